//! Command-line parsing helpers shared by the binary's commands.

use std::time::Duration;

/// Parse "30m", "90s", "1h30m", "500ms", "2h" or a plain number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("empty duration: write e.g. 30m, 90s, 1h, 500ms".into());
    }
    if let Ok(secs) = text.parse::<f64>() {
        return seconds(secs, text);
    }
    let mut total = 0.0;
    let mut rest = text;
    while !rest.is_empty() {
        let split = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| {
                format!("duration `{text}` lacks a unit after its last number (ms, s, m, h)")
            })?;
        let (number, tail) = rest.split_at(split);
        let value: f64 = number
            .parse()
            .map_err(|_| format!("duration `{text}`: `{number}` is not a number"))?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(tail.len());
        let (unit, next) = tail.split_at(unit_len);
        let scale = match unit {
            "ms" => 0.001,
            "s" | "sec" => 1.0,
            "m" | "min" => 60.0,
            "h" => 3600.0,
            other => {
                return Err(format!(
                    "duration `{text}`: unknown unit `{other}`; use ms, s, m or h"
                ));
            }
        };
        total += value * scale;
        rest = next;
    }
    seconds(total, text)
}

fn seconds(secs: f64, text: &str) -> Result<Duration, String> {
    if secs.is_finite() && secs > 0.0 && secs < 1e9 {
        Ok(Duration::from_secs_f64(secs))
    } else {
        Err(format!("duration `{text}` must be positive"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2.5s"), Ok(Duration::from_millis(2500)));
        assert!(parse_duration("10 parsecs").is_err());
        assert!(parse_duration("-5s").is_err());
        assert!(parse_duration("0").is_err());
        assert!(parse_duration("5").is_ok());
        assert!(parse_duration("m").is_err());
    }
}
