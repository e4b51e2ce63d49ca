use super::plots::{ARM_B_COLOUR, FADED_COLOUR};
use super::*;
use crate::ab::run::{AB_FORMAT_VERSION, ArmInfo, Schedule, TickPoint};
use crate::ab::stats::{ArmEpoch, Compliance, EpochPair, ObjectiveCheck, ObjectiveGap};
use tokwatt_agent::assembly::RunMeta;
use tokwatt_report::chart::Axis;

const HOSTILE: &str = "<script>alert(1)</script>";

fn measured(tokens: u64, energy_j: f64) -> ArmEpoch {
    ArmEpoch {
        tokens,
        energy_j,
        served_fraction: 0.995,
        violation_ticks: 1,
        ticks: 10,
    }
}

fn epoch(pair: usize, arm: Arm, position: u8, gpu: u32, energy_j: f64) -> EpochRecord {
    let m = measured(100_000, energy_j);
    EpochRecord {
        pair,
        arm,
        position,
        seed: 1000 * pair as u64 + u64::from(position),
        gpus: vec![gpu],
        first_tick: 100 * pair as u64 + 50 * u64::from(position),
        last_tick: 100 * pair as u64 + 50 * u64::from(position) + 9,
        measured: m,
        tokens_per_joule: m.tokens as f64 / energy_j,
        tokens_per_s: 10_000.0,
        mean_power_w: energy_j / 10.0,
        fallback_ticks: u64::from(position) + 2 * pair as u64,
        settings: Vec::new(),
        group: gpu as usize,
    }
}

fn look(look: usize, pairs: usize, decision: Decision) -> AbSummary {
    AbSummary {
        pairs,
        ratio_b_over_a: 1.0417,
        ci_low: 1.0213,
        ci_high: 1.0625,
        t_ci_low: 1.0198,
        t_ci_high: 1.0641,
        confidence: 0.9922,
        decision,
        look,
        served_fraction_a: 0.995,
        served_fraction_b: 0.995,
        violation_rate_a: 0.1,
        violation_rate_b: 0.1,
        refused_because: None,
        objective: None,
    }
}

