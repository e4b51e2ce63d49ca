//! The experiment on fake agents (a policy history each, a fake API) and a fake
//! Prometheus that scrapes them every 50 ms of the real clock.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::series;
use crate::ab::Decision;
use crate::fleet_ab::counters::{self, Series, Window};
use crate::fleet_ab::experiment::{self, BoxError, NodeControl, NodeState, Swapped};
use crate::fleet_ab::nodes::{ApiAddress, Selector};
use crate::fleet_ab::prometheus::ScrapeTarget;
use crate::fleet_ab::*;

/// A fake agent: its policy's history on the local clock, and what its API does.
struct FakeNode {
    name: String,
    original: NodePolicy,
    /// (local unix seconds, spec in force from then).
    history: Mutex<Vec<(f64, PathBuf)>>,
    /// Refuses the swap with this number (1-based), counting every swap asked of it.
    refuse_swap: Option<usize>,
    swaps_asked: Mutex<usize>,
    /// Tokens per second it makes: its load.
    load: f64,
    answers: bool,
    /// Its power domain, as its status says.
    place: Option<NodePlace>,
}

impl FakeNode {
    fn new(index: usize, load: f64) -> Self {
        let original = NodePolicy {
            name: "original".into(),
            version: "000000000001".into(),
            spec: format!("/specs/original-{index}.toml").into(),
            plugin: "/plugins/original.wasm".into(),
        };
        Self {
            name: format!("node-{index}"),
            history: Mutex::new(vec![(local_s(), original.spec.clone())]),
            original,
            refuse_swap: None,
            swaps_asked: Mutex::new(0),
            load,
            answers: true,
            place: None,
        }
    }

    fn spec_now(&self) -> PathBuf {
        self.history
            .lock()
            .expect("lock")
            .last()
            .map(|(_, spec)| spec.clone())
            .unwrap_or_default()
    }

    /// Joules per token under `spec`: arm B (`/specs/b.toml`) uses 25 % less.
    fn joules_per_token(spec: &Path) -> f64 {
        if spec == Path::new("/specs/b.toml") {
            0.3
        } else {
            0.4
        }
    }

    /// Its counters at local time `t`: (ticks, tokens, energy, swaps).
    fn counters_at(&self, t: f64) -> (f64, f64, f64, f64) {
        let history = self.history.lock().expect("lock");
        let (mut tokens, mut energy) = (0.0, 0.0);
        let start = history.first().map_or(t, |h| h.0);
        for (i, &(from, ref spec)) in history.iter().enumerate() {
            let to = history.get(i + 1).map_or(t, |next| next.0).min(t);
            if to > from {
                tokens += self.load * (to - from);
                energy += self.load * (to - from) * Self::joules_per_token(spec);
            }
        }
        let ticks = (t - start).max(0.0) * 100.0;
        (ticks, tokens, energy, (history.len() - 1) as f64)
    }
}

impl NodeControl for FakeNode {
    fn status(&self) -> Result<NodeState, BoxError> {
        if !self.answers {
            return Err("connection refused".into());
        }
        let spec = self.spec_now();
        let policy = if spec == self.original.spec {
            self.original.clone()
        } else {
            NodePolicy {
                name: spec
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                version: "00000000000a".into(),
                plugin: "/plugins/arm.wasm".into(),
                spec,
            }
        };
        Ok(NodeState {
            policy,
            paused: false,
            simulated: true,
            fleet: self.place.clone(),
        })
    }

    fn swap(&self, spec: &Path, plugin: Option<&Path>, fresh: bool) -> Result<Swapped, BoxError> {
        let asked = {
            let mut asked = self.swaps_asked.lock().expect("lock");
            *asked += 1;
            *asked
        };
        if self.refuse_swap == Some(asked) {
            return Err(format!("the spec {} does not load", spec.display()).into());
        }
        if spec == self.original.spec {
            assert_eq!(
                plugin,
                Some(self.original.plugin.as_path()),
                "the same component"
            );
            assert!(!fresh);
        } else {
            assert!(fresh, "every half starts fresh");
        }
        self.history
            .lock()
            .expect("lock")
            .push((local_s(), spec.to_owned()));
        Ok(Swapped {
            policy: "arm".into(),
            state_carried: Some(false),
        })
    }
}

