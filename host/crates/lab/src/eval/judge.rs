//! The judge's figures: seeds' medians and ranges, the per-tick series of true tokens and
//! energy, ticks to a fraction of the oracle, and one entry from a policy's runs.

use serde::Serialize;

use super::{EvalEntry, EvalScenario, HOLD_S, PhaseOracle, RuleFigures, TRAILING_WINDOW_S};
use tokwatt_agent::RunSummary;
use tokwatt_policy::spec::PolicySpec;
use tokwatt_sim::SimGpu;

/// Median and range over seeds.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: &[f64]) -> Spread {
        let mut sorted: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
        sorted.sort_by(f64::total_cmp);
        Spread {
            median: median_sorted(&sorted),
            min: sorted.first().copied().unwrap_or(f64::NAN),
            max: sorted.last().copied().unwrap_or(f64::NAN),
        }
    }
}

fn median_sorted(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The median of `values`, ignoring NaN (NaN when nothing is left).
pub fn median(values: &[f64]) -> f64 {
    Spread::of(values).median
}

/// Per tick, summed over GPUs: time and the cumulative true tokens and energy.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Series {
    pub time_s: Vec<f64>,
    pub tokens: Vec<f64>,
    pub energy_j: Vec<f64>,
    /// Settings in force on GPU 0 at each tick (cap W, SM clock max MHz, batch).
    pub settings: Vec<(f64, u32, u32)>,
}

impl Series {
    pub(super) fn push(&mut self, time_s: f64, sim: &SimGpu, gpus: u32, settings: (f64, u32, u32)) {
        let (mut tokens, mut energy) = (0.0, 0.0);
        for gpu in 0..gpus {
            if let Some(truth) = sim.truth(gpu) {
                tokens += truth.tokens;
                energy += truth.energy_j;
            }
        }
        self.time_s.push(time_s);
        self.tokens.push(tokens);
        self.energy_j.push(energy);
        self.settings.push(settings);
    }

    fn totals(&self) -> (f64, f64) {
        (
            self.tokens.last().copied().unwrap_or(0.0),
            self.energy_j.last().copied().unwrap_or(0.0),
        )
    }

    /// Tokens per joule over `(t - window, t]` at each tick (NaN before a full window).
    pub fn trailing_tokens_per_joule(&self, window_s: f64) -> Vec<(f64, f64)> {
        let mut start = 0;
        let mut out = Vec::with_capacity(self.time_s.len());
        for (i, &t) in self.time_s.iter().enumerate() {
            while start < i && self.time_s[start] < t - window_s - 1e-9 {
                start += 1;
            }
            let value = if t - self.time_s[start] + 1e-9 < window_s || start == i {
                f64::NAN
            } else {
                let energy = self.energy_j[i] - self.energy_j[start];
                let tokens = self.tokens[i] - self.tokens[start];
                if energy > 0.0 {
                    tokens / energy
                } else {
                    f64::NAN
                }
            };
            out.push((t, value));
        }
        out
    }

    /// The trailing tokens per joule at time `t` (the latest tick at or before it).
    fn trailing_at(trailing: &[(f64, f64)], t: f64) -> f64 {
        let index = trailing.partition_point(|&(time, _)| time <= t + 1e-9);
        index
            .checked_sub(1)
            .and_then(|i| trailing.get(i))
            .map_or(f64::NAN, |&(_, v)| v)
    }
}

/// What one run of a policy gave.
pub(super) struct RunOutcome {
    pub(super) summary: RunSummary,
    pub(super) series: Series,
}

/// The oracle's schedule on one seed: each phase's settings from its first second.
pub(super) struct Schedule {
    pub(super) series: Series,
    pub(super) served_fraction: f64,
    /// The share of ticks over the objective, in this one run of the schedule (a backlog
    /// left by an overload phase carried into the next, as in the policy's run).
    pub(super) violation_fraction: f64,
    /// The same, over the ticks of the phases the oracle found feasible (none: no such
    /// phase).
    pub(super) feasible_violation_fraction: Option<f64>,
}

/// What a policy is measured against on one seed.
pub(super) struct References {
    /// The oracle's settings from each phase's first second.
    pub(super) oracle: Schedule,
    /// The same settings taken up a reaction lag late: the best a controller that sees
    /// a phase only once it has begun can do.
    pub(super) causal: Schedule,
    /// The default settings throughout.
    pub(super) default: Schedule,
}

impl Schedule {
    pub(super) fn tokens_per_joule(&self) -> f64 {
        let (tokens, energy) = self.series.totals();
        if energy > 0.0 {
            tokens / energy
        } else {
            f64::NAN
        }
    }
}

