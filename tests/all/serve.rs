//! `tokwatt serve`: one agent for every GPU of a node, acted on while it runs. The swap
//! test is issue 15's: a policy swapped every few ticks for hundreds of ticks, no missed
//! tick, state carried over, a broken new policy rolled back by itself.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use tokwatt_serve::api::{Control, ControlError, SwapRequest};
use tokwatt_serve::serve::{self, ServeConfig};

use crate::support::*;
use tokwatt_test_support::wait_for;

/// Short enough for hundreds of ticks in seconds; the fixtures' 5 ms deadline (10 ms with
/// the wall-clock margin) fits in it.
const TICK: &str = "20ms";

fn sandbox() -> &'static str {
    "[sandbox]\ndeadline_ms = 5\n"
}

fn config(dir: &Path, spec: &Path, extra: &str) -> ServeConfig {
    config_with(dir, spec, "", extra)
}

/// [`config`] with more `[policy]` keys (`policy_keys`, whole lines).
fn config_with(dir: &Path, spec: &Path, policy_keys: &str, extra: &str) -> ServeConfig {
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("component-cache");
    let text = format!(
        "[policy]\nspec = \"{}\"\ncache_dir = \"{}\"\nprobation_ticks = 5\n{policy_keys}\n[node]\nbackend = \"sim\"\nsim_gpus = 2\ntick = \"{TICK}\"\n\n[output]\ndir = \"{}\"\n{extra}",
        spec.display(),
        cache.display(),
        dir.join("out").display()
    );
    let path = dir.join("serve.toml");
    std::fs::write(&path, &text).expect("write config");
    ServeConfig::load(&path).expect("the test's config is valid")
}

/// A `[state]` table naming `path` as the state file (a simulated node keeps one only then).
fn state_table(path: &Path) -> String {
    format!("\n[state]\nfile = \"{}\"\n", path.display())
}

