//! The oracle's invariant, checked (`tokwatt eval --plan --check`): no fixed setting of a
//! grid, held through a phase from where the oracle's schedule left the run, beats the
//! oracle's phase by more than [`INVARIANT_MARGIN`] while keeping the objective. A
//! reference is a bound: this is the test that nothing reachable beats it.

use serde::Serialize;

use super::fixed::OracleSetting;
use super::oracle;
use super::scenario::EvalScenario;
use super::search::{
    Grids, Trial, keeps_on, phase_ticks, search_with_starts, seed_phases, shared_allowance,
};
use tokwatt_sim::SimError;

/// The fixed settings the oracle's invariant is checked against: every combination of
/// these, held through a phase.
#[derive(Debug, Clone)]
pub struct CheckGrid {
    /// Rungs of the cap range, evenly spaced from the top (in 25 W steps).
    pub caps: usize,
    /// Rungs of the SM clock ladder, evenly spaced from the top (no lock).
    pub clocks: usize,
    /// Rungs of the batch grid, evenly spaced up to the largest.
    pub batches: usize,
    /// Token budgets: the largest, then halves (a decode-only scenario has one).
    pub budgets: usize,
}

impl CheckGrid {
    /// What `tokwatt eval --plan --check` runs: 6 caps × 6 clocks × 4 batches × 3 budgets.
    pub fn coarse() -> Self {
        CheckGrid {
            caps: 6,
            clocks: 6,
            batches: 4,
            budgets: 3,
        }
    }

    fn settings(&self, grids: &Grids) -> Vec<OracleSetting> {
        let spread = |len: usize, rungs: usize| -> Vec<usize> {
            let rungs = rungs.clamp(1, len.max(1));
            let mut picked: Vec<usize> = (0..rungs)
                .map(|i| {
                    if rungs == 1 {
                        0
                    } else {
                        i * (len - 1) / (rungs - 1)
                    }
                })
                .collect();
            picked.dedup();
            picked
        };
        let ladder = oracle::cap_grid(grids.cap_min_w, grids.cap_max_w);
        let caps: Vec<f64> = spread(ladder.len(), self.caps)
            .into_iter()
            .map(|i| ladder[i])
            .collect();
        let clocks: Vec<u32> = spread(grids.clocks.len(), self.clocks)
            .into_iter()
            .map(|i| grids.clocks[i])
            .collect();
        // Batches from the largest down, so that the largest is always checked.
        let batches: Vec<u32> = spread(grids.batches.len(), self.batches)
            .into_iter()
            .map(|i| grids.batches[grids.batches.len() - 1 - i])
            .collect();
        let budgets: Vec<u32> = grids
            .budgets
            .iter()
            .copied()
            .take(self.budgets.max(1))
            .collect();
        let mut settings = Vec::new();
        for &power_cap_w in &caps {
            for &sm_clock_max_mhz in &clocks {
                for &batch_size in &batches {
                    for &token_budget in &budgets {
                        settings.push(OracleSetting {
                            power_cap_w,
                            sm_clock_max_mhz,
                            batch_size,
                            token_budget,
                        });
                    }
                }
            }
        }
        settings
    }
}

/// A fixed setting that beat the oracle's phase while keeping the objective.
#[derive(Debug, Clone, Serialize)]
pub struct Beaten {
    pub setting: OracleSetting,
    pub tokens_per_joule: f64,
    /// Its tokens per joule over the oracle's phase's.
    pub ratio: f64,
}

/// One phase of the oracle's invariant check.
#[derive(Debug, Clone, Serialize)]
pub struct CheckedPhase {
    pub start_s: f64,
    pub end_s: f64,
    pub oracle: OracleSetting,
    pub oracle_tokens_per_joule: f64,
    pub settings_checked: usize,
    /// How many of them kept the objective on the first seed (the oracle's own bar).
    pub kept_objective: usize,
    /// The best of those over the oracle's phase (those beating it only where they keep
    /// the objective on every seed too).
    pub best_ratio: Option<f64>,
    /// Those that beat the oracle by more than [`INVARIANT_MARGIN`].
    pub beaten_by: Vec<Beaten>,
}

