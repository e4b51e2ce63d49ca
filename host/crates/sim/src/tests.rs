//! Behaviour of the simulated GPU through the three boundary traits, on a virtual clock.
#![allow(clippy::unwrap_used)] // tests may unwrap

use std::sync::Arc;
use std::time::Duration;

use super::*;
use tokwatt_core::clock::VirtualClock;

/// A scenario that keeps `batch` sequences decoding: requests far outnumber slots and never finish.
fn saturated(preset: &str, context: u32, batch: u32) -> Scenario {
    Scenario {
        description: "saturated".to_owned(),
        model_name: preset.to_owned(),
        model: ModelShape::preset(preset).unwrap(),
        context_tokens: context,
        output_tokens: 1_000_000,
        requests: None,
        max_batched_tokens: scenario::DEFAULT_MAX_BATCHED_TOKENS,
        batch_size_max: 512,
        initial_batch_size: batch,
        queue_max: 4096,
        phases: vec![Phase {
            start_s: 0.0,
            arrival_rps: 20_000.0,
            outside_power_limit_w: None,
        }],
    }
}

fn sim_with(
    profile: &str,
    scenario: Scenario,
    gpus: u32,
    seed: u64,
) -> (SimGpu, Arc<VirtualClock>) {
    sim_on(GpuProfile::load(profile).unwrap(), scenario, gpus, seed)
}

fn sim_on(
    profile: GpuProfile,
    scenario: Scenario,
    gpus: u32,
    seed: u64,
) -> (SimGpu, Arc<VirtualClock>) {
    let clock = VirtualClock::new();
    let config = SimConfig {
        profile,
        scenario,
        gpus,
        seed,
        noise_seed: None,
    };
    let sim = SimGpu::new(config, clock.clone()).unwrap();
    (sim, clock)
}

/// A profile whose every board reads through the calibration board's sensor (gain 1).
fn calibration_board(profile: &str) -> GpuProfile {
    let mut profile = GpuProfile::load(profile).unwrap();
    profile.nvml.gain = Some(profile::SensorGain::Every(1.0));
    profile
}

/// The calibration board without sensor noise: for checking NVML's timing alone.
fn noiseless(profile: &str) -> GpuProfile {
    let mut profile = calibration_board(profile);
    profile.nvml.instantaneous_noise_w = 0.0;
    profile.nvml.instantaneous_noise_fraction = 0.0;
    profile
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

#[test]
fn devices_are_labelled_simulated_with_the_profile_constraints() {
    let (sim, _) = sim_with("h200", Scenario::built_in().unwrap(), 2, 1);
    let devices = sim.telemetry().devices();
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[1].uuid, "SIM-h200-1");
    assert!(
        devices
            .iter()
            .all(|d| d.simulated && d.name == "NVIDIA H200")
    );
    assert_eq!(
        (devices[0].power_cap_min_w, devices[0].power_cap_max_w),
        (200.0, 700.0)
    );
    assert_eq!(devices[0].sm_clock_max_mhz(), 1980);
    assert_eq!(sim.actuator().devices(), devices);
    assert_eq!(
        sim.calibration_note(),
        "simulated NVIDIA H200, calibrated to measured H200 data (driver 580.159.04, 2026-11-29)"
    );
    let (h100, _) = sim_with("h100", Scenario::built_in().unwrap(), 1, 1);
    assert!(
        h100.calibration_note().contains("NOT measured"),
        "{}",
        h100.calibration_note()
    );
}

#[test]
fn an_invalid_in_memory_configuration_is_refused() {
    let clock = VirtualClock::new();
    let config = |gpus: u32, batch: u32| SimConfig {
        profile: GpuProfile::load("h200").unwrap(),
        scenario: Scenario {
            initial_batch_size: batch,
            ..saturated("llama-3-8b", 1024, 1)
        },
        gpus,
        seed: 0,
        noise_seed: None,
    };
    let err = SimGpu::new(config(0, 1), clock.clone())
        .unwrap_err()
        .to_string();
    assert_eq!(err, "the simulation needs 1 to 1024 GPUs (got 0)");
    let err = SimGpu::new(config(1, 600), clock.clone())
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("scenario 'saturated' (llama-3-8b): initial_batch_size"),
        "{err}"
    );
    let mut bad_profile = config(1, 1);
    bad_profile.profile.power.core_w = f64::NAN;
    let err = SimGpu::new(bad_profile, clock).unwrap_err().to_string();
    assert!(
        err.contains("GPU profile 'h200': power.core_w must be a number above 0"),
        "{err}"
    );
}

#[test]
fn a_saturated_run_through_the_traits_matches_the_measured_rows() {
    // The calibration rows through the whole path: energy from the (quantised) counter over a
    // 6 s window after 4 s of warm-up, as the reference script measured.
    let measured = [
        (1, 204.04, 503.69),
        (64, 8864.93, 692.18),
        (512, 17011.64, 703.48),
    ];
    for (batch, tokens_per_s, watts) in measured {
        let (sim, clock) = sim_on(
            calibration_board("h200"),
            saturated("llama-3-8b", 1024, batch),
            1,
            3,
        );
        let (mut telemetry, mut workload) = (sim.telemetry(), sim.workload());
        clock.sleep_until(secs(4.0));
        telemetry.read_window(0).unwrap();
        workload.read_window(0).unwrap();
        clock.sleep_until(secs(10.0));
        let t = telemetry.read_window(0).unwrap();
        let w = workload.read_window(0).unwrap();
        assert_eq!(t.interval_s, 6.0);
        assert_eq!(w.active_sequences, batch);
        let sim_tokens_per_s = w.tokens as f64 / t.interval_s;
        let sim_watts = t.energy_j / t.interval_s;
        assert!(
            (sim_tokens_per_s / tokens_per_s - 1.0).abs() < 0.05,
            "batch {batch}: {sim_tokens_per_s} tokens/s"
        );
        assert!(
            (sim_watts / watts - 1.0).abs() < 0.05,
            "batch {batch}: {sim_watts} W"
        );
        assert!(w.tpot_p50_ms > 0.0 && w.tpot_p99_ms >= w.tpot_p50_ms);
    }
}

