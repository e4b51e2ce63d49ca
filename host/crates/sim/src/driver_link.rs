//! A simulation's link to its driver file: the settings version its boards run on, read
//! again when another process changed it, and followed board by board.

use std::sync::Arc;

use tokwatt_core::actuator::accepts;

use crate::driver::{DriverError, SimDriver, Snapshot};
use crate::gpu::GpuSim;
use crate::profile::GpuProfile;

/// A simulation's link to its driver file.
#[derive(Debug)]
pub(super) struct DriverLink {
    pub(super) driver: SimDriver,
    /// The version of the file the boards run on.
    pub(super) seen: Snapshot,
    /// The last problem reading the file (reported once, not every tick), and the bytes it
    /// was found in (not checked again while the file holds them).
    pub(super) problem: Option<(String, Option<Vec<u8>>)>,
    pub(super) profile: Arc<GpuProfile>,
    pub(super) sm_clocks_mhz: Vec<u32>,
    pub(super) mem_clocks_mhz: Vec<u32>,
    /// The batch of a board whose driver holds none (the workload's own).
    pub(super) initial_batch: u32,
    pub(super) batch_size_max: u32,
}

impl DriverLink {
    /// Bring every board to the settings of the version read last: each one that differs
    /// is first caught up to `now_ns` under its old settings, so a change made by another
    /// process applies from now on, never to the time before it was seen.
    pub(super) fn follow(&self, gpus: &mut [GpuSim], now_ns: u64) {
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
    pub(super) fn reread(&mut self) -> bool {
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
