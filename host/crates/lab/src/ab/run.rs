//! Running an A/B comparison: epochs of each arm on the same work, interleaved in
//! randomised pairs (AB or BA) on one node, or in parallel crossover blocks on two or more
//! GPUs (A on one GPU and B on the other, then swapped).
//!
//! The arms take turns through the hot-swap path ([`tokwatt_agent::swap`]) at tick boundaries, so
//! an A/B run is the agent's own loop, on the simulator or real GPUs.
//!
//! **The unit of replication is a trajectory.** Every epoch is a fresh instance of its
//! arm's policy, with a seed of its own and no state from any earlier epoch
//! ([`StateOnSwap::Fresh`]), started from the device defaults: an optional cool-down
//! (the defaults held, the policy paused), then for the settled estimand a settling time,
//! a warm-up (the arm in charge, not measured) and the measured window. Two epochs are
//! therefore two independent runs of their policies, and a pair holds one of each arm, so
//! the statistics over pairs see how differently two runs of the same policy end up, not
//! one instance's trajectory read as many samples ([`Estimand`]).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::stats::{
    AbError, AbSummary, Arm, ArmEpoch, Decision, EpochPair, SequentialPlan, sample_sd,
};
use tokwatt_agent::assembly::RunMeta;
use tokwatt_agent::control::{Backends, ControlLoop, LoopCommand, LoopConfig, Progress};
use tokwatt_agent::recorder::Recorder;
use tokwatt_agent::swap::{PreparedPolicy, StateOnSwap, SwapSender, swap_channel};
use tokwatt_agent::{self as agent, AgentError, NodeFacts, plugin_search_path};
use tokwatt_core::rng::Rng;
use tokwatt_core::types::{InForce, Objective, Settings};
use tokwatt_plugin::{ComponentCache, HostConfig, PluginHost};
use tokwatt_policy::envelope::Envelope;
use tokwatt_policy::spec::PolicySpec;
use tokwatt_policy::supervisor::{PolicyFailure, Supervisor};

/// Version of `ab.json`'s layout. 2: every epoch is an independent trajectory (a fresh
/// instance), and the outcome states its estimand and the spread within each arm.
pub const AB_FORMAT_VERSION: u32 = 2;

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

