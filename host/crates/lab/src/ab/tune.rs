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
use tokwatt_agent::node::{Node, NodeRequest};
use tokwatt_policy::spec::PolicySpec;

mod output;
mod ranges;
mod report;
#[cfg(test)]
mod tests;

pub use output::{tuned_spec_text, write_outputs};
pub use ranges::{ParamRange, candidate_spec, candidates};
pub use report::{decision_text, format_params, promoted_words, report_html};

/// Version of `tune.json`'s layout. 2: a candidate (or reference) ahead on tokens per
/// joule but refused on the objective has a decision of its own (`b-refused`,
/// `a-refused`) where 1 wrote `no-difference`.
pub const TUNE_FORMAT_VERSION: u32 = 2;
/// The most candidates a search takes: beyond this, narrow the ranges or coarsen the steps.
pub const MAX_CANDIDATES: usize = 4096;

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
    #[error("setting up the simulator: {0}")]
    Node(Box<tokwatt_agent::node::NodeError>),
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
    // The knobs a node on this simulator grants the reference (nothing is opened: the
    // comparison below puts its own nodes together).
    let assembled = Node::assemble(NodeRequest::new(backend, &request.reference))
        .map_err(|e| RunOne::Setup(Box::new(TuneError::Node(Box::new(e)))))?
        .assembled;
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
