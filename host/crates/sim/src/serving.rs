//! The serving engine of one simulated GPU: core's one serving scheduler
//! ([`tokwatt_core::workload::serving::Scheduler`], the same the CUDA serving loop runs),
//! over the KV cache a simulated GPU holds, driven by runs of identical steps. Only a
//! step's execution is the simulator's own (`gpu` prices a run with the cost model: its
//! time, power and clock).
//!
//! A scenario with prompts has a pool of KV positions beside the weights (a full pool
//! preempts the latest arrival among the decoding sequences, vLLM's recompute
//! preemption); a decode-only scenario is prompts of no tokens over the scenario's fixed
//! context, its cache sized by the batch limit. The rules (chunked prefill under the token
//! budget, admission, the batch limit's cuts) are core's, documented there; this file's
//! tests step it by hand as the simulator does.

use std::ops::{Deref, DerefMut};

use super::model::StepLoad;
use super::scenario::Scenario;
pub(super) use tokwatt_core::workload::serving::Next;
use tokwatt_core::workload::serving::{KvCache, Request, Scheduler, SchedulerWindow};

/// The scheduler of one simulated GPU.
#[derive(Debug, Clone)]
pub(super) struct Server(Scheduler);

impl Deref for Server {
    type Target = Scheduler;
    fn deref(&self) -> &Scheduler {
        &self.0
    }
}

impl DerefMut for Server {
    fn deref_mut(&mut self) -> &mut Scheduler {
        &mut self.0
    }
}

impl Server {
    /// A server for `scenario`; `kv_capacity_tokens` is what the memory holds beside the
    /// weights (used only when requests have prompts).
    pub(super) fn new(scenario: &Scenario, kv_capacity_tokens: f64) -> Self {
        let cache = if scenario.requests.is_some() {
            KvCache::Pool {
                positions: kv_capacity_tokens,
            }
        } else {
            KvCache::DecodeOnly {
                context: scenario.context_tokens,
            }
        };
        Self(Scheduler::with_cache(
            cache,
            scenario.max_batched_tokens,
            scenario.queue_max,
            scenario.initial_batch_size,
        ))
    }

    /// Slots in use follow `batch` from `now_s` on (see [`Scheduler::rebalance`]).
    pub(super) fn rebalance(&mut self, now_s: f64, batch: u32) {
        self.0.set_running_limit(batch);
        self.0.rebalance(now_s);
    }

    /// One arrival of `prompt` and `output` tokens at `arrival_s`: queued, or turned away
    /// when the queue is full.
    pub(super) fn arrive(&mut self, arrival_s: f64, prompt: u32, output: u32) {
        self.0.arrive(Request {
            arrival_s,
            prompt,
            output,
        });
    }

    /// Runs `steps` steps of `load`, `step_s` each (no event inside them), ending at
    /// `end_s`; they drew `energy_j` (the simulator always knows it).
    pub(super) fn advance(
        &mut self,
        load: &StepLoad,
        steps: f64,
        step_s: f64,
        energy_j: f64,
        end_s: f64,
    ) {
        self.0.advance(load, steps, step_s, Some(energy_j), end_s);
    }

    pub(super) fn budget_range(&self) -> Option<(u32, u32)> {
        self.0.token_budget_range()
    }

    pub(super) fn budget(&self) -> u32 {
        self.0.token_budget()
    }

    /// The token budget from the next step on (the caller checked it against
    /// [`Server::budget_range`]; held within it all the same).
    pub(super) fn set_budget(&mut self, tokens: u32) {
        self.0.set_token_budget(tokens);
    }

    /// The window's counts, reset.
    pub(super) fn take_window(&mut self) -> SchedulerWindow {
        self.0.take_counts()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests;
