//! One file because a request moves through the scheduler's queues (waiting, prefilling,
//! decoding, paused) under one bookkeeping — KV positions in use, slots, the decode-step
//! clock, energy shares — that every transition here keeps; the step-by-step face is
//! `discrete.rs`, the tests `tests.rs` and `run_tests.rs`.
//!
//! Time is counted in steps, and a count may be a real number (the simulator's fluid
//! view): [`Scheduler::next`] says how many steps of the current composition remain to the
//! next event, [`Scheduler::advance`] applies at most that many at once, and the
//! composition of a step never changes between events. Whole steps give exactly the
//! discrete scheduler's steps.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use super::{KvCache, Request, RequestRecord, ServingError, ServingLimits, StepLoad};
use crate::types::RequestEnergy;
use crate::workload::FinishedRequests;

/// Two step counts (or token counts) closer than this are the same (float round-off).
pub(super) const EPSILON: f64 = 1e-6;

/// Finished requests kept between two takes; more are counted as dropped.
const FINISHED_KEPT: usize = 1 << 16;

/// A request holding no slot.
const NO_SLOT: u32 = u32::MAX;

/// What a request's record needs, carried through its states.
#[derive(Debug, Clone, Copy)]
pub(super) struct Life {
    id: u64,
    arrival_s: f64,
    /// When it first got a batch slot (NaN before).
    admitted_s: f64,
    first_token_s: Option<f64>,
    prompt: u32,
    output: u32,
    /// The KV slot it holds ([`NO_SLOT`]: none).
    pub(super) slot: u32,
    /// A step of its life ran without an energy counter: its energy is unknown.
    pub(super) energy_gap: bool,
}

/// A request that has not got a batch slot yet, or is prefilling in one.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pending {
    pub(super) life: Life,
    /// Tokens to prefill before its next token: its prompt, or after a preemption all it
    /// had (prompt and output so far).
    pub(super) prompt: u32,
    pub(super) prefilled: f64,
    /// Tokens it still has to generate.
    output_left: u32,
    /// Its first token came already (a preempted sequence prefilled again).
    first_token_done: bool,
    /// The tokens of the step that ends its prompt, fixed when that step starts (0: not
    /// yet): every prompt a step holds whole ends with that step, together.
    final_chunk: f64,
    /// Its wait for a first slot was counted.
    slotted_before: bool,
    pub(super) energy_j: f64,
}

impl Pending {
    pub(super) fn remaining(&self) -> f64 {
        (f64::from(self.prompt) - self.prefilled).max(0.0)
    }

    /// Its tokens in a step with `left` tokens of room, and the steps to its next event
    /// at that share. Its final chunk once that started (a step's composition is fixed at
    /// its start: a step cut by an event goes on with the same chunk). The oldest prompt
    /// (`first`), longer than the room, goes in chunks of the room from its start: a chunk
    /// under way goes on to its end, and the rest is its final chunk only from a chunk's
    /// end, a step of its own shared with the next prompts. Else as much as fits. In whole
    /// steps this is `min(rest, room)`, vLLM's chunk.
    pub(super) fn step_take(&self, left: f64, first: bool) -> (f64, f64) {
        let remaining = self.remaining();
        if self.final_chunk > 0.0 {
            let take = self.final_chunk.min(left).max(0.0);
            return (take, remaining / take);
        }
        if first && left > 0.0 {
            let chunks_done = (self.prefilled / left + EPSILON).floor();
            let boundary = (chunks_done + 1.0) * left;
            let to_boundary = (boundary - self.prefilled) / left;
            let mid_chunk = to_boundary < 1.0 - EPSILON && boundary < f64::from(self.prompt);
            if mid_chunk || remaining > left {
                return (left, to_boundary.max(EPSILON));
            }
        }
        let take = remaining.min(left).max(0.0);
        (take, remaining / take)
    }

