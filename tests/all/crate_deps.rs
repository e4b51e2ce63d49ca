//! The crates' dependencies point down (issue 43: `cargo tree` shows no upward edge), and
//! each outside library is known by the one crate whose concern it is (ARCHITECTURE.md,
//! "Invariants"). Read from each crate's own `Cargo.toml`, `[dependencies]` only: a test
//! helper in `[dev-dependencies]` is not part of the product.

use std::collections::BTreeSet;

use crate::support::repo_root;

/// The crates from the bottom floor up: a crate may depend only on crates before it.
const FLOORS: &[&str] = &[
    "tokwatt-core",
    "tokwatt-report",
    "tokwatt-plugin-artifacts",
    "tokwatt-fleet",
    "tokwatt-engines",
    "tokwatt-sim",
    "tokwatt-nvml",
    "tokwatt-cuda",
    "tokwatt-policy",
    "tokwatt-test-support",
    "tokwatt-plugin",
    "tokwatt-agent",
    "tokwatt-lab",
    "tokwatt-bench",
    "tokwatt-serve",
    "tokwatt",
];

/// Outside libraries and the crates that alone may know them.
const OWNERS: &[(&str, &[&str])] = &[
    ("wasmtime", &["tokwatt-plugin"]),
    ("wasmtime-wasi", &["tokwatt-plugin"]),
    ("wasmparser", &["tokwatt-plugin"]),
    ("nvml-wrapper", &["tokwatt-nvml"]),
    ("nvml-wrapper-sys", &["tokwatt-nvml"]),
    ("cudarc", &["tokwatt-cuda"]),
    ("axum", &["tokwatt-serve"]),
    ("prometheus-client", &["tokwatt-serve"]),
    ("tokio-rustls", &["tokwatt-fleet"]),
    ("rustls", &["tokwatt-fleet"]),
    (
        "hyper",
        &[
            "tokwatt-serve",
            "tokwatt-engines",
            "tokwatt-fleet",
            "tokwatt-lab",
        ],
    ),
];

/// Each crate's name and the names in its `[dependencies]`.
fn manifests() -> Vec<(String, BTreeSet<String>)> {
    let root = repo_root();
    let mut paths = vec![root.join("host/Cargo.toml")];
    for entry in std::fs::read_dir(root.join("host/crates")).expect("host/crates") {
        let path = entry.expect("entry").path().join("Cargo.toml");
        if path.exists() {
            paths.push(path);
        }
    }
    paths
        .iter()
        .map(|path| {
            let text = std::fs::read_to_string(path).expect("a manifest");
            let manifest: toml::Table = toml::from_str(&text).expect("a TOML manifest");
            let name = manifest["package"]["name"]
                .as_str()
                .expect("a package name")
                .to_owned();
            let deps = manifest
                .get("dependencies")
                .and_then(toml::Value::as_table)
                .map(|deps| deps.keys().cloned().collect())
                .unwrap_or_default();
            (name, deps)
        })
        .collect()
}

#[test]
fn the_crates_dependencies_point_down() {
    let crates = manifests();
    assert!(crates.len() >= FLOORS.len(), "{crates:?}");
    let mut upward = Vec::new();
    for (name, deps) in &crates {
        let floor = FLOORS
            .iter()
            .position(|c| c == name)
            .unwrap_or_else(|| panic!("{name} is on no floor: add it to FLOORS"));
        for dep in deps.iter().filter(|d| d.starts_with("tokwatt")) {
            match FLOORS.iter().position(|c| c == dep) {
                Some(below) if below < floor => {}
                _ => upward.push(format!("{name} -> {dep}")),
            }
        }
    }
    assert!(
        upward.is_empty(),
        "edges that do not point down: {upward:?}"
    );
}

#[test]
fn each_outside_library_is_known_by_its_own_crate_alone() {
    let mut strays = Vec::new();
    for (name, deps) in manifests() {
        for (library, owners) in OWNERS {
            if deps.contains(*library) && !owners.contains(&name.as_str()) {
                strays.push(format!("{name} depends on {library} (only {owners:?} may)"));
            }
        }
    }
    assert!(strays.is_empty(), "{strays:?}");
}
