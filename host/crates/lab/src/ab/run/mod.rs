//! Running an A/B comparison: epochs of each arm on the same work, interleaved in
//! randomised pairs (AB or BA) on one node, or in parallel crossover blocks on two or more
//! GPUs (A on one GPU and B on the other, then swapped).
//!
//! The arms take turns through the hot-swap path ([`tokwatt_agent::swap`]) at tick boundaries, so
//! an A/B run is the agent's own loop, on the simulator or real GPUs.
//!
//! **The unit of replication is a trajectory.** Every epoch is a fresh instance of its
//! arm's policy, with a seed of its own and no state from any earlier epoch
//! ([`StateOnSwap::Fresh`]), started from the device defaults: an optional cool-down
//! (the defaults held, the policy paused), then for the settled estimand a settling time,
//! a warm-up (the arm in charge, not measured) and the measured window. Two epochs are
//! therefore two independent runs of their policies, and a pair holds one of each arm, so
//! the statistics over pairs see how differently two runs of the same policy end up, not
//! one instance's trajectory read as many samples ([`Estimand`]).
//!
//! The records a run writes (`ab.json`) are [`outcome`]'s; driving one loop through its
//! epochs is [`driver`]'s.
//!
//! One file because the three ways to run (about a hundred lines each) share the seeding,
//! pairing and finishing below, which would otherwise be passed between files.

mod driver;
mod outcome;

use driver::{Arms, Flow, drive_group};
pub use outcome::{
    AB_FORMAT_VERSION, AbOutcome, AbProgress, AbRequest, AbRunError, ArmInfo, EpochRecord,
    Estimand, EstimandInfo, MIN_MEASURED_WINDOW, Mode, Schedule, Spread, TickPoint,
};

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::ab::stats::{AbSummary, Arm, ArmEpoch, Decision, EpochPair, SequentialPlan};
use tokwatt_agent::NodeFacts;
use tokwatt_agent::assembly::RunMeta;
use tokwatt_agent::control::Backends;
use tokwatt_core::rng::Rng;
use tokwatt_core::types::Objective;

/// The seed of one trajectory: its own for every arm, pair and GPU group, so that two
/// runs of the same policy (an A/A) are independent, and the same for the same request
/// seed (the candidates of a `tune` round meet the same draws).
pub fn trajectory_seed(seed: u64, group: usize, pair: usize, arm: Arm) -> u64 {
    let arm = Arms::index(arm) as u64;
    let mut pairs = Rng::stream(seed, 0x7a_1ec7);
    let pair_seed = pairs.next_u64() ^ (pair as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    Rng::stream(pair_seed, (group as u64) << 1 | arm).next_u64()
}

/// The arms' order in every pair, drawn before the first epoch: AB or BA, each with
/// probability ½.
pub fn pair_orders(pairs: usize, seed: u64) -> Vec<[Arm; 2]> {
    let mut rng = Rng::stream(seed, 0xab);
    (0..pairs)
        .map(|_| {
            if rng.uniform() < 0.5 {
                [Arm::A, Arm::B]
            } else {
                [Arm::B, Arm::A]
            }
        })
        .collect()
}

/// The statistics side: pairs in, looks out, until a look decides.
struct Looker<'a> {
    plan: &'a SequentialPlan,
    pairs: Vec<EpochPair>,
    looks: Vec<AbSummary>,
    decided: Option<Decision>,
    progress: &'a mut (dyn FnMut(AbProgress) + Send),
    epochs_done: usize,
}

impl<'a> Looker<'a> {
    fn new(plan: &'a SequentialPlan, progress: &'a mut (dyn FnMut(AbProgress) + Send)) -> Self {
        Self {
            plan,
            pairs: Vec::new(),
            looks: Vec::new(),
            decided: None,
            progress,
            epochs_done: 0,
        }
    }

