//! Running the judge's jobs: every (policy, scenario, seed) run on the simulator, spread
//! over worker threads, each run's totals kept and its files discarded.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use super::fixed::{FixedRun, OracleSetting};
use super::judge::{References, RunOutcome, Schedule};
use super::{EvalError, EvalRequest, EvalScenario, PhaseOracle, Series, oracle};
use tokwatt_agent::RunRequest;
use tokwatt_agent::assembly::RunMeta;
use tokwatt_core::clock::VirtualClock;
use tokwatt_policy::spec::PolicySpec;
use tokwatt_sim::{SimConfig, SimGpu};

/// Run `work` on every job on `threads` threads; `done` is told of each result (by job
/// index) on the caller's thread as it comes. The first error stops the rest.
pub(super) fn parallel<J: Sync, T: Send>(
    jobs: &[J],
    threads: usize,
    stop: &AtomicBool,
    work: impl Fn(&J) -> Result<T, EvalError> + Sync,
    done: &mut dyn FnMut(usize, &T),
) -> Result<Vec<T>, EvalError> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let (sender, receiver) = mpsc::channel();
    let mut results: Vec<Option<T>> = std::iter::repeat_with(|| None).take(jobs.len()).collect();
    let mut first_error = None;
    std::thread::scope(|scope| {
        for _ in 0..threads.min(jobs.len()) {
            let sender = sender.clone();
            let (next, failed, work) = (&next, &failed, &work);
            scope.spawn(move || {
                loop {
                    if failed.load(Ordering::Relaxed) || stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { break };
                    let result = work(job);
                    if result.is_err() {
                        failed.store(true, Ordering::Relaxed);
                    }
                    if sender.send((i, result)).is_err() {
                        break;
                    }
                }
            });
        }
        drop(sender);
        for (i, result) in receiver {
            match result {
                Ok(value) => {
                    done(i, &value);
                    results[i] = Some(value);
                }
                Err(error) => {
                    first_error.get_or_insert(error);
                }
            }
        }
    });
    if let Some(error) = first_error {
        return Err(error);
    }
    if stop.load(Ordering::Relaxed) {
        return Err(EvalError::Interrupted);
    }
    results
        .into_iter()
        .map(|r| r.ok_or(EvalError::Interrupted))
        .collect()
}

/// The references of one scenario on one seed: the oracle's schedule, the causal
/// reference ([`causal_setting`]) and the default settings throughout.
pub(super) fn run_references(
    scenario: &EvalScenario,
    phases: &[PhaseOracle],
    duration_s: f64,
    seed: u64,
) -> Result<References, EvalError> {
    Ok(References {
        oracle: run_schedule(scenario, phases, duration_s, seed, false)?,
        causal: run_schedule(scenario, phases, duration_s, seed, true)?,
        default: run_schedule(
            scenario,
            &[oracle::default_settings(scenario, duration_s)],
            duration_s,
            seed,
            false,
        )?,
    })
}

/// What the causal reference holds `since_s` seconds into phase `index` (a controller that
/// sees a phase only through its one-second windows): the phase before's settings for the
/// first second, while nothing shows the change yet; then, until [`super::REACTION_LAG_S`]
/// has passed, on a rise in demand the most capable settings (no cap, no clock lock, the
/// largest batch; the token budget the phase before kept its TPOT with), on a fall the
/// phase before's (they served more); then the phase's own. It pays for its lag in joules
/// instead of in broken objectives: a rise it has not sized yet is met at full speed.
pub(super) fn causal_setting(
    scenario: &EvalScenario,
    phases: &[PhaseOracle],
    index: usize,
    since_s: f64,
) -> OracleSetting {
    let Some(phase) = phases.get(index) else {
        return oracle::default_settings(scenario, 0.0).setting;
    };
    let Some(before) = index.checked_sub(1).and_then(|i| phases.get(i)) else {
        return phase.setting;
    };
    if since_s + 1e-9 >= super::REACTION_LAG_S {
        phase.setting
    } else if since_s < 1.0 - 1e-9 || phase.arrival_rps <= before.arrival_rps {
        before.setting
    } else {
        OracleSetting {
            token_budget: before.setting.token_budget,
            ..OracleSetting::most_capable(scenario)
        }
    }
}

