//! GPU tests: every kernel against a CPU reference on small shapes, the two matmul paths
//! against each other, graph replay against eager launches, and the workload end to end.
//! Without a CUDA driver each test prints why it skips and passes.
//!
//! `bench_on_device` (ignored) prints the benchmark table; see its doc comment.

use std::sync::{Mutex, MutexGuard};

use cudarc::driver::CudaSlice;

use super::device::{Arg, AttentionImpl, GEMV_ROWS_PER_BLOCK, GEMV_THREADS, GemvMode, Gpu, int};
use super::engine::{
    AttentionArgs, AttentionChoice, Engine, EngineOptions, MatmulChoice, MatmulPath, Tuning,
    launch_attention,
};
use super::error::CudaError;
use super::plan::AttentionSplit;
use super::shape::ModelShape;
use crate::model::parse_presets;
use super::{BenchConfig, CudaDecode, CudaDecodeConfig, bench_with, format_table};
use crate::workload::{Workload, WorkloadError};

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
            println!("skipping: no CUDA driver: {error}");
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

// ---- kernels ----------------------------------------------------------------------------

#[test]
fn rmsnorm_matches_the_cpu() {
    let _lock = gpu_lock();
    let Some(gpu) = open_gpu() else { return };
    let (batch, hidden, eps) = (3usize, 264usize, 1e-5f32);
    let mut rng = Rng(1);
    let x = rng.bf16s(batch * hidden, 2.0, 0.0);
    let gamma = rng.bf16s(hidden, 0.2, 1.0);
    let (dx, dg) = (upload(&gpu, &x), upload(&gpu, &gamma));
    let out = upload(&gpu, &vec![POISON; batch * hidden]);
    gpu.launch(
        &gpu.kernels.rmsnorm,
        (batch as u32, 1, 1),
        256,
        0,
        &[
            Arg::Ptr(gpu.addr(&dx, 0)),
            Arg::Ptr(gpu.addr(&dg, 0)),
            Arg::Ptr(gpu.addr(&out, 0)),
            int(hidden, "h").unwrap(),
            Arg::F32(eps),
        ],
    )
    .unwrap();
    let got = floats(&download(&gpu, &out));
    let (xf, gf) = (floats(&x), floats(&gamma));
    let mut want = Vec::new();
    for row in xf.chunks(hidden) {
        let mean_square = row.iter().map(|v| v * v).sum::<f64>() / hidden as f64;
        let rstd = 1.0 / (mean_square + f64::from(eps)).sqrt();
        want.extend(row.iter().zip(&gf).map(|(v, g)| v * rstd * g));
    }
    let err = relative_error(&got, &want);
    assert!(err < BF16_TOLERANCE, "relative error {err}");
}

#[test]
fn silu_mul_matches_the_cpu_with_and_without_the_norm_factor() {
    let _lock = gpu_lock();
    let Some(gpu) = open_gpu() else { return };
    let (batch, mlp, hidden, eps) = (3usize, 2072usize, 264usize, 1e-5f32);
    let mut rng = Rng(2);
    let gate_up = rng.bf16s(batch * 2 * mlp, 4.0, 0.0);
    let x = rng.bf16s(batch * hidden, 3.0, 0.0);
    let (dgu, dx) = (upload(&gpu, &gate_up), upload(&gpu, &x));
    let (gu, xf) = (floats(&gate_up), floats(&x));
    for with_norm in [false, true] {
        let out = upload(&gpu, &vec![POISON; batch * mlp]);
        gpu.launch(
            &gpu.kernels.silu_mul,
            ((mlp / 8).div_ceil(256) as u32, batch as u32, 1),
            256,
            0,
            &[
                Arg::Ptr(gpu.addr(&dgu, 0)),
                Arg::Ptr(gpu.addr(&out, 0)),
                int(mlp, "mlp").unwrap(),
                Arg::Ptr(if with_norm { gpu.addr(&dx, 0) } else { 0 }),
                int(hidden, "hidden").unwrap(),
                Arg::F32(eps),
            ],
        )
        .unwrap();
        let got = floats(&download(&gpu, &out));
        let want: Vec<f64> = (0..batch)
            .flat_map(|b| {
                let row = &gu[b * 2 * mlp..(b + 1) * 2 * mlp];
                let r = if with_norm {
                    rms_factor(&xf[b * hidden..(b + 1) * hidden], eps)
                } else {
                    1.0
                };
                (0..mlp).map(move |j| silu(r * row[j]) * (r * row[mlp + j]))
            })
            .collect();
        let err = relative_error(&got, &want);
        assert!(
            err < BF16_TOLERANCE,
            "norm {with_norm}: relative error {err}"
        );
    }
}

#[test]
fn scale_columns_folds_norm_weights_into_each_column() {
    let _lock = gpu_lock();
    let Some(gpu) = open_gpu() else { return };
    let (rows, cols) = (37usize, 264usize);
    let mut rng = Rng(9);
    let w = rng.bf16s(rows * cols, 1.0, 0.0);
    let gamma = rng.bf16s(cols, 0.5, 1.0);
    let (dw, dg) = (upload(&gpu, &w), upload(&gpu, &gamma));
    gpu.scale_columns(gpu.addr(&dw, 0), rows as u32, cols as u32, gpu.addr(&dg, 0))
        .unwrap();
    let got = download(&gpu, &dw);
    for (i, (&got, &before)) in got.iter().zip(&w).enumerate() {
        let want = to_bf16(from_bf16(before) * from_bf16(gamma[i % cols]));
        assert!(
            got.abs_diff(want) <= 1,
            "element {i}: {got:#x} vs {want:#x}"
        );
    }
}

