//! The policy against a made-up GPU with the shape of the simulator's H200: step time
//! linear in the sequences decoding, slower at lower clocks; power falling with the
//! clock; Poisson-free demand in tokens per second.

use super::*;
use tokwatt_policy_sdk::{Objective, StateWriter, testing};

const LIMIT_MS: f64 = 20.0;

#[derive(Debug, Clone)]
struct Gpu {
    batch: u32,
    clock: u32,
    /// Demand, tokens per second.
    demand: f64,
    queue: f64,
    settling: bool,
    /// Multiplies every step time (a longer context, say).
    slowness: f64,
    /// The p99 is reported as NaN, as the host does when a serving engine saw no
    /// request end in the tick.
    latency_unknown: bool,
    /// Each tick's p99 strays uniformly by up to this fraction (short requests, a noisy
    /// board), drawn from `noise`.
    jitter: f64,
    noise: u64,
}

impl Gpu {
    fn step_ms(&self, sequences: f64) -> f64 {
        self.slowness * (4.8 + 0.056 * sequences) * (1980.0 / f64::from(self.clock)).powf(0.8)
    }

    /// One second: the sequences that the demand keeps busy (at most the batch), the
    /// tokens made, and the queue of requests (in tokens) that did not fit.
    fn tick(&mut self, gpu: u32, tick: u64) -> Observation {
        // Fixed point of x = demand * step(x), as Little's law has it.
        let mut sequences: f64 = 1.0;
        for _ in 0..50 {
            sequences = (self.demand * self.step_ms(sequences) / 1000.0).min(f64::from(self.batch));
        }
        let capacity = sequences * 1000.0 / self.step_ms(sequences);
        let backlog = self.queue >= 256.0 || self.demand > capacity * 1.001;
        if backlog {
            sequences = f64::from(self.batch);
        }
        let made = (sequences * 1000.0 / self.step_ms(sequences)).min(self.demand + self.queue);
        self.queue = (self.queue + self.demand - made).max(0.0);
        let power_w = 120.0
            + 520.0 * (f64::from(self.clock) / 1980.0).powi(2) * (0.4 + 0.6 * sequences / 512.0);
        let mut observation = testing::observation(gpu, tick);
        observation.tokens = made as u64;
        observation.energy_j = power_w;
        observation.tokens_per_s = made;
        observation.tokens_per_joule = made / power_w;
        // A linear congruential step: uniform in [0, 1) from the top 53 bits.
        self.noise = self
            .noise
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let uniform = (self.noise >> 11) as f64 / (1u64 << 53) as f64;
        observation.tpot_p99_ms = if self.latency_unknown {
            f64::NAN
        } else {
            self.step_ms(sequences) * 1.04 * (1.0 + self.jitter * (2.0 * uniform - 1.0))
        };
        observation.active_sequences = sequences.round().max(1.0) as u32;
        observation.queue_depth = (self.queue / 256.0).floor() as u32;
        observation.in_force.batch_size = self.batch;
        observation.in_force.sm_clock_max_mhz = self.clock;
        observation.settling = self.settling;
        observation
    }

    fn apply(&mut self, settings: &Settings) {
        let mut changed = false;
        if let Some(batch) = settings.batch_size {
            changed |= batch != self.batch;
            self.batch = batch;
        }
        if let Some(clock) = settings.sm_clock_max_mhz {
            changed |= clock != self.clock;
            self.clock = clock;
        }
        self.settling = changed;
    }
}

struct Run {
    policy: SloBatch,
    gpu: Gpu,
    tick: u64,
    violations: u32,
}

impl Run {
    fn new(knobs: Knobs, demand: f64) -> Run {
        Run::with_limit(knobs, demand, Some(LIMIT_MS))
    }

