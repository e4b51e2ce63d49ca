//! The token budget per step, where the spec grants `token-budget`, the workload has one
//! (it serves prompts: `token_budget_max` above 0) and the objective bounds the time to
//! first token. It trades one latency for the other: a larger budget prefills more of a
//! prompt per step (an earlier first token) and slows every decode step that shares it
//! (a longer time per output token); a smaller one the reverse.
//!
//! Every `window_ticks` settled ticks that saw first tokens, on the window's worst p99s:
//!
//! - first tokens late (TTFT p99 over `headroom` × its bound) while the time per token has
//!   room (under `headroom` × its bound, or no bound): the budget grows by
//!   `token_budget_step`;
//! - the time per token over its target: the budget shrinks by `token_budget_step`, never
//!   below the batch size in force (the decoding sequences take their tokens first: a
//!   budget at or under them leaves prompts no room at all). It does so even with first
//!   tokens late: a chunk that breaks the time per token also holds the batch down (the
//!   batch loop cuts at every violation), and a smaller batch queues more prompts, so the
//!   late first tokens are the queue's, which a larger chunk does not shorten (on the
//!   simulated H100, holding 8,192 tokens a step kept the batch at 2-8 with 60 requests
//!   queued);
//! - else it stays.
//!
//! Without a TTFT bound, or without the knob, the budget is left where it is and the
//! policy behaves as before. The budget is not handed over at a hot swap (the state's
//! schema is unchanged): the new instance starts from the budget in force.

use crate::config::Config;
use crate::control::Limits;
use tokwatt_policy_sdk::{DeviceFacts, Knobs, Observation, debug};

/// The token budget of one GPU.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BudgetControl {
    min: u32,
    max: u32,
    /// Settled ticks with first tokens since the last decision, and their worst p99s.
    ticks: u32,
    ttft_worst_ms: f64,
    tpot_worst_ms: f64,
}

impl BudgetControl {
    /// `None` where the knob is not granted or the workload has no token budget.
    pub fn new(device: &DeviceFacts, knobs: Knobs) -> Option<BudgetControl> {
        (knobs.contains(Knobs::TOKEN_BUDGET) && device.token_budget_max > 0).then(|| {
            BudgetControl {
                min: device.token_budget_min.max(1),
                max: device.token_budget_max,
                ticks: 0,
                ttft_worst_ms: 0.0,
                tpot_worst_ms: 0.0,
            }
        })
    }

    /// Whether this budget answers the time per token on `observation`: the objective
    /// bounds first tokens, the workload is serving prompts, and the budget can still
    /// shrink (it is above the decoding sequences' own tokens).
    pub fn answers(&self, observation: &Observation, limits: Limits) -> bool {
        let prompts = observation
            .requests
            .as_ref()
            .is_some_and(|requests| requests.prefill_tokens > 0);
        limits.ttft_p99_ms.is_some()
            && prompts
            && observation.in_force.token_budget > self.floor(observation)
    }

    /// The least budget: above the batch in force (its decodes take their tokens first).
    fn floor(&self, observation: &Observation) -> u32 {
        observation
            .in_force
            .batch_size
            .saturating_add(1)
            .max(self.min)
    }