/// rsqrt(mean(x^2) + eps), the RMSNorm factor of one row.
fn rms_factor(x: &[f64], eps: f32) -> f64 {
    let mean_square = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    1.0 / (mean_square + f64::from(eps)).sqrt()
}

#[test]
fn rope_rotates_query_and_key_heads_and_leaves_values() {
    let _lock = gpu_lock();
    let Some(gpu) = open_gpu() else { return };
    for head_dim in [64usize, 128] {
        let (batch, heads, kv_heads, pos, theta) = (2usize, 4usize, 2usize, 1023u32, 500_000.0f64);
        let width = (heads + 2 * kv_heads) * head_dim;
        let mut rng = Rng(3 + head_dim as u64);
        let qkv = rng.bf16s(batch * width, 1.0, 0.0);
        let dqkv = upload(&gpu, &qkv);
        gpu.launch(
            &gpu.kernels.rope_qk,
            (batch as u32, 1, 1),
            128,
            0,
            &[
                Arg::Ptr(gpu.addr(&dqkv, 0)),
                int(width, "w").unwrap(),
                int(heads, "h").unwrap(),
                int(kv_heads, "kv").unwrap(),
                int(head_dim, "hd").unwrap(),
                int(pos, "pos").unwrap(),
                Arg::F32(theta.log2() as f32),
            ],
        )
        .unwrap();
        let got = download(&gpu, &dqkv);
        let input = floats(&qkv);
        let mut want = Vec::new();
        for row in input.chunks(width) {
            for head in row[..(heads + kv_heads) * head_dim].chunks(head_dim) {
                want.extend(rope_reference(head, pos, theta));
            }
            want.extend_from_slice(&row[(heads + kv_heads) * head_dim..]);
        }
        let err = relative_error(&floats(&got), &want);
        assert!(
            err < BF16_TOLERANCE,
            "head_dim {head_dim}: relative error {err}"
        );
        for b in 0..batch {
            let values = b * width + (heads + kv_heads) * head_dim..(b + 1) * width;
            assert_eq!(
                got[values.clone()],
                qkv[values],
                "value heads must not change"
            );
        }
    }
}

#[test]
fn argmax_picks_the_largest_and_the_lowest_index_on_ties() {
    let _lock = gpu_lock();
    let Some(gpu) = open_gpu() else { return };
    // 1003 exercises the scalar tail after the 16-byte vectors.
    for vocab in [1000usize, 1003] {
        let batch = 3;
        let mut rng = Rng(4);
        let mut logits = rng.bf16s(batch * vocab, 8.0, 0.0);
        logits[vocab + 17] = to_bf16(100.0); // row 1: a tie at 17 and 900, lowest wins
        logits[vocab + 900] = to_bf16(100.0);
        logits[2 * vocab + vocab - 1] = to_bf16(200.0); // row 2: the very last element
        let dl = upload(&gpu, &logits);
        let tokens = upload(&gpu, &vec![u32::MAX; batch]);
        gpu.launch(
            &gpu.kernels.argmax,
            (batch as u32, 1, 1),
            1024,
            0,
            &[
                Arg::Ptr(gpu.addr(&dl, 0)),
                int(vocab, "v").unwrap(),
                Arg::Ptr(gpu.addr(&tokens, 0)),
            ],
        )
        .unwrap();
        let got = download(&gpu, &tokens);
        assert_eq!(got, cpu_argmax(&logits, vocab));
        assert_eq!(got[1], 17);
        assert_eq!(got[2], vocab as u32 - 1);
    }
}

/// Runs a matrix-vector kernel on random data and returns (inputs, outputs) for checking.
struct GemvCase {
    batch: usize,
    rows: usize,
    cols: usize,
    w: Vec<u16>,
    x: Vec<u16>,
    gamma: Vec<u16>,
    y0: Vec<u16>,
}

impl GemvCase {
    fn new(mode: GemvMode, batch: usize, rows: usize, cols: usize, seed: u64) -> GemvCase {
        let mut rng = Rng(seed);
        let weight_rows = if mode == GemvMode::NormSilu {
            2 * rows
        } else {
            rows
        };
        GemvCase {
            batch,
            rows,
            cols,
            w: rng.bf16s(weight_rows * cols, 0.1, 0.0),
            x: rng.bf16s(batch * cols, 2.0, 0.0),
            gamma: rng.bf16s(cols, 0.2, 1.0),
            y0: match mode {
                GemvMode::Residual => rng.bf16s(batch * rows, 1.0, 0.0),
                _ => vec![POISON; batch * rows],
            },
        }
    }

    fn sumsq(&self) -> Vec<f32> {
        self.x
            .chunks(self.cols)
            .map(|row| row.iter().map(|&v| from_bf16(v) * from_bf16(v)).sum())
            .collect()
    }

    /// Σ_k W[r, k] · xin[b, k] in f64, with x normalised when `norm`.
    fn dot(&self, r: usize, b: usize, norm: bool, eps: f64) -> f64 {
        let x = floats(&self.x[b * self.cols..(b + 1) * self.cols]);
        let w = floats(&self.w[r * self.cols..(r + 1) * self.cols]);
        let g = floats(&self.gamma);
        let rstd = if norm {
            let mean_square = x.iter().map(|v| v * v).sum::<f64>() / self.cols as f64;
            1.0 / (mean_square + eps).sqrt()
        } else {
            1.0
        };
        let sum: f64 = (0..self.cols)
            .map(|k| w[k] * x[k] * if norm { g[k] } else { 1.0 })
            .sum();
        sum * rstd
    }
}

