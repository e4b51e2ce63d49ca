//! One simulated GPU: firmware clock control, NVML's view of it, and the windows the
//! control loop reads, around its serving engine ([`super::serving`]).
//!
//! Time advances in fixed substeps (a quarter of NVML's update period: 25 ms on the built-in
//! profiles). Within a substep the engine's steps are handled analytically: the number of
//! steps is the elapsed time over the step time, split only where a request finishes,
//! arrives, finishes its prompt or the KV cache fills — never one iteration per step.
//!
//! One file because `GpuSim`'s queue, clock, power and NVML view advance together in
//! every substep and share its fields; split by job, each part would pass the whole state
//! around. The memo of model results (`ModelCache`) is the separable part.

use std::collections::VecDeque;
use std::sync::Arc;

use super::arrivals::ScenarioArrivals;
use super::model::{ClockLimit, DecodeCost, DecodeModel, FirmwareClock, StepLoad, StepPoint};
use super::profile::GpuProfile;
use super::scenario::Scenario;
use super::serving::{Next, Server};
use tokwatt_core::actuator::GpuSettings;
use tokwatt_core::rng::Rng;
use tokwatt_core::types::{
    ClockEvents, DemandWindow, RequestsWindow, TelemetryWindow, WorkloadWindow,
};
use tokwatt_core::workload::serving::RequestSource;

/// Substeps per NVML update period.
const SUBSTEPS_PER_UPDATE: u64 = 4;
/// Arrivals in one substep beyond which their times are not drawn (they all queue: the
/// batch fills in this substep anyway).
const MAX_TIMED_ARRIVALS: u64 = 4096;
/// Every pass of a substep's event loop retires a request, finishes a prompt, preempts a
/// sequence, admits an arrival or ends the substep, so it terminates; this bound only
/// guards against a float pathology.
const MAX_EVENTS_PER_SUBSTEP: usize = 10_000_000;

/// Exact quantities the sensors only approximate, for tests and evaluation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimTruth {
    /// Simulated time, seconds.
    pub time_s: f64,
    /// Energy drawn, joules (no sensor gain error, no update quantisation).
    pub energy_j: f64,
    /// Tokens generated (fractional: a decode step may be part-way done).
    pub tokens: f64,
    /// Current SM clock (continuous, while it settles), MHz.
    pub sm_mhz: f64,
    /// The clock the firmware is steering to, MHz.
    pub target_sm_mhz: u32,
    /// Power over the last substep, watts.
    pub power_w: f64,
    /// This board's power-sensor gain: NVML reads `gain ×` the true power (see `[nvml]`).
    pub sensor_gain: f64,
    pub temperature_c: f64,
    pub requests_completed: u64,
    /// Every arrival: admitted to the queue or turned away.
    pub requests_arrived: u64,
    /// Arrivals turned away because the queue was full.
    pub requests_turned_away: u64,
    pub active_sequences: u32,
    /// Waiting requests, including sequences paused by a batch-size cut.
    pub waiting: u64,
}

/// What NVML would answer now (values change only at update boundaries).
#[derive(Debug, Clone, Copy)]
struct Readings {
    energy_counter_j: f64,
    power_avg_w: f64,
    power_inst_w: f64,
    sm_mhz: u32,
    temperature_c: f64,
}

/// Telemetry accumulated since the last `read_window`.
#[derive(Debug, Clone, Default)]
struct TelemetryAccumulator {
    start_substep: u64,
    /// The substep of the counter update the window's energy starts from.
    start_update_substep: u64,
    start_counter_j: f64,
    samples: u32,
    peak_w: f64,
    clocks: Vec<u32>,
    events: ClockEvents,
    busy_s: f64,
}

/// Workload accounting since the last `read_window`.
#[derive(Debug, Clone, Default)]
struct WorkloadAccumulator {
    start_tokens: u64,
    start_steps: u64,
    /// (step time ms, decode steps) per substep with decode steps.
    step_times: Vec<(f64, f64)>,
    start_arrived: u64,
    start_completed: u64,
    start_turned_away: u64,
    start_demanded: u64,
    start_first_tokens: u64,
    /// Busy time, and busy time in steps that carried prompt tokens.
    busy_s: f64,
    prefill_busy_s: f64,
}

/// Independent random streams, so drawing more of one (e.g. arrival times, only needed when
/// a slot is free) never shifts another (the arrival counts every policy must face).
#[derive(Debug, Clone)]
struct Streams {
    /// A scenario with prompts: its requests, the very ones tokwatt's CUDA serving loop is
    /// given for the same seed and GPU index (so a run on the GPU and one on its simulator
    /// serve the same requests, and their TTFT and TPOT compare the engines, not two draws).
    requests: Option<ScenarioArrivals>,
    /// A decode-only scenario: arrival counts per substep and their times.
    arrival_counts: Rng,
    arrival_times: Rng,
    sensor: Rng,
    step_jitter: Rng,
}

