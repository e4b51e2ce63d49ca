//! Model shapes as data, and the byte arithmetic of one decode step.
//!
//! Presets live in `models.toml` (embedded at build time); nothing here touches a GPU.

use std::collections::BTreeMap;

use serde::Deserialize;

/// The presets shipped with tokwatt, as TOML: one table per model.
const PRESETS_TOML: &str = include_str!("models.toml");

/// Bytes per element of every weight, activation and cache entry (bf16).
pub const BYTES_PER_ELEMENT: u64 = 2;

/// Head sizes the attention kernel is compiled for.
pub const SUPPORTED_HEAD_DIMS: [u32; 2] = [64, 128];
/// Query heads per KV head the attention kernel is compiled for.
pub const SUPPORTED_GROUP_SIZES: [u32; 5] = [1, 2, 3, 4, 8];

/// Why a model shape could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ShapeError {
    #[error("unknown model '{name}': known models are {known}")]
    UnknownModel { name: String, known: String },
    #[error("the model table is not valid TOML for model shapes: {0}")]
    Parse(#[from] toml::de::Error),
    #[error("model '{model}' has an unsupported shape: {reason}")]
    Invalid { model: String, reason: String },
}

/// The shape of a Llama-style decoder: pre-norm blocks of grouped-query attention and a
/// SiLU-gated MLP, RMSNorm, RoPE, and an output head over the vocabulary.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    /// The preset's name (the TOML table name).
    #[serde(skip)]
    pub name: String,
    /// Width of the residual stream.
    pub hidden: u32,
    pub layers: u32,
    /// Query heads.
    pub heads: u32,
    /// Key/value heads (grouped-query attention: `heads` is a multiple of it).
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Width of the MLP's gate and up projections.
    pub mlp: u32,
    pub vocab: u32,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
}

fn default_rope_theta() -> f64 {
    500_000.0
}

fn default_norm_eps() -> f64 {
    1e-5
}

/// Parses a model table (TOML, one table per model) and validates every entry.
pub fn parse_presets(text: &str) -> Result<BTreeMap<String, ModelShape>, ShapeError> {
    let mut models: BTreeMap<String, ModelShape> = toml::from_str(text)?;
    for (name, shape) in &mut models {
        shape.name.clone_from(name);
        shape.validate()?;
    }
    Ok(models)
}

/// The shipped presets.
pub fn presets() -> Result<BTreeMap<String, ModelShape>, ShapeError> {
    parse_presets(PRESETS_TOML)
}

/// Names of the shipped presets, sorted.
pub fn preset_names() -> Vec<String> {
    presets()
        .map(|p| p.into_keys().collect())
        .unwrap_or_default()
}

impl ModelShape {
    /// A shipped preset by name, e.g. `llama-3-8b`.
    pub fn preset(name: &str) -> Result<ModelShape, ShapeError> {
        let mut all = presets()?;
        all.remove(name).ok_or_else(|| ShapeError::UnknownModel {
            name: name.to_owned(),
            known: all.keys().cloned().collect::<Vec<_>>().join(", "),
        })
    }

