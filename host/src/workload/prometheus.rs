//! An external token source: a serving engine's Prometheus metrics (vLLM's
//! `vllm:generation_tokens_total` counter and `vllm:time_per_output_token_seconds`
//! histogram by default), so tokwatt can tune a GPU that a running server drives.
//!
//! A thread of its own scrapes the endpoint every period (plain HTTP, as metrics
//! endpoints are), so the control loop never waits on the network; a failed scrape is
//! logged and counted, and the window simply sees no new tokens.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::{Workload, WorkloadError};
use crate::types::WorkloadWindow;

/// Where and what to scrape.
#[derive(Debug, Clone, PartialEq)]
pub struct PrometheusConfig {
    /// `http://host:port/path`.
    pub url: String,
    /// Counter of generated tokens, summed over all its series.
    pub token_counter: String,
    /// Histogram of time per output token, seconds (optional).
    pub tpot_histogram: Option<String>,
    pub period: Duration,
}

impl PrometheusConfig {
    /// vLLM's metric names.
    pub fn vllm(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            token_counter: "vllm:generation_tokens_total".into(),
            tpot_histogram: Some("vllm:time_per_output_token_seconds".into()),
            period: Duration::from_secs(1),
        }
    }
}

/// One scrape, reduced to what the workload window needs.
#[derive(Debug, Clone, Default, PartialEq)]
struct Scrape {
    tokens: f64,
    /// Cumulative histogram buckets (upper bound in seconds, count), sorted by bound.
    tpot_buckets: Vec<(f64, f64)>,
}

#[derive(Debug, Default)]
struct Shared {
    latest: Option<Scrape>,
    failures: u64,
}

/// The external token source, behind the [`Workload`] trait. The batch size belongs to
/// the server: it cannot be changed from here.
#[derive(Debug)]
pub struct PrometheusTokens {
    shared: Arc<Mutex<Shared>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// The scrape the current window started from.
    window_start: Option<Scrape>,
}

impl PrometheusTokens {
    /// Check the endpoint answers with the counter, then start scraping.
    pub fn start(config: PrometheusConfig) -> Result<Self, WorkloadError> {
        let target = Target::parse(&config.url)?;
        let first = scrape(&target, &config)?;
        let shared = Arc::new(Mutex::new(Shared {
            latest: Some(first.clone()),
            failures: 0,
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name("tokwatt-prometheus".into())
            .spawn({
                let shared = Arc::clone(&shared);
                let stop = Arc::clone(&stop);
                move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(config.period);
                        let result = scrape(&target, &config);
                        let mut shared = shared.lock().unwrap_or_else(|e| e.into_inner());
                        match result {
                            Ok(s) => shared.latest = Some(s),
                            Err(e) => {
                                shared.failures += 1;
                                tracing::warn!("scraping {} failed: {e}", config.url);
                            }
                        }
                    }
                }
            })
            .map_err(|e| WorkloadError::Failed(format!("cannot start the scraper thread: {e}")))?;
        Ok(Self {
            shared,
            stop,
            thread: Some(thread),
            window_start: Some(first),
        })
    }

    /// Scrapes that failed since the start.
    pub fn failures(&self) -> u64 {
        self.shared.lock().map_or(0, |s| s.failures)
    }
}

impl Drop for PrometheusTokens {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Workload for PrometheusTokens {
    fn name(&self) -> &'static str {
        "prometheus"
    }
    fn batch_size_max(&self, _gpu: u32) -> u32 {
        1
    }
    fn batch_size(&self, _gpu: u32) -> u32 {
        1
    }
    fn set_batch_size(&mut self, _gpu: u32, _batch: u32) -> Result<(), WorkloadError> {
        Err(WorkloadError::BatchFixed(
            "the serving engine behind the metrics endpoint sets its own batch size".into(),
        ))
    }
    fn read_window(&mut self, gpu: u32) -> Result<WorkloadWindow, WorkloadError> {
        if gpu != 0 {
            return Err(WorkloadError::NoSuchGpu {
                index: gpu,
                count: 1,
            });
        }
        let latest = self
            .shared
            .lock()
            .map_err(|_| WorkloadError::Failed("the scraper thread panicked".into()))?
            .latest
            .clone();
        let (Some(start), Some(end)) = (self.window_start.as_ref(), latest.as_ref()) else {
            return Ok(WorkloadWindow::default());
        };
        let window = window_between(start, end);
        self.window_start = latest;
        Ok(window)
    }
}

fn window_between(start: &Scrape, end: &Scrape) -> WorkloadWindow {
    // A counter that went down was reset (server restart): count from zero.
    let tokens = if end.tokens >= start.tokens {
        end.tokens - start.tokens
    } else {
        end.tokens
    };
    let buckets = bucket_delta(&start.tpot_buckets, &end.tpot_buckets);
    WorkloadWindow {
        tokens: tokens.round() as u64,
        steps: 0,
        tpot_p50_ms: histogram_quantile(&buckets, 0.5).map_or(0.0, |s| s * 1e3),
        tpot_p99_ms: histogram_quantile(&buckets, 0.99).map_or(0.0, |s| s * 1e3),
        active_sequences: 0,
        queue_depth: 0,
        batch_size: 1,
        demand: None,
    }
}

/// The buckets of the window: end minus start, bound by bound (start ignored after a reset).
fn bucket_delta(start: &[(f64, f64)], end: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let reset = end.iter().zip(start).any(|((_, e), (_, s))| e < s);
    end.iter()
        .map(|&(bound, count)| {
            let before = if reset {
                0.0
            } else {
                start
                    .iter()
                    .find(|(b, _)| *b == bound)
                    .map_or(0.0, |&(_, c)| c)
            };
            (bound, (count - before).max(0.0))
        })
        .collect()
}

/// The `q` quantile of cumulative buckets, interpolating linearly inside the bucket, as
/// Prometheus's `histogram_quantile` does. `None` without observations.
fn histogram_quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for &(bound, count) in buckets {
        if count >= rank {
            if bound.is_infinite() {
                // Beyond the last finite bound: the best answer is that bound.
                return Some(lower.0);
            }
            let in_bucket = count - lower.1;
            let fraction = if in_bucket > 0.0 {
                (rank - lower.1) / in_bucket
            } else {
                1.0
            };
            return Some(lower.0 + (bound - lower.0) * fraction);
        }
        lower = (bound, count);
    }
    Some(lower.0)
}

