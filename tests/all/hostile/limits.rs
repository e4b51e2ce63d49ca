//! Plugins that run into fuel, the deadline, the memory and table limits, the counts of
//! memories and instances, or the stack.

use super::*;

#[test]
fn infinite_loop_is_stopped_by_fuel_or_deadline_and_ejected() {
    let r = run_fixture("fixture_infinite_loop", "1m", "");
    assert_run_sound(&r, 60);
    let c = counters(&r);
    assert!(
        failures(&r, "fuel") + failures(&r, "deadline") >= 3.0,
        "{c}"
    );
    assert!(num(c, "ejections") >= 1.0, "{c}");
    assert_eq!(
        num(&r.summary, "fallback_ticks"),
        60.0,
        "every tick fell back"
    );
    assert!(num(&r.summary, "plugin_traps") >= 3.0);
}

#[test]
fn deadline_stops_a_loop_that_has_fuel_to_spare() {
    let r = run_fixture(
        "fixture_infinite_loop",
        "20s",
        "[sandbox]\nfuel_per_call = 100000000000000\ndeadline_ms = 10",
    );
    assert_run_sound(&r, 20);
    assert!(failures(&r, "deadline") >= 3.0, "{}", counters(&r));
    assert!(num(counters(&r), "ejections") >= 1.0);
}

#[test]
fn memory_bomb_hits_the_memory_limit() {
    let r = run_fixture("fixture_memory_bomb", "20s", "[sandbox]\nmemory_mib = 16");
    assert_run_sound(&r, 20);
    assert!(failures(&r, "memory") >= 3.0, "{}", counters(&r));
    assert!(num(counters(&r), "ejections") >= 1.0);
}

#[test]
fn a_leak_every_call_hits_the_limit_and_the_rebuild_starts_clean() {
    // 8 MiB leaked per call against 24 MiB: every third or so call fails, and the
    // rebuilt instance starts from nothing again; one failure ejects here.
    let r = run_hostile(
        "leak",
        "20s",
        "[sandbox]\nmemory_mib = 24\n[breaker]\nfailures_to_eject = 1\nbackoff_ticks = 1",
    );
    assert_run_sound(&r, 20);
    assert!(failures(&r, "memory") >= 2.0, "{}", counters(&r));
    assert!(num(counters(&r), "rebuilds") >= 2.0, "{}", counters(&r));
    assert!(num(counters(&r), "ejections") >= 2.0, "{}", counters(&r));
    assert!(num(&r.summary, "fallback_ticks") < 20.0, "it also decided");
}

#[test]
fn stack_overflow_is_a_named_trap() {
    let r = run_hostile("stack-overflow", "10s", "");
    assert_run_sound(&r, 10);
    assert!(failures(&r, "trap") >= 3.0, "{}", counters(&r));
    assert!(num(counters(&r), "ejections") >= 1.0);
}

#[test]
fn draining_entropy_is_bounded() {
    // A million host calls per tick: the call finishes or is stopped, never the run.
    let r = run_hostile("entropy-drain", "10s", "[sandbox]\nfuel_per_call = 5000000");
    assert_run_sound(&r, 10);
    assert!(
        failures(&r, "fuel") + failures(&r, "deadline") >= 3.0,
        "{}",
        counters(&r)
    );
    assert!(num(counters(&r), "ejections") >= 1.0);
}

fn synth_refused(shape: synth::Shape, extra: &str) -> String {
    let dir = tempdir();
    let plugin = plugin_file(dir.path(), "synth.wasm", &synth::policy_component(shape));
    stderr(&run_refused(&plugin, extra))
}

#[test]
fn many_memories_cannot_slip_past_the_memory_limit() {
    // Three 10 MiB memories against 16 MiB: each is under the limit, the instance is not.
    let err = synth_refused(
        synth::Shape {
            memories: 3,
            memory_pages: 160,
            table_elements: 1,
        },
        "[sandbox]\nmemory_mib = 16",
    );
    assert!(err.contains("memory limit of 16 MiB"), "{err}");
}

#[test]
fn too_many_memories_are_refused_by_count() {
    let err = synth_refused(
        synth::Shape {
            memories: 32,
            memory_pages: 1,
            table_elements: 1,
        },
        "",
    );
    assert!(err.contains("memory count too high"), "{err}");
}

#[test]
fn a_huge_table_hits_the_table_limit() {
    let err = synth_refused(
        synth::Shape {
            memories: 1,
            memory_pages: 1,
            table_elements: 10_000_000,
        },
        "",
    );
    assert!(err.contains("table limit"), "{err}");
}

/// An `init` stopped by the wall clock is started afresh before the policy is refused (a
/// busy machine can make a sound `init` late); one stopped by fuel is the guest's own
/// doing and is refused at once.
#[test]
fn an_init_late_by_the_clock_is_tried_again_and_one_out_of_fuel_is_not() {
    let plugin = built_plugin("fixture_hostile");
    let by_clock = stderr(&run_refused(
        &plugin,
        &hostile_extra(
            "spin-init",
            "[sandbox]\nfuel_per_call = 1000000000000\ndeadline_ms = 5",
        ),
    ));
    assert!(
        by_clock.contains("missed its deadline of 5 ms"),
        "{by_clock}"
    );
    assert_eq!(
        by_clock.matches("starting it again").count(),
        2,
        "three starts in all: {by_clock}"
    );

    let by_fuel = stderr(&run_refused(
        &plugin,
        &hostile_extra("spin-init", "[sandbox]\nfuel_per_call = 1000000"),
    ));
    assert!(by_fuel.contains("fuel"), "{by_fuel}");
    assert!(!by_fuel.contains("starting it again"), "{by_fuel}");
}
