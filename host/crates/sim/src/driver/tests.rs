//! The simulated driver: settings that outlive a simulation, changes from other processes,
//! reboots, and the files it refuses.
#![allow(clippy::unwrap_used)] // tests may unwrap

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::{Phase, Scenario, SimConfig, SimError, SimGpu};
use tokwatt_core::clock::{Clock, VirtualClock};
use tokwatt_core::model::ModelShape;

/// Requests far outnumber the batch's slots and never finish: the boards draw what their
/// caps allow.
fn saturated() -> Scenario {
    Scenario {
        description: "saturated".to_owned(),
        model_name: "llama-3-8b".to_owned(),
        model: ModelShape::preset("llama-3-8b").unwrap(),
        context_tokens: 1024,
        output_tokens: 1_000_000,
        batch_size_max: 512,
        initial_batch_size: 256,
        queue_max: 4096,
        phases: vec![Phase {
            start_s: 0.0,
            arrival_rps: 20_000.0,
            outside_power_limit_w: None,
        }],
    }
}

fn h200() -> GpuProfile {
    GpuProfile::load("h200").unwrap()
}

fn config(profile: GpuProfile, gpus: u32) -> SimConfig {
    SimConfig {
        profile,
        scenario: saturated(),
        gpus,
        seed: 5,
        noise_seed: None,
    }
}

/// `gpus` simulated H200s on the driver at `path`, and their clock.
fn node(path: &Path, gpus: u32) -> (SimGpu, Arc<VirtualClock>) {
    let clock = VirtualClock::new();
    let sim = SimGpu::with_driver(config(h200(), gpus), clock.clone(), path).unwrap();
    (sim, clock)
}

fn driver_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("node/driver.json")
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

#[test]
fn a_new_driver_starts_at_the_board_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    let (sim, _clock) = node(&path, 2);
    let state = SimDriver::at(&path).read().unwrap();
    assert_eq!(state.profile, "h200");
    assert_eq!((state.generation, state.boots), (0, 0));
    assert_eq!(state.boards.len(), 2);
    for board in &state.boards {
        assert_eq!(board, &BoardSettings::boot_defaults(&state.limits));
    }
    assert_eq!(state.power_cap_sum_w(), 1400.0);
    let mut actuator = sim.actuator();
    assert_eq!(actuator.read(1).unwrap().power_cap_w, 700.0);
    assert_eq!(
        sim.workload().batch_size(1),
        256,
        "the workload's own batch"
    );
}

#[test]
fn settings_survive_the_simulation_that_set_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    {
        let (sim, clock) = node(&path, 2);
        let (mut actuator, mut workload) = (sim.actuator(), sim.workload());
        clock.sleep_until(secs(1.0));
        assert_eq!(actuator.set_power_cap(0, 450.0004).unwrap(), 450.0);
        actuator.set_sm_clock_lock(1, Some((1000, 1500))).unwrap();
        actuator.set_mem_clock_lock(1, Some((1, 100_000))).unwrap();
        workload.set_batch_size(0, 64).unwrap();
        // The simulation (the agent's process) ends here; the file stays.
    }
    let state = SimDriver::at(&path).read().unwrap();
    assert_eq!(
        state.boards[0].power_cap_w, 450.0,
        "to the milliwatt, as NVML"
    );
    assert_eq!(state.boards[0].batch_size, Some(64));
    assert_eq!(state.generation, 4, "one generation a change");

    let (sim, clock) = node(&path, 2);
    let (mut actuator, mut telemetry, workload) = (sim.actuator(), sim.telemetry(), sim.workload());
    let first = actuator.read(0).unwrap();
    assert_eq!(first.power_cap_w, 450.0);
    assert_eq!(workload.batch_size(0), 64);
    let second = actuator.read(1).unwrap();
    let sm_lock = second.sm_clock_lock_mhz.unwrap();
    assert!(sm_lock.0 >= 1000 && sm_lock.1 <= 1500, "{sm_lock:?}");
    assert!(second.mem_clock_lock_mhz.is_some());
    clock.sleep_until(secs(4.0));
    let window = telemetry.read_window(0).unwrap();
    assert_eq!(window.power_limit_enforced_w, 450.0);
    let window = telemetry.read_window(1).unwrap();
    assert!(window.sm_clock_mhz <= 1500, "{}", window.sm_clock_mhz);
}

