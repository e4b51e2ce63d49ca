//! The agent's side of its fence ([`crate::fence`]): the loop feeds it after every
//! on-time tick (systemd's watchdog over `NOTIFY_SOCKET`, or the heartbeat file), the
//! fleet thread declares it in the node's reports (the watchdog from the start, the
//! heartbeat's fence only while its status shows it alive), and a start in a power domain
//! applies the reserve before anything that can fail.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokwatt_fleet::{Fence, FenceKind};

use super::ServeError;
use super::config::{FenceConfig, FenceWatch, FleetConfig, NodeBackend, ServeConfig};
use crate::fence::notify::SystemdNotifier;
use crate::fence::status::StatusWatch;

/// The most often the loop feeds its fence: a tick of 10 ms (or the virtual clock's
/// back-to-back ticks) need not send a datagram or touch a file each time; a watchdog
/// interval or a stall is seconds.
const FEED_EVERY: Duration = Duration::from_millis(100);

/// The shortest watchdog interval (or heartbeat stall), in ticks and in feeds: one late
/// tick must not get the agent aborted, nor a tick of 10 ms fed every [`FEED_EVERY`].
const MIN_WATCHDOG_TICKS: u32 = 3;

/// The shortest watchdog interval or stall that feeds every tick can keep satisfied.
fn shortest_watch(tick: Duration) -> Duration {
    (MIN_WATCHDOG_TICKS * tick).max(MIN_WATCHDOG_TICKS * FEED_EVERY)
}

/// What the loop feeds after each on-time tick.
#[derive(Debug)]
pub(super) struct FenceFeed {
    /// systemd, where it runs the agent as a `Type=notify` service with a watchdog.
    watchdog: Option<Arc<SystemdNotifier>>,
    /// The heartbeat file `tokwatt fence` watches.
    heartbeat: Option<PathBuf>,
    tick: Duration,
    /// When the last tick ended.
    last_end: Option<Instant>,
    last_fed: Option<Instant>,
    /// The last feed failed (logged once until one succeeds).
    failing: bool,
}

impl FenceFeed {
    /// Feeds nothing.
    #[cfg(test)]
    fn none(tick: Duration) -> Self {
        Self {
            watchdog: None,
            heartbeat: None,
            tick,
            last_end: None,
            last_fed: None,
            failing: false,
        }
    }

    /// After each tick, on the loop's thread (`lateness`: how late the tick started
    /// against its schedule; `now`: when it ended). A tick is on time when it started
    /// less than a tick late and ended less than two ticks after the one before: a tick
    /// that hung in a GPU call feeds nothing, even once it returns. Returns whether it fed.
    pub(super) fn after_tick(&mut self, lateness: Duration, now: Instant) -> bool {
        let previous = self.last_end.replace(now);
        let on_time = lateness < self.tick
            && previous.is_none_or(|end| now.saturating_duration_since(end) < 2 * self.tick);
        let due = self
            .last_fed
            .is_none_or(|fed| now.saturating_duration_since(fed) >= FEED_EVERY);
        if !on_time || !due || (self.watchdog.is_none() && self.heartbeat.is_none()) {
            return false;
        }
        self.last_fed = Some(now);
        let mut failure = None;
        if let Some(systemd) = &self.watchdog
            && let Err(error) = systemd.notify("WATCHDOG=1")
        {
            failure = Some(format!("notifying systemd's watchdog: {error}"));
        }
        if let Some(path) = &self.heartbeat
            && let Err(error) = touch(path)
        {
            failure = Some(format!(
                "touching the heartbeat {}: {error}",
                path.display()
            ));
        }
        match failure {
            Some(why) if !self.failing => {
                self.failing = true;
                tracing::error!(
                    "fence: {why}; the fence will apply the reserve unless it is fed again"
                );
            }
            Some(_) => {}
            None if self.failing => {
                self.failing = false;
                tracing::warn!("fence: fed again");
            }
            None => {}
        }
        true
    }
}

