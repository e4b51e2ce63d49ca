//! What a run adds up: per GPU and over the node, the tokens, energy, violations, demand,
//! and the counts of every kind of failure and intervention. `summary.json` is these.

use serde::{Deserialize, Serialize};

use crate::swap::SwapCounters;
use tokwatt_core::types::{DemandWindow, InForce, RequestEnergy, RequestsWindow};
use tokwatt_policy::guard::GuardCounters;
use tokwatt_policy::supervisor::PolicyCounters;

/// Totals for one GPU.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct GpuTotals {
    pub gpu: u32,
    pub tokens: u64,
    #[serde(deserialize_with = "tokwatt_core::types::nan_if_null")]
    pub energy_j: f64,
    #[serde(deserialize_with = "tokwatt_core::types::nan_if_null")]
    pub tokens_per_joule: f64,
    pub slo_violation_ticks: u64,
    /// The demand this GPU faced; `None` where the workload does not report demand.
    pub demand: Option<DemandTotals>,
    /// Prompts, first tokens and energy per request; written only where the workload
    /// sees requests through (the simulator).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub requests: Option<RequestsTotals>,
    pub final_settings: Option<InForce>,
}

/// Requests over a run, where the workload sees each one through. What the source does
/// not see (a serving engine's preemptions, energy per request) stays `None`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestsTotals {
    /// Prompt tokens prefilled (recomputed ones included).
    pub prefill_tokens: u64,
    /// Requests that got their first token.
    pub first_tokens: u64,
    /// The highest per-tick p99 time to first token, ms (`None` when no request got one).
    pub worst_tick_ttft_p99_ms: Option<f64>,
    /// Sequences preempted for KV-cache room.
    pub preemptions: Option<u64>,
    /// Requests finished, and their energy: each step's energy shared over the tokens it
    /// processed, summed over a request's prompt and output.
    pub requests_finished: Option<u64>,
    pub request_energy_j: Option<f64>,
    /// `request_energy_j / requests_finished` (`None` with none finished).
    pub energy_per_request_j: Option<f64>,
}

/// The sum of two counts of which either may be unknown: the known ones.
fn add_known<T: std::ops::Add<Output = T>>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a + b),
        (a, b) => a.or(b),
    }
}

impl RequestsTotals {
    pub(super) fn add(&mut self, window: &RequestsWindow) {
        self.sum(&RequestsTotals {
            prefill_tokens: window.prefill_tokens,
            first_tokens: window.first_tokens,
            worst_tick_ttft_p99_ms: window.ttft_p99_ms,
            preemptions: window.preemptions,
            requests_finished: window.energy.map(|e| e.count),
            request_energy_j: window.energy.map(|e| e.sum_j),
            energy_per_request_j: None,
        });
    }

    /// Add `other`'s counts and keep the worse TTFT; the mean follows.
    pub(super) fn sum(&mut self, other: &RequestsTotals) {
        self.prefill_tokens = self.prefill_tokens.saturating_add(other.prefill_tokens);
        self.first_tokens = self.first_tokens.saturating_add(other.first_tokens);
        self.preemptions = add_known(self.preemptions, other.preemptions);
        self.requests_finished = add_known(self.requests_finished, other.requests_finished);
        self.request_energy_j = add_known(self.request_energy_j, other.request_energy_j);
        self.energy_per_request_j = match (self.requests_finished, self.request_energy_j) {
            (Some(count), Some(sum_j)) => RequestEnergy {
                count,
                sum_j,
                ..RequestEnergy::default()
            }
            .mean_j(),
            _ => None,
        };
        self.worst_tick_ttft_p99_ms =
            match (self.worst_tick_ttft_p99_ms, other.worst_tick_ttft_p99_ms) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
    }
}

/// Demand over a run: what arrived, what was served and what was turned away.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct DemandTotals {
    pub requests_arrived: u64,
    pub requests_completed: u64,
    pub requests_turned_away: u64,
    pub tokens_demanded: u64,
    pub tokens_served: u64,
    /// `tokens_served / tokens_demanded`, at most 1 (1 when nothing was asked). Tokens of
    /// requests still in flight at the end count as served once generated.
    #[serde(deserialize_with = "tokwatt_core::types::nan_if_null")]
    pub served_fraction: f64,
    /// Ticks in which a request was turned away (each is an objective violation).
    pub ticks_turning_away: u64,
    /// The highest per-tick p99 queue wait, ms (`None` when no request got a slot).
    pub worst_tick_queue_wait_p99_ms: Option<f64>,
}

