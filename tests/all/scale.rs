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

/// `tokwatt eval` of `policies` on one shipped scenario, two seeds of 20 s, with `extra`
/// flags: (stdout, stderr).
fn eval(out: &std::path::Path, extra: &[&str]) -> (String, String) {
    let root = repo_root();
    let output = tokwatt()
        .args([
            "eval",
            "--seeds",
            "2",
            "--duration",
            "20s",
            "--threads",
            "2",
        ])
        .arg("--policies")
        .arg(root.join("policies/static.toml"))
        .arg(root.join("policies/hill-climb.toml"))
        .arg("--scenarios")
        .arg(root.join("host/scenarios/eval/h200-8b-latency.toml"))
        .arg("--out")
        .arg(out)
        .arg("--overwrite")
        .args(extra)
        .output()
        .expect("tokwatt eval runs");
    assert!(output.status.success(), "{}", stderr(&output));
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr(&output),
    )
}

/// The summary comes first and alone; each run's line and the per-scenario table are
/// behind --verbose and --details (issue 43 item 9: 429 lines before the summary).
#[test]
fn eval_prints_its_summary_first_and_its_details_on_request() {
    let dir = tempdir();
    let out = dir.path().join("eval");
    let (stdout, progress) = eval(&out, &[]);
    assert!(!progress.contains("[run"), "{progress}");
    assert!(!progress.contains("[oracle"), "{progress}");
    // Not a terminal: a line at each tenth of the 4 runs at most, and the two notes.
    assert!(progress.lines().count() <= 8, "{progress}");
    assert!(progress.contains("4/4 runs"), "{progress}");
    let summary = stdout
        .find("median ratio to oracle")
        .unwrap_or_else(|| panic!("no summary in:\n{stdout}"));
    assert!(
        stdout[summary..].contains("--details, or report.html"),
        "{stdout}"
    );
    // The per-scenario table (its `scenario` column) is --details'.
    assert!(!stdout.contains("┆ scenario "), "{stdout}");

    let (stdout, progress) = eval(&out, &["--details", "--verbose"]);
    assert_eq!(
        progress.lines().filter(|l| l.starts_with("[run")).count(),
        4,
        "{progress}"
    );
    let summary = stdout.find("median ratio to oracle").expect("the summary");
    let details = stdout.find("┆ scenario ").expect("the per-scenario table");
    assert!(summary < details, "the summary first:\n{stdout}");
}
