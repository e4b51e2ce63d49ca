use std::time::Duration;

use super::registry::GpuPolicyLabels;
use super::*;
use prometheus_client::metrics::counter::Atomic;
use prometheus_client::metrics::family::Family;
use std::sync::atomic::AtomicU64;
use tokwatt_agent::control::{GpuTotals, LoopTotals};
use tokwatt_core::types::{InForce, Settings};

fn device(index: u32) -> DeviceInfo {
    DeviceInfo {
        index,
        uuid: format!("GPU-{index}"),
        name: "sim".into(),
        simulated: true,
        power_cap_min_w: 200.0,
        power_cap_max_w: 700.0,
        power_cap_default_w: 700.0,
        sm_clocks_mhz: vec![1980, 1000],
        mem_clocks_mhz: vec![3201],
    }
}

fn observation(gpu: u32, tick: u64, tokens: u64, energy_j: f64) -> Observation {
    Observation {
        gpu,
        tick,
        interval_s: 1.0,
        tokens,
        energy_j,
        tokens_per_joule: if energy_j > 0.0 {
            tokens as f64 / energy_j
        } else {
            0.0
        },
        tokens_per_s: tokens as f64,
        power_avg_w: energy_j,
        power_peak_w: energy_j * 1.1,
        sm_clock_mhz: 1980,
        mem_clock_mhz: 3201,
        temperature_c: 55.0,
        gpu_util_pct: 100.0,
        clock_events: ClockEvents {
            sw_power_cap: true,
            ..ClockEvents::default()
        },
        tpot_p50_ms: 10.0,
        tpot_p99_ms: 12.0,
        active_sequences: 8,
        queue_depth: 0,
        demand: None,
        requests: None,
        in_force: InForce {
            power_cap_w: 500.0,
            power_cap_requested_w: 550.0,
            sm_clock_max_mhz: 1500,
            batch_size: 8,
            token_budget: 0,
        },
        last_clamped: false,
        settling: false,
    }
}

/// `observation` as the simulator sees it: the window's arrivals asked for `demanded` tokens.
fn with_demand(mut observation: Observation, demanded: u64) -> Observation {
    observation.demand = Some(tokwatt_core::types::DemandWindow {
        requests_arrived: 1,
        tokens_demanded: demanded,
        ..Default::default()
    });
    observation
}

/// A loop's state after a tick, enough to build its [`Progress`].
struct Tick {
    totals: LoopTotals,
    observations: Vec<Observation>,
    policy: &'static str,
    decide_time: Option<Duration>,
    on_probation: bool,
}

impl Tick {
    fn first(policy: &'static str) -> Self {
        Self {
            totals: LoopTotals {
                gpus: vec![GpuTotals {
                    gpu: 0,
                    ..GpuTotals::default()
                }],
                ..LoopTotals::default()
            },
            observations: Vec::new(),
            policy,
            decide_time: Some(Duration::from_micros(40)),
            on_probation: false,
        }
    }

    /// The next tick on GPU 0, the totals grown as the loop grows them.
    fn next(&mut self, observation: Observation) {
        self.totals.ticks += 1;
        self.totals.tokens += observation.tokens;
        self.totals.energy_j += observation.energy_j;
        self.totals.gpus[0].tokens += observation.tokens;
        self.totals.gpus[0].energy_j += observation.energy_j;
        self.observations = vec![observation];
    }

    fn feed(&self, metrics: &AgentMetrics, version: &str) {
        let requested = vec![Settings::default(); self.observations.len()];
        metrics.observe(
            &Progress {
                tick: self.totals.ticks.saturating_sub(1),
                ticks: 100,
                time: Duration::from_secs(self.totals.ticks),
                totals: &self.totals,
                observations: &self.observations,
                in_force: &[],
                policy: self.policy,
                requested: &requested,
                decide_time: self.decide_time,
                lateness: Duration::from_micros(3),
                paused: false,
                on_probation: self.on_probation,
                guard_in_charge: false,
                guard_enabled: true,
                objective: tokwatt_core::types::Objective::default(),
                commands_taken: 0,
            },
            version,
        );
    }
}

