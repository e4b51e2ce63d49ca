//! A stall: the loop found that far more time passed than its tick. The process was
//! stopped (SIGSTOP, a debugger, a frozen container, a host under memory pressure) or a
//! call hung; every setting it knows is then as old as the stall, and a cap outlives the
//! process that set it, so something else may have changed the driver meanwhile (a fence
//! that lowered the caps to the node's reserve, an operator, a restore). Before the loop
//! acts or reports again it reads every GPU's cap and clock lock back from the device.
//!
//! The threshold is [`STALL_TICKS`] periods behind schedule: a tick that starts more than
//! two periods after it was due, or that has run that long before it applies anything.
//! - Ordinary lateness stays under it: a tick may start up to a period late without
//!   being wrong (the fence's feed already calls that on time), and a slow policy call is
//!   bounded by its deadline, a fraction of the tick.
//! - A fence cannot have acted under it: the agent warns of a fence that watches for a
//!   stall shorter than three ticks (`serve/fence.rs`, `MIN_WATCHDOG_TICKS`), and its
//!   heartbeat, fed after each on-time tick, goes unfed for a period plus however late the
//!   next tick is, so such a fence fires only once the loop is two periods behind or more.
//! - Counting one too many costs one read of each GPU's settings and a warning.
//!
//! A virtual clock moves only when the loop sleeps, so a simulated run never stalls.

use std::time::Duration;

use super::ControlLoop;

/// How many tick periods behind its schedule the loop may fall before it counts a stall
/// and reads every GPU's settings back (see the module's text for why two).
pub const STALL_TICKS: u32 = 2;

/// The time behind schedule past which the loop counts a stall, for ticks `tick` apart.
pub fn stall_threshold(tick: Duration) -> Duration {
    tick.saturating_mul(STALL_TICKS)
}

/// Where in a tick the loop found it had stalled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StallAt {
    /// The tick started late: the loop was stopped between two ticks.
    BeforeTick,
    /// The tick had run too long before applying anything: stopped between its reads and
    /// its changes.
    WithinTick,
}

impl StallAt {
    fn describe(self) -> &'static str {
        match self {
            StallAt::BeforeTick => "between two ticks",
            StallAt::WithinTick => "between a tick's reads and its changes",
        }
    }
}

impl ControlLoop {
    /// After a stall of `lost` found at `now`: counted, logged once, every GPU's settings
    /// read back, and the schedule moved on so that the next tick is due within a period
    /// of now, on the same phase (the ticks the stall missed are not run back to back:
    /// each would see a window of next to nothing).
    pub(super) fn after_stall(&mut self, lost: Duration, now: Duration, at: StallAt) {
        let tick = self.config.tick;
        self.totals.stalls += 1;
        self.totals.stalled_s += lost.as_secs_f64();
        tracing::warn!(
            stalled_s = lost.as_secs_f64(),
            tick_s = tick.as_secs_f64(),
            "the control loop stalled {} for {:.3} s (a tick is {:.3} s): reading every GPU's settings back from the device before acting on them or reporting them",
            at.describe(),
            lost.as_secs_f64(),
            tick.as_secs_f64(),
        );
        for gpu in 0..self.in_force.len() as u32 {
            if let Err(error) = self.read_back(gpu) {
                // Nothing better is known: the loop keeps what it had, and the next
                // change of this GPU's settings reads them back again.
                tracing::warn!(
                    gpu,
                    "reading the settings back after a stall failed: {error}"
                );
            }
        }
        if let Some(schedule) = &mut self.schedule {
            let next_due = schedule.due(schedule.next_tick, tick);
            if now >= next_due {
                let period_ns = tick.as_nanos().max(1);
                let missed = (now - next_due).as_nanos() / period_ns + 1;
                let skipped_ns =
                    u64::try_from(missed.saturating_mul(period_ns)).unwrap_or(u64::MAX);
                schedule.slip = schedule
                    .slip
                    .saturating_add(Duration::from_nanos(skipped_ns));
            }
        }
    }
}
