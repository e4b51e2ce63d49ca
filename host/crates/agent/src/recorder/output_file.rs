//! One output file of a run (`trace.csv` or `observations.jsonl`), optionally rotated so
//! that a run of weeks keeps a bounded amount of disk.
//!
//! Rotation keeps the newest lines in `trace.csv` and the older ones in `trace.1.csv`
//! (newest) … `trace.<keep>.csv` (oldest); each file starts with the header, so each
//! reads on its own.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::RecorderError;

/// Bounds on each output file's size, for runs that last weeks: when a line would take
/// the current file past `max_bytes`, the file is renamed to `<name>.1.<ext>` (older ones
/// shift up to `<name>.<keep>.<ext>`, the oldest is deleted) and a fresh one starts.
/// Each file kind then holds at most about `(keep + 1) × max_bytes` on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rotation {
    /// Size at which a file is rotated, in bytes (a file holds at least one line, so a
    /// single line longer than this still makes a file of its own).
    pub max_bytes: u64,
    /// How many rotated files of each kind are kept (0: none, only the current file).
    pub keep: u32,
}

impl Rotation {
    /// The smallest `max_bytes`: a file must hold its header and a few lines.
    pub const MIN_BYTES: u64 = 4096;
    /// The most rotated files kept per kind: each rotation renames every kept file.
    pub const MAX_KEEP: u32 = 1000;

    /// Checks the bounds; the error names the value and how to fix it.
    pub fn validate(&self) -> Result<(), RecorderError> {
        if self.max_bytes < Self::MIN_BYTES {
            return Err(RecorderError::Rotation(format!(
                "max_bytes is {}, below the smallest useful size: raise it to at least {} bytes",
                self.max_bytes,
                Self::MIN_BYTES
            )));
        }
        if self.keep > Self::MAX_KEEP {
            return Err(RecorderError::Rotation(format!(
                "keep is {}, above {}: keep fewer files and raise max_bytes instead",
                self.keep,
                Self::MAX_KEEP
            )));
        }
        Ok(())
    }
}

/// The name of the `n`th rotated file of `name` (`trace.csv`, 2 → `trace.2.csv`).
pub(super) fn rotated_name(name: &str, n: u32) -> String {
    match name.rsplit_once('.') {
        Some((stem, ext)) => format!("{stem}.{n}.{ext}"),
        None => format!("{name}.{n}"),
    }
}

/// Whether `file_name` is a rotated file of `name` (`trace.7.csv` of `trace.csv`).
pub(super) fn is_rotated_name(name: &str, file_name: &str) -> bool {
    let (stem, ext) = name.rsplit_once('.').unwrap_or((name, ""));
    let Some(rest) = file_name
        .strip_prefix(stem)
        .and_then(|rest| rest.strip_prefix('.'))
    else {
        return false;
    };
    let number = if ext.is_empty() {
        Some(rest)
    } else {
        rest.strip_suffix(ext).and_then(|n| n.strip_suffix('.'))
    };
    number.is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The files of kind `name` in `dir`, oldest first: `name.N.ext` … `name.1.ext` (a rotating
/// run's older ones, by number), then `name` itself (listed whether or not it exists).
pub(super) fn files_oldest_first(dir: &Path, name: &str) -> std::io::Result<Vec<PathBuf>> {
    let (stem, ext) = name.rsplit_once('.').unwrap_or((name, ""));
    let mut rotated: Vec<(u64, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(dir)?.flatten() {
        let file_name = entry.file_name();
        let Some(file_name) = file_name.to_str() else {
            continue;
        };
        if !is_rotated_name(name, file_name) {
            continue;
        }
        let number = file_name[stem.len() + 1..]
            .strip_suffix(ext)
            .map_or(&file_name[stem.len() + 1..], |n| n.trim_end_matches('.'));
        if let Ok(n) = number.parse::<u64>() {
            rotated.push((n, entry.path()));
        }
    }
    rotated.sort_by_key(|(n, _)| std::cmp::Reverse(*n));
    let mut files: Vec<PathBuf> = rotated.into_iter().map(|(_, path)| path).collect();
    files.push(dir.join(name));
    Ok(files)
}

/// The rotated files of `name` in `dir` (none if `dir` does not exist yet).
pub(super) fn rotated_files(dir: &Path, name: &str) -> Result<Vec<PathBuf>, RecorderError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(RecorderError::Write {
                path: dir.to_owned(),
                source,
            });
        }
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| RecorderError::Write {
            path: dir.to_owned(),
            source,
        })?;
        if entry
            .file_name()
            .to_str()
            .is_some_and(|file_name| is_rotated_name(name, file_name))
        {
            found.push(entry.path());
        }
    }
    found.sort();
    Ok(found)
}

