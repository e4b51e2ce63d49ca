//! The telemetry boundary: what the GPU did, per control window.
//!
//! Backends sample at their own pace (the NVML backend on a thread of its own, since each
//! NVML call costs ~2 ms; the simulator at NVML's 100 ms update period) and hand the
//! control loop an aggregated window without making it wait.

use crate::types::{DeviceInfo, TelemetryWindow};

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("GPU index {index} is out of range: this backend manages {count} GPU(s)")]
    NoSuchGpu { index: u32, count: u32 },
    #[error("NVML is not available: {0}")]
    Unavailable(String),
    #[error("reading {what} from GPU {gpu} failed: {reason}")]
    Read {
        gpu: u32,
        what: &'static str,
        reason: String,
    },
}

pub trait Telemetry: Send {
    /// The managed GPUs, in index order.
    fn devices(&self) -> Vec<DeviceInfo>;
    /// Aggregate everything seen on `gpu` since the previous call (or since start) into
    /// one window, and start a new window.
    fn read_window(&mut self, gpu: u32) -> Result<TelemetryWindow, TelemetryError>;
}
