//! Who gets the watts: separate from safety (the [`Ledger`] decides what may be written;
//! an allocator only proposes targets) and swappable behind [`Allocator`].
//!
//! [`MarginalAllocator`], the default, moves watts from where they are: every node keeps
//! at least its reserve; a node that does not draw what it holds gives the rest back;
//! free watts go tier by tier (a higher `priority` first) and within a tier one step at a
//! time to the node whose next watt buys the most tokens per second; then a step moves
//! from one node to another only where it buys clearly more there (a higher tier, or a
//! marginal value higher by more than `min_gain`). Starting from the grants in force
//! and moving only for a clear gain keeps the targets still when the reports only
//! jitter: every move costs a cut acknowledged before the raise it pays for, so a
//! target that wanders leaves watts in flight instead of in the GPUs.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use crate::budget::NodeBudget;
use crate::ledger::Ledger;
use crate::store::NodeReport;

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
    /// A node gives back only what it holds beyond its draw's share by more than this.
    pub hysteresis_w: f64,
    /// The least a node that wants more may be raised by in a round, where its policy
    /// asked for less than that above its grant: a policy raising for its objective may
    /// ask one small step at a time, and a grant that follows it step by step starves it.
    pub raise_w: f64,
    /// A step moves between two nodes of one tier only where the receiver's marginal
    /// value exceeds the giver's by more than this fraction: reports jitter by a few
    /// percent a round, and a move that only follows the jitter is a wasted cut.
    pub min_gain: f64,
}

