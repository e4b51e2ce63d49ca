//! One GPU's control: the knob that slows it (a clock lock or a power cap, searched by
//! the kit's ladder), the token budget and the batch. See the crate's text for the rules.

mod descent;
mod knobs;

use crate::config::{Config, KnobChoice};
use descent::{Descent, TTFT_CLOCK_EXPONENT, descend};
use knobs::{Batch, Budget, preempted};
use tokwatt_policy_kit::knob_ladder::cap_ladder;
use tokwatt_policy_kit::measure::objective_breach;
use tokwatt_policy_kit::serving::{self, BudgetBounds, PhaseMix, StepModel};
use tokwatt_policy_kit::{KnobLadder, clocks, ladder::first_token_bound};
use tokwatt_policy_sdk::{DeviceFacts, Knobs, Objective, Observation, Settings, info};

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

fn clock_ladder(device: &DeviceFacts) -> Vec<f64> {
    let mut clocks: Vec<f64> = clocks::clock_ladder(device)
        .into_iter()
        .map(f64::from)
        .collect();
    clocks.reverse();
    clocks
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
            let values = cap_ladder(device, config.cap_grid_w)?;
            Some(KnobLadder::new(device.index, values, &config.ladder)?)
        } else {
            None
        };
        let budget = Budget::new(device, knobs, config.budget_floor);
        let batch = knobs.contains(Knobs::BATCH_SIZE).then(Batch::new);
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
}
