//! The oracle's search, phase by phase, on the simulator itself: every setting it weighs is
//! run over the **whole** phase, from the queue the phases before it left (a fork of one
//! run, [`SimGpu::fork`]), at fixed settings, and judged on the simulator's true energy.
//! The steady-state model only proposes where to start; it never decides.
//!
//! A phase is searched on the judge's first seed and every setting that would move the
//! search is confirmed on the other seeds (each from where the schedule left its own run):
//! a setting fitted to one seed's arrivals breaks the objective on the next seed's, and the
//! judge measures the schedule on all of them. A phase's search:
//!
//! 1. The most capable setting (no cap, no lock, the largest batch) at each token budget
//!    of the grid: the queue the largest budget leaves is the least any setting leaves,
//!    and the largest budget that keeps the objective is the search's first setting (it
//!    keeps every seed's bar, below, by construction).
//! 2. Seeds: the model's best distinct operating points (clock locks, mostly) and a cap
//!    ladder with no clock lock (under a cap the firmware clocks each step by its own
//!    power, which no steady state averages right), at that budget.
//! 3. A pattern search from the best of each (two basins): one step down and up each of
//!    cap, SM clock, batch and token budget; a better step moves there; when none is, the
//!    steps halve, down to one rung of each grid, where two diagonals are tried too (a
//!    rung less of cap or clock with two rungs less of batch). Equal tokens per joule (a
//!    knob that binds nothing) go to the setting with fewer ticks over.
//!
//! A setting keeps the objective over a phase when, on every seed, it turns nobody away
//! and leaves no more waiting requests at the phase's end than the most capable setting
//! does (plus two seconds of arrivals): a setting slower than the arrivals builds a queue
//! that grows with the phase, and never passes, even where no latency bound sees it yet;
//! and when it breaks the objective on at most [`PHASE_VIOLATION_ALLOWANCE`] of the
//! phase's ticks, on the mean over the seeds (as the failure rule reads a policy). Among
//! those, the most tokens per joule on the first seed wins (with none asked for, the
//! least power). The winner's runs are the next phase's starts.
//!
//! Where no budget lets the most capable setting keep the objective on a seed, the phase
//! is an overload there (`feasible: false`): the bar is then what the most capable setting
//! did, ticks over and requests turned away, and the search still takes the most efficient
//! setting that comes as close, as a policy judged against it may.
//!
//! One file because a phase's search is one algorithm over one bookkeeping: the seeds'
//! bars (`SeedPhase`), the trials and their confirmations (`PhaseSearch`) and the grids it
//! moves on are read by every step of it.

use std::collections::HashMap;
use std::sync::Arc;

use tokwatt_core::clock::VirtualClock;
use tokwatt_sim::{SimConfig, SimError, SimGpu};

use super::fixed::{FixedRun, OracleSetting};
use super::oracle::{self, PhaseOracle};
use super::scenario::EvalScenario;

/// Ticks of a phase that may break the objective, as a share (the failure rule's own
/// margin, [`super::MAX_VIOLATION_FRACTION`]).
pub const PHASE_VIOLATION_ALLOWANCE: f64 = super::MAX_VIOLATION_FRACTION;
/// Settings run per phase at most on the search's seed (the budget screen and the seeds
/// included).
const MAX_TRIES: usize = 48;
/// Settings a polish around the best may run beyond [`MAX_TRIES`].
const POLISH_TRIES: usize = 8;
/// The model's best distinct operating points tried as seeds.
const MODEL_SEEDS: usize = 5;
/// Rungs of the cap ladder tried as seeds (no clock lock), from the top down.
const CAP_SEEDS: usize = 5;
/// The share of the TPOT bound a cap seed's batch is chosen to keep in the steady-state
/// model: a p99 over a phase under a cap runs above the model's mean step.
const CAP_SEED_TPOT_HEADROOM: f64 = 0.8;
/// Tokens per joule this close (relative) are equal: a knob that binds nothing moves them
/// by rounding only.
const EQUAL_TOKENS_PER_JOULE: f64 = 1e-4;
/// Batch rungs a diagonal move gives up with a rung of cap or clock.
const DIAGONAL_BATCH_RUNGS: i64 = 2;
/// The smallest token budget of the grid.
const MIN_TOKEN_BUDGET: u32 = 256;
/// Seconds of arrivals a setting may leave waiting beyond the most capable setting.
const BACKLOG_SLACK_S: f64 = 2.0;
/// Seconds a drained backlog's own setting holds past the most capable setting's last tick
/// over (rounded up to ten), before the rest of the phase gets a setting of its own.
const DRAIN_MARGIN_S: u64 = 10;
/// The shortest rest of a phase, after a drain, that gets a setting of its own.
const MIN_REST_S: u64 = 60;

