//! A power budget across nodes. A domain (a rack, a row) has a budget in watts; a
//! coordinator, elected through the coordination store, keeps a [`ledger`] of the watts
//! each node may have in force and writes grants; each node's agent enforces its grant
//! as a sum over its GPUs and holds its reserve on its own whenever it cannot hear the
//! coordinator. The invariant: the sum of the caps in force never passes the budget,
//! whatever fails.
//!
//! The coordination store is an engine operators already run, used through its own
//! guarantees: etcd's leases and transactions ([`etcd`]), behind [`store::FleetStore`].

pub mod allocator;
pub mod budget;
pub mod coordinator;
pub mod etcd;
pub mod ledger;
pub mod node;
pub mod offnode;
pub mod show;
pub mod store;

pub use allocator::{Allocation, Allocator, MarginalAllocator};
pub use budget::{BudgetError, DomainBudget, NodeBudget};
pub use coordinator::{Coordinator, CoordinatorConfig, Round};
pub use ledger::{Ledger, PlannedGrant};
pub use node::{Allowance, AllowanceSnapshot, LinkCounts, LinkState, NodeConfig, NodeLink};
pub use store::{
    DEFAULT_PROOF_TTL, DomainView, Fence, FenceKind, FleetStore, Freeze, FreezeOutcome,
    FreezeSession, FrozenWrite, Grant, GrantWrite, Hold, HoldWrite, Leadership, NodeRecord,
    NodeReport, NodeSession, NodeView, ProofSource, ReleaseProof, StoreError, StoredFreeze,
    StoredHold, StoredProof, Written, boot_of,
};
