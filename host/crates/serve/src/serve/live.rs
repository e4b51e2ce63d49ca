//! The agent's status as of the last tick, written by the loop once per tick and read by
//! the API as often as it likes (a clone under a short lock: the loop never waits on a
//! reader for longer than that clone).

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::api::{GpuStatus, NodeStatus};
use tokwatt_agent::RunMeta;
use tokwatt_core::types::DeviceInfo;

#[derive(Debug, Default)]
pub(super) struct LiveState {
    pub status: NodeStatus,
    /// Operator commands the loop has carried out.
    pub commands_taken: u64,
    /// The loop has ended: nothing waits for another tick.
    pub ended: bool,
}

#[derive(Debug)]
pub(super) struct Live {
    state: Mutex<LiveState>,
    ticked: Condvar,
    pub started: Instant,
}

impl Live {
    pub fn new(meta: &RunMeta, devices: &[DeviceInfo]) -> Self {
        let status = NodeStatus {
            api_version: crate::api::API_VERSION,
            agent_version: env!("CARGO_PKG_VERSION").to_owned(),
            simulated: meta.simulated,
            data_source: meta.data_source.clone(),
            actuator: meta.actuator.clone(),
            workload: meta.workload.clone(),
            gpus: devices
                .iter()
                .map(|d| GpuStatus {
                    gpu: d.index,
                    name: d.name.clone(),
                    uuid: d.uuid.clone(),
                    ..GpuStatus::default()
                })
                .collect(),
            ..NodeStatus::default()
        };
        Self {
            state: Mutex::new(LiveState {
                status,
                ..LiveState::default()
            }),
            ticked: Condvar::new(),
            started: Instant::now(),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, LiveState> {
        // A panic while writing the status leaves plain data: keep serving it.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wake whoever waits for a tick.
    pub fn notify(&self) {
        self.ticked.notify_all();
    }

    pub fn status(&self) -> NodeStatus {
        self.lock().status.clone()
    }

    /// The loop has ended.
    pub fn end(&self) {
        self.lock().ended = true;
        self.notify();
    }

    /// Wait until `done` holds for the state, the loop ends, or `timeout` passes.
    /// Returns the state's `done` at the end.
    pub fn wait_until(&self, timeout: Duration, done: impl Fn(&LiveState) -> bool) -> bool {
        let guard = self.lock();
        let (guard, _) = self
            .ticked
            .wait_timeout_while(guard, timeout, |state| !state.ended && !done(state))
            .unwrap_or_else(PoisonError::into_inner);
        done(&guard)
    }
}
