//! The control loop: every tick, read each GPU's window, build the observations, ask the
//! policy (through its supervisor), pass the answer through the envelope, apply what
//! changes, and record everything. Simulated and real runs share every line of it: only
//! the backends and the clock differ.
//!
//! One file because `ControlLoop::tick` is the loop's one step, and observing, deciding,
//! applying and recording a tick share that tick's borrowed state; what separates cleanly
//! is already apart (the per-GPU steps and the host's own moves in `moves.rs`, what a run
//! adds up in `totals.rs`, swaps in `crate::swap`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant};

use crate::recorder::{InitRecord, Recorder, RecorderError, TickRecord};
use crate::swap::{InCharge, SwapPort, Swapper};
use tokwatt_core::actuator::Actuator;
use tokwatt_core::clock::Clock;
use tokwatt_core::telemetry::Telemetry;
use tokwatt_core::types::{InForce, Knobs, Objective, Observation, Settings, TelemetryWindow};
use tokwatt_core::workload::{FinishedRequests, Workload};
use tokwatt_policy::envelope::{Envelope, Guardrails, WorkloadLimits};
use tokwatt_policy::guard::{Decider, GuardConfig, GuardEvent, ObjectiveGuard};
use tokwatt_policy::supervisor::{DecisionSource, PolicyCounters, Supervisor};

mod allowance;
mod moves;
mod stall;
mod totals;

pub use allowance::PowerAllowance;
pub use allowance::{Fit, fit_caps};
pub use stall::{STALL_TICKS, stall_threshold};
use totals::RequestLatency;
pub use totals::{DemandTotals, GpuTotals, LoopTotals, RequestLatencyTotals, RequestsTotals};

/// The hardware and the clock a run drives. To have changed settings restored, wrap
/// the actuator in a [`crate::restore::SettingsGuard`]: it saves the originals before the
/// first change and puts them back when dropped (normal end, interrupt, or panic).
pub struct Backends {
    pub telemetry: Box<dyn Telemetry>,
    pub actuator: Box<dyn Actuator>,
    pub workload: Box<dyn Workload>,
    pub clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for Backends {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backends")
            .field("actuator", &self.actuator.name())
            .field("workload", &self.workload.name())
            .field("clock", &self.clock)
            .finish()
    }
}

#[derive(Debug, Clone)]
pub struct LoopConfig {
    pub duration: Duration,
    pub tick: Duration,
    /// The objective in force: the node's, narrowed by the policy's spec
    /// ([`tokwatt_policy::rules::NodeRules::narrow`]). A swap brings the new spec's.
    pub objective: Objective,
    /// The knobs the node's backends offer, whoever owns them: a knob the policy in charge
    /// does not own is held at the node's baseline (the settings found at the start), and
    /// the guard's fallback sets them all.
    pub node_knobs: Knobs,
    /// The node's guardrails, which bound the host's own moves (the guard's fallback, the
    /// return of a knob to the baseline) as a policy's envelope bounds the policy's.
    pub node_guardrails: Guardrails,
    /// The node's envelope as the caller checked it against the devices
    /// ([`tokwatt_policy::rules::NodeRules::envelope`], before any setting changed); `None`: the
    /// loop builds it from `node_guardrails`.
    pub node_envelope: Option<Envelope>,
    /// The objective guard ([`tokwatt_policy::guard`]).
    pub guard: GuardConfig,
    /// A ceiling on the sum of the node's power caps (a fleet's grant or reserve): every
    /// tick's caps are fitted within it, from the first settings on.
    pub power_allowance: Option<Arc<dyn PowerAllowance>>,
}

