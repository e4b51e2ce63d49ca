//! `tokwatt bench decide` and `agent-cpu`: measurements of the agent itself, a policy
//! call's latency through the plugin host and the agent loop's CPU time per GPU count.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use tokwatt_bench::DecideLatencies;
use tokwatt_bench::agent_cpu::{
    self, AgentCpuRequest, AgentCpuRun, AgentCpuTarget, CPU_TIME_RESOLUTION,
};
use tokwatt_nvml::SamplerConfig;
use tokwatt_plugin::ComponentCache;

pub(super) fn agent_cpu_targets(
    gpus: &[u32],
    profile: &str,
    nvml: Option<Vec<u32>>,
    nvml_repeat: Option<Vec<u32>>,
    sampler: SamplerConfig,
) -> Result<Vec<AgentCpuTarget>> {
    Ok(match (nvml, nvml_repeat) {
        (None, _) => {
            if gpus.contains(&0) {
                bail!("--gpus: every GPU count must be at least 1");
            }
            gpus.iter()
                .map(|&gpus| AgentCpuTarget::Sim {
                    profile: profile.to_owned(),
                    gpus,
                })
                .collect()
        }
        (Some(indices), None) => vec![AgentCpuTarget::Nvml { indices, sampler }],
        (Some(indices), Some(copies)) => {
            let [index] = indices[..] else {
                bail!(
                    "--nvml-repeat opens one GPU several times: give one index to --nvml (got {indices:?})"
                );
            };
            if copies.contains(&0) {
                bail!("--nvml-repeat: every count must be at least 1");
            }
            copies
                .into_iter()
                .map(|copies| AgentCpuTarget::NvmlRepeated {
                    index,
                    copies,
                    sampler,
                })
                .collect()
        }
    })
}

pub(super) fn bench_agent_cpu(
    targets: &[AgentCpuTarget],
    request: &AgentCpuRequest,
    repeats: u32,
    sampler: Option<SamplerConfig>,
) -> Result<()> {
    let repeats = repeats.max(1);
    let simulated = matches!(targets.first(), Some(AgentCpuTarget::Sim { .. }));
    println!(
        "tokwatt bench agent-cpu: policy `{}` ({}), tick {}, {} per run, median of {repeats} run(s)",
        request.spec.name,
        request.spec.path.display(),
        humantime::format_duration(request.tick),
        humantime::format_duration(request.duration),
    );
    println!(
        "CPU time of this process (user + system, all threads) from the end of the first tick to the end of the last, resolution {} ms",
        CPU_TIME_RESOLUTION.as_millis()
    );
    if simulated {
        println!(
            "SIMULATOR output: the simulated GPU runs in real time; its work stands in for NVML's, so these figures are not what NVML costs (measure that with --nvml on a GPU machine)"
        );
    } else if let Some(sampler) = sampler {
        println!(
            "NVML telemetry, dry-run actuator (no GPU setting changes), no workload (an idle token source); sampler: energy and power every {} ms, SM clock, clock events and enforced limit every {} sample(s), temperature, utilisation, memory clock and requested limit every {} sample(s)",
            sampler.period.as_millis(),
            sampler.tick_gauges_every,
            sampler.slow_gauges_every
        );
        if targets
            .iter()
            .any(|t| matches!(t, AgentCpuTarget::NvmlRepeated { .. }))
        {
            println!(
                "LOGICAL GPUs: one GPU opened K times, so each row is K GPUs' worth of NVML sampling on one device"
            );
        }
    }
    let mut rows = Vec::new();
    for target in targets {
        let mut runs = Vec::new();
        for repeat in 1..=repeats {
            eprintln!(
                "measuring {} (run {repeat} of {repeats}, {})",
                agent_cpu::describe(target),
                humantime::format_duration(request.duration)
            );
            let run = agent_cpu::measure(target, request)
                .with_context(|| format!("measuring {}", agent_cpu::describe(target)))?;
            eprintln!("  {}", run_line(&run));
            runs.push(run);
        }
        rows.push((target, runs));
    }
    println!("{}", agent_cpu_table(&rows, simulated));
    Ok(())
}

