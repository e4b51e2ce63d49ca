//! What a plugin instance may touch: its memory (limited), fuel and deadline (armed per
//! call by the host), the `tokwatt:policy/host` imports, and a WASI context with nothing
//! in it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use wasmtime::component::ResourceTable;
use wasmtime_wasi::{
    HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView,
};

use super::bindings::tokwatt::policy::{host, types};

/// Per-plugin sandbox limits, from the policy spec's `[sandbox]` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxLimits {
    /// WebAssembly instructions (roughly) one call may execute.
    pub fuel_per_call: u64,
    /// Wall-clock time one call may take.
    pub deadline_ms: u64,
    /// Linear memory the instance may grow to.
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

/// Longest log message kept; longer ones are cut.
const LOG_MESSAGE_MAX_BYTES: usize = 1024;

/// Enforces the memory limit and remembers that it did, so the trap can be named.
#[derive(Debug)]
pub(super) struct MemoryLimiter {
    limit_bytes: usize,
    hit: bool,
}

impl MemoryLimiter {
    pub(super) fn hit(&self) -> bool {
        self.hit
    }
}

impl wasmtime::ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.limit_bytes {
            self.hit = true;
            // An error (rather than `Ok(false)`) traps at once instead of handing the guest
            // a failed `memory.grow` it may ignore.
            return Err(wasmtime::Error::msg(format!(
                "memory limit: growing to {desired} bytes exceeds {} bytes",
                self.limit_bytes
            )));
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }
}

/// The run's clock as a plugin sees it, through both its own import and WASI's clocks.
#[derive(Debug, Clone, Default)]
struct TickClock(Arc<AtomicU64>);

impl TickClock {
    fn nanos(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
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
        self.nanos()
    }
}

/// The data of one plugin store.
pub(super) struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    pub(super) limiter: MemoryLimiter,
    rng: StdRng,
    clock: TickClock,
    policy_name: Arc<str>,
    log_budget: u32,
    log_messages_per_call: u32,
    logs_dropped: u64,
}

impl HostState {
    pub(super) fn new(policy_name: &str, seed: u64, limits: &SandboxLimits) -> Self {
        let clock = TickClock::default();
        let mut builder = WasiCtxBuilder::new();
        // No preopens, environment, arguments, stdio or network: the builder grants none
        // unless asked. Random and clocks are replaced so a run replays exactly.
        builder
            .secure_random(StdRng::seed_from_u64(seed ^ 0x5EC0_4E00))
            .insecure_random(StdRng::seed_from_u64(seed ^ 0x1A5E_C04E))
            .insecure_random_seed(u128::from(seed))
            .wall_clock(clock.clone())
            .monotonic_clock(clock.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false);
        let limit_bytes =
            usize::try_from(limits.memory_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX);
        Self {
            wasi: builder.build(),
            table: ResourceTable::new(),
            limiter: MemoryLimiter {
                limit_bytes,
                hit: false,
            },
            rng: StdRng::seed_from_u64(seed),
            clock,
            policy_name: Arc::from(policy_name),
            log_budget: limits.log_messages_per_call,
            log_messages_per_call: limits.log_messages_per_call,
            logs_dropped: 0,
        }
    }

    pub(super) fn begin_call(&mut self) {
        self.log_budget = self.log_messages_per_call;
    }

    pub(super) fn set_tick_time(&mut self, t: Duration) {
        let nanos = u64::try_from(t.as_nanos()).unwrap_or(u64::MAX);
        self.clock.0.store(nanos, Ordering::Relaxed);
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
        if self.log_budget == 0 {
            self.logs_dropped += 1;
            return;
        }
        self.log_budget -= 1;
        let mut message = message;
        if message.len() > LOG_MESSAGE_MAX_BYTES {
            let mut cut = LOG_MESSAGE_MAX_BYTES;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push('…');
        }
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
