//! `tokwatt ab`: is policy B more efficient than policy A on this work? Epochs of each
//! arm interleaved in random pairs on one node (or in crossover blocks over several GPUs),
//! a ratio of tokens per joule with its interval, a sequential decision; `ab.json` and
//! `report.html` in the output folder.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use tokwatt_agent::assembly::{
    self, Assembled, BackendRequest, GpuTarget, SimTarget, Target, WorkloadSource,
};
use tokwatt_agent::node::{Keep, KeepFor, Node, NodeRequest};
use tokwatt_lab::ab::stats::{DEFAULT_ALPHA, DEFAULT_BUDGET, DEFAULT_SIM_BUDGET};
use tokwatt_lab::ab::{self, AbOutcome, AbRequest, Schedule, SequentialPlan};

use tokwatt_policy::in_force::ObjectiveInForce;
use tokwatt_policy::spec::PolicySpec;

use crate::node_rules::ObjectiveArgs;
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
    /// Print the result as JSON on standard output instead of the verdict's lines: ab.json
    /// in an envelope with the output folder and its files (progress stays on standard
    /// error).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    target: TargetArgs,
    // The objective both arms are held to; each spec's own may only narrow it.
    #[command(flatten)]
    objective: ObjectiveArgs,
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
    pub(crate) alpha: f64,
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
    pub(crate) tick: Option<Duration>,
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
    pub(crate) fn budget(&self, simulated: bool) -> usize {
        self.budget.unwrap_or(if simulated {
            DEFAULT_SIM_BUDGET
        } else {
            DEFAULT_BUDGET
        })
    }

    /// The schedule in whole ticks of `tick`, checked.
    pub(crate) fn schedule(&self, tick: Duration) -> Result<Schedule> {
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
    pub(crate) fn describe(&self) -> String {
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
    // The flags' objective, narrowed by each arm's spec where it is stricter.
    let in_force = ArmsInForce {
        a: args.objective.hold(&mut a).context("arm a")?,
        b: args.objective.hold(&mut b).context("arm b")?,
    };
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
        // Each group a node put together by the one rule (tokwatt_agent::node), its
        // original settings kept over both arms' knobs, a state file a group.
        let draft = Node::assemble(NodeRequest {
            keep: Keep {
                state_file: args.target.state_file.clone(),
                knobs: KeepFor::GrantedAnd(b.knobs),
                group: args.crossover.then_some(g),
                power_ceiling_w: None,
            },
            plugins: args.plugins.for_node(),
            ..NodeRequest::new(group.clone(), &a)
        })?;
        grant_both(&draft.assembled, &mut a, &mut b, g == 0);
        let assembled = draft
            .open()
            .context("saving the original GPU settings before the comparison")?
            .assembled;
        backends.push(assembled.backends);
        meta.get_or_insert(assembled.meta);
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
        for line in in_force.lines() {
            eprintln!("tokwatt: {line}");
        }
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
                "tokwatt: {}/{} pairs: B/A {:.4} [{:.4}, {:.4}] at {}: {}",
                p.pairs_done,
                p.budget_pairs,
                look.ratio_b_over_a,
                look.ci_low,
                look.ci_high,
                ab::confidence_percent(look.confidence),
                look.decision_headline()
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
    tokwatt_lab::ab::report::write_ab_outputs(&out_dir, &outcome)
        .with_context(|| format!("writing ab.json and report.html in {}", out_dir.display()))?;
    if args.json {
        return crate::json_out::JsonResult::new("ab", Some(&out_dir), &outcome)
            .with_objective_in_force(&in_force)?
            .print();
    }
    print_outcome(&outcome, &out_dir);
    Ok(())
}

/// The objective each arm is held to (`--json`'s `objective_in_force`: `a` and `b`).
#[derive(Debug, serde::Serialize)]
struct ArmsInForce {
    a: ObjectiveInForce,
    b: ObjectiveInForce,
}

impl ArmsInForce {
    /// One objective's lines where both arms hold the same, else each arm's.
    fn lines(&self) -> Vec<String> {
        if self.a == self.b {
            return self.a.lines();
        }
        let titled = |arm: &str, o: &ObjectiveInForce| {
            let mut lines = o.lines();
            if let Some(first) = lines.first_mut() {
                *first = first.replacen(
                    "objective in force",
                    &format!("objective in force for arm {arm}"),
                    1,
                );
            }
            lines
        };
        let mut lines = titled("a", &self.a);
        lines.extend(titled("b", &self.b));
        lines
    }
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

fn print_outcome(o: &AbOutcome, out: &Path) {
    let source = o.meta.source_line();
    println!();
    let row = |key: &str, value: String| println!("{key:<20} {value}");
    row("a", o.a.policy.clone());
    row("b", o.b.policy.clone());
    row("gpu", source);
    row(
        "decision",
        format!("{} ({})", o.decision_headline(), o.decision.code()),
    );
    row(
        "tokens/J B/A",
        format!(
            "{:.4}, {} interval [{:.4}, {:.4}]",
            o.ratio_b_over_a,
            ab::confidence_percent(o.confidence),
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
        row("refused because", why.clone());
    }
    if let Some(why) = o.winner_gave_up_within_noise() {
        row("objective", why.to_owned());
    }
    if let Some(difference) = &o.gpu_difference {
        row(
            "gpu difference",
            tokwatt_lab::ab::report::gpu_difference_words(difference, o.ratio_b_over_a),
        );
    }
    for note in &o.notes {
        row("note", note.clone());
    }
    row("time", format!("{:.0} s", o.run_time_s));
    row("output", out.join("ab.json").display().to_string());
}