/// An outcome with `pairs` pairs on `groups` GPU groups (crossover when more than one),
/// arm B using 4 % less energy than arm A.
fn outcome(groups: u32, pairs: usize, simulated: bool) -> AbOutcome {
    let mode = if groups > 1 {
        Mode::Crossover
    } else {
        Mode::Interleaved
    };
    let mut epochs = Vec::new();
    let mut timeline = Vec::new();
    for pair in 0..pairs {
        for group in 0..groups {
            let first = if (pair + group as usize).is_multiple_of(2) {
                Arm::A
            } else {
                Arm::B
            };
            let second = if first == Arm::A { Arm::B } else { Arm::A };
            for (position, arm) in [(0u8, first), (1u8, second)] {
                let energy = match arm {
                    Arm::A => 50_000.0 + 100.0 * pair as f64,
                    Arm::B => 48_000.0 + 100.0 * pair as f64,
                };
                epochs.push(epoch(pair, arm, position, group, energy));
                let start = 100 * pair as u64 + 50 * u64::from(position);
                for tick in start..start + 50 {
                    let cooling = tick < start + 20;
                    timeline.push(TickPoint {
                        group: group as usize,
                        tick,
                        time_s: tick as f64 + 1.0,
                        arm: (!cooling).then_some(arm),
                        measured: tick >= start + 40,
                        pair: (!cooling).then_some(pair),
                        trajectory_tick: (!cooling).then(|| tick - start - 20),
                        tokens: if cooling { 600 } else { 1000 },
                        energy_j: if cooling { 300.0 } else { 500.0 },
                        power_w: if cooling { 300.0 } else { 500.0 },
                        tokens_per_joule: 2.0,
                    });
                }
            }
        }
    }
    let pairs_seen: Vec<EpochPair> = (0..pairs)
        .map(|pair| EpochPair {
            a: measured(100_000, 50_000.0 + 100.0 * pair as f64),
            b: measured(100_000, 48_000.0 + 100.0 * pair as f64),
        })
        .collect();
    let gpu_difference = if groups > 1 {
        crate::ab::gpu_difference(&epochs)
    } else {
        None
    };
    let schedule = Schedule {
        cooldown_ticks: 20,
        settle_ticks: 0,
        warmup_ticks: 20,
        measure_ticks: 10,
    };
    let ratio_b_over_a = 1.0417;
    AbOutcome {
        format_version: AB_FORMAT_VERSION,
        estimand: crate::ab::run::EstimandInfo::of(
            &schedule,
            std::time::Duration::from_secs(1),
            mode,
            None,
        ),
        spread: crate::ab::run::Spread::of(&pairs_seen, ratio_b_over_a),
        gpu_difference,
        a: ArmInfo {
            policy: "fixed-cap".to_owned(),
            spec: "/specs/a.toml".to_owned(),
            params: vec![("cap_w".to_owned(), "450".to_owned())],
        },
        b: ArmInfo {
            policy: HOSTILE.to_owned(),
            spec: "/specs/b&c.toml".to_owned(),
            params: Vec::new(),
        },
        mode,
        epochs,
        pairs: pairs_seen,
        ratio_b_over_a,
        ci_low: 1.0213,
        ci_high: 1.0625,
        confidence: 0.9922,
        decision: Decision::B,
        looks: vec![look(1, 4, Decision::Continue), look(2, 8, Decision::B)],
        served_fraction_a: 0.995,
        served_fraction_b: 0.993,
        violation_ticks_a: 7,
        violation_ticks_b: 9,
        violation_rate_a: 0.0875,
        violation_rate_b: 0.1125,
        refused_because: None,
        demand_reported: true,
        objective: Objective {
            tpot_p99_limit_ms: Some(60.0),
            ..Objective::default()
        },
        schedule,
        tick_ms: 1000,
        budget_pairs: 16,
        alpha: 0.05,
        plan_looks: vec![4, 8, 16],
        plan_alpha_at_look: vec![0.00078125, 0.00546875, 0.04375],
        seed: 7,
        interrupted: false,
        run_time_s: 100.0 * pairs as f64,
        meta: RunMeta {
            simulated,
            gpu_profile: "h200".to_owned(),
            gpu_name: "NVIDIA H200".to_owned(),
            data_source: if simulated {
                "simulator (profile h200)".to_owned()
            } else {
                "NVML".to_owned()
            },
            gpu_count: groups,
            actuator: "sim".to_owned(),
            workload: "sim decode".to_owned(),
            seed: 7,
        },
        notes: vec!["arm b's spec ticks every 500 ms & <more>".to_owned()],
        timeline,
    }
}

/// The text of every `<td>` of the page's rows, row by row.
fn table_rows(html: &str) -> Vec<Vec<String>> {
    html.split("<tr>")
        .skip(1)
        .map(|row| {
            row.split("</tr>")
                .next()
                .unwrap_or("")
                .split("<td")
                .skip(1)
                .map(|cell| {
                    let start = cell.find('>').map_or(0, |i| i + 1);
                    let end = cell.find("</td>").unwrap_or(cell.len());
                    cell[start..end].to_owned()
                })
                .collect()
        })
        .collect()
}

