//! The recorder: every tick of every GPU goes to `trace.csv` (for people and plots) and
//! `observations.jsonl` (every observation and decision, for deterministic replay), and
//! the run ends with `summary.json`.
//!
//! **API boundary.** These files are read by scripts, plots and (later) `tokwatt replay`:
//! their layouts are a compatibility promise. Each has a format version
//! ([`TRACE_FORMAT_VERSION`], [`OBSERVATIONS_FORMAT_VERSION`], and the summary's own
//! `format_version`), recorded in `summary.json`; a change that renames or removes a
//! field raises it. The trace's header and the summary's keys are pinned by tests.
//!
//! A long run bounds its files with a [`Rotation`] (`tokwatt serve` for weeks, `tokwatt run`
//! by default, [`OutputBounds`]): the current `trace.csv` holds the newest lines,
//! `trace.1.csv` … `trace.<keep>.csv` older ones, each with its header; `observations.jsonl`
//! and `requests.jsonl` likewise. `requests.jsonl` may also be capped at a number of lines
//! ([`OutputBounds::max_request_lines`]): the first requests of the run are written, the
//! rest only counted ([`Recorder::requests_not_written`], the summary's
//! `request_latency.requests_not_written`). [`Recorder::checkpoint`] keeps `summary.json`
//! current while the run goes on.

mod background;
mod observations;
mod output_file;
mod trace;

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use tokwatt_core::types::{InForce, Observation, Settings};

use background::{Background, Message};
#[cfg(test)]
use observations::ObservationLine;
pub use observations::{ObservationError, ObservationReader, RecordedLine, observation_files};
use output_file::OutputFile;
pub use output_file::Rotation;
use trace::trace_header_line;
pub use trace::{TraceError, TraceReader, TraceRow, trace_files, trace_header};

/// Version of `trace.csv`'s columns (2: the requests columns added at the end; 3: the
/// token budget beside the batch size; a version 1 or 2 trace, without them, still reads).
pub const TRACE_FORMAT_VERSION: u32 = 3;
/// Version of the records in `observations.jsonl`.
pub const OBSERVATIONS_FORMAT_VERSION: u32 = 1;

/// The files a run writes into its output folder (`report.html` is written by
/// `agent` from the others, after them).
pub const OUTPUT_FILES: [&str; 5] = [
    "summary.json",
    "trace.csv",
    "observations.jsonl",
    "report.html",
    "requests.jsonl",
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
    Exists { path: PathBuf, file: String },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot rotate {} to {}: {source}", from.display(), to.display())]
    Rotate {
        from: PathBuf,
        to: PathBuf,
        source: std::io::Error,
    },
    #[error("output file rotation: {0}")]
    Rotation(String),
}

/// One GPU in one tick: what was seen, asked for and applied. One line of
/// `observations.jsonl`, written by [`Recorder::record`] and read back by
/// [`ObservationReader`].
#[derive(Debug, Clone, Serialize, Deserialize)]
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
    /// The policy failed and its supervisor's fallback held the settings.
    pub fallback: bool,
    pub clamped: bool,
    /// The objective guard's fallback (the device defaults) decided this tick.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub guard: bool,
    pub slo_violation: bool,
    /// Energy counter reading at the end of the window, joules.
    pub energy_counter_j: f64,
    /// Averaged memory power, where the GPU reports it.
    pub power_mem_avg_w: Option<f64>,
    /// What the policy's `init` asked for before the first tick (the first tick's record
    /// of each GPU only): a swapped-in policy's `init` is its tick's `requested` instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init: Option<InitRecord>,
}

impl TickRecord {
    /// A tick where the policy asked for nothing and nothing changed: the settings in
    /// force stay the ones `observation` shows. What a test or a header starts from.
    pub fn unchanged(time_s: f64, policy: &str, observation: Observation) -> Self {
        Self {
            time_s,
            policy: policy.to_owned(),
            in_force_after: observation.in_force,
            observation,
            requested: Settings::default(),
            applied: Settings::default(),
            fallback: false,
            clamped: false,
            guard: false,
            slo_violation: false,
            energy_counter_j: 0.0,
            power_mem_avg_w: None,
            init: None,
        }
    }
}

