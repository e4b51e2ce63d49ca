//! A discrete serving scheduler: continuous batching with chunked prefill under a token
//! budget, step by step, for a workload that runs real steps (tokwatt's CUDA serving loop).
//!
//! Each step decodes one token of every sequence past its prompt, then spends what the
//! token budget (`max_batched_tokens`) leaves on prompt chunks, oldest admission first:
//! vLLM's and SGLang's chunked prefill, and the rule the simulator's serving model follows.
//! A request waits in the queue until a KV cache slot is free and fewer than the running
//! limit (the batch size knob) are admitted; the last chunk of its prompt gives its first
//! token (time to first token: arrival to the end of that step), each decode step one more.
//! Each step's energy is shared over the tokens it processed, and a request's energy is its
//! share summed over its life.
//!
//! Nothing here runs a GPU or reads a clock: the caller plans a step, runs it, and reports
//! when it ended and what it cost, so the rule is tested on its own.

use std::collections::VecDeque;

use crate::quantile::nearest_rank;
use crate::types::{DemandWindow, RequestEnergy, RequestsWindow, WorkloadWindow};

/// The sizes the scheduler works within.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServingLimits {
    /// KV cache slots (sequences the engine can hold).
    pub slots: u32,
    /// KV positions per slot: a request's prompt plus output, less one, must fit.
    pub context: u32,
    /// Tokens one step may process (decoding sequences' tokens, then prompt chunks): the
    /// budget at the start, and the most [`Scheduler::set_token_budget`] may raise it to.
    pub max_batched_tokens: u32,
    /// Waiting requests beyond this are turned away.
    pub queue_max: u32,
}

/// A request as it arrives.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request {
    pub arrival_s: f64,
    /// Prompt tokens, at least 1.
    pub prompt: u32,
    /// Tokens to generate, at least 1.
    pub output: u32,
}

/// Where requests come from: a scenario's arrivals (the simulator's scenario files), a
/// trace, a load generator.
pub trait RequestSource: Send {
    /// The requests arriving in `[from_s, to_s)` seconds after the start, in order of
    /// arrival.
    fn arrivals(&mut self, from_s: f64, to_s: f64) -> Vec<Request>;
}

/// One decoding sequence's row of a step: the token it generated last goes in at
/// `position` of its slot, and its next token comes out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeRow {
    pub slot: u32,
    pub position: u32,
}

/// A chunk of a prompt in a step: positions `[start, start + len)` of `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptChunk {
    pub slot: u32,
    pub start: u32,
    pub len: u32,
    /// The chunk ends the prompt: the step gives the request its first token.
    pub ends_prompt: bool,
}

/// What one step processes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub decodes: Vec<DecodeRow>,
    pub prompts: Vec<PromptChunk>,
}

impl StepPlan {
    /// Tokens the step processes (rows of its forward pass).
    pub fn tokens(&self) -> u32 {
        self.decodes.len() as u32 + self.prompts.iter().map(|c| c.len).sum::<u32>()
    }

    pub fn is_empty(&self) -> bool {
        self.decodes.is_empty() && self.prompts.is_empty()
    }
}

/// A finished request, for the per-request outputs.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct RequestRecord {
    pub arrival_s: f64,
    /// When it got a KV cache slot.
    pub admitted_s: f64,
    pub first_token_s: f64,
    pub finish_s: f64,
    pub prompt: u32,
    pub output: u32,
    pub ttft_ms: f64,
    /// Time per output token after the first, `(finish − first token) / (output − 1)`;
    /// `None` for a request of one output token.
    pub tpot_ms: Option<f64>,
    /// Its share of each step's energy; `None` when steps ran without an energy counter
    /// (a gap, never 0 J).
    pub energy_j: Option<f64>,
}

/// An admitted request.
#[derive(Debug, Clone, Copy)]
struct Sequence {
    request: Request,
    admitted_s: f64,
    prefilled: u32,
    generated: u32,
    first_token_s: f64,
    energy_j: Option<f64>,
}

/// What one window saw, reset by [`Scheduler::take_window`].
#[derive(Debug, Default)]
struct Window {
    tokens: u64,
    steps: u64,
    decode_step_ms: Vec<f64>,
    busy_s: f64,
    prefill_busy_s: f64,
    prefill_tokens: u64,
    ttfts_ms: Vec<f64>,
    queue_waits_ms: Vec<f64>,
    arrived: u64,
    completed: u64,
    turned_away: u64,
    tokens_demanded: u64,
    energy: RequestEnergy,
}

