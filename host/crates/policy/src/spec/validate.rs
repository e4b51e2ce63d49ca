//! Every value of a policy spec checked in one place, after parsing, with the key named
//! (and its line, where the file writes it). Parsing (`toml` + serde) already refuses
//! unknown keys and wrong types; this refuses values that parse but make no sense: a
//! zero budget, a NaN objective, a breaker that never ejects, a tick shorter than the
//! plugin's deadline.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{RawSpec, SpecError};

/// The shortest control tick: NVML's energy counter updates every 100 ms, so shorter
/// ticks mostly see quantisation, but 10 ms is allowed for simulated experiments.
pub const MIN_TICK: Duration = Duration::from_millis(10);
/// The longest control tick.
pub const MAX_TICK: Duration = Duration::from_secs(3600);

/// A value that is wrong, before the file is known.
#[derive(Debug)]
pub(super) struct Problem {
    table: Option<&'static str>,
    key: &'static str,
    text: String,
}

impl Problem {
    fn new(table: Option<&'static str>, key: &'static str, text: String) -> Self {
        Self { table, key, text }
    }

    /// The error, with the file and the key's line in it.
    pub(super) fn locate(self, path: &Path, text: &str) -> SpecError {
        SpecError::Invalid {
            path: PathBuf::from(path),
            line: line_of(text, self.table, self.key),
            key: match self.table {
                Some(table) => format!("{table}.{}", self.key),
                None => self.key.to_owned(),
            },
            problem: self.text,
        }
    }
}

/// The 1-based line on which `key` is assigned inside `[table]` (or at the top level).
fn line_of(text: &str, table: Option<&str>, key: &str) -> Option<usize> {
    let mut current: Option<&str> = None;
    for (index, line) in text.lines().enumerate() {
        let line = line.trim();
        if let Some(header) = line.strip_prefix('[') {
            current = header.split(']').next().map(str::trim);
            continue;
        }
        let assigns = line
            .strip_prefix(key)
            .is_some_and(|rest| rest.trim_start().starts_with('='));
        if assigns && current == table {
            return Some(index + 1);
        }
    }
    None
}

/// The tick in milliseconds, if it lies between [`MIN_TICK`] and [`MAX_TICK`] and leaves
/// the plugin's deadline room within it.
pub(super) fn tick_ms(tick: Duration, deadline_ms: u64) -> Result<u32, String> {
    if !(MIN_TICK..=MAX_TICK).contains(&tick) {
        return Err(format!(
            "must be between {} and {}, not {}",
            humantime::format_duration(MIN_TICK),
            humantime::format_duration(MAX_TICK),
            humantime::format_duration(tick)
        ));
    }
    let ms = u32::try_from(tick.as_millis()).unwrap_or(u32::MAX);
    // A call is interrupted only at its deadline times the margin for wall-clock noise.
    let longest_call_ms = deadline_ms.saturating_mul(crate::limits::DEADLINE_MARGIN);
    if u64::from(ms) < longest_call_ms {
        return Err(format!(
            "({ms} ms) is shorter than the longest a plugin call may take ({longest_call_ms} ms: sandbox.deadline_ms = {deadline_ms}, times {} for wall-clock noise): a call could outlast its tick; lengthen the tick or shorten the deadline",
            crate::limits::DEADLINE_MARGIN
        ));
    }
    Ok(ms)
}

/// Checks every value; the first problem found is returned.
pub(super) fn check(raw: &RawSpec) -> Result<(), Problem> {
    let top = |key, text| Problem::new(None, key, text);
    if raw.name.trim().is_empty() {
        return Err(top("name", "must not be empty".into()));
    }
    if raw.plugin.trim().is_empty() {
        return Err(top("plugin", "must name the plugin's .wasm file".into()));
    }
    tick_ms(Duration::from_millis(raw.tick_ms), raw.sandbox.deadline_ms)
        .map_err(|text| top("tick_ms", text))?;
    check_objective(raw)?;
    check_guardrails(raw)?;
    check_sandbox(raw)?;
    check_breaker(raw)
}

