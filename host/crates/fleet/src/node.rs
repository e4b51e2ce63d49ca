//! A node's side: its membership in the domain, and what it may hold. The node renews its
//! lease every period and drops to its reserve **on its own clock** when it has not
//! renewed for the lease's TTL less a margin, so it is at its reserve before etcd can
//! expire the lease and the coordinator can give its watts away.
//!
//! Why the node's clock suffices: the drop deadline is counted from when the node *sent*
//! its last successful renewal, which is before etcd received it, and etcd's expiry is
//! counted from its receipt (and only extended by an etcd leader change). Only the two
//! clocks' rates enter, never their offsets; the margin covers rate drift, one control
//! tick, and the time to apply a cut.

use std::time::{Duration, Instant};

use crate::store::{Fence, FleetStore, Grant, NodeReport, NodeSession, StoreError};

/// Caps read back this close above a grant acknowledge it: NVML reports milliwatts,
/// and a board rounds a requested limit to its own step.
pub const ACK_TOLERANCE_W: f64 = 0.5;

/// How a node takes part.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeConfig {
    pub domain: String,
    pub node: String,
    /// What the node holds when it hears no coordinator (the domain's budget may lower
    /// it: the lower of the two is held).
    pub reserve_w: f64,
    /// The lease's time to live.
    pub ttl: Duration,
    /// How long before the lease could lapse the node drops to its reserve.
    pub margin: Duration,
}

impl NodeConfig {
    /// The margin must leave time to renew: at least a second of the TTL after it.
    pub fn check(&self) -> Result<(), String> {
        if self.ttl < Duration::from_secs(2) {
            return Err(format!(
                "the lease TTL ({:?}) is under 2 s: etcd grants whole seconds, and a node must renew well within it",
                self.ttl
            ));
        }
        if self.margin.is_zero() || self.margin + Duration::from_secs(1) > self.ttl {
            return Err(format!(
                "the margin ({:?}) must be above zero and at least a second under the TTL ({:?})",
                self.margin, self.ttl
            ));
        }
        if !(self.reserve_w.is_finite() && self.reserve_w > 0.0) {
            return Err(format!(
                "the reserve ({} W) must be a positive number of watts",
                self.reserve_w
            ));
        }
        Ok(())
    }
}

/// What the node may hold now: the sum its GPUs' power caps must stay within.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Allowance {
    /// No live grant: the reserve.
    Reserve(f64),
    /// The coordinator's grant, within the lease's deadline.
    Granted(Grant),
}

impl Allowance {
    pub fn watts(&self) -> f64 {
        match self {
            Self::Reserve(w) => *w,
            Self::Granted(g) => g.watts,
        }
    }
}

/// The grant and until when it holds: what the control loop reads every tick, while the
/// link talks to the store on a thread of its own.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AllowanceSnapshot {
    grant: Option<Grant>,
    deadline: Option<Instant>,
    reserve_w: f64,
}

impl AllowanceSnapshot {
    /// Nothing heard yet: the reserve.
    pub fn reserve(reserve_w: f64) -> Self {
        Self {
            grant: None,
            deadline: None,
            reserve_w,
        }
    }

    /// `grant`, held until `deadline` (by the node's clock), then `reserve_w`.
    pub fn granted(grant: Grant, deadline: Instant, reserve_w: f64) -> Self {
        Self {
            grant: Some(grant),
            deadline: Some(deadline),
            reserve_w,
        }
    }

    pub fn allowance(&self, now: Instant) -> Allowance {
        match (self.grant, self.deadline) {
            (Some(grant), Some(deadline)) if now < deadline => Allowance::Granted(Grant {
                // Never below the reserve: a grant under it would be a coordinator's
                // mistake, and the reserve is budgeted anyway.
                watts: grant.watts.max(self.reserve_w),
                ..grant
            }),
            _ => Allowance::Reserve(self.reserve_w),
        }
    }

    /// The reserve held without a grant.
    pub fn reserve_w(&self) -> f64 {
        self.reserve_w
    }

