//! What the Python and JavaScript policy tests share: the example policies in both
//! languages follow the same rules (hold a power cap, cut the batch on a p99 TPOT
//! violation), so both are compiled ahead of time, checked, and run on the simulator the
//! same way. Each language's test builds its components with its own toolchain.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::support::{
    RunResult, assert_run_sound, num, read_trace, repo_root, sim_run_args, stderr, tokwatt,
};

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// When a language's toolchain is missing: skip with the reason printed, or fail when the
/// environment variable `require` is `1` (`.ci/run` sets it, so CI never skips).
pub use crate::support::skip_unless_required;

/// A fresh build folder under `target/` (the last build's is removed).
pub fn fresh_folder(name: &str) -> PathBuf {
    let folder = repo_root().join("target").join(name);
    if folder.exists() {
        std::fs::remove_dir_all(&folder).expect("clear the last build");
    }
    std::fs::create_dir_all(&folder).expect("create the build folder");
    folder
}

/// Runs a component build (`tool` with its arguments), failing the test with its
/// output when it fails; prints its wall time under `label`.
pub fn build_component(mut build: Command, label: &str) {
    let started = Instant::now();
    let result = build.output().expect("runs the component build");
    assert!(
        result.status.success(),
        "{label} failed:\n{}\n{}",
        stdout(&result),
        stderr(&result)
    );
    println!("{label}: {:.1} s", started.elapsed().as_secs_f64());
}

/// `tokwatt plugin compile` into `cache`, expecting a fresh compile; its wall time.
pub fn compile_ahead(component: &Path, cache: &Path) -> Duration {
    let started = Instant::now();
    let output = tokwatt()
        .args(["plugin", "compile"])
        .arg(component)
        .arg("--cache-dir")
        .arg(cache)
        .output()
        .expect("runs tokwatt plugin compile");
    let took = started.elapsed();
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        stdout(&output).starts_with("compiled "),
        "{}",
        stdout(&output)
    );
    took
}

/// Prints the component's size and its first-load compile time.
pub fn print_build_figures(label: &str, component: &Path, compile: Duration) {
    let bytes = std::fs::metadata(component).expect("the component").len();
    println!(
        "{label}: component {:.1} MiB; first-load compile {:.1} s (tokwatt plugin compile, beside a second compile)",
        bytes as f64 / (1024.0 * 1024.0),
        compile.as_secs_f64()
    );
}

/// `tokwatt plugin check` on 2 GPUs with a cap parameter: fine, and its state survives
/// a snapshot and restore.
pub fn assert_checks_fine(component: &Path, cache: &Path) {
    let check = tokwatt()
        .args(["plugin", "check"])
        .arg(component)
        .arg("--cache-dir")
        .arg(cache)
        .args(["--gpus", "2", "--params", "power_cap_w=450"])
        .output()
        .expect("runs tokwatt plugin check");
    let text = stdout(&check);
    assert!(check.status.success(), "{text}\n{}", stderr(&check));
    assert!(
        text.lines()
            .last()
            .is_some_and(|verdict| verdict.starts_with("verdict: fine:")),
        "{text}"
    );
    assert!(text.contains("ok     snapshot: state schema 1"), "{text}");
    assert!(
        text.contains("ok     restore: took its own snapshot back"),
        "{text}"
    );
}

/// `tokwatt plugin check` on a variant whose `decide` fails: exit 1, every `decide`
/// failed, the other calls fine, and each of `shown` (the guest's error text) in the
/// output. The whole output, for more checks.
pub fn assert_check_shows_failing_decide(component: &Path, cache: &Path, shown: &[&str]) -> String {
    let check = tokwatt()
        .args(["plugin", "check"])
        .arg(component)
        .arg("--cache-dir")
        .arg(cache)
        .output()
        .expect("runs tokwatt plugin check");
    let text = format!("{}{}", stdout(&check), stderr(&check));
    assert_eq!(check.status.code(), Some(1), "{text}");
    assert!(text.contains("FAILED decide #"), "{text}");
    for needle in shown {
        assert!(text.contains(needle), "{needle:?} not shown:\n{text}");
    }
    // init, snapshot and restore are the example's own and still work.
    assert!(text.contains("ok     init:"), "{text}");
    text
}

/// An example's spec (`examples/LANG/policy.toml`) with its `plugin` pointed at
/// `component`, each of `replacements` (`(from, to)`, each present) made, written as
/// `name` in `folder`. Its path.
pub fn write_example_spec(
    spec_in_repo: &str,
    component: &Path,
    replacements: &[(&str, &str)],
    folder: &Path,
    name: &str,
) -> PathBuf {
    let plugin_line = format!("plugin = \"{}\"", component.display());
    let mut text =
        std::fs::read_to_string(repo_root().join(spec_in_repo)).expect("the example's spec");
    for (from, to) in [("plugin = \"policy.wasm\"", plugin_line.as_str())]
        .iter()
        .chain(replacements)
    {
        assert!(
            text.contains(from),
            "{spec_in_repo} changed: this test rewrites `{from}`"
        );
        text = text.replace(from, to);
    }
    let spec = folder.join(name);
    std::fs::write(&spec, text).expect("write the spec");
    spec
}

