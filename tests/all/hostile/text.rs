//! Text from plugins reaches the operator escaped, on one line, and bounded.

use super::*;

#[test]
fn a_hostile_init_error_is_escaped_and_cut() {
    let output = run_refused(
        &built_plugin("fixture_hostile"),
        &hostile_extra("hostile-error", ""),
    );
    let err = stderr(&output);
    assert!(err.contains("\\u{1b}[2J"), "shown escaped: {err}");
    assert!(err.contains("\\nERROR fake line"), "{err}");
    assert!(err.contains("bytes cut"), "{err}");
}

#[test]
fn log_messages_with_escapes_and_newlines_are_escaped() {
    for mode in ["escape-log", "huge-log"] {
        let dir = tempdir();
        let spec = write_spec(
            dir.path(),
            mode,
            &built_plugin("fixture_hostile"),
            &hostile_extra(mode, ""),
        );
        let output = sim_run(&spec, "5s", &dir.path().join("out"))
            .env("RUST_LOG", "warn")
            .output()
            .expect("runs");
        assert!(output.status.success(), "{}", stderr(&output));
        let err = stderr(&output);
        assert_no_raw_text(&err);
        let shown = if mode == "escape-log" {
            "cleared\\nERROR fake line"
        } else {
            "bytes cut"
        };
        assert!(err.contains(shown), "{mode}: {err}");
    }
}
