//! From each node's two halves to one pair of epochs per pair of nodes, and the verdict
//! over those pairs: `tokwatt ab`'s statistics ([`SequentialPlan`]), one look.

use serde::{Deserialize, Serialize};

use super::counters::Figures;
use crate::ab::stats::{ObjectiveCheck, ObjectiveGap};
use crate::ab::{AbError, Arm, ArmEpoch, Decision, EpochPair, SequentialPlan};

/// One arm over one pair of nodes: its two halves summed (one on each node, one in each
/// half, each scaled to the pair's mean length: see [`PairSums`]), so the difference
/// between the periods and between the nodes cancels within the pair.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ArmSum {
    pub tokens: u64,
    pub energy_j: f64,
    pub tokens_per_joule: f64,
    pub violation_ticks: u64,
    pub ticks: u64,
    pub tokens_demanded: Option<u64>,
    /// Tokens over tokens demanded, at most 1 (1 where nothing was asked); `None` where a
    /// node of the pair exports no demand counter.
    pub served_fraction: Option<f64>,
}

impl ArmSum {
    /// The two halves of one arm: `x` (a node's) and `y` (its partner's).
    pub fn of(x: &Figures, y: &Figures) -> Self {
        let tokens = x.tokens + y.tokens;
        let energy_j = x.energy_j + y.energy_j;
        let tokens_demanded = x.tokens_demanded.zip(y.tokens_demanded).map(|(x, y)| x + y);
        Self {
            tokens,
            energy_j,
            tokens_per_joule: tokens as f64 / energy_j,
            violation_ticks: x.violation_ticks + y.violation_ticks,
            ticks: x.ticks + y.ticks,
            tokens_demanded,
            served_fraction: tokens_demanded.map(|demanded| {
                if demanded == 0 {
                    1.0
                } else {
                    (tokens as f64 / demanded as f64).min(1.0)
                }
            }),
        }
    }

    /// What the statistics read. An unknown served fraction has to be some number there;
    /// 1 is used, and the verdict never reports it or lets it count (see [`verdict`]).
    pub fn epoch(&self) -> ArmEpoch {
        ArmEpoch {
            tokens: self.tokens,
            energy_j: self.energy_j,
            served_fraction: self.served_fraction.unwrap_or(1.0),
            violation_ticks: self.violation_ticks,
            ticks: self.ticks,
        }
    }
}

/// One pair of nodes' sums: arm A's halves (`a_first`'s first and `b_first`'s second)
/// and arm B's (the other two), each half first scaled to the pair's mean ticks a half.
///
/// The scaling is why the node and the period cancel: a sum weighs each half by its
/// length, so with a half of one node longer than its other (the scrapes that bound the
/// windows fall a little differently, a simulated node ticks faster in one half than in
/// the other) the arm holding it leans toward that node's own tokens per joule, which in
/// a pair of nodes of different loads is not the other's. Scaled, each half weighs alike;
/// a half's own ratios (tokens per joule, served demand, violations per tick) are kept.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PairSums {
    pub a: ArmSum,
    pub b: ArmSum,
    /// `tokens_per_joule` B over A: this pair's estimate of the ratio.
    pub ratio_b_over_a: f64,
}

impl PairSums {
    /// `a_first` ran A then B, `b_first` B then A; each given as [first half, second half].
    pub fn of(a_first: [&Figures; 2], b_first: [&Figures; 2]) -> Self {
        let halves = [a_first[0], a_first[1], b_first[0], b_first[1]];
        let mean_ticks = halves.iter().map(|h| h.ticks).sum::<u64>() as f64 / 4.0;
        let [x1, x2, y1, y2] = halves.map(|half| scaled(half, mean_ticks));
        let a = ArmSum::of(&x1, &y2);
        let b = ArmSum::of(&y1, &x2);
        Self {
            a,
            b,
            ratio_b_over_a: b.tokens_per_joule / a.tokens_per_joule,
        }
    }

    pub fn epochs(&self) -> EpochPair {
        EpochPair {
            a: self.a.epoch(),
            b: self.b.epoch(),
        }
    }
}

/// `half` as if it had run `ticks` ticks at the same rates (unchanged where it ran none:
/// the statistics refuse a half without ticks by name).
fn scaled(half: &Figures, ticks: f64) -> Figures {
    if half.ticks == 0 {
        return *half;
    }
    let factor = ticks / half.ticks as f64;
    let count = |n: u64| (n as f64 * factor).round() as u64;
    Figures {
        tokens: count(half.tokens),
        energy_j: half.energy_j * factor,
        violation_ticks: count(half.violation_ticks).min(ticks.round() as u64),
        ticks: ticks.round() as u64,
        tokens_demanded: half.tokens_demanded.map(count),
    }
}