#[test]
fn the_energy_counter_moves_in_100_ms_quanta() {
    let (sim, clock) = sim_on(noiseless("h200"), saturated("llama-3-8b", 1024, 64), 1, 5);
    let mut telemetry = sim.telemetry();
    clock.sleep_until(secs(2.0));
    let start = telemetry.read_window(0).unwrap().energy_counter_j;
    let mut counters = Vec::new();
    for ms in (2_010..=2_400).step_by(10) {
        clock.sleep_until(Duration::from_millis(ms));
        counters.push((ms, telemetry.read_window(0).unwrap().energy_counter_j));
    }
    for (ms, counter) in &counters {
        let update_due = ms % 100 == 0;
        let previous = counters
            .iter()
            .rev()
            .find(|(m, _)| m < ms)
            .map_or(start, |&(_, c)| c);
        if update_due {
            // ~690 W for 100 ms.
            assert!(
                (counter - previous - 69.0).abs() < 3.0,
                "at {ms} ms: +{} J",
                counter - previous
            );
        } else {
            assert_eq!(
                *counter, previous,
                "at {ms} ms the counter moved between updates"
            );
        }
    }
    // The windows' energy is the counter difference: windows between updates read 0 J.
    clock.sleep_until(secs(2.45));
    assert_eq!(telemetry.read_window(0).unwrap().energy_j, 0.0);
    assert_eq!(telemetry.read_window(0).unwrap().samples, 0);
}

#[test]
fn the_average_reading_ramps_over_one_second() {
    // Idle, then a saturating load from t = 2 s: the 1 s boxcar ramps linearly, like field 185.
    let mut scenario = saturated("llama-3-8b", 1024, 512);
    scenario.phases = vec![
        Phase {
            start_s: 0.0,
            arrival_rps: 0.0,
            outside_power_limit_w: None,
        },
        Phase {
            start_s: 2.0,
            arrival_rps: 20_000.0,
            outside_power_limit_w: None,
        },
    ];
    let (sim, clock) = sim_on(noiseless("h200"), scenario, 1, 9);
    let mut telemetry = sim.telemetry();
    let mut readings = Vec::new();
    for ms in (1_900..=3_600).step_by(100) {
        clock.sleep_until(Duration::from_millis(ms));
        readings.push((ms, telemetry.read_window(0).unwrap().power_avg_reading_w));
    }
    let at = |ms: u64| {
        readings
            .iter()
            .find(|(m, _)| *m == ms)
            .map(|&(_, w)| w)
            .unwrap()
    };
    let idle = at(2_000);
    let loaded = at(3_600);
    assert!((idle - 122.0).abs() < 1.0, "idle reading {idle}");
    assert!(loaded > 650.0, "loaded reading {loaded}");
    // Half-way after ~0.5 s, still short of the end after 0.8 s, at the end after ~1.1 s.
    let half = at(2_500);
    assert!(
        (half - (idle + loaded) / 2.0).abs() < 0.15 * (loaded - idle),
        "at 2.5 s: {half}"
    );
    assert!(at(2_800) < loaded - 50.0, "at 2.8 s: {}", at(2_800));
    assert!((at(3_200) - loaded).abs() < 15.0, "at 3.2 s: {}", at(3_200));
    // A monotone ramp over the boxcar's second; after it, the first 100 ms (drawn at the idle
    // clock before the limiter pulled it down, like the measured 949 W overshoot) leaves the
    // average, which settles a little lower.
    let ramp: Vec<f64> = readings
        .iter()
        .filter(|(ms, _)| *ms <= 3_000)
        .map(|&(_, w)| w)
        .collect();
    assert!(ramp.windows(2).all(|w| w[1] >= w[0] - 1.0), "{readings:?}");
    assert!(
        readings.iter().all(|&(_, w)| w <= loaded + 40.0),
        "{readings:?}"
    );
}

#[test]
fn a_low_cap_lowers_the_clock_and_holds_the_power_under_it() {
    let (sim, clock) = sim_with("h200", saturated("llama-3-8b", 1024, 256), 1, 11);
    let (mut telemetry, mut actuator) = (sim.telemetry(), sim.actuator());
    clock.sleep_until(secs(3.0));
    let before = telemetry.read_window(0).unwrap();
    assert_eq!(actuator.set_power_cap(0, 400.0).unwrap(), 400.0);
    clock.sleep_until(secs(5.0));
    telemetry.read_window(0).unwrap();
    clock.sleep_until(secs(8.0));
    let after = telemetry.read_window(0).unwrap();
    assert!(
        after.sm_clock_mhz + 300 < before.sm_clock_mhz,
        "{} vs {}",
        after.sm_clock_mhz,
        before.sm_clock_mhz
    );
    assert!(after.clock_events.sw_power_cap);
    assert_eq!(after.power_limit_enforced_w, 400.0);
    // The limiter holds the board's own (gain-scaled) reading under the cap; what is left above
    // it is the sensor noise: ~28 W per 100 ms update at 400 W, 5 W over 3 s, 9 W over 1 s.
    let truth = sim.truth(0).unwrap();
    assert!(truth.sensor_gain != 1.0, "{truth:?}");
    assert!(
        after.energy_j / after.interval_s <= 400.0 + 3.0 * 28.0 / 30f64.sqrt(),
        "{} W",
        after.energy_j / after.interval_s
    );
    assert!(after.power_avg_reading_w <= 400.0 + 3.0 * 28.0 / 10f64.sqrt());
    let sensed = truth.power_w * truth.sensor_gain;
    assert!(sensed <= 400.0 && sensed > 380.0, "{truth:?}");
    let settings = actuator.read(0).unwrap();
    assert_eq!(
        (settings.power_cap_w, settings.power_cap_enforced_w),
        (400.0, 400.0)
    );
}

