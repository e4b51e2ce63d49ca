//! The simulated driver: a node's GPU settings kept in a file outside the agent process.
//!
//! On a real GPU a power cap set through NVML stays in the driver when the process that set
//! it is paused, hung or killed, and a reboot puts the board defaults back. A [`SimDriver`]
//! is that driver for the simulator: per board the power cap, the SM and memory clock
//! locks and the workload's batch size, in a small versioned file that every process of a
//! simulated node shares (the agent's [`crate::SimGpu`], a fence, `tokwatt restore`, the
//! fault harness, a simulated reboot).
//!
//! A real driver holds no lock that a process could keep: each NVML setter is one ioctl,
//! done before a stop (SIGSTOP, a debugger) takes effect. So is every change here: one
//! `pwrite` of fixed-width lines in place, with nothing held before or after it. A writer
//! stopped anywhere holds nothing, and the fence that must lower the caps exactly when the
//! agent is stopped writes at once. (Version 1 serialised writers with a lock file: an
//! agent stopped while it held it kept the fence out, and the caps stayed up.)
//!
//! The file (format version 2) is one JSON document made of fixed-width lines, so a reader
//! that knows nothing of them reads it as JSON (`state["boards"][i]["power_cap_w"]`):
//!
//! - a header line of 512 bytes: the format version, the profile, the board name and
//!   count, the limits, the boots so far and the boot unit's reserve;
//! - per board, one line of 128 bytes per setting, what one NVML setter changes: the power
//!   cap, the SM clock lock, the memory clock lock, the batch;
//! - `]}`.
//!
//! Every line but the last ends its content with `"#…": "N/CRC"`: how many times the line
//! has been written, and the CRC-32 (zlib's) of the line up to and including the slash.
//!
//! - A setter writes its setting's line: one `pwrite`. Writers of different settings never
//!   lose each other's change; of the same setting the last one wins, as with a driver.
//!   (A line per setting, not per board: an agent stopped between its read and its write
//!   of a batch must not, once resumed, put back the cap a fence lowered meanwhile.) A
//!   change of several lines (several settings of a board, a reboot: the header and every
//!   line it changes) is one `pwrite` from the first to the last, and wins over a change
//!   made meanwhile to a line between them; `boot-reserve` writes the header.
//! - Linux serialises the writes to a regular file (its inode lock), so two never
//!   interleave; a read, though, runs beside a write and may see it half done. A reader
//!   checks every line and reads again while one does not match its CRC (for at most
//!   200 ms: a write lasts microseconds); a file that stays so is corrupt. No line crosses
//!   a 4 KiB page: the kernel copies a write page by page, and a setter's is one page.
//! - The generation, bumped by every write that changes something, is the sum of the
//!   lines' counts; a write that changes nothing writes nothing.
//! - The file is created complete under a temporary name and moved into place only where
//!   none is (`renameat2(RENAME_NOREPLACE)`, else `link`): two processes creating it at
//!   once agree on one.
//! - A reboot puts every board back at the board defaults and, where a boot unit is
//!   enabled (`boot_reserve_w`), fits the caps within its reserve in the same write.
//!
//! One file because it is one on-disk format and its write protocol, above: the layout, the
//! sealing of each line, the checked reads and the one-`pwrite` setters all rest on the
//! same offsets and widths, which a split would spread over files.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::profile::GpuProfile;

/// The file's layout version; a file of another version is refused, never guessed at.
pub const DRIVER_FORMAT_VERSION: u32 = 2;