    fn with_limit(knobs: Knobs, demand: f64, limit_ms: Option<f64>) -> Run {
        let mut args = testing::init_args(vec![testing::h200(0)], knobs);
        args.objective = Objective {
            tpot_p99_limit_ms: limit_ms,
            min_tokens_per_s: None,
            queue_wait_p99_limit_ms: None,
            ttft_p99_limit_ms: None,
        };
        let (policy, first) = SloBatch::init(args).unwrap();
        let mut gpu = Gpu {
            batch: 512,
            clock: 1980,
            demand,
            queue: 0.0,
            settling: false,
            slowness: 1.0,
            latency_unknown: false,
            jitter: 0.0,
            noise: 1,
        };
        gpu.apply(&first[0]);
        Run {
            policy,
            gpu,
            tick: 0,
            violations: 0,
        }
    }

    fn run(&mut self, ticks: u64) {
        for _ in 0..ticks {
            let observation = self.gpu.tick(0, self.tick);
            self.violations += u32::from(observation.tpot_p99_ms > LIMIT_MS);
            let settings = self.policy.decide(&[observation]);
            self.gpu.apply(&settings[0]);
            self.tick += 1;
        }
    }
}

/// The largest batch under the limit at 1980 MHz: 4.8 + 0.056 b <= 20 / 1.04.
fn limit_batch() -> f64 {
    (LIMIT_MS / 1.04 - 4.8) / 0.056
}

#[test]
fn batch_only_under_saturation_reaches_the_limit_fast_without_violations() {
    let mut run = Run::new(Knobs::BATCH_SIZE, 1e6);
    assert_eq!(run.gpu.batch, 64);
    run.run(12);
    let batch = f64::from(run.gpu.batch);
    assert!(
        batch >= 0.85 * limit_batch() && batch <= limit_batch(),
        "{batch}"
    );
    run.run(300);
    assert_eq!(run.violations, 0);
    assert_eq!(run.gpu.clock, 1980);
}

#[test]
fn light_load_lowers_the_clock_while_latency_allows() {
    let mut run = Run::new(Knobs::BATCH_SIZE | Knobs::SM_CLOCK, 1500.0);
    run.run(120);
    assert!(run.gpu.clock < 1000, "{}", run.gpu.clock);
    assert!(run.violations <= 2, "{}", run.violations);
    assert!(run.gpu.queue < 1.0);
    let observation = run.gpu.clone().tick(0, 0);
    assert!(observation.tpot_p99_ms <= LIMIT_MS);
}

#[test]
fn medium_load_stops_where_the_demand_needs_the_clock() {
    let mut run = Run::new(Knobs::BATCH_SIZE | Knobs::SM_CLOCK, 9000.0);
    run.run(300);
    assert!(run.violations <= 3, "{}", run.violations);
    assert!(run.gpu.queue < 512.0, "{}", run.gpu.queue);
    // Lower than the top clock, but the demand holds it well above the light-load clock.
    assert!((700..1980).contains(&run.gpu.clock), "{}", run.gpu.clock);
}

#[test]
fn re_explores_when_the_workload_shifts() {
    let mut run = Run::new(Knobs::BATCH_SIZE | Knobs::SM_CLOCK, 1500.0);
    run.run(120);
    let light_clock = run.gpu.clock;
    // Heavy load arrives: the clock must come back up and the queue must not run away.
    run.gpu.demand = 10_000.0;
    run.run(200);
    assert!(
        run.gpu.clock > light_clock,
        "{} vs {light_clock}",
        run.gpu.clock
    );
    assert!(run.gpu.queue < 2048.0, "{}", run.gpu.queue);
    let heavy_clock = run.gpu.clock;
    // And light load again: down again, after forgetting the heavy load's floor.
    run.gpu.demand = 1500.0;
    run.run(200);
    assert!(
        run.gpu.clock < heavy_clock,
        "{} vs {heavy_clock}",
        run.gpu.clock
    );
    assert!(run.violations <= 8, "{}", run.violations);
}

#[test]
fn a_slower_workload_is_met_by_a_smaller_batch_at_once() {
    let mut run = Run::new(Knobs::BATCH_SIZE, 1e6);
    run.run(60);
    let before = run.gpu.batch;
    run.gpu.slowness = 1.4;
    run.run(30);
    assert!(run.gpu.batch < before, "{} vs {before}", run.gpu.batch);
    assert!(run.violations <= 2, "{}", run.violations);
}

