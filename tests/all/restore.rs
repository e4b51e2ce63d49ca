//! Invariant 3: every setting the agent changed is restored on exit (normal, SIGINT,
//! SIGTERM, panic), and after a crash (`kill -9`) by the next start or `tokwatt restore`,
//! from a state file written before the first change. Driven on the simulated GPU.

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::support::*;

/// A run on the simulator against the wall clock, so there is time to interrupt it.
fn spawn_realtime(state: &Path, out: &Path) -> Child {
    tokwatt()
        .args([
            "run",
            "--sim",
            "h200",
            "--realtime",
            "--quiet",
            "--duration",
            "120s",
            "--tick",
            "100ms",
        ])
        .arg("--policy")
        .arg(repo_root().join("policies/hill-climb.toml"))
        .arg("--state-file")
        .arg(state)
        .arg("--out")
        .arg(out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tokwatt starts")
}

/// Wait (generously) for the run to save the original settings.
fn wait_for_state_file(state: &Path, child: &mut Child) {
    let start = Instant::now();
    while !state.exists() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("tokwatt exited early: {status}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no state file written"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Let a few ticks pass so settings have changed.
    std::thread::sleep(Duration::from_millis(1500));
}

fn signal(child: &Child, name: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
}

#[test]
fn sigterm_and_sigint_restore_and_clear_the_state_file() {
    for sig in ["TERM", "INT"] {
        let dir = tempdir();
        let state = dir.path().join("state.json");
        let mut child = spawn_realtime(&state, &dir.path().join("out"));
        wait_for_state_file(&state, &mut child);
        signal(&child, sig);
        let output = child.wait_with_output().expect("exits");
        assert!(output.status.success(), "SIG{sig}: {}", stderr(&output));
        assert!(
            !state.exists(),
            "SIG{sig}: settings restored, state file cleared"
        );
        let summary: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("out/summary.json")).expect("summary"),
        )
        .expect("json");
        assert_eq!(summary["interrupted"], true);
    }
}

#[test]
fn kill_9_leaves_the_state_file_and_restore_puts_settings_back() {
    let dir = tempdir();
    let state = dir.path().join("state.json");
    let mut child = spawn_realtime(&state, &dir.path().join("out"));
    wait_for_state_file(&state, &mut child);
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    assert!(state.exists(), "a crash leaves the saved originals behind");
    let saved = std::fs::read_to_string(&state).expect("state");
    assert!(saved.contains("SIM-"), "GPUs are keyed by UUID: {saved}");

    let output = tokwatt()
        .args(["restore", "--sim", "h200", "--state-file"])
        .arg(&state)
        .output()
        .expect("runs");
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(!state.exists(), "restored, state file cleared");
    let again = tokwatt()
        .args(["restore", "--sim", "h200", "--state-file"])
        .arg(&state)
        .output()
        .expect("runs");
    assert!(again.status.success());
    assert!(String::from_utf8_lossy(&again.stdout).contains("nothing to restore"));
}

#[test]
fn the_next_start_restores_what_a_crash_left() {
    let dir = tempdir();
    let state = dir.path().join("state.json");
    let mut child = spawn_realtime(&state, &dir.path().join("crashed"));
    wait_for_state_file(&state, &mut child);
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    assert!(state.exists());

    let r = run_sim(
        &repo_root().join("policies/static.toml"),
        "30s",
        &dir.path().join("next"),
        &["--state-file", &state.to_string_lossy()],
    );
    assert_eq!(num(&r.summary, "ticks"), 30.0);
    assert!(
        !state.exists(),
        "the next run restored the leftovers, then its own settings"
    );
}

#[test]
fn a_panic_restores_settings() {
    let dir = tempdir();
    let state = dir.path().join("state.json");
    let output = tokwatt()
        .args([
            "run",
            "--sim",
            "h200",
            "--quiet",
            "--duration",
            "1m",
            "--debug-panic-after-ticks",
            "5",
        ])
        .arg("--policy")
        .arg(repo_root().join("policies/hill-climb.toml"))
        .arg("--state-file")
        .arg(&state)
        .arg("--out")
        .arg(dir.path().join("out"))
        .output()
        .expect("runs");
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("panicking on purpose"),
        "{}",
        stderr(&output)
    );
    assert!(
        !state.exists(),
        "unwinding restored the settings and cleared the state file"
    );
}
