//! `tokwatt tune`: which parameters of a policy are best, by rounds of A/B on the simulator.
//!
//! The candidates are the cartesian product of the parameters' ranges. Each round compares
//! every surviving candidate (arm B) with the spec as given (the reference, arm A) by
//! [`run_replicated`] (independent trajectories, each on a simulator of its own), every
//! candidate of a round on the same seed (common random numbers: the same moments and
//! arrivals), with a fixed pairs budget
//! for the round. Candidates are ranked by the ratio B/A, but one that serves less or
//! violates the objective more than the reference beyond the plan's [`Tolerances`] ranks
//! below every one that does not. The best 1/η go on with η times the pairs (successive
//! halving); the search ends when one is left. Every A/B's `run_time_s` is counted: the sum
//! is the search's cost in simulated time.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};

use super::run::{AbOutcome, AbRequest, AbRunError, Schedule, run_replicated};
use super::sim_work::SimWork;
use super::stats::{
    AbError, Arm, Compliance, Decision, MAX_BUDGET, SequentialPlan, Tolerances, objective_check,
};
use tokwatt_agent::AgentError;
use tokwatt_agent::assembly::{self, BackendRequest, RunMeta, SimTarget, Target};
use tokwatt_policy::spec::PolicySpec;

#[cfg(test)]
mod tests;

/// Version of `tune.json`'s layout. 2: a candidate (or reference) ahead on tokens per
/// joule but refused on the objective has a decision of its own (`b-refused`,
/// `a-refused`) where 1 wrote `no-difference`.
pub const TUNE_FORMAT_VERSION: u32 = 2;
/// The most candidates a search takes: beyond this, narrow the ranges or coarsen the steps.
pub const MAX_CANDIDATES: usize = 4096;
/// The ranges' values a numeric range may hold before it is refused as a typo.
const MAX_VALUES_PER_RANGE: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    #[error(
        "--param `{text}`: {problem}; write NAME=LO..HI:STEP (inclusive, numeric, e.g. power_cap_w=300..700:50) or NAME=a,b,c"
    )]
    BadParam { text: String, problem: String },
    #[error("--param `{name}` is given twice; give each parameter once")]
    DuplicateParam { name: String },
    #[error(
        "no --param given: name at least one parameter to tune, e.g. --param power_cap_w=300..700:50"
    )]
    NoParams,
    #[error(
        "{count} candidates (the product of the ranges' sizes: {sizes}) is more than {MAX_CANDIDATES}; narrow the ranges or coarsen the steps"
    )]
    TooManyCandidates { count: u128, sizes: String },
    #[error(
        "η = {eta} is not a reduction factor; use an integer of at least 2 (3 keeps a third each round)"
    )]
    BadEta { eta: usize },
    #[error("--pairs {pairs}: each round needs at least 2 pairs for an interval")]
    BadPairs { pairs: usize },
    #[error(
        "every candidate was refused by policy `{policy}` at init (the first: {first}); check the parameter names and values against the policy's documentation"
    )]
    EveryCandidateRefused { policy: String, first: String },
    #[error("setting up the simulator: {0}")]
    Assembly(#[from] Box<assembly::AssemblyError>),
    #[error(transparent)]
    Stats(#[from] AbError),
    #[error("round {round}, candidate {params}: {source}")]
    Ab {
        round: usize,
        params: String,
        #[source]
        source: Box<AbRunError>,
    },
    #[error("interrupted in round {round}: no winner; run again")]
    Interrupted { round: usize },
    #[error("{path}: {problem}")]
    TunedSpec { path: PathBuf, problem: String },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Report(#[from] tokwatt_report::ReportError),
}

/// One parameter and the values it is tried at, as the policy will read them (strings).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamRange {
    pub name: String,
    pub values: Vec<String>,
}

impl ParamRange {
    /// `NAME=LO..HI:STEP` (inclusive, numeric) or `NAME=a,b,c`.
    pub fn parse(text: &str) -> Result<Self, TuneError> {
        let bad = |problem: &str| TuneError::BadParam {
            text: text.to_owned(),
            problem: problem.to_owned(),
        };
        let (name, range) = text
            .split_once('=')
            .ok_or_else(|| bad("there is no `=` between the name and the range"))?;
        let name = name.trim();
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(bad(
                "the name must be a parameter of the spec's [params]: letters, digits, `_` or `-`",
            ));
        }
        let range = range.trim();
        let values = if let Some((bounds, step)) = range.split_once(':') {
            let (low, high) = bounds
                .split_once("..")
                .ok_or_else(|| bad("a range with a step needs `..` between its bounds"))?;
            numeric_range(low.trim(), high.trim(), step.trim()).map_err(|p| bad(&p))?
        } else if range.contains("..") {
            return Err(bad("the range has no step (`:STEP`)"));
        } else {
            let values: Vec<String> = range.split(',').map(|v| v.trim().to_owned()).collect();
            if values.iter().any(String::is_empty) {
                return Err(bad("the list has an empty value"));
            }
            let mut seen = std::collections::HashSet::new();
            if let Some(twice) = values.iter().find(|v| !seen.insert(v.as_str())) {
                return Err(bad(&format!("the list has `{twice}` twice")));
            }
            values
        };
        Ok(Self {
            name: name.to_owned(),
            values,
        })
    }
}

