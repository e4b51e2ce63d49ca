//! The simulated driver: a node's GPU settings kept in a file outside the agent process.
//!
//! On a real GPU a power cap set through NVML stays in the driver when the process that set
//! it is paused, hung or killed, and a reboot puts the board defaults back. A [`SimDriver`]
//! is that driver for the simulator: per board the power cap, the SM and memory clock
//! locks and the workload's batch size, in a small versioned JSON file that every process
//! of a simulated node shares (the agent's [`crate::SimGpu`], a fence, `tokwatt restore`,
//! the fault harness, a simulated reboot).
//!
//! - Every version of the file is complete: a write goes to `PATH.tmp` and is renamed over
//!   `PATH` (then synced, with its folder). So a reader never takes the lock and never
//!   waits: an agent stopped (SIGSTOP) in the middle of a write cannot stall the fault
//!   harness's reads.
//! - Every read-modify-write holds an exclusive lock on `PATH.lock` (std's `File::lock`,
//!   an advisory whole-file lock), so two writers never lose each other's change. It is
//!   held for a read, a small write and a rename, never a sync: a writer stopped while it
//!   holds it stalls the other writers (for at most 10 s, then they fail saying so).
//! - The file carries a generation, bumped by every write that changes something; a write
//!   that changes nothing leaves the file alone.
//! - A reboot puts every board back at the board defaults and, where a boot unit is
//!   enabled (`boot_reserve_w`), fits the caps within its reserve in the same locked step.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::profile::GpuProfile;

/// The file's layout version; a file of another version is refused, never guessed at.
pub const DRIVER_FORMAT_VERSION: u32 = 1;

/// How long a write waits for another process's lock before it gives up, by default. A
/// write holds the lock for a read, a small write and a rename: only a holder that stopped
/// running (SIGSTOP, a debugger) keeps it longer.
const LOCK_WAIT: Duration = Duration::from_secs(10);

/// What the driver holds for one board.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BoardSettings {
    /// The requested power limit, watts.
    pub power_cap_w: f64,
    /// The SM clock lock `(min, max)`, MHz, as the driver holds it (supported clocks).
    pub sm_clock_lock_mhz: Option<(u32, u32)>,
    pub mem_clock_lock_mhz: Option<(u32, u32)>,
    /// The workload's batch size; `None`: the workload's own initial batch (what a freshly
    /// started serving engine runs, which the driver does not know).
    pub batch_size: Option<u32>,
}

impl BoardSettings {
    /// A board as it boots: the default cap, no clock lock, the workload's own batch.
    pub fn boot_defaults(limits: &BoardLimits) -> Self {
        Self {
            power_cap_w: limits.power_cap_default_w,
            sm_clock_lock_mhz: None,
            mem_clock_lock_mhz: None,
            batch_size: None,
        }
    }
}

/// The boards' power limit constraints (one profile: every board alike).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BoardLimits {
    pub power_cap_min_w: f64,
    pub power_cap_default_w: f64,
    pub power_cap_max_w: f64,
}

impl BoardLimits {
    pub fn of(profile: &GpuProfile) -> Self {
        Self {
            power_cap_min_w: profile.power_cap.min_w,
            power_cap_default_w: profile.power_cap.default_w,
            power_cap_max_w: profile.power_cap.max_w,
        }
    }
}

/// The file's content: everything the simulated driver holds for a node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriverState {
    pub format_version: u32,
    /// The GPU profile's id (`h200`): the boards the file describes.
    pub profile: String,
    /// The boards' name (the profile's), for people reading the file.
    pub board_name: String,
    pub limits: BoardLimits,
    /// Bumped by every write that changes something: a reader that saw this generation has
    /// seen every change up to it.
    pub generation: u64,
    /// Simulated reboots so far.
    pub boots: u64,
    /// `Some`: a boot-time unit is enabled that fits the caps within this many watts (the
    /// node's reserve, summed over its boards) when the node boots.
    pub boot_reserve_w: Option<f64>,
    pub boards: Vec<BoardSettings>,
}

impl DriverState {
    /// A node of `boards` boards of `profile`, as it boots the first time.
    pub fn fresh(profile: &GpuProfile, boards: u32) -> Self {
        let limits = BoardLimits::of(profile);
        Self {
            format_version: DRIVER_FORMAT_VERSION,
            profile: profile.id.clone(),
            board_name: profile.name.clone(),
            limits,
            generation: 0,
            boots: 0,
            boot_reserve_w: None,
            boards: (0..boards)
                .map(|_| BoardSettings::boot_defaults(&limits))
                .collect(),
        }
    }

