//! What one tick says about the settings in force, what a setting has done so far, and
//! when the workload has shifted under it: the measuring shared by the noise-aware
//! searches (`cap-search`, `clock-search`, `joint-search`).
//!
//! # Two regimes, two figures
//!
//! While the GPU keeps up with demand (nobody waits for a batch slot), it makes the tokens
//! that arrive whatever the settings: its tokens per second follow the arrivals, whose
//! randomness dwarfs any difference between two settings (±40 % a second at 5 requests/s).
//! Tokens per joule is then demand ÷ power, so two settings that both keep up are compared
//! on power alone ([`ArmRecord::inverse_power`]), which the arrivals barely move. While
//! requests wait, the GPU runs flat out and tokens per joule itself
//! ([`ArmRecord::efficiency`]) is the figure, with little demand noise in it.

use crate::stats::{PooledNoise, RunningStats, Verdict, compare};
use tokwatt_policy_sdk::{Objective, Observation, StateReader, StateWriter};

/// The figures of one settled, busy tick.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TickFigures {
    /// Tokens per joule over the tick.
    pub efficiency: f64,
    /// 1000 / average power in watts: higher is better, like the efficiency.
    pub inverse_power: f64,
    pub tokens_per_s: f64,
    pub queue_depth: u32,
    pub tpot_p99_ms: f64,
    /// Nobody waited at the end of the tick: the GPU kept up with demand.
    pub demand_limited: bool,
}

impl TickFigures {
    /// The figures of `observation`, or `None` when it says nothing about the settings:
    /// a setting changed during it (`settling`), it made no tokens, or it counted no
    /// energy.
    pub fn of(observation: &Observation) -> Option<TickFigures> {
        let energy_j = observation.energy_j;
        let interval_s = observation.interval_s;
        if observation.settling
            || observation.tokens == 0
            || !(energy_j.is_finite() && energy_j > 0.0)
            || !(interval_s.is_finite() && interval_s > 0.0)
        {
            return None;
        }
        let power_w = energy_j / interval_s;
        Some(TickFigures {
            efficiency: observation.tokens as f64 / energy_j,
            inverse_power: 1000.0 / power_w,
            tokens_per_s: observation.tokens as f64 / interval_s,
            queue_depth: observation.queue_depth,
            tpot_p99_ms: observation.tpot_p99_ms,
            demand_limited: observation.queue_depth == 0,
        })
    }
}

/// Why `observation` breaks the objective, if it does: p99 time per token over the limit
/// on a tick that made tokens, p99 time to first token or queue wait over theirs (where
/// the workload tells them), or throughput under the floor while requests wait (under it
/// with an empty queue means too little demand, not too slow a GPU).
pub fn objective_breach(observation: &Observation, objective: &Objective) -> Option<String> {
    if let Some(limit_ms) = objective.tpot_p99_limit_ms
        && observation.tokens > 0
        && observation.tpot_p99_ms > limit_ms
    {
        return Some(format!(
            "p99 time per token {:.2} ms is over the {limit_ms} ms limit",
            observation.tpot_p99_ms
        ));
    }
    if let Some(limit_ms) = objective.ttft_p99_limit_ms
        && let Some(ttft_ms) = observation.requests.as_ref().and_then(|r| r.ttft_p99_ms)
        && ttft_ms > limit_ms
    {
        return Some(format!(
            "p99 time to first token {ttft_ms:.0} ms is over the {limit_ms} ms limit"
        ));
    }
    if let Some(limit_ms) = objective.queue_wait_p99_limit_ms
        && let Some(wait_ms) = observation
            .demand
            .as_ref()
            .and_then(|d| d.queue_wait_p99_ms)
        && wait_ms > limit_ms
    {
        return Some(format!(
            "p99 queue wait {wait_ms:.0} ms is over the {limit_ms} ms limit"
        ));
    }
    if let Some(min_tokens_per_s) = objective.min_tokens_per_s
        && observation.queue_depth > 0
        && observation.tokens_per_s < min_tokens_per_s
    {
        return Some(format!(
            "{:.0} tokens/s with {} requests waiting is under the {min_tokens_per_s} \
             tokens/s minimum",
            observation.tokens_per_s, observation.queue_depth
        ));
    }
    None
}

