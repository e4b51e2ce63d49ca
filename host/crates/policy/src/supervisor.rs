//! The policy boundary as the control loop sees it: a [`PolicyEngine`] (the WebAssembly
//! plugin host implements it; tests may use a native double) wrapped in a [`Supervisor`]
//! that turns every failure into a fallback decision and ejects a failing policy.
//!
//! Nothing here knows about wasmtime.

use std::time::Duration;

use tokwatt_core::types::{Knobs, Objective, Observation, Settings};

/// What a policy knows about one managed GPU (guardrails already applied).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DeviceFacts {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub simulated: bool,
    pub power_cap_min_w: f64,
    pub power_cap_max_w: f64,
    pub power_cap_default_w: f64,
    /// Highest first.
    pub sm_clocks_mhz: Vec<u32>,
    pub batch_size_max: u32,
    /// The token budget per step's range; both 0 where the workload has none.
    pub token_budget_min: u32,
    pub token_budget_max: u32,
}

/// What `init` receives.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct InitArgs {
    pub devices: Vec<DeviceFacts>,
    pub knobs: Knobs,
    pub objective: Objective,
    pub params: Vec<(String, String)>,
    pub tick_ms: u32,
    pub seed: u64,
}

impl DeviceFacts {
    /// A plausible H200 as a policy is told about it (110 SM clocks from 1980 MHz down,
    /// caps 200 to 700 W, batches to 512, decoding only: no token budget), for benchmarks
    /// and tests.
    pub fn typical_h200(gpu: u32) -> Self {
        Self {
            index: gpu,
            uuid: format!("SIM-h200-{gpu}"),
            name: "bench".into(),
            simulated: true,
            power_cap_min_w: 200.0,
            power_cap_max_w: 700.0,
            power_cap_default_w: 700.0,
            sm_clocks_mhz: (0..110).map(|i| 1980 - 15 * i).collect(),
            batch_size_max: 512,
            token_budget_min: 0,
            token_budget_max: 0,
        }
    }
}

impl InitArgs {
    /// What `init` gets for `gpus` typical H200s with every knob they have granted (not
    /// the token budget: they decode only) and the default objective, for benchmarks and
    /// tests.
    pub fn typical_h200(gpus: u32) -> Self {
        Self {
            devices: (0..gpus).map(DeviceFacts::typical_h200).collect(),
            knobs: Knobs {
                power_cap: true,
                sm_clock: true,
                batch_size: true,
                token_budget: false,
            },
            objective: Objective::default(),
            params: vec![],
            tick_ms: 1000,
            seed: 1,
        }
    }
}

/// Opaque policy state, handed to a new version at a swap.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PolicyState {
    pub schema_version: u32,
    pub bytes: Vec<u8>,
}

/// Why a policy call did not produce a usable answer. Each costs one tick.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PolicyFailure {
    #[error("the plugin trapped: {0}")]
    Trap(String),
    // The limits' variants carry the end of what the failed call wrote to standard error
    // (escaped, one line): what a guest was doing when it was stopped, often the only
    // clue to why it looped or grew.
    #[error(
        "the plugin ran out of fuel (its per-call instruction budget){}",
        stderr_note(stderr.as_deref())
    )]
    OutOfFuel { stderr: Option<String> },
    #[error(
        "the plugin missed its deadline of {deadline_ms} ms{}",
        stderr_note(stderr.as_deref())
    )]
    Deadline {
        deadline_ms: u64,
        stderr: Option<String>,
    },
    #[error(
        "the plugin hit its memory limit of {limit_mib} MiB (all its memories together){}",
        stderr_note(stderr.as_deref())
    )]
    MemoryLimit {
        limit_mib: u64,
        stderr: Option<String>,
    },
    #[error(
        "the plugin hit its table limit of {limit_elements} elements (all its tables together){}",
        stderr_note(stderr.as_deref())
    )]
    TableLimit {
        limit_elements: u64,
        stderr: Option<String>,
    },
    #[error("the plugin has more core instances, memories or tables than a policy may: {0}")]
    ResourceCount(String),
    #[error("the plugin's answer is invalid: {0}")]
    InvalidAnswer(String),
    #[error("the plugin refused: {0}")]
    Refused(String),
    #[error("the plugin could not be instantiated: {0}")]
    Instantiate(String),
}

