//! The WebAssembly plugin host: the only code that knows wasmtime.
//!
//! A policy is a component implementing `tokwatt:policy@0.4.*` (see `wit/policy.wit`) or
//! an earlier line, 0.3, 0.2 or 0.1 (`wit/0.3/policy.wit`, `wit/0.2/policy.wit`,
//! `wit/0.1/policy.wit`), each served on its own bindings (`lines`).
//! Loading validates the file, checks the contract version, compiles it (or takes the
//! compiled form from the on-disk cache) and links it once into an `InstancePre`, so
//! instantiating a fresh copy after a trap is cheap. Each instance runs sandboxed: a
//! fuel budget and an epoch deadline per call, a memory limit, and a locked-down WASI
//! context (no filesystem, network, environment or arguments; clocks and random made
//! deterministic) — plain Rust guests import WASI through std even when they never use it.

mod binary;
mod cache;
mod contract;
pub mod inspect;
mod lines;
mod sandbox;
pub(crate) mod text;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine, Store};

pub use cache::ComponentCache;
pub use sandbox::{GUEST_OUTPUT_TAIL_BYTES, GuestConsole, GuestLog, GuestOutput};
pub use text::{PLUGIN_TEXT_MAX_BYTES, sanitize_text};
pub use tokwatt_policy::limits::{DEADLINE_MARGIN, SandboxLimits};

use contract::{check_component_header, check_contract_version, check_guest_signatures};
use lines::{Guest, Line, PolicyPre};
use sandbox::{HostState, LimitHit};
use tokwatt_core::types::{Observation, Settings};
use tokwatt_policy::supervisor::{InitArgs, PolicyEngine, PolicyFailure, PolicyState, stderr_note};

/// The contract this host implements, and the versions it accepts.
pub const CONTRACT_PACKAGE: &str = "tokwatt:policy";
/// The newest contract this host implements; [`served_versions`] lists every line it
/// accepts.
pub const CONTRACT_VERSION: &str = "0.4.0";
const GUEST_INTERFACE: &str = "tokwatt:policy/guest";

/// How often the epoch ticker advances; deadlines are rounded up to it.
const EPOCH_PERIOD: Duration = Duration::from_millis(2);

/// Epochs from arming a call to interrupting it: `deadline_ms` × [`DEADLINE_MARGIN`],
/// rounded up to the epoch period, plus one period for the phase of the ticker.
fn deadline_epochs(deadline_ms: u64) -> u64 {
    let period = u64::try_from(EPOCH_PERIOD.as_millis()).unwrap_or(1).max(1);
    deadline_ms
        .saturating_mul(DEADLINE_MARGIN)
        .div_ceil(period)
        .max(1)
        .saturating_add(1)
}

#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("cannot read plugin {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path} is not a WebAssembly file (it does not start with the `\\0asm` magic): point the policy spec's `plugin` at a .wasm component"
    )]
    NotWasm { path: PathBuf },
    #[error(
        "{path} is truncated: it has {len} bytes, and a WebAssembly file has at least 8 (the `\\0asm` magic and a version); rebuild or copy the plugin again"
    )]
    Truncated { path: PathBuf, len: usize },
    #[error(
        "{path} is a core WebAssembly module, not a component: build it for the wasm32-wasip2 target (`cargo build --target wasm32-wasip2`), or wrap it with `wasm-tools component new`"
    )]
    CoreModule { path: PathBuf },
    #[error("{path} is not a valid WebAssembly component: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error(
        "{path} does not export `{GUEST_INTERFACE}`: it is not a tokwatt policy (a policy implements the world `policy` of wit/policy.wit)"
    )]
    NotAPolicy { path: PathBuf },
    #[error(
        "{path} implements `{found}`, but this tokwatt accepts {CONTRACT_PACKAGE}@{accepted}: rebuild the plugin against the contract in this tokwatt's wit/ folder"
    )]
    WrongVersion {
        path: PathBuf,
        found: String,
        accepted: String,
    },
    /// Found from the binary's import names, before anything is compiled.
    #[error("{path} {problems}")]
    ImportNotProvided { path: PathBuf, problems: String },
    #[error(
        "{path} needs imports this host does not offer ({reason}); a policy may import only tokwatt:policy/host and the WASI 0.2 interfaces that Rust's std pulls in"
    )]
    Link { path: PathBuf, reason: String },
    #[error(
        "{path} exports `{GUEST_INTERFACE}` with the wrong types ({reason}): rebuild the plugin against the contract in this tokwatt's wit/ folder"
    )]
    Contract { path: PathBuf, reason: String },
    #[error("the WebAssembly engine could not be set up: {0}")]
    Engine(String),
}

/// Engine-wide settings.
#[derive(Debug, Clone, Default)]
pub struct HostConfig {
    /// Where compiled components are cached; `None` disables the cache.
    pub cache_dir: Option<PathBuf>,
}

