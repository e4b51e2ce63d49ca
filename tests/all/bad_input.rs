//! Bad input gets a clear error naming the problem, and never a panic.

use std::path::Path;
use std::process::Command;

use crate::support::*;

/// Runs tokwatt with `args`, expects it to fail naming each of `expected`, and returns
/// its standard error for further checks.
fn fails_with(args: &[&str], expected: &[&str]) -> String {
    refused(tokwatt().args(args), expected)
}

/// Run `command`, expecting it to fail with an error that mentions each of `expected`.
fn refused(command: &mut Command, expected: &[&str]) -> String {
    let output = command.output().expect("runs");
    let err = stderr(&output);
    assert!(!output.status.success(), "{command:?} should fail");
    assert!(!err.contains("thread 'main' panicked"), "{err}");
    for needle in expected {
        assert!(
            err.contains(needle),
            "error for {command:?} should mention {needle:?}: {err}"
        );
    }
    err
}

#[test]
fn missing_spec_file() {
    fails_with(
        &["run", "--sim", "h200", "--policy", "/nonexistent/spec.toml"],
        &["/nonexistent/spec.toml"],
    );
}

#[test]
fn bad_toml() {
    let dir = tempdir();
    let spec = dir.path().join("bad.toml");
    std::fs::write(&spec, "name = \"x\"\nplugin = [oops").expect("write");
    let spec = spec.to_string_lossy().into_owned();
    fails_with(
        &["run", "--sim", "h200", "--policy", &spec],
        &["bad.toml", "not valid"],
    );
}

#[test]
fn plugin_that_is_not_a_component() {
    let dir = tempdir();
    let text = dir.path().join("text.wasm");
    std::fs::write(&text, "this is not wasm").expect("write");
    let spec = write_spec(dir.path(), "text", &text, "");
    fails_with(
        &["run", "--sim", "h200", "--policy", &spec.to_string_lossy()],
        &["not a WebAssembly file"],
    );

    let core = dir.path().join("core.wasm");
    std::fs::write(&core, b"\0asm\x01\0\0\0").expect("write");
    let spec = write_spec(dir.path(), "core", &core, "");
    fails_with(
        &["run", "--sim", "h200", "--policy", &spec.to_string_lossy()],
        &["core WebAssembly module", "wasm32-wasip2"],
    );
}

#[test]
fn missing_plugin() {
    let dir = tempdir();
    let spec = write_spec(dir.path(), "gone", &dir.path().join("gone.wasm"), "");
    fails_with(
        &["run", "--sim", "h200", "--policy", &spec.to_string_lossy()],
        &["gone.wasm", "not found"],
    );
}

#[test]
fn unknown_gpu_profile() {
    let spec = repo_root().join("policies/static.toml");
    fails_with(
        &["run", "--sim", "b300", "--policy", &spec.to_string_lossy()],
        &["b300", "h200"],
    );
}

#[test]
fn a_missing_profile_file_is_called_missing() {
    let spec = repo_root().join("policies/static.toml");
    let err = fails_with(
        &[
            "run",
            "--sim",
            "nope.toml",
            "--policy",
            &spec.to_string_lossy(),
        ],
        &["nope.toml", "not found"],
    );
    assert!(!err.contains("unknown GPU profile"), "{err}");
}

#[test]
fn a_word_for_a_duration_is_named() {
    let spec = repo_root().join("policies/static.toml");
    fails_with(
        &[
            "run",
            "--sim",
            "h200",
            "--duration",
            "abc",
            "--policy",
            &spec.to_string_lossy(),
        ],
        &["`abc` is not a duration", "30m"],
    );
}

#[test]
fn an_earlier_run_is_kept_unless_overwrite_is_given() {
    let dir = tempdir();
    let out = dir.path().join("run");
    let spec = repo_root().join("policies/static.toml");
    run_sim(&spec, "3s", &out, &[]);
    refused(
        &mut sim_run(&spec, "3s", &out),
        &["already holds a run", "--overwrite"],
    );
    run_sim(&spec, "3s", &out, &["--overwrite"]);
}

#[test]
fn logs_carry_no_colour_codes_when_redirected() {
    let dir = tempdir();
    let spec = repo_root().join("policies/static.toml");
    let output = tokwatt()
        .args(["run", "--sim", "h200", "--duration", "3s", "--log", "info"])
        .arg("--policy")
        .arg(&spec)
        .arg("--out")
        .arg(dir.path().join("run"))
        .output()
        .expect("runs");
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(err.contains("INFO"), "info logs are shown: {err}");
    assert!(
        !err.contains('\x1b'),
        "no ANSI escapes in a redirected log: {err:?}"
    );
}

#[test]
fn bad_duration() {
    let spec = repo_root().join("policies/static.toml");
    fails_with(
        &[
            "run",
            "--sim",
            "h200",
            "--duration",
            "ten minutes",
            "--policy",
            &spec.to_string_lossy(),
        ],
        &["duration"],
    );
}

