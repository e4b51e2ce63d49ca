//! `tokwatt fleet ab` on a fleet: eight simulated `tokwatt serve` agents (one GPU each,
//! ticking as fast as they can, each under its own steady demand), a real Prometheus
//! (Debian's `prometheus`) scraping them every second, and the command run as an operator
//! would: a policy against itself names no winner, a 300 W cap against 700 W under light
//! load wins on tokens per joule, and every node is back on its own policy after each.
//! Skipped with its reason where `prometheus` is missing, unless
//! TOKWATT_REQUIRE_PROMETHEUS=1 (set by .ci/run).
//!
//! And in one power domain (a real etcd, a `tokwatt fleet coordinate`, every agent in the
//! domain with a budget that binds): refused without the domain's store, naming the bias;
//! with it, an A/A and a greedy-vs-modest A/B each hold every node's grant through the
//! measured windows, read from etcd by the test as well. Skipped also where `etcd` is
//! missing, unless TOKWATT_REQUIRE_ETCD=1.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use tokwatt_fleet::FleetStore;
use tokwatt_fleet::etcd::EtcdFleet;
use tokwatt_serve::api::ApiClient;
use tokwatt_test_support::{free_port, wait_for};

use crate::prometheus_server::{Killed, prometheus, query, start_prometheus};
use crate::support::*;

const NODES: usize = 8;

/// The child gets SIGKILL when the thread that started it ends, so that a test killed
/// from outside (where no destructor runs) leaves no agent spinning a core.
fn dies_with_the_test(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec the closure makes one async-signal-safe call (prctl)
    // and allocates nothing.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
}

/// A copy of the shipped `static` spec holding `watts`, its plugin named by path.
fn static_spec(dir: &Path, watts: u32) -> PathBuf {
    let shipped =
        std::fs::read_to_string(repo_root().join("policies/static.toml")).expect("static.toml");
    let text = shipped
        .replace(
            "power_cap_w = \"500\"",
            &format!("power_cap_w = \"{watts}\""),
        )
        .replace(
            "plugin = \"policy_static.wasm\"",
            &format!("plugin = \"{}\"", built_plugin("policy_static").display()),
        );
    assert!(text.contains(&format!("power_cap_w = \"{watts}\"")));
    let path = dir.join(format!("static-{watts}.toml"));
    std::fs::write(&path, text).expect("write the spec");
    path
}

/// What a fleet A/B run printed and wrote.
struct Outcome {
    stdout: String,
    report: serde_json::Value,
}

fn fleet_ab(
    nodes: &Path,
    prometheus_port: u16,
    a: &Path,
    b: &Path,
    extra: &[&str],
    out: &Path,
) -> Outcome {
    let output = tokwatt()
        .args(["fleet", "ab", "--nodes"])
        .arg(nodes)
        .arg("--prometheus")
        .arg(format!("http://127.0.0.1:{prometheus_port}"))
        .arg("--a")
        .arg(a)
        .arg("--b")
        .arg(b)
        .args([
            "--half",
            "6s",
            "--settle",
            "2s",
            "--baseline",
            "4s",
            "--out",
        ])
        .arg(out)
        .args(extra)
        .output()
        .expect("tokwatt fleet ab runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "tokwatt fleet ab failed:\n{stdout}\n{}",
        stderr(&output)
    );
    let report = serde_json::from_str(
        &std::fs::read_to_string(out.join("fleet-ab.json")).expect("fleet-ab.json written"),
    )
    .expect("fleet-ab.json is JSON");
    Outcome { stdout, report }
}

/// Every node answers and has swapped nothing (a refused experiment changed nothing);
/// their statuses, for further checks.
fn assert_nothing_swapped(sockets: &[PathBuf]) -> Vec<tokwatt_serve::api::NodeStatus> {
    sockets
        .iter()
        .map(|socket| {
            let status = ApiClient::unix(socket)
                .expect("client")
                .status()
                .expect("status");
            assert_eq!(
                status.policy.swaps,
                0,
                "nothing swapped on {}",
                socket.display()
            );
            status
        })
        .collect()
}