fn local_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64()
}

/// Scrapes every `SCRAPE_S` on the local clock, of every node, with its counters.
struct FakePrometheus<'a> {
    nodes: &'a [FakeNode],
}

const SCRAPE_S: f64 = 0.05;

impl CounterSource for FakePrometheus<'_> {
    fn now_s(&self) -> Result<f64, BoxError> {
        Ok(local_s())
    }

    fn targets(&self) -> Result<Vec<ScrapeTarget>, BoxError> {
        Ok(self
            .nodes
            .iter()
            .map(|node| ScrapeTarget {
                labels: BTreeMap::from([("instance".to_owned(), node.name.clone())]),
                scrape_url: format!("http://{}/metrics", node.name),
                scrape_interval_s: Some(SCRAPE_S),
                health: "up".into(),
                last_error: String::new(),
            })
            .collect())
    }

    fn samples(
        &self,
        metric: &str,
        selector: &Selector,
        window: Window,
    ) -> Result<Vec<Series>, BoxError> {
        let Some(node) = self
            .nodes
            .iter()
            .find(|n| selector.0.get("instance") == Some(&n.name))
        else {
            return Ok(Vec::new());
        };
        let first = (window.start_s / SCRAPE_S).ceil() as i64;
        let last = (window.end_s.min(local_s()) / SCRAPE_S).floor() as i64;
        let times: Vec<f64> = (first..=last).map(|k| k as f64 * SCRAPE_S).collect();
        let value = |t: f64| {
            let (ticks, tokens, energy, swaps) = node.counters_at(t);
            match metric {
                counters::UP => 1.0,
                counters::TICKS => ticks,
                counters::TOKENS | counters::DEMANDED => tokens,
                counters::ENERGY => energy,
                counters::SWAPS => swaps,
                _ => 0.0,
            }
        };
        let labels: &[(&str, &str)] = match metric {
            counters::TOKENS | counters::ENERGY | counters::VIOLATIONS | counters::DEMANDED => {
                &[("gpu", "0")]
            }
            _ => &[],
        };
        Ok(vec![series(
            labels,
            &times.iter().map(|&t| (t, value(t))).collect::<Vec<_>>(),
        )])
    }
}

fn fleet_of(loads: &[f64]) -> Vec<FakeNode> {
    loads
        .iter()
        .enumerate()
        .map(|(i, &load)| FakeNode::new(i, load))
        .collect()
}

fn nodes_of(fakes: &[FakeNode]) -> Vec<FleetNode> {
    fakes
        .iter()
        .map(|fake| FleetNode {
            name: fake.name.clone(),
            api: ApiAddress::Socket(format!("/run/{}.sock", fake.name).into()),
            selector: Selector(BTreeMap::from([("instance".to_owned(), fake.name.clone())])),
            load: None,
        })
        .collect()
}

fn settings() -> Settings {
    Settings {
        a: "/specs/a.toml".into(),
        b: "/specs/b.toml".into(),
        half: Duration::from_millis(300),
        settle: Duration::from_millis(50),
        baseline: Duration::from_millis(200),
        seed: 1,
        alpha: 0.02,
        accept_unknown_demand: false,
        max_scrape_gap: None,
        source: "fake".into(),
    }
}

/// Runs the experiment on `fakes` until done or `stop`.
fn run_on(fakes: &[FakeNode], stop: &AtomicBool) -> Result<FleetAbReport, FleetAbError> {
    run_in(fakes, None, stop)
}

