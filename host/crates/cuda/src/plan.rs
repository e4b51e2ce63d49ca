//! Pure planning for the decode engine: where each weight lives in the weight buffer, how
//! large each activation buffer is, how attention splits the context across thread blocks.
//! Nothing here touches a GPU, so all of it is unit-tested.

use super::shape::ModelShape;

/// Largest batch the small-batch matrix-vector kernels are compiled for.
pub const GEMV_MAX_BATCH: u32 = 8;

/// Largest context the attention kernel's split-merge scratch is planned for.
pub const MAX_CONTEXT: u32 = 1 << 18;

/// Largest batch: the attention grid puts the batch on its z dimension (at most 65535).
pub const MAX_BATCH: u32 = 8192;

/// Shared-memory budget (bytes) for one attention block's scores (`group * chunk` floats) and,
/// when splits merge, their maxima and sums (`2 * group * splits` floats). With the kernel's static shared
/// memory (at most ~22 KB) it stays under the 48 KB available without opting in to more.
pub const ATTENTION_SCORE_BYTES: u32 = 24 * 1024;

/// Fewest positions an attention block handles when the context is split.
pub const ATTENTION_MIN_CHUNK: u32 = 64;

/// Weight tensors are aligned to this many elements (256 bytes) in the weight buffer.
const WEIGHT_ALIGN: u64 = 128;

/// How one decode step's attention spreads over thread blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionSplit {
    /// Blocks per (sequence, KV head), each over `chunk` consecutive positions.
    pub splits: u32,
    pub chunk: u32,
}

impl AttentionSplit {
    /// Plans attention for `batch` sequences on a GPU of `sms` multiprocessors.
    ///
    /// Large batches give one block per (sequence, KV head) already; small ones split the
    /// context so that at least two blocks per multiprocessor stream the cache, but no block
    /// gets fewer than `ATTENTION_MIN_CHUNK` positions (each split costs a merge).
    pub fn plan(shape: &ModelShape, batch: u32, context: u32, sms: u32) -> AttentionSplit {
        let group = shape.group_size();
        let max_chunk = (ATTENTION_SCORE_BYTES / (4 * group)).max(1);
        let pairs = u64::from(batch.max(1)) * u64::from(shape.kv_heads);
        let wanted = (2 * u64::from(sms.max(1))).div_ceil(pairs);
        let fewest = context.div_ceil(max_chunk);
        let most = (context / ATTENTION_MIN_CHUNK).max(fewest).max(1);
        let splits = u32::try_from(wanted)
            .unwrap_or(u32::MAX)
            .clamp(fewest.max(1), most);
        let chunk = context.div_ceil(splits);
        // Rounding the chunk up can leave the last split empty: recount.
        AttentionSplit {
            splits: context.div_ceil(chunk),
            chunk,
        }
    }

    /// Dynamic shared memory for one attention block, bytes: the scores, or, in the block that
    /// merges the splits, their maxima and sums.
    pub fn shared_bytes(&self, group: u32) -> u32 {
        4 * group * self.chunk.max(2 * self.splits)
    }
}

/// Offsets (in elements) of one layer's tensors in the weight buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerOffsets {
    pub attn_norm: u64,
    /// Fused QKV, [qkv_dim, hidden].
    pub qkv: u64,
    /// [hidden, q_dim].
    pub o: u64,
    pub mlp_norm: u64,
    /// Gate rows then up rows, [2 * mlp, hidden].
    pub gate_up: u64,
    /// [hidden, mlp].
    pub down: u64,
}

/// Where every weight tensor lives in the single weight allocation (row-major, one row per
/// output feature).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightLayout {
    pub layers: Vec<LayerOffsets>,
    /// [vocab, hidden].
    pub embedding: u64,
    pub final_norm: u64,
    /// [vocab, hidden].
    pub lm_head: u64,
    /// Elements of the whole buffer, alignment padding included.
    pub total: u64,
    /// Each tensor as (offset, elements, kind), for initialisation.
    pub tensors: Vec<(u64, u64, TensorKind)>,
}

/// What a weight tensor holds, which decides its random initialisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorKind {
    /// A projection matrix.
    Matrix,
    /// An RMSNorm weight (values near 1; the engine folds each layer's into the projection
    /// after it and leaves exactly 1 in their place).
    Norm,
    /// The token embedding table.
    Embedding,
}

