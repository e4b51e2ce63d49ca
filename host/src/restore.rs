//! Save and restore: every GPU setting tokwatt changes is put back when it stops, and after
//! a crash by the next start or `tokwatt restore`.
//!
//! Before the first change, the original settings of every managed GPU are written to a
//! state file (atomically: a temporary file in the same folder, fsync, rename, fsync of
//! the folder), keyed by GPU UUID so a renumbering cannot misapply them. A clean stop
//! restores them and deletes the file; a file left behind means a run did not stop
//! cleanly, and its settings are restored before anything else is changed.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::actuator::{Actuator, ActuatorError, Capabilities, GpuSettings};
use crate::nvml::privileges::Privileges;
use crate::types::DeviceInfo;

/// Version of the state file's layout; a file with another version is refused.
const FORMAT: u32 = 1;

/// Power limits closer than this are the same (NVML works in milliwatts).
const POWER_TOLERANCE_W: f64 = 0.5;

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("cannot read the state file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "cannot write the state file {path}: {source}. tokwatt changes no GPU setting before the originals are saved; make the folder writable or choose another state file"
    )]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "the state file {path} is corrupt ({reason}). It holds the original GPU settings to put back after a crash. Check each GPU's power limit and clock locks (`nvidia-smi -q -d POWER,CLOCK`), reset them if needed (`nvidia-smi -pl <default W>`, `nvidia-smi -rgc`, `nvidia-smi -rmc`), then delete the file"
    )]
    Corrupt { path: PathBuf, reason: String },
    #[error(
        "the state file {path} was written by a newer tokwatt (format {found}; this one reads format {FORMAT}): restore with that version"
    )]
    UnsupportedFormat { path: PathBuf, found: u32 },
    #[error(
        "tokwatt (pid {pid}) is still running and owns {path}: it restores its settings when it stops. Stop it first"
    )]
    OwnerRunning { path: PathBuf, pid: u32 },
    #[error("reading the original settings of GPU {gpu} failed, so nothing was changed: {source}")]
    ReadOriginal {
        gpu: u32,
        #[source]
        source: ActuatorError,
    },
    #[error(
        "an earlier run left GPU settings that could not all be restored, so nothing will be changed:\n{report}Fix the cause and run `tokwatt restore`"
    )]
    LeftoverNotRestored { report: RestoreReport },
}

/// The original settings of one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SavedGpu {
    pub uuid: String,
    /// Position when saved (for messages; GPUs are matched by UUID).
    pub index: u32,
    pub original: GpuSettings,
}

/// What the state file holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct StateDocument {
    format: u32,
    /// The process that saved it: a file whose owner still runs is not restored under it.
    pid: u32,
    written_by: String,
    gpus: Vec<SavedGpu>,
}

/// The file that holds the original settings while tokwatt has changed them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateFile {
    path: PathBuf,
}

impl StateFile {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// `/var/lib/tokwatt/state.json` for root; otherwise `$XDG_STATE_HOME/tokwatt/state.json`
    /// (`~/.local/state/tokwatt/state.json` when unset).
    pub fn default_path() -> PathBuf {
        default_path_for(
            Privileges::current().is_root(),
            std::env::var_os("XDG_STATE_HOME").map(PathBuf::from),
            std::env::var_os("HOME").map(PathBuf::from),
        )
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The saved settings, or `None` when there is no file (nothing to restore).
    pub fn load(&self) -> Result<Option<Vec<SavedGpu>>, RestoreError> {
        Ok(self.load_document()?.map(|document| document.gpus))
    }

    fn load_document(&self) -> Result<Option<StateDocument>, RestoreError> {
        let text = match fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(RestoreError::Read {
                    path: self.path.clone(),
                    source,
                });
            }
        };
        let corrupt = |reason: String| RestoreError::Corrupt {
            path: self.path.clone(),
            reason,
        };
        // The format first, so a newer layout is reported as such, not as corruption.
        let format = serde_json::from_str::<serde_json::Value>(&text)
            .map_err(|e| corrupt(e.to_string()))?
            .get("format")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| corrupt("no \"format\" number".into()))?;
        if format != u64::from(FORMAT) {
            return Err(RestoreError::UnsupportedFormat {
                path: self.path.clone(),
                found: u32::try_from(format).unwrap_or(u32::MAX),
            });
        }
        let document: StateDocument =
            serde_json::from_str(&text).map_err(|e| corrupt(e.to_string()))?;
        if let Some(bad) = document
            .gpus
            .iter()
            .find(|gpu| !gpu.original.power_cap_w.is_finite() || gpu.original.power_cap_w <= 0.0)
        {
            return Err(corrupt(format!(
                "GPU {} has power cap {} W",
                bad.uuid, bad.original.power_cap_w
            )));
        }
        Ok(Some(document))
    }

    /// Write `gpus` as the saved settings, atomically: readers see the old file or the new
    /// one, never a part.
    pub fn save(&self, gpus: &[SavedGpu]) -> Result<(), RestoreError> {
        let document = StateDocument {
            format: FORMAT,
            pid: std::process::id(),
            written_by: concat!("tokwatt ", env!("CARGO_PKG_VERSION")).to_owned(),
            gpus: gpus.to_vec(),
        };
        let write_error = |source| RestoreError::Write {
            path: self.path.clone(),
            source,
        };
        let mut bytes =
            serde_json::to_vec_pretty(&document).map_err(|e| write_error(io::Error::other(e)))?;
        bytes.push(b'\n');
        write_atomically(&self.path, &bytes).map_err(write_error)
    }

    /// Delete the file (nothing left to restore). No file is fine.
    pub fn clear(&self) -> Result<(), RestoreError> {
        match fs::remove_file(&self.path) {
            Ok(()) => sync_parent(&self.path).map_err(|source| RestoreError::Write {
                path: self.path.clone(),
                source,
            }),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(RestoreError::Write {
                path: self.path.clone(),
                source,
            }),
        }
    }
}

