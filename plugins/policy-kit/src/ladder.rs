//! A noise-aware search over a ladder of settings of one knob, ordered from the least
//! power (rung 0) to the most: power caps on a grid, or the supported SM clocks.
//!
//! # Bracketing: a golden-section search on noisy figures
//!
//! Tokens per joule along such a ladder rises to one peak and falls (or, while the GPU
//! keeps up with demand, rises all the way down to the lowest setting that still keeps
//! up). The search keeps a *bracket* `[lo, hi]` of rungs known to hold the peak, starting
//! with the whole ladder, and measures two rungs inside it at the golden ratio, the
//! upper one first (the safe side). Each is measured tick by tick; once both have
//! `min_window_ticks` settled, busy ticks they are compared (see [`compare_arms`]: on
//! power when both kept up with demand, on tokens per joule otherwise), and a difference
//! counts only beyond `z` standard errors, with the per-tick noise pooled over every
//! window (per-window noise does not cancel between settings; a board's constant gain
//! error does). Then, as in a golden-section search:
//!
//! - the lower rung better: the peak is below the upper one, `hi` moves down to it;
//! - the upper rung better: `lo` moves up to the lower one;
//! - still within the noise after `max_window_ticks`: the point estimates decide, as in
//!   a plain golden-section search (a wrong call needs the two to be close, so it costs
//!   little).
//!
//! Records persist per rung (fading after `memory_ticks`), so a rung measured before is
//! not measured again, and the bracket shrinks by about 0.618 per window: some nine
//! windows from a ladder of fifty rungs to three. Then the search settles on the best
//! rung of the bracket.
//!
//! # Settled: following a drift
//!
//! Every `recheck_windows` windows at the settled rung it probes a neighbour (sides
//! alternate) and moves there if it is better beyond the noise, then keeps probing that
//! way while the next rung is better still. While both keep up with demand, a tie goes
//! to the lower rung (it cannot cost more power for the same tokens), so the search walks
//! down to the edge of the bounds.
//!
//! # Bounds and the objective
//!
//! A rung whose window has a mean p99 time per token within `tpot_margin` of the limit,
//! whose p99 time to first token (with prompts: mean + 2 standard deviations of its
//! ticks, against the TTFT bound or, if lower, the queue-wait bound) comes within
//! `tpot_margin` of its bound, which falls behind (with prompts: under 70 % of the tokens
//! asked for while the batch fills past a quarter), or whose queue grows (by
//! `queue_growth` requests a tick past `queue_min`) or holds `queue_min` requests on
//! average without draining, is out of bounds (unless requests
//! wait at the top rung too: demand beyond the GPU): it becomes a *floor*, below which
//! the search does not go for `floor_hold_windows` windows, and the bracket starts above
//! it (the settled rung, only just out of bounds, gives way to the rung above it). A tick
//! that breaks the objective (see [`objective_breach`]) does the same at once, and moves
//! the GPU up: to the settled rung when it was a probe below it (by at least an eighth
//! of the rest of the ladder when the breach was by over 5 %); from the settled rung,
//! by an eighth of the rest of the ladder when it was only just broken (by up to 10 %: a
//! burst, or a slow rise), otherwise into a new bracket above it (the load rose), as from
//! a point of the bracket (up to the bracket's top, or the ladder's when the breach was by
//! over 5 %). While such a move settles, further breaches wait, and the
//! first window after it (while the backlog drains) is judged on breaches only.
//!
//! A tick whose p99 time per token is not a number (a serving engine saw no request end
//! in it: the host sends NaN) says nothing about latency: it counts for tokens per joule
//! but not for the window's latency, and a window in which no tick's latency was known
//! is not judged under a latency limit: the search stays where it is (never moving down
//! on it) until a tick tells.
//!
//! # Re-exploration
//!
//! When the tokens per second at a rung move by `shift_factor` from that rung's record,
//! or a queue appears or vanishes, for `shift_ticks` ticks in a row (see
//! [`ShiftDetector`]), every record is dropped and a new bracket is searched: below the
//! rung in force after a fall in load (less work needs less power), the whole ladder
//! after a rise (measuring its upper point first, the safe side). A floor stands through
//! a rise until its hold runs out, and with prompts through a fall too. Two moves are not
//! shifts: more tokens a second in the first window after a raise for the objective (the
//! backlog drains), and fewer at a rung that lags its demand (see [`LadderWindow::lagging`]: with prompts, a rung too
//! slow to prefill them makes fewer tokens while its batch fills). Requests waiting at a
//! probe mean a rung too slow or a rise in demand; where a higher rung served them at
//! once, the search measures it again to tell: if the queue drains there, the probe was
//! too slow (a floor); if not, the demand rose (a re-exploration).
//!
//! One file because it is one algorithm, described above: bracketing, settling, floors and
//! re-exploration are rules over the same `LadderSearch` state (the bracket, the per-rung
//! records, the floor), and each rule is read against the others.

