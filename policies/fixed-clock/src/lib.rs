//! The `fixed-clock` baseline: a fixed, reduced SM clock lock, the board's default power
//! cap and a fixed batch size, on every GPU.
//!
//! A reduced clock is the classic hand-tuned energy saving: lower voltage and frequency
//! cut power more than they cut a memory-bound decode's speed. This policy is what an
//! operator gets from one `nvidia-smi -lgc` and a fixed engine batch, to compare the
//! adaptive policies with.
//!
//! # Parameters
//!
//! | key | default | meaning |
//! |---|---|---|
//! | `sm_clock_max_mhz` | 1410 | the lock's upper bound, fitted down to a supported clock |
//! | `batch_size` | the workload's largest | sequences decoded together, fitted to the range |
//!
//! It needs the `sm-clock` knob; the cap and the batch are set where granted. `decide`
//! only re-asserts a setting that something else moved. It keeps no state between
//! ticks, so it hands none over at a hot swap (the SDK's empty state), and it has
//! nothing to re-explore when the workload shifts: that is the point of a fixed baseline.

use tokwatt_policy_kit::clocks::supported_clock_at_or_below;
use tokwatt_policy_kit::{check_objective, decide_per_gpu};
use tokwatt_policy_sdk::{
    DeviceFacts, InitArgs, Knobs, Observation, Params, Policy, Settings, info,
};

/// What the spec asks for, before fitting to a GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Requested {
    clock_mhz: u32,
    batch_size: Option<u32>,
}

/// The settings one GPU is held at.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Held {
    cap_w: Option<f64>,
    clock_mhz: u32,
    batch_size: Option<u32>,
}

impl Held {
    fn new(device: &DeviceFacts, knobs: Knobs, requested: Requested) -> Result<Held, String> {
        let clock_mhz =
            supported_clock_at_or_below(device, requested.clock_mhz).ok_or_else(|| {
                format!(
                    "gpu {}: the host reports no supported SM clocks to lock to",
                    device.index
                )
            })?;
        let batch_size = knobs.contains(Knobs::BATCH_SIZE).then(|| {
            requested
                .batch_size
                .unwrap_or(device.batch_size_max)
                .clamp(1, device.batch_size_max.max(1))
        });
        Ok(Held {
            cap_w: knobs.contains(Knobs::POWER_CAP).then(|| {
                device
                    .power_cap_default_w
                    .clamp(device.power_cap_min_w, device.power_cap_max_w)
            }),
            clock_mhz,
            batch_size,
        })
    }

    fn settings(&self) -> Settings {
        Settings {
            power_cap_w: self.cap_w,
            sm_clock_max_mhz: Some(self.clock_mhz),
            batch_size: self.batch_size,
            token_budget: None,
        }
    }

    /// Only what drifted from its value.
    fn reassert(&self, observation: &Observation) -> Settings {
        let in_force = observation.in_force;
        Settings {
            power_cap_w: self
                .cap_w
                .filter(|cap_w| (cap_w - in_force.power_cap_w).abs() > 0.5),
            sm_clock_max_mhz: Some(self.clock_mhz)
                .filter(|&clock| clock != in_force.sm_clock_max_mhz),
            batch_size: self.batch_size.filter(|&size| size != in_force.batch_size),
            token_budget: None,
        }
    }
}

#[derive(Debug, Clone)]
struct FixedClock {
    gpus: Vec<Held>,
}