/// How a failure's message quotes the end of the failed call's standard error (escaped,
/// on the message's one line), or nothing where it wrote none. Always last, so a reader
/// that shows the tail line by line (`tokwatt plugin check`) can take exactly this off.
pub fn stderr_note(tail: Option<&str>) -> String {
    tail.map(|tail| format!(" (its standard error: {tail})"))
        .unwrap_or_default()
}

impl PolicyFailure {
    /// A short stable name for counters and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            PolicyFailure::Trap(_) => "trap",
            PolicyFailure::OutOfFuel { .. } => "fuel",
            PolicyFailure::Deadline { .. } => "deadline",
            PolicyFailure::MemoryLimit { .. } => "memory",
            PolicyFailure::TableLimit { .. } => "table",
            PolicyFailure::ResourceCount(_) => "resource-count",
            PolicyFailure::InvalidAnswer(_) => "invalid",
            PolicyFailure::Refused(_) => "refused",
            PolicyFailure::Instantiate(_) => "instantiate",
        }
    }

    /// Whether the instance is unusable afterwards and must be rebuilt (a trap poisons a
    /// component instance; an invalid answer does not).
    pub fn poisons_instance(&self) -> bool {
        !matches!(
            self,
            PolicyFailure::InvalidAnswer(_) | PolicyFailure::Refused(_)
        )
    }
}

/// A policy the supervisor can drive. Implemented by the WebAssembly plugin host.
pub trait PolicyEngine: Send {
    fn name(&self) -> &str;
    fn init(&mut self, args: &InitArgs) -> Result<Vec<Settings>, PolicyFailure>;
    fn decide(
        &mut self,
        tick_time: Duration,
        observations: &[Observation],
    ) -> Result<Vec<Settings>, PolicyFailure>;
    fn snapshot(&mut self) -> Result<PolicyState, PolicyFailure>;
    fn restore(&mut self, state: &PolicyState) -> Result<(), PolicyFailure>;
    /// Throw the instance away and start a fresh one (after a trap). `init` must be called again.
    fn rebuild(&mut self) -> Result<(), PolicyFailure>;
    /// Log messages the policy sent past its rate limit, since the start.
    fn logs_dropped(&self) -> u64 {
        0
    }
}

/// When to give up on a failing policy and when to try it again.
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// Consecutive failed ticks that eject the policy.
    pub failures_to_eject: u32,
    /// Ticks an ejected policy sits out the first time; doubled at each ejection.
    pub backoff_ticks: u64,
    /// Longest sit-out.
    pub max_backoff_ticks: u64,
    /// Consecutive healthy ticks after which earlier ejections are forgiven: the next
    /// ejection sits out `backoff_ticks` again, not a doubling of the last sit-out.
    pub forgive_after_ticks: u64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failures_to_eject: 3,
            backoff_ticks: 10,
            max_backoff_ticks: 600,
            forgive_after_ticks: 600,
        }
    }
}

/// A breaker setting that makes no sense, named by its key in the spec's `[breaker]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("[breaker] {key} {problem}")]
pub struct BreakerConfigError {
    pub key: &'static str,
    pub problem: String,
}

impl BreakerConfig {
    /// Refuse settings that parse but make no sense.
    pub fn validate(&self) -> Result<(), BreakerConfigError> {
        let error = |key, problem: &str| {
            Err(BreakerConfigError {
                key,
                problem: problem.to_owned(),
            })
        };
        if self.failures_to_eject == 0 {
            return error(
                "failures_to_eject",
                "must be at least 1 (0 would never eject a failing plugin)",
            );
        }
        if self.backoff_ticks == 0 {
            return error(
                "backoff_ticks",
                "must be at least 1 (0 would retry an ejected plugin at once)",
            );
        }
        if self.max_backoff_ticks < self.backoff_ticks {
            return Err(BreakerConfigError {
                key: "max_backoff_ticks",
                problem: format!(
                    "({}) is below backoff_ticks ({})",
                    self.max_backoff_ticks, self.backoff_ticks
                ),
            });
        }
        if self.forgive_after_ticks == 0 {
            return error(
                "forgive_after_ticks",
                "must be at least 1 (0 would forgive a flapping plugin after every good tick, so its backoff never grows)",
            );
        }
        Ok(())
    }
}

