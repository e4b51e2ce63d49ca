//! The coordination store: what the coordinator and the nodes keep in the engine the
//! operator runs, and the few operations the fleet needs of it. etcd is the one backend
//! ([`crate::etcd::EtcdFleet`]); the trait is this small so that a Kubernetes backend
//! (a Lease per node and per coordinator, the domain as a custom resource updated with
//! `resourceVersion` preconditions) can follow once it can be tested against a real API
//! server.
//!
//! Every guarantee comes from the engine: leadership is a key bound to the leader's
//! lease and created only where absent; every grant is written in a transaction fenced
//! on that key, so a deposed leader's writes fail; a node's record and its grant are
//! bound to the node's lease, so both vanish together, atomically, when it lapses.
//! A node's [`Hold`] is bound to no lease: it outlives the node's silence, so the watts
//! the node may still hold stay charged whoever leads; the leader writes it in the
//! same fenced transaction as the grants, an operator's release only where it is still
//! the one the operator read. A domain's [`Freeze`] (an experiment holding every grant
//! where it is) is bound to the experiment's own lease: kept alive while it runs, it
//! lapses by itself when the experiment dies, and the leader reads it in the same
//! transaction as the rest of the domain.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::budget::DomainBudget;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Tls(#[from] crate::etcd::TlsError),
    #[error("no etcd member answered: {0}")]
    Unavailable(String),
    #[error("etcd refused the request (code {code}): {message}")]
    Etcd { code: i32, message: String },
    #[error("{0}")]
    Protocol(String),
    #[error("{what} in the store is damaged: {why}")]
    Damaged { what: String, why: String },
}

/// What the coordinator grants one node: the most its GPUs' power caps may sum to.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Grant {
    /// Rises with every grant written to the node; a node acknowledges by generation.
    pub generation: u64,
    pub watts: f64,
    /// The most the node may have in force while this grant is unacknowledged: the
    /// highest of the grants since its last acknowledgement (a node may have read and
    /// applied any of them). Freed only by an acknowledgement.
    pub ceiling_w: f64,
    /// Why the leader wrote this grant while the domain was frozen (`None`: written
    /// without a freeze), so that an experiment reading it can tell a cut the budget
    /// forced from a move it must not see.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub under_freeze: Option<FrozenWrite>,
}

/// The only grants a leader writes while the domain is frozen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FrozenWrite {
    /// The node's reserve: its first grant, for a node that joined during the freeze.
    Reserve,
    /// A cut the budget forced: the grants held no longer fit (the budget was lowered, a
    /// silent node's charge rose, a node joined). Safety comes before the experiment.
    BudgetCut,
}

/// A domain frozen: every live node's grant held where it is (no raise, no move between
/// nodes), while every cut the budget needs is still made. Written by an experiment
/// whose arms share the domain's budget (`tokwatt fleet ab`), so that neither arm wins
/// watts from the other through the coordinator; bound to the experiment's lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Freeze {
    /// Who froze it (a command, a host, a process), for `fleet show` and the metrics.
    pub by: String,
    /// Why, in words.
    pub why: String,
}

/// A freeze as the store keeps it: the lease it lives under (its holder's), and the
/// revision that created it (each freeze is a new key: this names it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredFreeze {
    pub freeze: Freeze,
    pub lease: i64,
    pub create_revision: i64,
}

/// A freeze this process holds: its lease, which it keeps alive while the experiment runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FreezeSession {
    pub domain: String,
    pub lease: i64,
    pub ttl: Duration,
}

/// What asking for a freeze gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FreezeOutcome {
    /// The domain is frozen under this session's lease.
    Frozen(FreezeSession),
    /// Another holds a freeze of the domain (nothing written).
    HeldBy(Freeze),
}

