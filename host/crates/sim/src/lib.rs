//! The simulated GPU: one object behind all three boundary traits ([`Telemetry`],
//! [`Actuator`], [`Workload`]), so a simulated run takes the same code path as a real one.
//!
//! - [`GpuProfile`]: the device (constraints, decode power and step-time model, NVML
//!   behaviour, thermals), from a TOML file that cites what it was fitted to.
//! - [`Scenario`]: the workload (model, context, batch limits, demand phases).
//! - [`SimGpu`]: `gpus` independent simulated boards sharing one profile and scenario.
//!
//! The simulation is lazy: every trait method first catches the simulated boards up to
//! `clock.now()`. On a [`tokwatt_core::clock::VirtualClock`] the control loop sleeps to its next
//! tick and then reads the windows, which advances the simulation; on a wall clock the same
//! code simulates in real time. Everything is deterministic given the seed.
//!
//! Not simulated: prefill, context growth during decode (every sequence attends over the
//! scenario's context length), thermal throttling, out-of-band power limits.

mod gpu;
pub mod model;
pub mod profile;
pub mod scenario;

#[cfg(test)]
mod calibration;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

pub use gpu::SimTruth;
pub use model::{DecodeCost, DecodeModel, ModelShape};
pub use profile::GpuProfile;
pub use scenario::{Phase, Scenario};

use gpu::GpuSim;
use tokwatt_core::actuator::{Actuator, ActuatorError, Capabilities, GpuSettings};
use tokwatt_core::clock::Clock;
use tokwatt_core::telemetry::{Telemetry, TelemetryError};
use tokwatt_core::types::{DeviceInfo, TelemetryWindow, WorkloadWindow};
use tokwatt_core::workload::{Workload, WorkloadError};

/// Most boards one simulation may hold (a node has at most a few dozen).
const MAX_GPUS: u32 = 1024;

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(
        "unknown GPU profile '{0}': built-in profiles are a100, h100, h200; or pass the path of a profile TOML file"
    )]
    UnknownProfile(String),
    #[error(
        "GPU profile file not found: {}. Give an existing profile file, or a built-in profile (a100, h100, h200)", .0.display()
    )]
    ProfileNotFound(PathBuf),
    #[error("cannot read {what} file {}: {source}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} file {origin} is not valid: {message}")]
    Parse {
        what: &'static str,
        origin: String,
        message: String,
    },
    #[error("{what} {origin}: {problem}")]
    Invalid {
        what: &'static str,
        origin: String,
        problem: String,
    },
    /// An unknown model preset or a bad shape (or give the shape in a `[model_shape]` table).
    #[error(transparent)]
    Model(#[from] tokwatt_core::model::ModelError),
    #[error("the simulation needs 1 to {MAX_GPUS} GPUs (got {0})")]
    GpuCount(u32),
    /// The model's weights (or one sequence's KV cache beside them) exceed the profile's memory.
    #[error("GPU profile '{profile}': {source}")]
    Memory {
        profile: String,
        source: tokwatt_core::model::MemoryFitError,
    },
}

/// What to simulate.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub profile: GpuProfile,
    pub scenario: Scenario,
    /// Number of simulated boards; each serves its own copy of the scenario, with its own
    /// arrivals (seeded from `seed` and its index).
    pub gpus: u32,
    pub seed: u64,
    /// Seeds the run's own noise (sensor readings, step-time jitter) apart from the work
    /// (arrivals, the boards' gain errors), which `seed` keeps: two runs with one `seed`
    /// and their own noise seeds see the same work and read it differently. `None`: `seed`.
    pub noise_seed: Option<u64>,
}

/// Simulated GPUs. Cheap to clone: clones share the same boards.
#[derive(Debug, Clone)]
pub struct SimGpu {
    state: Arc<Mutex<SimState>>,
    profile: Arc<GpuProfile>,
    scenario: Arc<Scenario>,
    devices: Arc<Vec<DeviceInfo>>,
    /// The scenario's `batch_size_max`, or the largest batch that fits the device's memory
    /// if that is smaller.
    batch_size_max: u32,
}

#[derive(Debug)]
struct SimState {
    clock: Arc<dyn Clock>,
    gpus: Vec<GpuSim>,
}

impl SimState {
    /// Board `index`, caught up to the clock's now.
    fn gpu(&mut self, index: u32) -> Option<&mut GpuSim> {
        let now_ns = u64::try_from(self.clock.now().as_nanos()).unwrap_or(u64::MAX);
        let gpu = self.gpus.get_mut(usize::try_from(index).ok()?)?;
        gpu.advance_to(now_ns);
        Some(gpu)
    }

    fn count(&self) -> u32 {
        self.gpus.len() as u32
    }
}

