//! How often `tokwatt ab` is wrong, measured on the simulator where the truth is known:
//! the same comparison repeated over many seeds, each a whole A/B run through the agent's
//! loop on the virtual clock. An A/A study (both arms the same policy) gives the
//! false-positive rate; a study with a known difference gives the power. Used by
//! `tokwatt bench ab-error-rates` and the test suite (`tests/all/ab.rs`).

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use serde::Serialize;

use super::run::{
    AbRequest, AbRunError, Mode, Schedule, TrajectoryWork, run_interleaved, run_replicated,
};
use super::sim_work::SimWork;
use super::stats::{Decision, SequentialPlan};
use tokwatt_agent::assembly::{self, SimTarget};
use tokwatt_agent::{self as agent, RunRequest};
use tokwatt_policy::spec::PolicySpec;

/// One study: the same A/B comparison on every seed of `seeds`.
#[derive(Debug, Clone)]
pub struct Study {
    pub a: PolicySpec,
    pub b: PolicySpec,
    pub sim: SimTarget,
    /// A judging scenario to run on instead of `sim`: its GPU profile, workload and
    /// objective (both arms are judged by it, as `tokwatt eval` judges).
    pub judging: Option<crate::eval::EvalScenario>,
    /// How every comparison runs: `Replicated` (what `tokwatt ab --sim` does by default)
    /// or `Interleaved` (one simulated node, as on a real one); `Crossover` is run as
    /// `Interleaved`.
    pub mode: Mode,
    pub schedule: Schedule,
    pub budget_pairs: usize,
    pub alpha: f64,
    pub seeds: Range<u64>,
    /// Comparisons run at once (each on a thread of its own).
    pub threads: usize,
    pub plugin_dirs: Vec<PathBuf>,
    pub cache_dir: Option<PathBuf>,
    /// A known true ratio B/A laid on arm B's measurements ([`AbRequest::injected_ratio`]):
    /// with both arms the same policy, the power against exactly this difference.
    pub injected_ratio: Option<f64>,
}

/// What a study found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StudyResult {
    pub comparisons: usize,
    pub decided_a: usize,
    pub decided_b: usize,
    pub no_difference: usize,
    /// Comparisons whose arm ahead on tokens per joule was refused on the objective.
    pub refused: usize,
    /// Mean pairs a comparison ran before it stopped.
    pub mean_pairs: f64,
    /// Median of the comparisons' final ratio B/A.
    pub median_ratio: f64,
    /// Simulated time of all comparisons together, seconds.
    pub simulated_time_s: f64,
    /// Median over the comparisons of the pairs' standard deviation of ln(B/A) at their
    /// last look: the noise a verdict had to beat.
    pub median_pair_sd: f64,
    /// Winners named at each look of the plan (by pairs: 4, 8, 16 …).
    pub winners_by_look: Vec<(usize, usize)>,
}

impl StudyResult {
    /// Share of comparisons that named a winner (the false-positive rate of an A/A study).
    pub fn winner_rate(&self) -> f64 {
        (self.decided_a + self.decided_b) as f64 / self.comparisons.max(1) as f64
    }

    /// Share that named B (the power of a study where B is truly better).
    pub fn b_rate(&self) -> f64 {
        self.decided_b as f64 / self.comparisons.max(1) as f64
    }
}

/// Run every comparison of `study`.
pub fn run_study(study: &Study) -> Result<StudyResult, AbRunError> {
    let seeds: Vec<u64> = study.seeds.clone().collect();
    let next = Mutex::new(0usize);
    let results: Mutex<Vec<Found>> = Mutex::new(Vec::new());
    let failure: Mutex<Option<AbRunError>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..study.threads.max(1) {
            scope.spawn(|| {
                loop {
                    let i = {
                        let mut next = next.lock().unwrap_or_else(|p| p.into_inner());
                        let i = *next;
                        *next += 1;
                        i
                    };
                    let Some(&seed) = seeds.get(i) else { break };
                    if failure.lock().map(|f| f.is_some()).unwrap_or(true) {
                        break;
                    }
                    match one_comparison(study, seed) {
                        Ok(found) => results
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(found),
                        Err(error) => {
                            *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
                        }
                    }
                }
            });
        }
    });
    if let Some(error) = failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(error);
    }
    let results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    let count = |d: Decision| results.iter().filter(|r| r.0 == d).count();
    let mut ratios: Vec<f64> = results.iter().map(|r| r.2).collect();
    ratios.sort_by(f64::total_cmp);
    let mut pair_sds: Vec<f64> = results.iter().map(|r| r.4).collect();
    pair_sds.sort_by(f64::total_cmp);
    let n = results.len();
    let looks = SequentialPlan::new(study.budget_pairs, study.alpha, 0)?
        .looks()
        .to_vec();
    let winners_by_look = looks
        .iter()
        .map(|&at| {
            let winners = results
                .iter()
                .filter(|r| r.1 == at && matches!(r.0, Decision::A | Decision::B))
                .count();
            (at, winners)
        })
        .collect();
    Ok(StudyResult {
        comparisons: n,
        decided_a: count(Decision::A),
        decided_b: count(Decision::B),
        no_difference: count(Decision::NoDifference),
        refused: results
            .iter()
            .filter(|r| r.0.refused_arm().is_some())
            .count(),
        mean_pairs: results.iter().map(|r| r.1 as f64).sum::<f64>() / n.max(1) as f64,
        median_ratio: if n == 0 { f64::NAN } else { ratios[n / 2] },
        simulated_time_s: results.iter().map(|r| r.3).sum(),
        median_pair_sd: if n == 0 { f64::NAN } else { pair_sds[n / 2] },
        winners_by_look,
    })
}

