//! Where a run happens: the simulator or real GPUs, and where the tokens come from. Shared
//! by `tokwatt run`, `tokwatt ab` and `tokwatt tune` (flattened into each one's flags).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use tokwatt_agent::assembly::{BackendRequest, GpuTarget, SimTarget, Target, WorkloadSource};
use tokwatt_core::types::Objective;
use tokwatt_engines::prometheus::Engine;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadKind {
    Cuda,
    External,
}

#[derive(Debug, clap::Args)]
pub struct TargetArgs {
    /// Run on the simulated GPU with this profile (built-in: h200, h100, a100; or a profile file).
    #[arg(long, value_name = "PROFILE")]
    pub sim: Option<String>,
    /// Number of simulated GPUs.
    #[arg(long, default_value_t = 1, requires = "sim")]
    pub gpus: u32,
    /// Demand scenario file: the simulator's work (default: the built-in phased scenario);
    /// with --gpu, the requests tokwatt's CUDA engine serves (arrivals, prompts, outputs,
    /// model and token budget) instead of a fixed decode.
    #[arg(long)]
    pub scenario: Option<PathBuf>,
    /// Run the simulator against the wall clock instead of the virtual clock.
    #[arg(long, requires = "sim")]
    pub realtime: bool,
    /// Run on these real GPUs (NVML indices, comma-separated).
    #[arg(long, value_delimiter = ',', conflicts_with = "sim")]
    pub gpu: Option<Vec<u32>>,
    /// Observe only: log every GPU setting decision and change nothing (the batch size,
    /// the workload's own knob, still changes).
    #[arg(long, requires = "gpu")]
    pub dry_run: bool,
    /// Let the policy change only the batch size (for running without privileges).
    #[arg(long)]
    pub batch_only: bool,
    /// Where the tokens come from on a real GPU: `cuda` (tokwatt's own decode workload)
    /// or `external` (a running server's Prometheus metrics, see --metrics-url and --engine).
    /// With --sim (`tokwatt run` only), `external` reads an engine's tokens beside a simulated
    /// GPU's power, on the wall clock: for trying the metrics on a machine without a GPU.
    #[arg(long, value_enum, default_value_t = WorkloadKind::Cuda)]
    pub workload: WorkloadKind,
    /// The serving engine's metrics endpoint, for `--workload external`
    /// (http://HOST:PORT/metrics, IPv6 as http://[::1]:PORT/metrics).
    #[arg(long, required_if_eq("workload", "external"))]
    pub metrics_url: Option<String>,
    /// The serving engine behind --metrics-url, whose metric names to read: vllm, sglang,
    /// tgi, triton or llamacpp (triton and llamacpp have no TPOT histogram).
    #[arg(long, default_value = "vllm", value_parser = clap::value_parser!(Engine))]
    pub engine: Engine,
    /// Counter of generated tokens at --metrics-url, summed over its series (default: the
    /// --engine preset's).
    #[arg(long)]
    pub token_counter: Option<String>,
    /// Histogram of time per output token (seconds) at --metrics-url, merged over its
    /// series (default: the --engine preset's); "" for none.
    #[arg(long)]
    pub tpot_histogram: Option<String>,
    /// Histogram of time to first token (seconds) at --metrics-url, merged over its series
    /// (default: the --engine preset's, vllm and sglang); "" for none. A TTFT bound needs it
    /// (tgi, triton and llamacpp export none).
    #[arg(long)]
    pub ttft_histogram: Option<String>,
    /// Counter of prompt tokens at --metrics-url, summed over its series (default: the
    /// --engine preset's), read with --ttft-histogram.
    #[arg(long)]
    pub prompt_counter: Option<String>,
    /// CUDA workload model preset (llama-3-8b, llama-3.2-1b) or a model shape file.
    /// (Default: llama-3-8b; serving a --scenario, the scenario names the model.)
    #[arg(long, requires = "gpu")]
    pub model: Option<String>,
    /// CUDA workload KV context length, tokens (default: 1024; serving a --scenario, its
    /// longest request).
    #[arg(long, requires = "gpu")]
    pub context: Option<u32>,
    /// CUDA workload largest batch size, the KV slots (buffers are sized for it; default:
    /// 512; serving a --scenario, its batch_size_max).
    #[arg(long, requires = "gpu")]
    pub batch_size_max: Option<u32>,
    /// State file of original GPU settings (default for real GPUs: /var/lib/tokwatt/state.json
    /// as root, else $XDG_STATE_HOME/tokwatt/state.json). With --sim, only used when given.
    #[arg(long)]
    pub state_file: Option<PathBuf>,
}

