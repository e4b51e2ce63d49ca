//! Serving with prompts: what a policy can predict from one observation, instead of
//! waiting for a spiky per-tick p99 to break.
//!
//! A serving engine with chunked prefill runs steps of at most `token-budget` tokens:
//! every decoding sequence takes one, and what is left (the *chunk*) goes to prompts. So
//! with `n` sequences decoding and a budget `B`, a step that carries prompts costs about
//!
//! ```text
//! t(B) = a + c·(B - n)        a: a decode step's time, c: one prompt token's
//! ```
//!
//! and it sets the tick's p99 time per token (the longest steps are the ones with a full
//! chunk). Prompts are prefilled at `(B - n) / t(B)` tokens a second while any wait, so a
//! prompt that arrives behind `W` prompt tokens gets its first token after about
//! `(W + P) · t(B) / (B - n)`. Both are measured at the setting in force and scaled to
//! another budget through the same line; nothing here probes.
//!
//! - [`Ewma`]: the smoothing every estimate here uses.
//! - [`StepModel`]: `a`, `c` and the mean prompt, learnt from each settled tick (the
//!   prompt tokens prefilled, the share of busy time spent on them, the p50 time per
//!   token); it predicts the p99 time per token ([`StepModel::tpot_p99_ms`]) and the
//!   p99 time to first token ([`StepModel::ttft_p99_ms`]) at any budget, the latter
//!   scaled by how far the measured p99 has run above the plain mean prediction
//!   (the tail of the prompt lengths, learnt, not assumed).
//! - [`choose_budget`]: the largest budget whose step with a full chunk keeps the TPOT
//!   bound (a smaller chunk only costs first tokens and prefill efficiency), so that a
//!   clock search can go as low as first tokens allow: a broken TPOT is answered with
//!   smaller chunks first.
//! - [`PhaseMix`]: the share of busy time spent on prompts, smoothed, with a hysteresis
//!   between the two ways of slowing a GPU: under a power cap the firmware clocks each
//!   step by its own power (compute-bound prompt chunks low, memory-bound decode steps
//!   high), which a clock lock cannot do; on decode-only work a lock is finer.

use tokwatt_policy_sdk::{Objective, Observation};

/// An exponentially weighted mean; empty until its first value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ewma {
    value: Option<f64>,
    alpha: f64,
}

impl Ewma {
    /// A mean that gives each new value the weight `alpha` (0 to 1).
    pub fn new(alpha: f64) -> Ewma {
        Ewma {
            value: None,
            alpha: alpha.clamp(0.0, 1.0),
        }
    }

    /// Takes `value` in; a value that is not finite is ignored (a plugin never trusts a
    /// figure the host could not measure).
    pub fn push(&mut self, value: f64) {
        if !value.is_finite() {
            return;
        }
        self.value = Some(match self.value {
            Some(mean) => mean + self.alpha * (value - mean),
            None => value,
        });
    }

    pub fn get(&self) -> Option<f64> {
        self.value
    }

    pub fn clear(&mut self) {
        self.value = None;
    }
}

/// The prompt side of one tick, where the workload serves prompts and the tick tells
/// enough to learn from (settled, busy, prompts prefilled).
#[derive(Debug, Clone, Copy, PartialEq)]
struct PromptTick {
    prefill_tokens: f64,
    /// Seconds spent in steps that carried prompt tokens.
    prefill_s: f64,
    /// Share of the busy time they took (0 to 1).
    share: f64,
    first_tokens: u64,
    ttft_p99_ms: Option<f64>,
}

impl PromptTick {
    fn of(observation: &Observation) -> Option<PromptTick> {
        let requests = observation.requests.as_ref()?;
        let share = requests.prefill_time_share?;
        let interval_s = observation.interval_s;
        let busy = observation.gpu_util_pct / 100.0;
        if observation.settling
            || requests.prefill_tokens == 0
            || !(share.is_finite() && share > 0.0 && share <= 1.0)
            || !(interval_s.is_finite() && interval_s > 0.0)
            || !(busy.is_finite() && busy > 0.0)
        {
            return None;
        }
        let prefill_s = share * busy.min(1.0) * interval_s;
        Some(PromptTick {
            prefill_tokens: requests.prefill_tokens as f64,
            prefill_s,
            share,
            first_tokens: requests.first_tokens,
            ttft_p99_ms: requests
                .ttft_p99_ms
                .filter(|ms| ms.is_finite() && *ms > 0.0),
        })
    }
}

