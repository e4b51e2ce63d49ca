//! The search told to people: `report.html` and the words for rounds and parameters.

use super::*;

/// ` (2 of them from earlier rounds, in place of candidates that broke the objective)`,
/// or nothing when none was promoted.
pub fn promoted_words(round: &Round) -> String {
    if round.promoted == 0 {
        String::new()
    } else {
        format!(
            " ({} of them from earlier rounds, in place of candidates that broke the objective)",
            round.promoted
        )
    }
}

/// `a=1, b=2`.
pub fn format_params(params: &[(String, String)]) -> String {
    params
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `report.html`: the rounds' fields, one table per round, and the evidence.
pub fn report_html(outcome: &TuneOutcome) -> String {
    let mut page = tokwatt_report::Page::new(&format!("tokwatt tune: {}", outcome.policy));
    page.notice(&format!(
        "Simulator output: {}. No figure on this page was measured on a real GPU.",
        outcome.data_source
    ));
    page.paragraph(&format!(
        "{} candidates over {}; each round compares every survivor with the spec as given ({}) by an interleaved A/B, keeps the best 1/{} and multiplies the pairs by {}. Simulated time of the whole search: {:.0} s.",
        outcome.candidates,
        outcome
            .ranges
            .iter()
            .map(|r| format!("{} ({} values)", r.name, r.values.len()))
            .collect::<Vec<_>>()
            .join(" × "),
        if outcome.reference_params.is_empty() {
            "no params".to_owned()
        } else {
            format_params(&outcome.reference_params)
        },
        outcome.eta,
        outcome.eta,
        outcome.simulated_time_s
    ));
    page.heading("Winner");
    let e = &outcome.evidence;
    page.table(
        &[
            "parameters",
            "ratio B/A",
            "interval",
            "decision",
            "pairs",
            "served (ref → winner)",
            "violation rate (ref → winner)",
        ],
        &[vec![
            format_params(&outcome.winner),
            format!("{:.4}", e.ratio_b_over_a),
            format!(
                "{:.4} – {:.4} ({})",
                e.ci_low,
                e.ci_high,
                crate::ab::stats::confidence_percent(e.confidence)
            ),
            decision_text(e.decision),
            e.pairs.to_string(),
            format!(
                "{:.2} % → {:.2} %",
                e.served_fraction_reference * 100.0,
                e.served_fraction_winner * 100.0
            ),
            format!(
                "{:.2} % → {:.2} %",
                e.violation_rate_reference * 100.0,
                e.violation_rate_winner * 100.0
            ),
        ]],
    );
    for note in &outcome.notes {
        page.paragraph(note);
    }
    for round in &outcome.rounds {
        page.heading(&format!(
            "Round {}: {} candidates, {} pairs each, {} kept{}, {:.0} s simulated",
            round.round,
            round.candidates.len(),
            round.pairs_budget,
            round.kept,
            promoted_words(round),
            round.simulated_time_s
        ));
        let rows: Vec<Vec<String>> = round
            .candidates
            .iter()
            .map(|c| {
                vec![
                    c.rank.to_string(),
                    format_params(&c.params),
                    format!("{:.4}", c.ratio),
                    format!("{:.4} – {:.4}", c.ci_low, c.ci_high),
                    decision_text(c.decision),
                    c.pairs.to_string(),
                    format!("{:.2} %", c.served_fraction * 100.0),
                    format!("{:.2} %", c.violation_rate * 100.0),
                    match (c.compliance, &c.not_compliant_because) {
                        (Compliance::Keeps, _) | (_, None) => "yes".to_owned(),
                        (Compliance::Unresolved, Some(why)) => format!("unresolved: {why}"),
                        (Compliance::Breaks, Some(why)) => format!("no: {why}"),
                    },
                    if c.kept { "kept" } else { "out" }.to_owned(),
                ]
            })
            .collect();
        let field: Vec<(String, f64, f64, f64, bool)> = round
            .candidates
            .iter()
            .map(|c| {
                let mark = if c.compliant { "" } else { " (not compliant)" };
                (
                    format!("{}{mark}", format_params(&c.params)),
                    c.ratio,
                    c.ci_low,
                    c.ci_high,
                    c.kept,
                )
            })
            .collect();
        page.svg(crate::ab::report::round_field_section(
            &format!("Round {}", round.round),
            &field,
        ));
        page.table(
            &[
                "rank",
                "parameters",
                "ratio B/A",
                "interval",
                "decision",
                "pairs",
                "served",
                "violations",
                "compliant",
                "",
            ],
            &rows,
        );
        for d in &round.dropped {
            page.paragraph(&format!(
                "Dropped {}: {}",
                format_params(&d.params),
                d.reason
            ));
        }
    }
    page.finish()
}

/// A candidate's decision against the reference (arm A) in a few words; a refused arm is
/// named as refused, never as "no difference".
pub fn decision_text(decision: Decision) -> String {
    match decision {
        Decision::A => "reference better",
        Decision::B => "candidate better",
        Decision::ARefused => "reference refused: more tokens per joule, breaks the objective",
        Decision::BRefused => "candidate refused: more tokens per joule, breaks the objective",
        Decision::NoDifference => "no difference",
        Decision::Continue => "undecided",
    }
    .to_owned()
}
