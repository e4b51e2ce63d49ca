//! What the loop does to one GPU besides asking the policy: read its window and build its
//! observation, make the host's own moves (knobs no policy owns held at the node's
//! baseline, the guard's fallback), and apply settings through the actuator and the
//! workload, counting what changed and what failed.

use std::time::Duration;

use super::{ControlLoop, ratio};
use tokwatt_core::actuator::ActuatorError;
use tokwatt_core::types::{Knobs, Observation, Settings, TelemetryWindow, WorkloadWindow};
use tokwatt_policy::envelope::Applied;
use tokwatt_policy::guard::Decider;

impl ControlLoop {
    /// Each GPU's settings this tick, from what the loop knows is in force: the policy's
    /// `decision` through the envelope (nothing while the guard is in charge), with the
    /// host's own moves where the decision leaves a knob unset. Counts nothing, so a tick
    /// may work its settings out again after reading them back (a stall inside it).
    pub(super) fn settle(
        &mut self,
        decision: &[Settings],
        observations: &[Observation],
        guard_in_charge: bool,
    ) -> Vec<Applied> {
        let mut settled = Vec::with_capacity(observations.len());
        for (gpu, obs) in observations.iter().enumerate() {
            let requested = decision.get(gpu).copied().unwrap_or_default();
            let mut applied = if guard_in_charge {
                Applied::default()
            } else {
                self.envelope
                    .apply(gpu as u32, &requested, &self.in_force[gpu])
            };
            let host_moves = if self.paused {
                Settings::default()
            } else {
                self.host_moves(gpu as u32, guard_in_charge, obs)
            };
            applied.settings = merged(applied.settings, host_moves);
            settled.push(applied);
        }
        settled
    }

    /// The host's own moves on `gpu` this tick: every knob of the node the policy in
    /// charge does not own goes back to the node's baseline, and while the guard is in
    /// charge every knob goes to the device defaults; within the node's guardrails and
    /// steps, so the host never swings a cap further per tick than a policy may.
    pub(super) fn host_moves(
        &mut self,
        gpu: u32,
        guard_in_charge: bool,
        obs: &Observation,
    ) -> Settings {
        let g = gpu as usize;
        let node = self.config.node_knobs;
        let owned = self.envelope.knobs();
        let moved = if guard_in_charge {
            node
        } else {
            Knobs {
                power_cap: node.power_cap && !owned.power_cap,
                sm_clock: node.sm_clock && !owned.sm_clock,
                batch_size: node.batch_size && !owned.batch_size,
                token_budget: node.token_budget && !owned.token_budget,
            }
        };
        if moved.none() {
            return Settings::default();
        }
        let target = if guard_in_charge {
            let mut defaults = self.defaults.get(g).copied().unwrap_or_default();
            match self.fallback_token_budget(g, obs) {
                Some(FallbackBudget { tokens, answers }) => {
                    defaults.token_budget = Some(tokens);
                    // A time per token the budget answers leaves the batch where it is.
                    let current = self.in_force.get(g).map_or(1, |f| f.batch_size);
                    defaults.batch_size = Some(if answers {
                        current
                    } else {
                        self.fallback_batch(g, obs)
                    });
                }
                None => defaults.batch_size = Some(self.fallback_batch(g, obs)),
            }
            defaults
        } else {
            self.baseline
                .get(g)
                .map_or_else(Settings::default, |b| Settings {
                    power_cap_w: Some(b.power_cap_requested_w),
                    sm_clock_max_mhz: Some(b.sm_clock_max_mhz),
                    batch_size: Some(b.batch_size),
                    token_budget: (b.token_budget > 0).then_some(b.token_budget),
                })
        };
        let stepped = self
            .node_envelope
            .apply(gpu, &only(target, moved), &self.in_force[g])
            .settings;
        only(stepped, moved)
    }

    /// The guard's batch size on GPU `g`: the workload's largest when it takes over, then fitted to the objective's p99 time per token from what the fallback's
    /// own windows show (the device defaults can break a tight bound at the largest
    /// batch). Down in proportion to the overshoot, back up toward the start's batch
    /// while requests wait with room under the bound. No bound: the start's batch.
    pub(super) fn fallback_batch(&mut self, g: usize, obs: &Observation) -> u32 {
        // The workload's largest batch within the node's guardrails: the batch found at
        // start may be anything (tokwatt's CUDA decode starts at 1, which serves no floor).
        let start = self.node_envelope.limits(g as u32).map_or_else(
            || self.initial_batch.get(g).copied().unwrap_or(1),
            |l| l.batch_size.1,
        );
        let current = self.in_force.get(g).map_or(start, |f| f.batch_size);
        let first_tick = self.decided_by != Decider::Guard;
        let Some(limit) = self.config.objective.tpot_p99_limit_ms else {
            return start;
        };
        if first_tick {
            return start;
        }
        let tpot = obs.tpot_p99_ms;
        let waiting = obs.queue_depth > 0
            || self.work_waiting == tokwatt_core::workload::WorkWaiting::Always
            || obs.demand.is_some_and(|d| d.requests_turned_away > 0);
        if obs.tokens > 0 && tpot.is_finite() && tpot > limit {
            // A decode step's time grows about in proportion to the batch at large
            // batches.
            (aimed_under(current, limit, tpot) as u32).clamp(1, current.max(1))
        } else if waiting && tpot.is_finite() && tpot < 0.85 * limit && current < start {
            (current + current.div_ceil(10)).min(start)
        } else {
            current
        }
    }

