//! `tokwatt ab`: is policy B more efficient than policy A on this work? Epochs of each
//! arm interleaved in random pairs on one node (or in crossover blocks over several GPUs),
//! a ratio of tokens per joule with its interval, a sequential decision; `ab.json` and
//! `report.html` in the output folder.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use tokwatt::ab::stats::{DEFAULT_ALPHA, DEFAULT_BUDGET, DEFAULT_SIM_BUDGET};
use tokwatt::ab::study::Study;
use tokwatt::ab::{self, AbOutcome, AbRequest, Decision, Schedule, SequentialPlan};
use tokwatt::assembly::{
    self, Assembled, BackendRequest, GpuTarget, SimTarget, Target, WorkloadSource,
};
use tokwatt::control::Backends;
use tokwatt::restore::{SettingsGuard, StateFile};
use tokwatt::spec::PolicySpec;

use crate::plugin_places::PluginPlaces;
use crate::target::TargetArgs;

#[derive(Debug, clap::Args)]
pub struct AbArgs {
    /// Arm A's policy spec (the reference).
    #[arg(long = "a", value_name = "SPEC")]
    a: PathBuf,
    /// Arm B's policy spec (the challenger).
    #[arg(long = "b", value_name = "SPEC")]
    b: PathBuf,
    #[command(flatten)]
    epochs: EpochArgs,
    /// Parallel crossover: half the GPUs run A and half B, then they swap (needs 2+ GPUs:
    /// `--sim h200 --gpus 2`, or `--gpu 0,1`).
    #[arg(long, conflicts_with = "interleaved")]
    crossover: bool,
    /// On the simulator: take turns on one simulated node, as on a real one, instead of
    /// the default replicated mode (every trajectory on a simulator of its own, a pair's
    /// two on the same work from the same moment).
    #[arg(long)]
    interleaved: bool,
    /// Seeds the arms' order in each pair, the simulator and the policies.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output folder for ab.json and report.html (default: out/ab-A-vs-B-TIME).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replace an earlier comparison's files in --out.
    #[arg(long)]
    overwrite: bool,
    #[command(flatten)]
    plugins: PluginPlaces,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
    #[command(flatten)]
    target: TargetArgs,
}

/// The epochs and the sequential test's budget, as `ab` and `bench ab-error-rates` take
/// them.
#[derive(Debug, clap::Args)]
pub struct EpochArgs {
    /// Most pairs of epochs to run; looks at 4, 8, 16 … pairs and at this budget stop
    /// early once decided. Default: 256 on the simulator (time is cheap there, and runs of
    /// an adaptive policy differ by up to 10 %), 32 on real GPUs.
    #[arg(long)]
    budget: Option<usize>,
    /// False-positive rate over the whole comparison (spent across the looks).
    #[arg(long, default_value_t = DEFAULT_ALPHA)]
    alpha: f64,
    /// What the verdict estimates. Every epoch is a fresh instance of its arm's policy
    /// (its own seed, no state, from the device defaults); `cold-start` measures it from
    /// its start, learning included (what an operator deploying it gets); `settled`
    /// measures it after `--settle` of running unmeasured.
    #[arg(long, value_enum, default_value = "cold-start")]
    estimand: EstimandArg,
    /// With `--estimand settled`: how long each fresh instance runs, unmeasured, before
    /// its warm-up and window (default: 5m).
    #[arg(long, value_parser = tokwatt::cli::parse_duration)]
    settle: Option<Duration>,
    /// The measured window of each epoch.
    #[arg(long, value_parser = tokwatt::cli::parse_duration, default_value = "60s")]
    epoch: Duration,
    /// Each epoch's warm-up after its arm takes over, not measured.
    #[arg(long, value_parser = tokwatt::cli::parse_duration, default_value = "10s")]
    warmup: Duration,
    /// Device defaults with the policy paused before each epoch's warm-up (default: none).
    /// For a closed-loop workload whose thermal state carries over; on demand-driven work
    /// it drains the last arm's queue at full power outside every measured window, which
    /// favours a slow arm, so the warm-up alone separates the arms there.
    #[arg(long, value_parser = tokwatt::cli::parse_duration_or_zero, default_value = "0s")]
    cooldown: Duration,
    /// Control tick of both arms (default: arm A's spec's). A longer tick with the same
    /// epochs makes a comparison cheaper: noise depends on the epochs' length, cost on
    /// their ticks.
    #[arg(long, value_parser = tokwatt::cli::parse_duration)]
    tick: Option<Duration>,
}

