//! The experiment: everything checked before any node changes ([`prepare`]), then two
//! halves ([`run`]): every node of a pair swapped to its arm, a settling time, the
//! measured window, the arms swapped, again; then every node put back on the policy it
//! had. Any failure after the first swap (a refused swap, a node that left its policy, a
//! gap in the scrapes, an interrupt) stops the experiment, and the nodes changed so far
//! are put back before the error is returned.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::counters::{self, Hold, MeasureError, Measured, Series, Window};
use super::nodes::{ApiAddress, FleetNode, Selector};
use super::plan::{Assignment, MIN_PAIRS, assign};
use super::prometheus::{Prometheus, PrometheusError, ScrapeTarget};
use super::verdict::{FleetVerdict, PairSums, verdict};
use crate::ab::{AbError, Arm, SequentialPlan};

/// Version of `fleet-ab.json`'s layout.
pub const FLEET_AB_FORMAT_VERSION: u32 = 1;

/// The errors a node's API or Prometheus gives, in their own types.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The policy a node runs, as its control API names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodePolicy {
    pub name: String,
    /// The plugin's content version.
    pub version: String,
    pub spec: PathBuf,
    pub plugin: PathBuf,
}

/// What the experiment needs of a node's status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeState {
    pub policy: NodePolicy,
    pub paused: bool,
    pub simulated: bool,
}

/// A swap that took effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Swapped {
    /// The policy in charge afterwards.
    pub policy: String,
    pub state_carried: Option<bool>,
}

/// A node's control API (`tokwatt serve`'s, through its client).
pub trait NodeControl: Sync {
    fn status(&self) -> Result<NodeState, BoxError>;
    /// Swaps in `spec` (with `plugin` overriding the spec's), without the running policy's
    /// state where `fresh`; returns once it took effect.
    fn swap(&self, spec: &Path, plugin: Option<&Path>, fresh: bool) -> Result<Swapped, BoxError>;
}

/// The nodes, their control APIs (in the same order) and where their counters are read.
#[derive(Clone, Copy)]
pub struct Fleet<'a> {
    pub nodes: &'a [FleetNode],
    pub controls: &'a [&'a dyn NodeControl],
    pub counters: &'a dyn CounterSource,
}

impl std::fmt::Debug for Fleet<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("nodes", &self.nodes)
            .finish_non_exhaustive()
    }
}

/// Where the nodes' counters are read (a Prometheus server).
pub trait CounterSource: Sync {
    /// Its clock, unix seconds.
    fn now_s(&self) -> Result<f64, BoxError>;
    fn targets(&self) -> Result<Vec<ScrapeTarget>, BoxError>;
    fn samples(
        &self,
        metric: &str,
        selector: &Selector,
        window: Window,
    ) -> Result<Vec<Series>, BoxError>;
}

impl CounterSource for Prometheus {
    fn now_s(&self) -> Result<f64, BoxError> {
        Ok(Prometheus::now_s(self)?)
    }

    fn targets(&self) -> Result<Vec<ScrapeTarget>, BoxError> {
        Ok(Prometheus::targets(self)?)
    }

    fn samples(
        &self,
        metric: &str,
        selector: &Selector,
        window: Window,
    ) -> Result<Vec<Series>, BoxError> {
        Ok(Prometheus::samples(self, metric, selector, window)?)
    }
}

impl From<PrometheusError> for FleetAbError {
    fn from(error: PrometheusError) -> Self {
        FleetAbError::Prometheus(Box::new(error))
    }
}

/// How the experiment runs.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// The arms' policy specs, as paths on the nodes' machines.
    pub a: PathBuf,
    pub b: PathBuf,
    /// Each half's measured window.
    pub half: Duration,
    /// After each swap, before the window: the new policy's first moves and the old
    /// one's queue are not measured.
    pub settle: Duration,
    /// Before the start: the window the loads are measured over (where not given) and
    /// every node's series are checked on.
    pub baseline: Duration,
    pub seed: u64,
    pub alpha: f64,
    /// Judge the objective on violations alone where some node does not know its demand.
    pub accept_unknown_demand: bool,
    /// The longest stretch without a successful scrape of a node; default three of its
    /// scrape intervals.
    pub max_scrape_gap: Option<Duration>,
    /// Where the counters are read, for the report.
    pub source: String,
}

