//! `tokwatt plugin check` and `tokwatt plugin compile` as a plugin author runs them: a
//! shipped policy is fine, each kind of broken component is refused with a reason that
//! names the version, function or file and the fix (a trapping guest's standard error
//! quoted line by line), and a compiled component is found in the cache the second time,
//! by `plugin compile` and by `bench decide`.

use std::process::Output;

use crate::support::*;

fn check(plugin: &std::path::Path, extra: &[&str]) -> Output {
    tokwatt()
        .args(["plugin", "check"])
        .arg(plugin)
        .args(extra)
        .output()
        .expect("runs tokwatt plugin check")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn a_shipped_policy_is_fine_on_several_gpus_with_params() {
    let output = check(
        &built_plugin("policy_static"),
        &["--gpus", "2", "--params", "power_cap_w=450"],
    );
    let text = stdout(&output);
    assert!(output.status.success(), "{text}\n{}", stderr(&output));
    let verdict = text.lines().last().expect("a verdict line");
    assert!(verdict.starts_with("verdict: fine:"), "{text}");
    // The parameter reached init, for each of the two GPUs.
    let init = text
        .lines()
        .find(|line| line.contains("ok     init:"))
        .unwrap_or_else(|| panic!("init answered: {text}"));
    assert_eq!(init.matches("power cap 450 W").count(), 2, "{init}");
    assert!(text.contains("ok     snapshot:"), "{text}");
    assert!(text.contains("ok     restore:"), "{text}");
    assert_eq!(text.matches("ok     decide #").count(), 5, "{text}");
}

#[test]
fn the_json_report_lists_every_call() {
    let output = check(&built_plugin("policy_default"), &["--json"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(report["fine"], true);
    assert_eq!(report["format_version"], 1);
    assert_eq!(report["inspection"]["contract_version"], "0.4.0");
    let calls = report["calls"].as_array().expect("calls");
    let functions: Vec<&str> = calls
        .iter()
        .map(|call| call["function"].as_str().expect("function"))
        .collect();
    assert_eq!(
        functions,
        [
            "init", "decide", "decide", "decide", "decide", "decide", "snapshot", "restore",
            "decide"
        ]
    );
}

#[test]
fn the_wrong_contract_version_is_named_with_the_one_served() {
    let output = check(&built_plugin("fixture_wrong_version"), &[]);
    let text = stdout(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(
        text.contains("implements `tokwatt:policy/guest@1.0.0`")
            && text.contains("serves tokwatt:policy@0.4.* or 0.3.* or 0.2.* or 0.1.*"),
        "{text}"
    );
    assert!(text.contains("verdict: NOT FINE"), "{text}");
    assert!(text.contains("nothing was run"), "{text}");
}

#[test]
fn a_wrong_signature_names_the_function_and_both_types() {
    let output = check(&built_plugin("fixture_wrong_signature"), &[]);
    let text = stdout(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    let problem = text
        .lines()
        .find(|line| line.contains("1. decide:"))
        .unwrap_or_else(|| panic!("a problem naming decide: {text}"));
    assert!(
        problem.contains("expected decide: func(observations: list<observation>)")
            && problem.contains("found decide: func(tick: u64)"),
        "{problem}"
    );
    // Only decide is wrong: the other three are reported as matching.
    for function in ["init", "snapshot", "restore"] {
        assert!(text.contains(&format!("ok      {function}")), "{text}");
    }
}

#[test]
fn a_plugin_whose_decide_traps_is_not_fine_and_decide_is_named() {
    let output = check(&built_plugin("fixture_trap_decide"), &[]);
    let text = stdout(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.contains("FAILED decide #"), "{text}");
    let verdict = text.lines().last().expect("a verdict line");
    assert!(
        verdict.starts_with("verdict: NOT FINE") && verdict.contains("`decide` failed"),
        "{verdict}"
    );
}

#[test]
fn a_trapping_guests_stderr_is_shown_line_by_line_under_the_failed_call() {
    // The fixture writes a Python-style traceback (ending in a terminal escape) to
    // standard error and traps on its third decide.
    let output = check(&built_plugin("fixture_stderr_trap"), &[]);
    let text = stdout(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    let failed = lines
        .iter()
        .position(|line| line.starts_with("    FAILED decide #3 (busy): the plugin trapped: "))
        .unwrap_or_else(|| panic!("the third decide failed: {text}"));
    // The one-line message keeps the trap, not a second copy of the traceback.
    assert!(
        !lines[failed].contains("Traceback") && !lines[failed].contains("its standard error"),
        "{}",
        lines[failed]
    );
    let quoted = [
        "           stderr| stderr-trap: deciding tick 2",
        "           stderr| Traceback (most recent call last):",
        "           stderr|   File \"policy.py\", line 12, in decide",
        "           stderr|     raise ValueError(\"call 3\")",
        // The guest's escape sequence stays escaped: it must not reach the terminal.
        "           stderr| ValueError: fixture stderr-trap: decide call 3 raises on purpose\\u{1b}[2J",
    ];
    assert_eq!(lines[failed + 1..=failed + quoted.len()], quoted, "{text}");
    assert!(
        lines[failed + quoted.len() + 1].starts_with("    ok     decide #4"),
        "the trial goes on after the quote: {text}"
    );
    assert!(!text.contains('\u{1b}'), "{text:?}");

    // JSON keeps the lines apart, and the detail without them.
    let output = check(&built_plugin("fixture_stderr_trap"), &["--json"]);
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let failed = report["calls"]
        .as_array()
        .expect("calls")
        .iter()
        .find(|call| call["ok"] == false)
        .expect("a failed call");
    assert_eq!(failed["stderr"][1], "Traceback (most recent call last):");
    assert!(
        !failed["detail"]
            .as_str()
            .expect("detail")
            .contains("Traceback"),
        "{failed}"
    );
}

#[test]
fn bench_decide_loads_a_component_compiled_ahead_from_the_cache() {
    let dir = tempdir();
    let plugin = built_plugin("policy_cap_search");
    let bench = |cache: &std::path::Path| {
        let output = tokwatt()
            .args([
                "bench", "decide", "--gpus", "2", "--calls", "50", "--plugin",
            ])
            .arg(&plugin)
            .arg("--cache-dir")
            .arg(cache)
            .output()
            .expect("runs tokwatt bench decide");
        assert!(output.status.success(), "{}", stderr(&output));
        stdout(&output)
    };
    let cache = dir.path().join("cache");
    let compiled = tokwatt()
        .args(["plugin", "compile"])
        .arg(&plugin)
        .arg("--cache-dir")
        .arg(&cache)
        .output()
        .expect("runs tokwatt plugin compile");
    assert!(compiled.status.success(), "{}", stderr(&compiled));
    // After `plugin compile` into a cache, the bench loads from it, compiling nothing.
    let warm = bench(&cache);
    assert!(
        warm.contains(&format!(
            ": loaded from the compiled-component cache {}\n",
            cache.display()
        )),
        "{warm}"
    );
    // The worst call is reported beside the quantiles (a deadline is judged against it).
    let quantiles = warm
        .lines()
        .find(|line| line.trim_start().starts_with("p50 "))
        .unwrap_or_else(|| panic!("a quantile line: {warm}"));
    assert!(
        quantiles.contains(" p99 ") && quantiles.contains(" max "),
        "{quantiles}"
    );
    // A cache without it: the bench compiles, and says so.
    let cold = bench(&dir.path().join("empty"));
    assert!(cold.contains(": compiled (it was not in the"), "{cold}");
}

#[test]
fn a_core_module_is_not_a_component_and_the_fix_is_given() {
    let dir = tempdir();
    let core = dir.path().join("core.wasm");
    // The smallest core module: magic and version 1, layer 0.
    std::fs::write(&core, b"\0asm\x01\0\0\0").expect("write");
    let output = check(&core, &[]);
    let text = stdout(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(
        text.contains("is a core WebAssembly module, not a component")
            && text.contains("wasm32-wasip2")
            && text.contains("wasm-tools component new"),
        "{text}"
    );
    let text_file = dir.path().join("notes.wasm");
    std::fs::write(&text_file, b"hello, not wasm").expect("write");
    let output = check(&text_file, &[]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stdout(&output).contains("is not a WebAssembly file"),
        "{}",
        stdout(&output)
    );
}

#[test]
fn compile_fills_the_cache_and_a_second_compile_finds_it() {
    let dir = tempdir();
    let cache = dir.path().join("cache");
    let compile = || {
        tokwatt()
            .args(["plugin", "compile"])
            .arg(built_plugin("policy_cap_search"))
            .arg("--cache-dir")
            .arg(&cache)
            .output()
            .expect("runs tokwatt plugin compile")
    };
    let first = compile();
    assert!(first.status.success(), "{}", stderr(&first));
    let first = stdout(&first);
    assert!(first.starts_with("compiled "), "{first}");
    let cached: Vec<_> = std::fs::read_dir(&cache)
        .expect("the cache folder was made")
        .map(|entry| entry.expect("entry").path())
        .collect();
    assert_eq!(cached.len(), 1, "{cached:?}");
    assert!(first.contains(&cached[0].display().to_string()), "{first}");
    let second = compile();
    assert!(second.status.success(), "{}", stderr(&second));
    let second = stdout(&second);
    assert!(second.starts_with("already cached: "), "{second}");

    let not_a_policy = dir.path().join("core.wasm");
    std::fs::write(&not_a_policy, b"\0asm\x01\0\0\0").expect("write");
    let refused = tokwatt()
        .args(["plugin", "compile"])
        .arg(&not_a_policy)
        .arg("--cache-dir")
        .arg(&cache)
        .output()
        .expect("runs");
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        stderr(&refused).contains("not a component"),
        "{}",
        stderr(&refused)
    );
}

/// `tokwatt check SPEC` says what the policy's `init` asked for in words, per GPU.
#[test]
fn check_names_a_specs_first_settings_in_words() {
    let output = tokwatt()
        .arg("check")
        .arg(repo_root().join("policies/static.toml"))
        .output()
        .expect("runs");
    assert!(output.status.success(), "{}", stderr(&output));
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.starts_with("ok: static ("), "{text}");
    assert!(
        text.trim_end()
            .ends_with("and starts; first settings: GPU 0: power cap 500 W"),
        "{text}"
    );
}
