//! Running what [`super::prepare`] planned: the power domains frozen, the two halves, the
//! reading of their windows, putting every node back, and the domains thawed.
//!
//! One file because every step is a method of one `Runner`, which borrows the fleet and the
//! plan and keeps what the run has changed, frozen and measured; the way out (put back,
//! thaw, report) reads all of it, so split, its private fields would cross files.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::{
    BoxError, CounterSource, DomainPlan, Fleet, FleetAbError, NodeControl, NodePolicy, Prepared,
    PutBack, PutBackFailure, Settings, Swapped, local_now_s, measure_node, node_error,
};
use crate::ab::Arm;
use crate::fleet_ab::counters::{self, Hold, Measured, Window};
use crate::fleet_ab::domains::{
    DomainRecord, GrantChange, GrantSeen, NodePlace, PowerDomains, freeze_reason,
};
use crate::fleet_ab::nodes::{ApiAddress, FleetNode};
use crate::fleet_ab::plan::MIN_PAIRS;
use crate::fleet_ab::report::{
    ESTIMAND, FLEET_AB_FORMAT_VERSION, FleetAbReport, HalfRecord, NodeReport, PairReport, UNIT,
};
use crate::fleet_ab::verdict::{PairSums, verdict};

/// How often a frozen domain's grants are read while the experiment runs (more often where
/// a half is short).
const READ_GRANTS_EVERY_S: f64 = 1.0;

/// Runs the experiment [`super::prepare`] planned; says what it does through `say`. Every node
/// changed is put back at the end, and on any failure or when `stop` is raised. The
/// report says whether every node is back (`put_back`). The power domains planned are
/// frozen before the first swap and thawed after the last node is back, on every way out;
/// a grant that moved during a measured window other than by a cut the budget forced
/// ends in [`FleetAbError::Biased`], which carries the report.
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
        domains,
    } = fleet;
    let mut runner = Runner {
        nodes,
        controls,
        counters,
        domains,
        settings,
        prepared,
        stop,
        changed: vec![false; nodes.len()],
        halves: vec![Vec::new(); nodes.len()],
        windows: Vec::new(),
        frozen: Vec::new(),
        grants: vec![None; nodes.len()],
        grant_changes: Vec::new(),
        next_read_s: f64::NEG_INFINITY,
    };
    if let Err(error) = runner.freeze_domains(say) {
        // The freeze's error is the one to give; a thaw that fails is said, and lapses.
        let _ = runner.thaw_domains(say);
        return Err(FleetAbError::Unchanged(Box::new(error)));
    }
    let mut outcome = runner.both_halves(say);
    say("putting every node back on its policy");
    let put_back = runner.put_back();
    if let Err(error) = runner.thaw_domains(say)
        && outcome.is_ok()
    {
        outcome = Err(error);
    }
    let measured = match outcome {
        Ok(()) => runner.read_half(1, say),
        Err(error) => Err(error),
    };
    match measured {
        Err(cause) => Err(FleetAbError::Stopped {
            cause: Box::new(cause),
            put_back,
        }),
        Ok(()) => {
            let report = runner.report(put_back.clone())?;
            let moved: Vec<GrantChange> = report
                .grant_changes
                .iter()
                .filter(|c| c.in_window && !c.forced_cut)
                .cloned()
                .collect();
            if moved.is_empty() {
                Ok(report)
            } else {
                Err(FleetAbError::Biased {
                    report: Box::new(report),
                    moved,
                    put_back,
                })
            }
        }
    }
}

/// A domain frozen for the experiment.
#[derive(Debug, Clone)]
struct Frozen {
    plan: DomainPlan,
    by: String,
    reads: u64,
    read_errors: u64,
    thawed: bool,
}

