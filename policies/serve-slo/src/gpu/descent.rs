//! The descent: a settled clock that keeps every bound with room goes down at once to
//! the lowest clock predicted to keep them.

use crate::config::Config;
use tokwatt_policy_kit::KnobLadder;
use tokwatt_policy_kit::ladder::first_token_bound;
use tokwatt_policy_kit::serving::{self, BudgetBounds, StepModel};
use tokwatt_policy_sdk::{Objective, Observation, debug};

/// Settled ticks at one clock, for a descent predicted from them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(super) struct Descent {
    mhz: u32,
    ticks: u32,
    tpot_sum_ms: f64,
    tpot_worst_ms: f64,
    ttft_sum_ms: f64,
    ttft_worst_ms: f64,
    ttft_ticks: u32,
    queue_worst: u32,
    /// A clock a descent reached and the objective broke at: no descent goes to it or
    /// below again until `floor_ticks` run out (a shift of the workload resets it).
    floor_mhz: f64,
    floor_ticks: u32,
    /// Ticks since the last descent.
    since_descent: u32,
}

/// The time to first token goes as 1/clock to this power at a lower clock (see
/// `descend`).
pub(super) const TTFT_CLOCK_EXPONENT: f64 = 2.2;

/// Ticks after a descent in which a breach is the descent's.
const DESCENT_BLAME_TICKS: u32 = 30;
/// Ticks a clock a descent broke at stays ruled out for descents.
const DESCENT_FLOOR_TICKS: u32 = 300;

impl Descent {
    /// Takes a tick that broke the objective: blamed on a recent descent, its clock
    /// is a floor for descents.
    pub(super) fn breach(&mut self, mhz: f64) {
        if self.since_descent <= DESCENT_BLAME_TICKS {
            self.floor_mhz = self.floor_mhz.max(mhz);
            self.floor_ticks = DESCENT_FLOOR_TICKS;
        }
    }

    pub(super) fn push(&mut self, observation: &Observation) {
        let mhz = observation.in_force.sm_clock_max_mhz;
        self.since_descent = self.since_descent.saturating_add(1);
        self.floor_ticks = self.floor_ticks.saturating_sub(1);
        if self.floor_ticks == 0 {
            self.floor_mhz = 0.0;
        }
        if mhz != self.mhz {
            *self = Descent {
                mhz,
                floor_mhz: self.floor_mhz,
                floor_ticks: self.floor_ticks,
                since_descent: self.since_descent,
                ..Descent::default()
            };
        }
        if observation.settling || observation.tokens == 0 {
            return;
        }
        self.ticks += 1;
        let tpot = observation.tpot_p99_ms;
        if tpot.is_finite() {
            self.tpot_sum_ms += tpot;
            self.tpot_worst_ms = self.tpot_worst_ms.max(tpot);
        }
        if let Some(ttft) = observation
            .requests
            .as_ref()
            .and_then(|r| r.ttft_p99_ms)
            .filter(|ms| ms.is_finite())
        {
            self.ttft_sum_ms += ttft;
            self.ttft_worst_ms = self.ttft_worst_ms.max(ttft);
            self.ttft_ticks += 1;
        }
        self.queue_worst = self.queue_worst.max(observation.queue_depth);
    }
}

