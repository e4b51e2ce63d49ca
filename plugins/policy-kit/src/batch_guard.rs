//! The batch size an operator would run without tokwatt: the largest the workload takes,
//! cut when the p99 time per token breaks the objective and grown back slowly when there
//! is ample room. Shared by the `default` and `node-budget` policies.
//!
//! On a settled tick that made tokens:
//!
//! - p99 time per token over the limit: cut at once to `batch_shrink_factor` of the
//!   sequences decoding (of the batch, when it is full);
//! - under `batch_headroom` of the limit while there is demand (requests wait, or every
//!   slot is taken) for `batch_grow_after_ticks` ticks in a row: grow by
//!   `batch_grow_factor` (at least one sequence), up to the largest batch;
//! - otherwise hold, and the count of calm ticks starts over. So it is on a tick whose
//!   p99 is unknown (NaN: the serving engine saw no request end in it): unknown latency
//!   is never read as room to grow.
//!
//! Without a p99 limit the batch stays at the largest the workload takes.

use tokwatt_policy_sdk::{DeviceFacts, Observation, Params, StateReader, StateWriter, info};

/// How the guard moves the batch. Keys and defaults:
///
/// | key | default | meaning |
/// |---|---|---|
/// | `batch_shrink_factor` | 0.8 | cut to this fraction of the sequences decoding on a violation |
/// | `batch_grow_factor` | 1.05 | growth per step while there is ample room |
/// | `batch_grow_after_ticks` | 10 | calm ticks in a row before one growth step |
/// | `batch_headroom` | 0.8 | "ample room": p99 under this fraction of the limit |
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchGuardConfig {
    pub shrink_factor: f64,
    pub grow_factor: f64,
    pub grow_after_ticks: u32,
    pub headroom: f64,
}

impl BatchGuardConfig {
    /// The parameter names the guard reads, for a policy's unknown-parameter check.
    pub const KEYS: [&str; 4] = [
        "batch_shrink_factor",
        "batch_grow_factor",
        "batch_grow_after_ticks",
        "batch_headroom",
    ];

    /// The guard's parameters; the caller checks for unknown keys.
    ///
    /// # Errors
    /// A value that does not parse or makes no sense, by name.
    pub fn read(params: &Params<'_>) -> Result<BatchGuardConfig, String> {
        let config = BatchGuardConfig {
            shrink_factor: params.get("batch_shrink_factor", 0.8)?,
            grow_factor: params.get("batch_grow_factor", 1.05)?,
            grow_after_ticks: params.get("batch_grow_after_ticks", 10)?,
            headroom: params.get("batch_headroom", 0.8)?,
        };
        if !(config.shrink_factor > 0.0 && config.shrink_factor < 1.0) {
            return Err(format!(
                "parameter `batch_shrink_factor` = {} must lie strictly between 0 and 1",
                config.shrink_factor
            ));
        }
        if !(config.grow_factor > 1.0 && config.grow_factor.is_finite()) {
            return Err(format!(
                "parameter `batch_grow_factor` = {} must be a finite number above 1",
                config.grow_factor
            ));
        }
        if config.grow_after_ticks == 0 {
            return Err("parameter `batch_grow_after_ticks` must be at least 1".into());
        }
        if !(config.headroom > 0.0 && config.headroom <= 1.0) {
            return Err(format!(
                "parameter `batch_headroom` = {} must lie in (0, 1]",
                config.headroom
            ));
        }
        Ok(config)
    }
}

/// The batch guard of one GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchGuard {
    pub gpu: u32,
    /// The largest batch the workload takes, after the operator's guardrails.
    pub max: u32,
    /// The batch size the guard wants.
    pub target: u32,
    /// Calm ticks in a row with demand, towards the next growth step.
    pub calm_ticks: u32,
}

