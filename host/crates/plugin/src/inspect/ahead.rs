//! `tokwatt plugin compile`: a component compiled ahead into the agent's cache, so a large
//! (Python or JavaScript) component starts at once.

use std::path::{Path, PathBuf};

use crate::contract::{check_component_header, check_contract_version};
use crate::{PLUGIN_TEXT_MAX_BYTES, PluginError, PluginHost, sanitize_text};

/// Why a component could not be compiled ahead of time.
#[derive(Debug, thiserror::Error)]
pub enum CompileAheadError {
    #[error(transparent)]
    Plugin(#[from] PluginError),
    #[error(
        "there is no compiled-component cache to compile into: no cache folder is known for this user; pass --cache-dir DIR or set TOKWATT_CACHE_DIR (the agent must use the same folder)"
    )]
    NoCache,
    #[error(
        "the compiled-component cache cannot be used: {why}; the agent would not trust it either and would compile at every start (make the folder this user's own, mode 0700, or pick another with --cache-dir)"
    )]
    Untrusted { why: String },
    #[error(
        "compiled {path}, but the compiled form could not be written to {cache_path} (see the warning above); the agent would compile it again at start"
    )]
    NotStored { path: PathBuf, cache_path: PathBuf },
}

/// What `tokwatt plugin compile` did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CompiledAhead {
    /// The cached compiled component, where the agent will look for it.
    pub cache_path: PathBuf,
    /// It was there already (nothing compiled).
    pub already_cached: bool,
    /// Time to compile, or to load the cached form.
    pub seconds: f64,
    /// The guest interface it implements.
    pub guest_interface: String,
}

/// Compile a policy into the host's component cache (same key and trust rules as every
/// load), so an agent that starts or swaps to it later loads native code at once.
/// Refuses a file that is not a policy of a served contract version: caching it would
/// only hide the error until the agent loads it.
pub fn compile_ahead(host: &PluginHost, path: &Path) -> Result<CompiledAhead, CompileAheadError> {
    let cache = host.cache.as_ref().ok_or(CompileAheadError::NoCache)?;
    cache
        .check_folder()
        .map_err(|why| CompileAheadError::Untrusted {
            why: why.to_string(),
        })?;
    let bytes = crate::read_component(path)?;
    check_component_header(path, &bytes)?;
    let hits_before = cache.hits();
    let started = std::time::Instant::now();
    let component = cache
        .load_or_compile(&host.engine, &bytes)
        .map_err(|reason| PluginError::Invalid {
            path: path.to_owned(),
            reason: sanitize_text(&reason, PLUGIN_TEXT_MAX_BYTES),
        })?;
    let seconds = started.elapsed().as_secs_f64();
    let already_cached = cache.hits() > hits_before;
    let (guest_interface, _line) = check_contract_version(&host.engine, path, &component)?;
    let cache_path = cache.path_for(&bytes);
    if !cache_path.is_file() {
        return Err(CompileAheadError::NotStored {
            path: path.to_owned(),
            cache_path,
        });
    }
    Ok(CompiledAhead {
        cache_path,
        already_cached,
        seconds,
        guest_interface,
    })
}
