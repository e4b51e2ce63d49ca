//! Assembling a run's backends from a plain request: the simulated GPU, or real GPUs
//! through NVML (with the NVML or dry-run actuator) and a workload (the CUDA decode or an
//! external serving engine's metrics). Every command and test builds its backends here,
//! so `run`, `check`, `restore` and the commands still to come (`serve`, `eval`, `ab`)
//! assemble runs the same way, and knobs are granted in one place ([`grant_knobs`]).
//!
//! One file because it is the one place the paragraph above promises: the simulated and the
//! real-GPU paths share the operator's offer, the knob grant and the `Assembled` they
//! return, and are kept alike by being read side by side.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::control::Backends;
use tokwatt_core::actuator::{Actuator, DryRun};
use tokwatt_core::clock::{Clock, VirtualClock, WallClock};
use tokwatt_core::types::Knobs;
use tokwatt_core::workload::Workload;
#[cfg(feature = "cuda")]
use tokwatt_cuda::{CudaDecode, CudaDecodeConfig, ModelShape};
use tokwatt_engines::prometheus::{PrometheusConfig, PrometheusTokens};
use tokwatt_nvml::{NvmlSystem, SamplerConfig};
use tokwatt_sim::{GpuProfile, Scenario, SimConfig, SimGpu};

/// Where a run's GPUs come from.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// The simulated GPU.
    Sim(SimTarget),
    /// Real GPUs through NVML.
    Gpu(GpuTarget),
}

/// A simulated node.
#[derive(Debug, Clone, PartialEq)]
pub struct SimTarget {
    /// A built-in profile name (`h200`, `h100`, `a100`) or a profile file.
    pub profile: String,
    /// A scenario file; the built-in scenario when `None`.
    pub scenario: Option<PathBuf>,
    pub gpus: u32,
    /// Simulate against the wall clock instead of the virtual clock.
    pub realtime: bool,
    /// The simulated driver's file, where the node's settings live outside this process
    /// (they survive its end, as a real driver's do; see [`tokwatt_sim::SimDriver`]);
    /// `None`: in the process alone.
    pub driver: Option<PathBuf>,
}

impl SimTarget {
    /// One GPU of a built-in or file profile, the built-in scenario, the virtual clock.
    pub fn new(profile: impl Into<String>) -> Self {
        Self {
            profile: profile.into(),
            scenario: None,
            gpus: 1,
            realtime: false,
            driver: None,
        }
    }
}

/// Real GPUs.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuTarget {
    /// NVML indices.
    pub indices: Vec<u32>,
    /// Observe only: power-cap and clock decisions are logged, never applied.
    pub dry_run: bool,
    pub workload: WorkloadSource,
    /// The control tick: NVML is sampled at the rates a window of this length needs
    /// ([`SamplerConfig::for_tick`]).
    pub tick: Duration,
}

/// Where a real GPU's tokens come from.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkloadSource {
    /// tokwatt's own CUDA decode workload.
    Cuda {
        /// A model preset name or a model shape file.
        model: String,
        context: u32,
        batch_size_max: u32,
    },
    /// tokwatt's own CUDA engine serving a simulator scenario's requests: its arrivals,
    /// prompt and output lengths, model, token budget and queue, in real time.
    CudaServe {
        scenario: PathBuf,
        /// KV positions per slot; `None`: the scenario's longest request.
        context: Option<u32>,
        /// KV slots (the batch size knob's range); `None`: the scenario's `batch_size_max`.
        slots: Option<u32>,
        /// Seeds the arrivals (GPU `n` of the run: `seed + n`).
        seed: u64,
    },
    /// A running serving engine's Prometheus metrics.
    External {
        url: String,
        token_counter: String,
        /// `None`: the engine's latency is not read; every window's TPOT is unknown
        /// (`tokwatt run` refuses a spec with a TPOT bound then).
        tpot_histogram: Option<String>,
        /// `None`: first tokens are not timed (a TTFT bound is refused then).
        request_metrics: Option<tokwatt_engines::prometheus::RequestMetrics>,
    },
    /// One source per GPU, in the order of [`GpuTarget::indices`] (each GPU's own
    /// serving engine); each is `Cuda` or `External`.
    PerGpu(Vec<WorkloadSource>),
}

/// Everything needed to assemble backends.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendRequest {
    pub target: Target,
    /// Seeds the simulator (and, through the run, the policy's random source).
    pub seed: u64,
    /// The operator allows only the batch size (running without privileges), and the
    /// workload's other knob, the token budget: neither needs privileges.
    pub batch_only: bool,
}

/// What describes a run besides its totals (part of `summary.json`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RunMeta {
    /// True when the GPU was the simulator: then every figure is simulator output.
    pub simulated: bool,
    /// The simulator's GPU profile as given (`h200`, or a profile file), or the real
    /// GPU's name.
    pub gpu_profile: String,
    /// The GPU's name (the profile's for the simulator).
    pub gpu_name: String,
    /// Where the figures come from, in words.
    pub data_source: String,
    /// How many GPUs the run managed.
    pub gpu_count: u32,
    pub actuator: String,
    pub workload: String,
    pub seed: u64,
}

