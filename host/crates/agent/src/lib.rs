//! The node agent: putting a run together (the policy spec, the plugin, the backends, the
//! envelope and the loop) and running it. The `tokwatt` binary, the daemon, the lab and the
//! tests all go through here, so what the tests check is what operators run.
//!
//! - [`node`]: where a node is put together (backends, the settings guard, the plugin
//!   host), by one rule for every command.
//! - [`assembly`]: the backends a run asks for (simulator, NVML, CUDA decode, a serving
//!   engine), assembled behind the boundary traits.
//! - [`control`]: the control loop, one tick at a time.
//! - [`swap`]: policies handed to a running loop at a tick boundary.
//! - [`recorder`]: the run's output files.
//! - [`restore`]: every changed GPU setting put back, after a crash too.

pub mod assembly;
pub mod control;
pub mod node;
pub mod recorder;
pub mod restore;
pub mod run_report;
pub mod swap;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use crate::assembly::RunMeta;
use crate::control::{Backends, ControlLoop, LoopConfig, LoopTotals, Progress};
use crate::recorder::{OutputBounds, Recorder};
use crate::swap::{PreparedPolicy, SwapPort};
use tokwatt_core::types::{DeviceInfo, Knobs, Settings};
use tokwatt_plugin::{ComponentCache, HostConfig, PluginHost};
use tokwatt_policy::envelope::{Envelope, WorkloadLimits};
use tokwatt_policy::rules::NodeRules;
use tokwatt_policy::spec::PolicySpec;
use tokwatt_policy::supervisor::{InitArgs, PolicyFailure, Supervisor};

/// The plugin host every command starts its policies in, by one rule: compiled
/// components cached in `cache_dir`, or the user's default cache
/// ([`ComponentCache::default_dir`]: `$TOKWATT_CACHE_DIR`, else the user's cache folder),
/// so that `plugin compile`, `run`, `serve`, `ab` and `replay` share one cache.
pub fn plugin_host(cache_dir: Option<PathBuf>) -> Result<PluginHost, tokwatt_plugin::PluginError> {
    PluginHost::new(&HostConfig {
        cache_dir: cache_dir.or_else(ComponentCache::default_dir),
    })
}

/// Where plugins are looked for, after the spec's own folder: `$TOKWATT_PLUGIN_DIR`,
/// the folder of the running executable (a deployed bundle), and the build's folder.
pub fn plugin_search_path(extra: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs = extra.to_vec();
    if let Some(dir) = std::env::var_os("TOKWATT_PLUGIN_DIR") {
        dirs.push(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_owned))
    {
        dirs.push(dir);
    }
    dirs.push(tokwatt_plugin_artifacts::built_plugin_dir());
    dirs
}

/// How often a run rewrites its current `summary.json` while it runs (wall time).
pub const CHECKPOINT_EVERY: Duration = Duration::from_secs(30);

/// Version of `summary.json`'s layout: raised when a key is renamed or removed.
pub const SUMMARY_FORMAT_VERSION: u32 = 1;

/// The format versions of a run's output files, recorded in its summary.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OutputFormats {
    pub trace_csv: u32,
    pub observations_jsonl: u32,
    /// Absent in summaries written before `requests.jsonl` existed.
    #[serde(default = "requests_format_version")]
    pub requests_jsonl: u32,
}

fn requests_format_version() -> u32 {
    crate::recorder::REQUESTS_FORMAT_VERSION
}

impl Default for OutputFormats {
    fn default() -> Self {
        Self {
            trace_csv: crate::recorder::TRACE_FORMAT_VERSION,
            observations_jsonl: crate::recorder::OBSERVATIONS_FORMAT_VERSION,
            requests_jsonl: crate::recorder::REQUESTS_FORMAT_VERSION,
        }
    }
}

/// `summary.json`. **API boundary**: its keys are a compatibility promise, pinned by
/// `summary_keys_are_stable` (tests/all); raise [`SUMMARY_FORMAT_VERSION`] to change them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunSummary {
    pub format_version: u32,
    /// Absent in the earliest summaries of format 1: read as this build's versions.
    #[serde(default)]
    pub output_formats: OutputFormats,
    pub policy: String,
    pub policy_spec: String,
    pub plugin: String,
    pub tick_ms: u32,
    /// The objective the run was judged by (the spec's, or the judge's scenario's).
    /// Always written; `None` only when reading a summary from before it was recorded.
    #[serde(default)]
    pub objective: Option<tokwatt_core::types::Objective>,
    /// [`Self::objective`] bound by bound with where each came from (a flag, serve.toml,
    /// the spec) and which of the operator's the spec narrowed. Absent where the node's
    /// rules are tokwatt's own (the judge's, whose scenario replaces the spec's objective),
    /// and in summaries from before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objective_in_force: Option<tokwatt_policy::in_force::ObjectiveInForce>,
    #[serde(flatten)]
    pub meta: RunMeta,
    #[serde(flatten)]
    pub totals: LoopTotals,
}

