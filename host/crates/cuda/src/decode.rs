//! [`CudaDecode`]: the decode engine stepping continuously on a thread of its own, behind the
//! [`Workload`] trait.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;

use super::engine::{Engine, EngineOptions, StepDone, Tuning};
use super::error::CudaError;
use super::shape::ModelShape;
use tokwatt_core::quantile::nearest_rank;
use tokwatt_core::types::WorkloadWindow;
use tokwatt_core::workload::{Workload, WorkloadError};

/// Step times kept per window for the latency percentiles; steps beyond it still count tokens.
const MAX_SAMPLES_PER_WINDOW: usize = 1 << 16;

/// Steps kept in flight: one running, one queued behind it, so the GPU never waits for the host.
const STEPS_IN_FLIGHT: usize = 2;

/// What to run.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaDecodeConfig {
    pub model: ModelShape,
    /// KV-cache positions each sequence attends over at every step.
    pub context: u32,
    /// Buffers are allocated once for this many sequences (fewer if the GPU's memory holds
    /// fewer: see [`tokwatt_core::model::max_batch_that_fits`]).
    pub batch_size_max: u32,
    /// Batch size of the first steps.
    pub batch_size: u32,
    /// CUDA device ordinal to run on.
    pub device: u32,
    /// The GPU index the agent uses for this GPU (the `gpu` argument of [`Workload`] calls).
    pub gpu_index: u32,
    pub engine: EngineOptions,
}

impl CudaDecodeConfig {
    /// A preset model on device 0 at the given context and batch sizes.
    pub fn new(model: ModelShape, context: u32, batch_size_max: u32) -> CudaDecodeConfig {
        CudaDecodeConfig {
            model,
            context,
            batch_size_max,
            batch_size: 1,
            device: 0,
            gpu_index: 0,
            // A policy moves the batch size while tokens are counted: a new size takes the
            // nearest timed size's variant instead of stalling for a full tuning.
            engine: EngineOptions {
                tuning: Tuning::Nearest,
                ..EngineOptions::default()
            },
        }
    }
}

/// What the decode thread shares with the agent.
#[derive(Debug)]
struct Shared {
    requested_batch: AtomicU32,
    stop: AtomicBool,
    window: Mutex<Window>,
    failure: Mutex<Option<String>>,
}

#[derive(Debug, Default)]
struct Window {
    tokens: u64,
    steps: u64,
    step_ms: Vec<f64>,
    last_batch: u32,
}

impl Window {
    fn record(&mut self, done: StepDone) {
        self.tokens += u64::from(done.batch);
        self.steps += 1;
        self.last_batch = done.batch;
        if self.step_ms.len() < MAX_SAMPLES_PER_WINDOW {
            self.step_ms.push(done.gpu_ms);
        }
    }

    /// Closes the window: its summary, and a fresh window in its place.
    fn take(&mut self, active_batch: u32) -> WorkloadWindow {
        let mut step_ms = std::mem::take(&mut self.step_ms);
        let window = WorkloadWindow {
            tokens: self.tokens,
            steps: self.steps,
            // No step in the window (a stall, e.g. building a new batch size's graphs):
            // the latency is unknown, not zero.
            tpot_p50_ms: nearest_rank(&mut step_ms, 0.50).unwrap_or(f64::NAN),
            tpot_p99_ms: nearest_rank(&mut step_ms, 0.99).unwrap_or(f64::NAN),
            active_sequences: active_batch,
            queue_depth: 0,
            batch_size: active_batch,
            // A closed loop: the benchmark makes its own work, nothing arrives.
            demand: None,
            // Decode only: no prompts, no requests seen through.
            requests: None,
        };
        self.tokens = 0;
        self.steps = 0;
        step_ms.clear();
        self.step_ms = step_ms;
        window
    }
}

