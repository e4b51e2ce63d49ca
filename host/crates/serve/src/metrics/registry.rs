//! The agent's metric families, their labels and their registration: every name, help
//! text and unit the exposition carries is written here, once.

use std::fmt::Write as _;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::{
    EncodeGaugeValue, EncodeLabelSet, EncodeLabelValue, EncodeMetric, LabelValueEncoder,
    MetricEncoder,
};
use prometheus_client::metrics::counter::{Atomic, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

/// Upper bounds of `tokwatt_policy_decide_duration_seconds`: a wasm `decide` takes tens
/// of microseconds; the epoch deadline stops one long before a second.
pub(super) const DECIDE_BUCKETS_S: [f64; 16] = [
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1,
    0.25, 0.5, 1.0,
];

/// Upper bounds of `tokwatt_tick_lateness_seconds`: from a scheduler's jitter to a loop
/// that fell whole ticks behind.
pub(super) const LATENESS_BUCKETS_S: [f64; 22] = [
    1e-6, 2.5e-6, 5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3,
    25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Clock-event reasons, by their label value.
pub(super) const CLOCK_EVENT_REASONS: [&str; 6] = [
    "gpu_idle",
    "sw_power_cap",
    "hw_slowdown",
    "sw_thermal",
    "hw_thermal",
    "clock_setting",
];

pub(super) type GaugeF64 = Gauge<f64, AtomicU64>;
pub(super) type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// A counter whose family is named with `_total`, as the classic text format wants (see
/// the module docs). Its sample has the same name as a prometheus-client counter's.
#[derive(Debug, Default)]
pub(super) struct TotalCounter<N, A = AtomicU64>(pub(super) Counter<N, A>);

// By hand: the derive would ask for `A: Clone`, and a clone shares the count anyway.
impl<N, A> Clone for TotalCounter<N, A> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<N, A: Atomic<N>> TotalCounter<N, A> {
    pub(super) fn inc_by(&self, amount: N) {
        self.0.inc_by(amount);
    }

    #[cfg(test)]
    pub(super) fn get(&self) -> N {
        self.0.get()
    }
}

impl<N, A> TypedMetric for TotalCounter<N, A> {
    const TYPE: MetricType = MetricType::Counter;
}

impl<N: EncodeGaugeValue, A: Atomic<N>> EncodeMetric for TotalCounter<N, A> {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        // A plain sample line (no suffix added): the family's name already ends in _total.
        encoder.encode_gauge(&self.0.get())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Counter
    }
}

/// A label value escaped for the text format (prometheus-client writes label values as
/// given; a policy's name comes from an operator's spec and may hold `"` or `\`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct LabelText(pub(super) String);

impl LabelText {
    pub(super) fn new(raw: &str) -> Self {
        let mut escaped = String::with_capacity(raw.len());
        for c in raw.chars() {
            match c {
                '\\' => escaped.push_str("\\\\"),
                '"' => escaped.push_str("\\\""),
                '\n' => escaped.push_str("\\n"),
                c => escaped.push(c),
            }
        }
        Self(escaped)
    }
}

impl EncodeLabelValue for LabelText {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(&self.0)
    }
}

/// A GPU's labels on every per-GPU series: its index on the node (`gpu`), and, named as
/// dcgm-exporter names them, its board's UUID (`UUID`) and model (`modelName`): an index
/// can change across reboots or a board swap, the UUID cannot, so a dashboard or a join
/// with dcgm-exporter's series follows the board.
#[allow(non_snake_case)] // dcgm-exporter's label names.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct GpuLabels {
    pub(super) gpu: String,
    pub(super) UUID: LabelText,
    pub(super) modelName: LabelText,
}

impl GpuLabels {
    /// The labels of the GPU `device` describes.
    pub(super) fn of(device: &tokwatt_core::types::DeviceInfo) -> Self {
        Self {
            gpu: device.index.to_string(),
            UUID: LabelText::new(&device.uuid),
            modelName: LabelText::new(&device.name),
        }
    }

