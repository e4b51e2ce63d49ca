//! The workload's knobs: the token budget and the batch, and the helpers they share.

use super::Gpu;
use crate::config::Config;
use tokwatt_policy_kit::ladder::first_token_bound;
use tokwatt_policy_kit::serving::{self, BudgetBounds};
use tokwatt_policy_sdk::{DeviceFacts, Knobs, Objective, Observation, Settings, debug};

/// The token budget, where granted and the workload has one.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Budget {
    min: u32,
    /// The candidates, ascending: the largest the workload takes, then steps of √2
    /// down to the floor.
    pub(super) candidates: Vec<u32>,
    /// Settled ticks with prompts since the last decision.
    ticks: u32,
}

impl Budget {
    pub(super) fn new(device: &DeviceFacts, knobs: Knobs, floor: u32) -> Option<Budget> {
        if !knobs.contains(Knobs::TOKEN_BUDGET) || device.token_budget_max == 0 {
            return None;
        }
        let min = device.token_budget_min.max(1);
        let max = device.token_budget_max.max(min);
        let floor = floor.clamp(min, max);
        let mut candidates = Vec::new();
        let mut budget = f64::from(max);
        while budget >= f64::from(floor) {
            // Multiples of 16 tokens: what a tensor-core tile takes.
            let rounded = ((budget / 16.0).round() * 16.0).clamp(f64::from(min), f64::from(max));
            candidates.push(rounded as u32);
            budget /= std::f64::consts::SQRT_2;
        }
        candidates.push(floor);
        candidates.sort_unstable();
        candidates.dedup();
        Some(Budget {
            min,
            candidates,
            ticks: 0,
        })
    }

    /// The least budget for `sequences` decoding: above them (their decodes take their
    /// tokens first; a budget at or under them leaves prompts no room at all).
    fn floor(&self, sequences: u32) -> u32 {
        sequences.saturating_add(1).max(self.min)
    }
}

/// The batch, where granted.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Batch {
    /// The batch the workload started with: what it grows back to.
    start: u32,
    calm_windows: u32,
    ticks: u32,
    worst_tpot_ms: f64,
    /// The last cut was for the KV cache.
    preempted: bool,
    /// Ticks since the last cut for the KV cache.
    since_cut: u32,
}

/// Ticks between two cuts for the KV cache.
const KV_CUT_TICKS: u32 = 5;

/// The least batch a cut leaves: an eighth of the workload's own (at least one).
fn batch_floor(start: u32) -> u32 {
    (start / 8).max(1)
}

impl Batch {
    /// Its start is taken from the first tick (the workload's own batch).
    pub(super) fn new() -> Batch {
        Batch {
            start: 0,
            calm_windows: 0,
            ticks: 0,
            worst_tpot_ms: 0.0,
            preempted: false,
            since_cut: KV_CUT_TICKS,
        }
    }
}

/// A window of ticks for the batch's growth.
const BATCH_WINDOW_TICKS: u32 = 4;

/// A batch cut for the KV cache: this share of the sequences in flight.
const KV_CUT: f64 = 0.9;

/// Whether the tick pushed sequences out of the KV cache.
pub(super) fn preempted(observation: &Observation) -> bool {
    observation
        .requests
        .as_ref()
        .and_then(|r| r.preemptions)
        .is_some_and(|n| n > 0)
}