/// The settings a policy's `init` gave for one GPU, and what the envelope let through.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct InitRecord {
    pub requested: Settings,
    pub applied: Settings,
    pub clamped: bool,
}

/// Writes the trace of a run into a folder, or nothing (the judge runs hundreds of runs and
/// keeps only their totals).
#[derive(Debug)]
pub struct Recorder {
    dir: PathBuf,
    sink: Sink,
    /// At most this many lines in `requests.jsonl`; those written, and those past the cap.
    max_request_lines: Option<u64>,
    requests_written: u64,
    requests_not_written: u64,
}

/// Where the lines go: nowhere, the files (written on the caller's thread), or a thread
/// that writes them ([`Recorder::write_in_background`]).
#[derive(Debug)]
enum Sink {
    Discard,
    Files(Box<Files>),
    Background(Background),
}

/// How much a run may write: each file kind rotated within a bound, and a cap on the lines
/// of `requests.jsonl` (one per finished request: the simulator finishes hundreds a second
/// per GPU, so a day of 8 GPUs is about 20 million lines, 5 GB, and the time to write them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputBounds {
    /// Each kind of file rotated within `(keep + 1) × max_bytes`; `None`: unbounded.
    pub rotation: Option<Rotation>,
    /// Lines `requests.jsonl` holds at most, the run's first finished requests; the rest
    /// are counted, not written. `None`: every request is written.
    pub max_request_lines: Option<u64>,
}

impl OutputBounds {
    /// `tokwatt run`'s default size of one output file before it rotates, MiB (`serve`'s).
    pub const DEFAULT_MAX_FILE_MIB: u64 = 64;
    /// `tokwatt run`'s default number of rotated files kept per kind (`serve`'s).
    pub const DEFAULT_KEEP_FILES: u32 = 4;
    /// `tokwatt run`'s default cap on `requests.jsonl`: about 260 MB of lines, every request
    /// of a 30-minute run of two simulated H200s under the built-in scenario.
    pub const DEFAULT_MAX_REQUEST_LINES: u64 = 1_000_000;

    /// Every file written whole, every request written: what a test or a short run of a
    /// caller that bounds nothing gets.
    pub const UNBOUNDED: OutputBounds = OutputBounds {
        rotation: None,
        max_request_lines: None,
    };

    /// `tokwatt run`'s defaults: each kind at most 5 × 64 MiB, the newest kept (as `serve`);
    /// `requests.jsonl` at most a million lines.
    pub fn run_default() -> Self {
        Self {
            rotation: Some(Rotation {
                max_bytes: Self::DEFAULT_MAX_FILE_MIB * 1024 * 1024,
                keep: Self::DEFAULT_KEEP_FILES,
            }),
            max_request_lines: Some(Self::DEFAULT_MAX_REQUEST_LINES),
        }
    }
}

impl Default for OutputBounds {
    fn default() -> Self {
        Self::run_default()
    }
}

#[derive(Debug)]
struct Files {
    trace: OutputFile,
    observations: OutputFile,
    /// Made at the first finished request: a workload that sees none writes no file.
    requests: Option<OutputFile>,
    rotation: Option<Rotation>,
    /// One row's CSV bytes, made before they are written (the buffer is reused).
    trace_line: Vec<u8>,
    /// One JSON line, made before it is written (the buffer is reused).
    json_line: Vec<u8>,
}

pub const TRACE_FILE: &str = "trace.csv";
pub const OBSERVATIONS_FILE: &str = "observations.jsonl";
pub const SUMMARY_FILE: &str = "summary.json";
/// One line per finished request, where the workload sees each one through.
pub const REQUESTS_FILE: &str = "requests.jsonl";
pub const REQUESTS_FORMAT_VERSION: u32 = 1;