/// Why the experiment did not run or did not finish.
#[derive(Debug, thiserror::Error)]
pub enum FleetAbError {
    #[error("{0}")]
    Settings(String),
    #[error(
        "{nodes} node(s) make {pairs} pair(s); a verdict needs at least {MIN_PAIRS} pairs ({} nodes), since the pairs of nodes are its units: add nodes",
        MIN_PAIRS * 2
    )]
    TooFewPairs { nodes: usize, pairs: usize },
    #[error("Prometheus: {0}")]
    Prometheus(BoxError),
    #[error("node `{node}`: {why}")]
    Node { node: String, why: String },
    #[error("node `{node}`, {what}: {source}")]
    Measure {
        node: String,
        what: &'static str,
        #[source]
        source: MeasureError,
    },
    #[error("the verdict: {0}")]
    Stats(#[from] AbError),
    #[error("interrupted")]
    Interrupted,
    /// Raised before any node changed.
    #[error("{0}; nothing was changed on any node")]
    Unchanged(Box<FleetAbError>),
    /// Raised after some node changed; `put_back` says what became of them.
    #[error("{cause}; {put_back}")]
    Stopped {
        cause: Box<FleetAbError>,
        put_back: PutBack,
    },
}

/// The nodes put back on their policies at the end, and those that could not be.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PutBack {
    pub restored: Vec<String>,
    pub failed: Vec<PutBackFailure>,
}

/// A node left on the experiment's policy, why, and the command that puts it back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PutBackFailure {
    pub node: String,
    pub why: String,
    pub fix: String,
}

impl std::fmt::Display for PutBack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.failed.is_empty() {
            return match self.restored.len() {
                0 => f.write_str("no node had been changed"),
                n => write!(
                    f,
                    "the {n} node(s) changed are back on their policies ({})",
                    self.restored.join(", ")
                ),
            };
        }
        write!(f, "NOT put back on their policies:")?;
        for failure in &self.failed {
            write!(
                f,
                " node `{}` ({}): run `{}`;",
                failure.node, failure.why, failure.fix
            )?;
        }
        if !self.restored.is_empty() {
            write!(f, " put back: {}", self.restored.join(", "))?;
        }
        Ok(())
    }
}

/// How each node's load was had.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LoadSource {
    /// From the nodes file.
    Given,
    /// Tokens per control tick over the baseline window.
    TokensPerTick,
}

/// What was found before anything changed: enough to run, and to show the plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    pub originals: Vec<NodeState>,
    pub loads: Vec<f64>,
    pub load_source: LoadSource,
    pub baseline: Vec<Measured>,
    pub baseline_window: Window,
    pub assignment: Assignment,
    pub scrape_interval_s: Vec<f64>,
    pub max_gap_s: Vec<f64>,
    /// Prometheus's clock minus this machine's, seconds.
    pub clock_offset_s: f64,
    /// Nodes taking part whose demand is unknown (no demand counter).
    pub demand_unknown_on: Vec<String>,
}

/// One node's half.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HalfRecord {
    pub arm: Arm,
    /// The policy its status named after the swap.
    pub policy: NodePolicy,
    pub state_carried: Option<bool>,
    pub measured: Measured,
}

/// One node in the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeReport {
    pub name: String,
    pub load: f64,
    /// The policy it ran before, and runs again after.
    pub original: NodePolicy,
    pub simulated: bool,
    /// `a-first`, `b-first` or `left-out`.
    pub part: String,
    /// Its pair, counted from 0.
    pub pair: Option<usize>,
    pub baseline: Measured,
    pub halves: Vec<HalfRecord>,
}