impl Policy for FixedClock {
    fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String> {
        if !args.knobs.contains(Knobs::SM_CLOCK) {
            return Err("fixed-clock locks the SM clock and was not granted \
                 \"sm-clock\": list it in the spec's `knobs`, or, where it is listed, \
                 run where the agent does not withhold it (the agent says why it does)"
                .into());
        }
        let params = Params::new(&args.params);
        params.check_known(&["sm_clock_max_mhz", "batch_size"])?;
        let requested = Requested {
            clock_mhz: params.get("sm_clock_max_mhz", 1410)?,
            batch_size: params.get_optional("batch_size")?,
        };
        if requested.clock_mhz == 0 {
            return Err("parameter `sm_clock_max_mhz` must be a positive number of MHz".into());
        }
        if requested.batch_size == Some(0) {
            return Err("parameter `batch_size` must be at least 1".into());
        }
        if requested.batch_size.is_some() && !args.knobs.contains(Knobs::BATCH_SIZE) {
            return Err(
                "parameter `batch_size` needs the batch size knob: add \"batch-size\" to the \
                 spec's `knobs`"
                    .into(),
            );
        }
        check_objective(&args.objective)?;
        let gpus = args
            .devices
            .iter()
            .map(|device| Held::new(device, args.knobs, requested))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(first) = gpus.first() {
            info!(
                "fixed-clock on {} GPUs: SM clock locked at {} MHz (asked {}), batch {:?}",
                gpus.len(),
                first.clock_mhz,
                requested.clock_mhz,
                first.batch_size
            );
        }
        let first = gpus.iter().map(Held::settings).collect();
        Ok((FixedClock { gpus }, first))
    }

    fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
        decide_per_gpu(&mut self.gpus, observations, |held, observation| {
            held.reassert(observation)
        })
    }
}

tokwatt_policy_sdk::export_policy!(FixedClock);

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_policy_sdk::testing;

    fn init(knobs: Knobs, params: &[(&str, &str)]) -> Result<(FixedClock, Vec<Settings>), String> {
        let mut args = testing::init_args(vec![testing::h200(0), testing::h200(1)], knobs);
        args.params = testing::params(params);
        FixedClock::init(args)
    }

    fn all() -> Knobs {
        Knobs::POWER_CAP | Knobs::SM_CLOCK | Knobs::BATCH_SIZE
    }

    #[test]
    fn locks_the_clock_fitted_to_a_supported_one_at_the_default_cap() {
        let (_, first) = init(all(), &[]).unwrap();
        let expected = Settings {
            power_cap_w: Some(700.0),
            sm_clock_max_mhz: Some(1410),
            batch_size: Some(512),
            token_budget: None,
        };
        assert_eq!(first, vec![expected, expected]);
        let (_, first) = init(Knobs::SM_CLOCK, &[("sm_clock_max_mhz", "1400")]).unwrap();
        assert_eq!(first[0], Settings::unchanged().with_sm_clock_max_mhz(1395));
        let (_, first) =
            init(all(), &[("sm_clock_max_mhz", "100"), ("batch_size", "900")]).unwrap();
        assert_eq!(first[1].sm_clock_max_mhz, Some(345));
        assert_eq!(first[1].batch_size, Some(512));
    }

    #[test]
    fn re_asserts_only_what_drifted() {
        let (mut policy, _) = init(all(), &[("batch_size", "256")]).unwrap();
        let mut held = testing::observation(0, 0);
        held.in_force.sm_clock_max_mhz = 1410;
        held.in_force.batch_size = 256;
        let mut drifted = testing::observation(1, 0);
        drifted.in_force.sm_clock_max_mhz = 1980;
        drifted.in_force.batch_size = 256;
        assert_eq!(
            policy.decide(&[held, drifted]),
            vec![
                Settings::unchanged(),
                Settings::unchanged().with_sm_clock_max_mhz(1410)
            ]
        );
    }

    #[test]
    fn bad_parameters_and_missing_knobs_are_refused_by_name() {
        type Case = (Knobs, &'static [(&'static str, &'static str)], &'static str);
        let cases: [Case; 5] = [
            (all(), &[("sm_clock_max_mhz", "0")], "sm_clock_max_mhz"),
            (all(), &[("sm_clock_max_mhz", "fast")], "sm_clock_max_mhz"),
            (all(), &[("batch_size", "0")], "batch_size"),
            (Knobs::SM_CLOCK, &[("batch_size", "64")], "\"batch-size\""),
            (Knobs::BATCH_SIZE, &[], "\"sm-clock\""),
        ];
        for (knobs, params, named) in cases {
            let error = init(knobs, params).err().unwrap_or_default();
            assert!(error.contains(named), "{params:?}: {error}");
        }
        let error = init(all(), &[("clock", "1")]).err().unwrap_or_default();
        assert!(error.contains("unknown parameter `clock`"), "{error}");
    }
}
