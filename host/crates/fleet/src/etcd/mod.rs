//! The fleet in etcd. Under `/tokwatt/fleet/<domain>/`:
//!
//! - `budget`: the domain's [`DomainBudget`] (JSON), written by the operator;
//! - `leader`: the coordinator's name, bound to its lease, created only where absent;
//!   its create revision is the fencing token of every grant write;
//! - `nodes/<node>`: the node's [`NodeReport`], bound to the node's lease;
//! - `grants/<node>`: the node's [`Grant`], bound to the node's lease too, so a lapsed
//!   node's record and grant go together, in one step of etcd's log;
//! - `holds/<node>`: the node's [`Hold`], bound to no lease: what it may still hold once
//!   silent, written by the leader with the grants, or released by an operator;
//! - `proofs/<node>/<source>`: the newest [`ReleaseProof`] of each source (fence, agent,
//!   off-node, operator; the boot unit's one per boot, `boot-<boot>`), each under a lease
//!   of its writer's own: what the node's GPUs were read back at, after whatever lowered
//!   them;
//! - `freeze`: the domain's [`Freeze`] (who froze its grants and why), bound to the
//!   lease of the experiment that holds it, created only where absent.
//!
//! A domain is read whole in one transaction: every key at one revision.

mod client;
mod tls;

use std::time::Duration;

pub use client::{
    Compare, Endpoint, EtcdClient, KeyValue, Op, Txn, TxnOutcome, check_endpoint, check_endpoints,
};
pub use tls::{ClientFiles, EtcdTls, TlsError, TlsFile, TlsFiles};

use crate::budget::{DomainBudget, valid_name};
use crate::store::{
    DomainView, FleetStore, Freeze, FreezeOutcome, FreezeSession, Grant, GrantWrite, Hold,
    HoldWrite, Leadership, NodeRecord, NodeReport, NodeSession, NodeView, ProofSource,
    ReleaseProof, StoreError, StoredFreeze, StoredHold, StoredProof, Written,
};

/// Where every domain lives.
pub const ROOT: &str = "/tokwatt/fleet/";

/// Most operations one transaction carries: etcd refuses more than its `--max-txn-ops`
/// (128 unless its operator raised it) with "too many operations in txn request".
pub const MAX_TXN_OPS: usize = 128;

/// The fleet's keys in one etcd cluster.
#[derive(Debug)]
pub struct EtcdFleet {
    client: EtcdClient,
}

fn domain_prefix(domain: &str) -> String {
    format!("{ROOT}{domain}/")
}

fn budget_key(domain: &str) -> String {
    format!("{ROOT}{domain}/budget")
}

fn leader_key(domain: &str) -> String {
    format!("{ROOT}{domain}/leader")
}

fn node_key(domain: &str, node: &str) -> String {
    format!("{ROOT}{domain}/nodes/{node}")
}

fn grant_key(domain: &str, node: &str) -> String {
    format!("{ROOT}{domain}/grants/{node}")
}

fn hold_key(domain: &str, node: &str) -> String {
    format!("{ROOT}{domain}/holds/{node}")
}

/// One key per source, but one per boot for the boot unit's records: a node that
/// rebooted is still reported (and held) under its old boot until its agent joins again,
/// and the old boot's record must still prove that one meanwhile.
fn proof_key(domain: &str, node: &str, proof: &ReleaseProof) -> String {
    match proof.source {
        ProofSource::Boot => format!("{ROOT}{domain}/proofs/{node}/boot-{:016x}", proof.boot),
        source => format!("{ROOT}{domain}/proofs/{node}/{}", source.label()),
    }
}

fn freeze_key(domain: &str) -> String {
    format!("{ROOT}{domain}/freeze")
}

/// The freeze a key holds. A value that does not parse still freezes the domain (its
/// lease is live, so someone holds it): frozen is the side that only holds grants and
/// still makes every cut, and `fleet show` names the damage.
fn stored_freeze(kv: &KeyValue) -> StoredFreeze {
    let freeze = decode::<Freeze>(kv).unwrap_or_else(|error| Freeze {
        by: "unknown (the freeze key is damaged)".to_owned(),
        why: error.to_string(),
    });
    StoredFreeze {
        freeze,
        lease: kv.lease,
        create_revision: kv.create_revision,
    }
}

