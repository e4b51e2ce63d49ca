//! The `static` policy: holds the settings written in its spec.
//!
//! Parameters (each optional; a knob without one is left as it is):
//!
//! | key | meaning |
//! |---|---|
//! | `power_cap_w` | power cap, watts |
//! | `sm_clock_max_mhz` | upper bound of the SM clock lock, MHz |
//! | `batch_size` | the workload's batch size, sequences |
//! | `token_budget` | tokens one engine step may process (prefill and decode), where the workload serves prompts |
//!
//! `init` fits each value to each GPU's range (the device's limits after the operator's
//! guardrails): the power cap and batch size are clamped, and the SM clock becomes the
//! highest supported clock at or below the one asked for. `init` returns those settings;
//! `decide` then leaves every knob alone unless the setting in force has drifted from
//! its value (someone else changed it, or the host is still ramping towards it under a
//! step limit), in which case it asks for the value again.
//!
//! A parameter for a knob the spec does not grant, an unknown parameter, or a value
//! that is not a positive number stops the policy from loading with an error saying so.

use tokwatt_policy_sdk::{
    DeviceFacts, InForce, InitArgs, Knobs, Observation, Params, Policy, Settings, debug, info, warn,
};

/// The power cap counts as drifted when it is further than this from its value:
/// NVML keeps the limit in milliwatts, and a host may round it to whole watts.
const POWER_CAP_TOLERANCE_W: f64 = 0.5;

/// What the spec asks for, before fitting to any GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Requested {
    power_cap_w: Option<f64>,
    sm_clock_max_mhz: Option<u32>,
    batch_size: Option<u32>,
    token_budget: Option<u32>,
}

impl Requested {
    fn from_params(args: &InitArgs) -> Result<Requested, String> {
        let params = Params::new(&args.params);
        params.check_known(&[
            "power_cap_w",
            "sm_clock_max_mhz",
            "batch_size",
            "token_budget",
        ])?;
        let requested = Requested {
            power_cap_w: params.get_optional("power_cap_w")?,
            sm_clock_max_mhz: params.get_optional("sm_clock_max_mhz")?,
            batch_size: params.get_optional("batch_size")?,
            token_budget: params.get_optional("token_budget")?,
        };
        if let Some(watts) = requested.power_cap_w
            && !(watts.is_finite() && watts > 0.0)
        {
            return Err(format!(
                "parameter `power_cap_w` = {watts} must be a positive number of watts"
            ));
        }
        if requested.sm_clock_max_mhz == Some(0) {
            return Err("parameter `sm_clock_max_mhz` must be a positive number of MHz".into());
        }
        if requested.batch_size == Some(0) {
            return Err("parameter `batch_size` must be at least 1".into());
        }
        if requested.token_budget == Some(0) {
            return Err("parameter `token_budget` must be at least 1".into());
        }
        let grants = [
            (
                requested.power_cap_w.is_some(),
                Knobs::POWER_CAP,
                "power_cap_w",
                "power-cap",
            ),
            (
                requested.sm_clock_max_mhz.is_some(),
                Knobs::SM_CLOCK,
                "sm_clock_max_mhz",
                "sm-clock",
            ),
            (
                requested.batch_size.is_some(),
                Knobs::BATCH_SIZE,
                "batch_size",
                "batch-size",
            ),
            (
                requested.token_budget.is_some(),
                Knobs::TOKEN_BUDGET,
                "token_budget",
                "token-budget",
            ),
        ];
        for (asked, knob, param, knob_name) in grants {
            if asked && !args.knobs.contains(knob) {
                return Err(format!(
                    "parameter `{param}` is set but the spec does not grant the \"{knob_name}\" \
                     knob; add \"{knob_name}\" to `knobs` or remove the parameter"
                ));
            }
        }
        Ok(requested)
    }

    fn is_empty(&self) -> bool {
        self.power_cap_w.is_none()
            && self.sm_clock_max_mhz.is_none()
            && self.batch_size.is_none()
            && self.token_budget.is_none()
    }

