//! Invariant 3: every setting the agent changed is restored on exit (normal, SIGINT,
//! SIGTERM, panic), and after a crash (`kill -9`) by the next start or `tokwatt restore`,
//! from a state file written before the first change. Driven on the simulated GPU.

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::support::*;

/// A run on the simulator against the wall clock, so there is time to interrupt it.
fn spawn_realtime(state: &Path, out: &Path) -> Child {
    sim_run(&repo_root().join("policies/hill-climb.toml"), "120s", out)
        .args(["--realtime", "--tick", "200ms"])
        .arg("--state-file")
        .arg(state)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tokwatt starts")
}

/// Wait (generously) for the run to save the original settings.
fn wait_for_state_file(state: &Path, child: &mut Child) {
    let start = Instant::now();
    while !state.exists() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("tokwatt exited early: {status}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no state file written"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Let a few ticks pass so settings have changed.
    std::thread::sleep(Duration::from_millis(1500));
}

fn signal(child: &Child, name: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
}

#[test]
fn sigterm_and_sigint_restore_and_clear_the_state_file() {
    for sig in ["TERM", "INT"] {
        let dir = tempdir();
        let state = dir.path().join("state.json");
        let mut child = spawn_realtime(&state, &dir.path().join("out"));
        wait_for_state_file(&state, &mut child);
        signal(&child, sig);
        let output = child.wait_with_output().expect("exits");
        assert!(output.status.success(), "SIG{sig}: {}", stderr(&output));
        assert!(
            !state.exists(),
            "SIG{sig}: settings restored, state file cleared"
        );
        let summary: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("out/summary.json")).expect("summary"),
        )
        .expect("json");
        assert_eq!(summary["interrupted"], true);
    }
}

#[test]
fn kill_9_leaves_the_state_file_and_restore_puts_settings_back() {
    let dir = tempdir();
    let state = dir.path().join("state.json");
    let mut child = spawn_realtime(&state, &dir.path().join("out"));
    wait_for_state_file(&state, &mut child);
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    assert!(state.exists(), "a crash leaves the saved originals behind");
    let saved = std::fs::read_to_string(&state).expect("state");
    assert!(saved.contains("SIM-"), "GPUs are keyed by UUID: {saved}");

    let output = tokwatt()
        .args(["restore", "--sim", "h200", "--state-file"])
        .arg(&state)
        .output()
        .expect("runs");
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(!state.exists(), "restored, state file cleared");
    let again = tokwatt()
        .args(["restore", "--sim", "h200", "--state-file"])
        .arg(&state)
        .output()
        .expect("runs");
    assert!(again.status.success());
    assert!(String::from_utf8_lossy(&again.stdout).contains("nothing to restore"));
}

/// A run killed outright keeps a current summary.json (interrupted), so it can still be
/// reported and replayed (issue 43 item 4: it had none, though its trace was whole).
#[test]
fn a_run_killed_with_kill_9_can_be_reported_and_replayed() {
    let dir = tempdir();
    let state = dir.path().join("state.json");
    let out = dir.path().join("out");
    let mut child = spawn_realtime(&state, &out);
    wait_for_state_file(&state, &mut child);
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).expect("a summary from the first tick"),
    )
    .expect("whole JSON");
    assert_eq!(summary["interrupted"], true, "{summary}");
    let report = tokwatt().arg("report").arg(&out).output().expect("runs");
    assert!(report.status.success(), "{}", stderr(&report));
    let replay = tokwatt()
        .arg("replay")
        .arg(&out)
        .arg("--policy")
        .arg(repo_root().join("policies/static.toml"))
        .output()
        .expect("runs");
    assert!(replay.status.success(), "{}", stderr(&replay));
}

#[test]
fn the_next_start_restores_what_a_crash_left() {
    let dir = tempdir();
    let state = dir.path().join("state.json");
    let mut child = spawn_realtime(&state, &dir.path().join("crashed"));
    wait_for_state_file(&state, &mut child);
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    assert!(state.exists());

    let r = run_sim(
        &repo_root().join("policies/static.toml"),
        "30s",
        &dir.path().join("next"),
        &["--state-file", &state.to_string_lossy()],
    );
    assert_eq!(num(&r.summary, "ticks"), 30.0);
    assert!(
        !state.exists(),
        "the next run restored the leftovers, then its own settings"
    );
}

