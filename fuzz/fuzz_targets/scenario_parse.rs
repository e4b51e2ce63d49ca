//! `Scenario::from_toml_str` on arbitrary text: an error or a valid scenario, never a
//! panic; a valid scenario answers its demand questions at any time.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokwatt_sim::Scenario;

fuzz_target!(|text: &str| {
    // `model = "<name>"` may name a model file: keep the fuzzer from naming devices or
    // fifos that never end (a finding of its own, see README.md), only presets and
    // inline shapes are exercised.
    if text.contains('/') {
        return;
    }
    if let Ok(scenario) = Scenario::from_toml_str(text, "fuzz") {
        for t in [0.0, 1.0, 59.5, 3600.0, 86_400.0, 1e9] {
            let rps = scenario.arrival_rps_at(t);
            assert!(rps.is_finite() && rps >= 0.0, "{rps} at {t}");
            if let Some(limit) = scenario.outside_power_limit_at(t) {
                assert!(limit.is_finite() && limit > 0.0, "{limit} at {t}");
            }
        }
    }
});