/// Ticks with less prompt work than this share of busy time say little about a prompt
/// token's cost (one short prompt's chunk), and their p50 is a decode step's.
const DECODE_ONLY_SHARE: f64 = 0.3;

/// The measured tail of first tokens over the plain mean prediction is held within this
/// range: a single odd tick must not make the predictor promise or forbid everything.
const TAIL_RANGE: (f64, f64) = (1.0, 8.0);

/// A decode step's time goes as 1/clock to this power (between a memory-bound step, 0,
/// and a compute-bound one, 1).
const DECODE_CLOCK_EXPONENT: f64 = 0.6;

/// The clock the learnt times are carried to, MHz.
const REFERENCE_MHZ: f64 = 1000.0;

/// The cost of one engine step, learnt from settled ticks (see the module's text), at
/// any SM clock: what a tick shows is carried to a reference clock (a prompt token's
/// time as 1/clock: compute-bound; a decode step's as 1/clock^`DECODE_CLOCK_EXPONENT`:
/// it streams the weights and the cache as much as it computes) and back to the clock
/// asked about ([`StepModel::at_clock`]), so a rung not yet visited is predicted from
/// the rungs that were.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepModel {
    /// A decode step, in ms (the p50 time per token where few steps carry prompts).
    decode_ms: Ewma,
    /// Seconds of prompt-carrying steps per prompt token, at the budget `at_budget`.
    prefill_s_per_token: Ewma,
    /// The chunk (budget less the sequences decoding) those were measured with.
    chunk: Ewma,
    /// Mean prompt length, tokens.
    prompt_tokens: Ewma,
    /// The measured p99 time to first token over the plain mean prediction.
    tail: Ewma,
    /// The plain mean prediction of the last tick, to compare with the next tick's TTFT.
    last_plain_ms: Option<f64>,
    /// The clock the predictions are for, MHz (the last tick's, or [`StepModel::at_clock`]'s).
    clock_mhz: f64,
    backlog: PromptBacklog,
}

impl Default for StepModel {
    fn default() -> StepModel {
        StepModel::new()
    }
}

impl StepModel {
    pub fn new() -> StepModel {
        StepModel {
            decode_ms: Ewma::new(0.3),
            prefill_s_per_token: Ewma::new(0.3),
            chunk: Ewma::new(0.3),
            prompt_tokens: Ewma::new(0.1),
            tail: Ewma::new(0.2),
            last_plain_ms: None,
            clock_mhz: REFERENCE_MHZ,
            backlog: PromptBacklog::default(),
        }
    }

    /// Forgets what depends on the GPU's speed (after a clock or cap change); the prompt
    /// lengths and their tail are the workload's and stay.
    pub fn forget_speed(&mut self) {
        self.decode_ms.clear();
        self.prefill_s_per_token.clear();
        self.chunk.clear();
        self.last_plain_ms = None;
    }

    /// The same model, predicting at `mhz` (a clock not finite or not above zero leaves
    /// it where it is).
    pub fn at_clock(&self, mhz: f64) -> StepModel {
        let mut model = *self;
        if mhz.is_finite() && mhz > 0.0 {
            model.clock_mhz = mhz;
        }
        model
    }

    /// The clock the predictions are for, MHz.
    pub fn clock_mhz(&self) -> f64 {
        self.clock_mhz
    }

