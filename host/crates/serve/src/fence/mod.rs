//! The fence: what puts a fleet node's GPUs back at its reserve when the agent's control
//! loop stops running — hung (a stuck NVML call, a deadlock), paused (SIGSTOP, `systemctl
//! freeze`, a debugger), killed, crash-looping, or failing at start. A power cap set
//! through NVML outlives the process that set it, so only something outside the loop can
//! bound how long a silent node's last grant stays in force; the node declares that bound
//! (its deadline) in its reports, and the coordinator frees a silent node's grant only
//! once it has passed.
//!
//! Two kinds, one per deployment:
//!
//! - **systemd's watchdog**: the loop sends `WATCHDOG=1` over `NOTIFY_SOCKET` after every
//!   on-time tick ([`notify`]); systemd aborts an agent that stops sending for
//!   `WatchdogSec=`, and the unit's `ExecStopPost=` restores at the reserve (the state
//!   file's caps are fitted within it). Deadline: the watchdog interval plus `restore_s`.
//! - **a heartbeat** watched by a second process, `tokwatt fence` ([`watch`]): the loop
//!   touches a file after every on-time tick; the fence lowers the caps within the reserve
//!   once the file has not changed for its stall time, and holds them there while it
//!   stays stalled. The fence writes a status file every second ([`status`]); the agent
//!   declares the fence only while that file shows the fence alive. Deadline: the stall
//!   plus `restore_s`.
//!
//! Neither kind's deadline frees a silent node's watts any more: the coordinator waits for
//! a record of the caps read back ([`proof`]), which `tokwatt fence --etcd …` writes when
//! it holds the reserve, the boot unit (`tokwatt fence --once --etcd …`) after it applied
//! it at boot, and `tokwatt serve` after it applied it at start. The deadline is declared
//! still, and shown.
//!
//! [`apply_reserve`] is the one way any of them lowers caps: `tokwatt fence` when it
//! fires, `tokwatt fence --once` at boot and at a pod's start, and `tokwatt serve` at its
//! own start, before anything that can fail.

pub mod notify;
pub mod proof;
mod reserve;
pub mod status;
pub mod watch;

pub use proof::{ProofTarget, ProofWritten, unix_ms_now};
pub use reserve::{ReserveApplied, apply_reserve, read_caps};

use std::path::PathBuf;

use tokwatt_core::actuator::ActuatorError;

#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    #[error("reading GPU {gpu}'s power cap: {source}")]
    Read {
        gpu: u32,
        #[source]
        source: ActuatorError,
    },
    #[error("lowering GPU {gpu}'s power cap to {watts:.0} W: {source}")]
    Lower {
        gpu: u32,
        watts: f64,
        #[source]
        source: ActuatorError,
    },
    #[error(
        "the reserve ({reserve_w} W) is not a positive number of watts: give the node's reserve, as its serve.toml's fleet.reserve_w"
    )]
    BadReserve { reserve_w: f64 },
    #[error("the fence's status file {}: {source}", path.display())]
    Status {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writing node `{node}`'s proof of release to the fleet's store: {source}")]
    Proof {
        node: String,
        #[source]
        source: tokwatt_fleet::StoreError,
    },
    #[error(
        "the heartbeat's folder {} does not exist: create it (the agent's `fleet.fence.heartbeat` must be in it)",
        folder.display()
    )]
    NoHeartbeatFolder { folder: PathBuf },
}
