//! [`CudaServe`]: the engine serving requests on a thread of its own, behind the [`Workload`]
//! trait. Requests arrive in real time from a [`RequestSource`] (a scenario's arrivals); each
//! step runs every decoding sequence's next token and prompt chunks under the token budget
//! ([`Scheduler`], core's one serving scheduler, the simulator's too) as one forward pass
//! ([`Engine::serve_step`]), and the step's end is when its tokens exist. The running limit
//! (the batch size knob) and the token budget are the knobs; TTFT, TPOT and queue waits are
//! measured per request on the wall clock. With an energy counter, each step's energy is
//! its duration times the GPU's mean power over the last second ([`PowerEstimate`]), shared
//! over the step's tokens; without one, a request's energy is unknown, never 0 J.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::engine::{DecodeInput, Engine, EngineOptions, PrefillChunk};
use super::error::CudaError;
use super::shape::ModelShape;
use super::step_log::{StepLog, StepRecord};
use tokwatt_core::types::WorkloadWindow;
use tokwatt_core::workload::serving::{
    RequestRecord, RequestSource, Scheduler, ServingLimits, StepPlan,
};
use tokwatt_core::workload::{FinishedRequests, WorkWaiting, Workload, WorkloadError};

/// Finished requests kept for [`CudaServe::take_finished`] between reads; older ones are
/// dropped and counted.
const MAX_KEPT_RECORDS: usize = 1 << 20;

/// How long the loop sleeps when nothing is admitted or waiting.
const IDLE_SLEEP: Duration = Duration::from_micros(500);

/// Reads the GPU's cumulative energy counter in joules (`None`: unreadable this time). The
/// NVML counter is refreshed every 100 ms; it is read at most that often.
pub type EnergyCounter = Box<dyn FnMut() -> Option<f64> + Send>;

/// What to serve.
pub struct CudaServeConfig {
    pub model: ModelShape,
    /// KV positions per sequence: a request's prompt and output must fit (longer ones are
    /// cut and counted).
    pub context: u32,
    /// KV cache slots allocated: the most sequences that can run at once.
    pub slots: u32,
    /// Sequences admitted at first (the batch size knob).
    pub running_limit: u32,
    /// Tokens one step may process at first, and the most the token budget knob may
    /// raise it to.
    pub max_batched_tokens: u32,
    pub queue_max: u32,
    pub device: u32,
    /// The GPU index the agent uses for this GPU.
    pub gpu_index: u32,
    pub engine: EngineOptions,
    pub requests: Box<dyn RequestSource>,
    /// The GPU's energy counter, to give each request its share of each step's energy;
    /// `None`: requests' energy is unknown.
    pub energy: Option<EnergyCounter>,
    /// Keep a record of every step, at most this many between two reads
    /// ([`CudaServe::take_steps`]); `None`: keep none.
    pub step_log: Option<usize>,
}

impl std::fmt::Debug for CudaServeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaServeConfig")
            .field("model", &self.model.name)
            .field("context", &self.context)
            .field("slots", &self.slots)
            .field("running_limit", &self.running_limit)
            .field("max_batched_tokens", &self.max_batched_tokens)
            .field("queue_max", &self.queue_max)
            .field("device", &self.device)
            .field("energy", &self.energy.is_some())
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Shared {
    scheduler: Mutex<Scheduler>,
    requested_limit: AtomicU32,
    /// The token budget per step the loop asked for, taken up before the next plan.
    requested_budget: AtomicU32,
    stop: AtomicBool,
    failure: Mutex<Option<String>>,
    finished: Mutex<Vec<RequestRecord>>,
    dropped_records: AtomicU32,
    /// Whether steps are given their energy (an energy counter was configured).
    energy_counted: bool,
    /// A step in the current window ran without its energy (the counter was unreadable or
    /// not yet warm): the window's request energies are then not all known.
    energy_gap: AtomicBool,
    steps: Option<Mutex<StepLog>>,
}