/// The seed of one trajectory: its own for every arm, pair and GPU group, so that two
/// runs of the same policy (an A/A) are independent, and the same for the same request
/// seed (the candidates of a `tune` round meet the same draws).
pub fn trajectory_seed(seed: u64, group: usize, pair: usize, arm: Arm) -> u64 {
    let arm = Arms::index(arm) as u64;
    let mut pairs = Rng::stream(seed, 0x7a_1ec7);
    let pair_seed = pairs.next_u64() ^ (pair as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    Rng::stream(pair_seed, (group as u64) << 1 | arm).next_u64()
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
    pub gpu_difference: Option<super::GpuDifference>,
}

impl AbOutcome {
    /// Where the declared winner gave up more of the objective than the tolerance on
    /// average, by less than the noise of the pairs ([`super::stats::Compliance::Unresolved`]
    /// at the deciding look), the rule's words.
    pub fn winner_gave_up_within_noise(&self) -> Option<&str> {
        if !matches!(self.decision, Decision::A | Decision::B) {
            return None;
        }
        let check = self.looks.last()?.objective.as_ref()?;
        (check.compliance == super::stats::Compliance::Unresolved)
            .then_some(check.because.as_deref())
            .flatten()
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
        let d = super::stats::log_ratios(pairs).unwrap_or_default();
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
    fn of(spec: &PolicySpec) -> Self {
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

/// The arms' order in every pair, drawn before the first epoch: AB or BA, each with
/// probability ½.
pub fn pair_orders(pairs: usize, seed: u64) -> Vec<[Arm; 2]> {
    let mut rng = Rng::stream(seed, 0xab);
    (0..pairs)
        .map(|_| {
            if rng.uniform() < 0.5 {
                [Arm::A, Arm::B]
            } else {
                [Arm::B, Arm::A]
            }
        })
        .collect()
}

/// Tries at starting an arm whose `init` misses its deadline.
const START_ATTEMPTS: u32 = 3;

/// Both arms' specs on one node's facts, ready to be started and restarted.
struct Arms {
    host: PluginHost,
    specs: [PolicySpec; 2],
    plugins: [PathBuf; 2],
    node: NodeFacts,
    seed: u64,
    tick: Duration,
    judge: Objective,
    injected_ratio: Option<f64>,
}

impl Arms {
    fn new(request: &AbRequest, tick: Duration, node: NodeFacts) -> Result<Self, AbRunError> {
        let search = plugin_search_path(&request.plugin_dirs);
        let resolve = |arm: Arm, spec: &PolicySpec| {
            spec.resolve_plugin(&search)
                .map_err(|source| AbRunError::Arm {
                    arm,
                    policy: spec.name.clone(),
                    source: source.into(),
                })
        };
        let plugins = [resolve(Arm::A, &request.a)?, resolve(Arm::B, &request.b)?];
        let host = PluginHost::new(&HostConfig {
            cache_dir: request
                .cache_dir
                .clone()
                .or_else(ComponentCache::default_dir),
        })
        .map_err(AgentError::from)?;
        Ok(Self {
            host,
            specs: [request.a.clone(), request.b.clone()],
            plugins,
            node,
            seed: request.seed,
            tick,
            judge: judging_objective(request),
            injected_ratio: request.injected_ratio,
        })
    }

    fn index(arm: Arm) -> usize {
        match arm {
            Arm::A => 0,
            Arm::B => 1,
        }
    }

    fn spec(&self, arm: Arm) -> &PolicySpec {
        &self.specs[Self::index(arm)]
    }

    /// A fresh instance of `arm` seeded with `seed`: its supervisor, first settings and
    /// envelope. An arm is started at every one of its epochs, so an `init` that missed
    /// its wall-clock deadline once (a busy machine) is tried again before the comparison
    /// gives up.
    fn start(
        &self,
        arm: Arm,
        seed: u64,
    ) -> Result<(Supervisor, Vec<Settings>, Envelope), AbRunError> {
        let i = Self::index(arm);
        let mut attempt = 1;
        loop {
            let started = agent::start_policy(
                &self.host,
                &self.specs[i],
                &self.plugins[i],
                &self.node,
                seed,
                self.tick,
            );
            match started {
                Err(AgentError::PolicyStart {
                    failure: PolicyFailure::Deadline { deadline_ms, .. },
                    ..
                }) if attempt < START_ATTEMPTS => {
                    tracing::warn!(
                        %arm,
                        attempt,
                        "arm {arm}'s init missed its {deadline_ms} ms deadline; starting it again"
                    );
                    attempt += 1;
                }
                other => {
                    return other.map_err(|source| AbRunError::Arm {
                        arm,
                        policy: self.specs[i].name.clone(),
                        source,
                    });
                }
            }
        }
    }

    /// Both arms must start before the first epoch: a broken arm is refused up front.
    fn check_both_start(&self) -> Result<(), AbRunError> {
        self.start(Arm::A, self.seed)?;
        self.start(Arm::B, self.seed)?;
        Ok(())
    }

    /// A fresh instance of `arm` ready to take over at a tick boundary: no state, neither
    /// its own from an earlier epoch nor the outgoing policy's.
    fn prepare(&self, arm: Arm, seed: u64) -> Result<PreparedPolicy, AbRunError> {
        let (supervisor, first, envelope) = self.start(arm, seed)?;
        Ok(PreparedPolicy {
            supervisor,
            first,
            envelope,
            objective: self.spec(arm).objective,
            // An arm that fails is measured failing (its fallback ticks are counted),
            // never replaced by the other arm in the middle of its epoch.
            probation_ticks: 0,
            notify: None,
            state: StateOnSwap::Fresh,
            operator_rollback: false,
        })
    }
}

/// Where an epoch driver is within its epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Cooldown,
    Warmup,
    Measure,
}

/// Sums over a measured window.
#[derive(Debug, Clone, Copy, Default)]
struct Window {
    first_tick: u64,
    ticks: u64,
    tokens: u64,
    energy_j: f64,
    seconds: f64,
    tokens_demanded: u64,
    demand_reported: bool,
    violation_ticks: u64,
    fallback_ticks_at_start: u64,
}

/// What an epoch driver does after a measured epoch.
enum Flow {
    Continue,
    Stop,
}

/// Drives one control loop through its epochs from the loop's progress callback: swaps
/// the arms in, pauses for cool-downs, measures the windows and hands each finished epoch
/// to `on_epoch`.
struct Driver<'a> {
    group: usize,
    arms: &'a Arms,
    /// The arm of every epoch, in order.
    epochs: Vec<(usize, u8, Arm)>,
    next_epoch: usize,
    current: Arm,
    /// The pair of the trajectory in charge, and the tick it took over plus one (the first
    /// trajectory's settings are in force from before tick 0, as if it took over at -1).
    trajectory: Option<(usize, u64)>,
    /// The seed of the trajectory in charge.
    trajectory_seed: u64,
    phase: Phase,
    phase_left: u64,
    window: Window,
    swaps: SwapSender,
    commands: Sender<LoopCommand>,
    schedule: Schedule,
    judge: Objective,
    stop: Arc<AtomicBool>,
    timeline: Vec<TickPoint>,
    failure: Option<AbRunError>,
    finished: bool,
}

impl Driver<'_> {
    fn on_tick(
        &mut self,
        p: &Progress<'_>,
        on_epoch: &mut dyn FnMut(EpochRecord) -> Result<Flow, AbRunError>,
    ) {
        if self.finished {
            return;
        }
        let power_w: f64 = p.observations.iter().map(|o| o.power_avg_w).sum();
        let tokens: u64 = p.observations.iter().map(|o| o.tokens).sum();
        let energy: f64 = p.observations.iter().map(|o| o.energy_j).sum();
        self.timeline.push(TickPoint {
            group: self.group,
            tick: p.tick,
            time_s: p.time.as_secs_f64(),
            arm: (self.phase != Phase::Cooldown).then_some(self.current),
            measured: self.phase == Phase::Measure,
            pair: self.trajectory.map(|(pair, _)| pair),
            trajectory_tick: self
                .trajectory
                .map(|(_, since)| (p.tick + 1).saturating_sub(since)),
            tokens,
            energy_j: energy,
            power_w,
            tokens_per_joule: if energy > 0.0 {
                tokens as f64 / energy
            } else {
                0.0
            },
        });
        if self.phase == Phase::Measure {
            let w = &mut self.window;
            if w.ticks == 0 {
                w.first_tick = p.tick;
            }
            w.ticks += 1;
            w.tokens += tokens;
            w.energy_j += energy;
            w.seconds += p.observations.first().map_or(0.0, |o| o.interval_s);
            for o in p.observations {
                if let Some(demand) = &o.demand {
                    w.demand_reported = true;
                    w.tokens_demanded += demand.tokens_demanded;
                }
            }
            w.violation_ticks +=
                u64::from(p.observations.iter().any(|o| self.judge.violated_by(o)));
        }
        self.phase_left = self.phase_left.saturating_sub(1);
        if self.phase_left > 0 {
            return;
        }
        if let Err(failure) = self.advance(p, on_epoch) {
            self.failure = Some(failure);
            self.finish();
        }
    }

    fn finish(&mut self) {
        self.finished = true;
        self.stop.store(true, Ordering::Relaxed);
    }

    /// The phase ended at this tick: move on.
    fn advance(
        &mut self,
        p: &Progress<'_>,
        on_epoch: &mut dyn FnMut(EpochRecord) -> Result<Flow, AbRunError>,
    ) -> Result<(), AbRunError> {
        match self.phase {
            Phase::Cooldown => {
                self.commands
                    .send(LoopCommand::Resume)
                    .map_err(|_| self.loop_gone())?;
                self.take_turn(p)
            }
            Phase::Warmup => {
                self.phase = Phase::Measure;
                self.phase_left = self.schedule.measure_ticks;
                self.window = Window {
                    fallback_ticks_at_start: p.totals.fallback_ticks,
                    ..Window::default()
                };
                Ok(())
            }
            Phase::Measure => {
                let record = self.record(p);
                self.trajectory = None;
                let flow = on_epoch(record)?;
                if matches!(flow, Flow::Stop) || self.next_epoch >= self.epochs.len() {
                    self.finish();
                    return Ok(());
                }
                if self.schedule.cooldown_ticks > 0 {
                    self.commands
                        .send(LoopCommand::RestoreDefaults)
                        .map_err(|_| self.loop_gone())?;
                    self.phase = Phase::Cooldown;
                    self.phase_left = self.schedule.cooldown_ticks;
                    Ok(())
                } else {
                    self.take_turn(p)
                }
            }
        }
    }

    fn loop_gone(&self) -> AbRunError {
        AbRunError::Loop {
            group: self.group,
            reason: "the control loop stopped taking commands".into(),
        }
    }

    /// The next epoch's trajectory takes over (at the next tick boundary): a fresh
    /// instance of its arm with its own seed, from the device defaults, so a knob an arm
    /// leaves alone is not held where the other arm put it (without a cool-down, the
    /// defaults and the instance's first settings are applied at the same boundary). It
    /// settles (the settled estimand) and warms up before its window.
    fn take_turn(&mut self, p: &Progress<'_>) -> Result<(), AbRunError> {
        let (pair, _, arm) = self.epochs[self.next_epoch];
        if self.schedule.cooldown_ticks == 0 {
            for command in [LoopCommand::RestoreDefaults, LoopCommand::Resume] {
                self.commands.send(command).map_err(|_| self.loop_gone())?;
            }
        }
        let seed = trajectory_seed(self.arms.seed, self.group, pair, arm);
        let prepared = self.arms.prepare(arm, seed)?;
        self.swaps.send(prepared).map_err(|_| self.loop_gone())?;
        self.current = arm;
        self.trajectory = Some((pair, p.tick + 2));
        self.trajectory_seed = seed;
        self.phase = Phase::Warmup;
        self.phase_left = self.schedule.settle_ticks + self.schedule.warmup_ticks;
        Ok(())
    }

    fn record(&mut self, p: &Progress<'_>) -> EpochRecord {
        let (pair, position, arm) = self.epochs[self.next_epoch];
        self.next_epoch += 1;
        let mut w = self.window;
        if arm == Arm::B
            && let Some(ratio) = self.arms.injected_ratio
        {
            w.energy_j /= ratio;
        }
        let served_fraction = if w.demand_reported && w.tokens_demanded > 0 {
            (w.tokens as f64 / w.tokens_demanded as f64).min(1.0)
        } else {
            1.0
        };
        EpochRecord {
            pair,
            arm,
            position,
            seed: self.trajectory_seed,
            group: self.group,
            gpus: p.observations.iter().map(|o| o.gpu).collect(),
            first_tick: w.first_tick,
            last_tick: p.tick,
            measured: ArmEpoch {
                tokens: w.tokens,
                energy_j: w.energy_j,
                served_fraction,
                violation_ticks: w.violation_ticks,
                ticks: w.ticks,
            },
            tokens_per_joule: if w.energy_j > 0.0 {
                w.tokens as f64 / w.energy_j
            } else {
                0.0
            },
            tokens_per_s: if w.seconds > 0.0 {
                w.tokens as f64 / w.seconds
            } else {
                0.0
            },
            mean_power_w: if w.seconds > 0.0 {
                w.energy_j / w.seconds
            } else {
                0.0
            },
            fallback_ticks: p.totals.fallback_ticks - w.fallback_ticks_at_start,
            settings: p.observations.iter().map(|o| o.in_force).collect(),
        }
    }
}

/// One GPU group's loop, driven through `epochs`, handing each epoch to `on_epoch`.
/// Returns the group's timeline and how long the loop ran (its clock's time).
fn drive_group(
    group: usize,
    arms: &Arms,
    epochs: Vec<(usize, u8, Arm)>,
    schedule: Schedule,
    backends: Backends,
    stop: Arc<AtomicBool>,
    on_epoch: &mut dyn FnMut(EpochRecord) -> Result<Flow, AbRunError>,
) -> Result<(Vec<TickPoint>, f64, bool), AbRunError> {
    let (first_pair, first_arm) = epochs.first().map_or((0, Arm::A), |e| (e.0, e.2));
    let first_seed = trajectory_seed(arms.seed, group, first_pair, first_arm);
    let (supervisor, first, envelope) = arms.start(first_arm, first_seed)?;
    let (swaps, port) = swap_channel();
    let (commands, command_port) = std::sync::mpsc::channel();
    let judge = arms.judge;
    let ticks = epochs.len() as u64 * schedule.epoch_ticks() + 1;
    let duration = arms.tick * u32::try_from(ticks).unwrap_or(u32::MAX);
    // The loop stops on its own flag, raised by the driver when decided or by `stop`.
    let loop_stop = Arc::new(AtomicBool::new(false));
    let control = ControlLoop::new(
        backends,
        supervisor,
        &first,
        envelope,
        {
            // A knob one arm owns and the other does not goes back to where the run
            // started when the other takes over; the guard is off, since an A/B measures
            // the policies themselves.
            let (a, b) = (arms.spec(Arm::A).knobs, arms.spec(Arm::B).knobs);
            LoopConfig {
                node_knobs: tokwatt_core::types::Knobs {
                    power_cap: a.power_cap || b.power_cap,
                    sm_clock: a.sm_clock || b.sm_clock,
                    batch_size: a.batch_size || b.batch_size,
                },
                guard: tokwatt_policy::rules::NodeRules::judging().guard,
                ..LoopConfig::new(duration, arms.tick, arms.spec(first_arm).objective)
            }
        },
        loop_stop.clone(),
    )
    .with_swaps(port)
    .with_commands(command_port);
    let mut driver = Driver {
        group,
        arms,
        epochs,
        next_epoch: 0,
        current: first_arm,
        trajectory: Some((first_pair, 0)),
        trajectory_seed: first_seed,
        // The first trajectory's settings are in force from the start, a tick ahead of a
        // later one's (whose take-over tick still observes the window before it): one
        // tick less of warm-up puts its window at the same age. Later epochs may cool
        // down first.
        phase: Phase::Warmup,
        phase_left: schedule.settle_ticks + schedule.warmup_ticks - 1,
        window: Window::default(),
        swaps,
        commands,
        schedule,
        judge,
        stop: loop_stop.clone(),
        timeline: Vec::new(),
        failure: None,
        finished: false,
    };
    let mut recorder = Recorder::discard();
    let mut control = control;
    let result = loop {
        match control.tick(&mut recorder) {
            Ok(Some(p)) => {
                if stop.load(Ordering::Relaxed) {
                    loop_stop.store(true, Ordering::Relaxed);
                }
                driver.on_tick(&p, on_epoch);
            }
            Ok(None) => break Ok(control.finish()),
            Err(error) => break Err(error),
        }
    };
    let (totals, _backends) = result.map_err(|e| AbRunError::Loop {
        group,
        reason: e.to_string(),
    })?;
    if let Some(failure) = driver.failure {
        return Err(failure);
    }
    let interrupted = stop.load(Ordering::Relaxed);
    Ok((driver.timeline, totals.duration_s, interrupted))
}

/// The statistics side: pairs in, looks out, until a look decides.
struct Looker<'a> {
    plan: &'a SequentialPlan,
    pairs: Vec<EpochPair>,
    looks: Vec<AbSummary>,
    decided: Option<Decision>,
    progress: &'a mut (dyn FnMut(AbProgress) + Send),
    epochs_done: usize,
}