/// What one setting did over one phase.
pub(super) struct Trial {
    pub(super) tokens_per_joule: f64,
    /// Mean power over the phase: what tells settings apart where no token is asked for.
    pub(super) power_w: f64,
    pub(super) violations: u64,
    ticks_run: u64,
    turned_away: u64,
    /// Requests waiting at the phase's end (none: stopped early, it had already failed).
    waiting_end: Option<u64>,
    /// The last tick (from the phase's start) that broke the objective.
    last_violation: Option<u64>,
}

impl Trial {
    pub(super) fn violation_fraction(&self) -> f64 {
        self.violations as f64 / self.ticks_run.max(1) as f64
    }

    /// More tokens per joule; at equal tokens per joule (a knob that binds nothing), fewer
    /// ticks over and then less power: the setting with more slack is where the next move
    /// (a lower cap, a lower clock) still keeps the objective.
    pub(super) fn better_than(&self, other: &Trial) -> bool {
        let apart = (self.tokens_per_joule - other.tokens_per_joule).abs();
        if apart > EQUAL_TOKENS_PER_JOULE * other.tokens_per_joule.abs() {
            return self.tokens_per_joule > other.tokens_per_joule;
        }
        (self.violations, self.power_w) < (other.violations, other.power_w)
    }
}

/// The grids a phase's search moves on.
pub(super) struct Grids {
    /// Supported SM clocks, highest first.
    pub(super) clocks: Vec<u32>,
    pub(super) batches: Vec<u32>,
    /// Token budgets, largest first (the one budget of a decode-only scenario).
    pub(super) budgets: Vec<u32>,
    pub(super) cap_min_w: f64,
    pub(super) cap_max_w: f64,
    most_capable: OracleSetting,
}

impl Grids {
    pub(super) fn of(scenario: &EvalScenario) -> Self {
        let workload = &scenario.workload;
        let mut budgets = vec![workload.max_batched_tokens];
        if workload.requests.is_some() {
            let mut budget = workload.max_batched_tokens / 2;
            while budget >= MIN_TOKEN_BUDGET {
                budgets.push(budget);
                budget /= 2;
            }
        }
        Grids {
            clocks: scenario.profile.sm_clocks_mhz(),
            batches: oracle::batch_grid(workload.batch_size_max),
            budgets,
            cap_min_w: scenario.profile.power_cap.min_w,
            cap_max_w: scenario.profile.power_cap.max_w,
            most_capable: OracleSetting::most_capable(scenario),
        }
    }

    fn most_capable(&self) -> OracleSetting {
        self.most_capable
    }

    /// `setting` moved `steps` along `axis` (0 cap in 25 W rungs, 1 clock, 2 batch, 3
    /// budget; positive: more capable), if that stays on the grid and moves at all.
    fn moved(&self, setting: OracleSetting, axis: usize, steps: i64) -> Option<OracleSetting> {
        let along = |grid: &[u32], value: u32, more_capable_first: bool| -> Option<u32> {
            let index = grid.iter().position(|&v| v == value)? as i64;
            let toward = if more_capable_first { -steps } else { steps };
            let to = (index + toward).clamp(0, grid.len() as i64 - 1);
            (to != index).then(|| grid[to as usize])
        };
        let mut next = setting;
        match axis {
            0 => {
                let cap = (setting.power_cap_w + steps as f64 * oracle::CAP_STEP_W)
                    .clamp(self.cap_min_w, self.cap_max_w);
                if (cap - setting.power_cap_w).abs() < 1e-9 {
                    return None;
                }
                next.power_cap_w = cap;
            }
            1 => next.sm_clock_max_mhz = along(&self.clocks, setting.sm_clock_max_mhz, true)?,
            2 => next.batch_size = along(&self.batches, setting.batch_size, false)?,
            _ => next.token_budget = along(&self.budgets, setting.token_budget, true)?,
        }
        Some(next)
    }

