//! A real Prometheus server (Debian's `prometheus`) scraping `tokwatt serve` on a simulated
//! node while policies are swapped: `increase()` over the node's swap counter counts every
//! swap (issue 28: a series first seen above zero loses what it held, so 104 swaps read
//! as 100.06 before). Skipped with its reason where `prometheus` is missing, unless
//! TOKWATT_REQUIRE_PROMETHEUS=1 (set by .ci/run).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokwatt_test_support::free_port;

use crate::support::*;

/// Kills the process when the test ends, however it ends.
pub(crate) struct Killed(pub(crate) Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Debian's `prometheus`, or the test skips (fails where TOKWATT_REQUIRE_PROMETHEUS).
pub(crate) fn prometheus() -> Option<&'static str> {
    required_tool(
        "prometheus",
        "TOKWATT_REQUIRE_PROMETHEUS",
        "Debian: apt-get install prometheus",
    )
}

/// The value of `query` (a single-element vector or a scalar), from Prometheus's HTTP API.
pub(crate) fn query(port: u16, query: &str) -> Option<f64> {
    let url = format!("/api/v1/query?query={}", encode(query));
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    use std::io::{Read, Write};
    write!(
        stream,
        "GET {url} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let body = text.split("\r\n\r\n").nth(1)?;
    // Chunked or not, the JSON is the part between the first '{' and the last '}'.
    let json = &body[body.find('{')?..=body.rfind('}')?];
    let value: serde_json::Value = serde_json::from_str(json).ok()?;
    let result = &value["data"]["result"];
    let sample = if result.is_array() {
        result.get(0)?["value"][1].as_str()?.to_owned()
    } else {
        result[1].as_str()?.to_owned()
    };
    sample.parse().ok()
}

fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'.' | b'-' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_real_prometheus_counts_every_swap_with_increase() {
    let Some(prometheus) = prometheus() else {
        return;
    };
    let dir = tempdir();
    let metrics_port = free_port();
    let web_port = free_port();
    let socket = dir.path().join("tokwatt.sock");
    let config = dir.path().join("serve.toml");
    std::fs::write(
        &config,
        format!(
            "[policy]\nspec = \"{}\"\n[node]\nbackend = \"sim\"\nsim_gpus = 1\ntick = \"250ms\"\n\
             [api]\nsocket = \"{}\"\n[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\n\
             [output]\ndir = \"{}\"\n",
            repo_root().join("policies/static.toml").display(),
            socket.display(),
            dir.path().join("out").display()
        ),
    )
    .expect("write config");
    let _serve = Killed(
        tokwatt()
            .args(["serve", "--config"])
            .arg(&config)
            .args(["--duration", "90s"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("tokwatt serve starts"),
    );
    let _prometheus = start_prometheus(
        prometheus,
        dir.path(),
        &[format!("'127.0.0.1:{metrics_port}'")],
        web_port,
    );
    wait_for("the agent's socket", Duration::from_secs(60), || {
        socket.exists()
    });
    wait_for(
        "Prometheus scraping the agent",
        Duration::from_secs(60),
        || query(web_port, "tokwatt_swaps_total") == Some(0.0),
    );

    // Swaps among three policies: each one a new (policy, version) series.
    let specs = ["slo-batch", "hill-climb", "static"];
    let swaps = 9;
    for i in 0..swaps {
        let spec = repo_root().join(format!("policies/{}.toml", specs[i % specs.len()]));
        let output = tokwatt()
            .args(["policy", "swap"])
            .arg(&spec)
            .arg("--socket")
            .arg(&socket)
            .output()
            .expect("tokwatt policy swap runs");
        assert!(output.status.success(), "swap {i}: {}", stderr(&output));
        std::thread::sleep(Duration::from_millis(700));
    }
    // Every swap scraped: the last sample holds all of them.
    wait_for("the last swap scraped", Duration::from_secs(30), || {
        query(web_port, "tokwatt_swaps_total") == Some(swaps as f64)
    });
    std::thread::sleep(Duration::from_secs(2));
    // The samples themselves count every swap exactly.
    let counted = query(
        web_port,
        "max_over_time(tokwatt_swaps_total[10m]) - min_over_time(tokwatt_swaps_total[10m])",
    )
    .expect("max - min");
    assert!(
        (counted - swaps as f64).abs() < 0.5,
        "the samples count {counted} of {swaps} swaps"
    );
    // increase() extrapolates to the window's end when the last sample lies within about
    // an interval of it (PromQL's documented behaviour: results need not be integers), so
    // it may read above the count, never below it: 10.13 of 9 over a 10-second run.
    let increase = query(web_port, "increase(tokwatt_swaps_total[10m])").expect("increase()");
    assert!(
        increase > swaps as f64 - 0.5 && increase < swaps as f64 * 1.5,
        "increase() over the run counts {increase} of {swaps} swaps"
    );
    // The per-policy series are announced at zero before each policy takes over.
    let announced = query(web_port, "count(tokwatt_policy_swaps_total)").expect("count()");
    assert!(announced >= 3.0, "{announced} policy series");
    assert!(Path::new(&dir.path().join("tsdb")).exists());
}

/// Debian's Prometheus scraping `targets` (quoted host:port) every second, its web API on
/// 127.0.0.1:`web_port`, its data under `dir`; killed when dropped.
pub(crate) fn start_prometheus(
    prometheus: &str,
    dir: &std::path::Path,
    targets: &[String],
    web_port: u16,
) -> Killed {
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: tokwatt\n    static_configs:\n      - targets: [{}]\n",
            targets.join(", ")
        ),
    )
    .expect("write prometheus.yml");
    Killed(
        Command::new(prometheus)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{web_port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus starts"),
    )
}
