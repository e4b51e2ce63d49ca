//! Simulated GPUs driven at fixed settings in one-second ticks, the objective checked on
//! every tick's window as the control loop does: how the oracle tries a setting and how
//! the references (the oracle's schedule, the causal reference, the default settings) run.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use tokwatt_core::actuator::Actuator;
use tokwatt_core::clock::{Clock, VirtualClock};
use tokwatt_core::telemetry::Telemetry;
use tokwatt_core::workload::Workload;
use tokwatt_sim::SimGpu;

/// Settings for one GPU: what a policy can set.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct OracleSetting {
    pub power_cap_w: f64,
    /// The SM clock lock's upper bound (the highest supported clock: no lock).
    pub sm_clock_max_mhz: u32,
    pub batch_size: u32,
    /// Tokens a step may process (prompt chunks beside the decoding sequences); a
    /// decode-only scenario's is its `max_batched_tokens` and moves nothing.
    pub token_budget: u32,
}

impl OracleSetting {
    /// The most capable setting of `scenario`: no cap below the board's maximum, no clock
    /// lock, the largest batch and token budget. What serves the most; the bar of an
    /// overload, and what the causal reference meets a rise with.
    pub fn most_capable(scenario: &super::EvalScenario) -> Self {
        OracleSetting {
            power_cap_w: scenario.profile.power_cap.max_w,
            sm_clock_max_mhz: scenario.profile.sm_max_mhz(),
            batch_size: scenario.workload.batch_size_max,
            token_budget: scenario.workload.max_batched_tokens,
        }
    }
}

/// Drives simulated GPUs at fixed settings in one-second ticks.
pub(super) struct FixedRun {
    sim: SimGpu,
    clock: Arc<VirtualClock>,
    telemetry: Box<dyn Telemetry>,
    actuator: Box<dyn Actuator>,
    workload: Box<dyn Workload>,
    objective: tokwatt_core::types::Objective,
    gpus: u32,
    /// Whole seconds since the simulation's start (a fork starts where it was taken).
    tick: u64,
    tokens_served: u64,
    tokens_demanded: u64,
}

impl FixedRun {
    pub(super) fn new(
        sim: &SimGpu,
        clock: Arc<VirtualClock>,
        objective: &tokwatt_core::types::Objective,
    ) -> Self {
        let tick = clock.now().as_secs();
        Self {
            sim: sim.clone(),
            clock,
            telemetry: sim.telemetry(),
            actuator: sim.actuator(),
            workload: sim.workload(),
            objective: *objective,
            gpus: u32::try_from(sim.telemetry().devices().len()).unwrap_or(0),
            tick,
            tokens_served: 0,
            tokens_demanded: 0,
        }
    }

    /// The same settings on every GPU. A setting the device refuses is left as it was:
    /// the grids only hold supported values (and a decode-only scenario has no token
    /// budget to set).
    pub(super) fn apply(&mut self, setting: OracleSetting) {
        let supported = self.sim.profile().sm_clocks_mhz();
        let lowest = supported.last().copied().unwrap_or(0);
        let highest = supported.first().copied().unwrap_or(0);
        let lock =
            (setting.sm_clock_max_mhz < highest).then_some((lowest, setting.sm_clock_max_mhz));
        let prompts = self.sim.scenario().requests.is_some();
        for gpu in 0..self.gpus {
            let _ = self.actuator.set_power_cap(gpu, setting.power_cap_w);
            let _ = self.actuator.set_sm_clock_lock(gpu, lock);
            let _ = self.workload.set_batch_size(gpu, setting.batch_size);
            if prompts {
                let _ = self.workload.set_token_budget(gpu, setting.token_budget);
            }
        }
    }

    /// Run `ticks` one-second ticks; returns how many broke the objective on any GPU.
    pub(super) fn advance_ticks(&mut self, ticks: u64) -> u64 {
        let mut violations = 0;
        for _ in 0..ticks {
            self.tick += 1;
            self.clock.sleep_until(Duration::from_secs(self.tick));
            let mut broken = false;
            for gpu in 0..self.gpus {
                // Reading the windows also resets them for the next tick.
                let _ = self.telemetry.read_window(gpu);
                if let Ok(window) = self.workload.read_window(gpu) {
                    broken |= self.objective.violated_by_window(&window, 1.0);
                    self.tokens_served += window.tokens;
                    self.tokens_demanded += window.demand.map_or(0, |d| d.tokens_demanded);
                }
            }
            violations += u64::from(broken);
        }
        violations
    }

    pub(super) fn tick(&self) -> u64 {
        self.tick
    }

    /// Tokens served over tokens demanded so far (at most 1; 1 when nothing was asked).
    pub(super) fn served_fraction(&self) -> f64 {
        if self.tokens_demanded == 0 {
            1.0
        } else {
            (self.tokens_served as f64 / self.tokens_demanded as f64).min(1.0)
        }
    }
}
