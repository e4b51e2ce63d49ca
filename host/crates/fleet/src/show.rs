//! `tokwatt fleet show`: a domain's ledger for people (the words of each charge) and for
//! scripts (`--json`, [`LedgerDocument`]). Both are made here from one [`Ledger`], so the
//! table and the JSON say the same.
//!
//! **API boundary**: the JSON's keys are what operators' scripts read. A key renamed or
//! removed, or a new meaning of one, is a new [`SHOW_FORMAT_VERSION`]; keys are only added
//! within a version. Pinned by `the_documents_keys_are_stable` below; listed in the book
//! (`docs/book/src/operating/fleet.md`, "Watching it").

use serde::Serialize;

use crate::ledger::{Entry, Ledger, Why};
use crate::store::{Fence, FrozenWrite, NodeReport, ProofSource, ReleaseProof, StoredProof};

/// The version of [`LedgerDocument`]'s keys. 2: a silent node's watts are freed on a
/// proof of release only (`why` `silent-unproven` and `proven`, no more `silent-fenced`,
/// `fence-elapsed` or `silent-unfenced`; `frees_in_s` and `then_w` gone; `proof`,
/// `proofs`, `boot_proven` and the release's `released_by` added).
pub const SHOW_FORMAT_VERSION: u32 = 2;

/// Why a node is charged what it is, and until when, in words.
pub fn why_words(entry: &Entry) -> String {
    match entry.why {
        Why::Live => "live".to_owned(),
        Why::SilentUnproven => {
            "silent, no proof of release: until its fence, boot unit, agent or an off-node fence writes one, it reports again, or `tokwatt fleet release`".to_owned()
        }
        Why::Proven(source) if entry.charged_w > entry.budget.reserve_w + 1e-9 => format!(
            "silent, proven by its {} record; a reboot may leave its board defaults (no boot unit proved)",
            source.label()
        ),
        Why::Proven(source) => format!("silent, proven by its {} record", source.label()),
        Why::Released => match release_record(entry) {
            Some(record) => format!("silent, released by {}: {}", record.by, record.detail),
            None => "silent, released".to_owned(),
        },
        Why::NeverHeard => "never heard".to_owned(),
    }
}

/// The operator's record of a node's release (who and why), where the store has one.
fn release_record(entry: &Entry) -> Option<&ReleaseProof> {
    entry
        .proofs
        .iter()
        .filter(|p| p.proof.source == ProofSource::Operator)
        .max_by_key(|p| p.mod_revision)
        .map(|p| &p.proof)
}

/// Whether the node has enforced its grant (`None`: no grant, or no report to tell).
pub fn acknowledged(entry: &Entry) -> Option<bool> {
    match (entry.grant, entry.record) {
        (Some(grant), Some(record)) => Some(record.report.acked_generation >= grant.generation),
        _ => None,
    }
}

/// `tokwatt fleet show --json`: the domain's ledger at one revision, as the coordinator
/// reads it. Watts are W, times are s.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LedgerDocument {
    /// [`SHOW_FORMAT_VERSION`].
    pub format_version: u32,
    pub domain: String,
    /// etcd's revision the ledger was read at.
    pub revision: i64,
    /// The domain's budget.
    pub budget_w: f64,
    /// Draw outside tokwatt, subtracted from the budget.
    pub uncontrolled_w: f64,
    /// What the nodes may share: `budget_w` less `uncontrolled_w`.
    pub available_w: f64,
    /// Every node's charge, summed.
    pub charged_w: f64,
    /// `available_w` less `charged_w`: what a raise may be written into.
    pub headroom_w: f64,
    /// Charged above their reserves to silent nodes, summed.
    pub stranded_w: f64,
    /// An experiment holding the domain's grants where they are (`None`: not frozen).
    pub frozen: Option<FrozenDocument>,
    /// The budget's nodes, in its order.
    pub nodes: Vec<NodeDocument>,
    /// Nodes with a live record that the budget does not name, and what they report.
    pub unbudgeted: Vec<UnbudgetedDocument>,
}

/// Who froze the domain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FrozenDocument {
    pub by: String,
    pub why: String,
    /// The freeze's lease, in hex: it lapses with it.
    pub lease: String,
}

/// One node's line of the ledger.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeDocument {
    pub node: String,
    /// A live lease: it reports, and can be granted watts.
    pub live: bool,
    /// The lease its record lives under, in hex (`None`: silent).
    pub lease: Option<String>,
    /// The coordinator's grant to the node (`None`: none written under its lease).
    pub grant: Option<GrantDocument>,
    /// What the node last reported (`None`: silent).
    pub report: Option<ReportDocument>,
    /// The most this node may have in force now: what the ledger counts.
    pub charged_w: f64,
    /// Why it is charged that: `live`, `silent-unproven`, `proven`, `released` or
    /// `never-heard` (the coordinator's metrics label).
    pub why: &'static str,
    /// The same in words, with its figures (as the table prints it).
    pub why_words: String,
    /// `proven`: the record the charge rests on (`None` otherwise).
    pub proof: Option<ProofDocument>,
    /// Every proof of release the store holds for the node, each source's newest.
    pub proofs: Vec<ProofDocument>,
    /// A boot unit's record proves a reboot of its current boot lands at its reserve.
    pub boot_proven: bool,
    /// `released`: who released it (`None` otherwise, or no record of who).
    pub released_by: Option<String>,
    /// How long the leader has seen it silent, s (`None`: live, or not known to this
    /// reader: only the leader counts).
    pub silent_for_s: Option<f64>,
    /// Charged above its reserve while silent: watts no other node can be given.
    pub stranded_w: f64,
    /// What it may draw once silent however long.
    pub floor_w: f64,
    /// The budget's lines for the node.
    pub reserve_w: f64,
    pub max_w: f64,
    pub priority: u8,
    pub fenced: bool,
    /// The budget calls it fenced, but it declares no fence, or no boot unit proved
    /// itself: it is charged as unfenced.
    pub fence_missing: bool,
}

