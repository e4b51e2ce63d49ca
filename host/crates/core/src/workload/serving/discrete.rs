//! The scheduler step by step, for a loop that runs real steps (tokwatt's CUDA serving
//! loop): [`Scheduler::plan`] admits and composes the next step from the same rule as
//! [`Scheduler::next`], [`Scheduler::complete`] applies it as one whole step.

use super::scheduler::{EPSILON, Scheduler};
use super::{DecodeRow, PromptChunk, RequestRecord, StepPlan};
use crate::quantile::nearest_rank;
use crate::types::{DemandWindow, RequestsWindow, WorkloadWindow};
use crate::workload::FinishedRequests;

/// What the steps of one window saw, besides the scheduler's counts.
#[derive(Debug, Clone, Default)]
pub(super) struct StepsWindow {
    steps: u64,
    decode_step_ms: Vec<f64>,
    busy_s: f64,
    prefill_busy_s: f64,
    /// The cumulative counts at the window's start: tokens, arrived, completed, turned
    /// away, tokens demanded.
    marks: [u64; 5],
}

impl Scheduler {
    /// Admits waiting requests where slots allow at `now_s`, and plans the next step: one
    /// row per decoding sequence (its slot, the position its last token goes in at), then
    /// the prompt chunks the budget leaves room for, oldest admission first.
    pub fn plan(&mut self, now_s: f64) -> StepPlan {
        self.rebalance(now_s);
        let mut plan = StepPlan::default();
        for sequence in &self.running {
            plan.decodes.push(DecodeRow {
                slot: sequence.life.slot,
                position: self.context_of(sequence).round() as u32,
            });
        }
        // Rows by slot: the engine's rows stay compact.
        plan.decodes.sort_unstable_by_key(|row| row.slot);
        // Oldest admission first, by `next`'s rule; a whole step takes at most the
        // prompt's rest (a fluid chunk under way may be priced wider), `min(rest, room)`.
        let mut left = self.prompt_room(plan.decodes.len() as u32);
        let mut first = true;
        for pending in &self.prefilling {
            if left <= 0.0 {
                break;
            }
            let (take, _) = pending.step_take(left, first);
            let len = take.min(pending.remaining()).round();
            if len <= 0.0 {
                continue;
            }
            first = false;
            left -= len;
            plan.prompts.push(PromptChunk {
                slot: pending.life.slot,
                start: pending.prefilled.round() as u32,
                len: len as u32,
                ends_prompt: (pending.remaining() - len).abs() <= EPSILON,
            });
        }
        plan
    }

    /// Records that `plan` (the last [`Scheduler::plan`]) ran, ending at `end_s` after
    /// `step_s` seconds and costing `energy_j` (`None`: no energy counter, its requests get
    /// no energy).
    pub fn complete(&mut self, plan: &StepPlan, end_s: f64, step_s: f64, energy_j: Option<f64>) {
        let tokens = plan.tokens();
        if tokens == 0 {
            return;
        }
        let per_token_j = energy_j.map_or(0.0, |j| j / f64::from(tokens));
        let gap = energy_j.is_none();
        let w = &mut self.steps_window;
        w.steps += 1;
        w.busy_s += step_s;
        if !plan.prompts.is_empty() {
            w.prefill_busy_s += step_s;
        }
        if !plan.decodes.is_empty() {
            w.decode_step_ms.push(1000.0 * step_s);
        }
        debug_assert_eq!(
            plan.decodes.len(),
            self.running.len(),
            "a plan of this state"
        );
        let decode = plan.decodes.len() as u32;
        self.advance_decodes(decode, 1.0, per_token_j, gap, step_s, end_s);
        let mut chunks = plan.prompts.iter().peekable();
        for pending in self.prefilling.iter_mut() {
            let Some(chunk) = chunks.next_if(|c| c.slot == pending.life.slot) else {
                continue;
            };
            let len = f64::from(chunk.len);
            pending.prefilled += len;
            pending.energy_j += len * per_token_j;
            pending.life.energy_gap |= gap;
            self.window.prefill_tokens += len;
        }
        self.end_steps(step_s, end_s);
    }

    /// The requests finished since the last call.
    pub fn take_finished_records(&mut self) -> Vec<RequestRecord> {
        let mut into = FinishedRequests::default();
        self.take_finished(&mut into);
        into.records
    }

    /// The window since the last call, as the control loop reads it, and a new one.
    /// `energy_known`: whether steps were given their energy.
    pub fn take_window(&mut self, energy_known: bool) -> WorkloadWindow {
        let counts = self.take_counts();
        let marks = [
            self.tokens().round() as u64,
            self.arrived(),
            self.completed(),
            self.turned_away(),
            self.tokens_demanded(),
        ];
        let mut w = std::mem::take(&mut self.steps_window);
        let since = |i: usize| marks[i].saturating_sub(w.marks[i]);
        self.steps_window.marks = marks;
        let (mut ttfts_ms, mut queue_waits_ms) = (counts.ttfts_ms, counts.queue_waits_ms);
        let requests = RequestsWindow {
            prefill_tokens: counts.prefill_tokens.round() as u64,
            first_tokens: ttfts_ms.len() as u64,
            ttft_p99_ms: nearest_rank(&mut ttfts_ms, 0.99),
            prefill_time_share: (w.busy_s > 0.0).then(|| w.prefill_busy_s / w.busy_s),
            preemptions: Some(counts.preemptions),
            energy: energy_known.then_some(counts.energy),
        };
        WorkloadWindow {
            tokens: since(0),
            steps: w.steps,
            tpot_p50_ms: nearest_rank(&mut w.decode_step_ms, 0.5).unwrap_or(f64::NAN),
            tpot_p99_ms: nearest_rank(&mut w.decode_step_ms, 0.99).unwrap_or(f64::NAN),
            active_sequences: u32::try_from(self.in_slots()).unwrap_or(u32::MAX),
            queue_depth: u32::try_from(self.waiting()).unwrap_or(u32::MAX),
            batch_size: self.running_limit(),
            demand: Some(DemandWindow {
                requests_arrived: since(1),
                requests_completed: since(2),
                requests_turned_away: since(3),
                tokens_demanded: since(4),
                queue_wait_p99_ms: nearest_rank(&mut queue_waits_ms, 0.99),
            }),
            requests: Some(requests),
        }
    }
}
