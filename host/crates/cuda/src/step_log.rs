//! The serving loop's steps, one record each, for comparing the loop with a model of it
//! (`tokwatt bench serving --steps`): what each step held and how long it took, with the
//! loop's own time around the engine's step kept apart from the step.

use serde::Serialize;
use tokwatt_core::workload::serving::StepPlan;

/// One step of the serving loop.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepRecord {
    /// When the loop began the step (took its arrivals, planned), seconds since it started.
    pub start_s: f64,
    /// When the engine's step began (after planning) and ended (after the GPU finished).
    pub engine_start_s: f64,
    pub engine_end_s: f64,
    /// Decoding rows, their attended KV positions all together, and the longest row's.
    pub decodes: u32,
    pub decode_positions: u64,
    pub decode_position_max: u32,
    /// Prompt chunks, their tokens, and the positions those tokens attend to all together
    /// (causal: a token sees the prompt before it).
    pub chunks: u32,
    pub prompt_tokens: u32,
    pub prompt_positions: u64,
}

impl StepRecord {
    /// The record of `plan`, run by the engine from `engine_start_s` to `engine_end_s`.
    pub fn of(plan: &StepPlan, start_s: f64, engine_start_s: f64, engine_end_s: f64) -> Self {
        let decode_positions = plan.decodes.iter().map(|d| u64::from(d.position) + 1).sum();
        let prompt_positions = plan
            .prompts
            .iter()
            .map(|c| {
                let (start, len) = (u64::from(c.start), u64::from(c.len));
                len * start + len * (len + 1) / 2
            })
            .sum();
        StepRecord {
            start_s,
            engine_start_s,
            engine_end_s,
            decodes: plan.decodes.len() as u32,
            decode_positions,
            decode_position_max: plan
                .decodes
                .iter()
                .map(|d| d.position + 1)
                .max()
                .unwrap_or(0),
            chunks: plan.prompts.len() as u32,
            prompt_tokens: plan.prompts.iter().map(|c| c.len).sum(),
            prompt_positions,
        }
    }
}

/// The steps kept for a reader, at most `capacity` of them between two reads; those past
/// it are counted, not kept (a reader that stopped reading must not grow the memory).
#[derive(Debug)]
pub(crate) struct StepLog {
    capacity: usize,
    steps: Vec<StepRecord>,
    dropped: u64,
}

impl StepLog {
    pub(crate) fn new(capacity: usize) -> Self {
        StepLog {
            capacity,
            steps: Vec::new(),
            dropped: 0,
        }
    }

    pub(crate) fn push(&mut self, step: StepRecord) {
        if self.steps.len() < self.capacity {
            self.steps.push(step);
        } else {
            self.dropped += 1;
        }
    }

    /// The steps kept since the last call, and how many were dropped since then.
    pub(crate) fn take(&mut self) -> (Vec<StepRecord>, u64) {
        (
            std::mem::take(&mut self.steps),
            std::mem::replace(&mut self.dropped, 0),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_core::workload::serving::{DecodeRow, PromptChunk};

    #[test]
    fn a_record_sums_what_the_step_attends_to() {
        let plan = StepPlan {
            decodes: vec![
                DecodeRow {
                    slot: 0,
                    position: 99,
                },
                DecodeRow {
                    slot: 1,
                    position: 9,
                },
            ],
            prompts: vec![PromptChunk {
                slot: 2,
                start: 4,
                len: 3,
                ends_prompt: false,
            }],
        };
        let record = StepRecord::of(&plan, 1.0, 1.25, 1.5);
        assert_eq!((record.decodes, record.decode_positions), (2, 100 + 10));
        assert_eq!(record.decode_position_max, 100);
        // Tokens at positions 4, 5 and 6 see 5, 6 and 7 positions.
        assert_eq!((record.chunks, record.prompt_tokens), (1, 3));
        assert_eq!(record.prompt_positions, 5 + 6 + 7);
        assert_eq!(
            StepRecord::of(&StepPlan::default(), 0.0, 0.0, 0.0).decode_position_max,
            0
        );
    }

    #[test]
    fn the_log_keeps_up_to_its_capacity_and_counts_the_rest() {
        let mut log = StepLog::new(2);
        let step = StepRecord::of(&StepPlan::default(), 0.0, 0.0, 0.0);
        for _ in 0..5 {
            log.push(step);
        }
        assert_eq!(log.take(), (vec![step, step], 3));
        assert_eq!(log.take(), (vec![], 0));
    }
}
