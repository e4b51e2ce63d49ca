//! Kernel-lab timing (feature `lab`, used by the `kernel-lab` binary; never in the product):
//! each launch kind of a step on its own, for work on the kernels. What was learnt with it is
//! in `docs/kernel-experiments.md`.

use cudarc::driver::sys as cu;

use super::Engine;
use super::step::GemvCall;
use crate::device::{AttentionImpl, GemvMode};
use crate::error::CudaError;
use crate::plan::{ATTENTION_SCORE_BYTES, AttentionSplit, GEMV_MAX_BATCH, LayerOffsets};
use crate::shape::BYTES_PER_ELEMENT;

/// One timed part of a step: its name, time per launch (µs) and the bytes it must read.
#[derive(Debug, Clone)]
pub struct PartTiming {
    pub name: String,
    pub micros: f64,
    pub bytes: u64,
}

impl Engine {
    /// Times the launches a step of `batch` is made of, each on its own, by capturing `REPS`
    /// launches into a graph and replaying it. Each launch takes the next layer's weights, as a
    /// step does: repeating one layer's would serve the smaller matrices from L2.
    pub fn profile_parts(&mut self, batch: u32) -> Result<Vec<PartTiming>, CudaError> {
        const REPS: usize = 32;
        self.check_batch(batch)?;
        self.settle()?;
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