/// One arrival within a substep: when, and its prompt and output lengths.
#[derive(Debug, Clone, Copy)]
struct Arrival {
    offset_s: f64,
    prompt: u32,
    output: u32,
    /// When it arrived, where it waited for a step in progress to end before the engine
    /// saw it (`None`: it arrived at `offset_s`).
    arrived_s: Option<f64>,
}

#[derive(Debug, Clone)]
pub(super) struct GpuSim {
    model: DecodeModel,
    scenario: Arc<Scenario>,
    profile: Arc<GpuProfile>,
    mem_grid: Vec<u32>,
    substep_ns: u64,
    substep_s: f64,
    clock_alpha: f64,
    /// The lag's step toward a lower target.
    throttle_alpha: f64,
    thermal_alpha: f64,
    gain: f64,
    streams: Streams,

    // Settings.
    cap_w: f64,
    sm_lock: Option<(u32, u32)>,
    mem_lock: Option<(u32, u32)>,
    mem_mhz: f64,
    batch: u32,

    // Dynamics.
    substeps_done: u64,
    sm_mhz: f64,
    target: FirmwareClock,
    cache: ModelCache,
    /// The idle power at the clocks of the last substep, by their bits.
    idle_power: Option<(u64, u64, f64)>,
    temperature_c: f64,
    last_power_w: f64,
    was_idle: bool,

    server: Server,
    arrivals: Vec<Arrival>,
    /// The drawn arrival times of a substep (a buffer reused).
    offsets: Vec<f64>,
    /// Arrivals waiting past the substep's end for the step in progress to end.
    carried: Vec<Arrival>,
    /// The share of the engine's step in progress already run (0: between steps).
    step_phase: f64,

    // NVML emulation.
    energy_true_j: f64,
    bin_energy_j: f64,
    boxcar: VecDeque<f64>,
    boxcar_len: usize,
    readings: Readings,
    /// The substep at which NVML last updated its readings.
    last_update_substep: u64,

    telemetry: TelemetryAccumulator,
    workload: WorkloadAccumulator,
}

impl GpuSim {
    pub(super) fn new(
        index: u32,
        profile: Arc<GpuProfile>,
        scenario: Arc<Scenario>,
        seed: u64,
        noise_seed: u64,
    ) -> Self {
        let cost = DecodeCost::new(&scenario.model, scenario.context_tokens);
        let model = DecodeModel::new(&profile, &cost);
        let server = Server::new(
            &scenario,
            super::kv_positions_beside_weights(&profile, &scenario),
        );
        let nvml = &profile.nvml;
        let substep_s = nvml.energy_update_s / SUBSTEPS_PER_UPDATE as f64;
        let substep_ns = ((substep_s * 1e9).round() as u64).max(1);
        let substep_s = substep_ns as f64 * 1e-9;
        // The clock follows its target as a first-order lag reaching 95 % after `settle_s`
        // (up) or `throttle_s` (down).
        let lag = |settle_s: f64| {
            if settle_s > 0.0 {
                1.0 - (-substep_s * 3.0 / settle_s).exp()
            } else {
                1.0
            }
        };
        let clock_alpha = lag(nvml.settle_s);
        let throttle_alpha = lag(nvml.throttle_s.unwrap_or(nvml.settle_s));
        let thermal_alpha = 1.0 - (-substep_s / profile.thermal.time_constant_s).exp();
        let stream_base = u64::from(index) << 8;
        // Drawn whether or not the profile fixes this board's gain, so a fixed gain on one
        // board leaves the others' draws as they were.
        let mut gain_stream = Rng::stream(seed, stream_base | 4);
        let drawn_gain = 1.0 + nvml.gain_error_max * (2.0 * gain_stream.uniform() - 1.0);
        let gain = nvml.fixed_gain(index).unwrap_or(drawn_gain);
        let idle_w = profile.idle.power_w;
        let boxcar_len =
            ((nvml.power_average_window_s / nvml.energy_update_s).round() as usize).max(1);
        let mem_grid = profile.mem_clocks_mhz();
        let idle_mhz = profile.clocks.idle_sm_mhz;
        let temperature_c = profile.thermal.ambient_c + profile.thermal.resistance_c_per_w * idle_w;
        Self {
            model,
            streams: Streams {
                // The CUDA serving loop of GPU `index` draws from `seed + index` (the agent's
                // assembly); a decode-only scenario has no requests to draw.
                requests: ScenarioArrivals::new(&scenario, seed.wrapping_add(index.into())).ok(),
                arrival_counts: Rng::stream(seed, stream_base),
                arrival_times: Rng::stream(seed, stream_base | 1),
                sensor: Rng::stream(noise_seed, stream_base | 2),
                step_jitter: Rng::stream(noise_seed, stream_base | 3),
            },
            cap_w: profile.power_cap.default_w,
            sm_lock: None,
            mem_lock: None,
            mem_mhz: f64::from(mem_grid.first().copied().unwrap_or(1)),
            batch: scenario.initial_batch_size,
            substeps_done: 0,
            sm_mhz: f64::from(idle_mhz),
            target: FirmwareClock {
                sm_mhz: idle_mhz,
                limit: ClockLimit::None,
            },
            cache: ModelCache::default(),
            idle_power: None,
            temperature_c,
            last_power_w: idle_w,
            was_idle: true,
            server,
            arrivals: Vec::new(),
            offsets: Vec::new(),
            carried: Vec::new(),
            step_phase: 0.0,
            energy_true_j: 0.0,
            bin_energy_j: 0.0,
            boxcar: std::iter::repeat_n(idle_w * gain, boxcar_len).collect(),
            boxcar_len,
            readings: Readings {
                energy_counter_j: 0.0,
                power_avg_w: idle_w * gain,
                power_inst_w: idle_w * gain,
                sm_mhz: idle_mhz,
                temperature_c,
            },
            last_update_substep: 0,
            telemetry: TelemetryAccumulator::default(),
            workload: WorkloadAccumulator::default(),
            mem_grid,
            substep_ns,
            substep_s,
            clock_alpha,
            throttle_alpha,
            thermal_alpha,
            gain,
            scenario,
            profile,
        }
    }

