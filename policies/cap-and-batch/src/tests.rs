//! Both loops against a made-up GPU whose latency grows with the batch and falls with
//! the cap, and whose efficiency peaks at a known cap.

use super::*;
use crate::cap::Direction;
use tokwatt_policy_sdk::testing;

/// The latency limit most tests run under.
const LIMIT_MS: f64 = 20.0;

/// How many sequences want to decode.
#[derive(Debug, Clone, Copy)]
enum Demand {
    /// A closed loop: every slot is refilled at once, so the batch is always full and
    /// the queue always empty.
    Saturated,
    /// This many requests in the system: the batch takes what fits, the rest waits.
    Requests(u32),
}

/// The simulated host's rate limit on the batch size, as in the shipped spec.
const MAX_BATCH_STEP: u32 = 64;

/// One simulated GPU. p99 time per token grows linearly with the sequences decoding and
/// as the cap falls; tokens per joule follow a parabola in the cap peaking at `best_w`,
/// scaled by how full the batch is. The host applies a requested cap at once (200-700
/// W) and a batch size in steps of at most [`MAX_BATCH_STEP`] (1-512), and marks the
/// next tick as settling after any change.
#[derive(Debug, Clone)]
struct SimGpu {
    best_w: f64,
    demand: Demand,
    cap_w: f64,
    batch: u32,
    settling: bool,
}

impl SimGpu {
    fn active(&self) -> u32 {
        match self.demand {
            Demand::Saturated => self.batch,
            Demand::Requests(requests) => requests.min(self.batch),
        }
    }

    fn queue(&self) -> u32 {
        match self.demand {
            Demand::Saturated => 0,
            Demand::Requests(requests) => requests - self.active(),
        }
    }
}

fn tpot_p99_ms(active: u32, cap_w: f64) -> f64 {
    (4.0 + 0.055 * f64::from(active)) * (700.0 / cap_w).powf(0.35)
}

fn tokens_per_j(best_w: f64, active: u32, cap_w: f64) -> f64 {
    let active = f64::from(active);
    20.0 * (1.0 - ((cap_w - best_w) / 500.0).powi(2)) * active / (active + 32.0)
}

/// The most tokens per joule any fixed cap and batch size gets from a saturated GPU
/// without breaking `limit_ms`: what a perfect static choice would achieve.
fn best_feasible_tokens_per_j(best_w: f64, limit_ms: f64) -> f64 {
    let mut best = 0.0_f64;
    for cap_w in (200..=700).step_by(5).map(f64::from) {
        for batch in 1..=512 {
            if tpot_p99_ms(batch, cap_w) <= limit_ms {
                best = best.max(tokens_per_j(best_w, batch, cap_w));
            }
        }
    }
    best
}

/// What happened on one GPU in one tick.
#[derive(Debug, Clone, Copy)]
struct Record {
    cap_w: f64,
    batch: u32,
    settling: bool,
    tpot_p99_ms: f64,
    tokens: u64,
    energy_j: f64,
    asked_w: Option<f64>,
    asked_batch: Option<u32>,
    /// The cap search's target after the decision.
    target_w: f64,
}

#[derive(Debug, Clone)]
struct Bench {
    policy: CapAndBatch,
    gpus: Vec<SimGpu>,
    /// Relative noise on each tick's tokens and latency, uniform in ±`noise`.
    noise: f64,
    rng: u64,
    tick: u64,
    history: Vec<Vec<Record>>,
}

