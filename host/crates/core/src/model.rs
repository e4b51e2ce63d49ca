//! Model shapes as data: the one description of a decoder that the simulator and the CUDA
//! workload share, and the byte and FLOP arithmetic of one decode step.
//!
//! Presets live in `host/models/models.toml` (embedded at build time). A user's own shape is a
//! TOML file with the same fields at its top level; [`ModelShape::load`] takes either a
//! preset's name or such a file's path. Nothing here knows a backend: the CUDA workload adds
//! the checks its kernels need (`cuda::shape`), the simulator turns a shape into a step cost.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The presets shipped with tokwatt, as TOML: one table per model.
const PRESETS_TOML: &str = include_str!("../../../models/models.toml");

/// Bytes per weight, activation and KV-cache element (bf16).
pub const BYTES_PER_PARAM: u64 = 2;

/// Attention width (`heads × head_dim`) and `hidden` may differ by at most this factor either
/// way. Llama models have them equal; other families differ by up to 2× (Qwen3-0.6B: 16 × 128
/// heads over a hidden size of 1024). Beyond 4× a shape is almost surely a typo (a head
/// size given as the whole width).
const ATTENTION_WIDTH_FACTOR: u64 = 4;

/// Share of a device's memory held back from weights and KV cache: the CUDA context (~0.5 GB),
/// activation and logit buffers, cuBLAS workspaces, CUDA graphs and allocator slack. Serving
/// engines hold back about as much (vLLM's default `gpu_memory_utilization` is 0.9).
pub const MEMORY_RESERVE_FRACTION: f64 = 0.10;

/// A model that does not fit a device's memory at all.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MemoryFitError {
    #[error(
        "model '{model}' does not fit in {device_gb:.1} GB of device memory: its weights need \
         {weights_gb:.1} GB and {usable_gb:.1} GB is usable (10 % is held back for the CUDA \
         context and activations)"
    )]
    WeightsTooLarge {
        model: String,
        weights_gb: f64,
        device_gb: f64,
        usable_gb: f64,
    },
    #[error(
        "model '{model}' fits in {device_gb:.1} GB of device memory, but not one sequence of \
         {context} positions besides it: the KV cache needs {kv_gb_per_sequence:.2} GB per \
         sequence and {left_gb:.2} GB is left after the weights ({weights_gb:.1} GB)"
    )]
    NoSequenceFits {
        model: String,
        context: u32,
        kv_gb_per_sequence: f64,
        weights_gb: f64,
        left_gb: f64,
        device_gb: f64,
    },
}

/// The largest batch of `context`-position sequences whose KV cache fits beside the model's
/// bf16 weights in `device_bytes` of memory, after [`MEMORY_RESERVE_FRACTION`]. The one rule
/// the simulator and the CUDA workload share.
pub fn max_batch_that_fits(
    shape: &ModelShape,
    context: u32,
    device_bytes: u64,
) -> Result<u32, MemoryFitError> {
    let gb = |bytes: f64| bytes / 1e9;
    let usable = device_bytes as f64 * (1.0 - MEMORY_RESERVE_FRACTION);
    let weights = shape.weight_bytes() as f64;
    if weights > usable {
        return Err(MemoryFitError::WeightsTooLarge {
            model: shape.name.clone(),
            weights_gb: gb(weights),
            device_gb: gb(device_bytes as f64),
            usable_gb: gb(usable),
        });
    }
    let per_sequence = shape.kv_cache_bytes(1, context).max(1) as f64;
    let batch = ((usable - weights) / per_sequence).floor();
    if batch < 1.0 {
        return Err(MemoryFitError::NoSequenceFits {
            model: shape.name.clone(),
            context,
            kv_gb_per_sequence: gb(per_sequence),
            weights_gb: gb(weights),
            left_gb: gb(usable - weights),
            device_gb: gb(device_bytes as f64),
        });
    }
    Ok(batch.min(f64::from(u32::MAX)) as u32)
}

