//! The budget loop against made-up GPUs: a saturated GPU turns watts into tokens with
//! diminishing returns; a lightly loaded one serves its demand once its cap covers it.

use super::*;
use tokwatt_policy_sdk::{StateWriter, testing};

#[derive(Debug, Clone, Copy)]
struct Board {
    /// Demand in tokens/s; infinite for a saturated board.
    demand: f64,
    cap_w: f64,
    settling: bool,
    queue: f64,
}

impl Board {
    /// Tokens/s the board can make under `cap_w`: concave, 17 000 at 700 W.
    fn capacity(cap_w: f64) -> f64 {
        17_000.0 * ((cap_w - 150.0) / 550.0).max(0.0).sqrt()
    }

    fn tick(&mut self, gpu: u32, tick: u64) -> Observation {
        let capacity = Board::capacity(self.cap_w);
        let made = capacity.min(self.demand + self.queue);
        self.queue = (self.queue + self.demand - made).max(0.0);
        if !self.queue.is_finite() {
            self.queue = 1e9;
        }
        // Power: what the tokens need, at most the cap.
        let watts = (150.0 + 550.0 * (made / 17_000.0).powi(2)).min(self.cap_w);
        let mut observation = testing::observation(gpu, tick);
        observation.tokens = made as u64;
        observation.tokens_per_s = made;
        observation.energy_j = watts;
        observation.power_avg_w = watts;
        observation.queue_depth = (self.queue / 256.0).ceil().min(1e6) as u32;
        observation.in_force.power_cap_w = self.cap_w;
        observation.settling = self.settling;
        observation
    }
}

fn node(demands: &[f64], budget_w: f64) -> (NodeBudget, Vec<Board>) {
    let devices = (0..demands.len() as u32).map(testing::h200).collect();
    let mut args = testing::init_args(devices, Knobs::POWER_CAP);
    args.params = testing::params(&[("node_budget_w", &budget_w.to_string())]);
    let (policy, first) = NodeBudget::init(args).unwrap();
    let boards = demands
        .iter()
        .zip(&first)
        .map(|(&demand, settings)| Board {
            demand,
            cap_w: settings.power_cap_w.unwrap_or(700.0),
            settling: false,
            queue: 0.0,
        })
        .collect();
    (policy, boards)
}

/// Runs `ticks` ticks; checks the budget on the caps in force every tick; returns the
/// tokens made.
fn run(policy: &mut NodeBudget, boards: &mut [Board], ticks: u64, budget_w: f64) -> f64 {
    let mut tokens = 0.0;
    for tick in 0..ticks {
        let observations: Vec<Observation> = boards
            .iter_mut()
            .enumerate()
            .map(|(i, board)| board.tick(i as u32, tick))
            .collect();
        tokens += observations.iter().map(|o| o.tokens as f64).sum::<f64>();
        let settings = policy.decide(&observations);
        for (board, settings) in boards.iter_mut().zip(&settings) {
            board.settling = false;
            if let Some(cap_w) = settings.power_cap_w {
                assert!((200.0..=700.0).contains(&cap_w), "{cap_w}");
                board.settling = (cap_w - board.cap_w).abs() > 0.5;
                board.cap_w = cap_w;
            }
        }
        let total: f64 = boards.iter().map(|b| b.cap_w).sum();
        assert!(
            total <= budget_w + 1e-6,
            "tick {tick}: caps sum to {total} W"
        );
    }
    tokens
}

#[test]
fn watts_move_to_the_loaded_gpus_and_beat_an_equal_split() {
    let budget_w = 1800.0;
    let demands = [f64::INFINITY, 3_000.0, f64::INFINITY, 3_000.0];
    let (mut policy, mut boards) = node(&demands, budget_w);
    assert!(boards.iter().all(|b| b.cap_w == 450.0));
    let tokens = run(&mut policy, &mut boards, 600, budget_w);
    let caps: Vec<f64> = boards.iter().map(|b| b.cap_w).collect();
    assert!(caps[0] > 550.0 && caps[2] > 550.0, "{caps:?}");
    assert!(caps[1] < 350.0 && caps[3] < 350.0, "{caps:?}");
    // The light boards still serve their demand.
    assert!(
        boards[1].queue < 3_000.0 && boards[3].queue < 3_000.0,
        "{boards:?}"
    );
    // Equal split: 450 W each for the same time.
    let equal = 600.0 * (2.0 * Board::capacity(450.0) + 2.0 * 3_000.0);
    assert!(tokens > 1.1 * equal, "{tokens} vs {equal}");
}

#[test]
fn equal_loads_stay_near_an_equal_split() {
    let budget_w = 1600.0;
    let (mut policy, mut boards) = node(&[f64::INFINITY; 4], budget_w);
    run(&mut policy, &mut boards, 600, budget_w);
    for board in &boards {
        assert!((board.cap_w - 400.0).abs() <= 75.0, "{boards:?}");
    }
}

#[test]
fn a_load_that_moves_takes_its_watts_with_it() {
    let budget_w = 1000.0;
    let (mut policy, mut boards) = node(&[f64::INFINITY, 3_000.0], budget_w);
    run(&mut policy, &mut boards, 400, budget_w);
    assert!(boards[0].cap_w > boards[1].cap_w + 200.0, "{boards:?}");
    boards[0].demand = 3_000.0;
    boards[0].queue = 0.0;
    boards[1].demand = f64::INFINITY;
    run(&mut policy, &mut boards, 600, budget_w);
    assert!(boards[1].cap_w > boards[0].cap_w + 200.0, "{boards:?}");
}

#[test]
fn parameters_are_checked_and_state_hands_over() {
    let init = |pairs: &[(&str, &str)]| {
        let mut args =
            testing::init_args(vec![testing::h200(0), testing::h200(1)], Knobs::POWER_CAP);
        args.params = testing::params(pairs);
        NodeBudget::init(args).err().unwrap_or_default()
    };
    assert!(init(&[]).contains("node_budget_w"));
    assert!(init(&[("node_budget_w", "300")]).contains("below the 400 W"));
    assert!(init(&[("node_budget_w", "900"), ("step_w", "0")]).contains("step_w"));
    assert!(init(&[("node_budget_w", "900"), ("window_ticks", "0")]).contains("window_ticks"));
    assert!(
        init(&[("node_budget_w", "900"), ("unused_fraction", "1")]).contains("unused_fraction")
    );
    assert!(
        init(&[("node_budget_w", "900"), ("budget", "1")]).contains("unknown parameter `budget`")
    );

    let (mut old, mut boards) = node(&[f64::INFINITY, 3_000.0], 1000.0);
    run(&mut old, &mut boards, 100, 1000.0);
    let (mut new, _) = node(&[f64::INFINITY, 3_000.0], 1000.0);
    testing::assert_hands_over(&old, &mut new);
    assert_eq!(new.gpus[0].target_w, old.gpus[0].target_w);
    let (mut smaller, _) = node(&[f64::INFINITY, 3_000.0], 800.0);
    let state = old.snapshot();
    // The caps move in pairs: they still sum to the old 1000 W, over 800 W.
    testing::assert_restore_refused(&mut smaller, state, "over this instance's 800 W");
    testing::assert_restore_refused(&mut new, StateWriter::new().finish(4), "got version 4");
}