impl RunMeta {
    /// Where the figures come from, in one line for a command's final table: a simulated
    /// run says so in capitals, with its profile and data source.
    pub fn source_line(&self) -> String {
        if self.simulated {
            format!("SIMULATED ({}) — {}", self.gpu_profile, self.data_source)
        } else {
            format!("{} (measured)", self.gpu_name)
        }
    }
}

/// Assembled backends, ready for [`crate::run`].
#[derive(Debug)]
pub struct Assembled {
    pub backends: Backends,
    pub meta: RunMeta,
    /// The knobs the policy gets: the spec's, intersected with what the backends can do.
    pub knobs: Knobs,
    /// Knobs the spec asked for and the policy does not get, with the reason (shown to
    /// the operator).
    pub withheld: Vec<Withheld>,
    /// Whether the actuator changes a real GPU's settings (a real GPU, not a dry run):
    /// see [`Assembled::guard_settings`].
    pub real_settings: bool,
    /// The simulator, for runs on it (ground truth for tests and judging).
    pub sim: Option<SimGpu>,
    /// What the operator and the backends offer, knob by knob: a policy swapped in later
    /// gets its spec's knobs intersected with this, as the first one did.
    pub offered: Offered,
    /// Knobs this process may not change on the hardware (no privileges), with why: a
    /// policy asking for one is refused, as the first one would have been.
    pub not_permitted: Vec<Withheld>,
}

impl Assembled {
    /// Whether a GPU setting may change in the node's lifetime, turning `knobs` (a run's:
    /// its policy's; a served node's: every hardware knob, for a policy swapped in later
    /// may take any).
    pub fn changes_hardware(&self, knobs: Knobs) -> bool {
        self.real_settings && (knobs.power_cap || knobs.sm_clock)
    }

    /// The one rule for keeping a node's original settings, for every command that runs
    /// one (`run`, `ab`, `serve`): where a GPU setting may change turning `knobs`, or where
    /// the operator names a state file (on the simulator: to test restoring), the actuator
    /// is wrapped in a [`SettingsGuard`] that saves every GPU's settings before the first
    /// change (restoring first what a stopped run left behind) and puts them back when the
    /// node ends, however it ends. `group`: one of several groups of GPUs run side by side
    /// (`ab --crossover`), each with a state file of its own (`NAME.gpuG.json`).
    /// `power_ceiling_w`: the most a restore may put back, summed (a fleet node's reserve).
    /// Returns the state file kept, if any.
    pub fn guard_settings(
        &mut self,
        named: Option<PathBuf>,
        knobs: Knobs,
        group: Option<usize>,
        power_ceiling_w: Option<f64>,
    ) -> Result<Option<PathBuf>, crate::restore::RestoreError> {
        let path = match named {
            Some(path) => path,
            None if self.changes_hardware(knobs) => crate::restore::StateFile::default_path(),
            None => return Ok(None),
        };
        let path = match group {
            Some(g) => path.with_extension(format!("gpu{g}.json")),
            None => path,
        };
        let placeholder: Box<dyn Actuator> = Box::new(DryRun::new(Vec::new(), Vec::new()));
        let actuator = std::mem::replace(&mut self.backends.actuator, placeholder);
        let mut guard = crate::restore::SettingsGuard::new(
            crate::restore::StateFile::new(path.clone()),
            actuator,
        );
        if let Some(watts) = power_ceiling_w {
            guard = guard.with_power_ceiling(watts);
        }
        let armed = guard.arm();
        self.backends.actuator = Box::new(guard);
        armed.map(|()| Some(path))
    }
}

/// A knob the spec asked for that the run does not grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Withheld {
    pub knob: &'static str,
    pub reason: String,
}