use crate::ladder_config::LadderConfig;
use crate::measure::{
    ArmRecord, Noise, Shift, ShiftDetector, ShiftRule, TickFigures, compare_arms, objective_breach,
};
use crate::stats::{RunningStats, Verdict};
use tokwatt_policy_sdk::{Objective, Observation, debug, info};

/// Ticks the setting in force may differ from the one asked for before the search takes
/// the one in force as its own (something outside holds the knob).
const MISMATCH_TICKS: u32 = 5;

/// Bracket updates one tick may make from records already taken, before it must measure.
const MOVES_PER_TICK: u32 = 16;

/// A rung that broke the objective or went out of bounds, and how many more windows the
/// search stays above it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Floor {
    pub rung: usize,
    pub windows_left: u32,
}

/// The ticks of the current visit to a rung.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LadderWindow {
    /// The visit's own ticks, for the noise estimate and the bounds.
    pub record: ArmRecord,
    pub tpot_p99_ms: RunningStats,
    /// The p99 time to first token of the ticks that told one (requests with prompts).
    pub ttft_p99_ms: RunningStats,
    /// Tokens made and tokens the arrivals asked for over the visit (where the workload
    /// tells the demand), and the sequences in flight on its first and latest tick: a
    /// rung that makes far fewer tokens than are asked for while the batch fills is
    /// falling behind, though nobody waits in the queue yet.
    pub tokens_made: f64,
    pub tokens_demanded: f64,
    pub in_flight_start: u32,
    pub in_flight_last: u32,
    /// The batch size in force on the latest tick.
    pub batch_size: u32,
    /// Requests waiting on the visit's first and latest tick.
    pub queue_start: u32,
    pub queue_last: u32,
}

/// Below this share of the tokens asked for, with the batch filling, a visit falls behind
/// (the arrivals' lengths make the asked-for tokens swing about a fifth over a few ticks).
pub const FALLING_BEHIND_SHARE: f64 = 0.7;

/// Requests that waited through a visit: the queue's mean over it, its latest depth
/// and its growth a tick.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Waiting {
    pub mean: f64,
    pub last: u32,
    pub growth: f64,
}

/// What a window's ticks say about the p99 time per token, against a limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WindowLatency {
    /// The mean of the ticks that reported one is within the margin below the limit.
    Within,
    /// The mean (in ms) is past the margin: out of bounds.
    Near(f64),
    /// No tick of the window reported one: it is neither within nor out of bounds.
    Unknown,
}

impl LadderWindow {
    /// The window's p99 time per token against `limit_ms` less the fraction `margin`
    /// kept free. Ticks whose p99 was not a number were left out of the mean; if every
    /// tick was one, the latency is unknown, never within.
    pub fn latency(&self, limit_ms: f64, margin: f64) -> WindowLatency {
        let stats = &self.tpot_p99_ms;
        if stats.count == 0 || !stats.mean.is_finite() {
            return WindowLatency::Unknown;
        }
        if stats.mean > limit_ms * (1.0 - margin) {
            WindowLatency::Near(stats.mean)
        } else {
            WindowLatency::Within
        }
    }

    /// Why the visit fell behind its demand, if it did: it made under
    /// [`FALLING_BEHIND_SHARE`] of the tokens its arrivals asked for while the sequences
    /// in flight grew past a quarter of the batch (and `queue_min`). Below that, a slower
    /// rung's sequences simply live longer: by Little's law more are in flight at the
    /// same demand, and the tokens made lag the tokens asked for while they build up.
    pub fn falling_behind(&self, queue_min: u32, batch_size: u32) -> Option<String> {
        (self.lagging() && self.in_flight_last >= queue_min.max(batch_size / 4)).then(|| {
                format!(
                    "it made {:.0} % of the tokens asked for while the sequences in flight grew from {} to {}",
                    100.0 * self.tokens_made / self.tokens_demanded,
                    self.in_flight_start,
                    self.in_flight_last
                )
            })
    }

    /// Whether the visit so far made under [`FALLING_BEHIND_SHARE`] of the tokens its
    /// arrivals asked for while more sequences came into flight: the rung lags its
    /// demand (with prompts: its batch fills with prompts it prefills too slowly), so
    /// its fewer tokens a second say nothing of the load.
    pub fn lagging(&self) -> bool {
        self.tokens_demanded > 0.0
            && self.in_flight_last > self.in_flight_start
            && self.tokens_made < FALLING_BEHIND_SHARE * self.tokens_demanded
    }

    /// Whether requests waited for a slot through the visit: a queue that grew (to at
    /// least `queue_min`, by `queue_growth` a tick), or one that stayed without
    /// draining. The objective may bound that wait, and a full queue turns them away.
    pub fn requests_waiting(&self, queue_min: u32, queue_growth: f64) -> Option<Waiting> {
        let ticks = f64::from(self.record.ticks().saturating_sub(1).max(1));
        let last = self.queue_last;
        let growth = (f64::from(last) - f64::from(self.queue_start)) / ticks;
        let mean = self.record.queue_depth.mean;
        let waiting = (last >= queue_min && growth >= queue_growth)
            || (mean >= f64::from(queue_min) && growth > -queue_growth);
        waiting.then_some(Waiting { mean, last, growth })
    }
}

