//! The safety envelope between a policy's wishes and the hardware: every setting is
//! clamped to the device's constraints and the operator's guardrails, limited to a
//! configured change per tick, and dropped when it is not a finite number or turns a
//! knob the policy was not granted. Whatever a plugin returns, what leaves here is safe.

use serde::{Deserialize, Serialize};

use crate::supervisor::DeviceFacts;
use tokwatt_core::types::{DeviceInfo, InForce, Knobs, Settings};

/// The operator's limits, from the policy spec's `[guardrails]` table. Unset means the
/// device's own limit.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Guardrails {
    pub power_cap_min_w: Option<f64>,
    pub power_cap_max_w: Option<f64>,
    pub sm_clock_min_mhz: Option<u32>,
    pub sm_clock_max_mhz: Option<u32>,
    pub batch_size_min: Option<u32>,
    pub batch_size_max: Option<u32>,
    /// Largest power cap change per tick.
    pub max_power_cap_step_w: Option<f64>,
    /// Largest power cap raise per tick (a cut is never slowed by it): what a sudden
    /// rise in draw may cost the facility. The node's rules set one by default.
    #[serde(default)]
    pub max_power_cap_raise_w: Option<f64>,
    /// Largest SM clock change per tick.
    pub max_sm_clock_step_mhz: Option<u32>,
    /// Largest batch size change per tick.
    pub max_batch_size_step: Option<u32>,
    /// The token budget per step's range, where the workload has one (tokens a step).
    #[serde(default)]
    pub token_budget_min: Option<u32>,
    #[serde(default)]
    pub token_budget_max: Option<u32>,
    /// Largest token budget change per tick.
    #[serde(default)]
    pub max_token_budget_step: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EnvelopeError {
    #[error(
        "GPU {gpu}: the guardrails allow {what} {lo}..{hi}, which is outside the device's range {dev_lo}..{dev_hi}; fix [guardrails] in the policy spec"
    )]
    Disjoint {
        gpu: u32,
        what: &'static str,
        lo: f64,
        hi: f64,
        dev_lo: f64,
        dev_hi: f64,
    },
    #[error("guardrail `{0}` must be a positive, finite number")]
    BadValue(&'static str),
}

/// What the workload accepts on one GPU: the envelope's view of its knobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkloadLimits {
    /// The largest batch size ([`tokwatt_core::workload::Workload::batch_size_max`]).
    pub batch_size_max: u32,
    /// The token budget per step's range, `(min, max)`; `None` where the workload has no
    /// token budget ([`tokwatt_core::workload::Workload::token_budget_range`]).
    pub token_budget: Option<(u32, u32)>,
}

impl WorkloadLimits {
    /// A workload of batches up to `batch_size_max` and no token budget (it decodes only).
    pub const fn batch_only(batch_size_max: u32) -> Self {
        Self {
            batch_size_max,
            token_budget: None,
        }
    }

    /// What `workload` accepts on each of `gpus`.
    pub fn of(workload: &dyn tokwatt_core::workload::Workload, gpus: &[u32]) -> Vec<Self> {
        gpus.iter()
            .map(|&gpu| Self {
                batch_size_max: workload.batch_size_max(gpu),
                token_budget: workload.token_budget_range(gpu),
            })
            .collect()
    }
}

/// The effective limits of one GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuLimits {
    pub power_cap_w: (f64, f64),
    /// Allowed SM clocks, highest first (device-supported, within guardrails).
    pub sm_clocks_mhz: Vec<u32>,
    /// The device's highest clock: asking for it releases the lock.
    pub sm_clock_device_max_mhz: u32,
    pub batch_size: (u32, u32),
    /// The token budget per step's range within the guardrails; `None` where the workload
    /// has no token budget (the knob then turns nothing).
    pub token_budget: Option<(u32, u32)>,
    pub max_power_cap_step_w: f64,
    /// The largest raise per tick: the step, or less.
    pub max_power_cap_raise_w: f64,
    pub max_sm_clock_step_mhz: u32,
    pub max_batch_size_step: u32,
    pub max_token_budget_step: u32,
}