    /// `setting` with its cap `rungs - 1` rungs of 25 W below the highest cap of the grid
    /// under `drawn_w` (what the setting drew): a cap above the draw binds nothing.
    fn cap_below(&self, setting: OracleSetting, drawn_w: f64, rungs: i64) -> Option<OracleSetting> {
        let below_draw = self.cap_max_w
            - ((self.cap_max_w - drawn_w) / oracle::CAP_STEP_W)
                .ceil()
                .max(1.0)
                * oracle::CAP_STEP_W;
        let cap = (below_draw.min(setting.power_cap_w - oracle::CAP_STEP_W)
            - (rungs - 1).max(0) as f64 * oracle::CAP_STEP_W)
            .max(self.cap_min_w);
        (cap < setting.power_cap_w - 1e-9).then_some(OracleSetting {
            power_cap_w: cap,
            ..setting
        })
    }

    /// The nearest grid values to a model candidate's (its batch is on the grid; its
    /// budget is the largest).
    fn snapped(&self, setting: OracleSetting) -> OracleSetting {
        let nearest = |grid: &[u32], value: u32| {
            grid.iter()
                .copied()
                .min_by_key(|&v| v.abs_diff(value))
                .unwrap_or(value)
        };
        OracleSetting {
            power_cap_w: setting.power_cap_w.clamp(self.cap_min_w, self.cap_max_w),
            sm_clock_max_mhz: nearest(&self.clocks, setting.sm_clock_max_mhz),
            batch_size: nearest(&self.batches, setting.batch_size),
            token_budget: self.budgets.first().copied().unwrap_or(1),
        }
    }
}

/// A setting run over a phase, with its run's end.
pub(super) type Run = (OracleSetting, Trial, SimGpu);

/// One seed's view of a phase: where its run stands at the phase's start, and the bar a
/// setting must pass there.
pub(super) struct SeedPhase<'a> {
    scenario: &'a EvalScenario,
    base: SimGpu,
    ticks: u64,
    allowed_violations: u64,
    /// Requests a setting may turn away: none, or on an overload as many as the most
    /// capable setting does.
    allowed_turned_away: u64,
    /// The most requests a setting may leave waiting at the phase's end.
    backlog_limit: u64,
    /// No budget let the most capable setting keep the objective here.
    pub(super) overload: bool,
}

impl<'a> SeedPhase<'a> {
    /// The bar on `base` for a phase of `ticks` at `rate`: the most capable setting at
    /// each of `budgets` (the largest first) runs to the end. Returns the seed's view,
    /// the budget it takes (the largest that kept the objective, or on an overload the
    /// one that came closest) and every run with its end.
    pub(super) fn start(
        scenario: &'a EvalScenario,
        grids: &Grids,
        base: &SimGpu,
        ticks: u64,
        rate: f64,
        budgets: &[u32],
    ) -> Result<(Self, u32, Vec<Run>), SimError> {
        let mut seed = SeedPhase {
            scenario,
            base: base.clone(),
            ticks,
            allowed_violations: (PHASE_VIOLATION_ALLOWANCE * ticks as f64).floor() as u64,
            allowed_turned_away: 0,
            backlog_limit: u64::MAX,
            overload: false,
        };
        let most = grids.most_capable();
        let mut runs = Vec::new();
        for &token_budget in budgets {
            let setting = OracleSetting {
                token_budget,
                ..most
            };
            let (trial, sim) = seed.run(setting, None)?;
            runs.push((setting, trial, sim));
        }
        let waiting_start = base.truth(0).map_or(0, |t| t.waiting);
        let drained = runs
            .first()
            .and_then(|(_, t, _)| t.waiting_end)
            .unwrap_or(waiting_start);
        let slack = (rate * BACKLOG_SLACK_S).ceil() as u64 + 1;
        seed.backlog_limit = waiting_start.max(drained) + slack;
        let kept = runs.iter().find(|(_, t, _)| seed.feasible(t));
        let budget = match kept {
            Some((setting, _, _)) => setting.token_budget,
            None => {
                // An overload: the bar is the closest run's (fewest turned away, then
                // fewest ticks over).
                seed.overload = true;
                let closest = runs.iter().min_by(|(_, a, _), (_, b, _)| {
                    (a.turned_away, a.violations).cmp(&(b.turned_away, b.violations))
                });
                if let Some((setting, trial, _)) = closest {
                    seed.hold_to(trial);
                    setting.token_budget
                } else {
                    most.token_budget
                }
            }
        };
        Ok((seed, budget, runs))
    }