impl<'a> Looker<'a> {
    fn new(plan: &'a SequentialPlan, progress: &'a mut (dyn FnMut(AbProgress) + Send)) -> Self {
        Self {
            plan,
            pairs: Vec::new(),
            looks: Vec::new(),
            decided: None,
            progress,
            epochs_done: 0,
        }
    }

    /// Add a pair; take the look due at this many pairs, if any. Whether the run stops.
    fn add(&mut self, pair: EpochPair) -> Result<Flow, AbRunError> {
        self.pairs.push(pair);
        let n = self.pairs.len();
        let mut flow = Flow::Continue;
        if let Some(look) = self.plan.looks().iter().position(|&at| at == n) {
            let verdict = self.plan.look(&self.pairs, look)?;
            self.looks.push(verdict.summary);
            if verdict.decision.is_final() {
                self.decided = Some(verdict.decision);
                flow = Flow::Stop;
            }
        }
        (self.progress)(AbProgress {
            pairs_done: n,
            budget_pairs: self.plan.budget(),
            epochs_done: self.epochs_done,
            last_look: self.looks.last().cloned(),
        });
        Ok(flow)
    }
}

/// Interleaved A/B on one node: the arms take turns on `backends`, in pairs whose order
/// is drawn at random.
pub fn run_interleaved(
    request: &AbRequest,
    backends: Backends,
    meta: RunMeta,
    stop: Arc<AtomicBool>,
    progress: &mut (dyn FnMut(AbProgress) + Send),
) -> Result<AbOutcome, AbRunError> {
    let (tick, notes) = common_tick(request)?;
    request.schedule.check(tick)?;
    let arms = Arms::new(request, tick, NodeFacts::of(&backends))?;
    arms.check_both_start()?;
    let budget = request.plan.budget();
    let epochs: Vec<(usize, u8, Arm)> = pair_orders(budget, request.seed)
        .into_iter()
        .enumerate()
        .flat_map(|(pair, order)| [(pair, 0, order[0]), (pair, 1, order[1])])
        .collect();
    let mut looker = Looker::new(&request.plan, progress);
    let mut records: Vec<EpochRecord> = Vec::new();
    let mut waiting: Option<EpochRecord> = None;
    let (timeline, run_time_s, interrupted) = drive_group(
        0,
        &arms,
        epochs,
        request.schedule,
        backends,
        stop,
        &mut |record| {
            records.push(record.clone());
            looker.epochs_done += 1;
            match waiting.take() {
                None => {
                    waiting = Some(record);
                    Ok(Flow::Continue)
                }
                Some(first) => looker.add(pair_of(&first, &record)),
            }
        },
    )?;
    finish(
        request,
        Mode::Interleaved,
        looker,
        records,
        timeline,
        run_time_s,
        interrupted,
        meta,
        notes,
        tick,
        None,
    )
}

