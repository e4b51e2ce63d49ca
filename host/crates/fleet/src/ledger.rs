//! The ledger: the watts each node may have in force right now, read from the store,
//! and the grants that move watts without the sum ever passing the budget.
//!
//! A node is charged the most it may hold: its reserve where it has no live lease (it
//! holds the reserve on its own before its lease can lapse), else the highest of its
//! reserve, the caps it reported in force, and its grant, or, while that grant is not
//! acknowledged, every grant since the last acknowledgement (the grant's ceiling). So
//! watts come free only on an acknowledged cut or a lease that has surely expired.
//!
//! Planning keeps the sum: a cut is written at once and charged at the old level until
//! the node acknowledges it; a raise is written only into headroom (the budget less
//! everything charged), and is charged from the moment it is written, before any node
//! can act on it.

use std::collections::BTreeMap;

use crate::budget::{DomainBudget, NodeBudget};
use crate::store::{DomainView, Grant, NodeRecord};

/// Grants within this many watts of the current one are not rewritten (hysteresis: a
/// node's caps do not chase noise in the allocator's inputs).
pub const MIN_CHANGE_W: f64 = 1.0;

/// One node's line.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub budget: NodeBudget,
    pub record: Option<NodeRecord>,
    pub grant: Option<Grant>,
    /// The most this node may have in force now (see the module's rule).
    pub charged_w: f64,
}

impl Entry {
    fn new(budget: NodeBudget, record: Option<NodeRecord>, grant: Option<Grant>) -> Self {
        let charged_w = charge(&budget, record.as_ref(), grant.as_ref());
        Self {
            budget,
            record,
            grant,
            charged_w,
        }
    }

    pub fn node(&self) -> &str {
        &self.budget.node
    }

    /// Whether the node has a live lease (it can be granted watts).
    pub fn live(&self) -> bool {
        self.record.is_some()
    }
}

fn charge(budget: &NodeBudget, record: Option<&NodeRecord>, grant: Option<&Grant>) -> f64 {
    let Some(record) = record else {
        return budget.reserve_w;
    };
    let granted = match grant {
        Some(g) if record.report.acked_generation >= g.generation => g.watts,
        Some(g) => g.ceiling_w.max(g.watts),
        None => budget.reserve_w,
    };
    budget
        .reserve_w
        .max(granted)
        .max(record.report.caps_in_force_w)
}

/// The ledger of one domain at one revision.
#[derive(Debug, Clone, PartialEq)]
pub struct Ledger {
    pub revision: i64,
    pub budget: DomainBudget,
    /// The budget's nodes, in its order.
    pub entries: Vec<Entry>,
    /// Nodes that joined under a name the budget does not list: never granted, charged
    /// what they report in force, and named loudly (their watts are outside the plan).
    pub unbudgeted: Vec<(String, f64)>,
}

/// A grant the plan writes.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedGrant {
    pub node: String,
    pub lease: i64,
    pub grant: Grant,
}

impl Ledger {
    pub fn from_view(view: DomainView) -> Self {
        let mut records: BTreeMap<String, _> = view
            .nodes
            .into_iter()
            .map(|n| (n.node, (n.record, n.grant)))
            .collect();
        let entries = view
            .budget
            .nodes
            .iter()
            .map(|budget| {
                let (record, grant) = records.remove(&budget.node).unwrap_or((None, None));
                Entry::new(budget.clone(), record, grant)
            })
            .collect();
        let unbudgeted = records
            .into_iter()
            .filter_map(|(node, (record, _))| {
                record.map(|r| (node, r.report.caps_in_force_w.max(0.0)))
            })
            .collect();
        Self {
            revision: view.revision,
            budget: view.budget,
            entries,
            unbudgeted,
        }
    }

    /// Everything charged: every node's charge and every unbudgeted node's caps.
    pub fn charged_w(&self) -> f64 {
        self.entries.iter().map(|e| e.charged_w).sum::<f64>()
            + self.unbudgeted.iter().map(|(_, w)| w).sum::<f64>()
    }

    /// What may still be granted without passing the budget (negative after the budget
    /// was lowered, until the cuts are acknowledged).
    pub fn headroom_w(&self) -> f64 {
        self.budget.available_w() - self.charged_w()
    }