/// The scheduler of one engine.
#[derive(Debug)]
pub struct Scheduler {
    limits: ServingLimits,
    running_limit: u32,
    /// Tokens one step may process now: 1 to `limits.max_batched_tokens`.
    token_budget: u32,
    queue: VecDeque<Request>,
    /// Indexed by slot.
    slots: Vec<Option<Sequence>>,
    /// Free slots, the lowest last (taken first).
    free: Vec<u32>,
    /// Slots by admission, oldest first: the order prompts are prefilled in.
    admitted: VecDeque<u32>,
    /// Requests whose prompt and output were cut to fit a slot's context.
    truncated: u64,
    window: Window,
    finished: Vec<RequestRecord>,
}

/// Why a request cannot be scheduled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ServingError {
    #[error("serving limits must all be at least 1 (and the context at least 2): {0:?}")]
    Limits(ServingLimits),
}

impl Scheduler {
    pub fn new(limits: ServingLimits, running_limit: u32) -> Result<Scheduler, ServingError> {
        if limits.slots == 0
            || limits.context < 2
            || limits.max_batched_tokens == 0
            || limits.queue_max == 0
        {
            return Err(ServingError::Limits(limits));
        }
        Ok(Scheduler {
            limits,
            running_limit: running_limit.clamp(1, limits.slots),
            token_budget: limits.max_batched_tokens,
            queue: VecDeque::new(),
            slots: vec![None; limits.slots as usize],
            free: (0..limits.slots).rev().collect(),
            admitted: VecDeque::new(),
            truncated: 0,
            window: Window::default(),
            finished: Vec::new(),
        })
    }

    pub fn limits(&self) -> ServingLimits {
        self.limits
    }

    /// The running limit (the batch size knob): sequences admitted at once. Lowering it
    /// admits no one new until fewer run; those running finish.
    pub fn set_running_limit(&mut self, limit: u32) {
        self.running_limit = limit.clamp(1, self.limits.slots);
    }

    pub fn running_limit(&self) -> u32 {
        self.running_limit
    }

    /// The token budget per step (the token budget knob), from the next plan on: 1 to
    /// [`ServingLimits::max_batched_tokens`], what the engine was sized for.
    pub fn set_token_budget(&mut self, tokens: u32) {
        self.token_budget = tokens.clamp(1, self.limits.max_batched_tokens);
    }

    pub fn token_budget(&self) -> u32 {
        self.token_budget
    }

    /// Sequences holding a slot.
    pub fn running(&self) -> u32 {
        self.admitted.len() as u32
    }

    pub fn queued(&self) -> u32 {
        self.queue.len() as u32
    }

    /// Requests cut to fit a slot's context so far.
    pub fn truncated(&self) -> u64 {
        self.truncated
    }

    /// Queues a request, or turns it away when the queue is full (returns false). A
    /// request longer than a slot holds is cut to fit (prompt first, then output) and
    /// counted in [`Scheduler::truncated`].
    pub fn arrive(&mut self, request: Request) -> bool {
        self.window.arrived += 1;
        self.window.tokens_demanded += u64::from(request.output.max(1));
        if self.queue.len() as u32 >= self.limits.queue_max {
            self.window.turned_away += 1;
            return false;
        }
        let context = self.limits.context;
        let prompt = request.prompt.clamp(1, context - 1);
        let output = request.output.clamp(1, context + 1 - prompt);
        if prompt != request.prompt || output != request.output.max(1) {
            self.truncated += 1;
        }
        self.queue.push_back(Request {
            prompt,
            output,
            ..request
        });
        true
    }

    /// Admits waiting requests where slots allow, and plans the next step at time `now_s`.
    pub fn plan(&mut self, now_s: f64) -> StepPlan {
        while self.running() < self.running_limit {
            let Some(&slot) = self.free.last() else { break };
            let Some(request) = self.queue.pop_front() else {
                break;
            };
            self.free.pop();
            self.window
                .queue_waits_ms
                .push(1000.0 * (now_s - request.arrival_s).max(0.0));
            self.slots[slot as usize] = Some(Sequence {
                request,
                admitted_s: now_s,
                prefilled: 0,
                generated: 0,
                first_token_s: f64::NAN,
                energy_j: Some(0.0),
            });
            self.admitted.push_back(slot);
        }
        let mut plan = StepPlan::default();
        for &slot in &self.admitted {
            if let Some(seq) = &self.slots[slot as usize]
                && seq.generated >= 1
            {
                plan.decodes.push(DecodeRow {
                    slot,
                    position: seq.request.prompt + seq.generated - 1,
                });
            }
        }
        let mut budget = self.token_budget.saturating_sub(plan.decodes.len() as u32);
        for &slot in &self.admitted {
            if budget == 0 {
                break;
            }
            if let Some(seq) = &self.slots[slot as usize]
                && seq.prefilled < seq.request.prompt
            {
                let len = (seq.request.prompt - seq.prefilled).min(budget);
                budget -= len;
                plan.prompts.push(PromptChunk {
                    slot,
                    start: seq.prefilled,
                    len,
                    ends_prompt: seq.prefilled + len == seq.request.prompt,
                });
            }
        }
        plan
    }