    /// How long from `now` the node may still hold a grant without renewing its lease:
    /// until the lease could lapse, less the margin, by this node's clock (zero once
    /// passed; `None` where it holds no lease).
    pub fn holds_for(&self, now: Instant) -> Option<Duration> {
        self.deadline
            .map(|deadline| deadline.saturating_duration_since(now))
    }
}

/// Why the node holds its reserve, for its metrics and logs.
#[derive(Debug, Clone, PartialEq)]
pub enum LinkState {
    /// Joined, renewing, no grant yet or a grant in force.
    Live,
    /// Not joined (the store did not answer, or the lease lapsed): joining again.
    Apart(String),
}

/// The node's link to the domain.
#[derive(Debug)]
pub struct NodeLink {
    config: NodeConfig,
    session: Option<NodeSession>,
    /// Until when the lease is surely live, by this node's clock.
    deadline: Option<Instant>,
    grant: Option<Grant>,
    /// The generation of the last grant the node enforced and read back.
    acked_generation: u64,
    state: LinkState,
    counts: LinkCounts,
    /// The reserve held: the configured one, or the budget's where that is lower.
    reserve_w: f64,
    /// The fence this node declares in its reports (see [`Fence`]).
    fence: Option<Fence>,
    /// The sum of its GPUs' board-default caps, declared in its reports.
    default_w: f64,
    /// The boot it runs in ([`crate::store::boot_of`]; 0: unknown), declared in its reports.
    boot: u64,
}

/// What the link has been through, for the node's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkCounts {
    /// Requests to the store that failed (no member answered, or one refused).
    pub store_errors: u64,
    /// Leases found lapsed (the node was apart longer than its TTL).
    pub lapses: u64,
    /// Joins, the first included.
    pub joins: u64,
}

impl NodeLink {
    pub fn new(config: NodeConfig) -> Self {
        Self {
            reserve_w: config.reserve_w,
            config,
            session: None,
            deadline: None,
            grant: None,
            acked_generation: 0,
            state: LinkState::Apart("not joined yet".into()),
            counts: LinkCounts::default(),
            fence: None,
            default_w: 0.0,
            boot: 0,
        }
    }

    /// What the node declares from its next report on: its fence (`None` where it has
    /// none, or the fence stopped proving it is there) and its GPUs' board defaults.
    pub fn declare(&mut self, fence: Option<Fence>, default_w: f64) {
        self.fence = fence;
        self.default_w = default_w;
    }

    /// The boot the node runs in, declared from its next report on: a boot unit's record
    /// of the same boot proves a reboot lands at the reserve.
    pub fn declare_boot(&mut self, boot: u64) {
        self.boot = boot;
    }

    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// The reserve the node holds (the budget's where lower than the configured one).
    pub fn reserve_w(&self) -> f64 {
        self.reserve_w
    }

    pub fn state(&self) -> &LinkState {
        &self.state
    }

    pub fn counts(&self) -> LinkCounts {
        self.counts
    }

    pub fn session(&self) -> Option<&NodeSession> {
        self.session.as_ref()
    }

    /// The generation of the last grant the node enforced and read back (0: none).
    pub fn acked_generation(&self) -> u64 {
        self.acked_generation
    }

    /// What the node may hold at `now`: the grant while the lease is surely live, else
    /// the reserve. Cheap: call it every control tick.
    pub fn allowance(&self, now: Instant) -> Allowance {
        self.snapshot().allowance(now)
    }

    /// What [`Self::allowance`] needs, to hand to the thread that enforces it.
    pub fn snapshot(&self) -> AllowanceSnapshot {
        AllowanceSnapshot {
            grant: self.grant,
            deadline: self.deadline,
            reserve_w: self.reserve_w,
        }
    }

