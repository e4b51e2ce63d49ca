//! `trace.csv`: one row per GPU per tick. [`TraceRow`] is the row as written and as read
//! back: the recorder serializes it, [`TraceReader`] deserializes it, so the file has one
//! layout in one place.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::TickRecord;
use tokwatt_core::types::Observation;

/// Why `trace.csv` could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: csv::Error },
    #[error(
        "{} has no `{column}` column: it is not a tokwatt trace, or one damaged at its first line",
        path.display()
    )]
    MissingColumn { path: PathBuf, column: String },
    #[error("{}, line {line}: `{column}` is `{value}`, which is not a valid {column} ({reason})", path.display())]
    BadValue {
        path: PathBuf,
        line: u64,
        column: String,
        value: String,
        reason: String,
    },
}

/// One row of `trace.csv`. The field order is the column order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceRow {
    pub time_s: f64,
    pub tick: u64,
    pub gpu: u32,
    pub policy: String,
    /// The enforced power limit during the window.
    pub power_cap_w: f64,
    /// The power limit tokwatt had requested during the window.
    pub power_cap_requested_w: f64,
    pub sm_clock_max_mhz: u32,
    pub batch_size: u32,
    /// The token budget per step during the window; empty where the workload has none
    /// (format 3 on).
    pub token_budget: Option<u32>,
    pub power_avg_w: f64,
    pub power_peak_w: f64,
    pub energy_j: f64,
    pub energy_counter_j: f64,
    pub tokens: u64,
    pub tokens_per_joule: f64,
    pub tokens_per_s: f64,
    pub sm_clock_mhz: u32,
    pub mem_clock_mhz: u32,
    pub temperature_c: f64,
    pub gpu_util_pct: f64,
    pub tpot_p50_ms: f64,
    pub tpot_p99_ms: f64,
    pub active_sequences: u32,
    pub queue_depth: u32,
    pub sw_power_cap: u8,
    pub settling: u8,
    pub clamped: u8,
    pub fallback: u8,
    pub slo_violation: u8,
    /// Empty where the GPU does not report memory power.
    pub power_mem_w: Option<f64>,
    /// Demand in the window; all four empty where the workload does not report demand.
    pub requests_arrived: Option<u64>,
    pub requests_turned_away: Option<u64>,
    pub tokens_demanded: Option<u64>,
    pub queue_wait_p99_ms: Option<f64>,
    /// Requests in the window; all empty where the workload does not see requests
    /// through (format 2 on; a format 1 trace has none of these columns).
    pub prefill_tokens: Option<u64>,
    pub ttft_p99_ms: Option<f64>,
    pub prefill_time_share: Option<f64>,
    pub requests_finished: Option<u64>,
    /// Mean energy of the requests finished in the window (empty when none finished).
    pub energy_per_request_j: Option<f64>,
}

/// `value` rounded to `decimals` places, so the trace stays short to read and to store.
fn round(value: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (value * scale).round() / scale
}

impl TraceRow {
    pub(super) fn new(r: &TickRecord) -> Self {
        let o = &r.observation;
        // The settings in force during the window are the ones the observation reports.
        Self {
            time_s: round(r.time_s, 3),
            tick: o.tick,
            gpu: o.gpu,
            policy: r.policy.clone(),
            power_cap_w: round(o.in_force.power_cap_w, 1),
            power_cap_requested_w: round(o.in_force.power_cap_requested_w, 1),
            sm_clock_max_mhz: o.in_force.sm_clock_max_mhz,
            batch_size: o.in_force.batch_size,
            token_budget: (o.in_force.token_budget > 0).then_some(o.in_force.token_budget),
            power_avg_w: round(o.power_avg_w, 2),
            power_peak_w: round(o.power_peak_w, 2),
            energy_j: round(o.energy_j, 4),
            energy_counter_j: round(r.energy_counter_j, 3),
            tokens: o.tokens,
            tokens_per_joule: round(o.tokens_per_joule, 5),
            tokens_per_s: round(o.tokens_per_s, 2),
            sm_clock_mhz: o.sm_clock_mhz,
            mem_clock_mhz: o.mem_clock_mhz,
            temperature_c: round(o.temperature_c, 1),
            gpu_util_pct: round(o.gpu_util_pct, 1),
            tpot_p50_ms: round(o.tpot_p50_ms, 3),
            tpot_p99_ms: round(o.tpot_p99_ms, 3),
            active_sequences: o.active_sequences,
            queue_depth: o.queue_depth,
            sw_power_cap: u8::from(o.clock_events.sw_power_cap),
            settling: u8::from(o.settling),
            clamped: u8::from(r.clamped),
            fallback: u8::from(r.fallback),
            slo_violation: u8::from(r.slo_violation),
            power_mem_w: r.power_mem_avg_w.map(|w| round(w, 2)),
            requests_arrived: o.demand.map(|d| d.requests_arrived),
            requests_turned_away: o.demand.map(|d| d.requests_turned_away),
            tokens_demanded: o.demand.map(|d| d.tokens_demanded),
            queue_wait_p99_ms: o
                .demand
                .and_then(|d| d.queue_wait_p99_ms)
                .map(|w| round(w, 3)),
            prefill_tokens: o.requests.map(|r| r.prefill_tokens),
            ttft_p99_ms: o.requests.and_then(|r| r.ttft_p99_ms).map(|t| round(t, 3)),
            prefill_time_share: o
                .requests
                .and_then(|r| r.prefill_time_share)
                .map(|share| round(share, 4)),
            requests_finished: o.requests.and_then(|r| r.energy).map(|e| e.count),
            energy_per_request_j: o
                .requests
                .and_then(|r| r.energy?.mean_j())
                .map(|j| round(j, 4)),
        }
    }
}

