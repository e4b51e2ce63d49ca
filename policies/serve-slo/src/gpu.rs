//! One GPU's control: the knob that slows it (a clock lock or a power cap, searched by
//! the kit's ladder), the token budget and the batch. See the crate's text for the rules.

use crate::config::{Config, KnobChoice};
use tokwatt_policy_kit::measure::objective_breach;
use tokwatt_policy_kit::serving::{self, BudgetBounds, PhaseMix, StepModel};
use tokwatt_policy_kit::{KnobLadder, clocks, ladder::first_token_bound};
use tokwatt_policy_sdk::{DeviceFacts, Knobs, Objective, Observation, Settings, debug, info};

/// Two clocks closer than this are the same clock; two caps within a watt the same cap.
const CLOCK_TOLERANCE_MHZ: f64 = 0.5;
const CAP_TOLERANCE_W: f64 = 1.0;

/// The slowing knob in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Clock,
    Cap,
    /// Neither granted (`--batch-only`): the budget and the batch alone.
    None,
}

/// The token budget, where granted and the workload has one.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Budget {
    min: u32,
    /// The candidates, ascending: the largest the workload takes, then steps of √2
    /// down to the floor.
    candidates: Vec<u32>,
    /// Settled ticks with prompts since the last decision.
    ticks: u32,
}

impl Budget {
    fn new(device: &DeviceFacts, knobs: Knobs, floor: u32) -> Option<Budget> {
        if !knobs.contains(Knobs::TOKEN_BUDGET) || device.token_budget_max == 0 {
            return None;
        }
        let min = device.token_budget_min.max(1);
        let max = device.token_budget_max.max(min);
        let floor = floor.clamp(min, max);
        let mut candidates = Vec::new();
        let mut budget = f64::from(max);
        while budget >= f64::from(floor) {
            // Multiples of 16 tokens: what a tensor-core tile takes.
            let rounded = ((budget / 16.0).round() * 16.0).clamp(f64::from(min), f64::from(max));
            candidates.push(rounded as u32);
            budget /= std::f64::consts::SQRT_2;
        }
        candidates.push(floor);
        candidates.sort_unstable();
        candidates.dedup();
        Some(Budget {
            min,
            candidates,
            ticks: 0,
        })
    }

    /// The least budget for `sequences` decoding: above them (their decodes take their
    /// tokens first; a budget at or under them leaves prompts no room at all).
    fn floor(&self, sequences: u32) -> u32 {
        sequences.saturating_add(1).max(self.min)
    }
}

/// The batch, where granted.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Batch {
    /// The batch the workload started with: what it grows back to.
    start: u32,
    calm_windows: u32,
    ticks: u32,
    worst_tpot_ms: f64,
    /// The last cut was for the KV cache.
    preempted: bool,
    /// Ticks since the last cut for the KV cache.
    since_cut: u32,
}

/// Ticks between two cuts for the KV cache.
const KV_CUT_TICKS: u32 = 5;

/// The least batch a cut leaves: an eighth of the workload's own (at least one).
fn batch_floor(start: u32) -> u32 {
    (start / 8).max(1)
}

/// A window of ticks for the batch's growth.
const BATCH_WINDOW_TICKS: u32 = 4;

/// A batch cut for the KV cache: this share of the sequences in flight.
const KV_CUT: f64 = 0.9;

/// Whether the tick pushed sequences out of the KV cache.
fn preempted(observation: &Observation) -> bool {
    observation
        .requests
        .as_ref()
        .and_then(|r| r.preemptions)
        .is_some_and(|n| n > 0)
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Gpu {
    index: u32,
    pub mode: Mode,
    clock: Option<KnobLadder>,
    cap: Option<KnobLadder>,
    /// The clock that releases a lock, and the cap that releases a cap.
    clock_top_mhz: f64,
    cap_top_w: f64,
    mix: PhaseMix,
    pub model: StepModel,
    /// The clock and cap the model's speed was learnt at.
    speed_at: Option<(u32, i64)>,
    budget: Option<Budget>,
    batch: Option<Batch>,
    /// A knob to release at the next decision, after a switch of mode.
    release: Option<Mode>,
    /// What the settled clock showed since it was taken up: the ground of a descent.
    descent: Descent,
    /// Ticks the knob stays at its top: the objective broke there with requests waiting
    /// (demand beyond the GPU).
    overload_ticks: u32,
}

/// Ticks at the top after the objective broke there with requests waiting: an overload
/// is served first (the judge holds it to what the untuned GPU breaks and serves), and a
/// search for efficiency under it serves less.
const OVERLOAD_HOLD_TICKS: u32 = 30;

/// Settled ticks at one clock, for a descent predicted from them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct Descent {
    mhz: u32,
    ticks: u32,
    tpot_sum_ms: f64,
    tpot_worst_ms: f64,
    ttft_sum_ms: f64,
    ttft_worst_ms: f64,
    ttft_ticks: u32,
    queue_worst: u32,
    /// A clock a descent reached and the objective broke at: no descent goes to it or
    /// below again until `floor_ticks` run out (a shift of the workload resets it).
    floor_mhz: f64,
    floor_ticks: u32,
    /// Ticks since the last descent.
    since_descent: u32,
}

