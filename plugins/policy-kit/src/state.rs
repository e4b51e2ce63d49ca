//! Hand-over of a policy's per-GPU state at a hot swap, little-endian.
//!
//! A policy's state is a count of GPUs followed by one record per GPU
//! ([`encode_per_gpu`], [`decode_per_gpu`]). A record that holds a [`CapSearch`] starts
//! with the search's part ([`CapSearch::write_state`], [`CapSearch::read_state`]):
//!
//! ```text
//! f64 target_w, f64 step_w, u8 direction (0 down, 1 up), u32 improvements_in_a_row,
//! f64 window cap_w, [u32 window batch_size, under WindowScope::CapAndBatch only]
//! u64 window tokens, f64 window energy_j, u32 window ticks,
//! bool has previous [f64 cap_w, f64 tokens_per_j],
//! bool has objective floor [f64 cap_w, u32 windows_left]
//! ```

use crate::config::CapConfig;
use crate::search::{CapSearch, Direction, Measurement, SloFloor, Window, WindowScope};
use tokwatt_policy_sdk::{State, StateReader, StateWriter};

/// The state of the per-GPU `controls`: their count, then one record each, written by
/// `write_record`.
pub fn encode_per_gpu<T>(
    schema_version: u32,
    controls: &[T],
    mut write_record: impl FnMut(StateWriter, &T) -> StateWriter,
) -> State {
    let count = u32::try_from(controls.len()).unwrap_or(u32::MAX);
    let mut writer = StateWriter::new().u32(count);
    for control in controls {
        writer = write_record(writer, control);
    }
    writer.finish(schema_version)
}