fn check_name(what: &str, name: &str) -> Result<(), StoreError> {
    if valid_name(name) {
        Ok(())
    } else {
        Err(StoreError::Config(format!(
            "the {what} name `{name}` cannot be a key: use letters, digits, `-`, `_` and `.`"
        )))
    }
}

fn decode<T: serde::de::DeserializeOwned>(kv: &KeyValue) -> Result<T, StoreError> {
    serde_json::from_slice(&kv.value).map_err(|e| StoreError::Damaged {
        what: kv.key.clone(),
        why: e.to_string(),
    })
}

fn encode<T: serde::Serialize>(value: &T) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(value).map_err(|e| StoreError::Protocol(format!("cannot encode: {e}")))
}

impl EtcdFleet {
    /// One transaction of a round's writes, only while `leadership` holds the leader
    /// key and the domain's freeze is still `freeze`.
    fn write_fenced(
        &self,
        leadership: &Leadership,
        freeze: Option<&StoredFreeze>,
        success: Vec<Op>,
    ) -> Result<Written, StoreError> {
        let leader = leader_key(&leadership.domain);
        let outcome = self.client.txn(&Txn {
            compare: vec![
                Compare::CreateRevision(leader.clone(), leadership.fence),
                // The freeze the round read, still the same one (0: still none).
                Compare::CreateRevision(
                    freeze_key(&leadership.domain),
                    freeze.map_or(0, |f| f.create_revision),
                ),
            ],
            success,
            // Which compare failed: the leader key read in the same step.
            failure: vec![Op::ListPrefix { prefix: leader }],
        })?;
        if outcome.succeeded {
            return Ok(Written::Done);
        }
        let still_leads = outcome
            .lists
            .first()
            .and_then(|keys| {
                keys.iter()
                    .find(|kv| kv.key == leader_key(&leadership.domain))
            })
            .is_some_and(|kv| kv.create_revision == leadership.fence);
        Ok(if still_leads {
            Written::FreezeChanged
        } else {
            Written::Deposed
        })
    }

    /// The fleet on the etcd cluster at `endpoints` (`http://HOST:PORT` each), each
    /// request given `timeout`.
    pub fn connect(endpoints: &[String], timeout: Duration) -> Result<Self, StoreError> {
        Self::connect_with(endpoints, None, timeout)
    }

    /// The fleet on the etcd cluster at `endpoints`: `https://HOST:PORT` ones spoken to
    /// over `tls`, `http://` ones (with `tls` `None`) in plain.
    pub fn connect_with(
        endpoints: &[String],
        tls: Option<&EtcdTls>,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        Ok(Self {
            client: EtcdClient::with_tls(endpoints, tls, timeout)?,
        })
    }

    pub fn client(&self) -> &EtcdClient {
        &self.client
    }
}

impl EtcdFleet {
    /// A joining node's first record, written with its hold's release cleared where an
    /// operator released it: a release states the node's GPUs are at its reserve until
    /// it reports again, so it ends here, even where no coordinator sees the node live
    /// before it goes silent again. Compared on the hold's revision, so a release that
    /// lands between the read and the write is cleared on the next try.
    fn first_report(&self, session: &NodeSession, report: &NodeReport) -> Result<(), StoreError> {
        let record = Op::Put {
            key: node_key(&session.domain, &session.node),
            value: encode(report)?,
            lease: session.lease,
        };
        let key = hold_key(&session.domain, &session.node);
        for _ in 0..5 {
            let stored = self.client.get(&key)?;
            let mut success = vec![record.clone()];
            // A damaged hold is not a release: the leader rewrites it.
            if let Some(kv) = &stored
                && let Ok(hold) = decode::<Hold>(kv)
                && hold.released
            {
                success.push(Op::Put {
                    key: key.clone(),
                    value: encode(&Hold {
                        released: false,
                        ..hold
                    })?,
                    lease: 0,
                });
            }
            let outcome = self.client.txn(&Txn {
                compare: vec![Compare::ModRevision(
                    key.clone(),
                    stored.as_ref().map_or(0, |kv| kv.mod_revision),
                )],
                success,
                failure: Vec::new(),
            })?;
            if outcome.succeeded {
                return Ok(());
            }
        }
        Err(StoreError::Protocol(format!(
            "node `{}`'s hold kept changing while it joined; it joins again next period",
            session.node
        )))
    }
}

