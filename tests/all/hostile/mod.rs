//! Hostile plugins: each failure costs a tick, never the run, never drives the GPU
//! outside its envelope, is counted and named in `summary.json`'s `policy_counters`, and
//! repeated failures eject. Plugins that cannot be loaded are refused before the run, with
//! a reason an operator can act on and nothing raw from the plugin.
//!
//! Most kinds come from `plugins/fixtures/hostile`, one behaviour per `mode` parameter;
//! `synth` builds components no Rust guest can be.

mod answers;
mod blocking;
mod limits;
mod loading;
mod state;
mod synth;
mod text;

use std::path::Path;
use std::process::Output;

use crate::support::*;

pub fn run_fixture(fixture: &str, duration: &str, extra: &str) -> RunResult {
    let dir = tempdir();
    let spec = write_spec(dir.path(), fixture, &built_plugin(fixture), extra);
    let out = dir.path().join("out");
    run_sim(&spec, duration, &out, &[])
}

/// `params` TOML lines for the hostile fixture's `mode`, then `extra`.
pub fn hostile_extra(mode: &str, extra: &str) -> String {
    format!("[params]\nmode = \"{mode}\"\n{extra}")
}

/// Run the hostile fixture in `mode`.
pub fn run_hostile(mode: &str, duration: &str, extra: &str) -> RunResult {
    run_fixture("fixture_hostile", duration, &hostile_extra(mode, extra))
}

pub fn counters(r: &RunResult) -> &serde_json::Value {
    &r.summary["policy_counters"]
}

/// How many failures of `kind` the run counted, by name.
pub fn failures(r: &RunResult, kind: &str) -> f64 {
    counters(r)["failures_by_kind"][kind]
        .as_f64()
        .unwrap_or(0.0)
}

/// `tokwatt run` on a spec for `plugin` that is expected not to start.
pub fn run_refused(plugin: &Path, extra: &str) -> Output {
    let dir = tempdir();
    let spec = write_spec(dir.path(), "refused", plugin, extra);
    let output = sim_run(&spec, "5s", &dir.path().join("out"))
        .output()
        .expect("runs");
    assert!(!output.status.success(), "{}", stderr(&output));
    assert!(
        !stderr(&output).contains("thread 'main' panicked"),
        "{}",
        stderr(&output)
    );
    assert_no_raw_text(&stderr(&output));
    output
}

/// Nothing a plugin wrote reached the terminal raw: no escape character, no forged line,
/// no flood.
pub fn assert_no_raw_text(err: &str) {
    assert!(
        !err.contains('\u{1b}'),
        "an escape code reached stderr: {err:?}"
    );
    assert!(
        !err.lines().any(|line| line.starts_with("ERROR fake line")),
        "a forged line: {err}"
    );
    assert!(err.len() < 64 * 1024, "stderr has {} bytes", err.len());
}

/// A plugin file written into a temp folder.
pub fn plugin_file(dir: &Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("write plugin");
    path
}
