//! The `cap-and-batch` policy: on each GPU, holds the batch size at the latency objective
//! and moves the power cap towards the most tokens per joule.
//!
//! Larger batches make more tokens per joule but make every token wait longer, so the
//! best batch is the largest that keeps the p99 time per token under the limit; the
//! largest such batch in turn depends on the power cap. Two loops share each GPU:
//!
//! # The batch size: AIMD on the latency limit
//!
//! Every settled, busy tick is judged against the objective's `tpot_p99_limit_ms`:
//!
//! - over the limit: the batch shrinks at once to `batch_shrink_factor` of the sequences
//!   decoding (of the batch size, when it is full);
//! - under `batch_headroom` of the limit while there is demand (requests wait, or every
//!   slot is taken, as with a closed-loop client): the batch grows by `batch_step`, or by
//!   `batch_grow_factor` while it is below `batch_multiplicative_below`;
//! - otherwise, inside the band between the two, it holds.
//!
//! The band is what lets the batch settle: a step of 16 sequences moves an H200's time
//! per token by about 1 ms at Llama-3-8B sizes, less than the 3 ms band at a 20 ms
//! limit. Batches stay in 1..=the workload's largest. `settling` ticks (a setting changed
//! during them) and idle ticks are not judged.
//!
//! # The power cap: hill climbing on windows of one batch size
//!
//! With the cap search of `tokwatt-policy-kit`, as in the `hill-climb` policy, a *window* sums tokens and energy over `window_ticks`
//! settled, busy ticks and divides them; a full window is compared with the previous
//! one. Better by more than `min_gain`: keep going (doubling the step, up to `step_w`,
//! from the second improvement in a row); otherwise reverse and halve the step (down to
//! `min_step_w`).
//!
//! The loops must not read each other's moves as their own: a window holds only ticks
//! at one cap *and one batch size*, and the tick on which the batch changes drops it.
//! So the cap steps only after `window_ticks` ticks of a steady batch, and never on the
//! tick the batch moves. Consecutive windows may run at different batch sizes — a lower
//! cap slows each step, and the batch loop answers with a smaller batch — and comparing
//! them is the point: it compares each cap with the batch that cap can afford.
//!
//! The objective is the batch loop's job. Only when it is broken at batch 1, which no
//! batch can fix, does the cap go up by `step_w` at once; that cap then becomes a floor
//! for `slo_hold_windows` windows, as in `hill-climb`.
//!
//! # Parameters
//!
//! | key | default | meaning |
//! |---|---|---|
//! | `window_ticks` | 5 | settled, busy ticks at one cap and batch per measurement |
//! | `step_w` | 50 | first and largest cap step, W; also the objective raise |
//! | `min_step_w` | 10 | smallest cap step, W |
//! | `min_gain` | 0.005 | relative gain in tokens per joule that counts as better |
//! | `slo_hold_windows` | 10 | windows to stay above a cap that broke the objective at batch 1 |
//! | `start_w` | the GPU's default cap | first cap, W |
//! | `batch_headroom` | 0.85 | grow only under this fraction of the latency limit |
//! | `batch_step` | 16 | additive growth, sequences |
//! | `batch_multiplicative_below` | 64 | below this batch, grow by the factor instead |
//! | `batch_grow_factor` | 1.25 | multiplicative growth |
//! | `batch_shrink_factor` | 0.7 | multiplicative decrease on a violation |
//! | `start_batch_size` | the workload's | first batch size |
//!
//! The policy needs the `power-cap` and `batch-size` knobs and an objective with
//! `tpot_p99_limit_ms`; it refuses to load without them. A `min_tokens_per_s` floor is
//! served only by growing the batch while requests wait: latency is never traded for
//! it. The state (schema version 1, see `state.rs`) goes to a new version at a hot swap.

mod batch;
mod cap;
mod config;
mod state;

use batch::{BatchControl, BatchMove};
use config::Config;
use tokwatt_policy_kit::{CapSearch, WindowScope, check_objective, decide_per_gpu};
use tokwatt_policy_sdk::{
    DeviceFacts, InitArgs, Knobs, Objective, Observation, Params, Policy, Settings, State, info,
};

/// The two loops of one GPU.
#[derive(Debug, Clone, PartialEq)]
struct GpuControl {
    cap: CapSearch,
    batch: BatchControl,
}

