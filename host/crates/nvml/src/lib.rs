//! The NVML backend for real NVIDIA GPUs: telemetry ([`NvmlTelemetry`]), settings
//! ([`NvmlActuator`]) and the `gpus` report ([`list_gpus`]).
//!
//! This is the only module that knows nvml-wrapper. NVML is loaded at run time
//! (`libnvidia-ml.so.1`), so tokwatt builds and runs on machines without a GPU; there,
//! opening NVML fails with [`NvmlError::LibraryNotLoaded`] instead of panicking.
//!
//! GPUs are addressed by their position among the managed GPUs (0-based), which is also
//! the `index` in their [`DeviceInfo`]. When every GPU is managed (the default), the
//! position is NVML's index, as `nvidia-smi` shows it.

mod actuator;
mod report;
mod sampler;
mod telemetry;

use std::sync::Arc;
use std::time::Duration;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::Clock;
use nvml_wrapper::error::NvmlError as WrapperError;

pub use actuator::NvmlActuator;
pub use report::{ClockRange, GpuReport, GpuTable, list_gpus};
pub use sampler::NvmlWindow;
pub use telemetry::{NvmlCallCounts, NvmlTelemetry};

use tokwatt_core::telemetry::TelemetryError;
use tokwatt_core::types::DeviceInfo;

/// Why NVML could not be used.
#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    #[error(
        "NVML could not be loaded (libnvidia-ml.so.1): is the NVIDIA driver installed? On a machine without an NVIDIA GPU, use the simulated GPU instead ({detail})"
    )]
    LibraryNotLoaded { detail: String },
    #[error(
        "NVML loaded but the NVIDIA driver is not running: check that the nvidia kernel module is loaded (`nvidia-smi` should list the GPUs)"
    )]
    DriverNotLoaded,
    #[error(
        "NVML refused to talk to the driver: this user may not open the GPU device files (/dev/nvidia*); check their permissions or run in the group that owns them"
    )]
    AccessDenied,
    #[error("NVML failed to start: {0}")]
    Init(String),
    #[error("no NVIDIA GPU found: NVML reports 0 devices")]
    NoGpus,
    #[error(
        "GPU {index} was selected, but NVML reports {count} GPU(s) (indices 0 to {last})",
        last = .count.saturating_sub(1)
    )]
    NoSuchGpu { index: u32, count: u32 },
    #[error("GPU {index} was selected twice")]
    DuplicateGpu { index: u32 },
    #[error("reading {what} from GPU {index} failed: {reason}")]
    Query {
        index: u32,
        what: &'static str,
        reason: String,
    },
    #[error("the NVML sampling period must be between 1 ms and 10 s, got {0:?}")]
    SamplingPeriod(Duration),
    #[error(
        "the NVML gauges must be read every 1 or more samples, got tick gauges every {tick_gauges_every} and slow gauges every {slow_gauges_every}"
    )]
    SamplingEvery {
        tick_gauges_every: u32,
        slow_gauges_every: u32,
    },
    #[error("starting the NVML sampler thread failed: {0}")]
    SamplerThread(#[source] std::io::Error),
}

impl NvmlError {
    /// Whether this failure means "no NVIDIA driver here" (no library, or no driver
    /// running) as opposed to a driver that is present and failing: the first is a reason
    /// for a GPU test to skip, the second a reason for it to fail.
    pub fn means_no_driver(&self) -> bool {
        matches!(self, Self::LibraryNotLoaded { .. } | Self::DriverNotLoaded)
    }
}

impl From<NvmlError> for TelemetryError {
    fn from(error: NvmlError) -> Self {
        TelemetryError::Unavailable(error.to_string())
    }
}

/// Map NVML's error at initialisation to ours.
fn init_error(error: WrapperError) -> NvmlError {
    match error {
        WrapperError::LibloadingError(e) => NvmlError::LibraryNotLoaded {
            detail: e.to_string(),
        },
        WrapperError::FailedToLoadSymbol(detail) => NvmlError::LibraryNotLoaded { detail },
        WrapperError::LibraryNotFound => NvmlError::LibraryNotLoaded {
            detail: "NVML reported that a library it needs is missing".into(),
        },
        WrapperError::DriverNotLoaded => NvmlError::DriverNotLoaded,
        WrapperError::NoPermission => NvmlError::AccessDenied,
        other => NvmlError::Init(other.to_string()),
    }
}

