//! Requests with prompts through the three boundary traits: prefill beside decode under
//! the token budget, time to first token, KV caches that grow and fill, energy per request.
#![allow(clippy::unwrap_used)] // tests may unwrap

use std::sync::Arc;
use std::time::Duration;

use super::*;
use tokwatt_core::clock::VirtualClock;
use tokwatt_core::types::WorkloadWindow;

/// llama-3-8b requests of `prompt` and `output` tokens at `rps` on one H200.
fn with_prompts(prompt: &str, output: &str, rps: f64, extra: &str) -> Scenario {
    Scenario::from_toml_str(
        &format!(
            "model = \"llama-3-8b\"\nprompt_tokens = {prompt}\noutput_tokens = {output}\n{extra}\n\
             [[phases]]\nstart_s = 0\narrival_rps = {rps}\n"
        ),
        "test scenario",
    )
    .unwrap()
}

fn sim(profile: GpuProfile, scenario: Scenario, seed: u64) -> (SimGpu, Arc<VirtualClock>) {
    let clock = VirtualClock::new();
    let sim = SimGpu::new(
        SimConfig {
            profile,
            scenario,
            gpus: 1,
            seed,
            noise_seed: None,
        },
        clock.clone(),
    )
    .unwrap();
    (sim, clock)
}

fn h200() -> GpuProfile {
    GpuProfile::load("h200").unwrap()
}

/// The workload window over `from_s..to_s`.
fn window(sim: &SimGpu, clock: &VirtualClock, from_s: f64, to_s: f64) -> WorkloadWindow {
    let mut workload = sim.workload();
    clock.sleep_until(Duration::from_secs_f64(from_s));
    workload.read_window(0).unwrap();
    clock.sleep_until(Duration::from_secs_f64(to_s));
    workload.read_window(0).unwrap()
}

#[test]
fn a_lone_prompt_gets_its_first_token_after_its_prefill() {
    // One request of 2,048 prompt tokens every 2 s on average: each finds the GPU idle, so
    // its time to first token is its prefill, ~53 ms measured for this prompt (prefill
    // table), plus at most the decode steps that share its chunk's steps.
    let (sim, clock) = sim(h200(), with_prompts("2048", "64", 0.5, ""), 3);
    let w = window(&sim, &clock, 10.0, 130.0);
    let requests = w.requests.unwrap();
    assert!(requests.first_tokens > 30, "{requests:?}");
    let ttft = requests.ttft_p99_ms.unwrap();
    assert!((45.0..90.0).contains(&ttft), "TTFT p99 {ttft} ms");
    // Every prompt token was prefilled once: no preemption at this load.
    assert_eq!(requests.preemptions, Some(0));
    let demand = w.demand.unwrap();
    assert!(requests.prefill_tokens >= 2048 * (requests.first_tokens - 1));
    assert!(requests.prefill_tokens <= 2048 * (demand.requests_arrived + 1));
    let share = requests.prefill_time_share.unwrap();
    assert!(share > 0.05 && share < 0.9, "{share}");
}

#[test]
fn a_decode_only_scenario_reports_first_tokens_without_prefill() {
    let (sim, clock) = sim(h200(), Scenario::built_in().unwrap(), 3);
    let w = window(&sim, &clock, 650.0, 700.0);
    let requests = w.requests.unwrap();
    assert_eq!(requests.prefill_tokens, 0);
    assert_eq!(requests.prefill_time_share, Some(0.0));
    // Light phase (5 requests/s): a slot is free, so the first token is one decode step.
    assert!(requests.first_tokens > 150, "{requests:?}");
    assert!(requests.ttft_p99_ms.unwrap() < 20.0, "{requests:?}");
}