fn assert_common(html: &str, outcome: &AbOutcome) {
    assert!(html.starts_with("<!DOCTYPE html>") && html.trim_end().ends_with("</html>"));
    // The hostile policy name is shown, escaped, and never as markup.
    assert!(!html.contains("<script"), "unescaped markup");
    assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    assert!(html.contains("/specs/b&amp;c.toml"));
    // The decision, the ratio and its interval.
    assert!(html.contains("<td>decision</td><td>b</td>"), "decision row");
    assert!(html.contains("B wins: &lt;script&gt;"), "decision in words");
    assert!(html.contains("4.17% more tokens per joule"), "the gain");
    assert!(html.contains(">1.0417<"), "ratio");
    assert!(html.contains("1.0213 to 1.0625 at 99.22 % confidence"));
    assert!(html.contains("1.0198 to 1.0641"), "t interval");
    assert!(
        html.contains("8 of a budget of 16"),
        "pairs used of the budget"
    );
    assert!(html.contains("arm b&#39;s spec ticks every 500 ms &amp; &lt;more&gt;"));
    assert!(html.contains("cap_w = 450"), "params");
    assert!(html.contains("TPOT p99 at most 60 ms"), "objective");
    // Every epoch has its row, with its figures.
    let rows = table_rows(html);
    for e in &outcome.epochs {
        let found = rows.iter().any(|r| {
            r.len() == 11
                && r[0] == e.pair.to_string()
                && r[1] == e.arm.to_string().to_uppercase()
                && (r[3] == e.gpus[0].to_string() || r[3] == format!("group {}", e.group))
                && r[5] == format!("{:.4}", e.tokens_per_joule)
                && r[10] == e.fallback_ticks.to_string()
        });
        assert!(found, "no row for {e:?}");
    }
    let epoch_rows = rows.iter().filter(|r| r.len() == 11).count();
    assert_eq!(epoch_rows, outcome.epochs.len());
    // Trajectories, power and tokens per joule over time, epochs, pair ratios, looks.
    assert_eq!(html.matches("<svg").count(), 6);
    assert!(html.contains(">cool-down (device defaults)</text>"));
    assert!(html.contains(">look 2: 8 pairs</text>"));
    assert!(
        !html.contains("NaN") && !html.contains("inf<"),
        "no unplaceable values"
    );
}

#[test]
fn an_interleaved_report_has_the_verdict_every_epoch_and_escaped_names() {
    let outcome = outcome(1, 8, true);
    let html = ab_report(&outcome).expect("report");
    assert_common(&html, &outcome);
    assert!(
        html.contains("Simulator output: every figure"),
        "simulator notice"
    );
    assert!(html.contains("simulator output (simulator (profile h200))"));
    assert!(html.contains("interleaved: the arms take turns"));
    assert!(!html.contains("Measured on real GPUs"));
}

#[test]
fn a_crossover_report_averages_the_groups_and_says_so() {
    let outcome = outcome(2, 8, false);
    let html = ab_report(&outcome).expect("report");
    assert_common(&html, &outcome);
    assert!(html.contains("crossover over 2 GPU groups"));
    assert!(
        html.contains("The GPU-to-GPU difference the crossover cancelled"),
        "the crossover report states what it cancelled"
    );
    assert!(html.contains("Without the swap, B/A would have read"));
    assert!(html.contains("mean over the GPU groups"));
    assert!(html.contains("Measured on real GPUs (NVIDIA H200)"));
    assert!(!html.to_lowercase().contains("simulator"), "not simulated");
    // Both groups' epochs of a pair are rows of their own.
    let rows = table_rows(&html);
    let pair_zero = rows.iter().filter(|r| r.len() == 11 && r[0] == "0").count();
    assert_eq!(pair_zero, 4);
}

#[test]
fn a_crossover_timeline_is_the_mean_over_the_groups_running_each_arm() {
    let mut outcome = outcome(2, 1, false);
    // At tick 30 group 0 runs A and group 1 runs B; give group 1 a different power.
    for p in outcome.timeline.iter_mut().filter(|p| p.group == 1) {
        p.power_w += 100.0;
    }
    let [power, _] = timeline_charts(&outcome);
    let value = |series: usize, tick: u64| {
        power.series[series]
            .points
            .iter()
            .find(|(x, _)| *x == tick as f64 + 1.0)
            .map(|p| p.1)
            .expect("a point at every tick")
    };
    assert_eq!(value(0, 30), 500.0, "arm A: group 0 alone");
    assert_eq!(value(1, 30), 600.0, "arm B: group 1 alone");
    assert!(value(2, 30).is_nan(), "no cool-down at tick 30");
    assert_eq!(value(2, 5), 350.0, "cool-down: the mean of both groups");
    assert!(value(0, 5).is_nan() && value(1, 5).is_nan());
}