/// A proof of release: who read the node's caps back, what they summed to, and when.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProofDocument {
    /// `fence`, `boot`, `agent`, `off-node` or `operator`.
    pub source: &'static str,
    pub by: String,
    pub sum_w: f64,
    pub caps_w: Vec<f64>,
    /// The writer's clock, ms since the Unix epoch (shown, never compared).
    pub at_unix_ms: u64,
    /// etcd's revision that wrote it (compared with the node's hold).
    pub revision: i64,
    /// Its lease, in hex (the writer's own).
    pub lease: String,
    pub detail: String,
}

impl From<&StoredProof> for ProofDocument {
    fn from(stored: &StoredProof) -> Self {
        Self {
            source: stored.proof.source.label(),
            by: stored.proof.by.clone(),
            sum_w: stored.proof.sum_w,
            caps_w: stored.proof.caps_w.clone(),
            at_unix_ms: stored.proof.at_unix_ms,
            revision: stored.mod_revision,
            lease: format!("{:x}", stored.lease),
            detail: stored.proof.detail.clone(),
        }
    }
}

/// A node's grant.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GrantDocument {
    pub watts: f64,
    pub generation: u64,
    /// The most the node may have in force while the grant is unacknowledged.
    pub ceiling_w: f64,
    /// The node reported it enforced (`None`: no report to tell).
    pub acknowledged: Option<bool>,
    /// Written while the domain was frozen: `reserve` (a joining node's first grant) or
    /// `budget-cut` (a cut the budget forced); `None` otherwise.
    pub under_freeze: Option<FrozenWrite>,
}

/// What a live node last reported.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ReportDocument {
    /// Its GPUs' caps in force, read back, summed.
    pub caps_in_force_w: f64,
    pub draw_w: f64,
    pub tokens_per_s: f64,
    /// Its work asked for more than it served.
    pub wants_more: bool,
    /// What its policy asked the caps to sum to, before the allowance (0: not reported).
    pub requested_w: f64,
    pub acked_generation: u64,
    /// Its GPUs' board-default caps, summed (0: not reported).
    pub default_w: f64,
    /// The fence it declares (`None`: none): `kind`, `deadline_s`, `covers_reboot`.
    pub fence: Option<Fence>,
    /// The boot it runs in (a hash of the kernel's boot id; 0: not reported).
    pub boot: u64,
}

impl From<&NodeReport> for ReportDocument {
    fn from(report: &NodeReport) -> Self {
        Self {
            caps_in_force_w: report.caps_in_force_w,
            draw_w: report.draw_w,
            tokens_per_s: report.tokens_per_s,
            wants_more: report.wants_more,
            requested_w: report.requested_w,
            acked_generation: report.acked_generation,
            default_w: report.default_w,
            fence: report.fence,
            boot: report.boot,
        }
    }
}

/// A node the budget does not name.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UnbudgetedDocument {
    pub node: String,
    /// What it holds outside the plan, W.
    pub watts: f64,
}

impl NodeDocument {
    fn of(entry: &Entry) -> Self {
        Self {
            node: entry.node().to_owned(),
            live: entry.live(),
            lease: entry.record.map(|r| format!("{:x}", r.lease)),
            grant: entry.grant.map(|g| GrantDocument {
                watts: g.watts,
                generation: g.generation,
                ceiling_w: g.ceiling_w,
                acknowledged: acknowledged(entry),
                under_freeze: g.under_freeze,
            }),
            report: entry.record.map(|r| ReportDocument::from(&r.report)),
            charged_w: entry.charged_w,
            why: entry.why.label(),
            why_words: why_words(entry),
            proof: entry.proof.as_ref().map(ProofDocument::from),
            proofs: entry.proofs.iter().map(ProofDocument::from).collect(),
            boot_proven: entry.boot_proven,
            released_by: (entry.why == Why::Released)
                .then(|| release_record(entry).map(|r| r.by.clone()))
                .flatten(),
            silent_for_s: entry.silent_for.map(|d| d.as_secs_f64()),
            stranded_w: entry.stranded_w,
            floor_w: entry.floor_w,
            reserve_w: entry.budget.reserve_w,
            max_w: entry.budget.max_w,
            priority: entry.budget.priority,
            fenced: entry.budget.fenced,
            fence_missing: entry.fence_missing,
        }
    }
}

impl LedgerDocument {
    pub fn of(ledger: &Ledger) -> Self {
        Self {
            format_version: SHOW_FORMAT_VERSION,
            domain: ledger.budget.domain.clone(),
            revision: ledger.revision,
            budget_w: ledger.budget.budget_w,
            uncontrolled_w: ledger.budget.uncontrolled_w,
            available_w: ledger.budget.available_w(),
            charged_w: ledger.charged_w(),
            headroom_w: ledger.headroom_w(),
            stranded_w: ledger.stranded_w(),
            frozen: ledger.freeze.as_ref().map(|frozen| FrozenDocument {
                by: frozen.freeze.by.clone(),
                why: frozen.freeze.why.clone(),
                lease: format!("{:x}", frozen.lease),
            }),
            nodes: ledger.entries.iter().map(NodeDocument::of).collect(),
            unbudgeted: ledger
                .unbudgeted
                .iter()
                .map(|(node, watts)| UnbudgetedDocument {
                    node: node.clone(),
                    watts: *watts,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests;