/// The ladder search of one GPU. Rungs are indices into the policy's ordered settings.
#[derive(Debug, Clone, PartialEq)]
pub struct LadderSearch {
    pub gpu: u32,
    /// Per rung, what it has done since the last re-exploration.
    pub rungs: Vec<ArmRecord>,
    /// The rung asked for.
    pub current: usize,
    /// The bracket searched while not settled.
    pub lo: usize,
    pub hi: usize,
    /// The rung settled on, once the bracket closed.
    pub incumbent: Option<usize>,
    /// Windows at the settled rung since the last probe of a neighbour.
    pub windows_at_incumbent: u32,
    /// The side of the next neighbour probe: +1 up, -1 down.
    pub recheck_direction: i32,
    pub floor: Option<Floor>,
    /// A rung the host held the GPU at when a higher one was asked for (a fleet's
    /// allowance, a limit from outside): the search for efficiency stays at or below it
    /// for `floor_hold_windows` windows, so it does not ask again and again for rungs it
    /// is never given. A raise for the objective still asks above it: that ask is how a
    /// node says it needs more. Not kept across a swap (learnt again in a few ticks).
    pub ceiling: Option<Floor>,
    pub window: LadderWindow,
    pub noise: Noise,
    pub shift: ShiftDetector,
    /// Ticks in a row at a rung other than the one asked for.
    pub mismatch_ticks: u32,
    /// True from a raise for the objective until a settled tick shows it.
    pub raised: bool,
    /// A rung whose queue grew, and the higher rung that kept up, being measured again
    /// to tell a rung too slow for the demand from a rise in demand.
    pub queue_suspect: Option<QueueSuspect>,
    /// Whether requests with prompts were seen (a tick prefilled some). Not kept across a
    /// swap: learnt again on the first tick that prefills.
    pub serves_prompts: bool,
    /// True for the first window after a raise for the objective: the backlog that built
    /// up at the breaking rung drains during it, so its latency says little about the
    /// rung, and only a breach counts.
    pub recovering: bool,
}

/// A rung whose queue grew where a higher one had kept up with demand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueSuspect {
    pub rung: usize,
    /// The higher rung that kept up, measured again.
    pub reference: usize,
}

/// Why a rung is out of bounds.
enum Bound {
    /// The window's p99 time per token is too close to the limit, or requests wait
    /// and no higher rung is known to have served them at once.
    Plain(String),
    /// Requests wait where the `reference` rung had served them at once.
    Queue { reason: String, reference: usize },
}

impl LadderSearch {
    /// A search over `rung_count` rungs that starts at the top one, bracketing them all.
    ///
    /// # Errors
    /// When there is no rung.
    pub fn new(gpu: u32, rung_count: usize, config: &LadderConfig) -> Result<LadderSearch, String> {
        let Some(top) = rung_count.checked_sub(1) else {
            return Err(format!("gpu {gpu}: no setting to search"));
        };
        Ok(LadderSearch {
            gpu,
            rungs: vec![ArmRecord::default(); rung_count],
            current: top,
            lo: 0,
            hi: top,
            incumbent: None,
            windows_at_incumbent: 0,
            recheck_direction: -1,
            floor: None,
            ceiling: None,
            window: LadderWindow::default(),
            noise: Noise::new(config.noise_cv),
            shift: ShiftDetector::default(),
            mismatch_ticks: 0,
            raised: false,
            queue_suspect: None,
            recovering: false,
            serves_prompts: false,
        })
    }

    pub fn top(&self) -> usize {
        self.rungs.len().saturating_sub(1)
    }