fn default_path_for(
    is_root: bool,
    xdg_state_home: Option<PathBuf>,
    home: Option<PathBuf>,
) -> PathBuf {
    const FILE: &str = "tokwatt/state.json";
    if is_root {
        return Path::new("/var/lib").join(FILE);
    }
    // The XDG spec says relative values are invalid and must be ignored.
    if let Some(state) = xdg_state_home.filter(|p| p.is_absolute()) {
        return state.join(FILE);
    }
    match home {
        Some(home) => home.join(".local/state").join(FILE),
        None => std::env::temp_dir().join(FILE),
    }
}

fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

/// Temporary file in the same folder, fsync, rename over `path`, fsync the folder.
fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let folder = parent_of(path);
    fs::create_dir_all(folder)?;
    let file_name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path names no file"))?;
    let mut temporary_name = std::ffi::OsString::from(".");
    temporary_name.push(file_name);
    temporary_name.push(format!(".tmp.{}", std::process::id()));
    let temporary = folder.join(temporary_name);

    let written = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&temporary)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        fs::rename(&temporary, path)
    })();
    if let Err(error) = written {
        // Leave nothing half-written behind; the original file, if any, is untouched.
        let _ = fs::remove_file(&temporary);
        return Err(error);
    }
    sync_parent(path)
}

/// Make a rename or delete in `path`'s folder durable.
fn sync_parent(path: &Path) -> io::Result<()> {
    File::open(parent_of(path))?.sync_all()
}

/// Whether `pid` is another live tokwatt (so its state file must not be restored under it).
fn owned_by_other_live_process(pid: u32) -> bool {
    owner_alive_in(Path::new("/proc"), pid, std::process::id())
}

/// [`owned_by_other_live_process`] against the process table under `proc_root`: `pid`
/// counts when it is not ours, has not exited (zombies have) and runs the same command.
fn owner_alive_in(proc_root: &Path, pid: u32, own_pid: u32) -> bool {
    if pid == own_pid {
        return false;
    }
    let process = proc_root.join(pid.to_string());
    let Ok(theirs) = fs::read_to_string(process.join("comm")) else {
        return false;
    };
    // "pid (comm) state ...": the state follows the last parenthesis.
    let zombie = fs::read_to_string(process.join("stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false);
    let ours = fs::read_to_string(proc_root.join(own_pid.to_string()).join("comm"));
    !zombie && ours.is_ok_and(|ours| ours == theirs)
}

/// Which setting a restore step put back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Setting {
    PowerCap,
    SmClockLock,
    MemClockLock,
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::PowerCap => "power cap",
            Self::SmClockLock => "SM clock lock",
            Self::MemClockLock => "memory clock lock",
        })
    }
}

/// How one setting's restore went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "outcome", content = "detail")]
pub enum Outcome {
    Restored,
    /// The setting already had its original value.
    AlreadyInPlace,
    /// The GPU cannot have the setting, so there is nothing to undo.
    NothingToUndo(String),
    Failed(String),
}

/// One setting of one GPU, put back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RestoreStep {
    pub setting: Setting,
    /// The original value, in words ("700 W", "no lock").
    pub original: String,
    pub outcome: Outcome,
}

/// What was done for one saved GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuRestore {
    pub uuid: String,
    /// Position when the settings were saved.
    pub saved_index: u32,
    /// Whether the GPU was found among the actuator's devices.
    pub found: bool,
    pub steps: Vec<RestoreStep>,
}

impl GpuRestore {
    pub fn is_complete(&self) -> bool {
        self.found
            && self
                .steps
                .iter()
                .all(|step| !matches!(step.outcome, Outcome::Failed(_)))
    }
}

/// What a restore did, GPU by GPU.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct RestoreReport {
    pub gpus: Vec<GpuRestore>,
    /// Whether the state file was deleted (everything restored).
    pub state_cleared: bool,
}

impl RestoreReport {
    /// Whether every saved setting is back.
    pub fn is_complete(&self) -> bool {
        self.gpus.iter().all(GpuRestore::is_complete)
    }
}

impl fmt::Display for RestoreReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.gpus.is_empty() {
            return writeln!(f, "nothing to restore");
        }
        for gpu in &self.gpus {
            if !gpu.found {
                writeln!(
                    f,
                    "GPU {} (was {}): not found, its settings were not restored",
                    gpu.uuid, gpu.saved_index
                )?;
                continue;
            }
            writeln!(f, "GPU {} (was {}):", gpu.uuid, gpu.saved_index)?;
            for step in &gpu.steps {
                let outcome = match &step.outcome {
                    Outcome::Restored => "restored".to_owned(),
                    Outcome::AlreadyInPlace => "already in place".to_owned(),
                    Outcome::NothingToUndo(why) => format!("nothing to undo ({why})"),
                    Outcome::Failed(why) => format!("FAILED: {why}"),
                };
                writeln!(f, "  {} -> {}: {outcome}", step.setting, step.original)?;
            }
        }
        Ok(())
    }
}

fn describe_lock(lock: Option<(u32, u32)>) -> String {
    match lock {
        Some((lo, hi)) => format!("{lo}-{hi} MHz"),
        None => "no lock".to_owned(),
    }
}