    /// Checks what the kernels rely on: every row a whole number of 16-byte vectors, whole
    /// query-head groups, and a head size and group size the attention kernel is built for.
    pub fn validate(&self) -> Result<(), ShapeError> {
        let invalid = |reason: String| ShapeError::Invalid {
            model: self.name.clone(),
            reason,
        };
        let positive = [
            ("hidden", self.hidden),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("mlp", self.mlp),
            ("vocab", self.vocab),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(invalid(format!("{field} must be at least 1")));
            }
        }
        for (field, value) in [
            ("hidden", self.hidden),
            ("mlp", self.mlp),
            ("vocab", self.vocab),
        ] {
            if !value.is_multiple_of(8) {
                return Err(invalid(format!(
                    "{field} = {value} is not a multiple of 8 (rows are read as 16-byte vectors)"
                )));
            }
        }
        if !SUPPORTED_HEAD_DIMS.contains(&self.head_dim) {
            return Err(invalid(format!(
                "head_dim = {} (supported: {SUPPORTED_HEAD_DIMS:?})",
                self.head_dim
            )));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(invalid(format!(
                "heads = {} is not a multiple of kv_heads = {}",
                self.heads, self.kv_heads
            )));
        }
        if !SUPPORTED_GROUP_SIZES.contains(&self.group_size()) {
            return Err(invalid(format!(
                "{} query heads per KV head (supported: {SUPPORTED_GROUP_SIZES:?})",
                self.group_size()
            )));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(invalid(format!(
                "rope_theta = {} must be above 1",
                self.rope_theta
            )));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return Err(invalid(format!(
                "norm_eps = {} must be positive",
                self.norm_eps
            )));
        }
        // Element counts are handed to kernels as 32-bit integers.
        let widest = u64::from(self.hidden).max(u64::from(self.mlp)) * 2;
        if widest > u64::from(i32::MAX as u32)
            || u64::from(self.qkv_dim()) > u64::from(i32::MAX as u32)
        {
            return Err(invalid("a dimension exceeds 2^31".to_owned()));
        }
        Ok(())
    }

    /// Query heads per KV head.
    pub fn group_size(&self) -> u32 {
        self.heads / self.kv_heads
    }

    /// Width of the concatenated query heads.
    pub fn q_dim(&self) -> u32 {
        self.heads * self.head_dim
    }

    /// Width of the key (or value) heads.
    pub fn kv_dim(&self) -> u32 {
        self.kv_heads * self.head_dim
    }

    /// Width of the fused QKV projection's output.
    pub fn qkv_dim(&self) -> u32 {
        self.q_dim() + 2 * self.kv_dim()
    }

    /// Parameters of one layer's four matrices (fused QKV, O, fused gate/up, down).
    pub fn layer_matrix_params(&self) -> u64 {
        let hidden = u64::from(self.hidden);
        let qkv = hidden * u64::from(self.qkv_dim());
        let o = u64::from(self.q_dim()) * hidden;
        let gate_up = hidden * 2 * u64::from(self.mlp);
        let down = u64::from(self.mlp) * hidden;
        qkv + o + gate_up + down
    }

    /// Parameters of one layer including its two norm weights.
    pub fn layer_params(&self) -> u64 {
        self.layer_matrix_params() + 2 * u64::from(self.hidden)
    }

    /// Parameters of the output head.
    pub fn lm_head_params(&self) -> u64 {
        u64::from(self.vocab) * u64::from(self.hidden)
    }

    /// Every parameter, the embedding table included.
    pub fn total_params(&self) -> u64 {
        u64::from(self.layers) * self.layer_params()
            + 2 * self.lm_head_params() // embedding table and output head
            + u64::from(self.hidden) // final norm
    }

    /// Bytes of all weights on the GPU.
    pub fn weight_bytes(&self) -> u64 {
        self.total_params() * BYTES_PER_ELEMENT
    }

    /// Weight bytes one decode step must read, whatever the batch: every matrix and norm once,
    /// the output head included; of the embedding table only one row per sequence, which is
    /// not counted.
    pub fn weight_bytes_per_step(&self) -> u64 {
        (u64::from(self.layers) * self.layer_params()
            + self.lm_head_params()
            + u64::from(self.hidden))
            * BYTES_PER_ELEMENT
    }

    /// Bytes of the KV cache for `batch` sequences of `context` positions (keys and values, all
    /// layers). A decode step attends over all of it, so this is also what one step reads.
    pub fn kv_cache_bytes(&self, batch: u32, context: u32) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(batch)
            * u64::from(context)
            * u64::from(self.kv_dim())
            * BYTES_PER_ELEMENT
    }

    /// Multiply-adds of one decode step's matrix products, times two (FLOPs), for `batch`.
    pub fn matmul_flops_per_step(&self, batch: u32) -> u64 {
        2 * u64::from(batch)
            * (u64::from(self.layers) * self.layer_matrix_params() + self.lm_head_params())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    fn llama_8b() -> ModelShape {
        ModelShape::preset("llama-3-8b").unwrap()
    }

    #[test]
    fn presets_parse_and_carry_their_names() {
        let all = presets().unwrap();
        assert!(all.contains_key("llama-3-8b"));
        assert!(all.contains_key("llama-3.2-1b"));
        for (name, shape) in &all {
            assert_eq!(&shape.name, name);
        }
        assert_eq!(preset_names().len(), all.len());
    }

    #[test]
    fn llama_3_8b_matches_its_published_shape() {
        let s = llama_8b();
        assert_eq!((s.hidden, s.layers, s.heads, s.kv_heads), (4096, 32, 32, 8));
        assert_eq!((s.head_dim, s.mlp, s.vocab), (128, 14336, 128_256));
        assert_eq!(s.group_size(), 4);
        assert_eq!(s.qkv_dim(), 6144);
    }

    #[test]
    fn llama_3_8b_step_reads_15_gb_of_weights() {
        // 7.50 B parameters without the embedding table (calibration README: 15.0 GB).
        let s = llama_8b();
        assert_eq!(s.layer_matrix_params(), 218_103_808);
        assert_eq!(s.lm_head_params(), 525_336_576);
        let bytes = s.weight_bytes_per_step();
        assert_eq!(
            bytes,
            (32 * (218_103_808 + 2 * 4096) + 525_336_576 + 4096) * 2
        );
        assert!((bytes as f64 / 1e9 - 15.01).abs() < 0.01, "{bytes}");
        // The embedding table is allocated but not read per step.
        assert_eq!(s.weight_bytes() - bytes, s.lm_head_params() * 2);
    }

    #[test]
    fn kv_cache_bytes_scale_with_batch_and_context() {
        let s = llama_8b();
        // One sequence, one position: keys and values of 8 heads of 128, 32 layers, bf16.
        assert_eq!(s.kv_cache_bytes(1, 1), 2 * 32 * 8 * 128 * 2);
        // The reference's largest point: batch 512 at context 1024 is 68.7 GB.
        assert_eq!(s.kv_cache_bytes(512, 1024), 68_719_476_736);
        assert_eq!(s.kv_cache_bytes(2, 3), 6 * s.kv_cache_bytes(1, 1));
    }

    #[test]
    fn matmul_flops_are_two_per_weight_per_sequence() {
        let s = llama_8b();
        let per_sequence = s.matmul_flops_per_step(1);
        assert_eq!(per_sequence, 2 * (32 * 218_103_808 + 525_336_576));
        assert_eq!(s.matmul_flops_per_step(512), 512 * per_sequence);
    }

    #[test]
    fn unknown_model_lists_the_known_ones() {
        let err = ModelShape::preset("gpt-2").unwrap_err().to_string();
        assert!(err.contains("unknown model 'gpt-2'"), "{err}");
        assert!(
            err.contains("llama-3-8b") && err.contains("llama-3.2-1b"),
            "{err}"
        );
    }

    #[test]
    fn a_user_table_is_parsed_with_defaults() {
        let text = "[tiny]\nhidden = 256\nlayers = 2\nheads = 4\nkv_heads = 2\nhead_dim = 64\nmlp = 512\nvocab = 1000\n";
        let models = parse_presets(text).unwrap();
        let tiny = &models["tiny"];
        assert_eq!(tiny.name, "tiny");
        assert_eq!(tiny.group_size(), 2);
        assert_eq!(tiny.rope_theta, 500_000.0);
        assert_eq!(tiny.norm_eps, 1e-5);
    }

    #[test]
    fn unknown_fields_are_refused() {
        let text = "[m]\nhidden = 256\nlayers = 2\nheads = 4\nkv_heads = 2\nhead_dim = 64\nmlp = 512\nvocab = 1000\nexperts = 8\n";
        let err = parse_presets(text).unwrap_err().to_string();
        assert!(err.contains("experts"), "{err}");
    }

    #[test]
    fn shapes_the_kernels_cannot_run_are_refused_with_the_reason() {
        let base = llama_8b();
        type Mutation = fn(&mut ModelShape);
        let cases: [(Mutation, &str); 6] = [
            (|s| s.hidden = 4100, "hidden = 4100 is not a multiple of 8"),
            (|s| s.head_dim = 96, "head_dim = 96"),
            (|s| s.kv_heads = 5, "not a multiple of kv_heads = 5"),
            (|s| s.heads = 80, "10 query heads per KV head"),
            (|s| s.layers = 0, "layers must be at least 1"),
            (|s| s.norm_eps = 0.0, "norm_eps"),
        ];
        for (mutate, expected) in cases {
            let mut shape = base.clone();
            mutate(&mut shape);
            let err = shape.validate().unwrap_err().to_string();
            assert!(err.contains(expected), "{err} should mention {expected}");
            assert!(err.contains("llama-3-8b"), "{err}");
        }
    }
}
