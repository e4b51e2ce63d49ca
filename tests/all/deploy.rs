//! The deployment files under `deploy/`, each checked by a tool that parses it: the
//! checkers in `tests/deploy/` (Python) run `systemd-analyze verify`, dockerfile-parse,
//! kubernetes-validate and promtool, and check what those cannot (privileges, paths
//! shared between files, metric names, tokwatt's flags against this build's binary).
//! Each checker is also shown a broken copy and must reject it.
//!
//! A checker whose tool is missing passes what it could check and skips the rest with a
//! printed reason (exit 77); under `TOKWATT_REQUIRE_DEPLOY_TOOLS=1` (CI) that fails.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::{repo_root, tempdir};

/// Subcommands the deployment files call that this binary may not have yet: they are
/// allowed to be missing (with a note), and the checkers fail once the binary has one
/// and it is still listed, so that its flags get checked.
const PENDING_SUBCOMMANDS: &[&str] = &[];

/// Exit code of a checker that skipped a check because its tool is missing.
const SKIPPED: i32 = 77;

enum Outcome {
    Passed,
    /// Nothing failed, but the checker could not run some checks (its tool is missing):
    /// no verdict on what those checks cover.
    Skipped,
    Failed(String),
}

fn tools_required() -> bool {
    crate::support::required("TOKWATT_REQUIRE_DEPLOY_TOOLS")
}

/// Runs `tests/deploy/<script>` with `args`, the built binary and the pending list.
/// `None` where python3 itself is missing and tools are not required.
fn run_checker(script: &str, args: &[&Path]) -> Option<Outcome> {
    let mut command = Command::new("python3");
    command
        .arg(repo_root().join("tests/deploy").join(script))
        .args(args)
        .arg("--tokwatt")
        .arg(env!("CARGO_BIN_EXE_tokwatt"));
    for subcommand in PENDING_SUBCOMMANDS {
        command.args(["--pending", subcommand]);
    }
    let output = match command.output() {
        Ok(output) => output,
        Err(error) => {
            assert!(
                !tools_required(),
                "TOKWATT_REQUIRE_DEPLOY_TOOLS is set but python3 cannot run: {error}"
            );
            eprintln!("skipped {script}: python3 cannot run ({error})");
            return None;
        }
    };
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    eprintln!("{said}");
    match output.status.code() {
        Some(0) => Some(Outcome::Passed),
        Some(SKIPPED) => {
            assert!(
                !tools_required(),
                "TOKWATT_REQUIRE_DEPLOY_TOOLS is set but {script} skipped checks (see SKIP lines):\n{said}"
            );
            Some(Outcome::Skipped)
        }
        _ => Some(Outcome::Failed(said)),
    }
}

fn assert_accepted(script: &str, args: &[&Path]) {
    if let Some(Outcome::Failed(said)) = run_checker(script, args) {
        panic!("{script} rejected the shipped file:\n{said}");
    }
}

/// The checker must reject `args` and say `expected` about it.
fn assert_rejected(script: &str, args: &[&Path], expected: &str) {
    match run_checker(script, args) {
        Some(Outcome::Failed(said)) => assert!(
            said.contains(expected),
            "{script} rejected the broken copy, but not for {expected:?}:\n{said}"
        ),
        Some(Outcome::Passed) => panic!("{script} accepted a broken copy (expected {expected:?})"),
        // A skipped check is not a passed one: the broken part may be what it skipped.
        Some(Outcome::Skipped) => {
            eprintln!(
                "skipped: {script} could not run every check, so it cannot reject the broken copy"
            );
        }
        None => {}
    }
}

fn deploy_file(relative: &str) -> PathBuf {
    repo_root().join("deploy").join(relative)
}

