//! A native policy for tests: `decide` is a closure of the call number and the
//! observations. One file, compiled in two crates: the test-support crate exports it for
//! the loop's tests above the policy crate, and the policy crate includes it for its own
//! supervisor tests (`#[path]`), where `crate::supervisor` is itself.

use std::time::Duration;

use crate::supervisor::{InitArgs, PolicyEngine, PolicyFailure, PolicyState};
use tokwatt_core::types::{Observation, Settings};

type Decide = dyn FnMut(u64, &[Observation]) -> Result<Vec<Settings>, PolicyFailure> + Send;

/// A policy whose `decide` is a closure of the call number and the observations.
pub struct NativePolicy {
    decide: Box<Decide>,
    calls: u64,
}

impl NativePolicy {
    pub fn new(
        decide: impl FnMut(u64, &[Observation]) -> Result<Vec<Settings>, PolicyFailure> + Send + 'static,
    ) -> Self {
        Self {
            decide: Box::new(decide),
            calls: 0,
        }
    }
}

impl std::fmt::Debug for NativePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativePolicy")
            .field("calls", &self.calls)
            .finish_non_exhaustive()
    }
}

impl PolicyEngine for NativePolicy {
    fn name(&self) -> &str {
        "native"
    }
    fn init(&mut self, args: &InitArgs) -> Result<Vec<Settings>, PolicyFailure> {
        Ok(vec![Settings::default(); args.devices.len()])
    }
    fn decide(
        &mut self,
        _tick_time: Duration,
        observations: &[Observation],
    ) -> Result<Vec<Settings>, PolicyFailure> {
        let call = self.calls;
        self.calls += 1;
        (self.decide)(call, observations)
    }
    fn snapshot(&mut self) -> Result<PolicyState, PolicyFailure> {
        Ok(PolicyState::default())
    }
    fn restore(&mut self, _state: &PolicyState) -> Result<(), PolicyFailure> {
        Ok(())
    }
    fn rebuild(&mut self) -> Result<(), PolicyFailure> {
        Ok(())
    }
}