impl Bench {
    fn new(
        gpus: &[(f64, Demand)],
        params: &[(&str, &str)],
        limit_ms: Option<f64>,
        noise: f64,
    ) -> Bench {
        let devices = (0..gpus.len()).map(|i| testing::h200(i as u32)).collect();
        let mut args = testing::init_args(devices, Knobs::POWER_CAP | Knobs::BATCH_SIZE);
        args.params = testing::params(params);
        args.objective.tpot_p99_limit_ms = limit_ms;
        let (policy, first) = CapAndBatch::init(args).unwrap_or_else(|error| panic!("{error}"));
        let mut gpus: Vec<SimGpu> = gpus
            .iter()
            .map(|&(best_w, demand)| SimGpu {
                best_w,
                demand,
                cap_w: 700.0,
                batch: 512,
                settling: false,
            })
            .collect();
        for (gpu, settings) in gpus.iter_mut().zip(first) {
            apply(gpu, settings);
        }
        let count = gpus.len();
        Bench {
            policy,
            gpus,
            noise,
            rng: 0x2545_F491_4F6C_DD1D,
            tick: 0,
            history: vec![Vec::new(); count],
        }
    }

    /// The workloads already run at `batch`, as if the host had applied the first
    /// settings before the run (the default start is 512).
    fn with_workload_batch(mut self, batch: u32) -> Bench {
        for gpu in &mut self.gpus {
            gpu.batch = batch;
            gpu.settling = false;
        }
        self
    }

    fn saturated(best_w: f64, params: &[(&str, &str)], noise: f64) -> Bench {
        Bench::new(
            &[(best_w, Demand::Saturated)],
            params,
            Some(LIMIT_MS),
            noise,
        )
    }

    fn jitter(&mut self) -> f64 {
        // xorshift64: deterministic noise for a repeatable test.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let uniform = (self.rng >> 11) as f64 / (1_u64 << 53) as f64;
        1.0 + self.noise * (2.0 * uniform - 1.0)
    }

    fn observations(&mut self) -> Vec<Observation> {
        let mut observations = Vec::new();
        for index in 0..self.gpus.len() {
            let (tokens_jitter, latency_jitter) = (self.jitter(), self.jitter());
            let gpu = &self.gpus[index];
            let active = gpu.active();
            let mut observation = testing::observation(index as u32, self.tick);
            observation.in_force.power_cap_w = gpu.cap_w;
            observation.in_force.batch_size = gpu.batch;
            observation.settling = gpu.settling;
            observation.active_sequences = active;
            observation.queue_depth = gpu.queue();
            observation.energy_j = 0.9 * gpu.cap_w;
            observation.tokens = (tokens_per_j(gpu.best_w, active, gpu.cap_w)
                * tokens_jitter
                * observation.energy_j)
                .round() as u64;
            observation.tokens_per_joule = observation.tokens as f64 / observation.energy_j;
            observation.tokens_per_s = observation.tokens as f64;
            observation.power_avg_w = observation.energy_j;
            observation.tpot_p99_ms = tpot_p99_ms(active, gpu.cap_w) * latency_jitter;
            observations.push(observation);
        }
        observations
    }

    fn step(&mut self) {
        let observations = self.observations();
        let decisions = self.policy.decide(&observations);
        assert_eq!(decisions.len(), observations.len());
        for (index, (settings, observation)) in decisions.into_iter().zip(&observations).enumerate()
        {
            assert_eq!(settings.sm_clock_max_mhz, None);
            self.history[index].push(Record {
                cap_w: observation.in_force.power_cap_w,
                batch: observation.in_force.batch_size,
                settling: observation.settling,
                tpot_p99_ms: observation.tpot_p99_ms,
                tokens: observation.tokens,
                energy_j: observation.energy_j,
                asked_w: settings.power_cap_w,
                asked_batch: settings.batch_size,
                target_w: self.policy.gpus[index].cap.target_w,
            });
            let gpu = &mut self.gpus[index];
            gpu.settling = false;
            apply(gpu, settings);
        }
        self.tick += 1;
    }

    fn run(&mut self, ticks: u64) {
        for _ in 0..ticks {
            self.step();
        }
    }

    fn recent(&self, gpu: usize, ticks: usize) -> &[Record] {
        let history = &self.history[gpu];
        &history[history.len() - ticks..]
    }