/// The time to first token goes as 1/clock to this power at a lower clock (see
/// `descend`).
const TTFT_CLOCK_EXPONENT: f64 = 2.2;

/// Ticks after a descent in which a breach is the descent's.
const DESCENT_BLAME_TICKS: u32 = 30;
/// Ticks a clock a descent broke at stays ruled out for descents.
const DESCENT_FLOOR_TICKS: u32 = 300;

impl Descent {
    /// Takes a tick that broke the objective: blamed on a recent descent, its clock
    /// is a floor for descents.
    fn breach(&mut self, mhz: f64) {
        if self.since_descent <= DESCENT_BLAME_TICKS {
            self.floor_mhz = self.floor_mhz.max(mhz);
            self.floor_ticks = DESCENT_FLOOR_TICKS;
        }
    }

    fn push(&mut self, observation: &Observation) {
        let mhz = observation.in_force.sm_clock_max_mhz;
        self.since_descent = self.since_descent.saturating_add(1);
        self.floor_ticks = self.floor_ticks.saturating_sub(1);
        if self.floor_ticks == 0 {
            self.floor_mhz = 0.0;
        }
        if mhz != self.mhz {
            *self = Descent {
                mhz,
                floor_mhz: self.floor_mhz,
                floor_ticks: self.floor_ticks,
                since_descent: self.since_descent,
                ..Descent::default()
            };
        }
        if observation.settling || observation.tokens == 0 {
            return;
        }
        self.ticks += 1;
        let tpot = observation.tpot_p99_ms;
        if tpot.is_finite() {
            self.tpot_sum_ms += tpot;
            self.tpot_worst_ms = self.tpot_worst_ms.max(tpot);
        }
        if let Some(ttft) = observation
            .requests
            .as_ref()
            .and_then(|r| r.ttft_p99_ms)
            .filter(|ms| ms.is_finite())
        {
            self.ttft_sum_ms += ttft;
            self.ttft_worst_ms = self.ttft_worst_ms.max(ttft);
            self.ttft_ticks += 1;
        }
        self.queue_worst = self.queue_worst.max(observation.queue_depth);
    }
}

fn clock_ladder(device: &DeviceFacts) -> Vec<f64> {
    let mut clocks: Vec<f64> = clocks::clock_ladder(device)
        .into_iter()
        .map(f64::from)
        .collect();
    clocks.reverse();
    clocks
}

fn cap_ladder(device: &DeviceFacts, grid_w: f64) -> Option<Vec<f64>> {
    let (min_w, max_w) = (device.power_cap_min_w, device.power_cap_max_w);
    if !(min_w.is_finite() && max_w.is_finite() && 0.0 < min_w && min_w <= max_w) {
        return None;
    }
    let mut caps = Vec::new();
    let mut cap_w = min_w;
    while cap_w < max_w - grid_w / 2.0 {
        caps.push(cap_w);
        cap_w += grid_w;
    }
    caps.push(max_w);
    Some(caps)
}