    /// The settings to hold on `device`: the requested ones, fitted to its range.
    fn fit_to(&self, device: &DeviceFacts) -> Settings {
        let power_cap_w = self.power_cap_w.map(|watts| {
            // `max` then `min` rather than `clamp`, which panics on a reversed range.
            let fitted = watts
                .max(device.power_cap_min_w)
                .min(device.power_cap_max_w);
            if fitted != watts {
                warn!(
                    "gpu {}: power cap {watts} W is outside {}-{} W; holding {fitted} W",
                    device.index, device.power_cap_min_w, device.power_cap_max_w
                );
            }
            fitted
        });
        let sm_clock_max_mhz = self.sm_clock_max_mhz.map(|mhz| {
            let fitted = supported_clock_at_or_below(&device.sm_clocks_mhz, mhz);
            if fitted != mhz {
                info!(
                    "gpu {}: SM clock {mhz} MHz is not supported; holding {fitted} MHz",
                    device.index
                );
            }
            fitted
        });
        let batch_size = self.batch_size.map(|sequences| {
            let fitted = sequences.min(device.batch_size_max.max(1));
            if fitted != sequences {
                warn!(
                    "gpu {}: batch size {sequences} is above the workload's {}; holding {fitted}",
                    device.index, device.batch_size_max
                );
            }
            fitted
        });
        // A workload without a token budget (max 0) gets none asked of it.
        let token_budget = self
            .token_budget
            .filter(|_| device.token_budget_max > 0)
            .map(|tokens| {
                let fitted = tokens
                    .max(device.token_budget_min)
                    .min(device.token_budget_max);
                if fitted != tokens {
                    warn!(
                        "gpu {}: token budget {tokens} is outside {}-{}; holding {fitted}",
                        device.index, device.token_budget_min, device.token_budget_max
                    );
                }
                fitted
            });
        Settings {
            power_cap_w,
            sm_clock_max_mhz,
            batch_size,
            token_budget,
        }
    }
}

/// The highest of `supported` at or below `mhz`; the lowest supported clock if all are
/// above it; `mhz` itself if the device lists no clocks.
fn supported_clock_at_or_below(supported: &[u32], mhz: u32) -> u32 {
    let at_or_below = supported
        .iter()
        .copied()
        .filter(|&clock| clock <= mhz)
        .max();
    at_or_below
        .or_else(|| supported.iter().copied().min())
        .unwrap_or(mhz)
}

/// The knobs of `target` whose value differs from what is in force.
fn drifted(target: &Settings, in_force: &InForce) -> Settings {
    Settings {
        power_cap_w: target
            .power_cap_w
            .filter(|&watts| (in_force.power_cap_w - watts).abs() > POWER_CAP_TOLERANCE_W),
        sm_clock_max_mhz: target
            .sm_clock_max_mhz
            .filter(|&mhz| in_force.sm_clock_max_mhz != mhz),
        batch_size: target
            .batch_size
            .filter(|&sequences| in_force.batch_size != sequences),
        token_budget: target
            .token_budget
            .filter(|&tokens| in_force.token_budget != tokens),
    }
}

struct Static {
    /// The settings held on each GPU, by device index.
    targets: Vec<Settings>,
}

impl Policy for Static {
    fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String> {
        let requested = Requested::from_params(&args)?;
        if requested.is_empty() {
            info!("no settings in the spec's params: leaving every GPU as it is");
        }
        let targets: Vec<Settings> = args
            .devices
            .iter()
            .map(|device| requested.fit_to(device))
            .collect();
        let first = targets.clone();
        Ok((Static { targets }, first))
    }

    fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
        observations
            .iter()
            .map(|observation| {
                let Some(target) = usize::try_from(observation.gpu)
                    .ok()
                    .and_then(|index| self.targets.get(index))
                else {
                    return Settings::unchanged();
                };
                let again = drifted(target, &observation.in_force);
                if !again.is_unchanged() {
                    debug!(
                        "gpu {}: in force {:?} drifted from the held settings; asking for {again:?}",
                        observation.gpu, observation.in_force
                    );
                }
                again
            })
            .collect()
    }
}