/// Why a model shape could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("file not found: {}", path.display())]
    FileNotFound { path: PathBuf },
    #[error("cannot read model file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "unknown model '{name}': known models are {known}; or give the path of a TOML file with the shape"
    )]
    UnknownPreset { name: String, known: String },
    #[error("{origin} is not a valid model shape: {message}")]
    Parse { origin: String, message: String },
    #[error("model '{model}': {problem}")]
    Invalid {
        model: String,
        /// The field at fault, as spelled in the file.
        field: &'static str,
        problem: String,
    },
}

/// The shape of a Llama-style decoder: pre-norm blocks of grouped-query attention and a
/// SiLU-gated MLP, RMSNorm, RoPE, and an output head over the vocabulary.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    /// The preset's name (its TOML table), or a user file's stem.
    #[serde(skip)]
    pub name: String,
    /// Width of the residual stream.
    pub hidden: u32,
    pub layers: u32,
    /// Query heads.
    pub heads: u32,
    /// Key/value heads (grouped-query attention: `heads` is a multiple of it).
    pub kv_heads: u32,
    /// Size of one attention head. A field, not `hidden / heads`: some models differ.
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
pub fn parse_presets(text: &str) -> Result<BTreeMap<String, ModelShape>, ModelError> {
    let mut models: BTreeMap<String, ModelShape> =
        toml::from_str(text).map_err(|e| ModelError::Parse {
            origin: "the model table".to_owned(),
            message: e.to_string(),
        })?;
    for (name, shape) in &mut models {
        shape.name.clone_from(name);
        shape.validate()?;
    }
    Ok(models)
}

/// The shipped presets.
pub fn presets() -> Result<BTreeMap<String, ModelShape>, ModelError> {
    parse_presets(PRESETS_TOML)
}

/// Names of the shipped presets, sorted.
pub fn preset_names() -> Vec<String> {
    presets()
        .map(|p| p.into_keys().collect())
        .unwrap_or_default()
}

/// Whether `arg` names a file rather than a preset: it has a folder in it or ends in `.toml`.
fn looks_like_path(arg: &str) -> bool {
    arg.contains('/') || arg.contains(std::path::MAIN_SEPARATOR) || arg.ends_with(".toml")
}

impl ModelShape {
    /// A shipped preset's name (`llama-3-8b`) or the path of a TOML file holding one shape.
    /// An argument with a folder in it or ending in `.toml` is always a path; otherwise a
    /// preset of that name comes first, then a file of that name.
    pub fn load(name_or_path: &str) -> Result<ModelShape, ModelError> {
        if looks_like_path(name_or_path) {
            return Self::from_file(Path::new(name_or_path));
        }
        match Self::preset(name_or_path) {
            Err(ModelError::UnknownPreset { .. }) if Path::new(name_or_path).is_file() => {
                Self::from_file(Path::new(name_or_path))
            }
            other => other,
        }
    }

    /// A shipped preset by name, e.g. `llama-3-8b`.
    pub fn preset(name: &str) -> Result<ModelShape, ModelError> {
        let mut all = presets()?;
        all.remove(name).ok_or_else(|| ModelError::UnknownPreset {
            name: name.to_owned(),
            known: all.keys().cloned().collect::<Vec<_>>().join(", "),
        })
    }