/// A line of `requests.jsonl`: the GPU that served it and its record's fields, in the
/// record's order (a plain struct, not a flattened one: serde writes it several times
/// faster, and the bytes are the same; test: `request_lines_are_the_flattened_records`).
#[derive(Debug, Serialize)]
struct RequestLine {
    format_version: u32,
    gpu: u32,
    arrival_s: f64,
    admitted_s: f64,
    first_token_s: f64,
    finish_s: f64,
    prompt: u32,
    output: u32,
    ttft_ms: f64,
    tpot_ms: Option<f64>,
    energy_j: Option<f64>,
}

impl RequestLine {
    fn new(gpu: u32, record: &tokwatt_core::workload::serving::RequestRecord) -> Self {
        let tokwatt_core::workload::serving::RequestRecord {
            arrival_s,
            admitted_s,
            first_token_s,
            finish_s,
            prompt,
            output,
            ttft_ms,
            tpot_ms,
            energy_j,
        } = *record;
        Self {
            format_version: REQUESTS_FORMAT_VERSION,
            gpu,
            arrival_s,
            admitted_s,
            first_token_s,
            finish_s,
            prompt,
            output,
            ttft_ms,
            tpot_ms,
            energy_j,
        }
    }
}

/// `record`'s line of `observations.jsonl` into `line` (cleared first), newline included:
/// `{"format_version":1,` and the record's own fields, the bytes [`ObservationLine`]'s
/// flattened serialisation gives, written several times faster (test:
/// `observation_lines_are_the_flattened_records`).
fn write_observation_line(line: &mut Vec<u8>, record: &TickRecord) -> serde_json::Result<()> {
    line.clear();
    line.extend_from_slice(b"{\"format_version\":");
    line.extend_from_slice(OBSERVATIONS_FORMAT_VERSION.to_string().as_bytes());
    let start = line.len();
    serde_json::to_writer(&mut *line, record)?;
    // The record's own object opens with `{`: it continues this one.
    line[start] = b',';
    line.push(b'\n');
    Ok(())
}

impl Recorder {
    /// Create the run's files in `dir`. A folder that already holds a run is refused
    /// unless `overwrite`: a previous run's results are never lost by accident.
    pub fn create(dir: &Path, overwrite: bool) -> Result<Self, RecorderError> {
        Self::open(dir, overwrite, None)
    }

    /// Like [`Recorder::create`], with `trace.csv` and `observations.jsonl` each bounded
    /// by `rotation` (see [`Rotation`]). Rotated files of an earlier run in `dir` count
    /// as a run: refused unless `overwrite`, then deleted so the runs do not mix.
    pub fn create_rotating(
        dir: &Path,
        overwrite: bool,
        rotation: Rotation,
    ) -> Result<Self, RecorderError> {
        Self::create_bounded(
            dir,
            overwrite,
            OutputBounds {
                rotation: Some(rotation),
                max_request_lines: None,
            },
        )
    }

    /// Like [`Recorder::create`], within `bounds` (see [`OutputBounds`]).
    pub fn create_bounded(
        dir: &Path,
        overwrite: bool,
        bounds: OutputBounds,
    ) -> Result<Self, RecorderError> {
        if let Some(rotation) = &bounds.rotation {
            rotation.validate()?;
        }
        let mut recorder = Self::open(dir, overwrite, bounds.rotation)?;
        recorder.max_request_lines = bounds.max_request_lines;
        Ok(recorder)
    }

