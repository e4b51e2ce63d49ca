//! One decode step's launches: embedding, every layer on the matrix-vector kernels or cuBLAS,
//! attention, the output head and greedy argmax.

use super::{Addrs, Engine, MatmulPath, StepVariant};
use crate::device::{Arg, AttentionImpl, GEMV_ROWS_PER_BLOCK, GEMV_THREADS, GemvMode, Gpu, int};
use crate::error::CudaError;
use crate::plan::{AttentionSplit, GEMV_MAX_BATCH};
use crate::shape::{BYTES_PER_ELEMENT, ModelShape};

impl Engine {
    /// Enqueues one decode step for `batch` sequences on the stream (no graph).
    pub(super) fn enqueue_step(
        &self,
        batch: u32,
        variant: StepVariant,
        split: AttentionSplit,
    ) -> Result<(), CudaError> {
        let path = variant.path;
        let attention = variant.attention;
        let s = &self.shape;
        let a = self.addrs();
        let w = self.gpu.addr(&self.weights, 0);
        let wt = |offset: u64| w + offset * BYTES_PER_ELEMENT;
        let (hidden, mlp, vocab) = (s.hidden, s.mlp, s.vocab);
        let (qkv_dim, q_dim) = (s.qkv_dim(), s.q_dim());
        let eps = s.norm_eps as f32;

        self.gpu.launch(
            &self.gpu.kernels.embed,
            (batch, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(a.tokens),
                Arg::Ptr(wt(self.layout.embedding)),
                Arg::Ptr(a.x),
                Arg::Ptr(a.sumsq_attn),
                int(hidden, "hidden")?,
                int(vocab, "vocab")?,
            ],
        )?;
        for (layer, offsets) in self.layout.layers.iter().enumerate() {
            match path {
                MatmulPath::Gemv => {
                    let qkv = GemvCall::new(wt(offsets.qkv), a.x, qkv_dim, hidden)
                        .norm(wt(offsets.attn_norm), a.sumsq_attn, a.sumsq_mlp)
                        .output(a.qkv, qkv_dim);
                    self.gemv(GemvMode::NormStore, batch, qkv, eps)?;
                    self.attention(batch, layer, split, attention, &a, 0)?;
                    let o = GemvCall::new(wt(offsets.o), a.attn, hidden, q_dim)
                        .output(a.x, hidden)
                        .accumulate_sumsq(a.sumsq_mlp);
                    self.gemv(GemvMode::Residual, batch, o, eps)?;
                    let gate_up = GemvCall::new(wt(offsets.gate_up), a.x, mlp, hidden)
                        .norm(wt(offsets.mlp_norm), a.sumsq_mlp, a.sumsq_attn)
                        .output(a.act, mlp);
                    self.gemv(GemvMode::NormSilu, batch, gate_up, eps)?;
                    let down = GemvCall::new(wt(offsets.down), a.act, hidden, mlp)
                        .output(a.x, hidden)
                        .accumulate_sumsq(a.sumsq_attn);
                    self.gemv(GemvMode::Residual, batch, down, eps)?;
                }
                MatmulPath::Cublas => {
                    // The norms' weights are folded into QKV and gate/up, which read the raw
                    // residual stream; attention and SiLU·mul apply the norms' factors.
                    self.gpu.gemm(
                        qkv_dim,
                        batch,
                        hidden,
                        wt(offsets.qkv),
                        a.x,
                        hidden,
                        a.qkv,
                        qkv_dim,
                        false,
                    )?;
                    self.attention(batch, layer, split, attention, &a, a.x)?;
                    self.gpu.gemm(
                        hidden,
                        batch,
                        q_dim,
                        wt(offsets.o),
                        a.attn,
                        q_dim,
                        a.x,
                        hidden,
                        true,
                    )?;
                    self.gpu.gemm(
                        2 * mlp,
                        batch,
                        hidden,
                        wt(offsets.gate_up),
                        a.x,
                        hidden,
                        a.gate_up,
                        2 * mlp,
                        false,
                    )?;
                    self.gpu.launch(
                        &self.gpu.kernels.silu_mul,
                        (grid_for(u64::from(mlp / 8), 256)?, batch, 1),
                        256,
                        0,
                        &[
                            Arg::Ptr(a.gate_up),
                            Arg::Ptr(a.act),
                            int(mlp, "mlp")?,
                            Arg::Ptr(a.x),
                            int(hidden, "hidden")?,
                            Arg::F32(eps),
                        ],
                    )?;
                    self.gpu.gemm(
                        hidden,
                        batch,
                        mlp,
                        wt(offsets.down),
                        a.act,
                        mlp,
                        a.x,
                        hidden,
                        true,
                    )?;
                }
            }
        }
        match path {
            MatmulPath::Gemv => {
                let head = GemvCall::new(wt(self.layout.lm_head), a.x, vocab, hidden)
                    .norm(wt(self.layout.final_norm), a.sumsq_attn, 0)
                    .output(a.logits, vocab);
                self.gemv(GemvMode::NormStore, batch, head, eps)?;
            }
            MatmulPath::Cublas => {
                self.rmsnorm(batch, a.x, wt(self.layout.final_norm), a.x_norm)?;
                self.gpu.gemm(
                    vocab,
                    batch,
                    hidden,
                    wt(self.layout.lm_head),
                    a.x_norm,
                    hidden,
                    a.logits,
                    vocab,
                    false,
                )?;
            }
        }
        self.gpu.launch(
            &self.gpu.kernels.argmax,
            (batch, 1, 1),
            1024,
            0,
            &[Arg::Ptr(a.logits), int(vocab, "vocab")?, Arg::Ptr(a.tokens)],
        )
    }