/// Advances the engine's epoch so that calls past their deadline are interrupted.
#[derive(Debug)]
struct EpochTicker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EpochTicker {
    fn start(engine: Engine) -> Result<Self, PluginError> {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name("tokwatt-epoch".into())
            .spawn({
                let stop = Arc::clone(&stop);
                move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(EPOCH_PERIOD);
                        engine.increment_epoch();
                    }
                }
            })
            .map_err(|e| PluginError::Engine(format!("cannot start the epoch thread: {e}")))?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The engine, linker and cache, shared by every plugin of a process.
pub struct PluginHost {
    engine: Engine,
    linker: Linker<HostState>,
    cache: Option<ComponentCache>,
    _ticker: Arc<EpochTicker>,
}

impl std::fmt::Debug for PluginHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginHost")
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

impl PluginHost {
    pub fn new(config: &HostConfig) -> Result<Self, PluginError> {
        let mut wasm_config = Config::new();
        wasm_config
            .wasm_component_model(true)
            .consume_fuel(true)
            .epoch_interruption(true)
            .cranelift_opt_level(wasmtime::OptLevel::Speed);
        let engine =
            Engine::new(&wasm_config).map_err(|e| PluginError::Engine(format!("{e:#}")))?;
        let mut linker = Linker::<HostState>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)
            .map_err(|e| PluginError::Engine(format!("linking WASI: {e:#}")))?;
        sandbox::shadow_monotonic_clock(&mut linker)
            .map_err(|e| PluginError::Engine(format!("linking the virtual clock: {e:#}")))?;
        for line in Line::SERVED {
            line.add_to_linker(&mut linker).map_err(|e| {
                PluginError::Engine(format!(
                    "linking tokwatt:policy/host@{}: {e:#}",
                    line.pattern()
                ))
            })?;
        }
        let cache = config
            .cache_dir
            .as_ref()
            .map(|dir| ComponentCache::new(dir.clone(), &engine));
        let ticker = EpochTicker::start(engine.clone())?;
        Ok(Self {
            engine,
            linker,
            cache,
            _ticker: Arc::new(ticker),
        })
    }

    /// The compiled-component cache this host loads through, if it has one (its hit
    /// count tells a caller whether a load compiled).
    pub fn cache(&self) -> Option<&ComponentCache> {
        self.cache.as_ref()
    }

    /// Validate, compile (or load from the cache) and link a policy component.
    pub fn load(
        &self,
        path: &Path,
        name: &str,
        limits: SandboxLimits,
    ) -> Result<LoadedPlugin, PluginError> {
        let bytes = read_component(path)?;
        check_component_header(path, &bytes)?;
        refuse_unprovided_imports(path, &bytes)?;
        let component = match &self.cache {
            Some(cache) => cache.load_or_compile(&self.engine, &bytes),
            None => Component::new(&self.engine, &bytes).map_err(|e| format!("{e:#}")),
        }
        .map_err(|reason| PluginError::Invalid {
            path: path.to_owned(),
            reason: sanitize_text(&reason, PLUGIN_TEXT_MAX_BYTES),
        })?;
        let (guest_export, line) = check_contract_version(&self.engine, path, &component)?;
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| PluginError::Link {
                path: path.to_owned(),
                reason: error_text(&e),
            })?;
        check_guest_signatures(&self.engine, &pre, name, &limits, &guest_export, line).map_err(
            |reason| PluginError::Contract {
                path: path.to_owned(),
                reason,
            },
        )?;
        let pre = PolicyPre::new(line, pre).map_err(|e| PluginError::Contract {
            path: path.to_owned(),
            reason: error_text(&e),
        })?;
        Ok(LoadedPlugin {
            engine: self.engine.clone(),
            pre,
            name: name.to_owned(),
            path: path.to_owned(),
            limits,
            _ticker: Arc::clone(&self._ticker),
        })
    }
}

/// Refuses a component whose binary names a WASI or other import the sandbox does not provide, before
/// the compiler spends seconds on it (15-20 s for a JavaScript or Python component). Bytes
/// that do not parse pass here: the compiler names what is wrong with them.
fn refuse_unprovided_imports(path: &Path, bytes: &[u8]) -> Result<(), PluginError> {
    let Ok(names) = binary::top_level_imports(bytes) else {
        return Ok(());
    };
    let problems = unprovided_before_compiling(&names);
    if problems.is_empty() {
        return Ok(());
    }
    Err(PluginError::ImportNotProvided {
        path: path.to_owned(),
        problems: problems.join("; it also "),
    })
}

/// Why each of `names` that the sandbox does not provide is refused, for the imports
/// refused before compiling. A contract import of another version is left to the
/// contract check after compiling, whose error names the version the component
/// implements.
fn unprovided_before_compiling(names: &[String]) -> Vec<String> {
    names
        .iter()
        .filter(|name| !name.starts_with(CONTRACT_PACKAGE))
        .filter_map(|name| inspect::import_verdict(name).err())
        .collect()
}