/// The values `low, low+step, …` up to `high` inclusive, written as given: integers stay
/// integers (`300`, not `300.0`).
fn numeric_range(low: &str, high: &str, step: &str) -> Result<Vec<String>, String> {
    let number = |what: &str, text: &str| -> Result<f64, String> {
        match text.parse::<f64>() {
            Ok(v) if v.is_finite() => Ok(v),
            _ => Err(format!("the {what} `{text}` is not a number")),
        }
    };
    let (lo, hi, st) = (
        number("low bound", low)?,
        number("high bound", high)?,
        number("step", step)?,
    );
    if st <= 0.0 {
        return Err(format!("the step {step} must be positive"));
    }
    if hi < lo {
        return Err(format!(
            "the high bound {high} is below the low bound {low}"
        ));
    }
    let count = ((hi - lo) / st + 1e-9).floor() + 1.0;
    if count > MAX_VALUES_PER_RANGE as f64 {
        return Err(format!(
            "{count} values is more than {MAX_VALUES_PER_RANGE}; use a larger step"
        ));
    }
    let integers = [low, high, step].iter().all(|t| t.parse::<i64>().is_ok());
    let decimals = [low, high, step]
        .iter()
        .map(|t| t.split_once('.').map_or(0, |(_, f)| f.len()))
        .max()
        .unwrap_or(0)
        // An f64 holds no more than 17 significant digits (and a format precision past
        // 65 535 panics): longer fractions are written to that.
        .min(17);
    Ok((0..count as usize)
        .map(|i| {
            let value = lo + st * i as f64;
            if integers {
                format!("{}", value.round() as i64)
            } else {
                format!("{value:.decimals$}")
            }
        })
        .collect())
}

/// Every combination of the ranges' values, the first parameter varying slowest.
pub fn candidates(ranges: &[ParamRange]) -> Result<Vec<Vec<(String, String)>>, TuneError> {
    if ranges.is_empty() {
        return Err(TuneError::NoParams);
    }
    let mut names = std::collections::HashSet::new();
    for range in ranges {
        if !names.insert(range.name.as_str()) {
            return Err(TuneError::DuplicateParam {
                name: range.name.clone(),
            });
        }
    }
    let count = ranges
        .iter()
        .fold(1u128, |n, r| n.saturating_mul(r.values.len() as u128));
    if count > MAX_CANDIDATES as u128 {
        return Err(TuneError::TooManyCandidates {
            count,
            sizes: ranges
                .iter()
                .map(|r| format!("{} {}", r.name, r.values.len()))
                .collect::<Vec<_>>()
                .join(" × "),
        });
    }
    let mut all = vec![Vec::new()];
    for range in ranges {
        all = all
            .into_iter()
            .flat_map(|prefix: Vec<(String, String)>| {
                range.values.iter().map(move |value| {
                    let mut next = prefix.clone();
                    next.push((range.name.clone(), value.clone()));
                    next
                })
            })
            .collect();
    }
    Ok(all)
}

/// The reference spec with `params` set (added or replaced), sorted by key as the spec is.
pub fn candidate_spec(reference: &PolicySpec, params: &[(String, String)]) -> PolicySpec {
    let mut spec = reference.clone();
    for (name, value) in params {
        match spec.params.iter_mut().find(|(key, _)| key == name) {
            Some(slot) => slot.1 = value.clone(),
            None => spec.params.push((name.clone(), value.clone())),
        }
    }
    spec.params.sort();
    spec
}

