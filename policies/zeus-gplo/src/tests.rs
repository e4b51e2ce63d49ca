//! The state machine against a made-up GPU whose tokens per joule peak at a known cap.

use super::*;
use tokwatt_policy_sdk::{StateWriter, testing};

/// Tokens/s and watts at `cap_w` for a demand of `demand` tokens/s: throughput falls
/// below 450 W, power follows the cap down to what the work needs.
fn gpu(cap_w: f64, demand: f64) -> (f64, f64) {
    let capacity = 17_000.0 * (cap_w / 450.0).min(1.0).powf(1.5);
    let tokens_per_s = demand.min(capacity);
    let watts = (120.0 + 580.0 * tokens_per_s / 17_000.0)
        .min(cap_w)
        .max(120.0)
        + (cap_w - 450.0).max(0.0) * 0.4;
    (tokens_per_s, watts)
}

fn init(params: &[(&str, &str)], gpus: u32) -> (ZeusGplo, Vec<Settings>) {
    let devices = (0..gpus).map(testing::h200).collect();
    let mut args = testing::init_args(devices, Knobs::POWER_CAP | Knobs::BATCH_SIZE);
    args.params = testing::params(params);
    ZeusGplo::init(args).unwrap()
}

/// Runs `ticks` ticks and returns the caps requested, tick by tick.
fn run(policy: &mut ZeusGplo, caps: &mut Vec<f64>, ticks: usize, demand: f64) {
    for tick in 0..ticks {
        let cap_w = *caps.last().unwrap_or(&700.0);
        let (tokens_per_s, watts) = gpu(cap_w, demand);
        let observations: Vec<Observation> = (0..policy.gpus as u32)
            .map(|index| {
                let mut observation = testing::observation(index, tick as u64);
                observation.tokens = tokens_per_s as u64;
                observation.tokens_per_s = tokens_per_s;
                observation.energy_j = watts;
                observation.in_force.power_cap_w = cap_w;
                observation.in_force.batch_size = 512;
                observation
            })
            .collect();
        let decided = policy.decide(&observations);
        caps.push(decided[0].power_cap_w.unwrap_or(cap_w));
        assert!(
            decided
                .iter()
                .all(|s| s.power_cap_w == decided[0].power_cap_w)
        );
    }
}

#[test]
fn profiles_every_limit_from_the_top_down_then_keeps_the_selected_one() {
    let (mut policy, first) = init(&[], 1);
    assert_eq!(first[0].power_cap_w, Some(700.0));
    assert_eq!(first[0].batch_size, Some(512));
    // 200-700 W in 25 W steps: 21 limits of 10 + 40 ticks, after 1 tick of waiting.
    assert_eq!(policy.limits.len(), 21);
    let mut caps = vec![700.0];
    run(&mut policy, &mut caps, 1 + 21 * 50, 1e6);
    assert_eq!(caps[1], 700.0);
    assert_eq!(caps[2 + 50], 675.0);
    assert!(
        matches!(policy.phase, Phase::Done { .. }),
        "{:?}",
        policy.phase
    );
    assert_eq!(policy.measurements.len(), 21);
    let kept = policy.cap_w();
    let expected = policy.config.selector.select(&policy.measurements).unwrap();
    assert_eq!(kept, expected);
    // The made-up GPU's cost optimum for eta 0.5 lies at the knee, 450 W.
    assert_eq!(kept, 450.0);
    run(&mut policy, &mut caps, 100, 1e6);
    assert_eq!(caps.last(), Some(&450.0));
}

#[test]
fn the_selector_options_change_the_pick() {
    let pick = |params: &[(&str, &str)]| {
        let (mut policy, _) = init(params, 2);
        let mut caps = vec![700.0];
        run(&mut policy, &mut caps, 1 + 21 * 3, 1e6);
        policy.cap_w()
    };
    let fast = [("warmup_ticks", "1"), ("profile_ticks", "2")];
    let with = |extra: (&'static str, &'static str)| {
        let mut params = fast.to_vec();
        params.push(extra);
        params
    };
    assert_eq!(pick(&with(("optimum_selector", "time"))), 700.0);
    // The made-up GPU makes the most tokens per joule at its knee.
    assert_eq!(pick(&with(("optimum_selector", "energy"))), 450.0);
    let slow = pick(&[
        fast[0],
        fast[1],
        ("optimum_selector", "max-slowdown"),
        ("max_slowdown_factor", "1.5"),
    ]);
    let strict = pick(&[
        fast[0],
        fast[1],
        ("optimum_selector", "max-slowdown"),
        ("max_slowdown_factor", "1.0"),
    ]);
    // Time per token at most 1.5x the top limit's: 11 661 tokens/s at 350 W.
    assert_eq!((slow, strict), (350.0, 450.0));
}

#[test]
fn a_workload_shift_starts_the_profile_over() {
    let params = [("warmup_ticks", "1"), ("profile_ticks", "4")];
    let (mut policy, _) = init(&params, 1);
    let mut caps = vec![700.0];
    run(&mut policy, &mut caps, 1 + 21 * 5 + 8, 1e6);
    assert!(matches!(
        policy.phase,
        Phase::Done {
            reference: Some(_),
            ..
        }
    ));
    run(&mut policy, &mut caps, 4, 1000.0);
    assert!(
        matches!(policy.phase, Phase::Ready { .. }),
        "{:?}",
        policy.phase
    );
    assert!(policy.measurements.is_empty());
    let (mut fixed, _) = init(&[params[0], params[1], ("reprofile_on_shift", "false")], 1);
    let mut caps = vec![700.0];
    run(&mut fixed, &mut caps, 1 + 21 * 5 + 8, 1e6);
    run(&mut fixed, &mut caps, 8, 1000.0);
    assert!(matches!(fixed.phase, Phase::Done { .. }));
}

#[test]
fn parameters_are_checked_and_state_hands_over() {
    let devices = vec![testing::h200(0)];
    for (key, value) in [
        ("pl_step_w", "0"),
        ("eta_knob", "1.5"),
        ("max_slowdown_factor", "0.9"),
        ("optimum_selector", "cheapest"),
        ("profile_ticks", "0"),
        ("shift_factor", "1"),
        ("batch_size", "0"),
        ("zeus", "1"),
    ] {
        let mut args = testing::init_args(devices.clone(), Knobs::POWER_CAP | Knobs::BATCH_SIZE);
        args.params = testing::params(&[(key, value)]);
        let error = ZeusGplo::init(args).err().unwrap_or_default();
        assert!(error.contains(key), "{key}: {error}");
    }
    let mut uneven = testing::h200(1);
    uneven.power_cap_max_w = 600.0;
    let args = testing::init_args(vec![testing::h200(0), uneven], Knobs::POWER_CAP);
    assert!(
        ZeusGplo::init(args)
            .err()
            .unwrap_or_default()
            .contains("one power limit")
    );

    let (mut old, _) = init(&[("warmup_ticks", "1"), ("profile_ticks", "3")], 1);
    let mut caps = vec![700.0];
    run(&mut old, &mut caps, 30, 1e6);
    let (mut new, _) = init(&[("warmup_ticks", "1"), ("profile_ticks", "3")], 1);
    testing::assert_hands_over(&old, &mut new);
    assert_eq!(
        (new.phase, &new.measurements),
        (old.phase, &old.measurements)
    );
    testing::assert_restore_refused(
        &mut new,
        StateWriter::new().u32(3).finish(1),
        "3 power limits",
    );
    testing::assert_restore_refused(&mut new, StateWriter::new().finish(2), "got version 2");
}
