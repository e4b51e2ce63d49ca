//! The search on one GPU: measure, compare, step.

use crate::config::Config;
use tokwatt_policy_sdk::{DeviceFacts, Objective, Observation, Settings, debug, info};

/// Two caps closer than this are the same cap: NVML keeps the limit in milliwatts, and a
/// host may round it to whole watts.
pub(crate) const CAP_TOLERANCE_W: f64 = 0.5;

/// Which way the power cap moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    Down,
    Up,
}

impl Direction {
    fn sign(self) -> f64 {
        match self {
            Direction::Down => -1.0,
            Direction::Up => 1.0,
        }
    }

    fn reversed(self) -> Direction {
        match self {
            Direction::Down => Direction::Up,
            Direction::Up => Direction::Down,
        }
    }

    fn word(self) -> &'static str {
        match self {
            Direction::Down => "down",
            Direction::Up => "up",
        }
    }
}

/// Tokens and energy summed over the settled, busy ticks at one cap.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Window {
    pub cap_w: f64,
    pub tokens: u64,
    pub energy_j: f64,
    pub ticks: u32,
}

impl Window {
    pub fn empty(cap_w: f64) -> Window {
        Window {
            cap_w,
            tokens: 0,
            energy_j: 0.0,
            ticks: 0,
        }
    }
}

/// The efficiency measured over one full window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Measurement {
    pub cap_w: f64,
    pub tokens_per_j: f64,
}

/// A cap that recently broke the objective: the search stays above it for
/// `windows_left` more windows, then may probe below it again (the load may have eased).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SloFloor {
    pub cap_w: f64,
    pub windows_left: u32,
}

/// The search state of one GPU.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GpuSearch {
    pub gpu: u32,
    /// The device's power cap range, after the operator's guardrails.
    pub min_w: f64,
    pub max_w: f64,
    /// The cap this search asks for.
    pub target_w: f64,
    /// The current step; halves on every reversal, down to `min_step_w`.
    pub step_w: f64,
    /// The direction of the next step.
    pub direction: Direction,
    /// Consecutive windows that improved; from the second on, the step doubles back
    /// towards `step_w`, so the search can follow a workload that changed.
    pub improvements_in_a_row: u32,
    /// The window being filled.
    pub window: Window,
    /// The last full window, the reference for the next one.
    pub previous: Option<Measurement>,
    pub slo_floor: Option<SloFloor>,
    /// True from an objective-driven raise until the next settled tick, so the raise is
    /// judged on figures that show it rather than repeated while it takes effect.
    pub raised_for_slo: bool,
}

impl GpuSearch {
    /// A search on `device`, starting at `config.start_w` or the device's default cap.
    pub fn new(device: &DeviceFacts, config: &Config) -> Result<GpuSearch, String> {
        let (min_w, max_w) = (device.power_cap_min_w, device.power_cap_max_w);
        if !(min_w.is_finite() && max_w.is_finite() && 0.0 < min_w && min_w <= max_w) {
            return Err(format!(
                "gpu {}: the host reports a power cap range of {min_w}-{max_w} W, which \
                 hill-climb cannot search; check the spec's power cap guardrails",
                device.index
            ));
        }
        let start_w = config
            .start_w
            .unwrap_or(device.power_cap_default_w)
            .max(min_w)
            .min(max_w);
        Ok(GpuSearch {
            gpu: device.index,
            min_w,
            max_w,
            target_w: start_w,
            step_w: config.step_w,
            // From the board's default (its highest cap, usually), lower caps save more
            // energy than they cost in tokens.
            direction: Direction::Down,
            improvements_in_a_row: 0,
            window: Window::empty(start_w),
            previous: None,
            slo_floor: None,
            raised_for_slo: false,
        })
    }