impl std::fmt::Display for Withheld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the {} knob is withheld: {}", self.knob, self.reason)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AssemblyError {
    #[error(transparent)]
    Sim(#[from] tokwatt_sim::SimError),
    #[error(transparent)]
    Nvml(#[from] tokwatt_nvml::NvmlError),
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] tokwatt_cuda::CudaError),
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Model(#[from] tokwatt_cuda::ModelError),
    #[error(
        "this tokwatt was built without its CUDA decode workload (the `cuda` feature): rebuild with `cargo build -p tokwatt --features cuda` (on by default), or take tokens from a serving engine (`--engine`) or the simulator"
    )]
    NoCuda,
    #[error(
        "the scenario {scenario}'s longest request needs {needed} KV positions, but --context is {context}: raise --context to {needed} or more, or drop it (the scenario's longest is the default)"
    )]
    ContextTooShort {
        scenario: String,
        needed: u32,
        context: u32,
    },
    #[error("reading the GPU settings in force: {0}")]
    ReadSettings(#[from] tokwatt_core::actuator::ActuatorError),
    #[error("reading this boot's identity from {path}: {reason} (a Linux kernel has it)")]
    BootId { path: &'static str, reason: String },
    #[error("reading tokens from {url}: {reason}")]
    External { url: String, reason: String },
    #[error(
        "{sources} workload sources for {gpus} GPUs: give one per GPU, in the order of the GPUs"
    )]
    SourcesPerGpu { sources: usize, gpus: usize },
    #[error("no GPU selected: pass at least one NVML index")]
    NoGpu,
    #[error(
        "one serving engine's tokens cannot feed {gpus} simulated GPUs: simulate one (--gpus 1)"
    )]
    EngineBesideManyGpus { gpus: u32 },
    #[error(
        "policy `{policy}` may change {what} on GPU {gpu}, but this process may not ({why}). Run as root or with CAP_SYS_ADMIN, or run observe-only with --dry-run (serve: node.dry_run = true), or let the policy change only the batch size with --batch-only (serve: node.batch_only = true)"
    )]
    NotPermitted {
        policy: String,
        what: String,
        gpu: u32,
        why: String,
    },
}

/// What the backends can do, knob by knob, with the reason where they cannot.
#[derive(Debug, Clone)]
pub struct Offered {
    pub power_cap: Result<(), String>,
    pub sm_clock: Result<(), String>,
    pub batch_size: Result<(), String>,
    /// The token budget per step: a workload knob, as the batch size, offered unless an
    /// engine outside tokwatt keeps its own. Whether the workload has a budget at all
    /// (it serves prompts) is checked when a policy starts (`crate::start_policy`),
    /// which refuses a spec that lists it where there is none.
    pub token_budget: Result<(), String>,
}

impl Offered {
    /// The knobs the backends offer, whoever asks.
    pub fn knobs(&self) -> Knobs {
        Knobs {
            power_cap: self.power_cap.is_ok(),
            sm_clock: self.sm_clock.is_ok(),
            batch_size: self.batch_size.is_ok(),
            token_budget: self.token_budget.is_ok(),
        }
    }
}

impl Default for Offered {
    /// Every knob offered.
    fn default() -> Self {
        Self {
            power_cap: Ok(()),
            sm_clock: Ok(()),
            batch_size: Ok(()),
            token_budget: Ok(()),
        }
    }
}

/// For a policy that failed to start where the run withheld knobs its spec lists (a
/// policy sees only what it is granted, so it cannot tell an unlisted knob from a withheld
/// one): which knobs, why, and the fix. `batch_only` is whether the operator withheld them
/// (`--batch-only`). `None` where nothing was withheld.
pub fn withheld_hint(withheld: &[Withheld], batch_only: bool) -> Option<String> {
    if withheld.is_empty() {
        return None;
    }
    let knobs = withheld
        .iter()
        .map(|w| format!("\"{}\"", w.knob))
        .collect::<Vec<_>>()
        .join(" and ");
    let them = if withheld.len() == 1 { "it" } else { "them" };
    let fix = if batch_only && withheld.iter().all(|w| w.knob != "batch-size") {
        format!(
            "drop --batch-only (serve: node.batch_only) to grant {them}, or run a policy that \
             turns only the batch size, such as policies/slo-batch.toml"
        )
    } else {
        format!("run the policy where {them} can be granted, or run one that does without {them}")
    };
    let why = withheld
        .iter()
        .map(|w| format!("{}: {}", w.knob, w.reason))
        .collect::<Vec<_>>()
        .join("; ");
    Some(format!(
        "the spec lists {knobs}, which this run withholds ({why}): {fix}"
    ))
}

/// The knobs a policy gets: those its spec asks for and the backends offer. A knob the
/// spec asks for that the backends do not offer is withheld with its reason.
pub fn grant_knobs(asked: Knobs, offered: &Offered) -> (Knobs, Vec<Withheld>) {
    let mut granted = Knobs::default();
    let mut withheld = Vec::new();
    let mut grant = |asked: bool, offer: &Result<(), String>, name: &'static str| match offer {
        Ok(()) => asked,
        Err(reason) => {
            if asked {
                withheld.push(Withheld {
                    knob: name,
                    reason: reason.clone(),
                });
            }
            false
        }
    };
    granted.power_cap = grant(asked.power_cap, &offered.power_cap, "power-cap");
    granted.sm_clock = grant(asked.sm_clock, &offered.sm_clock, "sm-clock");
    granted.batch_size = grant(asked.batch_size, &offered.batch_size, "batch-size");
    granted.token_budget = grant(asked.token_budget, &offered.token_budget, "token-budget");
    (granted, withheld)
}

