//! `tokwatt plugin new` and `tokwatt plugin test`, as a plugin author meets them: the
//! Rust scaffold builds for WebAssembly, passes its own tests natively, loads under
//! `tokwatt check` and runs under `tokwatt plugin test`; the Python and JavaScript
//! scaffolds pass their rules' tests, build with their toolchains, check fine and run.
//!
//! The Python scaffold needs componentize-py, the JavaScript one Node.js, npm and
//! componentize-js 0.23.0 in npm's cache (`npm ci` in `examples/js` puts it there): without
//! them the tests skip with the reason printed, and fail instead under
//! `TOKWATT_REQUIRE_PYTHON_COMPONENTS=1` or `TOKWATT_REQUIRE_JS_COMPONENTS=1`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::guest_lang::{
    assert_checks_fine, build_component, compile_ahead, fresh_folder, skip_unless_required,
};
use crate::python_policy::componentize_py;
use crate::support::{built_plugin, repo_root, sim_run, stderr, tempdir, tokwatt};

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Runs cargo in the scaffold, with the build folder under the workspace's `target/` so
/// repeated runs reuse it (`--offline`: the SDK's dependencies are the workspace's).
fn cargo_in(scaffold: &Path, args: &[&str]) {
    let output = Command::new(env!("CARGO"))
        .current_dir(scaffold)
        .args(args)
        .arg("--offline")
        .env(
            "CARGO_TARGET_DIR",
            repo_root().join("target").join("plugin-new-scaffold"),
        )
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET")
        .output()
        .expect("run cargo");
    assert!(
        output.status.success(),
        "cargo {args:?} in the scaffold failed:\n{}",
        stderr(&output)
    );
}

/// The rows of `plugin test`'s table: (label, tokens per joule).
fn table_rows(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter_map(|line| {
            // │ label ┆ tok/J ┆ vs oracle ┆ over objective ┆ served │
            let cells: Vec<&str> = line.split(['│', '┆']).map(str::trim).collect();
            let label = cells.get(1)?;
            let tokens_per_joule: f64 = cells.get(2)?.parse().ok()?;
            Some(((*label).to_owned(), tokens_per_joule))
        })
        .collect()
}

fn assert_three_rows(text: &str, policy: &str) {
    let rows = table_rows(text);
    let labels: Vec<&str> = rows.iter().map(|(label, _)| label.as_str()).collect();
    assert_eq!(
        labels,
        [
            format!("policy {policy}").as_str(),
            "baseline default",
            "oracle"
        ],
        "{text}"
    );
    for (label, tokens_per_joule) in &rows {
        assert!(
            tokens_per_joule.is_finite() && *tokens_per_joule > 0.0,
            "{label}: {tokens_per_joule}\n{text}"
        );
    }
    assert!(text.contains("simulator output"), "{text}");
}

/// Slow (a minute or more the first time): builds the scaffold with cargo twice, for
/// WebAssembly and natively, into target/plugin-new-scaffold.
#[test]
fn a_scaffolded_policy_builds_passes_its_tests_loads_and_runs() {
    if !crate::support::run_slow("building a scaffolded Rust policy") {
        return;
    }
    let dir = tempdir();
    let scaffold = dir.path().join("demo-policy");
    let output = tokwatt()
        .args(["plugin", "new", "demo-policy", "--dir"])
        .arg(&scaffold)
        .output()
        .expect("tokwatt runs");
    assert!(output.status.success(), "{}", stderr(&output));
    for file in [
        "Cargo.toml",
        "src/lib.rs",
        "demo-policy.toml",
        "README.md",
        ".gitignore",
    ] {
        assert!(scaffold.join(file).is_file(), "{file} not written");
    }
    let readme = std::fs::read_to_string(scaffold.join("README.md")).expect("README");
    assert!(readme.contains("rustup target add wasm32-wasip2"));
    assert!(readme.contains("cargo build --release --target wasm32-wasip2"));

    cargo_in(
        &scaffold,
        &["build", "--release", "--target", "wasm32-wasip2"],
    );
    cargo_in(&scaffold, &["test"]);
    // Where the spec looks for the component (the build went to the shared folder).
    let built =
        repo_root().join("target/plugin-new-scaffold/wasm32-wasip2/release/demo_policy.wasm");
    let expected = scaffold.join("target/wasm32-wasip2/release/demo_policy.wasm");
    std::fs::create_dir_all(expected.parent().expect("a folder")).expect("mkdir");
    std::fs::copy(&built, &expected).expect("copy the component");

    let spec = scaffold.join("demo-policy.toml");
    let check = tokwatt().arg("check").arg(&spec).output().expect("runs");
    assert!(check.status.success(), "{}", stderr(&check));
    assert!(
        stdout(&check).starts_with("ok: demo-policy"),
        "{}",
        stdout(&check)
    );

    let test = tokwatt()
        .args(["plugin", "test", "--duration", "3m"])
        .arg(&spec)
        .output()
        .expect("runs");
    assert!(test.status.success(), "{}", stderr(&test));
    assert_three_rows(&stdout(&test), "demo-policy");
}

