//! The outputs of `tokwatt ab`: `ab.json` (the [`AbOutcome`] itself) and a self-contained
//! `report.html` that a person reads: the verdict in words, power and tokens per joule over
//! time by arm, every measured epoch, each look's interval against ratio = 1, and the tables
//! behind them. Every piece of text (policy names, paths, notes) is escaped.
//!
//! [`round_field_section`] draws one round of `tokwatt tune` with the same drawing code.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use super::run::{AbOutcome, EpochRecord, Mode, TickPoint};
use super::stats::{AbSummary, Arm, Decision};
use tokwatt_core::types::Objective;
use tokwatt_report::chart::Axis;
use tokwatt_report::{LineChart, Page, RUN_REPORT_FILE, ReportError, Series, escape};

/// The outcome's file name in the output folder.
pub const AB_JSON_FILE: &str = "ab.json";

/// Colours of arm A, arm B and the cool-downs: the first three of the line charts' palette,
/// so an arm has the same colour in every chart of the page.
const ARM_A_COLOUR: &str = "#0072b2";
const ARM_B_COLOUR: &str = "#d55e00";
/// An entry that is not in the running (a dropped candidate).
const FADED_COLOUR: &str = "#9a9a9a";

/// Write `dir/ab.json` (pretty JSON) and `dir/report.html`, each atomically, creating `dir`
/// if needed. The JSON is written first: it is the data, the page is drawn from it.
pub fn write_ab_outputs(dir: &Path, outcome: &AbOutcome) -> Result<(), ReportError> {
    std::fs::create_dir_all(dir).map_err(|source| ReportError::Write {
        path: dir.to_owned(),
        source,
    })?;
    let json_path = dir.join(AB_JSON_FILE);
    let json = serde_json::to_string_pretty(outcome).map_err(|source| ReportError::Write {
        path: json_path.clone(),
        source: source.into(),
    })?;
    tokwatt_report::write_atomically(&json_path, &(json + "\n"))?;
    tokwatt_report::write_atomically(&dir.join(RUN_REPORT_FILE), &ab_report(outcome)?)
}

/// The A/B report as a self-contained HTML page.
pub fn ab_report(outcome: &AbOutcome) -> Result<String, ReportError> {
    let a = &outcome.a.policy;
    let b = &outcome.b.policy;
    let mut page = Page::new(&format!("tokwatt A/B: {a} (A) against {b} (B)"));
    page.notice(&data_source_line(outcome));
    if outcome.interrupted {
        page.notice("The run was interrupted before its plan ended; see the notes.");
    }

    page.heading("Verdict");
    page.paragraph(&decision_words(outcome));
    page.table(&["", "value"], &headline_rows(outcome));
    if let Some(why) = &outcome.refused_because {
        page.notice(&format!(
            "An arm won on tokens per joule but was refused as the winner: {why}"
        ));
    }
    if let Some(why) = outcome.winner_gave_up_within_noise() {
        page.notice(&format!(
            "The winner gave up more of the objective than the tolerance on average, by less \
             than the pairs' noise, so it was not refused: {why}"
        ));
    }

    page.heading("Arms");
    page.table(
        &[
            "arm",
            "policy",
            "spec",
            "params",
            "measured epochs",
            "tokens per joule",
            "served fraction",
            "violation ticks",
            "violation rate",
            "fallback ticks",
        ],
        &[arm_row(outcome, Arm::A), arm_row(outcome, Arm::B)],
    );
    if !outcome.demand_reported {
        page.paragraph(
            "The workload does not report demand, so the served fraction is 1 by definition \
             and only the latency objective can be violated.",
        );
    }
    page.paragraph(&format!(
        "Objective: {}.",
        describe_objective(&outcome.objective)
    ));
    if !outcome.notes.is_empty() {
        page.heading("Notes");
        for note in &outcome.notes {
            page.paragraph(note);
        }
    }

    page.heading("Trajectories: the unit of replication");
    page.paragraph(&format!(
        "What the ratio estimates: {}. One sample is {}.",
        outcome.estimand.statement, outcome.estimand.unit_of_replication
    ));
    page.paragraph(&spread_words(outcome));
    page.svg(trajectories_chart(outcome).to_svg());

    page.heading("Over time");
    page.paragraph(&timeline_words(outcome));
    for chart in timeline_charts(outcome) {
        page.svg(chart.to_svg());
    }

    page.heading("Every measured epoch");
    page.paragraph(
        "Left: tokens per joule of each measured epoch (dots) and of each arm over all its \
         epochs (bar: its tokens over its energy). Right: each pair's ratio B/A; the verdict \
         is exp(mean ln ratio) over the pairs the last look used.",
    );
    page.svg(epoch_strip_svg(outcome));
    page.svg(pair_ratio_chart(outcome).to_svg());

    page.heading("The interval at each look");
    page.paragraph(&plan_words(outcome));
    page.svg(looks_svg(outcome));
    page.table(
        &[
            "look",
            "pairs",
            "ratio B/A",
            "bootstrap interval",
            "t interval",
            "confidence",
            "decision",
            "served A / B",
            "violation rate A / B",
            "refused because",
        ],
        &outcome.looks.iter().map(look_row).collect::<Vec<_>>(),
    );

    if let Some(difference) = &outcome.gpu_difference {
        page.heading("The GPU-to-GPU difference the crossover cancelled");
        page.paragraph(&gpu_difference_words(difference, outcome.ratio_b_over_a));
        page.table(
            &[
                "group",
                "GPUs",
                "tokens per joule, A",
                "tokens per joule, B",
                "vs group 0 (same arm, same block)",
            ],
            &difference
                .groups
                .iter()
                .map(|g| {
                    vec![
                        g.group.to_string(),
                        g.gpus
                            .iter()
                            .map(u32::to_string)
                            .collect::<Vec<_>>()
                            .join(", "),
                        number(g.tokens_per_joule_a, 4),
                        number(g.tokens_per_joule_b, 4),
                        number(g.vs_group_0, 4),
                    ]
                })
                .collect::<Vec<_>>(),
        );
    }

    page.heading("Epochs");
    page.table(
        &[
            "pair (from 0)",
            "arm",
            "position",
            "GPUs",
            "measured ticks",
            "tokens per joule",
            "tokens/s",
            "mean power (W)",
            "served fraction",
            "violation ticks",
            "fallback ticks",
        ],
        &outcome
            .epochs
            .iter()
            .map(|e| epoch_row(e, outcome.mode == Mode::Crossover))
            .collect::<Vec<_>>(),
    );
    page.paragraph(&format!(
        "Made by tokwatt {} from the outcome written beside it as {AB_JSON_FILE} (format {}).",
        env!("CARGO_PKG_VERSION"),
        outcome.format_version
    ));
    Ok(page.finish())
}

