//! Bad input gets a clear error naming the problem, and never a panic.

use std::path::Path;

use crate::support::*;

fn fails_with(args: &[&str], expected: &[&str]) {
    let output = tokwatt().args(args).output().expect("runs");
    let err = stderr(&output);
    assert!(!output.status.success(), "{args:?} should fail");
    assert!(!err.contains("thread 'main' panicked"), "{err}");
    for needle in expected {
        assert!(
            err.contains(needle),
            "error for {args:?} should mention {needle:?}: {err}"
        );
    }
}

#[test]
fn missing_spec_file() {
    fails_with(
        &["run", "--sim", "h200", "--policy", "/nonexistent/spec.toml"],
        &["/nonexistent/spec.toml"],
    );
}

#[test]
fn bad_toml() {
    let dir = tempdir();
    let spec = dir.path().join("bad.toml");
    std::fs::write(&spec, "name = \"x\"\nplugin = [oops").expect("write");
    let spec = spec.to_string_lossy().into_owned();
    fails_with(
        &["run", "--sim", "h200", "--policy", &spec],
        &["bad.toml", "not valid"],
    );
}

#[test]
fn plugin_that_is_not_a_component() {
    let dir = tempdir();
    let text = dir.path().join("text.wasm");
    std::fs::write(&text, "this is not wasm").expect("write");
    let spec = write_spec(dir.path(), "text", &text, "");
    fails_with(
        &["run", "--sim", "h200", "--policy", &spec.to_string_lossy()],
        &["not a WebAssembly file"],
    );

    let core = dir.path().join("core.wasm");
    std::fs::write(&core, b"\0asm\x01\0\0\0").expect("write");
    let spec = write_spec(dir.path(), "core", &core, "");
    fails_with(
        &["run", "--sim", "h200", "--policy", &spec.to_string_lossy()],
        &["core WebAssembly module", "wasm32-wasip2"],
    );
}

#[test]
fn missing_plugin() {
    let dir = tempdir();
    let spec = write_spec(dir.path(), "gone", &dir.path().join("gone.wasm"), "");
    fails_with(
        &["run", "--sim", "h200", "--policy", &spec.to_string_lossy()],
        &["gone.wasm", "not found"],
    );
}

#[test]
fn unknown_gpu_profile() {
    let spec = repo_root().join("policies/static.toml");
    fails_with(
        &["run", "--sim", "b300", "--policy", &spec.to_string_lossy()],
        &["b300", "h200"],
    );
}

#[test]
fn bad_duration() {
    let spec = repo_root().join("policies/static.toml");
    fails_with(
        &[
            "run",
            "--sim",
            "h200",
            "--duration",
            "ten minutes",
            "--policy",
            &spec.to_string_lossy(),
        ],
        &["duration"],
    );
}

#[test]
fn gpu_commands_without_a_driver_say_so() {
    if Path::new("/proc/driver/nvidia").exists() {
        println!(
            "skipping: an NVIDIA driver is present, so the no-driver message cannot be checked here"
        );
        return;
    }
    let spec = repo_root().join("policies/hill-climb.toml");
    let spec = spec.to_string_lossy();
    for args in [
        vec!["gpus"],
        vec!["bench", "workload"],
        vec![
            "run",
            "--gpu",
            "0",
            "--dry-run",
            "--duration",
            "10s",
            "--policy",
            &spec,
        ],
    ] {
        fails_with(&args, &["NVIDIA driver", "simulated GPU"]);
    }
}
