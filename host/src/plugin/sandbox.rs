//! What a plugin instance may touch: its memory (limited), fuel and deadline (armed per
//! call by the host), the `tokwatt:policy/host` imports, and a WASI context with nothing
//! in it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use wasmtime::component::{HasData, Linker, Resource, ResourceTable};
use wasmtime_wasi::p2::bindings::clocks::monotonic_clock;
use wasmtime_wasi::p2::{DynPollable, Pollable, subscribe};
use wasmtime_wasi::{
    HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView,
};

use super::bindings::tokwatt::policy::{host, types};
use super::text::{PLUGIN_TEXT_MAX_BYTES, sanitize_text};

/// A plugin's random streams (see `crate::rng`): the contract's `random` import and WASI's
/// two random interfaces each draw from their own, so a plugin's use of one never shifts
/// the others, and the simulator's streams (small numbers) are never shared.
const RANDOM_STREAM_CONTRACT: u64 = 0x706C_7567_0001;
const RANDOM_STREAM_WASI_SECURE: u64 = 0x706C_7567_0002;
const RANDOM_STREAM_WASI_INSECURE: u64 = 0x706C_7567_0003;

/// Per-plugin sandbox limits, from the policy spec's `[sandbox]` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxLimits {
    /// WebAssembly instructions (roughly) one call may execute.
    pub fuel_per_call: u64,
    /// Wall-clock time one call may take.
    pub deadline_ms: u64,
    /// Linear memory the instance may hold, all its memories together.
    pub memory_mib: u64,
    /// Log messages per call; the rest are dropped and counted.
    pub log_messages_per_call: u32,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        Self {
            fuel_per_call: 100_000_000,
            deadline_ms: 100,
            memory_mib: 64,
            log_messages_per_call: 16,
        }
    }
}

/// What an instance may hold besides its linear memories' bytes. A plain Rust
/// `wasm32-wasip2` policy instantiates 3 core modules (its own and two small shims that
/// `wasm-component-ld` adds), with 1 memory and 2 tables between them (counted in the
/// built fixtures and shipped policies; `plugin::tests::a_normal_policy_fits_the_counts`
/// instantiates them under these limits). The limits leave room for another toolchain's
/// adapters, not for a plugin that multiplies memories or instances.
pub(super) const MAX_CORE_INSTANCES: usize = 16;
pub(super) const MAX_MEMORIES: usize = 4;
pub(super) const MAX_TABLES: usize = 8;
/// Table elements over all tables of an instance (a funcref costs the host about 8 to
/// 16 bytes): a Rust policy's function table has a few hundred to a few thousand.
pub(super) const MAX_TABLE_ELEMENTS: usize = 100_000;
/// Host resources (WASI streams, pollables, …) one instance may hold at once. wasmtime's
/// own default is about a million, and each one costs host memory that the memory limit
/// does not see, so a guest leaking handles could grow the agent; a policy needs a few.
pub(super) const MAX_HOST_RESOURCES: usize = 1024;

/// Which limit a failed call ran into, so the trap can be named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LimitHit {
    Memory,
    Table,
}

/// Enforces the instance's limits: the total of all its linear memories (not each one),
/// the total of its table elements, and the counts of core instances, memories and
/// tables. Growth past a limit traps at once rather than handing the guest a failed
/// `memory.grow` it may ignore (what `StoreLimitsBuilder::trap_on_grow_failure` does),
/// and the hit is remembered so the failure is named.
#[derive(Debug)]
pub(super) struct InstanceLimiter {
    memory_limit_bytes: usize,
    memory_bytes: usize,
    table_elements: usize,
    /// The last growth allowed, undone if the grow then fails in the engine.
    pending_memory: usize,
    pending_table: usize,
    hit: Option<LimitHit>,
}

impl InstanceLimiter {
    fn new(memory_limit_bytes: usize) -> Self {
        Self {
            memory_limit_bytes,
            memory_bytes: 0,
            table_elements: 0,
            pending_memory: 0,
            pending_table: 0,
            hit: None,
        }
    }

    pub(super) fn hit(&self) -> Option<LimitHit> {
        self.hit
    }
}

