//! The coordinator: one of several replicas leads a domain (the store elects it); the
//! leader, every round, reads the domain whole, lets the allocator propose targets, and
//! writes the grants the ledger allows, fenced on its leadership. A replica that does not
//! lead campaigns every round, so a leader that dies is replaced once its lease lapses.
//!
//! The coordinator keeps nothing of its own between rounds that safety needs: the
//! ledger is rebuilt from the store each round, so a new leader starts from exactly
//! what the old one wrote. Its one memory is when it first saw each node silent (a
//! fenced node's charge falls once its fence's deadline has passed since then): a new
//! leader starts that count anew, which only lengthens a charge.
//!
//! A frozen domain (an experiment's [`Freeze`](crate::store::Freeze), read with the rest
//! of the domain) is not allocated: every grant is held where it is, and only the cuts
//! the budget needs and a joining node's reserve are written, each marked as such
//! ([`frozen_allocation`]).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::allocator::{Allocator, frozen_allocation};
use crate::ledger::{Ledger, Why};
use crate::offnode::OffNodeFence;
use crate::store::{FleetStore, GrantWrite, HoldWrite, Leadership, StoreError, Written};

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
        /// Holds written with the grants (nodes whose charge, fence or defaults moved).
        holds_written: usize,
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
    /// While it leads: when it first saw each budgeted node silent (no live record).
    silent_since: BTreeMap<String, Instant>,
    /// The nodes last named for a missing fence, and the budget's last broken rule:
    /// warned of when they change, not every round.
    named_fence_missing: BTreeSet<String>,
    budget_warning: Option<String>,
    /// Who froze the domain, as last said in the log (a change is said once).
    frozen_by: Option<String>,
    /// Powers frozen hosts off through their BMCs, while this replica leads.
    off_node: Option<OffNodeFence>,
}

impl Coordinator {
    pub fn new(config: CoordinatorConfig, allocator: Box<dyn Allocator>) -> Self {
        Self {
            config,
            allocator,
            leadership: None,
            since: None,
            silent_since: BTreeMap::new(),
            named_fence_missing: BTreeSet::new(),
            budget_warning: None,
            frozen_by: None,
            off_node: None,
        }
    }

    /// Runs `fence` after each round this replica leads: a node silent long enough with
    /// watts stranded and no proof is powered off through its BMC, and proven so
    /// ([`crate::offnode`]).
    pub fn with_off_node(mut self, fence: OffNodeFence) -> Self {
        self.off_node = Some(fence);
        self
    }

