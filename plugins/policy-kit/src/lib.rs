//! Building blocks shared by tokwatt's shipped policies (`hill-climb`, `cap-and-batch`).
//!
//! Both policies move each GPU's power cap towards the most tokens per joule with the
//! same search; they differ in what else they steer and in how they answer a broken
//! objective. This crate holds what they share, so the search is written once:
//!
//! - [`CapSearch`]: the per-GPU hill climb of the power cap: windows of settled, busy
//!   ticks, comparison by relative gain, reverse-and-halve, device bounds, and a floor
//!   above a cap that broke the objective. [`WindowScope`] says whether a window must
//!   also hold one batch size.
//! - [`CapConfig`]: the search's parameters (`window_ticks`, `step_w`, `min_step_w`,
//!   `min_gain`, `slo_hold_windows`, `start_w`), read and checked from the spec.
//! - [`state`]: the search's part of a policy's hot-swap state, and the per-GPU framing
//!   around it.
//! - [`check_objective`] and [`decide_per_gpu`]: small pieces of `init` and `decide`.
//! - [`serving`]: for serving with prompts, a step model that predicts the p99 time per
//!   token and to first token at any token budget from what a tick shows (prompt tokens
//!   waiting in the queue and in the batch, the prefill rate measured, carried across
//!   clocks), the largest budget whose full chunk keeps the TPOT bound, and the phase
//!   mix that says whether a power cap or a clock lock is the better knob.
//!
//! It is a plain library: the policy crates link it into their components and export
//! the policy themselves.

pub mod batch_guard;
pub mod clocks;
mod config;
pub mod knob_ladder;
pub mod ladder;
mod ladder_config;
mod ladder_state;
pub mod measure;
mod objective;
mod search;
pub mod serving;
pub mod state;
pub mod stats;

pub use batch_guard::{BatchGuard, BatchGuardConfig};
pub use config::CapConfig;
pub use knob_ladder::KnobLadder;
pub use ladder::LadderSearch;
pub use ladder_config::LadderConfig;
pub use objective::check_objective;
pub use search::{
    CAP_TOLERANCE_W, CapSearch, Direction, Measurement, SloFloor, Window, WindowScope,
};
pub use serving::{BudgetBounds, PhaseMix, StepModel, choose_budget, largest_budget_within_tpot};

use tokwatt_policy_sdk::{Observation, Settings};

/// Answers each observation with `decide` on the per-GPU control of its device index,
/// and leaves a GPU that no control manages unchanged.
pub fn decide_per_gpu<T>(
    controls: &mut [T],
    observations: &[Observation],
    mut decide: impl FnMut(&mut T, &Observation) -> Settings,
) -> Vec<Settings> {
    observations
        .iter()
        .map(|observation| {
            let control = usize::try_from(observation.gpu)
                .ok()
                .and_then(|index| controls.get_mut(index));
            match control {
                Some(control) => decide(control, observation),
                None => Settings::unchanged(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_policy_sdk::testing;

    #[test]
    fn each_observation_goes_to_its_gpu_and_strangers_are_left_alone() {
        let mut seen = vec![Vec::new(), Vec::new()];
        let observations = [
            testing::observation(1, 0),
            testing::observation(7, 0),
            testing::observation(0, 0),
        ];
        let decided = decide_per_gpu(&mut seen, &observations, |seen, observation| {
            seen.push(observation.gpu);
            Settings::unchanged().with_batch_size(observation.gpu + 1)
        });
        assert_eq!(
            decided,
            vec![
                Settings::unchanged().with_batch_size(2),
                Settings::unchanged(),
                Settings::unchanged().with_batch_size(1),
            ]
        );
        assert_eq!(seen, vec![vec![0], vec![1]]);
    }
}