impl wasmtime::ResourceLimiter for InstanceLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if maximum.is_some_and(|max| desired > max) {
            // Past the memory's own declared maximum: a plain failed grow, as in any engine.
            return Ok(false);
        }
        let added = desired.saturating_sub(current);
        let total = self.memory_bytes.saturating_add(added);
        if total > self.memory_limit_bytes {
            self.hit = Some(LimitHit::Memory);
            return Err(wasmtime::Error::msg(format!(
                "memory limit: growing the instance's memories to {total} bytes exceeds {} bytes",
                self.memory_limit_bytes
            )));
        }
        self.memory_bytes = total;
        self.pending_memory = added;
        Ok(true)
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.memory_bytes = self.memory_bytes.saturating_sub(self.pending_memory);
        self.pending_memory = 0;
        Err(error.context("growing a linear memory failed"))
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if maximum.is_some_and(|max| desired > max) {
            return Ok(false);
        }
        let added = desired.saturating_sub(current);
        let total = self.table_elements.saturating_add(added);
        if total > MAX_TABLE_ELEMENTS {
            self.hit = Some(LimitHit::Table);
            return Err(wasmtime::Error::msg(format!(
                "table limit: growing the instance's tables to {total} elements exceeds {MAX_TABLE_ELEMENTS}"
            )));
        }
        self.table_elements = total;
        self.pending_table = added;
        Ok(true)
    }

    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.table_elements = self.table_elements.saturating_sub(self.pending_table);
        self.pending_table = 0;
        Err(error.context("growing a table failed"))
    }

    fn instances(&self) -> usize {
        MAX_CORE_INSTANCES
    }

    fn tables(&self) -> usize {
        MAX_TABLES
    }

    fn memories(&self) -> usize {
        MAX_MEMORIES
    }
}

/// The run's clock as a plugin sees it. The wall clock and `tick-time-ms` read the
/// tick's time. The monotonic clock starts there too, but a plugin that sleeps (a
/// `wasi:clocks/monotonic-clock` pollable, which `std::thread::sleep` compiles to) does
/// not wait: its pollable is ready at once and its monotonic time jumps ahead by the
/// sleep, so a sleeping plugin can neither hold up the control loop (fuel and the epoch
/// deadline do not run while a guest waits in a host call) nor make a replay differ.
#[derive(Debug, Clone, Default)]
pub(super) struct TickClock(Arc<ClockState>);

#[derive(Debug, Default)]
struct ClockState {
    tick_nanos: AtomicU64,
    monotonic_nanos: AtomicU64,
}

impl TickClock {
    fn nanos(&self) -> u64 {
        self.0.tick_nanos.load(Ordering::Relaxed)
    }

    fn set(&self, nanos: u64) {
        self.0.tick_nanos.store(nanos, Ordering::Relaxed);
        // Monotonic: never back, even after a long sleep ran it ahead of the ticks.
        self.0.monotonic_nanos.fetch_max(nanos, Ordering::Relaxed);
    }

    pub(super) fn monotonic(&self) -> u64 {
        self.0.monotonic_nanos.load(Ordering::Relaxed)
    }

    /// Move the monotonic clock to `until` at once (a sleep that took no time).
    fn advance_to(&self, until: u64) {
        self.0.monotonic_nanos.fetch_max(until, Ordering::Relaxed);
    }
}

impl HostWallClock for TickClock {
    fn resolution(&self) -> Duration {
        Duration::from_millis(1)
    }
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos())
    }
}

impl HostMonotonicClock for TickClock {
    fn resolution(&self) -> u64 {
        1_000_000
    }
    fn now(&self) -> u64 {
        self.monotonic()
    }
}

/// A pollable that is ready at once: what every monotonic-clock subscription returns.
struct Ready;

impl Pollable for Ready {
    fn ready<'life0, 'async_trait>(
        &'life0 mut self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(std::future::ready(()))
    }
}

/// `wasi:clocks/monotonic-clock` on the virtual clock, shadowing wasmtime-wasi's (whose
/// subscriptions wait in real time).
pub(super) struct VirtualMonotonicClock<'a> {
    clock: &'a TickClock,
    table: &'a mut ResourceTable,
}

impl VirtualMonotonicClock<'_> {
    fn ready_after(&mut self, until: u64) -> wasmtime::Result<Resource<DynPollable>> {
        self.clock.advance_to(until);
        let ready = self.table.push(Ready)?;
        subscribe(self.table, ready)
    }
}

impl monotonic_clock::Host for VirtualMonotonicClock<'_> {
    fn now(&mut self) -> wasmtime::Result<monotonic_clock::Instant> {
        Ok(self.clock.monotonic())
    }

    fn resolution(&mut self) -> wasmtime::Result<monotonic_clock::Duration> {
        Ok(1_000_000)
    }

    fn subscribe_instant(
        &mut self,
        when: monotonic_clock::Instant,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        self.ready_after(when)
    }

    fn subscribe_duration(
        &mut self,
        duration: monotonic_clock::Duration,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        let until = self.clock.monotonic().saturating_add(duration);
        self.ready_after(until)
    }
}

/// Selects [`VirtualMonotonicClock`] as the data the shadowing bindings see.
pub(super) struct HasVirtualClock;

impl HasData for HasVirtualClock {
    type Data<'a> = VirtualMonotonicClock<'a>;
}

