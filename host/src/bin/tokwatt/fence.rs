//! `tokwatt fence`: applies a fleet node's reserve from outside the agent. Beside the
//! agent (a sidecar container, a node-level unit), it watches the heartbeat the agent's
//! loop touches after every on-time tick and holds the caps within the reserve while it
//! stalls; with `--once` it applies the reserve and exits (a boot unit, a pod's init
//! container). With `--etcd`, `--domain` and `--node` it also writes what it read back to
//! the fleet's store, with its own credentials and under its own lease: a boot record
//! (`--once`) or, while it holds the reserve, a fence record; the coordinator frees a
//! silent node's watts only on such a record. The logic is `tokwatt_serve::fence`; this
//! file parses and opens the GPUs.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use tokwatt_agent::assembly;
use tokwatt_core::actuator::Actuator;
use tokwatt_fleet::{ProofSource, boot_of};
use tokwatt_nvml::NvmlSystem;
use tokwatt_serve::fence::ProofTarget;
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
    /// Write each reading to the fleet's store as proof of release (`--etcd URL`, repeat
    /// per member, with this fence's own --etcd-ca/--etcd-cert/--etcd-key, not the
    /// agent's): without it the coordinator keeps the node's watts charged while it is
    /// silent, and a boot unit does not prove itself.
    #[command(flatten)]
    proof: ProofArgs,
}

#[derive(Debug, clap::Args)]
pub struct ProofArgs {
    /// An etcd client URL of the fleet's store (http://HOST:PORT, or https:// with
    /// --etcd-ca); repeat for each member.
    #[arg(long = "etcd", value_name = "URL", requires_all = ["domain", "node"])]
    endpoints: Vec<String>,
    /// The node's power domain, as its budget names it.
    #[arg(long, requires = "endpoints")]
    domain: Option<String>,
    /// The node's name, as the budget names it (the agent's fleet.node).
    #[arg(long, requires = "endpoints")]
    node: Option<String>,
    /// Each request's deadline.
    #[arg(long, default_value = "2s", value_parser = tokwatt::cli::parse_duration)]
    etcd_timeout: Duration,
    /// The CA that signed etcd's server certificate (PEM).
    #[arg(long, value_name = "FILE")]
    etcd_ca: Option<PathBuf>,
    /// This fence's own client certificate (PEM), for an etcd with --client-cert-auth: a
    /// role that may write only this node's proofs.
    #[arg(long, value_name = "FILE", requires_all = ["etcd_ca", "etcd_key"])]
    etcd_cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    #[arg(long, value_name = "FILE", requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
    /// How long each record lives unless written again: a record outlives this process,
    /// and lapses by itself once stale.
    #[arg(long, default_value = "7d", value_parser = tokwatt::cli::parse_duration)]
    proof_ttl: Duration,
}

/// Where this fence writes its records, if it was given a store.
fn proof_target(args: &FenceArgs) -> Result<Option<ProofTarget>> {
    let proof = &args.proof;
    let (Some(domain), Some(node)) = (&proof.domain, &proof.node) else {
        return Ok(None);
    };
    let store = crate::fleet::connect_etcd(
        &proof.endpoints,
        proof.etcd_timeout,
        proof.etcd_ca.as_ref(),
        proof.etcd_cert.as_ref(),
        proof.etcd_key.as_ref(),
    )?;
    let identity = assembly::boot_identity(args.sim_driver.as_deref())
        .context("reading which boot this node runs in")?;
    let host = Some(tokwatt_fleet::budget::host_name())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown host".to_owned());
    let what = if args.once {
        "tokwatt fence --once"
    } else {
        "tokwatt fence"
    };
    Ok(Some(ProofTarget {
        store: Box::new(store),
        domain: domain.clone(),
        node: node.clone(),
        by: format!("{what} on {host} (pid {})", std::process::id()),
        boot: boot_of(&identity),
        ttl: proof.proof_ttl,
    }))
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
        let proof = proof_target(args)?;
        let applied = tokwatt_serve::fence::apply_reserve(actuator.as_mut(), args.reserve)
            .with_context(|| format!("applying the reserve ({} W)", args.reserve))?;
        println!("tokwatt fence: reserve {} W: {applied}", args.reserve);
        if applied.unmet {
            bail!(
                "the reserve ({} W) is below the sum of the GPUs' lowest caps: they are held at their lowest",
                args.reserve
            );
        }
        if let Some(target) = &proof {
            // The boot unit's record: the reserve in force at this boot, read back. It
            // proves the unit runs (a reboot lands at the reserve) for this boot only.
            let written = target
                .write(ProofSource::Boot, actuator.as_mut(), "the reserve applied at boot")
                .context("the reserve is in force, but its record was not written: the coordinator keeps charging the node its board defaults until one is")?;
            println!(
                "tokwatt fence: the caps read back ({:.0} W) written as node `{}`'s boot record (revision {})",
                written.sum_w, target.node, written.revision
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
    // Once the GPUs are open (a simulated node's driver file exists, so its boot can be
    // read): where its records go.
    let proof = proof_target(args)?;
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
        proof.as_ref(),
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