impl TargetArgs {
    /// The external token source: the --engine preset, with --token-counter and
    /// --tpot-histogram overriding its names. A TPOT objective needs a TPOT histogram.
    pub fn external_source(&self, objective: &Objective) -> Result<WorkloadSource> {
        let url = self
            .metrics_url
            .clone()
            .context("--workload external needs --metrics-url")?;
        let token_counter = self
            .token_counter
            .clone()
            .unwrap_or_else(|| self.engine.token_counter().to_owned());
        let tpot_histogram = match &self.tpot_histogram {
            Some(name) if name.is_empty() => None,
            Some(name) => Some(name.clone()),
            None => self.engine.tpot_histogram().map(str::to_owned),
        };
        if tpot_histogram.is_none()
            && let Some(limit) = objective.tpot_p99_limit_ms
        {
            bail!(
                "the policy's objective bounds the p99 TPOT at {limit} ms, but {} tokwatt reads no TPOT histogram for --engine {}: name one with --tpot-histogram, or drop tpot_p99_limit_ms from the spec's objective",
                if self.tpot_histogram.is_some() {
                    "with --tpot-histogram \"\""
                } else {
                    "the engine exports none, so"
                },
                self.engine.name()
            );
        }
        // Read where the objective bounds TTFT or a histogram is named: an engine's own
        // deployment may lack the preset's, and nothing else needs it.
        let request_metrics =
            if objective.ttft_p99_limit_ms.is_some() || self.ttft_histogram.is_some() {
                tokwatt_engines::prometheus::request_metrics(
                    self.engine,
                    self.ttft_histogram.clone(),
                    self.prompt_counter.clone(),
                )
                .map_err(anyhow::Error::msg)?
            } else {
                None
            };
        if request_metrics.is_none()
            && let Some(limit) = objective.ttft_p99_limit_ms
        {
            bail!(
                "the policy's objective bounds the p99 time to first token at {limit} ms, but tokwatt reads no TTFT histogram for --engine {}: name one with --ttft-histogram (and --prompt-counter), or drop ttft_p99_limit_ms from the spec's objective",
                self.engine.name()
            );
        }
        Ok(WorkloadSource::External {
            url,
            token_counter,
            tpot_histogram,
            request_metrics,
        })
    }

    pub fn backend_request(
        &self,
        objective: &Objective,
        tick: Duration,
        seed: u64,
    ) -> Result<BackendRequest> {
        if self.sim.is_some() && self.workload == WorkloadKind::External {
            bail!(
                "--workload external beside --sim is read by `tokwatt run` only: compare on a real GPU (--gpu), or drop --workload external to compare on the simulator's own tokens"
            );
        }
        self.request(objective, tick, seed)
    }

    /// [`Self::backend_request`], and the serving engine whose tokens replace the
    /// simulator's where --workload external stands beside --sim (`tokwatt run`).
    pub fn backend_request_with_engine(
        &self,
        objective: &Objective,
        tick: Duration,
        seed: u64,
    ) -> Result<(BackendRequest, Option<WorkloadSource>)> {
        let engine_beside_sim = match (&self.sim, self.workload) {
            (Some(_), WorkloadKind::External) => Some(self.external_source(objective)?),
            _ => None,
        };
        Ok((self.request(objective, tick, seed)?, engine_beside_sim))
    }

    fn request(&self, objective: &Objective, tick: Duration, seed: u64) -> Result<BackendRequest> {
        if self.sim.is_none() && self.gpu.is_none() && self.workload == WorkloadKind::External {
            bail!(
                "--workload external reads a serving engine's tokens for a GPU: add `--gpu 0` (a real GPU; --dry-run to observe only) or `--sim h200` (a simulated one)"
            );
        }
        let target = match (&self.sim, &self.gpu) {
            (Some(profile), None) => Target::Sim(SimTarget {
                profile: profile.clone(),
                scenario: self.scenario.clone(),
                gpus: self.gpus,
                realtime: self.realtime,
                driver: None,
            }),
            (None, Some(indices)) => Target::Gpu(GpuTarget {
                indices: indices.clone(),
                dry_run: self.dry_run,
                workload: match (self.workload, &self.scenario) {
                    (WorkloadKind::Cuda, None) => WorkloadSource::Cuda {
                        model: self.model.clone().unwrap_or_else(|| "llama-3-8b".into()),
                        context: self.context.unwrap_or(1024),
                        batch_size_max: self.batch_size_max.unwrap_or(512),
                    },
                    (WorkloadKind::Cuda, Some(scenario)) if self.model.is_some() => bail!(
                        "--scenario {} names the model its requests run on: drop --model (or set the scenario's `model`)",
                        scenario.display()
                    ),
                    (WorkloadKind::Cuda, Some(scenario)) => WorkloadSource::CudaServe {
                        scenario: scenario.clone(),
                        context: self.context,
                        slots: self.batch_size_max,
                        seed,
                    },
                    (WorkloadKind::External, Some(_)) => bail!(
                        "--scenario gives the requests tokwatt's own CUDA engine serves; with --workload external the engine at --metrics-url serves its own: drop --scenario"
                    ),
                    (WorkloadKind::External, None) => self.external_source(objective)?,
                },
                tick,
            }),
            _ => bail!(
                "choose where to run: `--sim h200` for the simulated GPU, or `--gpu 0` for a real GPU (add --dry-run to observe only)"
            ),
        };
        Ok(BackendRequest {
            target,
            seed,
            batch_only: self.batch_only,
        })
    }
}