#[test]
fn the_clock_settles_to_a_new_target_over_about_200_ms() {
    let (sim, clock) = sim_with("h200", saturated("llama-3-8b", 1024, 256), 1, 13);
    let mut actuator = sim.actuator();
    clock.sleep_until(secs(3.0));
    let old = sim.truth(0).unwrap().sm_mhz;
    actuator.set_power_cap(0, 350.0).unwrap();
    let target = f64::from(sim.truth(0).unwrap().target_sm_mhz);
    clock.sleep_until(secs(3.05));
    let early = sim.truth(0).unwrap();
    let new_target = f64::from(early.target_sm_mhz);
    assert!(
        new_target < old - 300.0,
        "target {new_target} from {old} (before: {target})"
    );
    assert!(
        early.sm_mhz < old && early.sm_mhz > new_target + 100.0,
        "after 50 ms: {}",
        early.sm_mhz
    );
    // Drawing above the cap while the clock is still high, like the measured overshoot.
    assert!(early.power_w > 350.0, "{early:?}");
    clock.sleep_until(secs(3.2));
    let settled = sim.truth(0).unwrap().sm_mhz;
    assert!(
        (settled - new_target).abs() < 0.06 * (old - new_target),
        "after 200 ms: {settled}"
    );
    // By 400 ms the reported (supported-clock) reading is the target.
    clock.sleep_until(secs(3.4));
    let mut telemetry = sim.telemetry();
    telemetry.read_window(0).unwrap();
    clock.sleep_until(secs(3.5));
    assert_eq!(
        f64::from(telemetry.read_window(0).unwrap().sm_clock_mhz),
        new_target
    );
}

#[test]
fn with_a_throttle_time_the_clock_falls_within_a_substep_and_rises_over_the_settle_time() {
    // The h100 profile: throttle_s 0.025 (down), settle_s 0.2 (up).
    let (sim, clock) = sim_with("h100", saturated("llama-3-8b", 1024, 256), 1, 13);
    let mut actuator = sim.actuator();
    clock.sleep_until(secs(3.0));
    let old = sim.truth(0).unwrap().sm_mhz;
    actuator.set_power_cap(0, 350.0).unwrap();
    clock.sleep_until(secs(3.05));
    let cut = sim.truth(0).unwrap();
    let low = f64::from(cut.target_sm_mhz);
    assert!(low < old - 300.0, "target {low} from {old}");
    assert!(
        (cut.sm_mhz - low).abs() < 0.01 * (old - low),
        "after 50 ms: {cut:?}"
    );
    // Back up: the same 50 ms leaves it well short of its target.
    actuator.set_power_cap(0, 700.0).unwrap();
    clock.sleep_until(secs(3.1));
    let raised = sim.truth(0).unwrap();
    let high = f64::from(raised.target_sm_mhz);
    assert!(high > low + 300.0, "target {high}");
    assert!(
        raised.sm_mhz < high - 0.2 * (high - low),
        "after 50 ms up: {raised:?}"
    );
}

#[test]
fn a_clock_lock_binds_and_is_reported() {
    let (sim, clock) = sim_with("h200", saturated("llama-3-8b", 1024, 16), 1, 17);
    let (mut telemetry, mut actuator) = (sim.telemetry(), sim.actuator());
    // As NVML does, a range reaching outside the supported clocks is refused; one within
    // them locks to the supported clocks it holds.
    assert!(actuator.set_sm_clock_lock(0, Some((300, 1500))).is_err());
    actuator.set_sm_clock_lock(0, Some((345, 1500))).unwrap();
    assert_eq!(
        actuator.read(0).unwrap().sm_clock_lock_mhz,
        Some((345, 1500))
    );
    clock.sleep_until(secs(2.0));
    telemetry.read_window(0).unwrap();
    clock.sleep_until(secs(3.0));
    let window = telemetry.read_window(0).unwrap();
    assert_eq!(window.sm_clock_mhz, 1500);
    assert!(window.clock_events.clock_setting && !window.clock_events.sw_power_cap);
    actuator.set_sm_clock_lock(0, None).unwrap();
    clock.sleep_until(secs(4.0));
    telemetry.read_window(0).unwrap();
    clock.sleep_until(secs(5.0));
    assert_eq!(telemetry.read_window(0).unwrap().sm_clock_mhz, 1980);
}

#[test]
fn the_actuator_rejects_settings_the_device_would() {
    let (sim, _) = sim_with("h200", Scenario::built_in().unwrap(), 1, 1);
    let mut actuator = sim.actuator();
    for bad in [150.0, 701.0, f64::NAN, -1.0] {
        let err = actuator.set_power_cap(0, bad).unwrap_err().to_string();
        assert!(
            err.contains("power-limit range 200-700 W") || err.contains("is not a power"),
            "{err}"
        );
    }
    let err = actuator
        .set_sm_clock_lock(0, Some((1500, 1400)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("1500-1400 MHz is reversed"), "{err}");
    let err = actuator
        .set_sm_clock_lock(0, Some((2000, 2100)))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("2000-2100 MHz is outside the supported 345-1980 MHz"),
        "{err}"
    );
    assert!(matches!(
        actuator.set_power_cap(3, 500.0),
        Err(ActuatorError::NoSuchGpu { index: 3, count: 1 })
    ));
    actuator.set_mem_clock_lock(0, Some((2201, 2201))).unwrap();
    assert_eq!(
        actuator.read(0).unwrap().mem_clock_lock_mhz,
        Some((2201, 2201))
    );
}

