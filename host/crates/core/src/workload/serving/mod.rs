//! The serving scheduler, written once: continuous batching with chunked prefill under a
//! token budget, for tokwatt's CUDA serving loop and for the simulator alike
//! ([`Scheduler`]). Both run the same admission, running limit (the batch size knob),
//! token budget, chunking, preemption and KV accounting; they differ only in how a step is
//! executed: the CUDA loop runs it on the GPU, the simulator prices it with its cost model.
//!
//! Each step decodes one token of every sequence past its prompt, then spends what the
//! token budget leaves on prompt chunks, oldest admission first (vLLM's and SGLang's
//! chunked prefill). A request waits in the queue (turned away beyond `queue_max`) until
//! fewer than the running limit hold a batch slot and the KV cache has room; the step that
//! holds the last chunk of its prompt gives its first token (time to first token: arrival
//! to the end of that step), each decode step one more. Each step's energy is shared over
//! the tokens it processed, and a request's energy is its share summed over its life
//! (`None` where a step ran without an energy counter: a gap, never 0 J).
//!
//! Two ways to drive it, over one state:
//! - step by step ([`Scheduler::plan`], then [`Scheduler::complete`]): the caller runs the
//!   planned step (slots, KV positions, chunks) and reports when it ended and what it cost
//!   (the CUDA loop);
//! - by runs of identical steps ([`Scheduler::next`] or
//!   [`Scheduler::identical_steps_ahead`], then [`Scheduler::advance`]): the scheduler says
//!   how many coming steps keep the same composition (no completion, no chunk boundary, no
//!   full KV cache; arrivals are the caller's, who knows when the next comes), and the
//!   caller prices them at once (the simulator). The count is a real number: the simulator
//!   cuts a run where an arrival or the end of its substep falls, inside a step (its fluid
//!   view). Advanced by whole steps, `k` steps at once are `k` single steps (test:
//!   `k_identical_steps_at_once_are_k_single_steps`).
//!
//! KV accounting ([`KvCache`]): the CUDA engine has a fixed number of slots of a fixed
//! context (a request longer is cut to fit, and counted); the simulator a pool of positions
//! beside the weights, where a full pool preempts the latest arrival among the decoding
//! sequences (vLLM's recompute preemption: its cache dropped, its prompt and output so far
//! prefilled again later); a decode-only scenario is prompts of no tokens over a fixed
//! context, its cache sized by the batch limit.
//!
//! Where the two schedulers this one replaced disagreed, the rule that won:
//! - a lowered running limit pauses the decoding sequences with the most tokens left (they
//!   keep their KV cache and slot and resume first) and sends prompts being prefilled back
//!   to the head of the queue, at the next step; the discrete scheduler let the running
//!   finish. vLLM fixes `max_num_seqs` at start, so it has no rule for a knob that moves;
//!   the simulator's rule makes the knob act within a step, which every simulated result
//!   and every policy tuned on them relied on.
//! - the oldest prompt's chunk is `min(rest of its prompt, room)`, as vLLM's scheduler
//!   takes `min(num_new_tokens, token_budget)`, and so is every later prompt's; both old
//!   schedulers agreed on this in whole steps. The simulator's fluid view lets a chunk
//!   under way go on to its end at the room it started with, which gives the same chunks
//!   whenever the room holds through a prompt; where a prompt longer than the room is
//!   under way while the decoding count moves, its chunks' ends fall a fraction of a step
//!   apart from whole steps'.
//! - a run of steps applies the very shares [`Scheduler::next`] priced it with. The
//!   simulator's `Server` recomputed them in `advance` with the step's prefill total as the
//!   room, so a prompt whose prefill had begun in an earlier step (the last prompt of a
//!   full step) and was longer than that total took all of it, and the prompts behind it,
//!   priced in the step, got nothing and waited a step more for their first token. The test
//!   `the_servers_runs_and_the_cuda_loops_single_steps_give_every_request_the_same_steps`
//!   (in `sim`) found it; simulated serving results with prompts move by that much.
//! - queue depth counts the paused sequences with the queue (they wait for a slot), and
//!   preemptions are counted (0 where the cache is slots: a request cut to fit never
//!   outgrows its slot).

mod discrete;
mod scheduler;

pub use scheduler::{Next, Scheduler, SchedulerWindow};

/// What one engine step processes: every decoding sequence's next token and chunks of
/// prompt tokens, as the cost model of a step reads it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepLoad {
    /// Sequences decoding one token each.
    pub decode: u32,
    /// KV-cache positions the decoding sequences attend to, all together.
    pub decode_positions: f64,
    /// Positions the longest decoding row attends to (its own reads, a few blocks wide,
    /// finish after the rest).
    pub decode_position_max: f64,
    /// Prompt tokens prefilled in the step.
    pub prefill: f64,
    /// Positions the prompt tokens attend to, all together (causal: a token sees the
    /// prompt before it).
    pub prefill_positions: f64,
}

/// Where the KV cache lives, which decides admission, cuts and preemption.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvCache {
    /// `slots` caches of `context` positions each (tokwatt's CUDA engine): a request is
    /// admitted into a free slot, and one longer than a slot is cut to fit.
    Slots { slots: u32, context: u32 },
    /// One pool of `positions` shared by every sequence (vLLM's paged cache): a prompt is
    /// admitted where the pool has room for it, and a full pool preempts.
    Pool { positions: f64 },
    /// Decode only: every request is a prompt of no tokens over a fixed `context`, which
    /// never grows; the cache is sized by the running limit.
    DecodeOnly { context: u32 },
}

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

/// Why a scheduler cannot be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ServingError {
    #[error("serving limits must all be at least 1 (and the context at least 2): {0:?}")]
    Limits(ServingLimits),
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod run_tests;