/// Assemble the backends for `policy` (its name, for messages) asking for `knobs`.
pub fn assemble(
    request: &BackendRequest,
    policy: &str,
    knobs: Knobs,
) -> Result<Assembled, AssemblyError> {
    match &request.target {
        Target::Sim(sim) => assemble_sim(sim, request, knobs),
        Target::Gpu(gpu) => assemble_gpu(gpu, request, policy, knobs),
    }
}

/// The simulated GPU and the backends of a run on it.
pub fn simulator(target: &SimTarget, seed: u64) -> Result<(SimGpu, Backends), AssemblyError> {
    let (profile, scenario) = sim_work(target)?;
    let config = SimConfig {
        profile,
        scenario,
        gpus: target.gpus,
        seed,
        noise_seed: None,
    };
    simulator_on(config, target.realtime, target.driver.as_deref())
}

/// The actuator of a simulated node whose driver file exists: its boards (their count,
/// and their profile unless `profile` names one, as a profile file must be) are the
/// file's. What a second process on the node (`tokwatt fence`, `tokwatt restore`)
/// changes the node's settings through.
pub fn simulated_node_actuator(
    driver: &std::path::Path,
    profile: Option<String>,
) -> Result<Box<dyn Actuator>, AssemblyError> {
    let held = tokwatt_sim::SimDriver::at(driver)
        .read()
        .map_err(tokwatt_sim::SimError::from)?;
    let target = SimTarget {
        gpus: held.boards.len() as u32,
        driver: Some(driver.to_owned()),
        ..SimTarget::new(profile.unwrap_or(held.profile))
    };
    Ok(simulator(&target, 1)?.1.actuator)
}

/// Which boot a node runs in, as the fleet compares boots (`tokwatt_fleet::boot_of` of it): a
/// simulated node's driver file and its reboots so far, else the kernel's boot id. A boot
/// unit's record carries it, and the agent reports it: the record proves that a reboot
/// lands at the reserve only for the boot it was written in.
pub fn boot_identity(driver: Option<&std::path::Path>) -> Result<String, AssemblyError> {
    match driver {
        Some(path) => {
            let held = tokwatt_sim::SimDriver::at(path)
                .read()
                .map_err(tokwatt_sim::SimError::from)?;
            let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
            Ok(format!("sim-driver {} boot {}", path.display(), held.boots))
        }
        None => std::fs::read_to_string(BOOT_ID)
            .map(|id| id.trim().to_owned())
            .map_err(|error| AssemblyError::BootId {
                path: BOOT_ID,
                reason: error.to_string(),
            }),
    }
}

/// The kernel's identity of this boot (a random UUID, new at every boot).
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// `target`'s GPU profile and scenario (the built-in one where it names none), loaded.
pub fn sim_work(target: &SimTarget) -> Result<(GpuProfile, Scenario), AssemblyError> {
    let profile = GpuProfile::load(&target.profile)?;
    let scenario = match &target.scenario {
        Some(path) => Scenario::load(path)?,
        None => Scenario::built_in()?,
    };
    Ok((profile, scenario))
}

/// The simulated GPU of an already loaded profile and scenario (the judge builds its
/// scenarios' profiles itself), and the backends of a run on it.
pub fn simulator_from(
    config: SimConfig,
    realtime: bool,
) -> Result<(SimGpu, Backends), AssemblyError> {
    simulator_on(config, realtime, None)
}

/// [`simulator_from`], the settings kept in the simulated driver's file at `driver`
/// where one is given.
pub fn simulator_on(
    config: SimConfig,
    realtime: bool,
    driver: Option<&std::path::Path>,
) -> Result<(SimGpu, Backends), AssemblyError> {
    let clock: Arc<dyn Clock> = if realtime {
        WallClock::new()
    } else {
        VirtualClock::new()
    };
    let sim = match driver {
        Some(path) => SimGpu::with_driver(config, clock.clone(), path)?,
        None => SimGpu::new(config, clock.clone())?,
    };
    let backends = Backends {
        telemetry: sim.telemetry(),
        actuator: sim.actuator(),
        workload: sim.workload(),
        clock,
    };
    Ok((sim, backends))
}

fn operator_offer(request: &BackendRequest) -> Offered {
    let batch_only = || {
        Err(
            "the operator allows only the batch size (--batch-only, or serve's node.batch_only)"
                .to_owned(),
        )
    };
    if request.batch_only {
        // The workload's knobs need no privileges: the token budget stays offered.
        Offered {
            power_cap: batch_only(),
            sm_clock: batch_only(),
            batch_size: Ok(()),
            token_budget: Ok(()),
        }
    } else {
        Offered::default()
    }
}

