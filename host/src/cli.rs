//! Command-line parsing helpers shared by the binary's commands.

use std::time::Duration;

/// Parse a duration as people write it: "30m", "90s", "1h30m", "500ms", "2h 5m" (through
/// `humantime`), or a plain number of seconds ("90", "2.5").
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err("the duration is empty: write e.g. 30m, 90s, 1h30m or 500ms".into());
    }
    let duration = match trimmed.parse::<f64>() {
        Ok(secs) if secs.is_finite() && (0.0..1e9).contains(&secs) => {
            Duration::from_secs_f64(secs)
        }
        Ok(_) => {
            return Err(format!(
                "duration `{trimmed}` is out of range: give a positive number of seconds, or e.g. 30m"
            ));
        }
        Err(_) => humantime::parse_duration(trimmed).map_err(|error| {
            format!(
                "`{trimmed}` is not a duration ({error}): write a number with a unit, e.g. 30m, 90s, 1h30m or 500ms"
            )
        })?,
    };
    if duration.is_zero() {
        return Err(format!("duration `{trimmed}` must be longer than zero"));
    }
    Ok(duration)
}

/// [`parse_duration`] that also takes zero ("0", "0s"): for a part of a schedule that may
/// be left out, such as `tokwatt ab --cooldown 0s`.
pub fn parse_duration_or_zero(text: &str) -> Result<Duration, String> {
    let trimmed = text.trim();
    if trimmed.parse::<f64>() == Ok(0.0)
        || humantime::parse_duration(trimmed).is_ok_and(|d| d.is_zero())
    {
        return Ok(Duration::ZERO);
    }
    parse_duration(trimmed)
}

/// The most worker threads a command may be asked for: past it the operating system may
/// refuse one mid-run, and no machine gains from more.
pub const MAX_THREADS: usize = 1024;

/// A `--threads` count: 1 to [`MAX_THREADS`].
pub fn thread_count(text: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(threads) if (1..=MAX_THREADS).contains(&threads) => Ok(threads),
        _ => Err(format!(
            "`{text}` is not a thread count: give a whole number from 1 to {MAX_THREADS}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_counts_are_whole_and_bounded() {
        assert_eq!(thread_count("4"), Ok(4));
        for bad in ["0", "-1", "2.5", "1025", "lots"] {
            let err = thread_count(bad).expect_err(bad);
            assert!(err.contains("1 to 1024"), "{err}");
        }
    }

    #[test]
    fn zero_is_taken_only_where_asked_for() {
        assert_eq!(parse_duration_or_zero("0s"), Ok(Duration::ZERO));
        assert_eq!(parse_duration_or_zero("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration_or_zero("5s"), Ok(Duration::from_secs(5)));
        assert!(parse_duration_or_zero("-1").is_err());
        assert!(parse_duration("0s").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2.5"), Ok(Duration::from_millis(2500)));
        assert_eq!(parse_duration("2h 5m"), Ok(Duration::from_secs(7500)));
        assert!(parse_duration("10 parsecs").is_err());
        assert!(parse_duration("-5s").is_err());
        assert!(parse_duration("0").is_err());
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("m").is_err());
    }

    #[test]
    fn a_word_is_named_in_the_error_not_an_empty_number() {
        let error = parse_duration("abc").expect_err("not a duration");
        assert!(error.contains("`abc` is not a duration"), "{error}");
        assert!(!error.contains("``"), "{error}");
    }
}
