//! The sampling core: one thread reads every GPU at a fixed period into per-GPU
//! accumulators, and the control loop takes aggregated windows from them without ever
//! waiting on NVML.
//!
//! Nothing here knows NVML: readings come through [`SampleSource`], so the window logic
//! is tested with a fake source.

use std::collections::HashSet;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::types::{ClockEvents, TelemetryWindow};

/// One reading of one GPU. A value the source could not read is `None`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Sample {
    /// Energy counter, millijoules since the driver loaded.
    pub energy_mj: Option<u64>,
    /// NVML's 1 s averaged board power (field 185), milliwatts.
    pub power_avg_mw: Option<u32>,
    /// Instantaneous board power (field 186), milliwatts.
    pub power_instant_mw: Option<u32>,
    /// Averaged memory power (field 185, memory scope), milliwatts.
    pub mem_power_avg_mw: Option<u32>,
    pub sm_clock_mhz: Option<u32>,
    pub mem_clock_mhz: Option<u32>,
    pub temperature_c: Option<u32>,
    pub gpu_util_pct: Option<u32>,
    pub clock_events: Option<ClockEvents>,
    pub power_limit_requested_mw: Option<u32>,
    pub power_limit_enforced_mw: Option<u32>,
}

impl Sample {
    /// `self` with every value `newer` has replaced.
    fn updated_by(self, newer: &Sample) -> Sample {
        Sample {
            energy_mj: newer.energy_mj.or(self.energy_mj),
            power_avg_mw: newer.power_avg_mw.or(self.power_avg_mw),
            power_instant_mw: newer.power_instant_mw.or(self.power_instant_mw),
            mem_power_avg_mw: newer.mem_power_avg_mw.or(self.mem_power_avg_mw),
            sm_clock_mhz: newer.sm_clock_mhz.or(self.sm_clock_mhz),
            mem_clock_mhz: newer.mem_clock_mhz.or(self.mem_clock_mhz),
            temperature_c: newer.temperature_c.or(self.temperature_c),
            gpu_util_pct: newer.gpu_util_pct.or(self.gpu_util_pct),
            clock_events: newer.clock_events.or(self.clock_events),
            power_limit_requested_mw: newer
                .power_limit_requested_mw
                .or(self.power_limit_requested_mw),
            power_limit_enforced_mw: newer
                .power_limit_enforced_mw
                .or(self.power_limit_enforced_mw),
        }
    }
}

/// A reading that failed during one sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SampleError {
    pub what: &'static str,
    pub reason: String,
}

/// Where samples come from: NVML on a real machine, a fake in tests.
pub(crate) trait SampleSource: Send + 'static {
    fn gpu_count(&self) -> usize;
    /// Read GPU `gpu` (0-based position) once. Reads that fail are left `None` in the
    /// sample and pushed onto `errors`; a failed read never ends sampling.
    fn sample(&mut self, gpu: usize, errors: &mut Vec<SampleError>) -> Sample;
}

/// One window of telemetry from the NVML backend: the backend-neutral window plus the
/// readings only NVML has.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct NvmlWindow {
    pub window: TelemetryWindow,
    /// Averaged memory power at the end of the window, watts (where the GPU reports it).
    pub mem_power_avg_w: Option<f64>,
    /// Power limit requested through NVML at the end of the window, watts.
    pub power_limit_requested_w: Option<f64>,
    /// Readings that failed during the window (each is logged; sampling went on).
    pub sample_errors: u32,
    /// Times the energy counter went backwards (driver reload) since the start; the energy
    /// across such a step is unknown and counted as zero.
    pub energy_counter_resets: u32,
}

/// Aggregates one GPU's samples into windows.
///
/// Energy is the sum of counter differences between consecutive readings, so the reading
/// that closes one window is the one the next window starts from: consecutive windows
/// tile the counter exactly, and a failed read only moves energy to the next reading.
#[derive(Debug, Default)]
pub(crate) struct Accumulator {
    /// Last energy counter value and when it was read.
    last_energy: Option<(u64, Duration)>,
    /// Time of the energy reading the current window starts from.
    window_start: Option<Duration>,
    energy_since_start_mj: u64,
    energy_counter_resets: u32,
    /// Most recent value of every reading, across windows.
    latest: Sample,
    current: WindowStats,
}