/// A copy of a shipped deployment file with `from` replaced by `to` (which must occur).
fn broken_copy(dir: &Path, relative: &str, from: &str, to: &str) -> PathBuf {
    let text = std::fs::read_to_string(deploy_file(relative)).expect("read the shipped file");
    assert!(
        text.contains(from),
        "{relative} no longer contains {from:?}: update this test"
    );
    let path = dir.join(Path::new(relative).file_name().expect("a file name"));
    std::fs::write(&path, text.replacen(from, to, 1)).expect("write the broken copy");
    path
}

#[test]
fn systemd_unit_is_valid_and_calls_real_flags() {
    assert_accepted(
        "check_systemd.py",
        &[&deploy_file("systemd/tokwatt.service")],
    );
}

#[test]
fn systemd_checker_rejects_an_unknown_restore_flag_and_key() {
    let dir = tempdir();
    let unit = broken_copy(
        dir.path(),
        "systemd/tokwatt.service",
        "restore --state-file",
        "restore --state",
    );
    assert_rejected("check_systemd.py", &[&unit], "has no flag --state");
    let unit = broken_copy(
        dir.path(),
        "systemd/tokwatt.service",
        "PrivateTmp=yes",
        "PrivateTmp=yes\nPrivateDevices=yes",
    );
    assert_rejected(
        "check_systemd.py",
        &[&unit],
        "PrivateDevices= must stay off",
    );
}

#[test]
fn systemd_checker_rejects_an_agent_that_does_not_feed_a_watchdog() {
    let dir = tempdir();
    let unit = broken_copy(
        dir.path(),
        "systemd/tokwatt.service",
        "Type=notify",
        "Type=simple",
    );
    assert_rejected("check_systemd.py", &[&unit], "Type=notify");
    let unit = broken_copy(
        dir.path(),
        "systemd/tokwatt.service",
        "WatchdogSec=5s\n",
        "",
    );
    assert_rejected("check_systemd.py", &[&unit], "WatchdogSec= must be set");
}

#[test]
fn the_boot_reserve_unit_is_valid_and_runs_the_fence_once_before_the_agent() {
    assert_accepted(
        "check_systemd.py",
        &[
            &deploy_file("systemd/tokwatt-reserve.service"),
            Path::new("--role"),
            Path::new("reserve"),
        ],
    );
}

#[test]
fn the_boot_reserve_checker_rejects_a_fence_that_does_not_exit_and_an_unknown_flag() {
    let dir = tempdir();
    let role = [Path::new("--role"), Path::new("reserve")];
    let unit = broken_copy(
        dir.path(),
        "systemd/tokwatt-reserve.service",
        "fence --once --reserve",
        "fence --reserve",
    );
    assert_rejected(
        "check_systemd.py",
        &[&unit, role[0], role[1]],
        "must run `tokwatt fence --once`",
    );
    let unit = broken_copy(
        dir.path(),
        "systemd/tokwatt-reserve.service",
        "--reserve 2400",
        "--reserve-w 2400",
    );
    assert_rejected(
        "check_systemd.py",
        &[&unit, role[0], role[1]],
        "`tokwatt fence` has no flag --reserve-w",
    );
}

#[test]
fn coordinator_unit_is_valid_unprivileged_and_calls_real_flags() {
    assert_accepted(
        "check_systemd.py",
        &[
            &deploy_file("systemd/tokwatt-coordinator.service"),
            Path::new("--role"),
            Path::new("coordinator"),
        ],
    );
}

#[test]
fn coordinator_unit_checker_rejects_a_capability_and_an_unknown_nested_flag() {
    let dir = tempdir();
    let role = [Path::new("--role"), Path::new("coordinator")];
    let unit = broken_copy(
        dir.path(),
        "systemd/tokwatt-coordinator.service",
        "CapabilityBoundingSet=\n",
        "CapabilityBoundingSet=CAP_SYS_ADMIN\n",
    );
    assert_rejected(
        "check_systemd.py",
        &[&unit, role[0], role[1]],
        "the coordinator needs no capabilities",
    );
    let unit = broken_copy(
        dir.path(),
        "systemd/tokwatt-coordinator.service",
        "--period 1s",
        "--perio 1s",
    );
    assert_rejected(
        "check_systemd.py",
        &[&unit, role[0], role[1]],
        "`tokwatt fleet coordinate` has no flag --perio",
    );
}

