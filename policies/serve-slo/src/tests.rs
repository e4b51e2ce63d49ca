use super::*;
use tokwatt_policy_sdk::{Knobs, Requests, testing};

fn objective(tpot_ms: Option<f64>, ttft_ms: Option<f64>) -> Objective {
    Objective {
        tpot_p99_limit_ms: tpot_ms,
        min_tokens_per_s: None,
        queue_wait_p99_limit_ms: None,
        ttft_p99_limit_ms: ttft_ms,
    }
}

fn policy(knobs: Knobs, objective: Objective, params: &[(&str, &str)]) -> (ServeSlo, Settings) {
    let mut args = testing::init_args(vec![testing::h200_serving(0)], knobs);
    args.objective = objective;
    args.params = testing::params(params);
    match ServeSlo::init(args) {
        Ok((policy, first)) => (policy, first[0]),
        Err(error) => panic!("init: {error}"),
    }
}

/// A serving tick: `budget` in force, 64 decoding, `queued` waiting, a decode step of
/// 10 ms and a full chunk's step at `tpot_p99_ms`, prompts of 1000 tokens.
fn serving(tick: u64, budget: u32, queued: u32, tpot_p99_ms: f64, ttft_ms: f64) -> Observation {
    let mut observation = testing::observation(0, tick);
    observation.in_force.token_budget = budget;
    observation.in_force.batch_size = 256;
    observation.active_sequences = 64;
    observation.queue_depth = queued;
    observation.tpot_p50_ms = 10.0;
    observation.tpot_p99_ms = tpot_p99_ms;
    // Four arrive and four get their first token: nobody waits in the batch.
    observation.demand = Some(tokwatt_policy_sdk::Demand {
        requests_arrived: 4 + u64::from(queued),
        requests_completed: 4,
        requests_turned_away: 0,
        tokens_demanded: 4 * 200,
        queue_wait_p99_ms: None,
    });
    observation.requests = Some(Requests {
        prefill_tokens: 4000,
        first_tokens: 4,
        ttft_p99_ms: Some(ttft_ms),
        prefill_time_share: Some(0.2),
        preemptions: Some(0),
        requests_finished: Some(4),
        energy_per_request_j: None,
    });
    observation
}

const ALL: Knobs = Knobs::SM_CLOCK
    .union(Knobs::BATCH_SIZE)
    .union(Knobs::TOKEN_BUDGET)
    .union(Knobs::POWER_CAP);

#[test]
fn a_broken_tpot_is_answered_with_smaller_chunks_before_fewer_sequences() {
    let (mut policy, _) = policy(ALL, objective(Some(30.0), Some(2000.0)), &[]);
    let decided = policy.decide(&[serving(1, 4096, 0, 45.0, 200.0)]);
    assert_eq!(decided[0].token_budget, Some(2048));
    assert_eq!(
        decided[0].batch_size, None,
        "the batch waits for the budget"
    );
    // At the floor, with the batch not full, fewer sequences would not shorten the
    // chunk's step: the batch stays.
    let decided = policy.decide(&[serving(2, 256, 0, 45.0, 200.0)]);
    assert_eq!(decided[0].token_budget, None);
    assert_eq!(decided[0].batch_size, None);
    // At the floor with every slot taken the batch goes.
    let mut full = serving(3, 256, 0, 45.0, 200.0);
    full.in_force.batch_size = 64;
    let decided = policy.decide(&[full]);
    assert_eq!(decided[0].token_budget, None);
    assert_eq!(decided[0].batch_size, Some(51), "80 % of the 64 decoding");
    // Demand beyond the GPU (requests wait at the top clock and cap): neither goes, the
    // budget goes to the largest (it serves the most).
    let mut overload = serving(4, 2048, 40, 45.0, 200.0);
    overload.in_force.batch_size = 64;
    let decided = policy.decide(&[overload]);
    assert_eq!(decided[0].batch_size, None);
    assert_ne!(decided[0].token_budget, Some(1024));
}