/// The value of the sample named `series` (name and labels as written) in `text`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map(|value| value.parse().expect("a number"))
}

fn policy(name: &str, version: &str) -> PolicyLabels {
    PolicyLabels::new(name, version)
}

fn count(family: &Family<PolicyLabels, TotalCounter<u64>>, labels: &PolicyLabels) -> Option<u64> {
    family.get(labels).map(|counter| counter.get())
}

fn gpu_count<N: Copy>(
    family: &Family<GpuPolicyLabels, TotalCounter<N>>,
    labels: &PolicyLabels,
) -> Option<N>
where
    AtomicU64: Atomic<N>,
{
    family
        .get(&labels.on_gpu(&GpuLabels::of(&device(0))))
        .map(|counter| counter.get())
}

#[test]
fn run_totals_become_counter_increments() {
    let metrics = AgentMetrics::new(&[device(0)], true, false);
    let mut tick = Tick::first("a");
    for n in 0..3 {
        tick.next(observation(0, n, 100, 400.0));
        tick.totals.fallback_ticks += u64::from(n == 1);
        tick.totals.gpus[0].slo_violation_ticks += u64::from(n >= 1);
        tick.totals.actuator_errors = 2;
        tick.feed(&metrics, "aaaaaaaaaaaa");
    }
    let inner = metrics.lock();
    let a = policy("a", "aaaaaaaaaaaa");
    assert_eq!(count(&inner.policy.fallback_ticks, &a), Some(1));
    assert_eq!(gpu_count(&inner.gpu.slo_violation_ticks, &a), Some(2));
    assert_eq!(gpu_count(&inner.gpu.tokens, &a), Some(300));
    assert_eq!(gpu_count(&inner.gpu.energy_joules, &a), Some(1200.0));
    assert_eq!(inner.agent.ticks.get(), 3);
    assert_eq!(
        inner.agent.actuator_errors.get(),
        2,
        "counted once, not per tick"
    );
    let sw_power_cap = GpuLabels::of(&device(0)).with_reason("sw_power_cap");
    assert_eq!(
        inner
            .gpu
            .clock_event_ticks
            .get(&sw_power_cap)
            .map(|c| c.get()),
        Some(3)
    );
}

