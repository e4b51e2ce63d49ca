//! `tokwatt`: the node agent's command line.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

use tokwatt::actuator::{Actuator, DryRun};
use tokwatt::agent::{self, RunMeta, RunRequest, RunSummary};
use tokwatt::clock::{Clock, VirtualClock, WallClock};
use tokwatt::control::{Backends, Progress};
use tokwatt::nvml::NvmlSystem;
use tokwatt::restore::{SettingsGuard, StateFile, restore_all};
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
    Run(Box<RunArgs>),
    /// Load a policy spec and its plugin, and check it starts (no run).
    Check {
        /// The policy spec (TOML).
        spec: PathBuf,
        #[arg(long = "plugin-dir")]
        plugin_dirs: Vec<PathBuf>,
    },
    /// Put back the GPU settings saved in the state file (after a crash or `kill -9`).
    Restore {
        /// State file (default: /var/lib/tokwatt/state.json as root, else $XDG_STATE_HOME/tokwatt/state.json).
        #[arg(long)]
        state_file: Option<PathBuf>,
        /// Restore through the simulated GPU with this profile (for testing).
        #[arg(long, value_name = "PROFILE")]
        sim: Option<String>,
    },
    /// List the GPUs: constraints, supported clocks, current settings, whether tokwatt may change them.
    Gpus {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Benchmarks of the agent itself and of the workload.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// The CUDA decode workload on a real GPU: tokens/s, step time, watts (NVML energy
    /// counter) and tokens per joule per batch size. Changes no GPU setting.
    Workload {
        /// CUDA device / NVML index.
        #[arg(long, default_value_t = 0)]
        gpu: u32,
        /// Model preset (llama-3-8b, llama-3.2-1b).
        #[arg(long, default_value = "llama-3-8b")]
        model: String,
        /// KV context length, tokens.
        #[arg(long, default_value_t = 1024)]
        context: u32,
        /// Batch sizes to measure.
        #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,128,256,512")]
        batches: Vec<u32>,
        /// Measured seconds per batch size (after a warm-up).
        #[arg(long, default_value_t = 6.0)]
        seconds: f64,
        /// Also write the rows as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum WorkloadKind {
    Cuda,
    External,
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
    /// Run on these real GPUs (NVML indices, comma-separated).
    #[arg(long, value_delimiter = ',', conflicts_with = "sim")]
    gpu: Option<Vec<u32>>,
    /// Observe only: log every GPU setting decision and change nothing (the batch size,
    /// the workload's own knob, still changes).
    #[arg(long, requires = "gpu")]
    dry_run: bool,
    /// Let the policy change only the batch size (for running without privileges).
    #[arg(long, requires = "gpu")]
    batch_only: bool,
    /// Where the tokens come from on a real GPU: `cuda` (tokwatt's own decode workload)
    /// or `external` (a running server's Prometheus token counter, see --metrics-url).
    #[arg(long, value_enum, default_value_t = WorkloadKind::Cuda, requires = "gpu")]
    workload: WorkloadKind,
    /// The serving engine's metrics endpoint, for `--workload external` (http://HOST:PORT/metrics).
    #[arg(long, required_if_eq("workload", "external"))]
    metrics_url: Option<String>,
    /// Counter of generated tokens at --metrics-url (summed over its series).
    #[arg(long, default_value = "vllm:generation_tokens_total")]
    token_counter: String,
    /// Histogram of time per output token (seconds) at --metrics-url; "" for none.
    #[arg(long, default_value = "vllm:time_per_output_token_seconds")]
    tpot_histogram: String,
    /// CUDA workload model preset (llama-3-8b, llama-3.2-1b).
    #[arg(long, default_value = "llama-3-8b", requires = "gpu")]
    model: String,
    /// CUDA workload KV context length, tokens.
    #[arg(long, default_value_t = 1024, requires = "gpu")]
    context: u32,
    /// CUDA workload largest batch size (buffers are sized for it).
    #[arg(long, default_value_t = 512, requires = "gpu")]
    batch_size_max: u32,
    /// State file of original GPU settings (default for real GPUs: /var/lib/tokwatt/state.json
    /// as root, else $XDG_STATE_HOME/tokwatt/state.json). With --sim, only used when given.
    #[arg(long)]
    state_file: Option<PathBuf>,
    /// Testing aid: panic after this many ticks (to check that settings are restored).
    #[arg(long, hide = true)]
    debug_panic_after_ticks: Option<u64>,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log.as_deref());
    match dispatch(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The error and its causes, leaving out a cause whose text the message before it
/// already carries (typed errors often quote their source in their own message).
fn error_chain(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&cause);
        }
    }
    text
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
        Command::Run(args) => run(*args),
        Command::Check { spec, plugin_dirs } => check(&spec, &plugin_dirs),
        Command::Restore { state_file, sim } => restore(state_file, sim.as_deref()),
        Command::Gpus { json } => gpus(json),
        Command::Bench { what } => match what {
            BenchCommand::Workload {
                gpu,
                model,
                context,
                batches,
                seconds,
                json,
            } => bench_workload(gpu, &model, context, batches, seconds, json),
            BenchCommand::Decide {
                gpus,
                calls,
                plugin,
            } => bench_decide(gpus, calls, plugin),
        },
    }
}

