//! The simulated driver: settings that outlive a simulation, changes from other processes,
//! reboots, and the files it refuses.
#![allow(clippy::unwrap_used)] // tests may unwrap

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::{Phase, Scenario, SimConfig, SimError, SimGpu, scenario};
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
        requests: None,
        max_batched_tokens: scenario::DEFAULT_MAX_BATCHED_TOKENS,
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
        actuator.set_mem_clock_lock(1, Some((2201, 3201))).unwrap();
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
    let steps = 100u32;
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Two writers a board, of different settings, each a read-modify-write in which a lost
    // update would leave a gap; no lock anywhere.
    let mut writers = Vec::new();
    for board in 0..4u32 {
        let driver = SimDriver::at(&path);
        writers.push(std::thread::spawn(move || {
            for step in 1..=steps {
                driver
                    .update_board(board, |b| {
                        assert_eq!(b.batch_size.unwrap_or(0), step - 1);
                        b.batch_size = Some(step);
                    })
                    .unwrap();
            }
        }));
        let driver = SimDriver::at(&path);
        writers.push(std::thread::spawn(move || {
            for step in 1..=steps {
                driver
                    .update_board(board, |b| {
                        assert_eq!(b.power_cap_w, 700.0 - f64::from(step - 1));
                        b.power_cap_w = 700.0 - f64::from(step);
                    })
                    .unwrap();
            }
        }));
    }
    // A reader all along: every read whole, every setting only ever moving on.
    let reader = {
        let (driver, done) = (SimDriver::at(&path), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut reads = 0u32;
            let mut last = driver.read().unwrap();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let now = driver.read().unwrap();
                for (was, is) in last.boards.iter().zip(&now.boards) {
                    assert!(is.batch_size.unwrap_or(0) >= was.batch_size.unwrap_or(0));
                    assert!(is.power_cap_w <= was.power_cap_w);
                }
                assert!(now.generation >= last.generation);
                last = now;
                reads += 1;
            }
            reads
        })
    };
    for writer in writers {
        writer.join().unwrap();
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(reader.join().unwrap() > 0);
    let state = SimDriver::at(&path).read().unwrap();
    for board in &state.boards {
        assert_eq!(board.batch_size, Some(steps));
        assert_eq!(board.power_cap_w, 700.0 - f64::from(steps));
    }
    assert_eq!(state.generation, u64::from(8 * steps));
}

#[test]
fn processes_creating_the_file_at_once_agree_on_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    let start = Arc::new(std::sync::Barrier::new(8));
    let openers: Vec<_> = (0..8u32)
        .map(|board| {
            let (path, start) = (path.clone(), Arc::clone(&start));
            std::thread::spawn(move || {
                start.wait();
                let (driver, snapshot) = SimDriver::open_for(&path, &h200(), 8).unwrap();
                // Each one's first change lands in the one file.
                driver
                    .update_board(board, |b| b.power_cap_w = 600.0 - f64::from(board))
                    .unwrap();
                snapshot.state
            })
        })
        .collect();
    for opener in openers {
        assert_eq!(opener.join().unwrap().boards.len(), 8);
    }
    let state = SimDriver::at(&path).read().unwrap();
    for (board, settings) in state.boards.iter().enumerate() {
        assert_eq!(settings.power_cap_w, 600.0 - board as f64);
    }
    let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .collect();
    assert_eq!(names, ["driver.json"], "no temporary file left behind");
}

/// The environment variable that makes [`a_writing_child`] write.
const WRITER_ENV: &str = "TOKWATT_SIM_DRIVER_WRITER";

/// Run as a child process by [`a_writer_stopped_anywhere_holds_no_other_writer_up`]: board
/// 0's cap and batch rewritten in a tight loop until the file goes.
#[test]
#[ignore = "a child process of another test"]
fn a_writing_child() {
    let Some(path) = std::env::var_os(WRITER_ENV) else {
        return;
    };
    let driver = SimDriver::at(PathBuf::from(path));
    for step in 0u32.. {
        let cap = if step % 2 == 0 { 400.0 } else { 600.0 };
        let written = driver
            .update_board(0, |b| b.power_cap_w = cap)
            .and_then(|_| driver.update_board(0, |b| b.batch_size = Some(1 + step % 100)));
        if written.is_err() {
            return;
        }
    }
}

/// A child process, killed when the test ends however it ends.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Child {
    fn signal(&self, name: &str) {
        let status = std::process::Command::new("kill")
            .args([format!("-{name}"), self.0.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{name}");
    }

    /// Whether the kernel has it stopped (`T` in `/proc/PID/stat`).
    fn stopped(&self) -> bool {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.0.id())).unwrap();
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('T'))
    }
}