/// The header line's width, bytes (its newline included).
const HEADER_LEN: usize = 512;
/// A setting's line's width, bytes: 512 + k·128 never crosses a 4 KiB page.
const SETTING_LEN: usize = 128;
/// A board's settings, in the order of their lines.
const SETTINGS: [&str; 4] = [
    "power_cap_w",
    "sm_clock_lock_mhz",
    "mem_clock_lock_mhz",
    "batch_size",
];
const BOARD_LEN: usize = SETTING_LEN * SETTINGS.len();
const TRAILER: &[u8] = b"]}\n";
/// Where a setting's `"#…"` starts: the values line up.
const CHECK_COLUMN: usize = 52;
/// The most boards a file describes (bounds what a read allocates).
const BOARDS_MAX: usize = 4096;
/// How long a read keeps reading again while a line does not match its check. A write in
/// progress lasts microseconds; a writer preempted in the middle of one, milliseconds.
const READ_PATIENCE: Duration = Duration::from_millis(200);

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

/// Everything the simulated driver holds for a node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DriverState {
    pub format_version: u32,
    /// The GPU profile's id (`h200`): the boards the file describes.
    pub profile: String,
    /// The boards' name (the profile's), for people reading the file.
    pub board_name: String,
    pub limits: BoardLimits,
    /// Bumped by every write that changes something (the sum of the file's lines' write
    /// counts; a change to it is not written): a reader that saw this generation has seen
    /// every change up to it.
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
    #[error("the simulated driver has no board {index} (it holds {count})")]
    NoSuchBoard { index: u32, count: u32 },
    #[error("a boot reserve of {0} W is not a positive number of watts")]
    BadReserve(f64),
}

/// The driver file of a simulated node. Cheap to clone; holds no file open.
#[derive(Debug, Clone)]
pub struct SimDriver {
    path: PathBuf,
}

/// A version of the file as read (or as written by this process): the state, the bytes
/// and each line's write count. A later version is told from it by its bytes
/// ([`Self::is_current`]).
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub state: DriverState,
    raw: Vec<u8>,
    /// Each line's write count: the header's, then every board's settings'.
    counts: Vec<u64>,
}

impl Snapshot {
    /// Whether `driver`'s file still holds this version: one read, no parse. An unreadable
    /// file counts as changed (the read that follows says why).
    pub fn is_current(&self, driver: &SimDriver) -> bool {
        driver.raw().is_ok_and(|raw| raw == self.raw)
    }

    /// The file's bytes as this version holds them.
    pub(crate) fn raw(&self) -> &[u8] {
        &self.raw
    }
}

