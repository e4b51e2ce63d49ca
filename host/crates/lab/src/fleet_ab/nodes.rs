//! The nodes file: which agents take part, how to reach each one's control API, and which
//! of Prometheus's series are its own.
//!
//! ```toml
//! # Labels every node's series carry (optional), e.g. the scrape job.
//! labels = { job = "tokwatt" }
//!
//! [[node]]
//! name = "gpu-01"
//! socket = "/run/tokwatt/gpu-01.sock"   # or: url = "http://127.0.0.1:9400" with token_file
//! instance = "gpu-01:9400"              # its Prometheus `instance` label
//! labels = { rack = "r1" }              # more label equalities (optional)
//! load = 1200.0                         # optional: give it for every node or for none
//! ```
//!
//! Relative paths are taken from the nodes file's folder, as `serve.toml`'s are.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The largest nodes file read: thousands of nodes fit in far less.
const MAX_FILE_BYTES: u64 = 4 * 1024 * 1024;

/// How to reach a node's control API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiAddress {
    /// The agent's Unix socket.
    Socket(PathBuf),
    /// The agent's loopback HTTP listener, with the file holding its bearer token.
    Http { url: String, token_file: PathBuf },
}

impl std::fmt::Display for ApiAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApiAddress::Socket(path) => write!(f, "{}", path.display()),
            ApiAddress::Http { url, .. } => f.write_str(url),
        }
    }
}

/// Label equalities that select one node's series in Prometheus (after the scrape's
/// relabelling: what the targets page shows), e.g. `{instance="gpu-01:9400"}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Selector(pub BTreeMap<String, String>);

impl Selector {
    /// Whether a target or series with `labels` is this node's.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0
            .iter()
            .all(|(name, value)| labels.get(name) == Some(value))
    }

    /// The matchers inside a PromQL selector's braces, values escaped.
    pub fn promql(&self) -> String {
        self.0
            .iter()
            .map(|(name, value)| format!("{name}=\"{}\"", escape_label_value(value)))
            .collect::<Vec<_>>()
            .join(",")
    }
}

impl std::fmt::Display for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{{{}}}", self.promql())
    }
}

/// A PromQL string literal's body: backslash, quote and newline escaped.
fn escape_label_value(value: &str) -> String {
    let mut escaped = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => escaped.push_str("\\\\"),
            '"' => escaped.push_str("\\\""),
            '\n' => escaped.push_str("\\n"),
            c => escaped.push(c),
        }
    }
    escaped
}

/// One node of the experiment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FleetNode {
    pub name: String,
    pub api: ApiAddress,
    pub selector: Selector,
    /// The load to pair by, in any unit as long as every node's is in the same one; `None`:
    /// measured from Prometheus before the start (tokens per control tick).
    pub load: Option<f64>,
}

/// Why the nodes file cannot be used. Nothing has been asked of any node yet.
#[derive(Debug, thiserror::Error)]
#[error("the nodes file {}: {why}", path.display())]
pub struct NodesFileError {
    pub path: PathBuf,
    pub why: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default, rename = "node")]
    nodes: Vec<RawNode>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    name: String,
    socket: Option<PathBuf>,
    url: Option<String>,
    token_file: Option<PathBuf>,
    instance: Option<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    load: Option<f64>,
}

/// Reads and checks the nodes file at `path`.
pub fn load_nodes(path: &Path) -> Result<Vec<FleetNode>, NodesFileError> {
    let error = |why: String| NodesFileError {
        path: path.to_owned(),
        why,
    };
    let text = tokwatt_core::files::read_text_bounded(path, MAX_FILE_BYTES)
        .map_err(|e| error(format!("cannot be read: {e}")))?;
    let base = path.parent().unwrap_or(Path::new("."));
    parse_nodes(&text, base).map_err(error)
}