/// Runs an example's spec (`examples/LANG/policy.toml`) with `component` and a p99 TPOT
/// limit the simulated H200 breaks at the largest batch, for 30 ticks: the policy must
/// hold its cap and cut the batch tick by tick to 0.8 of its last target, which proves
/// its state lives from call to call. Prints the run's peak RSS where `/usr/bin/time`
/// can tell it. The spec it ran and the run's folder.
pub fn assert_example_spec_runs_keeping_state(
    spec_in_repo: &str,
    component: &Path,
    folder: &Path,
    cache: &Path,
    label: &str,
) -> (PathBuf, PathBuf) {
    let spec = write_example_spec(
        spec_in_repo,
        component,
        &[("tpot_p99_limit_ms = 25.0", "tpot_p99_limit_ms = 10.0")],
        folder,
        "tight.toml",
    );
    let out = folder.join("run");
    let time_v = Path::new("/usr/bin/time");
    let mut run = if time_v.is_file() {
        let mut command = Command::new(time_v);
        command.arg("-v").arg(env!("CARGO_BIN_EXE_tokwatt"));
        command.env_remove("RUST_LOG");
        command
    } else {
        tokwatt()
    };
    let output = run
        .args(sim_run_args(&spec, "30s", &out))
        .args(["--seed", "1"])
        // The tightened bound has the example cut its batch on tick after tick, which the
        // node's guard (tests/all/guard.rs) rightly takes over from after five; here the
        // guest's own steps are under test, so it stays in charge.
        .arg("--no-guard")
        .arg("--cache-dir")
        .arg(cache)
        .output()
        .expect("tokwatt runs");
    assert!(output.status.success(), "{}", stderr(&output));
    let peak = stderr(&output).lines().find_map(|line| {
        line.trim()
            .strip_prefix("Maximum resident set size (kbytes): ")
            .map(str::to_owned)
    });
    match peak {
        Some(kib) => {
            println!("{label}: `tokwatt run` (1 simulated GPU, 30 ticks) peak RSS {kib} KiB")
        }
        None => println!("{label}: peak RSS not measured (no /usr/bin/time -v)"),
    }
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).expect("summary.json"),
    )
    .expect("JSON");
    let result = RunResult {
        summary,
        trace: read_trace(&out.join("trace.csv")),
    };
    assert_run_sound(&result, 30);
    assert_eq!(
        num(&result.summary, "fallback_ticks"),
        0.0,
        "{:#}",
        result.summary
    );
    assert_eq!(num(&result.summary, "plugin_traps"), 0.0);
    for row in &result.trace {
        assert_eq!(row.f64("power_cap_w"), 500.0, "the cap param is held");
    }
    // The batch steps down from the largest, each cut to shrink (0.8) of the one before:
    // the target is remembered from tick to tick in the guest's state.
    let mut batches: Vec<u32> = result
        .trace
        .iter()
        .map(|row| row.f64("batch_size") as u32)
        .collect();
    batches.dedup();
    assert!(
        batches.len() >= 4,
        "the batch moved at most twice: {batches:?}"
    );
    assert_eq!(batches[0], 512, "{batches:?}");
    for pair in batches.windows(2) {
        assert_eq!(
            pair[1],
            pair[0] * 4 / 5,
            "each cut is 0.8 of the last target: {batches:?}"
        );
    }
    (spec, out)
}

/// The author's next steps after a run: `tokwatt replay` feeds the run's observations to
/// the policy again and gets every decision the run recorded (its debug logs shown), and
/// `tokwatt plugin test` puts its tokens per joule beside the default policy and the
/// oracle, labelled as simulator output.
pub fn assert_replays_and_tests(spec: &Path, run: &Path, cache: &Path, policy_name: &str) {
    let replay = tokwatt()
        .arg("replay")
        .arg(run)
        .arg("--policy")
        .arg(spec)
        .arg("--cache-dir")
        .arg(cache)
        .output()
        .expect("runs tokwatt replay");
    let text = stdout(&replay);
    assert!(replay.status.success(), "{text}\n{}", stderr(&replay));
    assert!(
        text.lines().last().is_some_and(
            |last| last.ends_with("30 same as the run, 0 different, 0 decided by the fallback")
        ),
        "{text}"
    );
    assert!(
        text.contains("log debug: gpu 0: batch 512 -> 409"),
        "{text}"
    );

    let test = tokwatt()
        .args(["plugin", "test"])
        .arg(spec)
        .args(["--duration", "60s", "--cache-dir"])
        .arg(cache)
        .output()
        .expect("runs tokwatt plugin test");
    let text = stdout(&test);
    assert!(test.status.success(), "{text}\n{}", stderr(&test));
    assert!(text.contains("labelled simulator output"), "{text}");
    for row in [
        format!("policy {policy_name}"),
        "baseline default".to_owned(),
        "oracle".to_owned(),
    ] {
        assert!(text.contains(&row), "no {row} row:\n{text}");
    }
}