    pub(super) fn gemv(
        &self,
        mode: GemvMode,
        batch: u32,
        call: GemvCall,
        eps: f32,
    ) -> Result<(), CudaError> {
        let kernel = self.gpu.kernels.gemv(mode, batch).ok_or_else(|| {
            CudaError::Config(format!(
                "no matrix-vector kernel for batch {batch} (at most {GEMV_MAX_BATCH})"
            ))
        })?;
        self.gpu.launch(
            kernel,
            (call.rows.div_ceil(GEMV_ROWS_PER_BLOCK), 1, 1),
            GEMV_THREADS,
            0,
            &[
                Arg::Ptr(call.weights),
                Arg::Ptr(call.input),
                Arg::Ptr(call.gamma),
                Arg::Ptr(call.sumsq_in),
                Arg::Ptr(call.zero_out),
                Arg::Ptr(call.out),
                Arg::Ptr(call.sumsq_out),
                int(call.rows, "rows")?,
                int(call.cols, "columns")?,
                int(call.cols, "input stride")?,
                int(call.out_stride, "output stride")?,
                Arg::F32(eps),
            ],
        )
    }

    pub(super) fn rmsnorm(
        &self,
        batch: u32,
        x: u64,
        gamma: u64,
        out: u64,
    ) -> Result<(), CudaError> {
        self.gpu.launch(
            &self.gpu.kernels.rmsnorm,
            (batch, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(x),
                Arg::Ptr(gamma),
                Arg::Ptr(out),
                int(self.shape.hidden, "hidden")?,
                Arg::F32(self.shape.norm_eps as f32),
            ],
        )
    }

    pub(super) fn attention(
        &self,
        batch: u32,
        layer: usize,
        split: AttentionSplit,
        implementation: AttentionImpl,
        a: &Addrs,
        norm_of: u64,
    ) -> Result<(), CudaError> {
        let s = &self.shape;
        let kernel = self
            .gpu
            .kernels
            .attention(s.head_dim, s.group_size(), implementation)
            .ok_or_else(|| {
                CudaError::Config(format!(
                    "no {} attention kernel for head_dim {} and group {}",
                    implementation.name(),
                    s.head_dim,
                    s.group_size()
                ))
            })?;
        let (Some(k), Some(v)) = (self.k_cache.get(layer), self.v_cache.get(layer)) else {
            return Err(CudaError::Config(format!("layer {layer} has no KV cache")));
        };
        launch_attention(
            &self.gpu,
            kernel,
            s,
            AttentionArgs {
                batch,
                qkv: a.qkv,
                k_cache: self.gpu.addr(k, 0),
                v_cache: self.gpu.addr(v, 0),
                context: self.context,
                out: a.attn,
                part_o: a.part_o,
                part_ml: a.part_ml,
                counters: a.counters,
                split,
                norm_of,
            },
        )
    }

    /// Runs one step of `batch` on `path` without a graph and waits for it.
    #[cfg(test)]
    pub(crate) fn step_eager(&mut self, batch: u32, path: MatmulPath) -> Result<(), CudaError> {
        self.check_batch(batch)?;
        self.settle()?;
        let split = AttentionSplit::plan(&self.shape, batch, self.context, self.gpu.sms);
        let variant = StepVariant {
            path,
            attention: AttentionImpl::CudaCores,
        };
        self.gpu.bind()?;
        self.enqueue_step(batch, variant, split)?;
        self.gpu.synchronize()
    }
}

/// One matrix-vector call; unused pointers stay 0.
#[derive(Debug, Clone, Copy)]
pub(super) struct GemvCall {
    weights: u64,
    input: u64,
    rows: u32,
    cols: u32,
    gamma: u64,
    sumsq_in: u64,
    zero_out: u64,
    out: u64,
    out_stride: u32,
    sumsq_out: u64,
}

