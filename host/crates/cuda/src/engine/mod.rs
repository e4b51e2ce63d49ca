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
//!
//! This file holds the engine's data and its stepping (launch, wait); `step.rs` enqueues one
//! step's kernels, `tuning.rs` captures and times the step variants of a batch size, and
//! `lab.rs` (feature `lab` only) times a step's parts for kernel work.

use std::collections::{HashMap, VecDeque};

use cudarc::driver::sys as cu;
use cudarc::driver::{CudaEvent, CudaGraph, CudaSlice};

use super::device::{AttentionImpl, Gpu, PrefillAttention};
use super::error::CudaError;
use super::plan::{AttentionSplit, BufferPlan, MAX_BATCH, MAX_CONTEXT, TensorKind, WeightLayout};
use super::shape::{BYTES_PER_ELEMENT, ModelShape, check_supported};

#[cfg(feature = "lab")]
mod lab;
mod prefill;
mod step;
mod tuning;

#[cfg(feature = "lab")]
pub use lab::PartTiming;
pub use prefill::{DecodeInput, MAX_PREFILL_ROWS, PrefillChunk};
#[cfg(test)]
pub(crate) use step::{AttentionArgs, launch_attention};

/// Memory left free beyond the planned buffers: CUDA graphs, cuBLAS and the module.
const MEMORY_HEADROOM_BYTES: u64 = 1 << 30;

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
    /// How prefill attention tiles its work.
    pub prefill_attention: PrefillAttention,
    /// Seed of the random weights, KV cache and first tokens.
    pub seed: u64,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            matmul: MatmulChoice::Auto,
            attention: AttentionChoice::Auto,
            tuning: Tuning::EveryBatch,
            prefill_attention: PrefillAttention::default(),
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
    pub attention: AttentionImpl,
}

impl StepVariant {
    /// E.g. `cublas/tensor-cores`.
    pub fn label(&self) -> String {
        format!("{}/{}", self.path.name(), self.attention.name())
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
    /// Prompt activations, allocated by the first prefill call.
    prefill_buffers: Option<prefill::PrefillBuffers>,
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
    /// `batch_max` is lowered to the largest batch that fits the device's memory (the rule the
    /// simulator applies too, [`tokwatt_core::model::max_batch_that_fits`]); [`Engine::batch_max`]
    /// says what was allocated.
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
        let (_free, total) = gpu.memory()?;
        let fits = tokwatt_core::model::max_batch_that_fits(shape, context, total)
            .map_err(|e| CudaError::Config(e.to_string()))?;
        let batch_max = if batch_max > fits {
            tracing::warn!(
                requested = batch_max,
                fits,
                "batch_size_max does not fit the GPU's {:.1} GB with {} at {context} positions: \
                 the batch is limited to {fits}",
                total as f64 / 1e9,
                shape.name
            );
            fits
        } else {
            batch_max
        };
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
            prefill_buffers: None,
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