impl SimGpu {
    pub fn new(config: SimConfig, clock: Arc<dyn Clock>) -> Result<SimGpu, SimError> {
        let SimConfig {
            profile,
            scenario,
            gpus,
            seed,
            noise_seed,
        } = config;
        if !(1..=MAX_GPUS).contains(&gpus) {
            return Err(SimError::GpuCount(gpus));
        }
        profile.validate().map_err(|problem| SimError::Invalid {
            what: "GPU profile",
            origin: format!("'{}'", profile.id),
            problem,
        })?;
        scenario.validate().map_err(|problem| SimError::Invalid {
            what: "scenario",
            origin: format!("'{}' ({})", scenario.description, scenario.model_name),
            problem,
        })?;
        let fits = tokwatt_core::model::max_batch_that_fits(
            &scenario.model,
            scenario.context_tokens,
            profile.memory_bytes(),
        )
        .map_err(|source| SimError::Memory {
            profile: profile.id.clone(),
            source,
        })?;
        let mut scenario = scenario;
        if scenario.batch_size_max > fits {
            tracing::warn!(
                requested = scenario.batch_size_max,
                fits,
                "the scenario's batch_size_max does not fit {} ({} GB) with {} at {} positions: \
                 the batch is limited to {fits}",
                profile.name,
                profile.memory.size_gb,
                scenario.model_name,
                scenario.context_tokens
            );
            scenario.batch_size_max = fits;
            scenario.initial_batch_size = scenario.initial_batch_size.min(fits);
        }
        let batch_size_max = scenario.batch_size_max;
        let profile = Arc::new(profile);
        let scenario = Arc::new(scenario);
        let devices = (0..gpus)
            .map(|index| device_info(&profile, index))
            .collect();
        let boards = (0..gpus)
            .map(|index| {
                GpuSim::new(
                    index,
                    Arc::clone(&profile),
                    Arc::clone(&scenario),
                    seed,
                    noise_seed.unwrap_or(seed),
                )
            })
            .collect();
        Ok(SimGpu {
            state: Arc::new(Mutex::new(SimState {
                clock,
                gpus: boards,
            })),
            profile,
            scenario,
            devices: Arc::new(devices),
            batch_size_max,
        })
    }

    /// The telemetry face; all three faces share one simulation.
    pub fn telemetry(&self) -> Box<dyn Telemetry> {
        Box::new(SimTelemetry { sim: self.clone() })
    }

    pub fn actuator(&self) -> Box<dyn Actuator> {
        Box::new(SimActuator { sim: self.clone() })
    }

    pub fn workload(&self) -> Box<dyn Workload> {
        Box::new(SimWorkload { sim: self.clone() })
    }

    pub fn profile(&self) -> &GpuProfile {
        &self.profile
    }

    /// The scenario as simulated: `batch_size_max` (and the initial batch) limited to what
    /// fits the device's memory.
    pub fn scenario(&self) -> &Scenario {
        &self.scenario
    }

    /// One line for labelling output, e.g. "simulated NVIDIA H200, calibrated to measured H200
    /// data (driver 580.159.04, 2026-11-29)". Simulator figures are never GPU figures.
    pub fn calibration_note(&self) -> String {
        let calibration = &self.profile.calibration;
        if calibration.measured {
            format!(
                "simulated {}, calibrated to {}",
                self.profile.name, calibration.source
            )
        } else {
            format!(
                "simulated {}, NOT measured: {}",
                self.profile.name, calibration.source
            )
        }
    }

    /// Exact quantities of board `gpu` now (tests and evaluation; a real GPU has no such thing).
    pub fn truth(&self, gpu: u32) -> Option<SimTruth> {
        self.lock().gpu(gpu).map(|board| board.truth())
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        // A panic while holding the lock leaves consistent (if stale) numbers: carry on.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn device_info(profile: &GpuProfile, index: u32) -> DeviceInfo {
    DeviceInfo {
        index,
        uuid: format!("SIM-{}-{index}", profile.id),
        name: profile.name.clone(),
        simulated: true,
        power_cap_min_w: profile.power_cap.min_w,
        power_cap_max_w: profile.power_cap.max_w,
        power_cap_default_w: profile.power_cap.default_w,
        sm_clocks_mhz: profile.sm_clocks_mhz(),
        mem_clocks_mhz: profile.mem_clocks_mhz(),
    }
}

/// Supported clocks (highest first) within `[lo, hi]`, as the range NVML would lock to.
fn lock_range(supported: &[u32], lo: u32, hi: u32) -> Option<(u32, u32)> {
    let mut inside = supported.iter().copied().filter(|f| (lo..=hi).contains(f));
    let highest = inside.next()?;
    let lowest = inside.next_back().unwrap_or(highest);
    Some((lowest, highest))
}

#[derive(Debug)]
struct SimTelemetry {
    sim: SimGpu,
}

impl Telemetry for SimTelemetry {
    fn devices(&self) -> Vec<DeviceInfo> {
        self.sim.devices.as_ref().clone()
    }