    pub(super) fn feasible(&self, trial: &Trial) -> bool {
        self.feasible_within(trial, self.allowed_violations)
    }

    /// An overload here: the bar becomes what `trial` (the most capable setting's run)
    /// did, ticks over and requests turned away, where that is more than the bar's.
    fn hold_to(&mut self, trial: &Trial) {
        self.overload = true;
        self.allowed_violations = self.allowed_violations.max(trial.violations);
        self.allowed_turned_away = self.allowed_turned_away.max(trial.turned_away);
    }

    /// [`Self::feasible`], with `violations` ticks over allowed here (what the seeds'
    /// shared allowance leaves).
    pub(super) fn feasible_within(&self, trial: &Trial, violations: u64) -> bool {
        trial.turned_away <= self.allowed_turned_away
            && trial.violations <= violations
            && trial.waiting_end.is_some_and(|w| w <= self.backlog_limit)
    }

    /// `setting` over the phase on a fork of this seed's run; it stops as soon as it
    /// breaks the objective on more than `stop_after` ticks or turns away more than the
    /// bar allows (`None`: it runs to the end).
    pub(super) fn run(
        &self,
        setting: OracleSetting,
        stop_after: Option<u64>,
    ) -> Result<(Trial, SimGpu), SimError> {
        let (sim, clock) = self.base.fork()?;
        let trial = self.run_on(&sim, clock, setting, stop_after);
        Ok((trial, sim))
    }

    fn run_on(
        &self,
        sim: &SimGpu,
        clock: Arc<VirtualClock>,
        setting: OracleSetting,
        stop_after: Option<u64>,
    ) -> Trial {
        let mut run = FixedRun::new(sim, clock, &self.scenario.objective);
        run.apply(setting);
        let before = sim.truth(0);
        let mut violations = 0;
        let mut ticks_run = 0;
        let mut last_violation = None;
        let mut failed = false;
        while ticks_run < self.ticks {
            let broken = run.advance_ticks(1);
            if broken > 0 {
                last_violation = Some(ticks_run);
            }
            violations += broken;
            ticks_run += 1;
            if let Some(stop_after) = stop_after {
                let turned_away = match (before, sim.truth(0)) {
                    (Some(b), Some(a)) => a.requests_turned_away - b.requests_turned_away,
                    _ => 0,
                };
                if violations > stop_after || turned_away > self.allowed_turned_away {
                    failed = true;
                    break;
                }
            }
        }
        let after = sim.truth(0);
        let (tokens, energy, turned_away, waiting) = match (before, after) {
            (Some(b), Some(a)) => (
                a.tokens - b.tokens,
                a.energy_j - b.energy_j,
                a.requests_turned_away - b.requests_turned_away,
                a.waiting,
            ),
            _ => (0.0, 0.0, 0, 0),
        };
        Trial {
            tokens_per_joule: if energy > 0.0 { tokens / energy } else { 0.0 },
            power_w: energy / ticks_run.max(1) as f64,
            violations,
            ticks_run,
            turned_away,
            waiting_end: (!failed).then_some(waiting),
            last_violation,
        }
    }
}

