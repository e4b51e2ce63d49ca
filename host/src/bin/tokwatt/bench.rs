//! `tokwatt bench`: its subcommands' arguments and their dispatch. The measurements live
//! beside it: the agent itself (`decide`, `agent-cpu`) in `bench/agent.rs`, the CUDA engine
//! on a real GPU (`workload`, `prefill`, `serving`) in `bench/gpu.rs`, the simulator's speed
//! (`sim-run`) in `bench/sim_run.rs`, `tokwatt ab`'s error rates in `ab_studies.rs` and the
//! API's cost to the tick (`serve-api`) in `bench_serve.rs`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};

mod agent;
mod gpu;
mod sim_run;

use crate::plugin_places::PluginPlaces;
use agent::{agent_cpu_targets, bench_agent_cpu, bench_decide};
use gpu::{StepGrid, bench_prefill, bench_serving, bench_serving_steps, bench_workload};
use tokwatt_bench::agent_cpu::{AgentCpuRequest, AgentCpuTarget};
use tokwatt_nvml::SamplerConfig;
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
    /// The serving loop's steps on a real GPU, one composition at a time: decoding rows at a
    /// context beside prompt chunks, each step waited for as the serving thread waits. Step
    /// time, watts (NVML energy counter) and SM clock per case: the table a profile's
    /// `[serving]` constants are fitted to. Changes no GPU setting.
    ServingSteps {
        /// CUDA device / NVML index.
        #[arg(long, default_value_t = 0)]
        gpu: u32,
        /// Model preset (llama-3-8b, llama-3.2-1b) or a model shape file.
        #[arg(long, default_value = "llama-3-8b")]
        model: String,
        /// Measured seconds per case (after three warm-up steps).
        #[arg(long, default_value_t = 1.0)]
        seconds: f64,
        /// The compositions: `standard` (decoding rows to 128 at contexts to 2,047, prompt
        /// chunks to 4 x 2,048) or `long` (rows to 64 at contexts 3,072 and 4,095, prompts
        /// of 3,072 whole, in halves and late chunks).
        #[arg(long, value_enum, default_value_t = StepGrid::Standard)]
        grid: StepGrid,
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
        /// Write every step (its decoding rows and prompt chunks, when the loop began it,
        /// when the engine began and ended it) as JSON lines here.
        #[arg(long)]
        steps: Option<PathBuf>,
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
            steps,
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
            steps,
        }),
        BenchCommand::Prefill {
            gpu,
            model,
            cases,
            attention,
            seconds,
            json,
        } => bench_prefill(gpu, &model, cases, attention, seconds, json),
        BenchCommand::ServingSteps {
            gpu,
            model,
            seconds,
            grid,
            json,
        } => bench_serving_steps(gpu, &model, seconds, grid, json),
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

/// What `tokwatt bench serving` was asked. (Read by the CUDA build only: without the
/// `cuda` feature the command is refused with the fix before any field is used.)
#[derive(Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
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
    steps: Option<PathBuf>,
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