fn assemble_sim(
    target: &SimTarget,
    request: &BackendRequest,
    knobs: Knobs,
) -> Result<Assembled, AssemblyError> {
    let (sim, backends) = simulator(target, request.seed)?;
    let (knobs, withheld) = grant_knobs(knobs, &operator_offer(request));
    let meta = RunMeta {
        simulated: true,
        gpu_profile: target.profile.clone(),
        gpu_name: sim.profile().name.clone(),
        data_source: format!("simulator output: {}", sim.calibration_note()),
        gpu_count: target.gpus,
        actuator: "sim".into(),
        workload: "sim".into(),
        seed: request.seed,
    };
    Ok(Assembled {
        backends,
        meta,
        knobs,
        withheld,
        real_settings: false,
        sim: Some(sim),
        offered: operator_offer(request),
        not_permitted: Vec::new(),
    })
}

/// A simulated GPU whose tokens come from a running serving engine's metrics
/// (`source`, [`WorkloadSource::External`]): the external token source tried against a
/// real engine on a machine without a GPU (the llama.cpp end-to-end test). Power, energy
/// and settings are simulator output, the tokens are the engine's; the simulator runs on
/// the wall clock whatever `target` says, as the engine's tokens do. The engine keeps its
/// own batch size, as on a real GPU.
pub fn assemble_sim_with_engine(
    target: &SimTarget,
    source: &WorkloadSource,
    request: &BackendRequest,
    knobs: Knobs,
) -> Result<Assembled, AssemblyError> {
    if target.gpus != 1 {
        return Err(AssemblyError::EngineBesideManyGpus { gpus: target.gpus });
    }
    let target = SimTarget {
        realtime: true,
        ..target.clone()
    };
    let (sim, mut backends) = simulator(&target, request.seed)?;
    let (workload, note) = one_gpu_workload(source, 0, 0)?;
    backends.workload = workload;
    let mut offered = operator_offer(request);
    offered.batch_size = Err("the external serving engine sets its own batch size".into());
    offered.token_budget = Err("the external serving engine sets its own token budget".into());
    let (knobs, withheld) = grant_knobs(knobs, &offered);
    let meta = RunMeta {
        simulated: true,
        gpu_profile: target.profile.clone(),
        gpu_name: sim.profile().name.clone(),
        data_source: format!(
            "simulator output for power and energy ({}); {note}",
            sim.calibration_note()
        ),
        gpu_count: 1,
        actuator: "sim".into(),
        workload: backends.workload.name().into(),
        seed: request.seed,
    };
    Ok(Assembled {
        backends,
        meta,
        knobs,
        withheld,
        real_settings: false,
        sim: Some(sim),
        offered,
        not_permitted: Vec::new(),
    })
}

fn assemble_gpu(
    target: &GpuTarget,
    request: &BackendRequest,
    policy: &str,
    knobs: Knobs,
) -> Result<Assembled, AssemblyError> {
    if target.indices.is_empty() {
        return Err(AssemblyError::NoGpu);
    }
    if let WorkloadSource::PerGpu(sources) = &target.workload
        && sources.len() != target.indices.len()
    {
        return Err(AssemblyError::SourcesPerGpu {
            sources: sources.len(),
            gpus: target.indices.len(),
        });
    }
    let system = NvmlSystem::open(Some(&target.indices))?;
    let devices = system.devices();
    let mut nvml_actuator = system.actuator();

    // What the operator allows, then what the workload can do.
    let mut offered = operator_offer(request);
    if target.workload.is_external() {
        offered.batch_size = Err("the external serving engine sets its own batch size".into());
        offered.token_budget = Err("the external serving engine sets its own token budget".into());
    }
    let (knobs, withheld) = grant_knobs(knobs, &offered);

    let mut not_permitted = Vec::new();
    let actuator: Box<dyn Actuator> = if target.dry_run {
        let current = (0..devices.len() as u32)
            .map(|gpu| nvml_actuator.read(gpu))
            .collect::<Result<Vec<_>, _>>()?;
        Box::new(DryRun::new(devices.clone(), current))
    } else {
        let why = || {
            tokwatt_core::privileges::Privileges::current()
                .denial()
                .map_or_else(|| "the driver refused".to_owned(), |d| d.to_string())
        };
        for device in &devices {
            let can = nvml_actuator.capabilities(device.index);
            for (denied, knob) in [(!can.power_cap, "power-cap"), (!can.sm_clock, "sm-clock")] {
                if denied && !not_permitted.iter().any(|w: &Withheld| w.knob == knob) {
                    not_permitted.push(Withheld {
                        knob,
                        reason: format!("GPU {}: {}", device.index, why()),
                    });
                }
            }
            // A knob granted but not permitted is explained now, not half-way through the run.
            let missing: Vec<&str> = [
                (knobs.power_cap && !can.power_cap, "the power cap"),
                (knobs.sm_clock && !can.sm_clock, "the SM clock lock"),
            ]
            .into_iter()
            .filter_map(|(missing, what)| missing.then_some(what))
            .collect();
            if !missing.is_empty() {
                return Err(AssemblyError::NotPermitted {
                    policy: policy.to_owned(),
                    what: missing.join(" and "),
                    gpu: device.index,
                    why: why(),
                });
            }
        }
        Box::new(nvml_actuator)
    };
    let telemetry = system.telemetry(SamplerConfig::for_tick(target.tick))?;
    let (workload, note) = workload(target)?;
    let name = devices.first().map_or_else(String::new, |d| d.name.clone());
    let indices: Vec<String> = target.indices.iter().map(u32::to_string).collect();
    let meta = RunMeta {
        simulated: false,
        gpu_profile: name.clone(),
        gpu_name: name,
        data_source: format!(
            "measured on GPU {} (NVML energy counter, {note})",
            indices.join(",")
        ),
        gpu_count: target.indices.len() as u32,
        actuator: actuator.name().to_owned(),
        workload: workload.name().into(),
        seed: request.seed,
    };
    Ok(Assembled {
        backends: Backends {
            telemetry: Box::new(telemetry),
            actuator,
            workload,
            clock: WallClock::new(),
        },
        meta,
        knobs,
        withheld,
        real_settings: !target.dry_run,
        sim: None,
        offered,
        not_permitted,
    })
}

