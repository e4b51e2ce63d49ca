//! `tokwatt serve` in a power domain, on a real etcd: the node holds its reserve until a
//! coordinator grants it more, holds the grant, and drops back to its reserve on its own
//! when etcd goes away; the caps of its GPUs, summed, never pass what it may hold.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokwatt_fleet::etcd::EtcdFleet;
use tokwatt_fleet::{
    Coordinator, CoordinatorConfig, DomainBudget, FleetStore, MarginalAllocator, NodeBudget,
};
use tokwatt_serve::api::Control;
use tokwatt_serve::serve::{self, ServeConfig};
use tokwatt_test_support::{EtcdCluster, wait_for};

/// A static policy that asks every GPU for 700 W, and a four-GPU simulated node in the
/// domain `rack-s` as `n1` with a 1 kW reserve.
fn node_config(dir: &Path, endpoints: &[String]) -> ServeConfig {
    node_config_with(dir, endpoints, "")
}

/// [`node_config`], with `extra` lines in its `[fleet]` table.
fn node_config_with(dir: &Path, endpoints: &[String], extra: &str) -> ServeConfig {
    let spec = dir.join("greedy.toml");
    std::fs::write(
        &spec,
        "name = \"greedy\"\nplugin = \"policy_static.wasm\"\nknobs = [\"power-cap\"]\ntick_ms = 100\n[sandbox]\ndeadline_ms = 20\n[params]\npower_cap_w = \"700\"\n",
    )
    .expect("spec");
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("component-cache");
    let etcd: Vec<String> = endpoints.iter().map(|e| format!("\"{e}\"")).collect();
    let text = format!(
        "[policy]\nspec = \"{}\"\ncache_dir = \"{}\"\n[node]\nbackend = \"sim\"\nsim_gpus = 4\n[output]\ndir = \"{}\"\n\
         [fleet]\netcd = [{}]\ndomain = \"rack-s\"\nnode = \"n1\"\nreserve_w = 1000\nlease_ttl = \"4s\"\nmargin = \"2s\"\nreport_every = \"200ms\"\ntimeout = \"300ms\"\n{}",
        spec.display(),
        cache.display(),
        dir.join("out").display(),
        etcd.join(", "),
        extra
    );
    let path = dir.join("serve.toml");
    std::fs::write(&path, text).expect("config");
    ServeConfig::load(&path).expect("the test's config is valid")
}

/// Domain `rack-s`: 2.8 kW, one node `n1` with `reserve_w` and at most 2.8 kW. The node
/// runs no fence, so the budget holds its GPUs' board defaults (4 × 700 W).
fn rack_s(reserve_w: f64) -> DomainBudget {
    DomainBudget {
        domain: "rack-s".into(),
        budget_w: 2800.0,
        uncontrolled_w: 0.0,
        nodes: vec![NodeBudget {
            node: "n1".into(),
            reserve_w,
            max_w: 2800.0,
            priority: 0,
            fenced: false,
            default_w: None,
        }],
    }
}

