//! The real token-generating workload: Llama-shaped greedy decoding with random bf16 weights
//! on one NVIDIA GPU, through cudarc (the only module that knows it).
//!
//! - [`shape`]: what the kernels need of a [`tokwatt_core::model::ModelShape`] (re-exported here);
//! - [`engine`]: weights, KV cache and one CUDA graph per batch size; cuBLAS GEMMs or
//!   hand-written matrix-vector kernels for the projections, NVRTC kernels for RMSNorm, RoPE,
//!   SiLU·mul, grouped-query decode attention (on CUDA cores, tensor cores, or tensor-core
//!   scores with values on CUDA cores) and greedy argmax (`kernels.cu`). Where there is a
//!   choice, each batch size's graph is built every way and the fastest by interleaved timing
//!   is kept (in the H200 checks: cuBLAS at every batch size; attention's pick moves between
//!   runs where the candidates are within noise). Each layer's RMSNorm weights are folded into
//!   the projection after them, and on Hopper attention merges its context splits inside a
//!   thread block cluster;
//! - [`CudaDecode`]: the engine stepping on a thread of its own, behind [`tokwatt_core::workload::Workload`];
//! - [`CudaServe`]: the engine serving requests as they arrive (continuous batching, chunked
//!   prefill under a token budget), TTFT and TPOT per request, behind the same trait;
//! - [`Engine::prefill`](engine::Engine::prefill): chunks of prompts as rows of one matrix, on
//!   cuBLAS GEMMs and a flash-style causal attention on tensor cores, their keys and values
//!   into the KV cache;
//! - [`bench_batches`]: tokens/s, step time, watts and tokens per joule per batch size;
//!   [`bench_prefill`]: the same per prompt length, beside the PyTorch prefill reference.
//!
//! On a machine without the NVIDIA driver every constructor returns
//! [`CudaError::DriverNotFound`]; nothing panics.

mod bench;
mod decode;
mod device;
pub mod engine;
mod error;
mod plan;
mod prefill_bench;
mod serve;
mod serving_step_bench;
pub mod shape;
mod step_log;

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests;

pub use bench::{BenchConfig, BenchRow, bench_batches, bench_with, format_table};
pub use decode::{CudaDecode, CudaDecodeConfig};
pub use device::{AttentionImpl, PrefillAttention};
pub use engine::{
    AttentionChoice, DecodeInput, EngineOptions, GraphInfo, MAX_PREFILL_ROWS, MatmulChoice,
    MatmulPath, PrefillChunk, StepVariant, Tuning,
};
pub use error::CudaError;
pub use plan::{AttentionSplit, GEMV_MAX_BATCH, MAX_BATCH, MAX_CONTEXT};
pub use prefill_bench::{PrefillRow, REFERENCE_PREFILL_CASES, bench_prefill};
pub use serve::{CudaServe, CudaServeConfig, EnergyCounter};
pub use serving_step_bench::{
    GpuReading, ServingStepCase, ServingStepGrid, ServingStepRow, bench_serving_steps,
};
pub use shape::{ModelError, ModelShape, ShapeError};
pub use step_log::StepRecord;
