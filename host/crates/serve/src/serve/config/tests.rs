use super::*;

fn parse(text: &str) -> Result<ServeConfig, ConfigError> {
    ServeConfig::parse(Path::new("/etc/tokwatt/serve.toml"), text)
}

fn error(text: &str) -> String {
    parse(text).expect_err("the config is refused").to_string()
}

const SIM: &str = r#"
[policy]
spec = "policies/slo-batch.toml"

[node]
backend = "sim"
sim_gpus = 8
tick = "100ms"
"#;

#[test]
fn a_simulated_node_needs_only_a_policy_and_a_backend() {
    let config = parse(SIM).expect("valid");
    assert_eq!(
        config.backend,
        NodeBackend::Sim {
            profile: "h200".into(),
            gpus: 8,
            scenario: None,
            realtime: true,
            driver: None,
        }
    );
    assert_eq!(config.workload, ServeWorkload::Sim);
    assert_eq!(config.tick, Some(Duration::from_millis(100)));
    // Relative to the config's folder.
    assert_eq!(
        config.policy_spec,
        PathBuf::from("/etc/tokwatt/policies/slo-batch.toml")
    );
    assert_eq!(
        config.probation_ticks,
        tokwatt_agent::swap::DEFAULT_PROBATION_TICKS
    );
    assert!(config.http.is_none() && config.metrics_listen.is_none());
}

#[test]
fn real_gpus_with_one_engine_each() {
    let config = parse(
        r#"
[policy]
spec = "/p/slo.toml"
probation_ticks = 5

[node]
gpus = [0, 1]
dry_run = true

[workload]
source = "external"
[[workload.engine]]
gpu = 0
url = "http://127.0.0.1:8000/metrics"
[[workload.engine]]
gpu = 1
url = "http://[::1]:8001/metrics"
engine = "sglang"

[api]
http = "127.0.0.1:9400"
token_file = "token"

[metrics]
listen = "0.0.0.0:9401"

[output]
max_file_mib = 8
keep_files = 2
"#,
    )
    .expect("valid");
    assert_eq!(
        config.backend,
        NodeBackend::Nvml {
            gpus: Some(vec![0, 1])
        }
    );
    let ServeWorkload::External(engines) = &config.workload else {
        panic!("external: {:?}", config.workload)
    };
    assert_eq!(engines[1].engine, Engine::Sglang);
    assert_eq!(engines[1].token_counter, "sglang:generation_tokens_total");
    assert_eq!(config.token_file, Some(PathBuf::from("/etc/tokwatt/token")));
    assert_eq!(config.max_file_bytes, 8 * 1024 * 1024);
    assert_eq!((config.keep_files, config.probation_ticks), (2, 5));
    assert!(config.dry_run);
}

#[test]
fn an_unknown_key_is_refused_with_its_line() {
    let text = format!("{SIM}sim_gpu = 2\n");
    let message = error(&text);
    assert!(
        message.contains("sim_gpu") && message.contains("line 9"),
        "{message}"
    );
}

#[test]
fn bad_values_name_the_key_its_line_and_the_fix() {
    let cases: &[(&str, &str, &[&str])] = &[
        (
            "backend = \"sim\"",
            "backend = \"gpu\"",
            &["node.backend", ":6", "\"nvml\""],
        ),
        (
            "tick = \"100ms\"",
            "tick = \"fast\"",
            &["node.tick", ":8", "\"500ms\""],
        ),
        (
            "tick = \"100ms\"",
            "tick = \"1ms\"",
            &["node.tick", "between"],
        ),
        (
            "sim_gpus = 8",
            "sim_gpus = 0",
            &["node.sim_gpus", ":7", "between 1 and 64"],
        ),
    ];
    for (from, to, wanted) in cases {
        let message = error(&SIM.replace(from, to));
        for piece in *wanted {
            assert!(message.contains(piece), "{to}: `{piece}` not in {message}");
        }
    }
}

