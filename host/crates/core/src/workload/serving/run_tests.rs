//! Runs of identical steps (the simulator's face) against single steps and against the
//! step-by-step face: one scheduler, whichever way it is driven.

use super::*;
use crate::workload::FinishedRequests;

const STEP_S: f64 = 0.01;

/// Requests of prompts that fit a step's room beside the running (so no chunk is under way
/// when the room moves), arriving on step boundaries, some while others run.
fn stream() -> Vec<Request> {
    let mut rng = crate::rng::Rng::stream(7, 0);
    let mut at = 0u32;
    (0..60)
        .map(|_| {
            at += (rng.uniform() * 4.0) as u32;
            Request {
                arrival_s: f64::from(at) * STEP_S,
                prompt: 1 + (rng.uniform() * 200.0) as u32,
                output: 1 + (rng.uniform() * 40.0) as u32,
            }
        })
        .collect()
}

fn scheduler(cache: KvCache) -> Scheduler {
    Scheduler::with_cache(cache, 256, 1000, 8)
}

fn pool() -> KvCache {
    KvCache::Pool { positions: 1e9 }
}

/// (arrival, first token, finish, energy) of every request, by arrival.
fn records(s: &mut Scheduler) -> Vec<(f64, f64, f64, Option<f64>)> {
    let mut into = FinishedRequests::default();
    s.take_finished(&mut into);
    let mut out: Vec<_> = into
        .records
        .iter()
        .map(|r| (r.arrival_s, r.first_token_s, r.finish_s, r.energy_j))
        .collect();
    out.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
    out
}

/// Arrives every request due by step `step` (arrival on or before its start).
fn arrive_due(s: &mut Scheduler, requests: &[Request], next: &mut usize, now_s: f64) {
    while let Some(r) = requests.get(*next)
        && r.arrival_s <= now_s + 1e-9
    {
        s.arrive(*r);
        *next += 1;
    }
}

/// The simulator's way: runs of identical steps, each as long as the scheduler says (cut
/// at the next arrival, as the simulator cuts them), priced at once. `whole`: runs of
/// whole steps only.
fn by_runs(cache: KvCache, requests: &[Request], whole: bool) -> Vec<(f64, f64, f64, Option<f64>)> {
    let mut s = scheduler(cache);
    let (mut next, mut now) = (0, 0.0);
    for _ in 0..100_000 {
        arrive_due(&mut s, requests, &mut next, now);
        s.rebalance(now);
        let Next::Steps { load, until_event } = s.next() else {
            let Some(r) = requests.get(next) else { break };
            now = r.arrival_s;
            continue;
        };
        let to_arrival = requests
            .get(next)
            .map_or(f64::INFINITY, |r| (r.arrival_s - now) / STEP_S);
        let mut steps = until_event.min(to_arrival);
        if whole {
            steps = steps.floor().max(1.0);
        }
        let energy = steps * f64::from(load.decode) + steps * load.prefill;
        now += steps * STEP_S;
        s.advance(&load, steps, STEP_S, Some(energy), now);
    }
    records(&mut s)
}

/// The CUDA loop's way: plan a step, run it, complete it.
fn by_steps(cache: KvCache, requests: &[Request]) -> Vec<(f64, f64, f64, Option<f64>)> {
    let mut s = scheduler(cache);
    let (mut next, mut now) = (0, 0.0);
    for _ in 0..100_000 {
        arrive_due(&mut s, requests, &mut next, now);
        let plan = s.plan(now);
        if plan.is_empty() {
            let Some(r) = requests.get(next) else { break };
            now = r.arrival_s;
            continue;
        }
        now += STEP_S;
        s.complete(&plan, now, STEP_S, Some(f64::from(plan.tokens())));
    }
    records(&mut s)
}

