//! `tokwatt restore`: put back the GPU settings a crashed run left changed.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

use tokwatt_agent::assembly::{self, SimTarget};
use tokwatt_agent::restore::{StateFile, restore_all};
use tokwatt_core::actuator::Actuator;
use tokwatt_nvml::NvmlSystem;

#[derive(Debug, clap::Args)]
pub struct RestoreArgs {
    /// State file (default: /var/lib/tokwatt/state.json as root, else $XDG_STATE_HOME/tokwatt/state.json).
    #[arg(long)]
    state_file: Option<PathBuf>,
    /// Restore through a simulated GPU with this profile (for testing). Alone, the
    /// simulator is the command's own and ends with it: the state file is read, checked
    /// and cleared, and nothing that outlives the command changes. With --sim-driver, the
    /// profile of the driver file's boards (needed only for a profile file).
    #[arg(long, value_name = "PROFILE")]
    sim: Option<String>,
    /// Restore a simulated node's settings: through the simulated driver file its agent
    /// ran on (node.sim_driver, `tokwatt run --sim-driver`), whose boards keep them.
    #[arg(long, value_name = "PATH")]
    sim_driver: Option<PathBuf>,
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
    let mut actuator: Box<dyn Actuator> = match (&args.sim_driver, &args.sim) {
        (Some(path), profile) => assembly::simulated_node_actuator(path, profile.clone())
            .with_context(|| format!("opening the simulated driver {}", path.display()))?,
        (None, Some(profile)) => {
            eprintln!(
                "tokwatt: restoring into a simulator of this command's own (--sim): nothing that outlives it changes; give --sim-driver PATH to restore a simulated node's settings"
            );
            let target = SimTarget {
                gpus: SIM_GPUS,
                ..SimTarget::new(profile.clone())
            };
            assembly::simulator(&target, 1)?.1.actuator
        }
        (None, None) => Box::new(NvmlSystem::open(None)?.actuator()),
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