/// A bare number has no unit to read it in: it is refused by key and line with the
/// accepted range, the units and the line that works, not with the parser's "invalid
/// type" (issue 43: `summary_every = 300`).
#[test]
fn a_duration_written_as_a_number_is_refused_with_the_fix() {
    let message = error(&format!("{SIM}[output]\nsummary_every = 300\n"));
    for piece in [
        "output.summary_every",
        ":10",
        "= 300 is a number without a unit",
        "summary_every = \"300s\"",
        "units: ms, s, m, h",
        "at least 1s",
    ] {
        assert!(message.contains(piece), "`{piece}` not in {message}");
    }
    assert!(!message.contains("invalid type"), "{message}");
    // Every duration key reads the same way, with its own range.
    let message = error(&SIM.replace("tick = \"100ms\"", "tick = 0.5"));
    assert!(
        message.contains("node.tick")
            && message.contains("tick = \"0.5s\"")
            && message.contains("between 10ms and 1h"),
        "{message}"
    );
    let message = error(&SIM.replace(
        "spec = \"policies/slo-batch.toml\"",
        "spec = \"policies/slo-batch.toml\"\nwatch_period = true",
    ));
    assert!(
        message.contains("policy.watch_period") && message.contains("is a boolean"),
        "{message}"
    );
    let message = error(&format!("{SIM}[output]\nsummary_every = \"500ms\"\n"));
    assert!(
        message.contains("must be at least 1s") && message.contains("summary_every = \"5m\""),
        "{message}"
    );
    // Written with its unit, it is read.
    let config = parse(&format!("{SIM}[output]\nsummary_every = \"300s\"\n")).expect("valid");
    assert_eq!(config.summary_every, Duration::from_secs(300));
}

#[test]
fn the_http_api_is_loopback_only_and_needs_a_token() {
    let message = error(&format!(
        "{SIM}[api]\nhttp = \"0.0.0.0:9400\"\ntoken_file = \"t\"\n"
    ));
    assert!(
        message.contains("loopback") && message.contains("api.http"),
        "{message}"
    );
    let message = error(&format!("{SIM}[api]\nhttp = \"127.0.0.1:9400\"\n"));
    assert!(
        message.contains("api.token_file") && message.contains("600"),
        "{message}"
    );
    let message = error(&format!(
        "{SIM}[api]\nhttp = \"localhost\"\ntoken_file = \"t\"\n"
    ));
    assert!(message.contains("127.0.0.1:9400"), "{message}");
}

#[test]
fn engines_must_cover_exactly_the_managed_gpus() {
    let base = r#"
[policy]
spec = "/p.toml"
[node]
gpus = [0, 1]
[workload]
source = "external"
[[workload.engine]]
gpu = 0
url = "http://127.0.0.1:8000/metrics"
"#;
    let message = error(base);
    assert!(
        message.contains("GPU 1") && message.contains("workload.engine"),
        "{message}"
    );
    let message = error(&format!(
        "{base}[[workload.engine]]\ngpu = 3\nurl = \"http://h:1/metrics\"\n"
    ));
    assert!(message.contains("not among node.gpus"), "{message}");
    let message = error(&format!(
        "{base}[[workload.engine]]\ngpu = 0\nurl = \"http://h:1/metrics\"\n"
    ));
    assert!(message.contains("two engines"), "{message}");
    let message = error(&base.replace("http://127.0.0.1:8000/metrics", "127.0.0.1:8000"));
    assert!(message.contains("http://HOST:PORT/metrics"), "{message}");
    let message = error(&format!(
        "{}[[workload.engine]]\ngpu = 1\nurl = \"http://h:1/metrics\"\nengine = \"ollama\"\n",
        base
    ));
    assert!(
        message.contains("workload.engine.engine") && message.contains("vllm"),
        "{message}"
    );
}

#[test]
fn a_simulated_driver_is_relative_to_the_config_and_for_the_simulator_only() {
    let config = parse(&format!("{SIM}sim_driver = \"node-a/driver.json\"\n")).expect("valid");
    let NodeBackend::Sim { driver, .. } = &config.backend else {
        panic!("{:?}", config.backend);
    };
    assert_eq!(
        driver.as_deref(),
        Some(Path::new("/etc/tokwatt/node-a/driver.json"))
    );
    let message = error(&format!("{SIM}sim_driver = \"\"\n"));
    assert!(
        message.contains("node.sim_driver") && message.contains("is empty"),
        "{message}"
    );
    let message = error(
        "[policy]\nspec = \"/p\"\n[node]\nsim_driver = \"d.json\"\n[workload]\nsource = \"cuda\"\n",
    );
    assert!(
        message.contains("node.sim_driver") && message.contains("backend = \"sim\" only"),
        "{message}"
    );
}

