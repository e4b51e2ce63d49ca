//! Plugins that wait in a host call, where fuel and the epoch deadline do not run: the
//! host offers nothing that blocks (a virtual monotonic clock, closed stdin).

use std::time::{Duration, Instant};

use super::*;

#[test]
fn sleeping_in_decide_keeps_the_tick_schedule() {
    let started = Instant::now();
    let r = run_hostile("sleep-decide", "20s", "");
    assert_run_sound(&r, 20);
    assert_eq!(num(&r.summary, "fallback_ticks"), 0.0, "{}", counters(&r));
    // 20 sleeps of 60 s would take 20 minutes if they blocked; the bound is far from
    // both that and the run's real time (not a speed target: a proof of not blocking).
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn sleeping_in_init_does_not_hold_up_the_start() {
    let started = Instant::now();
    let r = run_hostile("sleep-init", "10s", "");
    assert_run_sound(&r, 10);
    // A blocking 10-minute sleep in `init` against a bound of one minute.
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn sleeping_forever_is_stopped_and_ejected() {
    let r = run_hostile("sleep-forever", "20s", "[sandbox]\nfuel_per_call = 2000000");
    assert_run_sound(&r, 20);
    assert!(
        failures(&r, "fuel") + failures(&r, "deadline") >= 3.0,
        "{}",
        counters(&r)
    );
    assert!(num(counters(&r), "ejections") >= 1.0, "{}", counters(&r));
}

#[test]
fn reading_stdin_does_not_block() {
    let r = run_hostile("read-stdin", "10s", "");
    assert_run_sound(&r, 10);
    assert_eq!(num(&r.summary, "fallback_ticks"), 0.0, "{}", counters(&r));
}
