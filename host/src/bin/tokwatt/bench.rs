//! `tokwatt bench`: measurements of the agent itself (`decide`, `agent-cpu`) and of the
//! CUDA decode workload on a real GPU (`workload`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};

mod sim_run;

use crate::plugin_places::PluginPlaces;
use tokwatt_bench::DecideLatencies;
use tokwatt_bench::agent_cpu::{
    self, AgentCpuRequest, AgentCpuRun, AgentCpuTarget, CPU_TIME_RESOLUTION,
};
use tokwatt_nvml::SamplerConfig;
use tokwatt_plugin::{ComponentCache, HostConfig, PluginHost};
use tokwatt_policy::spec::PolicySpec;

#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// How often `tokwatt ab` is wrong, on the simulator where the truth is known: an A/A
    /// study (the false-positive rate) and a study of a known difference in tokens per
    /// joule (the power), each a whole A/B per seed on the virtual clock. Simulator output.
    AbErrorRates(crate::ab_studies::ErrorRatesArgs),
    /// The error rates of `tokwatt ab` for what users compare: for each policy on each
    /// scenario, the A/A false-positive rate and the power against a known true difference
    /// laid on one arm, over many seeds, with what a comparison costs. Simulator output.
    AbTable(crate::ab_studies::AbTableArgs),
    /// How fast `tokwatt run` simulates: simulated GPU-hours per wall second of the real
    /// command (8 GPUs for 24 h by default, report included) and the bytes it leaves on disk,
    /// medians of repeated runs; with --compare-with, an earlier tokwatt binary runs the same
    /// command alternately, side by side. Simulator output.
    SimRun(sim_run::SimRunArgs),
    /// The CUDA decode workload on a real GPU: tokens/s, step time, watts (NVML energy
    /// counter) and tokens per joule per batch size. Changes no GPU setting.
    Workload {
        /// CUDA device / NVML index.
        #[arg(long, default_value_t = 0)]
        gpu: u32,
        /// Model preset (llama-3-8b, llama-3.2-1b) or a model shape file.
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
    /// Prefill on a real GPU, as the PyTorch reference in the calibration data measures it
    /// (whole prompts, causal attention, the first token of each): prompt tokens/s, watts
    /// (NVML energy counter) and tokens per joule per prompt length and sequences per call.
    /// Changes no GPU setting.
    Prefill {
        /// CUDA device / NVML index.
        #[arg(long, default_value_t = 0)]
        gpu: u32,
        /// Model preset (llama-3-8b, llama-3.2-1b) or a model shape file.
        #[arg(long, default_value = "llama-3-8b")]
        model: String,
        /// Cases as PROMPTxSEQUENCES (default: the PyTorch reference's nine).
        #[arg(long, value_delimiter = ',', value_parser = parse_prefill_case)]
        cases: Vec<(u32, u32)>,
        /// Prefill attention tilings to measure each case with (m1n64, m2n32, m2n64; default:
        /// the engine's default).
        #[arg(long, value_delimiter = ',')]
        attention: Vec<String>,
        /// Measured seconds per case (after two warm-up calls).
        #[arg(long, default_value_t = 4.0)]
        seconds: f64,
        /// Also write the rows as JSON lines here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Requests served on a real GPU by tokwatt's engine: a scenario's arrivals in real time,
    /// continuous batching with chunked prefill, the running limit and token budget fixed.
    /// Tokens/s, watts (NVML energy counter), tokens per joule, TTFT and TPOT per request.
    /// Changes no GPU setting.
    Serving {
        /// CUDA device / NVML index.
        #[arg(long, default_value_t = 0)]
        gpu: u32,
        /// Simulator scenario with prompts (its phases, rates and length distributions).
        #[arg(long)]
        scenario: PathBuf,
        /// Seconds to serve.
        #[arg(long, default_value_t = 60.0)]
        seconds: f64,
        /// KV positions per sequence (longer requests are cut to fit, and counted).
        #[arg(long, default_value_t = 4096)]
        context: u32,
        /// KV cache slots (default: the running limit).
        #[arg(long)]
        slots: Option<u32>,
        /// Sequences admitted at once (default: the scenario's initial batch size).
        #[arg(long)]
        running_limit: Option<u32>,
        /// Tokens one step may process (default: the scenario's).
        #[arg(long)]
        max_batched_tokens: Option<u32>,
        /// Seed of the arrivals and lengths.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Write the summary as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Write every finished request (arrival, TTFT, TPOT, lengths) as JSON lines here.
        #[arg(long)]
        requests: Option<PathBuf>,
    },
    /// Host overhead of one `decide` call (plugin host + supervisor): p50, p90, p99 and
    /// the worst call (a deadline is judged against the worst), and the plugin's start.
    Decide {
        /// GPUs per call.
        #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
        gpus: u32,
        /// Calls to time.
        #[arg(long, default_value_t = 100_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100_000_000))]
        calls: usize,
        /// Plugin to call (default: the shipped `static` policy, which does no work).
        #[arg(long)]
        plugin: Option<PathBuf>,
        /// The compiled-component cache to load the plugin through (default: the
        /// agent's, `$TOKWATT_CACHE_DIR` or the user's cache folder); `tokwatt plugin
        /// compile` fills it, so a large component starts at once.
        #[arg(long = "cache-dir")]
        cache_dir: Option<PathBuf>,
    },
    /// Tick lateness of `tokwatt serve` (simulated node, real time) idle and under a
    /// stream of status requests on loopback HTTP, side by side in one run.
    ServeApi {
        /// Served time per run (idle, then under load).
        #[arg(long, value_parser = tokwatt::cli::parse_duration, default_value = "60s")]
        duration: std::time::Duration,
        /// Status requests per second in the loaded run.
        #[arg(long, default_value_t = 1000.0)]
        rate: f64,
        /// Simulated GPUs.
        #[arg(long, default_value_t = 8)]
        gpus: u32,
        /// Control tick.
        #[arg(long, value_parser = tokwatt::cli::parse_duration, default_value = "1s")]
        tick: std::time::Duration,
        /// Policy spec (default: the shipped slo-batch).
        #[arg(long)]
        policy: Option<PathBuf>,
        /// Idle and loaded runs each, alternating; medians reported.
        #[arg(long, default_value_t = 1)]
        repeats: u32,
    },
    /// The agent's own CPU time while it runs (user + system, this process, all threads)
    /// per GPU count: the real agent loop with a shipped policy, on the simulator in
    /// real time, or with --nvml on real GPUs (NVML telemetry, dry-run actuator, no
    /// workload). Changes no GPU setting.
    AgentCpu {
        /// Measured run length per GPU count and repeat: 60s, 20s, 5m.
        #[arg(long, value_parser = tokwatt::cli::parse_duration, default_value = "60s")]
        duration: Duration,
        /// Control tick.
        #[arg(long, value_parser = tokwatt::cli::parse_duration, default_value = "1s")]
        tick: Duration,
        /// Simulated GPU counts to measure (ignored with --nvml).
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
        gpus: Vec<u32>,
        /// Runs per GPU count; the table shows their medians.
        #[arg(long, default_value_t = 3)]
        repeats: u32,
        /// The policy spec to run (default: slo-batch.toml from policies/, the bundle's
        /// specs/ or the source tree).
        #[arg(long)]
        policy: Option<PathBuf>,
        /// Simulator GPU profile.
        #[arg(long, default_value = "h200")]
        profile: String,
        /// Measure on these real GPUs (NVML indices) instead of the simulator.
        #[arg(long, value_delimiter = ',')]
        nvml: Option<Vec<u32>>,
        /// With one --nvml index: open that GPU this many times as that many logical GPUs
        /// (one row per count), to measure K GPUs' worth of NVML sampling on one GPU.
        #[arg(long, value_delimiter = ',', requires = "nvml")]
        nvml_repeat: Option<Vec<u32>>,
        /// NVML fast samples (energy, power) per tick.
        #[arg(long, default_value_t = SamplerConfig::SAMPLES_PER_TICK, requires = "nvml")]
        samples_per_tick: u32,
        /// NVML slow gauges (temperature, utilisation, memory clock, requested limit)
        /// every this many samples (default: about every 5 s).
        #[arg(long, requires = "nvml")]
        slow_gauges_every: Option<u32>,
        /// NVML tick gauges (SM clock, clock-event reasons, enforced limit) every this
        /// many samples (default: once per tick).
        #[arg(long, requires = "nvml")]
        tick_gauges_every: Option<u32>,
        /// NVML fast readings are the energy counter alone (no power fields).
        #[arg(long, requires = "nvml")]
        energy_only: bool,
        /// NVML sampling as before issue 15, for comparison: every reading every 100 ms.
        #[arg(long, requires = "nvml", conflicts_with_all = ["samples_per_tick", "slow_gauges_every", "tick_gauges_every", "energy_only"])]
        old_rates: bool,
        #[command(flatten)]
        plugins: PluginPlaces,
    },
}

pub fn bench(what: BenchCommand) -> Result<()> {
    match what {
        BenchCommand::AbErrorRates(args) => crate::ab_studies::error_rates(&args),
        BenchCommand::AbTable(args) => crate::ab_studies::ab_table(&args),
        BenchCommand::SimRun(args) => sim_run::bench_sim_run(&args),
        BenchCommand::ServeApi {
            duration,
            rate,
            gpus,
            tick,
            policy,
            repeats,
        } => crate::bench_serve::bench_serve_api(duration, rate, gpus, tick, policy, repeats),
        BenchCommand::Workload {
            gpu,
            model,
            context,
            batches,
            seconds,
            json,
        } => bench_workload(gpu, &model, context, batches, seconds, json),
        BenchCommand::Serving {
            gpu,
            scenario,
            seconds,
            context,
            slots,
            running_limit,
            max_batched_tokens,
            seed,
            json,
            requests,
        } => bench_serving(ServingBench {
            gpu,
            scenario,
            seconds,
            context,
            slots,
            running_limit,
            max_batched_tokens,
            seed,
            json,
            requests,
        }),
        BenchCommand::Prefill {
            gpu,
            model,
            cases,
            attention,
            seconds,
            json,
        } => bench_prefill(gpu, &model, cases, attention, seconds, json),
        BenchCommand::Decide {
            gpus,
            calls,
            plugin,
            cache_dir,
        } => bench_decide(gpus, calls, plugin, cache_dir),
        BenchCommand::AgentCpu {
            duration,
            tick,
            gpus,
            repeats,
            policy,
            profile,
            nvml,
            nvml_repeat,
            samples_per_tick,
            slow_gauges_every,
            tick_gauges_every,
            energy_only,
            old_rates,
            plugins:
                PluginPlaces {
                    plugin_dirs,
                    cache_dir,
                },
        } => {
            let sampler = if old_rates {
                SamplerConfig::everything_every(Duration::from_millis(100))
            } else {
                let mut sampler = SamplerConfig::with_samples_per_tick(tick, samples_per_tick);
                if let Some(every) = slow_gauges_every {
                    sampler.slow_gauges_every = every;
                }
                if let Some(every) = tick_gauges_every {
                    sampler.tick_gauges_every = every;
                }
                sampler.power_fields = !energy_only;
                sampler
            };
            let targets = agent_cpu_targets(&gpus, &profile, nvml, nvml_repeat, sampler)?;
            let policy = match policy {
                Some(path) => path,
                None => default_policy("slo-batch.toml")?,
            };
            let request = AgentCpuRequest {
                spec: PolicySpec::load(&policy)?,
                duration,
                tick,
                plugin_dirs,
                cache_dir,
            };
            let simulated = matches!(targets.first(), Some(AgentCpuTarget::Sim { .. }));
            bench_agent_cpu(&targets, &request, repeats, (!simulated).then_some(sampler))
        }
    }
}

fn agent_cpu_targets(
    gpus: &[u32],
    profile: &str,
    nvml: Option<Vec<u32>>,
    nvml_repeat: Option<Vec<u32>>,
    sampler: SamplerConfig,
) -> Result<Vec<AgentCpuTarget>> {
    Ok(match (nvml, nvml_repeat) {
        (None, _) => {
            if gpus.contains(&0) {
                bail!("--gpus: every GPU count must be at least 1");
            }
            gpus.iter()
                .map(|&gpus| AgentCpuTarget::Sim {
                    profile: profile.to_owned(),
                    gpus,
                })
                .collect()
        }
        (Some(indices), None) => vec![AgentCpuTarget::Nvml { indices, sampler }],
        (Some(indices), Some(copies)) => {
            let [index] = indices[..] else {
                bail!(
                    "--nvml-repeat opens one GPU several times: give one index to --nvml (got {indices:?})"
                );
            };
            if copies.contains(&0) {
                bail!("--nvml-repeat: every count must be at least 1");
            }
            copies
                .into_iter()
                .map(|copies| AgentCpuTarget::NvmlRepeated {
                    index,
                    copies,
                    sampler,
                })
                .collect()
        }
    })
}

/// A shipped spec: in ./policies (a checkout), beside the binary in specs/ (the GPU
/// bundle), or in the source tree this binary was built from.
pub(crate) fn default_policy(file: &str) -> Result<PathBuf> {
    let mut candidates = vec![Path::new("policies").join(file)];
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_owned))
    {
        candidates.push(dir.join("specs").join(file));
    }
    candidates.push(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../policies")
            .join(file),
    );
    candidates
        .iter()
        .find(|path| path.is_file())
        .cloned()
        .with_context(|| {
            let looked: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
            format!(
                "no {file} found (looked in {}): name a spec with --policy",
                looked.join(", ")
            )
        })
}

