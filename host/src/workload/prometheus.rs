//! An external token source: a serving engine's Prometheus metrics, so tokwatt can
//! tune a GPU that a running server drives. [`Engine`] presets name each engine's
//! generated-token counter and time-per-output-token histogram.
//!
//! A thread of its own scrapes the endpoint every period (plain HTTP, as metrics
//! endpoints are), so the control loop never waits on the network. A metric that is
//! named but missing is an error, never a zero: the first scrape must find every named
//! metric or the run does not start, and a later scrape that lacks one is a counted,
//! logged failure. A window with tokens but no TPOT observation has an unknown TPOT
//! (NaN), not 0 ms.

use std::collections::{BTreeSet, HashMap};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::{Workload, WorkloadError};
use crate::types::WorkloadWindow;

/// A serving engine whose metric names tokwatt knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Engine {
    #[default]
    Vllm,
    Sglang,
    Tgi,
    Triton,
}

impl Engine {
    pub const ALL: [Engine; 4] = [Engine::Vllm, Engine::Sglang, Engine::Tgi, Engine::Triton];

    pub fn name(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
            Engine::Tgi => "tgi",
            Engine::Triton => "triton",
        }
    }

    /// The series summed for generated tokens (from each project's metric definitions).
    pub fn token_counter(self) -> &'static str {
        match self {
            // vllm/v1/metrics/loggers.py: Counter `vllm:generation_tokens`, labels
            // model_name and engine (one series per engine core).
            Engine::Vllm => "vllm:generation_tokens_total",
            // sglang/srt/metrics/collector.py.
            Engine::Sglang => "sglang:generation_tokens_total",
            // TGI has no token counter: the per-request histogram's sum grows by each
            // request's generated tokens when it finishes.
            Engine::Tgi => "tgi_request_generated_tokens_sum",
            // Triton's TensorRT-LLM backend: histogram `nv_llm_output_token_len`,
            // response_metric_type="total_output_tokens"; its sum counts finished requests' tokens.
            Engine::Triton => "nv_llm_output_token_len_sum",
        }
    }

    /// The histogram of time per output token, seconds, where the engine has one.
    pub fn tpot_histogram(self) -> Option<&'static str> {
        match self {
            // Replaces `vllm:time_per_output_token_seconds`, deprecated in vLLM 0.11:
            // one observation per token gap, which is what a p99 TPOT bound means.
            Engine::Vllm => Some("vllm:inter_token_latency_seconds"),
            Engine::Sglang => Some("sglang:inter_token_latency_seconds"),
            // One observation per finished request: its mean time per token.
            Engine::Tgi => Some("tgi_request_mean_time_per_token_duration"),
            // Triton and its TensorRT-LLM backend export no per-token latency histogram.
            Engine::Triton => None,
        }
    }
}

impl std::str::FromStr for Engine {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Engine::ALL
            .into_iter()
            .find(|e| e.name() == text)
            .ok_or_else(|| format!("unknown engine `{text}`: expected vllm, sglang, tgi or triton"))
    }
}

/// Where and what to scrape.
#[derive(Debug, Clone, PartialEq)]
pub struct PrometheusConfig {
    /// `http://host:port/path` (IPv6 hosts in brackets: `http://[::1]:8000/metrics`).
    pub url: String,
    /// Counter of generated tokens, summed over all its series.
    pub token_counter: String,
    /// Histogram of time per output token, seconds, merged over all its series
    /// (optional: without it the TPOT is unknown).
    pub tpot_histogram: Option<String>,
    pub period: Duration,
}

impl PrometheusConfig {
    /// The metric names of `engine`.
    pub fn for_engine(engine: Engine, url: &str) -> Self {
        Self {
            url: url.to_owned(),
            token_counter: engine.token_counter().into(),
            tpot_histogram: engine.tpot_histogram().map(str::to_owned),
            period: Duration::from_secs(1),
        }
    }

