//! `tokwatt plugin new` and `tokwatt plugin test`, as a plugin author meets them: the
//! scaffold builds for WebAssembly, passes its own tests natively, loads under
//! `tokwatt check` and runs under `tokwatt plugin test`.

use std::path::Path;
use std::process::{Command, Output};

use crate::support::{built_plugin, repo_root, stderr, tempdir, tokwatt};

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

    for (lang, toolchain) in [("python", "componentize-py"), ("js", "componentize-js")] {
        let output = tokwatt()
            .args(["plugin", "new", "ok-name", "--lang", lang, "--dir"])
            .arg(dir.path().join(lang))
            .output()
            .expect("runs");
        assert!(!output.status.success(), "--lang {lang} accepted");
        let error = stderr(&output);
        assert!(
            error.contains(toolchain) && error.contains("--lang rust"),
            "{error}"
        );
        assert!(!dir.path().join(lang).exists());
    }
}