#[test]
fn keys_of_the_other_backend_are_refused() {
    let message =
        error("[policy]\nspec = \"/p\"\n[node]\nsim_gpus = 2\n[workload]\nsource = \"cuda\"\n");
    assert!(
        message.contains("node.sim_gpus") && message.contains("\"sim\""),
        "{message}"
    );
    let message = error(&format!("{SIM}dry_run = true\n"));
    assert!(message.contains("node.dry_run"), "{message}");
    let message = error("[policy]\nspec = \"/p\"\n[node]\ngpus = \"all\"\n");
    assert!(
        message.contains("workload.source") && message.contains("external"),
        "{message}"
    );
    let message =
        error("[policy]\nspec = \"/p\"\n[node]\ngpus = \"some\"\n[workload]\nsource = \"cuda\"\n");
    assert!(
        message.contains("node.gpus") && message.contains("[0, 1]"),
        "{message}"
    );
}

#[test]
fn a_missing_policy_table_is_a_parse_error_naming_it() {
    let message = error("[node]\nbackend = \"sim\"\n");
    assert!(message.contains("policy"), "{message}");
}

#[test]
fn the_nodes_objective_guardrails_and_guard_are_read_and_checked() {
    let config = parse(SIM).expect("valid");
    assert_eq!(
        config.rules.objective,
        tokwatt_core::types::Objective::default()
    );
    assert_eq!(
        config.rules.guardrails.max_power_cap_raise_w,
        Some(tokwatt_policy::rules::DEFAULT_MAX_POWER_CAP_RAISE_W),
        "a raise limit by default"
    );
    assert!(config.rules.guard.enabled, "the guard is on by default");

    let config = parse(&format!(
        "{SIM}\n[objective]\ntpot_p99_limit_ms = 40.0\n[guardrails]\npower_cap_max_w = 600.0\nmax_power_cap_raise_w = 100.0\n[guard]\nwindow_ticks = 30\nmax_violation_ticks = 6\n"
    ))
    .expect("valid");
    assert_eq!(config.rules.objective.tpot_p99_limit_ms, Some(40.0));
    assert_eq!(config.rules.guardrails.power_cap_max_w, Some(600.0));
    assert_eq!(config.rules.guardrails.max_power_cap_raise_w, Some(100.0));
    assert_eq!(
        (
            config.rules.guard.window_ticks,
            config.rules.guard.max_violation_ticks
        ),
        (30, 6)
    );

    for (extra, key) in [
        (
            "[objective]\ntpot_p99_limit_ms = -1.0\n",
            "objective.tpot_p99_limit_ms",
        ),
        ("[objective]\nlatency = 3.0\n", "latency"),
        (
            "[guardrails]\npower_cap_min_w = 600.0\npower_cap_max_w = 300.0\n",
            "guardrails.power_cap_min_w",
        ),
        (
            "[guard]\nwindow_ticks = 10\nmax_violation_ticks = 11\n",
            "max_violation_ticks",
        ),
    ] {
        let message = error(&format!("{SIM}\n{extra}"));
        assert!(message.contains(key), "{extra}: {message}");
    }
}

#[test]
fn a_fleet_section_takes_its_defaults_and_names_each_bad_value() {
    let fleet = |extra: &str| {
        format!(
            "{SIM}\n[fleet]\netcd = [\"http://10.0.0.1:2379\"]\ndomain = \"rack-12\"\nnode = \"gpu-07\"\nreserve_w = 2400\n{extra}"
        )
    };
    let config = parse(&fleet("")).expect("valid");
    let f = config.fleet.expect("a fleet");
    assert_eq!(f.endpoints, ["http://10.0.0.1:2379"]);
    assert_eq!(f.link.node, "gpu-07");
    assert_eq!(f.link.reserve_w, 2400.0);
    assert_eq!(f.link.ttl, Duration::from_secs(10));
    assert_eq!(f.link.margin, Duration::from_secs(3));
    assert_eq!(f.report_every, Duration::from_secs(1));
    assert!(parse(SIM).expect("valid").fleet.is_none());

    let text = fleet("").replace("http://10.0.0.1:2379", "10.0.0.1:2379");
    let message = error(&text);
    assert!(
        message.contains("fleet.etcd") && message.contains("https://HOST:PORT"),
        "{message}"
    );
    let message = error(&fleet("").replace("rack-12", "rack/12"));
    assert!(message.contains("fleet.domain"), "{message}");
    let message = error(&fleet("").replace("reserve_w = 2400", "reserve_w = 0"));
    assert!(message.contains("fleet.reserve_w"), "{message}");
    let message = error(&fleet("margin = \"10s\"\n"));
    assert!(message.contains("margin"), "{message}");
    let message = error(&fleet("report_every = \"2s\"\n"));
    assert!(message.contains("fleet.report_every"), "{message}");
    let message = error(&fleet("lease = \"10s\"\n"));
    assert!(
        message.contains("lease"),
        "unknown keys are refused: {message}"
    );
}

