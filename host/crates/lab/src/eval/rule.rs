//! The failure rule: when a scenario counts as failed for a policy, on the means over
//! seeds it reads ([`RuleFigures`], written to `eval.json` as each entry's
//! `failure_rule`), the words that say why, and the advice for a policy refused under the
//! judge.

use serde::Serialize;
use tokwatt_agent::AgentError;

use super::REACTION_LAG_S;

/// A scenario fails for a policy that breaks the objective on more than this share of
/// its ticks (mean over seeds): a ratio bought by breaking the service is not a score.
pub const MAX_VIOLATION_FRACTION: f64 = 0.01;
/// A scenario fails for a policy that serves less of the demand than the oracle by more
/// than this (a fraction of the demand, mean over seeds).
pub const SERVED_MARGIN: f64 = 0.01;

/// What the failure rule reads of one policy on one scenario, written to `eval.json` as
/// each entry's `failure_rule` so that a failure message's figures can be found there:
/// means over the seeds that ran (one bad seed is not hidden by the median of the
/// others), where the entry's other figures are medians.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RuleFigures {
    /// How many seeds the means are over.
    pub seeds: usize,
    /// The policy's share of ticks over the objective.
    pub slo_violation_fraction_mean: f64,
    /// The causal reference's, the oracle's schedule's and the default settings'.
    pub causal_violation_fraction_mean: f64,
    pub oracle_violation_fraction_mean: f64,
    pub default_violation_fraction_mean: f64,
    /// Whether a phase is beyond what any setting serves (then the largest of the three
    /// references' shares is allowed, else the causal reference's).
    pub overload: bool,
    /// The references' share a policy may match, before the one-point margin
    /// ([`MAX_VIOLATION_FRACTION`]).
    pub reference_violation_fraction: f64,
    /// The policy's served share of the demand.
    pub served_fraction_mean: f64,
    /// Seed by seed the lesser of the oracle's and the causal reference's served shares
    /// (a backlog the reaction lag leaves is not the policy's fault), averaged.
    pub reference_served_fraction_mean: f64,
    /// `reference_served_fraction_mean` less `served_fraction_mean`.
    pub served_shortfall_mean: f64,
}

/// Why a policy fails a scenario on the objective, if it does: it broke the objective on
/// more of its ticks than the references' share a controller reacting after the fact
/// cannot avoid (see `judge::allowed_violations`) plus [`MAX_VIOLATION_FRACTION`], or it
/// served less of the demand than the references by more than [`SERVED_MARGIN`]. The
/// words quote `figures` by their names in `eval.json`'s `failure_rule`.
pub fn objective_breach(figures: &RuleFigures) -> Option<String> {
    let mut reasons = Vec::new();
    let reference = if figures.reference_violation_fraction.is_finite() {
        figures.reference_violation_fraction.max(0.0)
    } else {
        0.0
    };
    let means = match figures.seeds {
        1 => "over its 1 seed".to_owned(),
        n => format!("means over {n} seeds"),
    };
    let violations = figures.slo_violation_fraction_mean;
    if violations > MAX_VIOLATION_FRACTION + reference {
        reasons.push(if reference > 0.0 {
            format!(
                "broke the objective on {:.2} % of ticks (slo_violation_fraction_mean), more than the references' {:.2} % (reference_violation_fraction) + {:.0} point ({means})",
                violations * 100.0,
                reference * 100.0,
                MAX_VIOLATION_FRACTION * 100.0
            )
        } else {
            format!(
                "broke the objective on {:.2} % of ticks (slo_violation_fraction_mean), more than {:.0} % ({means})",
                violations * 100.0,
                MAX_VIOLATION_FRACTION * 100.0
            )
        });
    }
    if figures.served_shortfall_mean > SERVED_MARGIN {
        reasons.push(format!(
            "served {:.4} of the demand (served_fraction_mean) against the references' {:.4} (reference_served_fraction_mean): {:.2} points less, more than {:.0} ({means})",
            figures.served_fraction_mean,
            figures.reference_served_fraction_mean,
            figures.served_shortfall_mean * 100.0,
            SERVED_MARGIN * 100.0
        ));
    }
    (!reasons.is_empty()).then(|| reasons.join("; "))
}

/// The failure rule in words, for the terminal and the report.
pub fn failure_rule_words() -> String {
    format!(
        "A scenario fails for a policy that breaks the objective on more ticks than the causal \
         reference (the oracle's settings taken up {:.0} s after each phase starts) plus {:.0} % \
         of them, serves less of the demand than the references by more than {:.0} point, or \
         cannot run it (means over seeds). A failed scenario shows no ratio and counts as 0 in \
         the median: a ratio bought by breaking the service is not a score.",
        REACTION_LAG_S,
        MAX_VIOLATION_FRACTION * 100.0,
        SERVED_MARGIN * 100.0
    )
}

/// Advice for a policy that refused to run on a scenario, where the refusal's own words
/// point at the spec's `[objective]`: the judge gives every policy the scenario's
/// objective in its place, so editing the spec's cannot help.
pub fn eval_advice(error: &AgentError, objective: &tokwatt_core::types::Objective) -> String {
    let about_the_objective = matches!(
        error,
        AgentError::PolicyStart { .. }
            | AgentError::ThroughputUnchecked { .. }
            | AgentError::TtftUnchecked { .. }
    );
    if !about_the_objective {
        return String::new();
    }
    let bounds: Vec<String> = [
        ("tpot_p99_limit_ms", objective.tpot_p99_limit_ms),
        ("ttft_p99_limit_ms", objective.ttft_p99_limit_ms),
        ("queue_wait_p99_limit_ms", objective.queue_wait_p99_limit_ms),
        ("min_tokens_per_s", objective.min_tokens_per_s),
    ]
    .into_iter()
    .filter_map(|(key, value)| value.map(|v| format!("{key} = {v}")))
    .collect();
    let objective = if bounds.is_empty() {
        "none".to_owned()
    } else {
        bounds.join(", ")
    };
    format!(
        ". Under `tokwatt eval` the scenario's [objective] replaces the spec's (this scenario's: {objective}), so a change to the spec's [objective] cannot help: make the policy start with this objective (its [params], its plugin), or judge it on scenarios whose objective it serves"
    )
}
