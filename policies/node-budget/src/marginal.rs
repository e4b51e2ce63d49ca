//! What one more watt of cap buys a GPU, in tokens/s: its *marginal return*.
//!
//! A window sums the settled ticks at one cap. A GPU whose window drew clearly less than
//! its cap, or emptied its queue, serves all its demand already: another watt buys it
//! nothing (marginal 0), and the watts it does not use are the cheapest to give away. A
//! GPU with requests waiting all window long is limited by its cap: its marginal is the
//! slope of tokens/s over cap through its recent windows at different caps, or, until it
//! has two, unknown (the budget loop then probes it).

use tokwatt_policy_sdk::{StateReader, StateWriter};

/// Windows kept per GPU (each at a distinct cap).
const POINTS: usize = 4;

/// Settled ticks at one cap.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct Window {
    pub ticks: u32,
    pub tokens: u64,
    pub seconds: f64,
    pub energy_j: f64,
    /// Ticks that ended with requests waiting.
    pub queued_ticks: u32,
}

impl Window {
    pub fn tokens_per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.tokens as f64 / self.seconds
        } else {
            0.0
        }
    }

    pub fn power_w(&self) -> f64 {
        if self.seconds > 0.0 {
            self.energy_j / self.seconds
        } else {
            0.0
        }
    }
}

/// How a window says the GPU stands.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Need {
    /// Serves its demand below its cap: more watts buy nothing.
    Satisfied,
    /// Limited by its cap: the slope in tokens/s per W, if two caps were seen.
    Limited(Option<f64>),
}

/// Recent (cap W, tokens/s) points of one GPU's cap-limited windows, newest last.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Returns {
    pub points: Vec<(f64, f64)>,
}

impl Returns {
    /// Files a finished window at `cap_w`; a point at a cap already held replaces it.
    /// A throughput at the same cap that moved by `shift_factor` means the workload
    /// changed: the older points are dropped. Returns true on such a shift.
    pub fn add(&mut self, cap_w: f64, tokens_per_s: f64, shift_factor: f64) -> bool {
        let mut shifted = false;
        if let Some(index) = self.points.iter().position(|p| (p.0 - cap_w).abs() < 0.5) {
            let old = self.points[index].1;
            shifted = tokens_per_s > old * shift_factor || tokens_per_s * shift_factor < old;
            self.points.remove(index);
        }
        if shifted {
            self.points.clear();
        }
        if self.points.len() == POINTS {
            self.points.remove(0);
        }
        self.points.push((cap_w, tokens_per_s));
        shifted
    }

    /// Least-squares slope of tokens/s over cap, from at least two distinct caps. A
    /// slope below zero is noise (a higher cap never slows a GPU down), but it is kept
    /// as measured: clamped to 0 it would make any GPU look like a donor.
    pub fn slope(&self) -> Option<f64> {
        if self.points.len() < 2 {
            return None;
        }
        let n = self.points.len() as f64;
        let mean_x = self.points.iter().map(|p| p.0).sum::<f64>() / n;
        let mean_y = self.points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = self.points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
        if sxx < 1.0 {
            return None;
        }
        let sxy: f64 = self
            .points
            .iter()
            .map(|p| (p.0 - mean_x) * (p.1 - mean_y))
            .sum();
        Some(sxy / sxx)
    }

    pub fn write_state(&self, writer: StateWriter) -> StateWriter {
        let mut writer = writer.u32(self.points.len() as u32);
        for &(cap_w, tokens_per_s) in &self.points {
            writer = writer.f64(cap_w).f64(tokens_per_s);
        }
        writer
    }

    pub fn read_state(reader: &mut StateReader<'_>) -> Result<Returns, String> {
        let count = reader.u32()? as usize;
        if count > POINTS {
            return Err(format!("{count} points in the state, at most {POINTS}"));
        }
        let mut returns = Returns::default();
        for _ in 0..count {
            let (cap_w, tokens_per_s) = (reader.f64()?, reader.f64()?);
            if !(cap_w.is_finite() && tokens_per_s.is_finite() && tokens_per_s >= 0.0) {
                return Err(format!("point ({cap_w}, {tokens_per_s}) in the state"));
            }
            returns.points.push((cap_w, tokens_per_s));
        }
        Ok(returns)
    }
}

/// How a finished window at `cap_w` says the GPU stands. `unused_fraction` of the cap
/// left undrawn counts as satisfied.
pub(crate) fn need(window: &Window, cap_w: f64, returns: &Returns, unused_fraction: f64) -> Need {
    let below_cap = window.power_w() < cap_w * (1.0 - unused_fraction);
    let queue_drained = window.queued_ticks < window.ticks;
    if below_cap || queue_drained {
        Need::Satisfied
    } else {
        Need::Limited(returns.slope())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_from_two_caps_and_a_shift_drops_the_old_points() {
        let mut returns = Returns::default();
        assert!(!returns.add(500.0, 10_000.0, 2.0));
        assert_eq!(returns.slope(), None);
        returns.add(525.0, 10_250.0, 2.0);
        assert!((returns.slope().unwrap() - 10.0).abs() < 1e-9);
        // The same cap again replaces its point.
        returns.add(525.0, 10_500.0, 2.0);
        assert_eq!(returns.points.len(), 2);
        assert!((returns.slope().unwrap() - 20.0).abs() < 1e-9);
        // Falling throughput with cap is noise, kept as measured.
        returns.add(550.0, 9_000.0, 2.0);
        assert!(returns.slope().is_some_and(|slope| slope < 0.0));
        assert!(returns.add(550.0, 3_000.0, 2.0));
        assert_eq!(returns.points, vec![(550.0, 3_000.0)]);
    }

    #[test]
    fn a_window_under_its_cap_or_with_the_queue_drained_is_satisfied() {
        let returns = Returns::default();
        let busy = Window {
            ticks: 5,
            tokens: 50_000,
            seconds: 5.0,
            energy_j: 2_450.0,
            queued_ticks: 5,
        };
        assert_eq!(need(&busy, 500.0, &returns, 0.05), Need::Limited(None));
        let drained = Window {
            queued_ticks: 4,
            ..busy
        };
        assert_eq!(need(&drained, 500.0, &returns, 0.05), Need::Satisfied);
        assert_eq!(need(&busy, 600.0, &returns, 0.05), Need::Satisfied);
    }
}
