//! `tokwatt eval --plan`: what a scenario asks of its GPU, phase by phase, without judging
//! anything: the demand, the most the GPU serves within the objective (the capacity the
//! steady-state model gives, no cap, no clock lock), and the oracle's settings with what
//! they measured on the simulator.

use serde::Serialize;

use super::oracle::{self, PhaseOracle};
use super::scenario::EvalScenario;
use tokwatt_sim::SimError;

/// One demand phase of a plan.
#[derive(Debug, Clone, Serialize)]
pub struct PlannedPhase {
    pub start_s: f64,
    pub end_s: f64,
    pub arrival_rps: f64,
    /// The most requests/s served within the objective's TPOT and TTFT bounds (10 %
    /// headroom), at the phase's outside power limit if it has one.
    pub capacity_rps: f64,
    /// The demand over the capacity.
    pub load: f64,
    pub oracle: PhaseOracle,
}

/// A scenario's plan. **API boundary**: `tokwatt eval --plan --json`.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub scenario: String,
    pub description: String,
    pub gpu: String,
    /// Mean prompt and output tokens a request (no prompt: decode only, at the context).
    pub prompt_tokens_mean: Option<f64>,
    pub output_tokens_mean: f64,
    pub context_tokens: u32,
    pub batch_size_max: u32,
    pub phases: Vec<PlannedPhase>,
    /// Every figure is simulator output.
    pub data_source: String,
}

/// The plan of `scenario` over its first `duration_s` seconds (the oracle searches on
/// the first of `seeds`' arrivals and confirms on the others', as `tokwatt eval` does on
/// its seeds).
pub fn plan(scenario: &EvalScenario, duration_s: f64, seeds: &[u64]) -> Result<Plan, SimError> {
    let phases = oracle::search(scenario, duration_s, seeds)?;
    let workload = &scenario.workload;
    let planned = phases
        .into_iter()
        .map(|phase| {
            let outside = workload
                .phases
                .get(phase.scenario_phase)
                .and_then(|p| p.outside_power_limit_w);
            let cap = outside.map_or(scenario.profile.power_cap.max_w, |o| {
                o.min(scenario.profile.power_cap.max_w)
            });
            let capacity_rps = oracle::capacity_at(scenario, cap, None);
            PlannedPhase {
                start_s: phase.start_s,
                end_s: phase.end_s,
                arrival_rps: phase.arrival_rps,
                capacity_rps,
                load: if capacity_rps > 0.0 {
                    phase.arrival_rps / capacity_rps
                } else {
                    f64::INFINITY
                },
                oracle: phase,
            }
        })
        .collect();
    Ok(Plan {
        scenario: scenario.name.clone(),
        description: scenario.description.clone(),
        gpu: scenario.profile.name.clone(),
        prompt_tokens_mean: workload.requests.as_ref().map(|r| r.prompt.mean()),
        output_tokens_mean: workload
            .requests
            .as_ref()
            .map_or(f64::from(workload.output_tokens), |r| r.output.mean()),
        context_tokens: workload.context_tokens,
        batch_size_max: workload.batch_size_max,
        phases: planned,
        data_source: format!(
            "simulator output (the steady-state model and simulated runs of {})",
            scenario.profile.name
        ),
    })
}