    /// The prompt position its chunk in the step starts at.
    fn chunk_start(&self) -> f64 {
        if self.final_chunk > 0.0 {
            f64::from(self.prompt) - self.final_chunk
        } else {
            self.prefilled
        }
    }
}

/// A decoding sequence.
#[derive(Debug, Clone, Copy)]
pub(super) struct Decoding {
    /// The decode-step count at which it has generated its last token.
    finish: f64,
    /// Its context is `context_base + growth · decode_steps`.
    context_base: f64,
    /// Its energy is `energy_base +` the per-sequence decode energy so far.
    energy_base: f64,
    /// Decode steps without energy before it started decoding.
    gaps_base: u64,
    pub(super) life: Life,
}

/// A decoding sequence paused by a cut of the running limit (it keeps its KV cache).
#[derive(Debug, Clone, Copy)]
struct Paused {
    left: f64,
    context: f64,
    energy_j: f64,
    life: Life,
}

/// What a step of the current load leads to next.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Next {
    /// Nothing to run.
    Idle,
    /// Steps of `load` until a sequence finishes, a prompt is done or the cache fills
    /// (`until_event` steps, a real number).
    Steps { load: StepLoad, until_event: f64 },
}

/// Counts for a window, taken and reset by [`Scheduler::take_counts`].
#[derive(Debug, Clone, Default)]
pub struct SchedulerWindow {
    /// Queue waits (arrival to a first batch slot), ms.
    pub queue_waits_ms: Vec<f64>,
    /// Times to first token, ms.
    pub ttfts_ms: Vec<f64>,
    pub prefill_tokens: f64,
    pub preemptions: u64,
    /// The finished requests' energy (those whose energy is known).
    pub energy: RequestEnergy,
}

/// The scheduler of one engine: see the module's documentation.
#[derive(Debug, Clone)]
pub struct Scheduler {
    /// Tokens one step may process: 1 to `budget_max`.
    pub(super) budget: u32,
    /// What the engine was sized for.
    budget_max: u32,
    /// The running limit (the batch size knob): sequences holding a batch slot.
    running_limit: u32,
    /// 1 when contexts grow as sequences decode; 0 decode only.
    growth: f64,
    /// The fixed context of a decode-only engine.
    fixed_context: f64,
    /// KV-cache positions of a pool; `None`: no pool.
    kv_capacity: Option<f64>,
    /// Slots and their context, where the cache is slots.
    slot_cache: Option<(u32, u32)>,
    queue_max: u32,
    /// Free slots below `next_slot`, the lowest taken first (keeps the engine's rows
    /// compact).
    free_slots: BinaryHeap<Reverse<u32>>,
    next_slot: u32,

    /// Decode steps every decoding sequence has taken together.
    pub(super) decode_steps: f64,
    /// Decode energy one sequence has been charged since the start (cumulative, joules).
    decode_energy_per_sequence: f64,
    /// Decode advances that ran without an energy counter, since the start.
    decode_gaps: u64,
    /// Ascending by `finish`.
    pub(super) running: VecDeque<Decoding>,
    context_base_sum: f64,
    /// The largest `context_base` of `running` (the longest row's context, less growth).
    context_base_max: f64,
    paused: Vec<Paused>,
    paused_context_sum: f64,
    /// Oldest first; at most `queue_max` that never had a slot.
    queue: VecDeque<Pending>,
    /// Prompts being prefilled, oldest first.
    pub(super) prefilling: VecDeque<Pending>,
    /// (decode-step count of its first token, request id, arrival) of decode-only
    /// sequences whose first token is still to come, in admission order.
    first_tokens_due: VecDeque<(f64, u64, f64)>,
    /// Finished since the last take, at most [`FINISHED_KEPT`]; and those not kept.
    finished: Vec<RequestRecord>,
    finished_dropped: u64,
    truncated: u64,