/// What one setting (a rung of a ladder, an arm of a bandit) has done so far.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ArmRecord {
    pub efficiency: RunningStats,
    pub inverse_power: RunningStats,
    pub tokens_per_s: RunningStats,
    pub queue_depth: RunningStats,
    /// The share of its ticks that kept up with demand (the mean of 1s and 0s).
    pub demand_limited: RunningStats,
}

/// The share of demand-limited ticks above which a setting is compared on power.
const DEMAND_LIMITED_SHARE: f64 = 0.8;

impl ArmRecord {
    pub fn push(&mut self, figures: &TickFigures, memory: u32) {
        self.efficiency.push(figures.efficiency, memory);
        self.inverse_power.push(figures.inverse_power, memory);
        self.tokens_per_s.push(figures.tokens_per_s, memory);
        self.queue_depth
            .push(f64::from(figures.queue_depth), memory);
        self.demand_limited
            .push(if figures.demand_limited { 1.0 } else { 0.0 }, memory);
    }

    pub fn ticks(&self) -> u32 {
        self.efficiency.count
    }

    /// Whether this setting kept up with demand on most of its ticks.
    pub fn is_demand_limited(&self) -> bool {
        self.demand_limited.count > 0 && self.demand_limited.mean >= DEMAND_LIMITED_SHARE
    }

    pub fn write(&self, writer: StateWriter) -> StateWriter {
        let mut writer = writer;
        for stats in [
            &self.efficiency,
            &self.inverse_power,
            &self.tokens_per_s,
            &self.queue_depth,
            &self.demand_limited,
        ] {
            writer = stats.write(writer);
        }
        writer
    }

    /// # Errors
    /// A truncated record or a value that is not finite.
    pub fn read(reader: &mut StateReader<'_>, memory: u32) -> Result<ArmRecord, String> {
        Ok(ArmRecord {
            efficiency: RunningStats::read(reader, memory)?,
            inverse_power: RunningStats::read(reader, memory)?,
            tokens_per_s: RunningStats::read(reader, memory)?,
            queue_depth: RunningStats::read(reader, memory)?,
            demand_limited: RunningStats::read(reader, memory)?,
        })
    }
}

/// The per-tick noise of the two figures, each pooled over a search's windows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Noise {
    pub efficiency: PooledNoise,
    pub inverse_power: PooledNoise,
}

impl Noise {
    pub fn new(cv: f64) -> Noise {
        Noise {
            efficiency: PooledNoise::new(cv),
            inverse_power: PooledNoise::new(cv),
        }
    }

    /// Learns from one window's own ticks.
    pub fn learn(&mut self, window: &ArmRecord, floor_cv: f64) {
        self.efficiency.learn(&window.efficiency, floor_cv);
        self.inverse_power.learn(&window.inverse_power, floor_cv);
    }

    pub fn write(&self, writer: StateWriter) -> StateWriter {
        writer
            .f64(self.efficiency.relative_variance)
            .f64(self.inverse_power.relative_variance)
    }

    /// # Errors
    /// A truncated record or a variance that is not a finite positive number.
    pub fn read(reader: &mut StateReader<'_>) -> Result<Noise, String> {
        let mut read_one = || -> Result<PooledNoise, String> {
            let relative_variance = reader.f64()?;
            if relative_variance.is_finite() && relative_variance > 0.0 {
                Ok(PooledNoise { relative_variance })
            } else {
                Err(format!(
                    "a noise variance of {relative_variance} in the state"
                ))
            }
        };
        Ok(Noise {
            efficiency: read_one()?,
            inverse_power: read_one()?,
        })
    }
}