/// A node's grant, followed through the freeze.
#[derive(Debug, Clone)]
struct Followed {
    place: NodePlace,
    start: Option<GrantSeen>,
    last: Option<GrantSeen>,
    /// When the last read that saw it was (Prometheus's clock).
    last_read_s: f64,
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
    domains: Option<&'a dyn PowerDomains>,
    settings: &'a Settings,
    prepared: &'a Prepared,
    stop: &'a AtomicBool,
    /// Nodes swapped at least once: put back at the end.
    changed: Vec<bool>,
    /// Each node's halves, swapped into and then measured.
    halves: Vec<Vec<Half>>,
    windows: Vec<Window>,
    /// The domains frozen so far, and each node's grant followed through the freeze.
    frozen: Vec<Frozen>,
    grants: Vec<Option<Followed>>,
    grant_changes: Vec<GrantChange>,
    next_read_s: f64,
}

impl Runner<'_> {
    fn prometheus_now(&self) -> f64 {
        local_now_s() + self.prepared.clock_offset_s
    }

    /// Sleeps until Prometheus's clock reads `t`, or the stop is raised; reads the frozen
    /// domains' grants when due meanwhile.
    fn wait_until(&mut self, t: f64) -> Result<(), FleetAbError> {
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Err(FleetAbError::Interrupted);
            }
            if !self.frozen.is_empty() && self.prometheus_now() >= self.next_read_s {
                self.read_grants()?;
            }
            let left = t - self.prometheus_now();
            if left <= 0.0 {
                return Ok(());
            }
            std::thread::sleep(Duration::from_secs_f64(left.min(0.1)));
        }
    }

    /// Freezes every domain planned and reads the grants it holds (each node's at the
    /// start). An error leaves the domains frozen so far for [`Self::thaw_domains`].
    fn freeze_domains(&mut self, say: &mut dyn FnMut(&str)) -> Result<(), FleetAbError> {
        if self.prepared.domains.is_empty() {
            return Ok(());
        }
        let Some(store) = self.domains else {
            // `prepare` refuses nodes in a domain without a store.
            return Err(FleetAbError::Settings(
                "nodes are in a power domain, and no store of the domains was given".into(),
            ));
        };
        let why = freeze_reason(&self.settings.a, &self.settings.b);
        for plan in &self.prepared.domains {
            let by = store
                .freeze(&plan.domain, &why)
                .map_err(|e| FleetAbError::Domain {
                    domain: plan.domain.clone(),
                    why: format!("its grants could not be frozen: {e}"),
                })?;
            say(&format!(
                "froze power domain {} ({} node(s)) as {by}: every grant held until the end",
                plan.domain,
                plan.nodes.len()
            ));
            self.frozen.push(Frozen {
                plan: plan.clone(),
                by,
                reads: 0,
                read_errors: 0,
                thawed: false,
            });
            for &node in &plan.nodes {
                if let Some(place) = self.prepared.originals[node].fleet.clone() {
                    self.grants[node] = Some(Followed {
                        place,
                        start: None,
                        last: None,
                        last_read_s: f64::NEG_INFINITY,
                    });
                }
            }
        }
        // The grants at the start: each domain must answer once, frozen by this run.
        self.read_grants()?;
        for frozen in &self.frozen {
            if frozen.reads == 0 {
                return Err(FleetAbError::Domain {
                    domain: frozen.plan.domain.clone(),
                    why: "its grants could not be read once frozen: nothing was measured".into(),
                });
            }
        }
        for followed in self.grants.iter_mut().flatten() {
            followed.start = followed.last;
        }
        self.grant_changes.clear();
        Ok(())
    }

    /// Reads every frozen domain's grants, noting each node's that changed since the last
    /// read. A read that fails is counted and tried again at the next; a freeze that is
    /// no longer this run's (it lapsed, or was removed) stops the experiment.
    fn read_grants(&mut self) -> Result<(), FleetAbError> {
        let Some(store) = self.domains else {
            return Ok(());
        };
        // At least four reads a half, so that a change is placed within a quarter of it.
        let every_s = READ_GRANTS_EVERY_S.min(self.settings.half.as_secs_f64() / 4.0);
        self.next_read_s = self.prometheus_now() + every_s;
        for frozen in &mut self.frozen {
            if frozen.thawed {
                continue;
            }
            let domain = &frozen.plan.domain;
            let reading = match store.read(domain) {
                Ok(reading) => reading,
                Err(error) => {
                    frozen.read_errors += 1;
                    tracing::warn!(domain = %domain, "fleet ab: reading the frozen domain's grants failed (tried again): {error}");
                    continue;
                }
            };
            frozen.reads += 1;
            let now = local_now_s() + self.prepared.clock_offset_s;
            if !reading.frozen_by_us {
                return Err(FleetAbError::Domain {
                    domain: domain.clone(),
                    why: format!(
                        "its freeze is gone{}: it lapsed (its store did not hear this run renew it within its lease) or was removed, so its grants were free to move; nothing measured since can be trusted",
                        reading
                            .frozen_by_other
                            .map(|other| format!(" (frozen now by {other})"))
                            .unwrap_or_default()
                    ),
                });
            }
            for &node in &frozen.plan.nodes {
                let Some(followed) = self.grants[node].as_mut() else {
                    continue;
                };
                let seen = reading.grants.get(&followed.place.node).copied().flatten();
                if followed.last_read_s.is_finite() && seen != followed.last {
                    self.grant_changes.push(GrantChange {
                        node: self.nodes[node].name.clone(),
                        domain: domain.clone(),
                        after_s: followed.last_read_s,
                        seen_s: now,
                        from: followed.last,
                        to: seen,
                        forced_cut: GrantChange::allowed(followed.last, seen),
                        in_window: false,
                    });
                }
                followed.last = seen;
                followed.last_read_s = now;
            }
        }
        Ok(())
    }

    /// Reads the grants once more (each node's at the end) and ends every freeze this run
    /// holds. A freeze that cannot be ended lapses with its lease; that is said, and is
    /// the error returned (after every domain was tried).
    fn thaw_domains(&mut self, say: &mut dyn FnMut(&str)) -> Result<(), FleetAbError> {
        let Some(store) = self.domains else {
            return Ok(());
        };
        if self.frozen.is_empty() {
            return Ok(());
        }
        let read = self.read_grants();
        let mut failed = None;
        for frozen in &mut self.frozen {
            match store.thaw(&frozen.plan.domain) {
                Ok(()) => {
                    frozen.thawed = true;
                    say(&format!("thawed power domain {}", frozen.plan.domain));
                }
                Err(error) => {
                    say(&format!(
                        "power domain {} could not be thawed ({error}): its freeze lapses with its lease",
                        frozen.plan.domain
                    ));
                    failed.get_or_insert(FleetAbError::Domain {
                        domain: frozen.plan.domain.clone(),
                        why: format!(
                            "its freeze could not be ended ({error}); it lapses with its lease"
                        ),
                    });
                }
            }
        }
        read?;
        failed.map_or(Ok(()), Err)
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
                let followed = self.grants[i].as_ref();
                NodeReport {
                    name: node.name.clone(),
                    load: self.prepared.loads[i],
                    fleet: self.prepared.originals[i].fleet.clone(),
                    grant_start: followed.and_then(|f| f.start),
                    grant_end: followed.and_then(|f| f.last),
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
            domains: self
                .frozen
                .iter()
                .map(|frozen| DomainRecord {
                    domain: frozen.plan.domain.clone(),
                    nodes: frozen.plan.nodes.iter().map(|&i| name(i)).collect(),
                    frozen_by: frozen.by.clone(),
                    reads: frozen.reads,
                    read_errors: frozen.read_errors,
                    thawed: frozen.thawed,
                })
                .collect(),
            grant_changes: self
                .grant_changes
                .iter()
                .map(|change| GrantChange {
                    in_window: change.overlaps(&self.windows),
                    ..change.clone()
                })
                .collect(),
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
