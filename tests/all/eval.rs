//! `tokwatt eval`: the judge's files and figures, on short runs of shipped scenarios.

use crate::support::*;

fn eval(
    out: &std::path::Path,
    policies: &[&str],
    scenarios: &[&str],
    extra: &[&str],
) -> serde_json::Value {
    let root = repo_root();
    let mut command = tokwatt();
    command.arg("eval").arg("--policies");
    for policy in policies {
        command.arg(root.join("policies").join(policy));
    }
    command.arg("--scenarios");
    for scenario in scenarios {
        command.arg(root.join("host/scenarios/eval").join(scenario));
    }
    command.arg("--out").arg(out).args(extra);
    let output = command.output().expect("tokwatt eval runs");
    assert!(
        output.status.success(),
        "tokwatt eval failed: {}",
        stderr(&output)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("simulator output"), "{stdout}");
    let text = std::fs::read_to_string(out.join("eval.json")).expect("eval.json");
    serde_json::from_str(&text).expect("eval.json is JSON")
}

#[test]
fn eval_writes_every_field_for_every_policy_and_scenario() {
    let dir = tempdir();
    let out = dir.path().join("eval");
    let results = eval(
        &out,
        &["static.toml", "hill-climb.toml"],
        &["h200-8b-latency.toml", "a100-1b-latency.toml"],
        &["--seeds", "2", "--duration", "4m", "--threads", "2"],
    );
    let entries = results["entries"].as_array().expect("entries");
    assert_eq!(entries.len(), 4, "2 policies × 2 scenarios");
    for entry in entries {
        for key in [
            "policy",
            "scenario",
            "seeds",
            "tokens_per_joule",
            "oracle_tokens_per_joule",
            "ratio",
            "measured_ratio",
            "failed",
            "ticks_to_95",
            "ticks_to_98",
            "slo_violation_fraction",
            "served_fraction",
            "setting_changes",
            "causal_violation_fraction",
            "oracle_violation_fraction",
            "default_violation_fraction",
            "oracle_served_fraction",
            "causal_served_fraction",
            "default_served_fraction",
            "failure_rule",
        ] {
            assert!(entry.get(key).is_some(), "entry lacks `{key}`: {entry}");
        }
        // The failure rule's arithmetic is in the file: its means decide `failed`, and a
        // failure quotes them.
        let rule = &entry["failure_rule"];
        assert_eq!(rule["seeds"], 2, "{entry}");
        let over_ticks = num(rule, "slo_violation_fraction_mean")
            > num(rule, "allowed_violation_fraction") + 1e-12;
        let served_less = num(rule, "served_shortfall_mean") > 0.01;
        assert_eq!(
            entry["failed"].is_null(),
            !(over_ticks || served_less),
            "`failed` follows failure_rule: {entry}"
        );
        if served_less {
            let failed = entry["failed"].as_str().unwrap_or_default();
            let quoted = format!("{:.4}", num(rule, "served_fraction_mean"));
            assert!(failed.contains(&quoted), "{failed} quotes {quoted}");
        }
        assert_eq!(entry["seeds"], serde_json::json!([1, 2]));
        let tpj = &entry["tokens_per_joule"];
        assert!(num(tpj, "min") <= num(tpj, "median") && num(tpj, "median") <= num(tpj, "max"));
        if entry["failed"].is_null() {
            let ratio = num(entry, "ratio");
            // The oracle is the best that serves the demand within the objective: a policy
            // that keeps the objective cannot beat it by more than the noise of one phase.
            assert!(ratio > 0.0 && ratio < 1.05, "ratio {ratio}: {entry}");
            assert_eq!(entry["ratio"], entry["measured_ratio"]);
        } else {
            assert!(
                entry["ratio"].is_null(),
                "a failed scenario has no ratio: {entry}"
            );
        }
    }
    let scenarios = results["scenarios"].as_array().expect("scenarios");
    assert_eq!(scenarios.len(), 2);
    for scenario in scenarios {
        let oracle = scenario["oracle"].as_array().expect("oracle phases");
        assert!(!oracle.is_empty());
        for phase in oracle {
            assert_eq!(phase["feasible"], true, "{phase}");
            assert!(num(&phase["setting"], "power_cap_w") > 0.0);
        }
    }
    let report = std::fs::read_to_string(out.join("report.html")).expect("report.html");
    assert!(report.contains("<svg"), "the report has plots");
    assert!(report.contains("h200-8b-latency") && report.contains("hill-climb"));
    // An evaluation is not overwritten by accident.
    let again = tokwatt()
        .args(["eval", "--policies"])
        .arg(repo_root().join("policies/static.toml"))
        .arg("--scenarios")
        .arg(repo_root().join("host/scenarios/eval/h200-8b-latency.toml"))
        .arg("--out")
        .arg(&out)
        .output()
        .expect("runs");
    assert!(!again.status.success());
    assert!(stderr(&again).contains("--overwrite"), "{}", stderr(&again));
}