/// Compares two settings on the figure that fits their regime: power when both kept up
/// with demand, tokens per joule otherwise.
pub fn compare_arms(
    candidate: &ArmRecord,
    incumbent: &ArmRecord,
    noise: &Noise,
    z: f64,
) -> Verdict {
    if candidate.is_demand_limited() && incumbent.is_demand_limited() {
        compare(
            &candidate.inverse_power,
            &incumbent.inverse_power,
            &noise.inverse_power,
            z,
        )
    } else {
        compare(
            &candidate.efficiency,
            &incumbent.efficiency,
            &noise.efficiency,
            z,
        )
    }
}

/// Which way the workload moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shift {
    /// More work: more tokens per second at the same setting, or a queue where there
    /// was none.
    Rise,
    /// Less work: fewer tokens per second at the same setting, or the queue gone.
    Fall,
}

/// Notices a workload shift, comparing this tick's tokens per second (smoothed over a few
/// ticks) with a reference: while the GPU keeps up with demand, its tokens per second are
/// the demand whatever the setting, so the reference is their slow average over such
/// ticks; while requests wait, they depend on the setting, so the reference is what the
/// same setting did before (its record), which keeps a search's own moves from reading as
/// shifts. A shift is a move beyond a factor, or a queue appearing or vanishing at a
/// setting, lasting `ticks` ticks in a row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShiftDetector {
    /// Smoothed ratio of this tick's tokens per second to the reference.
    pub ratio: f64,
    /// Ticks in a row that pointed the same way, and which way (+ rise, - fall).
    pub ticks_off: i32,
    /// Slow average of tokens per second over ticks that kept up with demand; 0 before
    /// the first.
    pub demand: f64,
}

impl Default for ShiftDetector {
    fn default() -> Self {
        ShiftDetector {
            ratio: 1.0,
            ticks_off: 0,
            demand: 0.0,
        }
    }
}

/// What the shift detector needs from the configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShiftRule {
    pub factor: f64,
    pub ticks: u32,
    /// Requests that count as a queue.
    pub queue_min: u32,
    /// Ticks a setting's record needs before it is a reference.
    pub min_record_ticks: u32,
}

impl ShiftDetector {
    /// Takes a tick at a setting with record `record` (before the tick is added to it).
    pub fn observe(
        &mut self,
        record: &ArmRecord,
        figures: &TickFigures,
        rule: &ShiftRule,
    ) -> Option<Shift> {
        const SMOOTHING: f64 = 0.35;
        /// About 20 ticks: slower than the shift rule, faster than a phase.
        const DEMAND_SMOOTHING: f64 = 0.05;
        let has_record = record.ticks() >= rule.min_record_ticks && record.tokens_per_s.mean > 0.0;
        if figures.demand_limited && self.demand <= 0.0 && has_record {
            self.demand = record.tokens_per_s.mean;
        }
        let reference = if figures.demand_limited && self.demand > 0.0 {
            self.demand
        } else if has_record {
            record.tokens_per_s.mean
        } else {
            self.ratio = 1.0;
            self.ticks_off = 0;
            if figures.demand_limited {
                self.demand = figures.tokens_per_s;
            }
            return None;
        };
        let ratio = figures.tokens_per_s / reference;
        self.ratio = (1.0 - SMOOTHING) * self.ratio + SMOOTHING * ratio;
        let queue_min = f64::from(rule.queue_min);
        let queue = f64::from(figures.queue_depth);
        let queue_appeared =
            has_record && record.queue_depth.mean < 1.0 && queue >= 4.0 * queue_min;
        let queue_vanished =
            has_record && record.queue_depth.mean >= 4.0 * queue_min && queue < 1.0;
        let way = if self.ratio > rule.factor || queue_appeared {
            1
        } else if self.ratio < 1.0 / rule.factor || queue_vanished {
            -1
        } else {
            0
        };
        self.ticks_off = if way == 0 || way * self.ticks_off < 0 {
            way
        } else {
            self.ticks_off + way
        };
        if figures.demand_limited {
            self.demand =
                (1.0 - DEMAND_SMOOTHING) * self.demand + DEMAND_SMOOTHING * figures.tokens_per_s;
        }
        let limit = i32::try_from(rule.ticks).unwrap_or(i32::MAX);
        let shift = if self.ticks_off >= limit {
            Some(Shift::Rise)
        } else if self.ticks_off <= -limit {
            Some(Shift::Fall)
        } else {
            None
        };
        if shift.is_some() {
            // The new level is the reference from now on.
            *self = ShiftDetector {
                demand: if figures.demand_limited {
                    figures.tokens_per_s
                } else {
                    0.0
                },
                ..ShiftDetector::default()
            };
        }
        shift
    }