/// How long a fresh instance runs unmeasured under the settled estimand, by default.
const DEFAULT_SETTLE: Duration = Duration::from_secs(300);

/// `--estimand`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum EstimandArg {
    ColdStart,
    Settled,
}

impl EpochArgs {
    /// The pairs budget: as given, or the default for where the comparison runs.
    fn budget(&self, simulated: bool) -> usize {
        self.budget.unwrap_or(if simulated {
            DEFAULT_SIM_BUDGET
        } else {
            DEFAULT_BUDGET
        })
    }

    /// The schedule in whole ticks of `tick`, checked.
    fn schedule(&self, tick: Duration) -> Result<Schedule> {
        let schedule = Schedule {
            cooldown_ticks: ticks_of("cooldown", self.cooldown, tick)?,
            settle_ticks: match (self.estimand, self.settle) {
                (EstimandArg::ColdStart, None) => 0,
                (EstimandArg::ColdStart, Some(_)) => bail!(
                    "--settle applies to the settled estimand only; add --estimand settled, or drop --settle"
                ),
                (EstimandArg::Settled, settle) => {
                    ticks_of("settle", settle.unwrap_or(DEFAULT_SETTLE), tick)?
                }
            },
            warmup_ticks: ticks_of("warmup", self.warmup, tick)?,
            measure_ticks: ticks_of("epoch", self.epoch, tick)?,
        };
        schedule.check(tick)?;
        Ok(schedule)
    }

    /// "cold-start epochs of 1m (warm-up 10s, cool-down 0s)"
    fn describe(&self) -> String {
        format!(
            "{} epochs of {} (warm-up {}, cool-down {})",
            match self.estimand {
                EstimandArg::ColdStart => "cold-start".to_owned(),
                EstimandArg::Settled => format!(
                    "settled ({} settling)",
                    humantime::format_duration(self.settle.unwrap_or(DEFAULT_SETTLE))
                ),
            },
            humantime::format_duration(self.epoch),
            humantime::format_duration(self.warmup),
            humantime::format_duration(self.cooldown),
        )
    }
}

/// `span` in whole ticks of `tick` (`what` names the flag in the error). Shared by `ab`,
/// `bench ab-error-rates` and `tune`.
pub fn ticks_of(what: &str, span: Duration, tick: Duration) -> Result<u64> {
    let tick_ns = tick.as_nanos().max(1);
    let ticks = span.as_nanos() / tick_ns;
    if !span.as_nanos().is_multiple_of(tick_ns) {
        bail!(
            "--{what} {} is not a whole number of ticks of {}; give a multiple of the tick",
            humantime::format_duration(span),
            humantime::format_duration(tick)
        );
    }
    u64::try_from(ticks).with_context(|| format!("--{what} is too long"))
}

