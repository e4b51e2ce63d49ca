use super::*;
use tokwatt_policy_sdk::{Requests, testing};

/// A tick of an engine whose decode step takes `a_ms` and a prompt token `c_ms`
/// (`(a_ms, c_ms)`), at
/// `budget` with `sequences` decoding, prefilling `prompts` prompts of `prompt` tokens
/// in full chunks, `queued` requests waiting, first tokens at `ttft_ms`.
fn tick(
    (a_ms, c_ms): (f64, f64),
    budget: u32,
    sequences: u32,
    prompts: u64,
    prompt: u64,
    queued: u32,
    ttft_ms: f64,
) -> Observation {
    let chunk = f64::from(budget - sequences);
    let prefill_tokens = prompts * prompt;
    let prompt_steps = prefill_tokens as f64 / chunk;
    let prefill_s = prompt_steps * (a_ms + c_ms * chunk) / 1000.0;
    let mut observation = testing::observation(0, 1);
    observation.in_force.token_budget = budget;
    observation.active_sequences = sequences;
    observation.queue_depth = queued;
    observation.tpot_p50_ms = a_ms;
    observation.tpot_p99_ms = a_ms + c_ms * chunk;
    observation.gpu_util_pct = 100.0;
    observation.requests = Some(Requests {
        prefill_tokens,
        first_tokens: prompts,
        ttft_p99_ms: Some(ttft_ms),
        prefill_time_share: Some(prefill_s.min(1.0)),
        preemptions: Some(0),
        requests_finished: Some(prompts),
        energy_per_request_j: None,
    });
    observation
}

fn close(actual: f64, expected: f64, tolerance: f64) -> bool {
    (actual - expected).abs() <= tolerance * expected.abs()
}

#[test]
fn the_step_line_is_learnt_and_predicts_another_budget() {
    // 10 ms a decode step, 0.02 ms a prompt token: at 2048 with 64 decoding a full step
    // takes 10 + 0.02 · 1984 = 49.7 ms.
    let mut model = StepModel::new();
    for _ in 0..20 {
        model.observe(&tick((10.0, 0.02), 2048, 64, 4, 1000, 0, 300.0));
    }
    let at_512 = model.tpot_p99_ms(512, 64).unwrap_or(f64::NAN);
    assert!(close(at_512, 10.0 + 0.02 * 448.0, 0.02), "{at_512}");
    let at_2048 = model.tpot_p99_ms(2048, 64).unwrap_or(f64::NAN);
    assert!(close(at_2048, 49.68, 0.02), "{at_2048}");
    // Prompts go through at chunk / step: 1984 tokens per 49.7 ms.
    let rate = model.prefill_rate(2048, 64).unwrap_or(f64::NAN);
    assert!(close(rate, 1984.0 / 0.04968, 0.02), "{rate}");
    // A budget under the sequences decoding leaves prompts nothing.
    assert_eq!(model.prefill_rate(64, 64), Some(0.0));
    assert_eq!(model.mean_prompt_tokens(), Some(1000.0));
}

#[test]
fn time_to_first_token_grows_with_the_prompt_tokens_waiting_and_learns_its_tail() {
    let mut model = StepModel::new();
    // The engine's first tokens come 1.5 times the plain mean prediction.
    for queued in [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0] {
        let plain = 1000.0 / (1984.0 / 0.04968) * 1000.0;
        model.observe(&tick((10.0, 0.02), 2048, 64, 4, 1000, queued, 1.5 * plain));
    }
    let empty = model.ttft_p99_ms(0.0, 2048, 64).unwrap_or(f64::NAN);
    let plain = 1000.0 / (1984.0 / 0.04968) * 1000.0;
    assert!(close(empty, 1.5 * plain, 0.05), "{empty} vs {plain}");
    // Eight prompts queued ahead: nine prompts' worth.
    let behind = model.ttft_p99_ms(8000.0, 2048, 64).unwrap_or(f64::NAN);
    assert!(close(behind, 9.0 * empty, 0.01), "{behind}");
    // A smaller budget prefills slower: a later first token.
    let small = model.ttft_p99_ms(0.0, 512, 64).unwrap_or(f64::NAN);
    assert!(small > empty, "{small} <= {empty}");
}

#[test]
fn nothing_is_predicted_before_prompts_were_seen_and_bad_figures_are_ignored() {
    let mut model = StepModel::new();
    assert_eq!(model.tpot_p99_ms(2048, 64), None);
    assert_eq!(model.ttft_p99_ms(0.0, 2048, 64), None);
    let mut bad = tick((10.0, 0.02), 2048, 64, 4, 1000, 0, 300.0);
    if let Some(requests) = bad.requests.as_mut() {
        requests.prefill_time_share = Some(f64::NAN);
    }
    bad.tpot_p50_ms = f64::INFINITY;
    model.observe(&bad);
    assert!(!model.knows_prompts());
    assert_eq!(model.decode_ms(), None);
    let mut settling = tick((10.0, 0.02), 2048, 64, 4, 1000, 0, 300.0);
    settling.settling = true;
    model.observe(&settling);
    assert!(!model.knows_prompts());
}

fn bounds(tpot_ms: Option<f64>) -> BudgetBounds {
    BudgetBounds {
        tpot_ms,
        tpot_share: 0.83,
        prefill_share_max: 0.8,
    }
}

const CANDIDATES: [u32; 6] = [256, 512, 1024, 2048, 4096, 8192];

fn learnt() -> StepModel {
    let mut model = StepModel::new();
    for _ in 0..20 {
        model.observe(&tick((10.0, 0.02), 2048, 64, 4, 1000, 0, 150.0));
    }
    model
}

