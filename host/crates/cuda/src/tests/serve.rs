//! The serving loop end to end on a tiny model: requests arrive, are prefilled and decoded,
//! and each finishes with its TTFT and TPOT; the windows count every token once.

use super::*;
use crate::{CudaServe, CudaServeConfig};
use tokwatt_core::workload::serving::{Request, RequestSource};

/// Twenty requests at `at_s` (from the first call at or after it), then nothing.
struct Burst {
    sent: bool,
    at_s: f64,
}

impl RequestSource for Burst {
    fn arrivals(&mut self, _from_s: f64, to_s: f64) -> Vec<Request> {
        if to_s < self.at_s || std::mem::replace(&mut self.sent, true) {
            return Vec::new();
        }
        (0..20)
            .map(|i| Request {
                arrival_s: to_s,
                prompt: 20 + 7 * i,
                output: 10,
            })
            .collect()
    }
}

/// The tiny model serving a [`Burst`] at `at_s` (8 slots, running limit 6, 64 tokens a
/// step); `None` (the test skips, saying why) where there is no CUDA driver.
fn burst_served(at_s: f64, energy: Option<crate::EnergyCounter>) -> Option<CudaServe> {
    let config = CudaServeConfig {
        model: tiny_shape(128, 8, 2),
        context: 300,
        slots: 8,
        running_limit: 6,
        max_batched_tokens: 64,
        queue_max: 100,
        device: 0,
        gpu_index: 0,
        engine: EngineOptions::default(),
        requests: Box::new(Burst { sent: false, at_s }),
        energy,
        step_log: Some(10_000),
    };
    match CudaServe::new(config) {
        Ok(serve) => Some(serve),
        Err(error) if no_cuda(&error) => {
            tokwatt_test_support::skip_gpu(format_args!("no CUDA driver: {error}"));
            None
        }
        Err(error) => panic!("{error}"),
    }
}

#[test]
fn requests_are_served_each_with_its_ttft_and_tpot() {
    let _lock = gpu_lock();
    let Some(mut serve) = burst_served(0.0, None) else {
        return;
    };
    let mut records = Vec::new();
    let mut tokens = 0;
    let mut first_tokens = 0;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while records.len() < 20 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
        let window = serve.read_window(0).unwrap();
        tokens += window.tokens;
        first_tokens += window.requests.unwrap().first_tokens;
        // The running limit holds.
        assert!(window.active_sequences <= 6, "{window:?}");
        records.extend(serve.take_finished().0);
    }
    let window = serve.read_window(0).unwrap();
    tokens += window.tokens;
    first_tokens += window.requests.unwrap().first_tokens;
    assert_eq!(records.len(), 20, "not every request finished in time");
    assert_eq!(tokens, 200);
    assert_eq!(first_tokens, 20);
    for r in &records {
        assert!(r.ttft_ms > 0.0 && r.first_token_s <= r.finish_s, "{r:?}");
        assert!(r.tpot_ms.is_some_and(|t| t > 0.0), "{r:?}");
        assert_eq!(r.output, 10);
        // No energy counter: unknown, never 0 J.
        assert_eq!(r.energy_j, None, "{r:?}");
    }
    // The step log holds every step: each prompt token once, each later token as a decode.
    let (steps, dropped) = serve.take_steps();
    assert_eq!(dropped, 0);
    let prompt_tokens: u32 = (0..20).map(|i| 20 + 7 * i).sum();
    assert_eq!(
        steps.iter().map(|s| s.prompt_tokens).sum::<u32>(),
        prompt_tokens
    );
    assert_eq!(steps.iter().map(|s| s.decodes).sum::<u32>(), 20 * 9);
    for step in &steps {
        assert!(step.start_s <= step.engine_start_s && step.engine_start_s < step.engine_end_s);
        assert!(step.decodes <= 6, "{step:?}");
    }
    assert!(steps.windows(2).all(|w| w[0].engine_end_s <= w[1].start_s));
    // A lowered limit is taken; a limit beyond the slots is refused.
    serve.set_batch_size(0, 2).unwrap();
    assert!(serve.set_batch_size(0, 9).is_err());
}

/// The token budget is a knob between steps: 1 to the budget it started with; a budget
/// cut to 8 tokens still serves every request (in more, smaller prompt chunks).
#[test]
fn the_token_budget_moves_between_steps_within_what_the_engine_started_with() {
    let _lock = gpu_lock();
    let Some(mut serve) = burst_served(0.2, None) else {
        return;
    };
    assert_eq!(serve.token_budget_range(0), Some((1, 64)));
    assert_eq!(serve.token_budget(0), Some(64));
    serve.set_token_budget(0, 8).unwrap();
    assert_eq!(serve.token_budget(0), Some(8));
    assert!(matches!(
        serve.set_token_budget(0, 65),
        Err(WorkloadError::TokenBudgetOutOfRange { max: 64, .. })
    ));
    assert!(serve.set_token_budget(0, 0).is_err());
    assert!(serve.set_token_budget(1, 8).is_err(), "one GPU only");
    let mut records = Vec::new();
    let mut prefilled = 0;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while records.len() < 20 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
        prefilled += serve
            .read_window(0)
            .unwrap()
            .requests
            .unwrap()
            .prefill_tokens;
        records.extend(serve.take_finished().0);
    }
    prefilled += serve
        .read_window(0)
        .unwrap()
        .requests
        .unwrap()
        .prefill_tokens;
    assert_eq!(records.len(), 20, "not every request finished in time");
    // Every prompt token prefilled once: 20 prompts of 20 + 7 i tokens.
    assert_eq!(prefilled, (0..20).map(|i| 20 + 7 * i).sum::<u64>());
}

/// With an energy counter (here a made-up steady 100 W), each request gets its share of
/// each step's energy, and the shares add up to no more than the counter over the run.
#[test]
fn with_an_energy_counter_each_request_gets_its_share_of_the_steps_energy() {
    let _lock = gpu_lock();
    let started = std::time::Instant::now();
    // After the estimate has its first second of readings.
    let Some(mut serve) = burst_served(
        1.2,
        Some(Box::new(move || {
            Some(100.0 * started.elapsed().as_secs_f64())
        })),
    ) else {
        return;
    };
    let mut records = Vec::new();
    let mut window_energy_known = true;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while records.len() < 20 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
        let window = serve.read_window(0).unwrap();
        window_energy_known &= window.requests.unwrap().energy.is_some();
        records.extend(serve.take_finished().0);
    }
    let elapsed = started.elapsed().as_secs_f64();
    assert_eq!(records.len(), 20, "not every request finished in time");
    assert!(
        window_energy_known,
        "every window's request energies are known"
    );
    let mut total = 0.0;
    for r in &records {
        let joules = r.energy_j.expect("a request's energy with a counter");
        assert!(joules > 0.0, "{r:?}");
        total += joules;
    }
    let first = records
        .iter()
        .map(|r| r.arrival_s)
        .fold(f64::INFINITY, f64::min);
    let last = records.iter().map(|r| r.finish_s).fold(0.0, f64::max);
    // The steps ran within [first arrival, last finish]: at 100 W, no more than that.
    assert!(
        total <= 100.0 * (last - first) * 1.05 + 1e-9,
        "{total} J over {:.3} s",
        last - first
    );
    assert!(total > 0.0 && last <= elapsed);
}
