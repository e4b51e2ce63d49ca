//! The serving engine of one simulated GPU: requests queue for a batch slot, have their
//! prompt prefilled in chunks beside the decoding sequences, then decode one token a step
//! until their output is done.
//!
//! Each step processes every decoding sequence's next token, then as many prompt tokens as
//! the step's token budget leaves, oldest prompt first: vLLM's and SGLang's chunked
//! prefill. The budget starts at the scenario's `max_batched_tokens`, the most it may be;
//! the token budget knob ([`Server::set_budget`]) moves it between steps. The last prompt token's step gives the request its first
//! token (time to first token: arrival to then). A decoding sequence's KV cache grows a
//! position a step; when the cache is full, the latest arrival among the decoding
//! sequences is preempted (its cache dropped, its prompt and output so far prefilled again
//! later), as vLLM's recompute preemption does. Each step's energy is shared over the
//! tokens it processed, and a request's energy is its share summed over its life.
//!
//! Time is continuous in steps (the fluid view of [`super::gpu`]): the caller asks how many
//! steps remain to the next event at the current load, advances by at most that many, and
//! the composition of a step never changes between events.
//!
//! A decode-only scenario (no prompts) is the special case of prompts of no tokens over a
//! fixed context: a request decodes from its first step, its context never grows, and the
//! KV cache is sized by the batch limit instead.
//!
//! One file because a request moves through the server's queues (waiting, prefilling,
//! decoding, paused) under one bookkeeping — KV positions in use, the decode-step clock,
//! energy shares — that every transition here keeps; its tests live in `serving/tests.rs`.

use std::collections::VecDeque;

use super::model::StepLoad;
use super::scenario::Scenario;
use tokwatt_core::types::RequestEnergy;
use tokwatt_core::workload::FinishedRequests;
use tokwatt_core::workload::serving::RequestRecord;

/// Two step counts (or token counts) closer than this are the same (float round-off).
const EPSILON: f64 = 1e-6;

/// Finished requests kept between two takes ([`Server::take_finished`]); more are counted
/// as dropped.
const FINISHED_KEPT: usize = 1 << 16;

/// What a request's record needs, carried through its states.
#[derive(Debug, Clone, Copy)]
struct Life {
    id: u64,
    arrival_s: f64,
    /// When it first got a batch slot (NaN before).
    admitted_s: f64,
    first_token_s: Option<f64>,
    prompt: u32,
    output: u32,
}

/// A request that has not got a batch slot yet, or is prefilling in one.
#[derive(Debug, Clone, Copy)]
struct Pending {
    life: Life,
    /// Tokens to prefill before its next token: its prompt, or after a preemption all it
    /// had (prompt and output so far).
    prompt: u32,
    prefilled: f64,
    /// Tokens it still has to generate.
    output_left: u32,
    /// Its first token came already (a preempted sequence prefilled again).
    first_token_done: bool,
    /// The tokens of the step that ends its prompt, fixed when that step starts (0: not
    /// yet): every prompt a step holds whole ends with that step, together.
    final_chunk: f64,
    /// Its wait for a first slot was counted.
    slotted_before: bool,
    energy_j: f64,
}

impl Pending {
    fn remaining(&self) -> f64 {
        (f64::from(self.prompt) - self.prefilled).max(0.0)
    }

    /// Its tokens in a step with `left` tokens of room, and the steps to its next event
    /// at that share. Its final chunk once that started (a step's composition is fixed at
    /// its start: a step cut by an event goes on with the same chunk). The oldest prompt
    /// (`first`), longer than the room, goes in chunks of the room from its start: a chunk
    /// under way goes on to its end, and the rest is its final chunk only from a chunk's
    /// end, a step of its own shared with the next prompts. Else as much as fits.
    fn step_take(&self, left: f64, first: bool) -> (f64, f64) {
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
struct Decoding {
    /// The decode-step count at which it has generated its last token.
    finish: f64,
    /// Its context is `context_base + growth · decode_steps`.
    context_base: f64,
    /// Its energy is `energy_base +` the per-sequence decode energy so far.
    energy_base: f64,
    life: Life,
}

/// A decoding sequence paused by a batch-size cut (it keeps its KV cache).
#[derive(Debug, Clone, Copy)]
struct Paused {
    left: f64,
    context: f64,
    energy_j: f64,
    life: Life,
}

/// What a step of the current load leads to next.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Next {
    /// Nothing to run.
    Idle,
    /// Steps of `load` until a sequence finishes, a prompt is done or the cache fills.
    Steps { load: StepLoad, until_event: f64 },
}

/// Counts for the workload window, taken and reset by [`Server::take_window`].
#[derive(Debug, Clone, Default)]
pub(super) struct ServerWindow {
    /// Queue waits (arrival to a first batch slot), ms.
    pub queue_waits_ms: Vec<f64>,
    /// Times to first token, ms.
    pub ttfts_ms: Vec<f64>,
    pub prefill_tokens: f64,
    pub preemptions: u64,
    pub energy: RequestEnergy,
}

#[derive(Debug, Clone)]
pub(super) struct Server {
    /// Tokens one step may process: 1 to `budget_max`.
    budget: u32,
    /// The scenario's `max_batched_tokens`: what the engine was sized for.
    budget_max: u32,
    /// 1 when contexts grow as sequences decode; 0 for a decode-only scenario.
    growth: f64,
    /// The fixed context of a decode-only scenario.
    fixed_context: f64,
    /// KV-cache positions the memory holds beside the weights; `None`: sized by the batch
    /// limit (decode only).
    kv_capacity: Option<f64>,
    queue_max: u32,

