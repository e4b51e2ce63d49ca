//! The scrape: a plain-HTTP GET of the metrics endpoint with hyper's HTTP/1.1 client
//! (chunked bodies, IPv6 hosts), on a small runtime each scraper owns, and its exposition
//! reduced to a [`Scrape`].

use std::time::Duration;

use http_body_util::{BodyExt, Empty, LengthLimitError, Limited};
use hyper::body::Bytes;
use hyper::{Request, header};
use hyper_util::rt::TokioIo;

use super::{PrometheusConfig, Scrape, parse_scrape};
use tokwatt_core::workload::WorkloadError;

/// The largest metrics body read: far above what an engine exposes (vLLM with many
/// models and engine cores stays under 1 MiB), low enough to bound a wrong endpoint.
const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// A plain-HTTP metrics endpoint, split, and the runtime its scrapes run on (built
/// once here, so a scrape only connects and reads).
#[derive(Debug)]
pub(super) struct Target {
    /// What to connect to: `host:port`, `[v6]:port`.
    pub(super) host_port: String,
    /// The Host header: the authority as written.
    pub(super) host: String,
    pub(super) path: String,
    runtime: tokio::runtime::Runtime,
}

impl Target {
    pub(super) fn parse(url: &str) -> Result<Self, WorkloadError> {
        let bad = |why: &str| {
            WorkloadError::Failed(format!(
                "metrics URL `{url}` {why}: write it as http://HOST:PORT/metrics (IPv6: http://[::1]:PORT/metrics)"
            ))
        };
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| bad("is not plain http://"))?;
        // A fragment is never sent. The authority ends at the path, or at a query when
        // there is no path (`http://h:8000?name[]=x` asks `/metrics?name[]=x`).
        let rest = rest.split_once('#').map_or(rest, |(before, _)| before);
        let (authority, path) = match rest.find(['/', '?']) {
            Some(end) if rest[end..].starts_with('/') => (&rest[..end], rest[end..].to_owned()),
            Some(end) => (&rest[..end], format!("/metrics{}", &rest[end..])),
            None => (rest, "/metrics".to_owned()),
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
        // The request line carries the path alone (origin form): refuse here what hyper
        // would refuse at every scrape.
        if path.parse::<hyper::Uri>().is_err() {
            return Err(bad("has a path that is not a valid request path"));
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| {
                WorkloadError::Failed(format!("cannot start the scraper's runtime for {url}: {e}"))
            })?;
        Ok(Self {
            host_port,
            host: authority.to_owned(),
            path,
            runtime,
        })
    }
}

pub(super) fn scrape(target: &Target, config: &PrometheusConfig) -> Result<Scrape, WorkloadError> {
    // At least a second: a busy engine (or a loaded test machine) may answer late, and a
    // late answer only delays the scraper thread, never the control loop.
    let timeout = config.period.max(Duration::from_secs(1));
    let body = target.runtime.block_on(async {
        tokio::time::timeout(timeout, fetch(target, &config.url))
            .await
            .map_err(|_| {
                WorkloadError::Failed(format!(
                    "{} did not answer within {timeout:?}: is the serving engine overloaded, or is the URL its metrics endpoint?",
                    config.url
                ))
            })?
    })?;
    parse_scrape(
        &String::from_utf8_lossy(&body),
        &config.token_counter,
        config.tpot_histogram.as_deref(),
        config.request_metrics.as_ref(),
    )
    .map_err(|e| match e {
        WorkloadError::Failed(why) => WorkloadError::Failed(format!("{}: {why}", config.url)),
        other => other,
    })
}

/// One GET of the metrics path on a fresh connection: the body of a 2xx answer.
async fn fetch(target: &Target, url: &str) -> Result<Bytes, WorkloadError> {
    let failed =
        |what: &str, e: &dyn std::fmt::Display| WorkloadError::Failed(format!("{what} {url}: {e}"));
    let stream = tokio::net::TcpStream::connect(target.host_port.as_str())
        .await
        .map_err(|e| {
            WorkloadError::Failed(format!(
                "cannot connect to {url}: {e} (is the serving engine running, and is this its metrics URL?)"
            ))
        })?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| failed("cannot talk HTTP/1.1 to", &e))?;
    // The connection runs beside the request; dropping the set (the scrape done, or
    // its timeout) aborts it, so no connection outlives its scrape.
    let mut connection_task = tokio::task::JoinSet::new();
    connection_task.spawn(connection);
    // `Connection: close`: one scrape, one connection. No Accept-Encoding: plain text.
    let request = Request::get(target.path.as_str())
        .header(header::HOST, target.host.as_str())
        .header(header::ACCEPT, "text/plain")
        .header(header::CONNECTION, "close")
        .body(Empty::<Bytes>::new())
        .map_err(|e| failed("cannot build the request for", &e))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| failed("got no HTTP answer from", &e))?;
    let status = response.status();
    if !status.is_success() {
        return Err(WorkloadError::Failed(format!(
            "{url} answered `{status}`: give the serving engine's metrics URL (usually http://HOST:PORT/metrics)"
        )));
    }
    let body = Limited::new(response.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
        .map_err(|e| {
            if e.downcast_ref::<LengthLimitError>().is_some() {
                WorkloadError::Failed(format!(
                    "{url} sent more than {} MiB of metrics, the most a scrape reads: is this the serving engine's metrics URL?",
                    MAX_BODY_BYTES >> 20
                ))
            } else {
                failed("cannot read the metrics body of", &e)
            }
        })?;
    Ok(body.to_bytes())
}
