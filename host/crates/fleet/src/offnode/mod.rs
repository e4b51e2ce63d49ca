//! The off-node fence: the coordinator powers a frozen host off through its BMC, then
//! writes that down as a [`ReleaseProof`] of source [`ProofSource::OffNode`].
//!
//! A whole host can freeze (a hung kernel, a paused VM): its agent and its on-node fence
//! stop together, so nothing on the node can lower its caps or write a proof, and its
//! watts stay charged to it (`silent-unproven`) however long it is silent. What can still
//! act is outside the host: its baseboard management controller. As Pacemaker does, the
//! coordinator runs one of the ClusterLabs fence agents (`fence_redfish`,
//! `fence_ipmilan`, …) that the operator configured for the node, asks it to power the
//! node off, reads the power state back through the same agent, and only on `Status:
//! OFF` writes a proof that the node holds 0 W (the ledger still charges its reboot
//! floor: a powered-off node may be powered on again).
//!
//! The agent is given its options on its standard input, one `name=value` a line, as
//! Pacemaker's fencer does (the fence agent API): the BMC's password never appears on a
//! command line another user can read, nor in a log. The password comes from a file or an
//! environment variable, read at each action (so a rotated one is picked up), never from
//! the configuration itself.
//!
//! Rules (each for a reason):
//! - Only the leader acts ([`OffNodeFence::tend`] is called after a leader's round, and
//!   [`OffNodeFence::stand_down`] when it stops leading): two replicas powering one node
//!   off at once would do no harm, but a follower's view is stale.
//! - Only a node the ledger charges `silent-unproven` with watts stranded, and only once
//!   the coordinator has seen it silent for `after_s` and past the deadline its own fence
//!   declared: the on-node fence, which frees the watts without killing the host's work,
//!   gets its chance first. Never a live node, one proven by any record, or one released.
//! - A node that reports again, is proven by another record, or is released while its
//!   action runs has the action cancelled (the agent killed; an off already sent to the
//!   BMC cannot be taken back), and its outcome is never written.
//! - A proof is written only where the node is still silent under the same hold (the
//!   hold is rewritten with every grant, so a node that came back and was granted watts
//!   since has a newer hold, and a proof older than it never counts).
//! - A failure (an agent that fails, times out, or reads back anything but OFF) writes
//!   nothing, is logged as an error, counted, and tried again after `retry_after_s`.
//! - The coordinator's round never waits on an agent: each action runs on a thread of its
//!   own and its outcome is collected at the next round.

mod agent;
mod config;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

pub use agent::{AgentAction, AgentRun, OffNodeError, PoweredOff, power_off, run_agent};
pub use config::{
    DEFAULT_AFTER, DEFAULT_LEASE_TTL, DEFAULT_RETRY_AFTER, DEFAULT_TIMEOUT, NodeFenceAction,
    OffNodeConfig, OffNodeConfigError, PasswordSource,
};

use crate::ledger::{Entry, Ledger, Why};
use crate::store::{FleetStore, ProofSource, ReleaseProof};

/// What the off-node fence has done since it started (the coordinator's metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OffNodeCounts {
    /// Actions started.
    pub started: u64,
    /// Nodes powered off, read back off, and proven.
    pub powered_off: u64,
    /// Actions that failed, timed out, read back anything but OFF, or whose proof could
    /// not be written.
    pub failed: u64,
    /// Actions cancelled: the node reported again, was proven or released meanwhile, or
    /// this replica stopped leading.
    pub cancelled: u64,
}

/// Where one node stands with its fence, for the hold it is silent under.
#[derive(Debug)]
enum NodeState {
    /// An action runs on its thread.
    Running {
        attempt: u64,
        hold_revision: i64,
        cancel: Arc<AtomicBool>,
    },
    /// The last action failed: the next waits until `until`.
    Waiting { hold_revision: i64, until: Instant },
    /// Powered off and proven: nothing more for this hold.
    Proven { hold_revision: i64 },
}

