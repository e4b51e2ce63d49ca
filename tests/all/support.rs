//! Helpers: run the binary, read its outputs, write throwaway specs.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn tokwatt() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tokwatt"));
    // Keep compiled plugins inside the test's target folder, not in the user's cache.
    cmd.env(
        "TOKWATT_CACHE_DIR",
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("component-cache"),
    );
    cmd.env_remove("RUST_LOG");
    cmd
}

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("host/ has a parent")
        .to_owned()
}

pub fn built_plugin(name: &str) -> PathBuf {
    let path = tokwatt_plugin_artifacts::built_plugin_dir().join(format!("{name}.wasm"));
    assert!(
        path.is_file(),
        "{} was not built by the plugin-artifacts crate's build script",
        path.display()
    );
    path
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("tokwatt-e2e-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("temp dir")
}

/// A spec for `plugin` granting all knobs, with the given extra TOML appended.
pub fn write_spec(dir: &Path, name: &str, plugin: &Path, extra: &str) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    let text = format!(
        "name = \"{name}\"\nplugin = \"{}\"\nknobs = [\"power-cap\", \"sm-clock\", \"batch-size\"]\n{extra}\n",
        plugin.display()
    );
    std::fs::write(&path, text).expect("write spec");
    path
}

#[derive(Debug)]
pub struct RunResult {
    pub summary: serde_json::Value,
    pub trace: Vec<TraceRow>,
}

#[derive(Debug, Clone)]
pub struct TraceRow {
    pub fields: std::collections::HashMap<String, String>,
}

impl TraceRow {
    pub fn f64(&self, key: &str) -> f64 {
        self.fields[key]
            .parse()
            .unwrap_or_else(|_| panic!("{key} is not a number"))
    }
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The arguments of `tokwatt run --sim h200 --quiet --duration DURATION --policy SPEC
/// --out OUT`, for a command that is not [`tokwatt`] (one wrapped in `time`, say).
pub fn sim_run_args(spec: &Path, duration: &str, out: &Path) -> Vec<OsString> {
    let mut args: Vec<OsString> = ["run", "--sim", "h200", "--quiet", "--duration", duration]
        .into_iter()
        .map(OsString::from)
        .collect();
    args.extend(["--policy".into(), spec.into(), "--out".into(), out.into()]);
    args
}

/// `tokwatt run` of `spec` on one simulated H200 for `duration`, writing into `out`:
/// add flags, then run it.
pub fn sim_run(spec: &Path, duration: &str, out: &Path) -> Command {
    let mut cmd = tokwatt();
    cmd.args(sim_run_args(spec, duration, out));
    cmd
}

/// Run [`sim_run`] with `args`, expecting success.
pub fn run_sim(spec: &Path, duration: &str, out: &Path, args: &[&str]) -> RunResult {
    let output = sim_run(spec, duration, out)
        .args(args)
        .output()
        .expect("tokwatt runs");
    assert!(
        output.status.success(),
        "tokwatt run failed: {}\n{}",
        output.status,
        stderr(&output)
    );
    assert!(
        !stderr(&output).contains("thread 'main' panicked"),
        "{}",
        stderr(&output)
    );
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).expect("summary.json written"),
    )
    .expect("summary.json is JSON");
    RunResult {
        summary,
        trace: read_trace(&out.join("trace.csv")),
    }
}

pub fn read_trace(path: &Path) -> Vec<TraceRow> {
    let text = std::fs::read_to_string(path).expect("trace.csv written");
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    lines
        .map(|line| TraceRow {
            fields: header
                .iter()
                .zip(line.split(','))
                .map(|(k, v)| ((*k).to_owned(), v.to_owned()))
                .collect(),
        })
        .collect()
}

pub fn num(summary: &serde_json::Value, key: &str) -> f64 {
    summary[key]
        .as_f64()
        .unwrap_or_else(|| panic!("summary.{key} missing: {summary}"))
}

/// The checks every completed run must pass.
pub fn assert_run_sound(r: &RunResult, expected_ticks: u64) {
    let s = &r.summary;
    assert_eq!(num(s, "ticks") as u64, expected_ticks, "ran on schedule");
    assert_eq!(s["simulated"], serde_json::Value::Bool(true));
    assert_eq!(s["gpu_profile"], "h200");
    let tokens = num(s, "tokens");
    let energy = num(s, "energy_j");
    assert!(energy > 0.0);
    let tpj = num(s, "tokens_per_joule");
    assert!(
        (tpj - tokens / energy).abs() <= 1e-9 * tpj.max(1.0),
        "tokens_per_joule {tpj} != tokens / energy_j {}",
        tokens / energy
    );
    for key in [
        "duration_s",
        "fallback_ticks",
        "plugin_traps",
        "slo_violation_ticks",
    ] {
        assert!(s[key].is_number(), "summary lacks {key}");
    }
    assert!(s["policy"].is_string());
    assert_eq!(
        r.trace.len() as u64,
        expected_ticks,
        "one trace row per tick per GPU"
    );
    // The envelope held on every tick: the H200's constraints.
    for row in &r.trace {
        let cap = row.f64("power_cap_w");
        assert!(
            (200.0..=700.0).contains(&cap),
            "cap {cap} outside the device range"
        );
        let clock = row.f64("sm_clock_max_mhz");
        assert!((345.0..=1980.0).contains(&clock), "clock {clock}");
        let batch = row.f64("batch_size");
        assert!((1.0..=512.0).contains(&batch), "batch {batch}");
    }
}

pub use tokwatt_test_support::{required, run_slow, skip_unless_required};

/// `tool`'s name when `tool --version` runs, or `None` after printing why the test is
/// skipped. Where [`required`]`(require)` a missing tool fails the test instead.
#[track_caller]
pub fn required_tool(tool: &'static str, require: &str, install: &str) -> Option<&'static str> {
    let found = Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if found {
        return Some(tool);
    }
    skip_unless_required(require, format!("{tool} is not installed ({install})"));
    None
}

/// A child process (an agent, a fence, a coordinator) killed when its test ends, a failed
/// assertion too, so none outlives its test.
pub struct Running(pub std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Running {
    /// Sends it a signal by name (`STOP`, `CONT`, `KILL`), through kill(1).
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.0.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -{name}");
    }

    /// Fails the test, with its log, where `what` has exited.
    pub fn assert_alive(&mut self, what: &str, log: &Path) {
        if let Some(status) = self.0.try_wait().expect("status") {
            panic!(
                "{what} exited ({status}): {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
    }
}