    /// Learns from one tick.
    pub fn observe(&mut self, observation: &Observation) {
        // The backlog counts every tick, settling or not: requests arrive regardless.
        self.backlog.observe(observation);
        if observation.settling {
            self.last_plain_ms = None;
            return;
        }
        let clock = f64::from(observation.sm_clock_mhz);
        if clock > 0.0 {
            self.clock_mhz = clock;
        }
        let (decode_scale, prompt_scale) = self.scales();
        let prompt = PromptTick::of(observation);
        let share = prompt.map_or(0.0, |p| p.share);
        if share < DECODE_ONLY_SHARE && observation.tokens > 0 {
            self.decode_ms.push(observation.tpot_p50_ms / decode_scale);
        }
        let Some(prompt) = prompt else {
            return;
        };
        let budget = f64::from(observation.in_force.token_budget);
        let chunk = budget - f64::from(observation.active_sequences);
        if chunk >= 1.0 {
            self.chunk.push(chunk);
        }
        // The seconds per prompt token mix both costs (s = a / C + c): carried at the
        // prompt token's scale, the error is the decode share's, a few percent.
        self.prefill_s_per_token
            .push(prompt.prefill_s / prompt.prefill_tokens / prompt_scale);
        if prompt.first_tokens > 0 {
            self.prompt_tokens
                .push(prompt.prefill_tokens / prompt.first_tokens as f64);
        }
        if let (Some(measured), Some(plain)) = (prompt.ttft_p99_ms, self.last_plain_ms)
            && plain > 0.0
        {
            self.tail
                .push((measured / plain).clamp(TAIL_RANGE.0, TAIL_RANGE.1));
        }
        self.last_plain_ms = self.plain_ttft_ms(
            self.waiting_prompt_tokens(),
            observation.in_force.token_budget,
            observation.active_sequences,
        );
    }

    /// Whether it has measured prompts at all.
    pub fn knows_prompts(&self) -> bool {
        self.prefill_s_per_token.get().is_some()
    }

    pub fn mean_prompt_tokens(&self) -> Option<f64> {
        self.prompt_tokens.get()
    }

    /// A decode step at the model's clock, ms.
    pub fn decode_ms(&self) -> Option<f64> {
        Some(self.decode_ms.get()? * self.scales().0)
    }

    /// How much longer than at the reference clock a decode step and a prompt token take
    /// at the model's clock.
    fn scales(&self) -> (f64, f64) {
        let ratio = REFERENCE_MHZ / self.clock_mhz.max(1.0);
        (ratio.powf(DECODE_CLOCK_EXPONENT), ratio)
    }

    /// `(a, c)`: a decode step and a prompt token, in seconds. `c` comes from the
    /// measured seconds per prompt token `s` at chunk `C` through `s = a / C + c`; where
    /// `a` is unknown yet, or that leaves too little (the chunks were not full), a
    /// prompt token keeps at least a fifth of `s`.
    fn costs(&self) -> Option<(f64, f64)> {
        let per_token = self.prefill_s_per_token.get()? * self.scales().1;
        let chunk = self.chunk.get().unwrap_or(1.0).max(1.0);
        let a = self.decode_ms().map_or(0.0, |ms| ms / 1000.0);
        let c = (per_token - a / chunk).max(per_token / 5.0);
        Some((a, c))
    }

    /// Prompt tokens waiting ahead of the last request admitted (see [`PromptBacklog`]:
    /// queued or in the batch waiting for chunks), at the mean prompt learnt; 0 while no
    /// prompt was seen.
    pub fn waiting_prompt_tokens(&self) -> f64 {
        (self.backlog.requests() - 1.0).max(0.0) * self.prompt_tokens.get().unwrap_or(0.0)
    }

    /// Prompt tokens a second while prompts wait, at `budget` with `sequences` decoding.
    pub fn prefill_rate(&self, budget: u32, sequences: u32) -> Option<f64> {
        let (a, c) = self.costs()?;
        let chunk = f64::from(budget) - f64::from(sequences);
        if chunk < 1.0 {
            return Some(0.0);
        }
        Some(chunk / (a + c * chunk))
    }

    /// Predicted p99 time per token at `budget` with `sequences` decoding: a step with a
    /// full chunk. `None` until a decode step and a prompt token have been measured.
    pub fn tpot_p99_ms(&self, budget: u32, sequences: u32) -> Option<f64> {
        let (a, c) = self.costs()?;
        self.decode_ms.get()?;
        let chunk = (f64::from(budget) - f64::from(sequences)).max(0.0);
        Some((a + c * chunk) * 1000.0)
    }