/// Requests served on one GPU by tokwatt's engine, stepping on a thread of its own.
#[derive(Debug)]
pub struct CudaServe {
    gpu_index: u32,
    slots: u32,
    /// The most tokens a step may process: the budget it started with.
    budget_max: u32,
    gpu_name: String,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl CudaServe {
    /// Starts the serving thread: opens the GPU and allocates the engine for `slots`
    /// sequences of `context` positions, then returns; requests are timed from then on.
    pub fn new(config: CudaServeConfig) -> Result<CudaServe, CudaError> {
        super::engine::validate(&config.model, config.context, config.slots)?;
        let limits = ServingLimits {
            slots: config.slots,
            context: config.context,
            max_batched_tokens: config.max_batched_tokens,
            queue_max: config.queue_max,
        };
        let scheduler = Scheduler::new(limits, config.running_limit)
            .map_err(|e| CudaError::Config(e.to_string()))?;
        let budget_max = limits.max_batched_tokens;
        let shared = Arc::new(Shared {
            requested_limit: AtomicU32::new(scheduler.running_limit()),
            requested_budget: AtomicU32::new(scheduler.token_budget()),
            scheduler: Mutex::new(scheduler),
            stop: AtomicBool::new(false),
            failure: Mutex::new(None),
            finished: Mutex::new(Vec::new()),
            dropped_records: AtomicU32::new(0),
            energy_counted: config.energy.is_some(),
            energy_gap: AtomicBool::new(false),
            steps: config
                .step_log
                .map(|capacity| Mutex::new(StepLog::new(capacity))),
        });
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(String, u32), CudaError>>();
        let thread_shared = shared.clone();
        let gpu_index = config.gpu_index;
        let device = config.device;
        let thread = std::thread::Builder::new()
            .name(format!("tokwatt-cuda-serve-{device}"))
            .spawn(move || serve_thread(config, thread_shared, ready_tx))
            .map_err(|e| {
                CudaError::ThreadStopped(format!("the serving thread could not start: {e}"))
            })?;
        match ready_rx.recv() {
            Ok(Ok((gpu_name, slots))) => Ok(CudaServe {
                gpu_index,
                slots,
                budget_max,
                gpu_name,
                shared,
                thread: Some(thread),
            }),
            Ok(Err(error)) => {
                let _ = thread.join();
                Err(error)
            }
            Err(_) => {
                let _ = thread.join();
                Err(CudaError::ThreadStopped(
                    "the serving thread exited before reporting".into(),
                ))
            }
        }
    }

    pub fn gpu_name(&self) -> &str {
        &self.gpu_name
    }

    /// The requests finished since the last call, with their TTFT and TPOT, and how many
    /// were dropped because nobody read them in time.
    pub fn take_finished(&self) -> (Vec<RequestRecord>, u32) {
        let records = std::mem::take(
            &mut *self
                .shared
                .finished
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        (
            records,
            self.shared.dropped_records.swap(0, Ordering::Relaxed),
        )
    }

    /// The steps run since the last call, and how many were dropped because nobody read
    /// them in time; none unless the config asked for a step log.
    pub fn take_steps(&self) -> (Vec<StepRecord>, u64) {
        match &self.shared.steps {
            Some(log) => log.lock().unwrap_or_else(|p| p.into_inner()).take(),
            None => (Vec::new(), 0),
        }
    }

    /// Requests cut to fit a slot's context so far.
    pub fn truncated(&self) -> u64 {
        self.shared
            .scheduler
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .truncated()
    }

    fn check_gpu(&self, gpu: u32) -> Result<(), WorkloadError> {
        if gpu == self.gpu_index {
            Ok(())
        } else {
            Err(WorkloadError::NoSuchGpu {
                index: gpu,
                count: 1,
            })
        }
    }

    fn check_running(&self) -> Result<(), WorkloadError> {
        match self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            Some(reason) => Err(WorkloadError::Failed(reason.clone())),
            None => Ok(()),
        }
    }
}

impl Workload for CudaServe {
    fn name(&self) -> &'static str {
        "cuda-serve"
    }

    /// Each window's queue depth says whether requests wait.
    fn work_waiting(&self) -> WorkWaiting {
        WorkWaiting::Reported
    }

    fn reports_ttft(&self) -> bool {
        true
    }

    fn reports_requests(&self) -> bool {
        true
    }

    /// Times are seconds from when the serving thread started (just before the run's
    /// first tick); energy is unknown (`None`) without an energy counter.
    fn take_finished_requests(&mut self, gpu: u32, into: &mut FinishedRequests) {
        if gpu != self.gpu_index {
            return;
        }
        let (records, dropped) = self.take_finished();
        into.records.extend(records);
        into.dropped += u64::from(dropped);
    }

