//! The scheduler step by step (the CUDA serving loop's face).

use super::*;

fn limits() -> ServingLimits {
    ServingLimits {
        slots: 4,
        context: 1000,
        max_batched_tokens: 100,
        queue_max: 3,
    }
}

fn request(arrival_s: f64, prompt: u32, output: u32) -> Request {
    Request {
        arrival_s,
        prompt,
        output,
    }
}

/// Runs steps of `step_s` each until nothing is left, from `t`.
fn run_out(s: &mut Scheduler, mut t: f64, step_s: f64) -> f64 {
    loop {
        let plan = s.plan(t);
        if plan.is_empty() {
            return t;
        }
        t += step_s;
        s.complete(&plan, t, step_s, Some(f64::from(plan.tokens())));
    }
}

#[test]
fn prompts_are_chunked_under_the_budget_after_the_decodes() {
    let mut s = Scheduler::new(limits(), 4).unwrap();
    assert!(s.arrive(request(0.0, 150, 3)));
    assert!(s.arrive(request(0.0, 30, 2)));
    let first = s.plan(0.0);
    // The oldest prompt takes the whole budget; the second waits.
    assert_eq!(
        first.prompts,
        vec![PromptChunk {
            slot: 0,
            start: 0,
            len: 100,
            ends_prompt: false
        }]
    );
    s.complete(&first, 0.01, 0.01, Some(1.0));
    let second = s.plan(0.01);
    assert_eq!(second.prompts.len(), 2);
    assert_eq!((second.prompts[0].start, second.prompts[0].len), (100, 50));
    assert!(second.prompts[0].ends_prompt);
    assert_eq!((second.prompts[1].slot, second.prompts[1].len), (1, 30));
    s.complete(&second, 0.02, 0.01, Some(1.0));
    // Both decode now: one row each, at the position after their prompt's last.
    let third = s.plan(0.02);
    assert_eq!(
        third.decodes,
        vec![
            DecodeRow {
                slot: 0,
                position: 150
            },
            DecodeRow {
                slot: 1,
                position: 30
            }
        ]
    );
    assert!(third.prompts.is_empty());
}

#[test]
fn a_lowered_token_budget_chunks_the_next_steps_finer_within_what_the_engine_holds() {
    let mut s = Scheduler::new(limits(), 4).unwrap();
    assert_eq!(s.token_budget(), 100, "the start's budget");
    s.arrive(request(0.0, 150, 3));
    s.set_token_budget(40);
    let first = s.plan(0.0);
    assert_eq!(first.tokens(), 40);
    s.complete(&first, 0.01, 0.01, None);
    // Raised past what the engine was sized for: held at its most.
    s.set_token_budget(1_000);
    assert_eq!(s.token_budget(), 100);
    let second = s.plan(0.01);
    assert_eq!((second.prompts[0].start, second.prompts[0].len), (40, 100));
    s.complete(&second, 0.02, 0.01, None);
    // Never below one token: a step always moves.
    s.set_token_budget(0);
    assert_eq!(s.token_budget(), 1);
    assert_eq!(s.plan(0.02).tokens(), 1);
}

#[test]
fn each_request_gets_its_tokens_its_ttft_and_tpot_and_the_energy_adds_up() {
    let mut s = Scheduler::new(limits(), 2).unwrap();
    s.arrive(request(0.0, 50, 5));
    s.arrive(request(0.0, 60, 1));
    s.arrive(request(0.0, 10, 4));
    let end = run_out(&mut s, 0.0, 0.01);
    let records = s.take_finished_records();
    assert_eq!(records.len(), 3);
    let window = s.take_window(true);
    // Every output token was counted once.
    assert_eq!(window.tokens, 5 + 1 + 4);
    let requests = window.requests.unwrap();
    assert_eq!(requests.prefill_tokens, 120);
    assert_eq!(requests.first_tokens, 3);
    // One joule per token processed: each request's energy is its prompt plus its
    // decode rows (output - 1).
    for r in &records {
        assert!(
            (r.energy_j.unwrap() - f64::from(r.prompt + r.output - 1)).abs() < 1e-9,
            "{r:?}"
        );
    }
    assert_eq!(requests.energy.unwrap().count, 3);
    // 50 + 60 fit one step's budget of 100 only in part: the first two prompts end in
    // steps 1 and 2; the third waits for a slot (running limit 2) until the 1-token
    // request leaves at the end of step 2.
    let first = records.iter().find(|r| r.prompt == 50).unwrap();
    assert!((first.ttft_ms - 10.0).abs() < 1e-9);
    assert!((first.tpot_ms.unwrap() - 10.0).abs() < 1e-9);
    let single = records.iter().find(|r| r.output == 1).unwrap();
    assert!((single.ttft_ms - 20.0).abs() < 1e-9 && single.tpot_ms.is_none());
    let late = records.iter().find(|r| r.prompt == 10).unwrap();
    assert!((late.admitted_s - 0.02).abs() < 1e-9, "{late:?}");
    assert!(end > 0.0 && s.in_slots() == 0 && s.waiting() == 0);
}

