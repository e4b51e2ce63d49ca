//! The `zeus-gplo` baseline: Zeus's `GlobalPowerLimitOptimizer` (ml-energy/zeus,
//! `zeus/optimizer/power_limit.py` and `docs/optimize/power_limit_optimizer.md`), on
//! control ticks instead of training steps.
//!
//! What Zeus does, and this policy does the same way:
//!
//! - one power limit for every GPU ("global": data-parallel GPUs carry the same load);
//!   energy is summed over the GPUs, time taken over them together;
//! - the limits to profile run from the highest the device allows down to the lowest, in
//!   steps of `pl_step` (25 W);
//! - `wait_steps` (1) steps at the highest limit first; then, per limit, `warmup_steps`
//!   (10) unmeasured steps followed by `profile_steps` (40) measured ones;
//! - after the last limit, the optimum selector picks the limit to keep: `ZeusCost` with
//!   `eta_knob = 0.5` by default (`eta·energy + (1 − eta)·max power·time`, max power = the
//!   highest profiled limit × the number of GPUs), or `Energy`, `Time`, or
//!   `MaxSlowdownConstraint(factor)`: the lowest limit whose time is at most `factor`
//!   times the highest limit's.
//!
//! Liberties taken, because a serving GPU is not a training job:
//!
//! - a step is a control tick (1 s), so the defaults profile each limit for 50 s;
//! - energy and time are per token (a tick is a fixed time, a training step a fixed
//!   amount of work);
//! - Zeus's epoch boundary, which interrupts a profile, does not exist in serving;
//! - Zeus profiles once per job. Here a change of tokens/s by `shift_factor` between two
//!   blocks of `profile_ticks` ticks after profiling counts as a new job, and the
//!   profile starts over (`reprofile_on_shift`, on by default, so the baseline is not
//!   left stranded by a demand shift);
//! - the batch size, which Zeus does not tune at serving time, is held at `batch_size`
//!   (default: the workload's largest) where the knob is granted.
//!
//! # Parameters
//!
//! | key | default | meaning |
//! |---|---|---|
//! | `wait_ticks` | 1 | ticks at the highest limit before profiling (Zeus `wait_steps`) |
//! | `warmup_ticks` | 10 | unmeasured ticks per limit (Zeus `warmup_steps`) |
//! | `profile_ticks` | 40 | measured ticks per limit (Zeus `profile_steps`) |
//! | `pl_step_w` | 25 | stride between limits, W (Zeus `pl_step`) |
//! | `optimum_selector` | `zeus-cost` | `zeus-cost`, `energy`, `time` or `max-slowdown` |
//! | `eta_knob` | 0.5 | ZeusCost's weight of energy, in [0, 1] |
//! | `max_slowdown_factor` | 1.1 | MaxSlowdownConstraint's `factor`, at least 1 |
//! | `batch_size` | the workload's largest | held batch size |
//! | `reprofile_on_shift` | true | profile again after a workload shift |
//! | `shift_factor` | 2.0 | tokens/s change between blocks that counts as a shift |
//!
//! The state (schema version 1, see `state.rs`) goes to a new version at a hot swap.

mod selector;
mod state;

use selector::{Measurement, Selector};
use tokwatt_policy_kit::check_objective;
use tokwatt_policy_sdk::{InitArgs, Knobs, Observation, Params, Policy, Settings, State, info};

#[derive(Debug, Clone, Copy, PartialEq)]
struct Config {
    wait_ticks: u32,
    warmup_ticks: u32,
    profile_ticks: u32,
    selector: Selector,
    batch_size: Option<u32>,
    reprofile_on_shift: bool,
    shift_factor: f64,
}

/// Zeus's state machine (`Ready`, `Warmup`, `Profiling`, `Done`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Waiting at the highest limit before profiling `next`.
    Ready { next: usize, ticks_left: u32 },
    /// At limit `index`, not yet measured.
    Warmup { index: usize, ticks_left: u32 },
    /// At limit `index`, summing energy, tokens and time.
    Profiling {
        index: usize,
        ticks_left: u32,
        energy_j: f64,
        tokens: u64,
        time_s: f64,
    },
    /// Keeping `cap_w`; `block` sums tokens/s over the current block of ticks to notice
    /// a shift, against the previous block's mean `reference`.
    Done {
        cap_w: f64,
        block_ticks: u32,
        block_tokens_per_s: f64,
        reference: Option<f64>,
    },
}