/// A fleet node with `fence` as its `[fleet.fence]` table's lines.
fn fenced(fence: &str) -> String {
    format!(
        "{SIM}\n[fleet]\netcd = [\"http://10.0.0.1:2379\"]\ndomain = \"rack-12\"\nnode = \"gpu-07\"\nreserve_w = 2400\n\n[fleet.fence]\n{fence}"
    )
}

#[test]
fn a_fence_takes_its_kind_its_files_and_its_defaults() {
    let config = parse(&fenced("kind = \"systemd-watchdog\"\n")).expect("valid");
    let fence = config.fleet.expect("a fleet").fence.expect("a fence");
    assert_eq!(fence.watch, FenceWatch::SystemdWatchdog);
    assert_eq!(fence.restore, Duration::from_secs(10));
    assert!(!fence.covers_reboot);

    let config = parse(&fenced(
        "kind = \"heartbeat\"\nheartbeat = \"fence/heartbeat\"\nstatus = \"/run/tokwatt-fence/status.json\"\nrestore_s = 2.5\ncovers_reboot = true\n",
    ))
    .expect("valid");
    let fence = config.fleet.expect("a fleet").fence.expect("a fence");
    assert_eq!(
        fence.watch,
        FenceWatch::Heartbeat {
            // Relative to the config's folder, as every path in it.
            heartbeat: "/etc/tokwatt/fence/heartbeat".into(),
            status: "/run/tokwatt-fence/status.json".into(),
        }
    );
    assert_eq!(fence.restore, Duration::from_millis(2500));
    assert!(fence.covers_reboot);
    // A whole number of seconds is a number too.
    let config = parse(&fenced("kind = \"systemd-watchdog\"\nrestore_s = 4\n")).expect("valid");
    assert_eq!(
        config.fleet.and_then(|f| f.fence).map(|f| f.restore),
        Some(Duration::from_secs(4))
    );
}

#[test]
fn a_bad_fence_is_refused_naming_the_key_and_the_fix() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "kind = \"watchdog\"\n",
            "fleet.fence.kind",
            "\"systemd-watchdog\"",
        ),
        (
            "kind = \"heartbeat\"\nstatus = \"/run/s.json\"\n",
            "fleet.fence.heartbeat",
            "is missing",
        ),
        (
            "kind = \"heartbeat\"\nheartbeat = \"/run/h\"\n",
            "fleet.fence.status",
            "is missing",
        ),
        (
            "kind = \"heartbeat\"\nheartbeat = \"/run/h\"\nstatus = \"/run/h\"\n",
            "fleet.fence.status",
            "name two files",
        ),
        (
            "kind = \"systemd-watchdog\"\nheartbeat = \"/run/h\"\n",
            "fleet.fence.heartbeat",
            "applies to kind = \"heartbeat\"",
        ),
        (
            "kind = \"systemd-watchdog\"\nrestore_s = 0\n",
            "fleet.fence.restore_s",
            "above 0",
        ),
        (
            "kind = \"systemd-watchdog\"\nrestore_s = 3600\n",
            "fleet.fence.restore_s",
            "at most 600",
        ),
        (
            "kind = \"systemd-watchdog\"\nstall = \"5s\"\n",
            "stall",
            "unknown field",
        ),
        ("heartbeat = \"/run/h\"\n", "kind", "missing field"),
    ];
    for (fence, key, says) in cases {
        let message = error(&fenced(fence));
        assert!(
            message.contains(key) && message.contains(says),
            "{fence:?}: expected {key} and {says:?} in: {message}"
        );
    }
    // A bad value names its line ([fleet.fence] is on line 16, its kind on 17).
    let message = error(&fenced("kind = \"watchdog\"\n"));
    assert!(message.contains("serve.toml:17:"), "{message}");
}