    /// One tick: the budget to ask for, `None` to leave it. `tpot_target_ms` is where the
    /// batch loop steers the p99 time per token.
    pub fn observe(
        &mut self,
        observation: &Observation,
        limits: Limits,
        tpot_target_ms: f64,
        config: &Config,
    ) -> Option<u32> {
        let ttft_limit = limits.ttft_p99_ms?;
        let in_force = observation.in_force.token_budget;
        if in_force == 0 || observation.settling {
            return None;
        }
        let ttft = observation
            .requests
            .as_ref()
            .and_then(|requests| requests.ttft_p99_ms)
            .filter(|ms| ms.is_finite())?;
        // A time per token over its bound is answered at once, not at the window's end:
        // the batch loop leaves it to the budget (`GpuControl::observe`).
        if let Some(limit) = limits.tpot_p99_ms
            && observation.tpot_p99_ms.is_finite()
            && observation.tpot_p99_ms > limit
            && self.answers(observation, limits)
        {
            self.start_window();
            return self.shrunk(observation, in_force, config.token_budget_step);
        }
        self.ticks += 1;
        self.ttft_worst_ms = self.ttft_worst_ms.max(ttft);
        if observation.tpot_p99_ms.is_finite() {
            self.tpot_worst_ms = self.tpot_worst_ms.max(observation.tpot_p99_ms);
        }
        if self.ticks < config.window_ticks {
            return None;
        }
        let (ttft, tpot) = (self.ttft_worst_ms, self.tpot_worst_ms);
        self.start_window();
        let step = config.token_budget_step;
        let tpot_room = tpot <= tpot_target_ms;
        let wanted = if ttft > config.headroom * ttft_limit && tpot_room {
            (f64::from(in_force) * (1.0 + step)).ceil()
        } else if !tpot_room {
            return self.shrunk(observation, in_force, step);
        } else {
            return None;
        };
        let tokens = self.within(wanted);
        if tokens == in_force {
            return None;
        }
        debug!(
            "gpu {}: token budget {in_force} -> {tokens} (TTFT p99 {ttft:.0} ms of {ttft_limit} ms, \
             TPOT p99 {tpot:.1} ms against {tpot_target_ms:.1} ms)",
            observation.gpu
        );
        Some(tokens)
    }

    /// A new window of ticks: nothing counted, no worst seen.
    fn start_window(&mut self) {
        self.ticks = 0;
        self.ttft_worst_ms = 0.0;
        self.tpot_worst_ms = 0.0;
    }

    /// `wanted` tokens as a budget within this GPU's range.
    fn within(&self, wanted: f64) -> u32 {
        (wanted.min(f64::from(u32::MAX)) as u32).clamp(self.min, self.max)
    }