    arrived: u64,
    turned_away: u64,
    completed: u64,
    tokens: f64,
    tokens_demanded: u64,
    first_tokens: u64,
    pub(super) window: SchedulerWindow,
    pub(super) steps_window: super::discrete::StepsWindow,
}

impl Scheduler {
    /// A scheduler over `limits.slots` KV slots of `limits.context` positions (tokwatt's
    /// CUDA engine), admitting at most `running_limit` at once.
    pub fn new(limits: ServingLimits, running_limit: u32) -> Result<Scheduler, ServingError> {
        if limits.slots == 0
            || limits.context < 2
            || limits.max_batched_tokens == 0
            || limits.queue_max == 0
        {
            return Err(ServingError::Limits(limits));
        }
        let cache = KvCache::Slots {
            slots: limits.slots,
            context: limits.context,
        };
        Ok(Self::with_cache(
            cache,
            limits.max_batched_tokens,
            limits.queue_max,
            running_limit,
        ))
    }

    /// A scheduler over `cache`, with a token budget of at most `max_batched_tokens` (where
    /// it starts), turning arrivals away beyond `queue_max` waiting.
    pub fn with_cache(
        cache: KvCache,
        max_batched_tokens: u32,
        queue_max: u32,
        running_limit: u32,
    ) -> Self {
        let (growth, fixed_context, kv_capacity, slot_cache) = match cache {
            KvCache::Slots { slots, context } => (1.0, 0.0, None, Some((slots, context))),
            KvCache::Pool { positions } => (1.0, 0.0, Some(positions), None),
            KvCache::DecodeOnly { context } => (0.0, f64::from(context), None, None),
        };
        let mut scheduler = Self {
            budget: max_batched_tokens,
            budget_max: max_batched_tokens,
            running_limit,
            growth,
            fixed_context,
            kv_capacity,
            slot_cache,
            queue_max,
            free_slots: BinaryHeap::new(),
            next_slot: 0,
            decode_steps: 0.0,
            decode_energy_per_sequence: 0.0,
            decode_gaps: 0,
            running: VecDeque::new(),
            context_base_sum: 0.0,
            context_base_max: f64::NEG_INFINITY,
            paused: Vec::new(),
            paused_context_sum: 0.0,
            queue: VecDeque::new(),
            prefilling: VecDeque::new(),
            first_tokens_due: VecDeque::new(),
            finished: Vec::new(),
            finished_dropped: 0,
            truncated: 0,
            arrived: 0,
            turned_away: 0,
            completed: 0,
            tokens: 0.0,
            tokens_demanded: 0,
            first_tokens: 0,
            window: SchedulerWindow::default(),
            steps_window: Default::default(),
        };
        scheduler.set_running_limit(running_limit);
        scheduler
    }

    /// Whether requests bring prompts to prefill (not a decode-only engine).
    pub fn has_prompts(&self) -> bool {
        self.growth > 0.0
    }

    /// The token budget's range, where requests bring prompts: 1 to `max_batched_tokens`.
    /// A decode-only engine has no budget to move (its steps are its decoding sequences).
    pub fn token_budget_range(&self) -> Option<(u32, u32)> {
        self.has_prompts().then_some((1, self.budget_max))
    }

    /// The token budget per step (the token budget knob), from the next step on: held
    /// within 1 to `max_batched_tokens`, what the engine was sized for.
    pub fn set_token_budget(&mut self, tokens: u32) {
        self.budget = tokens.clamp(1, self.budget_max);
    }

    pub fn token_budget(&self) -> u32 {
        self.budget
    }

    /// The running limit (the batch size knob), from the next admission on: a cut pauses
    /// the decoding sequences with the most tokens left (they keep their cache). Held
    /// within 1 and the slots where the cache is slots.
    pub fn set_running_limit(&mut self, limit: u32) {
        self.running_limit = match self.slot_cache {
            Some((slots, _)) => limit.clamp(1, slots),
            None => limit,
        };
    }

    pub fn running_limit(&self) -> u32 {
        self.running_limit
    }