/// What survives the envelope for one GPU: only the knobs that change.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Applied {
    pub settings: Settings,
    /// Something asked for was changed or dropped.
    pub clamped: bool,
    /// A value was not a finite number (NaN or infinite).
    pub non_finite: bool,
}

#[derive(Debug, Clone)]
pub struct Envelope {
    knobs: Knobs,
    gpus: Vec<GpuLimits>,
}

fn check_positive(value: Option<f64>, name: &'static str) -> Result<(), EnvelopeError> {
    match value {
        Some(v) if !(v.is_finite() && v > 0.0) => Err(EnvelopeError::BadValue(name)),
        _ => Ok(()),
    }
}

impl Envelope {
    /// The envelope of a workload without a token budget, whose largest batch on each
    /// GPU is `batch_size_max`: [`Envelope::for_workload`] with
    /// [`WorkloadLimits::batch_only`].
    pub fn new(
        devices: &[DeviceInfo],
        batch_size_max: &[u32],
        guardrails: &Guardrails,
        knobs: Knobs,
    ) -> Result<Self, EnvelopeError> {
        let workload: Vec<WorkloadLimits> = batch_size_max
            .iter()
            .map(|&max| WorkloadLimits::batch_only(max))
            .collect();
        Self::for_workload(devices, &workload, guardrails, knobs)
    }

