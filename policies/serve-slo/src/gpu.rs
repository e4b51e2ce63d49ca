//! One GPU's control: the knob that slows it (a clock lock or a power cap, searched by
//! the kit's ladder), the token budget and the batch. See the crate's text for the rules.

use crate::config::{Config, KnobChoice};
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

    /// The step model learns from the tick; what it knew of the GPU's speed goes when
    /// the clock or the cap in force changes.
    fn learn(&mut self, observation: &Observation) {
        let at = (
            observation.in_force.sm_clock_max_mhz,
            observation.in_force.power_cap_w.round() as i64,
        );
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
        if let (Some(bound_ms), false) = (first_token_bound(objective), observation.settling) {
            let waiting =
                serving::waiting_prompt_tokens(observation, self.model.mean_prompt_tokens());
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
                    // A prompt token's time goes with the clock (compute-bound): the lower
                    // rung's first tokens, scaled from this one's.
                    let target = ladder.target();
                    let scaled_ms = predicted_ms * in_force / target.max(1.0);
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
        let target = ladder.target();
        if (target - in_force).abs() > tolerance {
            *settings = match self.mode {
                Mode::Clock => settings.with_sm_clock_max_mhz(target as u32),
                _ => settings.with_power_cap_w(target),
            };
        }
    }

    /// The token budget: the candidate that leaves the most room under the tighter of
    /// the latency bounds, once a window; a tick that breaks the TPOT bound halves it at
    /// once (smaller chunks before fewer sequences). Returns whether it was cut for a
    /// breach, so the batch is not cut for the same one.
    fn steer_budget(
        &mut self,
        observation: &Observation,
        objective: &Objective,
        config: &Config,
        settings: &mut Settings,
    ) -> bool {
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
        if let Some(limit_ms) = objective.tpot_p99_limit_ms
            && observation.tpot_p99_ms > limit_ms
            && in_force > floor
        {
            let cut = (in_force / 2).max(floor);
            debug!(
                "gpu {}: p99 time per token {:.1} ms over {limit_ms} ms: budget {in_force} -> {cut}",
                self.index, observation.tpot_p99_ms
            );
            *settings = settings.with_token_budget(cut);
            budget.ticks = 0;
            return true;
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
        let waiting = serving::waiting_prompt_tokens(observation, self.model.mean_prompt_tokens());
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
            waiting,
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
        if preempted(observation) {
            let cut =
                ((f64::from(observation.active_sequences.min(in_force)) * KV_CUT) as u32).max(1);
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
            if budget_spent || decode_too_slow {
                let cut =
                    ((f64::from(observation.active_sequences.min(in_force)) * 0.8) as u32).max(1);
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
            let factor = if batch.preempted { 1.1 } else { 1.25 };
            let grown = (f64::from(in_force) * factor).ceil() as u32;
            *settings = settings.with_batch_size(grown.min(batch.start));
        }
    }
}