impl Gpu {
    /// The control of `device` under `knobs`.
    ///
    /// # Errors
    /// Where no knob it turns is granted, or a granted one has no range to search.
    pub fn new(device: &DeviceFacts, knobs: Knobs, config: &Config) -> Result<Gpu, String> {
        let clock = if knobs.contains(Knobs::SM_CLOCK) && config.knob_choice != KnobChoice::Cap {
            let values = clock_ladder(device);
            if values.is_empty() {
                return Err(format!(
                    "gpu {}: \"sm-clock\" is granted but the host reports no supported SM clocks",
                    device.index
                ));
            }
            Some(KnobLadder::new(device.index, values, &config.ladder)?)
        } else {
            None
        };
        let cap = if knobs.contains(Knobs::POWER_CAP) && config.knob_choice != KnobChoice::Clock {
            let Some(values) = cap_ladder(device, config.cap_grid_w) else {
                return Err(format!(
                    "gpu {}: the host reports a power cap range of {}-{} W, in which no cap \
                     can be searched; check the spec's power cap guardrails",
                    device.index, device.power_cap_min_w, device.power_cap_max_w
                ));
            };
            Some(KnobLadder::new(device.index, values, &config.ladder)?)
        } else {
            None
        };
        let budget = Budget::new(device, knobs, config.budget_floor);
        let batch = knobs.contains(Knobs::BATCH_SIZE).then_some(Batch {
            start: 0,
            calm_windows: 0,
            ticks: 0,
            worst_tpot_ms: 0.0,
            preempted: false,
            since_cut: KV_CUT_TICKS,
        });
        if clock.is_none() && cap.is_none() && budget.is_none() && batch.is_none() {
            return Err(format!(
                "gpu {}: serve-slo turns the SM clock or the power cap, the token budget and \
                 the batch size, and none of them is granted here: list at least \
                 \"batch-size\" in the spec's `knobs`",
                device.index
            ));
        }
        let mode = match (&clock, &cap) {
            (Some(_), _) => Mode::Clock,
            (None, Some(_)) => Mode::Cap,
            (None, None) => Mode::None,
        };
        Ok(Gpu {
            index: device.index,
            mode,
            clock,
            cap,
            clock_top_mhz: clocks::highest_clock(device).map_or(0.0, f64::from),
            cap_top_w: device.power_cap_max_w,
            mix: PhaseMix::new(config.cap_above, config.lock_below),
            model: StepModel::new(),
            speed_at: None,
            budget,
            batch,
            release: None,
            descent: Descent::default(),
            overload_ticks: 0,
        })
    }

    /// The first settings: the search's first rung (the top: the safe side).
    pub fn first(&self) -> Settings {
        let mut settings = Settings::unchanged();
        match self.mode {
            Mode::Clock => {
                if let Some(ladder) = &self.clock {
                    settings = settings.with_sm_clock_max_mhz(ladder.target() as u32);
                }
            }
            Mode::Cap => {
                if let Some(ladder) = &self.cap {
                    settings = settings.with_power_cap_w(ladder.target());
                }
            }
            Mode::None => {}
        }
        settings
    }

    pub fn decide(
        &mut self,
        observation: &Observation,
        objective: &Objective,
        config: &Config,
    ) -> Settings {
        let mut settings = Settings::unchanged();
        self.choose_mode(observation, config, &mut settings);
        self.learn(observation);
        self.slow(observation, objective, config, &mut settings);
        let cut_budget = self.steer_budget(observation, objective, config, &mut settings);
        self.steer_batch(observation, objective, config, cut_budget, &mut settings);
        settings
    }

    /// Requests wait while the clock and the cap are at their top: demand beyond the
    /// GPU, where a smaller chunk or batch only serves less of it (the judge holds an
    /// overload to the untuned GPU's breaches and to what it served).
    fn beyond_the_gpu(&self, observation: &Observation) -> bool {
        (observation.queue_depth > 0 || self.model.waiting_prompt_tokens() > 0.0)
            && self.at_top(observation)
    }

    /// The clock and the cap are at their top: nothing faster to go to.
    fn at_top(&self, observation: &Observation) -> bool {
        f64::from(observation.in_force.sm_clock_max_mhz) >= self.clock_top_mhz
            && observation.in_force.power_cap_w >= self.cap_top_w - CAP_TOLERANCE_W
    }

