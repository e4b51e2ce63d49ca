//! The oracle's invariant (`tokwatt eval --plan --check`), tested: on every shipped judging
//! and serving scenario and on a sample of both families' held-out draws, no fixed setting
//! of a grid, held through a phase from where the oracle's schedule left the run, beats the
//! oracle's phase by more than [`invariant::INVARIANT_MARGIN`] while keeping the objective.
//!
//! The scenarios run their first [`CHECKED_S`] seconds on a grid smaller than the
//! command's, so that CI's two cores finish it in about a minute; the full scenarios on the
//! command's grid are a measurement (`docs/measurements/sim-2026-12-07-oracle`).

use std::path::PathBuf;

use super::family::{self, Split};
use super::invariant::{self, CheckGrid};
use super::scenario::EvalScenario;

/// Simulated seconds of each scenario checked.
const CHECKED_S: f64 = 360.0;

fn shipped(folder: &str) -> Vec<EvalScenario> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scenarios");
    EvalScenario::load_all(&[root.join(folder)]).expect("the shipped scenarios load")
}

#[test]
fn no_fixed_setting_beats_the_oracle_on_the_shipped_scenarios_or_a_family_sample() {
    let mut scenarios = shipped("eval");
    scenarios.extend(shipped("serving"));
    for (name, count) in [("serving", 4), ("broad", 2)] {
        let drawn = family::draw(name, Split::HeldOut, count, 11).expect("draws");
        scenarios.extend(drawn.into_iter().map(|d| d.scenario));
    }
    let grid = CheckGrid {
        caps: 4,
        clocks: 4,
        batches: 3,
        budgets: 2,
    };
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let checks = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(scenario) = scenarios.get(i) else {
                        break;
                    };
                    let duration = CHECKED_S.min(scenario.duration_s);
                    let check = invariant::check(scenario, duration, &[1], &grid).expect("checks");
                    checks
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(check);
                }
            });
        }
    });
    let checks = checks
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    assert_eq!(checks.len(), scenarios.len());
    let mut beaten = Vec::new();
    for check in &checks {
        for phase in &check.phases {
            println!(
                "{} {:.0}-{:.0} s: {} of {} settings kept the objective, best {}",
                check.scenario,
                phase.start_s,
                phase.end_s,
                phase.kept_objective,
                phase.settings_checked,
                phase
                    .best_ratio
                    .map_or_else(|| "none".to_owned(), |r| format!("{r:.4} of the oracle"))
            );
            if let Some(b) = phase.beaten_by.first() {
                beaten.push(format!(
                    "{} {:.0}-{:.0} s: {:?} at {:.4} of the oracle's {:?}",
                    check.scenario, phase.start_s, phase.end_s, b.setting, b.ratio, phase.oracle
                ));
            }
        }
    }
    assert!(
        beaten.is_empty(),
        "fixed settings beat the oracle:\n{}",
        beaten.join("\n")
    );
}