    /// Takes one tick, observed at rung `in_force`, and returns the rung to ask for.
    pub fn observe(
        &mut self,
        observation: &Observation,
        in_force: usize,
        objective: &Objective,
        config: &LadderConfig,
    ) -> usize {
        let in_force = in_force.min(self.top());
        if let Some(breach) = objective_breach(observation, objective) {
            if !(observation.settling && self.raised) {
                let overshoot = tpot_overshoot(observation, objective);
                self.raise_for_objective(in_force, overshoot, &breach, config);
            }
            return self.current;
        }
        if !observation.settling {
            self.raised = false;
        }
        if in_force != self.current {
            self.mismatch_ticks += 1;
            if self.mismatch_ticks <= MISMATCH_TICKS {
                return self.current;
            }
            debug!(
                "gpu {}: rung {in_force} is in force, not {}; searching from it",
                self.gpu, self.current
            );
            let held_lower = in_force < self.current;
            self.current = in_force;
            self.window = LadderWindow::default();
            if held_lower {
                self.hold_at(in_force, config);
            }
        }
        self.mismatch_ticks = 0;
        let Some(figures) = TickFigures::of(observation) else {
            return self.current;
        };
        let rule = ShiftRule {
            factor: config.shift_factor,
            ticks: config.shift_ticks,
            queue_min: config.queue_min,
            min_record_ticks: config.min_window_ticks,
        };
        // Only with prompts: a decoding sequence holds its slot from its first step, so
        // without them a rung too slow shows in the queue (and the TPOT) soon enough, and
        // long outputs make the tokens made lag the tokens asked for after every step
        // down.
        let prefilling = observation
            .requests
            .as_ref()
            .is_some_and(|r| r.prefill_tokens > 0);
        self.serves_prompts |= prefilling;
        let shift = self
            .shift
            .observe(&self.rungs[self.current], &figures, &rule);
        // After a raise for the objective the backlog the breaking rung left drains: more
        // tokens a second for a while, which is not more work. And a rung too slow for
        // its prompts makes fewer tokens while its batch fills, which is not less work.
        let spurious = match shift {
            Some(Shift::Rise) => self.recovering,
            Some(Shift::Fall) => self.window.lagging(),
            None => false,
        };
        if let Some(shift) = shift
            && !spurious
        {
            self.reexplore(shift, config);
            return self.current;
        }
        if spurious {
            self.shift = ShiftDetector::default();
        }
        if self.window.record.ticks() == 0 {
            self.window.queue_start = figures.queue_depth;
            self.window.in_flight_start = observation.active_sequences;
        }
        self.window.queue_last = figures.queue_depth;
        self.window.in_flight_last = observation.active_sequences;
        self.window.batch_size = observation.in_force.batch_size;
        if let (true, Some(demand)) = (prefilling, observation.demand.as_ref()) {
            self.window.tokens_made += observation.tokens as f64;
            self.window.tokens_demanded += demand.tokens_demanded as f64;
        }
        self.window.record.push(&figures, config.memory_ticks);
        // An unknown p99 (NaN) is left out of the window's latency (the push skips it);
        // the tick still counts for tokens per joule.
        self.window
            .tpot_p99_ms
            .push(figures.tpot_p99_ms, config.memory_ticks);
        let ttft_ms = observation
            .requests
            .as_ref()
            .and_then(|r| r.ttft_p99_ms)
            .unwrap_or(f64::NAN);
        self.window.ttft_p99_ms.push(ttft_ms, config.memory_ticks);
        self.rungs[self.current].push(&figures, config.memory_ticks);
        self.judge(objective, config);
        self.current
    }

    /// A breach predicted before it shows (see [`crate::serving`]: the prompt tokens
    /// waiting, at the prefill rate measured, will reach their first token late) is
    /// answered as a measured one: a floor at `in_force` and a move up, by `overshoot`
    /// (the predicted ratio to the bound). Ignored while a raise still settles, so one
    /// backlog is not answered twice.
    pub fn raise_for_predicted_breach(
        &mut self,
        in_force: usize,
        overshoot: f64,
        reason: &str,
        config: &LadderConfig,
    ) {
        if self.raised || in_force >= self.top() {
            return;
        }
        let overshoot = if overshoot.is_finite() {
            overshoot
        } else {
            2.0
        };
        self.raise_for_objective(in_force, overshoot, reason, config);
    }

    /// Rules out the rung the search now asks for, which a prediction says would break a
    /// bound, as if its window had gone out of bounds: it becomes a floor and the search
    /// moves above it. Nothing happens where the search asks for the top rung.
    pub fn rule_out_current(&mut self, reason: &str, config: &LadderConfig) {
        if self.current >= self.top() {
            return;
        }
        debug!(
            "gpu {}: rung {} is ruled out: {reason}",
            self.gpu, self.current
        );
        self.window = LadderWindow::default();
        self.after_out_of_bounds(config);
    }

    /// Settles on `rung` at once, where a model predicts it keeps the objective with room
    /// (a descent that the settled search would otherwise make one probe a rung at a
    /// time): never below a floor, never above a ceiling; its neighbours are probed from
    /// there as from any settled rung. Returns the rung settled on.
    pub fn settle_at(&mut self, rung: usize) -> usize {
        let rung = rung.clamp(self.lowest_allowed(), self.highest_allowed());
        self.resettle(rung);
        rung
    }