#[derive(Debug, Clone)]
struct ZeusGplo {
    config: Config,
    /// Limits to profile, highest first.
    limits: Vec<f64>,
    batch_size: Option<u32>,
    phase: Phase,
    measurements: Vec<Measurement>,
    gpus: usize,
}

fn read_config(args: &InitArgs) -> Result<(Config, f64), String> {
    let params = Params::new(&args.params);
    params.check_known(&[
        "wait_ticks",
        "warmup_ticks",
        "profile_ticks",
        "pl_step_w",
        "optimum_selector",
        "eta_knob",
        "max_slowdown_factor",
        "batch_size",
        "reprofile_on_shift",
        "shift_factor",
    ])?;
    let pl_step_w: f64 = params.get("pl_step_w", 25.0)?;
    if !(pl_step_w.is_finite() && pl_step_w > 0.0) {
        return Err(format!(
            "parameter `pl_step_w` = {pl_step_w} must be a positive number of watts"
        ));
    }
    let eta: f64 = params.get("eta_knob", 0.5)?;
    if !(0.0..=1.0).contains(&eta) {
        return Err(format!("parameter `eta_knob` = {eta} must lie in [0, 1]"));
    }
    let factor: f64 = params.get("max_slowdown_factor", 1.1)?;
    if !(factor.is_finite() && factor >= 1.0) {
        return Err(format!(
            "parameter `max_slowdown_factor` = {factor} must be at least 1"
        ));
    }
    let selector = match params
        .get("optimum_selector", "zeus-cost".to_string())?
        .as_str()
    {
        "zeus-cost" => Selector::ZeusCost {
            eta,
            gpus: args.devices.len().max(1),
        },
        "energy" => Selector::Energy,
        "time" => Selector::Time,
        "max-slowdown" => Selector::MaxSlowdown { factor },
        other => {
            return Err(format!(
                "parameter `optimum_selector` = {other:?} must be one of \"zeus-cost\", \
                 \"energy\", \"time\", \"max-slowdown\""
            ));
        }
    };
    let config = Config {
        wait_ticks: params.get("wait_ticks", 1)?,
        warmup_ticks: params.get("warmup_ticks", 10)?,
        profile_ticks: params.get("profile_ticks", 40)?,
        selector,
        batch_size: params.get_optional("batch_size")?,
        reprofile_on_shift: params.get("reprofile_on_shift", true)?,
        shift_factor: params.get("shift_factor", 2.0)?,
    };
    if config.profile_ticks == 0 {
        return Err("parameter `profile_ticks` must be at least 1".into());
    }
    if config.batch_size == Some(0) {
        return Err("parameter `batch_size` must be at least 1".into());
    }
    if !(config.shift_factor > 1.0 && config.shift_factor.is_finite()) {
        return Err(format!(
            "parameter `shift_factor` = {} must be a finite factor above 1",
            config.shift_factor
        ));
    }
    Ok((config, pl_step_w))
}

impl ZeusGplo {
    fn start(&self) -> Phase {
        Phase::Ready {
            next: 0,
            ticks_left: self.config.wait_ticks,
        }
    }

    /// The limit in force in the current phase.
    fn cap_w(&self) -> f64 {
        match self.phase {
            Phase::Ready { .. } => self.limits[0],
            Phase::Warmup { index, .. } | Phase::Profiling { index, .. } => self.limits[index],
            Phase::Done { cap_w, .. } => cap_w,
        }
    }

    fn warmup(&self, index: usize) -> Phase {
        if self.config.warmup_ticks == 0 {
            self.profiling(index)
        } else {
            Phase::Warmup {
                index,
                ticks_left: self.config.warmup_ticks,
            }
        }
    }

    fn profiling(&self, index: usize) -> Phase {
        Phase::Profiling {
            index,
            ticks_left: self.config.profile_ticks,
            energy_j: 0.0,
            tokens: 0,
            time_s: 0.0,
        }
    }