    /// The mean prediction of the time to first token of a prompt arriving behind
    /// `waiting` prompt tokens, ms, before the learnt tail.
    fn plain_ttft_ms(&self, waiting: f64, budget: u32, sequences: u32) -> Option<f64> {
        let prompt = self.prompt_tokens.get()?;
        let rate = self.prefill_rate(budget, sequences)?;
        if rate <= 0.0 {
            return Some(f64::INFINITY);
        }
        Some((waiting.max(0.0) + prompt) / rate * 1000.0)
    }

    /// Predicted p99 time to first token, ms, of the prompts now waiting (`waiting`
    /// prompt tokens: see [`StepModel::waiting_prompt_tokens`]) at `budget` with `sequences`
    /// decoding. The tail (how far the measured p99 ran above the mean prediction: the
    /// long prompts, the arrivals between ticks) is learnt; until a tick shows it, 2.
    pub fn ttft_p99_ms(&self, waiting: f64, budget: u32, sequences: u32) -> Option<f64> {
        let plain = self.plain_ttft_ms(waiting, budget, sequences)?;
        Some(plain * self.tail.get().unwrap_or(2.0))
    }
}

/// Requests admitted whose first token has not come yet: those queued for a batch slot
/// and those in the batch waiting for their prompt's chunks. The second kind never
/// shows in the queue depth (a serving engine admits a prompt to the batch, then
/// prefills it a chunk a step), so the count is kept from the demand: requests admitted
/// (arrived less turned away) less first tokens, tick by tick, held within what is in
/// flight and queued, and emptied by a tick that prefilled nothing with nobody queued
/// (chunked prefill takes any prompt waiting, so none was).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PromptBacklog {
    pending: f64,
}

impl PromptBacklog {
    pub fn observe(&mut self, observation: &Observation) {
        let (Some(demand), Some(requests)) =
            (observation.demand.as_ref(), observation.requests.as_ref())
        else {
            return;
        };
        let admitted = demand
            .requests_arrived
            .saturating_sub(demand.requests_turned_away);
        let most = f64::from(observation.active_sequences) + f64::from(observation.queue_depth);
        self.pending = (self.pending + admitted as f64 - requests.first_tokens as f64)
            .clamp(0.0, most.max(0.0));
        if requests.prefill_tokens == 0 && observation.queue_depth == 0 {
            self.pending = 0.0;
        }
    }

    /// Requests waiting for their first token.
    pub fn requests(&self) -> f64 {
        self.pending
    }
}

/// The latency bounds a budget answers to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetBounds {
    /// p99 time per token, ms.
    pub tpot_ms: Option<f64>,
    /// The share of `tpot_ms` a full chunk's step is held to: under the margin a clock
    /// search keeps (a window's mean p99 within it is out of bounds), so the budget does
    /// not hold the clock up.
    pub tpot_share: f64,
    /// The most of the busy time prompts may take (a GPU that spends all of it on prompts
    /// falls behind its decodes and its arrivals).
    pub prefill_share_max: f64,
}

impl BudgetBounds {
    /// The bounds `objective` sets.
    pub fn of(objective: &Objective) -> BudgetBounds {
        BudgetBounds {
            tpot_ms: objective.tpot_p99_limit_ms.filter(|ms| *ms > 0.0),
            tpot_share: 0.83,
            prefill_share_max: 0.8,
        }
    }
}

/// The largest of `candidates` whose step with a full chunk is predicted within the TPOT
/// bound's share, for `sequences` decoding; `None` where none is (or the model cannot
/// tell yet, or there is no TPOT bound: then every budget is).
pub fn largest_budget_within_tpot(
    model: &StepModel,
    bounds: &BudgetBounds,
    candidates: &[u32],
    sequences: u32,
) -> Option<u32> {
    let limit_ms = bounds.tpot_ms?;
    let mut best = None;
    for &budget in candidates {
        if budget <= sequences {
            continue;
        }
        if model.tpot_p99_ms(budget, sequences)? <= limit_ms * bounds.tpot_share {
            best = best.max(Some(budget));
        }
    }
    best
}