#[derive(Debug, Default)]
struct WindowStats {
    samples: u32,
    errors: u32,
    energy_mj: u64,
    sm_clocks_mhz: Vec<u32>,
    mem_clocks_mhz: Vec<u32>,
    peak_instant_mw: Option<u32>,
    peak_avg_mw: Option<u32>,
    util_sum_pct: u64,
    util_samples: u32,
    clock_events: ClockEvents,
}

impl Accumulator {
    /// Add a sample taken at `at` (time since sampling started) with `errors` failed reads.
    pub fn record(&mut self, at: Duration, sample: &Sample, errors: usize) {
        let window = &mut self.current;
        window.samples += 1;
        window.errors = window
            .errors
            .saturating_add(u32::try_from(errors).unwrap_or(u32::MAX));

        if let Some(counter) = sample.energy_mj {
            match self.last_energy {
                Some((previous, _)) if counter >= previous => {
                    let delta = counter - previous;
                    window.energy_mj += delta;
                    self.energy_since_start_mj += delta;
                }
                Some((previous, _)) => {
                    self.energy_counter_resets += 1;
                    tracing::warn!(
                        previous_mj = previous,
                        now_mj = counter,
                        "the energy counter went backwards (driver reloaded?): the energy across this step is lost"
                    );
                }
                None => {}
            }
            self.last_energy = Some((counter, at));
            self.window_start.get_or_insert(at);
        }

        if let Some(mhz) = sample.sm_clock_mhz {
            window.sm_clocks_mhz.push(mhz);
        }
        if let Some(mhz) = sample.mem_clock_mhz {
            window.mem_clocks_mhz.push(mhz);
        }
        if let Some(mw) = sample.power_instant_mw {
            window.peak_instant_mw = window.peak_instant_mw.max(Some(mw));
        }
        if let Some(mw) = sample.power_avg_mw {
            window.peak_avg_mw = window.peak_avg_mw.max(Some(mw));
        }
        if let Some(pct) = sample.gpu_util_pct {
            window.util_sum_pct += u64::from(pct);
            window.util_samples += 1;
        }
        if let Some(events) = sample.clock_events {
            window.clock_events = window.clock_events.union(events);
        }
        self.latest = self.latest.updated_by(sample);
    }

    /// Close the current window and start the next one at its last energy reading.
    ///
    /// Gauges with no sample in the window (temperature, limits) keep their last known
    /// value; `samples == 0` says the window saw nothing new.
    pub fn take_window(&mut self) -> NvmlWindow {
        let stats = std::mem::take(&mut self.current);
        let end = self.last_energy.map(|(_, at)| at);
        let interval = match (self.window_start, end) {
            (Some(start), Some(end)) => end.saturating_sub(start),
            _ => Duration::ZERO,
        };
        self.window_start = end;

        let latest = self.latest;
        let watts = |mw: u32| f64::from(mw) / 1000.0;
        let window = TelemetryWindow {
            interval_s: interval.as_secs_f64(),
            energy_j: stats.energy_mj as f64 / 1000.0,
            energy_counter_j: self.energy_since_start_mj as f64 / 1000.0,
            power_avg_reading_w: latest.power_avg_mw.map_or(0.0, watts),
            // Without instantaneous readings, the averaged ones are the best peak there is.
            power_peak_w: stats
                .peak_instant_mw
                .or(stats.peak_avg_mw)
                .map_or(0.0, watts),
            sm_clock_mhz: median(stats.sm_clocks_mhz)
                .or(latest.sm_clock_mhz)
                .unwrap_or(0),
            mem_clock_mhz: median(stats.mem_clocks_mhz)
                .or(latest.mem_clock_mhz)
                .unwrap_or(0),
            temperature_c: latest.temperature_c.map_or(0.0, f64::from),
            gpu_util_pct: if stats.util_samples > 0 {
                stats.util_sum_pct as f64 / f64::from(stats.util_samples)
            } else {
                latest.gpu_util_pct.map_or(0.0, f64::from)
            },
            clock_events: stats.clock_events,
            power_limit_enforced_w: latest.power_limit_enforced_mw.map_or(0.0, watts),
            power_limit_requested_w: None,
            power_mem_avg_w: None,
            samples: stats.samples,
        };
        NvmlWindow {
            window,
            mem_power_avg_w: latest.mem_power_avg_mw.map(watts),
            power_limit_requested_w: latest.power_limit_requested_mw.map(watts),
            sample_errors: stats.errors,
            energy_counter_resets: self.energy_counter_resets,
        }
    }
}