pub fn ab(args: AbArgs) -> Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop))
            .context("installing signal handlers")?;
    }
    let mut a = PolicySpec::load(&args.a).context("arm a")?;
    let mut b = PolicySpec::load(&args.b).context("arm b")?;
    if let Some(tick) = args.epochs.tick {
        a.override_tick(tick).context("arm a")?;
        b.override_tick(tick).context("arm b")?;
    }
    let tick = Duration::from_millis(u64::from(a.tick_ms));
    let schedule = args.epochs.schedule(tick)?;
    let request = args.target.backend_request(&a.objective, tick, args.seed)?;
    let budget = args.epochs.budget(matches!(request.target, Target::Sim(_)));
    let plan = SequentialPlan::new(budget, args.epochs.alpha, args.seed)?;
    let out_dir = match &args.out {
        Some(dir) => dir.clone(),
        None => {
            crate::run::fresh_out_dir(Path::new("out"), &format!("ab-{}-vs-{}", a.name, b.name))
        }
    };
    let ab_json = out_dir.join("ab.json");
    if ab_json.exists() && !args.overwrite {
        bail!(
            "{} holds an earlier comparison; choose another --out, or pass --overwrite",
            ab_json.display()
        );
    }
    // On the simulator, every trajectory may have a simulator of its own.
    let replicated = match &request.target {
        Target::Sim(sim) if !args.crossover && !args.interleaved => {
            Some(ab::SimWork::of(sim, None, &schedule, tick)?)
        }
        _ => None,
    };
    let groups = if args.crossover {
        crossover_groups(&request)?
    } else {
        vec![request]
    };
    let mut backends = Vec::with_capacity(groups.len());
    let mut meta = None;
    for (g, group) in groups.iter().enumerate() {
        let assembled = assembly::assemble(group, &a.name, a.knobs)?;
        grant_both(&assembled, &mut a, &mut b, g == 0);
        let state_file = args.target.state_file.clone().map(|path| {
            if args.crossover {
                path.with_extension(format!("gpu{g}.json"))
            } else {
                path
            }
        });
        let (group_backends, group_meta) = guard(assembled, state_file, args.crossover, g)?;
        backends.push(group_backends);
        meta.get_or_insert(group_meta);
    }
    let mut meta = meta.context("no GPU to run on")?;
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("creating the output folder {}", out_dir.display()))?;
    meta.gpu_count = u32::try_from(backends.len())
        .unwrap_or(u32::MAX)
        .max(meta.gpu_count);
    if !args.quiet {
        eprintln!(
            "tokwatt: A/B `{}` vs `{}` on {} [{}]: {} mode, up to {} pairs, {}",
            a.name,
            b.name,
            meta.gpu_name,
            meta.data_source,
            if args.crossover {
                "crossover"
            } else if replicated.is_some() {
                "replicated"
            } else {
                "interleaved"
            },
            budget,
            args.epochs.describe(),
        );
    }
    let request = AbRequest {
        a,
        b,
        schedule,
        plan,
        seed: args.seed,
        plugin_dirs: args.plugins.plugin_dirs.clone(),
        cache_dir: args.plugins.cache_dir.clone(),
        injected_ratio: None,
    };
    let bar = crate::progress::AbBar::new(args.quiet, budget);
    let lines = !args.quiet && !bar.is_drawn();
    let mut progress = |p: ab::AbProgress| {
        bar.update(&p);
        // In a pipe or a log there is no bar: one line per look instead.
        if let Some(look) = p
            .last_look
            .as_ref()
            .filter(|l| lines && l.pairs == p.pairs_done)
        {
            eprintln!(
                "tokwatt: {}/{} pairs: B/A {:.4} [{:.4}, {:.4}] at {:.2} %: {}",
                p.pairs_done,
                p.budget_pairs,
                look.ratio_b_over_a,
                look.ci_low,
                look.ci_high,
                look.confidence * 100.0,
                decision_words(look.decision)
            );
        }
    };
    let outcome = if let Some(work) = &replicated {
        // The assembled simulator gave the node's facts and the arms' knobs; every
        // trajectory gets a simulator of its own.
        drop(backends);
        ab::run_replicated(
            &request,
            &|w| work.build(w),
            work.span_s,
            meta,
            stop,
            &mut progress,
        )?
    } else if args.crossover {
        ab::run_crossover(&request, backends, meta, stop, &mut progress)?
    } else {
        let one = backends.pop().context("no GPU to run on")?;
        ab::run_interleaved(&request, one, meta, stop, &mut progress)?
    };
    bar.finish(&outcome);
    // The backends (and their settings guards) are gone: every setting is restored.
    tokwatt::ab::report::write_ab_outputs(&out_dir, &outcome)
        .with_context(|| format!("writing ab.json and report.html in {}", out_dir.display()))?;
    print_outcome(&outcome, &out_dir);
    Ok(())
}

/// One single-GPU request per GPU of `request` (crossover runs a loop per GPU).
fn crossover_groups(request: &BackendRequest) -> Result<Vec<BackendRequest>> {
    let groups: Vec<BackendRequest> = match &request.target {
        Target::Sim(sim) => (0..sim.gpus)
            .map(|g| BackendRequest {
                target: Target::Sim(SimTarget {
                    gpus: 1,
                    ..sim.clone()
                }),
                // Each simulated GPU its own board (and its own demand stream).
                seed: request.seed.wrapping_add(u64::from(g) * 7919),
                batch_only: request.batch_only,
            })
            .collect(),
        Target::Gpu(gpu) => {
            if let WorkloadSource::External { url, .. } = &gpu.workload {
                bail!(
                    "--crossover runs each GPU on its own, but --metrics-url {url} is one engine's tokens for all of them; compare on one GPU (drop --crossover), or run one engine per GPU with the CUDA workload"
                );
            }
            gpu.indices
                .iter()
                .map(|&index| BackendRequest {
                    target: Target::Gpu(GpuTarget {
                        indices: vec![index],
                        ..gpu.clone()
                    }),
                    seed: request.seed,
                    batch_only: request.batch_only,
                })
                .collect()
        }
    };
    if groups.len() < 2 {
        bail!(
            "--crossover needs at least 2 GPUs, got {}: use --sim h200 --gpus 2, or --gpu 0,1",
            groups.len()
        );
    }
    Ok(groups)
}