/// [`run_on`], the nodes' power domains kept in `domains`.
fn run_in(
    fakes: &[FakeNode],
    domains: Option<&dyn PowerDomains>,
    stop: &AtomicBool,
) -> Result<FleetAbReport, FleetAbError> {
    let nodes = nodes_of(fakes);
    let controls: Vec<&dyn NodeControl> = fakes.iter().map(|f| f as &dyn NodeControl).collect();
    let prometheus = FakePrometheus { nodes: fakes };
    let fleet = Fleet {
        nodes: &nodes,
        controls: &controls,
        counters: &prometheus,
        domains,
    };
    // Time for the baseline's scrapes.
    std::thread::sleep(Duration::from_millis(250));
    let prepared = experiment::prepare(fleet, &settings())?;
    experiment::run(fleet, &settings(), &prepared, stop, &mut |_| {})
}

fn assert_all_back(fakes: &[FakeNode]) {
    for fake in fakes {
        assert_eq!(fake.spec_now(), fake.original.spec, "{} is back", fake.name);
    }
}

#[test]
fn a_fleet_ab_swaps_every_pair_crosses_over_and_puts_every_node_back() {
    let fakes = fleet_of(&[
        1000.0, 1100.0, 2000.0, 2100.0, 3000.0, 3050.0, 500.0, 520.0, 9.0,
    ]);
    let report = run_on(&fakes, &AtomicBool::new(false)).expect("the experiment runs");
    assert_all_back(&fakes);
    assert_eq!(report.verdict.pairs, 4);
    assert_eq!(report.verdict.decision, Decision::B, "{:?}", report.verdict);
    assert!(
        (report.verdict.ratio_b_over_a - 4.0 / 3.0).abs() < 0.05,
        "{:?}",
        report.verdict
    );
    assert_eq!(report.left_out.as_deref(), Some("node-8"));
    assert_eq!(
        fakes[8].history.lock().expect("lock").len(),
        1,
        "the node left out is never swapped"
    );
    assert_eq!(report.put_back.restored.len(), 8);
    assert!(report.put_back.failed.is_empty());
    assert_eq!(report.simulated_nodes.len(), 9);
    for node in &report.nodes[..8] {
        assert_eq!(node.halves.len(), 2, "{}", node.name);
        assert_ne!(node.halves[0].arm, node.halves[1].arm);
        assert_eq!(node.halves[0].state_carried, Some(false));
        assert!(node.halves[1].measured.figures.tokens > 0);
    }
    let json = serde_json::to_value(&report).expect("JSON");
    for key in [
        "format_version",
        "estimand",
        "unit_of_replication",
        "verdict",
        "pairs",
        "nodes",
        "left_out",
        "windows",
        "put_back",
    ] {
        assert!(json.get(key).is_some(), "fleet-ab.json has `{key}`");
    }
}

#[test]
fn a_refused_swap_stops_the_experiment_naming_the_node_and_puts_back_the_others() {
    for refused_at in [1, 2] {
        let mut fakes = fleet_of(&[10.0, 11.0, 20.0, 21.0, 30.0, 31.0, 40.0, 41.0]);
        fakes[5].refuse_swap = Some(refused_at);
        let error = run_on(&fakes, &AtomicBool::new(false)).expect_err("refused");
        let text = error.to_string();
        assert!(text.contains("node `node-5`"), "{text}");
        assert!(text.contains("does not load"), "{text}");
        let FleetAbError::Stopped { put_back, .. } = error else {
            panic!("stopped after changing nodes: {text}");
        };
        assert!(put_back.failed.is_empty(), "{put_back}");
        assert_eq!(
            put_back.restored.len(),
            if refused_at == 1 { 7 } else { 8 },
            "{put_back}"
        );
        assert_all_back(&fakes);
    }
}

