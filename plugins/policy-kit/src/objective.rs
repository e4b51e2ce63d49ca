//! Checks on the spec's `[objective]`.

use tokwatt_policy_sdk::Objective;

/// Checks that the objective's limits, where set, can be met by some setting at all: a
/// positive, finite p99 time per token, a finite throughput floor of zero or more and a
/// positive, finite p99 queue wait.
///
/// # Errors
/// A message naming the offending key and value.
pub fn check_objective(objective: &Objective) -> Result<(), String> {
    if let Some(limit_ms) = objective.tpot_p99_limit_ms
        && !(limit_ms.is_finite() && limit_ms > 0.0)
    {
        return Err(format!(
            "objective `tpot_p99_limit_ms` = {limit_ms} must be a positive number of ms"
        ));
    }
    if let Some(min_tokens_per_s) = objective.min_tokens_per_s
        && !(min_tokens_per_s.is_finite() && min_tokens_per_s >= 0.0)
    {
        return Err(format!(
            "objective `min_tokens_per_s` = {min_tokens_per_s} must be zero or more"
        ));
    }
    if let Some(limit_ms) = objective.queue_wait_p99_limit_ms
        && !(limit_ms.is_finite() && limit_ms > 0.0)
    {
        return Err(format!(
            "objective `queue_wait_p99_limit_ms` = {limit_ms} must be a positive number of ms"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn objective(tpot_p99_limit_ms: Option<f64>, min_tokens_per_s: Option<f64>) -> Objective {
        Objective {
            tpot_p99_limit_ms,
            min_tokens_per_s,
            queue_wait_p99_limit_ms: None,
            ttft_p99_limit_ms: None,
        }
    }

    #[test]
    fn unset_and_sensible_limits_pass() {
        assert_eq!(check_objective(&objective(None, None)), Ok(()));
        assert_eq!(check_objective(&objective(Some(20.0), Some(0.0))), Ok(()));
    }

    #[test]
    fn impossible_limits_are_refused_by_name() {
        let cases = [
            (objective(Some(-1.0), None), "tpot_p99_limit_ms` = -1"),
            (objective(Some(0.0), None), "tpot_p99_limit_ms` = 0"),
            (objective(Some(f64::NAN), None), "tpot_p99_limit_ms` = NaN"),
            (objective(None, Some(-5.0)), "min_tokens_per_s` = -5"),
            (
                objective(None, Some(f64::INFINITY)),
                "min_tokens_per_s` = inf",
            ),
            (
                Objective {
                    queue_wait_p99_limit_ms: Some(0.0),
                    ..objective(None, None)
                },
                "queue_wait_p99_limit_ms` = 0",
            ),
        ];
        for (objective, named) in cases {
            let error = check_objective(&objective).err().unwrap_or_default();
            assert!(error.contains(named), "{objective:?}: {error:?}");
        }
    }
}