/// Sets the heartbeat's modification time to now (creating the file where it is not):
/// the change is the beat `tokwatt fence` looks for.
fn touch(path: &std::path::Path) -> std::io::Result<()> {
    std::fs::File::options()
        .create(true)
        .write(true)
        .truncate(false)
        .open(path)?
        .set_modified(SystemTime::now())
}

/// What the node declares about its fence, read by the fleet thread before each report.
#[derive(Debug)]
pub(super) struct FenceDeclaration {
    config: FenceConfig,
    reserve_w: f64,
    tick: Duration,
    /// systemd's watchdog interval (the watchdog kind).
    watchdog: Option<Duration>,
    /// The fence's status file (the heartbeat kind).
    status: Option<StatusWatch>,
    /// What the last call declared, to log each change once.
    declared: Option<Fence>,
    /// Why the last call declared nothing, to log each reason once.
    undeclared_because: Option<String>,
}

impl FenceDeclaration {
    /// The fence to declare as of `now` (`None`: none is proved to run).
    pub(super) fn now(&mut self, now: Instant) -> Option<Fence> {
        let declared = match self.evaluate(now) {
            Ok(fence) => {
                self.undeclared_because = None;
                Some(fence)
            }
            Err(why) => {
                if self.undeclared_because.as_ref() != Some(&why) {
                    tracing::warn!(
                        "fence: not declared in the node's reports (a silent node is charged as unfenced): {why}"
                    );
                    self.undeclared_because = Some(why);
                }
                None
            }
        };
        if let Some(fence) = declared
            && self.declared != declared
        {
            tracing::info!(
                kind = ?fence.kind,
                deadline_s = fence.deadline_s,
                covers_reboot = fence.covers_reboot,
                "fence: declared in the node's reports"
            );
        }
        self.declared = declared;
        declared
    }

    fn evaluate(&mut self, now: Instant) -> Result<Fence, String> {
        let restore_s = self.config.restore.as_secs_f64();
        let covers_reboot = self.config.covers_reboot;
        if let Some(watchdog) = self.watchdog {
            return Ok(Fence {
                kind: FenceKind::SystemdWatchdog,
                deadline_s: watchdog.as_secs_f64() + restore_s,
                covers_reboot,
            });
        }
        let Some(watch) = &mut self.status else {
            return Err("no fence configured".into());
        };
        let status = match watch.alive(now) {
            Ok(Some(status)) => status,
            Ok(None) => {
                return Err(format!(
                    "the fence's status {} is absent or has not changed for {:?}: is `tokwatt fence --status` running?",
                    watch.path().display(),
                    crate::fence::status::STATUS_FRESH
                ));
            }
            Err(error) => return Err(error.to_string()),
        };
        if status.holding {
            return Err(format!(
                "the fence holds the reserve: it saw no beat of {} for {} s (if this lasts while the agent runs, the fence watches another file than fleet.fence.heartbeat)",
                status.heartbeat.display(),
                status.stall_s
            ));
        }
        if !(status.stall_s.is_finite() && status.stall_s > 0.0) {
            return Err(format!("the fence reports a stall of {} s", status.stall_s));
        }
        if status.reserve_w > self.reserve_w + 0.5 {
            return Err(format!(
                "the fence applies a reserve of {} W, above this node's {} W: give `tokwatt fence --reserve` the node's reserve",
                status.reserve_w, self.reserve_w
            ));
        }
        if status.stall_s < shortest_watch(self.tick).as_secs_f64() {
            tracing::warn!(
                stall_s = status.stall_s,
                tick = ?self.tick,
                "fence: the fence's stall is under {MIN_WATCHDOG_TICKS} ticks (and 300 ms): a late tick or two will make it apply the reserve"
            );
        }
        Ok(Fence {
            kind: FenceKind::Heartbeat,
            deadline_s: status.stall_s + restore_s,
            covers_reboot,
        })
    }
}

/// The fence's pieces for a start: what the loop feeds, what the fleet thread declares,
/// and systemd's notifier (for `READY=1` and `STOPPING=1`).
#[derive(Debug)]
pub(super) struct FenceParts {
    pub feed: FenceFeed,
    pub declaration: Option<FenceDeclaration>,
    pub systemd: Option<Arc<SystemdNotifier>>,
}