#[test]
fn a_change_by_another_process_is_seen_by_telemetry_read_and_the_workload() {
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    let (sim, clock) = node(&path, 2);
    let (mut actuator, mut telemetry, workload) = (sim.actuator(), sim.telemetry(), sim.workload());
    clock.sleep_until(secs(3.0));
    telemetry.read_window(0).unwrap();
    let before = sim.truth(0).unwrap();
    assert!(before.power_w > 500.0, "saturated at 700 W: {before:?}");

    // A fence, `tokwatt restore` or an operator: another handle on the same file.
    let other = SimDriver::at(&path);
    other
        .update_board(0, |board| {
            board.power_cap_w = 300.0;
            board.batch_size = Some(32);
        })
        .unwrap();
    assert_eq!(actuator.read(0).unwrap().power_cap_w, 300.0);
    assert_eq!(workload.batch_size(0), 32);
    clock.sleep_until(secs(8.0));
    let window = telemetry.read_window(0).unwrap();
    assert_eq!(window.power_limit_enforced_w, 300.0);
    assert_eq!(window.power_limit_requested_w, Some(300.0));
    // In force, not only reported: the limiter holds the board to it.
    let truth = sim.truth(0).unwrap();
    assert!(
        truth.power_w * truth.sensor_gain <= 300.0 + 30.0,
        "{truth:?}"
    );
    // The other board is left alone.
    assert_eq!(actuator.read(1).unwrap().power_cap_w, 700.0);

    // The agent's next change keeps the other process's change to board 0.
    actuator.set_power_cap(1, 500.0).unwrap();
    let state = other.read().unwrap();
    assert_eq!(
        (state.boards[0].power_cap_w, state.boards[1].power_cap_w),
        (300.0, 500.0)
    );
}

#[test]
fn a_change_applies_from_when_it_is_seen_not_before() {
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    let (sim, clock) = node(&path, 1);
    let mut telemetry = sim.telemetry();
    clock.sleep_until(secs(3.0));
    telemetry.read_window(0).unwrap();
    // Five seconds pass unobserved, then a fence lowers the cap.
    clock.sleep_until(secs(8.0));
    SimDriver::at(&path)
        .update_board(0, |board| board.power_cap_w = 250.0)
        .unwrap();
    let window = telemetry.read_window(0).unwrap();
    // The five seconds ran at 700 W: the window's energy says so.
    assert!(
        window.energy_j / window.interval_s > 500.0,
        "{} W",
        window.energy_j / window.interval_s
    );
    assert_eq!(window.power_limit_enforced_w, 250.0);
}

#[test]
fn reboot_puts_the_defaults_back_then_the_boot_unit_fits_its_reserve() {
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    let (sim, _clock) = node(&path, 4);
    let (mut actuator, mut workload) = (sim.actuator(), sim.workload());
    for gpu in 0..4 {
        actuator.set_power_cap(gpu, 400.0).unwrap();
        actuator.set_sm_clock_lock(gpu, Some((900, 1200))).unwrap();
        workload.set_batch_size(gpu, 16).unwrap();
    }
    let driver = SimDriver::at(&path);

    // No boot unit: the board defaults.
    let booted = driver.reboot().unwrap();
    assert_eq!(booted.boots, 1);
    for board in &booted.boards {
        assert_eq!(board, &BoardSettings::boot_defaults(&booted.limits));
    }
    assert_eq!(booted.power_cap_sum_w(), booted.power_cap_default_sum_w());
    assert_eq!(actuator.read(2).unwrap().power_cap_w, 700.0);
    assert_eq!(actuator.read(2).unwrap().sm_clock_lock_mhz, None);
    assert_eq!(workload.batch_size(2), 256);

    // A boot unit with a reserve: the caps in force stay until the next boot.
    let enabled = driver.set_boot_reserve(Some(1200.0)).unwrap();
    assert_eq!(enabled.power_cap_sum_w(), 2800.0);
    let booted = driver.reboot().unwrap();
    assert_eq!(booted.boots, 2);
    assert!(booted.power_cap_sum_w() <= 1200.0);
    assert!(booted.power_cap_sum_w() > 1199.99);
    for board in &booted.boards {
        assert_eq!(board.power_cap_w, 300.0);
        assert_eq!(board.sm_clock_lock_mhz, None);
    }
    assert_eq!(actuator.read(0).unwrap().power_cap_w, 300.0);

    // A reserve under the boards' minimum caps: each board at its minimum.
    driver.set_boot_reserve(Some(500.0)).unwrap();
    let booted = driver.reboot().unwrap();
    assert!(booted.boards.iter().all(|b| b.power_cap_w == 200.0));

    // The unit disabled: the defaults again.
    driver.set_boot_reserve(None).unwrap();
    assert_eq!(driver.reboot().unwrap().power_cap_sum_w(), 2800.0);

    let refused = driver.set_boot_reserve(Some(f64::NAN)).unwrap_err();
    assert!(matches!(refused, DriverError::BadReserve(_)), "{refused}");
    let refused = driver.set_boot_reserve(Some(-5.0)).unwrap_err();
    assert!(refused.to_string().contains("positive"), "{refused}");
}