fn query_error(index: u32, what: &'static str) -> impl FnOnce(WrapperError) -> NvmlError {
    move |error| NvmlError::Query {
        index,
        what,
        reason: error.to_string(),
    }
}

/// Load NVML and initialise it.
/// NVML and its GPU count, refusing a machine with none.
fn init_with_gpus() -> Result<(Nvml, u32), NvmlError> {
    let nvml = init()?;
    let count = nvml
        .device_count()
        .map_err(|e| NvmlError::Init(e.to_string()))?;
    if count == 0 {
        return Err(NvmlError::NoGpus);
    }
    Ok((nvml, count))
}

fn init() -> Result<Nvml, NvmlError> {
    Nvml::init().map_err(init_error)
}

/// How telemetry is sampled: which readings, how often.
///
/// Every NVML call costs CPU in the driver (about 0.4 ms of system time each on an H200,
/// 2026-12-01), so each reading is taken at the rate the observation needs it:
///
/// - every sample (`period`): the energy counter and the power readings, in one
///   `nvmlDeviceGetFieldValues` call where the GPU supports those fields. The energy of a
///   window is a counter difference, exact at any rate; the sampling rate only decides
///   how closely a window's end follows the tick and over how many instantaneous
///   readings the peak power is taken.
/// - every `tick_gauges_every`-th sample: the SM clock, the clock-event reasons and the
///   enforced power limit (what a policy acts on tick by tick). At about one reading per
///   tick the window's "median" clock is one reading and the clock-event reasons are
///   those in force at that reading, not the union over the whole window.
/// - every `slow_gauges_every`-th sample: temperature, utilisation, the memory clock and
///   the requested power limit, which move over seconds (utilisation is NVML's own
///   average over its sample period). Between readings a window reports the last one.
///
/// The first sample reads everything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SamplerConfig {
    /// Time between two fast readings (energy, power) of every GPU. NVML refreshes power
    /// and energy every 100 ms, so sampling faster only repeats values.
    pub period: Duration,
    /// The tick gauges are read at every this many samples (1: every sample).
    pub tick_gauges_every: u32,
    /// The slow gauges are read at every this many samples (1: every sample).
    pub slow_gauges_every: u32,
    /// Read the power fields (averaged, instantaneous and memory power) with the energy
    /// counter in one field-values call. `false`: the energy counter alone
    /// (`nvmlDeviceGetTotalEnergyConsumption`), and a window's peak power is the highest
    /// average between two energy readings.
    pub power_fields: bool,
}

impl Default for SamplerConfig {
    /// The rates for the default 1 s control tick.
    fn default() -> Self {
        Self::for_tick(Duration::from_secs(1))
    }
}

impl SamplerConfig {
    /// Fast samples per control tick: two, so that every window holds at least one
    /// energy reading even when the loop's tick and the sampler drift against each other.
    pub const SAMPLES_PER_TICK: u32 = 2;
    /// How often the slow gauges are read, at the most.
    pub const SLOW_GAUGES_PERIOD: Duration = Duration::from_secs(5);
    /// NVML refreshes energy and power every 100 ms: no sampling faster than that.
    const FASTEST: Duration = Duration::from_millis(100);

    /// The rates for a control loop with tick `tick`: [`Self::SAMPLES_PER_TICK`] fast
    /// samples per tick (no faster than NVML refreshes), the tick gauges once per tick,
    /// the slow gauges about every [`Self::SLOW_GAUGES_PERIOD`].
    pub fn for_tick(tick: Duration) -> Self {
        Self::with_samples_per_tick(tick, Self::SAMPLES_PER_TICK)
    }

    /// [`Self::for_tick`] with `samples_per_tick` fast samples per tick (at least 1).
    pub fn with_samples_per_tick(tick: Duration, samples_per_tick: u32) -> Self {
        let samples_per_tick = samples_per_tick.max(1);
        let period = (tick / samples_per_tick).clamp(Self::FASTEST, Duration::from_secs(10));
        // Rounded to the nearest whole number of samples, at least one.
        let every = |span: Duration| {
            let samples = span.as_secs_f64() / period.as_secs_f64();
            (samples.round() as u32).max(1)
        };
        Self {
            period,
            tick_gauges_every: every(tick),
            slow_gauges_every: every(Self::SLOW_GAUGES_PERIOD.max(tick)),
            power_fields: true,
        }
    }

    /// Every reading at every sample, every `period` (the old behaviour: for measurements
    /// that want the freshest counter, like `tokwatt bench workload`).
    pub fn everything_every(period: Duration) -> Self {
        Self {
            period,
            tick_gauges_every: 1,
            slow_gauges_every: 1,
            power_fields: true,
        }
    }

