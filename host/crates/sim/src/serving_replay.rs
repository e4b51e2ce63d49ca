//! The prefill-saturation scenarios served step by step, as tokwatt's CUDA serving loop
//! serves them (run by hand): core's scheduler planned one whole step at a time over 64 KV
//! slots of 4,096 positions, each step priced by the profile's model at the clock its
//! firmware picks under the default cap, no clock lag, no jitter. Against the simulator's
//! run of the same requests (runs of identical steps, cut where a request arrives, with
//! the clock's lag) it tells a difference of scheduling from a difference of cost
//! (docs/measurements/h100-2026-12-07-prefill-saturation).
//!
//! `TOKWATT_REPLAY_SCALE=1.02` multiplies every step's time (how far the figures follow
//! the busy time); `TOKWATT_SERVING_PARAMS` overrides `[serving]` as in
//! `serving_calibration`.
#![allow(clippy::unwrap_used)] // test-only module: tests may unwrap

use super::arrivals::ScenarioArrivals;
use super::model::{DecodeCost, DecodeModel, ModelShape, StepLoad};
use super::profile::GpuProfile;
use tokwatt_core::workload::serving::{
    RequestRecord, RequestSource, Scheduler, ServingLimits, StepPlan,
};

/// The load the model prices for a planned step: each decoding row attends to its cached
/// positions and itself, each prompt token to the prompt before it and itself (what the
/// serving loop's step log records).
fn load_of(plan: &StepPlan) -> StepLoad {
    let rows = plan.decodes.iter().map(|r| f64::from(r.position) + 1.0);
    let chunks = plan.prompts.iter().map(|c| {
        let (start, len) = (f64::from(c.start), f64::from(c.len));
        (len, len * start + len * (len + 1.0) / 2.0)
    });
    StepLoad {
        decode: plan.decodes.len() as u32,
        decode_positions: rows.clone().sum(),
        decode_position_max: rows.fold(0.0, f64::max),
        prefill: chunks.clone().map(|c| c.0).sum(),
        prefill_positions: chunks.map(|c| c.1).sum(),
    }
}

/// The scenario `name` served whole step by step for `seconds` (seed 1, running limit 64):
/// the requests finished, and the busy seconds.
fn replay(profile: &GpuProfile, name: &str, seconds: f64, scale: f64) -> (Vec<RequestRecord>, f64) {
    let path = format!("{}/../../scenarios/{name}.toml", env!("CARGO_MANIFEST_DIR"));
    let scenario = super::Scenario::load(std::path::Path::new(&path)).unwrap();
    let shape = ModelShape::preset(&scenario.model_name).unwrap();
    let model = DecodeModel::new(profile, &DecodeCost::new(&shape, 1024));
    let mem = f64::from(profile.mem_max_mhz());
    let cap = profile.power_cap.default_w;
    let limits = ServingLimits {
        slots: 64,
        context: 4096,
        max_batched_tokens: scenario.max_batched_tokens,
        queue_max: scenario.queue_max,
    };
    let mut scheduler = Scheduler::new(limits, 64).unwrap();
    let mut arrivals = ScenarioArrivals::new(&scenario, 1).unwrap();
    let (mut now, mut asked, mut busy) = (0.0, 0.0, 0.0);
    let mut finished = Vec::new();
    while now < seconds {
        for request in arrivals.arrivals(asked, now) {
            scheduler.arrive(request);
        }
        asked = now;
        let plan = scheduler.plan(now);
        if plan.is_empty() {
            now += 5e-4;
            continue;
        }
        let load = load_of(&plan);
        let state = model.steady_state_load(&load, cap, u32::MAX, mem);
        let step_s = state.step_s * scale;
        now += step_s;
        busy += step_s;
        scheduler.complete(&plan, now, step_s, Some(state.power_w * step_s));
        finished.extend(
            scheduler
                .take_finished_records()
                .into_iter()
                .filter(|r| r.finish_s <= seconds),
        );
    }
    (finished, busy)
}

#[test]
#[ignore = "analysis helper: the prefill-saturation scenarios step by step (TOKWATT_REPLAY_SCALE, TOKWATT_SERVING_PARAMS)"]
fn prefill_saturation_step_by_step() {
    let profile = super::serving_calibration::overridden(GpuProfile::load("h100").unwrap());
    let scale: f64 = std::env::var("TOKWATT_REPLAY_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.0);
    let out = std::env::var("TOKWATT_REPLAY_OUT").ok();
    for name in [
        "prefill-half",
        "prefill-ninetenths",
        "chat-half",
        "chat-ninetenths",
    ] {
        let (records, busy) = replay(&profile, name, 60.0, scale);
        let q = |v: &mut Vec<f64>, p: f64| tokwatt_core::quantile::nearest_rank(v, p).unwrap();
        let mut ttft: Vec<f64> = records.iter().map(|r| r.ttft_ms).collect();
        let mut tpot: Vec<f64> = records.iter().filter_map(|r| r.tpot_ms).collect();
        let tokens: f64 = records.iter().map(|r| f64::from(r.output)).sum();
        println!(
            "{name:<20} busy {:5.3} requests {:5} tok/s {:8.1} TTFT {:7.1} {:7.1} TPOT {:6.2} {:6.2}",
            busy / 60.0,
            records.len(),
            tokens / 60.0,
            q(&mut ttft, 0.5),
            q(&mut ttft, 0.99),
            q(&mut tpot, 0.5),
            q(&mut tpot, 0.99)
        );
        // Per-request lines in the serving loop's format, for prefill-sat-compare.py.
        if let Some(dir) = &out {
            let dir = format!("{dir}/sim-{name}-s1");
            std::fs::create_dir_all(&dir).unwrap();
            let lines: Vec<String> = records
                .iter()
                .map(|r| serde_json::to_string(r).unwrap())
                .collect();
            std::fs::write(format!("{dir}/requests.jsonl"), lines.join("\n") + "\n").unwrap();
        }
    }
}
