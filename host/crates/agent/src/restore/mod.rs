//! Save and restore: every GPU setting tokwatt changes is put back when it stops, and after
//! a crash by the next start or `tokwatt restore`.
//!
//! Before the first change, the original settings of every managed GPU are written to a
//! state file (atomically: a temporary file in the same folder, fsync, rename, fsync of
//! the folder), keyed by GPU UUID so a renumbering cannot misapply them. A clean stop
//! restores them and deletes the file; a file left behind means a run did not stop
//! cleanly, and its settings are restored before anything else is changed.
//!
//! One job per file:
//!
//! - `state_file` — the state file: its format (with a version), the atomic write, the
//!   load, and the errors for a corrupt, foreign or newer file;
//! - `owner` — whether the process that wrote a state file still runs;
//! - `report` — what a restore did, GPU by GPU, and how that reads;
//! - `apply` — the restore itself: [`restore_all`] and the steps it shares with the guard;
//! - `guard` — [`OriginalSettings`] (saves before the first change) and [`SettingsGuard`]
//!   (an actuator that also restores when dropped, on a panic too).

mod apply;
mod guard;
mod owner;
mod report;
mod state_file;
#[cfg(test)]
mod test_support;

use std::io;
use std::path::PathBuf;

use tokwatt_core::actuator::ActuatorError;

pub use apply::restore_all;
pub use guard::{OriginalSettings, SettingsGuard};
pub use report::{GpuRestore, Outcome, RestoreReport, RestoreStep, Setting};
pub use state_file::{Changed, SavedGpu, StateFile};

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("cannot read the state file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "cannot write the state file {path}: {source}. tokwatt changes no GPU setting before the originals are saved; make the folder writable or choose another state file"
    )]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "the state file {path} is corrupt ({reason}). It holds the original GPU settings to put back after a crash. Check each GPU's power limit and clock locks (`nvidia-smi -q -d POWER,CLOCK`), reset them if needed (`nvidia-smi -pl <default W>`, `nvidia-smi -rgc`, `nvidia-smi -rmc`), then delete the file"
    )]
    Corrupt { path: PathBuf, reason: String },
    #[error(
        "{path} is not a tokwatt state file ({reason}), so tokwatt will neither read nor overwrite it. Give tokwatt a state file of its own with --state-file (serve: state.file), or move that file away if it is not needed"
    )]
    Foreign { path: PathBuf, reason: String },
    #[error(
        "the state file {path} has format version {found}, and this tokwatt reads only version {}: it was written by another tokwatt release. Restore with that release (`tokwatt restore --state-file {path}`), or check each GPU's power limit and clock locks by hand (`nvidia-smi -q -d POWER,CLOCK`) and then delete the file",
        state_file::FORMAT_VERSION
    )]
    UnsupportedFormat { path: PathBuf, found: u32 },
    #[error(
        "tokwatt (pid {pid}) is still running and owns {path}: it restores its settings when it stops. Stop it first"
    )]
    OwnerRunning { path: PathBuf, pid: u32 },
    #[error("reading the original settings of GPU {gpu} failed, so nothing was changed: {source}")]
    ReadOriginal {
        gpu: u32,
        #[source]
        source: ActuatorError,
    },
    #[error(
        "an earlier run left GPU settings that could not all be restored, so nothing will be changed:\n{report}Fix the cause and run `tokwatt restore`"
    )]
    LeftoverNotRestored { report: RestoreReport },
}