impl GemvCall {
    pub(super) fn new(weights: u64, input: u64, rows: u32, cols: u32) -> GemvCall {
        GemvCall {
            weights,
            input,
            rows,
            cols,
            gamma: 0,
            sumsq_in: 0,
            zero_out: 0,
            out: 0,
            out_stride: 0,
            sumsq_out: 0,
        }
    }

    /// RMSNorm the input with `gamma` and the sums of squares in `sumsq_in`; zero `zero_out`.
    pub(super) fn norm(self, gamma: u64, sumsq_in: u64, zero_out: u64) -> GemvCall {
        GemvCall {
            gamma,
            sumsq_in,
            zero_out,
            ..self
        }
    }

    pub(super) fn output(self, out: u64, out_stride: u32) -> GemvCall {
        GemvCall {
            out,
            out_stride,
            ..self
        }
    }

    pub(super) fn accumulate_sumsq(self, sumsq_out: u64) -> GemvCall {
        GemvCall { sumsq_out, ..self }
    }
}

/// Arguments of one attention launch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionArgs {
    pub batch: u32,
    pub qkv: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub context: u32,
    pub out: u64,
    pub part_o: u64,
    pub part_ml: u64,
    pub counters: u64,
    pub split: AttentionSplit,
    /// The residual stream whose RMSNorm factor scales q, k and v (the norm's weights folded
    /// into the QKV projection), or 0 when the QKV input was normalised already.
    pub norm_of: u64,
}

/// Launches decode attention: the new token at position `context - 1`.
pub(crate) fn launch_attention(
    gpu: &Gpu,
    kernel: &cudarc::driver::CudaFunction,
    shape: &ModelShape,
    args: AttentionArgs,
) -> Result<(), CudaError> {
    let split = args.split;
    let shared = split.shared_bytes(shape.group_size());
    if shared > gpu.attention_shared_limit() {
        return Err(CudaError::Config(format!(
            "attention split {split:?} does not fit shared memory"
        )));
    }
    let q_scale = std::f32::consts::LOG2_E / (shape.head_dim as f32).sqrt();
    let grid = (split.splits, shape.kv_heads, args.batch);
    let threads = gpu.attention_threads();
    // The splits of a (sequence, KV head) merge through the shared memory of one cluster
    // where the GPU has clusters and one fits; otherwise through L2 with an arrival counter.
    let cluster = (MIN_CLUSTER_SPLITS..=MAX_CLUSTER_SPLITS).contains(&split.splits)
        && gpu.cluster_fits(kernel, grid, threads, shared, split.splits);
    let launch_args = [
        Arg::Ptr(args.qkv),
        int(shape.qkv_dim(), "qkv width")?,
        int(shape.heads, "heads")?,
        int(shape.kv_heads, "kv heads")?,
        Arg::Ptr(args.k_cache),
        Arg::Ptr(args.v_cache),
        int(args.context, "context")?,
        int(args.context - 1, "position")?,
        int(split.chunk, "chunk")?,
        int(split.splits, "splits")?,
        Arg::Ptr(args.out),
        Arg::Ptr(args.part_o),
        Arg::Ptr(args.part_ml),
        Arg::Ptr(args.counters),
        Arg::F32(q_scale),
        Arg::F32(shape.rope_theta.log2() as f32),
        Arg::Ptr(args.norm_of),
        int(shape.hidden, "hidden")?,
        Arg::F32(shape.norm_eps as f32),
        Arg::I32(i32::from(cluster)),
    ];
    if cluster {
        gpu.launch_in_clusters(kernel, grid, threads, shared, &launch_args, split.splits)
    } else {
        gpu.launch(kernel, grid, threads, shared, &launch_args)
    }
}

/// Fewest splits merged inside a cluster. On the H200 (llama-3-8b, context 1024) the cluster
/// merge made the step 3.5 % faster at batch 1 (16 splits) and 0.9 % at batch 4 (9), and
/// 0.35 % slower at batch 16 (3 splits, where the merge through L2 is short anyway).
const MIN_CLUSTER_SPLITS: u32 = 8;

/// Most splits merged inside one thread block cluster (the kernel's `MAX_RANKS`; 16 is the
/// largest cluster Hopper allows, with the non-portable size opted in).
const MAX_CLUSTER_SPLITS: u32 = 16;

/// Blocks of `threads` covering `items`.
fn grid_for(items: u64, threads: u32) -> Result<u32, CudaError> {
    u32::try_from(items.div_ceil(u64::from(threads)).max(1))
        .map_err(|_| CudaError::Config(format!("{items} items exceed one launch")))
}