    /// Drops every record and brackets again: below the rung in force after a fall in
    /// load, above it after a rise.
    pub fn reexplore(&mut self, shift: Shift, config: &LadderConfig) {
        info!(
            "gpu {}: the workload shifted ({}); searching again",
            self.gpu,
            match shift {
                Shift::Rise => "more work",
                Shift::Fall => "less work",
            }
        );
        self.rungs.fill(ArmRecord::default());
        // A rung that broke the objective under less work breaks it under more: after a
        // rise its floor stands (until its hold runs out). With prompts it stands after a
        // fall too: a fall read from the tokens made is as often a rung that lagged its
        // prompts. Without them a fall is a fall, and the rungs under the floor may keep
        // up again.
        if shift == Shift::Fall && !self.serves_prompts {
            self.floor = None;
        }
        self.shift = ShiftDetector::default();
        self.queue_suspect = None;
        let (lo, hi) = match shift {
            Shift::Rise => (0, self.top()),
            Shift::Fall => (0, self.current),
        };
        self.start_bracket(lo, hi, config);
    }

    /// Searches `[lo, hi]` afresh (records are kept), moving to its first point.
    fn start_bracket(&mut self, lo: usize, hi: usize, config: &LadderConfig) {
        self.incumbent = None;
        self.windows_at_incumbent = 0;
        self.lo = lo.max(self.lowest_allowed()).min(self.highest_allowed());
        self.hi = hi.min(self.highest_allowed()).max(self.lo);
        self.window = LadderWindow::default();
        self.bracket_step(config);
    }

    /// Moves up at once from `in_force`, which broke the objective (by `overshoot`, the
    /// p99 time per token over its limit; 1 for a throughput breach).
    fn raise_for_objective(
        &mut self,
        in_force: usize,
        overshoot: f64,
        breach: &str,
        config: &LadderConfig,
    ) {
        /// A breach by more than this at the settled rung is a rise in load, not a burst.
        const LOAD_ROSE: f64 = 1.1;
        /// A breach by more than this below the settled rung may break it too: the load
        /// may be rising under the probe.
        const CLEAR_BREACH: f64 = 1.05;
        self.set_floor(in_force, config);
        // An eighth of the rest of the ladder: far enough to clear a burst or a slow rise.
        let eighth_up = self.up(in_force, ((self.top() - in_force) / 8).max(2));
        match self.incumbent {
            Some(incumbent) if incumbent > in_force => {
                self.current = if overshoot > CLEAR_BREACH {
                    incumbent.max(eighth_up)
                } else {
                    incumbent
                };
                self.recheck_direction = 1;
                self.windows_at_incumbent = 0;
                self.window = LadderWindow::default();
            }
            Some(incumbent) if incumbent == in_force && overshoot <= LOAD_ROSE => {
                // Just over, at the settled rung: a burst of arrivals, or a slow rise.
                // Step up and climb from there.
                self.resettle(eighth_up);
            }
            _ => {
                // A point of the bracket, or a clear breach at the settled rung: bracket
                // above it. A breach by over 5 % may break the bracket's top too (the load
                // may be rising), so then the whole ladder above it.
                let hi = if overshoot > CLEAR_BREACH {
                    self.top()
                } else {
                    self.hi_above(in_force)
                };
                self.start_bracket(in_force + 1, hi, config);
            }
        }
        info!(
            "gpu {}: {breach} at rung {in_force}; moving to rung {}",
            self.gpu, self.current
        );
        self.raised = true;
        self.recovering = true;
    }

    fn set_floor(&mut self, rung: usize, config: &LadderConfig) {
        let rung = match self.floor {
            Some(floor) => floor.rung.max(rung),
            None => rung,
        };
        // A floor at the top would leave nowhere to go; the top is the safe side anyway.
        if rung < self.top() {
            self.floor = Some(Floor {
                rung,
                windows_left: config.floor_hold_windows,
            });
        }
    }

    /// The host held the GPU at `rung`, below the rung asked for: search at or below it.
    fn hold_at(&mut self, rung: usize, config: &LadderConfig) {
        self.ceiling = Some(Floor {
            rung,
            windows_left: config.floor_hold_windows,
        });
        let highest = self.highest_allowed();
        match self.incumbent {
            Some(incumbent) if incumbent > highest => self.resettle(highest),
            Some(_) => {}
            None => {
                self.lo = self.lo.min(highest);
                self.hi = self.hi.min(highest).max(self.lo);
            }
        }
    }

    /// The highest rung the search for efficiency may ask for: the held rung, unless a
    /// floor for the objective lies above it (then the floor's: the objective first).
    fn highest_allowed(&self) -> usize {
        match self.ceiling {
            Some(ceiling) => ceiling.rung.max(self.lowest_allowed()),
            None => self.top(),
        }
    }

    /// The lowest rung the search may ask for.
    fn lowest_allowed(&self) -> usize {
        match self.floor {
            Some(floor) => (floor.rung + 1).min(self.top()),
            None => 0,
        }
    }

    /// Ends the current visit's window: learns its noise and counts down the floor.
    fn close_window(&mut self, config: &LadderConfig) {
        self.noise.learn(&self.window.record, config.noise_floor_cv);
        self.window = LadderWindow::default();
        for hold in [&mut self.floor, &mut self.ceiling] {
            if let Some(held) = hold {
                held.windows_left = held.windows_left.saturating_sub(1);
                if held.windows_left == 0 {
                    *hold = None;
                }
            }
        }
    }

