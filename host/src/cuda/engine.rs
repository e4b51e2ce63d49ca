//! The decode engine: random bf16 weights and KV cache on one GPU, one decode step as a
//! sequence of kernels and cuBLAS GEMMs, captured into a CUDA graph per batch size.
//!
//! Every buffer is allocated once, for `batch_max` sequences, so a batch change never
//! reallocates: the graph of a batch size simply uses the first `batch` rows. Each step embeds
//! the previous step's greedy tokens, runs every layer, and writes the new tokens back.
//!
//! Two ways to do the matrix products, chosen per batch size by timing both:
//! - `Gemv` (batch ≤ 8): hand-written bandwidth-bound kernels with RMSNorm, the residual add
//!   and SiLU·mul fused in (5 kernels per layer);
//! - `Cublas`: cuBLAS GEMMs and a SiLU·mul kernel (6 per layer). Each layer's RMSNorm weights
//!   are folded into the projection after them when the weights are made, so QKV and gate/up
//!   read the raw residual stream and attention and SiLU·mul apply the norms' factors.
//!
//! The KV cache holds `context` positions per sequence; the new token sits at the last one
//! (`context - 1`) and overwrites it, so every step attends over `context` positions, as the
//! PyTorch reference in the calibration data does.

use std::collections::{HashMap, VecDeque};

use cudarc::driver::sys as cu;
use cudarc::driver::{CudaEvent, CudaGraph, CudaSlice};

use super::device::{Arg, AttentionImpl, GEMV_ROWS_PER_BLOCK, GEMV_THREADS, GemvMode, Gpu, int};
use super::error::CudaError;
use super::plan::{
    AttentionSplit, BufferPlan, GEMV_MAX_BATCH, MAX_BATCH, MAX_CONTEXT, TensorKind, WeightLayout,
    percentile,
};
use super::shape::{BYTES_PER_ELEMENT, ModelShape, check_supported};

/// Memory left free beyond the planned buffers: CUDA graphs, cuBLAS and the module.
const MEMORY_HEADROOM_BYTES: u64 = 1 << 30;

/// Timing of candidate graphs: warm-up replays each, then rounds that visit every candidate in
/// turn (so a drifting clock or temperature favours none), `TUNE_REPLAYS_PER_ROUND` replays per
/// visit; each candidate's median visit decides.
const TUNE_WARMUP_REPLAYS: usize = 2;
const TUNE_ROUNDS: usize = 5;
const TUNE_REPLAYS_PER_ROUND: usize = 2;

/// How the matrix products of a step are done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MatmulPath {
    /// Hand-written matrix-vector kernels with the norms and activations fused in (batch ≤ 8).
    Gemv,
    /// cuBLAS GEMMs.
    Cublas,
}

impl MatmulPath {
    pub fn name(self) -> &'static str {
        match self {
            MatmulPath::Gemv => "gemv",
            MatmulPath::Cublas => "cublas",
        }
    }
}

/// Which matmul path to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MatmulChoice {
    /// Time both where both apply (batch ≤ 8) and keep the faster.
    #[default]
    Auto,
    /// The matrix-vector kernels where they apply, cuBLAS above.
    Gemv,
    /// cuBLAS at every batch size.
    Cublas,
}

/// Which attention implementation to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionChoice {
    /// Time every implementation and keep the fastest.
    #[default]
    Auto,
    /// This one only.
    Only(AttentionImpl),
}

/// How a batch size not seen before picks its step variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Tuning {
    /// Capture and time every variant (0.5–0.8 s per new batch size for llama-3-8b on an
    /// H200): the fastest step at every batch size, which is what a benchmark wants.
    #[default]
    EveryBatch,
    /// Time every variant for the first batch size; later ones take the variant chosen for the
    /// nearest timed batch size and capture only that (milliseconds), so that a policy moving
    /// the batch size does not stall decoding at each new size.
    Nearest,
}

/// Knobs of the engine that do not change the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineOptions {
    pub matmul: MatmulChoice,
    pub attention: AttentionChoice,
    pub tuning: Tuning,
    /// Also try programmatic dependent launch (Hopper and newer), which lets a kernel start,
    /// and prefetch its weights, while the previous one drains; kept only where it is faster.
    /// Off by default: on the H200 it was faster in one timing out of four and slower in the
    /// others, and it doubles the variants to time.
    pub pdl: bool,
    /// Seed of the random weights, KV cache and first tokens.
    pub seed: u64,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            matmul: MatmulChoice::Auto,
            attention: AttentionChoice::Auto,
            tuning: Tuning::EveryBatch,
            pdl: false,
            seed: 0x0074_6f6b_7761_7474, // "tokwatt"
        }
    }
}

/// A captured step for one batch size.
struct StepGraph {
    graph: CudaGraph,
    info: GraphInfo,
}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepGraph")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

