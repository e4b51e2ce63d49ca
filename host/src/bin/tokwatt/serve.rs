//! `tokwatt serve`: the node agent, until stopped (SIGINT or SIGTERM end it at a tick
//! boundary, and every GPU setting it changed is put back).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};

use tokwatt_serve::api::{self, ApiConfig, ApiServer};
use tokwatt_serve::serve::{self, ServeConfig};

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The agent's configuration (TOML): policy, GPUs, workload, API, metrics, outputs.
    #[arg(long)]
    config: PathBuf,
    /// Stop after this long (for trials and benchmarks; default: until SIGINT/SIGTERM).
    #[arg(long, value_parser = tokwatt::cli::parse_duration)]
    duration: Option<Duration>,
    /// No status lines.
    #[arg(long, short)]
    quiet: bool,
}

pub fn serve(args: &ServeArgs) -> Result<()> {
    // First, so that from the moment any setting could change, SIGINT and SIGTERM end
    // the loop at a tick boundary (and the settings are restored) instead of killing it.
    // A second signal, while the first is being honoured (a GPU call that hangs), ends the
    // process at once with status 1: the state file then lets the next start or `tokwatt
    // restore` put the settings back.
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(signal, 1, Arc::clone(&stop))
            .context("installing signal handlers")?;
        signal_hook::flag::register(signal, Arc::clone(&stop))
            .context("installing signal handlers")?;
    }
    let config = ServeConfig::load(&args.config)?;
    let socket = match &config.socket {
        Some(path) => path.clone(),
        None => api::default_socket_path().context("the control API's socket (api.socket)")?,
    };
    let agent = serve::start(&config, Arc::clone(&stop), args.duration)?;
    let info = &agent.info;
    // The API starts after the agent: a request never reaches a half-started agent. If
    // it cannot start, the agent stops and restores what it changed.
    let server = ApiServer::start(
        ApiConfig {
            socket: Some(socket),
            http: config.http,
            token_file: config.token_file.clone(),
            metrics: config.metrics_listen,
        },
        agent.control(),
    );
    let server = match server {
        Ok(server) => server,
        Err(error) => {
            agent.stop();
            if let Err(loop_error) = agent.join() {
                tracing::error!(
                    "the control loop, stopped because the API could not start: {loop_error}"
                );
            }
            return Err(error).context("starting the control API");
        }
    };
    // The API answers: under systemd (Type=notify) the start is over.
    agent.notify_ready();
    if !args.quiet {
        eprintln!(
            "tokwatt serve: policy `{}` (version {}) on {} GPU(s) of {} [{}], tick {}",
            info.policy,
            info.policy_version,
            info.meta.gpu_count,
            info.meta.gpu_name,
            info.meta.data_source,
            humantime::format_duration(info.tick),
        );
        for line in info.objective_in_force.lines() {
            eprintln!("tokwatt serve: {line}");
        }
        for withheld in &info.withheld {
            eprintln!("tokwatt serve: {withheld}");
        }
        if let Some(path) = server.socket_path() {
            eprintln!("tokwatt serve: control socket {}", path.display());
        }
        if let Some(addr) = server.http_addr() {
            eprintln!("tokwatt serve: control API http://{addr} (bearer token)");
        }
        if let Some(addr) = server.metrics_addr() {
            eprintln!("tokwatt serve: metrics http://{addr}/metrics");
        }
        eprintln!("tokwatt serve: writing {}", info.out_dir.display());
        if let Some(state) = &info.state_file {
            eprintln!(
                "tokwatt serve: original settings saved in {} (`tokwatt restore` puts them back after a crash)",
                state.display()
            );
        }
    }
    while !agent.is_finished() && !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
    }
    agent.notify_stopping();
    agent.stop();
    let out_dir = agent.info.out_dir.clone();
    let result = agent.join();
    server.shutdown();
    let summary = result?;
    if !args.quiet {
        let t = &summary.totals;
        eprintln!(
            "tokwatt serve: stopped after {} ticks: {} tokens, {:.0} J, {:.4} tok/J{}; {} swaps, {} rollbacks, {} by the operator; settings restored; wrote {}",
            t.ticks,
            t.tokens,
            t.energy_j,
            t.tokens_per_joule,
            if summary.meta.simulated {
                " (SIMULATED)"
            } else {
                ""
            },
            t.swaps.swaps,
            t.swaps.rollbacks,
            t.swaps.operator_rollbacks,
            out_dir.display()
        );
    }
    Ok(())
}
