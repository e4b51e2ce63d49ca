//! The policy plugins this build made: every crate under `policies/` and
//! `plugins/fixtures/`, built as WebAssembly components by this crate's build script (a
//! nested `cargo build --target wasm32-wasip2 --profile plugin` into
//! `<workspace>/target/plugins`). The agent looks for shipped policies here last; tests load
//! fixtures from here.

use std::path::{Path, PathBuf};

/// The folder the build put the shipped and fixture plugins in.
pub fn built_plugin_dir() -> PathBuf {
    PathBuf::from(env!("TOKWATT_BUILT_PLUGIN_DIR"))
}

/// The plugin `name` (a crate name with underscores, `policy_static`), for tests and
/// benchmarks: from `$TOKWATT_PLUGIN_DIR` when it is there, so a test binary also runs from
/// a bundle on another machine (scripts/gpu-bundle.sh ships the fixtures), else from the
/// build's folder.
pub fn built_plugin(name: &str) -> PathBuf {
    let file = format!("{name}.wasm");
    std::env::var_os("TOKWATT_PLUGIN_DIR")
        .map(|dir| Path::new(&dir).join(&file))
        .filter(|path| path.is_file())
        .unwrap_or_else(|| built_plugin_dir().join(file))
}
