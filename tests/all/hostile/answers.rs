//! Plugins whose answers are wrong, or that trap or refuse while answering.

use super::*;

#[test]
fn trap_in_decide_costs_only_the_failing_ticks() {
    let r = run_fixture("fixture_trap_decide", "20s", "");
    assert_run_sound(&r, 20);
    let fallback: Vec<bool> = r
        .trace
        .iter()
        .map(|row| row.fields["fallback"] == "1")
        .collect();
    assert!(!fallback[0] && !fallback[1], "the first two calls succeed");
    assert!(fallback[2], "the third call traps");
    assert!(failures(&r, "trap") >= 1.0, "{}", counters(&r));
    assert!(num(counters(&r), "rebuilds") >= 1.0, "rebuilt after a trap");
}

#[test]
fn bad_numbers_are_clamped_and_never_reach_the_gpu() {
    let r = run_fixture(
        "fixture_bad_numbers",
        "30s",
        "[guardrails]\npower_cap_min_w = 300.0\nmax_power_cap_step_w = 50.0\nbatch_size_max = 256",
    );
    assert_run_sound(&r, 30);
    assert!(num(&r.summary, "clamped_decisions") > 0.0);
    assert!(num(&r.summary, "non_finite_values") > 0.0);
    let mut previous = 700.0;
    for row in &r.trace {
        let cap = row.f64("power_cap_w");
        assert!((300.0..=700.0).contains(&cap), "guardrail held: {cap}");
        assert!(
            (cap - previous).abs() <= 50.0 + 1e-6,
            "rate limit held: {previous} -> {cap}"
        );
        previous = cap;
        assert!(row.f64("batch_size") <= 256.0);
    }
}

#[test]
fn nan_everywhere_never_reaches_the_gpu() {
    let r = run_hostile("nan", "20s", "");
    assert_run_sound(&r, 20);
    assert!(
        num(&r.summary, "non_finite_values") >= 20.0,
        "{}",
        r.summary
    );
    for row in &r.trace {
        assert!(row.f64("power_cap_w").is_finite());
    }
}

#[test]
fn wrong_length_answers_fall_back_and_eject() {
    let r = run_fixture("fixture_wrong_length", "30s", "");
    assert_run_sound(&r, 30);
    assert!(failures(&r, "invalid") >= 1.0, "{}", counters(&r));
    assert!(num(&r.summary, "fallback_ticks") >= 1.0);
}

#[test]
fn log_flood_is_rate_limited() {
    let r = run_fixture("fixture_log_flood", "20s", "");
    assert_run_sound(&r, 20);
    assert!(
        num(counters(&r), "logs_dropped") > 1000.0,
        "{}",
        counters(&r)
    );
    assert_eq!(num(&r.summary, "fallback_ticks"), 0.0);
}

#[test]
fn trap_in_init_is_a_clear_error() {
    let output = run_refused(&built_plugin("fixture_trap_init"), "");
    let err = stderr(&output);
    assert!(
        err.contains("failed to start") && err.contains("trap"),
        "{err}"
    );
    assert!(
        !err.contains("wasm backtrace"),
        "the cause, not the addresses: {err}"
    );
}

#[test]
fn a_panic_names_its_message() {
    let r = run_hostile("panic-decide-message", "10s", "");
    assert_run_sound(&r, 10);
    assert!(failures(&r, "trap") >= 3.0, "{}", counters(&r));
    assert!(num(counters(&r), "ejections") >= 1.0);
}

#[test]
fn a_well_behaved_stateful_plugin_is_followed_tick_by_tick() {
    // The stateful fixture asks for 200 + n W at call n: the envelope lets each through
    // (they are in range), so the trace shows the policy's answers applied in order.
    let r = run_fixture(
        "fixture_stateful",
        "20s",
        "[guardrails]\npower_cap_min_w = 200.0",
    );
    assert_run_sound(&r, 20);
    let caps: Vec<f64> = r.trace.iter().map(|row| row.f64("power_cap_w")).collect();
    // Row n shows the cap in force during tick n, set by call n (1-based: 200 + n).
    assert_eq!(caps[5], 205.0, "{caps:?}");
    assert!(
        caps.windows(2).skip(1).all(|w| w[1] == w[0] + 1.0),
        "{caps:?}"
    );
    assert_eq!(num(&r.summary, "fallback_ticks"), 0.0);
}
