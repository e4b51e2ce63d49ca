//! Statistics of an A/B comparison of tokens per joule over paired epochs.
//!
//! Each pair holds one epoch of arm A and one of arm B run back to back on the same work, so
//! slow drifts (temperature, load) cancel within a pair. The statistic per pair is
//! `d = ln(tpj_b / tpj_a)`: logs make the ratio symmetric (B/A and A/B are mirror images) and
//! turn a ratio of means into a mean, and the reported ratio B/A is `exp(mean d)`.
//!
//! Looking at the data repeatedly and stopping when it looks decided inflates the
//! false-positive rate, so a [`SequentialPlan`] fixes the looks in advance and spends the
//! error rate α across them; the parts sum to α, so by the union bound the chance of
//! declaring a winner when there is none stays at or below α whatever look stops the run.

use serde::{Deserialize, Serialize};

use tokwatt_core::rng::Rng;

mod compliance;
mod student_t;

use compliance::ObjectiveMeans;
pub use compliance::{Compliance, ObjectiveCheck, ObjectiveGap, objective_check, shortfall_words};
pub use student_t::{student_t_upper_quantile, student_t_upper_tail};

/// One arm's measurement over one epoch.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ArmEpoch {
    pub tokens: u64,
    /// Energy from the GPU's counter over the epoch's window, in joules.
    pub energy_j: f64,
    /// Share of the offered demand served in the epoch, 0 to 1.
    pub served_fraction: f64,
    /// Control ticks in the epoch on which the service objective was violated.
    pub violation_ticks: u64,
    pub ticks: u64,
}

/// One epoch of each arm, measured back to back on the same work.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EpochPair {
    pub a: ArmEpoch,
    pub b: ArmEpoch,
}

/// One of the two arms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arm {
    A,
    B,
}

impl std::fmt::Display for Arm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Arm::A => "a",
            Arm::B => "b",
        })
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum AbError {
    #[error(
        "pair {pair}, arm {arm}: {what} is {value}, so tokens per joule is not a measurement; \
         make the epoch long enough for the energy counter and the workload to produce tokens"
    )]
    NotAMeasurement {
        pair: usize,
        arm: Arm,
        what: &'static str,
        value: f64,
    },
    #[error(
        "pair {pair}, arm {arm}: served fraction {value} is outside 0..=1; \
         it is served demand over offered demand"
    )]
    ServedFractionOutOfRange { pair: usize, arm: Arm, value: f64 },
    #[error(
        "pair {pair}, arm {arm}: {violation_ticks} violation ticks out of {ticks} ticks; \
         violations are counted among the epoch's ticks"
    )]
    ViolationsExceedTicks {
        pair: usize,
        arm: Arm,
        violation_ticks: u64,
        ticks: u64,
    },
    #[error("look {look} needs {needed} pairs but only {have} were given")]
    NotEnoughPairs {
        look: usize,
        needed: usize,
        have: usize,
    },
    #[error("look {look} does not exist: the plan has {looks} looks (0 to {})", looks.saturating_sub(1))]
    NoSuchLook { look: usize, looks: usize },
    #[error("a budget of {budget} pairs is too small: at least 2 pairs are needed for an interval")]
    BudgetTooSmall { budget: usize },
    #[error(
        "a budget of {budget} pairs is more than any comparison needs: give at most {MAX_BUDGET} (the default is {DEFAULT_BUDGET})"
    )]
    BudgetTooLarge { budget: usize },
    #[error("α = {alpha} is not a false-positive rate; use a value between 0 and 1, e.g. 0.05")]
    BadAlpha { alpha: f64 },
    #[error("{name} = {value} is not valid; {fix}")]
    BadSetting {
        name: &'static str,
        value: f64,
        fix: &'static str,
    },
}

/// The outcome of a look: `a`, `b`, `a-refused`, `b-refused` or `no-difference` in
/// `ab.json`; `continue` only appears between looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Decision {
    A,
    B,
    /// A has more tokens per joule by both intervals but is not the winner: it does not
    /// keep the objective as well as B (`refused_because` says how). Named apart from
    /// `no-difference` because a refused arm is a finding, often a large one, and a
    /// reader of the decision alone must not take it for "the arms are alike".
    ARefused,
    /// As [`Decision::ARefused`], for B.
    BRefused,
    NoDifference,
    Continue,
}