    /// Records that `plan` ran, ending at `end_s` after `step_s` seconds and costing
    /// `energy_j` (`None`: no energy counter, requests get no energy).
    pub fn complete(&mut self, plan: &StepPlan, end_s: f64, step_s: f64, energy_j: Option<f64>) {
        let tokens = plan.tokens();
        if tokens == 0 {
            return;
        }
        let per_token = energy_j.map(|j| j / f64::from(tokens));
        let w = &mut self.window;
        w.steps += 1;
        w.busy_s += step_s;
        if !plan.prompts.is_empty() {
            w.prefill_busy_s += step_s;
        }
        if !plan.decodes.is_empty() {
            w.decode_step_ms.push(1000.0 * step_s);
        }
        let mut done = Vec::new();
        for row in &plan.decodes {
            if let Some(seq) = self.slots[row.slot as usize].as_mut() {
                seq.generated += 1;
                seq.energy_j = add_energy(seq.energy_j, per_token);
                self.window.tokens += 1;
                if seq.generated >= seq.request.output {
                    done.push(row.slot);
                }
            }
        }
        for chunk in &plan.prompts {
            if let Some(seq) = self.slots[chunk.slot as usize].as_mut() {
                seq.prefilled += chunk.len;
                seq.energy_j =
                    add_energy(seq.energy_j, per_token.map(|j| j * f64::from(chunk.len)));
                self.window.prefill_tokens += u64::from(chunk.len);
                if chunk.ends_prompt {
                    seq.generated = 1;
                    seq.first_token_s = end_s;
                    self.window.tokens += 1;
                    self.window
                        .ttfts_ms
                        .push(1000.0 * (end_s - seq.request.arrival_s));
                    if seq.request.output <= 1 {
                        done.push(chunk.slot);
                    }
                }
            }
        }
        for slot in done {
            self.finish(slot, end_s);
        }
    }

    fn finish(&mut self, slot: u32, end_s: f64) {
        let Some(seq) = self.slots[slot as usize].take() else {
            return;
        };
        self.admitted.retain(|&s| s != slot);
        self.free.push(slot);
        // The lowest free slot is taken first: keeps the engine's rows compact.
        self.free.sort_unstable_by(|a, b| b.cmp(a));
        let r = seq.request;
        self.window.completed += 1;
        if let Some(energy_j) = seq.energy_j {
            self.window.energy.record(energy_j);
        }
        self.finished.push(RequestRecord {
            arrival_s: r.arrival_s,
            admitted_s: seq.admitted_s,
            first_token_s: seq.first_token_s,
            finish_s: end_s,
            prompt: r.prompt,
            output: r.output,
            ttft_ms: 1000.0 * (seq.first_token_s - r.arrival_s),
            tpot_ms: (r.output > 1)
                .then(|| 1000.0 * (end_s - seq.first_token_s) / f64::from(r.output - 1)),
            energy_j: seq.energy_j,
        });
    }

    /// The requests finished since the last call.
    pub fn take_finished(&mut self) -> Vec<RequestRecord> {
        std::mem::take(&mut self.finished)
    }

    /// The window since the last call, as the control loop reads it, and a new one.
    /// `energy_known`: whether steps were given their energy.
    pub fn take_window(&mut self, energy_known: bool) -> WorkloadWindow {
        let mut w = std::mem::take(&mut self.window);
        let requests = RequestsWindow {
            prefill_tokens: w.prefill_tokens,
            first_tokens: w.ttfts_ms.len() as u64,
            ttft_p99_ms: nearest_rank(&mut w.ttfts_ms, 0.99),
            prefill_time_share: (w.busy_s > 0.0).then(|| w.prefill_busy_s / w.busy_s),
            preemptions: Some(0),
            energy: energy_known.then_some(w.energy),
        };
        WorkloadWindow {
            tokens: w.tokens,
            steps: w.steps,
            tpot_p50_ms: nearest_rank(&mut w.decode_step_ms, 0.5).unwrap_or(f64::NAN),
            tpot_p99_ms: nearest_rank(&mut w.decode_step_ms, 0.99).unwrap_or(f64::NAN),
            active_sequences: self.running(),
            queue_depth: self.queued(),
            batch_size: self.running_limit,
            demand: Some(DemandWindow {
                requests_arrived: w.arrived,
                requests_completed: w.completed,
                requests_turned_away: w.turned_away,
                tokens_demanded: w.tokens_demanded,
                queue_wait_p99_ms: nearest_rank(&mut w.queue_waits_ms, 0.99),
            }),
            requests: Some(requests),
        }
    }
}