    /// Decode steps taken so far (a real number in the fluid view).
    pub fn decode_steps(&self) -> f64 {
        self.decode_steps
    }

    /// Sequences holding a batch slot: decoding or prefilling.
    pub fn in_slots(&self) -> usize {
        self.running.len() + self.prefilling.len()
    }

    pub fn decoding(&self) -> u32 {
        u32::try_from(self.running.len()).unwrap_or(u32::MAX)
    }

    /// Requests waiting for a slot, sequences paused by a cut included.
    pub fn waiting(&self) -> u64 {
        (self.queue.len() + self.paused.len()) as u64
    }

    /// Room in the queue for new arrivals.
    pub fn queue_room(&self) -> u64 {
        u64::from(self.queue_max).saturating_sub(self.queue.len() as u64)
    }

    /// Requests cut to fit a slot's context so far.
    pub fn truncated(&self) -> u64 {
        self.truncated
    }

    /// Cumulative counts since the start: arrived, turned away, completed, tokens
    /// demanded, first tokens.
    pub fn arrived(&self) -> u64 {
        self.arrived
    }
    pub fn turned_away(&self) -> u64 {
        self.turned_away
    }
    pub fn completed(&self) -> u64 {
        self.completed
    }
    pub fn tokens_demanded(&self) -> u64 {
        self.tokens_demanded
    }
    pub fn first_tokens(&self) -> u64 {
        self.first_tokens
    }
    /// Output tokens generated (a real number in the fluid view).
    pub fn tokens(&self) -> f64 {
        self.tokens
    }

    /// Queues a request, or turns it away when the queue is full (returns false). Where
    /// the cache is slots, a request longer than a slot holds is cut to fit (prompt first,
    /// then output) and counted in [`Scheduler::truncated`].
    pub fn arrive(&mut self, request: Request) -> bool {
        self.arrived += 1;
        self.tokens_demanded += u64::from(request.output);
        if self.queue_room() == 0 {
            self.turned_away += 1;
            return false;
        }
        let (mut prompt, mut output) = (request.prompt, request.output);
        if let Some((_, context)) = self.slot_cache {
            prompt = request.prompt.clamp(1, context - 1);
            output = request.output.clamp(1, context + 1 - prompt);
            if prompt != request.prompt || output != request.output.max(1) {
                self.truncated += 1;
            }
        }
        let life = Life {
            id: self.arrived,
            arrival_s: request.arrival_s,
            admitted_s: f64::NAN,
            first_token_s: None,
            prompt,
            output,
            slot: NO_SLOT,
            energy_gap: false,
        };
        self.queue.push_back(Pending {
            life,
            prompt,
            prefilled: 0.0,
            output_left: output,
            first_token_done: false,
            final_chunk: 0.0,
            slotted_before: false,
            energy_j: 0.0,
        });
        true
    }

    /// KV-cache positions in use.
    fn kv_used(&self) -> f64 {
        self.decode_positions()
            + self.paused_context_sum
            + self.prefilling.iter().map(|p| p.prefilled).sum::<f64>()
    }

    fn decode_positions(&self) -> f64 {
        self.context_base_sum + self.growth * self.running.len() as f64 * self.decode_steps
    }

    /// The longest decoding row's attended positions (0 with none).
    fn decode_position_max(&self) -> f64 {
        if self.running.is_empty() {
            0.0
        } else {
            self.context_base_max + self.growth * self.decode_steps
        }
    }

    pub(super) fn context_of(&self, d: &Decoding) -> f64 {
        d.context_base + self.growth * self.decode_steps
    }

    /// Tokens the budget leaves prompts in a step beside `decode` decoding sequences.
    pub(super) fn prompt_room(&self, decode: u32) -> f64 {
        f64::from(self.budget.saturating_sub(decode))
    }

