//! The state file: what it holds, how it is written (atomically) and read back, and which
//! files it refuses — corrupt ones, other programs' files, and other format versions.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::RestoreError;
use super::report::Setting;
use tokwatt_core::actuator::GpuSettings;
use tokwatt_core::privileges::Privileges;

/// Version of the state file's layout, in its `format` field; a file with another
/// version is refused. Every state file tokwatt has written carries the field.
pub(super) const FORMAT_VERSION: u32 = 1;

/// Ending of the temporary file a save writes before renaming it over the state file.
const TEMPORARY_SUFFIX: &str = ".tmp";

/// The original settings of one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SavedGpu {
    pub uuid: String,
    /// Position when saved (for messages; GPUs are matched by UUID).
    pub index: u32,
    pub original: GpuSettings,
    /// What tokwatt changed (recorded before each first change): only these are put back,
    /// so a clock lock someone else set survives a power-cap-only run. A file from before
    /// this field restores everything, as those versions did.
    #[serde(default = "Changed::everything")]
    pub changed: Changed,
}

/// Which of a GPU's settings tokwatt has changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Changed {
    pub power_cap: bool,
    pub sm_clock_lock: bool,
    pub mem_clock_lock: bool,
}

impl Changed {
    pub fn everything() -> Self {
        Self {
            power_cap: true,
            sm_clock_lock: true,
            mem_clock_lock: true,
        }
    }
}

impl Changed {
    /// Mark `setting` changed; whether it was not before.
    pub fn mark(&mut self, setting: Setting) -> bool {
        let flag = match setting {
            Setting::PowerCap => &mut self.power_cap,
            Setting::SmClockLock => &mut self.sm_clock_lock,
            Setting::MemClockLock => &mut self.mem_clock_lock,
        };
        !std::mem::replace(flag, true)
    }
}

