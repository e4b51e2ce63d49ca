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

/// The samples of the unlabelled `family` (`None`: absent) and of a per-GPU `family` (by
/// GPU index) in a scrape of `/metrics`.
fn scraped(text: &str, family: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(family)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}

fn scraped_by_gpu(text: &str, family: &str) -> Vec<f64> {
    let mut samples: Vec<(String, f64)> = text
        .lines()
        .filter_map(|line| line.strip_prefix(family)?.strip_prefix('{'))
        .filter_map(|rest| {
            let gpu = rest.split("gpu=\"").nth(1)?.split('"').next()?.to_owned();
            let value = rest.rsplit(' ').next()?.trim().parse().ok()?;
            Some((gpu, value))
        })
        .collect();
    samples.sort_by(|a, b| a.0.cmp(&b.0));
    samples.into_iter().map(|(_, value)| value).collect()
}

fn scrape(port: u16) -> String {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut text = String::new();
    let _ = stream.read_to_string(&mut text);
    text
}

/// Issue 52: a paused agent does not know time passed, and showed the caps it had set
/// (2,215 W) while its driver held what a fence lowered them to (1,200 W). Now the first
/// tick after the pause finds the loop stalled, counts it and reads every GPU back before
/// it shows or acts on anything: from the scrape that counts the stall on, `/metrics`
/// shows the driver's caps, never the ones set before the pause, and the policy's cap
/// comes back from the fence's as its guardrails allow (1 W a tick here), not at once
/// from a cap the loop only remembers.
#[test]
fn a_paused_agent_shows_and_acts_on_the_caps_its_driver_holds_once_it_runs_again() {
    let dir = tempdir();
    let driver = dir.path().join("node/driver.json");
    let spec = dir.path().join("slow-raise.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"slow-raise\"\nplugin = \"{}\"\nknobs = [\"power-cap\"]\ntick_ms = 200\n[params]\npower_cap_w = \"500\"\n[guardrails]\nmax_power_cap_raise_w = 1.0\n",
            built_plugin("policy_static").display()
        ),
    )
    .expect("spec");
    let config = serve_config(dir.path(), &spec, "paused");
    let port = tokwatt_test_support::free_port();
    let text = std::fs::read_to_string(&config).expect("config");
    std::fs::write(
        &config,
        format!("{text}[metrics]\nlisten = \"127.0.0.1:{port}\"\n"),
    )
    .expect("config");
    let log = dir.path().join("paused.log");
    let mut agent = serve(dir.path(), &config, &log);
    wait_for_caps(&driver, 500.0, &mut agent, &log);
    wait_for("500 W on /metrics", Duration::from_secs(30), || {
        agent.assert_alive("the agent", &log);
        scraped_by_gpu(&scrape(port), "tokwatt_gpu_power_cap_requested_watts") == [500.0, 500.0]
    });
    // Present from the start (at zero, unless a loaded machine already held a tick back).
    let stalls_before = scraped(&scrape(port), "tokwatt_stalls_total").expect("the stall counter");

    // Paused for a second (five ticks); meanwhile a fence fits the caps within 600 W.
    agent.signal("STOP");
    std::thread::sleep(Duration::from_millis(1000));
    let fenced = tokwatt()
        .args(["fence", "--once", "--reserve", "600", "--sim-driver"])
        .arg(&driver)
        .output()
        .expect("tokwatt fence --once");
    assert!(fenced.status.success(), "{}", stderr(&fenced));
    assert_eq!(caps(&show(&driver)), [300.0, 300.0]);
    agent.signal("CONT");

    // Until the loop's first tick, a scrape may show what it last read (before the pause);
    // from the scrape that counts the stall on, every one shows the driver's caps.
    let mut after_the_stall = 0;
    let watching = std::time::Instant::now();
    while after_the_stall < 40 {
        assert!(
            watching.elapsed() < Duration::from_secs(30),
            "no stall counted 30 s after the pause\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        let text = scrape(port);
        let held = caps(&show(&driver));
        if scraped(&text, "tokwatt_stalls_total").is_some_and(|n| n > stalls_before) {
            after_the_stall += 1;
            assert!(
                scraped(&text, "tokwatt_stall_seconds_total").is_some_and(|s| s >= 0.5),
                "{text}"
            );
            for family in [
                "tokwatt_gpu_power_cap_requested_watts",
                "tokwatt_gpu_power_cap_enforced_watts",
            ] {
                let shown = scraped_by_gpu(&text, family);
                assert_eq!(shown.len(), 2, "{family}: {text}");
                for (shown, held) in shown.iter().zip(&held) {
                    // The gauge is the window's setting, the driver's may be a tick or
                    // two of 1 W raises further on; the 500 W of before is far off.
                    assert!(
                        (300.0..=330.0).contains(shown) && (held - shown).abs() <= 3.0,
                        "{family} shows {shown} W while the driver holds {held} W: {text}"
                    );
                }
            }
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    // The status says the same, and the policy's cap comes back 1 W a tick from the
    // fence's, not at once.
    let output = tokwatt()
        .args(["status", "--json", "--socket"])
        .arg(socket(dir.path(), "paused"))
        .output()
        .expect("tokwatt status");
    assert!(output.status.success(), "{}", stderr(&output));
    let status: serde_json::Value = serde_json::from_slice(&output.stdout).expect("status JSON");
    let held = caps(&show(&driver));
    for (gpu, held) in status["gpus"].as_array().expect("gpus").iter().zip(&held) {
        let requested = gpu["in_force"]["power_cap_requested_w"]
            .as_f64()
            .expect("a cap");
        assert!(
            (300.0..=330.0).contains(&requested) && (held - requested).abs() <= 3.0,
            "{gpu} while the driver holds {held} W"
        );
    }
    assert!(held.iter().all(|&c| c > 300.0 && c < 340.0), "{held:?}");
    agent.signal("TERM");
    let exited = agent.0.wait().expect("serve exits");
    assert!(
        exited.success(),
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        log_text.contains("the control loop stalled"),
        "one warning for the stall: {log_text}"
    );
}
