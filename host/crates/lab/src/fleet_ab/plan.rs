//! Who runs what: the nodes sorted by load and paired with their neighbours, a seeded coin
//! per pair for which node runs A first, the arms swapped halfway (a crossover).

use serde::{Deserialize, Serialize};

use tokwatt_core::rng::Rng;

use crate::ab::Arm;

/// Pairs a verdict needs at the least: the first look `tokwatt ab` takes. Each pair is one
/// value of the statistic, so the t interval has pairs − 1 degrees of freedom: at the
/// default α = 0.02 its half-width is 31.8 standard errors with 2 pairs and 7.0 with 3,
/// where only an enormous difference could ever win; with 4 it is 4.5, which a clear
/// difference passes. Fewer pairs than this would change every node for a run that can
/// hardly decide, so it is refused before anything changes.
pub const MIN_PAIRS: usize = 4;

/// Two nodes of similar load: `a_first` runs A in the first half and B in the second,
/// `b_first` the reverse. Indices into the nodes file's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedPair {
    pub a_first: usize,
    pub b_first: usize,
}

/// Every node's part in the experiment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    pub pairs: Vec<PlannedPair>,
    /// With an odd count, the node left on its own policy.
    pub left_out: Option<usize>,
}

impl Assignment {
    /// The arm node `node` runs in `half` (0 or 1); `None` for the node left out.
    pub fn arm_of(&self, node: usize, half: usize) -> Option<Arm> {
        let first = self.pairs.iter().find_map(|pair| {
            if pair.a_first == node {
                Some(Arm::A)
            } else if pair.b_first == node {
                Some(Arm::B)
            } else {
                None
            }
        })?;
        Some(match (first, half) {
            (arm, 0) => arm,
            (Arm::A, _) => Arm::B,
            (Arm::B, _) => Arm::A,
        })
    }

    /// The nodes that take part (every node but the one left out).
    pub fn taking_part(&self) -> impl Iterator<Item = usize> + '_ {
        self.pairs
            .iter()
            .flat_map(|pair| [pair.a_first, pair.b_first])
    }
}

/// Pairs `loads` (each node's name and load, in the nodes file's order): sorted by load,
/// highest first (ties by name, so the plan does not depend on the file's order), each
/// node paired with its neighbour; with an odd count, the node whose leaving out pairs the
/// others most closely stays out. Within each pair a coin seeded by `seed` decides which
/// node runs A first.
pub fn assign(loads: &[(String, f64)], seed: u64) -> Assignment {
    let mut order: Vec<usize> = (0..loads.len()).collect();
    order.sort_by(|&x, &y| {
        loads[y]
            .1
            .total_cmp(&loads[x].1)
            .then_with(|| loads[x].0.cmp(&loads[y].0))
    });
    let left_out = (order.len() % 2 == 1).then(|| {
        let position = best_left_out(&order.iter().map(|&i| loads[i].1).collect::<Vec<_>>());
        order.remove(position)
    });
    let mut coin = Rng::stream(seed, 0x0f1e_e7ab);
    let pairs = order
        .chunks_exact(2)
        .map(|two| {
            let (higher, lower) = (two[0], two[1]);
            if coin.uniform() < 0.5 {
                PlannedPair {
                    a_first: higher,
                    b_first: lower,
                }
            } else {
                PlannedPair {
                    a_first: lower,
                    b_first: higher,
                }
            }
        })
        .collect();
    Assignment { pairs, left_out }
}

/// Of `sorted` (an odd count of loads, highest first), the position to leave out so that
/// neighbours pair with the least summed difference. Only even positions leave an even
/// count on both sides; ties go to the lowest load.
fn best_left_out(sorted: &[f64]) -> usize {
    let gap = |i: usize| (sorted[i] - sorted[i + 1]).abs();
    (0..sorted.len())
        .step_by(2)
        .map(|out| {
            let before: f64 = (0..out).step_by(2).map(gap).sum();
            let after: f64 = (out + 1..sorted.len()).step_by(2).map(gap).sum();
            (out, before + after)
        })
        .fold(None, |best: Option<(usize, f64)>, (out, cost)| match best {
            Some((_, best_cost)) if best_cost < cost => best,
            _ => Some((out, cost)),
        })
        .map_or(0, |(out, _)| out)
}
