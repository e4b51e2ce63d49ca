//! Prefill against a CPU reference: the keys and values it writes to the cache, its causal
//! attention over whole prompts and over chunks with a prefix already cached, and a prompt
//! prefilled in chunks against the same prompt in one call.

use super::*;
use crate::device::PrefillAttention;
use crate::engine::PrefillChunk;

/// Causal attention of one query row (after RoPE) over positions `0..=pos` of one sequence's
/// cache for its KV head, `[position][head_dim]`.
fn causal_reference(q: &[f64], keys: &[f64], values: &[f64], pos: usize) -> Vec<f64> {
    let hd = q.len();
    let scores: Vec<f64> = (0..=pos)
        .map(|p| {
            keys[p * hd..(p + 1) * hd]
                .iter()
                .zip(q)
                .map(|(k, q)| k * q)
                .sum::<f64>()
                / (hd as f64).sqrt()
        })
        .collect();
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let total: f64 = weights.iter().sum();
    (0..hd)
        .map(|d| {
            (0..=pos)
                .map(|p| weights[p] * values[p * hd + d])
                .sum::<f64>()
                / total
        })
        .collect()
}

fn prompt_tokens(n: u32, seed: u32) -> Vec<u32> {
    (0..n)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 1000)
        .collect()
}

#[test]
fn prefill_attention_and_cache_writes_match_the_cpu() {
    let _lock = gpu_lock();
    for (head_dim, heads, kv_heads, tiling) in [(128u32, 8u32, 2u32), (64, 4, 4), (64, 8, 1)]
        .into_iter()
        .flat_map(|(hd, h, kv)| PrefillAttention::ALL.map(|t| (hd, h, kv, t)))
    {
        let shape = tiny_shape(head_dim, heads, kv_heads);
        let context = 300u32;
        let Some(mut engine) = engine_or_skip(&shape, context, 3, EngineOptions::default()) else {
            return;
        };
        engine.set_prefill_attention(tiling);
        // Slot 1's first 70 positions are prefilled by an earlier call: the second call's
        // chunk attends over them as its cached prefix.
        engine
            .prefill(
                &[PrefillChunk {
                    slot: 1,
                    start: 0,
                    len: 70,
                    ends_prompt: false,
                }],
                &prompt_tokens(70, 1),
            )
            .unwrap();
        // Whole prompts of 150 (over two query tiles, a short last one) and 1, and a chunk of
        // 130 after a cached prefix of 70.
        let chunks = [
            PrefillChunk {
                slot: 0,
                start: 0,
                len: 150,
                ends_prompt: true,
            },
            PrefillChunk {
                slot: 1,
                start: 70,
                len: 130,
                ends_prompt: true,
            },
            PrefillChunk {
                slot: 2,
                start: 0,
                len: 1,
                ends_prompt: true,
            },
        ];
        let tokens: Vec<u32> = [(150, 0), (130, 2), (1, 3)]
            .iter()
            .flat_map(|&(n, seed)| prompt_tokens(n, seed))
            .collect();
        engine.prefill(&chunks, &tokens).unwrap();
        engine.synchronize().unwrap();

        let rows = tokens.len();
        let (hd, nh, nkv) = (head_dim as usize, heads as usize, kv_heads as usize);
        let width = shape.qkv_dim() as usize;
        let qkv = floats(&engine.prefill_qkv(rows).unwrap());
        let attn = floats(&engine.prefill_attention(rows).unwrap());
        let (k_cache, v_cache) = engine.kv_cache(shape.layers as usize - 1).unwrap();
        let (k_cache, v_cache) = (floats(&k_cache), floats(&v_cache));
        let ctx = context as usize;
        let mut got = Vec::new();
        let mut want = Vec::new();
        let mut row0 = 0usize;
        for chunk in &chunks {
            let slot = chunk.slot as usize;
            for local in 0..chunk.len as usize {
                let row = row0 + local;
                let pos = chunk.start as usize + local;
                for kvh in 0..nkv {
                    let base = (slot * nkv + kvh) * ctx * hd;
                    let keys = &k_cache[base..base + ctx * hd];
                    let values = &v_cache[base..base + ctx * hd];
                    // The cache holds this row's key after RoPE and its value as computed.
                    let k_row = &qkv[row * width + (nh + kvh) * hd..][..hd];
                    let k_roped = rope_reference(k_row, pos as u32, shape.rope_theta);
                    got.extend_from_slice(&keys[pos * hd..(pos + 1) * hd]);
                    want.extend(k_roped);
                    got.extend_from_slice(&values[pos * hd..(pos + 1) * hd]);
                    want.extend_from_slice(&qkv[row * width + (nh + nkv + kvh) * hd..][..hd]);
                    for head in kvh * (nh / nkv)..(kvh + 1) * (nh / nkv) {
                        let q = &qkv[row * width + head * hd..][..hd];
                        want.extend(causal_reference(q, keys, values, pos));
                        got.extend_from_slice(&attn[row * nh * hd + head * hd..][..hd]);
                    }
                }
            }
            row0 += chunk.len as usize;
        }
        let error = relative_error(&got, &want);
        assert!(
            error < BF16_TOLERANCE,
            "head_dim {head_dim}, {heads}/{kv_heads} heads, {}: relative error {error}",
            tiling.name()
        );
    }
}

