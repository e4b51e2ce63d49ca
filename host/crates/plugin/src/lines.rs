//! The contract lines this host serves, side by side: each has its generated bindings,
//! its conversions from the host's types, its `tokwatt:policy/host` imports and its
//! type checks. A plugin is served on the line it was built for, so a plugin built
//! against 0.1, 0.2 or 0.3 keeps loading after later lines added fields, and simply never
//! sees them: a line without the token budget (before 0.4) is never told of it, and its
//! settings never move it.
//!
//! Everything the lines share is written once, in [`contract_line!`]; what differs
//! (the fields a line added) is passed in.

use wasmtime::Store;
use wasmtime::component::{HasSelf, Instance, InstancePre, Linker};

use super::sandbox::{GuestLogLevel, HostState};
use tokwatt_core::types::{Observation, Settings};
use tokwatt_policy::supervisor::{InitArgs, PolicyState};

/// A contract line (for 0.x versions, the minor), newest last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Line {
    V0_1,
    V0_2,
    V0_3,
    V0_4,
}

impl Line {
    /// Every line this host serves, oldest first.
    pub(super) const SERVED: [Line; 4] = [Line::V0_1, Line::V0_2, Line::V0_3, Line::V0_4];
    /// The line of [`super::CONTRACT_VERSION`], the one new plugins are built against.
    pub(super) const NEWEST: Line = Line::V0_4;

    /// The line of a version string (`0.1.3` → 0.1), if this host serves it.
    pub(super) fn of(version: &str) -> Option<Line> {
        let mut parts = version.split('.').map(|p| p.parse::<u64>().ok());
        let (major, minor) = (parts.next()??, parts.next()??);
        match (major, minor) {
            (0, 1) => Some(Line::V0_1),
            (0, 2) => Some(Line::V0_2),
            (0, 3) => Some(Line::V0_3),
            (0, 4) => Some(Line::V0_4),
            _ => None,
        }
    }

    /// The line as its accepted versions are written: `0.1.*`.
    pub(super) fn pattern(self) -> &'static str {
        match self {
            Line::V0_1 => "0.1.*",
            Line::V0_2 => "0.2.*",
            Line::V0_3 => "0.3.*",
            Line::V0_4 => "0.4.*",
        }
    }

    /// Add this line's `tokwatt:policy/host` imports to the linker. Each line's
    /// interfaces have their own versioned names, so they sit side by side.
    pub(super) fn add_to_linker(self, linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
        match self {
            Line::V0_1 => {
                v0_1::Policy::add_to_linker::<HostState, HasSelf<HostState>>(linker, |s| s)
            }
            Line::V0_2 => {
                v0_2::Policy::add_to_linker::<HostState, HasSelf<HostState>>(linker, |s| s)
            }
            Line::V0_3 => {
                v0_3::Policy::add_to_linker::<HostState, HasSelf<HostState>>(linker, |s| s)
            }
            Line::V0_4 => {
                v0_4::Policy::add_to_linker::<HostState, HasSelf<HostState>>(linker, |s| s)
            }
        }
    }

    /// Check one guest function's type against this line's contract, on a live instance.
    pub(super) fn check_function(
        self,
        instance: &Instance,
        store: &mut Store<HostState>,
        index: &wasmtime::component::ComponentExportIndex,
        function: &str,
    ) -> wasmtime::Result<()> {
        match self {
            Line::V0_1 => v0_1::check_function(instance, store, index, function),
            Line::V0_2 => v0_2::check_function(instance, store, index, function),
            Line::V0_3 => v0_3::check_function(instance, store, index, function),
            Line::V0_4 => v0_4::check_function(instance, store, index, function),
        }
    }

    /// Check one guest function's type against this line's contract, without an instance.
    pub(super) fn typecheck(
        self,
        function: &str,
        func: &wasmtime::component::types::ComponentFunc,
        cx: &wasmtime::component::__internal::InstanceType<'_>,
    ) -> wasmtime::Result<()> {
        match self {
            Line::V0_1 => v0_1::typecheck(function, func, cx),
            Line::V0_2 => v0_2::typecheck(function, func, cx),
            Line::V0_3 => v0_3::typecheck(function, func, cx),
            Line::V0_4 => v0_4::typecheck(function, func, cx),
        }
    }
}