/// The ticks over the objective a setting may have over a phase, summed over the seeds:
/// each seed's allowance, shared as the failure rule shares a policy's (a mean over
/// seeds), so that the oracle is held to what a policy is.
pub(super) fn shared_allowance(seeds: &[SeedPhase<'_>]) -> u64 {
    seeds.iter().map(|s| s.allowed_violations).sum()
}

/// `setting` on each of `others` in turn, the seeds sharing `left` ticks over between
/// them: every run's end where it kept each seed's bar, none as soon as one did not.
pub(super) fn keeps_on(
    others: &[SeedPhase<'_>],
    setting: OracleSetting,
    mut left: u64,
) -> Result<Option<Vec<SimGpu>>, SimError> {
    let mut ends = Vec::new();
    for other in others {
        let (there, end) = other.run(setting, Some(left))?;
        if !other.feasible_within(&there, left) {
            return Ok(None);
        }
        left -= there.violations;
        ends.push(end);
    }
    Ok(Some(ends))
}

/// One phase's search: the first seed's trials, confirmed on the others.
struct PhaseSearch<'a> {
    seeds: Vec<SeedPhase<'a>>,
    tried: HashMap<(u64, u32, u32, u32), usize>,
    /// Every setting run on the first seed, and whether it kept the objective on every
    /// seed (`None`: not confirmed on the others, as it could not have moved the search).
    trials: Vec<(OracleSetting, Trial, Option<bool>)>,
    /// The best that kept the objective on every seed, and every seed's run to the end.
    best: (usize, Vec<SimGpu>),
    /// Settings run on the first seed at most.
    max_tries: usize,
}

fn key(setting: &OracleSetting) -> (u64, u32, u32, u32) {
    (
        setting.power_cap_w.to_bits(),
        setting.sm_clock_max_mhz,
        setting.batch_size,
        setting.token_budget,
    )
}

impl PhaseSearch<'_> {
    /// Runs `setting` on the first seed (once: a setting tried before is not run again);
    /// where it keeps the objective there and beats trial `than`, on the other seeds too.
    /// True when it kept the objective on every seed and beat `than`; the best so far
    /// moves to it where it beats that too.
    fn try_setting(&mut self, setting: OracleSetting, than: usize) -> Result<bool, SimError> {
        if let Some(&index) = self.tried.get(&key(&setting)) {
            return Ok(self.trials[index].2 == Some(true)
                && self.trials[index].1.better_than(&self.trials[than].1));
        }
        if self.trials.len() >= self.max_tries {
            return Ok(false);
        }
        let (first, others) = self.seeds.split_first().ok_or(SimError::GpuCount(0))?;
        let shared = shared_allowance(&self.seeds);
        let (trial, sim) = first.run(setting, Some(shared))?;
        let mut kept = None;
        let mut ends = Vec::new();
        if first.feasible_within(&trial, shared) && trial.better_than(&self.trials[than].1) {
            let elsewhere = keeps_on(others, setting, shared - trial.violations)?;
            kept = Some(elsewhere.is_some());
            ends = std::iter::once(sim)
                .chain(elsewhere.into_iter().flatten())
                .collect();
        }
        let index = self.trials.len();
        self.tried.insert(key(&setting), index);
        let beats_best = kept == Some(true) && trial.better_than(&self.trials[self.best.0].1);
        self.trials.push((setting, trial, kept));
        if beats_best {
            self.best = (index, ends);
        }
        Ok(kept == Some(true))
    }

    /// The pattern search from trial `from` (kept on every seed): at most `tries` more
    /// settings run.
    fn refine(&mut self, grids: &Grids, from: usize, tries: usize) -> Result<(), SimError> {
        // Steps per axis: cap (25 W rungs), clock rungs, batch rungs, budget rungs.
        self.refine_by(grids, from, tries, [4, 16, 8, 1])
    }

    /// [`Self::refine`] from `steps`.
    fn refine_by(
        &mut self,
        grids: &Grids,
        from: usize,
        tries: usize,
        mut steps: [i64; 4],
    ) -> Result<(), SimError> {
        let limit = (self.trials.len() + tries).min(self.max_tries);
        let mut at = from;
        while self.trials.len() < limit {
            let (here, ref trial, _) = self.trials[at];
            let drawn_w = trial.power_w;
            let mut moved = false;
            // The clock first, then batch, budget and cap: the clock is where most of the
            // joules are, and a cap moves nothing until it binds.
            'axes: for axis in [1, 2, 3, 0] {
                let step = steps[axis];
                // Less capable first: that is where the joules are.
                for sign in [-1, 1] {
                    let next = if axis == 0 && sign < 0 {
                        // A cap down starts below what the setting draws, or it moves nothing.
                        grids.cap_below(here, drawn_w, step)
                    } else {
                        grids.moved(here, axis, sign * step)
                    };
                    let Some(next) = next else {
                        continue;
                    };
                    if self.trials.len() >= limit {
                        break 'axes;
                    }
                    if self.try_setting(next, at)? {
                        at = self.tried[&key(&next)];
                        moved = true;
                        break 'axes;
                    }
                }
            }
            if !moved && steps.iter().all(|&s| s == 1) {
                // Diagonals, at the last step size: a rung less of cap or clock with fewer
                // sequences. A latency bound a lower cap or clock breaks alone may hold with
                // a smaller batch, and a smaller batch alone only costs joules.
                for axis in [0, 1] {
                    let down = if axis == 0 {
                        grids.cap_below(here, drawn_w, 1)
                    } else {
                        grids.moved(here, 1, -1)
                    };
                    let Some(next) = down.and_then(|d| grids.moved(d, 2, -DIAGONAL_BATCH_RUNGS))
                    else {
                        continue;
                    };
                    if self.trials.len() >= limit {
                        return Ok(());
                    }
                    if self.try_setting(next, at)? {
                        at = self.tried[&key(&next)];
                        moved = true;
                        break;
                    }
                }
                if !moved {
                    return Ok(());
                }
                continue;
            }
            if !moved {
                for step in &mut steps {
                    *step = (*step / 2).max(1);
                }
            }
        }
        Ok(())
    }

    /// The best of `indices` that kept the objective on every seed.
    fn best_of(&self, indices: &[usize]) -> Option<usize> {
        indices
            .iter()
            .copied()
            .filter(|&i| self.trials[i].2 == Some(true))
            .reduce(|a, b| {
                if self.trials[b].1.better_than(&self.trials[a].1) {
                    b
                } else {
                    a
                }
            })
    }
}

