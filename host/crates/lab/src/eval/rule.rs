//! The failure rule: when a scenario counts as failed for a policy, on the means over
//! seeds it reads ([`RuleFigures`], written to `eval.json` as each entry's
//! `failure_rule`), the words that say why, and the advice for a policy refused under the
//! judge.

use serde::Serialize;
use tokwatt_agent::AgentError;

use super::REACTION_LAG_S;

/// The share of its ticks a policy may break the objective on (mean over seeds), beyond
/// what the oracle's schedule itself breaks and what the reaction lag costs the causal
/// reference: a ratio bought by breaking the service is not a score. The oracle's search
/// holds each phase to the same share, so the bar is one for both.
pub const MAX_VIOLATION_FRACTION: f64 = 0.01;
/// A scenario fails for a policy that serves less of the demand than the references by
/// more than this (a fraction of the demand, mean over seeds). Half a point: work left in
/// flight at the run's end is work not paid for, and a slower policy that leaves a point
/// more of it saves more joules than its ratio's served share charges it.
pub const SERVED_MARGIN: f64 = 0.005;

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
    /// Whether a phase is beyond what any setting serves (then the default settings'
    /// share is allowed too, where it is larger).
    pub overload: bool,
    /// The share a policy may break the objective on: the oracle's share or
    /// [`MAX_VIOLATION_FRACTION`], whichever is larger, plus what the reaction lag costs
    /// the causal reference over the oracle (see `judge::allowed_violations`).
    pub allowed_violation_fraction: f64,
    /// The policy's served share of the demand.
    pub served_fraction_mean: f64,
    /// Seed by seed the lesser of the oracle's and the causal reference's served shares
    /// (a backlog the reaction lag leaves is not the policy's fault), averaged.
    pub reference_served_fraction_mean: f64,
    /// `reference_served_fraction_mean` less `served_fraction_mean`.
    pub served_shortfall_mean: f64,
}

/// Why a policy fails a scenario on the objective, if it does: it broke the objective on
/// more of its ticks than it is allowed (`allowed_violation_fraction`: what the oracle's
/// search allows itself, and what a controller reacting after the fact cannot avoid, see
/// `judge::allowed_violations`), or it served less of the demand than the references by
/// more than [`SERVED_MARGIN`]. The words quote `figures` by their names in `eval.json`'s
/// `failure_rule`.
pub fn objective_breach(figures: &RuleFigures) -> Option<String> {
    let mut reasons = Vec::new();
    let allowed = if figures.allowed_violation_fraction.is_finite() {
        figures.allowed_violation_fraction.max(0.0)
    } else {
        MAX_VIOLATION_FRACTION
    };
    let means = match figures.seeds {
        1 => "over its 1 seed".to_owned(),
        n => format!("means over {n} seeds"),
    };
    let violations = figures.slo_violation_fraction_mean;
    if violations > allowed + 1e-12 {
        reasons.push(format!(
            "broke the objective on {:.2} % of ticks (slo_violation_fraction_mean), more than the {:.2} % allowed (allowed_violation_fraction: the oracle's {:.2} % or {:.0} %, whichever is larger, plus the causal reference's {:.2} % less the oracle's) ({means})",
            violations * 100.0,
            allowed * 100.0,
            figures.oracle_violation_fraction_mean * 100.0,
            MAX_VIOLATION_FRACTION * 100.0,
            figures.causal_violation_fraction_mean * 100.0,
        ));
    }
    if figures.served_shortfall_mean > SERVED_MARGIN {
        reasons.push(format!(
            "served {:.4} of the demand (served_fraction_mean) against the references' {:.4} (reference_served_fraction_mean): {:.2} points less, more than {:.1} ({means})",
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
        "A scenario fails for a policy that breaks the objective on more ticks than the oracle's \
         schedule or {:.0} % of them, whichever is more, plus what the causal reference (the \
         oracle's settings taken up {:.0} s after each phase starts) breaks beyond the oracle; \
         that serves less of the demand than the references by more than {:.1} point; or that \
         cannot run it (means over seeds). A failed scenario shows no ratio and counts as 0 in \
         the median: a ratio bought by breaking the service is not a score.",
        MAX_VIOLATION_FRACTION * 100.0,
        REACTION_LAG_S,
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
