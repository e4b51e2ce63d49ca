//! The policy on synthetic observations of an H200-like GPU (not simulator output).

use super::*;
use tokwatt_policy_sdk::{StateWriter, testing};

fn args(pairs: &[(&str, &str)], limit_ms: Option<f64>) -> InitArgs {
    let mut args = testing::init_args(vec![testing::h200(0)], Knobs::SM_CLOCK);
    args.params = testing::params(pairs);
    args.objective.tpot_p99_limit_ms = limit_ms;
    args
}

fn policy(limit_ms: Option<f64>) -> ClockSearchPolicy {
    match ClockSearchPolicy::init(args(&[], limit_ms)) {
        Ok((policy, _)) => policy,
        Err(error) => panic!("{error}"),
    }
}

/// Tokens a second under full load at `mhz`: memory-bound at high clocks, slowing below
/// ~1200 MHz.
fn capacity(mhz: f64) -> f64 {
    17_000.0 * (mhz / 1200.0).min(1.0).powf(0.9) * (0.9 + 0.1 * (mhz / 1980.0))
}

/// Busy power at `mhz`: static power plus clocked power falling with the voltage.
fn power(mhz: f64) -> f64 {
    let x = mhz / 1980.0;
    let volts = (1.0 - 0.64 * (1.0 - x)).max(0.65);
    100.0 + 600.0 * x * volts * volts
}

/// A GPU under a demand of `demand` tokens a second, with 3 % power noise. The p99 time
/// per token grows as the clock slows and as the batch fills.
struct Gpu {
    demand: f64,
    noise: u64,
}

impl Gpu {
    fn tpot_ms(&self, mhz: f64) -> f64 {
        let load = (self.demand / capacity(mhz)).min(1.0);
        8.0 + 25.0 * load * capacity(1980.0) / capacity(mhz)
    }

    fn observe(&mut self, tick: u64, mhz: u32, settling: bool) -> Observation {
        self.noise = self
            .noise
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let jitter = ((self.noise >> 11) as f64 / (1_u64 << 53) as f64) * 2.0 - 1.0;
        let mhz_f = f64::from(mhz);
        let tokens = self.demand.min(capacity(mhz_f));
        let power_w = power(mhz_f) * (1.0 + 0.03 * jitter);
        let mut observation = testing::observation(0, tick);
        observation.tokens = tokens as u64;
        observation.energy_j = power_w;
        observation.power_avg_w = power_w;
        observation.tokens_per_s = tokens;
        observation.tokens_per_joule = tokens / power_w;
        observation.queue_depth = if self.demand > capacity(mhz_f) {
            2000
        } else {
            0
        };
        observation.tpot_p99_ms = self.tpot_ms(mhz_f);
        observation.in_force.sm_clock_max_mhz = mhz;
        observation.sm_clock_mhz = mhz;
        observation.settling = settling;
        observation
    }
}

/// Runs `ticks` ticks from `first_tick`, applying every decision at once; returns the
/// clock locks in force.
fn run(policy: &mut ClockSearchPolicy, gpu: &mut Gpu, first_tick: u64, ticks: u64) -> Vec<u32> {
    let mut mhz = policy.gpus[0].target() as u32;
    let mut settling = false;
    let mut clocks = Vec::new();
    for tick in first_tick..first_tick + ticks {
        let observation = gpu.observe(tick, mhz, settling);
        let decided = policy.decide(&[observation]);
        settling = false;
        if let Some(asked) = decided[0].sm_clock_max_mhz {
            settling = asked != mhz;
            mhz = asked;
        }
        clocks.push(mhz);
    }
    clocks
}