    pub fn write(&self, writer: StateWriter) -> StateWriter {
        writer
            .f64(self.ratio)
            .u32(self.ticks_off as u32)
            .f64(self.demand)
    }

    /// # Errors
    /// A truncated record or a figure that is not finite.
    pub fn read(reader: &mut StateReader<'_>) -> Result<ShiftDetector, String> {
        let ratio = reader.f64()?;
        let ticks_off = reader.u32()? as i32;
        let demand = reader.f64()?;
        if !(ratio.is_finite() && ratio > 0.0 && demand.is_finite() && demand >= 0.0) {
            return Err(format!(
                "a shift ratio of {ratio} or demand of {demand} in the state"
            ));
        }
        Ok(ShiftDetector {
            ratio,
            ticks_off,
            demand,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_policy_sdk::testing;

    fn figures(tokens_per_s: f64, power_w: f64, queue_depth: u32) -> TickFigures {
        TickFigures {
            efficiency: tokens_per_s / power_w,
            inverse_power: 1000.0 / power_w,
            tokens_per_s,
            queue_depth,
            tpot_p99_ms: 10.0,
            demand_limited: queue_depth == 0,
        }
    }

    fn record(ticks: &[TickFigures]) -> ArmRecord {
        let mut record = ArmRecord::default();
        for tick in ticks {
            record.push(tick, 30);
        }
        record
    }

    #[test]
    fn ticks_that_say_nothing_give_no_figures() {
        let busy = testing::observation(0, 1);
        let figures = TickFigures::of(&busy).unwrap_or_else(|| panic!("a busy tick"));
        assert!((figures.inverse_power - 1000.0 / 692.0).abs() < 1e-9);
        assert!(figures.demand_limited);
        let mut settling = busy;
        settling.settling = true;
        let mut idle = busy;
        idle.tokens = 0;
        let mut no_energy = busy;
        no_energy.energy_j = 0.0;
        for tick in [settling, idle, no_energy] {
            assert_eq!(TickFigures::of(&tick), None);
        }
    }

    #[test]
    fn demand_limited_settings_compare_on_power_despite_noisy_tokens() {
        let noise = Noise::new(0.03);
        // Both keep up; the lower-power one made fewer tokens only by chance of arrivals.
        let low = record(&[figures(900.0, 300.0, 0); 5]);
        let high = record(&[figures(1500.0, 400.0, 0); 5]);
        assert_eq!(compare_arms(&low, &high, &noise, 2.0), Verdict::Better);
        // With a queue, tokens per joule decides.
        let low = record(&[figures(9000.0, 300.0, 2000); 5]);
        let high = record(&[figures(15000.0, 400.0, 2000); 5]);
        assert_eq!(compare_arms(&low, &high, &noise, 2.0), Verdict::Worse);
    }

    #[test]
    fn a_sustained_change_at_one_setting_is_a_shift_and_a_blip_is_not() {
        let rule = ShiftRule {
            factor: 1.6,
            ticks: 5,
            queue_min: 16,
            min_record_ticks: 3,
        };
        let known = record(&[figures(8000.0, 300.0, 0); 6]);
        let mut detector = ShiftDetector::default();
        assert_eq!(
            detector.observe(&known, &figures(30000.0, 300.0, 0), &rule),
            None
        );
        assert_eq!(
            detector.observe(&known, &figures(8000.0, 300.0, 0), &rule),
            None
        );
        let mut shift = None;
        for _ in 0..12 {
            shift = shift.or(detector.observe(&known, &figures(1200.0, 300.0, 0), &rule));
        }
        assert_eq!(shift, Some(Shift::Fall));
        let mut detector = ShiftDetector::default();
        let mut shift = None;
        for _ in 0..5 {
            shift = shift.or(detector.observe(&known, &figures(8000.0, 300.0, 500), &rule));
        }
        assert_eq!(shift, Some(Shift::Rise));
        // Without a record there is no reference.
        let mut detector = ShiftDetector::default();
        for _ in 0..10 {
            let shift = detector.observe(&ArmRecord::default(), &figures(1.0, 300.0, 900), &rule);
            assert_eq!(shift, None);
        }
    }

    #[test]
    fn while_demand_limited_a_fall_shows_even_at_a_setting_with_no_record() {
        let rule = ShiftRule {
            factor: 1.6,
            ticks: 5,
            queue_min: 16,
            min_record_ticks: 3,
        };
        let mut detector = ShiftDetector::default();
        let known = record(&[figures(8000.0, 300.0, 0); 6]);
        for _ in 0..10 {
            assert_eq!(
                detector.observe(&known, &figures(8000.0, 300.0, 0), &rule),
                None
            );
        }
        // The search moved to a setting it never measured just as demand fell.
        let mut shift = None;
        for _ in 0..8 {
            shift = shift.or(detector.observe(
                &ArmRecord::default(),
                &figures(2000.0, 250.0, 0),
                &rule,
            ));
        }
        assert_eq!(shift, Some(Shift::Fall));
    }

    #[test]
    fn breaches_name_the_limit() {
        let objective = Objective {
            tpot_p99_limit_ms: Some(7.0),
            min_tokens_per_s: Some(9000.0),
            queue_wait_p99_limit_ms: None,
            ttft_p99_limit_ms: None,
        };
        let observation = testing::observation(0, 1);
        let breach = objective_breach(&observation, &objective).unwrap_or_default();
        assert!(breach.contains("over the 7 ms limit"), "{breach}");
        let mut waiting = observation;
        waiting.tpot_p99_ms = 5.0;
        assert_eq!(objective_breach(&waiting, &objective), None);
        waiting.queue_depth = 3;
        assert!(objective_breach(&waiting, &objective).is_some());
    }

    #[test]
    fn a_first_token_or_a_wait_over_its_limit_is_a_breach() {
        let objective = Objective {
            tpot_p99_limit_ms: None,
            min_tokens_per_s: None,
            queue_wait_p99_limit_ms: Some(1000.0),
            ttft_p99_limit_ms: Some(500.0),
        };
        let mut observation = testing::observation(0, 1);
        assert_eq!(
            objective_breach(&observation, &objective),
            None,
            "nothing told"
        );
        observation.requests = Some(tokwatt_policy_sdk::Requests {
            prefill_tokens: 4000,
            first_tokens: 3,
            ttft_p99_ms: Some(650.0),
            prefill_time_share: Some(0.4),
            preemptions: Some(0),
            requests_finished: Some(3),
            energy_per_request_j: None,
        });
        let breach = objective_breach(&observation, &objective).unwrap_or_default();
        assert!(breach.contains("first token 650 ms"), "{breach}");
        assert!((crate::ladder::tpot_overshoot(&observation, &objective) - 1.3).abs() < 1e-9);
        if let Some(requests) = observation.requests.as_mut() {
            requests.ttft_p99_ms = Some(300.0);
        }
        assert_eq!(objective_breach(&observation, &objective), None);
        observation.demand = Some(tokwatt_policy_sdk::Demand {
            requests_arrived: 10,
            requests_completed: 10,
            requests_turned_away: 0,
            tokens_demanded: 1000,
            queue_wait_p99_ms: Some(1500.0),
        });
        let breach = objective_breach(&observation, &objective).unwrap_or_default();
        assert!(breach.contains("queue wait 1500 ms"), "{breach}");
    }
}