/// Every node runs the policy it was started with, unpaused.
fn assert_on_their_own_policy(sockets: &[PathBuf], spec: &Path) {
    for socket in sockets {
        let status = ApiClient::unix(socket)
            .expect("client")
            .status()
            .expect("the agent answers");
        assert_eq!(status.policy.spec, spec, "{}", socket.display());
        assert!(!status.paused);
    }
}

fn verdict_line(report: &serde_json::Value) -> String {
    let v = &report["verdict"];
    format!(
        "decision {}, B/A {:.4}, bootstrap [{:.4}, {:.4}], t [{:.4}, {:.4}], {} pairs, served {} / {}",
        v["decision"],
        v["ratio_b_over_a"].as_f64().unwrap_or(f64::NAN),
        v["ci_low"].as_f64().unwrap_or(f64::NAN),
        v["ci_high"].as_f64().unwrap_or(f64::NAN),
        v["t_ci_low"].as_f64().unwrap_or(f64::NAN),
        v["t_ci_high"].as_f64().unwrap_or(f64::NAN),
        v["pairs"],
        v["served_fraction_a"],
        v["served_fraction_b"]
    )
}

/// Eight simulated agents (one GPU each, ticking as fast as they can) on `home`, node `i`
/// under `rps(i)` requests a second of 256 tokens, each serve.toml given `extra(i)` (more
/// `[node]` keys, then more tables); a Prometheus scraping them every second, for longer
/// than the baseline once this returns.
struct Agents {
    _agents: Vec<Killed>,
    _prometheus: Killed,
    sockets: Vec<PathBuf>,
    web_port: u16,
    nodes_file: String,
    nodes: PathBuf,
}

fn start_agents(
    prometheus: &str,
    dir: &Path,
    home: &Path,
    rps: impl Fn(usize) -> usize,
    extra: impl Fn(usize) -> (String, String),
) -> Agents {
    let mut agents = Vec::new();
    let mut sockets = Vec::new();
    let mut targets = Vec::new();
    let mut nodes_file = String::new();
    for node in 0..NODES {
        let rps = rps(node);
        let scenario = dir.join(format!("demand-{node}.toml"));
        std::fs::write(
            &scenario,
            format!(
                "description = \"steady {rps} requests/s\"\nmodel = \"llama-3-8b\"\n\
                 context_tokens = 1024\noutput_tokens = 256\nbatch_size_max = 512\n\
                 initial_batch_size = 512\nqueue_max = 2048\n\
                 [[phases]]\nstart_s = 0\narrival_rps = {rps}.0\n"
            ),
        )
        .expect("write the scenario");
        let port = free_port();
        let socket = dir.join(format!("node-{node}.sock"));
        let config = dir.join(format!("serve-{node}.toml"));
        let (node_keys, tables) = extra(node);
        std::fs::write(
            &config,
            format!(
                "[policy]\nspec = \"{}\"\n[node]\nbackend = \"sim\"\nsim_gpus = 1\n\
                 sim_realtime = false\nsim_scenario = \"{}\"\n{node_keys}[api]\nsocket = \"{}\"\n\
                 [metrics]\nlisten = \"127.0.0.1:{port}\"\n\
                 [output]\ndir = \"{}\"\nmax_file_mib = 1\nkeep_files = 1\n{tables}",
                home.display(),
                scenario.display(),
                socket.display(),
                dir.join(format!("out-{node}")).display()
            ),
        )
        .expect("write serve.toml");
        // No --duration: a simulated node's duration is simulated time, which passes in a
        // blink here. The agent is killed when the test ends, or when its thread goes.
        // Its log kept, to say why an agent that never came up did not.
        let log = std::fs::File::create(dir.join(format!("serve-{node}.log")))
            .expect("create the agent's log");
        let mut serve = tokwatt();
        serve
            .args(["serve", "--config"])
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(log);
        dies_with_the_test(&mut serve);
        agents.push(Killed(serve.spawn().expect("tokwatt serve starts")));
        nodes_file.push_str(&format!(
            "[[node]]\nname = \"node-{node}\"\nsocket = \"{}\"\ninstance = \"127.0.0.1:{port}\"\n\n",
            socket.display()
        ));
        targets.push(format!("'127.0.0.1:{port}'"));
        sockets.push(socket);
    }
    let web_port = free_port();
    let prometheus = start_prometheus(prometheus, dir, &targets, web_port);
    let nodes = dir.join("nodes.toml");
    std::fs::write(&nodes, &nodes_file).expect("write the nodes file");
    // Eight agents starting at once on a loaded two-core runner can take a while.
    let up = tokwatt_test_support::eventually(Duration::from_secs(180), || {
        sockets.iter().all(|socket| socket.exists())
    });
    if !up {
        let missing: Vec<String> = sockets
            .iter()
            .enumerate()
            .filter(|(_, socket)| !socket.exists())
            .map(|(node, _)| {
                let log = std::fs::read_to_string(dir.join(format!("serve-{node}.log")))
                    .unwrap_or_default();
                let tail: String = log.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
                format!("node-{node}: {tail}")
            })
            .collect();
        panic!("timed out waiting for every agent's socket: {missing:?}");
    }
    // Prometheus scrapes every agent, and has for longer than the baseline.
    wait_for(
        "Prometheus scraping every agent",
        Duration::from_secs(60),
        || query(web_port, "count(up == 1)") == Some(NODES as f64),
    );
    std::thread::sleep(Duration::from_secs(5));
    Agents {
        _agents: agents,
        _prometheus: prometheus,
        sockets,
        web_port,
        nodes_file,
        nodes,
    }
}