/// The first line of every `trace.csv` file, newline included, written as the csv writer
/// writes a header (the column names need no quoting).
pub(super) fn trace_header_line() -> Vec<u8> {
    let mut writer = csv::Writer::from_writer(Vec::new());
    // Writing to memory cannot fail.
    let _ = writer.write_record(trace_header());
    writer.into_inner().unwrap_or_default()
}

/// The header of `trace.csv`, as written (for tests and documentation).
pub fn trace_header() -> Vec<String> {
    let mut writer = csv::Writer::from_writer(Vec::new());
    let row = TraceRow::new(&TickRecord::unchanged(0.0, "", Observation::nothing(0, 0)));
    // Writing to memory cannot fail.
    let _ = writer.serialize(row);
    let bytes = writer.into_inner().unwrap_or_default();
    String::from_utf8_lossy(&bytes)
        .lines()
        .next()
        .unwrap_or_default()
        .split(',')
        .map(str::to_owned)
        .collect()
}

/// The trace files of the run in `dir`, oldest first: `trace.N.csv` … `trace.1.csv` (a
/// rotating run's older ones, see [`super::Rotation`]), then `trace.csv`.
pub fn trace_files(dir: &Path) -> Result<Vec<PathBuf>, TraceError> {
    super::output_file::files_oldest_first(dir, super::TRACE_FILE).map_err(|source| {
        TraceError::Read {
            path: dir.to_owned(),
            source: source.into(),
        }
    })
}

/// Reads `trace.csv` one row at a time, so that a week-long trace needs no more memory
/// than a minute of it. Columns a row type marks optional (memory power, demand) may be
/// absent or empty; every other column must be there and parse.
pub struct TraceReader {
    path: PathBuf,
    reader: csv::Reader<std::fs::File>,
    headers: csv::StringRecord,
    record: csv::StringRecord,
}

impl std::fmt::Debug for TraceReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceReader")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl TraceReader {
    pub fn open(path: &Path) -> Result<Self, TraceError> {
        let read_error = |source| TraceError::Read {
            path: path.to_owned(),
            source,
        };
        let mut reader = csv::Reader::from_path(path).map_err(read_error)?;
        let headers = reader.headers().map_err(read_error)?.clone();
        // A required column that is missing is named once, here, not on every row. An
        // empty file (a run that ended before its first tick) has no header and no rows.
        let written = trace_header();
        let optional = optional_columns();
        if let Some(column) = written
            .iter()
            .filter(|_| !headers.is_empty())
            .find(|c| !optional.contains(c) && !headers.iter().any(|h| h == c.as_str()))
        {
            return Err(TraceError::MissingColumn {
                path: path.to_owned(),
                column: column.clone(),
            });
        }
        Ok(Self {
            path: path.to_owned(),
            reader,
            headers,
            record: csv::StringRecord::new(),
        })
    }

    /// The next row, `None` at the end of the file.
    pub fn next_row(&mut self) -> Option<Result<TraceRow, TraceError>> {
        match self.reader.read_record(&mut self.record) {
            Ok(false) => None,
            Err(source) => Some(Err(TraceError::Read {
                path: self.path.clone(),
                source,
            })),
            Ok(true) => Some(
                self.record
                    .deserialize::<TraceRow>(Some(&self.headers))
                    .map_err(|error| self.bad_value(&error)),
            ),
        }
    }

    fn bad_value(&self, error: &csv::Error) -> TraceError {
        let line = self.record.position().map_or(0, csv::Position::line);
        let field = match error.kind() {
            csv::ErrorKind::Deserialize { err, .. } => err.field(),
            _ => None,
        };
        let index = field.and_then(|f| usize::try_from(f).ok());
        TraceError::BadValue {
            path: self.path.clone(),
            line,
            column: index
                .and_then(|i| self.headers.get(i))
                .unwrap_or("a column")
                .to_owned(),
            value: index
                .and_then(|i| self.record.get(i))
                .unwrap_or("")
                .chars()
                .take(40)
                .collect(),
            reason: match error.kind() {
                csv::ErrorKind::Deserialize { err, .. } => err.kind().to_string(),
                _ => error.to_string(),
            },
        }
    }
}

impl Iterator for TraceReader {
    type Item = Result<TraceRow, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_row()
    }
}

/// The columns a trace may lack: those [`TraceRow`] reads as `Option`.
fn optional_columns() -> [String; 11] {
    [
        "token_budget",
        "power_mem_w",
        "requests_arrived",
        "requests_turned_away",
        "tokens_demanded",
        "queue_wait_p99_ms",
        "prefill_tokens",
        "ttft_p99_ms",
        "prefill_time_share",
        "requests_finished",
        "energy_per_request_j",
    ]
    .map(str::to_owned)
}