    /// The mean cap on `gpu` over the last `ticks` ticks.
    fn mean_cap_w(&self, gpu: usize, ticks: usize) -> f64 {
        let recent = self.recent(gpu, ticks);
        recent.iter().map(|record| record.cap_w).sum::<f64>() / ticks as f64
    }

    /// Tokens per joule on `gpu` over the last `ticks` ticks, as a ratio of sums.
    fn tokens_per_j(&self, gpu: usize, ticks: usize) -> f64 {
        let recent = self.recent(gpu, ticks);
        let tokens: u64 = recent.iter().map(|record| record.tokens).sum();
        tokens as f64 / recent.iter().map(|record| record.energy_j).sum::<f64>()
    }

    fn violations(&self, gpu: usize) -> usize {
        self.history[gpu]
            .iter()
            .filter(|record| record.tpot_p99_ms > LIMIT_MS)
            .count()
    }
}

fn apply(gpu: &mut SimGpu, settings: Settings) {
    if let Some(asked_w) = settings.power_cap_w {
        let applied_w = asked_w.clamp(200.0, 700.0);
        if applied_w != gpu.cap_w {
            gpu.cap_w = applied_w;
            gpu.settling = true;
        }
    }
    if let Some(asked) = settings.batch_size {
        let asked = asked.clamp(1, 512);
        let applied = if asked > gpu.batch {
            asked.min(gpu.batch + MAX_BATCH_STEP)
        } else {
            asked.max(gpu.batch.saturating_sub(MAX_BATCH_STEP))
        };
        if applied != gpu.batch {
            gpu.batch = applied;
            gpu.settling = true;
        }
    }
}

/// With `min_gain` 0.005 and a 10 W smallest step, the search cannot tell caps apart
/// within about ±62 W of the peak of the parabola (2·d·10/500² < 0.005), so that is how
/// close it can be expected to settle.
const RESOLUTION_W: f64 = 62.5;

/// A window so long that the cap never moves, for tests about the batch alone.
const FROZEN_CAP: (&str, &str) = ("window_ticks", "100000");

#[test]
fn the_batch_grows_until_the_latency_limit_binds() {
    let mut bench = Bench::saturated(450.0, &[FROZEN_CAP], 0.0).with_workload_batch(8);
    bench.run(80);
    let asked: Vec<u32> = bench.history[0]
        .iter()
        .filter_map(|record| record.asked_batch)
        .collect();
    // ×1.25 (rounded up) below 64, then +16.
    assert_eq!(
        asked[..12],
        [10, 13, 17, 22, 28, 35, 44, 55, 69, 85, 101, 117]
    );
    assert!(asked.windows(2).all(|pair| pair[1] > pair[0]), "{asked:?}");
    // It stops inside the band: at most one more step would not have broken the limit,
    // and the last step took it past the headroom.
    let last = bench.history[0][79];
    assert!(!last.settling);
    assert!(
        (0.85 * LIMIT_MS..=LIMIT_MS).contains(&last.tpot_p99_ms),
        "{last:?}"
    );
    assert_eq!(last.asked_batch, None);
    assert_eq!(bench.violations(0), 0);
}

#[test]
fn no_growth_without_demand() {
    let mut bench = Bench::new(
        &[(450.0, Demand::Requests(40))],
        &[FROZEN_CAP],
        Some(LIMIT_MS),
        0.0,
    )
    .with_workload_batch(48);
    bench.run(30);
    assert!(bench.history[0].iter().all(|record| record.batch == 48));
    // Once the requests outnumber the slots, the batch grows again.
    bench.gpus[0].demand = Demand::Requests(400);
    bench.run(20);
    assert!(bench.gpus[0].batch > 48, "{}", bench.gpus[0].batch);
}