    /// The sum of the boards' power caps, watts: the most the node's GPUs may draw now.
    pub fn power_cap_sum_w(&self) -> f64 {
        self.boards.iter().map(|b| b.power_cap_w).sum()
    }

    /// The sum of the boards' default caps: what a reboot without a boot unit leaves.
    pub fn power_cap_default_sum_w(&self) -> f64 {
        self.limits.power_cap_default_w * self.boards.len() as f64
    }

    /// The reboot: every board at its defaults, then the boot unit's reserve where one is
    /// enabled.
    fn boot(&mut self) {
        let defaults = BoardSettings::boot_defaults(&self.limits);
        for board in &mut self.boards {
            *board = defaults.clone();
        }
        if let Some(reserve) = self.boot_reserve_w {
            let caps: Vec<f64> = self.boards.iter().map(|b| b.power_cap_w).collect();
            let min = vec![self.limits.power_cap_min_w; caps.len()];
            for (board, cap) in self.boards.iter_mut().zip(fit_within(&caps, &min, reserve)) {
                board.power_cap_w = cap;
            }
        }
        self.boots += 1;
    }

    /// Whether the content is one this tokwatt can act on; the problem in words if not.
    fn check(&self) -> Result<(), String> {
        let limits = &self.limits;
        let ordered = limits.power_cap_max_w.is_finite()
            && 0.0 < limits.power_cap_min_w
            && limits.power_cap_min_w <= limits.power_cap_default_w
            && limits.power_cap_default_w <= limits.power_cap_max_w;
        if !ordered {
            return Err(format!(
                "its limits are not 0 < min <= default <= max: {limits:?}"
            ));
        }
        if self.boards.is_empty() {
            return Err("it describes no board".into());
        }
        if let Some(reserve) = self.boot_reserve_w
            && !(reserve.is_finite() && reserve > 0.0)
        {
            return Err(format!(
                "boot_reserve_w = {reserve} is not a positive wattage"
            ));
        }
        for (index, board) in self.boards.iter().enumerate() {
            let cap = board.power_cap_w;
            if !(cap.is_finite()
                && (limits.power_cap_min_w..=limits.power_cap_max_w).contains(&cap))
            {
                return Err(format!(
                    "board {index}'s power cap {cap} W is outside {}-{} W",
                    limits.power_cap_min_w, limits.power_cap_max_w
                ));
            }
            for (what, lock) in [
                ("SM clock lock", board.sm_clock_lock_mhz),
                ("memory clock lock", board.mem_clock_lock_mhz),
            ] {
                if let Some((lo, hi)) = lock
                    && lo > hi
                {
                    return Err(format!(
                        "board {index}'s {what} {lo}-{hi} MHz has its minimum above its maximum"
                    ));
                }
            }
            if board.batch_size == Some(0) {
                return Err(format!("board {index}'s batch size is 0"));
            }
        }
        Ok(())
    }
}