/// Every trajectory is a line of its own in its arm's colour (one legend entry per
/// arm), its tokens per joule since it took over; the estimand and the spread are said.
#[test]
fn each_trajectory_is_a_line_and_the_estimand_and_spread_are_stated() {
    let outcome = outcome(2, 3, true);
    let chart = trajectories_chart(&outcome);
    // Two groups × three pairs × one trajectory of each arm.
    assert_eq!(chart.series.len(), 12);
    assert_eq!(
        chart.series.iter().filter(|s| s.same_as.is_none()).count(),
        2
    );
    assert!(chart.series[2..].iter().all(|s| s.same_as.is_some()));
    // The fixture's arm ticks make 1000 tokens on 500 J: 2 tokens per joule so far,
    // from the first tick after the take-over (30 ticks, from age 1).
    let first = &chart.series[0].points;
    assert_eq!(first.len(), 29, "{first:?}");
    assert_eq!(first[0], (1.0, 2.0));
    let html = ab_report(&outcome).expect("report");
    assert!(html.contains("Trajectories: the unit of replication"));
    assert!(html.contains("a fresh instance of each policy"));
    assert!(html.contains("runs differ by") && html.contains("the arms differ by"));
}

#[test]
fn refusals_no_difference_and_interruptions_are_said_in_words() {
    let mut outcome = outcome(1, 4, true);
    outcome.decision = Decision::BRefused;
    outcome.refused_because = Some("b served 1.2 points less <than a>".to_owned());
    outcome.interrupted = true;
    let html = ab_report(&outcome).expect("report");
    // The refused arm is named as refused, in the decision and in words, never as "no
    // difference": it is 4 % ahead on tokens per joule.
    assert!(html.contains("<td>decision</td><td>b-refused</td>"));
    assert!(
        html.contains("B refused: ") && html.contains("4.17% more tokens per joule than"),
        "{html}"
    );
    assert!(html.contains("it does not keep the objective as well as the other arm"));
    assert!(!html.contains("No difference"));
    assert!(html.contains("refused as the winner: b served 1.2 points less &lt;than a&gt;"));
    assert!(html.contains("The run was interrupted"));
    // With the deciding look's reading of the objective, what B gave up is said.
    let gap = |mean: f64, low: f64| ObjectiveGap {
        mean,
        low: Some(low),
        tolerance: 0.005,
    };
    if let Some(last) = outcome.looks.last_mut() {
        last.objective = Some(ObjectiveCheck {
            arm: Arm::B,
            served: gap(0.012, 0.006),
            violations: gap(0.0, -0.01),
            compliance: Compliance::Breaks,
            because: Some("b served less".to_owned()),
        });
    }
    let html = ab_report(&outcome).expect("report");
    assert!(html.contains("but it served less demand than A, so it is not the winner"));
    outcome.decision = Decision::NoDifference;
    outcome.refused_because = None;
    let html = ab_report(&outcome).expect("report");
    assert!(html.contains("No difference: the interval does not exclude 1"));
    assert!(!html.contains("refused as the winner"));
}

#[test]
fn outputs_are_written_and_the_json_round_trips() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("new").join("ab");
    for outcome in [outcome(1, 8, true), outcome(2, 4, false)] {
        write_ab_outputs(&out, &outcome).expect("write");
        let text = std::fs::read_to_string(out.join(AB_JSON_FILE)).expect("ab.json");
        let back: AbOutcome = serde_json::from_str(&text).expect("round trip");
        assert_eq!((back.decision, back.mode), (outcome.decision, outcome.mode));
        assert_eq!(back.a, outcome.a);
        assert_eq!(back.epochs.len(), outcome.epochs.len());
        // Every field comes back; numbers to the last bit but one (serde_json parses
        // floats fast, not exactly, without its `float_roundtrip` feature).
        assert_json_close(
            &serde_json::to_value(&back).expect("json"),
            &serde_json::to_value(&outcome).expect("json"),
            "ab.json",
        );
        let value: serde_json::Value = serde_json::from_str(&text).expect("json");
        for key in ["a", "b", "epochs", "ratio_b_over_a", "ci_low", "ci_high"] {
            assert!(value.get(key).is_some(), "{key}");
        }
        let html = std::fs::read_to_string(out.join(RUN_REPORT_FILE)).expect("report");
        assert_eq!(html, ab_report(&outcome).expect("report"));
    }
    let files = std::fs::read_dir(&out).expect("list").count();
    assert_eq!(files, 2, "no temporary files left");
}