/// A linked component, ready to instantiate, on its line.
pub(super) enum PolicyPre {
    V0_1(v0_1::PolicyPre<HostState>),
    V0_2(v0_2::PolicyPre<HostState>),
    V0_3(v0_3::PolicyPre<HostState>),
    V0_4(v0_4::PolicyPre<HostState>),
}

/// One instance's guest exports, on its line.
pub(super) enum Guest {
    V0_1(v0_1::Policy),
    V0_2(v0_2::Policy),
    V0_3(v0_3::Policy),
    V0_4(v0_4::Policy),
}

impl PolicyPre {
    pub(super) fn new(line: Line, pre: InstancePre<HostState>) -> wasmtime::Result<Self> {
        Ok(match line {
            Line::V0_1 => Self::V0_1(v0_1::PolicyPre::new(pre)?),
            Line::V0_2 => Self::V0_2(v0_2::PolicyPre::new(pre)?),
            Line::V0_3 => Self::V0_3(v0_3::PolicyPre::new(pre)?),
            Line::V0_4 => Self::V0_4(v0_4::PolicyPre::new(pre)?),
        })
    }

    pub(super) fn line(&self) -> Line {
        match self {
            Self::V0_1(_) => Line::V0_1,
            Self::V0_2(_) => Line::V0_2,
            Self::V0_3(_) => Line::V0_3,
            Self::V0_4(_) => Line::V0_4,
        }
    }

    pub(super) fn instantiate(&self, store: &mut Store<HostState>) -> wasmtime::Result<Guest> {
        Ok(match self {
            Self::V0_1(pre) => Guest::V0_1(pre.instantiate(store)?),
            Self::V0_2(pre) => Guest::V0_2(pre.instantiate(store)?),
            Self::V0_3(pre) => Guest::V0_3(pre.instantiate(store)?),
            Self::V0_4(pre) => Guest::V0_4(pre.instantiate(store)?),
        })
    }
}

/// The guest's four calls, in the host's types. The outer `Result` is the call (a trap,
/// fuel, the deadline), the inner one the policy's own answer.
impl Guest {
    pub(super) fn init(
        &self,
        store: &mut Store<HostState>,
        args: &InitArgs,
    ) -> wasmtime::Result<Result<Vec<Settings>, String>> {
        match self {
            Self::V0_1(policy) => v0_1::init(policy, store, args),
            Self::V0_2(policy) => v0_2::init(policy, store, args),
            Self::V0_3(policy) => v0_3::init(policy, store, args),
            Self::V0_4(policy) => v0_4::init(policy, store, args),
        }
    }

    pub(super) fn decide(
        &self,
        store: &mut Store<HostState>,
        observations: &[Observation],
    ) -> wasmtime::Result<Vec<Settings>> {
        match self {
            Self::V0_1(policy) => v0_1::decide(policy, store, observations),
            Self::V0_2(policy) => v0_2::decide(policy, store, observations),
            Self::V0_3(policy) => v0_3::decide(policy, store, observations),
            Self::V0_4(policy) => v0_4::decide(policy, store, observations),
        }
    }

    pub(super) fn snapshot(&self, store: &mut Store<HostState>) -> wasmtime::Result<PolicyState> {
        match self {
            Self::V0_1(policy) => v0_1::snapshot(policy, store),
            Self::V0_2(policy) => v0_2::snapshot(policy, store),
            Self::V0_3(policy) => v0_3::snapshot(policy, store),
            Self::V0_4(policy) => v0_4::snapshot(policy, store),
        }
    }

    pub(super) fn restore(
        &self,
        store: &mut Store<HostState>,
        state: &PolicyState,
    ) -> wasmtime::Result<Result<(), String>> {
        match self {
            Self::V0_1(policy) => v0_1::restore(policy, store, state),
            Self::V0_2(policy) => v0_2::restore(policy, store, state),
            Self::V0_3(policy) => v0_3::restore(policy, store, state),
            Self::V0_4(policy) => v0_4::restore(policy, store, state),
        }
    }
}