    /// Takes one tick's observation of this GPU and returns its settings.
    pub fn observe(
        &mut self,
        observation: &Observation,
        objective: &Objective,
        config: &Config,
    ) -> Settings {
        let in_force_w = observation.in_force.power_cap_w;
        // The objective comes first: a violation raises the cap now, whatever the
        // window says. While an earlier raise is still settling, wait for it to show.
        if let Some(violation) = slo_violation(observation, objective) {
            if !(observation.settling && self.raised_for_slo) {
                self.raise_for_slo(in_force_w, &violation, config);
            }
            return self.request(in_force_w);
        }
        if !observation.settling {
            self.raised_for_slo = false;
        }
        if let Some(measurement) = self.accumulate(observation, config) {
            self.step_after(measurement, config);
        }
        self.request(in_force_w)
    }

    /// Asks for the target unless it is already in force.
    fn request(&self, in_force_w: f64) -> Settings {
        if (in_force_w - self.target_w).abs() <= CAP_TOLERANCE_W {
            Settings::unchanged()
        } else {
            Settings::unchanged().with_power_cap_w(self.target_w)
        }
    }

    /// Adds a settled, busy tick to the window; returns the measurement when the window
    /// is full. Ticks that mix two settings, idle ticks and ticks without energy say
    /// nothing about the cap, so they are skipped.
    fn accumulate(&mut self, observation: &Observation, config: &Config) -> Option<Measurement> {
        let energy_j = observation.energy_j;
        if observation.settling
            || observation.tokens == 0
            || !(energy_j.is_finite() && energy_j > 0.0)
        {
            return None;
        }
        // Measure at the cap actually in force: if it is not the window's cap (the host
        // is still stepping towards the target, or someone else moved it), start over.
        let in_force_w = observation.in_force.power_cap_w;
        if (in_force_w - self.window.cap_w).abs() > CAP_TOLERANCE_W {
            self.window = Window::empty(in_force_w);
        }
        let window = &mut self.window;
        window.tokens = window.tokens.saturating_add(observation.tokens);
        window.energy_j += energy_j;
        window.ticks = window.ticks.saturating_add(1);
        if window.ticks < config.window_ticks {
            return None;
        }
        let measurement = Measurement {
            cap_w: window.cap_w,
            tokens_per_j: window.tokens as f64 / window.energy_j,
        };
        *window = Window::empty(window.cap_w);
        Some(measurement)
    }

    /// Judges a full window against the previous one and picks the next cap.
    fn step_after(&mut self, measurement: Measurement, config: &Config) {
        let verdict = match self.previous {
            // Nothing to compare with, or the same cap measured again (the host did not
            // apply the last target): keep the direction and step.
            None => None,
            Some(previous) if (measurement.cap_w - previous.cap_w).abs() <= CAP_TOLERANCE_W => None,
            Some(previous) => {
                let moved = if measurement.cap_w > previous.cap_w {
                    Direction::Up
                } else {
                    Direction::Down
                };
                let gain = measurement.tokens_per_j / previous.tokens_per_j - 1.0;
                let improved = gain > config.min_gain;
                if improved {
                    self.direction = moved;
                    self.improvements_in_a_row = self.improvements_in_a_row.saturating_add(1);
                    if self.improvements_in_a_row >= 2 {
                        self.step_w = (self.step_w * 2.0).min(config.step_w);
                    }
                } else {
                    self.direction = moved.reversed();
                    self.improvements_in_a_row = 0;
                    self.step_w = (self.step_w / 2.0).max(config.min_step_w);
                }
                Some((previous, gain, improved))
            }
        };
        self.previous = Some(measurement);
        if let Some(floor) = &mut self.slo_floor {
            floor.windows_left = floor.windows_left.saturating_sub(1);
            if floor.windows_left == 0 {
                debug!(
                    "gpu {}: lifting the objective floor at {:.1} W",
                    self.gpu, floor.cap_w
                );
                self.slo_floor = None;
            }
        }
        self.target_w = self.next_cap(measurement.cap_w, config);
        let comparison = match verdict {
            None => "first at this cap".to_string(),
            Some((previous, gain, improved)) => format!(
                "{:+.2} % vs {:.1} W: {}",
                gain * 100.0,
                previous.cap_w,
                if improved {
                    "better"
                } else {
                    "not better, reversing"
                }
            ),
        };
        debug!(
            "gpu {}: {} ticks at {:.1} W gave {:.4} tokens/J ({comparison}); next {:.1} W \
             (going {}, step {:.1} W)",
            self.gpu,
            config.window_ticks,
            measurement.cap_w,
            measurement.tokens_per_j,
            self.target_w,
            self.direction.word(),
            self.step_w
        );
    }