/// From the config and the environment systemd gives (`systemd`: from `NOTIFY_SOCKET`):
/// refuses a watchdog fence systemd does not run, and a heartbeat whose folder is missing.
pub(super) fn prepare(
    fleet: Option<&FleetConfig>,
    systemd: Option<SystemdNotifier>,
    tick: Duration,
) -> Result<FenceParts, ServeError> {
    let systemd = systemd.map(Arc::new);
    // Wherever systemd runs a watchdog for the agent, the loop feeds it, fenced or not:
    // a unit's WatchdogSec= works without a `[fleet.fence]` too.
    let watchdog = systemd.as_ref().and_then(|s| s.watchdog());
    if let Some(interval) = watchdog
        && interval < shortest_watch(tick)
    {
        return Err(ServeError::Fence(format!(
            "systemd's watchdog interval ({interval:?}, the unit's WatchdogSec=) is under {:?} ({MIN_WATCHDOG_TICKS} ticks of {tick:?}, and at least {MIN_WATCHDOG_TICKS} feeds of the watchdog): one late tick would get the agent aborted; raise WatchdogSec=",
            shortest_watch(tick)
        )));
    }
    let fence = fleet.and_then(|f| f.fence.as_ref());
    let mut feed = FenceFeed {
        watchdog: watchdog.and(systemd.clone()),
        heartbeat: None,
        tick,
        last_end: None,
        last_fed: None,
        failing: false,
    };
    let declaration = match (fleet, fence) {
        (Some(fleet), Some(fence)) => {
            let (watchdog, status) = match &fence.watch {
                FenceWatch::SystemdWatchdog => {
                    let Some(interval) = watchdog else {
                        return Err(ServeError::Fence(if systemd.is_none() {
                            "fleet.fence.kind = \"systemd-watchdog\" but NOTIFY_SOCKET and WATCHDOG_USEC are not set: systemd sets them for a unit with Type=notify and WatchdogSec= (deploy/systemd/tokwatt.service); run the agent from such a unit, or fence it with kind = \"heartbeat\" and `tokwatt fence`".to_owned()
                        } else {
                            "fleet.fence.kind = \"systemd-watchdog\" but systemd set NOTIFY_SOCKET without WATCHDOG_USEC (for this process): set WatchdogSec= in the unit (deploy/systemd/tokwatt.service)".to_owned()
                        }));
                    };
                    (Some(interval), None)
                }
                FenceWatch::Heartbeat { heartbeat, status } => {
                    let folder = heartbeat.parent().unwrap_or(std::path::Path::new("/"));
                    if !folder.is_dir() {
                        return Err(ServeError::Fence(format!(
                            "the heartbeat's folder {} (fleet.fence.heartbeat) does not exist: create it, or name a file in a folder the agent and `tokwatt fence` share",
                            folder.display()
                        )));
                    }
                    feed.heartbeat = Some(heartbeat.clone());
                    (None, Some(StatusWatch::new(status.clone())))
                }
            };
            Some(FenceDeclaration {
                config: fence.clone(),
                reserve_w: fleet.link.reserve_w,
                tick,
                watchdog,
                status,
                declared: None,
                undeclared_because: None,
            })
        }
        _ => None,
    };
    Ok(FenceParts {
        feed,
        declaration,
        systemd,
    })
}

/// The boot this node runs in, as its reports and its boot unit's record name it (0, and
/// a warning, where it cannot be read: no boot record then proves a reboot lands at the
/// reserve, and the node is charged its board defaults).
pub(super) fn node_boot(config: &ServeConfig) -> u64 {
    let driver = match &config.backend {
        NodeBackend::Sim { driver, .. } => driver.as_deref(),
        NodeBackend::Nvml { .. } => None,
    };
    match tokwatt_agent::assembly::boot_identity(driver) {
        Ok(identity) => tokwatt_fleet::boot_of(&identity),
        Err(error) => {
            tracing::warn!("fleet: {error}; reporting no boot");
            0
        }
    }
}

