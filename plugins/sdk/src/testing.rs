//! Plausible arguments for a policy's native unit tests, so a test spells out only what
//! it is about: `let mut obs = testing::observation(0, 7); obs.tokens = 0;`.
//!
//! The figures follow an NVIDIA H200 decoding Llama-3-8B at batch 64 under a 700 W cap
//! (the project's calibration data); they are inputs for tests, not measurements.
//!
//! For stateful policies, [`assert_hands_over`] and [`assert_restore_refused`] check the
//! hot-swap contract: a new instance takes an old one's snapshot whole, and a refused
//! state leaves the policy as it was.

use crate::{
    ClockEvents, DeviceFacts, InForce, InitArgs, Knobs, Objective, Observation, Policy, State,
};

/// An H200 as the host describes it without guardrails: power cap 200–700 W (default
/// 700 W), SM clocks 1980 MHz down to 345 MHz in 15 MHz steps, batch size up to 512, and
/// no token budget (a decode-only workload: see [`h200_serving`]).
pub fn h200(index: u32) -> DeviceFacts {
    DeviceFacts {
        index,
        uuid: format!("SIM-H200-{index}"),
        name: "NVIDIA H200".to_string(),
        simulated: true,
        power_cap_min_w: 200.0,
        power_cap_max_w: 700.0,
        power_cap_default_w: 700.0,
        sm_clocks_mhz: (0..110).map(|step| 1980 - 15 * step).collect(),
        batch_size_max: 512,
        token_budget_min: 0,
        token_budget_max: 0,
    }
}

/// [`h200`] serving requests with prompts: a token budget per step of 1 to 8192 tokens
/// (the range [`crate::Settings::with_token_budget`] is clamped to).
pub fn h200_serving(index: u32) -> DeviceFacts {
    DeviceFacts {
        token_budget_min: 1,
        token_budget_max: 8192,
        ..h200(index)
    }
}

/// `init`'s arguments for `devices`, granting `knobs`, with no objective, no parameters,
/// a 1 s tick and seed 0.
pub fn init_args(devices: Vec<DeviceFacts>, knobs: Knobs) -> InitArgs {
    InitArgs {
        devices,
        knobs,
        objective: Objective {
            tpot_p99_limit_ms: None,
            min_tokens_per_s: None,
            queue_wait_p99_limit_ms: None,
            ttft_p99_limit_ms: None,
        },
        params: Vec::new(),
        tick_ms: 1000,
        seed: 0,
    }
}

/// Parameters as `init` receives them: `params(&[("step_w", "25")])`.
pub fn params(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(key, value)| ((*key).to_string(), (*value).to_string()))
        .collect()
}

/// One busy, settled second on GPU `gpu` at tick `tick`: 8865 tokens for 692 J under
/// a 700 W cap, batch 64, nothing clamped, and no demand or requests known (a
/// closed-loop workload: set `demand`, `requests` and `in_force.token_budget` to test a
/// policy on a serving one).
pub fn observation(gpu: u32, tick: u64) -> Observation {
    let interval_s = 1.0;
    let tokens = 8865;
    let energy_j = 692.0;
    Observation {
        gpu,
        tick,
        interval_s,
        tokens,
        energy_j,
        tokens_per_joule: tokens as f64 / energy_j,
        tokens_per_s: tokens as f64 / interval_s,
        power_avg_w: energy_j / interval_s,
        power_peak_w: 760.0,
        sm_clock_mhz: 1980,
        mem_clock_mhz: 3201,
        temperature_c: 55.0,
        gpu_util_pct: 100.0,
        clock_events: ClockEvents::empty(),
        tpot_p50_ms: 7.2,
        tpot_p99_ms: 7.9,
        active_sequences: 64,
        queue_depth: 0,
        demand: None,
        requests: None,
        in_force: InForce {
            power_cap_w: 700.0,
            sm_clock_max_mhz: 1980,
            batch_size: 64,
            token_budget: 0,
        },
        last_clamped: false,
        settling: false,
    }
}

