//! Who gets the watts: separate from safety (the [`Ledger`] decides what may be written;
//! an allocator only proposes targets) and swappable behind [`Allocator`].
//!
//! [`MarginalAllocator`], the default: every node first gets its reserve; a node that
//! does not draw what it holds gives the rest back; then the watts left go tier by tier
//! (a higher `priority` first), and within a tier one step at a time to the node whose
//! next watt buys the most tokens per second, so the nodes that still want watts end at
//! equal marginal tokens per second per watt. A target moves only when it changes by
//! more than the hysteresis, so grants do not chase the noise of one report.

use std::collections::BTreeMap;

use crate::ledger::Ledger;

/// Targets for the live nodes, and the order in which raises should be granted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Allocation {
    pub targets: BTreeMap<String, f64>,
    /// Most deserving first: where headroom is short, these are raised first.
    pub order: Vec<String>,
}

pub trait Allocator: Send + std::fmt::Debug {
    fn allocate(&mut self, ledger: &Ledger) -> Allocation;
}

/// The default allocator (see the module).
#[derive(Debug, Clone)]
pub struct MarginalAllocator {
    /// The watts one step gives.
    pub step_w: f64,
    /// How concave tokens per second are in watts (`tps ∝ watts^exponent`, 0 < e ≤ 1):
    /// the marginal value of a watt is `exponent × tps / watts` at the node's level.
    pub exponent: f64,
    /// Headroom kept above what a node draws before it gives watts back (fraction).
    pub draw_headroom: f64,
    /// A target within this many watts of the current grant is left as it is.
    pub hysteresis_w: f64,
}

impl Default for MarginalAllocator {
    fn default() -> Self {
        Self {
            step_w: 25.0,
            exponent: 0.6,
            draw_headroom: 0.10,
            hysteresis_w: 50.0,
        }
    }
}

/// One live node as the allocator sees it.
#[derive(Debug, Clone)]
struct Claim {
    node: String,
    priority: u8,
    reserve_w: f64,
    /// The most this node should get now: its maximum while it wants more, else what it
    /// draws plus headroom.
    cap_w: f64,
    /// The node's grant now (hysteresis compares with it).
    current_w: f64,
    /// The caps the node reported in force, where its tokens per second were measured.
    measured_at_w: f64,
    /// Tokens per second at `measured_at_w` (the scale of its marginal value).
    tokens_per_s: f64,
    target_w: f64,
}

impl MarginalAllocator {
    fn marginal(&self, claim: &Claim, watts: f64) -> f64 {
        if claim.tokens_per_s <= 0.0 || claim.measured_at_w <= 0.0 {
            // Nothing measured yet: any watt is worth trying, least to the largest.
            return 1.0 / watts.max(1.0);
        }
        // tps(w) = tps0 × (w / w0)^e, so d tps / d w = e × tps(w) / w.
        let tps = claim.tokens_per_s * (watts / claim.measured_at_w).powf(self.exponent);
        self.exponent * tps / watts.max(1.0)
    }
}