#[test]
fn containerfile_builds_what_it_copies() {
    assert_accepted(
        "check_container.py",
        &[&deploy_file("container/Containerfile")],
    );
}

#[test]
fn container_checker_rejects_a_copy_of_something_never_built() {
    let dir = tempdir();
    let file = broken_copy(
        dir.path(),
        "container/Containerfile",
        "/src/target/plugins/wasm32-wasip2/plugin/policy_*.wasm",
        "/src/target/release/policy_*.wasm",
    );
    assert_rejected(
        "check_container.py",
        &[&file],
        "is not something the builder's cargo build makes",
    );
}

#[test]
fn kubernetes_daemonsets_are_valid_with_the_right_privileges() {
    let privileged = deploy_file("kubernetes/daemonset.yaml");
    let observe = deploy_file("kubernetes/daemonset-observe-only.yaml");
    assert_accepted(
        "check_kubernetes.py",
        &[&privileged, Path::new("--variant"), Path::new("privileged")],
    );
    assert_accepted(
        "check_kubernetes.py",
        &[&observe, Path::new("--variant"), Path::new("observe-only")],
    );
    assert_accepted(
        "check_kubernetes.py",
        &[
            &deploy_file("kubernetes/daemonset-fleet.yaml"),
            Path::new("--variant"),
            Path::new("fleet"),
        ],
    );
}

#[test]
fn kubernetes_checker_rejects_a_fence_with_another_reserve_or_without_the_shared_folder() {
    let dir = tempdir();
    let variant = [Path::new("--variant"), Path::new("fleet")];
    let file = broken_copy(
        dir.path(),
        "kubernetes/daemonset-fleet.yaml",
        "            - --reserve\n            - \"2400\"",
        "            - --reserve\n            - \"3000\"",
    );
    assert_rejected(
        "check_kubernetes.py",
        &[&file, variant[0], variant[1]],
        "must be the config's fleet.reserve_w",
    );
    let file = broken_copy(
        dir.path(),
        "kubernetes/daemonset-fleet.yaml",
        "          volumeMounts:\n            - name: fence\n              mountPath: /run/tokwatt-fence\n            - name: fence-etcd-tls",
        "          volumeMounts:\n            - name: config\n              mountPath: /run/tokwatt-fence\n            - name: fence-etcd-tls",
    );
    assert_rejected(
        "check_kubernetes.py",
        &[&file, variant[0], variant[1]],
        "must be on an emptyDir the agent and the fence container both mount",
    );
    let file = broken_copy(
        dir.path(),
        "kubernetes/daemonset-fleet.yaml",
        "          args:\n            - fence\n            - --once\n            - --reserve\n            - \"2400\"\n",
        "          args:\n            - restore\n            - --reserve\n            - \"2400\"\n",
    );
    assert_rejected(
        "check_kubernetes.py",
        &[&file, variant[0], variant[1]],
        "init container running `tokwatt fence --once`",
    );
}

#[test]
fn kubernetes_checker_rejects_privileges_in_the_observe_only_variant_and_bad_yaml() {
    let dir = tempdir();
    let file = broken_copy(
        dir.path(),
        "kubernetes/daemonset-observe-only.yaml",
        "drop: [\"ALL\"]\n          resources:",
        "drop: [\"ALL\"]\n              add: [\"SYS_ADMIN\"]\n          resources:",
    );
    let variant = [Path::new("--variant"), Path::new("observe-only")];
    assert_rejected(
        "check_kubernetes.py",
        &[&file, variant[0], variant[1]],
        "adds no capability",
    );
    let file = broken_copy(
        dir.path(),
        "kubernetes/daemonset-observe-only.yaml",
        "kind: DaemonSet\n",
        "kind: DaemonSet\n  bad: [unclosed\n",
    );
    assert_rejected(
        "check_kubernetes.py",
        &[&file, variant[0], variant[1]],
        "not YAML",
    );
}