    fn read_window(&mut self, gpu: u32) -> Result<TelemetryWindow, TelemetryError> {
        let mut state = self.sim.lock();
        let count = state.count();
        state
            .gpu(gpu)
            .map(GpuSim::read_telemetry_window)
            .ok_or(TelemetryError::NoSuchGpu { index: gpu, count })
    }
}

#[derive(Debug)]
struct SimActuator {
    sim: SimGpu,
}

impl SimActuator {
    fn with_gpu<T>(
        &self,
        gpu: u32,
        f: impl FnOnce(&mut GpuSim) -> Result<T, ActuatorError>,
    ) -> Result<T, ActuatorError> {
        let mut state = self.sim.lock();
        let count = state.count();
        match state.gpu(gpu) {
            Some(board) => f(board),
            None => Err(ActuatorError::NoSuchGpu { index: gpu, count }),
        }
    }
}

impl Actuator for SimActuator {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        self.sim.devices.as_ref().clone()
    }

    fn capabilities(&self, gpu: u32) -> Capabilities {
        let exists = (gpu as usize) < self.sim.devices.len();
        Capabilities {
            power_cap: exists,
            sm_clock: exists,
            mem_clock: exists,
        }
    }

    fn read(&mut self, gpu: u32) -> Result<GpuSettings, ActuatorError> {
        self.with_gpu(gpu, |board| Ok(board.settings()))
    }

    fn set_power_cap(&mut self, gpu: u32, watts: f64) -> Result<f64, ActuatorError> {
        let range = self.sim.profile.power_cap;
        self.with_gpu(gpu, |board| {
            if !(watts.is_finite() && (range.min_w..=range.max_w).contains(&watts)) {
                return Err(ActuatorError::Failed {
                    gpu,
                    what: "power cap",
                    reason: format!(
                        "{watts} W is outside the device's range {}-{} W",
                        range.min_w, range.max_w
                    ),
                });
            }
            Ok(board.set_power_cap(watts))
        })
    }

    fn set_sm_clock_lock(
        &mut self,
        gpu: u32,
        range_mhz: Option<(u32, u32)>,
    ) -> Result<(), ActuatorError> {
        let supported = self.sim.profile.sm_clocks_mhz();
        let effective = match range_mhz {
            None => None,
            Some((lo, hi)) => Some(checked_lock(gpu, "SM clock lock", &supported, lo, hi)?),
        };
        self.with_gpu(gpu, |board| {
            board.set_sm_lock(effective);
            Ok(())
        })
    }

    fn set_mem_clock_lock(
        &mut self,
        gpu: u32,
        range_mhz: Option<(u32, u32)>,
    ) -> Result<(), ActuatorError> {
        let supported = self.sim.profile.mem_clocks_mhz();
        let effective = match range_mhz {
            None => None,
            Some((lo, hi)) => Some(checked_lock(gpu, "memory clock lock", &supported, lo, hi)?),
        };
        self.with_gpu(gpu, |board| {
            let mem_mhz = effective
                .map(|(_, hi)| hi)
                .or_else(|| board.mem_grid().first().copied())
                .unwrap_or(0);
            board.set_mem_lock(effective, mem_mhz);
            Ok(())
        })
    }
}

/// The supported clocks a requested lock range covers, or the error NVML would give.
fn checked_lock(
    gpu: u32,
    what: &'static str,
    supported: &[u32],
    lo: u32,
    hi: u32,
) -> Result<(u32, u32), ActuatorError> {
    if lo > hi {
        return Err(ActuatorError::Failed {
            gpu,
            what,
            reason: format!("the minimum {lo} MHz is above the maximum {hi} MHz"),
        });
    }
    lock_range(supported, lo, hi).ok_or_else(|| ActuatorError::Failed {
        gpu,
        what,
        reason: format!(
            "no supported clock lies within {lo}-{hi} MHz (supported: {}-{} MHz)",
            supported.last().copied().unwrap_or(0),
            supported.first().copied().unwrap_or(0)
        ),
    })
}

#[derive(Debug)]
struct SimWorkload {
    sim: SimGpu,
}

impl Workload for SimWorkload {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn batch_size_max(&self, _gpu: u32) -> u32 {
        self.sim.batch_size_max
    }

    fn batch_size(&self, gpu: u32) -> u32 {
        self.sim
            .lock()
            .gpu(gpu)
            .map_or(0, |board| board.batch_size())
    }

    fn set_batch_size(&mut self, gpu: u32, batch: u32) -> Result<(), WorkloadError> {
        let max = self.sim.batch_size_max;
        let mut state = self.sim.lock();
        let count = state.count();
        let board = state
            .gpu(gpu)
            .ok_or(WorkloadError::NoSuchGpu { index: gpu, count })?;
        if !(1..=max).contains(&batch) {
            return Err(WorkloadError::BatchOutOfRange {
                requested: batch,
                max,
            });
        }
        board.set_batch_size(batch);
        Ok(())
    }

    fn read_window(&mut self, gpu: u32) -> Result<WorkloadWindow, WorkloadError> {
        let mut state = self.sim.lock();
        let count = state.count();
        state
            .gpu(gpu)
            .map(GpuSim::read_workload_window)
            .ok_or(WorkloadError::NoSuchGpu { index: gpu, count })
    }
}

#[cfg(test)]
mod tests;
