//! Cost of the simulator: a 30-minute run of 8 simulated H200s with 1 s control ticks, read
//! through the traits as the control loop reads it (the brief asks for well under a second).

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use tokwatt_core::clock::{Clock, VirtualClock};
use tokwatt_sim::{GpuProfile, Scenario, SimConfig, SimGpu};

fn thirty_minutes_eight_gpus(c: &mut Criterion) {
    let profile = GpuProfile::load("h200").expect("built-in profile");
    let scenario = Scenario::built_in().expect("built-in scenario");
    let mut group = c.benchmark_group("sim");
    group.sample_size(10);
    group.bench_function("30 min x 8 GPUs, 1 s ticks", |b| {
        b.iter(|| {
            let clock = VirtualClock::new();
            let config = SimConfig {
                profile: profile.clone(),
                scenario: scenario.clone(),
                gpus: 8,
                seed: 7,
                noise_seed: None,
            };
            let sim = SimGpu::new(config, clock.clone()).expect("valid config");
            let (mut telemetry, mut workload) = (sim.telemetry(), sim.workload());
            let mut tokens = 0;
            for tick in 1..=1800u64 {
                clock.sleep_until(Duration::from_secs(tick));
                for gpu in 0..8 {
                    telemetry.read_window(gpu).expect("gpu in range");
                    tokens += workload.read_window(gpu).expect("gpu in range").tokens;
                }
            }
            assert!(clock.now() == Duration::from_secs(1800) && tokens > 0);
            tokens
        });
    });
    group.finish();
}

criterion_group!(benches, thirty_minutes_eight_gpus);
criterion_main!(benches);
