//! The actuator boundary: GPU settings (power cap, SM and memory clock locks).
//!
//! Every backend implements [`Actuator`]: NVML for real GPUs, the simulator, and
//! [`DryRun`], which logs each change and touches nothing. The batch size is the
//! workload's knob and lives in [`crate::workload`].

use crate::types::DeviceInfo;

pub mod accepts;

#[derive(Debug, thiserror::Error)]
pub enum ActuatorError {
    #[error("GPU index {index} is out of range: this backend manages {count} GPU(s)")]
    NoSuchGpu { index: u32, count: u32 },
    #[error(
        "not permitted to change {what} on GPU {gpu}: {reason}. Run as root or with CAP_SYS_ADMIN, or run observe-only with --dry-run (serve: node.dry_run = true)"
    )]
    NotPermitted {
        gpu: u32,
        what: &'static str,
        reason: String,
    },
    #[error("{what} is not supported on GPU {gpu}: {reason}")]
    NotSupported {
        gpu: u32,
        what: &'static str,
        reason: String,
    },
    #[error("setting {what} on GPU {gpu} failed: {reason}")]
    Failed {
        gpu: u32,
        what: &'static str,
        reason: String,
    },
}

/// The GPU settings an actuator controls, as read back from the device.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GpuSettings {
    /// Power limit requested through NVML (what `set_power_cap` sets), watts.
    pub power_cap_w: f64,
    /// Power limit the GPU enforces (may be lower: out-of-band limits win), watts.
    pub power_cap_enforced_w: f64,
    /// Locked SM clock range, if any.
    pub sm_clock_lock_mhz: Option<(u32, u32)>,
    /// Locked memory clock range, if any.
    pub mem_clock_lock_mhz: Option<(u32, u32)>,
}

/// Which settings this actuator may change on a GPU (checked up front, so a missing
/// privilege is explained before the run rather than half-way through it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    pub power_cap: bool,
    pub sm_clock: bool,
    pub mem_clock: bool,
}

pub trait Actuator: Send {
    /// Short name for logs and the summary ("nvml", "dry-run", "sim").
    fn name(&self) -> &'static str;
    /// Whether changes reach the hardware. A dry run pretends: the loop then shows the
    /// policy the settings it pretended to apply rather than the device's enforced ones,
    /// so the policy behaves as it would if its decisions were applied.
    fn applies_settings(&self) -> bool {
        true
    }
    fn devices(&self) -> Vec<DeviceInfo>;
    /// What this actuator may change on `gpu`.
    fn capabilities(&self, gpu: u32) -> Capabilities;
    /// The settings in force now.
    fn read(&mut self, gpu: u32) -> Result<GpuSettings, ActuatorError>;
    /// Set the power limit; returns the limit the GPU enforces afterwards.
    fn set_power_cap(&mut self, gpu: u32, watts: f64) -> Result<f64, ActuatorError>;
    /// Lock the SM clock to `[min_mhz, max_mhz]`, or release the lock with `None`.
    fn set_sm_clock_lock(
        &mut self,
        gpu: u32,
        range_mhz: Option<(u32, u32)>,
    ) -> Result<(), ActuatorError>;
    /// Lock the memory clock to `[min_mhz, max_mhz]`, or release the lock with `None`.
    fn set_mem_clock_lock(
        &mut self,
        gpu: u32,
        range_mhz: Option<(u32, u32)>,
    ) -> Result<(), ActuatorError>;
}

/// Observe-only: records what it would have done, changes nothing, and reads back the
/// settings it would have set (so the loop's view stays consistent), while
/// [`Actuator::read`] of the original backend stays untouched.
#[derive(Debug)]
pub struct DryRun {
    devices: Vec<DeviceInfo>,
    settings: Vec<GpuSettings>,
    /// How many changes it was asked for (each is logged at info level).
    changes_withheld: u64,
}

impl DryRun {
    /// Its [`Actuator::name`], which the agent's status and metrics report.
    pub const NAME: &'static str = "dry-run";

    /// Start from the settings the device has now.
    pub fn new(devices: Vec<DeviceInfo>, settings: Vec<GpuSettings>) -> Self {
        Self {
            devices,
            settings,
            changes_withheld: 0,
        }
    }

    /// Changes asked for and not made.
    pub fn changes_withheld(&self) -> u64 {
        self.changes_withheld
    }

    fn slot(&mut self, gpu: u32) -> Result<&mut GpuSettings, ActuatorError> {
        let count = self.settings.len() as u32;
        self.settings
            .get_mut(gpu as usize)
            .ok_or(ActuatorError::NoSuchGpu { index: gpu, count })
    }

    fn record(&mut self, gpu: u32, what: String) {
        tracing::info!(gpu, "dry-run: would {what}");
        self.changes_withheld += 1;
    }
}

impl Actuator for DryRun {
    fn name(&self) -> &'static str {
        Self::NAME
    }
    fn applies_settings(&self) -> bool {
        false
    }
    fn devices(&self) -> Vec<DeviceInfo> {
        self.devices.clone()
    }
    fn capabilities(&self, _gpu: u32) -> Capabilities {
        Capabilities {
            power_cap: true,
            sm_clock: true,
            mem_clock: true,
        }
    }
    fn read(&mut self, gpu: u32) -> Result<GpuSettings, ActuatorError> {
        self.slot(gpu).copied()
    }
    fn set_power_cap(&mut self, gpu: u32, watts: f64) -> Result<f64, ActuatorError> {
        let slot = self.slot(gpu)?;
        slot.power_cap_w = watts;
        slot.power_cap_enforced_w = watts;
        self.record(gpu, format!("set power cap to {watts:.0} W"));
        Ok(watts)
    }
    fn set_sm_clock_lock(
        &mut self,
        gpu: u32,
        range_mhz: Option<(u32, u32)>,
    ) -> Result<(), ActuatorError> {
        self.slot(gpu)?.sm_clock_lock_mhz = range_mhz;
        let what = match range_mhz {
            Some((lo, hi)) => format!("lock SM clock to {lo}-{hi} MHz"),
            None => "release the SM clock lock".to_owned(),
        };
        self.record(gpu, what);
        Ok(())
    }
    fn set_mem_clock_lock(
        &mut self,
        gpu: u32,
        range_mhz: Option<(u32, u32)>,
    ) -> Result<(), ActuatorError> {
        self.slot(gpu)?.mem_clock_lock_mhz = range_mhz;
        let what = match range_mhz {
            Some((lo, hi)) => format!("lock memory clock to {lo}-{hi} MHz"),
            None => "release the memory clock lock".to_owned(),
        };
        self.record(gpu, what);
        Ok(())
    }
}