    fn batch_size_max(&self, gpu: u32) -> u32 {
        if gpu == self.gpu_index { self.slots } else { 0 }
    }

    fn batch_size(&self, gpu: u32) -> u32 {
        if gpu == self.gpu_index {
            self.shared.requested_limit.load(Ordering::Relaxed)
        } else {
            0
        }
    }

    /// The running limit: sequences admitted at once (those running above a lowered limit
    /// finish; none is cut off).
    fn set_batch_size(&mut self, gpu: u32, batch: u32) -> Result<(), WorkloadError> {
        self.check_gpu(gpu)?;
        if !(1..=self.slots).contains(&batch) {
            return Err(WorkloadError::BatchOutOfRange {
                requested: batch,
                max: self.slots,
            });
        }
        self.check_running()?;
        self.shared.requested_limit.store(batch, Ordering::Relaxed);
        Ok(())
    }

    /// 1 to the budget it started with: the engine grows its prompt buffers to a step's
    /// rows on first use, and the start's budget is what its memory was planned for.
    fn token_budget_range(&self, gpu: u32) -> Option<(u32, u32)> {
        (gpu == self.gpu_index).then_some((1, self.budget_max))
    }

    fn token_budget(&self, gpu: u32) -> Option<u32> {
        (gpu == self.gpu_index).then(|| self.shared.requested_budget.load(Ordering::Relaxed))
    }

    /// Taken up before the next step is planned: its prompt chunks fit the new budget (a
    /// step under way finishes as planned).
    fn set_token_budget(&mut self, gpu: u32, tokens: u32) -> Result<(), WorkloadError> {
        self.check_gpu(gpu)?;
        tokwatt_core::workload::check_token_budget(
            self.name(),
            gpu,
            self.token_budget_range(gpu),
            tokens,
        )?;
        self.check_running()?;
        self.shared
            .requested_budget
            .store(tokens, Ordering::Relaxed);
        Ok(())
    }

    fn read_window(&mut self, gpu: u32) -> Result<WorkloadWindow, WorkloadError> {
        self.check_gpu(gpu)?;
        self.check_running()?;
        let mut scheduler = self
            .shared
            .scheduler
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // The window's request energies count only where every step had its energy.
        let gap = self.shared.energy_gap.swap(false, Ordering::Relaxed);
        Ok(scheduler.take_window(self.shared.energy_counted && !gap))
    }
}

impl Drop for CudaServe {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Prompt token ids: any ids do for random weights; these vary with the slot and position.
fn prompt_ids(chunk: &PrefillChunk, vocab: u32, out: &mut Vec<u32>) {
    out.extend(
        (chunk.start..chunk.start + chunk.len).map(|p| {
            (p.wrapping_mul(2_654_435_761) ^ chunk.slot.wrapping_mul(40_503)) % vocab.max(1)
        }),
    );
}

/// The GPU's mean power over the last second, from its cumulative energy counter read at
/// most every 100 ms (NVML refreshes it no faster). A step's energy is its duration times
/// this: an estimate whose sum over the steps follows the counter over busy time.
struct PowerEstimate {
    counter: EnergyCounter,
    /// (seconds since the start, joules), oldest first, spanning about [`Self::SPAN_S`].
    samples: VecDeque<(f64, f64)>,
    last_read_s: f64,
}

impl PowerEstimate {
    const PERIOD_S: f64 = 0.1;
    const SPAN_S: f64 = 1.0;
    /// Shorter than this, two readings may straddle no refresh of the counter.
    const MIN_SPAN_S: f64 = 0.3;

    fn new(counter: EnergyCounter) -> PowerEstimate {
        PowerEstimate {
            counter,
            samples: VecDeque::new(),
            last_read_s: f64::NEG_INFINITY,
        }
    }

    fn update(&mut self, now_s: f64) {
        // (Less a hair: readings a float's rounding short of the period are due.)
        if now_s - self.last_read_s < Self::PERIOD_S - 1e-9 {
            return;
        }
        self.last_read_s = now_s;
        let Some(joules) = (self.counter)().filter(|j| j.is_finite()) else {
            return;
        };
        // A counter that went back (driver reload) starts the estimate over.
        if self.samples.back().is_some_and(|&(_, last)| joules < last) {
            self.samples.clear();
        }
        self.samples.push_back((now_s, joules));
        while self.samples.len() > 2
            && self
                .samples
                .get(1)
                .is_some_and(|&(t, _)| now_s - t >= Self::SPAN_S)
        {
            self.samples.pop_front();
        }
    }

