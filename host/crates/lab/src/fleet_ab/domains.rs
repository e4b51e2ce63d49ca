//! The power domains the nodes share budgets in, and why the experiment freezes them.
//!
//! Nodes in one power domain share its budget through the coordinator, which moves watts
//! toward the nodes that ask for more. In an experiment whose arms run on nodes of one
//! domain, that is interference between the arms: a greedier arm wins watts from the other
//! arm's nodes, so each arm is measured on watts the other gave up, and the verdict
//! compares the two policies as neither would run alone (a known failure of A/B tests
//! whose arms share a resource). So the experiment freezes each domain for its whole
//! length (before the first swap until every node is back): every node's grant is held
//! where it is, while every cut the budget needs is still made and marked as such. The
//! grants are read throughout; a grant that moved during a measured window other than by
//! such a cut fails the experiment, with its figures kept for the record.
//!
//! The store itself is behind [`PowerDomains`] (the fleet's etcd, through `tokwatt
//! fleet`'s client), as the nodes are behind their control API.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::counters::Window;
use super::experiment::BoxError;

/// A node's place in a power domain, as its status names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodePlace {
    pub domain: String,
    /// The node, as the domain's budget names it (may differ from its name in the nodes
    /// file).
    pub node: String,
}

/// One node's grant, as the store holds it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GrantSeen {
    /// Rises with every grant written to the node.
    pub generation: u64,
    pub watts: f64,
    /// Written while the domain was frozen, as a cut the budget forced (a lowered budget,
    /// a silent node's charge rising): the only move a freeze allows.
    pub forced_cut: bool,
}

/// One read of a domain.
#[derive(Debug, Clone, PartialEq)]
pub struct DomainReading {
    /// Every node the domain's budget names: its grant (`None`: no live lease, or no
    /// grant written yet).
    pub grants: BTreeMap<String, Option<GrantSeen>>,
    /// This experiment's freeze holds the domain now.
    pub frozen_by_us: bool,
    /// Who else holds a freeze of it, where another does.
    pub frozen_by_other: Option<String>,
}

/// The power domains' store, as the experiment needs it.
pub trait PowerDomains: Sync {
    /// Freezes `domain`'s grants for the experiment, `why` recorded with it, and keeps the
    /// freeze alive until [`Self::thaw`] (one that is no longer renewed, as when the
    /// experiment dies, lapses by itself). Returns who holds it, as the store names it.
    /// An error where it cannot: another holds a freeze (named), or the store does not
    /// answer.
    fn freeze(&self, domain: &str, why: &str) -> Result<String, BoxError>;
    fn read(&self, domain: &str) -> Result<DomainReading, BoxError>;
    /// Ends this experiment's freeze of `domain`; nothing where it holds none.
    fn thaw(&self, domain: &str) -> Result<(), BoxError>;
}

/// A domain the experiment froze, in `fleet-ab.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DomainRecord {
    pub domain: String,
    /// The experiment's nodes in it (their names in the nodes file).
    pub nodes: Vec<String>,
    /// Who held the freeze, as the store names it.
    pub frozen_by: String,
    /// Reads of its grants during the freeze, and those that failed (a failed read is
    /// tried again; a change is seen at the next).
    pub reads: u64,
    pub read_errors: u64,
    /// Whether the freeze was ended by the experiment (false: its end failed, and it
    /// lapses with its lease).
    pub thawed: bool,
}

/// A change of a node's grant seen during the freeze: between two reads, on Prometheus's
/// clock.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GrantChange {
    pub node: String,
    pub domain: String,
    /// The read that last saw the grant as it was, and the one that saw the change.
    pub after_s: f64,
    pub seen_s: f64,
    pub from: Option<GrantSeen>,
    pub to: Option<GrantSeen>,
    /// A cut the budget forced (marked so by the coordinator, and lower than before).
    pub forced_cut: bool,
    /// It may have happened inside a measured window.
    pub in_window: bool,
}

impl GrantChange {
    /// Whether the change may have happened within one of `windows`.
    pub fn overlaps(&self, windows: &[Window]) -> bool {
        windows
            .iter()
            .any(|w| self.after_s < w.end_s && self.seen_s > w.start_s)
    }

    /// A change the freeze allows: a cut the budget forced.
    pub fn allowed(from: Option<GrantSeen>, to: Option<GrantSeen>) -> bool {
        matches!((from, to), (Some(from), Some(to)) if to.forced_cut && to.watts < from.watts)
    }
}

impl std::fmt::Display for GrantChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let grant = |g: Option<GrantSeen>| {
            g.map_or_else(
                || "none".to_owned(),
                |g| format!("{:.0} W (#{})", g.watts, g.generation),
            )
        };
        write!(
            f,
            "node `{}`'s grant in domain `{}` went from {} to {}",
            self.node,
            self.domain,
            grant(self.from),
            grant(self.to)
        )
    }
}

/// The words a freeze is recorded with.
pub fn freeze_reason(a: &std::path::Path, b: &std::path::Path) -> String {
    format!(
        "tokwatt fleet ab, A {} vs B {}: every grant held for the experiment, so that neither arm wins watts from the other through the coordinator",
        a.display(),
        b.display()
    )
}
