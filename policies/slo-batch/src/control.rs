//! The control of one GPU: the batch size held at the latency limit by the fitted line,
//! and the SM clock lowered while the demand allows.
//!
//! One file because it is one state machine: every step `observe` takes (the demand, a long
//! wait, a violation, the window, the clock's decision) reads and writes the same
//! `GpuControl`, and each step's rule is read against the others.

use crate::budget::BudgetControl;
use crate::config::Config;
use crate::fit::{Line, TpotFit};
use tokwatt_policy_kit::batch_guard::has_demand;
use tokwatt_policy_kit::clocks::clock_ladder;
use tokwatt_policy_sdk::{DeviceFacts, Knobs, Observation, Settings, debug, info};

/// The highest elasticity learnt: beyond it the GPU is past its knee anyway.
const MAX_ELASTICITY: f64 = 6.0;
/// The share of the batch the sequences decoding may be predicted to fill after a step
/// down.
const BATCH_FILL: f64 = 0.8;
/// Where the queue empties between bursts, the batch may reach this fraction of the
/// latency limit: per-tick p99 jitters by ~3 % at a fixed setting on the simulator.
const BURST_HEADROOM: f64 = 0.95;
/// The clock rise on a surge, as a fraction.
const SURGE_STEP_UP: f64 = 0.5;
/// A violation this soon (in windows) after lowering the clock is blamed on the clock.
const BLAME_WINDOWS: u32 = 2;
/// The margin kept under the limit, in units of the p99's learnt scatter around the line.
/// The line follows part of the noise (it is fitted to the last dozen ticks), so the
/// scatter reads low: 3 of its standard deviations kept a ±15 % p99 over the limit on
/// under 1 % of ticks in the tests (2.5: 2.3 %, none: 4.5 %).
const SCATTER_MARGIN: f64 = 3.0;
/// The p99's relative scatter a GPU starts from: ±3 % per tick at a fixed setting on the
/// simulator.
const START_SCATTER: f64 = 0.03;
/// Weight of the newest tick in the scatter's moving average.
const SCATTER_WEIGHT: f64 = 0.05;
/// Without a fitted line, requests waiting and the p99 under this share of the ceiling,
/// the batch probes a step up (a quarter, at least one sequence).
const PROBE_BELOW: f64 = 0.8;
/// The p99 queue wait is kept under this share of its bound: a queue grows by a tick's
/// arrivals each tick, so the clock answers well before the bound, not at it.
const QUEUE_WAIT_HEADROOM: f64 = 0.5;
/// The clock steps down only after a window whose queue waits stayed under this share
/// of the bound.
const QUEUE_WAIT_CALM: f64 = 0.25;
/// Weight of the newest tick in the demand's moving average: arrivals are Poisson, so
/// one tick's count strays by its square root.
const DEMAND_WEIGHT: f64 = 0.5;
/// The demand outgrows the batch when it needs this many times the sequences the batch
/// holds: a batch full at the latency limit in steady state needs about as many as it
/// holds, give or take the arrivals' scatter (about ±12 % a tick after averaging).
const OUTGROWN_MARGIN: f64 = 1.25;
/// ... and at least this many sequences more: over a batch of 4 at light load, one
/// arrival of a long request reads as 1.25 batches.
const OUTGROWN_MIN_SEQUENCES: f64 = 8.0;
/// The longest a step down waits for the decoding set to settle, seconds.
const MAX_SETTLE_S: f64 = 120.0;

/// A clock the search stays at or above for a while.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Floor {
    /// The highest ladder index (the lowest clock) allowed.
    pub index: usize,
    pub windows_left: u32,
}

/// The clock step last taken downwards, to judge it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct LastDown {
    pub from_index: usize,
    /// The mean p99 of the window before the step; `None` when no tick of it told one
    /// (possible only without a latency limit).
    pub p99_before_ms: Option<f64>,
    pub windows_since: u32,
}

/// Settled, busy ticks at one clock and one batch size.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct Window {
    pub ticks: u32,
    /// The ticks that told their p99 time per token, and its sum over them: a tick
    /// whose p99 is unknown (NaN) counts for the queue and the tokens, not the latency.
    pub p99_ticks: u32,
    pub p99_sum_ms: f64,
    pub tokens_per_s_sum: f64,
    pub queue_first: u32,
    pub queue_last: u32,
    pub queue_min: u32,
    pub queue_max: u32,
    /// The most sequences decoding at the end of a tick.
    pub active_max: u32,
    /// The longest p99 queue wait a tick reported (0 where none did).
    pub queue_wait_max_ms: f64,
    /// Requests turned away over the window.
    pub turned_away: u64,
    /// Over the ticks that reported their demand: the sequences decoding (summed) and
    /// the requests completed, and how many ticks and seconds they span.
    pub demand_ticks: u32,
    pub demand_seconds: f64,
    pub active_sum: f64,
    pub completed: u64,
}

impl Window {
    fn add(&mut self, observation: &Observation) {
        let queue = observation.queue_depth;
        if self.ticks == 0 {
            *self = Window {
                queue_first: queue,
                queue_min: queue,
                ..Window::default()
            };
        }
        self.ticks += 1;
        let p99_ms = observation.tpot_p99_ms;
        if p99_ms.is_finite() {
            self.p99_ticks += 1;
            self.p99_sum_ms += p99_ms;
        }
        self.tokens_per_s_sum += observation.tokens_per_s;
        self.queue_last = queue;
        self.queue_min = self.queue_min.min(queue);
        self.queue_max = self.queue_max.max(queue);
        self.active_max = self.active_max.max(observation.active_sequences);
        if let Some(demand) = &observation.demand {
            self.demand_ticks += 1;
            self.demand_seconds += observation.interval_s.max(0.0);
            self.active_sum += f64::from(observation.active_sequences);
            self.completed += demand.requests_completed;
            self.turned_away += demand.requests_turned_away;
            if let Some(wait_ms) = demand.queue_wait_p99_ms.filter(|wait| wait.is_finite()) {
                self.queue_wait_max_ms = self.queue_wait_max_ms.max(wait_ms);
            }
        }
    }

    /// The mean p99 over the ticks that told one; `None` when none did.
    fn mean_p99_ms(&self) -> Option<f64> {
        (self.p99_ticks > 0).then(|| self.p99_sum_ms / f64::from(self.p99_ticks))
    }