    /// Add a pair; take the look due at this many pairs, if any. Whether the run stops.
    fn add(&mut self, pair: EpochPair) -> Result<Flow, AbRunError> {
        self.pairs.push(pair);
        let n = self.pairs.len();
        let mut flow = Flow::Continue;
        if let Some(look) = self.plan.looks().iter().position(|&at| at == n) {
            let verdict = self.plan.look(&self.pairs, look)?;
            self.looks.push(verdict.summary);
            if verdict.decision.is_final() {
                self.decided = Some(verdict.decision);
                flow = Flow::Stop;
            }
        }
        (self.progress)(AbProgress {
            pairs_done: n,
            budget_pairs: self.plan.budget(),
            epochs_done: self.epochs_done,
            last_look: self.looks.last().cloned(),
        });
        Ok(flow)
    }
}

/// Interleaved A/B on one node: the arms take turns on `backends`, in pairs whose order
/// is drawn at random.
pub fn run_interleaved(
    request: &AbRequest,
    backends: Backends,
    meta: RunMeta,
    stop: Arc<AtomicBool>,
    progress: &mut (dyn FnMut(AbProgress) + Send),
) -> Result<AbOutcome, AbRunError> {
    let (tick, notes) = common_tick(request)?;
    request.schedule.check(tick)?;
    let arms = Arms::new(request, tick, NodeFacts::of(&backends))?;
    arms.check_both_start()?;
    let budget = request.plan.budget();
    let epochs: Vec<(usize, u8, Arm)> = pair_orders(budget, request.seed)
        .into_iter()
        .enumerate()
        .flat_map(|(pair, order)| [(pair, 0, order[0]), (pair, 1, order[1])])
        .collect();
    let mut looker = Looker::new(&request.plan, progress);
    let mut records: Vec<EpochRecord> = Vec::new();
    let mut waiting: Option<EpochRecord> = None;
    let (timeline, run_time_s, interrupted) = drive_group(
        0,
        &arms,
        epochs,
        request.schedule,
        backends,
        stop,
        &mut |record| {
            records.push(record.clone());
            looker.epochs_done += 1;
            match waiting.take() {
                None => {
                    waiting = Some(record);
                    Ok(Flow::Continue)
                }
                Some(first) => looker.add(pair_of(&first, &record)),
            }
        },
    )?;
    finish(
        request,
        Mode::Interleaved,
        looker,
        records,
        timeline,
        run_time_s,
        interrupted,
        meta,
        notes,
        tick,
        None,
    )
}