/// The GPUs whose caps a start in a power domain fits within the reserve, opened once
/// for the whole start: `None` for a dry run, a batch-only node and a simulator without a
/// driver file (nothing of theirs is set, or outlives the process).
pub(super) fn reserve_gpus(
    config: &ServeConfig,
) -> Result<Option<Box<dyn tokwatt_core::actuator::Actuator>>, ServeError> {
    if config.dry_run || config.batch_only {
        return Ok(None);
    }
    Ok(match &config.backend {
        NodeBackend::Nvml { gpus } => Some(Box::new(
            tokwatt_nvml::NvmlSystem::open(gpus.as_deref())?.actuator(),
        )),
        NodeBackend::Sim { .. } => sim_driver_actuator(config)?,
    })
}

/// In a power domain, the node's caps within `reserve_w` now: the first thing a start
/// does, before the policy spec, the plugin and anything else that can fail. A caps left
/// by a crash, a board's defaults after a reboot, or a grant that lapsed while the agent
/// was down may be above the reserve, and an agent that then fails to start would leave
/// them there, charged by nobody. Lowers only.
pub(super) fn apply_reserve_at_start(
    gpus: &mut dyn tokwatt_core::actuator::Actuator,
    reserve_w: f64,
) -> Result<(), ServeError> {
    let applied = crate::fence::apply_reserve(gpus, reserve_w).map_err(|e| {
        ServeError::Fleet(format!(
            "applying the reserve ({reserve_w} W) at start: {e}; nothing else was changed"
        ))
    })?;
    if applied.lowered.is_empty() {
        tracing::info!("fleet: at start, {applied}");
    } else {
        tracing::warn!("fleet: the reserve applied at start: {applied}");
    }
    Ok(())
}

/// The caps read back once the reserve is in force, written to the fleet's store as the
/// restarted agent's record ([`tokwatt_fleet::ProofSource::Agent`]): a node whose agent
/// starts but cannot join still frees the watts its silence strands. A record that cannot
/// be written is logged; the start goes on (the node stays charged).
pub(super) fn prove_at_start(
    gpus: &mut dyn tokwatt_core::actuator::Actuator,
    target: &crate::fence::ProofTarget,
) {
    match target.write(
        tokwatt_fleet::ProofSource::Agent,
        gpus,
        "the reserve applied at the agent's start",
    ) {
        Ok(written) => tracing::info!(
            revision = written.revision,
            "fleet: the caps read back at start ({:.0} W) written as proof of release",
            written.sum_w
        ),
        Err(error) => {
            tracing::warn!("fleet: {error}; the coordinator keeps the node charged until it joins")
        }
    }
}

