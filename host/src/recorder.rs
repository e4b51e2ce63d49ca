//! The recorder: every tick of every GPU goes to `trace.csv` (for people and plots) and
//! `observations.jsonl` (every observation and decision, for deterministic replay), and
//! the run ends with `summary.json`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::types::{InForce, Observation, Settings};

#[derive(Debug, thiserror::Error)]
pub enum RecorderError {
    #[error("cannot create the output folder {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
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

const TRACE_HEADER: &str = "time_s,tick,gpu,power_cap_w,sm_clock_max_mhz,batch_size,power_avg_w,power_peak_w,energy_j,energy_counter_j,tokens,tokens_per_joule,tokens_per_s,sm_clock_mhz,mem_clock_mhz,temperature_c,gpu_util_pct,tpot_p50_ms,tpot_p99_ms,active_sequences,queue_depth,sw_power_cap,settling,clamped,fallback,slo_violation,power_mem_w";

/// Writes the trace of a run into a folder.
#[derive(Debug)]
pub struct Recorder {
    dir: PathBuf,
    trace: BufWriter<File>,
    observations: BufWriter<File>,
}

impl Recorder {
    pub fn create(dir: &Path) -> Result<Self, RecorderError> {
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
        let mut trace = open("trace.csv")?;
        let observations = open("observations.jsonl")?;
        writeln!(trace, "{TRACE_HEADER}").map_err(|source| RecorderError::Write {
            path: dir.join("trace.csv"),
            source,
        })?;
        Ok(Self {
            dir: dir.to_owned(),
            trace,
            observations,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn record(&mut self, r: &TickRecord) -> Result<(), RecorderError> {
        let o = &r.observation;
        // The settings in force during the window are the ones the observation reports.
        let line = format!(
            "{:.3},{},{},{:.1},{},{},{:.2},{:.2},{:.4},{:.3},{},{:.5},{:.2},{},{},{:.1},{:.1},{:.3},{:.3},{},{},{},{},{},{},{},{}",
            r.time_s,
            o.tick,
            o.gpu,
            o.in_force.power_cap_w,
            o.in_force.sm_clock_max_mhz,
            o.in_force.batch_size,
            o.power_avg_w,
            o.power_peak_w,
            o.energy_j,
            r.energy_counter_j,
            o.tokens,
            o.tokens_per_joule,
            o.tokens_per_s,
            o.sm_clock_mhz,
            o.mem_clock_mhz,
            o.temperature_c,
            o.gpu_util_pct,
            o.tpot_p50_ms,
            o.tpot_p99_ms,
            o.active_sequences,
            o.queue_depth,
            u8::from(o.clock_events.sw_power_cap),
            u8::from(o.settling),
            u8::from(r.clamped),
            u8::from(r.fallback),
            u8::from(r.slo_violation),
            r.power_mem_avg_w
                .map_or_else(String::new, |w| format!("{w:.2}")),
        );
        writeln!(self.trace, "{line}").map_err(|source| RecorderError::Write {
            path: self.dir.join("trace.csv"),
            source,
        })?;
        let json = serde_json::to_string(r).map_err(|e| RecorderError::Write {
            path: self.dir.join("observations.jsonl"),
            source: std::io::Error::other(e),
        })?;
        writeln!(self.observations, "{json}").map_err(|source| RecorderError::Write {
            path: self.dir.join("observations.jsonl"),
            source,
        })
    }

    /// Flush the trace and write `summary.json`.
    pub fn finish<S: Serialize>(mut self, summary: &S) -> Result<(), RecorderError> {
        let flush = |w: &mut BufWriter<File>, name: &str| {
            w.flush().map_err(|source| RecorderError::Write {
                path: self.dir.join(name),
                source,
            })
        };
        flush(&mut self.trace, "trace.csv")?;
        flush(&mut self.observations, "observations.jsonl")?;
        let path = self.dir.join("summary.json");
        let json = serde_json::to_string_pretty(summary).map_err(|e| RecorderError::Write {
            path: path.clone(),
            source: std::io::Error::other(e),
        })?;
        std::fs::write(&path, json + "\n").map_err(|source| RecorderError::Write { path, source })
    }
}