#[test]
fn a_lower_memory_clock_slows_decode() {
    let (sim, clock) = sim_with("h200", saturated("llama-3-8b", 1024, 64), 1, 19);
    let (mut telemetry, mut workload, mut actuator) =
        (sim.telemetry(), sim.workload(), sim.actuator());
    clock.sleep_until(secs(2.0));
    workload.read_window(0).unwrap();
    clock.sleep_until(secs(4.0));
    let fast = workload.read_window(0).unwrap().tokens;
    actuator.set_mem_clock_lock(0, Some((2201, 2201))).unwrap();
    clock.sleep_until(secs(6.0));
    let slow = workload.read_window(0).unwrap().tokens;
    assert!((slow as f64) < 0.85 * fast as f64, "{slow} vs {fast}");
    assert_eq!(telemetry.read_window(0).unwrap().mem_clock_mhz, 2201);
}

#[test]
fn batch_size_outside_1_to_max_is_rejected_and_a_cut_pauses_sequences() {
    let (sim, clock) = sim_with("h200", saturated("llama-3-8b", 1024, 512), 1, 23);
    let mut workload = sim.workload();
    assert_eq!(workload.batch_size_max(0), 512);
    for bad in [0, 513] {
        assert!(matches!(
            workload.set_batch_size(0, bad),
            Err(WorkloadError::BatchOutOfRange { requested, max: 512 }) if requested == bad
        ));
    }
    clock.sleep_until(secs(2.0));
    assert_eq!(workload.read_window(0).unwrap().active_sequences, 512);
    workload.set_batch_size(0, 64).unwrap();
    assert_eq!(workload.batch_size(0), 64);
    clock.sleep_until(secs(2.1));
    let window = workload.read_window(0).unwrap();
    assert_eq!((window.active_sequences, window.batch_size), (64, 64));
    // The 448 paused sequences wait at the head of the queue.
    assert!(window.queue_depth >= 448, "{}", window.queue_depth);
}

#[test]
fn an_idle_gpu_reports_idle_power_low_clock_and_gpu_idle() {
    let mut scenario = Scenario::built_in().unwrap();
    scenario.phases = vec![Phase {
        start_s: 0.0,
        arrival_rps: 0.0,
        outside_power_limit_w: None,
    }];
    let (sim, clock) = sim_on(calibration_board("h200"), scenario, 1, 29);
    let (mut telemetry, mut workload) = (sim.telemetry(), sim.workload());
    clock.sleep_until(secs(5.0));
    let t = telemetry.read_window(0).unwrap();
    assert!((t.energy_j / t.interval_s - 122.0).abs() < 0.5);
    // A serving process's context keeps the clocks up between requests (h200.toml).
    assert_eq!(t.sm_clock_mhz, 1980);
    assert!(t.clock_events.gpu_idle && !t.clock_events.sw_power_cap);
    assert_eq!(t.gpu_util_pct, 0.0);
    let w = workload.read_window(0).unwrap();
    assert_eq!((w.tokens, w.tpot_p50_ms), (0, 0.0));
}

/// Readings of a few windows of a default-scenario run, for comparing runs.
fn fingerprint(seed: u64) -> Vec<(TelemetryWindow, WorkloadWindow)> {
    let (sim, clock) = sim_with("h200", Scenario::built_in().unwrap(), 2, seed);
    let (mut telemetry, mut workload) = (sim.telemetry(), sim.workload());
    (1..=20)
        .map(|tick| {
            clock.sleep_until(secs(f64::from(tick)));
            (
                telemetry.read_window(1).unwrap(),
                workload.read_window(1).unwrap(),
            )
        })
        .collect()
}

#[test]
fn runs_are_deterministic_given_the_seed() {
    assert_eq!(fingerprint(42), fingerprint(42));
    assert_ne!(fingerprint(42), fingerprint(43));
}

#[test]
fn arrivals_do_not_depend_on_what_the_policy_does() {
    // Same seed, different batch sizes: the same requests arrive (counted as completed + waiting
    // + active + turned away), so A/B comparisons face identical demand.
    let arrived = |batch: u32| {
        let mut scenario = Scenario::built_in().unwrap();
        scenario.initial_batch_size = batch;
        scenario.output_tokens = 32;
        scenario.phases = vec![Phase {
            start_s: 0.0,
            arrival_rps: 40.0,
            outside_power_limit_w: None,
        }];
        let (sim, clock) = sim_with("h200", scenario, 1, 77);
        clock.sleep_until(secs(30.0));
        let truth = sim.truth(0).unwrap();
        truth.requests_completed
            + truth.waiting
            + u64::from(truth.active_sequences)
            + truth.requests_turned_away
    };
    let reference = arrived(512);
    assert!((1_000..1_400).contains(&reference), "{reference}");
    assert_eq!(arrived(8), reference);
    assert_eq!(arrived(64), reference);
}

#[test]
fn demand_phases_change_throughput() {
    // Default scenario: heavy (0-600 s), light (600-1200 s), medium (from 1200 s).
    let (sim, clock) = sim_with("h200", Scenario::built_in().unwrap(), 1, 31);
    let mut workload = sim.workload();
    let mut rate_over = |from: f64, to: f64| {
        clock.sleep_until(secs(from));
        workload.read_window(0).unwrap();
        clock.sleep_until(secs(to));
        workload.read_window(0).unwrap().tokens as f64 / (to - from)
    };
    let heavy = rate_over(300.0, 600.0);
    let light = rate_over(900.0, 1200.0);
    let medium = rate_over(1500.0, 1800.0);
    // 45, 5 and 30 requests/s of 256 tokens: 11 520, 1280 and 7680 tokens/s.
    assert!((heavy / 11_520.0 - 1.0).abs() < 0.1, "heavy {heavy}");
    assert!((light / 1280.0 - 1.0).abs() < 0.1, "light {light}");
    assert!((medium / 7680.0 - 1.0).abs() < 0.1, "medium {medium}");
    // At 700 W and batch 512 every phase is servable: nothing is turned away.
    assert_eq!(sim.truth(0).unwrap().requests_turned_away, 0);
}