    /// Decode steps every decoding sequence has taken together.
    decode_steps: f64,
    /// Decode energy one sequence has been charged since the start (cumulative, joules).
    decode_energy_per_sequence: f64,
    /// Ascending by `finish`.
    running: VecDeque<Decoding>,
    context_base_sum: f64,
    /// The largest `context_base` of `running` (the longest row's context, less growth).
    context_base_max: f64,
    paused: Vec<Paused>,
    paused_context_sum: f64,
    /// Oldest first; at most `queue_max` that never had a slot.
    queue: VecDeque<Pending>,
    /// Prompts being prefilled, oldest first.
    prefilling: VecDeque<Pending>,
    /// (decode-step count of its first token, request id, arrival) of decode-only
    /// sequences whose first token is still to come, in admission order.
    first_tokens_due: VecDeque<(f64, u64, f64)>,
    /// Finished since the last take, at most [`FINISHED_KEPT`]; and those not kept.
    finished: Vec<RequestRecord>,
    finished_dropped: u64,

    pub(super) arrived: u64,
    pub(super) turned_away: u64,
    pub(super) completed: u64,
    pub(super) tokens: f64,
    pub(super) tokens_demanded: u64,
    pub(super) first_tokens: u64,
    window: ServerWindow,
}

impl Server {
    /// A server for `scenario`; `kv_capacity_tokens` is what the memory holds beside the
    /// weights (used only when requests have prompts).
    pub(super) fn new(scenario: &Scenario, kv_capacity_tokens: f64) -> Self {
        let with_prompts = scenario.requests.is_some();
        Self {
            budget: scenario.max_batched_tokens,
            budget_max: scenario.max_batched_tokens,
            growth: if with_prompts { 1.0 } else { 0.0 },
            fixed_context: f64::from(scenario.context_tokens),
            kv_capacity: with_prompts.then_some(kv_capacity_tokens),
            queue_max: scenario.queue_max,
            decode_steps: 0.0,
            decode_energy_per_sequence: 0.0,
            running: VecDeque::new(),
            context_base_sum: 0.0,
            context_base_max: f64::NEG_INFINITY,
            paused: Vec::new(),
            paused_context_sum: 0.0,
            queue: VecDeque::new(),
            prefilling: VecDeque::new(),
            first_tokens_due: VecDeque::new(),
            arrived: 0,
            turned_away: 0,
            completed: 0,
            tokens: 0.0,
            tokens_demanded: 0,
            first_tokens: 0,
            finished: Vec::new(),
            finished_dropped: 0,
            window: ServerWindow::default(),
        }
    }

    /// Whether requests bring prompts to prefill.
    pub(super) fn has_prompts(&self) -> bool {
        self.kv_capacity.is_some()
    }

    /// The token budget's range, where requests bring prompts: 1 to the scenario's
    /// `max_batched_tokens`. A decode-only scenario has no budget to move (its steps
    /// are its decoding sequences, whatever the budget).
    pub(super) fn budget_range(&self) -> Option<(u32, u32)> {
        self.has_prompts().then_some((1, self.budget_max))
    }

    pub(super) fn budget(&self) -> u32 {
        self.budget
    }

    /// The token budget from the next step on (the caller checked it against
    /// [`Server::budget_range`]; held within it all the same).
    pub(super) fn set_budget(&mut self, tokens: u32) {
        self.budget = tokens.clamp(1, self.budget_max);
    }

    pub(super) fn decode_steps(&self) -> f64 {
        self.decode_steps
    }

    /// Sequences holding a batch slot: decoding or prefilling.
    pub(super) fn in_slots(&self) -> usize {
        self.running.len() + self.prefilling.len()
    }

    pub(super) fn decoding(&self) -> u32 {
        u32::try_from(self.running.len()).unwrap_or(u32::MAX)
    }

    /// Requests waiting for a slot, sequences paused by a batch cut included.
    pub(super) fn waiting(&self) -> u64 {
        (self.queue.len() + self.paused.len()) as u64
    }

    /// Room in the queue for new arrivals.
    pub(super) fn queue_room(&self) -> u64 {
        u64::from(self.queue_max).saturating_sub(self.queue.len() as u64)
    }