impl DemandTotals {
    pub(super) fn add(&mut self, window: &DemandWindow, tokens_served: u64) {
        let tick = DemandTotals {
            requests_arrived: window.requests_arrived,
            requests_completed: window.requests_completed,
            requests_turned_away: window.requests_turned_away,
            tokens_demanded: window.tokens_demanded,
            tokens_served,
            served_fraction: 0.0,
            ticks_turning_away: u64::from(window.requests_turned_away > 0),
            worst_tick_queue_wait_p99_ms: window.queue_wait_p99_ms,
        };
        self.sum_counts(&tick);
        self.ticks_turning_away += tick.ticks_turning_away;
    }

    /// Fold another GPU's totals into this one (the run-level figure).
    pub(super) fn merge(&mut self, other: &DemandTotals) {
        self.sum_counts(other);
        self.ticks_turning_away = self.ticks_turning_away.max(other.ticks_turning_away);
    }

    /// Add `other`'s counts and keep the worse queue wait; the served fraction follows.
    pub(super) fn sum_counts(&mut self, other: &DemandTotals) {
        self.requests_arrived = self.requests_arrived.saturating_add(other.requests_arrived);
        self.requests_completed = self
            .requests_completed
            .saturating_add(other.requests_completed);
        self.requests_turned_away = self
            .requests_turned_away
            .saturating_add(other.requests_turned_away);
        self.tokens_demanded = self.tokens_demanded.saturating_add(other.tokens_demanded);
        self.tokens_served = self.tokens_served.saturating_add(other.tokens_served);
        self.served_fraction = if self.tokens_demanded == 0 {
            1.0
        } else {
            (self.tokens_served as f64 / self.tokens_demanded as f64).min(1.0)
        };
        self.worst_tick_queue_wait_p99_ms = match (
            self.worst_tick_queue_wait_p99_ms,
            other.worst_tick_queue_wait_p99_ms,
        ) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
}

fn is_zero(count: &u64) -> bool {
    *count == 0
}

fn is_no_time(seconds: &f64) -> bool {
    *seconds == 0.0
}

/// What a run did, for `summary.json`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LoopTotals {
    pub tokens: u64,
    #[serde(deserialize_with = "tokwatt_core::types::nan_if_null")]
    pub energy_j: f64,
    #[serde(deserialize_with = "tokwatt_core::types::nan_if_null")]
    pub tokens_per_joule: f64,
    #[serde(deserialize_with = "tokwatt_core::types::nan_if_null")]
    pub duration_s: f64,
    pub ticks: u64,
    pub fallback_ticks: u64,
    /// Plugin traps (trap, fuel, deadline, memory) over every policy in charge during the
    /// run, a swapped-out one's included.
    pub plugin_traps: u64,
    pub slo_violation_ticks: u64,
    /// What the objective guard did: take-overs, and the violations charged to the
    /// policy, to the guard's fallback, or excused (demand beyond the GPU).
    pub guard: GuardCounters,
    /// Ticks where tokens flowed under a TPOT bound but no GPU's TPOT was known (an
    /// external engine's histogram without observations): the bound went unchecked.
    /// Written only where there were some, so the summary's layout stays as it was for
    /// every run whose TPOT is always known.
    #[serde(skip_serializing_if = "is_zero", default)]
    pub tpot_unknown_ticks: u64,
    pub clamped_decisions: u64,
    /// Ticks where the node's power allowance (a fleet's grant or reserve) lowered the
    /// caps; and where even every GPU at its minimum cap passed it. Written only where
    /// there were some, so a run without an allowance keeps the summary's layout.
    #[serde(skip_serializing_if = "is_zero", default)]
    pub allowance_cut_ticks: u64,
    #[serde(skip_serializing_if = "is_zero", default)]
    pub allowance_unmet_ticks: u64,
    pub non_finite_values: u64,
    /// Stalls: times the loop found itself more than
    /// [`STALL_TICKS`](crate::control::STALL_TICKS) periods behind its schedule (the
    /// process stopped, a call hung) and read every GPU's settings back before going on;
    /// and the time they lost, seconds (how far behind each found the loop). Written only
    /// where there were some, so a run without one keeps the summary's layout.
    #[serde(skip_serializing_if = "is_zero", default)]
    pub stalls: u64,
    #[serde(skip_serializing_if = "is_no_time", default)]
    pub stalled_s: f64,
    pub actuator_errors: u64,
    pub telemetry_errors: u64,
    pub settings_changes: u64,
    pub interrupted: bool,
    /// Every policy's calls and failures over the run: each supervisor's counts while it
    /// was in charge (and its `init`), summed over swaps and rollbacks.
    pub policy_counters: PolicyCounters,
    /// The policy in charge when the run ended (`policy` names the one it started with).
    pub policy_at_end: String,
    /// Hot swaps, their state hand-overs and rollbacks.
    pub swaps: SwapCounters,
    /// Demand over all GPUs (`ticks_turning_away`: the most of any one GPU); `None` where
    /// the workload does not report demand.
    pub demand: Option<DemandTotals>,
    /// Requests over all GPUs; written only where the workload sees them through.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub requests: Option<RequestsTotals>,
    /// Time to first token and time per output token over every request finished in the
    /// run, from each request's own record (`requests.jsonl`); written only where the
    /// workload gives records.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub request_latency: Option<RequestLatencyTotals>,
    pub gpus: Vec<GpuTotals>,
    /// Wall time the loop took, seconds (on a virtual clock, far less than `duration_s`).
    #[serde(deserialize_with = "tokwatt_core::types::nan_if_null")]
    pub wall_time_s: f64,
}

