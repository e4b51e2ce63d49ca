//! The `node-budget` policy: the GPUs of a node share a power budget, and watts go where
//! they buy the most tokens.
//!
//! Every GPU's cap starts at an equal share of `node_budget_w` (within its range). Every
//! `window_ticks` settled ticks (all GPUs' windows full) the loop judges each GPU
//! (`marginal.rs`):
//!
//! - *satisfied*: it drew clearly less than its cap, or its queue emptied during the
//!   window: it serves its demand, and another watt would buy it nothing;
//! - *limited*: requests waited all window long at full cap: its marginal return is the
//!   slope of tokens/s over cap through its recent windows at different caps.
//!
//! Then `step_w` watts move from the GPU with the lowest marginal return (a satisfied
//! one first, the one leaving the most watts unused) to the limited GPU with the highest
//! (one whose slope is still unknown is probed first: the move gives it a second point),
//! when the gap is worth it (a satisfied donor, or a gap of `min_gain` times the two
//! slopes' mean size). Where no gap stands out from the noise, limited GPUs' caps drift
//! back toward equal, a step at a time, since equal loads are best served by equal caps. So the caps
//! move toward equal marginal tokens per watt, which maximises the node's tokens for its
//! watts; where every GPU is satisfied, nothing moves.
//!
//! # The budget is never exceeded
//!
//! Targets are moved in pairs, so they always sum to at most the budget. What reaches
//! the GPUs is safe on every tick too: a cut is asked for at once, but a raise only as
//! far as the caps in force leave room under the budget, so a raise waits a tick for the
//! cut that pays for it. Every cap stays inside its device's range.
//!
//! # Re-exploration
//!
//! A GPU whose throughput at a cap it held before moved by `shift_factor` has a new
//! workload: its older points are dropped and its slope is probed again. Satisfied and
//! limited are judged afresh every window, so a load that moves from one GPU to another
//! takes its watts with it.
//!
//! # Parameters
//!
//! | key | default | meaning |
//! |---|---|---|
//! | `node_budget_w` | (required) | the most the caps may sum to, W |
//! | `step_w` | 25 | watts moved per decision |
//! | `window_ticks` | 5 | settled ticks per GPU per decision |
//! | `min_gain` | 0.5 | gap in marginal return, relative to the two slopes' mean size, worth a move between limited GPUs |
//! | `unused_fraction` | 0.1 | a window drawing this far under its cap is satisfied |
//! | `shift_factor` | 2.0 | throughput change at one cap that counts as a new workload |
//!
//! With the `batch-size` knob, each GPU's batch is held by the kit's `BatchGuard`
//! (largest batch under the p99 objective; its `batch_*` keys apply). The state (schema
//! version 1: per GPU the target cap, the points, the batch guard) goes to a new version
//! at a hot swap.

mod marginal;

use marginal::{Need, Returns, Window, need};
use tokwatt_policy_kit::{BatchGuard, BatchGuardConfig, check_objective, state};
use tokwatt_policy_sdk::{
    DeviceFacts, InitArgs, Knobs, Observation, Params, Policy, Settings, State, debug, info,
};

const SCHEMA_VERSION: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq)]
struct Config {
    budget_w: f64,
    step_w: f64,
    window_ticks: u32,
    min_gain: f64,
    unused_fraction: f64,
    shift_factor: f64,
    batch: BatchGuardConfig,
}

