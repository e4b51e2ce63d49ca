//! The one compliance rule, for `tokwatt ab` and `tokwatt tune` alike: does the arm
//! keep the objective, as far as the pairs can tell? Each bound's mean per-epoch gap with
//! its interval: breaks when the interval lies wholly past the tolerance, keeps when wholly
//! within, unresolved otherwise.

use super::{AbError, Arm, ArmEpoch, EpochPair, Tolerances, mean, t_interval};
use serde::{Deserialize, Serialize};

/// Each arm's served fraction (mean over pairs) and violation ticks per tick.
pub(super) struct ObjectiveMeans {
    pub(super) served_a: f64,
    pub(super) served_b: f64,
    pub(super) violations_a: f64,
    pub(super) violations_b: f64,
}

impl ObjectiveMeans {
    pub(super) fn of(pairs: &[EpochPair]) -> Result<Self, AbError> {
        let mut served = [0.0, 0.0];
        let mut violation_ticks = [0u64, 0];
        let mut ticks = [0u64, 0];
        for (index, pair) in pairs.iter().enumerate() {
            for (slot, arm, epoch) in [(0, Arm::A, &pair.a), (1, Arm::B, &pair.b)] {
                if !(0.0..=1.0).contains(&epoch.served_fraction) {
                    return Err(AbError::ServedFractionOutOfRange {
                        pair: index,
                        arm,
                        value: epoch.served_fraction,
                    });
                }
                if epoch.violation_ticks > epoch.ticks {
                    return Err(AbError::ViolationsExceedTicks {
                        pair: index,
                        arm,
                        violation_ticks: epoch.violation_ticks,
                        ticks: epoch.ticks,
                    });
                }
                if epoch.ticks == 0 {
                    return Err(AbError::NotAMeasurement {
                        pair: index,
                        arm,
                        what: "ticks",
                        value: 0.0,
                    });
                }
                served[slot] += epoch.served_fraction;
                violation_ticks[slot] += epoch.violation_ticks;
                ticks[slot] += epoch.ticks;
            }
        }
        let count = pairs.len().max(1) as f64;
        let rate = |slot: usize| violation_ticks[slot] as f64 / ticks[slot].max(1) as f64;
        Ok(Self {
            served_a: served[0] / count,
            served_b: served[1] / count,
            violations_a: rate(0),
            violations_b: rate(1),
        })
    }
}

/// How far a candidate arm falls behind the other on one part of the objective, over the
/// pairs: each pair's gap (candidate worse is positive), their mean and a one-sided lower
/// confidence bound. Fractions: 0.01 is one percentage point.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ObjectiveGap {
    pub mean: f64,
    /// The Student t lower bound of the mean gap at level 1 − α; none below two pairs.
    pub low: Option<f64>,
    pub tolerance: f64,
}

impl ObjectiveGap {
    fn of(gaps: &[f64], alpha: f64, tolerance: f64) -> Self {
        // The two-sided interval at 1 − 2α has the one-sided bound at 1 − α as its low end.
        let (low, _) = t_interval(gaps, (2.0 * alpha).min(0.999));
        Self {
            mean: mean(gaps),
            low: low.is_finite().then_some(low),
            tolerance,
        }
    }

    fn compliance(&self) -> Compliance {
        if self.mean <= self.tolerance {
            Compliance::Keeps
        } else if self.low.is_some_and(|low| low > 0.0) {
            Compliance::Breaks
        } else {
            Compliance::Unresolved
        }
    }
}

/// Whether a candidate keeps the objective as well as the other arm, within the
/// tolerances. Two runs of an adaptive policy differ in violations and served demand as
/// much as in tokens per joule, so the rule reads the pairs' gaps with their noise: an arm
/// breaks the objective when it gives up more than the tolerance on average *and* the
/// pairs show it worse at all (the gap's lower bound above 0); a mean beyond the
/// tolerance that the noise can explain is unresolved. `tokwatt ab` and `tokwatt tune`
/// both judge by this rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Compliance {
    Keeps,
    /// Beyond the tolerance on average, within the noise: more pairs would tell.
    Unresolved,
    Breaks,
}