/// A hot swap between two instances: `new` takes `old`'s snapshot and must hand back the
/// same one. Returns the state handed over.
///
/// # Panics
/// When `new` refuses the state or its snapshot differs afterwards.
pub fn assert_hands_over<P: Policy>(old: &P, new: &mut P) -> State {
    let state = old.snapshot();
    if let Err(error) = new.restore(state.clone()) {
        panic!("the new instance refused its predecessor's state: {error}");
    }
    assert!(
        new.snapshot() == state,
        "the new instance's snapshot differs from the state it took over"
    );
    state
}

/// `policy.restore(state)` must fail with a message containing `expected` and leave the
/// policy as it was (the same snapshot), since the host then carries on with it.
///
/// # Panics
/// When the state is accepted, the message lacks `expected`, or the policy changed.
pub fn assert_restore_refused<P: Policy>(policy: &mut P, state: State, expected: &str) {
    let before = policy.snapshot();
    match policy.restore(state) {
        Ok(()) => panic!("restore accepted a state it should refuse (expected: {expected})"),
        Err(error) => assert!(
            error.contains(expected),
            "restore's error lacks {expected:?}: {error}"
        ),
    }
    assert!(
        policy.snapshot() == before,
        "a refused restore changed the policy's state (expected error: {expected})"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Settings, StateReader, StateWriter};

    #[test]
    fn the_h200_clock_table_matches_the_calibration() {
        let clocks = h200(0).sm_clocks_mhz;
        assert_eq!(clocks.len(), 110);
        assert_eq!(clocks.first(), Some(&1980));
        assert_eq!(clocks.last(), Some(&345));
    }

    #[test]
    fn observation_figures_are_consistent() {
        let observation = observation(1, 3);
        let derived = observation.tokens as f64 / observation.energy_j;
        assert!((observation.tokens_per_joule - derived).abs() < 1e-12);
        assert_eq!(observation.gpu, 1);
        assert_eq!(observation.tick, 3);
    }

    /// Counts ticks; restores schema 1. `careless` sets the count before checking the
    /// schema, which a refused restore must not do.
    struct Counter {
        count: u64,
        careless: bool,
    }

    impl Policy for Counter {
        fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String> {
            let counter = Counter {
                count: 0,
                careless: false,
            };
            Ok((counter, vec![Settings::unchanged(); args.devices.len()]))
        }

        fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
            self.count += 1;
            vec![Settings::unchanged(); observations.len()]
        }

        fn snapshot(&self) -> State {
            StateWriter::new().u64(self.count).finish(1)
        }

        fn restore(&mut self, state: State) -> Result<(), String> {
            let mut reader = StateReader::new(&state.bytes);
            let count = reader.u64()?;
            reader.finish()?;
            if self.careless {
                self.count = count;
            }
            if state.schema_version != 1 {
                return Err(format!(
                    "schema version 1, got version {}",
                    state.schema_version
                ));
            }
            self.count = count;
            Ok(())
        }
    }

    fn counter(count: u64, careless: bool) -> Counter {
        Counter { count, careless }
    }

    fn other_schema(count: u64) -> State {
        StateWriter::new().u64(count).finish(2)
    }

    #[test]
    fn a_faithful_hand_over_passes() {
        let old = counter(7, false);
        let mut new = counter(0, false);
        let state = assert_hands_over(&old, &mut new);
        assert_eq!(state.schema_version, 1);
        assert_eq!(new.count, 7);
    }

    #[test]
    fn a_refusal_with_the_expected_message_passes() {
        let mut policy = counter(3, false);
        assert_restore_refused(&mut policy, other_schema(9), "got version 2");
        assert_eq!(policy.count, 3);
    }

    #[test]
    #[should_panic(expected = "restore accepted a state it should refuse")]
    fn an_accepted_state_fails_the_check() {
        let good = counter(9, false).snapshot();
        assert_restore_refused(&mut counter(3, false), good, "schema");
    }

    #[test]
    #[should_panic(expected = "restore's error lacks \"2 GPUs\"")]
    fn a_refusal_for_another_reason_fails_the_check() {
        assert_restore_refused(&mut counter(3, false), other_schema(9), "2 GPUs");
    }

    #[test]
    #[should_panic(expected = "a refused restore changed the policy's state")]
    fn a_refusal_that_changed_the_policy_fails_the_check() {
        assert_restore_refused(&mut counter(3, true), other_schema(9), "got version 2");
    }
}