    /// Simulate every whole substep up to `now_ns` (a change made now applies from the next one).
    pub(super) fn advance_to(&mut self, now_ns: u64) {
        let target = now_ns / self.substep_ns;
        while self.substeps_done < target {
            self.substep();
        }
    }

    /// Substeps still to simulate up to `now_ns`.
    pub(super) fn substeps_behind(&self, now_ns: u64) -> u64 {
        (now_ns / self.substep_ns).saturating_sub(self.substeps_done)
    }

    fn now_s(&self) -> f64 {
        self.substeps_done as f64 * self.substep_s
    }

    fn substep(&mut self) {
        let dt = self.substep_s;
        let start_s = self.now_s();
        self.draw_arrivals(start_s, dt);
        self.server.rebalance(start_s, self.batch);
        self.steer_clock();
        // The settings the model results depend on hold for the whole substep (a change
        // applies from the next one): checked once here, not at every segment.
        if !self.server.has_prompts() {
            self.cache.check_settings(self.settings_key());
        }

        let mut elapsed = 0.0;
        let mut energy = 0.0;
        let mut busy = 0.0;
        let mut decode_busy = 0.0;
        let mut decode_steps = 0.0;
        let mut next_arrival = 0;
        // With nothing to run: the model's clocked idle power at the current clock, which is
        // the profile's idle power at the idle clock (checked when the profile loads) and less
        // under a lower clock lock.
        let idle_w = self.idle_power_w();
        // A request finishing, arriving or finishing its prompt splits the substep.
        for _ in 0..MAX_EVENTS_PER_SUBSTEP {
            let remaining = dt - elapsed;
            if remaining <= 1e-12 {
                break;
            }
            let until_arrival = self
                .arrivals
                .get(next_arrival)
                .map_or(f64::INFINITY, |a| (a.offset_s - elapsed).max(0.0));
            // The step the server is in when the segment ends (0 when idle): an arrival
            // then is seen at that step's end.
            let (segment, step_in_progress_s) = match self.server.next() {
                Next::Idle => {
                    let segment = remaining.min(until_arrival);
                    self.step_phase = 0.0;
                    energy += idle_w * segment;
                    (segment, 0.0)
                }
                Next::Steps { load, until_event } => {
                    let point = self.point(&load);
                    let segment = remaining.min(until_arrival).min(until_event * point.step_s);
                    let steps = segment / point.step_s;
                    let phase = self.step_phase + steps;
                    self.step_phase = phase - (phase + 1e-9).floor();
                    if self.step_phase < 1e-9 {
                        self.step_phase = 0.0;
                    }
                    let segment_j = point.power_w * segment;
                    // Requests are charged what the board's sensor reads (its gain), as an
                    // attribution of its energy counter would charge them.
                    self.server.advance(
                        &load,
                        steps,
                        point.step_s,
                        segment_j * self.gain,
                        start_s + elapsed + segment,
                    );
                    energy += segment_j;
                    busy += segment;
                    if load.decode > 0 {
                        decode_busy += segment;
                        decode_steps += steps;
                    }
                    if load.prefill > 0.0 {
                        self.workload.prefill_busy_s += segment;
                    }
                    (segment, point.step_s)
                }
            };
            elapsed += segment;
            while let Some(arrival) = self.arrivals.get(next_arrival) {
                if arrival.offset_s > elapsed + 1e-12 {
                    break;
                }
                let arrival = *arrival;
                next_arrival += 1;
                // An engine takes requests in at step boundaries: one arriving while a
                // step runs waits, unseen, for what is left of that step (its step stays as
                // it was). A random share of a step instead put it in mid-step, where the
                // runs that followed were no longer whole steps: at half the H100's prefill
                // capacity, short answers beside 8,192-token steps then decoded 20 % fast
                // at the p99 (docs/measurements/h100-2026-12-07-prefill-saturation).
                if arrival.arrived_s.is_none() && step_in_progress_s > 0.0 && self.step_phase > 0.0
                {
                    let waiting = Arrival {
                        offset_s: arrival.offset_s + (1.0 - self.step_phase) * step_in_progress_s,
                        arrived_s: Some(start_s + arrival.offset_s),
                        ..arrival
                    };
                    if waiting.offset_s < dt {
                        let at = next_arrival
                            + self.arrivals[next_arrival..]
                                .partition_point(|a| a.offset_s <= waiting.offset_s);
                        self.arrivals.insert(at, waiting);
                    } else {
                        self.carried.push(Arrival {
                            offset_s: waiting.offset_s - dt,
                            ..waiting
                        });
                    }
                    continue;
                }
                self.server.arrive(
                    arrival.arrived_s.unwrap_or(start_s + arrival.offset_s),
                    arrival.prompt,
                    arrival.output,
                );
            }
            self.server.rebalance(start_s + elapsed, self.batch);
        }
        // Arrivals the substep did not reach (a step longer than what was left of it) wait
        // on into the next one.
        for arrival in self.arrivals.drain(next_arrival.min(self.arrivals.len())..) {
            self.carried.push(Arrival {
                offset_s: (arrival.offset_s - dt).max(0.0),
                ..arrival
            });
        }
        self.workload.busy_s += busy;
        self.finish_substep(energy, busy, decode_busy, decode_steps);
    }

