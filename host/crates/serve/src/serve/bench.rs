//! `tokwatt bench serve-api`: does the control loop keep its schedule while the API is
//! busy? The same simulated node is served twice, side by side in one process: once
//! idle, once under a steady stream of status requests on loopback HTTP (the API's
//! most expensive transport: TCP and the token check). What is compared is each tick's
//! lateness against its schedule.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::{ServeConfig, ServeError};
use crate::api::load::{self, LoadReport};
use crate::api::{ApiClient, ApiConfig, ApiServer};

/// One served stretch.
#[derive(Debug, Clone, Serialize)]
pub struct LatenessRun {
    /// Status requests per second asked for (0: no load).
    pub load_per_s: f64,
    pub ticks: usize,
    pub lateness_p50_ms: f64,
    pub lateness_p99_ms: f64,
    pub lateness_max_ms: f64,
    /// What the load achieved (`None` without load).
    pub load: Option<LoadReport>,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Serve(#[from] ServeError),
    #[error("the control API for the benchmark: {0}")]
    Api(#[from] crate::api::ApiError),
    #[error("the load: {0}")]
    Load(#[from] crate::api::load::LoadError),
    #[error("the benchmark's scratch folder: {0}")]
    Scratch(std::io::Error),
}

/// The config of the benchmark's node: `gpus` simulated H200s in real time under
/// `policy`, at `tick`, writing into `scratch`.
pub fn bench_config(
    scratch: &Path,
    policy: &Path,
    gpus: u32,
    tick: Duration,
) -> Result<ServeConfig, BenchError> {
    let text = format!(
        "[policy]\nspec = \"{}\"\n[node]\nbackend = \"sim\"\nsim_gpus = {gpus}\ntick = \"{}ms\"\n[output]\ndir = \"{}\"\n",
        policy.display(),
        tick.as_millis(),
        scratch.join("out").display()
    );
    let path = scratch.join("serve.toml");
    std::fs::write(&path, &text).map_err(BenchError::Scratch)?;
    Ok(ServeConfig::parse(&path, &text).map_err(ServeError::from)?)
}

/// Serve `config` for `duration` with `load_per_s` status requests a second (0: none)
/// and report the ticks' lateness.
pub fn serve_under_load(
    config: &ServeConfig,
    scratch: &Path,
    duration: Duration,
    load_per_s: f64,
) -> Result<LatenessRun, BenchError> {
    let agent = super::start(config, Arc::new(AtomicBool::new(false)), None)?;
    let token_file = scratch.join("token");
    write_token(&token_file)?;
    let server = ApiServer::start(
        ApiConfig {
            socket: Some(scratch.join("api.sock")),
            http: Some(([127, 0, 0, 1], 0).into()),
            token_file: Some(token_file.clone()),
            metrics: None,
        },
        agent.control(),
    )?;
    let started = Instant::now();
    let load = if load_per_s > 0.0 {
        let url = format!(
            "http://{}",
            server
                .http_addr()
                .map_or_else(String::new, |addr| addr.to_string())
        );
        Some(load::hammer(
            || ApiClient::http_with_token_file(&url, &token_file),
            load_per_s,
            duration,
        )?)
    } else {
        None
    };
    if let Some(rest) = duration.checked_sub(started.elapsed()) {
        std::thread::sleep(rest);
    }
    let lateness = agent.control().recent_lateness();
    agent.stop();
    let joined = agent.join();
    server.shutdown();
    joined?;
    let mut lateness_ms: Vec<f64> = lateness.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    let mut ms = |q: f64| tokwatt_core::quantile::nearest_rank(&mut lateness_ms, q).unwrap_or(0.0);
    Ok(LatenessRun {
        load_per_s,
        ticks: lateness.len(),
        lateness_p50_ms: ms(0.5),
        lateness_p99_ms: ms(0.99),
        lateness_max_ms: ms(1.0),
        load,
    })
}

fn write_token(path: &PathBuf) -> Result<(), BenchError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(BenchError::Scratch)?;
    // Not a secret: the benchmark's server lives for one run on loopback.
    file.write_all(b"tokwatt-bench-token\n")
        .map_err(BenchError::Scratch)
}
