//! `PolicySpec::parse` on arbitrary text: an error or a spec, never a panic.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use tokwatt_policy::spec::PolicySpec;

fuzz_target!(|text: &str| {
    if let Ok(spec) = PolicySpec::parse(Path::new("/fuzz/spec.toml"), text) {
        // What a parsed spec promises.
        assert!((10..=3_600_000).contains(&spec.tick_ms));
        // Resolving the plugin only looks at paths; a missing file is an error.
        let _ = spec.resolve_plugin(&[]);
    }
});
