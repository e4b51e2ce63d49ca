//! Running what [`super::prepare`] planned: the two halves, the reading of their windows,
//! and putting every node back.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::{
    BoxError, CounterSource, Fleet, FleetAbError, NodeControl, NodePolicy, Prepared, PutBack,
    PutBackFailure, Settings, Swapped, local_now_s, measure_node, node_error,
};
use crate::ab::Arm;
use crate::fleet_ab::counters::{self, Hold, Measured, Window};
use crate::fleet_ab::nodes::{ApiAddress, FleetNode};
use crate::fleet_ab::plan::MIN_PAIRS;
use crate::fleet_ab::report::{
    ESTIMAND, FLEET_AB_FORMAT_VERSION, FleetAbReport, HalfRecord, NodeReport, PairReport, UNIT,
};
use crate::fleet_ab::verdict::{PairSums, verdict};

/// Runs the experiment [`super::prepare`] planned; says what it does through `say`. Every node
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
