//! The `joint-search` policy: on each GPU, searches the SM clock and the batch size
//! together by Thompson sampling over a grid of arms, under the objective's constraints,
//! and explores again when the workload shifts.
//!
//! # Arms and beliefs
//!
//! The arms are `clock_levels` clocks spread evenly over the supported ones, times
//! `batch_levels` batch sizes (the workload's largest, halved each level). Each arm keeps
//! the kit's record of its ticks (`tokwatt_policy_kit::measure`); the belief about its
//! tokens per joule is Gaussian: its own mean and standard error (with the per-tick noise
//! pooled over every visit) once visited — demand over power while it kept up with
//! demand, so the arrivals' randomness stays out — and otherwise the mean of the measured
//! arms within two grid steps, closer ones weighing more, spread 10 % a step, so the
//! search does not have to visit every arm to know roughly what it holds.
//!
//! # Constraints, from the safe side
//!
//! An arm whose visit brought the mean p99 time per token within `tpot_margin` of the
//! limit is ruled out for latency, and with it every slower clock with a larger batch; an
//! arm whose queue grew or held `queue_min` requests is ruled out for the queue, and with
//! it every slower clock with a smaller batch (unless requests wait at the fastest arm
//! too: demand beyond the GPU). Rule-outs last `hold_visits` visits. An arm that held is
//! known to hold, and vouches for faster clocks (with smaller batches for latency, larger
//! ones for the queue). The search starts at the fastest clock and the largest batch, and
//! may visit arms known to hold or within three grid steps of one.
//!
//! A tick whose p99 time per token is not a number (a serving engine saw no request end
//! in it: the host sends NaN) counts for tokens per joule but not for the visit's
//! latency. Under a latency limit, a visit in which no tick told it is neither held nor
//! ruled out for latency (the queue may still rule it out): it goes on until a tick
//! tells, so the search never moves to a slower clock or a larger batch on it.
//!
//! # Thompson sampling
//!
//! After each visit of `window_ticks` settled, busy ticks (fewer when a queue piles up),
//! it draws a number from each allowed arm's belief (the host's seeded `random` import,
//! so runs replay exactly) and visits the arm with the best draw, unless the draw
//! promises less than 1 % over the current arm's mean (a switch costs a settling tick):
//! arms that are probably best are visited most, and uncertain ones now and then.
//!
//! # The objective first, and shifts
//!
//! A tick that breaks the objective rules the arm out and moves at once to the best arm
//! known to hold (else one clock level up). A sustained change of tokens per second at
//! one arm, or a queue appearing or vanishing, drops every record and rule-out; after a
//! rise in load, the search starts from the fastest clock.
//!
//! The policy needs the `sm-clock` and `batch-size` knobs. Its state (schema version 3,
//! see `state.rs`) goes to a new version at a hot swap.

mod bandit;
mod config;
mod state;

use bandit::Bandit;
use config::Config;
use tokwatt_policy_kit::{check_objective, decide_per_gpu};
use tokwatt_policy_sdk::{
    InitArgs, Knobs, Objective, Observation, Params, Policy, Settings, State, info,
};

#[derive(Debug, Clone)]
struct JointSearch {
    config: Config,
    objective: Objective,
    gpus: Vec<Bandit>,
}

/// The settings for `bandit`'s arm, leaving alone what is already in force.
fn settings(bandit: &Bandit, observation: Option<&Observation>) -> Settings {
    let (clock_mhz, batch_size) = bandit.target();
    let in_force = observation.map(|observation| observation.in_force);
    Settings {
        power_cap_w: None,
        sm_clock_max_mhz: (in_force.map(|f| f.sm_clock_max_mhz) != Some(clock_mhz))
            .then_some(clock_mhz),
        batch_size: (in_force.map(|f| f.batch_size) != Some(batch_size)).then_some(batch_size),
        token_budget: None,
    }
}

impl Policy for JointSearch {
    fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String> {
        let missing: Vec<&str> = [
            (Knobs::SM_CLOCK, "\"sm-clock\""),
            (Knobs::BATCH_SIZE, "\"batch-size\""),
        ]
        .into_iter()
        .filter(|(knob, _)| !args.knobs.contains(*knob))
        .map(|(_, name)| name)
        .collect();
        if !missing.is_empty() {
            return Err(format!(
                "joint-search turns the SM clock and the batch size: add {} to the spec's \
                 `knobs`",
                missing.join(" and ")
            ));
        }
        let config = Config::from_params(&Params::new(&args.params))?;
        check_objective(&args.objective)?;
        let gpus = args
            .devices
            .iter()
            .map(|device| Bandit::new(device, &config))
            .collect::<Result<Vec<_>, _>>()?;
        let first = gpus.iter().map(|bandit| settings(bandit, None)).collect();
        info!(
            "joint-search on {} GPUs: {} clocks x {} batch sizes, visits of {} ticks",
            gpus.len(),
            gpus.first().map_or(0, |bandit| bandit.clocks.len()),
            gpus.first().map_or(0, |bandit| bandit.batches.len()),
            config.window_ticks
        );
        Ok((
            JointSearch {
                config,
                objective: args.objective,
                gpus,
            },
            first,
        ))
    }

    fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
        decide_per_gpu(&mut self.gpus, observations, |bandit, observation| {
            bandit.observe(observation, &self.objective, &self.config);
            settings(bandit, Some(observation))
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

tokwatt_policy_sdk::export_policy!(JointSearch);

#[cfg(test)]
mod tests;
