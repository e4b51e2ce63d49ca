//! The workload boundary: the token-generating work and its own knobs, the batch size
//! and, where it serves prompts, the token budget per step.
//!
//! Backends: the simulator, the CUDA decode workload, and an external token source
//! (a serving engine's Prometheus counter).

pub mod per_gpu;
pub mod serving;

use crate::types::WorkloadWindow;

/// Whether the workload knows when work is waiting: a throughput floor
/// (`min_tokens_per_s`) needs it, since a GPU with nothing to do is not slow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WorkWaiting {
    /// Each window's `queue_depth` says (the simulator).
    #[default]
    Reported,
    /// A closed loop that makes its own work: there is always work waiting (tokwatt's
    /// CUDA decode), so the floor is checked on every window.
    Always,
    /// Nothing says (a serving engine's token counter without a queue gauge): a
    /// throughput floor cannot be checked and is refused at start.
    Unknown,
}

#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("GPU index {index} is out of range: this workload runs on {count} GPU(s)")]
    NoSuchGpu { index: u32, count: u32 },
    #[error("batch size {requested} is out of range: this workload accepts 1 to {max}")]
    BatchOutOfRange { requested: u32, max: u32 },
    #[error("the workload cannot change its batch size: {0}")]
    BatchFixed(String),
    #[error(
        "the {workload} workload has no token budget per step on GPU {gpu}: it decodes only (its requests bring no prompts to prefill), or an engine outside tokwatt fixes its budget"
    )]
    NoTokenBudget { workload: &'static str, gpu: u32 },
    #[error(
        "token budget {requested} is out of range: this workload accepts {min} to {max} tokens a step"
    )]
    TokenBudgetOutOfRange { requested: u32, min: u32, max: u32 },
    #[error("the workload failed: {0}")]
    Failed(String),
}

pub trait Workload: Send {
    fn name(&self) -> &'static str;
    /// The largest batch size the workload accepts on `gpu`.
    fn batch_size_max(&self, gpu: u32) -> u32;
    fn batch_size(&self, gpu: u32) -> u32;
    /// Takes effect at the next decode step; never reallocates.
    fn set_batch_size(&mut self, gpu: u32, batch: u32) -> Result<(), WorkloadError>;
    /// The range of the token budget per step on `gpu` (the tokens, prompt chunks and
    /// decoding sequences together, one step may process), `(min, max)`; `None` where the
    /// workload has no such budget: it decodes only, or an engine outside tokwatt fixes
    /// it. The most is the budget the workload was sized for at its start.
    fn token_budget_range(&self, _gpu: u32) -> Option<(u32, u32)> {
        None
    }
    /// The token budget per step in force on `gpu`; `None` where there is none.
    fn token_budget(&self, _gpu: u32) -> Option<u32> {
        None
    }
    /// Takes effect between steps: the next step's prompt chunks fit the new budget.
    /// [`WorkloadError::NoTokenBudget`] where the workload has none.
    fn set_token_budget(&mut self, gpu: u32, _tokens: u32) -> Result<(), WorkloadError> {
        Err(WorkloadError::NoTokenBudget {
            workload: self.name(),
            gpu,
        })
    }
    /// Tokens and latency on `gpu` since the previous call, and start a new window.
    fn read_window(&mut self, gpu: u32) -> Result<WorkloadWindow, WorkloadError>;
    /// Whether the workload knows when work is waiting (see [`WorkWaiting`]).
    fn work_waiting(&self) -> WorkWaiting {
        WorkWaiting::Reported
    }
    /// Whether every window reports time to first token
    /// ([`crate::types::WorkloadWindow::requests`]): a TTFT bound is refused where not.
    fn reports_ttft(&self) -> bool {
        false
    }
    /// Whether the workload sees each request through and gives its record
    /// ([`Workload::take_finished_requests`]): the simulator and tokwatt's serving loop do,
    /// a serving engine's counters do not.
    fn reports_requests(&self) -> bool {
        false
    }
    /// Moves the requests finished on `gpu` since the last call into `into`. A workload
    /// keeps a bounded number between calls and counts what it had to drop
    /// ([`FinishedRequests::dropped`]).
    fn take_finished_requests(&mut self, _gpu: u32, _into: &mut FinishedRequests) {}
}

/// The check every workload with a token budget makes before taking `tokens` on `gpu`:
/// within `range` ([`Workload::token_budget_range`]), or the typed error.
pub fn check_token_budget(
    workload: &'static str,
    gpu: u32,
    range: Option<(u32, u32)>,
    tokens: u32,
) -> Result<(), WorkloadError> {
    match range {
        None => Err(WorkloadError::NoTokenBudget { workload, gpu }),
        Some((min, max)) if !(min..=max).contains(&tokens) => {
            Err(WorkloadError::TokenBudgetOutOfRange {
                requested: tokens,
                min,
                max,
            })
        }
        Some(_) => Ok(()),
    }
}

/// Requests a workload finished, with the count it could not keep.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FinishedRequests {
    pub records: Vec<serving::RequestRecord>,
    /// Finished but not recorded: more finished between two takes than the workload keeps.
    pub dropped: u64,
}

impl FinishedRequests {
    pub fn clear(&mut self) {
        self.records.clear();
        self.dropped = 0;
    }
}
