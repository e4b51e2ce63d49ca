//! Noise-aware comparison of per-tick figures: a running mean with a bounded memory, a
//! pooled estimate of the per-tick noise, and a verdict that only calls a difference
//! real when it exceeds `z` standard errors.
//!
//! Per-window noise does not cancel between two settings the way a board's constant
//! sensor gain error does, so a search that compares single windows is fooled by it. The
//! standard error of a mean of a few ticks is itself noisy, so it comes from a *pooled*
//! relative variance, learnt over every window of the search (the noise is much the same
//! at every setting), rather than from the two or three ticks of one window.

use tokwatt_policy_sdk::{StateReader, StateWriter};

/// Mean and spread of a series (Welford), remembering at most `memory` samples: past
/// that, each new sample weighs `1 / memory`, so old figures fade as the workload drifts.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RunningStats {
    /// Samples so far, up to the memory.
    pub count: u32,
    pub mean: f64,
    /// Sum of squared deviations from the mean, over the remembered samples.
    pub m2: f64,
}

impl RunningStats {
    /// Adds `value`; a sample that is not finite is ignored.
    pub fn push(&mut self, value: f64, memory: u32) {
        if !value.is_finite() {
            return;
        }
        let memory = memory.max(2);
        let weight = f64::from(self.count.saturating_add(1).min(memory));
        let delta = value - self.mean;
        self.mean += delta / weight;
        if self.count >= memory {
            // Forget a share of the old spread as the new sample takes its weight.
            self.m2 = self.m2 * (1.0 - 1.0 / weight) + delta * (value - self.mean);
        } else {
            self.m2 += delta * (value - self.mean);
            self.count += 1;
        }
    }

    /// The sample variance, once there are two samples.
    pub fn variance(&self) -> Option<f64> {
        (self.count >= 2).then(|| (self.m2 / f64::from(self.count - 1)).max(0.0))
    }

    /// The variance relative to the squared mean, once there are two samples and the
    /// mean is not zero.
    pub fn relative_variance(&self) -> Option<f64> {
        let variance = self.variance()?;
        (self.mean.abs() > f64::MIN_POSITIVE).then(|| variance / (self.mean * self.mean))
    }

    /// The standard error of the mean under a relative per-sample variance of
    /// `pooled_relative_variance`; infinite with no samples.
    pub fn standard_error(&self, pooled_relative_variance: f64) -> f64 {
        if self.count == 0 {
            return f64::INFINITY;
        }
        self.mean.abs() * (pooled_relative_variance / f64::from(self.count)).sqrt()
    }

    pub fn write(&self, writer: StateWriter) -> StateWriter {
        writer.u32(self.count).f64(self.mean).f64(self.m2)
    }

    /// # Errors
    /// A truncated record or a value that is not finite.
    pub fn read(reader: &mut StateReader<'_>, memory: u32) -> Result<RunningStats, String> {
        let count = reader.u32()?.min(memory.max(2));
        let mean = reader.f64()?;
        let m2 = reader.f64()?;
        if !(mean.is_finite() && m2.is_finite()) {
            return Err(format!(
                "statistics in the state are not finite ({mean}, {m2})"
            ));
        }
        Ok(RunningStats {
            count,
            mean,
            m2: m2.max(0.0),
        })
    }
}

/// The per-tick relative variance of one figure, pooled over the windows of a search: an
/// exponential average of each full window's own relative variance, starting from the
/// configured guess.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PooledNoise {
    pub relative_variance: f64,
}

impl PooledNoise {
    /// Starts from a per-tick coefficient of variation of `cv` (0.03 for 3 %).
    pub fn new(cv: f64) -> PooledNoise {
        PooledNoise {
            relative_variance: cv * cv,
        }
    }

