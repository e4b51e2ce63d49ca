//! `tokwatt`: the node agent's command line.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

use tokwatt::agent::{self, RunMeta, RunRequest, RunSummary};
use tokwatt::clock::{Clock, VirtualClock, WallClock};
use tokwatt::control::{Backends, Progress};
use tokwatt::sim::{GpuProfile, Scenario, SimConfig, SimGpu};
use tokwatt::spec::PolicySpec;

#[derive(Debug, Parser)]
#[command(
    name = "tokwatt",
    version,
    about = "Tunes GPU power caps, SM clocks and batch sizes for tokens per joule, through sandboxed WebAssembly policies"
)]
struct Cli {
    /// Log filter (e.g. `info`, `tokwatt=debug,plugin=info`); also RUST_LOG.
    #[arg(long, global = true)]
    log: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a policy on the simulator or on real GPUs, writing summary.json and trace.csv.
    Run(RunArgs),
    /// Load a policy spec and its plugin, and check it starts (no run).
    Check {
        /// The policy spec (TOML).
        spec: PathBuf,
        #[arg(long = "plugin-dir")]
        plugin_dirs: Vec<PathBuf>,
    },
    /// Benchmarks of the agent itself and of the workload.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Host overhead of one `decide` call (plugin host + supervisor), p50 and p99.
    Decide {
        /// GPUs per call.
        #[arg(long, default_value_t = 8)]
        gpus: u32,
        /// Calls to time.
        #[arg(long, default_value_t = 100_000)]
        calls: usize,
        /// Plugin to call (default: the shipped `static` policy, which does no work).
        #[arg(long)]
        plugin: Option<PathBuf>,
    },
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Run on the simulated GPU with this profile (built-in: h200, h100, a100; or a profile file).
    #[arg(long, value_name = "PROFILE")]
    sim: Option<String>,
    /// Number of simulated GPUs.
    #[arg(long, default_value_t = 1, requires = "sim")]
    gpus: u32,
    /// Demand scenario file for the simulator (default: the built-in phased scenario).
    #[arg(long, requires = "sim")]
    scenario: Option<PathBuf>,
    /// Run the simulator against the wall clock instead of the virtual clock.
    #[arg(long, requires = "sim")]
    realtime: bool,
    /// The policy spec (TOML) to run.
    #[arg(long)]
    policy: PathBuf,
    /// How long to run: 30m, 90s, 1h, 500ms.
    #[arg(long, value_parser = tokwatt::cli::parse_duration, default_value = "5m")]
    duration: Duration,
    /// Control tick (overrides the spec's tick_ms).
    #[arg(long, value_parser = tokwatt::cli::parse_duration)]
    tick: Option<Duration>,
    /// Output folder for summary.json, trace.csv and observations.jsonl.
    #[arg(long, default_value = "out")]
    out: PathBuf,
    /// Seed for the simulator and the policy's random source.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Extra folder to look for plugins in.
    #[arg(long = "plugin-dir")]
    plugin_dirs: Vec<PathBuf>,
    /// Folder for compiled plugins (default: ~/.cache/tokwatt/components).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// No progress lines.
    #[arg(long, short)]
    quiet: bool,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log.as_deref());
    match dispatch(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn init_logging(filter: Option<&str>) {
    let filter = filter
        .map(str::to_owned)
        .or_else(|| std::env::var("RUST_LOG").ok())
        .unwrap_or_else(|| "warn".to_owned());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn dispatch(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Run(args) => run(args),
        Command::Check { spec, plugin_dirs } => check(&spec, &plugin_dirs),
        Command::Bench { what } => match what {
            BenchCommand::Decide {
                gpus,
                calls,
                plugin,
            } => bench_decide(gpus, calls, plugin),
        },
    }
}

fn bench_decide(gpus: u32, calls: usize, plugin: Option<PathBuf>) -> Result<()> {
    let plugin = plugin.unwrap_or_else(|| agent::built_plugin_dir().join("policy_static.wasm"));
    let mut times = tokwatt::bench::decide_latencies(&plugin, gpus, calls)
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("benchmarking {}", plugin.display()))?;
    let q = |times: &mut [Duration], q: f64| tokwatt::bench::quantile(times, q).as_secs_f64() * 1e6;
    println!(
        "decide, {gpus} GPUs, {calls} calls through the plugin host ({}):",
        plugin.display()
    );
    println!(
        "  p50 {:.2} us   p90 {:.2} us   p99 {:.2} us   max {:.2} us",
        q(&mut times, 0.5),
        q(&mut times, 0.9),
        q(&mut times, 0.99),
        q(&mut times, 1.0)
    );
    Ok(())
}

fn check(spec_path: &std::path::Path, plugin_dirs: &[PathBuf]) -> Result<()> {
    let spec = PolicySpec::load(spec_path)?;
    let clock: Arc<dyn Clock> = VirtualClock::new();
    let sim = SimGpu::new(
        SimConfig {
            profile: GpuProfile::load("h200")?,
            scenario: Scenario::built_in()?,
            gpus: 1,
            seed: 1,
        },
        clock.clone(),
    )?;
    let backends = Backends {
        telemetry: sim.telemetry(),
        actuator: sim.actuator(),
        workload: sim.workload(),
        clock,
    };
    let plugin = spec.resolve_plugin(&agent::plugin_search_path(plugin_dirs))?;
    let host = tokwatt::plugin::PluginHost::new(&tokwatt::plugin::HostConfig {
        cache_dir: tokwatt::plugin::ComponentCache::default_dir(),
    })?;
    let tick = Duration::from_millis(u64::from(spec.tick_ms));
    let (_, first, _) = agent::start_policy(&host, &spec, &plugin, &backends, 1, tick)?;
    println!(
        "ok: {} ({}) loads, implements tokwatt:policy@{} and starts; first settings: {first:?}",
        spec.name,
        plugin.display(),
        tokwatt::plugin::CONTRACT_VERSION
    );
    Ok(())
}

