//! The control API's contract: what a running agent (`tokwatt serve`) answers, whatever
//! carries the request (a Unix socket, loopback HTTP with a bearer token). The server and
//! the CLI client live beside this file; `crate::serve` implements [`Control`].
//!
//! **API boundary**: the JSON of [`NodeStatus`] and of the request bodies is what
//! operators' scripts read; [`API_VERSION`] is raised when a key is renamed or removed.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use tokwatt_core::types::{ClockEvents, InForce};

/// Version of the API's JSON.
pub const API_VERSION: u32 = 1;

/// What `GET /v1/status` answers.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct NodeStatus {
    pub api_version: u32,
    /// The tokwatt version serving.
    pub agent_version: String,
    /// True when the GPUs are the simulator: every figure is simulator output.
    pub simulated: bool,
    /// Where the figures come from, in words.
    pub data_source: String,
    pub actuator: String,
    pub workload: String,
    /// Ticks since the agent started.
    pub ticks: u64,
    pub uptime_s: f64,
    /// The loop holds the settings in force and does not ask the policy.
    pub paused: bool,
    /// How late ticks started against their schedule, p99 over the last
    /// [`crate::serve::LATENESS_WINDOW`] ticks, ms (`None` before the first tick).
    #[serde(default)]
    pub tick_lateness_p99_ms: Option<f64>,
    pub policy: PolicyStatus,
    pub gpus: Vec<GpuStatus>,
    pub failures: Failures,
    /// The objective in force and what the objective guard did.
    #[serde(default)]
    pub guard: GuardStatus,
    /// The power domain this node shares a budget in (`[fleet]` in serve.toml); `None`
    /// where it has none. Added within API version 1 (an older agent omits it).
    #[serde(default)]
    pub fleet: Option<FleetStatus>,
    /// The node's GPUs together, as of the last tick ([`NodeTotals::of`] the `gpus`).
    /// Added within API version 1 (an older agent omits it).
    #[serde(default)]
    pub node: Option<NodeTotals>,
}

/// A node's place in a power domain: what `tokwatt fleet ab` reads to learn which nodes
/// share a budget (their grants move through the coordinator unless frozen), and what
/// the node may hold now. Every key after `node` was added within API version 1: an
/// older agent omits them (`None`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct FleetStatus {
    /// The domain, as its budget names it.
    pub domain: String,
    /// This node, as the budget names it.
    pub node: String,
    /// What the node's GPUs' power caps must sum within now, W: its grant while its
    /// lease is surely live, else its reserve.
    #[serde(default)]
    pub allowance_w: Option<f64>,
    /// Which of the two the allowance is.
    #[serde(default)]
    pub holding: Option<Holding>,
    /// What the node holds without a grant, W: `fleet.reserve_w`, or the domain
    /// budget's reserve for the node where that is lower.
    #[serde(default)]
    pub reserve_w: Option<f64>,
    /// The coordinator's grant in force (`None`: none yet, or the lease could have
    /// lapsed, so the node holds its reserve).
    #[serde(default)]
    pub grant: Option<GrantStatus>,
    /// The node's lease in etcd (`None`: not joined; `apart_because` says why).
    #[serde(default)]
    pub lease: Option<LeaseStatus>,
    /// Why the node is not joined or could not renew or read its grant at its last
    /// exchange with etcd (`None`: that exchange went through).
    #[serde(default)]
    pub apart_because: Option<String>,
}

/// Which allowance a node in a power domain holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Holding {
    /// The coordinator's grant.
    Grant,
    /// Its reserve: no grant yet, or it could not renew its lease in time.
    Reserve,
}

/// The coordinator's grant a node holds.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct GrantStatus {
    pub watts: f64,
    /// Rises with every grant the coordinator writes to the node.
    pub generation: u64,
    /// The node has enforced it: its GPUs' caps, read back, were within it when it last
    /// reported (until then the coordinator charges the node its earlier, higher grants).
    pub acknowledged: bool,
}

/// A node's lease, by its own clock.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LeaseStatus {
    /// etcd's lease ID, in hex (as `tokwatt fleet show` prints it).
    pub id: String,
    /// How long the node may still hold its grant without renewing, s: until the lease
    /// could lapse less `fleet.margin`. At 0 the node holds its reserve.
    pub holds_for_s: f64,
}

