//! The fence's status file: written by `tokwatt fence` every second (atomically: a
//! temporary file renamed over it), read by the agent before each report. The agent
//! declares the fence only while the file keeps changing: a fence that stopped, hung or
//! was never started leaves it unchanged (or absent), and a silent node without a fence
//! that runs is charged as unfenced.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::FenceError;

/// The file's layout version; a reader refuses another.
pub const STATUS_FORMAT_VERSION: u32 = 1;

/// How often the fence rewrites its status.
pub const STATUS_EVERY: Duration = Duration::from_secs(1);

/// A status that has not changed for this long (three of the fence's rewrites) says the
/// fence is not running.
pub const STATUS_FRESH: Duration = Duration::from_secs(3);

/// What the fence says about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FenceStatus {
    pub format_version: u32,
    /// The fence's process id (in its own PID namespace).
    pub pid: u32,
    /// The heartbeat it watches, as it names it.
    pub heartbeat: PathBuf,
    /// How long the heartbeat may stay unchanged before the fence applies the reserve.
    pub stall_s: f64,
    /// The reserve it applies, watts.
    pub reserve_w: f64,
    /// Checks since it started: a reader that sees this change knows the fence runs.
    pub checks: u64,
    /// When it last checked, seconds since the Unix epoch (for people reading the file).
    pub checked_at_unix_s: f64,
    /// Seconds since it last saw the heartbeat change (`None`: not since it started).
    pub beat_age_s: Option<f64>,
    /// Whether it holds the caps within the reserve now (the heartbeat is stalled).
    pub holding: bool,
    /// The caps' sum at the last check, watts (`None`: not read).
    pub caps_w: Option<f64>,
    /// Times it found caps above the reserve while stalled and lowered them.
    pub holds: u64,
    /// The last failure to read or lower the caps, if the last check failed.
    pub last_error: Option<String>,
}

impl FenceStatus {
    /// Writes the status atomically (a temporary file in the same folder, renamed).
    pub fn write(&self, path: &Path) -> Result<(), FenceError> {
        let text = serde_json::to_string_pretty(self).map_err(|e| FenceError::Status {
            path: path.to_owned(),
            source: std::io::Error::other(e),
        })?;
        tokwatt_report::write_atomically(path, &text).map_err(|e| FenceError::Status {
            path: path.to_owned(),
            source: std::io::Error::other(e),
        })
    }

    /// Reads a status file; `None` where it does not exist.
    pub fn read(path: &Path) -> Result<Option<Self>, FenceError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(FenceError::Status {
                    path: path.to_owned(),
                    source,
                });
            }
        };
        let status: Self = serde_json::from_str(&text).map_err(|e| FenceError::Status {
            path: path.to_owned(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        })?;
        if status.format_version != STATUS_FORMAT_VERSION {
            return Err(FenceError::Status {
                path: path.to_owned(),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!(
                        "format version {}, and this tokwatt reads {STATUS_FORMAT_VERSION}: run the agent and the fence from one release",
                        status.format_version
                    ),
                ),
            });
        }
        Ok(Some(status))
    }
}

/// The agent's view of a fence's status file: whether it changed lately, by the agent's
/// own monotonic clock (never by comparing the two processes' wall clocks, which a clock
/// step would fool).
#[derive(Debug)]
pub struct StatusWatch {
    path: PathBuf,
    /// What identifies the last status seen (the fence's pid and check count), and when
    /// it was first seen.
    last: Option<((u32, u64), Instant)>,
}

impl StatusWatch {
    pub fn new(path: PathBuf) -> Self {
        Self { path, last: None }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The fence's status where it changed within [`STATUS_FRESH`] of `now`; `Err` where
    /// the file cannot be read or is not a status.
    pub fn alive(&mut self, now: Instant) -> Result<Option<FenceStatus>, FenceError> {
        let Some(status) = FenceStatus::read(&self.path)? else {
            self.last = None;
            return Ok(None);
        };
        let seen = (status.pid, status.checks);
        match self.last {
            Some((last, _)) if last == seen => {}
            // The first sighting proves nothing (the file may be a dead fence's): only a
            // change does.
            None => {
                self.last = Some((seen, now));
                return Ok(None);
            }
            Some(_) => self.last = Some((seen, now)),
        }
        let changed_at = self.last.map_or(now, |(_, at)| at);
        Ok((now.saturating_duration_since(changed_at) <= STATUS_FRESH).then_some(status))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(checks: u64) -> FenceStatus {
        FenceStatus {
            format_version: STATUS_FORMAT_VERSION,
            pid: 42,
            heartbeat: "/run/tokwatt-fence/heartbeat".into(),
            stall_s: 5.0,
            reserve_w: 1200.0,
            checks,
            checked_at_unix_s: 1.7e9,
            beat_age_s: Some(0.4),
            holding: false,
            caps_w: Some(1100.0),
            holds: 0,
            last_error: None,
        }
    }

    #[test]
    fn a_status_reads_back_as_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("status.json");
        assert!(
            FenceStatus::read(&path)
                .expect("absent is no error")
                .is_none()
        );
        status(3).write(&path).expect("written");
        assert_eq!(FenceStatus::read(&path).expect("read"), Some(status(3)));
        std::fs::write(&path, "{\"format_version\": 2}").expect("write");
        let error = FenceStatus::read(&path).expect_err("refused");
        assert!(error.to_string().contains("status.json"), "{error}");
    }

    #[test]
    fn a_fence_is_alive_only_while_its_status_keeps_changing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("status.json");
        let mut watch = StatusWatch::new(path.clone());
        let start = Instant::now();
        let at = |s: f64| start + Duration::from_secs_f64(s);
        assert_eq!(watch.alive(at(0.0)).expect("read"), None, "no file");
        status(1).write(&path).expect("written");
        // A file seen once may be a dead fence's.
        assert_eq!(watch.alive(at(0.5)).expect("read"), None);
        status(2).write(&path).expect("written");
        assert_eq!(watch.alive(at(1.5)).expect("read"), Some(status(2)));
        // Unchanged, but within three seconds of the last change.
        assert!(watch.alive(at(4.4)).expect("read").is_some());
        // Unchanged for longer: the fence stopped.
        assert_eq!(watch.alive(at(4.6)).expect("read"), None);
        status(3).write(&path).expect("written");
        assert!(watch.alive(at(5.0)).expect("read").is_some());
        // Gone: not alive, and a new file must change again to count.
        std::fs::remove_file(&path).expect("removed");
        assert_eq!(watch.alive(at(5.5)).expect("read"), None);
        status(4).write(&path).expect("written");
        assert_eq!(watch.alive(at(6.0)).expect("read"), None);
    }
}