/// The [`Compliance`] of one arm against the other, with the gaps it rests on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ObjectiveCheck {
    /// The arm judged.
    pub arm: Arm,
    /// How much less demand it served (other's served fraction − its own).
    pub served: ObjectiveGap,
    /// How many more of its ticks violated the objective (its rate − the other's).
    pub violations: ObjectiveGap,
    pub compliance: Compliance,
    /// In words, where it does not keep the objective.
    pub because: Option<String>,
}

impl ObjectiveCheck {
    /// The parts of the objective the arm is shown to break, in a few words (`it served
    /// less demand than a`), or `None` where it breaks none.
    pub fn shortfall_words(&self) -> Option<String> {
        shortfall_words(self.arm, Some(&self.served), &self.violations)
    }
}

/// The parts of the objective `arm` is shown to break, in a few words for a verdict's
/// headline (the gaps' figures are in [`ObjectiveCheck::because`]); `served` is `None`
/// where served demand was not checked. `None` where it breaks neither.
pub fn shortfall_words(
    arm: Arm,
    served: Option<&ObjectiveGap>,
    violations: &ObjectiveGap,
) -> Option<String> {
    // Upper case, as the headline names the arms.
    let other = match arm {
        Arm::A => "B",
        Arm::B => "A",
    };
    let breaks = |gap: &ObjectiveGap| gap.compliance() == Compliance::Breaks;
    let mut parts = Vec::new();
    if served.is_some_and(breaks) {
        parts.push(format!("served less demand than {other}"));
    }
    if breaks(violations) {
        parts.push(format!("violated the objective on more ticks than {other}"));
    }
    (!parts.is_empty()).then(|| format!("it {}", parts.join(" and ")))
}

/// Judges `arm` against the other arm over `pairs` at false-positive rate `alpha` (see
/// [`Compliance`]).
pub fn objective_check(
    pairs: &[EpochPair],
    arm: Arm,
    tolerances: &Tolerances,
    alpha: f64,
) -> Result<ObjectiveCheck, AbError> {
    // Refuses pairs that are not measurements; its means are what the words quote.
    let means = ObjectiveMeans::of(pairs)?;
    let (other_arm, served_means, violation_means) = match arm {
        Arm::A => (
            Arm::B,
            (means.served_a, means.served_b),
            (means.violations_a, means.violations_b),
        ),
        Arm::B => (
            Arm::A,
            (means.served_b, means.served_a),
            (means.violations_b, means.violations_a),
        ),
    };
    let rate = |e: &ArmEpoch| e.violation_ticks as f64 / e.ticks.max(1) as f64;
    // Per pair, how much worse `arm` did: less demand served, more ticks violated.
    let (mut served_gaps, mut violation_gaps) = (Vec::new(), Vec::new());
    for pair in pairs {
        let (own, other) = match arm {
            Arm::A => (&pair.a, &pair.b),
            Arm::B => (&pair.b, &pair.a),
        };
        served_gaps.push(other.served_fraction - own.served_fraction);
        violation_gaps.push(rate(own) - rate(other));
    }
    let served_gap = ObjectiveGap::of(&served_gaps, alpha, tolerances.served_fraction);
    let violation_gap = ObjectiveGap::of(&violation_gaps, alpha, tolerances.violation_rate);
    let compliance = served_gap.compliance().max(violation_gap.compliance());
    let mut reasons = Vec::new();
    for (gap, (own, other), what, unit, less_or_more) in [
        (&served_gap, served_means, "served", "of demand", "less"),
        (
            &violation_gap,
            violation_means,
            "violated the objective on",
            "of ticks",
            "more",
        ),
    ] {
        let said = match gap.compliance() {
            Compliance::Keeps => continue,
            Compliance::Breaks => "",
            Compliance::Unresolved => ", within the noise",
        };
        let bound = gap.low.map_or_else(
            || "no bound from one pair".to_owned(),
            |low| format!("lower bound {:.2}", low * 100.0),
        );
        reasons.push(format!(
            "{arm} {what} {:.2} % {unit} against {other_arm}'s {:.2} % ({:.2} points \
             {less_or_more} on average, {bound}, tolerance {:.2}){said}",
            own * 100.0,
            other * 100.0,
            gap.mean * 100.0,
            gap.tolerance * 100.0
        ));
    }
    Ok(ObjectiveCheck {
        arm,
        served: served_gap,
        violations: violation_gap,
        compliance,
        because: (!reasons.is_empty()).then(|| reasons.join("; ")),
    })
}