#[test]
fn the_shipped_scenario_set_covers_what_the_judge_promises() {
    let dir = repo_root().join("host/scenarios/eval");
    let scenarios =
        tokwatt_lab::eval::EvalScenario::load_all(&[dir]).expect("the shipped set loads");
    assert!(scenarios.len() >= 12, "{} scenarios", scenarios.len());
    let has = |f: &dyn Fn(&tokwatt_lab::eval::EvalScenario) -> bool| scenarios.iter().any(f);
    for gpu in ["h200", "h100", "a100"] {
        assert!(has(&|s| s.profile.id == gpu), "no {gpu} scenario");
    }
    assert!(has(&|s| s.workload.model_name == "llama-3-8b"));
    assert!(has(&|s| s.workload.model_name == "llama-3.2-1b"));
    assert!(
        has(&|s| s.workload.model_name == "custom"),
        "no user-given shape"
    );
    assert!(has(&|s| s.workload.context_tokens <= 1024));
    assert!(has(&|s| s.workload.context_tokens >= 8192));
    assert!(
        has(&|s| s.objective.tpot_p99_limit_ms.is_some()),
        "no latency objective"
    );
    assert!(
        has(&|s| s.objective.tpot_p99_limit_ms.is_none()
            && s.objective.queue_wait_p99_limit_ms.is_some()),
        "no throughput objective"
    );
    assert!(has(&|s| s.workload.phases.len() >= 3), "no demand shifts");
    assert!(
        has(&|s| s.profile.nvml.gain_error_max >= 0.05),
        "no noisy boards"
    );
}

#[test]
fn a_policy_that_refuses_a_scenario_is_an_entry_not_the_end() {
    let dir = tempdir();
    // cap-and-batch sizes the batch by a TPOT bound; a throughput objective has none.
    let results = eval(
        &dir.path().join("eval"),
        &["cap-and-batch.toml", "static.toml"],
        &["h200-8b-throughput.toml"],
        &["--seeds", "1", "--duration", "1m"],
    );
    let entries = results["entries"].as_array().expect("entries");
    let refused = &entries[0];
    assert_eq!(refused["policy"], "cap-and-batch");
    let failure = refused["failure"]
        .as_str()
        .expect("the failure is recorded");
    assert!(failure.contains("tpot_p99_limit_ms"), "{failure}");
    assert!(
        refused["ratio"].is_null() && refused["measured_ratio"].is_null(),
        "no figure for a run that did not happen"
    );
    // Refusing a scenario is no way out of it: it counts as failed, scoring 0.
    assert!(
        refused["failed"]
            .as_str()
            .is_some_and(|why| why.starts_with("could not run")),
        "{refused}"
    );
    let policy = &results["policies"][0];
    assert_eq!(policy["failed"], 1);
    assert_eq!(num(policy, "ratio"), 0.0);
    let failed_on = policy["failed_scenarios"][0].as_str().unwrap_or_default();
    assert!(
        failed_on.starts_with("h200-8b-throughput (could not run"),
        "{failed_on}"
    );
    assert!(entries[1]["failure"].is_null());
    assert!(num(&entries[1], "ratio") > 0.0);
}

#[test]
fn a_policy_that_breaks_the_objective_fails_the_scenario_whatever_its_ratio() {
    // `static` with the SM clock held at 600 MHz: efficient, and far too slow for a 20 ms
    // time per token.
    let dir = tempdir();
    let shipped = std::fs::read_to_string(repo_root().join("policies/static.toml"))
        .expect("policies/static.toml");
    let text = shipped
        .replace(
            "plugin = \"policy_static.wasm\"",
            &format!("plugin = \"{}\"", built_plugin("policy_static").display()),
        )
        .replace("name = \"static\"", "name = \"slow-clock\"")
        .replace("[params]\n", "[params]\nsm_clock_max_mhz = \"600\"\n");
    let spec = dir.path().join("slow-clock.toml");
    std::fs::write(&spec, text).expect("write spec");
    let spec = spec.to_str().expect("utf-8").to_owned();
    let out = dir.path().join("eval");
    let results = eval(
        &out,
        &[spec.as_str(), "static.toml"],
        &["h200-8b-latency.toml"],
        &["--seeds", "1", "--duration", "2m"],
    );
    let entries = results["entries"].as_array().expect("entries");
    let slow = &entries[0];
    assert_eq!(slow["policy"], "slow-clock");
    assert!(num(slow, "slo_violation_fraction") > 0.01, "{slow}");
    let why = slow["failed"].as_str().expect("the scenario failed");
    assert!(why.contains("broke the objective on"), "{why}");
    assert!(
        slow["ratio"].is_null(),
        "never a ratio, above 1 or not: {slow}"
    );
    assert!(
        num(slow, "measured_ratio") > 0.0,
        "what it measured stays on record"
    );
    let policy = &results["policies"][0];
    assert_eq!(policy["failed"], 1);
    assert_eq!(num(policy, "ratio"), 0.0);
    assert_eq!(policy["worst_scenario"], "h200-8b-latency");
    assert!(policy["worst_ratio"].is_null());
    // The shipped static keeps the objective there and scores.
    assert!(entries[1]["failed"].is_null(), "{}", entries[1]);
    assert!(num(&results["policies"][1], "ratio") > 0.0);
    let report = std::fs::read_to_string(out.join("report.html")).expect("report.html");
    assert!(report.contains("FAILED"));
}

