//! The power cap search of one GPU: measure a window at one cap, compare it with the
//! previous window, step.
//!
//! A *window* sums tokens and energy over `window_ticks` ticks at one cap and divides
//! them (a ratio of sums, so a busy tick weighs more than a quiet one). Ticks that say
//! nothing about the cap are skipped: `settling` ticks (a setting changed during them),
//! idle ticks (no tokens) and ticks without energy. A full window is compared with the
//! previous one:
//!
//! - better by more than `min_gain` (relative): keep going the same way; from the second
//!   improvement in a row on, double the step (up to `step_w`) to follow a workload that
//!   moved;
//! - otherwise, including a change within the noise: reverse and halve the step (down to
//!   `min_step_w`).
//!
//! Steps stay inside the device's range (after the operator's guardrails) and above any
//! objective floor; at a bound the direction reverses. Windows are measured at the
//! settings actually in force, so a host that steps towards a target under a rate limit,
//! or a dry run that applies nothing, cannot make the search compare the wrong caps.

use crate::config::CapConfig;
use tokwatt_policy_sdk::{DeviceFacts, InForce, Observation, debug};

/// Two caps closer than this are the same cap: NVML keeps the limit in milliwatts, and a
/// host may round it to whole watts.
pub const CAP_TOLERANCE_W: f64 = 0.5;

/// Which way the power cap moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Towards lower caps.
    Down,
    /// Towards higher caps.
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

/// Which settings a window holds still besides the cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowScope {
    /// Only the cap: ticks at any batch size count towards the same window.
    Cap,
    /// The cap and the batch size: a policy that also moves the batch must not read
    /// the batch's effect as the cap's, so a tick at another batch starts the window over.
    CapAndBatch,
}

impl WindowScope {
    /// The batch size a window at `in_force` is held at: 0, standing for any batch,
    /// when the scope does not hold the batch still.
    fn batch_size(self, in_force: &InForce) -> u32 {
        match self {
            WindowScope::Cap => 0,
            WindowScope::CapAndBatch => in_force.batch_size,
        }
    }
}

/// Tokens and energy summed over the settled, busy ticks at one cap (and one batch size,
/// under [`WindowScope::CapAndBatch`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    /// The cap in force over the window, W.
    pub cap_w: f64,
    /// The batch size the window is held at; 0 under [`WindowScope::Cap`].
    pub batch_size: u32,
    /// Tokens made over the window's ticks.
    pub tokens: u64,
    /// Energy used over the window's ticks, J.
    pub energy_j: f64,
    /// The ticks summed so far.
    pub ticks: u32,
}

impl Window {
    /// A window with nothing in it yet.
    pub fn empty(cap_w: f64, batch_size: u32) -> Window {
        Window {
            cap_w,
            batch_size,
            tokens: 0,
            energy_j: 0.0,
            ticks: 0,
        }
    }

    /// Whether a tick at these settings belongs to this window.
    fn holds(&self, cap_w: f64, batch_size: u32) -> bool {
        (cap_w - self.cap_w).abs() <= CAP_TOLERANCE_W && batch_size == self.batch_size
    }
}

/// The efficiency measured over one full window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measurement {
    /// The cap the window ran at, W.
    pub cap_w: f64,
    /// Tokens per joule over the window, as a ratio of sums.
    pub tokens_per_j: f64,
}

/// A cap that recently broke the objective: the search stays above it for
/// `windows_left` more windows, then may probe below it again (the load may have eased).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SloFloor {
    /// The cap that broke the objective, W.
    pub cap_w: f64,
    /// Full windows until the floor lifts.
    pub windows_left: u32,
}

/// The power cap search of one GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct CapSearch {
    /// The device index of the GPU searched.
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
    /// The cap the search stays above for a while after it broke the objective.
    pub slo_floor: Option<SloFloor>,
    /// What a window holds still; fixed by the policy, not part of the handed-over state.
    pub scope: WindowScope,
}

impl CapSearch {
    /// A search on `device`, starting at `config.start_w` or the device's default cap.
    ///
    /// # Errors
    /// When the device's power cap range (after the guardrails) is empty or not finite.
    pub fn new(
        device: &DeviceFacts,
        config: &CapConfig,
        scope: WindowScope,
    ) -> Result<CapSearch, String> {
        let (min_w, max_w) = (device.power_cap_min_w, device.power_cap_max_w);
        if !(min_w.is_finite() && max_w.is_finite() && 0.0 < min_w && min_w <= max_w) {
            return Err(format!(
                "gpu {}: the host reports a power cap range of {min_w}-{max_w} W, in which \
                 no cap can be searched; check the spec's power cap guardrails",
                device.index
            ));
        }
        let start_w = config
            .start_w
            .unwrap_or(device.power_cap_default_w)
            .max(min_w)
            .min(max_w);
        Ok(CapSearch {
            gpu: device.index,
            min_w,
            max_w,
            target_w: start_w,
            step_w: config.step_w,
            // From the board's default (its highest cap, usually), lower caps save more
            // energy than they cost in tokens.
            direction: Direction::Down,
            improvements_in_a_row: 0,
            window: Window::empty(start_w, 0),
            previous: None,
            slo_floor: None,
            scope,
        })
    }