#[test]
fn prompt_chunks_slow_the_decode_steps_they_share_and_a_smaller_budget_trades_ttft_for_tpot() {
    // Long prompts arriving among busy decoders: a step with a prompt chunk in it takes
    // longer, so the decode step's p99 rises over a decode-only step's; a smaller token
    // budget caps the chunk (lower TPOT p99) and spreads a prompt over more steps (higher
    // TTFT).
    let run = |budget: u32| {
        let (sim, clock) = sim(
            h200(),
            with_prompts(
                "4096",
                "256",
                10.0,
                &format!("max_batched_tokens = {budget}"),
            ),
            9,
        );
        let w = window(&sim, &clock, 20.0, 80.0);
        (
            w.tpot_p50_ms,
            w.tpot_p99_ms,
            w.requests.unwrap().ttft_p99_ms.unwrap(),
        )
    };
    let (p50_big, p99_big, ttft_big) = run(8192);
    let (_, p99_small, ttft_small) = run(512);
    assert!(p99_big > 2.0 * p50_big, "p50 {p50_big}, p99 {p99_big}");
    assert!(p99_small < p99_big, "TPOT p99 {p99_small} vs {p99_big}");
    assert!(ttft_small > ttft_big, "TTFT p99 {ttft_small} vs {ttft_big}");
}

#[test]
fn the_token_budget_knob_moves_the_budget_between_steps_and_ttft_follows() {
    // The same prompt-heavy load as above, on one board whose budget is cut from the
    // scenario's 8192 to 512 a minute in: the prompt tokens each step serves follow the
    // budget from then on, and prompts take more steps, so their first tokens come later.
    let (sim, clock) = sim(
        h200(),
        with_prompts("4096", "256", 10.0, "max_batched_tokens = 8192"),
        9,
    );
    let mut workload = sim.workload();
    assert_eq!(workload.token_budget_range(0), Some((1, 8192)));
    assert_eq!(workload.token_budget(0), Some(8192));
    let before = window(&sim, &clock, 20.0, 80.0);
    workload.set_token_budget(0, 512).unwrap();
    assert_eq!(workload.token_budget(0), Some(512));
    let after = window(&sim, &clock, 100.0, 160.0);
    let per_step =
        |w: &WorkloadWindow| w.requests.unwrap().prefill_tokens as f64 / w.steps.max(1) as f64;
    assert!(per_step(&before) > 512.0, "{} a step", per_step(&before));
    assert!(per_step(&after) <= 512.0, "{} a step", per_step(&after));
    let ttft = |w: &WorkloadWindow| w.requests.unwrap().ttft_p99_ms.unwrap();
    assert!(
        ttft(&after) > ttft(&before),
        "TTFT p99 {} ms at 512 against {} ms at 8192",
        ttft(&after),
        ttft(&before)
    );
    // Out of range or on another board: refused by type, nothing changed.
    assert!(matches!(
        workload.set_token_budget(0, 8193),
        Err(WorkloadError::TokenBudgetOutOfRange {
            requested: 8193,
            min: 1,
            max: 8192
        })
    ));
    assert!(matches!(
        workload.set_token_budget(0, 0),
        Err(WorkloadError::TokenBudgetOutOfRange { .. })
    ));
    assert!(matches!(
        workload.set_token_budget(3, 512),
        Err(WorkloadError::NoSuchGpu { index: 3, .. })
    ));
    assert_eq!(workload.token_budget(0), Some(512));
}

#[test]
fn a_decode_only_scenario_has_no_token_budget_to_turn() {
    let (sim, _clock) = sim(h200(), Scenario::built_in().unwrap(), 3);
    let mut workload = sim.workload();
    assert_eq!(workload.token_budget_range(0), None);
    assert_eq!(workload.token_budget(0), None);
    let refused = workload.set_token_budget(0, 512).unwrap_err();
    assert!(
        matches!(
            refused,
            WorkloadError::NoTokenBudget {
                workload: "sim",
                gpu: 0
            }
        ),
        "{refused}"
    );
}

#[test]
fn contexts_grow_as_sequences_decode() {
    // 64 sequences of short prompts and long outputs, started together: their KV caches
    // grow a position a step, and attention reads all of it, so the decode step slows.
    let scenario = Scenario::from_toml_str(
        "model = \"llama-3-8b\"\nprompt_tokens = 128\noutput_tokens = 16384\nbatch_size_max = 64\n\
         [[phases]]\nstart_s = 0\narrival_rps = 200\n[[phases]]\nstart_s = 0.5\narrival_rps = 0\n",
        "growing",
    )
    .unwrap();
    let (sim, clock) = sim(h200(), scenario, 5);
    let early = window(&sim, &clock, 2.0, 4.0);
    let late = window(&sim, &clock, 60.0, 62.0);
    assert_eq!((early.active_sequences, late.active_sequences), (64, 64));
    assert!(
        late.tpot_p50_ms > 1.5 * early.tpot_p50_ms,
        "early {} ms, late {} ms",
        early.tpot_p50_ms,
        late.tpot_p50_ms
    );
}

