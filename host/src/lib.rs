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
pub use tokwatt_agent as agent;
pub use tokwatt_agent::{assembly, control, recorder, restore, swap};
pub use tokwatt_bench as bench;
pub use tokwatt_core::{
    actuator, clock, files, model, privileges, quantile, rng, telemetry, types, workload,
};
#[cfg(feature = "cuda")]
pub use tokwatt_cuda as cuda;
pub use tokwatt_engines::prometheus;
pub use tokwatt_fleet as fleet;
pub use tokwatt_lab::{ab, eval, fleet_ab, replay};
pub use tokwatt_nvml as nvml;
pub use tokwatt_plugin as plugin;
pub use tokwatt_policy::{envelope, guard, limits, rules, spec, supervisor as policy};
/// The drawing library, and a run's own report (the agent's: it reads the recorder's files).
pub mod report {
    pub use tokwatt_agent::run_report::{
        ROLLING_TICKS, RunReportError, run_report, run_report_with_objective,
    };
    pub use tokwatt_report::*;
}
pub use tokwatt_serve::{api, fence, metrics, serve};
pub use tokwatt_sim as sim;

pub mod cli;
