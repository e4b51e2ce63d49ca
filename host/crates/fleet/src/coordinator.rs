//! The coordinator: one of several replicas leads a domain (the store elects it); the
//! leader, every round, reads the domain whole, lets the allocator propose targets, and
//! writes the grants the ledger allows, fenced on its leadership. A replica that does not
//! lead campaigns every round, so a leader that dies is replaced once its lease lapses.
//!
//! The coordinator keeps nothing of its own between rounds that safety needs: the
//! ledger is rebuilt from the store each round, so a new leader starts from exactly
//! what the old one wrote.

use std::time::{Duration, Instant};

use crate::allocator::Allocator;
use crate::ledger::Ledger;
use crate::store::{FleetStore, GrantWrite, Leadership, StoreError};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoordinatorConfig {
    pub domain: String,
    /// This replica's name (the leader key holds it).
    pub name: String,
    /// The leadership lease's TTL: how long a dead leader holds the domain.
    pub ttl: Duration,
}

/// What one round did.
#[derive(Debug, Clone, PartialEq)]
pub enum Round {
    /// Another replica leads.
    Follower,
    /// This replica leads: the ledger it read and the grants it wrote.
    Leader {
        /// Whether it took over in this round.
        took_over: bool,
        charged_w: f64,
        available_w: f64,
        grants_written: usize,
        /// Nodes with a live lease.
        live_nodes: usize,
        /// Nodes the budget does not name that hold watts: named loudly.
        unbudgeted: Vec<String>,
        /// The ledger after the round's grants (for the coordinator's metrics).
        ledger: Box<Ledger>,
    },
}

#[derive(Debug)]
pub struct Coordinator {
    config: CoordinatorConfig,
    allocator: Box<dyn Allocator>,
    leadership: Option<Leadership>,
    /// When this replica last became leader.
    since: Option<Instant>,
}

impl Coordinator {
    pub fn new(config: CoordinatorConfig, allocator: Box<dyn Allocator>) -> Self {
        Self {
            config,
            allocator,
            leadership: None,
            since: None,
        }
    }

    pub fn config(&self) -> &CoordinatorConfig {
        &self.config
    }

    pub fn leads(&self) -> bool {
        self.leadership.is_some()
    }

    /// When this replica became the leader, if it leads.
    pub fn leading_since(&self) -> Option<Instant> {
        self.since
    }

    /// One round. An error leaves the domain as it was (nothing is written unless the
    /// whole round succeeds) and the round is simply tried again.
    pub fn round(&mut self, store: &dyn FleetStore) -> Result<Round, StoreError> {
        if let Some(leadership) = &self.leadership
            && !store.renew_leadership(leadership)?
        {
            tracing::warn!(domain = %self.config.domain, "fleet: leadership lost (lease lapsed)");
            self.leadership = None;
            self.since = None;
        }
        let mut took_over = false;
        if self.leadership.is_none() {
            match store.campaign(&self.config.domain, &self.config.name, self.config.ttl)? {
                Some(leadership) => {
                    tracing::info!(
                        domain = %self.config.domain,
                        name = %self.config.name,
                        fence = leadership.fence,
                        "fleet: leading the domain"
                    );
                    self.leadership = Some(leadership);
                    self.since = Some(Instant::now());
                    took_over = true;
                }
                None => return Ok(Round::Follower),
            }
        }
        let Some(leadership) = self.leadership.clone() else {
            return Ok(Round::Follower);
        };
        let view = store.read_domain(&self.config.domain)?.ok_or_else(|| {
            StoreError::Config(format!(
                "domain `{}` has no budget in the store: set one with `tokwatt fleet budget`",
                self.config.domain
            ))
        })?;
        let ledger = Ledger::from_view(view);
        for (node, watts) in &ledger.unbudgeted {
            tracing::warn!(
                domain = %self.config.domain,
                node = %node,
                "fleet: node `{node}` joined but the budget does not name it; it holds {watts} W outside the plan"
            );
        }
        let allocation = self.allocator.allocate(&ledger);
        let planned = ledger.plan(&allocation.targets, &allocation.order);
        let writes: Vec<GrantWrite<'_>> = planned
            .iter()
            .map(|p| GrantWrite {
                node: &p.node,
                lease: p.lease,
                grant: p.grant,
            })
            .collect();
        if !writes.is_empty() && !store.write_grants(&leadership, &writes)? {
            tracing::warn!(domain = %self.config.domain, "fleet: a newer leader holds the domain");
            self.leadership = None;
            self.since = None;
            return Ok(Round::Follower);
        }
        let after = ledger.after(&planned);
        Ok(Round::Leader {
            took_over,
            charged_w: after.charged_w(),
            available_w: after.budget.available_w(),
            grants_written: writes.len(),
            live_nodes: ledger.entries.iter().filter(|e| e.live()).count(),
            unbudgeted: ledger.unbudgeted.iter().map(|(n, _)| n.clone()).collect(),
            ledger: Box::new(after),
        })
    }

    /// Gives the leadership up (a clean stop): another replica takes over at once.
    pub fn resign(&mut self, store: &dyn FleetStore) -> Result<(), StoreError> {
        self.since = None;
        match self.leadership.take() {
            Some(leadership) => store.resign(&leadership),
            None => Ok(()),
        }
    }
}
