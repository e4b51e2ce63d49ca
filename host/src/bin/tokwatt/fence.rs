//! `tokwatt fence`: applies a fleet node's reserve from outside the agent. Beside the
//! agent (a sidecar container, a node-level unit), it watches the heartbeat the agent's
//! loop touches after every on-time tick and holds the caps within the reserve while it
//! stalls; with `--once` it applies the reserve and exits (a boot unit, a pod's init
//! container). The logic is `tokwatt_serve::fence`; this file parses and opens the GPUs.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use tokwatt_agent::assembly;
use tokwatt_core::actuator::Actuator;
use tokwatt_nvml::NvmlSystem;
use tokwatt_serve::fence::watch::FenceSettings;

#[derive(Debug, clap::Args)]
pub struct FenceArgs {
    /// The node's reserve, watts (its serve.toml's fleet.reserve_w): the GPUs' caps are
    /// lowered, never raised, to sum to at most this.
    #[arg(long, value_name = "WATTS")]
    reserve: f64,
    /// The file the agent touches after every on-time tick (its fleet.fence.heartbeat).
    #[arg(long, value_name = "PATH", required_unless_present = "once")]
    heartbeat: Option<PathBuf>,
    /// How long the heartbeat may stay unchanged (or absent since this fence started)
    /// before the reserve is applied: 5s, 2500ms. A few ticks at least; the node declares
    /// this plus its fleet.fence.restore_s as its deadline.
    #[arg(long, value_name = "DURATION", value_parser = tokwatt::cli::parse_duration, required_unless_present = "once")]
    stall: Option<Duration>,
    /// The status file this fence rewrites every second (the agent's fleet.fence.status):
    /// the agent declares the fence only while it changes.
    #[arg(long, value_name = "PATH", required_unless_present = "once")]
    status: Option<PathBuf>,
    /// Apply the reserve once and exit: at boot, before the agent starts (a boot unit, an
    /// init container).
    #[arg(long, conflicts_with_all = ["heartbeat", "stall", "status"])]
    once: bool,
    /// NVML indices of the GPUs the agent manages, comma-separated (default: all), as its
    /// node.gpus.
    #[arg(long, value_name = "INDICES", value_delimiter = ',')]
    gpus: Option<Vec<u32>>,
    /// A simulated node: its GPUs are the boards of this simulated driver file (the
    /// agent's node.sim_driver), not NVML's.
    #[arg(long, value_name = "PATH", conflicts_with = "gpus")]
    sim_driver: Option<PathBuf>,
}

pub fn fence(args: &FenceArgs) -> Result<()> {
    // First: from here on SIGTERM and SIGINT end the fence between two checks.
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop))
            .context("installing signal handlers")?;
    }
    if !(args.reserve.is_finite() && args.reserve > 0.0) {
        bail!(
            "--reserve {} is not a positive number of watts: give the node's fleet.reserve_w",
            args.reserve
        );
    }
    if args.once {
        let mut actuator = open_gpus(args)?;
        let applied = tokwatt_serve::fence::apply_reserve(actuator.as_mut(), args.reserve)
            .with_context(|| format!("applying the reserve ({} W)", args.reserve))?;
        println!("tokwatt fence: reserve {} W: {applied}", args.reserve);
        if applied.unmet {
            bail!(
                "the reserve ({} W) is below the sum of the GPUs' lowest caps: they are held at their lowest",
                args.reserve
            );
        }
        return Ok(());
    }
    let (Some(heartbeat), Some(stall), Some(status)) =
        (args.heartbeat.clone(), args.stall, args.status.clone())
    else {
        bail!("--heartbeat, --stall and --status are needed unless --once");
    };
    // A fence that starts before its GPUs can be opened (a driver still loading, a
    // simulated node whose agent has not created its driver file yet) waits for them
    // rather than exiting: it writes no status meanwhile, so no agent declares it.
    let mut told = false;
    let mut actuator = loop {
        match open_gpus(args) {
            Ok(actuator) => break actuator,
            Err(error) => {
                if !told {
                    eprintln!("tokwatt fence: {error:#}; trying again every second");
                    told = true;
                }
                if stop.load(Ordering::Relaxed) {
                    return Ok(());
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    };
    eprintln!(
        "tokwatt fence: watching {} (stall {}), holding the {} GPU(s) within {} W when it stalls; status in {}",
        heartbeat.display(),
        humantime::format_duration(stall),
        actuator.devices().len(),
        args.reserve,
        status.display()
    );
    tokwatt_serve::fence::watch::run(
        FenceSettings {
            heartbeat,
            stall,
            reserve_w: args.reserve,
            status,
        },
        actuator.as_mut(),
        &stop,
    )?;
    eprintln!("tokwatt fence: stopped");
    Ok(())
}

/// The GPUs to fence: the simulated driver's boards, or NVML's.
fn open_gpus(args: &FenceArgs) -> Result<Box<dyn Actuator>> {
    match &args.sim_driver {
        Some(path) => assembly::simulated_node_actuator(path, None)
            .with_context(|| format!("opening the simulated driver {}", path.display())),
        None => Ok(Box::new(
            NvmlSystem::open(args.gpus.as_deref())
                .context("opening the GPUs through NVML")?
                .actuator(),
        )),
    }
}
