//! A policy written in JavaScript (`examples/js/`), as its author meets it: its rules'
//! own tests under Node.js (`npm test`), built with componentize-js against `wit/`,
//! compiled ahead of time into a cache, checked, and run on the simulator (state kept
//! between ticks); a variant whose `decide` throws is refused by `tokwatt plugin check`
//! with the JavaScript error and stack shown; a default build, which imports `wasi:http`,
//! is refused by name before anything is compiled.
//!
//! componentize-js is an npm package: `npm ci` in `examples/js` installs the pinned
//! version (0.23.0). Without it (or without Node.js) the tests skip with the reason
//! printed, and fail instead under `TOKWATT_REQUIRE_JS_COMPONENTS=1` (set by `.ci/run`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Instant;

use crate::guest_lang::{
    assert_check_shows_failing_decide, assert_checks_fine, assert_example_spec_runs_keeping_state,
    assert_replays_and_tests, build_component, compile_ahead, fresh_folder, print_build_figures,
    skip_unless_required, stdout, write_example_spec,
};
use crate::support::{repo_root, sim_run, stderr, tokwatt};

/// The message the broken variant's `decide` throws; the check must show it.
const THROWN: &str = "js-example: decide fails on purpose";

/// The broken variant: the example with a `decide` that throws. A module of its own that
/// imports the example, so the example itself stays as shipped.
const BROKEN_MODULE: &str = "import { guest as working } from \"./policy.js\";\n\nexport const guest = {\n  ...working,\n  decide(observations) {\n    throw new Error(\"js-example: decide fails on purpose\");\n  },\n};\n";

/// The example's sources, copied into the build folder.
const SOURCES: [&str; 3] = ["policy.js", "rules.js", "rules.test.js"];

/// The built components and the cache they were compiled into, shared by the tests.
struct Built {
    policy: PathBuf,
    broken: PathBuf,
    with_http: PathBuf,
    sources: PathBuf,
    cache: PathBuf,
    folder: PathBuf,
}

/// componentize-js from `examples/js/node_modules` (where `npm ci` puts the pinned
/// version), else from PATH, with the reason when neither has it.
fn componentize_js() -> Result<PathBuf, String> {
    let runs = |program: &Path| {
        Command::new(program)
            .arg("--version")
            .output()
            .is_ok_and(|output| output.status.success())
    };
    if !runs(Path::new("node")) {
        return Err("Node.js is not installed (node --version failed)".to_owned());
    }
    let installed = repo_root().join("examples/js/node_modules/.bin/componentize-js");
    if runs(&installed) {
        return Ok(installed);
    }
    let on_path = PathBuf::from("componentize-js");
    if runs(&on_path) {
        return Ok(on_path);
    }
    Err(format!(
        "componentize-js is neither at {} nor on PATH: (cd examples/js && npm ci)",
        installed.display()
    ))
}

/// `componentize-js SOURCE` into `output`, without `wasi:http` unless `with_http`.
fn componentize(tool: &Path, source: &Path, output: &Path, with_http: bool) {
    let mut build = Command::new(tool);
    build
        .arg(source)
        .arg("--wit")
        .arg(repo_root().join("wit"))
        .args(["--world-name", "policy"]);
    if !with_http {
        build.args(["--disable", "http", "fetch-event"]);
    }
    build.arg("-o").arg(output);
    let name = source.file_name().unwrap_or_default().to_string_lossy();
    build_component(build, &format!("componentize-js {name}"));
}