#[test]
fn a_swap_starts_the_new_policys_series_and_a_rollback_counts_against_the_failing_one() {
    let metrics = AgentMetrics::new(&[device(0)], true, false);
    let (a, b) = (policy("a", "aaaaaaaaaaaa"), policy("b", "bbbbbbbbbbbb"));
    let mut tick = Tick::first("a");
    // Tick 0: `a` decides; it has trapped twice before.
    tick.totals.plugin_traps = 2;
    tick.next(observation(0, 0, 10, 100.0));
    tick.feed(&metrics, "aaaaaaaaaaaa");
    // Tick 1: `b` is swapped in (its `init` decides). The run's totals carry on.
    tick.policy = "b";
    tick.on_probation = true;
    tick.decide_time = None;
    tick.totals.swaps.swaps = 1;
    tick.next(observation(0, 1, 20, 100.0));
    tick.feed(&metrics, "bbbbbbbbbbbb");
    // Tick 2: `b` traps: a fallback tick, and rolled back at once.
    tick.policy = "a";
    tick.on_probation = false;
    tick.decide_time = Some(Duration::from_micros(900));
    tick.totals.fallback_ticks = 1;
    tick.totals.swaps.rollbacks = 1;
    tick.totals.plugin_traps = 3; // `b`'s trap, counted against `b`
    tick.next(observation(0, 2, 40, 100.0));
    tick.feed(&metrics, "aaaaaaaaaaaa");
    // Tick 3: `a` again, trapping once more.
    tick.decide_time = Some(Duration::from_micros(40));
    tick.totals.plugin_traps = 4;
    tick.next(observation(0, 3, 80, 100.0));
    tick.feed(&metrics, "aaaaaaaaaaaa");

    let inner = metrics.lock();
    assert_eq!(
        count(&inner.policy.swaps, &b),
        Some(1),
        "labelled by who came in"
    );
    assert_eq!(count(&inner.policy.swaps, &a), Some(0));
    assert_eq!(
        count(&inner.policy.rollbacks, &b),
        Some(1),
        "the failing one"
    );
    assert_eq!(count(&inner.policy.rollbacks, &a), Some(0));
    assert_eq!(count(&inner.policy.fallback_ticks, &b), Some(1));
    assert_eq!(count(&inner.policy.fallback_ticks, &a), Some(0));
    // Run-wide totals: each trap counted once, against the policy whose call trapped.
    assert_eq!(count(&inner.policy.traps, &a), Some(3));
    assert_eq!(count(&inner.policy.traps, &b), Some(1));
    // Windows go to the policy whose settings were in force: tick 0 and 1 ran on `a`'s
    // (its init, then its tick-0 decision), tick 2 and 3 on `b`'s.
    assert_eq!(gpu_count(&inner.gpu.tokens, &a), Some(30));
    assert_eq!(gpu_count(&inner.gpu.tokens, &b), Some(120));
    // The failing decide is `b`'s.
    drop(inner);
    let text = metrics.encode();
    let decided = |p: &str, what: &str| {
        sample(
            &text,
            &format!(
                "tokwatt_policy_decide_duration_seconds_{what}{{policy=\"{p}\",version=\"{p}{p}{p}{p}{p}{p}{p}{p}{p}{p}{p}{p}\"}}"
            ),
        )
    };
    assert_eq!(decided("b", "count"), Some(1.0));
    assert_eq!(decided("b", "sum"), Some(900e-6));
    assert_eq!(decided("a", "count"), Some(2.0));
    let inner = metrics.lock();
    let info = |p: &PolicyLabels| inner.policy.info.get(p).map(|g| g.get());
    assert_eq!(info(&a), Some(1.0));
    assert_eq!(info(&b), Some(0.0));
}

#[test]
fn unknown_tpot_leaves_the_series_absent_and_is_counted() {
    let metrics = AgentMetrics::new(&[device(0)], false, false);
    let mut tick = Tick::first("a");
    let mut unknown = observation(0, 0, 100, 400.0);
    unknown.tpot_p99_ms = f64::NAN;
    tick.next(unknown);
    tick.feed(&metrics, "aaaaaaaaaaaa");
    let text = metrics.encode();
    assert!(
        !text.contains("tokwatt_gpu_tpot_p99_seconds{"),
        "no sample:\n{text}"
    );
    assert!(text.contains(
        "tokwatt_gpu_tpot_unknown_ticks_total{gpu=\"0\",UUID=\"GPU-0\",modelName=\"sim\"} 1\n"
    ));
    assert!(!text.contains("NaN"));

    tick.next(observation(0, 1, 100, 400.0));
    tick.feed(&metrics, "aaaaaaaaaaaa");
    let text = metrics.encode();
    assert!(text.contains(
        "tokwatt_gpu_tpot_p99_seconds{gpu=\"0\",UUID=\"GPU-0\",modelName=\"sim\"} 0.012\n"
    ));
    assert!(text.contains(
        "tokwatt_gpu_tpot_unknown_ticks_total{gpu=\"0\",UUID=\"GPU-0\",modelName=\"sim\"} 1\n"
    ));

    // An idle window measured no step: no series, and not an unknown one.
    tick.next(observation(0, 2, 0, 100.0));
    tick.feed(&metrics, "aaaaaaaaaaaa");
    let text = metrics.encode();
    assert!(!text.contains("tokwatt_gpu_tpot_p99_seconds{"));
    assert!(text.contains(
        "tokwatt_gpu_tpot_unknown_ticks_total{gpu=\"0\",UUID=\"GPU-0\",modelName=\"sim\"} 1\n"
    ));
}