impl Decision {
    /// Whether the run stops here.
    pub fn is_final(self) -> bool {
        self != Decision::Continue
    }

    /// The decision that refuses `arm`, the one ahead on tokens per joule.
    pub fn refused(arm: Arm) -> Self {
        match arm {
            Arm::A => Decision::ARefused,
            Arm::B => Decision::BRefused,
        }
    }

    /// The arm ahead on tokens per joule that was refused, if one was.
    pub fn refused_arm(self) -> Option<Arm> {
        match self {
            Decision::ARefused => Some(Arm::A),
            Decision::BRefused => Some(Arm::B),
            _ => None,
        }
    }

    /// The arm declared the winner, if one was.
    pub fn winner(self) -> Option<Arm> {
        match self {
            Decision::A => Some(Arm::A),
            Decision::B => Some(Arm::B),
            _ => None,
        }
    }

    /// The decision as `ab.json` writes it (`b-refused`), for the terminal and the reports.
    pub fn code(self) -> &'static str {
        match self {
            Decision::A => "a",
            Decision::B => "b",
            Decision::ARefused => "a-refused",
            Decision::BRefused => "b-refused",
            Decision::NoDifference => "no-difference",
            Decision::Continue => "continue",
        }
    }
}

/// A decision in a few words, for a verdict's first line: `B is more efficient`, or for a
/// refused arm `B refused: more tokens per joule, but it served less demand than a`.
/// `shortfall`: what the refused arm gave up ([`ObjectiveCheck::shortfall_words`]), where
/// known.
pub fn decision_headline(decision: Decision, shortfall: Option<&str>) -> String {
    match decision {
        Decision::A => "A is more efficient".to_owned(),
        Decision::B => "B is more efficient".to_owned(),
        Decision::ARefused | Decision::BRefused => {
            let arm = if decision == Decision::ARefused {
                "A"
            } else {
                "B"
            };
            format!(
                "{arm} refused: more tokens per joule, but {}",
                shortfall.unwrap_or("it does not keep the objective as well as the other arm")
            )
        }
        Decision::NoDifference => "no difference shown".to_owned(),
        Decision::Continue => "not decided yet".to_owned(),
    }
}

/// A confidence level in percent that never rounds up to 100 %: the early looks of a plan
/// spend a tiny share of α (a 99.99994 % interval), and `100.00 %` would claim a certainty
/// no interval has. Two decimals where they keep the level below 100, up to four where
/// needed, and `> 99.9999 %` beyond; `100 %` only for a level of exactly 1.
pub fn confidence_percent(confidence: f64) -> String {
    if !confidence.is_finite() {
        return "n/a".to_owned();
    }
    if confidence >= 1.0 {
        return "100 %".to_owned();
    }
    let percent = confidence * 100.0;
    (2..=4)
        .map(|decimals| format!("{percent:.decimals$}"))
        .find(|shown| shown.parse::<f64>().is_ok_and(|value| value < 100.0))
        .map_or_else(|| "> 99.9999 %".to_owned(), |shown| format!("{shown} %"))
}

/// How much an arm may give up on the objective and still win on tokens per joule.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Tolerances {
    /// How much lower the winner's mean served fraction may be, as a fraction (0.005 = 0.5
    /// percentage points).
    pub served_fraction: f64,
    /// How much higher the winner's violation ticks per tick may be, as a fraction.
    pub violation_rate: f64,
}

impl Default for Tolerances {
    fn default() -> Self {
        Self {
            served_fraction: 0.005,
            violation_rate: 0.005,
        }
    }
}

/// The result of one look, serialisable as the statistics part of `ab.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AbSummary {
    /// Pairs used at this look.
    pub pairs: usize,
    /// `exp(mean d)`: tokens per joule of B over A.
    pub ratio_b_over_a: f64,
    /// The percentile bootstrap interval of the ratio at level `confidence`.
    pub ci_low: f64,
    pub ci_high: f64,
    /// The Student t interval of the ratio at the same level, for comparison.
    pub t_ci_low: f64,
    pub t_ci_high: f64,
    /// The level of the intervals: 1 − the α spent at this look (not the overall 1 − α).
    pub confidence: f64,
    pub decision: Decision,
    /// The look, counted from 1.
    pub look: usize,
    pub served_fraction_a: f64,
    pub served_fraction_b: f64,
    /// Violation ticks per tick over all pairs used.
    pub violation_rate_a: f64,
    pub violation_rate_b: f64,
    /// Set when an arm won on tokens per joule but broke the objective, and why.
    pub refused_because: Option<String>,
    /// The objective rule's reading of the arm that won on tokens per joule, if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objective: Option<ObjectiveCheck>,
}