    /// The step the scheduler would run now, and how many of it until the next event.
    pub fn next(&self) -> Next {
        let decode = self.decoding();
        let mut left = self.prompt_room(decode);
        // Each prompt's share of the step (oldest first) attends to that prompt before it
        // and half its share (causal), to the first order: a large budget packs several
        // short prompts, none of which sees the others. A prompt's event is the end of the
        // step that holds the rest of it whole.
        let mut prefill = 0.0;
        let mut prefill_positions = 0.0;
        let mut until_prompt = f64::INFINITY;
        for pending in &self.prefilling {
            if left <= 0.0 {
                break;
            }
            let (take, until) = pending.step_take(left, prefill <= 0.0);
            if take <= 0.0 {
                continue;
            }
            prefill += take;
            prefill_positions += take * (pending.chunk_start() + take / 2.0);
            until_prompt = until_prompt.min(until);
            left -= take;
        }
        if decode == 0 && prefill <= 0.0 {
            return Next::Idle;
        }
        let load = StepLoad {
            decode,
            decode_positions: self.decode_positions(),
            decode_position_max: self.decode_position_max(),
            prefill,
            prefill_positions,
        };
        let mut until = f64::INFINITY;
        if let Some(head) = self.running.front() {
            until = until.min((head.finish - self.decode_steps).max(0.0));
        }
        until = until.min(until_prompt);
        if let Some(capacity) = self.kv_capacity {
            let grows = self.growth * f64::from(decode) + prefill;
            if grows > 0.0 {
                until = until.min(((capacity - self.kv_used()) / grows).max(0.0));
            }
        }
        Next::Steps {
            load,
            until_event: until,
        }
    }

    /// How many coming steps keep the composition of the next one (until a completion, a
    /// chunk boundary or a full KV cache; arrivals are the caller's): `None` when idle.
    pub fn identical_steps_ahead(&self) -> Option<f64> {
        match self.next() {
            Next::Idle => None,
            Next::Steps { until_event, .. } => Some(until_event),
        }
    }

    /// Runs `steps` steps of `load` (from [`Scheduler::next`], at most its `until_event`
    /// of them), `step_s` each, ending at `end_s`; they drew `energy_j` (`None`: no energy
    /// counter, the requests in them get no energy).
    pub fn advance(
        &mut self,
        load: &StepLoad,
        steps: f64,
        step_s: f64,
        energy_j: Option<f64>,
        end_s: f64,
    ) {
        let processed = steps * (f64::from(load.decode) + load.prefill);
        let per_token_j = match energy_j {
            Some(energy_j) if processed > 0.0 => energy_j / processed,
            _ => 0.0,
        };
        let gap = energy_j.is_none();
        self.advance_decodes(load.decode, steps, per_token_j, gap, step_s, end_s);
        self.window.prefill_tokens += load.prefill * steps;
        // The same shares as `next` gave the step (they sum to its prefill): the same room,
        // the same order.
        let mut left = if load.prefill > 0.0 {
            self.prompt_room(load.decode)
        } else {
            0.0
        };
        let mut first = true;
        for pending in self.prefilling.iter_mut() {
            if left <= 0.0 {
                break;
            }
            let (take, _) = pending.step_take(left, first);
            if take <= 0.0 {
                continue;
            }
            first = false;
            left -= take;
            let remaining = pending.remaining();
            // Its final step starts when its whole rest is its share (a chunk under way
            // may take more than is left of the prompt's rest: not its final chunk).
            if pending.final_chunk <= 0.0 && (take - remaining).abs() <= EPSILON {
                pending.final_chunk = take;
            }
            let done = (take * steps).min(remaining);
            pending.prefilled += done;
            pending.energy_j += done * per_token_j;
            pending.life.energy_gap |= gap;
        }
        self.end_steps(step_s, end_s);
    }