/// A compiled, linked policy, ready to instantiate any number of times.
pub struct LoadedPlugin {
    engine: Engine,
    pre: PolicyPre,
    name: String,
    path: PathBuf,
    limits: SandboxLimits,
    _ticker: Arc<EpochTicker>,
}

impl std::fmt::Debug for LoadedPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedPlugin")
            .field("name", &self.name)
            .field("path", &self.path)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl LoadedPlugin {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The contract line the plugin was built against and is served on (`0.1.*`, `0.2.*`,
    /// `0.3.*`, `0.4.*`).
    pub fn contract_line(&self) -> &'static str {
        self.pre.line().pattern()
    }

    /// A fresh sandboxed instance, seeded for exact replay.
    pub fn instantiate(self: &Arc<Self>, seed: u64) -> Result<WasmPolicy, PolicyFailure> {
        let console = GuestConsole::default();
        let (store, bindings) = self.new_instance(seed, 0, &console)?;
        Ok(WasmPolicy {
            plugin: Arc::clone(self),
            store,
            bindings,
            seed,
            generation: 0,
            logs_dropped_before: 0,
            console,
        })
    }

    fn new_instance(
        &self,
        seed: u64,
        generation: u64,
        console: &GuestConsole,
    ) -> Result<(Store<HostState>, Guest), PolicyFailure> {
        // Each rebuild gets its own stream so a replay stays exact but a rebuilt
        // instance does not repeat the random numbers that led to its trap.
        let state = HostState::with_console(
            &self.name,
            seed ^ generation.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            &self.limits,
            console.clone(),
        );
        let mut store = Store::new(&self.engine, state);
        store.limiter(|state| &mut state.limiter);
        self.arm(&mut store)?;
        let bindings = self
            .pre
            .instantiate(&mut store)
            .map_err(|e| classify(&store, &self.limits, e))?;
        Ok((store, bindings))
    }

    /// Give the next call its fuel and deadline.
    fn arm(&self, store: &mut Store<HostState>) -> Result<(), PolicyFailure> {
        store
            .set_fuel(self.limits.fuel_per_call)
            .map_err(|e| PolicyFailure::Instantiate(format!("setting fuel: {e:#}")))?;
        store.set_epoch_deadline(deadline_epochs(self.limits.deadline_ms));
        store.epoch_deadline_trap();
        store.data_mut().begin_call();
        Ok(())
    }
}

/// Name a failed call: fuel, deadline, memory or table limit, too many memories or
/// instances, or a plain trap with its root cause.
fn classify(
    store: &Store<HostState>,
    limits: &SandboxLimits,
    error: wasmtime::Error,
) -> PolicyFailure {
    // The end of what the call wrote to standard error goes with every kind of stop.
    let stderr = store.data().call_stderr_tail();
    match store.data().limiter.hit() {
        Some(LimitHit::Memory) => {
            return PolicyFailure::MemoryLimit {
                limit_mib: limits.memory_mib,
                stderr,
            };
        }
        Some(LimitHit::Table) => {
            return PolicyFailure::TableLimit {
                limit_elements: sandbox::MAX_TABLE_ELEMENTS as u64,
                stderr,
            };
        }
        None => {}
    }
    match error.downcast_ref::<wasmtime::Trap>() {
        Some(wasmtime::Trap::OutOfFuel) => return PolicyFailure::OutOfFuel { stderr },
        Some(wasmtime::Trap::Interrupt) => {
            return PolicyFailure::Deadline {
                deadline_ms: limits.deadline_ms,
                stderr,
            };
        }
        _ => {}
    }
    let text = error_text(&error);
    // wasmtime checks the counts of core instances, memories and tables when it
    // instantiates, and says so only in words.
    if text.contains("resource limit exceeded") {
        return PolicyFailure::ResourceCount(text);
    }
    // The guest's own panic message reached the host through its `log` import just
    // before the trap (the trap itself carries none): name it beside the trap, and the
    // end of what the call wrote to standard error (a Python traceback, Rust's default
    // panic report).
    let mut message = text;
    if let Some(logged) = store.data().last_error_log() {
        message.push_str(&format!(" (the plugin logged: {logged})"));
    }
    message.push_str(&stderr_note(stderr.as_deref()));
    PolicyFailure::Trap(message)
}

