//! NVML telemetry: the NVML [`SampleSource`] and [`NvmlTelemetry`], which runs it on the
//! sampler thread.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use nvml_wrapper::bitmasks::device::ThrottleReasons;
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::error::{NvmlError as WrapperError, nvml_try};
use nvml_wrapper::struct_wrappers::device::FieldValueSample;
use nvml_wrapper::sys_exports::field_id::{NVML_FI_DEV_POWER_AVERAGE, NVML_FI_DEV_POWER_INSTANT};
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{NVML_POWER_SCOPE_GPU, NVML_POWER_SCOPE_MEMORY, nvmlFieldValue_t};

use super::sampler::{NvmlWindow, Sample, SampleError, SampleSource, Sampler};
use super::{ManagedGpu, NvmlError};
use crate::telemetry::{Telemetry, TelemetryError};
use crate::types::{ClockEvents, DeviceInfo};

/// Telemetry from NVML. A thread of its own reads every GPU once per sampling period
/// (each NVML call can cost milliseconds); [`Telemetry::read_window`] only takes what has
/// accumulated, so the control loop never waits on NVML. The thread stops when this is
/// dropped.
#[derive(Debug)]
pub struct NvmlTelemetry {
    devices: Vec<DeviceInfo>,
    sampler: Sampler,
}

impl NvmlTelemetry {
    pub(super) fn start(
        nvml: Arc<Nvml>,
        gpus: &[ManagedGpu],
        period: Duration,
    ) -> Result<Self, NvmlError> {
        let source = NvmlSource {
            nvml,
            gpus: gpus
                .iter()
                .map(|gpu| SourceGpu {
                    nvml_index: gpu.nvml_index,
                    unsupported: HashSet::new(),
                })
                .collect(),
        };
        let sampler = Sampler::start(source, period).map_err(NvmlError::SamplerThread)?;
        Ok(Self {
            devices: gpus.iter().map(|gpu| gpu.info.clone()).collect(),
            sampler,
        })
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

    fn read_window(&mut self, gpu: u32) -> Result<crate::types::TelemetryWindow, TelemetryError> {
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

/// Reads every gauge of the managed GPUs through NVML.
struct NvmlSource {
    nvml: Arc<Nvml>,
    gpus: Vec<SourceGpu>,
}

struct SourceGpu {
    nvml_index: u32,
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

const ENERGY: &str = "the energy counter";
const POWER_FIELDS: &str = "power (fields 185/186)";
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

impl SampleSource for NvmlSource {
    fn gpu_count(&self) -> usize {
        self.gpus.len()
    }

    fn sample(&mut self, gpu: usize, errors: &mut Vec<SampleError>) -> Sample {
        let nvml = &*self.nvml;
        let Some(state) = self.gpus.get_mut(gpu) else {
            return Sample::default();
        };
        let device = match nvml.device_by_index(state.nvml_index) {
            Ok(device) => device,
            Err(error) => {
                errors.push(SampleError {
                    what: "the device handle",
                    reason: error.to_string(),
                });
                return Sample::default();
            }
        };

        // The energy counter first: the sample's timestamp is taken just before it.
        let energy_mj = state.keep(ENERGY, device.total_energy_consumption(), errors);

        let mut power = PowerReadings::default();
        if state.wants(POWER_FIELDS) {
            let wanted = PowerField::ALL
                .into_iter()
                .filter(|field| state.wants(field.what()))
                .collect::<Vec<_>>();
            if let Some(values) = state.keep(
                POWER_FIELDS,
                read_power_fields(nvml, &device, &wanted),
                errors,
            ) {
                for (field, value) in wanted.into_iter().zip(values) {
                    let milliwatts = state.keep(field.what(), value, errors);
                    power.set(field, milliwatts);
                }
            }
        }

        // Without field 185 (GPUs before Ampere, and the A100), nvmlDeviceGetPowerUsage
        // is the averaged reading there is.
        if power.avg.is_none() && !(state.wants(POWER_FIELDS) && state.wants(POWER_AVG)) {
            power.avg = state.keep(POWER_USAGE, device.power_usage(), errors);
        }

        Sample {
            energy_mj,
            power_avg_mw: power.avg,
            power_instant_mw: power.instant,
            mem_power_avg_mw: power.mem_avg,
            sm_clock_mhz: state.keep(SM_CLOCK, device.clock_info(Clock::SM), errors),
            mem_clock_mhz: state.keep(MEM_CLOCK, device.clock_info(Clock::Memory), errors),
            temperature_c: state.keep(
                TEMPERATURE,
                device.temperature(TemperatureSensor::Gpu),
                errors,
            ),
            gpu_util_pct: state
                .keep(UTILISATION, device.utilization_rates(), errors)
                .map(|utilisation| utilisation.gpu),
            clock_events: state
                .keep(CLOCK_EVENTS, device.current_throttle_reasons(), errors)
                .map(clock_events),
            power_limit_requested_mw: state.keep(
                LIMIT_REQUESTED,
                device.power_management_limit(),
                errors,
            ),
            power_limit_enforced_mw: state.keep(
                LIMIT_ENFORCED,
                device.enforced_power_limit(),
                errors,
            ),
        }
    }
}

/// The power fields read in one `nvmlDeviceGetFieldValues` call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PowerField {
    Average,
    Instant,
    MemoryAverage,
}

impl PowerField {
    const ALL: [PowerField; 3] = [Self::Average, Self::Instant, Self::MemoryAverage];

    /// (field id, scope id) as `nvmlFieldValue_t` wants them.
    fn request(self) -> (u32, u32) {
        match self {
            Self::Average => (NVML_FI_DEV_POWER_AVERAGE, NVML_POWER_SCOPE_GPU),
            Self::Instant => (NVML_FI_DEV_POWER_INSTANT, NVML_POWER_SCOPE_GPU),
            Self::MemoryAverage => (NVML_FI_DEV_POWER_AVERAGE, NVML_POWER_SCOPE_MEMORY),
        }
    }

    fn what(self) -> &'static str {
        match self {
            Self::Average => POWER_AVG,
            Self::Instant => POWER_INSTANT,
            Self::MemoryAverage => MEM_POWER,
        }
    }
}

#[derive(Debug, Default)]
struct PowerReadings {
    avg: Option<u32>,
    instant: Option<u32>,
    mem_avg: Option<u32>,
}

impl PowerReadings {
    fn set(&mut self, field: PowerField, milliwatts: Option<u32>) {
        match field {
            PowerField::Average => self.avg = milliwatts,
            PowerField::Instant => self.instant = milliwatts,
            PowerField::MemoryAverage => self.mem_avg = milliwatts,
        }
    }
}

/// Read power fields, milliwatts, in one `nvmlDeviceGetFieldValues` call.
///
/// nvml-wrapper's `field_values_for` always asks for the GPU scope; the memory-scope
/// reading needs `scopeId` set, so the call is made directly. The outer error is the
/// call's; the inner ones are per field.
fn read_power_fields(
    nvml: &Nvml,
    device: &Device<'_>,
    fields: &[PowerField],
) -> Result<Vec<Result<u32, WrapperError>>, WrapperError> {
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
        .map(|raw| {
            let sample = FieldValueSample::try_from(raw)?;
            milliwatts(sample.value?)
        })
        .collect())
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
    use crate::nvml::SamplerConfig;
    use crate::nvml::tests::nvml_or_skip;

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
