//! Hand-over of a [`LadderSearch`] at a hot swap.

use crate::ladder::{Floor, LadderSearch, LadderWindow, QueueSuspect};
use crate::ladder_config::LadderConfig;
use crate::measure::{ArmRecord, Noise, ShiftDetector};
use crate::stats::RunningStats;
use tokwatt_policy_sdk::{StateReader, StateWriter};

/// Hand-over of a ladder search at a hot swap, little-endian:
///
/// ```text
/// u32 rung count, per rung an ArmRecord (5 x [u32 count, f64 mean, f64 m2]),
/// u32 current, u32 lo, u32 hi, bool has incumbent [u32 incumbent],
/// u32 windows_at_incumbent, u8 recheck direction (0 down, 1 up),
/// bool has floor [u32 rung, u32 windows_left],
/// window: ArmRecord, [u32 count, f64 mean, f64 m2] p99, u32 queue_start, u32 queue_last,
/// [u32 count, f64 mean, f64 m2] TTFT p99, f64 tokens made, f64 tokens asked for,
/// u32 in flight at the start, u32 in flight last, u32 batch size (since schema 3),
/// noise: f64 x2, shift: f64 ratio, u32 ticks_off, f64 demand, u32 mismatch_ticks,
/// bool raised,
/// bool has queue suspect [u32 rung, u32 reference], bool recovering
/// ```
impl LadderWindow {
    /// The visit's record, p99 statistics and queue depths (the ladder search's and the
    /// joint search's hand-overs share this layout).
    pub fn write(&self, writer: StateWriter) -> StateWriter {
        let writer = self.record.write(writer);
        let writer = self
            .tpot_p99_ms
            .write(writer)
            .u32(self.queue_start)
            .u32(self.queue_last);
        self.ttft_p99_ms
            .write(writer)
            .f64(self.tokens_made)
            .f64(self.tokens_demanded)
            .u32(self.in_flight_start)
            .u32(self.in_flight_last)
            .u32(self.batch_size)
    }

    /// A window written by [`LadderWindow::write`].
    pub fn read(reader: &mut StateReader<'_>, memory: u32) -> Result<LadderWindow, String> {
        Ok(LadderWindow {
            record: ArmRecord::read(reader, memory)?,
            tpot_p99_ms: RunningStats::read(reader, memory)?,
            queue_start: reader.u32()?,
            queue_last: reader.u32()?,
            ttft_p99_ms: RunningStats::read(reader, memory)?,
            tokens_made: reader.f64()?,
            tokens_demanded: reader.f64()?,
            in_flight_start: reader.u32()?,
            in_flight_last: reader.u32()?,
            batch_size: reader.u32()?,
        })
    }
}

impl LadderSearch {
    #[must_use]
    pub fn write_state(&self, writer: StateWriter) -> StateWriter {
        let as_u32 = |value: usize| u32::try_from(value).unwrap_or(u32::MAX);
        let mut writer = writer.u32(as_u32(self.rungs.len()));
        for rung in &self.rungs {
            writer = rung.write(writer);
        }
        writer = writer
            .u32(as_u32(self.current))
            .u32(as_u32(self.lo))
            .u32(as_u32(self.hi))
            .bool(self.incumbent.is_some());
        if let Some(incumbent) = self.incumbent {
            writer = writer.u32(as_u32(incumbent));
        }
        writer = writer
            .u32(self.windows_at_incumbent)
            .u8(u8::from(self.recheck_direction > 0))
            .bool(self.floor.is_some());
        if let Some(floor) = self.floor {
            writer = writer.u32(as_u32(floor.rung)).u32(floor.windows_left);
        }
        writer = self.window.write(writer);
        writer = self.noise.write(writer);
        writer = self
            .shift
            .write(writer)
            .u32(self.mismatch_ticks)
            .bool(self.raised)
            .bool(self.queue_suspect.is_some());
        if let Some(suspect) = self.queue_suspect {
            writer = writer
                .u32(as_u32(suspect.rung))
                .u32(as_u32(suspect.reference));
        }
        writer.bool(self.recovering)
    }

    /// This search with the handed-over state read from `reader` laid over it.
    ///
    /// # Errors
    /// Another number of rungs (the ladder changed), a truncated record, a value that is
    /// not finite or a rung outside the ladder, naming the GPU.
    pub fn read_state(
        &self,
        reader: &mut StateReader<'_>,
        config: &LadderConfig,
    ) -> Result<LadderSearch, String> {
        let gpu = self.gpu;
        let memory = config.memory_ticks;
        let count = reader.u32()? as usize;
        if count != self.rungs.len() {
            return Err(format!(
                "gpu {gpu}: the state searched {count} settings, this instance has {}; \
                 starting afresh",
                self.rungs.len()
            ));
        }
        let rung = |value: u32, name: &str| -> Result<usize, String> {
            let value = value as usize;
            if value < count {
                Ok(value)
            } else {
                Err(format!(
                    "gpu {gpu}: {name} {value} in the state is off the ladder"
                ))
            }
        };
        let mut search = self.clone();
        for record in &mut search.rungs {
            *record = ArmRecord::read(reader, memory)?;
        }
        search.current = rung(reader.u32()?, "current rung")?;
        search.lo = rung(reader.u32()?, "bracket low")?;
        search.hi = rung(reader.u32()?, "bracket high")?.max(search.lo);
        search.incumbent = if reader.bool()? {
            Some(rung(reader.u32()?, "incumbent")?)
        } else {
            None
        };
        search.windows_at_incumbent = reader.u32()?;
        search.recheck_direction = if reader.u8()? == 0 { -1 } else { 1 };
        search.floor = if reader.bool()? {
            Some(Floor {
                rung: rung(reader.u32()?, "floor")?,
                windows_left: reader.u32()?.min(config.floor_hold_windows),
            })
        } else {
            None
        };
        search.window = LadderWindow::read(reader, memory)?;
        search.noise = Noise::read(reader)?;
        search.shift = ShiftDetector::read(reader)?;
        search.mismatch_ticks = reader.u32()?;
        search.raised = reader.bool()?;
        search.queue_suspect = if reader.bool()? {
            Some(QueueSuspect {
                rung: rung(reader.u32()?, "queue suspect")?,
                reference: rung(reader.u32()?, "queue reference")?,
            })
        } else {
            None
        };
        search.recovering = reader.bool()?;
        Ok(search)
    }
}