fn workload(target: &GpuTarget) -> Result<(Box<dyn Workload>, String), AssemblyError> {
    let sources: Vec<&WorkloadSource> = match &target.workload {
        WorkloadSource::PerGpu(sources) => sources.iter().collect(),
        one => vec![one; target.indices.len()],
    };
    if let ([source], [nvml_index]) = (&sources[..], &target.indices[..]) {
        return one_gpu_workload(source, *nvml_index, 0);
    }
    // One source per GPU, each answering for its own GPU.
    let mut per_gpu = Vec::with_capacity(sources.len());
    let mut notes = Vec::with_capacity(sources.len());
    for (position, (source, nvml_index)) in sources.iter().zip(&target.indices).enumerate() {
        let agent_index = position as u32;
        let (workload, note) = one_gpu_workload(source, *nvml_index, agent_index)?;
        // A CUDA decode answers to the agent's index; an external source to 0.
        let inner = if matches!(
            source,
            WorkloadSource::Cuda { .. } | WorkloadSource::CudaServe { .. }
        ) {
            agent_index
        } else {
            0
        };
        per_gpu.push((workload, inner));
        notes.push(format!("GPU {nvml_index}: {note}"));
    }
    Ok((
        Box::new(tokwatt_core::workload::per_gpu::PerGpu::new(per_gpu)),
        notes.join("; "),
    ))
}

/// The workload of one GPU (`nvml_index`), answering the loop as GPU `agent_index`.
fn one_gpu_workload(
    source: &WorkloadSource,
    nvml_index: u32,
    agent_index: u32,
) -> Result<(Box<dyn Workload>, String), AssemblyError> {
    match source {
        #[cfg(not(feature = "cuda"))]
        WorkloadSource::Cuda { .. } | WorkloadSource::CudaServe { .. } => {
            let _ = (nvml_index, agent_index);
            Err(AssemblyError::NoCuda)
        }
        #[cfg(feature = "cuda")]
        WorkloadSource::Cuda {
            model,
            context,
            batch_size_max,
        } => {
            let shape = ModelShape::load(model)?;
            let mut config = CudaDecodeConfig::new(shape, *context, *batch_size_max);
            config.device = nvml_index;
            config.gpu_index = agent_index;
            let workload = CudaDecode::new(config)?;
            Ok((
                Box::new(workload),
                format!("CUDA decode of {model} at context {context}"),
            ))
        }
        #[cfg(feature = "cuda")]
        WorkloadSource::CudaServe {
            scenario: path,
            context,
            slots,
            seed,
        } => {
            let scenario = Scenario::load(path)?;
            let needed = scenario.longest_context_tokens();
            let context = context.unwrap_or(needed);
            if context < needed {
                return Err(AssemblyError::ContextTooShort {
                    scenario: path.display().to_string(),
                    needed,
                    context,
                });
            }
            let slots = slots.unwrap_or(scenario.batch_size_max).max(1);
            let arrivals = tokwatt_sim::ScenarioArrivals::new(
                &scenario,
                seed.wrapping_add(agent_index.into()),
            )
            .map_err(|problem| tokwatt_sim::SimError::Invalid {
                what: "scenario",
                origin: path.display().to_string(),
                problem,
            })?;
            let workload = tokwatt_cuda::CudaServe::new(tokwatt_cuda::CudaServeConfig {
                model: scenario.model.clone(),
                context,
                slots,
                running_limit: scenario.initial_batch_size.clamp(1, slots),
                max_batched_tokens: scenario.max_batched_tokens,
                queue_max: scenario.queue_max,
                device: nvml_index,
                gpu_index: agent_index,
                engine: tokwatt_cuda::EngineOptions::default(),
                requests: Box::new(arrivals),
                energy: Some(energy_counter(nvml_index)?),
                step_log: None,
            })?;
            Ok((
                Box::new(workload),
                format!(
                    "CUDA serving of {} ({}): {slots} slots of {context} positions, {} tokens a step",
                    path.display(),
                    scenario.model_name,
                    scenario.max_batched_tokens
                ),
            ))
        }
        WorkloadSource::External {
            url,
            token_counter,
            tpot_histogram,
            request_metrics,
        } => {
            let config = PrometheusConfig {
                url: url.clone(),
                token_counter: token_counter.clone(),
                tpot_histogram: tpot_histogram.clone(),
                request_metrics: request_metrics.clone(),
                period: Duration::from_secs(1),
            };
            let workload =
                PrometheusTokens::start(config).map_err(|e| AssemblyError::External {
                    url: url.clone(),
                    reason: e.to_string(),
                })?;
            Ok((Box::new(workload), format!("tokens from {url}")))
        }
        WorkloadSource::PerGpu(_) => Err(AssemblyError::SourcesPerGpu {
            sources: 0,
            gpus: 1,
        }),
    }
}