impl AbSummary {
    /// The look's decision in a few words, a refused arm named as refused with what it
    /// gave up ([`decision_headline`]).
    pub fn decision_headline(&self) -> String {
        let shortfall = self
            .decision
            .refused_arm()
            .and(self.objective.as_ref())
            .and_then(ObjectiveCheck::shortfall_words);
        decision_headline(self.decision, shortfall.as_deref())
    }
}

/// The verdict of one look.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    pub decision: Decision,
    pub summary: AbSummary,
}

/// Default pairs budget: looks after 4, 8, 16 and 32 pairs. On the simulator's steady work
/// a pair's log ratio varies by about 3 % (Poisson arrivals, sensor noise), and a true 3 %
/// difference is decided with over 90 % power by the last look (`tokwatt bench
/// ab-error-rates` prints it; `tests/all/ab.rs` holds it).
pub const DEFAULT_BUDGET: usize = 32;
/// The default budget on the simulator, where time is cheap (256 pairs of the default
/// epochs: about 10 simulated hours, a second or two of compute in a release build).
/// Two cold-start runs of an adaptive policy on the same work differ by up to 10 %
/// (`hill-climb`, `joint-search`): 32 pairs resolve 3 % for them with under 80 % power,
/// 128 with 72-79 % for `joint-search` (`docs/measurements/sim-2026-12-03-ab-table/`),
/// 256 with more (`tokwatt bench ab-table`).
pub const DEFAULT_SIM_BUDGET: usize = 256;
/// The most pairs a comparison may budget: 100 000 pairs of one-minute epochs is most of a
/// year; more is a typo, and would only allocate.
pub const MAX_BUDGET: usize = 100_000;
/// The default false-positive rate. The looks' union bound is nearly tight here (the last
/// look gets most of α), so the rate is close to α itself: on the simulator, 1000 A/A
/// comparisons at α = 0.05 named a winner 5.4 % of the time. Over 128 pairs of the
/// adaptive policies' trajectories it ran a little above α (3.6 % at 0.03, 2.8 % at 0.02,
/// 1600 comparisons each), and one policy-scenario cell of 200 seeds at a true 3 % reads
/// above 5 % one time in ten; 0.02 keeps every cell under 5 % with room for that noise,
/// at little cost in power.
pub const DEFAULT_ALPHA: f64 = 0.02;
pub const DEFAULT_BOOTSTRAP_RESAMPLES: usize = 4000;
/// Exponent ρ of the spending rule α·t^ρ: 3 is close to O'Brien-Fleming, spending little
/// early (when a few pairs can look decided by chance) and most at the last look.
pub const DEFAULT_SPENDING_EXPONENT: f64 = 3.0;

/// Looks, α spending and the objective rule, fixed before the first pair is measured.
#[derive(Debug, Clone, PartialEq)]
pub struct SequentialPlan {
    /// Pairs at each look, increasing; the last is the budget.
    looks: Vec<usize>,
    /// α spent at each look; sums to α.
    alpha_at_look: Vec<f64>,
    pub resamples: usize,
    pub seed: u64,
    pub tolerances: Tolerances,
}

impl SequentialPlan {
    /// Looks after 4, 8, 16, … pairs up to `budget` (always a look at the budget), with α
    /// spent by the default rule.
    pub fn new(budget: usize, alpha: f64, seed: u64) -> Result<Self, AbError> {
        Self::with_spending(budget, alpha, DEFAULT_SPENDING_EXPONENT, seed)
    }

