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
            decode_position_max: if self.decodes > 0 {
                f64::from(self.decode_context + 1)
            } else {
                0.0
            },
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
    super::calibration::csv_rows(text, "decodes", 8)
        .into_iter()
        .map(|f| StepRow {
            decodes: f[0] as u32,
            decode_context: f[1] as u32,
            chunks: f[2] as u32,
            chunk_len: f[3] as u32,
            chunk_start: f[4] as u32,
            step_ms: f[5],
            watts: f[6],
            sm_mhz: f[7],
        })
        .collect()
}

/// What the model gives for one row: step time (ms), power (W) and SM clock (MHz).
#[derive(Debug, Clone, Copy)]
struct Predicted {
    step_ms: f64,
    watts: f64,
    sm_mhz: f64,
}

fn model_of(profile: &GpuProfile, preset: &str) -> DecodeModel {
    let shape = ModelShape::preset(preset).unwrap();
    // The context only sizes the closed-loop decode's KV term, which a load does not use.
    DecodeModel::new(profile, &DecodeCost::new(&shape, 1024))
}

/// The model's step for each row as the simulator runs it: at the clock its firmware
/// picks under the default power cap (the measured steps ran at the defaults).
fn predictions(profile: &GpuProfile, preset: &str, rows: &[StepRow]) -> Vec<Predicted> {
    let model = model_of(profile, preset);
    let mem = f64::from(profile.mem_max_mhz());
    rows.iter()
        .map(|row| {
            let state =
                model.steady_state_load(&row.load(), profile.power_cap.default_w, u32::MAX, mem);
            Predicted {
                step_ms: state.step_s * 1e3,
                watts: state.power_w,
                sm_mhz: f64::from(state.sm_mhz),
            }
        })
        .collect()
}

/// Relative errors (step time, power, SM clock) of every row.
fn errors(profile: &GpuProfile, preset: &str, rows: &[StepRow]) -> Vec<[f64; 3]> {
    predictions(profile, preset, rows)
        .iter()
        .zip(rows)
        .map(|(p, row)| {
            [
                p.step_ms / row.step_ms - 1.0,
                p.watts / row.watts - 1.0,
                p.sm_mhz / row.sm_mhz - 1.0,
            ]
        })
        .collect()
}

fn print_table(title: &str, profile: &GpuProfile, preset: &str, rows: &[StepRow]) {
    println!("\n{title}");
    println!(
        "{:<30} {:>9} {:>9} {:>7} {:>7} {:>7} {:>7} {:>6} {:>6}",
        "decodes @ ctx + prompt", "ms", "sim ms", "err", "W", "sim W", "err", "MHz", "sim"
    );
    for ((row, p), e) in rows
        .iter()
        .zip(predictions(profile, preset, rows))
        .zip(errors(profile, preset, rows))
    {
        println!(
            "{:<30} {:>9.3} {:>9.3} {:>+6.1}% {:>7.1} {:>7.1} {:>+6.1}% {:>6.0} {:>6.0}",
            row.label(),
            row.step_ms,
            p.step_ms,
            100.0 * e[0],
            row.watts,
            p.watts,
            100.0 * e[1],
            row.sm_mhz,
            p.sm_mhz
        );
    }
}

/// Share of rows within `limit` on step time and on power.
fn within(errors: &[[f64; 3]], limit: f64) -> [f64; 2] {
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
        // The worst powers are single decoding rows at contexts of 3,072 and more: the GPU
        // waits on one row's long attention at ~340 W, where the model keeps ~420 W.
        assert!(share[1] >= 0.9 && worst(1) <= 0.25, "{id}: powers");
    }
}