/// `got` and `want` have the same keys, strings and values, numbers equal within a
/// relative 1e-15.
fn assert_json_close(got: &serde_json::Value, want: &serde_json::Value, at: &str) {
    use serde_json::Value;
    match (got, want) {
        (Value::Number(g), Value::Number(w)) => {
            let (g, w) = (g.as_f64().expect("number"), w.as_f64().expect("number"));
            assert!(
                (g - w).abs() <= 1e-15 * g.abs().max(w.abs()),
                "{at}: {g} != {w}"
            );
        }
        (Value::Array(g), Value::Array(w)) => {
            assert_eq!(g.len(), w.len(), "{at}");
            for (i, (g, w)) in g.iter().zip(w).enumerate() {
                assert_json_close(g, w, &format!("{at}[{i}]"));
            }
        }
        (Value::Object(g), Value::Object(w)) => {
            assert_eq!(
                g.keys().collect::<Vec<_>>(),
                w.keys().collect::<Vec<_>>(),
                "{at}"
            );
            for (key, w) in w {
                assert_json_close(&g[key], w, &format!("{at}.{key}"));
            }
        }
        _ => assert_eq!(got, want, "{at}"),
    }
}

#[test]
fn writing_into_a_file_names_the_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").expect("file");
    let error = write_ab_outputs(&file, &outcome(1, 4, true)).expect_err("not a folder");
    assert!(error.to_string().contains("a-file"), "{error}");
}

#[test]
fn a_round_field_marks_the_kept_candidates_and_the_line_of_one() {
    let field = vec![
        ("cap_w = 400".to_owned(), 1.031, 1.012, 1.049, true),
        ("cap_w = <500>".to_owned(), 0.982, 0.961, 1.004, false),
        (
            "cap_w = 600".to_owned(),
            f64::NAN,
            f64::NAN,
            f64::NAN,
            false,
        ),
    ];
    let svg = round_field_section("round 1 <of 3>", &field);
    assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
    assert!(svg.contains("round 1 &lt;of 3&gt;") && svg.contains("cap_w = &lt;500&gt;"));
    assert_eq!(svg.matches(" kept<").count(), 1, "{svg}");
    assert!(svg.contains(">1.0310 [1.0120, 1.0490] kept<"));
    assert!(
        svg.contains(">n/a [n/a, n/a]<"),
        "a candidate without a figure"
    );
    assert!(svg.contains(">ratio = 1<"));
    assert_eq!(
        svg.matches(&format!("stroke=\"{ARM_B_COLOUR}\"")).count(),
        2
    );
    assert_eq!(
        svg.matches(&format!("stroke=\"{FADED_COLOUR}\"")).count(),
        2
    );
    assert!(!svg.contains("NaN"));
    let empty = round_field_section("round 2", &[]);
    assert!(empty.contains("no data") && empty.ends_with("</svg>"));
}

#[test]
fn the_reference_line_sits_at_one() {
    let svg = round_field_section("r", &[("x".to_owned(), 1.5, 1.2, 2.0, true)]);
    let axis = Axis::padded((1.0, 2.0));
    assert!(axis.lo < 1.0 && axis.hi > 2.0, "{axis:?}");
    let labels: Vec<String> = axis.labelled_ticks().into_iter().map(|t| t.1).collect();
    assert!(labels.contains(&"1.0".to_owned()), "{labels:?}");
    assert!(svg.contains("stroke-dasharray=\"6 4\""));
    let flat = Axis::padded((0.0, 0.0));
    assert!(flat.lo < 0.0 && flat.hi > 0.0);
    let labels: Vec<String> = flat.labelled_ticks().into_iter().map(|t| t.1).collect();
    assert!(labels.contains(&"0".to_owned()), "{labels:?}");
    assert!(
        !labels.iter().any(|l| l == "-0" || l == "-0.0"),
        "{labels:?}"
    );
}