#[test]
fn a_failed_telemetry_read_leaves_that_gpus_readings_absent() {
    let metrics = AgentMetrics::new(&[device(0)], false, false);
    let mut tick = Tick::first("a");
    tick.next(observation(0, 0, 100, 400.0));
    tick.feed(&metrics, "aaaaaaaaaaaa");
    assert!(
        metrics
            .encode()
            .contains("tokwatt_gpu_power_watts{gpu=\"0\",UUID=\"GPU-0\",modelName=\"sim\"} 400")
    );

    let mut empty = observation(0, 1, 100, 0.0);
    empty.sm_clock_mhz = 0;
    empty.mem_clock_mhz = 0;
    empty.temperature_c = 0.0;
    empty.power_avg_w = 0.0;
    empty.clock_events = ClockEvents::default();
    tick.totals.telemetry_errors = 1;
    tick.next(empty);
    tick.feed(&metrics, "aaaaaaaaaaaa");
    let text = metrics.encode();
    for absent in [
        "tokwatt_gpu_power_watts{",
        "tokwatt_gpu_tokens_per_joule{",
        "tokwatt_gpu_sm_clock_hertz{",
        "tokwatt_gpu_temperature_celsius{",
        "tokwatt_gpu_clock_event_active{",
    ] {
        assert!(!text.contains(absent), "{absent} is no reading:\n{text}");
    }
    assert!(text.contains("tokwatt_telemetry_errors_total 1\n"));
    // The settings in force are the loop's own, known either way.
    assert!(text.contains(
        "tokwatt_gpu_power_cap_enforced_watts{gpu=\"0\",UUID=\"GPU-0\",modelName=\"sim\"} 500"
    ));
}

