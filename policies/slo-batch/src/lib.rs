//! The `slo-batch` policy: an SLO-aware batch controller that also lowers the SM clock
//! while the demand allows.
//!
//! Under saturating load the largest batch makes the most tokens per joule, but every
//! sequence in a batch waits for the whole step, so the p99 time per token (TPOT) grows
//! with the batch. Under light load the batch does not bind at all, and the energy goes
//! into running a clock faster than the demand needs. Per GPU, two loops:
//!
//! # The batch: a fitted line, not blind steps
//!
//! Every settled tick that made tokens adds a point (sequences decoding, p99 TPOT) to a
//! least-squares line `p99 ≈ a + b·sequences` over the last dozen ticks (`fit.rs`). The
//! batch is set to where the line meets `headroom` × the limit, growing by at most
//! `max_batch_growth` per step while there is demand (requests wait or every slot is
//! taken). From `start_batch_size` (64) it reaches the limit in two or three steps
//! instead of a dozen additive ones; without spread in the points the line goes through
//! the origin, which overestimates the time of a larger batch, so growth is from the safe
//! side. With requests waiting, no slope yet and the p99 under 80 % of the target, the
//! batch probes a quarter up (at least one sequence): the line through the origin from
//! points at one batch size would otherwise hold it there (at a batch of 1 whose step
//! is mostly the weights' read, it did). On a violation the batch is cut at once, to
//! the line's size and at least 10 % below the sequences decoding.
//!
//! The target is `headroom` × the limit, or lower where the p99 strays further than that
//! covers: how far each tick's p99 lies from the line is learnt (a moving average of the
//! squared relative gap, from ±3 %), and the target keeps 3 of its standard deviations
//! under the limit. Short requests and noisy boards scatter the per-tick p99 by 15–20 %.
//!
//! # The clock: as low as the latency and the demand allow
//!
//! Where the `sm-clock` knob is granted, every `window_ticks` settled ticks at one batch
//! and clock:
//!
//! - the GPU keeps up (the queue emptied during the window or shrank) and the queue is
//!   empty: lower the clock to the lowest supported clock predicted to keep the window's
//!   mean p99 under the target, taking p99 ∝ (old clock / new clock)^`clock_elasticity`
//!   and at most `clock_step_down` lower per step. The points of the line are rescaled to
//!   the new clock. How much p99 actually grew after a step is learnt (a steeper GPU,
//!   near the knee where a slower step also piles up more sequences, gets smaller
//!   steps);
//! - requests wait and do not drain, and the batch is at its latency limit: raise the
//!   clock by `clock_step_up` (by half, on a surge: a full batch's worth waiting and
//!   growing) and stay a step above the clock that failed for `hold_windows` windows;
//! - a violation within two windows of a step down is blamed on the step: back to the
//!   previous clock, held for `hold_windows`, and the elasticity raised.
//!
//! The lowest clock that keeps up within the latency target is where a GPU serving a
//! fixed demand draws the least power, so the most tokens per joule (simulator: tokens
//! per joule rise monotonically as the clock falls until the queue starts to grow).
//! Without the clock knob (a real H200 with only the batch size granted), the batch loop
//! runs alone. The power cap is left alone: the clock lock does the same job with a
//! finer grain.
//!
//! # Unknown latency
//!
//! A tick whose p99 time per token is not a number (a serving engine saw no request end
//! in it: the host sends NaN) adds no point to the line, is no violation and moves no
//! batch; it counts toward the clock window's queue and tokens but not its latency.
//! Under a latency limit, a window in which no tick told the p99 never lowers the clock
//! (a queue that does not drain still raises it, since the batch cannot grow on it).
//!
//! # Re-exploration
//!
//! A window whose tokens/s differs from the running reference by `shift_factor` (either
//! way) is a new workload: the floor and the learnt elasticity are dropped and the line
//! keeps only its newest point, so both loops search afresh. A violation or a queue that
//! stops draining is answered at once in any case.
//!
//! # Parameters
//!
//! | key | default | meaning |
//! |---|---|---|
//! | `headroom` | 0.9 | steer p99 TPOT to this fraction of the limit |
//! | `start_batch_size` | 64 | first batch |
//! | `max_batch_growth` | 2.0 | largest batch growth per step, factor |
//! | `window_ticks` | 3 | settled ticks per clock decision |
//! | `clock_step_down` | 0.25 | largest clock fall per step, fraction |
//! | `clock_step_up` | 0.05 | clock rise when the GPU does not keep up, fraction |
//! | `clock_elasticity` | 2.0 | assumed p99 growth exponent for a lower clock |
//! | `hold_windows` | 10 | windows to stay above a clock that failed |
//! | `shift_factor` | 2.0 | tokens/s change that counts as a workload shift |
//! | `token_budget_step` | 0.25 | largest token budget change per step, fraction |
//!
//! # The token budget
//!
//! Where the spec also grants `token-budget`, the workload has one (it serves prompts)
//! and the objective bounds the time to first token (`ttft_p99_limit_ms`), the token
//! budget per step trades the two latencies (`budget.rs`): late first tokens with room
//! in the time per token grow it, a time per token over target with first tokens to
//! spare shrinks it, by `token_budget_step` per window. Otherwise it is left alone.
//!
//! The policy needs the `batch-size` or `sm-clock` knob (or both). Without a
//! `tpot_p99_limit_ms` objective (a throughput objective) the batch grows to the largest
//! the workload takes and only the queue bounds the clock. A `min_tokens_per_s` floor
//! counts as "not keeping up" while requests wait. The state (schema version 1, see
//! `state.rs`) goes to a new version at a hot swap.