#[test]
fn a_prompt_prefilled_in_chunks_gives_the_logits_of_one_call() {
    let _lock = gpu_lock();
    let shape = tiny_shape(128, 8, 2);
    let Some(mut engine) = engine_or_skip(&shape, 300, 2, EngineOptions::default()) else {
        return;
    };
    let tokens = prompt_tokens(200, 7);
    engine
        .prefill(
            &[PrefillChunk {
                slot: 0,
                start: 0,
                len: 200,
                ends_prompt: true,
            }],
            &tokens,
        )
        .unwrap();
    let whole = floats(&engine.prefill_logits(1).unwrap());
    for (start, len) in [(0u32, 64u32), (64, 100), (164, 36)] {
        engine
            .prefill(
                &[PrefillChunk {
                    slot: 1,
                    start,
                    len,
                    ends_prompt: start + len == 200,
                }],
                &tokens[start as usize..(start + len) as usize],
            )
            .unwrap();
    }
    let chunked = floats(&engine.prefill_logits(1).unwrap());
    let error = relative_error(&chunked, &whole);
    assert!(
        error < 2e-2,
        "chunked against whole: relative error {error}"
    );
    // Both sequences got their first generated token as the next decode input.
    let next = engine.tokens(2).unwrap();
    assert_eq!(next[0], next[1], "the same prompt's first token differs");
}

#[test]
fn bad_prefill_calls_are_refused_with_the_reason() {
    let _lock = gpu_lock();
    let shape = tiny_shape(64, 4, 2);
    let Some(mut engine) = engine_or_skip(&shape, 100, 2, EngineOptions::default()) else {
        return;
    };
    let chunk = |slot, start, len| PrefillChunk {
        slot,
        start,
        len,
        ends_prompt: true,
    };
    let cases: [(Vec<PrefillChunk>, usize, &str); 5] = [
        (vec![], 0, "at least one chunk"),
        (vec![chunk(2, 0, 10)], 10, "out of range"),
        (vec![chunk(0, 0, 5), chunk(0, 5, 5)], 10, "appears twice"),
        (vec![chunk(0, 90, 20)], 20, "past the engine's context"),
        (vec![chunk(0, 0, 10)], 9, "token ids"),
    ];
    for (chunks, n, expected) in cases {
        let error = engine
            .prefill(&chunks, &prompt_tokens(n as u32, 0))
            .unwrap_err()
            .to_string();
        assert!(error.contains(expected), "{error}");
    }
}

#[test]
fn a_decoding_row_continues_its_prompt_as_a_longer_prefill_would() {
    let _lock = gpu_lock();
    let shape = tiny_shape(128, 8, 2);
    let Some(mut engine) = engine_or_skip(&shape, 300, 4, EngineOptions::default()) else {
        return;
    };
    let prompt = prompt_tokens(40, 11);
    let whole = |slot, len| PrefillChunk {
        slot,
        start: 0,
        len,
        ends_prompt: true,
    };
    // Slot 1 prefills its prompt; its first generated token becomes its next input.
    engine.prefill(&[whole(1, 40)], &prompt).unwrap();
    let first = engine.tokens(4).unwrap()[1];
    // One serving step: slot 1 decodes that token at position 40, beside slot 2's prompt.
    engine
        .serve_step(
            &[crate::engine::DecodeInput {
                slot: 1,
                position: 40,
            }],
            &[whole(2, 30)],
            &prompt_tokens(30, 12),
        )
        .unwrap();
    let stepped = floats(&engine.prefill_logits(2).unwrap());
    let vocab = shape.vocab as usize;
    // Slot 0 prefills the prompt with that token appended, in one call.
    let mut longer = prompt.clone();
    longer.push(first);
    engine.prefill(&[whole(0, 41)], &longer).unwrap();
    let reference = floats(&engine.prefill_logits(1).unwrap());
    let error = relative_error(&stepped[..vocab], &reference);
    assert!(error < 2e-2, "decode row against a longer prefill: {error}");
    let next = engine.tokens(4).unwrap();
    assert_eq!(next[0], next[1], "the decode row's next token differs");
}

#[test]
fn the_serving_step_bench_measures_each_case_it_is_given() {
    use crate::serving_step_bench::{GpuReading, ServingStepCase, bench_serving_steps};
    let _lock = gpu_lock();
    if open_gpu().is_none() {
        return;
    }
    let shape = tiny_shape(64, 4, 2);
    let cases = [
        ServingStepCase {
            decodes: 3,
            decode_context: 40,
            chunks: 0,
            chunk_len: 0,
            chunk_start: 0,
        },
        ServingStepCase {
            decodes: 2,
            decode_context: 10,
            chunks: 2,
            chunk_len: 33,
            chunk_start: 20,
        },
    ];
    let mut counter = 0.0;
    let mut read = || {
        counter += 5.0;
        GpuReading {
            energy_counter_j: Some(counter),
            sm_mhz: Some(1500),
        }
    };
    let mut seen = Vec::new();
    let rows = bench_serving_steps(&shape, &cases, 0.05, 0, &mut read, &mut |row| {
        seen.push(row.case)
    })
    .unwrap();
    assert_eq!(seen, cases);
    for (row, case) in rows.iter().zip(&cases) {
        assert_eq!(row.case, *case);
        assert!(row.steps >= 1);
        assert!(row.step_ms > 0.0 && row.step_ms_p50 > 0.0, "{row:?}");
        // 5 J over the case's wall time, which is at least the 0.05 s asked for.
        let watts = row.watts.unwrap();
        assert!(watts > 0.0 && watts <= 5.0 / 0.05, "{row:?}");
        assert_eq!(row.sm_mhz, Some(1500));
    }
}