/// An engine error as one safe line: the whole cause chain, without the wasm backtrace
/// (one context of the chain, many lines of addresses), escaped and bounded — the
/// messages may quote names and strings from the plugin.
fn error_text(error: &wasmtime::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in error.chain() {
        let part = cause.to_string();
        // `WasmBacktrace` is attached as a context, not an error type, so it is known by
        // its words.
        if part.starts_with("error while executing at wasm backtrace") {
            continue;
        }
        if !part.is_empty() && !parts.last().is_some_and(|last| last.contains(&part)) {
            parts.push(part);
        }
    }
    if parts.is_empty() {
        parts.push("unknown error".to_owned());
    }
    sanitize_text(&parts.join(": "), PLUGIN_TEXT_MAX_BYTES)
}

/// A string the plugin returned, made safe to show.
fn plugin_text(text: &str) -> String {
    sanitize_text(text, PLUGIN_TEXT_MAX_BYTES)
}

/// One sandboxed instance of a policy.
pub struct WasmPolicy {
    plugin: Arc<LoadedPlugin>,
    store: Store<HostState>,
    bindings: Guest,
    seed: u64,
    generation: u64,
    logs_dropped_before: u64,
    /// The guest's standard output and error, kept across rebuilds.
    console: GuestConsole,
}

impl std::fmt::Debug for WasmPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmPolicy")
            .field("plugin", &self.plugin)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl WasmPolicy {
    /// The guest's console: what it wrote to standard output and error (and, when
    /// transcribing, its log messages), for a caller that shows them (`tokwatt replay`).
    pub fn console(&self) -> GuestConsole {
        self.console.clone()
    }

    fn call<R>(
        &mut self,
        f: impl FnOnce(&Guest, &mut Store<HostState>) -> wasmtime::Result<R>,
    ) -> Result<R, PolicyFailure> {
        self.plugin.arm(&mut self.store)?;
        f(&self.bindings, &mut self.store)
            .map_err(|e| classify(&self.store, &self.plugin.limits, e))
    }
}

impl PolicyEngine for WasmPolicy {
    fn name(&self) -> &str {
        &self.plugin.name
    }

    fn init(&mut self, args: &InitArgs) -> Result<Vec<Settings>, PolicyFailure> {
        self.store.data_mut().set_tick_time(Duration::ZERO);
        let answer = self.call(|guest, store| guest.init(store, args))?;
        answer.map_err(|text| PolicyFailure::Refused(plugin_text(&text)))
    }

    fn decide(
        &mut self,
        tick_time: Duration,
        observations: &[Observation],
    ) -> Result<Vec<Settings>, PolicyFailure> {
        self.store.data_mut().set_tick_time(tick_time);
        self.call(|guest, store| guest.decide(store, observations))
    }

    fn snapshot(&mut self) -> Result<PolicyState, PolicyFailure> {
        self.call(|guest, store| guest.snapshot(store))
    }

    fn restore(&mut self, state: &PolicyState) -> Result<(), PolicyFailure> {
        self.call(|guest, store| guest.restore(store, state))?
            .map_err(|text| PolicyFailure::Refused(plugin_text(&text)))
    }

    fn rebuild(&mut self) -> Result<(), PolicyFailure> {
        self.logs_dropped_before += self.store.data().logs_dropped();
        self.generation += 1;
        let (store, bindings) =
            self.plugin
                .new_instance(self.seed, self.generation, &self.console)?;
        self.store = store;
        self.bindings = bindings;
        Ok(())
    }

    fn logs_dropped(&self) -> u64 {
        self.logs_dropped_before + self.store.data().logs_dropped()
    }
}

/// A component's bytes, read bounded ([`tokwatt_core::files::MAX_PLUGIN_BYTES`]).
pub fn read_component(path: &Path) -> Result<Vec<u8>, PluginError> {
    tokwatt_core::files::read_bounded(path, tokwatt_core::files::MAX_PLUGIN_BYTES).map_err(
        |source| PluginError::Read {
            path: path.to_owned(),
            source,
        },
    )
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod unit_tests {
    use super::contract::*;
    use super::*;

    #[test]
    fn contract_versions() {
        assert!(compatible_version("0.1.0"));
        assert!(compatible_version("0.1.7"));
        assert!(compatible_version("0.2.0"));
        assert!(compatible_version("0.3.0"));
        assert!(compatible_version("0.4.0"));
        assert!(compatible_version(CONTRACT_VERSION));
        assert!(!compatible_version("0.5.0"));
        assert!(!compatible_version("1.0.0"));
        assert!(!compatible_version(""));
        assert_eq!(accepted_versions(), "0.4.* or 0.3.* or 0.2.* or 0.1.*");
    }

    #[test]
    fn headers() {
        let p = Path::new("x.wasm");
        assert!(matches!(
            check_component_header(p, b"hello world"),
            Err(PluginError::NotWasm { .. })
        ));
        assert!(matches!(
            check_component_header(p, b"\0asm\x01\0\0\0"),
            Err(PluginError::CoreModule { .. })
        ));
        assert!(check_component_header(p, b"\0asm\x0d\0\x01\0").is_ok());
    }
}
