//! The kernel lab: timings for work on the CUDA decode kernels, kept out of the product. Built
//! only with the `lab` feature:
//!
//! ```sh
//! cargo build --release -p tokwatt --features lab --bin kernel-lab
//! kernel-lab parts --batches 1,8        # each launch kind of a step alone: µs and TB/s
//! kernel-lab bench --matmul cublas --attention tensor-cores --batches 1,4
//! kernel-lab pause                      # the stall of a new batch size, per tuning mode
//! ```
//!
//! Compare variants within one call: a lent GPU changes between calls. What was measured with
//! it on the H200 is in `docs/kernel-experiments.md`. For the product's own figures use
//! `tokwatt bench workload`.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use tokwatt_core::model::ModelShape;
use tokwatt_cuda::engine::Engine;
use tokwatt_cuda::{
    AttentionChoice, AttentionImpl, BenchConfig, EngineOptions, MatmulChoice, Tuning, bench_with,
    format_table,
};

#[derive(Debug, Parser)]
#[command(about = "Kernel timings for work on tokwatt's CUDA decode kernels")]
struct Lab {
    /// A model preset's name or a model file's path.
    #[arg(long, default_value = "llama-3-8b", global = true)]
    model: String,
    #[arg(long, default_value_t = 1024, global = true)]
    context: u32,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0, global = true)]
    device: u32,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Each launch kind of a step on its own (attention implementations and split counts,
    /// matrix-vector and cuBLAS products, a device copy for scale): µs per launch and TB/s.
    Parts {
        #[arg(long, value_delimiter = ',', default_value = "1,8,16,64,512")]
        batches: Vec<u32>,
    },
    /// Whole steps per batch size with every candidate variant's time, the choices forced or not.
    Bench {
        #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,128,256,512")]
        batches: Vec<u32>,
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        #[arg(long, value_enum, default_value_t = Matmul::Auto)]
        matmul: Matmul,
        /// `auto`, or one implementation: cuda-cores, tensor-cores, tensor-scores.
        #[arg(long, default_value = "auto")]
        attention: String,
    },
    /// The stall of `prepare` for batch sizes not seen before, after batch 1 was tuned, under
    /// each tuning mode.
    Pause,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Matmul {
    Auto,
    Gemv,
    Cublas,
}

fn main() -> Result<()> {
    let lab = Lab::parse();
    let model = ModelShape::load(&lab.model)?;
    match lab.command {
        Command::Parts { batches } => parts(&model, lab.context, lab.device, &batches),
        Command::Bench {
            batches,
            seconds,
            matmul,
            attention,
        } => {
            let mut config = BenchConfig::new(model, lab.context, batches, seconds);
            config.device = lab.device;
            config.engine.matmul = match matmul {
                Matmul::Auto => MatmulChoice::Auto,
                Matmul::Gemv => MatmulChoice::Gemv,
                Matmul::Cublas => MatmulChoice::Cublas,
            };
            config.engine.attention = match attention.as_str() {
                "auto" => AttentionChoice::Auto,
                name => match AttentionImpl::from_name(name) {
                    Some(implementation) => AttentionChoice::Only(implementation),
                    None => bail!(
                        "unknown attention '{name}': use auto, cuda-cores, tensor-cores or tensor-scores"
                    ),
                },
            };
            let rows = bench_with(&config, &mut || None, &mut |row| {
                let candidates: Vec<String> = row
                    .candidates_ms
                    .iter()
                    .map(|(label, ms)| format!("{label} {ms:.3}"))
                    .collect();
                println!(
                    "batch {:<4} candidates ms: {}",
                    row.batch,
                    candidates.join("  ")
                );
            })?;
            print!("{}", format_table(&rows, &|_| None));
            Ok(())
        }
        Command::Pause => pause(&model, lab.context, lab.device),
    }
}

fn parts(model: &ModelShape, context: u32, device: u32, batches: &[u32]) -> Result<()> {
    let batch_max = batches.iter().copied().max().context("no batch sizes")?;
    let mut engine = Engine::new(model, context, batch_max, device, EngineOptions::default())?;
    println!("{} on {} ctx {context}", model.name, engine.gpu_name());
    for &batch in batches {
        for part in engine.profile_parts(batch)? {
            println!(
                "part batch {batch:<4} {:<40} {:>10.2} us {:>8.3} TB/s",
                part.name,
                part.micros,
                part.bytes as f64 / part.micros / 1e6
            );
        }
    }
    Ok(())
}

fn pause(model: &ModelShape, context: u32, device: u32) -> Result<()> {
    for tuning in [Tuning::EveryBatch, Tuning::Nearest] {
        let options = EngineOptions {
            tuning,
            ..EngineOptions::default()
        };
        let mut engine = Engine::new(model, context, 256, device, options)?;
        engine.prepare(1)?;
        let mut pauses = Vec::new();
        for batch in [2u32, 3, 5, 9, 17, 33, 65, 129, 256] {
            let started = Instant::now();
            engine.prepare(batch)?;
            pauses.push(started.elapsed().as_secs_f64() * 1e3);
        }
        pauses.sort_by(f64::total_cmp);
        println!(
            "pause {tuning:?}: median {:.1} ms, max {:.1} ms over {} new batch sizes",
            pauses[pauses.len() / 2],
            pauses[pauses.len() - 1],
            pauses.len()
        );
    }
    Ok(())
}