impl Gpu {
    /// The token budget: the largest candidate whose full chunk keeps the TPOT bound
    /// (the kit's `choose_budget`), once a window; a tick that breaks the TPOT bound
    /// halves it at once where first tokens stay on time (smaller chunks before fewer
    /// sequences); the largest with demand beyond the GPU. Returns whether it was cut for
    /// a breach, so the batch is not cut for the same one.
    pub(super) fn steer_budget(
        &mut self,
        observation: &Observation,
        objective: &Objective,
        config: &Config,
        settings: &mut Settings,
    ) -> bool {
        let beyond = self.beyond_the_gpu(observation);
        let Some(budget) = self.budget.as_mut() else {
            return false;
        };
        let in_force = observation.in_force.token_budget;
        if in_force == 0 || observation.settling || observation.tokens == 0 {
            return false;
        }
        let sequences = observation.active_sequences;
        let floor = budget.floor(sequences).max(
            budget
                .candidates
                .first()
                .copied()
                .unwrap_or(budget.min)
                .min(in_force),
        );
        let halved = (in_force / 2).max(floor);
        // A smaller chunk prefills slower: not where first tokens would then be late.
        let first_tokens_allow = match first_token_bound(objective) {
            Some(bound_ms) => self
                .model
                .ttft_p99_ms(self.model.waiting_prompt_tokens(), halved, sequences)
                .is_none_or(|ms| ms <= config.ttft_guard * bound_ms),
            None => true,
        };
        if let Some(limit_ms) = objective.tpot_p99_limit_ms
            && observation.tpot_p99_ms > limit_ms
            && in_force > floor
            && !beyond
            && first_tokens_allow
        {
            let cut = halved;
            debug!(
                "gpu {}: p99 time per token {:.1} ms over {limit_ms} ms: budget {in_force} -> {cut}",
                self.index, observation.tpot_p99_ms
            );
            *settings = settings.with_token_budget(cut);
            budget.ticks = 0;
            return true;
        }
        // Demand beyond the GPU: the largest budget serves the most of it.
        if beyond {
            let largest = budget.candidates.last().copied().unwrap_or(in_force);
            if largest != in_force {
                *settings = settings.with_token_budget(largest);
            }
            budget.ticks = 0;
            return false;
        }
        let prompts = observation
            .requests
            .as_ref()
            .is_some_and(|r| r.prefill_tokens > 0);
        if !prompts {
            return false;
        }
        budget.ticks += 1;
        if budget.ticks < config.budget_window_ticks {
            return false;
        }
        budget.ticks = 0;
        let share_now = observation
            .requests
            .as_ref()
            .and_then(|r| r.prefill_time_share)
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(|s| (s, in_force));
        let Some(chosen) = serving::choose_budget(
            &self.model,
            &BudgetBounds::of(objective),
            &budget.candidates,
            sequences,
            share_now,
        ) else {
            return false;
        };
        // At most a doubling or a halving a decision: the model is a line through what
        // one budget showed, and a step of it is recoverable in one window.
        let next = chosen
            .clamp(in_force / 2, in_force.saturating_mul(2))
            .max(floor);
        if next != in_force {
            debug!(
                "gpu {}: budget {in_force} -> {next} (toward {chosen})",
                self.index
            );
            *settings = settings.with_token_budget(next);
        }
        false
    }

