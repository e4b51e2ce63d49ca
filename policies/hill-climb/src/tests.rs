//! The search against a made-up GPU whose efficiency peaks at a known cap.

use super::*;
use crate::search::Direction;
use tokwatt_policy_sdk::testing;

/// One simulated GPU. Tokens per joule follow a parabola peaking at `best_w`; p99 time
/// per token grows as the cap falls. The host applies a requested cap at once, clamped to
/// 200-700 W, and marks the next tick as settling.
#[derive(Debug, Clone)]
struct SimGpu {
    best_w: f64,
    cap_w: f64,
    settling: bool,
}

impl SimGpu {
    fn new(best_w: f64) -> SimGpu {
        SimGpu {
            best_w,
            cap_w: 700.0,
            settling: false,
        }
    }

    fn tokens_per_j(&self, cap_w: f64) -> f64 {
        20.0 * (1.0 - ((cap_w - self.best_w) / 500.0).powi(2))
    }
}

fn tpot_p99_ms(cap_w: f64) -> f64 {
    8.0 * (700.0 / cap_w).sqrt()
}

/// What happened on one GPU in one tick.
#[derive(Debug, Clone, Copy)]
struct Record {
    cap_w: f64,
    settling: bool,
    tpot_p99_ms: f64,
    asked_w: Option<f64>,
}

#[derive(Debug, Clone)]
struct Bench {
    policy: HillClimb,
    gpus: Vec<SimGpu>,
    /// Relative noise on each tick's tokens, uniform in ±`noise`.
    noise: f64,
    rng: u64,
    tick: u64,
    history: Vec<Vec<Record>>,
}

impl Bench {
    fn new(best_w: &[f64], params: &[(&str, &str)], objective: Objective, noise: f64) -> Bench {
        let devices = (0..best_w.len()).map(|i| testing::h200(i as u32)).collect();
        let mut args = testing::init_args(devices, Knobs::POWER_CAP);
        args.params = testing::params(params);
        args.objective = objective;
        let (policy, first) = HillClimb::init(args).unwrap_or_else(|error| panic!("{error}"));
        let mut gpus: Vec<SimGpu> = best_w.iter().map(|&best| SimGpu::new(best)).collect();
        for (gpu, settings) in gpus.iter_mut().zip(first) {
            apply(gpu, settings);
        }
        Bench {
            policy,
            gpus,
            noise,
            rng: 0x2545_F491_4F6C_DD1D,
            tick: 0,
            history: vec![Vec::new(); best_w.len()],
        }
    }

    fn uniform(&mut self) -> f64 {
        // xorshift64: deterministic noise for a repeatable test.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng >> 11) as f64 / (1_u64 << 53) as f64
    }

    fn observations(&mut self) -> Vec<Observation> {
        let mut observations = Vec::new();
        for index in 0..self.gpus.len() {
            let jitter = 1.0 + self.noise * (2.0 * self.uniform() - 1.0);
            let gpu = &self.gpus[index];
            let mut observation = testing::observation(index as u32, self.tick);
            observation.in_force.power_cap_w = gpu.cap_w;
            observation.settling = gpu.settling;
            observation.energy_j = 0.9 * gpu.cap_w;
            observation.tokens =
                (gpu.tokens_per_j(gpu.cap_w) * jitter * observation.energy_j).round() as u64;
            observation.tokens_per_joule = observation.tokens as f64 / observation.energy_j;
            observation.tokens_per_s = observation.tokens as f64;
            observation.power_avg_w = observation.energy_j;
            observation.tpot_p99_ms = tpot_p99_ms(gpu.cap_w);
            observations.push(observation);
        }
        observations
    }