/// One round of `tokwatt tune` as an SVG section for [`Page::svg`]: one row per candidate
/// with its ratio of tokens per joule to the round's reference and that ratio's interval,
/// against the line ratio = 1. `field` holds `(label, ratio, ci_low, ci_high, kept)`;
/// candidates kept for the next round are drawn in colour and marked "kept", the others
/// grey. A non-finite ratio or bound is left out of the drawing and shown as "n/a".
pub fn round_field_section(title: &str, field: &[(String, f64, f64, f64, bool)]) -> String {
    let rows = field
        .iter()
        .map(|(label, ratio, low, high, kept)| Row {
            label: label.clone(),
            colour: if *kept { ARM_B_COLOUR } else { FADED_COLOUR },
            dots: Vec::new(),
            point: Some(*ratio),
            intervals: vec![Interval {
                low: *low,
                high: *high,
                thick: true,
            }],
            note: format!(
                "{} [{}, {}]{}",
                number(*ratio, 4),
                number(*low, 4),
                number(*high, 4),
                if *kept { " kept" } else { "" }
            ),
        })
        .collect();
    RowPlot {
        title: title.to_owned(),
        x_label: "tokens per joule, ratio to the round's reference".to_owned(),
        rows,
        reference: Some((1.0, "ratio = 1")),
    }
    .to_svg()
}

fn number(value: f64, decimals: usize) -> String {
    if value.is_finite() {
        format!("{value:.decimals$}")
    } else {
        "n/a".to_owned()
    }
}

fn percent(fraction: f64, decimals: usize) -> String {
    if fraction.is_finite() {
        format!("{:.decimals$}%", fraction * 100.0)
    } else {
        "n/a".to_owned()
    }
}

fn data_source_line(outcome: &AbOutcome) -> String {
    let meta = &outcome.meta;
    if meta.simulated {
        format!(
            "Simulator output: every figure in this report comes from the simulator (GPU \
             profile {}), not from a GPU measurement. Data source: {}.",
            meta.gpu_profile, meta.data_source
        )
    } else {
        format!(
            "Measured on real GPUs ({}). Data source: {}.",
            meta.gpu_name, meta.data_source
        )
    }
}

fn decision_code(decision: Decision) -> &'static str {
    match decision {
        Decision::A => "a",
        Decision::B => "b",
        Decision::NoDifference => "no-difference",
        Decision::Continue => "continue",
    }
}