/// Who decided a tick.
#[derive(Debug, Clone, PartialEq)]
pub enum DecisionSource {
    Policy,
    /// The safe fallback held the last good settings, because of this failure.
    Fallback(PolicyFailure),
    /// The policy is ejected; the fallback decides until `until_tick`.
    Ejected {
        until_tick: u64,
    },
}

/// Failure counts over a run.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PolicyCounters {
    pub calls: u64,
    pub fallback_ticks: u64,
    pub traps: u64,
    pub fuel_exhausted: u64,
    pub deadlines_missed: u64,
    pub memory_limit_hits: u64,
    pub invalid_answers: u64,
    pub ejections: u64,
    pub rebuilds: u64,
    pub rebuild_failures: u64,
    pub logs_dropped: u64,
    /// Every failure by its [`PolicyFailure::kind`] (`trap`, `fuel`, `deadline`,
    /// `memory`, `table`, `resource-count`, `invalid`, `refused`, `instantiate`).
    pub failures_by_kind: std::collections::BTreeMap<String, u64>,
}

impl PolicyCounters {
    fn count(&mut self, failure: &PolicyFailure) {
        *self
            .failures_by_kind
            .entry(failure.kind().to_owned())
            .or_default() += 1;
        match failure {
            PolicyFailure::Trap(_) | PolicyFailure::Refused(_) | PolicyFailure::Instantiate(_) => {
                self.traps += 1
            }
            PolicyFailure::OutOfFuel { .. } => self.fuel_exhausted += 1,
            PolicyFailure::Deadline { .. } => self.deadlines_missed += 1,
            PolicyFailure::MemoryLimit { .. }
            | PolicyFailure::TableLimit { .. }
            | PolicyFailure::ResourceCount(_) => self.memory_limit_hits += 1,
            PolicyFailure::InvalidAnswer(_) => self.invalid_answers += 1,
        }
    }

    /// Every failure that trapped the plugin (trap, fuel, deadline, memory).
    pub fn plugin_traps(&self) -> u64 {
        self.traps + self.fuel_exhausted + self.deadlines_missed + self.memory_limit_hits
    }

