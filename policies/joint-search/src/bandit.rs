//! Thompson sampling over the (SM clock, batch size) arms of one GPU, under constraints.

use crate::config::Config;
use tokwatt_policy_kit::ladder::{LadderWindow, WindowLatency};
use tokwatt_policy_kit::measure::{
    ArmRecord, Noise, Shift, ShiftDetector, ShiftRule, TickFigures, objective_breach,
};
use tokwatt_policy_kit::stats::RunningStats;
use tokwatt_policy_sdk::{
    DeviceFacts, Objective, Observation, StateReader, StateWriter, debug, info, random_f64,
};

/// Ticks the settings in force may differ from the arm asked for before the search takes
/// the arm in force as its own.
const MISMATCH_TICKS: u32 = 5;

/// The relative gain a draw must promise over the current arm's mean to move.
const SWITCH_MARGIN: f64 = 0.01;

/// Grid steps within which measured arms inform an unmeasured arm's prior.
const PRIOR_REACH: usize = 2;

/// Grid steps from an arm known to hold that the search may explore: far enough that a
/// 24-level clock grid is crossed in a handful of visits, near enough that a step over
/// the latency edge overshoots it by little (and is left at once).
const EXPLORE_REACH: usize = 3;

/// The search of one GPU. Arms are `clock * batches.len() + batch`, by level indices,
/// lowest clock and smallest batch first.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Bandit {
    pub gpu: u32,
    /// Clock levels, ascending, MHz.
    pub clocks: Vec<u32>,
    /// Batch levels, ascending.
    pub batches: Vec<u32>,
    /// What each arm did since the last re-exploration.
    pub records: Vec<ArmRecord>,
    /// Per arm, the visit count until which it stays ruled out (0: not ruled out), for
    /// latency (slower clocks and larger batches are no better) and for the queue
    /// (slower clocks and smaller batches are no better).
    pub latency_bad_until: Vec<u32>,
    pub queue_bad_until: Vec<u32>,
    /// Per arm, whether a full visit kept the objective and the queue.
    pub held: Vec<bool>,
    /// Visits (full windows) so far.
    pub visits: u32,
    /// The arm asked for.
    pub current: usize,
    pub window: LadderWindow,
    pub noise: Noise,
    pub shift: ShiftDetector,
    /// Tokens per second over the ticks that kept up with demand: the demand, which
    /// turns a demand-limited arm's power into tokens per joule.
    pub demand: RunningStats,
    pub mismatch_ticks: u32,
    /// True from a move for the objective until a settled tick shows it.
    pub raised: bool,
}

/// A Gaussian belief about an arm's tokens per joule.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Belief {
    mean: f64,
    spread: f64,
}