#[test]
fn an_interrupt_puts_every_node_back() {
    let fakes = fleet_of(&[10.0, 11.0, 20.0, 21.0, 30.0, 31.0, 40.0, 41.0]);
    let stop = AtomicBool::new(false);
    let error = std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(450));
            stop.store(true, Ordering::Relaxed);
        });
        run_on(&fakes, &stop).expect_err("interrupted")
    });
    assert!(
        matches!(&error, FleetAbError::Stopped { cause, .. } if matches!(**cause, FleetAbError::Interrupted)),
        "{error}"
    );
    assert!(
        error.to_string().contains("back on their policies"),
        "{error}"
    );
    assert_all_back(&fakes);
}

#[test]
fn what_is_wrong_before_the_start_changes_nothing() {
    // A node that does not answer.
    let mut fakes = fleet_of(&[10.0, 11.0, 20.0, 21.0, 30.0, 31.0, 40.0, 41.0]);
    fakes[3].answers = false;
    let error = run_on(&fakes, &AtomicBool::new(false)).expect_err("unreachable");
    let text = error.to_string();
    assert!(
        matches!(error, FleetAbError::Unchanged(_))
            && text.contains("node `node-3`")
            && text.contains("nothing was changed on any node"),
        "{text}"
    );
    // Too few nodes for a verdict.
    let fakes = fleet_of(&[10.0, 11.0, 20.0, 21.0, 30.0, 31.0, 40.0]);
    let text = run_on(&fakes, &AtomicBool::new(false))
        .expect_err("too few")
        .to_string();
    assert!(text.contains("at least 4 pairs (8 nodes)"), "{text}");
    // A node whose policy could not be swapped back in.
    let mut fakes = fleet_of(&[10.0, 11.0, 20.0, 21.0, 30.0, 31.0, 40.0, 41.0]);
    fakes[0].original.spec = "relative/original.toml".into();
    fakes[0].history = Mutex::new(vec![(local_s(), fakes[0].original.spec.clone())]);
    let text = run_on(&fakes, &AtomicBool::new(false))
        .expect_err("relative")
        .to_string();
    assert!(text.contains("absolute `[policy] spec`"), "{text}");
    for fake in &fakes {
        assert_eq!(*fake.swaps_asked.lock().expect("lock"), 0, "{}", fake.name);
    }
}

// ---------------------------------------------------------------------------------------
// Power domains

/// What a fake domain store does to one node's grant, once, this long after the freeze.
#[derive(Debug, Clone, Copy)]
struct Event {
    after_s: f64,
    node: usize,
    /// Watts added to its grant (negative: a cut).
    delta_w: f64,
    /// Marked as a cut the budget forced.
    forced: bool,
}

/// A domain store: one domain `rack-1`, every node granted 500 W + 10 W × its index.
#[derive(Default)]
struct FakeDomains {
    state: Mutex<DomainsState>,
    event: Option<Event>,
    /// Another experiment holds the freeze.
    held_by_other: bool,
    /// The freeze lapses this long after it was made (the store stopped hearing us).
    lapses_after_s: Option<f64>,
}

#[derive(Default)]
struct DomainsState {
    frozen_at: Option<f64>,
    freezes: usize,
    thaws: usize,
    reads: usize,
    event_done: bool,
    grants: BTreeMap<String, GrantSeen>,
}

impl FakeDomains {
    fn new(nodes: usize) -> Self {
        let fake = Self::default();
        fake.state.lock().expect("lock").grants = (0..nodes)
            .map(|i| {
                (
                    format!("node-{i}"),
                    GrantSeen {
                        generation: 3,
                        watts: 500.0 + 10.0 * i as f64,
                        forced_cut: false,
                    },
                )
            })
            .collect();
        fake
    }
}

impl PowerDomains for FakeDomains {
    fn freeze(&self, domain: &str, _why: &str) -> Result<String, BoxError> {
        assert_eq!(domain, "rack-1");
        let mut state = self.state.lock().expect("lock");
        state.freezes += 1;
        state.frozen_at = Some(local_s());
        Ok("the test (pid 1)".into())
    }