    /// One step from `from_w` in the current direction, inside the device range and
    /// above any objective floor; at a bound, the direction reverses.
    fn next_cap(&mut self, from_w: f64, config: &Config) -> f64 {
        let lowest_w = match self.slo_floor {
            Some(floor) => (floor.cap_w + config.min_step_w).max(self.min_w),
            None => self.min_w,
        }
        .min(self.max_w);
        let step = |direction: Direction| {
            (from_w + direction.sign() * self.step_w)
                .max(lowest_w)
                .min(self.max_w)
        };
        let next_w = step(self.direction);
        if (next_w - from_w).abs() > CAP_TOLERANCE_W {
            return next_w;
        }
        // Blocked by a bound: the best cap is probably at the bound, so probe away from
        // it by the smallest step rather than leave it by a large one.
        self.direction = self.direction.reversed();
        self.step_w = config.min_step_w;
        self.improvements_in_a_row = 0;
        let step = |direction: Direction| {
            (from_w + direction.sign() * self.step_w)
                .max(lowest_w)
                .min(self.max_w)
        };
        step(self.direction)
    }

    /// Raises the cap by a full step at once, and keeps the search above the cap that
    /// broke the objective for a while.
    fn raise_for_slo(&mut self, in_force_w: f64, violation: &str, config: &Config) {
        // If a higher target is already on its way, keep it rather than lowering it.
        let raised_w = (in_force_w + config.step_w)
            .max(self.target_w)
            .min(self.max_w);
        let floor_w = match self.slo_floor {
            Some(floor) => floor.cap_w.max(in_force_w),
            None => in_force_w,
        };
        self.slo_floor = Some(SloFloor {
            cap_w: floor_w,
            windows_left: config.slo_hold_windows,
        });
        info!(
            "gpu {}: {violation} at {in_force_w:.1} W; raising the cap to {raised_w:.1} W",
            self.gpu
        );
        self.target_w = raised_w;
        // Restart the comparison from the feasible side, probing back down towards the
        // boundary (where the best feasible efficiency usually is) by the smallest step,
        // so the probe does not jump straight back over it.
        self.previous = None;
        self.window = Window::empty(raised_w);
        self.direction = Direction::Down;
        self.step_w = config.min_step_w;
        self.improvements_in_a_row = 0;
        self.raised_for_slo = true;
    }
}

/// Why the observation breaks the objective, if it does.
///
/// Latency counts only when tokens were made; throughput only when requests are waiting
/// (below the minimum with an empty queue means too little demand, not too low a cap).
fn slo_violation(observation: &Observation, objective: &Objective) -> Option<String> {
    if let Some(limit_ms) = objective.tpot_p99_limit_ms
        && observation.tokens > 0
        && observation.tpot_p99_ms > limit_ms
    {
        return Some(format!(
            "p99 time per token {:.2} ms is over the {limit_ms} ms limit",
            observation.tpot_p99_ms
        ));
    }
    if let Some(min_tokens_per_s) = objective.min_tokens_per_s
        && observation.queue_depth > 0
        && observation.tokens_per_s < min_tokens_per_s
    {
        return Some(format!(
            "{:.0} tokens/s with {} requests waiting is under the {min_tokens_per_s} \
                 tokens/s minimum",
            observation.tokens_per_s, observation.queue_depth
        ));
    }
    None
}