/// Crossover A/B on two or more GPU groups (usually one GPU each), each with its own
/// loop on a thread of its own: in every block half the groups run one arm and half the
/// other, then each group runs the other arm; a block's pair sums each arm over all
/// groups, so differences between GPUs cancel.
pub fn run_crossover(
    request: &AbRequest,
    groups: Vec<Backends>,
    meta: RunMeta,
    stop: Arc<AtomicBool>,
    progress: &mut (dyn FnMut(AbProgress) + Send),
) -> Result<AbOutcome, AbRunError> {
    if groups.len() < 2 {
        return Err(AbRunError::CrossoverNeedsTwo { gpus: groups.len() });
    }
    let (tick, notes) = common_tick(request)?;
    request.schedule.check(tick)?;
    let budget = request.plan.budget();
    let orders = pair_orders(budget, request.seed);
    let group_count = groups.len();
    let all_arms = groups
        .iter()
        .map(|backends| Arms::new(request, tick, NodeFacts::of(backends)))
        .collect::<Result<Vec<_>, _>>()?;
    all_arms[0].check_both_start()?;
    let looker = Mutex::new(Looker::new(&request.plan, progress));
    let records: Mutex<Vec<EpochRecord>> = Mutex::new(Vec::new());
    let rendezvous = Rendezvous::new(group_count);
    let outcomes = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .zip(&all_arms)
            .enumerate()
            .map(|(group, (backends, arms))| {
                // Even groups run the block's first arm first, odd groups the other.
                let epochs: Vec<(usize, u8, Arm)> = orders
                    .iter()
                    .enumerate()
                    .flat_map(|(block, order)| {
                        let (first, second) = if group % 2 == 0 {
                            (order[0], order[1])
                        } else {
                            (order[1], order[0])
                        };
                        [(block, 0, first), (block, 1, second)]
                    })
                    .collect();
                let stop = stop.clone();
                let (looker, records, rendezvous) = (&looker, &records, &rendezvous);
                std::thread::Builder::new()
                    .name(format!("ab-group-{group}"))
                    .spawn_scoped(scope, move || {
                        let leaving = rendezvous.member();
                        let result = drive_group(
                            group,
                            arms,
                            epochs,
                            request.schedule,
                            backends,
                            stop,
                            &mut |record| {
                                let (block, position) = (record.pair, record.position);
                                lock(records).push(record);
                                // Every group finishes each epoch at the same tick; the
                                // last to arrive folds the block once both halves are in.
                                let flow = rendezvous.meet(|| {
                                    let mut looker = lock(looker);
                                    looker.epochs_done += group_count;
                                    if position == 1 {
                                        let pair = block_pair(&lock(records), block);
                                        looker.add(pair).map(|f| matches!(f, Flow::Stop))
                                    } else {
                                        Ok(false)
                                    }
                                });
                                match flow {
                                    Ok(true) => Ok(Flow::Stop),
                                    Ok(false) => Ok(Flow::Continue),
                                    Err(error) => Err(error),
                                }
                            },
                        );
                        drop(leaving);
                        result
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(group, handle)| match handle {
                Ok(handle) => handle.join().unwrap_or_else(|_| {
                    Err(AbRunError::Loop {
                        group,
                        reason: "its thread panicked".into(),
                    })
                }),
                Err(e) => Err(AbRunError::Loop {
                    group,
                    reason: format!("no thread: {e}"),
                }),
            })
            .collect::<Vec<_>>()
    });
    let mut timeline = Vec::new();
    let mut run_time_s: f64 = 0.0;
    let mut interrupted = false;
    for outcome in outcomes {
        let (points, seconds, stopped) = outcome?;
        timeline.extend(points);
        run_time_s = run_time_s.max(seconds);
        interrupted |= stopped;
    }
    let looker = looker.into_inner().unwrap_or_else(|p| p.into_inner());
    let mut records = records.into_inner().unwrap_or_else(|p| p.into_inner());
    records.sort_by_key(|r| (r.pair, r.position, r.group));
    finish(
        request,
        Mode::Crossover,
        looker,
        records,
        timeline,
        run_time_s,
        interrupted,
        meta,
        notes,
        tick,
        None,
    )
}

/// What one trajectory of the replicated mode runs on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrajectoryWork {
    /// Seeds the work: the same for both trajectories of a pair.
    pub work_seed: u64,
    /// Seeds the trajectory's own sensor noise and step jitter.
    pub noise_seed: u64,
    /// The moment of the scenario the trajectory starts at, seconds.
    pub offset_s: f64,
}