#[test]
fn a_fleet_ab_over_prometheus_finds_no_winner_against_itself_and_the_lower_cap_under_light_load() {
    let Some(prometheus) = prometheus() else {
        return;
    };
    let dir = tempdir();
    let home = static_spec(dir.path(), 500);
    // Light load: 3 to 17 requests a second of 256 tokens, at most a quarter of what an
    // H200 serves; each node's own, so that the pairs are made by load.
    let agents = start_agents(
        prometheus,
        dir.path(),
        &home,
        |node| 3 + 2 * node,
        |_| Default::default(),
    );
    let (sockets, web_port, nodes_file, nodes) = (
        &agents.sockets,
        agents.web_port,
        &agents.nodes_file,
        &agents.nodes,
    );
    let a = static_spec(dir.path(), 700);
    let b = static_spec(dir.path(), 300);

    // A node that cannot be reached: named, with nothing changed anywhere.
    let broken = dir.path().join("broken-nodes.toml");
    std::fs::write(
        &broken,
        nodes_file.replace("node-5.sock", "node-5-moved.sock"),
    )
    .expect("write");
    let refused = tokwatt()
        .args(["fleet", "ab", "--nodes"])
        .arg(&broken)
        .args([
            "--prometheus",
            &format!("http://127.0.0.1:{web_port}"),
            "--a",
        ])
        .arg(&a)
        .arg("--b")
        .arg(&b)
        .arg("--out")
        .arg(dir.path().join("refused"))
        .output()
        .expect("runs");
    let said = stderr(&refused);
    assert!(!refused.status.success());
    assert!(
        said.contains("node `node-5`")
            && said.contains("node-5-moved.sock")
            && said.contains("is `tokwatt serve` running?")
            && said.contains("nothing was changed on any node"),
        "{said}"
    );
    assert_nothing_swapped(sockets);

    // The plan alone: checked and shown, nothing changed.
    let plan = tokwatt()
        .args(["fleet", "ab", "--plan-only", "--nodes"])
        .arg(nodes)
        .args([
            "--prometheus",
            &format!("http://127.0.0.1:{web_port}"),
            "--a",
        ])
        .arg(&a)
        .arg("--b")
        .arg(&b)
        .args(["--baseline", "4s"])
        .output()
        .expect("runs");
    let shown = String::from_utf8_lossy(&plan.stdout);
    assert!(plan.status.success(), "{shown}\n{}", stderr(&plan));
    assert!(
        shown.contains("pair 4:") && shown.contains("plan only: nothing was changed"),
        "{shown}"
    );

    // A against itself: no winner. α = 0.001 here so that the test fails by chance once in
    // a thousand runs, not once in fifty.
    let same = fleet_ab(
        nodes,
        web_port,
        &a,
        &a,
        &["--alpha", "0.001"],
        &dir.path().join("a-a"),
    );
    println!("A/A: {}", verdict_line(&same.report));
    let verdict = &same.report["verdict"];
    assert_eq!(verdict["decision"], "no-difference", "{}", same.stdout);
    // Within 1-2 % on a quiet machine; a loaded one runs fewer simulated seconds a half,
    // and the interval widens with the noise.
    let ratio = verdict["ratio_b_over_a"].as_f64().expect("ratio");
    assert!((0.8..1.25).contains(&ratio), "{}", same.stdout);
    assert_eq!(verdict["pairs"], 4);
    assert_eq!(
        same.report["put_back"]["restored"].as_array().map(Vec::len),
        Some(8)
    );
    assert!(same.stdout.contains("SIMULATED"), "{}", same.stdout);
    assert_on_their_own_policy(sockets, &home);

    // 300 W against 700 W under light load: the same tokens for less energy.
    let capped = fleet_ab(nodes, web_port, &a, &b, &[], &dir.path().join("a-b"));
    println!("A/B: {}", verdict_line(&capped.report));
    let verdict = &capped.report["verdict"];
    assert_eq!(verdict["decision"], "b", "{}", capped.stdout);
    assert!(
        verdict["ci_low"].as_f64().expect("low") > 1.1,
        "{}",
        capped.stdout
    );
    assert!(
        verdict["t_ci_low"].as_f64().expect("low") > 1.0,
        "{}",
        capped.stdout
    );
    for arm in ["served_fraction_a", "served_fraction_b"] {
        let served = verdict[arm]
            .as_f64()
            .expect("demand is known on the simulator");
        assert!(served > 0.99, "{arm} {served}: light load is served");
    }
    let report = &capped.report;
    assert_eq!(report["pairs"].as_array().map(Vec::len), Some(4));
    // Pairs are neighbours by load: each pair's two demands differ by one step.
    for node in report["nodes"].as_array().expect("nodes") {
        assert_eq!(node["halves"].as_array().map(Vec::len), Some(2), "{node}");
        assert_eq!(
            node["halves"][0]["state_carried"], false,
            "a fresh instance"
        );
        assert!(node["halves"][1]["measured"]["coverage"]["scrapes"].as_u64() >= Some(3));
    }
    for pair in report["pairs"].as_array().expect("pairs") {
        let index = |key: &str| -> usize {
            pair[key]
                .as_str()
                .and_then(|n| n.strip_prefix("node-"))
                .and_then(|n| n.parse().ok())
                .expect("node-N")
        };
        assert_eq!(index("a_first").abs_diff(index("b_first")), 1, "{pair}");
    }
    assert_on_their_own_policy(sockets, &home);
    drop(agents);
}

