//! The policy on synthetic observations of an H200-like GPU (not simulator output).

use super::*;
use tokwatt_policy_sdk::{StateWriter, testing};

fn args(pairs: &[(&str, &str)], limit_ms: Option<f64>) -> InitArgs {
    let mut args = testing::init_args(vec![testing::h200(0)], Knobs::POWER_CAP);
    args.params = testing::params(pairs);
    args.objective.tpot_p99_limit_ms = limit_ms;
    args
}

fn policy(limit_ms: Option<f64>) -> CapSearchPolicy {
    match CapSearchPolicy::init(args(&[], limit_ms)) {
        Ok((policy, _)) => policy,
        Err(error) => panic!("{error}"),
    }
}

/// Tokens a second at `cap_w` under full load: rising and flattening, so that tokens per
/// joule peaks near 350 W.
fn capacity(cap_w: f64) -> f64 {
    17_500.0 * (1.0 - (-(cap_w - 120.0) / 200.0).exp())
}

/// A GPU under a demand of `demand` tokens a second, with 3 % power noise.
struct Gpu {
    demand: f64,
    noise: u64,
}

impl Gpu {
    fn observe(&mut self, tick: u64, cap_w: f64, settling: bool) -> Observation {
        self.noise = self
            .noise
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let jitter = ((self.noise >> 11) as f64 / (1_u64 << 53) as f64) * 2.0 - 1.0;
        let tokens = self.demand.min(capacity(cap_w));
        let power_w = cap_w * (1.0 + 0.03 * jitter);
        let mut observation = testing::observation(0, tick);
        observation.tokens = tokens as u64;
        observation.energy_j = power_w;
        observation.power_avg_w = power_w;
        observation.tokens_per_s = tokens;
        observation.tokens_per_joule = tokens / power_w;
        observation.queue_depth = if self.demand > capacity(cap_w) {
            2000
        } else {
            0
        };
        observation.tpot_p99_ms = 30.0 * capacity(700.0) / capacity(cap_w);
        observation.in_force.power_cap_w = cap_w;
        observation.settling = settling;
        observation
    }
}

/// Runs `ticks` ticks from `first_tick`, applying every decision at once; returns the
/// caps in force.
fn run(policy: &mut CapSearchPolicy, gpu: &mut Gpu, first_tick: u64, ticks: u64) -> Vec<f64> {
    let mut cap_w = policy.gpus[0].target();
    let mut settling = false;
    let mut caps = Vec::new();
    for tick in first_tick..first_tick + ticks {
        let observation = gpu.observe(tick, cap_w, settling);
        let decided = policy.decide(&[observation]);
        settling = false;
        if let Some(asked_w) = decided[0].power_cap_w {
            settling = (asked_w - cap_w).abs() > CAP_TOLERANCE_W;
            cap_w = asked_w;
        }
        caps.push(cap_w);
    }
    caps
}

#[test]
fn it_needs_the_power_cap_and_known_sensible_parameters() {
    let mut no_knob = args(&[], None);
    no_knob.knobs = Knobs::SM_CLOCK;
    let cases = [
        (no_knob, "was not granted \"power-cap\""),
        (args(&[("grid", "5")], None), "unknown parameter `grid`"),
        (args(&[("grid_w", "0.5")], None), "`grid_w` = 0.5"),
        (args(&[("z", "0")], None), "`z` = 0"),
        (args(&[], Some(-1.0)), "tpot_p99_limit_ms"),
    ];
    for (args, expected) in cases {
        let error = CapSearchPolicy::init(args).err().unwrap_or_default();
        assert!(error.contains(expected), "{expected}: {error}");
    }
}

#[test]
fn it_starts_at_the_highest_cap_on_a_ladder_of_the_grid() {
    let (policy, first) =
        CapSearchPolicy::init(args(&[("grid_w", "30")], None)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first, vec![Settings::unchanged().with_power_cap_w(700.0)]);
    let caps = &policy.gpus[0].values;
    assert_eq!(caps.first(), Some(&200.0));
    assert_eq!(caps.last(), Some(&700.0));
    // 200, 230, ..., 680, then the top: no rung closer than half a grid step to it.
    assert_eq!(caps[caps.len() - 2], 680.0);
}

#[test]
fn under_full_load_it_settles_near_the_most_tokens_per_joule() {
    let mut policy = policy(None);
    let mut gpu = Gpu {
        demand: 1e9,
        noise: 7,
    };
    let caps = run(&mut policy, &mut gpu, 0, 150);
    let best_w = (200..=700)
        .step_by(10)
        .map(f64::from)
        .max_by(|a, b| (capacity(*a) / a).total_cmp(&(capacity(*b) / b)))
        .unwrap_or_default();
    let settled_w = caps[caps.len() - 1];
    assert!(
        (settled_w - best_w).abs() <= 40.0,
        "settled {settled_w} W, best {best_w} W"
    );
}

#[test]
fn a_broken_latency_objective_raises_the_cap_at_once() {
    // Under full load, 40 ms breaks below ~330 W.
    let mut policy = policy(Some(40.0));
    let mut gpu = Gpu {
        demand: 1e9,
        noise: 3,
    };
    let caps = run(&mut policy, &mut gpu, 0, 200);
    let breaking = caps
        .iter()
        .filter(|&&cap_w| 30.0 * capacity(700.0) / capacity(cap_w) > 40.0)
        .count();
    assert!(breaking <= 4, "{breaking} ticks at breaking caps: {caps:?}");
    assert!(caps[caps.len() - 1] >= 330.0);
}

#[test]
fn when_demand_falls_it_searches_again_and_goes_lower() {
    let mut policy = policy(None);
    let mut gpu = Gpu {
        demand: 1e9,
        noise: 11,
    };
    let caps = run(&mut policy, &mut gpu, 0, 150);
    let saturated_w = caps[caps.len() - 1];
    gpu.demand = 1_500.0;
    let caps = run(&mut policy, &mut gpu, 150, 150);
    let light_w = caps[caps.len() - 1];
    // Demand-limited, the lowest cap that keeps up costs the least power.
    assert!(
        light_w <= 230.0,
        "light load at {light_w} W (was {saturated_w} W)"
    );
}

#[test]
fn its_state_hands_over_and_foreign_state_is_refused() {
    let mut old = policy(Some(45.0));
    let mut gpu = Gpu {
        demand: 1e9,
        noise: 5,
    };
    run(&mut old, &mut gpu, 0, 41);
    let mut new = policy(Some(45.0));
    let state = testing::assert_hands_over(&old, &mut new);
    assert_eq!(state.schema_version, SCHEMA_VERSION);
    assert_eq!(new.gpus, old.gpus);
    testing::assert_restore_refused(
        &mut new,
        StateWriter::new().u32(1).finish(SCHEMA_VERSION + 1),
        "schema version",
    );
    let mut finer = match CapSearchPolicy::init(args(&[("grid_w", "5")], Some(45.0))) {
        Ok((policy, _)) => policy,
        Err(error) => panic!("{error}"),
    };
    testing::assert_restore_refused(&mut finer, state, "starting afresh");
}
