//! The experiments: policies compared on the same work, with figures that say what they
//! estimate.
//!
//! - [`eval`]: the judge, every policy on every judging scenario against the oracle, and
//!   the scenario families with their tuning and held-out splits.
//! - [`ab`]: `tokwatt ab` (is B more efficient than A, with statistics whose unit of
//!   replication is a policy trajectory) and `tokwatt tune`.
//! - [`fleet_ab`]: `tokwatt fleet ab`, the same question across a fleet of serving nodes,
//!   read from Prometheus, with pairs of load-matched nodes as the unit of replication.
//! - [`replay`]: a recorded run's observations fed to a policy again.

pub mod ab;
pub mod eval;
pub mod fleet_ab;
pub mod replay;