impl Default for MarginalAllocator {
    fn default() -> Self {
        Self {
            step_w: 25.0,
            exponent: 0.6,
            draw_headroom: 0.10,
            hysteresis_w: 50.0,
            raise_w: 200.0,
            min_gain: 0.05,
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
    /// draws plus headroom (or its grant, where that is within the hysteresis of it).
    cap_w: f64,
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

    /// What the next step into `claim` is worth, as (tier, marginal value).
    fn gain(&self, claim: &Claim) -> (u8, f64) {
        (
            claim.priority,
            self.marginal(claim, claim.target_w + self.step_w / 2.0),
        )
    }

    /// What the last step out of `claim` costs, as (tier, marginal value).
    fn loss(&self, claim: &Claim) -> (u8, f64) {
        (
            claim.priority,
            self.marginal(claim, (claim.target_w - self.step_w / 2.0).max(1.0)),
        )
    }

    /// The most a node should get now: what its policy asked for (at least `raise_w`
    /// above its grant, its maximum where it did not say) while it wants more; else what
    /// it draws plus headroom, its grant kept where that is within the hysteresis. Never
    /// below its reserve.
    fn most_for(&self, report: &NodeReport, budget: &NodeBudget, current_w: f64) -> f64 {
        let most = if report.wants_more {
            if report.requested_w > 0.0 {
                report.requested_w.max(current_w + self.raise_w)
            } else {
                budget.max_w
            }
        } else {
            let share = report.draw_w * (1.0 + self.draw_headroom);
            if current_w - share < self.hysteresis_w {
                share.max(current_w)
            } else {
                share
            }
        };
        most.min(budget.max_w).max(budget.reserve_w)
    }

    fn can_take(claim: &Claim) -> bool {
        claim.target_w + 1e-9 < claim.cap_w
    }

    fn can_give(claim: &Claim) -> bool {
        claim.target_w > claim.reserve_w + 1e-9
    }

    /// The claim that would use a step best.
    fn best_taker(&self, claims: &[Claim]) -> Option<usize> {
        claims
            .iter()
            .enumerate()
            .filter(|(_, c)| Self::can_take(c))
            .max_by(|(_, a), (_, b)| by_tier_then_value(self.gain(a), self.gain(b)))
            .map(|(i, _)| i)
    }

    /// The claim that would miss a step least.
    fn best_giver(&self, claims: &[Claim]) -> Option<usize> {
        claims
            .iter()
            .enumerate()
            .filter(|(_, c)| Self::can_give(c))
            .min_by(|(_, a), (_, b)| by_tier_then_value(self.loss(a), self.loss(b)))
            .map(|(i, _)| i)
    }
}

fn by_tier_then_value(a: (u8, f64), b: (u8, f64)) -> Ordering {
    a.0.cmp(&b.0).then(a.1.total_cmp(&b.1))
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
                let cap_w = self.most_for(&report, budget, current_w);
                Some(Claim {
                    node: entry.node().to_owned(),
                    priority: budget.priority,
                    reserve_w: budget.reserve_w,
                    cap_w,
                    measured_at_w: report.caps_in_force_w,
                    tokens_per_s: report.tokens_per_s,
                    target_w: current_w.clamp(budget.reserve_w, cap_w),
                })
            })
            .collect();
        // The pool: the budget less every node's reserve (a node without a lease holds
        // its own), what unbudgeted nodes hold, and what the live nodes keep above their
        // reserves.
        let mut pool = ledger.budget.available_w()
            - ledger.budget.reserves_w()
            - ledger.unbudgeted.iter().map(|(_, w)| w).sum::<f64>()
            - claims.iter().map(|c| c.target_w - c.reserve_w).sum::<f64>();
        // A lowered budget: take steps from where they are worth least.
        while pool < -1e-9 {
            let Some(giver) = self.best_giver(&claims) else {
                break;
            };
            let claim = &mut claims[giver];
            let step = self.step_w.min(claim.target_w - claim.reserve_w).min(-pool);
            claim.target_w -= step;
            pool += step;
        }
        // Free watts: to where they are worth most.
        while pool > 1e-9 {
            let Some(taker) = self.best_taker(&claims) else {
                break;
            };
            let claim = &mut claims[taker];
            let step = self.step_w.min(claim.cap_w - claim.target_w).min(pool);
            claim.target_w += step;
            pool -= step;
        }
        // Moves between nodes, each for a clear gain. Every move raises the modelled
        // tokens per second (or serves a higher tier), so this ends; the bound only
        // guards against a model that does not.
        for _ in 0..100_000 {
            let (Some(taker), Some(giver)) = (self.best_taker(&claims), self.best_giver(&claims))
            else {
                break;
            };
            if taker == giver {
                break;
            }
            let (gain, loss) = (self.gain(&claims[taker]), self.loss(&claims[giver]));
            let worth_it =
                gain.0 > loss.0 || (gain.0 == loss.0 && gain.1 > loss.1 * (1.0 + self.min_gain));
            if !worth_it {
                break;
            }
            let step = self
                .step_w
                .min(claims[taker].cap_w - claims[taker].target_w)
                .min(claims[giver].target_w - claims[giver].reserve_w);
            claims[taker].target_w += step;
            claims[giver].target_w -= step;
        }
        let mut order: Vec<&Claim> = claims.iter().collect();
        order.sort_by(|a, b| by_tier_then_value(self.gain(b), self.gain(a)));
        Allocation {
            order: order.iter().map(|c| c.node.clone()).collect(),
            targets: claims
                .iter()
                .map(|c| (c.node.clone(), c.target_w))
                .collect(),
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
                        requested_w: 0.0,
                        fence: None,
                        default_w: 0.0,
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

    fn split(allocation: &Allocation) -> (f64, f64) {
        (allocation.targets["fast"], allocation.targets["slow"])
    }

    #[test]
    fn the_watts_left_go_where_they_buy_the_most_tokens() {
        // Same power, one node 20 % more productive: it gets more, until the marginal
        // values of the two are equal (within a step) ...
        let ledger = ledger(
            &[
                ("fast", 0, 3000.0, 12_000.0, true),
                ("slow", 0, 3000.0, 10_000.0, true),
            ],
            6000.0,
        );
        let mut exact = MarginalAllocator {
            min_gain: 0.0,
            ..MarginalAllocator::default()
        };
        let allocation = exact.allocate(&ledger);
        let (fast, slow) = split(&allocation);
        assert!((fast + slow - 6000.0).abs() < 1e-6, "{fast} + {slow}");
        // tps ∝ w^0.6 ⇒ equal marginals when w_fast / w_slow = 1.2^(1/0.4).
        let optimum = 1.2f64.powf(1.0 / 0.4);
        assert!((fast / slow - optimum).abs() < 0.03, "{}", fast / slow);
        // ... or, by default, until a step would gain less than 5 %: the marginal of
        // the fast node is then within 5 % of the slow one's.
        let (fast, slow) = split(&MarginalAllocator::default().allocate(&ledger));
        let floor = (1.2f64 / 1.05).powf(1.0 / 0.4);
        let ratio = fast / slow;
        assert!(
            ratio >= floor - 0.03 && ratio <= optimum + 1e-9,
            "{ratio} outside {floor}..{optimum}"
        );
    }

    #[test]
    fn reports_that_only_jitter_move_no_watts() {
        // Two equal nodes at their equal split: reports a few percent apart, either way,
        // change no target (each move would cost a cut and a round trip).
        let mut allocator = MarginalAllocator::default();
        for (a, b) in [
            (10_000.0, 10_300.0),
            (10_300.0, 10_000.0),
            (9_800.0, 10_150.0),
        ] {
            let ledger = ledger(
                &[("fast", 0, 3000.0, a, true), ("slow", 0, 3000.0, b, true)],
                6000.0,
            );
            assert_eq!(split(&allocator.allocate(&ledger)), (3000.0, 3000.0));
        }
    }

    #[test]
    fn a_node_that_wants_more_gets_what_its_policy_asked_for_not_its_maximum() {
        let mut view = ledger(
            &[
                ("fast", 0, 3000.0, 12_000.0, true),
                ("slow", 0, 3000.0, 10_000.0, true),
            ],
            9000.0,
        );
        for entry in &mut view.entries {
            if let Some(record) = entry.record.as_mut() {
                record.report.requested_w = 3400.0;
            }
        }
        let (fast, slow) = split(&MarginalAllocator::default().allocate(&view));
        // Both asked for 3.4 kW; 2.2 kW of the budget stays free for whoever asks next.
        assert_eq!((fast, slow), (3400.0, 3400.0));
        // A policy that asks one small step above its grant is raised by `raise_w`.
        for entry in &mut view.entries {
            if let Some(record) = entry.record.as_mut() {
                record.report.requested_w = 3010.0;
            }
        }
        let (fast, slow) = split(&MarginalAllocator::default().allocate(&view));
        assert_eq!((fast, slow), (3200.0, 3200.0));
    }

    #[test]
    fn a_lowered_budget_is_taken_from_where_it_costs_least() {
        let ledger = ledger(
            &[
                ("fast", 0, 3000.0, 12_000.0, true),
                ("slow", 0, 3000.0, 8_000.0, true),
            ],
            5000.0,
        );
        let (fast, slow) = split(&MarginalAllocator::default().allocate(&ledger));
        assert!((fast + slow - 5000.0).abs() < 1e-6, "{fast} + {slow}");
        assert!(fast > slow, "{fast} {slow}");
        assert!(slow >= 1000.0, "a reserve is never taken: {slow}");
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
