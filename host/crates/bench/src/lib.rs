//! Measurements behind `tokwatt bench` and the criterion benchmarks.

pub mod agent_cpu;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokwatt_core::types::Observation;
use tokwatt_plugin::{HostConfig, PluginHost, SandboxLimits};
use tokwatt_policy::supervisor::{BreakerConfig, InitArgs, PolicyFailure, Supervisor};

/// A started supervisor around `plugin` managing `gpus` GPUs (compiled afresh, no cache).
pub fn supervisor_for(plugin: &Path, gpus: u32) -> Result<Supervisor, String> {
    let host = PluginHost::new(&HostConfig::default()).map_err(|e| e.to_string())?;
    supervisor_with(&host, plugin, gpus)
}

/// A started supervisor around `plugin` managing `gpus` GPUs, loaded through `host` (and
/// its compiled-component cache, if it has one).
pub fn supervisor_with(host: &PluginHost, plugin: &Path, gpus: u32) -> Result<Supervisor, String> {
    let loaded = Arc::new(
        host.load(plugin, "bench", SandboxLimits::default())
            .map_err(|e| e.to_string())?,
    );
    let engine = loaded
        .instantiate(1)
        .map_err(|e: PolicyFailure| e.to_string())?;
    Supervisor::start(
        Box::new(engine),
        InitArgs::typical_h200(gpus),
        BreakerConfig::default(),
    )
    .map(|(s, _)| s)
    .map_err(|e| e.to_string())
}

/// What [`decide_latencies`] measured.
#[derive(Debug, Clone)]
pub struct DecideLatencies {
    /// Loading (compiling, or reading the compiled form from the cache), instantiating
    /// and `init`.
    pub start: Duration,
    /// One per timed call.
    pub times: Vec<Duration>,
}

/// Time `calls` decide calls for `gpus` GPUs through the supervisor and plugin host,
/// the plugin loaded through `host`.
pub fn decide_latencies(
    host: &PluginHost,
    plugin: &Path,
    gpus: u32,
    calls: usize,
) -> Result<DecideLatencies, String> {
    let started = Instant::now();
    let mut supervisor = supervisor_with(host, plugin, gpus)?;
    let start = started.elapsed();
    let observations: Vec<Observation> =
        (0..gpus).map(|g| Observation::typical_h200(g, 0)).collect();
    // Warm up caches and the instance.
    for tick in 0..1000 {
        supervisor.decide(tick, Duration::ZERO, &observations);
    }
    let mut times = Vec::with_capacity(calls);
    for tick in 0..calls as u64 {
        let start = Instant::now();
        let decision = supervisor.decide(tick, Duration::ZERO, &observations);
        times.push(start.elapsed());
        std::hint::black_box(decision);
    }
    if supervisor.counters().fallback_ticks > 0 {
        return Err(format!(
            "the benchmark policy failed: {:?}",
            supervisor.counters()
        ));
    }
    Ok(DecideLatencies { start, times })
}

/// The `q`-quantile (0..=1) of `times`, by nearest rank.
pub fn quantile(times: &mut [Duration], q: f64) -> Duration {
    if times.is_empty() {
        return Duration::ZERO;
    }
    times.sort_unstable();
    let rank = ((q * times.len() as f64).ceil() as usize).clamp(1, times.len());
    times[rank - 1]
}