#[test]
fn the_text_is_the_classic_format_with_escaped_labels() {
    let metrics = AgentMetrics::new(&[device(0)], true, false);
    let mut tick = Tick::first("odd \"name\" \\ here");
    tick.next(observation(0, 0, 100, 400.0));
    tick.feed(&metrics, "0123456789ab");
    metrics.swap_refused();
    let text = metrics.encode();
    assert!(text.ends_with("# EOF\n"));
    // prometheus-client ends every HELP with a full stop of its own.
    assert!(
        !text
            .lines()
            .any(|line| line.starts_with("# HELP") && line.ends_with("..")),
        "{text}"
    );
    assert!(text.contains("# TYPE tokwatt_ticks_total counter\ntokwatt_ticks_total 1\n"));
    assert!(text.contains("# TYPE tokwatt_policy_swaps_refused_total counter\n"));
    assert!(text.contains("tokwatt_policy_swaps_refused_total 1\n"));
    assert!(text.contains(r#"policy="odd \"name\" \\ here",version="0123456789ab""#));
    assert!(text.contains(&format!(
        "tokwatt_info{{version=\"{}\",simulated=\"true\",dry_run=\"false\"}} 1",
        env!("CARGO_PKG_VERSION")
    )));
    assert!(text.contains("tokwatt_gpu_sm_clock_max_requested_hertz{gpu=\"0\",UUID=\"GPU-0\",modelName=\"sim\"} 1500000000"));
}

/// In a dry run the cap and clock gauges show what the dry run pretends is set, so the
/// exposition says it is one, and the enforced cap's help says what it then shows.
#[test]
fn a_dry_run_says_so_in_tokwatt_info_and_in_the_enforced_caps_help() {
    let metrics = AgentMetrics::new(&[device(0)], false, true);
    let mut tick = Tick::first("static");
    tick.next(observation(0, 0, 100, 400.0));
    tick.feed(&metrics, "0123456789ab");
    let text = metrics.encode();
    assert!(
        text.contains(&format!(
            "tokwatt_info{{version=\"{}\",simulated=\"false\",dry_run=\"true\"}} 1",
            env!("CARGO_PKG_VERSION")
        )),
        "{text}"
    );
    let help = text
        .lines()
        .find(|line| line.starts_with("# HELP tokwatt_gpu_power_cap_enforced_watts "))
        .expect("the enforced cap's help");
    assert!(
        help.contains("the cap the dry run pretends is set"),
        "{help}"
    );
}

#[test]
fn a_new_runs_totals_count_from_zero() {
    let metrics = AgentMetrics::new(&[device(0)], true, false);
    let mut tick = Tick::first("a");
    for n in 0..5 {
        tick.next(observation(0, n, 1, 1.0));
        tick.feed(&metrics, "aaaaaaaaaaaa");
    }
    let mut again = Tick::first("a");
    for n in 0..2 {
        again.next(observation(0, n, 1, 1.0));
        again.feed(&metrics, "aaaaaaaaaaaa");
    }
    assert_eq!(metrics.lock().agent.ticks.get(), 7);
}

#[test]
fn every_gpu_starts_with_its_counters_at_zero() {
    let metrics = AgentMetrics::new(&[device(0), device(1)], true, false);
    let text = metrics.encode();
    assert!(text.contains(
        "tokwatt_gpu_tpot_unknown_ticks_total{gpu=\"1\",UUID=\"GPU-1\",modelName=\"sim\"} 0\n"
    ));
    assert!(
        text.contains("tokwatt_gpu_clock_event_ticks_total{gpu=\"1\",UUID=\"GPU-1\",modelName=\"sim\",reason=\"hw_thermal\"} 0\n")
    );
}

#[test]
fn the_metrics_can_be_shared_between_the_loop_and_the_http_handler() {
    fn shared<T: Send + Sync>() {}
    shared::<AgentMetrics>();
}

#[test]
fn a_serving_engines_batch_size_is_absent_not_the_workloads_placeholder() {
    for (engine_batch, expected) in [(false, true), (true, false)] {
        let mut metrics = AgentMetrics::new(&[device(0)], false, false);
        if engine_batch {
            metrics = metrics.with_engine_batch();
        }
        let mut tick = Tick::first("a");
        tick.next(observation(0, 0, 100, 400.0));
        tick.feed(&metrics, "aaaaaaaaaaaa");
        let text = metrics.encode();
        assert_eq!(
            text.contains("tokwatt_gpu_batch_size{gpu=\"0\",UUID=\"GPU-0\",modelName=\"sim\"}"),
            expected,
            "engine batch {engine_batch}:\n{text}"
        );
    }
}

/// One line of `tests/deploy/metric_names.txt`: a family's name, type and label names.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct ListedFamily {
    name: String,
    kind: String,
    labels: Vec<String>,
}

/// The label names of one sample line (`name{a="x",b="y\"z"} 1`), in order.
fn label_names(line: &str) -> Vec<String> {
    let Some(start) = line.find('{') else {
        return Vec::new();
    };
    let mut names = Vec::new();
    let mut rest = &line[start + 1..];
    while let Some((name, after)) = rest.split_once("=\"") {
        names.push(name.trim_start_matches(',').to_owned());
        // Skip the quoted value, honouring backslash escapes.
        let mut escaped = false;
        let end = after
            .char_indices()
            .find(|&(_, c)| {
                let closes = c == '"' && !escaped;
                escaped = c == '\\' && !escaped;
                closes
            })
            .map(|(i, _)| i)
            .expect("a label value ends with a quote");
        rest = &after[end + 1..];
        if rest.starts_with('}') {
            break;
        }
    }
    names
}

/// The families an exposition declares, with the label names its samples carry (a
/// histogram's `le` is the format's, not the family's).
fn exposed_families(text: &str) -> Vec<ListedFamily> {
    let mut families: Vec<ListedFamily> = text
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .map(|declared| {
            let (name, kind) = declared.split_once(' ').expect("# TYPE name kind");
            ListedFamily {
                name: name.to_owned(),
                kind: kind.to_owned(),
                labels: Vec::new(),
            }
        })
        .collect();
    for line in text.lines().filter(|line| !line.starts_with('#')) {
        let series = line.split(['{', ' ']).next().unwrap_or_default();
        let family = families
            .iter_mut()
            .filter(|family| series.starts_with(&family.name))
            .max_by_key(|family| family.name.len())
            .unwrap_or_else(|| panic!("sample `{line}` belongs to no declared family"));
        for name in label_names(line) {
            if name != "le" && !family.labels.contains(&name) {
                family.labels.push(name);
            }
        }
    }
    families.sort();
    families
}

/// Dashboards, alerts and the deployment checkers are written against
/// `tests/deploy/metric_names.txt`; this keeps it the exposition's own list.
#[test]
fn the_deployment_list_of_metric_names_is_the_exposition() {
    let listed_text = include_str!("../../../../../tests/deploy/metric_names.txt");
    let mut listed: Vec<ListedFamily> = listed_text
        .lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(fields.len(), 3, "`name type labels`: {line}");
            ListedFamily {
                name: fields[0].to_owned(),
                kind: fields[1].to_owned(),
                labels: match fields[2] {
                    "-" => Vec::new(),
                    labels => labels.split(',').map(str::to_owned).collect(),
                },
            }
        })
        .collect();
    listed.sort();

    // Every family with at least one sample: a GPU that ran a tick under a policy, a
    // refused swap, and the batch gauge the agent's own workload reports.
    let metrics = AgentMetrics::new(&[device(0)], true, false)
        .with_fleet()
        .with_demand();
    let mut tick = Tick::first("a");
    let mut serving = with_demand(observation(0, 0, 100, 400.0), 120);
    serving.requests = Some(tokwatt_core::types::RequestsWindow {
        ttft_p99_ms: Some(180.0),
        energy: Some(tokwatt_core::types::RequestEnergy::default()),
        ..Default::default()
    });
    tick.next(serving);
    tick.feed(&metrics, "aaaaaaaaaaaa");
    metrics.swap_refused();
    metrics.observe_fleet(&crate::metrics::FleetReading {
        allowance_w: 2400.0,
        caps_in_force_w: 2400.0,
        granted: true,
        lease_live: true,
        store_errors: 1,
        lease_lapses: 0,
        joins: 1,
    });
    let exposed = exposed_families(&metrics.encode());
    let unlabelled: Vec<&str> = exposed
        .iter()
        .filter(|family| {
            family.labels.is_empty()
                && listed
                    .iter()
                    .any(|entry| entry.name == family.name && !entry.labels.is_empty())
        })
        .map(|family| family.name.as_str())
        .collect();
    assert!(
        unlabelled.is_empty(),
        "families without a sample here, so their labels go unchecked: {unlabelled:?}"
    );
    let differing: Vec<String> = exposed
        .iter()
        .filter(|family| !listed.contains(family))
        .map(|family| format!("exported {family:?}"))
        .chain(
            listed
                .iter()
                .filter(|entry| !exposed.contains(entry))
                .map(|entry| format!("listed {entry:?}")),
        )
        .collect();
    assert!(
        differing.is_empty(),
        "tests/deploy/metric_names.txt must list what /metrics exports:\n{}",
        differing.join("\n")
    );
}