/// Quantiles over requests, not ticks: each finished request counts once, whatever tick it
/// finished in. Read from log-spaced buckets (within 1 % of the exact nearest rank).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestLatencyTotals {
    /// Requests whose records the quantiles are over.
    pub requests: u64,
    /// Finished but not recorded (more than the workload keeps between two ticks): left
    /// out of the quantiles, and counted so that the gap shows.
    pub requests_unrecorded: u64,
    /// In the quantiles but not in `requests.jsonl`: finished after the file held its cap
    /// of lines (`tokwatt run --max-request-lines`), which keeps the run's first requests.
    /// Absent from summaries written before the cap: read as 0.
    #[serde(default)]
    pub requests_not_written: u64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    /// Over requests of more than one output token (`None` where there were none).
    pub tpot_p50_ms: Option<f64>,
    pub tpot_p90_ms: Option<f64>,
    pub tpot_p99_ms: Option<f64>,
}

/// What [`RequestLatencyTotals`] is read from.
#[derive(Debug, Clone, Default)]
pub(crate) struct RequestLatency {
    requests: u64,
    unrecorded: u64,
    ttft: tokwatt_core::quantile::LatencyHistogram,
    tpot: tokwatt_core::quantile::LatencyHistogram,
}

impl RequestLatency {
    pub(crate) fn add(&mut self, finished: &tokwatt_core::workload::FinishedRequests) {
        self.unrecorded += finished.dropped;
        for record in &finished.records {
            self.requests += 1;
            self.ttft.record(record.ttft_ms);
            if let Some(tpot) = record.tpot_ms {
                self.tpot.record(tpot);
            }
        }
    }

    pub(crate) fn totals(&self) -> RequestLatencyTotals {
        let [ttft_p50_ms, ttft_p90_ms, ttft_p99_ms] = self.ttft.quantiles([0.50, 0.90, 0.99]);
        let [tpot_p50_ms, tpot_p90_ms, tpot_p99_ms] = self.tpot.quantiles([0.50, 0.90, 0.99]);
        RequestLatencyTotals {
            requests: self.requests,
            requests_unrecorded: self.unrecorded,
            requests_not_written: 0,
            ttft_p50_ms,
            ttft_p90_ms,
            ttft_p99_ms,
            tpot_p50_ms,
            tpot_p90_ms,
            tpot_p99_ms,
        }
    }
}
