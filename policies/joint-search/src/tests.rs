//! The policy on synthetic observations of an H200-like GPU (not simulator output).

use super::*;
use tokwatt_policy_sdk::{StateWriter, testing};

fn args(pairs: &[(&str, &str)], limit_ms: Option<f64>) -> InitArgs {
    let mut args = testing::init_args(vec![testing::h200(0)], Knobs::SM_CLOCK | Knobs::BATCH_SIZE);
    args.params = testing::params(pairs);
    args.objective.tpot_p99_limit_ms = limit_ms;
    args
}

fn policy(limit_ms: Option<f64>) -> JointSearch {
    match JointSearch::init(args(&[], limit_ms)) {
        Ok((policy, _)) => policy,
        Err(error) => panic!("{error}"),
    }
}

/// A GPU under `demand` tokens a second: capacity grows with the clock and the batch,
/// the p99 time per token with the batch in use and falls with the clock, power falls
/// with the clock (voltage). 3 % power noise.
struct Gpu {
    demand: f64,
    noise: u64,
}

impl Gpu {
    /// How much slower than at full speed a step runs at `mhz` (below the ~1200 MHz knee).
    fn slowdown(mhz: f64) -> f64 {
        (1200.0 / mhz).max(1.0).powf(0.9)
    }

    /// Step time with `active` sequences, ms.
    fn step_ms(mhz: f64, active: f64) -> f64 {
        (6.0 + 0.04 * active) * Self::slowdown(mhz)
    }

    /// Tokens a second with every slot of `batch` busy.
    fn capacity(mhz: f64, batch: u32) -> f64 {
        f64::from(batch) / Self::step_ms(mhz, f64::from(batch)) * 1000.0
    }

    /// Sequences decoding: as many as the demand keeps in flight (more when each step is
    /// slower), at most the batch.
    fn active(&self, mhz: f64, batch: u32) -> f64 {
        (0.025 * self.demand * Self::slowdown(mhz)).min(f64::from(batch))
    }

    fn tpot_ms(&self, mhz: f64, batch: u32) -> f64 {
        Self::step_ms(mhz, self.active(mhz, batch))
    }

    fn observe(&mut self, tick: u64, mhz: u32, batch: u32, settling: bool) -> Observation {
        self.noise = self
            .noise
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let jitter = ((self.noise >> 11) as f64 / (1_u64 << 53) as f64) * 2.0 - 1.0;
        let mhz_f = f64::from(mhz);
        let capacity = Self::capacity(mhz_f, batch);
        let tokens = self.demand.min(capacity);
        let x = mhz_f / 1980.0;
        let volts = (1.0 - 0.64 * (1.0 - x)).max(0.65);
        let power_w = (100.0 + 600.0 * x * volts * volts) * (1.0 + 0.03 * jitter);
        let mut observation = testing::observation(0, tick);
        observation.tokens = tokens as u64;
        observation.energy_j = power_w;
        observation.power_avg_w = power_w;
        observation.tokens_per_s = tokens;
        observation.tokens_per_joule = tokens / power_w;
        observation.queue_depth = if self.demand > capacity { 500 } else { 0 };
        observation.tpot_p99_ms = self.tpot_ms(mhz_f, batch);
        observation.in_force.sm_clock_max_mhz = mhz;
        observation.in_force.batch_size = batch;
        observation.settling = settling;
        observation
    }
}

/// Runs `ticks` ticks, applying every decision at once; returns (clock, batch) in force.
fn run(policy: &mut JointSearch, gpu: &mut Gpu, first_tick: u64, ticks: u64) -> Vec<(u32, u32)> {
    run_edited(policy, gpu, first_tick, ticks, |_| {})
}

