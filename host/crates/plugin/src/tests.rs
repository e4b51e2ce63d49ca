//! The plugin host against real components built by host/crates/plugin-artifacts/build.rs.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use tokwatt_policy::supervisor::{InitArgs, PolicyEngine, PolicyState};

use tokwatt_plugin_artifacts::built_plugin as built;

fn args(gpus: u32) -> InitArgs {
    InitArgs::typical_h200(gpus)
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
    let observations = [Observation::typical_h200(0, 0)];
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
    let observations = [Observation::typical_h200(0, 0)];

    let mut looping = instance(&host, "fixture_infinite_loop", SandboxLimits::default());
    looping.init(&args(1)).expect("init");
    assert_eq!(
        looping.decide(Duration::ZERO, &observations),
        Err(PolicyFailure::OutOfFuel { stderr: None })
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
        Err(PolicyFailure::Deadline {
            deadline_ms: 10,
            stderr: None
        })
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
        Err(PolicyFailure::MemoryLimit {
            limit_mib: 8,
            stderr: None
        })
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
        text.contains("tokwatt:policy/guest@1.0.0")
            && text.contains("0.4.* or 0.3.* or 0.2.* or 0.1.*"),
        "{text}"
    );
}

#[test]
fn plugins_see_the_runs_clock_and_seeded_random() {
    // Same seed, same stream: what makes a seeded run replay exactly.
    let limits = SandboxLimits::default();
    let mut a = sandbox::HostState::new("a", 9, &limits);
    let mut b = sandbox::HostState::new("b", 9, &limits);
    let sa: Vec<u64> = (0..4).map(|_| a.guest_random()).collect();
    let sb: Vec<u64> = (0..4).map(|_| b.guest_random()).collect();
    assert_eq!(sa, sb);
    a.set_tick_time(Duration::from_millis(12_345));
    assert_eq!(a.guest_tick_time_ms(), 12_345);
}

fn hostile(host: &PluginHost, mode: &str, limits: SandboxLimits) -> (WasmPolicy, InitArgs) {
    let mut init_args = args(1);
    init_args.params = vec![("mode".to_owned(), mode.to_owned())];
    (instance(host, "fixture_hostile", limits), init_args)
}

#[test]
fn a_sleeping_plugin_does_not_wait() {
    // `std::thread::sleep` in `decide` and in `init`: fuel and the epoch deadline do
    // not run while a guest waits in a host call, so the clock it sleeps on is virtual.
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let observations = [Observation::typical_h200(0, 0)];
    // Both loaded (compiled) first, so only the calls are timed. They sleep 60 s and
    // 10 minutes: blocking, these calls would take 11 minutes; they take milliseconds,
    // so the bound below is far from both (a proof of not blocking, not a speed target).
    let (mut sleeper, init_args) = hostile(&host, "sleep-decide", SandboxLimits::default());
    let (mut init_sleeper, init_sleeper_args) =
        hostile(&host, "sleep-init", SandboxLimits::default());
    let started = std::time::Instant::now();
    sleeper.init(&init_args).expect("init");
    sleeper
        .decide(Duration::from_secs(7), &observations)
        .expect("decide returns");
    init_sleeper.init(&init_sleeper_args).expect("init returns");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "sleeping took {:?}",
        started.elapsed()
    );
    // An endless sleep loop is stopped like any loop.
    let (mut forever, init_args) = hostile(&host, "sleep-forever", SandboxLimits::default());
    forever.init(&init_args).expect("init");
    let failure = forever
        .decide(Duration::ZERO, &observations)
        .expect_err("stopped");
    assert!(
        matches!(
            failure,
            PolicyFailure::OutOfFuel { .. } | PolicyFailure::Deadline { .. }
        ),
        "{failure:?}"
    );
}

#[test]
fn the_monotonic_clock_is_virtual_and_never_goes_back() {
    let limits = SandboxLimits::default();
    let mut state = sandbox::HostState::new("a", 1, &limits);
    state.set_tick_time(Duration::from_secs(10));
    let clock = state.clock_for_tests();
    assert_eq!(clock.monotonic(), 10_000_000_000);
    // A 5 s sleep moves it 5 s at once; the next tick does not move it back.
    let mut view = state.virtual_clock_for_tests();
    use wasmtime_wasi::p2::bindings::clocks::monotonic_clock::Host as _;
    view.subscribe_duration(5_000_000_000).expect("subscribes");
    assert_eq!(view.now().expect("now"), 15_000_000_000);
    state.set_tick_time(Duration::from_secs(11));
    assert_eq!(clock.monotonic(), 15_000_000_000);
    state.set_tick_time(Duration::from_secs(20));
    assert_eq!(clock.monotonic(), 20_000_000_000);
}