/// Builds a fresh simulator for one trajectory.
pub type WorkFactory<'a> = dyn Fn(TrajectoryWork) -> Result<Backends, String> + 'a;

/// Replicated A/B on the simulator: each trajectory on a simulator of its own, built by
/// `make`; a pair's two trajectories (in random order) on the same work from the same
/// moment, drawn uniformly from the work's first `span_s` seconds.
pub fn run_replicated(
    request: &AbRequest,
    make: &WorkFactory<'_>,
    span_s: f64,
    meta: RunMeta,
    stop: Arc<AtomicBool>,
    progress: &mut (dyn FnMut(AbProgress) + Send),
) -> Result<AbOutcome, AbRunError> {
    let (tick, notes) = common_tick(request)?;
    request.schedule.check(tick)?;
    let budget = request.plan.budget();
    let orders = pair_orders(budget, request.seed);
    let mut moments = Rng::stream(request.seed, 0x3e91_1ca7);
    let works: Vec<(u64, f64)> = (0..budget)
        .map(|_| (moments.next_u64(), moments.uniform() * span_s.max(0.0)))
        .collect();
    let build = |pair: usize, arm: Arm| {
        let (work_seed, offset_s) = works[pair];
        make(TrajectoryWork {
            work_seed,
            noise_seed: trajectory_seed(request.seed, 0, pair, arm) ^ 0x005e_7507,
            offset_s,
        })
        .map_err(|reason| AbRunError::Loop { group: 0, reason })
    };
    let arms = Arms::new(request, tick, NodeFacts::of(&build(0, Arm::A)?))?;
    arms.check_both_start()?;
    let mut looker = Looker::new(&request.plan, progress);
    let mut records: Vec<EpochRecord> = Vec::new();
    let mut timeline: Vec<TickPoint> = Vec::new();
    let (mut run_time_s, mut base_tick) = (0.0, 0u64);
    let mut interrupted = false;
    'pairs: for (pair, order) in orders.iter().enumerate() {
        let mut first: Option<EpochRecord> = None;
        for (position, &arm) in order.iter().enumerate() {
            let backends = build(pair, arm)?;
            let mut measured: Option<EpochRecord> = None;
            let (points, seconds, stopped) = drive_group(
                0,
                &arms,
                vec![(pair, position as u8, arm)],
                request.schedule,
                backends,
                stop.clone(),
                &mut |record| {
                    measured = Some(record);
                    Ok(Flow::Stop)
                },
            )?;
            // Laid end to end: each trajectory's ticks and time after the one before.
            let ticks = points.len() as u64;
            timeline.extend(points.into_iter().map(|p| TickPoint {
                tick: p.tick + base_tick,
                time_s: p.time_s + run_time_s,
                ..p
            }));
            base_tick += ticks;
            run_time_s += seconds;
            let Some(mut record) = measured else {
                interrupted = true;
                break 'pairs;
            };
            record.first_tick += base_tick - ticks;
            record.last_tick += base_tick - ticks;
            records.push(record.clone());
            looker.epochs_done += 1;
            if stopped {
                interrupted = true;
            }
            match first.take() {
                None => first = Some(record),
                Some(first) => {
                    if matches!(looker.add(pair_of(&first, &record))?, Flow::Stop) {
                        break 'pairs;
                    }
                }
            }
            if interrupted {
                break 'pairs;
            }
        }
    }
    finish(
        request,
        Mode::Replicated,
        looker,
        records,
        timeline,
        run_time_s,
        interrupted,
        meta,
        notes,
        tick,
        Some(span_s),
    )
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// The pair of two epochs of one pair, whatever their order.
fn pair_of(x: &EpochRecord, y: &EpochRecord) -> EpochPair {
    if x.arm == Arm::A {
        EpochPair {
            a: x.measured,
            b: y.measured,
        }
    } else {
        EpochPair {
            a: y.measured,
            b: x.measured,
        }
    }
}