#[test]
fn eval_without_arguments_judges_the_shipped_policies_on_the_shipped_scenarios() {
    let dir = tempdir();
    let out = dir.path().join("eval");
    let output = tokwatt()
        .current_dir(repo_root())
        .args([
            "eval",
            "--seeds",
            "1",
            "--duration",
            "20s",
            "--quiet",
            "--out",
        ])
        .arg(&out)
        .output()
        .expect("tokwatt eval runs");
    assert!(output.status.success(), "{}", stderr(&output));
    let text = std::fs::read_to_string(out.join("eval.json")).expect("eval.json");
    let results: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let shipped_specs = std::fs::read_dir(repo_root().join("policies"))
        .expect("policies/")
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "toml"))
        })
        .count();
    let shipped_scenarios =
        tokwatt_lab::eval::EvalScenario::load_all(&[repo_root().join("host/scenarios/eval")])
            .expect("the shipped set")
            .len();
    assert_eq!(
        results["policies"].as_array().map(Vec::len),
        Some(shipped_specs)
    );
    assert_eq!(
        results["scenarios"].as_array().map(Vec::len),
        Some(shipped_scenarios)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("worst scenario"), "{stdout}");

    // Elsewhere, without the checkout's folders: what to pass instead.
    let output = tokwatt()
        .current_dir(dir.path())
        .args(["eval", "--quiet"])
        .output()
        .expect("tokwatt eval runs");
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("--policies"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn a_family_is_judged_on_its_tuning_and_held_out_splits_side_by_side() {
    let dir = tempdir();
    let out = dir.path().join("eval");
    let drawn = dir.path().join("drawn");
    let output = tokwatt()
        .args(["eval", "--policies"])
        .arg(repo_root().join("policies/static.toml"))
        .args([
            "--family",
            "broad",
            "--count",
            "2",
            "--seed",
            "5",
            "--seeds",
            "1",
            "--duration",
            "1m",
            "--quiet",
            "--out",
        ])
        .arg(&out)
        .arg("--write-scenarios")
        .arg(&drawn)
        .output()
        .expect("tokwatt eval runs");
    assert!(output.status.success(), "{}", stderr(&output));
    for (split, tag) in [("tuning", "t"), ("held-out", "h")] {
        let text = std::fs::read_to_string(out.join(split).join("eval.json")).expect("eval.json");
        let results: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        let names: Vec<&str> = results["scenarios"]
            .as_array()
            .expect("scenarios")
            .iter()
            .filter_map(|s| s["name"].as_str())
            .collect();
        assert_eq!(
            names,
            [format!("broad-{tag}5-00"), format!("broad-{tag}5-01")]
        );
        for name in names {
            // The drawn files judge as any scenario file.
            let file = drawn.join(split).join(format!("{name}.toml"));
            tokwatt_lab::eval::EvalScenario::load(&file).expect("a drawn file loads");
        }
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("held-out ratio"), "{stdout}");
    assert!(stdout.contains("tuning ratio"), "{stdout}");

    let output = tokwatt()
        .args(["eval", "--family", "narrow", "--quiet"])
        .output()
        .expect("tokwatt eval runs");
    assert!(!output.status.success());
    assert!(stderr(&output).contains("broad"), "{}", stderr(&output));
}

#[test]
fn the_held_out_set_written_elsewhere_loads_and_covers_what_the_generator_draws() {
    // Written without the family generator, to check that the generated held-out split
    // says what a policy does on scenarios nobody drew from it.
    let dir = repo_root().join("host/scenarios/held-out-elsewhere");
    let scenarios = tokwatt_lab::eval::EvalScenario::load_all(&[dir]).expect("the set loads");
    assert!(scenarios.len() >= 8, "{} scenarios", scenarios.len());
    let has = |f: &dyn Fn(&tokwatt_lab::eval::EvalScenario) -> bool| scenarios.iter().any(f);
    for gpu in ["h200", "h100", "a100"] {
        assert!(has(&|s| s.profile.id == gpu), "no {gpu} scenario");
    }
    assert!(
        has(&|s| s.workload.model.layers >= 40),
        "no 14B-class shape"
    );
    assert!(
        has(&|s| s.objective.tpot_p99_limit_ms.is_none()),
        "no throughput objective"
    );
    assert!(
        has(&|s| s.workload.phases.len() >= 10),
        "no fast shifts or bursts"
    );
}

/// `eval --plan` judges nothing: per phase, the demand, the capacity within the bounds
/// and the oracle's settings, as JSON for a script; a TTFT bound without prompts is
/// refused with the fix.
#[test]
fn a_plan_prints_each_phases_capacity_and_oracle_and_refuses_a_ttft_bound_without_prompts() {
    let output = tokwatt()
        .args(["eval", "--json", "--plan"])
        .arg(repo_root().join("host/scenarios/serving/h200-8b-chat.toml"))
        .output()
        .expect("runs");
    assert!(output.status.success(), "{}", stderr(&output));
    let plans: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("the plan is JSON");
    let plan = &plans[0];
    assert!(
        plan["prompt_tokens_mean"]
            .as_f64()
            .is_some_and(|p| p > 500.0),
        "{plan}"
    );
    assert!(
        plan["data_source"]
            .as_str()
            .is_some_and(|s| s.contains("simulator output"))
    );
    let phases = plan["phases"].as_array().expect("phases");
    assert_eq!(phases.len(), 3);
    for phase in phases {
        let rate = phase["arrival_rps"].as_f64().expect("rate");
        let capacity = phase["capacity_rps"].as_f64().expect("capacity");
        assert!(capacity > rate, "{phase}");
        assert!(
            phase["oracle"]["feasible"].as_bool().expect("feasible"),
            "{phase}"
        );
    }
    // The idle phase idles at a lower clock than the busy one (its cap, above what an
    // idle board draws, moves nothing).
    let idle = &phases[1]["oracle"]["setting"];
    let busy = &phases[0]["oracle"]["setting"];
    assert!(
        idle["sm_clock_max_mhz"].as_u64() < busy["sm_clock_max_mhz"].as_u64(),
        "{plan}"
    );
    assert!(busy["token_budget"].as_u64().is_some(), "{plan}");

    let dir = tempdir();
    let bad = dir.path().join("decode-with-ttft.toml");
    std::fs::write(
        &bad,
        "gpu = \"h200\"\n[objective]\nttft_p99_limit_ms = 500\n[workload]\nmodel = \"llama-3-8b\"\n\
         context_tokens = 1024\noutput_tokens = 128\n[[workload.phases]]\nstart_s = 0\narrival_rps = 5\n",
    )
    .expect("write");
    let output = tokwatt()
        .args(["eval", "--plan"])
        .arg(&bad)
        .output()
        .expect("runs");
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("prompt_tokens"),
        "{}",
        stderr(&output)
    );
}

