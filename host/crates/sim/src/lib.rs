//! The simulated GPU: one object behind all three boundary traits ([`Telemetry`],
//! [`Actuator`], [`Workload`]), so a simulated run takes the same code path as a real one.
//!
//! - [`GpuProfile`]: the device (constraints, decode power and step-time model, NVML
//!   behaviour, thermals), from a TOML file that cites what it was fitted to.
//! - [`Scenario`]: the workload (model, context, batch limits, demand phases).
//! - [`SimGpu`]: `gpus` independent simulated boards sharing one profile and scenario.
//! - [`SimDriver`]: the settings a real driver would hold (caps, clock locks, batch), in a
//!   file outside the process, for a simulated node whose settings must outlive its agent
//!   ([`SimGpu::with_driver`]); without one a simulation keeps them in memory.
//!
//! The simulation is lazy: every trait method first catches the simulated boards up to
//! `clock.now()`. On a [`tokwatt_core::clock::VirtualClock`] the control loop sleeps to its next
//! tick and then reads the windows, which advances the simulation; on a wall clock the same
//! code simulates in real time. Everything is deterministic given the seed.
//!
//! A scenario with prompts is served as an engine does ([`serving`]): chunked prefill
//! beside decode under a token budget, KV caches that grow as sequences decode (recompute
//! preemption when the memory is full), time to first token and energy per request. A
//! decode-only scenario decodes over a fixed context.
//!
//! Not simulated: thermal throttling, prefix caching, speculative decoding.
//!
//! This file holds [`SimGpu`] and the state its faces share; `adapters` holds the three
//! trait faces, `driver_link` how a simulation follows its driver file, and `parallel` the
//! helper thread that catches boards up beside the caller's.

mod adapters;
mod arrivals;
pub mod driver;
mod driver_link;
mod gpu;
pub mod lengths;
pub mod model;
mod parallel;
pub mod profile;
mod profile_validation;
pub mod scenario;
mod serving;

#[cfg(test)]
mod calibration;
#[cfg(test)]
mod prefill_tests;
#[cfg(test)]
mod serving_calibration;
#[cfg(test)]
mod serving_replay;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

pub use arrivals::ScenarioArrivals;
pub use driver::{BoardSettings, DriverError, DriverState, SimDriver};
pub use gpu::SimTruth;
pub use lengths::LengthDist;
pub use model::{DecodeCost, DecodeModel, ModelShape};
pub use profile::GpuProfile;
pub use scenario::{Phase, RequestLengths, Scenario};

use adapters::{SimActuator, SimTelemetry, SimWorkload, device_info};
use driver_link::DriverLink;
use gpu::GpuSim;
use parallel::Helper;
use tokwatt_core::actuator::Actuator;
use tokwatt_core::clock::{Clock, VirtualClock};
use tokwatt_core::telemetry::Telemetry;
use tokwatt_core::types::DeviceInfo;
use tokwatt_core::workload::Workload;
// What the tests (`use super::*`) name from the faces' errors and windows.
#[cfg(test)]
use tokwatt_core::{
    actuator::ActuatorError,
    types::{TelemetryWindow, WorkloadWindow},
    workload::WorkloadError,
};

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
    /// The simulated driver's file cannot be opened, or describes other boards.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// A copy of boards whose settings live in a driver file was asked for.
    #[error(
        "simulated boards tied to a driver file cannot be copied: the file holds one set of settings. Fork a simulation without --sim-driver"
    )]
    Fork,
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
    /// Where the settings live when they outlive the process; `None`: in the boards alone.
    driver: Option<DriverLink>,
    /// The thread that simulates boards beside this one (started at the first catch-up
    /// long enough to be worth it).
    helper: Option<Helper>,
}

/// Why a change of a board's settings did not take.
enum ChangeError {
    NoSuchGpu { count: u32 },
    Driver(DriverError),
}

impl SimState {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.clock.now().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Board `index`, caught up to the clock's now (and to the driver's settings, where
    /// another process changed them). Every board is caught up with it: a control loop
    /// reads them all at each tick, and two threads simulate them faster than one.
    fn gpu(&mut self, index: u32) -> Option<&mut GpuSim> {
        let now_ns = self.now_ns();
        if let Some(link) = &mut self.driver
            && link.reread()
        {
            link.follow(&mut self.gpus, now_ns);
        }
        self.catch_up_in_parallel(now_ns);
        let gpu = self.gpus.get_mut(usize::try_from(index).ok()?)?;
        gpu.advance_to(now_ns);
        Some(gpu)
    }