/// Two numbers from the host's seeded generator as one standard normal draw
/// (Box-Muller).
fn standard_normal() -> f64 {
    let u = random_f64().max(f64::MIN_POSITIVE);
    let v = random_f64();
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

impl Bandit {
    /// The arm grid of `device` and a search that starts at the fastest clock and the
    /// largest batch.
    pub fn new(device: &DeviceFacts, config: &Config) -> Result<Bandit, String> {
        let mut supported = tokwatt_policy_kit::clocks::clock_ladder(device);
        supported.reverse();
        if supported.is_empty() {
            return Err(format!(
                "gpu {}: the host reports no supported SM clocks, so none can be searched",
                device.index
            ));
        }
        if device.batch_size_max == 0 {
            return Err(format!("gpu {}: the workload takes no batch", device.index));
        }
        let levels = (config.clock_levels as usize).min(supported.len());
        let mut clocks: Vec<u32> = (0..levels)
            .map(|level| {
                let at = if levels == 1 {
                    supported.len() - 1
                } else {
                    level * (supported.len() - 1) / (levels - 1)
                };
                supported[at]
            })
            .collect();
        clocks.dedup();
        let mut batches: Vec<u32> = (0..config.batch_levels)
            .map(|halvings| (device.batch_size_max >> halvings).max(1))
            .collect();
        batches.sort_unstable();
        batches.dedup();
        let arms = clocks.len() * batches.len();
        Ok(Bandit {
            gpu: device.index,
            current: arms - 1,
            clocks,
            batches,
            records: vec![ArmRecord::default(); arms],
            latency_bad_until: vec![0; arms],
            queue_bad_until: vec![0; arms],
            held: vec![false; arms],
            visits: 0,
            window: LadderWindow::default(),
            noise: Noise::new(config.noise_cv),
            shift: ShiftDetector::default(),
            demand: RunningStats::default(),
            mismatch_ticks: 0,
            raised: false,
        })
    }

    fn arm(&self, clock: usize, batch: usize) -> usize {
        clock * self.batches.len() + batch
    }

    fn levels(&self, arm: usize) -> (usize, usize) {
        (arm / self.batches.len(), arm % self.batches.len())
    }

    /// The clock and batch of the arm asked for.
    pub fn target(&self) -> (u32, u32) {
        let (clock, batch) = self.levels(self.current);
        (self.clocks[clock], self.batches[batch])
    }

    /// The arm nearest the settings in force.
    fn arm_in_force(&self, observation: &Observation) -> usize {
        let nearest = |levels: &[u32], value: u32| {
            (0..levels.len())
                .min_by_key(|&level| levels[level].abs_diff(value))
                .unwrap_or(0)
        };
        let in_force = &observation.in_force;
        self.arm(
            nearest(&self.clocks, in_force.sm_clock_max_mhz),
            nearest(&self.batches, in_force.batch_size),
        )
    }

    /// Takes one tick and returns the clock and batch to ask for.
    pub fn observe(
        &mut self,
        observation: &Observation,
        objective: &Objective,
        config: &Config,
    ) -> (u32, u32) {
        let in_force = self.arm_in_force(observation);
        if let Some(breach) = objective_breach(observation, objective) {
            if !(observation.settling && self.raised) {
                self.escape(in_force, &breach, objective, config);
            }
            return self.target();
        }
        if !observation.settling {
            self.raised = false;
        }
        if in_force != self.current {
            self.mismatch_ticks += 1;
            if self.mismatch_ticks <= MISMATCH_TICKS {
                return self.target();
            }
            self.current = in_force;
            self.window = LadderWindow::default();
        }
        self.mismatch_ticks = 0;
        let Some(figures) = TickFigures::of(observation) else {
            return self.target();
        };
        let rule = ShiftRule {
            factor: config.shift_factor,
            ticks: config.shift_ticks,
            queue_min: config.queue_min,
            min_record_ticks: config.window_ticks,
        };
        if let Some(shift) = self
            .shift
            .observe(&self.records[self.current], &figures, &rule)
        {
            self.reexplore(shift);
            return self.target();
        }
        if figures.demand_limited {
            self.demand
                .push(figures.tokens_per_s, 2 * config.memory_ticks);
        }
        if self.window.record.ticks() == 0 {
            self.window.queue_start = figures.queue_depth;
        }
        self.window.queue_last = figures.queue_depth;
        self.window.record.push(&figures, config.memory_ticks);
        // An unknown p99 (NaN) is left out of the visit's latency (the push skips it);
        // the tick still counts for tokens per joule.
        self.window
            .tpot_p99_ms
            .push(figures.tpot_p99_ms, config.memory_ticks);
        self.records[self.current].push(&figures, config.memory_ticks);
        // A queue that piles up ends the visit at once: every tick more is a backlog the
        // next arm must drain, and waits the objective may bound.
        let piling_up = self.window.queue_last >= 2 * config.queue_min
            && self.window.queue_last >= self.window.queue_start + config.queue_min;
        if self.window.record.ticks() >= config.window_ticks || piling_up {
            self.end_visit(objective, config);
        }
        self.target()
    }

    /// Drops what was learnt; after a rise in load, goes to the fastest clock first.
    pub fn reexplore(&mut self, shift: Shift) {
        info!(
            "gpu {}: the workload shifted ({}); exploring again",
            self.gpu,
            match shift {
                Shift::Rise => "more work",
                Shift::Fall => "less work",
            }
        );
        self.records.fill(ArmRecord::default());
        self.latency_bad_until.fill(0);
        self.queue_bad_until.fill(0);
        self.held.fill(false);
        self.demand = RunningStats::default();
        self.shift = ShiftDetector::default();
        self.window = LadderWindow::default();
        if shift == Shift::Rise {
            let (_, batch) = self.levels(self.current);
            self.current = self.arm(self.clocks.len() - 1, batch);
        }
    }

    /// Leaves an arm that broke the objective: to the best arm known to hold it, or one
    /// clock level up (one batch level down at the fastest clock).
    fn escape(&mut self, arm: usize, breach: &str, objective: &Objective, config: &Config) {
        let latency = objective
            .tpot_p99_limit_ms
            .is_some_and(|_| breach.contains("time per token"));
        self.rule_out(arm, latency, config);
        let (clock, batch) = self.levels(arm);
        let holds = self.holds();
        let safe = (0..self.records.len())
            .filter(|&candidate| holds[candidate] && self.allowed(candidate, &holds))
            .max_by(|&a, &b| {
                let score = |arm: usize| {
                    self.belief(arm, config.prior_spread)
                        .map_or(0.0, |belief| belief.mean)
                };
                score(a).total_cmp(&score(b))
            });
        self.current = match safe {
            Some(safe) => safe,
            None if clock + 1 < self.clocks.len() => self.arm(clock + 1, batch),
            None => self.arm(clock, batch.saturating_sub(1)),
        };
        info!(
            "gpu {}: {breach} at {} MHz, batch {}; moving to {:?}",
            self.gpu,
            self.clocks[clock],
            self.batches[batch],
            self.target()
        );
        self.raised = true;
        self.window = LadderWindow::default();
    }

    fn rule_out(&mut self, arm: usize, latency: bool, config: &Config) {
        let until = self.visits.saturating_add(config.hold_visits);
        if latency {
            self.latency_bad_until[arm] = until;
        } else {
            self.queue_bad_until[arm] = until;
        }
        self.held[arm] = false;
    }

    /// Ends a visit: judges the arm's bounds, learns the noise, picks the next arm. A
    /// visit in which no tick told the p99 time per token, under a limit, is not ended
    /// unless the queue rules the arm out: it goes on until a tick tells.
    fn end_visit(&mut self, objective: &Objective, config: &Config) {
        let arm = self.current;
        match self.out_of_bounds(objective, config) {
            Some((latency, reason)) => {
                debug!(
                    "gpu {}: arm {:?} is out of bounds: {reason}",
                    self.gpu,
                    self.target()
                );
                self.rule_out(arm, latency, config);
            }
            None if self.latency_unknown(objective, config) => {
                // Held on tokens per joule alone, the arm would vouch for slower clocks
                // and larger batches, and the next draw could move past the limit unseen.
                debug!(
                    "gpu {}: no tick at arm {:?} told its p99 time per token; measuring on",
                    self.gpu,
                    self.target()
                );
                return;
            }
            None => self.held[arm] = true,
        }
        self.noise.learn(&self.window.record, config.noise_floor_cv);
        self.window = LadderWindow::default();
        self.visits = self.visits.saturating_add(1);
        self.current = self.sample(config.prior_spread).unwrap_or(arm);
    }

    /// Whether the objective bounds the p99 time per token and no tick of the visit
    /// told it (the host sends NaN when a serving engine saw no request end).
    fn latency_unknown(&self, objective: &Objective, config: &Config) -> bool {
        objective.tpot_p99_limit_ms.is_some_and(|limit_ms| {
            self.window.latency(limit_ms, config.tpot_margin) == WindowLatency::Unknown
        })
    }

    /// Why the visit just ended is out of bounds, and whether for latency.
    fn out_of_bounds(&self, objective: &Objective, config: &Config) -> Option<(bool, String)> {
        let window = &self.window;
        if let Some(limit_ms) = objective.tpot_p99_limit_ms
            && let WindowLatency::Near(mean_ms) = window.latency(limit_ms, config.tpot_margin)
        {
            return Some((
                true,
                format!("p99 time per token {mean_ms:.2} ms is near the limit"),
            ));
        }
        let fastest = self.records.len() - 1;
        let top = &self.records[fastest];
        let queue_min = f64::from(config.queue_min);
        let beyond_the_gpu = top.ticks() >= config.window_ticks
            && top.queue_depth.mean >= queue_min
            && !top.is_demand_limited();
        if self.current == fastest || beyond_the_gpu {
            return None;
        }
        window
            .requests_waiting(config.queue_min, config.queue_growth)
            .map(|waiting| {
                (
                    false,
                    format!("{:.0} requests waited on average", waiting.mean),
                )
            })
    }

    /// Whether an active rule-out covers `arm`: a latency rule-out at a faster or
    /// equal clock with a smaller or equal batch, or a queue rule-out at a faster or
    /// equal clock with a larger or equal batch.
    fn ruled_out(&self, arm: usize) -> bool {
        self.ruled_out_for(arm, true) || self.ruled_out_for(arm, false)
    }

    /// Whether an active rule-out for latency (`true`) or the queue covers `arm`.
    fn ruled_out_for(&self, arm: usize, latency: bool) -> bool {
        let (clock, batch) = self.levels(arm);
        let active = |until: u32| until > self.visits;
        (0..self.records.len()).any(|other| {
            let (other_clock, other_batch) = self.levels(other);
            if latency {
                active(self.latency_bad_until[other])
                    && other_clock >= clock
                    && other_batch <= batch
            } else {
                active(self.queue_bad_until[other]) && other_clock >= clock && other_batch >= batch
            }
        })
    }

    /// Per arm, whether it is known to hold (see [`Bandit::known_to_hold`]).
    fn holds(&self) -> Vec<bool> {
        (0..self.records.len())
            .map(|arm| self.known_to_hold(arm))
            .collect()
    }

    /// Whether some visited arm vouches for `arm` on both counts: one as slow or slower
    /// with as large a batch or larger kept the latency; one as slow or slower with as
    /// small a batch or smaller kept up with demand.
    fn known_to_hold(&self, arm: usize) -> bool {
        let (clock, batch) = self.levels(arm);
        let vouched = |larger: bool| {
            (0..self.records.len()).any(|other| {
                let (other_clock, other_batch) = self.levels(other);
                self.held[other]
                    && other_clock <= clock
                    && if larger {
                        other_batch >= batch
                    } else {
                        other_batch <= batch
                    }
            })
        };
        vouched(true) && vouched(false)
    }

    /// Whether `arm` may be visited: not ruled out, at the largest batch or one where the
    /// next larger batch is ruled out for latency, and known to hold or within
    /// [`EXPLORE_REACH`] grid steps of an arm known to hold (exploration from the safe
    /// side).
    fn allowed(&self, arm: usize, holds: &[bool]) -> bool {
        if self.ruled_out(arm) {
            return false;
        }
        let (clock, batch) = self.levels(arm);
        // A smaller batch makes fewer tokens per joule at the same clock and lets a queue
        // build; it is worth a visit only where the next larger one breaks the latency.
        if batch + 1 < self.batches.len() && !self.ruled_out_for(self.arm(clock, batch + 1), true) {
            return false;
        }
        if holds[arm] {
            return true;
        }
        (0..self.records.len()).any(|other| {
            let (other_clock, other_batch) = self.levels(other);
            holds[other]
                && clock.abs_diff(other_clock) + batch.abs_diff(other_batch) <= EXPLORE_REACH
        })
    }

    /// What an arm's tokens per joule is believed to be: from its own record where it
    /// has one, else from measured arms within two grid steps (closer ones weigh more),
    /// with a spread of `prior_spread` of the mean per grid step.
    fn belief(&self, arm: usize, prior_spread: f64) -> Option<Belief> {
        let record = &self.records[arm];
        if record.ticks() > 0 {
            return self.measured(record);
        }
        let (clock, batch) = self.levels(arm);
        let mut weight_sum = 0.0;
        let mut mean_sum = 0.0;
        let mut nearest = usize::MAX;
        for other in 0..self.records.len() {
            let (other_clock, other_batch) = self.levels(other);
            let distance = clock.abs_diff(other_clock) + batch.abs_diff(other_batch);
            if distance == 0 || distance > PRIOR_REACH {
                continue;
            }
            if let Some(belief) = self.measured(&self.records[other]) {
                let weight = 1.0 / distance as f64;
                weight_sum += weight;
                mean_sum += weight * belief.mean;
                nearest = nearest.min(distance);
            }
        }
        (weight_sum > 0.0).then(|| {
            let mean = mean_sum / weight_sum;
            Belief {
                mean,
                spread: mean * prior_spread * nearest as f64,
            }
        })
    }

    /// The belief from an arm's own ticks: tokens per joule, or, while it kept up with
    /// demand, demand over power (the arrivals' noise left out).
    fn measured(&self, record: &ArmRecord) -> Option<Belief> {
        if record.ticks() == 0 {
            return None;
        }
        let (stats, noise, scale) = if record.is_demand_limited() && self.demand.count > 0 {
            (
                &record.inverse_power,
                self.noise.inverse_power.relative_variance,
                self.demand.mean / 1000.0,
            )
        } else {
            (
                &record.efficiency,
                self.noise.efficiency.relative_variance,
                1.0,
            )
        };
        let mean = stats.mean * scale;
        Some(Belief {
            mean,
            spread: stats.standard_error(noise) * scale,
        })
    }

    /// Thompson sampling: a draw from each allowed arm's belief, and the best draw wins.
    /// Arms with no belief yet borrow the best belief, widened, so that the search
    /// looks at them when nothing near is known.
    fn sample(&self, prior_spread: f64) -> Option<usize> {
        let best_known = (0..self.records.len())
            .filter_map(|arm| self.belief(arm, prior_spread))
            .map(|belief| belief.mean)
            .fold(0.0_f64, f64::max);
        let holds = self.holds();
        let mut best: Option<(usize, f64)> = None;
        for arm in 0..self.records.len() {
            if !self.allowed(arm, &holds) {
                continue;
            }
            let belief = self.belief(arm, prior_spread).unwrap_or(Belief {
                mean: best_known,
                spread: 2.0 * prior_spread * best_known,
            });
            let draw = belief.mean + belief.spread * standard_normal();
            if best.is_none_or(|(_, best_draw)| draw > best_draw) {
                best = Some((arm, draw));
            }
        }
        // Stay unless the winner's draw beats the current arm's mean by `SWITCH_MARGIN`:
        // every switch costs a settling tick and stirs the queue, for a gain within
        // the noise.
        let current = self.belief(self.current, prior_spread);
        match (best, current) {
            (Some((_, draw)), Some(current))
                if self.allowed(self.current, &holds)
                    && draw < current.mean * (1.0 + SWITCH_MARGIN) =>
            {
                Some(self.current)
            }
            _ => best.map(|(arm, _)| arm),
        }
    }

    /// Appends this search's state (see `state.rs` for the layout).
    pub fn write_state(&self, writer: StateWriter) -> StateWriter {
        let as_u32 = |value: usize| u32::try_from(value).unwrap_or(u32::MAX);
        let mut writer = writer.u32(as_u32(self.records.len()));
        for arm in 0..self.records.len() {
            writer = self.records[arm]
                .write(writer)
                .u32(self.latency_bad_until[arm])
                .u32(self.queue_bad_until[arm])
                .bool(self.held[arm]);
        }
        writer = writer.u32(self.visits).u32(as_u32(self.current));
        writer = self.window.write(writer);
        writer = self.noise.write(writer);
        writer = self.shift.write(writer);
        self.demand
            .write(writer)
            .u32(self.mismatch_ticks)
            .bool(self.raised)
    }

    /// This search with the state read from `reader` laid over it.
    ///
    /// # Errors
    /// Another arm grid, a truncated record or a value out of range, naming the GPU.
    pub fn read_state(
        &self,
        reader: &mut StateReader<'_>,
        config: &Config,
    ) -> Result<Bandit, String> {
        let memory = config.memory_ticks;
        let arms = reader.u32()? as usize;
        if arms != self.records.len() {
            return Err(format!(
                "gpu {}: the state has {arms} arms, this instance {}; starting afresh",
                self.gpu,
                self.records.len()
            ));
        }
        let mut bandit = self.clone();
        for arm in 0..arms {
            bandit.records[arm] = ArmRecord::read(reader, memory)?;
            bandit.latency_bad_until[arm] = reader.u32()?;
            bandit.queue_bad_until[arm] = reader.u32()?;
            bandit.held[arm] = reader.bool()?;
        }
        bandit.visits = reader.u32()?;
        bandit.current = reader.u32()? as usize;
        if bandit.current >= arms {
            return Err(format!(
                "gpu {}: arm {} is off the grid",
                self.gpu, bandit.current
            ));
        }
        bandit.window = LadderWindow::read(reader, memory)?;
        bandit.noise = Noise::read(reader)?;
        bandit.shift = ShiftDetector::read(reader)?;
        bandit.demand = RunningStats::read(reader, 2 * memory)?;
        bandit.mismatch_ticks = reader.u32()?;
        bandit.raised = reader.bool()?;
        Ok(bandit)
    }
}
