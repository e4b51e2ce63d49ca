//! The simulator a replicated A/B ([`super::run_replicated`]) builds afresh for every
//! trajectory: one GPU profile and scenario, started at the pair's moment with the pair's
//! work seed and the trajectory's own noise seed.

use std::time::Duration;

use super::run::{Schedule, TrajectoryWork};
use tokwatt_agent::assembly::{self, AssemblyError, SimTarget};
use tokwatt_agent::control::Backends;
use tokwatt_sim::{GpuProfile, Scenario, SimConfig};

/// What every trajectory of a replicated comparison runs on.
#[derive(Debug, Clone)]
pub struct SimWork {
    pub profile: GpuProfile,
    pub scenario: Scenario,
    pub gpus: u32,
    /// Pairs start at a moment drawn uniformly from the work's first `span_s` seconds.
    pub span_s: f64,
}

impl SimWork {
    /// `target`'s profile and scenario; `duration_s`: how long the work lasts, where it
    /// says (a judging scenario), else see [`replicated_span_s`].
    pub fn of(
        target: &SimTarget,
        duration_s: Option<f64>,
        schedule: &Schedule,
        tick: Duration,
    ) -> Result<Self, AssemblyError> {
        let (profile, scenario) = assembly::sim_work(target)?;
        Ok(Self::new(
            profile,
            scenario,
            target.gpus,
            duration_s,
            schedule,
            tick,
        ))
    }

    pub fn new(
        profile: GpuProfile,
        scenario: Scenario,
        gpus: u32,
        duration_s: Option<f64>,
        schedule: &Schedule,
        tick: Duration,
    ) -> Self {
        let span_s = replicated_span_s(&scenario, duration_s, schedule, tick);
        Self {
            profile,
            scenario,
            gpus,
            span_s,
        }
    }

    /// A fresh simulator for one trajectory.
    pub fn build(&self, work: TrajectoryWork) -> Result<Backends, String> {
        tokwatt_agent::node::Node::simulated(SimConfig {
            profile: self.profile.clone(),
            scenario: self.scenario.starting_at(work.offset_s),
            gpus: self.gpus,
            seed: work.work_seed,
            noise_seed: Some(work.noise_seed),
        })
        .map(|(_, backends)| backends)
        .map_err(|e| e.to_string())
    }
}

/// The replicated mode's span for a simulator scenario: pairs start at a moment of the
/// work's first `duration_s` (a judging scenario's length), or, where the scenario names
/// none, of its phases with the last one as long as 10 minutes; less one trajectory, so
/// that every trajectory ends within it.
pub fn replicated_span_s(
    scenario: &Scenario,
    duration_s: Option<f64>,
    schedule: &Schedule,
    tick: Duration,
) -> f64 {
    let work_s = duration_s.unwrap_or(scenario.last_change_s() + 600.0);
    let trajectory_s = tick.as_secs_f64() * schedule.epoch_ticks() as f64;
    (work_s - trajectory_s).max(0.0)
}
