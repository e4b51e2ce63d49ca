//! A policy written in Python (`examples/python/app.py`), as its author meets it: built
//! with componentize-py against `wit/`, compiled ahead of time into a cache, checked,
//! run on the simulator (state kept between ticks), and a variant whose `decide` raises
//! is refused by `tokwatt plugin check` with the Python traceback shown.
//!
//! componentize-py is a pip package (`pip install componentize-py==0.25.1`): without it
//! the tests skip with the reason printed, and fail instead under
//! `TOKWATT_REQUIRE_PYTHON_COMPONENTS=1` (set by `.ci/run`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::support::{assert_run_sound, num, read_trace, repo_root, stderr, tokwatt};

/// The message the broken variant's `decide` raises; its traceback must show it.
const RAISED: &str = "python-example: decide fails on purpose";

/// The broken variant: the example with a `decide` that raises. A module of its own that
/// imports the example, so the example itself stays as shipped.
const BROKEN_MODULE: &str = "from app import Guest as _Working\n\n\nclass Guest(_Working):\n    def decide(self, observations):\n        raise RuntimeError(\"python-example: decide fails on purpose\")\n";

/// The built components and the cache they were compiled into, shared by the tests.
struct Built {
    policy: PathBuf,
    broken: PathBuf,
    cache: PathBuf,
    folder: PathBuf,
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// componentize-py from PATH, else from Python's user scripts folder (where
/// `pip install --user` puts it), with the reason when neither has it.
fn componentize_py() -> Result<PathBuf, String> {
    let runs = |program: &Path| {
        Command::new(program)
            .arg("--version")
            .output()
            .is_ok_and(|output| output.status.success())
    };
    let on_path = PathBuf::from("componentize-py");
    if runs(&on_path) {
        return Ok(on_path);
    }
    let user_base = Command::new("python3")
        .args(["-m", "site", "--user-base"])
        .output()
        .map_err(|error| format!("python3 is not installed ({error})"))?;
    let user_scripts = PathBuf::from(stdout(&user_base).trim())
        .join("bin")
        .join("componentize-py");
    if runs(&user_scripts) {
        return Ok(user_scripts);
    }
    Err(format!(
        "componentize-py is neither on PATH nor at {}: python3 -m pip install --user componentize-py==0.25.1",
        user_scripts.display()
    ))
}

/// `componentize-py componentize MODULE` from `sources` into `output`.
fn componentize(tool: &Path, sources: &Path, module: &str, output: &Path) {
    let started = Instant::now();
    let result = Command::new(tool)
        .arg("-d")
        .arg(repo_root().join("wit"))
        .args(["-w", "policy", "componentize", "-p"])
        .arg(sources)
        .arg(module)
        .arg("-o")
        .arg(output)
        .output()
        .expect("runs componentize-py");
    assert!(
        result.status.success(),
        "componentize-py {module} failed:\n{}\n{}",
        stdout(&result),
        stderr(&result)
    );
    println!(
        "componentize-py {module}: {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// `tokwatt plugin compile` into `cache`, expecting a fresh compile; its wall time.
fn compile_ahead(component: &Path, cache: &Path) -> Duration {
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

/// Builds the example and its broken variant once per test binary, side by side (each
/// build and compile takes tens of seconds), into a fresh `target/python-policy/`.
/// `None` (with the reason printed) when componentize-py is missing and not required.
fn built() -> Option<&'static Built> {
    static BUILT: OnceLock<Option<Built>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let tool = match componentize_py() {
                Ok(tool) => tool,
                Err(reason) => {
                    assert!(
                        std::env::var_os("TOKWATT_REQUIRE_PYTHON_COMPONENTS").is_none_or(|v| v != "1"),
                        "TOKWATT_REQUIRE_PYTHON_COMPONENTS=1 but {reason}"
                    );
                    println!("skipped: {reason}");
                    return None;
                }
            };
            let folder = repo_root().join("target").join("python-policy");
            if folder.exists() {
                std::fs::remove_dir_all(&folder).expect("clear the last build");
            }
            // The sources are copied so that Python's bytecode cache lands here, not in
            // examples/.
            let sources = folder.join("src");
            std::fs::create_dir_all(&sources).expect("create the build folder");
            std::fs::copy(
                repo_root().join("examples/python/app.py"),
                sources.join("app.py"),
            )
            .expect("copy app.py");
            std::fs::write(sources.join("broken.py"), BROKEN_MODULE).expect("write broken.py");
            let built = Built {
                policy: folder.join("policy.wasm"),
                broken: folder.join("broken.wasm"),
                cache: folder.join("cache"),
                folder,
            };
            let compile_s = std::thread::scope(|scope| {
                let broken = scope.spawn(|| {
                    componentize(&tool, &sources, "broken", &built.broken);
                    compile_ahead(&built.broken, &built.cache)
                });
                componentize(&tool, &sources, "app", &built.policy);
                let policy = compile_ahead(&built.policy, &built.cache);
                broken.join().expect("the broken variant builds");
                policy
            });
            let bytes = std::fs::metadata(&built.policy).expect("policy.wasm").len();
            println!(
                "python example: component {:.1} MiB; first-load compile {:.1} s (tokwatt plugin compile, beside a second compile)",
                bytes as f64 / (1024.0 * 1024.0),
                compile_s.as_secs_f64()
            );
            Some(built)
        })
        .as_ref()
}

#[test]
fn the_python_example_checks_fine_and_runs_keeping_its_state_between_ticks() {
    let Some(built) = built() else { return };
    let check = tokwatt()
        .args(["plugin", "check"])
        .arg(&built.policy)
        .arg("--cache-dir")
        .arg(&built.cache)
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

    // The example spec, with the component built here and a TPOT limit the simulated
    // H200 breaks at the largest batch, so the policy must cut the batch tick by tick.
    let spec_text = std::fs::read_to_string(repo_root().join("examples/python/policy.toml"))
        .expect("examples/python/policy.toml");
    assert!(
        spec_text.contains("plugin = \"policy.wasm\"")
            && spec_text.contains("tpot_p99_limit_ms = 25.0")
    );
    let spec_text = spec_text
        .replace(
            "plugin = \"policy.wasm\"",
            &format!("plugin = \"{}\"", built.policy.display()),
        )
        .replace("tpot_p99_limit_ms = 25.0", "tpot_p99_limit_ms = 10.0");
    let spec = built.folder.join("tight.toml");
    std::fs::write(&spec, spec_text).expect("write the spec");
    let out = built.folder.join("run");
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
        .args([
            "run",
            "--sim",
            "h200",
            "--quiet",
            "--duration",
            "30s",
            "--seed",
            "1",
        ])
        .arg("--policy")
        .arg(&spec)
        .arg("--out")
        .arg(&out)
        .arg("--cache-dir")
        .arg(&built.cache)
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
            println!("python example: `tokwatt run` (1 simulated GPU, 30 ticks) peak RSS {kib} KiB")
        }
        None => println!("python example: peak RSS not measured (no /usr/bin/time -v)"),
    }
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).expect("summary.json"),
    )
    .expect("JSON");
    let result = crate::support::RunResult {
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
    // the target is remembered from tick to tick in the module's state.
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
}

#[test]
fn a_python_decide_that_raises_is_not_fine_and_its_traceback_is_shown() {
    let Some(built) = built() else { return };
    let check = tokwatt()
        .args(["plugin", "check"])
        .arg(&built.broken)
        .arg("--cache-dir")
        .arg(&built.cache)
        .output()
        .expect("runs tokwatt plugin check");
    let text = format!("{}{}", stdout(&check), stderr(&check));
    assert_eq!(check.status.code(), Some(1), "{text}");
    assert!(text.contains("FAILED decide #"), "{text}");
    assert!(text.contains("Traceback (most recent call last)"), "{text}");
    assert!(text.contains(&format!("RuntimeError: {RAISED}")), "{text}");
    // init, snapshot and restore are the example's own and still work.
    assert!(text.contains("ok     init:"), "{text}");
}
