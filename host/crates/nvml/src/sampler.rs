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

use super::SamplerConfig;
use tokwatt_core::types::{ClockEvents, TelemetryWindow};

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

/// Which readings a sample takes besides the fast ones (energy and power), which every
/// sample takes. See [`SamplerConfig`] for what each group holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Due {
    /// The SM clock, the clock-event reasons, the enforced power limit.
    pub tick_gauges: bool,
    /// Temperature, utilisation, the memory clock, the requested power limit.
    pub slow_gauges: bool,
}

impl SamplerConfig {
    /// What sample number `round` (0 for the first) reads. The first reads everything,
    /// so that every gauge has a value from the start.
    pub(crate) fn due(&self, round: u64) -> Due {
        let every = |n: u32| round.is_multiple_of(u64::from(n.max(1)));
        Due {
            tick_gauges: every(self.tick_gauges_every),
            slow_gauges: every(self.slow_gauges_every),
        }
    }
}

/// Where samples come from: NVML on a real machine, a fake in tests.
pub(crate) trait SampleSource: Send + 'static {
    fn gpu_count(&self) -> usize;
    /// Read GPU `gpu` (0-based position) once: the fast readings always, the gauges
    /// `due` says. Reads that fail are left `None` in the sample and pushed onto
    /// `errors`; a failed read never ends sampling.
    fn sample(&mut self, gpu: usize, due: Due, errors: &mut Vec<SampleError>) -> Sample;
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
    /// Union of the clock-event readings in the window; `None` when none was read.
    clock_events: Option<ClockEvents>,
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
            window.clock_events = Some(window.clock_events.unwrap_or_default().union(events));
        }
        self.latest = self.latest.updated_by(sample);
    }

    /// Close the current window and start the next one at its last energy reading.
    ///
    /// Gauges with no reading in the window (the slow ones, and the tick gauges when
    /// the sampler's phase put their reading in the neighbouring window) keep their last
    /// known value; `samples == 0` says the window saw nothing new.
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
            // Without instantaneous readings, the averaged ones are the best peak there is;
            // without any power reading (energy only), the window's own average.
            power_peak_w: stats.peak_instant_mw.or(stats.peak_avg_mw).map_or_else(
                || {
                    if interval.is_zero() {
                        0.0
                    } else {
                        stats.energy_mj as f64 / 1000.0 / interval.as_secs_f64()
                    }
                },
                watts,
            ),
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
            // A window between two clock-event readings reports the last one rather than
            // none: the reasons in force then are the best knowledge there is.
            clock_events: stats
                .clock_events
                .or(latest.clock_events)
                .unwrap_or_default(),
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
    /// Start sampling every GPU of `source` at the rates of `config`.
    pub fn start<S: SampleSource>(source: S, config: SamplerConfig) -> std::io::Result<Self> {
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
                move || run(source, config, &accumulators, &stopped)
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
    config: SamplerConfig,
    accumulators: &[Mutex<Accumulator>],
    stopped: &mpsc::Receiver<()>,
) {
    let started = Instant::now();
    let mut next = started;
    let mut reported: HashSet<(usize, &'static str)> = HashSet::new();
    let mut errors = Vec::new();
    for round in 0u64.. {
        let due = config.due(round);
        for (gpu, accumulator) in accumulators.iter().enumerate() {
            errors.clear();
            let at = started.elapsed();
            let sample = source.sample(gpu, due, &mut errors);
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
        next += config.period;
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
mod tests;
