//! The off-node fence's configuration: a TOML file mapping each node to its fence agent,
//! the agent's options and where its BMC password comes from, checked when it is loaded
//! (every error names the key and the fix).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::store::DEFAULT_PROOF_TTL;

/// How long a node must have been seen silent before its BMC is used, by default.
pub const DEFAULT_AFTER: Duration = Duration::from_secs(15);
/// The nodes' lease TTL assumed where the file does not say (`fleet.lease_ttl`'s default).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);
/// How long one agent invocation may run before it is killed (Pacemaker's default
/// `stonith-timeout`; `fence_redfish` alone waits up to 20 s for the power to change).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long after a failed action the next is tried.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(30);

/// Where fence agents live where `PATH` does not name them (Debian and RHEL install them
/// in /usr/sbin, which a non-root user's `PATH` often lacks).
const AGENT_FOLDERS: &[&str] = &["/usr/sbin", "/sbin"];

/// What is wrong with an off-node fence configuration: each names the key and the fix.
#[derive(Debug, thiserror::Error)]
pub enum OffNodeConfigError {
    #[error("cannot read the off-node fence file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{origin} is not an off-node fence configuration: {message}")]
    Parse { origin: String, message: String },
    #[error("{origin}: `{key}` {problem}; {fix}")]
    Invalid {
        origin: String,
        key: String,
        problem: String,
        fix: String,
    },
}

/// Where a node's BMC password comes from (never the configuration itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PasswordSource {
    /// A file holding the password (a trailing newline is dropped); readable by the
    /// coordinator only.
    File(PathBuf),
    /// An environment variable of the coordinator's (a systemd `LoadCredential=` or a
    /// Kubernetes secret mounted as one).
    Env(String),
}

impl PasswordSource {
    pub(super) fn describe(&self) -> String {
        match self {
            Self::File(path) => format!("the file {}", path.display()),
            Self::Env(name) => format!("the environment variable {name}"),
        }
    }

    /// The password, or why it cannot be had (without it).
    pub(super) fn read(&self) -> Result<String, String> {
        let raw = match self {
            Self::File(path) => std::fs::read_to_string(path).map_err(|e| e.to_string())?,
            Self::Env(name) => std::env::var(name).map_err(|e| e.to_string())?,
        };
        let password = raw.strip_suffix('\n').unwrap_or(&raw);
        let password = password.strip_suffix('\r').unwrap_or(password);
        if password.is_empty() {
            return Err("it is empty".into());
        }
        if password.contains(['\n', '\r', '\0']) {
            // On the agent's standard input a line break would end the password and
            // start another option.
            return Err("it holds a line break or a NUL".into());
        }
        Ok(password.to_owned())
    }
}

/// One node's fence action: the agent, its options, where its password comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeFenceAction {
    pub node: String,
    /// The agent's program, resolved when the file was loaded.
    pub agent: PathBuf,
    /// The agent's options (its long option names: `ip`, `ipport`, `username`,
    /// `systems-uri`, `plug`, `ssl-insecure`, …), given on its standard input. Never
    /// `action` (the coordinator's) nor `password`.
    pub options: BTreeMap<String, String>,
    pub password: Option<PasswordSource>,
    /// Environment variables set for the agent (e.g. `REQUESTS_CA_BUNDLE` for the BMC's
    /// CA).
    pub env: BTreeMap<String, String>,
    /// How long the coordinator must have seen the node silent, unproven, with watts
    /// stranded, before it acts.
    pub after: Duration,
    /// How long one agent invocation may run before it is killed.
    pub timeout: Duration,
    /// How long after a failure the next action is tried.
    pub retry_after: Duration,
}

impl NodeFenceAction {
    /// The agent's name, as a proof and the logs say it (`fence_redfish`).
    pub fn agent_name(&self) -> String {
        self.agent.file_name().map_or_else(
            || self.agent.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        )
    }

    /// The BMC's address from the agent's options (`ip` or `ipaddr`, with `ipport`), or
    /// the plug where the agent addresses the node by plug alone.
    pub fn bmc_address(&self) -> String {
        let host = ["ip", "ipaddr", "plug", "port"]
            .iter()
            .find_map(|key| self.options.get(*key));
        match (host, self.options.get("ipport")) {
            (Some(host), Some(port)) => format!("{host}:{port}"),
            (Some(host), None) => host.clone(),
            (None, _) => "(no address)".into(),
        }
    }

    /// Who writes the proof: the agent and the BMC it spoke to.
    pub fn proof_by(&self) -> String {
        format!("{} {}", self.agent_name(), self.bmc_address())
    }
}