#[test]
fn first_tokens_predicted_late_raise_the_clock_before_any_is() {
    let (mut policy, first) = policy(ALL, objective(None, Some(500.0)), &[]);
    assert_eq!(first.sm_clock_max_mhz, Some(1980));
    // Walk the search down a little: quiet ticks at the top clock.
    let mut clock = 1980;
    for tick in 1..40 {
        let mut observation = serving(tick, 2048, 0, 20.0, 100.0);
        observation.in_force.sm_clock_max_mhz = clock;
        if let Some(mhz) = policy.decide(&[observation])[0].sm_clock_max_mhz {
            clock = mhz;
        }
    }
    assert!(clock < 1980, "the search never moved down");
    // Forty prompts queue up; the last first token was still on time.
    let mut observation = serving(40, 2048, 40, 20.0, 100.0);
    observation.in_force.sm_clock_max_mhz = clock;
    let decided = policy.decide(&[observation]);
    let raised = decided[0].sm_clock_max_mhz.unwrap_or(0);
    assert!(raised > clock, "{raised} <= {clock}");
}

#[test]
fn under_batch_only_the_budget_and_the_batch_run_alone() {
    let knobs = Knobs::BATCH_SIZE | Knobs::TOKEN_BUDGET;
    let (mut policy, first) = policy(knobs, objective(Some(30.0), Some(2000.0)), &[]);
    assert_eq!(first, Settings::unchanged());
    let mut saw_budget = false;
    for tick in 1..30 {
        let decided = policy.decide(&[serving(tick, 4096, 0, 25.0, 200.0)]);
        assert_eq!(decided[0].sm_clock_max_mhz, None);
        assert_eq!(decided[0].power_cap_w, None);
        saw_budget |= decided[0].token_budget.is_some();
    }
    assert!(saw_budget, "the budget never moved");
}

#[test]
fn prompt_heavy_work_moves_to_the_power_cap_and_releases_the_lock() {
    let (mut policy, _) = policy(
        ALL,
        objective(None, Some(5000.0)),
        &[("knob_choice", "auto")],
    );
    let mut released = false;
    let mut capped = false;
    for tick in 1..200 {
        let mut observation = serving(tick, 2048, 0, 20.0, 100.0);
        observation.in_force.sm_clock_max_mhz = 1500;
        if let Some(requests) = observation.requests.as_mut() {
            requests.prefill_time_share = Some(0.9);
        }
        let decided = policy.decide(&[observation]);
        released |= decided[0].sm_clock_max_mhz == Some(1980);
        capped |= decided[0].power_cap_w.is_some();
    }
    assert!(released && capped, "released {released}, capped {capped}");
    // Told to keep the clock, it never caps.
    let (mut clock_only, _) = self::policy(
        ALL,
        objective(None, Some(5000.0)),
        &[("knob_choice", "clock")],
    );
    for tick in 1..200 {
        let mut observation = serving(tick, 2048, 0, 20.0, 100.0);
        if let Some(requests) = observation.requests.as_mut() {
            requests.prefill_time_share = Some(0.9);
        }
        assert_eq!(clock_only.decide(&[observation])[0].power_cap_w, None);
    }
}

#[test]
fn nonsense_from_the_host_costs_nothing() {
    let (mut policy, _) = policy(ALL, objective(Some(30.0), Some(500.0)), &[]);
    let mut observation = serving(1, 2048, 3, f64::NAN, f64::NAN);
    observation.energy_j = f64::NAN;
    observation.gpu_util_pct = f64::INFINITY;
    observation.in_force.power_cap_w = f64::NAN;
    if let Some(requests) = observation.requests.as_mut() {
        requests.prefill_time_share = Some(-3.0);
    }
    for _ in 0..10 {
        let _ = policy.decide(std::slice::from_ref(&observation));
    }
    // A GPU it does not manage is left alone.
    let stranger = serving(1, 2048, 0, 20.0, 100.0);
    let mut stranger = stranger;
    stranger.gpu = 7;
    assert_eq!(policy.decide(&[stranger]), vec![Settings::unchanged()]);
}

#[test]
fn bad_parameters_and_no_knob_are_refused_by_name() {
    let refused = |knobs: Knobs, params: &[(&str, &str)]| {
        let mut args = testing::init_args(vec![testing::h200_serving(0)], knobs);
        args.params = testing::params(params);
        ServeSlo::init(args).err().unwrap_or_default()
    };
    assert!(refused(ALL, &[("knob_choice", "both")]).contains("knob_choice"));
    assert!(refused(ALL, &[("ttft_guard", "1.5")]).contains("ttft_guard"));
    assert!(refused(ALL, &[("lock_below", "0.9")]).contains("lock_below"));
    assert!(refused(ALL, &[("budget_floor", "0")]).contains("budget_floor"));
    assert!(refused(ALL, &[("no_such_key", "1")]).contains("no_such_key"));
    assert!(refused(Knobs::empty(), &[]).contains("none of them is granted"));
}
