//! The `hill-climb` policy: on each GPU, moves the power cap towards the most tokens per
//! joule, and raises it at once when the service objective is broken.
//!
//! # The search
//!
//! Each GPU is searched on its own, with the cap search of `tokwatt-policy-kit`. A *window* sums tokens and energy over
//! `window_ticks` ticks at one cap and divides them (a ratio of sums, so a busy tick
//! weighs more than a quiet one). Ticks that say nothing about the cap are skipped:
//! `settling` ticks (a setting changed during them), idle ticks (no tokens) and ticks
//! without energy. A full window is compared with the previous one:
//!
//! - better by more than `min_gain` (relative): keep going the same way; from the second
//!   improvement in a row on, double the step (up to `step_w`) to follow a workload that
//!   moved;
//! - otherwise, including a change within the noise: reverse and halve the step (down to
//!   `min_step_w`).
//!
//! So the search closes in on the best cap and then keeps probing around it in steps of
//! `min_step_w`, which is how it notices when the best cap moves. Energy counters update
//! every 100 ms, so a 1 s tick carries up to ~10 % quantisation noise; a window of 5
//! ticks brings it to a few percent, and the halving makes a wrong turn cheap.
//!
//! Steps stay inside the device's range (after the operator's guardrails); at a bound
//! the direction reverses. Windows are measured at the cap actually in force, so a host
//! that steps towards a target under a rate limit, or a dry run that applies nothing,
//! cannot make the search compare the wrong caps.
//!
//! # The objective comes first
//!
//! If a tick breaks the objective — p99 time per token over `tpot_p99_limit_ms` (on a
//! tick that made tokens), or throughput under `min_tokens_per_s` while requests wait —
//! the cap goes up by `step_w` at once. The cap that broke it becomes a floor: for the
//! next `slo_hold_windows` windows the search stays at least `min_step_w` above it, then
//! it may probe lower again, since the load may have eased.
//!
//! # Parameters
//!
//! | key | default | meaning |
//! |---|---|---|
//! | `window_ticks` | 5 | settled, busy ticks per measurement |
//! | `step_w` | 50 | first and largest step, W; also the objective raise |
//! | `min_step_w` | 10 | smallest step, W |
//! | `min_gain` | 0.005 | relative gain that counts as better |
//! | `slo_hold_windows` | 10 | windows to stay above a cap that broke the objective |
//! | `start_w` | the GPU's default cap | first cap, W |
//!
//! The policy needs the `power-cap` knob and turns no other. Its state (schema version
//! 1, see `state.rs`) goes to a new version at a hot swap, so the search carries on.

mod search;
mod state;

use search::GpuSearch;
use tokwatt_policy_kit::{CapConfig, check_objective, decide_per_gpu};
use tokwatt_policy_sdk::{
    InitArgs, Knobs, Objective, Observation, Params, Policy, Settings, State, info,
};

#[derive(Debug, Clone)]
struct HillClimb {
    config: CapConfig,
    objective: Objective,
    /// One search per GPU, by device index.
    searches: Vec<GpuSearch>,
}

impl Policy for HillClimb {
    fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String> {
        if !args.knobs.contains(Knobs::POWER_CAP) {
            return Err("hill-climb turns the power cap and was not granted \
                 \"power-cap\": list it in the spec's `knobs`, or, where it is listed, \
                 run where the agent does not withhold it (the agent says why it does)"
                .into());
        }
        let config = CapConfig::from_params(&Params::new(&args.params))?;
        check_objective(&args.objective)?;
        let searches = args
            .devices
            .iter()
            .map(|device| GpuSearch::new(device, &config))
            .collect::<Result<Vec<_>, _>>()?;
        let first = searches
            .iter()
            .map(|search| Settings::unchanged().with_power_cap_w(search.target_w))
            .collect();
        info!(
            "hill-climb on {} GPUs: windows of {} ticks, steps {}-{} W, min gain {}",
            searches.len(),
            config.window_ticks,
            config.min_step_w,
            config.step_w,
            config.min_gain
        );
        let policy = HillClimb {
            config,
            objective: args.objective,
            searches,
        };
        Ok((policy, first))
    }

    fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
        decide_per_gpu(&mut self.searches, observations, |search, observation| {
            search.observe(observation, &self.objective, &self.config)
        })
    }

    fn snapshot(&self) -> State {
        state::encode(&self.searches)
    }

    fn restore(&mut self, state: State) -> Result<(), String> {
        self.searches = state::decode(&state, &self.searches, &self.config)?;
        Ok(())
    }
}

tokwatt_policy_sdk::export_policy!(HillClimb);

#[cfg(test)]
mod tests;
