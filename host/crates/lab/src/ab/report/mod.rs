//! The outputs of `tokwatt ab`: `ab.json` (the [`AbOutcome`] itself) and a self-contained
//! `report.html` that a person reads: the verdict in words, power and tokens per joule over
//! time by arm, every measured epoch, each look's interval against ratio = 1, and the tables
//! behind them. Every piece of text (policy names, paths, notes) is escaped.
//!
//! The drawings are in [`plots`]; [`round_field_section`] draws one round of `tokwatt
//! tune` with the same code.
//!
//! Just over 600 lines on purpose: what is left here is the page and the words on it
//! (the verdict, the plan, each table's rows), which read best beside each other.

use std::path::Path;

mod plots;

pub use plots::round_field_section;
use plots::{epoch_strip_svg, looks_svg, pair_ratio_chart, timeline_charts, trajectories_chart};

use super::run::{AbOutcome, EpochRecord, Mode};
use super::stats::{AbSummary, Arm, Decision, confidence_percent};
use tokwatt_core::types::Objective;
use tokwatt_report::{Page, RUN_REPORT_FILE, ReportError};

/// The outcome's file name in the output folder.
pub const AB_JSON_FILE: &str = "ab.json";

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
            "The arm ahead on tokens per joule was refused as the winner: {why}"
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
    decision.code()
}

/// The verdict in one sentence.
fn decision_words(outcome: &AbOutcome) -> String {
    let (a, b) = (&outcome.a.policy, &outcome.b.policy);
    let ratio = outcome.ratio_b_over_a;
    let interval = format!(
        "ratio B/A {}, {} interval {} to {}",
        number(ratio, 4),
        confidence_percent(outcome.confidence),
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
        Decision::ARefused | Decision::BRefused => {
            let (arm, name, other, more) = if outcome.decision == Decision::BRefused {
                ("B", b, a, ratio - 1.0)
            } else {
                ("A", a, b, 1.0 / ratio - 1.0)
            };
            format!(
                "{arm} refused: {name} made {} more tokens per joule than {other}, but {}, so \
                 it is not the winner ({interval}).",
                percent(more, 2),
                outcome.refusal_shortfall().unwrap_or_else(|| {
                    "it does not keep the objective as well as the other arm".to_owned()
                })
            )
        }
        Decision::NoDifference => format!(
            "No difference: the interval does not exclude 1, so neither arm is shown to be \
             more efficient ({interval})."
        ),
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
                confidence_percent(outcome.confidence)
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
    if let Some(limit) = o.ttft_p99_limit_ms {
        parts.push(format!("time to first token p99 at most {limit} ms"));
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
         interval; thin bar below it: the t interval; an arrow at the frame: an interval that \
         runs on beyond the axis (the early looks spend little α, so their intervals are \
         wide; the table gives every end).",
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
        confidence_percent(look.confidence),
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

#[cfg(test)]
mod tests;
