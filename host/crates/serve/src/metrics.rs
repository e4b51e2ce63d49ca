//! Prometheus `/metrics` for the agent: a registry of its own (`prometheus-client`),
//! updated once per control tick from [`Progress`] and encoded in the text format.
//!
//! The loop's [`LoopTotals`] are run totals; they become counter increments here by
//! keeping the last value seen. Energy, tokens and objective violations are labelled with
//! the policy whose settings were in force during the window they measure (the one that
//! decided the previous tick), so a swap starts the new policy's series with the first
//! window it chose the settings for. What Progress does not carry per tick is said where
//! it is read.
//!
//! The text is the classic Prometheus exposition (`text/plain; version=0.0.4`, see
//! [`CONTENT_TYPE`]): a counter family is named with its `_total` suffix, as `promtool
//! check metrics` and Prometheus's classic parser want. prometheus-client's own counters
//! name the family without it (OpenMetrics), which promtool reports as samples with no
//! HELP; [`TotalCounter`] keeps the sample names and fixes the family's.
//!
//! One file because the families, the `Seen` totals and the fleet's series are one `Inner`
//! behind one mutex, which every update reads and writes whole; what stands apart already
//! is apart (the families' definitions in `registry.rs`, the coordinator's in its own).

pub mod coordinator;
mod registry;

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use tokwatt_agent::control::Progress;
use tokwatt_core::types::{ClockEvents, DeviceInfo, Observation};

use registry::{
    AgentFamilies, CLOCK_EVENT_REASONS, DECIDE_BUCKETS_S, GaugeF64, GpuFamilies, GpuLabels,
    LATENESS_BUCKETS_S, PolicyFamilies, PolicyLabels, TotalCounter, register_agent, register_gpu,
    register_policy,
};

/// The HTTP `Content-Type` of [`AgentMetrics::encode`]'s text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

fn clock_event_active(events: &ClockEvents, reason: &str) -> bool {
    match reason {
        "gpu_idle" => events.gpu_idle,
        "sw_power_cap" => events.sw_power_cap,
        "hw_slowdown" => events.hw_slowdown,
        "sw_thermal" => events.sw_thermal,
        "hw_thermal" => events.hw_thermal,
        "clock_setting" => events.clock_setting,
        _ => false,
    }
}

const MHZ_TO_HZ: f64 = 1e6;

/// The last run totals seen, to turn them into increments.
#[derive(Debug, Default)]
struct Seen {
    /// The policy in charge after the last tick observed.
    in_charge: Option<PolicyLabels>,
    /// The policy that decided the last tick observed (the failing one where it was
    /// rolled back): its settings are in force during the next window.
    last_decided_by: Option<PolicyLabels>,
    /// Run-wide plugin traps and ejections (over every policy that was in charge).
    traps: u64,
    ejections: u64,
    ticks: u64,
    fallback_ticks: u64,
    swaps: u64,
    rollbacks: u64,
    operator_rollbacks: u64,
    objective_rollbacks: u64,
    guard_takeovers: u64,
    guard_takeover_ticks: u64,
    actuator_errors: u64,
    telemetry_errors: u64,
    stalls: u64,
    stalled_s: f64,
    /// Per GPU index.
    slo_violation_ticks: BTreeMap<u32, u64>,
}

/// How much a run total grew since it was last seen. A total below the last one is a new
/// run's (the loop's totals never decrease within a run): all of it is new.
fn advance(last: &mut u64, now: u64) -> u64 {
    let grown = if now >= *last { now - *last } else { now };
    *last = now;
    grown
}

/// [`advance`] for a run total that is a sum of seconds.
fn advance_seconds(last: &mut f64, now: f64) -> f64 {
    let grown = if now >= *last { now - *last } else { now };
    *last = now;
    grown
}

