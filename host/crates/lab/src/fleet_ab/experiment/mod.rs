//! The experiment: everything checked before any node changes ([`prepare`]), then two
//! halves ([`run`]): every node of a pair swapped to its arm, a settling time, the
//! measured window, the arms swapped, again; then every node put back on the policy it
//! had. Any failure after the first swap (a refused swap, a node that left its policy, a
//! gap in the scrapes, an interrupt) stops the experiment, and the nodes changed so far
//! are put back before the error is returned. Nodes in a power domain have the domain's
//! grants frozen around all of it ([`super::domains`]), and thawed on every way out.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::counters::{self, Hold, MeasureError, Measured, Series, Window};
use super::domains::{GrantChange, NodePlace, PowerDomains};
use super::nodes::{FleetNode, Selector};
use super::plan::{Assignment, MIN_PAIRS, assign};
use super::prometheus::{Prometheus, PrometheusError, ScrapeTarget};
use crate::ab::{AbError, SequentialPlan};

mod run;

pub use run::run;

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
    /// Its power domain, where it shares a budget (`None`: none, or an agent that does
    /// not say).
    pub fleet: Option<NodePlace>,
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

/// The nodes, their control APIs (in the same order), where their counters are read, and
/// the store of the power domains they share budgets in (`None`: not given, which is
/// refused where a node is in one).
#[derive(Clone, Copy)]
pub struct Fleet<'a> {
    pub nodes: &'a [FleetNode],
    pub controls: &'a [&'a dyn NodeControl],
    pub counters: &'a dyn CounterSource,
    pub domains: Option<&'a dyn PowerDomains>,
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
    #[error(
        "{} share the power budget of {}: there the coordinator moves watts toward the nodes that ask for more, so a greedier arm would win watts from the other arm's nodes and the verdict would be biased by the shared budget, not earned by the policy; give the domains' store (--etcd, with --etcd-ca/--etcd-cert/--etcd-key where it speaks TLS) so the experiment can freeze every grant for its length",
        nodes.join(", "),
        domains.join(", ")
    )]
    SharedBudget {
        /// The nodes in a domain, each with its domain.
        nodes: Vec<String>,
        domains: Vec<String>,
    },
    #[error("power domain `{domain}`: {why}")]
    Domain { domain: String, why: String },
    /// The experiment ran, but a grant moved during a measured window other than by a cut
    /// the budget forced: the arms did not have their watts held. The report keeps every
    /// figure (and the changes) for the record; it is not a verdict.
    #[error(
        "{}: the grants were not held during the measured windows (a move other than a cut the budget forced), so the arms' watts were not their own and no verdict is given; is every coordinator of the domain one that honours a freeze? ({put_back})",
        moved.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    )]
    Biased {
        report: Box<super::report::FleetAbReport>,
        moved: Vec<GrantChange>,
        put_back: PutBack,
    },
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
    /// The power domains to freeze, each with its nodes (indices), in name order.
    pub domains: Vec<DomainPlan>,
}

/// A power domain the experiment's nodes share, frozen for its length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainPlan {
    pub domain: String,
    /// The experiment's nodes in it (indices into the nodes file's order).
    pub nodes: Vec<usize>,
}
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
        domains: store,
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
    let domains = plan_domains(nodes, &originals, store)?;

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
        domains,
    })
}

/// The power domains the nodes are in, by their statuses, each checked in the store: it
/// answers, its budget names each node, and no other experiment holds it frozen. Refused
/// where a node is in a domain and no store is given (the bias is named, and the fix).
fn plan_domains(
    nodes: &[FleetNode],
    states: &[NodeState],
    store: Option<&dyn PowerDomains>,
) -> Result<Vec<DomainPlan>, FleetAbError> {
    let mut by_domain: std::collections::BTreeMap<String, Vec<usize>> = Default::default();
    for (index, state) in states.iter().enumerate() {
        if let Some(place) = &state.fleet {
            by_domain
                .entry(place.domain.clone())
                .or_default()
                .push(index);
        }
    }
    if by_domain.is_empty() {
        return Ok(Vec::new());
    }
    let Some(store) = store else {
        return Err(FleetAbError::SharedBudget {
            nodes: by_domain
                .iter()
                .flat_map(|(domain, members)| {
                    members
                        .iter()
                        .map(move |&i| format!("`{}` ({domain})", nodes[i].name))
                })
                .collect(),
            domains: by_domain.keys().map(|d| format!("`{d}`")).collect(),
        });
    };
    let mut plans = Vec::with_capacity(by_domain.len());
    for (domain, members) in by_domain {
        let error = |why: String| FleetAbError::Domain {
            domain: domain.clone(),
            why,
        };
        let reading = store
            .read(&domain)
            .map_err(|e| error(format!("its store did not answer: {e}")))?;
        if let Some(other) = &reading.frozen_by_other {
            return Err(error(format!(
                "it is frozen already, by {other}: another experiment holds its grants; wait until it ends (a freeze lapses with its holder's lease), and see `tokwatt fleet show`"
            )));
        }
        for &i in &members {
            let place = states[i].fleet.as_ref().map_or("", |p| p.node.as_str());
            if !reading.grants.contains_key(place) {
                return Err(error(format!(
                    "node `{}` says it is `{place}` of this domain, but the domain's budget does not name `{place}`: fix its [fleet] node, or the budget",
                    nodes[i].name
                )));
            }
        }
        plans.push(DomainPlan {
            domain,
            nodes: members,
        });
    }
    Ok(plans)
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
