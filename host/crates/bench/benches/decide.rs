//! One `decide` call for 8 GPUs through the plugin host and supervisor, with a policy
//! that does no work of its own (the shipped `static` policy), so this is the host's
//! overhead: conversions, arming fuel and deadline, the call, and the checks.
//! Run: `cargo bench -p tokwatt --bench decide`. `tokwatt bench decide` prints p50/p99.

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};

fn decide_8_gpus(c: &mut Criterion) {
    let plugin = tokwatt_plugin_artifacts::built_plugin("policy_static");
    let mut supervisor = match tokwatt_bench::supervisor_for(&plugin, 8) {
        Ok(s) => s,
        Err(e) => panic!(
            "cannot start the static policy from {}: {e}",
            plugin.display()
        ),
    };
    let observations: Vec<_> = (0..8)
        .map(|g| tokwatt_core::types::Observation::typical_h200(g, 0))
        .collect();
    let mut tick = 0;
    c.bench_function("decide/8-gpus/static", |b| {
        b.iter(|| {
            tick += 1;
            supervisor.decide(tick, Duration::ZERO, &observations)
        })
    });
}

criterion_group!(benches, decide_8_gpus);
criterion_main!(benches);