    /// The grants that move every live node toward its target (watts, clamped to
    /// [reserve, max]): cuts first and always, raises in `order` (the allocator's, most
    /// deserving first) and only into headroom. A live node without a grant gets one.
    pub fn plan(&self, targets: &BTreeMap<String, f64>, order: &[String]) -> Vec<PlannedGrant> {
        let mut planned = Vec::new();
        let mut headroom = self.headroom_w();
        let mut raises = Vec::new();
        for entry in &self.entries {
            let Some(record) = entry.record else {
                continue;
            };
            let budget = &entry.budget;
            let target = targets
                .get(entry.node())
                .copied()
                .filter(|t| t.is_finite())
                .unwrap_or(budget.reserve_w)
                .clamp(budget.reserve_w, budget.max_w.max(budget.reserve_w));
            let current = entry.grant.map_or(budget.reserve_w, |g| g.watts);
            let next_generation = entry.grant.map_or(1, |g| g.generation + 1);
            let changes = entry.grant.is_none() || (target - current).abs() >= MIN_CHANGE_W;
            if !changes {
                continue;
            }
            if target <= entry.charged_w {
                // A cut (or a grant at or under what is already charged): always safe,
                // charged at the old level until acknowledged.
                planned.push(PlannedGrant {
                    node: entry.node().to_owned(),
                    lease: record.lease,
                    grant: Grant {
                        generation: next_generation,
                        watts: target,
                        ceiling_w: entry.charged_w,
                    },
                });
            } else {
                raises.push((entry, record.lease, target, next_generation));
            }
        }
        // Raises in the allocator's order; a node it does not name goes last.
        let rank = |node: &str| order.iter().position(|n| n == node).unwrap_or(usize::MAX);
        raises.sort_by_key(|(entry, ..)| rank(entry.node()));
        for (entry, lease, target, generation) in raises {
            let raise = (target - entry.charged_w).min(headroom.max(0.0));
            if raise < MIN_CHANGE_W && entry.grant.is_some() {
                continue;
            }
            let watts = entry.charged_w + raise.max(0.0);
            headroom -= raise.max(0.0);
            planned.push(PlannedGrant {
                node: entry.node().to_owned(),
                lease,
                grant: Grant {
                    generation,
                    watts,
                    ceiling_w: watts,
                },
            });
        }
        planned
    }

