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

pub mod ab;
pub mod actuator;
pub mod agent;
pub mod api;
pub mod assembly;
pub mod bench;
pub mod cli;
pub mod clock;
pub mod control;
pub mod cuda;
pub mod envelope;
pub mod eval;
pub mod files;
pub mod gpu_tests;
pub mod guard;
pub mod metrics;
pub mod model;
pub mod nvml;
pub mod plugin;
pub mod policy;
pub mod quantile;
pub mod recorder;
pub mod replay;
pub mod report;
pub mod restore;
pub mod rng;
pub mod rules;
pub mod serve;
pub mod sim;
pub mod spec;
pub mod swap;
pub mod telemetry;
pub mod types;
pub mod workload;
