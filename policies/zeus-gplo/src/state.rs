//! Hand-over at a hot swap: schema version 1, little-endian.
//!
//! ```text
//! u32 number of limits profiled (must match the new instance's),
//! u8 phase: 0 ready [u32 next, u32 ticks left]
//!           1 warmup [u32 index, u32 ticks left]
//!           2 profiling [u32 index, u32 ticks left, f64 energy J, u64 tokens, f64 time s]
//!           3 done [f64 cap W, u32 block ticks, f64 block tokens/s sum,
//!                   bool has reference [f64 tokens/s]]
//! u32 measurements, then per measurement f64 cap W, f64 J/token, f64 s/token
//! ```

use crate::selector::Measurement;
use crate::{Phase, ZeusGplo};
use tokwatt_policy_sdk::{State, StateReader, StateWriter};

pub(crate) const SCHEMA_VERSION: u32 = 1;

pub(crate) fn encode(policy: &ZeusGplo) -> State {
    let mut writer = StateWriter::new().u32(policy.limits.len() as u32);
    writer = match policy.phase {
        Phase::Ready { next, ticks_left } => writer.u8(0).u32(next as u32).u32(ticks_left),
        Phase::Warmup { index, ticks_left } => writer.u8(1).u32(index as u32).u32(ticks_left),
        Phase::Profiling {
            index,
            ticks_left,
            energy_j,
            tokens,
            time_s,
        } => writer
            .u8(2)
            .u32(index as u32)
            .u32(ticks_left)
            .f64(energy_j)
            .u64(tokens)
            .f64(time_s),
        Phase::Done {
            cap_w,
            block_ticks,
            block_tokens_per_s,
            reference,
        } => {
            let writer = writer
                .u8(3)
                .f64(cap_w)
                .u32(block_ticks)
                .f64(block_tokens_per_s)
                .bool(reference.is_some());
            match reference {
                Some(reference) => writer.f64(reference),
                None => writer,
            }
        }
    };
    writer = writer.u32(policy.measurements.len() as u32);
    for m in &policy.measurements {
        writer = writer.f64(m.cap_w).f64(m.energy_j).f64(m.time_s);
    }
    writer.finish(SCHEMA_VERSION)
}

fn finite(name: &str, value: f64) -> Result<f64, String> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(format!("{name} in the state is {value}"))
    }
}

pub(crate) fn decode(
    state: &State,
    policy: &ZeusGplo,
) -> Result<(Phase, Vec<Measurement>), String> {
    if state.schema_version != SCHEMA_VERSION {
        return Err(format!(
            "this policy reads state schema version {SCHEMA_VERSION}, got version {}; \
             starting afresh",
            state.schema_version
        ));
    }
    let mut reader = StateReader::new(&state.bytes);
    let limits = reader.u32()? as usize;
    if limits != policy.limits.len() {
        return Err(format!(
            "the state profiles {limits} power limits but this instance {}; starting afresh",
            policy.limits.len()
        ));
    }
    let index = |reader: &mut StateReader<'_>| -> Result<usize, String> {
        let index = reader.u32()? as usize;
        if index < limits {
            Ok(index)
        } else {
            Err(format!("limit index {index} in the state, of {limits}"))
        }
    };
    let phase = match reader.u8()? {
        0 => Phase::Ready {
            next: index(&mut reader)?,
            ticks_left: reader.u32()?,
        },
        1 => Phase::Warmup {
            index: index(&mut reader)?,
            ticks_left: reader.u32()?,
        },
        2 => Phase::Profiling {
            index: index(&mut reader)?,
            ticks_left: reader.u32()?,
            energy_j: finite("profile energy", reader.f64()?)?,
            tokens: reader.u64()?,
            time_s: finite("profile time", reader.f64()?)?,
        },
        3 => Phase::Done {
            cap_w: finite("kept limit", reader.f64()?)?,
            block_ticks: reader.u32()?,
            block_tokens_per_s: finite("block tokens/s", reader.f64()?)?,
            reference: if reader.bool()? {
                Some(finite("reference tokens/s", reader.f64()?)?)
            } else {
                None
            },
        },
        other => return Err(format!("phase {other} in the state")),
    };
    let count = reader.u32()? as usize;
    if count > limits {
        return Err(format!(
            "{count} measurements in the state, of {limits} limits"
        ));
    }
    let mut measurements = Vec::with_capacity(count);
    for _ in 0..count {
        measurements.push(Measurement {
            cap_w: finite("measured limit", reader.f64()?)?,
            energy_j: finite("measured energy", reader.f64()?)?,
            time_s: finite("measured time", reader.f64()?)?,
        });
    }
    reader.finish()?;
    Ok((phase, measurements))
}