/// Put one GPU's saved settings back through `actuator` (GPU `gpu` there).
fn restore_gpu(actuator: &mut dyn Actuator, gpu: u32, saved: &SavedGpu) -> Vec<RestoreStep> {
    let original = saved.original;
    let outcome_of = |result: Result<(), ActuatorError>, undoing_a_lock: bool| match result {
        Ok(()) => Outcome::Restored,
        // A GPU that cannot lock clocks has no lock to release.
        Err(ActuatorError::NotSupported { reason, .. }) if undoing_a_lock => {
            Outcome::NothingToUndo(reason)
        }
        Err(error) => Outcome::Failed(error.to_string()),
    };

    let power = match actuator.read(gpu) {
        Ok(now) if (now.power_cap_w - original.power_cap_w).abs() < POWER_TOLERANCE_W => {
            Outcome::AlreadyInPlace
        }
        _ => outcome_of(
            actuator
                .set_power_cap(gpu, original.power_cap_w)
                .map(|_enforced| ()),
            false,
        ),
    };
    // NVML cannot report clock locks, so they are always put back (a reset when there
    // was none).
    let sm = outcome_of(
        actuator.set_sm_clock_lock(gpu, original.sm_clock_lock_mhz),
        original.sm_clock_lock_mhz.is_none(),
    );
    let mem = outcome_of(
        actuator.set_mem_clock_lock(gpu, original.mem_clock_lock_mhz),
        original.mem_clock_lock_mhz.is_none(),
    );
    vec![
        RestoreStep {
            setting: Setting::PowerCap,
            original: format!("{:.0} W", original.power_cap_w),
            outcome: power,
        },
        RestoreStep {
            setting: Setting::SmClockLock,
            original: describe_lock(original.sm_clock_lock_mhz),
            outcome: sm,
        },
        RestoreStep {
            setting: Setting::MemClockLock,
            original: describe_lock(original.mem_clock_lock_mhz),
            outcome: mem,
        },
    ]
}

/// Put back every saved setting, matching GPUs by UUID.
fn apply(saved: &[SavedGpu], actuator: &mut dyn Actuator) -> RestoreReport {
    let devices = actuator.devices();
    let gpus = saved
        .iter()
        .map(|saved_gpu| {
            let position = devices.iter().position(|d| d.uuid == saved_gpu.uuid);
            let steps = match position {
                Some(position) => restore_gpu(actuator, position as u32, saved_gpu),
                None => Vec::new(),
            };
            let restore = GpuRestore {
                uuid: saved_gpu.uuid.clone(),
                saved_index: saved_gpu.index,
                found: position.is_some(),
                steps,
            };
            if restore.is_complete() {
                tracing::info!(uuid = %restore.uuid, "original GPU settings restored");
            } else {
                tracing::error!(uuid = %restore.uuid, "original GPU settings not fully restored: {restore:?}");
            }
            restore
        })
        .collect();
    RestoreReport {
        gpus,
        state_cleared: false,
    }
}

/// Write back what is still to restore: delete the file when everything is back, otherwise
/// keep only the GPUs that are not.
fn settle(
    state: &StateFile,
    saved: &[SavedGpu],
    report: &mut RestoreReport,
) -> Result<(), RestoreError> {
    if report.is_complete() {
        state.clear()?;
        report.state_cleared = true;
    } else {
        let remaining: Vec<SavedGpu> = saved
            .iter()
            .zip(&report.gpus)
            .filter(|(_, restore)| !restore.is_complete())
            .map(|(saved_gpu, _)| saved_gpu.clone())
            .collect();
        state.save(&remaining)?;
    }
    Ok(())
}

/// Put back every setting saved in `state` through `actuator` (matching GPUs by UUID via
/// `actuator.devices()`). Deletes the file only when everything was restored; otherwise
/// it keeps the GPUs still to do, so `tokwatt restore` can try again.
pub fn restore_all(
    state: &StateFile,
    actuator: &mut dyn Actuator,
) -> Result<RestoreReport, RestoreError> {
    let Some(document) = state.load_document()? else {
        return Ok(RestoreReport::default());
    };
    if owned_by_other_live_process(document.pid) {
        return Err(RestoreError::OwnerRunning {
            path: state.path.clone(),
            pid: document.pid,
        });
    }
    let mut report = apply(&document.gpus, actuator);
    settle(state, &document.gpus, &mut report)?;
    Ok(report)
}

/// The original settings of a run: saved to the state file before the first change,
/// put back by [`OriginalSettings::restore`].
///
/// It does not hold the actuator, so a control loop that owns its actuator can call
/// [`OriginalSettings::save_before_change`] before each change (it saves once). For
/// restore-on-drop, wrap the actuator in a [`SettingsGuard`] instead.
#[derive(Debug)]
pub struct OriginalSettings {
    state: StateFile,
    /// The originals, once saved.
    saved: Option<Vec<SavedGpu>>,
}

impl OriginalSettings {
    /// Touches neither the GPUs nor the state file.
    pub fn new(state: StateFile) -> Self {
        Self { state, saved: None }
    }

    pub fn state_file(&self) -> &StateFile {
        &self.state
    }