#[test]
fn a_violation_shrinks_the_batch_at_once() {
    // Batch 512 at 700 W takes ~32 ms per token: far over the limit.
    let mut bench = Bench::saturated(450.0, &[FROZEN_CAP], 0.0);
    bench.run(40);
    let history = &bench.history[0];
    for record in history.iter().filter(|record| !record.settling) {
        if record.tpot_p99_ms > LIMIT_MS {
            let shrunk = (f64::from(record.batch) * 0.7).floor() as u32;
            assert_eq!(record.asked_batch, Some(shrunk), "{record:?}");
        }
    }
    // 512 -> 358 -> 250: two cuts, each applied in the host's rate-limited steps
    // (512, 448, 384, 358; 358, 294, 250), over the limit until the second lands.
    assert_eq!(bench.violations(0), 6, "{history:?}");
    assert!(history[6..].iter().all(|record| record.batch == 250));
    let last = history[39];
    assert!(
        (0.85 * LIMIT_MS..=LIMIT_MS).contains(&last.tpot_p99_ms),
        "{last:?}"
    );
}

#[test]
fn the_cap_moves_only_after_a_window_of_steady_batch() {
    let window_ticks = 5;
    // ±5 % latency noise, about ±1 ms at the limit: the batch keeps moving.
    let mut bench = Bench::saturated(400.0, &[], 0.05);
    bench.run(1200);
    let history = &bench.history[0];
    let mut cap_moves = 0;
    let mut batch_moves = 0;
    for (tick, record) in history.iter().enumerate().skip(1) {
        if record.asked_batch.is_some() && !record.settling {
            batch_moves += 1;
        }
        if record.target_w == history[tick - 1].target_w {
            continue;
        }
        cap_moves += 1;
        assert_eq!(record.asked_w, Some(record.target_w), "tick {tick}");
        assert_eq!(record.asked_batch, None, "both knobs at tick {tick}");
        // The window that ended here: the last `window_ticks` settled ticks, all at this
        // tick's cap and batch, none of them asking for a new batch.
        let window: Vec<&Record> = history[..=tick]
            .iter()
            .rev()
            .filter(|earlier| !earlier.settling)
            .take(window_ticks)
            .collect();
        assert_eq!(window.len(), window_ticks);
        for earlier in window {
            assert_eq!(earlier.batch, record.batch, "tick {tick}");
            assert_eq!(earlier.cap_w, record.cap_w, "tick {tick}");
            assert!(earlier.asked_batch.is_none(), "tick {tick}");
        }
    }
    assert!(cap_moves >= 20, "{cap_moves} cap moves");
    assert!(batch_moves >= 20, "{batch_moves} batch moves");
}

/// A policy on one H200 under the usual limit with `window_ticks` 2, and a settled
/// tick at 600 W and batch 256 with free slots (so no demand) and latency to spare.
fn two_tick_windows() -> (CapAndBatch, Observation) {
    let mut args = testing::init_args(vec![testing::h200(0)], Knobs::POWER_CAP | Knobs::BATCH_SIZE);
    args.objective.tpot_p99_limit_ms = Some(LIMIT_MS);
    args.params = testing::params(&[("window_ticks", "2"), ("start_w", "600")]);
    let Ok((policy, _)) = CapAndBatch::init(args) else {
        panic!("init fails");
    };
    let mut steady = testing::observation(0, 0);
    steady.in_force.power_cap_w = 600.0;
    steady.in_force.batch_size = 256;
    steady.active_sequences = 200;
    steady.tpot_p99_ms = 18.0;
    (policy, steady)
}