impl SimDriver {
    /// The driver at `path` (nothing is read until asked).
    pub fn at(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
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

    /// What the driver holds now. Never waits for a writer: a write in progress is read
    /// again until it is done.
    pub fn read(&self) -> Result<DriverState, DriverError> {
        self.snapshot().map(|s| s.state)
    }

    /// The file's current version (see [`Snapshot`]).
    pub fn snapshot(&self) -> Result<Snapshot, DriverError> {
        let file = self.open(false)?;
        self.read_from(&file)
    }

    /// The file's bytes as they are now, unchecked: one read.
    pub(crate) fn raw(&self) -> Result<Vec<u8>, DriverError> {
        let file = self.open(false)?;
        self.raw_from(&file)
    }

    /// Change what the driver holds: read the current version, apply `change`, and write
    /// the lines it changed, in one `pwrite` and without a lock (nothing when it changed
    /// nothing). Only the boards' settings, the boots and the boot reserve can change.
    /// Returns the version in force afterwards, as far as this process knows.
    pub fn update(
        &self,
        change: impl FnOnce(&mut DriverState) -> Result<(), DriverError>,
    ) -> Result<Snapshot, DriverError> {
        let file = self.open(true)?;
        let current = self.read_from(&file)?;
        let mut next = current.state.clone();
        change(&mut next)?;
        next.generation = current.state.generation;
        if next == current.state {
            return Ok(current);
        }
        let invalid = |problem: String| DriverError::Corrupt {
            path: self.path.clone(),
            problem: format!("the change would make it invalid: {problem}"),
        };
        next.check().map_err(invalid)?;
        if layout(&next) != layout(&current.state) {
            return Err(invalid(
                "a change cannot alter the format version, the profile, the limits or the number of boards".into(),
            ));
        }
        let (offset, bytes, written) = changed_lines(&current, next).map_err(invalid)?;
        // One system call: in force for every reader once it returns, and done before a
        // stop (SIGSTOP) takes effect.
        let done = file
            .write_at(&bytes, offset as u64)
            .map_err(|e| self.io("write", e))?;
        if done != bytes.len() {
            return Err(self.io(
                "write",
                std::io::Error::other(format!("{done} of {} bytes written", bytes.len())),
            ));
        }
        // The change is in force from the write: this only concerns a crash of the host.
        if let Err(e) = file.sync_data() {
            tracing::warn!(
                "{}: the change is in force, but may not be on the disk yet",
                self.io("sync", e)
            );
        }
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
    /// its reserve. One write: no reader sees the defaults of a node whose boot unit
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

    /// The file of a node that boots the first time, written whole under a temporary
    /// name, then moved into place unless another process created one meanwhile (then
    /// that one is read).
    fn create(&self, profile: &GpuProfile, boards: u32) -> Result<Snapshot, DriverError> {
        let folder = match self.path.parent().filter(|p| !p.as_os_str().is_empty()) {
            Some(folder) => {
                std::fs::create_dir_all(folder).map_err(|e| self.io("create the folder of", e))?;
                folder
            }
            None => Path::new("."),
        };
        let state = DriverState::fresh(profile, boards);
        let raw = encode(&state).map_err(|problem| DriverError::Corrupt {
            path: self.path.clone(),
            problem: format!("cannot be written: {problem}"),
        })?;
        let mut temporary = tempfile::Builder::new()
            .prefix(".driver-")
            .suffix(".new")
            .permissions(std::fs::Permissions::from_mode(0o666))
            .tempfile_in(folder)
            .map_err(|e| self.io("create", e))?;
        temporary
            .write_all(&raw)
            .and_then(|()| temporary.as_file().sync_all())
            .map_err(|e| self.io("write", e))?;
        match temporary.persist_noclobber(&self.path) {
            Ok(_) => {}
            Err(e) if e.error.kind() == std::io::ErrorKind::AlreadyExists => {
                return self.snapshot();
            }
            Err(e) => return Err(self.io("create", e.error)),
        }
        // The name on the disk too (a crash of the host could otherwise lose it).
        if let Err(e) = File::open(folder).and_then(|f| f.sync_all()) {
            tracing::warn!("{}", self.io("sync the folder of", e));
        }
        self.decode(raw).map_err(|refusal| match refusal {
            Refusal::Final(e) => e,
            Refusal::Torn(problem) => DriverError::Corrupt {
                path: self.path.clone(),
                problem,
            },
        })
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

    fn open(&self, write: bool) -> Result<File, DriverError> {
        File::options()
            .read(true)
            .write(write)
            .open(&self.path)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => DriverError::Missing(self.path.clone()),
                _ => self.io("open", e),
            })
    }

    /// The bytes of `file`, in one `pread` (more only for a file that grows meanwhile).
    fn raw_from(&self, file: &File) -> Result<Vec<u8>, DriverError> {
        let most = HEADER_LEN + BOARDS_MAX * BOARD_LEN + TRAILER.len();
        let length = file.metadata().map_err(|e| self.io("read", e))?.len();
        let mut raw = vec![0; usize::try_from(length).unwrap_or(most).min(most) + 1];
        let mut filled = 0;
        loop {
            let read = file
                .read_at(&mut raw[filled..], filled as u64)
                .map_err(|e| self.io("read", e))?;
            filled += read;
            if read == 0 || filled == raw.len() {
                break;
            }
        }
        if filled > most {
            return Err(DriverError::Corrupt {
                path: self.path.clone(),
                problem: format!("it is larger than the {most} bytes of {BOARDS_MAX} boards"),
            });
        }
        raw.truncate(filled);
        Ok(raw)
    }

    /// The version in `file`, read again while it may be a write in progress (a line that
    /// does not match its check, JSON cut anywhere) for at most [`READ_PATIENCE`].
    fn read_from(&self, file: &File) -> Result<Snapshot, DriverError> {
        let started = Instant::now();
        let mut pause = Duration::from_micros(50);
        let mut reads = 0u32;
        loop {
            reads += 1;
            match self.decode(self.raw_from(file)?) {
                Ok(snapshot) => return Ok(snapshot),
                Err(Refusal::Final(e)) => return Err(e),
                Err(Refusal::Torn(problem)) if started.elapsed() >= READ_PATIENCE => {
                    return Err(DriverError::Corrupt {
                        path: self.path.clone(),
                        problem: format!(
                            "{problem}; the same in {reads} reads over {} ms, so no write in progress",
                            started.elapsed().as_millis()
                        ),
                    });
                }
                Err(Refusal::Torn(_)) => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(10));
                }
            }
        }
    }

    /// The version `raw` holds, every line checked.
    fn decode(&self, raw: Vec<u8>) -> Result<Snapshot, Refusal> {
        let corrupt = |problem: String| {
            Refusal::Final(DriverError::Corrupt {
                path: self.path.clone(),
                problem,
            })
        };
        let (mut state, mut counts) = match decode_header(&raw) {
            Ok((state, _)) if state.format_version != DRIVER_FORMAT_VERSION => {
                return Err(Refusal::Final(DriverError::Version {
                    path: self.path.clone(),
                    found: state.format_version.into(),
                }));
            }
            Ok(header) => header,
            // Told apart as a whole: a file of another version, or none of tokwatt's, or
            // this version's header torn or edited.
            Err(problem) => return Err(self.undecodable(&raw, problem)),
        };
        let boards = state.boards.len();
        let expected = HEADER_LEN + boards * BOARD_LEN + TRAILER.len();
        if raw.len() != expected {
            return Err(corrupt(format!(
                "it is {} bytes, where a file of {boards} boards is {expected}: edited by hand, or not written by tokwatt",
                raw.len()
            )));
        }
        for (index, board) in state.boards.iter_mut().enumerate() {
            for (setting, name) in SETTINGS.iter().enumerate() {
                let count = decode_setting(&raw, index, setting, boards, board).map_err(|r| {
                    self.refusal(r.map(|p| format!("board {index}'s {name} line {p}")))
                })?;
                counts.push(count);
            }
        }
        if !raw.ends_with(TRAILER) {
            return Err(corrupt("it does not end with ]}".into()));
        }
        state.generation = counts.iter().fold(0u64, |sum, c| sum.saturating_add(*c));
        state.check().map_err(corrupt)?;
        Ok(Snapshot { state, raw, counts })
    }

    /// Why `raw`, whose header line is not this version's (`problem`), is refused.
    fn undecodable(&self, raw: &[u8], problem: LineProblem) -> Refusal {
        let value: serde_json::Value = match serde_json::from_slice(raw) {
            Ok(value) => value,
            Err(e) => return Refusal::Torn(format!("not JSON, or cut short: {e}")),
        };
        match value
            .get("format_version")
            .and_then(serde_json::Value::as_u64)
        {
            Some(version) if version == u64::from(DRIVER_FORMAT_VERSION) => {
                self.refusal(problem.map(|p| format!("its header line {p}")))
            }
            Some(found) => Refusal::Final(DriverError::Version {
                path: self.path.clone(),
                found,
            }),
            None => Refusal::Final(DriverError::Corrupt {
                path: self.path.clone(),
                problem: "no format_version: not a tokwatt simulated-driver file".into(),
            }),
        }
    }

    fn refusal(&self, problem: LineProblem) -> Refusal {
        match problem {
            LineProblem::Torn(problem) => Refusal::Torn(problem),
            LineProblem::Wrong(problem) => Refusal::Final(DriverError::Corrupt {
                path: self.path.clone(),
                problem,
            }),
        }
    }

    fn io(&self, action: &'static str, source: std::io::Error) -> DriverError {
        DriverError::Io {
            action,
            path: self.path.clone(),
            source,
        }
    }
}

