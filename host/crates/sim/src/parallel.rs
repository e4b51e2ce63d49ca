//! Boards caught up on two threads: a helper thread takes boards from one pool beside the
//! caller's thread, for a catch-up long enough to be worth the hand-over.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::SimState;
use crate::gpu::GpuSim;

/// Boards caught up together by two threads at least this many substeps (a second of
/// simulated time on the built-in profiles): shorter catch-ups (a real-time run's) stay on
/// the caller's thread, where a hand-over would cost more than it saves.
const PARALLEL_MIN_SUBSTEPS: u64 = 32;

/// A thread that advances boards beside the caller. Both take boards one at a time from a
/// shared pool until it is empty, so a helper that wakes late (a busy machine) leaves its
/// share to the caller instead of holding it up. The boards are independent (each its own
/// random streams), so which thread advances one changes nothing of what it simulates.
#[derive(Debug)]
pub(super) struct Helper {
    shared: Arc<HandOver>,
    thread: std::thread::JoinHandle<()>,
}

#[derive(Debug, Default)]
struct HandOver {
    /// Boards still to advance, with their places.
    todo: Mutex<Vec<(usize, GpuSim)>>,
    /// Boards advanced, with their places.
    done: Mutex<Vec<(usize, GpuSim)>>,
    now_ns: std::sync::atomic::AtomicU64,
    /// Raised for every catch-up; the helper works whenever it sees a new one.
    generation: std::sync::atomic::AtomicU64,
    /// Boards handed out and not yet back in `done`.
    pending: std::sync::atomic::AtomicUsize,
    closed: std::sync::atomic::AtomicBool,
}

/// How long the helper spins for the next catch-up before it sleeps.
const SPIN: std::time::Duration = std::time::Duration::from_micros(50);

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl HandOver {
    /// Advance boards from the pool until it is empty.
    fn work(&self) {
        let now_ns = self.now_ns.load(Ordering::Acquire);
        loop {
            let Some((place, mut board)) = locked(&self.todo).pop() else {
                return;
            };
            board.advance_to(now_ns);
            locked(&self.done).push((place, board));
            self.pending.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Helper {
    fn start() -> Option<Helper> {
        let shared = Arc::new(HandOver::default());
        let theirs = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("tokwatt-sim".into())
            .spawn(move || helper_loop(&theirs))
            .map_err(|error| {
                tracing::warn!("the simulation runs on one thread (no helper thread: {error})");
            })
            .ok()?;
        Some(Helper { shared, thread })
    }

    /// Every board of `boards` advanced to `now_ns`, by this thread and the helper, in
    /// their places; `None` if the helper stopped holding one (a panic in a board).
    fn advance(&self, boards: Vec<GpuSim>, now_ns: u64) -> Option<Vec<GpuSim>> {
        let count = boards.len();
        let shared = &self.shared;
        shared.now_ns.store(now_ns, Ordering::Release);
        shared.pending.store(count, Ordering::Release);
        *locked(&shared.todo) = boards.into_iter().enumerate().rev().collect();
        shared.generation.fetch_add(1, Ordering::AcqRel);
        self.thread.thread().unpark();
        shared.work();
        let mut spins = 0u32;
        while shared.pending.load(Ordering::Acquire) > 0 {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                if self.thread.is_finished() {
                    return None;
                }
                std::thread::yield_now();
            }
            std::hint::spin_loop();
        }
        let mut done = std::mem::take(&mut *locked(&shared.done));
        done.sort_unstable_by_key(|(place, _)| *place);
        Some(done.into_iter().map(|(_, board)| board).collect())
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.thread.thread().unpark();
    }
}

fn helper_loop(shared: &HandOver) {
    let mut seen = 0;
    loop {
        let idle_since = std::time::Instant::now();
        let mut spins = 0u32;
        loop {
            if shared.closed.load(Ordering::Acquire) {
                return;
            }
            let generation = shared.generation.load(Ordering::Acquire);
            if generation != seen {
                seen = generation;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && idle_since.elapsed() > SPIN {
                std::thread::park_timeout(std::time::Duration::from_millis(50));
            } else if spins.is_multiple_of(16) {
                // A thread that has work (the run's output writer) gets this core.
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        shared.work();
    }
}

impl SimState {
    /// With two boards or more and a catch-up of at least [`PARALLEL_MIN_SUBSTEPS`], the
    /// boards are advanced by this thread and the helper together; they are back in their
    /// places, in order, when it returns.
    pub(super) fn catch_up_in_parallel(&mut self, now_ns: u64) {
        if self.gpus.len() < 2
            || self
                .gpus
                .iter()
                .all(|board| board.substeps_behind(now_ns) < PARALLEL_MIN_SUBSTEPS)
        {
            return;
        }
        if self.helper.is_none() {
            self.helper = Helper::start();
        }
        let Some(helper) = &self.helper else {
            return;
        };
        let boards = std::mem::take(&mut self.gpus);
        match helper.advance(boards, now_ns) {
            Some(boards) => self.gpus = boards,
            // It stopped holding a board: only a panic in a board does that, and that is a
            // bug here as it would be on this thread.
            None => panic!("the simulation's helper thread stopped with a board"),
        }
    }
}