/// `eval --plan --check` runs the oracle's invariant on a user's scenario: every fixed
/// setting of its grid against the oracle's phases, as JSON for a script.
#[test]
fn a_plan_check_runs_the_oracles_invariant_on_a_users_scenario() {
    let output = tokwatt()
        .args([
            "eval",
            "--json",
            "--check",
            "--duration",
            "120s",
            "--seeds",
            "1",
            "--plan",
        ])
        .arg(repo_root().join("host/scenarios/eval/h100-1b-throughput.toml"))
        .output()
        .expect("runs");
    assert!(output.status.success(), "{}", stderr(&output));
    let checks: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("the check is JSON");
    let check = &checks[0];
    assert_eq!(check["holds"], true, "{check}");
    let phase = &check["phases"][0];
    assert!(
        phase["settings_checked"].as_u64().is_some_and(|n| n >= 100),
        "{check}"
    );
    assert!(
        phase["kept_objective"].as_u64().is_some_and(|n| n >= 1),
        "{check}"
    );
    assert!(
        phase["best_ratio"].as_f64().is_some_and(|r| r <= 1.005),
        "{check}"
    );
    let output = tokwatt()
        .args(["eval", "--check", "--scenarios"])
        .arg(repo_root().join("host/scenarios/eval/h100-1b-throughput.toml"))
        .output()
        .expect("runs");
    assert!(!output.status.success(), "--check needs --plan");
    assert!(stderr(&output).contains("--plan"), "{}", stderr(&output));
}
