//! The plugin loader on arbitrary bytes: `PluginHost::load` returns an error (or, for a
//! byte string that happens to be a valid policy, a plugin), never panics.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tokwatt_plugin::{HostConfig, PluginHost, SandboxLimits};

fn host() -> &'static PluginHost {
    static HOST: OnceLock<PluginHost> = OnceLock::new();
    // No cache: every input is compiled, and nothing is written outside the temp file.
    HOST.get_or_init(|| PluginHost::new(&HostConfig { cache_dir: None }).expect("engine"))
}

fn scratch() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        std::env::temp_dir().join(format!("tokwatt-fuzz-plugin-{}.wasm", std::process::id()))
    })
}

fuzz_target!(|bytes: &[u8]| {
    let path = scratch();
    if std::fs::write(path, bytes).is_err() {
        return;
    }
    let _ = host().load(path, "fuzz", SandboxLimits::default());
});
