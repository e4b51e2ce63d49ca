//! The external token source against real expositions: `tests/engines/expose.py` defines
//! each serving engine's metrics with Python's `prometheus_client` (the library the
//! engines use), does known work, and writes `generate_latest()` before and after; a
//! tiny HTTP server here serves them to tokwatt, whose window must match the hand
//! computation. Skipped with a printed reason only where python3 or prometheus_client is
//! missing and TOKWATT_REQUIRE_PYTHON is unset (CI sets it).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokwatt_core::types::WorkloadWindow;
use tokwatt_core::workload::Workload;
use tokwatt_engines::prometheus::{Engine, PrometheusConfig, PrometheusTokens};

use crate::support::{repo_root, tempdir};

/// The expositions written by `expose.py`, or `None` (with the reason printed) where
/// Python cannot run it and CI did not ask for it.
fn expositions() -> Option<tempfile::TempDir> {
    let required = crate::support::required("TOKWATT_REQUIRE_PYTHON");
    let probe = Command::new("python3")
        .args(["-c", "import prometheus_client"])
        .output();
    let usable = probe.as_ref().is_ok_and(|o| o.status.success());
    if !usable {
        let why = match &probe {
            Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_owned(),
            Err(e) => format!("python3: {e}"),
        };
        assert!(
            !required,
            "TOKWATT_REQUIRE_PYTHON is set but prometheus_client cannot be imported: {why}"
        );
        eprintln!(
            "skipped: python3 with prometheus_client is needed (pip install prometheus_client): {why}"
        );
        return None;
    }
    let dir = tempdir();
    let script = repo_root().join("tests/engines/expose.py");
    let output = Command::new("python3")
        .arg(&script)
        .arg(dir.path())
        .output()
        .expect("python3 runs");
    assert!(
        output.status.success(),
        "expose.py failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Some(dir)
}

fn read(dir: &Path, name: &str) -> Vec<u8> {
    std::fs::read(dir.join(name)).expect("exposition written")
}

/// A metrics endpoint: the first request gets `bodies[0]`, the n-th `bodies[n]`, and
/// every later one the last body. Stops when dropped.
struct Server {
    address: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Server {
    /// `None` where the address cannot be bound (no IPv6 loopback on this machine).
    fn start(bind: &str, bodies: Vec<Vec<u8>>, chunked: bool) -> Option<Self> {
        let listener = match TcpListener::bind(bind) {
            Ok(listener) => listener,
            Err(e) => {
                eprintln!("skipped the {bind} endpoint: cannot bind it ({e})");
                return None;
            }
        };
        let address = listener.local_addr().expect("address");
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        std::thread::spawn(move || {
            for (n, stream) in listener.incoming().enumerate() {
                if stopping.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(stream) = stream else { continue };
                let body = &bodies[n.min(bodies.len() - 1)];
                respond(stream, body, chunked);
            }
        });
        Some(Self { address, stop })
    }

    fn url(&self) -> String {
        format!("http://{}/metrics", self.address)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so that it sees the flag.
        let _ = TcpStream::connect(self.address);
    }
}

fn respond(mut stream: TcpStream, body: &[u8], chunked: bool) {
    // Read the whole request, so closing does not reset the connection.
    let mut request = Vec::new();
    let mut buffer = [0u8; 512];
    while !request.ends_with(b"\r\n\r\n") {
        match stream.read(&mut buffer) {
            Ok(0) | Err(_) => return,
            Ok(n) => request.extend_from_slice(&buffer[..n]),
        }
    }
    let content_type = "Content-Type: text/plain; version=0.0.4; charset=utf-8";
    let mut response = Vec::new();
    if chunked {
        write!(
            response,
            "HTTP/1.1 200 OK\r\n{content_type}\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        .expect("head");
        for chunk in body.chunks(97) {
            write!(response, "{:x}\r\n", chunk.len()).expect("size");
            response.extend_from_slice(chunk);
            response.extend_from_slice(b"\r\n");
        }
        response.extend_from_slice(b"0\r\n\r\n");
    } else {
        write!(
            response,
            "HTTP/1.1 200 OK\r\n{content_type}\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .expect("head");
        response.extend_from_slice(body);
    }
    let _ = stream.write_all(&response);
}

/// The first window with tokens after the start (the server's second exposition).
fn window_after_start(config: PrometheusConfig) -> WorkloadWindow {
    let mut tokens = PrometheusTokens::start(config).expect("starts");
    for _ in 0..1000 {
        let window = tokens.read_window(0).expect("window");
        if window.tokens > 0 {
            return window;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!(
        "no tokens after 1000 windows ({} scrapes failed)",
        tokens.failures()
    );
}

fn config(engine: Engine, server: &Server) -> PrometheusConfig {
    PrometheusConfig {
        period: Duration::from_millis(20),
        ..PrometheusConfig::for_engine(engine, &server.url())
    }
}

fn assert_close(actual: f64, expected: f64, what: &str) {
    assert!(
        (actual - expected).abs() < 1e-9,
        "{what}: {actual} ms, expected {expected} ms"
    );
}

#[test]
fn vllm_engines_are_summed_and_merged_over_a_chunked_response() {
    let Some(dir) = expositions() else { return };
    let bodies = vec![
        read(dir.path(), "vllm-0.prom"),
        read(dir.path(), "vllm-1.prom"),
    ];
    let server = Server::start("127.0.0.1:0", bodies, true).expect("loopback");
    let w = window_after_start(config(Engine::Vllm, &server));
    // Engine 0 made 1000 tokens, engine 1 made 500; the 100 before the start do not count.
    assert_eq!(w.tokens, 1500);
    // Merged buckets: le 0.01 → 100 (engine 1), 0.025 → 180, 0.05 → 200. The p99 rank
    // 198 lies 18/20 into (25, 50] ms: 47.5 ms; the p50 rank 100 ends the first bucket.
    assert_close(w.tpot_p99_ms, 47.5, "p99");
    assert_close(w.tpot_p50_ms, 10.0, "p50");
}

#[test]
fn vllm_times_first_tokens_where_a_ttft_bound_asks() {
    let Some(dir) = expositions() else { return };
    let bodies = vec![
        read(dir.path(), "vllm-0.prom"),
        read(dir.path(), "vllm-1.prom"),
    ];
    // Not read unless asked for: no requests.
    let server = Server::start("127.0.0.1:0", bodies.clone(), false).expect("loopback");
    assert_eq!(
        window_after_start(config(Engine::Vllm, &server)).requests,
        None
    );
    let server = Server::start("127.0.0.1:0", bodies, false).expect("loopback");
    let w = window_after_start(PrometheusConfig {
        request_metrics: Engine::Vllm.request_metrics(),
        ..config(Engine::Vllm, &server)
    });
    let requests = w.requests.expect("requests read");
    // 4096 + 2048 prompt tokens and 30 + 10 first tokens in the window (the 400 and 5
    // before the start do not count).
    assert_eq!((requests.prefill_tokens, requests.first_tokens), (6144, 40));
    // Merged: 30 in (0.08, 0.1] s, 10 in (0.25, 0.5]: the p99 rank 39.6 is 9.6/10 into
    // (0.25, 0.5]: 490 ms.
    assert_close(requests.ttft_p99_ms.expect("a TTFT"), 490.0, "TTFT p99");
    // vLLM knows nothing of the energy each request drew.
    assert_eq!(requests.energy, None);
}

#[test]
fn sglang_over_ipv6_loopback() {
    let Some(dir) = expositions() else { return };
    let bodies = vec![
        read(dir.path(), "sglang-0.prom"),
        read(dir.path(), "sglang-1.prom"),
    ];
    let Some(server) = Server::start("[::1]:0", bodies, false) else {
        return;
    };
    assert!(
        server.url().starts_with("http://[::1]:"),
        "{}",
        server.url()
    );
    let w = window_after_start(config(Engine::Sglang, &server));
    assert_eq!(w.tokens, 300);
    // 90 at 9 ms in (8, 10], 10 at 50 ms in (40, 60]: p99 rank 99 is 9/10 into (40, 60].
    assert_close(w.tpot_p99_ms, 58.0, "p99");
    // p50 rank 50 is 50/90 into (8, 10].
    assert_close(w.tpot_p50_ms, 8.0 + 2.0 * 50.0 / 90.0, "p50");
}

#[test]
fn tgi_counts_finished_requests_tokens_and_their_mean_tpot() {
    let Some(dir) = expositions() else { return };
    let bodies = vec![
        read(dir.path(), "tgi-0.prom"),
        read(dir.path(), "tgi-1.prom"),
    ];
    let server = Server::start("127.0.0.1:0", bodies, false).expect("loopback");
    let w = window_after_start(config(Engine::Tgi, &server));
    assert_eq!(w.tokens, 200 + 300 + 100 + 400);
    // Means 20, 30, 40 ms in (10, 50], 200 ms in (100, 500]: p99 rank 3.96.
    assert_close(w.tpot_p99_ms, 100.0 + 400.0 * 0.96, "p99");
}

#[test]
fn triton_has_tokens_and_an_unknown_tpot() {
    let Some(dir) = expositions() else { return };
    let bodies = vec![
        read(dir.path(), "triton-0.prom"),
        read(dir.path(), "triton-1.prom"),
    ];
    let server = Server::start("127.0.0.1:0", bodies, false).expect("loopback");
    let w = window_after_start(config(Engine::Triton, &server));
    assert_eq!(w.tokens, 200);
    assert!(w.tpot_p99_ms.is_nan(), "unknown, not 0 ms: {w:?}");
}

#[test]
fn llamacpp_counts_predicted_tokens_and_its_latencies_stay_unknown() {
    let Some(dir) = expositions() else { return };
    let bodies = vec![
        read(dir.path(), "llamacpp-0.prom"),
        read(dir.path(), "llamacpp-1.prom"),
    ];
    let server = Server::start("127.0.0.1:0", bodies.clone(), false).expect("loopback");
    let w = window_after_start(config(Engine::Llamacpp, &server));
    // Eight requests of 256 predicted tokens; the probe's 96 before the start do not count,
    // nor do the 1024 prompt tokens.
    assert_eq!(w.tokens, 8 * 256);
    // llama.cpp exports no latency histogram: unknown, not 0 ms.
    assert!(
        w.tpot_p99_ms.is_nan() && w.tpot_p50_ms.is_nan(),
        "unknown, not 0 ms: {w:?}"
    );
    assert_eq!(
        w.requests, None,
        "no TTFT histogram, so no first tokens read"
    );
    // Its prompt counter is read beside a TTFT histogram named for it; one it lacks
    // refuses the start, naming the flag.
    let server = Server::start("127.0.0.1:0", bodies, false).expect("loopback");
    let named = PrometheusConfig {
        request_metrics: tokwatt_engines::prometheus::request_metrics(
            Engine::Llamacpp,
            Some("llamacpp:time_to_first_token_seconds".into()),
            None,
        )
        .expect("a prompt counter"),
        ..config(Engine::Llamacpp, &server)
    };
    let error = PrometheusTokens::start(named)
        .expect_err("no such histogram")
        .to_string();
    assert!(error.contains("--ttft-histogram"), "{error}");
}

#[test]
fn a_named_metric_that_is_missing_refuses_the_start() {
    let Some(dir) = expositions() else { return };
    let server =
        Server::start("127.0.0.1:0", vec![read(dir.path(), "vllm-1.prom")], false).expect("up");
    // The name vLLM deprecated in 0.11: an exposition with only the current names lacks it.
    let deprecated = PrometheusConfig {
        tpot_histogram: Some("vllm:time_per_output_token_seconds".into()),
        ..config(Engine::Vllm, &server)
    };
    let error = PrometheusTokens::start(deprecated)
        .expect_err("refused")
        .to_string();
    assert!(
        error.contains("`vllm:time_per_output_token_seconds`"),
        "{error}"
    );
    assert!(error.contains(&server.url()), "{error}");
    assert!(
        error.contains("vllm:inter_token_latency_seconds_bucket"),
        "{error}"
    );
    let wrong_engine = PrometheusConfig {
        tpot_histogram: None,
        ..config(Engine::Sglang, &server)
    };
    let error = PrometheusTokens::start(wrong_engine)
        .expect_err("refused")
        .to_string();
    assert!(
        error.contains("`sglang:generation_tokens_total`"),
        "{error}"
    );
}

#[test]
fn a_scrape_that_loses_the_metric_is_a_counted_failure_never_a_zero() {
    let Some(dir) = expositions() else { return };
    // The vLLM exposition, then one without any vLLM metric, then vLLM's again.
    let bodies = vec![
        read(dir.path(), "vllm-0.prom"),
        read(dir.path(), "triton-1.prom"),
        read(dir.path(), "vllm-1.prom"),
    ];
    let server = Server::start("127.0.0.1:0", bodies, false).expect("loopback");
    let mut tokens = PrometheusTokens::start(config(Engine::Vllm, &server)).expect("starts");
    let mut total = 0;
    for _ in 0..1000 {
        total += tokens.read_window(0).expect("window").tokens;
        if total > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        tokens.failures() >= 1,
        "the scrape without the metric failed"
    );
    // Read as a counter at zero, the lost scrape would make the next one look like a
    // restart and count all 1600 tokens again; only the 1500 made in between count.
    assert_eq!(total, 1500);
}

#[test]
fn a_tpot_bound_without_a_tpot_histogram_is_refused_naming_the_fix() {
    // Refused before any GPU or endpoint is touched, so this runs without either.
    let spec = repo_root().join("policies/cap-and-batch.toml");
    for extra in [
        &["--engine", "triton"][..],
        &["--engine", "llamacpp"][..],
        &["--tpot-histogram", ""][..],
    ] {
        let output = crate::support::tokwatt()
            .args(["run", "--gpu", "0", "--workload", "external"])
            .args(["--metrics-url", "http://127.0.0.1:9/metrics", "--policy"])
            .arg(&spec)
            .args(extra)
            .output()
            .expect("tokwatt runs");
        let stderr = crate::support::stderr(&output);
        assert!(!output.status.success(), "{stderr}");
        assert!(stderr.contains("tpot_p99_limit_ms"), "{stderr}");
        assert!(stderr.contains("--tpot-histogram"), "{stderr}");
    }
}

#[test]
fn a_ttft_bound_on_llamacpp_is_refused_naming_the_fix() {
    // llama.cpp times no first token: refused before any GPU or endpoint is touched.
    let output = crate::support::tokwatt()
        .args([
            "run",
            "--gpu",
            "0",
            "--workload",
            "external",
            "--engine",
            "llamacpp",
        ])
        .args(["--metrics-url", "http://127.0.0.1:9/metrics"])
        .args(["--ttft-p99-limit-ms", "500", "--policy"])
        .arg(repo_root().join("policies/static.toml"))
        .output()
        .expect("tokwatt runs");
    let stderr = crate::support::stderr(&output);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("--engine llamacpp"), "{stderr}");
    assert!(stderr.contains("--ttft-histogram"), "{stderr}");
}

#[test]
fn an_external_workload_needs_a_gpu_or_the_simulator() {
    let output = crate::support::tokwatt()
        .args(["run", "--workload", "external", "--engine", "llamacpp"])
        .args(["--metrics-url", "http://127.0.0.1:9/metrics", "--policy"])
        .arg(repo_root().join("policies/static.toml"))
        .output()
        .expect("tokwatt runs");
    let stderr = crate::support::stderr(&output);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("--gpu 0") && stderr.contains("--sim h200"),
        "{stderr}"
    );
    // Beside the simulator, only one GPU: the engine's tokens are one GPU's.
    let output = crate::support::tokwatt()
        .args([
            "run",
            "--sim",
            "h200",
            "--gpus",
            "2",
            "--workload",
            "external",
        ])
        .args([
            "--engine",
            "llamacpp",
            "--metrics-url",
            "http://127.0.0.1:9/metrics",
        ])
        .arg("--policy")
        .arg(repo_root().join("policies/static.toml"))
        .output()
        .expect("tokwatt runs");
    let stderr = crate::support::stderr(&output);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("--gpus 1"), "{stderr}");
}