impl FleetStore for EtcdFleet {
    fn put_budget(&self, budget: &DomainBudget) -> Result<(), StoreError> {
        budget
            .check()
            .map_err(|e| StoreError::Config(format!("budget of `{}`: {e}", budget.domain)))?;
        self.client
            .put(&budget_key(&budget.domain), &encode(budget)?, 0)
    }

    fn read_domain(&self, domain: &str) -> Result<Option<DomainView>, StoreError> {
        check_name("domain", domain)?;
        let prefix = domain_prefix(domain);
        let outcome = self.client.txn(&Txn {
            compare: Vec::new(),
            success: vec![Op::ListPrefix {
                prefix: prefix.clone(),
            }],
            failure: Vec::new(),
        })?;
        let keys = outcome.lists.into_iter().next().unwrap_or_default();
        let mut budget = None;
        let mut records: Vec<(String, NodeRecord)> = Vec::new();
        let mut grants: Vec<(String, i64, Grant)> = Vec::new();
        let mut holds: Vec<(String, StoredHold)> = Vec::new();
        let mut freeze = None;
        let mut proofs = Vec::new();
        for kv in &keys {
            let rest = &kv.key[prefix.len()..];
            if rest == "budget" {
                budget = Some(decode::<DomainBudget>(kv)?);
            } else if rest == "freeze" {
                freeze = Some(stored_freeze(kv));
            } else if let Some(node) = rest.strip_prefix("nodes/") {
                records.push((
                    node.to_owned(),
                    NodeRecord {
                        lease: kv.lease,
                        report: decode(kv)?,
                    },
                ));
            } else if let Some(node) = rest.strip_prefix("grants/") {
                grants.push((node.to_owned(), kv.lease, decode(kv)?));
            } else if let Some(path) = rest.strip_prefix("proofs/") {
                // A damaged proof proves nothing: it is left out (the node stays charged).
                if let (Some((node, _)), Ok(proof)) = (path.split_once('/'), decode(kv)) {
                    proofs.push(StoredProof {
                        node: node.to_owned(),
                        proof,
                        mod_revision: kv.mod_revision,
                        lease: kv.lease,
                    });
                }
            } else if let Some(node) = rest.strip_prefix("holds/") {
                holds.push((
                    node.to_owned(),
                    StoredHold {
                        hold: decode(kv)?,
                        mod_revision: kv.mod_revision,
                    },
                ));
            }
        }
        let Some(budget) = budget else {
            return Ok(None);
        };
        let mut names: Vec<String> = budget.nodes.iter().map(|n| n.node.clone()).collect();
        for (node, _) in &records {
            if !names.contains(node) {
                names.push(node.clone());
            }
        }
        let nodes = names
            .into_iter()
            .map(|node| {
                let record = records.iter().find(|(n, _)| *n == node).map(|(_, r)| *r);
                // A grant counts only under the lease the node lives under now: one left
                // from an earlier lease (a restart within the TTL) is not the node's.
                let grant = record.and_then(|r| {
                    grants
                        .iter()
                        .find(|(n, lease, _)| *n == node && *lease == r.lease)
                        .map(|(_, _, g)| *g)
                });
                let hold = holds.iter().find(|(n, _)| *n == node).map(|(_, h)| *h);
                NodeView {
                    node,
                    record,
                    grant,
                    hold,
                }
            })
            .collect();
        Ok(Some(DomainView {
            revision: outcome.revision,
            budget,
            nodes,
            freeze,
            proofs,
        }))
    }