    /// Arrivals of this substep, identical for every policy. A scenario with prompts: its
    /// requests up to the substep's end, each at its own time. A decode-only one: the count
    /// from its own stream; when a slot is free their times decide when serving starts, so
    /// they are drawn (from a stream of their own); when none is, they queue behind others
    /// and are spread evenly over the substep — their waits are then exact to a fraction of
    /// a substep, at no cost.
    fn draw_arrivals(&mut self, start_s: f64, dt: f64) {
        self.arrivals.clear();
        // Those still waiting for a step to end come first (a step is shorter than a
        // substep, so they enter in this one).
        self.arrivals.append(&mut self.carried);
        let slot_free = self.server.in_slots() < self.batch as usize && self.server.waiting() == 0;
        if let Some(requests) = self.streams.requests.as_mut() {
            // Every request before the substep's end, from the start of time: no request
            // is lost to the float rounding between one substep's end and the next's start.
            let due = requests.arrivals(f64::NEG_INFINITY, start_s + dt);
            if slot_free && due.len() as u64 <= MAX_TIMED_ARRIVALS {
                self.arrivals.extend(due.iter().map(|r| Arrival {
                    offset_s: (r.arrival_s - start_s).max(0.0),
                    prompt: r.prompt,
                    output: r.output,
                    arrived_s: None,
                }));
                self.arrivals
                    .sort_by(|a, b| a.offset_s.total_cmp(&b.offset_s));
            } else {
                for r in due {
                    self.server.arrive(r.arrival_s, r.prompt, r.output);
                }
            }
            return;
        }
        let rate = self.scenario.arrival_rps_at(start_s);
        let count = self.streams.arrival_counts.poisson(rate * dt);
        if count == 0 {
            return;
        }
        let output = self.scenario.output_tokens;
        let arrival = |offset_s: f64| Arrival {
            offset_s,
            prompt: 0,
            output,
            arrived_s: None,
        };
        if slot_free && count <= MAX_TIMED_ARRIVALS {
            let times = &mut self.streams.arrival_times;
            self.offsets.clear();
            self.offsets
                .extend((0..count).map(|_| times.uniform() * dt));
            self.arrivals
                .extend(self.offsets.iter().map(|&offset| arrival(offset)));
            self.arrivals
                .sort_unstable_by(|a, b| a.offset_s.total_cmp(&b.offset_s));
        } else {
            let spacing = dt / count as f64;
            for i in 0..count {
                let queued = arrival((i as f64 + 0.5) * spacing);
                self.server
                    .arrive(start_s + queued.offset_s, queued.prompt, queued.output);
            }
        }
    }