    /// The phase mix picks the knob (where both are granted and the choice is `auto`).
    /// A switch starts the new knob's search afresh from its top and releases the other.
    fn choose_mode(&mut self, observation: &Observation, config: &Config, settings: &mut Settings) {
        // A tick that re-prefills preempted sequences is a KV cache thrashing, not a mix
        // of prompt-heavy work: it says nothing about which knob to use.
        let changed = !preempted(observation) && self.mix.observe(observation);
        if let Some(release) = self.release.take() {
            match release {
                Mode::Clock if self.clock_top_mhz > 0.0 => {
                    *settings = settings.with_sm_clock_max_mhz(self.clock_top_mhz as u32);
                }
                Mode::Cap => *settings = settings.with_power_cap_w(self.cap_top_w),
                _ => {}
            }
        }
        if !(changed
            && config.knob_choice == KnobChoice::Auto
            && self.clock.is_some()
            && self.cap.is_some())
        {
            return;
        }
        let (to, from) = if self.mix.prefers_cap() {
            (Mode::Cap, Mode::Clock)
        } else {
            (Mode::Clock, Mode::Cap)
        };
        if to == self.mode {
            return;
        }
        info!(
            "gpu {}: prompts take {:.0} % of the busy time; slowing by the {}",
            self.index,
            self.mix.share().unwrap_or(0.0) * 100.0,
            if to == Mode::Cap {
                "power cap (the firmware clocks prompt and decode steps apart)"
            } else {
                "clock lock"
            }
        );
        self.mode = to;
        self.release = Some(from);
        let ladder = match to {
            Mode::Cap => self.cap.as_mut(),
            _ => self.clock.as_mut(),
        };
        if let Some(ladder) = ladder
            && let Ok(fresh) = KnobLadder::new(self.index, ladder.values.clone(), &config.ladder)
        {
            *ladder = fresh;
        }
    }

    /// The step model learns from the tick (it carries what it learns across clocks);
    /// what it knew of the GPU's speed goes when the cap in force changes (under a cap
    /// prompt and decode steps run at clocks of their own, which the tick's median
    /// clock does not tell apart).
    fn learn(&mut self, observation: &Observation) {
        let at = (0, observation.in_force.power_cap_w.round() as i64);
        if self.speed_at != Some(at) {
            self.model.forget_speed();
            self.speed_at = Some(at);
        }
        self.model.observe(observation);
    }

