#![allow(clippy::unwrap_used)] // tests may unwrap
use super::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn energy(mj: u64) -> Sample {
    Sample {
        energy_mj: Some(mj),
        ..Sample::default()
    }
}

#[test]
fn energy_is_continuous_across_windows() {
    let mut acc = Accumulator::default();
    // Counter starts at an arbitrary value (energy since driver load).
    acc.record(ms(0), &energy(5_000_000), 0);
    acc.record(ms(100), &energy(5_000_070), 0);
    acc.record(ms(200), &energy(5_000_140), 0);
    let first = acc.take_window();
    acc.record(ms(300), &energy(5_000_300), 0);
    acc.record(ms(400), &energy(5_000_500), 0);
    let second = acc.take_window();

    // The first window covers 0..200 ms, the second 200..400 ms: the boundary reading
    // at 200 ms ends one and starts the other.
    assert_eq!(first.window.energy_j, 0.140);
    assert_eq!(first.window.interval_s, 0.2);
    assert_eq!(second.window.energy_j, 0.360);
    assert_eq!(second.window.interval_s, 0.2);
    assert_eq!(second.window.energy_counter_j, 0.5);
    assert_eq!(first.window.samples, 3);
    assert_eq!(second.window.samples, 2);
}

#[test]
fn a_failed_energy_read_moves_energy_to_the_next_reading() {
    let mut acc = Accumulator::default();
    acc.record(ms(0), &energy(1_000), 0);
    acc.record(ms(100), &energy(1_100), 0);
    // The closing reading of this window fails: the window ends at 100 ms.
    acc.record(ms(200), &Sample::default(), 1);
    let first = acc.take_window();
    acc.record(ms(300), &energy(1_400), 0);
    let second = acc.take_window();

    assert_eq!(first.window.energy_j, 0.1);
    assert_eq!(first.window.interval_s, 0.1);
    assert_eq!(first.sample_errors, 1);
    // 100..300 ms: nothing lost, nothing counted twice.
    assert_eq!(second.window.energy_j, 0.3);
    assert_eq!(second.window.interval_s, 0.2);
    assert_eq!(second.window.energy_counter_j, 0.4);
    assert_eq!(second.sample_errors, 0);
}

#[test]
fn a_counter_that_goes_backwards_is_counted_not_subtracted() {
    let mut acc = Accumulator::default();
    acc.record(ms(0), &energy(9_000), 0);
    acc.record(ms(100), &energy(9_500), 0);
    acc.record(ms(200), &energy(200), 0); // driver reloaded
    acc.record(ms(300), &energy(700), 0);
    let window = acc.take_window();
    assert_eq!(window.window.energy_j, 1.0);
    assert_eq!(window.energy_counter_resets, 1);
}

#[test]
fn window_statistics_median_peak_union_mean_last() {
    let mut acc = Accumulator::default();
    let readings = [
        (1980, 300_000, 40, 10, ClockEvents::default()),
        (
            1500,
            949_000,
            41,
            90,
            ClockEvents {
                sw_power_cap: true,
                ..ClockEvents::default()
            },
        ),
        (
            1440,
            690_000,
            44,
            100,
            ClockEvents {
                hw_slowdown: true,
                ..ClockEvents::default()
            },
        ),
        (1590, 700_000, 45, 100, ClockEvents::default()),
    ];
    for (i, (sm, instant, temp, util, events)) in readings.into_iter().enumerate() {
        let sample = Sample {
            energy_mj: Some(i as u64 * 70),
            power_avg_mw: Some(600_000 + i as u32),
            power_instant_mw: Some(instant),
            sm_clock_mhz: Some(sm),
            mem_clock_mhz: Some(3201),
            temperature_c: Some(temp),
            gpu_util_pct: Some(util),
            clock_events: Some(events),
            power_limit_enforced_mw: Some(700_000),
            power_limit_requested_mw: Some(700_000),
            mem_power_avg_mw: Some(130_000),
        };
        acc.record(ms(i as u64 * 100), &sample, 0);
    }
    let w = acc.take_window();
    // Sorted clocks 1440, 1500, 1590, 1980: the lower middle one.
    assert_eq!(w.window.sm_clock_mhz, 1500);
    assert_eq!(w.window.mem_clock_mhz, 3201);
    assert_eq!(w.window.power_peak_w, 949.0);
    assert_eq!(w.window.power_avg_reading_w, 600.003);
    assert_eq!(w.window.temperature_c, 45.0);
    assert_eq!(w.window.gpu_util_pct, 75.0);
    assert_eq!(
        w.window.clock_events,
        ClockEvents {
            sw_power_cap: true,
            hw_slowdown: true,
            ..ClockEvents::default()
        }
    );
    assert_eq!(w.window.power_limit_enforced_w, 700.0);
    assert_eq!(w.power_limit_requested_w, Some(700.0));
    assert_eq!(w.mem_power_avg_w, Some(130.0));
    assert_eq!(w.window.energy_j, 0.21);
}