impl GpuControl {
    fn new(device: &DeviceFacts, config: &Config) -> Result<GpuControl, String> {
        Ok(GpuControl {
            // A window holds one batch size: the batch loop's moves are not the cap's.
            cap: CapSearch::new(device, &config.cap, WindowScope::CapAndBatch)?,
            batch: BatchControl::new(device, config.batch.start)?,
        })
    }

    /// The first settings: the starting cap, and the starting batch if one is set.
    fn first_settings(&self) -> Settings {
        let settings = Settings::unchanged().with_power_cap_w(self.cap.target_w);
        match self.batch.pending {
            Some(size) => settings.with_batch_size(size),
            None => settings,
        }
    }

    /// Takes one tick's observation of this GPU and returns its settings.
    fn observe(&mut self, observation: &Observation, limit_ms: f64, config: &Config) -> Settings {
        let in_force = observation.in_force;
        let power_cap_w = match self.batch.observe(observation, limit_ms, &config.batch) {
            BatchMove::Hold => self.cap.observe(observation, &config.cap),
            BatchMove::Resize(_) => {
                // This tick still ran at the old batch, but a window ending on it would
                // move the cap together with the batch: neither move could be judged.
                self.cap.restart_window(observation);
                self.cap.request(in_force.power_cap_w)
            }
            BatchMove::AtSmallest => {
                cap::raise_at_smallest_batch(&mut self.cap, observation, &config.cap)
            }
        };
        Settings {
            power_cap_w,
            sm_clock_max_mhz: None,
            batch_size: self.batch.request(in_force.batch_size),
            token_budget: None,
        }
    }
}

#[derive(Debug, Clone)]
struct CapAndBatch {
    config: Config,
    /// The objective's p99 time per token limit, which the batch size is held under.
    limit_ms: f64,
    /// One control per GPU, by device index.
    gpus: Vec<GpuControl>,
}

/// The latency limit the batch loop steers by. Also checks that a throughput floor, if
/// set, is one some setting can meet.
fn latency_limit(objective: &Objective) -> Result<f64, String> {
    const MISSING: &str = "cap-and-batch sizes the batch by the latency objective: set \
                           `tpot_p99_limit_ms` in the spec's [objective], e.g. 20.0";
    let Some(limit_ms) = objective.tpot_p99_limit_ms else {
        return Err(MISSING.into());
    };
    check_objective(objective)?;
    Ok(limit_ms)
}

impl Policy for CapAndBatch {
    fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String> {
        let missing: Vec<&str> = [
            (Knobs::POWER_CAP, "\"power-cap\""),
            (Knobs::BATCH_SIZE, "\"batch-size\""),
        ]
        .into_iter()
        .filter(|(knob, _)| !args.knobs.contains(*knob))
        .map(|(_, name)| name)
        .collect();
        if !missing.is_empty() {
            return Err(format!(
                "cap-and-batch turns the power cap and the batch size: add {} to the spec's \
                 `knobs`",
                missing.join(" and ")
            ));
        }
        let config = Config::from_params(&Params::new(&args.params))?;
        let limit_ms = latency_limit(&args.objective)?;
        let gpus = args
            .devices
            .iter()
            .map(|device| GpuControl::new(device, &config))
            .collect::<Result<Vec<_>, _>>()?;
        let first = gpus.iter().map(GpuControl::first_settings).collect();
        info!(
            "cap-and-batch on {} GPUs: batch held under {:.0} % of {limit_ms} ms (+{} or \
             x{} below {}, x{} on a violation); cap windows of {} ticks, steps {}-{} W",
            gpus.len(),
            config.batch.headroom * 100.0,
            config.batch.step,
            config.batch.grow_factor,
            config.batch.multiplicative_below,
            config.batch.shrink_factor,
            config.cap.window_ticks,
            config.cap.min_step_w,
            config.cap.step_w
        );
        Ok((
            CapAndBatch {
                config,
                limit_ms,
                gpus,
            },
            first,
        ))
    }

    fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
        decide_per_gpu(&mut self.gpus, observations, |control, observation| {
            control.observe(observation, self.limit_ms, &self.config)
        })
    }

    fn snapshot(&self) -> State {
        state::encode(&self.gpus)
    }

    fn restore(&mut self, state: State) -> Result<(), String> {
        self.gpus = state::decode(&state, &self.gpus, &self.config)?;
        Ok(())
    }
}

tokwatt_policy_sdk::export_policy!(CapAndBatch);

#[cfg(test)]
mod tests;