    /// How long a request spends decoding, by Little's law (sequences decoding over
    /// requests completed per second); `None` where the demand is not reported or no
    /// request completed.
    fn decode_time_s(&self) -> Option<f64> {
        if self.demand_ticks == 0 || self.completed == 0 || self.demand_seconds <= 0.0 {
            return None;
        }
        let active = self.active_sum / f64::from(self.demand_ticks);
        let completed_per_s = self.completed as f64 / self.demand_seconds;
        Some(active / completed_per_s)
    }

    fn tokens_per_s(&self) -> f64 {
        self.tokens_per_s_sum / f64::from(self.ticks.max(1))
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GpuControl {
    pub gpu: u32,
    pub batch_max: u32,
    /// Whether the batch size is granted: without it, only the clock moves.
    pub batch_knob: bool,
    /// Supported clocks, highest first; empty when the clock is not granted.
    pub clocks: Vec<u32>,
    pub batch_target: u32,
    pub clock_index: usize,
    pub fit: TpotFit,
    pub floor: Option<Floor>,
    pub elasticity: f64,
    pub reference_tokens_per_s: Option<f64>,
    pub window: Window,
    pub last_down: Option<LastDown>,
    /// Windows in a row in which the queue did not drain.
    pub backlog_windows: u32,
    /// Whether the queue emptied during the last window.
    pub queue_empties: bool,
    /// Moving average of the output tokens the arrivals ask for per second, where the
    /// workload reports its demand.
    pub demand_tokens_per_s: Option<f64>,
    /// Whether the demand is being served past the latency limit (see `observe`).
    pub serving_first: bool,
    /// Time since the clock last moved, settling ticks included.
    pub since_clock_move_s: f64,
    /// Moving average of the output tokens a request asks for, where the workload
    /// reports its demand.
    pub output_tokens: Option<f64>,
    /// Moving average of the squared relative gap between the p99 and the line's
    /// prediction: how far one tick's p99 strays. Short requests and noisy boards stray
    /// more than the shipped headroom allows for, so the target keeps its margin in these
    /// units too.
    pub p99_scatter_sq: f64,
    /// The token budget, where granted and the workload has one (`budget.rs`).
    pub budget: Option<BudgetControl>,
}

/// What the objective asks of one GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Limits {
    /// The p99 time per token limit; `None` when the objective sets none (a throughput
    /// objective): the batch then grows to the largest and only the queue bounds the clock.
    pub tpot_p99_ms: Option<f64>,
    pub min_tokens_per_s: Option<f64>,
    /// The p99 wait for a batch slot, where the objective bounds it (checked on the
    /// ticks whose workload reports its demand).
    pub queue_wait_p99_ms: Option<f64>,
    /// The p99 time to first token, where the objective bounds it: the token budget
    /// trades it against the time per token.
    pub ttft_p99_ms: Option<f64>,
}

/// How long requests wait for a batch slot, as one tick's demand tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    /// Under the headroom, or nothing told (a closed-loop workload).
    Short,
    /// Over [`QUEUE_WAIT_HEADROOM`] of the bound: answer before it is reached.
    Long,
    /// Over the bound, or requests turned away: the objective is broken now.
    Over,
}

impl Waiting {
    /// `outgrown`: the demand needs more sequences decoding at once than the batch
    /// holds (see [`GpuControl::note_demand`]); `output_tokens`: the requests' mean
    /// output, where learnt.
    fn of(
        observation: &Observation,
        limits: Limits,
        outgrown: bool,
        output_tokens: Option<f64>,
    ) -> Waiting {
        let Some(demand) = &observation.demand else {
            return Waiting::Short;
        };
        if demand.requests_turned_away > 0 {
            return Waiting::Over;
        }
        let Some(limit) = limits.queue_wait_p99_ms else {
            return Waiting::Short;
        };
        let wait_ms = demand
            .queue_wait_p99_ms
            .filter(|wait| wait.is_finite())
            .unwrap_or(0.0)
            .max(Self::queued_wait_ms(observation, output_tokens));
        if wait_ms > limit {
            Waiting::Over
        } else if wait_ms > limit * QUEUE_WAIT_HEADROOM || outgrown {
            Waiting::Long
        } else {
            Waiting::Short
        }
    }

    /// The wait ahead of the last request queued behind a full batch. The reported wait
    /// counts only requests that got a slot, so it lags: behind a full batch a slot frees
    /// only as a decoding request finishes, and with 51 s decodes the queue grew for 3
    /// ticks before the first of it was seated and reported 2 to 6 s. A slot frees each
    /// time a sequence ends, which at the tick's generation rate is every `output tokens
    /// ÷ tokens/s` seconds, so the last of the queue waits that times its place. (The
    /// tick's own completions, a handful at small batches, read 0 on many ticks: an
    /// unbounded wait that sent the clock to the top for one queued request.)
    fn queued_wait_ms(observation: &Observation, output_tokens: Option<f64>) -> f64 {
        let full = observation.active_sequences >= observation.in_force.batch_size;
        let (Some(output_tokens), true) = (output_tokens, full && observation.queue_depth > 0)
        else {
            return 0.0;
        };
        if observation.tokens_per_s > 0.0 {
            f64::from(observation.queue_depth) * output_tokens / observation.tokens_per_s * 1000.0
        } else {
            f64::INFINITY
        }
    }
}

impl GpuControl {
    pub fn new(device: &DeviceFacts, knobs: Knobs, config: &Config) -> Result<GpuControl, String> {
        if device.batch_size_max == 0 {
            return Err(format!(
                "gpu {}: the host reports a largest batch size of 0; check the spec's batch \
                 size guardrails",
                device.index
            ));
        }
        Ok(GpuControl {
            gpu: device.index,
            batch_max: device.batch_size_max,
            batch_knob: knobs.contains(Knobs::BATCH_SIZE),
            clocks: if knobs.contains(Knobs::SM_CLOCK) {
                clock_ladder(device)
            } else {
                Vec::new()
            },
            batch_target: config.start_batch_size.clamp(1, device.batch_size_max),
            clock_index: 0,
            fit: TpotFit::default(),
            floor: None,
            elasticity: config.clock_elasticity,
            reference_tokens_per_s: None,
            window: Window::default(),
            last_down: None,
            backlog_windows: 0,
            queue_empties: false,
            demand_tokens_per_s: None,
            output_tokens: None,
            serving_first: false,
            // No move yet: nothing to settle.
            since_clock_move_s: MAX_SETTLE_S,
            p99_scatter_sq: START_SCATTER * START_SCATTER,
            budget: BudgetControl::new(device, knobs),
        })
    }