/// One pair of nodes in the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairReport {
    pub a_first: String,
    pub b_first: String,
    #[serde(flatten)]
    pub sums: PairSums,
}

/// `fleet-ab.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FleetAbReport {
    pub format_version: u32,
    pub a: PathBuf,
    pub b: PathBuf,
    /// What the ratio estimates, in words.
    pub estimand: String,
    pub unit_of_replication: String,
    pub min_pairs: usize,
    pub verdict: FleetVerdict,
    pub pairs: Vec<PairReport>,
    pub nodes: Vec<NodeReport>,
    pub left_out: Option<String>,
    /// Nodes without a demand counter: their served demand is unknown.
    pub demand_unknown_on: Vec<String>,
    pub accept_unknown_demand: bool,
    /// Nodes whose figures are the simulator's, never a GPU's.
    pub simulated_nodes: Vec<String>,
    pub load_source: LoadSource,
    /// The two halves' measured windows, on Prometheus's clock.
    pub windows: Vec<Window>,
    pub baseline_window: Window,
    pub half_s: f64,
    pub settle_s: f64,
    pub seed: u64,
    pub alpha: f64,
    pub source: String,
    pub put_back: PutBack,
}

/// What the experiment estimates, in words (`fleet-ab.json`'s `estimand`).
pub const ESTIMAND: &str = "the fleet's tokens per joule under B over A: per pair of load-matched \
nodes, each arm's tokens over its energy summed over its two halves (one on each node, one \
in each half, so the period and the node cancel within the pair), settled (the settling time \
after each swap is not measured); the ratio is exp(mean of the pairs' ln(B/A))";
/// What the statistics resample (`fleet-ab.json`'s `unit_of_replication`).
pub const UNIT: &str = "a pair of load-matched nodes: each half is a fresh instance of its arm's \
policy on its own node, so pairs are independent of each other (the halves of one adaptive \
instance never would be)";

fn node_error(node: &FleetNode, why: impl std::fmt::Display) -> FleetAbError {
    FleetAbError::Node {
        node: node.name.clone(),
        why: why.to_string(),
    }
}

/// The local clock, unix seconds.
fn local_now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Checks everything that can be checked without changing a node, and makes the plan:
/// the settings, every node's status, target and series, the baseline, the pairs.
pub fn prepare(fleet: Fleet<'_>, settings: &Settings) -> Result<Prepared, FleetAbError> {
    prepare_inner(fleet, settings).map_err(|error| FleetAbError::Unchanged(Box::new(error)))
}

