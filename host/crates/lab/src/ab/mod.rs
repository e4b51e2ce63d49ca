//! The experiment tool `tokwatt ab`: is policy B more efficient than policy A on this work?
//!
//! [`stats`]: pairs in, a ratio of tokens per joule with its interval and a sequential
//! decision out; a pair holds one independent trajectory of each arm (a fresh policy
//! instance), the unit of replication. [`run`]: the epochs themselves, interleaved on one node or in
//! crossover blocks over several GPUs, through the agent's own loop and hot-swap path;
//! its [`run::AbOutcome`] is `ab.json`.

pub mod gpu_difference;
pub mod report;
pub mod run;
pub mod sim_work;
pub mod stats;
pub mod study;
pub mod tune;

#[cfg(test)]
mod tests;

pub use gpu_difference::{GpuDifference, gpu_difference};
pub use run::{
    AbOutcome, AbProgress, AbRequest, AbRunError, EpochRecord, Estimand, EstimandInfo, Mode,
    Schedule, Spread, TickPoint, TrajectoryWork, WorkFactory, run_crossover, run_interleaved,
    run_replicated, trajectory_seed,
};
pub use sim_work::{SimWork, replicated_span_s};
pub use stats::{
    AbError, AbSummary, Arm, ArmEpoch, Decision, EpochPair, SequentialPlan, Tolerances, Verdict,
    confidence_percent, decision_headline,
};
