//! The guest's clocks: wall and monotonic time are the run's tick time, so a guest's
//! sleep or timer never blocks the loop and a run replays exactly.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use wasmtime::component::{HasData, Linker, Resource, ResourceTable};
use wasmtime_wasi::p2::bindings::clocks::monotonic_clock;
use wasmtime_wasi::p2::{DynPollable, Pollable, subscribe};
use wasmtime_wasi::{HostMonotonicClock, HostWallClock};

use super::HostState;

/// The run's clock as a plugin sees it. The wall clock and `tick-time-ms` read the
/// tick's time. The monotonic clock starts there too, but a plugin that sleeps (a
/// `wasi:clocks/monotonic-clock` pollable, which `std::thread::sleep` compiles to) does
/// not wait: its pollable is ready at once and its monotonic time jumps ahead by the
/// sleep, so a sleeping plugin can neither hold up the control loop (fuel and the epoch
/// deadline do not run while a guest waits in a host call) nor make a replay differ.
#[derive(Debug, Clone, Default)]
pub(crate) struct TickClock(pub(crate) Arc<ClockState>);

#[derive(Debug, Default)]
pub(crate) struct ClockState {
    pub(crate) tick_nanos: AtomicU64,
    pub(crate) monotonic_nanos: AtomicU64,
}

impl TickClock {
    pub(crate) fn nanos(&self) -> u64 {
        self.0.tick_nanos.load(Ordering::Relaxed)
    }

    pub(crate) fn set(&self, nanos: u64) {
        self.0.tick_nanos.store(nanos, Ordering::Relaxed);
        // Monotonic: never back, even after a long sleep ran it ahead of the ticks.
        self.0.monotonic_nanos.fetch_max(nanos, Ordering::Relaxed);
    }

    pub(crate) fn monotonic(&self) -> u64 {
        self.0.monotonic_nanos.load(Ordering::Relaxed)
    }

    /// Move the monotonic clock to `until` at once (a sleep that took no time).
    pub(crate) fn advance_to(&self, until: u64) {
        self.0.monotonic_nanos.fetch_max(until, Ordering::Relaxed);
    }
}

impl HostWallClock for TickClock {
    fn resolution(&self) -> Duration {
        Duration::from_millis(1)
    }
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos())
    }
}

impl HostMonotonicClock for TickClock {
    fn resolution(&self) -> u64 {
        1_000_000
    }
    fn now(&self) -> u64 {
        self.monotonic()
    }
}

/// A pollable that is ready at once: what every monotonic-clock subscription returns.
pub(crate) struct Ready;

impl Pollable for Ready {
    fn ready<'life0, 'async_trait>(
        &'life0 mut self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(std::future::ready(()))
    }
}

/// `wasi:clocks/monotonic-clock` on the virtual clock, shadowing wasmtime-wasi's (whose
/// subscriptions wait in real time).
pub(crate) struct VirtualMonotonicClock<'a> {
    pub(crate) clock: &'a TickClock,
    pub(crate) table: &'a mut ResourceTable,
}

impl VirtualMonotonicClock<'_> {
    pub(crate) fn ready_after(&mut self, until: u64) -> wasmtime::Result<Resource<DynPollable>> {
        self.clock.advance_to(until);
        let ready = self.table.push(Ready)?;
        subscribe(self.table, ready)
    }
}

impl monotonic_clock::Host for VirtualMonotonicClock<'_> {
    fn now(&mut self) -> wasmtime::Result<monotonic_clock::Instant> {
        Ok(self.clock.monotonic())
    }

    fn resolution(&mut self) -> wasmtime::Result<monotonic_clock::Duration> {
        Ok(1_000_000)
    }

    fn subscribe_instant(
        &mut self,
        when: monotonic_clock::Instant,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        self.ready_after(when)
    }

    fn subscribe_duration(
        &mut self,
        duration: monotonic_clock::Duration,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        let until = self.clock.monotonic().saturating_add(duration);
        self.ready_after(until)
    }
}

/// Selects [`VirtualMonotonicClock`] as the data the shadowing bindings see.
pub(crate) struct HasVirtualClock;

impl HasData for HasVirtualClock {
    type Data<'a> = VirtualMonotonicClock<'a>;
}

/// Replace WASI's monotonic clock in `linker` (which already holds all of WASI) with the
/// virtual one.
pub(crate) fn shadow_monotonic_clock(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let result = monotonic_clock::add_to_linker::<HostState, HasVirtualClock>(linker, |state| {
        VirtualMonotonicClock {
            clock: &state.clock,
            table: &mut state.table,
        }
    });
    linker.allow_shadowing(false);
    result
}
