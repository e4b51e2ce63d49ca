//! The workload benchmark behind `tokwatt bench workload`: decode throughput, step time and
//! energy per batch size, on one engine whose buffers are sized for the largest batch.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::device::AttentionImpl;
use super::engine::{Engine, EngineOptions, StepDone};
use super::error::CudaError;
use super::plan::MAX_BATCH;
use super::shape::ModelShape;
use tokwatt_core::quantile::nearest_rank;

/// What to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchConfig {
    pub model: ModelShape,
    pub context: u32,
    pub batches: Vec<u32>,
    /// Measured time per batch size, after the warm-up.
    pub seconds_per_batch: f64,
    /// Stepping before each measurement, so that clocks, power and caches settle.
    pub warmup_seconds: f64,
    /// CUDA device ordinal.
    pub device: u32,
    pub engine: EngineOptions,
}

impl BenchConfig {
    pub fn new(
        model: ModelShape,
        context: u32,
        batches: Vec<u32>,
        seconds_per_batch: f64,
    ) -> BenchConfig {
        BenchConfig {
            model,
            context,
            batches,
            seconds_per_batch,
            warmup_seconds: 1.0,
            device: 0,
            engine: EngineOptions::default(),
        }
    }
}

/// One batch size's measurement.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchRow {
    pub batch: u32,
    /// Matmul path the step graph uses: `gemv` or `cublas`.
    pub path: &'static str,
    /// Attention's arithmetic: `cuda-cores`, `tensor-cores` or `tensor-scores`.
    pub attention: &'static str,
    pub attention_splits: u32,
    /// Median replay time of each step variant timed when the graph was built, ms.
    pub candidates_ms: Vec<(String, f64)>,
    pub steps: u64,
    pub seconds: f64,
    pub tokens_per_s: f64,
    /// Wall time per step over the measurement (seconds / steps), ms.
    pub step_ms: f64,
    /// GPU time per step from CUDA events, median and 99th percentile, ms.
    pub step_gpu_ms_p50: f64,
    pub step_gpu_ms_p99: f64,
    /// Weights plus KV cache read per step over the wall time per step, TB/s.
    pub read_tb_per_s: f64,
    /// Average power from the energy counter; `None` without one.
    pub watts: Option<f64>,
    pub tokens_per_j: Option<f64>,
}

/// Measures each batch size for `seconds_per_batch` (after a warm-up) on GPU 0. `energy`
/// returns a joules counter (e.g. NVML's total energy), or `None` when there is none.
pub fn bench_batches(
    model: &ModelShape,
    context: u32,
    batches: &[u32],
    seconds_per_batch: f64,
    energy: &mut dyn FnMut() -> Option<f64>,
) -> Result<Vec<BenchRow>, CudaError> {
    let config = BenchConfig::new(model.clone(), context, batches.to_vec(), seconds_per_batch);
    bench_with(&config, energy, &mut |_| {})
}

/// [`bench_batches`] with every option, handing each row to `on_row` as soon as it is measured.
pub fn bench_with(
    config: &BenchConfig,
    energy: &mut dyn FnMut() -> Option<f64>,
    on_row: &mut dyn FnMut(&BenchRow),
) -> Result<Vec<BenchRow>, CudaError> {
    let Some(&batch_max) = config.batches.iter().max() else {
        return Err(CudaError::Config("no batch sizes to measure".into()));
    };
    if let Some(&bad) = config
        .batches
        .iter()
        .find(|&&b| !(1..=MAX_BATCH).contains(&b))
    {
        return Err(CudaError::Config(format!(
            "batch size {bad} is out of range: use 1 to {MAX_BATCH}"
        )));
    }
    for (what, value) in [
        ("seconds per batch", config.seconds_per_batch),
        ("warm-up seconds", config.warmup_seconds),
    ] {
        // A day per batch is past any benchmark (and `Duration` ends near 6e11 years).
        if !(value.is_finite() && (0.0..=86_400.0).contains(&value)) {
            return Err(CudaError::Config(format!(
                "{what} must be between 0 and 86400 (a day), not {value}"
            )));
        }
    }
    let mut engine = Engine::new(
        &config.model,
        config.context,
        batch_max,
        config.device,
        config.engine,
    )?;
    let mut rows = Vec::with_capacity(config.batches.len());
    for &batch in &config.batches {
        let info = engine.prepare(batch)?.clone();
        run_for(
            &mut engine,
            batch,
            Duration::from_secs_f64(config.warmup_seconds),
        )?;
        let energy_start = energy();
        let started = Instant::now();
        let steps = run_for(
            &mut engine,
            batch,
            Duration::from_secs_f64(config.seconds_per_batch),
        )?;
        let seconds = started.elapsed().as_secs_f64();
        let energy_end = energy();

        let count = steps.len() as u64;
        let mut gpu_ms: Vec<f64> = steps.iter().map(|s| s.gpu_ms).collect();
        let step_s = seconds / count.max(1) as f64;
        let tokens = count * u64::from(batch);
        let watts = match (energy_start, energy_end) {
            (Some(start), Some(end)) if end >= start && seconds > 0.0 => {
                Some((end - start) / seconds)
            }
            _ => None,
        };
        let bytes = config.model.weight_bytes_per_step()
            + config.model.kv_cache_bytes(batch, config.context);
        let row = BenchRow {
            batch,
            path: info.variant.path.name(),
            attention: info.variant.attention.name(),
            attention_splits: info.attention.splits,
            candidates_ms: info
                .candidates_ms
                .iter()
                .map(|(variant, ms)| (variant.label(), *ms))
                .collect(),
            steps: count,
            seconds,
            tokens_per_s: tokens as f64 / seconds,
            step_ms: step_s * 1e3,
            step_gpu_ms_p50: nearest_rank(&mut gpu_ms, 0.50).unwrap_or(f64::NAN),
            step_gpu_ms_p99: nearest_rank(&mut gpu_ms, 0.99).unwrap_or(f64::NAN),
            read_tb_per_s: bytes as f64 / step_s / 1e12,
            watts,
            tokens_per_j: watts.map(|w| tokens as f64 / (w * seconds)),
        };
        on_row(&row);
        rows.push(row);
    }
    Ok(rows)
}

