//! The judge: every policy on every judging scenario on the simulator, over several seeds,
//! against the oracle (the best settings per demand phase, see [`oracle`]).
//!
//! Policies are judged on the simulator's **true** tokens and energy (no sensor gain error,
//! no update quantisation): the sensors' noise is what the policy has to cope with, not
//! what it is scored by. Every figure is simulator output.
//!
//! Per policy, scenario and seed the judge runs the policy through the same agent code as
//! `tokwatt run` (plugin, envelope, control loop), with the scenario's objective replacing
//! the spec's own, and the oracle's schedule on the same seed (the same arrivals). From
//! the two it takes:
//!
//! - `ratio`: the policy's tokens per joule over the oracle's, times the share of the
//!   oracle's served demand the policy served (a policy that serves less has the
//!   shortfall counted against it, at most 1);
//! - `ticks_to_95` / `ticks_to_98`: per demand phase, the ticks from the phase's start
//!   until the policy's tokens per joule over the trailing [`TRAILING_WINDOW_S`] first
//!   reaches that fraction of the oracle's over the same seconds and holds it for
//!   [`HOLD_S`]; a phase where it never does counts as its full length; the mean over
//!   phases;
//! - `slo_violation_fraction`, `served_fraction` and `setting_changes` from the run's
//!   summary.
//!
//! Seeds run in parallel on the cores there are; the figures are medians over seeds.

pub mod family;
mod fixed;
pub mod invariant;
mod judge;
pub mod oracle;
pub mod plan;
mod report;
mod rule;
mod runner;
pub mod scenario;
pub mod search;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use serde::Serialize;

use judge::{RunOutcome, judge};
pub use judge::{Series, Spread, median, time_to_fraction};
pub use oracle::{OracleSetting, PhaseOracle};
pub use report::{
    EvalTable, NO_SCENARIO_RAN, entry_table, eval_report, figure, percent_figure, policy_table,
    ranked_entries, ranked_policies,
};
pub use rule::{
    MAX_VIOLATION_FRACTION, RuleFigures, SERVED_MARGIN, eval_advice, failure_rule_words,
    objective_breach,
};
use runner::{parallel, run_policy, run_references};
pub use scenario::{EvalScenario, ScenarioError};
use tokwatt_agent::AgentError;
use tokwatt_agent::assembly::AssemblyError;
use tokwatt_policy::spec::{PolicySpec, SpecError};
use tokwatt_sim::SimError;

/// Version of `eval.json`'s layout.
pub const EVAL_FORMAT_VERSION: u32 = 4;
/// How long after a demand phase starts the causal reference takes up its settings,
/// seconds: a controller that sees the phase only through its one-second windows needs a
/// few of them to tell a shift from noise, and a few ticks to move its settings.
pub const REACTION_LAG_S: f64 = 10.0;
/// The span over which tokens per joule is compared with the oracle's, seconds.
pub const TRAILING_WINDOW_S: f64 = 30.0;
/// How long a fraction must hold to count as reached, seconds.
pub const HOLD_S: f64 = 10.0;

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error(transparent)]
    Scenario(#[from] ScenarioError),
    #[error("policy spec {}: {source}", path.display())]
    Spec { path: PathBuf, source: SpecError },
    #[error("scenario `{scenario}`: {source}")]
    Sim { scenario: String, source: SimError },
    #[error("scenario `{scenario}`: {source}")]
    Assembly {
        scenario: String,
        source: AssemblyError,
    },
    #[error("policy `{policy}` on scenario `{scenario}` (seed {seed}): {source}{advice}")]
    Run {
        policy: String,
        scenario: String,
        seed: u64,
        source: Box<AgentError>,
        /// What a user can do about it under the judge ([`eval_advice`]; empty where the
        /// error's own words suffice).
        advice: String,
    },
    #[error("give at least one policy spec and one scenario")]
    Nothing,
    #[error("--duration {duration_s} s: a judging run lasts 10 s to a week (604800 s)")]
    Duration { duration_s: f64 },
    #[error("the judge was interrupted")]
    Interrupted,
}

/// What to judge.
#[derive(Debug, Clone)]
pub struct EvalRequest {
    pub policies: Vec<PathBuf>,
    pub scenarios: Vec<EvalScenario>,
    /// Seeds 1..=seeds.
    pub seeds: u64,
    /// Overrides every scenario's own duration.
    pub duration_s: Option<f64>,
    /// Parallel runs (at least 1).
    pub threads: usize,
    pub plugin_dirs: Vec<PathBuf>,
    pub cache_dir: Option<PathBuf>,
}