    /// Adds a tick to the window when it says something about the cap, and steps when
    /// the window is full. Returns the cap to ask for, unless it is already in force.
    pub fn observe(&mut self, observation: &Observation, config: &CapConfig) -> Option<f64> {
        if let Some(measurement) = self.accumulate(observation, config) {
            self.step_after(measurement, config);
        }
        self.request(observation.in_force.power_cap_w)
    }

    /// The target, unless it is already in force.
    pub fn request(&self, in_force_w: f64) -> Option<f64> {
        ((in_force_w - self.target_w).abs() > CAP_TOLERANCE_W).then_some(self.target_w)
    }

    /// Drops the window being filled and starts one at the settings in force: for a
    /// policy about to change a setting the window holds still, so the ticks so far
    /// would describe settings that are no longer in force.
    pub fn restart_window(&mut self, observation: &Observation) {
        let in_force = &observation.in_force;
        self.window = Window::empty(in_force.power_cap_w, self.scope.batch_size(in_force));
    }

    /// Raises the cap by a full step at once, for an objective the policy cannot meet
    /// otherwise, and keeps the search above the cap that broke it for
    /// `slo_hold_windows` windows. Returns the raised target.
    ///
    /// The comparison restarts from the feasible side, probing back down towards the
    /// boundary (where the best feasible efficiency usually is) by the smallest step, so
    /// the probe does not jump straight back over it.
    pub fn raise_for_slo(&mut self, observation: &Observation, config: &CapConfig) -> f64 {
        let in_force_w = observation.in_force.power_cap_w;
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
        self.target_w = raised_w;
        self.previous = None;
        self.window = Window::empty(raised_w, self.scope.batch_size(&observation.in_force));
        self.direction = Direction::Down;
        self.step_w = config.min_step_w;
        self.improvements_in_a_row = 0;
        raised_w
    }

