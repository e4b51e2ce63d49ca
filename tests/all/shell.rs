//! `tokwatt completions SHELL` and `tokwatt man`: made from the clap definition that parses
//! the command line, checked by the tools that read them (bash parses the completion
//! script; groff renders every man page with no macro, escape or character it cannot).

use std::process::Command;

use crate::support::*;

fn stdout_of(args: &[&str]) -> String {
    let output = tokwatt().args(args).output().expect("tokwatt runs");
    assert!(
        output.status.success(),
        "tokwatt {args:?} failed: {}",
        stderr(&output)
    );
    String::from_utf8(output.stdout).expect("UTF-8")
}

#[test]
fn completions_complete_every_subcommand_and_bash_parses_them() {
    let bash = stdout_of(&["completions", "bash"]);
    for subcommand in ["run", "ab", "tune", "eval", "report", "completions", "man"] {
        assert!(
            bash.contains(&format!("tokwatt,{subcommand})")),
            "bash completes {subcommand}"
        );
    }
    // A flag of a nested subcommand.
    assert!(bash.contains("--baseline"), "plugin test's flags");
    // From a file: the script is over the 128 KiB one argument may be (`bash -c SCRIPT`
    // fails with E2BIG), as a user's completion file is read.
    let dir = tempdir();
    let script = dir.path().join("tokwatt.bash");
    std::fs::write(&script, &bash).expect("the completion script");
    let parsed = Command::new("bash")
        .arg("-n")
        .arg(&script)
        .output()
        .expect("bash runs");
    assert!(parsed.status.success(), "{}", stderr(&parsed));

    assert!(stdout_of(&["completions", "zsh"]).starts_with("#compdef tokwatt"));
    assert!(stdout_of(&["completions", "fish"]).contains("complete -c tokwatt"));
    let refused = tokwatt()
        .args(["completions", "tcsh"])
        .output()
        .expect("tokwatt runs");
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("possible values"),
        "{}",
        stderr(&refused)
    );
}

#[test]
fn man_prints_the_page_and_writes_one_per_subcommand() {
    let page = stdout_of(&["man"]);
    assert!(page.contains(".TH tokwatt 1"), "{page}");
    assert!(
        page.contains("completions"),
        "the page lists the subcommands"
    );

    let dir = tempdir();
    let said = stdout_of(&["man", "--out", dir.path().to_str().expect("utf-8")]);
    let mut pages: Vec<String> = std::fs::read_dir(dir.path())
        .expect("the folder")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    pages.sort();
    assert!(
        said.contains(&format!("wrote {} man pages", pages.len())),
        "{said}"
    );
    for expected in [
        "tokwatt.1",
        "tokwatt-run.1",
        "tokwatt-plugin-test.1",
        "tokwatt-fleet-show.1",
        "tokwatt-report.1",
    ] {
        assert!(
            pages.iter().any(|p| p == expected),
            "{expected} in {pages:?}"
        );
    }
    assert!(!pages.iter().any(|p| p.contains("help")), "{pages:?}");
    let run = std::fs::read_to_string(dir.path().join("tokwatt-run.1")).expect("page");
    assert!(
        run.contains("tokwatt run") && run.contains("\\-\\-json"),
        "{run}"
    );

    let Some(groff) = required_tool(
        "groff",
        "TOKWATT_REQUIRE_DEPLOY_TOOLS",
        "apt-get install groff-base",
    ) else {
        return;
    };
    for page in &pages {
        let rendered = Command::new(groff)
            // Warnings of what would render wrong (an undefined macro or escape, a
            // character with no glyph, bad input), not of a long line's spacing.
            .args([
                "-k", "-man", "-Tutf8", "-z", "-wmac", "-wescape", "-wchar", "-winput", "-Wbreak",
            ])
            .arg(dir.path().join(page))
            .output()
            .expect("groff runs");
        assert!(
            rendered.status.success() && rendered.stderr.is_empty(),
            "groff on {page}: {}",
            stderr(&rendered)
        );
    }
}