/// The per-GPU controls in `state`, each read by `read_record` over a copy of this
/// instance's control for that GPU (whose ranges and configuration win: the new
/// version's spec may have changed them). Nothing is returned unless all of `state`
/// reads back.
///
/// # Errors
/// Another schema version, another number of GPUs, a record that does not read back, or
/// bytes left over; each message says that the policy starts afresh.
pub fn decode_per_gpu<T: Clone>(
    state: &State,
    schema_version: u32,
    current: &[T],
    mut read_record: impl FnMut(&mut StateReader<'_>, T) -> Result<T, String>,
) -> Result<Vec<T>, String> {
    if state.schema_version != schema_version {
        return Err(format!(
            "this policy reads state schema version {schema_version}, got version {}; \
             starting afresh",
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
        restored.push(read_record(&mut reader, control.clone())?);
    }
    reader.finish()?;
    Ok(restored)
}

impl CapSearch {
    /// Appends the search's part of a record to `writer`, in the layout above.
    #[must_use]
    pub fn write_state(&self, writer: StateWriter) -> StateWriter {
        let mut writer = writer
            .f64(self.target_w)
            .f64(self.step_w)
            .u8(match self.direction {
                Direction::Down => 0,
                Direction::Up => 1,
            })
            .u32(self.improvements_in_a_row)
            .f64(self.window.cap_w);
        if self.scope == WindowScope::CapAndBatch {
            writer = writer.u32(self.window.batch_size);
        }
        writer = writer
            .u64(self.window.tokens)
            .f64(self.window.energy_j)
            .u32(self.window.ticks)
            .bool(self.previous.is_some());
        if let Some(previous) = self.previous {
            writer = writer.f64(previous.cap_w).f64(previous.tokens_per_j);
        }
        writer = writer.bool(self.slo_floor.is_some());
        if let Some(floor) = self.slo_floor {
            writer = writer.f64(floor.cap_w).u32(floor.windows_left);
        }
        writer
    }

    /// This search with the handed-over part of a record read from `reader` laid over
    /// it: values are fitted to this search's range and `config`, which may have changed.
    ///
    /// # Errors
    /// A truncated record, a value that is not finite, or an unknown direction, naming
    /// the GPU and the field.
    pub fn read_state(
        &self,
        reader: &mut StateReader<'_>,
        config: &CapConfig,
    ) -> Result<CapSearch, String> {
        let mut search = self.clone();
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
            batch_size: match search.scope {
                WindowScope::Cap => 0,
                WindowScope::CapAndBatch => reader.u32()?,
            },
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
        Ok(search)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_policy_sdk::{Params, testing};

    /// The documented defaults.
    fn config() -> CapConfig {
        CapConfig::from_params(&Params::new(&[])).unwrap_or_else(|error| panic!("{error}"))
    }

    /// A search on `gpu` with every field away from its starting value.
    fn busy_search(gpu: u32, scope: WindowScope) -> CapSearch {
        let mut search = CapSearch::new(&testing::h200(gpu), &config(), scope)
            .unwrap_or_else(|error| panic!("{error}"));
        search.target_w = 480.0;
        search.step_w = 20.0;
        search.direction = Direction::Up;
        search.improvements_in_a_row = 2;
        search.window = Window {
            cap_w: 460.0,
            batch_size: if scope == WindowScope::Cap { 0 } else { 192 },
            tokens: 123_456,
            energy_j: 4321.5,
            ticks: 3,
        };
        search.previous = Some(Measurement {
            cap_w: 440.0,
            tokens_per_j: 19.5,
        });
        search.slo_floor = Some(SloFloor {
            cap_w: 400.0,
            windows_left: 4,
        });
        search
    }

    fn encode(searches: &[CapSearch]) -> State {
        encode_per_gpu(7, searches, |writer, search| search.write_state(writer))
    }

    fn decode(state: &State, current: &[CapSearch]) -> Result<Vec<CapSearch>, String> {
        decode_per_gpu(state, 7, current, |reader, search| {
            search.read_state(reader, &config())
        })
    }

    #[test]
    fn searches_round_trip_in_both_scopes_and_only_the_batch_scope_writes_the_batch() {
        let mut lengths = Vec::new();
        for scope in [WindowScope::Cap, WindowScope::CapAndBatch] {
            let old = [busy_search(0, scope), busy_search(1, scope)];
            let state = encode(&old);
            assert_eq!(state.schema_version, 7);
            let fresh = [0, 1].map(|gpu| {
                CapSearch::new(&testing::h200(gpu), &config(), scope)
                    .unwrap_or_else(|error| panic!("{error}"))
            });
            assert_eq!(decode(&state, &fresh), Ok(old.to_vec()), "{scope:?}");
            lengths.push(state.bytes.len());
        }
        // Per GPU, the batch scope adds one u32: the window's batch size.
        assert_eq!(lengths[1] - lengths[0], 2 * 4);
    }

    #[test]
    fn restored_values_are_fitted_to_the_new_range_and_config() {
        let state = encode(&[busy_search(0, WindowScope::Cap)]);
        let mut device = testing::h200(0);
        device.power_cap_max_w = 450.0;
        let mut narrower = config();
        narrower.step_w = 15.0;
        narrower.slo_hold_windows = 2;
        let current = CapSearch::new(&device, &narrower, WindowScope::Cap)
            .unwrap_or_else(|error| panic!("{error}"));
        let restored = decode_per_gpu(&state, 7, &[current], |reader, search| {
            search.read_state(reader, &narrower)
        });
        let Ok([restored]) = restored.as_deref() else {
            panic!("{restored:?}");
        };
        assert_eq!(restored.target_w, 450.0);
        assert_eq!(restored.step_w, 15.0);
        assert_eq!(restored.slo_floor.map(|floor| floor.windows_left), Some(2));
    }

    #[test]
    fn foreign_or_damaged_state_is_refused_by_what_is_wrong() {
        let current = [busy_search(0, WindowScope::Cap)];
        let good = encode(&current);
        let error = |state: &State| decode(state, &current).err().unwrap_or_default();

        let other_schema = State {
            schema_version: 8,
            bytes: good.bytes.clone(),
        };
        assert!(error(&other_schema).contains("schema version 7, got version 8"));
        let two_gpus = encode(&[current[0].clone(), current[0].clone()]);
        assert!(error(&two_gpus).contains("the state is for 2 GPUs"));
        let mut truncated = good.clone();
        truncated.bytes.pop();
        assert!(!error(&truncated).is_empty());
        let mut extended = good.clone();
        extended.bytes.push(0);
        assert!(error(&extended).contains("unexpected bytes"));
        let mut not_a_number = good.clone();
        not_a_number.bytes[4..12].copy_from_slice(&f64::NAN.to_le_bytes());
        assert!(error(&not_a_number).contains("gpu 0: target_w in the state is NaN"));
        let mut bad_direction = good;
        bad_direction.bytes[20] = 2;
        assert!(error(&bad_direction).contains("gpu 0: direction 2"));
    }
}