#[test]
fn it_needs_the_clock_knob_and_known_sensible_parameters() {
    let mut no_knob = args(&[], None);
    no_knob.knobs = Knobs::POWER_CAP;
    let mut no_clocks = args(&[], None);
    no_clocks.devices[0].sm_clocks_mhz.clear();
    let cases = [
        (no_knob, "was not granted \"sm-clock\""),
        (
            args(&[("grid_w", "10")], None),
            "unknown parameter `grid_w`",
        ),
        (args(&[("tpot_margin", "0.9")], None), "`tpot_margin` = 0.9"),
        (no_clocks, "no supported SM clocks"),
    ];
    for (args, expected) in cases {
        let error = ClockSearchPolicy::init(args).err().unwrap_or_default();
        assert!(error.contains(expected), "{expected}: {error}");
    }
}

#[test]
fn it_starts_at_the_highest_clock_with_every_supported_clock_on_its_ladder() {
    let (policy, first) =
        ClockSearchPolicy::init(args(&[], None)).unwrap_or_else(|error| panic!("{error}"));
    assert_eq!(
        first,
        vec![Settings::unchanged().with_sm_clock_max_mhz(1980)]
    );
    let clocks = &policy.gpus[0].values;
    assert_eq!(clocks.len(), 110);
    assert_eq!((clocks[0], clocks[109]), (345.0, 1980.0));
}

#[test]
fn under_a_latency_objective_it_settles_on_a_low_clock_that_keeps_the_limit() {
    let limit_ms = 30.0;
    let mut policy = policy(Some(limit_ms));
    let mut gpu = Gpu {
        demand: 7_000.0,
        noise: 9,
    };
    let clocks = run(&mut policy, &mut gpu, 0, 200);
    let breaking: Vec<usize> = (0..clocks.len())
        .filter(|&tick| gpu.tpot_ms(f64::from(clocks[tick])) > limit_ms)
        .collect();
    assert!(
        breaking.len() <= 4,
        "breaking ticks {breaking:?}: {clocks:?}"
    );
    // Never two breaking ticks after the first tick of a breach.
    assert!(
        breaking.windows(3).all(|ticks| ticks[2] - ticks[0] > 2),
        "{breaking:?}"
    );
    // The lowest clock that keeps the margin, by brute force.
    let lowest_ok = (345..=1980)
        .step_by(15)
        .find(|&mhz| gpu.tpot_ms(f64::from(mhz)) <= limit_ms * 0.92)
        .unwrap_or(1980);
    let settled = clocks[clocks.len() - 1];
    assert!(
        settled >= lowest_ok && settled <= lowest_ok + 90,
        "settled {settled} MHz, lowest within the margin {lowest_ok} MHz"
    );
}

#[test]
fn when_demand_rises_it_raises_the_clock_at_once_and_searches_again() {
    let limit_ms = 30.0;
    let mut policy = policy(Some(limit_ms));
    let mut gpu = Gpu {
        demand: 1_500.0,
        noise: 13,
    };
    let light = run(&mut policy, &mut gpu, 0, 200);
    let light_mhz = light[light.len() - 1];
    gpu.demand = 9_000.0;
    let busy = run(&mut policy, &mut gpu, 200, 200);
    let breaking = busy
        .iter()
        .filter(|&&mhz| gpu.tpot_ms(f64::from(mhz)) > limit_ms)
        .count();
    assert!(breaking <= 4, "{breaking} breaking ticks: {busy:?}");
    let busy_mhz = busy[busy.len() - 1];
    assert!(
        busy_mhz > light_mhz,
        "light {light_mhz} MHz, busy {busy_mhz} MHz"
    );
}

#[test]
fn its_state_hands_over_and_foreign_state_is_refused() {
    let mut old = policy(Some(30.0));
    let mut gpu = Gpu {
        demand: 7_000.0,
        noise: 5,
    };
    run(&mut old, &mut gpu, 0, 53);
    let mut new = policy(Some(30.0));
    let state = testing::assert_hands_over(&old, &mut new);
    assert_eq!(state.schema_version, SCHEMA_VERSION);
    assert_eq!(new.gpus, old.gpus);
    testing::assert_restore_refused(
        &mut new,
        StateWriter::new().u32(1).finish(SCHEMA_VERSION + 1),
        "schema version",
    );
}