    /// The model's power with nothing to run at the current clocks, memoised by the clocks'
    /// bits (the same value the model gives: it is a pure function of them).
    fn idle_power_w(&mut self) -> f64 {
        let key = (self.sm_mhz.to_bits(), self.mem_mhz.to_bits());
        match self.idle_power {
            Some((sm, mem, watts)) if (sm, mem) == key => watts,
            _ => {
                let watts = self.model.point(0, self.sm_mhz, self.mem_mhz).power_w;
                self.idle_power = Some((key.0, key.1, watts));
                watts
            }
        }
    }

    /// The step of `load` at the current clock. A decode-only step depends on the count of
    /// sequences alone (their context is fixed), so it is memoised by that count.
    fn point(&mut self, load: &StepLoad) -> StepPoint {
        let (model, sm_mhz, mem_mhz) = (&self.model, self.sm_mhz, self.mem_mhz);
        if self.server.has_prompts() {
            return model.point_load(load, sm_mhz, mem_mhz);
        }
        // The cache holds this substep's settings: `substep` checked them.
        let active = load.decode;
        self.cache
            .point(active, sm_mhz, || model.point(active, sm_mhz, mem_mhz))
    }

    /// What the model results depend on besides the load and the clock.
    fn settings_key(&self) -> (u64, u32, u64) {
        let lock_max = self.sm_lock.map_or(u32::MAX, |(_, hi)| hi);
        (
            self.enforced_cap_w().to_bits(),
            lock_max,
            self.mem_mhz.to_bits(),
        )
    }

    /// The limit the GPU enforces: the requested cap, or a lower limit held from outside
    /// (the scenario's `outside_power_limit_w`), as NVML's enforced limit is.
    fn enforced_cap_w(&self) -> f64 {
        match self.scenario.outside_power_limit_at(self.now_s()) {
            Some(outside) => self.cap_w.min(outside),
            None => self.cap_w,
        }
    }

    /// The true power the firmware's limiter holds to: it acts on the board's own sensor, so
    /// with gain `g` the sensed power stays under the cap and the true power under `cap / g`.
    fn limiter_cap_w(&self) -> f64 {
        self.enforced_cap_w() / self.gain
    }

    /// The firmware picks a target clock for the load at the start of the substep; the clock
    /// moves toward it with the settle lag.
    fn steer_clock(&mut self) {
        let next = self.server.next();
        self.target = match next {
            Next::Idle => {
                let (lo, hi) = self.sm_lock.unwrap_or((0, u32::MAX));
                FirmwareClock {
                    sm_mhz: self.profile.clocks.idle_sm_mhz.clamp(lo, hi),
                    limit: ClockLimit::None,
                }
            }
            Next::Steps { load, .. } => {
                let key = self.settings_key();
                let lock_max = key.1;
                let (model, cap_w, mem_mhz) = (&self.model, self.limiter_cap_w(), self.mem_mhz);
                if self.server.has_prompts() {
                    model.firmware_clock_load(&load, cap_w, lock_max, mem_mhz)
                } else {
                    self.cache.check_settings(key);
                    let active = load.decode;
                    self.cache.clock(active, || {
                        model.firmware_clock(active, cap_w, lock_max, mem_mhz)
                    })
                }
            }
        };
        let target = f64::from(self.target.sm_mhz);
        let alpha = if target < self.sm_mhz {
            self.throttle_alpha
        } else {
            self.clock_alpha
        };
        self.sm_mhz += (target - self.sm_mhz) * alpha;
        if (target - self.sm_mhz).abs() < 0.5 {
            self.sm_mhz = target;
        }
        self.was_idle = next == Next::Idle;
    }

