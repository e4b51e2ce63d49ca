//! What an A/B run is asked and what it found: the request, the schedule and estimand,
//! every epoch and tick, and the outcome (`ab.json`).

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ab::stats::{
    AbError, AbSummary, Arm, ArmEpoch, Decision, EpochPair, SequentialPlan, sample_sd,
};
use tokwatt_agent::AgentError;
use tokwatt_agent::assembly::RunMeta;
use tokwatt_core::types::{InForce, Objective};
use tokwatt_policy::spec::PolicySpec;

/// Version of `ab.json`'s layout. 2: every epoch is an independent trajectory (a fresh
/// instance), and the outcome states its estimand and the spread within each arm. 3: an
/// arm ahead on tokens per joule but refused on the objective has a decision of its own
/// (`a-refused`, `b-refused`) where 2 wrote `no-difference`.
pub const AB_FORMAT_VERSION: u32 = 3;

/// The parts of an epoch, in ticks of the arms' common tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schedule {
    /// Device defaults with the policy paused, before the arm takes over (0: none).
    pub cooldown_ticks: u64,
    /// The settled estimand: ticks a fresh instance runs, unmeasured, before its warm-up
    /// (0: the cold-start estimand).
    #[serde(default)]
    pub settle_ticks: u64,
    /// The arm in charge, not measured. At least 2: the tick the arm takes over observes
    /// the window before it.
    pub warmup_ticks: u64,
    /// The measured window.
    pub measure_ticks: u64,
}

impl Schedule {
    /// Ticks one epoch takes.
    pub fn epoch_ticks(&self) -> u64 {
        self.cooldown_ticks + self.settle_ticks + self.warmup_ticks + self.measure_ticks
    }

    /// What a verdict on this schedule estimates.
    pub fn estimand(&self) -> Estimand {
        if self.settle_ticks > 0 {
            Estimand::Settled
        } else {
            Estimand::ColdStart
        }
    }

    /// Refuse a schedule whose windows cannot be measured.
    pub fn check(&self, tick: Duration) -> Result<(), AbRunError> {
        if self.warmup_ticks < 2 {
            return Err(AbRunError::Schedule(format!(
                "a warm-up of {} ticks is too short: the tick an arm takes over still observes the window before it; use at least 2 ticks",
                self.warmup_ticks
            )));
        }
        let measured = tick * u32::try_from(self.measure_ticks).unwrap_or(u32::MAX);
        if self.measure_ticks < 3 || measured < MIN_MEASURED_WINDOW {
            return Err(AbRunError::Schedule(format!(
                "a measured window of {} ticks ({}) is too short for the energy counter (it moves in steps of up to 100 ms); use at least 3 ticks and {}",
                self.measure_ticks,
                humantime::format_duration(measured),
                humantime::format_duration(MIN_MEASURED_WINDOW)
            )));
        }
        Ok(())
    }
}

/// The shortest measured window: 20 steps of the slowest energy counter (100 ms) keep its
/// quantisation under 5 % of an epoch's energy at worst, and far less in practice.
pub const MIN_MEASURED_WINDOW: Duration = Duration::from_secs(2);

/// Which tokens per joule of each policy a verdict compares. Either way the sample is a
/// fresh instance's run from the device defaults; they differ in which part of that run
/// is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Estimand {
    /// From the start: the window right after the warm-up, learning included. What an
    /// operator deploying the policy gets; the default.
    ColdStart,
    /// Once settled: the window after the instance has run the settling time unmeasured.
    Settled,
}

/// The estimand and the unit of replication, in words, as `ab.json` and the report state
/// them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EstimandInfo {
    pub kind: Estimand,
    /// What the ratio B/A estimates.
    pub statement: String,
    /// What one independent sample is, and what the interval is computed over.
    pub unit_of_replication: String,
}

