//! Compiled components on disk, keyed by the content hash of the component and the
//! engine's compatibility hash (wasmtime version, target, settings), so a cached file
//! is only ever loaded by an engine that could have produced it.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

#[derive(Debug, Clone)]
pub struct ComponentCache {
    dir: PathBuf,
    engine_key: String,
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
        Self { dir, engine_key }
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

    /// The compiled component, from the cache when present and loadable; otherwise
    /// compiled and written back. A cache that cannot be written only costs speed.
    pub fn load_or_compile(&self, engine: &Engine, wasm: &[u8]) -> Result<Component, String> {
        let path = self.path_for(wasm);
        // Read into memory rather than map the file: a mapped cache file truncated by
        // another process would crash this one (SIGBUS).
        if let Ok(compiled) = std::fs::read(&path) {
            // SAFETY: the file is named by the hash of its source and of this engine's
            // compatibility settings, and only this cache writes it (atomically, via
            // rename); wasmtime also checks its header against the engine.
            match unsafe { Component::deserialize(engine, &compiled) } {
                Ok(component) => return Ok(component),
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
        std::fs::create_dir_all(&self.dir).map_err(|e| e.to_string())?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, bytes).map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, path).map_err(|e| e.to_string())
    }
}