    /// As [`SequentialPlan::new`] with the spending rule α·(t_k^ρ − t_{k−1}^ρ), t_k = pairs at
    /// look k / budget.
    pub fn with_spending(
        budget: usize,
        alpha: f64,
        exponent: f64,
        seed: u64,
    ) -> Result<Self, AbError> {
        if budget < 2 {
            return Err(AbError::BudgetTooSmall { budget });
        }
        if budget > MAX_BUDGET {
            return Err(AbError::BudgetTooLarge { budget });
        }
        if !(alpha > 0.0 && alpha < 1.0) {
            return Err(AbError::BadAlpha { alpha });
        }
        if !(exponent.is_finite() && exponent > 0.0) {
            return Err(AbError::BadSetting {
                name: "spending exponent",
                value: exponent,
                fix: "use a positive number (1 spends evenly, 3 is O'Brien-Fleming-like)",
            });
        }
        let mut looks = Vec::new();
        let mut pairs = 4;
        while pairs < budget {
            looks.push(pairs);
            pairs *= 2;
        }
        looks.push(budget);
        let spent = |pairs: usize| alpha * (pairs as f64 / budget as f64).powf(exponent);
        let mut alpha_at_look = Vec::with_capacity(looks.len());
        let mut before = 0.0;
        for (index, &pairs) in looks.iter().enumerate() {
            // The last look takes exactly what is left, so the parts sum to α despite rounding.
            let cumulative = if index + 1 == looks.len() {
                alpha
            } else {
                spent(pairs)
            };
            alpha_at_look.push(cumulative - before);
            before = cumulative;
        }
        Ok(Self {
            looks,
            alpha_at_look,
            resamples: DEFAULT_BOOTSTRAP_RESAMPLES,
            seed,
            tolerances: Tolerances::default(),
        })
    }

    /// A fixed-size comparison: one look, after `pairs` pairs, spending all of α there
    /// (a grid's measurement of each point, a study's fixed budget).
    pub fn single_look(pairs: usize, alpha: f64, seed: u64) -> Result<Self, AbError> {
        let mut plan = Self::new(pairs, alpha, seed)?;
        plan.looks = vec![pairs];
        plan.alpha_at_look = vec![alpha];
        Ok(plan)
    }

    /// Pairs needed at each look.
    pub fn looks(&self) -> &[usize] {
        &self.looks
    }

    /// α spent at each look.
    pub fn alpha_at_look(&self) -> &[f64] {
        &self.alpha_at_look
    }

    pub fn budget(&self) -> usize {
        self.looks.last().copied().unwrap_or(0)
    }

    /// Decide at look `look` (from 0) on the first `looks()[look]` pairs.
    ///
    /// A winner is declared only when both the bootstrap and the t interval at level 1 − α_k
    /// exclude 1: the t interval is exact for normal noise and keeps small looks honest (a
    /// percentile bootstrap of 4 pairs is far too narrow), the bootstrap guards against
    /// skewed noise. Requiring both can only lower the false-positive rate.
    pub fn look(&self, pairs: &[EpochPair], look: usize) -> Result<Verdict, AbError> {
        let (&needed, &alpha) = self
            .looks
            .get(look)
            .zip(self.alpha_at_look.get(look))
            .ok_or(AbError::NoSuchLook {
                look,
                looks: self.looks.len(),
            })?;
        if pairs.len() < needed {
            return Err(AbError::NotEnoughPairs {
                look,
                needed,
                have: pairs.len(),
            });
        }
        let used = &pairs[..needed];
        let log_ratios = log_ratios(used)?;
        let means = ObjectiveMeans::of(used)?;

        let mean = mean(&log_ratios);
        let mut rng = Rng::stream(self.seed, look as u64);
        let (boot_low, boot_high) =
            bootstrap_interval(&log_ratios, alpha, self.resamples, &mut rng);
        let (t_low, t_high) = t_interval(&log_ratios, alpha);
        // Both exclude 1 exactly when their hull does.
        let low = boot_low.min(t_low);
        let high = boot_high.max(t_high);

        let is_last = look + 1 == self.looks.len();
        let tpj_winner = if low > 0.0 {
            Some(Arm::B)
        } else if high < 0.0 {
            Some(Arm::A)
        } else {
            None
        };
        let objective = match tpj_winner {
            Some(winner) => Some(objective_check(
                used,
                winner,
                &self.tolerances,
                self.alpha_at_look.iter().sum(),
            )?),
            None => None,
        };
        let (decision, refused_because) = match (tpj_winner, &objective) {
            (Some(winner), Some(check)) => match check.compliance {
                // A refused winner is final: more pairs would not make it keep the objective.
                Compliance::Breaks => (
                    Decision::refused(winner),
                    Some(format!(
                        "{winner} has more tokens per joule but does not win: {}",
                        check
                            .because
                            .as_deref()
                            .unwrap_or("it breaks the objective")
                    )),
                ),
                // Within the noise: more pairs tell, while the budget lasts.
                Compliance::Unresolved if !is_last => (Decision::Continue, None),
                _ if winner == Arm::B => (Decision::B, None),
                _ => (Decision::A, None),
            },
            _ if is_last => (Decision::NoDifference, None),
            _ => (Decision::Continue, None),
        };
        let summary = AbSummary {
            pairs: needed,
            ratio_b_over_a: mean.exp(),
            ci_low: boot_low.exp(),
            ci_high: boot_high.exp(),
            t_ci_low: t_low.exp(),
            t_ci_high: t_high.exp(),
            confidence: 1.0 - alpha,
            decision,
            look: look + 1,
            served_fraction_a: means.served_a,
            served_fraction_b: means.served_b,
            violation_rate_a: means.violations_a,
            violation_rate_b: means.violations_b,
            refused_because,
            objective,
        };
        Ok(Verdict { decision, summary })
    }
}