/// As [`run`], with `edit` applied to each observation before the policy sees it.
fn run_edited(
    policy: &mut JointSearch,
    gpu: &mut Gpu,
    first_tick: u64,
    ticks: u64,
    edit: impl Fn(&mut Observation),
) -> Vec<(u32, u32)> {
    let (mut mhz, mut batch) = policy.gpus[0].target();
    let mut settling = false;
    let mut history = Vec::new();
    for tick in first_tick..first_tick + ticks {
        let mut observation = gpu.observe(tick, mhz, batch, settling);
        edit(&mut observation);
        let decided = policy.decide(&[observation]);
        let asked = (
            decided[0].sm_clock_max_mhz.unwrap_or(mhz),
            decided[0].batch_size.unwrap_or(batch),
        );
        settling = asked != (mhz, batch);
        (mhz, batch) = asked;
        history.push((mhz, batch));
    }
    history
}

#[test]
fn it_needs_both_knobs_and_known_sensible_parameters() {
    let mut clock_only = args(&[], None);
    clock_only.knobs = Knobs::SM_CLOCK;
    let cases = [
        (clock_only, "add \"batch-size\""),
        (args(&[("arms", "9")], None), "unknown parameter `arms`"),
        (args(&[("clock_levels", "1")], None), "`clock_levels` = 1"),
        (args(&[("batch_levels", "40")], None), "within 256"),
        (args(&[("prior_spread", "-1")], None), "`prior_spread` = -1"),
    ];
    for (args, expected) in cases {
        let error = JointSearch::init(args).err().unwrap_or_default();
        assert!(error.contains(expected), "{expected}: {error}");
    }
}

#[test]
fn it_starts_at_the_fastest_clock_and_largest_batch_of_its_grid() {
    let (policy, first) =
        JointSearch::init(args(&[], None)).unwrap_or_else(|error| panic!("{error}"));
    assert_eq!(
        first,
        vec![
            Settings::unchanged()
                .with_sm_clock_max_mhz(1980)
                .with_batch_size(512)
        ]
    );
    let bandit = &policy.gpus[0];
    assert_eq!(bandit.clocks.len(), 24);
    assert_eq!((bandit.clocks[0], bandit.clocks[23]), (345, 1980));
    assert_eq!(bandit.batches, vec![64, 128, 256, 512]);
}

#[test]
fn under_a_latency_objective_it_finds_a_low_clock_and_keeps_the_limit_mostly() {
    let limit_ms = 30.0;
    let mut policy = policy(Some(limit_ms));
    let mut gpu = Gpu {
        demand: 8_000.0,
        noise: 21,
    };
    let history = run(&mut policy, &mut gpu, 0, 400);
    let breaking = history
        .iter()
        .filter(|&&(mhz, batch)| gpu.tpot_ms(f64::from(mhz), batch) > limit_ms)
        .count();
    assert!(breaking <= 12, "{breaking} of 400 ticks broke the limit");
    // Demand-limited, tokens per joule is demand over power: the best arm is the one of
    // least power that keeps the limit (with the margin) and the demand. By brute force:
    let power = |mhz: u32| {
        let x = f64::from(mhz) / 1980.0;
        let volts = (1.0 - 0.64 * (1.0 - x)).max(0.65);
        100.0 + 600.0 * x * volts * volts
    };
    let bandit = &policy.gpus[0];
    let best_w = bandit
        .clocks
        .iter()
        .flat_map(|&mhz| bandit.batches.iter().map(move |&batch| (mhz, batch)))
        .filter(|&(mhz, batch)| {
            gpu.tpot_ms(f64::from(mhz), batch) <= 0.9 * limit_ms
                && Gpu::capacity(f64::from(mhz), batch) >= gpu.demand
        })
        .map(|(mhz, _)| power(mhz))
        .fold(f64::INFINITY, f64::min);
    // The last 100 ticks spend within 6 % of that power on average.
    let tail = &history[300..];
    let mean_w = tail.iter().map(|&(mhz, _)| power(mhz)).sum::<f64>() / tail.len() as f64;
    assert!(
        mean_w <= best_w * 1.06,
        "{mean_w:.0} W vs best {best_w:.0} W: {tail:?}"
    );
}