/// What a node reports, under its lease.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct NodeReport {
    /// The generation of the last grant the node enforced and read back.
    pub acked_generation: u64,
    /// The sum of its GPUs' power caps in force, read back from NVML.
    pub caps_in_force_w: f64,
    /// What its GPUs drew over the last report period (average power).
    pub draw_w: f64,
    /// Tokens per second over the last report period.
    pub tokens_per_s: f64,
    /// Whether the node's work asked for more than it served (it would use more watts).
    pub wants_more: bool,
    /// What the node's policy asked its GPUs' caps to be, summed, before the allowance
    /// cut them (0: not reported, as by a node from before this field): a node that
    /// wants more is granted up to this, not its maximum, so a grant does not
    /// overshoot what the node will use and come back the next round.
    #[serde(default)]
    pub requested_w: f64,
    /// What puts this node back at its reserve when its agent stops running (hung,
    /// paused, killed, failing at start), outside the agent's loop: `None` where the node
    /// has none, or has not proved it is there. A silent node without one is charged
    /// what its GPUs may hold without tokwatt until it reports again or is released.
    #[serde(default)]
    pub fence: Option<Fence>,
    /// The sum of the node's GPUs' board-default power caps: what a reboot or a driver
    /// reload leaves in force (0: not reported, as by a node from before this field; the
    /// budget's `default_w` is used).
    #[serde(default)]
    pub default_w: f64,
    /// Which boot of the node this report is from ([`boot_of`] of the kernel's boot id, or
    /// of a simulated driver's boots; 0: not reported): a boot unit's [`ReleaseProof`] of
    /// the same boot proves the unit runs, so a reboot lands at the reserve.
    #[serde(default)]
    pub boot: u64,
}

/// A boot's number as the fleet compares it: FNV-1a of the boot's identity (the kernel's
/// `/proc/sys/kernel/random/boot_id`, or a simulated driver's file and boot count), never
/// 0 (0 means unknown).
pub fn boot_of(identity: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in identity.trim().bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash.max(1)
}

/// Who read a node's caps back from its driver and wrote them down as proof.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProofSource {
    /// `tokwatt fence`, after it applied the reserve to a stalled agent's GPUs.
    Fence,
    /// The boot unit (`tokwatt fence --once --etcd …`), after it applied the reserve at
    /// boot: also proof that a reboot lands at the reserve (`covers_reboot`).
    Boot,
    /// A restarted agent, after it applied the reserve at start, before it joins.
    Agent,
    /// The coordinator's off-node fence (a BMC through a ClusterLabs fence agent), after
    /// the action succeeded and the node's power state was read back.
    OffNode,
    /// An operator's `tokwatt fleet release`: not a reading, a person's word (who and
    /// why are kept).
    Operator,
}

impl ProofSource {
    pub fn label(self) -> &'static str {
        match self {
            Self::Fence => "fence",
            Self::Boot => "boot",
            Self::Agent => "agent",
            Self::OffNode => "off-node",
            Self::Operator => "operator",
        }
    }
}

/// "Node N: GPUs at these caps since t, sum W": written to the store by whatever lowered a
/// node's caps, after reading them back from the driver, with its own credentials and
/// under a lease of its own (not the agent's, which lapses with the node's silence). The
/// coordinator frees a silent node's watts above `sum_w` only on such a record written
/// after the node's last grant (compared on the store's revisions, never on clocks).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReleaseProof {
    pub source: ProofSource,
    /// Who wrote it: a host and process, a fence agent and BMC, an operator.
    pub by: String,
    /// Each GPU's cap as read back, watts (empty for a node powered off, or an operator).
    #[serde(default)]
    pub caps_w: Vec<f64>,
    /// The caps summed: what the node holds from this record on, at most.
    pub sum_w: f64,
    /// When it was read, by the writer's clock (milliseconds since the Unix epoch; shown,
    /// never compared).
    pub at_unix_ms: u64,
    /// The boot it was read in ([`boot_of`]; 0: unknown).
    #[serde(default)]
    pub boot: u64,
    /// The writer's words: the fence agent's output, the operator's reason.
    #[serde(default)]
    pub detail: String,
}

impl ReleaseProof {
    /// `source`'s record of the caps `caps_w` it read back (their sum with them), by `by`,
    /// at `at_unix_ms` by its clock, in `boot`; no words beside.
    pub fn of_caps(
        source: ProofSource,
        by: impl Into<String>,
        caps_w: Vec<f64>,
        at_unix_ms: u64,
        boot: u64,
    ) -> Self {
        Self {
            source,
            by: by.into(),
            sum_w: caps_w.iter().sum(),
            caps_w,
            at_unix_ms,
            boot,
            detail: String::new(),
        }
    }

    /// A sum the ledger can count on: finite and not negative.
    pub fn usable_sum(&self) -> Option<f64> {
        (self.sum_w.is_finite() && self.sum_w >= 0.0).then_some(self.sum_w)
    }
}

/// A proof as the store keeps it: the revision that wrote it and the writer's lease.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredProof {
    pub node: String,
    pub proof: ReleaseProof,
    pub mod_revision: i64,
    pub lease: i64,
}

