//! What the agent costs to leave running: this process's CPU time over a run of the real
//! agent loop (`agent::run`, the path `tokwatt run` takes), on the simulator in real time
//! or on real GPUs through NVML telemetry with the dry-run actuator and an idle token
//! source. Behind `tokwatt bench agent-cpu`.
//!
//! Only the steady state is measured: from the end of the first tick to the end of the
//! last, so compiling the plugin before the run and writing the report after it are left
//! out. Nothing here changes a GPU setting: the actuator is always the dry run.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use tokwatt_agent::assembly::{self, BackendRequest, SimTarget, Target};
use tokwatt_agent::control::Backends;
use tokwatt_agent::node::{Node, NodeRequest};
use tokwatt_agent::{self as agent, RunMeta, RunRequest};
use tokwatt_core::types::WorkloadWindow;
use tokwatt_core::workload::{Workload, WorkloadError};
use tokwatt_nvml::{NvmlCallCounts, NvmlSystem, SamplerConfig};
use tokwatt_policy::spec::PolicySpec;

/// Why a measurement could not be made.
#[derive(Debug, thiserror::Error)]
pub enum AgentCpuError {
    #[error("reading this process's CPU time from /proc/self/stat: {0}")]
    CpuTime(String),
    #[error(transparent)]
    Spec(#[from] tokwatt_policy::spec::SpecError),
    #[error(transparent)]
    Assembly(#[from] tokwatt_agent::assembly::AssemblyError),
    #[error(transparent)]
    Node(#[from] tokwatt_agent::node::NodeError),
    #[error(transparent)]
    Nvml(#[from] tokwatt_nvml::NvmlError),
    #[error("reading the GPU settings in force: {0}")]
    ReadSettings(#[from] tokwatt_core::actuator::ActuatorError),
    #[error(transparent)]
    Agent(#[from] tokwatt_agent::AgentError),
    #[error("creating a folder for the run's files: {0}")]
    OutDir(#[source] std::io::Error),
    #[error(
        "the run ended after {ticks} tick(s): at least 2 are needed to measure between the first and the last (run longer than two ticks)"
    )]
    TooFewTicks { ticks: u64 },
}

/// This process's CPU time so far (all threads).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CpuTimes {
    pub user: Duration,
    pub system: Duration,
}

/// Linux reports /proc times in clock ticks of 1/100 s (USER_HZ, fixed by the kernel's
/// ABI on x86-64 and arm64): the resolution of these figures is 10 ms.
pub const CPU_TIME_RESOLUTION: Duration = Duration::from_millis(10);

impl CpuTimes {
    /// Read from `/proc/self/stat`.
    pub fn now() -> Result<Self, AgentCpuError> {
        let stat = std::fs::read_to_string("/proc/self/stat")
            .map_err(|e| AgentCpuError::CpuTime(e.to_string()))?;
        Self::parse_stat(&stat)
    }

    /// utime and stime are fields 14 and 15 of `/proc/PID/stat`, counted after the
    /// command name, which is in parentheses and may itself hold spaces and parentheses.
    fn parse_stat(stat: &str) -> Result<Self, AgentCpuError> {
        let after_name = stat
            .rfind(')')
            .map(|end| &stat[end + 1..])
            .ok_or_else(|| AgentCpuError::CpuTime("no command name in parentheses".into()))?;
        // After the name: field 3 (state) is the first, so utime (14) is the 12th.
        let mut fields = after_name.split_whitespace().skip(11);
        let mut ticks = |name: &str| {
            fields
                .next()
                .and_then(|text| text.parse::<u64>().ok())
                .ok_or_else(|| AgentCpuError::CpuTime(format!("no {name} field")))
        };
        let user = ticks("utime")?;
        let system = ticks("stime")?;
        let tick = CPU_TIME_RESOLUTION;
        Ok(Self {
            user: tick * u32::try_from(user).unwrap_or(u32::MAX),
            system: tick * u32::try_from(system).unwrap_or(u32::MAX),
        })
    }

    fn since(self, earlier: CpuTimes) -> CpuTimes {
        CpuTimes {
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
        }
    }
}

/// Where the measured agent's GPUs come from.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentCpuTarget {
    /// The simulator against the wall clock: the simulator's work stands in for NVML's.
    Sim { profile: String, gpus: u32 },
    /// Real GPUs (NVML indices), sampled at `sampler`'s rates.
    Nvml {
        indices: Vec<u32>,
        sampler: SamplerConfig,
    },
    /// One real GPU opened `copies` times, as that many logical GPUs: what sampling
    /// `copies` GPUs costs, on a machine with fewer.
    NvmlRepeated {
        index: u32,
        copies: u32,
        sampler: SamplerConfig,
    },
}

impl AgentCpuTarget {
    /// How many GPUs the agent manages.
    pub fn gpus(&self) -> u32 {
        match self {
            Self::Sim { gpus, .. } => *gpus,
            Self::Nvml { indices, .. } => indices.len() as u32,
            Self::NvmlRepeated { copies, .. } => *copies,
        }
    }
}

/// One measured run.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentCpuRun {
    pub gpus: u32,
    /// Ticks between the first measured point and the last.
    pub ticks: u64,
    pub wall: Duration,
    pub cpu: CpuTimes,
    /// NVML calls the telemetry made over the measured span, all GPUs (NVML targets only).
    pub nvml_calls: Option<u64>,
}

impl AgentCpuRun {
    /// CPU time (user + system) as a percentage of one core over the measured span.
    pub fn cpu_pct_of_one_core(&self) -> f64 {
        let wall = self.wall.as_secs_f64();
        if wall > 0.0 {
            100.0 * (self.cpu.user + self.cpu.system).as_secs_f64() / wall
        } else {
            f64::NAN
        }
    }

    /// NVML calls per second per GPU over the measured span.
    pub fn nvml_calls_per_s_per_gpu(&self) -> Option<f64> {
        let wall = self.wall.as_secs_f64();
        self.nvml_calls
            .filter(|_| wall > 0.0 && self.gpus > 0)
            .map(|calls| calls as f64 / wall / f64::from(self.gpus))
    }
}

/// What a measurement runs besides its target.
#[derive(Debug, Clone)]
pub struct AgentCpuRequest {
    pub spec: PolicySpec,
    pub duration: Duration,
    pub tick: Duration,
    pub plugin_dirs: Vec<PathBuf>,
    pub cache_dir: Option<PathBuf>,
}

/// Run the agent on `target` for `request.duration` and measure this process's CPU time
/// over the steady state. The run's files are written, as `tokwatt run` writes them, into
/// a temporary folder that is removed afterwards.
pub fn measure(
    target: &AgentCpuTarget,
    request: &AgentCpuRequest,
) -> Result<AgentCpuRun, AgentCpuError> {
    let mut spec = request.spec.clone();
    spec.override_tick(request.tick)?;
    let (backends, meta, knobs, calls) = backends(target, &spec)?;
    spec.knobs = knobs;
    let out = tempfile::Builder::new()
        .prefix("tokwatt-bench-agent-cpu-")
        .tempdir()
        .map_err(AgentCpuError::OutDir)?;
    let run = RunRequest {
        spec,
        duration: request.duration,
        tick: None,
        out_dir: out.path().join("run"),
        plugin_dirs: request.plugin_dirs.clone(),
        cache_dir: request.cache_dir.clone(),
        seed: 1,
        overwrite: false,
        write_files: true,
        rules: tokwatt_policy::rules::NodeRules::default(),
        rules_source: "the default node rules".into(),
        node_knobs: tokwatt_core::types::Knobs::all(),
        output: tokwatt_agent::recorder::OutputBounds::default(),
    };
    let mut first: Option<Point> = None;
    let mut last: Option<Point> = None;
    let mut cpu_error = None;
    let stop = Arc::new(AtomicBool::new(false));
    agent::run(&run, backends, meta, stop, &mut |progress| {
        // Only the first and the last tick are read: reading costs CPU too.
        let edge = progress.tick == 0 || progress.tick + 1 >= progress.ticks;
        if !edge {
            return;
        }
        match Point::now(progress.tick, calls.as_ref()) {
            Ok(point) if first.is_none() => first = Some(point),
            Ok(point) => last = Some(point),
            Err(error) => cpu_error = Some(error),
        }
    })?;
    if let Some(error) = cpu_error {
        return Err(error);
    }
    match (first, last) {
        (Some(first), Some(last)) if last.tick > first.tick => Ok(AgentCpuRun {
            gpus: target.gpus(),
            ticks: last.tick - first.tick,
            wall: last.at.duration_since(first.at),
            cpu: last.cpu.since(first.cpu),
            nvml_calls: last
                .nvml_calls
                .zip(first.nvml_calls)
                .map(|(end, start)| end.saturating_sub(start)),
        }),
        (first, last) => Err(AgentCpuError::TooFewTicks {
            ticks: last.or(first).map_or(0, |point| point.tick + 1),
        }),
    }
}

/// A measuring point: after tick `tick`.
#[derive(Debug, Clone, Copy)]
struct Point {
    tick: u64,
    at: Instant,
    cpu: CpuTimes,
    nvml_calls: Option<u64>,
}

impl Point {
    fn now(tick: u64, calls: Option<&NvmlCallCounts>) -> Result<Self, AgentCpuError> {
        Ok(Self {
            tick,
            at: Instant::now(),
            cpu: CpuTimes::now()?,
            nvml_calls: calls.map(NvmlCallCounts::total),
        })
    }
}

type Assembled = (
    Backends,
    RunMeta,
    tokwatt_core::types::Knobs,
    Option<NvmlCallCounts>,
);

fn backends(target: &AgentCpuTarget, spec: &PolicySpec) -> Result<Assembled, AgentCpuError> {
    let (system, sampler) = match target {
        AgentCpuTarget::Sim { profile, gpus } => {
            let request = BackendRequest {
                target: Target::Sim(SimTarget {
                    profile: profile.clone(),
                    scenario: None,
                    gpus: *gpus,
                    realtime: true,
                    driver: None,
                }),
                seed: 1,
                batch_only: false,
            };
            // Put together as every command's node is; nothing to keep on a simulator.
            let node = Node::open(NodeRequest::new(request, spec))?;
            let assembled = node.assembled;
            return Ok((assembled.backends, assembled.meta, assembled.knobs, None));
        }
        AgentCpuTarget::Nvml { indices, sampler } => (NvmlSystem::open(Some(indices))?, sampler),
        AgentCpuTarget::NvmlRepeated {
            index,
            copies,
            sampler,
        } => (NvmlSystem::open_repeated(*index, *copies)?, sampler),
    };
    // Observe only, assembled where every backend is (the dry run starts from the
    // settings in force and changes nothing).
    let workload = IdleTokens::new(system.devices().len(), BATCH_SIZE_MAX);
    let (backends, meta, calls) = assembly::assemble_observed_nvml(
        &system,
        *sampler,
        Box::new(workload),
        format!(
            "measured through NVML ({}); no tokens (bench agent-cpu's idle source)",
            describe(target)
        ),
    )?;
    Ok((backends, meta, spec.knobs, Some(calls)))
}

/// The target in words, for outputs.
pub fn describe(target: &AgentCpuTarget) -> String {
    match target {
        AgentCpuTarget::Sim { profile, gpus } => {
            format!("SIMULATOR ({profile}, {gpus} GPU(s), real time)")
        }
        AgentCpuTarget::Nvml { indices, .. } => {
            let list: Vec<String> = indices.iter().map(u32::to_string).collect();
            format!("NVML GPU(s) {}", list.join(","))
        }
        AgentCpuTarget::NvmlRepeated { index, copies, .. } => {
            format!("NVML GPU {index} opened {copies} time(s) as {copies} logical GPU(s)")
        }
    }
}

/// The largest batch the idle source accepts (what a policy that turns the batch knob
/// may ask for; nothing is decoded).
const BATCH_SIZE_MAX: u32 = 512;

/// A token source that reports no tokens: the agent's own cost without a workload (as
/// with an external serving engine, whose scraping is not measured here).
#[derive(Debug)]
pub struct IdleTokens {
    batch: Vec<u32>,
    batch_size_max: u32,
}

impl IdleTokens {
    pub fn new(gpus: usize, batch_size_max: u32) -> Self {
        Self {
            batch: vec![1; gpus],
            batch_size_max,
        }
    }

    fn slot(&mut self, gpu: u32) -> Result<&mut u32, WorkloadError> {
        let count = self.batch.len() as u32;
        self.batch
            .get_mut(gpu as usize)
            .ok_or(WorkloadError::NoSuchGpu { index: gpu, count })
    }
}

impl Workload for IdleTokens {
    fn name(&self) -> &'static str {
        "idle (no tokens)"
    }

    fn batch_size_max(&self, _gpu: u32) -> u32 {
        self.batch_size_max
    }

    fn batch_size(&self, gpu: u32) -> u32 {
        self.batch.get(gpu as usize).copied().unwrap_or(1)
    }

    fn set_batch_size(&mut self, gpu: u32, batch: u32) -> Result<(), WorkloadError> {
        let max = self.batch_size_max;
        if !(1..=max).contains(&batch) {
            return Err(WorkloadError::BatchOutOfRange {
                requested: batch,
                max,
            });
        }
        *self.slot(gpu)? = batch;
        Ok(())
    }

    fn read_window(&mut self, gpu: u32) -> Result<WorkloadWindow, WorkloadError> {
        let batch_size = *self.slot(gpu)?;
        Ok(WorkloadWindow {
            batch_size,
            ..WorkloadWindow::default()
        })
    }
}

/// The median of `values` (the mean of the two middle ones for an even count); NaN for
/// none.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted.sort_by(f64::total_cmp);
    let middle = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[middle]
    } else {
        (sorted[middle - 1] + sorted[middle]) / 2.0
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    #[test]
    fn cpu_times_are_read_after_the_command_name() {
        // A command name with spaces and a parenthesis, as a process may set it.
        let stat = "4242 (tok watt) x) S 1 4242 4242 0 -1 4194304 1500 0 0 0 \
                    250 37 0 0 20 0 9 0 12345 1000000 2000 18446744073709551615";
        let times = CpuTimes::parse_stat(stat).unwrap();
        assert_eq!(times.user, Duration::from_millis(2500));
        assert_eq!(times.system, Duration::from_millis(370));
        assert!(CpuTimes::parse_stat("4242 tokwatt S 1").is_err());
        assert!(CpuTimes::parse_stat("4242 (tokwatt) S 1 2").is_err());
    }

    #[test]
    fn this_process_has_spent_cpu_time() {
        let before = CpuTimes::now().unwrap();
        // Burn a little CPU so the counter must move (progress, not time, is checked).
        let mut x = 0u64;
        let mut after = before;
        while after == before {
            for i in 0..1_000_000u64 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(i);
            }
            std::hint::black_box(x);
            after = CpuTimes::now().unwrap();
        }
        assert!(after.user + after.system > before.user + before.system);
    }

    #[test]
    fn cpu_share_and_call_rate_come_from_the_measured_span() {
        let run = AgentCpuRun {
            gpus: 4,
            ticks: 20,
            wall: Duration::from_secs(20),
            cpu: CpuTimes {
                user: Duration::from_millis(100),
                system: Duration::from_millis(300),
            },
            nvml_calls: Some(480),
        };
        assert!((run.cpu_pct_of_one_core() - 2.0).abs() < 1e-9);
        assert!((run.nvml_calls_per_s_per_gpu().unwrap() - 6.0).abs() < 1e-9);
        let sim = AgentCpuRun {
            nvml_calls: None,
            ..run
        };
        assert_eq!(sim.nvml_calls_per_s_per_gpu(), None);
    }

    #[test]
    fn the_idle_source_reports_no_tokens_and_keeps_its_batch() {
        let mut idle = IdleTokens::new(2, 64);
        idle.set_batch_size(1, 32).unwrap();
        let window = idle.read_window(1).unwrap();
        assert_eq!((window.tokens, window.batch_size), (0, 32));
        assert!(matches!(
            idle.set_batch_size(0, 65),
            Err(WorkloadError::BatchOutOfRange { .. })
        ));
        assert!(matches!(
            idle.read_window(2),
            Err(WorkloadError::NoSuchGpu { index: 2, count: 2 })
        ));
    }

    #[test]
    fn medians_of_odd_even_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}