/// The entry of one policy on one scenario from its runs and the references, seed by seed.
pub(super) fn judge(
    spec: &PolicySpec,
    scenario: &EvalScenario,
    oracle: &[PhaseOracle],
    per_seed: &[(u64, &RunOutcome, &References)],
) -> EvalEntry {
    let tick_s = f64::from(spec.tick_ms) / 1e3;
    let mut tpj = Vec::new();
    let mut oracle_tpj = Vec::new();
    let mut ratios = Vec::new();
    let mut to_95 = Vec::new();
    let mut to_98 = Vec::new();
    let mut violations = Vec::new();
    let mut served = Vec::new();
    let mut oracle_served = Vec::new();
    let mut oracle_violations = Vec::new();
    let mut causal_tpj = Vec::new();
    let mut causal_ratios = Vec::new();
    let mut causal_served = Vec::new();
    let mut causal_violations = Vec::new();
    let mut default_tpj = Vec::new();
    let mut default_violations = Vec::new();
    let mut default_served = Vec::new();
    let mut over_default = Vec::new();
    let mut changes = Vec::new();
    let mut fallbacks = Vec::new();
    for (_, run, references) in per_seed {
        let schedule = &references.oracle;
        let causal = &references.causal;
        let (tokens, energy) = run.series.totals();
        let policy_tpj = if energy > 0.0 { tokens / energy } else { 0.0 };
        let best_tpj = schedule.tokens_per_joule();
        let served_fraction = run.summary.totals.demand.map_or(1.0, |d| d.served_fraction);
        // A policy that serves less than a reference has the shortfall counted against it.
        let share_of = |reference: &Schedule| {
            if reference.served_fraction > 0.0 {
                (served_fraction / reference.served_fraction).min(1.0)
            } else {
                1.0
            }
        };
        tpj.push(policy_tpj);
        oracle_tpj.push(best_tpj);
        ratios.push(policy_tpj / best_tpj * share_of(schedule));
        causal_tpj.push(causal.tokens_per_joule());
        causal_ratios.push(policy_tpj / causal.tokens_per_joule() * share_of(causal));
        causal_served.push(causal.served_fraction);
        causal_violations.push(causal.violation_fraction);
        default_tpj.push(references.default.tokens_per_joule());
        default_violations.push(references.default.violation_fraction);
        default_served.push(references.default.served_fraction);
        over_default.push(policy_tpj / references.default.tokens_per_joule());
        let ticks = run.summary.totals.ticks.max(1) as f64;
        violations.push(run.summary.totals.slo_violation_ticks as f64 / ticks);
        served.push(served_fraction);
        oracle_served.push(schedule.served_fraction);
        oracle_violations.push(schedule.violation_fraction);
        changes.push(run.summary.totals.settings_changes as f64);
        fallbacks.push(run.summary.totals.fallback_ticks as f64);
        let phases: Vec<(f64, f64)> = oracle.iter().map(|p| (p.start_s, p.end_s)).collect();
        to_95.push(time_to_fraction(&run.series, &schedule.series, &phases, 0.95) / tick_s);
        to_98.push(time_to_fraction(&run.series, &schedule.series, &phases, 0.98) / tick_s);
    }
    // A seed where no phase reached it counts as slower than any that did.
    let reached = |values: &[f64]| {
        let never_as_slowest: Vec<f64> = values
            .iter()
            .map(|&v| if v.is_nan() { f64::INFINITY } else { v })
            .collect();
        let m = median(&never_as_slowest);
        m.is_finite().then_some(m)
    };
    // The objective is judged on the mean over seeds: one bad seed is not hidden by the
    // median of the others.
    let mean = |values: &[f64]| values.iter().sum::<f64>() / values.len().max(1) as f64;
    // Served demand is judged against the lesser of the two references: a backlog the
    // reaction lag leaves is not the policy's fault.
    let reference_served: Vec<f64> = oracle_served
        .iter()
        .zip(&causal_served)
        .map(|(oracle, causal)| oracle.min(*causal))
        .collect();
    let overload = super::oracle::is_overload(oracle);
    let figures = (!per_seed.is_empty()).then(|| RuleFigures {
        seeds: per_seed.len(),
        slo_violation_fraction_mean: mean(&violations),
        causal_violation_fraction_mean: mean(&causal_violations),
        oracle_violation_fraction_mean: mean(&oracle_violations),
        default_violation_fraction_mean: mean(&default_violations),
        overload,
        allowed_violation_fraction: allowed_violations(
            mean(&causal_violations),
            mean(&oracle_violations),
            mean(&default_violations),
            overload,
        ),
        served_fraction_mean: mean(&served),
        reference_served_fraction_mean: mean(&reference_served),
        served_shortfall_mean: mean(&reference_served) - mean(&served),
    });
    // None where no seed ran: said by the caller, which knows why.
    let failed = figures.as_ref().and_then(super::objective_breach);
    let measured_ratio = median(&ratios);
    let measured_causal_ratio = median(&causal_ratios);
    let passed = |ratio: f64| (failed.is_none() && ratio.is_finite()).then_some(ratio);
    EvalEntry {
        policy: spec.name.clone(),
        scenario: scenario.name.clone(),
        seeds: per_seed.iter().map(|(seed, _, _)| *seed).collect(),
        tokens_per_joule: Spread::of(&tpj),
        oracle_tokens_per_joule: median(&oracle_tpj),
        causal_tokens_per_joule: median(&causal_tpj),
        default_tokens_per_joule: median(&default_tpj),
        ratio: passed(measured_ratio),
        measured_ratio: measured_ratio.is_finite().then_some(measured_ratio),
        causal_ratio: passed(measured_causal_ratio),
        measured_causal_ratio: measured_causal_ratio
            .is_finite()
            .then_some(measured_causal_ratio),
        over_default: {
            let m = median(&over_default);
            m.is_finite().then_some(m)
        },
        causal_violation_fraction: median(&causal_violations),
        oracle_violation_fraction: median(&oracle_violations),
        default_violation_fraction: median(&default_violations),
        causal_served_fraction: median(&causal_served),
        default_served_fraction: median(&default_served),
        failure_rule: figures,
        failed,
        ticks_to_95: reached(&to_95),
        ticks_to_98: reached(&to_98),
        slo_violation_fraction: median(&violations),
        served_fraction: median(&served),
        oracle_served_fraction: median(&oracle_served),
        setting_changes: median(&changes),
        fallback_ticks: median(&fallbacks),
        failure: None,
    }
}