#[test]
fn a_write_that_changes_nothing_leaves_the_file_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    let (sim, _clock) = node(&path, 1);
    let mut actuator = sim.actuator();
    actuator.set_power_cap(0, 500.0).unwrap();
    let generation = SimDriver::at(&path).read().unwrap().generation;
    let modified = std::fs::metadata(&path).unwrap().modified().unwrap();
    for _ in 0..5 {
        actuator.set_power_cap(0, 500.0).unwrap();
    }
    assert_eq!(SimDriver::at(&path).read().unwrap().generation, generation);
    assert_eq!(
        std::fs::metadata(&path).unwrap().modified().unwrap(),
        modified
    );
}

#[test]
fn writers_at_once_lose_none_of_each_others_changes() {
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    let (_sim, _clock) = node(&path, 4);
    let writers: Vec<_> = (0..4u32)
        .map(|board| {
            let driver = SimDriver::at(&path);
            std::thread::spawn(move || {
                for step in 1..=25u32 {
                    driver
                        .update_board(board, |b| {
                            // A read-modify-write: a lost update leaves a gap.
                            assert_eq!(b.batch_size.unwrap_or(0), step - 1);
                            b.batch_size = Some(step);
                        })
                        .unwrap();
                }
            })
        })
        .collect();
    for writer in writers {
        writer.join().unwrap();
    }
    let state = SimDriver::at(&path).read().unwrap();
    assert!(state.boards.iter().all(|b| b.batch_size == Some(25)));
    assert_eq!(state.generation, 100);
}

#[test]
fn a_reader_never_waits_for_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    let (_sim, _clock) = node(&path, 1);
    let driver = SimDriver::at(&path);
    // A writer stopped while it held the lock (SIGSTOP): readers carry on.
    let held = File::options()
        .write(true)
        .open(driver.lock_path())
        .unwrap();
    held.lock().unwrap();
    let started = Instant::now();
    assert_eq!(driver.read().unwrap().boards.len(), 1);
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[test]
fn a_writer_waits_for_a_stopped_holder_only_so_long_and_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    let (_sim, _clock) = node(&path, 1);
    let driver = SimDriver::at(&path).with_lock_wait(Duration::from_millis(200));
    // A writer stopped while it held the lock: it wrote its process id, as every holder does.
    let mut held = File::options()
        .write(true)
        .open(driver.lock_path())
        .unwrap();
    held.lock().unwrap();
    held.set_len(0).unwrap();
    held.write_all(b"4242").unwrap();
    let started = Instant::now();
    let error = driver.reboot().unwrap_err();
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert!(started.elapsed() < Duration::from_secs(5));
    let text = error.to_string();
    assert!(
        matches!(error, DriverError::LockTimeout { .. }) && text.contains("process 4242"),
        "{text}"
    );
    assert_eq!(driver.read().unwrap().boots, 0, "nothing changed");
    // Once it runs again (here: lets go), the write goes through.
    drop(held);
    assert_eq!(driver.reboot().unwrap().boots, 1);
}

#[test]
fn a_file_of_other_boards_is_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    drop(node(&path, 2));
    let clock = VirtualClock::new();

    let more = SimGpu::with_driver(config(h200(), 4), clock.clone(), &path).unwrap_err();
    assert!(
        matches!(
            more,
            SimError::Driver(DriverError::BoardCount {
                found: 2,
                expected: 4,
                ..
            })
        ),
        "{more}"
    );
    assert!(more.to_string().contains("node.sim_gpus"), "{more}");

    let a100 = GpuProfile::load("a100").unwrap();
    let other = SimGpu::with_driver(config(a100, 2), clock.clone(), &path).unwrap_err();
    let text = other.to_string();
    assert!(
        matches!(other, SimError::Driver(DriverError::Profile { .. })),
        "{text}"
    );
    assert!(
        text.contains("'h200'") && text.contains("'a100'") && text.contains("its own driver file"),
        "{text}"
    );

    // The same id with other limits (an edited profile file).
    let mut edited = h200();
    edited.power_cap.default_w = 600.0;
    let limits = SimGpu::with_driver(config(edited, 2), clock, &path).unwrap_err();
    assert!(
        matches!(limits, SimError::Driver(DriverError::Limits { .. })),
        "{limits}"
    );
    // Nothing refused was changed.
    assert_eq!(SimDriver::at(&path).read().unwrap().generation, 0);
}