#[test]
fn knobs_objective_and_parameters_are_checked() {
    let init = |knobs: Knobs, limit: Option<f64>, params: &[(&str, &str)]| {
        let mut args = testing::init_args(vec![testing::h200(0)], knobs);
        args.objective.tpot_p99_limit_ms = limit;
        args.params = testing::params(params);
        SloBatch::init(args).err().unwrap_or_default()
    };
    assert!(init(Knobs::POWER_CAP, Some(20.0), &[]).contains("\"batch-size\""));
    assert!(init(Knobs::BATCH_SIZE, Some(-1.0), &[]).contains("tpot_p99_limit_ms"));
    assert!(init(Knobs::BATCH_SIZE, Some(20.0), &[("headroom", "2")]).contains("headroom"));
    assert!(init(Knobs::BATCH_SIZE, Some(20.0), &[("x", "2")]).contains("unknown parameter `x`"));
}

#[test]
fn state_hands_over_and_foreign_state_is_refused() {
    let mut old = Run::new(Knobs::BATCH_SIZE | Knobs::SM_CLOCK, 1500.0);
    old.run(60);
    let mut new = Run::new(Knobs::BATCH_SIZE | Knobs::SM_CLOCK, 1500.0);
    testing::assert_hands_over(&old.policy, &mut new.policy);
    assert_eq!(
        new.policy.gpus[0].clock_index,
        old.policy.gpus[0].clock_index
    );
    assert_eq!(new.policy.gpus[0].fit, old.policy.gpus[0].fit);
    let other = StateWriter::new().u32(1).finish(2);
    testing::assert_restore_refused(&mut new.policy, other, "got version 2");
    let mut truncated = old.policy.snapshot();
    truncated.bytes.pop();
    testing::assert_restore_refused(&mut new.policy, truncated, "state ends early");
}

#[test]
fn without_a_latency_limit_the_batch_grows_to_the_largest_and_the_queue_bounds_the_clock() {
    let mut run = Run::with_limit(Knobs::BATCH_SIZE | Knobs::SM_CLOCK, 1e6, None);
    run.run(20);
    assert_eq!(run.gpu.batch, 512);
    // Saturated: the queue never drains, so the clock stays at the top.
    assert_eq!(run.gpu.clock, 1980);
    let mut light = Run::with_limit(Knobs::BATCH_SIZE | Knobs::SM_CLOCK, 3000.0, None);
    light.run(300);
    assert!(light.gpu.clock < 1500, "{}", light.gpu.clock);
    assert!(light.gpu.queue < 5_000.0, "{}", light.gpu.queue);
}

#[test]
fn an_unknown_latency_neither_grows_the_batch_nor_lowers_the_clock() {
    for demand in [1500.0, 1e6] {
        let mut run = Run::new(Knobs::BATCH_SIZE | Knobs::SM_CLOCK, demand);
        run.gpu.latency_unknown = true;
        run.run(120);
        assert_eq!(
            (run.gpu.batch, run.gpu.clock),
            (64, 1980),
            "demand {demand}: unknown latency was read as room"
        );
    }
}

#[test]
fn a_backlog_while_the_latency_is_unknown_raises_the_clock() {
    let mut run = Run::new(Knobs::BATCH_SIZE | Knobs::SM_CLOCK, 1500.0);
    run.run(120);
    let light_clock = run.gpu.clock;
    assert!(light_clock < 1000, "{light_clock}");
    let batch = run.gpu.batch;
    // Heavy load arrives while the engine reports no request end: only the queue tells.
    run.gpu.latency_unknown = true;
    run.gpu.demand = 10_000.0;
    run.run(60);
    assert!(
        run.gpu.clock > light_clock,
        "{} vs {light_clock}: the backlog went unanswered",
        run.gpu.clock
    );
    assert_eq!(run.gpu.batch, batch, "the batch moved on unknown latency");
}

