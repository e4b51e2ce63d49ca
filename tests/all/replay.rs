//! `tokwatt replay`: a recorded run's observations fed to a policy again.

use std::path::Path;

use crate::support::{built_plugin, run_sim, stderr, tempdir, tokwatt, write_spec};

/// A 20-tick run of joint-search (Thompson sampling: random and stateful) on two
/// simulated GPUs, into `out`.
fn record_joint_search(out: &Path) {
    let spec = crate::support::repo_root().join("policies/joint-search.toml");
    run_sim(&spec, "20s", out, &["--gpus", "2", "--seed", "7"]);
}

fn replay(run: &Path, spec: &Path, extra: &[&str]) -> std::process::Output {
    tokwatt()
        .arg("replay")
        .arg(run)
        .arg("--policy")
        .arg(spec)
        .args(extra)
        .output()
        .expect("tokwatt runs")
}

fn replay_json(run: &Path, spec: &Path, extra: &[&str]) -> serde_json::Value {
    let output = replay(run, spec, &[&["--json"], extra].concat());
    assert!(output.status.success(), "{}", stderr(&output));
    serde_json::from_slice(&output.stdout).expect("the replay is JSON")
}

#[test]
fn replaying_a_run_with_its_own_policy_reproduces_every_recorded_decision() {
    let dir = tempdir();
    let run = dir.path().join("run");
    record_joint_search(&run);
    let spec = crate::support::repo_root().join("policies/joint-search.toml");
    let report = replay_json(&run, &spec, &[]);
    assert_eq!(report["format_version"], 1);
    assert_eq!(report["seed"], 7);
    let ticks = report["ticks"].as_array().expect("ticks");
    assert_eq!(ticks.len(), 20);
    assert_eq!(report["totals"]["different"], 0, "{report:#}");
    assert_eq!(report["totals"]["same"], 20);
    // Not a replay of nothing: the policy moved the clocks, and the replay with it.
    let moved = ticks
        .iter()
        .filter(|tick| {
            tick["decided"]
                .as_array()
                .expect("decided")
                .iter()
                .any(|s| !s["sm_clock_max_mhz"].is_null())
        })
        .count();
    assert!(moved >= 2, "{moved} ticks changed a clock");
    for tick in ticks {
        assert_eq!(tick["decided"], tick["recorded"], "tick {}", tick["tick"]);
        assert_eq!(tick["decided"].as_array().expect("decided").len(), 2);
    }

    // The same replay twice prints the same bytes.
    let first = replay(&run, &spec, &["--ticks", "3..12"]);
    let second = replay(&run, &spec, &["--ticks", "3..12"]);
    assert!(first.status.success(), "{}", stderr(&first));
    assert_eq!(first.stdout, second.stdout);
    let text = String::from_utf8(first.stdout).expect("text");
    assert!(text.contains("tick 3 (t=4 s): same"), "{text}");
    assert!(!text.contains("tick 2 "), "{text}");
    assert!(!text.contains("tick 13 "), "{text}");
    assert!(
        text.contains("10 ticks shown (13 fed): 10 same as the run, 0 different"),
        "{text}"
    );
    assert!(
        text.contains("    log info: joint-search on 2 GPUs"),
        "{text}"
    );
}

#[test]
fn replaying_with_another_policy_prints_its_decisions_and_marks_the_differences() {
    let dir = tempdir();
    let run = dir.path().join("run");
    record_joint_search(&run);
    let spec = crate::support::repo_root().join("policies/static.toml");
    let report = replay_json(&run, &spec, &[]);
    assert_eq!(report["policy"], "static");
    assert_eq!(report["recorded_policy"], "joint-search");
    assert!(
        report["notes"][0]
            .as_str()
            .expect("a note")
            .contains("different decisions are expected")
    );
    // static's spec asks for a 500 W cap; joint-search never sets a cap.
    assert_eq!(report["init"]["settings"][0]["power_cap_w"], 500.0);
    assert_eq!(report["init"]["settings"][1]["power_cap_w"], 500.0);
    assert!(report["totals"]["different"].as_u64().expect("count") >= 1);
    let output = replay(&run, &spec, &[]);
    let text = String::from_utf8(output.stdout).expect("text");
    assert!(text.contains("init: gpu0 cap 500 W"), "{text}");
    assert!(text.contains("DIFFERS"), "{text}");
}