    /// Judges the current visit when it has enough ticks, and moves on.
    fn judge(&mut self, objective: &Objective, config: &LadderConfig) {
        let ticks = self.window.record.ticks();
        // A queue that piles up fast is judged at once: every tick more is a backlog the
        // next rung must drain (and waits the objective may bound).
        let piling_up = self.window.queue_last >= 2 * config.queue_min
            && self.window.queue_last >= self.window.queue_start + config.queue_min;
        if ticks < config.min_window_ticks && !piling_up {
            return;
        }
        if let Some(suspect) = self.queue_suspect
            && suspect.reference == self.current
        {
            self.queue_suspect = None;
            let window = &self.window;
            let drained =
                window.queue_last < window.queue_start || window.queue_last < config.queue_min;
            self.close_window(config);
            if drained {
                debug!(
                    "gpu {}: the queue drained at rung {}: rung {} is too slow",
                    self.gpu, suspect.reference, suspect.rung
                );
                self.current = suspect.rung;
                self.after_out_of_bounds(config);
            } else {
                self.reexplore(Shift::Rise, config);
            }
            return;
        }
        let bound = if self.recovering {
            None
        } else {
            self.out_of_bounds(objective, config)
        };
        self.recovering = false;
        match bound {
            Some(Bound::Plain(reason)) => {
                debug!(
                    "gpu {}: rung {} is out of bounds: {reason}",
                    self.gpu, self.current
                );
                self.close_window(config);
                self.after_out_of_bounds(config);
                return;
            }
            Some(Bound::Queue { reason, reference }) => {
                debug!(
                    "gpu {}: at rung {}, {reason}; measuring rung {reference} again",
                    self.gpu, self.current
                );
                self.close_window(config);
                self.queue_suspect = Some(QueueSuspect {
                    rung: self.current,
                    reference,
                });
                self.current = reference;
                return;
            }
            None => {}
        }
        if let Some(limit_ms) = objective.tpot_p99_limit_ms
            && self.window.latency(limit_ms, config.tpot_margin) == WindowLatency::Unknown
        {
            // No tick of this visit told its latency: a verdict on tokens per joule alone
            // could move down past the limit unseen. Keep measuring here until one tells.
            return;
        }
        match self.incumbent {
            Some(incumbent) if incumbent == self.current => {
                self.close_window(config);
                self.windows_at_incumbent += 1;
                if self.windows_at_incumbent >= config.recheck_windows {
                    self.windows_at_incumbent = 0;
                    self.probe_neighbour(incumbent);
                }
            }
            Some(incumbent) => {
                let verdict = compare_arms(
                    &self.rungs[self.current],
                    &self.rungs[incumbent],
                    &self.noise,
                    config.z,
                );
                if verdict == Verdict::Tie && ticks < config.max_window_ticks {
                    return;
                }
                // While both keep up with demand, a lower rung within bounds costs no more
                // power (the tokens are the demand's): a tie goes to it, so the search
                // walks down to the edge of the bounds instead of stopping where one
                // rung's saving drowns in the noise.
                let verdict = if verdict == Verdict::Tie
                    && self.current < incumbent
                    && self.rungs[self.current].is_demand_limited()
                    && self.rungs[incumbent].is_demand_limited()
                {
                    Verdict::Better
                } else {
                    verdict
                };
                self.close_window(config);
                debug!(
                    "gpu {}: neighbour rung {} vs settled rung {incumbent}: {verdict:?}",
                    self.gpu, self.current
                );
                if verdict == Verdict::Better {
                    // Keep going that way at once: the best setting has moved.
                    self.incumbent = Some(self.current);
                    self.probe_neighbour(self.current);
                } else {
                    self.recheck_direction = -self.recheck_direction;
                    self.current = incumbent;
                }
            }
            None => {
                let (low, high) = self.points();
                if self.current == low || self.current == high {
                    let other = if self.current == low { high } else { low };
                    if self.rungs[other].ticks() >= config.min_window_ticks {
                        let verdict = compare_arms(
                            &self.rungs[low],
                            &self.rungs[high],
                            &self.noise,
                            config.z,
                        );
                        if verdict == Verdict::Tie && ticks < config.max_window_ticks {
                            return;
                        }
                    }
                }
                self.close_window(config);
                self.bracket_step(config);
            }
        }
    }

    /// Probes the settled rung's neighbour on the side of `recheck_direction`.
    fn probe_neighbour(&mut self, incumbent: usize) {
        let lowest = self.lowest_allowed();
        let top = self.highest_allowed();
        let toward = |direction: i32| {
            if direction > 0 {
                (incumbent + 1).min(top)
            } else {
                incumbent.saturating_sub(1).max(lowest)
            }
        };
        let mut next = toward(self.recheck_direction);
        if next == incumbent {
            self.recheck_direction = -self.recheck_direction;
            next = toward(self.recheck_direction);
        }
        self.current = next;
    }

