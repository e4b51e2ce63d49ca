//! The `clock-search` policy: on each GPU, searches the SM clock lock for the most tokens
//! per joule with comparisons that hold up under sensor noise, the objective first, and
//! searches again when the workload shifts.
//!
//! Lower clocks save power faster than they lose speed (the voltage falls with the
//! clock), until the p99 time per token (or, with prompts, to first token) breaks the
//! objective or the GPU no longer keeps up with demand. So the best clock under a latency objective is usually the lowest
//! that keeps the p99 under the limit with a margin and the queue from growing; under a
//! saturating load, tokens per joule itself peaks at some clock.
//!
//! The ladder is the device's supported clocks (`sm-clocks-mhz`), lowest first; the knob
//! is the upper bound of the clock lock, and the highest clock releases it. The search
//! over it is the kit's [`LadderSearch`](tokwatt_policy_kit::LadderSearch), as in
//! `cap-search`:
//!
//! - A golden-section search: it brackets the best clock (at first every clock),
//!   measures two clocks inside the bracket at the golden ratio, the higher first (the
//!   safe side), and drops the part beyond the worse one. Clocks are compared on several
//!   settled ticks each, and a difference counts only beyond `z` standard errors, with
//!   the per-tick noise pooled over every window; within the noise, the point estimates
//!   decide. While the GPU keeps up with demand, clocks are compared on power (the
//!   tokens are the arrivals'); while requests wait, on tokens per joule. From 110
//!   clocks to 3 takes about ten windows.
//! - A clock whose window brings the mean p99 time per token within `tpot_margin` of
//!   the limit, the time to first token near its bound (with prompts: compute-bound
//!   prefill slows with the clock), falls behind the arrivals while the batch fills, or
//!   makes the queue grow where a higher clock kept up, is a floor for
//!   `floor_hold_windows` windows. A tick that breaks the objective moves the lock up
//!   at once, so the GPU never sits at a breaking clock for more than a tick or two.
//! - Settled on the best clock, it probes a neighbour every `recheck_windows` windows.
//! - A sustained change of tokens per second at one clock, or a queue appearing or
//!   vanishing, drops what it learnt and starts the search again.
//!
//! # Parameters
//!
//! The ladder search's keys ([`LadderConfig`](tokwatt_policy_kit::LadderConfig));
//! `policies/clock-search.toml` documents each with its unit and default. The policy
//! needs the `sm-clock` knob and turns no other. Its state (schema version 3, see
//! `tokwatt_policy_kit::ladder`) goes to a new version at a hot swap.

use tokwatt_policy_kit::{
    KnobLadder, LadderConfig, check_objective, clocks, decide_per_gpu, knob_ladder,
};
use tokwatt_policy_sdk::{
    DeviceFacts, InitArgs, Knobs, Objective, Observation, Params, Policy, Settings, State, info,
};

/// The version of the state layout.
const SCHEMA_VERSION: u32 = 3;

/// Two clocks closer than this are the same clock.
const CLOCK_TOLERANCE_MHZ: f64 = 0.5;

#[derive(Debug, Clone)]
struct ClockSearchPolicy {
    config: LadderConfig,
    objective: Objective,
    gpus: Vec<KnobLadder>,
}

/// The device's supported clocks, lowest first.
fn clock_ladder(device: &DeviceFacts) -> Result<Vec<f64>, String> {
    let mut clocks: Vec<f64> = clocks::clock_ladder(device)
        .into_iter()
        .map(f64::from)
        .collect();
    if clocks.is_empty() {
        return Err(format!(
            "gpu {}: the host reports no supported SM clocks, so none can be searched",
            device.index
        ));
    }
    clocks.reverse();
    Ok(clocks)
}

impl Policy for ClockSearchPolicy {
    fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String> {
        if !args.knobs.contains(Knobs::SM_CLOCK) {
            return Err("clock-search turns the SM clock and was not granted \
                 \"sm-clock\": list it in the spec's `knobs`, or, where it is listed, \
                 run where the agent does not withhold it (the agent says why it does)"
                .into());
        }
        let params = Params::new(&args.params);
        params.check_known(&LadderConfig::KEYS)?;
        let config = LadderConfig::read(&params, LadderConfig::defaults())?;
        check_objective(&args.objective)?;
        let gpus = args
            .devices
            .iter()
            .map(|device| KnobLadder::new(device.index, clock_ladder(device)?, &config))
            .collect::<Result<Vec<_>, _>>()?;
        let first = gpus
            .iter()
            .map(|ladder| Settings::unchanged().with_sm_clock_max_mhz(ladder.target() as u32))
            .collect();
        info!(
            "clock-search on {} GPUs: windows of {}-{} ticks, z {}, p99 margin {} %",
            gpus.len(),
            config.min_window_ticks,
            config.max_window_ticks,
            config.z,
            config.tpot_margin * 100.0
        );
        Ok((
            ClockSearchPolicy {
                config,
                objective: args.objective,
                gpus,
            },
            first,
        ))
    }

    fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
        decide_per_gpu(&mut self.gpus, observations, |ladder, observation| {
            let in_force_mhz = f64::from(observation.in_force.sm_clock_max_mhz);
            match ladder.observe(
                observation,
                in_force_mhz,
                CLOCK_TOLERANCE_MHZ,
                &self.objective,
                &self.config,
            ) {
                Some(mhz) => Settings::unchanged().with_sm_clock_max_mhz(mhz as u32),
                None => Settings::unchanged(),
            }
        })
    }

    fn snapshot(&self) -> State {
        knob_ladder::encode(SCHEMA_VERSION, &self.gpus)
    }

    fn restore(&mut self, state: State) -> Result<(), String> {
        self.gpus = knob_ladder::decode(&state, SCHEMA_VERSION, &self.gpus, &self.config)?;
        Ok(())
    }
}

tokwatt_policy_sdk::export_policy!(ClockSearchPolicy);

#[cfg(test)]
mod tests;