/// The middle value (the lower of the two middle ones for an even count, so the result is
/// always a clock the GPU actually ran at).
fn median(mut values: Vec<u32>) -> Option<u32> {
    if values.is_empty() {
        return None;
    }
    let middle = (values.len() - 1) / 2;
    let (_, value, _) = values.select_nth_unstable(middle);
    Some(*value)
}

fn lock(accumulator: &Mutex<Accumulator>) -> MutexGuard<'_, Accumulator> {
    // A panic while recording leaves plain numbers behind: keep using them.
    accumulator.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The sampler thread and the accumulators it fills. Dropping it stops the thread.
#[derive(Debug)]
pub(crate) struct Sampler {
    accumulators: Arc<Vec<Mutex<Accumulator>>>,
    /// Dropping the sender wakes the thread and tells it to stop.
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Sampler {
    /// Start sampling every GPU of `source` once per `period`.
    pub fn start<S: SampleSource>(source: S, period: Duration) -> std::io::Result<Self> {
        let accumulators: Arc<Vec<Mutex<Accumulator>>> = Arc::new(
            (0..source.gpu_count())
                .map(|_| Mutex::new(Accumulator::default()))
                .collect(),
        );
        let (stop, stopped) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("tokwatt-nvml-sampler".into())
            .spawn({
                let accumulators = Arc::clone(&accumulators);
                move || run(source, period, &accumulators, &stopped)
            })?;
        Ok(Self {
            accumulators,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    pub fn gpu_count(&self) -> usize {
        self.accumulators.len()
    }

    /// Take GPU `gpu`'s window; `None` when there is no such GPU. Never waits on the source.
    pub fn take_window(&self, gpu: usize) -> Option<NvmlWindow> {
        self.accumulators
            .get(gpu)
            .map(|accumulator| lock(accumulator).take_window())
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the NVML sampler thread panicked");
        }
    }
}

/// The sampler thread's loop: read every GPU, then sleep until the next period (or until
/// told to stop). Reads happen outside the accumulator locks, so a slow NVML call never
/// holds up a reader.
fn run<S: SampleSource>(
    mut source: S,
    period: Duration,
    accumulators: &[Mutex<Accumulator>],
    stopped: &mpsc::Receiver<()>,
) {
    let started = Instant::now();
    let mut next = started;
    let mut reported: HashSet<(usize, &'static str)> = HashSet::new();
    let mut errors = Vec::new();
    loop {
        for (gpu, accumulator) in accumulators.iter().enumerate() {
            errors.clear();
            let at = started.elapsed();
            let sample = source.sample(gpu, &mut errors);
            for error in &errors {
                if reported.insert((gpu, error.what)) {
                    tracing::warn!(
                        gpu,
                        "reading {} failed: {} (counted; further failures of this reading are logged at debug level)",
                        error.what,
                        error.reason
                    );
                } else {
                    tracing::debug!(gpu, "reading {} failed: {}", error.what, error.reason);
                }
            }
            lock(accumulator).record(at, &sample, errors.len());
        }
        next += period;
        let now = Instant::now();
        if next < now {
            // Sampling took longer than a period: start the next round at once rather
            // than bursting to catch up.
            next = now;
        }
        match stopped.recv_timeout(next - now) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
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
        fn sample(&mut self, gpu: usize, errors: &mut Vec<SampleError>) -> Sample {
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
        let sampler = Sampler::start(source, ms(1)).unwrap();
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
        fn sample(&mut self, _gpu: usize, _errors: &mut Vec<SampleError>) -> Sample {
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
        let sampler = Sampler::start(source, ms(1)).unwrap();
        entered_rx.recv().unwrap();
        // The sampler is stuck inside a read; the window must still come back.
        let w = sampler.take_window(0).unwrap();
        assert_eq!(w.window.samples, 1);
        release_tx.send(()).unwrap();
        drop(sampler);
    }
}