/// `(x1, x2)` of every `<line>` drawn with `stroke-width="{width}"` (the intervals).
fn line_spans(svg: &str, width: &str) -> Vec<(f64, f64)> {
    let attribute = |line: &str, name: &str| -> f64 {
        let start = line.find(&format!(" {name}=\"")).expect(name) + name.len() + 3;
        let end = start + line[start..].find('"').expect("closing quote");
        line[start..end].parse().expect("a number")
    };
    svg.split("<line")
        .skip(1)
        .filter(|line| line.contains(&format!("stroke-width=\"{width}\"")))
        .map(|line| (attribute(line, "x1"), attribute(line, "x2")))
        .collect()
}

#[test]
fn the_looks_chart_is_scaled_to_the_intervals_and_marks_those_it_clips() {
    // The issue's run: the first look's t interval at α ≈ 8e-8 runs from 0.056 to 39.
    let mut outcome = outcome(1, 8, true);
    let mut first = look(1, 4, Decision::Continue);
    (first.ratio_b_over_a, first.ci_low, first.ci_high) = (1.4814, 1.4432, 1.5113);
    (first.t_ci_low, first.t_ci_high) = (0.0560, 39.1889);
    let mut second = look(2, 8, Decision::BRefused);
    (second.ratio_b_over_a, second.ci_low, second.ci_high) = (1.4974, 1.4481, 1.5434);
    (second.t_ci_low, second.t_ci_high) = (1.2770, 1.7558);
    outcome.looks = vec![first, second];
    let svg = super::plots::looks_svg(&outcome);
    // Each bootstrap interval (thick) is drawn tens of pixels wide, not one.
    let thick = line_spans(&svg, "4");
    assert_eq!(thick.len(), 2, "{svg}");
    for (x1, x2) in &thick {
        assert!(x2 - x1 > 20.0, "{thick:?}");
    }
    // The first look's t interval is clipped at both ends of the frame, and says so.
    assert_eq!(svg.matches("class=\"clipped\"").count(), 2, "{svg}");
    assert!(svg.contains("continues beyond the axis to 39.1889"));
    assert!(svg.contains("continues beyond the axis to 0.0560"));
    // The second look's t interval fits and is drawn whole.
    assert!(svg.contains("<title>1.2770 to 1.7558</title>"));
    // No tick anywhere near 39.
    assert!(!svg.contains(">40<") && !svg.contains(">20<"), "{svg}");

    // An unbounded interval is clipped and marked too.
    outcome.looks[0].t_ci_high = f64::INFINITY;
    let svg = super::plots::looks_svg(&outcome);
    assert!(svg.contains("continues beyond the axis to infinity (unbounded)"));
    assert!(!svg.contains("inf<") && !svg.contains("NaN"), "{svg}");
}

#[test]
fn a_round_field_sizes_its_label_column_to_the_longest_label() {
    let long = "power_cap_w=450, sm_clock_max_mhz=1300, batch_target=64 (not compliant)";
    let field = vec![
        ("power_cap_w=350".to_owned(), 1.02, 1.01, 1.03, true),
        (long.to_owned(), 1.05, 1.03, 1.07, false),
    ];
    let svg = round_field_section("Round 1", &field);
    // The labels end 8 px left of the frame, right-aligned: the frame must start far
    // enough right for the longest of them at 0.6 em a character.
    let frame = svg.split("<rect").nth(1).expect("the frame");
    let start = frame.find(" x=\"").expect("x") + 4;
    let end = start + frame[start..].find('"').expect("quote");
    let frame_left: f64 = frame[start..end].parse().expect("number");
    assert!(
        frame_left - 8.0 >= long.chars().count() as f64 * 7.2,
        "{frame_left}"
    );
    // And the plotting area keeps its width.
    let width = frame.split("width=\"").nth(1).expect("width");
    let width: f64 = width[..width.find('"').expect("quote")]
        .parse()
        .expect("number");
    assert!(width >= 360.0, "{width}");
}