#[test]
fn the_forward_tables_alone_miss_the_serving_loop() {
    // Without [serving], a serving step is costed from the closed-loop decode (CUDA graphs,
    // its own attention kernel) and the whole-prompt prefill: the measured steps are not.
    let mut profile = GpuProfile::load("h100").unwrap();
    let rows = parse(TABLES[0].2);
    let fitted = within(&errors(&profile, "llama-3-8b", &rows), 0.10)[0];
    profile.serving = None;
    let forward_errors = errors(&profile, "llama-3-8b", &rows);
    let forward = within(&forward_errors, 0.10)[0];
    let worst = forward_errors
        .iter()
        .map(|e| e[0].abs())
        .fold(0.0, f64::max);
    println!(
        "step times within 10 %: {fitted:.2} with [serving], {forward:.2} without (worst {worst:.2})"
    );
    assert!(forward < 0.8 && forward < fitted && worst > 0.25);
}

// ---- The fit behind a profile's [serving] (run by hand) ----

fn with_params(base: &GpuProfile, p: &[f64]) -> GpuProfile {
    let mut profile = base.clone();
    profile.serving = Some(ServingConstants {
        overhead_per_layer_us: p[0],
        kv_bandwidth_tbs: p[1],
        tensor_tflops: p[2],
        attention_efficiency: p[3],
        core_activity: p[4],
        row_attention_ns_per_position: p[5],
    });
    profile
}