    fn step(&mut self, observations: &[Observation]) {
        let energy_j: f64 = observations
            .iter()
            .map(|o| o.energy_j)
            .filter(|e| e.is_finite())
            .sum();
        let tokens: u64 = observations.iter().map(|o| o.tokens).sum();
        let interval_s = observations
            .iter()
            .map(|o| o.interval_s)
            .fold(0.0, f64::max);
        self.phase = match self.phase {
            Phase::Ready { next, ticks_left } if ticks_left > 1 => Phase::Ready {
                next,
                ticks_left: ticks_left - 1,
            },
            Phase::Ready { next, .. } => self.warmup(next),
            Phase::Warmup { index, ticks_left } if ticks_left > 1 => Phase::Warmup {
                index,
                ticks_left: ticks_left - 1,
            },
            Phase::Warmup { index, .. } => self.profiling(index),
            Phase::Profiling {
                index,
                ticks_left,
                energy_j: sum_j,
                tokens: sum_tokens,
                time_s: sum_s,
            } => {
                let (sum_j, sum_tokens, sum_s) =
                    (sum_j + energy_j, sum_tokens + tokens, sum_s + interval_s);
                if ticks_left > 1 {
                    Phase::Profiling {
                        index,
                        ticks_left: ticks_left - 1,
                        energy_j: sum_j,
                        tokens: sum_tokens,
                        time_s: sum_s,
                    }
                } else {
                    self.finish_profile(index, sum_j, sum_tokens, sum_s)
                }
            }
            Phase::Done {
                cap_w,
                block_ticks,
                block_tokens_per_s,
                reference,
            } => self.watch(
                cap_w,
                block_ticks,
                block_tokens_per_s,
                reference,
                observations,
            ),
        };
    }

    fn finish_profile(&mut self, index: usize, energy_j: f64, tokens: u64, time_s: f64) -> Phase {
        let cap_w = self.limits[index];
        // An idle profile (no tokens) says nothing per token: it is left out, as Zeus
        // cannot measure a step that did not run.
        if tokens > 0 {
            let tokens = tokens as f64;
            self.measurements.push(Measurement {
                cap_w,
                energy_j: energy_j / tokens,
                time_s: time_s / tokens,
            });
        }
        info!(
            "zeus-gplo: profiled {cap_w} W: {:.1} tokens/J, {:.0} tokens/s",
            if energy_j > 0.0 {
                tokens as f64 / energy_j
            } else {
                0.0
            },
            if time_s > 0.0 {
                tokens as f64 / time_s
            } else {
                0.0
            },
        );
        if index + 1 < self.limits.len() {
            return self.warmup(index + 1);
        }
        let optimal = self
            .config
            .selector
            .select(&self.measurements)
            .unwrap_or(self.limits[0]);
        info!(
            "zeus-gplo: {} picks {optimal} W of {} profiled limits",
            self.config.selector.name(),
            self.measurements.len()
        );
        Phase::Done {
            cap_w: optimal,
            block_ticks: 0,
            block_tokens_per_s: 0.0,
            reference: None,
        }
    }

    /// After profiling: blocks of `profile_ticks` ticks; a block whose mean tokens/s
    /// differs from the previous one's by `shift_factor` starts the profile over.
    fn watch(
        &mut self,
        cap_w: f64,
        block_ticks: u32,
        block_tokens_per_s: f64,
        reference: Option<f64>,
        observations: &[Observation],
    ) -> Phase {
        let tokens_per_s: f64 = observations.iter().map(|o| o.tokens_per_s).sum();
        let (block_ticks, block_sum) = (block_ticks + 1, block_tokens_per_s + tokens_per_s);
        if block_ticks < self.config.profile_ticks {
            return Phase::Done {
                cap_w,
                block_ticks,
                block_tokens_per_s: block_sum,
                reference,
            };
        }
        let mean = block_sum / f64::from(block_ticks);
        let factor = self.config.shift_factor;
        let shifted = reference.is_some_and(|r| mean > r * factor || mean * factor < r);
        if shifted && self.config.reprofile_on_shift {
            info!(
                "zeus-gplo: tokens/s moved from {:.0} to {mean:.0}: a new job, profiling again",
                reference.unwrap_or_default()
            );
            self.measurements.clear();
            return self.start();
        }
        Phase::Done {
            cap_w,
            block_ticks: 0,
            block_tokens_per_s: 0.0,
            reference: Some(mean),
        }
    }
}

