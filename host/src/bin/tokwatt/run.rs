//! `tokwatt run`: one policy on the simulator or on real GPUs for a duration, writing
//! `summary.json`, `trace.csv` and `observations.jsonl`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{Context, Result};

use tokwatt_agent::assembly;
use tokwatt_agent::control::Progress;
use tokwatt_agent::node::{Keep, Node, NodeRequest};
use tokwatt_agent::recorder::{OutputBounds, Rotation};
use tokwatt_agent::{AgentError, RunRequest, RunSummary};
use tokwatt_engines::prometheus;

use tokwatt_policy::in_force::ObjectiveInForce;
use tokwatt_policy::spec::PolicySpec;

use crate::plugin_places::PluginPlaces;
use crate::target::TargetArgs;

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The policy spec (TOML) to run.
    #[arg(long)]
    policy: PathBuf,
    /// How long to run: 30m, 90s, 1h30m, 500ms.
    #[arg(long, value_parser = tokwatt::cli::parse_duration, default_value = "5m")]
    duration: Duration,
    /// Control tick (overrides the spec's tick_ms).
    #[arg(long, value_parser = tokwatt::cli::parse_duration)]
    tick: Option<Duration>,
    /// Output folder for summary.json, trace.csv and observations.jsonl (default: a new
    /// folder under out/ named after the policy and the time).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replace an earlier run's files in --out.
    #[arg(long)]
    overwrite: bool,
    /// Size at which each output file (trace.csv, observations.jsonl, requests.jsonl) is
    /// rotated, MiB: the full file becomes trace.1.csv (older ones shift up) and a new one
    /// starts, each with its header.
    #[arg(long, value_name = "MIB", default_value_t = OutputBounds::DEFAULT_MAX_FILE_MIB,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_file_mib: u64,
    /// Rotated files kept of each kind: each kind holds at most (keep + 1) × --max-file-mib,
    /// the oldest ticks rotated away first (replay and report read what is kept).
    #[arg(long, value_name = "N", default_value_t = OutputBounds::DEFAULT_KEEP_FILES,
          value_parser = clap::value_parser!(u32).range(0..=1000))]
    keep_files: u32,
    /// Lines requests.jsonl holds at most: the run's first finished requests. Later ones are
    /// counted in summary.json (request_latency.requests_not_written), not written; the
    /// latency quantiles cover every request. 0 writes none.
    #[arg(long, value_name = "N", default_value_t = OutputBounds::DEFAULT_MAX_REQUEST_LINES)]
    max_request_lines: u64,
    /// Seed for the simulator and the policy's random source.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[command(flatten)]
    plugins: PluginPlaces,
    /// No progress lines.
    #[arg(long, short)]
    quiet: bool,
    /// Print the result as JSON on standard output instead of the summary's lines: the
    /// run's summary.json in an envelope with the output folder and its files (progress
    /// stays on standard error).
    #[arg(long)]
    json: bool,
    /// Testing aid: panic after this many ticks (to check that settings are restored).
    #[arg(long, hide = true)]
    debug_panic_after_ticks: Option<u64>,
    #[command(flatten)]
    pub target: TargetArgs,
    /// Keep the simulated GPUs' settings in this simulated driver file, outside the run's
    /// process, as a real driver holds them: they outlive the run (a kill -9 leaves them),
    /// and the run starts from what the file holds (created at the board defaults if it
    /// does not exist). See `tokwatt sim-driver`.
    #[arg(long, value_name = "PATH", requires = "sim")]
    sim_driver: Option<PathBuf>,
    #[command(flatten)]
    node: crate::node_rules::NodeRulesArgs,
}

