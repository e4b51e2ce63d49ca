//! An external token source: a serving engine's Prometheus metrics, so tokwatt can
//! tune a GPU that a running server drives. [`Engine`] presets name each engine's
//! generated-token counter, and its time-per-output-token and time-to-first-token
//! histograms where it has them (llama.cpp and Triton have neither: their TPOT is
//! unknown, NaN, and a bound on either latency is refused at the start).
//!
//! A thread of its own scrapes the endpoint every period (plain HTTP, as metrics
//! endpoints are), so the control loop never waits on the network. A metric that is
//! named but missing is an error, never a zero: the first scrape must find every named
//! metric or the run does not start, and a later scrape that lacks one is a counted,
//! logged failure. A window with tokens but no TPOT observation has an unknown TPOT
//! (NaN), not 0 ms.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tokwatt_core::types::{RequestsWindow, WorkloadWindow};
use tokwatt_core::workload::{Workload, WorkloadError};

/// A serving engine whose metric names tokwatt knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Engine {
    #[default]
    Vllm,
    Sglang,
    Tgi,
    Triton,
    /// llama.cpp's `llama-server` (started with `--metrics`).
    Llamacpp,
}

impl Engine {
    pub const ALL: [Engine; 5] = [
        Engine::Vllm,
        Engine::Sglang,
        Engine::Tgi,
        Engine::Triton,
        Engine::Llamacpp,
    ];

    /// Every preset's name, for help texts and errors: `vllm, sglang, tgi, triton or llamacpp`.
    pub fn names() -> String {
        let names: Vec<&str> = Engine::ALL.iter().map(|e| e.name()).collect();
        match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => names.join(""),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
            Engine::Tgi => "tgi",
            Engine::Triton => "triton",
            Engine::Llamacpp => "llamacpp",
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
            // tools/server/server-context.cpp: counter `llamacpp:tokens_predicted_total`,
            // one series, grown as each slot generates (not only when a request ends).
            Engine::Llamacpp => "llamacpp:tokens_predicted_total",
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
            // llama.cpp's /metrics has counters and averages only (seconds spent predicting,
            // `llamacpp:predicted_tokens_seconds`): a mean cannot give a p99.
            Engine::Llamacpp => None,
        }
    }

    /// The counter of prompt tokens, where the engine has one.
    pub fn prompt_counter(self) -> Option<&'static str> {
        match self {
            // vllm/v1/metrics/loggers.py: Counter `vllm:prompt_tokens`.
            Engine::Vllm => Some("vllm:prompt_tokens_total"),
            // sglang/srt/metrics/collector.py.
            Engine::Sglang => Some("sglang:prompt_tokens_total"),
            // TGI and Triton count prompt tokens only in per-request histograms.
            Engine::Tgi | Engine::Triton => None,
            // Prompt tokens processed, the ones reused from the cache not counted
            // (`llamacpp:prompt_tokens_cached_total` has those).
            Engine::Llamacpp => Some("llamacpp:prompt_tokens_total"),
        }
    }

    /// The histogram of time to first token, seconds, where the engine has one.
    pub fn ttft_histogram(self) -> Option<&'static str> {
        match self {
            // vllm/v1/metrics/loggers.py: Histogram `vllm:time_to_first_token_seconds`.
            Engine::Vllm => Some("vllm:time_to_first_token_seconds"),
            // sglang/srt/metrics/collector.py.
            Engine::Sglang => Some("sglang:time_to_first_token_seconds"),
            // TGI times a request's queue, validation and inference, and a batch's
            // prefill, but not a request's first token.
            Engine::Tgi => None,
            // Triton's TensorRT-LLM backend exports no time-to-first-token histogram.
            Engine::Triton => None,
            // llama.cpp counts the seconds spent on prompts (`llamacpp:prompt_seconds_total`),
            // not each request's wait for its first token.
            Engine::Llamacpp => None,
        }
    }

    /// The histogram of time to first token, seconds, and the counter of prompt tokens,
    /// where the engine has both (what a TTFT bound needs).
    pub fn request_metrics(self) -> Option<RequestMetrics> {
        Some(RequestMetrics {
            ttft_histogram: self.ttft_histogram()?.to_owned(),
            prompt_counter: self.prompt_counter()?.to_owned(),
        })
    }
}

