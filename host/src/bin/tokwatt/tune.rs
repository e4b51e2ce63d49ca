//! `tokwatt tune`: the best parameters of a policy by rounds of A/B on the simulator
//! (successive halving against the spec as given); `tune.json`, `report.html` and the spec
//! with the winning parameters written in, in the output folder.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use tokwatt_agent::assembly::SimTarget;
use tokwatt_lab::ab::Schedule;
use tokwatt_lab::ab::stats::{Compliance, DEFAULT_ALPHA};
use tokwatt_lab::ab::tune::{
    self, ParamRange, TuneOutcome, TuneProgress, TuneRequest, format_params,
};
use tokwatt_policy::spec::PolicySpec;

use crate::node_rules::ObjectiveArgs;
use crate::plugin_places::PluginPlaces;
use crate::progress::RoundBar;

#[derive(Debug, clap::Args)]
#[command(
    after_help = "Runs on the simulator only for now (--sim). On real GPUs, compare each candidate with the spec as given by `tokwatt ab --a SPEC --b CANDIDATE-SPEC`."
)]
pub struct TuneArgs {
    /// The policy spec to tune: the reference every candidate is compared with, and the
    /// base of the tuned spec.
    #[arg(long)]
    policy: PathBuf,
    /// A parameter of the spec's [params] and its values: NAME=LO..HI:STEP (inclusive,
    /// numeric, e.g. power_cap_w=300..700:50) or NAME=a,b,c. Repeat for more parameters;
    /// the candidates are every combination.
    #[arg(long = "param", value_name = "NAME=RANGE", required = true)]
    params: Vec<String>,
    /// The simulated GPU's profile (built-in: h200, h100, a100; or a profile file).
    #[arg(long, value_name = "PROFILE")]
    sim: Option<String>,
    /// Real GPUs are not tuned yet: see the note below.
    #[arg(long, value_delimiter = ',', conflicts_with = "sim")]
    gpu: Option<Vec<u32>>,
    /// Demand scenario file for the simulator (default: the built-in phased scenario).
    #[arg(long)]
    scenario: Option<PathBuf>,
    /// Keep the best 1/ETA of each round, and give the next round ETA times the pairs.
    #[arg(long, default_value_t = 3)]
    eta: usize,
    /// Pairs of epochs per A/B in the first round (at least 2).
    #[arg(long, default_value_t = 2)]
    pairs: usize,
    /// False-positive rate of each A/B's decision (the ranking uses the ratio).
    #[arg(long, default_value_t = DEFAULT_ALPHA)]
    alpha: f64,
    /// The measured window of each epoch (default: 15 ticks).
    #[arg(long, value_parser = tokwatt::cli::parse_duration)]
    epoch: Option<Duration>,
    /// Each epoch's warm-up after its arm takes over, not measured (default: 30 ticks: a
    /// serving workload's queue and batch need a few requests' lifetimes to settle at new
    /// settings; with 5 ticks the measured window still sees the other arm's backlog).
    #[arg(long, value_parser = tokwatt::cli::parse_duration)]
    warmup: Option<Duration>,
    /// Device defaults with the policy paused before each epoch's warm-up (default: 2
    /// ticks, the schedule tune's own test was measured with; every epoch already starts
    /// from the device defaults, so `0s` is allowed).
    #[arg(long, value_parser = tokwatt::cli::parse_duration_or_zero)]
    cooldown: Option<Duration>,
    /// Control tick (default: the spec's).
    #[arg(long, value_parser = tokwatt::cli::parse_duration)]
    tick: Option<Duration>,
    /// Seeds the simulator (its demand and its board), the arms' order and the policies; every A/B uses it.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Tune for tokens per joule with no latency bound. Without one, the search favours
    /// the slowest settings of the ranges (the lowest clock or cap that still serves the
    /// demand), so a spec whose [objective] bounds no latency is refused unless a flag
    /// below gives a bound or this is given.
    #[arg(long)]
    without_objective: bool,
    // The objective every candidate is held to; the spec's own may only narrow it.
    #[command(flatten)]
    objective: ObjectiveArgs,
    /// Output folder (default: out/tune-POLICY-TIME).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replace an earlier search's files in --out.
    #[arg(long)]
    overwrite: bool,
    #[command(flatten)]
    plugins: PluginPlaces,
    /// No progress bar or progress lines.
    #[arg(long, short)]
    quiet: bool,
    /// Print the result as JSON on standard output: tune.json in an envelope with the
    /// output folder and its files (the tuned spec among them). Each round's lines go to
    /// standard error instead.
    #[arg(long)]
    json: bool,
}