    /// The two rungs at the golden ratio inside the bracket, lower first. A rung next to
    /// one with a record stands in for it, so a shrinking bracket reuses what it measured.
    fn points(&self) -> (usize, usize) {
        const GOLDEN: f64 = 0.618_033_988_749_895;
        let span = (self.hi - self.lo) as f64;
        let snap = |point: usize| -> usize {
            if self.rungs[point].ticks() > 0 {
                return point;
            }
            [point.saturating_sub(1), point + 1]
                .into_iter()
                .filter(|&near| near > self.lo && near < self.hi)
                .find(|&near| self.rungs[near].ticks() > 0)
                .unwrap_or(point)
        };
        let low = snap(self.lo + ((1.0 - GOLDEN) * span).round() as usize);
        let high = snap(self.lo + (GOLDEN * span).round() as usize);
        if low < high {
            (low, high)
        } else {
            (low, (low + 1).min(self.hi))
        }
    }

    /// Moves the bracket on from the records it has, as far as they allow, then asks for
    /// the next rung to measure; settles when the bracket has closed.
    fn bracket_step(&mut self, config: &LadderConfig) {
        for _ in 0..MOVES_PER_TICK {
            if self.hi - self.lo < 3 {
                self.settle();
                return;
            }
            let (low, high) = self.points();
            // The upper point first: the safe side.
            for point in [high, low] {
                if self.rungs[point].ticks() < config.min_window_ticks {
                    self.current = point;
                    return;
                }
            }
            let verdict = compare_arms(&self.rungs[low], &self.rungs[high], &self.noise, config.z);
            debug!(
                "gpu {}: bracket {}-{}: rung {low} vs rung {high}: {verdict:?}",
                self.gpu, self.lo, self.hi
            );
            // Within the noise, the point estimates decide, as in a plain golden-section
            // search: wrong only when the two are close, which costs little.
            let lower_better = match verdict {
                Verdict::Better => true,
                Verdict::Worse => false,
                Verdict::Tie => better_estimate(&self.rungs[low], &self.rungs[high]),
            };
            let (lo, hi) = if lower_better {
                (self.lo, high)
            } else {
                (low, self.hi)
            };
            if (lo, hi) == (self.lo, self.hi) {
                self.settle();
                return;
            }
            (self.lo, self.hi) = (lo, hi);
        }
    }

    /// Settles on the best measured rung of the bracket (the highest if none was).
    fn settle(&mut self) {
        let mut best = self.hi;
        for rung in self.lo..=self.hi {
            if self.rungs[rung].ticks() == 0 {
                continue;
            }
            if self.rungs[best].ticks() == 0
                || better_estimate(&self.rungs[rung], &self.rungs[best])
            {
                best = rung;
            }
        }
        debug!(
            "gpu {}: bracket {}-{} closed; settled at rung {best}",
            self.gpu, self.lo, self.hi
        );
        self.incumbent = Some(best);
        self.windows_at_incumbent = 0;
        self.current = best;
    }

    fn out_of_bounds(&self, objective: &Objective, config: &LadderConfig) -> Option<Bound> {
        let window = &self.window;
        if let Some(limit_ms) = objective.tpot_p99_limit_ms
            && let WindowLatency::Near(mean_ms) = window.latency(limit_ms, config.tpot_margin)
        {
            return Some(Bound::Plain(format!(
                "p99 time per token {mean_ms:.2} ms is within {:.0} % of the limit",
                config.tpot_margin * 100.0
            )));
        }
        // Time to first token: a prompt's chunks run at the rung's clock, and a window's
        // TTFT p99 is set by its longest prompt, so it swings from tick to tick. A rung
        // whose ticks reach near the limit two deviations above their mean breaks it on
        // the windows that hold a long prompt.
        if let Some(limit_ms) = first_token_bound(objective) {
            let ttft = &window.ttft_p99_ms;
            let spread = ttft.variance().map_or(0.0, f64::sqrt);
            let high = ttft.mean + 2.0 * spread;
            if ttft.count > 0 && high.is_finite() && high > limit_ms * (1.0 - config.tpot_margin) {
                return Some(Bound::Plain(format!(
                    "p99 time to first token reaches {high:.0} ms (mean + 2 sd), within {:.0} % of the limit",
                    config.tpot_margin * 100.0
                )));
            }
        }
        // Falling behind before the queue shows it: the batch takes the arrivals in, and
        // a rung too slow for them (with prompts, too slow to prefill them) fills it.
        if let Some(reason) = window.falling_behind(config.queue_min, window.batch_size)
            && self.current < self.top()
        {
            return Some(Bound::Plain(reason));
        }
        // A growing queue rules a rung out only where a higher rung kept up with demand:
        // when every setting leaves requests waiting (demand beyond the GPU), the queue
        // cannot tell settings apart and tokens per joule decides.
        let queue_min = f64::from(config.queue_min);
        let top = &self.rungs[self.top()];
        let beyond_the_gpu = top.ticks() >= config.min_window_ticks
            && top.queue_depth.mean >= queue_min
            && !top.is_demand_limited();
        if self.current == self.top() || beyond_the_gpu {
            // Nowhere faster to go, or requests wait even at the top: demand beyond the
            // GPU, where the queue cannot tell settings apart and tokens per joule decides.
            return None;
        }
        let Waiting { mean, last, growth } =
            window.requests_waiting(config.queue_min, config.queue_growth)?;
        let reason = format!(
            "{mean:.0} requests waited on average, {last} at the end ({growth:+.1} a tick)"
        );
        let reference = (self.current + 1..self.rungs.len())
            .find(|&rung| self.rungs[rung].ticks() >= config.min_window_ticks)
            .filter(|&rung| self.rungs[rung].queue_depth.mean < queue_min / 2.0);
        Some(match reference {
            Some(reference) => Bound::Queue { reason, reference },
            None => Bound::Plain(reason),
        })
    }