/// Real GPUs observed only, for measuring the agent itself (`tokwatt bench agent-cpu`):
/// NVML telemetry sampled by `sampler`, a dry-run actuator starting from the settings in
/// force (nothing changes), and `workload` as the token source. Returns the backends, the
/// run's description and the counts of the NVML calls the sampler makes.
pub fn assemble_observed_nvml(
    system: &NvmlSystem,
    sampler: SamplerConfig,
    workload: Box<dyn Workload>,
    data_source: String,
) -> Result<(Backends, RunMeta, tokwatt_nvml::NvmlCallCounts), AssemblyError> {
    let devices = system.devices();
    let mut reader = system.actuator();
    let current = (0..devices.len() as u32)
        .map(|gpu| reader.read(gpu))
        .collect::<Result<Vec<_>, _>>()?;
    let actuator = DryRun::new(devices.clone(), current);
    let telemetry = system.telemetry(sampler)?;
    let calls = telemetry.call_counts();
    let name = devices.first().map_or_else(String::new, |d| d.name.clone());
    let meta = RunMeta {
        simulated: false,
        gpu_profile: name.clone(),
        gpu_name: name,
        data_source,
        gpu_count: devices.len() as u32,
        actuator: actuator.name().to_owned(),
        workload: workload.name().to_owned(),
        seed: 1,
    };
    let backends = Backends {
        telemetry: Box::new(telemetry),
        actuator: Box::new(actuator),
        workload,
        clock: WallClock::new(),
    };
    Ok((backends, meta, calls))
}

/// GPU `nvml_index`'s energy counter on a sampler of its own (one NVML call every 100 ms),
/// for the serving loop to share each step's energy over its requests.
#[cfg(feature = "cuda")]
fn energy_counter(nvml_index: u32) -> Result<tokwatt_cuda::EnergyCounter, AssemblyError> {
    use tokwatt_core::telemetry::Telemetry;
    let system = NvmlSystem::open(Some(&[nvml_index]))?;
    let mut telemetry = system.telemetry(tokwatt_nvml::SamplerConfig::energy_only(
        Duration::from_millis(100),
    ))?;
    Ok(Box::new(move || {
        telemetry
            .read_window(0)
            .ok()
            .map(|window| window.energy_counter_j)
    }))
}

