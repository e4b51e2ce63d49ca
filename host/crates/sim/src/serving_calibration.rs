//! Calibration checks of the serving step: a profile's `[serving]` constants against the
//! serving loop's steps measured on its GPU (`tokwatt bench serving-steps`, copied into
//! `host/profiles/calibration/`, so the tests run on a clean checkout).
//!
//! `cargo test -p tokwatt-sim --lib serving_calibration -- --nocapture` prints the tables;
//! `cargo test -p tokwatt-sim --lib serving_calibration::fit -- --ignored --nocapture` re-runs
//! the fit behind a profile's `[serving]` constants.
#![allow(clippy::unwrap_used)] // test-only module: tests may unwrap

use super::model::{DecodeCost, DecodeModel, ModelShape, StepLoad};
use super::profile::{GpuProfile, ServingConstants};

/// One measured serving step (a row of `tokwatt bench serving-steps`).
#[derive(Debug, Clone, Copy)]
struct StepRow {
    decodes: u32,
    decode_context: u32,
    chunks: u32,
    chunk_len: u32,
    chunk_start: u32,
    step_ms: f64,
    watts: f64,
    sm_mhz: f64,
}

impl StepRow {
    /// The step as the simulator's model sees it: each decoding row attends to its cached
    /// positions and itself; each prompt token to the prompt before it and itself.
    fn load(&self) -> StepLoad {
        let (chunks, len, start) = (
            f64::from(self.chunks),
            f64::from(self.chunk_len),
            f64::from(self.chunk_start),
        );
        StepLoad {
            decode: self.decodes,
            decode_positions: f64::from(self.decodes) * f64::from(self.decode_context + 1),
            prefill: chunks * len,
            prefill_positions: chunks * (len * start + len * (len + 1.0) / 2.0),
        }
    }

    fn label(&self) -> String {
        format!(
            "{:>3} @ {:>4} + {} x {:>4} @ {:>4}",
            self.decodes, self.decode_context, self.chunks, self.chunk_len, self.chunk_start
        )
    }
}

/// (profile, model preset, CSV text) of the measured serving-step tables.
const TABLES: [(&str, &str, &str); 1] = [(
    "h100",
    "llama-3-8b",
    include_str!("../../../profiles/calibration/h100_serving_steps_llama-3-8b.csv"),
)];

fn parse(text: &str) -> Vec<StepRow> {
    text.lines()
        .filter(|line| {
            !line.starts_with('#') && !line.starts_with("decodes") && !line.trim().is_empty()
        })
        .map(|line| {
            let f: Vec<f64> = line.split(',').map(|f| f.trim().parse().unwrap()).collect();
            assert_eq!(f.len(), 8, "row {line}");
            StepRow {
                decodes: f[0] as u32,
                decode_context: f[1] as u32,
                chunks: f[2] as u32,
                chunk_len: f[3] as u32,
                chunk_start: f[4] as u32,
                step_ms: f[5],
                watts: f[6],
                sm_mhz: f[7],
            }
        })
        .collect()
}

/// The model's step time (ms) and power (W) for each row, at the row's measured SM clock.
fn predictions(profile: &GpuProfile, preset: &str, rows: &[StepRow]) -> Vec<(f64, f64)> {
    let shape = ModelShape::preset(preset).unwrap();
    // The context only sizes the closed-loop decode's KV term, which a load does not use.
    let model = DecodeModel::new(profile, &DecodeCost::new(&shape, 1024));
    let mem = f64::from(profile.mem_max_mhz());
    rows.iter()
        .map(|row| {
            let point = model.point_load(&row.load(), row.sm_mhz, mem);
            (point.step_s * 1e3, point.power_w)
        })
        .collect()
}

/// Relative errors (step time, power) of every row.
fn errors(profile: &GpuProfile, preset: &str, rows: &[StepRow]) -> Vec<[f64; 2]> {
    predictions(profile, preset, rows)
        .iter()
        .zip(rows)
        .map(|(&(ms, w), row)| [ms / row.step_ms - 1.0, w / row.watts - 1.0])
        .collect()
}

fn print_table(title: &str, profile: &GpuProfile, preset: &str, rows: &[StepRow]) {
    println!("\n{title}");
    println!(
        "{:<30} {:>9} {:>9} {:>7} {:>7} {:>7} {:>7}",
        "decodes @ ctx + prompt", "ms", "sim ms", "err", "W", "sim W", "err"
    );
    for ((row, (ms, w)), e) in rows
        .iter()
        .zip(predictions(profile, preset, rows))
        .zip(errors(profile, preset, rows))
    {
        println!(
            "{:<30} {:>9.3} {:>9.3} {:>+6.1}% {:>7.1} {:>7.1} {:>+6.1}%",
            row.label(),
            row.step_ms,
            ms,
            100.0 * e[0],
            row.watts,
            w,
            100.0 * e[1]
        );
    }
}

