//! Fixture plugins that misbehave: each failure costs a tick, never the run, and never
//! drives the GPU outside its envelope.

use crate::support::*;

fn run_fixture(fixture: &str, duration: &str, extra: &str) -> RunResult {
    let dir = tempdir();
    let spec = write_spec(dir.path(), fixture, &built_plugin(fixture), extra);
    let out = dir.path().join("out");
    let r = run_sim(&spec, duration, &out, &[]);
    // Keep the temp dir alive until the files are read.
    drop(dir);
    r
}

fn counters(r: &RunResult) -> &serde_json::Value {
    &r.summary["policy_counters"]
}

#[test]
fn infinite_loop_is_stopped_by_fuel_or_deadline_and_ejected() {
    let r = run_fixture("fixture_infinite_loop", "2m", "");
    assert_run_sound(&r, 120);
    let c = counters(&r);
    let stopped = num(c, "fuel_exhausted") + num(c, "deadlines_missed");
    assert!(stopped >= 3.0, "{c}");
    assert!(num(c, "ejections") >= 1.0, "{c}");
    assert_eq!(
        num(&r.summary, "fallback_ticks"),
        120.0,
        "every tick fell back"
    );
    assert!(num(&r.summary, "plugin_traps") >= 3.0);
}

#[test]
fn deadline_stops_a_loop_that_has_fuel_to_spare() {
    let r = run_fixture(
        "fixture_infinite_loop",
        "30s",
        "[sandbox]\nfuel_per_call = 100000000000000\ndeadline_ms = 20",
    );
    assert!(
        num(counters(&r), "deadlines_missed") >= 1.0,
        "{}",
        counters(&r)
    );
}

#[test]
fn memory_bomb_hits_the_memory_limit() {
    let r = run_fixture("fixture_memory_bomb", "1m", "[sandbox]\nmemory_mib = 16");
    assert_run_sound(&r, 60);
    assert!(
        num(counters(&r), "memory_limit_hits") >= 1.0,
        "{}",
        counters(&r)
    );
}

#[test]
fn trap_in_decide_costs_only_the_failing_ticks() {
    let r = run_fixture("fixture_trap_decide", "2m", "");
    assert_run_sound(&r, 120);
    let fallback: Vec<bool> = r
        .trace
        .iter()
        .map(|row| row.fields["fallback"] == "1")
        .collect();
    assert!(!fallback[0] && !fallback[1], "the first two calls succeed");
    assert!(fallback[2], "the third call traps");
    assert!(num(counters(&r), "traps") >= 1.0);
    assert!(
        num(counters(&r), "rebuilds") >= 1.0,
        "the store is rebuilt after a trap"
    );
}

#[test]
fn bad_numbers_are_clamped_and_never_reach_the_gpu() {
    let r = run_fixture(
        "fixture_bad_numbers",
        "2m",
        "[guardrails]\npower_cap_min_w = 300.0\nmax_power_cap_step_w = 50.0\nbatch_size_max = 256",
    );
    assert_run_sound(&r, 120);
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
fn wrong_length_answers_fall_back() {
    let r = run_fixture("fixture_wrong_length", "1m", "");
    assert_run_sound(&r, 60);
    assert!(
        num(counters(&r), "invalid_answers") >= 1.0,
        "{}",
        counters(&r)
    );
    assert!(num(&r.summary, "fallback_ticks") >= 1.0);
}

#[test]
fn log_flood_is_rate_limited() {
    let r = run_fixture("fixture_log_flood", "30s", "");
    assert!(
        num(counters(&r), "logs_dropped") > 1000.0,
        "{}",
        counters(&r)
    );
    assert_eq!(num(&r.summary, "fallback_ticks"), 0.0);
}

#[test]
fn trap_in_init_is_a_clear_error() {
    let dir = tempdir();
    let spec = write_spec(
        dir.path(),
        "trap-init",
        &built_plugin("fixture_trap_init"),
        "",
    );
    let output = tokwatt()
        .args([
            "run",
            "--sim",
            "h200",
            "--quiet",
            "--duration",
            "10s",
            "--policy",
        ])
        .arg(&spec)
        .arg("--out")
        .arg(dir.path().join("out"))
        .output()
        .expect("runs");
    assert!(!output.status.success());
    let err = stderr(&output);
    assert!(
        err.contains("failed to start") && err.contains("trap"),
        "{err}"
    );
    assert!(!err.contains("thread 'main' panicked"), "{err}");
}

#[test]
fn other_contract_versions_are_refused() {
    let dir = tempdir();
    let spec = write_spec(dir.path(), "v1", &built_plugin("fixture_wrong_version"), "");
    let output = tokwatt().arg("check").arg(&spec).output().expect("runs");
    assert!(!output.status.success());
    let err = stderr(&output);
    assert!(err.contains("1.0.0") && err.contains("0.1.*"), "{err}");
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
