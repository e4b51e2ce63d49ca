//! The daemon: `tokwatt serve` keeps the control loop running on a node and lets an
//! operator steer it without stopping it.
//!
//! - [`serve`]: the loop on its own thread, its configuration (`serve.toml`), policy swaps
//!   from the API or a watched folder, and a summary kept current.
//! - [`api`]: the control API over a Unix socket and loopback HTTP (bounded bodies, tokens,
//!   slow clients cut off), and its client for the CLI.
//! - [`metrics`]: the Prometheus exposition of what the loop counts.
//! - [`fence`]: what puts a fleet node back at its reserve when the loop stops running
//!   (systemd's watchdog, fed by the loop; `tokwatt fence`, watching its heartbeat).

pub mod api;
pub mod fence;
pub mod metrics;
pub mod serve;