#[test]
fn swaps_every_few_ticks_for_hundreds_of_ticks_miss_none_carry_state_and_roll_back() {
    let dir = tempdir();
    let stateful = write_spec(
        dir.path(),
        "stateful",
        &built_plugin("fixture_stateful"),
        sandbox(),
    );
    let broken = write_spec(
        dir.path(),
        "broken",
        &built_plugin("fixture_trap_decide"),
        sandbox(),
    );
    let config = config(dir.path(), &stateful, "");
    let stop = Arc::new(AtomicBool::new(false));
    let agent = serve::start(&config, stop, None).expect("the agent starts");
    let control = agent.control();
    let swap_fresh = |spec: &PathBuf, fresh: bool| {
        control.swap(&SwapRequest {
            spec: spec.clone(),
            plugin: None,
            fresh,
        })
    };
    let swap = |spec: &PathBuf| swap_fresh(spec, false);

    // A swap every few ticks until hundreds of ticks have passed.
    let mut swaps = 0;
    let mut last_tick = 0;
    while control.status().ticks < 300 {
        // Every fifth asks for a fresh start, as `tokwatt fleet ab`'s halves do.
        let fresh = swaps % 5 == 4;
        let outcome = swap_fresh(&stateful, fresh).expect("a stateful policy swaps in");
        assert_eq!(
            outcome.state_carried,
            Some(!fresh),
            "same schema: the state is carried unless a fresh start was asked ({})",
            outcome.message
        );
        assert!(outcome.tick > last_tick || swaps == 0, "{outcome:?}");
        last_tick = outcome.tick;
        swaps += 1;
        std::thread::sleep(Duration::from_millis(40));
    }
    assert!(swaps >= 20, "only {swaps} swaps in 300 ticks");

    // A policy that traps on its third decide: in within probation, out by itself.
    let outcome = swap(&broken).expect("the broken policy starts (its init is fine)");
    assert_eq!(outcome.policy, "broken");
    wait_for("the automatic rollback", Duration::from_secs(10), || {
        control.status().policy.rollbacks == 1
    });
    let status = control.status();
    assert_eq!(status.policy.name, "stateful", "{:?}", status.policy);
    assert!(
        status
            .failures
            .last
            .as_deref()
            .is_some_and(|l| l.contains("broken"))
    );

    // The operator's rollback goes back through the history, then runs out.
    let back = control.rollback().expect("an earlier policy to go back to");
    assert!(back.message.starts_with("rolled back"), "{}", back.message);
    // Counted as what it is, not as a swap.
    let policy = control.status().policy;
    assert_eq!(
        (policy.operator_rollbacks, policy.swaps),
        (1, swaps + 1),
        "{policy:?}"
    );

    // Pause holds the settings; a swap while paused changes nothing; resume.
    control.pause().expect("pause");
    assert!(control.status().paused);
    let held = control.status().gpus[0].in_force;
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(control.status().gpus[0].in_force, held);
    let refused = swap(&stateful).expect_err("no swap while paused");
    assert!(matches!(refused, ControlError::Conflict(_)), "{refused:?}");
    control.resume().expect("resume");
    assert!(!control.status().paused);

    // Restore defaults: the device's default cap and no clock lock, then paused.
    control.restore_defaults().expect("restore defaults");
    let status = control.status();
    assert!(status.paused);
    for gpu in &status.gpus {
        assert_eq!(gpu.in_force.power_cap_w, 700.0, "gpu {}", gpu.gpu);
        assert_eq!(gpu.in_force.sm_clock_max_mhz, 1980, "gpu {}", gpu.gpu);
    }
    control.resume().expect("resume");

    // A bad spec is refused with its reason, and nothing changes.
    let before = control.status().policy;
    let missing = swap(&dir.path().join("nope.toml")).expect_err("no such spec");
    assert!(
        matches!(&missing, ControlError::BadRequest(m) if m.contains("nope.toml")),
        "{missing:?}"
    );
    let after = control.status().policy;
    assert_eq!((before.name, before.swaps), (after.name, after.swaps));
    assert_eq!(control.status().failures.swaps_refused, 1);

    let metrics = control.metrics();
    assert!(metrics.contains("tokwatt_policy_swaps_total"), "{metrics}");
    let node_wide = |name: &str| {
        metrics.lines().find_map(|line| {
            let (sample, value) = line.split_once(' ')?;
            (sample == name || sample.starts_with(&format!("{name}{{")))
                .then(|| value.parse::<f64>().ok())?
        })
    };
    assert_eq!(node_wide("tokwatt_operator_rollbacks_total"), Some(1.0));
    assert_eq!(node_wide("tokwatt_swaps_total"), Some((swaps + 1) as f64));

    agent.stop();
    let summary = agent.join().expect("the agent ends cleanly");
    let totals = &summary.totals;
    assert_eq!(totals.swaps.rollbacks, 1);
    assert_eq!(totals.swaps.swaps, swaps + 1, "{:?}", totals.swaps);
    assert_eq!(totals.swaps.operator_rollbacks, 1);
    assert_eq!(
        totals.swaps.state_carried + totals.swaps.started_fresh,
        totals.swaps.swaps + totals.swaps.operator_rollbacks
    );

    // No missed tick: every tick of both GPUs is in the trace, in order.
    let out = std::fs::read_dir(dir.path().join("out"))
        .expect("output folder")
        .next()
        .expect("one run folder")
        .expect("entry")
        .path();
    let trace = read_trace(&out.join("trace.csv"));
    assert_eq!(trace.len() as u64, totals.ticks * 2);
    for (i, pair) in trace.chunks(2).enumerate() {
        for (gpu, row) in pair.iter().enumerate() {
            assert_eq!(row.fields["tick"], i.to_string(), "row {i} gpu {gpu}");
            assert_eq!(row.fields["gpu"], gpu.to_string());
        }
    }
    // Only the broken policy's failing tick fell back.
    assert_eq!(totals.fallback_ticks, 1, "{totals:?}");
}