/// Issue 28: a policy version's counters start above zero unless they exist before it
/// takes over, and `increase()` then misses its first window.
#[test]
fn an_announced_policy_has_its_counters_at_zero_before_its_first_tick() {
    let metrics = AgentMetrics::new(&[device(0)], true, false);
    metrics.announce("next", "0123456789ab");
    let text = metrics.encode();
    for series in [
        "tokwatt_policy_swaps_total{policy=\"next\",version=\"0123456789ab\"}",
        "tokwatt_gpu_tokens_total{gpu=\"0\",UUID=\"GPU-0\",modelName=\"sim\",policy=\"next\",version=\"0123456789ab\"}",
        "tokwatt_gpu_energy_joules_total{gpu=\"0\",UUID=\"GPU-0\",modelName=\"sim\",policy=\"next\",version=\"0123456789ab\"}",
        "tokwatt_gpu_slo_violation_ticks_total{gpu=\"0\",UUID=\"GPU-0\",modelName=\"sim\",policy=\"next\",version=\"0123456789ab\"}",
    ] {
        assert_eq!(sample(&text, series), Some(0.0), "{series} in\n{text}");
    }
}

#[test]
fn the_allowance_gauge_follows_every_tick_not_only_the_stores_answers() {
    let metrics = AgentMetrics::new(&[device(0)], true, false).with_fleet();
    metrics.observe_fleet(&crate::metrics::FleetReading {
        allowance_w: 2400.0,
        caps_in_force_w: 2400.0,
        granted: true,
        lease_live: true,
        store_errors: 0,
        lease_lapses: 0,
        joins: 1,
    });
    // Cut off: the exchange hangs on its timeouts while the lease runs out on the
    // node's clock; the tick's reading lowers the gauge meanwhile.
    metrics.observe_allowance(1000.0, false);
    let text = metrics.encode();
    assert_eq!(sample(&text, "tokwatt_fleet_allowance_watts"), Some(1000.0));
    assert_eq!(sample(&text, "tokwatt_fleet_granted"), Some(0.0));
    // A node outside a domain has no fleet series to set.
    let alone = AgentMetrics::new(&[device(0)], true, false);
    alone.observe_allowance(1000.0, false);
    assert_eq!(
        sample(&alone.encode(), "tokwatt_fleet_allowance_watts"),
        None
    );
}