    /// The energy counter alone every `period`, the gauges almost never (once at the
    /// start, then every hour of samples): a counter for a workload to share energy over
    /// its requests, at one NVML call per sample.
    pub fn energy_only(period: Duration) -> Self {
        let hour = (3600.0 / period.as_secs_f64().max(1e-3)).ceil() as u32;
        Self {
            period,
            tick_gauges_every: hour.max(1),
            slow_gauges_every: hour.max(1),
            power_fields: false,
        }
    }

    fn validate(&self) -> Result<(), NvmlError> {
        if !(Duration::from_millis(1)..=Duration::from_secs(10)).contains(&self.period) {
            return Err(NvmlError::SamplingPeriod(self.period));
        }
        if self.tick_gauges_every == 0 || self.slow_gauges_every == 0 {
            return Err(NvmlError::SamplingEvery {
                tick_gauges_every: self.tick_gauges_every,
                slow_gauges_every: self.slow_gauges_every,
            });
        }
        Ok(())
    }
}

/// One managed GPU: where NVML finds it and what it is.
#[derive(Debug, Clone)]
struct ManagedGpu {
    nvml_index: u32,
    info: DeviceInfo,
    /// Whether NVML reports power-limit constraints (power management is supported).
    power_cap_supported: bool,
    /// Whether the architecture supports locked SM clocks (Volta and newer).
    sm_lock_supported: bool,
    /// Whether the architecture supports locked memory clocks (Ampere and newer).
    mem_lock_supported: bool,
}

/// NVML, opened once, and the GPUs tokwatt manages. Hands out telemetry and an actuator
/// that share the one NVML handle.
#[derive(Debug)]
pub struct NvmlSystem {
    nvml: Arc<Nvml>,
    gpus: Vec<ManagedGpu>,
}

impl NvmlSystem {
    /// Open NVML and read the facts of the selected GPUs (NVML indices; `None` = all).
    /// Reads only; changes nothing.
    pub fn open(selection: Option<&[u32]>) -> Result<Self, NvmlError> {
        let (nvml, count) = init_with_gpus()?;
        let indices = select(selection, count)?;
        let gpus = indices
            .into_iter()
            .enumerate()
            .map(|(position, nvml_index)| managed_gpu(&nvml, position as u32, nvml_index))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            nvml: Arc::new(nvml),
            gpus,
        })
    }

    /// NVML GPU `nvml_index` opened `copies` times, as `copies` managed GPUs: for measuring
    /// what sampling that many GPUs costs on a machine with fewer (`tokwatt bench
    /// agent-cpu --nvml-repeat`). Reads only. Never hand this to a real actuator: every
    /// copy is the same device.
    pub fn open_repeated(nvml_index: u32, copies: u32) -> Result<Self, NvmlError> {
        let (nvml, count) = init_with_gpus()?;
        let index = select(Some(&[nvml_index]), count)?[0];
        let gpus = (0..copies.max(1))
            .map(|position| managed_gpu(&nvml, position, index))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            nvml: Arc::new(nvml),
            gpus,
        })
    }

    /// The managed GPUs, in position order.
    pub fn devices(&self) -> Vec<DeviceInfo> {
        self.gpus.iter().map(|gpu| gpu.info.clone()).collect()
    }

    /// NVML's index of the GPU at `position`.
    pub fn nvml_index(&self, position: u32) -> Option<u32> {
        self.gpus.get(position as usize).map(|gpu| gpu.nvml_index)
    }

    /// Start sampling telemetry on a thread of its own.
    pub fn telemetry(&self, config: SamplerConfig) -> Result<NvmlTelemetry, NvmlError> {
        config.validate()?;
        NvmlTelemetry::start(Arc::clone(&self.nvml), &self.gpus, config)
    }

    /// An actuator for the managed GPUs. Creating it changes nothing.
    pub fn actuator(&self) -> NvmlActuator {
        NvmlActuator::new(Arc::clone(&self.nvml), &self.gpus)
    }
}

/// The NVML indices to manage, validated.
fn select(selection: Option<&[u32]>, count: u32) -> Result<Vec<u32>, NvmlError> {
    let Some(selection) = selection else {
        return Ok((0..count).collect());
    };
    let mut chosen = Vec::with_capacity(selection.len());
    for &index in selection {
        if index >= count {
            return Err(NvmlError::NoSuchGpu { index, count });
        }
        if chosen.contains(&index) {
            return Err(NvmlError::DuplicateGpu { index });
        }
        chosen.push(index);
    }
    if chosen.is_empty() {
        return Err(NvmlError::NoGpus);
    }
    Ok(chosen)
}