#[test]
fn a_normal_policy_fits_the_counts() {
    // Every SDK-built plugin instantiates under the instance, memory and table counts.
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    for name in [
        "policy_static",
        "policy_hill_climb",
        "policy_cap_and_batch",
        "fixture_stateful",
    ] {
        let mut policy = instance(&host, name, SandboxLimits::default());
        // cap-and-batch refuses to start without a latency objective: it ran, and that
        // is all this checks.
        match policy.init(&args(2)) {
            Ok(_) | Err(PolicyFailure::Refused(_)) => {}
            Err(failure) => panic!("{name}: {failure}"),
        }
    }
}

#[test]
fn traps_name_their_cause() {
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let observations = [Observation::typical_h200(0, 0)];
    let (mut panicking, init_args) =
        hostile(&host, "panic-decide-message", SandboxLimits::default());
    panicking.init(&init_args).expect("init");
    let Err(PolicyFailure::Trap(text)) = panicking.decide(Duration::ZERO, &observations) else {
        panic!("a trap");
    };
    assert!(text.contains("wasm trap"), "{text}");
    assert!(!text.contains("wasm backtrace"), "{text}");
    assert!(
        text.contains("the cause: index 7 of a 3-element table"),
        "the panic message: {text}"
    );
    let (mut deep, init_args) = hostile(&host, "stack-overflow", SandboxLimits::default());
    deep.init(&init_args).expect("init");
    let Err(PolicyFailure::Trap(text)) = deep.decide(Duration::ZERO, &observations) else {
        panic!("a trap");
    };
    assert!(text.contains("stack"), "{text}");
}

#[test]
fn a_wrong_signature_is_refused_naming_the_function() {
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let error = host
        .load(
            &built("fixture_wrong_signature"),
            "sig",
            SandboxLimits::default(),
        )
        .expect_err("refused");
    let text = error.to_string();
    assert!(matches!(error, PluginError::Contract { .. }), "{text}");
    assert!(text.contains("decide"), "{text}");
}

#[test]
fn plugin_text_is_escaped_and_bounded() {
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let (mut refusing, init_args) = hostile(&host, "hostile-error", SandboxLimits::default());
    let Err(PolicyFailure::Refused(text)) = refusing.init(&init_args) else {
        panic!("refused");
    };
    assert!(text.len() < 2048, "{} bytes", text.len());
    assert!(!text.chars().any(char::is_control), "{text:?}");
    assert!(text.contains("\\u{1b}[2J") && text.contains("\\nERROR fake line"));
    assert!(text.contains("bytes cut"), "{text}");
}

#[test]
fn leaked_host_resources_are_bounded() {
    let limits = SandboxLimits::default();
    let mut state = sandbox::HostState::new("a", 1, &limits);
    let mut view = state.virtual_clock_for_tests();
    use wasmtime_wasi::p2::bindings::clocks::monotonic_clock::Host as _;
    let mut held = 0;
    while view.subscribe_duration(1).is_ok() {
        held += 1;
        assert!(held <= 4096, "no bound");
    }
    assert!(held >= 100, "room for a normal policy: {held}");
}

#[test]
fn the_wall_clock_deadline_has_a_margin() {
    // 100 ms allowed: interrupted no sooner than 200 ms (in 2 ms epochs, plus one).
    assert_eq!(deadline_epochs(100), 101);
    assert_eq!(deadline_epochs(1), 2);
    assert!(deadline_epochs(u64::MAX) > 1);
}

