//! The serving-step benchmark behind `tokwatt bench serving-steps`: the time and power of one
//! step of the serving loop ([`crate::CudaServe`]) for a grid of step compositions (decoding
//! rows at a context, beside prompt chunks), each step run and waited for as the serving
//! thread runs it. The simulator's serving constants (a profile's `[serving]`) are fitted to
//! this table: the closed-loop decode and the whole-prompt prefill tables cannot give them,
//! since a serving step has no CUDA graph and its decoding rows go through the prefill path.

use std::time::Instant;

use serde::Serialize;

use super::engine::{DecodeInput, Engine, EngineOptions, MAX_PREFILL_ROWS, PrefillChunk};
use super::error::CudaError;
use super::shape::ModelShape;

/// One step's composition: `decodes` rows each at position `decode_context` (attending to
/// that many cached positions), then `chunks` prompt chunks of `chunk_len` tokens each,
/// starting at prompt position `chunk_start` (attending to the positions before them too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ServingStepCase {
    pub decodes: u32,
    pub decode_context: u32,
    pub chunks: u32,
    pub chunk_len: u32,
    pub chunk_start: u32,
}

impl ServingStepCase {
    /// Prompt tokens in the step.
    pub fn prefill_tokens(&self) -> u32 {
        self.chunks * self.chunk_len
    }

    /// KV positions a slot needs.
    fn context(&self) -> u32 {
        (self.decode_context + 1).max(self.chunk_start + self.chunk_len)
    }

    fn slots(&self) -> u32 {
        self.decodes + self.chunks
    }
}

/// Which compositions `tokwatt bench serving-steps` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServingStepGrid {
    /// Decoding rows 0-128 at contexts 256-2,047 beside no prompt, one chunk of 128, 512 or
    /// 2,048 tokens from a prompt's start, four of 2,048 (a step of 8,192 prompt tokens, as
    /// a large token budget packs several prompts) and one 512-token chunk late in its
    /// prompt (positions 1,536-2,047: the attention over what came before).
    Standard,
    /// Long prompts and contexts, as a scenario whose requests fill KV slots of 4,096
    /// positions serves them (`serving-budget.toml`: prompts to 3,072, contexts to 4,095):
    /// decoding rows 0-64 at contexts 3,072 and 4,095 beside no prompt, a whole 3,072-token
    /// prompt, two of them, the second half of one (2,048 from position 1,024) and its last
    /// 512. Fewer rows than the standard grid: 66 slots of 4,096 positions are 35 GB of
    /// llama-3-8b's KV cache.
    Long,
}

impl ServingStepGrid {
    /// The grid's cases, each valid for [`bench_serving_steps`].
    pub fn cases(self) -> Vec<ServingStepCase> {
        match self {
            Self::Standard => grid(
                &[
                    (1, 128, 0),
                    (1, 512, 0),
                    (1, 2048, 0),
                    (4, 2048, 0),
                    (1, 512, 1536),
                ],
                &[1, 8, 32, 64, 128],
                &[256, 1024, 2047],
            ),
            Self::Long => grid(
                &[(1, 3072, 0), (2, 3072, 0), (1, 2048, 1024), (1, 512, 2560)],
                &[1, 8, 32, 64],
                &[3072, 4095],
            ),
        }
    }
}

/// Each prompt composition `(chunks, chunk_len, chunk_start)` alone, then every count of
/// decoding rows at every context beside no prompt and beside each composition.
fn grid(prompts: &[(u32, u32, u32)], decodes: &[u32], contexts: &[u32]) -> Vec<ServingStepCase> {
    let mut cases = Vec::new();
    for &(chunks, chunk_len, chunk_start) in prompts {
        cases.push(ServingStepCase {
            decodes: 0,
            decode_context: 0,
            chunks,
            chunk_len,
            chunk_start,
        });
    }
    let with_no_prompt: Vec<_> = std::iter::once((0, 0, 0))
        .chain(prompts.iter().copied())
        .collect();
    for &rows in decodes {
        for &decode_context in contexts {
            for &(chunks, chunk_len, chunk_start) in &with_no_prompt {
                cases.push(ServingStepCase {
                    decodes: rows,
                    decode_context,
                    chunks,
                    chunk_len,
                    chunk_start,
                });
            }
        }
    }
    cases
}