/// The fault harness's case: an agent SIGSTOPped while it writes (anywhere in a write:
/// reading the file, between the read and the write, in its sync) must not hold up the
/// fence, and its writes after SIGCONT must not undo the fence's.
#[test]
fn a_writer_stopped_anywhere_holds_no_other_writer_up() {
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    let (driver, _) = SimDriver::open_for(&path, &h200(), 2).unwrap();
    let child = Child(
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["driver::tests::a_writing_child", "--exact", "--ignored"])
            .env(WRITER_ENV, &path)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let wait_for = |what: &str, ready: &dyn Fn() -> bool| {
        let started = Instant::now();
        while !ready() {
            assert!(started.elapsed() < Duration::from_secs(30), "{what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    let generation = || driver.read().unwrap().generation;
    let mut slowest = Duration::ZERO;
    for cycle in 0..20u32 {
        let before = generation();
        wait_for("the child writes", &|| generation() >= before + 10);
        child.signal("STOP");
        wait_for("the child stops", &|| child.stopped());
        let stopped_at = generation();
        // Another process's changes land at once, to another board and to another setting
        // of the board the stopped one writes.
        let cap = 300.0 + f64::from(cycle);
        let started = Instant::now();
        driver.update_board(1, |b| b.power_cap_w = cap).unwrap();
        driver
            .update_board(0, |b| b.sm_clock_lock_mhz = Some((900, 1000 + cycle)))
            .unwrap();
        let state = driver.read().unwrap();
        slowest = slowest.max(started.elapsed());
        assert_eq!(state.boards[1].power_cap_w, cap);
        assert_eq!(state.generation, stopped_at + 2, "the child is stopped");
        child.signal("CONT");
        // The child writes on, and loses none of them.
        wait_for("the child writes again", &|| {
            generation() >= stopped_at + 20
        });
        let state = driver.read().unwrap();
        assert_eq!(state.boards[1].power_cap_w, cap);
        assert_eq!(state.boards[0].sm_clock_lock_mhz, Some((900, 1000 + cycle)));
    }
    eprintln!("writes beside a stopped writer: the slowest two and a read took {slowest:?}");
    assert!(slowest < Duration::from_secs(1), "{slowest:?}");
}

/// A write in progress, as a reader may see it: the first half of board 0's new cap line
/// over the old one.
fn tear(path: &Path, watts: f64) -> (Vec<u8>, Vec<u8>) {
    let state = SimDriver::at(path).read().unwrap();
    let mut board = state.boards[0].clone();
    board.power_cap_w = watts;
    let line = setting_line(&board, 0, 0, state.boards.len(), 99).unwrap();
    let span = line_span(1);
    let file = File::options().write(true).open(path).unwrap();
    file.write_at(&line.as_bytes()[..64], span.start as u64)
        .unwrap();
    (line.into_bytes(), std::fs::read(path).unwrap())
}

#[test]
fn a_torn_line_is_read_again_and_refused_if_it_stays_torn() {
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    drop(node(&path, 2));
    let driver = SimDriver::at(&path);
    driver.update_board(1, |b| b.power_cap_w = 500.0).unwrap();

    // The write completes 30 ms later: the reader reads again until it has.
    let (line, _) = tear(&path, 400.0);
    let finisher = {
        let path = path.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            let file = File::options().write(true).open(&path).unwrap();
            file.write_at(&line[64..], (line_span(1).start + 64) as u64)
                .unwrap();
        })
    };
    let started = Instant::now();
    let state = driver.read().unwrap();
    assert!(started.elapsed() >= Duration::from_millis(25));
    assert_eq!(state.boards[0].power_cap_w, 400.0);
    assert_eq!(state.boards[1].power_cap_w, 500.0);
    finisher.join().unwrap();

    // Torn for good (a writer killed mid-write, an edit): refused, saying so, and kept.
    let (_, torn) = tear(&path, 250.0);
    let started = Instant::now();
    let error = driver.read().unwrap_err();
    assert!(started.elapsed() >= READ_PATIENCE);
    let text = error.to_string();
    assert!(
        matches!(error, DriverError::Corrupt { .. })
            && text.contains("board 0's power_cap_w line does not match its check")
            && text.contains("no write in progress")
            && text.contains("delete it"),
        "{text}"
    );
    let refused = driver
        .update_board(1, |b| b.power_cap_w = 200.0)
        .unwrap_err();
    assert!(refused.to_string().contains("does not match"), "{refused}");
    assert_eq!(std::fs::read(&path).unwrap(), torn, "kept as it was");
}

/// What the fault harness reads with Python's json (`state["boards"][i]["power_cap_w"]`),
/// and checks line by line with zlib.crc32.
#[test]
fn the_file_is_json_of_fixed_width_checked_lines() {
    assert_eq!(crc32(b"123456789"), 0xCBF4_3926, "zlib's CRC-32");
    let dir = tempfile::tempdir().unwrap();
    let path = driver_path(&dir);
    let (sim, _clock) = node(&path, 3);
    sim.actuator().set_power_cap(2, 450.5).unwrap();
    sim.actuator()
        .set_sm_clock_lock(1, Some((1000, 1500)))
        .unwrap();
    let raw = std::fs::read(&path).unwrap();
    let json: serde_json::Value = serde_json::from_slice(&raw).unwrap();
    assert_eq!(json["format_version"], DRIVER_FORMAT_VERSION);
    assert_eq!(json["boards"][2]["power_cap_w"], 450.5);
    assert_eq!(json["boards"][0]["power_cap_w"], 700.0);
    assert!(json["boards"][1]["sm_clock_lock_mhz"].is_array());
    assert_eq!(
        json["boards"][2]["#power_cap_w"]
            .as_str()
            .unwrap()
            .split_once('/')
            .unwrap()
            .0,
        "1"
    );
    assert_eq!(raw.len(), HEADER_LEN + 3 * BOARD_LEN + TRAILER.len());
    let text = std::str::from_utf8(&raw).unwrap();
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    assert_eq!(lines.len(), 1 + 3 * SETTINGS.len() + 1);
    assert_eq!(lines[0].len(), HEADER_LEN);
    for line in &lines[1..lines.len() - 1] {
        assert_eq!(line.len(), SETTING_LEN, "{line}");
    }
    assert_eq!(*lines.last().unwrap(), "]}\n");
    for line in &lines[..lines.len() - 1] {
        let slash = line.rfind('/').unwrap();
        let check = format!("{:08x}", crc32(&line.as_bytes()[..=slash]));
        assert_eq!(&line[slash + 1..slash + 9], check, "{line}");
    }
    // One setter, one line: the cap's line alone differs.
    sim.actuator().set_power_cap(0, 650.0).unwrap();
    let after = std::fs::read(&path).unwrap();
    let differ: Vec<usize> = (0..raw.len()).filter(|&i| raw[i] != after[i]).collect();
    let line = line_span(1);
    assert!(
        differ.iter().all(|i| line.contains(i)),
        "{differ:?} outside {line:?}"
    );
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

/// A file of format version 1 (one JSON document, replaced whole under a lock).
const VERSION_1: &str = r#"{
  "format_version": 1,
  "profile": "h200",
  "board_name": "NVIDIA H200",
  "limits": {
    "power_cap_min_w": 200.0,
    "power_cap_default_w": 700.0,
    "power_cap_max_w": 700.0
  },
  "generation": 0,
  "boots": 0,
  "boot_reserve_w": null,
  "boards": [
    {
      "power_cap_w": 700.0,
      "sm_clock_lock_mhz": null,
      "mem_clock_lock_mhz": null,
      "batch_size": null
    }
  ]
}
"#;

/// `text` with `from` replaced by `to` in every line, each such line given a check that
/// matches: edited by something that knows the format.
fn resealed(text: &str, from: &str, to: &str) -> String {
    text.split_inclusive('\n')
        .map(|line| {
            if !line.contains(from) {
                return line.to_owned();
            }
            let edited = line.replace(from, to);
            let slash = edited.rfind('/').unwrap();
            seal(
                edited[..=slash].to_owned(),
                edited[slash + 10..].trim_end(),
                line.len(),
            )
            .unwrap()
        })
        .collect()
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
            &good.replace("\"format_version\": 2", "\"format_version\": 7"),
            "format version 7",
            "delete it",
        ),
        (VERSION_1, "format version 1", "delete it"),
        (
            &resealed(&good, "\"power_cap_w\": 700.0", "\"power_cap_w\": 9000.0"),
            "outside 200-700 W",
            "delete it",
        ),
        (
            &resealed(&good, "\"boots\": 0, ", "\"boots\": 0, \"extra\": 1, "),
            "unknown field",
            "delete it",
        ),
        // Edited by hand, the line's check left as it was.
        (
            &good.replace("\"power_cap_w\": 700.0", "\"power_cap_w\": 300.0"),
            "board 0's power_cap_w line does not match its check",
            "delete it",
        ),
        (
            &format!("{good}\n"),
            "where a file of 1 boards is",
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
