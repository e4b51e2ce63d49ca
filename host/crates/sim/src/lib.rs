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

mod arrivals;
pub mod driver;
mod gpu;
pub mod lengths;
pub mod model;
pub mod profile;
pub mod scenario;
mod serving;

#[cfg(test)]
mod calibration;
#[cfg(test)]
mod prefill_tests;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

pub use arrivals::ScenarioArrivals;
pub use driver::{BoardSettings, DriverError, DriverState, SimDriver};
pub use gpu::SimTruth;
pub use lengths::LengthDist;
pub use model::{DecodeCost, DecodeModel, ModelShape};
pub use profile::GpuProfile;
pub use scenario::{Phase, RequestLengths, Scenario};

use driver::Snapshot;
use gpu::GpuSim;
use tokwatt_core::actuator::{Actuator, ActuatorError, Capabilities, GpuSettings, accepts};
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
    /// The simulated driver's file cannot be opened, or describes other boards.
    #[error(transparent)]
    Driver(#[from] DriverError),
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

/// Boards caught up together by two threads at least this many substeps (a second of
/// simulated time on the built-in profiles): shorter catch-ups (a real-time run's) stay on
/// the caller's thread, where a hand-over would cost more than it saves.
const PARALLEL_MIN_SUBSTEPS: u64 = 32;

/// A thread that advances boards beside the caller. Both take boards one at a time from a
/// shared pool until it is empty, so a helper that wakes late (a busy machine) leaves its
/// share to the caller instead of holding it up. The boards are independent (each its own
/// random streams), so which thread advances one changes nothing of what it simulates.
#[derive(Debug)]
struct Helper {
    shared: Arc<HandOver>,
    thread: std::thread::JoinHandle<()>,
}

#[derive(Debug, Default)]
struct HandOver {
    /// Boards still to advance, with their places.
    todo: Mutex<Vec<(usize, GpuSim)>>,
    /// Boards advanced, with their places.
    done: Mutex<Vec<(usize, GpuSim)>>,
    now_ns: std::sync::atomic::AtomicU64,
    /// Raised for every catch-up; the helper works whenever it sees a new one.
    generation: std::sync::atomic::AtomicU64,
    /// Boards handed out and not yet back in `done`.
    pending: std::sync::atomic::AtomicUsize,
    closed: std::sync::atomic::AtomicBool,
}

/// How long the helper spins for the next catch-up before it sleeps.
const SPIN: std::time::Duration = std::time::Duration::from_micros(50);

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl HandOver {
    /// Advance boards from the pool until it is empty.
    fn work(&self) {
        let now_ns = self.now_ns.load(Ordering::Acquire);
        loop {
            let Some((place, mut board)) = locked(&self.todo).pop() else {
                return;
            };
            board.advance_to(now_ns);
            locked(&self.done).push((place, board));
            self.pending.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Helper {
    fn start() -> Option<Helper> {
        let shared = Arc::new(HandOver::default());
        let theirs = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("tokwatt-sim".into())
            .spawn(move || helper_loop(&theirs))
            .map_err(|error| {
                tracing::warn!("the simulation runs on one thread (no helper thread: {error})");
            })
            .ok()?;
        Some(Helper { shared, thread })
    }

    /// Every board of `boards` advanced to `now_ns`, by this thread and the helper, in
    /// their places; `None` if the helper stopped holding one (a panic in a board).
    fn advance(&self, boards: Vec<GpuSim>, now_ns: u64) -> Option<Vec<GpuSim>> {
        let count = boards.len();
        let shared = &self.shared;
        shared.now_ns.store(now_ns, Ordering::Release);
        shared.pending.store(count, Ordering::Release);
        *locked(&shared.todo) = boards.into_iter().enumerate().rev().collect();
        shared.generation.fetch_add(1, Ordering::AcqRel);
        self.thread.thread().unpark();
        shared.work();
        let mut spins = 0u32;
        while shared.pending.load(Ordering::Acquire) > 0 {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                if self.thread.is_finished() {
                    return None;
                }
                std::thread::yield_now();
            }
            std::hint::spin_loop();
        }
        let mut done = std::mem::take(&mut *locked(&shared.done));
        done.sort_unstable_by_key(|(place, _)| *place);
        Some(done.into_iter().map(|(_, board)| board).collect())
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.thread.thread().unpark();
    }
}

fn helper_loop(shared: &HandOver) {
    let mut seen = 0;
    loop {
        let idle_since = std::time::Instant::now();
        let mut spins = 0u32;
        loop {
            if shared.closed.load(Ordering::Acquire) {
                return;
            }
            let generation = shared.generation.load(Ordering::Acquire);
            if generation != seen {
                seen = generation;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && idle_since.elapsed() > SPIN {
                std::thread::park_timeout(std::time::Duration::from_millis(50));
            } else if spins.is_multiple_of(16) {
                // A thread that has work (the run's output writer) gets this core.
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        shared.work();
    }
}

/// A simulation's link to its driver file.
#[derive(Debug)]
struct DriverLink {
    driver: SimDriver,
    /// The version of the file the boards run on.
    seen: Snapshot,
    /// The last problem reading the file (reported once, not every tick), and the bytes it
    /// was found in (not checked again while the file holds them).
    problem: Option<(String, Option<Vec<u8>>)>,
    profile: Arc<GpuProfile>,
    sm_clocks_mhz: Vec<u32>,
    mem_clocks_mhz: Vec<u32>,
    /// The batch of a board whose driver holds none (the workload's own).
    initial_batch: u32,
    batch_size_max: u32,
}

impl DriverLink {
    /// Bring every board to the settings of the version read last: each one that differs
    /// is first caught up to `now_ns` under its old settings, so a change made by another
    /// process applies from now on, never to the time before it was seen.
    fn follow(&self, gpus: &mut [GpuSim], now_ns: u64) {
        for (board, wanted) in gpus.iter_mut().zip(&self.seen.state.boards) {
            let sm_lock = wanted
                .sm_clock_lock_mhz
                .and_then(|(lo, hi)| accepts::clock_lock(&self.sm_clocks_mhz, lo, hi).ok());
            let mem_lock = wanted
                .mem_clock_lock_mhz
                .and_then(|(lo, hi)| accepts::clock_lock(&self.mem_clocks_mhz, lo, hi).ok());
            let batch = wanted
                .batch_size
                .unwrap_or(self.initial_batch)
                .clamp(1, self.batch_size_max);
            let now = board.settings();
            if now.power_cap_w == wanted.power_cap_w
                && now.sm_clock_lock_mhz == sm_lock
                && now.mem_clock_lock_mhz == mem_lock
                && board.batch_size() == batch
            {
                continue;
            }
            board.advance_to(now_ns);
            board.set_power_cap(wanted.power_cap_w);
            board.set_sm_lock(sm_lock);
            let mem_mhz = mem_lock
                .map(|(_, hi)| hi)
                .or_else(|| self.mem_clocks_mhz.first().copied())
                .unwrap_or(0);
            board.set_mem_lock(mem_lock, mem_mhz);
            board.set_batch_size(batch);
        }
    }

    /// Read the file again if another process changed it since (one read while it did
    /// not); `false` when it cannot be read or no longer fits the boards (the boards keep
    /// the settings last read, and the problem is logged once).
    fn reread(&mut self) -> bool {
        let raw = match self.driver.raw() {
            Ok(raw) => raw,
            Err(e) => {
                self.report(e, None);
                return false;
            }
        };
        let refused = self.problem.as_ref().and_then(|(_, raw)| raw.as_deref());
        if raw == self.seen.raw() || refused == Some(raw.as_slice()) {
            return false;
        }
        let count = self.seen.state.boards.len() as u32;
        let read = self.driver.snapshot().and_then(|snapshot| {
            self.driver
                .check_fits(&snapshot.state, &self.profile, count)
                .map(|()| snapshot)
        });
        match read {
            Ok(snapshot) => {
                self.seen = snapshot;
                self.problem = None;
                true
            }
            Err(e) => {
                self.report(e, Some(raw));
                false
            }
        }
    }

    fn report(&mut self, error: DriverError, raw: Option<Vec<u8>>) {
        let text = error.to_string();
        if self.problem.as_ref().map(|(said, _)| said.as_str()) != Some(text.as_str()) {
            tracing::warn!("the simulated boards keep the settings last read: {text}");
        }
        self.problem = Some((text, raw));
    }
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

    /// With two boards or more and a catch-up of at least [`PARALLEL_MIN_SUBSTEPS`], the
    /// boards are advanced by this thread and the helper together; they are back in their
    /// places, in order, when it returns.
    fn catch_up_in_parallel(&mut self, now_ns: u64) {
        if self.gpus.len() < 2
            || self
                .gpus
                .iter()
                .all(|board| board.substeps_behind(now_ns) < PARALLEL_MIN_SUBSTEPS)
        {
            return;
        }
        if self.helper.is_none() {
            self.helper = Helper::start();
        }
        let Some(helper) = &self.helper else {
            return;
        };
        let boards = std::mem::take(&mut self.gpus);
        match helper.advance(boards, now_ns) {
            Some(boards) => self.gpus = boards,
            // It stopped holding a board: only a panic in a board does that, and that is a
            // bug here as it would be on this thread.
            None => panic!("the simulation's helper thread stopped with a board"),
        }
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

    /// Change board `gpu`'s settings (see [`SimState::change`]); a driver that cannot be
    /// written fails the change as a real driver's error would.
    fn change(
        &self,
        gpu: u32,
        what: &'static str,
        in_driver: impl FnOnce(&mut BoardSettings),
        on_board: impl FnOnce(&mut GpuSim),
    ) -> Result<GpuSettings, ActuatorError> {
        let mut state = self.sim.lock();
        match state.change(gpu, in_driver, on_board) {
            Ok(board) => Ok(board.settings()),
            Err(ChangeError::NoSuchGpu { count }) => {
                Err(ActuatorError::NoSuchGpu { index: gpu, count })
            }
            Err(ChangeError::Driver(e)) => Err(ActuatorError::Failed {
                gpu,
                what,
                reason: e.to_string(),
            }),
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
        // The rule every backend shares, NVML's.
        if let Err(refused) = accepts::power_cap_milliwatts(range.min_w, range.max_w, watts) {
            let count = self.sim.devices.len() as u32;
            if gpu >= count {
                return Err(ActuatorError::NoSuchGpu { index: gpu, count });
            }
            return Err(ActuatorError::Failed {
                gpu,
                what: "power cap",
                reason: refused.to_string(),
            });
        }
        let settings = self.change(
            gpu,
            "power cap",
            |driver| driver.power_cap_w = gpu::milliwatts(watts),
            |board| {
                board.set_power_cap(watts);
            },
        )?;
        Ok(settings.power_cap_enforced_w)
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
        self.change(
            gpu,
            "SM clock lock",
            |driver| driver.sm_clock_lock_mhz = effective,
            |board| board.set_sm_lock(effective),
        )
        .map(|_| ())
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
        self.change(
            gpu,
            "memory clock lock",
            |driver| driver.mem_clock_lock_mhz = effective,
            |board| {
                let mem_mhz = effective
                    .map(|(_, hi)| hi)
                    .or_else(|| board.mem_grid().first().copied())
                    .unwrap_or(0);
                board.set_mem_lock(effective, mem_mhz);
            },
        )
        .map(|_| ())
    }
}

/// The supported clocks a requested lock range covers, or the error NVML gives: the rule
/// every backend shares ([`accepts::clock_lock`]).
fn checked_lock(
    gpu: u32,
    what: &'static str,
    supported: &[u32],
    lo: u32,
    hi: u32,
) -> Result<(u32, u32), ActuatorError> {
    accepts::clock_lock(supported, lo, hi).map_err(|refused| ActuatorError::Failed {
        gpu,
        what,
        reason: refused.to_string(),
    })
}

#[derive(Debug)]
struct SimWorkload {
    sim: SimGpu,
}

impl Workload for SimWorkload {
    /// Both layouts see each request through: its first token is timed (a prefill's
    /// last chunk, or a decode-only request's first step).
    fn reports_ttft(&self) -> bool {
        true
    }

    fn reports_requests(&self) -> bool {
        true
    }

    fn take_finished_requests(
        &mut self,
        gpu: u32,
        into: &mut tokwatt_core::workload::FinishedRequests,
    ) {
        if let Some(board) = self.sim.lock().gpu(gpu) {
            board.take_finished_requests(into);
        }
    }

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
        if gpu >= count {
            return Err(WorkloadError::NoSuchGpu { index: gpu, count });
        }
        if !(1..=max).contains(&batch) {
            return Err(WorkloadError::BatchOutOfRange {
                requested: batch,
                max,
            });
        }
        match state.change(
            gpu,
            |driver| driver.batch_size = Some(batch),
            |board| board.set_batch_size(batch),
        ) {
            Ok(_) => Ok(()),
            Err(ChangeError::NoSuchGpu { count }) => {
                Err(WorkloadError::NoSuchGpu { index: gpu, count })
            }
            Err(ChangeError::Driver(e)) => Err(WorkloadError::Failed(format!(
                "the simulated driver did not take batch size {batch} on GPU {gpu}: {e}"
            ))),
        }
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

/// KV-cache positions `profile`'s memory holds beside `scenario`'s weights.
pub fn kv_positions_beside_weights(profile: &GpuProfile, scenario: &Scenario) -> f64 {
    let usable =
        profile.memory_bytes() as f64 * (1.0 - tokwatt_core::model::MEMORY_RESERVE_FRACTION);
    let per_position = scenario.model.kv_cache_bytes(1, 1) as f64;
    ((usable - scenario.model.weight_bytes() as f64) / per_position).max(0.0)
}