    /// vLLM's metric names.
    pub fn vllm(url: &str) -> Self {
        Self::for_engine(Engine::Vllm, url)
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

/// [`Workload::name`] of the external token source (the run's `meta.workload`).
pub const WORKLOAD_NAME: &str = "prometheus";

impl Workload for PrometheusTokens {
    fn name(&self) -> &'static str {
        WORKLOAD_NAME
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
    // Tokens without a TPOT observation: the TPOT is unknown (NaN), which is not 0 ms.
    // A window without tokens reads 0 ms, as every workload reports an empty window (and
    // the objective does not judge latency without tokens), so policies never see a NaN
    // on the ticks between two scrapes.
    let unknown = if tokens > 0.0 { f64::NAN } else { 0.0 };
    let ms = |q| histogram_quantile(&buckets, q).map_or(unknown, |s| s * 1e3);
    WorkloadWindow {
        tokens: tokens.round() as u64,
        steps: 0,
        tpot_p50_ms: ms(0.5),
        tpot_p99_ms: ms(0.99),
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

/// The `q` quantile of cumulative buckets sorted by bound, as Prometheus's
/// `histogram_quantile` computes it: linear interpolation inside the bucket the rank
/// falls in (the first bucket starts at 0); a rank in the +Inf bucket answers the
/// largest finite bound; counts that decrease are raised to stay monotonic. `None`
/// without observations or without a +Inf bucket (Prometheus's NaN).
fn histogram_quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    if q.is_nan() {
        return None;
    }
    if q < 0.0 {
        return Some(f64::NEG_INFINITY);
    }
    if q > 1.0 {
        return Some(f64::INFINITY);
    }
    if buckets.len() < 2
        || buckets
            .last()
            .is_none_or(|(bound, _)| *bound != f64::INFINITY)
    {
        return None;
    }
    let mut monotonic = buckets.to_vec();
    for i in 1..monotonic.len() {
        if monotonic[i].1 < monotonic[i - 1].1 {
            monotonic[i].1 = monotonic[i - 1].1;
        }
    }
    let total = monotonic.last()?.1;
    if total <= 0.0 || total.is_nan() {
        return None;
    }
    let rank = q * total;
    let index = monotonic.iter().position(|&(_, count)| count >= rank)?;
    if index == monotonic.len() - 1 {
        return Some(monotonic[monotonic.len() - 2].0);
    }
    let (upper, count) = monotonic[index];
    if index == 0 && upper <= 0.0 {
        return Some(upper);
    }
    let (lower, below) = if index == 0 {
        (0.0, 0.0)
    } else {
        monotonic[index - 1]
    };
    let in_bucket = count - below;
    let fraction = if in_bucket > 0.0 {
        (rank - below) / in_bucket
    } else {
        1.0
    };
    Some(lower + (upper - lower) * fraction)
}

/// One sample line of the text exposition format.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

/// Parse one sample line: `name{label="value",...} value [timestamp] [# exemplar]`.
/// Label values may hold commas, braces and the escapes `\"`, `\\` and `\n`. `None`
/// for comments, blank lines and lines that are not samples.
fn parse_sample(line: &str) -> Option<Sample> {
    let line = line.trim_start();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        let mut chars = after_brace.char_indices().peekable();
        let mut key = String::new();
        let consumed = loop {
            let (i, c) = chars.next()?;
            match c {
                '}' => break i + 1,
                ',' | ' ' | '\t' => {}
                '=' => {
                    // The value: a quoted string with escapes.
                    while chars.peek().is_some_and(|(_, c)| c.is_whitespace()) {
                        chars.next();
                    }
                    if chars.next()?.1 != '"' {
                        return None;
                    }
                    let mut value = String::new();
                    loop {
                        match chars.next()?.1 {
                            '"' => break,
                            '\\' => match chars.next()?.1 {
                                'n' => value.push('\n'),
                                other => value.push(other),
                            },
                            other => value.push(other),
                        }
                    }
                    labels.push((std::mem::take(&mut key).trim().to_owned(), value));
                }
                other => key.push(other),
            }
        };
        rest = &after_brace[consumed..];
    }
    // The value; a timestamp and an exemplar (`# {...} value`) may follow: ignored.
    let value = parse_float(rest.split_whitespace().next()?)?;
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// A sample value as the format writes it, `+Inf`, `-Inf` and `NaN` included.
fn parse_float(text: &str) -> Option<f64> {
    match text {
        "+Inf" | "Inf" | "+inf" | "inf" => Some(f64::INFINITY),
        "-Inf" | "-inf" => Some(f64::NEG_INFINITY),
        "NaN" | "nan" => Some(f64::NAN),
        other => other.parse().ok(),
    }
}

/// Parse the Prometheus text exposition format into what the window needs: the counter
/// summed over all its series, the histogram merged bucket by bound over all its series
/// (several engines, several models). A named metric that is absent is an error naming
/// it and the similar names the exposition does have.
fn parse_exposition(
    text: &str,
    counter: &str,
    histogram: Option<&str>,
) -> Result<Scrape, WorkloadError> {
    let mut tokens = None;
    let mut buckets: HashMap<u64, (f64, f64)> = HashMap::new();
    let bucket_name = histogram.map(|h| format!("{h}_bucket"));
    let mut names_seen = BTreeSet::new();
    // A family declared by `# TYPE` but without series yet (a labelled metric before its
    // first observation, as prometheus_client writes it) is present, at zero.
    let mut declared = BTreeSet::new();
    for line in text.lines() {
        if let Some(declaration) = line.trim_start().strip_prefix("# TYPE ")
            && let Some(name) = declaration.split_whitespace().next()
        {
            declared.insert(name.to_owned());
        }
    }
    if declared.contains(counter) {
        tokens = Some(0.0);
    }
    for sample in text.lines().filter_map(parse_sample) {
        if sample.name == counter {
            *tokens.get_or_insert(0.0) += sample.value;
        } else if bucket_name.as_deref() == Some(sample.name.as_str()) {
            let Some(le) = sample
                .labels
                .iter()
                .find(|(k, _)| k == "le")
                .and_then(|(_, le)| parse_float(le))
            else {
                continue;
            };
            let entry = buckets.entry(le.to_bits()).or_insert((le, 0.0));
            entry.1 += sample.value;
        }
        names_seen.insert(sample.name);
    }
    let tokens = tokens.ok_or_else(|| missing(counter, "--token-counter", &names_seen))?;
    // A counter is a non-negative, exactly representable count: anything else is a
    // broken or lying endpoint, refused as a failed scrape rather than summed.
    if !(tokens.is_finite() && (0.0..=MAX_PLAUSIBLE_TOKENS).contains(&tokens)) {
        return Err(WorkloadError::Failed(format!(
            "the `{counter}` counter reads {tokens}, which is not a token count (expected a whole number from 0 to 2^53)"
        )));
    }
    if let Some(histogram) = histogram
        && buckets.is_empty()
        && !declared.contains(histogram)
    {
        return Err(missing(histogram, "--tpot-histogram", &names_seen));
    }
    let mut tpot_buckets: Vec<(f64, f64)> = buckets.into_values().collect();
    tpot_buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(Scrape {
        tokens,
        tpot_buckets,
    })
}

/// The error for a named metric the exposition lacks, with the names it has that share
/// at least two words with it (`vllm:inter_token_latency_seconds` for the deprecated
/// `vllm:time_per_output_token_seconds`).
fn missing(wanted: &str, flag: &str, names_seen: &BTreeSet<String>) -> WorkloadError {
    let words = |name: &str| -> BTreeSet<String> {
        name.split([':', '_'])
            .filter(|w| w.len() >= 4)
            .map(str::to_owned)
            .collect()
    };
    let wanted_words = words(wanted);
    let similar: Vec<&str> = names_seen
        .iter()
        .filter(|name| words(name).intersection(&wanted_words).count() >= 2)
        .map(String::as_str)
        .take(12)
        .collect();
    let similar = if similar.is_empty() {
        "none".to_owned()
    } else {
        similar.join(", ")
    };
    WorkloadError::Failed(format!(
        "the metrics have no `{wanted}` (similar names there: {similar}): pick the engine with --engine or name the metric with {flag}"
    ))
}

/// The largest count an `f64` holds exactly (2^53).
const MAX_PLAUSIBLE_TOKENS: f64 = 9_007_199_254_740_992.0;

/// A plain-HTTP URL, split.
#[derive(Debug, Clone)]
struct Target {
    /// What to connect to: `host:port`, `[v6]:port`.
    host_port: String,
    /// The Host header: the authority as written.
    host: String,
    path: String,
}

impl Target {
    fn parse(url: &str) -> Result<Self, WorkloadError> {
        let bad = |why: &str| {
            WorkloadError::Failed(format!(
                "metrics URL `{url}` {why}: write it as http://HOST:PORT/metrics (IPv6: http://[::1]:PORT/metrics)"
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
        let has_port = match authority.strip_prefix('[') {
            // An IPv6 literal: the port follows the closing bracket.
            Some(v6) => {
                let (_, after) = v6
                    .split_once(']')
                    .ok_or_else(|| bad("opens an IPv6 bracket it does not close"))?;
                if !(after.is_empty() || after.starts_with(':')) {
                    return Err(bad("has text after its IPv6 host"));
                }
                !after.is_empty()
            }
            None => authority.contains(':'),
        };
        let host_port = if has_port {
            authority.to_owned()
        } else {
            format!("{authority}:80")
        };
        Ok(Self {
            host_port,
            host: authority.to_owned(),
            path: path.to_owned(),
        })
    }
}

/// The body of an HTTP/1.1 response, with `Transfer-Encoding: chunked` decoded.
fn response_body(response: &[u8], url: &str) -> Result<Vec<u8>, WorkloadError> {
    let failed = |why: &str| WorkloadError::Failed(format!("{url} {why}"));
    let head_end = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| failed("sent no HTTP response"))?;
    let head = String::from_utf8_lossy(&response[..head_end]);
    let body = &response[head_end + 4..];
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(failed(&format!("answered `{status}`")));
    }
    let chunked = head.lines().skip(1).any(|line| {
        line.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("transfer-encoding")
                && v.to_ascii_lowercase().contains("chunked")
        })
    });
    if !chunked {
        return Ok(body.to_vec());
    }
    let mut decoded = Vec::new();
    let mut rest = body;
    loop {
        let line_end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| failed("sent a chunked body cut short"))?;
        let size_line = String::from_utf8_lossy(&rest[..line_end]);
        // A chunk size may carry extensions after `;`.
        let size_hex = size_line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_hex, 16)
            .map_err(|_| failed(&format!("sent a bad chunk size `{size_hex}`")))?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok(decoded);
        }
        let chunk = rest
            .get(..size)
            .ok_or_else(|| failed("sent a chunked body cut short"))?;
        decoded.extend_from_slice(chunk);
        rest = rest.get(size + 2..).unwrap_or_default();
    }
}