tokwatt_policy_sdk::export_policy!(Static);

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_policy_sdk::testing;

    fn init(knobs: Knobs, params: &[(&str, &str)]) -> Result<(Static, Vec<Settings>), String> {
        let mut args = testing::init_args(vec![testing::h200(0), testing::h200(1)], knobs);
        args.params = testing::params(params);
        Static::init(args)
    }

    #[test]
    fn init_returns_the_requested_settings_for_every_gpu() {
        let params = [
            ("power_cap_w", "500"),
            ("sm_clock_max_mhz", "1410"),
            ("batch_size", "64"),
        ];
        let Ok((_, first)) = init(Knobs::all(), &params) else {
            panic!("init fails");
        };
        let expected = Settings::unchanged()
            .with_power_cap_w(500.0)
            .with_sm_clock_max_mhz(1410)
            .with_batch_size(64);
        assert_eq!(first, vec![expected; 2]);
    }

    #[test]
    fn the_token_budget_is_held_where_the_workload_has_one_and_fitted_to_its_range() {
        let mut args = testing::init_args(
            vec![testing::h200_serving(0), testing::h200(1)],
            Knobs::TOKEN_BUDGET,
        );
        args.params = testing::params(&[("token_budget", "9000")]);
        let Ok((mut policy, first)) = Static::init(args) else {
            panic!("init fails");
        };
        // Fitted to the serving GPU's 1-8192; the decode-only GPU has no budget to set.
        assert_eq!(first[0].token_budget, Some(8192));
        assert_eq!(first[1].token_budget, None);
        let mut drifted = testing::observation(0, 1);
        drifted.in_force.token_budget = 512;
        assert_eq!(policy.decide(&[drifted])[0].token_budget, Some(8192));
        // Not granted: refused, naming the knob.
        let error = init(Knobs::BATCH_SIZE, &[("token_budget", "512")])
            .err()
            .expect("refused");
        assert!(error.contains("token-budget"), "{error}");
        assert!(init(Knobs::all(), &[("token_budget", "0")]).is_err());
    }

    #[test]
    fn without_params_every_gpu_is_left_alone() {
        let Ok((mut policy, first)) = init(Knobs::empty(), &[]) else {
            panic!("init fails");
        };
        assert_eq!(first, vec![Settings::unchanged(); 2]);
        let mut observation = testing::observation(0, 1);
        observation.in_force.power_cap_w = 321.0;
        assert_eq!(policy.decide(&[observation]), vec![Settings::unchanged()]);
    }

    #[test]
    fn values_are_fitted_to_the_device_range() {
        let params = [
            ("power_cap_w", "900"),
            ("sm_clock_max_mhz", "1412"),
            ("batch_size", "4096"),
        ];
        let Ok((_, first)) = init(Knobs::all(), &params) else {
            panic!("init fails");
        };
        assert_eq!(first[0].power_cap_w, Some(700.0));
        assert_eq!(first[0].sm_clock_max_mhz, Some(1410));
        assert_eq!(first[0].batch_size, Some(512));

        let Ok((_, first)) = init(
            Knobs::all(),
            &[("power_cap_w", "50"), ("sm_clock_max_mhz", "100")],
        ) else {
            panic!("init fails");
        };
        assert_eq!(first[1].power_cap_w, Some(200.0));
        assert_eq!(first[1].sm_clock_max_mhz, Some(345));
    }

    #[test]
    fn decide_reasserts_only_the_knobs_that_drifted() {
        let params = [("power_cap_w", "500"), ("batch_size", "64")];
        let Ok((mut policy, _)) = init(Knobs::all(), &params) else {
            panic!("init fails");
        };
        let mut settled = testing::observation(0, 1);
        settled.in_force.power_cap_w = 500.2;
        settled.in_force.batch_size = 64;
        let mut drifted = testing::observation(1, 1);
        drifted.in_force.power_cap_w = 650.0;
        drifted.in_force.batch_size = 64;
        drifted.in_force.sm_clock_max_mhz = 990;
        let settings = policy.decide(&[settled, drifted]);
        assert_eq!(settings[0], Settings::unchanged());
        assert_eq!(settings[1], Settings::unchanged().with_power_cap_w(500.0));
    }

    #[test]
    fn an_unknown_gpu_is_left_alone() {
        let Ok((mut policy, _)) = init(Knobs::all(), &[("power_cap_w", "500")]) else {
            panic!("init fails");
        };
        let stranger = testing::observation(7, 1);
        assert_eq!(policy.decide(&[stranger]), vec![Settings::unchanged()]);
    }

    #[test]
    fn spec_mistakes_are_errors_that_say_how_to_fix_them() {
        let error = init(Knobs::POWER_CAP, &[("batch_size", "64")]).err();
        let error = error.unwrap_or_default();
        assert!(error.contains("\"batch-size\""), "{error}");
        assert!(error.contains("add"), "{error}");

        let error = init(Knobs::all(), &[("power_cap", "500")])
            .err()
            .unwrap_or_default();
        assert!(error.contains("unknown parameter `power_cap`"), "{error}");

        for bad in ["-5", "NaN", "inf", "0"] {
            let error = init(Knobs::all(), &[("power_cap_w", bad)])
                .err()
                .unwrap_or_default();
            assert!(error.contains("power_cap_w"), "{bad}: {error}");
        }
        assert!(init(Knobs::all(), &[("batch_size", "0")]).is_err());
        assert!(init(Knobs::all(), &[("batch_size", "-1")]).is_err());
        assert!(init(Knobs::all(), &[("sm_clock_max_mhz", "0")]).is_err());
    }

    #[test]
    fn clock_fitting_picks_the_highest_supported_at_or_below() {
        let supported = [1980, 1965, 1950];
        assert_eq!(supported_clock_at_or_below(&supported, 1970), 1965);
        assert_eq!(supported_clock_at_or_below(&supported, 1980), 1980);
        assert_eq!(supported_clock_at_or_below(&supported, 5000), 1980);
        assert_eq!(supported_clock_at_or_below(&supported, 10), 1950);
        assert_eq!(supported_clock_at_or_below(&[], 1234), 1234);
    }
}