/// Launches `mode` for the case; returns (Y, zeroed buffer, sums of squares out).
fn run_gemv(
    gpu: &Gpu,
    mode: GemvMode,
    case: &GemvCase,
    eps: f32,
) -> (Vec<u16>, Vec<f32>, Vec<f32>) {
    let (dw, dx, dg) = (
        upload(gpu, &case.w),
        upload(gpu, &case.x),
        upload(gpu, &case.gamma),
    );
    let dy = upload(gpu, &case.y0);
    let sumsq_in = upload(gpu, &case.sumsq());
    let zero_out = upload(gpu, &vec![5.0f32; case.batch]);
    let sumsq_out = upload(gpu, &vec![0.5f32; case.batch]);
    let norm = mode != GemvMode::Residual;
    let kernel = gpu.kernels.gemv(mode, case.batch as u32).unwrap();
    gpu.launch(
        kernel,
        ((case.rows as u32).div_ceil(GEMV_ROWS_PER_BLOCK), 1, 1),
        GEMV_THREADS,
        0,
        &[
            Arg::Ptr(gpu.addr(&dw, 0)),
            Arg::Ptr(gpu.addr(&dx, 0)),
            Arg::Ptr(if norm { gpu.addr(&dg, 0) } else { 0 }),
            Arg::Ptr(if norm { gpu.addr(&sumsq_in, 0) } else { 0 }),
            Arg::Ptr(if norm { gpu.addr(&zero_out, 0) } else { 0 }),
            Arg::Ptr(gpu.addr(&dy, 0)),
            Arg::Ptr(if norm { 0 } else { gpu.addr(&sumsq_out, 0) }),
            int(case.rows, "rows").unwrap(),
            int(case.cols, "cols").unwrap(),
            int(case.cols, "ldx").unwrap(),
            int(case.rows, "ldy").unwrap(),
            Arg::F32(eps),
        ],
    )
    .unwrap();
    (
        download(gpu, &dy),
        download(gpu, &zero_out),
        download(gpu, &sumsq_out),
    )
}

#[test]
fn gemv_kernels_match_the_cpu_in_every_mode() {
    let _lock = gpu_lock();
    let Some(gpu) = open_gpu() else { return };
    let eps = 1e-5f32;
    // 42 rows: a partial block; 264 columns: a partial 256-column chunk; the wider rows take
    // many rounds of loads per warp.
    let shapes = [
        (1usize, 264usize),
        (1, 4104),
        (1, 14336),
        (1, 33000),
        (3, 264),
        (5, 264),
        (8, 264),
        (8, 14336),
    ];
    for (batch, cols) in shapes {
        for mode in [GemvMode::NormStore, GemvMode::Residual, GemvMode::NormSilu] {
            let case = GemvCase::new(mode, batch, 42, cols, 10 + batch as u64);
            let (y, zeroed, sumsq_out) = run_gemv(&gpu, mode, &case, eps);
            let mut want = Vec::new();
            for b in 0..batch {
                for r in 0..case.rows {
                    want.push(match mode {
                        GemvMode::NormStore => case.dot(r, b, true, f64::from(eps)),
                        GemvMode::Residual => {
                            f64::from(from_bf16(case.y0[b * case.rows + r]))
                                + case.dot(r, b, false, 0.0)
                        }
                        GemvMode::NormSilu => {
                            silu(case.dot(r, b, true, f64::from(eps)))
                                * case.dot(case.rows + r, b, true, f64::from(eps))
                        }
                    });
                }
            }
            let err = relative_error(&floats(&y), &want);
            assert!(
                err < BF16_TOLERANCE,
                "{mode:?} batch {batch} cols {cols}: relative error {err}"
            );
            if mode == GemvMode::Residual {
                // 0.5 to start with, plus the squares of the new residual rows as stored.
                for b in 0..batch {
                    let row = &y[b * case.rows..(b + 1) * case.rows];
                    let want = 0.5
                        + row
                            .iter()
                            .map(|&v| f64::from(from_bf16(v)).powi(2))
                            .sum::<f64>();
                    let got = f64::from(sumsq_out[b]);
                    assert!(
                        (got - want).abs() < 1e-4 * want,
                        "batch {batch} row {b}: {got} vs {want}"
                    );
                }
            } else {
                assert_eq!(
                    zeroed,
                    vec![0.0; batch],
                    "{mode:?} must zero the next accumulator"
                );
            }
        }
    }
}

#[test]
fn gemv_agrees_with_cublas() {
    let _lock = gpu_lock();
    let Some(gpu) = open_gpu() else { return };
    for batch in [1usize, 4, 8] {
        let (rows, cols) = (520usize, 1032usize);
        let mut case = GemvCase::new(GemvMode::Residual, batch, rows, cols, 40 + batch as u64);
        case.y0 = vec![0; batch * rows]; // Y = 0 + W·X
        let (gemv_y, _, _) = run_gemv(&gpu, GemvMode::Residual, &case, 0.0);
        let (dw, dx) = (upload(&gpu, &case.w), upload(&gpu, &case.x));
        let dy = upload(&gpu, &vec![POISON; batch * rows]);
        gpu.bind().unwrap();
        gpu.gemm(
            rows as u32,
            batch as u32,
            cols as u32,
            gpu.addr(&dw, 0),
            gpu.addr(&dx, 0),
            cols as u32,
            gpu.addr(&dy, 0),
            rows as u32,
            false,
        )
        .unwrap();
        let cublas_y = download(&gpu, &dy);
        let err = relative_error(&floats(&gemv_y), &floats(&cublas_y));
        assert!(err < BF16_TOLERANCE, "batch {batch}: relative error {err}");
    }
}