pub fn tune(args: TuneArgs) -> Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop))
            .context("installing signal handlers")?;
    }
    let (None, Some(profile)) = (&args.gpu, args.sim.clone()) else {
        bail!(
            "tokwatt tune runs on the simulator only for now: pass --sim h200 (or another profile). On real GPUs, compare each candidate with the spec as given by `tokwatt ab --a SPEC --b CANDIDATE-SPEC`"
        );
    };
    let ranges = args
        .params
        .iter()
        .map(|text| ParamRange::parse(text))
        .collect::<Result<Vec<_>, _>>()?;
    // Refuse a bad grid before loading anything.
    let count = tune::candidates(&ranges)?.len();
    let text = std::fs::read_to_string(&args.policy)
        .with_context(|| format!("reading {}", args.policy.display()))?;
    let mut spec = PolicySpec::parse(&args.policy, &text)?;
    // The flags' objective, narrowed where the spec is stricter: every candidate (a copy
    // of this spec with other parameters) is held to it.
    let in_force = args.objective.hold(&mut spec)?;
    check_objective(&spec, &args.policy, args.without_objective)?;
    if let Some(tick) = args.tick {
        spec.override_tick(tick)?;
    }
    let tick = Duration::from_millis(u64::from(spec.tick_ms));
    let schedule = Schedule {
        cooldown_ticks: match args.cooldown {
            Some(span) => crate::ab::ticks_of("cooldown", span, tick)?,
            None => 2,
        },
        // Every candidate is measured as fresh trajectories from a cold start, as `ab`
        // measures by default.
        settle_ticks: 0,
        warmup_ticks: match args.warmup {
            Some(span) => crate::ab::ticks_of("warmup", span, tick)?,
            None => 30,
        },
        measure_ticks: match args.epoch {
            Some(span) => crate::ab::ticks_of("epoch", span, tick)?,
            None => 15,
        },
    };
    schedule.check(tick)?;
    let out_dir = match &args.out {
        Some(dir) => dir.clone(),
        None => crate::run::fresh_out_dir(Path::new("out"), &format!("tune-{}", spec.name)),
    };
    let tune_json = out_dir.join("tune.json");
    if tune_json.exists() && !args.overwrite {
        bail!(
            "{} holds an earlier search; choose another --out, or pass --overwrite",
            tune_json.display()
        );
    }
    let request = TuneRequest {
        reference: spec.clone(),
        ranges,
        sim: SimTarget {
            profile,
            scenario: args.scenario.clone(),
            gpus: 1,
            realtime: false,
            driver: None,
        },
        seed: args.seed,
        eta: args.eta,
        first_round_pairs: args.pairs,
        alpha: args.alpha,
        schedule,
        plugin_dirs: args.plugins.plugin_dirs.clone(),
        cache_dir: args.plugins.cache_dir.clone(),
    };
    if !args.quiet {
        eprintln!(
            "tokwatt: tuning `{}` over {count} candidates on the simulator: rounds of A/B against the spec as given, η {}, {} pairs in the first round, epochs of {} ticks (warm-up {})",
            spec.name, args.eta, args.pairs, schedule.measure_ticks, schedule.warmup_ticks
        );
        for line in in_force.lines() {
            eprintln!("tokwatt: {line}");
        }
    }
    let bar = RoundBar::new(args.quiet, planned_runs(count, args.eta));
    let mut progress = |event: TuneProgress<'_>| match event {
        TuneProgress::RoundStarted { .. } => {}
        TuneProgress::CandidateDone { round, result, .. } => bar.inc(&format!(
            "round {round}: {} B/A {:.4}",
            format_params(&result.params),
            result.ratio
        )),
        TuneProgress::CandidateDropped { round, dropped } => {
            bar.inc(&format!("round {round}: dropped"));
            bar.suspend(|| {
                eprintln!(
                    "tokwatt: candidate {} dropped: the policy refused it at init: {}",
                    format_params(&dropped.params),
                    dropped.reason
                );
            });
        }
        TuneProgress::RoundDone { round } => bar.suspend(|| {
            let lines = round_lines(round);
            if args.json {
                eprintln!("{lines}");
            } else {
                println!("{lines}");
            }
        }),
    };
    let outcome = tune::tune(&request, stop, &mut progress)?;
    bar.finish();
    let tuned = tune::write_outputs(&out_dir, &outcome, &spec, &text)?;
    if args.json {
        return crate::json_out::JsonResult::new("tune", Some(&out_dir), &outcome)
            .with_objective_in_force(&in_force)?
            .print();
    }
    print_outcome(&outcome, &out_dir, tuned.as_deref());
    Ok(())
}