/// Served demand is tokens over tokens demanded; a workload that does not know its demand
/// must leave the demand series out, never let a reader take all of it as served.
#[test]
fn demand_is_counted_where_the_workload_knows_it_and_absent_elsewhere() {
    let series = "tokwatt_gpu_tokens_demanded_total{gpu=\"0\",UUID=\"GPU-0\",modelName=\"sim\",policy=\"a\",version=\"aaaaaaaaaaaa\"}";
    let knows = AgentMetrics::new(&[device(0)], true, false).with_demand();
    knows.announce("a", "aaaaaaaaaaaa");
    assert_eq!(
        sample(&knows.encode(), series),
        Some(0.0),
        "announced at zero before the first tick"
    );
    let mut tick = Tick::first("a");
    for demanded in [120, 80] {
        tick.next(with_demand(
            observation(0, tick.totals.ticks, 100, 400.0),
            demanded,
        ));
        tick.feed(&knows, "aaaaaaaaaaaa");
    }
    assert_eq!(sample(&knows.encode(), series), Some(200.0));

    let unknown = AgentMetrics::new(&[device(0)], true, false);
    unknown.announce("a", "aaaaaaaaaaaa");
    let mut tick = Tick::first("a");
    tick.next(observation(0, 0, 100, 400.0));
    tick.feed(&unknown, "aaaaaaaaaaaa");
    let text = unknown.encode();
    assert!(
        !text.contains("tokwatt_gpu_tokens_demanded_total{"),
        "no demand series without demand:\n{text}"
    );
}