impl Policy for ZeusGplo {
    fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String> {
        if !args.knobs.contains(Knobs::POWER_CAP) {
            return Err("zeus-gplo sets the power limit and was not granted \
                 \"power-cap\": list it in the spec's `knobs`, or, where it is listed, \
                 run where the agent does not withhold it (the agent says why it does)"
                .into());
        }
        let (config, pl_step_w) = read_config(&args)?;
        check_objective(&args.objective)?;
        let Some(first) = args.devices.first() else {
            return Err("zeus-gplo needs at least one GPU".into());
        };
        // Zeus refuses GPUs whose limit ranges differ; so does this.
        if let Some(other) = args.devices.iter().find(|d| {
            d.power_cap_min_w != first.power_cap_min_w || d.power_cap_max_w != first.power_cap_max_w
        }) {
            return Err(format!(
                "zeus-gplo sets one power limit for every GPU, but gpu {} allows {}-{} W and \
                 gpu {} {}-{} W",
                first.index,
                first.power_cap_min_w,
                first.power_cap_max_w,
                other.index,
                other.power_cap_min_w,
                other.power_cap_max_w
            ));
        }
        let (min_w, max_w) = (first.power_cap_min_w, first.power_cap_max_w);
        let mut limits = Vec::new();
        let mut cap_w = max_w;
        while cap_w >= min_w - 1e-9 {
            limits.push(cap_w);
            cap_w -= pl_step_w;
        }
        if limits.is_empty() {
            return Err(format!(
                "gpu {}: empty power limit range {min_w}-{max_w} W",
                first.index
            ));
        }
        let batch_size = if args.knobs.contains(Knobs::BATCH_SIZE) {
            Some(
                config
                    .batch_size
                    .unwrap_or(first.batch_size_max)
                    .clamp(1, first.batch_size_max.max(1)),
            )
        } else if config.batch_size.is_some() {
            return Err("parameter `batch_size` needs \"batch-size\" in the spec's `knobs`".into());
        } else {
            None
        };
        let mut policy = ZeusGplo {
            config,
            limits,
            batch_size,
            phase: Phase::Done {
                cap_w: max_w,
                block_ticks: 0,
                block_tokens_per_s: 0.0,
                reference: None,
            },
            measurements: Vec::new(),
            gpus: args.devices.len(),
        };
        policy.phase = policy.start();
        info!(
            "zeus-gplo on {} GPUs: {} limits {max_w}-{} W, {} + {} ticks each, selector {}",
            policy.gpus,
            policy.limits.len(),
            policy.limits.last().copied().unwrap_or(max_w),
            config.warmup_ticks,
            config.profile_ticks,
            config.selector.name()
        );
        let settings = Settings {
            power_cap_w: Some(max_w),
            sm_clock_max_mhz: None,
            batch_size,
            token_budget: None,
        };
        Ok((policy, vec![settings; args.devices.len()]))
    }

    fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
        self.step(observations);
        let cap_w = self.cap_w();
        observations
            .iter()
            .map(|observation| {
                let in_force = observation.in_force;
                Settings {
                    power_cap_w: Some(cap_w).filter(|cap| (cap - in_force.power_cap_w).abs() > 0.5),
                    sm_clock_max_mhz: None,
                    batch_size: self.batch_size.filter(|&size| size != in_force.batch_size),
                    token_budget: None,
                }
            })
            .collect()
    }

    fn snapshot(&self) -> State {
        state::encode(self)
    }

    fn restore(&mut self, state: State) -> Result<(), String> {
        let (phase, measurements) = state::decode(&state, self)?;
        self.phase = phase;
        self.measurements = measurements;
        Ok(())
    }
}

tokwatt_policy_sdk::export_policy!(ZeusGplo);

#[cfg(test)]
mod tests;
