//! One control loop driven through its epochs: each trajectory a fresh instance swapped in
//! from the device defaults, then cool-down, settling, warm-up and the measured window.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::time::Duration;

use super::outcome::{AbRequest, AbRunError, EpochRecord, Schedule, TickPoint};
use super::{judging_objective, trajectory_seed};
use crate::ab::stats::{Arm, ArmEpoch};
use tokwatt_agent::control::{Backends, ControlLoop, LoopCommand, LoopConfig, Progress};
use tokwatt_agent::recorder::Recorder;
use tokwatt_agent::swap::{PreparedPolicy, StateOnSwap, SwapSender, swap_channel};
use tokwatt_agent::{self as agent, AgentError, NodeFacts, plugin_search_path};
use tokwatt_core::types::{Objective, Settings};
use tokwatt_plugin::PluginHost;
use tokwatt_policy::envelope::Envelope;
use tokwatt_policy::spec::PolicySpec;
use tokwatt_policy::supervisor::Supervisor;

/// Both arms' specs on one node's facts, ready to be started and restarted.
pub(super) struct Arms {
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
    pub(super) fn new(
        request: &AbRequest,
        tick: Duration,
        node: NodeFacts,
    ) -> Result<Self, AbRunError> {
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
        let host =
            tokwatt_agent::plugin_host(request.cache_dir.clone()).map_err(AgentError::from)?;
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

    pub(super) fn index(arm: Arm) -> usize {
        match arm {
            Arm::A => 0,
            Arm::B => 1,
        }
    }

    pub(super) fn spec(&self, arm: Arm) -> &PolicySpec {
        &self.specs[Self::index(arm)]
    }

    /// A fresh instance of `arm` seeded with `seed`: its supervisor, first settings and
    /// envelope. An `init` that missed its wall-clock deadline (a busy machine) is tried
    /// again by [`agent::start_policy`] before the comparison gives up.
    pub(super) fn start(
        &self,
        arm: Arm,
        seed: u64,
    ) -> Result<(Supervisor, Vec<Settings>, Envelope), AbRunError> {
        let i = Self::index(arm);
        agent::start_policy(
            &self.host,
            &self.specs[i],
            &self.plugins[i],
            &self.node,
            seed,
            self.tick,
        )
        .map_err(|source| AbRunError::Arm {
            arm,
            policy: self.specs[i].name.clone(),
            source,
        })
    }

    /// Both arms must start before the first epoch: a broken arm is refused up front.
    pub(super) fn check_both_start(&self) -> Result<(), AbRunError> {
        self.start(Arm::A, self.seed)?;
        self.start(Arm::B, self.seed)?;
        Ok(())
    }

    /// A fresh instance of `arm` ready to take over at a tick boundary: no state, neither
    /// its own from an earlier epoch nor the outgoing policy's.
    pub(super) fn prepare(&self, arm: Arm, seed: u64) -> Result<PreparedPolicy, AbRunError> {
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
pub(super) enum Phase {
    Cooldown,
    Warmup,
    Measure,
}

/// Sums over a measured window.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Window {
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
pub(super) enum Flow {
    Continue,
    Stop,
}

/// Drives one control loop through its epochs from the loop's progress callback: swaps
/// the arms in, pauses for cool-downs, measures the windows and hands each finished epoch
/// to `on_epoch`.
pub(super) struct Driver<'a> {
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
    pub(super) fn on_tick(
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

    pub(super) fn finish(&mut self) {
        self.finished = true;
        self.stop.store(true, Ordering::Relaxed);
    }

    /// The phase ended at this tick: move on.
    pub(super) fn advance(
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

    pub(super) fn loop_gone(&self) -> AbRunError {
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
    pub(super) fn take_turn(&mut self, p: &Progress<'_>) -> Result<(), AbRunError> {
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

    pub(super) fn record(&mut self, p: &Progress<'_>) -> EpochRecord {
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
pub(super) fn drive_group(
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
                node_knobs: a.union(b),
                guard: tokwatt_policy::rules::NodeRules::judging().guard,
                power_allowance: None,
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