/// An output file that counts what it wrote, writes its header at the start of each
/// file, and rotates when asked to.
#[derive(Debug)]
pub(super) struct OutputFile {
    dir: PathBuf,
    name: &'static str,
    path: PathBuf,
    /// Written before the first line of every file (the CSV header); none for JSON lines.
    header: Option<Vec<u8>>,
    writer: BufWriter<File>,
    /// Bytes written to the current file, header included.
    bytes: u64,
    rotation: Option<Rotation>,
    /// Rotated files of this kind on disk, `name.1.ext` to `name.<rotated>.ext`.
    rotated: u32,
}

impl OutputFile {
    /// Creates (or truncates) `dir/name`. The header is written with the first line, so
    /// a run that records nothing leaves an empty file, as it always has.
    pub(super) fn create(
        dir: &Path,
        name: &'static str,
        header: Option<Vec<u8>>,
        rotation: Option<Rotation>,
    ) -> Result<Self, RecorderError> {
        let path = dir.join(name);
        let writer = open(&path)?;
        Ok(Self {
            dir: dir.to_owned(),
            name,
            path,
            header,
            writer,
            bytes: 0,
            rotation,
            rotated: 0,
        })
    }

    fn error(&self, source: std::io::Error) -> RecorderError {
        RecorderError::Write {
            path: self.path.clone(),
            source,
        }
    }

    /// Writes one whole line (`line` ends with its newline), rotating first if the line
    /// would take a file that already holds lines past the size bound.
    pub(super) fn write_line(&mut self, line: &[u8]) -> Result<(), RecorderError> {
        let line_bytes = line.len() as u64;
        if let Some(rotation) = self.rotation
            && self.bytes > 0
            && self.bytes.saturating_add(line_bytes) > rotation.max_bytes
        {
            self.rotate(rotation)?;
        }
        if self.bytes == 0
            && let Some(header) = &self.header
        {
            let header_bytes = header.len() as u64;
            if let Err(source) = self.writer.write_all(header) {
                return Err(self.error(source));
            }
            self.bytes = header_bytes;
        }
        if let Err(source) = self.writer.write_all(line) {
            return Err(self.error(source));
        }
        self.bytes += line_bytes;
        Ok(())
    }

    pub(super) fn flush(&mut self) -> Result<(), RecorderError> {
        self.writer.flush().map_err(|source| self.error(source))
    }

    /// Closes the current file, shifts the rotated ones up by one (the one at `keep` is
    /// replaced, so the oldest goes), renames the current file to `.1` and opens a fresh
    /// one. Each rename is atomic. A rotated file found missing is skipped, so a rotation
    /// that failed half way can be retried by the next line.
    fn rotate(&mut self, rotation: Rotation) -> Result<(), RecorderError> {
        self.flush()?;
        if rotation.keep == 0 {
            std::fs::remove_file(&self.path).map_err(|source| self.error(source))?;
        } else {
            for n in (1..=self.rotated.min(rotation.keep - 1)).rev() {
                let from = self.dir.join(rotated_name(self.name, n));
                let to = self.dir.join(rotated_name(self.name, n + 1));
                match std::fs::rename(&from, &to) {
                    Ok(()) => {}
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                    Err(source) => return Err(RecorderError::Rotate { from, to, source }),
                }
            }
            let to = self.dir.join(rotated_name(self.name, 1));
            std::fs::rename(&self.path, &to).map_err(|source| RecorderError::Rotate {
                from: self.path.clone(),
                to,
                source,
            })?;
            self.rotated = (self.rotated + 1).min(rotation.keep);
        }
        // The old file was flushed above; replacing the writer closes it.
        self.writer = open(&self.path)?;
        self.bytes = 0;
        Ok(())
    }
}