    fn open(
        dir: &Path,
        overwrite: bool,
        rotation: Option<Rotation>,
    ) -> Result<Self, RecorderError> {
        let mut earlier_rotated = Vec::new();
        for name in [TRACE_FILE, OBSERVATIONS_FILE, REQUESTS_FILE] {
            earlier_rotated.extend(output_file::rotated_files(dir, name)?);
        }
        if !overwrite {
            let earlier = OUTPUT_FILES
                .iter()
                .map(|f| dir.join(f))
                .chain(earlier_rotated.iter().cloned())
                .find(|path| path.exists());
            if let Some(path) = earlier {
                return Err(RecorderError::Exists {
                    path: dir.to_owned(),
                    file: path
                        .file_name()
                        .map(|name| name.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                });
            }
        }
        std::fs::create_dir_all(dir).map_err(|source| RecorderError::CreateDir {
            path: dir.to_owned(),
            source,
        })?;
        for path in earlier_rotated {
            std::fs::remove_file(&path).map_err(|source| RecorderError::Write { path, source })?;
        }
        let trace = OutputFile::create(dir, TRACE_FILE, Some(trace_header_line()), rotation)?;
        let observations = OutputFile::create(dir, OBSERVATIONS_FILE, None, rotation)?;
        Ok(Self {
            dir: dir.to_owned(),
            sink: Sink::Files(Box::new(Files {
                trace,
                observations,
                requests: None,
                rotation,
                trace_line: Vec::new(),
                json_line: Vec::new(),
            })),
            max_request_lines: None,
            requests_written: 0,
            requests_not_written: 0,
        })
    }

    /// A recorder that writes nothing, not even a summary.
    pub fn discard() -> Self {
        Self {
            dir: PathBuf::new(),
            sink: Sink::Discard,
            max_request_lines: None,
            requests_written: 0,
            requests_not_written: 0,
        }
    }

    /// From now on the lines are written by a thread of their own, from a bounded queue,
    /// while the caller goes on: for a run on a virtual clock, whose ticks follow each
    /// other as fast as they are computed. Each tick's lines then reach the operating
    /// system a little after the tick (a `kill -9` may lose the few ticks still queued, of
    /// a run that repeats bit for bit); `checkpoint` and `finish` wait for everything
    /// queued, so the files reach at least as far as the summary. A run in real time keeps
    /// writing on its own thread, each tick before the next.
    pub fn write_in_background(&mut self) -> Result<(), RecorderError> {
        if let Sink::Files(_) = &self.sink {
            let Sink::Files(files) = std::mem::replace(&mut self.sink, Sink::Discard) else {
                return Ok(());
            };
            self.sink = Sink::Background(Background::start(self.dir.clone(), files)?);
        }
        Ok(())
    }

    /// Whether this recorder writes files.
    pub fn writes_files(&self) -> bool {
        !matches!(self.sink, Sink::Discard)
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
        match &mut self.sink {
            Sink::Discard => Ok(()),
            Sink::Files(files) => files.write_tick(&self.dir, r),
            Sink::Background(background) => {
                background.send(&self.dir, Message::Tick(Box::new(r.clone())))
            }
        }
    }

    /// One line per request `gpu` finished, in `requests.jsonl`: up to the cap on its
    /// lines, past which they are counted ([`Recorder::requests_not_written`]).
    pub fn record_requests(
        &mut self,
        gpu: u32,
        records: &[tokwatt_core::workload::serving::RequestRecord],
    ) -> Result<(), RecorderError> {
        if let Sink::Discard = self.sink {
            return Ok(());
        }
        let room = self
            .max_request_lines
            .map_or(u64::MAX, |cap| cap.saturating_sub(self.requests_written));
        let fits = records
            .len()
            .min(usize::try_from(room).unwrap_or(usize::MAX));
        let (records, past_cap) = records.split_at(fits);
        if !past_cap.is_empty() && self.requests_not_written == 0 {
            tracing::warn!(
                "requests.jsonl holds its cap of {} lines: later requests are counted \
                 (summary.json's request_latency.requests_not_written), not written",
                self.requests_written + records.len() as u64
            );
        }
        self.requests_not_written += past_cap.len() as u64;
        self.requests_written += records.len() as u64;
        if records.is_empty() {
            return Ok(());
        }
        match &mut self.sink {
            Sink::Discard => Ok(()),
            Sink::Files(files) => files.write_requests(&self.dir, gpu, records),
            Sink::Background(background) => {
                background.send(&self.dir, Message::Requests(gpu, records.to_vec()))
            }
        }
    }

    /// Finished requests past the cap on `requests.jsonl`'s lines: counted, not written.
    pub fn requests_not_written(&self) -> u64 {
        self.requests_not_written
    }

    /// End a tick: its rows are handed to the operating system, so a crash of the agent
    /// (`kill -9`) loses at most the tick in flight. Not an fsync: a crash of the machine
    /// may still lose what the kernel had not written.
    pub fn end_tick(&mut self) -> Result<(), RecorderError> {
        match &mut self.sink {
            Sink::Discard => Ok(()),
            Sink::Files(files) => files.flush(),
            Sink::Background(background) => background.send(&self.dir, Message::EndTick),
        }
    }

    /// Flush the trace and write `summary.json` (atomically: a reader never sees half a
    /// summary), keeping the recording going: a long run's current summary. The trace
    /// and observations on disk then reach at least as far as the summary.
    pub fn checkpoint<S: Serialize>(&mut self, summary: &S) -> Result<(), RecorderError> {
        match &mut self.sink {
            Sink::Discard => return Ok(()),
            Sink::Files(files) => files.flush()?,
            Sink::Background(background) => background.flush(&self.dir)?,
        }
        let json = serde_json::to_string_pretty(summary)
            .map_err(|e| self.write_error(SUMMARY_FILE, std::io::Error::other(e)))?;
        let mut file = tokwatt_report::output_tempfile(&self.dir)
            .map_err(|e| self.write_error(SUMMARY_FILE, e))?;
        file.write_all((json + "\n").as_bytes())
            .map_err(|e| self.write_error(SUMMARY_FILE, e))?;
        file.persist(self.dir.join(SUMMARY_FILE))
            .map_err(|e| self.write_error(SUMMARY_FILE, e.error))?;
        Ok(())
    }

    /// Flush the trace and write `summary.json` (atomically), ending the recording.
    pub fn finish<S: Serialize>(mut self, summary: &S) -> Result<(), RecorderError> {
        self.checkpoint(summary)
    }
}

impl Files {
    /// One GPU's tick: its trace row and its observation line.
    fn write_tick(&mut self, dir: &Path, r: &TickRecord) -> Result<(), RecorderError> {
        let error = |name: &str, source: std::io::Error| RecorderError::Write {
            path: dir.join(name),
            source,
        };
        // Each line is made whole before it is written, so a rotation falls between lines;
        // the header is not the csv writer's to write: `trace` writes it at each file's start.
        self.trace_line.clear();
        let mut row_writer = csv::WriterBuilder::new()
            .has_headers(false)
            .buffer_capacity(1024)
            .from_writer(&mut self.trace_line);
        row_writer
            .serialize(TraceRow::new(r))
            .and_then(|()| Ok(row_writer.flush()?))
            .map_err(|e| error(TRACE_FILE, e.into()))?;
        drop(row_writer);
        self.trace.write_line(&self.trace_line)?;
        write_observation_line(&mut self.json_line, r)
            .map_err(|e| error(OBSERVATIONS_FILE, std::io::Error::other(e)))?;
        self.observations.write_line(&self.json_line)
    }