/// Both arms' knobs granted by what the node offers; what is withheld is said once.
fn grant_both(assembled: &Assembled, a: &mut PolicySpec, b: &mut PolicySpec, say: bool) {
    for spec in [a, b] {
        let (knobs, withheld) = assembly::grant_knobs(spec.knobs, &assembled.offered);
        if say {
            for withheld in &withheld {
                eprintln!("tokwatt: policy `{}`: {withheld}", spec.name);
            }
        }
        spec.knobs = knobs;
    }
}

/// The group's backends, with a settings guard where real settings may change (as
/// `tokwatt run` does).
fn guard(
    mut assembled: Assembled,
    state_file: Option<PathBuf>,
    crossover: bool,
    group: usize,
) -> Result<(Backends, tokwatt::assembly::RunMeta)> {
    if assembled.changes_hardware {
        let path = state_file.unwrap_or_else(|| {
            let default = StateFile::default_path();
            if crossover {
                default.with_extension(format!("gpu{group}.json"))
            } else {
                default
            }
        });
        let mut guard = SettingsGuard::new(StateFile::new(path), assembled.backends.actuator);
        guard
            .arm()
            .context("saving the original GPU settings before the comparison")?;
        assembled.backends.actuator = Box::new(guard);
    }
    Ok((assembled.backends, assembled.meta))
}

fn decision_words(decision: Decision) -> &'static str {
    match decision {
        Decision::A => "A is more efficient",
        Decision::B => "B is more efficient",
        Decision::NoDifference => "no difference shown",
        Decision::Continue => "not decided yet",
    }
}

fn print_outcome(o: &AbOutcome, out: &Path) {
    let source = o.meta.source_line();
    println!();
    let row = |key: &str, value: String| println!("{key:<20} {value}");
    row("a", o.a.policy.clone());
    row("b", o.b.policy.clone());
    row("gpu", source);
    row(
        "decision",
        format!(
            "{} ({})",
            decision_words(o.decision),
            serde_json::to_value(o.decision)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default()
        ),
    );
    row(
        "tokens/J B/A",
        format!(
            "{:.4}, {:.2} % interval [{:.4}, {:.4}]",
            o.ratio_b_over_a,
            o.confidence * 100.0,
            o.ci_low,
            o.ci_high
        ),
    );
    row(
        "pairs",
        format!(
            "{} of {} ({} mode){}",
            o.pairs.len(),
            o.budget_pairs,
            serde_json::to_value(o.mode)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
            if o.interrupted { ", interrupted" } else { "" }
        ),
    );
    row(
        "estimand",
        format!(
            "{}: a fresh instance per epoch (a trajectory), {} measured{}",
            match o.estimand.kind {
                ab::Estimand::ColdStart => "cold start",
                ab::Estimand::Settled => "settled",
            },
            humantime::format_duration(Duration::from_millis(
                o.schedule.measure_ticks.saturating_mul(o.tick_ms)
            )),
            if o.estimand.kind == ab::Estimand::Settled {
                format!(
                    " after {} unmeasured",
                    humantime::format_duration(Duration::from_millis(
                        (o.schedule.settle_ticks + o.schedule.warmup_ticks)
                            .saturating_mul(o.tick_ms)
                    ))
                )
            } else {
                String::new()
            }
        ),
    );
    row(
        "spread",
        format!(
            "pairs' B/A varies by {:.1} % (sd), the arms differ by {:.1} %; one arm's runs by {:.1} % (a) and {:.1} % (b), the work's changes between pairs included",
            o.spread.pairs.exp_m1() * 100.0,
            o.spread.between_arms.exp_m1() * 100.0,
            o.spread.within_a.exp_m1() * 100.0,
            o.spread.within_b.exp_m1() * 100.0
        ),
    );
    row(
        "served a / b",
        format!("{:.4} / {:.4}", o.served_fraction_a, o.served_fraction_b),
    );
    row(
        "violations a / b",
        format!(
            "{} / {} ticks ({:.2} % / {:.2} %)",
            o.violation_ticks_a,
            o.violation_ticks_b,
            o.violation_rate_a * 100.0,
            o.violation_rate_b * 100.0
        ),
    );
    if let Some(why) = &o.refused_because {
        row("no winner because", why.clone());
    }
    if let Some(why) = o.winner_gave_up_within_noise() {
        row("objective", why.to_owned());
    }
    if let Some(difference) = &o.gpu_difference {
        row(
            "gpu difference",
            tokwatt::ab::report::gpu_difference_words(difference, o.ratio_b_over_a),
        );
    }
    for note in &o.notes {
        row("note", note.clone());
    }
    row("time", format!("{:.0} s", o.run_time_s));
    row("output", out.join("ab.json").display().to_string());
}

