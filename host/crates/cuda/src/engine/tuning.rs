//! Choosing a batch size's step: every variant that applies is captured into a graph, the
//! graphs are timed in interleaved rounds, and the fastest is kept (or, under
//! [`Tuning::Nearest`], the choice of the nearest batch size already timed is reused).

use cudarc::driver::CudaGraph;
use cudarc::driver::sys as cu;

use super::{
    AttentionChoice, Engine, GraphInfo, MatmulChoice, MatmulPath, StepGraph, StepVariant, Tuning,
};
use crate::device::AttentionImpl;
use crate::error::CudaError;
use crate::plan::{AttentionSplit, GEMV_MAX_BATCH};
use tokwatt_core::quantile::nearest_rank;

/// Timing of candidate graphs: warm-up replays each, then rounds that visit every candidate in
/// turn (so a drifting clock or temperature favours none), `TUNE_REPLAYS_PER_ROUND` replays per
/// visit; each candidate's median visit decides.
const TUNE_WARMUP_REPLAYS: usize = 2;
const TUNE_ROUNDS: usize = 5;
const TUNE_REPLAYS_PER_ROUND: usize = 2;

impl Engine {
    /// The step variants that apply to `batch` under the options.
    pub(super) fn candidates(&self, batch: u32) -> Vec<StepVariant> {
        let gemv_fits = batch <= GEMV_MAX_BATCH;
        let paths = match self.options.matmul {
            MatmulChoice::Auto if gemv_fits => vec![MatmulPath::Gemv, MatmulPath::Cublas],
            MatmulChoice::Gemv if gemv_fits => vec![MatmulPath::Gemv],
            _ => vec![MatmulPath::Cublas],
        };
        let only;
        let attentions: &[AttentionImpl] = match self.options.attention {
            AttentionChoice::Auto => &AttentionImpl::ALL,
            AttentionChoice::Only(implementation) => {
                only = [implementation];
                &only
            }
        };
        paths
            .iter()
            .flat_map(|&path| {
                attentions
                    .iter()
                    .map(move |&attention| StepVariant { path, attention })
            })
            .collect()
    }

    /// Captures one step of `batch` built as `variant` into a graph.
    fn capture(
        &mut self,
        batch: u32,
        variant: StepVariant,
        split: AttentionSplit,
    ) -> Result<CudaGraph, CudaError> {
        self.gpu.bind()?;
        self.gpu
            .stream
            .begin_capture(cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| CudaError::driver("cuStreamBeginCapture", e))?;
        let enqueued = self.enqueue_step(batch, variant, split);
        // End the capture whatever happened, so the stream leaves capture mode.
        let ended = self.gpu.stream.end_capture(cu::CUgraphInstantiate_flags(0));
        enqueued?;
        ended
            .map_err(|e| CudaError::driver("cuStreamEndCapture/cuGraphInstantiate", e))?
            .ok_or_else(|| CudaError::Driver {
                call: "cuStreamEndCapture",
                reason: "the capture produced no graph".into(),
            })
    }

    /// Captures a graph and replays it once, so that a variant the driver refuses fails here.
    pub(super) fn capture_checked(
        &mut self,
        batch: u32,
        variant: StepVariant,
        split: AttentionSplit,
    ) -> Result<CudaGraph, CudaError> {
        let graph = self.capture(batch, variant, split)?;
        graph
            .launch()
            .map_err(|e| CudaError::driver("cuGraphLaunch", e))?;
        self.gpu.synchronize()?;
        Ok(graph)
    }