    /// The guard's token budget on GPU `g`, where the node turns it, the workload has one
    /// and the objective bounds the time per token; `None` elsewhere (the
    /// device default: the budget the run started with). A step's time follows its
    /// prefill chunk there, so the start's budget (the workload's largest) is the one
    /// most likely to break the bound the guard defends: the budget in force is held,
    /// and a time per token over the bound shrinks it in proportion (aiming 5 % under),
    /// not under the batch in force plus one. `answers`: it shrank, so the batch stays.
    pub(super) fn fallback_token_budget(
        &self,
        g: usize,
        obs: &Observation,
    ) -> Option<FallbackBudget> {
        let limit = self.config.objective.tpot_p99_limit_ms?;
        let in_force = self.in_force.get(g)?;
        // Held on a tick without prompts too: the default is the budget that broke the
        // bound (on the H100 a quiet tick under the guard put 8,192 back, stepping up).
        if !self.config.node_knobs.token_budget || in_force.token_budget == 0 {
            return None;
        }
        let floor = in_force.batch_size.saturating_add(1);
        let tpot = obs.tpot_p99_ms;
        let serves_prompts = obs.requests.is_some_and(|r| r.prefill_tokens > 0);
        if serves_prompts
            && obs.tokens > 0
            && tpot.is_finite()
            && tpot > limit
            && in_force.token_budget > floor
        {
            let fitted = aimed_under(in_force.token_budget, limit, tpot);
            let tokens = (fitted as u32).clamp(floor, in_force.token_budget);
            return Some(FallbackBudget {
                tokens,
                answers: true,
            });
        }
        Some(FallbackBudget {
            tokens: in_force.token_budget,
            answers: false,
        })
    }

    pub(super) fn read_telemetry(&mut self, gpu: u32) -> TelemetryWindow {
        match self.backends.telemetry.read_window(gpu) {
            Ok(window) => {
                self.last_telemetry[gpu as usize] = window;
                window
            }
            Err(e) => {
                self.totals.telemetry_errors += 1;
                tracing::warn!(
                    gpu,
                    "telemetry read failed, the tick sees an empty window: {e}"
                );
                TelemetryWindow::default()
            }
        }
    }

    pub(super) fn observe(
        &mut self,
        gpu: u32,
        tick: u64,
        interval: Duration,
        t: &TelemetryWindow,
        w: &WorkloadWindow,
    ) -> Observation {
        let g = gpu as usize;
        let interval_s = interval.as_secs_f64();
        // The enforced limit comes from the device, not from what was asked (unless the
        // run is a dry run, whose changes never reach the device).
        if self.backends.actuator.applies_settings() && t.power_limit_enforced_w > 0.0 {
            self.in_force[g].power_cap_w = t.power_limit_enforced_w;
        }
        let observation = Observation {
            gpu,
            tick,
            interval_s,
            tokens: w.tokens,
            energy_j: t.energy_j,
            tokens_per_joule: ratio(w.tokens, t.energy_j),
            tokens_per_s: if interval_s > 0.0 {
                w.tokens as f64 / interval_s
            } else {
                0.0
            },
            // Over the span between the two energy readings when the backend knows it
            // (NVML's counter updates every 100 ms, so it differs from the tick).
            power_avg_w: match (t.interval_s > 0.0, interval_s > 0.0) {
                (true, _) => t.energy_j / t.interval_s,
                (false, true) => t.energy_j / interval_s,
                (false, false) => 0.0,
            },
            power_peak_w: t.power_peak_w,
            sm_clock_mhz: t.sm_clock_mhz,
            mem_clock_mhz: t.mem_clock_mhz,
            temperature_c: t.temperature_c,
            gpu_util_pct: t.gpu_util_pct,
            clock_events: t.clock_events,
            tpot_p50_ms: w.tpot_p50_ms,
            tpot_p99_ms: w.tpot_p99_ms,
            active_sequences: w.active_sequences,
            queue_depth: w.queue_depth,
            demand: w.demand,
            requests: w.requests,
            in_force: self.in_force[g],
            last_clamped: self.last_clamped[g],
            settling: self.settling[g],
        };
        self.settling[g] = false;
        observation
    }