    /// One arrival of `prompt` and `output` tokens at `arrival_s`: queued, or turned away
    /// when the queue is full.
    pub(super) fn arrive(&mut self, arrival_s: f64, prompt: u32, output: u32) {
        self.arrived += 1;
        self.tokens_demanded += u64::from(output);
        if self.queue_room() == 0 {
            self.turned_away += 1;
            return;
        }
        let life = Life {
            id: self.arrived,
            arrival_s,
            admitted_s: f64::NAN,
            first_token_s: None,
            prompt,
            output,
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

    fn context_of(&self, d: &Decoding) -> f64 {
        d.context_base + self.growth * self.decode_steps
    }

    /// The step the server would run now, and how many of it until the next event.
    pub(super) fn next(&self) -> Next {
        let decode = self.decoding();
        let mut left = f64::from(self.budget.saturating_sub(decode));
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

    /// Run `steps` steps of `load`, `step_s` each (no event inside them), ending at
    /// `end_s`; they drew `energy_j`.
    pub(super) fn advance(
        &mut self,
        load: &StepLoad,
        steps: f64,
        step_s: f64,
        energy_j: f64,
        end_s: f64,
    ) {
        let processed = steps * (f64::from(load.decode) + load.prefill);
        let per_token_j = if processed > 0.0 {
            energy_j / processed
        } else {
            0.0
        };
        if load.decode > 0 {
            self.decode_steps += steps;
            self.tokens += steps * f64::from(load.decode);
            self.decode_energy_per_sequence += per_token_j * steps;
            self.note_due_first_tokens(step_s, end_s);
        }
        self.window.prefill_tokens += load.prefill * steps;
        // The same shares as `next` gave the step (they sum to its prefill).
        let mut left = load.prefill;
        for pending in self.prefilling.iter_mut() {
            if left <= 0.0 {
                break;
            }
            let (take, _) = pending.step_take(left, left >= load.prefill);
            if take <= 0.0 {
                continue;
            }
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
        }
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

    fn stop_decoding(&mut self, sequence: &Decoding) {
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
    }

    fn finish_request(&mut self, life: Life, energy_j: f64, finish_s: f64) {
        self.completed += 1;
        self.window.energy.record(energy_j);
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
            energy_j: Some(energy_j),
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
            self.stop_decoding(&head);
            let finish_s = end_s - (self.decode_steps - head.finish).max(0.0) * step_s;
            self.finish_request(
                head.life,
                head.energy_base + self.decode_energy_per_sequence,
                finish_s,
            );
        }
    }

    /// Moves the requests finished since the last call into `into`.
    pub(super) fn take_finished(&mut self, into: &mut FinishedRequests) {
        into.records.append(&mut self.finished);
        into.dropped += std::mem::take(&mut self.finished_dropped);
    }

    /// A full KV cache: the latest arrival among the decoding sequences (else the latest
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
            let requeued = if let Some(i) = latest
                && let Some(victim) = self.running.remove(i)
            {
                self.stop_decoding(&victim);
                let context = self.context_of(&victim).ceil();
                // A step is whole: the part of one under way is lost with the cache.
                let left = (victim.finish - self.decode_steps).max(0.0);
                let whole_left = left.ceil().max(1.0);
                self.tokens -= whole_left - left;
                Pending {
                    life: victim.life,
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
            self.window.preemptions += 1;
            self.queue.push_front(requeued);
        }
    }

    /// Slots in use = min(batch size, requests in the system): pause the decoding
    /// sequences with the most tokens left when the batch shrank (then send prompts being
    /// prefilled back to the queue's head), fill free slots (paused sequences first: they
    /// waited already). A prompt takes a slot only when the KV cache has room for it.
    /// `now_s` is when the slots open.
    pub(super) fn rebalance(&mut self, now_s: f64, batch: u32) {
        let batch = batch as usize;
        while self.in_slots() > batch {
            if let Some(sequence) = self.running.pop_back() {
                self.stop_decoding(&sequence);
                let context = self.context_of(&sequence);
                self.paused_context_sum += context;
                self.paused.push(Paused {
                    left: sequence.finish - self.decode_steps,
                    context,
                    energy_j: sequence.energy_base + self.decode_energy_per_sequence,
                    life: sequence.life,
                });
            } else if let Some(mut prompt) = self.prefilling.pop_back() {
                prompt.prefilled = 0.0;
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
            self.queue.pop_front();
            let mut head = head;
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
    pub(super) fn take_window(&mut self) -> ServerWindow {
        std::mem::take(&mut self.window)
    }

    /// Put the emptied buffers back, for reuse.
    pub(super) fn return_buffers(&mut self, mut waits: Vec<f64>, mut ttfts: Vec<f64>) {
        waits.clear();
        ttfts.clear();
        self.window.queue_waits_ms = waits;
        self.window.ttfts_ms = ttfts;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests;
