//! A policy written in Python (`examples/python/app.py`), as its author meets it: built
//! with componentize-py against `wit/`, compiled ahead of time into a cache, checked,
//! run on the simulator (state kept between ticks), and a variant whose `decide` raises
//! is refused by `tokwatt plugin check` with the Python traceback shown.
//!
//! componentize-py is a pip package (`pip install componentize-py==0.25.1`): without it
//! the tests skip with the reason printed, and fail instead under
//! `TOKWATT_REQUIRE_PYTHON_COMPONENTS=1` (set by `.ci/run`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::guest_lang::{
    assert_check_shows_failing_decide, assert_checks_fine, assert_example_spec_runs_keeping_state,
    assert_replays_and_tests, build_component, compile_ahead, fresh_folder, print_build_figures,
    skip_unless_required, stdout,
};
use crate::support::repo_root;

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

/// componentize-py from PATH, else from Python's user scripts folder (where
/// `pip install --user` puts it), with the reason when neither has it.
pub fn componentize_py() -> Result<PathBuf, String> {
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
    let mut build = Command::new(tool);
    build
        .arg("-d")
        .arg(repo_root().join("wit"))
        .args(["-w", "policy", "componentize", "-p"])
        .arg(sources)
        .arg(module)
        .arg("-o")
        .arg(output);
    build_component(build, &format!("componentize-py {module}"));
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
                    skip_unless_required("TOKWATT_REQUIRE_PYTHON_COMPONENTS", &reason);
                    return None;
                }
            };
            let folder = fresh_folder("python-policy");
            // The sources are copied so that Python's bytecode cache lands here, not in
            // examples/.
            let sources = folder.join("src");
            std::fs::create_dir_all(&sources).expect("create the sources folder");
            for source in ["app.py", "rules.py"] {
                std::fs::copy(
                    repo_root().join("examples/python").join(source),
                    sources.join(source),
                )
                .expect("copy the example's sources");
            }
            std::fs::write(sources.join("broken.py"), BROKEN_MODULE).expect("write broken.py");
            let built = Built {
                policy: folder.join("policy.wasm"),
                broken: folder.join("broken.wasm"),
                cache: folder.join("cache"),
                folder,
            };
            let compile = std::thread::scope(|scope| {
                let broken = scope.spawn(|| {
                    componentize(&tool, &sources, "broken", &built.broken);
                    compile_ahead(&built.broken, &built.cache)
                });
                componentize(&tool, &sources, "app", &built.policy);
                let policy = compile_ahead(&built.policy, &built.cache);
                broken.join().expect("the broken variant builds");
                policy
            });
            print_build_figures("python example", &built.policy, compile);
            Some(built)
        })
        .as_ref()
}

#[test]
fn the_python_example_checks_fine_runs_keeping_its_state_replays_and_tests() {
    let Some(built) = built() else { return };
    assert_checks_fine(&built.policy, &built.cache);
    let (spec, run) = assert_example_spec_runs_keeping_state(
        "examples/python/policy.toml",
        &built.policy,
        &built.folder,
        &built.cache,
        "python example",
    );
    assert_replays_and_tests(&spec, &run, &built.cache, "python-example");
}

#[test]
fn a_python_decide_that_raises_is_not_fine_and_its_traceback_is_shown() {
    let Some(built) = built() else { return };
    assert_check_shows_failing_decide(
        &built.broken,
        &built.cache,
        &[
            "Traceback (most recent call last)",
            &format!("RuntimeError: {RAISED}"),
        ],
    );
}