/// The node's GPUs together, as of the last tick.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct NodeTotals {
    pub gpus: usize,
    /// The GPUs' power caps in force, summed, W.
    pub power_cap_w: f64,
    /// The last tick's power, summed, W (`None` before the first tick).
    pub last_power_w: Option<f64>,
    /// The last tick's tokens per second, summed.
    pub last_tokens_per_s: Option<f64>,
    /// The node's tokens per joule over the last tick: its tokens per second over its
    /// power (`None` before the first tick, or without power).
    pub last_tokens_per_joule: Option<f64>,
    /// Since the agent started.
    pub tokens: u64,
    pub energy_j: f64,
    /// `tokens` over `energy_j` (0 before any energy).
    pub tokens_per_joule: f64,
}

impl NodeTotals {
    /// The sums over `gpus`. A last-tick figure is summed only where every GPU has it.
    pub fn of(gpus: &[GpuStatus]) -> Self {
        let sum = |figure: fn(&GpuStatus) -> Option<f64>| -> Option<f64> {
            gpus.iter().map(figure).sum::<Option<f64>>()
        };
        let last_power_w = sum(|g| g.last_power_w).filter(|_| !gpus.is_empty());
        let last_tokens_per_s = sum(|g| g.last_tokens_per_s).filter(|_| !gpus.is_empty());
        let tokens = gpus
            .iter()
            .map(|g| g.tokens)
            .fold(0u64, u64::saturating_add);
        let energy_j: f64 = gpus.iter().map(|g| g.energy_j).sum();
        Self {
            gpus: gpus.len(),
            power_cap_w: gpus.iter().map(|g| g.in_force.power_cap_w).sum(),
            last_power_w,
            last_tokens_per_s,
            last_tokens_per_joule: match (last_tokens_per_s, last_power_w) {
                (Some(rate), Some(power)) if power > 0.0 => Some(rate / power),
                _ => None,
            },
            tokens,
            energy_j,
            tokens_per_joule: if energy_j > 0.0 {
                tokens as f64 / energy_j
            } else {
                0.0
            },
        }
    }
}

/// The node's objective in force and its guard, as of the last tick.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct GuardStatus {
    /// The objective in force: the node's, narrowed by the policy's spec.
    pub objective: tokwatt_core::types::Objective,
    /// Whether the guard acts (`[guard] enabled`); off, it only counts.
    pub enabled: bool,
    /// The guard's fallback (the device defaults) decides instead of the policy.
    pub in_charge: bool,
    /// Ticks, node-wide, in which any GPU's window broke the objective under the policy's
    /// own settings (of `window_ticks` recent ticks, the guard takes over at
    /// `max_violation_ticks`).
    pub policy_violation_ticks: u64,
    pub takeovers: u64,
    /// Take-overs whose fallback broke the objective as well (demand beyond the GPUs).
    pub unservable_takeovers: u64,
    pub takeover_ticks: u64,
    /// Swapped-in policies rolled back for breaking the objective in probation.
    pub objective_rollbacks: u64,
}

/// The policy in charge.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct PolicyStatus {
    pub name: String,
    /// The plugin's content version: the first 12 hex digits of its SHA-256.
    pub version: String,
    pub spec: PathBuf,
    pub plugin: PathBuf,
    /// Ticks since it took charge.
    pub ticks_in_charge: u64,
    /// Still on probation after a swap (a failure brings the previous policy back).
    pub on_probation: bool,
    /// The policy a rollback would bring back, if any.
    pub previous: Option<String>,
    pub swaps: u64,
    pub rollbacks: u64,
    /// Earlier policies brought back by the operator (`tokwatt policy rollback`), not
    /// counted in `swaps`.
    #[serde(default)]
    pub operator_rollbacks: u64,
    pub state_carried: u64,
    pub started_fresh: u64,
}

