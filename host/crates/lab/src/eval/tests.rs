use super::*;

fn series(points: &[(f64, f64, f64)]) -> Series {
    Series {
        time_s: points.iter().map(|p| p.0).collect(),
        tokens: points.iter().map(|p| p.1).collect(),
        energy_j: points.iter().map(|p| p.2).collect(),
        settings: vec![(0.0, 0, 0); points.len()],
    }
}

/// `ticks` one-second ticks at `tpj(t)` tokens per joule, 100 J a tick.
fn steady(ticks: u32, tpj: impl Fn(f64) -> f64) -> Series {
    let mut points = Vec::new();
    let (mut tokens, mut energy) = (0.0, 0.0);
    for i in 1..=ticks {
        let t = f64::from(i);
        energy += 100.0;
        tokens += 100.0 * tpj(t);
        points.push((t, tokens, energy));
    }
    series(&points)
}

#[test]
fn trailing_windows_need_a_full_window() {
    let s = steady(100, |_| 2.0);
    let trailing = s.trailing_tokens_per_joule(30.0);
    assert!(trailing[10].1.is_nan());
    assert!((trailing[50].1 - 2.0).abs() < 1e-12);
}

#[test]
fn time_to_fraction_counts_from_each_phase_start() {
    let oracle = steady(600, |_| 2.0);
    // Reaches the oracle at 100 s into the first phase; never in the second.
    let policy = steady(600, |t| {
        if t < 100.0 {
            1.0
        } else if t < 300.0 {
            2.0
        } else {
            1.5
        }
    });
    let first = time_to_fraction(&policy, &oracle, &[(0.0, 300.0)], 0.95);
    // The trailing 30 s window mixes 1.0 and 2.0 tokens per joule until it holds 27 s
    // at 2.0 (1.9 = 0.95 × 2.0): from t = 126 s, and it holds after that.
    assert_eq!(first, 126.0);
    let both = time_to_fraction(&policy, &oracle, &[(0.0, 300.0), (300.0, 600.0)], 0.95);
    // The second phase never reaches it and counts as its full 300 s.
    assert!((both - (first + 300.0) / 2.0).abs() < 1e-9, "{both}");
    assert!(time_to_fraction(&steady(600, |_| 1.0), &oracle, &[(0.0, 600.0)], 0.95).is_nan());
}

#[test]
fn spreads_ignore_nan_and_take_the_middle() {
    let spread = Spread::of(&[3.0, f64::NAN, 1.0, 2.0]);
    assert_eq!(
        spread,
        Spread {
            median: 2.0,
            min: 1.0,
            max: 3.0
        }
    );
    assert_eq!(median(&[1.0, 2.0, 3.0, 4.0]), 2.5);
    assert!(median(&[]).is_nan());
}

#[test]
fn a_scenario_fails_beyond_one_percent_of_ticks_or_one_point_of_demand() {
    assert_eq!(
        super::objective_breach(0.01, 0.01, None),
        None,
        "at the limits: kept"
    );
    let why = super::objective_breach(0.0101, 0.0, None).expect("violations");
    assert!(why.contains("1.01 % of ticks"), "{why}");
    let why = super::objective_breach(0.0, 0.02, None).expect("served less");
    assert!(why.contains("2.00 points less"), "{why}");
    let both = super::objective_breach(0.5, 0.5, None).expect("both");
    assert!(both.contains("; "), "{both}");
    // An overload: the oracle itself breaks the objective on 30 % of ticks.
    assert_eq!(super::objective_breach(0.305, 0.0, Some(0.30)), None);
    let why = super::objective_breach(0.32, 0.0, Some(0.30)).expect("beyond the oracle");
    assert!(why.contains("an overload"), "{why}");
    assert!(
        super::objective_breach(0.30, 0.05, Some(0.30)).is_some(),
        "served demand first"
    );
}

/// An overload (a 14B-class shape on an H200, the middle phase beyond what any setting
/// serves) leaves a backlog that the phase after it must work off, whoever holds the
/// knobs. The oracle's phases, each verified from an empty queue, leave that out; its
/// schedule run in one piece, as a policy runs, counts it, and the judge allows a policy
/// that share of ticks over the objective (plus the margin).
#[test]
fn an_overloads_backlog_counts_for_the_oracle_too() {
    let text = r#"
description = "overload, then a light phase that inherits its backlog"
gpu = "h200"
duration_s = 300

[objective]
queue_wait_p99_limit_ms = 3000

[workload]
context_tokens = 4096
output_tokens = 128
batch_size_max = 120
queue_max = 2048

[workload.model_shape]
hidden = 5120
layers = 48
heads = 40
kv_heads = 8
head_dim = 128
mlp = 13824
vocab = 152064

[[workload.phases]]
start_s = 0
arrival_rps = 6.8

[[workload.phases]]
start_s = 100
arrival_rps = 37.6

[[workload.phases]]
start_s = 200
arrival_rps = 9.2
"#;
    let scenario =
        EvalScenario::parse(std::path::Path::new("overload.toml"), text).expect("parses");
    let phases = oracle::search(&scenario, 300.0, 1).expect("oracle");
    assert!(oracle::is_overload(&phases), "{phases:?}");
    let per_phase = oracle::violation_fraction(&phases);
    let schedule = run_schedule(&scenario, &phases, 300.0, 1).expect("schedule");
    assert!(
        schedule.violation_fraction > per_phase + 0.01,
        "one run {:.3}, phases one by one {per_phase:.3}",
        schedule.violation_fraction
    );
}