    /// The envelope of `devices` running a workload that accepts `workload` on each (in
    /// the devices' order), within `guardrails`, for a policy granted `knobs`. The token
    /// budget knob turns nothing on a GPU whose workload has none: a policy granted it
    /// there is refused before it starts (`tokwatt_agent`), and a node's own envelope
    /// simply has no budget to move.
    pub fn for_workload(
        devices: &[DeviceInfo],
        workload: &[WorkloadLimits],
        guardrails: &Guardrails,
        knobs: Knobs,
    ) -> Result<Self, EnvelopeError> {
        check_positive(guardrails.power_cap_min_w, "power_cap_min_w")?;
        check_positive(guardrails.power_cap_max_w, "power_cap_max_w")?;
        check_positive(guardrails.max_power_cap_step_w, "max_power_cap_step_w")?;
        check_positive(guardrails.max_power_cap_raise_w, "max_power_cap_raise_w")?;
        let mut gpus = Vec::with_capacity(devices.len());
        for (device, accepts) in devices.iter().zip(workload) {
            let workload_max = accepts.batch_size_max;
            let gpu = device.index;
            let lo = guardrails
                .power_cap_min_w
                .map_or(device.power_cap_min_w, |g| g.max(device.power_cap_min_w));
            let hi = guardrails
                .power_cap_max_w
                .map_or(device.power_cap_max_w, |g| g.min(device.power_cap_max_w));
            if lo > hi {
                return Err(EnvelopeError::Disjoint {
                    gpu,
                    what: "power cap (W)",
                    lo: guardrails.power_cap_min_w.unwrap_or(lo),
                    hi: guardrails.power_cap_max_w.unwrap_or(hi),
                    dev_lo: device.power_cap_min_w,
                    dev_hi: device.power_cap_max_w,
                });
            }
            let clock_lo = guardrails.sm_clock_min_mhz.unwrap_or(0);
            let clock_hi = guardrails.sm_clock_max_mhz.unwrap_or(u32::MAX);
            let mut sm_clocks: Vec<u32> = device
                .sm_clocks_mhz
                .iter()
                .copied()
                .filter(|c| (clock_lo..=clock_hi).contains(c))
                .collect();
            sm_clocks.sort_unstable_by(|a, b| b.cmp(a));
            sm_clocks.dedup();
            if sm_clocks.is_empty() && !device.sm_clocks_mhz.is_empty() {
                return Err(EnvelopeError::Disjoint {
                    gpu,
                    what: "SM clock (MHz)",
                    lo: f64::from(clock_lo),
                    hi: f64::from(clock_hi),
                    dev_lo: f64::from(device.sm_clock_min_mhz()),
                    dev_hi: f64::from(device.sm_clock_max_mhz()),
                });
            }
            let batch_lo = guardrails.batch_size_min.unwrap_or(1).max(1);
            let batch_hi = guardrails
                .batch_size_max
                .map_or(workload_max, |g| g.min(workload_max));
            if batch_lo > batch_hi {
                return Err(EnvelopeError::Disjoint {
                    gpu,
                    what: "batch size",
                    lo: f64::from(batch_lo),
                    hi: f64::from(batch_hi),
                    dev_lo: 1.0,
                    dev_hi: f64::from(workload_max),
                });
            }
            let token_budget = match accepts.token_budget {
                None => None,
                Some((workload_lo, workload_hi)) => {
                    let lo = guardrails
                        .token_budget_min
                        .map_or(workload_lo, |g| g.max(workload_lo));
                    let hi = guardrails
                        .token_budget_max
                        .map_or(workload_hi, |g| g.min(workload_hi));
                    if lo > hi {
                        return Err(EnvelopeError::Disjoint {
                            gpu,
                            what: "token budget (tokens a step)",
                            lo: f64::from(guardrails.token_budget_min.unwrap_or(lo)),
                            hi: f64::from(guardrails.token_budget_max.unwrap_or(hi)),
                            dev_lo: f64::from(workload_lo),
                            dev_hi: f64::from(workload_hi),
                        });
                    }
                    Some((lo, hi))
                }
            };
            gpus.push(GpuLimits {
                power_cap_w: (lo, hi),
                sm_clocks_mhz: sm_clocks,
                sm_clock_device_max_mhz: device.sm_clock_max_mhz(),
                batch_size: (batch_lo, batch_hi),
                token_budget,
                max_power_cap_step_w: guardrails.max_power_cap_step_w.unwrap_or(f64::INFINITY),
                max_power_cap_raise_w: guardrails
                    .max_power_cap_raise_w
                    .unwrap_or(f64::INFINITY)
                    .min(guardrails.max_power_cap_step_w.unwrap_or(f64::INFINITY)),
                max_sm_clock_step_mhz: guardrails.max_sm_clock_step_mhz.unwrap_or(u32::MAX),
                max_batch_size_step: guardrails.max_batch_size_step.unwrap_or(u32::MAX),
                max_token_budget_step: guardrails.max_token_budget_step.unwrap_or(u32::MAX),
            });
        }
        Ok(Self { knobs, gpus })
    }

    /// The knobs the policy behind this envelope owns.
    pub fn knobs(&self) -> Knobs {
        self.knobs
    }

    pub fn limits(&self, gpu: u32) -> Option<&GpuLimits> {
        self.gpus.get(gpu as usize)
    }

    /// What a policy is told about each GPU: the device's facts narrowed by the guardrails.
    pub fn facts(&self, devices: &[DeviceInfo]) -> Vec<DeviceFacts> {
        devices
            .iter()
            .zip(&self.gpus)
            .map(|(d, limits)| DeviceFacts {
                index: d.index,
                uuid: d.uuid.clone(),
                name: d.name.clone(),
                simulated: d.simulated,
                power_cap_min_w: limits.power_cap_w.0,
                power_cap_max_w: limits.power_cap_w.1,
                power_cap_default_w: d.power_cap_default_w,
                sm_clocks_mhz: limits.sm_clocks_mhz.clone(),
                batch_size_max: limits.batch_size.1,
                token_budget_min: limits.token_budget.map_or(0, |(lo, _)| lo),
                token_budget_max: limits.token_budget.map_or(0, |(_, hi)| hi),
            })
            .collect()
    }