    /// Lines of `requests.jsonl` (made at the first).
    fn write_requests(
        &mut self,
        dir: &Path,
        gpu: u32,
        records: &[tokwatt_core::workload::serving::RequestRecord],
    ) -> Result<(), RecorderError> {
        let requests = match &mut self.requests {
            Some(file) => file,
            None => {
                self.requests
                    .insert(OutputFile::create(dir, REQUESTS_FILE, None, self.rotation)?)
            }
        };
        for record in records {
            let line = RequestLine::new(gpu, record);
            self.json_line.clear();
            serde_json::to_writer(&mut self.json_line, &line).map_err(|e| {
                RecorderError::Write {
                    path: dir.join(REQUESTS_FILE),
                    source: std::io::Error::other(e),
                }
            })?;
            self.json_line.push(b'\n');
            requests.write_line(&self.json_line)?;
        }
        Ok(())
    }

    /// Every file's lines handed to the operating system.
    fn flush(&mut self) -> Result<(), RecorderError> {
        self.trace.flush()?;
        if let Some(requests) = self.requests.as_mut() {
            requests.flush()?;
        }
        self.observations.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trace_header_is_stable() {
        // A compatibility promise: change TRACE_FORMAT_VERSION with this list.
        assert_eq!(TRACE_FORMAT_VERSION, 3);
        assert_eq!(
            trace_header().join(","),
            "time_s,tick,gpu,policy,power_cap_w,power_cap_requested_w,sm_clock_max_mhz,batch_size,\
             token_budget,power_avg_w,power_peak_w,energy_j,energy_counter_j,tokens,tokens_per_joule,\
             tokens_per_s,sm_clock_mhz,mem_clock_mhz,temperature_c,gpu_util_pct,tpot_p50_ms,\
             tpot_p99_ms,active_sequences,queue_depth,sw_power_cap,settling,clamped,fallback,\
             slo_violation,power_mem_w,requests_arrived,requests_turned_away,tokens_demanded,\
             queue_wait_p99_ms,prefill_tokens,ttft_p99_ms,prefill_time_share,requests_finished,\
             energy_per_request_j"
        );
    }

    #[test]
    fn a_discarding_recorder_writes_nothing() {
        let mut recorder = Recorder::discard();
        assert!(!recorder.writes_files());
        let record = TickRecord::unchanged(
            0.0,
            "p",
            tokwatt_core::types::Observation::typical_h200(0, 0),
        );
        recorder.record(&record).expect("record");
        recorder.finish(&"summary").expect("finish");
    }

    /// The flattened layouts the files were written with, for the tests that pin the bytes.
    #[derive(Serialize)]
    struct FlatRequestLine<'a> {
        format_version: u32,
        gpu: u32,
        #[serde(flatten)]
        record: &'a tokwatt_core::workload::serving::RequestRecord,
    }