#[test]
fn a_shift_in_demand_drops_what_was_learnt() {
    let mut policy = policy(Some(30.0));
    let mut gpu = Gpu {
        demand: 8_000.0,
        noise: 4,
    };
    run(&mut policy, &mut gpu, 0, 200);
    let visited_before = policy.gpus[0]
        .records
        .iter()
        .filter(|record| record.ticks() > 0)
        .count();
    gpu.demand = 1_000.0;
    // Enough ticks for the shift to show, too few to visit as many arms again.
    run(&mut policy, &mut gpu, 200, 14);
    let visited_after = policy.gpus[0]
        .records
        .iter()
        .filter(|record| record.ticks() > 0)
        .count();
    assert!(
        visited_after < visited_before && visited_after <= 3,
        "{visited_before} arms known before the shift, {visited_after} after"
    );
}

#[test]
fn its_state_hands_over_and_foreign_state_is_refused() {
    let mut old = policy(Some(30.0));
    let mut gpu = Gpu {
        demand: 8_000.0,
        noise: 5,
    };
    run(&mut old, &mut gpu, 0, 61);
    let mut new = policy(Some(30.0));
    let state = testing::assert_hands_over(&old, &mut new);
    assert_eq!(state.schema_version, state::SCHEMA_VERSION);
    assert_eq!(new.gpus, old.gpus);
    testing::assert_restore_refused(
        &mut new,
        StateWriter::new().u32(1).finish(state::SCHEMA_VERSION + 1),
        "schema version",
    );
    let mut coarser = match JointSearch::init(args(&[("clock_levels", "8")], Some(30.0))) {
        Ok((policy, _)) => policy,
        Err(error) => panic!("{error}"),
    };
    testing::assert_restore_refused(&mut coarser, state, "starting afresh");
}

#[test]
fn a_visit_whose_latency_is_unknown_vouches_for_nothing_and_measures_on_until_a_tick_tells() {
    let limit_ms = 30.0;
    let mut policy = policy(Some(limit_ms));
    let mut gpu = Gpu {
        demand: 8_000.0,
        noise: 21,
    };
    let start = policy.gpus[0].target();
    // A serving engine that saw no request end: the host sends NaN, tick after tick.
    let unknown = |observation: &mut Observation| observation.tpot_p99_ms = f64::NAN;
    let history = run_edited(&mut policy, &mut gpu, 0, 40, unknown);
    let bandit = &policy.gpus[0];
    assert!(
        history.iter().all(|&arm| arm == start),
        "it left {start:?} on unknown latency: {history:?}"
    );
    assert_eq!(
        (
            bandit.visits,
            bandit.held.iter().filter(|&&held| held).count()
        ),
        (0, 0),
        "an unknown latency was read as within the limit"
    );
    assert!(bandit.window.record.ticks() > policy.config.window_ticks);
    // The first tick that tells ends the visit, judged on it: 14 ms is within the limit.
    let start_arm = bandit.current;
    assert!(gpu.tpot_ms(f64::from(start.0), start.1) < 0.9 * limit_ms);
    run(&mut policy, &mut gpu, 40, 1);
    let bandit = &policy.gpus[0];
    assert_eq!(bandit.visits, 1);
    assert!(bandit.held[start_arm]);
}

#[test]
fn without_a_latency_limit_an_unknown_latency_does_not_hold_a_visit_open() {
    let mut policy = policy(None);
    let mut gpu = Gpu {
        demand: 8_000.0,
        noise: 21,
    };
    let unknown = |observation: &mut Observation| observation.tpot_p99_ms = f64::NAN;
    run_edited(&mut policy, &mut gpu, 0, 40, unknown);
    assert!(policy.gpus[0].visits >= 5, "{}", policy.gpus[0].visits);
}