    /// The labels of a GPU the agent was not told of at the start: its index alone (an
    /// empty label is no label, to Prometheus).
    pub(super) fn index_only(gpu: u32) -> Self {
        Self {
            gpu: gpu.to_string(),
            UUID: LabelText::new(""),
            modelName: LabelText::new(""),
        }
    }

    pub(super) fn with_reason(&self, reason: &'static str) -> GpuReasonLabels {
        GpuReasonLabels {
            gpu: self.gpu.clone(),
            UUID: self.UUID.clone(),
            modelName: self.modelName.clone(),
            reason,
        }
    }
}

#[allow(non_snake_case)] // dcgm-exporter's label names.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct GpuReasonLabels {
    pub(super) gpu: String,
    pub(super) UUID: LabelText,
    pub(super) modelName: LabelText,
    pub(super) reason: &'static str,
}

#[allow(non_snake_case)] // dcgm-exporter's label names.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct GpuPolicyLabels {
    pub(super) gpu: String,
    pub(super) UUID: LabelText,
    pub(super) modelName: LabelText,
    pub(super) policy: LabelText,
    pub(super) version: LabelText,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, EncodeLabelSet)]
pub(super) struct PolicyLabels {
    pub(super) policy: LabelText,
    pub(super) version: LabelText,
}

impl PolicyLabels {
    pub(super) fn new(policy: &str, version: &str) -> Self {
        Self {
            policy: LabelText::new(policy),
            version: LabelText::new(version),
        }
    }

