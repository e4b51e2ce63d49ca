//! `report.html`: every run writes one beside its trace, and `tokwatt report` renders it
//! again from a run folder.

use std::path::Path;

use crate::support::*;

/// The charts of one GPU, by title, when the workload reports demand (the simulator does).
const PANELS: [&str; 9] = [
    "power and the power cap in force",
    "tokens per joule, rolling over 10 ticks",
    "SM clock: limit in force (lock) and actual",
    "batch size in force",
    "time per output token",
    "requests per tick",
    "queue wait for a batch slot",
    "time to first token",
    "energy per finished request, mean per tick",
];

/// A spec for the static policy whose name is markup, with an objective.
fn hostile_name_spec(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("spec.toml");
    let text = format!(
        "name = \"<script>alert(1)</script>\"\nplugin = \"{}\"\nknobs = [\"power-cap\"]\n\
         [params]\npower_cap_w = \"450\"\n\
         [objective]\ntpot_p99_limit_ms = 40.0\nqueue_wait_p99_limit_ms = 900.0\n",
        built_plugin("policy_static").display()
    );
    std::fs::write(&path, text).expect("write spec");
    path
}

/// A small check that the page is well formed: every element opened is closed, in order
/// (HTML's void elements excepted), and nothing runs or loads from elsewhere.
fn assert_well_formed(html: &str) {
    assert!(html.starts_with("<!DOCTYPE html>"), "doctype");
    assert!(html.trim_end().ends_with("</html>"), "ends with </html>");
    let mut open: Vec<&str> = Vec::new();
    let mut rest = html;
    while let Some(start) = rest.find('<') {
        rest = &rest[start + 1..];
        let end = rest.find('>').expect("every tag is closed by >");
        let tag = &rest[..end];
        rest = &rest[end + 1..];
        if tag.starts_with('!') || tag.ends_with('/') {
            continue;
        }
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(open.pop(), Some(name), "closing </{name}> out of order");
        } else {
            let name = tag.split_whitespace().next().expect("tag name");
            if name != "meta" {
                open.push(name);
            }
        }
    }
    assert!(open.is_empty(), "left open: {open:?}");
    for outside in ["<script", "src=", "href=", "<link", "url("] {
        assert!(!html.contains(outside), "the page has {outside}");
    }
}

/// The part of the page about one GPU: from its heading to the next.
fn gpu_section(html: &str, gpu: u32) -> &str {
    let heading = format!("<h2>GPU {gpu}</h2>");
    let start = html
        .find(&heading)
        .unwrap_or_else(|| panic!("no {heading}"));
    let after = &html[start + heading.len()..];
    &after[..after.find("<h2>").unwrap_or(after.len())]
}

#[test]
fn a_simulated_run_writes_a_report_with_each_panel_for_each_gpu() {
    let dir = tempdir();
    let spec = hostile_name_spec(dir.path());
    let out = dir.path().join("run");
    let r = run_sim(&spec, "2m", &out, &["--gpus", "2"]);
    let html = std::fs::read_to_string(out.join("report.html")).expect("report.html written");
    assert_well_formed(&html);
    assert!(html.contains("<h2>Summary</h2>"), "the summary section");

    // The policy's name is text, never markup.
    assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    // Simulator output says so, with the run's data source.
    let source = r.summary["data_source"].as_str().expect("data_source");
    assert!(html.contains("Simulator output"), "simulator label");
    assert!(html.contains(&tokwatt_report::escape(source)), "{source}");
    // The headline figures are the summary's.
    let tpj = num(&r.summary, "tokens_per_joule");
    for figure in [
        format!("<td>tokens per joule</td><td>{tpj:.4}</td>"),
        format!("<td>tokens</td><td>{}</td>", num(&r.summary, "tokens")),
        format!(
            "<td>SLO violation ticks</td><td>{}</td>",
            num(&r.summary, "slo_violation_ticks")
        ),
        format!(
            "<td>fallback ticks</td><td>{} (plugin traps 0)",
            num(&r.summary, "fallback_ticks")
        ),
        "<td>served fraction</td>".to_owned(),
        "TPOT p99 at most 40 ms; queue wait p99 at most 900 ms".to_owned(),
    ] {
        assert!(html.contains(&figure), "{figure}");
    }

    for gpu in 0..2 {
        let section = gpu_section(&html, gpu);
        assert_eq!(section.matches("<svg").count(), PANELS.len(), "GPU {gpu}");
        for panel in PANELS {
            let title = format!("aria-label=\"GPU {gpu}: {panel}");
            assert_eq!(section.matches(&title).count(), 1, "{title}");
        }
        // The objective's limits are drawn where they apply.
        assert_eq!(section.matches(">p99 limit (objective)</text>").count(), 2);
        // The enforced cap is drawn with the power.
        assert!(section.contains(">power cap (enforced)</text>"));
    }
    assert!(!html.contains("<h2>GPU 2</h2>"));
}

