//! The simulated driver: a simulated node's settings live outside its agent, as a real
//! driver's do. A cap the agent set stays when the agent is killed (`kill -9`) or paused
//! (SIGSTOP), the next agent starts from it, `tokwatt restore --sim-driver` puts back what
//! a crashed run changed, and a simulated reboot puts the board defaults back.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crate::support::*;
use tokwatt_test_support::wait_for;

/// serve.toml for two simulated H200s whose settings live in `node/driver.json` beside
/// it (a relative path: relative to the config file).
fn serve_config(dir: &Path, spec: &Path, name: &str) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(
        &path,
        format!(
            "[policy]\nspec = \"{}\"\n[node]\nbackend = \"sim\"\nsim_gpus = 2\ntick = \"200ms\"\nsim_driver = \"node/driver.json\"\n[api]\nsocket = \"{}\"\n[output]\ndir = \"{}\"\n",
            spec.display(),
            socket(dir, name).display(),
            dir.join(format!("out-{name}")).display()
        ),
    )
    .expect("config");
    path
}

fn socket(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("run/{name}.sock"))
}

fn serve(dir: &Path, config: &Path, log: &Path) -> Running {
    let log = std::fs::File::create(log).expect("log file");
    Running(
        tokwatt()
            .current_dir(dir)
            .args(["serve", "--config"])
            .arg(config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("tokwatt serve starts"),
    )
}

/// `tokwatt sim-driver show --json`.
fn show(driver: &Path) -> serde_json::Value {
    let output = tokwatt()
        .args(["sim-driver", "show", "--json"])
        .arg(driver)
        .output()
        .expect("tokwatt sim-driver show");
    assert!(output.status.success(), "{}", stderr(&output));
    serde_json::from_slice(&output.stdout).expect("show's JSON")
}

fn caps(shown: &serde_json::Value) -> Vec<f64> {
    shown["boards"]
        .as_array()
        .expect("boards")
        .iter()
        .map(|b| b["power_cap_w"].as_f64().expect("a cap"))
        .collect()
}

/// Wait until every board's cap in the driver file is `watts`.
fn wait_for_caps(driver: &Path, watts: f64, agent: &mut Running, log: &Path) {
    wait_for(
        &format!("every cap at {watts} W"),
        Duration::from_secs(60),
        || {
            agent.assert_alive("the agent", log);
            driver.exists() && caps(&show(driver)).iter().all(|&c| c == watts)
        },
    );
}

fn reboot(driver: &Path) -> String {
    let output = tokwatt()
        .args(["sim-driver", "reboot"])
        .arg(driver)
        .output()
        .expect("tokwatt sim-driver reboot");
    assert!(output.status.success(), "{}", stderr(&output));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn caps_outlive_a_killed_or_paused_agent_and_a_reboot_puts_the_defaults_back() {
    let dir = tempdir();
    let driver = dir.path().join("node/driver.json");
    // The shipped static policy: 500 W on every GPU, below the H200's 700 W default.
    let capping = serve_config(
        dir.path(),
        &repo_root().join("policies/static.toml"),
        "capping",
    );

    // kill -9: nothing runs after it, and the caps stay where the agent set them.
    let log = dir.path().join("killed.log");
    let mut agent = serve(dir.path(), &capping, &log);
    wait_for_caps(&driver, 500.0, &mut agent, &log);
    agent.signal("KILL");
    let _ = agent.0.wait();
    std::thread::sleep(Duration::from_millis(500));
    let shown = show(&driver);
    assert_eq!(caps(&shown), [500.0, 500.0], "{shown}");
    assert_eq!(shown["power_cap_sum_w"], 1000.0);
    assert_eq!(shown["power_cap_default_sum_w"], 1400.0);
    drop(agent);

    // A reboot: the board defaults.
    let said = reboot(&driver);
    assert!(said.contains("700 W"), "{said}");
    let shown = show(&driver);
    assert_eq!(caps(&shown), [700.0, 700.0], "{shown}");
    assert_eq!(shown["boots"], 1);

    // SIGSTOP: a paused agent's caps stay in force too.
    let log = dir.path().join("paused.log");
    let mut agent = serve(dir.path(), &capping, &log);
    wait_for_caps(&driver, 500.0, &mut agent, &log);
    agent.signal("STOP");
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(caps(&show(&driver)), [500.0, 500.0]);
    agent.signal("KILL");
    drop(agent);

    // The next agent starts from what the driver holds: its policy may change only the
    // batch, so the caps it reports in force are the ones the killed agent left.
    let batch_only = dir.path().join("batch-only.toml");
    std::fs::write(
        &batch_only,
        format!(
            "name = \"batch-only\"\nplugin = \"{}\"\nknobs = [\"batch-size\"]\ntick_ms = 200\n[params]\nbatch_size = \"64\"\n",
            built_plugin("policy_static").display()
        ),
    )
    .expect("spec");
    let restarted = serve_config(dir.path(), &batch_only, "restarted");
    let log = dir.path().join("restarted.log");
    let mut agent = serve(dir.path(), &restarted, &log);
    let socket = socket(dir.path(), "restarted");
    let mut status = serde_json::Value::Null;
    wait_for(
        "the restarted agent's first ticks",
        Duration::from_secs(60),
        || {
            agent.assert_alive("the agent", &log);
            if !socket.exists() {
                return false;
            }
            let output = tokwatt()
                .args(["status", "--json", "--socket"])
                .arg(&socket)
                .output()
                .expect("tokwatt status");
            if !output.status.success() {
                return false;
            }
            status = serde_json::from_slice(&output.stdout).expect("status JSON");
            status["ticks"].as_u64().is_some_and(|t| t >= 3)
        },
    );
    for gpu in status["gpus"].as_array().expect("gpus") {
        assert_eq!(gpu["in_force"]["power_cap_w"], 500.0, "{gpu}");
        assert_eq!(gpu["in_force"]["power_cap_requested_w"], 500.0, "{gpu}");
    }
    wait_for(
        "the new batch in the driver",
        Duration::from_secs(30),
        || {
            agent.assert_alive("the agent", &log);
            show(&driver)["boards"]
                .as_array()
                .is_some_and(|b| b.iter().all(|b| b["batch_size"] == 64))
        },
    );
    assert_eq!(caps(&show(&driver)), [500.0, 500.0]);

    // A reboot under a running agent: it sees the defaults at its next read.
    reboot(&driver);
    let shown = show(&driver);
    assert_eq!(caps(&shown), [700.0, 700.0], "{shown}");
    assert!(
        shown["boards"]
            .as_array()
            .is_some_and(|b| b.iter().all(|b| b["batch_size"].is_null())),
        "{shown}"
    );
    wait_for(
        "the agent to see the reboot",
        Duration::from_secs(30),
        || {
            agent.assert_alive("the agent", &log);
            let output = tokwatt()
                .args(["status", "--json", "--socket"])
                .arg(&socket)
                .output()
                .expect("tokwatt status");
            let status: serde_json::Value =
                serde_json::from_slice(&output.stdout).expect("status JSON");
            status["gpus"]
                .as_array()
                .is_some_and(|g| g.iter().all(|g| g["in_force"]["power_cap_w"] == 700.0))
        },
    );
    agent.signal("TERM");
    let exited = agent.0.wait().expect("serve exits");
    assert!(
        exited.success(),
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
}

#[test]
fn restore_puts_back_through_the_driver_what_a_killed_run_changed() {
    let dir = tempdir();
    let driver = dir.path().join("driver.json");
    let state = dir.path().join("state.json");
    let log = dir.path().join("run.log");
    let mut run = Running(
        sim_run(
            &repo_root().join("policies/static.toml"),
            "120s",
            &dir.path().join("out"),
        )
        .args(["--gpus", "2", "--realtime", "--tick", "200ms"])
        .arg("--sim-driver")
        .arg(&driver)
        .arg("--state-file")
        .arg(&state)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("tokwatt run starts"),
    );
    wait_for_caps(&driver, 500.0, &mut run, &log);
    run.signal("KILL");
    drop(run);
    assert!(state.exists(), "a crash leaves the saved originals behind");
    assert_eq!(caps(&show(&driver)), [500.0, 500.0]);

    let output = tokwatt()
        .args(["restore", "--sim-driver"])
        .arg(&driver)
        .arg("--state-file")
        .arg(&state)
        .output()
        .expect("tokwatt restore");
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(!state.exists(), "restored, the state file cleared");
    assert_eq!(caps(&show(&driver)), [700.0, 700.0], "back in the driver");

    // A driver file that is not there is named, not created.
    let missing = tokwatt()
        .args(["sim-driver", "show"])
        .arg(dir.path().join("nope.json"))
        .output()
        .expect("runs");
    assert!(!missing.status.success());
    assert!(
        stderr(&missing).contains("does not exist"),
        "{}",
        stderr(&missing)
    );
    assert!(!dir.path().join("nope.json").exists());
}