    /// Clamp `requested` for `gpu`, given what is in force. Returns only the knobs that change.
    ///
    /// Ranges win over step limits, for every knob alike: a value outside the allowed
    /// range is brought inside at once, whatever the step limit; within the range, a
    /// change is limited per tick. A token budget asked of a GPU whose workload has none
    /// is dropped and counted as clamped, as a knob not granted is. A granted knob whose
    /// setting in force lies outside the
    /// range is brought inside even when nothing asks for it (the workload's initial
    /// batch size, a fallback's "hold"), so no setting the host keeps escapes the
    /// envelope.
    pub fn apply(&self, gpu: u32, requested: &Settings, in_force: &InForce) -> Applied {
        let mut applied = Applied::default();
        let Some(limits) = self.gpus.get(gpu as usize) else {
            applied.clamped = requested != &Settings::default();
            return applied;
        };
        let inside = self.bring_inside(limits, in_force);
        let requested = &Settings {
            power_cap_w: requested.power_cap_w.or(inside.power_cap_w),
            sm_clock_max_mhz: requested.sm_clock_max_mhz.or(inside.sm_clock_max_mhz),
            batch_size: requested.batch_size.or(inside.batch_size),
            token_budget: requested.token_budget.or(inside.token_budget),
        };

        if let Some(want) = requested.power_cap_w {
            // Requests are compared with requests: the enforced limit may sit lower because
            // something outside holds it there, and re-asking would change nothing.
            let requested_before = in_force.power_cap_requested_w;
            match self.power_cap(limits, want, requested_before) {
                Ok((watts, clamped)) => {
                    applied.clamped |= clamped;
                    if (watts - requested_before).abs() >= 0.5 {
                        applied.settings.power_cap_w = Some(watts);
                    }
                }
                Err(non_finite) => {
                    applied.clamped = true;
                    applied.non_finite |= non_finite;
                }
            }
        }
        if let Some(want) = requested.sm_clock_max_mhz {
            match self.sm_clock(limits, want, in_force.sm_clock_max_mhz) {
                Some((mhz, clamped)) => {
                    applied.clamped |= clamped;
                    if mhz != in_force.sm_clock_max_mhz {
                        applied.settings.sm_clock_max_mhz = Some(mhz);
                    }
                }
                None => applied.clamped = true,
            }
        }
        if let Some(want) = requested.batch_size {
            if self.knobs.batch_size {
                let (lo, hi) = limits.batch_size;
                let (stepped, _) = step_limited_u32(
                    want.clamp(lo, hi),
                    in_force.batch_size,
                    limits.max_batch_size_step,
                );
                // The step starts from the setting in force, which may lie outside the
                // range: the range wins.
                let batch = stepped.clamp(lo, hi);
                applied.clamped |= batch != want;
                if batch != in_force.batch_size {
                    applied.settings.batch_size = Some(batch);
                }
            } else {
                applied.clamped = true;
            }
        }
        if let Some(want) = requested.token_budget {
            match limits.token_budget.filter(|_| self.knobs.token_budget) {
                Some((lo, hi)) => {
                    let (stepped, _) = step_limited_u32(
                        want.clamp(lo, hi),
                        in_force.token_budget,
                        limits.max_token_budget_step,
                    );
                    let tokens = stepped.clamp(lo, hi);
                    applied.clamped |= tokens != want;
                    if tokens != in_force.token_budget {
                        applied.settings.token_budget = Some(tokens);
                    }
                }
                None => applied.clamped = true,
            }
        }
        applied
    }

