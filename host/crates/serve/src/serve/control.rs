//! [`ServeControl`]: what the API's requests do to a running agent. Every action either
//! takes effect at a tick boundary (and returns once it has) or changes nothing and says
//! why.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::mpsc::{RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use super::live::Live;
use crate::api::{
    ActionOutcome, Control, ControlError, Failures, NodeStatus, PolicyStatus, SwapRequest,
};
use crate::metrics::AgentMetrics;
use tokwatt_agent::assembly::{Offered, Withheld, grant_knobs};
use tokwatt_agent::control::{LoopCommand, Progress};
use tokwatt_agent::swap::{StateOnSwap, SwapEvent, SwapSender};
use tokwatt_agent::{self as agent, NodeFacts};
use tokwatt_plugin::PluginHost;
use tokwatt_policy::in_force::{ObjectiveInForce, RulesSource};
use tokwatt_policy::spec::PolicySpec;

/// A spec checked for this node, its plugin, and the objective it would be held to.
type LoadedSpec = (PolicySpec, PathBuf, ObjectiveInForce);

/// Policies a rollback can go back through.
const HISTORY: usize = 16;
/// The longest text of a failure kept for the status.
const FAILURE_TEXT_MAX: usize = 512;
/// The simulator's workload name (its `Workload::name`): the one workload whose windows
/// carry the demand they faced.
const SIM_WORKLOAD: &str = "sim";

/// A policy the agent has run, enough to start it again.
#[derive(Debug, Clone)]
pub(super) struct PolicyRecord {
    pub spec: PolicySpec,
    pub plugin: PathBuf,
    pub version: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SwapKind {
    /// A new policy: the one it replaces goes onto the history.
    Forward,
    /// The last policy of the history comes back.
    Back,
}

/// Which policy is in charge and which came before, kept in step with the loop's swap
/// counters (the loop swaps; the book only follows).
#[derive(Debug)]
struct Book {
    current: PolicyRecord,
    since_tick: u64,
    history: Vec<PolicyRecord>,
    /// Sent to the loop, not yet in charge, in the order sent: the loop takes them in
    /// that order, one a tick. More than one waits only after a swap timed out (its
    /// handler answered, its policy still queued) and another followed.
    pending: VecDeque<(PolicyRecord, SwapKind)>,
    /// In charge, on probation: the one it replaced and how it came in.
    probation: Option<(PolicyRecord, SwapKind)>,
    /// Take-overs seen: swaps and operator rollbacks (each takes the next pending one).
    seen_takeovers: u64,
    seen_rollbacks: u64,
    swaps_refused: u64,
    last_failure: Option<String>,
}

impl Book {
    /// The first policy in charge, nothing before it.
    fn new(first: PolicyRecord) -> Self {
        Self {
            current: first,
            since_tick: 0,
            history: Vec::new(),
            pending: VecDeque::new(),
            probation: None,
            seen_takeovers: 0,
            seen_rollbacks: 0,
            swaps_refused: 0,
            last_failure: None,
        }
    }

    /// Follow the loop's counters after a tick.
    fn follow(&mut self, progress: &Progress<'_>) {
        let counters = &progress.totals.swaps;
        let takeovers = counters.swaps + counters.operator_rollbacks;
        if takeovers > self.seen_takeovers {
            self.seen_takeovers = takeovers;
            if let Some((next, kind)) = self.pending.pop_front() {
                let replaced = std::mem::replace(&mut self.current, next);
                match kind {
                    SwapKind::Forward => {
                        self.history.push(replaced.clone());
                        if self.history.len() > HISTORY {
                            self.history.remove(0);
                        }
                    }
                    SwapKind::Back => {
                        self.history.pop();
                    }
                }
                self.probation = Some((replaced, kind));
                self.since_tick = progress.tick;
            }
        }
        if counters.rollbacks > self.seen_rollbacks {
            self.seen_rollbacks = counters.rollbacks;
            if let Some((previous, kind)) = self.probation.take() {
                let failed = std::mem::replace(&mut self.current, previous);
                match kind {
                    SwapKind::Forward => {
                        self.history.pop();
                    }
                    SwapKind::Back => self.history.push(failed.clone()),
                }
                self.since_tick = progress.tick;
                self.last_failure = Some(format!(
                    "policy `{}` (version {}) failed in its probation at tick {}; `{}` is back",
                    failed.spec.name, failed.version, progress.tick, self.current.spec.name
                ));
            }
        }
        if !progress.on_probation {
            self.probation = None;
        }
    }