impl NodeState {
    fn hold_revision(&self) -> i64 {
        match self {
            Self::Running { hold_revision, .. }
            | Self::Waiting { hold_revision, .. }
            | Self::Proven { hold_revision } => *hold_revision,
        }
    }
}

#[derive(Debug)]
struct Outcome {
    node: String,
    attempt: u64,
    result: Result<PoweredOff, OffNodeError>,
}

/// The coordinator's off-node fence: hand it the ledger after each leader round
/// ([`Self::tend`]); it starts, collects and cancels the actions.
#[derive(Debug)]
pub struct OffNodeFence {
    config: OffNodeConfig,
    states: BTreeMap<String, NodeState>,
    outcomes_tx: mpsc::Sender<Outcome>,
    outcomes_rx: mpsc::Receiver<Outcome>,
    next_attempt: u64,
    counts: OffNodeCounts,
    /// Configured nodes the budget does not name, as last warned of (said once).
    named_unbudgeted: BTreeSet<String>,
}

/// The hold revision a silent node awaits a proof under: `Some` only for a node charged
/// `silent-unproven` with watts stranded (never live, proven, released or never heard).
fn awaiting_proof(entry: &Entry) -> Option<i64> {
    if entry.live() || entry.why != Why::SilentUnproven || entry.stranded_w <= 0.0 {
        return None;
    }
    entry.hold.map(|h| h.mod_revision)
}

/// Why a node no longer awaits its off-node fence, in words for the log.
fn no_longer_awaiting(entry: Option<&Entry>) -> String {
    match entry {
        None => "left the budget".into(),
        Some(e) if e.live() => "reported again".into(),
        Some(e) => match e.why {
            Why::Proven(source) => format!("was proven by its {} record", source.label()),
            Why::Released => "was released by an operator".into(),
            Why::SilentUnproven if e.stranded_w > 0.0 => {
                "went silent again under a newer hold".into()
            }
            _ => "has no watts stranded any more".into(),
        },
    }
}

impl OffNodeFence {
    pub fn new(config: OffNodeConfig) -> Self {
        let (outcomes_tx, outcomes_rx) = mpsc::channel();
        Self {
            config,
            states: BTreeMap::new(),
            outcomes_tx,
            outcomes_rx,
            next_attempt: 1,
            counts: OffNodeCounts::default(),
            named_unbudgeted: BTreeSet::new(),
        }
    }

    pub fn config(&self) -> &OffNodeConfig {
        &self.config
    }

    pub fn counts(&self) -> OffNodeCounts {
        self.counts
    }

    /// The nodes whose action runs now.
    pub fn running(&self) -> Vec<&str> {
        self.states
            .iter()
            .filter(|(_, s)| matches!(s, NodeState::Running { .. }))
            .map(|(n, _)| n.as_str())
            .collect()
    }