/// A crossover block's pair: each arm's epochs summed over every group.
fn block_pair(records: &[EpochRecord], block: usize) -> EpochPair {
    let sum = |arm: Arm| {
        let mut total = ArmEpoch {
            tokens: 0,
            energy_j: 0.0,
            served_fraction: 0.0,
            violation_ticks: 0,
            ticks: 0,
        };
        let mut count = 0.0;
        for r in records.iter().filter(|r| r.pair == block && r.arm == arm) {
            total.tokens += r.measured.tokens;
            total.energy_j += r.measured.energy_j;
            total.served_fraction += r.measured.served_fraction;
            total.violation_ticks += r.measured.violation_ticks;
            total.ticks += r.measured.ticks;
            count += 1.0;
        }
        if count > 0.0 {
            total.served_fraction /= count;
        }
        total
    };
    EpochPair {
        a: sum(Arm::A),
        b: sum(Arm::B),
    }
}

/// The arms' common tick: A's; B runs on it too (said in the notes when its own differs).
fn common_tick(request: &AbRequest) -> Result<(Duration, Vec<String>), AbRunError> {
    let mut notes = Vec::new();
    let tick = Duration::from_millis(u64::from(request.a.tick_ms));
    if let Some(ratio) = request.injected_ratio {
        notes.push(format!(
            "an error-rate study: arm b's measured energy was divided by {ratio}, a known true ratio B/A on top of the policies' own"
        ));
    }
    if request.b.tick_ms != request.a.tick_ms {
        notes.push(format!(
            "arm b's spec ticks every {} ms; both arms ran on arm a's {} ms tick so that their epochs match",
            request.b.tick_ms, request.a.tick_ms
        ));
    }
    if request.a.objective != request.b.objective {
        notes.push(format!(
            "the arms' specs set different objectives; both arms were judged by arm {}'s",
            if judging_objective(request) == request.a.objective {
                "a"
            } else {
                "b"
            }
        ));
    }
    Ok((tick, notes))
}