#[test]
fn events_and_peaks_do_not_leak_into_the_next_window() {
    let mut acc = Accumulator::default();
    acc.record(
        ms(0),
        &Sample {
            power_instant_mw: Some(900_000),
            clock_events: Some(ClockEvents {
                sw_thermal: true,
                ..ClockEvents::default()
            }),
            temperature_c: Some(80),
            ..Sample::default()
        },
        0,
    );
    acc.take_window();
    acc.record(
        ms(100),
        &Sample {
            power_instant_mw: Some(200_000),
            clock_events: Some(ClockEvents::default()),
            ..Sample::default()
        },
        0,
    );
    let w = acc.take_window();
    assert_eq!(w.window.power_peak_w, 200.0);
    assert_eq!(w.window.clock_events, ClockEvents::default());
    // Temperature was not read this window: the last known value stands.
    assert_eq!(w.window.temperature_c, 80.0);
}

#[test]
fn an_empty_window_reports_no_samples_and_no_energy() {
    let mut acc = Accumulator::default();
    acc.record(ms(0), &energy(100), 0);
    acc.record(ms(100), &energy(300), 0);
    acc.take_window();
    let empty = acc.take_window();
    assert_eq!(empty.window.samples, 0);
    assert_eq!(empty.window.energy_j, 0.0);
    assert_eq!(empty.window.interval_s, 0.0);
    assert_eq!(empty.window.energy_counter_j, 0.2);
}

#[test]
fn peak_falls_back_to_the_averaged_reading() {
    let mut acc = Accumulator::default();
    for (i, avg) in [500_000, 650_000, 620_000].into_iter().enumerate() {
        let sample = Sample {
            power_avg_mw: Some(avg),
            ..Sample::default()
        };
        acc.record(ms(i as u64 * 100), &sample, 0);
    }
    assert_eq!(acc.take_window().window.power_peak_w, 650.0);
}

#[test]
fn median_of_odd_even_and_empty() {
    assert_eq!(median(vec![]), None);
    assert_eq!(median(vec![7]), Some(7));
    assert_eq!(median(vec![3, 1, 2]), Some(2));
    assert_eq!(median(vec![4, 1, 3, 2]), Some(2));
}

/// A GPU whose counter rises by 1 J per sample and that says when it is dropped.
struct CountingSource {
    samples: Arc<AtomicU64>,
    dropped: Arc<AtomicBool>,
}

impl SampleSource for CountingSource {
    fn gpu_count(&self) -> usize {
        2
    }
    fn sample(&mut self, gpu: usize, _due: Due, errors: &mut Vec<SampleError>) -> Sample {
        let n = self.samples.fetch_add(1, Ordering::SeqCst);
        if gpu == 1 {
            errors.push(SampleError {
                what: "temperature",
                reason: "not today".into(),
            });
        }
        energy(n * 1000)
    }
}

impl Drop for CountingSource {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::SeqCst);
    }
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    // Waits for progress; a generous bound turns a hang into a failure.
    for _ in 0..10_000 {
        if done() {
            return;
        }
        std::thread::sleep(ms(1));
    }
    panic!("gave up waiting for {what}");
}