/// `caps` lowered toward `min` in proportion to each one's room above it, so that they sum
/// to at most `allowance` (down to the milliwatt: rounding up anywhere could pass it); at
/// `min` where even that does not fit. The rule the agent's allowance and its settings
/// guard apply (`tokwatt_agent::control::fit_caps`; this crate depends on core only).
pub fn fit_within(caps: &[f64], min: &[f64], allowance: f64) -> Vec<f64> {
    let total: f64 = caps.iter().sum();
    if total <= allowance {
        return caps.to_vec();
    }
    let room: Vec<f64> = caps
        .iter()
        .zip(min)
        .map(|(c, m)| (c - m).max(0.0))
        .collect();
    let room_total: f64 = room.iter().sum();
    let floor_total: f64 = caps.iter().zip(&room).map(|(c, r)| c - r).sum();
    if floor_total >= allowance || room_total <= 0.0 {
        return caps.iter().zip(&room).map(|(c, r)| c - r).collect();
    }
    let keep = (allowance - floor_total) / room_total;
    caps.iter()
        .zip(&room)
        .map(|(c, r)| ((c - r + r * keep) * 1000.0).floor() / 1000.0)
        .collect()
}

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("cannot {action} the simulated driver file {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the simulated driver file {} does not exist: a simulated node creates it when it starts (tokwatt serve with node.sim_driver, or tokwatt run --sim-driver)", .0.display()
    )]
    Missing(PathBuf),
    #[error(
        "the simulated driver file {} is corrupt ({problem}): delete it, and the next start of the simulated node creates it afresh at the board defaults", path.display()
    )]
    Corrupt { path: PathBuf, problem: String },
    #[error(
        "the simulated driver file {} is format version {found}, this tokwatt reads version {DRIVER_FORMAT_VERSION}: delete it (the next start creates it at the board defaults), or use the tokwatt that wrote it", path.display()
    )]
    Version { path: PathBuf, found: u64 },
    #[error(
        "the simulated driver file {} holds boards of GPU profile '{found}', but this node simulates '{expected}': give each simulated node its own driver file (node.sim_driver, --sim-driver), or delete this one to start from '{expected}''s defaults", path.display()
    )]
    Profile {
        path: PathBuf,
        found: String,
        expected: String,
    },
    #[error(
        "the simulated driver file {} holds boards with power limits {found_limits}, but this node's profile '{profile}' has {expected_limits}: delete it to start from the profile's defaults", path.display()
    )]
    Limits {
        path: PathBuf,
        profile: String,
        found_limits: String,
        expected_limits: String,
    },
    #[error(
        "the simulated driver file {} holds {found} boards, but this node simulates {expected}: simulate {found} GPUs (node.sim_gpus, --gpus), or delete the file to start {expected} boards at their defaults", path.display()
    )]
    BoardCount {
        path: PathBuf,
        found: u32,
        expected: u32,
    },
    #[error(
        "the simulated driver's lock {} has been held by another process ({holder}) for {:.1} s: one stopped (SIGSTOP, a debugger) while it wrote keeps it until it runs again; resume or end it, then retry", path.display(), waited.as_secs_f64()
    )]
    LockTimeout {
        path: PathBuf,
        waited: Duration,
        holder: String,
    },
    #[error("the simulated driver has no board {index} (it holds {count})")]
    NoSuchBoard { index: u32, count: u32 },
    #[error("a boot reserve of {0} W is not a positive number of watts")]
    BadReserve(f64),
}

/// The driver file of a simulated node. Cheap to clone; holds no file open.
#[derive(Debug, Clone)]
pub struct SimDriver {
    path: PathBuf,
    lock_wait: Duration,
}

/// A version of the file as read, with the file itself kept open: while it is open its
/// inode cannot be reused, so a new version is surely a different inode ([`Self::is_current`]).
#[derive(Debug)]
pub struct Snapshot {
    pub state: DriverState,
    pinned: File,
    inode: (u64, u64),
}

impl Snapshot {
    /// Whether `driver`'s file is still this version: one `stat`, no read. An unreadable
    /// file counts as changed (the read that follows says why).
    pub fn is_current(&self, driver: &SimDriver) -> bool {
        std::fs::metadata(&driver.path).is_ok_and(|m| (m.dev(), m.ino()) == self.inode)
    }
}