    /// The off-node fence, where one is configured (its counts: the metrics).
    pub fn off_node(&self) -> Option<&OffNodeFence> {
        self.off_node.as_ref()
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

    /// One round. An error leaves the domain sound (each node's grant and hold land
    /// together or not at all, and each pair is safe alone) and the round is simply
    /// tried again.
    pub fn round(&mut self, store: &dyn FleetStore) -> Result<Round, StoreError> {
        if let Some(leadership) = &self.leadership
            && !store.renew_leadership(leadership)?
        {
            tracing::warn!(domain = %self.config.domain, "fleet: leadership lost (lease lapsed)");
            self.step_down();
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
                    // What it saw while leading before is stale: count silence anew.
                    self.silent_since.clear();
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
        let now = Instant::now();
        let silence = self.count_silence(&view, now);
        let ledger = Ledger::with_silence(view, &silence);
        self.warn_of(&ledger);
        // Frozen: the allocator is not asked (it would move watts toward the nodes that
        // ask most, which in an experiment is one arm); the grants are held.
        let allocation = if ledger.freeze.is_some() {
            frozen_allocation(&ledger)
        } else {
            self.allocator.allocate(&ledger)
        };
        let planned = ledger.plan(&allocation.targets, &allocation.order);
        let after = ledger.after(&planned);
        let holds = after.holds(&planned);
        let grant_writes: Vec<GrantWrite<'_>> = planned
            .iter()
            .map(|p| GrantWrite {
                node: &p.node,
                lease: p.lease,
                grant: p.grant,
            })
            .collect();
        let hold_writes: Vec<HoldWrite<'_>> = holds
            .iter()
            .map(|h| HoldWrite {
                node: &h.node,
                hold: h.hold,
            })
            .collect();
        let writes = !grant_writes.is_empty() || !hold_writes.is_empty();
        let written = if writes {
            store.write_grants(
                &leadership,
                ledger.freeze.as_ref(),
                &grant_writes,
                &hold_writes,
            )?
        } else {
            Written::Done
        };
        match written {
            Written::Done => {}
            Written::Deposed => {
                tracing::warn!(domain = %self.config.domain, "fleet: a newer leader holds the domain");
                self.step_down();
                return Ok(Round::Follower);
            }
            Written::FreezeChanged => {
                // Planned for a domain that is frozen or thawed now: nothing was written,
                // and the next round plans from what the store says then.
                tracing::info!(domain = %self.config.domain, "fleet: the domain's freeze changed while the round planned; nothing written, planned again next round");
                // Still the leader: a frozen host's watts are freed under a freeze too.
                self.tend_off_node(store, &ledger);
                return Ok(Round::Leader {
                    took_over,
                    charged_w: ledger.charged_w(),
                    available_w: ledger.budget.available_w(),
                    grants_written: 0,
                    holds_written: 0,
                    live_nodes: ledger.entries.iter().filter(|e| e.live()).count(),
                    unbudgeted: ledger.unbudgeted.iter().map(|(n, _)| n.clone()).collect(),
                    ledger: Box::new(ledger),
                });
            }
        }
        self.tend_off_node(store, &after);
        Ok(Round::Leader {
            took_over,
            charged_w: after.charged_w(),
            available_w: after.budget.available_w(),
            grants_written: grant_writes.len(),
            holds_written: hold_writes.len(),
            live_nodes: ledger.entries.iter().filter(|e| e.live()).count(),
            unbudgeted: ledger.unbudgeted.iter().map(|(n, _)| n.clone()).collect(),
            ledger: Box::new(after),
        })
    }

    fn step_down(&mut self) {
        self.leadership = None;
        self.since = None;
        self.silent_since.clear();
        if let Some(fence) = &mut self.off_node {
            fence.stand_down();
        }
    }

    /// Hands the leader's ledger to the off-node fence, where one is configured (it
    /// starts and collects actions; it never waits on one).
    fn tend_off_node(&mut self, store: &dyn FleetStore, ledger: &Ledger) {
        if let Some(fence) = &mut self.off_node {
            fence.tend(store, &self.config.domain, ledger);
        }
    }

    /// How long this leader has seen each budgeted node silent, counted from the first
    /// round it saw it so (a node that reports again starts over).
    fn count_silence(
        &mut self,
        view: &crate::store::DomainView,
        now: Instant,
    ) -> BTreeMap<String, Duration> {
        let silent: BTreeSet<&str> = view
            .nodes
            .iter()
            .filter(|n| n.record.is_none() && view.budget.node(&n.node).is_some())
            .map(|n| n.node.as_str())
            .collect();
        self.silent_since
            .retain(|node, _| silent.contains(node.as_str()));
        for node in silent {
            self.silent_since.entry(node.to_owned()).or_insert(now);
        }
        self.silent_since
            .iter()
            .map(|(node, since)| (node.clone(), now.saturating_duration_since(*since)))
            .collect()
    }

    /// Names what an operator must fix: a budget that breaks a rule, a node the budget
    /// does not name, a node the budget calls fenced that declares no fence, a node
    /// that went silent with watts stranded.
    fn warn_of(&mut self, ledger: &Ledger) {
        let domain = &self.config.domain;
        let broken = ledger.budget.check().err().map(|e| e.to_string());
        if broken != self.budget_warning {
            if let Some(why) = &broken {
                tracing::warn!(
                    domain = %domain,
                    "fleet: the budget in the store breaks a rule ({why}); the ledger charges every node what it may hold anyway, so the domain may stay over it until cuts land: write a budget that passes `tokwatt fleet budget --check`"
                );
            }
            self.budget_warning = broken;
        }
        for (node, watts) in &ledger.unbudgeted {
            tracing::warn!(
                domain = %domain,
                node = %node,
                "fleet: node `{node}` joined but the budget does not name it; it holds {watts} W outside the plan"
            );
        }
        let missing: BTreeSet<String> = ledger
            .fence_missing()
            .into_iter()
            .map(str::to_owned)
            .collect();
        for node in missing.difference(&self.named_fence_missing) {
            if let Some(entry) = ledger.entries.iter().find(|e| e.node() == node) {
                tracing::warn!(
                    domain = %domain,
                    node = %node,
                    "fleet: the budget calls node `{node}` fenced, but it declares no fence, or no boot unit proved it puts the reserve in force at this boot (a record from `tokwatt fence --once --etcd …`): it is charged {:.0} W, what a reboot may leave, instead of its {:.0} W reserve; run its fence and its boot unit with etcd access, or set fenced = false in the budget",
                    entry.floor_w,
                    entry.budget.reserve_w
                );
            }
        }
        self.named_fence_missing = missing;
        let frozen_by = ledger
            .freeze
            .as_ref()
            .map(|f| format!("{} ({})", f.freeze.by, f.freeze.why));
        if frozen_by != self.frozen_by {
            match &frozen_by {
                Some(by) => tracing::warn!(
                    domain = %domain,
                    "fleet: the domain is frozen by {by}: every grant is held where it is; only the cuts the budget needs and a joining node's reserve are written"
                ),
                None => {
                    tracing::info!(domain = %domain, "fleet: the domain is thawed: grants move again")
                }
            }
            self.frozen_by = frozen_by;
        }
        for entry in &ledger.entries {
            let first_round_silent = entry.silent_for == Some(Duration::ZERO);
            if first_round_silent && entry.hold.is_some() && entry.stranded_w > 0.0 {
                let until = match entry.why {
                    Why::Proven(source) => format!(
                        "on the {} record of the caps read back, until it reports again",
                        source.label()
                    ),
                    _ => "until a record proves its caps lower (its fence, its boot unit, a restarted agent, an off-node fence), it reports again, or an operator releases it (`tokwatt fleet release`)".to_owned(),
                };
                tracing::warn!(
                    domain = %domain,
                    node = %entry.node(),
                    reason = entry.why.label(),
                    "fleet: node `{}` is silent: charged {:.0} W ({:.0} W above its reserve) {until}",
                    entry.node(),
                    entry.charged_w,
                    entry.stranded_w
                );
            }
        }
    }

    /// Gives the leadership up (a clean stop): another replica takes over at once.
    pub fn resign(&mut self, store: &dyn FleetStore) -> Result<(), StoreError> {
        self.since = None;
        self.silent_since.clear();
        if let Some(fence) = &mut self.off_node {
            fence.stand_down();
        }
        match self.leadership.take() {
            Some(leadership) => store.resign(&leadership),
            None => Ok(()),
        }
    }
}