    /// The token budget to ask for this tick, where this GPU has one to turn (see
    /// `budget.rs`); `None` leaves it.
    pub fn steer_budget(
        &mut self,
        observation: &Observation,
        limits: Limits,
        config: &Config,
    ) -> Option<u32> {
        let target_ms = self.target_ms(limits, config);
        self.budget
            .as_mut()?
            .observe(observation, limits, target_ms, config)
    }

    /// Where the p99 is steered: `headroom` × the limit, or lower where the p99 strays
    /// more than that margin covers.
    fn target_ms(&self, limits: Limits, config: &Config) -> f64 {
        limits.tpot_p99_ms.map_or(f64::INFINITY, |limit| {
            (limit * config.headroom).min(self.under_scatter(limit, SCATTER_MARGIN))
        })
    }

    /// `limit` less `sds` standard deviations of the p99's learnt scatter.
    fn under_scatter(&self, limit: f64, sds: f64) -> f64 {
        limit / (1.0 + sds * self.p99_scatter_sq.sqrt())
    }

    fn clock(&self) -> Option<u32> {
        self.clocks.get(self.clock_index).copied()
    }

    pub fn first_settings(&self) -> Settings {
        Settings {
            power_cap_w: None,
            sm_clock_max_mhz: self.clock(),
            batch_size: self.batch_knob.then_some(self.batch_target),
            token_budget: None,
        }
    }

    /// The targets, where they are not in force yet.
    fn requests(&self, observation: &Observation) -> Settings {
        let in_force = observation.in_force;
        Settings {
            power_cap_w: None,
            sm_clock_max_mhz: self.clock().filter(|&mhz| mhz != in_force.sm_clock_max_mhz),
            batch_size: Some(self.batch_target)
                .filter(|&size| self.batch_knob && size != in_force.batch_size),
            token_budget: None,
        }
    }

    /// Takes one tick's observation of this GPU and returns its settings.
    pub fn observe(
        &mut self,
        observation: &Observation,
        limits: Limits,
        config: &Config,
    ) -> Settings {
        self.since_clock_move_s += observation.interval_s.max(0.0);
        // A long wait is answered even on a settling tick: the answer only raises the
        // clock, and a tick later the queue is a tick longer.
        let outgrown = self.note_demand(observation);
        let waiting = Waiting::of(observation, limits, outgrown, self.output_tokens);
        if waiting != Waiting::Short && self.on_long_wait(observation, waiting, config) {
            self.window = Window::default();
            return self.requests(observation);
        }
        if observation.settling || observation.tokens == 0 {
            return self.requests(observation);
        }
        if !observation.tpot_p99_ms.is_finite() {
            // Unknown latency (the engine saw no request end: the host sends NaN): no
            // point for the line, no violation and no batch move on it, but its queue and
            // tokens still tell the clock loop whether the GPU keeps up.
            self.count_in_window(observation, limits, config);
            return self.requests(observation);
        }
        let in_force_batch = observation.in_force.batch_size;
        let sequences = match observation.active_sequences {
            0 => in_force_batch,
            active => active.min(in_force_batch),
        };
        // Only a fitted line's gap is the p99's own scatter: the line through the origin
        // is off by its construction.
        if let Some(line) = self.fit.line().filter(|line| line.fitted) {
            let predicted = line.a_ms + line.b_ms * f64::from(sequences);
            if predicted > 0.0 {
                let gap = observation.tpot_p99_ms / predicted - 1.0;
                self.p99_scatter_sq += SCATTER_WEIGHT * (gap * gap - self.p99_scatter_sq);
            }
        }
        self.fit.add(sequences, observation.tpot_p99_ms);
        let target_ms = self.target_ms(limits, config);
        let line = self.fit.line();

        // Requests turned away, or waiting past their bound, at the top clock: the tick
        // breaks the objective whatever the latency, and only a larger batch serves more
        // of the demand (an overload, judged on demand served). The latency limit then
        // yields to the demand until the waits come back under their bound; a batch held
        // at it turned away 10 % of an overload's demand that a larger one served.
        // It holds until the backlog fits in one batch: a latency limit enforced the tick
        // the turning away stopped cut the batch, and the queue refilled and turned
        // demand away again (an overload under a TPOT limit alone served 1.8 points
        // less than the oracle so).
        if waiting == Waiting::Over && self.clock_index == 0 {
            self.serving_first = true;
        } else if observation.queue_depth <= observation.in_force.batch_size {
            self.serving_first = false;
        }
        let serving_first = self.serving_first;
        // With prompts, a step's time follows its prefill chunk more than its decoding
        // sequences: where the token budget is turned (and can still shrink), it answers a
        // time per token over its bound (`budget.rs`), and the batch follows the demand. A
        // batch cut there queues prompts behind a batch that was not the cause (on the
        // simulated H100: batch 1-8 with 60-85 requests queued, first tokens 20 s late).
        let budget_answers = self
            .budget
            .as_ref()
            .is_some_and(|budget| budget.answers(observation, limits));
        if let Some(limit_ms) = limits.tpot_p99_ms
            && observation.tpot_p99_ms > limit_ms
            && !serving_first
            && !budget_answers
        {
            self.on_violation(observation, sequences, line, target_ms, limit_ms, config);
            self.window = Window::default();
            return self.requests(observation);
        }

        if self.batch_knob
            && let Some(line) = line
        {
            // Where the queue empties between bursts, the batch is a ceiling that only a
            // burst reaches, briefly: it may sit closer to the limit, so bursts decode
            // rather than queue. Where requests always wait, the batch is full every tick
            // and keeps the full headroom.
            let ceiling_ms = if self.queue_empties {
                limits
                    .tpot_p99_ms
                    .map_or(f64::INFINITY, |limit| {
                        (limit * BURST_HEADROOM).min(self.under_scatter(limit, SCATTER_MARGIN))
                    })
                    .max(target_ms)
            } else {
                target_ms
            };
            // A queue that has not drained for two windows at the top clock ends in
            // requests turned away, which break the objective on every tick: the batch may
            // then go up to the limit less one standard deviation of the p99's scatter,
            // breaking it only on the ticks the p99 strays that far.
            // So does a wait near its bound (or demand turned away) at the top clock.
            let pressed = self.backlog_windows >= 2 || waiting != Waiting::Short;
            let ceiling_ms = match limits.tpot_p99_ms {
                _ if serving_first => f64::INFINITY,
                Some(limit) if pressed && self.clock_index == 0 => {
                    ceiling_ms.max(self.under_scatter(limit, 1.0))
                }
                _ => ceiling_ms,
            };
            let mut wanted = batch_for(line, ceiling_ms, self.batch_max);
            // The line through the origin (every point at one batch size, so no slope yet)
            // overstates a larger batch's time many times over where the weights' read
            // dominates the step: at batch 1 with a 5.6 ms step under a 9.6 ms limit it
            // held the batch at 1 while 70 requests queued. With requests waiting and the
            // latency well under the ceiling, probe a step up: that gives the fit its
            // spread, and a violation cuts back.
            // So, at the top clock, does a backlog or a long wait: the batch is the only
            // lever left, and a line fitted over a narrow spread of batches can overstate
            // the slope, so it probes a step up while the p99 is under the ceiling itself.
            // (A 14B-class shape under a TPOT limit and a throughput floor, bursty: 1.1
            // points less of the demand served than the oracle without it, 0.3 with.)
            let pressed_at_top = pressed && self.clock_index == 0;
            let probe_below = if pressed_at_top { 1.0 } else { PROBE_BELOW };
            if (!line.fitted || pressed_at_top)
                && has_demand(observation)
                && wanted <= in_force_batch
                && observation.tpot_p99_ms < probe_below * ceiling_ms
            {
                wanted = in_force_batch
                    .saturating_add((in_force_batch / 4).max(1))
                    .min(self.batch_max);
            }
            // Where the token budget answers the time per token, a line over batch sizes
            // can hold the batch under the demand while the p99 has room (on the
            // simulated H100, batch 4 with 100 requests queued and the p99 at half its
            // bound): a full batch with requests queued behind it and the p99 under the
            // ceiling grows toward the queue, at most `max_batch_growth` a move.
            if budget_answers
                && observation.queue_depth > 0
                && sequences >= in_force_batch
                && observation.tpot_p99_ms < ceiling_ms
            {
                wanted = wanted.max(
                    in_force_batch
                        .saturating_add(observation.queue_depth)
                        .min(self.batch_max),
                );
            }
            let before = self.batch_target;
            // Changes under 5 % are not worth a settling tick; one sequence always is
            // (it is 100 % at a batch of 1).
            let worth = |next: u32| next.abs_diff(in_force_batch) >= (in_force_batch / 20).max(1);
            if has_demand(observation) && wanted > in_force_batch {
                let most = (f64::from(in_force_batch) * config.max_batch_growth).ceil() as u32;
                let grown = wanted.min(most);
                if worth(grown) {
                    self.batch_target = grown;
                }
            } else if wanted < in_force_batch && !budget_answers {
                // (Where the budget answers the time per token, the batch is a ceiling the
                // demand fills, and trimming it to a lull's sequences queued the next
                // surge behind it.)
                // Never below the sequences decoding (that would pause them), but no
                // higher than the latency allows: a burst then waits instead of
                // breaking the limit.
                // Only a fitted line is trusted this far: the fallback through the origin
                // overstates a larger batch's time many times over at light load.
                let trimmed = wanted.max(sequences);
                if line.fitted && trimmed < in_force_batch && worth(trimmed) {
                    self.batch_target = trimmed;
                }
            }
            if self.batch_target != before {
                debug!(
                    "gpu {}: p99 {:.2} ms at {sequences} sequences, line {:.2} + {:.4}/seq: \
                     batch {before} -> {}",
                    self.gpu, observation.tpot_p99_ms, line.a_ms, line.b_ms, self.batch_target
                );
                // Clock windows hold one batch size.
                self.window = Window::default();
                return self.requests(observation);
            }
        }

        self.count_in_window(observation, limits, config);
        self.requests(observation)
    }