#[test]
fn gpu_commands_without_a_driver_say_so() {
    if Path::new("/proc/driver/nvidia").exists() {
        // The opposite check (commands work with a driver) is the GPU machine's.
        println!(
            "not applicable: an NVIDIA driver is present, so the no-driver message cannot be checked here"
        );
        return;
    }
    let spec = repo_root().join("policies/hill-climb.toml");
    let spec = spec.to_string_lossy();
    for args in [
        vec!["gpus"],
        vec!["bench", "workload"],
        vec![
            "run",
            "--gpu",
            "0",
            "--dry-run",
            "--duration",
            "10s",
            "--policy",
            &spec,
        ],
    ] {
        fails_with(&args, &["NVIDIA driver", "simulated GPU"]);
    }
}

#[test]
fn a_tick_of_one_nanosecond_is_refused() {
    let spec = repo_root().join("policies/static.toml");
    fails_with(
        &[
            "run",
            "--sim",
            "h200",
            "--tick",
            "1ns",
            "--policy",
            &spec.to_string_lossy(),
        ],
        &["`--tick` must be between 10ms and 1h"],
    );
}

#[test]
fn values_that_parse_but_make_no_sense_are_named_with_file_and_line() {
    let dir = tempdir();
    for (extra, expected) in [
        (
            "[sandbox]\nfuel_per_call = 0",
            "zero-fuel.toml:5: `sandbox.fuel_per_call`",
        ),
        (
            "[sandbox]\nlog_messages_per_call = 100000",
            "log-flood.toml:5: `sandbox.log_messages_per_call`",
        ),
        (
            "[breaker]\nfailures_to_eject = 0",
            "zero-breaker.toml:5: `breaker.failures_to_eject`",
        ),
        (
            "[objective]\ntpot_p99_limit_ms = nan",
            "nan-objective.toml:5: `objective.tpot_p99_limit_ms`",
        ),
    ] {
        let name = expected.split(".toml").next().expect("name");
        let spec = write_spec(dir.path(), name, &built_plugin("policy_static"), extra);
        fails_with(
            &["run", "--sim", "h200", "--policy", &spec.to_string_lossy()],
            &[expected],
        );
    }
}

