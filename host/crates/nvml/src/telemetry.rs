//! NVML telemetry: the NVML [`SampleSource`] and [`NvmlTelemetry`], which runs it on the
//! sampler thread.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use nvml_wrapper::bitmasks::device::ThrottleReasons;
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::error::{NvmlError as WrapperError, nvml_try};
use nvml_wrapper::struct_wrappers::device::FieldValueSample;
use nvml_wrapper::sys_exports::field_id::{
    NVML_FI_DEV_POWER_AVERAGE, NVML_FI_DEV_POWER_INSTANT, NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION,
};
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    NVML_POWER_SCOPE_GPU, NVML_POWER_SCOPE_MEMORY, nvmlDevice_t, nvmlFieldValue_t,
};

use super::sampler::{Due, NvmlWindow, Sample, SampleError, SampleSource, Sampler};
use super::{ManagedGpu, NvmlError, SamplerConfig, query_error};
use tokwatt_core::telemetry::{Telemetry, TelemetryError};
use tokwatt_core::types::{ClockEvents, DeviceInfo};

/// Telemetry from NVML. A thread of its own reads every GPU at the rates of its
/// [`SamplerConfig`] (each NVML call costs CPU in the driver and can take milliseconds);
/// [`Telemetry::read_window`] only takes what has accumulated, so the control loop never
/// waits on NVML. The thread stops when this is dropped.
#[derive(Debug)]
pub struct NvmlTelemetry {
    devices: Vec<DeviceInfo>,
    sampler: Sampler,
    calls: NvmlCallCounts,
}

impl NvmlTelemetry {
    pub(super) fn start(
        nvml: Arc<Nvml>,
        gpus: &[ManagedGpu],
        config: SamplerConfig,
    ) -> Result<Self, NvmlError> {
        let mut source = NvmlSource::new(nvml, gpus)?;
        source.power_fields = config.power_fields;
        let calls = source.calls.clone();
        let sampler = Sampler::start(source, config).map_err(NvmlError::SamplerThread)?;
        Ok(Self {
            devices: gpus.iter().map(|gpu| gpu.info.clone()).collect(),
            sampler,
            calls,
        })
    }

    /// The NVML calls the sampler has made so far, per GPU (shared: it keeps counting).
    pub fn call_counts(&self) -> NvmlCallCounts {
        self.calls.clone()
    }

    /// The window of GPU `gpu` with the readings only NVML has (memory power, requested
    /// limit, error counts). [`Telemetry::read_window`] returns its `window` part.
    pub fn read_window_detailed(&mut self, gpu: u32) -> Result<NvmlWindow, TelemetryError> {
        self.sampler
            .take_window(gpu as usize)
            .ok_or(TelemetryError::NoSuchGpu {
                index: gpu,
                count: self.sampler.gpu_count() as u32,
            })
    }
}

impl Telemetry for NvmlTelemetry {
    fn devices(&self) -> Vec<DeviceInfo> {
        self.devices.clone()
    }

    fn read_window(
        &mut self,
        gpu: u32,
    ) -> Result<tokwatt_core::types::TelemetryWindow, TelemetryError> {
        self.read_window_detailed(gpu).map(|detailed| {
            let mut window = detailed.window;
            window.power_limit_requested_w = detailed.power_limit_requested_w;
            window.power_mem_avg_w = detailed.mem_power_avg_w;
            window
        })
    }
}

/// Map NVML's clock-event reasons to the ones a policy acts on. Sync boost and display
/// clock settings have no counterpart and are left out.
pub(super) fn clock_events(reasons: ThrottleReasons) -> ClockEvents {
    ClockEvents {
        gpu_idle: reasons.contains(ThrottleReasons::GPU_IDLE),
        sw_power_cap: reasons.contains(ThrottleReasons::SW_POWER_CAP),
        hw_slowdown: reasons
            .intersects(ThrottleReasons::HW_SLOWDOWN | ThrottleReasons::HW_POWER_BRAKE_SLOWDOWN),
        sw_thermal: reasons.contains(ThrottleReasons::SW_THERMAL_SLOWDOWN),
        hw_thermal: reasons.contains(ThrottleReasons::HW_THERMAL_SLOWDOWN),
        // Locked clocks and application clocks both report this bit.
        clock_setting: reasons.contains(ThrottleReasons::APPLICATIONS_CLOCKS_SETTING),
    }
}