    /// Save the settings of every GPU of `actuator` before the first change (later calls
    /// do nothing). Restores first what an earlier run left in the state file, and refuses
    /// while the tokwatt that wrote it still runs. On error, change nothing.
    pub fn save_before_change(&mut self, actuator: &mut dyn Actuator) -> Result<(), RestoreError> {
        if self.saved.is_some() {
            return Ok(());
        }
        if let Some(leftover) = self.state.load_document()? {
            if owned_by_other_live_process(leftover.pid) {
                return Err(RestoreError::OwnerRunning {
                    path: self.state.path.clone(),
                    pid: leftover.pid,
                });
            }
            tracing::warn!(
                path = %self.state.path.display(),
                pid = leftover.pid,
                "an earlier run did not stop cleanly: restoring the GPU settings it saved"
            );
            let mut report = apply(&leftover.gpus, actuator);
            settle(&self.state, &leftover.gpus, &mut report)?;
            if !report.is_complete() {
                return Err(RestoreError::LeftoverNotRestored { report });
            }
        }
        let saved = actuator
            .devices()
            .iter()
            .enumerate()
            .map(|(position, device)| {
                let gpu = position as u32;
                actuator
                    .read(gpu)
                    .map(|original| SavedGpu {
                        uuid: device.uuid.clone(),
                        index: gpu,
                        original,
                    })
                    .map_err(|source| RestoreError::ReadOriginal { gpu, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.state.save(&saved)?;
        tracing::info!(path = %self.state.path.display(), "original GPU settings saved");
        self.saved = Some(saved);
        Ok(())
    }

    /// Whether originals are saved and not yet all restored.
    pub fn is_saved(&self) -> bool {
        self.saved.is_some()
    }

    /// Put the original settings back through `actuator` and delete the state file. Does
    /// nothing when nothing was saved or everything is already back; after a partial
    /// failure, a later call (or `tokwatt restore`) tries the rest again.
    pub fn restore(&mut self, actuator: &mut dyn Actuator) -> Result<RestoreReport, RestoreError> {
        let Some(saved) = self.saved.take() else {
            return Ok(RestoreReport::default());
        };
        let mut report = apply(&saved, actuator);
        let settled = settle(&self.state, &saved, &mut report);
        if !report.is_complete() {
            self.saved = Some(
                saved
                    .into_iter()
                    .zip(&report.gpus)
                    .filter(|(_, restore)| !restore.is_complete())
                    .map(|(saved_gpu, _)| saved_gpu)
                    .collect(),
            );
        }
        settled.map(|()| report)
    }
}

/// An actuator that saves the original settings before its first change and puts them
/// back when restored or dropped.
///
/// Wrap the run's actuator in it and change settings only through it: the first setter
/// call saves the originals (see [`OriginalSettings::save_before_change`]), then changes.
/// If saving fails, nothing is changed.
pub struct SettingsGuard {
    originals: OriginalSettings,
    actuator: Box<dyn Actuator>,
}

impl fmt::Debug for SettingsGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SettingsGuard")
            .field("originals", &self.originals)
            .field("actuator", &self.actuator.name())
            .finish()
    }
}

impl SettingsGuard {
    /// Wrap `actuator`. Touches neither the GPUs nor the state file.
    pub fn new(state: StateFile, actuator: Box<dyn Actuator>) -> Self {
        Self {
            originals: OriginalSettings::new(state),
            actuator,
        }
    }

    /// Save the original settings now rather than at the first change.
    pub fn arm(&mut self) -> Result<(), RestoreError> {
        self.originals.save_before_change(self.actuator.as_mut())
    }

    /// Whether the originals have been saved (and not yet restored).
    pub fn is_armed(&self) -> bool {
        self.originals.is_saved()
    }

    /// Put the original settings back (idempotent; see [`OriginalSettings::restore`]).
    pub fn restore(&mut self) -> Result<RestoreReport, RestoreError> {
        self.originals.restore(self.actuator.as_mut())
    }

    /// The wrapped actuator.
    pub fn actuator(&self) -> &dyn Actuator {
        self.actuator.as_ref()
    }

    fn arm_for(&mut self, gpu: u32, what: &'static str) -> Result<(), ActuatorError> {
        self.arm().map_err(|error| ActuatorError::Failed {
            gpu,
            what,
            reason: format!(
                "the original settings could not be saved, so nothing was changed: {error}"
            ),
        })
    }
}

impl Actuator for SettingsGuard {
    fn name(&self) -> &'static str {
        self.actuator.name()
    }
    fn applies_settings(&self) -> bool {
        self.actuator.applies_settings()
    }
    fn devices(&self) -> Vec<DeviceInfo> {
        self.actuator.devices()
    }
    fn capabilities(&self, gpu: u32) -> Capabilities {
        self.actuator.capabilities(gpu)
    }
    fn read(&mut self, gpu: u32) -> Result<GpuSettings, ActuatorError> {
        self.actuator.read(gpu)
    }
    fn set_power_cap(&mut self, gpu: u32, watts: f64) -> Result<f64, ActuatorError> {
        self.arm_for(gpu, "the power cap")?;
        self.actuator.set_power_cap(gpu, watts)
    }
    fn set_sm_clock_lock(
        &mut self,
        gpu: u32,
        range_mhz: Option<(u32, u32)>,
    ) -> Result<(), ActuatorError> {
        self.arm_for(gpu, "the SM clock lock")?;
        self.actuator.set_sm_clock_lock(gpu, range_mhz)
    }
    fn set_mem_clock_lock(
        &mut self,
        gpu: u32,
        range_mhz: Option<(u32, u32)>,
    ) -> Result<(), ActuatorError> {
        self.arm_for(gpu, "the memory clock lock")?;
        self.actuator.set_mem_clock_lock(gpu, range_mhz)
    }
}

impl Drop for SettingsGuard {
    fn drop(&mut self) {
        if !self.is_armed() {
            return;
        }
        match self.restore() {
            Ok(report) if report.is_complete() => {}
            Ok(report) => tracing::error!(
                path = %self.originals.state.path.display(),
                "GPU settings not fully restored; run `tokwatt restore`:\n{report}"
            ),
            Err(error) => tracing::error!("restoring GPU settings failed: {error}"),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;
    use crate::actuator::DryRun;
    use std::sync::{Arc, Mutex};

    fn device(index: u32, uuid: &str) -> DeviceInfo {
        DeviceInfo {
            index,
            uuid: uuid.into(),
            name: "fake".into(),
            simulated: true,
            power_cap_min_w: 200.0,
            power_cap_max_w: 700.0,
            power_cap_default_w: 700.0,
            sm_clocks_mhz: vec![1980, 1500, 345],
            mem_clocks_mhz: vec![3201, 2201],
        }
    }

    fn stock() -> GpuSettings {
        GpuSettings {
            power_cap_w: 700.0,
            power_cap_enforced_w: 700.0,
            sm_clock_lock_mhz: None,
            mem_clock_lock_mhz: None,
        }
    }

    /// GPUs whose settings outlive any one actuator instance (like real hardware), so a
    /// "new process" can see what a crashed one left.
    #[derive(Debug, Clone)]
    struct Hardware(Arc<Mutex<Vec<GpuSettings>>>);

    impl Hardware {
        fn new(gpus: usize) -> Self {
            Self(Arc::new(Mutex::new(vec![stock(); gpus])))
        }
        fn get(&self, gpu: usize) -> GpuSettings {
            self.0.lock().unwrap()[gpu]
        }
    }

    /// An actuator over [`Hardware`], with knobs to make it fail.
    #[derive(Debug)]
    struct FakeActuator {
        hardware: Hardware,
        devices: Vec<DeviceInfo>,
        deny_power: bool,
        no_mem_locks: bool,
        changes: Arc<Mutex<Vec<String>>>,
    }

    impl FakeActuator {
        fn new(hardware: &Hardware, uuids: &[&str]) -> Self {
            Self {
                hardware: hardware.clone(),
                devices: uuids
                    .iter()
                    .enumerate()
                    .map(|(i, uuid)| device(i as u32, uuid))
                    .collect(),
                deny_power: false,
                no_mem_locks: false,
                changes: Arc::default(),
            }
        }
        fn with<T>(
            &self,
            gpu: u32,
            f: impl FnOnce(&mut GpuSettings) -> T,
        ) -> Result<T, ActuatorError> {
            let mut gpus = self.hardware.0.lock().unwrap();
            let count = gpus.len() as u32;
            gpus.get_mut(gpu as usize)
                .map(f)
                .ok_or(ActuatorError::NoSuchGpu { index: gpu, count })
        }
    }

    impl Actuator for FakeActuator {
        fn name(&self) -> &'static str {
            "fake"
        }
        fn devices(&self) -> Vec<DeviceInfo> {
            self.devices.clone()
        }
        fn capabilities(&self, _gpu: u32) -> Capabilities {
            Capabilities {
                power_cap: !self.deny_power,
                sm_clock: true,
                mem_clock: !self.no_mem_locks,
            }
        }
        fn read(&mut self, gpu: u32) -> Result<GpuSettings, ActuatorError> {
            self.with(gpu, |s| *s)
        }
        fn set_power_cap(&mut self, gpu: u32, watts: f64) -> Result<f64, ActuatorError> {
            if self.deny_power {
                return Err(ActuatorError::NotPermitted {
                    gpu,
                    what: "the power cap",
                    reason: "test".into(),
                });
            }
            self.changes
                .lock()
                .unwrap()
                .push(format!("{gpu} power {watts}"));
            self.with(gpu, |s| {
                s.power_cap_w = watts;
                s.power_cap_enforced_w = watts;
                watts
            })
        }
        fn set_sm_clock_lock(
            &mut self,
            gpu: u32,
            range: Option<(u32, u32)>,
        ) -> Result<(), ActuatorError> {
            self.changes
                .lock()
                .unwrap()
                .push(format!("{gpu} sm {range:?}"));
            self.with(gpu, |s| s.sm_clock_lock_mhz = range)
        }
        fn set_mem_clock_lock(
            &mut self,
            gpu: u32,
            range: Option<(u32, u32)>,
        ) -> Result<(), ActuatorError> {
            if self.no_mem_locks {
                return Err(ActuatorError::NotSupported {
                    gpu,
                    what: "the memory clock lock",
                    reason: "not on this GPU".into(),
                });
            }
            self.changes
                .lock()
                .unwrap()
                .push(format!("{gpu} mem {range:?}"));
            self.with(gpu, |s| s.mem_clock_lock_mhz = range)
        }
    }

    fn state_in(dir: &tempfile::TempDir) -> StateFile {
        StateFile::new(dir.path().join("state.json"))
    }

    fn files_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn saved(uuid: &str, index: u32, original: GpuSettings) -> SavedGpu {
        SavedGpu {
            uuid: uuid.into(),
            index,
            original,
        }
    }

    #[test]
    fn save_load_clear_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateFile::new(dir.path().join("deeper/tokwatt/state.json"));
        assert_eq!(state.load().unwrap(), None);
        let gpus = vec![
            saved("GPU-a", 0, stock()),
            saved(
                "GPU-b",
                1,
                GpuSettings {
                    power_cap_w: 450.0,
                    power_cap_enforced_w: 400.0,
                    sm_clock_lock_mhz: Some((1200, 1500)),
                    mem_clock_lock_mhz: None,
                },
            ),
        ];
        state.save(&gpus).unwrap();
        assert_eq!(state.load().unwrap(), Some(gpus));
        state.clear().unwrap();
        assert_eq!(state.load().unwrap(), None);
        state.clear().unwrap();
    }