/// A settled clock that keeps every bound with room goes down at once to the lowest
/// clock predicted to keep them, instead of a probe a rung every `recheck_windows`
/// windows (from a raise for a burst, that took minutes). The prediction scales what
/// `descent.ticks` settled ticks at this clock showed: the time to first token by
/// (old / new clock)^2.2 (a prompt token's time goes with the clock, and a slower GPU
/// holds more sequences in flight, whose decodes share the prompts' steps: 1,140 to 555
/// MHz took a chat's TTFT from 45 to about 200 ms on the simulated H100), the time per
/// token by ^1.5; at most `DESCENT_STEP` lower a jump. The ladder judges the new clock's
/// window as any other, and a breach raises it as any other.
pub(super) fn descend(
    ladder: &mut KnobLadder,
    descent: &mut Descent,
    candidates: Option<&[u32]>,
    model: &StepModel,
    observation: &Observation,
    objective: &Objective,
    config: &Config,
) {
    /// Settled ticks at a clock before a descent is predicted from them.
    const DESCENT_TICKS: u32 = 6;
    /// At most this much lower a jump.
    const DESCENT_STEP: f64 = 0.25;
    const TPOT_EXPONENT: f64 = 1.5;
    let search = &ladder.search;
    let rung = ladder.rung_of(f64::from(observation.in_force.sm_clock_max_mhz));
    if descent.ticks < DESCENT_TICKS
        || search.incumbent != Some(rung)
        || search.current != rung
        || rung == 0
        || descent.queue_worst >= config.ladder.queue_min / 2
    {
        return;
    }
    let f0 = ladder.values[rung];
    let ticks = f64::from(descent.ticks);
    let tpot_limit = objective.tpot_p99_limit_ms;
    let first_bound = first_token_bound(objective);
    // TTFT at this clock: the worse of the ticks' mean and the model's prediction for
    // an empty queue (its learnt tail covers the long prompts a window may not hold).
    let ttft_here = match (first_bound, descent.ttft_ticks) {
        (Some(_), 0) => return,
        (Some(_), n) => {
            let mean = descent.ttft_sum_ms / f64::from(n);
            let predicted = model
                .ttft_p99_ms(
                    0.0,
                    observation.in_force.token_budget,
                    observation.active_sequences,
                )
                .unwrap_or(mean);
            mean.max(predicted).max(descent.ttft_worst_ms * 0.8)
        }
        (None, _) => 0.0,
    };
    let budget_now = observation.in_force.token_budget;
    let sequences = observation.active_sequences;
    let keeps = |mhz: f64| -> bool {
        let ratio = f0 / mhz;
        let there = model.at_clock(mhz);
        // Where the budget is turned and prompts were measured, the budget there is the
        // largest whose full chunk keeps the TPOT bound: the clock keeps it if one does,
        // and first tokens come as much later as that budget prefills slower.
        let mut budget_scale = 1.0;
        if let (Some(candidates), Some(_)) = (candidates, tpot_limit)
            && there.knows_prompts()
        {
            let bounds = BudgetBounds::of(objective);
            let Some(budget) =
                serving::largest_budget_within_tpot(&there, &bounds, candidates, sequences)
            else {
                return false;
            };
            if let (Some(now), Some(then)) = (
                there.prefill_rate(budget_now, sequences),
                there.prefill_rate(budget, sequences),
            ) && then > 0.0
            {
                budget_scale = (now / then).max(1.0);
            }
        } else if let Some(limit) = tpot_limit
            && let Some(step_ms) = there.tpot_p99_ms(budget_now, sequences)
            && step_ms > limit * (1.0 - config.ladder.tpot_margin)
        {
            return false;
        }
        if let Some(limit) = tpot_limit
            && (candidates.is_none() || !there.knows_prompts())
        {
            let mean = descent.tpot_sum_ms / ticks * ratio.powf(TPOT_EXPONENT);
            let worst = descent.tpot_worst_ms * ratio.powf(TPOT_EXPONENT);
            if mean > limit * (1.0 - config.ladder.tpot_margin) || worst > 0.95 * limit {
                return false;
            }
        }
        if let Some(bound) = first_bound {
            let scale = ratio.powf(TTFT_CLOCK_EXPONENT) * budget_scale;
            // The typical tick with the guard's room, and the worst one seen under the
            // bound itself (less a twentieth): a window's worst prompt comes again.
            if ttft_here * scale > config.descent_guard * bound
                || descent.ttft_worst_ms * scale > 0.95 * bound
            {
                return false;
            }
        }
        true
    };
    let lowest = (f0 * (1.0 - DESCENT_STEP)).max(descent.floor_mhz + 0.5);
    let mut chosen = rung;
    for candidate in (0..rung).rev() {
        let mhz = ladder.values[candidate];
        if mhz < lowest || !keeps(mhz) {
            break;
        }
        chosen = candidate;
    }
    // One rung is the ladder's own recheck.
    if chosen + 1 < rung {
        let settled = ladder.search.settle_at(chosen);
        debug!(
            "gpu {}: {f0:.0} MHz keeps every bound with room: down to {:.0} MHz",
            observation.gpu, ladder.values[settled]
        );
        descent.ticks = 0;
        descent.since_descent = 0;
    }
}
