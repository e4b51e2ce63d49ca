//! `tokwatt bench serve-api`: tick lateness idle and under API load, side by side.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};

use tokwatt_serve::serve::bench::{self, LatenessRun};

pub fn bench_serve_api(
    duration: Duration,
    rate: f64,
    gpus: u32,
    tick: Duration,
    policy: Option<PathBuf>,
    repeats: u32,
) -> Result<()> {
    let policy = policy.map_or_else(|| crate::bench::default_policy("slo-batch.toml"), Ok)?;
    // The benchmark's config lives in a scratch folder: a relative path would be read
    // against that folder.
    let policy = std::path::absolute(&policy)
        .with_context(|| format!("the policy spec {}", policy.display()))?;
    let scratch = tempfile::tempdir().context("a scratch folder for the benchmark")?;
    let config = bench::bench_config(scratch.path(), &policy, gpus, tick)?;
    eprintln!(
        "SIMULATOR: {gpus} simulated H200s in real time, tick {}, {} per run; idle vs {rate:.0} status requests/s on loopback HTTP; {repeats} repeat(s)",
        humantime::format_duration(tick),
        humantime::format_duration(duration)
    );
    let mut idle = Vec::new();
    let mut loaded = Vec::new();
    for repeat in 0..repeats.max(1) {
        for load in [0.0, rate] {
            let dir = scratch.path().join(format!("run-{repeat}-{load}"));
            std::fs::create_dir_all(&dir).context("a run folder")?;
            let run = bench::serve_under_load(&config, &dir, duration, load)?;
            print_run(&run);
            if load > 0.0 {
                loaded.push(run);
            } else {
                idle.push(run);
            }
        }
    }
    let median = |runs: &[LatenessRun], f: fn(&LatenessRun) -> f64| {
        let mut values: Vec<f64> = runs.iter().map(f).collect();
        values.sort_by(f64::total_cmp);
        values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let idle_p99 = median(&idle, |r| r.lateness_p99_ms);
    let loaded_p99 = median(&loaded, |r| r.lateness_p99_ms);
    println!(
        "tick lateness p99 (median of runs): idle {idle_p99:.3} ms, under load {loaded_p99:.3} ms ({:.2}x; tick {} ms)",
        loaded_p99 / idle_p99,
        tick.as_millis()
    );
    Ok(())
}

fn print_run(run: &LatenessRun) {
    let load = match &run.load {
        Some(load) => format!(
            "load {:.0}/s asked, {:.0}/s done, {} errors, request p50 {} ms p99 {} ms",
            run.load_per_s,
            load.ok as f64 / load.duration_s.max(f64::EPSILON),
            load.errors,
            load.latency_p50_ms
                .map_or("-".into(), |v| format!("{v:.2}")),
            load.latency_p99_ms
                .map_or("-".into(), |v| format!("{v:.2}")),
        ),
        None => "idle".to_owned(),
    };
    println!(
        "{load}: {} ticks, lateness p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        run.ticks, run.lateness_p50_ms, run.lateness_p99_ms, run.lateness_max_ms
    );
}
