//! Decode attention against a CPU reference, with and without context splits and clusters.

use super::*;

/// CPU reference of decode attention for one (sequence, KV head): returns the G head outputs
/// and the new key and value as stored in the cache.
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
        tokwatt_test_support::skip_gpu(format_args!("{} has no thread block clusters", gpu.name));
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