/// One contract line: its bindings and everything written against them. `$objective`,
/// `$observation`, `$device` and `$in_force` name the host value (`&Objective`,
/// `&Observation`, `&DeviceFacts`, `&InForce`) that the line's added fields (`{ … }`,
/// field initialisers) are read from; `knobs` lists the line's added flags (`(granted,
/// flag)`, read from the host's `Knobs`), and `settings` says what the line's settings
/// give of the knobs it added (read from the line's own `wit::Settings`).
macro_rules! contract_line {
    (
        $line:ident, $wit_path:literal,
        knobs: |$knobs:ident| [ $($knobs_added:tt)* ],
        device: |$device:ident| { $($device_added:tt)* },
        settings: |$settings:ident| { $($settings_added:tt)* },
        in_force: |$in_force:ident| { $($in_force_added:tt)* },
        objective: |$objective:ident| { $($objective_added:tt)* },
        observation: |$observation:ident| { $($observation_added:tt)* } $(,)?
    ) => {
        pub(super) mod $line {
            wasmtime::component::bindgen!({
                path: $wit_path,
                world: "policy",
            });

            use wasmtime::Store;
            use wasmtime::component::{ComponentExportIndex, Instance};

            use super::{GuestLogLevel, HostState};
            use tokwatt_policy::supervisor::{InitArgs, PolicyState};
            use tokwatt_core::types::{ClockEvents, Knobs, Observation, Settings};
            use self::tokwatt::policy::types as wit;

            impl self::tokwatt::policy::types::Host for HostState {}

            impl self::tokwatt::policy::host::Host for HostState {
                fn log(&mut self, level: wit::LogLevel, message: String) {
                    let level = match level {
                        wit::LogLevel::Trace => GuestLogLevel::Trace,
                        wit::LogLevel::Debug => GuestLogLevel::Debug,
                        wit::LogLevel::Info => GuestLogLevel::Info,
                        wit::LogLevel::Warn => GuestLogLevel::Warn,
                        wit::LogLevel::Error => GuestLogLevel::Error,
                    };
                    self.guest_log(level, message);
                }

                fn random(&mut self) -> u64 {
                    self.guest_random()
                }

                fn tick_time_ms(&mut self) -> u64 {
                    self.guest_tick_time_ms()
                }
            }

            fn knobs($knobs: Knobs) -> wit::Knobs {
                let k = $knobs;
                let mut out = wit::Knobs::empty();
                for (set, flag) in [
                    (k.power_cap, wit::Knobs::POWER_CAP),
                    (k.sm_clock, wit::Knobs::SM_CLOCK),
                    (k.batch_size, wit::Knobs::BATCH_SIZE),
                    $($knobs_added)*
                ] {
                    if set {
                        out |= flag;
                    }
                }
                out
            }

            fn clock_events(e: ClockEvents) -> wit::ClockEvents {
                let mut out = wit::ClockEvents::empty();
                for (set, flag) in [
                    (e.gpu_idle, wit::ClockEvents::GPU_IDLE),
                    (e.sw_power_cap, wit::ClockEvents::SW_POWER_CAP),
                    (e.hw_slowdown, wit::ClockEvents::HW_SLOWDOWN),
                    (e.sw_thermal, wit::ClockEvents::SW_THERMAL),
                    (e.hw_thermal, wit::ClockEvents::HW_THERMAL),
                    (e.clock_setting, wit::ClockEvents::CLOCK_SETTING),
                ] {
                    if set {
                        out |= flag;
                    }
                }
                out
            }

            pub(super) fn init_args(args: &InitArgs) -> wit::InitArgs {
                let $objective = &args.objective;
                wit::InitArgs {
                    devices: args
                        .devices
                        .iter()
                        .map(|$device| {
                            let d = $device;
                            wit::DeviceFacts {
                                index: d.index,
                                uuid: d.uuid.clone(),
                                name: d.name.clone(),
                                simulated: d.simulated,
                                power_cap_min_w: d.power_cap_min_w,
                                power_cap_max_w: d.power_cap_max_w,
                                power_cap_default_w: d.power_cap_default_w,
                                sm_clocks_mhz: d.sm_clocks_mhz.clone(),
                                batch_size_max: d.batch_size_max,
                                $($device_added)*
                            }
                        })
                        .collect(),
                    knobs: knobs(args.knobs),
                    objective: wit::Objective {
                        tpot_p99_limit_ms: $objective.tpot_p99_limit_ms,
                        min_tokens_per_s: $objective.min_tokens_per_s,
                        $($objective_added)*
                    },
                    params: args.params.clone(),
                    tick_ms: args.tick_ms,
                    seed: args.seed,
                }
            }

            pub(super) fn observation($observation: &Observation) -> wit::Observation {
                let o = $observation;
                wit::Observation {
                    gpu: o.gpu,
                    tick: o.tick,
                    interval_s: o.interval_s,
                    tokens: o.tokens,
                    energy_j: o.energy_j,
                    tokens_per_joule: o.tokens_per_joule,
                    tokens_per_s: o.tokens_per_s,
                    power_avg_w: o.power_avg_w,
                    power_peak_w: o.power_peak_w,
                    sm_clock_mhz: o.sm_clock_mhz,
                    mem_clock_mhz: o.mem_clock_mhz,
                    temperature_c: o.temperature_c,
                    gpu_util_pct: o.gpu_util_pct,
                    clock_events: clock_events(o.clock_events),
                    tpot_p50_ms: o.tpot_p50_ms,
                    tpot_p99_ms: o.tpot_p99_ms,
                    active_sequences: o.active_sequences,
                    queue_depth: o.queue_depth,
                    in_force: {
                        let $in_force = &o.in_force;
                        wit::InForce {
                            power_cap_w: $in_force.power_cap_w,
                            sm_clock_max_mhz: $in_force.sm_clock_max_mhz,
                            batch_size: $in_force.batch_size,
                            $($in_force_added)*
                        }
                    },
                    last_clamped: o.last_clamped,
                    settling: o.settling,
                    $($observation_added)*
                }
            }

            fn settings($settings: &wit::Settings) -> Settings {
                let s = $settings;
                Settings {
                    power_cap_w: s.power_cap_w,
                    sm_clock_max_mhz: s.sm_clock_max_mhz,
                    batch_size: s.batch_size,
                    $($settings_added)*
                }
            }

            pub(super) fn init(
                policy: &Policy,
                store: &mut Store<HostState>,
                args: &InitArgs,
            ) -> wasmtime::Result<Result<Vec<Settings>, String>> {
                let answer = policy
                    .tokwatt_policy_guest()
                    .call_init(store, &init_args(args))?;
                Ok(answer.map(|all| all.iter().map(settings).collect()))
            }

            pub(super) fn decide(
                policy: &Policy,
                store: &mut Store<HostState>,
                observations: &[Observation],
            ) -> wasmtime::Result<Vec<Settings>> {
                let observations: Vec<wit::Observation> =
                    observations.iter().map(observation).collect();
                let answer = policy
                    .tokwatt_policy_guest()
                    .call_decide(store, &observations)?;
                Ok(answer.iter().map(settings).collect())
            }

            pub(super) fn snapshot(
                policy: &Policy,
                store: &mut Store<HostState>,
            ) -> wasmtime::Result<PolicyState> {
                let state = policy.tokwatt_policy_guest().call_snapshot(store)?;
                Ok(PolicyState {
                    schema_version: state.schema_version,
                    bytes: state.bytes,
                })
            }

            pub(super) fn restore(
                policy: &Policy,
                store: &mut Store<HostState>,
                state: &PolicyState,
            ) -> wasmtime::Result<Result<(), String>> {
                let state = wit::State {
                    schema_version: state.schema_version,
                    bytes: state.bytes.clone(),
                };
                policy.tokwatt_policy_guest().call_restore(store, &state)
            }

            pub(super) fn check_function(
                instance: &Instance,
                store: &mut Store<HostState>,
                index: &ComponentExportIndex,
                function: &str,
            ) -> wasmtime::Result<()> {
                match function {
                    "init" => instance
                        .get_typed_func::<(&wit::InitArgs,), (Result<Vec<wit::Settings>, String>,)>(
                            store, index,
                        )
                        .map(|_| ()),
                    "decide" => instance
                        .get_typed_func::<(&[wit::Observation],), (Vec<wit::Settings>,)>(
                            store, index,
                        )
                        .map(|_| ()),
                    "snapshot" => instance
                        .get_typed_func::<(), (wit::State,)>(store, index)
                        .map(|_| ()),
                    _ => instance
                        .get_typed_func::<(&wit::State,), (Result<(), String>,)>(store, index)
                        .map(|_| ()),
                }
            }

            pub(super) fn typecheck(
                function: &str,
                func: &wasmtime::component::types::ComponentFunc,
                cx: &wasmtime::component::__internal::InstanceType<'_>,
            ) -> wasmtime::Result<()> {
                match function {
                    "init" => func
                        .typecheck::<(&wit::InitArgs,), (Result<Vec<wit::Settings>, String>,)>(cx),
                    "decide" => func.typecheck::<(&[wit::Observation],), (Vec<wit::Settings>,)>(cx),
                    "snapshot" => func.typecheck::<(), (wit::State,)>(cx),
                    _ => func.typecheck::<(&wit::State,), (Result<(), String>,)>(cx),
                }
            }
        }
    };
}