impl WeightLayout {
    pub fn new(shape: &ModelShape) -> WeightLayout {
        let hidden = u64::from(shape.hidden);
        let mut next = 0u64;
        let mut tensors = Vec::new();
        let mut place = |elements: u64, kind: TensorKind| {
            let offset = next;
            tensors.push((offset, elements, kind));
            next = (offset + elements).next_multiple_of(WEIGHT_ALIGN);
            offset
        };
        let layers = (0..shape.layers)
            .map(|_| LayerOffsets {
                attn_norm: place(hidden, TensorKind::Norm),
                qkv: place(u64::from(shape.qkv_dim()) * hidden, TensorKind::Matrix),
                o: place(hidden * u64::from(shape.q_dim()), TensorKind::Matrix),
                mlp_norm: place(hidden, TensorKind::Norm),
                gate_up: place(2 * u64::from(shape.mlp) * hidden, TensorKind::Matrix),
                down: place(hidden * u64::from(shape.mlp), TensorKind::Matrix),
            })
            .collect();
        let embedding = place(u64::from(shape.vocab) * hidden, TensorKind::Embedding);
        let final_norm = place(hidden, TensorKind::Norm);
        let lm_head = place(u64::from(shape.vocab) * hidden, TensorKind::Matrix);
        WeightLayout {
            layers,
            embedding,
            final_norm,
            lm_head,
            total: next,
            tensors,
        }
    }
}

/// Element counts of the activation buffers, sized once for `batch_max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferPlan {
    pub tokens: u64,
    /// Residual stream, [batch, hidden].
    pub x: u64,
    /// Normalised residual for the cuBLAS path, [batch, hidden].
    pub x_norm: u64,
    pub qkv: u64,
    /// Attention output, [batch, q_dim].
    pub attn: u64,
    /// Gate and up outputs for the cuBLAS path, [batch, 2 * mlp].
    pub gate_up: u64,
    /// SiLU-gated product, [batch, mlp].
    pub act: u64,
    pub logits: u64,
    /// Sums of squares of the residual for the fused norms: two sets of `batch`.
    pub sumsq: u64,
    /// Split-attention partial outputs (f32), enough for the worst batch size.
    pub attn_partial_out: u64,
    /// Split-attention partial max and sum (f32).
    pub attn_partial_stats: u64,
    /// Split-attention arrival counters, one per (sequence, KV head).
    pub attn_counters: u64,
}

impl BufferPlan {
    pub fn new(shape: &ModelShape, batch_max: u32, context: u32, sms: u32) -> BufferPlan {
        let b = u64::from(batch_max);
        let worst_partials = (1..=batch_max)
            .map(|batch| {
                let split = AttentionSplit::plan(shape, batch, context, sms);
                if split.splits > 1 {
                    u64::from(batch) * u64::from(shape.kv_heads) * u64::from(split.splits)
                } else {
                    0
                }
            })
            .max()
            .unwrap_or(0);
        let per_partial = u64::from(shape.group_size());
        BufferPlan {
            tokens: b,
            x: b * u64::from(shape.hidden),
            x_norm: b * u64::from(shape.hidden),
            qkv: b * u64::from(shape.qkv_dim()),
            attn: b * u64::from(shape.q_dim()),
            gate_up: b * 2 * u64::from(shape.mlp),
            act: b * u64::from(shape.mlp),
            logits: b * u64::from(shape.vocab),
            sumsq: 2 * b,
            attn_partial_out: (worst_partials * per_partial * u64::from(shape.head_dim)).max(1),
            attn_partial_stats: (worst_partials * per_partial * 2).max(1),
            attn_counters: b * u64::from(shape.kv_heads),
        }
    }