fn bench_agent_cpu(
    targets: &[AgentCpuTarget],
    request: &AgentCpuRequest,
    repeats: u32,
    sampler: Option<SamplerConfig>,
) -> Result<()> {
    let repeats = repeats.max(1);
    let simulated = matches!(targets.first(), Some(AgentCpuTarget::Sim { .. }));
    println!(
        "tokwatt bench agent-cpu: policy `{}` ({}), tick {}, {} per run, median of {repeats} run(s)",
        request.spec.name,
        request.spec.path.display(),
        humantime::format_duration(request.tick),
        humantime::format_duration(request.duration),
    );
    println!(
        "CPU time of this process (user + system, all threads) from the end of the first tick to the end of the last, resolution {} ms",
        CPU_TIME_RESOLUTION.as_millis()
    );
    if simulated {
        println!(
            "SIMULATOR output: the simulated GPU runs in real time; its work stands in for NVML's, so these figures are not what NVML costs (measure that with --nvml on a GPU machine)"
        );
    } else if let Some(sampler) = sampler {
        println!(
            "NVML telemetry, dry-run actuator (no GPU setting changes), no workload (an idle token source); sampler: energy and power every {} ms, SM clock, clock events and enforced limit every {} sample(s), temperature, utilisation, memory clock and requested limit every {} sample(s)",
            sampler.period.as_millis(),
            sampler.tick_gauges_every,
            sampler.slow_gauges_every
        );
        if targets
            .iter()
            .any(|t| matches!(t, AgentCpuTarget::NvmlRepeated { .. }))
        {
            println!(
                "LOGICAL GPUs: one GPU opened K times, so each row is K GPUs' worth of NVML sampling on one device"
            );
        }
    }
    let mut rows = Vec::new();
    for target in targets {
        let mut runs = Vec::new();
        for repeat in 1..=repeats {
            eprintln!(
                "measuring {} (run {repeat} of {repeats}, {})",
                agent_cpu::describe(target),
                humantime::format_duration(request.duration)
            );
            let run = agent_cpu::measure(target, request)
                .with_context(|| format!("measuring {}", agent_cpu::describe(target)))?;
            eprintln!("  {}", run_line(&run));
            runs.push(run);
        }
        rows.push((target, runs));
    }
    println!("{}", agent_cpu_table(&rows, simulated));
    Ok(())
}