fn run(args: RunArgs) -> Result<()> {
    let spec = PolicySpec::load(&args.policy)?;
    let Some(profile_name) = args.sim.as_deref() else {
        bail!("choose a GPU: `--sim h200` for the simulator");
    };
    let profile = GpuProfile::load(profile_name)?;
    let scenario = match &args.scenario {
        Some(path) => Scenario::load(path)?,
        None => Scenario::built_in()?,
    };
    let clock: Arc<dyn Clock> = if args.realtime {
        WallClock::new()
    } else {
        VirtualClock::new()
    };
    let sim = SimGpu::new(
        SimConfig {
            profile,
            scenario,
            gpus: args.gpus,
            seed: args.seed,
        },
        clock.clone(),
    )
    .context("setting up the simulated GPU")?;
    let meta = RunMeta {
        simulated: true,
        gpu_profile: profile_name.to_owned(),
        gpu_name: sim.profile().name.clone(),
        data_source: sim.calibration_note(),
        gpus: args.gpus,
        actuator: "sim".into(),
        workload: "sim".into(),
        seed: args.seed,
    };
    let backends = Backends {
        telemetry: sim.telemetry(),
        actuator: sim.actuator(),
        workload: sim.workload(),
        clock,
    };
    let request = RunRequest {
        spec,
        duration: args.duration,
        tick: args.tick,
        out_dir: args.out.clone(),
        plugin_dirs: args.plugin_dirs.clone(),
        cache_dir: args.cache_dir.clone(),
        seed: args.seed,
    };
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop))
            .context("installing signal handlers")?;
    }
    if !args.quiet {
        eprintln!(
            "tokwatt: running policy `{}` for {:?} on {} ({})",
            request.spec.name, request.duration, meta.gpu_profile, meta.data_source
        );
    }
    let mut reporter = ProgressReporter::new(args.quiet);
    let (summary, _backends) =
        agent::run(&request, backends, meta, stop, &mut |p| reporter.report(p))?;
    print_summary(&summary, &args.out);
    Ok(())
}

/// Prints a progress line at every tenth of the run.
struct ProgressReporter {
    quiet: bool,
    next_tenth: u64,
}

impl ProgressReporter {
    fn new(quiet: bool) -> Self {
        Self {
            quiet,
            next_tenth: 1,
        }
    }

    fn report(&mut self, p: Progress<'_>) {
        if self.quiet || p.ticks == 0 {
            return;
        }
        let done = p.tick + 1;
        if done * 10 < self.next_tenth * p.ticks {
            return;
        }
        self.next_tenth = done * 10 / p.ticks + 1;
        let caps: Vec<String> = p
            .observations
            .iter()
            .map(|o| {
                format!(
                    "{:.0}W/{}MHz/b{}",
                    o.in_force.power_cap_w, o.in_force.sm_clock_max_mhz, o.in_force.batch_size
                )
            })
            .collect();
        let energy = p.totals.energy_j;
        eprintln!(
            "[{:>3}%] t={:>6.0}s tokens={:>10} energy={:>10.0}J tok/J={:>7.3} fallback={} traps={} settings={}",
            done * 100 / p.ticks,
            p.time.as_secs_f64(),
            p.totals.tokens,
            energy,
            if energy > 0.0 {
                p.totals.tokens as f64 / energy
            } else {
                0.0
            },
            p.totals.fallback_ticks,
            p.totals.plugin_traps,
            caps.join(" "),
        );
    }
}

fn print_summary(s: &RunSummary, out: &std::path::Path) {
    let t = &s.totals;
    let source = if s.meta.simulated {
        format!(
            "SIMULATED ({}) — {}",
            s.meta.gpu_profile, s.meta.data_source
        )
    } else {
        format!("{} (measured)", s.meta.gpu_profile)
    };
    println!();
    println!("policy            {}", s.policy);
    println!("gpu               {source}");
    println!(
        "duration          {:.0} s in {} ticks ({:.2} s wall){}",
        t.duration_s,
        t.ticks,
        t.wall_time_s,
        if t.interrupted { ", interrupted" } else { "" }
    );
    println!("tokens            {}", t.tokens);
    println!("energy            {:.0} J", t.energy_j);
    println!("tokens per joule  {:.4}", t.tokens_per_joule);
    println!("SLO violations    {} ticks", t.slo_violation_ticks);
    println!(
        "fallback ticks    {} (plugin traps {}, invalid answers {}, ejections {})",
        t.fallback_ticks,
        t.plugin_traps,
        t.policy_counters.invalid_answers,
        t.policy_counters.ejections
    );
    println!(
        "clamped           {} decisions ({} non-finite values)",
        t.clamped_decisions, t.non_finite_values
    );
    for g in &t.gpus {
        if let Some(f) = g.final_settings {
            println!(
                "gpu {}             {:.4} tok/J, final cap {:.0} W, SM max {} MHz, batch {}",
                g.gpu, g.tokens_per_joule, f.power_cap_w, f.sm_clock_max_mhz, f.batch_size
            );
        }
    }
    println!(
        "wrote             {}/summary.json, trace.csv, observations.jsonl",
        out.display()
    );
}