/// The nodes of a nodes file's `text`, relative paths taken from `base`; every problem
/// named with its node and key, and the fix.
pub fn parse_nodes(text: &str, base: &Path) -> Result<Vec<FleetNode>, String> {
    let raw: RawFile = toml::from_str(text).map_err(|e| e.to_string().trim_end().to_owned())?;
    if raw.nodes.is_empty() {
        return Err(
            "it names no node: add a [[node]] table per agent (name, socket or url, instance)"
                .into(),
        );
    }
    check_labels("the file's `labels`", &raw.labels)?;
    let resolve = |p: PathBuf| if p.is_absolute() { p } else { base.join(p) };
    let mut nodes: Vec<FleetNode> = Vec::with_capacity(raw.nodes.len());
    for (index, node) in raw.nodes.into_iter().enumerate() {
        let name = node.name.trim().to_owned();
        if name.is_empty() {
            return Err(format!("node {} has an empty `name`", index + 1));
        }
        let at = |key: &str| format!("node `{name}`: `{key}`");
        let api = match (node.socket, node.url, node.token_file) {
            (Some(socket), None, None) => ApiAddress::Socket(resolve(socket)),
            (None, Some(url), Some(token_file)) => {
                if !url.starts_with("http://") {
                    return Err(format!(
                        "{} = {url:?} is not http://HOST:PORT (the agent's loopback listener)",
                        at("url")
                    ));
                }
                ApiAddress::Http {
                    url,
                    token_file: resolve(token_file),
                }
            }
            (None, Some(_), None) => {
                return Err(format!(
                    "node `{name}` has a `url` without a `token_file`: name the file holding the agent's bearer token"
                ));
            }
            (None, None, Some(_)) => {
                return Err(format!(
                    "node `{name}` has a `token_file` without a `url`: a token is for the HTTP listener"
                ));
            }
            (None, None, None) => {
                return Err(format!(
                    "node `{name}` has no control API: give `socket` (the agent's Unix socket) or `url` with `token_file`"
                ));
            }
            (Some(_), Some(_), _) | (Some(_), None, Some(_)) => {
                return Err(format!(
                    "node `{name}` has both `socket` and `url`/`token_file`: give one way to reach it"
                ));
            }
        };
        check_labels(&at("labels"), &node.labels)?;
        // Without labels of its own, only the file-wide ones would select it: every node's.
        if node.instance.is_none() && node.labels.is_empty() {
            return Err(format!(
                "node `{name}` has no `instance` and no labels of its own: give its Prometheus `instance` label (host:port of its /metrics), or labels that only its series carry"
            ));
        }
        let mut labels = raw.labels.clone();
        labels.extend(node.labels);
        if let Some(instance) = node.instance {
            if labels
                .get("instance")
                .is_some_and(|other| *other != instance)
            {
                return Err(format!(
                    "{} and its `labels` name two instances: keep one",
                    at("instance")
                ));
            }
            labels.insert("instance".into(), instance);
        }
        if labels.values().any(String::is_empty) {
            return Err(format!(
                "node `{name}`: a label with an empty value matches series without that label; give a value"
            ));
        }
        if let Some(load) = node.load
            && !(load.is_finite() && load >= 0.0)
        {
            return Err(format!(
                "{} = {load} is not a load: give a number at or above 0",
                at("load")
            ));
        }
        nodes.push(FleetNode {
            name,
            api,
            selector: Selector(labels),
            load: node.load,
        });
    }
    for (i, node) in nodes.iter().enumerate() {
        for other in &nodes[..i] {
            if other.name == node.name {
                return Err(format!(
                    "two nodes are named `{}`: names must differ",
                    node.name
                ));
            }
            if other.selector == node.selector {
                return Err(format!(
                    "nodes `{}` and `{}` have the same labels {}: each node's series must be its own",
                    other.name, node.name, node.selector
                ));
            }
            if other.api == node.api {
                return Err(format!(
                    "nodes `{}` and `{}` have the same control API {}: each is one agent",
                    other.name, node.name, node.api
                ));
            }
        }
    }
    let given = nodes.iter().filter(|n| n.load.is_some()).count();
    if given != 0 && given != nodes.len() {
        let missing: Vec<&str> = nodes
            .iter()
            .filter(|n| n.load.is_none())
            .map(|n| n.name.as_str())
            .collect();
        return Err(format!(
            "`load` is given for {given} of {} nodes (not for {}): give it for every node or for none (then it is measured), since given and measured loads are in different units",
            nodes.len(),
            missing.join(", ")
        ));
    }
    Ok(nodes)
}

/// Prometheus label names: `[a-zA-Z_][a-zA-Z0-9_]*`, and not the reserved `__` ones.
fn check_labels(at: &str, labels: &BTreeMap<String, String>) -> Result<(), String> {
    for name in labels.keys() {
        let mut chars = name.chars();
        let valid = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid || name.starts_with("__") {
            return Err(format!(
                "{at}: `{name}` is not a label name a series carries (letters, digits and _, not starting with a digit or __)"
            ));
        }
    }
    Ok(())
}