    fn step(&mut self) {
        let observations = self.observations();
        let decisions = self.policy.decide(&observations);
        assert_eq!(decisions.len(), observations.len());
        for ((gpu, settings), observation) in self.gpus.iter_mut().zip(decisions).zip(&observations)
        {
            self.history[observation.gpu as usize].push(Record {
                cap_w: observation.in_force.power_cap_w,
                settling: observation.settling,
                tpot_p99_ms: observation.tpot_p99_ms,
                asked_w: settings.power_cap_w,
            });
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

    /// The mean cap on `gpu` over the last `ticks` ticks.
    fn mean_cap_w(&self, gpu: usize, ticks: usize) -> f64 {
        let history = &self.history[gpu];
        let recent = &history[history.len() - ticks..];
        recent.iter().map(|record| record.cap_w).sum::<f64>() / ticks as f64
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
}

const NO_OBJECTIVE: Objective = Objective {
    tpot_p99_limit_ms: None,
    min_tokens_per_s: None,
    queue_wait_p99_limit_ms: None,
    ttft_p99_limit_ms: None,
};

/// With `min_gain` 0.005 and a 10 W smallest step, the search cannot tell caps apart
/// within about ±62 W of the peak of this parabola (2·d·10/500² < 0.005), so that is how
/// close it can be expected to settle; efficiency there is within 1.6 % of the peak.
const RESOLUTION_W: f64 = 62.5;

#[test]
fn each_gpu_settles_near_its_own_peak() {
    let mut bench = Bench::new(&[450.0, 600.0], &[], NO_OBJECTIVE, 0.0);
    bench.run(400);
    for (gpu, best_w) in [(0, 450.0), (1, 600.0)] {
        let mean_w = bench.mean_cap_w(gpu, 200);
        assert!(
            (mean_w - best_w).abs() < RESOLUTION_W,
            "gpu {gpu}: {mean_w} W"
        );
    }
}

#[test]
fn noise_slows_the_search_but_does_not_lose_the_peak() {
    // ±2 % per tick is about ±0.5 % per window: as large as `min_gain`, so the search
    // wanders over the flat top, but the slope beyond it keeps pulling it back.
    let mut bench = Bench::new(&[450.0], &[], NO_OBJECTIVE, 0.02);
    bench.run(1000);
    let mean_w = bench.mean_cap_w(0, 500);
    assert!((mean_w - 450.0).abs() < 1.5 * RESOLUTION_W, "{mean_w} W");
}

#[test]
fn caps_stay_in_the_device_range() {
    // The peak is below the device's 200 W floor: the search must stop there.
    let mut bench = Bench::new(&[100.0], &[("start_w", "250")], NO_OBJECTIVE, 0.0);
    bench.run(200);
    let history = &bench.history[0];
    assert!(
        history
            .iter()
            .all(|record| (200.0..=700.0).contains(&record.cap_w))
    );
    assert!(
        history
            .iter()
            .filter_map(|record| record.asked_w)
            .all(|w| (200.0..=700.0).contains(&w))
    );
    assert!(bench.mean_cap_w(0, 100) < 200.0 + RESOLUTION_W);
}

#[test]
fn the_objective_wins_over_efficiency() {
    // The limit is broken below 700·(8/9)² ≈ 553 W, above the efficiency peak at 450 W.
    let limit_ms = 9.0;
    let boundary_w = 700.0 * (8.0_f64 / limit_ms).powi(2);
    let objective = Objective {
        tpot_p99_limit_ms: Some(limit_ms),
        min_tokens_per_s: None,
        queue_wait_p99_limit_ms: None,
        ttft_p99_limit_ms: None,
    };
    let mut bench = Bench::new(&[450.0], &[], objective, 0.0);
    bench.run(600);
    let history = &bench.history[0];
    let mut violations = 0;
    for record in history {
        if record.tpot_p99_ms > limit_ms {
            violations += 1;
            if !record.settling {
                let asked_w = record.asked_w.unwrap_or(record.cap_w);
                assert!(
                    asked_w >= record.cap_w + 50.0,
                    "no raise at once: {record:?}"
                );
            }
        }
    }
    // The search probes below the boundary only when a floor lifts, and leaves at once.
    assert!(
        violations * 20 < history.len(),
        "{violations} of {}",
        history.len()
    );
    let mean_w = bench.mean_cap_w(0, 300);
    assert!(
        mean_w > boundary_w && mean_w < boundary_w + RESOLUTION_W,
        "{mean_w} W"
    );
}

#[test]
fn low_throughput_counts_only_while_requests_wait() {
    let objective = Objective {
        tpot_p99_limit_ms: None,
        min_tokens_per_s: Some(10_000.0),
        queue_wait_p99_limit_ms: None,
        ttft_p99_limit_ms: None,
    };
    let mut args = testing::init_args(vec![testing::h200(0)], Knobs::POWER_CAP);
    args.objective = objective;
    args.params = testing::params(&[("start_w", "500")]);
    let Ok((mut policy, _)) = HillClimb::init(args) else {
        panic!("init fails");
    };
    let mut slow = testing::observation(0, 0);
    slow.in_force.power_cap_w = 500.0;
    slow.tokens_per_s = 8000.0;
    slow.queue_depth = 0;
    assert_eq!(policy.decide(&[slow]), vec![Settings::unchanged()]);
    slow.queue_depth = 12;
    assert_eq!(policy.decide(&[slow])[0].power_cap_w, Some(550.0));
}

#[test]
fn settling_idle_and_energyless_ticks_are_not_measured() {
    let mut args = testing::init_args(vec![testing::h200(0)], Knobs::POWER_CAP);
    args.params = testing::params(&[("window_ticks", "3")]);
    let Ok((mut policy, first)) = HillClimb::init(args) else {
        panic!("init fails");
    };
    assert_eq!(first[0].power_cap_w, Some(700.0));
    let busy = testing::observation(0, 0);
    let mut idle = busy;
    idle.tokens = 0;
    let mut settling = busy;
    settling.settling = true;
    let mut no_energy = busy;
    no_energy.energy_j = 0.0;
    for observation in [busy, idle, settling, no_energy, busy, idle, idle] {
        assert_eq!(policy.decide(&[observation]), vec![Settings::unchanged()]);
    }
    // The third busy tick fills the window: the first step goes down by `step_w`.
    assert_eq!(policy.decide(&[busy])[0].power_cap_w, Some(650.0));
}

#[test]
fn a_window_restarts_when_the_cap_in_force_changes() {
    let mut args = testing::init_args(vec![testing::h200(0)], Knobs::POWER_CAP);
    args.params = testing::params(&[("window_ticks", "2")]);
    let Ok((mut policy, _)) = HillClimb::init(args) else {
        panic!("init fails");
    };
    let at_700 = testing::observation(0, 0);
    let mut at_690 = at_700;
    at_690.in_force.power_cap_w = 690.0;
    policy.decide(&[at_700]);
    // Someone else moved the cap: the tick at 700 W no longer counts, and the search
    // asks for its target again.
    assert_eq!(policy.decide(&[at_690])[0].power_cap_w, Some(700.0));
    let decided = policy.decide(&[at_690]);
    assert_eq!(decided[0].power_cap_w, Some(640.0));
    assert_eq!(policy.searches[0].previous.map(|m| m.cap_w), Some(690.0));
}

#[test]
fn state_hands_over_to_a_new_instance() {
    let objective = Objective {
        tpot_p99_limit_ms: Some(9.0),
        min_tokens_per_s: None,
        queue_wait_p99_limit_ms: None,
        ttft_p99_limit_ms: None,
    };
    let mut old = Bench::new(&[450.0, 600.0], &[], objective, 0.01);
    old.run(157);
    let mut new = Bench::new(&[450.0, 600.0], &[], objective, 0.01);
    let state = testing::assert_hands_over(&old.policy, &mut new.policy);
    assert_eq!(state.schema_version, 1);
    assert_eq!(new.policy.searches, old.policy.searches);

    // From identical inputs, the two carry on identically.
    new.gpus = old.gpus.clone();
    new.rng = old.rng;
    new.tick = old.tick;
    old.run(50);
    new.run(50);
    assert_eq!(new.policy.searches, old.policy.searches);
}

#[test]
fn restore_refuses_foreign_state_and_keeps_its_own() {
    let mut bench = Bench::new(&[450.0], &[], NO_OBJECTIVE, 0.0);
    bench.run(40);
    let good = bench.policy.snapshot();
    let policy = &mut bench.policy;

    let other_schema = State {
        schema_version: 2,
        bytes: good.bytes.clone(),
    };
    testing::assert_restore_refused(policy, other_schema, "schema version 1, got version 2");
    let two_gpus = Bench::new(&[450.0, 450.0], &[], NO_OBJECTIVE, 0.0)
        .policy
        .snapshot();
    testing::assert_restore_refused(policy, two_gpus, "2 GPUs");
    let mut truncated = good.clone();
    truncated.bytes.pop();
    testing::assert_restore_refused(policy, truncated, "");
    let mut not_a_number = good;
    not_a_number.bytes[4..12].copy_from_slice(&f64::NAN.to_le_bytes());
    testing::assert_restore_refused(policy, not_a_number, "target_w");
}

#[test]
fn restored_values_are_fitted_to_the_new_range_and_config() {
    let mut old = Bench::new(&[450.0], &[], NO_OBJECTIVE, 0.0);
    old.run(3);
    old.policy.searches[0].target_w = 690.0;
    old.policy.searches[0].step_w = 50.0;
    old.policy.searches[0].direction = Direction::Up;
    let state = old.policy.snapshot();

    let mut device = testing::h200(0);
    device.power_cap_max_w = 600.0;
    let mut args = testing::init_args(vec![device], Knobs::POWER_CAP);
    args.params = testing::params(&[("step_w", "20")]);
    let Ok((mut new, _)) = HillClimb::init(args) else {
        panic!("init fails");
    };
    assert_eq!(new.restore(state), Ok(()));
    assert_eq!(new.searches[0].target_w, 600.0);
    assert_eq!(new.searches[0].step_w, 20.0);
    assert_eq!(new.searches[0].direction, Direction::Up);
}

#[test]
fn spec_mistakes_stop_the_policy_from_loading() {
    let init = |knobs: Knobs, device_min_w: f64, objective: Objective| {
        let mut device = testing::h200(0);
        device.power_cap_min_w = device_min_w;
        let mut args = testing::init_args(vec![device], knobs);
        args.objective = objective;
        HillClimb::init(args).err().unwrap_or_default()
    };
    let error = init(Knobs::SM_CLOCK, 200.0, NO_OBJECTIVE);
    assert!(error.contains("\"power-cap\""), "{error}");
    let error = init(Knobs::POWER_CAP, 800.0, NO_OBJECTIVE);
    assert!(error.contains("800-700 W"), "{error}");
    let negative_limit = Objective {
        tpot_p99_limit_ms: Some(-1.0),
        min_tokens_per_s: None,
        queue_wait_p99_limit_ms: None,
        ttft_p99_limit_ms: None,
    };
    let error = init(Knobs::POWER_CAP, 200.0, negative_limit);
    assert!(error.contains("tpot_p99_limit_ms"), "{error}");
}

#[test]
fn an_unknown_gpu_is_left_alone() {
    let mut bench = Bench::new(&[450.0], &[], NO_OBJECTIVE, 0.0);
    let stranger = testing::observation(3, 0);
    assert_eq!(
        bench.policy.decide(&[stranger]),
        vec![Settings::unchanged()]
    );
}