// ---------------------------------------------------------------------------------------
// In one power domain

const DOMAIN: &str = "rack-ab";

/// The shipped H200 profile with its board-default cap lowered to `default_w` (of 700 W):
/// an unfenced node is charged its board defaults however long it is silent, and the
/// allocator gives none less; at the H200's own 700 W that is all it can use, and no watt
/// would move between nodes at all. Lower defaults leave the budget something to move.
fn profile_defaulting_to(dir: &Path, default_w: u32) -> PathBuf {
    let shipped =
        std::fs::read_to_string(repo_root().join("host/profiles/h200.toml")).expect("h200.toml");
    let text = shipped.replacen(
        "default_w = 700.0",
        &format!("default_w = {default_w}.0"),
        1,
    );
    assert_ne!(text, shipped);
    let path = dir.join(format!("h200-default-{default_w}.toml"));
    std::fs::write(&path, text).expect("write the profile");
    path
}

/// The grants of every node of the domain (by its name there, `gpu-N`), and its freeze.
type DomainNow = (
    Vec<Option<tokwatt_fleet::Grant>>,
    Option<tokwatt_fleet::StoredFreeze>,
);

/// The domain now, read from etcd.
fn grants_and_freeze(store: &EtcdFleet) -> DomainNow {
    try_grants_and_freeze(store).expect("etcd answers")
}