    /// Median replay time of each graph, ms, visiting them in turn (see `TUNE_ROUNDS`).
    pub(super) fn time_graphs(&self, graphs: &[&CudaGraph]) -> Result<Vec<f64>, CudaError> {
        let launch = |graph: &CudaGraph| {
            graph
                .launch()
                .map_err(|e| CudaError::driver("cuGraphLaunch", e))
        };
        for graph in graphs {
            for _ in 0..TUNE_WARMUP_REPLAYS {
                launch(graph)?;
            }
        }
        let start = self.new_event()?;
        let end = self.new_event()?;
        let mut samples = vec![Vec::with_capacity(TUNE_ROUNDS); graphs.len()];
        for _ in 0..TUNE_ROUNDS {
            for (graph, samples) in graphs.iter().zip(&mut samples) {
                start
                    .record(&self.gpu.stream)
                    .map_err(|e| CudaError::driver("cuEventRecord", e))?;
                for _ in 0..TUNE_REPLAYS_PER_ROUND {
                    launch(graph)?;
                }
                end.record(&self.gpu.stream)
                    .map_err(|e| CudaError::driver("cuEventRecord", e))?;
                let ms = start
                    .elapsed_ms(&end)
                    .map_err(|e| CudaError::driver("cuEventElapsedTime", e))?;
                samples.push(f64::from(ms) / TUNE_REPLAYS_PER_ROUND as f64);
            }
        }
        // TUNE_ROUNDS > 0, so every graph has samples; an empty set would rank last.
        Ok(samples
            .iter_mut()
            .map(|s| nearest_rank(s, 0.50).unwrap_or(f64::INFINITY))
            .collect())
    }

    /// Builds the graph for `batch` if it does not exist yet: captures every applicable step
    /// variant, times them when there is a choice, and keeps the fastest. Waits for steps in
    /// flight.
    pub fn prepare(&mut self, batch: u32) -> Result<&GraphInfo, CudaError> {
        self.check_batch(batch)?;
        if !self.graphs.contains_key(&batch) {
            self.settle()?;
            let split = AttentionSplit::plan(&self.shape, batch, self.context, self.gpu.sms);
            let inherited = match self.options.tuning {
                Tuning::Nearest => self.nearest_choice(batch),
                Tuning::EveryBatch => None,
            };
            let variants = match inherited {
                Some((_, variant)) => vec![variant],
                None => self.candidates(batch),
            };
            let mut captured = Vec::with_capacity(variants.len());
            for variant in variants {
                captured.push((variant, self.capture_checked(batch, variant, split)?));
            }
            let chosen_for = inherited.map(|(timed, _)| timed);
            let timings = if captured.len() > 1 {
                let graphs: Vec<&CudaGraph> = captured.iter().map(|(_, g)| g).collect();
                self.time_graphs(&graphs)?
            } else {
                vec![0.0; captured.len()]
            };
            let candidates_ms: Vec<(StepVariant, f64)> = if captured.len() > 1 {
                captured
                    .iter()
                    .map(|(v, _)| *v)
                    .zip(timings.iter().copied())
                    .collect()
            } else {
                Vec::new()
            };
            let fastest = timings
                .iter()
                .enumerate()
                .min_by(|a, b| a.1.total_cmp(b.1))
                .map(|(index, _)| index);
            let Some(fastest) = fastest else {
                return Err(CudaError::Config(format!(
                    "no step variant applies to batch {batch}"
                )));
            };
            let (variant, graph) = captured.swap_remove(fastest);
            let info = GraphInfo {
                variant,
                attention: split,
                candidates_ms,
                chosen_for,
            };
            self.graphs.insert(batch, StepGraph { graph, info });
        }
        self.graphs
            .get(&batch)
            .map(|g| &g.info)
            .ok_or_else(|| CudaError::Config(format!("the graph of batch {batch} is missing")))
    }

    /// The variant chosen by timing for the batch size nearest `batch` (by ratio) among those
    /// whose variant applies to `batch`, with that batch size.
    fn nearest_choice(&self, batch: u32) -> Option<(u32, StepVariant)> {
        let candidates = self.candidates(batch);
        let distance = |timed: u32| (f64::from(timed) / f64::from(batch)).ln().abs();
        self.graphs
            .iter()
            .filter(|(_, g)| g.info.chosen_for.is_none() && candidates.contains(&g.info.variant))
            .map(|(&timed, g)| (timed, g.info.variant))
            .min_by(|a, b| distance(a.0).total_cmp(&distance(b.0)).then(a.0.cmp(&b.0)))
    }
}
