//! Measurements behind `tokwatt bench` and the criterion benchmarks.

pub mod agent_cpu;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::plugin::{HostConfig, PluginHost, SandboxLimits};
use crate::policy::{BreakerConfig, DeviceFacts, InitArgs, PolicyFailure, Supervisor};
use crate::types::{Knobs, Objective, Observation};

/// A plausible H200 as a policy is told about it, for benchmarks and tests.
pub fn sample_facts(gpu: u32) -> DeviceFacts {
    DeviceFacts {
        index: gpu,
        uuid: format!("SIM-h200-{gpu}"),
        name: "bench".into(),
        simulated: true,
        power_cap_min_w: 200.0,
        power_cap_max_w: 700.0,
        power_cap_default_w: 700.0,
        sm_clocks_mhz: (0..110).map(|i| 1980 - 15 * i).collect(),
        batch_size_max: 512,
    }
}

/// A plugin the build made (`host/build.rs`), for tests: from `$TOKWATT_PLUGIN_DIR` when
/// it is there, so a test binary also runs from a bundle on another machine
/// (scripts/gpu-bundle.sh ships the fixtures), else from the build's folder.
pub fn built_plugin(name: &str) -> PathBuf {
    let file = format!("{name}.wasm");
    std::env::var_os("TOKWATT_PLUGIN_DIR")
        .map(|dir| Path::new(&dir).join(&file))
        .filter(|path| path.is_file())
        .unwrap_or_else(|| crate::agent::built_plugin_dir().join(file))
}

/// What `init` gets for `gpus` sample GPUs with every knob granted.
pub fn sample_init_args(gpus: u32) -> InitArgs {
    InitArgs {
        devices: (0..gpus).map(sample_facts).collect(),
        knobs: Knobs {
            power_cap: true,
            sm_clock: true,
            batch_size: true,
        },
        objective: Objective::default(),
        params: vec![],
        tick_ms: 1000,
        seed: 1,
    }
}

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
        sample_init_args(gpus),
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