/// Crossover A/B on two or more GPU groups (usually one GPU each), each with its own
/// loop on a thread of its own: in every block half the groups run one arm and half the
/// other, then each group runs the other arm; a block's pair sums each arm over all
/// groups, so differences between GPUs cancel.
pub fn run_crossover(
    request: &AbRequest,
    groups: Vec<Backends>,
    meta: RunMeta,
    stop: Arc<AtomicBool>,
    progress: &mut (dyn FnMut(AbProgress) + Send),
) -> Result<AbOutcome, AbRunError> {
    if groups.len() < 2 {
        return Err(AbRunError::CrossoverNeedsTwo { gpus: groups.len() });
    }
    let (tick, notes) = common_tick(request)?;
    request.schedule.check(tick)?;
    let budget = request.plan.budget();
    let orders = pair_orders(budget, request.seed);
    let group_count = groups.len();
    let all_arms = groups
        .iter()
        .map(|backends| Arms::new(request, tick, NodeFacts::of(backends)))
        .collect::<Result<Vec<_>, _>>()?;
    all_arms[0].check_both_start()?;
    let looker = Mutex::new(Looker::new(&request.plan, progress));
    let records: Mutex<Vec<EpochRecord>> = Mutex::new(Vec::new());
    let rendezvous = Rendezvous::new(group_count);
    let outcomes = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .zip(&all_arms)
            .enumerate()
            .map(|(group, (backends, arms))| {
                // Even groups run the block's first arm first, odd groups the other.
                let epochs: Vec<(usize, u8, Arm)> = orders
                    .iter()
                    .enumerate()
                    .flat_map(|(block, order)| {
                        let (first, second) = if group % 2 == 0 {
                            (order[0], order[1])
                        } else {
                            (order[1], order[0])
                        };
                        [(block, 0, first), (block, 1, second)]
                    })
                    .collect();
                let stop = stop.clone();
                let (looker, records, rendezvous) = (&looker, &records, &rendezvous);
                std::thread::Builder::new()
                    .name(format!("ab-group-{group}"))
                    .spawn_scoped(scope, move || {
                        let leaving = rendezvous.member();
                        let result = drive_group(
                            group,
                            arms,
                            epochs,
                            request.schedule,
                            backends,
                            stop,
                            &mut |record| {
                                let (block, position) = (record.pair, record.position);
                                lock(records).push(record);
                                // Every group finishes each epoch at the same tick; the
                                // last to arrive folds the block once both halves are in.
                                let flow = rendezvous.meet(|| {
                                    let mut looker = lock(looker);
                                    looker.epochs_done += group_count;
                                    if position == 1 {
                                        let pair = block_pair(&lock(records), block);
                                        looker.add(pair).map(|f| matches!(f, Flow::Stop))
                                    } else {
                                        Ok(false)
                                    }
                                });
                                match flow {
                                    Ok(true) => Ok(Flow::Stop),
                                    Ok(false) => Ok(Flow::Continue),
                                    Err(error) => Err(error),
                                }
                            },
                        );
                        drop(leaving);
                        result
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(group, handle)| match handle {
                Ok(handle) => handle.join().unwrap_or_else(|_| {
                    Err(AbRunError::Loop {
                        group,
                        reason: "its thread panicked".into(),
                    })
                }),
                Err(e) => Err(AbRunError::Loop {
                    group,
                    reason: format!("no thread: {e}"),
                }),
            })
            .collect::<Vec<_>>()
    });
    let mut timeline = Vec::new();
    let mut run_time_s: f64 = 0.0;
    let mut interrupted = false;
    for outcome in outcomes {
        let (points, seconds, stopped) = outcome?;
        timeline.extend(points);
        run_time_s = run_time_s.max(seconds);
        interrupted |= stopped;
    }
    let looker = looker.into_inner().unwrap_or_else(|p| p.into_inner());
    let mut records = records.into_inner().unwrap_or_else(|p| p.into_inner());
    records.sort_by_key(|r| (r.pair, r.position, r.group));
    finish(
        request,
        Mode::Crossover,
        looker,
        records,
        timeline,
        run_time_s,
        interrupted,
        meta,
        notes,
        tick,
        None,
    )
}

/// What one trajectory of the replicated mode runs on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrajectoryWork {
    /// Seeds the work: the same for both trajectories of a pair.
    pub work_seed: u64,
    /// Seeds the trajectory's own sensor noise and step jitter.
    pub noise_seed: u64,
    /// The moment of the scenario the trajectory starts at, seconds.
    pub offset_s: f64,
}

/// Builds a fresh simulator for one trajectory.
pub type WorkFactory<'a> = dyn Fn(TrajectoryWork) -> Result<Backends, String> + 'a;