/// The request metrics to read: the engine preset's, with a TTFT histogram name
/// (`""`: none) and a prompt counter name replacing its own. A TTFT histogram without a
/// prompt counter (the engine has none, none named) is refused, naming the fix.
pub fn request_metrics(
    engine: Engine,
    ttft_histogram: Option<String>,
    prompt_counter: Option<String>,
) -> Result<Option<RequestMetrics>, String> {
    let ttft = match ttft_histogram {
        Some(name) if name.is_empty() => return Ok(None),
        Some(name) => Some(name),
        None => engine.ttft_histogram().map(str::to_owned),
    };
    let Some(ttft_histogram) = ttft else {
        return Ok(None);
    };
    // The preset's prompt counter serves a named TTFT histogram too (llama.cpp has the
    // counter but no histogram).
    let prompt_counter = prompt_counter
        .or_else(|| engine.prompt_counter().map(str::to_owned))
        .ok_or_else(|| {
            format!(
                "a TTFT histogram (`{ttft_histogram}`) needs the engine's prompt-token counter too: \
                 name it (prompt_counter, --prompt-counter), or give the TTFT histogram as \"\" to read none"
            )
        })?;
    Ok(Some(RequestMetrics {
        ttft_histogram,
        prompt_counter,
    }))
}

/// The metrics a serving engine's requests are read from: time to first token and the
/// prompt tokens it prefilled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestMetrics {
    /// Histogram of time to first token, seconds, merged over its series.
    pub ttft_histogram: String,
    /// Counter of prompt tokens, summed over its series.
    pub prompt_counter: String,
}

impl std::str::FromStr for Engine {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Engine::ALL
            .into_iter()
            .find(|e| e.name() == text)
            .ok_or_else(|| format!("unknown engine `{text}`: expected {}", Engine::names()))
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
    /// Time to first token and prompt tokens (optional: without them the workload reports
    /// no requests, and a TTFT bound is refused).
    pub request_metrics: Option<RequestMetrics>,
    pub period: Duration,
}

impl PrometheusConfig {
    /// The metric names of `engine`.
    pub fn for_engine(engine: Engine, url: &str) -> Self {
        Self {
            url: url.to_owned(),
            token_counter: engine.token_counter().into(),
            tpot_histogram: engine.tpot_histogram().map(str::to_owned),
            // Read only where asked for (a TTFT bound): `engine.request_metrics()`.
            request_metrics: None,
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
    /// Where the requests are read: prompt tokens and time-to-first-token buckets.
    requests: Option<RequestScrape>,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct RequestScrape {
    prompt_tokens: f64,
    ttft_buckets: Vec<(f64, f64)>,
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

    /// Whether the windows carry requests (the engine's TTFT histogram is read).
    pub fn reads_requests(&self) -> bool {
        self.window_start
            .as_ref()
            .is_some_and(|scrape| scrape.requests.is_some())
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
    /// The engine's token counter says nothing of requests waiting.
    fn work_waiting(&self) -> tokwatt_core::workload::WorkWaiting {
        tokwatt_core::workload::WorkWaiting::Unknown
    }
    /// Where the engine's time-to-first-token histogram is read.
    fn reports_ttft(&self) -> bool {
        self.reads_requests()
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
        requests: match (&start.requests, &end.requests) {
            (Some(start), Some(end)) => Some(requests_between(start, end)),
            _ => None,
        },
    }
}

/// Prompt tokens and first tokens between two scrapes. The engine knows neither the
/// share of its time spent on prompts nor each request's energy: those stay `None`.
fn requests_between(start: &RequestScrape, end: &RequestScrape) -> RequestsWindow {
    let prompt_tokens = if end.prompt_tokens >= start.prompt_tokens {
        end.prompt_tokens - start.prompt_tokens
    } else {
        end.prompt_tokens
    };
    let buckets = bucket_delta(&start.ttft_buckets, &end.ttft_buckets);
    // The +Inf bucket counts every observation: the first tokens in the window.
    let first_tokens = buckets.last().map_or(0.0, |&(_, count)| count);
    RequestsWindow {
        prefill_tokens: prompt_tokens.round() as u64,
        first_tokens: first_tokens.round() as u64,
        ttft_p99_ms: (first_tokens > 0.0)
            .then(|| histogram_quantile(&buckets, 0.99).map(|s| s * 1e3))
            .flatten(),
        prefill_time_share: None,
        preemptions: None,
        energy: None,
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

mod http;
mod parse;
#[cfg(test)]
mod tests;

use http::{Target, scrape};
use parse::*;