impl WorkloadSource {
    /// Whether the tokens come from a serving engine (which sets its own batch size).
    pub fn is_external(&self) -> bool {
        match self {
            WorkloadSource::Cuda { .. } | WorkloadSource::CudaServe { .. } => false,
            WorkloadSource::External { .. } => true,
            WorkloadSource::PerGpu(sources) => sources.iter().any(WorkloadSource::is_external),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Built without the `cuda` feature (`cargo test -p tokwatt-agent` alone; the binary
    /// turns it on), a CUDA workload is refused with the fix, not a link error.
    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_cuda_workload_without_the_feature_is_refused_with_the_fix() {
        let source = WorkloadSource::Cuda {
            model: "llama-3-8b".into(),
            context: 1024,
            batch_size_max: 64,
        };
        let error = one_gpu_workload(&source, 0, 0)
            .err()
            .expect("refused")
            .to_string();
        assert!(error.contains("`cuda` feature"), "{error}");
        assert!(error.contains("--features cuda"), "{error}");
    }

    /// A scenario whose requests cannot fit the KV slots asked for is refused before any
    /// GPU is opened, with the context that would fit.
    #[cfg(feature = "cuda")]
    #[test]
    fn serving_a_scenario_with_too_short_a_context_is_refused_with_the_length_needed() {
        let scenario = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../scenarios/serving-check.toml");
        let source = WorkloadSource::CudaServe {
            scenario,
            context: Some(1024),
            slots: None,
            seed: 1,
        };
        let error = one_gpu_workload(&source, 0, 0)
            .err()
            .expect("refused")
            .to_string();
        assert!(error.contains("needs 3072 KV positions"), "{error}");
        assert!(error.contains("--context is 1024"), "{error}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn serving_a_scenario_without_the_feature_is_refused_with_the_fix() {
        let source = WorkloadSource::CudaServe {
            scenario: "serving-check.toml".into(),
            context: None,
            slots: None,
            seed: 1,
        };
        let error = one_gpu_workload(&source, 0, 0)
            .err()
            .expect("refused")
            .to_string();
        assert!(error.contains("--features cuda"), "{error}");
    }

    fn all() -> Knobs {
        Knobs::all()
    }

    #[test]
    fn knobs_are_the_spec_intersected_with_the_offer() {
        let offered = Offered {
            power_cap: Ok(()),
            sm_clock: Err("not supported".into()),
            batch_size: Err("external engine".into()),
            token_budget: Err("external engine".into()),
        };
        let (granted, withheld) = grant_knobs(all(), &offered);
        assert_eq!(
            granted,
            Knobs {
                power_cap: true,
                ..Knobs::default()
            }
        );
        let names: Vec<_> = withheld.iter().map(|w| w.knob).collect();
        assert_eq!(names, ["sm-clock", "batch-size", "token-budget"]);
        // A knob the spec never asked for is neither granted nor reported.
        let (granted, withheld) = grant_knobs(Knobs::default(), &offered);
        assert_eq!(granted, Knobs::default());
        assert!(withheld.is_empty());
    }

    #[test]
    fn a_withheld_knob_is_named_with_the_fix_that_grants_it() {
        let request = BackendRequest {
            target: Target::Sim(SimTarget::new("h200")),
            seed: 1,
            batch_only: true,
        };
        let (granted, withheld) = grant_knobs(
            Knobs {
                power_cap: true,
                sm_clock: false,
                batch_size: true,
                token_budget: true,
            },
            &operator_offer(&request),
        );
        assert!(
            granted.batch_size && granted.token_budget,
            "the workload's knobs need no privileges"
        );
        let hint = withheld_hint(&withheld, true).expect("power-cap is withheld");
        assert!(
            hint.starts_with("the spec lists \"power-cap\", which this run withholds")
                && hint.contains("drop --batch-only")
                && hint.contains("policies/slo-batch.toml"),
            "{hint}"
        );
        assert_eq!(withheld_hint(&[], true), None);
    }

    /// The one rule for keeping original settings, as `run`, `ab` and `serve` apply it:
    /// a state file where a GPU setting may change or where one is named, none otherwise.
    #[test]
    fn the_original_settings_are_kept_by_one_rule() {
        let dir = tempfile::tempdir().expect("tempdir");
        let request = BackendRequest {
            target: Target::Sim(SimTarget::new("h200")),
            seed: 1,
            batch_only: false,
        };
        let cap = Knobs {
            power_cap: true,
            ..Knobs::default()
        };
        let batch = Knobs {
            batch_size: true,
            ..Knobs::default()
        };
        // The simulator, nothing named: nothing kept.
        let mut assembled = assemble(&request, "rule", cap).expect("assembles");
        assert!(!assembled.changes_hardware(cap));
        assert_eq!(
            assembled.guard_settings(None, cap, None, None).unwrap(),
            None
        );
        // Named: kept, on the simulator too (to test restoring), per group where asked.
        let named = dir.path().join("state.json");
        let kept = assembled
            .guard_settings(Some(named.clone()), cap, Some(1), None)
            .unwrap();
        assert_eq!(kept, Some(dir.path().join("state.gpu1.json")));
        assert!(dir.path().join("state.gpu1.json").exists(), "armed: saved");
        // Real settings: kept where a cap or clock may change, not for the batch alone.
        let mut real = assemble(&request, "rule", cap).expect("assembles");
        real.real_settings = true;
        assert!(real.changes_hardware(cap) && !real.changes_hardware(batch));
        assert_eq!(real.guard_settings(None, batch, None, None).unwrap(), None);
    }

    #[test]
    fn batch_only_withholds_caps_and_clocks_on_the_simulator_too() {
        let request = BackendRequest {
            target: Target::Sim(SimTarget::new("h200")),
            seed: 1,
            batch_only: true,
        };
        let assembled = assemble(&request, "p", all()).expect("assembles");
        // The workload's knobs need no privileges.
        assert_eq!(
            assembled.knobs,
            Knobs {
                batch_size: true,
                token_budget: true,
                ..Knobs::default()
            }
        );
        assert_eq!(assembled.withheld.len(), 2);
        assert!(assembled.meta.simulated && !assembled.real_settings);
    }

    #[test]
    fn a_missing_profile_file_is_not_called_an_unknown_profile() {
        let request = BackendRequest {
            target: Target::Sim(SimTarget::new("nope.toml")),
            seed: 1,
            batch_only: false,
        };
        let error = assemble(&request, "p", all()).expect_err("no such file");
        let text = error.to_string();
        assert!(
            text.contains("nope.toml") && text.contains("not found"),
            "{text}"
        );
    }
}