#[test]
fn kubernetes_fleet_coordinator_and_etcd_are_valid_and_unprivileged() {
    let etcd = deploy_file("kubernetes/etcd-statefulset.yaml");
    assert_accepted(
        "check_kubernetes.py",
        &[
            &deploy_file("kubernetes/fleet-coordinator.yaml"),
            Path::new("--variant"),
            Path::new("coordinator"),
            Path::new("--etcd-manifest"),
            &etcd,
        ],
    );
    assert_accepted(
        "check_kubernetes.py",
        &[&etcd, Path::new("--variant"), Path::new("etcd")],
    );
}

#[test]
fn kubernetes_checker_rejects_a_privileged_coordinator_and_an_etcd_scaled_alone() {
    let dir = tempdir();
    let file = broken_copy(
        dir.path(),
        "kubernetes/fleet-coordinator.yaml",
        "drop: [\"ALL\"]\n",
        "drop: [\"ALL\"]\n              add: [\"NET_ADMIN\"]\n",
    );
    assert_rejected(
        "check_kubernetes.py",
        &[&file, Path::new("--variant"), Path::new("coordinator")],
        "adds no capability",
    );
    let file = broken_copy(
        dir.path(),
        "kubernetes/fleet-coordinator.yaml",
        "replicas: 2",
        "replicas: 1",
    );
    assert_rejected(
        "check_kubernetes.py",
        &[&file, Path::new("--variant"), Path::new("coordinator")],
        "must run 2 or more replicas",
    );
    // Five members, but --initial-cluster still names three.
    let file = broken_copy(
        dir.path(),
        "kubernetes/etcd-statefulset.yaml",
        "replicas: 3",
        "replicas: 5",
    );
    assert_rejected(
        "check_kubernetes.py",
        &[&file, Path::new("--variant"), Path::new("etcd")],
        "--initial-cluster must list the 5 members",
    );
}

#[test]
fn the_example_budget_passes_its_own_check() {
    let out = crate::support::tokwatt()
        .args(["fleet", "budget", "--check", "--file"])
        .arg(deploy_file("fleet/budget.toml"))
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "deploy/fleet/budget.toml is refused: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("checked, not written"));
    // Reserves that pass the budget are refused without contacting etcd.
    let dir = tempdir();
    let file = broken_copy(
        dir.path(),
        "fleet/budget.toml",
        "budget_w = 48000",
        "budget_w = 20000",
    );
    let out = crate::support::tokwatt()
        .args(["fleet", "budget", "--check", "--file"])
        .arg(&file)
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("every node cut off at once"),
        "{stderr}"
    );
}

#[test]
fn prometheus_config_and_rules_pass_promtool_and_name_exported_metrics() {
    assert_accepted("check_prometheus.py", &[&deploy_file("prometheus")]);
}

#[test]
fn prometheus_checker_rejects_a_metric_the_agent_does_not_export() {
    let dir = tempdir();
    for config in ["prometheus.yml", "prometheus-kubernetes.yml"] {
        std::fs::copy(
            deploy_file(&format!("prometheus/{config}")),
            dir.path().join(config),
        )
        .expect("copy the scrape config");
    }
    broken_copy(
        dir.path(),
        "prometheus/tokwatt.rules.yml",
        "sum by (node) (rate(tokwatt_gpu_tokens_total[5m]))",
        "sum by (node) (rate(tokwatt_gpu_tokens[5m]))",
    );
    assert_rejected(
        "check_prometheus.py",
        &[dir.path()],
        "tokwatt_gpu_tokens is not a metric tokwatt exports",
    );
}