mod budget;
mod config;
mod control;
mod fit;
mod state;

use config::Config;
use control::{GpuControl, Limits};
use tokwatt_policy_kit::{check_objective, decide_per_gpu};
use tokwatt_policy_sdk::{InitArgs, Knobs, Observation, Params, Policy, Settings, State, info};

#[derive(Debug, Clone)]
struct SloBatch {
    config: Config,
    limits: Limits,
    gpus: Vec<GpuControl>,
}

impl Policy for SloBatch {
    fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String> {
        if !args.knobs.intersects(Knobs::BATCH_SIZE | Knobs::SM_CLOCK) {
            return Err(
                "slo-batch steers the batch size and the SM clock: add \"batch-size\" (and \
                 \"sm-clock\" where the clock may move) to the spec's `knobs`"
                    .into(),
            );
        }
        let config = Config::from_params(&Params::new(&args.params))?;
        check_objective(&args.objective)?;
        let limits = Limits {
            tpot_p99_ms: args.objective.tpot_p99_limit_ms,
            min_tokens_per_s: args.objective.min_tokens_per_s,
            queue_wait_p99_ms: args.objective.queue_wait_p99_limit_ms,
            ttft_p99_ms: args.objective.ttft_p99_limit_ms,
        };
        let gpus = args
            .devices
            .iter()
            .map(|device| GpuControl::new(device, args.knobs, &config))
            .collect::<Result<Vec<_>, _>>()?;
        let first = gpus.iter().map(GpuControl::first_settings).collect();
        info!(
            "slo-batch on {} GPUs: p99 steered to {}, batch {}, clock {}",
            gpus.len(),
            match limits.tpot_p99_ms {
                Some(limit) => format!("{:.0} % of {limit} ms", config.headroom * 100.0),
                None => "nothing (no p99 limit: largest batch, queue-bound clock)".to_string(),
            },
            if args.knobs.contains(Knobs::BATCH_SIZE) {
                "steered"
            } else {
                "not granted"
            },
            if args.knobs.contains(Knobs::SM_CLOCK) {
                "steered"
            } else {
                "not granted"
            },
        );
        Ok((
            SloBatch {
                config,
                limits,
                gpus,
            },
            first,
        ))
    }

    fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
        decide_per_gpu(&mut self.gpus, observations, |control, observation| {
            let settings = control.observe(observation, self.limits, &self.config);
            Settings {
                token_budget: control.steer_budget(observation, self.limits, &self.config),
                ..settings
            }
        })
    }

    fn snapshot(&self) -> State {
        state::encode(&self.gpus)
    }

    fn restore(&mut self, state: State) -> Result<(), String> {
        self.gpus = state::decode(&state, &self.gpus)?;
        Ok(())
    }
}

tokwatt_policy_sdk::export_policy!(SloBatch);

#[cfg(test)]
mod tests;
