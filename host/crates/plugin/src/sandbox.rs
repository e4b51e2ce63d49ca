//! What a plugin instance may touch: its memory (limited), fuel and deadline (armed per
//! call by the host), the `tokwatt:policy/host` imports, and a WASI context with nothing
//! in it but a bounded console: what the guest writes to its standard output and error
//! is kept (the last [`GUEST_OUTPUT_TAIL_BYTES`] of each), so a failed call can show the
//! traceback or panic message a guest printed before it trapped.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;
use tokwatt_policy::limits::SandboxLimits;

use wasmtime::component::{HasData, Linker, Resource, ResourceTable};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::bindings::clocks::monotonic_clock;
use wasmtime_wasi::p2::{DynPollable, OutputStream, Pollable, StreamResult, subscribe};
use wasmtime_wasi::{
    HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView,
};

use super::text::{PLUGIN_TEXT_MAX_BYTES, sanitize_text};

/// A plugin's random streams (see `tokwatt_core::rng`): the contract's `random` import and WASI's
/// two random interfaces each draw from their own, so a plugin's use of one never shifts
/// the others, and the simulator's streams (small numbers) are never shared.
const RANDOM_STREAM_CONTRACT: u64 = 0x706C_7567_0001;
const RANDOM_STREAM_WASI_SECURE: u64 = 0x706C_7567_0002;
const RANDOM_STREAM_WASI_INSECURE: u64 = 0x706C_7567_0003;

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

/// How much of each of a guest's output streams (standard output, standard error) the
/// host keeps: the newest bytes. A guest writing more costs the host only this buffer
/// and a count of the bytes it no longer holds.
pub const GUEST_OUTPUT_TAIL_BYTES: usize = 16 * 1024;

/// How much of the standard error a failed call wrote is quoted in its failure message:
/// its end, where a traceback names the exception and a panic its message.
const FAILURE_TAIL_BYTES: usize = 1024;

/// Log messages kept for [`GuestConsole::take`] between two takes (only while
/// transcribing); further ones are counted.
const MAX_TRANSCRIBED_LOGS: usize = 256;

/// The newest bytes written to one stream, and how many were written in all.
#[derive(Debug, Default)]
struct TailBuffer {
    held: VecDeque<u8>,
    written: u64,
}

impl TailBuffer {
    fn push(&mut self, data: &[u8]) {
        self.written = self.written.saturating_add(data.len() as u64);
        // Only the end of a large write can survive; the rest is never copied.
        let kept = &data[data.len().saturating_sub(GUEST_OUTPUT_TAIL_BYTES)..];
        let overflow = (self.held.len() + kept.len()).saturating_sub(GUEST_OUTPUT_TAIL_BYTES);
        self.held.drain(..overflow);
        self.held.extend(kept);
    }

    /// The bytes written since the stream had `mark` bytes written, as far as they are
    /// still held, and how many of them are not.
    fn since(&self, mark: u64) -> (Vec<u8>, u64) {
        let wanted = self.written.saturating_sub(mark);
        let held = self.held.len();
        let have = usize::try_from(wanted).map_or(held, |wanted| wanted.min(held));
        let bytes = self.held.range(held - have..).copied().collect();
        (bytes, wanted - have as u64)
    }
}

/// One log message a guest sent through the contract's `log`, escaped.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GuestLog {
    /// `trace`, `debug`, `info`, `warn` or `error`.
    pub level: &'static str,
    pub message: String,
}

/// What a guest wrote between two [`GuestConsole::take`]s. Every line is escaped and
/// bounded (`plugin::text`), so it is safe to print.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct GuestOutput {
    pub stdout: Vec<String>,
    /// Bytes written to standard output that the bounded buffer no longer held.
    pub stdout_bytes_lost: u64,
    pub stderr: Vec<String>,
    pub stderr_bytes_lost: u64,
    /// Log messages that passed the per-call rate limit (only while transcribing).
    pub logs: Vec<GuestLog>,
    /// Log messages past [`MAX_TRANSCRIBED_LOGS`] between two takes.
    pub logs_lost: u64,
}