fn stderr_trap_spec(dir: &Path, params: &str) -> std::path::PathBuf {
    write_spec(
        dir,
        "stderr-trap",
        &built_plugin("fixture_stderr_trap"),
        &format!("[params]\n{params}"),
    )
}

#[test]
fn a_decide_that_traps_shows_the_guests_stderr_in_replay() {
    let dir = tempdir();
    let run = dir.path().join("run");
    record_joint_search(&run);
    let spec = stderr_trap_spec(dir.path(), "good_calls = \"2\"");
    let output = replay(&run, &spec, &["--ticks", "..3"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = String::from_utf8(output.stdout).expect("text");
    assert!(
        text.contains("    stderr| stderr-trap: init for 2 GPUs"),
        "{text}"
    );
    assert!(
        text.contains("    log info: stderr-trap: decide call 1 at tick 0"),
        "{text}"
    );
    assert!(
        text.contains("  fallback: the plugin trapped: wasm trap: wasm `unreachable` instruction executed (its standard error: stderr-trap: deciding tick 2\\nTraceback (most recent call last):"),
        "{text}"
    );
    // Line by line under the tick, escaped: no terminal control reaches the output.
    assert!(
        text.contains(
            "    stderr| ValueError: fixture stderr-trap: decide call 3 raises on purpose\\u{1b}[2J\n"
        ),
        "{text}"
    );
    assert!(!text.contains('\u{1b}'));
    // The run's supervisor rebuilt the instance at the next tick: so does the replay's.
    assert!(
        text.contains("    log info: stderr-trap: decide call 1 at tick 3"),
        "{text}"
    );
}

#[test]
fn an_init_that_traps_shows_the_guests_stderr_in_check() {
    let dir = tempdir();
    let spec = stderr_trap_spec(dir.path(), "trap_in = \"init\"");
    let output = tokwatt().arg("check").arg(&spec).output().expect("runs");
    assert!(!output.status.success());
    let text = stderr(&output);
    assert!(
        text.contains(
            "(its standard error: stderr-trap: init for 1 GPUs\\nTraceback (most recent call last):"
        ),
        "{text}"
    );
    assert!(
        text.contains("ValueError: fixture stderr-trap: init call 0 raises on purpose\\u{1b}[2J)"),
        "{text}"
    );
    assert!(!text.contains('\u{1b}'));
}

#[test]
fn a_bad_run_folder_is_refused_with_the_fix() {
    let dir = tempdir();
    let spec = crate::support::repo_root().join("policies/static.toml");
    let missing = replay(&dir.path().join("no-such-run"), &spec, &[]);
    assert!(!missing.status.success());
    assert!(
        stderr(&missing).contains("is not a run's output folder: it has no summary.json"),
        "{}",
        stderr(&missing)
    );

    let run = dir.path().join("run");
    record_joint_search(&run);
    let summary_path = run.join("summary.json");
    let summary = std::fs::read_to_string(&summary_path).expect("summary");
    let mut foreign: serde_json::Value = serde_json::from_str(&summary).expect("json");
    foreign["format_version"] = 99.into();
    std::fs::write(&summary_path, foreign.to_string()).expect("write");
    let refused = replay(&run, &spec, &[]);
    assert!(!refused.status.success());
    let text = stderr(&refused);
    assert!(
        text.contains("summary.json is in summary.json format version 99, and this tokwatt reads version 1: replay it with the tokwatt version that recorded it"),
        "{text}"
    );
    assert!(refused.stdout.is_empty());

    std::fs::write(&summary_path, &summary).expect("put back");
    let observations_path = run.join("observations.jsonl");
    let observations = std::fs::read_to_string(&observations_path).expect("observations");
    let last = observations.lines().last().expect("a line");
    let changed = last.replacen("\"format_version\":1", "\"format_version\":2", 1);
    assert_ne!(changed, last);
    std::fs::write(&observations_path, format!("{observations}{changed}\n")).expect("write");
    let refused = replay(&run, &spec, &[]);
    let text = stderr(&refused);
    assert!(!refused.status.success());
    assert!(
        text.contains("observations.jsonl is in observations.jsonl format version 2"),
        "{text}"
    );

    std::fs::write(&observations_path, format!("{observations}{{not json\n")).expect("write");
    let damaged = replay(&run, &spec, &[]);
    assert!(!damaged.status.success());
    assert!(
        stderr(&damaged).contains(&format!(
            "is damaged at line {}",
            observations.lines().count() + 1
        )),
        "{}",
        stderr(&damaged)
    );
}