#[test]
fn a_panic_restores_settings() {
    let dir = tempdir();
    let state = dir.path().join("state.json");
    let output = sim_run(
        &repo_root().join("policies/hill-climb.toml"),
        "1m",
        &dir.path().join("out"),
    )
    .args(["--debug-panic-after-ticks", "5"])
    .arg("--state-file")
    .arg(&state)
    .output()
    .expect("runs");
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("panicking on purpose"),
        "{}",
        stderr(&output)
    );
    assert!(
        !state.exists(),
        "unwinding restored the settings and cleared the state file"
    );
}

/// A run like [`spawn_realtime`] on 2 GPUs at a 50 ms tick, whose policy (the shipped
/// `static`) changes the power cap, the SM clock and the batch size at its first tick.
fn spawn_changing(spec: &Path, state: &Path, out: &Path) -> Child {
    sim_run(spec, "1h", out)
        .args(["--gpus", "2", "--realtime"])
        .arg("--state-file")
        .arg(state)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tokwatt starts")
}

/// What a run had in force on each GPU when it died: the last whole observation of each
/// (the line being written at the kill may be cut short).
fn last_in_force(observations: &Path) -> Vec<tokwatt_core::types::InForce> {
    let text = std::fs::read_to_string(observations).unwrap_or_default();
    let mut last: Vec<Option<tokwatt_core::types::InForce>> = Vec::new();
    for line in text.lines() {
        let Ok(row) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let gpu = row["observation"]["gpu"].as_u64().expect("gpu") as usize;
        let in_force = serde_json::from_value(row["in_force_after"].clone()).expect("in force");
        if last.len() <= gpu {
            last.resize(gpu + 1, None);
        }
        last[gpu] = Some(in_force);
    }
    last.into_iter().flatten().collect()
}

/// A small deterministic generator for the kill delays (xorshift64*).
struct Delays(u64);

impl Delays {
    /// 50..=2000 ms.
    fn next_ms(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        50 + self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % 1951
    }
}