/// Progress, reported as each piece finishes.
#[derive(Debug, Clone)]
pub enum EvalProgress {
    Oracle {
        scenario: String,
        done: usize,
        of: usize,
    },
    Run {
        policy: String,
        scenario: String,
        seed: u64,
        /// Tokens per joule, or why the run failed.
        outcome: Result<f64, String>,
        done: usize,
        of: usize,
    },
}

/// One policy on one scenario. **API boundary**: `eval.json`'s entries.
#[derive(Debug, Clone, Serialize)]
pub struct EvalEntry {
    pub policy: String,
    pub scenario: String,
    pub seeds: Vec<u64>,
    pub tokens_per_joule: Spread,
    pub oracle_tokens_per_joule: f64,
    /// The causal reference's: the oracle's settings taken up [`REACTION_LAG_S`] after
    /// each phase starts.
    pub causal_tokens_per_joule: f64,
    /// The default settings' (no cap, no clock lock, the starting batch) throughout.
    pub default_tokens_per_joule: f64,
    /// The judged ratio: `measured_ratio` where the policy kept the objective, none where
    /// the scenario counts as failed for it (`failed`), whatever it measured.
    pub ratio: Option<f64>,
    /// Median over seeds of the policy's tokens per joule over the oracle's (same seed),
    /// times its served share of the oracle's served demand (at most 1); none without a
    /// run.
    pub measured_ratio: Option<f64>,
    /// The judged ratio to the causal reference (none where the scenario failed).
    pub causal_ratio: Option<f64>,
    /// As `measured_ratio`, against the causal reference.
    pub measured_causal_ratio: Option<f64>,
    /// Median over seeds of the policy's tokens per joule over the default settings'.
    pub over_default: Option<f64>,
    /// The causal reference's share of ticks over the objective (median over seeds).
    pub causal_violation_fraction: f64,
    /// The oracle's schedule's and the default settings' (medians over seeds).
    pub oracle_violation_fraction: f64,
    pub default_violation_fraction: f64,
    /// The causal reference's and the default settings' served shares of the demand
    /// (medians over seeds; the oracle's is `oracle_served_fraction`).
    pub causal_served_fraction: f64,
    pub default_served_fraction: f64,
    /// What the failure rule read (means over seeds; `None` where no seed ran).
    pub failure_rule: Option<RuleFigures>,
    /// Why the scenario counts as failed for the policy: it broke the objective on more
    /// than [`MAX_VIOLATION_FRACTION`] of ticks or served less than the oracle by more
    /// than [`SERVED_MARGIN`] (means over seeds), or it could not run.
    pub failed: Option<String>,
    /// `None` when no phase of any seed reached it.
    pub ticks_to_95: Option<f64>,
    pub ticks_to_98: Option<f64>,
    pub slo_violation_fraction: f64,
    pub served_fraction: f64,
    pub oracle_served_fraction: f64,
    pub setting_changes: f64,
    /// Ticks the policy was not in charge (trap, deadline, ejection).
    pub fallback_ticks: f64,
    /// Why a seed's run did not happen (the policy refused the scenario, say): the
    /// figures then cover the other seeds only, or none.
    pub failure: Option<String>,
}

/// One policy over every scenario: medians of its entries.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyResult {
    pub policy: String,
    /// Median over scenarios of the judged ratio, a failed scenario counting as 0: the
    /// headline, beside `failed` and the worst scenario.
    pub ratio: f64,
    /// The same against the causal reference.
    pub causal_ratio: f64,
    /// Median over scenarios of the tokens per joule over the default settings' (over
    /// the scenarios that ran).
    pub over_default: f64,
    /// Scenarios that count as failed (see [`EvalEntry::failed`]).
    pub failed: usize,
    /// The scenario with the lowest judged ratio (a failed one first) and that ratio
    /// (none where it failed).
    pub worst_scenario: Option<String>,
    pub worst_ratio: Option<f64>,
    pub ticks_to_95: Option<f64>,
    pub ticks_to_98: Option<f64>,
    pub slo_violation_fraction: f64,
    pub served_fraction: f64,
    /// The oracle's served fraction, median over the same scenarios.
    pub oracle_served_fraction: f64,
    /// The scenarios that count as failed, with why.
    pub failed_scenarios: Vec<String>,
}