/// One way to build a step: what the engine chooses between, per batch size, by timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepVariant {
    pub path: MatmulPath,
    /// Kernels launched with programmatic dependent launch.
    pub pdl: bool,
    pub attention: AttentionImpl,
}

impl StepVariant {
    /// E.g. `cublas+pdl/tensor-cores`.
    pub fn label(&self) -> String {
        let pdl = if self.pdl { "+pdl" } else { "" };
        format!("{}{pdl}/{}", self.path.name(), self.attention.name())
    }
}

/// How a batch size's step was built, and what the alternatives measured.
#[derive(Debug, Clone, PartialEq)]
pub struct GraphInfo {
    pub variant: StepVariant,
    pub attention: AttentionSplit,
    /// Median replay time of each candidate timed, ms (empty when there was one candidate).
    pub candidates_ms: Vec<(StepVariant, f64)>,
    /// Under [`Tuning::Nearest`], the timed batch size whose choice this one took (None: this
    /// batch size chose for itself).
    pub chosen_for: Option<u32>,
}

/// A step launched and not yet waited for.
#[derive(Debug)]
struct InFlight {
    batch: u32,
    start: CudaEvent,
    end: CudaEvent,
}

/// A finished step: its batch and its GPU time (between events recorded around the replay).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepDone {
    pub batch: u32,
    pub gpu_ms: f64,
}

#[derive(Debug)]
struct Buffers {
    tokens: CudaSlice<u32>,
    x: CudaSlice<u16>,
    x_norm: CudaSlice<u16>,
    qkv: CudaSlice<u16>,
    attn: CudaSlice<u16>,
    gate_up: CudaSlice<u16>,
    act: CudaSlice<u16>,
    logits: CudaSlice<u16>,
    sumsq: CudaSlice<f32>,
    part_o: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    counters: CudaSlice<u32>,
}

/// Device addresses of everything a step touches.
#[derive(Debug, Clone, Copy)]
struct Addrs {
    tokens: u64,
    x: u64,
    x_norm: u64,
    qkv: u64,
    attn: u64,
    gate_up: u64,
    act: u64,
    logits: u64,
    sumsq_attn: u64,
    sumsq_mlp: u64,
    part_o: u64,
    part_ml: u64,
    counters: u64,
}

/// The decode engine on one GPU. Not `Send`: it lives on the thread that created it.
#[derive(Debug)]
pub struct Engine {
    gpu: Gpu,
    shape: ModelShape,
    context: u32,
    batch_max: u32,
    options: EngineOptions,
    layout: WeightLayout,
    weights: CudaSlice<u16>,
    k_cache: Vec<CudaSlice<u16>>,
    v_cache: Vec<CudaSlice<u16>>,
    buffers: Buffers,
    graphs: HashMap<u32, StepGraph>,
    in_flight: VecDeque<InFlight>,
    /// Steps waited for internally (before a graph capture) and not yet handed out.
    finished: VecDeque<StepDone>,
    spare_events: Vec<CudaEvent>,
}

/// Checks the sizes an engine is asked for.
pub(crate) fn validate(shape: &ModelShape, context: u32, batch_max: u32) -> Result<(), CudaError> {
    check_supported(shape)?;
    if !(1..=MAX_CONTEXT).contains(&context) {
        return Err(CudaError::Config(format!(
            "context length {context} is out of range: use 1 to {MAX_CONTEXT} positions"
        )));
    }
    if !(1..=MAX_BATCH).contains(&batch_max) {
        return Err(CudaError::Config(format!(
            "batch size maximum {batch_max} is out of range: use 1 to {MAX_BATCH}"
        )));
    }
    Ok(())
}