#[test]
fn without_a_tpot_bound_the_largest_budget_is_chosen() {
    let model = learnt();
    let chosen = choose_budget(&model, &bounds(None), &CANDIDATES, 64, None);
    assert_eq!(chosen, Some(8192));
}

#[test]
fn a_tight_tpot_bound_takes_the_largest_chunks_that_keep_it() {
    let model = learnt();
    // TPOT 30 ms, a full chunk's step held to 83 % of it (24.9 ms): 10 + 0.02 · (B - 64)
    // fits up to B = 809, so 512 of the candidates.
    let chosen = choose_budget(&model, &bounds(Some(30.0)), &CANDIDATES, 64, None);
    assert_eq!(chosen, Some(512));
    assert_eq!(
        largest_budget_within_tpot(&model, &bounds(Some(30.0)), &CANDIDATES, 64),
        Some(512)
    );
    // More sequences decoding take more of each budget: a larger one fits.
    let crowded = choose_budget(&model, &bounds(Some(30.0)), &CANDIDATES, 300, None);
    assert_eq!(crowded, Some(1024));
    // None fits: the smallest above the sequences decoding, and the search must climb.
    let tight = bounds(Some(11.0));
    assert_eq!(
        largest_budget_within_tpot(&model, &tight, &CANDIDATES, 64),
        None
    );
    assert_eq!(
        choose_budget(&model, &tight, &CANDIDATES, 64, None),
        Some(256)
    );
    assert_eq!(
        choose_budget(&model, &tight, &CANDIDATES, 300, None),
        Some(512)
    );
}

#[test]
fn the_share_of_time_on_prompts_keeps_the_budget_from_starving_them() {
    let model = learnt();
    // Prompts take 70 % of the time at 2048: at 512 they would take 118 %.
    let chosen = choose_budget(
        &model,
        &bounds(Some(30.0)),
        &CANDIDATES,
        64,
        Some((0.7, 2048)),
    );
    assert_eq!(chosen, Some(2048));
}

#[test]
fn the_phase_mix_prefers_a_cap_for_prompt_heavy_work_with_a_hysteresis() {
    let mut mix = PhaseMix::new(0.5, 0.3);
    let mut heavy = tick((10.0, 0.02), 2048, 64, 4, 1000, 0, 150.0);
    if let Some(requests) = heavy.requests.as_mut() {
        requests.prefill_time_share = Some(0.8);
    }
    assert!(!mix.prefers_cap());
    let mut changed = false;
    for _ in 0..100 {
        changed |= mix.observe(&heavy);
    }
    assert!(changed && mix.prefers_cap());
    // Decode-only ticks (no requests) bring it back, through the gap.
    let decode = testing::observation(0, 2);
    let mut ticks_to_lock = 0;
    while mix.prefers_cap() && ticks_to_lock < 1000 {
        mix.observe(&decode);
        ticks_to_lock += 1;
    }
    assert!(!mix.prefers_cap());
    assert!(mix.share().unwrap_or(1.0) < 0.3);
    assert!(ticks_to_lock > 5, "flipped after {ticks_to_lock} ticks");
    // An idle tick says nothing.
    let mut idle = testing::observation(0, 3);
    idle.tokens = 0;
    let before = mix.share();
    mix.observe(&idle);
    assert_eq!(mix.share(), before);
}

fn with_demand(mut observation: Observation, arrived: u64, turned_away: u64) -> Observation {
    observation.demand = Some(tokwatt_policy_sdk::Demand {
        requests_arrived: arrived,
        requests_completed: 0,
        requests_turned_away: turned_away,
        tokens_demanded: 0,
        queue_wait_p99_ms: None,
    });
    observation
}

#[test]
fn prompts_waiting_in_the_batch_for_their_chunks_are_counted_though_the_queue_is_empty() {
    let mut backlog = PromptBacklog::default();
    // Nine arrive, one gets its first token: eight wait, none of them in the queue.
    let mut busy = with_demand(tick((10.0, 0.02), 2048, 64, 1, 1000, 0, 300.0), 9, 0);
    backlog.observe(&busy);
    assert_eq!(backlog.requests(), 8.0);
    // Three more, two of them turned away, four first tokens.
    busy = with_demand(tick((10.0, 0.02), 2048, 64, 4, 1000, 0, 300.0), 3, 2);
    backlog.observe(&busy);
    assert_eq!(backlog.requests(), 5.0);
    // Never more than what is in flight and queued.
    busy = with_demand(tick((10.0, 0.02), 2048, 3, 0, 1000, 1, 300.0), 50, 0);
    if let Some(requests) = busy.requests.as_mut() {
        requests.prefill_tokens = 100;
    }
    backlog.observe(&busy);
    assert_eq!(backlog.requests(), 4.0);
    // A tick that prefilled nothing with nobody queued: nobody waited.
    let mut idle = with_demand(tick((10.0, 0.02), 2048, 64, 0, 1000, 0, 300.0), 0, 0);
    if let Some(requests) = idle.requests.as_mut() {
        requests.prefill_tokens = 0;
    }
    backlog.observe(&idle);
    assert_eq!(backlog.requests(), 0.0);
    // The step model predicts the last one's first token behind the others' prompts.
    let mut model = StepModel::new();
    for _ in 0..5 {
        model.observe(&with_demand(
            tick((10.0, 0.02), 2048, 64, 4, 1000, 0, 300.0),
            4,
            0,
        ));
    }
    assert_eq!(model.waiting_prompt_tokens(), 0.0);
    model.observe(&with_demand(
        tick((10.0, 0.02), 2048, 64, 4, 1000, 0, 300.0),
        14,
        0,
    ));
    assert_eq!(model.waiting_prompt_tokens(), 9000.0);
}