impl LoopConfig {
    /// A loop with the default node rules: every knob offered, the default cap step, the
    /// guard on.
    pub fn new(duration: Duration, tick: Duration, objective: Objective) -> Self {
        let rules = tokwatt_policy::rules::NodeRules::default();
        Self {
            duration,
            tick,
            objective,
            node_knobs: Knobs::all(),
            node_guardrails: rules.guardrails,
            node_envelope: None,
            guard: rules.guard,
            power_allowance: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("reading the workload on GPU {gpu} failed: {reason}")]
    Workload { gpu: u32, reason: String },
    #[error(transparent)]
    Recorder(#[from] RecorderError),
}

/// Progress, reported after every tick.
#[derive(Debug, Clone, Copy)]
pub struct Progress<'a> {
    pub tick: u64,
    pub ticks: u64,
    pub time: Duration,
    pub totals: &'a LoopTotals,
    pub observations: &'a [Observation],
    /// Each GPU's settings in force after this tick's changes (the observations show
    /// the window before them); power caps and clock locks as read back from the device.
    pub in_force: &'a [InForce],
    /// The policy in charge after this tick (a swap or a rollback may have changed it).
    pub policy: &'a str,
    /// What each GPU's policy asked for this tick, before the envelope (`None` while
    /// paused: nothing was asked).
    pub requested: &'a [Settings],
    /// Wall time of the policy's `decide` this tick (`None`: not called, e.g. paused, or
    /// a newly swapped-in policy's `init` decided).
    pub decide_time: Option<Duration>,
    /// How late the tick started against its schedule (wall clock or virtual clock).
    pub lateness: Duration,
    /// The loop holds the settings in force and does not consult the policy.
    pub paused: bool,
    /// A swapped-in policy is still on probation.
    pub on_probation: bool,
    /// The objective guard's fallback decided this tick, not the policy.
    pub guard_in_charge: bool,
    /// Whether the guard acts (else it only counts).
    pub guard_enabled: bool,
    /// The objective in force after this tick.
    pub objective: Objective,
    /// Operator commands carried out since the start (whoever sent one waits for this).
    pub commands_taken: u64,
}

/// An operator's command to a running loop, carried out at the next tick boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoopCommand {
    /// Hold the settings in force: the loop observes and records, the policy is not asked.
    Pause,
    /// Ask the policy again.
    Resume,
    /// Put every GPU back to its device defaults (default power cap, no clock lock, the
    /// batch size and token budget the run started with) and pause.
    RestoreDefaults,
}

/// The sending half of the loop's command channel.
pub type CommandSender = std::sync::mpsc::Sender<LoopCommand>;

pub struct ControlLoop {
    backends: Backends,
    supervisor: Supervisor,
    envelope: Envelope,
    config: LoopConfig,
    stop: Arc<AtomicBool>,
    swapper: Swapper,
    commands: Option<Receiver<LoopCommand>>,
    commands_taken: u64,
    paused: bool,
    /// Each GPU's batch size when the loop started (what "restore defaults" puts back).
    initial_batch: Vec<u32>,
    /// The start's `init` settings per GPU, until the first tick's records carry them.
    init_records: Vec<Option<InitRecord>>,
    in_force: Vec<InForce>,
    last_clamped: Vec<bool>,
    settling: Vec<bool>,
    last_telemetry: Vec<TelemetryWindow>,
    totals: LoopTotals,
    guard: ObjectiveGuard,
    /// Who decided the last tick (whose settings the next window shows).
    decided_by: Decider,
    /// The node's guardrails and knobs, for the host's own moves.
    node_envelope: Envelope,
    /// Each GPU's settings at the start: where a knob no policy owns is held.
    baseline: Vec<InForce>,
    /// Each GPU's device defaults: the guard's fallback.
    defaults: Vec<Settings>,
    /// How the workload knows work is waiting (for a throughput floor).
    work_waiting: tokwatt_core::workload::WorkWaiting,
    /// The in-charge supervisor's counters as last added to the run's totals.
    counters_seen: PolicyCounters,
    /// Where the run is in its schedule: fixed when the first tick starts.
    schedule: Option<Schedule>,
    /// The last tick's observations, one per GPU.
    observations: Vec<Observation>,
    /// What the policy asked for at the last tick, one per GPU (empty while paused).
    requested: Vec<Settings>,
    /// The ceiling on the sum of the node's caps (fleet mode), and each GPU's lowest cap.
    allowance: Option<Arc<dyn PowerAllowance>>,
    cap_min: Vec<f64>,
    /// Latencies of the requests finished so far, where the workload gives records.
    request_latency: Option<RequestLatency>,
    /// Each tick's finished requests (the buffer is reused).
    finished: FinishedRequests,
}