impl BatchGuard {
    /// A guard for `device`, starting at `start` (fitted to the device) or its largest batch.
    ///
    /// # Errors
    /// A device whose largest batch is 0.
    pub fn new(device: &DeviceFacts, start: Option<u32>) -> Result<BatchGuard, String> {
        let max = device.batch_size_max;
        if max == 0 {
            return Err(format!(
                "gpu {}: the host reports a largest batch size of 0; check the spec's batch \
                 size guardrails",
                device.index
            ));
        }
        Ok(BatchGuard {
            gpu: device.index,
            max,
            target: start.unwrap_or(max).clamp(1, max),
            calm_ticks: 0,
        })
    }

    /// Judges one tick against `limit_ms` and returns the batch to ask for, `None` when
    /// the one in force is already it.
    pub fn observe(
        &mut self,
        observation: &Observation,
        limit_ms: Option<f64>,
        config: &BatchGuardConfig,
    ) -> Option<u32> {
        let in_force = observation.in_force.batch_size;
        let Some(limit_ms) = limit_ms else {
            self.target = self.max;
            return self.request(in_force);
        };
        if observation.settling || observation.tokens == 0 {
            return self.request(in_force);
        }
        let tpot_ms = observation.tpot_p99_ms;
        if !tpot_ms.is_finite() {
            // Unknown latency (the engine saw no request end: the host sends NaN): no
            // cut and no growth on it, and a calm stretch must be told tick by tick.
            self.calm_ticks = 0;
            return self.request(in_force);
        }
        if tpot_ms > limit_ms {
            let decoding = match observation.active_sequences {
                0 => in_force,
                active => active.min(in_force),
            };
            let cut =
                ((f64::from(decoding) * config.shrink_factor).floor() as u32).clamp(1, self.max);
            if cut < in_force {
                info!(
                    "gpu {}: p99 time per token {tpot_ms:.2} ms over the {limit_ms} ms limit at \
                     batch {in_force}; cutting to {cut}",
                    self.gpu
                );
            }
            self.target = cut.min(in_force);
            self.calm_ticks = 0;
        } else if tpot_ms < config.headroom * limit_ms && has_demand(observation) {
            self.calm_ticks += 1;
            if self.calm_ticks >= config.grow_after_ticks {
                let grown = (f64::from(in_force) * config.grow_factor).ceil() as u32;
                self.target = grown.max(in_force.saturating_add(1)).clamp(1, self.max);
                self.calm_ticks = 0;
            }
        } else {
            self.calm_ticks = 0;
        }
        self.request(in_force)
    }

    /// The target, unless it is already in force.
    pub fn request(&self, in_force: u32) -> Option<u32> {
        (self.target != in_force).then_some(self.target)
    }

    /// Appends the guard's state: u32 target, u32 calm ticks.
    #[must_use]
    pub fn write_state(&self, writer: StateWriter) -> StateWriter {
        writer.u32(self.target).u32(self.calm_ticks)
    }

    /// This guard with the handed-over state laid over it, fitted to its range.
    ///
    /// # Errors
    /// A truncated record.
    pub fn read_state(&self, reader: &mut StateReader<'_>) -> Result<BatchGuard, String> {
        let mut guard = self.clone();
        guard.target = reader.u32()?.clamp(1, guard.max);
        guard.calm_ticks = reader.u32()?;
        Ok(guard)
    }
}