impl EstimandInfo {
    /// `span_s`: the replicated mode's pairs start at a moment drawn uniformly from the
    /// work's first `span_s` seconds.
    pub fn of(schedule: &Schedule, tick: Duration, mode: Mode, span_s: Option<f64>) -> Self {
        let span = |ticks: u64| {
            humantime::format_duration(tick * u32::try_from(ticks).unwrap_or(u32::MAX)).to_string()
        };
        let measured = span(schedule.measure_ticks);
        let moment = match (mode, span_s) {
            (Mode::Replicated, Some(span)) => format!(
                ", from a moment of this work drawn uniformly from its first {}",
                humantime::format_duration(Duration::from_secs_f64(span.max(0.0).round()))
            ),
            _ => String::new(),
        };
        let statement = match schedule.estimand() {
            Estimand::ColdStart => format!(
                "the ratio B/A of the tokens per joule a fresh instance of each policy achieves on this work over the {measured} after its first {} (a warm-up, not measured), started from the device defaults with no state{moment}: a deployment's first {}, learning included",
                span(schedule.warmup_ticks),
                span(schedule.warmup_ticks + schedule.measure_ticks),
            ),
            Estimand::Settled => format!(
                "the ratio B/A of the tokens per joule a fresh instance of each policy achieves on this work over {measured} once settled: after running {} unmeasured from the device defaults with no state{moment}",
                span(schedule.settle_ticks + schedule.warmup_ticks),
            ),
        };
        let unit_of_replication = match mode {
            Mode::Interleaved => "one trajectory: a fresh instance of a policy with its own seed, run for one epoch from the device defaults; each pair holds one trajectory of each arm in random order, and the interval and the sequential test are computed over pairs of trajectories, so they include how differently two runs of the same policy end up".to_owned(),
            Mode::Crossover => "one block: in each block every GPU group runs one fresh trajectory of each arm (half the groups A first), each with its own seed, from the device defaults; the interval and the sequential test are computed over blocks".to_owned(),
            Mode::Replicated => "one trajectory, on a simulator of its own: a fresh instance of a policy with its own seed and its own sensor noise; a pair's two trajectories see the same work (the same arrivals from the same moment: common random numbers), and the interval and the sequential test are computed over pairs, so they include how differently two runs of the same policy end up on the same work".to_owned(),
        };
        Self {
            kind: schedule.estimand(),
            statement,
            unit_of_replication,
        }
    }
}

/// How the arms share the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// One node, the arms taking turns: each pair is AB or BA at random.
    Interleaved,
    /// Two or more GPUs, each with its own loop: in each block, half the GPUs run A and
    /// the others B, then they swap, so GPU-to-GPU differences cancel within a block.
    Crossover,
    /// The simulator only: every trajectory on a simulator of its own. A pair's two
    /// trajectories see the same work (the same arrivals from the same moment of the
    /// scenario, drawn at random for each pair: common random numbers), each with its own
    /// sensor noise and policy seed, so nothing of one leaks into the other.
    Replicated,
}

#[derive(Debug, thiserror::Error)]
pub enum AbRunError {
    #[error("the A/B schedule: {0}")]
    Schedule(String),
    #[error("arm {arm} (`{policy}`): {source}")]
    Arm {
        arm: Arm,
        policy: String,
        #[source]
        source: AgentError,
    },
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error(transparent)]
    Stats(#[from] AbError),
    #[error("the control loop on GPU group {group} failed: {reason}")]
    Loop { group: usize, reason: String },
    #[error(
        "the run was interrupted after {pairs} pairs, before the first look at {needed} pairs: there is no verdict; run again, or lower --budget"
    )]
    NoVerdict { pairs: usize, needed: usize },
    #[error(
        "crossover needs at least 2 GPUs, got {gpus}; run on more GPUs (--gpus 2 on the simulator) or use the interleaved mode"
    )]
    CrossoverNeedsTwo { gpus: usize },
}