    /// The decoding sequences' part of `steps` steps of `decode` rows.
    pub(super) fn advance_decodes(
        &mut self,
        decode: u32,
        steps: f64,
        per_token_j: f64,
        gap: bool,
        step_s: f64,
        end_s: f64,
    ) {
        if decode > 0 {
            self.decode_steps += steps;
            self.tokens += steps * f64::from(decode);
            self.decode_energy_per_sequence += per_token_j * steps;
            if gap {
                self.decode_gaps += 1;
            }
            self.note_due_first_tokens(step_s, end_s);
        }
    }

    /// What follows a run of steps ending at `end_s`: prompts done decode, sequences done
    /// finish, a full cache preempts.
    pub(super) fn end_steps(&mut self, step_s: f64, end_s: f64) {
        self.promote_prefilled(end_s);
        self.retire_finished(step_s, end_s);
        self.preempt_for_room();
    }

    /// Decode-only sequences whose first step ended by now (`end_s`, steps of `step_s`):
    /// their time to first token, to the step.
    fn note_due_first_tokens(&mut self, step_s: f64, end_s: f64) {
        while let Some(&(due, id, arrival_s)) = self.first_tokens_due.front() {
            if due > self.decode_steps + EPSILON {
                break;
            }
            self.first_tokens_due.pop_front();
            let steps_since = (self.decode_steps - due).max(0.0);
            let at_s = end_s - steps_since * step_s;
            self.first_token(at_s, arrival_s);
            // Its record's first token: the sequence decodes, or waits paused by a cut.
            // From the back: it was admitted a step ago, so it is among the latest to
            // finish (ids are unique, so the order of the search changes nothing).
            let life = self
                .running
                .iter_mut()
                .rev()
                .map(|d| &mut d.life)
                .chain(self.paused.iter_mut().map(|p| &mut p.life))
                .find(|life| life.id == id);
            if let Some(life) = life {
                life.first_token_s.get_or_insert(at_s);
            }
        }
    }

    fn first_token(&mut self, at_s: f64, arrival_s: f64) {
        self.first_tokens += 1;
        self.window.ttfts_ms.push((at_s - arrival_s).max(0.0) * 1e3);
    }

    /// Prompts whose last token was prefilled: their first token, then decoding.
    fn promote_prefilled(&mut self, end_s: f64) {
        while let Some(head) = self.prefilling.front() {
            if head.remaining() > EPSILON {
                break;
            }
            let Some(done) = self.prefilling.pop_front() else {
                break;
            };
            self.tokens += 1.0;
            let mut life = done.life;
            if !done.first_token_done {
                self.first_token(end_s, life.arrival_s);
                life.first_token_s = Some(end_s);
            }
            let left = done.output_left.saturating_sub(1);
            if left == 0 {
                self.finish_request(life, done.energy_j, end_s);
                continue;
            }
            self.start_decoding(Decoding {
                finish: self.decode_steps + f64::from(left),
                context_base: f64::from(done.prompt) - self.growth * self.decode_steps,
                energy_base: done.energy_j - self.decode_energy_per_sequence,
                gaps_base: self.decode_gaps,
                life,
            });
        }
    }

    fn start_decoding(&mut self, sequence: Decoding) {
        self.context_base_sum += sequence.context_base;
        self.context_base_max = self.context_base_max.max(sequence.context_base);
        // Usually the latest to finish (it started last): then its place is the end.
        if self
            .running
            .back()
            .is_none_or(|last| last.finish <= sequence.finish)
        {
            self.running.push_back(sequence);
            return;
        }
        let at = self
            .running
            .partition_point(|d| d.finish <= sequence.finish);
        self.running.insert(at, sequence);
    }

    /// Takes `sequence` (just removed from `running`) out of the sums; its life, with
    /// whether a decode step without energy ran while it decoded.
    fn stop_decoding(&mut self, sequence: &Decoding) -> Life {
        self.context_base_sum -= sequence.context_base;
        if self.running.is_empty() {
            // No drift survives an empty batch.
            self.context_base_sum = 0.0;
        }
        // Only the longest row leaving moves the maximum: then it is found again.
        if sequence.context_base >= self.context_base_max {
            self.context_base_max = self
                .running
                .iter()
                .map(|d| d.context_base)
                .fold(f64::NEG_INFINITY, f64::max);
        }
        let mut life = sequence.life;
        life.energy_gap |= self.decode_gaps > sequence.gaps_base;
        life
    }