/// The in-suite version of `scripts/crash-restore.sh`: five `kill -9`s at seeded random
/// moments, each followed by a restore that is checked by value. Since a fresh simulated
/// GPU starts at its defaults, the crashed run's settings (from its observations) are
/// first put on a simulated GPU, which the restore must then bring back to the saved
/// originals — themselves checked to be the profile's stock settings.
#[test]
fn random_kill_9s_are_all_restored_by_value() {
    use tokwatt_agent::assembly::{self, SimTarget};
    use tokwatt_agent::restore::{Outcome, Setting, StateFile, restore_all};

    let profile = tokwatt_sim::GpuProfile::load("h200").expect("h200 profile");
    let stock_w = profile.power_cap.default_w;
    let sm_max = profile.sm_max_mhz();
    let dir = tempdir();
    let spec = write_spec(
        dir.path(),
        "crash-static",
        &built_plugin("policy_static"),
        "tick_ms = 50\n[params]\npower_cap_w = \"400\"\nsm_clock_max_mhz = \"1500\"\nbatch_size = \"128\"\n[guardrails]\npower_cap_min_w = 300.0\n[sandbox]\ndeadline_ms = 25",
    );
    let mut delays = Delays(0x5eed_2026_0013);
    let mut restored_changes = 0;
    for round in 0..5 {
        let state = dir.path().join(format!("state-{round}.json"));
        let out = dir.path().join(format!("out-{round}"));
        let delay = Duration::from_millis(delays.next_ms());
        let mut child = spawn_changing(&spec, &state, &out);
        // The first two rounds count from the start, so a kill may land before the
        // originals are saved; the others from the first change, however slow the start.
        if round >= 2 {
            let start = Instant::now();
            while !state.exists() {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!("round {round}: tokwatt exited early: {status}");
                }
                assert!(start.elapsed() < Duration::from_secs(60), "no state file");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        std::thread::sleep(delay);
        if child.try_wait().expect("status").is_some() {
            let output = child.wait_with_output().expect("output");
            panic!(
                "round {round}: the run ended before its kill: {}",
                stderr(&output)
            );
        }
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");

        let in_force = last_in_force(&out.join("observations.jsonl"));
        let state_file = StateFile::new(&state);
        let Some(saved) = state_file
            .load()
            .expect("the state file a crash leaves loads")
        else {
            assert!(
                in_force.is_empty(),
                "round {round}: settings changed without a state file: {in_force:?}"
            );
            continue;
        };
        assert_eq!(saved.len(), 2, "round {round}");
        for (index, gpu) in saved.iter().enumerate() {
            assert_eq!(gpu.uuid, format!("SIM-h200-{index}"));
            assert_eq!(gpu.original.power_cap_w, stock_w, "round {round}: {gpu:?}");
            assert_eq!(gpu.original.sm_clock_lock_mhz, None, "round {round}");
            assert_eq!(gpu.original.mem_clock_lock_mhz, None, "round {round}");
        }

        // The "hardware" as the crash left it.
        let target = SimTarget {
            gpus: 2,
            ..SimTarget::new("h200")
        };
        let mut actuator = assembly::simulator(&target, 1).expect("sim").1.actuator;
        let sm_min = actuator.devices()[0].sm_clock_min_mhz();
        for (gpu, now) in in_force.iter().enumerate() {
            let gpu = gpu as u32;
            actuator
                .set_power_cap(gpu, now.power_cap_requested_w)
                .expect("cap");
            if now.sm_clock_max_mhz < sm_max {
                actuator
                    .set_sm_clock_lock(gpu, Some((sm_min, now.sm_clock_max_mhz)))
                    .expect("lock");
            }
            let left = actuator.read(gpu).expect("read");
            if left.power_cap_w != stock_w || left.sm_clock_lock_mhz.is_some() {
                restored_changes += 1;
            }
        }

        let report = restore_all(&state_file, actuator.as_mut()).expect("restore");
        assert!(
            report.is_complete() && report.state_cleared,
            "round {round}: {report}"
        );
        assert!(!state.exists(), "round {round}: state file cleared");
        for (gpu, saved_gpu) in saved.iter().enumerate() {
            let now = actuator.read(gpu as u32).expect("read");
            assert_eq!(
                now.power_cap_w, saved_gpu.original.power_cap_w,
                "round {round}"
            );
            assert_eq!(now.sm_clock_lock_mhz, saved_gpu.original.sm_clock_lock_mhz);
            assert_eq!(
                now.mem_clock_lock_mhz,
                saved_gpu.original.mem_clock_lock_mhz
            );
            // The policy never locks memory clocks: that lock is not the run's to reset.
            assert!(
                report.gpus[gpu]
                    .steps
                    .iter()
                    .all(|step| match step.setting {
                        Setting::MemClockLock => step.outcome == Outcome::NotChanged,
                        _ => matches!(step.outcome, Outcome::Restored | Outcome::AlreadyInPlace),
                    }),
                "round {round}: {report}"
            );
        }
    }
    assert!(
        restored_changes >= 3 * 2,
        "the last three rounds each kill a run that had changed both GPUs ({restored_changes} changed GPUs restored)"
    );
}

#[test]
fn a_corrupt_or_foreign_state_file_is_refused_by_restore_and_run_and_kept() {
    let dir = tempdir();
    let cases: [(&str, &str, &str); 3] = [
        ("cut-short", "{\"format\": 1, \"gpus\": [", "is corrupt"),
        (
            "foreign",
            "{\"theme\": \"dark\"}",
            "is not a tokwatt state file",
        ),
        (
            "not-json",
            "root:x:0:0:root:/root:/bin/bash\n",
            "is not a tokwatt state file",
        ),
    ];
    for (name, text, says) in cases {
        let state = dir.path().join(format!("{name}.json"));
        std::fs::write(&state, text).expect("write");
        let restore = tokwatt()
            .args(["restore", "--sim", "h200", "--state-file"])
            .arg(&state)
            .output()
            .expect("runs");
        assert!(!restore.status.success(), "{name}: restore guessed");
        let message = stderr(&restore);
        assert!(message.contains(says), "{name}: {message}");
        assert!(
            message.contains(&state.display().to_string()),
            "{name}: names the file: {message}"
        );
        assert!(
            String::from_utf8_lossy(&restore.stdout).is_empty(),
            "{name}"
        );

        let out = dir.path().join(format!("out-{name}"));
        let run = sim_run(&repo_root().join("policies/static.toml"), "10s", &out)
            .arg("--state-file")
            .arg(&state)
            .output()
            .expect("runs");
        assert!(!run.status.success(), "{name}: a run went ahead");
        assert!(stderr(&run).contains(says), "{name}: {}", stderr(&run));
        assert!(!out.join("trace.csv").exists(), "{name}: no tick ran");
        assert_eq!(
            std::fs::read_to_string(&state).expect("kept"),
            text,
            "{name}: the file is left as it was"
        );
    }
}