    /// Add what one supervisor counted between `seen` and `now` (two readings of its
    /// counters): a run's totals over every policy that was in charge, where each swap
    /// brings a supervisor whose counts start afresh.
    pub fn add_since(&mut self, now: &PolicyCounters, seen: &PolicyCounters) {
        let fields = [
            (&mut self.calls, now.calls, seen.calls),
            (
                &mut self.fallback_ticks,
                now.fallback_ticks,
                seen.fallback_ticks,
            ),
            (&mut self.traps, now.traps, seen.traps),
            (
                &mut self.fuel_exhausted,
                now.fuel_exhausted,
                seen.fuel_exhausted,
            ),
            (
                &mut self.deadlines_missed,
                now.deadlines_missed,
                seen.deadlines_missed,
            ),
            (
                &mut self.memory_limit_hits,
                now.memory_limit_hits,
                seen.memory_limit_hits,
            ),
            (
                &mut self.invalid_answers,
                now.invalid_answers,
                seen.invalid_answers,
            ),
            (&mut self.ejections, now.ejections, seen.ejections),
            (&mut self.rebuilds, now.rebuilds, seen.rebuilds),
            (
                &mut self.rebuild_failures,
                now.rebuild_failures,
                seen.rebuild_failures,
            ),
            (&mut self.logs_dropped, now.logs_dropped, seen.logs_dropped),
        ];
        for (total, now, seen) in fields {
            *total = total.saturating_add(now.saturating_sub(seen));
        }
        for (kind, &count) in &now.failures_by_kind {
            let before = seen.failures_by_kind.get(kind).copied().unwrap_or(0);
            let total = self.failures_by_kind.entry(kind.clone()).or_default();
            *total = total.saturating_add(count.saturating_sub(before));
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BreakerState {
    Closed { consecutive_failures: u32 },
    Open { until_tick: u64 },
}

/// Drives a policy, catching every failure: a failed tick is decided by the safe
/// fallback (hold the last good settings: "leave unchanged"), a poisoned instance is
/// rebuilt, and repeated failures eject the policy with exponential backoff.
pub struct Supervisor {
    engine: Box<dyn PolicyEngine>,
    init_args: InitArgs,
    config: BreakerConfig,
    state: BreakerState,
    ejections: u32,
    /// Consecutive ticks the policy decided since its last failure.
    healthy_ticks: u64,
    needs_rebuild: bool,
    counters: PolicyCounters,
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor")
            .field("policy", &self.engine.name())
            .field("state", &self.state)
            .field("counters", &self.counters)
            .finish()
    }
}

/// One tick's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// One per GPU; all `None` ("hold") when the fallback decided.
    pub settings: Vec<Settings>,
    pub source: DecisionSource,
}

impl Supervisor {
    /// Initialise `engine`. An `init` failure is returned: a policy that cannot start is
    /// not run (the caller reports it, or keeps the previous policy at a swap).
    pub fn start(
        mut engine: Box<dyn PolicyEngine>,
        init_args: InitArgs,
        config: BreakerConfig,
    ) -> Result<(Supervisor, Vec<Settings>), PolicyFailure> {
        let first = engine.init(&init_args)?;
        check_length(&first, init_args.devices.len())?;
        let supervisor = Supervisor {
            engine,
            init_args,
            config,
            state: BreakerState::Closed {
                consecutive_failures: 0,
            },
            ejections: 0,
            healthy_ticks: 0,
            needs_rebuild: false,
            counters: PolicyCounters::default(),
        };
        Ok((supervisor, first))
    }

    pub fn policy_name(&self) -> &str {
        self.engine.name()
    }

    pub fn counters(&self) -> PolicyCounters {
        let mut counters = self.counters.clone();
        counters.logs_dropped = self.engine.logs_dropped();
        counters
    }

    pub fn is_ejected(&self) -> bool {
        matches!(self.state, BreakerState::Open { .. })
    }

    /// Ask the policy for this tick's settings; never fails.
    pub fn decide(
        &mut self,
        tick: u64,
        tick_time: Duration,
        observations: &[Observation],
    ) -> Decision {
        let hold = vec![Settings::default(); observations.len()];
        if let BreakerState::Open { until_tick } = self.state {
            if tick < until_tick {
                self.counters.fallback_ticks += 1;
                return Decision {
                    settings: hold,
                    source: DecisionSource::Ejected { until_tick },
                };
            }
            // Half-open: give it one more chance on a fresh instance.
            tracing::info!(policy = self.engine.name(), tick, "retrying ejected policy");
            self.needs_rebuild = true;
        }

        if self.needs_rebuild
            && let Err(failure) = self.rebuild()
        {
            return self.fail(tick, hold, failure);
        }

        self.counters.calls += 1;
        match self
            .engine
            .decide(tick_time, observations)
            .and_then(|settings| check_length(&settings, observations.len()).map(|()| settings))
        {
            Ok(settings) => {
                self.state = BreakerState::Closed {
                    consecutive_failures: 0,
                };
                self.healthy_ticks += 1;
                if self.ejections > 0 && self.healthy_ticks >= self.config.forgive_after_ticks {
                    tracing::info!(
                        policy = self.engine.name(),
                        tick,
                        "policy healthy for {} ticks: its earlier ejections are forgiven",
                        self.healthy_ticks
                    );
                    self.ejections = 0;
                }
                Decision {
                    settings,
                    source: DecisionSource::Policy,
                }
            }
            Err(failure) => self.fail(tick, hold, failure),
        }
    }