/// A run's schedule: tick `k` (from 0) is due at `start + slip + (k + 1) × tick`.
#[derive(Debug, Clone, Copy)]
struct Schedule {
    /// Wall time at the first tick's start, for the run's wall time.
    started: Instant,
    /// The run's clock at the first tick's start.
    start: Duration,
    /// Whole tick periods skipped after stalls (see `stall.rs`): the ticks a stall missed
    /// are not run back to back once it ends.
    slip: Duration,
    /// Ticks in the configured duration.
    ticks: u64,
    /// The tick the next call of [`ControlLoop::tick`] runs.
    next_tick: u64,
    /// Where the window the next tick observes began.
    window_start: Duration,
}

impl Schedule {
    /// When tick `tick` is due, with ticks `period` apart.
    fn due(&self, tick: u64, period: Duration) -> Duration {
        // In nanoseconds: `Duration * u32` would stop advancing after 2^32 ticks (497
        // days of `serve` at a 10 ms tick) and the loop would spin.
        let offset_ns = period.as_nanos().saturating_mul(u128::from(tick) + 1);
        self.start
            .saturating_add(self.slip)
            .saturating_add(Duration::from_nanos(
                u64::try_from(offset_ns).unwrap_or(u64::MAX),
            ))
    }
}

impl std::fmt::Debug for ControlLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlLoop")
            .field("backends", &self.backends)
            .field("supervisor", &self.supervisor)
            .field("in_force", &self.in_force)
            .finish_non_exhaustive()
    }
}

