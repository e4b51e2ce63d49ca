//! Reading the run back: its summary through the recorder's reader, and its
//! `observations.jsonl` through the recorder's reader, grouped into recorded ticks.

use std::path::{Path, PathBuf};

use tokwatt_agent::recorder::{
    OBSERVATIONS_FILE, OBSERVATIONS_FORMAT_VERSION, ObservationError, ObservationReader,
    RecordedLine,
};
use tokwatt_agent::{self as agent, RunSummary, SummaryError};
use tokwatt_core::types::{Observation, Settings};

use super::*;

/// One recorded tick: every GPU's line.
pub(super) struct RecordedTick {
    pub(super) tick: u64,
    pub(super) time_s: f64,
    pub(super) policy: String,
    pub(super) fallback: bool,
    pub(super) observations: Vec<Observation>,
    pub(super) requested: Vec<Settings>,
}

/// The run's summary through the recorder's one reader, and its observations' version
/// checked against this replay's.
pub(super) fn read_summary(dir: &Path) -> Result<RunSummary, ReplayError> {
    let summary = agent::read_summary(dir)?;
    let found = summary.output_formats.observations_jsonl;
    if found != OBSERVATIONS_FORMAT_VERSION {
        return Err(ReplayError::ForeignVersion {
            path: dir.join(OBSERVATIONS_FILE),
            what: "observations.jsonl",
            found: u64::from(found),
            supported: OBSERVATIONS_FORMAT_VERSION,
        });
    }
    Ok(summary)
}

impl From<SummaryError> for ReplayError {
    fn from(error: SummaryError) -> Self {
        match error {
            SummaryError::NotARun { dir } => Self::NotARun { dir },
            SummaryError::Read { path, source } => Self::Read { path, source },
            SummaryError::Damaged { path, line, reason } => Self::Damaged { path, line, reason },
            SummaryError::ForeignVersion {
                path,
                found,
                supported,
            } => Self::ForeignVersion {
                path,
                what: "summary.json",
                found,
                supported,
            },
        }
    }
}

impl From<ObservationError> for ReplayError {
    fn from(error: ObservationError) -> Self {
        match error {
            ObservationError::Read { path, source } => Self::Read { path, source },
            ObservationError::Damaged { path, line, reason } => {
                Self::Damaged { path, line, reason }
            }
            ObservationError::ForeignVersion {
                path,
                found,
                supported,
            } => Self::ForeignVersion {
                path,
                what: "observations.jsonl",
                found,
                supported,
            },
        }
    }
}

/// Calls `each` with every recorded tick in order, until it returns `false`.
pub(super) fn for_each_recorded_tick(
    dir: &Path,
    gpus: usize,
    each: &mut dyn FnMut(RecordedTick) -> Result<bool, ReplayError>,
) -> Result<(), ReplayError> {
    let mut pending: Option<(RecordedTick, PathBuf)> = None;
    let complete = |tick: RecordedTick, path: &Path| -> Result<RecordedTick, ReplayError> {
        if tick.observations.len() == gpus {
            Ok(tick)
        } else {
            Err(ReplayError::TickIncomplete {
                path: path.to_owned(),
                tick: tick.tick,
                found: tick.observations.len(),
                expected: gpus,
            })
        }
    };
    for line in ObservationReader::open(dir)? {
        let RecordedLine { path, record, .. } = line?;
        let tick = record.observation.tick;
        if let Some((current, _)) = &mut pending
            && current.tick == tick
        {
            current.observations.push(record.observation);
            current.requested.push(record.requested);
            continue;
        }
        if let Some((done, done_path)) = pending.take()
            && !each(complete(done, &done_path)?)?
        {
            return Ok(());
        }
        pending = Some((
            RecordedTick {
                tick,
                time_s: record.time_s,
                policy: record.policy,
                fallback: record.fallback,
                observations: vec![record.observation],
                requested: vec![record.requested],
            },
            path,
        ));
    }
    if let Some((done, done_path)) = pending {
        each(complete(done, &done_path)?)?;
    }
    Ok(())
}
