//! What a crossover run cancels: how much its GPU groups differ on their own. Two GPUs of
//! one model rarely give the same tokens per joule (silicon, cooling, the slot's power
//! delivery); a comparison with A on one GPU and B on the other throughout would read that
//! difference as the policies'. The crossover swaps the arms in every block, so the
//! ratio B/A compares each arm on every group; this module states the difference it
//! removed, measured from the same epochs.

use serde::{Deserialize, Serialize};

use super::run::EpochRecord;
use super::stats::{Arm, mean};

/// The GPU-to-GPU difference in a crossover run, from its complete blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuDifference {
    /// Complete blocks it is measured over (each group ran both arms).
    pub blocks: usize,
    pub groups: Vec<GroupEfficiency>,
    /// B/A as a comparison without the swap would have read it: A on one group and B on
    /// another in every block.
    pub unswapped: Vec<UnswappedRatio>,
}

/// One GPU group's efficiency against group 0's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupEfficiency {
    pub group: usize,
    /// The GPUs of the group, as its loop numbers them.
    pub gpus: Vec<u32>,
    /// Its tokens over its energy in its epochs of each arm.
    pub tokens_per_joule_a: f64,
    pub tokens_per_joule_b: f64,
    /// Its tokens per joule over group 0's with the same arm in the same block: the
    /// geometric mean over the blocks and both arms, so the arms' own difference cancels.
    pub vs_group_0: f64,
}

/// The ratio B/A of one fixed assignment of the arms to the groups.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnswappedRatio {
    pub a_group: usize,
    pub b_group: usize,
    /// Geometric mean over the blocks of B's tokens per joule on `b_group` over A's on
    /// `a_group`.
    pub ratio_b_over_a: f64,
}

/// The difference between the groups of a crossover run's epochs; `None` with fewer than
/// two groups or no complete block.
pub fn gpu_difference(epochs: &[EpochRecord]) -> Option<GpuDifference> {
    let groups = epochs.iter().map(|e| e.group).max()? + 1;
    if groups < 2 {
        return None;
    }
    let blocks = epochs.iter().map(|e| e.pair).max()? + 1;
    // tokens per joule [block][group][arm], for the blocks in which every group measured
    // both arms (an interrupted run's last block may be partial; an epoch without energy
    // records 0).
    let arm_index = |arm: Arm| usize::from(arm == Arm::B);
    let mut grid = vec![vec![[None::<f64>; 2]; groups]; blocks];
    for epoch in epochs {
        grid[epoch.pair][epoch.group][arm_index(epoch.arm)] = Some(epoch.tokens_per_joule);
    }
    let complete: Vec<Vec<[f64; 2]>> = grid
        .into_iter()
        .filter_map(|block| {
            block
                .into_iter()
                .map(|arms| Some([arms[0]?, arms[1]?]))
                .collect::<Option<Vec<_>>>()
        })
        .filter(|block| block.iter().flatten().all(|tpj| *tpj > 0.0))
        .collect();
    if complete.is_empty() {
        return None;
    }
    let geometric_mean = |logs: Vec<f64>| mean(&logs).exp();
    let pooled = |group: usize, arm: Arm| {
        let (tokens, energy) = epochs
            .iter()
            .filter(|e| e.group == group && e.arm == arm)
            .fold((0.0, 0.0), |(t, j), e| {
                (t + e.measured.tokens as f64, j + e.measured.energy_j)
            });
        if energy > 0.0 {
            tokens / energy
        } else {
            f64::NAN
        }
    };
    let group_rows = (0..groups)
        .map(|group| GroupEfficiency {
            group,
            gpus: epochs
                .iter()
                .find(|e| e.group == group)
                .map(|e| e.gpus.clone())
                .unwrap_or_default(),
            tokens_per_joule_a: pooled(group, Arm::A),
            tokens_per_joule_b: pooled(group, Arm::B),
            vs_group_0: geometric_mean(
                complete
                    .iter()
                    .flat_map(|block| {
                        (0..2).map(move |arm| (block[group][arm] / block[0][arm]).ln())
                    })
                    .collect(),
            ),
        })
        .collect();
    let mut unswapped = Vec::new();
    for a_group in 0..groups {
        for b_group in (0..groups).filter(|g| *g != a_group) {
            unswapped.push(UnswappedRatio {
                a_group,
                b_group,
                ratio_b_over_a: geometric_mean(
                    complete
                        .iter()
                        .map(|block| (block[b_group][1] / block[a_group][0]).ln())
                        .collect(),
                ),
            });
        }
    }
    Some(GpuDifference {
        blocks: complete.len(),
        groups: group_rows,
        unswapped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ab::stats::ArmEpoch;

    fn epoch(block: usize, group: usize, arm: Arm, tokens_per_joule: f64) -> EpochRecord {
        let energy_j = 10_000.0;
        EpochRecord {
            pair: block,
            arm,
            position: u8::from((block + group) % 2 == 1) ^ u8::from(arm == Arm::B),
            seed: 0,
            group,
            gpus: vec![group as u32],
            first_tick: 0,
            last_tick: 9,
            measured: ArmEpoch {
                tokens: (tokens_per_joule * energy_j).round() as u64,
                energy_j,
                served_fraction: 1.0,
                violation_ticks: 0,
                ticks: 10,
            },
            tokens_per_joule,
            tokens_per_s: 0.0,
            mean_power_w: 0.0,
            fallback_ticks: 0,
            settings: Vec::new(),
        }
    }

    /// GPU 1 is 10 % more efficient than GPU 0 and B 5 % more than A: the difference is
    /// found apart from the arms', and a fixed assignment would have read 1.05 × 1.10 or
    /// 1.05 / 1.10.
    #[test]
    fn the_gpu_difference_is_found_apart_from_the_arms() {
        let mut epochs = Vec::new();
        for block in 0..4 {
            for group in 0..2 {
                let gpu = if group == 1 { 1.10 } else { 1.0 };
                epochs.push(epoch(block, group, Arm::A, 20.0 * gpu));
                epochs.push(epoch(block, group, Arm::B, 20.0 * 1.05 * gpu));
            }
        }
        // A partial last block (interrupted) is left out.
        epochs.push(epoch(4, 0, Arm::A, 99.0));
        let found = gpu_difference(&epochs).expect("two groups");
        assert_eq!(found.blocks, 4);
        assert!((found.groups[0].vs_group_0 - 1.0).abs() < 1e-9);
        assert!(
            (found.groups[1].vs_group_0 - 1.10).abs() < 1e-6,
            "{found:?}"
        );
        let ratio = |a: usize, b: usize| {
            found
                .unswapped
                .iter()
                .find(|u| u.a_group == a && u.b_group == b)
                .expect("each ordered pair")
                .ratio_b_over_a
        };
        assert!((ratio(0, 1) - 1.05 * 1.10).abs() < 1e-6);
        assert!((ratio(1, 0) - 1.05 / 1.10).abs() < 1e-6);
        assert!(
            (found.groups[1].tokens_per_joule_b / found.groups[1].tokens_per_joule_a - 1.05).abs()
                < 1e-3
        );
    }

    #[test]
    fn one_group_has_no_gpu_difference() {
        let epochs = vec![epoch(0, 0, Arm::A, 20.0), epoch(0, 0, Arm::B, 21.0)];
        assert_eq!(gpu_difference(&epochs), None);
    }
}