#[test]
fn the_tick_the_batch_moves_ends_no_window() {
    let (mut policy, steady) = two_tick_windows();
    assert_eq!(policy.decide(&[steady]), vec![Settings::unchanged()]);
    let mut violation = steady;
    violation.tpot_p99_ms = 21.0;
    // The second tick would fill the window, but the batch moves on it.
    assert_eq!(
        policy.decide(&[violation]),
        vec![Settings::unchanged().with_batch_size(140)]
    );
    assert_eq!(policy.gpus[0].cap.window.ticks, 0);
    // Two settled ticks at the new batch fill a window; the first step goes down.
    let mut settling = steady;
    settling.settling = true;
    settling.in_force.batch_size = 140;
    assert_eq!(policy.decide(&[settling]), vec![Settings::unchanged()]);
    let mut after = steady;
    after.in_force.batch_size = 140;
    after.active_sequences = 140;
    after.queue_depth = 0;
    after.tpot_p99_ms = 18.0;
    assert_eq!(policy.decide(&[after]), vec![Settings::unchanged()]);
    assert_eq!(policy.decide(&[after])[0].power_cap_w, Some(550.0));
}

#[test]
fn a_window_restarts_when_the_batch_in_force_changes() {
    let (mut policy, steady) = two_tick_windows();
    policy.decide(&[steady]);
    // Someone else changed the batch, without a settling tick in between: the tick at
    // 256 no longer counts.
    let mut resized = steady;
    resized.in_force.batch_size = 240;
    assert_eq!(policy.decide(&[resized]), vec![Settings::unchanged()]);
    assert_eq!(policy.gpus[0].cap.window.batch_size, 240);
    assert_eq!(policy.gpus[0].cap.window.ticks, 1);
    assert_eq!(policy.decide(&[resized])[0].power_cap_w, Some(550.0));
}

#[test]
fn both_loops_together_come_close_to_the_best_feasible_setting() {
    for best_w in [350.0, 500.0] {
        let mut bench = Bench::saturated(best_w, &[], 0.01);
        bench.run(1500);
        let best = best_feasible_tokens_per_j(best_w, LIMIT_MS);
        let achieved = bench.tokens_per_j(0, 500);
        assert!(
            achieved > 0.97 * best,
            "peak at {best_w} W: {achieved} tokens/J, best feasible {best}"
        );
        let violations = bench.violations(0);
        assert!(violations * 50 < 1500, "peak at {best_w} W: {violations}");
        let mean_w = bench.mean_cap_w(0, 500);
        assert!((mean_w - best_w).abs() < 2.0 * RESOLUTION_W, "{mean_w} W");
    }
}

#[test]
fn with_the_batch_not_binding_the_cap_finds_each_gpu_peak() {
    let mut bench = Bench::new(
        &[(450.0, Demand::Requests(64)), (600.0, Demand::Requests(64))],
        &[],
        Some(LIMIT_MS),
        0.0,
    )
    .with_workload_batch(128);
    bench.run(400);
    for (gpu, best_w) in [(0, 450.0), (1, 600.0)] {
        assert!(bench.history[gpu].iter().all(|record| record.batch == 128));
        let mean_w = bench.mean_cap_w(gpu, 200);
        assert!(
            (mean_w - best_w).abs() < RESOLUTION_W,
            "gpu {gpu}: {mean_w} W"
        );
    }
}

#[test]
fn a_violation_at_batch_one_raises_the_cap_and_sets_a_floor() {
    let mut args = testing::init_args(vec![testing::h200(0)], Knobs::POWER_CAP | Knobs::BATCH_SIZE);
    args.objective.tpot_p99_limit_ms = Some(5.0);
    args.params = testing::params(&[("start_w", "400")]);
    let Ok((mut policy, _)) = CapAndBatch::init(args) else {
        panic!("init fails");
    };
    let mut single = testing::observation(0, 0);
    single.in_force.power_cap_w = 400.0;
    single.in_force.batch_size = 1;
    single.active_sequences = 1;
    single.tpot_p99_ms = 6.0;
    let decided = policy.decide(&[single]);
    assert_eq!(decided[0].power_cap_w, Some(450.0));
    assert_eq!(decided[0].batch_size, None);
    let cap = &policy.gpus[0].cap;
    assert_eq!(cap.slo_floor.map(|floor| floor.cap_w), Some(400.0));
    assert_eq!(cap.direction, Direction::Down);
    // While the raise settles, the violation is not answered again.
    single.settling = true;
    assert_eq!(policy.decide(&[single])[0].power_cap_w, Some(450.0));
    assert_eq!(policy.gpus[0].cap.target_w, 450.0);
}