#[test]
fn a_full_kv_cache_preempts_and_every_request_still_finishes() {
    let profile = GpuProfile::from_toml_str(
        include_str!("../../../profiles/fixtures/l40s-class.toml"),
        "l40s-class.toml",
    )
    .unwrap();
    // A 48 GB card holds ~207k positions of llama-3-8b's KV cache beside its weights; the
    // batch limit is sized for the typical context (1,024 + 8,192 / 2: 40 sequences), and
    // 40 sequences of 9,216 positions overflow it, so the latest are preempted and
    // prefilled again. After the arrivals stop, everything admitted finishes.
    let scenario = Scenario::from_toml_str(
        "model = \"llama-3-8b\"\nprompt_tokens = 1024\noutput_tokens = 8192\n\
         [[phases]]\nstart_s = 0\narrival_rps = 4\n[[phases]]\nstart_s = 30\narrival_rps = 0\n",
        "overflow",
    )
    .unwrap();
    let capacity = kv_positions_beside_weights(&profile, &scenario);
    assert!(capacity < 40.0 * 9216.0, "{capacity}");
    let (sim, clock) = sim(profile, scenario, 11);
    let w = window(&sim, &clock, 0.0, 600.0);
    let requests = w.requests.unwrap();
    assert!(requests.preemptions.unwrap() > 0, "{requests:?}");
    clock.sleep_until(Duration::from_secs(3600));
    let truth = sim.truth(0).unwrap();
    assert_eq!(truth.requests_turned_away, 0);
    assert_eq!(
        truth.requests_completed, truth.requests_arrived,
        "{truth:?}"
    );
    assert_eq!(truth.waiting, 0);
    // Every token asked for was generated, once.
    assert!(
        (truth.tokens - 8192.0 * truth.requests_arrived as f64).abs() < 1.0,
        "{truth:?}"
    );
}

#[test]
fn request_energy_adds_up_to_the_energy_of_the_steps() {
    // Steady load, then nothing: the requests' energies together are the busy steps'
    // energy (as the board's sensor reads it), which is the energy drawn less the idle
    // time's.
    let scenario = Scenario::from_toml_str(
        "model = \"llama-3-8b\"\n\
         prompt_tokens = { distribution = \"lognormal\", median = 1024, sigma = 0.8, max = 8192 }\n\
         output_tokens = { distribution = \"uniform\", min = 16, max = 512 }\n\
         [[phases]]\nstart_s = 0\narrival_rps = 20\n[[phases]]\nstart_s = 60\narrival_rps = 0\n",
        "energy",
    )
    .unwrap();
    let (sim, clock) = sim(h200(), scenario, 13);
    let w = window(&sim, &clock, 0.0, 200.0);
    let requests = w.requests.unwrap();
    let energy = requests.energy.unwrap();
    let truth = sim.truth(0).unwrap();
    assert_eq!(energy.count, truth.requests_completed);
    assert_eq!(truth.requests_completed, truth.requests_arrived);
    let idle_w = h200().idle.power_w;
    let mean = energy.mean_j().unwrap();
    // Per request: about 1,500 prompt tokens at ~55 tokens/J and 264 output tokens at
    // tens of tokens/J: tens of joules.
    assert!((10.0..200.0).contains(&mean), "{mean} J");
    // Charged through the board's sensor, as its energy counter reads.
    let busy_j = energy.sum_j / truth.sensor_gain;
    assert!(busy_j < truth.energy_j, "{busy_j} of {}", truth.energy_j);
    assert!(
        busy_j > truth.energy_j - idle_w * 200.0,
        "{busy_j} of {}",
        truth.energy_j
    );
    assert_eq!(energy.buckets.iter().sum::<u64>(), energy.count);
}