    fn finish_substep(&mut self, energy_j: f64, busy_s: f64, decode_busy_s: f64, steps: f64) {
        let dt = self.substep_s;
        self.substeps_done += 1;
        self.energy_true_j += energy_j;
        self.bin_energy_j += energy_j;
        self.last_power_w = energy_j / dt;
        let thermal = self.profile.thermal;
        let settled_c = thermal.ambient_c + thermal.resistance_c_per_w * self.last_power_w;
        self.temperature_c += (settled_c - self.temperature_c) * self.thermal_alpha;
        self.telemetry.busy_s += busy_s;
        if steps > 0.0 {
            let sigma = self.profile.nvml.step_time_jitter;
            let jitter = (sigma * self.streams.step_jitter.normal() - 0.5 * sigma * sigma).exp();
            let step_ms = decode_busy_s / steps * 1e3 * jitter;
            self.workload.step_times.push((step_ms, steps));
        }
        if self.substeps_done.is_multiple_of(SUBSTEPS_PER_UPDATE) {
            self.nvml_update();
        }
    }

    /// NVML's update: counter, boxcar average, an instantaneous sample, clock, temperature.
    ///
    /// The sensor reads `gain ×` the true power plus noise: one draw per update, shared by the
    /// instantaneous sample and the counter's increment (the counter integrates the same
    /// sensor), so a 1 s window carries about `noise / sqrt(10)` and the average reading,
    /// built from the increments, agrees with the counter.
    fn nvml_update(&mut self) {
        let nvml = &self.profile.nvml;
        let update_s = nvml.energy_update_s;
        let dynamic_w = (self.last_power_w - self.profile.idle.power_w).max(0.0);
        let noise_sd = nvml.instantaneous_noise_w + nvml.instantaneous_noise_fraction * dynamic_w;
        let noise_w = noise_sd * self.streams.sensor.normal();
        // The counter never runs backwards.
        let sensed_bin_j = (self.bin_energy_j * self.gain + noise_w * update_s).max(0.0);
        self.bin_energy_j = 0.0;
        self.boxcar.push_back(sensed_bin_j / update_s);
        while self.boxcar.len() > self.boxcar_len {
            self.boxcar.pop_front();
        }
        let inst = (self.last_power_w * self.gain + noise_w).max(0.0);
        self.last_update_substep = self.substeps_done;
        self.readings = Readings {
            energy_counter_j: self.readings.energy_counter_j + sensed_bin_j,
            power_avg_w: self.boxcar.iter().sum::<f64>() / self.boxcar.len() as f64,
            power_inst_w: inst,
            sm_mhz: self.nearest_sm_clock(self.sm_mhz),
            temperature_c: self.temperature_c,
        };
        let events = self.clock_events();
        let acc = &mut self.telemetry;
        acc.samples += 1;
        acc.peak_w = acc.peak_w.max(inst);
        acc.clocks.push(self.readings.sm_mhz);
        acc.events = acc.events.union(events);
    }

    fn clock_events(&self) -> ClockEvents {
        ClockEvents {
            gpu_idle: self.was_idle,
            sw_power_cap: !self.was_idle && self.target.limit == ClockLimit::PowerCap,
            clock_setting: !self.was_idle && self.target.limit == ClockLimit::ClockLock,
            ..ClockEvents::default()
        }
    }

    /// The supported clock nearest `mhz` (what NVML reports while the clock settles).
    fn nearest_sm_clock(&self, mhz: f64) -> u32 {
        let grid = self.model.sm_grid();
        // Highest first: `above` is the first clock at or below `mhz`.
        let above = grid.partition_point(|&f| f64::from(f) > mhz);
        let candidates = [above.checked_sub(1), Some(above)];
        candidates
            .into_iter()
            .flatten()
            .filter_map(|i| grid.get(i).copied())
            .min_by(|a, b| {
                (f64::from(*a) - mhz)
                    .abs()
                    .total_cmp(&(f64::from(*b) - mhz).abs())
            })
            .unwrap_or(0)
    }

    pub(super) fn read_telemetry_window(&mut self) -> TelemetryWindow {
        let acc = std::mem::take(&mut self.telemetry);
        self.telemetry = TelemetryAccumulator {
            start_substep: self.substeps_done,
            start_update_substep: self.last_update_substep,
            start_counter_j: self.readings.energy_counter_j,
            clocks: Vec::with_capacity(acc.clocks.capacity()),
            ..TelemetryAccumulator::default()
        };
        let elapsed_s = (self.substeps_done - acc.start_substep) as f64 * self.substep_s;
        // As NVML's sampler: the energy is the counter difference between two updates, so the
        // interval is the span between those updates, not the time between reads. A read off an
        // update boundary (any wall-clock run) would otherwise put up to one update too many or
        // too few into the window's power.
        let interval_s =
            (self.last_update_substep - acc.start_update_substep) as f64 * self.substep_s;
        let mut clocks = acc.clocks;
        clocks.sort_unstable();
        let sm_clock_mhz = clocks
            .get(clocks.len() / 2)
            .copied()
            .unwrap_or(self.readings.sm_mhz);
        TelemetryWindow {
            interval_s,
            energy_j: self.readings.energy_counter_j - acc.start_counter_j,
            energy_counter_j: self.readings.energy_counter_j,
            power_avg_reading_w: self.readings.power_avg_w,
            power_peak_w: if acc.samples > 0 {
                acc.peak_w
            } else {
                self.readings.power_inst_w
            },
            sm_clock_mhz,
            mem_clock_mhz: self.mem_mhz.round() as u32,
            temperature_c: self.readings.temperature_c,
            gpu_util_pct: if elapsed_s > 0.0 {
                (acc.busy_s / elapsed_s * 100.0).clamp(0.0, 100.0)
            } else {
                0.0
            },
            clock_events: acc.events,
            power_limit_enforced_w: self.enforced_cap_w(),
            power_limit_requested_w: Some(self.cap_w),
            // The simulator does not split memory power out.
            power_mem_avg_w: None,
            samples: acc.samples,
        }
    }