/// Replace WASI's monotonic clock in `linker` (which already holds all of WASI) with the
/// virtual one.
pub(super) fn shadow_monotonic_clock(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let result = monotonic_clock::add_to_linker::<HostState, HasVirtualClock>(linker, |state| {
        VirtualMonotonicClock {
            clock: &state.clock,
            table: &mut state.table,
        }
    });
    linker.allow_shadowing(false);
    result
}

/// The data of one plugin store.
pub(super) struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    pub(super) limiter: InstanceLimiter,
    rng: crate::rng::Rng,
    clock: TickClock,
    policy_name: Arc<str>,
    log_budget: u32,
    log_messages_per_call: u32,
    logs_dropped: u64,
    /// The last error-level message of the current call (a panic report), even if the
    /// rate limit dropped it, to name the cause of a trap.
    last_error_log: Option<String>,
}

impl HostState {
    pub(super) fn new(policy_name: &str, seed: u64, limits: &SandboxLimits) -> Self {
        let clock = TickClock::default();
        let mut builder = WasiCtxBuilder::new();
        // No preopens, environment, arguments or network: the builder grants none unless
        // asked. Stdin is closed and stdout/stderr discard, which the builder's defaults
        // are and which are set here anyway, since their pollables must never block (a
        // guest waiting in `wasi:io/poll.poll` is beyond fuel and the epoch deadline).
        // Random and clocks are replaced so a run replays exactly; the monotonic clock's
        // subscriptions are shadowed in the linker (`shadow_monotonic_clock`).
        builder
            .stdin(wasmtime_wasi::p2::pipe::ClosedInputStream)
            .stdout(wasmtime_wasi::p2::pipe::SinkOutputStream)
            .stderr(wasmtime_wasi::p2::pipe::SinkOutputStream)
            .secure_random(crate::rng::Rng::stream(seed, RANDOM_STREAM_WASI_SECURE))
            .insecure_random(crate::rng::Rng::stream(seed, RANDOM_STREAM_WASI_INSECURE))
            .insecure_random_seed(u128::from(seed))
            .wall_clock(clock.clone())
            .monotonic_clock(clock.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false);
        let limit_bytes =
            usize::try_from(limits.memory_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX);
        let mut table = ResourceTable::new();
        table.set_max_capacity(MAX_HOST_RESOURCES);
        Self {
            wasi: builder.build(),
            table,
            limiter: InstanceLimiter::new(limit_bytes),
            rng: crate::rng::Rng::stream(seed, RANDOM_STREAM_CONTRACT),
            clock,
            policy_name: Arc::from(policy_name),
            log_budget: limits.log_messages_per_call,
            log_messages_per_call: limits.log_messages_per_call,
            logs_dropped: 0,
            last_error_log: None,
        }
    }

    pub(super) fn begin_call(&mut self) {
        self.log_budget = self.log_messages_per_call;
        self.last_error_log = None;
    }

    pub(super) fn last_error_log(&self) -> Option<&str> {
        self.last_error_log.as_deref()
    }

    pub(super) fn set_tick_time(&mut self, t: Duration) {
        let nanos = u64::try_from(t.as_nanos()).unwrap_or(u64::MAX);
        self.clock.set(nanos);
    }

    #[cfg(test)]
    pub(super) fn clock_for_tests(&self) -> TickClock {
        self.clock.clone()
    }

    #[cfg(test)]
    pub(super) fn virtual_clock_for_tests(&mut self) -> VirtualMonotonicClock<'_> {
        VirtualMonotonicClock {
            clock: &self.clock,
            table: &mut self.table,
        }
    }

    pub(super) fn logs_dropped(&self) -> u64 {
        self.logs_dropped
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl types::Host for HostState {}

impl host::Host for HostState {
    fn log(&mut self, level: types::LogLevel, message: String) {
        if matches!(level, types::LogLevel::Error) {
            self.last_error_log = Some(sanitize_text(&message, PLUGIN_TEXT_MAX_BYTES));
        }
        if self.log_budget == 0 {
            self.logs_dropped += 1;
            return;
        }
        self.log_budget -= 1;
        let message = sanitize_text(&message, PLUGIN_TEXT_MAX_BYTES);
        let policy = &*self.policy_name;
        match level {
            types::LogLevel::Trace => tracing::trace!(target: "plugin", policy, "{message}"),
            types::LogLevel::Debug => tracing::debug!(target: "plugin", policy, "{message}"),
            types::LogLevel::Info => tracing::info!(target: "plugin", policy, "{message}"),
            types::LogLevel::Warn => tracing::warn!(target: "plugin", policy, "{message}"),
            types::LogLevel::Error => tracing::error!(target: "plugin", policy, "{message}"),
        }
    }

    fn random(&mut self) -> u64 {
        self.rng.next_u64()
    }

    fn tick_time_ms(&mut self) -> u64 {
        self.clock.nanos() / 1_000_000
    }
}
