//! NVML actuator: power limit and locked SM / memory clocks.
//!
//! Every setter checks the request against the GPU's constraints and this process's
//! privileges before calling NVML, so a missing privilege is reported up front and NVML
//! is never called just to find out. After a change it reads back what the GPU enforces.
//!
//! NVML has no call that reports locked clocks, so the lock state this actuator reports is
//! the one it set itself (none at start). Restoring "no lock" therefore always resets.

use std::sync::Arc;

use nvml_wrapper::enums::device::GpuLockedClocksSetting;
use nvml_wrapper::error::NvmlError as WrapperError;
use nvml_wrapper::{Device, Nvml};

use super::{ManagedGpu, current_sm_clock};
use tokwatt_core::actuator::{Actuator, ActuatorError, Capabilities, GpuSettings, accepts};
use tokwatt_core::privileges::Privileges;
use tokwatt_core::types::DeviceInfo;

const POWER_CAP: &str = "the power cap";
const SM_CLOCK_LOCK: &str = "the SM clock lock";
const MEM_CLOCK_LOCK: &str = "the memory clock lock";
const SETTINGS: &str = "the settings";

/// Changes GPU settings through NVML (needs root or `CAP_SYS_ADMIN`).
#[derive(Debug)]
pub struct NvmlActuator {
    nvml: Arc<Nvml>,
    gpus: Vec<ActuatorGpu>,
    privileges: Privileges,
}

#[derive(Debug)]
struct ActuatorGpu {
    managed: ManagedGpu,
    /// The SM clock lock this actuator set (NVML cannot report one).
    sm_lock_mhz: Option<(u32, u32)>,
    /// The memory clock lock this actuator set.
    mem_lock_mhz: Option<(u32, u32)>,
}

impl NvmlActuator {
    pub(super) fn new(nvml: Arc<Nvml>, gpus: &[ManagedGpu]) -> Self {
        Self::with_privileges(nvml, gpus, Privileges::current())
    }

    fn with_privileges(nvml: Arc<Nvml>, gpus: &[ManagedGpu], privileges: Privileges) -> Self {
        if let Some(denial) = privileges.denial() {
            tracing::warn!("GPU settings cannot be changed: {denial}");
        }
        Self {
            nvml,
            gpus: gpus
                .iter()
                .map(|managed| ActuatorGpu {
                    managed: managed.clone(),
                    sm_lock_mhz: None,
                    mem_lock_mhz: None,
                })
                .collect(),
            privileges,
        }
    }

    fn slot(&self, gpu: u32) -> Result<&ActuatorGpu, ActuatorError> {
        self.gpus.get(gpu as usize).ok_or(ActuatorError::NoSuchGpu {
            index: gpu,
            count: self.gpus.len() as u32,
        })
    }

    /// The GPU's slot, once the privilege and support checks for `what` have passed.
    fn changeable(
        &self,
        gpu: u32,
        what: &'static str,
        supported: fn(&ManagedGpu) -> bool,
    ) -> Result<&ActuatorGpu, ActuatorError> {
        let slot = self.slot(gpu)?;
        if let Some(denial) = self.privileges.denial() {
            return Err(ActuatorError::NotPermitted {
                gpu,
                what,
                reason: denial.to_string(),
            });
        }
        if !supported(&slot.managed) {
            return Err(ActuatorError::NotSupported {
                gpu,
                what,
                reason: format!(
                    "{} does not support it (NVML needs Volta or newer for SM clock locks, Ampere or newer for memory clock locks, and power management for a power cap)",
                    slot.managed.info.name
                ),
            });
        }
        Ok(slot)
    }

