//! What the host offers a policy: logging, a seeded random source and the run's clock.
//!
//! Inside the WebAssembly component these call the host's imports. Built natively (for a
//! policy's own unit tests), they need no host: [`log`] prints to standard error,
//! [`random_u64`] draws from a fixed-seed generator (so tests are repeatable) and
//! [`tick_time_ms`] is always 0.

use crate::LogLevel;

/// Writes `message` to the agent's log at `level`, tagged with the policy's name.
///
/// The host rate-limits logging per tick: messages past its limit are dropped and
/// counted, so log decisions, not every intermediate value.
pub fn log(level: LogLevel, message: &str) {
    imports::log(level, message);
}

/// A uniformly distributed `u64` from the host's generator, seeded per run so a run
/// replays exactly.
pub fn random_u64() -> u64 {
    imports::random()
}

/// A uniformly distributed `f64` in `[0, 1)`, from [`random_u64`].
pub fn random_f64() -> f64 {
    unit_interval(random_u64())
}

/// Milliseconds since the run started, on the run's clock (virtual on the simulator).
pub fn tick_time_ms() -> u64 {
    imports::tick_time_ms()
}

/// Maps 64 random bits onto `[0, 1)`: the top 53 bits fill an `f64` mantissa exactly,
/// so every result is equally likely and 1.0 is never reached.
fn unit_interval(bits: u64) -> f64 {
    const MANTISSA_BITS: u32 = 53;
    let scale = 1.0 / (1_u64 << MANTISSA_BITS) as f64;
    (bits >> (64 - MANTISSA_BITS)) as f64 * scale
}

#[cfg(target_arch = "wasm32")]
mod imports {
    pub(super) use crate::bindings::tokwatt::policy::host::{log, random, tick_time_ms};
}

/// Stand-ins for the host's imports when the policy is built natively for its tests.
#[cfg(not(target_arch = "wasm32"))]
mod imports {
    use crate::LogLevel;
    use std::cell::Cell;

    pub(super) fn log(level: LogLevel, message: &str) {
        eprintln!("[policy {level:?}] {message}");
    }

    std::thread_local! {
        static STATE: Cell<u64> = const { Cell::new(0x7419_57AE_D5EE_D001) };
    }

    /// SplitMix64: tiny, and good enough to drive a policy's tests.
    pub(super) fn random() -> u64 {
        STATE.with(|state| {
            let next = state.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
            state.set(next);
            let mut z = next;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        })
    }

    pub(super) fn tick_time_ms() -> u64 {
        0
    }
}

/// Logs a formatted message at trace level: `trace!("window {n} done")`.
#[macro_export]
macro_rules! trace {
    ($($arg:tt)+) => {
        $crate::log($crate::LogLevel::Trace, &::std::format!($($arg)+))
    };
}

/// Logs a formatted message at debug level: `debug!("cap {cap_w} W")`.
#[macro_export]
macro_rules! debug {
    ($($arg:tt)+) => {
        $crate::log($crate::LogLevel::Debug, &::std::format!($($arg)+))
    };
}

/// Logs a formatted message at info level.
#[macro_export]
macro_rules! info {
    ($($arg:tt)+) => {
        $crate::log($crate::LogLevel::Info, &::std::format!($($arg)+))
    };
}

/// Logs a formatted message at warn level.
#[macro_export]
macro_rules! warn {
    ($($arg:tt)+) => {
        $crate::log($crate::LogLevel::Warn, &::std::format!($($arg)+))
    };
}

/// Logs a formatted message at error level.
#[macro_export]
macro_rules! error {
    ($($arg:tt)+) => {
        $crate::log($crate::LogLevel::Error, &::std::format!($($arg)+))
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_interval_covers_zero_to_just_below_one() {
        assert_eq!(unit_interval(0), 0.0);
        let top = unit_interval(u64::MAX);
        assert!(top < 1.0, "{top}");
        assert!(top > 0.999_999_999, "{top}");
        assert_eq!(unit_interval(1 << 63), 0.5);
    }

    #[test]
    fn native_random_is_spread_over_the_unit_interval() {
        let draws: Vec<f64> = (0..10_000).map(|_| random_f64()).collect();
        assert!(draws.iter().all(|x| (0.0..1.0).contains(x)));
        let below_half = draws.iter().filter(|&&x| x < 0.5).count();
        assert!((4_500..5_500).contains(&below_half), "{below_half}");
    }
}
