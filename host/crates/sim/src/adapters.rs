//! The simulation's three faces: the boundary traits ([`Telemetry`], [`Actuator`],
//! [`Workload`]) on one shared [`SimGpu`], and the device facts they report.

use tokwatt_core::actuator::{Actuator, ActuatorError, Capabilities, GpuSettings, accepts};
use tokwatt_core::telemetry::{Telemetry, TelemetryError};
use tokwatt_core::types::{DeviceInfo, TelemetryWindow, WorkloadWindow};
use tokwatt_core::workload::{Workload, WorkloadError};

use crate::gpu::{self, GpuSim};
use crate::{BoardSettings, ChangeError, GpuProfile, SimGpu};

pub(super) fn device_info(profile: &GpuProfile, index: u32) -> DeviceInfo {
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
pub(super) struct SimTelemetry {
    pub(super) sim: SimGpu,
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
pub(super) struct SimActuator {
    pub(super) sim: SimGpu,
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
pub(super) struct SimWorkload {
    pub(super) sim: SimGpu,
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

    /// A scenario with prompts has one: 1 to its `max_batched_tokens`; a decode-only
    /// one has none.
    fn token_budget_range(&self, gpu: u32) -> Option<(u32, u32)> {
        self.sim.lock().gpu(gpu)?.token_budget_range()
    }

    fn token_budget(&self, gpu: u32) -> Option<u32> {
        self.sim.lock().gpu(gpu)?.token_budget()
    }

    /// Kept by the board, not the simulated driver: a serving engine's budget is the
    /// engine's own (as its batch limit would be), gone with the process.
    fn set_token_budget(&mut self, gpu: u32, tokens: u32) -> Result<(), WorkloadError> {
        let mut state = self.sim.lock();
        let count = state.count();
        let board = state
            .gpu(gpu)
            .ok_or(WorkloadError::NoSuchGpu { index: gpu, count })?;
        tokwatt_core::workload::check_token_budget("sim", gpu, board.token_budget_range(), tokens)?;
        board.set_token_budget(tokens);
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