/// Steps `batch` for at least `duration` (and at least three steps), two steps in flight, and
/// returns the finished steps once all have completed.
fn run_for(
    engine: &mut Engine,
    batch: u32,
    duration: Duration,
) -> Result<Vec<StepDone>, CudaError> {
    let started = Instant::now();
    let mut done = Vec::new();
    let mut launched = 0u64;
    while launched < 3 || started.elapsed() < duration {
        engine.launch_step(batch)?;
        launched += 1;
        while engine.in_flight() >= 2 {
            done.extend(engine.wait_oldest()?);
        }
    }
    done.extend(engine.drain()?);
    Ok(done)
}

/// A fixed-width table of rows, with the reference's tokens/s beside ours where given.
pub fn format_table(
    rows: &[BenchRow],
    reference_tokens_per_s: &dyn Fn(u32) -> Option<f64>,
) -> String {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::NOTHING);
    table.set_header([
        "batch",
        "variant",
        "splits",
        "tok/s",
        "ref tok/s",
        "ratio",
        "step ms",
        "gpu p50",
        "gpu p99",
        "TB/s",
        "W",
        "tok/J",
    ]);
    for r in rows {
        let reference = reference_tokens_per_s(r.batch);
        let na = || "-".to_owned();
        table.add_row([
            r.batch.to_string(),
            format!(
                "{}/{}",
                r.path,
                AttentionImpl::from_name(r.attention).map_or("?", AttentionImpl::short_name)
            ),
            r.attention_splits.to_string(),
            format!("{:.1}", r.tokens_per_s),
            reference.map_or_else(na, |t| format!("{t:.1}")),
            reference.map_or_else(na, |t| format!("{:.3}", r.tokens_per_s / t)),
            format!("{:.3}", r.step_ms),
            format!("{:.3}", r.step_gpu_ms_p50),
            format!("{:.3}", r.step_gpu_ms_p99),
            format!("{:.2}", r.read_tb_per_s),
            r.watts.map_or_else(na, |w| format!("{w:.0}")),
            r.tokens_per_j.map_or_else(na, |t| format!("{t:.2}")),
        ]);
    }
    // Right-align the figures.
    for index in 2..12 {
        if let Some(column) = table.column_mut(index) {
            column.set_cell_alignment(comfy_table::CellAlignment::Right);
        }
    }
    let text = table.to_string();
    text.lines()
        .map(str::trim_end)
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    fn row(batch: u32, tokens_per_s: f64) -> BenchRow {
        BenchRow {
            batch,
            path: "gemv",
            attention: "tensor-cores",
            attention_splits: 16,
            candidates_ms: vec![],
            steps: 100,
            seconds: 1.0,
            tokens_per_s,
            step_ms: 3.9,
            step_gpu_ms_p50: 3.8,
            step_gpu_ms_p99: 3.95,
            read_tb_per_s: 3.88,
            watts: Some(450.0),
            tokens_per_j: Some(0.57),
        }
    }

    #[test]
    fn the_table_puts_the_reference_beside_ours() {
        let table = format_table(&[row(1, 256.4), row(4, 900.0)], &|b| {
            (b == 1).then_some(204.0)
        });
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 3);
        let cells: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            &cells[..6],
            ["1", "gemv/tc", "16", "256.4", "204.0", "1.257"],
            "{}",
            lines[1]
        );
        assert!(lines[2].contains(" - "), "{}", lines[2]);
        assert!(lines[1].ends_with("0.57"), "{}", lines[1]);
        assert!(lines[0].split_whitespace().eq([
            "batch", "variant", "splits", "tok/s", "ref", "tok/s", "ratio", "step", "ms", "gpu",
            "p50", "gpu", "p99", "TB/s", "W", "tok/J"
        ]));
    }

    #[test]
    fn bad_requests_are_refused_before_any_gpu_work() {
        let model = ModelShape::preset("llama-3.2-1b").unwrap();
        let mut none = || None;
        let err = bench_batches(&model, 1024, &[], 1.0, &mut none)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no batch sizes"), "{err}");
        let err = bench_batches(&model, 1024, &[1, 0], 1.0, &mut none)
            .unwrap_err()
            .to_string();
        assert!(err.contains("batch size 0 is out of range"), "{err}");
        let err = bench_batches(&model, 1024, &[1], f64::NAN, &mut none)
            .unwrap_err()
            .to_string();
        assert!(err.contains("seconds per batch"), "{err}");
    }
}