/// The objective both arms are judged by: arm A's, unless only arm B's spec sets one (a
/// baseline without an objective must not wave a challenger's violations through).
pub fn judging_objective(request: &AbRequest) -> Objective {
    if request.a.objective == Objective::default() {
        request.b.objective
    } else {
        request.a.objective
    }
}

#[allow(clippy::too_many_arguments)]
fn finish(
    request: &AbRequest,
    mode: Mode,
    looker: Looker<'_>,
    epochs: Vec<EpochRecord>,
    timeline: Vec<TickPoint>,
    run_time_s: f64,
    interrupted: bool,
    meta: RunMeta,
    notes: Vec<String>,
    tick: Duration,
    replicated_span_s: Option<f64>,
) -> Result<AbOutcome, AbRunError> {
    let Some(last) = looker.looks.last().cloned() else {
        return Err(AbRunError::NoVerdict {
            pairs: looker.pairs.len(),
            needed: request.plan.looks().first().copied().unwrap_or(0),
        });
    };
    // Interrupted between looks: the last look stands, and it did not decide.
    let decision = looker.decided.unwrap_or(Decision::NoDifference);
    let arm_sums = |arm: Arm| {
        epochs
            .iter()
            .filter(|e| e.arm == arm)
            .fold((0u64, 0u64), |(v, t), e| {
                (v + e.measured.violation_ticks, t + e.measured.ticks)
            })
    };
    let (violation_ticks_a, _) = arm_sums(Arm::A);
    let (violation_ticks_b, _) = arm_sums(Arm::B);
    let mut notes = notes;
    if interrupted && looker.decided.is_none() {
        notes.push(format!(
            "interrupted after {} pairs: the verdict is the last look's ({} pairs), which did not decide",
            looker.pairs.len(),
            last.pairs
        ));
    }
    let gpu_difference = match mode {
        Mode::Crossover => super::gpu_difference(&epochs),
        Mode::Interleaved | Mode::Replicated => None,
    };
    let used = &looker.pairs[..last.pairs.min(looker.pairs.len())];
    Ok(AbOutcome {
        format_version: AB_FORMAT_VERSION,
        estimand: EstimandInfo::of(&request.schedule, tick, mode, replicated_span_s),
        spread: Spread::of(used, last.ratio_b_over_a),
        gpu_difference,
        a: ArmInfo::of(&request.a),
        b: ArmInfo::of(&request.b),
        mode,
        demand_reported: epochs.iter().any(|e| e.measured.served_fraction < 1.0) || meta.simulated,
        epochs,
        pairs: looker.pairs,
        ratio_b_over_a: last.ratio_b_over_a,
        ci_low: last.ci_low,
        ci_high: last.ci_high,
        confidence: last.confidence,
        decision,
        served_fraction_a: last.served_fraction_a,
        served_fraction_b: last.served_fraction_b,
        violation_ticks_a,
        violation_ticks_b,
        violation_rate_a: last.violation_rate_a,
        violation_rate_b: last.violation_rate_b,
        refused_because: last.refused_because.clone(),
        looks: looker.looks,
        objective: judging_objective(request),
        schedule: request.schedule,
        tick_ms: u64::try_from(tick.as_millis()).unwrap_or(u64::MAX),
        budget_pairs: request.plan.budget(),
        alpha: request.plan.alpha_at_look().iter().sum(),
        plan_looks: request.plan.looks().to_vec(),
        plan_alpha_at_look: request.plan.alpha_at_look().to_vec(),
        seed: request.seed,
        interrupted,
        run_time_s,
        meta,
        notes,
        timeline,
    })
}