/// What `tokwatt tune` asks for.
#[derive(Debug, Clone)]
pub struct TuneRequest {
    /// The spec as given: the reference (arm A) of every A/B, and the base of every
    /// candidate.
    pub reference: PolicySpec,
    pub ranges: Vec<ParamRange>,
    pub sim: SimTarget,
    pub seed: u64,
    /// Keep the best 1/η each round and give the next η times the pairs.
    pub eta: usize,
    /// Pairs per A/B in the first round.
    pub first_round_pairs: usize,
    pub alpha: f64,
    pub schedule: Schedule,
    pub plugin_dirs: Vec<PathBuf>,
    pub cache_dir: Option<PathBuf>,
}

/// One candidate's A/B in one round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CandidateResult {
    pub params: Vec<(String, String)>,
    /// Tokens per joule of the candidate over the reference, at the A/B's last look.
    pub ratio: f64,
    pub ci_low: f64,
    pub ci_high: f64,
    pub confidence: f64,
    pub decision: Decision,
    /// Pairs the last look used (fewer than the round's budget when the A/B decided early).
    pub pairs: usize,
    pub served_fraction: f64,
    pub served_fraction_reference: f64,
    pub violation_rate: f64,
    pub violation_rate_reference: f64,
    /// Whether it served and kept the objective as well as the reference, within the
    /// plan's tolerances, by the A/B's objective rule ([`Compliance`]): not shown to
    /// break it. One that breaks it ranks below every one that does not.
    pub compliant: bool,
    /// The rule's reading: keeps, unresolved (beyond the tolerance within the noise;
    /// ranked after those that keep it) or breaks.
    #[serde(default = "keeps")]
    pub compliance: Compliance,
    /// Where it gives up more than the tolerance, in words.
    pub not_compliant_because: Option<String>,
    /// Its place in the round, from 1.
    pub rank: usize,
    pub kept: bool,
    /// Simulated time of this A/B, both arms' epochs and their warm-ups included.
    pub run_time_s: f64,
}

fn keeps() -> Compliance {
    Compliance::Keeps
}

/// A candidate the policy refused at init: dropped, never run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Dropped {
    pub params: Vec<(String, String)>,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Round {
    /// From 1.
    pub round: usize,
    /// The pairs budget of each A/B in this round.
    pub pairs_budget: usize,
    /// The seed of every A/B in this round (the same for every candidate).
    pub seed: u64,
    /// Ranked, best first.
    pub candidates: Vec<CandidateResult>,
    pub dropped: Vec<Dropped>,
    /// How many go on to the next round (promoted ones included).
    pub kept: usize,
    /// Of those, how many come from earlier rounds, in place of candidates this round
    /// showed to break the objective.
    #[serde(default)]
    pub promoted: usize,
    pub simulated_time_s: f64,
}

/// The winner's A/B against the reference in the last round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evidence {
    pub ratio_b_over_a: f64,
    pub ci_low: f64,
    pub ci_high: f64,
    pub confidence: f64,
    pub decision: Decision,
    pub pairs: usize,
    pub served_fraction_reference: f64,
    pub served_fraction_winner: f64,
    pub violation_ticks_reference: u64,
    pub violation_ticks_winner: u64,
    pub violation_rate_reference: f64,
    pub violation_rate_winner: f64,
    pub refused_because: Option<String>,
    pub compliant: bool,
}

/// What the search found, written as `tune.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TuneOutcome {
    pub format_version: u32,
    pub policy: String,
    pub spec: String,
    pub reference_params: Vec<(String, String)>,
    pub ranges: Vec<ParamRange>,
    pub candidates: usize,
    pub eta: usize,
    pub first_round_pairs: usize,
    pub alpha: f64,
    pub tolerances: Tolerances,
    pub schedule: Schedule,
    pub tick_ms: u32,
    pub seed: u64,
    pub rounds: Vec<Round>,
    /// The winning candidate's values of the tuned parameters.
    pub winner: Vec<(String, String)>,
    /// Every parameter the tuned spec holds.
    pub winner_spec_params: Vec<(String, String)>,
    pub evidence: Evidence,
    /// Candidates refused at init.
    pub dropped: Vec<Dropped>,
    /// Every A/B's simulated time, summed: the search's cost.
    pub simulated_time_s: f64,
    /// Always true for now: tune runs on the simulator.
    pub simulated: bool,
    pub data_source: String,
    pub meta: RunMeta,
    pub notes: Vec<String>,
}