/// The validated configuration: what the coordinator may do to which node.
#[derive(Debug, Clone, PartialEq)]
pub struct OffNodeConfig {
    /// The nodes' lease TTL, as the operator states it (checked against `after`).
    pub lease_ttl: Duration,
    /// The TTL of the proofs written (the lease each is written under).
    pub proof_ttl: Duration,
    /// By node name.
    pub nodes: BTreeMap<String, NodeFenceAction>,
}

/// The file as written (every key optional but `agent`; unknown keys refused).
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    after_s: Option<f64>,
    lease_ttl_s: Option<f64>,
    timeout_s: Option<f64>,
    retry_after_s: Option<f64>,
    proof_ttl_s: Option<f64>,
    #[serde(default)]
    nodes: BTreeMap<String, RawNode>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    agent: String,
    #[serde(default)]
    options: BTreeMap<String, toml::Value>,
    password_file: Option<PathBuf>,
    password_env: Option<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    after_s: Option<f64>,
    timeout_s: Option<f64>,
    retry_after_s: Option<f64>,
}

/// Options the coordinator sets itself, or that would put a secret in the file.
const RESERVED_OPTIONS: &[(&str, &str)] = &[
    (
        "action",
        "is the coordinator's to set (off, then status): remove it",
    ),
    (
        "option",
        "is the old name of `action`, the coordinator's to set: remove it",
    ),
    (
        "password",
        "would put the BMC's password in this file: put it in a file of its own and name it in `password_file`, or name an environment variable in `password_env`",
    ),
    (
        "passwd",
        "would put the BMC's password in this file: put it in a file of its own and name it in `password_file`, or name an environment variable in `password_env`",
    ),
];