/// Steps before each measurement: buffers grown, cuBLAS's choice made, clocks warm.
const WARMUP_STEPS: u32 = 3;

/// One case's measurement.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServingStepRow {
    pub kind: &'static str,
    #[serde(flatten)]
    pub case: ServingStepCase,
    pub steps: u64,
    /// Mean wall time of a step, each waited for (as the serving thread does), ms.
    pub step_ms: f64,
    /// Median of the steps' wall times, ms.
    pub step_ms_p50: f64,
    /// Average power from the energy counter; `None` without one.
    pub watts: Option<f64>,
    /// The SM clock over the case (median of the telemetry's readings); `None` without one.
    pub sm_mhz: Option<u32>,
}

/// What the caller reads from the GPU around each case: the energy counter (J) and the
/// median SM clock since the last reading; `None` for what it cannot read.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GpuReading {
    pub energy_counter_j: Option<f64>,
    pub sm_mhz: Option<u32>,
}

/// Checks the cases before any GPU work, naming the first bad one.
pub fn validate_serving_step_cases(cases: &[ServingStepCase]) -> Result<(), CudaError> {
    if cases.is_empty() {
        return Err(CudaError::Config("no serving-step cases to measure".into()));
    }
    for case in cases {
        let rows = u64::from(case.decodes) + u64::from(case.chunks) * u64::from(case.chunk_len);
        if rows == 0 {
            return Err(CudaError::Config(format!(
                "serving-step case {case:?} has no row: give it decoding rows or a prompt chunk"
            )));
        }
        if (case.chunks == 0) != (case.chunk_len == 0) {
            return Err(CudaError::Config(format!(
                "serving-step case {case:?}: chunks and chunk_len are both 0 or both at least 1"
            )));
        }
        if rows > u64::from(MAX_PREFILL_ROWS) {
            return Err(CudaError::Config(format!(
                "serving-step case {case:?} has {rows} rows, over the {MAX_PREFILL_ROWS} one step takes: use fewer or shorter chunks"
            )));
        }
    }
    Ok(())
}

/// The engine the cases need: KV positions a slot (the longest case's) and slots (the
/// most rows and chunks of any case); at least 1 each.
fn engine_size(cases: &[ServingStepCase]) -> (u32, u32) {
    let context = cases.iter().map(ServingStepCase::context).max();
    let slots = cases.iter().map(ServingStepCase::slots).max();
    (context.unwrap_or(1), slots.unwrap_or(1))
}

