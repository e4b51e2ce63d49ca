//! The batch size of one GPU: additive increase while latency has headroom and requests
//! wait, multiplicative decrease when the latency limit is broken.

use crate::config::BatchConfig;
use tokwatt_policy_sdk::{DeviceFacts, Observation, debug, info};

/// What the batch control decided on one tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BatchMove {
    /// Nothing to change, or nothing to judge (a settling or idle tick).
    Hold,
    /// The batch size changes to this.
    Resize(u32),
    /// The latency limit is broken and the batch cannot shrink further: only a higher
    /// power cap can help.
    AtSmallest,
}

/// The batch control of one GPU.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BatchControl {
    pub gpu: u32,
    /// The largest batch the workload accepts, after the operator's guardrails.
    pub max: u32,
    /// A change asked for and not yet in force. The host may step towards it over
    /// several (settling) ticks under its rate limit, so it is asked for again until it
    /// is reached or a settled tick decides afresh.
    pub pending: Option<u32>,
}

impl BatchControl {
    /// The batch control for `device`, starting at `start` (fitted to the device) if
    /// given, else at whatever the workload runs.
    pub fn new(device: &DeviceFacts, start: Option<u32>) -> Result<BatchControl, String> {
        let max = device.batch_size_max;
        if max == 0 {
            return Err(format!(
                "gpu {}: the host reports a largest batch size of 0, which cap-and-batch \
                 cannot steer; check the spec's batch size guardrails",
                device.index
            ));
        }
        Ok(BatchControl {
            gpu: device.index,
            max,
            pending: start.map(|size| size.clamp(1, max)),
        })
    }

    /// Judges one tick against the latency limit and picks the next batch size.
    ///
    /// Settling ticks mix two settings and idle ticks carry no latency, so neither is
    /// judged. Decisions start from the batch size in force, not from the last request,
    /// so a host that clamped or refused a request cannot make the control drift.
    pub fn observe(
        &mut self,
        observation: &Observation,
        limit_ms: f64,
        config: &BatchConfig,
    ) -> BatchMove {
        if observation.settling {
            return BatchMove::Hold;
        }
        // A settled tick: the host is not stepping towards anything any more.
        self.pending = None;
        if observation.tokens == 0 {
            return BatchMove::Hold;
        }
        let in_force = observation.in_force.batch_size;
        let tpot_ms = observation.tpot_p99_ms;
        let next = if tpot_ms > limit_ms {
            let shrunk = self.shrunk(observation, config);
            if shrunk >= in_force {
                return BatchMove::AtSmallest;
            }
            info!(
                "gpu {}: p99 time per token {tpot_ms:.2} ms is over the {limit_ms} ms limit \
                 at batch {in_force} ({} active); shrinking the batch to {shrunk}",
                self.gpu, observation.active_sequences
            );
            shrunk
        } else if tpot_ms < config.headroom * limit_ms && has_demand(observation) {
            let grown = self.grown(in_force, config);
            if grown <= in_force {
                return BatchMove::Hold;
            }
            debug!(
                "gpu {}: p99 time per token {tpot_ms:.2} ms with {} waiting; growing the \
                 batch from {in_force} to {grown}",
                self.gpu, observation.queue_depth
            );
            grown
        } else {
            return BatchMove::Hold;
        };
        self.pending = Some(next);
        BatchMove::Resize(next)
    }

    /// The batch size to ask for, unless it is already in force.
    pub fn request(&self, in_force: u32) -> Option<u32> {
        self.pending.filter(|&size| size != in_force)
    }

    /// The multiplicative decrease. It starts from the sequences actually decoding when
    /// fewer than the batch size: cutting a limit the workload does not reach would
    /// change nothing, and the next tick would break the objective again.
    fn shrunk(&self, observation: &Observation, config: &BatchConfig) -> u32 {
        let in_force = observation.in_force.batch_size;
        let decoding = match observation.active_sequences {
            0 => in_force,
            active => active.min(in_force),
        };
        let shrunk = (f64::from(decoding) * config.shrink_factor).floor();
        // `as` saturates, and the clamp keeps the result a batch the workload accepts.
        (shrunk as u32).clamp(1, self.max)
    }

    /// The increase: multiplicative while the batch is small (an additive step would
    /// take long to get anywhere), additive above.
    fn grown(&self, in_force: u32, config: &BatchConfig) -> u32 {
        let grown = if in_force < config.multiplicative_below {
            let scaled = (f64::from(in_force) * config.grow_factor).ceil() as u32;
            scaled.max(in_force.saturating_add(1))
        } else {
            in_force.saturating_add(config.step)
        };
        grown.clamp(1, self.max)
    }
}