    pub(super) fn on_gpu(&self, gpu: &GpuLabels) -> GpuPolicyLabels {
        GpuPolicyLabels {
            gpu: gpu.gpu.clone(),
            UUID: gpu.UUID.clone(),
            modelName: gpu.modelName.clone(),
            policy: self.policy.clone(),
            version: self.version.clone(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct AgentInfoLabels {
    pub(super) version: &'static str,
    pub(super) simulated: &'static str,
    pub(super) dry_run: &'static str,
}

/// Per-GPU series.
#[derive(Debug, Default)]
pub(super) struct GpuFamilies {
    pub(super) power_watts: Family<GpuLabels, GaugeF64>,
    pub(super) tokens_per_joule: Family<GpuLabels, GaugeF64>,
    pub(super) tokens_per_second: Family<GpuLabels, GaugeF64>,
    pub(super) power_cap_requested_watts: Family<GpuLabels, GaugeF64>,
    pub(super) power_cap_enforced_watts: Family<GpuLabels, GaugeF64>,
    pub(super) sm_clock_max_requested_hertz: Family<GpuLabels, GaugeF64>,
    pub(super) sm_clock_hertz: Family<GpuLabels, GaugeF64>,
    pub(super) memory_clock_hertz: Family<GpuLabels, GaugeF64>,
    pub(super) batch_size: Family<GpuLabels, GaugeF64>,
    pub(super) temperature_celsius: Family<GpuLabels, GaugeF64>,
    pub(super) tpot_p99_seconds: Family<GpuLabels, GaugeF64>,
    pub(super) tpot_unknown_ticks: Family<GpuLabels, TotalCounter<u64>>,
    /// Only where the workload reports time to first token.
    pub(super) ttft_p99_seconds: Family<GpuLabels, GaugeF64>,
    pub(super) clock_event_active: Family<GpuReasonLabels, GaugeF64>,
    pub(super) clock_event_ticks: Family<GpuReasonLabels, TotalCounter<u64>>,
    pub(super) energy_joules: Family<GpuPolicyLabels, TotalCounter<f64>>,
    pub(super) tokens: Family<GpuPolicyLabels, TotalCounter<u64>>,
    /// Only where the workload knows its demand (the simulator).
    pub(super) tokens_demanded: Family<GpuPolicyLabels, TotalCounter<u64>>,
    pub(super) slo_violation_ticks: Family<GpuPolicyLabels, TotalCounter<u64>>,
    /// Only where the workload sees requests through (the simulator).
    pub(super) prefill_tokens: Family<GpuPolicyLabels, TotalCounter<u64>>,
    pub(super) request_energy_joules: Family<GpuPolicyLabels, BucketHistogram>,
}

/// A histogram fed whole windows at a time (bucket counts and a sum, as the workload
/// reports them: [`tokwatt_core::types::RequestEnergy`]), not one observation a call.
#[derive(Debug, Default, Clone)]
pub(super) struct BucketHistogram {
    inner: std::sync::Arc<std::sync::Mutex<tokwatt_core::types::RequestEnergy>>,
}

impl BucketHistogram {
    pub(super) fn add(&self, window: &tokwatt_core::types::RequestEnergy) {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .merge(window);
    }
}

impl TypedMetric for BucketHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for BucketHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let totals = *self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Per-bucket counts, as prometheus-client's own histogram hands them over (the
        // encoder writes them cumulative); the last bucket is +Inf, which the encoder
        // writes for f64::MAX (as prometheus-client's own histogram marks it).
        let buckets: Vec<(f64, u64)> = tokwatt_core::types::REQUEST_ENERGY_BUCKETS_J
            .iter()
            .copied()
            .chain(std::iter::once(f64::MAX))
            .zip(totals.buckets)
            .collect();
        encoder.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
            totals.sum_j,
            totals.count,
            &buckets,
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// Per-policy series.
#[derive(Debug)]
pub(super) struct PolicyFamilies {
    pub(super) decide_duration_seconds: HistogramFamily<PolicyLabels>,
    pub(super) traps: Family<PolicyLabels, TotalCounter<u64>>,
    pub(super) fallback_ticks: Family<PolicyLabels, TotalCounter<u64>>,
    pub(super) ejections: Family<PolicyLabels, TotalCounter<u64>>,
    pub(super) swaps: Family<PolicyLabels, TotalCounter<u64>>,
    pub(super) rollbacks: Family<PolicyLabels, TotalCounter<u64>>,
    pub(super) objective_rollbacks: Family<PolicyLabels, TotalCounter<u64>>,
    pub(super) guard_takeovers: Family<PolicyLabels, TotalCounter<u64>>,
    pub(super) guard_takeover_ticks: Family<PolicyLabels, TotalCounter<u64>>,
    pub(super) swaps_refused: TotalCounter<u64>,
    pub(super) info: Family<PolicyLabels, GaugeF64>,
    pub(super) on_probation: Family<PolicyLabels, GaugeF64>,
}

/// Agent-wide series.
#[derive(Debug)]
pub(super) struct AgentFamilies {
    pub(super) tick_lateness_seconds: Histogram,
    pub(super) ticks: TotalCounter<u64>,
    /// Node-wide, without a policy label: present at zero from the start, so
    /// `increase()` counts every swap (a per-policy series first seen above zero loses
    /// what it held then).
    pub(super) swaps: TotalCounter<u64>,
    pub(super) rollbacks: TotalCounter<u64>,
    pub(super) operator_rollbacks: TotalCounter<u64>,
    pub(super) actuator_errors: TotalCounter<u64>,
    pub(super) telemetry_errors: TotalCounter<u64>,
    /// The loop's stalls and the time they lost: present at zero from the start, so that
    /// `increase()` counts the first one.
    pub(super) stalls: TotalCounter<u64>,
    pub(super) stall_seconds: TotalCounter<f64>,
    pub(super) paused: GaugeF64,
    pub(super) guard_in_charge: GaugeF64,
}

impl PolicyFamilies {
    /// Every counter of a policy, at zero, from the tick it is first seen.
    pub(super) fn touch(&self, policy: &PolicyLabels) {
        for family in [
            &self.traps,
            &self.fallback_ticks,
            &self.ejections,
            &self.swaps,
            &self.rollbacks,
            &self.objective_rollbacks,
            &self.guard_takeovers,
            &self.guard_takeover_ticks,
        ] {
            family.get_or_create(policy).inc_by(0);
        }
    }
}

/// Where the per-GPU figures come from, for HELP texts.
pub(super) const FROM_TELEMETRY: &str =
    "NVML on a GPU, the simulator where tokwatt_info says simulated";

pub(super) fn register_gpu(registry: &mut Registry, families: &GpuFamilies) {
    let gauges: [(&str, String, &Family<GpuLabels, GaugeF64>); 12] = [
        (
            "tokwatt_gpu_power_watts",
            format!("Average power over the last control window, watts: energy counter difference over the window ({FROM_TELEMETRY})"),
            &families.power_watts,
        ),
        (
            "tokwatt_gpu_tokens_per_joule",
            format!("Tokens per joule over the last control window: the workload's tokens over the energy counter difference ({FROM_TELEMETRY}); absent when no energy was measured"),
            &families.tokens_per_joule,
        ),
        (
            "tokwatt_gpu_tokens_per_second",
            "Tokens per second over the last control window, from the workload (the decode workload, a serving engine's metrics or the simulator)".to_owned(),
            &families.tokens_per_second,
        ),
        (
            "tokwatt_gpu_power_cap_requested_watts",
            "Power cap requested of the GPU (the limit its driver holds, whoever set it), watts, in force during the last window, as last read back from the device: at the start, after each change tokwatt made and after a stall (tokwatt_stalls_total), never what tokwatt asked for unread. In a dry run (tokwatt_info dry_run=\"true\"), the cap the dry run pretends is set".to_owned(),
            &families.power_cap_requested_watts,
        ),
        (
            "tokwatt_gpu_power_cap_enforced_watts",
            format!("Power cap the GPU enforced during the last window, watts ({FROM_TELEMETRY}); below the request when something outside tokwatt holds it lower. In a dry run (tokwatt_info dry_run=\"true\"), the cap the dry run pretends is set: the GPU's own is unchanged"),
            &families.power_cap_enforced_watts,
        ),
        (
            "tokwatt_gpu_sm_clock_max_requested_hertz",
            "Upper bound of the SM clock lock in force during the last window, hertz (the highest supported clock when unlocked), as last read back from the device: at the start, after each change tokwatt made and after a stall. In a dry run (tokwatt_info dry_run=\"true\"), the lock the dry run pretends is set".to_owned(),
            &families.sm_clock_max_requested_hertz,
        ),
        (
            "tokwatt_gpu_sm_clock_hertz",
            format!("Measured SM clock, median of the last window's samples, hertz ({FROM_TELEMETRY})"),
            &families.sm_clock_hertz,
        ),
        (
            "tokwatt_gpu_memory_clock_hertz",
            format!("Measured memory clock in the last window, hertz ({FROM_TELEMETRY})"),
            &families.memory_clock_hertz,
        ),
        (
            "tokwatt_gpu_batch_size",
            "Batch size in force during the last window, sequences (as the workload reports it)".to_owned(),
            &families.batch_size,
        ),
        (
            "tokwatt_gpu_temperature_celsius",
            format!("GPU temperature at the end of the last window, degrees Celsius ({FROM_TELEMETRY})"),
            &families.temperature_celsius,
        ),
        (
            "tokwatt_gpu_tpot_p99_seconds",
            "99th percentile time per output token in the last window, seconds, from the workload; absent where no tokens flowed or the source had no TPOT observation (counted in tokwatt_gpu_tpot_unknown_ticks_total)".to_owned(),
            &families.tpot_p99_seconds,
        ),
        (
            "tokwatt_gpu_ttft_p99_seconds",
            "99th percentile time from a request's arrival to its first token over the requests that got one in the last window, seconds, from the workload; absent where none did, and on workloads that do not report it".to_owned(),
            &families.ttft_p99_seconds,
        ),
    ];
    for (name, help, family) in gauges {
        registry.register(name, help, family.clone());
    }
    registry.register(
        "tokwatt_gpu_tpot_unknown_ticks_total",
        "Ticks in which tokens flowed but the workload's TPOT p99 was unknown (a serving engine's histogram without observations in the window)",
        families.tpot_unknown_ticks.clone(),
    );
    registry.register(
        "tokwatt_gpu_clock_event_active",
        format!(
            "1 when the clock-event reason was active in the last window, else 0 ({FROM_TELEMETRY})"
        ),
        families.clock_event_active.clone(),
    );
    registry.register(
        "tokwatt_gpu_clock_event_ticks_total",
        format!("Ticks in which the clock-event reason was active ({FROM_TELEMETRY})"),
        families.clock_event_ticks.clone(),
    );
    registry.register(
        "tokwatt_gpu_energy_joules_total",
        format!("Energy the GPU used, joules, from the energy counter over each window ({FROM_TELEMETRY}), by the policy whose settings were in force"),
        families.energy_joules.clone(),
    );
    registry.register(
        "tokwatt_gpu_tokens_total",
        "Tokens the workload generated on the GPU, by the policy whose settings were in force",
        families.tokens.clone(),
    );
    registry.register(
        "tokwatt_gpu_tokens_demanded_total",
        "Tokens the requests that arrived asked for, turned-away ones included, by the policy whose settings were in force; present only where the workload knows its demand (the simulator), so that served demand is tokwatt_gpu_tokens_total over this, never assumed whole",
        families.tokens_demanded.clone(),
    );
    registry.register(
        "tokwatt_gpu_prefill_tokens_total",
        "Prompt tokens the workload prefilled on the GPU (recomputed ones included), by the policy whose settings were in force; present only where the workload sees requests through (the simulator)",
        families.prefill_tokens.clone(),
    );
    registry.register(
        "tokwatt_gpu_request_energy_joules",
        "Energy of each finished request, joules: each step's energy shared over the tokens it processed, summed over the request's prompt and output, by the policy whose settings were in force; present only where the workload sees requests through (the simulator)",
        families.request_energy_joules.clone(),
    );
    registry.register(
        "tokwatt_gpu_slo_violation_ticks_total",
        "Ticks whose window broke the objective of the policy spec in charge (TPOT, TTFT, throughput, queue wait, demand turned away), by the policy whose settings were in force",
        families.slo_violation_ticks.clone(),
    );
}

pub(super) fn register_policy(registry: &mut Registry, families: &PolicyFamilies) {
    registry.register(
        "tokwatt_policy_decide_duration_seconds",
        "Wall time of the policy's decide call, seconds (the wasm call with its sandbox checks), by the policy that decided",
        families.decide_duration_seconds.clone(),
    );
    registry.register(
        "tokwatt_policy_traps_total",
        "Failures that trapped the policy's instance (trap, fuel, deadline, memory limit), by the policy in charge",
        families.traps.clone(),
    );
    registry.register(
        "tokwatt_policy_fallback_ticks_total",
        "Ticks decided by the safe fallback (it holds the settings) because the policy failed or is ejected, by the policy that failed",
        families.fallback_ticks.clone(),
    );
    registry.register(
        "tokwatt_policy_ejections_total",
        "Times the circuit breaker ejected the policy after consecutive failures",
        families.ejections.clone(),
    );
    registry.register(
        "tokwatt_policy_swaps_total",
        "Hot swaps, by the policy swapped in",
        families.swaps.clone(),
    );
    registry.register(
        "tokwatt_policy_rollbacks_total",
        "Swapped-in policies that failed in probation and gave way to the previous one, by the policy rolled back",
        families.rollbacks.clone(),
    );
    registry.register(
        "tokwatt_policy_objective_rollbacks_total",
        "Swapped-in policies rolled back for breaking the node's objective in probation more often than the policy they replaced, by the policy rolled back",
        families.objective_rollbacks.clone(),
    );
    registry.register(
        "tokwatt_guard_takeovers_total",
        "Times the objective guard took the node over because the policy's settings broke the objective on too many recent ticks, by that policy",
        families.guard_takeovers.clone(),
    );
    registry.register(
        "tokwatt_guard_takeover_ticks_total",
        "Ticks decided by the objective guard's fallback (the device defaults) instead of the policy, by the policy in charge",
        families.guard_takeover_ticks.clone(),
    );
    registry.register(
        "tokwatt_policy_swaps_refused_total",
        "Swap requests refused before reaching the loop (a bad spec or plugin); nothing changed",
        families.swaps_refused.clone(),
    );
    registry.register(
        "tokwatt_policy_info",
        "1 for the policy in charge, 0 for one that was; version is the plugin's content version",
        families.info.clone(),
    );
    registry.register(
        "tokwatt_policy_on_probation",
        "1 while the policy swapped in is on probation (a failure brings the previous one back), else 0",
        families.on_probation.clone(),
    );
}

pub(super) fn register_agent(
    registry: &mut Registry,
    families: &AgentFamilies,
    simulated: bool,
    dry_run: bool,
) {
    registry.register(
        "tokwatt_tick_lateness_seconds",
        "How late each control tick started against its schedule, seconds (the virtual clock's in a simulated run)",
        families.tick_lateness_seconds.clone(),
    );
    registry.register(
        "tokwatt_ticks_total",
        "Control ticks run",
        families.ticks.clone(),
    );
    registry.register(
        "tokwatt_swaps_total",
        "Hot swaps on the node, whichever policy (exact under increase(): present at zero from the start)",
        families.swaps.clone(),
    );
    registry.register(
        "tokwatt_rollbacks_total",
        "Rollbacks on the node (a failure or the objective in probation), whichever policy",
        families.rollbacks.clone(),
    );
    registry.register(
        "tokwatt_operator_rollbacks_total",
        "Earlier policies brought back by the operator (tokwatt policy rollback), whichever policy; not counted in tokwatt_swaps_total",
        families.operator_rollbacks.clone(),
    );
    registry.register(
        "tokwatt_actuator_errors_total",
        "Setting changes (power cap, clock lock, batch size) that failed; the old setting stayed",
        families.actuator_errors.clone(),
    );
    registry.register(
        "tokwatt_telemetry_errors_total",
        "Telemetry reads that failed; that GPU's telemetry series are absent for the tick",
        families.telemetry_errors.clone(),
    );
    registry.register(
        "tokwatt_stalls_total",
        "Times the control loop found itself more than two tick periods behind its schedule (the process was stopped, or a call hung) and read every GPU's power cap and clock lock back from the device before acting or reporting again",
        families.stalls.clone(),
    );
    registry.register(
        "tokwatt_stall_seconds_total",
        "Time the control loop lost to stalls, seconds: how far behind its schedule each stall found it",
        families.stall_seconds.clone(),
    );
    registry.register(
        "tokwatt_paused",
        "1 while an operator holds the settings (the policy is not asked), else 0",
        families.paused.clone(),
    );
    registry.register(
        "tokwatt_guard_in_charge",
        "1 while the objective guard's fallback (the device defaults) decides instead of the policy, else 0",
        families.guard_in_charge.clone(),
    );
    let info: Family<AgentInfoLabels, GaugeF64> = Family::default();
    info.get_or_create(&AgentInfoLabels {
        version: env!("CARGO_PKG_VERSION"),
        simulated: if simulated { "true" } else { "false" },
        dry_run: if dry_run { "true" } else { "false" },
    })
    .set(1.0);
    registry.register(
        "tokwatt_info",
        "1, labelled with the agent's version, whether its GPUs are simulated (then every figure here is simulator output, never a GPU's), and whether it is a dry run (then no GPU setting is changed, and the power cap and SM clock gauges show what the dry run pretends is set)",
        info,
    );
}
