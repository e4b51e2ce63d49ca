//! The `default` baseline: what an operator gets without tokwatt, plus the obvious batch
//! limit.
//!
//! On every GPU: the board's default power cap (`power-cap-default-w`), no SM clock lock
//! (the highest supported clock), and the largest batch the objective allows: it starts
//! at the workload's largest batch and, when the p99 time per token breaks the limit,
//! cuts it multiplicatively until the limit holds, growing back slowly while there is
//! ample room (the kit's [`BatchGuard`]). Without a p99 limit it keeps the largest batch.
//!
//! Each knob is set only where the spec grants it; the policy needs none in particular.
//!
//! # Parameters
//!
//! | key | default | meaning |
//! |---|---|---|
//! | `batch_shrink_factor` | 0.8 | cut to this fraction of the sequences decoding on a violation |
//! | `batch_grow_factor` | 1.05 | growth per step while there is ample room |
//! | `batch_grow_after_ticks` | 10 | calm ticks in a row before one growth step |
//! | `batch_headroom` | 0.8 | "ample room": p99 under this fraction of the limit |
//!
//! The state (schema version 1: per GPU the guard's target and calm count) goes to a new
//! version at a hot swap. The guard follows a shifted workload by itself: a heavier load
//! that breaks the limit is cut at once, a lighter one grows back.

use tokwatt_policy_kit::clocks::highest_clock;
use tokwatt_policy_kit::{BatchGuard, BatchGuardConfig, check_objective, decide_per_gpu, state};
use tokwatt_policy_sdk::{
    DeviceFacts, InitArgs, Knobs, Observation, Params, Policy, Settings, State, info,
};

/// The version of the state layout: u32 GPUs, then per GPU u32 target, u32 calm ticks.
const SCHEMA_VERSION: u32 = 1;

/// One GPU's fixed settings and batch guard.
#[derive(Debug, Clone, PartialEq)]
struct GpuDefault {
    cap_w: Option<f64>,
    clock_mhz: Option<u32>,
    batch: Option<BatchGuard>,
}

impl GpuDefault {
    fn new(device: &DeviceFacts, knobs: Knobs) -> Result<GpuDefault, String> {
        Ok(GpuDefault {
            cap_w: knobs.contains(Knobs::POWER_CAP).then_some(
                device
                    .power_cap_default_w
                    .clamp(device.power_cap_min_w, device.power_cap_max_w),
            ),
            clock_mhz: if knobs.contains(Knobs::SM_CLOCK) {
                highest_clock(device)
            } else {
                None
            },
            batch: if knobs.contains(Knobs::BATCH_SIZE) {
                Some(BatchGuard::new(device, None)?)
            } else {
                None
            },
        })
    }

    fn first_settings(&self) -> Settings {
        Settings {
            power_cap_w: self.cap_w,
            sm_clock_max_mhz: self.clock_mhz,
            batch_size: self.batch.as_ref().map(|guard| guard.target),
            token_budget: None,
        }
    }

    fn observe(
        &mut self,
        observation: &Observation,
        limit_ms: Option<f64>,
        config: &BatchGuardConfig,
    ) -> Settings {
        let in_force = observation.in_force;
        Settings {
            // Re-asserted only if something else moved them.
            power_cap_w: self
                .cap_w
                .filter(|cap_w| (cap_w - in_force.power_cap_w).abs() > 0.5),
            sm_clock_max_mhz: self
                .clock_mhz
                .filter(|&clock| clock != in_force.sm_clock_max_mhz),
            batch_size: self
                .batch
                .as_mut()
                .and_then(|guard| guard.observe(observation, limit_ms, config)),
            token_budget: None,
        }
    }
}

#[derive(Debug, Clone)]
struct DefaultBaseline {
    config: BatchGuardConfig,
    limit_ms: Option<f64>,
    gpus: Vec<GpuDefault>,
}

impl Policy for DefaultBaseline {
    fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String> {
        let params = Params::new(&args.params);
        params.check_known(&BatchGuardConfig::KEYS)?;
        let config = BatchGuardConfig::read(&params)?;
        check_objective(&args.objective)?;
        let gpus = args
            .devices
            .iter()
            .map(|device| GpuDefault::new(device, args.knobs))
            .collect::<Result<Vec<_>, _>>()?;
        let first = gpus.iter().map(GpuDefault::first_settings).collect();
        info!(
            "default on {} GPUs: default power cap, no clock lock, largest batch {}",
            gpus.len(),
            match args.objective.tpot_p99_limit_ms {
                Some(limit) => format!("under the {limit} ms p99 limit"),
                None => "(no p99 limit)".to_string(),
            }
        );
        Ok((
            DefaultBaseline {
                config,
                limit_ms: args.objective.tpot_p99_limit_ms,
                gpus,
            },
            first,
        ))
    }

    fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
        decide_per_gpu(&mut self.gpus, observations, |gpu, observation| {
            gpu.observe(observation, self.limit_ms, &self.config)
        })
    }

    fn snapshot(&self) -> State {
        state::encode_per_gpu(SCHEMA_VERSION, &self.gpus, |writer, gpu| match &gpu.batch {
            Some(guard) => guard.write_state(writer.bool(true)),
            None => writer.bool(false),
        })
    }

    fn restore(&mut self, state: State) -> Result<(), String> {
        self.gpus = state::decode_per_gpu(&state, SCHEMA_VERSION, &self.gpus, |reader, gpu| {
            let had_batch = reader.bool()?;
            let mut gpu = gpu;
            match (had_batch, &gpu.batch) {
                (true, Some(guard)) => gpu.batch = Some(guard.read_state(reader)?),
                (true, None) => {
                    // This instance does not turn the batch: read past the old guard.
                    reader.u32()?;
                    reader.u32()?;
                }
                (false, _) => {}
            }
            Ok(gpu)
        })?;
        Ok(())
    }
}

tokwatt_policy_sdk::export_policy!(DefaultBaseline);

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_policy_sdk::{Objective, StateWriter, testing};

    fn policy(
        knobs: Knobs,
        limit_ms: Option<f64>,
        params: &[(&str, &str)],
    ) -> (DefaultBaseline, Vec<Settings>) {
        let mut device = testing::h200(0);
        device.power_cap_default_w = 600.0;
        let mut args = testing::init_args(vec![device], knobs);
        args.objective = Objective {
            tpot_p99_limit_ms: limit_ms,
            min_tokens_per_s: None,
            queue_wait_p99_limit_ms: None,
            ttft_p99_limit_ms: None,
        };
        args.params = testing::params(params);
        DefaultBaseline::init(args).unwrap()
    }

    fn all() -> Knobs {
        Knobs::POWER_CAP | Knobs::SM_CLOCK | Knobs::BATCH_SIZE
    }

    /// A settled tick at `batch`, full, with p99 per token linear in the batch (8 ms at 64).
    fn tick(batch: u32) -> Observation {
        let mut observation = testing::observation(0, 0);
        observation.in_force.batch_size = batch;
        observation.in_force.power_cap_w = 600.0;
        observation.active_sequences = batch;
        observation.queue_depth = 100;
        observation.tpot_p99_ms = 4.8 + 0.056 * f64::from(batch);
        observation
    }

    #[test]
    fn starts_at_the_default_cap_unlocked_and_the_largest_batch() {
        let (_, first) = policy(all(), Some(20.0), &[]);
        assert_eq!(
            first,
            vec![Settings {
                power_cap_w: Some(600.0),
                sm_clock_max_mhz: Some(1980),
                batch_size: Some(512),
                token_budget: None,
            }]
        );
        let (_, batch_only) = policy(Knobs::BATCH_SIZE, None, &[]);
        assert_eq!(batch_only, vec![Settings::unchanged().with_batch_size(512)]);
    }

    #[test]
    fn the_batch_settles_under_the_limit_and_follows_a_shift() {
        let (mut policy, _) = policy(all(), Some(20.0), &[]);
        let mut batch = 512;
        let mut violations = 0;
        for _ in 0..200 {
            let observation = tick(batch);
            violations += u32::from(observation.tpot_p99_ms > 20.0);
            if let Some(next) = policy.decide(&[observation])[0].batch_size {
                batch = next;
            }
        }
        // 4.8 + 0.056 b <= 20 means b <= 271; the guard ends inside the band below it.
        assert!((200..=271).contains(&batch), "{batch}");
        assert!(violations <= 6, "{violations}");
        // The workload shifts (longer contexts: every step slower): the batch follows down.
        for _ in 0..50 {
            let mut observation = tick(batch);
            observation.tpot_p99_ms *= 1.5;
            if let Some(next) = policy.decide(&[observation])[0].batch_size {
                batch = next;
            }
        }
        assert!(batch <= 181, "{batch}");
    }

    #[test]
    fn unknown_parameters_are_refused_and_state_hands_over() {
        let mut device = testing::h200(0);
        device.power_cap_default_w = 600.0;
        let mut args = testing::init_args(vec![device], all());
        args.params = testing::params(&[("batch", "3")]);
        let error = DefaultBaseline::init(args).err().unwrap_or_default();
        assert!(error.contains("unknown parameter `batch`"), "{error}");

        let (mut old, _) = policy(all(), Some(20.0), &[]);
        old.decide(&[tick(512)]);
        let (mut new, _) = policy(all(), Some(20.0), &[]);
        testing::assert_hands_over(&old, &mut new);
        assert_eq!(new.gpus, old.gpus);
        let other = StateWriter::new().u32(1).finish(9);
        testing::assert_restore_refused(&mut new, other, "schema version 1, got version 9");
    }
}