fn restore(state_file: Option<PathBuf>, sim: Option<&str>) -> Result<()> {
    let state = StateFile::new(state_file.unwrap_or_else(StateFile::default_path));
    if state.load()?.is_none() {
        println!(
            "nothing to restore: {} does not exist",
            state.path().display()
        );
        return Ok(());
    }
    let mut actuator: Box<dyn Actuator> = match sim {
        // Enough simulated GPUs for any state file a simulated run could have written.
        Some(profile) => {
            simulator(profile, None, 8, 1, VirtualClock::new())?
                .1
                .actuator
        }
        None => Box::new(NvmlSystem::open(None)?.actuator()),
    };
    let report = restore_all(&state, actuator.as_mut())?;
    println!("{report}");
    if !report.is_complete() {
        bail!(
            "some settings were not restored; {} keeps them: fix the cause and run `tokwatt restore` again",
            state.path().display()
        );
    }
    Ok(())
}

fn gpus(json: bool) -> Result<()> {
    let reports = tokwatt::nvml::list_gpus()?;
    if json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    } else {
        print!("{}", tokwatt::nvml::GpuTable(&reports));
    }
    Ok(())
}

fn bench_workload(
    gpu: u32,
    model: &str,
    context: u32,
    batches: Vec<u32>,
    seconds: f64,
    json: Option<PathBuf>,
) -> Result<()> {
    let system = NvmlSystem::open(Some(&[gpu]))?;
    let mut telemetry = system
        .telemetry(tokwatt::nvml::SamplerConfig::default())
        .context("starting NVML telemetry")?;
    let shape = tokwatt::cuda::ModelShape::preset(model)?;
    let mut config = tokwatt::cuda::BenchConfig::new(shape, context, batches, seconds);
    config.device = gpu;
    // Energy from the NVML energy counter (the sampler's latest reading), never from
    // integrated power samples.
    let mut energy = || {
        use tokwatt::telemetry::Telemetry;
        telemetry.read_window(0).ok().map(|w| w.energy_counter_j)
    };
    println!(
        "tokwatt bench workload: {model}, context {context}, GPU {gpu} ({}); energy from the NVML counter",
        system.devices().first().map_or("?", |d| d.name.as_str())
    );
    let rows = tokwatt::cuda::bench_with(&config, &mut energy, &mut |row| {
        eprintln!(
            "batch {:>4}: {:>9.1} tok/s  {:>7.3} ms/step  {:>6.1} W  {:>7.3} tok/J",
            row.batch,
            row.tokens_per_s,
            row.step_ms,
            row.watts.unwrap_or(f64::NAN),
            row.tokens_per_j.unwrap_or(f64::NAN)
        )
    })?;
    println!("{}", tokwatt::cuda::format_table(&rows, &|_| None));
    if let Some(path) = json {
        std::fs::write(&path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
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
    let (_, backends) = simulator("h200", None, 1, 1, VirtualClock::new())?;
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
    // First, so that from the moment any setting could change, SIGINT and SIGTERM end
    // the run at a tick boundary (and the settings are restored) instead of killing it.
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop))
            .context("installing signal handlers")?;
    }
    let mut spec = PolicySpec::load(&args.policy)?;
    let (mut backends, meta, needs_restore) = match (&args.sim, &args.gpu) {
        (Some(profile), None) => {
            let (backends, meta) = sim_backends(&args, profile)?;
            (backends, meta, args.state_file.is_some())
        }
        (None, Some(indices)) => {
            let (backends, meta) = gpu_backends(&args, indices, &mut spec)?;
            (backends, meta, !args.dry_run)
        }
        _ => bail!(
            "choose where to run: `--sim h200` for the simulated GPU, or `--gpu 0` for a real GPU (add --dry-run to observe only)"
        ),
    };
    if needs_restore {
        // Saves the original settings before the first change (restoring first whatever
        // a crashed run left behind) and puts them back when the run ends, however it ends.
        let state = StateFile::new(
            args.state_file
                .clone()
                .unwrap_or_else(StateFile::default_path),
        );
        let mut guard = SettingsGuard::new(state, backends.actuator);
        guard
            .arm()
            .context("saving the original GPU settings before the run")?;
        backends.actuator = Box::new(guard);
    }
    let request = RunRequest {
        spec,
        duration: args.duration,
        tick: args.tick,
        out_dir: args.out.clone(),
        plugin_dirs: args.plugin_dirs.clone(),
        cache_dir: args.cache_dir.clone(),
        seed: args.seed,
    };
    if !args.quiet {
        eprintln!(
            "tokwatt: running policy `{}` for {:?} on {} [{}]",
            request.spec.name, request.duration, meta.gpu_name, meta.data_source
        );
    }
    let mut reporter = ProgressReporter::new(args.quiet, args.debug_panic_after_ticks);
    let (summary, backends) =
        agent::run(&request, backends, meta, stop, &mut |p| reporter.report(p))?;
    // Dropping the backends puts back every setting the run changed (SettingsGuard).
    drop(backends);
    print_summary(&summary, &args.out);
    Ok(())
}