/// One GPU, as of the last tick.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct GpuStatus {
    pub gpu: u32,
    pub name: String,
    pub uuid: String,
    /// The settings in force after the last tick, the power cap and clock lock as the loop
    /// last read them back from the device (after a stall, before it reports again), never
    /// as it asked for them. Where the workload is a serving engine
    /// (`NodeStatus::workload` = `prometheus`), `batch_size` is a placeholder: the batch is
    /// the engine's, which tokwatt neither reads nor sets.
    pub in_force: InForce,
    /// Tokens per joule over the last tick (`None` before the first).
    pub last_tokens_per_joule: Option<f64>,
    pub last_power_w: Option<f64>,
    pub last_tokens_per_s: Option<f64>,
    /// The last tick's p99 time per output token, ms (`None`: unknown).
    pub last_tpot_p99_ms: Option<f64>,
    pub temperature_c: Option<f64>,
    pub clock_events: ClockEvents,
    pub tokens: u64,
    pub energy_j: f64,
    pub tokens_per_joule: f64,
    pub slo_violation_ticks: u64,
}

/// What went wrong since the agent started, counted.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Failures {
    pub fallback_ticks: u64,
    pub plugin_traps: u64,
    pub ejections: u64,
    pub actuator_errors: u64,
    pub telemetry_errors: u64,
    pub slo_violation_ticks: u64,
    pub tpot_unknown_ticks: u64,
    /// Swaps refused (bad spec, plugin that would not start) since the agent started.
    pub swaps_refused: u64,
    /// The last failure an operator should read, in words (bounded, escaped).
    pub last: Option<String>,
}

/// `POST /v1/policy/swap`'s body.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SwapRequest {
    /// The policy spec (TOML) on the agent's machine.
    pub spec: PathBuf,
    /// The component, overriding the spec's `plugin` (optional).
    #[serde(default)]
    pub plugin: Option<PathBuf>,
    /// Start the new policy without the outgoing one's state (`tokwatt fleet ab` starts
    /// every half this way, so that no half learns from another). Sent only when true,
    /// so an agent that predates the key still takes a plain swap.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fresh: bool,
}

/// What an action answers once carried out.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ActionOutcome {
    /// What happened, in words.
    pub message: String,
    /// The tick at which it took effect.
    pub tick: u64,
    /// The policy in charge afterwards.
    pub policy: String,
    /// For a swap: whether the new policy took the old one's state.
    #[serde(default)]
    pub state_carried: Option<bool>,
}

/// Why a request changed nothing. Each maps to one HTTP status.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum ControlError {
    /// The request itself is wrong (HTTP 400): names the problem and the fix.
    #[error("{0}")]
    BadRequest(String),
    /// The request is fine but cannot be carried out now (HTTP 409), e.g. no previous
    /// policy to roll back to.
    #[error("{0}")]
    Conflict(String),
    /// The agent is stopping or the loop has ended (HTTP 503).
    #[error("{0}")]
    Unavailable(String),
}

/// What a running agent does for its API. Every method returns only once the action has
/// taken effect at a tick boundary (or failed, changing nothing).
pub trait Control: Send + Sync + 'static {
    fn status(&self) -> NodeStatus;
    /// The Prometheus text exposition of the agent's metrics.
    fn metrics(&self) -> String;
    fn swap(&self, request: &SwapRequest) -> Result<ActionOutcome, ControlError>;
    fn rollback(&self) -> Result<ActionOutcome, ControlError>;
    fn pause(&self) -> Result<ActionOutcome, ControlError>;
    fn resume(&self) -> Result<ActionOutcome, ControlError>;
    /// Device defaults on every GPU, then paused.
    fn restore_defaults(&self) -> Result<ActionOutcome, ControlError>;
}

/// What a metrics-only listener serves ([`ApiServer::start_metrics_only`]).
pub trait MetricsSource: Send + Sync {
    /// The exposition, in Prometheus's text format.
    fn metrics(&self) -> String;
}

mod accept;
mod auth;
pub mod client;
pub mod load;
mod paths;
mod routes;
mod server;

pub use client::{ApiClient, ClientError};
pub use paths::{NoDefaultSocket, default_socket_path};
pub use routes::{ENDPOINTS, MAX_BODY_BYTES};
pub use server::{ApiConfig, ApiError, ApiServer};