/// `ln(tpj_b / tpj_a)` per pair, refusing pairs that are not measurements.
pub fn log_ratios(pairs: &[EpochPair]) -> Result<Vec<f64>, AbError> {
    pairs
        .iter()
        .enumerate()
        .map(|(index, pair)| {
            let tpj_a = tokens_per_joule(index, Arm::A, &pair.a)?;
            let tpj_b = tokens_per_joule(index, Arm::B, &pair.b)?;
            Ok((tpj_b / tpj_a).ln())
        })
        .collect()
}

fn tokens_per_joule(pair: usize, arm: Arm, epoch: &ArmEpoch) -> Result<f64, AbError> {
    if !(epoch.energy_j.is_finite() && epoch.energy_j > 0.0) {
        return Err(AbError::NotAMeasurement {
            pair,
            arm,
            what: "energy (J)",
            value: epoch.energy_j,
        });
    }
    if epoch.tokens == 0 {
        return Err(AbError::NotAMeasurement {
            pair,
            arm,
            what: "tokens",
            value: 0.0,
        });
    }
    Ok(epoch.tokens as f64 / epoch.energy_j)
}

pub(super) fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

/// The sample standard deviation (n − 1 in the denominator); NaN below two values.
pub(super) fn sample_sd(values: &[f64]) -> f64 {
    let n = values.len();
    if n < 2 {
        return f64::NAN;
    }
    let m = mean(values);
    (values.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
}

/// Percentile bootstrap interval of the mean of `values` at level 1 − α: resample the pairs
/// with replacement, take the α/2 and 1 − α/2 quantiles of the resampled means. Pairs are the
/// resampling unit because the two epochs of a pair share their conditions.
pub fn bootstrap_interval(
    values: &[f64],
    alpha: f64,
    resamples: usize,
    rng: &mut Rng,
) -> (f64, f64) {
    let n = values.len();
    if n == 0 || resamples == 0 {
        return (f64::NEG_INFINITY, f64::INFINITY);
    }
    let mut means: Vec<f64> = (0..resamples)
        .map(|_| {
            let sum: f64 = (0..n)
                .map(|_| {
                    // Multiply-shift: an index in 0..n without modulo bias worth the name.
                    let index = ((rng.next_u64() as u128 * n as u128) >> 64) as usize;
                    values[index]
                })
                .sum();
            sum / n as f64
        })
        .collect();
    means.sort_by(f64::total_cmp);
    let last = resamples - 1;
    let low_index = ((alpha / 2.0) * resamples as f64).floor() as usize;
    let high_index = last.saturating_sub(low_index);
    (means[low_index.min(last)], means[high_index])
}

/// Student t interval of the mean of `values` at level 1 − α (infinite with fewer than 2).
pub fn t_interval(values: &[f64], alpha: f64) -> (f64, f64) {
    let n = values.len();
    if n < 2 {
        return (f64::NEG_INFINITY, f64::INFINITY);
    }
    let m = mean(values);
    let standard_error = sample_sd(values) / (n as f64).sqrt();
    let half_width = student_t_upper_quantile(alpha / 2.0, (n - 1) as f64) * standard_error;
    (m - half_width, m + half_width)
}
