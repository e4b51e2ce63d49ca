//! What a plugin instance may touch: its memory (limited), fuel and deadline (armed per
//! call by the host), the `tokwatt:policy/host` imports, and a WASI context with nothing
//! in it but a bounded console: what the guest writes to its standard output and error
//! is kept (the last [`GUEST_OUTPUT_TAIL_BYTES`] of each), so a failed call can show the
//! traceback or panic message a guest printed before it trapped.

mod clock;
mod console;
mod limits;

#[cfg(test)]
use clock::VirtualMonotonicClock;
pub(crate) use clock::{TickClock, shadow_monotonic_clock};
pub(crate) use console::{ConsoleStream, Stream};
pub use console::{GUEST_OUTPUT_TAIL_BYTES, GuestConsole, GuestLog, GuestOutput};
pub(crate) use limits::{InstanceLimiter, LimitHit, MAX_HOST_RESOURCES, MAX_TABLE_ELEMENTS};

use std::sync::Arc;
use std::time::Duration;
use tokwatt_policy::limits::SandboxLimits;

use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use crate::text::{PLUGIN_TEXT_MAX_BYTES, sanitize_text};

/// A plugin's random streams (see `tokwatt_core::rng`): the contract's `random` import and WASI's
/// two random interfaces each draw from their own, so a plugin's use of one never shifts
/// the others, and the simulator's streams (small numbers) are never shared.
const RANDOM_STREAM_CONTRACT: u64 = 0x706C_7567_0001;
const RANDOM_STREAM_WASI_SECURE: u64 = 0x706C_7567_0002;
const RANDOM_STREAM_WASI_INSECURE: u64 = 0x706C_7567_0003;

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

    use super::console::{FAILURE_TAIL_BYTES, TailBuffer};
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