/// The budget of `candidates` for `sequences` decoding: the largest whose step with a
/// full chunk keeps the TPOT bound (see [`largest_budget_within_tpot`]). A larger chunk
/// only helps first tokens (prompts go through faster) and prefill efficiency (a large
/// chunk fills the tensor cores' tiles), so of the budgets that keep TPOT the largest
/// leaves a clock search the most room to go down before first tokens bind; it is
/// where the TPOT bound is answered with smaller chunks. Without a TPOT bound, the
/// largest candidate; where none keeps it, the smallest above the sequences decoding
/// (the clock must rise: the search's to see). Never one under which prompts would take
/// more than `prefill_share_max` of the busy time, given `share_now`, the share they
/// take at the budget in force: (share, budget). `None` while the model cannot predict.
pub fn choose_budget(
    model: &StepModel,
    bounds: &BudgetBounds,
    candidates: &[u32],
    sequences: u32,
    share_now: Option<(f64, u32)>,
) -> Option<u32> {
    let largest = candidates.iter().copied().max()?;
    if bounds.tpot_ms.is_none() {
        return Some(largest);
    }
    model.tpot_p99_ms(largest, sequences)?;
    let mut chosen = match largest_budget_within_tpot(model, bounds, candidates, sequences) {
        Some(budget) => budget,
        None => candidates
            .iter()
            .copied()
            .filter(|&budget| budget > sequences)
            .min()
            .unwrap_or(largest),
    };
    // The share of time on prompts scales with a prompt token's time at each budget: the
    // smallest budget that keeps it under the most.
    if let Some((share, at)) = share_now
        && let Some(now) = model.prefill_rate(at, sequences)
    {
        let keeps_share = |budget: u32| {
            model
                .prefill_rate(budget, sequences)
                .is_some_and(|then| then > 0.0 && share * now / then <= bounds.prefill_share_max)
        };
        if !keeps_share(chosen)
            && let Some(least) = candidates
                .iter()
                .copied()
                .filter(|&budget| budget > chosen && keeps_share(budget))
                .min()
        {
            chosen = least;
        }
    }
    Some(chosen)
}

/// The share of busy time spent on prompts, smoothed, and which way to slow the GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PhaseMix {
    share: Ewma,
    prefers_cap: bool,
    /// Above this share a power cap is preferred…
    pub cap_above: f64,
    /// …and below this one a clock lock again (the gap keeps a mix near the line from
    /// flipping the knob, which restarts a search each time).
    pub lock_below: f64,
}

impl PhaseMix {
    /// Starts on the clock lock.
    pub fn new(cap_above: f64, lock_below: f64) -> PhaseMix {
        PhaseMix {
            share: Ewma::new(0.05),
            prefers_cap: false,
            cap_above,
            lock_below: lock_below.min(cap_above),
        }
    }

    /// Takes a tick in; returns whether the preference changed. A tick without a
    /// share (decode only, or idle) counts as no prompt work only where the GPU worked.
    pub fn observe(&mut self, observation: &Observation) -> bool {
        if observation.settling || observation.tokens == 0 {
            return false;
        }
        let share = observation
            .requests
            .as_ref()
            .and_then(|r| r.prefill_time_share)
            .filter(|s| s.is_finite())
            .map_or(0.0, |s| s.clamp(0.0, 1.0));
        self.share.push(share);
        let before = self.prefers_cap;
        if let Some(mean) = self.share.get() {
            if mean > self.cap_above {
                self.prefers_cap = true;
            } else if mean < self.lock_below {
                self.prefers_cap = false;
            }
        }
        before != self.prefers_cap
    }

    pub fn share(&self) -> Option<f64> {
        self.share.get()
    }

    /// Whether a power cap is the better knob for the mix seen.
    pub fn prefers_cap(&self) -> bool {
        self.prefers_cap
    }
}

#[cfg(test)]
#[path = "serving_tests.rs"]
mod tests;