/// What `tokwatt ab` asks for: the two arms and how to compare them.
#[derive(Debug, Clone)]
pub struct AbRequest {
    pub a: PolicySpec,
    pub b: PolicySpec,
    pub schedule: Schedule,
    pub plan: SequentialPlan,
    /// Seeds the order of the arms in each pair and the policies' random sources.
    pub seed: u64,
    pub plugin_dirs: Vec<PathBuf>,
    pub cache_dir: Option<PathBuf>,
    /// Error-rate studies only (`tokwatt ab` never sets it): arm B's measured energy is
    /// divided by this, a known true ratio B/A on top of whatever the policies do, so that
    /// an A/A of an adaptive policy measures the power against a difference of exactly
    /// this size with that policy's own run-to-run spread. Said in the outcome's notes.
    pub injected_ratio: Option<f64>,
}

/// One measured epoch of one arm on one GPU group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochRecord {
    /// The pair (interleaved) or block (crossover) it belongs to, from 0.
    pub pair: usize,
    pub arm: Arm,
    /// 0 when it ran first in its pair, 1 second.
    pub position: u8,
    /// The seed of its policy instance (a fresh one, see [`trajectory_seed`]).
    #[serde(default)]
    pub seed: u64,
    /// The GPU group (its own loop) it ran on: always 0 when interleaved; in crossover,
    /// the group's place in the order of `--gpu` (or the simulated GPU's number).
    pub group: usize,
    /// The GPUs it ran on, as its group's loop numbers them.
    pub gpus: Vec<u32>,
    /// First and last tick of the measured window (the loop's tick numbers).
    pub first_tick: u64,
    pub last_tick: u64,
    pub measured: ArmEpoch,
    pub tokens_per_joule: f64,
    pub tokens_per_s: f64,
    pub mean_power_w: f64,
    /// Ticks on which the policy's answer was replaced by the fallback.
    pub fallback_ticks: u64,
    /// Each GPU's settings in force at the end of the window.
    pub settings: Vec<InForce>,
}

/// One tick of one GPU group, for the report's plots.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TickPoint {
    pub group: usize,
    pub tick: u64,
    pub time_s: f64,
    /// The arm in charge; `None` during a cool-down.
    pub arm: Option<Arm>,
    /// Whether the tick was in a measured window.
    pub measured: bool,
    /// The pair (block) of the trajectory in charge; `None` during a cool-down.
    #[serde(default)]
    pub pair: Option<usize>,
    /// Ticks since that trajectory's instance took over (0 at its take-over tick, which
    /// still observes the window before it).
    #[serde(default)]
    pub trajectory_tick: Option<u64>,
    pub tokens: u64,
    pub energy_j: f64,
    pub power_w: f64,
    pub tokens_per_joule: f64,
}

/// What the run found, written as `ab.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AbOutcome {
    pub format_version: u32,
    /// Arm A's and B's policy names and spec paths.
    pub a: ArmInfo,
    pub b: ArmInfo,
    pub mode: Mode,
    /// What the ratio estimates and what one sample is.
    pub estimand: EstimandInfo,
    /// Measured epochs, one per arm per pair (per GPU group in crossover): each an
    /// independent trajectory.
    pub epochs: Vec<EpochRecord>,
    /// How much the trajectories of one arm differ among themselves, beside the
    /// difference between the arms.
    pub spread: Spread,
    /// The pairs the statistics saw (crossover: each block's sums over its GPUs).
    pub pairs: Vec<EpochPair>,
    pub ratio_b_over_a: f64,
    pub ci_low: f64,
    pub ci_high: f64,
    pub confidence: f64,
    pub decision: Decision,
    /// Every look taken, the last one deciding.
    pub looks: Vec<AbSummary>,
    pub served_fraction_a: f64,
    pub served_fraction_b: f64,
    pub violation_ticks_a: u64,
    pub violation_ticks_b: u64,
    pub violation_rate_a: f64,
    pub violation_rate_b: f64,
    /// Why an arm that won on tokens per joule was not declared the winner.
    pub refused_because: Option<String>,
    /// Whether the workload reports demand (served fraction is 1 where it does not).
    pub demand_reported: bool,
    pub objective: Objective,
    pub schedule: Schedule,
    pub tick_ms: u64,
    pub budget_pairs: usize,
    pub alpha: f64,
    pub plan_looks: Vec<usize>,
    pub plan_alpha_at_look: Vec<f64>,
    pub seed: u64,
    pub interrupted: bool,
    /// Time the run covered (simulated time on the simulator).
    pub run_time_s: f64,
    pub meta: RunMeta,
    pub notes: Vec<String>,
    pub timeline: Vec<TickPoint>,
    /// Crossover only: how much the GPU groups differ on their own, the difference the
    /// swap in every block cancels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_difference: Option<crate::ab::GpuDifference>,
}

