//! The recorder: every tick of every GPU goes to `trace.csv` (for people and plots) and
//! `observations.jsonl` (every observation and decision, for deterministic replay), and
//! the run ends with `summary.json`.
//!
//! **API boundary.** These files are read by scripts, plots and (later) `tokwatt replay`:
//! their layouts are a compatibility promise. Each has a format version
//! ([`TRACE_FORMAT_VERSION`], [`OBSERVATIONS_FORMAT_VERSION`], and the summary's own
//! `format_version`), recorded in `summary.json`; a change that renames or removes a
//! field raises it. The trace's header and the summary's keys are pinned by tests.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::types::{InForce, Observation, Settings};

/// Version of `trace.csv`'s columns.
pub const TRACE_FORMAT_VERSION: u32 = 1;
/// Version of the records in `observations.jsonl`.
pub const OBSERVATIONS_FORMAT_VERSION: u32 = 1;

/// The files a run writes into its output folder (`report.html` is written by
/// `agent` from the others, after them).
pub const OUTPUT_FILES: [&str; 4] = [
    "summary.json",
    "trace.csv",
    "observations.jsonl",
    "report.html",
];

#[derive(Debug, thiserror::Error)]
pub enum RecorderError {
    #[error("cannot create the output folder {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the output folder {} already holds a run ({}); choose another folder with --out, or pass --overwrite to replace it", path.display(), file
    )]
    Exists { path: PathBuf, file: &'static str },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One GPU in one tick: what was seen, asked for and applied.
#[derive(Debug, Clone, Serialize)]
pub struct TickRecord {
    pub time_s: f64,
    /// The policy in charge (its spec's name): it changes at a hot swap.
    pub policy: String,
    pub observation: Observation,
    /// What the policy returned (or the fallback's "hold").
    pub requested: Settings,
    /// What the envelope let through (only the knobs that changed).
    pub applied: Settings,
    /// The settings in force after this tick's changes.
    pub in_force_after: InForce,
    pub fallback: bool,
    pub clamped: bool,
    pub slo_violation: bool,
    /// Energy counter reading at the end of the window, joules.
    pub energy_counter_j: f64,
    /// Averaged memory power, where the GPU reports it.
    pub power_mem_avg_w: Option<f64>,
}

/// One line of `observations.jsonl`.
#[derive(Debug, Serialize)]
struct ObservationLine<'a> {
    format_version: u32,
    #[serde(flatten)]
    record: &'a TickRecord,
}

/// One row of `trace.csv`. The field order is the column order.
#[derive(Debug, Serialize)]
struct TraceRow {
    time_s: f64,
    tick: u64,
    gpu: u32,
    policy: String,
    /// The enforced power limit during the window.
    power_cap_w: f64,
    /// The power limit tokwatt had requested during the window.
    power_cap_requested_w: f64,
    sm_clock_max_mhz: u32,
    batch_size: u32,
    power_avg_w: f64,
    power_peak_w: f64,
    energy_j: f64,
    energy_counter_j: f64,
    tokens: u64,
    tokens_per_joule: f64,
    tokens_per_s: f64,
    sm_clock_mhz: u32,
    mem_clock_mhz: u32,
    temperature_c: f64,
    gpu_util_pct: f64,
    tpot_p50_ms: f64,
    tpot_p99_ms: f64,
    active_sequences: u32,
    queue_depth: u32,
    sw_power_cap: u8,
    settling: u8,
    clamped: u8,
    fallback: u8,
    slo_violation: u8,
    /// Empty where the GPU does not report memory power.
    power_mem_w: Option<f64>,
    /// Demand in the window; all four empty where the workload does not report demand.
    requests_arrived: Option<u64>,
    requests_turned_away: Option<u64>,
    tokens_demanded: Option<u64>,
    queue_wait_p99_ms: Option<f64>,
}

/// `value` rounded to `decimals` places, so the trace stays short to read and to store.
fn round(value: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (value * scale).round() / scale
}

impl TraceRow {
    fn new(r: &TickRecord) -> Self {
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
        }
    }
}

/// Writes the trace of a run into a folder, or nothing (the judge runs hundreds of runs and
/// keeps only their totals).
#[derive(Debug)]
pub struct Recorder {
    dir: PathBuf,
    files: Option<Files>,
}

#[derive(Debug)]
struct Files {
    trace: csv::Writer<BufWriter<File>>,
    observations: BufWriter<File>,
}

impl Recorder {
    /// Create the run's files in `dir`. A folder that already holds a run is refused
    /// unless `overwrite`: a previous run's results are never lost by accident.
    pub fn create(dir: &Path, overwrite: bool) -> Result<Self, RecorderError> {
        if !overwrite && let Some(file) = OUTPUT_FILES.iter().find(|f| dir.join(f).exists()) {
            return Err(RecorderError::Exists {
                path: dir.to_owned(),
                file,
            });
        }
        std::fs::create_dir_all(dir).map_err(|source| RecorderError::CreateDir {
            path: dir.to_owned(),
            source,
        })?;
        let open = |name: &str| {
            let path = dir.join(name);
            File::create(&path)
                .map(BufWriter::new)
                .map_err(|source| RecorderError::Write { path, source })
        };
        let trace = csv::Writer::from_writer(open("trace.csv")?);
        let observations = open("observations.jsonl")?;
        Ok(Self {
            dir: dir.to_owned(),
            files: Some(Files {
                trace,
                observations,
            }),
        })
    }

