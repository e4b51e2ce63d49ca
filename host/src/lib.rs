//! tokwatt: a node agent that runs token-generating GPU work, reads telemetry, and asks a
//! sandboxed WebAssembly policy every control tick which power cap, SM clock and batch
//! size to use.
//!
//! The data flow reads top to bottom, one module per boundary:
//!
//! ```text
//! telemetry -> observation -> plugin (wasm) -> envelope -> actuator / workload
//! (nvml|sim)                                   (clamp,      (nvml|dry-run|sim,
//!                                               rate)        batch size)
//! ```
//!
//! See ARCHITECTURE.md for the code map and the invariants.

// The layers below, re-exported under the names the modules here have always used.
pub use tokwatt_core::{
    actuator, clock, files, model, privileges, quantile, rng, telemetry, types, workload,
};
pub use tokwatt_cuda as cuda;
pub use tokwatt_engines::prometheus;
pub use tokwatt_nvml as nvml;
pub use tokwatt_plugin as plugin;
pub use tokwatt_policy::{envelope, guard, limits, rules, spec, supervisor as policy};
pub use tokwatt_report as report;
pub use tokwatt_sim as sim;

pub mod ab;
pub mod agent;
pub mod api;
pub mod assembly;
pub mod bench;
pub mod cli;
pub mod control;
pub mod eval;
pub mod metrics;
pub mod recorder;
pub mod replay;
pub mod restore;
pub mod serve;
pub mod swap;
