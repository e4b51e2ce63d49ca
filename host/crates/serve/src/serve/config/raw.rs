//! serve.toml as written: the file's layout, every key in its place, before any check.

use serde::Deserialize;
use std::path::PathBuf;
use toml::Spanned;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) policy: RawPolicy,
    #[serde(default)]
    pub(super) node: RawNode,
    #[serde(default)]
    pub(super) workload: RawWorkload,
    #[serde(default)]
    pub(super) api: RawApi,
    #[serde(default)]
    pub(super) metrics: RawMetrics,
    #[serde(default)]
    pub(super) output: RawOutput,
    #[serde(default)]
    pub(super) state: RawState,
    #[serde(default)]
    pub(super) objective: tokwatt_core::types::Objective,
    #[serde(default)]
    pub(super) guardrails: tokwatt_policy::envelope::Guardrails,
    #[serde(default)]
    pub(super) guard: tokwatt_policy::guard::GuardConfig,
    pub(super) fleet: Option<RawFleet>,
}

/// `[fleet]`: the node's place in a power domain.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFleet {
    pub(super) etcd: Spanned<Vec<String>>,
    pub(super) domain: Spanned<String>,
    pub(super) node: Option<Spanned<String>>,
    pub(super) reserve_w: Spanned<f64>,
    pub(super) lease_ttl: Option<Spanned<RawDuration>>,
    pub(super) margin: Option<Spanned<RawDuration>>,
    pub(super) report_every: Option<Spanned<RawDuration>>,
    pub(super) timeout: Option<Spanned<RawDuration>>,
    /// TLS to etcd (https:// endpoints): the CA that signed etcd's server certificate,
    /// and a client certificate and key where etcd requires one.
    pub(super) ca_file: Option<Spanned<PathBuf>>,
    pub(super) cert_file: Option<Spanned<PathBuf>>,
    pub(super) key_file: Option<Spanned<PathBuf>>,
    /// `[fleet.fence]`: what puts the node back at its reserve when the agent stops.
    pub(super) fence: Option<RawFence>,
}

/// `[fleet.fence]`: the mechanism outside the agent's loop that applies the reserve when
/// the loop stops running, and what the operator states about it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFence {
    pub(super) kind: Spanned<String>,
    pub(super) heartbeat: Option<Spanned<PathBuf>>,
    pub(super) status: Option<Spanned<PathBuf>>,
    pub(super) restore_s: Option<Spanned<f64>>,
    pub(super) covers_reboot: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicy {
    pub(super) spec: PathBuf,
    #[serde(default)]
    pub(super) plugin_dirs: Vec<PathBuf>,
    pub(super) cache_dir: Option<PathBuf>,
    pub(super) watch: Option<PathBuf>,
    pub(super) watch_period: Option<Spanned<RawDuration>>,
    pub(super) probation_ticks: Option<Spanned<i64>>,
    #[serde(default = "default_seed")]
    pub(super) seed: u64,
}

pub(super) fn default_seed() -> u64 {
    1
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawNode {
    pub(super) backend: Option<Spanned<String>>,
    pub(super) gpus: Option<Spanned<RawGpus>>,
    pub(super) tick: Option<Spanned<RawDuration>>,
    #[serde(default)]
    pub(super) dry_run: bool,
    #[serde(default)]
    pub(super) batch_only: bool,
    pub(super) sim_profile: Option<Spanned<String>>,
    pub(super) sim_gpus: Option<Spanned<i64>>,
    pub(super) sim_scenario: Option<PathBuf>,
    pub(super) sim_realtime: Option<Spanned<bool>>,
    pub(super) sim_driver: Option<Spanned<PathBuf>>,
}

/// A duration as written: a string with its unit (`"5m"`). A bare number, or any other
/// value, is kept so that the check can refuse it by key with the fix (a number has no
/// unit to read it in), rather than the parser's "invalid type".
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum RawDuration {
    Text(String),
    Number(f64),
    Other(toml::Value),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum RawGpus {
    Word(String),
    List(Vec<i64>),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWorkload {
    pub(super) source: Option<Spanned<String>>,
    pub(super) model: Option<String>,
    pub(super) context: Option<Spanned<i64>>,
    pub(super) batch_size_max: Option<Spanned<i64>>,
    #[serde(default)]
    pub(super) engine: Vec<RawEngine>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEngine {
    pub(super) gpu: Spanned<i64>,
    pub(super) url: Spanned<String>,
    #[serde(default)]
    pub(super) engine: Option<Spanned<String>>,
    pub(super) token_counter: Option<String>,
    pub(super) tpot_histogram: Option<String>,
    /// "" for none; else with `prompt_counter` the engine preset's names replaced.
    pub(super) ttft_histogram: Option<String>,
    pub(super) prompt_counter: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawApi {
    pub(super) socket: Option<PathBuf>,
    pub(super) http: Option<Spanned<String>>,
    pub(super) token_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMetrics {
    pub(super) listen: Option<Spanned<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOutput {
    pub(super) dir: Option<PathBuf>,
    pub(super) max_file_mib: Option<Spanned<i64>>,
    pub(super) keep_files: Option<Spanned<i64>>,
    pub(super) summary_every: Option<Spanned<RawDuration>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawState {
    pub(super) file: Option<PathBuf>,
}