#[test]
fn requests_give_ttft_prefill_tokens_and_the_request_energy_histogram() {
    let metrics = AgentMetrics::new(&[device(0)], true, false);
    let mut tick = Tick::first("a");
    // A decode-only source: none of the requests series.
    tick.next(observation(0, 0, 100, 400.0));
    tick.feed(&metrics, "aaaaaaaaaaaa");
    let text = metrics.encode();
    for absent in [
        "tokwatt_gpu_ttft_p99_seconds{",
        "tokwatt_gpu_prefill_tokens_total{",
        "tokwatt_gpu_request_energy_joules_bucket{",
    ] {
        assert!(!text.contains(absent), "{absent}:\n{text}");
    }

    let with_requests = |tick_no: u64, ttft_ms: Option<f64>, joules: &[f64]| {
        let mut obs = observation(0, tick_no, 100, 400.0);
        let mut energy = tokwatt_core::types::RequestEnergy::default();
        for &j in joules {
            energy.record(j);
        }
        obs.requests = Some(tokwatt_core::types::RequestsWindow {
            prefill_tokens: 2048,
            first_tokens: u64::from(ttft_ms.is_some()),
            ttft_p99_ms: ttft_ms,
            prefill_time_share: Some(0.4),
            preemptions: Some(0),
            energy: Some(energy),
        });
        obs
    };
    tick.next(with_requests(1, Some(250.0), &[3.0, 40.0]));
    tick.feed(&metrics, "aaaaaaaaaaaa");
    tick.next(with_requests(2, Some(125.0), &[0.2]));
    tick.feed(&metrics, "aaaaaaaaaaaa");
    let text = metrics.encode();
    assert_eq!(
        sample(
            &text,
            "tokwatt_gpu_ttft_p99_seconds{gpu=\"0\",UUID=\"GPU-0\",modelName=\"sim\"}"
        ),
        Some(0.125)
    );
    let labels = "gpu=\"0\",UUID=\"GPU-0\",modelName=\"sim\",policy=\"a\",version=\"aaaaaaaaaaaa\"";
    assert_eq!(
        sample(
            &text,
            &format!("tokwatt_gpu_prefill_tokens_total{{{labels}}}")
        ),
        Some(4096.0)
    );
    // Buckets are cumulative: 0.2 J under 0.5, 3 J under 5, 40 J under 50.
    let bucket = |le: &str| {
        sample(
            &text,
            &format!("tokwatt_gpu_request_energy_joules_bucket{{le=\"{le}\",{labels}}}"),
        )
    };
    assert_eq!(bucket("0.5"), Some(1.0));
    assert_eq!(bucket("2.0"), Some(1.0));
    assert_eq!(bucket("5.0"), Some(2.0));
    assert_eq!(bucket("50.0"), Some(3.0));
    assert_eq!(bucket("+Inf"), Some(3.0));
    assert_eq!(
        sample(
            &text,
            &format!("tokwatt_gpu_request_energy_joules_count{{{labels}}}")
        ),
        Some(3.0)
    );
    assert_eq!(
        sample(
            &text,
            &format!("tokwatt_gpu_request_energy_joules_sum{{{labels}}}")
        ),
        Some(43.2)
    );

    // A window in which no request got its first token: no TTFT, not a zero one.
    tick.next(with_requests(3, None, &[]));
    tick.feed(&metrics, "aaaaaaaaaaaa");
    assert!(!metrics.encode().contains("tokwatt_gpu_ttft_p99_seconds{"));
}

/// dcgm-exporter's labels: every per-GPU series carries the board's UUID and model name
/// beside its index (an index can change across reboots; a dashboard follows the UUID).
#[test]
fn every_gpu_series_names_its_board_by_uuid_and_model() {
    let mut second = device(1);
    second.uuid = "GPU-8f7d7400-cf3f-3d61-8883-624982a1b30e".into();
    second.name = "NVIDIA H200".into();
    let metrics = AgentMetrics::new(&[device(0), second], true, false);
    let mut tick = Tick::first("a");
    tick.next(observation(1, 0, 100, 400.0));
    tick.feed(&metrics, "aaaaaaaaaaaa");
    let text = metrics.encode();
    let board =
        "gpu=\"1\",UUID=\"GPU-8f7d7400-cf3f-3d61-8883-624982a1b30e\",modelName=\"NVIDIA H200\"";
    for series in [
        format!("tokwatt_gpu_power_watts{{{board}}} 400"),
        format!("tokwatt_gpu_clock_event_ticks_total{{{board},reason=\"sw_power_cap\"}} 1"),
        format!("tokwatt_gpu_tokens_total{{{board},policy=\"a\",version=\"aaaaaaaaaaaa\"}} 100"),
    ] {
        assert!(text.contains(&series), "{series} in\n{text}");
    }
    for line in text.lines().filter(|l| l.starts_with("tokwatt_gpu_")) {
        assert!(line.contains(",UUID=\"GPU-"), "{line}");
        assert!(line.contains(",modelName=\""), "{line}");
    }

    // A GPU the agent was not told of at the start: its index, and empty labels (which
    // Prometheus reads as none), never another board's.
    let metrics = AgentMetrics::new(&[device(0)], true, false);
    let mut tick = Tick::first("a");
    tick.next(observation(3, 0, 100, 400.0));
    tick.feed(&metrics, "aaaaaaaaaaaa");
    assert!(
        metrics
            .encode()
            .contains("tokwatt_gpu_power_watts{gpu=\"3\",UUID=\"\",modelName=\"\"} 400")
    );
}
