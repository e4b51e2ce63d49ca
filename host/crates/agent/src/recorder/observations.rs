//! `observations.jsonl`: every GPU's [`TickRecord`] of every tick, one JSON object a line
//! with its format version, for deterministic replay. Written by the recorder, read back
//! here, across a rotating run's files oldest first.

use std::io::BufRead;
use std::path::{Path, PathBuf};

#[cfg(test)]
use serde::Serialize;

use super::{OBSERVATIONS_FILE, OBSERVATIONS_FORMAT_VERSION, TickRecord};

/// One line as written: the record with its format version (the recorder writes these
/// bytes faster itself, `recorder::write_observation_line`; the tests pin them to this).
#[cfg(test)]
#[derive(Debug, Serialize)]
pub(super) struct ObservationLine<'a> {
    pub(super) format_version: u32,
    #[serde(flatten)]
    pub(super) record: &'a TickRecord,
}

/// Why `observations.jsonl` could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ObservationError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is damaged at line {line}: {reason}", path.display())]
    Damaged {
        path: PathBuf,
        line: u64,
        reason: String,
    },
    #[error(
        "{} is in observations.jsonl format version {found}, and this tokwatt reads version {supported}",
        path.display()
    )]
    ForeignVersion {
        path: PathBuf,
        found: u64,
        supported: u32,
    },
}

/// One record read back, with the file it came from.
#[derive(Debug, Clone)]
pub struct RecordedLine {
    pub path: PathBuf,
    pub line: u64,
    pub record: TickRecord,
}

/// The observation files of the run in `dir`, oldest first: `observations.N.jsonl` …
/// `observations.1.jsonl` (a rotating run's older ones, see [`super::Rotation`]), then
/// `observations.jsonl`.
pub fn observation_files(dir: &Path) -> Result<Vec<PathBuf>, ObservationError> {
    let entries = std::fs::read_dir(dir).map_err(|source| ObservationError::Read {
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

/// Reads a run's records in the order they were written, a line at a time, across its
/// rotated files; every line's format version is checked before it is read.
#[derive(Debug)]
pub struct ObservationReader {
    /// Files still to open, the next last.
    files: Vec<PathBuf>,
    current: Option<OpenFile>,
}

#[derive(Debug)]
struct OpenFile {
    path: PathBuf,
    lines: std::io::Lines<std::io::BufReader<std::fs::File>>,
    line: u64,
}

impl ObservationReader {
    /// The records of the run in `dir`.
    pub fn open(dir: &Path) -> Result<Self, ObservationError> {
        let mut files = observation_files(dir)?;
        files.reverse();
        Ok(Self {
            files,
            current: None,
        })
    }

    fn next_record(&mut self) -> Option<Result<RecordedLine, ObservationError>> {
        loop {
            let file = match &mut self.current {
                Some(file) => file,
                None => {
                    let path = self.files.pop()?;
                    match std::fs::File::open(&path) {
                        Ok(opened) => {
                            self.current = Some(OpenFile {
                                lines: std::io::BufReader::new(opened).lines(),
                                path,
                                line: 0,
                            });
                            continue;
                        }
                        Err(source) => return Some(Err(ObservationError::Read { path, source })),
                    }
                }
            };
            let Some(text) = file.lines.next() else {
                self.current = None;
                continue;
            };
            file.line += 1;
            let text = match text {
                Ok(text) => text,
                Err(source) => {
                    return Some(Err(ObservationError::Read {
                        path: file.path.clone(),
                        source,
                    }));
                }
            };
            if text.trim().is_empty() {
                continue;
            }
            return Some(
                parse_line(&file.path, file.line, &text).map(|record| RecordedLine {
                    path: file.path.clone(),
                    line: file.line,
                    record,
                }),
            );
        }
    }
}

impl Iterator for ObservationReader {
    type Item = Result<RecordedLine, ObservationError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_record()
    }
}

/// One line of `path` (`line` for messages): its version checked, then the record.
pub(super) fn parse_line(
    path: &Path,
    line: u64,
    text: &str,
) -> Result<TickRecord, ObservationError> {
    let damaged = |reason: String| ObservationError::Damaged {
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
            return Err(ObservationError::ForeignVersion {
                path: path.to_owned(),
                found,
                supported: OBSERVATIONS_FORMAT_VERSION,
            });
        }
        None => return Err(damaged("the record has no numeric format_version".into())),
    }
    serde_json::from_value(value).map_err(|error| damaged(error.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recorder::{Recorder, Rotation};
    use tokwatt_core::types::{Observation, Settings};

    fn record(tick: u64) -> TickRecord {
        TickRecord {
            requested: Settings {
                power_cap_w: Some(f64::NAN),
                sm_clock_max_mhz: None,
                batch_size: Some(8),
                token_budget: None,
            },
            guard: tick == 1,
            energy_counter_j: 1.5,
            ..TickRecord::unchanged((tick + 1) as f64, "p", Observation::typical_h200(0, tick))
        }
    }

    #[test]
    fn records_read_back_as_written_across_rotated_files_oldest_first() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rotation = Rotation {
            max_bytes: 4096,
            keep: 50,
        };
        let mut recorder = Recorder::create_rotating(dir.path(), false, rotation).expect("create");
        let mut first = record(0);
        first.observation.tpot_p99_ms = f64::NAN;
        recorder.record(&first).expect("record");
        for tick in 1..40 {
            recorder.record(&record(tick)).expect("record");
        }
        recorder.finish(&"summary").expect("finish");
        assert!(
            observation_files(dir.path()).expect("files").len() > 2,
            "rotated"
        );
        let read: Vec<RecordedLine> = ObservationReader::open(dir.path())
            .expect("open")
            .collect::<Result<_, _>>()
            .expect("records");
        let ticks: Vec<u64> = read.iter().map(|r| r.record.observation.tick).collect();
        assert_eq!(ticks, (0..40).collect::<Vec<_>>());
        // NaN is written as null: an observation reads it back as NaN, a request as no
        // value (replay compares a decision as it would have been recorded).
        assert!(read[0].record.observation.tpot_p99_ms.is_nan());
        assert_eq!(read[0].record.requested.power_cap_w, None);
        assert_eq!(read[1].record.requested.batch_size, Some(8));
        assert!(read[1].record.guard && !read[2].record.guard);
        assert_eq!(read[3].record.energy_counter_j, 1.5);
    }

    #[test]
    fn a_foreign_or_damaged_line_is_named_with_its_file_and_line() {
        let path = Path::new("o.jsonl");
        let line = serde_json::to_string(&ObservationLine {
            format_version: OBSERVATIONS_FORMAT_VERSION,
            record: &record(1),
        })
        .expect("serialises");
        parse_line(path, 1, &line).expect("reads");
        let foreign = line.replacen("\"format_version\":1", "\"format_version\":2", 1);
        assert_ne!(foreign, line);
        let error = parse_line(path, 7, &foreign)
            .expect_err("foreign")
            .to_string();
        assert!(
            error.contains("format version 2") && error.contains("reads version 1"),
            "{error}"
        );
        let error = parse_line(path, 7, "{\"format_version\":1}")
            .expect_err("damaged")
            .to_string();
        assert!(error.contains("o.jsonl is damaged at line 7"), "{error}");
    }
}