/// CPU reference of decode attention for one (sequence, KV head): returns the G head outputs
/// and the new key and value as stored in the cache.
#[allow(clippy::too_many_arguments)]
fn attention_reference(
    qkv_row: &[f64],
    k_seq: &[f64],
    v_seq: &[f64],
    shape: &ModelShape,
    kvh: usize,
    context: usize,
) -> (Vec<f64>, Vec<u16>, Vec<f64>) {
    let hd = shape.head_dim as usize;
    let g = shape.group_size() as usize;
    let (heads, kv_heads) = (shape.heads as usize, shape.kv_heads as usize);
    let pos = context - 1;
    let k_new = rope_reference(
        &qkv_row[heads * hd + kvh * hd..][..hd],
        pos as u32,
        shape.rope_theta,
    );
    let k_new_bf16: Vec<u16> = k_new.iter().map(|&v| to_bf16(v as f32)).collect();
    let v_new = qkv_row[(heads + kv_heads) * hd + kvh * hd..][..hd].to_vec();
    let key = |p: usize| -> Vec<f64> {
        if p == pos {
            k_new_bf16
                .iter()
                .map(|&v| f64::from(from_bf16(v)))
                .collect()
        } else {
            k_seq[p * hd..(p + 1) * hd].to_vec()
        }
    };
    let value = |p: usize| -> &[f64] {
        if p == pos {
            &v_new
        } else {
            &v_seq[p * hd..(p + 1) * hd]
        }
    };
    let mut out = Vec::new();
    for head in 0..g {
        let q = rope_reference(
            &qkv_row[(kvh * g + head) * hd..][..hd],
            pos as u32,
            shape.rope_theta,
        );
        let scores: Vec<f64> = (0..context)
            .map(|p| key(p).iter().zip(&q).map(|(k, q)| k * q).sum::<f64>() / (hd as f64).sqrt())
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        for d in 0..hd {
            out.push((0..context).map(|p| weights[p] * value(p)[d]).sum::<f64>() / total);
        }
    }
    (out, k_new_bf16, v_new)
}

fn tiny_shape(head_dim: u32, heads: u32, kv_heads: u32) -> ModelShape {
    let text = format!(
        "[tiny]\nhidden = 256\nlayers = 2\nheads = {heads}\nkv_heads = {kv_heads}\nhead_dim = {head_dim}\nmlp = 512\nvocab = 1000\n"
    );
    parse_presets(&text).unwrap().remove("tiny").unwrap()
}