    #[test]
    fn atomic_save_replaces_whole_files_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_in(&dir);
        state.save(&[saved("GPU-a", 0, stock())]).unwrap();
        let second = vec![saved("GPU-b", 0, stock()), saved("GPU-c", 1, stock())];
        state.save(&second).unwrap();
        assert_eq!(state.load().unwrap(), Some(second));
        assert_eq!(files_in(dir.path()), vec!["state.json"]);
    }

    #[test]
    fn a_failed_save_keeps_the_old_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        // The rename fails: the target is a non-empty folder.
        let blocked = dir.path().join("state.json");
        fs::create_dir(&blocked).unwrap();
        fs::write(blocked.join("keep"), "x").unwrap();
        let state = StateFile::new(&blocked);
        let error = state.save(&[saved("GPU-a", 0, stock())]).unwrap_err();
        assert!(matches!(error, RestoreError::Write { .. }), "{error}");
        assert!(error.to_string().contains("state.json"), "{error}");
        assert_eq!(files_in(dir.path()), vec!["state.json"]);
        assert_eq!(files_in(&blocked), vec!["keep"]);
    }

    #[test]
    fn a_temporary_left_by_a_crash_mid_write_is_ignored_and_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_in(&dir);
        state.save(&[saved("GPU-a", 0, stock())]).unwrap();
        // A crash between write and rename leaves a partial temporary behind.
        let partial = dir
            .path()
            .join(format!(".state.json.tmp.{}", std::process::id()));
        fs::write(&partial, "{\"format\": 1, \"gpus\": [").unwrap();
        assert_eq!(state.load().unwrap().map(|g| g.len()), Some(1));
        state.save(&[saved("GPU-b", 0, stock())]).unwrap();
        assert_eq!(files_in(dir.path()), vec!["state.json"]);
    }

    #[test]
    fn a_corrupt_file_is_an_error_naming_the_path_and_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_in(&dir);
        for bad in [
            "{\"format\": 1, \"gpus\": [",
            "",
            "[]",
            "{\"format\": 1, \"pid\": 1, \"written_by\": \"x\", \"gpus\": [{\"uuid\": \"GPU-a\"}]}",
        ] {
            fs::write(state.path(), bad).unwrap();
            let error = state.load().unwrap_err();
            assert!(
                matches!(error, RestoreError::Corrupt { .. }),
                "{bad:?}: {error}"
            );
            let message = error.to_string();
            assert!(
                message.contains(&state.path().display().to_string()),
                "{message}"
            );
            assert!(message.contains("nvidia-smi -rgc"), "{message}");
            assert!(message.contains("delete the file"), "{message}");
        }
        fs::write(
            state.path(),
            "{\"format\": 1, \"pid\": 1, \"written_by\": \"x\", \"gpus\": [{\"uuid\": \"GPU-a\", \"index\": 0, \"original\": {\"power_cap_w\": -5.0, \"power_cap_enforced_w\": 1.0, \"sm_clock_lock_mhz\": null, \"mem_clock_lock_mhz\": null}}]}",
        )
        .unwrap();
        assert!(matches!(state.load(), Err(RestoreError::Corrupt { .. })));
    }

    #[test]
    fn a_newer_format_is_refused_as_such() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_in(&dir);
        fs::write(state.path(), "{\"format\": 2, \"anything\": true}").unwrap();
        let error = state.load().unwrap_err();
        assert!(
            matches!(error, RestoreError::UnsupportedFormat { found: 2, .. }),
            "{error}"
        );
    }

    #[test]
    fn guard_saves_before_the_first_change_and_restores_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(2);
        let actuator = FakeActuator::new(&hardware, &["GPU-a", "GPU-b"]);
        let mut guard = SettingsGuard::new(state_in(&dir), Box::new(actuator));
        // Reading is not a change: nothing saved yet.
        guard.read(0).unwrap();
        assert!(!guard.is_armed());
        assert_eq!(state_in(&dir).load().unwrap(), None);

        assert_eq!(guard.set_power_cap(0, 450.0).unwrap(), 450.0);
        guard.set_sm_clock_lock(1, Some((1200, 1500))).unwrap();
        guard.set_mem_clock_lock(1, Some((2201, 2201))).unwrap();
        assert!(guard.is_armed());
        // The file holds the settings from before the first change.
        let on_disk = state_in(&dir).load().unwrap().unwrap();
        assert_eq!(
            on_disk,
            vec![saved("GPU-a", 0, stock()), saved("GPU-b", 1, stock())]
        );
        assert_eq!(hardware.get(0).power_cap_w, 450.0);

        drop(guard);
        assert_eq!(hardware.get(0), stock());
        assert_eq!(hardware.get(1), stock());
        assert_eq!(state_in(&dir).load().unwrap(), None);
    }

    #[test]
    fn original_settings_work_beside_an_actuator_the_loop_owns() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(1);
        let mut actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        let mut originals = OriginalSettings::new(state_in(&dir));
        assert!(!originals.is_saved());

        originals.save_before_change(&mut actuator).unwrap();
        actuator.set_power_cap(0, 300.0).unwrap();
        // Before the next change: already saved, so the lowered cap is not taken as original.
        originals.save_before_change(&mut actuator).unwrap();
        actuator.set_sm_clock_lock(0, Some((1500, 1500))).unwrap();
        assert_eq!(
            originals.state_file().load().unwrap(),
            Some(vec![saved("GPU-a", 0, stock())])
        );

        let report = originals.restore(&mut actuator).unwrap();
        assert!(report.is_complete() && report.state_cleared, "{report}");
        assert_eq!(hardware.get(0), stock());
        assert!(!originals.is_saved());
    }

    #[test]
    fn explicit_restore_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(1);
        let actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        let changes = Arc::clone(&actuator.changes);
        let mut guard = SettingsGuard::new(state_in(&dir), Box::new(actuator));
        guard.set_power_cap(0, 300.0).unwrap();
        guard.set_power_cap(0, 350.0).unwrap();

        let report = guard.restore().unwrap();
        assert!(report.is_complete() && report.state_cleared, "{report}");
        assert_eq!(hardware.get(0), stock());
        let after_first = changes.lock().unwrap().len();
        let again = guard.restore().unwrap();
        assert!(again.gpus.is_empty());
        drop(guard);
        assert_eq!(changes.lock().unwrap().len(), after_first, "restored twice");
    }

    #[test]
    fn guard_that_changed_nothing_writes_and_restores_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(1);
        let actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        let changes = Arc::clone(&actuator.changes);
        drop(SettingsGuard::new(state_in(&dir), Box::new(actuator)));
        assert!(changes.lock().unwrap().is_empty());
        assert_eq!(files_in(dir.path()), Vec::<String>::new());
    }

    #[test]
    fn a_crashed_run_is_restored_by_the_next_process() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(2);
        let mut crashed = SettingsGuard::new(
            state_in(&dir),
            Box::new(FakeActuator::new(&hardware, &["GPU-a", "GPU-b"])),
        );
        crashed.set_power_cap(1, 250.0).unwrap();
        crashed.set_sm_clock_lock(0, Some((1500, 1500))).unwrap();
        // kill -9: no destructor runs.
        std::mem::forget(crashed);
        assert_eq!(hardware.get(1).power_cap_w, 250.0);

        // A new process, whose NVML numbers the GPUs the other way round.
        let mut next = FakeActuator::new(&hardware, &["GPU-b", "GPU-a"]);
        next.hardware = Hardware(Arc::new(Mutex::new(vec![hardware.get(1), hardware.get(0)])));
        let swapped = next.hardware.clone();
        let report = restore_all(&state_in(&dir), &mut next).unwrap();
        assert!(report.is_complete() && report.state_cleared, "{report}");
        assert_eq!(swapped.get(0), stock());
        assert_eq!(swapped.get(1), stock());
        assert_eq!(state_in(&dir).load().unwrap(), None);
        let text = report.to_string();
        assert!(text.contains("GPU GPU-b (was 1):"), "{text}");
        assert!(text.contains("power cap -> 700 W: restored"), "{text}");
        assert!(
            text.contains("SM clock lock -> no lock: restored"),
            "{text}"
        );
    }

    #[test]
    fn the_next_run_restores_leftovers_before_saving_its_own_originals() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(1);
        let mut crashed = SettingsGuard::new(
            state_in(&dir),
            Box::new(FakeActuator::new(&hardware, &["GPU-a"])),
        );
        crashed.set_power_cap(0, 250.0).unwrap();
        std::mem::forget(crashed);

        let mut next = SettingsGuard::new(
            state_in(&dir),
            Box::new(FakeActuator::new(&hardware, &["GPU-a"])),
        );
        next.set_power_cap(0, 300.0).unwrap();
        // The saved original is the true one, not the crashed run's 250 W.
        assert_eq!(
            state_in(&dir).load().unwrap(),
            Some(vec![saved("GPU-a", 0, stock())])
        );
        drop(next);
        assert_eq!(hardware.get(0), stock());
    }

    #[test]
    fn restore_all_without_a_file_does_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(1);
        let mut actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        let report = restore_all(&state_in(&dir), &mut actuator).unwrap();
        assert!(report.gpus.is_empty() && report.is_complete());
        assert_eq!(report.to_string(), "nothing to restore\n");
        assert!(actuator.changes.lock().unwrap().is_empty());
    }

    #[test]
    fn an_incomplete_restore_keeps_what_is_left_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_in(&dir);
        let lowered = GpuSettings {
            power_cap_w: 300.0,
            ..stock()
        };
        let hardware = Hardware(Arc::new(Mutex::new(vec![lowered, lowered])));
        state
            .save(&[
                saved("GPU-a", 0, stock()),
                saved("GPU-b", 1, stock()),
                saved("GPU-gone", 2, stock()),
            ])
            .unwrap();

        let mut actuator = FakeActuator::new(&hardware, &["GPU-a", "GPU-b"]);
        actuator.deny_power = true;
        let report = restore_all(&state, &mut actuator).unwrap();
        assert!(!report.is_complete() && !report.state_cleared);
        let text = report.to_string();
        assert!(text.contains("FAILED"), "{text}");
        assert!(text.contains("GPU GPU-gone (was 2): not found"), "{text}");
        assert_eq!(state.load().unwrap().map(|g| g.len()), Some(3));

        // Privileges back: the GPUs present are restored, the missing one stays on file.
        actuator.deny_power = false;
        let report = restore_all(&state, &mut actuator).unwrap();
        assert!(!report.is_complete());
        assert_eq!(hardware.get(0), stock());
        assert_eq!(hardware.get(1), stock());
        assert_eq!(
            state.load().unwrap(),
            Some(vec![saved("GPU-gone", 2, stock())])
        );
    }

    #[test]
    fn releasing_a_lock_the_gpu_cannot_have_is_nothing_to_undo() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(1);
        let mut actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        actuator.no_mem_locks = true;
        let mut guard = SettingsGuard::new(state_in(&dir), Box::new(actuator));
        guard.set_power_cap(0, 400.0).unwrap();
        let report = guard.restore().unwrap();
        assert!(report.is_complete(), "{report}");
        assert!(
            report
                .to_string()
                .contains("memory clock lock -> no lock: nothing to undo")
        );
        // The power cap came back; the untouched SM lock was reset all the same.
        assert_eq!(hardware.get(0), stock());
    }

    #[test]
    fn a_guard_that_cannot_save_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let blocked = dir.path().join("state.json");
        fs::create_dir(&blocked).unwrap();
        fs::write(blocked.join("keep"), "x").unwrap();
        let hardware = Hardware::new(1);
        let actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        let changes = Arc::clone(&actuator.changes);
        let mut guard = SettingsGuard::new(StateFile::new(&blocked), Box::new(actuator));
        let error = guard.set_power_cap(0, 300.0).unwrap_err();
        assert!(error.to_string().contains("nothing was changed"), "{error}");
        assert!(changes.lock().unwrap().is_empty());
        assert_eq!(hardware.get(0), stock());
    }

    #[test]
    fn guard_over_dry_run_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let original = GpuSettings {
            power_cap_w: 650.0,
            power_cap_enforced_w: 650.0,
            sm_clock_lock_mhz: Some((1400, 1980)),
            mem_clock_lock_mhz: None,
        };
        let dry = DryRun::new(vec![device(0, "GPU-a")], vec![original]);
        let mut guard = SettingsGuard::new(state_in(&dir), Box::new(dry));
        guard.set_power_cap(0, 400.0).unwrap();
        guard.set_sm_clock_lock(0, Some((1200, 1200))).unwrap();
        assert_eq!(guard.read(0).unwrap().power_cap_w, 400.0);
        let report = guard.restore().unwrap();
        assert!(report.is_complete(), "{report}");
        assert_eq!(guard.read(0).unwrap(), original);
    }

    fn fake_process(root: &Path, pid: u32, comm: &str, state: char) {
        let dir = root.join(pid.to_string());
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("comm"), format!("{comm}\n")).unwrap();
        fs::write(
            dir.join("stat"),
            format!("{pid} ({comm}) {state} 1 1 1 0 -1"),
        )
        .unwrap();
    }

    #[test]
    fn only_another_live_tokwatt_owns_a_state_file() {
        let proc_root = tempfile::tempdir().unwrap();
        let root = proc_root.path();
        fake_process(root, 10, "tokwatt", 'R');
        fake_process(root, 42, "tokwatt", 'S');
        fake_process(root, 43, "tokwatt", 'Z');
        fake_process(root, 44, "bash", 'S');
        assert!(owner_alive_in(root, 42, 10));
        assert!(!owner_alive_in(root, 10, 10), "our own file is a leftover");
        assert!(!owner_alive_in(root, 43, 10), "a zombie has exited");
        assert!(
            !owner_alive_in(root, 44, 10),
            "pid reused by another program"
        );
        assert!(!owner_alive_in(root, 45, 10), "gone");
        // The real process table: this test process is not another owner.
        assert!(!owned_by_other_live_process(std::process::id()));
    }

    const HELPER: &str = "restore::tests::helper_live_until_stdin_closes";

    #[test]
    #[ignore = "helper process for a_live_owner_blocks_restore_until_it_exits"]
    fn helper_live_until_stdin_closes() {
        if std::env::var_os("TOKWATT_TEST_HELPER").is_some() {
            let _ = io::Read::read_to_end(&mut io::stdin(), &mut Vec::new());
        }
    }

    #[test]
    fn a_live_owner_blocks_restore_until_it_exits() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_in(&dir);
        // Another process of this same program stands in for a running tokwatt.
        let mut owner = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", HELPER, "--ignored"])
            .env("TOKWATT_TEST_HELPER", "1")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // The child's process name settles only once its exec has completed.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !owned_by_other_live_process(owner.id()) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let document = StateDocument {
            format: FORMAT,
            pid: owner.id(),
            written_by: "test".into(),
            gpus: vec![saved("GPU-a", 0, stock())],
        };
        fs::write(state.path(), serde_json::to_vec(&document).unwrap()).unwrap();
        let hardware = Hardware(Arc::new(Mutex::new(vec![GpuSettings {
            power_cap_w: 300.0,
            ..stock()
        }])));

        let mut actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        let error = restore_all(&state, &mut actuator).unwrap_err();
        assert!(
            matches!(error, RestoreError::OwnerRunning { .. }),
            "{error}"
        );
        assert!(error.to_string().contains("Stop it first"), "{error}");
        let mut guard = SettingsGuard::new(state.clone(), Box::new(actuator));
        assert!(guard.set_power_cap(0, 400.0).is_err());
        assert_eq!(
            hardware.get(0).power_cap_w,
            300.0,
            "changed under a live owner"
        );

        drop(owner.stdin.take());
        owner.wait().unwrap();
        let mut actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        let report = restore_all(&state, &mut actuator).unwrap();
        assert!(report.is_complete() && report.state_cleared, "{report}");
        assert_eq!(hardware.get(0), stock());
        drop(guard);
    }

    #[test]
    fn default_path_follows_root_and_xdg() {
        let root = default_path_for(true, Some("/home/u/.state".into()), Some("/home/u".into()));
        assert_eq!(root, Path::new("/var/lib/tokwatt/state.json"));
        let xdg = default_path_for(false, Some("/home/u/.state".into()), Some("/home/u".into()));
        assert_eq!(xdg, Path::new("/home/u/.state/tokwatt/state.json"));
        let relative_xdg = default_path_for(false, Some("rel".into()), Some("/home/u".into()));
        assert_eq!(
            relative_xdg,
            Path::new("/home/u/.local/state/tokwatt/state.json")
        );
        let nothing = default_path_for(false, None, None);
        assert!(nothing.ends_with("tokwatt/state.json"));
        assert!(StateFile::default_path().ends_with("tokwatt/state.json"));
    }
}