/// What the state file holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct StateDocument {
    /// The layout's version, [`FORMAT_VERSION`].
    pub(super) format: u32,
    /// The process that saved it: a file whose owner still runs is not restored under it.
    pub(super) pid: u32,
    pub(super) written_by: String,
    pub(super) gpus: Vec<SavedGpu>,
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
        // The user's state folder comes from `directories` ($XDG_STATE_HOME/tokwatt, or
        // ~/.local/state/tokwatt; it ignores a relative $XDG_STATE_HOME, as XDG says).
        let user_state_dir = directories::ProjectDirs::from("", "", "tokwatt")
            .and_then(|dirs| dirs.state_dir().map(Path::to_path_buf));
        default_path_for(Privileges::current().is_root(), user_state_dir)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The saved settings, or `None` when there is no file (nothing to restore).
    pub fn load(&self) -> Result<Option<Vec<SavedGpu>>, RestoreError> {
        Ok(self.load_document()?.map(|document| document.gpus))
    }

    /// The whole document, or `None` when there is no file.
    pub(super) fn load_document(&self) -> Result<Option<StateDocument>, RestoreError> {
        let text = match fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(error) if error.kind() == io::ErrorKind::InvalidData => {
                return Err(self.foreign("it is not text".into()));
            }
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
        let value = match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(value) => value,
            // Empty, or cut short: what is left of a state file.
            Err(error) if text.trim().is_empty() || text.trim_start().starts_with('{') => {
                return Err(corrupt(error.to_string()));
            }
            Err(_) => return Err(self.foreign("it is not JSON".into())),
        };
        // The version first, so a newer layout is reported as such, not as corruption.
        let format = match value.get("format") {
            Some(format) => format
                .as_u64()
                .ok_or_else(|| corrupt(format!("its \"format\" is {format}, not a number")))?,
            None if value.get("gpus").is_some() => {
                return Err(corrupt("it has no \"format\" version".into()));
            }
            None => {
                return Err(
                    self.foreign("it has neither the \"format\" nor the \"gpus\" field".into())
                );
            }
        };
        if format != u64::from(FORMAT_VERSION) {
            return Err(RestoreError::UnsupportedFormat {
                path: self.path.clone(),
                found: u32::try_from(format).unwrap_or(u32::MAX),
            });
        }
        let document: StateDocument =
            serde_json::from_value(value).map_err(|e| corrupt(e.to_string()))?;
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

    fn foreign(&self, reason: String) -> RestoreError {
        RestoreError::Foreign {
            path: self.path.clone(),
            reason,
        }
    }

    /// Write `gpus` as the saved settings, atomically: readers see the old file or the new
    /// one, never a part.
    pub fn save(&self, gpus: &[SavedGpu]) -> Result<(), RestoreError> {
        let document = StateDocument {
            format: FORMAT_VERSION,
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

/// Root's state lives in /var/lib (it outlives any user's session); a user's in their
/// state folder, or, without a home, the temporary folder.
fn default_path_for(is_root: bool, user_state_dir: Option<PathBuf>) -> PathBuf {
    const FILE: &str = "state.json";
    if is_root {
        return Path::new("/var/lib/tokwatt").join(FILE);
    }
    match user_state_dir {
        Some(dir) => dir.join(FILE),
        None => std::env::temp_dir().join("tokwatt").join(FILE),
    }
}

fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

/// The start of the names of `path`'s temporaries: `.state.json.` for `state.json`.
fn temporary_prefix(path: &Path) -> io::Result<OsString> {
    let file_name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path names no file"))?;
    let mut prefix = OsString::from(".");
    prefix.push(file_name);
    prefix.push(".");
    Ok(prefix)
}

/// A temporary file in the same folder, fsync, rename over `path`, fsync the folder. On
/// failure the temporary is deleted and the file at `path`, if any, is untouched.
fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let folder = parent_of(path);
    fs::create_dir_all(folder)?;
    let prefix = temporary_prefix(path)?;
    let mut temporary = tempfile::Builder::new()
        .prefix(&prefix)
        .suffix(TEMPORARY_SUFFIX)
        .tempfile_in(folder)?;
    temporary.write_all(bytes)?;
    temporary.as_file().sync_all()?;
    // A failed rename hands the temporary back; dropping it deletes it.
    temporary.persist(path).map_err(|failed| failed.error)?;
    remove_stale_temporaries(folder, &prefix);
    sync_parent(path)
}

/// Delete temporaries that a crash between write and rename left behind. Best effort:
/// they are never read, only untidy.
fn remove_stale_temporaries(folder: &Path, prefix: &OsString) {
    let Ok(entries) = fs::read_dir(folder) else {
        return;
    };
    let prefix = prefix.to_string_lossy();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(prefix.as_ref()) && name.ends_with(TEMPORARY_SUFFIX) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// Make a rename or delete in `path`'s folder durable.
pub(super) fn sync_parent(path: &Path) -> io::Result<()> {
    File::open(parent_of(path))?.sync_all()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;
    use crate::restore::test_support::{files_in, saved, state_in, stock};

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
    fn a_saved_file_carries_its_format_version_and_writer() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_in(&dir);
        state.save(&[saved("GPU-a", 0, stock())]).unwrap();
        let value: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(state.path()).unwrap()).unwrap();
        assert_eq!(value["format"], serde_json::json!(FORMAT_VERSION));
        assert_eq!(value["pid"], serde_json::json!(std::process::id()));
        assert!(
            value["written_by"]
                .as_str()
                .unwrap()
                .starts_with("tokwatt ")
        );
    }

    #[test]
    fn a_file_written_by_the_first_release_still_loads() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_in(&dir);
        // Byte for byte what tokwatt 0.1.0 writes.
        fs::write(
            state.path(),
            r#"{
  "format": 1,
  "pid": 4242,
  "written_by": "tokwatt 0.1.0",
  "gpus": [
    {
      "uuid": "GPU-a",
      "index": 0,
      "original": {
        "power_cap_w": 700.0,
        "power_cap_enforced_w": 700.0,
        "sm_clock_lock_mhz": null,
        "mem_clock_lock_mhz": null
      }
    }
  ]
}
"#,
        )
        .unwrap();
        assert_eq!(
            state.load().unwrap(),
            Some(vec![saved("GPU-a", 0, stock())])
        );
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
    fn a_temporary_left_by_a_crash_mid_write_is_ignored_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_in(&dir);
        state.save(&[saved("GPU-a", 0, stock())]).unwrap();
        // A crash between write and rename leaves a partial temporary behind.
        fs::write(
            dir.path().join(".state.json.a1B2c3.tmp"),
            "{\"format\": 1, \"gpus\": [",
        )
        .unwrap();
        // Not a temporary of this state file: left alone.
        fs::write(dir.path().join(".other.json.x.tmp"), "").unwrap();
        assert_eq!(state.load().unwrap().map(|g| g.len()), Some(1));
        state.save(&[saved("GPU-b", 0, stock())]).unwrap();
        assert_eq!(
            files_in(dir.path()),
            vec![".other.json.x.tmp", "state.json"]
        );
    }

    #[test]
    fn a_corrupt_file_is_an_error_naming_the_path_and_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_in(&dir);
        for bad in [
            "{\"format\": 1, \"gpus\": [",
            "",
            "{\"format\": \"one\", \"gpus\": []}",
            "{\"pid\": 1, \"written_by\": \"x\", \"gpus\": []}",
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
    fn another_programs_file_is_refused_and_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_in(&dir);
        let foreign: [&[u8]; 4] = [
            b"[]",
            b"{\"theme\": \"dark\"}",
            b"root:x:0:0:root:/root:/bin/bash\n",
            b"\x7fELF\x02\x01\x01\xff\xfe",
        ];
        for bad in foreign {
            fs::write(state.path(), bad).unwrap();
            let error = state.load().unwrap_err();
            assert!(
                matches!(error, RestoreError::Foreign { .. }),
                "{bad:?}: {error}"
            );
            let message = error.to_string();
            assert!(
                message.contains(&state.path().display().to_string()),
                "{message}"
            );
            assert!(message.contains("not a tokwatt state file"), "{message}");
            assert!(message.contains("--state-file"), "{message}");
            assert_eq!(fs::read(state.path()).unwrap(), bad);
        }
    }

    #[test]
    fn another_format_version_is_refused_naming_the_file_and_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_in(&dir);
        for (text, version) in [
            ("{\"format\": 2, \"anything\": true}", 2),
            ("{\"format\": 0, \"gpus\": []}", 0),
            ("{\"format\": 99999999999}", u32::MAX),
        ] {
            fs::write(state.path(), text).unwrap();
            let error = state.load().unwrap_err();
            assert!(
                matches!(&error, RestoreError::UnsupportedFormat { found, .. } if *found == version),
                "{text}: {error}"
            );
            let message = error.to_string();
            assert!(
                message.contains(&state.path().display().to_string()),
                "{message}"
            );
            assert!(message.contains("reads only version 1"), "{message}");
            assert!(
                message.contains("tokwatt restore --state-file"),
                "{message}"
            );
        }
    }

    #[test]
    fn default_path_follows_root_and_xdg() {
        let root = default_path_for(true, Some("/home/u/.local/state/tokwatt".into()));
        assert_eq!(root, Path::new("/var/lib/tokwatt/state.json"));
        let user = default_path_for(false, Some("/home/u/.local/state/tokwatt".into()));
        assert_eq!(user, Path::new("/home/u/.local/state/tokwatt/state.json"));
        let nothing = default_path_for(false, None);
        assert!(nothing.ends_with("tokwatt/state.json"));
        assert!(StateFile::default_path().ends_with("tokwatt/state.json"));
    }
}