/// How long a proof lives unless its writer renews it: a week, so that a node powered off
/// over a weekend stays proven; a lapsed proof charges the node again until the next.
pub const DEFAULT_PROOF_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

/// What fences a node: the mechanism outside the agent's loop that puts its GPUs back
/// at the reserve when the agent stops renewing its lease, and how soon.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Fence {
    pub kind: FenceKind,
    /// At most this long after the node's lease lapses, its GPUs' caps sum to at most its
    /// reserve, whether the agent hung, was paused, killed, or failed at start.
    pub deadline_s: f64,
    /// Whether a reboot or a driver reload puts the node at its reserve before any
    /// work runs (a boot-time unit), rather than leaving the board defaults in force.
    pub covers_reboot: bool,
}

/// The mechanisms a node can declare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FenceKind {
    /// systemd's watchdog (`WatchdogSec=`), fed from the control loop only while ticks
    /// are on time; the unit's `ExecStopPost=` restores at the reserve.
    SystemdWatchdog,
    /// A second process (a sidecar container, a node-level unit) that watches the
    /// agent's heartbeat file and applies the reserve when it stalls (`tokwatt fence`).
    Heartbeat,
}

/// What the coordinator last knew of a node while it was live, kept after it goes
/// silent: the most the node may hold if it goes silent now (its charge after the
/// leader's last round), the fence it declared and its GPUs' board defaults. A silent
/// node is charged from this until it reports again or an operator releases it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Hold {
    pub watts: f64,
    /// The fence the node declared (`None`: none).
    #[serde(default)]
    pub fence: Option<Fence>,
    /// The sum of its GPUs' board-default caps, as it declared them (0: unknown, the
    /// budget's `default_w` is used).
    #[serde(default)]
    pub default_w: f64,
    /// An operator released the node (`tokwatt fleet release`), stating its GPUs are at
    /// or under its reserve: it is charged its reserve until it reports again.
    #[serde(default)]
    pub released: bool,
    /// The boot the node last reported (0: unknown): a boot unit's proof of this boot
    /// proves a reboot lands at the reserve.
    #[serde(default)]
    pub boot: u64,
}

/// A hold as the store keeps it: the revision of its last write, which a release
/// compares so it cannot overwrite a hold it did not read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StoredHold {
    pub hold: Hold,
    pub mod_revision: i64,
}

/// A node's record as the coordinator reads it: the report and the lease it lives under.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NodeRecord {
    pub lease: i64,
    pub report: NodeReport,
}

/// One node's entry in a consistent read of the domain.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeView {
    pub node: String,
    /// `None`: no live lease (never joined, left, or lapsed): the node holds its reserve.
    pub record: Option<NodeRecord>,
    /// The grant bound to the node's current lease, if any.
    pub grant: Option<Grant>,
    /// The node's hold, if a leader has written one (kept while the node is silent).
    pub hold: Option<StoredHold>,
}

/// The domain at one revision: its budget, each node's record and grant.
#[derive(Debug, Clone, PartialEq)]
pub struct DomainView {
    pub revision: i64,
    pub budget: DomainBudget,
    /// Every node the budget names, in its order, and any other node that registered.
    pub nodes: Vec<NodeView>,
    /// The domain's freeze, where an experiment holds one.
    pub freeze: Option<StoredFreeze>,
    /// Every proof of release in the store, each node's in the order read.
    pub proofs: Vec<StoredProof>,
}

/// A coordinator's leadership of one domain: its lease, and the revision that created
/// the leader key (the fencing token every grant write compares).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leadership {
    pub domain: String,
    pub candidate: String,
    pub lease: i64,
    pub fence: i64,
    pub ttl: Duration,
}

/// A node's membership: its lease, renewed by the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSession {
    pub domain: String,
    pub node: String,
    pub lease: i64,
    pub ttl: Duration,
}

/// A grant to write: to `node`, bound to the lease its record lives under.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GrantWrite<'a> {
    pub node: &'a str,
    pub lease: i64,
    pub grant: Grant,
}

/// What a round's write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// The grants and holds are written.
    Done,
    /// Nothing written: another leads the domain now.
    Deposed,
    /// Nothing written: the domain was frozen or thawed since the round read it (a round
    /// planned without a freeze must not land after one, nor one planned under a freeze
    /// after it ended); the next round reads it again.
    FreezeChanged,
}

/// A hold to write: the node's, in the same transaction as the round's grants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HoldWrite<'a> {
    pub node: &'a str,
    pub hold: Hold,
}