fn run_line(run: &AgentCpuRun) -> String {
    let calls = run
        .nvml_calls_per_s_per_gpu()
        .map_or_else(String::new, |rate| format!(", {rate:.1} NVML calls/s/GPU"));
    format!(
        "{} ticks in {:.1} s: {:.3} % of one core (user {:.2} s, system {:.2} s){calls}",
        run.ticks,
        run.wall.as_secs_f64(),
        run.cpu_pct_of_one_core(),
        run.cpu.user.as_secs_f64(),
        run.cpu.system.as_secs_f64()
    )
}

fn agent_cpu_table(rows: &[(&AgentCpuTarget, Vec<AgentCpuRun>)], simulated: bool) -> String {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::ASCII_MARKDOWN);
    let mut header = vec![
        "gpus",
        "cpu % of one core",
        "(min..max)",
        "user s",
        "system s",
        "per GPU (% of a core)",
        "measured s",
    ];
    if !simulated {
        header.push("NVML calls/s/GPU");
    }
    table.set_header(header);
    for (target, runs) in rows {
        let pick = |f: &dyn Fn(&AgentCpuRun) -> f64| {
            agent_cpu::median(&runs.iter().map(f).collect::<Vec<_>>())
        };
        let pct = pick(&|r| r.cpu_pct_of_one_core());
        let (low, high) = runs
            .iter()
            .map(AgentCpuRun::cpu_pct_of_one_core)
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            });
        let gpus = target.gpus();
        let label = match target {
            AgentCpuTarget::Sim { .. } => format!("{gpus} (simulated)"),
            AgentCpuTarget::Nvml { .. } => format!("{gpus}"),
            AgentCpuTarget::NvmlRepeated { .. } => format!("{gpus} (logical)"),
        };
        let mut row = vec![
            label,
            format!("{pct:.3}"),
            format!("{low:.3}..{high:.3}"),
            format!("{:.2}", pick(&|r| r.cpu.user.as_secs_f64())),
            format!("{:.2}", pick(&|r| r.cpu.system.as_secs_f64())),
            format!("{:.3}", pct / f64::from(gpus.max(1))),
            format!("{:.1}", pick(&|r| r.wall.as_secs_f64())),
        ];
        if !simulated {
            row.push(format!(
                "{:.1}",
                pick(&|r| r.nvml_calls_per_s_per_gpu().unwrap_or(f64::NAN))
            ));
        }
        table.add_row(row);
    }
    table.to_string()
}

pub(super) fn bench_decide(
    gpus: u32,
    calls: usize,
    plugin: Option<PathBuf>,
    cache_dir: Option<PathBuf>,
) -> Result<()> {
    let plugin = plugin
        .unwrap_or_else(|| tokwatt_plugin_artifacts::built_plugin_dir().join("policy_static.wasm"));
    let host = tokwatt_agent::plugin_host(cache_dir)?;
    let hits_before = host.cache().map(ComponentCache::hits);
    let DecideLatencies { start, mut times } =
        tokwatt_bench::decide_latencies(&host, &plugin, gpus, calls)
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("benchmarking {}", plugin.display()))?;
    let q = |times: &mut [Duration], q: f64| tokwatt_bench::quantile(times, q).as_secs_f64() * 1e6;
    println!(
        "decide, {gpus} GPUs, {calls} calls through the plugin host ({}):",
        plugin.display()
    );
    let how = match (host.cache(), hits_before) {
        (Some(cache), Some(before)) if cache.hits() > before => format!(
            "loaded from the compiled-component cache {}",
            cache.dir().display()
        ),
        (Some(cache), _) => format!(
            "compiled (it was not in the compiled-component cache {}; this run stored it there unless a warning above says otherwise)",
            cache.dir().display()
        ),
        (None, _) => "compiled (no compiled-component cache folder is known: pass --cache-dir or set TOKWATT_CACHE_DIR)".to_owned(),
    };
    println!("  started in {:.3} s: {how}", start.as_secs_f64());
    println!(
        "  p50 {:.2} us   p90 {:.2} us   p99 {:.2} us   max {:.2} us",
        q(&mut times, 0.5),
        q(&mut times, 0.9),
        q(&mut times, 0.99),
        q(&mut times, 1.0)
    );
    Ok(())
}