/// Replicated A/B on the simulator: each trajectory on a simulator of its own, built by
/// `make`; a pair's two trajectories (in random order) on the same work from the same
/// moment, drawn uniformly from the work's first `span_s` seconds.
pub fn run_replicated(
    request: &AbRequest,
    make: &WorkFactory<'_>,
    span_s: f64,
    meta: RunMeta,
    stop: Arc<AtomicBool>,
    progress: &mut (dyn FnMut(AbProgress) + Send),
) -> Result<AbOutcome, AbRunError> {
    let (tick, notes) = common_tick(request)?;
    request.schedule.check(tick)?;
    let budget = request.plan.budget();
    let orders = pair_orders(budget, request.seed);
    let mut moments = Rng::stream(request.seed, 0x3e91_1ca7);
    let works: Vec<(u64, f64)> = (0..budget)
        .map(|_| (moments.next_u64(), moments.uniform() * span_s.max(0.0)))
        .collect();
    let build = |pair: usize, arm: Arm| {
        let (work_seed, offset_s) = works[pair];
        make(TrajectoryWork {
            work_seed,
            noise_seed: trajectory_seed(request.seed, 0, pair, arm) ^ 0x005e_7507,
            offset_s,
        })
        .map_err(|reason| AbRunError::Loop { group: 0, reason })
    };
    let arms = Arms::new(request, tick, NodeFacts::of(&build(0, Arm::A)?))?;
    arms.check_both_start()?;
    let mut looker = Looker::new(&request.plan, progress);
    let mut records: Vec<EpochRecord> = Vec::new();
    let mut timeline: Vec<TickPoint> = Vec::new();
    let (mut run_time_s, mut base_tick) = (0.0, 0u64);
    let mut interrupted = false;
    'pairs: for (pair, order) in orders.iter().enumerate() {
        let mut first: Option<EpochRecord> = None;
        for (position, &arm) in order.iter().enumerate() {
            let backends = build(pair, arm)?;
            let mut measured: Option<EpochRecord> = None;
            let (points, seconds, stopped) = drive_group(
                0,
                &arms,
                vec![(pair, position as u8, arm)],
                request.schedule,
                backends,
                stop.clone(),
                &mut |record| {
                    measured = Some(record);
                    Ok(Flow::Stop)
                },
            )?;
            // Laid end to end: each trajectory's ticks and time after the one before.
            let ticks = points.len() as u64;
            timeline.extend(points.into_iter().map(|p| TickPoint {
                tick: p.tick + base_tick,
                time_s: p.time_s + run_time_s,
                ..p
            }));
            base_tick += ticks;
            run_time_s += seconds;
            let Some(mut record) = measured else {
                interrupted = true;
                break 'pairs;
            };
            record.first_tick += base_tick - ticks;
            record.last_tick += base_tick - ticks;
            records.push(record.clone());
            looker.epochs_done += 1;
            if stopped {
                interrupted = true;
            }
            match first.take() {
                None => first = Some(record),
                Some(first) => {
                    if matches!(looker.add(pair_of(&first, &record))?, Flow::Stop) {
                        break 'pairs;
                    }
                }
            }
            if interrupted {
                break 'pairs;
            }
        }
    }
    finish(
        request,
        Mode::Replicated,
        looker,
        records,
        timeline,
        run_time_s,
        interrupted,
        meta,
        notes,
        tick,
        Some(span_s),
    )
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// The pair of two epochs of one pair, whatever their order.
fn pair_of(x: &EpochRecord, y: &EpochRecord) -> EpochPair {
    if x.arm == Arm::A {
        EpochPair {
            a: x.measured,
            b: y.measured,
        }
    } else {
        EpochPair {
            a: y.measured,
            b: x.measured,
        }
    }
}

/// A crossover block's pair: each arm's epochs summed over every group.
fn block_pair(records: &[EpochRecord], block: usize) -> EpochPair {
    let sum = |arm: Arm| {
        let mut total = ArmEpoch {
            tokens: 0,
            energy_j: 0.0,
            served_fraction: 0.0,
            violation_ticks: 0,
            ticks: 0,
        };
        let mut count = 0.0;
        for r in records.iter().filter(|r| r.pair == block && r.arm == arm) {
            total.tokens += r.measured.tokens;
            total.energy_j += r.measured.energy_j;
            total.served_fraction += r.measured.served_fraction;
            total.violation_ticks += r.measured.violation_ticks;
            total.ticks += r.measured.ticks;
            count += 1.0;
        }
        if count > 0.0 {
            total.served_fraction /= count;
        }
        total
    };
    EpochPair {
        a: sum(Arm::A),
        b: sum(Arm::B),
    }
}