fn scrape(target: &Target, config: &PrometheusConfig) -> Result<Scrape, WorkloadError> {
    let failed = |what: &str, e: std::io::Error| {
        WorkloadError::Failed(format!("{what} {}: {e}", config.url))
    };
    // At least a second: a busy engine (or a loaded test machine) may answer late, and a
    // late answer only delays the scraper thread, never the control loop.
    let timeout = config.period.max(Duration::from_secs(1));
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
    // `Connection: close`: the server closes the connection after the body, so reading
    // to the end is the whole response (chunked or not). No Accept-Encoding: plain text.
    // One write: a server that answers after its first read must see the whole request.
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n",
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
    let body = response_body(&response, &config.url)?;
    parse_exposition(
        &String::from_utf8_lossy(&body),
        &config.token_counter,
        config.tpot_histogram.as_deref(),
    )
    .map_err(|e| match e {
        WorkloadError::Failed(why) => WorkloadError::Failed(format!("{}: {why}", config.url)),
        other => other,
    })
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

    #[test]
    fn ipv6_hosts_keep_their_brackets() {
        let target = Target::parse("http://[::1]:8000/metrics").expect("valid");
        assert_eq!(
            (target.host_port.as_str(), target.path.as_str()),
            ("[::1]:8000", "/metrics")
        );
        let default_port = Target::parse("http://[::1]/m").expect("valid");
        assert_eq!(default_port.host_port, "[::1]:80");
        for url in ["http://[::1:8000/metrics", "http://[::1]x:8000/"] {
            assert!(Target::parse(url).is_err(), "{url}");
        }
    }

    #[test]
    fn label_values_may_hold_commas_braces_and_escapes() {
        let line = r#"m_bucket{path="/a,b}{c",quote="say \"hi\"",slash="a\\b",nl="x\ny",le="0.5"} 7 1700000000000 # {trace_id="1"} 0.4"#;
        let sample = parse_sample(line).expect("a sample");
        assert_eq!(sample.name, "m_bucket");
        assert_eq!(sample.value, 7.0);
        let label = |k: &str| {
            sample
                .labels
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(label("path").as_deref(), Some("/a,b}{c"));
        assert_eq!(label("quote").as_deref(), Some("say \"hi\""));
        assert_eq!(label("slash").as_deref(), Some("a\\b"));
        assert_eq!(label("nl").as_deref(), Some("x\ny"));
        assert_eq!(label("le").as_deref(), Some("0.5"));
        assert!(parse_sample("# HELP m help text {with braces}").is_none());
        assert!(parse_sample("# TYPE m counter").is_none());
        assert!(parse_sample("m NaN").expect("NaN").value.is_nan());
        assert_eq!(parse_sample("m +Inf").expect("inf").value, f64::INFINITY);
        assert!(parse_sample(r#"m{a="unterminated} 1"#).is_none());
    }

    #[test]
    fn a_named_histogram_that_is_missing_is_an_error_naming_it_and_its_neighbours() {
        let text = "vllm:generation_tokens_total{engine=\"0\"} 5\n\
                    vllm:inter_token_latency_seconds_bucket{le=\"+Inf\"} 1\n\
                    vllm:request_time_per_output_token_seconds_bucket{le=\"+Inf\"} 1\n\
                    vllm:num_requests_running 1\n";
        let error = parse_exposition(
            text,
            "vllm:generation_tokens_total",
            Some("vllm:time_per_output_token_seconds"),
        )
        .expect_err("missing histogram")
        .to_string();
        assert!(
            error.contains("`vllm:time_per_output_token_seconds`"),
            "{error}"
        );
        assert!(
            error.contains("vllm:inter_token_latency_seconds_bucket"),
            "{error}"
        );
        assert!(
            error.contains("vllm:request_time_per_output_token_seconds_bucket"),
            "{error}"
        );
        assert!(!error.contains("num_requests_running"), "{error}");
        assert!(error.contains("--tpot-histogram"), "{error}");
    }

    #[test]
    fn a_declared_family_without_series_is_present_at_zero() {
        let text = "# HELP sglang:generation_tokens_total Tokens.\n\
                    # TYPE sglang:generation_tokens_total counter\n\
                    # TYPE sglang:inter_token_latency_seconds histogram\n";
        let scrape = parse_exposition(
            text,
            "sglang:generation_tokens_total",
            Some("sglang:inter_token_latency_seconds"),
        )
        .expect("present, without observations");
        assert_eq!(scrape, Scrape::default());
        // A histogram's TYPE line does not stand in for a different name.
        assert!(parse_exposition(text, "sglang:generation_tokens_total", Some("other")).is_err());
    }

    #[test]
    fn a_window_without_tpot_observations_has_an_unknown_tpot() {
        let a = Scrape {
            tokens: 10.0,
            tpot_buckets: vec![(0.01, 5.0), (f64::INFINITY, 5.0)],
        };
        let b = Scrape {
            tokens: 20.0,
            ..a.clone()
        };
        let w = window_between(&a, &b);
        assert_eq!(w.tokens, 10);
        assert!(w.tpot_p50_ms.is_nan() && w.tpot_p99_ms.is_nan(), "{w:?}");
        // Without tokens there is no token latency to know: 0 ms, as for any empty window.
        let idle = window_between(&b, &b);
        assert_eq!((idle.tokens, idle.tpot_p99_ms), (0, 0.0));
    }

    #[test]
    fn quantiles_follow_prometheus_rules() {
        // A rank in the +Inf bucket reads the largest finite bound.
        let tail = [(0.01, 1.0), (0.025, 2.0), (f64::INFINITY, 100.0)];
        assert_eq!(histogram_quantile(&tail, 0.99), Some(0.025));
        // Without a +Inf bucket Prometheus answers NaN.
        assert_eq!(histogram_quantile(&[(0.01, 1.0), (0.025, 2.0)], 0.5), None);
        // All observations under vLLM's first bound (10 ms) read as ~9.9 ms at p99.
        let fast = [(0.01, 100.0), (0.025, 100.0), (f64::INFINITY, 100.0)];
        let p99 = histogram_quantile(&fast, 0.99).expect("p99");
        assert!((p99 - 0.0099).abs() < 1e-12, "{p99}");
        // Decreasing counts are raised to stay monotonic.
        let bumpy = [(0.01, 10.0), (0.025, 8.0), (f64::INFINITY, 10.0)];
        let p50 = histogram_quantile(&bumpy, 0.5).expect("p50");
        assert!((p50 - 0.005).abs() < 1e-12, "{p50}");
        assert_eq!(histogram_quantile(&fast, 1.5), Some(f64::INFINITY));
    }

    #[test]
    fn chunked_bodies_are_decoded() {
        let response = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                         5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n";
        let body = response_body(response, "http://x").expect("decoded");
        assert_eq!(body, b"hello, world");
        let cut = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nff\r\nshort";
        assert!(response_body(cut, "http://x").is_err());
        let status = b"HTTP/1.1 404 Not Found\r\n\r\n";
        let error = response_body(status, "http://x").expect_err("404");
        assert!(error.to_string().contains("404"), "{error}");
    }

    #[test]
    fn engine_presets_parse_by_name() {
        for engine in Engine::ALL {
            assert_eq!(engine.name().parse::<Engine>(), Ok(engine));
        }
        assert!("llamacpp".parse::<Engine>().is_err());
        assert_eq!(Engine::Triton.tpot_histogram(), None);
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
        config.tpot_histogram = None;
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