/// A search with no latency bound has nothing to hold it back from the slowest settings
/// (fewer watts per token, however long each token takes): refused with the fix, or, with
/// `--without-objective`, said once more before it starts.
fn check_objective(spec: &PolicySpec, path: &Path, without_objective: bool) -> Result<()> {
    let objective = &spec.objective;
    if objective.tpot_p99_limit_ms.is_some()
        || objective.queue_wait_p99_limit_ms.is_some()
        || objective.ttft_p99_limit_ms.is_some()
    {
        return Ok(());
    }
    let why = format!(
        "the spec `{}` ({}) bounds no latency in its [objective] (tpot_p99_limit_ms, \
         queue_wait_p99_limit_ms or ttft_p99_limit_ms) and no flag gives one \
         (--tpot-p99-limit-ms, --queue-wait-p99-limit-ms or --ttft-p99-limit-ms), so nothing holds the search back \
         from the slowest settings of the ranges: it would pick the lowest clock or cap that \
         still serves the demand, however long each token takes",
        spec.name,
        path.display()
    );
    if without_objective {
        eprintln!("tokwatt: WARNING: {why} (--without-objective)");
        return Ok(());
    }
    bail!(
        "{why}. Give your service's bound, e.g. `--tpot-p99-limit-ms 25` (or \
         `tpot_p99_limit_ms = 25.0` under the spec's [objective]), or pass --without-objective to tune for tokens per joule alone"
    )
}

/// A/Bs the search runs if no candidate is dropped: n, ⌈n/η⌉, … down to one left.
fn planned_runs(candidates: usize, eta: usize) -> usize {
    let mut total = 0;
    let mut n = candidates;
    loop {
        total += n;
        if n <= 1 || eta < 2 {
            return total;
        }
        n = n.div_ceil(eta);
        if n <= 1 {
            return total;
        }
    }
}

/// A round's lines: its candidates ranked, and which were kept.
fn round_lines(round: &tune::Round) -> String {
    let mut lines = vec![format!(
        "round {}: {} candidates, {} pairs each, {} kept{}, {:.0} s simulated",
        round.round,
        round.candidates.len(),
        round.pairs_budget,
        round.kept,
        tune::promoted_words(round),
        round.simulated_time_s
    )];
    for c in &round.candidates {
        lines.push(format!(
            "  {:>3}. {:<40} B/A {:.4} [{:.4}, {:.4}] {} pairs{}{}",
            c.rank,
            format_params(&c.params),
            c.ratio,
            c.ci_low,
            c.ci_high,
            c.pairs,
            match (c.compliance, &c.not_compliant_because) {
                (Compliance::Keeps, _) | (_, None) => String::new(),
                (Compliance::Unresolved, Some(why)) => format!(", unresolved: {why}"),
                (Compliance::Breaks, Some(why)) => format!(", not compliant: {why}"),
            },
            if c.kept { "  kept" } else { "" }
        ));
    }
    lines.join("\n")
}

fn print_outcome(outcome: &TuneOutcome, out_dir: &Path, tuned: Option<&Path>) {
    let e = &outcome.evidence;
    println!(
        "winner: {} (simulator output): tokens per joule {:.4}x the spec as given [{:.4}, {:.4}] at {} over {} pairs, {} ({}); served {:.2} % (reference {:.2} %), violation ticks {} (reference {})",
        format_params(&outcome.winner),
        e.ratio_b_over_a,
        e.ci_low,
        e.ci_high,
        tokwatt_lab::ab::confidence_percent(e.confidence),
        e.pairs,
        tune::decision_text(e.decision),
        e.decision.code(),
        e.served_fraction_winner * 100.0,
        e.served_fraction_reference * 100.0,
        e.violation_ticks_winner,
        e.violation_ticks_reference
    );
    println!(
        "simulated time of the search: {:.0} s ({})",
        outcome.simulated_time_s, outcome.data_source
    );
    for note in outcome.notes.iter().skip(1) {
        println!("note: {note}");
    }
    match tuned {
        Some(path) => println!(
            "wrote tune.json, report.html and {} in {}",
            path.file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
            out_dir.display()
        ),
        None => println!(
            "wrote tune.json and report.html in {} (no tuned spec: the winner did not keep the objective)",
            out_dir.display()
        ),
    }
}