    fn read(&self, domain: &str) -> Result<DomainReading, BoxError> {
        assert_eq!(domain, "rack-1");
        let mut state = self.state.lock().expect("lock");
        state.reads += 1;
        let since = state.frozen_at.map(|at| local_s() - at);
        if let (Some(event), Some(since)) = (self.event, since)
            && since >= event.after_s
            && !state.event_done
        {
            state.event_done = true;
            let grant = state
                .grants
                .get_mut(&format!("node-{}", event.node))
                .expect("a node");
            grant.generation += 1;
            grant.watts += event.delta_w;
            grant.forced_cut = event.forced;
        }
        let lapsed = matches!((self.lapses_after_s, since), (Some(at), Some(since)) if since >= at);
        Ok(DomainReading {
            grants: state
                .grants
                .iter()
                .map(|(n, g)| (n.clone(), Some(*g)))
                .collect(),
            frozen_by_us: state.frozen_at.is_some() && !lapsed,
            frozen_by_other: self
                .held_by_other
                .then(|| "tokwatt fleet ab on another host".to_owned()),
        })
    }

    fn thaw(&self, _domain: &str) -> Result<(), BoxError> {
        let mut state = self.state.lock().expect("lock");
        state.thaws += 1;
        state.frozen_at = None;
        Ok(())
    }
}

/// Eight nodes of `rack-1`.
fn fleet_in_a_domain() -> Vec<FakeNode> {
    let mut fakes = fleet_of(&[10.0, 11.0, 20.0, 21.0, 30.0, 31.0, 40.0, 41.0]);
    for fake in &mut fakes {
        fake.place = Some(NodePlace {
            domain: "rack-1".into(),
            node: fake.name.clone(),
        });
    }
    fakes
}

#[test]
fn nodes_in_a_power_domain_are_refused_without_its_store_naming_the_bias_and_the_fix() {
    let fakes = fleet_in_a_domain();
    let error = run_on(&fakes, &AtomicBool::new(false)).expect_err("refused");
    let text = error.to_string();
    for expected in [
        "`node-0` (rack-1)",
        "share the power budget of `rack-1`",
        "a greedier arm would win watts from the other arm's nodes",
        "--etcd",
        "nothing was changed on any node",
    ] {
        assert!(text.contains(expected), "{expected:?}: {text}");
    }
    for fake in &fakes {
        assert_eq!(*fake.swaps_asked.lock().expect("lock"), 0, "{}", fake.name);
    }
    // Frozen by another experiment: refused too, naming it.
    let other = FakeDomains {
        held_by_other: true,
        ..FakeDomains::new(8)
    };
    let text = run_in(&fakes, Some(&other), &AtomicBool::new(false))
        .expect_err("held")
        .to_string();
    assert!(
        text.contains("frozen already, by tokwatt fleet ab on another host")
            && text.contains("nothing was changed"),
        "{text}"
    );
    assert_eq!(other.state.lock().expect("lock").freezes, 0);
}

#[test]
fn a_domain_is_frozen_for_the_whole_experiment_and_its_grants_recorded() {
    let fakes = fleet_in_a_domain();
    let domains = FakeDomains::new(8);
    let report = run_in(&fakes, Some(&domains), &AtomicBool::new(false)).expect("runs");
    assert_all_back(&fakes);
    let state = domains.state.lock().expect("lock");
    assert_eq!((state.freezes, state.thaws), (1, 1));
    assert!(state.reads >= 8, "read through the halves: {}", state.reads);
    assert_eq!(report.domains.len(), 1);
    assert_eq!(report.domains[0].frozen_by, "the test (pid 1)");
    assert!(report.domains[0].thawed);
    assert_eq!(report.domains[0].nodes.len(), 8);
    assert_eq!(report.grant_changes, []);
    for (i, node) in report.nodes.iter().enumerate() {
        let held = Some(GrantSeen {
            generation: 3,
            watts: 500.0 + 10.0 * i as f64,
            forced_cut: false,
        });
        assert_eq!(
            (node.grant_start, node.grant_end),
            (held, held),
            "{}",
            node.name
        );
        assert_eq!(
            node.fleet.as_ref().map(|p| p.domain.as_str()),
            Some("rack-1")
        );
    }
    let json = serde_json::to_value(&report).expect("JSON");
    for key in ["domains", "grant_changes"] {
        assert!(json.get(key).is_some(), "fleet-ab.json has `{key}`");
    }
    assert!(json["nodes"][0].get("grant_start").is_some());
}