// 0.1 as it shipped (`wit/0.1/policy.wit`, frozen): nothing added. The lines before 0.4
// name no token budget: their settings never move it.
contract_line!(
    v0_1, "../../../wit/0.1",
    knobs: |k| [],
    device: |d| {},
    settings: |s| { token_budget: None },
    in_force: |f| {},
    objective: |objective| {},
    observation: |observation| {},
);

// 0.2 as it shipped (`wit/0.2/policy.wit`, frozen): the workload's demand and the
// queue-wait bound.
contract_line!(
    v0_2, "../../../wit/0.2",
    knobs: |k| [],
    device: |d| {},
    settings: |s| { token_budget: None },
    in_force: |f| {},
    objective: |objective| {
        queue_wait_p99_limit_ms: objective.queue_wait_p99_limit_ms,
    },
    observation: |observation| {
        demand: observation.demand.map(|d| wit::Demand {
            requests_arrived: d.requests_arrived,
            requests_completed: d.requests_completed,
            requests_turned_away: d.requests_turned_away,
            tokens_demanded: d.tokens_demanded,
            queue_wait_p99_ms: d.queue_wait_p99_ms,
        }),
    },
);

// 0.3 as it shipped (`wit/0.3/policy.wit`, frozen): prompts — the requests window and
// the TTFT bound.
contract_line!(
    v0_3, "../../../wit/0.3",
    knobs: |k| [],
    device: |d| {},
    settings: |s| { token_budget: None },
    in_force: |f| {},
    objective: |objective| {
        queue_wait_p99_limit_ms: objective.queue_wait_p99_limit_ms,
        ttft_p99_limit_ms: objective.ttft_p99_limit_ms,
    },
    observation: |observation| {
        demand: observation.demand.map(|d| wit::Demand {
            requests_arrived: d.requests_arrived,
            requests_completed: d.requests_completed,
            requests_turned_away: d.requests_turned_away,
            tokens_demanded: d.tokens_demanded,
            queue_wait_p99_ms: d.queue_wait_p99_ms,
        }),
        requests: observation.requests.map(|r| wit::Requests {
            prefill_tokens: r.prefill_tokens,
            first_tokens: r.first_tokens,
            ttft_p99_ms: r.ttft_p99_ms,
            prefill_time_share: r.prefill_time_share,
            preemptions: r.preemptions,
            requests_finished: r.energy.map(|e| e.count),
            energy_per_request_j: r.energy.and_then(|e| e.mean_j()),
        }),
    },
);

