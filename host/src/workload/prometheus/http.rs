//! The scrape: a plain-HTTP GET (HTTP/1.1, `Connection: close`, chunked bodies, IPv6
//! hosts) of the metrics endpoint, and its exposition reduced to a [`Scrape`].

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use super::{PrometheusConfig, Scrape, parse_exposition};
use crate::workload::WorkloadError;

/// A plain-HTTP URL, split.
#[derive(Debug, Clone)]
pub(super) struct Target {
    /// What to connect to: `host:port`, `[v6]:port`.
    pub(super) host_port: String,
    /// The Host header: the authority as written.
    pub(super) host: String,
    pub(super) path: String,
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
pub(super) fn response_body(response: &[u8], url: &str) -> Result<Vec<u8>, WorkloadError> {
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

pub(super) fn scrape(target: &Target, config: &PrometheusConfig) -> Result<Scrape, WorkloadError> {
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