#[test]
fn a_thirty_minute_eight_gpu_run_completes_through_the_traits() {
    let (sim, clock) = sim_with("h200", Scenario::built_in().unwrap(), 8, 2026);
    let (mut telemetry, mut actuator, mut workload) =
        (sim.telemetry(), sim.actuator(), sim.workload());
    let mut tokens = [0u64; 8];
    let mut energy = [0.0f64; 8];
    for tick in 1..=1800u32 {
        clock.sleep_until(secs(f64::from(tick)));
        for gpu in 0..8u32 {
            let t = telemetry.read_window(gpu).unwrap();
            let w = workload.read_window(gpu).unwrap();
            tokens[gpu as usize] += w.tokens;
            energy[gpu as usize] += t.energy_j;
            assert_eq!(t.interval_s, 1.0);
            assert_eq!(t.samples, 10);
            if tick % 60 == 0 {
                // A policy at work: vary the cap between 450 and 700 W.
                let cap = 450.0 + f64::from((tick / 60 + gpu) % 6) * 50.0;
                actuator.set_power_cap(gpu, cap).unwrap();
            }
        }
    }
    for gpu in 0..8 {
        let truth = sim.truth(gpu).unwrap();
        assert_eq!(truth.time_s, 1800.0);
        assert_eq!(tokens[gpu as usize], truth.tokens.floor() as u64);
        // The counter reads the truth through the board's gain, lags it by at most one update
        // (~70 J) and carries the sensor noise (~5 J per update: ~0.7 kJ over 18 000 updates).
        let expected = truth.energy_j * truth.sensor_gain;
        assert!(
            (energy[gpu as usize] - expected).abs() < 80.0 + 3_000.0,
            "gpu {gpu}: {} J read, {expected} J through the gain",
            energy[gpu as usize]
        );
        assert!(truth.tokens > 1e7);
    }
}

/// Boards caught up together on two threads (a catch-up of a second or more) simulate
/// exactly what boards caught up one at a time, on the caller's thread, do: every board's
/// truth, bit for bit, with settings changed on the way.
#[test]
fn boards_caught_up_on_two_threads_match_boards_caught_up_one_by_one() {
    let run = |step_s: f64| {
        let (sim, clock) = sim_with("h200", Scenario::built_in().unwrap(), 5, 7);
        let (mut telemetry, mut actuator, mut workload) =
            (sim.telemetry(), sim.actuator(), sim.workload());
        let steps = (120.0 / step_s).round() as u32;
        for step in 1..=steps {
            let t = f64::from(step) * step_s;
            clock.sleep_until(secs(t));
            for gpu in 0..5u32 {
                telemetry.read_window(gpu).unwrap();
                workload.read_window(gpu).unwrap();
            }
            if (t.round() - t).abs() < 1e-9 && (t as u32).is_multiple_of(10) {
                for gpu in 0..5u32 {
                    let batch = 32 + ((t as u32 / 10 + gpu) % 5) * 40;
                    workload.set_batch_size(gpu, batch).unwrap();
                    actuator
                        .set_power_cap(gpu, 500.0 + f64::from(gpu) * 40.0)
                        .unwrap();
                }
            }
        }
        (0..5)
            .map(|gpu| sim.truth(gpu).unwrap())
            .collect::<Vec<_>>()
    };
    // Reads every 2 s catch up 80 substeps (two threads); every 10 ms, one (this thread).
    let parallel = run(2.0);
    let one_by_one = run(0.01);
    assert_eq!(parallel, one_by_one);
    assert!(parallel.iter().all(|truth| truth.tokens > 1e5));
}

// ---- Demand accounting ----

/// `output_tokens`-token requests arriving at `rps`, served at batch `batch`, with room for
/// `queue_max` waiting.
fn serving(rps: f64, batch: u32, queue_max: u32) -> Scenario {
    let mut scenario = Scenario::built_in().unwrap();
    scenario.initial_batch_size = batch;
    scenario.queue_max = queue_max;
    scenario.phases = vec![Phase {
        start_s: 0.0,
        arrival_rps: rps,
        outside_power_limit_w: None,
    }];
    scenario
}