    /// Adds a tick to the clock window, and decides the clock when the window is full.
    fn count_in_window(&mut self, observation: &Observation, limits: Limits, config: &Config) {
        self.window.add(observation);
        if self.window.ticks >= config.window_ticks {
            self.decide_clock(
                self.fit.line(),
                self.target_ms(limits, config),
                limits,
                config,
            );
            self.window = Window::default();
        }
    }

    fn on_violation(
        &mut self,
        observation: &Observation,
        sequences: u32,
        line: Option<Line>,
        target_ms: f64,
        limit_ms: f64,
        config: &Config,
    ) {
        let p99 = observation.tpot_p99_ms;
        // Far above what the line expects at these sequences: the workload changed under
        // it (a longer context, a bigger model); the older points mislead.
        if let Some(line) = line
            && p99 > 1.1 * (line.a_ms + line.b_ms * f64::from(sequences))
        {
            self.fit.keep_newest();
        }
        let line = self.fit.line();
        let mut cut = false;
        if self.batch_knob {
            // At least a tenth below the sequences decoding, whatever the line says.
            let by_line = line.map_or(u32::MAX, |line| batch_for(line, target_ms, self.batch_max));
            let below = ((f64::from(sequences) * 0.9).floor() as u32).max(1);
            let next = by_line.min(below).min(observation.in_force.batch_size);
            cut = next < observation.in_force.batch_size;
            self.batch_target = next;
        }
        let blame_clock = self
            .last_down
            .filter(|down| down.windows_since <= BLAME_WINDOWS);
        if let Some(down) = blame_clock {
            self.raise_clock_to(down.from_index, config);
            self.elasticity = (self.elasticity * 1.5).min(MAX_ELASTICITY);
        } else if !cut && self.clock_index > 0 {
            let up = self.index_above(config.clock_step_up);
            self.raise_clock_to(up, config);
        }
        info!(
            "gpu {}: p99 time per token {p99:.2} ms over the {limit_ms} ms limit at {sequences} \
             sequences; batch {}, clock {:?} MHz",
            self.gpu,
            self.batch_target,
            self.clock()
        );
    }

