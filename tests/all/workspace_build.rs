//! `cargo build --workspace` builds every member for the machine it runs on, the policy
//! plugins included. A plugin's component exports have symbol names that a native linker
//! refuses (`tokwatt:policy/guest@0.4.0#decide`), so the SDK's `export_policy!` (and the
//! fixture that uses wit-bindgen directly) must emit them only for WebAssembly; this
//! checks that every plugin crate builds and links natively.
//!
//! The README's test command, `cargo test --workspace`, links every plugin crate's native
//! library before it runs this test; when those libraries are all there and newer than
//! what they are built from, they are the proof. Otherwise (this test run on its own, with
//! `-p tokwatt`) it runs `cargo build --workspace` itself: a build with the features of
//! `cargo build` rather than `cargo test`, which recompiles the proc-macro stack (about
//! 100 s of CPU on a cold machine) to prove the same link.

use std::ffi::OsStr;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use crate::support::repo_root;

/// A warm build only links the plugin crates; a cold one compiles their dependencies.
const BUILD_DEADLINE: Duration = Duration::from_secs(540);

/// The package names and folders of the crates in each sub-folder of `folder`.
fn crates_under(folder: &Path) -> Vec<(String, PathBuf)> {
    let mut crates = Vec::new();
    for entry in std::fs::read_dir(folder).expect("read the crate folder") {
        let dir = entry.expect("folder entry").path();
        let Ok(text) = std::fs::read_to_string(dir.join("Cargo.toml")) else {
            continue;
        };
        let value: toml::Table = toml::from_str(&text).expect("a crate manifest is TOML");
        let name = value["package"]["name"]
            .as_str()
            .expect("a package name")
            .to_owned();
        crates.push((name, dir));
    }
    crates.sort();
    crates
}

/// The newest modification time of the files at or under `path`.
fn newest_under(path: &Path) -> Option<SystemTime> {
    let metadata = std::fs::metadata(path).ok()?;
    if !metadata.is_dir() {
        return metadata.modified().ok();
    }
    std::fs::read_dir(path)
        .ok()?
        .filter_map(|entry| newest_under(&entry.ok()?.path()))
        .max()
}

/// Whether the build that made this test binary also linked every plugin crate's native
/// library beside it, after the last change to anything they are built from.
fn linked_by_this_build(root: &Path, plugins: &[(String, PathBuf)]) -> bool {
    let Some(profile_dir) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent()?.parent().map(Path::to_path_buf))
    else {
        return false;
    };
    let shared = [
        "plugins/sdk",
        "plugins/policy-kit",
        "wit",
        "Cargo.lock",
        "Cargo.toml",
    ];
    let Some(shared_inputs) = shared
        .iter()
        .filter_map(|p| newest_under(&root.join(p)))
        .max()
    else {
        return false;
    };
    plugins.iter().all(|(name, dir)| {
        let library = profile_dir.join(format!(
            "{}{}{}",
            std::env::consts::DLL_PREFIX,
            name.replace('-', "_"),
            std::env::consts::DLL_SUFFIX
        ));
        let linked = std::fs::metadata(&library)
            .ok()
            .filter(|m| m.len() > 0)
            .and_then(|m| m.modified().ok());
        match (linked, newest_under(dir)) {
            (Some(linked), Some(inputs)) => linked >= inputs.max(shared_inputs),
            _ => false,
        }
    })
}

#[test]
fn every_plugin_crate_builds_and_links_natively() {
    if !crate::support::run_slow("building every plugin crate natively") {
        return;
    }
    let root = repo_root();
    let mut crates = crates_under(&root.join("policies"));
    crates.extend(crates_under(&root.join("plugins/fixtures")));
    assert!(crates.len() >= 3, "no plugin crates found: {crates:?}");
    if linked_by_this_build(&root, &crates) {
        println!(
            "the {} plugin crates' native libraries were linked by the build of this test (cargo test --workspace), after their last change",
            crates.len()
        );
        return;
    }
    let plugins: Vec<String> = crates.into_iter().map(|(name, _)| name).collect();

    // The host is built already (this test is part of it), and its build script builds the
    // plugins for WebAssembly; what is left to prove is the native build of the rest.
    let mut cargo = Command::new(env!("CARGO"));
    // What cargo set for this test process (CARGO_PKG_NAME, CARGO_MANIFEST_DIR, OUT_DIR,
    // …) must not reach the child: a build script that watches one of them (ring's does,
    // with rerun-if-env-changed) would run again here, and again in the next plain
    // `cargo build`, recompiling what depends on it (`.ci/run` caught it).
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let set_for_tests = ["CARGO_PKG_", "CARGO_MANIFEST_", "CARGO_BIN_"]
            .iter()
            .any(|prefix| name.starts_with(prefix))
            || [
                "CARGO_CRATE_NAME",
                "CARGO_TARGET_TMPDIR",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_RUSTC_CURRENT_DIR",
                "OUT_DIR",
            ]
            .contains(&name.as_ref());
        if set_for_tests {
            cargo.env_remove(name.as_ref());
        }
    }
    let mut child = cargo
        .current_dir(&root)
        .args(["build", "--workspace", "--exclude", "tokwatt", "--offline"])
        .args(["--message-format", "json-render-diagnostics"])
        .arg("--manifest-path")
        .arg(root.join("Cargo.toml"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run cargo");
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let out_reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let err_reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for cargo") {
            break status;
        }
        if started.elapsed() > BUILD_DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "cargo build --workspace did not finish in {BUILD_DEADLINE:?}:\n{}",
                err_reader.join().unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let messages = out_reader.join().unwrap_or_default();
    let diagnostics = err_reader.join().unwrap_or_default();
    assert!(
        status.success(),
        "cargo build --workspace failed ({status}):\n{diagnostics}"
    );

    // Each plugin crate's cdylib was linked.
    let mut linked: Vec<String> = messages
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|message| message["reason"] == "compiler-artifact")
        .filter(|message| {
            message["target"]["kind"]
                .as_array()
                .is_some_and(|kinds| kinds.iter().any(|kind| kind == "cdylib"))
        })
        .filter(|message| {
            message["filenames"].as_array().is_some_and(|files| {
                files.iter().filter_map(|file| file.as_str()).any(|file| {
                    Path::new(file).extension() == Some(OsStr::new(std::env::consts::DLL_EXTENSION))
                        && Path::new(file).is_file()
                })
            })
        })
        .filter_map(|message| message["target"]["name"].as_str().map(str::to_owned))
        .collect();
    linked.sort();
    linked.dedup();
    // A library target is named after its package, with `_` for `-`.
    let mut expected: Vec<String> = plugins.iter().map(|name| name.replace('-', "_")).collect();
    expected.sort();
    assert_eq!(linked, expected, "native libraries linked:\n{diagnostics}");
}
