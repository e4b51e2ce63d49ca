//! Output that scales (issue 43 item 9): `tokwatt run` on 64 simulated GPUs keeps its
//! progress and summary lines short, and `tokwatt eval` puts its summary first and its
//! per-run lines and per-scenario table behind flags.

use crate::support::*;

/// The longest line of `text`, in characters.
fn longest(text: &str) -> usize {
    text.lines().map(|l| l.chars().count()).max().unwrap_or(0)
}

#[test]
fn a_run_on_64_gpus_prints_short_lines_with_the_nodes_sums_and_extremes() {
    let dir = tempdir();
    let out = dir.path().join("run");
    let output = tokwatt()
        .args(["run", "--sim", "h200", "--gpus", "64", "--duration", "20s"])
        .arg("--policy")
        .arg(repo_root().join("policies/static.toml"))
        .arg("--out")
        .arg(&out)
        .output()
        .expect("tokwatt runs");
    let (progress, summary) = (stderr(&output), String::from_utf8_lossy(&output.stdout));
    assert!(output.status.success(), "{progress}");
    // Each progress report: the totals, then the node's sums and extremes (once 64
    // GPUs' settings made a line of 1,247 characters).
    let reports: Vec<&str> = progress.lines().filter(|l| l.starts_with('[')).collect();
    assert!(reports.len() >= 5, "{progress}");
    let nodes: Vec<&str> = progress
        .lines()
        .filter(|l| l.contains("64 GPUs: caps"))
        .collect();
    assert_eq!(nodes.len(), reports.len(), "{progress}");
    assert!(
        longest(&reports.join("\n")) < 160 && longest(&nodes.join("\n")) < 160,
        "{progress}"
    );
    assert!(progress.contains("tok/J worst"), "{progress}");
    // The summary: the spread and extremes, not 64 rows.
    assert!(!summary.contains("gpu 63"), "{summary}");
    assert!(
        summary.contains("64 GPUs") && summary.contains("final settings"),
        "{summary}"
    );
    assert!(summary.lines().count() < 25, "{summary}");
    let written: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).expect("summary.json"),
    )
    .expect("JSON");
    assert_eq!(written["gpus"].as_array().map(Vec::len), Some(64));
}