/// Reported as the search goes.
#[derive(Debug, Clone)]
pub enum TuneProgress<'a> {
    RoundStarted {
        round: usize,
        candidates: usize,
        pairs: usize,
    },
    CandidateDone {
        round: usize,
        index: usize,
        of: usize,
        result: &'a CandidateResult,
    },
    CandidateDropped {
        round: usize,
        dropped: &'a Dropped,
    },
    RoundDone {
        round: &'a Round,
    },
}

/// ` (2 of them from earlier rounds, in place of candidates that broke the objective)`,
/// or nothing when none was promoted.
pub fn promoted_words(round: &Round) -> String {
    if round.promoted == 0 {
        String::new()
    } else {
        format!(
            " ({} of them from earlier rounds, in place of candidates that broke the objective)",
            round.promoted
        )
    }
}

/// `a=1, b=2`.
pub fn format_params(params: &[(String, String)]) -> String {
    params
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The search. `stop` ends it between A/Bs (and inside one, at a tick boundary).
pub fn tune(
    request: &TuneRequest,
    stop: Arc<AtomicBool>,
    progress: &mut dyn FnMut(TuneProgress<'_>),
) -> Result<TuneOutcome, TuneError> {
    if request.eta < 2 {
        return Err(TuneError::BadEta { eta: request.eta });
    }
    if request.first_round_pairs < 2 {
        return Err(TuneError::BadPairs {
            pairs: request.first_round_pairs,
        });
    }
    // Refuse a bad α or budget before any simulation.
    SequentialPlan::new(request.first_round_pairs, request.alpha, request.seed)?;
    let all = candidates(&request.ranges)?;
    let total = all.len();
    let mut survivors = all;
    let mut rounds: Vec<Round> = Vec::new();
    let mut all_dropped: Vec<Dropped> = Vec::new();
    let mut simulated_time_s = 0.0;
    let mut pairs = request.first_round_pairs;
    let mut meta: Option<RunMeta> = None;
    let mut last_outcomes: Vec<(Vec<(String, String)>, AbOutcome)>;
    // Candidates not kept in a round though they did not break the objective, best first.
    let mut reserve: Vec<Vec<(String, String)>> = Vec::new();
    loop {
        let round_number = rounds.len() + 1;
        // Every A/B runs on the same seed: the same demand and, on the simulator, the
        // same board (its sensor gain is seeded), so candidates are compared on one device.
        let round_seed = request.seed;
        progress(TuneProgress::RoundStarted {
            round: round_number,
            candidates: survivors.len(),
            pairs,
        });
        let mut results: Vec<CandidateResult> = Vec::new();
        let mut outcomes: Vec<(Vec<(String, String)>, AbOutcome)> = Vec::new();
        let mut dropped: Vec<Dropped> = Vec::new();
        let count = survivors.len();
        for (index, params) in survivors.iter().enumerate() {
            if stop.load(Ordering::Relaxed) {
                return Err(TuneError::Interrupted {
                    round: round_number,
                });
            }
            let plan = SequentialPlan::new(pairs, request.alpha, round_seed)?;
            let tolerances = plan.tolerances;
            match run_one(request, params, plan, round_seed, stop.clone()) {
                Ok((outcome, run_meta)) => {
                    if outcome.interrupted {
                        return Err(TuneError::Interrupted {
                            round: round_number,
                        });
                    }
                    simulated_time_s += outcome.run_time_s;
                    meta.get_or_insert(run_meta);
                    let result = candidate_result(params, &outcome, &tolerances)?;
                    progress(TuneProgress::CandidateDone {
                        round: round_number,
                        index,
                        of: count,
                        result: &result,
                    });
                    results.push(result);
                    outcomes.push((params.clone(), outcome));
                }
                Err(RunOne::Refused(reason)) => {
                    let entry = Dropped {
                        params: params.clone(),
                        reason,
                    };
                    progress(TuneProgress::CandidateDropped {
                        round: round_number,
                        dropped: &entry,
                    });
                    dropped.push(entry);
                }
                Err(RunOne::Failed(source)) => {
                    return Err(TuneError::Ab {
                        round: round_number,
                        params: format_params(params),
                        source: Box::new(source),
                    });
                }
                Err(RunOne::Setup(error)) => return Err(*error),
            }
        }
        if results.is_empty() {
            return Err(TuneError::EveryCandidateRefused {
                policy: request.reference.name.clone(),
                first: dropped
                    .first()
                    .map_or_else(String::new, |d| d.reason.clone()),
            });
        }
        rank(&mut results);
        let keep = results.len().div_ceil(request.eta).max(1);
        let (next, promoted) = select(&mut results, keep, &mut reserve);
        let backfilled = promoted > 0;
        let round_time: f64 = results.iter().map(|r| r.run_time_s).sum();
        let kept = next.len();
        all_dropped.extend(dropped.iter().cloned());
        rounds.push(Round {
            round: round_number,
            pairs_budget: pairs,
            seed: round_seed,
            candidates: results,
            dropped,
            kept,
            promoted,
            simulated_time_s: round_time,
        });
        if let Some(round) = rounds.last() {
            progress(TuneProgress::RoundDone { round });
        }
        last_outcomes = outcomes;
        // Done when one is left that this round measured, or none is left at all (then
        // the best of this round is shown, not compliant).
        if next.is_empty() || (next.len() == 1 && !backfilled) {
            survivors = if next.is_empty() {
                rounds
                    .last()
                    .and_then(|r| r.candidates.first())
                    .map(|c| vec![c.params.clone()])
                    .unwrap_or_default()
            } else {
                next
            };
            break;
        }
        // A promoted candidate is measured with as many pairs as the one it replaces;
        // otherwise the later rounds of a wide search would pass any budget, and stop
        // growing there.
        if !backfilled {
            pairs = pairs.saturating_mul(request.eta).min(MAX_BUDGET);
        }
        survivors = next;
    }
    let winner = survivors.into_iter().next().unwrap_or_default();
    let (winner_outcome, winner_result) = last_outcomes
        .iter()
        .find(|(params, _)| *params == winner)
        .map(|(_, outcome)| outcome)
        .zip(
            rounds
                .last()
                .and_then(|r| r.candidates.iter().find(|c| c.params == winner)),
        )
        .ok_or_else(|| TuneError::TunedSpec {
            path: request.reference.path.clone(),
            problem: "internal: the winner has no A/B in the last round".into(),
        })?;
    let evidence = Evidence {
        ratio_b_over_a: winner_outcome.ratio_b_over_a,
        ci_low: winner_outcome.ci_low,
        ci_high: winner_outcome.ci_high,
        confidence: winner_outcome.confidence,
        decision: winner_outcome.decision,
        pairs: winner_result.pairs,
        served_fraction_reference: winner_outcome.served_fraction_a,
        served_fraction_winner: winner_outcome.served_fraction_b,
        violation_ticks_reference: winner_outcome.violation_ticks_a,
        violation_ticks_winner: winner_outcome.violation_ticks_b,
        violation_rate_reference: winner_outcome.violation_rate_a,
        violation_rate_winner: winner_outcome.violation_rate_b,
        refused_because: winner_outcome.refused_because.clone(),
        compliant: winner_result.compliant,
    };
    let meta = meta.unwrap_or_else(|| winner_outcome.meta.clone());
    let mut notes = vec![format!(
        "simulator output ({}): every figure here is from the simulated GPU, not from a real one",
        meta.data_source
    )];
    if !evidence.compliant {
        notes.push(
            "no candidate served and kept the objective as well as the reference: the best of the non-compliant ones is shown, and no tuned spec is written"
                .into(),
        );
    }
    if !all_dropped.is_empty() {
        notes.push(format!(
            "{} candidate(s) refused by the policy at init were dropped",
            all_dropped.len()
        ));
    }
    Ok(TuneOutcome {
        format_version: TUNE_FORMAT_VERSION,
        policy: request.reference.name.clone(),
        spec: request.reference.path.display().to_string(),
        reference_params: request.reference.params.clone(),
        ranges: request.ranges.clone(),
        candidates: total,
        eta: request.eta,
        first_round_pairs: request.first_round_pairs,
        alpha: request.alpha,
        tolerances: Tolerances::default(),
        schedule: request.schedule,
        tick_ms: request.reference.tick_ms,
        seed: request.seed,
        rounds,
        winner_spec_params: candidate_spec(&request.reference, &winner).params,
        winner,
        evidence,
        dropped: all_dropped,
        simulated_time_s,
        simulated: meta.simulated,
        data_source: meta.data_source.clone(),
        meta,
        notes,
    })
}

enum RunOne {
    /// The policy refused the candidate's parameters at init.
    Refused(String),
    Failed(AbRunError),
    Setup(Box<TuneError>),
}

/// One candidate against the reference on a fresh simulator.
fn run_one(
    request: &TuneRequest,
    params: &[(String, String)],
    plan: SequentialPlan,
    seed: u64,
    stop: Arc<AtomicBool>,
) -> Result<(AbOutcome, RunMeta), RunOne> {
    let backend = BackendRequest {
        target: Target::Sim(request.sim.clone()),
        seed,
        batch_only: false,
    };
    let assembled = assembly::assemble(&backend, &request.reference.name, request.reference.knobs)
        .map_err(|e| RunOne::Setup(Box::new(TuneError::Assembly(Box::new(e)))))?;
    let mut reference = request.reference.clone();
    reference.knobs = assembled.knobs;
    let candidate = candidate_spec(&reference, params);
    let ab = AbRequest {
        a: reference,
        b: candidate,
        schedule: request.schedule,
        plan,
        seed,
        plugin_dirs: request.plugin_dirs.clone(),
        cache_dir: request.cache_dir.clone(),
        injected_ratio: None,
    };
    let meta = assembled.meta.clone();
    // Replicated trajectories, as `tokwatt ab --sim` runs: every candidate of a round on
    // the same seed meets the same moments and arrivals (common random numbers).
    drop(assembled.backends);
    let tick = std::time::Duration::from_millis(u64::from(ab.a.tick_ms));
    let work = SimWork::of(&request.sim, None, &request.schedule, tick)
        .map_err(|e| RunOne::Setup(Box::new(TuneError::Assembly(Box::new(e)))))?;
    match run_replicated(
        &ab,
        &|w| work.build(w),
        work.span_s,
        assembled.meta,
        stop,
        &mut |_| {},
    ) {
        Ok(outcome) => Ok((outcome, meta)),
        Err(AbRunError::Arm {
            arm: Arm::B,
            source: source @ AgentError::PolicyStart { .. },
            ..
        }) => Err(RunOne::Refused(source.to_string())),
        Err(other) => Err(RunOne::Failed(other)),
    }
}

fn candidate_result(
    params: &[(String, String)],
    outcome: &AbOutcome,
    tolerances: &Tolerances,
) -> Result<CandidateResult, AbError> {
    let check = objective_check(&outcome.pairs, Arm::B, tolerances, outcome.alpha)?;
    let pairs = outcome.looks.last().map_or(0, |look| look.pairs);
    Ok(CandidateResult {
        params: params.to_vec(),
        ratio: outcome.ratio_b_over_a,
        ci_low: outcome.ci_low,
        ci_high: outcome.ci_high,
        confidence: outcome.confidence,
        decision: outcome.decision,
        pairs,
        served_fraction: outcome.served_fraction_b,
        served_fraction_reference: outcome.served_fraction_a,
        violation_rate: outcome.violation_rate_b,
        violation_rate_reference: outcome.violation_rate_a,
        compliant: check.compliance != Compliance::Breaks,
        compliance: check.compliance,
        not_compliant_because: check.because,
        rank: 0,
        kept: false,
        run_time_s: outcome.run_time_s,
    })
}

/// Marks the ranked `results`' places and which go on: the best `keep` that do not break
/// the objective. A candidate shown to break it is out for good, and its place goes to
/// the best one left behind so far (`reserve`, latest round first, which takes this
/// round's left-behind at its front): an aggressive point can look best over a few pairs
/// and show its violations only over more, and the search must still end on one that
/// keeps the objective. Returns those that go on and how many of them were promoted from
/// the reserve.
fn select(
    results: &mut [CandidateResult],
    keep: usize,
    reserve: &mut Vec<Vec<(String, String)>>,
) -> (Vec<Vec<(String, String)>>, usize) {
    let mut next: Vec<Vec<(String, String)>> = Vec::new();
    let mut left_behind: Vec<Vec<(String, String)>> = Vec::new();
    for (place, result) in results.iter_mut().enumerate() {
        result.rank = place + 1;
        result.kept = result.compliance != Compliance::Breaks && next.len() < keep;
        if result.kept {
            next.push(result.params.clone());
        } else if result.compliance != Compliance::Breaks {
            left_behind.push(result.params.clone());
        }
    }
    reserve.splice(0..0, left_behind);
    let promoted = keep.saturating_sub(next.len()).min(reserve.len());
    next.extend(reserve.drain(..promoted));
    (next, promoted)
}

/// Those that keep the objective first, then those within the noise of breaking it, then
/// those that break it; by ratio, best first, within each; ties keep the grid's order.
fn rank(results: &mut [CandidateResult]) {
    results.sort_by(|x, y| {
        x.compliance
            .cmp(&y.compliance)
            .then_with(|| y.ratio.total_cmp(&x.ratio))
    });
}

/// The spec's text with `params` written into its `params` table by a TOML editor
/// (`toml_edit`: replaced where the key is there, added after the table's last key
/// otherwise, inline tables included; a table added at the end if the spec has none),
/// and first lines saying where they come from. The rest of the text, comments and
/// layout, is kept. `plugin`, when it is a path found beside the original spec, is made absolute
/// so that the copy in another folder finds it. The result is checked by loading it.
pub fn tuned_spec_text(
    original: &PolicySpec,
    original_text: &str,
    params: &[(String, String)],
    written_to: &Path,
    comment: &str,
) -> Result<String, TuneError> {
    let problem = |problem: String| TuneError::TunedSpec {
        path: written_to.to_owned(),
        problem,
    };
    // An editor of the TOML itself: the operator's comments, order and layout stay.
    let mut document: toml_edit::DocumentMut = original_text
        .parse()
        .map_err(|e| problem(format!("the original spec is not TOML: {e}")))?;
    // Make a plugin path found only beside the original spec absolute.
    let spec_dir = original.path.parent().unwrap_or(Path::new("."));
    let beside = spec_dir.join(&original.plugin);
    if Path::new(&original.plugin).is_relative()
        && beside.is_file()
        && written_to.parent() != Some(spec_dir)
        && let Ok(absolute) = beside.canonicalize()
        && document.contains_key("plugin")
    {
        document["plugin"] = toml_edit::value(absolute.display().to_string());
    }
    let table = document
        .entry("params")
        .or_insert_with(toml_edit::table)
        .as_table_like_mut()
        .ok_or_else(|| problem("its `params` is not a table".to_owned()))?;
    for (name, value) in params {
        match table.get_mut(name) {
            Some(item) => *item = toml_edit::value(value.as_str()),
            None => {
                table.insert(name, toml_edit::value(value.as_str()));
            }
        }
    }
    let edited = document.to_string();
    let mut text = String::new();
    for line in comment.lines() {
        text.push_str("# ");
        text.push_str(line);
        text.push('\n');
    }
    text.push_str(edited.trim_end());
    text.push('\n');
    let check = PolicySpec::parse(written_to, &text).map_err(|e| problem(e.to_string()))?;
    for (name, value) in params {
        if !check.params.iter().any(|(k, v)| k == name && v == value) {
            return Err(problem(format!(
                "the written spec does not hold {name} = {value:?}; set it by hand"
            )));
        }
    }
    Ok(text)
}

/// The files of a search: `tune.json`, `report.html` and `<policy>-tuned.toml` (the last
/// only when the winner kept the objective). Returns the tuned spec's path, if written.
pub fn write_outputs(
    dir: &Path,
    outcome: &TuneOutcome,
    reference: &PolicySpec,
    reference_text: &str,
) -> Result<Option<PathBuf>, TuneError> {
    let write_error = |path: &Path| {
        let path = path.to_owned();
        move |source| TuneError::Write { path, source }
    };
    std::fs::create_dir_all(dir).map_err(write_error(dir))?;
    let json_path = dir.join("tune.json");
    let json = serde_json::to_string_pretty(outcome).map_err(|e| TuneError::Write {
        path: json_path.clone(),
        source: std::io::Error::other(e),
    })?;
    std::fs::write(&json_path, json + "\n").map_err(write_error(&json_path))?;
    tokwatt_report::write_atomically(&dir.join("report.html"), &report_html(outcome))?;
    if !outcome.evidence.compliant {
        return Ok(None);
    }
    let safe: String = outcome
        .policy
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let spec_path = dir.join(format!("{safe}-tuned.toml"));
    let comment = format!(
        "Tuned by `tokwatt tune` on the simulator ({}), seed {}: {} (tokens per joule {:.4}x the spec it came from, {} pairs). See tune.json beside this file.",
        outcome.data_source,
        outcome.seed,
        format_params(&outcome.winner),
        outcome.evidence.ratio_b_over_a,
        outcome.evidence.pairs
    );
    let text = tuned_spec_text(
        reference,
        reference_text,
        &outcome.winner,
        &spec_path,
        &comment,
    )?;
    std::fs::write(&spec_path, text).map_err(write_error(&spec_path))?;
    Ok(Some(spec_path))
}

/// `report.html`: the rounds' fields, one table per round, and the evidence.
pub fn report_html(outcome: &TuneOutcome) -> String {
    let mut page = tokwatt_report::Page::new(&format!("tokwatt tune: {}", outcome.policy));
    page.notice(&format!(
        "Simulator output: {}. No figure on this page was measured on a real GPU.",
        outcome.data_source
    ));
    page.paragraph(&format!(
        "{} candidates over {}; each round compares every survivor with the spec as given ({}) by an interleaved A/B, keeps the best 1/{} and multiplies the pairs by {}. Simulated time of the whole search: {:.0} s.",
        outcome.candidates,
        outcome
            .ranges
            .iter()
            .map(|r| format!("{} ({} values)", r.name, r.values.len()))
            .collect::<Vec<_>>()
            .join(" × "),
        if outcome.reference_params.is_empty() {
            "no params".to_owned()
        } else {
            format_params(&outcome.reference_params)
        },
        outcome.eta,
        outcome.eta,
        outcome.simulated_time_s
    ));
    page.heading("Winner");
    let e = &outcome.evidence;
    page.table(
        &[
            "parameters",
            "ratio B/A",
            "interval",
            "decision",
            "pairs",
            "served (ref → winner)",
            "violation rate (ref → winner)",
        ],
        &[vec![
            format_params(&outcome.winner),
            format!("{:.4}", e.ratio_b_over_a),
            format!(
                "{:.4} – {:.4} ({})",
                e.ci_low,
                e.ci_high,
                super::stats::confidence_percent(e.confidence)
            ),
            decision_text(e.decision),
            e.pairs.to_string(),
            format!(
                "{:.2} % → {:.2} %",
                e.served_fraction_reference * 100.0,
                e.served_fraction_winner * 100.0
            ),
            format!(
                "{:.2} % → {:.2} %",
                e.violation_rate_reference * 100.0,
                e.violation_rate_winner * 100.0
            ),
        ]],
    );
    for note in &outcome.notes {
        page.paragraph(note);
    }
    for round in &outcome.rounds {
        page.heading(&format!(
            "Round {}: {} candidates, {} pairs each, {} kept{}, {:.0} s simulated",
            round.round,
            round.candidates.len(),
            round.pairs_budget,
            round.kept,
            promoted_words(round),
            round.simulated_time_s
        ));
        let rows: Vec<Vec<String>> = round
            .candidates
            .iter()
            .map(|c| {
                vec![
                    c.rank.to_string(),
                    format_params(&c.params),
                    format!("{:.4}", c.ratio),
                    format!("{:.4} – {:.4}", c.ci_low, c.ci_high),
                    decision_text(c.decision),
                    c.pairs.to_string(),
                    format!("{:.2} %", c.served_fraction * 100.0),
                    format!("{:.2} %", c.violation_rate * 100.0),
                    match (c.compliance, &c.not_compliant_because) {
                        (Compliance::Keeps, _) | (_, None) => "yes".to_owned(),
                        (Compliance::Unresolved, Some(why)) => format!("unresolved: {why}"),
                        (Compliance::Breaks, Some(why)) => format!("no: {why}"),
                    },
                    if c.kept { "kept" } else { "out" }.to_owned(),
                ]
            })
            .collect();
        let field: Vec<(String, f64, f64, f64, bool)> = round
            .candidates
            .iter()
            .map(|c| {
                let mark = if c.compliant { "" } else { " (not compliant)" };
                (
                    format!("{}{mark}", format_params(&c.params)),
                    c.ratio,
                    c.ci_low,
                    c.ci_high,
                    c.kept,
                )
            })
            .collect();
        page.svg(super::report::round_field_section(
            &format!("Round {}", round.round),
            &field,
        ));
        page.table(
            &[
                "rank",
                "parameters",
                "ratio B/A",
                "interval",
                "decision",
                "pairs",
                "served",
                "violations",
                "compliant",
                "",
            ],
            &rows,
        );
        for d in &round.dropped {
            page.paragraph(&format!(
                "Dropped {}: {}",
                format_params(&d.params),
                d.reason
            ));
        }
    }
    page.finish()
}

/// A candidate's decision against the reference (arm A) in a few words; a refused arm is
/// named as refused, never as "no difference".
pub fn decision_text(decision: Decision) -> String {
    match decision {
        Decision::A => "reference better",
        Decision::B => "candidate better",
        Decision::ARefused => "reference refused: more tokens per joule, breaks the objective",
        Decision::BRefused => "candidate refused: more tokens per joule, breaks the objective",
        Decision::NoDifference => "no difference",
        Decision::Continue => "undecided",
    }
    .to_owned()
}
