//! The latency model of one GPU at one clock: p99 time per token ≈ a + b·sequences,
//! fitted by least squares to the recent settled ticks.
//!
//! A decode step streams the weights (the constant `a`) and each sequence's KV cache
//! (`b` per sequence), so the line fits well over the batch range. With too little
//! spread in the points to fit a slope, the model falls back to the line through the
//! origin (`a = 0`), which overestimates the time at any larger batch: growing by it is
//! safe, and the next ticks give the spread for a real fit.

use tokwatt_policy_sdk::{StateReader, StateWriter};

/// Points kept: ~a dozen seconds of ticks, recent enough to follow a workload that moved.
pub(crate) const FIT_POINTS: usize = 12;

/// The relative spread of sequence counts below which no slope is fitted.
const MIN_SPREAD: f64 = 0.1;

/// Recent (sequences, p99 ms) points, oldest first.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct TpotFit {
    pub points: Vec<(f64, f64)>,
}

/// A fitted line: p99 ms = `a_ms` + `b_ms` · sequences.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Line {
    pub a_ms: f64,
    pub b_ms: f64,
    /// False for the fallback through the origin (too little spread to fit a slope).
    pub fitted: bool,
}

impl Line {
    /// The largest sequence count predicted to stay at or under `target_ms`.
    pub fn sequences_for(&self, target_ms: f64) -> f64 {
        if self.b_ms <= 0.0 {
            return f64::INFINITY;
        }
        (target_ms - self.a_ms) / self.b_ms
    }
}

impl TpotFit {
    pub fn add(&mut self, sequences: u32, p99_ms: f64) {
        if sequences == 0 || !(p99_ms.is_finite() && p99_ms > 0.0) {
            return;
        }
        if self.points.len() == FIT_POINTS {
            self.points.remove(0);
        }
        self.points.push((f64::from(sequences), p99_ms));
    }

    /// Rescales every point's time by `factor`: after a clock change the old points
    /// still say how the time grows with the batch, at the new clock's speed.
    pub fn scale(&mut self, factor: f64) {
        for point in &mut self.points {
            point.1 *= factor;
        }
    }

    pub fn clear(&mut self) {
        self.points.clear();
    }

    /// Keeps only the newest point (after a workload shift the older ones mislead).
    pub fn keep_newest(&mut self) {
        let newest = self.points.last().copied();
        self.points.clear();
        self.points.extend(newest);
    }

    /// The line through the points, or `None` without any.
    pub fn line(&self) -> Option<Line> {
        let n = self.points.len() as f64;
        if self.points.is_empty() {
            return None;
        }
        let mean_x = self.points.iter().map(|p| p.0).sum::<f64>() / n;
        let mean_y = self.points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = self.points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
        let sxy: f64 = self
            .points
            .iter()
            .map(|p| (p.0 - mean_x) * (p.1 - mean_y))
            .sum();
        let spread = (sxx / n).sqrt() / mean_x;
        let through_origin = Line {
            a_ms: 0.0,
            b_ms: mean_y / mean_x,
            fitted: false,
        };
        if spread < MIN_SPREAD || sxx <= 0.0 {
            return Some(through_origin);
        }
        let b_ms = sxy / sxx;
        let a_ms = mean_y - b_ms * mean_x;
        // A flat or falling line is noise, and a negative intercept no decode has: the
        // line through the origin is the safe reading of either.
        if b_ms <= 0.0 || a_ms < 0.0 {
            return Some(through_origin);
        }
        Some(Line {
            a_ms,
            b_ms,
            fitted: true,
        })
    }

    pub fn write_state(&self, writer: StateWriter) -> StateWriter {
        let mut writer = writer.u32(self.points.len() as u32);
        for &(x, y) in &self.points {
            writer = writer.f64(x).f64(y);
        }
        writer
    }

    pub fn read_state(reader: &mut StateReader<'_>) -> Result<TpotFit, String> {
        let count = reader.u32()? as usize;
        if count > FIT_POINTS {
            return Err(format!(
                "{count} latency points in the state, at most {FIT_POINTS}"
            ));
        }
        let mut fit = TpotFit::default();
        for _ in 0..count {
            let (x, y) = (reader.f64()?, reader.f64()?);
            if !(x.is_finite() && x > 0.0 && y.is_finite() && y > 0.0) {
                return Err(format!("latency point ({x}, {y}) in the state"));
            }
            fit.points.push((x, y));
        }
        Ok(fit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_with_spread_is_fitted_and_inverted() {
        let mut fit = TpotFit::default();
        for batch in [64, 128, 192, 256] {
            fit.add(batch, 4.8 + 0.056 * f64::from(batch));
        }
        let line = fit.line().unwrap();
        assert!((line.a_ms - 4.8).abs() < 1e-9 && (line.b_ms - 0.056).abs() < 1e-9);
        assert!((line.sequences_for(18.0) - 235.714).abs() < 0.01);
    }

    #[test]
    fn without_spread_the_line_goes_through_the_origin_and_overestimates() {
        let mut fit = TpotFit::default();
        assert_eq!(fit.line(), None);
        fit.add(64, 8.0);
        fit.add(64, 8.2);
        let line = fit.line().unwrap();
        assert_eq!(line.a_ms, 0.0);
        assert!(!line.fitted);
        // True 4.8 + 0.056 x gives 11.97 ms at 128; the origin line says more.
        assert!(line.a_ms + line.b_ms * 128.0 > 11.97);
    }

    #[test]
    fn old_points_roll_off_and_scale_with_the_clock() {
        let mut fit = TpotFit::default();
        for i in 0..20 {
            fit.add(10 + i, 5.0);
        }
        assert_eq!(fit.points.len(), FIT_POINTS);
        assert_eq!(fit.points[0].0, 18.0);
        fit.scale(2.0);
        assert!(fit.points.iter().all(|p| p.1 == 10.0));
        fit.keep_newest();
        assert_eq!(fit.points, vec![(29.0, 10.0)]);
        fit.add(0, 3.0);
        fit.add(5, f64::NAN);
        assert_eq!(fit.points.len(), 1);
    }
}