#[test]
fn a_grant_that_moves_in_a_measured_window_fails_the_experiment_but_a_forced_cut_does_not() {
    // 250 ms after the freeze: inside the first half's window (50 ms settle, 300 ms).
    let at = |delta_w: f64, forced: bool| Event {
        after_s: 0.25,
        node: 3,
        delta_w,
        forced,
    };
    for (event, allowed) in [
        (at(150.0, false), false),  // a greedy node raised
        (at(-150.0, false), false), // a cut to pay for another's raise
        (at(-150.0, true), true),   // a cut the budget forced
    ] {
        let fakes = fleet_in_a_domain();
        let domains = FakeDomains {
            event: Some(event),
            ..FakeDomains::new(8)
        };
        let outcome = run_in(&fakes, Some(&domains), &AtomicBool::new(false));
        assert_all_back(&fakes);
        assert_eq!(domains.state.lock().expect("lock").thaws, 1);
        let report = match outcome {
            Ok(report) => {
                assert!(allowed, "{event:?} passed");
                report
            }
            Err(FleetAbError::Biased { report, moved, .. }) => {
                assert!(!allowed, "{event:?} failed");
                assert_eq!(moved.len(), 1);
                let text = FleetAbError::Biased {
                    report: report.clone(),
                    moved,
                    put_back: report.put_back.clone(),
                }
                .to_string();
                assert!(
                    text.contains("node `node-3`'s grant in domain `rack-1` went from 530 W")
                        && text.contains("no verdict is given"),
                    "{text}"
                );
                *report
            }
            Err(other) => panic!("{event:?}: {other}"),
        };
        let [change] = report.grant_changes.as_slice() else {
            panic!("one change: {:?}", report.grant_changes);
        };
        assert_eq!(change.node, "node-3");
        assert!(change.in_window, "{change:?} {:?}", report.windows);
        assert_eq!(change.forced_cut, allowed);
        assert_eq!(
            report.nodes[3].grant_end.map(|g| g.watts),
            Some(530.0 + event.delta_w)
        );
    }
}

#[test]
fn a_freeze_that_lapses_stops_the_experiment_and_an_interrupt_thaws() {
    let fakes = fleet_in_a_domain();
    let domains = FakeDomains {
        lapses_after_s: Some(0.2),
        ..FakeDomains::new(8)
    };
    let error = run_in(&fakes, Some(&domains), &AtomicBool::new(false)).expect_err("lapsed");
    let text = error.to_string();
    assert!(
        matches!(&error, FleetAbError::Stopped { .. }) && text.contains("its freeze is gone"),
        "{text}"
    );
    assert_all_back(&fakes);
    assert_eq!(domains.state.lock().expect("lock").thaws, 1);

    let fakes = fleet_in_a_domain();
    let domains = FakeDomains::new(8);
    let stop = AtomicBool::new(false);
    let error = std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(450));
            stop.store(true, Ordering::Relaxed);
        });
        run_in(&fakes, Some(&domains), &stop).expect_err("interrupted")
    });
    assert!(
        matches!(&error, FleetAbError::Stopped { cause, .. } if matches!(**cause, FleetAbError::Interrupted)),
        "{error}"
    );
    assert_all_back(&fakes);
    assert_eq!(domains.state.lock().expect("lock").thaws, 1);
}