    /// For each granted knob whose setting in force lies outside the allowed range, the
    /// nearest allowed value; `None` for the rest.
    fn bring_inside(&self, limits: &GpuLimits, in_force: &InForce) -> Settings {
        let mut inside = Settings::default();
        let (lo, hi) = limits.power_cap_w;
        let cap = in_force.power_cap_requested_w;
        if self.knobs.power_cap && cap.is_finite() && !(lo..=hi).contains(&cap) {
            inside.power_cap_w = Some(cap.clamp(lo, hi));
        }
        let clock = in_force.sm_clock_max_mhz;
        if self.knobs.sm_clock && !limits.sm_clocks_mhz.contains(&clock) {
            let highest = limits.sm_clocks_mhz.first().copied();
            let lowest = limits.sm_clocks_mhz.last().copied();
            inside.sm_clock_max_mhz = match (highest, lowest) {
                (Some(highest), _) if clock > highest => Some(highest),
                (_, Some(lowest)) if clock < lowest => Some(lowest),
                // Between two allowed clocks (off the grid) is inside the range.
                _ => None,
            };
        }
        let (lo, hi) = limits.batch_size;
        if self.knobs.batch_size && !(lo..=hi).contains(&in_force.batch_size) {
            inside.batch_size = Some(in_force.batch_size.clamp(lo, hi));
        }
        if let Some((lo, hi)) = limits.token_budget
            && self.knobs.token_budget
            && !(lo..=hi).contains(&in_force.token_budget)
        {
            inside.token_budget = Some(in_force.token_budget.clamp(lo, hi));
        }
        inside
    }

    /// `Err(true)` for a non-finite value, `Err(false)` for a knob not granted.
    fn power_cap(&self, limits: &GpuLimits, want: f64, current: f64) -> Result<(f64, bool), bool> {
        if !self.knobs.power_cap {
            return Err(false);
        }
        if !want.is_finite() {
            return Err(true);
        }
        let (lo, hi) = limits.power_cap_w;
        let in_range = want.clamp(lo, hi);
        let step = limits.max_power_cap_step_w;
        let raise = limits.max_power_cap_raise_w;
        // `current` comes from the device; were it ever unknown (NaN), `clamp` would panic.
        // There is then no step to limit, and nothing is applied: no difference from an
        // unknown request reaches the 0.5 W threshold.
        let stepped = if current.is_finite() {
            in_range
                .clamp(current - step, current + raise)
                .clamp(lo, hi)
        } else {
            in_range
        };
        Ok((stepped, stepped != want))
    }

    fn sm_clock(&self, limits: &GpuLimits, want: u32, current: u32) -> Option<(u32, bool)> {
        if !self.knobs.sm_clock || limits.sm_clocks_mhz.is_empty() {
            return None;
        }
        let (stepped, _) = step_limited_u32(want, current, limits.max_sm_clock_step_mhz);
        // The highest allowed clock at or below the target; the lowest allowed if none.
        let snapped = limits
            .sm_clocks_mhz
            .iter()
            .copied()
            .find(|&c| c <= stepped)
            .or_else(|| limits.sm_clocks_mhz.last().copied())?;
        Some((snapped, snapped != want))
    }
}