impl AbOutcome {
    /// Where the declared winner gave up more of the objective than the tolerance on
    /// average, by less than the noise of the pairs ([`crate::ab::stats::Compliance::Unresolved`]
    /// at the deciding look), the rule's words.
    pub fn winner_gave_up_within_noise(&self) -> Option<&str> {
        if !matches!(self.decision, Decision::A | Decision::B) {
            return None;
        }
        let check = self.looks.last()?.objective.as_ref()?;
        (check.compliance == crate::ab::stats::Compliance::Unresolved)
            .then_some(check.because.as_deref())
            .flatten()
    }
}

impl AbOutcome {
    /// Where an arm was refused, what it gave up in a few words (`it served less demand
    /// than A`), from the deciding look's reading of the objective.
    pub fn refusal_shortfall(&self) -> Option<String> {
        self.decision.refused_arm()?;
        self.looks.last()?.objective.as_ref()?.shortfall_words()
    }

    /// The decision in a few words, a refused arm named as refused.
    pub fn decision_headline(&self) -> String {
        crate::ab::stats::decision_headline(self.decision, self.refusal_shortfall().as_deref())
    }
}

/// The spread of the samples, on the log scale of the statistics (0.01 ≈ 1 %).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// Standard deviation of ln(tokens per joule) over arm A's samples (trajectories, or
    /// blocks' sums in crossover): how differently runs of the same policy end up, plus
    /// the work's own drift between pairs.
    pub within_a: f64,
    pub within_b: f64,
    /// Standard deviation of the pairs' ln(B/A): what the interval is built from.
    pub pairs: f64,
    /// ln of the ratio B/A: the difference between the arms on the same scale.
    pub between_arms: f64,
}

impl Spread {
    /// Over `pairs` that a look has used (every one a measurement).
    pub fn of(pairs: &[EpochPair], ratio_b_over_a: f64) -> Self {
        let tpj = |e: &ArmEpoch| (e.tokens as f64 / e.energy_j).ln();
        let a: Vec<f64> = pairs.iter().map(|p| tpj(&p.a)).collect();
        let b: Vec<f64> = pairs.iter().map(|p| tpj(&p.b)).collect();
        let d = crate::ab::stats::log_ratios(pairs).unwrap_or_default();
        Self {
            within_a: sample_sd(&a),
            within_b: sample_sd(&b),
            pairs: sample_sd(&d),
            between_arms: ratio_b_over_a.ln(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArmInfo {
    pub policy: String,
    pub spec: String,
    pub params: Vec<(String, String)>,
}

impl ArmInfo {
    pub(super) fn of(spec: &PolicySpec) -> Self {
        Self {
            policy: spec.name.clone(),
            spec: spec.path.display().to_string(),
            params: spec.params.clone(),
        }
    }
}

/// Reported after every measured epoch.
#[derive(Debug, Clone)]
pub struct AbProgress {
    pub pairs_done: usize,
    pub budget_pairs: usize,
    pub epochs_done: usize,
    /// The latest look, once one was taken.
    pub last_look: Option<AbSummary>,
}