/// The oracle of every phase of `scenario` over its first `duration_s` seconds, searched
/// on one GPU's arrivals from `seeds[0]` and confirmed on the other seeds' (the seeds the
/// judge measures the schedule on), each phase from where the schedule left every seed's
/// run.
pub fn search(
    scenario: &EvalScenario,
    duration_s: f64,
    seeds: &[u64],
) -> Result<Vec<PhaseOracle>, SimError> {
    Ok(search_with_starts(scenario, duration_s, seeds)?
        .into_iter()
        .map(|(phase, _)| phase)
        .collect())
}

/// [`search`], with every seed's simulation as it stood at each phase's start.
pub(super) fn search_with_starts(
    scenario: &EvalScenario,
    duration_s: f64,
    seeds: &[u64],
) -> Result<Vec<(PhaseOracle, Vec<SimGpu>)>, SimError> {
    let mut bases = Vec::new();
    for &seed in seeds {
        bases.push(SimGpu::new(
            SimConfig {
                profile: scenario.profile.clone(),
                scenario: scenario.workload.clone(),
                gpus: 1,
                seed,
                noise_seed: None,
            },
            VirtualClock::new(),
        )?);
    }
    if bases.is_empty() {
        return Err(SimError::GpuCount(0));
    }
    let grids = Grids::of(scenario);
    let mut phases = Vec::new();
    for (index, (start_s, end_s, rate)) in scenario.phase_spans(duration_s).into_iter().enumerate()
    {
        let outside = scenario
            .workload
            .phases
            .get(index)
            .and_then(|p| p.outside_power_limit_w);
        let ticks = phase_ticks(start_s, end_s);
        let drained_by = backlog_drained_by(scenario, &grids, &bases, ticks, rate)?;
        let segments = match drained_by {
            Some(split) => vec![
                (start_s, start_s + split as f64, true),
                (start_s + split as f64, end_s, false),
            ],
            None => vec![(start_s, end_s, false)],
        };
        for (start_s, end_s, drains_backlog) in segments {
            let ticks = phase_ticks(start_s, end_s);
            let (phase, ends) = search_phase(scenario, &grids, &bases, ticks, rate, outside)?;
            phases.push((
                PhaseOracle {
                    start_s,
                    end_s,
                    scenario_phase: index,
                    drains_backlog,
                    ..phase
                },
                bases,
            ));
            bases = ends;
        }
    }
    Ok(phases)
}

/// Ticks into a phase after which the rest of it gets a setting of its own: where the phase
/// inherits a backlog (the phase before was an overload) that the most capable setting works
/// off early, and keeps the objective from then on, on every seed. Held to one setting
/// throughout, the oracle would drain at full speed and then keep full speed for the rest
/// of the phase, which a policy that slows down once the queue is gone beats by far. The
/// split falls [`DRAIN_MARGIN_S`] after the last tick over on any seed, rounded up to ten
/// seconds; none where that leaves less than [`MIN_REST_S`], or where the most capable
/// setting keeps the objective over the whole phase anyway.
fn backlog_drained_by(
    scenario: &EvalScenario,
    grids: &Grids,
    bases: &[SimGpu],
    ticks: u64,
    rate: f64,
) -> Result<Option<u64>, SimError> {
    let largest = grids.budgets.first().copied().unwrap_or(1);
    let mut overload = false;
    let mut last_over = None;
    for base in bases {
        let (seed, _, runs) = SeedPhase::start(scenario, grids, base, ticks, rate, &[largest])?;
        let Some((_, trial, _)) = runs.first() else {
            return Ok(None);
        };
        if trial.turned_away > 0 {
            return Ok(None);
        }
        overload |= seed.overload;
        last_over = last_over.max(trial.last_violation);
    }
    let Some(last_over) = last_over.filter(|_| overload) else {
        return Ok(None);
    };
    let split = (last_over + 1).div_ceil(10) * 10 + DRAIN_MARGIN_S;
    Ok((split + MIN_REST_S <= ticks).then_some(split))
}