fn managed_gpu(nvml: &Nvml, position: u32, nvml_index: u32) -> Result<ManagedGpu, NvmlError> {
    let device = nvml
        .device_by_index(nvml_index)
        .map_err(query_error(nvml_index, "the device handle"))?;
    let uuid = device.uuid().map_err(query_error(nvml_index, "the UUID"))?;
    let name = device.name().map_err(query_error(nvml_index, "the name"))?;

    let constraints = device.power_management_limit_constraints().ok();
    let watts = |mw: u32| f64::from(mw) / 1000.0;
    // Without power management there is nothing to cap; report the limit in force.
    let fallback_w = device
        .enforced_power_limit()
        .or_else(|_| device.power_management_limit())
        .map_or(0.0, watts);
    let default_w = device
        .power_management_limit_default()
        .map_or(fallback_w, watts);

    let mut mem_clocks = device.supported_memory_clocks().unwrap_or_default();
    sort_highest_first(&mut mem_clocks);
    let mut sm_clocks = mem_clocks
        .first()
        .and_then(|&top| device.supported_graphics_clocks(top).ok())
        .unwrap_or_default();
    sort_highest_first(&mut sm_clocks);

    let arch = device.architecture().ok();
    let at_least = |minimum: nvml_wrapper::enums::device::DeviceArchitecture| {
        // Unknown architectures are newer than the wrapper: assume support and let NVML say.
        arch.as_ref()
            .is_none_or(|arch| arch.as_c() >= minimum.as_c())
    };
    use nvml_wrapper::enums::device::DeviceArchitecture::{Ampere, Volta};

    Ok(ManagedGpu {
        nvml_index,
        power_cap_supported: constraints.is_some(),
        sm_lock_supported: at_least(Volta),
        mem_lock_supported: at_least(Ampere),
        info: DeviceInfo {
            index: position,
            uuid,
            name,
            simulated: false,
            power_cap_min_w: constraints
                .as_ref()
                .map_or(fallback_w, |c| watts(c.min_limit)),
            power_cap_max_w: constraints
                .as_ref()
                .map_or(fallback_w, |c| watts(c.max_limit)),
            power_cap_default_w: default_w,
            sm_clocks_mhz: sm_clocks,
            mem_clocks_mhz: mem_clocks,
        },
    })
}

fn sort_highest_first(clocks: &mut Vec<u32>) {
    clocks.sort_unstable_by(|a, b| b.cmp(a));
    clocks.dedup();
}