#[test]
fn a_served_node_holds_its_reserve_then_its_grant_then_its_reserve_when_cut_off() {
    let Some(mut cluster) = EtcdCluster::start(1) else {
        return;
    };
    let store =
        Arc::new(EtcdFleet::connect(&cluster.endpoints(), Duration::from_secs(1)).expect("client"));
    store.put_budget(&rack_s(1000.0)).expect("budget");
    let dir = tempfile::tempdir().expect("tempdir");
    let config = node_config(dir.path(), &cluster.endpoints());
    let agent = serve::start(&config, Arc::new(AtomicBool::new(false)), None).expect("starts");
    let control = agent.control();
    let caps = || -> f64 {
        control
            .status()
            .gpus
            .iter()
            .map(|g| g.in_force.power_cap_w)
            .sum()
    };

    // Every tick's caps, sampled, against what the node may hold at that moment.
    let ceiling = Arc::new(Mutex::new(1000.0_f64));
    let over = Arc::new(Mutex::new(Vec::new()));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (control, ceiling, over, done) =
            (agent.control(), ceiling.clone(), over.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                let total: f64 = control
                    .status()
                    .gpus
                    .iter()
                    .map(|g| g.in_force.power_cap_w)
                    .sum();
                let allowed = *ceiling.lock().expect("lock");
                if total > allowed + 1e-6 {
                    over.lock().expect("lock").push((total, allowed));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };

    // No coordinator yet: the node holds its reserve from its first tick.
    wait_for("ticks", Duration::from_secs(20), || {
        control.status().ticks >= 5
    });
    assert!(caps() <= 1000.0 + 1e-6, "{} W before any grant", caps());
    // Its status names its domain and node (what `tokwatt fleet ab` reads).
    let place = control.status().fleet.expect("a node in a domain says so");
    assert_eq!(
        (place.domain.as_str(), place.node.as_str()),
        ("rack-s", "n1")
    );

    // A coordinator grants the domain's budget to its one node.
    *ceiling.lock().expect("lock") = 2800.0;
    let stop_coordinator = Arc::new(AtomicBool::new(false));
    let coordinator = {
        let (store, stop) = (store.clone(), stop_coordinator.clone());
        std::thread::spawn(move || {
            let mut coordinator = Coordinator::new(
                CoordinatorConfig {
                    domain: "rack-s".into(),
                    name: "c".into(),
                    ttl: Duration::from_secs(3),
                },
                Box::new(MarginalAllocator::default()),
            );
            while !stop.load(Ordering::Relaxed) {
                let _ = coordinator.round(store.as_ref());
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    wait_for("the grant in force", Duration::from_secs(30), || {
        caps() > 2700.0
    });
    let gauge = |name: &str| -> f64 {
        control
            .metrics()
            .lines()
            .find_map(|line| line.strip_prefix(&format!("{name} ")).map(str::to_owned))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(f64::NAN)
    };
    wait_for("the grant in /metrics", Duration::from_secs(10), || {
        gauge("tokwatt_fleet_granted") == 1.0
    });
    assert_eq!(gauge("tokwatt_fleet_allowance_watts"), 2800.0);
    assert_eq!(gauge("tokwatt_fleet_lease_live"), 1.0);
    assert_eq!(gauge("tokwatt_fleet_joins_total"), 1.0);
    // Its status shows the grant it holds, enforced, and its lease (`tokwatt status`).
    wait_for("the grant acknowledged", Duration::from_secs(10), || {
        control
            .status()
            .fleet
            .and_then(|f| f.grant)
            .is_some_and(|g| g.acknowledged)
    });
    let fleet = control.status().fleet.expect("a node in a domain");
    assert_eq!(
        fleet.holding,
        Some(tokwatt_serve::api::Holding::Grant),
        "{fleet:?}"
    );
    assert_eq!(fleet.allowance_w, Some(2800.0), "{fleet:?}");
    assert_eq!(fleet.reserve_w, Some(1000.0), "{fleet:?}");
    let lease = fleet.lease.as_ref().expect("a lease");
    // The lease's 4 s less the 2 s margin, counted from the last renewal.
    assert!(
        !lease.id.is_empty() && lease.holds_for_s > 0.0 && lease.holds_for_s <= 2.0,
        "{fleet:?}"
    );
    assert_eq!(fleet.apart_because, None, "{fleet:?}");

    // etcd goes away: the node cannot renew and drops to its reserve on its own, before
    // its lease could lapse (4 s, less a 2 s margin).
    stop_coordinator.store(true, Ordering::Relaxed);
    coordinator.join().expect("coordinator");
    let cut_off = Instant::now();
    cluster.kill(0);
    wait_for("the reserve", Duration::from_secs(10), || {
        caps() <= 1000.0 + 1e-6
    });
    let dropped_after = cut_off.elapsed();
    wait_for("the reserve in /metrics", Duration::from_secs(10), || {
        gauge("tokwatt_fleet_granted") == 0.0
    });
    assert_eq!(gauge("tokwatt_fleet_allowance_watts"), 1000.0);
    assert!(gauge("tokwatt_fleet_store_errors_total") >= 1.0);
    let fleet = control.status().fleet.expect("a node in a domain");
    assert_eq!(
        fleet.holding,
        Some(tokwatt_serve::api::Holding::Reserve),
        "{fleet:?}"
    );
    assert_eq!(
        (fleet.allowance_w, fleet.grant),
        (Some(1000.0), None),
        "{fleet:?}"
    );
    assert!(fleet.apart_because.is_some(), "says why: {fleet:?}");
    *ceiling.lock().expect("lock") = 1000.0;
    std::thread::sleep(Duration::from_millis(500));
    done.store(true, Ordering::Relaxed);
    sampler.join().expect("sampler");
    agent.stop();
    agent.join().expect("the agent stops");
    let over = over.lock().expect("lock");
    assert!(over.is_empty(), "caps over what the node held: {over:?}");
    assert!(
        dropped_after < Duration::from_secs(4),
        "dropped {dropped_after:?} after etcd went away: the lease could have lapsed first"
    );
}

#[test]
fn the_fleet_commands_set_a_budget_show_the_ledger_and_coordinate_until_stopped() {
    use crate::support::tokwatt;
    let Some(cluster) = EtcdCluster::start(1) else {
        return;
    };
    let endpoint = cluster.endpoints()[0].clone();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("rack.toml");

    // A budget whose reserves pass it is refused, naming the rule; nothing is written.
    // (Both nodes are declared fenced: unfenced, their 5.6 kW of board defaults would
    // not fit even the 4 kW budget written next.)
    std::fs::write(
        &file,
        "domain = \"rack-c\"\nbudget_w = 1500\n[[nodes]]\nnode = \"a\"\nreserve_w = 1000\nmax_w = 2800\nfenced = true\n[[nodes]]\nnode = \"b\"\nreserve_w = 1000\nmax_w = 2800\nfenced = true\n",
    )
    .expect("file");
    let out = tokwatt()
        .args(["fleet", "budget", "--etcd", &endpoint, "--file"])
        .arg(&file)
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("every node cut off at once"), "{stderr}");
    let out = tokwatt()
        .args(["fleet", "show", "--etcd", &endpoint, "--domain", "rack-c"])
        .output()
        .expect("runs");
    assert!(String::from_utf8_lossy(&out.stderr).contains("tokwatt fleet budget"));

    std::fs::write(
        &file,
        std::fs::read_to_string(&file)
            .expect("file")
            .replace("budget_w = 1500", "budget_w = 4000"),
    )
    .expect("file");
    let out = tokwatt()
        .args(["fleet", "budget", "--etcd", &endpoint, "--file"])
        .arg(&file)
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A node joins (declaring no fence: named); a coordinator replica grants it watts;
    // stopped, it resigns at once. Both nodes' boot units wrote their records (as
    // `tokwatt fence --once --etcd …` does), so a reboot of either lands at its reserve.
    let store = EtcdFleet::connect(std::slice::from_ref(&endpoint), Duration::from_secs(1))
        .expect("client");
    for name in ["a", "b"] {
        store
            .prove(
                "rack-c",
                name,
                &tokwatt_fleet::ReleaseProof::of_caps(
                    tokwatt_fleet::ProofSource::Boot,
                    format!("the boot unit of {name}"),
                    vec![500.0, 500.0],
                    0,
                    0,
                ),
                Duration::from_secs(600),
            )
            .expect("a boot record");
    }
    let node = store
        .join(
            "rack-c",
            "a",
            Duration::from_secs(30),
            &tokwatt_fleet::NodeReport {
                acked_generation: 0,
                caps_in_force_w: 1000.0,
                draw_w: 900.0,
                tokens_per_s: 5000.0,
                wants_more: true,
                requested_w: 0.0,
                fence: None,
                default_w: 0.0,
                boot: 0,
            },
        )
        .expect("joins");
    let metrics_port = tokwatt_test_support::free_port();
    let mut coordinator = tokwatt()
        .args([
            "fleet",
            "coordinate",
            "--etcd",
            &endpoint,
            "--domain",
            "rack-c",
            "--name",
            "c1",
            "--ttl",
            "5s",
            "--period",
            "200ms",
            "--metrics",
            &format!("127.0.0.1:{metrics_port}"),
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starts");
    wait_for("a grant", Duration::from_secs(20), || {
        store.grant(&node).ok().flatten().is_some()
    });
    // Its metrics: it leads, and the ledger it wrote (a's grant, b at its reserve).
    let scrape = || -> String {
        let mut stream =
            std::net::TcpStream::connect(("127.0.0.1", metrics_port)).expect("metrics listen");
        use std::io::{Read, Write};
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .expect("request");
        let mut text = String::new();
        stream.read_to_string(&mut text).expect("answer");
        text
    };
    let value = |text: &str, series: &str| -> Option<f64> {
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    };
    wait_for("the ledger in the metrics", Duration::from_secs(10), || {
        value(&scrape(), "tokwatt_fleet_charged_watts{domain=\"rack-c\"}").is_some()
    });
    let text = scrape();
    assert_eq!(
        value(
            &text,
            "tokwatt_fleet_coordinator_leading{domain=\"rack-c\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(&text, "tokwatt_fleet_available_watts{domain=\"rack-c\"}"),
        Some(4000.0),
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            "tokwatt_fleet_node_lease_live{domain=\"rack-c\",node=\"b\"}"
        ),
        Some(0.0),
        "{text}"
    );
    let charged =
        value(&text, "tokwatt_fleet_charged_watts{domain=\"rack-c\"}").unwrap_or(f64::NAN);
    assert!(charged <= 4000.0 + 1e-6 && charged > 2000.0, "{text}");
    assert_eq!(
        value(
            &text,
            "tokwatt_fleet_node_fence_missing{domain=\"rack-c\",node=\"a\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            "tokwatt_fleet_node_stranded_watts{domain=\"rack-c\",node=\"b\",reason=\"never-heard\"}"
        ),
        Some(0.0),
        "{text}"
    );
    if let Some(promtool) = crate::metrics::promtool() {
        let body = text.split_once("\r\n\r\n").map_or("", |(_, body)| body);
        crate::metrics::promtool_check(promtool, body).unwrap_or_else(|said| panic!("{said}"));
    }
    let grant = store.grant(&node).expect("read").expect("a grant");
    // Node b holds its reserve: a is granted the rest of the budget, and no more.
    assert!(
        grant.watts <= 3000.0 + 1e-6 && grant.watts > 1000.0,
        "{grant:?}"
    );
    let show = tokwatt()
        .args(["fleet", "show", "--etcd", &endpoint, "--domain", "rack-c"])
        .output()
        .expect("runs");
    let text = String::from_utf8_lossy(&show.stdout);
    assert!(
        show.status.success() && text.contains("never heard"),
        "{text}"
    );
    assert!(text.contains("of 4000 W available"), "{text}");
    assert!(
        text.contains("node a is fenced in the budget but declares no fence, or no boot unit"),
        "{text}"
    );
    // The same ledger for scripts: `--json`, the keys of the book's fleet page.
    let show = tokwatt()
        .args([
            "fleet", "show", "--etcd", &endpoint, "--domain", "rack-c", "--json",
        ])
        .output()
        .expect("runs");
    assert!(
        show.status.success(),
        "{}",
        String::from_utf8_lossy(&show.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&show.stdout).expect("only JSON");
    assert_eq!(json["format_version"], 2);
    assert_eq!(json["domain"], "rack-c");
    assert_eq!(json["available_w"], 4000.0);
    let nodes = json["nodes"].as_array().expect("nodes");
    let a = nodes.iter().find(|n| n["node"] == "a").expect("node a");
    let b = nodes.iter().find(|n| n["node"] == "b").expect("node b");
    assert_eq!(
        (&a["live"], &a["why"]),
        (&true.into(), &"live".into()),
        "{a}"
    );
    assert_eq!(a["lease"], format!("{:x}", node.lease), "{a}");
    assert!(
        a["grant"]["watts"]
            .as_f64()
            .is_some_and(|w| w > 1000.0 && w <= 3000.0 + 1e-6),
        "{a}"
    );
    assert_eq!(a["fence_missing"], true, "{a}");
    assert_eq!(a["report"]["caps_in_force_w"], 1000.0, "{a}");
    assert_eq!(
        (&b["live"], &b["why"]),
        (&false.into(), &"never-heard".into()),
        "{b}"
    );

    // SIGTERM: the replica resigns, and another can lead at once, well inside the TTL.
    let status = std::process::Command::new("kill")
        .args(["-TERM", &coordinator.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let exit = coordinator.wait().expect("exits");
    assert!(exit.success(), "{exit:?}");
    let next = store
        .campaign("rack-c", "c2", Duration::from_secs(5))
        .expect("campaign");
    assert!(next.is_some(), "the stopped replica resigned");

    // A release is refused while the node is live, and says what it assumes where not.
    let release = |node: &str| {
        tokwatt()
            .args([
                "fleet",
                "release",
                node,
                "--etcd",
                &endpoint,
                "--domain",
                "rack-c",
                "--why",
                "powered off at the PDU",
                "--by",
                "alice",
            ])
            .output()
            .expect("runs")
    };
    let out = release("a");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("is live"),
        "{stderr}"
    );
    let out = release("b");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("This assumes its GPUs' power caps sum to at most 1000 W")
            && stdout.contains("Released"),
        "{stdout}"
    );
    let show = tokwatt()
        .args(["fleet", "show", "--etcd", &endpoint, "--domain", "rack-c"])
        .output()
        .expect("runs");
    let text = String::from_utf8_lossy(&show.stdout);
    assert!(
        text.contains("silent, released by alice: powered off at the PDU"),
        "{text}"
    );
}

#[test]
fn the_fleet_commands_speak_tls_to_an_etcd_that_requires_client_certificates() {
    use crate::support::tokwatt;
    let Some((pki, cluster)) = EtcdCluster::start_tls_one() else {
        return;
    };
    let endpoint = cluster.endpoints()[0].clone();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("rack.toml");
    std::fs::write(
        &file,
        "domain = \"rack-t\"\nbudget_w = 4000\n[[nodes]]\nnode = \"a\"\nreserve_w = 1000\nmax_w = 2800\n",
    )
    .expect("file");
    let tls = |with_client: bool| {
        let mut args = vec!["--etcd".into(), endpoint.clone(), "--etcd-ca".into()];
        args.push(pki.ca.display().to_string());
        if with_client {
            args.push("--etcd-cert".into());
            args.push(pki.client_cert.display().to_string());
            args.push("--etcd-key".into());
            args.push(pki.client_key.display().to_string());
        }
        args
    };
    let out = tokwatt()
        .args(["fleet", "budget", "--file"])
        .arg(&file)
        .args(tls(true))
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = tokwatt()
        .args(["fleet", "show", "--domain", "rack-t"])
        .args(tls(true))
        .output()
        .expect("runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("of 4000 W available"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Without a client certificate etcd refuses, and the error says what to set.
    let out = tokwatt()
        .args(["fleet", "show", "--domain", "rack-t"])
        .args(tls(false))
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--etcd-cert and --etcd-key"),
        "{stderr}"
    );
}

#[test]
fn a_served_node_joins_over_tls_with_its_client_certificate() {
    let Some((pki, cluster)) = EtcdCluster::start_tls_one() else {
        return;
    };
    let tls = tokwatt_fleet::etcd::EtcdTls::load(&tokwatt_fleet::etcd::TlsFiles {
        ca_file: pki.ca.clone(),
        client: Some(tokwatt_fleet::etcd::ClientFiles {
            cert_file: pki.client_cert.clone(),
            key_file: pki.client_key.clone(),
        }),
    })
    .expect("the TLS files load");
    let store = EtcdFleet::connect_with(&cluster.endpoints(), Some(&tls), Duration::from_secs(1))
        .expect("client");
    store.put_budget(&rack_s(1000.0)).expect("budget");
    let dir = tempfile::tempdir().expect("tempdir");
    let config = node_config_with(
        dir.path(),
        &cluster.endpoints(),
        &format!(
            "ca_file = '{}'\ncert_file = '{}'\nkey_file = '{}'\n",
            pki.ca.display(),
            pki.client_cert.display(),
            pki.client_key.display()
        ),
    );
    let agent = serve::start(&config, Arc::new(AtomicBool::new(false)), None).expect("starts");
    wait_for("the node's record in etcd", Duration::from_secs(30), || {
        store
            .read_domain("rack-s")
            .ok()
            .flatten()
            .is_some_and(|view| view.nodes.iter().any(|n| n.record.is_some()))
    });
    agent.stop();
    agent.join().expect("the agent stops");
    // Stopped, it left: its record went with its lease.
    let view = store.read_domain("rack-s").expect("read").expect("budget");
    assert!(view.nodes.iter().all(|n| n.record.is_none()), "{view:?}");
}

#[test]
fn a_budget_that_gives_the_node_less_than_its_config_lowers_what_a_restore_puts_back() {
    // serve.toml says 1 kW; the domain's budget says 900 W. A crash must restore within
    // 900 W (what the ledger charges a node without a lease), not 1 kW.
    use tokwatt_agent::restore::StateFile;
    let Some(cluster) = EtcdCluster::start(1) else {
        return;
    };
    let store = EtcdFleet::connect(&cluster.endpoints(), Duration::from_secs(1)).expect("client");
    store.put_budget(&rack_s(900.0)).expect("budget");
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state.json");
    let mut config = node_config(dir.path(), &cluster.endpoints());
    config.state_file = Some(state.clone());
    let agent = serve::start(&config, Arc::new(AtomicBool::new(false)), None).expect("starts");
    let control = agent.control();
    wait_for("ticks", Duration::from_secs(20), || {
        control.status().ticks >= 3
    });
    let saved = StateFile::new(&state)
        .load()
        .expect("the state file loads")
        .expect("the guard saved the GPUs before the first change");
    let restored: f64 = saved.iter().map(|gpu| gpu.original.power_cap_w).sum();
    assert!(
        restored <= 900.0 + 1e-6,
        "a restore would put back {restored} W, above the budget's 900 W reserve"
    );
    let in_force: f64 = control
        .status()
        .gpus
        .iter()
        .map(|g| g.in_force.power_cap_w)
        .sum();
    assert!(in_force <= 900.0 + 1e-6, "{in_force} W in force");
    agent.stop();
    agent.join().expect("stops cleanly");
}