    fn device(&self, gpu: u32, what: &'static str) -> Result<Device<'_>, ActuatorError> {
        let slot = self.slot(gpu)?;
        self.nvml
            .device_by_index(slot.managed.nvml_index)
            .map_err(nvml_error(gpu, what))
    }
}

/// Map an NVML error from a setter to the actuator's error.
fn nvml_error(gpu: u32, what: &'static str) -> impl FnOnce(WrapperError) -> ActuatorError {
    move |error| match error {
        WrapperError::NoPermission => ActuatorError::NotPermitted {
            gpu,
            what,
            reason: "NVML refused: the current user does not have permission".into(),
        },
        WrapperError::NotSupported => ActuatorError::NotSupported {
            gpu,
            what,
            reason: "NVML reports that this GPU does not support it".into(),
        },
        WrapperError::InvalidArg => ActuatorError::Failed {
            gpu,
            what,
            reason: "NVML rejected the value as invalid for this GPU".into(),
        },
        other => ActuatorError::Failed {
            gpu,
            what,
            reason: other.to_string(),
        },
    }
}

/// Watts to NVML's milliwatts, if `watts` lies within the GPU's power-limit range
/// (the rule every backend shares: [`accepts`]).
fn power_cap_milliwatts(info: &DeviceInfo, watts: f64) -> Result<u32, String> {
    accepts::power_cap_milliwatts(info.power_cap_min_w, info.power_cap_max_w, watts)
        .map_err(|refused| refused.to_string())
}

/// Check a clock lock range against the supported clocks (highest first), by the rule
/// every backend shares ([`accepts`]).
fn check_clock_range(supported: &[u32], (min, max): (u32, u32)) -> Result<(), String> {
    accepts::clock_lock(supported, min, max)
        .map(|_| ())
        .map_err(|refused| refused.to_string())
}

impl Actuator for NvmlActuator {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        self.gpus
            .iter()
            .map(|gpu| gpu.managed.info.clone())
            .collect()
    }

    fn capabilities(&self, gpu: u32) -> Capabilities {
        let Some(slot) = self.gpus.get(gpu as usize) else {
            return Capabilities::default();
        };
        let allowed = self.privileges.can_change_gpu_settings();
        Capabilities {
            power_cap: allowed && slot.managed.power_cap_supported,
            sm_clock: allowed && slot.managed.sm_lock_supported,
            mem_clock: allowed && slot.managed.mem_lock_supported,
        }
    }

    fn read(&mut self, gpu: u32) -> Result<GpuSettings, ActuatorError> {
        let device = self.device(gpu, SETTINGS)?;
        let requested_mw = device
            .power_management_limit()
            .map_err(nvml_error(gpu, POWER_CAP))?;
        let enforced_mw = device
            .enforced_power_limit()
            .map_err(nvml_error(gpu, POWER_CAP))?;
        let slot = self.slot(gpu)?;
        Ok(GpuSettings {
            power_cap_w: f64::from(requested_mw) / 1000.0,
            power_cap_enforced_w: f64::from(enforced_mw) / 1000.0,
            sm_clock_lock_mhz: slot.sm_lock_mhz,
            mem_clock_lock_mhz: slot.mem_lock_mhz,
        })
    }

    fn set_power_cap(&mut self, gpu: u32, watts: f64) -> Result<f64, ActuatorError> {
        let slot = self.changeable(gpu, POWER_CAP, |g| g.power_cap_supported)?;
        let milliwatts = power_cap_milliwatts(&slot.managed.info, watts).map_err(|reason| {
            ActuatorError::Failed {
                gpu,
                what: POWER_CAP,
                reason,
            }
        })?;
        let mut device = self.device(gpu, POWER_CAP)?;
        device
            .set_power_management_limit(milliwatts)
            .map_err(nvml_error(gpu, POWER_CAP))?;

        // Read back what holds now: the request, and the limit the GPU enforces (an
        // out-of-band or lower limit set elsewhere wins).
        let requested = device.power_management_limit();
        let enforced = device.enforced_power_limit();
        match (requested, enforced) {
            (Ok(requested), Ok(enforced)) => {
                if requested != milliwatts {
                    tracing::warn!(
                        gpu,
                        "asked for a power cap of {milliwatts} mW; NVML reports {requested} mW requested"
                    );
                }
                if enforced < requested {
                    tracing::warn!(
                        gpu,
                        "the GPU enforces {:.0} W, below the requested {:.0} W: a lower limit set elsewhere wins",
                        f64::from(enforced) / 1000.0,
                        f64::from(requested) / 1000.0
                    );
                }
                tracing::info!(
                    gpu,
                    "power cap set to {watts:.0} W (enforced {:.0} W)",
                    f64::from(enforced) / 1000.0
                );
                Ok(f64::from(enforced) / 1000.0)
            }
            (requested, enforced) => {
                let error = requested.err().or(enforced.err());
                tracing::warn!(
                    gpu,
                    "power cap set to {watts:.0} W, but reading it back failed: {}",
                    error.map(|e| e.to_string()).unwrap_or_default()
                );
                Ok(watts)
            }
        }
    }