    fn request(energy_j: Option<f64>) -> tokwatt_core::workload::serving::RequestRecord {
        tokwatt_core::workload::serving::RequestRecord {
            arrival_s: 0.1 + 0.2,
            admitted_s: f64::NAN,
            first_token_s: 1.0 / 3.0,
            finish_s: 2.0,
            prompt: 10,
            output: 1,
            ttft_ms: 1e-7,
            tpot_ms: None,
            energy_j,
        }
    }

    #[test]
    fn request_lines_are_the_flattened_records() {
        for record in [request(Some(3.25)), request(None)] {
            let flat = serde_json::to_string(&FlatRequestLine {
                format_version: REQUESTS_FORMAT_VERSION,
                gpu: 3,
                record: &record,
            })
            .expect("flat");
            let plain = serde_json::to_string(&RequestLine::new(3, &record)).expect("plain");
            assert_eq!(plain, flat);
        }
    }

    #[test]
    fn observation_lines_are_the_flattened_records() {
        let mut observation = tokwatt_core::types::Observation::typical_h200(2, 7);
        observation.tpot_p99_ms = f64::NAN;
        observation.demand = Some(tokwatt_core::types::DemandWindow::default());
        let mut record = TickRecord::unchanged(8.0, "p \"q\"", observation);
        record.power_mem_avg_w = Some(1.0 / 3.0);
        record.guard = true;
        for record in [
            record.clone(),
            TickRecord {
                init: Some(InitRecord {
                    requested: Settings::default(),
                    applied: Settings::default(),
                    clamped: true,
                }),
                guard: false,
                ..record
            },
        ] {
            let flat = serde_json::to_string(&ObservationLine {
                format_version: OBSERVATIONS_FORMAT_VERSION,
                record: &record,
            })
            .expect("flat")
                + "\n";
            let mut line = Vec::new();
            write_observation_line(&mut line, &record).expect("line");
            assert_eq!(String::from_utf8(line).expect("utf-8"), flat);
        }
    }

