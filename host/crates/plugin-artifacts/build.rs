//! Builds the policy plugins — every crate under `policies/` and `plugins/fixtures/` — as
//! WebAssembly components, with a nested `cargo build --target wasm32-wasip2 --profile
//! plugin` into `<workspace>/target/plugins`, and tells the host where they are through
//! the `TOKWATT_BUILT_PLUGIN_DIR` compile-time variable.
//!
//! The nested build has its own target folder, so it never waits for the lock that the
//! outer build holds on `target/`. Set `TOKWATT_SKIP_PLUGIN_BUILD=1` to skip it (the
//! variable is still set, so the host compiles; plugins already built stay usable).

use std::env;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The target plugins are built for: WASI 0.2, whose binaries are components.
const PLUGIN_TARGET: &str = "wasm32-wasip2";
/// The workspace profile for plugins (small, optimised, stripped).
const PLUGIN_PROFILE: &str = "plugin";
/// Folders, relative to the workspace root, whose every sub-folder is a plugin crate.
const PLUGIN_CRATE_FOLDERS: [&str; 2] = ["policies", "plugins/fixtures"];
/// What the plugins are built from, relative to the workspace root. Folders are watched
/// recursively.
const PLUGIN_INPUTS: [&str; 6] = [
    "wit",
    "plugins",
    "policies",
    "Cargo.toml",
    "Cargo.lock",
    "rust-toolchain.toml",
];

/// Variables that cargo sets for this build script, or that steer the outer build, and
/// would redirect or break the nested one: its target folder or triple, compiler flags
/// and wrappers (clippy runs as `RUSTC_WORKSPACE_WRAPPER`), the outer jobserver, and the
/// outer package's metadata.
const OUTER_BUILD_VARIABLES: [&str; 25] = [
    "CARGO_TARGET_DIR",
    "CARGO_ENCODED_RUSTFLAGS",
    "CARGO_ENCODED_RUSTDOCFLAGS",
    "RUSTFLAGS",
    "RUSTDOCFLAGS",
    "RUSTC_WRAPPER",
    "RUSTC_WORKSPACE_WRAPPER",
    "CLIPPY_ARGS",
    "CLIPPY_CONF_DIR",
    "CARGO_MAKEFLAGS",
    "MAKEFLAGS",
    "MFLAGS",
    "CARGO_PRIMARY_PACKAGE",
    "CARGO_CRATE_NAME",
    "CARGO_RUSTC_CURRENT_DIR",
    "OUT_DIR",
    "TARGET",
    "HOST",
    "NUM_JOBS",
    "OPT_LEVEL",
    "DEBUG",
    "PROFILE",
    "RUSTC_LINKER",
    "CARGO_LLVM_COV",
    "CARGO_LLVM_COV_TARGET_DIR",
];
/// Prefixes of further such variables: profile and build settings (`CARGO_BUILD_TARGET`,
/// `CARGO_BUILD_RUSTFLAGS`, …), the outer target's `cfg`s, features and package
/// metadata, `links` metadata from dependencies, and cargo's internal variables.
const OUTER_BUILD_PREFIXES: [&str; 8] = [
    "CARGO_PROFILE_",
    "CARGO_BUILD_",
    "CARGO_CFG_",
    "CARGO_FEATURE_",
    "CARGO_PKG_",
    "CARGO_MANIFEST_",
    "DEP_",
    "__CARGO",
];

fn main() {
    if let Err(message) = build_plugins() {
        eprintln!("error: {message}");
        std::process::exit(1);
    }
}

