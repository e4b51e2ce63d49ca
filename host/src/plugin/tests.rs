//! The plugin host against real components built by host/build.rs.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::bench::{sample_init_args, sample_observation};
use crate::policy::{InitArgs, PolicyEngine, PolicyState};

/// A plugin built by host/build.rs; `$TOKWATT_PLUGIN_DIR` first, so the test binary also
/// runs from a bundle on another machine (scripts/gpu-bundle.sh ships the fixtures).
fn built(name: &str) -> PathBuf {
    let file = format!("{name}.wasm");
    std::env::var_os("TOKWATT_PLUGIN_DIR")
        .map(|dir| Path::new(&dir).join(&file))
        .filter(|path| path.is_file())
        .unwrap_or_else(|| Path::new(env!("TOKWATT_BUILT_PLUGIN_DIR")).join(file))
}

fn args(gpus: u32) -> InitArgs {
    sample_init_args(gpus)
}

fn instance(host: &PluginHost, name: &str, limits: SandboxLimits) -> WasmPolicy {
    let loaded = Arc::new(host.load(&built(name), name, limits).expect("loads"));
    loaded.instantiate(3).expect("instantiates")
}

#[test]
fn compiled_components_are_cached_and_a_bad_cache_entry_is_recompiled() {
    let cache = tempfile::tempdir().expect("tempdir");
    let config = HostConfig {
        cache_dir: Some(cache.path().to_owned()),
    };
    let host = PluginHost::new(&config).expect("host");
    host.load(&built("policy_static"), "static", SandboxLimits::default())
        .expect("compiles");
    let entries: Vec<_> = std::fs::read_dir(cache.path())
        .expect("cache written")
        .map(|e| e.expect("entry").path())
        .collect();
    assert_eq!(entries.len(), 1, "one compiled component: {entries:?}");
    let cached = &entries[0];
    assert_eq!(cached.extension().and_then(|e| e.to_str()), Some("cwasm"));

    // A second host (same engine settings) finds the same entry.
    let again = PluginHost::new(&config).expect("host");
    let mut policy = instance(&again, "policy_static", SandboxLimits::default());
    assert!(policy.init(&args(1)).is_ok());

    // A damaged entry is ignored, recompiled and replaced.
    std::fs::write(cached, b"not a compiled component").expect("damage");
    let third = PluginHost::new(&config).expect("host");
    let mut policy = instance(&third, "policy_static", SandboxLimits::default());
    assert!(policy.init(&args(1)).is_ok());
    assert!(std::fs::metadata(cached).expect("rewritten").len() > 1000);
}

#[test]
fn state_hands_over_between_instances() {
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let observations = [sample_observation(0, 0)];
    let mut old = instance(&host, "fixture_stateful", SandboxLimits::default());
    old.init(&args(1)).expect("init");
    for _ in 0..3 {
        old.decide(Duration::ZERO, &observations).expect("decide");
    }
    let state = old.snapshot().expect("snapshot");
    assert_eq!(state.schema_version, 1);

    let mut new = instance(&host, "fixture_stateful", SandboxLimits::default());
    new.init(&args(1)).expect("init");
    new.restore(&state).expect("restore");
    let next = new.decide(Duration::ZERO, &observations).expect("decide");
    assert_eq!(next[0].power_cap_w, Some(204.0), "the count went on from 3");

    let refused = new.restore(&PolicyState {
        schema_version: 99,
        bytes: vec![],
    });
    assert!(
        matches!(refused, Err(PolicyFailure::Refused(_))),
        "{refused:?}"
    );
}

#[test]
fn each_limit_is_named() {
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let observations = [sample_observation(0, 0)];

    let mut looping = instance(&host, "fixture_infinite_loop", SandboxLimits::default());
    looping.init(&args(1)).expect("init");
    assert_eq!(
        looping.decide(Duration::ZERO, &observations),
        Err(PolicyFailure::OutOfFuel)
    );

    let mut slow = instance(
        &host,
        "fixture_infinite_loop",
        SandboxLimits {
            fuel_per_call: u64::MAX / 2,
            deadline_ms: 10,
            ..SandboxLimits::default()
        },
    );
    slow.init(&args(1)).expect("init");
    assert_eq!(
        slow.decide(Duration::ZERO, &observations),
        Err(PolicyFailure::Deadline { deadline_ms: 10 })
    );

    let mut bomb = instance(
        &host,
        "fixture_memory_bomb",
        SandboxLimits {
            memory_mib: 8,
            ..SandboxLimits::default()
        },
    );
    bomb.init(&args(1)).expect("init");
    assert_eq!(
        bomb.decide(Duration::ZERO, &observations),
        Err(PolicyFailure::MemoryLimit { limit_mib: 8 })
    );

    let mut trap = instance(&host, "fixture_trap_init", SandboxLimits::default());
    assert!(matches!(trap.init(&args(1)), Err(PolicyFailure::Trap(_))));
    // After a rebuild the instance is usable again.
    trap.rebuild().expect("rebuilds");
}

#[test]
fn other_contract_versions_are_refused_by_name() {
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let error = host
        .load(
            &built("fixture_wrong_version"),
            "v1",
            SandboxLimits::default(),
        )
        .expect_err("refused");
    let text = error.to_string();
    assert!(
        text.contains("tokwatt:policy/guest@1.0.0") && text.contains("0.1.*"),
        "{text}"
    );
}

#[test]
fn plugins_see_the_runs_clock_and_seeded_random() {
    // Same seed, same stream: what makes a seeded run replay exactly.
    let limits = SandboxLimits::default();
    let mut a = sandbox::HostState::new("a", 9, &limits);
    let mut b = sandbox::HostState::new("b", 9, &limits);
    use bindings::tokwatt::policy::host::Host as _;
    let sa: Vec<u64> = (0..4).map(|_| a.random()).collect();
    let sb: Vec<u64> = (0..4).map(|_| b.random()).collect();
    assert_eq!(sa, sb);
    a.set_tick_time(Duration::from_millis(12_345));
    assert_eq!(a.tick_time_ms(), 12_345);
}