#[test]
fn sampler_thread_fills_windows_and_stops_when_dropped() {
    let samples = Arc::new(AtomicU64::new(0));
    let dropped = Arc::new(AtomicBool::new(false));
    let source = CountingSource {
        samples: Arc::clone(&samples),
        dropped: Arc::clone(&dropped),
    };
    let sampler = Sampler::start(source, SamplerConfig::everything_every(ms(1))).unwrap();
    assert_eq!(sampler.gpu_count(), 2);
    assert!(sampler.take_window(2).is_none());

    let mut total_j = 0.0;
    let mut errors = 0;
    let mut windows_with_samples = 0;
    while windows_with_samples < 3 {
        wait_for("a sample", || samples.load(Ordering::SeqCst) > 0);
        let w = sampler.take_window(0).unwrap();
        if w.window.samples > 0 {
            windows_with_samples += 1;
        }
        total_j += w.window.energy_j;
        errors += sampler.take_window(1).unwrap().sample_errors;
        assert!((total_j - w.window.energy_counter_j).abs() < 1e-9);
    }
    assert!(errors > 0, "GPU 1's failed reads were not counted");

    drop(sampler);
    // Drop joined the thread, so the source has gone and sampling has stopped.
    assert!(dropped.load(Ordering::SeqCst));
    let after = samples.load(Ordering::SeqCst);
    std::thread::sleep(ms(5));
    assert_eq!(samples.load(Ordering::SeqCst), after);
}

/// A source whose second read blocks until the test releases it.
struct StallingSource {
    reads: u32,
    entered: mpsc::Sender<()>,
    release: mpsc::Receiver<()>,
}

impl SampleSource for StallingSource {
    fn gpu_count(&self) -> usize {
        1
    }
    fn sample(&mut self, _gpu: usize, _due: Due, _errors: &mut Vec<SampleError>) -> Sample {
        self.reads += 1;
        if self.reads == 2 {
            let _ = self.entered.send(());
            let _ = self.release.recv();
        }
        energy(u64::from(self.reads) * 10)
    }
}

#[test]
fn taking_a_window_never_waits_for_a_slow_read() {
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel();
    let source = StallingSource {
        reads: 0,
        entered: entered_tx,
        release: release_rx,
    };
    let sampler = Sampler::start(source, SamplerConfig::everything_every(ms(1))).unwrap();
    entered_rx.recv().unwrap();
    // The sampler is stuck inside a read; the window must still come back.
    let w = sampler.take_window(0).unwrap();
    assert_eq!(w.window.samples, 1);
    release_tx.send(()).unwrap();
    drop(sampler);
}

/// Counts the reads of each group, per GPU, as the NVML source would make them.
#[derive(Default)]
struct GroupCounts {
    fast: AtomicU64,
    tick_gauges: AtomicU64,
    slow_gauges: AtomicU64,
}

struct GroupCountingSource {
    counts: Arc<[GroupCounts; 2]>,
}

impl SampleSource for GroupCountingSource {
    fn gpu_count(&self) -> usize {
        2
    }
    fn sample(&mut self, gpu: usize, due: Due, _errors: &mut Vec<SampleError>) -> Sample {
        let counts = &self.counts[gpu];
        let n = counts.fast.fetch_add(1, Ordering::SeqCst);
        let mut sample = energy(n * 1000);
        if due.tick_gauges {
            counts.tick_gauges.fetch_add(1, Ordering::SeqCst);
            sample.sm_clock_mhz = Some(1980);
            sample.clock_events = Some(ClockEvents::default());
        }
        if due.slow_gauges {
            counts.slow_gauges.fetch_add(1, Ordering::SeqCst);
            sample.temperature_c = Some(40);
        }
        sample
    }
}