#[test]
fn a_full_queue_turns_requests_away_and_counts_them() {
    let mut s = Scheduler::new(limits(), 1).unwrap();
    for _ in 0..5 {
        s.arrive(request(0.0, 10, 10));
    }
    let demand = s.take_window(false).demand.unwrap();
    assert_eq!(demand.requests_arrived, 5);
    assert_eq!(demand.requests_turned_away, 2);
    assert_eq!(demand.tokens_demanded, 50);
}

#[test]
fn the_running_limit_caps_admission_and_a_cut_pauses_the_longest_until_it_is_raised() {
    let mut s = Scheduler::new(limits(), 3).unwrap();
    for output in [100, 90, 80] {
        s.arrive(request(0.0, 5, output));
    }
    let plan = s.plan(0.0);
    assert_eq!(plan.prompts.len(), 3);
    s.complete(&plan, 0.01, 0.01, None);
    s.set_running_limit(1);
    s.arrive(request(0.01, 5, 5));
    let plan = s.plan(0.01);
    // The cut acts at the next step: the two with the most tokens left pause (keeping
    // their cache and slot); nobody new is admitted.
    assert_eq!((plan.decodes.len(), plan.prompts.len()), (1, 0));
    assert_eq!(
        plan.decodes[0].slot, 2,
        "the one with the fewest tokens left runs"
    );
    assert_eq!(s.waiting(), 3);
    s.complete(&plan, 0.02, 0.01, None);
    // Raised again: the paused resume first, at the positions they had.
    s.set_running_limit(3);
    let plan = s.plan(0.02);
    assert_eq!((plan.decodes.len(), plan.prompts.len()), (3, 0));
    let positions: Vec<(u32, u32)> = plan.decodes.iter().map(|r| (r.slot, r.position)).collect();
    assert_eq!(positions, vec![(0, 5), (1, 5), (2, 6)]);
    assert_eq!(s.waiting(), 1);
    let window = s.take_window(false);
    assert!(window.requests.unwrap().energy.is_none());
}

#[test]
fn a_step_without_energy_leaves_its_requests_energy_unknown_not_zero() {
    let mut s = Scheduler::new(limits(), 2).unwrap();
    s.arrive(request(0.0, 4, 3));
    let mut now = 0.0;
    let mut finished = Vec::new();
    for step in 0..100 {
        let plan = s.plan(now);
        now += 0.01;
        // The counter answers for the first step only.
        s.complete(&plan, now, 0.01, (step == 0).then_some(1.0));
        finished.extend(s.take_finished_records());
        if !finished.is_empty() {
            break;
        }
    }
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0].energy_j, None);
    let window = s.take_window(true);
    assert_eq!(window.requests.unwrap().energy.unwrap().count, 0);
}

#[test]
fn a_request_longer_than_a_slot_is_cut_to_fit_and_counted() {
    let mut s = Scheduler::new(limits(), 1).unwrap();
    s.arrive(request(0.0, 5000, 10));
    s.arrive(request(0.0, 900, 500));
    assert_eq!(s.truncated(), 2);
    run_out(&mut s, 0.0, 0.001);
    let records = s.take_finished_records();
    assert_eq!((records[0].prompt, records[0].output), (999, 2));
    assert_eq!((records[1].prompt, records[1].output), (900, 101));
    // Every position a sequence writes fits its slot: prompt + output - 1 <= context.
    assert!(records.iter().all(|r| r.prompt + r.output - 1 <= 1000));
}

#[test]
fn impossible_limits_are_refused() {
    for bad in [
        ServingLimits {
            slots: 0,
            ..limits()
        },
        ServingLimits {
            context: 1,
            ..limits()
        },
        ServingLimits {
            max_batched_tokens: 0,
            ..limits()
        },
    ] {
        assert!(Scheduler::new(bad, 1).is_err());
    }
}