/// Why a read did not give a version.
enum Refusal {
    /// What a write in progress could show (a line that does not match its check): read
    /// again.
    Torn(String),
    /// Not a write in progress.
    Final(DriverError),
}

/// A line's problem in words: torn (maybe a write in progress) or not.
enum LineProblem {
    Torn(String),
    Wrong(String),
}

impl LineProblem {
    fn map(self, f: impl FnOnce(String) -> String) -> LineProblem {
        match self {
            Self::Torn(p) => Self::Torn(f(p)),
            Self::Wrong(p) => Self::Wrong(f(p)),
        }
    }
}

/// What no change may alter: the file's layout rests on it.
fn layout(state: &DriverState) -> (u32, &str, &str, BoardLimits, usize) {
    (
        state.format_version,
        &state.profile,
        &state.board_name,
        state.limits,
        state.boards.len(),
    )
}

/// Line `i`'s place in the file: 0 the header, then every board's settings.
fn line_span(i: usize) -> std::ops::Range<usize> {
    match i {
        0 => 0..HEADER_LEN,
        _ => {
            let start = HEADER_LEN + (i - 1) * SETTING_LEN;
            start..start + SETTING_LEN
        }
    }
}

/// The lines `next` changes from `current`, each one write on: the byte offset and the
/// bytes of the one write that covers them all, and the version it makes.
fn changed_lines(
    current: &Snapshot,
    mut next: DriverState,
) -> Result<(usize, Vec<u8>, Snapshot), String> {
    let boards = next.boards.len();
    let mut counts = current.counts.clone();
    let mut raw = current.raw.clone();
    let mut changed = Vec::new();
    if header_content(&next) != header_content(&current.state) {
        counts[0] = counts[0].saturating_add(1);
        raw[line_span(0)].copy_from_slice(header_line(&next, counts[0])?.as_bytes());
        changed.push(0);
    }
    for (index, (now, was)) in next.boards.iter().zip(&current.state.boards).enumerate() {
        for setting in 0..SETTINGS.len() {
            if setting_value(now, setting) == setting_value(was, setting) {
                continue;
            }
            let i = 1 + index * SETTINGS.len() + setting;
            counts[i] = counts[i].saturating_add(1);
            let line = setting_line(now, index, setting, boards, counts[i])?;
            raw[line_span(i)].copy_from_slice(line.as_bytes());
            changed.push(i);
        }
    }
    let (Some(&first), Some(&last)) = (changed.first(), changed.last()) else {
        return Err("it changes no line".into());
    };
    let span = line_span(first).start..line_span(last).end;
    next.generation = counts.iter().fold(0u64, |sum, c| sum.saturating_add(*c));
    let bytes = raw[span.clone()].to_vec();
    Ok((
        span.start,
        bytes,
        Snapshot {
            state: next,
            raw,
            counts,
        },
    ))
}