    /// Apply the knobs that change. A failed change is logged and counted, never fatal:
    /// the setting stays as it was. A cap or clock lock that changed is read back from the
    /// device afterwards ([`Self::read_back`]): what the loop shows is what the driver
    /// holds, not what it was asked.
    pub(super) fn apply(&mut self, gpu: u32, settings: &Settings) {
        let g = gpu as usize;
        let mut device_changed = false;
        if let Some(watts) = settings.power_cap_w {
            match self.backends.actuator.set_power_cap(gpu, watts) {
                Ok(enforced) => {
                    // What the setter answered stands only where the read-back fails.
                    self.in_force[g].power_cap_w = enforced;
                    self.in_force[g].power_cap_requested_w = watts;
                    device_changed = true;
                    self.changed(gpu);
                }
                Err(e) => self.actuator_error(gpu, e),
            }
        }
        if let Some(mhz) = settings.sm_clock_max_mhz {
            let device_max = self
                .envelope
                .limits(gpu)
                .map_or(mhz, |l| l.sm_clock_device_max_mhz);
            let min = self
                .envelope
                .limits(gpu)
                .and_then(|l| l.sm_clocks_mhz.last().copied())
                .unwrap_or(mhz)
                .min(mhz);
            // The device's top clock means "no lock": release it rather than pin it.
            let range = (mhz < device_max).then_some((min, mhz));
            match self.backends.actuator.set_sm_clock_lock(gpu, range) {
                Ok(()) => {
                    self.in_force[g].sm_clock_max_mhz = mhz;
                    device_changed = true;
                    self.changed(gpu);
                }
                Err(e) => self.actuator_error(gpu, e),
            }
        }
        if device_changed && let Err(error) = self.read_back(gpu) {
            tracing::warn!(
                gpu,
                "reading the settings back after a change failed; the setter's answer stands: {error}"
            );
        }
        if let Some(batch) = settings.batch_size {
            match self.backends.workload.set_batch_size(gpu, batch) {
                Ok(()) => {
                    self.in_force[g].batch_size = batch;
                    self.changed(gpu);
                }
                Err(e) => {
                    self.totals.actuator_errors += 1;
                    tracing::warn!(gpu, "batch size change failed: {e}");
                }
            }
        }
        if let Some(tokens) = settings.token_budget {
            match self.backends.workload.set_token_budget(gpu, tokens) {
                Ok(()) => {
                    self.in_force[g].token_budget = tokens;
                    self.changed(gpu);
                }
                Err(e) => {
                    self.totals.actuator_errors += 1;
                    tracing::warn!(gpu, "token budget change failed: {e}");
                }
            }
        }
    }

    /// Replace what the loop knows of `gpu`'s power cap (requested and enforced) and SM
    /// clock lock with what the actuator reads back from the device: the driver's, where
    /// another process may have changed them (a fence, a restore, an operator); a dry
    /// run's, what it pretends is set. On an error nothing changes.
    pub(super) fn read_back(&mut self, gpu: u32) -> Result<(), ActuatorError> {
        let g = gpu as usize;
        let read = self.backends.actuator.read(gpu)?;
        // Unlocked: the device's highest clock (its default), as the loop's start reads it.
        let unlocked_mhz = self.defaults.get(g).and_then(|d| d.sm_clock_max_mhz);
        if let Some(in_force) = self.in_force.get_mut(g) {
            in_force.power_cap_w = read.power_cap_enforced_w;
            in_force.power_cap_requested_w = read.power_cap_w;
            in_force.sm_clock_max_mhz = match read.sm_clock_lock_mhz {
                Some((_, highest)) => highest,
                None => unlocked_mhz.unwrap_or(in_force.sm_clock_max_mhz),
            };
        }
        Ok(())
    }

    pub(super) fn changed(&mut self, gpu: u32) {
        self.settling[gpu as usize] = true;
        self.totals.settings_changes += 1;
    }

    pub(super) fn actuator_error(&mut self, gpu: u32, e: ActuatorError) {
        self.totals.actuator_errors += 1;
        tracing::warn!(gpu, "setting change failed, the old setting stays: {e}");
    }
}

/// `settings` with only the `knobs` given.
pub(super) fn only(settings: Settings, knobs: Knobs) -> Settings {
    Settings {
        power_cap_w: settings.power_cap_w.filter(|_| knobs.power_cap),
        sm_clock_max_mhz: settings.sm_clock_max_mhz.filter(|_| knobs.sm_clock),
        batch_size: settings.batch_size.filter(|_| knobs.batch_size),
        token_budget: settings.token_budget.filter(|_| knobs.token_budget),
    }
}

/// `a`'s knobs, and `b`'s where `a` leaves one unset.
pub(super) fn merged(a: Settings, b: Settings) -> Settings {
    Settings {
        power_cap_w: a.power_cap_w.or(b.power_cap_w),
        sm_clock_max_mhz: a.sm_clock_max_mhz.or(b.sm_clock_max_mhz),
        batch_size: a.batch_size.or(b.batch_size),
        token_budget: a.token_budget.or(b.token_budget),
    }
}

/// `current` scaled down in proportion to a p99 `tpot` over its `limit`, aiming 5 % under
/// the bound: the guard's fit of a batch or a token budget, whose step time grows about in
/// proportion to it.
fn aimed_under(current: u32, limit: f64, tpot: f64) -> f64 {
    (f64::from(current) * limit / tpot * 0.95).floor()
}

/// The guard's token budget ([`ControlLoop::fallback_token_budget`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FallbackBudget {
    pub tokens: u32,
    /// It shrank to answer a time per token over its bound.
    pub answers: bool,
}