#[test]
fn without_a_latency_limit_an_unknown_latency_does_not_hold_the_clock_up() {
    // Only the queue and the batch's fill bound the clock here; the latency plays no part.
    let mut run = Run::with_limit(Knobs::BATCH_SIZE | Knobs::SM_CLOCK, 3000.0, None);
    run.gpu.latency_unknown = true;
    run.run(300);
    assert!(run.gpu.clock < 1980, "{}", run.gpu.clock);
    assert!(run.gpu.queue < 5_000.0, "{}", run.gpu.queue);
}

#[test]
fn a_batch_stuck_at_one_with_requests_waiting_probes_up_to_the_limit() {
    // A step dominated by the weights' read (12 ms at one sequence, 0.14 ms more per
    // sequence): the line through the origin from points at one sequence predicts 25 ms
    // for two, so without a probe the batch stays at 1 while the queue grows.
    let mut run = Run::new(Knobs::BATCH_SIZE, 1e6);
    run.gpu.slowness = 2.5;
    run.gpu.batch = 1;
    run.policy.gpus[0].batch_target = 1;
    run.policy.gpus[0].fit.clear();
    run.run(40);
    let limit = (LIMIT_MS / 1.04 / 2.5 - 4.8) / 0.056;
    assert!(
        f64::from(run.gpu.batch) > 0.5 * limit,
        "batch {} of a limit of {limit:.0}",
        run.gpu.batch
    );
    assert!(f64::from(run.gpu.batch) <= limit, "batch {}", run.gpu.batch);
    assert_eq!(run.violations, 0);
}

#[test]
fn a_p99_that_strays_more_than_the_headroom_covers_is_kept_further_under_the_limit() {
    // ±15 % per tick: at the shipped 90 % headroom one tick in eight would break the limit.
    let mut run = Run::new(Knobs::BATCH_SIZE, 1e6);
    run.gpu.jitter = 0.15;
    run.run(100);
    let settling_in = run.violations;
    run.run(600);
    let violations = run.violations - settling_in;
    assert!(violations <= 6, "{violations} of 600 ticks over the limit");
    // It still fills most of what the margin allows.
    assert!(
        f64::from(run.gpu.batch) >= 0.5 * limit_batch(),
        "batch {}",
        run.gpu.batch
    );
}

#[test]
fn a_backlog_at_the_top_clock_lets_the_batch_past_the_scatter_margin() {
    // A p99 that strays by 10 % keeps the target 3 standard deviations under the 20 ms
    // limit (15.4 ms). When the queue has not drained for two windows at the top clock,
    // requests will be turned away: the batch may go to the limit less one standard
    // deviation (18.2 ms), some 19 % more sequences.
    let mut run = Run::new(Knobs::BATCH_SIZE | Knobs::SM_CLOCK, 1e6);
    let p99 = |sequences: f64| 1.04 * (4.8 + 0.056 * sequences);
    let decide = |run: &mut Run, backlog_windows: u32| {
        let gpu = &mut run.policy.gpus[0];
        gpu.p99_scatter_sq = 0.10 * 0.10;
        gpu.backlog_windows = backlog_windows;
        gpu.clock_index = 0;
        gpu.batch_target = 150;
        gpu.fit.clear();
        for sequences in [120, 130, 140, 150] {
            gpu.fit.add(sequences, p99(f64::from(sequences)));
        }
        let mut observation = testing::observation(0, 100);
        observation.tokens = 10_000;
        observation.tpot_p99_ms = p99(150.0);
        observation.active_sequences = 150;
        observation.queue_depth = 400;
        observation.in_force.batch_size = 150;
        observation.in_force.sm_clock_max_mhz = 1980;
        run.policy.decide(&[observation])[0].batch_size
    };
    let held = decide(&mut run, 0).expect("the batch grows");
    let backlog = decide(&mut run, 2).expect("the batch grows");
    println!("batch at the margin {held}, with a backlog at the top clock {backlog}");
    assert!(
        f64::from(backlog) > 1.1 * f64::from(held),
        "past the margin: {backlog} (at the margin: {held})"
    );
}
