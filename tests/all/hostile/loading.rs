//! Files that are not tokwatt policies are refused before the run, naming why.

use super::*;

fn refused_bytes(bytes: &[u8]) -> String {
    let dir = tempdir();
    let plugin = plugin_file(dir.path(), "plugin.wasm", bytes);
    stderr(&run_refused(&plugin, ""))
}

#[test]
fn a_truncated_file_is_called_truncated() {
    let err = refused_bytes(b"\0asm");
    assert!(
        err.contains("truncated") && err.contains("4 bytes"),
        "{err}"
    );
    let err = refused_bytes(b"");
    assert!(
        err.contains("truncated") && err.contains("0 bytes"),
        "{err}"
    );
}

#[test]
fn garbage_is_not_webassembly() {
    let mut garbage = b"\x1b[2J\nERROR fake line\n".to_vec();
    garbage.extend((0..4096_u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8));
    let err = refused_bytes(&garbage);
    assert!(err.contains("not a WebAssembly file"), "{err}");
}

#[test]
fn a_cut_component_is_invalid() {
    let whole = std::fs::read(built_plugin("fixture_stateful")).expect("read");
    let err = refused_bytes(&whole[..whole.len() / 2]);
    assert!(err.contains("not a valid WebAssembly component"), "{err}");
}

#[test]
fn a_core_module_is_not_a_component() {
    // The smallest core module: magic, version 1, no sections.
    let err = refused_bytes(b"\0asm\x01\0\0\0");
    assert!(err.contains("core WebAssembly module"), "{err}");
}

#[test]
fn other_contract_versions_are_refused() {
    let dir = tempdir();
    let spec = write_spec(dir.path(), "v1", &built_plugin("fixture_wrong_version"), "");
    let output = tokwatt().arg("check").arg(&spec).output().expect("runs");
    assert!(!output.status.success());
    let err = stderr(&output);
    assert!(
        err.contains("1.0.0") && err.contains("0.4.* or 0.3.* or 0.2.* or 0.1.*"),
        "{err}"
    );
}

#[test]
fn a_wrong_signature_is_refused_naming_the_function() {
    let err = stderr(&run_refused(&built_plugin("fixture_wrong_signature"), ""));
    assert!(
        err.contains("`decide`") && err.contains("wrong types"),
        "{err}"
    );
    assert!(err.contains("expected") && err.contains("found"), "{err}");
}
