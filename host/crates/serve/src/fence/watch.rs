//! `tokwatt fence`: a second process beside the agent (a sidecar container, a node-level
//! unit) that applies the node's reserve when the agent's heartbeat stalls.
//!
//! The heartbeat is a file the agent's loop touches after every on-time tick. The fence
//! counts a beat whenever the file's modification time *changes*, and measures the quiet
//! since the last beat on its own monotonic clock: a step of the wall clock (NTP, an
//! operator) can neither hide a stall nor fake one. A file left by an earlier agent, or
//! none at all, is no beat: from its start the fence gives the agent `stall` to beat, so an
//! agent that fails at start, before its first tick, is fenced too.
//!
//! Stalled, the fence lowers the caps within the reserve ([`apply_reserve`]: only lowers,
//! each GPU at least at its lowest cap) and keeps checking them while the stall lasts; a
//! beat ends the hold (the agent's own loop, at its own allowance, takes over; the fence
//! never raises a cap). It rewrites its status file every second, so the agent declares the
//! fence only while it runs. On SIGTERM or SIGINT it removes its status file and exits.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use tokwatt_core::actuator::Actuator;

use tokwatt_fleet::ProofSource;

use super::proof::ProofTarget;
use super::status::{FenceStatus, STATUS_EVERY, STATUS_FORMAT_VERSION};
use super::{FenceError, apply_reserve};

/// How often the fence looks at the heartbeat (a stat call) and, while stalled, at the caps.
pub const CHECK_EVERY: Duration = Duration::from_millis(250);

/// While it holds the reserve, how often the fence writes its reading to the fleet's store
/// again (a grant written after the last record makes it stale).
pub const PROOF_EVERY: Duration = Duration::from_secs(2);

/// `tokwatt fence`'s settings.
#[derive(Debug, Clone, PartialEq)]
pub struct FenceSettings {
    /// The file the agent touches (its `fleet.fence.heartbeat`).
    pub heartbeat: PathBuf,
    /// How long the heartbeat may stay unchanged before the reserve is applied.
    pub stall: Duration,
    /// The node's reserve, watts (its `fleet.reserve_w`).
    pub reserve_w: f64,
    /// The status file (the agent's `fleet.fence.status`).
    pub status: PathBuf,
}

/// What one check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The heartbeat changed within the stall time.
    Beating,
    /// It did not: the caps are held within the reserve (`lowered`: this check lowered
    /// some; `failed`: reading or lowering them failed, tried again at the next check).
    Stalled { lowered: bool, failed: bool },
}

/// The fence's state between checks; time and the heartbeat's modification time are given
/// to it, so that it is tested without waiting.
#[derive(Debug)]
pub struct Watch {
    settings: FenceSettings,
    started: Instant,
    /// The heartbeat's modification time as last seen (`None`: absent).
    last_mtime: Option<SystemTime>,
    /// When the heartbeat last changed (`None`: not since the start).
    last_beat: Option<Instant>,
    holding: bool,
    checks: u64,
    holds: u64,
    caps_w: Option<f64>,
    last_error: Option<String>,
}

impl Watch {
    /// A fence starting at `now`, finding the heartbeat with `mtime` (which is no beat).
    pub fn new(settings: FenceSettings, now: Instant, mtime: Option<SystemTime>) -> Self {
        Self {
            settings,
            started: now,
            last_mtime: mtime,
            last_beat: None,
            holding: false,
            checks: 0,
            holds: 0,
            caps_w: None,
            last_error: None,
        }
    }

    pub fn settings(&self) -> &FenceSettings {
        &self.settings
    }

    pub fn holding(&self) -> bool {
        self.holding
    }