    /// The active ladder's search, with the time to first token predicted: a backlog of
    /// prompts that will come out late raises the knob before any first token does, and
    /// a lower rung predicted to be late is ruled out before it is tried.
    fn slow(
        &mut self,
        observation: &Observation,
        objective: &Objective,
        config: &Config,
        settings: &mut Settings,
    ) {
        let (ladder, in_force, tolerance) = match self.mode {
            Mode::Clock => (
                self.clock.as_mut(),
                f64::from(observation.in_force.sm_clock_max_mhz),
                CLOCK_TOLERANCE_MHZ,
            ),
            Mode::Cap => (
                self.cap.as_mut(),
                observation.in_force.power_cap_w,
                CAP_TOLERANCE_W,
            ),
            Mode::None => (None, 0.0, 0.0),
        };
        let Some(ladder) = ladder else {
            return;
        };
        if !in_force.is_finite() {
            return;
        }
        let rung = ladder.rung_of(in_force);
        ladder
            .search
            .observe(observation, rung, objective, &config.ladder);
        let waiting = observation.queue_depth > 0 || self.model.waiting_prompt_tokens() > 0.0;
        if rung == ladder.search.top()
            && waiting
            && !observation.settling
            && objective_breach(observation, objective).is_some()
        {
            if self.overload_ticks == 0 {
                info!(
                    "gpu {}: the objective breaks at the top with requests waiting: demand \
                     beyond the GPU; holding the top",
                    self.index
                );
            }
            self.overload_ticks = OVERLOAD_HOLD_TICKS;
        } else {
            self.overload_ticks = self.overload_ticks.saturating_sub(1);
        }
        if self.overload_ticks > 0 {
            let top = ladder.search.top();
            ladder.search.settle_at(top);
        }
        // Sequences pushed out of the KV cache: the rung let too many pile up in flight
        // (a slower step holds each longer, with a longer context). A faster rung drains
        // them, and the batch admits fewer (see `steer_batch`).
        if preempted(observation) && !observation.settling {
            ladder.search.raise_for_predicted_breach(
                rung,
                1.2,
                "sequences preempted from the KV cache",
                &config.ladder,
            );
            if self.mode == Mode::Clock {
                self.descent.breach(in_force);
            }
        }
        if let (Some(bound_ms), false) = (first_token_bound(objective), observation.settling) {
            let waiting = self.model.waiting_prompt_tokens();
            let predicted = self.model.ttft_p99_ms(
                waiting,
                observation.in_force.token_budget,
                observation.active_sequences,
            );
            if let Some(predicted_ms) = predicted.filter(|ms| !ms.is_nan()) {
                let guard_ms = config.ttft_guard * bound_ms;
                if predicted_ms > guard_ms {
                    ladder.search.raise_for_predicted_breach(
                        rung,
                        predicted_ms / bound_ms,
                        &format!(
                            "first tokens predicted at {predicted_ms:.0} ms p99 ({waiting:.0} prompt \
                             tokens waiting), past {guard_ms:.0} ms"
                        ),
                        &config.ladder,
                    );
                } else if ladder.search.current < rung && self.mode == Mode::Clock {
                    // The lower rung's first tokens, scaled from this one's as a descent
                    // scales them (see `descend`: a prompt token's time goes with the
                    // clock, and a slower GPU holds more sequences in flight).
                    let target = ladder.target();
                    let scaled_ms =
                        predicted_ms * (in_force / target.max(1.0)).powf(TTFT_CLOCK_EXPONENT);
                    if scaled_ms > guard_ms {
                        ladder.search.rule_out_current(
                            &format!(
                                "first tokens predicted at {scaled_ms:.0} ms p99 at {target:.0} MHz"
                            ),
                            &config.ladder,
                        );
                    }
                }
            }
        }
        // A lower rung where no budget's step with a full chunk of prompt is predicted
        // within the TPOT bound (without the budget knob: the budget in force): the
        // decode-only ticks it would show first say nothing of the first prompt to come.
        if self.mode == Mode::Clock
            && ladder.search.current < rung
            && let Some(limit_ms) = objective.tpot_p99_limit_ms
        {
            let target = ladder.target();
            let there = self.model.at_clock(target);
            let sequences = observation.active_sequences;
            let breaks = match &self.budget {
                Some(budget) if there.knows_prompts() => serving::largest_budget_within_tpot(
                    &there,
                    &BudgetBounds::of(objective),
                    &budget.candidates,
                    sequences,
                )
                .is_none(),
                _ => there
                    .tpot_p99_ms(observation.in_force.token_budget, sequences)
                    .is_some_and(|ms| ms > limit_ms * (1.0 - config.ladder.tpot_margin)),
            };
            if breaks {
                ladder.search.rule_out_current(
                    &format!("no chunk predicted within the TPOT bound at {target:.0} MHz"),
                    &config.ladder,
                );
            }
        }
        if self.mode == Mode::Clock {
            if objective_breach(observation, objective).is_some() {
                self.descent.breach(in_force);
            }
            self.descent.push(observation);
            descend(
                ladder,
                &mut self.descent,
                self.budget.as_ref().map(|b| b.candidates.as_slice()),
                &self.model,
                observation,
                objective,
                config,
            );
        }
        let target = ladder.target();
        if (target - in_force).abs() > tolerance {
            *settings = match self.mode {
                Mode::Clock => settings.with_sm_clock_max_mhz(target as u32),
                _ => settings.with_power_cap_w(target),
            };
        }
    }