#[test]
fn lengths_are_drawn_the_same_whatever_the_policy_does() {
    let demanded = |batch: u32| {
        let mut scenario = with_prompts(
            "{ distribution = \"uniform\", min = 64, max = 4096 }",
            "{ distribution = \"lognormal\", median = 200, sigma = 1.0, max = 4000 }",
            30.0,
            "",
        );
        scenario.initial_batch_size = batch;
        let (sim, clock) = sim(h200(), scenario, 21);
        let w = window(&sim, &clock, 0.0, 30.0);
        let d = w.demand.unwrap();
        (d.requests_arrived, d.tokens_demanded)
    };
    let reference = demanded(512);
    assert!(reference.0 > 700, "{reference:?}");
    assert_eq!(demanded(16), reference);
    assert_eq!(demanded(128), reference);
}

#[test]
fn a_request_longer_than_the_kv_cache_is_refused_with_the_fix() {
    let profile = GpuProfile::from_toml_str(
        include_str!("../../../profiles/fixtures/l40s-class.toml"),
        "l40s-class.toml",
    )
    .unwrap();
    let clock = VirtualClock::new();
    let err = SimGpu::new(
        SimConfig {
            profile,
            scenario: with_prompts("1000000", "1000", 1.0, ""),
            gpus: 1,
            seed: 0,
            noise_seed: None,
        },
        clock,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("longest request (1001000 tokens") && err.contains("lower the lengths' max"),
        "{err}"
    );
}

#[test]
fn scenario_layouts_are_one_or_the_other() {
    let both = Scenario::from_toml_str(
        "model = \"llama-3-8b\"\ncontext_tokens = 1024\nprompt_tokens = 512\noutput_tokens = 64\n\
         [[phases]]\nstart_s = 0\narrival_rps = 1\n",
        "both.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(both.contains("not both"), "{both}");
    let drawn_without_prompts = Scenario::from_toml_str(
        "model = \"llama-3-8b\"\ncontext_tokens = 1024\n\
         output_tokens = { distribution = \"uniform\", min = 1, max = 9 }\n\
         [[phases]]\nstart_s = 0\narrival_rps = 1\n",
        "drawn.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(
        drawn_without_prompts.contains("fixed `output_tokens`"),
        "{drawn_without_prompts}"
    );
    let with = with_prompts(
        "{ distribution = \"table\", tokens = [100, 300], weights = [1, 1] }",
        "100",
        1.0,
        "",
    );
    // The typical context: mean prompt (200) + half the mean output (50).
    assert_eq!((with.context_tokens, with.output_tokens), (250, 100));
    assert_eq!(
        with.max_batched_tokens,
        scenario::DEFAULT_MAX_BATCHED_TOKENS
    );
}

#[test]
fn the_shipped_chat_scenario_serves_its_busy_phase_without_turning_work_away() {
    let scenario = Scenario::load(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scenarios/chat.toml"
    ))
    .unwrap();
    let (sim, clock) = sim(h200(), scenario, 17);
    let w = window(&sim, &clock, 60.0, 600.0);
    let demand = w.demand.unwrap();
    let requests = w.requests.unwrap();
    assert_eq!(demand.requests_turned_away, 0, "{demand:?}");
    // Served what was asked: completions within 2 % of arrivals over nine minutes.
    let served = demand.requests_completed as f64 / demand.requests_arrived as f64;
    assert!((0.98..1.02).contains(&served), "{demand:?}");
    let ttft = requests.ttft_p99_ms.unwrap();
    assert!(ttft < 2_000.0, "TTFT p99 {ttft} ms");
    assert!(
        requests
            .prefill_time_share
            .is_some_and(|share| (0.1..0.9).contains(&share)),
        "{requests:?}"
    );
    println!(
        "chat busy phase, SIMULATOR OUTPUT: {:.0} tokens/s, TPOT p99 {:.1} ms, TTFT p99 {ttft:.0} ms, \
         prefill share {:.2}, {:.1} J a request",
        w.tokens as f64 / 540.0,
        w.tpot_p99_ms,
        requests.prefill_time_share.unwrap_or(f64::NAN),
        requests.energy.and_then(|e| e.mean_j()).unwrap()
    );
}