    /// Takes the tick's demand into its moving average, and says whether it needs more
    /// sequences decoding at once than the batch holds at this clock. By Little's law
    /// the sequences needed are the arrivals per second times a request's decode time,
    /// which is its output tokens over a sequence's tokens per second:
    /// `active × demanded tokens/s ÷ generated tokens/s`. A burst shows in the arrivals
    /// at once, long before the batch fills (with 51 s decodes, it filled 15 ticks
    /// after the burst began, and answering the fill was too late: the requests seated
    /// finish at their own pace).
    fn note_demand(&mut self, observation: &Observation) -> bool {
        let Some(demand) = &observation.demand else {
            self.demand_tokens_per_s = None;
            return false;
        };
        if observation.interval_s.is_nan() || observation.interval_s <= 0.0 {
            return false;
        }
        let now = demand.tokens_demanded as f64 / observation.interval_s;
        let average = match self.demand_tokens_per_s {
            Some(before) => before + DEMAND_WEIGHT * (now - before),
            None => now,
        };
        self.demand_tokens_per_s = Some(average);
        if demand.requests_arrived > 0 {
            let output = demand.tokens_demanded as f64 / demand.requests_arrived as f64;
            self.output_tokens = Some(match self.output_tokens {
                Some(before) => before + DEMAND_WEIGHT * (output - before),
                None => output,
            });
        }
        if observation.settling || observation.tokens_per_s <= 0.0 {
            return false;
        }
        let needed = f64::from(observation.active_sequences) * average / observation.tokens_per_s;
        let batch = f64::from(observation.in_force.batch_size);
        // A few sequences over a small batch is one request's arrival, not a burst.
        needed > OUTGROWN_MARGIN * batch && needed - batch >= OUTGROWN_MIN_SEQUENCES
    }

    /// Requests wait near the bound (or are turned away): a faster clock empties the
    /// queue sooner, and a wait grows by a tick's arrivals each tick, so the answer is
    /// large: a step down just taken is undone, a wait past half the bound raises the
    /// clock by half, and one past the bound (or demand turned away) takes the top clock
    /// at once. (Stepping 5 % every other tick from a clock a quiet phase had lowered to
    /// 225 MHz left requests waiting past a 640 ms bound for 6 ticks after each rise in
    /// demand.) Returns whether the clock moved; at the top clock the batch answers
    /// instead, past its margin (see `observe`).
    fn on_long_wait(
        &mut self,
        observation: &Observation,
        waiting: Waiting,
        config: &Config,
    ) -> bool {
        if self.clock_index == 0 {
            return false;
        }
        let before = self.clock();
        let undo = self
            .last_down
            .filter(|down| down.windows_since <= BLAME_WINDOWS)
            .map(|down| down.from_index);
        let up = match waiting {
            Waiting::Over => 0,
            _ => self
                .index_above(SURGE_STEP_UP)
                .min(undo.unwrap_or(usize::MAX)),
        };
        self.raise_clock_to(up, config);
        let (wait_ms, turned_away) = observation.demand.as_ref().map_or((None, 0), |demand| {
            (demand.queue_wait_p99_ms, demand.requests_turned_away)
        });
        info!(
            "gpu {}: requests waited {} ms (p99), {turned_away} turned away, at {:?} MHz; \
             clock up to {:?} MHz",
            self.gpu,
            wait_ms.map_or("unknown".to_string(), |wait| format!("{wait:.0}")),
            before,
            self.clock()
        );
        true
    }

    /// Moves the clock up to ladder `index`, and keeps it a step above the clock that
    /// failed for a while.
    fn raise_clock_to(&mut self, index: usize, config: &Config) {
        let above_failed = self.index_above(config.clock_step_up);
        if index < self.clock_index {
            self.clock_index = index;
            self.since_clock_move_s = 0.0;
            // Points from the slower clock would hold the batch back: start the line
            // afresh at the new clock (its first point gives the safe fallback).
            self.fit.clear();
        }
        self.floor = Some(Floor {
            index: above_failed.max(self.clock_index),
            windows_left: config.hold_windows,
        });
        self.last_down = None;
    }

    /// The ladder index of the nearest clock at least `fraction` above the current one.
    fn index_above(&self, fraction: f64) -> usize {
        let Some(current) = self.clock() else {
            return 0;
        };
        let wanted = f64::from(current) * (1.0 + fraction);
        (0..self.clock_index)
            .rev()
            .find(|&index| f64::from(self.clocks[index]) >= wanted)
            .unwrap_or(0)
    }