#[test]
fn a_corrupt_file_is_refused_with_the_fix_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    drop(node(&path, 1));
    let good = std::fs::read_to_string(&path).unwrap();
    let cases = [
        (
            "{\"format_version\": 1, \"boards\": [",
            "is corrupt",
            "delete it",
        ),
        (
            "{\"theme\": \"dark\"}",
            "not a tokwatt simulated-driver file",
            "delete it",
        ),
        (
            "root:x:0:0:root:/root:/bin/bash\n",
            "is corrupt",
            "delete it",
        ),
        (
            &good.replace("\"format_version\": 1", "\"format_version\": 7"),
            "format version 7",
            "delete it",
        ),
        (
            &good.replace("\"power_cap_w\": 700.0", "\"power_cap_w\": 9000.0"),
            "outside 200-700 W",
            "delete it",
        ),
        (
            &good.replace("\"boots\": 0", "\"boots\": 0, \"extra\": 1"),
            "unknown field",
            "delete it",
        ),
    ];
    for (text, says, fix) in cases {
        std::fs::write(&path, text).unwrap();
        let clock = VirtualClock::new();
        let error = SimGpu::with_driver(config(h200(), 1), clock, &path).unwrap_err();
        let message = error.to_string();
        assert!(message.contains(says), "{says}: {message}");
        assert!(message.contains(fix), "{says}: {message}");
        assert!(message.contains(&path.display().to_string()), "{message}");
        let error = SimDriver::at(&path).reboot().unwrap_err();
        assert!(error.to_string().contains(says), "{error}");
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            text,
            "kept as it was"
        );
    }
}

#[test]
fn a_file_spoilt_while_running_keeps_the_settings_last_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    let (sim, clock) = node(&path, 1);
    let (mut actuator, mut telemetry) = (sim.actuator(), sim.telemetry());
    actuator.set_power_cap(0, 400.0).unwrap();
    std::fs::write(&path, "not json").unwrap();
    clock.sleep_until(secs(2.0));
    assert_eq!(
        telemetry.read_window(0).unwrap().power_limit_enforced_w,
        400.0
    );
    assert_eq!(actuator.read(0).unwrap().power_cap_w, 400.0);
    // A change cannot be written: it fails, as a real driver's error would, and changes
    // nothing.
    let refused = actuator.set_power_cap(0, 300.0).unwrap_err();
    assert!(refused.to_string().contains("corrupt"), "{refused}");
    assert_eq!(actuator.read(0).unwrap().power_cap_w, 400.0);
    // Gone altogether: the same.
    std::fs::remove_file(&path).unwrap();
    assert_eq!(actuator.read(0).unwrap().power_cap_w, 400.0);
    assert!(actuator.set_power_cap(0, 300.0).is_err());
}

#[test]
fn caps_fitted_within_an_allowance_fall_in_proportion_to_their_room() {
    assert_eq!(
        fit_within(&[600.0, 700.0], &[200.0, 200.0], 1300.0),
        [600.0, 700.0]
    );
    let fit = fit_within(&[600.0, 700.0], &[200.0, 200.0], 1000.0);
    let total: f64 = fit.iter().sum();
    assert!(total <= 1000.0 && total > 999.99, "{total}");
    assert_eq!(
        fit_within(&[600.0, 700.0], &[200.0, 250.0], 300.0),
        [200.0, 250.0]
    );
}

/// The clock is the simulation's: the driver's reads add no time.
#[test]
fn a_simulation_with_a_driver_runs_as_one_without_while_nothing_changes() {
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    let (driven, driven_clock) = node(&path, 1);
    let clock = VirtualClock::new();
    let plain = SimGpu::new(config(h200(), 1), clock.clone()).unwrap();
    let (mut a, mut b) = (driven.telemetry(), plain.telemetry());
    driven.actuator().set_power_cap(0, 500.0).unwrap();
    plain.actuator().set_power_cap(0, 500.0).unwrap();
    for step in 1..=5 {
        driven_clock.sleep_until(secs(f64::from(step)));
        clock.sleep_until(secs(f64::from(step)));
        assert_eq!(a.read_window(0).unwrap(), b.read_window(0).unwrap());
    }
    assert_eq!(driven_clock.now(), clock.now());
}