/// A barrier for the crossover groups that a group can leave (its loop failed or ended):
/// the others are then released instead of waiting for ever.
struct Rendezvous {
    state: Mutex<RendezvousState>,
    turn: Condvar,
}

struct RendezvousState {
    members: usize,
    arrived: usize,
    generation: u64,
    /// The last round's result, for those who waited.
    outcome: Option<Result<bool, String>>,
}

/// Leaves the rendezvous when dropped.
struct Member<'a>(&'a Rendezvous);

impl Drop for Member<'_> {
    fn drop(&mut self) {
        let mut state = lock(&self.0.state);
        state.members = state.members.saturating_sub(1);
        self.0.turn.notify_all();
    }
}

impl Rendezvous {
    fn new(members: usize) -> Self {
        Self {
            state: Mutex::new(RendezvousState {
                members,
                arrived: 0,
                generation: 0,
                outcome: None,
            }),
            turn: Condvar::new(),
        }
    }

    fn member(&self) -> Member<'_> {
        Member(self)
    }

    /// Wait for every member still in; the last to arrive runs `fold` and everyone gets
    /// its result. A member that left ends the rendezvous: the rest stop (`Ok(true)`), and
    /// the run's outcome is the leaver's own: its error, or, when a signal stopped it, the
    /// partial result every group measured until then.
    fn meet(&self, fold: impl FnOnce() -> Result<bool, AbRunError>) -> Result<bool, AbRunError> {
        let mut state = lock(&self.state);
        let generation = state.generation;
        state.arrived += 1;
        if state.arrived >= state.members {
            let outcome = fold().map_err(|e| e.to_string());
            state.outcome = Some(outcome.clone());
            state.arrived = 0;
            state.generation += 1;
            self.turn.notify_all();
            return outcome.map_err(|reason| AbRunError::Loop { group: 0, reason });
        }
        loop {
            state = self.turn.wait(state).unwrap_or_else(|p| p.into_inner());
            if state.generation != generation {
                let outcome = state.outcome.clone().unwrap_or(Ok(true));
                return outcome.map_err(|reason| AbRunError::Loop { group: 0, reason });
            }
            if state.arrived >= state.members {
                // A member left while the others waited: nobody folds this block, and
                // the block, unfinished, counts for neither arm.
                state.arrived = state.arrived.saturating_sub(1);
                return Ok(true);
            }
        }
    }
}

#[cfg(test)]
mod rendezvous_tests {
    use super::*;

    /// A SIGINT reaches the GPU groups' loops at different ticks: one leaves while another
    /// waits at the epoch's end. The waiting one must stop, not fail the run.
    #[test]
    fn a_member_that_leaves_stops_the_one_waiting_without_an_error() {
        let rendezvous = Rendezvous::new(2);
        let leaving = rendezvous.member();
        std::thread::scope(|scope| {
            let waiting = scope.spawn(|| {
                let _member = rendezvous.member();
                rendezvous.meet(|| panic!("nobody folds a block one group left"))
            });
            // Leave only once the other is waiting inside `meet`.
            while lock(&rendezvous.state).arrived == 0 {
                std::thread::yield_now();
            }
            drop(leaving);
            let outcome = waiting.join().expect("no panic");
            assert!(matches!(outcome, Ok(true)), "{outcome:?}");
        });
    }
}