    /// A shape from a TOML file with the fields at its top level, named after the file's stem.
    pub fn from_file(path: &Path) -> Result<ModelShape, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                ModelError::FileNotFound {
                    path: path.to_path_buf(),
                }
            } else {
                ModelError::Read {
                    path: path.to_path_buf(),
                    source,
                }
            }
        })?;
        let mut shape: ModelShape = toml::from_str(&text).map_err(|e| ModelError::Parse {
            origin: path.display().to_string(),
            message: e.to_string(),
        })?;
        shape.name = path
            .file_stem()
            .map_or_else(|| "custom".to_owned(), |s| s.to_string_lossy().into_owned());
        shape.validate()?;
        Ok(shape)
    }

    /// Checks what every backend relies on; the error names the field. Backends add their own
    /// limits (the CUDA kernels' head sizes, for one).
    pub fn validate(&self) -> Result<(), ModelError> {
        let invalid = |field: &'static str, problem: String| ModelError::Invalid {
            model: self.name.clone(),
            field,
            problem,
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
                return Err(invalid(field, format!("{field} must be at least 1")));
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(invalid(
                "kv_heads",
                format!(
                    "heads = {} is not a multiple of kv_heads = {}",
                    self.heads, self.kv_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(invalid(
                "head_dim",
                format!(
                    "head_dim = {} must be even (RoPE rotates pairs)",
                    self.head_dim
                ),
            ));
        }
        let (width, hidden) = (u64::from(self.q_dim()), u64::from(self.hidden));
        if width > ATTENTION_WIDTH_FACTOR * hidden || width * ATTENTION_WIDTH_FACTOR < hidden {
            return Err(invalid(
                "head_dim",
                format!(
                    "heads × head_dim = {} × {} = {width} is not within a factor of \
                     {ATTENTION_WIDTH_FACTOR} of hidden = {hidden} (head_dim is the size of one head)",
                    self.heads, self.head_dim
                ),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(invalid(
                "rope_theta",
                format!("rope_theta = {} must be above 1", self.rope_theta),
            ));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return Err(invalid(
                "norm_eps",
                format!("norm_eps = {} must be positive", self.norm_eps),
            ));
        }
        if self.checked_total_params().is_none() {
            return Err(invalid(
                "layers",
                "the parameter count overflows 64 bits".to_owned(),
            ));
        }
        Ok(())
    }

    /// Query heads per KV head.
    pub fn group_size(&self) -> u32 {
        self.heads / self.kv_heads
    }

    /// Width of the concatenated query heads (`heads × head_dim`).
    pub fn q_dim(&self) -> u32 {
        self.heads.saturating_mul(self.head_dim)
    }

    /// Width of the key (or value) heads.
    pub fn kv_dim(&self) -> u32 {
        self.kv_heads.saturating_mul(self.head_dim)
    }

    /// Width of the fused QKV projection's output.
    pub fn qkv_dim(&self) -> u32 {
        self.q_dim().saturating_add(self.kv_dim().saturating_mul(2))
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

    fn checked_total_params(&self) -> Option<u64> {
        u64::from(self.layers)
            .checked_mul(self.layer_params())?
            .checked_add(self.lm_head_params().checked_mul(2)?)?
            .checked_add(u64::from(self.hidden))?
            .checked_mul(BYTES_PER_PARAM)
            .map(|bytes| bytes / BYTES_PER_PARAM)
    }

    /// Every parameter, the embedding table included.
    pub fn total_params(&self) -> u64 {
        self.checked_total_params()
            .unwrap_or(u64::MAX / BYTES_PER_PARAM)
    }

    /// Bytes of all weights.
    pub fn weight_bytes(&self) -> u64 {
        self.total_params() * BYTES_PER_PARAM
    }

    /// Matrix parameters one decode step reads, whatever the batch: every projection and the
    /// output head; of the embedding table only one row per sequence, which is not counted.
    pub fn params_read_per_step(&self) -> u64 {
        u64::from(self.layers) * self.layer_matrix_params() + self.lm_head_params()
    }

    /// Weight bytes one decode step reads: [`ModelShape::params_read_per_step`] and the norms'
    /// weights.
    pub fn weight_bytes_per_step(&self) -> u64 {
        (u64::from(self.layers) * self.layer_params()
            + self.lm_head_params()
            + u64::from(self.hidden))
            * BYTES_PER_PARAM
    }

    /// Bytes of the KV cache for `batch` sequences of `context` positions (keys and values, all
    /// layers). A decode step attends over all of it, so this is also what one step reads.
    pub fn kv_cache_bytes(&self, batch: u32, context: u32) -> u64 {
        [
            2,
            u64::from(self.layers),
            u64::from(batch),
            u64::from(context),
            u64::from(self.kv_dim()),
            BYTES_PER_PARAM,
        ]
        .into_iter()
        .fold(1u64, u64::saturating_mul)
    }

    /// Multiply-adds of one decode step's matrix products, times two (FLOPs), for `batch`.
    pub fn matmul_flops_per_step(&self, batch: u32) -> u64 {
        2 * u64::from(batch) * self.params_read_per_step()
    }

    /// FLOPs of attention for one sequence attending over `context` positions: scores and the
    /// weighted sum of values, a multiply-add each per query dimension and position, every layer.
    pub fn attention_flops_per_token(&self, context: u32) -> u64 {
        4 * u64::from(self.layers) * u64::from(self.q_dim()) * u64::from(context)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    fn llama_8b() -> ModelShape {
        ModelShape::preset("llama-3-8b").unwrap()
    }

    const TINY: &str = "hidden = 256\nlayers = 2\nheads = 4\nkv_heads = 2\nhead_dim = 64\nmlp = 512\nvocab = 1000\n";

    #[test]
    fn presets_parse_and_carry_their_names() {
        let all = presets().unwrap();
        for name in [
            "llama-3-8b",
            "llama-3.2-1b",
            "llama-3.2-3b",
            "llama-3.1-70b",
        ] {
            assert!(all.contains_key(name), "{name}");
        }
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
        assert_eq!(s.params_read_per_step(), 32 * 218_103_808 + 525_336_576);
        let bytes = s.weight_bytes_per_step();
        assert_eq!(
            bytes,
            (32 * (218_103_808 + 2 * 4096) + 525_336_576 + 4096) * 2
        );
        assert!((bytes as f64 / 1e9 - 15.01).abs() < 0.01, "{bytes}");
        // The embedding table is allocated but not read per step.
        assert_eq!(s.weight_bytes() - bytes, s.lm_head_params() * 2);
        let small = ModelShape::preset("llama-3.2-1b").unwrap();
        assert!((small.params_read_per_step() as f64 / 1e9 - 1.236).abs() < 0.001);
    }

    #[test]
    fn the_largest_batch_that_fits_leaves_the_reserve_free() {
        let shape = llama_8b();
        let h200 = 141_000_000_000;
        let batch = max_batch_that_fits(&shape, 1024, h200).unwrap();
        let used = |b: u32| shape.weight_bytes() + shape.kv_cache_bytes(b, 1024);
        let usable = (h200 as f64 * (1.0 - MEMORY_RESERVE_FRACTION)) as u64;
        assert!(used(batch) <= usable && used(batch + 1) > usable);
        // 126.9 GB usable - 16.1 GB of weights = 110.8 GB of 134 MB sequences: 825.
        assert_eq!(batch, 825);
        // A longer context fits fewer sequences; 80 GB fits fewer than 512 at 1024.
        assert!(max_batch_that_fits(&shape, 4096, h200).unwrap() < batch / 3);
        assert!(max_batch_that_fits(&shape, 1024, 80_000_000_000).unwrap() < 512);
    }

    #[test]
    fn a_model_too_large_for_the_device_names_both_sizes() {
        let err = max_batch_that_fits(&llama_8b(), 1024, 16_000_000_000).unwrap_err();
        assert!(
            matches!(err, MemoryFitError::WeightsTooLarge { .. }),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("16.0 GB of device memory") && text.contains("weights need 16.1 GB"),
            "{text}"
        );
        // The weights fit, one sequence of a huge context does not.
        let err = max_batch_that_fits(&llama_8b(), 1 << 20, 40_000_000_000).unwrap_err();
        assert!(
            matches!(err, MemoryFitError::NoSequenceFits { .. }),
            "{err}"
        );
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
        assert_eq!(s.attention_flops_per_token(1024), 4 * 32 * 4096 * 1024);
    }

    #[test]
    fn a_user_preset_file_loads_with_defaults_and_its_stem_as_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.toml");
        std::fs::write(&path, TINY).unwrap();
        let tiny = ModelShape::load(path.to_str().unwrap()).unwrap();
        assert_eq!(tiny.name, "tiny");
        assert_eq!(
            (tiny.hidden, tiny.head_dim, tiny.group_size()),
            (256, 64, 2)
        );
        assert_eq!(tiny.rope_theta, 500_000.0);
        assert_eq!(tiny.norm_eps, 1e-5);
        // A preset name still finds the preset.
        assert_eq!(ModelShape::load("llama-3-8b").unwrap(), llama_8b());
    }

    #[test]
    fn head_dim_is_a_field_not_hidden_over_heads() {
        // Qwen3-0.6B's attention: 16 heads of 128 over a residual stream of 1024.
        let text = "[wide]\nhidden = 1024\nlayers = 28\nheads = 16\nkv_heads = 8\nhead_dim = 128\nmlp = 3072\nvocab = 151936\n";
        let wide = parse_presets(text).unwrap().remove("wide").unwrap();
        assert_eq!(wide.head_dim, 128);
        assert_eq!(wide.q_dim(), 2048);
        assert_eq!(wide.kv_dim(), 1024);
        // O maps the 2048-wide attention output back to the 1024-wide stream.
        assert_eq!(
            wide.layer_matrix_params(),
            1024 * (2048 + 2 * 1024) + 2048 * 1024 + 3 * 1024 * 3072
        );
        let missing =
            "[m]\nhidden = 256\nlayers = 2\nheads = 4\nkv_heads = 2\nmlp = 512\nvocab = 1000\n";
        let err = parse_presets(missing).unwrap_err().to_string();
        assert!(err.contains("head_dim"), "{err}");
    }

    #[test]
    fn nonsense_shapes_are_refused_naming_the_field() {
        type Mutation = fn(&mut ModelShape);
        let cases: [(Mutation, &str, &str); 7] = [
            (|s| s.head_dim = 4096, "head_dim", "32 × 4096 = 131072"),
            (|s| s.head_dim = 16, "head_dim", "within a factor of 4"),
            (
                |s| s.head_dim = 127,
                "head_dim",
                "head_dim = 127 must be even",
            ),
            (
                |s| s.head_dim = 0,
                "head_dim",
                "head_dim must be at least 1",
            ),
            (
                |s| s.kv_heads = 5,
                "kv_heads",
                "not a multiple of kv_heads = 5",
            ),
            (|s| s.layers = 0, "layers", "layers must be at least 1"),
            (|s| s.norm_eps = 0.0, "norm_eps", "norm_eps = 0"),
        ];
        for (mutate, field, expected) in cases {
            let mut shape = llama_8b();
            mutate(&mut shape);
            let err = shape.validate().unwrap_err();
            let ModelError::Invalid { field: named, .. } = &err else {
                panic!("{err}")
            };
            assert_eq!(*named, field, "{err}");
            let text = err.to_string();
            assert!(text.contains(expected), "{text} should mention {expected}");
            assert!(text.starts_with("model 'llama-3-8b': "), "{text}");
        }
    }

    #[test]
    fn a_missing_file_and_an_unknown_name_say_which_they_are() {
        let err = ModelShape::load("no/such/model.toml")
            .unwrap_err()
            .to_string();
        assert_eq!(err, "file not found: no/such/model.toml");
        let err = ModelShape::load("missing.toml").unwrap_err().to_string();
        assert_eq!(err, "file not found: missing.toml");
        let err = ModelShape::load("gpt-2").unwrap_err().to_string();
        assert!(err.contains("unknown model 'gpt-2'"), "{err}");
        assert!(
            err.contains("llama-3-8b") && err.contains("llama-3.2-1b"),
            "{err}"
        );
    }

    #[test]
    fn a_bad_user_file_names_itself_and_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("moe.toml");
        std::fs::write(&path, format!("{TINY}experts = 8\n")).unwrap();
        let err = ModelShape::load(path.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("moe.toml") && err.contains("experts"), "{err}");
        std::fs::write(&path, TINY.replace("kv_heads = 2", "kv_heads = 3")).unwrap();
        let err = ModelShape::load(path.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("model 'moe': "), "{err}");
    }
}