#[derive(Debug)]
struct Inner {
    /// The GPUs' labels (index, UUID, model), for the series a policy announced before it
    /// takes over and for every GPU's series.
    gpus: Vec<GpuLabels>,
    /// The batch size belongs to a serving engine, which tokwatt neither reads nor sets:
    /// the batch gauge stays absent rather than showing the workload's placeholder.
    engine_batch: bool,
    /// The workload reports its demand (the simulator): `tokwatt_gpu_tokens_demanded_total`
    /// exists, and is announced at zero with a policy's other series. Elsewhere it stays
    /// absent, so that no one reads an unknown demand as all of it served.
    knows_demand: bool,
    registry: Registry,
    gpu: GpuFamilies,
    policy: PolicyFamilies,
    agent: AgentFamilies,
    seen: Seen,
    /// A node in a power domain (`[fleet]`): its allowance, grant, lease and store.
    fleet: Option<FleetFamilies>,
}

/// The fleet's series (registered only in fleet mode).
#[derive(Debug, Default)]
struct FleetFamilies {
    allowance_watts: GaugeF64,
    caps_in_force_watts: GaugeF64,
    granted: GaugeF64,
    lease_live: GaugeF64,
    store_errors: TotalCounter<u64>,
    lease_lapses: TotalCounter<u64>,
    joins: TotalCounter<u64>,
    /// The link's counts as last added.
    seen: (u64, u64, u64),
}

/// What a fleet node's link reports to its metrics, once per exchange.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FleetReading {
    /// What the node may hold now (its grant, or its reserve).
    pub allowance_w: f64,
    /// The caps in force, summed, as last reported.
    pub caps_in_force_w: f64,
    /// Whether a grant is in force (else the reserve).
    pub granted: bool,
    /// Whether the node's lease is live.
    pub lease_live: bool,
    /// Cumulative: failed store requests, lapsed leases, joins.
    pub store_errors: u64,
    pub lease_lapses: u64,
    pub joins: u64,
}

/// The agent's Prometheus metrics. Shared between the loop (which calls
/// [`AgentMetrics::observe`] after every tick) and the HTTP handler (which calls
/// [`AgentMetrics::encode`]); a scrape sees one tick's update whole.
#[derive(Debug)]
pub struct AgentMetrics {
    inner: Mutex<Inner>,
}

impl AgentMetrics {
    /// Metrics for an agent driving `devices`; `simulated` labels every figure as the
    /// simulator's (`tokwatt_info{simulated="true"}`), `dry_run` says that no setting is
    /// changed, so the cap and clock gauges show what the dry run pretends is set
    /// (`tokwatt_info{dry_run="true"}`).
    pub fn new(devices: &[DeviceInfo], simulated: bool, dry_run: bool) -> Self {
        let mut registry = Registry::default();
        let gpu = GpuFamilies::default();
        let policy = PolicyFamilies {
            decide_duration_seconds: Family::new_with_constructor(|| {
                Histogram::new(DECIDE_BUCKETS_S)
            }),
            traps: Family::default(),
            fallback_ticks: Family::default(),
            ejections: Family::default(),
            swaps: Family::default(),
            rollbacks: Family::default(),
            objective_rollbacks: Family::default(),
            guard_takeovers: Family::default(),
            guard_takeover_ticks: Family::default(),
            swaps_refused: TotalCounter::default(),
            info: Family::default(),
            on_probation: Family::default(),
        };
        let agent = AgentFamilies {
            tick_lateness_seconds: Histogram::new(LATENESS_BUCKETS_S),
            ticks: TotalCounter::default(),
            swaps: TotalCounter::default(),
            rollbacks: TotalCounter::default(),
            operator_rollbacks: TotalCounter::default(),
            actuator_errors: TotalCounter::default(),
            telemetry_errors: TotalCounter::default(),
            stalls: TotalCounter::default(),
            stall_seconds: TotalCounter::default(),
            paused: GaugeF64::default(),
            guard_in_charge: GaugeF64::default(),
        };
        register_gpu(&mut registry, &gpu);
        register_policy(&mut registry, &policy);
        register_agent(&mut registry, &agent, simulated, dry_run);
        // Counters start at zero for every GPU, so a rate over the first scrapes is defined.
        for device in devices {
            let labels = GpuLabels::of(device);
            gpu.tpot_unknown_ticks.get_or_create(&labels).inc_by(0);
            for reason in CLOCK_EVENT_REASONS {
                gpu.clock_event_ticks
                    .get_or_create(&labels.with_reason(reason))
                    .inc_by(0);
            }
        }
        Self {
            inner: Mutex::new(Inner {
                gpus: devices.iter().map(GpuLabels::of).collect(),
                engine_batch: false,
                knows_demand: false,
                registry,
                gpu,
                policy,
                agent,
                seen: Seen::default(),
                fleet: None,
            }),
        }
    }