    fn set_sm_clock_lock(
        &mut self,
        gpu: u32,
        range_mhz: Option<(u32, u32)>,
    ) -> Result<(), ActuatorError> {
        let slot = self.changeable(gpu, SM_CLOCK_LOCK, |g| g.sm_lock_supported)?;
        if let Some(range) = range_mhz {
            check_clock_range(&slot.managed.info.sm_clocks_mhz, range).map_err(|reason| {
                ActuatorError::Failed {
                    gpu,
                    what: SM_CLOCK_LOCK,
                    reason,
                }
            })?;
        }
        let mut device = self.device(gpu, SM_CLOCK_LOCK)?;
        match range_mhz {
            Some((min_clock_mhz, max_clock_mhz)) => device
                .set_gpu_locked_clocks(GpuLockedClocksSetting::Numeric {
                    min_clock_mhz,
                    max_clock_mhz,
                })
                .map_err(nvml_error(gpu, SM_CLOCK_LOCK))?,
            None => device
                .reset_gpu_locked_clocks()
                .map_err(nvml_error(gpu, SM_CLOCK_LOCK))?,
        }
        // NVML cannot read a lock back; the clock itself shows whether it took (power and
        // thermal limits may still hold it below the lock).
        let now = current_sm_clock(&device);
        if let Some(slot) = self.gpus.get_mut(gpu as usize) {
            slot.sm_lock_mhz = range_mhz;
        }
        match range_mhz {
            Some((lo, hi)) => {
                tracing::info!(
                    gpu,
                    sm_clock_now_mhz = now,
                    "SM clock locked to {lo}-{hi} MHz"
                )
            }
            None => tracing::info!(gpu, sm_clock_now_mhz = now, "SM clock lock released"),
        }
        Ok(())
    }