    fn take_slot(&mut self) -> u32 {
        match self.free_slots.pop() {
            Some(Reverse(slot)) => slot,
            None => {
                self.next_slot += 1;
                self.next_slot - 1
            }
        }
    }

    fn release_slot(&mut self, slot: u32) {
        if slot != NO_SLOT {
            self.free_slots.push(Reverse(slot));
        }
    }

    /// Whether a slot is free for one more sequence (always, where the cache is no slots).
    fn slot_free(&self) -> bool {
        self.slot_cache
            .is_none_or(|(slots, _)| !self.free_slots.is_empty() || self.next_slot < slots)
    }

    fn finish_request(&mut self, life: Life, energy_j: f64, finish_s: f64) {
        self.completed += 1;
        self.release_slot(life.slot);
        let energy_j = (!life.energy_gap).then_some(energy_j);
        if let Some(energy_j) = energy_j {
            self.window.energy.record(energy_j);
        }
        if self.finished.len() >= FINISHED_KEPT {
            self.finished_dropped += 1;
            return;
        }
        // A decode-only request cut before its first step: its first token is its finish.
        let first_token_s = life.first_token_s.unwrap_or(finish_s);
        self.finished.push(RequestRecord {
            arrival_s: life.arrival_s,
            admitted_s: life.admitted_s,
            first_token_s,
            finish_s,
            prompt: life.prompt,
            output: life.output,
            ttft_ms: 1e3 * (first_token_s - life.arrival_s).max(0.0),
            tpot_ms: (life.output > 1)
                .then(|| 1e3 * (finish_s - first_token_s).max(0.0) / f64::from(life.output - 1)),
            energy_j,
        });
    }

    /// Sequences whose last token came by now (`end_s`, steps of `step_s`), each finished
    /// at its own step.
    fn retire_finished(&mut self, step_s: f64, end_s: f64) {
        while let Some(&head) = self.running.front() {
            if head.finish > self.decode_steps + EPSILON {
                break;
            }
            self.running.pop_front();
            let life = self.stop_decoding(&head);
            let finish_s = end_s - (self.decode_steps - head.finish).max(0.0) * step_s;
            self.finish_request(
                life,
                head.energy_base + self.decode_energy_per_sequence,
                finish_s,
            );
        }
    }

    /// Moves the requests finished since the last call into `into`.
    pub fn take_finished(&mut self, into: &mut FinishedRequests) {
        into.records.append(&mut self.finished);
        into.dropped += std::mem::take(&mut self.finished_dropped);
    }