// 0.4 (`wit/policy.wit`): the token budget per step as a knob — its flag, its setting,
// the budget in force and the range it may take.
contract_line!(
    v0_4, "../../../wit",
    knobs: |k| [(k.token_budget, wit::Knobs::TOKEN_BUDGET),],
    device: |d| {
        token_budget_min: d.token_budget_min,
        token_budget_max: d.token_budget_max,
    },
    settings: |s| { token_budget: s.token_budget },
    in_force: |f| { token_budget: f.token_budget, },
    objective: |objective| {
        queue_wait_p99_limit_ms: objective.queue_wait_p99_limit_ms,
        ttft_p99_limit_ms: objective.ttft_p99_limit_ms,
    },
    observation: |observation| {
        demand: observation.demand.map(|d| wit::Demand {
            requests_arrived: d.requests_arrived,
            requests_completed: d.requests_completed,
            requests_turned_away: d.requests_turned_away,
            tokens_demanded: d.tokens_demanded,
            queue_wait_p99_ms: d.queue_wait_p99_ms,
        }),
        requests: observation.requests.map(|r| wit::Requests {
            prefill_tokens: r.prefill_tokens,
            first_tokens: r.first_tokens,
            ttft_p99_ms: r.ttft_p99_ms,
            prefill_time_share: r.prefill_time_share,
            preemptions: r.preemptions,
            requests_finished: r.energy.map(|e| e.count),
            energy_per_request_j: r.energy.and_then(|e| e.mean_j()),
        }),
    },
);