pub fn run(args: RunArgs) -> Result<()> {
    // First, so that from the moment any setting could change, SIGINT and SIGTERM end
    // the run at a tick boundary (and the settings are restored) instead of killing it.
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop))
            .context("installing signal handlers")?;
    }
    let (rules, rules_source) = args.node.rules()?;
    // What the spec narrows of the node's rules is in force from here on.
    let given = PolicySpec::load(&args.policy)?;
    let mut spec = rules.narrow(&given, &rules_source.words)?;
    // Said at the start: whose each bound is, and which of the flags' the spec narrowed.
    let objective_in_force = ObjectiveInForce::merge(
        &rules.objective,
        &rules_source,
        &given.objective,
        &given.path,
    );
    if let Some(tick) = args.tick {
        spec.override_tick(tick)?;
    }
    let tick = Duration::from_millis(u64::from(spec.tick_ms));
    let (mut request, engine_beside_sim) =
        args.target
            .backend_request_with_engine(&spec.objective, tick, args.seed)?;
    if let assembly::Target::Sim(sim) = &mut request.target {
        sim.driver.clone_from(&args.sim_driver);
    }
    // The node, put together by the one rule (tokwatt_agent::node): its backends, the
    // state file keeping the original settings, the plugin host.
    let node = Node::open(NodeRequest {
        engine_beside_sim,
        keep: Keep {
            state_file: args.target.state_file.clone(),
            ..Keep::default()
        },
        plugins: args.plugins.for_node(),
        ..NodeRequest::new(request.clone(), &spec)
    })
    .context("putting the node together")?;
    for withheld in &node.assembled.withheld {
        eprintln!("tokwatt: policy `{}`: {withheld}", spec.name);
    }
    let withheld_hint = assembly::withheld_hint(&node.assembled.withheld, request.batch_only);
    spec.knobs = node.assembled.knobs;
    let node_knobs = node.assembled.offered.knobs();
    let out_dir = match &args.out {
        Some(dir) => dir.clone(),
        None => fresh_out_dir(Path::new("out"), &spec.name),
    };
    let request = RunRequest {
        spec,
        duration: args.duration,
        tick: None,
        out_dir: out_dir.clone(),
        plugin_dirs: args.plugins.plugin_dirs.clone(),
        cache_dir: args.plugins.cache_dir.clone(),
        seed: args.seed,
        overwrite: args.overwrite,
        write_files: true,
        rules,
        rules_source,
        node_knobs,
        output: OutputBounds {
            rotation: Some(Rotation {
                max_bytes: args.max_file_mib.saturating_mul(1024 * 1024),
                keep: args.keep_files,
            }),
            max_request_lines: Some(args.max_request_lines),
        },
    };
    let meta = node.assembled.meta.clone();
    if !args.quiet {
        eprintln!(
            "tokwatt: running policy `{}` for {} on {} [{}]",
            request.spec.name,
            humantime::format_duration(request.duration),
            meta.gpu_name,
            meta.data_source
        );
        for line in objective_in_force.lines() {
            eprintln!("tokwatt: {line}");
        }
    }
    let engine_batch = meta.workload == prometheus::WORKLOAD_NAME;
    let mut reporter =
        ProgressReporter::new(args.quiet, args.debug_panic_after_ticks, engine_batch);
    let (summary, backends) = node
        .run(&request, stop, None, &mut |p| reporter.report(p))
        .map_err(|error| match (&error, withheld_hint) {
            (AgentError::PolicyStart { .. }, Some(hint)) => anyhow::anyhow!("{error}\n{hint}"),
            _ => error.into(),
        })?;
    // Dropping the backends puts back every setting the run changed (SettingsGuard).
    drop(backends);
    if args.json {
        return crate::json_out::JsonResult::new("run", Some(&out_dir), &summary).print();
    }
    print_summary(&summary, &out_dir, &args);
    Ok(())
}

/// `base/POLICY-YYYY-MM-DDTHH-MM-SSZ`, with a counter if that exists already.
pub fn fresh_out_dir(base: &Path, policy: &str) -> PathBuf {
    let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now())
        .to_string()
        .replace(':', "-");
    let safe = tokwatt_report::file_name_safe(policy);
    let first = base.join(format!("{safe}-{stamp}"));
    if !first.exists() {
        return first;
    }
    (2..1000)
        .map(|n| base.join(format!("{safe}-{stamp}-{n}")))
        .find(|dir| !dir.exists())
        .unwrap_or(first)
}

/// Prints a progress line at every tenth of the run.
struct ProgressReporter {
    quiet: bool,
    next_tenth: u64,
    panic_after_ticks: Option<u64>,
    /// The batch size belongs to the serving engine: tokwatt neither knows nor sets it.
    engine_batch: bool,
}

impl ProgressReporter {
    fn new(quiet: bool, panic_after_ticks: Option<u64>, engine_batch: bool) -> Self {
        Self {
            quiet,
            next_tenth: 1,
            panic_after_ticks,
            engine_batch,
        }
    }