    fn campaign(
        &self,
        domain: &str,
        candidate: &str,
        ttl: Duration,
    ) -> Result<Option<Leadership>, StoreError> {
        check_name("domain", domain)?;
        let (lease, ttl) = self.client.grant_lease(ttl)?;
        let key = leader_key(domain);
        let outcome = self.client.txn(&Txn {
            compare: vec![Compare::CreateRevision(key.clone(), 0)],
            success: vec![Op::Put {
                key,
                value: candidate.as_bytes().to_vec(),
                lease,
            }],
            failure: Vec::new(),
        });
        match outcome {
            Ok(outcome) if outcome.succeeded => Ok(Some(Leadership {
                domain: domain.to_owned(),
                candidate: candidate.to_owned(),
                lease,
                // The put is the transaction's one write: the key's create revision.
                fence: outcome.revision,
                ttl,
            })),
            other => {
                // Another leads (or the attempt failed): the lease is not needed.
                let _ = self.client.revoke(lease);
                other.map(|_| None)
            }
        }
    }

    fn renew_leadership(&self, leadership: &Leadership) -> Result<bool, StoreError> {
        Ok(self.client.keep_alive(leadership.lease)?.is_some())
    }

    fn resign(&self, leadership: &Leadership) -> Result<(), StoreError> {
        self.client.revoke(leadership.lease)
    }