/// `[fleet]` with `etcd` and the TLS keys of `tls` (`key = 'value'` lines).
fn fleet_over(etcd: &str, tls: &str) -> String {
    format!(
        "{SIM}\n[fleet]\netcd = [{etcd}]\ndomain = \"rack-12\"\nnode = \"gpu-07\"\nreserve_w = 2400\n{tls}"
    )
}

#[test]
fn fleet_tls_keys_go_with_https_and_name_a_bad_file() {
    let https = "\"https://10.0.0.1:2379\", \"https://10.0.0.2:2379\"";
    // Relative to the config's folder, and read at load: a missing file is named.
    let message = error(&fleet_over(https, "ca_file = \"etcd/ca.pem\"\n"));
    assert!(
        message.contains("fleet.ca_file")
            && message.contains("/etc/tokwatt/etcd/ca.pem")
            && message.contains("name an existing PEM file"),
        "{message}"
    );
    let message = error(&fleet_over(
        "\"http://10.0.0.1:2379\", \"https://10.0.0.2:2379\"",
        "",
    ));
    assert!(
        message.contains("fleet.etcd") && message.contains("mix http:// and https://"),
        "{message}"
    );
    let message = error(&fleet_over(https, ""));
    assert!(
        message.contains("fleet.etcd") && message.contains("fleet.ca_file is not set"),
        "{message}"
    );
    let message = error(&fleet_over(
        "\"http://10.0.0.1:2379\"",
        "ca_file = \"/etc/tokwatt/etcd/ca.pem\"\n",
    ));
    assert!(
        message.contains("fleet.ca_file") && message.contains("are http://"),
        "{message}"
    );
    let message = error(&fleet_over(
        "\"http://10.0.0.1:2379\"",
        "cert_file = \"/etc/tokwatt/etcd/client.pem\"\n",
    ));
    assert!(
        message.contains("fleet.cert_file") && message.contains("without fleet.ca_file"),
        "{message}"
    );

    let Some(pki) = tokwatt_test_support::TestPki::generate() else {
        return;
    };
    let path = |p: &Path| p.display().to_string();
    let client = format!(
        "cert_file = '{}'\nkey_file = '{}'\n",
        path(&pki.client_cert),
        path(&pki.client_key)
    );
    let ca = format!("ca_file = '{}'\n", path(&pki.ca));
    let config = parse(&fleet_over(https, &format!("{ca}{client}"))).expect("valid");
    let tls = config.fleet.expect("a fleet").tls.expect("TLS");
    assert_eq!(tls.ca_file, pki.ca);
    let client_files = tls.client.expect("a client certificate");
    assert_eq!(
        (client_files.cert_file, client_files.key_file),
        (pki.client_cert.clone(), pki.client_key.clone())
    );
    let config = parse(&fleet_over(https, &ca)).expect("a CA alone is valid");
    assert!(
        config
            .fleet
            .expect("a fleet")
            .tls
            .expect("TLS")
            .client
            .is_none()
    );

    let message = error(&fleet_over(
        https,
        &format!("{ca}cert_file = '{}'\n", path(&pki.client_cert)),
    ));
    assert!(
        message.contains("fleet.cert_file") && message.contains("without fleet.key_file"),
        "{message}"
    );
    // The key of another certificate: named by the key's key.
    let message = error(&fleet_over(
        https,
        &format!(
            "{ca}cert_file = '{}'\nkey_file = '{}'\n",
            path(&pki.client_cert),
            path(&pki.server_key)
        ),
    ));
    assert!(
        message.contains("fleet.key_file") && message.contains("does not fit"),
        "{message}"
    );
    // A key where the CA belongs.
    let message = error(&fleet_over(
        https,
        &format!("ca_file = '{}'\n{client}", path(&pki.client_key)),
    ));
    assert!(
        message.contains("fleet.ca_file") && message.contains("holds no certificate"),
        "{message}"
    );
}

#[test]
fn paths_in_a_config_named_by_a_relative_path_come_out_absolute() {
    // `tokwatt serve --config deploy/serve.toml`: the spec's path is what the agent
    // reports, and a client swaps back to it from its own working directory.
    let config = ServeConfig::parse(
        Path::new("deploy/serve.toml"),
        "[policy]\nspec = \"policies/default.toml\"\n[node]\nbackend = \"sim\"\n",
    )
    .expect("valid");
    assert!(config.policy_spec.is_absolute(), "{:?}", config.policy_spec);
    assert!(
        config.policy_spec.ends_with("deploy/policies/default.toml"),
        "{:?}",
        config.policy_spec
    );
}