/// A request's energy so far plus one step's share: one step without a counter makes the
/// whole request's energy unknown rather than an undercount.
fn add_energy(so_far: Option<f64>, share: Option<f64>) -> Option<f64> {
    Some(so_far? + share?)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn limits() -> ServingLimits {
        ServingLimits {
            slots: 4,
            context: 1000,
            max_batched_tokens: 100,
            queue_max: 3,
        }
    }

    fn request(arrival_s: f64, prompt: u32, output: u32) -> Request {
        Request {
            arrival_s,
            prompt,
            output,
        }
    }

    /// Runs steps of `step_s` each until nothing is left, from `t`.
    fn run_out(s: &mut Scheduler, mut t: f64, step_s: f64) -> f64 {
        loop {
            let plan = s.plan(t);
            if plan.is_empty() {
                return t;
            }
            t += step_s;
            s.complete(&plan, t, step_s, Some(f64::from(plan.tokens())));
        }
    }

    #[test]
    fn prompts_are_chunked_under_the_budget_after_the_decodes() {
        let mut s = Scheduler::new(limits(), 4).unwrap();
        assert!(s.arrive(request(0.0, 150, 3)));
        assert!(s.arrive(request(0.0, 30, 2)));
        let first = s.plan(0.0);
        // The oldest prompt takes the whole budget; the second waits.
        assert_eq!(
            first.prompts,
            vec![PromptChunk {
                slot: 0,
                start: 0,
                len: 100,
                ends_prompt: false
            }]
        );
        s.complete(&first, 0.01, 0.01, Some(1.0));
        let second = s.plan(0.01);
        assert_eq!(second.prompts.len(), 2);
        assert_eq!((second.prompts[0].start, second.prompts[0].len), (100, 50));
        assert!(second.prompts[0].ends_prompt);
        assert_eq!((second.prompts[1].slot, second.prompts[1].len), (1, 30));
        s.complete(&second, 0.02, 0.01, Some(1.0));
        // Both decode now: one row each, at the position after their prompt's last.
        let third = s.plan(0.02);
        assert_eq!(
            third.decodes,
            vec![
                DecodeRow {
                    slot: 0,
                    position: 150
                },
                DecodeRow {
                    slot: 1,
                    position: 30
                }
            ]
        );
        assert!(third.prompts.is_empty());
    }

    #[test]
    fn a_lowered_token_budget_chunks_the_next_steps_finer_within_what_the_engine_holds() {
        let mut s = Scheduler::new(limits(), 4).unwrap();
        assert_eq!(s.token_budget(), 100, "the start's budget");
        s.arrive(request(0.0, 150, 3));
        s.set_token_budget(40);
        let first = s.plan(0.0);
        assert_eq!(first.tokens(), 40);
        s.complete(&first, 0.01, 0.01, None);
        // Raised past what the engine was sized for: held at its most.
        s.set_token_budget(1_000);
        assert_eq!(s.token_budget(), 100);
        let second = s.plan(0.01);
        assert_eq!((second.prompts[0].start, second.prompts[0].len), (40, 100));
        s.complete(&second, 0.02, 0.01, None);
        // Never below one token: a step always moves.
        s.set_token_budget(0);
        assert_eq!(s.token_budget(), 1);
        assert_eq!(s.plan(0.02).tokens(), 1);
    }

    #[test]
    fn each_request_gets_its_tokens_its_ttft_and_tpot_and_the_energy_adds_up() {
        let mut s = Scheduler::new(limits(), 2).unwrap();
        s.arrive(request(0.0, 50, 5));
        s.arrive(request(0.0, 60, 1));
        s.arrive(request(0.0, 10, 4));
        let end = run_out(&mut s, 0.0, 0.01);
        let records = s.take_finished();
        assert_eq!(records.len(), 3);
        let window = s.take_window(true);
        // Every output token was counted once.
        assert_eq!(window.tokens, 5 + 1 + 4);
        let requests = window.requests.unwrap();
        assert_eq!(requests.prefill_tokens, 120);
        assert_eq!(requests.first_tokens, 3);
        // One joule per token processed: each request's energy is its prompt plus its
        // decode rows (output - 1).
        for r in &records {
            assert!(
                (r.energy_j.unwrap() - f64::from(r.prompt + r.output - 1)).abs() < 1e-9,
                "{r:?}"
            );
        }
        assert_eq!(requests.energy.unwrap().count, 3);
        // 50 + 60 fit one step's budget of 100 only in part: the first two prompts end in
        // steps 1 and 2; the third waits for a slot (running limit 2) until the 1-token
        // request leaves at the end of step 2.
        let first = records.iter().find(|r| r.prompt == 50).unwrap();
        assert!((first.ttft_ms - 10.0).abs() < 1e-9);
        assert!((first.tpot_ms.unwrap() - 10.0).abs() < 1e-9);
        let single = records.iter().find(|r| r.output == 1).unwrap();
        assert!((single.ttft_ms - 20.0).abs() < 1e-9 && single.tpot_ms.is_none());
        let late = records.iter().find(|r| r.prompt == 10).unwrap();
        assert!((late.admitted_s - 0.02).abs() < 1e-9, "{late:?}");
        assert!(end > 0.0 && s.running() == 0 && s.queued() == 0);
    }

    #[test]
    fn a_full_queue_turns_requests_away_and_counts_them() {
        let mut s = Scheduler::new(limits(), 1).unwrap();
        for _ in 0..5 {
            s.arrive(request(0.0, 10, 10));
        }
        let demand = s.take_window(false).demand.unwrap();
        assert_eq!(demand.requests_arrived, 5);
        assert_eq!(demand.requests_turned_away, 2);
        assert_eq!(demand.tokens_demanded, 50);
    }

    #[test]
    fn the_running_limit_caps_admission_and_a_cut_lets_the_running_finish() {
        let mut s = Scheduler::new(limits(), 3).unwrap();
        for _ in 0..3 {
            s.arrive(request(0.0, 5, 100));
        }
        let plan = s.plan(0.0);
        assert_eq!(plan.prompts.len(), 3);
        s.complete(&plan, 0.01, 0.01, None);
        s.set_running_limit(1);
        s.arrive(request(0.01, 5, 5));
        let plan = s.plan(0.01);
        // Nobody new is admitted while three run; all three keep decoding.
        assert_eq!((plan.decodes.len(), plan.prompts.len()), (3, 0));
        assert_eq!(s.queued(), 1);
        let window = s.take_window(false);
        assert!(window.requests.unwrap().energy.is_none());
    }

    #[test]
    fn a_step_without_energy_leaves_its_requests_energy_unknown_not_zero() {
        let mut s = Scheduler::new(limits(), 2).unwrap();
        s.arrive(request(0.0, 4, 3));
        let mut now = 0.0;
        let mut finished = Vec::new();
        for step in 0..100 {
            let plan = s.plan(now);
            now += 0.01;
            // The counter answers for the first step only.
            s.complete(&plan, now, 0.01, (step == 0).then_some(1.0));
            finished.extend(s.take_finished());
            if !finished.is_empty() {
                break;
            }
        }
        assert_eq!(finished.len(), 1);
        assert_eq!(finished[0].energy_j, None);
        let window = s.take_window(true);
        assert_eq!(window.requests.unwrap().energy.unwrap().count, 0);
    }

    #[test]
    fn a_request_longer_than_a_slot_is_cut_to_fit_and_counted() {
        let mut s = Scheduler::new(limits(), 1).unwrap();
        s.arrive(request(0.0, 5000, 10));
        s.arrive(request(0.0, 900, 500));
        assert_eq!(s.truncated(), 2);
        run_out(&mut s, 0.0, 0.001);
        let records = s.take_finished();
        assert_eq!((records[0].prompt, records[0].output), (999, 2));
        assert_eq!((records[1].prompt, records[1].output), (900, 101));
        // Every position a sequence writes fits its slot: prompt + output - 1 <= context.
        assert!(records.iter().all(|r| r.prompt + r.output - 1 <= 1000));
    }

    #[test]
    fn impossible_limits_are_refused() {
        for bad in [
            ServingLimits {
                slots: 0,
                ..limits()
            },
            ServingLimits {
                context: 1,
                ..limits()
            },
            ServingLimits {
                max_batched_tokens: 0,
                ..limits()
            },
        ] {
            assert!(Scheduler::new(bad, 1).is_err());
        }
    }
}
