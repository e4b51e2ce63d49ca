//! Test doubles shared by the restore tests: GPUs whose settings outlive an actuator (as
//! real hardware does), an actuator over them that can be made to fail, and helpers.

#![allow(clippy::unwrap_used)] // tests may unwrap

use std::fs;
use std::path::Path;
use std::sync::{Arc, Mutex};

use super::state_file::Changed;
use super::{SavedGpu, StateFile};
use tokwatt_core::actuator::{Actuator, ActuatorError, Capabilities, GpuSettings};
use tokwatt_core::types::DeviceInfo;

pub(super) fn device(index: u32, uuid: &str) -> DeviceInfo {
    DeviceInfo {
        index,
        uuid: uuid.into(),
        name: "fake".into(),
        simulated: true,
        power_cap_min_w: 200.0,
        power_cap_max_w: 700.0,
        power_cap_default_w: 700.0,
        sm_clocks_mhz: vec![1980, 1500, 345],
        mem_clocks_mhz: vec![3201, 2201],
    }
}

pub(super) fn stock() -> GpuSettings {
    GpuSettings {
        power_cap_w: 700.0,
        power_cap_enforced_w: 700.0,
        sm_clock_lock_mhz: None,
        mem_clock_lock_mhz: None,
    }
}

/// GPUs whose settings outlive any one actuator instance (like real hardware), so a
/// "new process" can see what a crashed one left.
#[derive(Debug, Clone)]
pub(super) struct Hardware(pub(super) Arc<Mutex<Vec<GpuSettings>>>);

impl Hardware {
    pub(super) fn new(gpus: usize) -> Self {
        Self(Arc::new(Mutex::new(vec![stock(); gpus])))
    }
    pub(super) fn get(&self, gpu: usize) -> GpuSettings {
        self.0.lock().unwrap()[gpu]
    }
}

/// An actuator over [`Hardware`], with knobs to make it fail.
#[derive(Debug)]
pub(super) struct FakeActuator {
    pub(super) hardware: Hardware,
    pub(super) devices: Vec<DeviceInfo>,
    pub(super) deny_power: bool,
    pub(super) no_mem_locks: bool,
    pub(super) changes: Arc<Mutex<Vec<String>>>,
}

impl FakeActuator {
    pub(super) fn new(hardware: &Hardware, uuids: &[&str]) -> Self {
        Self {
            hardware: hardware.clone(),
            devices: uuids
                .iter()
                .enumerate()
                .map(|(i, uuid)| device(i as u32, uuid))
                .collect(),
            deny_power: false,
            no_mem_locks: false,
            changes: Arc::default(),
        }
    }
    fn with<T>(&self, gpu: u32, f: impl FnOnce(&mut GpuSettings) -> T) -> Result<T, ActuatorError> {
        let mut gpus = self.hardware.0.lock().unwrap();
        let count = gpus.len() as u32;
        gpus.get_mut(gpu as usize)
            .map(f)
            .ok_or(ActuatorError::NoSuchGpu { index: gpu, count })
    }
}

impl Actuator for FakeActuator {
    fn name(&self) -> &'static str {
        "fake"
    }
    fn devices(&self) -> Vec<DeviceInfo> {
        self.devices.clone()
    }
    fn capabilities(&self, _gpu: u32) -> Capabilities {
        Capabilities {
            power_cap: !self.deny_power,
            sm_clock: true,
            mem_clock: !self.no_mem_locks,
        }
    }
    fn read(&mut self, gpu: u32) -> Result<GpuSettings, ActuatorError> {
        self.with(gpu, |s| *s)
    }
    fn set_power_cap(&mut self, gpu: u32, watts: f64) -> Result<f64, ActuatorError> {
        if self.deny_power {
            return Err(ActuatorError::NotPermitted {
                gpu,
                what: "the power cap",
                reason: "test".into(),
            });
        }
        self.changes
            .lock()
            .unwrap()
            .push(format!("{gpu} power {watts}"));
        self.with(gpu, |s| {
            s.power_cap_w = watts;
            s.power_cap_enforced_w = watts;
            watts
        })
    }
    fn set_sm_clock_lock(
        &mut self,
        gpu: u32,
        range: Option<(u32, u32)>,
    ) -> Result<(), ActuatorError> {
        self.changes
            .lock()
            .unwrap()
            .push(format!("{gpu} sm {range:?}"));
        self.with(gpu, |s| s.sm_clock_lock_mhz = range)
    }
    fn set_mem_clock_lock(
        &mut self,
        gpu: u32,
        range: Option<(u32, u32)>,
    ) -> Result<(), ActuatorError> {
        if self.no_mem_locks {
            return Err(ActuatorError::NotSupported {
                gpu,
                what: "the memory clock lock",
                reason: "not on this GPU".into(),
            });
        }
        self.changes
            .lock()
            .unwrap()
            .push(format!("{gpu} mem {range:?}"));
        self.with(gpu, |s| s.mem_clock_lock_mhz = range)
    }
}

pub(super) fn state_in(dir: &tempfile::TempDir) -> StateFile {
    StateFile::new(dir.path().join("state.json"))
}

pub(super) fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

pub(super) fn saved(uuid: &str, index: u32, original: GpuSettings) -> SavedGpu {
    SavedGpu {
        uuid: uuid.into(),
        index,
        original,
        // What a crashed run may have left: anything.
        changed: Changed::everything(),
    }
}
