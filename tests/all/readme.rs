//! The README's first two commands are the project's front door: the main job and the
//! tests. The first must run as written on a machine without a GPU; this runs it with the
//! binary the tests built (what `cargo run -p tokwatt --` runs), writing into a temporary
//! folder instead of `out/`. The second must be the command CI runs.

use crate::support::{repo_root, stderr, tempdir, tokwatt};

/// The README's first `sh` block: the main command, then the test command.
fn front_door() -> (String, String) {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let block = readme
        .split("```sh\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the README starts with a ```sh block");
    let mut lines = block.lines();
    let main = lines.next().expect("the main command").to_owned();
    let test = lines.next().expect("the test command").to_owned();
    (main, test)
}

#[test]
fn the_readmes_main_command_runs_as_written_without_a_gpu() {
    let (main, _) = front_door();
    let args = main
        .strip_prefix("cargo run -p tokwatt -- ")
        .unwrap_or_else(|| panic!("the main command runs tokwatt through cargo: {main}"));
    let dir = tempdir();
    let out = dir.path().join("run");
    let output = tokwatt()
        .current_dir(repo_root())
        .args(args.split_whitespace())
        .arg("--quiet")
        .arg("--out")
        .arg(&out)
        .output()
        .expect("runs");
    assert!(
        output.status.success(),
        "`{main}` failed:\n{}",
        stderr(&output)
    );
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).expect("summary.json written"),
    )
    .expect("summary.json is JSON");
    assert_eq!(summary["simulated"], true, "no GPU needed: {summary}");
    assert!(summary["ticks"].as_u64().is_some_and(|ticks| ticks > 0));
}

#[test]
fn the_readmes_test_command_is_the_one_ci_runs() {
    let (_, test) = front_door();
    let ci = std::fs::read_to_string(repo_root().join(".ci/run")).expect(".ci/run");
    assert!(
        ci.lines().any(|line| line.trim() == test),
        ".ci/run does not run the README's test command `{test}`"
    );
}