/// The arms' common tick: A's; B runs on it too (said in the notes when its own differs).
fn common_tick(request: &AbRequest) -> Result<(Duration, Vec<String>), AbRunError> {
    let mut notes = Vec::new();
    let tick = Duration::from_millis(u64::from(request.a.tick_ms));
    if let Some(ratio) = request.injected_ratio {
        notes.push(format!(
            "an error-rate study: arm b's measured energy was divided by {ratio}, a known true ratio B/A on top of the policies' own"
        ));
    }
    if request.b.tick_ms != request.a.tick_ms {
        notes.push(format!(
            "arm b's spec ticks every {} ms; both arms ran on arm a's {} ms tick so that their epochs match",
            request.b.tick_ms, request.a.tick_ms
        ));
    }
    if request.a.objective != request.b.objective {
        notes.push(format!(
            "the arms' specs set different objectives; both arms were judged by arm {}'s",
            if judging_objective(request) == request.a.objective {
                "a"
            } else {
                "b"
            }
        ));
    }
    Ok((tick, notes))
}

/// The objective both arms are judged by: arm A's, unless only arm B's spec sets one (a
/// baseline without an objective must not wave a challenger's violations through).
pub fn judging_objective(request: &AbRequest) -> Objective {
    if request.a.objective == Objective::default() {
        request.b.objective
    } else {
        request.a.objective
    }
}

#[allow(clippy::too_many_arguments)]
fn finish(
    request: &AbRequest,
    mode: Mode,
    looker: Looker<'_>,
    epochs: Vec<EpochRecord>,
    timeline: Vec<TickPoint>,
    run_time_s: f64,
    interrupted: bool,
    meta: RunMeta,
    notes: Vec<String>,
    tick: Duration,
    replicated_span_s: Option<f64>,
) -> Result<AbOutcome, AbRunError> {
    let Some(last) = looker.looks.last().cloned() else {
        return Err(AbRunError::NoVerdict {
            pairs: looker.pairs.len(),
            needed: request.plan.looks().first().copied().unwrap_or(0),
        });
    };
    // Interrupted between looks: the last look stands, and it did not decide.
    let decision = looker.decided.unwrap_or(Decision::NoDifference);
    let arm_sums = |arm: Arm| {
        epochs
            .iter()
            .filter(|e| e.arm == arm)
            .fold((0u64, 0u64), |(v, t), e| {
                (v + e.measured.violation_ticks, t + e.measured.ticks)
            })
    };
    let (violation_ticks_a, _) = arm_sums(Arm::A);
    let (violation_ticks_b, _) = arm_sums(Arm::B);
    let mut notes = notes;
    if interrupted && looker.decided.is_none() {
        notes.push(format!(
            "interrupted after {} pairs: the verdict is the last look's ({} pairs), which did not decide",
            looker.pairs.len(),
            last.pairs
        ));
    }
    let gpu_difference = match mode {
        Mode::Crossover => super::gpu_difference(&epochs),
        Mode::Interleaved | Mode::Replicated => None,
    };
    let used = &looker.pairs[..last.pairs.min(looker.pairs.len())];
    Ok(AbOutcome {
        format_version: AB_FORMAT_VERSION,
        estimand: EstimandInfo::of(&request.schedule, tick, mode, replicated_span_s),
        spread: Spread::of(used, last.ratio_b_over_a),
        gpu_difference,
        a: ArmInfo::of(&request.a),
        b: ArmInfo::of(&request.b),
        mode,
        demand_reported: epochs.iter().any(|e| e.measured.served_fraction < 1.0) || meta.simulated,
        epochs,
        pairs: looker.pairs,
        ratio_b_over_a: last.ratio_b_over_a,
        ci_low: last.ci_low,
        ci_high: last.ci_high,
        confidence: last.confidence,
        decision,
        served_fraction_a: last.served_fraction_a,
        served_fraction_b: last.served_fraction_b,
        violation_ticks_a,
        violation_ticks_b,
        violation_rate_a: last.violation_rate_a,
        violation_rate_b: last.violation_rate_b,
        refused_because: last.refused_because.clone(),
        looks: looker.looks,
        objective: judging_objective(request),
        schedule: request.schedule,
        tick_ms: u64::try_from(tick.as_millis()).unwrap_or(u64::MAX),
        budget_pairs: request.plan.budget(),
        alpha: request.plan.alpha_at_look().iter().sum(),
        plan_looks: request.plan.looks().to_vec(),
        plan_alpha_at_look: request.plan.alpha_at_look().to_vec(),
        seed: request.seed,
        interrupted,
        run_time_s,
        meta,
        notes,
        timeline,
    })
}

