//! The nodes file, the plan, the counters and the verdict as pure functions; the
//! experiment's driver in [`experiment`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::counters::{
    self, Coverage, Figures, Hold, MeasureError, Series, Window, increase, measure,
};
use super::nodes::{ApiAddress, Selector, parse_nodes};
use super::plan::assign;
use super::prometheus::parse_prometheus_duration;
use super::verdict::{PairSums, verdict};
use crate::ab::{Arm, Decision};

mod experiment;

// ---------------------------------------------------------------------------------------
// The nodes file

const TWO_NODES: &str = r#"
labels = { job = "tokwatt" }

[[node]]
name = "gpu-01"
socket = "sockets/gpu-01.sock"
instance = "gpu-01:9400"
load = 10.0

[[node]]
name = "gpu-02"
url = "http://127.0.0.1:9500"
token_file = "/etc/tokwatt/token"
instance = "gpu-02:9400"
labels = { rack = "r2" }
load = 20.0
"#;

#[test]
fn a_nodes_file_gives_each_node_its_api_and_its_labels() {
    let nodes = parse_nodes(TWO_NODES, Path::new("/fleet")).expect("valid");
    assert_eq!(nodes.len(), 2);
    assert_eq!(
        nodes[0].api,
        ApiAddress::Socket(PathBuf::from("/fleet/sockets/gpu-01.sock")),
        "a relative path is the file's folder's"
    );
    assert_eq!(
        nodes[1].api,
        ApiAddress::Http {
            url: "http://127.0.0.1:9500".into(),
            token_file: "/etc/tokwatt/token".into()
        }
    );
    assert_eq!(
        nodes[1].selector.to_string(),
        r#"{instance="gpu-02:9400",job="tokwatt",rack="r2"}"#
    );
    assert_eq!(nodes[0].load, Some(10.0));
    let escaped = Selector(BTreeMap::from([("instance".into(), "a\"b\\c".into())]));
    assert_eq!(escaped.promql(), r#"instance="a\"b\\c""#);
}

#[test]
fn a_bad_nodes_file_names_the_node_the_key_and_the_fix() {
    let node = |body: &str| format!("[[node]]\nname = \"n1\"\n{body}\n");
    let cases = [
        ("".to_owned(), "names no node"),
        (node("instance = \"a:1\""), "has no control API"),
        (
            node("socket = \"/s\"\nurl = \"http://h:1\"\ntoken_file = \"/t\"\ninstance = \"a:1\""),
            "both `socket` and `url`",
        ),
        (
            node("url = \"http://h:1\"\ninstance = \"a:1\""),
            "without a `token_file`",
        ),
        (
            node("socket = \"/s\"\ntoken_file = \"/t\"\ninstance = \"a:1\""),
            "both `socket`",
        ),
        (
            node("url = \"https://h:1\"\ntoken_file = \"/t\"\ninstance = \"a:1\""),
            "is not http://",
        ),
        (node("socket = \"/s\""), "no `instance`"),
        (
            node("socket = \"/s\"\ninstance = \"a:1\"\nload = -1.0"),
            "is not a load",
        ),
        (
            node("socket = \"/s\"\ninstance = \"a:1\"\nlabels = { \"1x\" = \"y\" }"),
            "not a label name",
        ),
        (
            node("socket = \"/s\"\ninstance = \"a:1\"\nport = 3"),
            "unknown field",
        ),
        (
            node("socket = \"/s\"\ninstance = \"a:1\"")
                + &node("socket = \"/t\"\ninstance = \"b:1\""),
            "two nodes are named `n1`",
        ),
        (
            node("socket = \"/s\"\ninstance = \"a:1\"")
                + "[[node]]\nname = \"n2\"\nsocket = \"/t\"\ninstance = \"a:1\"\n",
            "have the same labels",
        ),
        (
            node("socket = \"/s\"\ninstance = \"a:1\"\nload = 3.0")
                + "[[node]]\nname = \"n2\"\nsocket = \"/t\"\ninstance = \"b:1\"\n",
            "for every node or for none",
        ),
    ];
    for (text, expected) in cases {
        let error = parse_nodes(&text, Path::new("/")).expect_err(&text);
        assert!(error.contains(expected), "{text}\n=> {error}");
    }
}

// ---------------------------------------------------------------------------------------
// The plan

fn named(loads: &[f64]) -> Vec<(String, f64)> {
    loads
        .iter()
        .enumerate()
        .map(|(i, &load)| (format!("n{i}"), load))
        .collect()
}

#[test]
fn nodes_are_paired_with_their_neighbours_by_load_whatever_the_files_order() {
    let loads = named(&[5.0, 80.0, 10.0, 75.0, 40.0, 45.0, 1.0, 2.0]);
    let assignment = assign(&loads, 7);
    assert_eq!(assignment.left_out, None);
    let mut pairs: Vec<[String; 2]> = assignment
        .pairs
        .iter()
        .map(|p| {
            let mut two = [loads[p.a_first].0.clone(), loads[p.b_first].0.clone()];
            two.sort();
            two
        })
        .collect();
    pairs.sort();
    let expected = [["n0", "n2"], ["n1", "n3"], ["n4", "n5"], ["n6", "n7"]];
    assert_eq!(pairs, expected.map(|p| p.map(str::to_owned)));

    // The same nodes in another order: the same pairs, the same coin.
    let mut reversed = loads.clone();
    reversed.reverse();
    let again = assign(&reversed, 7);
    for (p, q) in assignment.pairs.iter().zip(&again.pairs) {
        assert_eq!(loads[p.a_first].0, reversed[q.a_first].0);
        assert_eq!(loads[p.b_first].0, reversed[q.b_first].0);
    }
}

#[test]
fn an_odd_node_out_is_the_one_whose_absence_pairs_the_rest_best() {
    let loads = named(&[100.0, 99.0, 50.0, 10.0, 9.0]);
    let assignment = assign(&loads, 1);
    assert_eq!(assignment.left_out, Some(2));
    assert_eq!(assignment.arm_of(2, 0), None);
    assert_eq!(assignment.taking_part().count(), 4);
}

#[test]
fn a_seeded_coin_picks_who_runs_a_first_and_the_arms_swap_halfway() {
    let loads = named(&[8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]);
    assert_eq!(assign(&loads, 3), assign(&loads, 3), "the seed decides");
    let mut higher_first = 0;
    let mut pairs = 0;
    for seed in 0..200 {
        let assignment = assign(&loads, seed);
        for pair in &assignment.pairs {
            pairs += 1;
            higher_first += usize::from(loads[pair.a_first].1 > loads[pair.b_first].1);
            assert_eq!(assignment.arm_of(pair.a_first, 0), Some(Arm::A));
            assert_eq!(assignment.arm_of(pair.a_first, 1), Some(Arm::B));
            assert_eq!(assignment.arm_of(pair.b_first, 0), Some(Arm::B));
            assert_eq!(assignment.arm_of(pair.b_first, 1), Some(Arm::A));
        }
    }
    let share = higher_first as f64 / pairs as f64;
    assert!((0.42..0.58).contains(&share), "{share}");
}

// ---------------------------------------------------------------------------------------
// Counters

pub(super) fn series(labels: &[(&str, &str)], samples: &[(f64, f64)]) -> Series {
    Series {
        labels: labels
            .iter()
            .map(|&(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        samples: samples.to_vec(),
    }
}

#[test]
fn a_counters_increase_counts_across_a_reset_and_a_late_series_from_zero() {
    let reset = series(&[], &[(1.0, 10.0), (2.0, 15.0), (3.0, 4.0), (4.0, 6.0)]);
    let grown = increase(&reset, 1.0, 4.0);
    assert_eq!((grown.value, grown.resets), (5.0 + 4.0 + 2.0, 1));
    // Outside the scrapes asked for: not counted.
    assert_eq!(increase(&reset, 2.0, 3.0).value, 4.0);
    let late = series(&[], &[(3.0, 7.0), (4.0, 9.0)]);
    assert_eq!(
        increase(&late, 1.0, 4.0).value,
        9.0,
        "created at zero after 1.0"
    );
    assert!(!increase(&late, 1.0, 2.0).present_at_end);
}

/// A node's series by metric name.
type Samples = BTreeMap<String, Vec<Series>>;

/// Samples of a healthy node: one scrape a second from 0 to 10 s, `gpus` GPUs, 100 ticks
/// a second, each GPU making 1000 tokens and using 300 J per second, with demand where
/// `demand`.
fn node_samples(gpus: usize, demand: bool) -> Samples {
    let times: Vec<f64> = (0..=10).map(f64::from).collect();
    let at = |rate: f64| -> Vec<(f64, f64)> { times.iter().map(|&t| (t, rate * t)).collect() };
    let flat = |value: f64| -> Vec<(f64, f64)> { times.iter().map(|&t| (t, value)).collect() };
    let per_gpu = |rate: f64| -> Vec<Series> {
        (0..gpus)
            .map(|g| {
                series(
                    &[("gpu", &g.to_string()), ("policy", "p"), ("version", "v")],
                    &at(rate),
                )
            })
            .collect()
    };
    let mut samples = BTreeMap::new();
    samples.insert(counters::UP.to_owned(), vec![series(&[], &flat(1.0))]);
    samples.insert(counters::TICKS.to_owned(), vec![series(&[], &at(100.0))]);
    samples.insert(counters::TOKENS.to_owned(), per_gpu(1000.0));
    samples.insert(counters::ENERGY.to_owned(), per_gpu(300.0));
    samples.insert(counters::VIOLATIONS.to_owned(), per_gpu(1.0));
    if demand {
        samples.insert(counters::DEMANDED.to_owned(), per_gpu(1100.0));
    }
    for metric in [
        counters::SWAPS,
        counters::ROLLBACKS,
        counters::OPERATOR_ROLLBACKS,
        counters::PAUSED,
    ] {
        samples.insert(metric.to_owned(), vec![series(&[], &flat(0.0))]);
    }
    samples
}

const WINDOW: Window = Window {
    start_s: 1.5,
    end_s: 8.5,
};

#[test]
fn a_window_is_counted_between_its_first_and_last_scrapes_summed_over_gpus() {
    let measured = measure(&node_samples(2, true), WINDOW, 3.0, Hold::OnePolicy).expect("ok");
    assert_eq!(
        measured.coverage,
        Coverage {
            from_s: 2.0,
            to_s: 8.0,
            scrapes: 7,
            failed_scrapes: 0,
            longest_gap_s: 1.0,
        }
    );
    assert_eq!(measured.gpus, 2);
    assert_eq!(measured.node_ticks, 600);
    assert_eq!(
        measured.figures,
        Figures {
            tokens: 12_000,
            energy_j: 3600.0,
            violation_ticks: 12,
            ticks: 1200,
            tokens_demanded: Some(13_200),
        }
    );
    assert_eq!(measured.tokens_per_tick(), 20.0);
    let unknown = measure(&node_samples(2, false), WINDOW, 3.0, Hold::OnePolicy).expect("ok");
    assert_eq!(unknown.figures.tokens_demanded, None, "no counter: unknown");
    // Demand for one GPU of two is not the node's demand.
    let mut partial = node_samples(2, true);
    partial
        .get_mut(counters::DEMANDED)
        .expect("demand")
        .truncate(1);
    let partial = measure(&partial, WINDOW, 3.0, Hold::OnePolicy).expect("ok");
    assert_eq!(partial.figures.tokens_demanded, None);
}

#[test]
fn a_missing_metric_a_gap_or_a_change_of_policy_is_an_error_never_a_zero() {
    let check = |edit: &dyn Fn(&mut Samples), expected: MeasureError| {
        let mut samples = node_samples(1, true);
        edit(&mut samples);
        assert_eq!(
            measure(&samples, WINDOW, 3.0, Hold::OnePolicy),
            Err(expected)
        );
    };
    check(
        &|s| {
            s.remove(counters::ENERGY);
        },
        MeasureError::Missing {
            metric: counters::ENERGY,
        },
    );
    check(
        &|s| {
            let up = &mut s.get_mut(counters::UP).expect("up")[0].samples;
            up.retain(|&(t, _)| !(3.0..=6.0).contains(&t));
        },
        MeasureError::Gap {
            from_s: 2.0,
            to_s: 7.0,
            gap_s: 5.0,
            max_gap_s: 3.0,
        },
    );
    check(
        &|s| {
            let up = s.get_mut(counters::UP).expect("up");
            up.push(up[0].clone());
        },
        MeasureError::Ambiguous {
            metric: counters::UP,
            count: 2,
        },
    );
    check(
        &|s| {
            let ticks = &mut s.get_mut(counters::TICKS).expect("ticks")[0].samples;
            ticks[5].1 = 3.0;
        },
        MeasureError::Restarted,
    );
    check(
        &|s| {
            let swaps = &mut s.get_mut(counters::ROLLBACKS).expect("rollbacks")[0].samples;
            for sample in swaps.iter_mut().skip(6) {
                sample.1 = 1.0;
            }
        },
        MeasureError::PolicyChanged {
            metric: counters::ROLLBACKS,
            by: 1,
        },
    );
    check(
        &|s| {
            let paused = &mut s.get_mut(counters::PAUSED).expect("paused")[0].samples;
            paused[4].1 = 1.0;
        },
        MeasureError::Paused { at_s: 4.0 },
    );
    check(
        &|s| {
            let ticks = &mut s.get_mut(counters::TICKS).expect("ticks")[0].samples;
            for sample in ticks.iter_mut() {
                sample.1 = 7.0;
            }
        },
        MeasureError::NoTicks,
    );
    // The baseline only needs the scrapes.
    let mut swapped = node_samples(1, true);
    swapped.get_mut(counters::SWAPS).expect("swaps")[0].samples[7].1 = 1.0;
    assert!(measure(&swapped, WINDOW, 3.0, Hold::Scraped).is_ok());
    // A failed scrape here and there loses nothing: the counters are cumulative.
    let mut failed = node_samples(1, true);
    failed.get_mut(counters::UP).expect("up")[0].samples[4].1 = 0.0;
    for metric in [counters::TOKENS, counters::TICKS] {
        failed.get_mut(metric).expect("series")[0]
            .samples
            .retain(|&(t, _)| t != 4.0);
    }
    let measured = measure(&failed, WINDOW, 3.0, Hold::OnePolicy).expect("one failure is fine");
    assert_eq!(measured.coverage.failed_scrapes, 1);
    assert_eq!(measured.figures.tokens, 6000);
    // Two scrapes are the least a difference needs.
    let short = Window {
        start_s: 1.5,
        end_s: 2.5,
    };
    assert!(matches!(
        measure(&node_samples(1, true), short, 3.0, Hold::OnePolicy),
        Err(MeasureError::TooFewScrapes { scrapes: 1, .. })
    ));
}

#[test]
fn prometheus_durations_parse() {
    assert_eq!(parse_prometheus_duration("15s"), Some(15.0));
    assert_eq!(parse_prometheus_duration("1m30s"), Some(90.0));
    assert_eq!(parse_prometheus_duration("500ms"), Some(0.5));
    assert_eq!(parse_prometheus_duration("1h"), Some(3600.0));
    assert_eq!(parse_prometheus_duration("s"), None);
    assert_eq!(parse_prometheus_duration("10x"), None);
    assert_eq!(parse_prometheus_duration(""), None);
}

// ---------------------------------------------------------------------------------------
// Pairs and the verdict

fn figures(tokens: u64, energy_j: f64, demanded: Option<u64>) -> Figures {
    Figures {
        tokens,
        energy_j,
        violation_ticks: 0,
        ticks: 1000,
        tokens_demanded: demanded,
    }
}

#[test]
fn each_arm_sums_one_half_of_each_node_so_the_period_and_the_node_cancel() {
    // Arm B makes 1.25 times the tokens per joule. The second period is 10 % more
    // productive for both arms; node y draws twice node x's energy.
    let (t_a, t_b) = (2.0, 2.5);
    let (p1, p2) = (1.0, 1.1);
    let half = |tpj: f64, period: f64, energy: f64| {
        figures((tpj * period * energy).round() as u64, energy, None)
    };
    let (ex, ey) = (1000.0, 1000.0);
    // x runs A first; y runs B first.
    let sums = PairSums::of(
        [&half(t_a, p1, ex), &half(t_b, p2, ex)],
        [&half(t_b, p1, ey), &half(t_a, p2, ey)],
    );
    assert!((sums.ratio_b_over_a - 1.25).abs() < 1e-3, "{sums:?}");
    assert_eq!(
        sums.a.tokens,
        (t_a * p1 * ex) as u64 + (t_a * p2 * ey) as u64
    );
    let ey = 2000.0;
    let sums = PairSums::of(
        [&half(t_a, p1, ex), &half(t_b, p1, ex)],
        [&half(t_b, p1, ey), &half(t_a, p1, ey)],
    );
    assert!((sums.ratio_b_over_a - 1.25).abs() < 1e-3, "{sums:?}");
}

#[test]
fn halves_of_unequal_length_weigh_alike_so_the_node_still_cancels() {
    // No difference between the arms; node y makes three times node x's tokens per
    // joule. x's first half ran 1.5 times as long as its second (and y's the reverse):
    // summed as they are, A would lean to x's efficiency and B to y's.
    let half = |tpj: f64, ticks: u64| Figures {
        tokens: (tpj * ticks as f64 * 100.0).round() as u64,
        energy_j: ticks as f64 * 100.0,
        violation_ticks: ticks / 10,
        ticks,
        tokens_demanded: Some((tpj * ticks as f64 * 100.0).round() as u64),
    };
    let (x1, x2) = (half(2.0, 1500), half(2.0, 1000));
    let (y1, y2) = (half(6.0, 1000), half(6.0, 1500));
    let sums = PairSums::of([&x1, &x2], [&y1, &y2]);
    assert!((sums.ratio_b_over_a - 1.0).abs() < 1e-6, "{sums:?}");
    assert_eq!(sums.a.ticks, 2 * 1250);
    assert_eq!(
        sums.a.violation_ticks, 250,
        "a tenth of the ticks, as each half had"
    );
    assert_eq!(sums.a.served_fraction, Some(1.0));
}

#[test]
fn served_demand_is_known_only_where_both_halves_know_it() {
    let known = PairSums::of(
        [
            &figures(900, 10.0, Some(1000)),
            &figures(1000, 10.0, Some(800)),
        ],
        [&figures(500, 10.0, Some(500)), &figures(100, 10.0, Some(0))],
    );
    assert_eq!(known.a.served_fraction, Some(1000.0 / 1000.0));
    assert_eq!(known.a.tokens_demanded, Some(1000));
    assert_eq!(known.b.served_fraction, Some(1.0), "capped at 1");
    let unknown = PairSums::of(
        [&figures(900, 10.0, Some(1000)), &figures(1000, 10.0, None)],
        [&figures(500, 10.0, Some(500)), &figures(100, 10.0, Some(0))],
    );
    assert_eq!(unknown.a.served_fraction, Some(1.0));
    assert_eq!(unknown.b.served_fraction, None);
}

fn pairs_with_ratio(ratios: &[f64], demand: bool) -> Vec<PairSums> {
    ratios
        .iter()
        .map(|&ratio| {
            let demanded = demand.then_some(1000);
            let a = figures(1000, 100.0, demanded);
            let b = figures(1000, 100.0 / ratio, demanded);
            PairSums::of([&a, &b], [&b, &a])
        })
        .collect()
}

#[test]
fn a_clear_difference_wins_and_unknown_demand_refuses_the_win_unless_accepted() {
    let pairs = pairs_with_ratio(&[1.30, 1.28, 1.33, 1.31], true);
    let clear = verdict(&pairs, 0.02, 1, &[], false).expect("verdict");
    assert_eq!(clear.decision, Decision::B);
    assert_eq!(clear.more_tokens_per_joule, Some(Arm::B));
    assert!(clear.ci_low > 1.2 && clear.t_ci_low > 1.2, "{clear:?}");
    assert_eq!(clear.served_fraction_b, Some(1.0));

    let pairs = pairs_with_ratio(&[1.30, 1.28, 1.33, 1.31], false);
    let nodes = vec!["n1".to_owned(), "n2".to_owned()];
    let refused = verdict(&pairs, 0.02, 1, &nodes, false).expect("verdict");
    assert_eq!(refused.decision, Decision::BRefused, "named as refused");
    assert_eq!(
        refused.decision_headline(),
        "B refused: more tokens per joule, but whether it served less demand than A is unknown"
    );
    assert_eq!(refused.more_tokens_per_joule, Some(Arm::B));
    let why = refused.refused_because.expect("why");
    assert!(
        why.contains("n1, n2") && why.contains("--accept-unknown-demand"),
        "{why}"
    );
    assert_eq!(refused.served_fraction_a, None, "never read as 1");

    let accepted = verdict(&pairs, 0.02, 1, &nodes, true).expect("verdict");
    assert_eq!(accepted.decision, Decision::B);
    let objective = accepted.objective.expect("the winner's objective reading");
    assert_eq!(objective.served, None, "not checked, so not shown");
    assert_eq!(accepted.served_fraction_b, None);
}

#[test]
fn no_difference_is_no_winner() {
    let pairs = pairs_with_ratio(&[1.01, 0.98, 1.02, 0.99, 1.0], true);
    let same = verdict(&pairs, 0.02, 1, &[], false).expect("verdict");
    assert_eq!(same.decision, Decision::NoDifference);
    assert_eq!(same.more_tokens_per_joule, None);
    assert_eq!(same.refused_because, None);
}
