//! Reading a file a user names, bounded: a device (`/dev/zero`), a pipe that never ends or
//! a file of gigabytes must be an error that names it, not an allocation without end or a
//! read that never returns.

use std::io::{self, Read};
use std::path::Path;

/// The most a policy spec may hold: specs are a few KiB of TOML.
pub const MAX_SPEC_BYTES: u64 = 1024 * 1024;

/// The most a policy component may hold: a componentize-py component, interpreter
/// included, is about 40 MiB.
pub const MAX_PLUGIN_BYTES: u64 = 256 * 1024 * 1024;

/// The bytes of the regular file at `path`, refused when it is not a regular file or holds
/// more than `limit` bytes.
pub fn read_bounded(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    // Asked before opening: opening a named pipe waits for a writer.
    regular(&std::fs::metadata(path)?)?;
    let file = std::fs::File::open(path)?;
    let meta = file.metadata()?;
    regular(&meta)?;
    if meta.len() > limit {
        return Err(too_large(meta.len(), limit));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    // The file may grow between the check and the read.
    file.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64, limit));
    }
    Ok(bytes)
}

/// [`read_bounded`] as UTF-8 text.
pub fn read_text_bounded(path: &Path, limit: u64) -> io::Result<String> {
    String::from_utf8(read_bounded(path, limit)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "it is not UTF-8 text"))
}

fn regular(meta: &std::fs::Metadata) -> io::Result<()> {
    if meta.is_file() {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "it is not a regular file (a folder, a device or a pipe): name the file itself",
        ))
    }
}

fn too_large(len: u64, limit: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::FileTooLarge,
        format!("it holds {len} bytes, more than the {limit} allowed"),
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    #[test]
    fn devices_folders_and_large_files_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let folder = read_bounded(dir.path(), 10).unwrap_err();
        assert!(
            folder.to_string().contains("not a regular file"),
            "{folder}"
        );
        let device = read_bounded(Path::new("/dev/zero"), 10).unwrap_err();
        assert!(
            device.to_string().contains("not a regular file"),
            "{device}"
        );
        // A pipe with no writer: refused, not waited on.
        let pipe = dir.path().join("pipe");
        let made = std::process::Command::new("mkfifo").arg(&pipe).status();
        if made.is_ok_and(|status| status.success()) {
            let error = read_bounded(&pipe, 10).unwrap_err();
            assert!(error.to_string().contains("not a regular file"), "{error}");
        }
        let big = dir.path().join("big");
        std::fs::write(&big, [0u8; 11]).unwrap();
        let error = read_bounded(&big, 10).unwrap_err();
        assert!(
            error.to_string().contains("11 bytes, more than the 10"),
            "{error}"
        );
        assert_eq!(read_bounded(&big, 11).unwrap().len(), 11);
        std::fs::write(&big, [0xff, 0xfe]).unwrap();
        assert!(read_text_bounded(&big, 10).is_err());
    }
}
