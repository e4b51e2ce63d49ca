//! A ceiling on the sum of a node's power caps, set from outside the loop: the fleet's
//! grant, or its reserve. The loop fits every tick's caps within it, whoever decided them
//! (policy, guard, operator), and applies the GPUs whose caps fall before those whose caps
//! rise, so the sum in force never passes the ceiling, even between two GPUs' changes.

use crate::control::ControlLoop;
use tokwatt_core::types::Settings;

/// The most a node's power caps may sum to, read at every tick.
pub trait PowerAllowance: Send + Sync + std::fmt::Debug {
    fn watts(&self) -> f64;
}

/// Each GPU's cap, lowered toward its minimum in proportion to the room it has above
/// it, so that the caps sum to at most `allowance` (to the milliwatt NVML takes).
/// `unmet`: even every GPU at its minimum passes the allowance. No cap is ever raised.
/// The one fitting of caps within a ceiling: the loop's allowance, the settings guard's
/// restore, and `tokwatt fence` applying the reserve from outside the loop.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    pub caps: Vec<f64>,
    pub lowered: bool,
    pub unmet: bool,
}

pub fn fit_caps(next: &[f64], min: &[f64], allowance: f64) -> Fit {
    let total: f64 = next.iter().sum();
    if total <= allowance || !allowance.is_finite() {
        return Fit {
            caps: next.to_vec(),
            lowered: false,
            unmet: false,
        };
    }
    let room: Vec<f64> = next
        .iter()
        .zip(min)
        .map(|(n, m)| (n - m).max(0.0))
        .collect();
    let room_total: f64 = room.iter().sum();
    let floor_total: f64 = next.iter().zip(&room).map(|(n, r)| n - r).sum();
    if floor_total >= allowance || room_total <= 0.0 {
        return Fit {
            caps: next.iter().zip(&room).map(|(n, r)| n - r).collect(),
            lowered: true,
            unmet: floor_total > allowance,
        };
    }
    let keep = (allowance - floor_total) / room_total;
    // Down to the milliwatt: rounding up anywhere could pass the allowance.
    let caps = next
        .iter()
        .zip(&room)
        .map(|(n, r)| ((n - r + r * keep) * 1000.0).floor() / 1000.0)
        .collect();
    Fit {
        caps,
        lowered: true,
        unmet: false,
    }
}

impl ControlLoop {
    /// Applies `settings` to every GPU: caps fitted within the allowance (where there is
    /// one), the GPUs whose caps fall first.
    pub(super) fn apply_all(&mut self, settings: &mut [Settings]) {
        if let Some(allowance) = &self.allowance {
            let watts = allowance.watts();
            let next: Vec<f64> = settings
                .iter()
                .zip(&self.in_force)
                .map(|(s, f)| s.power_cap_w.unwrap_or(f.power_cap_requested_w))
                .collect();
            let fit = fit_caps(&next, &self.cap_min, watts);
            if fit.lowered {
                self.totals.allowance_cut_ticks += 1;
                for ((s, fitted), before) in settings.iter_mut().zip(&fit.caps).zip(&next) {
                    if fitted != before || s.power_cap_w.is_some() {
                        s.power_cap_w = Some(*fitted);
                    }
                }
            }
            if fit.unmet {
                self.totals.allowance_unmet_ticks += 1;
                tracing::error!(
                    allowance_w = watts,
                    "the node's power allowance is below the sum of its GPUs' minimum caps: every GPU held at its minimum"
                );
            }
        }
        let falls = |g: usize, s: &Settings, in_force: &[tokwatt_core::types::InForce]| {
            s.power_cap_w
                .is_some_and(|w| w < in_force[g].power_cap_requested_w)
        };
        let order: Vec<usize> = (0..settings.len())
            .filter(|&g| falls(g, &settings[g], &self.in_force))
            .chain((0..settings.len()).filter(|&g| !falls(g, &settings[g], &self.in_force)))
            .collect();
        for g in order {
            self.apply(g as u32, &settings[g]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_within_the_allowance_are_left_alone() {
        let fit = fit_caps(&[600.0, 700.0], &[200.0, 200.0], 1300.0);
        assert_eq!(fit.caps, [600.0, 700.0]);
        assert!(!fit.lowered);
    }

    #[test]
    fn caps_over_it_fall_toward_their_minimums_in_proportion() {
        // 1300 W asked, 1000 W allowed: 300 W of the 900 W of room goes.
        let fit = fit_caps(&[600.0, 700.0], &[200.0, 200.0], 1000.0);
        assert!(fit.lowered && !fit.unmet);
        let total: f64 = fit.caps.iter().sum();
        assert!(total <= 1000.0 && total > 999.99, "{total}");
        assert!((fit.caps[0] - (200.0 + 400.0 * 2.0 / 3.0)).abs() < 0.002);
        assert!((fit.caps[1] - (200.0 + 500.0 * 2.0 / 3.0)).abs() < 0.002);
    }

    #[test]
    fn an_allowance_under_the_minimums_holds_every_gpu_at_its_minimum_and_says_so() {
        let fit = fit_caps(&[600.0, 700.0], &[200.0, 250.0], 300.0);
        assert_eq!(fit.caps, [200.0, 250.0]);
        assert!(fit.unmet);
    }
}
