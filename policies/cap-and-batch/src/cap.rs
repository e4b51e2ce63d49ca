//! The power cap search of one GPU: the kit's cap search, with windows held at one cap
//! and one batch size, raised only when the batch cannot help.

use crate::config::CapConfig;
use tokwatt_policy_kit::CapSearch;
use tokwatt_policy_sdk::{Observation, info};

// The tests name the direction by this path.
#[cfg(test)]
pub(crate) use tokwatt_policy_kit::Direction;

/// The objective is broken at the smallest batch, so the batch cannot help: raises the
/// cap by a full step at once and keeps the search above the cap that broke it for a
/// while. Returns the cap to ask for, unless it is already in force.
pub(crate) fn raise_at_smallest_batch(
    cap: &mut CapSearch,
    observation: &Observation,
    config: &CapConfig,
) -> Option<f64> {
    let in_force_w = observation.in_force.power_cap_w;
    let raised_w = cap.raise_for_slo(observation, config);
    info!(
        "gpu {}: p99 time per token {:.2} ms is over the limit at batch {}, the smallest; \
         raising the cap from {in_force_w:.1} W to {raised_w:.1} W",
        cap.gpu, observation.tpot_p99_ms, observation.in_force.batch_size
    );
    cap.request(in_force_w)
}