    /// After a leader's round: writes the proofs of the actions that succeeded (where
    /// their node is still silent under the same hold), cancels the actions of nodes
    /// that no longer await one, and starts an action for each configured node silent
    /// long enough. Never waits on an agent.
    pub fn tend(&mut self, store: &dyn FleetStore, domain: &str, ledger: &Ledger) {
        self.collect(store, domain, ledger);
        let now = Instant::now();
        // Nodes gone from the budget: nothing to fence any more.
        let gone: Vec<String> = self
            .states
            .keys()
            .filter(|node| !ledger.entries.iter().any(|e| e.node() == node.as_str()))
            .cloned()
            .collect();
        for node in gone {
            self.forget(domain, &node, None);
        }
        // A node configured under a name the budget does not use is never fenced: most
        // likely a typo, so said (once) rather than left to be found when it freezes.
        let unbudgeted: BTreeSet<String> = self
            .config
            .nodes
            .keys()
            .filter(|node| !ledger.entries.iter().any(|e| e.node() == node.as_str()))
            .cloned()
            .collect();
        for node in unbudgeted.difference(&self.named_unbudgeted) {
            tracing::warn!(
                domain = %domain,
                node = %node,
                "fleet: the off-node fence configures node `{node}`, which the budget does not name: it is never fenced; name it as the budget does"
            );
        }
        self.named_unbudgeted = unbudgeted;
        for entry in &ledger.entries {
            let node = entry.node();
            // Cloned: the state map changes below while the action is in hand.
            let Some(action) = self.config.nodes.get(node).cloned() else {
                continue;
            };
            let Some(hold_revision) = awaiting_proof(entry) else {
                self.forget(domain, node, Some(entry));
                continue;
            };
            match self.states.get(node) {
                Some(state) if state.hold_revision() != hold_revision => {
                    // Silent again under a newer hold (it came back and went again):
                    // what was done for the older one says nothing of this one.
                    self.forget(domain, node, Some(entry));
                }
                Some(NodeState::Running { .. } | NodeState::Proven { .. }) => continue,
                Some(NodeState::Waiting { until, .. }) if now < *until => continue,
                _ => {}
            }
            let Some(silent_for) = entry.silent_for else {
                continue;
            };
            if silent_for < Self::wait_for(&action, entry) {
                continue;
            }
            self.start(domain, entry, action, hold_revision, now);
        }
    }

    /// How long a node must have been silent: `after`, and past the deadline its own
    /// fence declared (that fence frees the watts without killing the host's work).
    fn wait_for(action: &NodeFenceAction, entry: &Entry) -> Duration {
        let declared = entry
            .hold
            .and_then(|h| h.hold.fence)
            .and_then(|f| Duration::try_from_secs_f64(f.deadline_s).ok())
            .unwrap_or_default();
        action.after.max(declared)
    }

    fn start(
        &mut self,
        domain: &str,
        entry: &Entry,
        action: NodeFenceAction,
        hold_revision: i64,
        now: Instant,
    ) {
        let node = entry.node().to_owned();
        let attempt = self.next_attempt;
        self.next_attempt += 1;
        self.counts.started += 1;
        tracing::warn!(
            domain = %domain,
            node = %node,
            "fleet: node `{node}` has been silent {:.0} s with {:.0} W stranded and no proof of release: powering it off through its BMC ({})",
            entry.silent_for.unwrap_or_default().as_secs_f64(),
            entry.stranded_w,
            action.proof_by()
        );
        let cancel = Arc::new(AtomicBool::new(false));
        let thread_cancel = Arc::clone(&cancel);
        let tx = self.outcomes_tx.clone();
        let thread_node = node.clone();
        let retry_after = action.retry_after;
        let spawned = std::thread::Builder::new()
            .name(format!("off-node-{node}"))
            .spawn(move || {
                let result = power_off(&action, &thread_cancel);
                // The receiver is gone only once the coordinator is: nothing to tell.
                let _ = tx.send(Outcome {
                    node: thread_node,
                    attempt,
                    result,
                });
            });
        match spawned {
            Ok(_) => {
                self.states.insert(
                    node,
                    NodeState::Running {
                        attempt,
                        hold_revision,
                        cancel,
                    },
                );
            }
            Err(error) => {
                self.counts.failed += 1;
                tracing::error!(
                    domain = %domain,
                    node = %node,
                    "fleet: the off-node fence of node `{node}` could not start a thread ({error}); tried again in {retry_after:?}"
                );
                self.states.insert(
                    node,
                    NodeState::Waiting {
                        hold_revision,
                        until: now + retry_after,
                    },
                );
            }
        }
    }