    /// The ledger as it stands once `planned` is written (and before any node acts).
    pub fn after(&self, planned: &[PlannedGrant]) -> Self {
        let mut next = self.clone();
        for grant in planned {
            if let Some(entry) = next.entries.iter_mut().find(|e| e.node() == grant.node) {
                *entry = Entry::new(entry.budget.clone(), entry.record, Some(grant.grant));
            }
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{NodeReport, NodeView};
    use tokwatt_core::rng::Rng;

    /// A whole number below `n`, from the seeded stream.
    fn below(rng: &mut Rng, n: u64) -> u64 {
        rng.next_u64() % n
    }

    fn budget(nodes: usize, budget_w: f64) -> DomainBudget {
        DomainBudget {
            domain: "rack-1".into(),
            budget_w,
            uncontrolled_w: 0.0,
            nodes: (0..nodes)
                .map(|i| NodeBudget {
                    node: format!("n{i}"),
                    reserve_w: 1000.0,
                    max_w: 5600.0,
                    priority: 0,
                })
                .collect(),
        }
    }

    fn report(acked_generation: u64, caps_in_force_w: f64) -> NodeReport {
        NodeReport {
            acked_generation,
            caps_in_force_w,
            draw_w: caps_in_force_w,
            tokens_per_s: 0.0,
            wants_more: true,
            requested_w: 0.0,
            fence: None,
            default_w: 0.0,
        }
    }

    fn view(budget: DomainBudget, nodes: Vec<NodeView>) -> DomainView {
        DomainView {
            revision: 1,
            budget,
            nodes,
        }
    }

    fn live(node: &str, lease: i64, report: NodeReport, grant: Option<Grant>) -> NodeView {
        NodeView {
            node: node.into(),
            record: Some(NodeRecord { lease, report }),
            grant,
        }
    }

    #[test]
    fn a_node_is_charged_the_most_it_may_hold() {
        let b = budget(4, 20_000.0);
        let g = |generation, watts, ceiling_w| {
            Some(Grant {
                generation,
                watts,
                ceiling_w,
            })
        };
        let ledger = Ledger::from_view(view(
            b,
            vec![
                // Acknowledged: the grant.
                live("n0", 1, report(3, 4000.0), g(3, 4000.0, 4000.0)),
                // A cut not yet acknowledged: the ceiling.
                live("n1", 2, report(2, 5000.0), g(3, 3000.0, 5000.0)),
                // Joined, no grant yet: its reserve or what it reports, the higher.
                live("n2", 3, report(0, 1200.0), None),
                // n3 has no lease: its reserve.
            ],
        ));
        let charged: Vec<f64> = ledger.entries.iter().map(|e| e.charged_w).collect();
        assert_eq!(charged, [4000.0, 5000.0, 1200.0, 1000.0]);
        assert_eq!(ledger.headroom_w(), 20_000.0 - 11_200.0);
    }

    #[test]
    fn raises_go_only_into_headroom_and_cuts_always() {
        let b = budget(3, 9000.0);
        let ledger = Ledger::from_view(view(
            b,
            vec![
                live(
                    "n0",
                    1,
                    report(1, 4000.0),
                    Some(Grant {
                        generation: 1,
                        watts: 4000.0,
                        ceiling_w: 4000.0,
                    }),
                ),
                live(
                    "n1",
                    2,
                    report(1, 1000.0),
                    Some(Grant {
                        generation: 1,
                        watts: 1000.0,
                        ceiling_w: 1000.0,
                    }),
                ),
                live(
                    "n2",
                    3,
                    report(1, 1000.0),
                    Some(Grant {
                        generation: 1,
                        watts: 1000.0,
                        ceiling_w: 1000.0,
                    }),
                ),
            ],
        ));
        assert_eq!(ledger.headroom_w(), 3000.0);
        let targets: BTreeMap<String, f64> = [
            ("n0".into(), 2000.0),
            ("n1".into(), 5000.0),
            ("n2".into(), 5000.0),
        ]
        .into();
        let order = vec!["n2".to_owned(), "n1".to_owned()];
        let plan = ledger.plan(&targets, &order);
        let by_node: BTreeMap<&str, &Grant> =
            plan.iter().map(|p| (p.node.as_str(), &p.grant)).collect();
        // The cut is written, still charged at 4 kW until acknowledged.
        assert_eq!(
            (by_node["n0"].watts, by_node["n0"].ceiling_w),
            (2000.0, 4000.0)
        );
        // n2 comes first and takes the whole headroom; n1 gets nothing more yet.
        assert_eq!(by_node["n2"].watts, 4000.0);
        assert!(!by_node.contains_key("n1"));
        let after = ledger.after(&plan);
        assert!(after.charged_w() <= 9000.0, "{}", after.charged_w());
    }

    /// The protocol, played against nodes that act late, out of order, or not at all,
    /// and lapse and rejoin: the watts that may be in force never pass the budget.
    #[test]
    fn no_interleaving_of_grants_acks_and_lapses_passes_the_budget() {
        let mut rng = Rng::stream(7, 0);
        for trial in 0..200 {
            let nodes = 2 + below(&mut rng, 6) as usize;
            let b = budget(nodes, 1000.0 * nodes as f64 + 4000.0);
            let available = b.available_w();
            // What the world holds: per node, its lease (None: lapsed), the grants it has
            // seen under it, the caps it has in force, the generation it acknowledged.
            let mut lease: Vec<Option<i64>> = vec![None; nodes];
            let mut grants: Vec<Option<Grant>> = vec![None; nodes];
            let mut in_force: Vec<f64> = vec![1000.0; nodes];
            let mut acked: Vec<u64> = vec![0; nodes];
            let mut reported: Vec<f64> = vec![1000.0; nodes];
            let mut reported_ack: Vec<u64> = vec![0; nodes];
            // The grant a node has read and not yet applied (it may apply it late).
            let mut seen: Vec<Option<Grant>> = vec![None; nodes];
            let mut next_lease = 1;
            for step in 0..300 {
                let node = below(&mut rng, nodes as u64) as usize;
                match below(&mut rng, 7) {
                    0 => {
                        // The coordinator plans from what the store holds.
                        let views = (0..nodes)
                            .map(|i| NodeView {
                                node: format!("n{i}"),
                                record: lease[i].map(|l| NodeRecord {
                                    lease: l,
                                    report: report(reported_ack[i], reported[i]),
                                }),
                                grant: lease[i].and(grants[i]),
                            })
                            .collect();
                        let ledger = Ledger::from_view(view(b.clone(), views));
                        let targets = (0..nodes)
                            .map(|i| (format!("n{i}"), 1000.0 + below(&mut rng, 4600) as f64))
                            .collect();
                        let order: Vec<String> = (0..nodes).map(|i| format!("n{i}")).collect();
                        for p in ledger.plan(&targets, &order) {
                            let i: usize = p.node[1..].parse().expect("index");
                            if lease[i] == Some(p.lease) {
                                grants[i] = Some(p.grant);
                            }
                        }
                    }
                    1 => {
                        // A node applies the grant it read (cut or raise), perhaps long
                        // after reading it, and reads its caps back.
                        if lease[node].is_some()
                            && let Some(g) = seen[node].take()
                        {
                            in_force[node] = g.watts;
                            acked[node] = g.generation;
                        }
                    }
                    // A node reports (possibly long after it acted).
                    2 if lease[node].is_some() => {
                        reported[node] = in_force[node];
                        reported_ack[node] = acked[node];
                    }
                    3 => {
                        // A lease lapses: the node dropped to its reserve first, on its own.
                        in_force[node] = in_force[node].min(1000.0);
                        lease[node] = None;
                        grants[node] = None;
                        seen[node] = None;
                    }
                    // A node (re)joins at its reserve.
                    4 if lease[node].is_none() => {
                        in_force[node] = in_force[node].min(1000.0);
                        acked[node] = 0;
                        reported[node] = in_force[node];
                        reported_ack[node] = 0;
                        lease[node] = Some(next_lease);
                        next_lease += 1;
                    }
                    // A node reads the grant bound to its lease.
                    5 if lease[node].is_some() => {
                        seen[node] = grants[node];
                    }
                    _ => {}
                }
                let total: f64 = in_force.iter().sum();
                assert!(
                    total <= available + 1e-6,
                    "trial {trial}, step {step}: {total} W in force, {available} W available"
                );
            }
        }
    }
}