fn try_grants_and_freeze(store: &EtcdFleet) -> Result<DomainNow, tokwatt_fleet::StoreError> {
    let view = store.read_domain(DOMAIN)?.expect("the budget is there");
    let grants = (0..NODES)
        .map(|i| {
            view.nodes
                .iter()
                .find(|n| n.node == format!("gpu-{i}"))
                .and_then(|n| n.grant)
        })
        .collect();
    Ok((grants, view.freeze))
}

/// What the test saw of the domain while a fleet A/B ran, read from etcd every 100 ms.
#[derive(Debug, Default)]
struct Watched {
    /// Reads while the domain was frozen, and reads that failed.
    frozen_reads: usize,
    read_errors: usize,
    /// Who froze it, as etcd said.
    frozen_by: Option<String>,
    /// Each node's grants seen while frozen (generation and watts), in order, deduplicated.
    held: Vec<Vec<(u64, f64)>>,
    /// `tokwatt fleet show` and the coordinator's metrics while frozen.
    show: String,
    frozen_metric: Option<String>,
}

fn scrape(port: u16) -> String {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut text = String::new();
    let _ = stream.read_to_string(&mut text);
    text
}

/// Runs `run` while watching the domain from another thread.
fn watching<T>(
    store: &EtcdFleet,
    endpoint: &str,
    metrics_port: u16,
    run: impl FnOnce() -> T,
) -> (T, Watched) {
    /// Ends the watch however `run` ends: a panic there must not leave it watching.
    struct Done<'a>(&'a std::sync::atomic::AtomicBool);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let watcher = scope.spawn(|| {
            let mut watched = Watched {
                held: vec![Vec::new(); NODES],
                ..Watched::default()
            };
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                // A read that fails (a loaded machine) is tried again: a change is seen
                // at the next.
                let Ok((grants, freeze)) = try_grants_and_freeze(store) else {
                    watched.read_errors += 1;
                    continue;
                };
                if let Some(freeze) = freeze {
                    watched.frozen_reads += 1;
                    watched.frozen_by = Some(freeze.freeze.by.clone());
                    for (seen, grant) in watched.held.iter_mut().zip(&grants) {
                        let now = grant.map_or((0, 0.0), |g| (g.generation, g.watts));
                        if seen.last() != Some(&now) {
                            seen.push(now);
                        }
                    }
                    if watched.show.is_empty() {
                        let shown = tokwatt()
                            .args(["fleet", "show", "--etcd", endpoint, "--domain", DOMAIN])
                            .output()
                            .expect("fleet show runs");
                        watched.show = String::from_utf8_lossy(&shown.stdout).into_owned();
                    }
                    if watched.frozen_metric.is_none() {
                        watched.frozen_metric = scrape(metrics_port)
                            .lines()
                            .find(|l| {
                                l.starts_with("tokwatt_fleet_frozen{")
                                    && l.rsplit(' ').next().and_then(|v| v.parse().ok())
                                        == Some(1.0)
                            })
                            .map(str::to_owned);
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            watched
        });
        let outcome = {
            let _done = Done(&done);
            run()
        };
        (outcome, watcher.join().expect("the watcher"))
    })
}

