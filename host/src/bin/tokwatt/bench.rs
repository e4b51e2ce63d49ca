//! `tokwatt bench`: measurements of the agent itself (`decide`) and of the CUDA decode
//! workload on a real GPU (`workload`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};

use tokwatt::agent;
use tokwatt::nvml::{NvmlSystem, SamplerConfig};

#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
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

pub fn bench(what: BenchCommand) -> Result<()> {
    match what {
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
    }
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
        .telemetry(SamplerConfig::default())
        .context("starting NVML telemetry")?;
    let shape = tokwatt::cuda::ModelShape::load(model)?;
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