    /// A recorder that writes nothing, not even a summary.
    pub fn discard() -> Self {
        Self {
            dir: PathBuf::new(),
            files: None,
        }
    }

    /// Whether this recorder writes files.
    pub fn writes_files(&self) -> bool {
        self.files.is_some()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn write_error(&self, name: &str, error: impl Into<std::io::Error>) -> RecorderError {
        RecorderError::Write {
            path: self.dir.join(name),
            source: error.into(),
        }
    }

    pub fn record(&mut self, r: &TickRecord) -> Result<(), RecorderError> {
        let Some(files) = self.files.as_mut() else {
            return Ok(());
        };
        let dir = &self.dir;
        let error = |name: &str, source: std::io::Error| RecorderError::Write {
            path: dir.join(name),
            source,
        };
        // The csv writer writes the header before the first row.
        files
            .trace
            .serialize(TraceRow::new(r))
            .map_err(|e| error("trace.csv", e.into()))?;
        let line = ObservationLine {
            format_version: OBSERVATIONS_FORMAT_VERSION,
            record: r,
        };
        let json = serde_json::to_string(&line)
            .map_err(|e| error("observations.jsonl", std::io::Error::other(e)))?;
        writeln!(files.observations, "{json}").map_err(|e| error("observations.jsonl", e))
    }

    /// Flush the trace and write `summary.json` (atomically: a reader never sees half a
    /// summary).
    pub fn finish<S: Serialize>(mut self, summary: &S) -> Result<(), RecorderError> {
        let Some(files) = self.files.as_mut() else {
            return Ok(());
        };
        if let Err(error) = files.trace.flush() {
            return Err(self.write_error("trace.csv", error));
        }
        if let Err(error) = files.observations.flush() {
            return Err(self.write_error("observations.jsonl", error));
        }
        let json = serde_json::to_string_pretty(summary)
            .map_err(|e| self.write_error("summary.json", std::io::Error::other(e)))?;
        let mut file = tempfile::NamedTempFile::new_in(&self.dir)
            .map_err(|e| self.write_error("summary.json", e))?;
        file.write_all((json + "\n").as_bytes())
            .map_err(|e| self.write_error("summary.json", e))?;
        file.persist(self.dir.join("summary.json"))
            .map_err(|e| self.write_error("summary.json", e.error))?;
        Ok(())
    }
}

/// The header of `trace.csv`, as written (for tests and documentation).
pub fn trace_header() -> Vec<String> {
    let mut writer = csv::Writer::from_writer(Vec::new());
    let row = TraceRow::new(&TickRecord {
        time_s: 0.0,
        policy: String::new(),
        observation: crate::bench::sample_observation(0, 0),
        requested: Settings::default(),
        applied: Settings::default(),
        in_force_after: crate::bench::sample_observation(0, 0).in_force,
        fallback: false,
        clamped: false,
        slo_violation: false,
        energy_counter_j: 0.0,
        power_mem_avg_w: None,
    });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trace_header_is_stable() {
        // A compatibility promise: change TRACE_FORMAT_VERSION with this list.
        assert_eq!(TRACE_FORMAT_VERSION, 1);
        assert_eq!(
            trace_header().join(","),
            "time_s,tick,gpu,policy,power_cap_w,power_cap_requested_w,sm_clock_max_mhz,batch_size,\
             power_avg_w,power_peak_w,energy_j,energy_counter_j,tokens,tokens_per_joule,\
             tokens_per_s,sm_clock_mhz,mem_clock_mhz,temperature_c,gpu_util_pct,tpot_p50_ms,\
             tpot_p99_ms,active_sequences,queue_depth,sw_power_cap,settling,clamped,fallback,\
             slo_violation,power_mem_w,requests_arrived,requests_turned_away,tokens_demanded,\
             queue_wait_p99_ms"
        );
    }

    #[test]
    fn a_discarding_recorder_writes_nothing() {
        let mut recorder = Recorder::discard();
        assert!(!recorder.writes_files());
        let record = TickRecord {
            time_s: 0.0,
            policy: "p".into(),
            observation: crate::bench::sample_observation(0, 0),
            requested: Settings::default(),
            applied: Settings::default(),
            in_force_after: crate::bench::sample_observation(0, 0).in_force,
            fallback: false,
            clamped: false,
            slo_violation: false,
            energy_counter_j: 0.0,
            power_mem_avg_w: None,
        };
        recorder.record(&record).expect("record");
        recorder.finish(&"summary").expect("finish");
    }

    #[test]
    fn an_earlier_run_is_not_overwritten_unless_asked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let recorder = Recorder::create(dir.path(), false).expect("first run");
        recorder.finish(&"summary").expect("finish");
        let error = Recorder::create(dir.path(), false).expect_err("second run");
        assert!(error.to_string().contains("--overwrite"), "{error}");
        Recorder::create(dir.path(), true).expect("overwrite asked for");
    }
}
