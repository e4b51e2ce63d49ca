//! One rule for what a GPU accepts: the same requests through the simulated GPU's actuator
//! and through the rule the NVML actuator checks before it calls the driver get the same
//! answers, so code tested on the simulator is not refused on a GPU (issue 43).

use tokwatt_core::actuator::accepts::{self, Request};
use tokwatt_sim::{GpuProfile, Scenario, SimConfig, SimGpu};

#[test]
fn the_simulator_and_nvml_accept_and_refuse_the_same_requests() {
    for profile in ["h200", "h100", "a100"] {
        let sim = SimGpu::new(
            SimConfig {
                profile: GpuProfile::load(profile).expect("profile"),
                scenario: Scenario::built_in().expect("scenario"),
                gpus: 1,
                seed: 1,
                noise_seed: None,
            },
            tokwatt_core::clock::VirtualClock::new(),
        )
        .expect("sim");
        let device = sim.telemetry().devices().remove(0);
        let (lowest, highest) = (
            *device.sm_clocks_mhz.last().expect("sm clocks"),
            device.sm_clocks_mhz[0],
        );
        let (mem_low, mem_high) = (
            *device.mem_clocks_mhz.last().expect("mem clocks"),
            device.mem_clocks_mhz[0],
        );
        let requests = [
            Request::PowerCap(device.power_cap_min_w),
            Request::PowerCap(device.power_cap_max_w),
            Request::PowerCap(device.power_cap_min_w - 1.0),
            Request::PowerCap(device.power_cap_max_w + 0.5),
            Request::PowerCap(f64::NAN),
            Request::PowerCap(f64::INFINITY),
            Request::SmClockLock(lowest, highest),
            Request::SmClockLock(lowest, lowest),
            Request::SmClockLock(highest, lowest),
            // Overlapping the supported span, reaching outside it on either side.
            Request::SmClockLock(lowest.saturating_sub(50), highest),
            Request::SmClockLock(lowest, highest + 100),
            Request::SmClockLock(highest + 1, highest + 100),
            Request::MemClockLock(mem_low, mem_high),
            Request::MemClockLock(mem_low.saturating_sub(1), mem_high),
            Request::MemClockLock(mem_high, mem_high + 1000),
        ];
        let mut actuator = sim.actuator();
        for request in requests {
            let by_the_rule = accepts::check(&device, request);
            let by_the_simulator = match request {
                Request::PowerCap(watts) => actuator.set_power_cap(0, watts).map(|_| ()),
                Request::SmClockLock(lo, hi) => actuator.set_sm_clock_lock(0, Some((lo, hi))),
                Request::MemClockLock(lo, hi) => actuator.set_mem_clock_lock(0, Some((lo, hi))),
            };
            assert_eq!(
                by_the_rule.is_ok(),
                by_the_simulator.is_ok(),
                "{profile}: {request:?}: the rule says {by_the_rule:?}, the simulator {by_the_simulator:?}"
            );
            if let (Err(refused), Err(error)) = (&by_the_rule, &by_the_simulator) {
                assert!(
                    error.to_string().contains(&refused.to_string()),
                    "{profile}: {request:?}: {error} should say {refused}"
                );
            }
        }
    }
}