/// The verdict in one sentence.
fn decision_words(outcome: &AbOutcome) -> String {
    let (a, b) = (&outcome.a.policy, &outcome.b.policy);
    let ratio = outcome.ratio_b_over_a;
    let interval = format!(
        "ratio B/A {}, {} interval {} to {}",
        number(ratio, 4),
        percent(outcome.confidence, 2),
        number(outcome.ci_low, 4),
        number(outcome.ci_high, 4)
    );
    match outcome.decision {
        Decision::B => format!(
            "B wins: {b} made {} more tokens per joule than {a} ({interval}).",
            percent(ratio - 1.0, 2)
        ),
        Decision::A => format!(
            "A wins: {a} made {} more tokens per joule than {b} ({interval}).",
            percent(1.0 / ratio - 1.0, 2)
        ),
        Decision::NoDifference => match &outcome.refused_because {
            Some(_) => format!(
                "No winner: the arm ahead on tokens per joule gave up too much of the \
                 objective ({interval})."
            ),
            None => format!(
                "No difference: the interval does not exclude 1, so neither arm is shown to be \
                 more efficient ({interval})."
            ),
        },
        Decision::Continue => format!("Undecided: the run ended between looks ({interval})."),
    }
}

fn group_count(outcome: &AbOutcome) -> usize {
    let mut groups: Vec<usize> = outcome.timeline.iter().map(|p| p.group).collect();
    groups.sort_unstable();
    groups.dedup();
    groups.len().max(1)
}

/// The GPU-to-GPU difference in words: how far the groups differ, and what B/A a
/// comparison without the swap would have read, beside the crossover's.
pub fn gpu_difference_words(difference: &crate::ab::GpuDifference, ratio_b_over_a: f64) -> String {
    let spread: Vec<String> = difference
        .groups
        .iter()
        .skip(1)
        .map(|g| {
            format!(
                "group {} gives {} times group 0's tokens per joule ({:+.2} %)",
                g.group,
                number(g.vs_group_0, 4),
                (g.vs_group_0 - 1.0) * 100.0
            )
        })
        .collect();
    let unswapped: Vec<String> = difference
        .unswapped
        .iter()
        .map(|u| {
            format!(
                "{} with A on group {} and B on group {}",
                number(u.ratio_b_over_a, 4),
                u.a_group,
                u.b_group
            )
        })
        .collect();
    format!(
        "Over {} complete blocks, with the same arm in the same block, {}. Without the swap, B/A would have read {}; the crossover's B/A is {}.",
        difference.blocks,
        spread.join("; "),
        unswapped.join(", or "),
        number(ratio_b_over_a, 4)
    )
}

fn mode_words(outcome: &AbOutcome) -> String {
    match outcome.mode {
        Mode::Interleaved => {
            "interleaved: the arms take turns on one node, each pair AB or BA at random".to_owned()
        }
        Mode::Crossover => format!(
            "crossover over {} GPU groups: in each block half the groups run A and half B, \
             then they swap; a block's pair sums each arm over every group",
            group_count(outcome)
        ),
        Mode::Replicated => "replicated (simulator): every trajectory on a simulator of its own; \
             a pair's two trajectories see the same work from the same moment, each with its \
             own sensor noise"
            .to_owned(),
    }
}

fn headline_rows(outcome: &AbOutcome) -> Vec<Vec<String>> {
    let row = |key: &str, value: String| vec![key.to_owned(), value];
    let last = outcome.looks.last();
    let pairs_used = last.map_or(outcome.pairs.len(), |l| l.pairs);
    let mut rows = vec![
        row("decision", decision_code(outcome.decision).to_owned()),
        row(
            "tokens per joule, B over A",
            number(outcome.ratio_b_over_a, 4),
        ),
        row(
            "bootstrap interval",
            format!(
                "{} to {} at {} confidence",
                number(outcome.ci_low, 4),
                number(outcome.ci_high, 4),
                percent(outcome.confidence, 2)
            ),
        ),
    ];
    if let Some(last) = last {
        rows.push(row(
            "t interval (for comparison)",
            format!(
                "{} to {}",
                number(last.t_ci_low, 4),
                number(last.t_ci_high, 4)
            ),
        ));
    }
    let look_count = outcome.looks.len();
    rows.extend([
        row(
            "pairs used",
            format!(
                "{pairs_used} of a budget of {} ({} measured, {look_count} look{})",
                outcome.budget_pairs,
                outcome.pairs.len(),
                if look_count == 1 { "" } else { "s" }
            ),
        ),
        row(
            "false-positive rate",
            format!(
                "α = {} over the whole plan (each look's confidence is 1 − its share)",
                number(outcome.alpha, 4)
            ),
        ),
        row("estimand", outcome.estimand.statement.clone()),
        row(
            "unit of replication",
            outcome.estimand.unit_of_replication.clone(),
        ),
        row("spread", spread_words(outcome)),
        row("mode", mode_words(outcome)),
        row(
            "data",
            if outcome.meta.simulated {
                format!("simulator output ({})", outcome.meta.data_source)
            } else {
                format!("measured ({})", outcome.meta.data_source)
            },
        ),
        row(
            "GPUs",
            format!(
                "{} × {}{}",
                outcome.meta.gpu_count,
                outcome.meta.gpu_name,
                if outcome.meta.simulated {
                    " (simulated)"
                } else {
                    ""
                }
            ),
        ),
        row("workload", outcome.meta.workload.clone()),
        row("actuator", outcome.meta.actuator.clone()),
        row(
            "epoch",
            format!(
                "cool-down {} ticks, warm-up {} ticks, measured {} ticks; tick {} ms",
                outcome.schedule.cooldown_ticks,
                outcome.schedule.warmup_ticks,
                outcome.schedule.measure_ticks,
                outcome.tick_ms
            ),
        ),
        row(
            "run time",
            format!(
                "{} s{}",
                number(outcome.run_time_s, 0),
                if outcome.meta.simulated {
                    " (simulated time)"
                } else {
                    ""
                }
            ),
        ),
        row("seed", outcome.seed.to_string()),
    ]);
    if outcome.interrupted {
        rows.push(row(
            "interrupted",
            "yes: stopped before the plan ended".to_owned(),
        ));
    }
    rows
}