/// Squared log errors of step time and power (the clock at half weight), each at the clock
/// the model's firmware solves for continuously (a smooth loss), errors beyond 8 % pushed
/// back in.
fn loss(base: &GpuProfile, preset: &str, rows: &[StepRow], p: &[f64]) -> f64 {
    if p.iter().any(|&v| !(v.is_finite() && v >= 0.0)) || p[3] > 1.0 || p[4] > 2.0 {
        return f64::MAX;
    }
    let profile = with_params(base, p);
    let model = model_of(&profile, preset);
    let mem = f64::from(profile.mem_max_mhz());
    let cap = profile.power_cap.default_w;
    let top = f64::from(profile.sm_max_mhz());
    rows.iter()
        .map(|row| {
            let load = row.load();
            let power = |f: f64| model.point_load(&load, f, mem).power_w;
            let lowest = f64::from(profile.clocks.sm_min_mhz.unwrap_or(345));
            let f = super::calibration::clock_under_cap(power, cap, lowest, top);
            let point = model.point_load(&load, f, mem);
            let errs = [
                (point.step_s * 1e3 / row.step_ms).ln(),
                (point.power_w / row.watts).ln(),
                0.5 * (f / row.sm_mhz).ln(),
            ];
            errs.iter()
                .map(|e| e * e + 100.0 * (e.abs() - 0.08).max(0.0).powi(2))
                .sum::<f64>()
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
        // prefill table's tensor rate, attention efficiency and core activity.
        let pre = base.prefill();
        let mut best = vec![
            2.0 * base.decode.overhead_per_layer_us,
            0.5 * base.decode.kv_bandwidth_tbs,
            pre.tensor_tflops,
            pre.attention_efficiency,
            pre.core_activity,
            // Where a row's attention is as slow as the bandwidth gives 8 rows.
            8.0 * 131_072.0 / (0.5 * base.decode.kv_bandwidth_tbs * 1e3),
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
            "core_activity",
            "row_attention_ns_per_position",
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

// ---- A served run's steps against the model (run by hand) ----

/// `TOKWATT_STEP_LOG=steps.jsonl` (from `tokwatt bench serving --steps`): each logged step
/// of the real serving loop beside the model's time for the same load, at the clock its
/// firmware picks under the default cap, grouped by what the step held. With
/// `TOKWATT_CLOCK_LOG=clock.csv` (`clock-sampler.py` beside the same run) also the SM clock
/// sampled during each step against the model's, and the model's time at the sampled clock.
#[test]
#[ignore = "analysis helper: needs TOKWATT_STEP_LOG (and TOKWATT_STEP_PROFILE, default h100)"]
fn step_log_against_the_model() {
    let path = std::env::var("TOKWATT_STEP_LOG").expect("set TOKWATT_STEP_LOG");
    let id = std::env::var("TOKWATT_STEP_PROFILE").unwrap_or_else(|_| "h100".into());
    let profile = GpuProfile::load(&id).unwrap();
    let model = model_of(&profile, "llama-3-8b");
    let mem = f64::from(profile.mem_max_mhz());
    // (t_s, sm_mhz) samples, in time order.
    let clock: Vec<(f64, f64)> = std::env::var("TOKWATT_CLOCK_LOG")
        .map(|p| {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .skip(1)
                .filter_map(|l| {
                    let f: Vec<&str> = l.split(',').collect();
                    Some((f.first()?.parse().ok()?, f.get(1)?.parse().ok()?))
                })
                .filter(|&(_, mhz): &(f64, f64)| mhz > 0.0)
                .collect()
        })
        .unwrap_or_default();
    // The mean of the samples taken inside [a, b] (the nearest one where none was).
    let sampled = |a: f64, b: f64| -> Option<f64> {
        if clock.is_empty() {
            return None;
        }
        let i = clock.partition_point(|s| s.0 < a);
        let j = clock.partition_point(|s| s.0 <= b);
        if j > i {
            return Some(clock[i..j].iter().map(|s| s.1).sum::<f64>() / (j - i) as f64);
        }
        Some(clock[i.min(clock.len() - 1)].1)
    };
    // Per group: measured ms, model ms, model MHz, sampled MHz, model ms at the sampled MHz.
    let mut groups: std::collections::BTreeMap<String, Vec<[f64; 5]>> = Default::default();
    for line in std::fs::read_to_string(&path).unwrap().lines() {
        let Ok(step) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let field = |name: &str| step[name].as_f64().unwrap();
        let load = StepLoad {
            decode: field("decodes") as u32,
            decode_positions: field("decode_positions"),
            decode_position_max: field("decode_position_max"),
            prefill: field("prompt_tokens"),
            prefill_positions: field("prompt_positions"),
        };
        let (a, b) = (field("engine_start_s"), field("engine_end_s"));
        let measured_ms = (b - a) * 1e3;
        let state = model.steady_state_load(&load, profile.power_cap.default_w, u32::MAX, mem);
        let seen = sampled(a, b).unwrap_or(f64::NAN);
        let at_seen = if seen.is_finite() {
            model.point_load(&load, seen, mem).step_s * 1e3
        } else {
            f64::NAN
        };
        let rows = load.decode / 16 * 16;
        let prompt = match load.prefill as u32 {
            0 => "no prompt".to_owned(),
            p if p >= 2048 => format!("prompt {:>4}+", p / 2048 * 2048),
            p => format!("prompt {:>4}+", p / 512 * 512),
        };
        groups
            .entry(format!("decodes {rows:>3}+, {prompt}"))
            .or_default()
            .push([
                measured_ms,
                state.step_s * 1e3,
                f64::from(state.sm_mhz),
                seen,
                at_seen,
            ]);
    }
    println!(
        "{:<32} {:>6} {:>9} {:>9} {:>8} {:>8} {:>8} {:>10} {:>8}",
        "steps",
        "count",
        "ms",
        "model ms",
        "model/ms",
        "MHz mod",
        "MHz seen",
        "ms at seen",
        "ratio"
    );
    let mut all = [0.0; 3];
    for (group, steps) in &groups {
        let n = steps.len() as f64;
        let sum = |i: usize| steps.iter().map(|s| s[i]).sum::<f64>();
        all[0] += sum(0);
        all[1] += sum(1);
        all[2] += sum(4);
        println!(
            "{group:<32} {:>6} {:>9.3} {:>9.3} {:>8.3} {:>8.0} {:>8.0} {:>10.3} {:>8.3}",
            steps.len(),
            sum(0) / n,
            sum(1) / n,
            sum(1) / sum(0),
            sum(2) / n,
            sum(3) / n,
            sum(4) / n,
            sum(4) / sum(0)
        );
    }
    println!(
        "all steps: model/measured busy time {:.3} (at the sampled clock {:.3})",
        all[1] / all[0],
        all[2] / all[0]
    );
}
