//! Hand-over at a hot swap: schema version 1, little-endian.
//!
//! ```text
//! u32 number of GPUs, then per GPU:
//!   u32 batch target, u32 clock ladder index,
//!   u32 points, then per point f64 sequences, f64 p99 ms,
//!   bool has floor [u32 ladder index, u32 windows left],
//!   f64 elasticity,
//!   bool has reference [f64 tokens/s]
//! ```
//!
//! The clock window and the judgement of the last step down start afresh; the p99's
//! scatter is the new instance's own.

use crate::control::{Floor, GpuControl, Window};
use crate::fit::TpotFit;
use tokwatt_policy_kit::state;
use tokwatt_policy_sdk::State;

pub(crate) const SCHEMA_VERSION: u32 = 1;

pub(crate) fn encode(gpus: &[GpuControl]) -> State {
    state::encode_per_gpu(SCHEMA_VERSION, gpus, |writer, gpu| {
        let mut writer = gpu
            .fit
            .write_state(writer.u32(gpu.batch_target).u32(gpu.clock_index as u32))
            .bool(gpu.floor.is_some());
        if let Some(floor) = gpu.floor {
            writer = writer.u32(floor.index as u32).u32(floor.windows_left);
        }
        writer = writer
            .f64(gpu.elasticity)
            .bool(gpu.reference_tokens_per_s.is_some());
        match gpu.reference_tokens_per_s {
            Some(reference) => writer.f64(reference),
            None => writer,
        }
    })
}

/// The controls in `state`, laid over `current` (whose device ranges win). Nothing is
/// changed unless all of `state` reads back.
pub(crate) fn decode(state: &State, current: &[GpuControl]) -> Result<Vec<GpuControl>, String> {
    state::decode_per_gpu(state, SCHEMA_VERSION, current, |reader, control| {
        let mut control = control;
        let gpu = control.gpu;
        let last_index = control.clocks.len().saturating_sub(1);
        control.batch_target = reader.u32()?.clamp(1, control.batch_max);
        control.clock_index = (reader.u32()? as usize).min(last_index);
        control.fit = TpotFit::read_state(reader).map_err(|error| format!("gpu {gpu}: {error}"))?;
        control.floor = if reader.bool()? {
            Some(Floor {
                index: (reader.u32()? as usize).min(last_index),
                windows_left: reader.u32()?,
            })
        } else {
            None
        };
        let elasticity = reader.f64()?;
        if !(elasticity.is_finite() && elasticity >= 1.0) {
            return Err(format!("gpu {gpu}: elasticity {elasticity} in the state"));
        }
        control.elasticity = elasticity;
        control.reference_tokens_per_s = if reader.bool()? {
            Some(reader.f64()?).filter(|value| value.is_finite() && *value > 0.0)
        } else {
            None
        };
        control.window = Window::default();
        control.last_down = None;
        control.backlog_windows = 0;
        control.queue_empties = false;
        // The scatter is kept from the instance taking over: it is this GPU's, now.
        Ok(control)
    })
}