    /// The batch: cut on a TPOT breach that the budget cannot answer (it is at its floor,
    /// not granted, or the decode steps alone are too slow), grown back to the workload's
    /// own after `batch_calm_windows` windows of ample room.
    pub(super) fn steer_batch(
        &mut self,
        observation: &Observation,
        objective: &Objective,
        config: &Config,
        budget_cut: bool,
        settings: &mut Settings,
    ) {
        /// Ample room: the worst p99 of a window under this share of the bound.
        const CALM: f64 = 0.7;
        let beyond = self.beyond_the_gpu(observation);
        let at_top = self.at_top(observation);
        let Some(batch) = self.batch.as_mut() else {
            return;
        };
        let in_force = observation.in_force.batch_size;
        if batch.start == 0 {
            batch.start = in_force.max(1);
        }
        if observation.settling || observation.tokens == 0 {
            return;
        }
        // Sequences pushed out of the KV cache are prefilled again: work thrown away, and
        // at a slow rung (more sequences in flight, each holding a longer context) it
        // feeds on itself until every step is a re-prefill and the GPU serves a fraction
        // of the demand. Admit fewer than are in flight now, whatever the latency says;
        // the queue that builds is the ladder's to answer with a faster rung.
        batch.since_cut = batch.since_cut.saturating_add(1);
        // Below the top clock the ladder answers first (a faster rung drains them; a cut
        // batch queues the arrivals behind sequences that take minutes to finish, which
        // broke a queue-wait bound on a reasoning draw); at the top nothing else can.
        if preempted(observation) && at_top {
            // The sequences already in flight hold their cache for a while after a cut:
            // one cut per `KV_CUT_TICKS`, or the batch spirals down.
            if batch.since_cut < KV_CUT_TICKS {
                return;
            }
            batch.since_cut = 0;
            let cut = ((f64::from(observation.active_sequences.min(in_force)) * KV_CUT) as u32)
                .max(batch_floor(batch.start));
            if cut < in_force {
                debug!(
                    "gpu {}: sequences preempted with {} decoding: batch {in_force} -> {cut}",
                    self.index, observation.active_sequences
                );
                *settings = settings.with_batch_size(cut);
            }
            batch.calm_windows = 0;
            batch.ticks = 0;
            batch.worst_tpot_ms = 0.0;
            batch.preempted = true;
            return;
        }
        let tpot_ms = observation.tpot_p99_ms;
        let Some(limit_ms) = objective.tpot_p99_limit_ms else {
            // No latency bound: only a cut for the KV cache grows back, once no sequence
            // was preempted for `batch_calm_windows` windows.
            self.grow_back(observation, config, 0.0, f64::INFINITY, settings);
            return;
        };
        if tpot_ms > limit_ms && !budget_cut {
            let decode_too_slow = self
                .model
                .decode_ms()
                .is_some_and(|ms| ms > limit_ms * (1.0 - config.ladder.tpot_margin));
            let budget_spent = match &self.budget {
                Some(budget) => {
                    observation.in_force.token_budget
                        <= budget
                            .floor(observation.active_sequences)
                            .max(budget.candidates.first().copied().unwrap_or(budget.min))
                }
                None => true,
            };
            // Fewer sequences shorten a step only where the batch binds (every slot
            // taken): a chunk's step with two sequences decoding is the chunk's, and
            // cutting a batch of 299 to one there queued everything behind it.
            let binds = observation.active_sequences >= in_force.saturating_mul(9) / 10;
            if binds && (budget_spent || decode_too_slow) && !beyond {
                let cut = ((f64::from(observation.active_sequences.min(in_force)) * 0.8) as u32)
                    .max(batch_floor(batch.start));
                if cut < in_force {
                    debug!(
                        "gpu {}: p99 time per token {tpot_ms:.1} ms over {limit_ms} ms with \
                         the budget spent: batch {in_force} -> {cut}",
                        self.index
                    );
                    *settings = settings.with_batch_size(cut);
                }
                batch.calm_windows = 0;
                batch.ticks = 0;
                batch.worst_tpot_ms = 0.0;
                return;
            }
        }
        self.grow_back(observation, config, tpot_ms, CALM * limit_ms, settings);
    }

    /// Grows a cut batch back by a quarter (a tenth after a cut for the KV cache: the
    /// thrash starts sharply) after `batch_calm_windows` windows whose worst p99 time per
    /// token stayed under `calm_ms`, up to the workload's own batch.
    fn grow_back(
        &mut self,
        observation: &Observation,
        config: &Config,
        tpot_ms: f64,
        calm_ms: f64,
        settings: &mut Settings,
    ) {
        let Some(batch) = self.batch.as_mut() else {
            return;
        };
        let in_force = observation.in_force.batch_size;
        if in_force >= batch.start {
            batch.preempted = false;
            return;
        }
        if tpot_ms.is_finite() {
            batch.worst_tpot_ms = batch.worst_tpot_ms.max(tpot_ms);
        }
        batch.ticks += 1;
        if batch.ticks < BATCH_WINDOW_TICKS {
            return;
        }
        let calm = batch.worst_tpot_ms < calm_ms;
        batch.ticks = 0;
        batch.worst_tpot_ms = 0.0;
        batch.calm_windows = if calm { batch.calm_windows + 1 } else { 0 };
        if batch.calm_windows >= config.batch_calm_windows {
            batch.calm_windows = 0;
            let factor = if batch.preempted { 1.05 } else { 1.25 };
            let grown = (f64::from(in_force) * factor).ceil() as u32;
            *settings = settings.with_batch_size(grown.min(batch.start));
        }
    }
}