impl OffNodeConfig {
    /// Reads and checks the file at `path`.
    pub fn load(path: &Path) -> Result<Self, OffNodeConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| OffNodeConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and checks `text`; `origin` names it in errors (the file's path).
    pub fn parse(text: &str, origin: &str) -> Result<Self, OffNodeConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| OffNodeConfigError::Parse {
            origin: origin.to_owned(),
            message: e.to_string(),
        })?;
        let invalid = |key: &str, problem: String, fix: &str| OffNodeConfigError::Invalid {
            origin: origin.to_owned(),
            key: key.to_owned(),
            problem,
            fix: fix.to_owned(),
        };
        let seconds = |key: &str, value: Option<f64>, default: Duration| match value {
            None => Ok(default),
            Some(s) if s.is_finite() && s > 0.0 => Duration::try_from_secs_f64(s)
                .map_err(|e| invalid(key, format!("is {s}: {e}"), "give seconds above zero")),
            Some(s) => Err(invalid(
                key,
                format!("is {s}"),
                "give a number of seconds above zero",
            )),
        };
        let lease_ttl = seconds("lease_ttl_s", raw.lease_ttl_s, DEFAULT_LEASE_TTL)?;
        let after = seconds("after_s", raw.after_s, DEFAULT_AFTER)?;
        let timeout = seconds("timeout_s", raw.timeout_s, DEFAULT_TIMEOUT)?;
        let retry_after = seconds("retry_after_s", raw.retry_after_s, DEFAULT_RETRY_AFTER)?;
        let proof_ttl = seconds("proof_ttl_s", raw.proof_ttl_s, DEFAULT_PROOF_TTL)?;
        if raw.nodes.is_empty() {
            return Err(invalid(
                "nodes",
                "names no node".into(),
                "add a [nodes.<name>] table (agent, options, password_file) for each node whose BMC the coordinator may power off",
            ));
        }
        let mut nodes = BTreeMap::new();
        for (node, raw_node) in raw.nodes {
            let key = |name: &str| format!("nodes.{node}.{name}");
            if node.is_empty() {
                return Err(invalid(
                    "nodes",
                    "has a table with an empty name".into(),
                    "name each [nodes.<name>] table after the node, as the budget names it",
                ));
            }
            let node_after = seconds(&key("after_s"), raw_node.after_s, after)?;
            // A node is silent from the moment its lease lapsed; waiting at least one
            // lease more gives an agent that restarts, or a link that flapped, the time to
            // join again before its host's work is killed.
            if node_after <= lease_ttl {
                let which = if raw_node.after_s.is_some() {
                    key("after_s")
                } else {
                    "after_s".to_owned()
                };
                return Err(invalid(
                    &which,
                    format!(
                        "is {:?}, not more than the nodes' lease TTL ({lease_ttl:?}, `lease_ttl_s`)",
                        node_after
                    ),
                    "power a node off only once it has been silent longer than a lease: raise after_s above lease_ttl_s (and set lease_ttl_s to the nodes' fleet.lease_ttl)",
                ));
            }
            let agent = resolve_agent(&raw_node.agent)
                .map_err(|problem| invalid(&key("agent"), problem, "install the fence agents (apt-get install fence-agents) or give the agent's absolute path"))?;
            let mut options = BTreeMap::new();
            for (name, value) in raw_node.options {
                let option_key = format!("nodes.{node}.options.{name}");
                if let Some((_, fix)) = RESERVED_OPTIONS.iter().find(|(r, _)| *r == name) {
                    return Err(invalid(&option_key, "is not allowed".into(), fix));
                }
                if name.is_empty()
                    || !name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
                {
                    return Err(invalid(
                        &option_key,
                        "is not an option name".into(),
                        "use the agent's long option names (letters, digits, - and _), as `fence_redfish --help` lists them",
                    ));
                }
                let text = match value {
                    toml::Value::String(s) => s,
                    toml::Value::Integer(i) => i.to_string(),
                    toml::Value::Float(f) => f.to_string(),
                    toml::Value::Boolean(b) => if b { "1" } else { "0" }.to_owned(),
                    other => {
                        return Err(invalid(
                            &option_key,
                            format!("is a {}", other.type_str()),
                            "give a string, a number or a boolean",
                        ));
                    }
                };
                if text.contains(['\n', '\r', '\0']) {
                    return Err(invalid(
                        &option_key,
                        "holds a line break or a NUL".into(),
                        "options go to the agent one a line: give the value on one line",
                    ));
                }
                options.insert(name, text);
            }
            let password = match (raw_node.password_file, raw_node.password_env) {
                (Some(_), Some(_)) => {
                    return Err(invalid(
                        &key("password_file"),
                        "is given with password_env".into(),
                        "give one of password_file and password_env",
                    ));
                }
                (Some(path), None) => Some(PasswordSource::File(path)),
                (None, Some(name)) => Some(PasswordSource::Env(name)),
                (None, None) => None,
            };
            if let Some(source) = &password {
                let which = match source {
                    PasswordSource::File(_) => key("password_file"),
                    PasswordSource::Env(_) => key("password_env"),
                };
                if let Err(why) = source.read() {
                    return Err(invalid(
                        &which,
                        format!("names {}, which cannot be read: {why}", source.describe()),
                        "make it hold the BMC's password (one line), readable by the coordinator",
                    ));
                }
                if let PasswordSource::File(path) = source {
                    warn_if_others_can_read(&node, path);
                }
            }
            for (name, value) in &raw_node.env {
                if name.is_empty() || name.contains(['=', '\0']) || value.contains('\0') {
                    return Err(invalid(
                        &format!("nodes.{node}.env.{name}"),
                        "is not an environment variable".into(),
                        "give NAME = \"value\" without = or NUL in the name",
                    ));
                }
            }
            let action = NodeFenceAction {
                node: node.clone(),
                agent,
                options,
                password,
                env: raw_node.env,
                after: node_after,
                timeout: seconds(&key("timeout_s"), raw_node.timeout_s, timeout)?,
                retry_after: seconds(&key("retry_after_s"), raw_node.retry_after_s, retry_after)?,
            };
            nodes.insert(node, action);
        }
        Ok(Self {
            lease_ttl,
            proof_ttl,
            nodes,
        })
    }
}

/// The agent's program: a path as given (it must be a file), or a bare name found on
/// `PATH` or in the folders fence agents are installed in.
fn resolve_agent(agent: &str) -> Result<PathBuf, String> {
    if agent.trim().is_empty() {
        return Err("is empty".into());
    }
    if agent.contains('/') {
        let path = PathBuf::from(agent);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!("is {agent}, which is not a file"))
        };
    }
    let path_folders = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    path_folders
        .into_iter()
        .chain(AGENT_FOLDERS.iter().map(PathBuf::from))
        .map(|folder| folder.join(agent))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| {
            format!(
                "is {agent}, found neither on PATH nor in {}",
                AGENT_FOLDERS.join(" or ")
            )
        })
}

/// A password file others may read is named loudly (not refused: the operator may have
/// reasons, such as a file only a container sees).
fn warn_if_others_can_read(node: &str, path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o004 != 0
    {
        tracing::warn!(
            node = %node,
            "fleet: the BMC password file {} of node `{node}` is readable by every user: chmod o-r it",
            path.display()
        );
    }
}
