//! `fleet-ab.json`: what was asked, what each node and pair did, and the verdict.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::counters::{Measured, Window};
use super::domains::{DomainRecord, GrantChange, GrantSeen, NodePlace};
use super::experiment::{LoadSource, NodePolicy, PutBack};
use super::verdict::{FleetVerdict, PairSums};
use crate::ab::Arm;

/// Version of `fleet-ab.json`'s layout. Keys added without a change of meaning (the power
/// domains frozen, each node's grants) keep it: a reader that knows version 1 ignores
/// them, and one that wants them finds them absent in an older file. 2: an arm ahead on
/// tokens per joule but refused (on the objective, or on unknown demand) has a decision
/// of its own (`a-refused`, `b-refused`) where 1 wrote `no-difference`.
pub const FLEET_AB_FORMAT_VERSION: u32 = 2;

/// One node's half.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HalfRecord {
    pub arm: Arm,
    /// The policy its status named after the swap.
    pub policy: NodePolicy,
    pub state_carried: Option<bool>,
    pub measured: Measured,
}

/// One node in the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeReport {
    pub name: String,
    pub load: f64,
    /// Its power domain, where it is in one (its grant was frozen for the experiment).
    #[serde(default)]
    pub fleet: Option<NodePlace>,
    /// Its grant when the domain was frozen, and at the end, before the thaw (`None`: no
    /// grant, or in no domain).
    #[serde(default)]
    pub grant_start: Option<GrantSeen>,
    #[serde(default)]
    pub grant_end: Option<GrantSeen>,
    /// The policy it ran before, and runs again after.
    pub original: NodePolicy,
    pub simulated: bool,
    /// `a-first`, `b-first` or `left-out`.
    pub part: String,
    /// Its pair, counted from 0.
    pub pair: Option<usize>,
    pub baseline: Measured,
    pub halves: Vec<HalfRecord>,
}

/// One pair of nodes in the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairReport {
    pub a_first: String,
    pub b_first: String,
    #[serde(flatten)]
    pub sums: PairSums,
}

/// `fleet-ab.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FleetAbReport {
    pub format_version: u32,
    pub a: PathBuf,
    pub b: PathBuf,
    /// What the ratio estimates, in words.
    pub estimand: String,
    pub unit_of_replication: String,
    pub min_pairs: usize,
    pub verdict: FleetVerdict,
    pub pairs: Vec<PairReport>,
    pub nodes: Vec<NodeReport>,
    pub left_out: Option<String>,
    /// Nodes without a demand counter: their served demand is unknown.
    pub demand_unknown_on: Vec<String>,
    pub accept_unknown_demand: bool,
    /// Nodes whose figures are the simulator's, never a GPU's.
    pub simulated_nodes: Vec<String>,
    pub load_source: LoadSource,
    /// The two halves' measured windows, on Prometheus's clock.
    pub windows: Vec<Window>,
    pub baseline_window: Window,
    pub half_s: f64,
    pub settle_s: f64,
    pub seed: u64,
    pub alpha: f64,
    pub source: String,
    pub put_back: PutBack,
    /// The power domains frozen for the experiment (empty: no node is in one).
    #[serde(default)]
    pub domains: Vec<DomainRecord>,
    /// Every change of a node's grant seen while frozen, and whether it may have happened
    /// in a measured window. Only a cut the budget forced is allowed there.
    #[serde(default)]
    pub grant_changes: Vec<GrantChange>,
}

/// What the experiment estimates, in words (`fleet-ab.json`'s `estimand`).
pub const ESTIMAND: &str = "the fleet's tokens per joule under B over A: per pair of load-matched \
nodes, each arm's tokens over its energy summed over its two halves (one on each node, one \
in each half, so the period and the node cancel within the pair), settled (the settling time \
after each swap is not measured); the ratio is exp(mean of the pairs' ln(B/A))";
/// What the statistics resample (`fleet-ab.json`'s `unit_of_replication`).
pub const UNIT: &str = "a pair of load-matched nodes: each half is a fresh instance of its arm's \
policy on its own node, so pairs are independent of each other (the halves of one adaptive \
instance never would be)";