#[test]
fn a_log_filter_that_does_not_parse_is_refused_naming_where_it_came_from() {
    fails_with(
        &["--log", "tokwatt=loud", "gpus"],
        &["tokwatt=loud", "--log", "does not parse", "tokwatt=debug"],
    );
    let output = tokwatt()
        .arg("gpus")
        .env_remove("RUST_LOG")
        .env("TOKWATT_LOG", "tokwatt=loud")
        .output()
        .expect("runs");
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("TOKWATT_LOG"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn tokwatt_log_is_read() {
    let dir = tempdir();
    let run = |level: Option<&str>| {
        let mut command = sim_run(&repo_root().join("policies/static.toml"), "5s", dir.path());
        command.arg("--overwrite").env_remove("RUST_LOG");
        match level {
            Some(level) => command.env("TOKWATT_LOG", level),
            None => command.env_remove("TOKWATT_LOG"),
        };
        let output = command.output().expect("runs");
        assert!(output.status.success(), "{}", stderr(&output));
        stderr(&output)
    };
    assert!(!run(None).contains("policy started"));
    let info = run(Some("tokwatt=info"));
    assert!(info.contains("policy started"), "{info}");
}

/// `tokwatt bench decide | head`: a command that only prints ends when its reader goes,
/// without a panic.
#[test]
fn a_printing_command_whose_reader_is_gone_ends_without_a_panic() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;

    let cache = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("component-cache");
    let mut child = tokwatt()
        .args(["bench", "decide", "--calls", "2000", "--cache-dir"])
        .arg(&cache)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("runs");
    // The reader is gone before the first line is written.
    drop(child.stdout.take());
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("piped stderr")
        .read_to_string(&mut err)
        .expect("read stderr");
    let status = child.wait().expect("waits");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(status.signal(), Some(libc::SIGPIPE), "{status:?}\n{err}");
}

/// Counts that would only allocate or overflow are refused by name, before any work.
#[test]
fn counts_past_any_use_are_refused_with_their_range() {
    let spec = repo_root().join("policies/static.toml");
    let spec = spec.to_string_lossy();
    let scenarios = repo_root().join("host/scenarios/eval");
    let scenarios = scenarios.to_string_lossy();
    let eval = ["eval", "--policies", &spec, "--scenarios", &scenarios];
    for (extra, expected) in [
        (vec!["--seeds", "18446744073709551615"], "1..=1000"),
        (vec!["--threads", "0"], "1 to 1024"),
        (vec!["--duration", "100000h"], "10 s to a week"),
    ] {
        let args: Vec<&str> = eval.iter().copied().chain(extra).collect();
        fails_with(&args, &[expected]);
    }
    fails_with(
        &[
            "ab",
            "--sim",
            "h200",
            "--a",
            &spec,
            "--b",
            &spec,
            "--budget",
            "4611686018427387904",
        ],
        &["at most 100000"],
    );
    fails_with(&["bench", "decide", "--calls", "0"], &["1..=100000000"]);
}

/// A scenario on a real GPU is what tokwatt's own engine serves: beside a serving engine's
/// tokens, or beside a model of its own, it is refused (before any GPU is opened).
#[test]
fn a_scenario_on_a_gpu_conflicting_with_the_workload_is_refused_with_the_fix() {
    let spec = repo_root().join("policies/static-batch.toml");
    let spec = spec.to_string_lossy();
    let scenario = repo_root().join("host/scenarios/serving-check.toml");
    let scenario = scenario.to_string_lossy();
    let run = [
        "run",
        "--gpu",
        "0",
        "--dry-run",
        "--batch-only",
        "--duration",
        "10s",
        "--policy",
        &spec,
        "--scenario",
        &scenario,
    ];
    let mut external = run.to_vec();
    external.extend([
        "--workload",
        "external",
        "--metrics-url",
        "http://127.0.0.1:9/metrics",
    ]);
    fails_with(&external, &["--workload external", "drop --scenario"]);
    let mut model = run.to_vec();
    model.extend(["--model", "llama-3.2-1b"]);
    fails_with(&model, &["names the model", "drop --model"]);
}

#[test]
fn a_knob_withheld_by_batch_only_is_named_with_the_fix_that_works() {
    let spec = repo_root().join("policies/hill-climb.toml");
    let err = fails_with(
        &[
            "run",
            "--sim",
            "h200",
            "--batch-only",
            "--duration",
            "10s",
            "--quiet",
            "--policy",
            &spec.to_string_lossy(),
        ],
        &[
            "the spec lists \"power-cap\", which this run withholds",
            "drop --batch-only",
            "policies/slo-batch.toml",
        ],
    );
    // The spec lists the knob already: adding it is not the fix.
    assert!(!err.contains("add \"power-cap\""), "{err}");
}

#[test]
fn a_missing_python_or_javascript_plugin_gets_its_own_languages_build_command() {
    let dir = tempdir();
    for (lang, sources, expected) in [
        (
            "python",
            &["app.py", "rules.py"][..],
            &["componentize-py -d", "componentize app -o policy.wasm"][..],
        ),
        (
            "js",
            &["package.json", "policy.js"][..],
            &["componentize-js", "npm ci && npm run build"][..],
        ),
    ] {
        let folder = dir.path().join(lang);
        std::fs::create_dir(&folder).expect("folder");
        for source in sources {
            std::fs::copy(
                repo_root().join("examples").join(lang).join(source),
                folder.join(source),
            )
            .expect("copy the example's source");
        }
        let spec = folder.join("policy.toml");
        std::fs::copy(
            repo_root().join("examples").join(lang).join("policy.toml"),
            &spec,
        )
        .expect("copy the example's spec");
        let err = fails_with(&["check", &spec.to_string_lossy()], expected);
        assert!(
            err.contains("policy.wasm` not found") && !err.contains("cargo build --target"),
            "{err}"
        );
    }
}

#[test]
fn plugin_test_of_a_policy_that_cannot_start_says_so_and_shows_no_nan() {
    let dir = tempdir();
    let spec = dir.path().join("no-cap.toml");
    std::fs::write(
        &spec,
        "name = \"no-cap\"\nplugin = \"policy_hill_climb.wasm\"\nknobs = [\"batch-size\"]\n",
    )
    .expect("spec");
    let output = tokwatt()
        .args(["plugin", "test", "--duration", "2m"])
        .arg(&spec)
        .output()
        .expect("tokwatt plugin test");
    let out = String::from_utf8_lossy(&output.stdout);
    let err = stderr(&output);
    assert!(!output.status.success(), "{out}");
    assert!(!out.contains("NaN") && !err.contains("NaN"), "{out}");
    assert!(
        out.contains("could not start") && out.contains("was not granted \"power-cap\""),
        "{out}"
    );
    assert!(err.contains("could not start"), "{err}");
    // The oracle still has its figures, from the baseline's seeds.
    let oracle = out
        .lines()
        .find(|line| line.contains("oracle") && line.contains('%'))
        .unwrap_or_else(|| panic!("no oracle row in {out}"));
    assert!(oracle.chars().any(|c| c.is_ascii_digit()), "{oracle}");
}

#[test]
fn tune_without_a_latency_bound_is_refused_with_the_fix_or_warned_on_purpose() {
    let spec = repo_root().join("policies/static.toml");
    let spec = spec.to_string_lossy();
    let dir = tempdir();
    let out = dir.path().join("tune");
    let out = out.to_string_lossy();
    let args = [
        "tune",
        "--sim",
        "h200",
        "--quiet",
        "--policy",
        &spec,
        "--param",
        "power_cap_w=300,400",
        "--out",
        &out,
    ];
    fails_with(
        &args,
        &[
            "bounds no latency",
            "lowest clock or cap",
            "tpot_p99_limit_ms = 25.0",
            "--without-objective",
        ],
    );
    assert!(!dir.path().join("tune").exists(), "nothing is written");
    let on_purpose = tokwatt()
        .args(args)
        .arg("--without-objective")
        .output()
        .expect("runs");
    let err = stderr(&on_purpose);
    assert!(on_purpose.status.success(), "{err}");
    assert!(
        err.contains("WARNING") && err.contains("bounds no latency"),
        "{err}"
    );
}