    fn refused(&mut self, why: &str) {
        self.swaps_refused += 1;
        self.last_failure = Some(tokwatt_plugin::sanitize_text(why, FAILURE_TEXT_MAX));
    }
}

/// What [`ServeControl`] is built from.
#[derive(Debug)]
pub(super) struct Parts {
    pub live: Arc<Live>,
    pub host: Arc<PluginHost>,
    pub node: NodeFacts,
    pub offered: Offered,
    pub not_permitted: Vec<Withheld>,
    pub plugin_dirs: Vec<PathBuf>,
    pub seed: u64,
    pub tick: Duration,
    pub probation_ticks: u64,
    pub swaps: SwapSender,
    pub commands: Sender<LoopCommand>,
    pub first: PolicyRecord,
    /// The node's rules, which every swapped-in spec may only narrow.
    pub rules: tokwatt_policy::rules::NodeRules,
    /// Where they come from (the serve config): for the refusal of a spec loosening them,
    /// and the objective in force said at each swap.
    pub rules_source: RulesSource,
    /// The node is in a power domain: /metrics carries the fleet's series.
    pub fleet: bool,
}

/// The running agent, as the API sees it.
#[derive(Debug)]
pub struct ServeControl {
    live: Arc<Live>,
    metrics: AgentMetrics,
    host: Arc<PluginHost>,
    node: NodeFacts,
    offered: Offered,
    not_permitted: Vec<Withheld>,
    plugin_dirs: Vec<PathBuf>,
    seed: u64,
    tick: Duration,
    probation_ticks: u64,
    rules: tokwatt_policy::rules::NodeRules,
    rules_source: RulesSource,
    swaps: Mutex<SwapSender>,
    commands: Mutex<CommandLine>,
    book: Mutex<Book>,
    /// One swap or rollback at a time, start to finish.
    swapping: Mutex<()>,
    /// The last ticks' lateness, for the status and the benchmark.
    lateness: Mutex<std::collections::VecDeque<Duration>>,
}

#[derive(Debug)]
struct CommandLine {
    sender: Sender<LoopCommand>,
    sent: u64,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ServeControl {
    /// The fleet link's state after an exchange, for /metrics.
    pub(super) fn observe_fleet(&self, reading: &crate::metrics::FleetReading) {
        self.metrics.observe_fleet(reading);
    }

    /// The node's place in its power domain as of this tick, for the status.
    pub(super) fn observe_fleet_status(&self, fleet: crate::api::FleetStatus) {
        self.live.lock().status.fleet = Some(fleet);
    }

    pub(super) fn observe_allowance(&self, allowance: tokwatt_fleet::Allowance) {
        self.metrics.observe_allowance(
            allowance.watts(),
            matches!(allowance, tokwatt_fleet::Allowance::Granted(_)),
        );
    }

    pub(super) fn new(parts: Parts) -> Self {
        let status = parts.live.status();
        let mut metrics = AgentMetrics::new(
            &parts.node.devices,
            status.simulated,
            status.actuator == tokwatt_core::actuator::DryRun::NAME,
        );
        if status.workload == tokwatt_engines::prometheus::WORKLOAD_NAME {
            metrics = metrics.with_engine_batch();
        }
        if parts.fleet {
            metrics = metrics.with_fleet();
        }
        // The simulator knows what each request asked for; other workloads do not.
        if status.workload == SIM_WORKLOAD {
            metrics = metrics.with_demand();
        }
        metrics.announce(&parts.first.spec.name, &parts.first.version);
        // Before the first tick, the status already names the policy.
        parts.live.lock().status.policy = PolicyStatus {
            name: parts.first.spec.name.clone(),
            version: parts.first.version.clone(),
            spec: parts.first.spec.path.clone(),
            plugin: parts.first.plugin.clone(),
            ..PolicyStatus::default()
        };
        Self {
            live: parts.live,
            metrics,
            host: parts.host,
            node: parts.node,
            offered: parts.offered,
            not_permitted: parts.not_permitted,
            plugin_dirs: parts.plugin_dirs,
            seed: parts.seed,
            tick: parts.tick,
            probation_ticks: parts.probation_ticks,
            rules: parts.rules,
            rules_source: parts.rules_source,
            swaps: Mutex::new(parts.swaps),
            commands: Mutex::new(CommandLine {
                sender: parts.commands,
                sent: 0,
            }),
            book: Mutex::new(Book::new(parts.first)),
            swapping: Mutex::new(()),
            lateness: Mutex::new(std::collections::VecDeque::with_capacity(
                super::LATENESS_WINDOW,
            )),
        }
    }

    /// The lateness of the last [`super::LATENESS_WINDOW`] ticks, oldest first.
    pub fn recent_lateness(&self) -> Vec<Duration> {
        lock(&self.lateness).iter().copied().collect()
    }

    /// Keep this tick's lateness; the p99 over the window.
    fn note_lateness(&self, lateness: Duration) -> f64 {
        let mut recent = lock(&self.lateness);
        if recent.len() == super::LATENESS_WINDOW {
            recent.pop_front();
        }
        recent.push_back(lateness);
        let mut ms: Vec<f64> = recent.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
        tokwatt_core::quantile::nearest_rank(&mut ms, 0.99).unwrap_or(0.0)
    }

    /// After every tick, on the loop's thread: the book follows the swaps, and the
    /// status and the metrics take the tick.
    pub(super) fn observe(&self, progress: &Progress<'_>) {
        let (policy, failures_refused, last_failure) = {
            let mut book = lock(&self.book);
            book.follow(progress);
            let policy = PolicyStatus {
                name: book.current.spec.name.clone(),
                version: book.current.version.clone(),
                spec: book.current.spec.path.clone(),
                plugin: book.current.plugin.clone(),
                ticks_in_charge: progress.tick.saturating_sub(book.since_tick) + 1,
                on_probation: progress.on_probation,
                previous: book.history.last().map(|p| p.spec.name.clone()),
                swaps: progress.totals.swaps.swaps,
                rollbacks: progress.totals.swaps.rollbacks,
                operator_rollbacks: progress.totals.swaps.operator_rollbacks,
                state_carried: progress.totals.swaps.state_carried,
                started_fresh: progress.totals.swaps.started_fresh,
            };
            (policy, book.swaps_refused, book.last_failure.clone())
        };
        self.metrics.observe(progress, &policy.version);
        let lateness_p99_ms = self.note_lateness(progress.lateness);
        let totals = progress.totals;
        let mut live = self.live.lock();
        live.commands_taken = progress.commands_taken;
        let status = &mut live.status;
        status.ticks = progress.tick + 1;
        status.uptime_s = self.live.started.elapsed().as_secs_f64();
        status.paused = progress.paused;
        status.tick_lateness_p99_ms = Some(lateness_p99_ms);
        status.policy = policy;
        status.failures = Failures {
            fallback_ticks: totals.fallback_ticks,
            plugin_traps: totals.plugin_traps,
            ejections: totals.policy_counters.ejections,
            actuator_errors: totals.actuator_errors,
            telemetry_errors: totals.telemetry_errors,
            slo_violation_ticks: totals.slo_violation_ticks,
            tpot_unknown_ticks: totals.tpot_unknown_ticks,
            swaps_refused: failures_refused,
            last: last_failure,
        };
        status.guard = crate::api::GuardStatus {
            objective: progress.objective,
            enabled: progress.guard_enabled,
            in_charge: progress.guard_in_charge,
            policy_violation_ticks: totals.guard.policy_violation_ticks,
            takeovers: totals.guard.takeovers,
            unservable_takeovers: totals.guard.unservable_takeovers,
            takeover_ticks: totals.guard.takeover_ticks,
            objective_rollbacks: totals.swaps.objective_rollbacks,
        };
        for (gpu, observation) in status.gpus.iter_mut().zip(progress.observations) {
            let run = totals.gpus.get(gpu.gpu as usize);
            gpu.in_force = observation.in_force;
            gpu.last_tokens_per_joule =
                (observation.energy_j > 0.0).then_some(observation.tokens_per_joule);
            gpu.last_power_w = Some(observation.power_avg_w);
            gpu.last_tokens_per_s = Some(observation.tokens_per_s);
            gpu.last_tpot_p99_ms = observation
                .tpot_p99_ms
                .is_finite()
                .then_some(observation.tpot_p99_ms)
                .filter(|_| observation.tokens > 0);
            gpu.temperature_c = Some(observation.temperature_c);
            gpu.clock_events = observation.clock_events;
            if let Some(run) = run {
                gpu.tokens = run.tokens;
                gpu.energy_j = run.energy_j;
                gpu.tokens_per_joule = if run.energy_j > 0.0 {
                    run.tokens as f64 / run.energy_j
                } else {
                    0.0
                };
                gpu.slo_violation_ticks = run.slo_violation_ticks;
            }
        }
        status.node = Some(crate::api::NodeTotals::of(&status.gpus));
        drop(live);
        self.live.notify();
    }

    /// How long to wait for the loop to carry something out: a few ticks, and never less
    /// than a few seconds (a slow tick, a slow plugin call).
    fn patience(&self) -> Duration {
        (self.tick * 3).max(Duration::from_secs(5))
    }

    /// Load and check a policy spec for this node: the loop's tick, the knobs the node
    /// offers, the privileges this process has.
    fn load_spec(&self, request: &SwapRequest) -> Result<LoadedSpec, ControlError> {
        let spec = PolicySpec::load(&request.spec).map_err(|e| {
            // The caller hears what is wrong, never the file's text; the log has it all.
            tracing::warn!("swap refused: {e}");
            ControlError::BadRequest(e.without_contents())
        })?;
        // The node's objective and guardrails are the operator's: the spec may narrow them.
        let (mut spec, objective_in_force) = self
            .rules
            .narrow_in_force(&spec, &self.rules_source)
            .map_err(|e| ControlError::BadRequest(e.to_string()))?;
        if u64::from(spec.tick_ms) != self.tick.as_millis() as u64 {
            tracing::info!(
                policy = %spec.name,
                "the spec's tick ({} ms) gives way to the running loop's ({} ms)",
                spec.tick_ms,
                self.tick.as_millis()
            );
            spec.override_tick(self.tick)
                .map_err(|e| ControlError::BadRequest(e.to_string()))?;
        }
        let (knobs, withheld) = grant_knobs(spec.knobs, &self.offered);
        for w in &withheld {
            tracing::warn!(policy = %spec.name, "{w}");
        }
        let denied: Vec<String> = self
            .not_permitted
            .iter()
            .filter(|w| match w.knob {
                "power-cap" => knobs.power_cap,
                "sm-clock" => knobs.sm_clock,
                _ => false,
            })
            .map(|w| format!("the {} knob ({})", w.knob, w.reason))
            .collect();
        if !denied.is_empty() {
            return Err(ControlError::BadRequest(format!(
                "policy `{}` may change {}, but this agent may not: run the agent as root or with CAP_SYS_ADMIN, or drop those knobs from the spec",
                spec.name,
                denied.join(" and ")
            )));
        }
        spec.knobs = knobs;
        let plugin = match &request.plugin {
            Some(path) => {
                if !path.is_file() {
                    let what = if path.exists() {
                        "is not a regular file (a folder, a pipe or a device)"
                    } else {
                        "does not exist"
                    };
                    return Err(ControlError::BadRequest(format!(
                        "plugin {} {what}: give the path of a built component (.wasm) on the agent's machine",
                        path.display()
                    )));
                }
                path.clone()
            }
            None => spec
                .resolve_plugin(&agent::plugin_search_path(&self.plugin_dirs))
                .map_err(|e| ControlError::BadRequest(e.to_string()))?,
        };
        Ok((spec, plugin, objective_in_force))
    }

    /// Start `record` off the loop and hand it over; wait until it is in charge.
    fn hand_over(
        &self,
        record: PolicyRecord,
        kind: SwapKind,
        state: StateOnSwap,
    ) -> Result<ActionOutcome, ControlError> {
        if self.live.status().paused {
            return Err(ControlError::Conflict(
                "the agent is paused: resume it first (`tokwatt policy resume`), then swap".into(),
            ));
        }
        let mut prepared = agent::prepare_policy(
            &self.host,
            &record.spec,
            &record.plugin,
            &self.node,
            self.seed,
            self.tick,
        )
        .map_err(|e| {
            let why = format!("policy `{}` was not swapped in: {e}", record.spec.name);
            lock(&self.book).refused(&why);
            self.metrics.swap_refused();
            ControlError::BadRequest(why)
        })?;
        // Its series exist at zero before its first tick (increase() then counts it all).
        self.metrics.announce(&record.spec.name, &record.version);
        let (notify, events) = std::sync::mpsc::channel();
        prepared.notify = Some(notify);
        prepared.probation_ticks = self.probation_ticks;
        prepared.operator_rollback = matches!(kind, SwapKind::Back);
        prepared.state = state;
        let name = record.spec.name.clone();
        let version = record.version.clone();
        lock(&self.book).pending.push_back((record, kind));
        if lock(&self.swaps).send(prepared).is_err() {
            lock(&self.book).pending.pop_back();
            return Err(ControlError::Unavailable(
                "the control loop has ended; nothing was swapped".into(),
            ));
        }
        match events.recv_timeout(self.patience()) {
            Ok(SwapEvent::TookOver {
                tick,
                state_carried,
            }) => {
                // The status shows the new policy once the tick's progress is in.
                self.live
                    .wait_until(self.patience(), |state| state.status.ticks > tick);
                Ok(ActionOutcome {
                    message: format!(
                        "policy `{name}` (version {version}) took over at tick {tick}{}; on probation for {} ticks",
                        if state_carried {
                            " with the previous policy's state"
                        } else {
                            ", starting fresh"
                        },
                        self.probation_ticks
                    ),
                    tick,
                    policy: name,
                    state_carried: Some(state_carried),
                })
            }
            Ok(SwapEvent::RefusedWhilePaused { .. }) => {
                // The paused loop dropped everything queued, this one and any earlier.
                lock(&self.book).pending.clear();
                Err(ControlError::Conflict(format!(
                    "the agent was paused while policy `{name}` was being prepared, so it was not swapped in: resume the agent (`tokwatt policy resume`), then swap again"
                )))
            }
            Ok(other) => Err(ControlError::Conflict(format!(
                "policy `{name}`: unexpected swap event {other:?}"
            ))),
            Err(RecvTimeoutError::Timeout) => Err(ControlError::Unavailable(format!(
                "policy `{name}` is queued but the loop reached no tick boundary within {:?}; it takes over at the next one",
                self.patience()
            ))),
            Err(RecvTimeoutError::Disconnected) => Err(ControlError::Unavailable(
                "the control loop ended before the swap".into(),
            )),
        }
    }

    /// Send a command and wait until the loop has carried it out.
    fn command(&self, command: LoopCommand, done: &str) -> Result<ActionOutcome, ControlError> {
        let target = {
            let mut line = lock(&self.commands);
            line.sender
                .send(command)
                .map_err(|_| ControlError::Unavailable("the control loop has ended".into()))?;
            line.sent += 1;
            line.sent
        };
        if !self
            .live
            .wait_until(self.patience(), |state| state.commands_taken >= target)
        {
            return Err(ControlError::Unavailable(format!(
                "the loop reached no tick boundary within {:?}; the command is carried out at the next one",
                self.patience()
            )));
        }
        let status = self.live.status();
        Ok(ActionOutcome {
            message: done.to_owned(),
            tick: status.ticks.saturating_sub(1),
            policy: status.policy.name,
            state_carried: None,
        })
    }
}

impl ServeControl {
    /// A watched folder that could not be swapped in (no spec, two specs).
    pub(super) fn refused_from_watch(&self, why: &str) {
        lock(&self.book).refused(why);
        self.metrics.swap_refused();
    }
}

impl Control for ServeControl {
    fn status(&self) -> NodeStatus {
        let mut status = self.live.status();
        // Refusals happen off the loop: current as of now, not as of the last tick.
        let book = lock(&self.book);
        status.failures.swaps_refused = book.swaps_refused;
        status.failures.last.clone_from(&book.last_failure);
        status
    }

