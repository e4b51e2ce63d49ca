//! `tokwatt bench sim-run`: how fast `tokwatt run` simulates, in simulated GPU-hours per
//! wall second, and what it leaves on disk. Each run is the real command in a process of its
//! own (`tokwatt run --sim ... --quiet`, its report included), timed from start to exit; with
//! `--compare-with` another tokwatt binary runs the same command, alternating with this one,
//! so both are measured side by side on the same machine at the same time. Simulator output.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

#[derive(Debug, clap::Args)]
pub struct SimRunArgs {
    /// Simulated GPUs.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    gpus: u32,
    /// Simulated time per run: 24h, 30m.
    #[arg(long, value_parser = tokwatt::cli::parse_duration, default_value = "24h")]
    duration: Duration,
    /// Simulator GPU profile.
    #[arg(long, default_value = "h200")]
    profile: String,
    /// The policy spec to run (default: the shipped slo-batch).
    #[arg(long)]
    policy: Option<PathBuf>,
    /// Runs of each binary, alternating; medians reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    repeats: u32,
    /// Another tokwatt binary (an earlier build) to run the same command beside this one.
    #[arg(long, value_name = "TOKWATT")]
    compare_with: Option<PathBuf>,
    /// Where the runs write (each binary a folder of its own, replaced at every run; default:
    /// a temporary folder, removed at the end).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One binary's runs.
#[derive(Debug, serde::Serialize)]
struct Arm {
    binary: String,
    /// Wall seconds of each run, start to exit.
    wall_s: Vec<f64>,
    wall_s_median: f64,
    gpu_hours_per_s_median: f64,
    /// Bytes each output file kind holds at the end of the last run (rotated files with
    /// their kind: `observations.jsonl` counts `observations.N.jsonl` too).
    on_disk_bytes: BTreeMap<String, u64>,
    on_disk_bytes_total: u64,
}

#[derive(Debug, serde::Serialize)]
struct SimRunResults {
    format_version: u32,
    /// Always true: every figure is simulator output.
    simulated: bool,
    gpus: u32,
    duration_s: f64,
    profile: String,
    policy: String,
    simulated_gpu_hours: f64,
    cores: usize,
    arms: Vec<Arm>,
}

pub fn bench_sim_run(args: &SimRunArgs) -> Result<()> {
    let policy = match &args.policy {
        Some(path) => path.clone(),
        None => super::default_policy("slo-batch.toml")?,
    };
    let this = std::env::current_exe().context("finding this tokwatt binary")?;
    let mut binaries = vec![this];
    if let Some(other) = &args.compare_with {
        if !other.is_file() {
            bail!(
                "--compare-with {}: no such file; give the path of a tokwatt binary (an earlier build)",
                other.display()
            );
        }
        binaries.push(other.clone());
    }
    let temporary;
    let base = match &args.out {
        Some(dir) => dir.clone(),
        None => {
            temporary = tempfile::tempdir().context("making a temporary folder for the runs")?;
            temporary.path().to_owned()
        }
    };
    let gpu_hours = f64::from(args.gpus) * args.duration.as_secs_f64() / 3600.0;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    eprintln!(
        "tokwatt bench sim-run: {} × {} for {} ({gpu_hours:.1} simulated GPU-hours) per run, \
         policy {}, {} run(s) of each binary alternating, {cores} cores (simulator output)",
        args.gpus,
        args.profile,
        humantime::format_duration(args.duration),
        policy.display(),
        args.repeats,
    );
    let mut walls: Vec<Vec<f64>> = vec![Vec::new(); binaries.len()];
    for repeat in 0..args.repeats {
        for (arm, binary) in binaries.iter().enumerate() {
            let out = base.join(format!("arm{arm}"));
            let wall = run_once(binary, args, &policy, &out)?;
            eprintln!(
                "  run {} of {}: {} {wall:.2} s ({:.1} GPU-h/s)",
                repeat + 1,
                args.repeats,
                binary.display(),
                gpu_hours / wall
            );
            walls[arm].push(wall);
        }
    }
    let arms: Vec<Arm> = binaries
        .iter()
        .zip(walls)
        .enumerate()
        .map(|(arm, (binary, wall_s))| {
            let median = median(&wall_s);
            let on_disk_bytes = on_disk(&base.join(format!("arm{arm}")));
            Arm {
                binary: binary.display().to_string(),
                wall_s_median: median,
                gpu_hours_per_s_median: gpu_hours / median,
                on_disk_bytes_total: on_disk_bytes.values().sum(),
                on_disk_bytes,
                wall_s,
            }
        })
        .collect();
    let results = SimRunResults {
        format_version: 1,
        simulated: true,
        gpus: args.gpus,
        duration_s: args.duration.as_secs_f64(),
        profile: args.profile.clone(),
        policy: policy.display().to_string(),
        simulated_gpu_hours: gpu_hours,
        cores,
        arms,
    };
    print!("{}", table(&results));
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&results).context("writing the results")?;
        std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// One `tokwatt run` by `binary` into `out`: its wall seconds, start to exit.
fn run_once(binary: &Path, args: &SimRunArgs, policy: &Path, out: &Path) -> Result<f64> {
    let started = Instant::now();
    let output = Command::new(binary)
        .arg("run")
        .args(["--sim", &args.profile, "--gpus", &args.gpus.to_string()])
        .arg("--duration")
        .arg(humantime::format_duration(args.duration).to_string())
        .arg("--policy")
        .arg(policy)
        .arg("--out")
        .arg(out)
        .args(["--overwrite", "--quiet"])
        .output()
        .with_context(|| format!("starting {}", binary.display()))?;
    let wall = started.elapsed().as_secs_f64();
    if !output.status.success() {
        bail!(
            "{} run failed ({}): {}",
            binary.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(wall)
}

/// Bytes in `dir` by file kind: `observations.3.jsonl` counts as `observations.jsonl`.
fn on_disk(dir: &Path) -> BTreeMap<String, u64> {
    let mut kinds = BTreeMap::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let kind = match name.split('.').collect::<Vec<_>>().as_slice() {
            [stem, number, ext] if number.bytes().all(|b| b.is_ascii_digit()) => {
                format!("{stem}.{ext}")
            }
            _ => name,
        };
        let bytes = entry.metadata().map_or(0, |m| m.len());
        *kinds.entry(kind).or_insert(0) += bytes;
    }
    kinds
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

fn megabytes(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

fn table(results: &SimRunResults) -> String {
    let mut text = format!(
        "\nsimulator output: tokwatt run, {} × {} for {:.0} s ({:.1} GPU-hours), {} cores\n\n",
        results.gpus,
        results.profile,
        results.duration_s,
        results.simulated_gpu_hours,
        results.cores
    );
    for arm in &results.arms {
        text.push_str(&format!("{}\n", arm.binary));
        text.push_str(&format!(
            "  wall {:.2} s median (runs: {}), {:.1} simulated GPU-hours per second\n",
            arm.wall_s_median,
            arm.wall_s
                .iter()
                .map(|w| format!("{w:.2}"))
                .collect::<Vec<_>>()
                .join(", "),
            arm.gpu_hours_per_s_median
        ));
        let files: Vec<String> = arm
            .on_disk_bytes
            .iter()
            .map(|(kind, bytes)| format!("{kind} {}", megabytes(*bytes)))
            .collect();
        text.push_str(&format!(
            "  on disk {}: {}\n",
            megabytes(arm.on_disk_bytes_total),
            files.join(", ")
        ));
    }
    if let [this, other] = results.arms.as_slice() {
        text.push_str(&format!(
            "\nthis build is {:.2}× as fast as {} (median wall {:.2} s against {:.2} s)\n",
            other.wall_s_median / this.wall_s_median,
            other.binary,
            this.wall_s_median,
            other.wall_s_median
        ));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotated_files_count_with_their_kind_and_medians_are_the_middle() {
        let dir = tempfile::tempdir().expect("tempdir");
        for (name, bytes) in [
            ("observations.jsonl", 10),
            ("observations.1.jsonl", 20),
            ("trace.csv", 5),
            ("summary.json", 1),
        ] {
            std::fs::write(dir.path().join(name), vec![b'x'; bytes]).expect("write");
        }
        let kinds = on_disk(dir.path());
        assert_eq!(kinds["observations.jsonl"], 30);
        assert_eq!(kinds["trace.csv"], 5);
        assert_eq!(kinds.len(), 3);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