#[test]
fn attention_matches_the_cpu_with_and_without_splits() {
    let _lock = gpu_lock();
    let Some(gpu) = open_gpu() else { return };
    // (head_dim, heads, kv_heads): both head sizes, groups of 4, 1 and 8.
    for (head_dim, heads, kv_heads) in [(128u32, 8u32, 2u32), (64, 4, 4), (64, 8, 1), (128, 8, 1)] {
        let shape = tiny_shape(head_dim, heads, kv_heads);
        let (batch, context) = (3usize, 300usize);
        let (hd, nkv, g) = (
            head_dim as usize,
            kv_heads as usize,
            shape.group_size() as usize,
        );
        let width = shape.qkv_dim() as usize;
        let mut rng = Rng(u64::from(head_dim * heads));
        let qkv = rng.bf16s(batch * width, 1.5, 0.0);
        let k_cache = rng.bf16s(batch * nkv * context * hd, 1.0, 0.0);
        let v_cache = rng.bf16s(batch * nkv * context * hd, 1.0, 0.0);
        // The residual stream whose RMSNorm factor scales q, k and v when given.
        let hidden = shape.hidden as usize;
        let x = rng.bf16s(batch * hidden, 2.0, 0.0);
        let (dx, xf) = (upload(&gpu, &x), floats(&x));
        // One block per (sequence, KV head); even splits; uneven splits with a short last one.
        for split in [
            AttentionSplit {
                splits: 1,
                chunk: 300,
            },
            AttentionSplit {
                splits: 4,
                chunk: 75,
            },
            AttentionSplit {
                splits: 3,
                chunk: 128,
            },
            // Merged in a thread block cluster where the GPU has them: 10, and the largest
            // cluster (16, with a short last split).
            AttentionSplit {
                splits: 10,
                chunk: 30,
            },
            AttentionSplit {
                splits: 16,
                chunk: 19,
            },
            // More splits than a cluster holds or the L2 merge loads at once.
            AttentionSplit {
                splits: 20,
                chunk: 15,
            },
        ] {
            let dqkv = upload(&gpu, &qkv);
            let (dk, dv) = (upload(&gpu, &k_cache), upload(&gpu, &v_cache));
            let mut out = upload(&gpu, &vec![POISON; batch * heads as usize * hd]);
            let pairs = batch * nkv * split.splits as usize;
            let part_o = upload(&gpu, &vec![0f32; pairs * g * hd]);
            let part_ml = upload(&gpu, &vec![0f32; pairs * g * 2]);
            let counters = upload(&gpu, &vec![0u32; batch * nkv]);
            for (implementation, with_norm) in AttentionImpl::ALL
                .into_iter()
                .flat_map(|i| [(i, false), (i, true)])
            {
                let kernel = gpu
                    .kernels
                    .attention(head_dim, shape.group_size(), implementation)
                    .unwrap();
                let args = AttentionArgs {
                    batch: batch as u32,
                    qkv: gpu.addr(&dqkv, 0),
                    k_cache: gpu.addr(&dk, 0),
                    v_cache: gpu.addr(&dv, 0),
                    context: context as u32,
                    out: gpu.addr(&out, 0),
                    part_o: gpu.addr(&part_o, 0),
                    part_ml: gpu.addr(&part_ml, 0),
                    counters: gpu.addr(&counters, 0),
                    split,
                    norm_of: if with_norm { gpu.addr(&dx, 0) } else { 0 },
                };
                // Twice: the merge must leave its arrival counters ready for the next launch.
                for launch in 0..2 {
                    gpu.upload(&vec![POISON; batch * heads as usize * hd], &mut out)
                        .unwrap();
                    launch_attention(&gpu, kernel, &shape, args).unwrap();
                    let got = floats(&download(&gpu, &out));
                    let got_k = download(&gpu, &dk);
                    let got_v = download(&gpu, &dv);
                    let (qf, kf, vf) = (floats(&qkv), floats(&k_cache), floats(&v_cache));
                    let mut want = Vec::new();
                    for b in 0..batch {
                        let r = if with_norm {
                            rms_factor(&xf[b * hidden..(b + 1) * hidden], shape.norm_eps as f32)
                        } else {
                            1.0
                        };
                        let row: Vec<f64> = qf[b * width..(b + 1) * width]
                            .iter()
                            .map(|v| v * r)
                            .collect();
                        for kvh in 0..nkv {
                            let seq = (b * nkv + kvh) * context * hd;
                            let (o, k_new, v_new) = attention_reference(
                                &row,
                                &kf[seq..seq + context * hd],
                                &vf[seq..seq + context * hd],
                                &shape,
                                kvh,
                                context,
                            );
                            want.extend(o);
                            let slot = seq + (context - 1) * hd;
                            for d in 0..hd {
                                let (got, expected) = (got_k[slot + d], k_new[d]);
                                assert!(
                                    got.abs_diff(expected) <= 1,
                                    "key slot: {got:#x} vs {expected:#x}"
                                );
                                let (got, expected) = (got_v[slot + d], to_bf16(v_new[d] as f32));
                                assert!(
                                    got.abs_diff(expected) <= 1,
                                    "value slot: {got:#x} vs {expected:#x}"
                                );
                            }
                            assert_eq!(
                                got_k[seq..slot],
                                k_cache[seq..slot],
                                "earlier keys must not change"
                            );
                        }
                    }
                    let err = relative_error(&got, &want);
                    assert!(
                        err < BF16_TOLERANCE,
                        "hd {head_dim} g {g} {} norm {with_norm} {split:?} launch {launch}: \
                         relative error {err}",
                        implementation.name()
                    );
                    assert_eq!(
                        download(&gpu, &counters),
                        vec![0; batch * nkv],
                        "counters reset"
                    );
                }
            }
        }
    }
}

#[test]
fn attention_splits_merge_in_a_cluster_where_the_gpu_has_clusters() {
    let _lock = gpu_lock();
    let Some(gpu) = open_gpu() else { return };
    if !gpu.clusters_supported() {
        println!("skipping: {} has no thread block clusters", gpu.name);
        return;
    }
    // llama-3-8b at batch 1: 16 splits of 64 positions, 8 KV heads, group 4.
    let shape = ModelShape::preset("llama-3-8b").unwrap();
    let split = AttentionSplit {
        splits: 16,
        chunk: 64,
    };
    // Twice: the second round is answered from the cache, one driver query per shape.
    for _ in 0..2 {
        for implementation in AttentionImpl::ALL {
            let kernel = gpu.kernels.attention(128, 4, implementation).unwrap();
            let shared = split.shared_bytes(shape.group_size());
            let grid = (split.splits, shape.kv_heads, 1);
            assert!(
                gpu.cluster_fits(kernel, grid, gpu.attention_threads(), shared, 16),
                "{}: a cluster of 16 must fit, or the merge falls back to L2",
                implementation.name()
            );
            // A cluster must divide the grid.
            assert!(!gpu.cluster_fits(kernel, grid, gpu.attention_threads(), shared, 3));
        }
        assert_eq!(gpu.cluster_shapes_asked(), AttentionImpl::ALL.len());
    }
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
            println!("skipping: no CUDA driver: {error}");
            None
        }
        Err(error) => panic!("{error}"),
    }
}

/// The tiny test model: context 100, batches up to 8.
fn tiny_engine_with(options: EngineOptions) -> Option<Engine> {
    engine_or_skip(&tiny_shape(64, 4, 2), 100, 8, options)
}