/// The current SM clock, for logs after a clock change.
fn current_sm_clock(device: &nvml_wrapper::Device<'_>) -> Option<u32> {
    device.clock_info(Clock::SM).ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    /// NVML is absent on build machines; tests that need it say so and return. A
    /// driver that is present but fails is a failure, not a skip.
    pub(crate) fn nvml_or_skip() -> Option<NvmlSystem> {
        match NvmlSystem::open(None) {
            Ok(system) => Some(system),
            Err(error) if error.means_no_driver() => {
                tokwatt_test_support::skip_gpu(format_args!("NVML not available: {error}"));
                None
            }
            Err(error) => panic!("NVML is installed but failed: {error}"),
        }
    }

    #[test]
    fn no_driver_is_only_a_missing_driver() {
        assert!(
            NvmlError::LibraryNotLoaded {
                detail: String::new()
            }
            .means_no_driver()
        );
        assert!(NvmlError::DriverNotLoaded.means_no_driver());
        assert!(!NvmlError::AccessDenied.means_no_driver());
        assert!(!NvmlError::NoGpus.means_no_driver());
    }

    #[test]
    fn opening_without_a_driver_fails_cleanly_or_lists_gpus() {
        match NvmlSystem::open(None) {
            Ok(system) => {
                let devices = system.devices();
                assert!(!devices.is_empty());
                for (position, device) in devices.iter().enumerate() {
                    assert_eq!(device.index as usize, position);
                    assert!(device.power_cap_min_w <= device.power_cap_max_w);
                    assert!(device.sm_clocks_mhz.windows(2).all(|w| w[0] > w[1]));
                }
            }
            Err(NvmlError::LibraryNotLoaded { detail }) => {
                let message = NvmlError::LibraryNotLoaded { detail }.to_string();
                assert!(message.starts_with("NVML could not be loaded (libnvidia-ml.so.1)"));
                assert!(message.contains("is the NVIDIA driver installed?"));
                tokwatt_test_support::skip_gpu(format_args!("the GPU checks: {message}"));
            }
            Err(NvmlError::DriverNotLoaded) => {
                tokwatt_test_support::skip_gpu("NVML loaded but no NVIDIA driver is running");
            }
            Err(other) => panic!("NVML is installed but failed: {other}"),
        }
    }

    #[test]
    fn selection_is_validated() {
        assert_eq!(select(None, 3).unwrap(), vec![0, 1, 2]);
        assert_eq!(select(Some(&[2, 0]), 3).unwrap(), vec![2, 0]);
        assert!(matches!(
            select(Some(&[3]), 3),
            Err(NvmlError::NoSuchGpu { index: 3, count: 3 })
        ));
        assert!(matches!(
            select(Some(&[1, 1]), 3),
            Err(NvmlError::DuplicateGpu { index: 1 })
        ));
        assert!(matches!(select(Some(&[]), 3), Err(NvmlError::NoGpus)));
        let message = NvmlError::NoSuchGpu { index: 4, count: 2 }.to_string();
        assert!(message.contains("indices 0 to 1"), "{message}");
    }

    #[test]
    fn sampling_rates_are_validated() {
        assert!(SamplerConfig::default().validate().is_ok());
        let zero = SamplerConfig {
            period: Duration::ZERO,
            ..SamplerConfig::default()
        };
        assert!(matches!(zero.validate(), Err(NvmlError::SamplingPeriod(_))));
        let never = SamplerConfig {
            slow_gauges_every: 0,
            ..SamplerConfig::default()
        };
        let error = never.validate().unwrap_err();
        assert!(matches!(error, NvmlError::SamplingEvery { .. }));
        assert!(error.to_string().contains("slow gauges every 0"), "{error}");
    }

    #[test]
    fn sampling_follows_the_control_tick() {
        let ms = Duration::from_millis;
        // The default tick: two fast samples per tick, the tick gauges once per tick,
        // the slow gauges every 5 s.
        assert_eq!(
            SamplerConfig::for_tick(Duration::from_secs(1)),
            SamplerConfig {
                period: ms(500),
                tick_gauges_every: 2,
                slow_gauges_every: 10,
                power_fields: true,
            }
        );
        assert_eq!(SamplerConfig::default(), SamplerConfig::for_tick(ms(1000)));
        // A short tick: never faster than NVML refreshes (100 ms).
        assert_eq!(
            SamplerConfig::for_tick(ms(100)),
            SamplerConfig {
                period: ms(100),
                tick_gauges_every: 1,
                slow_gauges_every: 50,
                power_fields: true,
            }
        );
        // A long tick: the slow gauges at least once per tick.
        assert_eq!(
            SamplerConfig::for_tick(Duration::from_secs(10)),
            SamplerConfig {
                period: Duration::from_secs(5),
                tick_gauges_every: 2,
                slow_gauges_every: 2,
                power_fields: true,
            }
        );
        assert_eq!(
            SamplerConfig::with_samples_per_tick(Duration::from_secs(1), 4),
            SamplerConfig {
                period: ms(250),
                tick_gauges_every: 4,
                slow_gauges_every: 20,
                power_fields: true,
            }
        );
        for tick in [
            ms(100),
            ms(250),
            ms(1000),
            ms(3000),
            Duration::from_secs(30),
        ] {
            assert!(SamplerConfig::for_tick(tick).validate().is_ok(), "{tick:?}");
        }
    }

    #[test]
    fn clocks_sort_highest_first_without_repeats() {
        let mut clocks = vec![345, 1980, 1965, 1980, 360];
        sort_highest_first(&mut clocks);
        assert_eq!(clocks, vec![1980, 1965, 360, 345]);
    }

    #[test]
    fn library_errors_name_the_library_and_the_fix() {
        let error = init_error(WrapperError::FailedToLoadSymbol("nvmlInit_v2".into()));
        let message = error.to_string();
        assert!(message.contains("libnvidia-ml.so.1"), "{message}");
        assert!(message.contains("nvmlInit_v2"), "{message}");
        assert!(matches!(
            init_error(WrapperError::DriverNotLoaded),
            NvmlError::DriverNotLoaded
        ));
        assert!(matches!(
            init_error(WrapperError::NoPermission),
            NvmlError::AccessDenied
        ));
    }
}
