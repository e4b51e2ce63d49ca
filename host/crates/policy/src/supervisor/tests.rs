use super::doubles::NativePolicy;
use super::*;
use tokwatt_core::types::Objective;

/// Asks for 500 W, except on the calls listed, which trap.
fn failing_on(fail_on: Vec<u64>) -> NativePolicy {
    NativePolicy::new(move |call, observations| {
        if fail_on.contains(&call) {
            return Err(PolicyFailure::Trap("scripted".into()));
        }
        Ok(vec![
            Settings {
                power_cap_w: Some(500.0),
                ..Settings::default()
            };
            observations.len()
        ])
    })
}

fn args() -> InitArgs {
    InitArgs {
        devices: vec![],
        knobs: Knobs::default(),
        objective: Objective::default(),
        params: vec![],
        tick_ms: 1000,
        seed: 1,
    }
}

fn observation() -> Observation {
    Observation {
        interval_s: 1.0,
        tpot_p50_ms: 0.0,
        tpot_p99_ms: 0.0,
        in_force: tokwatt_core::types::InForce {
            power_cap_w: 700.0,
            power_cap_requested_w: 700.0,
            sm_clock_max_mhz: 1980,
            batch_size: 1,
            token_budget: 0,
        },
        ..Observation::nothing(0, 0)
    }
}

fn supervisor(fail_on: Vec<u64>) -> Supervisor {
    Supervisor::start(
        Box::new(failing_on(fail_on)),
        args(),
        BreakerConfig::default(),
    )
    .expect("starts")
    .0
}

#[test]
fn a_failure_costs_one_tick_and_holds_settings() {
    let mut sup = supervisor(vec![1]);
    let obs = [observation()];
    assert_eq!(
        sup.decide(0, Duration::ZERO, &obs).source,
        DecisionSource::Policy
    );
    let failed = sup.decide(1, Duration::ZERO, &obs);
    assert!(matches!(failed.source, DecisionSource::Fallback(_)));
    assert_eq!(failed.settings, vec![Settings::default()]);
    assert_eq!(
        sup.decide(2, Duration::ZERO, &obs).source,
        DecisionSource::Policy
    );
    let counters = sup.counters();
    assert_eq!(counters.traps, 1);
    assert_eq!(counters.fallback_ticks, 1);
    assert_eq!(counters.failures_by_kind.get("trap"), Some(&1));
    assert_eq!(counters.rebuilds, 1, "a trap rebuilds the instance");
    assert_eq!(counters.ejections, 0);
}

#[test]
fn repeated_failures_eject_with_backoff_then_retry() {
    // Fails on calls 0..=2 (eject), then the half-open call 3 succeeds.
    let mut sup = supervisor(vec![0, 1, 2]);
    let obs = [observation()];
    for tick in 0..3 {
        assert!(matches!(
            sup.decide(tick, Duration::ZERO, &obs).source,
            DecisionSource::Fallback(_)
        ));
    }
    assert!(sup.is_ejected());
    let backoff = BreakerConfig::default().backoff_ticks;
    for tick in 3..3 + backoff {
        assert!(matches!(
            sup.decide(tick, Duration::ZERO, &obs).source,
            DecisionSource::Ejected { .. }
        ));
    }
    assert_eq!(
        sup.decide(3 + backoff, Duration::ZERO, &obs).source,
        DecisionSource::Policy
    );
    assert!(!sup.is_ejected());
    assert_eq!(sup.counters().ejections, 1);
}

#[test]
fn backoff_doubles_at_each_ejection() {
    let mut sup = supervisor((0..1000).collect());
    let obs = [observation()];
    let mut ejected_until = Vec::new();
    for tick in 0..200 {
        if let DecisionSource::Ejected { until_tick } =
            sup.decide(tick, Duration::ZERO, &obs).source
            && ejected_until.last() != Some(&until_tick)
        {
            ejected_until.push(until_tick);
        }
    }
    // First ejection at tick 2 for 10 ticks, then a failed retry ejects for 20, then 40...
    assert_eq!(&ejected_until[..3], &[13, 34, 75]);
}

/// The until-ticks of each ejection over `ticks` ticks.
fn ejections(sup: &mut Supervisor, ticks: std::ops::Range<u64>) -> Vec<u64> {
    let obs = [observation()];
    let mut until = Vec::new();
    for tick in ticks {
        if let DecisionSource::Ejected { until_tick } =
            sup.decide(tick, Duration::ZERO, &obs).source
            && until.last() != Some(&until_tick)
        {
            until.push(until_tick);
        }
    }
    until
}

#[test]
fn a_long_healthy_stretch_forgives_earlier_ejections() {
    // Calls 0..=2 fail (ejected for 10), the retry (call 3) fails (ejected for 20);
    // then calls 4..=703 are healthy (700 ticks, past forgive_after_ticks = 600), and
    // calls 704..=706 fail: the backoff is back to 10, not 40.
    let mut failing: Vec<u64> = vec![0, 1, 2, 3];
    failing.extend(704..=706);
    let mut sup = supervisor(failing);
    let until = ejections(&mut sup, 0..800);
    assert_eq!(until.len(), 3, "{until:?}");
    assert_eq!(&until[..2], &[13, 34]);
    // The third ejection happens on the tick of call 706 (tick 34 + 702 = 736).
    assert_eq!(until[2], 736 + 1 + 10, "{until:?}");

    // Without the healthy stretch being long enough, the backoff keeps doubling.
    let mut failing: Vec<u64> = vec![0, 1, 2, 3];
    failing.extend(104..=106);
    let mut sup = supervisor(failing);
    let until = ejections(&mut sup, 0..200);
    assert_eq!(until[2], 136 + 1 + 40, "{until:?}");
}

#[test]
fn breaker_settings_are_validated() {
    assert_eq!(BreakerConfig::default().validate(), Ok(()));
    let zero_forgive = BreakerConfig {
        forgive_after_ticks: 0,
        ..BreakerConfig::default()
    };
    let error = zero_forgive.validate().expect_err("refused");
    assert_eq!(error.key, "forgive_after_ticks");
    let inverted = BreakerConfig {
        max_backoff_ticks: 5,
        ..BreakerConfig::default()
    };
    assert!(inverted.validate().is_err());
    // Older specs without the key get the default.
    let parsed: BreakerConfig =
        toml::from_str("failures_to_eject = 2").expect("parses without forgive_after_ticks");
    assert_eq!(parsed.forgive_after_ticks, 600);
}

#[test]
fn wrong_length_is_an_invalid_answer() {
    let short = NativePolicy::new(|_, _| Ok(vec![]));
    let (mut sup, _) =
        Supervisor::start(Box::new(short), args(), BreakerConfig::default()).expect("starts");
    let decision = sup.decide(0, Duration::ZERO, &[observation()]);
    assert!(matches!(
        decision.source,
        DecisionSource::Fallback(PolicyFailure::InvalidAnswer(_))
    ));
    assert_eq!(sup.counters().invalid_answers, 1);
}
