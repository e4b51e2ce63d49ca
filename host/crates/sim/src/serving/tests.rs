//! The server alone, stepped by hand: how prompts share a step.

use super::*;
use tokwatt_core::workload::FinishedRequests;

fn server(budget: u32) -> Server {
    let scenario = Scenario::from_toml_str(
        &format!(
            "model = \"llama-3-8b\"\nprompt_tokens = 600\noutput_tokens = 50\n\
             max_batched_tokens = {budget}\n[[phases]]\nstart_s = 0\narrival_rps = 1.0\n"
        ),
        "test scenario",
    )
    .unwrap();
    let mut server = Server::new(&scenario, 1e9);
    server.rebalance(0.0, 64);
    server
}

/// Runs the server's own steps (10 ms each) until `t_end`, cutting every step into
/// `cuts` segments as arrivals and finishing sequences do; the first-token times.
fn first_tokens(server: &mut Server, cuts: u32, t_end: f64) -> Vec<f64> {
    let mut now = 0.0;
    while now < t_end {
        let Next::Steps { load, until_event } = server.next() else {
            break;
        };
        let steps = until_event.min(1.0 / f64::from(cuts)).max(1e-9);
        now += steps * 0.01;
        server.advance(&load, steps, 0.01, 0.0, now);
        server.rebalance(now, 64);
    }
    let mut records = FinishedRequests::default();
    server.take_finished(&mut records);
    let window = server.take_window();
    window.ttfts_ms
}

#[test]
fn prompts_a_step_holds_whole_get_their_first_tokens_together_after_one_step() {
    for cuts in [1, 3] {
        let mut server = server(8192);
        for _ in 0..3 {
            server.arrive(0.0, 600, 50);
        }
        server.rebalance(0.0, 64);
        let ttfts = first_tokens(&mut server, cuts, 0.05);
        // One step of 1,800 prompt tokens, however often events cut it: 10 ms each.
        assert_eq!(ttfts.len(), 3, "{ttfts:?}");
        for ttft in ttfts {
            assert!((ttft - 10.0).abs() < 1e-6, "cut {cuts}: {ttft}");
        }
    }
}

#[test]
fn a_prompt_longer_than_the_budget_ends_with_the_step_that_holds_its_last_chunk() {
    for cuts in [1, 3] {
        // 600 tokens under a budget of 256: chunks of 256, 256 and 88, three steps (not the
        // 2.34 a continuous flow would give), however often events cut them.
        let mut server = server(256);
        server.arrive(0.0, 600, 50);
        server.rebalance(0.0, 64);
        let ttfts = first_tokens(&mut server, cuts, 0.05);
        assert_eq!(ttfts.len(), 1);
        assert!((ttfts[0] - 30.0).abs() < 1e-6, "cut {cuts}: {ttfts:?}");
    }
}

/// The simulator's server is core's scheduler: a stream of requests driven the simulator's
/// way (runs of identical steps, cut at arrivals) and through core's scheduler one planned
/// step at a time (the CUDA loop's way) gives every request the same first-token and
/// finish step.
#[test]
fn the_servers_runs_and_the_cuda_loops_single_steps_give_every_request_the_same_steps() {
    use tokwatt_core::workload::serving::{KvCache, Request, Scheduler};
    const STEP_S: f64 = 0.01;
    let mut rng = tokwatt_core::rng::Rng::stream(3, 0);
    let mut at = 0u32;
    // Prompts that fit a step beside the 64 running: no chunk is under way when the
    // room moves (where the fluid view and whole steps part by a fraction of a step).
    let requests: Vec<Request> = (0..80)
        .map(|_| {
            at += (rng.uniform() * 3.0) as u32;
            Request {
                arrival_s: f64::from(at) * STEP_S,
                prompt: 1 + (rng.uniform() * 400.0) as u32,
                output: 1 + (rng.uniform() * 60.0) as u32,
            }
        })
        .collect();
    let first_and_finish = |records: FinishedRequests| {
        let mut times: Vec<(f64, f64, f64)> = records
            .records
            .iter()
            .map(|r| (r.arrival_s, r.first_token_s, r.finish_s))
            .collect();
        times.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
        times
    };

    // Time in steps (whole numbers where runs end on steps), the same seconds both ways.
    let step_of = |r: &Request| (r.arrival_s / STEP_S).round();
    let mut server = server(512);
    let (mut next, mut now) = (0, 0.0);
    while next < requests.len() || server.in_slots() > 0 || server.waiting() > 0 {
        while let Some(r) = requests.get(next).filter(|r| step_of(r) <= now) {
            server.arrive(r.arrival_s, r.prompt, r.output);
            next += 1;
        }
        server.rebalance(now * STEP_S, 64);
        let to_arrival = requests
            .get(next)
            .map_or(f64::INFINITY, |r| step_of(r) - now);
        match server.next() {
            Next::Idle => now = step_of(&requests[next]),
            Next::Steps { load, until_event } => {
                let steps = until_event.min(to_arrival);
                now += steps;
                server.advance(&load, steps, STEP_S, 1.0, now * STEP_S);
            }
        }
    }
    let mut by_runs = FinishedRequests::default();
    server.take_finished(&mut by_runs);

    let mut core = Scheduler::with_cache(KvCache::Pool { positions: 1e9 }, 512, 10_000, 64);
    let (mut next, mut now) = (0, 0.0);
    let mut by_steps = Vec::new();
    while next < requests.len() || core.in_slots() > 0 || core.waiting() > 0 {
        while let Some(r) = requests.get(next).filter(|r| step_of(r) <= now) {
            core.arrive(*r);
            next += 1;
        }
        let plan = core.plan(now * STEP_S);
        if plan.is_empty() {
            now = step_of(&requests[next]);
            continue;
        }
        now += 1.0;
        core.complete(&plan, now * STEP_S, STEP_S, Some(1.0));
        by_steps.extend(core.take_finished_records());
    }

    let runs = first_and_finish(by_runs);
    let steps = first_and_finish(FinishedRequests {
        records: by_steps,
        dropped: 0,
    });
    assert_eq!(runs.len(), requests.len());
    assert_eq!(runs.len(), steps.len());
    for (a, b) in runs.iter().zip(&steps) {
        assert!((a.1 - b.1).abs() < 1e-6, "first token: {a:?} {b:?}");
        assert!((a.2 - b.2).abs() < 1e-6, "finish: {a:?} {b:?}");
    }
}