/// Why a run's `summary.json` could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SummaryError {
    #[error(
        "{} is not a run's output folder: it has no summary.json; give the folder a run wrote (`tokwatt run --out DIR`, or `tokwatt serve`'s output folder)",
        dir.display()
    )]
    NotARun { dir: PathBuf },
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is damaged (line {line}): {reason}", path.display())]
    Damaged {
        path: PathBuf,
        line: u64,
        reason: String,
    },
    #[error(
        "{} is in summary.json format version {found}, and this tokwatt reads version {supported}: read it with the tokwatt version that recorded it",
        path.display()
    )]
    ForeignVersion {
        path: PathBuf,
        found: u64,
        supported: u32,
    },
}

/// The `summary.json` of the run in `dir`, as [`RunSummary`]: the one reader of the file
/// the recorder writes. Its version is checked first, so a foreign summary is named as
/// such, not as damaged.
pub fn read_summary(dir: &Path) -> Result<RunSummary, SummaryError> {
    let path = dir.join(crate::recorder::SUMMARY_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Err(SummaryError::NotARun {
                dir: dir.to_owned(),
            });
        }
        Err(source) => return Err(SummaryError::Read { path, source }),
    };
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|error| SummaryError::Damaged {
            path: path.clone(),
            line: error.line() as u64,
            reason: error.to_string(),
        })?;
    match value
        .get("format_version")
        .and_then(serde_json::Value::as_u64)
    {
        Some(found) if found == u64::from(SUMMARY_FORMAT_VERSION) => {}
        Some(found) => {
            return Err(SummaryError::ForeignVersion {
                path,
                found,
                supported: SUMMARY_FORMAT_VERSION,
            });
        }
        None => {
            return Err(SummaryError::Damaged {
                path,
                line: 1,
                reason: "it has no numeric format_version".into(),
            });
        }
    }
    serde_json::from_value(value).map_err(|error| SummaryError::Damaged {
        path,
        line: 1,
        reason: error.to_string(),
    })
}

/// What `run` needs besides the backends.
#[derive(Debug, Clone)]
pub struct RunRequest {
    pub spec: PolicySpec,
    pub duration: Duration,
    /// Overrides the spec's tick.
    pub tick: Option<Duration>,
    pub out_dir: PathBuf,
    pub plugin_dirs: Vec<PathBuf>,
    pub cache_dir: Option<PathBuf>,
    pub seed: u64,
    /// Replace the files of an earlier run in `out_dir`.
    pub overwrite: bool,
    /// Write the run's files into `out_dir` (`false`: keep only the returned summary, as
    /// the judge does for its hundreds of runs).
    pub write_files: bool,
    /// The node's objective, guardrails and guard, which the spec may only narrow.
    pub rules: NodeRules,
    /// Where the rules come from: for the error that refuses a spec loosening them, and for
    /// the summary's `objective_in_force`.
    pub rules_source: tokwatt_policy::in_force::RulesSource,
    /// The knobs the node's backends offer ([`crate::assembly::Assembled::offered`]).
    pub node_knobs: Knobs,
    /// How much the run's files may hold ([`OutputBounds`]: `tokwatt run`'s defaults, or its
    /// `--max-file-mib`, `--keep-files` and `--max-request-lines`).
    pub output: OutputBounds,
}