impl ControlLoop {
    /// Read the settings in force and apply the policy's first settings (from `init`)
    /// through the envelope.
    pub fn new(
        mut backends: Backends,
        supervisor: Supervisor,
        first_settings: &[Settings],
        envelope: Envelope,
        config: LoopConfig,
        stop: Arc<AtomicBool>,
    ) -> Self {
        let devices = backends.telemetry.devices();
        let mut in_force = Vec::with_capacity(devices.len());
        for device in &devices {
            let gpu = device.index;
            let read = backends.actuator.read(gpu);
            let (cap, requested, sm_max) = match read {
                Ok(s) => (
                    s.power_cap_enforced_w,
                    s.power_cap_w,
                    s.sm_clock_lock_mhz
                        .map_or(device.sm_clock_max_mhz(), |(_, hi)| hi),
                ),
                Err(e) => {
                    tracing::warn!(gpu, "cannot read the settings in force: {e}");
                    let default = device.power_cap_default_w;
                    (default, default, device.sm_clock_max_mhz())
                }
            };
            in_force.push(InForce {
                power_cap_w: cap,
                power_cap_requested_w: requested,
                sm_clock_max_mhz: sm_max,
                batch_size: backends.workload.batch_size(gpu),
                token_budget: backends.workload.token_budget(gpu).unwrap_or(0),
            });
        }
        let n = devices.len();
        let initial_batch: Vec<u32> = in_force.iter().map(|f| f.batch_size).collect();
        let indices: Vec<u32> = devices.iter().map(|d| d.index).collect();
        let workload_limits = WorkloadLimits::of(backends.workload.as_ref(), &indices);
        let node_envelope = match config.node_envelope.clone() {
            Some(checked) => Ok(checked),
            None => Envelope::for_workload(
                &devices,
                &workload_limits,
                &config.node_guardrails,
                config.node_knobs,
            ),
        }
        .unwrap_or_else(|error| {
            // Callers check the node's guardrails against the devices first
            // (`NodeRules::check`); were one to slip through, the device's own limits
            // still bound the host's moves.
            tracing::error!("the node's guardrails do not fit the devices ({error}); the host's own moves keep to the devices' limits");
            Envelope::for_workload(
                &devices,
                &workload_limits,
                &Guardrails::default(),
                config.node_knobs,
            )
            .unwrap_or_else(|_| envelope.clone())
        });
        let defaults = devices
            .iter()
            .zip(&in_force)
            .map(|(d, start)| Settings {
                power_cap_w: Some(d.power_cap_default_w),
                sm_clock_max_mhz: Some(d.sm_clock_max_mhz()),
                batch_size: Some(start.batch_size),
                // The workload's own budget, as it started (none where it has none).
                token_budget: (start.token_budget > 0).then_some(start.token_budget),
            })
            .collect();
        let baseline = in_force.clone();
        let guard = ObjectiveGuard::new(config.guard);
        let totals = LoopTotals {
            gpus: devices
                .iter()
                .map(|d| GpuTotals {
                    gpu: d.index,
                    ..GpuTotals::default()
                })
                .collect(),
            ..LoopTotals::default()
        };
        let work_waiting = backends.workload.work_waiting();
        let cap_min = devices.iter().map(|d| d.power_cap_min_w).collect();
        let mut this = Self {
            backends,
            supervisor,
            envelope,
            config,
            stop,
            swapper: Swapper::new(None),
            commands: None,
            commands_taken: 0,
            paused: false,
            initial_batch,
            init_records: vec![None; n],
            in_force,
            last_clamped: vec![false; n],
            settling: vec![false; n],
            last_telemetry: vec![TelemetryWindow::default(); n],
            totals,
            guard,
            decided_by: Decider::Policy,
            node_envelope,
            baseline,
            defaults,
            counters_seen: PolicyCounters::default(),
            work_waiting,
            schedule: None,
            observations: Vec::with_capacity(n),
            requested: Vec::with_capacity(n),
            allowance: None,
            cap_min,
            request_latency: None,
            finished: FinishedRequests::default(),
        };
        let mut first: Vec<Settings> = Vec::with_capacity(n);
        for (gpu, settings) in first_settings.iter().enumerate() {
            let applied = this
                .envelope
                .apply(gpu as u32, settings, &this.in_force[gpu]);
            this.last_clamped[gpu] = applied.clamped;
            first.push(applied.settings);
            if let Some(record) = this.init_records.get_mut(gpu) {
                *record = Some(InitRecord {
                    requested: *settings,
                    applied: applied.settings,
                    clamped: applied.clamped,
                });
            }
        }
        // Every GPU gets settings (none where `init` gave fewer), so the caps in force at
        // the start are fitted within the allowance too.
        first.resize(n, Settings::default());
        this.allowance = this.config.power_allowance.clone();
        this.apply_all(&mut first);
        // Whatever the first settings did, the first window starts now.
        for gpu in 0..n as u32 {
            let _ = this.backends.telemetry.read_window(gpu);
            let _ = this.backends.workload.read_window(gpu);
        }
        if this.backends.workload.reports_requests() {
            // Those that finished before the first window are not the run's.
            for gpu in 0..n as u32 {
                this.backends
                    .workload
                    .take_finished_requests(gpu, &mut this.finished);
            }
            this.finished.clear();
            this.request_latency = Some(RequestLatency::default());
        }
        this
    }

    /// Take new policies from `port` at tick boundaries (hot swap, see [`crate::swap`]).
    /// With the guard on, a swapped-in policy that breaks the objective in probation more
    /// often than the one it replaced is rolled back.
    pub fn with_swaps(mut self, port: SwapPort) -> Self {
        let guard = self.config.guard;
        self.swapper = Swapper::new(Some(port)).judge_objective(
            guard
                .enabled
                .then_some(u64::from(guard.probation_allowance_ticks)),
        );
        self
    }

    /// Take operator commands from `commands` at tick boundaries.
    pub fn with_commands(mut self, commands: Receiver<LoopCommand>) -> Self {
        self.commands = Some(commands);
        self
    }