/// Parse the Prometheus text exposition format into what the window needs.
fn parse_exposition(
    text: &str,
    counter: &str,
    histogram: Option<&str>,
) -> Result<Scrape, WorkloadError> {
    let mut tokens = None;
    let mut buckets: HashMap<u64, (f64, f64)> = HashMap::new();
    let bucket_name = histogram.map(|h| format!("{h}_bucket"));
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name_and_labels, rest) = match line.find('{') {
            Some(brace) => {
                let close = line[brace..].find('}').map(|c| brace + c);
                let Some(close) = close else { continue };
                (&line[..=close], &line[close + 1..])
            }
            None => match line.split_once(' ') {
                Some((name, rest)) => (name, rest),
                None => continue,
            },
        };
        let name = name_and_labels.split('{').next().unwrap_or_default();
        let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        if name == counter {
            *tokens.get_or_insert(0.0) += value;
        } else if bucket_name.as_deref() == Some(name) {
            let Some(le) = label(name_and_labels, "le").and_then(|le| parse_bound(&le)) else {
                continue;
            };
            let entry = buckets.entry(le.to_bits()).or_insert((le, 0.0));
            entry.1 += value;
        }
    }
    let tokens = tokens.ok_or_else(|| {
        WorkloadError::Failed(format!(
            "the metrics have no `{counter}` counter: check the URL and the counter name (--token-counter)"
        ))
    })?;
    // A counter is a non-negative, exactly representable count: anything else is a
    // broken or lying endpoint, refused as a failed scrape rather than summed.
    if !(tokens.is_finite() && (0.0..=MAX_PLAUSIBLE_TOKENS).contains(&tokens)) {
        return Err(WorkloadError::Failed(format!(
            "the `{counter}` counter reads {tokens}, which is not a token count (expected a whole number from 0 to 2^53)"
        )));
    }
    let mut tpot_buckets: Vec<(f64, f64)> = buckets.into_values().collect();
    tpot_buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(Scrape {
        tokens,
        tpot_buckets,
    })
}

/// The largest count an `f64` holds exactly (2^53).
const MAX_PLAUSIBLE_TOKENS: f64 = 9_007_199_254_740_992.0;