/// The mode a study's comparisons run in: what `tokwatt ab --sim` runs, unless asked for
/// the interleaved one.
fn study_mode(interleaved: bool) -> ab::Mode {
    if interleaved {
        ab::Mode::Interleaved
    } else {
        ab::Mode::Replicated
    }
}

/// What the two study commands (`bench ab-table`, `bench ab-error-rates`) share about
/// their comparisons.
struct StudyShape<'a> {
    epochs: &'a EpochArgs,
    schedule: Schedule,
    seeds: u64,
    threads: usize,
    interleaved: bool,
}

impl StudyShape<'_> {
    /// `a` against `b` on `sim`, as `tokwatt ab --sim` compares them, one comparison per
    /// seed; no judging scenario, nothing injected.
    fn study(&self, a: &PolicySpec, b: &PolicySpec, sim: SimTarget) -> Study {
        Study {
            a: a.clone(),
            b: b.clone(),
            sim,
            judging: None,
            mode: study_mode(self.interleaved),
            schedule: self.schedule,
            budget_pairs: self.epochs.budget(true),
            alpha: self.epochs.alpha,
            seeds: 0..self.seeds,
            threads: self.threads,
            plugin_dirs: Vec::new(),
            cache_dir: None,
            injected_ratio: None,
        }
    }
}