fn tiny_engine(matmul: MatmulChoice, pdl: bool) -> Option<Engine> {
    tiny_engine_with(EngineOptions {
        matmul,
        pdl,
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

#[test]
fn both_matmul_paths_compute_the_same_step() {
    let _lock = gpu_lock();
    let Some(mut engine) = tiny_engine(MatmulChoice::Auto, false) else {
        return;
    };
    let vocab = engine.shape().vocab as usize;
    for batch in [1u32, 3, 8] {
        let start: Vec<u32> = (0..batch).map(|b| 11 + 97 * b).collect();
        let mut logits = Vec::new();
        for path in [MatmulPath::Gemv, MatmulPath::Cublas] {
            engine.set_tokens(&start).unwrap();
            engine.step_eager(batch, path).unwrap();
            let l = engine.logits(batch).unwrap();
            // The step's tokens are the greedy choice over its own logits.
            assert_eq!(
                engine.tokens(batch).unwrap(),
                cpu_argmax(&l, vocab),
                "{path:?} batch {batch}"
            );
            logits.push(floats(&l));
        }
        let err = relative_error(&logits[0], &logits[1]);
        assert!(
            err < 2e-2,
            "batch {batch}: gemv vs cublas logits differ by {err}"
        );
    }
}

#[test]
fn every_step_variant_replayed_as_a_graph_matches_eager_launches() {
    let _lock = gpu_lock();
    let Some(mut engine) = tiny_engine(MatmulChoice::Auto, true) else {
        return;
    };
    for batch in [2u32, 5, 8] {
        let start: Vec<u32> = (0..batch).map(|b| 5 + 31 * b).collect();
        let variants = engine.variants(batch);
        // Both paths, both attention implementations, and PDL on and off where the GPU has it.
        assert!(variants.len() >= 4, "{variants:?}");
        for variant in variants {
            engine.set_tokens(&start).unwrap();
            engine.step_eager(batch, variant.path).unwrap();
            let eager = floats(&engine.logits(batch).unwrap());
            engine.set_tokens(&start).unwrap();
            engine.replay_variant(batch, variant).unwrap();
            let replayed = floats(&engine.logits(batch).unwrap());
            let err = relative_error(&replayed, &eager);
            // Only the order of float atomics in the fused norms may differ.
            assert!(err < 1e-2, "{} batch {batch}: {err}", variant.label());
        }
    }
}

#[test]
fn a_prepared_graph_steps_and_reports_its_time() {
    let _lock = gpu_lock();
    for matmul in [MatmulChoice::Gemv, MatmulChoice::Cublas] {
        let Some(mut engine) = tiny_engine(matmul, false) else {
            return;
        };
        let path = if matmul == MatmulChoice::Gemv {
            MatmulPath::Gemv
        } else {
            MatmulPath::Cublas
        };
        let info = engine.prepare(3).unwrap().clone();
        assert_eq!(info.variant.path, path);
        engine.set_tokens(&[1, 2, 3]).unwrap();
        engine.launch_step(3).unwrap();
        let done = engine.drain().unwrap();
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].batch, 3);
        assert!(done[0].gpu_ms > 0.0);
        let logits = engine.logits(3).unwrap();
        assert_eq!(
            engine.tokens(3).unwrap(),
            cpu_argmax(&logits, engine.shape().vocab as usize)
        );
    }
}

#[test]
fn batch_size_changes_between_steps_without_reallocation() {
    let _lock = gpu_lock();
    let Some(mut engine) = tiny_engine(MatmulChoice::Auto, false) else {
        return;
    };
    let vocab = engine.shape().vocab;
    let mut seen = Vec::new();
    for batch in [1u32, 3, 8, 3, 1, 7] {
        engine.launch_step(batch).unwrap();
        seen.extend(engine.drain().unwrap().into_iter().map(|d| d.batch));
        assert!(engine.tokens(batch).unwrap().iter().all(|&t| t < vocab));
        let info = engine.graph_info(batch).unwrap();
        assert_eq!(
            info.attention,
            AttentionSplit::plan(engine.shape(), batch, 100, engine.gpu().sms)
        );
        // Both matmul paths and both attention implementations.
        let timed = &info.candidates_ms;
        assert!(timed.len() >= 4, "{timed:?}");
        assert!(timed.iter().any(|(v, _)| v.path == MatmulPath::Gemv));
        assert!(timed.iter().any(|(v, _)| v.path == MatmulPath::Cublas));
        assert!(timed.iter().all(|(_, ms)| *ms > 0.0));
    }
    assert_eq!(seen, [1, 3, 8, 3, 1, 7]);
    let err = engine.launch_step(9).unwrap_err().to_string();
    assert!(err.contains("batch size 9 is out of range"), "{err}");
}

#[test]
fn nearest_tuning_times_once_then_reuses_the_nearest_choice() {
    let _lock = gpu_lock();
    let Some(mut tuned) = tiny_engine(MatmulChoice::Auto, false) else {
        return;
    };
    let shape = tuned.shape().clone();
    let Some(mut engine) = tiny_engine_with(EngineOptions {
        tuning: Tuning::Nearest,
        ..EngineOptions::default()
    }) else {
        return;
    };
    let first = engine.prepare(2).unwrap().clone();
    assert_eq!(first.chosen_for, None);
    assert!(first.candidates_ms.len() >= 4, "{first:?}");
    // Only timed choices are handed on: every later size takes batch 2's.
    for batch in [3u32, 8, 1] {
        let info = engine.prepare(batch).unwrap().clone();
        assert_eq!(info.chosen_for, Some(2), "batch {batch}");
        assert_eq!(info.variant, first.variant, "batch {batch}");
        assert!(
            info.candidates_ms.is_empty(),
            "batch {batch}: nothing timed"
        );
        assert_eq!(
            info.attention,
            AttentionSplit::plan(&shape, batch, 100, engine.gpu().sms),
            "the split still fits the batch size"
        );
    }
    // Same weights, same input: the reused variant computes what a fully tuned engine does
    // (up to the rounding of whichever variant each chose).
    let vocab = shape.vocab as usize;
    let mut logits = Vec::new();
    for e in [&mut engine, &mut tuned] {
        // Tuning replays the step, which rewrites the tokens: prepare first.
        e.prepare(3).unwrap();
        e.set_tokens(&[5, 6, 7]).unwrap();
        e.launch_step(3).unwrap();
        e.drain().unwrap();
        let l = e.logits(3).unwrap();
        assert_eq!(e.tokens(3).unwrap(), cpu_argmax(&l, vocab));
        logits.push(floats(&l));
    }
    let err = relative_error(&logits[0], &logits[1]);
    assert!(err < 2e-2, "nearest vs fully tuned logits differ by {err}");
}

#[test]
fn a_model_larger_than_the_gpu_is_refused_with_the_sizes() {
    let _lock = gpu_lock();
    let shape = ModelShape::preset("llama-3.1-70b").unwrap();
    match Engine::new(&shape, 1024, 64, 0, EngineOptions::default()) {
        Err(CudaError::OutOfMemory {
            what,
            needed_bytes,
            free_bytes,
        }) => {
            assert!(needed_bytes > free_bytes);
            assert!(what.contains("llama-3.1-70b"), "{what}");
        }
        Err(error) if no_cuda(&error) => println!("skipping: no CUDA driver: {error}"),
        Err(error) => panic!("expected out of memory, got {error}"),
        Ok(engine) => {
            let (_, total) = engine.gpu().memory().unwrap();
            assert!(
                total > shape.weight_bytes(),
                "a GPU that holds 141 GB of weights"
            );
        }
    }
}

// ---- the workload -----------------------------------------------------------------------

#[test]
fn without_a_driver_construction_fails_cleanly() {
    // SAFETY: only tries to dlopen libcuda.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        println!("skipping: a CUDA driver is present; this checks machines without one");
        return;
    }
    let config = CudaDecodeConfig::new(tiny_shape(64, 4, 2), 100, 4);
    let err = CudaDecode::new(config).unwrap_err().to_string();
    assert!(
        err.starts_with("CUDA driver not found (libcuda.so): "),
        "{err}"
    );
}