/// A judging scenario (the layout `eval` reads) handed to `run --scenario` is refused
/// with the way to run it, not only with the key the simulator did not know.
#[test]
fn a_judging_scenario_given_as_a_simulator_scenario_says_how_to_run_it() {
    let judging = r#"
gpu = "h200"
duration_s = 600
[objective]
ttft_p99_limit_ms = 800
[workload]
model = "llama-3-8b"
output_tokens = 128
[[workload.phases]]
start_s = 0
arrival_rps = 2.0
"#;
    let error = Scenario::from_toml_str(judging, "chat.toml")
        .expect_err("the judging layout is not a simulator scenario")
        .to_string();
    assert!(error.contains("judging scenario"), "{error}");
    assert!(error.contains("tokwatt eval --scenarios"), "{error}");
    assert!(error.contains("--ttft-p99-limit-ms"), "{error}");
    // A plain typo in a simulator scenario gets no such hint.
    let typo =
        "model = \"llama-3-8b\"\noutput_tokns = 128\n[[phases]]\nstart_s = 0\narrival_rps = 1.0\n";
    let error = Scenario::from_toml_str(typo, "typo.toml")
        .expect_err("unknown key")
        .to_string();
    assert!(!error.contains("judging scenario"), "{error}");
}

#[test]
fn each_finished_request_has_its_record_and_they_add_up_to_the_window() {
    let (sim, clock) = sim(h200(), with_prompts("600", "150", 8.0, ""), 5);
    let mut workload = sim.workload();
    assert!(workload.reports_requests());
    let mut finished = tokwatt_core::workload::FinishedRequests::default();
    clock.sleep_until(Duration::from_secs_f64(60.0));
    let w = workload.read_window(0).unwrap();
    workload.take_finished_requests(0, &mut finished);
    let energy = w.requests.unwrap().energy.unwrap();
    assert_eq!(finished.dropped, 0);
    assert_eq!(finished.records.len() as u64, energy.count);
    assert_eq!(
        finished.records.len() as u64,
        w.demand.unwrap().requests_completed
    );
    let record_energy: f64 = finished.records.iter().map(|r| r.energy_j.unwrap()).sum();
    assert!(
        (record_energy - energy.sum_j).abs() < 1e-6 * energy.sum_j,
        "{record_energy} J against {} J",
        energy.sum_j
    );
    for r in &finished.records {
        assert!(r.arrival_s <= r.admitted_s, "{r:?}");
        assert!(
            r.admitted_s <= r.first_token_s && r.first_token_s <= r.finish_s,
            "{r:?}"
        );
        assert_eq!((r.prompt, r.output), (600, 150));
        // A decode step of llama-3-8b on an H200 at this load: a few ms to a few tens.
        let tpot = r.tpot_ms.unwrap();
        assert!((4.0..40.0).contains(&tpot), "TPOT {tpot} ms: {r:?}");
        assert!(r.ttft_ms >= 10.0, "a 600-token prefill is not free: {r:?}");
    }
    // A second take has only what finished since.
    finished.clear();
    workload.take_finished_requests(0, &mut finished);
    assert!(finished.records.is_empty());
    clock.sleep_until(Duration::from_secs_f64(70.0));
    workload.take_finished_requests(0, &mut finished);
    assert!(finished.records.iter().all(|r| r.finish_s > 60.0 - 1e-9));
    assert!(!finished.records.is_empty());
}

#[test]
fn a_decode_only_request_is_recorded_with_its_first_step_as_its_first_token() {
    let (sim, clock) = sim(h200(), Scenario::built_in().unwrap(), 2);
    let mut workload = sim.workload();
    let mut finished = tokwatt_core::workload::FinishedRequests::default();
    // The light phase: a slot is free, the first token is one decode step.
    clock.sleep_until(Duration::from_secs_f64(650.0));
    workload.take_finished_requests(0, &mut finished);
    finished.clear();
    clock.sleep_until(Duration::from_secs_f64(700.0));
    workload.take_finished_requests(0, &mut finished);
    assert!(!finished.records.is_empty());
    for r in &finished.records {
        assert_eq!(r.prompt, 0, "{r:?}");
        assert!(r.first_token_s <= r.finish_s, "{r:?}");
        assert!(r.ttft_ms < 20.0, "{r:?}");
        assert!(r.tpot_ms.is_some_and(|t| t > 0.0), "{r:?}");
    }
}