    /// Called by the serve loop after every tick. `policy_version` is the plugin's
    /// content version (12 hex digits) of the policy in charge.
    /// The GPUs' batch size belongs to their serving engines: `tokwatt_gpu_batch_size`
    /// stays absent (tokwatt neither knows nor sets it).
    pub fn with_engine_batch(self) -> Self {
        self.lock().engine_batch = true;
        self
    }

    /// The workload reports its demand (the simulator): each policy announced from now on
    /// has its demand series at zero beside its tokens, so `increase()` counts the first
    /// tick's too. Without this they appear with the first observation that carries
    /// demand. Call it before the first [`Self::announce`].
    pub fn with_demand(self) -> Self {
        self.lock().knows_demand = true;
        self
    }

    /// The fleet's series (`tokwatt_fleet_*`), for a node in a power domain.
    pub fn with_fleet(self) -> Self {
        {
            let mut inner = self.lock();
            let fleet = FleetFamilies::default();
            let registry = &mut inner.registry;
            registry.register(
                "tokwatt_fleet_allowance_watts",
                "What the node's GPUs' power caps may sum to now: the coordinator's grant while the node's lease is surely live, else its reserve",
                fleet.allowance_watts.clone(),
            );
            registry.register(
                "tokwatt_fleet_caps_in_force_watts",
                "The node's GPUs' power caps in force, summed, read back from the devices, as last reported to the coordinator",
                fleet.caps_in_force_watts.clone(),
            );
            registry.register(
                "tokwatt_fleet_granted",
                "1 while a coordinator's grant is in force, 0 while the node holds its reserve",
                fleet.granted.clone(),
            );
            registry.register(
                "tokwatt_fleet_lease_live",
                "1 while the node's lease in the coordination store is live by the node's last exchange",
                fleet.lease_live.clone(),
            );
            registry.register(
                "tokwatt_fleet_store_errors_total",
                "Requests to the coordination store that failed (no member answered, or one refused)",
                fleet.store_errors.clone(),
            );
            registry.register(
                "tokwatt_fleet_lease_lapses_total",
                "Times the node found its lease lapsed (apart from the store longer than its TTL) and joined again",
                fleet.lease_lapses.clone(),
            );
            registry.register(
                "tokwatt_fleet_joins_total",
                "Times the node joined its power domain, the first included",
                fleet.joins.clone(),
            );
            inner.fleet = Some(fleet);
        }
        self
    }

    /// The fleet link's state after an exchange (nothing where [`Self::with_fleet`] was
    /// not called).
    pub fn observe_fleet(&self, reading: &FleetReading) {
        let mut inner = self.lock();
        let Some(fleet) = inner.fleet.as_mut() else {
            return;
        };
        fleet.allowance_watts.set(reading.allowance_w);
        fleet.caps_in_force_watts.set(reading.caps_in_force_w);
        fleet.granted.set(f64::from(u8::from(reading.granted)));
        fleet
            .lease_live
            .set(f64::from(u8::from(reading.lease_live)));
        let (errors, lapses, joins) = fleet.seen;
        fleet
            .store_errors
            .inc_by(reading.store_errors.saturating_sub(errors));
        fleet
            .lease_lapses
            .inc_by(reading.lease_lapses.saturating_sub(lapses));
        fleet.joins.inc_by(reading.joins.saturating_sub(joins));
        fleet.seen = (reading.store_errors, reading.lease_lapses, reading.joins);
    }

    /// What the node may hold as of now, after every tick: the allowance falls to the
    /// reserve on the node's own clock, and the gauge must not wait for an exchange
    /// with a store that a partition holds up for seconds.
    pub fn observe_allowance(&self, allowance_w: f64, granted: bool) {
        let mut inner = self.lock();
        let Some(fleet) = inner.fleet.as_mut() else {
            return;
        };
        fleet.allowance_watts.set(allowance_w);
        fleet.granted.set(f64::from(u8::from(granted)));
    }

    pub fn observe(&self, progress: &Progress<'_>, policy_version: &str) {
        self.lock().observe(progress, policy_version);
    }