    /// Reads the counter until the readings span [`Self::MIN_SPAN_S`] (at most
    /// [`Self::SPAN_S`]: an unreadable counter is then a counted gap, not a hang), so that
    /// the first step served has its energy.
    fn prime(&mut self, now_s: impl Fn() -> f64) {
        let start = now_s();
        while self.watts().is_none() && now_s() - start < Self::SPAN_S {
            self.update(now_s());
            std::thread::sleep(std::time::Duration::from_secs_f64(Self::PERIOD_S / 4.0));
        }
    }

    /// `None` until the readings span [`Self::MIN_SPAN_S`].
    fn watts(&self) -> Option<f64> {
        let (&(t0, j0), &(t1, j1)) = (self.samples.front()?, self.samples.back()?);
        (t1 - t0 >= Self::MIN_SPAN_S).then(|| (j1 - j0) / (t1 - t0))
    }
}

fn run_plan(engine: &mut Engine, plan: &StepPlan, vocab: u32) -> Result<(), CudaError> {
    let decodes: Vec<DecodeInput> = plan
        .decodes
        .iter()
        .map(|d| DecodeInput {
            slot: d.slot,
            position: d.position,
        })
        .collect();
    let prompts: Vec<PrefillChunk> = plan
        .prompts
        .iter()
        .map(|c| PrefillChunk {
            slot: c.slot,
            start: c.start,
            len: c.len,
            ends_prompt: c.ends_prompt,
        })
        .collect();
    let mut tokens = Vec::with_capacity(prompts.iter().map(|c| c.len as usize).sum());
    for chunk in &prompts {
        prompt_ids(chunk, vocab, &mut tokens);
    }
    engine.serve_step(&decodes, &prompts, &tokens)?;
    engine.synchronize()
}

fn serve_thread(
    mut config: CudaServeConfig,
    shared: Arc<Shared>,
    ready: mpsc::Sender<Result<(String, u32), CudaError>>,
) {
    let mut engine = match Engine::new(
        &config.model,
        config.context,
        config.slots,
        config.device,
        config.engine,
    ) {
        Ok(engine) if engine.batch_max() < config.slots => {
            let _ = ready.send(Err(CudaError::Config(format!(
                "{} slots of {} positions do not fit the GPU's memory with {} (at most {}): lower the slots or the context",
                config.slots,
                config.context,
                config.model.name,
                engine.batch_max()
            ))));
            return;
        }
        Ok(engine) => engine,
        Err(error) => {
            let _ = ready.send(Err(error));
            return;
        }
    };
    if ready
        .send(Ok((engine.gpu_name().to_owned(), engine.batch_max())))
        .is_err()
    {
        return;
    }
    let vocab = config.model.vocab;
    // The estimate keeps its own origin and is read while idle too, so the first step
    // after a start or an idle spell already has the last second of readings.
    let power_origin = Instant::now();
    let power_now = || power_origin.elapsed().as_secs_f64();
    let mut power = config.energy.take().map(PowerEstimate::new);
    if let Some(power) = power.as_mut() {
        power.prime(power_now);
    }
    let started = Instant::now();
    let mut asked_until = 0.0;
    while !shared.stop.load(Ordering::Relaxed) {
        let now = started.elapsed().as_secs_f64();
        let arrivals = config.requests.arrivals(asked_until, now);
        asked_until = now;
        let plan = {
            let mut scheduler = shared.scheduler.lock().unwrap_or_else(|p| p.into_inner());
            scheduler.set_running_limit(shared.requested_limit.load(Ordering::Relaxed));
            scheduler.set_token_budget(shared.requested_budget.load(Ordering::Relaxed));
            for request in arrivals {
                scheduler.arrive(request);
            }
            scheduler.plan(now)
        };
        if plan.is_empty() {
            if let Some(power) = power.as_mut() {
                power.update(power_now());
            }
            std::thread::sleep(IDLE_SLEEP);
            continue;
        }
        let engine_start = started.elapsed().as_secs_f64();
        if let Err(error) = run_plan(&mut engine, &plan, vocab) {
            *shared.failure.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(format!("a serving step failed: {error}"));
            return;
        }
        let end = started.elapsed().as_secs_f64();
        if let Some(log) = &shared.steps {
            let record = StepRecord::of(&plan, now, engine_start, end);
            log.lock().unwrap_or_else(|p| p.into_inner()).push(record);
        }
        let step_j = power.as_mut().and_then(|p| {
            p.update(power_now());
            p.watts().map(|w| w * (end - now))
        });
        if power.is_some() && step_j.is_none() {
            shared.energy_gap.store(true, Ordering::Relaxed);
        }
        let finished = {
            let mut scheduler = shared.scheduler.lock().unwrap_or_else(|p| p.into_inner());
            scheduler.complete(&plan, end, end - now, step_j);
            scheduler.take_finished_records()
        };
        if !finished.is_empty() {
            let mut kept = shared.finished.lock().unwrap_or_else(|p| p.into_inner());
            for record in finished {
                if kept.len() < MAX_KEPT_RECORDS {
                    kept.push(record);
                } else {
                    shared.dropped_records.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

#[cfg(test)]
mod power_tests {
    use super::*;

    fn counter(readings: Vec<Option<f64>>) -> EnergyCounter {
        let mut readings = readings.into_iter();
        Box::new(move || readings.next().flatten())
    }

    #[test]
    fn the_power_is_the_counters_slope_over_the_last_second() {
        // 300 W for the first second, then 500 W.
        let joules = |t: f64| {
            if t <= 1.0 {
                300.0 * t
            } else {
                300.0 + 500.0 * (t - 1.0)
            }
        };
        let times: Vec<f64> = (0..=30).map(|i| f64::from(i) * 0.1).collect();
        let mut power =
            PowerEstimate::new(counter(times.iter().map(|&t| Some(joules(t))).collect()));
        power.update(0.0);
        assert_eq!(power.watts(), None, "one reading has no slope");
        power.update(0.1);
        assert_eq!(
            power.watts(),
            None,
            "0.1 s may straddle no refresh of the counter"
        );
        for &t in &times[2..=10] {
            power.update(t);
        }
        assert!((power.watts().unwrap() - 300.0).abs() < 1e-6);
        for &t in &times[11..] {
            power.update(t);
        }
        // The last second is all at 500 W.
        assert!((power.watts().unwrap() - 500.0).abs() < 1e-6);
    }

    #[test]
    fn reads_faster_than_the_refresh_are_skipped_and_failed_reads_leave_no_zero() {
        let mut power =
            PowerEstimate::new(counter(vec![Some(0.0), None, Some(f64::NAN), Some(200.0)]));
        power.update(0.0);
        // Too soon: the counter is not read (its second reading stays for later).
        power.update(0.05);
        power.update(0.2); // None: skipped
        power.update(0.3); // NaN: skipped
        assert_eq!(power.watts(), None);
        power.update(1.0);
        assert!((power.watts().unwrap() - 200.0).abs() < 1e-9);
    }

    #[test]
    fn a_counter_that_goes_back_starts_the_estimate_over() {
        let mut power = PowerEstimate::new(counter(vec![
            Some(1000.0),
            Some(1100.0),
            Some(1200.0),
            Some(5.0),
        ]));
        for t in [0.0, 0.5, 1.0] {
            power.update(t);
        }
        assert!((power.watts().unwrap() - 200.0).abs() < 1e-9);
        power.update(1.5);
        assert_eq!(power.watts(), None, "a reset leaves one reading");
    }

    /// A clock that moves `step_s` each time it is read.
    fn stepping_clock(step_s: f64) -> impl Fn() -> f64 {
        let now = std::cell::Cell::new(0.0);
        move || {
            let t = now.get();
            now.set(t + step_s);
            t
        }
    }

    #[test]
    fn priming_gives_the_first_step_its_power() {
        let readings = (0..100)
            .map(|i| Some(400.0 * 0.05 * f64::from(i)))
            .collect();
        let mut power = PowerEstimate::new(counter(readings));
        power.prime(stepping_clock(0.05));
        let watts = power.watts().expect("primed");
        assert!(watts > 0.0, "{watts}");
    }

    #[test]
    fn priming_an_unreadable_counter_gives_up_and_leaves_no_power() {
        let mut power = PowerEstimate::new(Box::new(|| None));
        power.prime(stepping_clock(0.05));
        assert_eq!(power.watts(), None);
    }
}