impl PolicyResult {
    fn of(policy: &str, entries: &[EvalEntry]) -> Self {
        let mine: Vec<&EvalEntry> = entries.iter().filter(|e| e.policy == policy).collect();
        let pick =
            |f: &dyn Fn(&EvalEntry) -> f64| median(&mine.iter().map(|e| f(e)).collect::<Vec<_>>());
        // A scenario that never reached the fraction counts as slower than any that did
        // (failed runs are left out), so the median is `None` when most never did.
        let reached = |f: &dyn Fn(&EvalEntry) -> Option<f64>| {
            let m = pick(&|e| {
                if e.failure.is_some() && e.seeds.is_empty() {
                    f64::NAN
                } else {
                    f(e).unwrap_or(f64::INFINITY)
                }
            });
            m.is_finite().then_some(m)
        };
        // A failed scenario scores 0, below any it passed.
        let judged = |e: &EvalEntry| e.ratio.unwrap_or(0.0);
        let worst = mine.iter().min_by(|x, y| judged(x).total_cmp(&judged(y)));
        Self {
            policy: policy.to_owned(),
            ratio: median(&mine.iter().map(|e| judged(e)).collect::<Vec<_>>()),
            causal_ratio: median(
                &mine
                    .iter()
                    .map(|e| e.causal_ratio.unwrap_or(0.0))
                    .collect::<Vec<_>>(),
            ),
            over_default: pick(&|e| e.over_default.unwrap_or(f64::NAN)),
            failed: mine.iter().filter(|e| e.failed.is_some()).count(),
            worst_scenario: worst.map(|e| e.scenario.clone()),
            worst_ratio: worst.and_then(|e| e.ratio),
            ticks_to_95: reached(&|e| e.ticks_to_95),
            ticks_to_98: reached(&|e| e.ticks_to_98),
            slo_violation_fraction: pick(&|e| e.slo_violation_fraction),
            served_fraction: pick(&|e| e.served_fraction),
            oracle_served_fraction: pick(&|e| e.oracle_served_fraction),
            failed_scenarios: mine
                .iter()
                .filter_map(|e| {
                    e.failed
                        .as_ref()
                        .map(|why| format!("{} ({why})", e.scenario))
                })
                .collect(),
        }
    }
}

impl EvalEntry {
    /// The judged ratio in three places, or `FAILED` where the scenario failed.
    pub fn ratio_text(&self) -> String {
        match (self.ratio, &self.failed) {
            (Some(ratio), _) => format!("{ratio:.3}"),
            (None, Some(_)) => "FAILED".to_owned(),
            (None, None) => "—".to_owned(),
        }
    }
}

impl EvalEntry {
    /// The judged ratio to the causal reference, or `FAILED`.
    pub fn causal_ratio_text(&self) -> String {
        match (self.causal_ratio, &self.failed) {
            (Some(ratio), _) => format!("{ratio:.3}"),
            (None, Some(_)) => "FAILED".to_owned(),
            (None, None) => "—".to_owned(),
        }
    }
}

impl PolicyResult {
    /// The worst scenario and its judged ratio (`FAILED` where it failed).
    pub fn worst_text(&self) -> String {
        match (&self.worst_scenario, self.worst_ratio) {
            (Some(scenario), Some(ratio)) => format!("{scenario} {ratio:.3}"),
            (Some(scenario), None) => format!("{scenario} FAILED"),
            (None, _) => "—".to_owned(),
        }
    }
}

/// `value` with `decimals` places, or "never".
pub fn fmt_option(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(|| "never".to_owned(), |v| format!("{v:.decimals$}"))
}

/// A scenario as judged: its oracle.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioResult {
    pub name: String,
    pub description: String,
    pub gpu: String,
    pub gpus: u32,
    pub duration_s: f64,
    /// A phase no setting serves: the oracle's violations are allowed, served demand
    /// judged first.
    pub overload: bool,
    pub oracle: Vec<PhaseOracle>,
    /// The oracle's schedule's and the causal reference's share of ticks over the
    /// objective within the phases the oracle found feasible, means over seeds (none: no
    /// such phase). The causal reference is built to keep these at the oracle's own bar
    /// ([`search::PHASE_VIOLATION_ALLOWANCE`]).
    pub oracle_violation_fraction_in_feasible_phases: Option<f64>,
    pub causal_violation_fraction_in_feasible_phases: Option<f64>,
}