/// Move from `current` toward `target` by at most `max_step`.
fn step_limited_u32(target: u32, current: u32, max_step: u32) -> (u32, bool) {
    let out = if target > current {
        current.saturating_add(max_step).min(target)
    } else {
        current.saturating_sub(max_step).max(target)
    };
    (out, out != target)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200() -> DeviceInfo {
        DeviceInfo {
            index: 0,
            uuid: "GPU-test".into(),
            name: "test".into(),
            simulated: true,
            power_cap_min_w: 200.0,
            power_cap_max_w: 700.0,
            power_cap_default_w: 700.0,
            sm_clocks_mhz: (0..110).map(|i| 1980 - 15 * i).collect(),
            mem_clocks_mhz: vec![3201],
        }
    }

    fn all_knobs() -> Knobs {
        Knobs::all()
    }

    fn in_force() -> InForce {
        InForce {
            power_cap_w: 700.0,
            power_cap_requested_w: 700.0,
            sm_clock_max_mhz: 1980,
            batch_size: 64,
            token_budget: 0,
        }
    }

    /// A serving workload: batches to 512, 1 to 8192 tokens a step, 8192 in force.
    fn serving() -> WorkloadLimits {
        WorkloadLimits {
            batch_size_max: 512,
            token_budget: Some((1, 8192)),
        }
    }

    fn serving_in_force() -> InForce {
        InForce {
            token_budget: 8192,
            ..in_force()
        }
    }

    fn serving_envelope(g: Guardrails, knobs: Knobs) -> Envelope {
        Envelope::for_workload(&[h200()], &[serving()], &g, knobs).expect("valid")
    }

    fn budget(tokens: u32) -> Settings {
        Settings {
            token_budget: Some(tokens),
            ..Settings::default()
        }
    }

    fn envelope(g: Guardrails) -> Envelope {
        Envelope::new(&[h200()], &[512], &g, all_knobs()).expect("valid")
    }

    #[test]
    fn garbage_never_leaves_the_envelope() {
        let env = envelope(Guardrails {
            power_cap_min_w: Some(300.0),
            max_power_cap_step_w: Some(100.0),
            ..Guardrails::default()
        });
        let garbage = [
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            -5.0,
            0.0,
            1e300,
            f64::MAX,
        ];
        for &watts in &garbage {
            for &mhz in &[0, 1, 7, u32::MAX] {
                for &batch in &[0, 1, u32::MAX] {
                    let req = Settings {
                        power_cap_w: Some(watts),
                        sm_clock_max_mhz: Some(mhz),
                        batch_size: Some(batch),
                        token_budget: Some(batch),
                    };
                    let out = env.apply(0, &req, &in_force());
                    assert!(out.clamped);
                    if let Some(w) = out.settings.power_cap_w {
                        assert!((300.0..=700.0).contains(&w), "{w}");
                        assert!((w - 700.0).abs() <= 100.0);
                    }
                    if let Some(c) = out.settings.sm_clock_max_mhz {
                        assert!(h200().sm_clocks_mhz.contains(&c));
                    }
                    if let Some(b) = out.settings.batch_size {
                        assert!((1..=512).contains(&b));
                    }
                    assert_eq!(out.settings.token_budget, None, "no budget to move");
                }
            }
        }
        let nan = env.apply(
            0,
            &Settings {
                power_cap_w: Some(f64::NAN),
                ..Settings::default()
            },
            &in_force(),
        );
        assert!(nan.non_finite && nan.settings.power_cap_w.is_none());
    }

    /// A cap in force that reads as unknown leaves the cap alone rather than panicking on a
    /// step limit it cannot compute.
    #[test]
    fn an_unknown_cap_in_force_changes_nothing() {
        let env = envelope(Guardrails {
            max_power_cap_step_w: Some(100.0),
            ..Guardrails::default()
        });
        let unknown = InForce {
            power_cap_requested_w: f64::NAN,
            ..in_force()
        };
        let out = env.apply(
            0,
            &Settings {
                power_cap_w: Some(450.0),
                ..Settings::default()
            },
            &unknown,
        );
        assert_eq!(out.settings.power_cap_w, None);
        assert!(!out.non_finite, "the policy asked for a finite cap");
    }

    #[test]
    fn in_range_requests_pass_unchanged() {
        let env = envelope(Guardrails::default());
        let req = Settings {
            power_cap_w: Some(450.0),
            sm_clock_max_mhz: Some(1500),
            batch_size: Some(128),
            token_budget: None,
        };
        let out = env.apply(0, &req, &in_force());
        assert!(!out.clamped);
        assert_eq!(out.settings, req);
    }

    #[test]
    fn unchanged_values_are_not_reapplied() {
        let env = envelope(Guardrails::default());
        let req = Settings {
            power_cap_w: Some(700.0),
            sm_clock_max_mhz: Some(1980),
            batch_size: Some(64),
            token_budget: None,
        };
        let out = env.apply(0, &req, &in_force());
        assert_eq!(out.settings, Settings::default());
        assert!(!out.clamped);
    }

    #[test]
    fn rate_limits_hold() {
        let env = envelope(Guardrails {
            max_power_cap_step_w: Some(50.0),
            max_sm_clock_step_mhz: Some(100),
            max_batch_size_step: Some(16),
            ..Guardrails::default()
        });
        let req = Settings {
            power_cap_w: Some(200.0),
            sm_clock_max_mhz: Some(800),
            batch_size: Some(512),
            token_budget: None,
        };
        let out = env.apply(0, &req, &in_force());
        assert_eq!(out.settings.power_cap_w, Some(650.0));
        // 1980 - 100 = 1880, snapped down to the 15 MHz grid.
        assert_eq!(out.settings.sm_clock_max_mhz, Some(1875));
        assert_eq!(out.settings.batch_size, Some(80));
        assert!(out.clamped);
    }

    #[test]
    fn ranges_win_over_step_limits_for_every_knob() {
        // In force: 700 W, 1980 MHz, batch 512 (the workload's initial batch); guardrails
        // far below, step limits small.
        let in_force = || InForce {
            batch_size: 512,
            ..in_force()
        };
        let env = envelope(Guardrails {
            power_cap_max_w: Some(400.0),
            sm_clock_max_mhz: Some(1500),
            batch_size_max: Some(256),
            max_power_cap_step_w: Some(100.0),
            max_sm_clock_step_mhz: Some(100),
            max_batch_size_step: Some(32),
            ..Guardrails::default()
        });
        let asked = Settings {
            power_cap_w: Some(390.0),
            sm_clock_max_mhz: Some(1400),
            batch_size: Some(200),
            token_budget: None,
        };
        let out = env.apply(0, &asked, &in_force());
        assert_eq!(out.settings.power_cap_w, Some(400.0));
        assert_eq!(out.settings.sm_clock_max_mhz, Some(1500));
        assert_eq!(
            out.settings.batch_size,
            Some(256),
            "no walk down through 480, 448, …"
        );
        // Asking for nothing (a fallback's hold) brings them inside too.
        let held = env.apply(0, &Settings::default(), &in_force());
        assert_eq!(
            held.settings,
            Settings {
                power_cap_w: Some(400.0),
                sm_clock_max_mhz: Some(1500),
                batch_size: Some(256),
                token_budget: None,
            }
        );
        assert!(
            !held.clamped,
            "the policy asked for nothing, so nothing was clamped"
        );
    }

    #[test]
    fn knobs_not_granted_are_dropped() {
        let env = Envelope::new(
            &[h200()],
            &[512],
            &Guardrails::default(),
            Knobs {
                power_cap: true,
                ..Knobs::default()
            },
        )
        .expect("valid");
        let out = env.apply(
            0,
            &Settings {
                power_cap_w: Some(500.0),
                sm_clock_max_mhz: Some(1500),
                batch_size: Some(8),
                token_budget: None,
            },
            &in_force(),
        );
        assert_eq!(out.settings.power_cap_w, Some(500.0));
        assert_eq!(out.settings.sm_clock_max_mhz, None);
        assert_eq!(out.settings.batch_size, None);
        assert!(out.clamped);
    }

    #[test]
    fn guardrails_outside_the_device_are_refused() {
        let err = Envelope::new(
            &[h200()],
            &[512],
            &Guardrails {
                power_cap_min_w: Some(800.0),
                ..Guardrails::default()
            },
            all_knobs(),
        )
        .expect_err("disjoint");
        assert!(err.to_string().contains("power cap"), "{err}");
    }

    #[test]
    fn facts_reflect_guardrails() {
        let env = envelope(Guardrails {
            power_cap_max_w: Some(600.0),
            sm_clock_min_mhz: Some(1000),
            batch_size_max: Some(256),
            ..Guardrails::default()
        });
        let facts = env.facts(&[h200()]);
        assert_eq!(facts[0].power_cap_max_w, 600.0);
        assert_eq!(facts[0].batch_size_max, 256);
        assert!(facts[0].sm_clocks_mhz.iter().all(|&c| c >= 1000));
        assert_eq!(
            (facts[0].token_budget_min, facts[0].token_budget_max),
            (0, 0),
            "a decode-only workload has no token budget"
        );
        let serving = serving_envelope(
            Guardrails {
                token_budget_min: Some(256),
                token_budget_max: Some(4096),
                ..Guardrails::default()
            },
            all_knobs(),
        );
        let facts = serving.facts(&[h200()]);
        assert_eq!(
            (facts[0].token_budget_min, facts[0].token_budget_max),
            (256, 4096)
        );
    }

    #[test]
    fn the_token_budget_is_clamped_to_its_range_and_stepped() {
        let env = serving_envelope(
            Guardrails {
                token_budget_min: Some(256),
                token_budget_max: Some(4096),
                max_token_budget_step: Some(1024),
                ..Guardrails::default()
            },
            all_knobs(),
        );
        let inside = InForce {
            token_budget: 2048,
            ..in_force()
        };
        // Within the range and the step: as asked.
        let out = env.apply(0, &budget(1536), &inside);
        assert_eq!(out.settings.token_budget, Some(1536));
        assert!(!out.clamped);
        // Past the range: its edge, then the step from what is in force.
        let out = env.apply(0, &budget(100_000), &inside);
        assert_eq!(out.settings.token_budget, Some(3072));
        assert!(out.clamped);
        let out = env.apply(0, &budget(0), &inside);
        assert_eq!(out.settings.token_budget, Some(1024));
        assert!(out.clamped);
        // The range wins over the step: the start's 8192 comes down to 4096 at once,
        // asked or not.
        let out = env.apply(0, &budget(3000), &serving_in_force());
        assert_eq!(out.settings.token_budget, Some(4096));
        let held = env.apply(0, &Settings::default(), &serving_in_force());
        assert_eq!(held.settings.token_budget, Some(4096));
        assert!(!held.clamped, "nothing was asked");
        // What is in force is not asked again.
        let out = env.apply(0, &budget(2048), &inside);
        assert_eq!(out.settings, Settings::default());
    }

    #[test]
    fn a_token_budget_not_granted_or_without_a_workload_budget_is_dropped_and_counted() {
        let batch_only = Knobs {
            batch_size: true,
            ..Knobs::default()
        };
        let env = serving_envelope(Guardrails::default(), batch_only);
        let out = env.apply(0, &budget(1024), &serving_in_force());
        assert_eq!(out.settings.token_budget, None);
        assert!(out.clamped, "a knob not granted counts as clamped");
        // Not granted, it is left where it is even outside the guardrails.
        let narrow = serving_envelope(
            Guardrails {
                token_budget_max: Some(1024),
                ..Guardrails::default()
            },
            batch_only,
        );
        let held = narrow.apply(0, &Settings::default(), &serving_in_force());
        assert_eq!(held.settings.token_budget, None);
        // Granted on a workload without a budget (decode only): nothing to move.
        let decode_only = envelope(Guardrails::default());
        let out = decode_only.apply(0, &budget(1024), &in_force());
        assert_eq!(out.settings.token_budget, None);
        assert!(out.clamped);
    }

    #[test]
    fn token_budget_guardrails_outside_the_workloads_range_are_refused() {
        let err = Envelope::for_workload(
            &[h200()],
            &[serving()],
            &Guardrails {
                token_budget_min: Some(10_000),
                ..Guardrails::default()
            },
            all_knobs(),
        )
        .expect_err("disjoint");
        assert!(err.to_string().contains("token budget"), "{err}");
        // On a workload without a budget they bound nothing and refuse nothing (a node's
        // guardrails serve every workload it runs).
        Envelope::new(
            &[h200()],
            &[512],
            &Guardrails {
                token_budget_min: Some(10_000),
                ..Guardrails::default()
            },
            all_knobs(),
        )
        .expect("no budget to bound");
    }
}