impl Allocator for MarginalAllocator {
    fn allocate(&mut self, ledger: &Ledger) -> Allocation {
        let mut claims: Vec<Claim> = ledger
            .entries
            .iter()
            .filter_map(|entry| {
                let record = entry.record?;
                let budget = &entry.budget;
                let report = record.report;
                let current_w = entry.grant.map_or(budget.reserve_w, |g| g.watts);
                let cap_w = if report.wants_more {
                    budget.max_w
                } else {
                    // Give back what is not drawn, keeping some headroom above the draw.
                    (report.draw_w * (1.0 + self.draw_headroom)).min(budget.max_w)
                }
                .max(budget.reserve_w);
                Some(Claim {
                    node: entry.node().to_owned(),
                    priority: budget.priority,
                    reserve_w: budget.reserve_w,
                    cap_w,
                    current_w,
                    measured_at_w: report.caps_in_force_w,
                    tokens_per_s: report.tokens_per_s,
                    target_w: budget.reserve_w,
                })
            })
            .collect();
        // The pool: the budget less every node's reserve (a node without a lease holds
        // its own) and what unbudgeted nodes hold.
        let mut pool = ledger.budget.available_w()
            - ledger.budget.reserves_w()
            - ledger.unbudgeted.iter().map(|(_, w)| w).sum::<f64>();
        let mut tiers: Vec<u8> = claims.iter().map(|c| c.priority).collect();
        tiers.sort_unstable_by(|a, b| b.cmp(a));
        tiers.dedup();
        for tier in tiers {
            while pool >= 1e-9 {
                // The node of this tier whose next step is worth the most.
                let best = claims
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.priority == tier && c.target_w + 1e-9 < c.cap_w)
                    .map(|(i, c)| (i, self.marginal(c, c.target_w + self.step_w / 2.0)))
                    .max_by(|a, b| a.1.total_cmp(&b.1));
                let Some((index, _)) = best else { break };
                let claim = &mut claims[index];
                let step = self.step_w.min(claim.cap_w - claim.target_w).min(pool);
                claim.target_w += step;
                pool -= step;
            }
        }
        // Hysteresis: a small change keeps the current grant (where the pool allows it,
        // which the ledger checks anyway).
        for claim in &mut claims {
            if (claim.target_w - claim.current_w).abs() < self.hysteresis_w
                && claim.current_w <= claim.cap_w
            {
                claim.target_w = claim.current_w.max(claim.reserve_w);
            }
        }
        let mut order: Vec<&Claim> = claims.iter().collect();
        order.sort_by(|a, b| {
            b.priority.cmp(&a.priority).then(
                self.marginal(b, b.current_w)
                    .total_cmp(&self.marginal(a, a.current_w)),
            )
        });
        Allocation {
            order: order.iter().map(|c| c.node.clone()).collect(),
            targets: claims.into_iter().map(|c| (c.node, c.target_w)).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::{DomainBudget, NodeBudget};
    use crate::store::{DomainView, Grant, NodeRecord, NodeReport, NodeView};

    fn ledger(nodes: &[(&str, u8, f64, f64, bool)], budget_w: f64) -> Ledger {
        let budget = DomainBudget {
            domain: "d".into(),
            budget_w,
            uncontrolled_w: 0.0,
            nodes: nodes
                .iter()
                .map(|(n, priority, ..)| NodeBudget {
                    node: (*n).into(),
                    reserve_w: 1000.0,
                    max_w: 5600.0,
                    priority: *priority,
                })
                .collect(),
        };
        let views = nodes
            .iter()
            .enumerate()
            .map(|(i, (n, _, draw_w, tokens_per_s, wants_more))| NodeView {
                node: (*n).into(),
                record: Some(NodeRecord {
                    lease: i as i64 + 1,
                    report: NodeReport {
                        acked_generation: 1,
                        caps_in_force_w: 3000.0,
                        draw_w: *draw_w,
                        tokens_per_s: *tokens_per_s,
                        wants_more: *wants_more,
                    },
                }),
                grant: Some(Grant {
                    generation: 1,
                    watts: 3000.0,
                    ceiling_w: 3000.0,
                }),
            })
            .collect();
        Ledger::from_view(DomainView {
            revision: 1,
            budget,
            nodes: views,
        })
    }

    #[test]
    fn the_watts_left_go_where_they_buy_the_most_tokens() {
        // Same power, one node 20 % more productive: it gets more, and the marginal
        // values of the two end equal (within a step).
        let ledger = ledger(
            &[
                ("fast", 0, 3000.0, 12_000.0, true),
                ("slow", 0, 3000.0, 10_000.0, true),
            ],
            6000.0,
        );
        let mut allocator = MarginalAllocator::default();
        let allocation = allocator.allocate(&ledger);
        let (fast, slow) = (allocation.targets["fast"], allocation.targets["slow"]);
        assert!((fast + slow - 6000.0).abs() < 1e-6, "{fast} + {slow}");
        // tps ∝ w^0.6 ⇒ equal marginals when w_fast / w_slow = 1.2^(1/0.4).
        let ratio = fast / slow;
        assert!((ratio - 1.2f64.powf(1.0 / 0.4)).abs() < 0.03, "{ratio}");
        assert_eq!(allocation.order[0], "fast");
    }

    #[test]
    fn a_node_that_does_not_draw_its_grant_gives_it_back_and_a_higher_tier_comes_first() {
        let ledger = ledger(
            &[
                ("idle", 0, 1500.0, 5000.0, false),
                ("busy", 0, 3000.0, 10_000.0, true),
                ("vip", 1, 3000.0, 1000.0, true),
            ],
            9000.0,
        );
        let allocation = MarginalAllocator::default().allocate(&ledger);
        // The idle node draws 1.5 kW of its 3 kW: it keeps at most its draw and 10 %.
        assert!(
            allocation.targets["idle"] <= 1650.0 + 1e-6,
            "{allocation:?}"
        );
        // The higher tier is served to its maximum before the lower tier gets a watt
        // beyond its reserve, however productive the lower tier is.
        assert_eq!(allocation.targets["vip"], 5600.0);
        assert_eq!(allocation.order[0], "vip");
        let total: f64 = allocation.targets.values().sum();
        assert!(total <= 9000.0 + 1e-6, "{total}");
    }
}
