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

#[cfg(test)]
mod tests {
    use super::nearest_rank;

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