fn gpu_backends(
    args: &RunArgs,
    indices: &[u32],
    spec: &mut PolicySpec,
) -> Result<(Backends, RunMeta)> {
    let [index] = indices else {
        bail!(
            "the CUDA decode workload runs on one GPU; pass one index to --gpu (got {indices:?})"
        );
    };
    let system = NvmlSystem::open(Some(indices))?;
    let devices = system.devices();
    let mut nvml_actuator = system.actuator();
    if args.batch_only {
        spec.knobs.power_cap = false;
        spec.knobs.sm_clock = false;
    }
    let actuator: Box<dyn Actuator> = if args.dry_run {
        let current = (0..devices.len() as u32)
            .map(|gpu| nvml_actuator.read(gpu))
            .collect::<Result<Vec<_>, _>>()
            .context("reading the GPU settings in force")?;
        Box::new(DryRun::new(devices.clone(), current))
    } else {
        // Explain a missing privilege now, not half-way through the run.
        for device in &devices {
            let can = nvml_actuator.capabilities(device.index);
            let missing: Vec<&str> = [
                (spec.knobs.power_cap && !can.power_cap, "the power cap"),
                (spec.knobs.sm_clock && !can.sm_clock, "the SM clock lock"),
            ]
            .into_iter()
            .filter_map(|(missing, what)| missing.then_some(what))
            .collect();
            if !missing.is_empty() {
                bail!(
                    "policy `{}` may change {} on GPU {}, but this process may not ({}). Run as root or with CAP_SYS_ADMIN, or run observe-only with --dry-run, or let the policy change only the batch size with --batch-only",
                    spec.name,
                    missing.join(" and "),
                    device.index,
                    tokwatt::nvml::privileges::Privileges::current()
                        .denial()
                        .map_or_else(|| "the driver refused".to_owned(), |d| d.to_string())
                );
            }
        }
        Box::new(nvml_actuator)
    };
    let telemetry = system
        .telemetry(tokwatt::nvml::SamplerConfig::default())
        .context("starting NVML telemetry")?;
    let (workload, workload_note): (Box<dyn tokwatt::workload::Workload>, String) = match args
        .workload
    {
        WorkloadKind::Cuda => {
            let model = tokwatt::cuda::ModelShape::preset(&args.model)?;
            let mut config =
                tokwatt::cuda::CudaDecodeConfig::new(model, args.context, args.batch_size_max);
            config.device = *index;
            let workload = tokwatt::cuda::CudaDecode::new(config)
                .context("starting the CUDA decode workload")?;
            let note = format!("CUDA decode of {} at context {}", args.model, args.context);
            (Box::new(workload), note)
        }
        WorkloadKind::External => {
            let url = args
                .metrics_url
                .clone()
                .context("--workload external needs --metrics-url")?;
            if spec.knobs.batch_size {
                eprintln!(
                    "tokwatt: the external server sets its own batch size; policy `{}` will not get the batch-size knob",
                    spec.name
                );
                spec.knobs.batch_size = false;
            }
            let config = tokwatt::workload::prometheus::PrometheusConfig {
                url: url.clone(),
                token_counter: args.token_counter.clone(),
                tpot_histogram: (!args.tpot_histogram.is_empty())
                    .then(|| args.tpot_histogram.clone()),
                period: Duration::from_secs(1),
            };
            let workload = tokwatt::workload::prometheus::PrometheusTokens::start(config)
                .with_context(|| format!("reading tokens from {url}"))?;
            (Box::new(workload), format!("tokens from {url}"))
        }
    };
    let name = devices.first().map_or_else(String::new, |d| d.name.clone());
    let meta = RunMeta {
        simulated: false,
        gpu_profile: name.clone(),
        gpu_name: name,
        data_source: format!("measured on GPU {index} (NVML energy counter, {workload_note})"),
        gpus: 1,
        actuator: actuator.name().to_owned(),
        workload: workload.name().into(),
        seed: args.seed,
    };
    let backends = Backends {
        telemetry: Box::new(telemetry),
        actuator,
        workload,
        clock: WallClock::new(),
    };
    Ok((backends, meta))
}