    /// A full KV pool: the latest arrival among the decoding sequences (else the latest
    /// prompt being prefilled) gives its cache up and queues first, to be prefilled again
    /// with everything it had.
    fn preempt_for_room(&mut self) {
        let Some(capacity) = self.kv_capacity else {
            return;
        };
        while self.kv_used() >= capacity - EPSILON && self.in_slots() > 0 {
            let latest = self
                .running
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.life.arrival_s.total_cmp(&b.1.life.arrival_s))
                .map(|(i, _)| i);
            let mut requeued = if let Some(i) = latest
                && let Some(victim) = self.running.remove(i)
            {
                let life = self.stop_decoding(&victim);
                let context = self.context_of(&victim).ceil();
                // A step is whole: the part of one under way is lost with the cache.
                let left = (victim.finish - self.decode_steps).max(0.0);
                let whole_left = left.ceil().max(1.0);
                self.tokens -= whole_left - left;
                Pending {
                    life,
                    prompt: context as u32,
                    prefilled: 0.0,
                    output_left: whole_left as u32,
                    first_token_done: true,
                    final_chunk: 0.0,
                    slotted_before: true,
                    energy_j: victim.energy_base + self.decode_energy_per_sequence,
                }
            } else if let Some(mut victim) = self.prefilling.pop_back() {
                victim.prefilled = 0.0;
                victim.final_chunk = 0.0;
                victim
            } else {
                break;
            };
            self.release_slot(requeued.life.slot);
            requeued.life.slot = NO_SLOT;
            self.window.preemptions += 1;
            self.queue.push_front(requeued);
        }
    }

    /// Slots in use = min(running limit, requests in the system): pause the decoding
    /// sequences with the most tokens left when the limit fell (then send prompts being
    /// prefilled back to the queue's head), fill free slots (paused sequences first: they
    /// waited already). A prompt takes a slot only when the KV cache has room for it.
    /// `now_s` is when the slots open.
    pub fn rebalance(&mut self, now_s: f64) {
        let batch = self.running_limit as usize;
        while self.in_slots() > batch {
            if let Some(sequence) = self.running.pop_back() {
                let life = self.stop_decoding(&sequence);
                let context = self.context_of(&sequence);
                self.paused_context_sum += context;
                self.paused.push(Paused {
                    left: sequence.finish - self.decode_steps,
                    context,
                    energy_j: sequence.energy_base + self.decode_energy_per_sequence,
                    life,
                });
            } else if let Some(mut prompt) = self.prefilling.pop_back() {
                prompt.prefilled = 0.0;
                self.release_slot(prompt.life.slot);
                prompt.life.slot = NO_SLOT;
                self.queue.push_front(prompt);
            } else {
                break;
            }
        }
        while self.in_slots() < batch {
            if let Some(paused) = self.paused.pop() {
                self.paused_context_sum -= paused.context;
                if self.paused.is_empty() {
                    self.paused_context_sum = 0.0;
                }
                self.start_decoding(Decoding {
                    finish: self.decode_steps + paused.left,
                    context_base: paused.context - self.growth * self.decode_steps,
                    energy_base: paused.energy_j - self.decode_energy_per_sequence,
                    gaps_base: self.decode_gaps,
                    life: paused.life,
                });
                continue;
            }
            let Some(&head) = self.queue.front() else {
                break;
            };
            if let Some(capacity) = self.kv_capacity
                && self.kv_used() + f64::from(head.prompt) > capacity
            {
                break;
            }
            if !self.slot_free() {
                break;
            }
            self.queue.pop_front();
            let mut head = head;
            head.life.slot = self.take_slot();
            if !head.slotted_before {
                self.window
                    .queue_waits_ms
                    .push((now_s - head.life.arrival_s).max(0.0) * 1e3);
                head.life.admitted_s = now_s;
            }
            if head.prompt == 0 {
                // Decode only: it decodes from the next step, over the fixed context.
                let first_step = self.decode_steps + 1.0;
                self.first_tokens_due
                    .push_back((first_step, head.life.id, head.life.arrival_s));
                self.start_decoding(Decoding {
                    finish: self.decode_steps + f64::from(head.output_left),
                    context_base: self.fixed_context,
                    energy_base: head.energy_j - self.decode_energy_per_sequence,
                    gaps_base: self.decode_gaps,
                    life: head.life,
                });
            } else {
                self.prefilling.push_back(Pending {
                    slotted_before: true,
                    ..head
                });
            }
        }
    }

    /// The window's counts, reset.
    pub fn take_counts(&mut self) -> SchedulerWindow {
        std::mem::take(&mut self.window)
    }

    /// Put the emptied buffers back, for reuse.
    pub fn return_buffers(&mut self, mut waits: Vec<f64>, mut ttfts: Vec<f64>) {
        waits.clear();
        ttfts.clear();
        self.window.queue_waits_ms = waits;
        self.window.ttfts_ms = ttfts;
    }
}