impl SimDriver {
    /// The driver at `path` (nothing is read until asked).
    pub fn at(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            lock_wait: LOCK_WAIT,
        }
    }

    /// Wait at most `wait` for another writer's lock (10 s by default) before a write fails
    /// with [`DriverError::LockTimeout`]: a process that must act within a deadline (a
    /// fence) waits less and tries again.
    pub fn with_lock_wait(mut self, wait: Duration) -> Self {
        self.lock_wait = wait;
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The lock file beside the driver file.
    pub fn lock_path(&self) -> PathBuf {
        suffixed(&self.path, ".lock")
    }

    /// Open the driver of a node of `boards` boards of `profile`: the file as it is when
    /// it exists (refused when it describes other boards), else created at the board
    /// defaults (as a node that boots the first time; the folder too).
    pub fn open_for(
        path: impl Into<PathBuf>,
        profile: &GpuProfile,
        boards: u32,
    ) -> Result<(SimDriver, Snapshot), DriverError> {
        let driver = Self::at(path);
        let snapshot = match driver.snapshot() {
            Ok(snapshot) => snapshot,
            Err(DriverError::Missing(_)) => driver.create(profile, boards)?,
            Err(e) => return Err(e),
        };
        driver.check_fits(&snapshot.state, profile, boards)?;
        Ok((driver, snapshot))
    }

    /// The file's current version, read without the lock (every version is complete).
    pub fn read(&self) -> Result<DriverState, DriverError> {
        self.snapshot().map(|s| s.state)
    }

    /// The file's current version, kept open (see [`Snapshot`]).
    pub fn snapshot(&self) -> Result<Snapshot, DriverError> {
        let mut file = match File::open(&self.path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(DriverError::Missing(self.path.clone()));
            }
            Err(source) => return Err(self.io("open", source)),
        };
        let metadata = file.metadata().map_err(|e| self.io("read", e))?;
        let mut text = String::new();
        file.read_to_string(&mut text)
            .map_err(|e| self.io("read", e))?;
        Ok(Snapshot {
            state: self.parse(&text)?,
            pinned: file,
            inode: (metadata.dev(), metadata.ino()),
        })
    }

    /// Change the driver's state under the lock: read the current version, apply `change`,
    /// and write it (one generation on) unless nothing changed. Returns the version in
    /// force afterwards.
    pub fn update(
        &self,
        change: impl FnOnce(&mut DriverState) -> Result<(), DriverError>,
    ) -> Result<Snapshot, DriverError> {
        let written = {
            let _lock = self.lock()?;
            let current = self.snapshot()?;
            let mut next = current.state.clone();
            change(&mut next)?;
            if next == current.state {
                return Ok(current);
            }
            next.generation = current.state.generation + 1;
            next.check().map_err(|problem| DriverError::Corrupt {
                path: self.path.clone(),
                problem: format!("the change would make it invalid: {problem}"),
            })?;
            self.replace(next)?
        };
        self.sync(&written);
        Ok(written)
    }

    /// Change board `index`'s settings (see [`Self::update`]).
    pub fn update_board(
        &self,
        index: u32,
        change: impl FnOnce(&mut BoardSettings),
    ) -> Result<Snapshot, DriverError> {
        self.update(|state| {
            let count = state.boards.len() as u32;
            let board = state
                .boards
                .get_mut(index as usize)
                .ok_or(DriverError::NoSuchBoard { index, count })?;
            change(board);
            Ok(())
        })
    }

    /// A simulated reboot: every board back at its defaults (no clock lock, the
    /// workload's own batch), then, where a boot unit is enabled, the caps fitted within
    /// its reserve. One locked step: no reader sees the defaults of a node whose boot unit
    /// applies a reserve.
    pub fn reboot(&self) -> Result<DriverState, DriverError> {
        // A reboot of boards already at their defaults still counts as a boot.
        self.update(|state| {
            state.boot();
            Ok(())
        })
        .map(|s| s.state)
    }

    /// Enable the boot unit with `reserve_w` watts (`Some`), or disable it (`None`). The
    /// caps in force do not change: the unit acts at the next boot.
    pub fn set_boot_reserve(&self, reserve_w: Option<f64>) -> Result<DriverState, DriverError> {
        if let Some(w) = reserve_w
            && !(w.is_finite() && w > 0.0)
        {
            return Err(DriverError::BadReserve(w));
        }
        self.update(|state| {
            state.boot_reserve_w = reserve_w;
            Ok(())
        })
        .map(|s| s.state)
    }

    fn create(&self, profile: &GpuProfile, boards: u32) -> Result<Snapshot, DriverError> {
        if let Some(folder) = self.path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(folder).map_err(|e| self.io("create the folder of", e))?;
        }
        let written = {
            let _lock = self.lock()?;
            // Another process may have created it while this one waited for the lock.
            match self.snapshot() {
                Err(DriverError::Missing(_)) => {
                    self.replace(DriverState::fresh(profile, boards))?
                }
                other => return other,
            }
        };
        self.sync(&written);
        Ok(written)
    }

    /// Refused when `state` describes other boards than `boards` of `profile`.
    pub fn check_fits(
        &self,
        state: &DriverState,
        profile: &GpuProfile,
        boards: u32,
    ) -> Result<(), DriverError> {
        if state.profile != profile.id {
            return Err(DriverError::Profile {
                path: self.path.clone(),
                found: state.profile.clone(),
                expected: profile.id.clone(),
            });
        }
        let expected = BoardLimits::of(profile);
        if state.limits != expected {
            let limits = |l: &BoardLimits| {
                format!(
                    "{}-{} W, default {} W",
                    l.power_cap_min_w, l.power_cap_max_w, l.power_cap_default_w
                )
            };
            return Err(DriverError::Limits {
                path: self.path.clone(),
                profile: profile.id.clone(),
                found_limits: limits(&state.limits),
                expected_limits: limits(&expected),
            });
        }
        let found = state.boards.len() as u32;
        if found != boards {
            return Err(DriverError::BoardCount {
                path: self.path.clone(),
                found,
                expected: boards,
            });
        }
        Ok(())
    }

    fn parse(&self, text: &str) -> Result<DriverState, DriverError> {
        let corrupt = |problem: String| DriverError::Corrupt {
            path: self.path.clone(),
            problem,
        };
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| corrupt(format!("not JSON, or cut short: {e}")))?;
        match value
            .get("format_version")
            .and_then(serde_json::Value::as_u64)
        {
            Some(version) if version == u64::from(DRIVER_FORMAT_VERSION) => {}
            Some(found) => {
                return Err(DriverError::Version {
                    path: self.path.clone(),
                    found,
                });
            }
            None => {
                return Err(corrupt(
                    "no format_version: not a tokwatt simulated-driver file".into(),
                ));
            }
        }
        let state: DriverState =
            serde_json::from_value(value).map_err(|e| corrupt(e.to_string()))?;
        state.check().map_err(corrupt)?;
        Ok(state)
    }

    /// Write `state` as the file's next version: to `PATH.tmp`, renamed over `PATH`.
    /// Called with the lock held, which it keeps for a small write and a rename only: a
    /// writer stopped (SIGSTOP) while it holds the lock stalls every other writer, so the
    /// syncs come after it is released ([`Self::sync`]).
    fn replace(&self, state: DriverState) -> Result<Snapshot, DriverError> {
        let mut text = serde_json::to_vec_pretty(&state).map_err(|e| DriverError::Corrupt {
            path: self.path.clone(),
            problem: format!("cannot be written: {e}"),
        })?;
        text.push(b'\n');
        let temporary = suffixed(&self.path, ".tmp");
        let mut file = File::create(&temporary).map_err(|e| self.io("write", e))?;
        file.write_all(&text).map_err(|e| self.io("write", e))?;
        std::fs::rename(&temporary, &self.path).map_err(|e| self.io("replace", e))?;
        let metadata = file.metadata().map_err(|e| self.io("read", e))?;
        Ok(Snapshot {
            state,
            pinned: file,
            inode: (metadata.dev(), metadata.ino()),
        })
    }

    /// Make a version written by [`Self::replace`] durable: its content, and the rename
    /// once the folder is synced (a host crash, not a simulated one, could otherwise bring
    /// the old version back, or an empty file). Every process reads the new version from
    /// the rename on; this only concerns the disk.
    /// A failure is logged, not returned: the change is in force for every reader already,
    /// and an error would tell the caller it was not.
    fn sync(&self, written: &Snapshot) {
        let synced = written
            .pinned
            .sync_all()
            .map_err(|e| self.io("sync", e))
            .and_then(|()| match self.path.parent() {
                Some(folder) if !folder.as_os_str().is_empty() => File::open(folder)
                    .and_then(|f| f.sync_all())
                    .map_err(|e| self.io("sync the folder of", e)),
                _ => Ok(()),
            });
        if let Err(e) = synced {
            tracing::warn!("{e}: the change is in force, but may not be on the disk yet");
        }
    }

    /// The exclusive lock around a read-modify-write, waiting at most `lock_wait`. The
    /// holder writes its process id into the lock file, for the message of a writer that
    /// waited too long.
    fn lock(&self) -> Result<File, DriverError> {
        let path = self.lock_path();
        let mut file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| self.io("open the lock of", e))?;
        let started = Instant::now();
        let mut pause = Duration::from_micros(200);
        loop {
            match file.try_lock() {
                Ok(()) => break,
                Err(std::fs::TryLockError::WouldBlock) => {}
                Err(std::fs::TryLockError::Error(e)) => return Err(self.io("lock", e)),
            }
            if started.elapsed() >= self.lock_wait {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = match holder.trim() {
                    "" => "unknown".to_owned(),
                    pid => format!("process {pid}"),
                };
                return Err(DriverError::LockTimeout {
                    path,
                    waited: started.elapsed(),
                    holder,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
        // Informational only: a failure to record the holder does not stop the write.
        let _ = file
            .set_len(0)
            .and_then(|()| file.write_all(std::process::id().to_string().as_bytes()));
        Ok(file)
    }

    fn io(&self, action: &'static str, source: std::io::Error) -> DriverError {
        DriverError::Io {
            action,
            path: self.path.clone(),
            source,
        }
    }
}

/// `path` with `suffix` appended to its file name (`driver.json` → `driver.json.lock`).
fn suffixed(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

#[cfg(test)]
mod tests;