impl RunRequest {
    /// A request with the default node rules (the default cap step, the guard on) on a
    /// node offering every knob.
    pub fn new(spec: PolicySpec, duration: Duration, out_dir: PathBuf) -> Self {
        Self {
            spec,
            duration,
            tick: None,
            out_dir,
            plugin_dirs: Vec::new(),
            cache_dir: None,
            seed: 0,
            overwrite: false,
            write_files: true,
            rules: NodeRules::default(),
            rules_source: "tokwatt's default node rules".into(),
            node_knobs: Knobs::all(),
            output: OutputBounds::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Spec(#[from] tokwatt_policy::spec::SpecError),
    #[error(transparent)]
    Plugin(#[from] tokwatt_plugin::PluginError),
    #[error("policy `{policy}` failed to start: {failure}")]
    PolicyStart {
        policy: String,
        failure: tokwatt_policy::supervisor::PolicyFailure,
    },
    #[error(transparent)]
    Envelope(#[from] tokwatt_policy::envelope::EnvelopeError),
    #[error(transparent)]
    Recorder(#[from] crate::recorder::RecorderError),
    #[error(transparent)]
    Control(#[from] crate::control::ControlError),
    #[error(transparent)]
    Loosened(Box<tokwatt_policy::rules::Loosened>),
    #[error(
        "policy `{policy}`: the objective's throughput floor (min_tokens_per_s = {floor}) cannot be checked on this workload, whose source does not say when requests are waiting (a serving engine's token counter), so an idle GPU would read as a slow one: remove min_tokens_per_s from the spec and the node's [objective], or bound the time per token (tpot_p99_limit_ms) instead"
    )]
    ThroughputUnchecked { policy: String, floor: f64 },
    #[error(
        "policy `{policy}`: the objective's time-to-first-token bound (ttft_p99_limit_ms = {limit}) cannot be checked on this workload, which does not report when each request's first token came (a closed decode loop, or an engine preset without a TTFT histogram): remove ttft_p99_limit_ms from the spec and the node's [objective], or run on a workload that reports it (the simulator; an engine that exports TTFT)"
    )]
    TtftUnchecked { policy: String, limit: f64 },
    #[error(
        "policy `{policy}`: its spec lists \"token-budget\" in `knobs`, but the {workload} workload has no token budget per step on GPU {gpu}: it decodes only (its requests bring no prompts to prefill), or an engine outside tokwatt fixes its budget. Remove \"token-budget\" from the spec's `knobs`, or run the policy on a workload that serves prompts (a scenario with `prompt_tokens`, such as host/scenarios/chat.toml, on the simulator or tokwatt's CUDA engine: `--workload cuda --scenario FILE`)"
    )]
    NoTokenBudget {
        policy: String,
        workload: &'static str,
        gpu: u32,
    },
    #[error("the run's duration ({duration:?}) is shorter than one tick ({tick:?})")]
    TooShort { duration: Duration, tick: Duration },
}

impl From<Box<tokwatt_policy::rules::Loosened>> for AgentError {
    fn from(loosened: Box<tokwatt_policy::rules::Loosened>) -> Self {
        AgentError::Loosened(loosened)
    }
}

/// What a policy is started against: the node's GPUs and what each one's workload
/// accepts (its largest batch size, its token budget's range where it has one). Taken
/// from the backends before the loop owns them, so a policy can be started off the loop
/// (for a hot swap).
#[derive(Debug, Clone, PartialEq)]
pub struct NodeFacts {
    pub devices: Vec<DeviceInfo>,
    /// In the devices' order.
    pub workload: Vec<WorkloadLimits>,
    /// The workload's name, for messages.
    pub workload_name: &'static str,
    /// How the workload knows work is waiting: a throughput floor needs it.
    pub work_waiting: tokwatt_core::workload::WorkWaiting,
    /// Whether the workload reports time to first token: a TTFT bound needs it.
    pub reports_ttft: bool,
}

impl NodeFacts {
    pub fn of(backends: &Backends) -> Self {
        let devices = backends.telemetry.devices();
        let indices: Vec<u32> = devices.iter().map(|d| d.index).collect();
        Self {
            workload: WorkloadLimits::of(backends.workload.as_ref(), &indices),
            workload_name: backends.workload.name(),
            devices,
            work_waiting: backends.workload.work_waiting(),
            reports_ttft: backends.workload.reports_ttft(),
        }
    }
}

/// Load the spec's plugin and start it on the node's devices. Returns the supervisor,
/// the policy's first settings and the envelope.
pub fn start_policy(
    host: &PluginHost,
    spec: &PolicySpec,
    plugin_path: &Path,
    node: &NodeFacts,
    seed: u64,
    tick: Duration,
) -> Result<(Supervisor, Vec<tokwatt_core::types::Settings>, Envelope), AgentError> {
    start_policy_inner(host, spec, plugin_path, node, seed, tick, false)
        .map(|(supervisor, first, envelope, _)| (supervisor, first, envelope))
}

/// What [`start_policy_watched`] hands back: [`start_policy`]'s supervisor, first
/// settings and envelope, and the guest's console.
pub type WatchedStart = (
    Supervisor,
    Vec<tokwatt_core::types::Settings>,
    Envelope,
    tokwatt_plugin::GuestConsole,
);

/// [`start_policy`], also handing back the guest's console with its log messages
/// transcribed into it, for a tool that shows what the guest wrote beside its decisions
/// (`tokwatt replay`).
pub fn start_policy_watched(
    host: &PluginHost,
    spec: &PolicySpec,
    plugin_path: &Path,
    node: &NodeFacts,
    seed: u64,
    tick: Duration,
) -> Result<WatchedStart, AgentError> {
    start_policy_inner(host, spec, plugin_path, node, seed, tick, true)
}

/// How often a policy whose start missed its wall-clock deadline is started before it
/// is refused.
pub const START_ATTEMPTS: u32 = 3;

/// Every named objective is checked, or refused here: never silently off.
fn check_measurable(spec: &PolicySpec, node: &NodeFacts) -> Result<(), AgentError> {
    if let Some(floor) = spec.objective.min_tokens_per_s
        && floor > 0.0
        && node.work_waiting == tokwatt_core::workload::WorkWaiting::Unknown
    {
        return Err(AgentError::ThroughputUnchecked {
            policy: spec.name.clone(),
            floor,
        });
    }
    if let Some(limit) = spec.objective.ttft_p99_limit_ms
        && !node.reports_ttft
    {
        return Err(AgentError::TtftUnchecked {
            policy: spec.name.clone(),
            limit,
        });
    }
    Ok(())
}

/// A knob the spec lists is one the workload has, or the spec is refused here: a token
/// budget granted on a workload without one would be a knob that silently turns nothing.
fn check_knobs(spec: &PolicySpec, node: &NodeFacts) -> Result<(), AgentError> {
    if !spec.knobs.token_budget {
        return Ok(());
    }
    match node
        .devices
        .iter()
        .zip(&node.workload)
        .find(|(_, accepts)| accepts.token_budget.is_none())
    {
        Some((device, _)) => Err(AgentError::NoTokenBudget {
            policy: spec.name.clone(),
            workload: node.workload_name,
            gpu: device.index,
        }),
        None => Ok(()),
    }
}

/// A live agent never takes the transcript of the guest's logs, so only a watching tool
/// turns it on (`transcribe_logs`).
fn start_policy_inner(
    host: &PluginHost,
    spec: &PolicySpec,
    plugin_path: &Path,
    node: &NodeFacts,
    seed: u64,
    tick: Duration,
    transcribe_logs: bool,
) -> Result<WatchedStart, AgentError> {
    check_measurable(spec, node)?;
    check_knobs(spec, node)?;
    let envelope =
        Envelope::for_workload(&node.devices, &node.workload, &spec.guardrails, spec.knobs)?;
    let loaded = Arc::new(host.load(plugin_path, &spec.name, spec.sandbox)?);
    let args = InitArgs {
        devices: envelope.facts(&node.devices),
        knobs: spec.knobs,
        objective: spec.objective,
        params: spec.params.clone(),
        tick_ms: u32::try_from(tick.as_millis()).unwrap_or(u32::MAX),
        seed,
    };
    let mut attempt = 1;
    let (supervisor, first, console) = loop {
        let started = loaded.instantiate(seed).and_then(|engine| {
            let console = engine.console();
            console.transcribe_logs(transcribe_logs);
            Supervisor::start(Box::new(engine), args.clone(), spec.breaker)
                .map(|(supervisor, first)| (supervisor, first, console))
        });
        match started {
            // Wall time is the one budget a busy machine can spend for the guest: an
            // instance that missed its deadline starting is started afresh (same seed,
            // same init) before the policy is refused. Fuel, traps and limits are the
            // guest's own doing and refuse it at once.
            Err(PolicyFailure::Deadline { deadline_ms, .. }) if attempt < START_ATTEMPTS => {
                tracing::warn!(
                    policy = %spec.name,
                    attempt,
                    "`{}` missed its {deadline_ms} ms deadline starting; starting it again",
                    spec.name
                );
                attempt += 1;
            }
            other => {
                break other.map_err(|failure| AgentError::PolicyStart {
                    policy: spec.name.clone(),
                    failure,
                })?;
            }
        }
    };
    Ok((supervisor, first, envelope, console))
}

/// Start a policy off the loop, ready to be sent to it through a
/// [`crate::swap::SwapSender`] (hot swap). Compiling, instantiating and `init` all
/// happen here, on the caller's thread.
pub fn prepare_policy(
    host: &PluginHost,
    spec: &PolicySpec,
    plugin_path: &Path,
    node: &NodeFacts,
    seed: u64,
    tick: Duration,
) -> Result<PreparedPolicy, AgentError> {
    let (supervisor, first, envelope) = start_policy(host, spec, plugin_path, node, seed, tick)?;
    Ok(PreparedPolicy {
        supervisor,
        first,
        envelope,
        objective: spec.objective,
        probation_ticks: crate::swap::DEFAULT_PROBATION_TICKS,
        notify: None,
        state: crate::swap::StateOnSwap::default(),
        operator_rollback: false,
    })
}

/// Run a policy on `backends` for the requested duration, writing the trace and summary
/// into `request.out_dir`.
pub fn run(
    request: &RunRequest,
    backends: Backends,
    meta: RunMeta,
    stop: Arc<AtomicBool>,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<(RunSummary, Backends), AgentError> {
    run_with_swaps(request, backends, meta, stop, None, progress)
}

/// [`run`], taking new policies from `swaps` at tick boundaries (hot swap).
pub fn run_with_swaps(
    request: &RunRequest,
    backends: Backends,
    meta: RunMeta,
    stop: Arc<AtomicBool>,
    swaps: Option<SwapPort>,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<(RunSummary, Backends), AgentError> {
    let host = plugin_host(request.cache_dir.clone())?;
    run_in(&host, request, backends, meta, stop, swaps, progress)
}

/// [`run_with_swaps`] in `host` (a [`node::Node`]'s).
pub(crate) fn run_in(
    host: &PluginHost,
    request: &RunRequest,
    backends: Backends,
    meta: RunMeta,
    stop: Arc<AtomicBool>,
    swaps: Option<SwapPort>,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<(RunSummary, Backends), AgentError> {
    // The node's rules first: what the spec narrows is in force, and its `init` is told.
    let (mut spec, in_force) = request
        .rules
        .narrow_in_force(&request.spec, &request.rules_source)?;
    // Said for rules an operator set (flags, serve.toml, a scenario), not for those set in
    // code (the judge's, whose scenario replaces the spec's objective).
    let objective_in_force = (request.rules_source.origin
        != tokwatt_policy::in_force::RulesOrigin::Described)
        .then_some(in_force);
    if let Some(tick) = request.tick {
        spec.override_tick(tick)?;
    }
    let spec = &spec;
    let tick = Duration::from_millis(u64::from(spec.tick_ms));
    if request.duration < tick {
        return Err(AgentError::TooShort {
            duration: request.duration,
            tick,
        });
    }
    let plugin_path = spec.resolve_plugin(&plugin_search_path(&request.plugin_dirs))?;
    let node = NodeFacts::of(&backends);
    let node_envelope =
        request
            .rules
            .envelope(&node.devices, &node.workload, request.node_knobs)?;
    let (supervisor, first, envelope) =
        start_policy(host, spec, &plugin_path, &node, request.seed, tick)?;
    tracing::info!(
        policy = %spec.name,
        plugin = %plugin_path.display(),
        "policy started; first settings: {}",
        Settings::per_gpu(&first)
    );
    let mut recorder = if request.write_files {
        Recorder::create_bounded(&request.out_dir, request.overwrite, request.output)?
    } else {
        Recorder::discard()
    };
    // On a virtual clock the ticks follow each other as fast as they are computed: the
    // lines are written on a thread of their own meanwhile. In real time each tick's lines
    // reach the files before the next tick, on the loop's thread.
    if backends.clock.is_virtual() {
        recorder.write_in_background()?;
    }
    let mut control = ControlLoop::new(
        backends,
        supervisor,
        &first,
        envelope,
        LoopConfig {
            duration: request.duration,
            tick,
            objective: spec.objective,
            node_knobs: request.node_knobs,
            node_guardrails: request.rules.guardrails,
            node_envelope: Some(node_envelope),
            guard: request.rules.guard,
            power_allowance: None,
        },
        stop,
    );
    if let Some(port) = swaps {
        control = control.with_swaps(port);
    }
    let summary_of = |totals: LoopTotals| RunSummary {
        format_version: SUMMARY_FORMAT_VERSION,
        output_formats: OutputFormats::default(),
        policy: spec.name.clone(),
        policy_spec: spec.path.display().to_string(),
        plugin: plugin_path.display().to_string(),
        tick_ms: u32::try_from(tick.as_millis()).unwrap_or(u32::MAX),
        objective: Some(spec.objective),
        objective_in_force: objective_in_force.clone(),
        meta: meta.clone(),
        totals,
    };
    // A current summary.json from the first tick on, rewritten every CHECKPOINT_EVERY of
    // wall time and marked interrupted until the run ends: a run killed outright
    // (`kill -9`, the node lost) can still be reported and replayed.
    let mut last_checkpoint: Option<std::time::Instant> = None;
    while let Some(ticked) = control.tick(&mut recorder)? {
        if request.write_files && last_checkpoint.is_none_or(|at| at.elapsed() >= CHECKPOINT_EVERY)
        {
            let mut totals = ticked.totals.clone();
            totals.interrupted = true;
            recorder.checkpoint(&summary_of(totals))?;
            last_checkpoint = Some(std::time::Instant::now());
        }
        progress(ticked);
    }
    let (totals, backends) = control.finish();
    let summary = summary_of(totals);
    recorder.finish(&summary)?;
    if request.write_files {
        write_report(&request.out_dir, &spec.objective);
    }
    Ok((summary, backends))
}

/// `report.html` beside the trace. The run's data is already safe on disk, so a report
/// that fails to render costs a warning, not the run.
fn write_report(out_dir: &Path, objective: &tokwatt_core::types::Objective) {
    let path = out_dir.join(tokwatt_report::RUN_REPORT_FILE);
    let written = run_report::run_report_with_objective(out_dir, objective).and_then(|html| {
        tokwatt_report::write_atomically(&path, &html).map_err(run_report::RunReportError::from)
    });
    if let Err(error) = written {
        tracing::warn!("no report for this run: {error}");
        // An earlier run's report (under --overwrite) must not pass for this run's.
        if path.exists() && std::fs::remove_file(&path).is_err() {
            tracing::warn!("{} is an earlier run's report", path.display());
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    fn spec(objective: &str) -> PolicySpec {
        PolicySpec::parse(
            Path::new("/specs/p.toml"),
            &format!("name = \"p\"\nplugin = \"p.wasm\"\nknobs = [\"power-cap\"]\n[objective]\n{objective}\n"),
        )
        .unwrap()
    }

    fn node(reports_ttft: bool) -> NodeFacts {
        NodeFacts {
            devices: Vec::new(),
            workload: Vec::new(),
            workload_name: "test",
            work_waiting: tokwatt_core::workload::WorkWaiting::Reported,
            reports_ttft,
        }
    }

    #[test]
    fn a_token_budget_granted_on_a_workload_without_one_is_refused_with_the_fix() {
        let spec = |knobs: &str| {
            PolicySpec::parse(
                Path::new("/specs/p.toml"),
                &format!("name = \"p\"\nplugin = \"p.wasm\"\nknobs = [{knobs}]\n"),
            )
            .unwrap()
        };
        let device = tokwatt_core::types::DeviceInfo {
            index: 0,
            uuid: "SIM-0".into(),
            name: "sim".into(),
            simulated: true,
            power_cap_min_w: 200.0,
            power_cap_max_w: 700.0,
            power_cap_default_w: 700.0,
            sm_clocks_mhz: vec![1980],
            mem_clocks_mhz: vec![3201],
        };
        let decode_only = NodeFacts {
            devices: vec![device.clone()],
            workload: vec![WorkloadLimits::batch_only(512)],
            workload_name: "sim",
            ..node(true)
        };
        let granted = spec("\"batch-size\", \"token-budget\"");
        let err = check_knobs(&granted, &decode_only).unwrap_err().to_string();
        assert!(
            err.contains("policy `p`")
                && err.contains("no token budget per step on GPU 0")
                && err.contains("Remove \"token-budget\" from the spec's `knobs`")
                && err.contains("prompt_tokens"),
            "{err}"
        );
        check_knobs(&spec("\"batch-size\""), &decode_only).unwrap();
        let serving = NodeFacts {
            workload: vec![WorkloadLimits {
                batch_size_max: 512,
                token_budget: Some((1, 8192)),
            }],
            ..decode_only
        };
        check_knobs(&granted, &serving).unwrap();
    }

    #[test]
    fn a_ttft_bound_is_refused_where_the_workload_cannot_time_first_tokens() {
        let bounded = spec("ttft_p99_limit_ms = 800.0");
        let err = check_measurable(&bounded, &node(false))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("ttft_p99_limit_ms = 800") && err.contains("remove ttft_p99_limit_ms"),
            "{err}"
        );
        check_measurable(&bounded, &node(true)).unwrap();
        check_measurable(&spec("tpot_p99_limit_ms = 50.0"), &node(false)).unwrap();
    }
}
