//! Calibration checks of the serving step: a profile's `[serving]` constants against the
//! serving loop's steps measured on its GPU (`tokwatt bench serving-steps`, copied into
//! `host/profiles/calibration/`, so the tests run on a clean checkout).
//!
//! `cargo test -p tokwatt-sim --lib serving_calibration -- --nocapture` prints the tables;
//! `cargo test -p tokwatt-sim --lib serving_calibration::fit -- --ignored --nocapture` re-runs
//! the fit behind a profile's `[serving]` constants.
//!
//! One file because it is test code over one set of measured step tables: the checks and
//! the fit behind `[serving]` read them through the same helpers.
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
        // The worst step time is 25.3 % since [serving] was fitted to served runs beside this
        // table (docs/measurements/h100-2026-12-07-prefill-saturation).
        assert!(share[0] >= 0.9 && worst(0) <= 0.26, "{id}: step times");
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
        gemm_ramp_tokens: p.get(6).copied().unwrap_or(0.0),
        gemm_power_exponent: p.get(7).copied().unwrap_or(0.0),
    });
    profile
}

/// The clock's weight in the fit's loss (`TOKWATT_FIT_CLOCK_WEIGHT`, default 1: as step time
/// and power). At 0.5 the h100 fit ran its largest steps 150 MHz above the GPU's clock and
/// made up the time by being faster at each clock; the simulator carries the clock into the
/// steps that follow, which then ran fast too.
fn clock_weight() -> f64 {
    std::env::var("TOKWATT_FIT_CLOCK_WEIGHT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.0)
}

/// Squared log errors of step time, power and clock ([`clock_weight`]), each at the clock
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
                clock_weight() * (f / row.sm_mhz).ln(),
            ];
            errs.iter()
                .map(|e| e * e + 100.0 * (e.abs() - 0.08).max(0.0).powi(2))
                .sum::<f64>()
        })
        .sum()
}

/// The step a line of the serving loop's step log describes.
fn logged_load(step: &serde_json::Value) -> StepLoad {
    let field = |name: &str| step[name].as_f64().unwrap();
    StepLoad {
        decode: field("decodes") as u32,
        decode_positions: field("decode_positions"),
        decode_position_max: field("decode_position_max"),
        prefill: field("prompt_tokens"),
        prefill_positions: field("prompt_positions"),
    }
}

/// Steps a served run logged (`tokwatt bench serving --steps`): each step's load and its
/// measured time, ms. Every step with prompt tokens, and every `thin`-th without.
fn served_steps(path: &str, thin: usize) -> Vec<(StepLoad, f64)> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut decode_only = 0;
    text.lines()
        .filter_map(|line| {
            let step: serde_json::Value = serde_json::from_str(line).ok()?;
            let field = |name: &str| step[name].as_f64().unwrap();
            let load = logged_load(&step);
            if load.prefill <= 0.0 {
                decode_only += 1;
                if decode_only % thin != 0 {
                    return None;
                }
            }
            Some((
                load,
                (field("engine_end_s") - field("engine_start_s")) * 1e3,
            ))
        })
        .collect()
}

/// Squared log errors of the model's time for served steps, at the clock its firmware picks
/// under the default cap (as the simulator runs them), each weighted by its measured time
/// and the whole scaled to `weight` rows of the table.
fn served_loss(
    base: &GpuProfile,
    preset: &str,
    steps: &[(StepLoad, f64)],
    p: &[f64],
    weight: f64,
) -> f64 {
    if steps.is_empty() {
        return 0.0;
    }
    let profile = with_params(base, p);
    let model = model_of(&profile, preset);
    let mem = f64::from(profile.mem_max_mhz());
    let cap = profile.power_cap.default_w;
    let top = f64::from(profile.sm_max_mhz());
    let lowest = f64::from(profile.clocks.sm_min_mhz.unwrap_or(345));
    let total: f64 = steps.iter().map(|s| s.1).sum();
    let sum: f64 = steps
        .iter()
        .map(|(load, ms)| {
            let f = super::calibration::clock_under_cap(
                |f| model.point_load(load, f, mem).power_w,
                cap,
                lowest,
                top,
            );
            let e = (model.point_load(load, f, mem).step_s * 1e3 / ms).ln();
            ms * (e * e + 100.0 * (e.abs() - 0.08).max(0.0).powi(2))
        })
        .sum();
    weight * sum / total
}