fn prepare_inner(fleet: Fleet<'_>, settings: &Settings) -> Result<Prepared, FleetAbError> {
    let Fleet {
        nodes,
        controls,
        counters,
    } = fleet;
    if controls.len() != nodes.len() {
        return Err(FleetAbError::Settings(format!(
            "{} control APIs for {} nodes",
            controls.len(),
            nodes.len()
        )));
    }
    check_settings(settings)?;
    if nodes.len() / 2 < MIN_PAIRS {
        return Err(FleetAbError::TooFewPairs {
            nodes: nodes.len(),
            pairs: nodes.len() / 2,
        });
    }
    let prometheus = FleetAbError::Prometheus;
    let prometheus_now = counters.now_s().map_err(prometheus)?;
    let clock_offset_s = prometheus_now - local_now_s();

    let mut originals = Vec::with_capacity(nodes.len());
    for (node, control) in nodes.iter().zip(controls) {
        let state = control.status().map_err(|e| {
            node_error(
                node,
                format!("its control API at {} did not answer: {e}", node.api),
            )
        })?;
        if state.paused {
            return Err(node_error(
                node,
                "it is paused by an operator (its policy is not asked): resume it (`tokwatt policy resume`) or leave it out of the nodes file",
            ));
        }
        if !state.policy.spec.is_absolute() {
            return Err(node_error(
                node,
                format!(
                    "its policy's spec is the relative path {:?}, which its control API cannot swap back in at the end: start the agent with an absolute `[policy] spec` (or `--config` given as an absolute path)",
                    state.policy.spec
                ),
            ));
        }
        originals.push(state);
    }

    let targets = counters.targets().map_err(prometheus)?;
    let mut scrape_interval_s = Vec::with_capacity(nodes.len());
    let mut max_gap_s = Vec::with_capacity(nodes.len());
    for node in nodes {
        let matching: Vec<&ScrapeTarget> = targets
            .iter()
            .filter(|t| node.selector.matches(&t.labels))
            .collect();
        let target = match matching.as_slice() {
            [one] => *one,
            [] => {
                let instances: Vec<&str> = targets
                    .iter()
                    .filter_map(|t| t.labels.get("instance").map(String::as_str))
                    .take(8)
                    .collect();
                return Err(node_error(
                    node,
                    format!(
                        "Prometheus scrapes no target with the labels {} (its targets' instances: {}): fix the node's `instance`/`labels`, or add the agent's /metrics to Prometheus's scrape config",
                        node.selector,
                        if instances.is_empty() {
                            "none".to_owned()
                        } else {
                            instances.join(", ")
                        }
                    ),
                ));
            }
            many => {
                return Err(node_error(
                    node,
                    format!(
                        "the labels {} match {} of Prometheus's targets ({}): add labels that only this node's target carries",
                        node.selector,
                        many.len(),
                        many.iter()
                            .map(|t| t.scrape_url.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
        };
        if target.health != "up" {
            return Err(node_error(
                node,
                format!(
                    "Prometheus's last scrape of {} is `{}`{}: is the agent's metrics listener up?",
                    target.scrape_url,
                    target.health,
                    if target.last_error.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", target.last_error)
                    }
                ),
            ));
        }
        let interval = match (target.scrape_interval_s, settings.max_scrape_gap) {
            (Some(interval), _) => interval,
            (None, Some(gap)) => gap.as_secs_f64() / 3.0,
            (None, None) => {
                return Err(node_error(
                    node,
                    "Prometheus does not say its target's scrape interval (an old Prometheus): pass --max-scrape-gap",
                ));
            }
        };
        if settings.half.as_secs_f64() < 3.0 * interval {
            return Err(FleetAbError::Settings(format!(
                "a half of {:?} is under three scrape intervals of node `{}` ({interval} s): make --half longer",
                settings.half, node.name
            )));
        }
        scrape_interval_s.push(interval);
        max_gap_s.push(
            settings
                .max_scrape_gap
                .map_or(3.0 * interval, |gap| gap.as_secs_f64()),
        );
    }

    let baseline_window = Window {
        start_s: prometheus_now - settings.baseline.as_secs_f64(),
        end_s: prometheus_now,
    };
    let mut baseline = Vec::with_capacity(nodes.len());
    for (index, node) in nodes.iter().enumerate() {
        let measured = measure_node(
            counters,
            node,
            baseline_window,
            max_gap_s[index],
            Hold::Scraped,
            "the baseline before the start (--baseline: has Prometheus scraped it that long?)",
        )?;
        baseline.push(measured);
    }

    let (loads, load_source): (Vec<f64>, LoadSource) = if nodes.iter().all(|n| n.load.is_some()) {
        (
            nodes.iter().map(|n| n.load.unwrap_or(0.0)).collect(),
            LoadSource::Given,
        )
    } else {
        (
            baseline.iter().map(Measured::tokens_per_tick).collect(),
            LoadSource::TokensPerTick,
        )
    };
    let named: Vec<(String, f64)> = nodes
        .iter()
        .zip(&loads)
        .map(|(node, &load)| (node.name.clone(), load))
        .collect();
    let assignment = assign(&named, settings.seed);
    let demand_unknown_on = assignment
        .taking_part()
        .filter(|&i| baseline[i].figures.tokens_demanded.is_none())
        .map(|i| nodes[i].name.clone())
        .collect();
    Ok(Prepared {
        originals,
        loads,
        load_source,
        baseline,
        baseline_window,
        assignment,
        scrape_interval_s,
        max_gap_s,
        clock_offset_s,
        demand_unknown_on,
    })
}

fn check_settings(settings: &Settings) -> Result<(), FleetAbError> {
    for (flag, spec) in [("--a", &settings.a), ("--b", &settings.b)] {
        if !spec.is_absolute() {
            return Err(FleetAbError::Settings(format!(
                "{flag} {}: give the spec's absolute path on the nodes' machines (the agents read it there)",
                spec.display()
            )));
        }
    }
    if settings.half.is_zero() || settings.baseline.is_zero() {
        return Err(FleetAbError::Settings(
            "--half and --baseline must be longer than zero".into(),
        ));
    }
    // The plan checks α (and that pairs make an interval) the way `tokwatt ab` does.
    SequentialPlan::single_look(MIN_PAIRS, settings.alpha, settings.seed)?;
    Ok(())
}

/// Node `node`'s figures over `window`, its series read from `counters`.
fn measure_node(
    counters: &dyn CounterSource,
    node: &FleetNode,
    window: Window,
    max_gap_s: f64,
    hold: Hold,
    what: &'static str,
) -> Result<Measured, FleetAbError> {
    let mut samples = std::collections::BTreeMap::new();
    for metric in counters::METRICS {
        let series = counters
            .samples(metric, &node.selector, window)
            .map_err(FleetAbError::Prometheus)?;
        samples.insert(metric.to_owned(), series);
    }
    counters::measure(&samples, window, max_gap_s, hold).map_err(|source| FleetAbError::Measure {
        node: node.name.clone(),
        what,
        source,
    })
}

/// Runs the experiment [`prepare`] planned; says what it does through `say`. Every node
/// changed is put back at the end, and on any failure or when `stop` is raised. The
/// report says whether every node is back (`put_back`).
pub fn run(
    fleet: Fleet<'_>,
    settings: &Settings,
    prepared: &Prepared,
    stop: &AtomicBool,
    say: &mut dyn FnMut(&str),
) -> Result<FleetAbReport, FleetAbError> {
    let Fleet {
        nodes,
        controls,
        counters,
    } = fleet;
    let mut runner = Runner {
        nodes,
        controls,
        counters,
        settings,
        prepared,
        stop,
        changed: vec![false; nodes.len()],
        halves: vec![Vec::new(); nodes.len()],
        windows: Vec::new(),
    };
    let outcome = runner.both_halves(say);
    say("putting every node back on its policy");
    let put_back = runner.put_back();
    let measured = match outcome {
        Ok(()) => runner.read_half(1, say),
        Err(error) => Err(error),
    };
    match measured {
        Err(cause) => Err(FleetAbError::Stopped {
            cause: Box::new(cause),
            put_back,
        }),
        Ok(()) => runner.report(put_back),
    }
}

/// A node's half as it goes: swapped into, checked, then measured.
#[derive(Debug, Clone)]
struct Half {
    arm: Arm,
    policy: NodePolicy,
    state_carried: Option<bool>,
    measured: Option<Measured>,
}

struct Runner<'a> {
    nodes: &'a [FleetNode],
    controls: &'a [&'a dyn NodeControl],
    counters: &'a dyn CounterSource,
    settings: &'a Settings,
    prepared: &'a Prepared,
    stop: &'a AtomicBool,
    /// Nodes swapped at least once: put back at the end.
    changed: Vec<bool>,
    /// Each node's halves, swapped into and then measured.
    halves: Vec<Vec<Half>>,
    windows: Vec<Window>,
}

impl Runner<'_> {
    fn prometheus_now(&self) -> f64 {
        local_now_s() + self.prepared.clock_offset_s
    }

    /// Sleeps until Prometheus's clock reads `t`, or the stop is raised.
    fn wait_until(&self, t: f64) -> Result<(), FleetAbError> {
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Err(FleetAbError::Interrupted);
            }
            let left = t - self.prometheus_now();
            if left <= 0.0 {
                return Ok(());
            }
            std::thread::sleep(Duration::from_secs_f64(left.min(0.1)));
        }
    }

    fn both_halves(&mut self, say: &mut dyn FnMut(&str)) -> Result<(), FleetAbError> {
        for half in 0..2 {
            let (a, b) = (&self.settings.a, &self.settings.b);
            let wanted: Vec<(usize, &Path, Arm)> = self
                .prepared
                .assignment
                .taking_part()
                .filter_map(|node| {
                    let arm = self.prepared.assignment.arm_of(node, half)?;
                    Some((
                        node,
                        if arm == Arm::A {
                            a.as_path()
                        } else {
                            b.as_path()
                        },
                        arm,
                    ))
                })
                .collect();
            say(&format!(
                "half {}: swapping {} nodes to their arm (fresh instances)",
                half + 1,
                wanted.len()
            ));
            self.swap_in(&wanted)?;
            let swapped_at = self.prometheus_now();
            let window = Window {
                start_s: swapped_at + self.settle_s(),
                end_s: swapped_at + self.settle_s() + self.settings.half.as_secs_f64(),
            };
            self.windows.push(window);
            if half == 1 {
                // The first half is on record by now; reading it here stops a bad run early.
                self.read_half(0, say)?;
            }
            say(&format!(
                "half {}: settling {:?}, then measuring {:?}",
                half + 1,
                self.settings.settle,
                self.settings.half
            ));
            self.wait_until(window.end_s)?;
            self.check_still_on(half)?;
        }
        Ok(())
    }

    fn settle_s(&self) -> f64 {
        self.settings.settle.as_secs_f64()
    }

    /// Swaps each `(node, spec, arm)` fresh, all at once, and checks each took.
    fn swap_in(&mut self, wanted: &[(usize, &Path, Arm)]) -> Result<(), FleetAbError> {
        let results = self.on_each(
            wanted
                .iter()
                .map(|&(node, spec, _)| (node, spec, None, true)),
        );
        let mut refused = Vec::new();
        for (&(node, spec, arm), result) in wanted.iter().zip(results) {
            match result {
                Ok(swapped) => {
                    self.changed[node] = true;
                    if swapped.state_carried == Some(true) {
                        refused.push(node_error(
                            &self.nodes[node],
                            "its agent carried the old policy's state into the half although a fresh start was asked: update the agent",
                        ));
                        continue;
                    }
                    self.halves[node].push(Half {
                        arm,
                        // Completed from its status below.
                        policy: NodePolicy {
                            name: swapped.policy,
                            version: String::new(),
                            spec: spec.to_owned(),
                            plugin: PathBuf::new(),
                        },
                        state_carried: swapped.state_carried,
                        measured: None,
                    });
                }
                Err(why) => refused.push(node_error(
                    &self.nodes[node],
                    format!("the swap to {} was refused: {why}", spec.display()),
                )),
            }
        }
        if let Some(first) = refused.into_iter().next() {
            return Err(first);
        }
        // Each node's status names the policy asked for, unpaused.
        for &(node, spec, _) in wanted {
            let state = self.controls[node].status().map_err(|e| {
                node_error(&self.nodes[node], format!("its status after the swap: {e}"))
            })?;
            if state.policy.spec != spec || state.paused {
                return Err(node_error(
                    &self.nodes[node],
                    format!(
                        "after the swap it runs {} ({}){}, not {}",
                        state.policy.name,
                        state.policy.spec.display(),
                        if state.paused { ", paused" } else { "" },
                        spec.display()
                    ),
                ));
            }
            if let Some(record) = self.halves[node].last_mut() {
                record.policy = state.policy;
            }
        }
        Ok(())
    }

    /// At a half's end: every node still runs the policy swapped in.
    fn check_still_on(&self, half: usize) -> Result<(), FleetAbError> {
        for node in self.prepared.assignment.taking_part() {
            let Some(expected) = self.halves[node].get(half) else {
                continue;
            };
            let state = self.controls[node].status().map_err(|e| {
                node_error(
                    &self.nodes[node],
                    format!("its status at the half's end: {e}"),
                )
            })?;
            if state.policy != expected.policy || state.paused {
                return Err(node_error(
                    &self.nodes[node],
                    format!(
                        "at the end of half {} it runs {} {} ({}){}, not the {} swapped in: a rollback or another swap",
                        half + 1,
                        state.policy.name,
                        state.policy.version,
                        state.policy.spec.display(),
                        if state.paused { ", paused" } else { "" },
                        expected.policy.name
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Reads half `half`'s window for every node taking part, once Prometheus has it.
    fn read_half(&mut self, half: usize, say: &mut dyn FnMut(&str)) -> Result<(), FleetAbError> {
        let Some(&window) = self.windows.get(half) else {
            return Ok(());
        };
        let latest_interval = self
            .prepared
            .scrape_interval_s
            .iter()
            .copied()
            .fold(0.0, f64::max);
        // The last scrape before the window's end is stored within about an interval.
        self.wait_until(window.end_s + latest_interval + 0.5)?;
        say(&format!("half {}: reading the counters", half + 1));
        for node in self.prepared.assignment.taking_part().collect::<Vec<_>>() {
            let measured = measure_node(
                self.counters,
                &self.nodes[node],
                window,
                self.prepared.max_gap_s[node],
                Hold::OnePolicy,
                if half == 0 {
                    "the first half"
                } else {
                    "the second half"
                },
            )?;
            if let Some(record) = self.halves[node].get_mut(half) {
                record.measured = Some(measured);
            }
        }
        Ok(())
    }

    /// Runs `swap` on each node at once (an action waits for the node's tick boundary).
    fn on_each<'p>(
        &self,
        swaps: impl Iterator<Item = (usize, &'p Path, Option<&'p Path>, bool)>,
    ) -> Vec<Result<Swapped, BoxError>> {
        let swaps: Vec<_> = swaps.collect();
        std::thread::scope(|scope| {
            let handles: Vec<_> = swaps
                .iter()
                .map(|&(node, spec, plugin, fresh)| {
                    let control = self.controls[node];
                    scope.spawn(move || control.swap(spec, plugin, fresh))
                })
                .collect();
            handles
                .into_iter()
                .map(|handle| {
                    handle
                        .join()
                        .unwrap_or_else(|_| Err("the swap's thread panicked".into()))
                })
                .collect()
        })
    }

    /// Every node changed goes back to the policy it had, checked by its status.
    fn put_back(&mut self) -> PutBack {
        let changed: Vec<usize> = (0..self.nodes.len()).filter(|&i| self.changed[i]).collect();
        let originals = &self.prepared.originals;
        let results = self.on_each(changed.iter().map(|&node| {
            let original = &originals[node].policy;
            // The same component, where its path can be named to the agent.
            let plugin = original
                .plugin
                .is_absolute()
                .then_some(original.plugin.as_path());
            (node, original.spec.as_path(), plugin, false)
        }));
        let mut put_back = PutBack::default();
        for (&node, result) in changed.iter().zip(results) {
            let original = &originals[node].policy;
            let checked = result.map_err(|e| e.to_string()).and_then(|_| {
                let state = self.controls[node].status().map_err(|e| e.to_string())?;
                if state.policy.spec == original.spec && state.policy.version == original.version {
                    Ok(())
                } else {
                    Err(format!(
                        "it runs {} {} after the swap back, not {} {}",
                        state.policy.name, state.policy.version, original.name, original.version
                    ))
                }
            });
            let name = self.nodes[node].name.clone();
            match checked {
                Ok(()) => {
                    self.changed[node] = false;
                    put_back.restored.push(name);
                }
                Err(why) => put_back.failed.push(PutBackFailure {
                    node: name,
                    why,
                    fix: fix_command(&self.nodes[node].api, original),
                }),
            }
        }
        put_back
    }

    fn report(&self, put_back: PutBack) -> Result<FleetAbReport, FleetAbError> {
        let assignment = &self.prepared.assignment;
        let name = |i: usize| self.nodes[i].name.clone();
        let mut pairs = Vec::with_capacity(assignment.pairs.len());
        for pair in &assignment.pairs {
            let figures = |node: usize| -> Result<[&counters::Figures; 2], FleetAbError> {
                match self.halves[node].as_slice() {
                    [
                        Half {
                            measured: Some(first),
                            ..
                        },
                        Half {
                            measured: Some(second),
                            ..
                        },
                    ] => Ok([&first.figures, &second.figures]),
                    _ => Err(node_error(&self.nodes[node], "it lacks a measured half")),
                }
            };
            pairs.push(PairReport {
                a_first: name(pair.a_first),
                b_first: name(pair.b_first),
                sums: PairSums::of(figures(pair.a_first)?, figures(pair.b_first)?),
            });
        }
        let sums: Vec<PairSums> = pairs.iter().map(|p| p.sums).collect();
        let verdict = verdict(
            &sums,
            self.settings.alpha,
            self.settings.seed,
            &self.prepared.demand_unknown_on,
            self.settings.accept_unknown_demand,
        )?;
        let nodes = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, node)| {
                let pair = assignment
                    .pairs
                    .iter()
                    .position(|p| p.a_first == i || p.b_first == i);
                let part = match (pair, assignment.arm_of(i, 0)) {
                    (Some(_), Some(Arm::A)) => "a-first",
                    (Some(_), Some(Arm::B)) => "b-first",
                    _ => "left-out",
                };
                NodeReport {
                    name: node.name.clone(),
                    load: self.prepared.loads[i],
                    original: self.prepared.originals[i].policy.clone(),
                    simulated: self.prepared.originals[i].simulated,
                    part: part.to_owned(),
                    pair,
                    baseline: self.prepared.baseline[i],
                    halves: self.halves[i]
                        .iter()
                        .filter_map(|half| {
                            Some(HalfRecord {
                                arm: half.arm,
                                policy: half.policy.clone(),
                                state_carried: half.state_carried,
                                measured: half.measured?,
                            })
                        })
                        .collect(),
                }
            })
            .collect();
        Ok(FleetAbReport {
            format_version: FLEET_AB_FORMAT_VERSION,
            a: self.settings.a.clone(),
            b: self.settings.b.clone(),
            estimand: ESTIMAND.to_owned(),
            unit_of_replication: UNIT.to_owned(),
            min_pairs: MIN_PAIRS,
            verdict,
            pairs,
            nodes,
            left_out: assignment.left_out.map(name),
            demand_unknown_on: self.prepared.demand_unknown_on.clone(),
            accept_unknown_demand: self.settings.accept_unknown_demand,
            simulated_nodes: self
                .nodes
                .iter()
                .zip(&self.prepared.originals)
                .filter(|(_, state)| state.simulated)
                .map(|(node, _)| node.name.clone())
                .collect(),
            load_source: self.prepared.load_source,
            windows: self.windows.clone(),
            baseline_window: self.prepared.baseline_window,
            half_s: self.settings.half.as_secs_f64(),
            settle_s: self.settle_s(),
            seed: self.settings.seed,
            alpha: self.settings.alpha,
            source: self.settings.source.clone(),
            put_back,
        })
    }
}

/// The command that puts a node back on `policy` by hand.
fn fix_command(api: &ApiAddress, policy: &NodePolicy) -> String {
    let plugin = if policy.plugin.is_absolute() {
        format!(" --plugin {}", policy.plugin.display())
    } else {
        String::new()
    };
    let connection = match api {
        ApiAddress::Socket(path) => format!("--socket {}", path.display()),
        ApiAddress::Http { url, token_file } => {
            format!("--url {url} --token-file {}", token_file.display())
        }
    };
    format!(
        "tokwatt policy swap {}{plugin} {connection}",
        policy.spec.display()
    )
}
