//! The run's clock. Real runs use the wall clock; simulated runs use a virtual clock that
//! jumps, so a simulated hour runs in seconds. Both sit behind [`Clock`], so the control
//! loop is the same code either way.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Time since the run started.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> Duration;
    /// Wait until `t` (returns at once if `t` has passed).
    fn sleep_until(&self, t: Duration);
    fn is_virtual(&self) -> bool;
}

/// The wall clock, measured from construction.
#[derive(Debug)]
pub struct WallClock {
    start: Instant,
}

impl WallClock {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            start: Instant::now(),
        })
    }
}

impl Clock for WallClock {
    fn now(&self) -> Duration {
        self.start.elapsed()
    }
    fn sleep_until(&self, t: Duration) {
        let now = self.now();
        if t > now {
            std::thread::sleep(t - now);
        }
    }
    fn is_virtual(&self) -> bool {
        false
    }
}

/// A clock that only moves when the run sleeps: sleeping jumps straight to the target.
/// Simulated devices read it and catch up lazily to its time whenever they are asked.
#[derive(Debug, Default)]
pub struct VirtualClock {
    nanos: AtomicU64,
}

impl VirtualClock {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }
}

impl Clock for VirtualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::Acquire))
    }
    fn sleep_until(&self, t: Duration) {
        let target = u64::try_from(t.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_max(target, Ordering::AcqRel);
    }
    fn is_virtual(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_clock_jumps_and_never_goes_back() {
        let clock = VirtualClock::new();
        assert_eq!(clock.now(), Duration::ZERO);
        clock.sleep_until(Duration::from_secs(3600));
        assert_eq!(clock.now(), Duration::from_secs(3600));
        clock.sleep_until(Duration::from_secs(10));
        assert_eq!(clock.now(), Duration::from_secs(3600));
    }
}