fn arm_epochs(outcome: &AbOutcome, arm: Arm) -> impl Iterator<Item = &EpochRecord> {
    outcome.epochs.iter().filter(move |e| e.arm == arm)
}

/// An arm's tokens over its energy across all its measured epochs.
fn arm_tokens_per_joule(outcome: &AbOutcome, arm: Arm) -> f64 {
    let (tokens, energy) = arm_epochs(outcome, arm).fold((0u64, 0.0), |(t, e), r| {
        (t + r.measured.tokens, e + r.measured.energy_j)
    });
    if energy > 0.0 {
        tokens as f64 / energy
    } else {
        f64::NAN
    }
}

fn arm_row(outcome: &AbOutcome, arm: Arm) -> Vec<String> {
    let (info, served, violations, rate) = match arm {
        Arm::A => (
            &outcome.a,
            outcome.served_fraction_a,
            outcome.violation_ticks_a,
            outcome.violation_rate_a,
        ),
        Arm::B => (
            &outcome.b,
            outcome.served_fraction_b,
            outcome.violation_ticks_b,
            outcome.violation_rate_b,
        ),
    };
    let params = if info.params.is_empty() {
        "none".to_owned()
    } else {
        info.params
            .iter()
            .map(|(k, v)| format!("{k} = {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let fallback: u64 = arm_epochs(outcome, arm).map(|e| e.fallback_ticks).sum();
    vec![
        arm.to_string().to_uppercase(),
        info.policy.clone(),
        info.spec.clone(),
        params,
        arm_epochs(outcome, arm).count().to_string(),
        number(arm_tokens_per_joule(outcome, arm), 4),
        percent(served, 2),
        violations.to_string(),
        percent(rate, 2),
        fallback.to_string(),
    ]
}

fn describe_objective(o: &Objective) -> String {
    let mut parts = Vec::new();
    if let Some(limit) = o.tpot_p99_limit_ms {
        parts.push(format!("TPOT p99 at most {limit} ms"));
    }
    if let Some(min) = o.min_tokens_per_s {
        parts.push(format!(
            "at least {min} tokens/s per GPU while requests queue"
        ));
    }
    if let Some(limit) = o.queue_wait_p99_limit_ms {
        parts.push(format!("queue wait p99 at most {limit} ms"));
    }
    if parts.is_empty() {
        "none (no tick counts as a violation, except one that turns requests away)".to_owned()
    } else {
        parts.join("; ")
    }
}

fn plan_words(outcome: &AbOutcome) -> String {
    let looks: Vec<String> = outcome.plan_looks.iter().map(usize::to_string).collect();
    let spent: Vec<String> = outcome
        .plan_alpha_at_look
        .iter()
        .map(|a| format!("{a:.4}"))
        .collect();
    format!(
        "The plan, fixed before the first pair: looks after {} pairs, spending α {} (sum {}), \
         so stopping at any look keeps the false-positive rate at or below α. A winner needs \
         both intervals of its look to exclude 1 and must not serve less or violate the \
         objective more than the other arm beyond the tolerances. Thick bar: the bootstrap \
         interval; thin bar below it: the t interval.",
        looks.join(", "),
        spent.join(", "),
        number(outcome.alpha, 4)
    )
}

fn look_row(look: &AbSummary) -> Vec<String> {
    vec![
        look.look.to_string(),
        look.pairs.to_string(),
        number(look.ratio_b_over_a, 4),
        format!("{} to {}", number(look.ci_low, 4), number(look.ci_high, 4)),
        format!(
            "{} to {}",
            number(look.t_ci_low, 4),
            number(look.t_ci_high, 4)
        ),
        percent(look.confidence, 3),
        decision_code(look.decision).to_owned(),
        format!(
            "{} / {}",
            percent(look.served_fraction_a, 2),
            percent(look.served_fraction_b, 2)
        ),
        format!(
            "{} / {}",
            percent(look.violation_rate_a, 2),
            percent(look.violation_rate_b, 2)
        ),
        look.refused_because.clone().unwrap_or_default(),
    ]
}

/// One epoch's row; in crossover the GPU column names the group (each group is its own
/// loop, whose GPUs are numbered from 0).
fn epoch_row(epoch: &EpochRecord, crossover: bool) -> Vec<String> {
    let gpus: Vec<String> = epoch.gpus.iter().map(u32::to_string).collect();
    let gpus = if crossover {
        format!("group {}", epoch.group)
    } else {
        gpus.join(", ")
    };
    vec![
        epoch.pair.to_string(),
        epoch.arm.to_string().to_uppercase(),
        if epoch.position == 0 {
            "first"
        } else {
            "second"
        }
        .to_owned(),
        gpus,
        format!(
            "{} ({}–{})",
            epoch.measured.ticks, epoch.first_tick, epoch.last_tick
        ),
        number(epoch.tokens_per_joule, 4),
        number(epoch.tokens_per_s, 1),
        number(epoch.mean_power_w, 1),
        percent(epoch.measured.served_fraction, 2),
        format!(
            "{} of {}",
            epoch.measured.violation_ticks, epoch.measured.ticks
        ),
        epoch.fallback_ticks.to_string(),
    ]
}

/// What is in charge of a tick: one of the arms, or nobody (a cool-down).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    ArmA,
    ArmB,
    Cooldown,
}

const LANES: [Lane; 3] = [Lane::ArmA, Lane::ArmB, Lane::Cooldown];

impl Lane {
    fn of(point: &TickPoint) -> Lane {
        match point.arm {
            Some(Arm::A) => Lane::ArmA,
            Some(Arm::B) => Lane::ArmB,
            None => Lane::Cooldown,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Sums of one lane's points at one tick (several in crossover: one per group).
#[derive(Debug, Clone, Copy, Default)]
struct LaneSums {
    count: usize,
    power_w: f64,
    tokens_per_joule: f64,
}

/// The time axis' unit, chosen so that its labels stay short.
fn time_unit(duration_s: f64) -> (f64, &'static str) {
    if duration_s <= 600.0 {
        (1.0, "s")
    } else if duration_s <= 36_000.0 {
        (60.0, "min")
    } else {
        (3600.0, "h")
    }
}

fn timeline_words(outcome: &AbOutcome) -> String {
    let per_group = match outcome.mode {
        Mode::Interleaved => String::new(),
        Mode::Replicated => " Each trajectory ran on a simulator of its own; they are drawn \
             end to end, in the order they ran."
            .to_owned(),
        Mode::Crossover => format!(
            " In crossover both arms run at once: each line is the mean over the GPU groups \
             running that arm at that tick ({} groups in all).",
            group_count(outcome)
        ),
    };
    format!(
        "Each tick's power (summed over a GPU group's GPUs) and tokens per joule, by who was \
         in charge: arm A, arm B, or nobody (a cool-down at device defaults). An arm's line \
         covers its warm-up and its measured window; only the measured window counts.{per_group}"
    )
}

/// Power and tokens per joule over time: one line per arm and one for the cool-downs.
fn timeline_charts(outcome: &AbOutcome) -> [LineChart; 2] {
    let mut ticks: BTreeMap<u64, (f64, usize, [LaneSums; 3])> = BTreeMap::new();
    for point in &outcome.timeline {
        let (time, count, lanes) = ticks.entry(point.tick).or_default();
        *time += point.time_s;
        *count += 1;
        let lane = &mut lanes[Lane::of(point).index()];
        lane.count += 1;
        lane.power_w += point.power_w;
        lane.tokens_per_joule += point.tokens_per_joule;
    }
    let duration = ticks
        .values()
        .map(|(time, count, _)| time / *count as f64)
        .fold(0.0, f64::max);
    let (scale, unit) = time_unit(duration);
    let line = |lane: Lane, value: fn(&LaneSums) -> f64| -> Vec<(f64, f64)> {
        ticks
            .values()
            .map(|(time, count, lanes)| {
                let sums = &lanes[lane.index()];
                let y = if sums.count > 0 {
                    value(sums) / sums.count as f64
                } else {
                    // Not in charge at this tick: a gap in its line.
                    f64::NAN
                };
                (time / *count as f64 / scale, y)
            })
            .collect()
    };
    let names = [
        format!("arm A: {}", outcome.a.policy),
        format!("arm B: {}", outcome.b.policy),
        "cool-down (device defaults)".to_owned(),
    ];
    let chart = |title: &str, y_label: &str, value: fn(&LaneSums) -> f64| LineChart {
        title: title.to_owned(),
        x_label: format!("time since the start ({unit})"),
        y_label: y_label.to_owned(),
        series: LANES
            .iter()
            .zip(&names)
            .map(|(lane, name)| Series::new(name, line(*lane, value)))
            .collect(),
    };
    [
        chart("power by arm", "W", |s| s.power_w),
        chart(
            "tokens per joule by arm, per tick",
            "tokens per joule",
            |s| s.tokens_per_joule,
        ),
    ]
}

/// The spread within each arm beside the difference between the arms, in percent of
/// the log scale the statistics use.
fn spread_words(outcome: &AbOutcome) -> String {
    let s = &outcome.spread;
    let pct = |log: f64| percent(log.exp_m1(), 1);
    format!(
        "pairs' B/A varies by {} (standard deviation of ln B/A over the pairs, what the interval is built from) and the arms differ by {}; one arm's runs differ by {} (arm A) and {} (arm B) across pairs, the work's own changes between pairs included",
        pct(s.pairs),
        pct(s.between_arms),
        pct(s.within_a),
        pct(s.within_b)
    )
}

/// Each trajectory's tokens per joule since its start (its tokens over its energy so
/// far), against the time since it took over, in its arm's colour: how far apart runs
/// of one policy end up, beside how far apart the arms are.
fn trajectories_chart(outcome: &AbOutcome) -> LineChart {
    let tick_s = outcome.tick_ms as f64 / 1000.0;
    // (group, pair, arm) → (trajectory tick, cumulative tokens, cumulative energy).
    let mut lines: BTreeMap<(usize, usize, u8), Vec<(f64, f64)>> = BTreeMap::new();
    let mut sums: BTreeMap<(usize, usize, u8), (u64, f64)> = BTreeMap::new();
    for point in &outcome.timeline {
        let (Some(arm), Some(pair), Some(age)) = (point.arm, point.pair, point.trajectory_tick)
        else {
            continue;
        };
        // The take-over tick still observes the window before the trajectory.
        if age == 0 {
            continue;
        }
        let key = (point.group, pair, u8::from(arm == Arm::B));
        let (tokens, energy) = sums.entry(key).or_default();
        *tokens += point.tokens;
        *energy += point.energy_j;
        let y = if *energy > 0.0 {
            *tokens as f64 / *energy
        } else {
            f64::NAN
        };
        lines.entry(key).or_default().push((age as f64 * tick_s, y));
    }
    let names = [
        format!("arm A: {}", outcome.a.policy),
        format!("arm B: {}", outcome.b.policy),
    ];
    let of_arm = |arm: u8| -> Vec<Vec<(f64, f64)>> {
        lines
            .iter()
            .filter(|(key, _)| key.2 == arm)
            .map(|(_, points)| points.clone())
            .collect()
    };
    let (mut a, mut b) = (of_arm(0).into_iter(), of_arm(1).into_iter());
    // Series 0 and 1 carry the arms' legend entries; every other trajectory takes the
    // colour of its arm's.
    let mut series = vec![
        Series::new(&names[0], a.next().unwrap_or_default()),
        Series::new(&names[1], b.next().unwrap_or_default()),
    ];
    series.extend(a.map(|points| Series::like(0, &names[0], points)));
    series.extend(b.map(|points| Series::like(1, &names[1], points)));
    LineChart {
        title: "each trajectory's tokens per joule since its start".to_owned(),
        x_label: "time since the trajectory took over (s)".to_owned(),
        y_label: "tokens per joule so far".to_owned(),
        series,
    }
}

/// Each measured epoch's tokens per joule, one row of dots per arm.
fn epoch_strip_svg(outcome: &AbOutcome) -> String {
    let row = |arm: Arm, colour: &'static str| {
        let overall = arm_tokens_per_joule(outcome, arm);
        let dots: Vec<f64> = arm_epochs(outcome, arm)
            .map(|e| e.tokens_per_joule)
            .collect();
        Row {
            label: format!("arm {}", arm.to_string().to_uppercase()),
            colour,
            note: format!("{} epochs, {}", dots.len(), number(overall, 4)),
            dots,
            point: Some(overall),
            intervals: Vec::new(),
        }
    };
    RowPlot {
        title: "tokens per joule of every measured epoch".to_owned(),
        x_label: "tokens per joule".to_owned(),
        rows: vec![row(Arm::A, ARM_A_COLOUR), row(Arm::B, ARM_B_COLOUR)],
        reference: None,
    }
    .to_svg()
}

/// Each pair's ratio B/A as a dot, with the verdict's ratio and interval and ratio = 1.
fn pair_ratio_chart(outcome: &AbOutcome) -> LineChart {
    let tokens_per_joule = |tokens: u64, energy: f64| {
        if energy > 0.0 {
            tokens as f64 / energy
        } else {
            f64::NAN
        }
    };
    // A gap after every point: each pair is a dot of its own, not a line through them.
    let dots: Vec<(f64, f64)> = outcome
        .pairs
        .iter()
        .enumerate()
        .flat_map(|(i, pair)| {
            let ratio = tokens_per_joule(pair.b.tokens, pair.b.energy_j)
                / tokens_per_joule(pair.a.tokens, pair.a.energy_j);
            [(i as f64, ratio), (i as f64, f64::NAN)]
        })
        .collect();
    let last = outcome.pairs.len().saturating_sub(1).max(1) as f64;
    let level = |name: &str, y: f64| Series::dashed(name, vec![(0.0, y), (last, y)]);
    LineChart {
        title: "each pair's tokens per joule, B over A".to_owned(),
        x_label: "pair (from 0)".to_owned(),
        y_label: "ratio B/A".to_owned(),
        series: vec![
            Series::new("pair", dots),
            level("verdict", outcome.ratio_b_over_a),
            level("interval low", outcome.ci_low),
            level("interval high", outcome.ci_high),
            level("ratio = 1", 1.0),
        ],
    }
}

/// Every look's ratio with its bootstrap and t intervals.
fn looks_svg(outcome: &AbOutcome) -> String {
    let rows = outcome
        .looks
        .iter()
        .map(|look| Row {
            label: format!("look {}: {} pairs", look.look, look.pairs),
            colour: if look.decision.is_final() {
                ARM_B_COLOUR
            } else {
                ARM_A_COLOUR
            },
            dots: Vec::new(),
            point: Some(look.ratio_b_over_a),
            intervals: vec![
                Interval {
                    low: look.ci_low,
                    high: look.ci_high,
                    thick: true,
                },
                Interval {
                    low: look.t_ci_low,
                    high: look.t_ci_high,
                    thick: false,
                },
            ],
            note: format!(
                "{} at {}: {}",
                number(look.ratio_b_over_a, 4),
                percent(look.confidence, 2),
                decision_code(look.decision)
            ),
        })
        .collect();
    RowPlot {
        title: "ratio B/A and its interval at each look".to_owned(),
        x_label: "tokens per joule, B over A".to_owned(),
        rows,
        reference: Some((1.0, "ratio = 1")),
    }
    .to_svg()
}

/// A horizontal interval of a [`Row`].
#[derive(Debug, Clone, Copy)]
struct Interval {
    low: f64,
    high: f64,
    /// Thick: the main interval; thin, drawn just below: one for comparison.
    thick: bool,
}

/// One labelled row of a [`RowPlot`].
#[derive(Debug, Clone)]
struct Row {
    label: String,
    colour: &'static str,
    /// Small dots (one per epoch), jittered up and down so that equal values stay visible.
    dots: Vec<f64>,
    /// The estimate, drawn as a bar across the row.
    point: Option<f64>,
    intervals: Vec<Interval>,
    /// Text at the row's right end.
    note: String,
}

/// Rows of dots, estimates and intervals on one shared horizontal axis: a strip plot, or
/// a forest plot with a reference line.
#[derive(Debug, Clone)]
struct RowPlot {
    title: String,
    x_label: String,
    rows: Vec<Row>,
    reference: Option<(f64, &'static str)>,
}

const PLOT_WIDTH: f64 = 640.0;
const ROW_HEIGHT: f64 = 30.0;
const TOP: f64 = 42.0;
const BOTTOM: f64 = 44.0;
/// Approximate width of one character of 12 px sans-serif text, for layout.
const CHAR_WIDTH: f64 = 6.6;

impl RowPlot {
    fn to_svg(&self) -> String {
        let text_width = |texts: &mut dyn Iterator<Item = &String>| {
            texts
                .map(|t| t.chars().count() as f64 * CHAR_WIDTH)
                .fold(0.0, f64::max)
                .clamp(40.0, 220.0)
        };
        let left = text_width(&mut self.rows.iter().map(|r| &r.label)) + 16.0;
        let right = text_width(&mut self.rows.iter().map(|r| &r.note)) + 16.0;
        let plot_left = left;
        let plot_width = (PLOT_WIDTH - left - right).max(120.0);
        let width = plot_left + plot_width + right;
        let plot_height = ROW_HEIGHT * self.rows.len().max(1) as f64;
        let height = TOP + plot_height + BOTTOM;
        let title = escape(&self.title);
        let mut svg = String::new();
        let _ = write!(
            svg,
            r##"<svg xmlns="http://www.w3.org/2000/svg" class="chart row-plot" viewBox="0 0 {width:.0} {height:.0}" width="{width:.0}" height="{height:.0}" role="img" aria-label="{title}" font-family="sans-serif" font-size="12"><title>{title}</title><text x="{plot_left:.0}" y="17" font-size="14" font-weight="bold">{title}</text><rect x="{plot_left:.1}" y="{TOP}" width="{plot_width:.1}" height="{plot_height:.1}" fill="#fff" stroke="#bbb"/>"##,
        );
        let values = self
            .rows
            .iter()
            .flat_map(|r| {
                r.dots
                    .iter()
                    .copied()
                    .chain(r.point)
                    .chain(r.intervals.iter().flat_map(|i| [i.low, i.high]))
            })
            .filter(|v| v.is_finite());
        let data_range = values.fold(None, |acc: Option<(f64, f64)>, v| match acc {
            None => Some((v, v)),
            Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
        });
        // The reference line widens the axis to include it, but is no data by itself.
        let Some((min, max)) = data_range.map(|(lo, hi)| match self.reference {
            Some((x, _)) if x.is_finite() => (lo.min(x), hi.max(x)),
            _ => (lo, hi),
        }) else {
            let _ = write!(
                svg,
                r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#777">no data</text></svg>"##,
                plot_left + plot_width / 2.0,
                TOP + plot_height / 2.0
            );
            return svg;
        };
        let axis = Axis::padded((min, max));
        let to_x = |v: f64| plot_left + axis.fraction(v) * plot_width;

        for (x, label) in axis.labelled_ticks() {
            let px = to_x(x);
            let _ = write!(
                svg,
                r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{bottom:.1}" stroke="#eee"/><text x="{px:.1}" y="{ty:.1}" text-anchor="middle">{label}</text>"##,
                bottom = TOP + plot_height,
                ty = TOP + plot_height + 16.0,
            );
        }
        let _ = write!(
            svg,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            plot_left + plot_width / 2.0,
            TOP + plot_height + 36.0,
            escape(&self.x_label)
        );
        if let Some((x, label)) = self.reference {
            let px = to_x(x);
            let _ = write!(
                svg,
                r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{bottom:.1}" stroke="#000" stroke-width="1.2" stroke-dasharray="6 4"><title>{label}</title></line><text x="{px:.1}" y="{ty:.1}" text-anchor="middle" fill="#555">{label}</text>"##,
                bottom = TOP + plot_height,
                ty = TOP - 4.0,
                label = escape(label),
            );
        }

        for (index, row) in self.rows.iter().enumerate() {
            let mid = TOP + (index as f64 + 0.5) * ROW_HEIGHT;
            let colour = row.colour;
            let _ = write!(
                svg,
                r##"<g><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                plot_left - 8.0,
                mid + 4.0,
                escape(&row.label)
            );
            for interval in &row.intervals {
                if !(interval.low.is_finite() && interval.high.is_finite()) {
                    continue;
                }
                let (y, stroke) = if interval.thick {
                    (mid, 4.0)
                } else {
                    (mid + 7.0, 1.5)
                };
                let _ = write!(
                    svg,
                    r##"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{colour}" stroke-width="{stroke}" stroke-opacity="0.6"><title>{} to {}</title></line>"##,
                    to_x(interval.low),
                    to_x(interval.high),
                    number(interval.low, 4),
                    number(interval.high, 4)
                );
            }
            for (i, dot) in row.dots.iter().enumerate() {
                if !dot.is_finite() {
                    continue;
                }
                // Deterministic jitter, five lanes: equal values do not hide each other.
                let jitter = ((i * 3) % 5) as f64 * 3.0 - 6.0;
                let _ = write!(
                    svg,
                    r##"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{colour}" fill-opacity="0.7"><title>{}</title></circle>"##,
                    to_x(*dot),
                    mid + jitter,
                    number(*dot, 4)
                );
            }
            if let Some(point) = row.point.filter(|p| p.is_finite()) {
                let px = to_x(point);
                let _ = write!(
                    svg,
                    r##"<line x1="{px:.1}" y1="{:.1}" x2="{px:.1}" y2="{:.1}" stroke="{colour}" stroke-width="3"><title>{}</title></line>"##,
                    mid - 10.0,
                    mid + 10.0,
                    number(point, 4)
                );
            }
            let _ = write!(
                svg,
                r##"<text x="{:.1}" y="{:.1}">{}</text></g>"##,
                plot_left + plot_width + 8.0,
                mid + 4.0,
                escape(&row.note)
            );
        }
        svg.push_str("</svg>");
        svg
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ab::run::{AB_FORMAT_VERSION, ArmInfo, Schedule};
    use crate::ab::stats::{ArmEpoch, EpochPair};
    use tokwatt_agent::assembly::RunMeta;

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
        assert!(html.contains("1.0213 to 1.0625 at 99.22% confidence"));
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
        outcome.decision = Decision::NoDifference;
        outcome.refused_because = Some("b served 1.2 points less <than a>".to_owned());
        outcome.interrupted = true;
        let html = ab_report(&outcome).expect("report");
        assert!(html.contains("<td>decision</td><td>no-difference</td>"));
        assert!(html.contains("No winner:"));
        assert!(html.contains("refused as the winner: b served 1.2 points less &lt;than a&gt;"));
        assert!(html.contains("The run was interrupted"));
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
}