impl GuestOutput {
    pub fn is_empty(&self) -> bool {
        self.stdout.is_empty()
            && self.stderr.is_empty()
            && self.logs.is_empty()
            && self.stdout_bytes_lost == 0
            && self.stderr_bytes_lost == 0
            && self.logs_lost == 0
    }
}

#[derive(Debug, Default)]
struct ConsoleState {
    stdout: TailBuffer,
    stderr: TailBuffer,
    /// `written` of each stream at the last take.
    stdout_taken: u64,
    stderr_taken: u64,
    transcribe_logs: bool,
    logs: Vec<GuestLog>,
    logs_lost: u64,
}

/// A guest's console: its standard output and error (bounded tails) and, when asked, a
/// transcript of its log messages. Shared by the instances a `WasmPolicy` rebuilds, so
/// what a trapped instance wrote is still there after the rebuild.
#[derive(Debug, Clone, Default)]
pub struct GuestConsole(Arc<Mutex<ConsoleState>>);

impl GuestConsole {
    fn state(&self) -> MutexGuard<'_, ConsoleState> {
        // The state stays consistent whatever panicked while holding it: every update
        // is complete before the next.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keep the guest's log messages for [`GuestConsole::take`] (what `tokwatt replay`
    /// shows), besides sending them to the agent's log.
    pub fn transcribe_logs(&self, on: bool) {
        self.state().transcribe_logs = on;
    }

    /// What the guest wrote since the last take.
    pub fn take(&self) -> GuestOutput {
        let mut state = self.state();
        let (stdout, stdout_bytes_lost) = state.stdout.since(state.stdout_taken);
        let (stderr, stderr_bytes_lost) = state.stderr.since(state.stderr_taken);
        state.stdout_taken = state.stdout.written;
        state.stderr_taken = state.stderr.written;
        GuestOutput {
            stdout: escaped_lines(&stdout),
            stdout_bytes_lost,
            stderr: escaped_lines(&stderr),
            stderr_bytes_lost,
            logs: std::mem::take(&mut state.logs),
            logs_lost: std::mem::take(&mut state.logs_lost),
        }
    }

    fn write(&self, stream: Stream, data: &[u8]) {
        let mut state = self.state();
        match stream {
            Stream::Stdout => state.stdout.push(data),
            Stream::Stderr => state.stderr.push(data),
        }
    }

    pub(super) fn stderr_written(&self) -> u64 {
        self.state().stderr.written
    }

    /// The end of what was written to standard error since `mark` (at most
    /// [`FAILURE_TAIL_BYTES`], raw) and how many bytes came before it; `None` if nothing
    /// but white space was written.
    fn stderr_tail_raw_since(&self, mark: u64) -> Option<(String, u64)> {
        let (bytes, lost) = self.state().stderr.since(mark);
        let start = bytes.len().saturating_sub(FAILURE_TAIL_BYTES);
        let text = String::from_utf8_lossy(&bytes[start..]);
        if text.trim().is_empty() {
            return None;
        }
        Some((text.into_owned(), lost + start as u64))
    }

    /// The end of what was written to standard error since `mark`, escaped, as one
    /// line; `None` if nothing was.
    pub(super) fn stderr_tail_since(&self, mark: u64) -> Option<String> {
        let (text, earlier) = self.stderr_tail_raw_since(mark)?;
        // An escape takes at most 8 bytes per byte of text (`\u{1b}` for one), so the
        // bound never cuts the end, where the message that matters is.
        let shown = sanitize_text(text.trim(), 8 * FAILURE_TAIL_BYTES);
        Some(if earlier > 0 {
            format!("… ({earlier} bytes before) {shown}")
        } else {
            shown
        })
    }

    /// The same tail as [`GuestConsole::stderr_tail_since`], one entry per line the
    /// guest wrote (its indentation kept), each escaped: only the line breaks become
    /// real, so a reader can show a traceback as written while a guest still cannot
    /// write control characters to the operator's terminal. The first entry says how
    /// many bytes came before, if any were left out.
    pub(super) fn stderr_tail_lines_since(&self, mark: u64) -> Vec<String> {
        let Some((text, earlier)) = self.stderr_tail_raw_since(mark) else {
            return Vec::new();
        };
        let mut lines = Vec::new();
        if earlier > 0 {
            lines.push(format!("… ({earlier} bytes before)"));
        }
        let text = text.trim_start_matches(['\n', '\r']).trim_end();
        lines.extend(text.split('\n').map(|line| {
            let line = line.strip_suffix('\r').unwrap_or(line);
            sanitize_text(line, 8 * FAILURE_TAIL_BYTES)
        }));
        lines
    }