    fn report(&mut self, p: Progress<'_>) {
        if self.panic_after_ticks.is_some_and(|n| p.tick + 1 >= n) {
            panic!(
                "--debug-panic-after-ticks: panicking on purpose at tick {}",
                p.tick
            );
        }
        if self.quiet || p.ticks == 0 {
            return;
        }
        let done = p.tick + 1;
        if done * 10 < self.next_tenth * p.ticks {
            return;
        }
        self.next_tenth = done * 10 / p.ticks + 1;
        // Short lines however many GPUs: the node's sums and extremes beyond a few.
        for line in crate::run_progress::progress_lines(
            done * 100 / p.ticks,
            p.time.as_secs_f64(),
            p.totals,
            p.observations,
            self.engine_batch,
        ) {
            eprintln!("{line}");
        }
    }
}

fn print_summary(s: &RunSummary, out: &Path, args: &RunArgs) {
    let t = &s.totals;
    let source = s.meta.source_line();
    println!();
    let row = |key: &str, value: String| println!("{key:<17} {value}");
    row("policy", s.policy.clone());
    row("gpu", source);
    row(
        "duration",
        format!(
            "{:.0} s in {} ticks ({:.2} s wall){}",
            t.duration_s,
            t.ticks,
            t.wall_time_s,
            if t.interrupted { ", interrupted" } else { "" }
        ),
    );
    row("tokens", t.tokens.to_string());
    row("energy", format!("{:.0} J", t.energy_j));
    row("tokens per joule", format!("{:.4}", t.tokens_per_joule));
    row("SLO violations", format!("{} ticks", t.slo_violation_ticks));
    if t.tpot_unknown_ticks > 0 {
        row(
            "TPOT unknown",
            format!(
                "{} ticks with tokens but no TPOT observation (the TPOT bound unchecked)",
                t.tpot_unknown_ticks
            ),
        );
    }
    row(
        "fallback ticks",
        format!(
            "{} (plugin traps {}, invalid answers {}, ejections {})",
            t.fallback_ticks,
            t.plugin_traps,
            t.policy_counters.invalid_answers,
            t.policy_counters.ejections
        ),
    );
    row(
        "clamped",
        format!(
            "{} decisions ({} non-finite values)",
            t.clamped_decisions, t.non_finite_values
        ),
    );
    if let Some(latency) = t.request_latency.filter(|l| l.requests_not_written > 0) {
        row(
            "requests.jsonl",
            format!(
                "the first {} requests; {} more NOT written (--max-request-lines {}); the \
                 latency quantiles cover all {}",
                latency.requests - latency.requests_not_written,
                latency.requests_not_written,
                args.max_request_lines,
                latency.requests
            ),
        );
    }
    let engine_batch = s.meta.workload == prometheus::WORKLOAD_NAME;
    // A row a GPU for a few; for many, the node's spread and extremes.
    for (key, value) in crate::run_progress::summary_gpu_rows(t, engine_batch) {
        row(&key, value);
    }
    // The report is left out where it failed to render (the run logged why).
    let report = out.join(tokwatt_report::RUN_REPORT_FILE).exists();
    let rotated =
        tokwatt_agent::recorder::observation_files(out).map_or(0, |files| files.len() - 1);
    // The oldest tick kept: past 0 where the bound rotated the oldest ticks away.
    let first_kept = tokwatt_agent::recorder::ObservationReader::open(out)
        .ok()
        .and_then(|mut lines| lines.next())
        .and_then(Result::ok)
        .map_or(0, |line| line.record.observation.tick);
    row(
        "wrote",
        format!(
            "{}/summary.json, trace.csv, observations.jsonl{}{}",
            out.display(),
            if report { ", report.html" } else { "" },
            match (rotated, first_kept) {
                (0, 0) => String::new(),
                (n, 0) => format!(" (+ {n} rotated observation files)"),
                (n, tick) => format!(
                    " (+ {n} rotated observation files; the ticks before {tick} were rotated \
                     away: each kind keeps at most {} MiB, --max-file-mib and --keep-files)",
                    (u64::from(args.keep_files) + 1) * args.max_file_mib
                ),
            }
        ),
    );
}