#[test]
fn grafana_dashboard_queries_parse_and_name_exported_metrics() {
    assert_accepted(
        "check_grafana.py",
        &[&deploy_file("grafana/tokwatt-dashboard.json")],
    );
}

#[test]
fn grafana_checker_rejects_an_unknown_metric_and_broken_json() {
    let dir = tempdir();
    let file = broken_copy(
        dir.path(),
        "grafana/tokwatt-dashboard.json",
        "tokwatt_gpu_batch_size{",
        "tokwatt_gpu_batch{",
    );
    assert_rejected(
        "check_grafana.py",
        &[&file],
        "tokwatt_gpu_batch is not a metric tokwatt exports",
    );
    let file = broken_copy(dir.path(), "grafana/tokwatt-dashboard.json", "{", "{{");
    assert_rejected("check_grafana.py", &[&file], "not JSON");
}

#[test]
fn grafana_checker_wants_an_energy_panel() {
    let dir = tempdir();
    let text = std::fs::read_to_string(deploy_file("grafana/tokwatt-dashboard.json"))
        .expect("read the dashboard");
    assert!(
        text.contains("[$__range]"),
        "the energy panel uses $__range"
    );
    let path = dir.path().join("tokwatt-dashboard.json");
    std::fs::write(&path, text.replace("[$__range]", "[$__rate_interval]")).expect("write");
    assert_rejected(
        "check_grafana.py",
        &[&path],
        "no panel shows the energy used over the time range",
    );
}

/// The `serve.toml` a ConfigMap in `manifest` carries, as the pod sees it (the
/// render-config init container fills in the node's address and name).
fn config_map_serve_toml(manifest: &str) -> String {
    let text = std::fs::read_to_string(deploy_file(manifest)).expect("read the manifest");
    let mut lines = text
        .lines()
        .skip_while(|line| line.trim() != "serve.toml: |");
    assert!(lines.next().is_some(), "{manifest} has no serve.toml");
    lines
        .take_while(|line| line.is_empty() || line.starts_with("    "))
        .map(|line| line.strip_prefix("    ").unwrap_or(line))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("@NODE_IP@", "10.0.0.7")
        .replace("@NODE_NAME@", "gpu-node-07")
}

#[test]
fn every_shipped_serve_config_is_accepted_by_the_agent() {
    let mut configs: Vec<(String, String)> =
        ["serve.toml", "serve-observe-only.toml", "serve-sim.toml"]
            .iter()
            .map(|name| {
                let text = std::fs::read_to_string(deploy_file(name)).expect("read the example");
                (format!("deploy/{name}"), text)
            })
            .collect();
    for manifest in [
        "kubernetes/daemonset.yaml",
        "kubernetes/daemonset-observe-only.yaml",
    ] {
        configs.push((
            format!("deploy/{manifest}"),
            config_map_serve_toml(manifest),
        ));
    }
    // The fleet node's etcd TLS files come from a Secret: the config loads them, so they
    // are made here (openssl) where the pod would mount them.
    let pki = tokwatt_test_support::TestPki::generate();
    if let Some(pki) = &pki {
        let text = config_map_serve_toml("kubernetes/daemonset-fleet.yaml")
            .replace("/etc/tokwatt/etcd/ca.crt", &pki.ca.display().to_string())
            .replace(
                "/etc/tokwatt/etcd/tls.crt",
                &pki.client_cert.display().to_string(),
            )
            .replace(
                "/etc/tokwatt/etcd/tls.key",
                &pki.client_key.display().to_string(),
            );
        configs.push(("deploy/kubernetes/daemonset-fleet.yaml".into(), text));
    }
    for (name, text) in configs {
        let path = Path::new("/etc/tokwatt/serve.toml");
        let parsed = tokwatt_serve::serve::config::ServeConfig::parse(path, &text);
        assert!(
            parsed.is_ok(),
            "{name} is refused by tokwatt serve: {}",
            parsed.err().map(|e| e.to_string()).unwrap_or_default()
        );
    }
}