    /// One check at `now`, the heartbeat's modification time being `mtime`.
    pub fn check(
        &mut self,
        now: Instant,
        mtime: Option<SystemTime>,
        actuator: &mut dyn Actuator,
    ) -> Verdict {
        self.checks += 1;
        if mtime.is_some() && mtime != self.last_mtime {
            self.last_beat = Some(now);
        }
        self.last_mtime = mtime;
        let quiet = now.saturating_duration_since(self.last_beat.unwrap_or(self.started));
        if quiet < self.settings.stall {
            if self.holding {
                tracing::warn!(
                    heartbeat = %self.settings.heartbeat.display(),
                    "fence: the heartbeat beats again: the agent's loop runs, and holds its own allowance"
                );
                self.holding = false;
                self.caps_w = None;
            }
            return Verdict::Beating;
        }
        if !self.holding {
            tracing::warn!(
                heartbeat = %self.settings.heartbeat.display(),
                quiet_s = quiet.as_secs_f64(),
                reserve_w = self.settings.reserve_w,
                "fence: the heartbeat stalled: holding the GPUs' caps within the reserve"
            );
            self.holding = true;
        }
        match apply_reserve(actuator, self.settings.reserve_w) {
            Ok(applied) => {
                self.caps_w = Some(applied.after_w);
                self.last_error = None;
                let lowered = !applied.lowered.is_empty();
                if lowered {
                    self.holds += 1;
                    tracing::warn!("fence: {applied}");
                } else if applied.unmet {
                    tracing::error!("fence: {applied}");
                }
                Verdict::Stalled {
                    lowered,
                    failed: false,
                }
            }
            Err(error) => {
                tracing::error!("fence: applying the reserve: {error}");
                self.last_error = Some(error.to_string());
                Verdict::Stalled {
                    lowered: false,
                    failed: true,
                }
            }
        }
    }

    /// The status as of `now` (`wall`: the same moment by the wall clock).
    pub fn status(&self, now: Instant, wall: SystemTime) -> FenceStatus {
        FenceStatus {
            format_version: STATUS_FORMAT_VERSION,
            pid: std::process::id(),
            heartbeat: self.settings.heartbeat.clone(),
            stall_s: self.settings.stall.as_secs_f64(),
            reserve_w: self.settings.reserve_w,
            checks: self.checks,
            checked_at_unix_s: wall
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            beat_age_s: self
                .last_beat
                .map(|beat| now.saturating_duration_since(beat).as_secs_f64()),
            holding: self.holding,
            caps_w: self.caps_w,
            holds: self.holds,
            last_error: self.last_error.clone(),
        }
    }
}

/// The heartbeat's modification time; `None` where it cannot be read (absent, or
/// unreadable: either way no beat, so the fence errs toward the reserve).
pub fn heartbeat_mtime(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Runs the fence until `stop` is raised: a check every [`CHECK_EVERY`], the status
/// rewritten every [`STATUS_EVERY`] and whenever the hold starts or ends. The status file
/// is removed on the way out, so the agent stops declaring the fence at once.
///
/// With a `proof` target, while it holds the reserve the fence reads the caps back and
/// writes them to the fleet's store (a [`ProofSource::Fence`] record) at once and then
/// every [`PROOF_EVERY`]: the coordinator frees the node's watts only on a record
/// written after its last grant, and a grant may land after the first record while the
/// node's lease is still live. A record that cannot be written is logged and tried
/// again; the hold never depends on the store.
pub fn run(
    settings: FenceSettings,
    actuator: &mut dyn Actuator,
    stop: &AtomicBool,
    proof: Option<&ProofTarget>,
) -> Result<(), FenceError> {
    if !(settings.reserve_w.is_finite() && settings.reserve_w > 0.0) {
        return Err(FenceError::BadReserve {
            reserve_w: settings.reserve_w,
        });
    }
    let folder = settings
        .heartbeat
        .parent()
        .filter(|f| !f.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !folder.is_dir() {
        return Err(FenceError::NoHeartbeatFolder {
            folder: folder.to_owned(),
        });
    }
    let status_path = settings.status.clone();
    let found = heartbeat_mtime(&settings.heartbeat);
    let mut watch = Watch::new(settings, Instant::now(), found);
    // The first status at once: the agent needs two to see the fence alive.
    write_status(&watch, &status_path)?;
    let mut next_status = Instant::now() + STATUS_EVERY;
    // While holding: when the next record is due (`None`: at once).
    let mut next_proof: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        let was_holding = watch.holding();
        let mtime = heartbeat_mtime(&watch.settings.heartbeat);
        let verdict = watch.check(now, mtime, actuator);
        match verdict {
            Verdict::Stalled { failed: false, .. } => {
                if let Some(target) = proof
                    && next_proof.is_none_or(|due| now >= due)
                {
                    match target.write(ProofSource::Fence, actuator, "the heartbeat stalled") {
                        Ok(written) => {
                            if next_proof.is_none() {
                                tracing::warn!(
                                    revision = written.revision,
                                    "fence: the caps read back ({:.0} W) written to the fleet's store as proof of release",
                                    written.sum_w
                                );
                            }
                            next_proof = Some(now + PROOF_EVERY);
                        }
                        Err(error) => {
                            tracing::error!("fence: {error}; trying again");
                            next_proof = Some(now + CHECK_EVERY);
                        }
                    }
                }
            }
            Verdict::Stalled { failed: true, .. } => {}
            Verdict::Beating => next_proof = None,
        }
        if now >= next_status || watch.holding() != was_holding {
            if let Err(error) = write_status(&watch, &status_path) {
                // The hold does not depend on the status: keep fencing.
                tracing::warn!("fence: {error}");
            }
            next_status = now + STATUS_EVERY;
        }
        std::thread::sleep(CHECK_EVERY);
    }
    if let Err(error) = std::fs::remove_file(&status_path)
        && error.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(path = %status_path.display(), "fence: removing the status file: {error}");
    }
    Ok(())
}

