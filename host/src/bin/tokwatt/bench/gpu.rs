//! `tokwatt bench workload`, `prefill` and `serving`: the CUDA engine measured on a real
//! GPU (tokens/s, watts and tokens per joule from the NVML energy counter); without the
//! `cuda` feature each says how to rebuild.

use std::path::PathBuf;
#[cfg(feature = "cuda")]
use std::time::Duration;

use anyhow::Result;
#[cfg(feature = "cuda")]
use anyhow::{Context, bail};

use super::ServingBench;

#[cfg(not(feature = "cuda"))]
const WITHOUT_CUDA: &str = "this tokwatt was built without its CUDA workload (the `cuda` feature): rebuild with `cargo build -p tokwatt --features cuda` (on by default)";

/// Writes `rows` as JSON lines to `path`.
#[cfg(feature = "cuda")]
fn write_json_lines<T: serde::Serialize>(path: &std::path::Path, rows: &[T]) -> Result<()> {
    let lines: Vec<String> = rows
        .iter()
        .map(serde_json::to_string)
        .collect::<Result<_, _>>()?;
    std::fs::write(path, lines.join("\n") + "\n")
        .with_context(|| format!("writing {}", path.display()))
}
#[cfg(feature = "cuda")]
use tokwatt_nvml::SamplerConfig;

#[cfg(not(feature = "cuda"))]
pub(super) fn bench_serving(_bench: ServingBench) -> Result<()> {
    anyhow::bail!(WITHOUT_CUDA)
}

#[cfg(feature = "cuda")]
pub(super) fn bench_serving(bench: ServingBench) -> Result<()> {
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
        // A second of steps is a few hundred; read every second.
        step_log: bench.steps.is_some().then_some(100_000),
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
    let (mut steps, mut steps_dropped) = (Vec::new(), 0u64);
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
        let (kept, lost) = serve.take_steps();
        steps.extend(kept);
        steps_dropped += lost;
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
        "steps_logged": steps.len(),
        "steps_dropped": steps_dropped,
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
        write_json_lines(path, &records)?;
    }
    if let Some(path) = &bench.steps {
        write_json_lines(path, &steps)?;
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub(super) fn bench_prefill(
    _gpu: u32,
    _model: &str,
    _cases: Vec<(u32, u32)>,
    _attention: Vec<String>,
    _seconds: f64,
    _json: Option<PathBuf>,
) -> Result<()> {
    anyhow::bail!(WITHOUT_CUDA)
}

#[cfg(feature = "cuda")]
pub(super) fn bench_prefill(
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
        },
    )?;
    println!("{} cases measured", rows.len());
    if let Some(path) = json {
        write_json_lines(&path, &rows)?;
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub(super) fn bench_workload(
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
pub(super) fn bench_workload(
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

/// `tokwatt bench serving-steps --grid`: which step compositions it measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum StepGrid {
    Standard,
    Long,
}

#[cfg(not(feature = "cuda"))]
pub(super) fn bench_serving_steps(
    _gpu: u32,
    _model: &str,
    _seconds: f64,
    _grid: StepGrid,
    _json: Option<PathBuf>,
) -> Result<()> {
    anyhow::bail!(WITHOUT_CUDA)
}

#[cfg(feature = "cuda")]
pub(super) fn bench_serving_steps(
    gpu: u32,
    model: &str,
    seconds: f64,
    grid: StepGrid,
    json: Option<PathBuf>,
) -> Result<()> {
    use tokwatt_core::telemetry::Telemetry;
    let shape = tokwatt_cuda::ModelShape::load(model)?;
    let cases = match grid {
        StepGrid::Standard => tokwatt_cuda::ServingStepGrid::Standard,
        StepGrid::Long => tokwatt_cuda::ServingStepGrid::Long,
    }
    .cases();
    let system = tokwatt_nvml::NvmlSystem::open(Some(&[gpu]))?;
    let mut telemetry = system
        .telemetry(SamplerConfig::everything_every(Duration::from_millis(50)))
        .context("starting NVML telemetry")?;
    // A window is read before and after each case: the second one's SM clock is the case's.
    let mut read = || match telemetry.read_window(0) {
        Ok(window) => tokwatt_cuda::GpuReading {
            energy_counter_j: Some(window.energy_counter_j),
            sm_mhz: (window.samples > 0 && window.sm_clock_mhz > 0).then_some(window.sm_clock_mhz),
        },
        Err(_) => tokwatt_cuda::GpuReading::default(),
    };
    println!(
        "tokwatt bench serving-steps: {model}, GPU {gpu} ({}), {grid:?} grid, {} cases of {seconds} s; energy from the NVML counter",
        system.devices().first().map_or("?", |d| d.name.as_str()),
        cases.len()
    );
    let rows = tokwatt_cuda::bench_serving_steps(
        &shape,
        &cases,
        seconds,
        gpu,
        &mut read,
        &mut |row| {
            let c = &row.case;
            eprintln!(
                "decodes {:>3} @ {:>4}  prompt {} x {:>4} @ {:>4}: {:>8.3} ms/step (p50 {:>8.3})  {:>6.1} W  {:>5} MHz",
                c.decodes,
                c.decode_context,
                c.chunks,
                c.chunk_len,
                c.chunk_start,
                row.step_ms,
                row.step_ms_p50,
                row.watts.unwrap_or(f64::NAN),
                row.sm_mhz.map_or_else(|| "?".to_owned(), |m| m.to_string()),
            );
        },
    )?;
    println!("{} cases measured", rows.len());
    if let Some(path) = json {
        write_json_lines(&path, &rows)?;
    }
    Ok(())
}
