//! `tokwatt report A B C`: run folders side by side, each against the run with the
//! default settings.

use std::path::{Path, PathBuf};

use crate::support::*;

/// Runs `policy` (a shipped spec) for `duration` into `dir/name`.
fn run(dir: &Path, name: &str, policy: &str, duration: &str) -> PathBuf {
    let out = dir.join(name);
    run_sim(
        &repo_root().join(format!("policies/{policy}.toml")),
        duration,
        &out,
        &[],
    );
    out
}

#[test]
fn several_runs_side_by_side_with_the_saving_against_the_default_settings() {
    let dir = tempdir();
    let static_run = run(dir.path(), "static", "static", "60s");
    let default_run = run(dir.path(), "default", "default", "60s");
    let output = tokwatt()
        .arg("report")
        .args([&static_run, &default_run])
        .arg("--json")
        .output()
        .expect("tokwatt report");
    assert!(output.status.success(), "{}", stderr(&output));
    let value: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("one JSON document");
    assert_eq!(value["command"], "report");
    let c = &value["result"];
    assert_eq!(c["format_version"], 1);
    // Found by itself: the one run of the `default` policy.
    assert_eq!(c["baseline"], default_run.to_str().expect("utf-8"));
    let runs = c["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0]["policy"], "static");
    assert!(runs[1]["vs_baseline"].is_null(), "the baseline itself");
    let summary = |dir: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).expect("read"))
            .expect("JSON")
    };
    let (s, d) = (summary(&static_run), summary(&default_run));
    assert_eq!(runs[0]["tokens"], s["tokens"]);
    assert_eq!(runs[0]["energy_j"], s["energy_j"]);
    let ratio = s["tokens_per_joule"].as_f64().expect("tok/J")
        / d["tokens_per_joule"].as_f64().expect("tok/J");
    let vs = &runs[0]["vs_baseline"];
    assert!(
        (vs["tokens_per_joule_ratio"].as_f64().expect("ratio") - ratio).abs() < 1e-9,
        "{vs}"
    );
    // The static policy's 500 W cap saves energy on this work against the board default.
    assert!(ratio > 1.0, "{ratio}");
    assert!(vs["energy_saved_j"].as_f64().expect("J") > 0.0, "{vs}");
    assert_eq!(vs["at_equal_service"], true, "{vs}");

    // The table, and the page where asked, name the baseline.
    let page = dir.path().join("compare.html");
    let output = tokwatt()
        .arg("report")
        .args([&static_run, &default_run])
        .arg("--baseline")
        .arg(&default_run)
        .arg("--out")
        .arg(&page)
        .output()
        .expect("tokwatt report");
    assert!(output.status.success(), "{}", stderr(&output));
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(
        table.contains("baseline") && table.contains("tok/J"),
        "{table}"
    );
    assert!(table.contains("named with --baseline"), "{table}");
    let html = std::fs::read_to_string(&page).expect("the page");
    assert!(html.contains("Simulator output") && html.contains("static"));
}

#[test]
fn a_baseline_outside_the_comparison_and_a_folder_without_a_run_are_refused() {
    let dir = tempdir();
    let a = run(dir.path(), "a", "static", "10s");
    let output = tokwatt()
        .arg("report")
        .arg(&a)
        .arg(&a)
        .arg("--baseline")
        .arg(dir.path())
        .output()
        .expect("tokwatt report");
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("is not one of the folders compared"),
        "{}",
        stderr(&output)
    );
    let output = tokwatt()
        .arg("report")
        .arg(&a)
        .arg(dir.path())
        .output()
        .expect("tokwatt report");
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("no summary.json"),
        "{}",
        stderr(&output)
    );
}