/// The whole file of `state`, every line written 0 times.
fn encode(state: &DriverState) -> Result<Vec<u8>, String> {
    let boards = state.boards.len();
    let mut raw = header_line(state, 0)?.into_bytes();
    for (index, board) in state.boards.iter().enumerate() {
        for setting in 0..SETTINGS.len() {
            raw.extend(setting_line(board, index, setting, boards, 0)?.into_bytes());
        }
    }
    raw.extend(TRAILER);
    Ok(raw)
}

fn json(value: &impl Serialize) -> String {
    // Numbers, strings and options of them always serialise.
    serde_json::to_string(value).unwrap_or_default()
}

/// The header's content before its check: everything but the boards' settings.
fn header_content(state: &DriverState) -> String {
    let limits = &state.limits;
    format!(
        "{{\"format_version\": {}, \"profile\": {}, \"board_name\": {}, \"board_count\": {}, \"limits\": {{\"power_cap_min_w\": {}, \"power_cap_default_w\": {}, \"power_cap_max_w\": {}}}, \"boots\": {}, \"boot_reserve_w\": {}, ",
        state.format_version,
        json(&state.profile),
        json(&state.board_name),
        state.boards.len(),
        json(&limits.power_cap_min_w),
        json(&limits.power_cap_default_w),
        json(&limits.power_cap_max_w),
        state.boots,
        json(&state.boot_reserve_w),
    )
}