/// The simulated GPU with `profile` (a built-in name or a file) and `scenario` (the
/// built-in one if `None`), and the backends of a run on it.
fn simulator(
    profile: &str,
    scenario: Option<&std::path::Path>,
    gpus: u32,
    seed: u64,
    clock: Arc<dyn Clock>,
) -> Result<(SimGpu, Backends)> {
    let profile = GpuProfile::load(profile)?;
    let scenario = match scenario {
        Some(path) => Scenario::load(path)?,
        None => Scenario::built_in()?,
    };
    let sim = SimGpu::new(
        SimConfig {
            profile,
            scenario,
            gpus,
            seed,
        },
        clock.clone(),
    )
    .context("setting up the simulated GPU")?;
    let backends = Backends {
        telemetry: sim.telemetry(),
        actuator: sim.actuator(),
        workload: sim.workload(),
        clock,
    };
    Ok((sim, backends))
}

fn sim_backends(args: &RunArgs, profile_name: &str) -> Result<(Backends, RunMeta)> {
    let clock: Arc<dyn Clock> = if args.realtime {
        WallClock::new()
    } else {
        VirtualClock::new()
    };
    let (sim, backends) = simulator(
        profile_name,
        args.scenario.as_deref(),
        args.gpus,
        args.seed,
        clock,
    )?;
    let meta = RunMeta {
        simulated: true,
        gpu_profile: profile_name.to_owned(),
        gpu_name: sim.profile().name.clone(),
        data_source: format!("simulator output: {}", sim.calibration_note()),
        gpus: args.gpus,
        actuator: "sim".into(),
        workload: "sim".into(),
        seed: args.seed,
    };
    Ok((backends, meta))
}

/// Prints a progress line at every tenth of the run.
struct ProgressReporter {
    quiet: bool,
    next_tenth: u64,
    panic_after_ticks: Option<u64>,
}

impl ProgressReporter {
    fn new(quiet: bool, panic_after_ticks: Option<u64>) -> Self {
        Self {
            quiet,
            next_tenth: 1,
            panic_after_ticks,
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