/// Measurement behind [`DEADLINE_MARGIN`]: the spread of wall time per call of a plugin
/// doing the same work every call. Run with `--ignored --nocapture` (under load, e.g.
/// beside a build, to see the spread that matters).
#[test]
#[ignore = "a measurement, not a check"]
fn wall_time_per_call_varies() {
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let (mut drain, init_args) = hostile(
        &host,
        "entropy-drain",
        SandboxLimits {
            deadline_ms: 60_000,
            fuel_per_call: u64::MAX / 2,
            ..SandboxLimits::default()
        },
    );
    drain.init(&init_args).expect("init");
    let observations = [Observation::typical_h200(0, 0)];
    let mut times: Vec<f64> = (0..40)
        .map(|_| {
            let started = std::time::Instant::now();
            drain.decide(Duration::ZERO, &observations).expect("decide");
            started.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    println!(
        "ms per call: min {:.1} median {:.1} p90 {:.1} max {:.1} (max/min {:.2})",
        times[0],
        times[20],
        times[36],
        times[39],
        times[39] / times[0]
    );
}

/// A plugin built against contract 0.1 before 0.2 existed (`tests/fixtures/contract-0.1`,
/// built by the 0.1 SDK from the shipped policy of that name), loaded.
fn load_0_1(host: &PluginHost, name: &str) -> LoadedPlugin {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../tests/fixtures/contract-0.1")
        .join(format!("{name}.wasm"));
    host.load(&path, name, SandboxLimits::default())
        .expect("a 0.1 plugin loads")
}

#[test]
fn a_plugin_built_against_0_1_keeps_loading_and_running() {
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let loaded = load_0_1(&host, "static");
    assert_eq!(loaded.contract_line(), "0.1.*");
    let mut policy = Arc::new(loaded).instantiate(1).expect("instantiates");
    let mut init_args = args(2);
    init_args.params = vec![("power_cap_w".to_owned(), "500".to_owned())];
    // The 0.2 fields the 0.1 plugin cannot see: set, so converting them away is exercised.
    init_args.objective.queue_wait_p99_limit_ms = Some(800.0);
    let first = policy.init(&init_args).expect("init");
    assert_eq!(first.len(), 2);
    assert!(
        first.iter().all(|s| s.power_cap_w == Some(500.0)),
        "{first:?}"
    );
    let mut observation = Observation::typical_h200(0, 1);
    observation.demand = Some(tokwatt_core::types::DemandWindow {
        requests_arrived: 7,
        queue_wait_p99_ms: Some(12.0),
        ..Default::default()
    });
    let answer = policy
        .decide(
            Duration::from_secs(1),
            &[observation, Observation::typical_h200(1, 1)],
        )
        .expect("decide");
    assert_eq!(answer.len(), 2);

    // A newly built plugin is on the newest line.
    let current = host
        .load(&built("policy_static"), "static", SandboxLimits::default())
        .expect("loads");
    assert_eq!(current.contract_line(), "0.4.*");
}

#[test]
fn state_hands_over_from_a_0_1_build_to_a_0_4_build() {
    // An operator's hot swap from last release's hill-climb to this one's: the policy's
    // own state crosses contract lines unchanged.
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let mut old = Arc::new(load_0_1(&host, "hill-climb"))
        .instantiate(1)
        .expect("instantiates");
    let mut init_args = args(1);
    init_args.knobs = tokwatt_core::types::Knobs {
        power_cap: true,
        ..Default::default()
    };
    old.init(&init_args).expect("init");
    for tick in 0..5 {
        old.decide(
            Duration::from_secs(tick),
            &[Observation::typical_h200(0, tick)],
        )
        .expect("decide");
    }
    let state = old.snapshot().expect("snapshot");
    assert!(!state.bytes.is_empty(), "hill-climb keeps state");

    let mut new = instance(&host, "policy_hill_climb", SandboxLimits::default());
    new.init(&init_args).expect("init");
    new.restore(&state)
        .expect("the 0.4 build takes over the 0.1 build's state");
    assert_eq!(new.snapshot().expect("snapshot"), state);
}

#[test]
fn a_0_2_plugin_sees_the_demand_and_the_queue_wait_bound() {
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let mut policy = instance(&host, "fixture_echo_demand", SandboxLimits::default());
    let mut init_args = args(2);
    init_args.objective.queue_wait_p99_limit_ms = Some(750.0);
    let first = policy.init(&init_args).expect("init");
    assert_eq!(first[0].power_cap_w, Some(750.0), "the bound arrives");

    let mut serving = Observation::typical_h200(0, 1);
    serving.demand = Some(tokwatt_core::types::DemandWindow {
        requests_arrived: 41,
        requests_completed: 30,
        requests_turned_away: 3,
        tokens_demanded: 9000,
        queue_wait_p99_ms: Some(612.5),
    });
    let closed_loop = Observation::typical_h200(1, 1);
    let answer = policy
        .decide(Duration::from_secs(1), &[serving, closed_loop])
        .expect("decide");
    assert_eq!(answer[0].power_cap_w, Some(612.5), "queue wait: {answer:?}");
    assert_eq!(answer[0].sm_clock_max_mhz, Some(41), "arrived: {answer:?}");
    assert_eq!(answer[0].batch_size, Some(3), "turned away: {answer:?}");
    assert_eq!(
        answer[1],
        Settings::default(),
        "no demand known: {answer:?}"
    );
}

#[test]
fn a_0_3_plugin_sees_the_requests_and_the_ttft_bound() {
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let mut policy = instance(&host, "fixture_echo_demand", SandboxLimits::default());
    let mut init_args = args(2);
    init_args.objective.ttft_p99_limit_ms = Some(900.0);
    let first = policy.init(&init_args).expect("init");
    assert_eq!(first[0].sm_clock_max_mhz, Some(900), "the bound arrives");

    let mut serving = Observation::typical_h200(0, 1);
    serving.demand = Some(tokwatt_core::types::DemandWindow::default());
    serving.requests = Some(tokwatt_core::types::RequestsWindow {
        prefill_tokens: 40_960,
        first_tokens: 17,
        ttft_p99_ms: Some(231.5),
        prefill_time_share: Some(0.4),
        ..Default::default()
    });
    let decode_only = Observation::typical_h200(1, 1);
    let answer = policy
        .decide(Duration::from_secs(1), &[serving, decode_only])
        .expect("decide");
    assert_eq!(answer[0].power_cap_w, Some(231.5), "TTFT: {answer:?}");
    assert_eq!(
        answer[0].sm_clock_max_mhz,
        Some(17),
        "first tokens: {answer:?}"
    );
    assert_eq!(
        answer[0].batch_size,
        Some(40_960),
        "prompt tokens: {answer:?}"
    );
    assert_eq!(answer[1], Settings::default(), "none known: {answer:?}");
}

/// A plugin built against contract 0.2 before 0.3 existed (`tests/fixtures/contract-0.2`,
/// built by the 0.2 SDK from the shipped policy of that name), loaded.
fn load_0_2(host: &PluginHost, name: &str) -> LoadedPlugin {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../tests/fixtures/contract-0.2")
        .join(format!("{name}.wasm"));
    host.load(&path, name, SandboxLimits::default())
        .expect("a 0.2 plugin loads")
}

#[test]
fn a_plugin_built_against_0_2_keeps_loading_and_running() {
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let loaded = load_0_2(&host, "static");
    assert_eq!(loaded.contract_line(), "0.2.*");
    let mut policy = Arc::new(loaded).instantiate(1).expect("instantiates");
    let mut init_args = args(2);
    init_args.params = vec![("power_cap_w".to_owned(), "450".to_owned())];
    // The 0.3 fields the 0.2 plugin cannot see: set, so converting them away is exercised.
    init_args.objective.ttft_p99_limit_ms = Some(800.0);
    let first = policy.init(&init_args).expect("init");
    assert!(
        first.iter().all(|s| s.power_cap_w == Some(450.0)),
        "{first:?}"
    );
    let mut observation = Observation::typical_h200(0, 1);
    observation.requests = Some(tokwatt_core::types::RequestsWindow {
        first_tokens: 3,
        ttft_p99_ms: Some(120.0),
        ..Default::default()
    });
    let answer = policy
        .decide(
            Duration::from_secs(1),
            &[observation, Observation::typical_h200(1, 1)],
        )
        .expect("decide");
    assert_eq!(answer.len(), 2);
}

#[test]
fn state_hands_over_from_a_0_2_build_to_a_0_4_build() {
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let mut old = Arc::new(load_0_2(&host, "hill-climb"))
        .instantiate(1)
        .expect("instantiates");
    let mut init_args = args(1);
    init_args.knobs = tokwatt_core::types::Knobs {
        power_cap: true,
        ..Default::default()
    };
    old.init(&init_args).expect("init");
    for tick in 0..5 {
        old.decide(
            Duration::from_secs(tick),
            &[Observation::typical_h200(0, tick)],
        )
        .expect("decide");
    }
    let state = old.snapshot().expect("snapshot");
    assert!(!state.bytes.is_empty(), "hill-climb keeps state");
    let mut new = instance(&host, "policy_hill_climb", SandboxLimits::default());
    new.init(&init_args).expect("init");
    new.restore(&state)
        .expect("the 0.4 build takes over the 0.2 build's state");
    assert_eq!(new.snapshot().expect("snapshot"), state);
}

/// A GPU serving prompts, with the token budget granted: what 0.4 added, set, so a test
/// sees it arrive on the 0.4 line and converted away on the earlier ones.
fn serving_args(gpus: u32) -> InitArgs {
    let mut init_args = args(gpus);
    init_args.knobs.token_budget = true;
    for device in &mut init_args.devices {
        device.token_budget_min = 256;
        device.token_budget_max = 8192;
    }
    init_args
}

fn serving_observation(gpu: u32, tick: u64, token_budget: u32) -> Observation {
    let mut observation = Observation::typical_h200(gpu, tick);
    observation.in_force.token_budget = token_budget;
    observation.requests = Some(tokwatt_core::types::RequestsWindow {
        prefill_tokens: 4096,
        first_tokens: 2,
        ttft_p99_ms: Some(180.0),
        ..Default::default()
    });
    observation
}

#[test]
fn a_0_4_plugin_is_told_of_the_token_budget_and_turns_it() {
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let mut policy = instance(&host, "fixture_echo_demand", SandboxLimits::default());
    // The flag and the range arrive: the fixture answers the smallest budget.
    let first = policy.init(&serving_args(2)).expect("init");
    assert!(
        first.iter().all(|s| s.token_budget == Some(256)),
        "{first:?}"
    );
    // Not granted: the flag is not set, and the fixture leaves the budget alone.
    let first = policy.init(&args(2)).expect("init");
    assert!(first.iter().all(|s| s.token_budget.is_none()), "{first:?}");
    // The budget in force arrives: the fixture answers half of it.
    let answer = policy
        .decide(
            Duration::from_secs(1),
            &[
                serving_observation(0, 1, 4096),
                Observation::typical_h200(1, 1),
            ],
        )
        .expect("decide");
    assert_eq!(answer[0].token_budget, Some(2048), "{answer:?}");
    assert_eq!(
        answer[1].token_budget, None,
        "no budget in force: {answer:?}"
    );
}

/// A plugin built against contract 0.3 before 0.4 existed (`tests/fixtures/contract-0.3`,
/// built by the 0.3 SDK from the shipped policy of that name), loaded.
fn load_0_3(host: &PluginHost, name: &str) -> LoadedPlugin {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../tests/fixtures/contract-0.3")
        .join(format!("{name}.wasm"));
    host.load(&path, name, SandboxLimits::default())
        .expect("a 0.3 plugin loads")
}

#[test]
fn a_plugin_built_against_0_3_keeps_loading_and_running_and_never_moves_the_token_budget() {
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let loaded = load_0_3(&host, "static");
    assert_eq!(loaded.contract_line(), "0.3.*");
    let mut policy = Arc::new(loaded).instantiate(1).expect("instantiates");
    // Granted the token budget and told its range: the 0.3 plugin cannot see either,
    // and its settings never name a budget.
    let mut init_args = serving_args(2);
    init_args.params = vec![
        ("power_cap_w".to_owned(), "450".to_owned()),
        ("batch_size".to_owned(), "128".to_owned()),
    ];
    let first = policy.init(&init_args).expect("init");
    assert!(
        first
            .iter()
            .all(|s| s.power_cap_w == Some(450.0) && s.token_budget.is_none()),
        "{first:?}"
    );
    for tick in 1..4 {
        let answer = policy
            .decide(
                Duration::from_secs(tick),
                &[
                    serving_observation(0, tick, 2048),
                    serving_observation(1, tick, 8192),
                ],
            )
            .expect("decide");
        assert_eq!(answer.len(), 2);
        assert!(
            answer.iter().all(|s| s.token_budget.is_none()),
            "{answer:?}"
        );
    }
}

#[test]
fn state_hands_over_from_a_0_3_build_to_a_0_4_build() {
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let mut old = Arc::new(load_0_3(&host, "hill-climb"))
        .instantiate(1)
        .expect("instantiates");
    let mut init_args = args(1);
    init_args.knobs = tokwatt_core::types::Knobs {
        power_cap: true,
        ..Default::default()
    };
    old.init(&init_args).expect("init");
    for tick in 0..5 {
        old.decide(
            Duration::from_secs(tick),
            &[Observation::typical_h200(0, tick)],
        )
        .expect("decide");
    }
    let state = old.snapshot().expect("snapshot");
    assert!(!state.bytes.is_empty(), "hill-climb keeps state");
    let mut new = instance(&host, "policy_hill_climb", SandboxLimits::default());
    new.init(&init_args).expect("init");
    new.restore(&state)
        .expect("the 0.4 build takes over the 0.3 build's state");
    assert_eq!(new.snapshot().expect("snapshot"), state);
}
