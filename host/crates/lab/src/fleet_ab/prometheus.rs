//! A Prometheus server's HTTP API (`/api/v1`), read with hyper's HTTP/1.1 client on a
//! small runtime of its own: its clock, its targets, and a series' raw samples.

use std::collections::BTreeMap;
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper::{Request, header};
use hyper_util::rt::TokioIo;

use super::counters::{Series, Window};
use super::nodes::Selector;

/// How long one request may take.
const TIMEOUT: Duration = Duration::from_secs(30);
/// The largest answer read: a window of one node's series is far smaller.
const MAX_ANSWER_BYTES: usize = 64 * 1024 * 1024;

/// Why Prometheus could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PrometheusError {
    #[error("--prometheus {url}: {why}")]
    BadUrl { url: String, why: String },
    #[error("cannot reach Prometheus at {url}: {why} (is it running, and is this its address?)")]
    Unreachable { url: String, why: String },
    #[error("Prometheus at {url} answered {status}: {message}")]
    Refused {
        url: String,
        status: u16,
        message: String,
    },
    #[error("Prometheus at {url} answered something else than its API's JSON: {why}")]
    Answer { url: String, why: String },
    #[error("cannot start the Prometheus client's runtime: {0}")]
    Runtime(std::io::Error),
}

/// One target Prometheus scrapes, as its targets page shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ScrapeTarget {
    /// Its labels after relabelling: what its series carry.
    pub labels: BTreeMap<String, String>,
    pub scrape_url: String,
    pub scrape_interval_s: Option<f64>,
    /// `up`, `down` or `unknown` (not scraped yet).
    pub health: String,
    pub last_error: String,
}

/// A Prometheus server's API.
#[derive(Debug)]
pub struct Prometheus {
    url: String,
    /// `host:port`, to connect to; also the Host header.
    authority: String,
    /// The route prefix (`--web.route-prefix`), without a trailing slash.
    prefix: String,
    runtime: tokio::runtime::Runtime,
}

