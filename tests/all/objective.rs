//! The objective in force (issue 54 item 3): `run`, `ab` and `tune` say which objective
//! they hold the policy to and where each bound came from, a spec's stricter bound is
//! stated rather than applied silently, and `ab` and `tune` take `run`'s objective flags.
//! (`serve` prints the same lines from serve.toml: tests/all/serve.rs starts it.)

use crate::support::{repo_root, stderr, tempdir, tokwatt};

/// The JSON document a `--json` command printed, asserting it succeeded.
fn json_of(output: &std::process::Output) -> serde_json::Value {
    assert!(output.status.success(), "{}", stderr(output));
    serde_json::from_slice(&output.stdout).expect("--json prints one JSON document")
}

#[test]
fn run_states_a_stricter_spec_bound_and_writes_its_source() {
    let dir = tempdir();
    let out = dir.path().join("run");
    // slo-batch.toml bounds TPOT at 20 ms, stricter than the operator's 70.
    let output = tokwatt()
        .args(["run", "--sim", "h200", "--duration", "20s", "--policy"])
        .arg(repo_root().join("policies/slo-batch.toml"))
        .args(["--tpot-p99-limit-ms", "70", "--ttft-p99-limit-ms", "2000"])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("runs");
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(err.contains("tokwatt: objective in force:"), "{err}");
    assert!(
        err.contains("TPOT p99 ≤ 20 ms (spec ")
            && err.contains("slo-batch.toml, stricter than --tpot-p99-limit-ms 70)"),
        "{err}"
    );
    assert!(
        err.contains("TTFT p99 ≤ 2000 ms (--ttft-p99-limit-ms)"),
        "{err}"
    );
    assert!(
        err.contains("no bound on queue wait p99 or throughput"),
        "{err}"
    );
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).expect("summary.json"),
    )
    .expect("JSON");
    let in_force = &summary["objective_in_force"];
    assert_eq!(in_force["objective"], summary["objective"]);
    let tpot = &in_force["bounds"][0];
    assert_eq!(tpot["bound"], "tpot_p99_limit_ms");
    assert_eq!(
        (tpot["value"].as_f64(), &tpot["source"]),
        (Some(20.0), &"spec".into())
    );
    assert_eq!(tpot["narrowed"]["source"], "flag");
    assert_eq!(tpot["narrowed"]["from"], "--tpot-p99-limit-ms");
    assert_eq!(tpot["narrowed"]["value"].as_f64(), Some(70.0));
    assert_eq!(in_force["bounds"][1]["source"], "flag");
}

#[test]
fn ab_takes_the_objective_flags_and_sets_a_looser_spec_bound_aside() {
    let dir = tempdir();
    let out = dir.path().join("ab");
    // Both shipped specs bound TPOT at 20 ms: looser than the flag's 10, which holds.
    let output = tokwatt()
        .arg("ab")
        .arg("--a")
        .arg(repo_root().join("policies/default.toml"))
        .arg("--b")
        .arg(repo_root().join("policies/slo-batch.toml"))
        .args([
            "--sim", "h200", "--budget", "4", "--epoch", "5s", "--warmup", "2s",
        ])
        .args([
            "--tpot-p99-limit-ms",
            "10",
            "--min-tokens-per-s",
            "50",
            "--json",
        ])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("runs");
    let err = stderr(&output);
    let doc = json_of(&output);
    assert!(
        err.contains("is looser than --tpot-p99-limit-ms 10, which holds"),
        "{err}"
    );
    assert!(
        err.contains("throughput ≥ 50 tokens/s per GPU (--min-tokens-per-s)"),
        "{err}"
    );
    for arm in ["a", "b"] {
        let in_force = &doc["objective_in_force"][arm];
        assert_eq!(
            in_force["objective"]["tpot_p99_limit_ms"].as_f64(),
            Some(10.0)
        );
        assert_eq!(in_force["bounds"][0]["source"], "flag");
        assert_eq!(
            in_force["set_aside"][0]["spec"]["value"].as_f64(),
            Some(20.0)
        );
    }
}

#[test]
fn tune_takes_the_objective_flags_as_its_latency_bound() {
    let dir = tempdir();
    let out = dir.path().join("tune");
    // static.toml bounds no latency: without a flag tune refuses it (tests/all/bad_input.rs).
    let output = tokwatt()
        .args([
            "tune",
            "--sim",
            "h200",
            "--param",
            "power_cap_w=300,400",
            "--policy",
        ])
        .arg(repo_root().join("policies/static.toml"))
        .args(["--tpot-p99-limit-ms", "40", "--json", "--out"])
        .arg(&out)
        .output()
        .expect("runs");
    let err = stderr(&output);
    let doc = json_of(&output);
    assert!(!err.contains("bounds no latency"), "{err}");
    assert!(
        err.contains("TPOT p99 ≤ 40 ms (--tpot-p99-limit-ms)"),
        "{err}"
    );
    let tpot = &doc["objective_in_force"]["bounds"][0];
    assert_eq!(tpot["source"], "flag");
    assert_eq!(tpot["value"].as_f64(), Some(40.0));
}
