//! A node's counters over one window, from the samples Prometheus stored.
//!
//! Not `increase()`: PromQL extrapolates it to the window's edges, so it is not a count
//! (the Prometheus test reads 10.13 swaps of 9). Here the figures are differences of the
//! counters between two of the node's own scrapes, the first at or after the window's
//! start and the last at or before its end, so they count exactly what happened between
//! those scrapes, all of it inside the window. Every series of a scrape shares its
//! timestamp, so tokens, energy, ticks and violations cover the same stretch.
//!
//! Nothing missing is read as a zero: a named metric with no series is an error, and so
//! is a stretch longer than the allowed gap without a successful scrape (a failed scrape
//! here and there loses nothing: the counters are cumulative).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `up`: 1 for each successful scrape of the target, 0 for a failed one.
pub const UP: &str = "up";
pub const TICKS: &str = "tokwatt_ticks_total";
pub const TOKENS: &str = "tokwatt_gpu_tokens_total";
pub const ENERGY: &str = "tokwatt_gpu_energy_joules_total";
pub const VIOLATIONS: &str = "tokwatt_gpu_slo_violation_ticks_total";
pub const DEMANDED: &str = "tokwatt_gpu_tokens_demanded_total";
pub const SWAPS: &str = "tokwatt_swaps_total";
pub const ROLLBACKS: &str = "tokwatt_rollbacks_total";
pub const OPERATOR_ROLLBACKS: &str = "tokwatt_operator_rollbacks_total";
pub const PAUSED: &str = "tokwatt_paused";

/// Every metric read for a window. All but [`DEMANDED`] must be there.
pub const METRICS: [&str; 10] = [
    UP,
    TICKS,
    TOKENS,
    ENERGY,
    VIOLATIONS,
    DEMANDED,
    SWAPS,
    ROLLBACKS,
    OPERATOR_ROLLBACKS,
    PAUSED,
];

/// Two timestamps of one scrape differ by less than this (Prometheus keeps milliseconds).
const SAME_SCRAPE_S: f64 = 0.0005;

/// One series' samples as Prometheus stored them: (unix seconds, value), oldest first.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Series {
    pub labels: BTreeMap<String, String>,
    pub samples: Vec<(f64, f64)>,
}

/// A stretch of time on Prometheus's clock, unix seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Window {
    pub start_s: f64,
    pub end_s: f64,
}

impl Window {
    pub fn seconds(&self) -> f64 {
        self.end_s - self.start_s
    }
}

/// What a window's figures must also show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// One policy throughout: no swap, rollback, restart or pause (a half).
    OnePolicy,
    /// Only that the node was scraped (the baseline before the start, whatever ran).
    Scraped,
}

/// The scrapes a window's figures rest on.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Coverage {
    /// The first and last successful scrapes in the window: the figures count what
    /// happened between them.
    pub from_s: f64,
    pub to_s: f64,
    pub scrapes: usize,
    pub failed_scrapes: usize,
    /// The longest stretch without a successful scrape, the window's edges included.
    pub longest_gap_s: f64,
}

/// What one node did in one window, summed over its GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    pub tokens: u64,
    pub energy_j: f64,
    /// GPU-ticks whose window broke the objective.
    pub violation_ticks: u64,
    /// GPU-ticks: the node's ticks times its GPUs.
    pub ticks: u64,
    /// `None` where the node exports no demand counter: served demand is unknown.
    pub tokens_demanded: Option<u64>,
}

impl Figures {
    pub fn tokens_per_joule(&self) -> f64 {
        self.tokens as f64 / self.energy_j
    }
}

/// A node's window, measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    pub coverage: Coverage,
    pub figures: Figures,
    pub node_ticks: u64,
    pub gpus: usize,
}

impl Measured {
    /// Tokens per control tick over all the node's GPUs: its load, whatever the speed of
    /// its clock (a simulated node runs faster than real time, so tokens per second would
    /// measure the simulator).
    pub fn tokens_per_tick(&self) -> f64 {
        self.figures.tokens as f64 / self.node_ticks.max(1) as f64
    }
}