/// What the fleet keeps in the coordination store.
pub trait FleetStore: Send + Sync + std::fmt::Debug {
    /// Sets a domain's budget (the operator's act). Checked before it is written.
    fn put_budget(&self, budget: &DomainBudget) -> Result<(), StoreError>;

    /// The domain's budget, each node's record and its grant, all at one revision.
    fn read_domain(&self, domain: &str) -> Result<Option<DomainView>, StoreError>;

    /// Become the domain's coordinator if none is: `None` where another holds it.
    fn campaign(
        &self,
        domain: &str,
        candidate: &str,
        ttl: Duration,
    ) -> Result<Option<Leadership>, StoreError>;

    /// Renews the leadership's lease: `false` once it has lapsed (another may lead).
    fn renew_leadership(&self, leadership: &Leadership) -> Result<bool, StoreError>;

    /// Gives the leadership up at once (a clean stop).
    fn resign(&self, leadership: &Leadership) -> Result<(), StoreError>;

    /// Writes a round's grants and holds, only while `leadership` still holds the leader
    /// key and the domain's freeze is still `freeze`, the one the round read (`None`:
    /// none); nothing more is written otherwise, and [`Written`] says which. A node's
    /// hold is written in the same transaction as its grant, so that no node can act on
    /// a grant its hold does not cover; a store may split a round of many nodes into
    /// several transactions (etcd takes 128 operations in one), each node's pair whole.
    fn write_grants(
        &self,
        leadership: &Leadership,
        freeze: Option<&StoredFreeze>,
        grants: &[GrantWrite<'_>],
        holds: &[HoldWrite<'_>],
    ) -> Result<Written, StoreError>;

    /// Writes `hold` for `node` (the operator's release), only where the node has no
    /// live record and its hold is still the one at `hold_revision` (0: none): `false`
    /// (nothing written) where it came back or a leader rewrote its hold since. `record`
    /// (an [`ProofSource::Operator`] proof: who released it and why) is written in the
    /// same transaction.
    fn release(
        &self,
        domain: &str,
        node: &str,
        hold: &Hold,
        hold_revision: i64,
        record: &ReleaseProof,
    ) -> Result<bool, StoreError>;

    /// Writes `proof` as `node`'s latest of its source, under a lease of its own of `ttl`
    /// (the writer's, granted here: it outlives the agent's silence, and lapses by itself
    /// once stale). Returns the revision it was written at.
    fn prove(
        &self,
        domain: &str,
        node: &str,
        proof: &ReleaseProof,
        ttl: Duration,
    ) -> Result<i64, StoreError>;

    /// Joins the domain: a lease of `ttl` and the node's first report under it, in the
    /// same step as the end of any operator's release of the node (its hold is kept,
    /// not released).
    fn join(
        &self,
        domain: &str,
        node: &str,
        ttl: Duration,
        report: &NodeReport,
    ) -> Result<NodeSession, StoreError>;

    /// Renews the node's lease: the TTL left, or `None` once it has lapsed (the node's
    /// record and grant are gone; it must hold its reserve and join again).
    fn renew(&self, session: &NodeSession) -> Result<Option<Duration>, StoreError>;

    /// Rewrites the node's report under its lease.
    fn report(&self, session: &NodeSession, report: &NodeReport) -> Result<(), StoreError>;

    /// The grant bound to this session's lease, if the coordinator has written one.
    fn grant(&self, session: &NodeSession) -> Result<Option<Grant>, StoreError>;

    /// Leaves the domain at once: the lease revoked, record and grant gone.
    fn leave(&self, session: &NodeSession) -> Result<(), StoreError>;

    /// Freezes the domain's grants (see [`Freeze`]) under a lease of `ttl`, where no other
    /// freeze holds it: the caller renews it while its experiment runs, and it lapses by
    /// itself once the caller stops renewing (a crashed experiment leaves no freeze).
    fn freeze(
        &self,
        domain: &str,
        freeze: &Freeze,
        ttl: Duration,
    ) -> Result<FreezeOutcome, StoreError>;

    /// Renews the freeze's lease: `false` once it has lapsed (the domain is not frozen
    /// by this session any more; it may be by another).
    fn renew_freeze(&self, session: &FreezeSession) -> Result<bool, StoreError>;

    /// Ends the freeze at once: its lease revoked, the key gone; grants move again from
    /// the leader's next round.
    fn thaw(&self, session: &FreezeSession) -> Result<(), StoreError>;
}