fn positive_f64(
    table: &'static str,
    key: &'static str,
    value: Option<f64>,
    zero_allowed: bool,
) -> Result<(), Problem> {
    match value {
        Some(v) if !v.is_finite() || v < 0.0 || (v == 0.0 && !zero_allowed) => Err(Problem::new(
            Some(table),
            key,
            format!(
                "must be a {} finite number, not {v}",
                if zero_allowed {
                    "non-negative"
                } else {
                    "positive"
                }
            ),
        )),
        _ => Ok(()),
    }
}

fn positive_u32(table: &'static str, key: &'static str, value: Option<u32>) -> Result<(), Problem> {
    match value {
        Some(0) => Err(Problem::new(
            Some(table),
            key,
            "must be at least 1 (0 would forbid every change)".into(),
        )),
        _ => Ok(()),
    }
}

fn ordered<T: PartialOrd + std::fmt::Display + Copy>(
    table: &'static str,
    (min_key, min): (&'static str, Option<T>),
    (max_key, max): (&'static str, Option<T>),
) -> Result<(), Problem> {
    match (min, max) {
        (Some(lo), Some(hi)) if lo > hi => Err(Problem::new(
            Some(table),
            min_key,
            format!("({lo}) is above {max_key} ({hi})"),
        )),
        _ => Ok(()),
    }
}

fn check_objective(raw: &RawSpec) -> Result<(), Problem> {
    let o = &raw.objective;
    positive_f64("objective", "tpot_p99_limit_ms", o.tpot_p99_limit_ms, false)?;
    positive_f64("objective", "min_tokens_per_s", o.min_tokens_per_s, true)?;
    positive_f64(
        "objective",
        "queue_wait_p99_limit_ms",
        o.queue_wait_p99_limit_ms,
        false,
    )?;
    positive_f64("objective", "ttft_p99_limit_ms", o.ttft_p99_limit_ms, false)
}

fn check_guardrails(raw: &RawSpec) -> Result<(), Problem> {
    let g = &raw.guardrails;
    const T: &str = "guardrails";
    positive_f64(T, "power_cap_min_w", g.power_cap_min_w, false)?;
    positive_f64(T, "power_cap_max_w", g.power_cap_max_w, false)?;
    positive_f64(T, "max_power_cap_step_w", g.max_power_cap_step_w, false)?;
    positive_f64(T, "max_power_cap_raise_w", g.max_power_cap_raise_w, false)?;
    positive_u32(T, "sm_clock_min_mhz", g.sm_clock_min_mhz)?;
    positive_u32(T, "sm_clock_max_mhz", g.sm_clock_max_mhz)?;
    positive_u32(T, "batch_size_min", g.batch_size_min)?;
    positive_u32(T, "batch_size_max", g.batch_size_max)?;
    positive_u32(T, "max_sm_clock_step_mhz", g.max_sm_clock_step_mhz)?;
    positive_u32(T, "max_batch_size_step", g.max_batch_size_step)?;
    positive_u32(T, "token_budget_min", g.token_budget_min)?;
    positive_u32(T, "token_budget_max", g.token_budget_max)?;
    positive_u32(T, "max_token_budget_step", g.max_token_budget_step)?;
    ordered(
        T,
        ("power_cap_min_w", g.power_cap_min_w),
        ("power_cap_max_w", g.power_cap_max_w),
    )?;
    ordered(
        T,
        ("sm_clock_min_mhz", g.sm_clock_min_mhz),
        ("sm_clock_max_mhz", g.sm_clock_max_mhz),
    )?;
    ordered(
        T,
        ("batch_size_min", g.batch_size_min),
        ("batch_size_max", g.batch_size_max),
    )?;
    ordered(
        T,
        ("token_budget_min", g.token_budget_min),
        ("token_budget_max", g.token_budget_max),
    )
}

/// The most log messages one call may write; past it they are dropped and counted.
const MAX_LOG_MESSAGES_PER_CALL: u32 = 1024;

fn check_sandbox(raw: &RawSpec) -> Result<(), Problem> {
    let s = &raw.sandbox;
    const T: &str = "sandbox";
    if s.fuel_per_call < 1_000 {
        return Err(Problem::new(
            Some(T),
            "fuel_per_call",
            format!(
                "({}) is too small for any policy to start: give at least 1000 (a Rust policy's `decide` takes about a thousand per GPU, its `init` about ten thousand)",
                s.fuel_per_call
            ),
        ));
    }
    if !(1..=60_000).contains(&s.deadline_ms) {
        return Err(Problem::new(
            Some(T),
            "deadline_ms",
            format!("must be between 1 and 60000, not {}", s.deadline_ms),
        ));
    }
    if !(1..=4096).contains(&s.memory_mib) {
        return Err(Problem::new(
            Some(T),
            "memory_mib",
            format!("must be between 1 and 4096, not {}", s.memory_mib),
        ));
    }
    // Each message may be a KiB: more than this a call floods the log every tick.
    if s.log_messages_per_call > MAX_LOG_MESSAGES_PER_CALL {
        return Err(Problem::new(
            Some(T),
            "log_messages_per_call",
            format!(
                "must be between 0 (a silent policy) and {MAX_LOG_MESSAGES_PER_CALL}, not {}",
                s.log_messages_per_call
            ),
        ));
    }
    Ok(())
}

fn check_breaker(raw: &RawSpec) -> Result<(), Problem> {
    // The breaker states its own rules; this names them with the file and line.
    raw.breaker
        .validate()
        .map_err(|error| Problem::new(Some("breaker"), error.key, error.problem))
}

#[cfg(test)]
mod tests {
    use super::super::PolicySpec;
    use std::path::Path;

    fn error(text: &str) -> String {
        let full = format!("name = 'x'\nplugin = 'x.wasm'\n{text}\n");
        PolicySpec::parse(Path::new("/specs/p.toml"), &full)
            .expect_err("invalid")
            .to_string()
    }

    #[test]
    fn bad_values_are_named_with_their_file_and_line() {
        let zero_fuel = error("[sandbox]\nfuel_per_call = 0");
        assert!(
            zero_fuel.contains("/specs/p.toml:4: `sandbox.fuel_per_call`"),
            "{zero_fuel}"
        );
        let nan = error("[objective]\ntpot_p99_limit_ms = nan");
        assert!(
            nan.contains(":4: `objective.tpot_p99_limit_ms` must be a positive finite number"),
            "{nan}"
        );
        let breaker = error("[breaker]\nfailures_to_eject = 0");
        assert!(
            breaker.contains(":4: `breaker.failures_to_eject` must be at least 1"),
            "{breaker}"
        );
        let backoff = error("[breaker]\nbackoff_ticks = 0");
        assert!(backoff.contains("breaker.backoff_ticks"), "{backoff}");
        let order = error("[guardrails]\npower_cap_min_w = 500.0\npower_cap_max_w = 400.0");
        assert!(
            order.contains(":4: `guardrails.power_cap_min_w` (500) is above power_cap_max_w (400)"),
            "{order}"
        );
        let step = error("[guardrails]\nmax_batch_size_step = 0");
        assert!(step.contains("guardrails.max_batch_size_step"), "{step}");
        let tick = error("tick_ms = 5");
        assert!(
            tick.contains(":3: `tick_ms` must be between 10ms"),
            "{tick}"
        );
        let deadline = error("tick_ms = 150\n[sandbox]\ndeadline_ms = 100");
        assert!(
            deadline.contains("shorter than the longest a plugin call may take (200 ms"),
            "{deadline}"
        );
    }

    #[test]
    fn a_tick_given_on_the_command_line_is_checked_the_same_way() {
        let mut spec =
            PolicySpec::parse(Path::new("/p.toml"), "name='x'\nplugin='x.wasm'").expect("valid");
        let error = spec
            .override_tick(std::time::Duration::from_nanos(1))
            .expect_err("1 ns");
        assert!(
            error.to_string().contains("`--tick` must be between"),
            "{error}"
        );
        spec.override_tick(std::time::Duration::from_millis(500))
            .expect("500 ms");
        assert_eq!(spec.tick_ms, 500);
    }
}
