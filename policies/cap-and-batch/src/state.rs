//! Hand-over of both loops' state at a hot swap: schema version 1, little-endian.
//!
//! ```text
//! u32 number of GPUs, then per GPU:
//!   cap search:
//!     f64 target_w, f64 step_w, u8 direction (0 down, 1 up), u32 improvements_in_a_row,
//!     f64 window cap_w, u32 window batch_size, u64 window tokens, f64 window energy_j,
//!     u32 window ticks,
//!     bool has previous [f64 cap_w, f64 tokens_per_j],
//!     bool has objective floor [f64 cap_w, u32 windows_left]
//!   batch control:
//!     bool has pending [u32 batch size]
//! ```

use crate::GpuControl;
use crate::cap::{Direction, Measurement, SloFloor, Window};
use crate::config::Config;
use tokwatt_policy_sdk::{State, StateReader, StateWriter};

/// The version of the layout above.
pub(crate) const SCHEMA_VERSION: u32 = 1;

pub(crate) fn encode(gpus: &[GpuControl]) -> State {
    let count = u32::try_from(gpus.len()).unwrap_or(u32::MAX);
    let mut writer = StateWriter::new().u32(count);
    for GpuControl { cap, batch } in gpus {
        writer = writer
            .f64(cap.target_w)
            .f64(cap.step_w)
            .u8(match cap.direction {
                Direction::Down => 0,
                Direction::Up => 1,
            })
            .u32(cap.improvements_in_a_row)
            .f64(cap.window.cap_w)
            .u32(cap.window.batch_size)
            .u64(cap.window.tokens)
            .f64(cap.window.energy_j)
            .u32(cap.window.ticks)
            .bool(cap.previous.is_some());
        if let Some(previous) = cap.previous {
            writer = writer.f64(previous.cap_w).f64(previous.tokens_per_j);
        }
        writer = writer.bool(cap.slo_floor.is_some());
        if let Some(floor) = cap.slo_floor {
            writer = writer.f64(floor.cap_w).u32(floor.windows_left);
        }
        writer = writer.bool(batch.pending.is_some());
        if let Some(size) = batch.pending {
            writer = writer.u32(size);
        }
    }
    writer.finish(SCHEMA_VERSION)
}

/// The controls in `state`, laid over `current` (this instance's GPUs, whose ranges and
/// configuration win: the new version's spec may have changed them). Nothing is changed
/// unless all of `state` reads back.
pub(crate) fn decode(
    state: &State,
    current: &[GpuControl],
    config: &Config,
) -> Result<Vec<GpuControl>, String> {
    if state.schema_version != SCHEMA_VERSION {
        return Err(format!(
            "cap-and-batch reads state schema version {SCHEMA_VERSION}, got version {}; \
             starting both loops afresh",
            state.schema_version
        ));
    }
    let mut reader = StateReader::new(&state.bytes);
    let count = reader.u32()?;
    if usize::try_from(count).ok() != Some(current.len()) {
        return Err(format!(
            "the state is for {count} GPUs but this instance manages {}; starting afresh",
            current.len()
        ));
    }
    let mut restored = Vec::with_capacity(current.len());
    for control in current {
        let GpuControl { mut cap, mut batch } = control.clone();
        let gpu = cap.gpu;
        let finite = |name: &str, value: f64| {
            if value.is_finite() {
                Ok(value)
            } else {
                Err(format!("gpu {gpu}: {name} in the state is {value}"))
            }
        };
        // The new spec's guardrails may have narrowed the range.
        cap.target_w = finite("target_w", reader.f64()?)?
            .max(cap.min_w)
            .min(cap.max_w);
        cap.step_w = finite("step_w", reader.f64()?)?
            .max(config.cap.min_step_w)
            .min(config.cap.step_w);
        cap.direction = match reader.u8()? {
            0 => Direction::Down,
            1 => Direction::Up,
            other => return Err(format!("gpu {gpu}: direction {other} in the state")),
        };
        cap.improvements_in_a_row = reader.u32()?;
        cap.window = Window {
            cap_w: finite("window cap_w", reader.f64()?)?,
            batch_size: reader.u32()?,
            tokens: reader.u64()?,
            energy_j: finite("window energy_j", reader.f64()?)?.max(0.0),
            ticks: reader.u32()?,
        };
        cap.previous = if reader.bool()? {
            let cap_w = finite("previous cap_w", reader.f64()?)?;
            let tokens_per_j = finite("previous tokens_per_j", reader.f64()?)?;
            // A reference of zero or less would turn every gain into nonsense.
            (tokens_per_j > 0.0).then_some(Measurement {
                cap_w,
                tokens_per_j,
            })
        } else {
            None
        };
        cap.slo_floor = if reader.bool()? {
            Some(SloFloor {
                cap_w: finite("floor cap_w", reader.f64()?)?,
                windows_left: reader.u32()?.min(config.cap.slo_hold_windows),
            })
            .filter(|floor| floor.windows_left > 0)
        } else {
            None
        };
        batch.pending = if reader.bool()? {
            Some(reader.u32()?.clamp(1, batch.max))
        } else {
            None
        };
        restored.push(GpuControl { cap, batch });
    }
    reader.finish()?;
    Ok(restored)
}