fn write_status(watch: &Watch, path: &Path) -> Result<(), FenceError> {
    watch.status(Instant::now(), SystemTime::now()).write(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fence::reserve::tests::Boards;

    fn settings() -> FenceSettings {
        FenceSettings {
            heartbeat: "/run/tokwatt-fence/heartbeat".into(),
            stall: Duration::from_secs(5),
            reserve_w: 1200.0,
            status: "/run/tokwatt-fence/status.json".into(),
        }
    }

    fn wall(s: u64) -> Option<SystemTime> {
        Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + s))
    }

    #[test]
    fn a_heartbeat_that_stops_changing_brings_the_caps_to_the_reserve_and_keeps_them_there() {
        let start = Instant::now();
        let at = |s: f64| start + Duration::from_secs_f64(s);
        let mut boards = Boards::at(&[700.0, 700.0, 700.0, 700.0]);
        let mut watch = Watch::new(settings(), start, wall(0));
        // Beats every second for 10 s: nothing happens.
        for s in 1..=10 {
            assert_eq!(
                watch.check(at(s as f64), wall(s), &mut boards),
                Verdict::Beating
            );
        }
        assert_eq!(boards.sets, 0);
        // The agent stops at 10 s: still within the stall at 14.9 s.
        assert_eq!(
            watch.check(at(14.9), wall(10), &mut boards),
            Verdict::Beating
        );
        assert_eq!(boards.sum(), 2800.0);
        // At 15 s the reserve is applied.
        assert_eq!(
            watch.check(at(15.0), wall(10), &mut boards),
            Verdict::Stalled {
                lowered: true,
                failed: false
            }
        );
        assert!(boards.sum() <= 1200.0, "{boards:?}");
        assert!(watch.holding());
        // Held: nothing more to do, until something raises a cap again.
        assert_eq!(
            watch.check(at(15.25), wall(10), &mut boards),
            Verdict::Stalled {
                lowered: false,
                failed: false
            }
        );
        boards.caps[0] = 700.0;
        assert_eq!(
            watch.check(at(15.5), wall(10), &mut boards),
            Verdict::Stalled {
                lowered: true,
                failed: false
            }
        );
        assert!(boards.sum() <= 1200.0);
        let status = watch.status(at(15.5), SystemTime::now());
        assert!(status.holding && status.holds == 2, "{status:?}");
        assert_eq!(status.beat_age_s, Some(5.5));
        // The agent beats again: the hold ends, and no cap is raised by the fence.
        let held = boards.caps.clone();
        assert_eq!(
            watch.check(at(16.0), wall(16), &mut boards),
            Verdict::Beating
        );
        assert!(!watch.holding());
        assert_eq!(boards.caps, held);
    }

    #[test]
    fn an_agent_that_never_beats_is_fenced_a_stall_after_the_fence_started() {
        let start = Instant::now();
        let at = |s: f64| start + Duration::from_secs_f64(s);
        let mut boards = Boards::at(&[700.0, 700.0]);
        // A heartbeat left by an earlier agent is no beat.
        let mut watch = Watch::new(settings(), start, wall(0));
        assert_eq!(watch.check(at(4.9), wall(0), &mut boards), Verdict::Beating);
        assert!(matches!(
            watch.check(at(5.0), wall(0), &mut boards),
            Verdict::Stalled { lowered: true, .. }
        ));
        assert!(boards.sum() <= 1200.0);
        // No heartbeat file at all: the same.
        let mut boards = Boards::at(&[700.0, 700.0]);
        let mut watch = Watch::new(settings(), start, None);
        assert_eq!(watch.check(at(4.9), None, &mut boards), Verdict::Beating);
        assert!(matches!(
            watch.check(at(5.0), None, &mut boards),
            Verdict::Stalled { lowered: true, .. }
        ));
        assert_eq!(watch.status(at(5.0), SystemTime::now()).beat_age_s, None);
    }

    #[test]
    fn a_heartbeat_removed_or_stepped_back_in_wall_time_still_counts_by_its_changes() {
        let start = Instant::now();
        let at = |s: f64| start + Duration::from_secs_f64(s);
        let mut boards = Boards::at(&[700.0, 700.0]);
        let mut watch = Watch::new(settings(), start, None);
        assert_eq!(
            watch.check(at(1.0), wall(100), &mut boards),
            Verdict::Beating
        );
        // The wall clock stepped back an hour: a change is a beat all the same.
        assert_eq!(watch.check(at(4.0), wall(0), &mut boards), Verdict::Beating);
        assert_eq!(watch.check(at(8.9), wall(0), &mut boards), Verdict::Beating);
        // The file goes: no beat from then on; the stall counts from the last beat.
        assert_eq!(watch.check(at(8.95), None, &mut boards), Verdict::Beating);
        assert!(matches!(
            watch.check(at(9.0), None, &mut boards),
            Verdict::Stalled { .. }
        ));
        // Recreated by a restarted agent: a beat.
        assert_eq!(watch.check(at(9.5), wall(1), &mut boards), Verdict::Beating);
    }

    #[test]
    fn a_failing_board_is_tried_again_at_every_check_and_reported() {
        let start = Instant::now();
        let at = |s: f64| start + Duration::from_secs_f64(s);
        let mut boards = Boards::at(&[700.0, 700.0]);
        boards.broken = Some(0);
        let mut watch = Watch::new(settings(), start, None);
        assert_eq!(
            watch.check(at(5.0), None, &mut boards),
            Verdict::Stalled {
                lowered: false,
                failed: true
            }
        );
        let status = watch.status(at(5.0), SystemTime::now());
        assert!(status.last_error.is_some_and(|e| e.contains("GPU 0")));
        boards.broken = None;
        assert_eq!(
            watch.check(at(5.25), None, &mut boards),
            Verdict::Stalled {
                lowered: true,
                failed: false
            }
        );
        assert!(boards.sum() <= 1200.0);
        assert_eq!(watch.status(at(5.25), SystemTime::now()).last_error, None);
    }

    #[test]
    fn the_fence_runs_until_stopped_writes_its_status_and_removes_it_on_the_way_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let settings = FenceSettings {
            heartbeat: dir.path().join("heartbeat"),
            stall: Duration::from_millis(600),
            reserve_w: 1200.0,
            status: dir.path().join("status.json"),
        };
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let fence = {
            let (settings, stop) = (settings.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut boards = Boards::at(&[700.0, 700.0]);
                run(settings, &mut boards, &stop, None).map(|()| boards)
            })
        };
        tokwatt_test_support::wait_for("a holding status", Duration::from_secs(10), || {
            FenceStatus::read(&settings.status)
                .ok()
                .flatten()
                .is_some_and(|s| s.holding)
        });
        stop.store(true, Ordering::Relaxed);
        let boards = fence.join().expect("no panic").expect("ran");
        assert!(boards.sum() <= 1200.0, "{boards:?}");
        assert!(!settings.status.exists(), "the status file is removed");

        let missing = FenceSettings {
            heartbeat: dir.path().join("absent/heartbeat"),
            ..settings
        };
        let error = run(
            missing,
            &mut Boards::at(&[700.0]),
            &AtomicBool::new(false),
            None,
        )
        .expect_err("refused");
        assert!(error.to_string().contains("absent"), "{error}");
    }
}