/// Measures each case for `seconds` on GPU `device`, each step prepared on the host and
/// waited for, as [`crate::CudaServe`]'s thread does; `read` is called before and after
/// each case.
pub fn bench_serving_steps(
    model: &ModelShape,
    cases: &[ServingStepCase],
    seconds: f64,
    device: u32,
    read: &mut dyn FnMut() -> GpuReading,
    on_row: &mut dyn FnMut(&ServingStepRow),
) -> Result<Vec<ServingStepRow>, CudaError> {
    validate_serving_step_cases(cases)?;
    if !(seconds.is_finite() && seconds > 0.0 && seconds <= 86_400.0) {
        return Err(CudaError::Config(format!(
            "seconds per case must be above 0 and at most 86400 (a day), not {seconds}"
        )));
    }
    let (context, slots) = engine_size(cases);
    let mut engine = Engine::new(model, context, slots, device, EngineOptions::default())?;
    if engine.batch_max() < slots {
        return Err(CudaError::Config(format!(
            "{slots} slots of {context} positions do not fit the GPU's memory with {} (at most {}): measure fewer decoding rows or shorter contexts",
            model.name,
            engine.batch_max()
        )));
    }
    let mut rows = Vec::with_capacity(cases.len());
    for case in cases {
        let decodes: Vec<DecodeInput> = (0..case.decodes)
            .map(|slot| DecodeInput {
                slot,
                position: case.decode_context,
            })
            .collect();
        let chunks: Vec<PrefillChunk> = (0..case.chunks)
            .map(|i| PrefillChunk {
                slot: case.decodes + i,
                start: case.chunk_start,
                len: case.chunk_len,
                ends_prompt: true,
            })
            .collect();
        let tokens: Vec<u32> = (0..case.prefill_tokens())
            .map(|i| i.wrapping_mul(2_654_435_761) % model.vocab)
            .collect();
        for _ in 0..WARMUP_STEPS {
            engine.serve_step(&decodes, &chunks, &tokens)?;
            engine.synchronize()?;
        }
        let before = read();
        let mut step_s = Vec::new();
        let t0 = Instant::now();
        while t0.elapsed().as_secs_f64() < seconds || step_s.is_empty() {
            let start = Instant::now();
            engine.serve_step(&decodes, &chunks, &tokens)?;
            engine.synchronize()?;
            step_s.push(start.elapsed().as_secs_f64());
        }
        let wall = t0.elapsed().as_secs_f64();
        let after = read();
        let watts = match (before.energy_counter_j, after.energy_counter_j) {
            (Some(a), Some(b)) if b > a => Some((b - a) / wall),
            _ => None,
        };
        let mean = step_s.iter().sum::<f64>() / step_s.len() as f64;
        step_s.sort_by(f64::total_cmp);
        let row = ServingStepRow {
            kind: "serving-step",
            case: *case,
            steps: step_s.len() as u64,
            step_ms: 1000.0 * mean,
            step_ms_p50: 1000.0 * step_s[step_s.len() / 2],
            watts,
            sm_mhz: after.sm_mhz,
        };
        on_row(&row);
        rows.push(row);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_grid_is_valid_and_fits_one_engine() {
        let cases = ServingStepGrid::Standard.cases();
        validate_serving_step_cases(&cases).expect("valid");
        assert_eq!(cases.len(), 5 + 5 * 3 * 6);
        // 132 slots of 2,048 positions: 35 GB of llama-3-8b's KV cache, beside 16 GB of weights.
        assert_eq!(engine_size(&cases), (2048, 132));
    }

    #[test]
    fn the_long_grid_reaches_a_4096_slot_within_the_standard_grids_memory() {
        let cases = ServingStepGrid::Long.cases();
        validate_serving_step_cases(&cases).expect("valid");
        assert_eq!(cases.len(), 4 + 4 * 2 * 5);
        // 66 slots of 4,096 positions: no more KV cache than the standard grid's 132 of 2,048.
        assert_eq!(engine_size(&cases), (4096, 66));
        // Every prompt composition stays within a 3,072-token prompt, as serving-budget's do.
        assert!(
            cases
                .iter()
                .all(|c| c.chunks == 0 || c.chunk_start + c.chunk_len <= 3072)
        );
    }

    #[test]
    fn a_case_without_rows_or_with_half_a_chunk_is_refused_by_name() {
        let empty = ServingStepCase {
            decodes: 0,
            decode_context: 0,
            chunks: 0,
            chunk_len: 0,
            chunk_start: 0,
        };
        let message = validate_serving_step_cases(&[empty])
            .unwrap_err()
            .to_string();
        assert!(message.contains("has no row"), "{message}");
        let half = ServingStepCase {
            decodes: 4,
            chunks: 2,
            ..empty
        };
        let message = validate_serving_step_cases(&[half])
            .unwrap_err()
            .to_string();
        assert!(message.contains("both 0 or both at least 1"), "{message}");
        let too_big = ServingStepCase {
            chunks: 8,
            chunk_len: 8192,
            ..empty
        };
        let message = validate_serving_step_cases(&[too_big])
            .unwrap_err()
            .to_string();
        assert!(message.contains("over the"), "{message}");
        assert!(validate_serving_step_cases(&[]).is_err());
    }
}
