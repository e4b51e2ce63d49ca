//! Plausible arguments for a policy's native unit tests, so a test spells out only what
//! it is about: `let mut obs = testing::observation(0, 7); obs.tokens = 0;`.
//!
//! The figures follow an NVIDIA H200 decoding Llama-3-8B at batch 64 under a 700 W cap
//! (the project's calibration data); they are inputs for tests, not measurements.

use crate::{ClockEvents, DeviceFacts, InForce, InitArgs, Knobs, Objective, Observation};

/// An H200 as the host describes it without guardrails: power cap 200–700 W (default
/// 700 W), SM clocks 1980 MHz down to 345 MHz in 15 MHz steps, batch size up to 512.
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
/// a 700 W cap, batch 64, nothing clamped.
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
        in_force: InForce {
            power_cap_w: 700.0,
            sm_clock_max_mhz: 1980,
            batch_size: 64,
        },
        last_clamped: false,
        settling: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
