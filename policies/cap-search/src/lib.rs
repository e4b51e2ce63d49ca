//! The `cap-search` policy: on each GPU, searches the power cap for the most tokens per
//! joule with comparisons that hold up under sensor noise, the objective first, and
//! searches again when the workload shifts.
//!
//! The caps form a ladder from the device's lowest cap to its highest in steps of
//! `grid_w` (the highest always included). The search over it is the kit's
//! [`LadderSearch`](tokwatt_policy_kit::LadderSearch); in short:
//!
//! - A golden-section search: it brackets the best cap (at first the whole ladder),
//!   measures two caps inside the bracket at the golden ratio, the higher first (the
//!   safe side), and drops the part beyond the worse one. Caps are compared on several
//!   settled ticks each, and a difference counts only beyond `z` standard errors, with
//!   the per-tick noise pooled over every window (per-window noise does not cancel
//!   between caps; a board's constant gain error does); within the noise, both are
//!   near the peak and the bracket shrinks to the span between them. While the GPU keeps
//!   up with demand, caps are compared on power (the tokens are the arrivals'); while
//!   requests wait, on tokens per joule. From 51 caps to 3 takes about nine windows.
//! - Settled on the best cap, it probes a neighbour every `recheck_windows` windows.
//! - A cap that breaks the objective, brings the window's p99 time per token within
//!   `tpot_margin` of the limit or makes the queue grow is a floor for
//!   `floor_hold_windows` windows; a breach moves the cap up at once.
//! - A sustained change of tokens per second at one cap, or a queue appearing or
//!   vanishing, drops what it learnt and starts the search again.
//!
//! # Parameters
//!
//! `grid_w` (default 10 W) and the ladder search's keys
//! ([`LadderConfig`](tokwatt_policy_kit::LadderConfig)); `policies/cap-search.toml`
//! documents each with its unit and default. The policy needs the `power-cap` knob and turns no
//! other. Its state (schema version 3, see `tokwatt_policy_kit::ladder`) goes to a new
//! version at a hot swap.

use tokwatt_policy_kit::knob_ladder::cap_ladder;
use tokwatt_policy_kit::{
    CAP_TOLERANCE_W, KnobLadder, LadderConfig, check_objective, decide_per_gpu, knob_ladder,
};
use tokwatt_policy_sdk::{
    InitArgs, Knobs, Objective, Observation, Params, Policy, Settings, State, info,
};

/// The version of the state layout.
const SCHEMA_VERSION: u32 = 3;

#[derive(Debug, Clone)]
struct CapSearchPolicy {
    config: LadderConfig,
    objective: Objective,
    gpus: Vec<KnobLadder>,
}

fn read_grid(params: &Params<'_>) -> Result<f64, String> {
    let grid_w: f64 = params.get("grid_w", 10.0)?;
    if !(grid_w.is_finite() && grid_w >= 1.0) {
        return Err(format!(
            "parameter `grid_w` = {grid_w} must be a number of watts of at least 1"
        ));
    }
    Ok(grid_w)
}

impl Policy for CapSearchPolicy {
    fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String> {
        if !args.knobs.contains(Knobs::POWER_CAP) {
            return Err("cap-search turns the power cap and was not granted \
                 \"power-cap\": list it in the spec's `knobs`, or, where it is listed, \
                 run where the agent does not withhold it (the agent says why it does)"
                .into());
        }
        let params = Params::new(&args.params);
        let mut known = vec!["grid_w"];
        known.extend(LadderConfig::KEYS);
        params.check_known(&known)?;
        let grid_w = read_grid(&params)?;
        let config = LadderConfig::read(&params, LadderConfig::defaults())?;
        check_objective(&args.objective)?;
        let gpus = args
            .devices
            .iter()
            .map(|device| KnobLadder::new(device.index, cap_ladder(device, grid_w)?, &config))
            .collect::<Result<Vec<_>, _>>()?;
        let first = gpus
            .iter()
            .map(|ladder| Settings::unchanged().with_power_cap_w(ladder.target()))
            .collect();
        info!(
            "cap-search on {} GPUs: caps {grid_w} W apart, windows of {}-{} ticks, z {}",
            gpus.len(),
            config.min_window_ticks,
            config.max_window_ticks,
            config.z
        );
        Ok((
            CapSearchPolicy {
                config,
                objective: args.objective,
                gpus,
            },
            first,
        ))
    }

    fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
        decide_per_gpu(&mut self.gpus, observations, |ladder, observation| {
            let in_force_w = observation.in_force.power_cap_w;
            match ladder.observe(
                observation,
                in_force_w,
                CAP_TOLERANCE_W,
                &self.objective,
                &self.config,
            ) {
                Some(cap_w) => Settings::unchanged().with_power_cap_w(cap_w),
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

tokwatt_policy_sdk::export_policy!(CapSearchPolicy);

#[cfg(test)]
mod tests;
