//! Hand-over of the search state at a hot swap: schema version 1, little-endian.
//!
//! ```text
//! u32 number of GPUs, then per GPU:
//!   f64 target_w, f64 step_w, u8 direction (0 down, 1 up), u32 improvements_in_a_row,
//!   f64 window cap_w, u64 window tokens, f64 window energy_j, u32 window ticks,
//!   bool has previous [f64 cap_w, f64 tokens_per_j],
//!   bool has objective floor [f64 cap_w, u32 windows_left],
//!   bool raised_for_slo
//! ```

use crate::config::Config;
use crate::search::{Direction, GpuSearch, Measurement, SloFloor, Window};
use tokwatt_policy_sdk::{State, StateReader, StateWriter};

/// The version of the layout above.
pub(crate) const SCHEMA_VERSION: u32 = 1;

pub(crate) fn encode(searches: &[GpuSearch]) -> State {
    let count = u32::try_from(searches.len()).unwrap_or(u32::MAX);
    let mut writer = StateWriter::new().u32(count);
    for search in searches {
        writer = writer
            .f64(search.target_w)
            .f64(search.step_w)
            .u8(match search.direction {
                Direction::Down => 0,
                Direction::Up => 1,
            })
            .u32(search.improvements_in_a_row)
            .f64(search.window.cap_w)
            .u64(search.window.tokens)
            .f64(search.window.energy_j)
            .u32(search.window.ticks)
            .bool(search.previous.is_some());
        if let Some(previous) = search.previous {
            writer = writer.f64(previous.cap_w).f64(previous.tokens_per_j);
        }
        writer = writer.bool(search.slo_floor.is_some());
        if let Some(floor) = search.slo_floor {
            writer = writer.f64(floor.cap_w).u32(floor.windows_left);
        }
        writer = writer.bool(search.raised_for_slo);
    }
    writer.finish(SCHEMA_VERSION)
}

/// The searches in `state`, laid over `current` (this instance's GPUs, whose ranges and
/// configuration win: the new version's spec may have changed them). Nothing is changed
/// unless all of `state` reads back.
pub(crate) fn decode(
    state: &State,
    current: &[GpuSearch],
    config: &Config,
) -> Result<Vec<GpuSearch>, String> {
    if state.schema_version != SCHEMA_VERSION {
        return Err(format!(
            "hill-climb reads state schema version {SCHEMA_VERSION}, got version {}; \
             starting the search afresh",
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
    for search in current {
        let mut search = search.clone();
        let gpu = search.gpu;
        let finite = |name: &str, value: f64| {
            if value.is_finite() {
                Ok(value)
            } else {
                Err(format!("gpu {gpu}: {name} in the state is {value}"))
            }
        };
        // The new spec's guardrails may have narrowed the range.
        search.target_w = finite("target_w", reader.f64()?)?
            .max(search.min_w)
            .min(search.max_w);
        search.step_w = finite("step_w", reader.f64()?)?
            .max(config.min_step_w)
            .min(config.step_w);
        search.direction = match reader.u8()? {
            0 => Direction::Down,
            1 => Direction::Up,
            other => return Err(format!("gpu {gpu}: direction {other} in the state")),
        };
        search.improvements_in_a_row = reader.u32()?;
        search.window = Window {
            cap_w: finite("window cap_w", reader.f64()?)?,
            tokens: reader.u64()?,
            energy_j: finite("window energy_j", reader.f64()?)?.max(0.0),
            ticks: reader.u32()?,
        };
        search.previous = if reader.bool()? {
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
        search.slo_floor = if reader.bool()? {
            Some(SloFloor {
                cap_w: finite("floor cap_w", reader.f64()?)?,
                windows_left: reader.u32()?.min(config.slo_hold_windows),
            })
            .filter(|floor| floor.windows_left > 0)
        } else {
            None
        };
        search.raised_for_slo = reader.bool()?;
        restored.push(search);
    }
    reader.finish()?;
    Ok(restored)
}