    /// Adds a settled, busy tick to the window; returns the measurement when the window
    /// is full. Ticks that mix two settings, idle ticks and ticks without energy say
    /// nothing about the cap, so they are skipped.
    fn accumulate(&mut self, observation: &Observation, config: &CapConfig) -> Option<Measurement> {
        let energy_j = observation.energy_j;
        if observation.settling
            || observation.tokens == 0
            || !(energy_j.is_finite() && energy_j > 0.0)
        {
            return None;
        }
        // Measure at the settings actually in force: if they are not the window's (the
        // host is still stepping towards the target, someone else moved the cap, or the
        // batch size changed under a scope that holds it), start over.
        let in_force_w = observation.in_force.power_cap_w;
        let batch_size = self.scope.batch_size(&observation.in_force);
        if !self.window.holds(in_force_w, batch_size) {
            self.window = Window::empty(in_force_w, batch_size);
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
        *window = Window::empty(window.cap_w, window.batch_size);
        Some(measurement)
    }

    /// Judges a full window against the previous one and picks the next cap.
    ///
    /// Under [`WindowScope::CapAndBatch`] the previous window may have run at another
    /// batch size: a policy that holds each cap's batch at the latency limit then
    /// compares the caps with their best batch each, which is the choice to make.
    fn step_after(&mut self, measurement: Measurement, config: &CapConfig) {
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
        let batch = match self.scope {
            WindowScope::Cap => String::new(),
            WindowScope::CapAndBatch => format!(" and batch {}", self.window.batch_size),
        };
        debug!(
            "gpu {}: {} ticks at {:.1} W{batch} gave {:.4} tokens/J ({comparison}); next \
             {:.1} W (going {}, step {:.1} W)",
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
    fn next_cap(&mut self, from_w: f64, config: &CapConfig) -> f64 {
        let lowest_w = match self.slo_floor {
            Some(floor) => (floor.cap_w + config.min_step_w).max(self.min_w),
            None => self.min_w,
        }
        .min(self.max_w);
        let step = |direction: Direction, step_w: f64| {
            (from_w + direction.sign() * step_w)
                .max(lowest_w)
                .min(self.max_w)
        };
        let next_w = step(self.direction, self.step_w);
        if (next_w - from_w).abs() > CAP_TOLERANCE_W {
            return next_w;
        }
        // Blocked by a bound: the best cap is probably at the bound, so probe away from
        // it by the smallest step rather than leave it by a large one.
        self.direction = self.direction.reversed();
        self.step_w = config.min_step_w;
        self.improvements_in_a_row = 0;
        step(self.direction, self.step_w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_policy_sdk::testing;

    /// The documented defaults, with windows of two ticks to keep the tests short.
    fn config() -> CapConfig {
        CapConfig {
            window_ticks: 2,
            step_w: 50.0,
            min_step_w: 10.0,
            min_gain: 0.005,
            slo_hold_windows: 3,
            start_w: None,
        }
    }

    fn search(scope: WindowScope) -> CapSearch {
        CapSearch::new(&testing::h200(0), &config(), scope).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A settled, busy tick at `cap_w` and `batch` giving `tokens_per_j`.
    fn tick(cap_w: f64, batch: u32, tokens_per_j: f64) -> Observation {
        let mut observation = testing::observation(0, 0);
        observation.in_force.power_cap_w = cap_w;
        observation.in_force.batch_size = batch;
        observation.energy_j = 500.0;
        observation.tokens = (tokens_per_j * 500.0).round() as u64;
        observation
    }

    /// Feeds one full window at `cap_w` and returns the cap asked for after it.
    fn window(search: &mut CapSearch, cap_w: f64, tokens_per_j: f64) -> Option<f64> {
        search.observe(&tick(cap_w, 64, tokens_per_j), &config());
        search.observe(&tick(cap_w, 64, tokens_per_j), &config())
    }

    #[test]
    fn starts_at_the_default_cap_inside_the_range_going_down() {
        let search = search(WindowScope::Cap);
        assert_eq!((search.min_w, search.max_w), (200.0, 700.0));
        assert_eq!(search.target_w, 700.0);
        assert_eq!(search.direction, Direction::Down);
        let mut narrow = testing::h200(1);
        narrow.power_cap_min_w = 800.0;
        let error = CapSearch::new(&narrow, &config(), WindowScope::Cap)
            .err()
            .unwrap_or_default();
        assert!(
            error.contains("gpu 1") && error.contains("800-700 W"),
            "{error}"
        );
    }

    #[test]
    fn only_settled_busy_ticks_with_energy_fill_a_window() {
        let mut search = search(WindowScope::Cap);
        let busy = tick(700.0, 64, 10.0);
        let mut settling = busy;
        settling.settling = true;
        let mut idle = busy;
        idle.tokens = 0;
        let mut no_energy = busy;
        no_energy.energy_j = f64::NAN;
        for observation in [busy, settling, idle, no_energy] {
            assert_eq!(search.observe(&observation, &config()), None);
        }
        assert_eq!(search.window.ticks, 1);
        assert_eq!(search.observe(&busy, &config()), Some(650.0));
        assert_eq!(
            search.previous,
            Some(Measurement {
                cap_w: 700.0,
                tokens_per_j: 10.0
            })
        );
    }

    #[test]
    fn better_keeps_going_and_doubles_from_the_second_gain_worse_reverses_and_halves() {
        let mut search = search(WindowScope::Cap);
        search.step_w = 20.0;
        assert_eq!(window(&mut search, 700.0, 10.0), Some(680.0));
        assert_eq!(window(&mut search, 680.0, 10.2), Some(660.0));
        // The second gain in a row doubles the step, up to `step_w`.
        assert_eq!(window(&mut search, 660.0, 10.4), Some(620.0));
        assert_eq!(search.improvements_in_a_row, 2);
        // A change within `min_gain` is noise: reverse and halve.
        assert_eq!(window(&mut search, 620.0, 10.42), Some(640.0));
        assert_eq!((search.direction, search.step_w), (Direction::Up, 20.0));
        assert_eq!(window(&mut search, 640.0, 10.0), Some(630.0));
        assert_eq!((search.direction, search.step_w), (Direction::Down, 10.0));
    }

    #[test]
    fn at_a_bound_the_search_turns_back_by_the_smallest_step() {
        let mut search = search(WindowScope::Cap);
        search.direction = Direction::Up;
        assert_eq!(window(&mut search, 700.0, 10.0), Some(690.0));
        assert_eq!((search.direction, search.step_w), (Direction::Down, 10.0));
    }

    #[test]
    fn a_window_holds_the_batch_only_under_the_batch_scope() {
        for (scope, ticks_after_resize) in [(WindowScope::Cap, 2), (WindowScope::CapAndBatch, 1)] {
            let mut search = search(scope);
            let mut long = config();
            long.window_ticks = 10;
            search.observe(&tick(700.0, 64, 10.0), &long);
            search.observe(&tick(700.0, 80, 10.0), &long);
            assert_eq!(search.window.ticks, ticks_after_resize, "{scope:?}");
        }
        let mut search = search(WindowScope::CapAndBatch);
        search.observe(&tick(700.0, 64, 10.0), &config());
        search.restart_window(&tick(700.0, 64, 10.0));
        assert_eq!(search.window, Window::empty(700.0, 64));
    }

    #[test]
    fn a_raise_sets_a_floor_that_lifts_after_its_windows() {
        let mut search = search(WindowScope::Cap);
        search.target_w = 400.0;
        assert_eq!(
            search.raise_for_slo(&tick(400.0, 64, 10.0), &config()),
            450.0
        );
        assert_eq!((search.direction, search.step_w), (Direction::Down, 10.0));
        // Probing down from 450 W stops at the floor plus the smallest step.
        search.step_w = 50.0;
        assert_eq!(window(&mut search, 450.0, 10.0), Some(410.0));
        assert_eq!(search.slo_floor.map(|floor| floor.windows_left), Some(2));
        window(&mut search, 410.0, 10.0);
        window(&mut search, 420.0, 10.0);
        assert_eq!(search.slo_floor, None);
    }
}