#[test]
fn the_workload_decodes_on_its_own_thread_and_follows_the_batch_size() {
    let _lock = gpu_lock();
    let mut config = CudaDecodeConfig::new(tiny_shape(64, 4, 2), 100, 4);
    config.batch_size = 2;
    let mut decode = match CudaDecode::new(config) {
        Ok(decode) => decode,
        Err(error) if no_cuda(&error) => return println!("skipping: no CUDA driver: {error}"),
        Err(error) => panic!("{error}"),
    };
    assert_eq!(decode.name(), "cuda-decode");
    assert_eq!((decode.batch_size_max(0), decode.batch_size(0)), (4, 2));
    // Wait (boundedly) for steps rather than assuming how long they take.
    let wait_for_steps = |decode: &mut CudaDecode| {
        for _ in 0..6000 {
            let window = decode.read_window(0).unwrap();
            if window.steps > 0 {
                return window;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("no decode step finished within a minute");
    };
    let first = wait_for_steps(&mut decode);
    assert_eq!(first.tokens, 2 * first.steps);
    assert_eq!(
        (first.active_sequences, first.batch_size, first.queue_depth),
        (2, 2, 0)
    );
    assert!(first.tpot_p50_ms > 0.0 && first.tpot_p99_ms >= first.tpot_p50_ms);

    decode.set_batch_size(0, 3).unwrap();
    assert_eq!(decode.batch_size(0), 3);
    // Steps queued at batch 2 may still land in the next windows; then only batch 3 remains.
    let mut only_threes = false;
    for _ in 0..6000 {
        let window = decode.read_window(0).unwrap();
        assert!(
            window.tokens >= 2 * window.steps && window.tokens <= 3 * window.steps,
            "{window:?}"
        );
        if window.steps > 0 && window.tokens == 3 * window.steps && window.batch_size == 3 {
            only_threes = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(only_threes, "no window of batch-3 steps within a minute");

    assert!(matches!(
        decode.set_batch_size(0, 5),
        Err(WorkloadError::BatchOutOfRange {
            requested: 5,
            max: 4
        })
    ));
    assert!(matches!(
        decode.set_batch_size(1, 2),
        Err(WorkloadError::NoSuchGpu { index: 1, count: 1 })
    ));
    assert!(matches!(
        decode.read_window(1),
        Err(WorkloadError::NoSuchGpu { .. })
    ));
    drop(decode); // joins the thread
}

/// A device benchmark's setting from the environment, or its default.
fn bench_env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// The model and context of the device benchmarks: `TOKWATT_BENCH_MODEL` (llama-3-8b) and
/// `TOKWATT_BENCH_CONTEXT` (1024).
fn bench_model() -> (ModelShape, u32) {
    let model = ModelShape::preset(&bench_env("TOKWATT_BENCH_MODEL", "llama-3-8b")).unwrap();
    let context = bench_env("TOKWATT_BENCH_CONTEXT", "1024").parse().unwrap();
    (model, context)
}

/// The batch sizes in `TOKWATT_BENCH_BATCHES` (comma-separated), or `default`'s.
fn bench_batches(default: &str) -> Vec<u32> {
    bench_env("TOKWATT_BENCH_BATCHES", default)
        .split(',')
        .map(|b| b.trim().parse().unwrap())
        .collect()
}

/// The benchmark table on a real GPU (ignored: minutes of device time). Environment:
/// `TOKWATT_BENCH_MODEL` (llama-3-8b), `TOKWATT_BENCH_CONTEXT` (1024), `TOKWATT_BENCH_BATCHES`
/// (1,4,16,64,128,256,512), `TOKWATT_BENCH_SECONDS` (3), `TOKWATT_BENCH_WARMUP` (1),
/// `TOKWATT_BENCH_PDL` (0), `TOKWATT_BENCH_MATMUL` (auto|gemv|cublas),
/// `TOKWATT_BENCH_ATTENTION` (auto, or one implementation's name: cuda-cores, tensor-cores,
/// tensor-scores, tensor-values); `TOKWATT_ENERGY_FILE`, a
/// file holding a joules counter that something else keeps current; `TOKWATT_REFERENCE_JSON`,
/// the PyTorch reference's output, printed beside ours; `TOKWATT_BENCH_JSON`, where to write rows.
#[test]
#[ignore]
fn bench_on_device() {
    let (model, context) = bench_model();
    let batches = bench_batches("1,4,16,64,128,256,512");
    let mut config = BenchConfig::new(
        model,
        context,
        batches,
        bench_env("TOKWATT_BENCH_SECONDS", "3").parse().unwrap(),
    );
    config.warmup_seconds = bench_env("TOKWATT_BENCH_WARMUP", "1").parse().unwrap();
    config.engine.pdl = bench_env("TOKWATT_BENCH_PDL", "0") == "1";
    config.engine.attention =
        AttentionImpl::from_name(&bench_env("TOKWATT_BENCH_ATTENTION", "auto"))
            .map_or(AttentionChoice::Auto, AttentionChoice::Only);
    config.engine.matmul = match bench_env("TOKWATT_BENCH_MATMUL", "auto").as_str() {
        "gemv" => MatmulChoice::Gemv,
        "cublas" => MatmulChoice::Cublas,
        _ => MatmulChoice::Auto,
    };
    let energy_file = std::env::var("TOKWATT_ENERGY_FILE").ok();
    let mut energy = || -> Option<f64> {
        std::fs::read_to_string(energy_file.as_ref()?)
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let reference: Vec<(u32, f64)> = std::env::var("TOKWATT_REFERENCE_JSON")
        .ok()
        .and_then(|path| std::fs::read_to_string(path).ok())
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|json| {
            json["sweep"].as_array().map(|rows| {
                rows.iter()
                    .filter_map(|r| {
                        Some((
                            u32::try_from(r["batch"].as_u64()?).ok()?,
                            r["tok_s"].as_f64()?,
                        ))
                    })
                    .collect()
            })
        })
        .unwrap_or_default();
    let lookup = |batch: u32| reference.iter().find(|(b, _)| *b == batch).map(|(_, t)| *t);
    let mut print_row = |row: &super::BenchRow| {
        println!("row {}", serde_json::to_string(row).unwrap());
    };
    let rows = match bench_with(&config, &mut energy, &mut print_row) {
        Ok(rows) => rows,
        Err(error) if no_cuda(&error) => return println!("skipping: no CUDA driver: {error}"),
        Err(error) => panic!("{error}"),
    };
    println!(
        "{} ctx {} pdl {}",
        config.model.name, context, config.engine.pdl
    );
    print!("{}", format_table(&rows, &lookup));
    if let Ok(path) = std::env::var("TOKWATT_BENCH_JSON") {
        std::fs::write(path, serde_json::to_string_pretty(&rows).unwrap()).unwrap();
    }
}

/// Per-part timings on a real GPU (ignored): each launch kind of a step, alone, with its
/// achieved read bandwidth. `TOKWATT_BENCH_MODEL`, `TOKWATT_BENCH_CONTEXT`,
/// `TOKWATT_BENCH_BATCHES` and `TOKWATT_BENCH_PDL` as for `bench_on_device`.
#[test]
#[ignore]
fn profile_parts_on_device() {
    let _lock = gpu_lock();
    let (model, context) = bench_model();
    let batches = bench_batches("1,8,16,64,512");
    let options = EngineOptions {
        pdl: bench_env("TOKWATT_BENCH_PDL", "0") == "1",
        ..EngineOptions::default()
    };
    let batch_max = batches.iter().copied().max().unwrap();
    let Some(mut engine) = engine_or_skip(&model, context, batch_max, options) else {
        return;
    };
    println!("{} on {} ctx {context}", model.name, engine.gpu_name());
    for batch in batches {
        for part in engine.profile_parts(batch).unwrap() {
            println!(
                "part batch {batch:<4} {:<40} {:>10.2} us {:>8.3} TB/s",
                part.name,
                part.micros,
                part.bytes as f64 / part.micros / 1e6
            );
        }
    }
}

/// The stall a new batch size costs on a real GPU (ignored): `prepare` of sizes not seen
/// before, after batch 1 was tuned, under each tuning mode. `TOKWATT_BENCH_MODEL` and
/// `TOKWATT_BENCH_CONTEXT` as for `bench_on_device`.
#[test]
#[ignore]
fn batch_change_pause_on_device() {
    let _lock = gpu_lock();
    let (model, context) = bench_model();
    for tuning in [Tuning::EveryBatch, Tuning::Nearest] {
        let options = EngineOptions {
            tuning,
            ..EngineOptions::default()
        };
        let Some(mut engine) = engine_or_skip(&model, context, 256, options) else {
            return;
        };
        engine.prepare(1).unwrap();
        let mut pauses = Vec::new();
        for batch in [2u32, 3, 5, 9, 17, 33, 65, 129, 256] {
            let started = std::time::Instant::now();
            engine.prepare(batch).unwrap();
            pauses.push(started.elapsed().as_secs_f64() * 1e3);
        }
        pauses.sort_by(f64::total_cmp);
        println!(
            "pause {tuning:?}: median {:.1} ms, max {:.1} ms over {} new batch sizes",
            pauses[pauses.len() / 2],
            pauses[pauses.len() - 1],
            pauses.len()
        );
    }
}