    fn rebuild(&mut self) -> Result<(), PolicyFailure> {
        self.counters.rebuilds += 1;
        let result = self
            .engine
            .rebuild()
            .and_then(|()| self.engine.init(&self.init_args))
            .and_then(|first| check_length(&first, self.init_args.devices.len()));
        match result {
            Ok(()) => {
                self.needs_rebuild = false;
                Ok(())
            }
            Err(failure) => {
                self.counters.rebuild_failures += 1;
                Err(failure)
            }
        }
    }

    fn fail(&mut self, tick: u64, hold: Vec<Settings>, failure: PolicyFailure) -> Decision {
        self.counters.count(&failure);
        self.healthy_ticks = 0;
        self.counters.fallback_ticks += 1;
        if failure.poisons_instance() {
            self.needs_rebuild = true;
        }
        let consecutive = match self.state {
            BreakerState::Closed {
                consecutive_failures,
            } => consecutive_failures + 1,
            // A failed half-open try ejects again at once.
            BreakerState::Open { .. } => self.config.failures_to_eject,
        };
        tracing::warn!(
            policy = self.engine.name(),
            tick,
            kind = failure.kind(),
            "policy failed, fallback holds the settings: {failure}"
        );
        if consecutive >= self.config.failures_to_eject {
            let backoff = self
                .config
                .backoff_ticks
                .saturating_mul(1u64 << self.ejections.min(32))
                .min(self.config.max_backoff_ticks);
            self.ejections += 1;
            self.counters.ejections += 1;
            let until_tick = tick + 1 + backoff;
            tracing::error!(
                policy = self.engine.name(),
                tick,
                until_tick,
                "policy ejected after {consecutive} consecutive failures; the fallback decides for {backoff} ticks"
            );
            self.state = BreakerState::Open { until_tick };
        } else {
            self.state = BreakerState::Closed {
                consecutive_failures: consecutive,
            };
        }
        Decision {
            settings: hold,
            source: DecisionSource::Fallback(failure),
        }
    }

    /// Hand state to a new policy: snapshot this one, start `next` off the loop's
    /// critical path and restore the snapshot into it. On any failure the caller keeps
    /// this supervisor (the old policy comes back).
    pub fn snapshot(&mut self) -> Result<PolicyState, PolicyFailure> {
        self.engine
            .snapshot()
            .inspect_err(|failure| self.state_call_failed(failure))
    }

    /// Give this policy the state of the one it replaces. A policy refuses a snapshot
    /// whose schema it does not know; it then keeps the state `init` gave it.
    pub fn restore(&mut self, state: &PolicyState) -> Result<(), PolicyFailure> {
        self.engine
            .restore(state)
            .inspect_err(|failure| self.state_call_failed(failure))
    }

    /// A `snapshot` or `restore` that failed: a refusal is the policy's answer, anything
    /// else (a trap, fuel, the deadline) is counted like a failed `decide`, and an
    /// instance it poisoned is rebuilt before its next call (a rolled-back policy is
    /// called again).
    fn state_call_failed(&mut self, failure: &PolicyFailure) {
        if matches!(failure, PolicyFailure::Refused(_)) {
            return;
        }
        self.counters.count(failure);
        if failure.poisons_instance() {
            self.needs_rebuild = true;
        }
        tracing::warn!(
            policy = self.engine.name(),
            kind = failure.kind(),
            "policy failed while its state was handed over: {failure}"
        );
    }
}

fn check_length(settings: &[Settings], expected: usize) -> Result<(), PolicyFailure> {
    if settings.len() == expected {
        Ok(())
    } else {
        Err(PolicyFailure::InvalidAnswer(format!(
            "returned {} settings for {expected} GPU(s)",
            settings.len()
        )))
    }
}

/// A native stand-in for a plugin: the test-support crate's own file, compiled here too
/// for this crate's tests (which cannot use that crate: it depends on this one).
#[cfg(test)]
#[path = "../../test-support/src/native_policy.rs"]
pub(crate) mod doubles;

#[cfg(test)]
mod tests;