fn open(path: &Path) -> Result<BufWriter<File>, RecorderError> {
    File::create(path)
        .map(BufWriter::new)
        .map_err(|source| RecorderError::Write {
            path: path.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotated_names_put_the_number_before_the_extension() {
        assert_eq!(rotated_name("trace.csv", 1), "trace.1.csv");
        assert_eq!(
            rotated_name("observations.jsonl", 12),
            "observations.12.jsonl"
        );
        assert!(is_rotated_name("trace.csv", "trace.1.csv"));
        assert!(is_rotated_name("trace.csv", "trace.30.csv"));
        for other in [
            "trace.csv",
            "trace..csv",
            "trace.x.csv",
            "trace.1.jsonl",
            "trace.1.csv.tmp",
            "observations.1.jsonl",
        ] {
            assert!(!is_rotated_name("trace.csv", other), "{other}");
        }
    }

    #[test]
    fn files_are_listed_oldest_first_by_number() {
        let dir = tempfile::tempdir().expect("tempdir");
        for name in [
            "trace.csv",
            "trace.1.csv",
            "trace.2.csv",
            "trace.10.csv",
            "trace.x.csv",
        ] {
            std::fs::write(dir.path().join(name), "").expect("write");
        }
        let names: Vec<String> = files_oldest_first(dir.path(), "trace.csv")
            .expect("list")
            .iter()
            .map(|p| p.file_name().expect("name").to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            ["trace.10.csv", "trace.2.csv", "trace.1.csv", "trace.csv"]
        );
    }

    #[test]
    fn bad_bounds_are_refused_with_the_fix() {
        let small = Rotation {
            max_bytes: 100,
            keep: 3,
        };
        let error = small.validate().expect_err("too small").to_string();
        assert!(
            error.contains("max_bytes is 100") && error.contains("4096"),
            "{error}"
        );
        let many = Rotation {
            max_bytes: 1 << 20,
            keep: 5000,
        };
        let error = many.validate().expect_err("too many").to_string();
        assert!(error.contains("keep is 5000"), "{error}");
        Rotation {
            max_bytes: Rotation::MIN_BYTES,
            keep: 0,
        }
        .validate()
        .expect("the smallest bounds are accepted");
    }

    #[test]
    fn keep_zero_keeps_only_the_current_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rotation = Rotation {
            max_bytes: Rotation::MIN_BYTES,
            keep: 0,
        };
        let mut file = OutputFile::create(
            dir.path(),
            "trace.csv",
            Some(b"h\n".to_vec()),
            Some(rotation),
        )
        .expect("create");
        let line = [b'x'; 999];
        for _ in 0..20 {
            file.write_line(&[&line[..], b"\n"].concat()).expect("line");
        }
        file.flush().expect("flush");
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["trace.csv"]);
        let text = std::fs::read_to_string(dir.path().join("trace.csv")).expect("read");
        // 2 header bytes + 4 lines of 1000 fit in 4096; 20 lines end with 4 in the file.
        assert_eq!(text.lines().count(), 5, "header and four lines");
        assert!(text.starts_with("h\n"));
    }

    #[test]
    fn a_failed_rotation_is_an_error_naming_the_path_and_the_next_line_retries() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rotation = Rotation {
            max_bytes: Rotation::MIN_BYTES,
            keep: 2,
        };
        let mut file =
            OutputFile::create(dir.path(), "trace.csv", None, Some(rotation)).expect("create");
        let line = [&[b'x'; 2999][..], b"\n"].concat();
        file.write_line(&line).expect("first line");
        // A folder where the rotated file should go makes the rename fail.
        let blocker = dir.path().join("trace.1.csv");
        std::fs::create_dir(&blocker).expect("blocker");
        std::fs::write(blocker.join("inside"), "x").expect("non-empty blocker");
        let error = file
            .write_line(&line)
            .expect_err("rotation fails")
            .to_string();
        assert!(error.contains("trace.1.csv"), "{error}");
        std::fs::remove_dir_all(&blocker).expect("unblock");
        file.write_line(&line).expect("the next line rotates");
        file.flush().expect("flush");
        let rotated = std::fs::read(&blocker).expect("trace.1.csv");
        assert_eq!(rotated, line, "the first line was rotated out");
    }
}