/// `phases`' settings on one seed: each from its phase's first second, or as the causal
/// reference holds them (`causal`).
fn run_schedule(
    scenario: &EvalScenario,
    phases: &[PhaseOracle],
    duration_s: f64,
    seed: u64,
    causal: bool,
) -> Result<Schedule, EvalError> {
    let sim_error = |source| EvalError::Sim {
        scenario: scenario.name.clone(),
        source,
    };
    let clock = VirtualClock::new();
    let sim = SimGpu::new(
        SimConfig {
            profile: scenario.profile.clone(),
            scenario: scenario.workload.clone(),
            gpus: scenario.gpus,
            seed,
            noise_seed: None,
        },
        clock.clone(),
    )
    .map_err(sim_error)?;
    let mut run = FixedRun::new(&sim, clock, &scenario.objective);
    let mut series = Series::default();
    let ticks = duration_s.round() as u64;
    let mut in_force = None;
    let mut violations = 0;
    let (mut feasible_ticks, mut feasible_violations) = (0_u64, 0_u64);
    for _ in 0..ticks {
        let t = run.tick() as f64;
        let current = phases
            .iter()
            .enumerate()
            .rposition(|(i, p)| i == 0 || p.start_s <= t + 1e-9);
        let setting = current.map(|i| {
            if causal {
                causal_setting(scenario, phases, i, t - phases[i].start_s)
            } else {
                phases[i].setting
            }
        });
        if setting != in_force
            && let Some(setting) = setting
        {
            run.apply(setting);
            in_force = Some(setting);
        }
        let broken = run.advance_ticks(1);
        violations += broken;
        if current
            .and_then(|i| phases.get(i))
            .is_some_and(|p| p.feasible)
        {
            feasible_ticks += 1;
            feasible_violations += broken;
        }
        let shown = in_force.map_or((0.0, 0, 0), |s| {
            (s.power_cap_w, s.sm_clock_max_mhz, s.batch_size)
        });
        series.push(run.tick() as f64, &sim, scenario.gpus, shown);
    }
    let served_fraction = run.served_fraction();
    Ok(Schedule {
        series,
        served_fraction,
        violation_fraction: violations as f64 / ticks.max(1) as f64,
        feasible_violation_fraction: (feasible_ticks > 0)
            .then(|| feasible_violations as f64 / feasible_ticks as f64),
    })
}

pub(super) fn run_policy(
    request: &EvalRequest,
    spec: &PolicySpec,
    scenario: &EvalScenario,
    duration_s: f64,
    seed: u64,
    stop: &Arc<AtomicBool>,
) -> Result<RunOutcome, EvalError> {
    let mut spec = spec.clone();
    spec.objective = scenario.objective;
    let (sim, backends) = tokwatt_agent::node::Node::simulated(SimConfig {
        profile: scenario.profile.clone(),
        scenario: scenario.workload.clone(),
        gpus: scenario.gpus,
        seed,
        noise_seed: None,
    })
    .map_err(|source| EvalError::Assembly {
        scenario: scenario.name.clone(),
        source,
    })?;
    let meta = RunMeta {
        simulated: true,
        gpu_profile: scenario.profile.id.clone(),
        gpu_name: scenario.profile.name.clone(),
        data_source: format!("simulator output: {}", sim.calibration_note()),
        gpu_count: scenario.gpus,
        actuator: "sim".into(),
        workload: "sim".into(),
        seed,
    };
    let run_request = RunRequest {
        spec: spec.clone(),
        duration: Duration::from_secs_f64(duration_s),
        tick: None,
        out_dir: PathBuf::new(),
        plugin_dirs: request.plugin_dirs.clone(),
        cache_dir: request.cache_dir.clone(),
        seed,
        overwrite: false,
        write_files: false,
        rules: tokwatt_policy::rules::NodeRules::judging(),
        rules_source: "the judge's rules".into(),
        node_knobs: tokwatt_core::types::Knobs::all(),
        output: tokwatt_agent::recorder::OutputBounds::default(),
    };
    let mut series = Series::default();
    let gpus = scenario.gpus;
    let (summary, _backends) =
        tokwatt_agent::run(&run_request, backends, meta, Arc::clone(stop), &mut |p| {
            let settings = p.observations.first().map_or((0.0, 0, 0), |o| {
                (
                    o.in_force.power_cap_w,
                    o.in_force.sm_clock_max_mhz,
                    o.in_force.batch_size,
                )
            });
            series.push(p.time.as_secs_f64(), &sim, gpus, settings);
        })
        .map_err(|source| EvalError::Run {
            policy: spec.name.clone(),
            scenario: scenario.name.clone(),
            seed,
            advice: super::eval_advice(&source, &scenario.objective),
            source: Box::new(source),
        })?;
    Ok(RunOutcome { summary, series })
}