/// How many NVML calls the sampler made, per managed GPU (for `tokwatt bench agent-cpu`
/// and anyone who wants to see what telemetry costs). Cheap to clone; counts keep rising
/// while the sampler runs.
#[derive(Debug, Clone, Default)]
pub struct NvmlCallCounts {
    per_gpu: Arc<[AtomicU64]>,
}

impl NvmlCallCounts {
    fn new(gpus: usize) -> Self {
        Self {
            per_gpu: (0..gpus).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Calls made for each GPU so far, by position.
    pub fn per_gpu(&self) -> Vec<u64> {
        self.per_gpu
            .iter()
            .map(|calls| calls.load(Ordering::Relaxed))
            .collect()
    }

    /// Calls made for all GPUs so far.
    pub fn total(&self) -> u64 {
        self.per_gpu().iter().sum()
    }

    fn add(&self, gpu: usize) {
        if let Some(calls) = self.per_gpu.get(gpu) {
            calls.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Reads the managed GPUs through NVML.
struct NvmlSource {
    nvml: Arc<Nvml>,
    gpus: Vec<SourceGpu>,
    calls: NvmlCallCounts,
    /// Read the power fields with the energy counter ([`SamplerConfig::power_fields`]).
    power_fields: bool,
}

/// A device handle looked up once, when sampling starts, instead of once per sample.
struct CachedHandle(nvmlDevice_t);

// SAFETY: an NVML device handle is an opaque identifier, valid on any thread for as long
// as the NVML session that issued it (held by `NvmlSource::nvml`); NVML is thread-safe.
unsafe impl Send for CachedHandle {}

struct SourceGpu {
    nvml_index: u32,
    handle: CachedHandle,
    /// Readings this GPU answered `NotSupported` to: no longer asked for.
    unsupported: HashSet<&'static str>,
}

impl SourceGpu {
    /// Keep a reading's value, or note why it is missing. A reading the GPU does not
    /// support is dropped from later samples (logged once) instead of failing every time.
    fn keep<T>(
        &mut self,
        what: &'static str,
        result: Result<T, WrapperError>,
        errors: &mut Vec<SampleError>,
    ) -> Option<T> {
        match result {
            Ok(value) => Some(value),
            Err(WrapperError::NotSupported) => {
                if self.unsupported.insert(what) {
                    tracing::info!(
                        nvml_index = self.nvml_index,
                        "this GPU does not report {what}; it is left out of the telemetry"
                    );
                }
                None
            }
            Err(error) => {
                errors.push(SampleError {
                    what,
                    reason: error.to_string(),
                });
                None
            }
        }
    }

    fn wants(&self, what: &'static str) -> bool {
        !self.unsupported.contains(what)
    }
}

const FIELDS: &str = "energy and power (one field-values call)";
const ENERGY_FIELD: &str = "the energy counter (field 83)";
const ENERGY: &str = "the energy counter";
const POWER_AVG: &str = "averaged power (field 185)";
const POWER_INSTANT: &str = "instantaneous power (field 186)";
const POWER_USAGE: &str = "the power usage";
const MEM_POWER: &str = "memory power (field 185, memory scope)";
const SM_CLOCK: &str = "the SM clock";
const MEM_CLOCK: &str = "the memory clock";
const TEMPERATURE: &str = "the temperature";
const UTILISATION: &str = "the utilisation";
const CLOCK_EVENTS: &str = "the clock-event reasons";
const LIMIT_REQUESTED: &str = "the requested power limit";
const LIMIT_ENFORCED: &str = "the enforced power limit";

impl NvmlSource {
    fn new(nvml: Arc<Nvml>, gpus: &[ManagedGpu]) -> Result<Self, NvmlError> {
        let gpus = gpus
            .iter()
            .map(|gpu| {
                let device = nvml
                    .device_by_index(gpu.nvml_index)
                    .map_err(query_error(gpu.nvml_index, "the device handle"))?;
                Ok(SourceGpu {
                    nvml_index: gpu.nvml_index,
                    // SAFETY: reading the raw handle out of a valid `Device` is sound; it
                    // is used only while `nvml` lives (see `CachedHandle`).
                    handle: CachedHandle(unsafe { device.handle() }),
                    unsupported: HashSet::new(),
                })
            })
            .collect::<Result<Vec<_>, NvmlError>>()?;
        Ok(Self {
            calls: NvmlCallCounts::new(gpus.len()),
            nvml,
            gpus,
            power_fields: true,
        })
    }
}

impl SampleSource for NvmlSource {
    fn gpu_count(&self) -> usize {
        self.gpus.len()
    }

    fn sample(&mut self, gpu: usize, due: Due, errors: &mut Vec<SampleError>) -> Sample {
        let nvml = &*self.nvml;
        let calls = &self.calls;
        let power_fields = self.power_fields;
        let Some(state) = self.gpus.get_mut(gpu) else {
            return Sample::default();
        };
        // SAFETY: the handle was issued by `nvml`, which is initialised and outlives this
        // call (see `CachedHandle`).
        let device = unsafe { Device::new(state.handle.0, nvml) };
        // One NVML call for a reading the GPU supports; none for one it does not.
        let read = |state: &mut SourceGpu,
                    what: &'static str,
                    errors: &mut Vec<SampleError>,
                    call: &dyn Fn() -> Result<u32, WrapperError>| {
            if !state.wants(what) {
                return None;
            }
            calls.add(gpu);
            state.keep(what, call(), errors)
        };
        let mut sample = Sample::default();

        // Energy and power first, in one call: the sample's timestamp is taken just
        // before it.
        let fields: Vec<Field> = Field::ALL
            .into_iter()
            .filter(|field| state.wants(field.what()))
            .collect();
        let use_fields = power_fields && state.wants(FIELDS) && !fields.is_empty();
        if use_fields {
            calls.add(gpu);
            if let Some(values) = state.keep(FIELDS, read_fields(nvml, &device, &fields), errors) {
                for (field, value) in fields.into_iter().zip(values) {
                    match field {
                        Field::Energy => {
                            sample.energy_mj =
                                state.keep(field.what(), value.and_then(millijoules), errors);
                        }
                        Field::PowerAverage => {
                            sample.power_avg_mw =
                                state.keep(field.what(), value.and_then(milliwatts), errors);
                        }
                        Field::PowerInstant => {
                            sample.power_instant_mw =
                                state.keep(field.what(), value.and_then(milliwatts), errors);
                        }
                        Field::MemoryPowerAverage => {
                            sample.mem_power_avg_mw =
                                state.keep(field.what(), value.and_then(milliwatts), errors);
                        }
                    }
                }
            }
        }
        // A GPU without the energy field (or without field values at all) has the energy
        // counter's own call; one without field 185 (GPUs before Ampere, and the A100)
        // has nvmlDeviceGetPowerUsage, the averaged reading there is.
        let answers =
            |state: &SourceGpu, field: &'static str| state.wants(FIELDS) && state.wants(field);
        if (!use_fields || !answers(state, ENERGY_FIELD)) && state.wants(ENERGY) {
            calls.add(gpu);
            sample.energy_mj = state.keep(ENERGY, device.total_energy_consumption(), errors);
        }
        if power_fields && !answers(state, POWER_AVG) {
            sample.power_avg_mw = read(state, POWER_USAGE, errors, &|| device.power_usage());
        }

        if due.tick_gauges {
            sample.sm_clock_mhz = read(state, SM_CLOCK, errors, &|| device.clock_info(Clock::SM));
            sample.power_limit_enforced_mw = read(state, LIMIT_ENFORCED, errors, &|| {
                device.enforced_power_limit()
            });
            if state.wants(CLOCK_EVENTS) {
                calls.add(gpu);
                sample.clock_events = state
                    .keep(CLOCK_EVENTS, device.current_throttle_reasons(), errors)
                    .map(clock_events);
            }
        }
        if due.slow_gauges {
            sample.mem_clock_mhz = read(state, MEM_CLOCK, errors, &|| {
                device.clock_info(Clock::Memory)
            });
            sample.temperature_c = read(state, TEMPERATURE, errors, &|| {
                device.temperature(TemperatureSensor::Gpu)
            });
            sample.power_limit_requested_mw = read(state, LIMIT_REQUESTED, errors, &|| {
                device.power_management_limit()
            });
            sample.gpu_util_pct = read(state, UTILISATION, errors, &|| {
                device
                    .utilization_rates()
                    .map(|utilisation| utilisation.gpu)
            });
        }
        sample
    }
}

/// The fields read in the one `nvmlDeviceGetFieldValues` call of every sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Energy,
    PowerAverage,
    PowerInstant,
    MemoryPowerAverage,
}

impl Field {
    const ALL: [Field; 4] = [
        Self::Energy,
        Self::PowerAverage,
        Self::PowerInstant,
        Self::MemoryPowerAverage,
    ];

    /// (field id, scope id) as `nvmlFieldValue_t` wants them.
    fn request(self) -> (u32, u32) {
        match self {
            Self::Energy => (NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, 0),
            Self::PowerAverage => (NVML_FI_DEV_POWER_AVERAGE, NVML_POWER_SCOPE_GPU),
            Self::PowerInstant => (NVML_FI_DEV_POWER_INSTANT, NVML_POWER_SCOPE_GPU),
            Self::MemoryPowerAverage => (NVML_FI_DEV_POWER_AVERAGE, NVML_POWER_SCOPE_MEMORY),
        }
    }

    fn what(self) -> &'static str {
        match self {
            Self::Energy => ENERGY_FIELD,
            Self::PowerAverage => POWER_AVG,
            Self::PowerInstant => POWER_INSTANT,
            Self::MemoryPowerAverage => MEM_POWER,
        }
    }
}

/// Read fields in one `nvmlDeviceGetFieldValues` call.
///
/// nvml-wrapper's `field_values_for` always asks for the GPU scope; the memory-scope
/// reading needs `scopeId` set, so the call is made directly. The outer error is the
/// call's; the inner ones are per field.
fn read_fields(
    nvml: &Nvml,
    device: &Device<'_>,
    fields: &[Field],
) -> Result<Vec<Result<SampleValue, WrapperError>>, WrapperError> {
    let get_field_values = nvml
        .lib()
        .nvmlDeviceGetFieldValues
        .as_ref()
        .map_err(|e| WrapperError::FailedToLoadSymbol(e.to_string()))?;
    let mut values: Vec<nvmlFieldValue_t> = fields
        .iter()
        .map(|field| {
            // SAFETY: nvmlFieldValue_t is a C struct of integers and a union of numbers;
            // all-zero bytes are a valid value of it.
            let mut value: nvmlFieldValue_t = unsafe { std::mem::zeroed() };
            (value.fieldId, value.scopeId) = field.request();
            value
        })
        .collect();
    let count = i32::try_from(values.len()).map_err(|_| WrapperError::InvalidArg)?;
    // SAFETY: the handle comes from `nvml`, which is initialised and outlives this call;
    // `values` holds `count` initialised entries, which NVML fills in place.
    let status = unsafe { get_field_values(device.handle(), count, values.as_mut_ptr()) };
    nvml_try(status)?;
    Ok(values
        .into_iter()
        .map(|raw| FieldValueSample::try_from(raw).and_then(|sample| sample.value))
        .collect())
}

/// The energy counter's value, millijoules.
fn millijoules(value: SampleValue) -> Result<u64, WrapperError> {
    match value {
        SampleValue::U32(mj) => Ok(u64::from(mj)),
        SampleValue::U64(mj) => Ok(mj),
        SampleValue::I64(mj) => u64::try_from(mj).map_err(|_| WrapperError::InvalidArg),
        SampleValue::F64(mj) if mj.is_finite() && mj >= 0.0 && mj < u64::MAX as f64 => {
            Ok(mj.round() as u64)
        }
        SampleValue::F64(_) => Err(WrapperError::InvalidArg),
    }
}

fn milliwatts(value: SampleValue) -> Result<u32, WrapperError> {
    let out_of_range = || WrapperError::InvalidArg;
    match value {
        SampleValue::U32(mw) => Ok(mw),
        SampleValue::U64(mw) => u32::try_from(mw).map_err(|_| out_of_range()),
        SampleValue::I64(mw) => u32::try_from(mw).map_err(|_| out_of_range()),
        SampleValue::F64(mw) if mw.is_finite() && (0.0..=f64::from(u32::MAX)).contains(&mw) => {
            Ok(mw.round() as u32)
        }
        SampleValue::F64(_) => Err(out_of_range()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;
    use crate::tests::nvml_or_skip;
    use std::time::Duration;

    #[test]
    fn clock_event_reasons_map_to_policy_events() {
        assert_eq!(clock_events(ThrottleReasons::NONE), ClockEvents::default());
        assert_eq!(
            clock_events(ThrottleReasons::GPU_IDLE),
            ClockEvents {
                gpu_idle: true,
                ..ClockEvents::default()
            }
        );
        let busy = ThrottleReasons::SW_POWER_CAP
            | ThrottleReasons::HW_POWER_BRAKE_SLOWDOWN
            | ThrottleReasons::SW_THERMAL_SLOWDOWN
            | ThrottleReasons::HW_THERMAL_SLOWDOWN
            | ThrottleReasons::APPLICATIONS_CLOCKS_SETTING
            | ThrottleReasons::SYNC_BOOST;
        assert_eq!(
            clock_events(busy),
            ClockEvents {
                gpu_idle: false,
                sw_power_cap: true,
                hw_slowdown: true,
                sw_thermal: true,
                hw_thermal: true,
                clock_setting: true,
            }
        );
        assert!(clock_events(ThrottleReasons::HW_SLOWDOWN).hw_slowdown);
    }

    #[test]
    fn field_values_convert_to_milliwatts() {
        assert_eq!(milliwatts(SampleValue::U32(97_187)).unwrap(), 97_187);
        assert_eq!(milliwatts(SampleValue::U64(700_000)).unwrap(), 700_000);
        assert_eq!(milliwatts(SampleValue::F64(1500.4)).unwrap(), 1500);
        assert!(milliwatts(SampleValue::I64(-1)).is_err());
        assert!(milliwatts(SampleValue::F64(f64::NAN)).is_err());
        assert!(milliwatts(SampleValue::U64(u64::MAX)).is_err());
    }

    #[test]
    fn the_energy_field_converts_to_millijoules() {
        // Counters beyond u32 (about 50 days at 1 kW) stay whole.
        assert_eq!(
            millijoules(SampleValue::U64(5_000_000_000)).unwrap(),
            5_000_000_000
        );
        assert_eq!(millijoules(SampleValue::U32(2_482_486)).unwrap(), 2_482_486);
        assert_eq!(millijoules(SampleValue::F64(10.6)).unwrap(), 11);
        assert!(millijoules(SampleValue::I64(-5)).is_err());
        assert!(millijoules(SampleValue::F64(f64::INFINITY)).is_err());
    }

    #[test]
    fn nvml_telemetry_reads_windows_on_a_real_gpu() {
        let Some(system) = nvml_or_skip() else { return };
        let mut telemetry = system.telemetry(SamplerConfig::default()).unwrap();
        let gpus = telemetry.devices().len() as u32;
        assert!(matches!(
            telemetry.read_window(gpus),
            Err(TelemetryError::NoSuchGpu { .. })
        ));
        // Wait for a few samples (progress, not time, is what is checked).
        let (mut samples, mut energy_j, mut interval_s) = (0, 0.0, 0.0);
        let mut window = NvmlWindow::default();
        for _ in 0..100 {
            std::thread::sleep(Duration::from_millis(100));
            window = telemetry.read_window_detailed(0).unwrap();
            samples += window.window.samples;
            energy_j += window.window.energy_j;
            interval_s += window.window.interval_s;
            if samples >= 5 && energy_j > 0.0 {
                break;
            }
        }
        println!("NVML window: {window:?}");
        assert!(energy_j > 0.0, "the energy counter never moved");
        // Units check: counter energy over counter time is a board power.
        let power_w = energy_j / interval_s;
        assert!((10.0..2000.0).contains(&power_w), "{power_w} W");
        assert!(window.window.power_avg_reading_w > 0.0);
        assert!(window.window.sm_clock_mhz > 0);
        assert!(window.window.power_limit_enforced_w > 0.0);
        assert!((window.window.energy_counter_j - energy_j).abs() < 1e-6);
    }
}