    fn metrics(&self) -> String {
        self.metrics.encode()
    }

    fn swap(&self, request: &SwapRequest) -> Result<ActionOutcome, ControlError> {
        let _one = lock(&self.swapping);
        let refused = |e: &ControlError| {
            lock(&self.book).refused(&e.to_string());
            self.metrics.swap_refused();
        };
        let (spec, plugin, objective_in_force) = self.load_spec(request).inspect_err(refused)?;
        let version = super::plugin_version(&plugin)
            .map_err(|e| ControlError::BadRequest(e.to_string()))
            .inspect_err(refused)?;
        let name = spec.name.clone();
        let outcome = self.hand_over(
            PolicyRecord {
                spec,
                plugin,
                version,
            },
            SwapKind::Forward,
            if request.fresh {
                StateOnSwap::Fresh
            } else {
                StateOnSwap::FromOutgoing
            },
        )?; // A new spec may narrow the node's objective otherwise than the last one:
        for line in objective_in_force.lines() {
            tracing::info!(policy = %name, "swapped in: {line}");
        }
        Ok(outcome)
    }

    fn rollback(&self) -> Result<ActionOutcome, ControlError> {
        let _one = lock(&self.swapping);
        let Some(previous) = lock(&self.book).history.last().cloned() else {
            return Err(ControlError::Conflict(
                "there is no earlier policy to roll back to: the policy in charge is the first this agent ran".into(),
            ));
        };
        let mut outcome = self.hand_over(previous, SwapKind::Back, StateOnSwap::FromOutgoing)?;
        outcome.message = format!("rolled back: {}", outcome.message);
        Ok(outcome)
    }

