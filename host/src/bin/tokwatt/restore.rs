//! `tokwatt restore`: put back the GPU settings a crashed run left changed.

use std::path::PathBuf;

use anyhow::{Result, bail};

use tokwatt::actuator::Actuator;
use tokwatt::assembly::{self, SimTarget};
use tokwatt::nvml::NvmlSystem;
use tokwatt::restore::{StateFile, restore_all};

#[derive(Debug, clap::Args)]
pub struct RestoreArgs {
    /// State file (default: /var/lib/tokwatt/state.json as root, else $XDG_STATE_HOME/tokwatt/state.json).
    #[arg(long)]
    state_file: Option<PathBuf>,
    /// Restore through the simulated GPU with this profile (for testing).
    #[arg(long, value_name = "PROFILE")]
    sim: Option<String>,
}

/// Enough simulated GPUs for any state file a simulated run could have written.
const SIM_GPUS: u32 = 8;

pub fn restore(args: &RestoreArgs) -> Result<()> {
    let state = StateFile::new(
        args.state_file
            .clone()
            .unwrap_or_else(StateFile::default_path),
    );
    if state.load()?.is_none() {
        println!(
            "nothing to restore: {} does not exist",
            state.path().display()
        );
        return Ok(());
    }
    let mut actuator: Box<dyn Actuator> = match &args.sim {
        Some(profile) => {
            let target = SimTarget {
                gpus: SIM_GPUS,
                ..SimTarget::new(profile.clone())
            };
            assembly::simulator(&target, 1)?.1.actuator
        }
        None => Box::new(NvmlSystem::open(None)?.actuator()),
    };
    let report = restore_all(&state, actuator.as_mut())?;
    println!("{report}");
    if !report.is_complete() {
        bail!(
            "some settings were not restored; {} keeps them: fix the cause and run `tokwatt restore` again",
            state.path().display()
        );
    }
    Ok(())
}