impl Engine {
    /// Opens GPU `ordinal`, allocates everything for `batch_max` sequences of `context`
    /// positions, and fills weights, cache and first tokens with seeded random values.
    pub fn new(
        shape: &ModelShape,
        context: u32,
        batch_max: u32,
        ordinal: u32,
        options: EngineOptions,
    ) -> Result<Engine, CudaError> {
        validate(shape, context, batch_max)?;
        let gpu = Gpu::open(ordinal)?;
        gpu.bind()?;
        let plan = BufferPlan::new(shape, batch_max, context, gpu.sms);
        let layout = WeightLayout::new(shape);
        let kv_per_layer = u64::from(batch_max) * u64::from(shape.kv_dim()) * u64::from(context);
        let needed = layout.total * BYTES_PER_ELEMENT
            + shape.kv_cache_bytes(batch_max, context)
            + plan.bytes()
            + MEMORY_HEADROOM_BYTES;
        let (free, _total) = gpu.memory()?;
        if needed > free {
            return Err(CudaError::OutOfMemory {
                what: format!(
                    "{} (weights {:.1} GB, KV cache for {batch_max} x {context} positions {:.1} GB)",
                    shape.name,
                    (layout.total * BYTES_PER_ELEMENT) as f64 / 1e9,
                    shape.kv_cache_bytes(batch_max, context) as f64 / 1e9
                ),
                needed_bytes: needed,
                free_bytes: free,
            });
        }

        let weights = gpu.alloc::<u16>("the weights", layout.total)?;
        let base = gpu.addr(&weights, 0);
        let matrix_scale = 0.02 * 3f32.sqrt(); // uniform with the standard deviation of 0.02·randn
        for (index, &(offset, elements, kind)) in layout.tensors.iter().enumerate() {
            let (scale, center) = match kind {
                TensorKind::Matrix => (matrix_scale, 0.0),
                TensorKind::Norm => (0.1, 1.0),
                TensorKind::Embedding => (3f32.sqrt(), 0.0),
            };
            let seed = options.seed ^ (index as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            gpu.fill_uniform(
                base + offset * BYTES_PER_ELEMENT,
                elements,
                seed,
                scale,
                center,
            )?;
        }
        // Fold each layer's two RMSNorm weights into the projection after them (as inference
        // engines do at load time), leaving weights of exactly 1: the cuBLAS path then needs no
        // norm kernel, and the fused matrix-vector kernels multiply by 1.
        let (hidden, qkv_dim, mlp) = (shape.hidden, shape.qkv_dim(), shape.mlp);
        for l in &layout.layers {
            let at = |offset: u64| base + offset * BYTES_PER_ELEMENT;
            gpu.scale_columns(at(l.qkv), qkv_dim, hidden, at(l.attn_norm))?;
            gpu.scale_columns(at(l.gate_up), 2 * mlp, hidden, at(l.mlp_norm))?;
            for gamma in [l.attn_norm, l.mlp_norm] {
                gpu.fill_uniform(at(gamma), u64::from(hidden), 0, 0.0, 1.0)?;
            }
        }
        let mut k_cache = Vec::new();
        let mut v_cache = Vec::new();
        for layer in 0..u64::from(shape.layers) {
            for (which, cache) in [(0u64, &mut k_cache), (1, &mut v_cache)] {
                let slice = gpu.alloc::<u16>("the KV cache", kv_per_layer)?;
                let seed = options.seed.rotate_left(17)
                    ^ (2 * layer + which + 1).wrapping_mul(0xd1b5_4a32_d192_ed03);
                gpu.fill_uniform(gpu.addr(&slice, 0), kv_per_layer, seed, 3f32.sqrt(), 0.0)?;
                cache.push(slice);
            }
        }
        let buffers = Buffers {
            tokens: gpu.alloc("the token ids", plan.tokens)?,
            x: gpu.alloc("the residual stream", plan.x)?,
            x_norm: gpu.alloc("the normalised residual", plan.x_norm)?,
            qkv: gpu.alloc("the QKV activations", plan.qkv)?,
            attn: gpu.alloc("the attention output", plan.attn)?,
            gate_up: gpu.alloc("the gate/up activations", plan.gate_up)?,
            act: gpu.alloc("the MLP activations", plan.act)?,
            logits: gpu.alloc("the logits", plan.logits)?,
            sumsq: gpu.alloc_zeros("the norm statistics", plan.sumsq)?,
            part_o: gpu.alloc("the attention partials", plan.attn_partial_out)?,
            part_ml: gpu.alloc("the attention partial statistics", plan.attn_partial_stats)?,
            counters: gpu.alloc_zeros("the attention counters", plan.attn_counters)?,
        };
        let mut engine = Engine {
            gpu,
            shape: shape.clone(),
            context,
            batch_max,
            options,
            layout,
            weights,
            k_cache,
            v_cache,
            buffers,
            graphs: HashMap::new(),
            in_flight: VecDeque::new(),
            finished: VecDeque::new(),
            spare_events: Vec::new(),
        };
        let first_tokens: Vec<u32> = (0..u64::from(batch_max))
            .map(|b| ((options.seed ^ b.wrapping_mul(7919)) % u64::from(shape.vocab)) as u32)
            .collect();
        engine.set_tokens(&first_tokens)?;
        engine.gpu.synchronize()?;
        Ok(engine)
    }

    pub fn shape(&self) -> &ModelShape {
        &self.shape
    }

    pub fn context(&self) -> u32 {
        self.context
    }

    pub fn batch_max(&self) -> u32 {
        self.batch_max
    }

    /// The GPU's name, as the driver reports it.
    pub fn gpu_name(&self) -> &str {
        &self.gpu.name
    }

    /// How the step of `batch` was built, once it has been prepared.
    pub fn graph_info(&self, batch: u32) -> Option<&GraphInfo> {
        self.graphs.get(&batch).map(|g| &g.info)
    }

    fn check_batch(&self, batch: u32) -> Result<(), CudaError> {
        if (1..=self.batch_max).contains(&batch) {
            Ok(())
        } else {
            Err(CudaError::Config(format!(
                "batch size {batch} is out of range: this engine was built for 1 to {}",
                self.batch_max
            )))
        }
    }

    fn addrs(&self) -> Addrs {
        let g = &self.gpu;
        let b = &self.buffers;
        Addrs {
            tokens: g.addr(&b.tokens, 0),
            x: g.addr(&b.x, 0),
            x_norm: g.addr(&b.x_norm, 0),
            qkv: g.addr(&b.qkv, 0),
            attn: g.addr(&b.attn, 0),
            gate_up: g.addr(&b.gate_up, 0),
            act: g.addr(&b.act, 0),
            logits: g.addr(&b.logits, 0),
            sumsq_attn: g.addr(&b.sumsq, 0),
            sumsq_mlp: g.addr(&b.sumsq, u64::from(self.batch_max)),
            part_o: g.addr(&b.part_o, 0),
            part_ml: g.addr(&b.part_ml, 0),
            counters: g.addr(&b.counters, 0),
        }
    }

    /// The step variants that apply to `batch` under the options.
    fn candidates(&self, batch: u32) -> Vec<StepVariant> {
        let gemv_fits = batch <= GEMV_MAX_BATCH;
        let paths = match self.options.matmul {
            MatmulChoice::Auto if gemv_fits => vec![MatmulPath::Gemv, MatmulPath::Cublas],
            MatmulChoice::Gemv if gemv_fits => vec![MatmulPath::Gemv],
            _ => vec![MatmulPath::Cublas],
        };
        let pdls: &[bool] = if self.options.pdl && self.gpu.pdl_supported() {
            &[true, false]
        } else {
            &[false]
        };
        let only;
        let attentions: &[AttentionImpl] = match self.options.attention {
            AttentionChoice::Auto => &AttentionImpl::ALL,
            AttentionChoice::Only(implementation) => {
                only = [implementation];
                &only
            }
        };
        let mut variants = Vec::new();
        for &path in &paths {
            for &pdl in pdls {
                for &attention in attentions {
                    variants.push(StepVariant {
                        path,
                        pdl,
                        attention,
                    });
                }
            }
        }
        variants
    }

    /// Enqueues one decode step for `batch` sequences on the stream (no graph).
    fn enqueue_step(
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

    fn gemv(&self, mode: GemvMode, batch: u32, call: GemvCall, eps: f32) -> Result<(), CudaError> {
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

    fn rmsnorm(&self, batch: u32, x: u64, gamma: u64, out: u64) -> Result<(), CudaError> {
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

    fn attention(
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

    /// Captures one step of `batch` built as `variant` into a graph.
    fn capture(
        &mut self,
        batch: u32,
        variant: StepVariant,
        split: AttentionSplit,
    ) -> Result<CudaGraph, CudaError> {
        self.gpu.set_pdl(variant.pdl);
        self.gpu.bind()?;
        self.gpu
            .stream
            .begin_capture(cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| CudaError::driver("cuStreamBeginCapture", e))?;
        let enqueued = self.enqueue_step(batch, variant, split);
        // End the capture whatever happened, so the stream leaves capture mode.
        let ended = self.gpu.stream.end_capture(cu::CUgraphInstantiate_flags(0));
        enqueued?;
        ended
            .map_err(|e| CudaError::driver("cuStreamEndCapture/cuGraphInstantiate", e))?
            .ok_or_else(|| CudaError::Driver {
                call: "cuStreamEndCapture",
                reason: "the capture produced no graph".into(),
            })
    }

    /// Captures a graph and replays it once, so that a variant the driver refuses fails here.
    fn capture_checked(
        &mut self,
        batch: u32,
        variant: StepVariant,
        split: AttentionSplit,
    ) -> Result<CudaGraph, CudaError> {
        let graph = self.capture(batch, variant, split)?;
        graph
            .launch()
            .map_err(|e| CudaError::driver("cuGraphLaunch", e))?;
        self.gpu.synchronize()?;
        Ok(graph)
    }

    /// Median replay time of each graph, ms, visiting them in turn (see `TUNE_ROUNDS`).
    fn time_graphs(&self, graphs: &[&CudaGraph]) -> Result<Vec<f64>, CudaError> {
        let launch = |graph: &CudaGraph| {
            graph
                .launch()
                .map_err(|e| CudaError::driver("cuGraphLaunch", e))
        };
        for graph in graphs {
            for _ in 0..TUNE_WARMUP_REPLAYS {
                launch(graph)?;
            }
        }
        let start = self.new_event()?;
        let end = self.new_event()?;
        let mut samples = vec![Vec::with_capacity(TUNE_ROUNDS); graphs.len()];
        for _ in 0..TUNE_ROUNDS {
            for (graph, samples) in graphs.iter().zip(&mut samples) {
                start
                    .record(&self.gpu.stream)
                    .map_err(|e| CudaError::driver("cuEventRecord", e))?;
                for _ in 0..TUNE_REPLAYS_PER_ROUND {
                    launch(graph)?;
                }
                end.record(&self.gpu.stream)
                    .map_err(|e| CudaError::driver("cuEventRecord", e))?;
                let ms = start
                    .elapsed_ms(&end)
                    .map_err(|e| CudaError::driver("cuEventElapsedTime", e))?;
                samples.push(f64::from(ms) / TUNE_REPLAYS_PER_ROUND as f64);
            }
        }
        Ok(samples.iter_mut().map(|s| percentile(s, 50.0)).collect())
    }

    /// Builds the graph for `batch` if it does not exist yet: captures every applicable step
    /// variant, times them when there is a choice, and keeps the fastest. A variant with
    /// programmatic dependent launch that the driver refuses is skipped. Waits for steps in flight.
    pub fn prepare(&mut self, batch: u32) -> Result<&GraphInfo, CudaError> {
        self.check_batch(batch)?;
        if !self.graphs.contains_key(&batch) {
            self.settle()?;
            let split = AttentionSplit::plan(&self.shape, batch, self.context, self.gpu.sms);
            let inherited = match self.options.tuning {
                Tuning::Nearest => self.nearest_choice(batch),
                Tuning::EveryBatch => None,
            };
            let variants = match inherited {
                Some((_, variant)) => vec![variant],
                None => self.candidates(batch),
            };
            let mut captured = self.capture_variants(batch, split, variants)?;
            let mut chosen_for = inherited.map(|(timed, _)| timed);
            if captured.is_empty() && chosen_for.is_some() {
                // The inherited variant was refused here: choose among all of them.
                let all = self.candidates(batch);
                captured = self.capture_variants(batch, split, all)?;
                chosen_for = None;
            }
            let timings = if captured.len() > 1 {
                let graphs: Vec<&CudaGraph> = captured.iter().map(|(_, g)| g).collect();
                self.time_graphs(&graphs)?
            } else {
                vec![0.0; captured.len()]
            };
            let candidates_ms: Vec<(StepVariant, f64)> = if captured.len() > 1 {
                captured
                    .iter()
                    .map(|(v, _)| *v)
                    .zip(timings.iter().copied())
                    .collect()
            } else {
                Vec::new()
            };
            let fastest = timings
                .iter()
                .enumerate()
                .min_by(|a, b| a.1.total_cmp(b.1))
                .map(|(index, _)| index);
            let Some(fastest) = fastest else {
                return Err(CudaError::Config(format!(
                    "no step variant applies to batch {batch}"
                )));
            };
            let (variant, graph) = captured.swap_remove(fastest);
            let info = GraphInfo {
                variant,
                attention: split,
                candidates_ms,
                chosen_for,
            };
            self.graphs.insert(batch, StepGraph { graph, info });
        }
        self.graphs
            .get(&batch)
            .map(|g| &g.info)
            .ok_or_else(|| CudaError::Config(format!("the graph of batch {batch} is missing")))
    }

    /// Captures `variants` of the step for `batch`, skipping those with programmatic dependent
    /// launch that the driver refuses.
    fn capture_variants(
        &mut self,
        batch: u32,
        split: AttentionSplit,
        variants: Vec<StepVariant>,
    ) -> Result<Vec<(StepVariant, CudaGraph)>, CudaError> {
        let mut captured = Vec::new();
        for variant in variants {
            match self.capture_checked(batch, variant, split) {
                Ok(graph) => captured.push((variant, graph)),
                Err(error) if variant.pdl => {
                    tracing::warn!(%error, variant = %variant.label(), "skipping a step variant the driver refused");
                }
                Err(error) => return Err(error),
            }
        }
        Ok(captured)
    }

    /// The variant chosen by timing for the batch size nearest `batch` (by ratio) among those
    /// whose variant applies to `batch`, with that batch size.
    fn nearest_choice(&self, batch: u32) -> Option<(u32, StepVariant)> {
        let candidates = self.candidates(batch);
        let distance = |timed: u32| (f64::from(timed) / f64::from(batch)).ln().abs();
        self.graphs
            .iter()
            .filter(|(_, g)| g.info.chosen_for.is_none() && candidates.contains(&g.info.variant))
            .map(|(&timed, g)| (timed, g.info.variant))
            .min_by(|a, b| distance(a.0).total_cmp(&distance(b.0)).then(a.0.cmp(&b.0)))
    }

    fn new_event(&self) -> Result<CudaEvent, CudaError> {
        // Blocking sync: the waiting thread sleeps instead of spinning a core.
        self.gpu
            .ctx
            .new_event(Some(cu::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(|e| CudaError::driver("cuEventCreate", e))
    }

    /// Launches one step of `batch` (building its graph first if needed) without waiting.
    pub fn launch_step(&mut self, batch: u32) -> Result<(), CudaError> {
        if !self.graphs.contains_key(&batch) {
            self.prepare(batch)?;
        }
        let start = match self.spare_events.pop() {
            Some(event) => event,
            None => self.new_event()?,
        };
        let end = match self.spare_events.pop() {
            Some(event) => event,
            None => self.new_event()?,
        };
        let graph = self
            .graphs
            .get(&batch)
            .ok_or_else(|| CudaError::Config(format!("the graph of batch {batch} is missing")))?;
        let stream = &self.gpu.stream;
        start
            .record(stream)
            .map_err(|e| CudaError::driver("cuEventRecord", e))?;
        graph
            .graph
            .launch()
            .map_err(|e| CudaError::driver("cuGraphLaunch", e))?;
        end.record(stream)
            .map_err(|e| CudaError::driver("cuEventRecord", e))?;
        self.in_flight.push_back(InFlight { batch, start, end });
        Ok(())
    }

    /// Steps launched and not yet handed out by [`Engine::wait_oldest`].
    pub fn in_flight(&self) -> usize {
        self.in_flight.len() + self.finished.len()
    }

    /// Waits for the oldest step launched and not yet handed out.
    pub fn wait_oldest(&mut self) -> Result<Option<StepDone>, CudaError> {
        if let Some(done) = self.finished.pop_front() {
            return Ok(Some(done));
        }
        self.wait_gpu_oldest()
    }

    /// Waits for every step on the GPU, keeping their results for [`Engine::wait_oldest`].
    fn settle(&mut self) -> Result<(), CudaError> {
        while let Some(done) = self.wait_gpu_oldest()? {
            self.finished.push_back(done);
        }
        Ok(())
    }

    fn wait_gpu_oldest(&mut self) -> Result<Option<StepDone>, CudaError> {
        let Some(step) = self.in_flight.pop_front() else {
            return Ok(None);
        };
        step.end
            .synchronize()
            .map_err(|e| CudaError::driver("cuEventSynchronize", e))?;
        let ms = step
            .start
            .elapsed_ms(&step.end)
            .map_err(|e| CudaError::driver("cuEventElapsedTime", e))?;
        self.spare_events.push(step.start);
        self.spare_events.push(step.end);
        Ok(Some(StepDone {
            batch: step.batch,
            gpu_ms: f64::from(ms),
        }))
    }

    /// Waits for every step in flight.
    pub fn drain(&mut self) -> Result<Vec<StepDone>, CudaError> {
        let mut done = Vec::with_capacity(self.in_flight.len());
        while let Some(step) = self.wait_oldest()? {
            done.push(step);
        }
        Ok(done)
    }

    /// Runs one step of `batch` on `path` without a graph and waits for it.
    #[cfg(test)]
    pub(crate) fn step_eager(&mut self, batch: u32, path: MatmulPath) -> Result<(), CudaError> {
        self.check_batch(batch)?;
        self.settle()?;
        let split = AttentionSplit::plan(&self.shape, batch, self.context, self.gpu.sms);
        let variant = StepVariant {
            path,
            pdl: false,
            attention: AttentionImpl::CudaCores,
        };
        self.gpu.set_pdl(false);
        self.gpu.bind()?;
        self.enqueue_step(batch, variant, split)?;
        self.gpu.synchronize()
    }

    /// Overwrites the first `tokens.len()` token ids (the next step embeds them).
    pub(crate) fn set_tokens(&mut self, tokens: &[u32]) -> Result<(), CudaError> {
        self.gpu.upload(tokens, &mut self.buffers.tokens)
    }

    /// The token ids of the first `batch` sequences (waits for the stream).
    pub fn tokens(&self, batch: u32) -> Result<Vec<u32>, CudaError> {
        self.gpu.download(&self.buffers.tokens, batch as usize)
    }

    /// Every step variant that applies to `batch`.
    #[cfg(test)]
    pub(crate) fn variants(&self, batch: u32) -> Vec<StepVariant> {
        self.candidates(batch)
    }

    /// Captures `variant` for `batch` and replays it once (no graph is kept).
    #[cfg(test)]
    pub(crate) fn replay_variant(
        &mut self,
        batch: u32,
        variant: StepVariant,
    ) -> Result<(), CudaError> {
        self.check_batch(batch)?;
        self.settle()?;
        let split = AttentionSplit::plan(&self.shape, batch, self.context, self.gpu.sms);
        self.capture_checked(batch, variant, split).map(drop)
    }

    /// The logits of the last step, `batch` rows of `vocab` bf16 values.
    #[cfg(test)]
    pub(crate) fn logits(&self, batch: u32) -> Result<Vec<u16>, CudaError> {
        self.gpu.download(
            &self.buffers.logits,
            batch as usize * self.shape.vocab as usize,
        )
    }

    #[cfg(test)]
    pub(crate) fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Nothing may still run on buffers about to be freed, nor on the cuBLAS handle.
        let _ = self.gpu.synchronize();
    }
}

/// One matrix-vector call; unused pointers stay 0.
#[derive(Debug, Clone, Copy)]
struct GemvCall {
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
    fn new(weights: u64, input: u64, rows: u32, cols: u32) -> GemvCall {
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
    fn norm(self, gamma: u64, sumsq_in: u64, zero_out: u64) -> GemvCall {
        GemvCall {
            gamma,
            sumsq_in,
            zero_out,
            ..self
        }
    }

    fn output(self, out: u64, out_stride: u32) -> GemvCall {
        GemvCall {
            out,
            out_stride,
            ..self
        }
    }

    fn accumulate_sumsq(self, sumsq_out: u64) -> GemvCall {
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

/// One timed part of a step: its name, time per launch (µs) and the bytes it must read.
#[cfg(test)]
#[derive(Debug, Clone)]
pub(crate) struct PartTiming {
    pub name: String,
    pub micros: f64,
    pub bytes: u64,
}

#[cfg(test)]
impl Engine {
    /// Times the launches a step of `batch` is made of, each on its own, by capturing `REPS`
    /// launches into a graph and replaying it. Each launch takes the next layer's weights, as a
    /// step does: repeating one layer's would serve the smaller matrices from L2.
    pub(crate) fn profile_parts(&mut self, batch: u32) -> Result<Vec<PartTiming>, CudaError> {
        use super::plan::{ATTENTION_SCORE_BYTES, LayerOffsets};
        const REPS: usize = 32;
        self.check_batch(batch)?;
        self.settle()?;
        self.gpu.set_pdl(self.options.pdl);
        let s = self.shape.clone();
        let a = self.addrs();
        let w = self.gpu.addr(&self.weights, 0);
        let wt = move |offset: u64| w + offset * BYTES_PER_ELEMENT;
        let (lm_head, final_norm) = (self.layout.lm_head, self.layout.final_norm);
        let split = AttentionSplit::plan(&s, batch, self.context, self.gpu.sms);

        let eps = s.norm_eps as f32;
        let (h, mlp, vocab, qkv_dim, q_dim) = (s.hidden, s.mlp, s.vocab, s.qkv_dim(), s.q_dim());
        let bytes = |rows: u32, cols: u32| u64::from(rows) * u64::from(cols) * BYTES_PER_ELEMENT;
        // One launch of a part, for the layer of that index and offsets.
        type Part<'a> = Box<dyn Fn(&Engine, usize, LayerOffsets) -> Result<(), CudaError> + 'a>;
        let kv_bytes = s.kv_cache_bytes(batch, self.context) / u64::from(s.layers);
        let mut parts: Vec<(String, Part, u64)> = AttentionImpl::ALL
            .into_iter()
            .map(|implementation| {
                let part: Part = Box::new(move |e: &Engine, layer, _| {
                    e.attention(batch, layer, split, implementation, &a, a.x)
                });
                (
                    format!(
                        "attention {} (splits {})",
                        implementation.name(),
                        split.splits
                    ),
                    part,
                    kv_bytes,
                )
            })
            .collect();
        // Fewer context splits than planned (the merge scratch is sized for the plan): longer
        // blocks, a shorter merge.
        let context = self.context;
        for splits in [1u32, 2, 4, 8] {
            let chunk = context.div_ceil(splits);
            let swept = AttentionSplit {
                splits: context.div_ceil(chunk),
                chunk,
            };
            if swept.splits >= split.splits
                || swept.shared_bytes(s.group_size()) > ATTENTION_SCORE_BYTES
            {
                continue;
            }
            let part: Part = Box::new(move |e: &Engine, layer, _| {
                e.attention(batch, layer, swept, AttentionImpl::CudaCores, &a, a.x)
            });
            parts.push((
                format!("attention cuda-cores (splits {})", swept.splits),
                part,
                kv_bytes,
            ));
        }
        if batch <= GEMV_MAX_BATCH {
            // The call a launch makes for a layer.
            type CallFor = Box<dyn Fn(LayerOffsets) -> GemvCall>;
            let calls: [(&str, GemvMode, CallFor, u64); 5] = [
                (
                    "gemv qkv",
                    GemvMode::NormStore,
                    Box::new(move |l| {
                        GemvCall::new(wt(l.qkv), a.x, qkv_dim, h)
                            .norm(wt(l.attn_norm), a.sumsq_attn, 0)
                            .output(a.qkv, qkv_dim)
                    }),
                    bytes(qkv_dim, h),
                ),
                (
                    "gemv o",
                    GemvMode::Residual,
                    Box::new(move |l| {
                        GemvCall::new(wt(l.o), a.attn, h, q_dim)
                            .output(a.x, h)
                            .accumulate_sumsq(a.sumsq_mlp)
                    }),
                    bytes(h, q_dim),
                ),
                (
                    "gemv gate_up",
                    GemvMode::NormSilu,
                    Box::new(move |l| {
                        GemvCall::new(wt(l.gate_up), a.x, mlp, h)
                            .norm(wt(l.mlp_norm), a.sumsq_mlp, 0)
                            .output(a.act, mlp)
                    }),
                    bytes(2 * mlp, h),
                ),
                (
                    "gemv down",
                    GemvMode::Residual,
                    Box::new(move |l| {
                        GemvCall::new(wt(l.down), a.act, h, mlp)
                            .output(a.x, h)
                            .accumulate_sumsq(a.sumsq_attn)
                    }),
                    bytes(h, mlp),
                ),
                (
                    "gemv lm_head",
                    GemvMode::NormStore,
                    Box::new(move |_| {
                        GemvCall::new(wt(lm_head), a.x, vocab, h)
                            .norm(wt(final_norm), a.sumsq_attn, 0)
                            .output(a.logits, vocab)
                    }),
                    bytes(vocab, h),
                ),
            ];
            for (name, mode, call, b) in calls {
                parts.push((
                    name.to_owned(),
                    Box::new(move |e: &Engine, _, l| e.gemv(mode, batch, call(l), eps)),
                    b,
                ));
            }
        }
        // The layer's weights a GEMM reads; none: the output head's.
        type Weights = Option<fn(&LayerOffsets) -> u64>;
        let gemms: [(&str, u32, u32, Weights, u64, u64, bool); 5] = [
            (
                "cublas qkv",
                qkv_dim,
                h,
                Some(|l| l.qkv),
                a.x_norm,
                a.qkv,
                false,
            ),
            ("cublas o", h, q_dim, Some(|l| l.o), a.attn, a.x, true),
            (
                "cublas gate_up",
                2 * mlp,
                h,
                Some(|l| l.gate_up),
                a.x_norm,
                a.gate_up,
                false,
            ),
            ("cublas down", h, mlp, Some(|l| l.down), a.act, a.x, true),
            ("cublas lm_head", vocab, h, None, a.x_norm, a.logits, false),
        ];
        for (name, out, inp, weights, x, y, accumulate) in gemms {
            parts.push((
                name.to_owned(),
                Box::new(move |e: &Engine, _, l| {
                    let offset = weights.map_or(lm_head, |pick| pick(&l));
                    e.gpu
                        .gemm(out, batch, inp, wt(offset), x, inp, y, out, accumulate)
                }),
                bytes(out, inp),
            ));
        }
        parts.push((
            "rmsnorm".to_owned(),
            Box::new(move |e: &Engine, _, l| e.rmsnorm(batch, a.x, wt(l.attn_norm), a.x_norm)),
            bytes(batch, h),
        ));
        let (Some(k0), Some(v0)) = (self.k_cache.first(), self.v_cache.first()) else {
            return Err(CudaError::Config("no KV cache".into()));
        };
        let (k0, v0, copy_len) = (self.gpu.addr(k0, 0), self.gpu.addr(v0, 0), k0.len());
        parts.push((
            "copy (read bytes; moves twice that)".to_owned(),
            Box::new(move |e: &Engine, _, _| {
                // SAFETY: both ranges are whole, distinct allocations of `copy_len` elements.
                unsafe {
                    cu::cuMemcpyDtoDAsync_v2(v0, k0, copy_len * 2, e.gpu.stream.cu_stream())
                        .result()
                        .map_err(|err| CudaError::driver("cuMemcpyDtoDAsync", err))
                }
            }),
            copy_len as u64 * 2,
        ));

        let mut timings = Vec::new();
        for (name, part, bytes) in &parts {
            self.gpu.bind()?;
            self.gpu
                .stream
                .begin_capture(cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| CudaError::driver("cuStreamBeginCapture", e))?;
            let layers = &self.layout.layers;
            let enqueued = (0..REPS).try_for_each(|rep| {
                let layer = rep % layers.len();
                part(self, layer, layers[layer])
            });
            let ended = self.gpu.stream.end_capture(cu::CUgraphInstantiate_flags(0));
            enqueued?;
            let graph = ended
                .map_err(|e| CudaError::driver("cuStreamEndCapture", e))?
                .ok_or_else(|| CudaError::Config("empty capture".into()))?;
            let per_replay = self.time_graphs(&[&graph])?[0];
            timings.push(PartTiming {
                name: name.clone(),
                micros: per_replay * 1e3 / REPS as f64,
                bytes: *bytes,
            });
        }
        Ok(timings)
    }
}
