//! `tokwatt fleet ab` on a fleet: eight simulated `tokwatt serve` agents (one GPU each,
//! ticking as fast as they can, each under its own steady demand), a real Prometheus
//! (Debian's `prometheus`) scraping them every second, and the command run as an operator
//! would: a policy against itself names no winner, a 300 W cap against 700 W under light
//! load wins on tokens per joule, and every node is back on its own policy after each.
//! Skipped with its reason where `prometheus` is missing, unless
//! TOKWATT_REQUIRE_PROMETHEUS=1 (set by .ci/run).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use tokwatt::api::ApiClient;
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

#[test]
fn a_fleet_ab_over_prometheus_finds_no_winner_against_itself_and_the_lower_cap_under_light_load() {
    let Some(prometheus) = prometheus() else {
        return;
    };
    let dir = tempdir();
    let home = static_spec(dir.path(), 500);
    let mut agents = Vec::new();
    let mut sockets = Vec::new();
    let mut targets = Vec::new();
    let mut nodes_file = String::new();
    for node in 0..NODES {
        // Light load: 3 to 17 requests a second of 256 tokens, at most a quarter of what
        // an H200 serves; each node's own, so that the pairs are made by load.
        let rps = 3 + 2 * node;
        let scenario = dir.path().join(format!("demand-{node}.toml"));
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
        let socket = dir.path().join(format!("node-{node}.sock"));
        let config = dir.path().join(format!("serve-{node}.toml"));
        std::fs::write(
            &config,
            format!(
                "[policy]\nspec = \"{}\"\n[node]\nbackend = \"sim\"\nsim_gpus = 1\n\
                 sim_realtime = false\nsim_scenario = \"{}\"\n[api]\nsocket = \"{}\"\n\
                 [metrics]\nlisten = \"127.0.0.1:{port}\"\n\
                 [output]\ndir = \"{}\"\nmax_file_mib = 1\nkeep_files = 1\n",
                home.display(),
                scenario.display(),
                socket.display(),
                dir.path().join(format!("out-{node}")).display()
            ),
        )
        .expect("write serve.toml");
        // No --duration: a simulated node's duration is simulated time, which passes in a
        // blink here. The agent is killed when the test ends, or when its thread goes.
        let mut serve = tokwatt();
        serve
            .args(["serve", "--config"])
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
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
    let _prometheus = start_prometheus(prometheus, dir.path(), &targets, web_port);
    let nodes = dir.path().join("nodes.toml");
    std::fs::write(&nodes, &nodes_file).expect("write the nodes file");
    wait_for("every agent's socket", Duration::from_secs(60), || {
        sockets.iter().all(|socket| socket.exists())
    });
    let a = static_spec(dir.path(), 700);
    let b = static_spec(dir.path(), 300);
    // Prometheus scrapes every agent, and has for longer than the baseline.
    wait_for(
        "Prometheus scraping every agent",
        Duration::from_secs(60),
        || query(web_port, "count(up == 1)") == Some(NODES as f64),
    );
    std::thread::sleep(Duration::from_secs(5));

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
    for socket in &sockets {
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
    }

    // The plan alone: checked and shown, nothing changed.
    let plan = tokwatt()
        .args(["fleet", "ab", "--plan-only", "--nodes"])
        .arg(&nodes)
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
        &nodes,
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
    assert_on_their_own_policy(&sockets, &home);

    // 300 W against 700 W under light load: the same tokens for less energy.
    let capped = fleet_ab(&nodes, web_port, &a, &b, &[], &dir.path().join("a-b"));
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
    assert_on_their_own_policy(&sockets, &home);
    drop(agents);
}