/// Llama-shaped greedy decoding with random weights on one GPU, stepping continuously on a
/// thread of its own. A batch change takes effect at the next step; dropping it stops the thread.
/// The first step at a batch size not seen before builds and times that size's graphs (up to
/// about two seconds at batch 512); later changes to it are immediate.
#[derive(Debug)]
pub struct CudaDecode {
    gpu_index: u32,
    batch_max: u32,
    gpu_name: String,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl CudaDecode {
    /// Starts the decode thread: opens the GPU, allocates and fills everything, builds the
    /// graph of the first batch size, and only then returns. Errors (no driver, no GPU, out
    /// of memory, compile failure) come back from here.
    pub fn new(config: CudaDecodeConfig) -> Result<CudaDecode, CudaError> {
        super::engine::validate(&config.model, config.context, config.batch_size_max)?;
        if !(1..=config.batch_size_max).contains(&config.batch_size) {
            return Err(CudaError::Config(format!(
                "batch size {} is out of range: use 1 to the maximum, {}",
                config.batch_size, config.batch_size_max
            )));
        }
        let shared = Arc::new(Shared {
            requested_batch: AtomicU32::new(config.batch_size),
            stop: AtomicBool::new(false),
            window: Mutex::new(Window::default()),
            failure: Mutex::new(None),
        });
        // The engine reports the GPU's name and the batch maximum it allocated (lower than asked
        // when the memory does not hold that many sequences).
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(String, u32), CudaError>>();
        let thread_shared = shared.clone();
        let thread_config = config.clone();
        let thread = std::thread::Builder::new()
            .name(format!("tokwatt-cuda-decode-{}", config.device))
            .spawn(move || decode_thread(thread_config, thread_shared, ready_tx))
            .map_err(|e| {
                CudaError::ThreadStopped(format!("the decode thread could not start: {e}"))
            })?;
        match ready_rx.recv() {
            Ok(Ok((gpu_name, batch_max))) => Ok(CudaDecode {
                gpu_index: config.gpu_index,
                batch_max,
                gpu_name,
                shared,
                thread: Some(thread),
            }),
            Ok(Err(error)) => {
                let _ = thread.join();
                Err(error)
            }
            Err(_) => {
                let reason = match thread.join() {
                    Err(panic) => panic_text(&panic),
                    Ok(()) => "it exited before reporting".to_owned(),
                };
                Err(CudaError::ThreadStopped(reason))
            }
        }
    }

    /// The GPU's name, as the driver reports it.
    pub fn gpu_name(&self) -> &str {
        &self.gpu_name
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
        let failure = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match failure.as_ref() {
            Some(reason) => Err(WorkloadError::Failed(reason.clone())),
            None => Ok(()),
        }
    }
}

impl Workload for CudaDecode {
    fn name(&self) -> &'static str {
        "cuda-decode"
    }

    /// A closed loop: the decode always has its next step to run.
    fn work_waiting(&self) -> tokwatt_core::workload::WorkWaiting {
        tokwatt_core::workload::WorkWaiting::Always
    }

    /// The maximum on this workload's GPU; 0 for any other index.
    fn batch_size_max(&self, gpu: u32) -> u32 {
        if gpu == self.gpu_index {
            self.batch_max
        } else {
            0
        }
    }

    /// The batch size in force from the next step on; 0 for any other index.
    fn batch_size(&self, gpu: u32) -> u32 {
        if gpu == self.gpu_index {
            self.shared.requested_batch.load(Ordering::Relaxed)
        } else {
            0
        }
    }

    fn set_batch_size(&mut self, gpu: u32, batch: u32) -> Result<(), WorkloadError> {
        self.check_gpu(gpu)?;
        if !(1..=self.batch_max).contains(&batch) {
            return Err(WorkloadError::BatchOutOfRange {
                requested: batch,
                max: self.batch_max,
            });
        }
        self.check_running()?;
        self.shared.requested_batch.store(batch, Ordering::Relaxed);
        Ok(())
    }

    fn read_window(&mut self, gpu: u32) -> Result<WorkloadWindow, WorkloadError> {
        self.check_gpu(gpu)?;
        self.check_running()?;
        let mut window = self.shared.window.lock().unwrap_or_else(|p| p.into_inner());
        let active = if window.steps > 0 {
            window.last_batch
        } else {
            self.shared.requested_batch.load(Ordering::Relaxed)
        };
        Ok(window.take(active))
    }
}