fn run_line(run: &AgentCpuRun) -> String {
    let calls = run
        .nvml_calls_per_s_per_gpu()
        .map_or_else(String::new, |rate| format!(", {rate:.1} NVML calls/s/GPU"));
    format!(
        "{} ticks in {:.1} s: {:.3} % of one core (user {:.2} s, system {:.2} s){calls}",
        run.ticks,
        run.wall.as_secs_f64(),
        run.cpu_pct_of_one_core(),
        run.cpu.user.as_secs_f64(),
        run.cpu.system.as_secs_f64()
    )
}

fn agent_cpu_table(rows: &[(&AgentCpuTarget, Vec<AgentCpuRun>)], simulated: bool) -> String {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::ASCII_MARKDOWN);
    let mut header = vec![
        "gpus",
        "cpu % of one core",
        "(min..max)",
        "user s",
        "system s",
        "per GPU (% of a core)",
        "measured s",
    ];
    if !simulated {
        header.push("NVML calls/s/GPU");
    }
    table.set_header(header);
    for (target, runs) in rows {
        let pick = |f: &dyn Fn(&AgentCpuRun) -> f64| {
            agent_cpu::median(&runs.iter().map(f).collect::<Vec<_>>())
        };
        let pct = pick(&|r| r.cpu_pct_of_one_core());
        let (low, high) = runs
            .iter()
            .map(AgentCpuRun::cpu_pct_of_one_core)
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            });
        let gpus = target.gpus();
        let label = match target {
            AgentCpuTarget::Sim { .. } => format!("{gpus} (simulated)"),
            AgentCpuTarget::Nvml { .. } => format!("{gpus}"),
            AgentCpuTarget::NvmlRepeated { .. } => format!("{gpus} (logical)"),
        };
        let mut row = vec![
            label,
            format!("{pct:.3}"),
            format!("{low:.3}..{high:.3}"),
            format!("{:.2}", pick(&|r| r.cpu.user.as_secs_f64())),
            format!("{:.2}", pick(&|r| r.cpu.system.as_secs_f64())),
            format!("{:.3}", pct / f64::from(gpus.max(1))),
            format!("{:.1}", pick(&|r| r.wall.as_secs_f64())),
        ];
        if !simulated {
            row.push(format!(
                "{:.1}",
                pick(&|r| r.nvml_calls_per_s_per_gpu().unwrap_or(f64::NAN))
            ));
        }
        table.add_row(row);
    }
    table.to_string()
}