/// Why a window of a node cannot be measured. The node's name is added by the caller.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MeasureError {
    #[error(
        "Prometheus has no `{metric}` series for it: is its agent a tokwatt serve scraped by this Prometheus, and are the node's labels right?"
    )]
    Missing { metric: &'static str },
    #[error(
        "its labels select {count} `{metric}` series (of several targets or agents): add labels that only this node's series carry"
    )]
    Ambiguous { metric: &'static str, count: usize },
    #[error(
        "only {scrapes} successful scrape(s) in the {window_s:.1} s window: the window must span at least two scrapes (make it longer than a few scrape intervals)"
    )]
    TooFewScrapes { scrapes: usize, window_s: f64 },
    #[error(
        "not scraped for {gap_s:.1} s (from {from_s:.3} to {to_s:.3}, unix s), more than the {max_gap_s:.1} s allowed: its counters over the window are not known well enough; was the agent or Prometheus down?"
    )]
    Gap {
        from_s: f64,
        to_s: f64,
        gap_s: f64,
        max_gap_s: f64,
    },
    #[error("its agent ran no control tick between two scrapes in the window: is its loop stuck?")]
    NoTicks,
    #[error(
        "its agent restarted in the window (tokwatt_ticks_total went down): a restarted agent runs its configured policy, not the experiment's"
    )]
    Restarted,
    #[error(
        "its policy changed in the window ({metric} rose by {by}): another swap or a rollback (a policy that failed in probation) happened, so the window did not run one policy"
    )]
    PolicyChanged { metric: &'static str, by: u64 },
    #[error(
        "it was paused in the window (tokwatt_paused was 1 at {at_s:.3}, unix s): an operator held its settings, so the policy did not decide"
    )]
    Paused { at_s: f64 },
}

/// The node's figures over `window` from its `samples` (by metric name), with no stretch
/// longer than `max_gap_s` without a successful scrape.
pub fn measure(
    samples: &BTreeMap<String, Vec<Series>>,
    window: Window,
    max_gap_s: f64,
    hold: Hold,
) -> Result<Measured, MeasureError> {
    let series = |metric: &'static str| -> Result<&[Series], MeasureError> {
        match samples.get(metric).map(Vec::as_slice) {
            Some(series) if !series.is_empty() => Ok(series),
            _ => Err(MeasureError::Missing { metric }),
        }
    };
    let one = |metric: &'static str| -> Result<&Series, MeasureError> {
        match series(metric)? {
            [one] => Ok(one),
            many => Err(MeasureError::Ambiguous {
                metric,
                count: many.len(),
            }),
        }
    };
    let coverage = coverage(one(UP)?, window, max_gap_s)?;
    let (from, to) = (coverage.from_s, coverage.to_s);

    let ticks = increase(one(TICKS)?, from, to);
    if ticks.resets > 0 {
        return Err(MeasureError::Restarted);
    }
    if hold == Hold::OnePolicy {
        if ticks.value < 1.0 {
            return Err(MeasureError::NoTicks);
        }
        for metric in [SWAPS, ROLLBACKS, OPERATOR_ROLLBACKS] {
            let grown = increase(one(metric)?, from, to);
            if grown.resets > 0 {
                return Err(MeasureError::Restarted);
            }
            if grown.value > 0.0 {
                return Err(MeasureError::PolicyChanged {
                    metric,
                    by: grown.value.round() as u64,
                });
            }
        }
        if let Some(&(at_s, _)) = one(PAUSED)?
            .samples
            .iter()
            .find(|&&(t, v)| within(t, from, to) && v != 0.0)
        {
            return Err(MeasureError::Paused { at_s });
        }
    }

    let summed = |metric: &'static str| -> Result<(f64, Vec<String>), MeasureError> {
        let mut total = 0.0;
        let mut gpus = Vec::new();
        for series in series(metric)? {
            let grown = increase(series, from, to);
            total += grown.value;
            if grown.present_at_end
                && let Some(gpu) = series.labels.get("gpu")
            {
                gpus.push(gpu.clone());
            }
        }
        gpus.sort();
        gpus.dedup();
        Ok((total, gpus))
    };
    let (tokens, gpus) = summed(TOKENS)?;
    let (energy_j, _) = summed(ENERGY)?;
    let (violation_ticks, _) = summed(VIOLATIONS)?;
    // Known only where every GPU that made tokens says what was asked of it.
    let tokens_demanded = match samples.get(DEMANDED) {
        Some(series) if !series.is_empty() => {
            let (demanded, demand_gpus) = summed(DEMANDED)?;
            (demand_gpus == gpus).then(|| demanded.round() as u64)
        }
        _ => None,
    };
    let node_ticks = ticks.value.round() as u64;
    Ok(Measured {
        coverage,
        figures: Figures {
            tokens: tokens.round() as u64,
            energy_j,
            violation_ticks: violation_ticks.round() as u64,
            ticks: node_ticks.saturating_mul(gpus.len() as u64),
            tokens_demanded,
        },
        node_ticks,
        gpus: gpus.len(),
    })
}

