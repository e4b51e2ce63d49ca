//! `--json`: `run`, `ab`, `tune`, `eval` and `plugin test` print one JSON document on
//! standard output and nothing else: an envelope (`format_version`, `command`, `out_dir`,
//! `files`) around the document the command writes to its file anyway.

use std::path::Path;
use std::process::Output;

use crate::support::*;

/// Standard output as the one JSON document it must be, with the envelope's keys checked.
fn document(output: &Output, command: &str) -> serde_json::Value {
    assert!(
        output.status.success(),
        "tokwatt {command} --json failed: {}",
        stderr(output)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let value: serde_json::Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON document ({e}):\n{stdout}"));
    assert_eq!(value["format_version"], 1, "{value}");
    assert_eq!(value["command"], command, "{value}");
    assert!(value["result"].is_object(), "{value}");
    assert!(value["files"].is_array(), "{value}");
    value
}

/// The envelope's files, by name.
fn file_names(value: &serde_json::Value) -> Vec<String> {
    value["files"]
        .as_array()
        .expect("files")
        .iter()
        .map(|f| {
            Path::new(f.as_str().expect("a path"))
                .file_name()
                .expect("a file name")
                .to_string_lossy()
                .into_owned()
        })
        .collect()
}

/// What the command wrote to `file` in its output folder.
fn written(value: &serde_json::Value, file: &str) -> serde_json::Value {
    let dir = Path::new(value["out_dir"].as_str().expect("out_dir"));
    let text = std::fs::read_to_string(dir.join(file)).expect("the file is written");
    serde_json::from_str(&text).expect("the file is JSON")
}

#[test]
fn run_json_prints_the_summary_and_its_files_and_nothing_else() {
    let dir = tempdir();
    let out = dir.path().join("run");
    let output = sim_run(&repo_root().join("policies/static.toml"), "20s", &out)
        .arg("--json")
        .output()
        .expect("tokwatt run");
    let value = document(&output, "run");
    assert_eq!(value["out_dir"], out.to_str().expect("utf-8"));
    let files = file_names(&value);
    for file in [
        "summary.json",
        "trace.csv",
        "observations.jsonl",
        "report.html",
    ] {
        assert!(files.iter().any(|f| f == file), "{file} in {files:?}");
    }
    // The result is summary.json, key for key.
    assert_eq!(value["result"], written(&value, "summary.json"));
    assert_eq!(value["result"]["ticks"], 20, "{}", value["result"]);
    assert!(value["result"]["tokens_per_joule"].as_f64().unwrap_or(0.0) > 0.0);
}

#[test]
fn ab_json_prints_the_verdict() {
    let dir = tempdir();
    let out = dir.path().join("ab");
    let spec = repo_root().join("policies/static.toml");
    let output = tokwatt()
        .args(["ab", "--sim", "h200", "--quiet", "--json"])
        .arg("--a")
        .arg(&spec)
        .arg("--b")
        .arg(&spec)
        .args(["--budget", "4", "--epoch", "20s", "--warmup", "5s"])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("tokwatt ab");
    let value = document(&output, "ab");
    assert_eq!(value["result"], written(&value, "ab.json"));
    for key in ["decision", "ratio_b_over_a", "ci_low", "ci_high", "pairs"] {
        assert!(value["result"].get(key).is_some(), "no {key}: {value}");
    }
    let files = file_names(&value);
    assert!(files.iter().any(|f| f == "report.html"), "{files:?}");
}

#[test]
fn tune_json_prints_the_search_and_sends_the_rounds_to_stderr() {
    let dir = tempdir();
    let out = dir.path().join("tune");
    let output = tokwatt()
        .args(["tune", "--sim", "h200", "--quiet", "--json"])
        .arg("--policy")
        .arg(repo_root().join("policies/slo-batch.toml"))
        .args([
            "--param",
            "headroom=0.85,0.9",
            "--epoch",
            "10s",
            "--warmup",
            "5s",
        ])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("tokwatt tune");
    let value = document(&output, "tune");
    assert_eq!(value["result"], written(&value, "tune.json"));
    assert!(value["result"].get("winner").is_some(), "{value}");
    assert!(stderr(&output).contains("round 1:"), "{}", stderr(&output));
}

#[test]
fn eval_json_prints_the_judgement() {
    let dir = tempdir();
    let out = dir.path().join("eval");
    let output = tokwatt()
        .args([
            "eval",
            "--quiet",
            "--json",
            "--seeds",
            "1",
            "--duration",
            "2m",
        ])
        .arg("--policies")
        .arg(repo_root().join("policies/static.toml"))
        .arg("--scenarios")
        .arg(repo_root().join("host/scenarios/eval/h200-8b-latency.toml"))
        .arg("--out")
        .arg(&out)
        .output()
        .expect("tokwatt eval");
    let value = document(&output, "eval");
    assert_eq!(value["result"], written(&value, "eval.json"));
    assert_eq!(value["result"]["entries"][0]["policy"], "static");
}

#[test]
fn plugin_test_json_prints_the_policy_beside_its_baseline_and_keeps_the_exit_status() {
    let output = tokwatt()
        .args(["plugin", "test", "--json", "--duration", "2m"])
        .arg(repo_root().join("policies/static.toml"))
        .output()
        .expect("tokwatt plugin test");
    let value = document(&output, "plugin test");
    assert!(value["out_dir"].is_null(), "{value}");
    let entries = value["result"]["entries"].as_array().expect("entries");
    assert_eq!(entries.len(), 2, "{value}");
    assert_eq!(entries[0]["policy"], "static");
    assert_eq!(entries[1]["policy"], "default");

    // A policy that cannot start: the document, then the failure's exit status.
    let dir = tempdir();
    let spec = dir.path().join("no-cap.toml");
    std::fs::write(
        &spec,
        "name = \"no-cap\"\nplugin = \"policy_hill_climb.wasm\"\nknobs = [\"batch-size\"]\n",
    )
    .expect("spec");
    let output = tokwatt()
        .args(["plugin", "test", "--json", "--duration", "2m"])
        .arg(&spec)
        .output()
        .expect("tokwatt plugin test");
    assert!(!output.status.success());
    let stdout = String::from_utf8_lossy(&output.stdout);
    let value: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON document");
    assert!(
        value["result"]["entries"][0]["failure"].is_string(),
        "{value}"
    );
    assert!(stderr(&output).contains("could not start"));
}