#[test]
#[ignore = "fit helper: prints the fitted [serving] constants of each measured table"]
fn fit() {
    // TOKWATT_FIT_STEP_LOGS=a.jsonl,b.jsonl: served runs' steps fitted beside the table.
    let served: Vec<(StepLoad, f64)> = std::env::var("TOKWATT_FIT_STEP_LOGS")
        .map(|paths| paths.split(',').flat_map(|p| served_steps(p, 50)).collect())
        .unwrap_or_default();
    let served_weight: f64 = std::env::var("TOKWATT_FIT_STEP_WEIGHT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100.0);
    println!("{} served steps beside the table", served.len());
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
            // A few hundred tokens: a chunk of 2,048 runs its GEMMs some 10 % slower a token.
            300.0,
            // A chunk of 2,048 draws some 20 % less at a clock than four of them.
            0.25,
        ];
        let total = |x: &[f64]| {
            loss(&base, preset, &rows, x) + served_loss(&base, preset, &served, x, served_weight)
        };
        // From the profile's own constants where it has them.
        if let Some(sv) = &base.serving {
            best = vec![
                sv.overhead_per_layer_us,
                sv.kv_bandwidth_tbs,
                sv.tensor_tflops,
                sv.attention_efficiency,
                sv.core_activity,
                sv.row_attention_ns_per_position,
                sv.gemm_ramp_tokens.max(100.0),
                sv.gemm_power_exponent.max(0.1),
            ];
        }
        // TOKWATT_FIT_START=a,b,c,...: a start of one's own (the fit's order).
        if let Ok(start) = std::env::var("TOKWATT_FIT_START") {
            best = start.split(',').map(|v| v.parse().unwrap()).collect();
        }
        let mut best_loss = total(&best);
        println!("start loss {best_loss:.5}");
        let rounds = std::env::var("TOKWATT_FIT_ROUNDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4);
        for _ in 0..rounds {
            let (params, value) = super::calibration::nelder_mead(total, best.clone(), 2000);
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
            "gemm_ramp_tokens",
            "gemm_power_exponent",
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
    let profile = overridden(GpuProfile::load(&id).unwrap());
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
        let load = logged_load(&step);
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

/// `profile` with its `[serving]` replaced by `TOKWATT_SERVING_PARAMS` (the fit's order,
/// comma-separated) where that is set: to try a fit before writing it into the profile.
pub(super) fn overridden(profile: GpuProfile) -> GpuProfile {
    match std::env::var("TOKWATT_SERVING_PARAMS") {
        Ok(params) => {
            let p: Vec<f64> = params.split(',').map(|v| v.parse().unwrap()).collect();
            with_params(&profile, &p)
        }
        Err(_) => profile,
    }
}

// ---- The prefill-saturation scenarios, simulated as `tokwatt run --sim` serves them ----

/// A scenario of `host/scenarios/` served by the simulated GPU of `profile` for `seconds`
/// (seed 1, its own batch size): tokens/s, watts, TTFT p50/p99 and TPOT p50/p99 (ms) of
/// the requests finished.
fn simulate(profile: GpuProfile, name: &str, seconds: f64) -> [f64; 6] {
    use std::time::Duration;
    use tokwatt_core::clock::Clock;
    let path = format!("{}/../../scenarios/{name}.toml", env!("CARGO_MANIFEST_DIR"));
    let scenario = super::Scenario::load(std::path::Path::new(&path)).unwrap();
    let clock = tokwatt_core::clock::VirtualClock::new();
    let sim = super::SimGpu::new(
        super::SimConfig {
            profile,
            scenario,
            gpus: 1,
            seed: 1,
            noise_seed: None,
        },
        clock.clone(),
    )
    .unwrap();
    let (mut workload, mut telemetry) = (sim.workload(), sim.telemetry());
    let mut finished = tokwatt_core::workload::FinishedRequests::default();
    let (mut tokens, mut joules) = (0.0, 0.0);
    for tick in 1..=(seconds as u64) {
        clock.sleep_until(Duration::from_secs(tick));
        tokens += workload.read_window(0).unwrap().tokens as f64;
        joules = telemetry.read_window(0).unwrap().energy_counter_j;
        workload.take_finished_requests(0, &mut finished);
    }
    let q = |v: &mut Vec<f64>, p: f64| tokwatt_core::quantile::nearest_rank(v, p).unwrap();
    let mut ttft: Vec<f64> = finished.records.iter().map(|r| r.ttft_ms).collect();
    let mut tpot: Vec<f64> = finished.records.iter().filter_map(|r| r.tpot_ms).collect();
    [
        tokens / seconds,
        joules / seconds,
        q(&mut ttft, 0.5),
        q(&mut ttft, 0.99),
        q(&mut tpot, 0.5),
        q(&mut tpot, 0.99),
    ]
}

#[test]
#[ignore = "analysis helper: the prefill-saturation scenarios on the simulator (TOKWATT_SERVING_PARAMS: a,b,c,... overrides [serving])"]
fn prefill_saturation_scenarios() {
    let profile = overridden(GpuProfile::load("h100").unwrap());
    for name in [
        "prefill-half",
        "prefill-ninetenths",
        "chat-half",
        "chat-ninetenths",
    ] {
        let m = simulate(profile.clone(), name, 60.0);
        println!(
            "{name:<20} tok/s {:8.1} W {:6.1} TTFT {:7.1} {:7.1} TPOT {:6.2} {:6.2}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        );
    }
}

/// The steps the serving loop ran at nine tenths of its capacity (prefill-heavy, then chat),
/// as the simulator runs them (each at the clock its firmware picks under the default cap):
/// the busy time of each run within 3.5 % (0.993 and 1.027 at the fit), and of the mixed
/// steps with 4,096 or more prompt
/// tokens within 3 %. At that load a queue's wait follows the busy time many times over, so
/// this pins the fit that brought the chat run's TTFT p99 within 15 %
/// (docs/measurements/h100-2026-12-07-prefill-saturation).
#[test]
fn the_served_steps_at_nine_tenths_keep_their_busy_time() {
    let profile = GpuProfile::load("h100").unwrap();
    let model = model_of(&profile, "llama-3-8b");
    let mem = f64::from(profile.mem_max_mhz());
    let text = include_str!("../../../profiles/calibration/h100_served_steps_llama-3-8b.csv");
    // Per run: [measured, model] of all steps and of the large mixed ones.
    let mut sums = [[[0.0; 2]; 2]; 2];
    let mut ratios = std::collections::HashMap::new();
    for f in super::calibration::csv_rows(text, "run", 7) {
        let load = StepLoad {
            decode: f[1] as u32,
            decode_positions: f[2],
            decode_position_max: f[3],
            prefill: f[4],
            prefill_positions: f[5],
        };
        let modelled = ratios
            .entry(format!("{load:?}"))
            .or_insert_with(|| {
                model
                    .steady_state_load(&load, profile.power_cap.default_w, u32::MAX, mem)
                    .step_s
                    * 1e3
            })
            .to_owned();
        let run = f[0] as usize;
        sums[run][0][0] += f[6];
        sums[run][0][1] += modelled;
        if load.prefill >= 4096.0 {
            sums[run][1][0] += f[6];
            sums[run][1][1] += modelled;
        }
    }
    for (run, name) in ["prefill-ninetenths", "chat-ninetenths"].iter().enumerate() {
        let all = sums[run][0][1] / sums[run][0][0];
        println!("{name}: model/measured busy time {all:.3}");
        assert!((all - 1.0).abs() <= 0.035, "{name}: busy time {all:.3}");
        if sums[run][1][0] > 0.0 {
            let large = sums[run][1][1] / sums[run][1][0];
            println!("{name}: steps of 4,096+ prompt tokens {large:.3}");
            assert!(
                (large - 1.0).abs() <= 0.03,
                "{name}: large steps {large:.3}"
            );
        }
    }
}
