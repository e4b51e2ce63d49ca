//! Putting a run together: the policy spec, the plugin, the backends, the envelope and
//! the loop. The `tokwatt` binary and the tests both go through here, so what the tests
//! check is what operators run.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use serde::Serialize;

use crate::control::{Backends, ControlLoop, LoopConfig, LoopTotals, Progress};
use crate::envelope::Envelope;
use crate::plugin::{ComponentCache, HostConfig, PluginHost};
use crate::policy::{InitArgs, Supervisor};
use crate::recorder::Recorder;
use crate::spec::PolicySpec;

/// The folder the build put the shipped and fixture plugins in.
pub fn built_plugin_dir() -> PathBuf {
    PathBuf::from(env!("TOKWATT_BUILT_PLUGIN_DIR"))
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
    dirs.push(built_plugin_dir());
    dirs
}

/// What describes a run besides its totals.
#[derive(Debug, Clone, Serialize)]
pub struct RunMeta {
    /// True when the GPU was the simulator: then every figure is simulator output.
    pub simulated: bool,
    /// The simulator's GPU profile as given (`h200`, or a profile file), or the real
    /// GPU's name.
    pub gpu_profile: String,
    /// The GPU's name (the profile's for the simulator).
    pub gpu_name: String,
    /// Where the figures come from, in words.
    pub data_source: String,
    pub gpus: u32,
    pub actuator: String,
    pub workload: String,
    pub seed: u64,
}

/// `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    pub policy: String,
    pub policy_spec: String,
    pub plugin: String,
    pub tick_ms: u32,
    #[serde(flatten)]
    pub meta: RunMeta,
    #[serde(flatten)]
    pub totals: LoopTotals,
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
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Spec(#[from] crate::spec::SpecError),
    #[error(transparent)]
    Plugin(#[from] crate::plugin::PluginError),
    #[error("policy `{policy}` failed to start: {failure}")]
    PolicyStart {
        policy: String,
        failure: crate::policy::PolicyFailure,
    },
    #[error(transparent)]
    Envelope(#[from] crate::envelope::EnvelopeError),
    #[error(transparent)]
    Recorder(#[from] crate::recorder::RecorderError),
    #[error(transparent)]
    Control(#[from] crate::control::ControlError),
    #[error("the run's duration ({duration:?}) is shorter than one tick ({tick:?})")]
    TooShort { duration: Duration, tick: Duration },
}

/// Load the spec's plugin and start it on `backends`' devices. Returns the supervisor,
/// the policy's first settings and the envelope.
pub fn start_policy(
    host: &PluginHost,
    spec: &PolicySpec,
    plugin_path: &Path,
    backends: &Backends,
    seed: u64,
    tick: Duration,
) -> Result<(Supervisor, Vec<crate::types::Settings>, Envelope), AgentError> {
    let devices = backends.telemetry.devices();
    let batch_max: Vec<u32> = devices
        .iter()
        .map(|d| backends.workload.batch_size_max(d.index))
        .collect();
    let envelope = Envelope::new(&devices, &batch_max, &spec.guardrails, spec.knobs)?;
    let loaded = Arc::new(host.load(plugin_path, &spec.name, spec.sandbox)?);
    let engine = loaded
        .instantiate(seed)
        .map_err(|failure| AgentError::PolicyStart {
            policy: spec.name.clone(),
            failure,
        })?;
    let args = InitArgs {
        devices: envelope.facts(&devices),
        knobs: spec.knobs,
        objective: spec.objective,
        params: spec.params.clone(),
        tick_ms: u32::try_from(tick.as_millis()).unwrap_or(u32::MAX),
        seed,
    };
    let (supervisor, first) =
        Supervisor::start(Box::new(engine), args, spec.breaker).map_err(|failure| {
            AgentError::PolicyStart {
                policy: spec.name.clone(),
                failure,
            }
        })?;
    Ok((supervisor, first, envelope))
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
    let spec = &request.spec;
    let tick = request
        .tick
        .unwrap_or(Duration::from_millis(u64::from(spec.tick_ms)));
    if request.duration < tick {
        return Err(AgentError::TooShort {
            duration: request.duration,
            tick,
        });
    }
    let plugin_path = spec.resolve_plugin(&plugin_search_path(&request.plugin_dirs))?;
    let host = PluginHost::new(&HostConfig {
        cache_dir: request
            .cache_dir
            .clone()
            .or_else(ComponentCache::default_dir),
    })?;
    let (supervisor, first, envelope) =
        start_policy(&host, spec, &plugin_path, &backends, request.seed, tick)?;
    let mut recorder = Recorder::create(&request.out_dir)?;
    let control = ControlLoop::new(
        backends,
        supervisor,
        &first,
        envelope,
        LoopConfig {
            duration: request.duration,
            tick,
            objective: spec.objective,
        },
        stop,
    );
    let (totals, backends) = control.run(&mut recorder, progress)?;
    let summary = RunSummary {
        policy: spec.name.clone(),
        policy_spec: spec.path.display().to_string(),
        plugin: plugin_path.display().to_string(),
        tick_ms: u32::try_from(tick.as_millis()).unwrap_or(u32::MAX),
        meta,
        totals,
    };
    recorder.finish(&summary)?;
    Ok((summary, backends))
}