    pub(super) fn read_workload_window(&mut self) -> WorkloadWindow {
        let server = &mut self.server;
        let tokens_now = server.tokens().floor() as u64;
        let steps_now = server.decode_steps().floor() as u64;
        let mut step_times = std::mem::take(&mut self.workload.step_times);
        let mut served = server.take_window();
        let arrived = server.arrived() - self.workload.start_arrived;
        let demand = DemandWindow {
            requests_arrived: arrived,
            requests_completed: server.completed() - self.workload.start_completed,
            requests_turned_away: server.turned_away() - self.workload.start_turned_away,
            tokens_demanded: server.tokens_demanded() - self.workload.start_demanded,
            queue_wait_p99_ms: tokwatt_core::quantile::nearest_rank(
                &mut served.queue_waits_ms,
                0.99,
            ),
        };
        let busy_s = self.workload.busy_s;
        let requests = RequestsWindow {
            prefill_tokens: served.prefill_tokens.round() as u64,
            first_tokens: server.first_tokens() - self.workload.start_first_tokens,
            ttft_p99_ms: tokwatt_core::quantile::nearest_rank(&mut served.ttfts_ms, 0.99),
            // No busy time, no share of it.
            prefill_time_share: (busy_s > 0.0)
                .then(|| (self.workload.prefill_busy_s / busy_s).clamp(0.0, 1.0)),
            preemptions: Some(served.preemptions),
            energy: Some(served.energy),
        };
        let window = WorkloadWindow {
            tokens: tokens_now - self.workload.start_tokens,
            steps: steps_now - self.workload.start_steps,
            tpot_p50_ms: weighted_percentile(&mut step_times, 0.50),
            tpot_p99_ms: weighted_percentile(&mut step_times, 0.99),
            active_sequences: u32::try_from(server.in_slots()).unwrap_or(u32::MAX),
            queue_depth: u32::try_from(server.waiting()).unwrap_or(u32::MAX),
            batch_size: self.batch,
            demand: Some(demand),
            requests: Some(requests),
        };
        step_times.clear();
        server.return_buffers(served.queue_waits_ms, served.ttfts_ms);
        self.workload = WorkloadAccumulator {
            start_tokens: tokens_now,
            start_steps: steps_now,
            step_times,
            start_arrived: server.arrived(),
            start_completed: server.completed(),
            start_turned_away: server.turned_away(),
            start_demanded: server.tokens_demanded(),
            start_first_tokens: server.first_tokens(),
            busy_s: 0.0,
            prefill_busy_s: 0.0,
        };
        window
    }

    /// Moves the requests finished since the last call into `into`.
    pub(super) fn take_finished_requests(
        &mut self,
        into: &mut tokwatt_core::workload::FinishedRequests,
    ) {
        self.server.take_finished(into);
    }

    pub(super) fn batch_size(&self) -> u32 {
        self.batch
    }

    /// Takes effect at the next substep (the decode loop picks it up at its next step).
    pub(super) fn set_batch_size(&mut self, batch: u32) {
        self.batch = batch;
    }

    /// The token budget per step's range; `None` for a decode-only scenario.
    pub(super) fn token_budget_range(&self) -> Option<(u32, u32)> {
        self.server.budget_range()
    }

    /// The token budget per step in force; `None` for a decode-only scenario.
    pub(super) fn token_budget(&self) -> Option<u32> {
        self.server.has_prompts().then(|| self.server.budget())
    }

    /// Takes effect from the next step: the next substep's prompt chunks fit it.
    pub(super) fn set_token_budget(&mut self, tokens: u32) {
        self.server.set_budget(tokens);
    }