/// Every node's grant was held through the freeze (one value each, seen by the test), the
/// report's start and end grants are those, and its grant changes none.
fn assert_grants_held(report: &serde_json::Value, watched: &Watched, stdout: &str) {
    assert!(watched.frozen_reads >= 20, "{watched:?}");
    assert!(
        watched
            .frozen_by
            .as_deref()
            .is_some_and(|by| by.starts_with("tokwatt fleet ab on ")),
        "{watched:?}"
    );
    for (node, held) in watched.held.iter().enumerate() {
        assert_eq!(
            held.len(),
            1,
            "node {node}'s grant moved while frozen: {held:?}"
        );
        assert!(held[0].1 >= 300.0, "node {node} has a grant: {held:?}");
        let reported = &report["nodes"][node];
        assert_eq!(reported["fleet"]["domain"], DOMAIN);
        assert_eq!(reported["fleet"]["node"], format!("gpu-{node}"));
        for key in ["grant_start", "grant_end"] {
            assert_eq!(
                reported[key]["generation"].as_u64(),
                Some(held[0].0),
                "{key} of node {node}: {reported}"
            );
        }
    }
    assert_eq!(report["grant_changes"], serde_json::json!([]), "{stdout}");
    let domains = report["domains"].as_array().expect("domains");
    assert_eq!(domains.len(), 1);
    assert_eq!(domains[0]["domain"], DOMAIN);
    assert_eq!(domains[0]["thawed"], true);
    assert_eq!(domains[0]["nodes"].as_array().map(Vec::len), Some(NODES));
    assert!(
        watched.show.contains("FROZEN by tokwatt fleet ab on "),
        "{}",
        watched.show
    );
    assert!(
        watched
            .frozen_metric
            .as_deref()
            .is_some_and(|line| line.contains("by=\"tokwatt fleet ab on ")),
        "{watched:?}"
    );
    assert!(stdout.contains("none while frozen"), "{stdout}");
}