    /// Make a policy's series exist at zero before it takes over (its counters per
    /// policy, and its energy, tokens and violations on every GPU), so that
    /// `increase()` over a scrape that spans its first ticks counts them whole: a series
    /// that first appears above zero loses what it held when first seen.
    pub fn announce(&self, policy: &str, version: &str) {
        let inner = self.lock();
        let labels = PolicyLabels::new(policy, version);
        inner.policy.touch(&labels);
        for gpu in &inner.gpus {
            let by_policy = labels.on_gpu(gpu);
            inner
                .gpu
                .energy_joules
                .get_or_create(&by_policy)
                .inc_by(0.0);
            inner.gpu.tokens.get_or_create(&by_policy).inc_by(0);
            inner
                .gpu
                .slo_violation_ticks
                .get_or_create(&by_policy)
                .inc_by(0);
            if inner.knows_demand {
                inner
                    .gpu
                    .tokens_demanded
                    .get_or_create(&by_policy)
                    .inc_by(0);
            }
        }
    }

    /// Count a refused swap (bad spec or plugin): the loop never sees those.
    pub fn swap_refused(&self) {
        self.lock().policy.swaps_refused.inc_by(1);
    }

    /// The text exposition ([`CONTENT_TYPE`]), ending with `# EOF`.
    pub fn encode(&self) -> String {
        let inner = self.lock();
        let mut text = String::new();
        // Writing into a String cannot fail, and these metrics' encoders only write; an
        // error would leave the text without its `# EOF`, which a scraper reports.
        if let Err(error) = prometheus_client::encoding::text::encode(&mut text, &inner.registry) {
            tracing::error!("encoding the metrics failed: {error}");
        }
        text
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic elsewhere while holding the lock leaves counters that are still counts.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Inner {
    fn observe(&mut self, progress: &Progress<'_>, policy_version: &str) {
        let totals = progress.totals;
        let in_charge = PolicyLabels::new(progress.policy, policy_version);
        let before = self.seen.in_charge.clone();
        let swapped = advance(&mut self.seen.swaps, totals.swaps.swaps);
        let rolled_back = advance(&mut self.seen.rollbacks, totals.swaps.rollbacks);
        // An operator's rollback takes over as a swap does (its policy's `init` decides).
        let brought_back = advance(
            &mut self.seen.operator_rollbacks,
            totals.swaps.operator_rollbacks,
        );
        // A rollback happens after the failing policy decided, so the one in charge now
        // is the one that came back; the failing one was in charge after the last tick.
        // (A swap and a rollback in the same tick leave the failing one unnamed.)
        let decided_by = match &before {
            Some(failed) if rolled_back > 0 && swapped + brought_back == 0 => failed.clone(),
            _ => in_charge.clone(),
        };
        // The window this tick measured ran on the settings of the last tick's decision
        // (on the first tick, the first policy's `init`).
        let window_policy = self
            .seen
            .last_decided_by
            .replace(decided_by.clone())
            .unwrap_or_else(|| in_charge.clone());

        if before.as_ref() != Some(&in_charge) {
            if let Some(before) = &before {
                self.policy.info.get_or_create(before).set(0.0);
                self.policy.on_probation.get_or_create(before).set(0.0);
            }
            self.policy.touch(&in_charge);
        }
        self.policy.info.get_or_create(&in_charge).set(1.0);
        self.policy
            .on_probation
            .get_or_create(&in_charge)
            .set(if progress.on_probation { 1.0 } else { 0.0 });

        // Traps and ejections are run-wide totals; this tick's happened in the call of
        // the policy that decided it (the failing one, where it was rolled back).
        let traps = advance(&mut self.seen.traps, totals.plugin_traps);
        let ejections = advance(&mut self.seen.ejections, totals.policy_counters.ejections);
        self.policy.traps.get_or_create(&decided_by).inc_by(traps);
        self.policy
            .ejections
            .get_or_create(&decided_by)
            .inc_by(ejections);
        self.policy.swaps.get_or_create(&in_charge).inc_by(swapped);
        self.policy
            .rollbacks
            .get_or_create(&decided_by)
            .inc_by(rolled_back);
        let objective_rollbacks = advance(
            &mut self.seen.objective_rollbacks,
            totals.swaps.objective_rollbacks,
        );
        self.policy
            .objective_rollbacks
            .get_or_create(&decided_by)
            .inc_by(objective_rollbacks);
        // The guard takes over from the policy whose settings broke the objective: the
        // one that decided the window before.
        let takeovers = advance(&mut self.seen.guard_takeovers, totals.guard.takeovers);
        self.policy
            .guard_takeovers
            .get_or_create(&window_policy)
            .inc_by(takeovers);
        let takeover_ticks = advance(
            &mut self.seen.guard_takeover_ticks,
            totals.guard.takeover_ticks,
        );
        self.policy
            .guard_takeover_ticks
            .get_or_create(&in_charge)
            .inc_by(takeover_ticks);
        self.agent
            .guard_in_charge
            .set(if progress.guard_in_charge { 1.0 } else { 0.0 });
        let fallbacks = advance(&mut self.seen.fallback_ticks, totals.fallback_ticks);
        self.policy
            .fallback_ticks
            .get_or_create(&decided_by)
            .inc_by(fallbacks);
        if let Some(took) = progress.decide_time {
            self.policy
                .decide_duration_seconds
                .get_or_create(&decided_by)
                .observe(took.as_secs_f64());
        }

        let ticks = advance(&mut self.seen.ticks, totals.ticks);
        self.agent.ticks.inc_by(ticks);
        self.agent.swaps.inc_by(swapped);
        self.agent.rollbacks.inc_by(rolled_back);
        self.agent.operator_rollbacks.inc_by(brought_back);
        self.agent.actuator_errors.inc_by(advance(
            &mut self.seen.actuator_errors,
            totals.actuator_errors,
        ));
        let telemetry_errors = advance(&mut self.seen.telemetry_errors, totals.telemetry_errors);
        self.agent.telemetry_errors.inc_by(telemetry_errors);
        // In the same update as the settings the stall's read-back gave: a scrape that
        // sees the stall counted sees those too.
        self.agent
            .stalls
            .inc_by(advance(&mut self.seen.stalls, totals.stalls));
        self.agent
            .stall_seconds
            .inc_by(advance_seconds(&mut self.seen.stalled_s, totals.stalled_s));
        self.agent
            .tick_lateness_seconds
            .observe(progress.lateness.as_secs_f64());
        self.agent
            .paused
            .set(if progress.paused { 1.0 } else { 0.0 });

        for observation in progress.observations {
            let slo_total = totals
                .gpus
                .iter()
                .find(|g| g.gpu == observation.gpu)
                .map(|g| g.slo_violation_ticks);
            // The loop substitutes an empty window for a failed telemetry read; its zeros
            // are no reading, so those series are left out for the tick (the failure is
            // counted in tokwatt_telemetry_errors_total).
            let telemetry_missing = telemetry_errors > 0 && is_empty_telemetry(observation);
            self.observe_gpu(observation, &window_policy, slo_total, telemetry_missing);
        }
        self.seen.in_charge = Some(in_charge);
    }

    fn observe_gpu(
        &mut self,
        obs: &Observation,
        window_policy: &PolicyLabels,
        slo_total: Option<u64>,
        telemetry_missing: bool,
    ) {
        let labels = self
            .gpus
            .iter()
            .find(|g| g.gpu == obs.gpu.to_string())
            .cloned()
            .unwrap_or_else(|| GpuLabels::index_only(obs.gpu));
        let families = &self.gpu;
        let set = |family: &Family<GpuLabels, GaugeF64>, value: f64| {
            family.get_or_create(&labels).set(value);
        };
        let unset = |family: &Family<GpuLabels, GaugeF64>| {
            family.remove(&labels);
        };

        // The settings in force during the window, as the loop last read them back from
        // the device (at a stall, before the window's observation was built; after each
        // change it made), never as it asked for them.
        set(
            &families.power_cap_requested_watts,
            obs.in_force.power_cap_requested_w,
        );
        set(&families.power_cap_enforced_watts, obs.in_force.power_cap_w);
        set(
            &families.sm_clock_max_requested_hertz,
            f64::from(obs.in_force.sm_clock_max_mhz) * MHZ_TO_HZ,
        );
        if !self.engine_batch {
            set(&families.batch_size, f64::from(obs.in_force.batch_size));
        }
        set(&families.tokens_per_second, obs.tokens_per_s);

        if telemetry_missing {
            for family in [
                &families.power_watts,
                &families.tokens_per_joule,
                &families.sm_clock_hertz,
                &families.memory_clock_hertz,
                &families.temperature_celsius,
            ] {
                unset(family);
            }
            for reason in CLOCK_EVENT_REASONS {
                families
                    .clock_event_active
                    .remove(&labels.with_reason(reason));
            }
        } else {
            set(&families.power_watts, obs.power_avg_w);
            // No energy measured, no ratio (the loop's ratio reads 0 there).
            if obs.energy_j > 0.0 && obs.tokens_per_joule.is_finite() {
                set(&families.tokens_per_joule, obs.tokens_per_joule);
            } else {
                unset(&families.tokens_per_joule);
            }
            set(
                &families.sm_clock_hertz,
                f64::from(obs.sm_clock_mhz) * MHZ_TO_HZ,
            );
            set(
                &families.memory_clock_hertz,
                f64::from(obs.mem_clock_mhz) * MHZ_TO_HZ,
            );
            set(&families.temperature_celsius, obs.temperature_c);
            for reason in CLOCK_EVENT_REASONS {
                let by_reason = labels.with_reason(reason);
                let active = clock_event_active(&obs.clock_events, reason);
                families
                    .clock_event_active
                    .get_or_create(&by_reason)
                    .set(if active { 1.0 } else { 0.0 });
                families
                    .clock_event_ticks
                    .get_or_create(&by_reason)
                    .inc_by(u64::from(active));
            }
        }

        // TPOT is a measurement only where tokens flowed; NaN there is an engine's
        // histogram without observations: no series, a counted tick.
        if obs.tokens > 0 && obs.tpot_p99_ms.is_finite() {
            set(&families.tpot_p99_seconds, obs.tpot_p99_ms / 1e3);
        } else {
            unset(&families.tpot_p99_seconds);
            if obs.tokens > 0 {
                families.tpot_unknown_ticks.get_or_create(&labels).inc_by(1);
            }
        }

        match obs.requests.and_then(|r| r.ttft_p99_ms) {
            Some(ttft_ms) if ttft_ms.is_finite() => set(&families.ttft_p99_seconds, ttft_ms / 1e3),
            _ => unset(&families.ttft_p99_seconds),
        }

        let by_policy = window_policy.on_gpu(&labels);
        if let Some(requests) = &obs.requests {
            families
                .prefill_tokens
                .get_or_create(&by_policy)
                .inc_by(requests.prefill_tokens);
            // Only where the workload attributes energy to requests: elsewhere the
            // histogram stays absent, not empty.
            if let Some(energy) = &requests.energy {
                families
                    .request_energy_joules
                    .get_or_create(&by_policy)
                    .add(energy);
            }
        }
        if obs.energy_j.is_finite() && obs.energy_j >= 0.0 {
            families
                .energy_joules
                .get_or_create(&by_policy)
                .inc_by(obs.energy_j);
        } else {
            tracing::warn!(
                gpu = obs.gpu,
                energy_j = obs.energy_j,
                "a window's energy is not a count of joules; left out of tokwatt_gpu_energy_joules_total"
            );
        }
        families.tokens.get_or_create(&by_policy).inc_by(obs.tokens);
        if let Some(demand) = &obs.demand {
            families
                .tokens_demanded
                .get_or_create(&by_policy)
                .inc_by(demand.tokens_demanded);
            self.knows_demand = true;
        }
        let violations = match slo_total {
            Some(total) => advance(
                self.seen.slo_violation_ticks.entry(obs.gpu).or_default(),
                total,
            ),
            None => 0,
        };
        families
            .slo_violation_ticks
            .get_or_create(&by_policy)
            .inc_by(violations);
    }
}

/// The window the loop substitutes when a telemetry read failed.
fn is_empty_telemetry(obs: &Observation) -> bool {
    obs.energy_j == 0.0
        && obs.sm_clock_mhz == 0
        && obs.mem_clock_mhz == 0
        && obs.temperature_c == 0.0
        && obs.power_peak_w == 0.0
}

#[cfg(test)]
mod tests;