/// Demand summed over 1 s windows from 1 s to `until_s` (the first window read at 1 s).
fn demand_over(
    sim: &SimGpu,
    clock: &VirtualClock,
    until_s: u32,
) -> tokwatt_core::types::DemandWindow {
    let mut workload = sim.workload();
    let mut total = tokwatt_core::types::DemandWindow::default();
    for tick in 1..=until_s {
        clock.sleep_until(secs(f64::from(tick)));
        let d = workload.read_window(0).unwrap().demand.unwrap();
        total.requests_arrived += d.requests_arrived;
        total.requests_completed += d.requests_completed;
        total.requests_turned_away += d.requests_turned_away;
        total.tokens_demanded += d.tokens_demanded;
        // The worst window's p99.
        total.queue_wait_p99_ms = match (total.queue_wait_p99_ms, d.queue_wait_p99_ms) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
    total
}

#[test]
fn arrivals_are_the_admitted_plus_the_turned_away() {
    // 100 requests/s of 256 tokens: above what an H200 serves (~66), so the queue overflows.
    let mut scenario = Scenario::built_in().unwrap();
    scenario.phases[0].arrival_rps = 100.0;
    let rps = scenario.phases[0].arrival_rps;
    let (sim, clock) = sim_with("h200", scenario, 1, 5);
    let demand = demand_over(&sim, &clock, 120);
    let truth = sim.truth(0).unwrap();
    assert_eq!(demand.requests_arrived, truth.requests_arrived);
    assert_eq!(demand.requests_turned_away, truth.requests_turned_away);
    assert_eq!(demand.requests_completed, truth.requests_completed);
    assert!(demand.requests_turned_away > 0, "{demand:?}");
    // Admitted = completed + decoding + waiting.
    let admitted = truth.requests_completed + u64::from(truth.active_sequences) + truth.waiting;
    assert_eq!(
        demand.requests_arrived,
        admitted + demand.requests_turned_away
    );
    assert_eq!(demand.tokens_demanded, demand.requests_arrived * 256);
    assert!(
        (demand.requests_arrived as f64 / (rps * 120.0) - 1.0).abs() < 0.02,
        "{demand:?}"
    );
}

#[test]
fn a_batch_1_policy_under_heavy_load_turns_demand_away() {
    // 5 requests/s of 256 tokens: 1280 tokens/s asked; batch 1 serves ~200, batch 64 ~8800.
    let turned_away = |batch: u32| {
        let (sim, clock) = sim_with("h200", serving(5.0, batch, 64), 1, 8);
        let demand = demand_over(&sim, &clock, 60);
        (demand, sim.truth(0).unwrap())
    };
    let (small, truth) = turned_away(1);
    assert_eq!(small.requests_turned_away, truth.requests_turned_away);
    // Of ~300 arrivals, batch 1 serves under 50 and the queue holds 64.
    assert!(small.requests_turned_away > 150, "{small:?}");
    assert!(small.requests_completed < 50, "{small:?}");
    // Waits reach tens of seconds: 64 requests ahead, ~1.3 s each.
    assert!(small.queue_wait_p99_ms.unwrap() > 10_000.0, "{small:?}");
    let (large, _) = turned_away(64);
    assert_eq!(large.requests_turned_away, 0, "{large:?}");
    assert_eq!(large.requests_arrived, small.requests_arrived);
    // No queue: a request waits only for the step in progress to end (a few ms).
    assert!(large.queue_wait_p99_ms.unwrap() < 20.0, "{large:?}");
}

#[test]
fn the_queue_wait_grows_when_the_batch_is_cut() {
    // 20 requests/s of 256 tokens (5120 tokens/s): batch 64 keeps up, batch 8 (~1500 tokens/s)
    // cannot.
    let (sim, clock) = sim_with("h200", serving(20.0, 64, 100_000), 1, 12);
    let mut workload = sim.workload();
    clock.sleep_until(secs(20.0));
    workload.read_window(0).unwrap();
    clock.sleep_until(secs(30.0));
    let before = workload.read_window(0).unwrap().demand.unwrap();
    workload.set_batch_size(0, 8).unwrap();
    clock.sleep_until(secs(40.0));
    workload.read_window(0).unwrap();
    clock.sleep_until(secs(50.0));
    let after = workload.read_window(0).unwrap().demand.unwrap();
    let (before_ms, after_ms) = (
        before.queue_wait_p99_ms.unwrap(),
        after.queue_wait_p99_ms.unwrap(),
    );
    assert!(before_ms < 100.0, "{before:?}");
    assert!(
        after_ms > 5_000.0,
        "before {before_ms} ms, after {after_ms} ms"
    );
    // Served requests fall to what batch 8 gets through: far fewer than arrive.
    assert!(
        after.requests_completed * 2 < after.requests_arrived,
        "{after:?}"
    );
}

#[test]
fn a_window_with_no_admission_has_no_queue_wait() {
    let (sim, clock) = sim_with("h200", serving(0.0, 8, 64), 1, 1);
    let mut workload = sim.workload();
    clock.sleep_until(secs(2.0));
    let demand = workload.read_window(0).unwrap().demand.unwrap();
    assert_eq!(demand, tokwatt_core::types::DemandWindow::default());
    assert_eq!(demand.queue_wait_p99_ms, None);
}

// ---- What the power sensor reports ----

/// Energy per 1 s window of a saturated batch-64 run from 2 s to 62 s.
fn window_watts(profile: GpuProfile, seed: u64) -> Vec<f64> {
    let (sim, clock) = sim_on(profile, saturated("llama-3-8b", 1024, 64), 1, seed);
    let mut telemetry = sim.telemetry();
    clock.sleep_until(secs(2.0));
    telemetry.read_window(0).unwrap();
    (3..=62)
        .map(|s| {
            clock.sleep_until(secs(f64::from(s)));
            let t = telemetry.read_window(0).unwrap();
            t.energy_j / t.interval_s
        })
        .collect()
}

fn mean_and_sd(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

#[test]
fn doubling_the_sensor_noise_doubles_the_spread_of_window_energy() {
    let normal = calibration_board("h200");
    let mut doubled = normal.clone();
    doubled.nvml.instantaneous_noise_w *= 2.0;
    doubled.nvml.instantaneous_noise_fraction *= 2.0;
    let (mean, sd) = mean_and_sd(&window_watts(normal, 4));
    let (mean2, sd2) = mean_and_sd(&window_watts(doubled, 4));
    let (_, quiet) = mean_and_sd(&window_watts(noiseless("h200"), 4));
    // ~692 W, 9 % of the 570 W above idle per 100 ms update: ~16 W over a 1 s window.
    assert!((mean / 692.0 - 1.0).abs() < 0.03 && (mean2 / mean - 1.0).abs() < 0.02);
    assert!((10.0..25.0).contains(&sd), "sd {sd} W");
    assert!(
        (1.6..2.4).contains(&(sd2 / sd)),
        "sd {sd} W, doubled {sd2} W"
    );
    assert!(quiet < 0.5, "without noise: sd {quiet} W");
}

#[test]
fn the_sensed_power_never_sits_above_the_enforced_cap_beyond_noise() {
    // Eight boards, each with its own drawn gain, capped at 400 W under saturating load.
    let (sim, clock) = sim_with("h200", saturated("llama-3-8b", 1024, 256), 8, 21);
    let (mut telemetry, mut actuator) = (sim.telemetry(), sim.actuator());
    for gpu in 0..8 {
        actuator.set_power_cap(gpu, 400.0).unwrap();
    }
    clock.sleep_until(secs(3.0));
    for gpu in 0..8 {
        telemetry.read_window(gpu).unwrap();
    }
    // Noise at 400 W: 1.5 + 0.09 · 278 = 26.5 W per update, 8.4 W over a 1 s window.
    let window_sd = 26.5 / 10f64.sqrt();
    let mut watts = vec![Vec::new(); 8];
    for s in 4..=33 {
        clock.sleep_until(secs(f64::from(s)));
        for gpu in 0..8 {
            let t = telemetry.read_window(gpu).unwrap();
            let w = t.energy_j / t.interval_s;
            assert!(w <= 400.0 + 4.0 * window_sd, "gpu {gpu} at {s} s: {w} W");
            assert!(t.power_avg_reading_w <= 400.0 + 4.0 * window_sd);
            watts[gpu as usize].push(w);
        }
    }
    let mut gains = Vec::new();
    for gpu in 0..8 {
        let (mean, _) = mean_and_sd(&watts[gpu as usize]);
        // Over 30 s the noise averages out (1.5 W): the reading sits just under the cap
        // whatever the gain, while the true power differs by the gain.
        assert!((385.0..=403.0).contains(&mean), "gpu {gpu}: mean {mean} W");
        let truth = sim.truth(gpu).unwrap();
        assert!(truth.power_w * truth.sensor_gain <= 400.0, "{truth:?}");
        gains.push(truth.sensor_gain);
    }
    // The gains differ by board and stay within the profile's ±5 %.
    assert!(gains.iter().all(|g| (0.95..=1.05).contains(g)), "{gains:?}");
    let spread = gains.iter().copied().fold(f64::MIN, f64::max)
        - gains.iter().copied().fold(f64::MAX, f64::min);
    assert!(spread > 0.02, "{gains:?}");
}

#[test]
fn a_fixed_gain_is_honoured_per_board() {
    let mut profile = GpuProfile::load("h200").unwrap();
    profile.nvml.gain = Some(profile::SensorGain::PerBoard(vec![1.0, 1.04]));
    let mut idle = saturated("llama-3-8b", 1024, 1);
    idle.phases[0].arrival_rps = 0.0;
    let (sim, clock) = sim_on(profile, idle.clone(), 3, 6);
    let mut telemetry = sim.telemetry();
    clock.sleep_until(secs(10.0));
    let watts: Vec<f64> = (0..3)
        .map(|gpu| {
            let t = telemetry.read_window(gpu).unwrap();
            t.energy_j / t.interval_s
        })
        .collect();
    let gains: Vec<f64> = (0..3)
        .map(|gpu| sim.truth(gpu).unwrap().sensor_gain)
        .collect();
    assert_eq!(&gains[..2], &[1.0, 1.04]);
    // Board 2 is past the list: it draws its gain.
    assert!(
        gains[2] != 1.0 && (0.95..=1.05).contains(&gains[2]),
        "{gains:?}"
    );
    assert!((watts[0] - 122.0).abs() < 0.5, "{watts:?}");
    assert!((watts[1] - 122.0 * 1.04).abs() < 0.5, "{watts:?}");

    // One gain for every board, from a profile file.
    let text = include_str!("../../../profiles/h200.toml").replace(
        "gain_error_max = 0.05",
        "gain_error_max = 0.05\ngain = 0.97",
    );
    let profile = GpuProfile::from_toml_str(&text, "fixed.toml").unwrap();
    let (sim, _) = sim_on(profile, idle, 2, 6);
    for gpu in 0..2 {
        assert_eq!(sim.truth(gpu).unwrap().sensor_gain, 0.97);
    }
}

#[test]
fn windows_read_between_counter_updates_report_consistent_power() {
    // A wall-clock run reads at arbitrary times: the window's interval is the span between the
    // counter updates its energy lies between, so energy / interval is the power, never a
    // window's worth of energy over a shorter (or longer) interval.
    let (sim, clock) = sim_on(noiseless("h200"), saturated("llama-3-8b", 1024, 64), 1, 2);
    let mut telemetry = sim.telemetry();
    clock.sleep_until(secs(3.0));
    telemetry.read_window(0).unwrap();
    let mut at_ms = 3_000;
    for step_ms in [130, 70, 30, 260, 110, 90, 45, 155, 1_030, 170].repeat(3) {
        at_ms += step_ms;
        clock.sleep_until(Duration::from_millis(at_ms));
        let t = telemetry.read_window(0).unwrap();
        if t.interval_s == 0.0 {
            assert_eq!(t.energy_j, 0.0, "at {at_ms} ms");
            continue;
        }
        let watts = t.energy_j / t.interval_s;
        assert!(
            (watts / 692.0 - 1.0).abs() < 0.01,
            "at {at_ms} ms: {watts} W over {} s",
            t.interval_s
        );
    }
}

// ---- Device memory ----

#[test]
fn the_batch_is_limited_to_what_fits_the_device_memory() {
    // The built-in scenario asks for 512 sequences of llama-3-8b at 1024 positions (69 GB of KV
    // cache beside 16 GB of weights): the H200's 141 GB holds them, the H100's 80 GB does not.
    let (h200, _) = sim_with("h200", Scenario::built_in().unwrap(), 1, 1);
    assert_eq!(h200.workload().batch_size_max(0), 512);
    let (h100, _) = sim_with("h100", Scenario::built_in().unwrap(), 1, 1);
    let mut workload = h100.workload();
    let fits = tokwatt_core::model::max_batch_that_fits(
        &ModelShape::preset("llama-3-8b").unwrap(),
        1024,
        80_000_000_000,
    )
    .unwrap();
    assert!(fits < 512);
    assert_eq!(workload.batch_size_max(0), fits);
    assert_eq!(
        workload.batch_size(0),
        fits,
        "the initial batch is limited too"
    );
    assert_eq!(h100.scenario().batch_size_max, fits);
    assert!(matches!(
        workload.set_batch_size(0, fits + 1),
        Err(WorkloadError::BatchOutOfRange { max, .. }) if max == fits
    ));
}

#[test]
fn a_model_whose_weights_do_not_fit_is_refused_naming_both_sizes() {
    let mut scenario = Scenario::built_in().unwrap();
    scenario.model = ModelShape::preset("llama-3.1-70b").unwrap();
    scenario.model_name = "llama-3.1-70b".to_owned();
    let config = SimConfig {
        profile: GpuProfile::load("a100").unwrap(),
        scenario,
        gpus: 1,
        seed: 0,
        noise_seed: None,
    };
    let err = SimGpu::new(config, VirtualClock::new())
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("GPU profile 'a100': model 'llama-3.1-70b' does not fit in 80.0 GB")
            && err.contains("weights need 141.")
            && err.contains("72.0 GB is usable"),
        "{err}"
    );
}

#[test]
fn a_user_profile_for_a_smaller_card_runs_within_its_limits() {
    let profile = GpuProfile::from_toml_str(
        include_str!("../../../profiles/fixtures/l40s-class.toml"),
        "l40s-class.toml",
    )
    .unwrap();
    let (sim, clock) = sim_on(profile, Scenario::built_in().unwrap(), 1, 3);
    let (mut telemetry, mut workload) = (sim.telemetry(), sim.workload());
    // 48 GB: ~200 sequences of 134 MB beside 16 GB of weights.
    let max = workload.batch_size_max(0);
    assert!((150..250).contains(&max), "{max}");
    clock.sleep_until(secs(5.0));
    telemetry.read_window(0).unwrap();
    workload.read_window(0).unwrap();
    clock.sleep_until(secs(15.0));
    let t = telemetry.read_window(0).unwrap();
    let w = workload.read_window(0).unwrap();
    let watts = t.energy_j / t.interval_s;
    let gain = sim.truth(0).unwrap().sensor_gain;
    assert!((60.0..=350.0 + 10.0).contains(&watts), "{watts} W");
    assert!(sim.truth(0).unwrap().power_w * gain <= 350.0);
    // 16 GB of weights at 864 GB/s: at most ~54 steps a second.
    assert!(
        w.steps as f64 / 10.0 <= 864e9 / 16.06e9,
        "{} steps",
        w.steps
    );
    assert_eq!(w.active_sequences, max);
}

#[test]
fn idle_power_follows_the_model_at_the_idle_clock_and_under_a_lock() {
    let mut scenario = Scenario::built_in().unwrap();
    scenario.phases[0].arrival_rps = 0.0;
    scenario.phases.truncate(1);
    let (sim, clock) = sim_on(noiseless("h200"), scenario, 1, 4);
    let (mut telemetry, mut actuator) = (sim.telemetry(), sim.actuator());
    clock.sleep_until(secs(2.0));
    let t = telemetry.read_window(0).unwrap();
    assert!((t.energy_j / t.interval_s - 122.0).abs() < 0.01);
    actuator.set_sm_clock_lock(0, Some((345, 990))).unwrap();
    clock.sleep_until(secs(3.0));
    telemetry.read_window(0).unwrap();
    clock.sleep_until(secs(5.0));
    let locked = telemetry.read_window(0).unwrap();
    // p0 + clock · x·v² at x = 0.5: 100 + 22 · 0.5 · 0.685² = 105.2 W.
    let watts = locked.energy_j / locked.interval_s;
    assert!((watts - 105.2).abs() < 0.3, "{watts} W");
    assert_eq!(locked.sm_clock_mhz, 990);
}

/// A chat-like scenario with prompts, for the fork tests.
fn chat() -> Scenario {
    Scenario::from_toml_str(
        r#"
description = "chat"
model = "llama-3-8b"
prompt_tokens = { distribution = "lognormal", median = 900, sigma = 0.8, min = 16, max = 8192 }
output_tokens = { distribution = "lognormal", median = 200, sigma = 0.7, min = 8, max = 2048 }
max_batched_tokens = 2048
batch_size_max = 256

[[phases]]
start_s = 0
arrival_rps = 6
"#,
        "chat",
    )
    .unwrap()
}

#[test]
fn a_fork_goes_on_as_the_original_would_and_never_touches_it() {
    for scenario in [saturated("llama-3-8b", 2048, 64), chat()] {
        let (original, clock) = sim_with("h100", scenario.clone(), 1, 7);
        let (untouched, untouched_clock) = sim_with("h100", scenario, 1, 7);
        clock.sleep_until(secs(30.0));
        let (copy, copy_clock) = original.fork().unwrap();
        assert_eq!(copy_clock.now(), secs(30.0));
        // The copy runs at a low cap; the original, left alone, must not notice.
        copy.actuator().set_power_cap(0, 200.0).unwrap();
        copy_clock.sleep_until(secs(60.0));
        clock.sleep_until(secs(60.0));
        untouched_clock.sleep_until(secs(60.0));
        assert_eq!(original.truth(0), untouched.truth(0));
        let (left_alone, lowered) = (original.truth(0).unwrap(), copy.truth(0).unwrap());
        assert!(lowered.energy_j < left_alone.energy_j);
        // A second copy with the original's settings goes on exactly as it does.
        let (twin, twin_clock) = original.fork().unwrap();
        twin_clock.sleep_until(secs(90.0));
        clock.sleep_until(secs(90.0));
        assert_eq!(original.truth(0), twin.truth(0));
    }
}
