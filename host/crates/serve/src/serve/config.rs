//! `tokwatt serve`'s configuration: one TOML file for the whole node. Parsing refuses
//! unknown keys and wrong types (with the line, from the TOML parser); [`ServeConfig::load`]
//! then checks every value and names the file, line and key of a bad one, as policy specs
//! do. Relative paths are relative to the config file's folder.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokwatt_engines::prometheus::Engine;

mod check;
mod raw;

use check::{check, line_at};
use raw::RawConfig;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read serve config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("serve config {path} is not valid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("serve config {}{}: `{key}` {problem}", path.display(), line.map_or_else(String::new, |l| format!(":{l}")))]
    Invalid {
        path: PathBuf,
        line: Option<usize>,
        key: String,
        problem: String,
    },
}

/// Where the node's GPUs come from.
#[derive(Debug, Clone, PartialEq)]
pub enum NodeBackend {
    /// Real GPUs through NVML: all of them, or these indices.
    Nvml { gpus: Option<Vec<u32>> },
    /// The simulated GPU (for trying `serve` without a GPU, and for tests).
    Sim {
        profile: String,
        gpus: u32,
        scenario: Option<PathBuf>,
        /// `false`: the virtual clock (ticks as fast as the loop runs).
        realtime: bool,
        /// The simulated driver's file: the node's settings outlive the agent, as a real
        /// driver's do (`tokwatt_sim::SimDriver`); `None`: they end with it.
        driver: Option<PathBuf>,
    },
}

/// Where each real GPU's tokens come from.
#[derive(Debug, Clone, PartialEq)]
pub enum ServeWorkload {
    /// tokwatt's own CUDA decode on every GPU.
    Cuda {
        model: String,
        context: u32,
        batch_size_max: u32,
    },
    /// Each GPU's serving engine, by NVML index.
    External(Vec<EngineEndpoint>),
    /// The simulator's own workload.
    Sim,
}

/// One GPU's serving engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineEndpoint {
    pub gpu: u32,
    pub url: String,
    pub engine: Engine,
    pub token_counter: String,
    /// `None`: the engine exports no TPOT histogram (the objective may not bound TPOT).
    pub tpot_histogram: Option<String>,
    /// `None`: no TTFT histogram read (the objective may not bound TTFT).
    pub request_metrics: Option<tokwatt_engines::prometheus::RequestMetrics>,
}

/// `[fleet]`, checked: the coordination store, and how this node takes part.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetConfig {
    /// etcd's client URLs.
    pub endpoints: Vec<String>,
    /// The TLS files for https:// endpoints (read and checked when the config loads, and
    /// read again when the fleet thread starts).
    pub tls: Option<tokwatt_fleet::etcd::TlsFiles>,
    pub link: tokwatt_fleet::NodeConfig,
    /// How often the node renews its lease, reports and reads its grant.
    pub report_every: Duration,
    /// Each request's deadline.
    pub timeout: Duration,
    /// What puts the node back at its reserve when the agent stops running
    /// (`[fleet.fence]`); `None`: nothing the node can declare.
    pub fence: Option<FenceConfig>,
}

/// `[fleet.fence]`, checked: the mechanism outside the agent's loop that applies the
/// node's reserve when the loop stops (hung, paused, killed, failing at start), which the
/// node declares in its reports so that the coordinator may free its grant once the
/// fence's deadline has passed.
#[derive(Debug, Clone, PartialEq)]
pub struct FenceConfig {
    pub watch: FenceWatch,
    /// How long applying the reserve may take once the fence fires: for the watchdog,
    /// systemd's abort of the agent and `ExecStopPost`'s restore; for the heartbeat, the
    /// fence's check period and its NVML calls. The deadline the node declares is the
    /// time to notice (the watchdog interval, the fence's stall) plus this.
    pub restore: Duration,
    /// The operator states that a boot-time unit applies the reserve when the node boots
    /// (or its driver reloads), before any work runs.
    pub covers_reboot: bool,
}

/// What watches the agent's loop.
#[derive(Debug, Clone, PartialEq)]
pub enum FenceWatch {
    /// systemd's watchdog (`Type=notify`, `WatchdogSec=`), fed over `NOTIFY_SOCKET`.
    SystemdWatchdog,
    /// `tokwatt fence`, a second process: the loop touches `heartbeat`, the fence writes
    /// `status` every second.
    Heartbeat { heartbeat: PathBuf, status: PathBuf },
}

impl FenceWatch {
    /// The kind the node declares.
    pub fn kind(&self) -> tokwatt_fleet::FenceKind {
        match self {
            Self::SystemdWatchdog => tokwatt_fleet::FenceKind::SystemdWatchdog,
            Self::Heartbeat { .. } => tokwatt_fleet::FenceKind::Heartbeat,
        }
    }
}

/// The checked configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeConfig {
    pub path: PathBuf,
    pub policy_spec: PathBuf,
    pub plugin_dirs: Vec<PathBuf>,
    pub cache_dir: Option<PathBuf>,
    /// Swap when this folder's spec or plugin changes.
    pub watch: Option<PathBuf>,
    pub watch_period: Duration,
    /// Ticks after a swap in which a failure of the new policy brings back the old one.
    pub probation_ticks: u64,
    pub seed: u64,
    pub backend: NodeBackend,
    pub workload: ServeWorkload,
    /// Overrides the spec's tick.
    pub tick: Option<Duration>,
    pub dry_run: bool,
    pub batch_only: bool,
    /// The API's Unix socket (`None`: the default, [`crate::api::default_socket_path`]).
    pub socket: Option<PathBuf>,
    pub http: Option<SocketAddr>,
    pub token_file: Option<PathBuf>,
    pub metrics_listen: Option<SocketAddr>,
    pub out_dir: PathBuf,
    pub max_file_bytes: u64,
    pub keep_files: u32,
    /// How often summary.json is rewritten during the run.
    pub summary_every: Duration,
    pub state_file: Option<PathBuf>,
    /// The node's place in a power domain (`[fleet]`), if it has one.
    pub fleet: Option<FleetConfig>,
    /// The node's objective, guardrails and guard (`[objective]`, `[guardrails]`,
    /// `[guard]`): every policy spec may only narrow them.
    pub rules: tokwatt_policy::rules::NodeRules,
}

impl ServeConfig {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        // Paths in the file are relative to its folder, made absolute here: a running
        // agent reports its spec's path, and a client (`tokwatt fleet ab`, an operator's
        // swap back) may use it from any working directory.
        let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
        let base = absolute.parent().unwrap_or(Path::new("."));
        check(raw, base, path).map_err(|p| ConfigError::Invalid {
            path: path.to_owned(),
            line: p.span.map(|span| line_at(text, span.start)),
            key: p.key.to_owned(),
            problem: p.text,
        })
    }

    /// The default output folder: under /var/lib/tokwatt as root, else the user's state
    /// folder.
    pub fn default_out_dir() -> PathBuf {
        tokwatt_agent::restore::StateFile::default_path()
            .parent()
            .map_or_else(|| PathBuf::from("tokwatt-serve"), |dir| dir.join("serve"))
    }
}

#[cfg(test)]
mod tests;