    /// Change board `index`'s settings: with a driver, in its file first (a failed write
    /// changes nothing) and then every board as the file now says; else on the board.
    fn change(
        &mut self,
        index: u32,
        in_driver: impl FnOnce(&mut BoardSettings),
        on_board: impl FnOnce(&mut GpuSim),
    ) -> Result<&mut GpuSim, ChangeError> {
        let count = self.count();
        let now_ns = self.now_ns();
        let position = usize::try_from(index)
            .ok()
            .filter(|&p| p < self.gpus.len())
            .ok_or(ChangeError::NoSuchGpu { count })?;
        match &mut self.driver {
            None => {
                let board = &mut self.gpus[position];
                board.advance_to(now_ns);
                on_board(board);
            }
            Some(link) => {
                link.seen = link
                    .driver
                    .update_board(index, in_driver)
                    .map_err(ChangeError::Driver)?;
                link.problem = None;
                link.follow(&mut self.gpus, now_ns);
            }
        }
        let board = &mut self.gpus[position];
        board.advance_to(now_ns);
        Ok(board)
    }

    fn count(&self) -> u32 {
        self.gpus.len() as u32
    }
}

impl SimGpu {
    /// Simulated boards whose settings live in this process alone (they end with it).
    pub fn new(config: SimConfig, clock: Arc<dyn Clock>) -> Result<SimGpu, SimError> {
        Self::build(config, clock, None)
    }

    /// Simulated boards whose settings live in the driver file at `driver`, as a real
    /// driver holds them: read from it at the start (what an earlier agent, a fence or a
    /// reboot left), every change written through, and read again whenever another process
    /// changed it, before a telemetry or workload window and before the settings are read.
    /// The file is created at the board defaults when there is none; one that describes
    /// other boards is refused.
    pub fn with_driver(
        config: SimConfig,
        clock: Arc<dyn Clock>,
        driver: &Path,
    ) -> Result<SimGpu, SimError> {
        Self::build(config, clock, Some(driver))
    }

    fn build(
        config: SimConfig,
        clock: Arc<dyn Clock>,
        driver_path: Option<&Path>,
    ) -> Result<SimGpu, SimError> {
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
        if scenario.requests.is_some() {
            let capacity = kv_positions_beside_weights(&profile, &scenario);
            let longest = scenario.longest_context_tokens();
            if f64::from(longest) > capacity {
                return Err(SimError::Invalid {
                    what: "scenario",
                    origin: format!("'{}' ({})", scenario.description, scenario.model_name),
                    problem: format!(
                        "its longest request ({longest} tokens: the largest prompt_tokens and \
                         output_tokens together) does not fit the KV cache {} holds beside \
                         {}'s weights ({capacity:.0} positions): lower the lengths' max, or \
                         pick a larger GPU",
                        profile.name, scenario.model_name
                    ),
                });
            }
        }
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
        let mut boards: Vec<GpuSim> = (0..gpus)
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
        let driver = match driver_path {
            None => None,
            Some(path) => {
                let (driver, seen) = SimDriver::open_for(path, &profile, gpus)?;
                let link = DriverLink {
                    driver,
                    seen,
                    problem: None,
                    profile: Arc::clone(&profile),
                    sm_clocks_mhz: profile.sm_clocks_mhz(),
                    mem_clocks_mhz: profile.mem_clocks_mhz(),
                    initial_batch: scenario.initial_batch_size,
                    batch_size_max,
                };
                let now_ns = u64::try_from(clock.now().as_nanos()).unwrap_or(u64::MAX);
                link.follow(&mut boards, now_ns);
                Some(link)
            }
        };
        Ok(SimGpu {
            state: Arc::new(Mutex::new(SimState {
                clock,
                gpus: boards,
                driver,
                helper: None,
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

    /// An independent copy of these boards as they stand now, on a virtual clock of its
    /// own set to now: what happens to the copy (settings, time) never reaches the
    /// original, and both go on drawing the same random streams from here. The judge's
    /// oracle tries settings on copies of one run, so each try starts from the queue the
    /// run carried in. Boards tied to a driver file are refused: a copy cannot own the
    /// file's settings beside the original ([`SimError::Fork`]).
    pub fn fork(&self) -> Result<(SimGpu, Arc<VirtualClock>), SimError> {
        let mut state = self.lock();
        if state.driver.is_some() {
            return Err(SimError::Fork);
        }
        let now = state.clock.now();
        // Every board caught up to now (and back from the helper thread).
        let count = state.count();
        for index in 0..count {
            let _ = state.gpu(index);
        }
        let clock = VirtualClock::new();
        clock.sleep_until(now);
        let copy = SimGpu {
            state: Arc::new(Mutex::new(SimState {
                clock: clock.clone(),
                gpus: state.gpus.clone(),
                driver: None,
                helper: None,
            })),
            profile: Arc::clone(&self.profile),
            scenario: Arc::clone(&self.scenario),
            devices: Arc::clone(&self.devices),
            batch_size_max: self.batch_size_max,
        };
        Ok((copy, clock))
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

#[cfg(test)]
mod tests;

/// KV-cache positions `profile`'s memory holds beside `scenario`'s weights.
pub fn kv_positions_beside_weights(profile: &GpuProfile, scenario: &Scenario) -> f64 {
    let usable =
        profile.memory_bytes() as f64 * (1.0 - tokwatt_core::model::MEMORY_RESERVE_FRACTION);
    let per_position = scenario.model.kv_cache_bytes(1, 1) as f64;
    ((usable - scenario.model.weight_bytes() as f64) / per_position).max(0.0)
}