#[test]
fn first_settings_carry_the_start_batch_only_when_set() {
    let init = |params: &[(&str, &str)]| {
        let mut args = testing::init_args(
            vec![testing::h200(0), testing::h200(1)],
            Knobs::POWER_CAP | Knobs::BATCH_SIZE,
        );
        args.objective.tpot_p99_limit_ms = Some(LIMIT_MS);
        args.params = testing::params(params);
        CapAndBatch::init(args).map(|(_, first)| first)
    };
    let first = init(&[]).unwrap_or_else(|error| panic!("{error}"));
    assert_eq!(
        first,
        vec![Settings::unchanged().with_power_cap_w(700.0); 2]
    );
    let first =
        init(&[("start_batch_size", "64"), ("start_w", "500")]).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        first[1],
        Settings::unchanged()
            .with_power_cap_w(500.0)
            .with_batch_size(64)
    );
}

#[test]
fn state_hands_over_to_a_new_instance() {
    let gpus = [(450.0, Demand::Saturated), (600.0, Demand::Requests(300))];
    let mut old = Bench::new(&gpus, &[], Some(LIMIT_MS), 0.01);
    old.run(157);
    let mut new = Bench::new(&gpus, &[], Some(LIMIT_MS), 0.01);
    let state = testing::assert_hands_over(&old.policy, &mut new.policy);
    assert_eq!(state.schema_version, 1);
    assert_eq!(new.policy.gpus, old.policy.gpus);

    // From identical inputs, the two carry on identically.
    new.gpus = old.gpus.clone();
    new.rng = old.rng;
    new.tick = old.tick;
    old.run(50);
    new.run(50);
    assert_eq!(new.policy.gpus, old.policy.gpus);
}

#[test]
fn a_pending_batch_survives_the_hand_over() {
    let mut old = Bench::saturated(450.0, &[FROZEN_CAP], 0.0);
    // The first tick asks to cut 512 to 358; the host gets as far as 448.
    old.run(1);
    assert_eq!(old.gpus[0].batch, 448);
    let mut new = Bench::saturated(450.0, &[FROZEN_CAP], 0.0);
    assert_eq!(new.policy.restore(old.policy.snapshot()), Ok(()));
    new.gpus = old.gpus.clone();
    new.run(1);
    assert_eq!(new.history[0][0].asked_batch, Some(358));
}

#[test]
fn restore_refuses_foreign_state_and_keeps_its_own() {
    let mut bench = Bench::saturated(450.0, &[], 0.0);
    bench.run(40);
    let good = bench.policy.snapshot();
    let policy = &mut bench.policy;

    let other_schema = State {
        schema_version: 2,
        bytes: good.bytes.clone(),
    };
    testing::assert_restore_refused(policy, other_schema, "schema version 1, got version 2");
    let two_gpus = Bench::new(
        &[(450.0, Demand::Saturated), (450.0, Demand::Saturated)],
        &[],
        Some(LIMIT_MS),
        0.0,
    )
    .policy
    .snapshot();
    testing::assert_restore_refused(policy, two_gpus, "2 GPUs");
    let mut truncated = good.clone();
    truncated.bytes.pop();
    testing::assert_restore_refused(policy, truncated, "");
    let mut extended = good.clone();
    extended.bytes.push(0);
    testing::assert_restore_refused(policy, extended, "unexpected bytes");
    let mut not_a_number = good;
    not_a_number.bytes[4..12].copy_from_slice(&f64::NAN.to_le_bytes());
    testing::assert_restore_refused(policy, not_a_number, "target_w");
}

