//! The prefill benchmark behind `tokwatt bench prefill`: prompt tokens per second, watts and
//! tokens per joule per (prompt length, sequences per call), measured as the PyTorch reference
//! in the calibration data measures its causal-SDPA prefill, so that the two can run side by
//! side in one GPU session.

use std::time::Instant;

use serde::Serialize;

use super::device::PrefillAttention;
use super::engine::{Engine, EngineOptions, MAX_PREFILL_ROWS, PrefillChunk};
use super::error::CudaError;
use super::shape::ModelShape;

/// The PyTorch reference's cases: (prompt tokens, sequences per call).
pub const REFERENCE_PREFILL_CASES: [(u32, u32); 9] = [
    (128, 1),
    (512, 1),
    (2048, 1),
    (8192, 1),
    (128, 16),
    (512, 8),
    (2048, 4),
    (512, 32),
    (1024, 16),
];

/// Calls before each measurement (as the reference: compile, allocate, warm the clocks).
const WARMUP_CALLS: u32 = 2;

/// One case's measurement. Field names follow the reference's JSON lines.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PrefillRow {
    pub kind: &'static str,
    pub prompt: u32,
    pub sequences: u32,
    /// The prefill attention's tiling.
    pub attention: &'static str,
    pub calls: u64,
    /// Wall time per prefill call, ms.
    pub call_ms: f64,
    pub tokens_per_s: f64,
    /// Average power from the energy counter; `None` without one.
    pub watts: Option<f64>,
    pub tokens_per_j: Option<f64>,
}

/// Measures each `(prompt, sequences)` case with each attention tiling for `seconds` on GPU
/// `device`: whole prompts from position 0, every sequence's first token computed, the GPU
/// synchronised every 4 calls. `energy` returns a joules counter (NVML's total energy), or
/// `None` when there is none.
#[allow(clippy::too_many_arguments)]
pub fn bench_prefill(
    model: &ModelShape,
    cases: &[(u32, u32)],
    tilings: &[PrefillAttention],
    seconds: f64,
    device: u32,
    energy: &mut dyn FnMut() -> Option<f64>,
    on_row: &mut dyn FnMut(&PrefillRow),
) -> Result<Vec<PrefillRow>, CudaError> {
    if cases.is_empty() || tilings.is_empty() {
        return Err(CudaError::Config(
            "no prefill cases or attention tilings to measure".into(),
        ));
    }
    if !(seconds.is_finite() && (0.0..=86_400.0).contains(&seconds)) {
        return Err(CudaError::Config(format!(
            "seconds per case must be between 0 and 86400 (a day), not {seconds}"
        )));
    }
    for &(prompt, sequences) in cases {
        let rows = u64::from(prompt) * u64::from(sequences);
        if prompt == 0 || sequences == 0 || rows > u64::from(MAX_PREFILL_ROWS) {
            return Err(CudaError::Config(format!(
                "prefill case {prompt}x{sequences}: use prompts and sequences of at least 1, at most {MAX_PREFILL_ROWS} tokens per call"
            )));
        }
    }
    let context = cases.iter().map(|c| c.0).max().unwrap_or(1);
    let slots = cases.iter().map(|c| c.1).max().unwrap_or(1);
    let mut engine = Engine::new(model, context, slots, device, EngineOptions::default())?;
    if engine.batch_max() < slots {
        return Err(CudaError::Config(format!(
            "{slots} sequences of {context} positions do not fit the GPU's memory with {} (at most {})",
            model.name,
            engine.batch_max()
        )));
    }
    let mut rows = Vec::with_capacity(cases.len() * tilings.len());
    for (&(prompt, sequences), &tiling) in cases
        .iter()
        .flat_map(|case| tilings.iter().map(move |t| (case, t)))
    {
        engine.set_prefill_attention(tiling);
        let chunks: Vec<PrefillChunk> = (0..sequences)
            .map(|slot| PrefillChunk {
                slot,
                start: 0,
                len: prompt,
                ends_prompt: true,
            })
            .collect();
        let tokens: Vec<u32> = (0..prompt * sequences)
            .map(|i| i.wrapping_mul(2_654_435_761) % model.vocab)
            .collect();
        for _ in 0..WARMUP_CALLS {
            engine.prefill(&chunks, &tokens)?;
        }
        engine.synchronize()?;
        let e0 = energy();
        let t0 = Instant::now();
        let mut calls = 0u64;
        while t0.elapsed().as_secs_f64() < seconds || calls == 0 {
            engine.prefill(&chunks, &tokens)?;
            calls += 1;
            if calls.is_multiple_of(4) {
                engine.synchronize()?;
            }
        }
        engine.synchronize()?;
        let wall = t0.elapsed().as_secs_f64();
        let joules = match (e0, energy()) {
            (Some(a), Some(b)) if b > a => Some(b - a),
            _ => None,
        };
        let tokens_made = (calls * u64::from(prompt) * u64::from(sequences)) as f64;
        let row = PrefillRow {
            kind: "prefill",
            prompt,
            sequences,
            attention: tiling.name(),
            calls,
            call_ms: 1000.0 * wall / calls as f64,
            tokens_per_s: tokens_made / wall,
            watts: joules.map(|j| j / wall),
            tokens_per_j: joules.map(|j| tokens_made / j),
        };
        on_row(&row);
        rows.push(row);
    }
    Ok(rows)
}
