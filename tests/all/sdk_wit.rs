//! The SDK carries its own copy of the contract (`plugins/sdk/wit/policy.wit`) so that the
//! published crate builds on its own; the host builds against `wit/policy.wit`. A policy
//! built with the SDK must meet exactly the contract the host checks, so the two files
//! must be the same, byte for byte.

use std::path::Path;

use crate::support::repo_root;

/// The contract the host is built against.
const HOST_WIT: &str = "wit/policy.wit";
/// The SDK's vendored copy, which its bindings are generated from.
const SDK_WIT: &str = "plugins/sdk/wit/policy.wit";

fn read(root: &Path, relative: &str) -> Vec<u8> {
    let path = root.join(relative);
    std::fs::read(&path).unwrap_or_else(|error| panic!("read {}: {error}", path.display()))
}

/// The first line on which `left` and `right` differ (1-based), for the failure message.
fn first_differing_line(left: &[u8], right: &[u8]) -> usize {
    let left = String::from_utf8_lossy(left);
    let right = String::from_utf8_lossy(right);
    let mut left_lines = left.lines();
    let mut right_lines = right.lines();
    let mut line = 1;
    loop {
        match (left_lines.next(), right_lines.next()) {
            (Some(a), Some(b)) if a == b => line += 1,
            _ => return line,
        }
    }
}

#[test]
fn the_sdk_vendors_the_hosts_contract_byte_for_byte() {
    let root = repo_root();
    let host = read(&root, HOST_WIT);
    let sdk = read(&root, SDK_WIT);
    assert!(
        host == sdk,
        "{SDK_WIT} differs from {HOST_WIT} (first at line {}). The contract is edited in \
         {HOST_WIT}; copy it over the SDK's: `cp {HOST_WIT} {SDK_WIT}`",
        first_differing_line(&host, &sdk)
    );
}

#[test]
fn the_sdk_generates_its_bindings_from_its_own_copy() {
    // A path out of the crate (`../../wit`) builds in the workspace but not once
    // packaged, where only the crate's own files exist.
    let sdk = repo_root().join("plugins/sdk");
    let lib = String::from_utf8(read(&sdk, "src/lib.rs")).expect("lib.rs is UTF-8");
    assert!(
        lib.contains("path: \"wit\","),
        "plugins/sdk/src/lib.rs must generate its bindings from the crate's own `wit` folder \
         (`path: \"wit\"`), so the published crate builds"
    );
    let manifest = String::from_utf8(read(&sdk, "Cargo.toml")).expect("UTF-8");
    assert!(
        manifest.contains("\"wit/policy.wit\""),
        "plugins/sdk/Cargo.toml's `include` must list \"wit/policy.wit\", or the published \
         crate has no contract to build from"
    );
}

#[test]
fn the_difference_finder_names_the_first_differing_line() {
    assert_eq!(first_differing_line(b"a\nb\nc\n", b"a\nx\nc\n"), 2);
    assert_eq!(first_differing_line(b"a\nb\n", b"a\nb\nc\n"), 3);
}