    /// `in_force` less `step` of it, not under [`Self::floor`]; `None` where that is no move.
    fn shrunk(&self, observation: &Observation, in_force: u32, step: f64) -> Option<u32> {
        let floor = self.floor(observation);
        let wanted = (f64::from(in_force) * (1.0 - step))
            .floor()
            .max(f64::from(floor));
        let tokens = self.within(wanted);
        (tokens != in_force).then(|| {
            debug!(
                "gpu {}: token budget {in_force} -> {tokens} (TPOT p99 {:.1} ms)",
                observation.gpu, observation.tpot_p99_ms
            );
            tokens
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_policy_sdk::{Params, Requests, testing};

    fn config() -> Config {
        Config::from_params(&Params::new(&[])).unwrap()
    }

    fn limits(ttft_ms: Option<f64>) -> Limits {
        Limits {
            tpot_p99_ms: Some(20.0),
            min_tokens_per_s: None,
            queue_wait_p99_ms: None,
            ttft_p99_ms: ttft_ms,
        }
    }

    /// A settled serving tick at `budget` tokens a step, batch 64.
    fn tick(budget: u32, ttft_ms: f64, tpot_ms: f64) -> Observation {
        let mut observation = testing::observation(0, 1);
        observation.in_force.token_budget = budget;
        observation.tpot_p99_ms = tpot_ms;
        observation.requests = Some(Requests {
            prefill_tokens: 8192,
            first_tokens: 4,
            ttft_p99_ms: Some(ttft_ms),
            prefill_time_share: Some(0.3),
            preemptions: Some(0),
            requests_finished: None,
            energy_per_request_j: None,
        });
        observation
    }

    /// The decision after a window of the same tick.
    fn decide(
        control: &mut BudgetControl,
        limits: Limits,
        observation: &Observation,
    ) -> Option<u32> {
        let config = config();
        (0..config.window_ticks)
            .map(|_| control.observe(observation, limits, 18.0, &config))
            .last()
            .flatten()
    }

    fn control() -> BudgetControl {
        BudgetControl::new(&testing::h200_serving(0), Knobs::TOKEN_BUDGET).unwrap()
    }

    #[test]
    fn only_a_granted_knob_on_a_workload_with_a_budget_is_turned() {
        assert!(BudgetControl::new(&testing::h200_serving(0), Knobs::BATCH_SIZE).is_none());
        assert!(BudgetControl::new(&testing::h200(0), Knobs::TOKEN_BUDGET).is_none());
        // No TTFT bound: nothing to trade, the budget stays.
        let mut control = control();
        assert_eq!(
            decide(&mut control, limits(None), &tick(2048, 5000.0, 10.0)),
            None
        );
    }

    #[test]
    fn late_first_tokens_with_tpot_room_grow_the_budget_up_to_its_most() {
        let mut control = control();
        let late = tick(2048, 900.0, 10.0);
        assert_eq!(decide(&mut control, limits(Some(800.0)), &late), Some(2560));
        assert_eq!(
            decide(&mut control, limits(Some(800.0)), &tick(8000, 900.0, 10.0)),
            Some(8192)
        );
        // Without TPOT room it does not grow (a larger chunk would slow every decode
        // step): it shrinks, the late first tokens being the queue's.
        assert_eq!(
            decide(&mut control, limits(Some(800.0)), &tick(2048, 900.0, 19.0)),
            Some(1536)
        );
    }

    #[test]
    fn a_time_per_token_over_its_bound_is_answered_at_once_while_the_budget_can_shrink() {
        let config = config();
        let mut control = control();
        // Over the 20 ms bound: the first tick shrinks, not the window's end.
        let broken = tick(2048, 900.0, 25.0);
        assert!(control.answers(&broken, limits(Some(800.0))));
        assert_eq!(
            control.observe(&broken, limits(Some(800.0)), 18.0, &config),
            Some(1536)
        );
        // At the floor (the batch of 64 in force, plus one) the batch loop answers.
        let floor = tick(65, 900.0, 25.0);
        assert!(!control.answers(&floor, limits(Some(800.0))));
        assert_eq!(
            control.observe(&floor, limits(Some(800.0)), 18.0, &config),
            None
        );
        // Without a TTFT bound, or without prompts, neither.
        assert!(!control.answers(&broken, limits(None)));
        let mut decode_only = broken;
        decode_only.requests = None;
        assert!(!control.answers(&decode_only, limits(Some(800.0))));
    }

    #[test]
    fn a_tpot_over_target_with_ttft_to_spare_shrinks_the_budget_above_the_decoders() {
        let mut control = control();
        let slow = tick(2048, 100.0, 19.0);
        assert_eq!(decide(&mut control, limits(Some(800.0)), &slow), Some(1536));
        // Never down to the decoding sequences' own tokens (batch 64 in force).
        assert_eq!(
            decide(&mut control, limits(Some(800.0)), &tick(70, 100.0, 19.0)),
            Some(65)
        );
        assert_eq!(
            decide(&mut control, limits(Some(800.0)), &tick(65, 100.0, 19.0)),
            None
        );
        // First tokens late too: the chunk still shrinks (the lateness is the queue's).
        assert_eq!(
            decide(&mut control, limits(Some(800.0)), &tick(2048, 900.0, 19.0)),
            Some(1536)
        );
    }

    #[test]
    fn settling_ticks_and_ticks_without_first_tokens_decide_nothing() {
        let config = config();
        let mut control = control();
        let mut settling = tick(2048, 900.0, 10.0);
        settling.settling = true;
        let mut quiet = tick(2048, 900.0, 10.0);
        quiet.requests = None;
        let mut nan = tick(2048, f64::NAN, 10.0);
        nan.requests.as_mut().unwrap().ttft_p99_ms = Some(f64::NAN);
        for _ in 0..10 {
            for observation in [&settling, &quiet, &nan] {
                assert_eq!(
                    control.observe(observation, limits(Some(800.0)), 18.0, &config),
                    None
                );
            }
        }
    }
}