/// Share of rows within `limit` on step time and on power.
fn within(errors: &[[f64; 2]], limit: f64) -> [f64; 2] {
    let n = errors.len() as f64;
    [0, 1].map(|i| errors.iter().filter(|e| e[i].abs() <= limit).count() as f64 / n)
}

#[test]
fn every_measured_serving_table_is_reproduced_by_its_profile() {
    for (id, preset, text) in TABLES {
        let profile = GpuProfile::load(id).unwrap();
        assert!(
            profile.serving.is_some(),
            "{id} has a measured serving table but no [serving] constants"
        );
        let rows = parse(text);
        assert!(rows.len() >= 50, "{id}: {} rows", rows.len());
        print_table(
            &format!("{id} serving steps, {preset}"),
            &profile,
            preset,
            &rows,
        );
        let errs = errors(&profile, preset, &rows);
        let worst = |i: usize| errs.iter().map(|e| e[i].abs()).fold(0.0, f64::max);
        let share = within(&errs, 0.10);
        println!(
            "{id}: within 10 %: {:.0} % of step times, {:.0} % of powers; worst {:.1} % / {:.1} %",
            100.0 * share[0],
            100.0 * share[1],
            100.0 * worst(0),
            100.0 * worst(1)
        );
        assert!(share[0] >= 0.9 && worst(0) <= 0.25, "{id}: step times");
        assert!(share[1] >= 0.9 && worst(1) <= 0.15, "{id}: powers");
    }
}

#[test]
fn without_serving_constants_a_serving_step_is_the_forward_tables() {
    let mut profile = GpuProfile::load("h100").unwrap();
    let rows = parse(TABLES[0].2);
    let fitted = predictions(&profile, "llama-3-8b", &rows);
    profile.serving = None;
    let forward = predictions(&profile, "llama-3-8b", &rows);
    // The serving loop has no CUDA graph: every step costs more than the forward tables'.
    assert!(fitted.iter().zip(&forward).all(|(s, f)| s.0 > f.0));
}

// ---- The fit behind a profile's [serving] (run by hand) ----

fn with_params(base: &GpuProfile, p: &[f64]) -> GpuProfile {
    let mut profile = base.clone();
    profile.serving = Some(ServingConstants {
        overhead_per_layer_us: p[0],
        kv_bandwidth_tbs: p[1],
        tensor_tflops: p[2],
        attention_efficiency: p[3],
    });
    profile
}

/// Squared log errors of the step times, with errors beyond 8 % pushed back in.
fn loss(base: &GpuProfile, preset: &str, rows: &[StepRow], p: &[f64]) -> f64 {
    if p.iter().any(|&v| !(v.is_finite() && v > 0.0)) || p[3] > 1.0 {
        return f64::MAX;
    }
    let profile = with_params(base, p);
    predictions(&profile, preset, rows)
        .iter()
        .zip(rows)
        .map(|(&(ms, _), row)| {
            let e = (ms / row.step_ms).ln();
            e * e + 100.0 * (e.abs() - 0.08).max(0.0).powi(2)
        })
        .sum()
}

#[test]
#[ignore = "fit helper: prints the fitted [serving] constants of each measured table"]
fn fit() {
    for (id, preset, text) in TABLES {
        let base = GpuProfile::load(id).unwrap();
        let rows = parse(text);
        // Neutral start: the decode table's overhead doubled, its KV bandwidth halved, the
        // prefill table's tensor rate and attention efficiency.
        let pre = base.prefill();
        let mut best = vec![
            2.0 * base.decode.overhead_per_layer_us,
            0.5 * base.decode.kv_bandwidth_tbs,
            pre.tensor_tflops,
            pre.attention_efficiency,
        ];
        let mut best_loss = loss(&base, preset, &rows, &best);
        for _ in 0..4 {
            let (params, value) = super::calibration::nelder_mead(
                |x| loss(&base, preset, &rows, x),
                best.clone(),
                2000,
            );
            if value < best_loss {
                (best, best_loss) = (params, value);
            }
        }
        println!("\n[serving] for {id} (loss {best_loss:.5})");
        let names = [
            "overhead_per_layer_us",
            "kv_bandwidth_tbs",
            "tensor_tflops",
            "attention_efficiency",
        ];
        for (name, value) in names.iter().zip(&best) {
            println!("{name} = {value:.4}");
        }
        print_table(
            &format!("fitted: {id} serving steps"),
            &with_params(&base, &best),
            preset,
            &rows,
        );
    }
}