impl Prometheus {
    /// The server at `url`: `http://HOST:PORT`, with its route prefix if it has one.
    pub fn new(url: &str) -> Result<Self, PrometheusError> {
        let bad = |why: &str| PrometheusError::BadUrl {
            url: url.to_owned(),
            why: why.to_owned(),
        };
        let uri: hyper::Uri = url
            .parse()
            .map_err(|_| bad("not a URL; write it as http://HOST:9090"))?;
        if uri.scheme_str() != Some("http") {
            return Err(bad(
                "only plain http:// is read; reach an https Prometheus through a local proxy or port forward",
            ));
        }
        if uri.query().is_some() {
            return Err(bad("give the server's address without a query"));
        }
        let authority = uri
            .authority()
            .ok_or_else(|| bad("no host; write it as http://HOST:9090"))?;
        if authority.as_str().contains('@') {
            return Err(bad("credentials in the URL are not sent"));
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(PrometheusError::Runtime)?;
        Ok(Self {
            url: url.trim_end_matches('/').to_owned(),
            authority: format!(
                "{}:{}",
                authority.host(),
                authority.port_u16().unwrap_or(80)
            ),
            prefix: uri.path().trim_end_matches('/').to_owned(),
            runtime,
        })
    }

    /// The server's clock, unix seconds: windows are laid on it, since its scrapes are
    /// timestamped by it.
    pub fn now_s(&self) -> Result<f64, PrometheusError> {
        let data = self.get("/api/v1/query", &[("query", "time()")])?;
        data["result"][0]
            .as_f64()
            .ok_or_else(|| self.answer("time() gave no scalar"))
    }

    /// The targets it scrapes now.
    pub fn targets(&self) -> Result<Vec<ScrapeTarget>, PrometheusError> {
        let data = self.get("/api/v1/targets", &[("state", "active")])?;
        let targets = data["activeTargets"]
            .as_array()
            .ok_or_else(|| self.answer("the targets answer has no activeTargets"))?;
        Ok(targets
            .iter()
            .map(|target| ScrapeTarget {
                labels: string_map(&target["labels"]),
                scrape_url: target["scrapeUrl"].as_str().unwrap_or_default().to_owned(),
                scrape_interval_s: target["scrapeInterval"]
                    .as_str()
                    .and_then(parse_prometheus_duration),
                health: target["health"].as_str().unwrap_or_default().to_owned(),
                last_error: target["lastError"].as_str().unwrap_or_default().to_owned(),
            })
            .collect())
    }

    /// Every sample of `metric`'s series selected by `selector` in `window` (and up to a
    /// second before it: the caller picks the scrapes it needs).
    pub fn samples(
        &self,
        metric: &str,
        selector: &Selector,
        window: Window,
    ) -> Result<Vec<Series>, PrometheusError> {
        // A range selector evaluated at the window's end gives the raw samples.
        let range_ms = ((window.seconds() + 1.0) * 1000.0).ceil().max(1.0) as u64;
        let query = format!("{metric}{{{}}}[{range_ms}ms]", selector.promql());
        let time = format!("{:.3}", window.end_s);
        let data = self.get("/api/v1/query", &[("query", &query), ("time", &time)])?;
        let result = data["result"]
            .as_array()
            .ok_or_else(|| self.answer("a range query gave no matrix"))?;
        result
            .iter()
            .map(|series| {
                let samples = series["values"]
                    .as_array()
                    .ok_or_else(|| self.answer("a series has no values"))?
                    .iter()
                    .map(|pair| {
                        let t = pair[0].as_f64();
                        let v = pair[1].as_str().and_then(|v| v.parse::<f64>().ok());
                        t.zip(v)
                            .ok_or_else(|| self.answer("a sample is not [time, \"value\"]"))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Series {
                    labels: string_map(&series["metric"]),
                    samples,
                })
            })
            .collect()
    }

    fn answer(&self, why: &str) -> PrometheusError {
        PrometheusError::Answer {
            url: self.url.clone(),
            why: why.to_owned(),
        }
    }

    /// GET `path` with `query`; the `data` of a `success` answer.
    fn get(
        &self,
        path: &str,
        query: &[(&str, &str)],
    ) -> Result<serde_json::Value, PrometheusError> {
        let query: Vec<String> = query
            .iter()
            .map(|(key, value)| format!("{key}={}", percent_encode(value)))
            .collect();
        let target = format!("{}{path}?{}", self.prefix, query.join("&"));
        let (status, body) = self.runtime.block_on(async {
            tokio::time::timeout(TIMEOUT, self.exchange(&target))
                .await
                .map_err(|_| PrometheusError::Unreachable {
                    url: self.url.clone(),
                    why: format!("no answer within {TIMEOUT:?}"),
                })?
        })?;
        let value: serde_json::Value = serde_json::from_slice(&body).map_err(|error| {
            if status.is_success() {
                self.answer(&format!("{error}"))
            } else {
                PrometheusError::Refused {
                    url: self.url.clone(),
                    status: status.as_u16(),
                    message: String::from_utf8_lossy(&body).chars().take(512).collect(),
                }
            }
        })?;
        if value["status"] != "success" {
            return Err(PrometheusError::Refused {
                url: self.url.clone(),
                status: status.as_u16(),
                message: value["error"]
                    .as_str()
                    .unwrap_or("an error without a message")
                    .chars()
                    .take(512)
                    .collect(),
            });
        }
        Ok(value["data"].clone())
    }

    async fn exchange(&self, target: &str) -> Result<(hyper::StatusCode, Bytes), PrometheusError> {
        let unreachable = |why: String| PrometheusError::Unreachable {
            url: self.url.clone(),
            why,
        };
        let stream = tokio::net::TcpStream::connect(self.authority.as_str())
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        // The connection runs beside the request and ends with it.
        let mut connection_task = tokio::task::JoinSet::new();
        connection_task.spawn(connection);
        let request = Request::get(target)
            .header(header::HOST, self.authority.as_str())
            .header(header::ACCEPT, "application/json")
            .header(header::CONNECTION, "close")
            .body(Empty::<Bytes>::new())
            .map_err(|e| unreachable(format!("the request could not be built: {e}")))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| unreachable(format!("the answer could not be read: {e}")))?
            .to_bytes();
        Ok((status, body))
    }
}

fn string_map(value: &serde_json::Value) -> BTreeMap<String, String> {
    value
        .as_object()
        .map(|object| {
            object
                .iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

/// A query string value, percent-encoded but for the unreserved characters.
fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus duration (`15s`, `1m30s`, `500ms`, `1h`), in seconds.
pub fn parse_prometheus_duration(text: &str) -> Option<f64> {
    let mut total = 0.0;
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit())?;
        if digits == 0 {
            return None;
        }
        let number: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let seconds = match &rest[..unit_len] {
            "ms" => 0.001,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "d" => 86_400.0,
            "w" => 604_800.0,
            "y" => 31_536_000.0,
            _ => return None,
        };
        total += number * seconds;
        rest = &rest[unit_len..];
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_is_plain_http_with_an_optional_route_prefix() {
        let server = Prometheus::new("http://prometheus:9090/prom/").expect("valid");
        assert_eq!(server.authority, "prometheus:9090");
        assert_eq!(server.prefix, "/prom");
        assert_eq!(
            Prometheus::new("http://localhost")
                .expect("valid")
                .authority,
            "localhost:80"
        );
        for (bad, why) in [
            ("https://prometheus:9090", "plain http://"),
            ("prometheus:9090", "plain http://"),
            ("http://u:p@prometheus:9090", "credentials"),
            ("http://prometheus:9090/?x=1", "without a query"),
        ] {
            let error = Prometheus::new(bad).expect_err(bad).to_string();
            assert!(
                error.contains(why) && error.contains("--prometheus"),
                "{error}"
            );
        }
    }

    #[test]
    fn a_prometheus_that_is_not_there_is_named_with_the_fix() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a port")
            .port();
        let error = Prometheus::new(&format!("http://127.0.0.1:{port}"))
            .expect("valid")
            .now_s()
            .expect_err("nothing listens")
            .to_string();
        assert!(error.contains("is it running"), "{error}");
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(
            percent_encode("up{instance=\"a:1\"}[5s]"),
            "up%7Binstance%3D%22a%3A1%22%7D%5B5s%5D"
        );
    }
}