/// Builds the example, its broken variant and a default (HTTP) build once per test
/// binary into a fresh `target/js-policy/`. `None` (with the reason printed) when
/// componentize-js is missing and not required.
fn built() -> Option<&'static Built> {
    static BUILT: OnceLock<Option<Built>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let tool = match componentize_js() {
                Ok(tool) => tool,
                Err(reason) => {
                    skip_unless_required("TOKWATT_REQUIRE_JS_COMPONENTS", &reason);
                    return None;
                }
            };
            let folder = fresh_folder("js-policy");
            let sources = folder.join("src");
            std::fs::create_dir_all(&sources).expect("create the sources folder");
            for source in SOURCES {
                std::fs::copy(
                    repo_root().join("examples/js").join(source),
                    sources.join(source),
                )
                .unwrap_or_else(|error| panic!("copy {source}: {error}"));
            }
            std::fs::write(sources.join("broken.js"), BROKEN_MODULE).expect("write broken.js");
            let built = Built {
                policy: folder.join("policy.wasm"),
                broken: folder.join("broken.wasm"),
                with_http: folder.join("with-http.wasm"),
                cache: folder.join("cache"),
                sources,
                folder,
            };
            let compile = std::thread::scope(|scope| {
                let broken = scope.spawn(|| {
                    componentize(
                        &tool,
                        &built.sources.join("broken.js"),
                        &built.broken,
                        false,
                    );
                    compile_ahead(&built.broken, &built.cache);
                    componentize(
                        &tool,
                        &built.sources.join("policy.js"),
                        &built.with_http,
                        true,
                    );
                });
                componentize(
                    &tool,
                    &built.sources.join("policy.js"),
                    &built.policy,
                    false,
                );
                let policy = compile_ahead(&built.policy, &built.cache);
                broken.join().expect("the variants build");
                policy
            });
            print_build_figures("js example", &built.policy, compile);
            Some(built)
        })
        .as_ref()
}

#[test]
fn the_js_example_rules_pass_their_own_node_tests() {
    let Some(built) = built() else { return };
    // `npm test` is `node --test`: the same runner, on the copied sources.
    let test = Command::new("node")
        .arg("--test")
        .current_dir(&built.sources)
        .output()
        .expect("runs node --test");
    let text = stdout(&test);
    assert!(test.status.success(), "{text}\n{}", stderr(&test));
    assert!(text.contains("# fail 0"), "{text}");
    assert!(!text.contains("# pass 0"), "no test ran:\n{text}");
}

#[test]
fn the_js_example_checks_fine_runs_keeping_its_state_replays_and_tests() {
    let Some(built) = built() else { return };
    assert_checks_fine(&built.policy, &built.cache);
    let (spec, run) = assert_example_spec_runs_keeping_state(
        "examples/js/policy.toml",
        &built.policy,
        &built.folder,
        &built.cache,
        "js example",
    );
    assert_replays_and_tests(&spec, &run, &built.cache, "js-example");
}

#[test]
fn a_js_decide_that_throws_is_not_fine_and_its_error_and_stack_are_shown() {
    let Some(built) = built() else { return };
    assert_check_shows_failing_decide(
        &built.broken,
        &built.cache,
        &[THROWN, "decide@", "broken.js:"],
    );
}

#[test]
fn a_default_js_build_that_imports_http_is_refused_by_name_before_compiling() {
    let Some(built) = built() else { return };
    // A cache of its own, so that nothing could have compiled it beforehand.
    let cache = built.folder.join("cache-http");
    let started = Instant::now();
    let check = tokwatt()
        .args(["plugin", "check"])
        .arg(&built.with_http)
        .arg("--cache-dir")
        .arg(&cache)
        .output()
        .expect("runs tokwatt plugin check");
    let text = stdout(&check);
    assert_eq!(check.status.code(), Some(1), "{text}\n{}", stderr(&check));
    assert!(text.contains("imports `wasi:http/"), "{text}");
    assert!(text.contains("--disable http"), "the fix is named:\n{text}");
    assert!(text.contains("(nothing was run)"), "{text}");
    println!(
        "js example with wasi:http: refused in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    // The agent refuses it the same way at start, naming the import and the fix.
    let spec = write_example_spec(
        "examples/js/policy.toml",
        &built.with_http,
        &[],
        &built.folder,
        "with-http.toml",
    );
    let run = sim_run(&spec, "5s", &built.folder.join("run-with-http"))
        .arg("--cache-dir")
        .arg(&cache)
        .output()
        .expect("tokwatt runs");
    let refusal = stderr(&run);
    assert!(!run.status.success(), "{refusal}");
    assert!(refusal.contains("imports `wasi:http/"), "{refusal}");
    assert!(refusal.contains("--disable http"), "{refusal}");
    // Refused before compiling, by both: nothing was written to the cache.
    let compiled = std::fs::read_dir(&cache).map_or(0, |entries| entries.count());
    assert_eq!(compiled, 0, "a refused component was compiled");
}