#[test]
fn each_group_is_read_at_its_own_rate() {
    let counts: Arc<[GroupCounts; 2]> = Arc::default();
    let config = SamplerConfig {
        period: ms(1),
        tick_gauges_every: 2,
        slow_gauges_every: 5,
        power_fields: true,
    };
    let sampler = Sampler::start(
        GroupCountingSource {
            counts: Arc::clone(&counts),
        },
        config,
    )
    .unwrap();
    wait_for("23 rounds", || counts[1].fast.load(Ordering::SeqCst) >= 23);
    drop(sampler);
    for gpu in counts.iter() {
        let rounds = gpu.fast.load(Ordering::SeqCst);
        // Rounds 0, 2, 4, ... and 0, 5, 10, ...: the first round reads everything.
        assert_eq!(gpu.tick_gauges.load(Ordering::SeqCst), rounds.div_ceil(2));
        assert_eq!(gpu.slow_gauges.load(Ordering::SeqCst), rounds.div_ceil(5));
    }
    // Both GPUs are read in every round.
    let rounds = counts[0].fast.load(Ordering::SeqCst);
    assert_eq!(counts[1].fast.load(Ordering::SeqCst), rounds);
    assert!(rounds >= 23);
}

#[test]
fn the_schedule_reads_everything_first_then_each_group_every_n() {
    let config = SamplerConfig {
        period: ms(500),
        tick_gauges_every: 2,
        slow_gauges_every: 10,
        power_fields: true,
    };
    let due: Vec<Due> = (0..21).map(|round| config.due(round)).collect();
    assert_eq!(
        due[0],
        Due {
            tick_gauges: true,
            slow_gauges: true
        }
    );
    let rounds_with = |pick: fn(&Due) -> bool| {
        due.iter()
            .enumerate()
            .filter(|(_, d)| pick(d))
            .map(|(round, _)| round)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        rounds_with(|d| d.tick_gauges),
        (0..21).step_by(2).collect::<Vec<_>>()
    );
    assert_eq!(rounds_with(|d| d.slow_gauges), vec![0, 10, 20]);
    // The default: 2 fast samples per 1 s tick, so 2 tick-gauge and 0.2 slow-gauge
    // reads per second against 20 of each at the old 100 ms.
    let default = SamplerConfig::default();
    let per_10_s: Vec<Due> = (0..20).map(|round| default.due(round)).collect();
    assert_eq!(per_10_s.iter().filter(|d| d.tick_gauges).count(), 10);
    assert_eq!(per_10_s.iter().filter(|d| d.slow_gauges).count(), 2);
}

#[test]
fn a_window_between_clock_event_readings_reports_the_last_one() {
    let mut acc = Accumulator::default();
    let capped = ClockEvents {
        sw_power_cap: true,
        ..ClockEvents::default()
    };
    acc.record(
        ms(0),
        &Sample {
            energy_mj: Some(0),
            clock_events: Some(capped),
            sm_clock_mhz: Some(1500),
            ..Sample::default()
        },
        0,
    );
    assert_eq!(acc.take_window().window.clock_events, capped);
    // Only fast readings in this window: the tick gauges' last values stand.
    acc.record(ms(500), &energy(300), 0);
    let w = acc.take_window();
    assert_eq!(w.window.clock_events, capped);
    assert_eq!(w.window.sm_clock_mhz, 1500);
    assert_eq!(w.window.energy_j, 0.3);
    // A reading in the window replaces it.
    acc.record(
        ms(1000),
        &Sample {
            clock_events: Some(ClockEvents::default()),
            ..energy(600)
        },
        0,
    );
    assert_eq!(
        acc.take_window().window.clock_events,
        ClockEvents::default()
    );
}

#[test]
fn without_power_readings_the_peak_is_the_window_average_never_zero() {
    // `SamplerConfig::power_fields = false`: the energy counter alone.
    let mut acc = Accumulator::default();
    acc.record(ms(0), &energy(1_000_000), 0);
    acc.record(ms(500), &energy(1_150_000), 0);
    acc.record(ms(1000), &energy(1_300_000), 0);
    let window = acc.take_window().window;
    assert_eq!(window.energy_j, 300.0);
    assert_eq!(window.power_peak_w, 300.0, "300 J over 1 s");
    // With an instantaneous reading, that is the peak.
    acc.record(
        ms(1500),
        &Sample {
            power_instant_mw: Some(450_000),
            ..energy(1_500_000)
        },
        0,
    );
    assert_eq!(acc.take_window().window.power_peak_w, 450.0);
}