/// The simulated node's actuator on its driver file, where it has one (the simulated
/// driver keeps the boards' caps outside the process, as a real driver does).
fn sim_driver_actuator(
    config: &ServeConfig,
) -> Result<Option<Box<dyn tokwatt_core::actuator::Actuator>>, ServeError> {
    let NodeBackend::Sim {
        profile,
        gpus,
        driver: Some(driver),
        ..
    } = &config.backend
    else {
        return Ok(None);
    };
    let target = tokwatt_agent::assembly::SimTarget {
        gpus: *gpus,
        driver: Some(driver.clone()),
        ..tokwatt_agent::assembly::SimTarget::new(profile.clone())
    };
    let (_sim, backends) = tokwatt_agent::assembly::simulator(&target, config.seed)?;
    Ok(Some(backends.actuator))
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixDatagram;

    use super::*;
    use crate::fence::status::{FenceStatus, STATUS_FORMAT_VERSION};

    const TICK: Duration = Duration::from_secs(1);

    fn notifier(socket: &std::path::Path, watchdog_usec: Option<&str>) -> SystemdNotifier {
        let socket = socket.as_os_str().to_owned();
        let watchdog = watchdog_usec.map(std::ffi::OsString::from);
        SystemdNotifier::from_env(
            move |name| match name {
                "NOTIFY_SOCKET" => Some(socket.clone()),
                "WATCHDOG_USEC" => watchdog.clone(),
                _ => None,
            },
            std::process::id(),
        )
        .expect("valid")
        .expect("a notifier")
    }

    fn received(systemd: &UnixDatagram) -> Vec<String> {
        let mut messages = Vec::new();
        let mut buffer = [0_u8; 64];
        while let Ok(n) = systemd.recv(&mut buffer) {
            messages.push(String::from_utf8_lossy(&buffer[..n]).into_owned());
        }
        messages
    }

    #[test]
    fn the_watchdog_is_fed_after_on_time_ticks_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify.sock");
        let systemd = UnixDatagram::bind(&path).expect("bind");
        systemd.set_nonblocking(true).expect("nonblocking");
        let parts = prepare(None, Some(notifier(&path, Some("5000000"))), TICK).expect("ready");
        let mut feed = parts.feed;
        let start = Instant::now();
        let at = |s: f64| start + Duration::from_secs_f64(s);
        // On time: fed.
        assert!(feed.after_tick(Duration::ZERO, at(1.0)));
        assert!(feed.after_tick(Duration::from_millis(300), at(2.0)));
        assert_eq!(received(&systemd), ["WATCHDOG=1", "WATCHDOG=1"]);
        // A tick that started a whole tick late: not fed.
        assert!(!feed.after_tick(Duration::from_secs(1), at(3.0)));
        // One that started on time but hung 5 s in a GPU call before it ended: not fed.
        assert!(!feed.after_tick(Duration::ZERO, at(8.0)));
        assert_eq!(received(&systemd), Vec::<String>::new());
        // On time again: fed.
        assert!(feed.after_tick(Duration::from_millis(10), at(9.0)));
        assert_eq!(received(&systemd), ["WATCHDOG=1"]);
        // Ticks closer together than FEED_EVERY feed once.
        assert!(!feed.after_tick(Duration::ZERO, at(9.05)));
        assert!(feed.after_tick(Duration::ZERO, at(9.1)));
        assert_eq!(received(&systemd), ["WATCHDOG=1"]);
    }

    #[test]
    fn without_a_watchdog_nothing_is_sent_and_a_watchdog_fence_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify.sock");
        let systemd = UnixDatagram::bind(&path).expect("bind");
        systemd.set_nonblocking(true).expect("nonblocking");
        let parts = prepare(None, Some(notifier(&path, None)), TICK).expect("ready");
        let mut feed = parts.feed;
        assert!(!feed.after_tick(Duration::ZERO, Instant::now()));
        assert!(received(&systemd).is_empty());
        assert!(!FenceFeed::none(TICK).after_tick(Duration::ZERO, Instant::now()));

        let fleet = fleet_with(FenceWatch::SystemdWatchdog);
        let error = prepare(Some(&fleet), None, TICK).expect_err("refused");
        assert!(
            error.to_string().contains("NOTIFY_SOCKET")
                && error.to_string().contains("WatchdogSec="),
            "{error}"
        );
        let error = prepare(Some(&fleet), Some(notifier(&path, None)), TICK).expect_err("refused");
        assert!(error.to_string().contains("WATCHDOG_USEC"), "{error}");
        // A 10 ms tick fed every 100 ms: a 200 ms watchdog is too short.
        let error = prepare(
            Some(&fleet),
            Some(notifier(&path, Some("200000"))),
            Duration::from_millis(10),
        )
        .expect_err("refused");
        assert!(error.to_string().contains("300ms"), "{error}");
        // An interval of two ticks is too short.
        let error = prepare(Some(&fleet), Some(notifier(&path, Some("2000000"))), TICK)
            .expect_err("refused");
        assert!(error.to_string().contains("WatchdogSec="), "{error}");
    }

    #[test]
    fn a_watchdog_fence_is_declared_with_the_interval_plus_the_restore_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify.sock");
        let _systemd = UnixDatagram::bind(&path).expect("bind");
        let fleet = fleet_with(FenceWatch::SystemdWatchdog);
        let parts =
            prepare(Some(&fleet), Some(notifier(&path, Some("5000000"))), TICK).expect("ready");
        assert!(parts.systemd.is_some());
        let mut declaration = parts.declaration.expect("declared");
        assert_eq!(
            declaration.now(Instant::now()),
            Some(Fence {
                kind: FenceKind::SystemdWatchdog,
                deadline_s: 15.0,
                covers_reboot: true,
            })
        );
    }

    #[test]
    fn a_heartbeat_fence_is_touched_on_time_and_declared_only_while_its_status_changes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let heartbeat = dir.path().join("heartbeat");
        let status_path = dir.path().join("status.json");
        let fleet = fleet_with(FenceWatch::Heartbeat {
            heartbeat: heartbeat.clone(),
            status: status_path.clone(),
        });
        let parts = prepare(Some(&fleet), None, TICK).expect("ready");
        let (mut feed, mut declaration) = (parts.feed, parts.declaration.expect("a fence"));
        let start = Instant::now();
        let at = |s: f64| start + Duration::from_secs_f64(s);

        assert!(!heartbeat.exists());
        assert!(feed.after_tick(Duration::ZERO, at(1.0)));
        let first = std::fs::metadata(&heartbeat)
            .and_then(|m| m.modified())
            .expect("touched");
        assert!(!feed.after_tick(Duration::from_secs(2), at(2.0)));
        assert_eq!(
            std::fs::metadata(&heartbeat)
                .and_then(|m| m.modified())
                .expect("there"),
            first,
            "a late tick does not touch it"
        );
        std::thread::sleep(Duration::from_millis(5));
        assert!(feed.after_tick(Duration::ZERO, at(3.0)));
        assert!(
            std::fs::metadata(&heartbeat)
                .and_then(|m| m.modified())
                .expect("there")
                > first
        );

        let status = |checks: u64, holding: bool, reserve_w: f64| FenceStatus {
            format_version: STATUS_FORMAT_VERSION,
            pid: 9,
            heartbeat: heartbeat.clone(),
            stall_s: 4.0,
            reserve_w,
            checks,
            checked_at_unix_s: 0.0,
            beat_age_s: Some(0.5),
            holding,
            caps_w: None,
            holds: 0,
            last_error: None,
        };
        assert_eq!(declaration.now(at(0.0)), None, "no fence running");
        status(1, false, 1200.0)
            .write(&status_path)
            .expect("written");
        assert_eq!(
            declaration.now(at(0.5)),
            None,
            "seen once: not proved alive"
        );
        status(2, false, 1200.0)
            .write(&status_path)
            .expect("written");
        let fenced = Some(Fence {
            kind: FenceKind::Heartbeat,
            deadline_s: 14.0,
            covers_reboot: true,
        });
        assert_eq!(declaration.now(at(1.5)), fenced);
        // Stopped: no longer declared once its status is 3 s old.
        assert_eq!(declaration.now(at(5.0)), None);
        // Holding the reserve, or applying more than the node's reserve: not declared.
        status(3, true, 1200.0)
            .write(&status_path)
            .expect("written");
        assert_eq!(declaration.now(at(5.5)), None);
        status(4, false, 2000.0)
            .write(&status_path)
            .expect("written");
        assert_eq!(declaration.now(at(6.0)), None);
        status(5, false, 1000.0)
            .write(&status_path)
            .expect("written");
        assert_eq!(declaration.now(at(6.5)), fenced);

        let missing = fleet_with(FenceWatch::Heartbeat {
            heartbeat: dir.path().join("absent/heartbeat"),
            status: status_path,
        });
        let error = prepare(Some(&missing), None, TICK).expect_err("refused");
        assert!(
            error.to_string().contains("fleet.fence.heartbeat"),
            "{error}"
        );
    }

    fn fleet_with(watch: FenceWatch) -> FleetConfig {
        FleetConfig {
            endpoints: vec!["http://127.0.0.1:1".into()],
            tls: None,
            link: tokwatt_fleet::NodeConfig {
                domain: "rack".into(),
                node: "n1".into(),
                reserve_w: 1200.0,
                ttl: Duration::from_secs(10),
                margin: Duration::from_secs(3),
            },
            report_every: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            fence: Some(FenceConfig {
                watch,
                restore: Duration::from_secs(10),
                covers_reboot: true,
            }),
        }
    }
}