fn header_line(state: &DriverState, count: u64) -> Result<String, String> {
    let text = format!("{}\"#\": \"{count}/", header_content(state));
    seal(text, ", \"boards\": [", HEADER_LEN)
}

/// Setting `setting` of a board as JSON.
fn setting_value(board: &BoardSettings, setting: usize) -> String {
    match setting {
        0 => json(&board.power_cap_w),
        1 => json(&board.sm_clock_lock_mhz),
        2 => json(&board.mem_clock_lock_mhz),
        _ => json(&board.batch_size),
    }
}

/// What comes before a setting's line's content and after its check: the JSON around it.
fn frame(index: usize, setting: usize, boards: usize) -> (&'static str, &'static str) {
    let lead = if setting == 0 { " {" } else { "  " };
    let tail = match (setting + 1 == SETTINGS.len(), index + 1 == boards) {
        (false, _) => ",",
        (true, false) => "},",
        (true, true) => "}",
    };
    (lead, tail)
}

fn setting_line(
    board: &BoardSettings,
    index: usize,
    setting: usize,
    boards: usize,
    count: u64,
) -> Result<String, String> {
    let (lead, tail) = frame(index, setting, boards);
    let name = SETTINGS[setting];
    let mut text = format!("{lead}\"{name}\": {},", setting_value(board, setting));
    let column = CHECK_COLUMN.max(text.len() + 1);
    text.push_str(&" ".repeat(column - text.len()));
    text.push_str(&format!("\"#{name}\": \"{count}/"));
    seal(text, tail, SETTING_LEN)
}

/// `text` (which ends with the slash of its `"N/CRC"`) with its CRC, `tail`, and spaces to
/// `width` bytes, the newline last.
fn seal(mut text: String, tail: &str, width: usize) -> Result<String, String> {
    let check = crc32(text.as_bytes());
    text.push_str(&format!("{check:08x}\"{tail}"));
    if text.len() >= width {
        return Err(format!(
            "a line of {} bytes, where the format has {}",
            text.len(),
            width - 1
        ));
    }
    text.push_str(&" ".repeat(width - 1 - text.len()));
    text.push('\n');
    Ok(text)
}

/// A line whose check matches: its content up to the check's closing quote, its write
/// count, and what follows (trailing spaces dropped).
struct Sealed<'a> {
    content: &'a str,
    count: u64,
    tail: &'a str,
}

/// The line at `span` of `raw`, checked. Every problem found before its check matches is
/// one a write in progress could show.
fn unseal(raw: &[u8], span: std::ops::Range<usize>) -> Result<Sealed<'_>, LineProblem> {
    let width = span.len();
    let torn = |problem: &str| LineProblem::Torn(problem.to_owned());
    let line = raw.get(span).ok_or_else(|| torn("is cut short"))?;
    let line = std::str::from_utf8(line).map_err(|_| torn("is not text"))?;
    let body = line
        .strip_suffix('\n')
        .filter(|body| !body.contains('\n'))
        .ok_or_else(|| LineProblem::Torn(format!("is not one line of {width} bytes")))?;
    let slash = body
        .rfind('/')
        .ok_or_else(|| torn("has no \"N/CRC\" check"))?;
    let check = body.get(slash + 1..slash + 9);
    let closed = body.get(slash + 9..slash + 10) == Some("\"");
    if !closed || check != Some(format!("{:08x}", crc32(&body.as_bytes()[..=slash])).as_str()) {
        return Err(torn(
            "does not match its check: torn by a write in progress, or edited by hand",
        ));
    }
    let count = body[..slash]
        .rfind('"')
        .and_then(|quote| body[quote + 1..slash].parse().ok())
        .ok_or_else(|| torn("has no write count before its check"))?;
    Ok(Sealed {
        content: &body[..slash + 10],
        count,
        tail: body[slash + 10..].trim_end(),
    })
}

