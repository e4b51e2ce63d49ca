//! `--json`: a command's result as one JSON document on standard output, for scripts
//! (`run`, `ab`, `tune`, `eval`, `plugin test`, `report A B …`). Standard output then holds
//! that document and nothing else; progress and notes stay on standard error (`--quiet`
//! silences them). The document is an envelope of stable keys around the result the
//! command writes to its file anyway (`summary.json`, `ab.json`, `tune.json`,
//! `eval.json`), so a script reads the same keys from either place. The keys are listed in
//! the book (`docs/book/src/operating/scripting.md`) and pinned by `tests/all/json.rs`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Serialize;

/// The envelope's own version: a key renamed or removed, or a new meaning of one, is a new
/// version. The result inside carries its own file's `format_version`.
pub const JSON_FORMAT_VERSION: u32 = 1;

/// What `--json` prints.
#[derive(Debug, Serialize)]
pub struct JsonResult<'a, T: Serialize> {
    /// [`JSON_FORMAT_VERSION`].
    pub format_version: u32,
    /// The subcommand: `run`, `ab`, `tune`, `eval`, `plugin test`, `report`.
    pub command: &'static str,
    /// The folder the command wrote into (`null` where it wrote nothing).
    pub out_dir: Option<&'a Path>,
    /// The files under that folder once the command was done (its subfolders' too),
    /// sorted (empty where it wrote nothing).
    pub files: Vec<PathBuf>,
    /// The result: the document of the command's own file.
    pub result: &'a T,
    /// `ab` and `tune`: the objective the policies were held to, bound by bound with where
    /// each came from (`run`'s is in its summary, `result.objective_in_force`). Absent for
    /// the other commands.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub objective_in_force: Option<serde_json::Value>,
}

impl<'a, T: Serialize> JsonResult<'a, T> {
    /// The result of `command`, which wrote into `out_dir` (if anywhere).
    pub fn new(command: &'static str, out_dir: Option<&'a Path>, result: &'a T) -> Self {
        Self {
            format_version: JSON_FORMAT_VERSION,
            command,
            out_dir,
            files: out_dir.map(files_in).unwrap_or_default(),
            result,
            objective_in_force: None,
        }
    }

    /// The envelope with `objective_in_force` (`ab`, `tune`).
    pub fn with_objective_in_force(mut self, in_force: &impl Serialize) -> Result<Self> {
        self.objective_in_force =
            Some(serde_json::to_value(in_force).context("writing the objective in force")?);
        Ok(self)
    }

    /// Prints the document on standard output, pretty, ending with a newline.
    pub fn print(&self) -> Result<()> {
        let text = serde_json::to_string_pretty(self)
            .with_context(|| format!("writing the result of `tokwatt {}` as JSON", self.command))?;
        println!("{text}");
        Ok(())
    }
}

/// The plain files under `dir`, its subfolders' included, sorted (a folder that cannot be
/// read has none; links are not followed).
fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut folders = vec![dir.to_owned()];
    while let Some(folder) = folders.pop() {
        let Ok(entries) = std::fs::read_dir(&folder) else {
            continue;
        };
        for entry in entries.flatten() {
            match entry.file_type() {
                Ok(kind) if kind.is_dir() => folders.push(entry.path()),
                Ok(kind) if kind.is_file() => files.push(entry.path()),
                _ => {}
            }
        }
    }
    files.sort();
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_envelope_has_its_keys_and_lists_the_folders_files() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("b.json"), "{}").expect("write");
        std::fs::write(dir.path().join("a.csv"), "").expect("write");
        std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
        std::fs::write(dir.path().join("sub/c.txt"), "").expect("write");
        let result = serde_json::json!({"format_version": 7});
        let doc = JsonResult::new("run", Some(dir.path()), &result);
        let value = serde_json::to_value(&doc).expect("serialises");
        let mut keys: Vec<&str> = value
            .as_object()
            .expect("an object")
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            ["command", "files", "format_version", "out_dir", "result"]
        );
        assert_eq!(value["format_version"], JSON_FORMAT_VERSION);
        assert_eq!(value["result"]["format_version"], 7);
        let files: Vec<String> = value["files"]
            .as_array()
            .expect("files")
            .iter()
            .map(|f| f.as_str().expect("a path").to_owned())
            .collect();
        assert_eq!(files.len(), 3, "{files:?}");
        assert!(files[0].ends_with("a.csv") && files[1].ends_with("b.json"));
        assert!(files[2].ends_with("sub/c.txt"), "{files:?}");
        let nothing = JsonResult::new("plugin test", None, &result);
        let value = serde_json::to_value(&nothing).expect("serialises");
        assert!(value["out_dir"].is_null());
        assert_eq!(value["files"], serde_json::json!([]));
    }
}