/// What one comparison found: its decision, pairs, ratio, simulated time and the pairs'
/// standard deviation of ln(B/A).
type Found = (Decision, usize, f64, f64, f64);

/// One whole A/B seeded with `seed`, in the study's mode.
fn one_comparison(study: &Study, seed: u64) -> Result<Found, AbRunError> {
    let loop_error = |e: &dyn std::fmt::Display| AbRunError::Loop {
        group: 0,
        reason: e.to_string(),
    };
    let tick = std::time::Duration::from_millis(u64::from(study.a.tick_ms));
    let work = match &study.judging {
        Some(judging) => SimWork::new(
            judging.profile.clone(),
            judging.workload.clone(),
            judging.gpus,
            Some(judging.duration_s),
            &study.schedule,
            tick,
        ),
        None => SimWork::of(&study.sim, None, &study.schedule, tick).map_err(|e| loop_error(&e))?,
    };
    let meta = sim_meta(&study.sim, seed);
    let (mut a, mut b) = (study.a.clone(), study.b.clone());
    if let Some(judging) = &study.judging {
        a.objective = judging.objective;
        b.objective = judging.objective;
    }
    let request = AbRequest {
        a,
        b,
        schedule: study.schedule,
        plan: SequentialPlan::new(study.budget_pairs, study.alpha, seed)?,
        seed,
        plugin_dirs: study.plugin_dirs.clone(),
        cache_dir: study.cache_dir.clone(),
        injected_ratio: study.injected_ratio,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let outcome = match study.mode {
        Mode::Replicated => run_replicated(
            &request,
            &|w| work.build(w),
            work.span_s,
            meta,
            stop,
            &mut |_| {},
        )?,
        Mode::Interleaved | Mode::Crossover => {
            // One simulated node for the whole comparison: the work from its start, the
            // run's noise from the same seed.
            let backends = work
                .build(TrajectoryWork {
                    work_seed: seed,
                    noise_seed: seed,
                    offset_s: 0.0,
                })
                .map_err(|e| loop_error(&e))?;
            run_interleaved(&request, backends, meta, stop, &mut |_| {})?
        }
    };
    Ok((
        outcome.decision,
        outcome.pairs.len(),
        outcome.ratio_b_over_a,
        outcome.run_time_s,
        outcome.spread.pairs,
    ))
}

fn sim_meta(sim: &SimTarget, seed: u64) -> tokwatt_agent::assembly::RunMeta {
    tokwatt_agent::assembly::RunMeta {
        simulated: true,
        gpu_profile: sim.profile.clone(),
        gpu_name: sim.profile.clone(),
        data_source: "simulator output (error-rate study)".into(),
        gpu_count: sim.gpus,
        actuator: "sim".into(),
        workload: "sim".into(),
        seed,
    }
}

/// The true ratio B/A of tokens per joule on this work: each arm alone for `duration` on
/// the same seed (the same demand), far longer than an epoch.
pub fn long_run_ratio(
    study: &Study,
    duration: Duration,
    seed: u64,
) -> Result<(f64, f64, f64), AbRunError> {
    let tpj = |spec: &PolicySpec| -> Result<f64, AbRunError> {
        let (_sim, backends) =
            assembly::simulator(&study.sim, seed).map_err(|e| AbRunError::Loop {
                group: 0,
                reason: e.to_string(),
            })?;
        let request = RunRequest {
            spec: spec.clone(),
            duration,
            tick: None,
            out_dir: PathBuf::new(),
            plugin_dirs: study.plugin_dirs.clone(),
            cache_dir: study.cache_dir.clone(),
            seed,
            overwrite: false,
            write_files: false,
            rules: tokwatt_policy::rules::NodeRules::judging(),
            rules_source: "the judge's rules".into(),
            node_knobs: tokwatt_core::types::Knobs::all(),
            output: tokwatt_agent::recorder::OutputBounds::default(),
        };
        let (summary, _) = agent::run(
            &request,
            backends,
            sim_meta(&study.sim, seed),
            Arc::new(AtomicBool::new(false)),
            &mut |_| {},
        )?;
        Ok(summary.totals.tokens_per_joule)
    };
    let a = tpj(&study.a)?;
    let b = tpj(&study.b)?;
    Ok((a, b, b / a))
}