    /// One exchange with the store (every period, off the control loop's thread):
    /// join where apart, else renew, then read the grant. `report` is what the node
    /// has in force now. Errors leave the allowance to the deadline.
    pub fn exchange(&mut self, store: &dyn FleetStore, report: &NodeReport) {
        let sent = Instant::now();
        let Some(session) = self.session.clone() else {
            // The domain's budget names this node and its reserve: a node it does not name
            // holds watts outside the plan, and a reserve above the budget's could pass
            // the budget while the node is cut off. The lower of the two is held.
            match store.read_domain(&self.config.domain) {
                Ok(Some(view)) => match view.budget.node(&self.config.node) {
                    Some(named) => {
                        if named.reserve_w < self.reserve_w {
                            tracing::warn!(
                                node = %self.config.node,
                                "fleet: the domain's budget gives this node a reserve of {} W, below fleet.reserve_w ({} W): holding {} W",
                                named.reserve_w,
                                self.reserve_w,
                                named.reserve_w
                            );
                            self.reserve_w = named.reserve_w;
                        }
                    }
                    None => {
                        self.apart(format!(
                            "domain `{}`'s budget does not name node `{}`: add it (tokwatt fleet budget), or set fleet.node to the name it has there",
                            self.config.domain, self.config.node
                        ));
                        return;
                    }
                },
                Ok(None) => {
                    self.apart(format!(
                        "domain `{}` has no budget yet (tokwatt fleet budget)",
                        self.config.domain
                    ));
                    return;
                }
                Err(error) => {
                    self.counts.store_errors += 1;
                    self.apart(format!("cannot read the domain's budget: {error}"));
                    return;
                }
            }
            match store.join(
                &self.config.domain,
                &self.config.node,
                self.config.ttl,
                report,
            ) {
                Ok(session) => {
                    self.deadline = Some(sent + session.ttl.saturating_sub(self.config.margin));
                    self.session = Some(session);
                    self.grant = None;
                    self.acked_generation = 0;
                    self.state = LinkState::Live;
                    self.counts.joins += 1;
                }
                Err(error) => {
                    self.counts.store_errors += 1;
                    self.apart(format!("cannot join: {error}"));
                }
            }
            return;
        };
        match store.renew(&session) {
            Ok(Some(ttl)) => {
                self.deadline = Some(sent + ttl.saturating_sub(self.config.margin));
            }
            Ok(None) => {
                // The lease lapsed: the record and grant are gone; join again next time.
                self.session = None;
                self.deadline = None;
                self.grant = None;
                self.counts.lapses += 1;
                self.apart("the lease lapsed".into());
                return;
            }
            Err(error) => {
                self.counts.store_errors += 1;
                self.apart(format!("cannot renew: {error}"));
                return;
            }
        }
        let read = store
            .grant(&session)
            .and_then(|grant| store.report(&session, report).map(|()| grant));
        match read {
            Ok(grant) => {
                self.grant = grant;
                self.state = LinkState::Live;
            }
            Err(error) => {
                self.counts.store_errors += 1;
                self.apart(format!("cannot read the grant: {error}"));
            }
        }
    }

    /// The report of what the node holds: `caps_in_force_w` is the sum of its GPUs'
    /// caps read back after enforcing `allowance`; a grant is acknowledged only once the
    /// caps read back are within it.
    pub fn report(
        &mut self,
        allowance: &Allowance,
        caps_in_force_w: f64,
        draw_w: f64,
        tokens_per_s: f64,
        wants_more: bool,
        requested_w: f64,
    ) -> NodeReport {
        if let Allowance::Granted(grant) = allowance
            && caps_in_force_w <= grant.watts + ACK_TOLERANCE_W
        {
            self.acked_generation = self.acked_generation.max(grant.generation);
        }
        NodeReport {
            acked_generation: self.acked_generation,
            caps_in_force_w,
            draw_w,
            tokens_per_s,
            wants_more,
            requested_w,
            fence: self.fence,
            default_w: self.default_w,
            boot: self.boot,
        }
    }

    fn apart(&mut self, why: String) {
        if self.state != LinkState::Apart(why.clone()) {
            tracing::warn!(
                domain = %self.config.domain,
                node = %self.config.node,
                "fleet: {why}; holding the grant until the lease could lapse, then the reserve"
            );
        }
        self.state = LinkState::Apart(why);
    }

    /// Leaves the domain (a clean stop, after the node cut to its reserve).
    pub fn leave(&mut self, store: &dyn FleetStore) -> Result<(), StoreError> {
        self.deadline = None;
        self.grant = None;
        match self.session.take() {
            Some(session) => store.leave(&session),
            None => Ok(()),
        }
    }
}