/// A child process killed when the test ends early (a failed assertion), so no agent
/// outlives its test.
struct Running(Option<std::process::Child>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn serve_runs_until_stopped_and_answers_the_cli_on_its_socket() {
    let dir = tempdir();
    let spec = repo_root().join("policies/slo-batch.toml");
    let socket = dir.path().join("run/tokwatt.sock");
    let config_path = dir.path().join("serve.toml");
    std::fs::write(
        &config_path,
        format!(
            "[policy]\nspec = \"{}\"\n[node]\nbackend = \"sim\"\nsim_gpus = 2\ntick = \"200ms\"\n[api]\nsocket = \"{}\"\n[output]\ndir = \"{}\"\n",
            spec.display(),
            socket.display(),
            dir.path().join("out").display()
        ),
    )
    .expect("config");
    let mut child = Running(Some(
        tokwatt()
            .args(["serve", "--config"])
            .arg(&config_path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("tokwatt serve starts"),
    ));
    wait_for("the control socket", Duration::from_secs(60), || {
        socket.exists()
    });

    let status = tokwatt()
        .args(["status", "--json", "--socket"])
        .arg(&socket)
        .output()
        .expect("tokwatt status");
    assert!(status.status.success(), "{}", stderr(&status));
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status JSON");
    assert_eq!(json["policy"]["name"], "slo-batch");
    assert_eq!(json["simulated"], true);
    assert_eq!(json["gpus"].as_array().map(Vec::len), Some(2));
    // The node's row: the GPUs summed, once a tick has been observed.
    let status_json = || -> serde_json::Value {
        let output = tokwatt()
            .args(["status", "--json", "--socket"])
            .arg(&socket)
            .output()
            .expect("tokwatt status");
        serde_json::from_slice(&output.stdout).expect("status JSON")
    };
    wait_for("a tick observed", Duration::from_secs(30), || {
        !status_json()["node"].is_null()
    });
    let json = status_json();
    let node = &json["node"];
    assert_eq!(node["gpus"], 2, "{node}");
    let caps: f64 = json["gpus"]
        .as_array()
        .map(|gpus| {
            gpus.iter()
                .filter_map(|g| g["in_force"]["power_cap_w"].as_f64())
                .sum()
        })
        .unwrap_or_default();
    assert!(
        node["power_cap_w"]
            .as_f64()
            .is_some_and(|w| (w - caps).abs() < 1e-6 && w > 0.0),
        "{json}"
    );
    let human = tokwatt()
        .args(["status", "--socket"])
        .arg(&socket)
        .output()
        .expect("tokwatt status");
    let text = String::from_utf8_lossy(&human.stdout);
    assert!(text.contains("node 2 GPUs"), "{text}");

    let swap = tokwatt()
        .args(["policy", "swap"])
        .arg(repo_root().join("policies/clock-search.toml"))
        .arg("--socket")
        .arg(&socket)
        .output()
        .expect("tokwatt policy swap");
    assert!(swap.status.success(), "{}", stderr(&swap));
    assert!(
        String::from_utf8_lossy(&swap.stdout).contains("clock-search"),
        "{}",
        String::from_utf8_lossy(&swap.stdout)
    );

    // A spec that is not one is refused with its reason, and the command the refusal
    // names, run as printed, shows the line.
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "name = \"bad\"\nplugin = \"x.wasm\"\nknob = [\"power-cap\"]\n",
    )
    .expect("bad spec");
    let refused = tokwatt()
        .args(["policy", "swap"])
        .arg(&bad)
        .arg("--socket")
        .arg(&socket)
        .output()
        .expect("tokwatt policy swap");
    assert!(!refused.status.success());
    let message = stderr(&refused);
    assert!(
        message.contains(
            "bad.toml:3:1 is not a valid policy spec: unknown field, expected one of `name`"
        ) && message.contains("docs/book/src/reference/spec.md"),
        "{message}"
    );
    // Read on this side, the reason comes in full.
    assert!(message.contains("unknown field `knob`"), "{message}");
    let suggested = message
        .split("run `")
        .nth(1)
        .and_then(|rest| rest.split('`').next())
        .unwrap_or_else(|| panic!("no command in {message}"));
    let mut words = suggested.split(' ');
    assert_eq!(words.next(), Some("tokwatt"), "{suggested}");
    let check = tokwatt()
        .args(words)
        .output()
        .expect("the suggested command");
    let checked = stderr(&check);
    assert!(
        !check.status.success()
            && checked.contains("unknown field `knob`")
            && !checked.contains("unexpected argument"),
        "{checked}"
    );
    assert!(
        repo_root()
            .join("docs/book/src/reference/spec.md")
            .is_file()
    );

    // SIGTERM: the loop ends at a tick boundary and the agent exits cleanly.
    let child = child.0.take().expect("still running");
    let pid = child.id().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let output = child.wait_with_output().expect("serve exits");
    let log = stderr(&output);
    assert!(output.status.success(), "{log}");
    assert!(
        log.contains("settings restored") && log.contains("1 swaps"),
        "{log}"
    );
    assert!(!socket.exists(), "the socket is removed on exit");
}

#[test]
fn a_bad_config_is_refused_with_its_line_and_changes_nothing() {
    let dir = tempdir();
    let path = dir.path().join("serve.toml");
    std::fs::write(
        &path,
        "[policy]\nspec = \"/nowhere.toml\"\n[node]\nbackend = \"sim\"\nsim_gpus = 0\n",
    )
    .expect("config");
    let output = tokwatt()
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .expect("tokwatt serve");
    assert!(!output.status.success());
    let message = stderr(&output);
    assert!(
        message.contains("serve.toml:5") && message.contains("node.sim_gpus"),
        "{message}"
    );
}

#[test]
fn a_watched_policy_folder_is_swapped_in_when_it_changes_and_settles() {
    let dir = tempdir();
    let first = write_spec(
        dir.path(),
        "stateful",
        &built_plugin("fixture_stateful"),
        sandbox(),
    );
    let watched = dir.path().join("policy.d");
    std::fs::create_dir(&watched).expect("watched folder");
    let config = config_with(
        dir.path(),
        &first,
        &format!(
            "watch = \"{}\"\nwatch_period = \"100ms\"\n",
            watched.display()
        ),
        "",
    );
    let agent =
        serve::start(&config, Arc::new(AtomicBool::new(false)), None).expect("the agent starts");
    let control = agent.control();

    // A spec dropped into the folder takes over once the folder has settled.
    write_spec(
        &watched,
        "watched",
        &built_plugin("fixture_stateful"),
        sandbox(),
    );
    wait_for(
        "the watched spec to take over",
        Duration::from_secs(20),
        || control.status().policy.name == "watched",
    );
    // Two specs: which one is meant is unknown, so nothing changes and it is counted.
    write_spec(
        &watched,
        "second",
        &built_plugin("fixture_stateful"),
        sandbox(),
    );
    wait_for("the refusal", Duration::from_secs(20), || {
        control.status().failures.swaps_refused == 1
    });
    let status = control.status();
    assert_eq!(status.policy.name, "watched");
    assert!(
        status
            .failures
            .last
            .as_deref()
            .is_some_and(|l| l.contains("2 policy specs")),
        "{:?}",
        status.failures
    );
    agent.stop();
    assert_eq!(agent.join().expect("clean end").totals.swaps.swaps, 1);
}

/// A watched folder that cannot be read is refused before any GPU setting changes: no
/// state file was written, no loop was left running.
#[test]
fn a_missing_watched_folder_is_refused_before_anything_changes() {
    let dir = tempdir();
    let spec = write_spec(
        dir.path(),
        "stateful",
        &built_plugin("fixture_stateful"),
        sandbox(),
    );
    let missing = dir.path().join("no-such-folder");
    let state = dir.path().join("state.json");
    let config = config_with(
        dir.path(),
        &spec,
        &format!("watch = \"{}\"\n", missing.display()),
        &state_table(&state),
    );
    let error = match serve::start(&config, Arc::new(AtomicBool::new(false)), None) {
        Ok(_) => panic!("an agent started watching a folder that is not there"),
        Err(error) => error.to_string(),
    };
    assert!(error.contains("no-such-folder"), "{error}");
    assert!(error.contains("`policy.watch`"), "{error}");
    assert!(!state.exists(), "nothing was saved, so nothing changed");
}

/// A return to the defaults that the GPUs refuse is an error naming the failure, not a
/// success: here the state file cannot record the clock lock's first change (a folder took
/// its place), so the guard changes nothing and the loop counts it.
#[test]
fn a_refused_return_to_the_defaults_is_reported_as_such() {
    let dir = tempdir();
    let state = dir.path().join("state.json");
    let spec = write_spec(
        dir.path(),
        "static",
        &built_plugin("policy_static"),
        &format!("[params]\npower_cap_w = \"500\"\n{}", sandbox()),
    );
    let config = config(dir.path(), &spec, &state_table(&state));
    let stop = Arc::new(AtomicBool::new(false));
    let agent = serve::start(&config, Arc::clone(&stop), None).expect("the agent starts");
    let control = agent.control();
    wait_for("two ticks", Duration::from_secs(20), || {
        control.status().ticks >= 2
    });
    assert!(state.is_file(), "the originals are saved");
    std::fs::remove_file(&state).expect("remove the state file");
    std::fs::create_dir(&state).expect("a folder in its place");
    std::fs::write(state.join("keep"), "x").expect("not empty");

    let refused = control
        .restore_defaults()
        .expect_err("the clock lock's change could not be saved");
    assert!(
        matches!(&refused, ControlError::Conflict(m) if m.contains("failed") && m.contains("paused")),
        "{refused:?}"
    );
    assert!(control.status().paused);
    assert!(control.status().failures.actuator_errors > 0);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    drop(agent);
}

/// A stop asked for while the agent starts (a signal during a slow compile) ends the start
/// before the policy's first settings are applied, and leaves no state file behind.
#[test]
fn a_stop_during_start_up_applies_nothing() {
    let dir = tempdir();
    let state = dir.path().join("state.json");
    let spec = write_spec(
        dir.path(),
        "stateful",
        &built_plugin("fixture_stateful"),
        sandbox(),
    );
    let config = config(dir.path(), &spec, &state_table(&state));
    let error = match serve::start(&config, Arc::new(AtomicBool::new(true)), None) {
        Ok(_) => panic!("an agent started after it was told to stop"),
        Err(error) => error.to_string(),
    };
    assert!(error.contains("while starting"), "{error}");
    assert!(
        !state.exists(),
        "nothing was changed, so nothing is left to restore"
    );
}