    /// The token budget: the largest candidate whose full chunk keeps the TPOT bound
    /// (the kit's `choose_budget`), once a window; a tick that breaks the TPOT bound
    /// halves it at once where first tokens stay on time (smaller chunks before fewer
    /// sequences); the largest with demand beyond the GPU. Returns whether it was cut for
    /// a breach, so the batch is not cut for the same one.
    fn steer_budget(
        &mut self,
        observation: &Observation,
        objective: &Objective,
        config: &Config,
        settings: &mut Settings,
    ) -> bool {
        let beyond = self.beyond_the_gpu(observation);
        let Some(budget) = self.budget.as_mut() else {
            return false;
        };
        let in_force = observation.in_force.token_budget;
        if in_force == 0 || observation.settling || observation.tokens == 0 {
            return false;
        }
        let sequences = observation.active_sequences;
        let floor = budget.floor(sequences).max(
            budget
                .candidates
                .first()
                .copied()
                .unwrap_or(budget.min)
                .min(in_force),
        );
        let halved = (in_force / 2).max(floor);
        // A smaller chunk prefills slower: not where first tokens would then be late.
        let first_tokens_allow = match first_token_bound(objective) {
            Some(bound_ms) => self
                .model
                .ttft_p99_ms(self.model.waiting_prompt_tokens(), halved, sequences)
                .is_none_or(|ms| ms <= config.ttft_guard * bound_ms),
            None => true,
        };
        if let Some(limit_ms) = objective.tpot_p99_limit_ms
            && observation.tpot_p99_ms > limit_ms
            && in_force > floor
            && !beyond
            && first_tokens_allow
        {
            let cut = halved;
            debug!(
                "gpu {}: p99 time per token {:.1} ms over {limit_ms} ms: budget {in_force} -> {cut}",
                self.index, observation.tpot_p99_ms
            );
            *settings = settings.with_token_budget(cut);
            budget.ticks = 0;
            return true;
        }
        // Demand beyond the GPU: the largest budget serves the most of it.
        if beyond {
            let largest = budget.candidates.last().copied().unwrap_or(in_force);
            if largest != in_force {
                *settings = settings.with_token_budget(largest);
            }
            budget.ticks = 0;
            return false;
        }
        let prompts = observation
            .requests
            .as_ref()
            .is_some_and(|r| r.prefill_tokens > 0);
        if !prompts {
            return false;
        }
        budget.ticks += 1;
        if budget.ticks < config.budget_window_ticks {
            return false;
        }
        budget.ticks = 0;
        let share_now = observation
            .requests
            .as_ref()
            .and_then(|r| r.prefill_time_share)
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(|s| (s, in_force));
        let Some(chosen) = serving::choose_budget(
            &self.model,
            &BudgetBounds::of(objective),
            &budget.candidates,
            sequences,
            share_now,
        ) else {
            return false;
        };
        // At most a doubling or a halving a decision: the model is a line through what
        // one budget showed, and a step of it is recoverable in one window.
        let next = chosen
            .clamp(in_force / 2, in_force.saturating_mul(2))
            .max(floor);
        if next != in_force {
            debug!(
                "gpu {}: budget {in_force} -> {next} (toward {chosen})",
                self.index
            );
            *settings = settings.with_token_budget(next);
        }
        false
    }

    /// The batch: cut on a TPOT breach that the budget cannot answer (it is at its floor,
    /// not granted, or the decode steps alone are too slow), grown back to the workload's
    /// own after `batch_calm_windows` windows of ample room.
    fn steer_batch(
        &mut self,
        observation: &Observation,
        objective: &Objective,
        config: &Config,
        budget_cut: bool,
        settings: &mut Settings,
    ) {
        /// Ample room: the worst p99 of a window under this share of the bound.
        const CALM: f64 = 0.7;
        let beyond = self.beyond_the_gpu(observation);
        let at_top = self.at_top(observation);
        let Some(batch) = self.batch.as_mut() else {
            return;
        };
        let in_force = observation.in_force.batch_size;
        if batch.start == 0 {
            batch.start = in_force.max(1);
        }
        if observation.settling || observation.tokens == 0 {
            return;
        }
        // Sequences pushed out of the KV cache are prefilled again: work thrown away, and
        // at a slow rung (more sequences in flight, each holding a longer context) it
        // feeds on itself until every step is a re-prefill and the GPU serves a fraction
        // of the demand. Admit fewer than are in flight now, whatever the latency says;
        // the queue that builds is the ladder's to answer with a faster rung.
        batch.since_cut = batch.since_cut.saturating_add(1);
        // Below the top clock the ladder answers first (a faster rung drains them; a cut
        // batch queues the arrivals behind sequences that take minutes to finish, which
        // broke a queue-wait bound on a reasoning draw); at the top nothing else can.
        if preempted(observation) && at_top {
            // The sequences already in flight hold their cache for a while after a cut:
            // one cut per `KV_CUT_TICKS`, or the batch spirals down.
            if batch.since_cut < KV_CUT_TICKS {
                return;
            }
            batch.since_cut = 0;
            let cut = ((f64::from(observation.active_sequences.min(in_force)) * KV_CUT) as u32)
                .max(batch_floor(batch.start));
            if cut < in_force {
                debug!(
                    "gpu {}: sequences preempted with {} decoding: batch {in_force} -> {cut}",
                    self.index, observation.active_sequences
                );
                *settings = settings.with_batch_size(cut);
            }
            batch.calm_windows = 0;
            batch.ticks = 0;
            batch.worst_tpot_ms = 0.0;
            batch.preempted = true;
            return;
        }
        let tpot_ms = observation.tpot_p99_ms;
        let Some(limit_ms) = objective.tpot_p99_limit_ms else {
            // No latency bound: only a cut for the KV cache grows back, once no sequence
            // was preempted for `batch_calm_windows` windows.
            self.grow_back(observation, config, 0.0, f64::INFINITY, settings);
            return;
        };
        if tpot_ms > limit_ms && !budget_cut {
            let decode_too_slow = self
                .model
                .decode_ms()
                .is_some_and(|ms| ms > limit_ms * (1.0 - config.ladder.tpot_margin));
            let budget_spent = match &self.budget {
                Some(budget) => {
                    observation.in_force.token_budget
                        <= budget
                            .floor(observation.active_sequences)
                            .max(budget.candidates.first().copied().unwrap_or(budget.min))
                }
                None => true,
            };
            // Fewer sequences shorten a step only where the batch binds (every slot
            // taken): a chunk's step with two sequences decoding is the chunk's, and
            // cutting a batch of 299 to one there queued everything behind it.
            let binds = observation.active_sequences >= in_force.saturating_mul(9) / 10;
            if binds && (budget_spent || decode_too_slow) && !beyond {
                let cut = ((f64::from(observation.active_sequences.min(in_force)) * 0.8) as u32)
                    .max(batch_floor(batch.start));
                if cut < in_force {
                    debug!(
                        "gpu {}: p99 time per token {tpot_ms:.1} ms over {limit_ms} ms with \
                         the budget spent: batch {in_force} -> {cut}",
                        self.index
                    );
                    *settings = settings.with_batch_size(cut);
                }
                batch.calm_windows = 0;
                batch.ticks = 0;
                batch.worst_tpot_ms = 0.0;
                return;
            }
        }
        self.grow_back(observation, config, tpot_ms, CALM * limit_ms, settings);
    }