/// What the header holds (the check aside).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    format_version: u32,
    profile: String,
    board_name: String,
    board_count: u32,
    limits: BoardLimits,
    boots: u64,
    boot_reserve_w: Option<f64>,
}

/// The state the header describes (its boards at their defaults, until their lines are
/// read), and the header's write count.
fn decode_header(raw: &[u8]) -> Result<(DriverState, Vec<u64>), LineProblem> {
    let sealed = unseal(raw, line_span(0))?;
    let wrong = |problem: String| LineProblem::Wrong(problem);
    if sealed.tail != ", \"boards\": [" {
        return Err(wrong(format!(
            "ends with '{}' where ', \"boards\": [' belongs",
            sealed.tail
        )));
    }
    let mut fields: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&format!("{}}}", sealed.content)).map_err(|e| wrong(e.to_string()))?;
    fields.remove("#");
    let header: Header = serde_json::from_value(serde_json::Value::Object(fields))
        .map_err(|e| wrong(e.to_string()))?;
    let boards = header.board_count as usize;
    if boards > BOARDS_MAX {
        return Err(wrong(format!(
            "describes {boards} boards, more than {BOARDS_MAX}"
        )));
    }
    let state = DriverState {
        format_version: header.format_version,
        profile: header.profile,
        board_name: header.board_name,
        limits: header.limits,
        generation: 0,
        boots: header.boots,
        boot_reserve_w: header.boot_reserve_w,
        boards: vec![BoardSettings::boot_defaults(&header.limits); boards],
    };
    Ok((state, vec![sealed.count]))
}

/// Setting `setting` of board `index` into `board`; the line's write count.
fn decode_setting(
    raw: &[u8],
    index: usize,
    setting: usize,
    boards: usize,
    board: &mut BoardSettings,
) -> Result<u64, LineProblem> {
    let sealed = unseal(raw, line_span(1 + index * SETTINGS.len() + setting))?;
    let wrong = |problem: String| LineProblem::Wrong(problem);
    let (lead, tail) = frame(index, setting, boards);
    let content = sealed
        .content
        .strip_prefix(lead)
        .filter(|_| sealed.tail == tail)
        .ok_or_else(|| wrong(format!("does not sit between '{lead}' and '{tail}'")))?;
    let name = SETTINGS[setting];
    // `"NAME": VALUE,` then spaces, then `"#NAME": "N/CRC"`.
    let value = content
        .strip_prefix(&format!("\"{name}\": "))
        .zip(content.rfind(&format!("\"#{name}\": \"")))
        .and_then(|(rest, check)| content.get(content.len() - rest.len()..check))
        .and_then(|value| value.trim_end().strip_suffix(','))
        .ok_or_else(|| {
            wrong(format!(
                "is not '\"{name}\": VALUE, \"#{name}\": \"N/CRC\"'"
            ))
        })?;
    let unexpected = |e: serde_json::Error| wrong(format!("holds {name} = {value}: {e}"));
    match setting {
        0 => board.power_cap_w = serde_json::from_str(value).map_err(unexpected)?,
        1 => board.sm_clock_lock_mhz = serde_json::from_str(value).map_err(unexpected)?,
        2 => board.mem_clock_lock_mhz = serde_json::from_str(value).map_err(unexpected)?,
        _ => board.batch_size = serde_json::from_str(value).map_err(unexpected)?,
    }
    Ok(sealed.count)
}

/// The CRC-32 of zlib (and of Python's `zlib.crc32`), which the fault harness checks too.
fn crc32(bytes: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 == 1 {
                    0xEDB8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
                k += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    !bytes.iter().fold(!0u32, |c, &b| {
        TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8)
    })
}

#[cfg(test)]
mod tests;
