//! The SDK carries its own copy of the contract (`plugins/sdk/wit/policy.wit`) so that the
//! published crate builds on its own; the host builds against `wit/policy.wit`. A policy
//! built with the SDK must meet exactly the contract the host checks, so the two files
//! must be the same, byte for byte. The published crate also carries the workspace's
//! license text (`plugins/sdk/LICENSE`, a copy of `LICENSE`), the same byte for byte.

use std::path::Path;

use crate::support::repo_root;

/// The contract the host is built against.
const HOST_WIT: &str = "wit/policy.wit";
/// The SDK's vendored copy, which its bindings are generated from.
const SDK_WIT: &str = "plugins/sdk/wit/policy.wit";
/// The workspace's license text (Apache-2.0, as `Cargo.toml` says).
const LICENSE: &str = "LICENSE";
/// The SDK's copy, which its package ships.
const SDK_LICENSE: &str = "plugins/sdk/LICENSE";

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
fn the_sdk_ships_the_workspace_license_byte_for_byte() {
    let root = repo_root();
    let license = read(&root, LICENSE);
    let sdk = read(&root, SDK_LICENSE);
    assert!(
        license == sdk,
        "{SDK_LICENSE} differs from {LICENSE} (first at line {}): `cp {LICENSE} {SDK_LICENSE}`",
        first_differing_line(&license, &sdk)
    );
    let text = String::from_utf8_lossy(&license);
    assert!(
        text.contains("Apache License") && text.contains("Version 2.0, January 2004"),
        "{LICENSE} must be the Apache License 2.0 text, as the workspace's `license` says"
    );
    // `include` is a whitelist: cargo packages no file it does not list.
    let manifest = String::from_utf8(read(&root.join("plugins/sdk"), "Cargo.toml")).expect("UTF-8");
    assert!(
        manifest.contains("\"LICENSE\""),
        "plugins/sdk/Cargo.toml's `include` must list \"LICENSE\", or the published crate \
         ships without its license text"
    );
}

#[test]
fn the_difference_finder_names_the_first_differing_line() {
    assert_eq!(first_differing_line(b"a\nb\nc\n", b"a\nx\nc\n"), 2);
    assert_eq!(first_differing_line(b"a\nb\n", b"a\nb\nc\n"), 3);
}

/// The 0.1 contract, which the host serves beside the current one for plugins built
/// against it.
const FROZEN_0_1_WIT: &str = "wit/0.1/policy.wit";
/// FNV-1a of the 0.1 contract as it shipped (the file from its `package` line on; the
/// lines above it say that it is frozen).
const FROZEN_0_1_FNV: u64 = 0xc648_75f2_5ff7_b2f8;

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[test]
fn the_0_1_contract_stays_as_it_shipped() {
    let text = String::from_utf8(read(&repo_root(), FROZEN_0_1_WIT)).expect("UTF-8");
    let body = text
        .find("package tokwatt:policy@0.1.0;")
        .map(|start| &text[start..])
        .unwrap_or_else(|| panic!("{FROZEN_0_1_WIT} must declare package tokwatt:policy@0.1.0"));
    assert_eq!(
        fnv1a(body.as_bytes()),
        FROZEN_0_1_FNV,
        "{FROZEN_0_1_WIT} changed: it is the contract plugins built against 0.1 were built \
         with, and the host generates their bindings from it, so a change breaks them. \
         Change wit/policy.wit (the current line) instead"
    );
}

/// The 0.2 contract, served beside the current one for plugins built against it.
const FROZEN_0_2_WIT: &str = "wit/0.2/policy.wit";
/// FNV-1a of the 0.2 contract as it shipped (from its `package` line on).
const FROZEN_0_2_FNV: u64 = 0xc60c_d193_ce3e_ef17;

#[test]
fn the_0_2_contract_stays_as_it_shipped() {
    let text = String::from_utf8(read(&repo_root(), FROZEN_0_2_WIT)).expect("UTF-8");
    let body = text
        .find("package tokwatt:policy@0.2.0;")
        .map(|start| &text[start..])
        .unwrap_or_else(|| panic!("{FROZEN_0_2_WIT} must declare package tokwatt:policy@0.2.0"));
    assert_eq!(
        fnv1a(body.as_bytes()),
        FROZEN_0_2_FNV,
        "{FROZEN_0_2_WIT} changed: it is the contract plugins built against 0.2 were built \
         with, and the host generates their bindings from it, so a change breaks them. \
         Change wit/policy.wit (the current line) instead"
    );
}

/// The 0.3 contract, served beside the current one for plugins built against it.
const FROZEN_0_3_WIT: &str = "wit/0.3/policy.wit";
/// FNV-1a of the 0.3 contract as it shipped (from its `package` line on).
const FROZEN_0_3_FNV: u64 = 0x1eb6_e60d_4215_a9e2;

#[test]
fn the_0_3_contract_stays_as_it_shipped() {
    let text = String::from_utf8(read(&repo_root(), FROZEN_0_3_WIT)).expect("UTF-8");
    let body = text
        .find("package tokwatt:policy@0.3.0;")
        .map(|start| &text[start..])
        .unwrap_or_else(|| panic!("{FROZEN_0_3_WIT} must declare package tokwatt:policy@0.3.0"));
    assert_eq!(
        fnv1a(body.as_bytes()),
        FROZEN_0_3_FNV,
        "{FROZEN_0_3_WIT} changed: it is the contract plugins built against 0.3 were built \
         with, and the host generates their bindings from it, so a change breaks them. \
         Change wit/policy.wit (the current line) instead"
    );
}