impl Config {
    fn from_params(params: &Params<'_>) -> Result<Config, String> {
        let mut known = vec![
            "node_budget_w",
            "step_w",
            "window_ticks",
            "min_gain",
            "unused_fraction",
            "shift_factor",
        ];
        known.extend(BatchGuardConfig::KEYS);
        params.check_known(&known)?;
        let Some(budget_w) = params.get_optional::<f64>("node_budget_w")? else {
            return Err(
                "node-budget needs `node_budget_w` in the spec's [params]: the most the GPUs' \
                 caps may sum to, in watts"
                    .into(),
            );
        };
        let config = Config {
            budget_w,
            step_w: params.get("step_w", 25.0)?,
            window_ticks: params.get("window_ticks", 5)?,
            min_gain: params.get("min_gain", 0.5)?,
            unused_fraction: params.get("unused_fraction", 0.1)?,
            shift_factor: params.get("shift_factor", 2.0)?,
            batch: BatchGuardConfig::read(params)?,
        };
        let positive = |name: &str, value: f64| {
            if value.is_finite() && value > 0.0 {
                Ok(())
            } else {
                Err(format!(
                    "parameter `{name}` = {value} must be a positive number"
                ))
            }
        };
        positive("node_budget_w", config.budget_w)?;
        positive("step_w", config.step_w)?;
        if config.window_ticks == 0 {
            return Err("parameter `window_ticks` must be at least 1".into());
        }
        if !(config.min_gain.is_finite() && config.min_gain >= 0.0) {
            return Err(format!(
                "parameter `min_gain` = {} must be a fraction of zero or more",
                config.min_gain
            ));
        }
        if !(0.0..1.0).contains(&config.unused_fraction) {
            return Err(format!(
                "parameter `unused_fraction` = {} must lie in [0, 1)",
                config.unused_fraction
            ));
        }
        if !(config.shift_factor > 1.0 && config.shift_factor.is_finite()) {
            return Err(format!(
                "parameter `shift_factor` = {} must be a finite factor above 1",
                config.shift_factor
            ));
        }
        Ok(config)
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Gpu {
    index: u32,
    min_w: f64,
    max_w: f64,
    target_w: f64,
    window: Window,
    returns: Returns,
    batch: Option<BatchGuard>,
}

#[derive(Debug, Clone)]
struct NodeBudget {
    config: Config,
    limit_ms: Option<f64>,
    gpus: Vec<Gpu>,
}

/// Which GPU gives and which takes, by position in `gpus`.
fn pick_move(gpus: &[Gpu], needs: &[Need], config: &Config) -> Option<(usize, usize)> {
    let can_give = |i: usize| gpus[i].target_w - gpus[i].min_w >= 1.0;
    let can_take = |i: usize| gpus[i].max_w - gpus[i].target_w >= 1.0;
    // The limited GPU with the highest marginal return; an unknown one first (probe it).
    let receiver = (0..gpus.len())
        .filter(|&i| can_take(i))
        .filter_map(|i| match needs[i] {
            Need::Limited(slope) => Some((i, slope.unwrap_or(f64::INFINITY))),
            Need::Satisfied => None,
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))?;
    // A satisfied GPU leaving the most watts unused; else the limited one returning least.
    let satisfied = (0..gpus.len())
        .filter(|&i| i != receiver.0 && can_give(i) && needs[i] == Need::Satisfied)
        .max_by(|&a, &b| {
            let unused = |i: usize| gpus[i].target_w - gpus[i].window.power_w();
            unused(a).total_cmp(&unused(b))
        });
    if let Some(donor) = satisfied {
        return Some((donor, receiver.0));
    }
    let (donor, donor_slope) = (0..gpus.len())
        .filter(|&i| i != receiver.0 && can_give(i))
        .filter_map(|i| match needs[i] {
            // An unknown donor is probed downwards: it gains its second point too.
            Need::Limited(slope) => Some((i, slope.unwrap_or(f64::NEG_INFINITY))),
            Need::Satisfied => None,
        })
        .min_by(|a, b| a.1.total_cmp(&b.1))?;
    // Between two measured slopes, the gap must stand out from their size: slopes from
    // 25 W steps carry the throughput's noise, and chasing it walks identical GPUs away
    // from the equal split that suits them.
    let worth = !receiver.1.is_finite()
        || !donor_slope.is_finite()
        || receiver.1 - donor_slope
            > config.min_gain * (receiver.1.abs() + donor_slope.abs()) / 2.0 + 1e-9;
    if worth {
        return Some((donor, receiver.0));
    }
    // No slope stands out from the noise: with no evidence that one limited GPU returns
    // more than another, their caps drift back toward equal (concave returns make the
    // equal split the best for equal loads), one step at a time and only while they are
    // at least two steps apart.
    let limited: Vec<usize> = (0..gpus.len())
        .filter(|&i| matches!(needs[i], Need::Limited(_)))
        .collect();
    let highest = limited
        .iter()
        .copied()
        .filter(|&i| can_give(i))
        .max_by(|&a, &b| gpus[a].target_w.total_cmp(&gpus[b].target_w))?;
    let lowest = limited
        .iter()
        .copied()
        .filter(|&i| can_take(i))
        .min_by(|&a, &b| gpus[a].target_w.total_cmp(&gpus[b].target_w))?;
    (gpus[highest].target_w - gpus[lowest].target_w >= 2.0 * config.step_w)
        .then_some((highest, lowest))
}

impl NodeBudget {
    /// Every window is full: judge each GPU and move watts.
    fn rebalance(&mut self) {
        let config = self.config;
        let needs: Vec<Need> = self
            .gpus
            .iter_mut()
            .map(|gpu| {
                let window = gpu.window;
                let judged = need(&window, gpu.target_w, &gpu.returns, config.unused_fraction);
                if judged != Need::Satisfied
                    && gpu
                        .returns
                        .add(gpu.target_w, window.tokens_per_s(), config.shift_factor)
                {
                    info!(
                        "gpu {}: throughput at {} W moved: a new workload",
                        gpu.index, gpu.target_w
                    );
                }
                gpu.window = Window::default();
                // Filed after judging, so the slope includes this window.
                match judged {
                    Need::Limited(_) => Need::Limited(gpu.returns.slope()),
                    Need::Satisfied => Need::Satisfied,
                }
            })
            .collect();
        let Some((donor, receiver)) = pick_move(&self.gpus, &needs, &config) else {
            return;
        };
        let amount = config
            .step_w
            .min(self.gpus[receiver].max_w - self.gpus[receiver].target_w)
            .min(self.gpus[donor].target_w - self.gpus[donor].min_w);
        self.gpus[donor].target_w -= amount;
        self.gpus[receiver].target_w += amount;
        debug!(
            "{amount} W from gpu {} ({:?}) to gpu {} ({:?})",
            self.gpus[donor].index, needs[donor], self.gpus[receiver].index, needs[receiver]
        );
    }

    /// The caps to ask for: cuts at once, raises only into the room the caps in force
    /// leave under the budget.
    fn cap_requests(&self, observations: &[Observation]) -> Vec<Option<f64>> {
        let in_force = |i: usize| {
            observations
                .iter()
                .find(|o| o.gpu == self.gpus[i].index)
                .map_or(self.gpus[i].target_w, |o| o.in_force.power_cap_w)
        };
        let mut room = self.config.budget_w - (0..self.gpus.len()).map(in_force).sum::<f64>();
        (0..self.gpus.len())
            .map(|i| {
                let (now, target) = (in_force(i), self.gpus[i].target_w);
                if target < now - 0.5 {
                    Some(target)
                } else if target > now + 0.5 {
                    let raise = (target - now).min(room.max(0.0));
                    room -= raise;
                    (raise >= 0.5).then_some(now + raise)
                } else {
                    None
                }
            })
            .collect()
    }
}

impl Policy for NodeBudget {
    fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String> {
        if !args.knobs.contains(Knobs::POWER_CAP) {
            return Err("node-budget sets power caps and was not granted \
                 \"power-cap\": list it in the spec's `knobs`, or, where it is listed, \
                 run where the agent does not withhold it (the agent says why it does)"
                .into());
        }
        let config = Config::from_params(&Params::new(&args.params))?;
        check_objective(&args.objective)?;
        let least: f64 = args.devices.iter().map(|d| d.power_cap_min_w).sum();
        if least > config.budget_w {
            return Err(format!(
                "`node_budget_w` = {} W is below the {least} W the {} GPUs' lowest caps sum to",
                config.budget_w,
                args.devices.len()
            ));
        }
        let share = config.budget_w / args.devices.len().max(1) as f64;
        let new_gpu = |device: &DeviceFacts| -> Result<Gpu, String> {
            Ok(Gpu {
                index: device.index,
                min_w: device.power_cap_min_w,
                max_w: device.power_cap_max_w,
                target_w: share.clamp(device.power_cap_min_w, device.power_cap_max_w),
                window: Window::default(),
                returns: Returns::default(),
                batch: if args.knobs.contains(Knobs::BATCH_SIZE) {
                    Some(BatchGuard::new(device, None)?)
                } else {
                    None
                },
            })
        };
        let mut gpus = args
            .devices
            .iter()
            .map(new_gpu)
            .collect::<Result<Vec<_>, _>>()?;
        // Shares clamped up to a GPU's lowest cap are paid for by the others.
        let mut over: f64 = gpus.iter().map(|g| g.target_w).sum::<f64>() - config.budget_w;
        for gpu in gpus.iter_mut().rev() {
            if over <= 0.0 {
                break;
            }
            let cut = over.min(gpu.target_w - gpu.min_w);
            gpu.target_w -= cut;
            over -= cut;
        }
        // The host starts every GPU at its current cap (typically the default), which may
        // sum above the budget: the first settings only cut, and raises follow once the
        // cuts are in force.
        let first = gpus
            .iter()
            .zip(&args.devices)
            .map(|(gpu, device)| Settings {
                power_cap_w: Some(
                    gpu.target_w
                        .min(device.power_cap_default_w.max(device.power_cap_min_w)),
                ),
                sm_clock_max_mhz: None,
                batch_size: gpu.batch.as_ref().map(|guard| guard.target),
                token_budget: None,
            })
            .collect();
        info!(
            "node-budget on {} GPUs: {} W shared, {} W steps every {} ticks",
            gpus.len(),
            config.budget_w,
            config.step_w,
            config.window_ticks
        );
        Ok((
            NodeBudget {
                config,
                limit_ms: args.objective.tpot_p99_limit_ms,
                gpus,
            },
            first,
        ))
    }

    fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
        let mut batches = Vec::with_capacity(observations.len());
        for observation in observations {
            let Some(gpu) = self.gpus.iter_mut().find(|g| g.index == observation.gpu) else {
                batches.push(None);
                continue;
            };
            let at_target = (observation.in_force.power_cap_w - gpu.target_w).abs() <= 0.5;
            if !observation.settling && at_target && observation.energy_j.is_finite() {
                let window = &mut gpu.window;
                window.ticks += 1;
                window.tokens += observation.tokens;
                window.seconds += observation.interval_s;
                window.energy_j += observation.energy_j;
                window.queued_ticks += u32::from(observation.queue_depth > 0);
            }
            batches.push(
                gpu.batch.as_mut().and_then(|guard| {
                    guard.observe(observation, self.limit_ms, &self.config.batch)
                }),
            );
        }
        if !self.gpus.is_empty()
            && self
                .gpus
                .iter()
                .all(|g| g.window.ticks >= self.config.window_ticks)
        {
            self.rebalance();
        }
        let caps = self.cap_requests(observations);
        observations
            .iter()
            .zip(batches)
            .map(|(observation, batch_size)| {
                let position = self.gpus.iter().position(|g| g.index == observation.gpu);
                Settings {
                    power_cap_w: position.and_then(|i| caps[i]),
                    sm_clock_max_mhz: None,
                    batch_size,
                    token_budget: None,
                }
            })
            .collect()
    }

    fn snapshot(&self) -> State {
        state::encode_per_gpu(SCHEMA_VERSION, &self.gpus, |writer, gpu| {
            let writer = gpu.returns.write_state(writer.f64(gpu.target_w));
            match &gpu.batch {
                Some(guard) => guard.write_state(writer.bool(true)),
                None => writer.bool(false),
            }
        })
    }

    fn restore(&mut self, state: State) -> Result<(), String> {
        let restored = state::decode_per_gpu(&state, SCHEMA_VERSION, &self.gpus, |reader, gpu| {
            let mut gpu = gpu;
            let target_w = reader.f64()?;
            if !target_w.is_finite() {
                return Err(format!(
                    "gpu {}: target cap {target_w} in the state",
                    gpu.index
                ));
            }
            gpu.target_w = target_w.clamp(gpu.min_w, gpu.max_w);
            gpu.returns = Returns::read_state(reader)?;
            gpu.window = Window::default();
            if reader.bool()? {
                match &gpu.batch {
                    Some(guard) => gpu.batch = Some(guard.read_state(reader)?),
                    None => {
                        reader.u32()?;
                        reader.u32()?;
                    }
                }
            }
            Ok(gpu)
        })?;
        let total: f64 = restored.iter().map(|g| g.target_w).sum();
        if total > self.config.budget_w + 0.5 {
            return Err(format!(
                "the handed-over caps sum to {total} W, over this instance's {} W budget; \
                 starting afresh",
                self.config.budget_w
            ));
        }
        self.gpus = restored;
        Ok(())
    }
}

tokwatt_policy_sdk::export_policy!(NodeBudget);

#[cfg(test)]
mod tests;