    fn set_mem_clock_lock(
        &mut self,
        gpu: u32,
        range_mhz: Option<(u32, u32)>,
    ) -> Result<(), ActuatorError> {
        let slot = self.changeable(gpu, MEM_CLOCK_LOCK, |g| g.mem_lock_supported)?;
        if let Some(range) = range_mhz {
            check_clock_range(&slot.managed.info.mem_clocks_mhz, range).map_err(|reason| {
                ActuatorError::Failed {
                    gpu,
                    what: MEM_CLOCK_LOCK,
                    reason,
                }
            })?;
        }
        let mut device = self.device(gpu, MEM_CLOCK_LOCK)?;
        match range_mhz {
            Some((min, max)) => device
                .set_mem_locked_clocks(min, max)
                .map_err(nvml_error(gpu, MEM_CLOCK_LOCK))?,
            None => device
                .reset_mem_locked_clocks()
                .map_err(nvml_error(gpu, MEM_CLOCK_LOCK))?,
        }
        if let Some(slot) = self.gpus.get_mut(gpu as usize) {
            slot.mem_lock_mhz = range_mhz;
        }
        match range_mhz {
            Some((lo, hi)) => tracing::info!(gpu, "memory clock locked to {lo}-{hi} MHz"),
            None => tracing::info!(gpu, "memory clock lock released"),
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;
    use crate::tests::nvml_or_skip;

    fn h200() -> DeviceInfo {
        DeviceInfo {
            index: 0,
            uuid: "GPU-test".into(),
            name: "NVIDIA H200".into(),
            simulated: false,
            power_cap_min_w: 200.0,
            power_cap_max_w: 700.0,
            power_cap_default_w: 700.0,
            sm_clocks_mhz: (0..110).map(|i| 1980 - 15 * i).collect(),
            mem_clocks_mhz: vec![3201, 2201],
        }
    }

    #[test]
    fn power_caps_convert_to_milliwatts_within_range_only() {
        let info = h200();
        assert_eq!(power_cap_milliwatts(&info, 450.0), Ok(450_000));
        assert_eq!(power_cap_milliwatts(&info, 200.0), Ok(200_000));
        assert_eq!(power_cap_milliwatts(&info, 512.3456), Ok(512_346));
        for bad in [199.9, 700.5, -1.0, f64::NAN, f64::INFINITY] {
            let error = power_cap_milliwatts(&info, bad).unwrap_err();
            assert!(error.contains(" W"), "{error}");
        }
        let error = power_cap_milliwatts(&info, 800.0).unwrap_err();
        assert!(error.contains("200-700 W"), "{error}");
    }

    #[test]
    fn clock_ranges_are_checked_against_supported_clocks() {
        let info = h200();
        assert!(check_clock_range(&info.sm_clocks_mhz, (1200, 1500)).is_ok());
        assert!(check_clock_range(&info.sm_clocks_mhz, (345, 1980)).is_ok());
        let reversed = check_clock_range(&info.sm_clocks_mhz, (1500, 1200)).unwrap_err();
        assert!(reversed.contains("reversed"), "{reversed}");
        let high = check_clock_range(&info.sm_clocks_mhz, (1500, 2100)).unwrap_err();
        assert!(high.contains("345-1980 MHz"), "{high}");
        assert!(check_clock_range(&info.mem_clocks_mhz, (100, 3201)).is_err());
        // Unknown supported clocks: only the order is checked; NVML judges the rest.
        assert!(check_clock_range(&[], (100, 200)).is_ok());
    }

    #[test]
    fn nvml_errors_map_to_actuator_errors_with_the_fix() {
        let denied = nvml_error(1, POWER_CAP)(WrapperError::NoPermission);
        assert!(matches!(denied, ActuatorError::NotPermitted { gpu: 1, .. }));
        let message = denied.to_string();
        assert!(message.contains("CAP_SYS_ADMIN"), "{message}");
        assert!(message.contains("--dry-run"), "{message}");
        assert!(matches!(
            nvml_error(0, SM_CLOCK_LOCK)(WrapperError::NotSupported),
            ActuatorError::NotSupported { .. }
        ));
        assert!(matches!(
            nvml_error(0, SM_CLOCK_LOCK)(WrapperError::GpuLost),
            ActuatorError::Failed { .. }
        ));
    }

    /// On a real GPU: capabilities and reads only. The setters are never called here;
    /// the GPU is shared and must not be changed by tests.
    #[test]
    fn nvml_actuator_reads_settings_without_changing_them() {
        let Some(system) = nvml_or_skip() else { return };
        let mut actuator = system.actuator();
        let devices = actuator.devices();
        for device in &devices {
            let settings = actuator.read(device.index).unwrap();
            println!("GPU {}: {settings:?}", device.index);
            assert!(settings.power_cap_w >= device.power_cap_min_w);
            assert!(settings.power_cap_w <= device.power_cap_max_w);
            assert!(settings.power_cap_enforced_w > 0.0);
            assert_eq!(settings.sm_clock_lock_mhz, None);
            let expected = Privileges::current().can_change_gpu_settings();
            assert_eq!(actuator.capabilities(device.index).power_cap, expected);
        }
        let count = devices.len() as u32;
        assert!(matches!(
            actuator.read(count),
            Err(ActuatorError::NoSuchGpu { .. })
        ));
    }

    /// Without privileges, a setter refuses before reaching NVML (safe to run on a real,
    /// shared GPU: nothing is changed).
    #[test]
    fn unprivileged_setters_refuse_before_calling_nvml() {
        let Some(system) = nvml_or_skip() else { return };
        let unprivileged =
            Privileges::from_status("Uid:\t1000\t1000\t1000\t1000\nCapEff:\t0000000000000000\n");
        let mut actuator =
            NvmlActuator::with_privileges(Arc::clone(&system.nvml), &system.gpus, unprivileged);
        assert_eq!(actuator.capabilities(0), Capabilities::default());
        let error = actuator.set_power_cap(0, 400.0).unwrap_err();
        assert!(
            matches!(error, ActuatorError::NotPermitted { .. }),
            "{error}"
        );
        assert!(error.to_string().contains("uid 1000"), "{error}");
        assert!(matches!(
            actuator.set_sm_clock_lock(0, Some((1200, 1500))),
            Err(ActuatorError::NotPermitted { .. })
        ));
        assert!(matches!(
            actuator.set_mem_clock_lock(0, None),
            Err(ActuatorError::NotPermitted { .. })
        ));
    }
}