/// The oracle's invariant on one scenario. **API boundary**: `tokwatt eval --plan --check
/// --json`.
#[derive(Debug, Clone, Serialize)]
pub struct InvariantCheck {
    pub scenario: String,
    pub phases: Vec<CheckedPhase>,
    /// No phase beaten by more than [`INVARIANT_MARGIN`].
    pub holds: bool,
    /// Every figure is simulator output.
    pub data_source: String,
}

/// How much better than the oracle a fixed setting may be before the invariant fails.
pub const INVARIANT_MARGIN: f64 = 0.005;

/// The oracle's invariant: no fixed setting of `grid`, held through a phase from where
/// the oracle's schedule left the runs, beats the oracle's phase (on the first seed) by
/// more than [`INVARIANT_MARGIN`] while keeping the objective on every seed as the
/// oracle's search must (the same bar: ticks over, requests turned away, the queue left).
/// With no tokens asked for, less power is what beats.
pub fn check(
    scenario: &EvalScenario,
    duration_s: f64,
    seeds: &[u64],
    grid: &CheckGrid,
) -> Result<InvariantCheck, SimError> {
    let grids = Grids::of(scenario);
    let settings = grid.settings(&grids);
    let mut phases = Vec::new();
    for (phase, bases) in search_with_starts(scenario, duration_s, seeds)? {
        let ticks = phase_ticks(phase.start_s, phase.end_s);
        let (views, _, _) = seed_phases(scenario, &grids, &bases, ticks, phase.arrival_rps)?;
        let (first, others) = views.split_first().ok_or(SimError::GpuCount(0))?;
        let shared = shared_allowance(&views);
        let (oracle_trial, _) = first.run(phase.setting, None)?;
        let ratio_of = |trial: &Trial| {
            if oracle_trial.tokens_per_joule > 0.0 {
                trial.tokens_per_joule / oracle_trial.tokens_per_joule
            } else if trial.power_w > 0.0 {
                // Nothing asked for: the one drawing less power is the better.
                oracle_trial.power_w / trial.power_w
            } else {
                1.0
            }
        };
        let mut kept = 0;
        let mut best_ratio: Option<f64> = None;
        let mut beaten_by = Vec::new();
        for &setting in &settings {
            let (trial, _) = first.run(setting, Some(shared))?;
            if !first.feasible_within(&trial, shared) {
                continue;
            }
            kept += 1;
            let ratio = ratio_of(&trial);
            if ratio > 1.0 + INVARIANT_MARGIN {
                // It must keep the objective on every seed, as the oracle's settings do.
                if keeps_on(others, setting, shared - trial.violations)?.is_none() {
                    continue;
                }
                beaten_by.push(Beaten {
                    setting,
                    tokens_per_joule: trial.tokens_per_joule,
                    ratio,
                });
            }
            best_ratio = Some(best_ratio.map_or(ratio, |b| b.max(ratio)));
        }
        beaten_by.sort_by(|a, b| b.ratio.total_cmp(&a.ratio));
        phases.push(CheckedPhase {
            start_s: phase.start_s,
            end_s: phase.end_s,
            oracle: phase.setting,
            oracle_tokens_per_joule: oracle_trial.tokens_per_joule,
            settings_checked: settings.len(),
            kept_objective: kept,
            best_ratio,
            beaten_by,
        });
    }
    Ok(InvariantCheck {
        scenario: scenario.name.clone(),
        holds: phases.iter().all(|p| p.beaten_by.is_empty()),
        phases,
        data_source: format!(
            "simulator output (simulated runs of {}, seeds {seeds:?})",
            scenario.profile.name
        ),
    })
}