    pub(super) fn settings(&self) -> GpuSettings {
        GpuSettings {
            power_cap_w: self.cap_w,
            power_cap_enforced_w: self.enforced_cap_w(),
            sm_clock_lock_mhz: self.sm_lock,
            mem_clock_lock_mhz: self.mem_lock,
        }
    }

    /// Set the power limit (already validated against the device range); NVML takes milliwatts.
    pub(super) fn set_power_cap(&mut self, watts: f64) -> f64 {
        self.cap_w = milliwatts(watts);
        self.enforced_cap_w()
    }

    /// Lock the SM clock to the supported clocks within `range` (validated by the caller).
    pub(super) fn set_sm_lock(&mut self, range: Option<(u32, u32)>) {
        self.sm_lock = range;
    }

    pub(super) fn set_mem_lock(&mut self, range: Option<(u32, u32)>, mem_mhz: u32) {
        self.mem_lock = range;
        self.mem_mhz = f64::from(mem_mhz);
    }

    pub(super) fn mem_grid(&self) -> &[u32] {
        &self.mem_grid
    }

    pub(super) fn truth(&self) -> SimTruth {
        SimTruth {
            time_s: self.now_s(),
            energy_j: self.energy_true_j,
            tokens: self.server.tokens(),
            sm_mhz: self.sm_mhz,
            target_sm_mhz: self.target.sm_mhz,
            power_w: self.last_power_w,
            sensor_gain: self.gain,
            temperature_c: self.temperature_c,
            requests_completed: self.server.completed(),
            requests_arrived: self.server.arrived(),
            requests_turned_away: self.server.turned_away(),
            active_sequences: self.server.decoding(),
            waiting: self.server.waiting(),
        }
    }
}

/// Model results memoised per active-sequence count, for one set of device settings (cap,
/// clock lock, memory clock): under varying load the same counts recur substep after substep,
/// and the firmware's clock search is the costliest part of a substep.
#[derive(Debug, Clone, Default)]
struct ModelCache {
    settings: Option<(u64, u32, u64)>,
    clocks: Vec<Option<FirmwareClock>>,
    /// The step at one clock (bits of the MHz value) for each count.
    points: Vec<Option<(u64, StepPoint)>>,
}

impl ModelCache {
    /// Forget everything when the settings changed.
    fn check_settings(&mut self, settings: (u64, u32, u64)) {
        if self.settings != Some(settings) {
            self.settings = Some(settings);
            self.clocks.clear();
            self.points.clear();
        }
    }

    fn clock(&mut self, active: u32, compute: impl FnOnce() -> FirmwareClock) -> FirmwareClock {
        let slot = slot(&mut self.clocks, active);
        *slot.get_or_insert_with(compute)
    }

    fn point(
        &mut self,
        active: u32,
        sm_mhz: f64,
        compute: impl FnOnce() -> StepPoint,
    ) -> StepPoint {
        let slot = slot(&mut self.points, active);
        match slot {
            Some((bits, point)) if *bits == sm_mhz.to_bits() => *point,
            _ => {
                let point = compute();
                *slot = Some((sm_mhz.to_bits(), point));
                point
            }
        }
    }
}

/// The cache slot for `active`, growing the table as needed.
fn slot<T>(table: &mut Vec<Option<T>>, active: u32) -> &mut Option<T> {
    let index = active as usize;
    if table.len() <= index {
        table.resize_with(index + 1, || None);
    }
    &mut table[index]
}

/// `watts` to the milliwatt, as NVML takes a power limit.
pub(super) fn milliwatts(watts: f64) -> f64 {
    (watts * 1000.0).round() / 1000.0
}

/// The `q` quantile of values weighted by their counts (0 with no samples).
fn weighted_percentile(samples: &mut [(f64, f64)], q: f64) -> f64 {
    samples.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
    let total: f64 = samples.iter().map(|&(_, weight)| weight).sum();
    if total <= 0.0 {
        return 0.0;
    }
    let mut cumulative = 0.0;
    for &(value, weight) in samples.iter() {
        cumulative += weight;
        if cumulative >= q * total {
            return value;
        }
    }
    samples.last().map_or(0.0, |&(value, _)| value)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::weighted_percentile;

    #[test]
    fn weighted_percentiles() {
        let mut samples = vec![(3.0, 1.0), (1.0, 1.0), (2.0, 98.0)];
        assert_eq!(weighted_percentile(&mut samples, 0.5), 2.0);
        assert_eq!(weighted_percentile(&mut samples, 0.99), 2.0);
        assert_eq!(weighted_percentile(&mut samples, 1.0), 3.0);
        assert_eq!(weighted_percentile(&mut [], 0.5), 0.0);
    }
}