    fn decide_clock(
        &mut self,
        line: Option<Line>,
        target_ms: f64,
        limits: Limits,
        config: &Config,
    ) {
        let window = self.window;
        let tokens_per_s = window.tokens_per_s();
        self.note_shift(tokens_per_s, config);
        if let Some(floor) = &mut self.floor {
            floor.windows_left = floor.windows_left.saturating_sub(1);
            if floor.windows_left == 0 {
                self.floor = None;
            }
        }
        let Some(clock) = self.clock() else {
            return;
        };
        if let Some(down) = &mut self.last_down {
            down.windows_since += 1;
            if down.windows_since == 1
                && let Some(p99_now_ms) = window.mean_p99_ms()
            {
                self.learn_elasticity(p99_now_ms, clock);
            }
        }
        let throughput_short = limits
            .min_tokens_per_s
            .is_some_and(|min| window.queue_last > 0 && tokens_per_s < min);
        // Without a p99 limit the batch takes every request it can, so a queue at all
        // means the GPU is at capacity: with no latency to protect, the queue (and the
        // wait in it, which a throughput objective bounds) is the only guard, and it is
        // kept empty. With a limit, a burst may queue behind a batch held at the limit.
        // With a queue-wait bound, the waits (and the wait predicted for a queue behind a
        // full batch) are the guard, answered tick by tick: a queue short enough to keep
        // them calm is no reason to hold the clock up. (Keeping the queue empty and the
        // batch a fifth empty held such scenarios at 0.65-0.85 of the oracle.)
        let latency_bound = limits.tpot_p99_ms.is_some();
        let queue_tolerated = latency_bound || limits.queue_wait_p99_ms.is_some();
        let draining = if queue_tolerated {
            window.queue_min == 0 || window.queue_last < window.queue_first
        } else {
            window.queue_last == 0 || window.queue_last < window.queue_first
        };
        let keeping_up = !throughput_short && draining;
        self.queue_empties = window.queue_min == 0;
        self.backlog_windows = if keeping_up {
            0
        } else {
            self.backlog_windows + 1
        };
        // A surge: a quarter batch's worth waiting and growing.
        let surge =
            window.queue_last > window.queue_first && window.queue_last >= self.batch_target / 4;
        // With a latency limit, a burst may queue behind the batch for a window and drain
        // in the next: only a second window without draining (or a surge) is a GPU that
        // does not keep up. Without a limit any queue is a wait to bound, at once.
        let persistent = !queue_tolerated || surge || self.backlog_windows >= 2;
        if !keeping_up && !persistent {
            return;
        }
        if !keeping_up {
            // The batch grows only on ticks that tell their latency: in a window where
            // none did, the clock must answer the backlog.
            let batch_can_grow = self.batch_knob
                && window.p99_ticks > 0
                && self.batch_target < self.batch_max
                && line.is_some_and(|line| {
                    // Within 5 % the batch is at the limit already.
                    f64::from(batch_for(line, target_ms, self.batch_max))
                        > f64::from(self.batch_target) * 1.05
                });
            if !batch_can_grow && self.clock_index > 0 {
                // On a surge, half as fast again at once (a few such steps reach any
                // clock), not one small step.
                let up = self.index_above(if surge {
                    SURGE_STEP_UP
                } else {
                    config.clock_step_up
                });
                info!(
                    "gpu {}: {} requests wait at {clock} MHz and the batch is at the latency \
                     limit; clock up to {} MHz",
                    self.gpu, window.queue_last, self.clocks[up]
                );
                self.raise_clock_to(up, config);
            }
            return;
        }
        let queue_free = if queue_tolerated {
            window.queue_last == 0
        } else {
            window.queue_max == 0
        };
        // A slower clock keeps requests waiting longer: only a window whose waits stayed
        // well under their bound, and that turned none away, lets it step down.
        let waits_calm = window.turned_away == 0
            && limits
                .queue_wait_p99_ms
                .is_none_or(|limit| window.queue_wait_max_ms <= limit * QUEUE_WAIT_CALM);
        if !queue_free || !waits_calm {
            return;
        }
        // After the clock moves, the sequences decoding at once change only as those
        // started at the old clock finish: the decoding set settles over about one
        // request's decode time (Little's law). A window judged before that sees the old
        // fill and steps down again (every 4 ticks, from 720 to 225 MHz in 16 s, with
        // requests taking 25 s to decode, until the batch filled and requests waited past
        // their bound; or, 3 ticks after a burst had raised the clock, back down while
        // the burst was still filling the batch).
        if let Some(decode_s) = window.decode_time_s()
            && self.since_clock_move_s < decode_s.min(MAX_SETTLE_S)
        {
            return;
        }
        // Keeping up with room: the lowest clock predicted to keep p99 under the target.
        // The window's mean p99, not its highest: with the batch at its latency limit, a
        // burst that fills it reaches the target by design, and says nothing about
        // whether a slower clock keeps up; a queue that stops draining says that, and
        // sends the clock back up.
        let mean_p99_ms = window.mean_p99_ms();
        let room = match mean_p99_ms {
            Some(mean_ms) => target_ms / mean_ms,
            // Without a latency limit the target is unbounded: latency plays no part.
            None if !latency_bound => f64::INFINITY,
            None => {
                // No tick of the window told its p99: a slower clock could break the
                // limit unseen.
                debug!(
                    "gpu {}: no tick of the window at {clock} MHz told its p99 time per \
                     token; the clock stays",
                    self.gpu
                );
                return;
            }
        };
        if room <= 1.0 {
            return;
        }
        let by_latency = f64::from(clock) / room.powf(1.0 / self.elasticity);
        let by_step = f64::from(clock) * (1.0 - config.clock_step_down);
        // A slower step keeps each request longer, so more of them decode at once
        // (Little's law), about as p99 grows: without a latency limit, stop before they
        // would fill the batch, where requests start to queue. This is what holds the
        // clock above the knee when no latency limit does.
        let fill = f64::from(window.active_max.max(1)) / f64::from(self.batch_target.max(1));
        let by_fill = if queue_tolerated {
            // The batch is held at the latency limit, or the waits bound the queue: a
            // full batch is the point, and a burst that queues behind it drains (or
            // raises the clock).
            0.0
        } else if fill >= BATCH_FILL {
            f64::INFINITY
        } else {
            f64::from(clock) / (BATCH_FILL / fill).powf(1.0 / self.elasticity)
        };
        let lowest_mhz = by_latency.max(by_step).max(by_fill);
        let lowest_index = self
            .floor
            .map_or(self.clocks.len() - 1, |floor| floor.index);
        let next = (self.clock_index + 1..=lowest_index)
            .take_while(|&index| f64::from(self.clocks[index]) >= lowest_mhz)
            .last();
        if let Some(next) = next {
            let next_mhz = self.clocks[next];
            debug!(
                "gpu {}: mean p99 {} under the {target_ms:.2} ms target with the queue \
                 empty; clock {clock} -> {next_mhz} MHz",
                self.gpu,
                mean_p99_ms.map_or("unknown".to_string(), |mean_ms| format!("{mean_ms:.2} ms"))
            );
            self.last_down = Some(LastDown {
                from_index: self.clock_index,
                p99_before_ms: mean_p99_ms,
                windows_since: 0,
            });
            self.since_clock_move_s = 0.0;
            self.fit.scale(f64::from(clock) / f64::from(next_mhz));
            self.clock_index = next;
        }
    }

    /// After a step down, how much p99 actually grew says how steep the GPU is here: a
    /// steeper answer than assumed makes the next steps smaller.
    fn learn_elasticity(&mut self, p99_now_ms: f64, clock_now: u32) {
        let Some(LastDown {
            from_index,
            p99_before_ms: Some(p99_before_ms),
            ..
        }) = self.last_down
        else {
            return;
        };
        let from = f64::from(self.clocks[from_index]);
        let ratio = from / f64::from(clock_now);
        if ratio <= 1.0 || p99_before_ms <= 0.0 || p99_now_ms <= 0.0 {
            return;
        }
        let observed = (p99_now_ms / p99_before_ms).ln() / ratio.ln();
        if observed > self.elasticity {
            self.elasticity = (observed * 1.25).min(MAX_ELASTICITY);
        }
    }