    fn log(&self, level: &'static str, message: &str) {
        let mut state = self.state();
        if !state.transcribe_logs {
            return;
        }
        if state.logs.len() < MAX_TRANSCRIBED_LOGS {
            state.logs.push(GuestLog {
                level,
                message: message.to_owned(),
            });
        } else {
            state.logs_lost += 1;
        }
    }
}

/// Each line of `bytes` (invalid UTF-8 replaced), escaped and bounded.
fn escaped_lines(bytes: &[u8]) -> Vec<String> {
    if bytes.is_empty() {
        return Vec::new();
    }
    let text = String::from_utf8_lossy(bytes);
    text.strip_suffix('\n')
        .unwrap_or(&text)
        .split('\n')
        .map(|line| sanitize_text(line, PLUGIN_TEXT_MAX_BYTES))
        .collect()
}

#[derive(Debug, Clone, Copy)]
enum Stream {
    Stdout,
    Stderr,
}

/// One of the guest's output streams, writing into its [`GuestConsole`]. Always ready
/// and never blocking (a guest waiting in `wasi:io/poll.poll` is beyond fuel and the
/// epoch deadline), never failing (a failed write to standard error makes a Rust
/// guest's `eprintln!` panic).
#[derive(Debug, Clone)]
struct ConsoleStream {
    console: GuestConsole,
    stream: Stream,
}