#[test]
fn plugin_test_of_a_shipped_policy_prints_three_rows() {
    let output = tokwatt()
        .args(["plugin", "test", "--duration", "2m"])
        .arg(repo_root().join("policies/static.toml"))
        .output()
        .expect("runs");
    assert!(output.status.success(), "{}", stderr(&output));
    assert_three_rows(&stdout(&output), "static");
}

#[test]
fn plugin_test_of_a_bare_component_says_it_made_a_spec() {
    let output = tokwatt()
        .args(["plugin", "test", "--duration", "2m"])
        .arg(built_plugin("policy_default"))
        .output()
        .expect("runs");
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    assert!(text.contains("runs under a minimal spec"), "{text}");
    assert_three_rows(&text, "policy_default");
}

#[test]
fn bad_names_existing_folders_and_other_languages_are_refused() {
    let dir = tempdir();
    for (name, why) in [
        ("2fast", "must start with a letter"),
        ("my policy", "contains ' '"),
        ("fn", "keyword"),
    ] {
        let output = tokwatt()
            .args(["plugin", "new", name, "--dir"])
            .arg(dir.path().join("x"))
            .output()
            .expect("runs");
        assert!(!output.status.success(), "{name} accepted");
        let error = stderr(&output);
        assert!(
            error.contains("not a valid crate name") && error.contains(why),
            "{name}: {error}"
        );
    }
    assert!(!dir.path().join("x").exists(), "a refused name wrote files");

    let taken = dir.path().join("taken");
    std::fs::create_dir_all(&taken).expect("mkdir");
    std::fs::write(taken.join("notes.txt"), "mine").expect("write");
    let output = tokwatt()
        .args(["plugin", "new", "ok-name", "--dir"])
        .arg(&taken)
        .output()
        .expect("runs");
    assert!(!output.status.success());
    assert!(stderr(&output).contains("not empty"), "{}", stderr(&output));
    assert_eq!(
        std::fs::read_dir(&taken).expect("list").count(),
        1,
        "the refused folder changed"
    );

    // The SDK is a Rust crate: Python and JavaScript refuse it rather than ignore it.
    for lang in ["python", "js"] {
        let output = tokwatt()
            .args([
                "plugin",
                "new",
                "ok-name",
                "--lang",
                lang,
                "--sdk",
                "plugins/sdk",
            ])
            .arg("--dir")
            .arg(dir.path().join(lang))
            .output()
            .expect("runs");
        assert!(!output.status.success(), "--sdk accepted for --lang {lang}");
        let error = stderr(&output);
        assert!(error.contains("drop --sdk"), "{error}");
        assert!(!dir.path().join(lang).exists());
    }
    // npm refuses uppercase in a package name; the error gives the lowercase one.
    let output = tokwatt()
        .args(["plugin", "new", "MyPolicy", "--lang", "js", "--dir"])
        .arg(dir.path().join("js"))
        .output()
        .expect("runs");
    assert!(!output.status.success(), "an uppercase npm name accepted");
    let error = stderr(&output);
    assert!(
        error.contains("uppercase") && error.contains("`mypolicy`"),
        "{error}"
    );
    assert!(!dir.path().join("js").exists());
}

/// `tokwatt plugin new NAME --lang LANG` into a fresh `target/plugin-new-LANG/`: the
/// scaffold's folder, and the build folder around it (for the cache and the run).
fn scaffold(lang: &str, name: &str) -> (PathBuf, PathBuf) {
    let folder = fresh_folder(&format!("plugin-new-{lang}"));
    let scaffold = folder.join(name);
    let output = tokwatt()
        .args(["plugin", "new", name, "--lang", lang, "--dir"])
        .arg(&scaffold)
        .output()
        .expect("tokwatt runs");
    assert!(output.status.success(), "{}", stderr(&output));
    let next = stdout(&output);
    assert!(
        next.contains("tokwatt plugin compile policy.wasm")
            && next.contains(&format!("tokwatt check {name}.toml")),
        "{next}"
    );
    for file in [
        "README.md",
        ".gitignore",
        "wit/policy.wit",
        &format!("{name}.toml"),
    ] {
        assert!(scaffold.join(file).is_file(), "{lang}: {file} not written");
    }
    (scaffold, folder)
}