fn build_plugins() -> Result<(), String> {
    let manifest_dir = env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .ok_or("CARGO_MANIFEST_DIR is not set: this build script runs under cargo")?;
    // This crate is `<workspace>/host/crates/plugin-artifacts`.
    let workspace = manifest_dir
        .ancestors()
        .nth(3)
        .ok_or_else(|| format!("{} is not three folders deep", manifest_dir.display()))?
        .to_path_buf();
    let target_dir = workspace.join("target").join("plugins");
    let built_dir = target_dir.join(PLUGIN_TARGET).join(PLUGIN_PROFILE);

    println!(
        "cargo:rustc-env=TOKWATT_BUILT_PLUGIN_DIR={}",
        built_dir.display()
    );
    println!("cargo:rerun-if-env-changed=TOKWATT_SKIP_PLUGIN_BUILD");
    for input in PLUGIN_INPUTS {
        println!("cargo:rerun-if-changed={}", workspace.join(input).display());
    }
    if skip_requested(env::var_os("TOKWATT_SKIP_PLUGIN_BUILD").as_deref()) {
        return Ok(());
    }

    let rustc = env::var_os("RUSTC").unwrap_or_else(|| OsString::from("rustc"));
    ensure_target_installed(&rustc)?;
    let packages = plugin_packages(&workspace)?;
    if packages.is_empty() {
        return Ok(());
    }

    let cargo = env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));
    let mut command = Command::new(&cargo);
    command
        .current_dir(&workspace)
        .arg("build")
        .arg("--manifest-path")
        .arg(workspace.join("Cargo.toml"))
        .args(["--target", PLUGIN_TARGET, "--profile", PLUGIN_PROFILE])
        .arg("--target-dir")
        .arg(&target_dir);
    for package in &packages {
        command.args(["--package", package]);
    }
    // Keep to the outer build's job count rather than start a second full set of jobs.
    if let Some(jobs) = env::var_os("NUM_JOBS") {
        command.arg("--jobs").arg(jobs);
    }
    remove_outer_build_variables(&mut command);
    // The outer build's own compiler, so both halves use the same toolchain.
    command.env("RUSTC", &rustc);

    let output = command.output().map_err(|error| {
        format!(
            "could not run {} to build the policy plugins: {error}",
            Path::new(&cargo).display()
        )
    })?;
    if !output.status.success() {
        return Err(format!(
            "building the policy plugins for {PLUGIN_TARGET} failed ({}); cargo said:\n\n{}\n\
             Fix the plugin, or set TOKWATT_SKIP_PLUGIN_BUILD=1 to build the host without \
             rebuilding its plugins.",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(())
}

/// `TOKWATT_SKIP_PLUGIN_BUILD` set to anything but empty or `0` skips the build.
fn skip_requested(value: Option<&OsStr>) -> bool {
    value.is_some_and(|value| !value.is_empty() && value != "0")
}

/// Makes sure the compiler has a standard library for the plugin target. Where rustup
/// manages the toolchain, the target is added (and the build says so): a toolchain that
/// was already installed when `rust-toolchain.toml` named it does not get the file's
/// `targets` added by rustup, so a fresh machine would otherwise stop here. Without
/// rustup, fails with the fix.
fn ensure_target_installed(rustc: &OsStr) -> Result<(), String> {
    if target_installed(rustc) {
        return Ok(());
    }
    let toolchain = env::var_os("RUSTUP_TOOLCHAIN");
    let added = match &toolchain {
        Some(toolchain) => add_target_with_rustup(toolchain)?,
        None => false,
    };
    if added && target_installed(rustc) {
        return Ok(());
    }
    Err(format!(
        "the {PLUGIN_TARGET} target is not installed for the Rust toolchain building tokwatt, \
         so its policy plugins cannot be built{}. Run `rustup target add {PLUGIN_TARGET}`, \
         or set TOKWATT_SKIP_PLUGIN_BUILD=1 to build the host without its plugins.",
        if toolchain.is_some() {
            " (adding it with rustup did not work)"
        } else {
            " (rustup does not manage this toolchain, so it was not added)"
        }
    ))
}

fn target_installed(rustc: &OsStr) -> bool {
    Command::new(rustc)
        .args(["--print", "target-libdir", "--target", PLUGIN_TARGET])
        .output()
        .is_ok_and(|output| {
            let libdir = String::from_utf8_lossy(&output.stdout).trim().to_string();
            // The folder exists only once the target's standard library is installed.
            output.status.success() && !libdir.is_empty() && Path::new(&libdir).is_dir()
        })
}

/// Runs `rustup target add` for the toolchain cargo runs under. Returns whether rustup
/// ran and succeeded; its output goes to the build's warnings so the user sees why the
/// first build downloads something.
fn add_target_with_rustup(toolchain: &OsStr) -> Result<bool, String> {
    println!(
        "cargo:warning=adding the {PLUGIN_TARGET} target to toolchain {} with rustup, \
         to build the policy plugins",
        toolchain.to_string_lossy()
    );
    let output = match Command::new("rustup")
        .arg("target")
        .arg("add")
        .arg("--toolchain")
        .arg(toolchain)
        .arg(PLUGIN_TARGET)
        .output()
    {
        Ok(output) => output,
        // rustup set RUSTUP_TOOLCHAIN but is not on PATH: report as not added.
        Err(_) => return Ok(false),
    };
    if !output.status.success() {
        for line in String::from_utf8_lossy(&output.stderr).lines() {
            println!("cargo:warning=rustup: {line}");
        }
    }
    Ok(output.status.success())
}

/// The package names of the plugin crates, sorted.
fn plugin_packages(workspace: &Path) -> Result<Vec<String>, String> {
    let mut packages = Vec::new();
    for folder in PLUGIN_CRATE_FOLDERS {
        let folder = workspace.join(folder);
        let entries = match fs::read_dir(&folder) {
            Ok(entries) => entries,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
            Err(error) => return Err(format!("cannot list {}: {error}", folder.display())),
        };
        for entry in entries {
            let entry =
                entry.map_err(|error| format!("cannot list {}: {error}", folder.display()))?;
            let manifest = entry.path().join("Cargo.toml");
            if manifest.is_file() {
                packages.push(package_name(&manifest)?);
            }
        }
    }
    packages.sort();
    Ok(packages)
}

/// The `name` in a manifest's `[package]` table. A line-based reader is enough for the
/// workspace's own plugin manifests, and keeps the build script free of dependencies.
fn package_name(manifest: &Path) -> Result<String, String> {
    let text = fs::read_to_string(manifest)
        .map_err(|error| format!("cannot read {}: {error}", manifest.display()))?;
    let mut in_package = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_package = line == "[package]";
            continue;
        }
        let value = line
            .strip_prefix("name")
            .map(str::trim_start)
            .and_then(|rest| rest.strip_prefix('='))
            .map(str::trim);
        if let (true, Some(value)) = (in_package, value) {
            let name = value
                .strip_prefix('"')
                .and_then(|value| value.strip_suffix('"'));
            return name.map(str::to_string).ok_or_else(|| {
                format!(
                    "{}: write the package name as `name = \"…\"` on one line",
                    manifest.display()
                )
            });
        }
    }
    Err(format!(
        "{}: no `name = \"…\"` in its [package] table",
        manifest.display()
    ))
}

fn remove_outer_build_variables(command: &mut Command) {
    for (name, _) in env::vars_os() {
        let Some(name) = name.to_str() else {
            continue;
        };
        let inherited_from_outer_build = OUTER_BUILD_VARIABLES.contains(&name)
            || OUTER_BUILD_PREFIXES
                .iter()
                .any(|prefix| name.starts_with(prefix));
        if inherited_from_outer_build {
            command.env_remove(name);
        }
    }
}