impl Drop for CudaDecode {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            // A panic in the thread has been recorded as a failure already; nothing to add.
            let _ = thread.join();
        }
    }
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "it panicked".to_owned())
}

fn decode_thread(
    config: CudaDecodeConfig,
    shared: Arc<Shared>,
    ready: mpsc::Sender<Result<(String, u32), CudaError>>,
) {
    let started = Engine::new(
        &config.model,
        config.context,
        config.batch_size_max,
        config.device,
        config.engine,
    )
    .and_then(|mut engine| {
        let batch = config.batch_size.min(engine.batch_max());
        shared.requested_batch.store(batch, Ordering::Relaxed);
        engine.prepare(batch)?;
        Ok(engine)
    });
    let mut engine = match started {
        Ok(engine) => {
            // The receiver only goes away if `new` is gone; then nobody needs the steps.
            let started = (engine.gpu_name().to_owned(), engine.batch_max());
            if ready.send(Ok(started)).is_err() {
                return;
            }
            engine
        }
        Err(error) => {
            let _ = ready.send(Err(error));
            return;
        }
    };
    if let Err(error) = run_steps(&mut engine, &shared) {
        tracing::error!(%error, "the CUDA decode loop stopped");
        *shared.failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(error.to_string());
    }
}

/// Steps until asked to stop, keeping [`STEPS_IN_FLIGHT`] steps queued on the GPU.
fn run_steps(engine: &mut Engine, shared: &Shared) -> Result<(), CudaError> {
    while !shared.stop.load(Ordering::Relaxed) {
        let batch = shared.requested_batch.load(Ordering::Relaxed);
        engine.launch_step(batch)?;
        while engine.in_flight() >= STEPS_IN_FLIGHT {
            if let Some(done) = engine.wait_oldest()? {
                shared
                    .window
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .record(done);
            }
        }
    }
    for done in engine.drain()? {
        shared
            .window
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .record(done);
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    #[test]
    fn a_window_counts_tokens_and_takes_percentiles_then_starts_afresh() {
        let mut window = Window::default();
        for (batch, ms) in [(4, 5.0), (4, 6.0), (8, 7.0), (8, 100.0)] {
            window.record(StepDone { batch, gpu_ms: ms });
        }
        let w = window.take(8);
        assert_eq!((w.tokens, w.steps), (24, 4));
        assert_eq!(w.tpot_p50_ms, 6.0);
        assert_eq!(w.tpot_p99_ms, 100.0);
        assert_eq!((w.active_sequences, w.batch_size, w.queue_depth), (8, 8, 0));
        let empty = window.take(8);
        assert_eq!((empty.tokens, empty.steps), (0, 0));
        // No step: the latency is unknown, never a zero that meets any bound.
        assert!(empty.tpot_p50_ms.is_nan() && empty.tpot_p99_ms.is_nan());
    }

    #[test]
    fn samples_are_capped_but_tokens_are_not() {
        let mut window = Window::default();
        for _ in 0..MAX_SAMPLES_PER_WINDOW + 10 {
            window.record(StepDone {
                batch: 2,
                gpu_ms: 1.0,
            });
        }
        assert_eq!(window.step_ms.len(), MAX_SAMPLES_PER_WINDOW);
        let w = window.take(2);
        assert_eq!(w.steps, MAX_SAMPLES_PER_WINDOW as u64 + 10);
        assert_eq!(w.tokens, 2 * w.steps);
    }

    #[test]
    fn configuration_errors_come_before_any_gpu_work() {
        let model = ModelShape::preset("llama-3.2-1b").unwrap();
        let mut config = CudaDecodeConfig::new(model.clone(), 1024, 8);
        config.batch_size = 9;
        let err = CudaDecode::new(config).unwrap_err().to_string();
        assert!(err.contains("batch size 9 is out of range"), "{err}");
        let err = CudaDecode::new(CudaDecodeConfig::new(model.clone(), 0, 8))
            .unwrap_err()
            .to_string();
        assert!(err.contains("context length 0"), "{err}");
        let err = CudaDecode::new(CudaDecodeConfig::new(model, 1024, 0))
            .unwrap_err()
            .to_string();
        assert!(err.contains("batch size maximum 0"), "{err}");
    }
}