/// Runs `program` in the scaffold, failing the test with its output when it fails; its
/// standard output and error together.
fn run_in(scaffold: &Path, program: &str, args: &[&str]) -> String {
    let output = Command::new(program)
        .current_dir(scaffold)
        .args(args)
        .output()
        .unwrap_or_else(|error| panic!("{program} does not run: {error}"));
    let text = format!("{}{}", stdout(&output), stderr(&output));
    assert!(
        output.status.success(),
        "{program} {args:?} in the scaffold failed:\n{text}"
    );
    text
}

/// The built scaffold as its README goes on: compiled ahead into a cache, checked fine,
/// its spec loaded by `tokwatt check` and run for 10 simulated seconds.
fn assert_built_scaffold_checks_and_runs(scaffold: &Path, folder: &Path, name: &str) {
    let component = scaffold.join("policy.wasm");
    let cache = folder.join("cache");
    compile_ahead(&component, &cache);
    assert_checks_fine(&component, &cache);
    let spec = scaffold.join(format!("{name}.toml"));
    let check = tokwatt()
        .env("TOKWATT_CACHE_DIR", &cache)
        .arg("check")
        .arg(&spec)
        .output()
        .expect("runs");
    assert!(check.status.success(), "{}", stderr(&check));
    assert!(
        stdout(&check).starts_with(&format!("ok: {name}")),
        "{}",
        stdout(&check)
    );
    let run = sim_run(&spec, "10s", &folder.join("run"))
        .arg("--cache-dir")
        .arg(&cache)
        .output()
        .expect("runs");
    assert!(run.status.success(), "{}", stderr(&run));
    assert!(stdout(&run).contains("plugin traps 0"), "{}", stdout(&run));
}

/// The number in `marker N` (`Ran 5 tests`, `# pass 5`) in a test runner's output.
fn count_after(text: &str, marker: &str) -> usize {
    text.split(marker)
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|count| count.parse().ok())
        .unwrap_or_else(|| panic!("no `{marker} N` in:\n{text}"))
}

/// Slow (about a minute: the component build and its first compile).
#[test]
fn a_scaffolded_python_policy_passes_its_tests_builds_checks_fine_and_runs() {
    let tool = match componentize_py() {
        Ok(tool) => tool,
        Err(reason) => {
            skip_unless_required("TOKWATT_REQUIRE_PYTHON_COMPONENTS", &reason);
            return;
        }
    };
    let (scaffold, folder) = scaffold("python", "demo-py");
    let tests = run_in(&scaffold, "python3", &["-m", "unittest"]);
    assert!(count_after(&tests, "Ran ") > 0, "{tests}");
    let mut build = Command::new(tool);
    build.current_dir(&scaffold).args([
        "-d",
        "wit",
        "-w",
        "policy",
        "componentize",
        "app",
        "-o",
        "policy.wasm",
    ]);
    build_component(build, "componentize-py in the scaffold");
    assert_built_scaffold_checks_and_runs(&scaffold, &folder, "demo-py");
}

/// Slow (about a minute: npm's install from its cache, the build and the first
/// compile).
#[test]
fn a_scaffolded_javascript_policy_passes_its_tests_builds_checks_fine_and_runs() {
    const REQUIRE: &str = "TOKWATT_REQUIRE_JS_COMPONENTS";
    for program in ["node", "npm"] {
        let runs = Command::new(program)
            .arg("--version")
            .output()
            .is_ok_and(|output| output.status.success());
        if !runs {
            skip_unless_required(
                REQUIRE,
                format!("{program} is not installed ({program} --version failed)"),
            );
            return;
        }
    }
    let (scaffold, folder) = scaffold("js", "demo-js");
    // The scaffold's lockfile pins every package, so npm needs only their tarballs, which
    // `npm ci` in examples/js put in its cache: the test never reaches the network.
    let install = Command::new("npm")
        .current_dir(&scaffold)
        .args(["ci", "--offline", "--no-audit", "--no-fund"])
        .output()
        .expect("npm runs");
    if !install.status.success() {
        skip_unless_required(
            REQUIRE,
            format!(
                "npm ci --offline failed, so npm's cache lacks componentize-js 0.23.0 \
                 (run `npm ci` in examples/js once to fill it):\n{}",
                stderr(&install)
            ),
        );
        return;
    }
    let tests = run_in(&scaffold, "npm", &["test"]);
    assert!(count_after(&tests, "# pass ") > 0, "{tests}");
    assert_eq!(count_after(&tests, "# fail "), 0, "{tests}");
    let mut build = Command::new("npm");
    build.current_dir(&scaffold).args(["run", "build"]);
    build_component(build, "npm run build in the scaffold");
    assert_built_scaffold_checks_and_runs(&scaffold, &folder, "demo-js");
}