    /// Bytes of all activation buffers.
    pub fn bytes(&self) -> u64 {
        let bf16 =
            self.x + self.x_norm + self.qkv + self.attn + self.gate_up + self.act + self.logits;
        let four_bytes = self.tokens
            + self.sumsq
            + self.attn_partial_out
            + self.attn_partial_stats
            + self.attn_counters;
        2 * bf16 + 4 * four_bytes
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
    fn small_batches_split_the_context_and_large_ones_do_not() {
        let s = llama_8b();
        let one = AttentionSplit::plan(&s, 1, 1024, 132);
        // 8 KV heads need 33 splits for 264 blocks, but no chunk under 64 positions: 16.
        assert_eq!(
            one,
            AttentionSplit {
                splits: 16,
                chunk: 64
            }
        );
        let four = AttentionSplit::plan(&s, 4, 1024, 132);
        assert_eq!(four.splits, 9);
        assert!(four.chunk * four.splits >= 1024 && four.chunk * (four.splits - 1) < 1024);
        assert_eq!(AttentionSplit::plan(&s, 64, 1024, 132).splits, 1);
        assert_eq!(
            AttentionSplit::plan(&s, 512, 1024, 132),
            AttentionSplit {
                splits: 1,
                chunk: 1024
            }
        );
    }

    #[test]
    fn long_contexts_split_to_fit_the_score_buffer() {
        let s = llama_8b(); // 4 query heads per KV head: 1536 positions of scores fit
        let split = AttentionSplit::plan(&s, 512, 4096, 132);
        assert_eq!(split.splits, 3);
        assert!(split.shared_bytes(4) <= ATTENTION_SCORE_BYTES);
        for context in [1, 7, 63, 64, 65, 1000, 4096, 100_000, MAX_CONTEXT] {
            for batch in [1, 3, 64, 512] {
                let p = AttentionSplit::plan(&s, batch, context, 132);
                assert!(p.splits >= 1 && p.chunk >= 1, "{p:?}");
                assert!(
                    u64::from(p.splits) * u64::from(p.chunk) >= u64::from(context),
                    "{p:?}"
                );
                assert!(
                    (p.splits - 1) * p.chunk < context,
                    "empty split: {p:?} at {context}"
                );
                assert!(
                    p.shared_bytes(4) <= ATTENTION_SCORE_BYTES,
                    "{p:?} at {context}"
                );
            }
        }
    }

    #[test]
    fn every_plan_fits_the_shared_memory_budget() {
        for (heads, kv_heads) in [(8, 8), (8, 4), (24, 8), (32, 8), (64, 8), (8, 1)] {
            let mut s = llama_8b();
            s.heads = heads;
            s.kv_heads = kv_heads;
            for context in [1, 100, 1024, 4096, 65_536, MAX_CONTEXT] {
                for batch in [1, 2, 7, 64, 512, MAX_BATCH] {
                    let p = AttentionSplit::plan(&s, batch, context, 132);
                    let bytes = p.shared_bytes(s.group_size());
                    assert!(
                        bytes <= ATTENTION_SCORE_BYTES,
                        "{p:?}: {bytes} bytes, group {}",
                        s.group_size()
                    );
                }
            }
        }
    }

    #[test]
    fn weight_layout_places_every_tensor_once_and_aligned() {
        let s = llama_8b();
        let layout = WeightLayout::new(&s);
        assert_eq!(layout.layers.len(), 32);
        let placed: u64 = layout.tensors.iter().map(|t| t.1).sum();
        assert_eq!(placed, s.total_params());
        let mut previous_end = 0;
        for &(offset, elements, _) in &layout.tensors {
            assert_eq!(offset % WEIGHT_ALIGN, 0);
            assert!(offset >= previous_end, "tensors overlap");
            previous_end = offset + elements;
        }
        assert!(layout.total >= previous_end && layout.total - previous_end < WEIGHT_ALIGN);
        let l1 = layout.layers[1];
        assert_eq!(l1.qkv - l1.attn_norm, 4096);
        assert_eq!(l1.o - l1.qkv, 6144 * 4096);
        assert_eq!(layout.lm_head - layout.final_norm, 4096);
    }

    #[test]
    fn buffer_plan_sizes_follow_batch_max() {
        let s = llama_8b();
        let plan = BufferPlan::new(&s, 512, 1024, 132);
        assert_eq!(plan.x, 512 * 4096);
        assert_eq!(plan.qkv, 512 * 6144);
        assert_eq!(plan.gate_up, 512 * 2 * 14336);
        assert_eq!(plan.logits, 512 * 128_256);
        assert_eq!(plan.attn_counters, 512 * 8);
        // The largest split scratch over batches 1..=512: batch b uses b * 8 * splits(b) slots.
        let worst = (1..=512u32)
            .map(|b| {
                let p = AttentionSplit::plan(&s, b, 1024, 132);
                if p.splits > 1 {
                    u64::from(b) * 8 * u64::from(p.splits)
                } else {
                    0
                }
            })
            .max()
            .unwrap();
        assert_eq!(plan.attn_partial_out, worst * 4 * 128);
        assert_eq!(plan.attn_partial_stats, worst * 4 * 2);
        let bytes = plan.bytes();
        assert!(bytes > 2 * 512 * 128_256 && bytes < 300_000_000, "{bytes}");
    }
}