#[test]
fn restored_values_are_fitted_to_the_new_range_and_config() {
    let mut old = Bench::saturated(450.0, &[], 0.0);
    old.run(3);
    old.policy.gpus[0].cap.target_w = 690.0;
    old.policy.gpus[0].cap.step_w = 50.0;
    old.policy.gpus[0].cap.direction = Direction::Up;
    old.policy.gpus[0].batch.pending = Some(500);
    let state = old.policy.snapshot();

    let mut device = testing::h200(0);
    device.power_cap_max_w = 600.0;
    device.batch_size_max = 256;
    let mut args = testing::init_args(vec![device], Knobs::POWER_CAP | Knobs::BATCH_SIZE);
    args.objective.tpot_p99_limit_ms = Some(LIMIT_MS);
    args.params = testing::params(&[("step_w", "20")]);
    let Ok((mut new, _)) = CapAndBatch::init(args) else {
        panic!("init fails");
    };
    assert_eq!(new.restore(state), Ok(()));
    let control = &new.gpus[0];
    assert_eq!(control.cap.target_w, 600.0);
    assert_eq!(control.cap.step_w, 20.0);
    assert_eq!(control.cap.direction, Direction::Up);
    assert_eq!(control.batch.pending, Some(256));
}

#[test]
fn spec_mistakes_stop_the_policy_from_loading() {
    let both = Knobs::POWER_CAP | Knobs::BATCH_SIZE;
    let init = |knobs: Knobs, device: DeviceFacts, limit_ms: Option<f64>| {
        let mut args = testing::init_args(vec![device], knobs);
        args.objective.tpot_p99_limit_ms = limit_ms;
        CapAndBatch::init(args).err().unwrap_or_default()
    };
    let h200 = testing::h200(0);

    let error = init(both, h200.clone(), None);
    assert!(
        error.contains("set `tpot_p99_limit_ms` in the spec's [objective]"),
        "{error}"
    );
    let error = init(both, h200.clone(), Some(-1.0));
    assert!(error.contains("tpot_p99_limit_ms` = -1"), "{error}");
    let error = init(both, h200.clone(), Some(f64::NAN));
    assert!(error.contains("tpot_p99_limit_ms` = NaN"), "{error}");

    let error = init(Knobs::POWER_CAP, h200.clone(), Some(LIMIT_MS));
    assert!(error.contains("add \"batch-size\" to"), "{error}");
    let error = init(Knobs::SM_CLOCK, h200.clone(), Some(LIMIT_MS));
    assert!(
        error.contains("add \"power-cap\" and \"batch-size\" to"),
        "{error}"
    );

    let mut narrow = h200.clone();
    narrow.power_cap_min_w = 800.0;
    let error = init(both, narrow, Some(LIMIT_MS));
    assert!(error.contains("800-700 W"), "{error}");
    let mut no_batch = h200;
    no_batch.batch_size_max = 0;
    let error = init(both, no_batch, Some(LIMIT_MS));
    assert!(error.contains("largest batch size of 0"), "{error}");

    let mut args = testing::init_args(vec![testing::h200(0)], both);
    args.objective.tpot_p99_limit_ms = Some(LIMIT_MS);
    args.objective.min_tokens_per_s = Some(-5.0);
    let error = CapAndBatch::init(args).err().unwrap_or_default();
    assert!(error.contains("min_tokens_per_s"), "{error}");

    let mut args = testing::init_args(vec![testing::h200(0)], both);
    args.objective.tpot_p99_limit_ms = Some(LIMIT_MS);
    args.params = testing::params(&[("batch_headroom", "2")]);
    let error = CapAndBatch::init(args).err().unwrap_or_default();
    assert!(error.contains("batch_headroom"), "{error}");
}

#[test]
fn an_unknown_gpu_is_left_alone() {
    let mut bench = Bench::saturated(450.0, &[], 0.0);
    let stranger = testing::observation(3, 0);
    assert_eq!(
        bench.policy.decide(&[stranger]),
        vec![Settings::unchanged()]
    );
}