    /// Learns from one window; windows of fewer than two samples say nothing. The
    /// estimate is kept above `floor_cv`², so a few lucky windows cannot make every
    /// difference look real.
    pub fn learn(&mut self, window: &RunningStats, floor_cv: f64) {
        const WEIGHT: f64 = 0.2;
        // One window counts for at most four times the estimate: a window that caught
        // a ramp (a queue filling, a phase change) is not noise, and must not make every
        // difference a tie for the next dozen windows. Real noise above the estimate
        // still raises it by 1.6x a window.
        const MOST_PER_WINDOW: f64 = 4.0;
        if let Some(relative_variance) = window.relative_variance() {
            let counted = relative_variance.min(MOST_PER_WINDOW * self.relative_variance);
            self.relative_variance = ((1.0 - WEIGHT) * self.relative_variance + WEIGHT * counted)
                .max(floor_cv * floor_cv);
        }
    }
}

/// How a candidate compares with the incumbent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Higher by more than `z` standard errors of the difference.
    Better,
    /// Lower by more than `z` standard errors of the difference.
    Worse,
    /// Within the noise.
    Tie,
}

/// Compares `candidate` with `incumbent` (higher is better), both measured with a
/// per-sample relative variance of `noise`.
pub fn compare(
    candidate: &RunningStats,
    incumbent: &RunningStats,
    noise: &PooledNoise,
    z: f64,
) -> Verdict {
    let se_candidate = candidate.standard_error(noise.relative_variance);
    let se_incumbent = incumbent.standard_error(noise.relative_variance);
    let se = (se_candidate * se_candidate + se_incumbent * se_incumbent).sqrt();
    let difference = candidate.mean - incumbent.mean;
    if !se.is_finite() {
        Verdict::Tie
    } else if difference > z * se {
        Verdict::Better
    } else if difference < -z * se {
        Verdict::Worse
    } else {
        Verdict::Tie
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(values: &[f64]) -> RunningStats {
        let mut stats = RunningStats::default();
        for &value in values {
            stats.push(value, 100);
        }
        stats
    }

    #[test]
    fn mean_and_variance_match_the_textbook() {
        let stats = stats(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert_eq!(stats.count, 8);
        assert!((stats.mean - 5.0).abs() < 1e-12);
        assert!((stats.variance().unwrap_or_default() - 32.0 / 7.0).abs() < 1e-12);
        assert_eq!(RunningStats::default().variance(), None);
    }

    #[test]
    fn a_bounded_memory_follows_a_level_that_moved() {
        let mut stats = RunningStats::default();
        for _ in 0..10 {
            stats.push(10.0, 4);
        }
        for _ in 0..10 {
            stats.push(20.0, 4);
        }
        assert_eq!(stats.count, 4);
        assert!(stats.mean > 19.0, "{stats:?}");
        stats.push(f64::NAN, 4);
        assert!(stats.mean.is_finite());
    }

    #[test]
    fn differences_count_only_beyond_the_noise() {
        let noise = PooledNoise::new(0.03);
        let incumbent = stats(&[10.0, 10.0, 10.0, 10.0]);
        // 3 % per sample over 4 samples: se 0.15 each, 0.21 for the difference.
        assert_eq!(
            compare(&stats(&[10.3; 4]), &incumbent, &noise, 2.0),
            Verdict::Tie
        );
        assert_eq!(
            compare(&stats(&[10.6; 4]), &incumbent, &noise, 2.0),
            Verdict::Better
        );
        assert_eq!(
            compare(&stats(&[9.4; 4]), &incumbent, &noise, 2.0),
            Verdict::Worse
        );
        assert_eq!(
            compare(&RunningStats::default(), &incumbent, &noise, 2.0),
            Verdict::Tie
        );
    }

    #[test]
    fn the_pooled_noise_learns_but_keeps_its_floor() {
        let mut noise = PooledNoise::new(0.03);
        for _ in 0..50 {
            noise.learn(&stats(&[10.0, 10.0, 10.0]), 0.005);
        }
        assert!((noise.relative_variance - 0.005 * 0.005).abs() < 1e-12);
        // One wild window moves it by at most 1.6x; sustained noise is learnt.
        let before = noise.relative_variance;
        noise.learn(&stats(&[8.0, 12.0]), 0.005);
        assert!(noise.relative_variance <= 1.6 * before + 1e-15, "{noise:?}");
        for _ in 0..50 {
            noise.learn(&stats(&[8.0, 12.0]), 0.005);
        }
        assert!(noise.relative_variance > 0.05, "{noise:?}");
    }
}
