//! GPU tests: every kernel against a CPU reference on small shapes, the two matmul paths
//! against each other, graph replay against eager launches, and the workload end to end.
//! Without a CUDA driver each test prints why it skips and passes. This file holds what the
//! test files share: the device lock, test data, the CPU helpers, and tiny engines.

mod attention;
mod engine;
mod kernels;
mod prefill;
mod serve;
mod workload;

use std::sync::{Mutex, MutexGuard};

use cudarc::driver::CudaSlice;

use super::device::{Arg, AttentionImpl, GEMV_ROWS_PER_BLOCK, GEMV_THREADS, GemvMode, Gpu, int};
use super::engine::{
    AttentionArgs, Engine, EngineOptions, MatmulChoice, MatmulPath, Tuning, launch_attention,
};
use super::error::CudaError;
use super::plan::AttentionSplit;
use super::shape::ModelShape;
use super::{CudaDecode, CudaDecodeConfig};
use tokwatt_core::model::parse_presets;
use tokwatt_core::workload::{Workload, WorkloadError};

/// GPU tests run one at a time: they share the device and its memory.
static GPU_LOCK: Mutex<()> = Mutex::new(());

fn gpu_lock() -> MutexGuard<'static, ()> {
    GPU_LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether `error` means "no CUDA here" rather than a bug.
fn no_cuda(error: &CudaError) -> bool {
    matches!(
        error,
        CudaError::DriverNotFound(_)
            | CudaError::CublasNotFound(_)
            | CudaError::NvrtcNotFound(_)
            | CudaError::NoGpu { .. }
    )
}

/// Opens GPU 0, or prints why the test skips.
fn open_gpu() -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(gpu) => Some(gpu),
        Err(error) if no_cuda(&error) => {
            tokwatt_test_support::skip_gpu(format_args!("no CUDA driver: {error}"));
            None
        }
        Err(error) => panic!("{error}"),
    }
}

// ---- host-side data ---------------------------------------------------------------------

/// splitmix64: reproducible test data without a dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-scale, scale).
    fn uniform(&mut self, scale: f32) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }

    /// `n` bf16 values uniform in [center - scale, center + scale).
    fn bf16s(&mut self, n: usize, scale: f32, center: f32) -> Vec<u16> {
        (0..n)
            .map(|_| to_bf16(center + self.uniform(scale)))
            .collect()
    }
}

fn to_bf16(value: f32) -> u16 {
    let bits = value.to_bits();
    if value.is_nan() {
        return 0x7fc0;
    }
    let rounding = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

fn from_bf16(value: u16) -> f32 {
    f32::from_bits(u32::from(value) << 16)
}

fn floats(values: &[u16]) -> Vec<f64> {
    values.iter().map(|&v| f64::from(from_bf16(v))).collect()
}

/// ‖got − want‖ / ‖want‖; fails on NaN or an untouched (poisoned) element.
fn relative_error(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    assert!(
        got.iter().all(|g| g.is_finite()),
        "non-finite or unwritten output"
    );
    let diff: f64 = got.iter().zip(want).map(|(g, w)| (g - w).powi(2)).sum();
    let norm: f64 = want.iter().map(|w| w * w).sum();
    (diff / norm.max(1e-30)).sqrt()
}

/// bf16 operands, fp32 arithmetic, bf16 output: well under 1e-2.
const BF16_TOLERANCE: f64 = 1e-2;

/// NaN: any output element a kernel fails to write shows up.
const POISON: u16 = 0x7fc0;

fn upload<T: cudarc::driver::DeviceRepr>(gpu: &Gpu, data: &[T]) -> CudaSlice<T> {
    let mut slice = gpu.alloc::<T>("test data", data.len() as u64).unwrap();
    gpu.upload(data, &mut slice).unwrap();
    slice
}

fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
    gpu: &Gpu,
    slice: &CudaSlice<T>,
) -> Vec<T> {
    gpu.download(slice, slice.len()).unwrap()
}

fn rope_reference(x: &[f64], pos: u32, theta: f64) -> Vec<f64> {
    let half = x.len() / 2;
    let mut out = x.to_vec();
    for i in 0..half {
        let inv_freq = theta.powf(-2.0 * i as f64 / x.len() as f64);
        let (s, c) = (f64::from(pos) * inv_freq).sin_cos();
        out[i] = x[i] * c - x[i + half] * s;
        out[i + half] = x[i + half] * c + x[i] * s;
    }
    out
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

fn tiny_shape(head_dim: u32, heads: u32, kv_heads: u32) -> ModelShape {
    let text = format!(
        "[tiny]\nhidden = 256\nlayers = 2\nheads = {heads}\nkv_heads = {kv_heads}\nhead_dim = {head_dim}\nmlp = 512\nvocab = 1000\n"
    );
    parse_presets(&text).unwrap().remove("tiny").unwrap()
}

// ---- the engine -------------------------------------------------------------------------

/// An engine on device 0, or None (with the reason printed) where there is no CUDA driver.
fn engine_or_skip(
    shape: &ModelShape,
    context: u32,
    batch_max: u32,
    options: EngineOptions,
) -> Option<Engine> {
    match Engine::new(shape, context, batch_max, 0, options) {
        Ok(engine) => Some(engine),
        Err(error) if no_cuda(&error) => {
            tokwatt_test_support::skip_gpu(format_args!("no CUDA driver: {error}"));
            None
        }
        Err(error) => panic!("{error}"),
    }
}

/// The tiny test model: context 100, batches up to 8.
fn tiny_engine_with(options: EngineOptions) -> Option<Engine> {
    engine_or_skip(&tiny_shape(64, 4, 2), 100, 8, options)
}

fn tiny_engine(matmul: MatmulChoice) -> Option<Engine> {
    tiny_engine_with(EngineOptions {
        matmul,
        ..EngineOptions::default()
    })
}

fn cpu_argmax(logits: &[u16], vocab: usize) -> Vec<u32> {
    logits
        .chunks(vocab)
        .map(|row| {
            let mut best = 0;
            for (i, &v) in row.iter().enumerate() {
                if from_bf16(v) > from_bf16(row[best]) {
                    best = i;
                }
            }
            best as u32
        })
        .collect()
}

/// rsqrt(mean(x^2) + eps), the RMSNorm factor of one row.
fn rms_factor(x: &[f64], eps: f32) -> f64 {
    let mean_square = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    1.0 / (mean_square + f64::from(eps)).sqrt()
}
