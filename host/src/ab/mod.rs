//! The experiment tool `tokwatt ab`: is policy B more efficient than policy A on this work?
//!
//! This room holds the statistics ([`stats`]): paired epochs in, a ratio of tokens per joule
//! with its interval and a sequential decision out. Running the epochs (interleaving, warm-up,
//! the simulator or real GPUs) and writing `ab.json` build on it.

pub mod stats;

#[cfg(test)]
mod tests;

pub use stats::{
    AbError, AbSummary, Arm, ArmEpoch, Decision, EpochPair, SequentialPlan, Tolerances, Verdict,
};