/// Everything the judge found. **API boundary**: `eval.json`.
#[derive(Debug, Clone, Serialize)]
pub struct EvalResults {
    pub format_version: u32,
    pub data_source: String,
    pub seeds: Vec<u64>,
    pub trailing_window_s: f64,
    pub hold_s: f64,
    /// The causal reference's reaction lag, seconds.
    pub reaction_lag_s: f64,
    pub scenarios: Vec<ScenarioResult>,
    pub entries: Vec<EvalEntry>,
    /// Per policy, the median over scenarios of its entries.
    pub policies: Vec<PolicyResult>,
    /// Wall time of the whole evaluation, seconds.
    pub wall_time_s: f64,
    /// Series of the first seed, for the report (not written to `eval.json`).
    #[serde(skip)]
    pub first_seed_series: Vec<SeriesOf>,
}

/// The first seed's series of one policy (or the oracle) on one scenario.
#[derive(Debug, Clone)]
pub struct SeriesOf {
    /// A policy's name, or `oracle`.
    pub who: String,
    pub scenario: String,
    pub series: Series,
}

/// Judge every policy on every scenario.
pub fn evaluate(
    request: &EvalRequest,
    stop: Arc<AtomicBool>,
    progress: &mut dyn FnMut(EvalProgress),
) -> Result<EvalResults, EvalError> {
    let started = Instant::now();
    if request.policies.is_empty() || request.scenarios.is_empty() {
        return Err(EvalError::Nothing);
    }
    if let Some(duration_s) = request.duration_s
        && !scenario::duration_in_range(duration_s)
    {
        return Err(EvalError::Duration { duration_s });
    }
    let specs: Vec<PolicySpec> = request
        .policies
        .iter()
        .map(|path| {
            PolicySpec::load(path).map_err(|source| EvalError::Spec {
                path: path.clone(),
                source,
            })
        })
        .collect::<Result<_, _>>()?;
    let seeds: Vec<u64> = (1..=request.seeds.max(1)).collect();
    let threads = request.threads.max(1);
    let duration_of = |s: &EvalScenario| request.duration_s.unwrap_or(s.duration_s);

    // The oracle of each scenario (its search uses the first seed), then its schedule run
    // on every seed: one job each.
    let oracle_jobs: Vec<usize> = (0..request.scenarios.len()).collect();
    let oracles = parallel(
        &oracle_jobs,
        threads,
        &stop,
        |&i| {
            let scenario = &request.scenarios[i];
            oracle::search(scenario, duration_of(scenario), &seeds).map_err(|source| {
                EvalError::Sim {
                    scenario: scenario.name.clone(),
                    source,
                }
            })
        },
        &mut |i, _| {
            progress(EvalProgress::Oracle {
                scenario: request.scenarios[oracle_jobs[i]].name.clone(),
                done: i + 1,
                of: oracle_jobs.len(),
            })
        },
    )?;
    let mut schedule_jobs: Vec<(usize, u64)> = Vec::new();
    for s in 0..request.scenarios.len() {
        schedule_jobs.extend(seeds.iter().map(|&seed| (s, seed)));
    }
    let schedules = parallel(
        &schedule_jobs,
        threads,
        &stop,
        |&(s, seed)| {
            let scenario = &request.scenarios[s];
            run_references(scenario, &oracles[s], duration_of(scenario), seed)
        },
        &mut |_, _| {},
    )?;

    let mut run_jobs: Vec<(usize, usize, u64)> = Vec::new();
    for p in 0..specs.len() {
        for s in 0..request.scenarios.len() {
            run_jobs.extend(seeds.iter().map(|&seed| (p, s, seed)));
        }
    }
    let done = AtomicUsize::new(0);
    let runs = parallel(
        &run_jobs,
        threads,
        &stop,
        |&(p, s, seed)| {
            let scenario = &request.scenarios[s];
            // A policy that cannot run on a scenario (it refuses the objective, say) is
            // an entry with its reason, not the end of the evaluation.
            Ok(run_policy(
                request,
                &specs[p],
                scenario,
                duration_of(scenario),
                seed,
                &stop,
            )
            .map_err(|error| error.to_string()))
        },
        &mut |i, outcome: &Result<RunOutcome, String>| {
            let (p, s, seed) = run_jobs[i];
            progress(EvalProgress::Run {
                policy: specs[p].name.clone(),
                scenario: request.scenarios[s].name.clone(),
                seed,
                outcome: outcome
                    .as_ref()
                    .map(|o| o.summary.totals.tokens_per_joule)
                    .map_err(Clone::clone),
                done: done.fetch_add(1, Ordering::Relaxed) + 1,
                of: run_jobs.len(),
            })
        },
    )?;

    let mut entries = Vec::new();
    let mut first_seed_series = Vec::new();
    for (s, scenario) in request.scenarios.iter().enumerate() {
        let schedule_of = |seed: u64| {
            schedule_jobs
                .iter()
                .position(|&job| job == (s, seed))
                .map(|i| &schedules[i])
        };
        if let Some(references) = schedule_of(seeds[0]) {
            for (who, schedule) in [
                ("oracle", &references.oracle),
                ("causal reference", &references.causal),
            ] {
                first_seed_series.push(SeriesOf {
                    who: who.into(),
                    scenario: scenario.name.clone(),
                    series: schedule.series.clone(),
                });
            }
        }
        for (p, spec) in specs.iter().enumerate() {
            let mut per_seed = Vec::new();
            let mut failure = None;
            for &seed in &seeds {
                let Some(run_index) = run_jobs.iter().position(|&job| job == (p, s, seed)) else {
                    continue;
                };
                let Some(schedule) = schedule_of(seed) else {
                    continue;
                };
                match &runs[run_index] {
                    Ok(run) => per_seed.push((seed, run, schedule)),
                    Err(reason) => {
                        failure.get_or_insert_with(|| format!("seed {seed}: {reason}"));
                    }
                }
            }
            if let Some((_, first, _)) = per_seed.first() {
                first_seed_series.push(SeriesOf {
                    who: spec.name.clone(),
                    scenario: scenario.name.clone(),
                    series: first.series.clone(),
                });
            }
            let mut entry = judge(spec, scenario, &oracles[s], &per_seed);
            if per_seed.is_empty() {
                // Refusing a scenario is no way out of it: it counts as failed.
                entry.failed = Some(format!(
                    "could not run: {}",
                    failure.as_deref().unwrap_or("no seed ran")
                ));
            }
            entry.failure = failure;
            entries.push(entry);
        }
    }
    let profiles: std::collections::BTreeSet<String> = request
        .scenarios
        .iter()
        .map(|s| s.profile.name.clone())
        .collect();
    let data_source = format!(
        "simulator output, judged on the simulator's true energy (simulated {})",
        profiles.into_iter().collect::<Vec<_>>().join(", ")
    );
    Ok(EvalResults {
        format_version: EVAL_FORMAT_VERSION,
        data_source,
        seeds,
        trailing_window_s: TRAILING_WINDOW_S,
        hold_s: HOLD_S,
        reaction_lag_s: REACTION_LAG_S,
        scenarios: request
            .scenarios
            .iter()
            .zip(oracles)
            .enumerate()
            .map(|(index, (s, oracle))| ScenarioResult {
                oracle_violation_fraction_in_feasible_phases: feasible_mean(
                    &schedule_jobs,
                    &schedules,
                    index,
                    |r| &r.oracle,
                ),
                causal_violation_fraction_in_feasible_phases: feasible_mean(
                    &schedule_jobs,
                    &schedules,
                    index,
                    |r| &r.causal,
                ),
                name: s.name.clone(),
                description: s.description.clone(),
                gpu: s.profile.name.clone(),
                gpus: s.gpus,
                duration_s: duration_of(s),
                overload: oracle::is_overload(&oracle),
                oracle,
            })
            .collect(),
        policies: specs
            .iter()
            .map(|spec| PolicyResult::of(&spec.name, &entries))
            .collect(),
        entries,
        wall_time_s: started.elapsed().as_secs_f64(),
        first_seed_series,
    })
}

/// The mean over seeds of one reference's share of ticks over the objective in the
/// feasible phases of scenario `index`.
fn feasible_mean(
    jobs: &[(usize, u64)],
    schedules: &[judge::References],
    index: usize,
    which: impl Fn(&judge::References) -> &judge::Schedule,
) -> Option<f64> {
    let shares: Vec<f64> = jobs
        .iter()
        .zip(schedules)
        .filter(|((s, _), _)| *s == index)
        .filter_map(|(_, references)| which(references).feasible_violation_fraction)
        .collect();
    (!shares.is_empty()).then(|| shares.iter().sum::<f64>() / shares.len() as f64)
}

#[cfg(test)]
mod invariant_tests;
#[cfg(test)]
mod tests;