/// The compliance reading of the arm that won on tokens per joule, as far as it is known.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ObjectiveReading {
    pub arm: Arm,
    /// `None` where served demand is unknown on some node: then it was not checked.
    pub served: Option<ObjectiveGap>,
    pub violations: ObjectiveGap,
    pub compliance: crate::ab::stats::Compliance,
    pub because: Option<String>,
}

/// The verdict of a fleet A/B, as `fleet-ab.json` and the printout give it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FleetVerdict {
    pub decision: Decision,
    /// The arm with more tokens per joule by both intervals, winner or not.
    pub more_tokens_per_joule: Option<Arm>,
    pub pairs: usize,
    /// exp(mean over pairs of ln(tokens/J of B over A)).
    pub ratio_b_over_a: f64,
    /// The percentile bootstrap interval of the ratio at `confidence`.
    pub ci_low: f64,
    pub ci_high: f64,
    /// The Student t interval at the same level.
    pub t_ci_low: f64,
    pub t_ci_high: f64,
    pub confidence: f64,
    /// Mean over pairs; `None` where some node's demand is unknown.
    pub served_fraction_a: Option<f64>,
    pub served_fraction_b: Option<f64>,
    /// Violating GPU-ticks per GPU-tick over every pair.
    pub violation_rate_a: f64,
    pub violation_rate_b: f64,
    /// Why the arm with more tokens per joule is not named the winner.
    pub refused_because: Option<String>,
    pub objective: Option<ObjectiveReading>,
}

impl FleetVerdict {
    /// The decision in a few words, a refused arm named as refused with what it gave up,
    /// or that its served demand is unknown.
    pub fn decision_headline(&self) -> String {
        let shortfall = self.decision.refused_arm().and_then(|arm| {
            let reading = self.objective.as_ref();
            reading
                .and_then(|r| {
                    crate::ab::stats::shortfall_words(r.arm, r.served.as_ref(), &r.violations)
                })
                .or_else(|| {
                    reading.is_some_and(|r| r.served.is_none()).then(|| {
                        let other = match arm {
                            Arm::A => "B",
                            Arm::B => "A",
                        };
                        format!("whether it served less demand than {other} is unknown")
                    })
                })
        });
        crate::ab::stats::decision_headline(self.decision, shortfall.as_deref())
    }
}

/// The verdict over `pairs` at false-positive rate `alpha`: one look of `tokwatt ab`'s
/// plan. Where served demand is unknown on the nodes `demand_unknown_on`, a winner on
/// tokens per joule is refused (it might have served less) unless
/// `accept_unknown_demand`, and then it is judged on violations alone.
pub fn verdict(
    pairs: &[PairSums],
    alpha: f64,
    seed: u64,
    demand_unknown_on: &[String],
    accept_unknown_demand: bool,
) -> Result<FleetVerdict, AbError> {
    let epochs: Vec<EpochPair> = pairs.iter().map(PairSums::epochs).collect();
    let plan = SequentialPlan::single_look(epochs.len(), alpha, seed)?;
    let look = plan.look(&epochs, 0)?;
    let summary = look.summary;
    let demand_known = demand_unknown_on.is_empty();
    let more_tokens_per_joule = if summary.ci_low.min(summary.t_ci_low) > 1.0 {
        Some(Arm::B)
    } else if summary.ci_high.max(summary.t_ci_high) < 1.0 {
        Some(Arm::A)
    } else {
        None
    };
    let mut decision = look.decision;
    let mut refused_because = summary.refused_because.clone();
    if let (Some(winner), false, false) =
        (more_tokens_per_joule, demand_known, accept_unknown_demand)
        && matches!(decision, Decision::A | Decision::B)
    {
        decision = Decision::refused(winner);
        refused_because = Some(format!(
            "{winner} has more tokens per joule, but served demand is unknown on {} (no \
             tokwatt_gpu_tokens_demanded_total: the workload does not report its demand), so \
             whether {winner} served less is not known; pass --accept-unknown-demand to judge \
             the objective on violations alone",
            demand_unknown_on.join(", ")
        ));
    }
    let objective = summary
        .objective
        .as_ref()
        .map(|check: &ObjectiveCheck| ObjectiveReading {
            arm: check.arm,
            served: demand_known.then_some(check.served),
            violations: check.violations,
            compliance: check.compliance,
            because: check.because.clone(),
        });
    Ok(FleetVerdict {
        decision,
        more_tokens_per_joule,
        pairs: summary.pairs,
        ratio_b_over_a: summary.ratio_b_over_a,
        ci_low: summary.ci_low,
        ci_high: summary.ci_high,
        t_ci_low: summary.t_ci_low,
        t_ci_high: summary.t_ci_high,
        confidence: summary.confidence,
        served_fraction_a: demand_known.then_some(summary.served_fraction_a),
        served_fraction_b: demand_known.then_some(summary.served_fraction_b),
        violation_rate_a: summary.violation_rate_a,
        violation_rate_b: summary.violation_rate_b,
        refused_because,
        objective,
    })
}