fn within(t: f64, from: f64, to: f64) -> bool {
    t >= from - SAME_SCRAPE_S && t <= to + SAME_SCRAPE_S
}

/// The successful scrapes of `up` in `window`, none further apart than `max_gap_s`, nor
/// further than that from the window's edges.
fn coverage(up: &Series, window: Window, max_gap_s: f64) -> Result<Coverage, MeasureError> {
    let in_window = up
        .samples
        .iter()
        .filter(|&&(t, _)| within(t, window.start_s, window.end_s));
    let (ok, failed): (Vec<_>, Vec<_>) = in_window.partition(|&&(_, v)| v == 1.0);
    let (Some(&&(first, _)), Some(&&(last, _))) = (ok.first(), ok.last()) else {
        return Err(MeasureError::Gap {
            from_s: window.start_s,
            to_s: window.end_s,
            gap_s: window.seconds(),
            max_gap_s,
        });
    };
    let mut edges = vec![window.start_s];
    edges.extend(ok.iter().map(|&&(t, _)| t));
    edges.push(window.end_s);
    let mut longest_gap_s: f64 = 0.0;
    for step in edges.windows(2) {
        let gap_s = step[1] - step[0];
        if gap_s > max_gap_s {
            return Err(MeasureError::Gap {
                from_s: step[0],
                to_s: step[1],
                gap_s,
                max_gap_s,
            });
        }
        longest_gap_s = longest_gap_s.max(gap_s);
    }
    if ok.len() < 2 {
        return Err(MeasureError::TooFewScrapes {
            scrapes: ok.len(),
            window_s: window.seconds(),
        });
    }
    Ok(Coverage {
        from_s: first,
        to_s: last,
        scrapes: ok.len(),
        failed_scrapes: failed.len(),
        longest_gap_s,
    })
}

/// How much a counter grew between the scrapes at `from` and `to`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Increase {
    pub value: f64,
    /// Times the counter went down (its process restarted): the new value counts whole.
    pub resets: u32,
    /// Whether the series had a sample at `to`.
    pub present_at_end: bool,
}

/// The counter's growth between the scrapes at `from` and `to`, across resets. A series
/// first seen after `from` was created after it, at zero, so its first value counts whole.
pub fn increase(series: &Series, from: f64, to: f64) -> Increase {
    let samples: Vec<f64> = series
        .samples
        .iter()
        .filter(|&&(t, _)| within(t, from, to))
        .map(|&(_, v)| v)
        .collect();
    let starts_at_from = series
        .samples
        .iter()
        .any(|&(t, _)| (t - from).abs() <= SAME_SCRAPE_S);
    let present_at_end = series
        .samples
        .iter()
        .any(|&(t, _)| (t - to).abs() <= SAME_SCRAPE_S);
    let (mut last, rest) = match (starts_at_from, samples.split_first()) {
        (true, Some((&first, rest))) => (first, rest),
        _ => (0.0, samples.as_slice()),
    };
    let mut grown = Increase {
        value: 0.0,
        resets: 0,
        present_at_end,
    };
    for &value in rest {
        if value >= last {
            grown.value += value - last;
        } else {
            grown.value += value;
            grown.resets += 1;
        }
        last = value;
    }
    grown
}
