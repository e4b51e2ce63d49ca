//! Each small kernel, and the matrix-vector kernels, against a CPU reference.

use super::*;

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