    /// Carry out the commands waiting, in order.
    fn take_commands(&mut self) {
        let Some(commands) = &self.commands else {
            return;
        };
        let mut waiting = Vec::new();
        loop {
            match commands.try_recv() {
                Ok(command) => waiting.push(command),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.commands = None;
                    break;
                }
            }
        }
        for command in waiting {
            tracing::info!(?command, "operator command");
            self.commands_taken += 1;
            match command {
                LoopCommand::Pause => self.paused = true,
                LoopCommand::Resume => self.paused = false,
                LoopCommand::RestoreDefaults => {
                    self.paused = true;
                    self.restore_defaults();
                }
            }
        }
    }

    /// After a rollback: the settings the restored policy had in force when the failed one
    /// took over, on every knob the failed one moved, straight through the actuator (the
    /// restored policy resumes from its own settings, not from the failed policy's).
    fn put_back(&mut self, before: &[InForce]) {
        let mut settings: Vec<Settings> = self
            .in_force
            .iter()
            .zip(before)
            .map(|(now, then)| Settings {
                power_cap_w: (now.power_cap_requested_w != then.power_cap_requested_w)
                    .then_some(then.power_cap_requested_w),
                sm_clock_max_mhz: (now.sm_clock_max_mhz != then.sm_clock_max_mhz)
                    .then_some(then.sm_clock_max_mhz),
                batch_size: (now.batch_size != then.batch_size).then_some(then.batch_size),
                token_budget: (now.token_budget != then.token_budget).then_some(then.token_budget),
            })
            .collect();
        if settings.iter().any(|s| *s != Settings::default()) {
            tracing::info!(
                policy = self.supervisor.policy_name(),
                "rollback: the restored policy's settings are back in force"
            );
            self.apply_all(&mut settings);
        }
    }

    /// Device defaults on every GPU, straight through the actuator (the envelope limits
    /// steps a policy takes, not an operator's return to defaults).
    /// (Within the power allowance, where there is one: in fleet mode the defaults are
    /// fitted within the node's grant or reserve.)
    fn restore_defaults(&mut self) {
        let devices = self.backends.telemetry.devices();
        let mut settings = vec![Settings::default(); self.in_force.len()];
        for device in devices {
            let g = device.index as usize;
            let (Some(batch), Some(slot)) =
                (self.initial_batch.get(g).copied(), settings.get_mut(g))
            else {
                continue;
            };
            let budget = self.baseline.get(g).map_or(0, |start| start.token_budget);
            *slot = Settings {
                power_cap_w: Some(device.power_cap_default_w),
                sm_clock_max_mhz: Some(device.sm_clock_max_mhz()),
                batch_size: (self.in_force[g].batch_size != batch).then_some(batch),
                token_budget: (budget > 0 && self.in_force[g].token_budget != budget)
                    .then_some(budget),
            };
        }
        self.apply_all(&mut settings);
    }

    /// Run until the configured duration is over or `stop` is raised (between ticks),
    /// telling `progress` after every tick: [`Self::tick`] until it says the run is over,
    /// then [`Self::finish`].
    pub fn run(
        mut self,
        recorder: &mut Recorder,
        progress: &mut dyn FnMut(Progress<'_>),
    ) -> Result<(LoopTotals, Backends), ControlError> {
        while let Some(tick) = self.tick(recorder)? {
            progress(tick);
        }
        Ok(self.finish())
    }

    /// One control tick: wait until it is due, observe every GPU over the window since
    /// the last one, take operator commands and a waiting swap, ask the policy (or the
    /// guard's fallback), put the answer through the envelope, apply it and record it.
    /// A tick that finds the loop stalled (more than [`STALL_TICKS`] periods behind,
    /// before it observes or before it applies) first reads every GPU's settings back
    /// (`stall.rs`). `None` once the configured duration is over or `stop` was raised; the
    /// first call fixes the schedule. What it returns borrows the loop until the next call.
    pub fn tick(&mut self, recorder: &mut Recorder) -> Result<Option<Progress<'_>>, ControlError> {
        let tick_len = self.config.tick;
        let schedule = *self.schedule.get_or_insert_with(|| {
            let start = self.backends.clock.now();
            Schedule {
                started: Instant::now(),
                start,
                slip: Duration::ZERO,
                ticks: (self.config.duration.as_nanos() / tick_len.as_nanos().max(1)) as u64,
                next_tick: 0,
                window_start: start,
            }
        });
        let Schedule {
            start,
            ticks,
            next_tick: tick,
            window_start,
            ..
        } = schedule;
        if tick >= ticks {
            return Ok(None);
        }
        if self.stop.load(Ordering::Relaxed) {
            self.totals.interrupted = true;
            return Ok(None);
        }
        let n = self.in_force.len();
        let deadline = schedule.due(tick, tick_len);
        self.backends.clock.sleep_until(deadline);
        let now = self.backends.clock.now();
        let lateness = now.saturating_sub(deadline);
        let interval = now.saturating_sub(window_start);
        if let Some(schedule) = &mut self.schedule {
            schedule.next_tick = tick + 1;
            schedule.window_start = now;
        }
        // Before anything reads what the loop knows of the GPUs' settings (an operator's
        // command, the observations, the status and metrics they feed): after a stall,
        // what it knows is as old as the stall, and something else (a fence) may have
        // changed the driver meanwhile.
        if lateness > stall_threshold(tick_len) {
            self.after_stall(lateness, now, stall::StallAt::BeforeTick);
        }
        self.take_commands();

        let mut observations = Vec::with_capacity(n);
        for gpu in 0..n as u32 {
            let t = self.read_telemetry(gpu);
            let w =
                self.backends
                    .workload
                    .read_window(gpu)
                    .map_err(|e| ControlError::Workload {
                        gpu,
                        reason: e.to_string(),
                    })?;
            observations.push(self.observe(gpu, tick, interval, &t, &w));
        }

        // The window just observed shows the settings of whoever decided the last
        // tick: the guard charges its violations to them.
        // Judged by the objective in force over that window (a swap at this boundary
        // brings the next one).
        let violations: Vec<bool> = observations
            .iter()
            .map(|o| {
                self.config
                    .objective
                    .violated_by_waiting(o, self.work_waiting)
            })
            .collect();
        let window_violated = violations.contains(&true);
        let decided_last = self.decided_by;
        if let Some(GuardEvent::TookOver { ticks }) =
            self.guard.observe(tick, window_violated, decided_last)
        {
            tracing::warn!(
                policy = self.supervisor.policy_name(),
                tick,
                ticks,
                "objective guard: the device defaults decide until the policy's back-off ends"
            );
        }

        // A policy waiting to take over does so here, at the boundary: its `init`
        // settings decide this tick, so no tick goes undecided. (A swap that arrives
        // while the loop is paused is refused.)
        let mut decide_time = None;
        let swapped_in = if self.paused {
            self.swapper.refuse_while_paused(tick);
            None
        } else {
            self.swapper.take_over(
                tick,
                InCharge {
                    supervisor: &mut self.supervisor,
                    envelope: &mut self.envelope,
                    objective: &mut self.config.objective,
                },
                &self.in_force,
            )
        };
        if swapped_in.is_some() {
            // An operator's new policy gets its own chance: the guard stands down.
            self.guard.policy_swapped();
            // Its supervisor counts afresh, its `init` included.
            self.counters_seen = PolicyCounters::default();
        }
        let guard_in_charge = !self.paused && self.guard.in_charge();
        let decision = match swapped_in {
            _ if self.paused || guard_in_charge => tokwatt_policy::supervisor::Decision {
                settings: vec![Settings::default(); n],
                source: DecisionSource::Policy,
            },
            Some(first) if first.len() == n => tokwatt_policy::supervisor::Decision {
                settings: first,
                source: DecisionSource::Policy,
            },
            _ => {
                let called = Instant::now();
                let decision = self.supervisor.decide(tick, now - start, &observations);
                decide_time = Some(called.elapsed());
                decision
            }
        };
        self.count_policy_calls();
        // The supervisor's fallback (a failing policy); the guard's ticks are its own.
        let fallback = !guard_in_charge && !matches!(decision.source, DecisionSource::Policy);
        let policy_name = self.supervisor.policy_name().to_owned();
        let mut any_violation = false;
        let mut any_tpot_unknown = false;
        // First every GPU's settings, then all applied at once (the caps fitted within
        // the node's allowance, falling ones first), then each GPU's record.
        let mut applied = self.settle(&decision.settings, &observations, guard_in_charge);
        // A stall inside this tick, between its reads and its changes (the process stopped
        // while the policy decided): the settings were worked out from what the loop knew
        // before it, so they are read back and worked out again before any is applied.
        let acting = self.backends.clock.now();
        let before_acting = acting.saturating_sub(now);
        if before_acting > stall_threshold(tick_len) {
            self.after_stall(before_acting, acting, stall::StallAt::WithinTick);
            // The tick reports (records, status, metrics) what it read back, not what it
            // had read before the stall; the policy has decided on the window already.
            for (observation, in_force) in observations.iter_mut().zip(&self.in_force) {
                observation.in_force = *in_force;
            }
            applied = self.settle(&decision.settings, &observations, guard_in_charge);
        }
        let mut clamped = Vec::with_capacity(n);
        let mut settings = Vec::with_capacity(n);
        for (gpu, applied) in applied.into_iter().enumerate() {
            self.last_clamped[gpu] = applied.clamped;
            self.totals.clamped_decisions += u64::from(applied.clamped);
            self.totals.non_finite_values += u64::from(applied.non_finite);
            clamped.push(applied.clamped);
            settings.push(applied.settings);
        }
        self.apply_all(&mut settings);
        for (gpu, obs) in observations.iter().enumerate() {
            let requested = decision.settings.get(gpu).copied().unwrap_or_default();

            let violation = violations[gpu];
            any_violation |= violation;
            any_tpot_unknown |= self.config.objective.tpot_unknown(obs);
            let gpu_totals = &mut self.totals.gpus[gpu];
            // Saturating: a token source that lies cannot overflow the totals.
            gpu_totals.tokens = gpu_totals.tokens.saturating_add(obs.tokens);
            gpu_totals.energy_j += obs.energy_j;
            gpu_totals.slo_violation_ticks += u64::from(violation);
            if let Some(window) = &obs.demand {
                gpu_totals
                    .demand
                    .get_or_insert_with(DemandTotals::default)
                    .add(window, obs.tokens);
            }
            if let Some(window) = &obs.requests {
                gpu_totals
                    .requests
                    .get_or_insert_with(RequestsTotals::default)
                    .add(window);
            }
            self.totals.tokens = self.totals.tokens.saturating_add(obs.tokens);
            self.totals.energy_j += obs.energy_j;

            recorder.record(&TickRecord {
                time_s: (now - start).as_secs_f64(),
                policy: policy_name.clone(),
                observation: *obs,
                requested,
                applied: settings[gpu],
                in_force_after: self.in_force[gpu],
                fallback,
                clamped: clamped[gpu],
                guard: guard_in_charge,
                slo_violation: violation,
                energy_counter_j: self.last_telemetry[gpu].energy_counter_j,
                power_mem_avg_w: self.last_telemetry[gpu].power_mem_avg_w,
                init: self.init_records.get_mut(gpu).and_then(Option::take),
            })?;
        }
        if let Some(latency) = self.request_latency.as_mut() {
            for gpu in 0..n as u32 {
                self.finished.clear();
                self.backends
                    .workload
                    .take_finished_requests(gpu, &mut self.finished);
                recorder.record_requests(gpu, &self.finished.records)?;
                latency.add(&self.finished);
            }
            self.totals.request_latency = Some(RequestLatencyTotals {
                requests_not_written: recorder.requests_not_written(),
                ..latency.totals()
            });
        }
        recorder.end_tick()?;
        if !self.paused && !guard_in_charge {
            let rolled_back = self.swapper.judge(
                tick,
                fallback,
                window_violated && decided_last == Decider::Policy,
                InCharge {
                    supervisor: &mut self.supervisor,
                    envelope: &mut self.envelope,
                    objective: &mut self.config.objective,
                },
            );
            if let Some(before) = rolled_back {
                self.guard.policy_swapped();
                // The one brought back had its counts added while it was in charge.
                self.counters_seen = self.supervisor.counters();
                self.put_back(&before);
            }
        }
        if guard_in_charge {
            self.guard.count_takeover_tick();
        }
        self.decided_by = if self.paused {
            Decider::Operator
        } else if guard_in_charge {
            Decider::Guard
        } else {
            Decider::Policy
        };
        self.totals.guard = self.guard.counters.clone();
        self.totals.swaps = self.swapper.counters.clone();
        self.totals.ticks += 1;
        self.totals.slo_violation_ticks += u64::from(any_violation);
        self.totals.tpot_unknown_ticks += u64::from(any_tpot_unknown);
        self.totals.duration_s = (now - start).as_secs_f64();
        // Counted here rather than read from the supervisor, which a swap replaces.
        self.totals.fallback_ticks += u64::from(fallback);
        // Per tick, for a checkpoint's summary; a new String only when it changed.
        if self.totals.policy_at_end != self.supervisor.policy_name() {
            self.totals.policy_at_end = self.supervisor.policy_name().to_owned();
        }
        self.requested = if self.paused {
            Vec::new()
        } else {
            decision.settings
        };
        self.observations = observations;
        Ok(Some(Progress {
            tick,
            ticks,
            time: now - start,
            totals: &self.totals,
            observations: &self.observations,
            in_force: &self.in_force,
            policy: self.supervisor.policy_name(),
            requested: &self.requested,
            decide_time,
            lateness,
            paused: self.paused,
            on_probation: self.swapper.on_probation(),
            guard_in_charge,
            guard_enabled: self.config.guard.enabled,
            objective: self.config.objective,
            commands_taken: self.commands_taken,
        }))
    }

    /// The run's totals and its backends once it is over (dropping the backends puts
    /// every changed setting back).
    pub fn finish(mut self) -> (LoopTotals, Backends) {
        self.count_policy_calls();
        self.totals.policy_at_end = self.supervisor.policy_name().to_owned();
        self.totals.tokens_per_joule = ratio(self.totals.tokens, self.totals.energy_j);
        for (gpu, totals) in self.totals.gpus.iter_mut().enumerate() {
            totals.tokens_per_joule = ratio(totals.tokens, totals.energy_j);
            totals.final_settings = Some(self.in_force[gpu]);
        }
        self.totals.demand =
            self.totals
                .gpus
                .iter()
                .filter_map(|g| g.demand)
                .reduce(|mut all, one| {
                    all.merge(&one);
                    all
                });
        self.totals.requests =
            self.totals
                .gpus
                .iter()
                .filter_map(|g| g.requests)
                .reduce(|mut all, one| {
                    all.sum(&one);
                    all
                });
        self.totals.wall_time_s = self
            .schedule
            .map_or(0.0, |schedule| schedule.started.elapsed().as_secs_f64());
        (self.totals, self.backends)
    }

    /// Add what the in-charge supervisor counted since last time to the run's totals:
    /// every tick, so that the status and /metrics see traps and ejections as they
    /// happen, and before a rollback replaces it.
    fn count_policy_calls(&mut self) {
        let now = self.supervisor.counters();
        self.totals
            .policy_counters
            .add_since(&now, &self.counters_seen);
        self.totals.plugin_traps = self.totals.policy_counters.plugin_traps();
        self.counters_seen = now;
    }
}

fn ratio(tokens: u64, energy_j: f64) -> f64 {
    if energy_j > 0.0 {
        tokens as f64 / energy_j
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests;
