//! Swap when a watched policy folder changes. The folder holds one policy spec (`*.toml`)
//! and its plugin; when any file in it changes (name, size or modification time) and
//! then stays the same for one more look (a copy in progress is not taken half-written),
//! the spec is swapped in through the same path as the API's swap. A folder that does not
//! hold exactly one spec, or a swap that fails, is logged and counted; the policy in
//! charge stays.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use super::{ServeControl, ServeError};
use crate::api::{Control, SwapRequest};

/// What the folder looked like: every file's name, size and modification time.
pub(super) type Fingerprint = Vec<(PathBuf, u64, Option<SystemTime>)>;

fn fingerprint(folder: &Path) -> std::io::Result<Fingerprint> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(folder)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        if meta.is_file() {
            files.push((entry.path(), meta.len(), meta.modified().ok()));
        }
    }
    files.sort();
    Ok(files)
}

/// The folder's files now, or why it cannot be watched.
pub(super) fn readable(folder: &Path) -> Result<Fingerprint, ServeError> {
    fingerprint(folder).map_err(|source| ServeError::Watch {
        folder: folder.to_owned(),
        source,
    })
}

/// The one spec in the folder.
fn the_spec(files: &Fingerprint, folder: &Path) -> Result<PathBuf, String> {
    let specs: Vec<&PathBuf> = files
        .iter()
        .map(|(path, _, _)| path)
        .filter(|path| path.extension().is_some_and(|e| e == "toml"))
        .collect();
    match specs[..] {
        [one] => Ok(one.clone()),
        [] => Err(format!(
            "the watched folder {} holds no policy spec (*.toml): put one spec and its plugin there",
            folder.display()
        )),
        _ => Err(format!(
            "the watched folder {} holds {} policy specs: keep exactly one there",
            folder.display(),
            specs.len()
        )),
    }
}

/// The watching thread; dropping it stops the thread.
#[derive(Debug)]
pub(super) struct Watcher {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Watch `folder` from `baseline` ([`readable`]'s reading at the start: what is
    /// there then is not a change).
    pub fn start(
        folder: PathBuf,
        baseline: Fingerprint,
        period: Duration,
        control: Arc<ServeControl>,
    ) -> Result<Self, ServeError> {
        let (stop, stopped) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("tokwatt-policy-watch".into())
            .spawn(move || watch(&folder, period, baseline, &control, &stopped))
            .map_err(ServeError::Thread)?;
        Ok(Self {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn watch(
    folder: &Path,
    period: Duration,
    mut swapped: Fingerprint,
    control: &ServeControl,
    stopped: &mpsc::Receiver<()>,
) {
    let mut last_seen = swapped.clone();
    loop {
        match stopped.recv_timeout(period) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
        let now = match fingerprint(folder) {
            Ok(now) => now,
            Err(error) => {
                tracing::warn!(folder = %folder.display(), "cannot read the watched policy folder: {error}");
                continue;
            }
        };
        // Changed since the last swap, and settled since the last look.
        let settled = now == last_seen;
        last_seen = now.clone();
        if now == swapped || !settled {
            continue;
        }
        swapped = now.clone();
        let spec = match the_spec(&now, folder) {
            Ok(spec) => spec,
            Err(why) => {
                tracing::error!("{why}");
                control.refused_from_watch(&why);
                continue;
            }
        };
        tracing::info!(spec = %spec.display(), "the watched policy folder changed: swapping");
        match control.swap(&SwapRequest {
            spec,
            plugin: None,
            fresh: false,
        }) {
            Ok(outcome) => tracing::info!("{}", outcome.message),
            Err(error) => {
                tracing::error!("the watched folder's policy was not swapped in: {error}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exactly_one_spec_is_taken_from_the_folder() {
        let folder = Path::new("/w");
        let file = |name: &str| (folder.join(name), 1, None);
        assert_eq!(
            the_spec(&vec![file("a.toml"), file("a.wasm")], folder),
            Ok(folder.join("a.toml"))
        );
        let none = the_spec(&vec![file("a.wasm")], folder).expect_err("no spec");
        assert!(none.contains("no policy spec"), "{none}");
        let two = the_spec(&vec![file("a.toml"), file("b.toml")], folder).expect_err("two");
        assert!(two.contains("2 policy specs"), "{two}");
    }
}