#[test]
fn tokwatt_report_renders_a_run_folder_again() {
    let dir = tempdir();
    let spec = hostile_name_spec(dir.path());
    let out = dir.path().join("run");
    run_sim(&spec, "30s", &out, &[]);
    let written = std::fs::read_to_string(out.join("report.html")).expect("report");
    std::fs::remove_file(out.join("report.html")).expect("remove");

    let output = tokwatt().arg("report").arg(&out).output().expect("runs");
    assert!(output.status.success(), "{}", stderr(&output));
    let again = std::fs::read_to_string(out.join("report.html")).expect("report again");
    assert_well_formed(&again);
    assert_eq!(
        again.matches("<svg").count(),
        written.matches("<svg").count()
    );
    // The objective comes from the run's own summary.json.
    assert!(
        !again.contains("read from the spec file"),
        "objective source"
    );
    assert!(again.contains("TPOT p99 at most 40 ms"));

    let elsewhere = dir.path().join("copy.html");
    let output = tokwatt()
        .arg("report")
        .arg(&out)
        .arg("--out")
        .arg(&elsewhere)
        .output()
        .expect("runs");
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(std::fs::read_to_string(&elsewhere).expect("copy"), again);

    // A folder without a run says what is missing.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).expect("mkdir");
    let output = tokwatt().arg("report").arg(&empty).output().expect("runs");
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("summary.json"),
        "{}",
        stderr(&output)
    );

    // A summary from before it recorded the objective: the spec file gives it, and the
    // page says so.
    let summary_path = out.join("summary.json");
    let mut summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&summary_path).expect("summary"))
            .expect("json");
    summary.as_object_mut().expect("object").remove("objective");
    std::fs::write(&summary_path, summary.to_string()).expect("write");
    std::fs::remove_file(out.join("report.html")).expect("remove");
    let output = tokwatt().arg("report").arg(&out).output().expect("runs");
    assert!(output.status.success(), "{}", stderr(&output));
    let older = std::fs::read_to_string(out.join("report.html")).expect("report");
    assert!(
        older.contains("read from the spec file"),
        "objective source"
    );
    assert!(older.contains("TPOT p99 at most 40 ms"));
}

#[test]
fn an_earlier_runs_report_is_not_replaced_unless_asked() {
    let dir = tempdir();
    let out = dir.path().join("run");
    std::fs::create_dir(&out).expect("mkdir");
    std::fs::write(out.join("report.html"), "an earlier run's report").expect("write");
    let spec = repo_root().join("policies/static.toml");
    let output = sim_run(&spec, "3s", &out).output().expect("runs");
    assert!(!output.status.success(), "refused");
    assert!(
        stderr(&output).contains("report.html"),
        "{}",
        stderr(&output)
    );
    assert_eq!(
        std::fs::read_to_string(out.join("report.html")).expect("kept"),
        "an earlier run's report"
    );
    run_sim(&spec, "3s", &out, &["--overwrite"]);
    let report = std::fs::read_to_string(out.join("report.html")).expect("replaced");
    assert!(report.contains("tokwatt run report: static"));
}
