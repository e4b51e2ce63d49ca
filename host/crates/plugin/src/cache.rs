//! Compiled components on disk, keyed by the content hash of the component and the
//! engine's compatibility hash (wasmtime version, target, settings), so a cached file
//! is only ever loaded by an engine that could have produced it.
//!
//! A cached file is native code that wasmtime runs unchecked, so an agent (often root)
//! trusts it only from a folder and a file that no other user could have written: both
//! owned by the effective user and writable by nobody else. Otherwise it compiles
//! without the cache and says why. The folder is created `0700`, files `0600`, and old
//! entries are evicted (the newest [`KEEP_FILES`] files within [`KEEP_BYTES`] are kept).

use std::fs::{File, OpenOptions};
use std::hash::{Hash, Hasher};
use std::io::{Read as _, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

/// Cached files kept at most: the newest by modification time.
pub const KEEP_FILES: usize = 64;
/// Bytes of cached files kept at most, newest first.
pub const KEEP_BYTES: u64 = 256 << 20;

#[derive(Debug, Clone)]
pub struct ComponentCache {
    dir: PathBuf,
    engine_key: String,
    /// The effective user id, which must own the folder and its files.
    uid: Option<u32>,
    /// Loads served from a cached file (shared by clones), so a test or a report can
    /// tell a cache hit from a compile.
    hits: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// Why a cache folder or file is not trusted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Untrusted {
    #[error("the effective user id could not be read from /proc/self/status")]
    UnknownUser,
    #[error("{path} cannot be used: {reason}")]
    Unusable { path: PathBuf, reason: String },
    #[error("{path} is not a folder")]
    NotAFolder { path: PathBuf },
    #[error("{path} is owned by user {owner}, not by this process's user {uid}")]
    ForeignOwner { path: PathBuf, owner: u32, uid: u32 },
    #[error("{path} is writable by its group or by others (mode {mode:03o})")]
    Writable { path: PathBuf, mode: u32 },
}

/// Whether `metadata` (of `path`) is owned by `uid` and writable by nobody else.
fn check_owner_and_mode(
    path: &Path,
    metadata: &std::fs::Metadata,
    uid: u32,
) -> Result<(), Untrusted> {
    if metadata.uid() != uid {
        return Err(Untrusted::ForeignOwner {
            path: path.to_owned(),
            owner: metadata.uid(),
            uid,
        });
    }
    let mode = metadata.mode() & 0o777;
    if mode & 0o022 != 0 {
        return Err(Untrusted::Writable {
            path: path.to_owned(),
            mode,
        });
    }
    Ok(())
}

fn effective_uid() -> Option<u32> {
    tokwatt_core::privileges::Privileges::current().effective_uid
}

/// Feeds `Hash` output into SHA-256, which (unlike `DefaultHasher`) is stable.
struct ShaHasher(Sha256);

impl Hasher for ShaHasher {
    fn finish(&self) -> u64 {
        0
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl ComponentCache {
    pub fn new(dir: PathBuf, engine: &Engine) -> Self {
        let mut hasher = ShaHasher(Sha256::new());
        engine.precompile_compatibility_hash().hash(&mut hasher);
        let engine_key = hex(&hasher.0.finalize()[..8]);
        Self {
            dir,
            engine_key,
            uid: effective_uid(),
            hits: std::sync::Arc::default(),
        }
    }

    /// How many loads this cache served from a cached file rather than compiling.
    pub fn hits(&self) -> u64 {
        self.hits.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The folder, created `0700` if missing, if this process may trust what is in it.
    pub fn check_folder(&self) -> Result<(), Untrusted> {
        let uid = self.uid.ok_or(Untrusted::UnknownUser)?;
        let unusable = |e: std::io::Error| Untrusted::Unusable {
            path: self.dir.clone(),
            reason: e.to_string(),
        };
        if !self.dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&self.dir)
                .map_err(unusable)?;
        }
        let metadata = std::fs::metadata(&self.dir).map_err(unusable)?;
        if !metadata.is_dir() {
            return Err(Untrusted::NotAFolder {
                path: self.dir.clone(),
            });
        }
        check_owner_and_mode(&self.dir, &metadata, uid)
    }

    /// A cached file's bytes, if it exists and this process may trust it (checked on
    /// the open file, so it cannot be swapped between the check and the read).
    fn read_trusted(&self, path: &Path) -> Option<Result<Vec<u8>, Untrusted>> {
        let uid = self.uid?;
        let mut file = File::open(path).ok()?;
        let checked = file
            .metadata()
            .map_err(|e| Untrusted::Unusable {
                path: path.to_owned(),
                reason: e.to_string(),
            })
            .and_then(|metadata| check_owner_and_mode(path, &metadata, uid));
        if let Err(why) = checked {
            return Some(Err(why));
        }
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).ok()?;
        Some(Ok(bytes))
    }

    /// The default place: `$TOKWATT_CACHE_DIR`, else the platform's cache folder for
    /// tokwatt (`$XDG_CACHE_HOME/tokwatt` or `~/.cache/tokwatt` on Linux) + `components`.
    pub fn default_dir() -> Option<PathBuf> {
        if let Some(dir) = std::env::var_os("TOKWATT_CACHE_DIR") {
            return Some(PathBuf::from(dir));
        }
        directories::ProjectDirs::from("", "", "tokwatt")
            .map(|dirs| dirs.cache_dir().join("components"))
    }

    pub fn path_for(&self, wasm: &[u8]) -> PathBuf {
        let digest = Sha256::digest(wasm);
        self.dir
            .join(format!("{}-{}.cwasm", hex(&digest[..16]), self.engine_key))
    }

    /// The compiled component, from the cache when present, trusted and loadable;
    /// otherwise compiled and written back. A cache that cannot be trusted or written
    /// only costs speed.
    pub fn load_or_compile(&self, engine: &Engine, wasm: &[u8]) -> Result<Component, String> {
        if let Err(why) = self.check_folder() {
            tracing::warn!("not using the compiled-component cache: {why}; compiling the plugin");
            return Component::new(engine, wasm).map_err(|e| format!("{e:#}"));
        }
        let path = self.path_for(wasm);
        // Read into memory rather than map the file: a mapped cache file truncated by
        // another process would crash this one (SIGBUS).
        let cached = match self.read_trusted(&path) {
            Some(Ok(bytes)) => Some(bytes),
            Some(Err(why)) => {
                tracing::warn!("ignoring a cached component: {why}; compiling the plugin");
                // Replace it with one this process wrote (the rename below).
                None
            }
            None => None,
        };
        if let Some(compiled) = cached {
            // SAFETY: the file is named by the hash of its source and of this engine's
            // compatibility settings, and only this cache writes it (atomically, via
            // rename); wasmtime also checks its header against the engine.
            match unsafe { Component::deserialize(engine, &compiled) } {
                Ok(component) => {
                    self.hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::debug!(path = %path.display(), "compiled component from the cache");
                    return Ok(component);
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), "ignoring unusable cached component: {e:#}")
                }
            }
        }
        let component = Component::new(engine, wasm).map_err(|e| format!("{e:#}"))?;
        if let Err(e) = self.store(&path, &component) {
            tracing::warn!(path = %path.display(), "could not cache the compiled component: {e}");
        }
        Ok(component)
    }

    fn store(&self, path: &Path, component: &Component) -> Result<(), String> {
        let bytes = component.serialize().map_err(|e| format!("{e:#}"))?;
        // Unique per writer: threads of one process (a study's comparisons) compile the
        // same plugin at once, and a name shared by them loses one writer's file.
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let write = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp{}-{write}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| e.to_string())?;
        file.write_all(&bytes).map_err(|e| e.to_string())?;
        drop(file);
        std::fs::rename(&tmp, path).map_err(|e| e.to_string())?;
        self.evict(KEEP_FILES, KEEP_BYTES);
        Ok(())
    }

    /// Delete all but the newest `keep_files` cached files within `keep_bytes`.
    pub fn evict(&self, keep_files: usize, keep_bytes: u64) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut files: Vec<(SystemTime, u64, PathBuf)> = entries
            .filter_map(Result::ok)
            .filter(|entry| entry.path().extension().is_some_and(|e| e == "cwasm"))
            .filter_map(|entry| {
                let metadata = entry.metadata().ok()?;
                if !metadata.is_file() {
                    return None;
                }
                Some((metadata.modified().ok()?, metadata.len(), entry.path()))
            })
            .collect();
        // Newest first.
        files.sort_by_key(|file| std::cmp::Reverse(file.0));
        let mut kept_bytes = 0_u64;
        for (index, (_, len, path)) in files.iter().enumerate() {
            kept_bytes = kept_bytes.saturating_add(*len);
            let evict = index >= keep_files || (index > 0 && kept_bytes > keep_bytes);
            if evict && let Err(e) = std::fs::remove_file(path) {
                tracing::debug!(path = %path.display(), "could not evict: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;
    use std::time::Duration;

    use super::*;

    fn cache(dir: &Path) -> ComponentCache {
        let engine = Engine::default();
        ComponentCache::new(dir.to_owned(), &engine)
    }

    #[test]
    fn the_folder_is_created_private() {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = root.path().join("a/components");
        cache(&dir).check_folder().expect("trusted");
        let mode = std::fs::metadata(&dir).expect("made").mode() & 0o777;
        assert_eq!(mode, 0o700);
    }

    #[test]
    fn a_group_or_world_writable_folder_is_not_trusted() {
        let root = tempfile::tempdir().expect("tempdir");
        for mode in [0o770, 0o757, 0o777] {
            std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(mode))
                .expect("chmod");
            let why = cache(root.path()).check_folder().expect_err("untrusted");
            assert!(matches!(why, Untrusted::Writable { .. }), "{why}");
        }
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        cache(root.path()).check_folder().expect("trusted");
    }

    #[test]
    fn a_writable_cached_file_is_not_read() {
        let root = tempfile::tempdir().expect("tempdir");
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o700))
            .expect("chmod");
        let cache = cache(root.path());
        let path = root.path().join("x.cwasm");
        std::fs::write(&path, b"native code").expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).expect("chmod");
        assert!(matches!(
            cache.read_trusted(&path),
            Some(Err(Untrusted::Writable { .. }))
        ));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_eq!(cache.read_trusted(&path), Some(Ok(b"native code".to_vec())));
    }

    #[test]
    fn a_foreign_owner_is_named() {
        let metadata = std::fs::metadata("/").expect("root folder");
        let other = metadata.uid().wrapping_add(1);
        let why = check_owner_and_mode(Path::new("/"), &metadata, other).expect_err("foreign");
        assert!(matches!(why, Untrusted::ForeignOwner { .. }), "{why}");
    }

    #[test]
    fn threads_storing_the_same_component_at_once_all_succeed() {
        // An empty component: the header alone (`\0asm`, component version 0x0d, layer 1).
        const EMPTY_COMPONENT: [u8; 8] = [0x00, 0x61, 0x73, 0x6d, 0x0d, 0x00, 0x01, 0x00];
        let root = tempfile::tempdir().expect("tempdir");
        let engine = Engine::default();
        let cache = ComponentCache::new(root.path().join("components"), &engine);
        cache.check_folder().expect("trusted");
        let component = Component::new(&engine, EMPTY_COMPONENT).expect("compiles");
        let path = cache.path_for(&EMPTY_COMPONENT);
        let results: Vec<Result<(), String>> = std::thread::scope(|scope| {
            let writers: Vec<_> = (0..8)
                .map(|_| scope.spawn(|| cache.store(&path, &component)))
                .collect();
            writers
                .into_iter()
                .map(|w| w.join().expect("no panic"))
                .collect()
        });
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        assert!(path.is_file());
    }

    #[test]
    fn old_entries_are_evicted_newest_kept() {
        let root = tempfile::tempdir().expect("tempdir");
        let cache = cache(root.path());
        let now = SystemTime::now();
        for i in 0..6_u64 {
            let path = root.path().join(format!("{i}.cwasm"));
            std::fs::write(&path, vec![0_u8; 100]).expect("write");
            let file = File::options().write(true).open(&path).expect("open");
            // File i is i minutes old: 0 is the newest.
            file.set_modified(now - Duration::from_secs(60 * i))
                .expect("mtime");
        }
        std::fs::write(root.path().join("other.txt"), b"not ours").expect("write");
        let names = || {
            let mut names: Vec<String> = std::fs::read_dir(root.path())
                .expect("list")
                .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        };
        cache.evict(4, u64::MAX);
        assert_eq!(
            names(),
            ["0.cwasm", "1.cwasm", "2.cwasm", "3.cwasm", "other.txt"]
        );
        cache.evict(64, 250);
        assert_eq!(names(), ["0.cwasm", "1.cwasm", "other.txt"]);
    }
}