    /// The top of the bracket to search above `rung`, which went out of bounds or broke
    /// the objective: while bracketing, the bracket's top still holds; once settled
    /// (the load rose under the settled rung), the whole ladder above it.
    fn hi_above(&self, rung: usize) -> usize {
        if self.incumbent.is_none() && self.hi > rung {
            self.hi
        } else {
            self.top()
        }
    }

    /// Makes the current rung a floor and moves above it.
    fn after_out_of_bounds(&mut self, config: &LadderConfig) {
        let rung = self.current;
        self.set_floor(rung, config);
        match self.incumbent {
            Some(incumbent) if incumbent > rung => {
                self.current = incumbent;
                self.recheck_direction = 1;
                self.windows_at_incumbent = 0;
            }
            // The settled rung itself, only just out of bounds (the objective holds):
            // the rung above.
            Some(incumbent) if incumbent == rung => self.resettle(self.up(rung, 1)),
            _ => {
                // A point of the bracket: search above it.
                let hi = self.hi_above(rung);
                self.start_bracket(rung + 1, hi, config);
            }
        }
    }

    /// Settles on `rung` without measuring it first; its neighbours above are probed
    /// first.
    fn resettle(&mut self, rung: usize) {
        self.incumbent = Some(rung);
        self.current = rung;
        self.windows_at_incumbent = 0;
        self.recheck_direction = 1;
        self.window = LadderWindow::default();
    }

    fn up(&self, from: usize, rungs: usize) -> usize {
        from.saturating_add(rungs).min(self.top())
    }
}

/// The bound a rung's time to first token is held to: the objective's TTFT limit, and
/// with prompts its queue-wait limit too, whichever is lower. A request whose prompt
/// waits in the batch for its chunks waits as surely as one in the queue: a rung too slow
/// for the prompts fills the batch with them and shows no queue until the batch is full,
/// and then a backlog no rung drains quickly. (A policy may narrow the objective.)
pub fn first_token_bound(objective: &Objective) -> Option<f64> {
    match (
        objective.ttft_p99_limit_ms,
        objective.queue_wait_p99_limit_ms,
    ) {
        (Some(ttft), Some(wait)) => Some(ttft.min(wait)),
        (ttft, wait) => ttft.or(wait),
    }
}

/// How far `observation`'s p99 time per token (or time to first token, whichever is
/// further) is over the objective's limit (its ratio to the limit), for a tick that
/// broke the objective: 1 without a limit, or when the tick's p99 is unknown (NaN: the
/// breach was on throughput), never NaN.
pub fn tpot_overshoot(observation: &Observation, objective: &Objective) -> f64 {
    let tpot = match objective.tpot_p99_limit_ms {
        Some(limit_ms) if observation.tpot_p99_ms.is_finite() => observation.tpot_p99_ms / limit_ms,
        _ => 1.0,
    };
    // With prompts, a TTFT over its limit by more says more about the rung.
    let ttft = match (
        objective.ttft_p99_limit_ms,
        observation.requests.as_ref().and_then(|r| r.ttft_p99_ms),
    ) {
        (Some(limit_ms), Some(ttft_ms)) if ttft_ms.is_finite() && limit_ms > 0.0 => {
            ttft_ms / limit_ms
        }
        _ => 1.0,
    };
    tpot.max(ttft)
}

/// Whether `candidate`'s point estimate beats `incumbent`'s, on the figure of their regime.
fn better_estimate(candidate: &ArmRecord, incumbent: &ArmRecord) -> bool {
    if candidate.is_demand_limited() && incumbent.is_demand_limited() {
        candidate.inverse_power.mean > incumbent.inverse_power.mean
    } else {
        candidate.efficiency.mean > incumbent.efficiency.mean
    }
}

#[cfg(test)]
#[path = "ladder_tests.rs"]
mod tests;