    fn write_grants(
        &self,
        leadership: &Leadership,
        freeze: Option<&StoredFreeze>,
        grants: &[GrantWrite<'_>],
        holds: &[HoldWrite<'_>],
    ) -> Result<Written, StoreError> {
        // Each node's grant and hold go together, nodes in the plan's order (cuts first,
        // then raises, then holds alone); a round of many nodes is cut into transactions
        // of at most MAX_TXN_OPS, each one fenced. Every node's pair is safe on its own
        // (a raise is charged from the headroom of the holds already in the store), so
        // transactions that land while a later one is refused leave the domain sound.
        let mut per_node: Vec<(&str, Vec<Op>)> = Vec::new();
        for g in grants {
            check_name("node", g.node)?;
            per_node.push((
                g.node,
                vec![Op::Put {
                    key: grant_key(&leadership.domain, g.node),
                    value: encode(&g.grant)?,
                    lease: g.lease,
                }],
            ));
        }
        for h in holds {
            check_name("node", h.node)?;
            let put = Op::Put {
                key: hold_key(&leadership.domain, h.node),
                value: encode(&h.hold)?,
                lease: 0,
            };
            match per_node.iter_mut().find(|(node, _)| *node == h.node) {
                Some((_, ops)) => ops.push(put),
                None => per_node.push((h.node, vec![put])),
            }
        }
        let mut chunks: Vec<Vec<Op>> = vec![Vec::new()];
        for (_, ops) in per_node {
            if chunks
                .last()
                .is_some_and(|c| c.len() + ops.len() > MAX_TXN_OPS)
            {
                chunks.push(Vec::new());
            }
            if let Some(chunk) = chunks.last_mut() {
                chunk.extend(ops);
            }
        }
        for success in chunks.into_iter().filter(|c| !c.is_empty()) {
            let written = self.write_fenced(leadership, freeze, success)?;
            if written != Written::Done {
                return Ok(written);
            }
        }
        Ok(Written::Done)
    }

    fn release(
        &self,
        domain: &str,
        node: &str,
        hold: &Hold,
        hold_revision: i64,
        record: &ReleaseProof,
    ) -> Result<bool, StoreError> {
        check_name("domain", domain)?;
        check_name("node", node)?;
        let key = hold_key(domain, node);
        let (lease, _) = self.client.grant_lease(crate::store::DEFAULT_PROOF_TTL)?;
        let outcome = self.client.txn(&Txn {
            compare: vec![
                // No live record: the node is silent (its lease lapsed, or it left).
                Compare::CreateRevision(node_key(domain, node), 0),
                Compare::ModRevision(key.clone(), hold_revision),
            ],
            success: vec![
                Op::Put {
                    key,
                    value: encode(hold)?,
                    lease: 0,
                },
                Op::Put {
                    key: proof_key(domain, node, record),
                    value: encode(record)?,
                    lease,
                },
            ],
            failure: Vec::new(),
        })?;
        if !outcome.succeeded {
            let _ = self.client.revoke(lease);
        }
        Ok(outcome.succeeded)
    }

    fn prove(
        &self,
        domain: &str,
        node: &str,
        proof: &ReleaseProof,
        ttl: Duration,
    ) -> Result<i64, StoreError> {
        check_name("domain", domain)?;
        check_name("node", node)?;
        let (lease, _) = self.client.grant_lease(ttl)?;
        let outcome = self.client.txn(&Txn {
            compare: Vec::new(),
            success: vec![Op::Put {
                key: proof_key(domain, node, proof),
                value: encode(proof)?,
                lease,
            }],
            failure: Vec::new(),
        });
        match outcome {
            Ok(outcome) => Ok(outcome.revision),
            Err(error) => {
                let _ = self.client.revoke(lease);
                Err(error)
            }
        }
    }

    fn join(
        &self,
        domain: &str,
        node: &str,
        ttl: Duration,
        report: &NodeReport,
    ) -> Result<NodeSession, StoreError> {
        check_name("domain", domain)?;
        check_name("node", node)?;
        let (lease, ttl) = self.client.grant_lease(ttl)?;
        let session = NodeSession {
            domain: domain.to_owned(),
            node: node.to_owned(),
            lease,
            ttl,
        };
        if let Err(error) = self.first_report(&session, report) {
            let _ = self.client.revoke(lease);
            return Err(error);
        }
        Ok(session)
    }

    fn renew(&self, session: &NodeSession) -> Result<Option<Duration>, StoreError> {
        self.client.keep_alive(session.lease)
    }

    fn report(&self, session: &NodeSession, report: &NodeReport) -> Result<(), StoreError> {
        self.client.put(
            &node_key(&session.domain, &session.node),
            &encode(report)?,
            session.lease,
        )
    }

    fn grant(&self, session: &NodeSession) -> Result<Option<Grant>, StoreError> {
        match self
            .client
            .get(&grant_key(&session.domain, &session.node))?
        {
            Some(kv) if kv.lease == session.lease => decode(&kv).map(Some),
            _ => Ok(None),
        }
    }

    fn leave(&self, session: &NodeSession) -> Result<(), StoreError> {
        self.client.revoke(session.lease)
    }

    fn freeze(
        &self,
        domain: &str,
        freeze: &Freeze,
        ttl: Duration,
    ) -> Result<FreezeOutcome, StoreError> {
        check_name("domain", domain)?;
        let key = freeze_key(domain);
        let value = encode(freeze)?;
        // A freeze that lapses between the failed create and the read is tried again.
        for _ in 0..3 {
            let (lease, ttl) = self.client.grant_lease(ttl)?;
            let outcome = self.client.txn(&Txn {
                compare: vec![Compare::CreateRevision(key.clone(), 0)],
                success: vec![Op::Put {
                    key: key.clone(),
                    value: value.clone(),
                    lease,
                }],
                failure: Vec::new(),
            });
            match outcome {
                Ok(outcome) if outcome.succeeded => {
                    return Ok(FreezeOutcome::Frozen(FreezeSession {
                        domain: domain.to_owned(),
                        lease,
                        ttl,
                    }));
                }
                other => {
                    // Another holds it (or the attempt failed): the lease is not needed.
                    let _ = self.client.revoke(lease);
                    other?;
                }
            }
            if let Some(kv) = self.client.get(&key)? {
                return Ok(FreezeOutcome::HeldBy(stored_freeze(&kv).freeze));
            }
        }
        Err(StoreError::Protocol(format!(
            "domain `{domain}`'s freeze kept appearing and lapsing while this one was asked for; try again"
        )))
    }

    fn renew_freeze(&self, session: &FreezeSession) -> Result<bool, StoreError> {
        Ok(self.client.keep_alive(session.lease)?.is_some())
    }

    fn thaw(&self, session: &FreezeSession) -> Result<(), StoreError> {
        self.client.revoke(session.lease)
    }
}
