//! `tokwatt fleet ab`: is policy B more efficient than A across a fleet of nodes running
//! `tokwatt serve`, read from the nodes' counters in a real Prometheus?
//!
//! The design, and why:
//!
//! - **Unit of replication: a pair of load-matched nodes.** Every half is a fresh instance
//!   of its arm's policy on its own node, so pairs are independent of each other, where
//!   the epochs of one adaptive instance never are. Nodes are sorted by load (given, or
//!   tokens per control tick over a baseline window) and paired with their neighbours
//!   ([`plan`]); a seeded coin decides which node of a pair runs A first, and the arms
//!   swap halfway (a crossover).
//! - **The estimand**: the fleet's tokens per joule under B over A, settled (the time
//!   after each swap is not measured). Per pair, arm A's tokens and energy are summed over
//!   its two halves (one node's first, the other's second) and B's likewise, so the
//!   difference between the two periods and between the two nodes cancels within the
//!   pair ([`verdict::PairSums`]). The verdict is `tokwatt ab`'s statistics over those
//!   pairs, one look ([`crate::ab::SequentialPlan::single_look`]): the bootstrap and t
//!   intervals of the ratio, and the objective check.
//! - **Counters from Prometheus**, as differences between the node's own scrapes inside
//!   each window, summed over its GPUs ([`counters`]); a missing metric or a stretch
//!   without scrapes is an error, never a zero. Served demand needs the agents'
//!   `tokwatt_gpu_tokens_demanded_total` (the simulator's); where a node has none it is
//!   unknown, said so, and a winner is refused unless the operator accepts judging the
//!   objective on violations alone.
//! - **The nodes are driven through their control API** ([`experiment`]): everything is
//!   checked before the first swap, and every node changed is put back on its own
//!   policy at the end, on an error and on an interrupt.
//! - **A shared power budget is frozen** ([`domains`]): nodes in one power domain would
//!   otherwise trade watts through the coordinator, a greedier arm winning them from the
//!   other's nodes. Each domain's grants are held for the experiment's length (thawed on
//!   every way out), read throughout, and a grant that moved during a measured window
//!   other than by a cut the budget forced fails the experiment. Without the domains'
//!   store, nodes in a domain are refused before anything changes.

pub mod counters;
pub mod domains;
pub mod experiment;
pub mod nodes;
pub mod plan;
pub mod prometheus;
pub mod report;
pub mod verdict;

#[cfg(test)]
mod tests;

pub use domains::{DomainReading, DomainRecord, GrantChange, GrantSeen, NodePlace, PowerDomains};
pub use experiment::{
    BoxError, CounterSource, DomainPlan, Fleet, FleetAbError, LoadSource, NodeControl, NodePolicy,
    NodeState, Prepared, PutBack, Settings, Swapped, prepare, run,
};
pub use nodes::{ApiAddress, FleetNode, NodesFileError, Selector, load_nodes, parse_nodes};
pub use plan::{Assignment, MIN_PAIRS, PlannedPair, assign};
pub use prometheus::{Prometheus, PrometheusError};
pub use report::{ESTIMAND, FLEET_AB_FORMAT_VERSION, FleetAbReport, UNIT};
pub use verdict::{FleetVerdict, PairSums, verdict};