impl Pollable for ConsoleStream {
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

impl OutputStream for ConsoleStream {
    fn write(&mut self, bytes: bytes::Bytes) -> StreamResult<()> {
        self.console.write(self.stream, &bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        // The size wasmtime-wasi's own always-ready sink offers.
        Ok(64 * 1024)
    }
}

impl tokio::io::AsyncWrite for ConsoleStream {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.console.write(self.stream, buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl IsTerminal for ConsoleStream {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for ConsoleStream {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

/// The data of one plugin store.
pub(super) struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    pub(super) limiter: InstanceLimiter,
    rng: tokwatt_core::rng::Rng,
    clock: TickClock,
    policy_name: Arc<str>,
    log_budget: u32,
    log_messages_per_call: u32,
    logs_dropped: u64,
    /// The last error-level message of the current call (a panic report), even if the
    /// rate limit dropped it, to name the cause of a trap.
    last_error_log: Option<String>,
    /// Where the guest's standard output and error go.
    console: GuestConsole,
    /// How much the guest had written to standard error when the current call began.
    call_stderr_mark: u64,
}

impl HostState {
    /// A store's data whose console no one reads (the load-time contract check's).
    pub(super) fn new(policy_name: &str, seed: u64, limits: &SandboxLimits) -> Self {
        Self::with_console(policy_name, seed, limits, GuestConsole::default())
    }

    pub(super) fn with_console(
        policy_name: &str,
        seed: u64,
        limits: &SandboxLimits,
        console: GuestConsole,
    ) -> Self {
        let clock = TickClock::default();
        let mut builder = WasiCtxBuilder::new();
        // No preopens, environment, arguments or network: the builder grants none unless
        // asked. Stdin is closed; stdout and stderr go to the bounded console. Their
        // pollables must never block (a guest waiting in `wasi:io/poll.poll` is beyond
        // fuel and the epoch deadline): the closed input and the console are always ready.
        // Random and clocks are replaced so a run replays exactly; the monotonic clock's
        // subscriptions are shadowed in the linker (`shadow_monotonic_clock`).
        builder
            .stdin(wasmtime_wasi::p2::pipe::ClosedInputStream)
            .stdout(ConsoleStream {
                console: console.clone(),
                stream: Stream::Stdout,
            })
            .stderr(ConsoleStream {
                console: console.clone(),
                stream: Stream::Stderr,
            })
            .secure_random(tokwatt_core::rng::Rng::stream(
                seed,
                RANDOM_STREAM_WASI_SECURE,
            ))
            .insecure_random(tokwatt_core::rng::Rng::stream(
                seed,
                RANDOM_STREAM_WASI_INSECURE,
            ))
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
            rng: tokwatt_core::rng::Rng::stream(seed, RANDOM_STREAM_CONTRACT),
            clock,
            policy_name: Arc::from(policy_name),
            log_budget: limits.log_messages_per_call,
            log_messages_per_call: limits.log_messages_per_call,
            logs_dropped: 0,
            last_error_log: None,
            call_stderr_mark: console.stderr_written(),
            console,
        }
    }

    pub(super) fn begin_call(&mut self) {
        self.log_budget = self.log_messages_per_call;
        self.last_error_log = None;
        self.call_stderr_mark = self.console.stderr_written();
    }

    /// The end of what the guest wrote to standard error during the current call,
    /// escaped, as one line.
    pub(super) fn call_stderr_tail(&self) -> Option<String> {
        self.console.stderr_tail_since(self.call_stderr_mark)
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

/// The severity of a guest's log message, whichever contract line it came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GuestLogLevel {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

impl GuestLogLevel {
    fn name(self) -> &'static str {
        match self {
            Self::Trace => "trace",
            Self::Debug => "debug",
            Self::Info => "info",
            Self::Warn => "warn",
            Self::Error => "error",
        }
    }
}

/// The `tokwatt:policy/host` imports, the same on every contract line (each line's
/// generated trait delegates here).
impl HostState {
    pub(super) fn guest_log(&mut self, level: GuestLogLevel, message: String) {
        if level == GuestLogLevel::Error {
            self.last_error_log = Some(sanitize_text(&message, PLUGIN_TEXT_MAX_BYTES));
        }
        if self.log_budget == 0 {
            self.logs_dropped += 1;
            return;
        }
        self.log_budget -= 1;
        let message = sanitize_text(&message, PLUGIN_TEXT_MAX_BYTES);
        self.console.log(level.name(), &message);
        let policy = &*self.policy_name;
        match level {
            GuestLogLevel::Trace => tracing::trace!(target: "plugin", policy, "{message}"),
            GuestLogLevel::Debug => tracing::debug!(target: "plugin", policy, "{message}"),
            GuestLogLevel::Info => tracing::info!(target: "plugin", policy, "{message}"),
            GuestLogLevel::Warn => tracing::warn!(target: "plugin", policy, "{message}"),
            GuestLogLevel::Error => tracing::error!(target: "plugin", policy, "{message}"),
        }
    }

    pub(super) fn guest_random(&mut self) -> u64 {
        self.rng.next_u64()
    }

    pub(super) fn guest_tick_time_ms(&self) -> u64 {
        self.clock.nanos() / 1_000_000
    }
}

#[cfg(test)]
mod console_tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::{HostConfig, PluginHost};
    use tokwatt_core::types::Observation;
    use tokwatt_policy::supervisor::{InitArgs, PolicyEngine, PolicyFailure};

    #[test]
    fn a_tail_buffer_keeps_the_newest_bytes_and_counts_the_rest() {
        let mut tail = TailBuffer::default();
        tail.push(b"abc");
        assert_eq!(tail.since(0), (b"abc".to_vec(), 0));
        assert_eq!(tail.since(1), (b"bc".to_vec(), 0));
        let flood = vec![b'x'; 3 * GUEST_OUTPUT_TAIL_BYTES];
        tail.push(&flood);
        tail.push(b"end");
        assert_eq!(tail.held.len(), GUEST_OUTPUT_TAIL_BYTES, "bounded");
        let (bytes, lost) = tail.since(0);
        assert!(bytes.ends_with(b"xxend"));
        assert_eq!(bytes.len(), GUEST_OUTPUT_TAIL_BYTES);
        assert_eq!(
            lost,
            3 + 3 * GUEST_OUTPUT_TAIL_BYTES as u64 + 3 - bytes.len() as u64
        );
        // Nothing new since the end.
        assert_eq!(tail.since(tail.written), (Vec::new(), 0));
    }

    #[test]
    fn taking_the_console_returns_only_what_is_new_escaped_line_by_line() {
        let console = GuestConsole::default();
        console.transcribe_logs(true);
        console.write(Stream::Stderr, b"first\nsecond \x1b[2J\n");
        console.write(Stream::Stdout, b"out");
        console.log("info", "hello");
        let taken = console.take();
        assert_eq!(taken.stderr, ["first", "second \\u{1b}[2J"]);
        assert_eq!(taken.stdout, ["out"]);
        assert_eq!(
            taken.logs,
            [GuestLog {
                level: "info",
                message: "hello".into()
            }]
        );
        assert!(console.take().is_empty(), "taken once");
        console.write(Stream::Stderr, b"third\n");
        assert_eq!(console.take().stderr, ["third"]);
    }

    #[test]
    fn the_failure_tail_is_the_end_of_the_calls_stderr_escaped_on_one_line() {
        let console = GuestConsole::default();
        console.write(Stream::Stderr, b"an earlier call\n");
        let mark = console.stderr_written();
        assert_eq!(console.stderr_tail_since(mark), None);
        let mut flood = vec![b'x'; 5000];
        flood.extend_from_slice(b"\nValueError: boom\x1b[2J\n");
        console.write(Stream::Stderr, &flood);
        let tail = console.stderr_tail_since(mark).expect("a tail");
        assert!(tail.ends_with("\\nValueError: boom\\u{1b}[2J"), "{tail}");
        assert!(
            tail.starts_with(&format!(
                "… ({} bytes before) ",
                flood.len() - FAILURE_TAIL_BYTES
            )),
            "{tail}"
        );
        assert!(!tail.contains("earlier call"));
        assert!(!tail.chars().any(char::is_control), "{tail}");
    }

    #[test]
    fn the_failure_tail_as_lines_keeps_indentation_and_escapes_control_characters() {
        let console = GuestConsole::default();
        console.write(Stream::Stderr, b"an earlier call\n");
        let mark = console.stderr_written();
        assert!(console.stderr_tail_lines_since(mark).is_empty());
        console.write(
            Stream::Stderr,
            b"\nTraceback (most recent call last):\r\n  File \"app.py\"\nValueError: boom\x1b[2J\t\\n\n\n",
        );
        assert_eq!(
            console.stderr_tail_lines_since(mark),
            [
                "Traceback (most recent call last):",
                "  File \"app.py\"",
                "ValueError: boom\\u{1b}[2J\\t\\\\n",
            ]
        );
        let mut flood = vec![b'x'; 5000];
        flood.extend_from_slice(b"\nlast\n");
        console.write(Stream::Stderr, &flood);
        let lines = console.stderr_tail_lines_since(mark);
        let before = lines.first().expect("a first line");
        assert!(
            before.starts_with("… (") && before.ends_with(" bytes before)"),
            "{before}"
        );
        assert_eq!(lines.last().map(String::as_str), Some("last"));
        assert!(
            lines.iter().all(|line| !line.chars().any(char::is_control)),
            "{lines:?}"
        );
    }

    fn stderr_trap() -> Arc<crate::LoadedPlugin> {
        stderr_trap_within(SandboxLimits::default())
    }

    fn stderr_trap_within(limits: SandboxLimits) -> Arc<crate::LoadedPlugin> {
        let path = tokwatt_plugin_artifacts::built_plugin("fixture_stderr_trap");
        let host = PluginHost::new(&HostConfig::default()).expect("host");
        Arc::new(host.load(&path, "stderr-trap", limits).expect("loads"))
    }

    /// The stderr-trap fixture's first `decide` fails by `fail_by` under `limits`.
    fn first_decide_failing_by(fail_by: &str, limits: SandboxLimits) -> PolicyFailure {
        let mut policy = stderr_trap_within(limits)
            .instantiate(1)
            .expect("instantiates");
        let mut args = InitArgs::typical_h200(1);
        args.params = vec![
            ("good_calls".into(), "0".into()),
            ("fail_by".into(), fail_by.into()),
        ];
        policy.init(&args).expect("init");
        policy
            .decide(Duration::from_secs(1), &[Observation::typical_h200(0, 0)])
            .expect_err("a limit stops it")
    }

    #[test]
    fn a_guest_stopped_by_a_limit_shows_what_it_wrote_to_stderr() {
        let said = |what: &str| {
            Some(format!(
                "stderr-trap: deciding tick 0\\nstderr-trap: decide call 1 {what} without end"
            ))
        };
        assert_eq!(
            first_decide_failing_by("spin", SandboxLimits::default()),
            PolicyFailure::OutOfFuel {
                stderr: said("loops")
            }
        );
        let slow = SandboxLimits {
            fuel_per_call: u64::MAX / 2,
            deadline_ms: 20,
            ..SandboxLimits::default()
        };
        assert_eq!(
            first_decide_failing_by("spin", slow),
            PolicyFailure::Deadline {
                deadline_ms: 20,
                stderr: said("loops")
            }
        );
        let small = SandboxLimits {
            memory_mib: 16,
            ..SandboxLimits::default()
        };
        // Rust's allocator may add its own last words ("memory allocation of … failed").
        let failure = first_decide_failing_by("grow", small);
        let PolicyFailure::MemoryLimit {
            limit_mib: 16,
            stderr: Some(tail),
        } = &failure
        else {
            panic!("the memory limit: {failure:?}");
        };
        assert!(
            tail.starts_with(
                "stderr-trap: deciding tick 0\\nstderr-trap: decide call 1 grows without end"
            ),
            "{tail}"
        );
        assert!(
            failure
                .to_string()
                .contains("(all its memories together) (its standard error: stderr-trap: deciding"),
            "{failure}"
        );
    }

    #[test]
    fn a_trap_names_the_traceback_the_guest_wrote_to_stderr() {
        let mut policy = stderr_trap().instantiate(1).expect("instantiates");
        let mut args = InitArgs::typical_h200(1);
        args.params = vec![("good_calls".into(), "1".into())];
        policy.init(&args).expect("init");
        let observations = [Observation::typical_h200(0, 0)];
        policy
            .decide(Duration::from_secs(1), &observations)
            .expect("the first call succeeds");
        let failure = policy
            .decide(Duration::from_secs(2), &observations)
            .expect_err("the second call traps");
        let PolicyFailure::Trap(message) = &failure else {
            panic!("a trap: {failure:?}");
        };
        assert!(message.contains("unreachable"), "{message}");
        assert!(
            message.contains("(its standard error: stderr-trap: deciding tick 0\\nTraceback (most recent call last):"),
            "only this call's output, from its start: {message}"
        );
        assert!(
            message.contains(
                "ValueError: fixture stderr-trap: decide call 2 raises on purpose\\u{1b}[2J)"
            ),
            "{message}"
        );
        // The console keeps everything across the rebuild, for a reader such as replay.
        policy.rebuild().expect("rebuilds");
        let output = policy.console().take();
        assert_eq!(
            output.stderr.first().map(String::as_str),
            Some("stderr-trap: init for 1 GPUs")
        );
        assert!(
            output
                .stderr
                .iter()
                .any(|line| line.starts_with("ValueError:"))
        );
    }

    #[test]
    fn a_stderr_flood_costs_the_host_only_its_bounded_buffer() {
        let mut policy = stderr_trap().instantiate(1).expect("instantiates");
        let mut args = InitArgs::typical_h200(1);
        let flood_bytes = 4 << 20;
        args.params = vec![
            ("good_calls".into(), "0".into()),
            ("flood_bytes".into(), flood_bytes.to_string()),
        ];
        policy.init(&args).expect("init");
        let failure = policy
            .decide(Duration::from_secs(1), &[Observation::typical_h200(0, 0)])
            .expect_err("traps after the flood");
        let message = failure.to_string();
        assert!(message.contains("bytes before) "), "{message}");
        assert!(
            message.contains("ValueError: fixture stderr-trap"),
            "{message}"
        );
        assert!(
            message.len() < 4 * FAILURE_TAIL_BYTES,
            "{} bytes",
            message.len()
        );
        let output = policy.console().take();
        let held: usize = output.stderr.iter().map(|line| line.len() + 1).sum();
        assert!(held <= GUEST_OUTPUT_TAIL_BYTES + 64, "{held} bytes held");
        assert!(output.stderr_bytes_lost >= flood_bytes - GUEST_OUTPUT_TAIL_BYTES as u64);
    }
}