/// Whether more sequences would be decoded if the batch allowed it: requests wait, or
/// every slot is taken (a closed-loop client refills a slot as soon as it frees, so its
/// queue stays empty while the batch is the limit).
fn has_demand(observation: &Observation) -> bool {
    observation.queue_depth > 0 || observation.active_sequences >= observation.in_force.batch_size
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_policy_sdk::testing;

    const LIMIT_MS: f64 = 20.0;

    fn control() -> BatchControl {
        BatchControl::new(&testing::h200(0), None).unwrap_or_else(|error| panic!("{error}"))
    }

    fn config() -> BatchConfig {
        BatchConfig {
            headroom: 0.85,
            step: 16,
            multiplicative_below: 64,
            grow_factor: 1.25,
            shrink_factor: 0.7,
            start: None,
        }
    }

    /// A settled tick at `batch` with every slot taken, `waiting` requests and `tpot_ms`.
    fn tick(batch: u32, waiting: u32, tpot_ms: f64) -> Observation {
        let mut observation = testing::observation(0, 0);
        observation.in_force.batch_size = batch;
        observation.active_sequences = batch;
        observation.queue_depth = waiting;
        observation.tpot_p99_ms = tpot_ms;
        observation
    }

    #[test]
    fn grows_multiplicatively_when_small_and_additively_above() {
        let mut control = control();
        let config = config();
        assert_eq!(
            control.observe(&tick(32, 5, 10.0), LIMIT_MS, &config),
            BatchMove::Resize(40)
        );
        assert_eq!(control.request(32), Some(40));
        assert_eq!(
            control.observe(&tick(1, 5, 10.0), LIMIT_MS, &config),
            BatchMove::Resize(2)
        );
        assert_eq!(
            control.observe(&tick(64, 5, 10.0), LIMIT_MS, &config),
            BatchMove::Resize(80)
        );
        assert_eq!(
            control.observe(&tick(500, 5, 10.0), LIMIT_MS, &config),
            BatchMove::Resize(512)
        );
        assert_eq!(
            control.observe(&tick(512, 5, 10.0), LIMIT_MS, &config),
            BatchMove::Hold
        );
    }

    #[test]
    fn a_full_batch_is_demand_even_with_an_empty_queue() {
        let mut control = control();
        let config = config();
        assert_eq!(
            control.observe(&tick(128, 0, 10.0), LIMIT_MS, &config),
            BatchMove::Resize(144)
        );
        let mut slack = tick(128, 0, 10.0);
        slack.active_sequences = 90;
        assert_eq!(control.observe(&slack, LIMIT_MS, &config), BatchMove::Hold);
        assert_eq!(control.request(128), None);
    }

    #[test]
    fn holds_inside_the_headroom_band() {
        let mut control = control();
        let config = config();
        for tpot_ms in [17.0, 18.5, 20.0] {
            assert_eq!(
                control.observe(&tick(200, 50, tpot_ms), LIMIT_MS, &config),
                BatchMove::Hold,
                "{tpot_ms} ms"
            );
        }
    }

    #[test]
    fn a_violation_shrinks_from_the_sequences_decoding() {
        let mut control = control();
        let config = config();
        assert_eq!(
            control.observe(&tick(256, 50, 25.0), LIMIT_MS, &config),
            BatchMove::Resize(179)
        );
        let mut part_full = tick(256, 0, 25.0);
        part_full.active_sequences = 100;
        assert_eq!(
            control.observe(&part_full, LIMIT_MS, &config),
            BatchMove::Resize(70)
        );
        assert_eq!(
            control.observe(&tick(2, 0, 25.0), LIMIT_MS, &config),
            BatchMove::Resize(1)
        );
        assert_eq!(
            control.observe(&tick(1, 0, 25.0), LIMIT_MS, &config),
            BatchMove::AtSmallest
        );
    }

    #[test]
    fn settling_and_idle_ticks_are_not_judged() {
        let mut control = control();
        let config = config();
        assert_eq!(
            control.observe(&tick(256, 50, 25.0), LIMIT_MS, &config),
            BatchMove::Resize(179)
        );
        // The host steps towards 179 under its rate limit: keep asking while it settles.
        let mut stepping = tick(192, 50, 25.0);
        stepping.settling = true;
        assert_eq!(
            control.observe(&stepping, LIMIT_MS, &config),
            BatchMove::Hold
        );
        assert_eq!(control.request(192), Some(179));
        let mut idle = tick(179, 0, 25.0);
        idle.tokens = 0;
        assert_eq!(control.observe(&idle, LIMIT_MS, &config), BatchMove::Hold);
        assert_eq!(control.request(179), None);
    }

    #[test]
    fn the_start_is_fitted_to_the_device() {
        let device = testing::h200(0);
        let start = |size| BatchControl::new(&device, Some(size)).map(|control| control.pending);
        assert_eq!(start(1000), Ok(Some(512)));
        assert_eq!(start(64), Ok(Some(64)));
        let mut no_batch = testing::h200(2);
        no_batch.batch_size_max = 0;
        let error = BatchControl::new(&no_batch, None).err().unwrap_or_default();
        assert!(error.contains("gpu 2"), "{error}");
    }
}