    /// The outcomes of the actions that ended since the last round.
    fn collect(&mut self, store: &dyn FleetStore, domain: &str, ledger: &Ledger) {
        let finished: Vec<Outcome> = self.outcomes_rx.try_iter().collect();
        for outcome in finished {
            let Outcome {
                node,
                attempt,
                result,
            } = outcome;
            // An outcome of an action cancelled since (its state gone or replaced) is
            // never written: the node came back, was proven, or this replica stood down.
            let hold_revision = match self.states.get(&node) {
                Some(NodeState::Running {
                    attempt: running,
                    hold_revision,
                    ..
                }) if *running == attempt => *hold_revision,
                _ => continue,
            };
            let retry_after = self
                .config
                .nodes
                .get(&node)
                .map_or(DEFAULT_RETRY_AFTER, |a| a.retry_after);
            let entry = ledger.entries.iter().find(|e| e.node() == node);
            let result = result.and_then(|off| {
                if entry.and_then(awaiting_proof) != Some(hold_revision) {
                    // Back, proven otherwise, or silent under a newer hold since the
                    // action started: a proof now could outlive what it saw.
                    return Ok(None);
                }
                let proof = ReleaseProof {
                    source: ProofSource::OffNode,
                    by: off.by.clone(),
                    caps_w: Vec::new(),
                    sum_w: 0.0,
                    at_unix_ms: off.at_unix_ms,
                    boot: 0,
                    detail: off.detail.clone(),
                };
                let revision = store.prove(domain, &node, &proof, self.config.proof_ttl)?;
                Ok(Some((off, revision)))
            });
            match result {
                Ok(Some((off, revision))) => {
                    self.counts.powered_off += 1;
                    tracing::warn!(
                        domain = %domain,
                        node = %node,
                        "fleet: node `{node}` is powered off through its BMC ({}) and read back off; its off-node proof is written at revision {revision}: it is charged its reboot floor from the next round",
                        off.by
                    );
                    self.states
                        .insert(node, NodeState::Proven { hold_revision });
                }
                Ok(None) => {
                    self.counts.cancelled += 1;
                    tracing::warn!(
                        domain = %domain,
                        node = %node,
                        "fleet: node `{node}` {} while its off-node fence ran: the power-off is not written down",
                        no_longer_awaiting(entry)
                    );
                    self.states.remove(&node);
                }
                Err(error) => {
                    self.counts.failed += 1;
                    tracing::error!(
                        domain = %domain,
                        node = %node,
                        "fleet: the off-node fence of node `{node}` failed: {error}; nothing is proven and the node stays charged; tried again in {retry_after:?}"
                    );
                    self.states.insert(
                        node,
                        NodeState::Waiting {
                            hold_revision,
                            until: Instant::now() + retry_after,
                        },
                    );
                }
            }
        }
    }

    /// Drops what was planned for `node`, cancelling its action where one runs.
    fn forget(&mut self, domain: &str, node: &str, entry: Option<&Entry>) {
        if let Some(NodeState::Running { cancel, .. }) = self.states.remove(node) {
            cancel.store(true, Ordering::Relaxed);
            self.counts.cancelled += 1;
            tracing::warn!(
                domain = %domain,
                node = %node,
                "fleet: node `{node}` {}: its off-node fence action is cancelled (the agent killed; an off already sent to its BMC cannot be taken back, and nothing is written down)",
                no_longer_awaiting(entry)
            );
        }
    }

    /// This replica no longer leads: every running action is cancelled and every plan
    /// dropped (the next leader counts each node's silence anew).
    pub fn stand_down(&mut self) {
        for (node, state) in std::mem::take(&mut self.states) {
            if let NodeState::Running { cancel, .. } = state {
                cancel.store(true, Ordering::Relaxed);
                self.counts.cancelled += 1;
                tracing::warn!(
                    node = %node,
                    "fleet: no longer leading: node `{node}`'s off-node fence action is cancelled"
                );
            }
        }
    }
}

impl Drop for OffNodeFence {
    fn drop(&mut self) {
        // No agent outlives the coordinator that started it with nobody to hear it.
        for state in self.states.values() {
            if let NodeState::Running { cancel, .. } = state {
                cancel.store(true, Ordering::Relaxed);
            }
        }
    }
}