fn label(name_and_labels: &str, key: &str) -> Option<String> {
    let inner = name_and_labels.split_once('{')?.1.strip_suffix('}')?;
    inner.split(',').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"').to_owned())
    })
}

fn parse_bound(le: &str) -> Option<f64> {
    match le {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        other => other.parse().ok(),
    }
}

/// A plain-HTTP URL, split.
#[derive(Debug, Clone)]
struct Target {
    host_port: String,
    host: String,
    path: String,
}

impl Target {
    fn parse(url: &str) -> Result<Self, WorkloadError> {
        let bad = |why: &str| {
            WorkloadError::Failed(format!(
                "metrics URL `{url}` {why}: write it as http://HOST:PORT/metrics"
            ))
        };
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| bad("is not plain http://"))?;
        let (authority, path) = match rest.find('/') {
            Some(slash) => (&rest[..slash], &rest[slash..]),
            None => (rest, "/metrics"),
        };
        if authority.is_empty() {
            return Err(bad("has no host"));
        }
        let host = authority.split(':').next().unwrap_or(authority).to_owned();
        let host_port = if authority.contains(':') {
            authority.to_owned()
        } else {
            format!("{authority}:80")
        };
        Ok(Self {
            host_port,
            host,
            path: path.to_owned(),
        })
    }
}