    /// Grows a cut batch back by a quarter (a tenth after a cut for the KV cache: the
    /// thrash starts sharply) after `batch_calm_windows` windows whose worst p99 time per
    /// token stayed under `calm_ms`, up to the workload's own batch.
    fn grow_back(
        &mut self,
        observation: &Observation,
        config: &Config,
        tpot_ms: f64,
        calm_ms: f64,
        settings: &mut Settings,
    ) {
        let Some(batch) = self.batch.as_mut() else {
            return;
        };
        let in_force = observation.in_force.batch_size;
        if in_force >= batch.start {
            batch.preempted = false;
            return;
        }
        if tpot_ms.is_finite() {
            batch.worst_tpot_ms = batch.worst_tpot_ms.max(tpot_ms);
        }
        batch.ticks += 1;
        if batch.ticks < BATCH_WINDOW_TICKS {
            return;
        }
        let calm = batch.worst_tpot_ms < calm_ms;
        batch.ticks = 0;
        batch.worst_tpot_ms = 0.0;
        batch.calm_windows = if calm { batch.calm_windows + 1 } else { 0 };
        if batch.calm_windows >= config.batch_calm_windows {
            batch.calm_windows = 0;
            let factor = if batch.preempted { 1.05 } else { 1.25 };
            let grown = (f64::from(in_force) * factor).ceil() as u32;
            *settings = settings.with_batch_size(grown.min(batch.start));
        }
    }
}