fn grants_line(report: &serde_json::Value) -> String {
    report["nodes"]
        .as_array()
        .map(|nodes| {
            nodes
                .iter()
                .map(|n| {
                    format!(
                        "{} {}->{}",
                        n["name"].as_str().unwrap_or("?"),
                        n["grant_start"]["watts"].as_f64().unwrap_or(f64::NAN),
                        n["grant_end"]["watts"].as_f64().unwrap_or(f64::NAN)
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default()
}

#[test]
fn a_fleet_ab_in_one_power_domain_freezes_its_grants_through_an_a_a_and_a_greedy_vs_modest_a_b() {
    use tokwatt_fleet::{DomainBudget, NodeBudget};
    let Some(prometheus) = prometheus() else {
        return;
    };
    let Some(cluster) = tokwatt_test_support::EtcdCluster::start(1) else {
        return;
    };
    let endpoint = cluster.endpoints()[0].clone();
    let store = EtcdFleet::connect(std::slice::from_ref(&endpoint), Duration::from_secs(2))
        .expect("an etcd client");
    let dir = tempdir();
    // Eight unfenced one-GPU nodes whose boards default to 400 W: the budget's check counts
    // each at 400 W silent (3.2 kW), and 4.4 kW leaves 1.2 kW to share above that, where
    // every node's policy asks for 700 W: the budget binds.
    let profile = profile_defaulting_to(dir.path(), 400);
    store
        .put_budget(&DomainBudget {
            domain: DOMAIN.into(),
            budget_w: 4400.0,
            uncontrolled_w: 0.0,
            nodes: (0..NODES)
                .map(|i| NodeBudget {
                    node: format!("gpu-{i}"),
                    reserve_w: 300.0,
                    max_w: 700.0,
                    priority: 0,
                    fenced: false,
                    default_w: Some(400.0),
                })
                .collect(),
        })
        .expect("the budget passes its check");
    let metrics_port = free_port();
    let mut coordinate = tokwatt();
    coordinate
        .args([
            "fleet",
            "coordinate",
            "--etcd",
            &endpoint,
            "--domain",
            DOMAIN,
            "--name",
            "c1",
            "--ttl",
            "5s",
            "--period",
            "300ms",
            "--metrics",
            &format!("127.0.0.1:{metrics_port}"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    dies_with_the_test(&mut coordinate);
    let _coordinator = Killed(coordinate.spawn().expect("the coordinator starts"));

    // Heavy load: 40 to 68 requests a second, more than a GPU serves at its share. The
    // guard only counts: at 400 W the heaviest nodes break the objective, and a guard that
    // acts would roll the modest arm back in its probation (the verdict judges the
    // objective instead).
    let home = static_spec(dir.path(), 700);
    let agents = start_agents(
        prometheus,
        dir.path(),
        &home,
        |node| 40 + 4 * node,
        |node| {
            (
                format!("sim_profile = \"{}\"\n", profile.display()),
                format!(
                    "[fleet]\netcd = [\"{endpoint}\"]\ndomain = \"{DOMAIN}\"\nnode = \"gpu-{node}\"\n\
                     reserve_w = 300\nlease_ttl = \"10s\"\nmargin = \"3s\"\nreport_every = \"300ms\"\n\
                     timeout = \"2s\"\n[guard]\nenabled = false\n"
                ),
            )
        },
    );
    // Every node granted, the budget shared out, the grants still for 3 s.
    let mut last = grants_and_freeze(&store).0;
    let mut still_since = std::time::Instant::now();
    wait_for(
        "every node granted, the grants settled",
        Duration::from_secs(120),
        || {
            let (now, _) = grants_and_freeze(&store);
            if now != last {
                last = now;
                still_since = std::time::Instant::now();
                return false;
            }
            let total: f64 = last.iter().flatten().map(|g| g.watts).sum();
            last.iter().all(Option::is_some)
                && total > 4300.0
                && still_since.elapsed() > Duration::from_secs(3)
        },
    );
    println!(
        "grants before: {:?}",
        last.iter()
            .map(|g| g.map_or(0.0, |g| g.watts))
            .collect::<Vec<_>>()
    );
    let a = static_spec(dir.path(), 700);
    let b = static_spec(dir.path(), 400);

    // Without the domain's store: refused before anything changes, naming the bias.
    let refused = tokwatt()
        .args(["fleet", "ab", "--nodes"])
        .arg(&agents.nodes)
        .args([
            "--prometheus",
            &format!("http://127.0.0.1:{}", agents.web_port),
            "--a",
        ])
        .arg(&a)
        .arg("--b")
        .arg(&b)
        .args(["--baseline", "4s", "--out"])
        .arg(dir.path().join("refused"))
        .output()
        .expect("runs");
    let said = stderr(&refused);
    assert!(!refused.status.success());
    for expected in [
        "share the power budget of `rack-ab`",
        "a greedier arm would win watts from the other arm's nodes",
        "--etcd",
        "nothing was changed on any node",
    ] {
        assert!(said.contains(expected), "{expected:?}: {said}");
    }
    for status in assert_nothing_swapped(&agents.sockets) {
        assert_eq!(
            status.fleet.map(|f| f.domain),
            Some(DOMAIN.to_owned()),
            "the status names the domain"
        );
    }
    assert_eq!(grants_and_freeze(&store).1, None, "nothing frozen");

    let etcd = ["--etcd", endpoint.as_str()];
    // A against itself in the domain: every grant held, no difference.
    let (same, watched) = watching(&store, &endpoint, metrics_port, || {
        let mut extra = vec!["--alpha", "0.001"];
        extra.extend(etcd);
        fleet_ab(
            &agents.nodes,
            agents.web_port,
            &a,
            &a,
            &extra,
            &dir.path().join("a-a"),
        )
    });
    println!("A/A in {DOMAIN}: {}", verdict_line(&same.report));
    println!("  grants: {}", grants_line(&same.report));
    assert_grants_held(&same.report, &watched, &same.stdout);
    let verdict = &same.report["verdict"];
    assert_eq!(verdict["decision"], "no-difference", "{}", same.stdout);
    let covers_one = |low: &str, high: &str| {
        verdict[low].as_f64().is_some_and(|l| l <= 1.0)
            && verdict[high].as_f64().is_some_and(|h| h >= 1.0)
    };
    // The t interval, not the bootstrap: with four pairs the percentile bootstrap's
    // 99.9 % interval is the span of the four pair ratios, which misses 1 whenever all four
    // fall on one side of it, one A/A in eight by chance alone.
    assert!(covers_one("t_ci_low", "t_ci_high"), "{}", same.stdout);
    assert_eq!(grants_and_freeze(&store).1, None, "thawed at the end");
    assert_on_their_own_policy(&agents.sockets, &home);

    // Greedy (700 W) against modest (400 W): unfrozen, the modest arm's nodes would give
    // back what they do not draw and the greedy arm's take it; frozen, every node keeps
    // its grant, whichever arm it runs.
    let (greedy, watched) = watching(&store, &endpoint, metrics_port, || {
        fleet_ab(
            &agents.nodes,
            agents.web_port,
            &a,
            &b,
            &etcd,
            &dir.path().join("greedy-modest"),
        )
    });
    println!(
        "greedy A (700 W) vs modest B (400 W) in {DOMAIN}: {}",
        verdict_line(&greedy.report)
    );
    println!("  grants: {}", grants_line(&greedy.report));
    assert_grants_held(&greedy.report, &watched, &greedy.stdout);
    let verdict = &greedy.report["verdict"];
    assert!(
        verdict["ratio_b_over_a"]
            .as_f64()
            .is_some_and(f64::is_finite),
        "{}",
        greedy.stdout
    );
    assert!(greedy.stdout.contains("decision"), "{}", greedy.stdout);
    assert_eq!(grants_and_freeze(&store).1, None, "thawed at the end");
    assert_on_their_own_policy(&agents.sockets, &home);

    // The control: the same arms without a freeze (swapped by hand, no experiment). The
    // modest nodes give back what they do not draw, and the greedy ones take it: the bias
    // the freeze keeps out of the measured windows.
    let held: Vec<f64> = grants_and_freeze(&store)
        .0
        .iter()
        .map(|g| g.map_or(0.0, |g| g.watts))
        .collect();
    for (node, socket) in agents.sockets.iter().enumerate() {
        let spec = if node % 2 == 0 { &b } else { &a };
        ApiClient::unix(socket)
            .expect("client")
            .swap(&tokwatt_serve::api::SwapRequest {
                spec: spec.clone(),
                plugin: None,
                fresh: true,
            })
            .expect("the swap takes");
    }
    let moved = || -> (f64, f64) {
        let now = grants_and_freeze(&store).0;
        let (mut given, mut taken) = (0.0, 0.0);
        for (node, (was, now)) in held.iter().zip(&now).enumerate() {
            let change = now.map_or(0.0, |g| g.watts) - was;
            if node % 2 == 0 {
                given -= change;
            } else {
                taken += change;
            }
        }
        (given, taken)
    };
    wait_for(
        "unfrozen, watts moved from the modest arm's nodes to the greedy arm's",
        Duration::from_secs(60),
        || {
            let (given, taken) = moved();
            given >= 200.0 && taken >= 200.0
        },
    );
    let (given, taken) = moved();
    println!(
        "unfrozen control: the modest arm's nodes gave {given:.0} W, the greedy arm's took {taken:.0} W (grants before {held:?})"
    );
    drop(agents);
}