/// What `tokwatt bench serving` was asked.
#[derive(Debug)]
struct ServingBench {
    gpu: u32,
    scenario: PathBuf,
    seconds: f64,
    context: u32,
    slots: Option<u32>,
    running_limit: Option<u32>,
    max_batched_tokens: Option<u32>,
    seed: u64,
    json: Option<PathBuf>,
    requests: Option<PathBuf>,
}

#[cfg(not(feature = "cuda"))]
fn bench_serving(_bench: ServingBench) -> Result<()> {
    anyhow::bail!(
        "this tokwatt was built without its CUDA workload (the `cuda` feature): rebuild with `cargo build -p tokwatt --features cuda` (on by default)"
    )
}

#[cfg(feature = "cuda")]
fn bench_serving(bench: ServingBench) -> Result<()> {
    use tokwatt_core::telemetry::Telemetry;
    use tokwatt_core::workload::Workload;
    if !(bench.seconds.is_finite() && bench.seconds > 0.0 && bench.seconds <= 86_400.0) {
        bail!(
            "--seconds must be above 0 and at most 86400 (a day), not {}",
            bench.seconds
        );
    }
    let scenario = tokwatt_sim::Scenario::load(&bench.scenario)
        .with_context(|| format!("reading the scenario {}", bench.scenario.display()))?;
    let arrivals =
        tokwatt_sim::ScenarioArrivals::new(&scenario, bench.seed).map_err(anyhow::Error::msg)?;
    let running_limit = bench.running_limit.unwrap_or(scenario.initial_batch_size);
    let slots = bench.slots.unwrap_or(running_limit).max(running_limit);
    let budget = bench
        .max_batched_tokens
        .unwrap_or(scenario.max_batched_tokens);
    let system = tokwatt_nvml::NvmlSystem::open(Some(&[bench.gpu]))?;
    let mut telemetry = system
        .telemetry(SamplerConfig::everything_every(Duration::from_millis(100)))
        .context("starting NVML telemetry")?;
    let mut energy = || telemetry.read_window(0).ok().map(|w| w.energy_counter_j);
    // The serving thread's own counter, to share each step's energy over its requests.
    let mut step_telemetry = system
        .telemetry(SamplerConfig::energy_only(Duration::from_millis(100)))
        .context("starting the serving loop's energy counter")?;
    let mut serve = tokwatt_cuda::CudaServe::new(tokwatt_cuda::CudaServeConfig {
        model: scenario.model.clone(),
        context: bench.context,
        slots,
        running_limit,
        max_batched_tokens: budget,
        queue_max: scenario.queue_max,
        device: bench.gpu,
        gpu_index: 0,
        engine: tokwatt_cuda::EngineOptions::default(),
        requests: Box::new(arrivals),
        energy: Some(Box::new(move || {
            step_telemetry
                .read_window(0)
                .ok()
                .map(|w| w.energy_counter_j)
        })),
    })?;
    println!(
        "tokwatt bench serving: {} on GPU {} ({}), {:.0} s, running limit {running_limit}, {slots} slots of {} positions, {budget} tokens per step; energy from the NVML counter",
        bench.scenario.display(),
        bench.gpu,
        serve.gpu_name(),
        bench.seconds,
        bench.context
    );
    let e0 = energy();
    let started = std::time::Instant::now();
    let mut records = Vec::new();
    let (mut tokens, mut prefill_tokens, mut arrived, mut turned_away) = (0u64, 0u64, 0u64, 0u64);
    let mut step_p99s = Vec::new();
    let mut dropped = 0u32;
    while started.elapsed().as_secs_f64() < bench.seconds {
        std::thread::sleep(Duration::from_secs(1));
        let window = serve.read_window(0)?;
        tokens += window.tokens;
        if let Some(r) = window.requests {
            prefill_tokens += r.prefill_tokens;
        }
        if let Some(d) = window.demand {
            arrived += d.requests_arrived;
            turned_away += d.requests_turned_away;
        }
        if window.tpot_p99_ms.is_finite() {
            step_p99s.push(window.tpot_p99_ms);
        }
        let (finished, lost) = serve.take_finished();
        records.extend(finished);
        dropped += lost;
    }
    let wall = started.elapsed().as_secs_f64();
    let joules = match (e0, energy()) {
        (Some(a), Some(b)) if b > a => Some(b - a),
        _ => None,
    };
    let truncated = serve.truncated();
    drop(serve);
    let quantile = |values: &mut Vec<f64>, q: f64| {
        tokwatt_core::quantile::nearest_rank(values, q).unwrap_or(f64::NAN)
    };
    let mut ttfts: Vec<f64> = records.iter().map(|r| r.ttft_ms).collect();
    let mut tpots: Vec<f64> = records.iter().filter_map(|r| r.tpot_ms).collect();
    let summary = serde_json::json!({
        "measured_on": "GPU",
        "gpu": system.devices().first().map(|d| d.name.clone()),
        "scenario": bench.scenario.display().to_string(),
        "seconds": wall,
        "running_limit": running_limit,
        "slots": slots,
        "context": bench.context,
        "max_batched_tokens": budget,
        "requests_arrived": arrived,
        "requests_turned_away": turned_away,
        "requests_finished": records.len(),
        "requests_truncated": truncated,
        "records_dropped": dropped,
        "tokens_per_s": tokens as f64 / wall,
        "prefill_tokens_per_s": prefill_tokens as f64 / wall,
        "watts": joules.map(|j| j / wall),
        "tokens_per_j": joules.map(|j| tokens as f64 / j),
        "ttft_p50_ms": quantile(&mut ttfts, 0.5),
        "ttft_p99_ms": quantile(&mut ttfts, 0.99),
        "tpot_p50_ms": quantile(&mut tpots, 0.5),
        "tpot_p99_ms": quantile(&mut tpots, 0.99),
        "step_p99_ms_median_over_windows": quantile(&mut step_p99s, 0.5),
    });
    println!("{}", serde_json::to_string_pretty(&summary)?);
    if let Some(path) = &bench.json {
        std::fs::write(path, serde_json::to_string_pretty(&summary)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &bench.requests {
        let lines: Vec<String> = records
            .iter()
            .map(serde_json::to_string)
            .collect::<Result<_, _>>()?;
        std::fs::write(path, lines.join("\n") + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// `2048x4`: a prompt of 2048 tokens, 4 sequences per call.
fn parse_prefill_case(text: &str) -> Result<(u32, u32), String> {
    let bad = || format!("prefill case `{text}`: write PROMPTxSEQUENCES, e.g. 2048x4");
    let (prompt, sequences) = text.split_once('x').ok_or_else(bad)?;
    let prompt = prompt.trim().parse::<u32>().map_err(|_| bad())?;
    let sequences = sequences.trim().parse::<u32>().map_err(|_| bad())?;
    if prompt == 0 || sequences == 0 {
        return Err(bad());
    }
    Ok((prompt, sequences))
}

#[cfg(not(feature = "cuda"))]
fn bench_prefill(
    _gpu: u32,
    _model: &str,
    _cases: Vec<(u32, u32)>,
    _attention: Vec<String>,
    _seconds: f64,
    _json: Option<PathBuf>,
) -> Result<()> {
    anyhow::bail!(
        "this tokwatt was built without its CUDA workload (the `cuda` feature): rebuild with `cargo build -p tokwatt --features cuda` (on by default)"
    )
}

#[cfg(feature = "cuda")]
fn bench_prefill(
    gpu: u32,
    model: &str,
    cases: Vec<(u32, u32)>,
    attention: Vec<String>,
    seconds: f64,
    json: Option<PathBuf>,
) -> Result<()> {
    use tokwatt_cuda::PrefillAttention;
    let tilings = if attention.is_empty() {
        vec![PrefillAttention::default()]
    } else {
        attention
            .iter()
            .map(|name| {
                PrefillAttention::from_name(name).with_context(|| {
                    format!(
                        "unknown prefill attention tiling `{name}`: use {}",
                        PrefillAttention::ALL.map(PrefillAttention::name).join(", ")
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?
    };
    let system = tokwatt_nvml::NvmlSystem::open(Some(&[gpu]))?;
    let mut telemetry = system
        .telemetry(SamplerConfig::everything_every(Duration::from_millis(100)))
        .context("starting NVML telemetry")?;
    let shape = tokwatt_cuda::ModelShape::load(model)?;
    let cases = if cases.is_empty() {
        tokwatt_cuda::REFERENCE_PREFILL_CASES.to_vec()
    } else {
        cases
    };
    let mut energy = || {
        use tokwatt_core::telemetry::Telemetry;
        telemetry.read_window(0).ok().map(|w| w.energy_counter_j)
    };
    println!(
        "tokwatt bench prefill: {model}, GPU {gpu} ({}); energy from the NVML counter",
        system.devices().first().map_or("?", |d| d.name.as_str())
    );
    let mut lines = Vec::new();
    let rows = tokwatt_cuda::bench_prefill(
        &shape,
        &cases,
        &tilings,
        seconds,
        gpu,
        &mut energy,
        &mut |row| {
            eprintln!(
                "prompt {:>5} x {:>2} ({}): {:>9.0} tok/s  {:>8.2} ms/call  {:>6.1} W  {:>7.2} tok/J",
                row.prompt,
                row.sequences,
                row.attention,
                row.tokens_per_s,
                row.call_ms,
                row.watts.unwrap_or(f64::NAN),
                row.tokens_per_j.unwrap_or(f64::NAN)
            );
            lines.push(serde_json::to_string(row).unwrap_or_default());
        },
    )?;
    println!("{} cases measured", rows.len());
    if let Some(path) = json {
        std::fs::write(&path, lines.join("\n") + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn bench_workload(
    _gpu: u32,
    _model: &str,
    _context: u32,
    _batches: Vec<u32>,
    _seconds: f64,
    _json: Option<PathBuf>,
) -> Result<()> {
    anyhow::bail!(
        "this tokwatt was built without its CUDA decode workload (the `cuda` feature): rebuild with `cargo build -p tokwatt --features cuda` (on by default)"
    )
}

#[cfg(feature = "cuda")]
fn bench_workload(
    gpu: u32,
    model: &str,
    context: u32,
    batches: Vec<u32>,
    seconds: f64,
    json: Option<PathBuf>,
) -> Result<()> {
    let system = tokwatt_nvml::NvmlSystem::open(Some(&[gpu]))?;
    // The freshest energy counter for per-batch measurements: every 100 ms, as NVML
    // refreshes it (a cost the agent does not pay; this is a measurement).
    let mut telemetry = system
        .telemetry(SamplerConfig::everything_every(Duration::from_millis(100)))
        .context("starting NVML telemetry")?;
    let shape = tokwatt_cuda::ModelShape::load(model)?;
    let mut config = tokwatt_cuda::BenchConfig::new(shape, context, batches, seconds);
    config.device = gpu;
    // Energy from the NVML energy counter (the sampler's latest reading), never from
    // integrated power samples.
    let mut energy = || {
        use tokwatt_core::telemetry::Telemetry;
        telemetry.read_window(0).ok().map(|w| w.energy_counter_j)
    };
    println!(
        "tokwatt bench workload: {model}, context {context}, GPU {gpu} ({}); energy from the NVML counter",
        system.devices().first().map_or("?", |d| d.name.as_str())
    );
    let rows = tokwatt_cuda::bench_with(&config, &mut energy, &mut |row| {
        eprintln!(
            "batch {:>4}: {:>9.1} tok/s  {:>7.3} ms/step  {:>6.1} W  {:>7.3} tok/J",
            row.batch,
            row.tokens_per_s,
            row.step_ms,
            row.watts.unwrap_or(f64::NAN),
            row.tokens_per_j.unwrap_or(f64::NAN)
        )
    })?;
    println!("{}", tokwatt_cuda::format_table(&rows, &|_| None));
    if let Some(path) = json {
        std::fs::write(&path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn bench_decide(
    gpus: u32,
    calls: usize,
    plugin: Option<PathBuf>,
    cache_dir: Option<PathBuf>,
) -> Result<()> {
    let plugin = plugin
        .unwrap_or_else(|| tokwatt_plugin_artifacts::built_plugin_dir().join("policy_static.wasm"));
    let host = PluginHost::new(&HostConfig {
        cache_dir: cache_dir.or_else(ComponentCache::default_dir),
    })?;
    let hits_before = host.cache().map(ComponentCache::hits);
    let DecideLatencies { start, mut times } =
        tokwatt_bench::decide_latencies(&host, &plugin, gpus, calls)
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("benchmarking {}", plugin.display()))?;
    let q = |times: &mut [Duration], q: f64| tokwatt_bench::quantile(times, q).as_secs_f64() * 1e6;
    println!(
        "decide, {gpus} GPUs, {calls} calls through the plugin host ({}):",
        plugin.display()
    );
    let how = match (host.cache(), hits_before) {
        (Some(cache), Some(before)) if cache.hits() > before => format!(
            "loaded from the compiled-component cache {}",
            cache.dir().display()
        ),
        (Some(cache), _) => format!(
            "compiled (it was not in the compiled-component cache {}; this run stored it there unless a warning above says otherwise)",
            cache.dir().display()
        ),
        (None, _) => "compiled (no compiled-component cache folder is known: pass --cache-dir or set TOKWATT_CACHE_DIR)".to_owned(),
    };
    println!("  started in {:.3} s: {how}", start.as_secs_f64());
    println!(
        "  p50 {:.2} us   p90 {:.2} us   p99 {:.2} us   max {:.2} us",
        q(&mut times, 0.5),
        q(&mut times, 0.9),
        q(&mut times, 0.99),
        q(&mut times, 1.0)
    );
    Ok(())
}
