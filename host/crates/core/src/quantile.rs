//! The one nearest-rank quantile: the simulator's queue-wait p99, the agent's tick
//! lateness, the API benchmark's request latencies, the CUDA decode's time per token.

/// The `q` quantile (nearest rank, `q` in 0..=1) of `values`, `None` when there are none.
/// Reorders `values`.
pub fn nearest_rank(values: &mut [f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    let (_, value, _) = values.select_nth_unstable_by(rank - 1, f64::total_cmp);
    Some(*value)
}

/// Log-spaced buckets for a run's latencies: each bucket's upper bound is 1 % above the
/// one before, from [`LatencyHistogram::FLOOR_MS`] to [`LatencyHistogram::CEILING_MS`].
/// A quantile read from it is within 1 % of the nearest-rank one, in fixed memory however
/// long the run (`tokwatt serve` for months).
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyHistogram {
    /// `counts[0]`: at or under the floor; `counts[last]`: above the ceiling.
    counts: Vec<u64>,
    /// The counts of each run of [`Self::BLOCK`] buckets, so a quantile skips the empty
    /// stretches of some 2 000 buckets (a control loop reads six quantiles a tick).
    blocks: Vec<u64>,
    count: u64,
    max_ms: f64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl LatencyHistogram {
    pub const FLOOR_MS: f64 = 0.01;
    pub const CEILING_MS: f64 = 1.0e7;
    const RATIO: f64 = 1.01;
    const BLOCK: usize = 64;

    pub fn new() -> Self {
        let inner = ((Self::CEILING_MS / Self::FLOOR_MS).ln() / Self::RATIO.ln()).ceil() as usize;
        let buckets = inner + 2;
        Self {
            counts: vec![0; buckets],
            blocks: vec![0; buckets.div_ceil(Self::BLOCK)],
            count: 0,
            max_ms: f64::NAN,
        }
    }

    /// Records one latency; a non-finite or negative one is not a latency and is ignored.
    pub fn record(&mut self, ms: f64) {
        if !(ms.is_finite() && ms >= 0.0) {
            return;
        }
        let last = self.counts.len() - 1;
        let bucket = if ms <= Self::FLOOR_MS {
            0
        } else {
            let above = ((ms / Self::FLOOR_MS).ln() / Self::RATIO.ln()).ceil() as usize;
            above.min(last)
        };
        self.counts[bucket] += 1;
        self.blocks[bucket / Self::BLOCK] += 1;
        self.count += 1;
        self.max_ms = if self.max_ms.is_nan() {
            ms
        } else {
            self.max_ms.max(ms)
        };
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// The quantiles `qs`, in ascending order, in one pass over the buckets: each what
    /// [`LatencyHistogram::quantile`] gives (a control loop reads three every tick).
    pub fn quantiles<const N: usize>(&self, qs: [f64; N]) -> [Option<f64>; N] {
        let mut found = [None; N];
        if self.count == 0 {
            return found;
        }
        let ranks = qs.map(|q| ((q * self.count as f64).ceil() as u64).clamp(1, self.count));
        let last = self.counts.len() - 1;
        let mut next = 0;
        let mut seen = 0;
        for (block, &in_block) in self.blocks.iter().enumerate() {
            if next == N {
                break;
            }
            if seen + in_block < ranks[next] {
                seen += in_block;
                continue;
            }
            let first = block * Self::BLOCK;
            let end = (first + Self::BLOCK).min(self.counts.len());
            for (bucket, &n) in self.counts[first..end].iter().enumerate() {
                let bucket = first + bucket;
                seen += n;
                while next < N && seen >= ranks[next] {
                    found[next] = Some(if bucket == last {
                        self.max_ms
                    } else {
                        (Self::FLOOR_MS * Self::RATIO.powi(bucket as i32)).min(self.max_ms)
                    });
                    next += 1;
                }
            }
        }
        for slot in &mut found[next..] {
            *slot = Some(self.max_ms);
        }
        found
    }

    /// The `q` quantile (nearest rank): the upper bound of the bucket holding that rank
    /// (the largest latency itself for the top bucket), `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = ((q * self.count as f64).ceil() as u64).clamp(1, self.count);
        let mut seen = 0;
        for (bucket, &n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                if bucket == self.counts.len() - 1 {
                    return Some(self.max_ms);
                }
                let bound = Self::FLOOR_MS * Self::RATIO.powi(bucket as i32);
                // No bucket bound past the largest value seen.
                return Some(bound.min(self.max_ms));
            }
        }
        Some(self.max_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::{LatencyHistogram, nearest_rank};

    #[test]
    fn the_histogram_quantiles_are_within_one_percent_of_nearest_rank() {
        let mut values: Vec<f64> = (0..10_000)
            .map(|i| 0.5 + (f64::from(i) * 0.618_033_988_75).fract() * 300.0)
            .collect();
        let mut h = LatencyHistogram::new();
        for &v in &values {
            h.record(v);
        }
        h.record(f64::NAN);
        h.record(-1.0);
        assert_eq!(h.count(), 10_000);
        for q in [0.5, 0.9, 0.99, 1.0] {
            let exact = nearest_rank(&mut values, q).unwrap();
            let read = h.quantile(q).unwrap();
            assert!(
                read >= exact && read <= exact * 1.01 + 1e-12,
                "q {q}: {read} against {exact}"
            );
        }
        assert_eq!(
            h.quantiles([0.5, 0.9, 0.99, 1.0]),
            [0.5, 0.9, 0.99, 1.0].map(|q| h.quantile(q)),
            "one pass reads what each quantile alone does"
        );
        assert_eq!(LatencyHistogram::new().quantiles([0.5, 0.9]), [None, None]);
        assert_eq!(LatencyHistogram::new().quantile(0.5), None);
        let mut one = LatencyHistogram::new();
        one.record(2e8);
        assert_eq!(one.quantile(0.99), Some(2e8));
        assert_eq!(one.quantiles([0.5, 0.99]), [Some(2e8), Some(2e8)]);
        // Ranks that land in different blocks of buckets, the first and the last included.
        let mut wide = LatencyHistogram::new();
        for i in 0..1000 {
            wide.record(0.001 * 1.05f64.powi(i % 400));
        }
        let qs = [0.001, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0];
        assert_eq!(wide.quantiles(qs), qs.map(|q| wide.quantile(q)));
    }

    #[test]
    fn nearest_rank_quantiles() {
        let mut waits: Vec<f64> = (1..=200).rev().map(f64::from).collect();
        assert_eq!(nearest_rank(&mut waits, 0.99), Some(198.0));
        assert_eq!(nearest_rank(&mut [5.0], 0.99), Some(5.0));
        assert_eq!(nearest_rank(&mut [], 0.99), None);
        let mut values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(nearest_rank(&mut values, 0.50), Some(50.0));
        assert_eq!(nearest_rank(&mut values, 0.99), Some(99.0));
        assert_eq!(nearest_rank(&mut [7.0], 0.99), Some(7.0));
        assert_eq!(nearest_rank(&mut [], 0.5), None);
    }
}
