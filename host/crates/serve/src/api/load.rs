//! A load tool for the control API's benchmark: `GET /v1/status` at a fixed rate, over
//! whichever transport the clients use, with latency percentiles.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::client::{ApiClient, ClientError};
use tokwatt_core::quantile::nearest_rank;

/// Clients sending at once: enough that one slow answer does not hold up the schedule.
const WORKERS: usize = 4;

/// What a [`hammer`] run saw.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LoadReport {
    /// Requests sent (every one due within the duration).
    pub sent: u64,
    /// Answered with a status the client could read.
    pub ok: u64,
    pub errors: u64,
    /// Median latency of the answered requests, ms, counted from when each request was
    /// due, so that falling behind the schedule shows (no coordinated omission);
    /// `None` when none was answered.
    pub latency_p50_ms: Option<f64>,
    pub latency_p99_ms: Option<f64>,
    pub rate_per_s: f64,
    pub duration_s: f64,
    /// The first error seen, in words.
    pub first_error: Option<String>,
}

/// Why a load run could not start.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("the request rate must be a positive number of requests per second, not {0}")]
    BadRate(f64),
    #[error("could not make a client: {0}")]
    Client(#[from] ClientError),
}

/// Sends `GET /v1/status` at `rate_per_s` for `duration` from [`WORKERS`] clients made by
/// `client_factory` (made before the clock starts).
pub fn hammer<F>(
    client_factory: F,
    rate_per_s: f64,
    duration: Duration,
) -> Result<LoadReport, LoadError>
where
    F: Fn() -> Result<ApiClient, ClientError>,
{
    if !(rate_per_s.is_finite() && rate_per_s > 0.0) {
        return Err(LoadError::BadRate(rate_per_s));
    }
    let clients = (0..WORKERS)
        .map(|_| client_factory())
        .collect::<Result<Vec<_>, _>>()?;
    // Whole requests due within the duration.
    let total = (rate_per_s * duration.as_secs_f64()).floor() as u64;
    let next = AtomicU64::new(0);
    let latencies_ms = Mutex::new(Vec::with_capacity(total as usize));
    let errors = AtomicU64::new(0);
    let first_error = Mutex::new(None::<String>);
    let start = Instant::now();
    std::thread::scope(|scope| {
        for client in &clients {
            scope.spawn(|| {
                loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    if index >= total {
                        break;
                    }
                    let due = start + Duration::from_secs_f64(index as f64 / rate_per_s);
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    match client.status() {
                        Ok(_) => {
                            let latency = due.elapsed().as_secs_f64() * 1e3;
                            if let Ok(mut all) = latencies_ms.lock() {
                                all.push(latency);
                            }
                        }
                        Err(error) => {
                            errors.fetch_add(1, Ordering::Relaxed);
                            if let Ok(mut first) = first_error.lock() {
                                first.get_or_insert_with(|| error.to_string());
                            }
                        }
                    }
                }
            });
        }
    });
    let duration_s = start.elapsed().as_secs_f64();
    let mut latencies = latencies_ms.into_inner().unwrap_or_default();
    Ok(LoadReport {
        sent: total,
        ok: latencies.len() as u64,
        errors: errors.into_inner(),
        latency_p50_ms: nearest_rank(&mut latencies, 0.50),
        latency_p99_ms: nearest_rank(&mut latencies, 0.99),
        rate_per_s,
        duration_s,
        first_error: first_error.into_inner().unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_rate_is_refused() {
        for rate in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let error = hammer(
                || ApiClient::unix("/nonexistent"),
                rate,
                Duration::from_secs(1),
            )
            .expect_err("refused");
            assert!(error.to_string().contains("positive"), "{error}");
        }
    }
}