/// The share of ticks over the objective a policy may have: the oracle's own share or
/// [`super::MAX_VIOLATION_FRACTION`], whichever is larger (the oracle's search allows each
/// phase that share, so a policy gets the same), plus what the reaction lag costs the
/// causal reference beyond the oracle (a controller that sees a phase only once it has
/// begun cannot avoid it). No more: a policy allowed a point more than the oracle could
/// spend it on joules the oracle was not allowed to save. On an overload the default
/// settings may break the objective more (a run that serves more of an overload carries a
/// longer backlog into the ticks after it): that is allowed too, so no policy fails for
/// doing what an untuned GPU does when demand is beyond it.
pub fn allowed_violations(causal: f64, oracle: f64, default: f64, overload: bool) -> f64 {
    let lag_cost = (causal - oracle).max(0.0);
    let allowed = oracle.max(super::MAX_VIOLATION_FRACTION) + lag_cost;
    if overload {
        allowed.max(default)
    } else {
        allowed
    }
}

/// Mean over phases of the seconds from each phase's start until the policy's trailing
/// tokens per joule reaches `fraction` of the oracle's and holds it for [`HOLD_S`]; a
/// phase where it never does counts as its full length. NaN when no phase reached it.
pub fn time_to_fraction(
    policy: &Series,
    oracle: &Series,
    phases: &[(f64, f64)],
    fraction: f64,
) -> f64 {
    let ours = policy.trailing_tokens_per_joule(TRAILING_WINDOW_S);
    let best = oracle.trailing_tokens_per_joule(TRAILING_WINDOW_S);
    let meets = |t: f64| {
        let (a, b) = (Series::trailing_at(&ours, t), Series::trailing_at(&best, t));
        a.is_finite() && b.is_finite() && a >= fraction * b
    };
    let mut total = 0.0;
    let mut any = false;
    for &(start, end) in phases {
        // The first full window inside the phase ends a trailing window after its start.
        let reached = ours
            .iter()
            .map(|&(t, _)| t)
            .filter(|&t| t >= start + TRAILING_WINDOW_S - 1e-9 && t + HOLD_S <= end + 1e-9)
            .find(|&t| {
                ours.iter()
                    .map(|&(u, _)| u)
                    .filter(|&u| u >= t && u <= t + HOLD_S)
                    .all(meets)
            });
        match reached {
            Some(t) => {
                any = true;
                total += t - start;
            }
            None => total += end - start,
        }
    }
    if any && !phases.is_empty() {
        total / phases.len() as f64
    } else {
        f64::NAN
    }
}