/// Whether more sequences would decode if the batch allowed: requests wait, or every
/// slot is taken.
pub fn has_demand(observation: &Observation) -> bool {
    observation.queue_depth > 0 || observation.active_sequences >= observation.in_force.batch_size
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_policy_sdk::testing;

    fn config() -> BatchGuardConfig {
        BatchGuardConfig::read(&Params::new(&[])).unwrap()
    }

    fn tick(batch: u32, waiting: u32, tpot_ms: f64) -> Observation {
        let mut observation = testing::observation(0, 0);
        observation.in_force.batch_size = batch;
        observation.active_sequences = batch;
        observation.queue_depth = waiting;
        observation.tpot_p99_ms = tpot_ms;
        observation
    }

    #[test]
    fn starts_at_the_largest_and_holds_it_without_a_limit() {
        let mut guard = BatchGuard::new(&testing::h200(0), None).unwrap();
        assert_eq!(guard.target, 512);
        assert_eq!(
            guard.observe(&tick(300, 9, 90.0), None, &config()),
            Some(512)
        );
    }

    #[test]
    fn cuts_on_a_violation_and_grows_back_only_after_calm_ticks() {
        let config = config();
        let mut guard = BatchGuard::new(&testing::h200(0), None).unwrap();
        assert_eq!(
            guard.observe(&tick(512, 50, 33.0), Some(20.0), &config),
            Some(409)
        );
        assert_eq!(
            guard.observe(&tick(409, 50, 26.0), Some(20.0), &config),
            Some(327)
        );
        for _ in 0..9 {
            assert_eq!(
                guard.observe(&tick(327, 50, 12.0), Some(20.0), &config),
                None
            );
        }
        assert_eq!(
            guard.observe(&tick(327, 50, 12.0), Some(20.0), &config),
            Some(344)
        );
        // Inside the band: hold, and the calm count starts over.
        assert_eq!(
            guard.observe(&tick(344, 50, 18.0), Some(20.0), &config),
            None
        );
        assert_eq!(guard.calm_ticks, 0);
        // No demand: no growth.
        let mut slack = tick(344, 0, 10.0);
        slack.active_sequences = 100;
        for _ in 0..20 {
            assert_eq!(guard.observe(&slack, Some(20.0), &config), None);
        }
    }

    #[test]
    fn an_unknown_p99_neither_cuts_nor_grows_and_breaks_a_calm_stretch() {
        let config = config();
        let mut guard = BatchGuard::new(&testing::h200(0), Some(300)).unwrap();
        // Requests wait and every slot is taken: only the latency stands between the
        // guard and growth.
        for _ in 0..50 {
            assert_eq!(
                guard.observe(&tick(300, 50, f64::NAN), Some(20.0), &config),
                None,
                "an unknown p99 is not room to grow"
            );
        }
        assert_eq!(guard.target, 300);
        // A calm stretch one tick short of growth, then an unknown tick: it starts over.
        for _ in 0..config.grow_after_ticks - 1 {
            assert_eq!(
                guard.observe(&tick(300, 50, 12.0), Some(20.0), &config),
                None
            );
        }
        for unknown in [f64::NAN, f64::INFINITY] {
            assert_eq!(
                guard.observe(&tick(300, 50, unknown), Some(20.0), &config),
                None
            );
            assert_eq!(guard.calm_ticks, 0, "{unknown}");
        }
        assert_eq!(
            guard.observe(&tick(300, 50, 12.0), Some(20.0), &config),
            None,
            "one calm tick after the unknown ones is not a calm stretch"
        );
    }

    #[test]
    fn bad_values_are_refused_by_name_and_state_round_trips() {
        for (key, value) in [
            ("batch_shrink_factor", "1"),
            ("batch_grow_factor", "1"),
            ("batch_grow_after_ticks", "0"),
            ("batch_headroom", "0"),
        ] {
            let pairs = testing::params(&[(key, value)]);
            let error = BatchGuardConfig::read(&Params::new(&pairs)).unwrap_err();
            assert!(error.contains(key), "{error}");
        }
        let mut guard = BatchGuard::new(&testing::h200(0), None).unwrap();
        guard.target = 200;
        guard.calm_ticks = 3;
        let state = guard.write_state(StateWriter::new()).finish(1);
        let fresh = BatchGuard::new(&testing::h200(0), None).unwrap();
        let mut reader = StateReader::new(&state.bytes);
        assert_eq!(fresh.read_state(&mut reader), Ok(guard));
    }
}