    #[test]
    fn lines_written_in_the_background_are_the_lines_written_in_place() {
        let bounds = OutputBounds {
            rotation: Some(Rotation {
                max_bytes: Rotation::MIN_BYTES,
                keep: 100,
            }),
            max_request_lines: Some(30),
        };
        let write = |background: bool| {
            let dir = tempfile::tempdir().expect("tempdir");
            let mut recorder = Recorder::create_bounded(dir.path(), false, bounds).expect("create");
            if background {
                recorder.write_in_background().expect("thread");
            }
            for tick in 0..50 {
                for gpu in 0..2 {
                    let observation = tokwatt_core::types::Observation::typical_h200(gpu, tick);
                    let record = TickRecord::unchanged((tick + 1) as f64, "p", observation);
                    recorder.record(&record).expect("record");
                    recorder
                        .record_requests(gpu, &[request(Some(1.0)); 2])
                        .expect("requests");
                }
                recorder.end_tick().expect("end tick");
                if tick == 20 {
                    recorder.checkpoint(&tick).expect("checkpoint");
                    // The files reach at least as far as the summary.
                    let trace =
                        std::fs::read_to_string(dir.path().join(TRACE_FILE)).expect("trace");
                    assert!(trace.contains("\n21.0,20,1,"), "{trace}");
                }
            }
            assert_eq!(recorder.requests_not_written(), 170);
            recorder.finish(&"summary").expect("finish");
            let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir.path())
                .expect("dir")
                .map(|entry| {
                    let entry = entry.expect("entry");
                    (
                        entry.file_name().to_string_lossy().into_owned(),
                        std::fs::read(entry.path()).expect("read"),
                    )
                })
                .collect();
            files.sort();
            files
        };
        let in_place = write(false);
        assert!(in_place.len() > 5, "rotated files");
        assert_eq!(write(true), in_place);
    }

    #[test]
    fn requests_past_the_cap_are_counted_not_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bounds = OutputBounds {
            rotation: None,
            max_request_lines: Some(3),
        };
        let mut recorder = Recorder::create_bounded(dir.path(), false, bounds).expect("create");
        let record = tokwatt_core::workload::serving::RequestRecord {
            arrival_s: 0.5,
            admitted_s: 0.5,
            first_token_s: 0.6,
            finish_s: 2.0,
            prompt: 10,
            output: 20,
            ttft_ms: 100.0,
            tpot_ms: Some(70.0),
            energy_j: Some(3.0),
        };
        recorder.record_requests(0, &[record; 2]).expect("two");
        recorder.record_requests(1, &[record; 2]).expect("one fits");
        recorder.record_requests(1, &[record]).expect("none fits");
        assert_eq!(recorder.requests_not_written(), 2);
        recorder.finish(&"summary").expect("finish");
        let text = std::fs::read_to_string(dir.path().join(REQUESTS_FILE)).expect("read");
        let gpus: Vec<&str> = text
            .lines()
            .map(|line| if line.contains("\"gpu\":0") { "0" } else { "1" })
            .collect();
        assert_eq!(gpus, ["0", "0", "1"], "the first three requests");
        // No cap: every request is written; a cap of 0 writes none (and no file).
        let none = tempfile::tempdir().expect("tempdir");
        let mut recorder = Recorder::create_bounded(
            none.path(),
            false,
            OutputBounds {
                rotation: None,
                max_request_lines: Some(0),
            },
        )
        .expect("create");
        recorder.record_requests(0, &[record; 4]).expect("none");
        assert_eq!(recorder.requests_not_written(), 4);
        assert!(!none.path().join(REQUESTS_FILE).exists());
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