    fn pause(&self) -> Result<ActionOutcome, ControlError> {
        self.command(
            LoopCommand::Pause,
            "paused: the settings in force are held and the policy is not asked",
        )
    }

    fn resume(&self) -> Result<ActionOutcome, ControlError> {
        self.command(LoopCommand::Resume, "resumed: the policy decides again")
    }

    fn restore_defaults(&self) -> Result<ActionOutcome, ControlError> {
        let errors_before = self.live.status().failures.actuator_errors;
        let outcome = self.command(
            LoopCommand::RestoreDefaults,
            "every GPU is back to its defaults (default power cap, no clock lock, the first batch size) and the agent is paused; `tokwatt policy resume` hands control back to the policy",
        )?;
        // The loop counts a change the GPU refused (and logs why) in the tick that took the
        // command, which the status above already holds.
        let failed = self
            .live
            .status()
            .failures
            .actuator_errors
            .saturating_sub(errors_before);
        if failed > 0 {
            return Err(ControlError::Conflict(format!(
                "the agent is paused, but {failed} setting change(s) back to the defaults failed and those settings stay as they were: the agent's log says why (often missing CAP_SYS_ADMIN); `tokwatt status` shows what is in force"
            )));
        }
        Ok(outcome)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use std::path::Path;

    use super::*;
    use tokwatt_agent::control::LoopTotals;

    fn record(name: &str) -> PolicyRecord {
        let text = format!("name = \"{name}\"\nplugin = \"{name}.wasm\"\n");
        PolicyRecord {
            spec: PolicySpec::parse(Path::new("spec.toml"), &text).unwrap(),
            plugin: PathBuf::from(format!("{name}.wasm")),
            version: name.to_owned(),
        }
    }

    fn after_tick(book: &mut Book, tick: u64, swaps: u64) {
        after_takeovers(book, tick, swaps, 0);
    }

    fn after_takeovers(book: &mut Book, tick: u64, swaps: u64, operator_rollbacks: u64) {
        let mut totals = LoopTotals::default();
        totals.swaps.swaps = swaps;
        totals.swaps.operator_rollbacks = operator_rollbacks;
        book.follow(&Progress {
            tick,
            ticks: 100,
            time: Duration::from_secs(tick),
            totals: &totals,
            observations: &[],
            in_force: &[],
            policy: "",
            requested: &[],
            decide_time: None,
            lateness: Duration::ZERO,
            paused: false,
            on_probation: true,
            guard_in_charge: false,
            guard_enabled: true,
            objective: tokwatt_core::types::Objective::default(),
            commands_taken: 0,
        });
    }

    /// A swap that timed out stays queued; one sent after it takes over after it, and the
    /// book names each when it takes charge.
    #[test]
    fn queued_swaps_take_charge_in_the_order_sent() {
        let mut book = Book::new(record("first"));
        book.pending.push_back((record("slow"), SwapKind::Forward));
        book.pending.push_back((record("next"), SwapKind::Forward));
        after_tick(&mut book, 10, 1);
        assert_eq!(book.current.spec.name, "slow");
        after_tick(&mut book, 11, 2);
        assert_eq!(book.current.spec.name, "next");
        let history: Vec<&str> = book.history.iter().map(|r| r.spec.name.as_str()).collect();
        assert_eq!(history, ["first", "slow"]);
        assert!(book.pending.is_empty());
    }

    /// An operator's rollback takes charge as a swap does, but is counted as what it is;
    /// the book follows either.
    #[test]
    fn an_operator_rollback_takes_charge_and_pops_the_history() {
        let mut book = Book::new(record("first"));
        book.pending
            .push_back((record("second"), SwapKind::Forward));
        after_tick(&mut book, 5, 1);
        book.pending.push_back((record("first"), SwapKind::Back));
        after_takeovers(&mut book, 6, 1, 1);
        assert_eq!(book.current.spec.name, "first");
        assert!(book.history.is_empty(), "{:?}", book.history);
        assert!(book.pending.is_empty());
    }
}
