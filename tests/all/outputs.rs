//! The output files are an API boundary: their layouts are pinned here. Changing a key
//! or a column means raising the file's format version (see `tokwatt::recorder`).

use crate::support::*;

#[test]
fn summary_keys_are_stable() {
    let dir = tempdir();
    let spec = repo_root().join("policies/static.toml");
    let r = run_sim(&spec, "5s", &dir.path().join("run"), &["--gpus", "2"]);
    let object = r.summary.as_object().expect("summary is an object");
    let mut keys: Vec<&str> = object.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "actuator",
            "actuator_errors",
            "clamped_decisions",
            "data_source",
            "demand",
            "duration_s",
            "energy_j",
            "fallback_ticks",
            "format_version",
            "gpu_count",
            "gpu_name",
            "gpu_profile",
            "gpus",
            "interrupted",
            "non_finite_values",
            "objective",
            "output_formats",
            "plugin",
            "plugin_traps",
            "policy",
            "policy_counters",
            "policy_spec",
            "seed",
            "settings_changes",
            "simulated",
            "slo_violation_ticks",
            "swaps",
            "telemetry_errors",
            "tick_ms",
            "ticks",
            "tokens",
            "tokens_per_joule",
            "wall_time_s",
            "workload",
        ],
        "summary.json's keys changed: raise SUMMARY_FORMAT_VERSION and update this list"
    );
    assert_eq!(r.summary["format_version"], 1);
    assert_eq!(r.summary["output_formats"]["trace_csv"], 1);
    assert_eq!(r.summary["output_formats"]["observations_jsonl"], 1);
    assert_eq!(r.summary["gpu_count"], 2);
    assert_eq!(r.summary["gpus"].as_array().map(Vec::len), Some(2));
}

#[test]
fn the_summary_has_no_key_twice() {
    // serde_json keeps the last of two equal keys, so read the raw text.
    let dir = tempdir();
    let spec = repo_root().join("policies/static.toml");
    let out = dir.path().join("run");
    run_sim(&spec, "3s", &out, &[]);
    let text = std::fs::read_to_string(out.join("summary.json")).expect("summary");
    let top_level_keys: Vec<&str> = text
        .lines()
        .filter(|line| line.starts_with("  \"") && !line.starts_with("   "))
        .filter_map(|line| line.trim().split('"').nth(1))
        .collect();
    let mut unique = top_level_keys.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(
        unique.len(),
        top_level_keys.len(),
        "a key appears twice: {top_level_keys:?}"
    );
}

#[test]
fn trace_header_and_observation_lines_carry_their_format() {
    let dir = tempdir();
    let spec = repo_root().join("policies/static.toml");
    let out = dir.path().join("run");
    run_sim(&spec, "3s", &out, &[]);
    let trace = std::fs::read_to_string(out.join("trace.csv")).expect("trace");
    let header = trace.lines().next().expect("header");
    assert_eq!(header, tokwatt::recorder::trace_header().join(","));
    let observations = std::fs::read_to_string(out.join("observations.jsonl")).expect("jsonl");
    for line in observations.lines() {
        let record: serde_json::Value = serde_json::from_str(line).expect("JSON line");
        assert_eq!(record["format_version"], 1, "{line}");
    }
}