/// A barrier for the crossover groups that a group can leave (its loop failed or ended):
/// the others are then released instead of waiting for ever.
struct Rendezvous {
    state: Mutex<RendezvousState>,
    turn: Condvar,
}

struct RendezvousState {
    members: usize,
    arrived: usize,
    generation: u64,
    /// The last round's result, for those who waited.
    outcome: Option<Result<bool, String>>,
}

/// Leaves the rendezvous when dropped.
struct Member<'a>(&'a Rendezvous);

impl Drop for Member<'_> {
    fn drop(&mut self) {
        let mut state = lock(&self.0.state);
        state.members = state.members.saturating_sub(1);
        self.0.turn.notify_all();
    }
}

impl Rendezvous {
    fn new(members: usize) -> Self {
        Self {
            state: Mutex::new(RendezvousState {
                members,
                arrived: 0,
                generation: 0,
                outcome: None,
            }),
            turn: Condvar::new(),
        }
    }

    fn member(&self) -> Member<'_> {
        Member(self)
    }

    /// Wait for every member still in; the last to arrive runs `fold` and everyone gets
    /// its result. A member that left ends the rendezvous: the rest stop (`Ok(true)`), and
    /// the run's outcome is the leaver's own: its error, or, when a signal stopped it, the
    /// partial result every group measured until then.
    fn meet(&self, fold: impl FnOnce() -> Result<bool, AbRunError>) -> Result<bool, AbRunError> {
        let mut state = lock(&self.state);
        let generation = state.generation;
        state.arrived += 1;
        if state.arrived >= state.members {
            let outcome = fold().map_err(|e| e.to_string());
            state.outcome = Some(outcome.clone());
            state.arrived = 0;
            state.generation += 1;
            self.turn.notify_all();
            return outcome.map_err(|reason| AbRunError::Loop { group: 0, reason });
        }
        loop {
            state = self.turn.wait(state).unwrap_or_else(|p| p.into_inner());
            if state.generation != generation {
                let outcome = state.outcome.clone().unwrap_or(Ok(true));
                return outcome.map_err(|reason| AbRunError::Loop { group: 0, reason });
            }
            if state.arrived >= state.members {
                // A member left while the others waited: nobody folds this block, and
                // the block, unfinished, counts for neither arm.
                state.arrived = state.arrived.saturating_sub(1);
                return Ok(true);
            }
        }
    }
}

#[cfg(test)]
mod rendezvous_tests {
    use super::*;

    /// A SIGINT reaches the GPU groups' loops at different ticks: one leaves while another
    /// waits at the epoch's end. The waiting one must stop, not fail the run.
    #[test]
    fn a_member_that_leaves_stops_the_one_waiting_without_an_error() {
        let rendezvous = Rendezvous::new(2);
        let leaving = rendezvous.member();
        std::thread::scope(|scope| {
            let waiting = scope.spawn(|| {
                let _member = rendezvous.member();
                rendezvous.meet(|| panic!("nobody folds a block one group left"))
            });
            // Leave only once the other is waiting inside `meet`.
            while lock(&rendezvous.state).arrived == 0 {
                std::thread::yield_now();
            }
            drop(leaving);
            let outcome = waiting.join().expect("no panic");
            assert!(matches!(outcome, Ok(true)), "{outcome:?}");
        });
    }
}