pub(super) fn phase_ticks(start_s: f64, end_s: f64) -> u64 {
    (end_s.round() - start_s.round()).max(1.0) as u64
}

/// Every seed's view of a phase (the first's budget screen over every budget of the
/// grid, the others' over the largest and the first's chosen one), the budget the search
/// starts from, and the first seed's screen runs.
#[allow(clippy::type_complexity)] // one phase's start, spelled out
pub(super) fn seed_phases<'a>(
    scenario: &'a EvalScenario,
    grids: &Grids,
    bases: &[SimGpu],
    ticks: u64,
    rate: f64,
) -> Result<
    (
        Vec<SeedPhase<'a>>,
        u32,
        Vec<(OracleSetting, Trial, Vec<SimGpu>)>,
    ),
    SimError,
> {
    let (first_base, other_bases) = bases.split_first().ok_or(SimError::GpuCount(0))?;
    let (first, budget, runs) =
        SeedPhase::start(scenario, grids, first_base, ticks, rate, &grids.budgets)?;
    let mut seeds = vec![first];
    let largest = grids.budgets.first().copied().unwrap_or(budget);
    let screened: Vec<u32> = if budget == largest {
        vec![largest]
    } else {
        vec![largest, budget]
    };
    // The most capable setting at the chosen budget keeps every seed's own bar (an
    // overload's bar is its own run): it is the search's first best, with every seed's end.
    let mut first_best_ends = Vec::new();
    for base in other_bases {
        let (seed, _, mut other_runs) =
            SeedPhase::start(scenario, grids, base, ticks, rate, &screened)?;
        // Held to the first seed's budget: on an overload here, the bar is that run's.
        if let Some(at) = other_runs
            .iter()
            .position(|(s, _, _)| s.token_budget == budget)
        {
            let (_, trial, end) = other_runs.swap_remove(at);
            let mut seed = seed;
            if !seed.feasible(&trial) {
                seed.hold_to(&trial);
            }
            seeds.push(seed);
            first_best_ends.push(end);
        }
    }
    let runs = runs
        .into_iter()
        .map(|(setting, trial, end)| {
            let ends = if setting.token_budget == budget {
                std::iter::once(end)
                    .chain(first_best_ends.drain(..))
                    .collect()
            } else {
                vec![end]
            };
            (setting, trial, ends)
        })
        .collect();
    Ok((seeds, budget, runs))
}