    /// A large change of tokens/s is a new workload: forget what was learnt about the
    /// old one (floor, steepness, most of the latency points) and search again.
    fn note_shift(&mut self, tokens_per_s: f64, config: &Config) {
        match self.reference_tokens_per_s {
            Some(reference)
                if tokens_per_s > reference * config.shift_factor
                    || tokens_per_s * config.shift_factor < reference =>
            {
                info!(
                    "gpu {}: tokens/s moved from {reference:.0} to {tokens_per_s:.0}: workload \
                     shift, re-exploring",
                    self.gpu
                );
                self.floor = None;
                self.last_down = None;
                self.elasticity = config.clock_elasticity;
                self.fit.keep_newest();
                self.reference_tokens_per_s = Some(tokens_per_s);
            }
            Some(reference) => {
                self.reference_tokens_per_s = Some(0.7 * reference + 0.3 * tokens_per_s);
            }
            None => self.reference_tokens_per_s = Some(tokens_per_s),
        }
    }
}

/// The largest batch the line keeps at or under `target_ms`, in 1..=`max`.
fn batch_for(line: Line, target_ms: f64, max: u32) -> u32 {
    let sequences = line.sequences_for(target_ms).floor();
    if sequences.is_nan() {
        return 1;
    }
    // `as` saturates; the clamp keeps a batch the workload takes.
    (sequences.max(1.0) as u32).clamp(1, max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_policy_sdk::testing;

    fn tick(p99_ms: f64, queue_depth: u32) -> Observation {
        let mut observation = testing::observation(0, 0);
        observation.tpot_p99_ms = p99_ms;
        observation.queue_depth = queue_depth;
        observation.tokens_per_s = 1000.0;
        observation
    }

    #[test]
    fn a_tick_with_unknown_latency_counts_for_the_queue_and_tokens_not_the_latency() {
        let mut window = Window::default();
        window.add(&tick(f64::NAN, 3));
        assert_eq!(window.mean_p99_ms(), None, "no tick told the latency");
        window.add(&tick(12.0, 5));
        window.add(&tick(f64::NAN, 7));
        window.add(&tick(14.0, 1));
        assert_eq!(window.mean_p99_ms(), Some(13.0));
        assert_eq!(
            (
                window.ticks,
                window.queue_first,
                window.queue_last,
                window.queue_max
            ),
            (4, 3, 1, 7)
        );
        assert_eq!(window.tokens_per_s(), 1000.0);
    }

    fn limits(queue_wait_ms: Option<f64>) -> Limits {
        Limits {
            tpot_p99_ms: Some(20.0),
            min_tokens_per_s: None,
            queue_wait_p99_ms: queue_wait_ms,
            ttft_p99_ms: None,
        }
    }

    /// A busy tick (5 ms p99, queue empty at its end) whose requests waited `wait_ms`.
    fn waited(wait_ms: Option<f64>, turned_away: u64) -> Observation {
        let mut observation = tick(5.0, 0);
        observation.demand = Some(tokwatt_policy_sdk::Demand {
            requests_arrived: 40,
            requests_completed: 40,
            requests_turned_away: turned_away,
            // What the tick generated: the demand is met, not outgrowing the batch.
            tokens_demanded: 1000,
            queue_wait_p99_ms: wait_ms,
        });
        observation
    }

    /// Clock only, so the batch's own steering stays out of the way.
    fn clock_control(clock_index: usize) -> (GpuControl, Config) {
        let config = Config::from_params(&tokwatt_policy_sdk::Params::new(&[])).unwrap();
        let mut control = GpuControl::new(&testing::h200(0), Knobs::SM_CLOCK, &config).unwrap();
        control.clock_index = clock_index;
        (control, config)
    }

    /// `observation`, with the clock `control` holds in force.
    fn at(control: &GpuControl, mut observation: Observation) -> Observation {
        observation.in_force.sm_clock_max_mhz = control.clock().expect("a clock");
        observation
    }

    #[test]
    fn a_queue_wait_past_half_its_bound_raises_the_clock_at_once() {
        let bound = limits(Some(1000.0));
        let (mut control, config) = clock_control(20);
        let slow = control.clocks[20];
        let calm = control.observe(&at(&control, waited(Some(300.0), 0)), bound, &config);
        assert_eq!(calm.sm_clock_max_mhz, None, "300 ms of 1000: no move");
        let long = control.observe(&at(&control, waited(Some(600.0), 0)), bound, &config);
        let raised = long.sm_clock_max_mhz.expect("the clock moves on the tick");
        assert!(raised > slow, "{raised} MHz after {slow}");

        // Requests turned away break any objective: the same answer without a bound.
        let (mut control, config) = clock_control(20);
        let away = control.observe(&at(&control, waited(None, 3)), limits(None), &config);
        assert!(
            away.sm_clock_max_mhz.is_some_and(|mhz| mhz > slow),
            "{away:?}"
        );
        // A workload that reports no demand is left to the windows.
        let (mut control, config) = clock_control(20);
        let unknown = control.observe(&at(&control, tick(5.0, 0)), bound, &config);
        assert_eq!(unknown.sm_clock_max_mhz, None);
    }

    #[test]
    fn the_clock_steps_down_only_after_a_window_of_calm_waits() {
        let steps_down = |wait_ms: f64| {
            let (mut control, config) = clock_control(0);
            for _ in 0..config.window_ticks {
                let observation = at(&control, waited(Some(wait_ms), 0));
                control.observe(&observation, limits(Some(1000.0)), &config);
            }
            control.clock_index > 0
        };
        assert!(steps_down(100.0), "waits at a tenth of the bound");
        assert!(
            !steps_down(400.0),
            "waits at 40 % of the bound hold the clock"
        );
    }

    #[test]
    fn a_queue_behind_a_full_batch_counts_before_any_of_it_is_seated() {
        // No request got a slot, so none reported its wait. Requests ask 25 tokens and
        // the full batch makes 1000 a second, so a slot frees every 25 ms: the last of
        // 30 queued waits 750 ms, past half the bound; the last of 60, 1.5 s, past it.
        let queued = |depth: u32| {
            let mut observation = waited(None, 0);
            observation.queue_depth = depth;
            observation
        };
        let (mut control, config) = clock_control(70);
        control.observe(&at(&control, queued(30)), limits(Some(1000.0)), &config);
        assert!(control.clock_index < 70, "a step up at 750 ms");
        assert!(
            control.clock_index > 0,
            "not the top: {}",
            control.clock_index
        );
        let (mut control, config) = clock_control(70);
        control.observe(&at(&control, queued(60)), limits(Some(1000.0)), &config);
        assert_eq!(control.clock_index, 0, "the top at 1.5 s");
        // The same queue behind a batch with room is seated next step.
        let (mut control, config) = clock_control(70);
        let mut room = queued(60);
        room.active_sequences = 32;
        control.observe(&at(&control, room), limits(Some(1000.0)), &config);
        assert_eq!(control.clock_index, 70);
    }

    #[test]
    fn a_step_down_waits_for_the_decoding_set_to_settle() {
        // 64 sequences decoding and `completed` finishing a second: by Little's law each
        // takes 64 / completed seconds.
        let steps_in_30_ticks = |completed: u64| {
            let (mut control, config) = clock_control(0);
            let mut steps = 0;
            for _ in 0..30 {
                let mut observation = waited(Some(10.0), 0);
                if let Some(demand) = &mut observation.demand {
                    demand.requests_completed = completed;
                }
                let before = control.clock_index;
                control.observe(&at(&control, observation), limits(Some(1000.0)), &config);
                steps += usize::from(control.clock_index > before);
            }
            steps
        };
        assert!(
            steps_in_30_ticks(40) >= 3,
            "1.6 s decodes: {}",
            steps_in_30_ticks(40)
        );
        assert_eq!(
            steps_in_30_ticks(2),
            1,
            "32 s decodes: one step, then a wait"
        );
    }

    #[test]
    fn a_burst_that_outgrows_the_batch_raises_the_clock_before_it_fills() {
        // Half the batch decoding, nothing queued, waits short: only the arrivals tell
        // that three times the tokens now arrive that the tick made.
        let (mut control, config) = clock_control(20);
        let mut burst = waited(Some(10.0), 0);
        burst.active_sequences = 32;
        if let Some(demand) = &mut burst.demand {
            demand.tokens_demanded = 3000;
        }
        let answer = control.observe(&at(&control, burst), limits(Some(1000.0)), &config);
        assert!(control.clock_index < 20, "{answer:?}");
        // The same tick with the demand met leaves the clock.
        let (mut control, config) = clock_control(20);
        burst.demand = waited(Some(10.0), 0).demand;
        control.observe(&at(&control, burst), limits(Some(1000.0)), &config);
        assert_eq!(control.clock_index, 20);
    }

    #[test]
    fn demand_turned_away_at_the_top_clock_grows_the_batch_past_the_latency_limit() {
        let config = Config::from_params(&tokwatt_policy_sdk::Params::new(&[])).unwrap();
        let knobs = Knobs::SM_CLOCK | Knobs::BATCH_SIZE;
        let answer = |turned_away: u64, queued: u32| {
            let mut control = GpuControl::new(&testing::h200(0), knobs, &config).unwrap();
            // 25 ms against a 20 ms limit, the batch full.
            let mut overloaded = at(&control, waited(Some(100.0), turned_away));
            overloaded.tpot_p99_ms = 25.0;
            overloaded.queue_depth = queued;
            control.observe(&overloaded, limits(Some(1000.0)), &config)
        };
        let served_first = answer(5, 100).batch_size.expect("the batch moves");
        assert!(served_first > 64, "turned away: batch {served_first}");
        // 100 queued behind a full batch that finishes 40 a second wait 2.5 s.
        let served_first = answer(0, 100).batch_size.expect("the batch moves");
        assert!(
            served_first > 64,
            "waiting past the bound: batch {served_first}"
        );
        let cut = answer(0, 0).batch_size.expect("the batch moves");
        assert!(cut < 64, "none waiting: the latency limit cuts it to {cut}");
    }

    #[test]
    fn a_backlog_at_the_top_clock_probes_past_a_line_that_says_no() {
        let config = Config::from_params(&tokwatt_policy_sdk::Params::new(&[])).unwrap();
        let knobs = Knobs::SM_CLOCK | Knobs::BATCH_SIZE;
        let grown = |backlog_windows: u32| {
            let mut control = GpuControl::new(&testing::h200(0), knobs, &config).unwrap();
            // A line (4 + 0.25 ms a sequence) that puts 64 sequences at 20 ms, at the limit.
            for _ in 0..4 {
                control.fit.add(32, 12.0);
                control.fit.add(48, 16.0);
            }
            control.backlog_windows = backlog_windows;
            // The p99 comes in under it: 19 ms, with requests waiting.
            let mut waiting = at(&control, tick(19.0, 30));
            waiting.in_force.batch_size = 64;
            waiting.active_sequences = 64;
            control.observe(&waiting, limits(None), &config).batch_size
        };
        assert_eq!(grown(0), None, "no backlog: the line holds the batch");
        assert_eq!(grown(2), Some(80), "a backlog: a quarter more");
    }

    #[test]
    fn serving_first_holds_until_the_backlog_fits_in_a_batch() {
        let config = Config::from_params(&tokwatt_policy_sdk::Params::new(&[])).unwrap();
        let knobs = Knobs::SM_CLOCK | Knobs::BATCH_SIZE;
        let mut control = GpuControl::new(&testing::h200(0), knobs, &config).unwrap();
        // A TPOT limit alone: only demand turned away says the objective is lost.
        let tpot_only = Limits {
            queue_wait_p99_ms: None,
            ..limits(None)
        };
        let tick_with = |control: &GpuControl, turned_away: u64, queued: u32| {
            let mut observation = at(control, waited(None, turned_away));
            observation.tpot_p99_ms = 25.0;
            observation.queue_depth = queued;
            observation.in_force.batch_size = control.batch_target;
            observation.active_sequences = control.batch_target;
            observation
        };
        let first = tick_with(&control, 5, 2000);
        control.observe(&first, tpot_only, &config);
        let grown = control.batch_target;
        assert!(grown > 64, "turned away: {grown}");
        // The turning away stops, 1500 still queued: the limit still yields.
        let next = tick_with(&control, 0, 1500);
        control.observe(&next, tpot_only, &config);
        assert!(
            control.batch_target >= grown,
            "{} after {grown}",
            control.batch_target
        );
        // The backlog fits in a batch: the limit holds again, and cuts.
        let drained = tick_with(&control, 0, 10);
        control.observe(&drained, tpot_only, &config);
        assert!(
            control.batch_target < grown,
            "{} after {grown}",
            control.batch_target
        );
    }
}