fn assert_same(a: &[(f64, f64, f64, Option<f64>)], b: &[(f64, f64, f64, Option<f64>)]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        // Times in steps of 10 ms: the same step, to round-off.
        assert!((x.0 - y.0).abs() < 1e-9, "{x:?} {y:?}");
        assert!((x.1 - y.1).abs() < 1e-6, "first token: {x:?} {y:?}");
        assert!((x.2 - y.2).abs() < 1e-6, "finish: {x:?} {y:?}");
        let (ex, ey) = (x.3.unwrap(), y.3.unwrap());
        assert!((ex - ey).abs() < 1e-6 * ex.max(1.0), "energy: {x:?} {y:?}");
    }
}

#[test]
fn the_simulators_runs_and_the_cuda_loops_steps_give_every_request_the_same_steps() {
    let requests = stream();
    for cache in [
        pool(),
        KvCache::Slots {
            slots: 8,
            context: 4096,
        },
    ] {
        let runs = by_runs(cache, &requests, false);
        let steps = by_steps(cache, &requests);
        assert_eq!(runs.len(), requests.len(), "{cache:?}");
        assert_same(&runs, &steps);
        for (_, _, _, energy) in &steps {
            assert!(energy.unwrap() > 0.0);
        }
    }
}

#[test]
fn k_identical_steps_at_once_are_k_single_steps() {
    let requests = stream();
    // Whole runs against single steps, through the same `advance`.
    let runs = by_runs(pool(), &requests, true);
    let steps = by_steps(pool(), &requests);
    assert_same(&runs, &steps);
    // And one run of decode steps against as many single ones, state for state.
    let mut at_once = scheduler(pool());
    let mut one_by_one = scheduler(pool());
    for s in [&mut at_once, &mut one_by_one] {
        for output in [30, 50, 70] {
            s.arrive(Request {
                arrival_s: 0.0,
                prompt: 20,
                output,
            });
        }
        s.rebalance(0.0);
        let Next::Steps { load, .. } = s.next() else {
            panic!("idle")
        };
        s.advance(&load, 1.0, STEP_S, Some(60.0), STEP_S);
    }
    let Next::Steps { load, until_event } = at_once.next() else {
        panic!("idle")
    };
    assert_eq!((load.decode, until_event), (3, 29.0));
    at_once.advance(&load, 29.0, STEP_S, Some(29.0 * 3.0), 30.0 * STEP_S);
    for k in 0..29 {
        let Next::Steps { load: one, .. } = one_by_one.next() else {
            panic!("idle")
        };
        assert_eq!(one.decode, 3, "the composition holds for the whole run");
        let end = f64::from(k + 2) * STEP_S;
        one_by_one.advance(&one, 1.0, STEP_S, Some(3.0), end);
    }
    assert_eq!(at_once.decode_steps(), one_by_one.decode_steps());
    assert_eq!(at_once.tokens(), one_by_one.tokens());
    assert_eq!(at_once.completed(), 1);
    assert_same(&records(&mut at_once), &records(&mut one_by_one));
    let (a, b) = (at_once.next(), one_by_one.next());
    assert_eq!(a, b);
}

#[test]
fn a_full_pool_preempts_and_the_preempted_is_prefilled_again_with_all_it_had() {
    let mut s = Scheduler::with_cache(KvCache::Pool { positions: 200.0 }, 64, 10, 4);
    for (i, prompt) in [30, 30].into_iter().enumerate() {
        s.arrive(Request {
            arrival_s: i as f64 * 1e-3,
            prompt,
            output: 100,
        });
    }
    let mut now = 0.0;
    let mut preempted = 0;
    for _ in 0..2000 {
        let plan = s.plan(now);
        if plan.is_empty() {
            break;
        }
        now += STEP_S;
        s.complete(&plan, now, STEP_S, Some(1.0));
        preempted += s.take_counts().preemptions;
    }
    assert!(preempted >= 1, "the pool filled");
    let mut into = FinishedRequests::default();
    s.take_finished(&mut into);
    // Both finish, each with its first token counted once and its whole output.
    assert_eq!(into.records.len(), 2);
    assert_eq!(s.first_tokens(), 2);
    assert!(
        into.records
            .iter()
            .all(|r| r.output == 100 && r.prompt == 30)
    );
    assert!((s.tokens() - 200.0).abs() < 1e-9, "{}", s.tokens());
}