/// `tokwatt bench ab-table`.
#[derive(Debug, clap::Args)]
pub struct AbTableArgs {
    /// A policy spec, compared with itself (repeat for several; default: the shipped
    /// adaptive policies).
    #[arg(long = "policy", default_values = [
        "policies/hill-climb.toml",
        "policies/slo-batch.toml",
        "policies/cap-search.toml",
        "policies/clock-search.toml",
        "policies/joint-search.toml",
    ])]
    policies: Vec<PathBuf>,
    /// A scenario file, or `built-in` (repeat for several; default: the built-in scenario
    /// and three of the judge's).
    #[arg(long = "scenario", default_values = [
        "built-in",
        "host/scenarios/eval/h200-8b-latency.toml",
        "host/scenarios/eval/h200-8b-shifts.toml",
        "host/scenarios/eval/h200-8b-noisy.toml",
    ])]
    scenarios: Vec<String>,
    /// The true ratio B/A laid on arm B's measurements for the power study.
    #[arg(long, default_value_t = 1.03)]
    true_ratio: f64,
    /// Run every comparison on one simulated node taking turns, as on a real one, instead
    /// of `tokwatt ab --sim`'s default replicated mode.
    #[arg(long)]
    interleaved: bool,
    /// Simulated GPU profile.
    #[arg(long, default_value = "h200")]
    sim: String,
    /// Comparisons per study (one seed each).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    seeds: u64,
    /// Each comparison's epochs and budget, as `tokwatt ab` takes them.
    #[command(flatten)]
    epochs: EpochArgs,
    /// Comparisons at once (default: the machine's cores).
    #[arg(long, value_parser = tokwatt::cli::thread_count)]
    threads: Option<usize>,
    /// Also write the table as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn ab_table(args: &AbTableArgs) -> Result<()> {
    use tokwatt::ab::study::run_study;
    if !(args.true_ratio.is_finite() && args.true_ratio > 0.0) {
        bail!(
            "--true-ratio {} is not a ratio of tokens per joule; give a positive number such as 1.03",
            args.true_ratio
        );
    }
    let threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    // A judging scenario (GPU profile, workload and objective) runs as `tokwatt eval` runs
    // it; any other file is a simulator scenario on --sim.
    let scenarios = args
        .scenarios
        .iter()
        .map(|name| {
            if name == "built-in" {
                return Ok((name.clone(), None));
            }
            let path = Path::new(name);
            match tokwatt::eval::EvalScenario::load(path) {
                Ok(judging) => Ok((name.clone(), Some(judging))),
                Err(judging_error) => tokwatt::sim::Scenario::load(path)
                    .map(|_| (name.clone(), None))
                    .map_err(|sim_error| {
                        anyhow::anyhow!(
                            "--scenario {name} is neither a judging scenario ({judging_error}) nor a simulator scenario ({sim_error})"
                        )
                    }),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let started = std::time::Instant::now();
    println!(
        "SIMULATOR OUTPUT ({}): {} comparisons per study, budget {} pairs, α {}, {}; power against a true B/A of {} laid on arm B; {} threads",
        args.sim,
        args.seeds,
        args.epochs.budget(true),
        args.epochs.alpha,
        args.epochs.describe(),
        args.true_ratio,
        threads
    );
    println!(
        "{:<14} {:<30} {:>12} {:>10} {:>10} {:>9} {:>14}",
        "policy", "scenario", "A/A winner", "power", "mean pairs", "pair sd", "cost/compare"
    );
    let mut rows = Vec::new();
    for path in &args.policies {
        let mut spec =
            PolicySpec::load(path).with_context(|| format!("--policy {}", path.display()))?;
        if let Some(tick) = args.epochs.tick {
            spec.override_tick(tick)?;
        }
        let tick = Duration::from_millis(u64::from(spec.tick_ms));
        let schedule = args.epochs.schedule(tick)?;
        for (scenario, judging) in &scenarios {
            let sim = SimTarget {
                scenario: (scenario != "built-in").then(|| PathBuf::from(scenario)),
                ..SimTarget::new(args.sim.clone())
            };
            let shape = StudyShape {
                epochs: &args.epochs,
                schedule,
                seeds: args.seeds,
                threads,
                interleaved: args.interleaved,
            };
            let study = |injected_ratio: Option<f64>| Study {
                judging: judging.clone(),
                injected_ratio,
                ..shape.study(&spec, &spec, sim.clone())
            };
            let aa = run_study(&study(None))
                .with_context(|| format!("A/A of {} on {scenario}", spec.name))?;
            let power = run_study(&study(Some(args.true_ratio)))
                .with_context(|| format!("power of {} on {scenario}", spec.name))?;
            let cost_s = (aa.simulated_time_s + power.simulated_time_s)
                / (aa.comparisons + power.comparisons).max(1) as f64;
            let name = Path::new(scenario)
                .file_stem()
                .map_or(scenario.clone(), |s| s.to_string_lossy().into_owned());
            println!(
                "{:<14} {:<30} {:>11.1}% {:>9.1}% {:>10.1} {:>9.3} {:>12.0} s",
                spec.name,
                name,
                aa.winner_rate() * 100.0,
                power.b_rate() * 100.0,
                power.mean_pairs,
                aa.median_pair_sd,
                cost_s
            );
            rows.push(serde_json::json!({
                "policy": spec.name,
                "scenario": scenario,
                "a_a": aa,
                "power_study": power,
                "false_positive_rate": aa.winner_rate(),
                "power": power.b_rate(),
                "mean_simulated_s_per_comparison": cost_s,
            }));
        }
    }
    println!("{:.0} s wall", started.elapsed().as_secs_f64());
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "simulated": true,
            "true_ratio": args.true_ratio,
            "seeds": args.seeds,
            "budget_pairs": args.epochs.budget(true),
            "alpha": args.epochs.alpha,
            "epochs": args.epochs.describe(),
            "rows": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// `tokwatt bench ab-error-rates`.
#[derive(Debug, clap::Args)]
pub struct ErrorRatesArgs {
    /// The policy both studies compare (arm A; in the A/A study arm B too).
    #[arg(long, default_value = "policies/static.toml")]
    policy: PathBuf,
    /// Arm B of the power study: the policy with this parameter changed (NAME=VALUE);
    /// the default makes B about 3 % more efficient on the steady scenario.
    #[arg(long, default_value = "power_cap_w=486")]
    b_param: String,
    /// Simulated GPU profile.
    #[arg(long, default_value = "h200")]
    sim: String,
    /// Demand scenario (default: host/scenarios/steady.toml, the same load throughout).
    #[arg(long, default_value = "host/scenarios/steady.toml")]
    scenario: PathBuf,
    /// Comparisons per study (one seed each).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    seeds: u64,
    /// Each comparison's epochs and budget, as `tokwatt ab` takes them.
    #[command(flatten)]
    epochs: EpochArgs,
    /// Run every comparison on one simulated node taking turns, as on a real one, instead
    /// of `tokwatt ab --sim`'s default replicated mode.
    #[arg(long)]
    interleaved: bool,
    /// Comparisons at once (default: the machine's cores).
    #[arg(long, value_parser = tokwatt::cli::thread_count)]
    threads: Option<usize>,
    /// Also write the figures as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn error_rates(args: &ErrorRatesArgs) -> Result<()> {
    use tokwatt::ab::study::{long_run_ratio, run_study};
    let mut a = PolicySpec::load(&args.policy)?;
    if let Some(tick) = args.epochs.tick {
        a.override_tick(tick)?;
    }
    let (name, value) = args
        .b_param
        .split_once('=')
        .context("--b-param takes NAME=VALUE, e.g. power_cap_w=486")?;
    let mut b = a.clone();
    match b.params.iter_mut().find(|(key, _)| key == name) {
        Some(param) => param.1 = value.to_owned(),
        None => b.params.push((name.to_owned(), value.to_owned())),
    }
    b.params.sort();
    let tick = Duration::from_millis(u64::from(a.tick_ms));
    let schedule = args.epochs.schedule(tick)?;
    let threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let shape = StudyShape {
        epochs: &args.epochs,
        schedule,
        seeds: args.seeds,
        threads,
        interleaved: args.interleaved,
    };
    let sim = SimTarget {
        scenario: Some(args.scenario.clone()),
        ..SimTarget::new(args.sim.clone())
    };
    let study = |b: &PolicySpec| shape.study(&a, b, sim.clone());
    let same = study(&a);
    let different = study(&b);
    let started = std::time::Instant::now();
    let (tpj_a, tpj_b, truth) = long_run_ratio(&different, Duration::from_secs(4 * 3600), 1)?;
    let aa = run_study(&same)?;
    let ab = run_study(&different)?;
    println!(
        "SIMULATOR OUTPUT ({}, {}): {} comparisons per study, budget {} pairs, α {}, {}, {} threads, {:.0} s wall",
        args.sim,
        args.scenario.display(),
        args.seeds,
        args.epochs.budget(true),
        args.epochs.alpha,
        args.epochs.describe(),
        threads,
        started.elapsed().as_secs_f64()
    );
    println!(
        "truth: {} {:.4} tok/J, with {} {:.4} tok/J over 4 h each: B/A {:.4}",
        a.name, tpj_a, args.b_param, tpj_b, truth
    );
    for (label, r, rate) in [
        ("A/A (false positives)", &aa, aa.winner_rate()),
        ("A/B (power, B better)", &ab, ab.b_rate()),
    ] {
        let by_look: Vec<String> = r
            .winners_by_look
            .iter()
            .map(|(pairs, winners)| format!("{winners} at {pairs}"))
            .collect();
        println!(
            "{label:<24} {:>5.1} %  (a {}, b {}, none {} of {}; winners {}), mean pairs {:.1}, median B/A {:.4}, simulated {:.1} h",
            rate * 100.0,
            r.decided_a,
            r.decided_b,
            r.no_difference,
            r.comparisons,
            by_look.join(", "),
            r.mean_pairs,
            r.median_ratio,
            r.simulated_time_s / 3600.0
        );
    }
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "simulated": true,
            "truth_ratio_b_over_a": truth,
            "a_a": aa,
            "a_b": ab,
            "false_positive_rate": aa.winner_rate(),
            "power": ab.b_rate(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
