//! Behaviour of the simulated GPU through the three boundary traits, on a virtual clock.
#![allow(clippy::unwrap_used)] // tests may unwrap

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::clock::VirtualClock;

/// A scenario that keeps `batch` sequences decoding: requests far outnumber slots and never finish.
fn saturated(preset: &str, context: u32, batch: u32) -> Scenario {
    Scenario {
        description: "saturated".to_owned(),
        model_name: preset.to_owned(),
        model: ModelShape::preset(preset).unwrap(),
        context_tokens: context,
        output_tokens: 1_000_000,
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
    let clock = VirtualClock::new();
    let config = SimConfig {
        profile: GpuProfile::load(profile).unwrap(),
        scenario,
        gpus,
        seed,
    };
    let sim = SimGpu::new(config, clock.clone()).unwrap();
    (sim, clock)
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
        let (sim, clock) = sim_with("h200", saturated("llama-3-8b", 1024, batch), 1, 3);
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
    let (sim, clock) = sim_with("h200", saturated("llama-3-8b", 1024, 64), 1, 5);
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
    let (sim, clock) = sim_with("h200", scenario, 1, 9);
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
    // Monotone ramp.
    assert!(readings.windows(2).all(|w| w[1].1 >= w[0].1 - 1.0));
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
    assert!(
        after.energy_j / after.interval_s <= 400.0,
        "{} W",
        after.energy_j / after.interval_s
    );
    assert!(after.power_avg_reading_w <= 400.0);
    let truth = sim.truth(0).unwrap();
    assert!(truth.power_w <= 400.0 && truth.power_w > 380.0, "{truth:?}");
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
fn a_clock_lock_binds_and_is_reported() {
    let (sim, clock) = sim_with("h200", saturated("llama-3-8b", 1024, 16), 1, 17);
    let (mut telemetry, mut actuator) = (sim.telemetry(), sim.actuator());
    actuator.set_sm_clock_lock(0, Some((300, 1500))).unwrap();
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
            err.contains("outside the device's range 200-700 W"),
            "{err}"
        );
    }
    let err = actuator
        .set_sm_clock_lock(0, Some((1500, 1400)))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("minimum 1500 MHz is above the maximum 1400 MHz"),
        "{err}"
    );
    let err = actuator
        .set_sm_clock_lock(0, Some((2000, 2100)))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no supported clock lies within 2000-2100 MHz (supported: 345-1980 MHz)"),
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
    let (sim, clock) = sim_with("h200", scenario, 1, 29);
    let (mut telemetry, mut workload) = (sim.telemetry(), sim.workload());
    clock.sleep_until(secs(5.0));
    let t = telemetry.read_window(0).unwrap();
    assert!((t.energy_j / t.interval_s - 122.0).abs() < 0.5);
    assert_eq!(t.sm_clock_mhz, 390);
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
    // Default scenario: saturating (0-600 s), light (600-1200 s), medium (from 1200 s).
    let (sim, clock) = sim_with("h200", Scenario::built_in().unwrap(), 1, 31);
    let mut workload = sim.workload();
    let mut rate_over = |from: f64, to: f64| {
        clock.sleep_until(secs(from));
        workload.read_window(0).unwrap();
        clock.sleep_until(secs(to));
        workload.read_window(0).unwrap().tokens as f64 / (to - from)
    };
    let saturating = rate_over(300.0, 600.0);
    let light = rate_over(900.0, 1200.0);
    let medium = rate_over(1500.0, 1800.0);
    // 5 and 30 requests/s of 256 tokens: 1280 and 7680 tokens/s; saturated: ~17 000.
    assert!((light / 1280.0 - 1.0).abs() < 0.1, "light {light}");
    assert!((medium / 7680.0 - 1.0).abs() < 0.1, "medium {medium}");
    assert!(saturating > 15_000.0, "saturating {saturating}");
    let truth = sim.truth(0).unwrap();
    assert!(
        truth.requests_turned_away > 0,
        "the saturating phase overflows the queue"
    );
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
        // The counter lags the truth by at most one update, and carries no gain error here.
        assert!((energy[gpu as usize] - truth.energy_j).abs() < 80.0);
        assert!(truth.tokens > 1e7);
    }
}
