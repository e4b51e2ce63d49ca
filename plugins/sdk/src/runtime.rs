//! The glue behind [`export_policy!`](crate::export_policy): holds the one policy
//! instance of a component and routes the WIT exports to it.

use crate::{InitArgs, LogLevel, Observation, Policy, Settings, State, log};
use std::cell::RefCell;
use std::fmt;

/// Makes a panic in the policy reach the agent's log, tagged with the policy's name,
/// before it traps: the trap itself carries no message. The default hook still runs
/// afterwards (it writes to the component's standard error).
#[cfg(target_arch = "wasm32")]
fn report_panics_to_the_host_log() {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        let default_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let message = info.payload_as_str().unwrap_or("(no message)");
            let report = match info.location() {
                Some(location) => format!("policy panicked at {location}: {message}"),
                None => format!("policy panicked: {message}"),
            };
            log(LogLevel::Error, &report);
            default_hook(info);
        }));
    });
}

/// Natively, for a policy's own tests, panics keep the test harness's reporting.
#[cfg(not(target_arch = "wasm32"))]
fn report_panics_to_the_host_log() {}

/// The single policy instance of a component, empty until `init` succeeds.
///
/// WebAssembly components are single-threaded and the component model forbids
/// re-entering an instance, so a `RefCell` is never borrowed twice.
pub struct Slot<P> {
    instance: RefCell<Option<P>>,
}

impl<P> fmt::Debug for Slot<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let initialised = self
            .instance
            .try_borrow()
            .map(|instance| instance.is_some());
        f.debug_struct("Slot")
            .field("initialised", &initialised.ok())
            .finish()
    }
}

impl<P: Policy> Slot<P> {
    /// An empty slot.
    pub const fn new() -> Self {
        Slot {
            instance: RefCell::new(None),
        }
    }

    /// Creates the instance. A second call starts over from scratch: the old instance
    /// is dropped first, so a failed re-`init` leaves no stale instance behind.
    pub fn init(&self, args: InitArgs) -> Result<Vec<Settings>, String> {
        report_panics_to_the_host_log();
        self.instance.replace(None);
        let (policy, settings) = P::init(args)?;
        self.instance.replace(Some(policy));
        Ok(settings)
    }

    /// Runs `decide`; before a successful `init`, leaves every GPU unchanged.
    pub fn decide(&self, observations: &[Observation]) -> Vec<Settings> {
        report_panics_to_the_host_log();
        match self.instance.borrow_mut().as_mut() {
            Some(policy) => policy.decide(observations),
            None => {
                log(
                    LogLevel::Warn,
                    "decide was called before a successful init; leaving every GPU unchanged",
                );
                vec![Settings::unchanged(); observations.len()]
            }
        }
    }

    /// Runs `snapshot`; before a successful `init`, there is no state.
    pub fn snapshot(&self) -> State {
        report_panics_to_the_host_log();
        self.instance
            .borrow()
            .as_ref()
            .map_or_else(State::empty, P::snapshot)
    }

    /// Runs `restore`; before a successful `init` there is nothing to restore into.
    pub fn restore(&self, state: State) -> Result<(), String> {
        report_panics_to_the_host_log();
        match self.instance.borrow_mut().as_mut() {
            Some(policy) => policy.restore(state),
            None => Err(
                "restore was called before a successful init; call init first, then restore"
                    .to_string(),
            ),
        }
    }
}

impl<P: Policy> Default for Slot<P> {
    fn default() -> Self {
        Slot::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Knobs, StateReader, StateWriter, testing};

    /// Counts decide calls; the cap it asks for is the count.
    struct Counter {
        calls: u64,
    }

    impl Policy for Counter {
        fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String> {
            if args.tick_ms == 0 {
                return Err("tick_ms must be positive".to_string());
            }
            Ok((
                Counter { calls: 0 },
                vec![Settings::unchanged(); args.devices.len()],
            ))
        }

        fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
            self.calls += 1;
            let cap_w = self.calls as f64;
            vec![Settings::unchanged().with_power_cap_w(cap_w); observations.len()]
        }

        fn snapshot(&self) -> State {
            StateWriter::new().u64(self.calls).finish(1)
        }

        fn restore(&mut self, state: State) -> Result<(), String> {
            let mut reader = StateReader::new(&state.bytes);
            self.calls = reader.u64()?;
            reader.finish()
        }
    }

    /// Keeps no state: uses the trait's default `snapshot` and `restore`.
    struct Stateless;

    impl Policy for Stateless {
        fn init(_: InitArgs) -> Result<(Self, Vec<Settings>), String> {
            Ok((Stateless, Vec::new()))
        }

        fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
            vec![Settings::unchanged(); observations.len()]
        }
    }

    fn args(devices: u32, tick_ms: u32) -> InitArgs {
        let mut args = testing::init_args((0..devices).map(testing::h200).collect(), Knobs::all());
        args.tick_ms = tick_ms;
        args
    }

    fn observation(gpu: u32) -> Observation {
        testing::observation(gpu, 0)
    }

    #[test]
    fn decide_before_init_leaves_every_gpu_unchanged() {
        let slot = Slot::<Counter>::new();
        let settings = slot.decide(&[observation(0), observation(1)]);
        assert_eq!(settings, vec![Settings::unchanged(); 2]);
        assert!(slot.snapshot().is_empty());
        assert!(slot.restore(State::empty()).is_err());
    }

    #[test]
    fn calls_reach_the_instance_once_initialised() {
        let slot = Slot::<Counter>::new();
        assert_eq!(slot.init(args(2, 1000)), Ok(vec![Settings::unchanged(); 2]));
        slot.decide(&[observation(0), observation(1)]);
        let second = slot.decide(&[observation(0), observation(1)]);
        assert_eq!(second[1].power_cap_w, Some(2.0));
        let state = slot.snapshot();
        assert_eq!(state.schema_version, 1);

        let successor = Slot::<Counter>::new();
        successor.init(args(2, 1000)).expect("init succeeds");
        assert_eq!(successor.restore(state), Ok(()));
        assert_eq!(
            successor.decide(&[observation(0)])[0].power_cap_w,
            Some(3.0)
        );
    }

    #[test]
    fn a_failed_reinit_leaves_no_instance() {
        let slot = Slot::<Counter>::new();
        slot.init(args(1, 1000)).expect("init succeeds");
        slot.decide(&[observation(0)]);
        assert!(slot.init(args(1, 0)).is_err());
        assert_eq!(slot.decide(&[observation(0)]), vec![Settings::unchanged()]);
    }

    #[test]
    fn a_stateless_policy_takes_empty_state_and_refuses_real_state() {
        let slot = Slot::<Stateless>::new();
        slot.init(args(1, 1000)).expect("init succeeds");
        assert!(slot.snapshot().is_empty());
        assert_eq!(slot.restore(State::empty()), Ok(()));
        let error = slot
            .restore(StateWriter::new().u64(9).finish(1))
            .expect_err("a stateless policy cannot take state");
        assert!(error.contains("keeps no state"), "{error}");
    }
}
