//! Reading the run back: its summary through the recorder's reader, and its
//! `observations.jsonl` files (rotated ones oldest first) one recorded tick at a time.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use tokwatt_agent::recorder::OBSERVATIONS_FORMAT_VERSION;
use tokwatt_agent::{self as agent, RunSummary, SummaryError};
use tokwatt_core::types::{Observation, Settings};

use super::*;

pub(super) const OBSERVATIONS_FILE: &str = "observations.jsonl";

/// One line of `observations.jsonl` (`recorder::TickRecord`; its version is checked
/// before).
#[derive(Debug, Deserialize)]
pub(super) struct RecordedLine {
    pub(super) time_s: f64,
    pub(super) policy: String,
    pub(super) observation: Observation,
    pub(super) requested: Settings,
    pub(super) fallback: bool,
}

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

/// The observation files oldest first: `observations.N.jsonl` … `observations.1.jsonl`
/// (a rotating run's older ones, see `recorder::Rotation`), then `observations.jsonl`.
pub(super) fn observation_files(dir: &Path) -> Result<Vec<PathBuf>, ReplayError> {
    let entries = std::fs::read_dir(dir).map_err(|source| ReplayError::Read {
        path: dir.to_owned(),
        source,
    })?;
    let mut rotated: Vec<(u64, PathBuf)> = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(n) = name
            .strip_prefix("observations.")
            .and_then(|rest| rest.strip_suffix(".jsonl"))
            .and_then(|n| n.parse::<u64>().ok())
        {
            rotated.push((n, entry.path()));
        }
    }
    rotated.sort_by_key(|(n, _)| std::cmp::Reverse(*n));
    let mut files: Vec<PathBuf> = rotated.into_iter().map(|(_, path)| path).collect();
    files.push(dir.join(OBSERVATIONS_FILE));
    Ok(files)
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
    for path in observation_files(dir)? {
        let file = std::fs::File::open(&path).map_err(|source| ReplayError::Read {
            path: path.clone(),
            source,
        })?;
        for (index, line) in std::io::BufReader::new(file).lines().enumerate() {
            let line_number = index as u64 + 1;
            let line = line.map_err(|source| ReplayError::Read {
                path: path.clone(),
                source,
            })?;
            if line.trim().is_empty() {
                continue;
            }
            let record = parse_line(&path, line_number, &line)?;
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
                path.clone(),
            ));
        }
    }
    if let Some((done, done_path)) = pending {
        each(complete(done, &done_path)?)?;
    }
    Ok(())
}

pub(super) fn parse_line(path: &Path, line: u64, text: &str) -> Result<RecordedLine, ReplayError> {
    let damaged = |reason: String| ReplayError::Damaged {
        path: path.to_owned(),
        line,
        reason,
    };
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|error| damaged(error.to_string()))?;
    match value
        .get("format_version")
        .and_then(serde_json::Value::as_u64)
    {
        Some(found) if found == u64::from(OBSERVATIONS_FORMAT_VERSION) => {}
        Some(found) => {
            return Err(ReplayError::ForeignVersion {
                path: path.to_owned(),
                what: "observations.jsonl",
                found,
                supported: OBSERVATIONS_FORMAT_VERSION,
            });
        }
        None => return Err(damaged("the record has no numeric format_version".into())),
    }
    serde_json::from_value(value).map_err(|error| damaged(error.to_string()))
}