/// A settled clock that keeps every bound with room goes down at once to the lowest
/// clock predicted to keep them, instead of a probe a rung every `recheck_windows`
/// windows (from a raise for a burst, that took minutes). The prediction scales what
/// `descent.ticks` settled ticks at this clock showed: the time to first token by
/// (old / new clock)^2.2 (a prompt token's time goes with the clock, and a slower GPU
/// holds more sequences in flight, whose decodes share the prompts' steps: 1,140 to 555
/// MHz took a chat's TTFT from 45 to about 200 ms on the simulated H100), the time per
/// token by ^1.5; at most `DESCENT_STEP` lower a jump. The ladder judges the new clock's
/// window as any other, and a breach raises it as any other.
fn descend(
    ladder: &mut KnobLadder,
    descent: &mut Descent,
    candidates: Option<&[u32]>,
    model: &StepModel,
    observation: &Observation,
    objective: &Objective,
    config: &Config,
) {
    /// Settled ticks at a clock before a descent is predicted from them.
    const DESCENT_TICKS: u32 = 6;
    /// At most this much lower a jump.
    const DESCENT_STEP: f64 = 0.25;
    const TPOT_EXPONENT: f64 = 1.5;
    let search = &ladder.search;
    let rung = ladder.rung_of(f64::from(observation.in_force.sm_clock_max_mhz));
    if descent.ticks < DESCENT_TICKS
        || search.incumbent != Some(rung)
        || search.current != rung
        || rung == 0
        || descent.queue_worst >= config.ladder.queue_min / 2
    {
        return;
    }
    let f0 = ladder.values[rung];
    let ticks = f64::from(descent.ticks);
    let tpot_limit = objective.tpot_p99_limit_ms;
    let first_bound = first_token_bound(objective);
    // TTFT at this clock: the worse of the ticks' mean and the model's prediction for
    // an empty queue (its learnt tail covers the long prompts a window may not hold).
    let ttft_here = match (first_bound, descent.ttft_ticks) {
        (Some(_), 0) => return,
        (Some(_), n) => {
            let mean = descent.ttft_sum_ms / f64::from(n);
            let predicted = model
                .ttft_p99_ms(
                    0.0,
                    observation.in_force.token_budget,
                    observation.active_sequences,
                )
                .unwrap_or(mean);
            mean.max(predicted).max(descent.ttft_worst_ms * 0.8)
        }
        (None, _) => 0.0,
    };
    let budget_now = observation.in_force.token_budget;
    let sequences = observation.active_sequences;
    let keeps = |mhz: f64| -> bool {
        let ratio = f0 / mhz;
        let there = model.at_clock(mhz);
        // Where the budget is turned and prompts were measured, the budget there is the
        // largest whose full chunk keeps the TPOT bound: the clock keeps it if one does,
        // and first tokens come as much later as that budget prefills slower.
        let mut budget_scale = 1.0;
        if let (Some(candidates), Some(_)) = (candidates, tpot_limit)
            && there.knows_prompts()
        {
            let bounds = BudgetBounds::of(objective);
            let Some(budget) =
                serving::largest_budget_within_tpot(&there, &bounds, candidates, sequences)
            else {
                return false;
            };
            if let (Some(now), Some(then)) = (
                there.prefill_rate(budget_now, sequences),
                there.prefill_rate(budget, sequences),
            ) && then > 0.0
            {
                budget_scale = (now / then).max(1.0);
            }
        } else if let Some(limit) = tpot_limit
            && let Some(step_ms) = there.tpot_p99_ms(budget_now, sequences)
            && step_ms > limit * (1.0 - config.ladder.tpot_margin)
        {
            return false;
        }
        if let Some(limit) = tpot_limit
            && (candidates.is_none() || !there.knows_prompts())
        {
            let mean = descent.tpot_sum_ms / ticks * ratio.powf(TPOT_EXPONENT);
            let worst = descent.tpot_worst_ms * ratio.powf(TPOT_EXPONENT);
            if mean > limit * (1.0 - config.ladder.tpot_margin) || worst > 0.95 * limit {
                return false;
            }
        }
        if let Some(bound) = first_bound {
            let scale = ratio.powf(TTFT_CLOCK_EXPONENT) * budget_scale;
            // The typical tick with the guard's room, and the worst one seen under the
            // bound itself (less a twentieth): a window's worst prompt comes again.
            if ttft_here * scale > config.descent_guard * bound
                || descent.ttft_worst_ms * scale > 0.95 * bound
            {
                return false;
            }
        }
        true
    };
    let lowest = (f0 * (1.0 - DESCENT_STEP)).max(descent.floor_mhz + 0.5);
    let mut chosen = rung;
    for candidate in (0..rung).rev() {
        let mhz = ladder.values[candidate];
        if mhz < lowest || !keeps(mhz) {
            break;
        }
        chosen = candidate;
    }
    // One rung is the ladder's own recheck.
    if chosen + 1 < rung {
        let settled = ladder.search.settle_at(chosen);
        debug!(
            "gpu {}: {f0:.0} MHz keeps every bound with room: down to {:.0} MHz",
            observation.gpu, ladder.values[settled]
        );
        descent.ticks = 0;
        descent.since_descent = 0;
    }
}