/// One phase's search (see the module's words); the phase's oracle and every seed's run
/// to the phase's end.
fn search_phase(
    scenario: &EvalScenario,
    grids: &Grids,
    bases: &[SimGpu],
    ticks: u64,
    rate: f64,
    outside: Option<f64>,
) -> Result<(PhaseOracle, Vec<SimGpu>), SimError> {
    let (seeds, budget, runs) = seed_phases(scenario, grids, bases, ticks, rate)?;
    let overload = seeds.iter().any(|s| s.overload);
    let mut search = PhaseSearch {
        seeds,
        tried: HashMap::new(),
        trials: Vec::new(),
        best: (0, Vec::new()),
        max_tries: MAX_TRIES,
    };
    for (setting, trial, ends) in runs {
        let index = search.trials.len();
        search.tried.insert(key(&setting), index);
        let first = setting.token_budget == budget;
        search.trials.push((setting, trial, first.then_some(true)));
        if first {
            search.best = (index, ends);
        }
    }
    let start = search.best.0;
    let most = OracleSetting {
        token_budget: budget,
        ..grids.most_capable()
    };
    let scored = oracle::score_all(scenario, rate, outside);
    let settings_scored = scored.len();
    // The model's best distinct operating points: settings that share one (a cap above
    // what the point draws) behave alike.
    let mut model_seeds: Vec<OracleSetting> = Vec::new();
    let mut points = Vec::new();
    for candidate in &scored {
        if points.contains(&candidate.point) {
            continue;
        }
        points.push(candidate.point);
        model_seeds.push(OracleSetting {
            token_budget: budget,
            ..grids.snapped(candidate.setting)
        });
        if model_seeds.len() == MODEL_SEEDS {
            break;
        }
    }
    let ladder = oracle::cap_grid(grids.cap_min_w, grids.cap_max_w);
    let tpot_limit_s = scenario
        .objective
        .tpot_p99_limit_ms
        .map_or(f64::INFINITY, |ms| ms * 1e-3);
    let stride = (ladder.len() / CAP_SEEDS).max(1);
    // Each rung at the batch the model ranks best under it with no clock lock: a low cap
    // keeps a latency bound only with fewer sequences, and a walk one axis at a time
    // cannot get there from the largest batch (the cap alone breaks the bound, the batch
    // alone costs joules).
    let cap_seeds: Vec<OracleSetting> = ladder
        .iter()
        .skip(stride)
        .step_by(stride)
        .take(CAP_SEEDS)
        .map(|&power_cap_w| {
            let batch_size = scored
                .iter()
                .find(|c| {
                    c.setting.power_cap_w == power_cap_w
                        && c.setting.sm_clock_max_mhz == most.sm_clock_max_mhz
                        && c.tpot_s <= CAP_SEED_TPOT_HEADROOM * tpot_limit_s
                })
                .map_or(most.batch_size, |c| grids.snapped(c.setting).batch_size);
            OracleSetting {
                power_cap_w,
                batch_size,
                ..most
            }
        })
        .collect();
    // Two basins: clock locks (the model's seeds, mostly) and caps the firmware clocks
    // under. Each is searched from its best seed (the most capable setting counts as the
    // first basin's), with half the tries left each.
    let mut basins = Vec::new();
    for group in [model_seeds, cap_seeds] {
        let mut indices = vec![start];
        for setting in group {
            search.try_setting(setting, start)?;
            if let Some(&index) = search.tried.get(&key(&setting)) {
                indices.push(index);
            }
        }
        basins.push(indices);
    }
    let starts: Vec<usize> = basins
        .iter()
        .filter_map(|indices| search.best_of(indices))
        .collect();
    let each = MAX_TRIES.saturating_sub(search.trials.len()) * 2 / 5;
    let mut refined = Vec::new();
    for from in starts {
        if !refined.contains(&from) {
            refined.push(from);
            search.refine(grids, from, each)?;
        }
    }
    // A third start: the best so far with half its token budget and an eighth of its
    // batch (smaller steps, each sequence's share of them larger), which a walk one axis
    // at a time rarely reaches from the others' basins.
    let best = search.trials[search.best.0].0;
    let third = OracleSetting {
        token_budget: grids
            .moved(best, 3, -1)
            .map_or(best.token_budget, |s| s.token_budget),
        batch_size: grids
            .moved(best, 2, -8)
            .map_or(best.batch_size, |s| s.batch_size),
        ..best
    };
    let here = search.best.0;
    if search.try_setting(third, 0)? || search.tried.contains_key(&key(&third)) {
        let from = search.tried[&key(&third)];
        if search.trials[from].2 == Some(true) && from != here {
            search.refine(grids, from, MAX_TRIES)?;
        }
    }
    // A polish: one rung each way from the best, past the budget of tries. A basin's walk
    // that ran out of tries while its steps were still coarse stops a rung off the edge.
    search.max_tries = search.trials.len() + POLISH_TRIES;
    search.refine_by(grids, search.best.0, POLISH_TRIES, [1; 4])?;
    let simulated = search.trials.len();
    let (index, ends) = search.best;
    let (setting, trial, _) = &search.trials[index];
    let (predicted_tokens_per_joule, predicted_tpot_s) =
        oracle::steady_estimate(scenario, rate, outside, *setting);
    Ok((
        PhaseOracle {
            start_s: 0.0,
            end_s: 0.0,
            scenario_phase: 0,
            drains_backlog: false,
            arrival_rps: rate,
            setting: *setting,
            predicted_tokens_per_joule,
            predicted_tpot_ms: predicted_tpot_s * 1e3,
            simulated_tokens_per_joule: trial.tokens_per_joule,
            simulated_violation_fraction: trial.violation_fraction(),
            feasible: !overload,
            settings_scored,
            settings_simulated: simulated,
        },
        ends,
    ))
}