fn scrape(target: &Target, config: &PrometheusConfig) -> Result<Scrape, WorkloadError> {
    let failed = |what: &str, e: std::io::Error| {
        WorkloadError::Failed(format!("{what} {}: {e}", config.url))
    };
    let timeout = config.period.max(Duration::from_millis(200));
    let address = target
        .host_port
        .to_socket_addrs()
        .map_err(|e| failed("cannot resolve", e))?
        .next()
        .ok_or_else(|| WorkloadError::Failed(format!("{} resolves to no address", config.url)))?;
    let mut stream = TcpStream::connect_timeout(&address, timeout)
        .map_err(|e| failed("cannot connect to", e))?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| failed("cannot set timeouts for", e))?;
    // HTTP/1.0: the server closes the connection after the body, so reading to the end
    // is the whole response.
    // One write: a server that answers after its first read must see the whole request.
    let request = format!(
        "GET {} HTTP/1.0\r\nHost: {}\r\nAccept: text/plain\r\n\r\n",
        target.path, target.host
    );
    stream
        .write_all(request.as_bytes())
        .map_err(|e| failed("cannot send the request to", e))?;
    let mut response = Vec::new();
    stream
        .take(64 << 20)
        .read_to_end(&mut response)
        .map_err(|e| failed("cannot read", e))?;
    let response = String::from_utf8_lossy(&response);
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| WorkloadError::Failed(format!("{} sent no HTTP response", config.url)))?;
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(WorkloadError::Failed(format!(
            "{} answered `{status}`",
            config.url
        )));
    }
    parse_exposition(
        body,
        &config.token_counter,
        config.tpot_histogram.as_deref(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn absurd_token_counters_are_refused_not_summed() {
        for value in ["NaN", "+Inf", "-5", "1e30"] {
            let text = format!("vllm:generation_tokens_total {value}\n");
            let error =
                parse_exposition(&text, "vllm:generation_tokens_total", None).expect_err(value);
            assert!(error.to_string().contains("not a token count"), "{error}");
        }
        let fine = parse_exposition(
            "vllm:generation_tokens_total 12\n",
            "vllm:generation_tokens_total",
            None,
        )
        .expect("a count");
        assert_eq!(fine.tokens, 12.0);
    }

    const VLLM: &str = r#"# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="llama"} 1000.0
vllm:generation_tokens_total{model_name="other"} 500.0
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.01",model_name="llama"} 10.0
vllm:time_per_output_token_seconds_bucket{le="0.025",model_name="llama"} 90.0
vllm:time_per_output_token_seconds_bucket{le="0.05",model_name="llama"} 100.0
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="llama"} 100.0
vllm:time_per_output_token_seconds_count{model_name="llama"} 100.0
"#;

    #[test]
    fn parses_vllm_metrics() {
        let s = parse_exposition(
            VLLM,
            "vllm:generation_tokens_total",
            Some("vllm:time_per_output_token_seconds"),
        )
        .expect("parses");
        assert_eq!(s.tokens, 1500.0, "all series summed");
        assert_eq!(
            s.tpot_buckets,
            vec![
                (0.01, 10.0),
                (0.025, 90.0),
                (0.05, 100.0),
                (f64::INFINITY, 100.0)
            ]
        );
        let missing = parse_exposition(VLLM, "sglang:tokens", None).expect_err("no counter");
        assert!(missing.to_string().contains("sglang:tokens"), "{missing}");
    }

    #[test]
    fn quantiles_interpolate_within_buckets() {
        let buckets = [
            (0.01, 10.0),
            (0.025, 90.0),
            (0.05, 100.0),
            (f64::INFINITY, 100.0),
        ];
        let p50 = histogram_quantile(&buckets, 0.5).expect("p50");
        // Rank 50 is half-way through the (0.01, 0.025] bucket's 80 observations.
        assert!((p50 - 0.0175).abs() < 1e-12, "{p50}");
        let p99 = histogram_quantile(&buckets, 0.99).expect("p99");
        assert!((p99 - 0.0475).abs() < 1e-12, "{p99}");
        assert_eq!(histogram_quantile(&[(0.01, 0.0)], 0.5), None);
    }

    #[test]
    fn windows_are_differences_and_survive_a_reset() {
        let a = Scrape {
            tokens: 1000.0,
            tpot_buckets: vec![(0.01, 5.0), (f64::INFINITY, 10.0)],
        };
        let b = Scrape {
            tokens: 1600.0,
            tpot_buckets: vec![(0.01, 15.0), (f64::INFINITY, 20.0)],
        };
        let w = window_between(&a, &b);
        assert_eq!(w.tokens, 600);
        assert!(w.tpot_p50_ms > 0.0 && w.tpot_p50_ms <= 10.0, "{w:?}");
        let restarted = Scrape {
            tokens: 40.0,
            tpot_buckets: vec![(0.01, 1.0), (f64::INFINITY, 1.0)],
        };
        assert_eq!(window_between(&b, &restarted).tokens, 40);
    }

    #[test]
    fn bad_urls_are_explained() {
        for url in ["https://x/metrics", "ftp://x", "http:///metrics"] {
            let error = Target::parse(url).expect_err(url);
            assert!(
                error.to_string().contains("http://HOST:PORT/metrics"),
                "{error}"
            );
        }
        let target = Target::parse("http://127.0.0.1:8000").expect("valid");
        assert_eq!(target.path, "/metrics");
    }

    /// A metrics server on loopback whose counter grows by 100 per scrape.
    fn serve(listener: TcpListener, scrapes: u32) {
        for n in 0..scrapes {
            let Ok((mut stream, _)) = listener.accept() else {
                return;
            };
            // Read the whole request, so closing does not reset the connection.
            let mut request = Vec::new();
            let mut chunk = [0u8; 256];
            while !request.ends_with(b"\r\n\r\n") {
                match stream.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&chunk[..n]),
                }
            }
            let body = format!("vllm:generation_tokens_total {}\n", 100 * (n + 1));
            let _ = write!(
                stream,
                "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n{body}"
            );
        }
    }

    #[test]
    fn scrapes_a_live_endpoint_off_the_loop() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}/metrics", listener.local_addr().expect("addr"));
        let server = std::thread::spawn(move || serve(listener, 3));
        let mut config = PrometheusConfig::vllm(&url);
        config.period = Duration::from_millis(20);
        let mut tokens = PrometheusTokens::start(config).expect("starts");
        // Wait (without asserting on time) until the scraper has seen the third value.
        let mut total = 0;
        for _ in 0..500 {
            total += tokens.read_window(0).expect("window").tokens;
            if total >= 200 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            total,
            200,
            "100 → 300 over the scrapes ({} failed)",
            tokens.failures()
        );
        assert!(matches!(
            tokens.set_batch_size(0, 8),
            Err(WorkloadError::BatchFixed(_))
        ));
        drop(tokens);
        let _ = server.join();
    }

    #[test]
    fn a_dead_endpoint_is_a_clear_error_at_start() {
        // Bind then drop: nothing listens on that port any more.
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("port")
            .port();
        let error = PrometheusTokens::start(PrometheusConfig::vllm(&format!(
            "http://127.0.0.1:{port}/metrics"
        )))
        .expect_err("refused");
        assert!(error.to_string().contains("cannot connect"), "{error}");
    }
}
