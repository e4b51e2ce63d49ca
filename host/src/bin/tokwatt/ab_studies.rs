//! `tokwatt bench ab-table` and `tokwatt bench ab-error-rates`: studies of the A/B
//! verdict itself (how often an A/A names a winner, how often a real difference is found),
//! each many `tokwatt ab` runs on the simulator with the shape `tokwatt ab` takes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use tokwatt_agent::assembly::SimTarget;
use tokwatt_lab::ab::study::Study;
use tokwatt_lab::ab::{self, Schedule};
use tokwatt_policy::spec::PolicySpec;

use crate::ab::EpochArgs;

/// The mode a study's comparisons run in: what `tokwatt ab --sim` runs, unless asked for
/// the interleaved one.
fn study_mode(interleaved: bool) -> ab::Mode {
    if interleaved {
        ab::Mode::Interleaved
    } else {
        ab::Mode::Replicated
    }
}

/// What the two study commands (`bench ab-table`, `bench ab-error-rates`) share about
/// their comparisons.
struct StudyShape<'a> {
    epochs: &'a EpochArgs,
    schedule: Schedule,
    seeds: u64,
    threads: usize,
    interleaved: bool,
}

impl StudyShape<'_> {
    /// `a` against `b` on `sim`, as `tokwatt ab --sim` compares them, one comparison per
    /// seed; no judging scenario, nothing injected.
    fn study(&self, a: &PolicySpec, b: &PolicySpec, sim: SimTarget) -> Study {
        Study {
            a: a.clone(),
            b: b.clone(),
            sim,
            judging: None,
            mode: study_mode(self.interleaved),
            schedule: self.schedule,
            budget_pairs: self.epochs.budget(true),
            alpha: self.epochs.alpha,
            seeds: 0..self.seeds,
            threads: self.threads,
            plugin_dirs: Vec::new(),
            cache_dir: None,
            injected_ratio: None,
        }
    }
}

/// `tokwatt bench ab-table`.
#[derive(Debug, clap::Args)]
pub struct AbTableArgs {
    /// A policy spec, compared with itself (repeat for several; default: the shipped
    /// adaptive policies).
    #[arg(long = "policy", default_values = [
        "policies/hill-climb.toml",
        "policies/slo-batch.toml",
        "policies/cap-search.toml",
        "policies/clock-search.toml",
        "policies/joint-search.toml",
    ])]
    policies: Vec<PathBuf>,
    /// A scenario file, or `built-in` (repeat for several; default: the built-in scenario
    /// and three of the judge's).
    #[arg(long = "scenario", default_values = [
        "built-in",
        "host/scenarios/eval/h200-8b-latency.toml",
        "host/scenarios/eval/h200-8b-shifts.toml",
        "host/scenarios/eval/h200-8b-noisy.toml",
    ])]
    scenarios: Vec<String>,
    /// The true ratio B/A laid on arm B's measurements for the power study.
    #[arg(long, default_value_t = 1.03)]
    true_ratio: f64,
    /// Run every comparison on one simulated node taking turns, as on a real one, instead
    /// of `tokwatt ab --sim`'s default replicated mode.
    #[arg(long)]
    interleaved: bool,
    /// Simulated GPU profile.
    #[arg(long, default_value = "h200")]
    sim: String,
    /// Comparisons per study (one seed each).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    seeds: u64,
    /// Each comparison's epochs and budget, as `tokwatt ab` takes them.
    #[command(flatten)]
    epochs: EpochArgs,
    /// Comparisons at once (default: the machine's cores).
    #[arg(long, value_parser = tokwatt::cli::thread_count)]
    threads: Option<usize>,
    /// Also write the table as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn ab_table(args: &AbTableArgs) -> Result<()> {
    use tokwatt_lab::ab::study::run_study;
    if !(args.true_ratio.is_finite() && args.true_ratio > 0.0) {
        bail!(
            "--true-ratio {} is not a ratio of tokens per joule; give a positive number such as 1.03",
            args.true_ratio
        );
    }
    let threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    // A judging scenario (GPU profile, workload and objective) runs as `tokwatt eval` runs
    // it; any other file is a simulator scenario on --sim.
    let scenarios = args
        .scenarios
        .iter()
        .map(|name| {
            if name == "built-in" {
                return Ok((name.clone(), None));
            }
            let path = Path::new(name);
            match tokwatt_lab::eval::EvalScenario::load(path) {
                Ok(judging) => Ok((name.clone(), Some(judging))),
                Err(judging_error) => tokwatt_sim::Scenario::load(path)
                    .map(|_| (name.clone(), None))
                    .map_err(|sim_error| {
                        anyhow::anyhow!(
                            "--scenario {name} is neither a judging scenario ({judging_error}) nor a simulator scenario ({sim_error})"
                        )
                    }),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let started = std::time::Instant::now();
    println!(
        "SIMULATOR OUTPUT ({}): {} comparisons per study, budget {} pairs, α {}, {}; power against a true B/A of {} laid on arm B; {} threads",
        args.sim,
        args.seeds,
        args.epochs.budget(true),
        args.epochs.alpha,
        args.epochs.describe(),
        args.true_ratio,
        threads
    );
    println!(
        "{:<14} {:<30} {:>12} {:>10} {:>10} {:>9} {:>14}",
        "policy", "scenario", "A/A winner", "power", "mean pairs", "pair sd", "cost/compare"
    );
    let mut rows = Vec::new();
    for path in &args.policies {
        let mut spec =
            PolicySpec::load(path).with_context(|| format!("--policy {}", path.display()))?;
        if let Some(tick) = args.epochs.tick {
            spec.override_tick(tick)?;
        }
        let tick = Duration::from_millis(u64::from(spec.tick_ms));
        let schedule = args.epochs.schedule(tick)?;
        for (scenario, judging) in &scenarios {
            let sim = SimTarget {
                scenario: (scenario != "built-in").then(|| PathBuf::from(scenario)),
                ..SimTarget::new(args.sim.clone())
            };
            let shape = StudyShape {
                epochs: &args.epochs,
                schedule,
                seeds: args.seeds,
                threads,
                interleaved: args.interleaved,
            };
            let study = |injected_ratio: Option<f64>| Study {
                judging: judging.clone(),
                injected_ratio,
                ..shape.study(&spec, &spec, sim.clone())
            };
            let aa = run_study(&study(None))
                .with_context(|| format!("A/A of {} on {scenario}", spec.name))?;
            let power = run_study(&study(Some(args.true_ratio)))
                .with_context(|| format!("power of {} on {scenario}", spec.name))?;
            let cost_s = (aa.simulated_time_s + power.simulated_time_s)
                / (aa.comparisons + power.comparisons).max(1) as f64;
            let name = Path::new(scenario)
                .file_stem()
                .map_or(scenario.clone(), |s| s.to_string_lossy().into_owned());
            println!(
                "{:<14} {:<30} {:>11.1}% {:>9.1}% {:>10.1} {:>9.3} {:>12.0} s",
                spec.name,
                name,
                aa.winner_rate() * 100.0,
                power.b_rate() * 100.0,
                power.mean_pairs,
                aa.median_pair_sd,
                cost_s
            );
            rows.push(serde_json::json!({
                "policy": spec.name,
                "scenario": scenario,
                "a_a": aa,
                "power_study": power,
                "false_positive_rate": aa.winner_rate(),
                "power": power.b_rate(),
                "mean_simulated_s_per_comparison": cost_s,
            }));
        }
    }
    println!("{:.0} s wall", started.elapsed().as_secs_f64());
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "simulated": true,
            "true_ratio": args.true_ratio,
            "seeds": args.seeds,
            "budget_pairs": args.epochs.budget(true),
            "alpha": args.epochs.alpha,
            "epochs": args.epochs.describe(),
            "rows": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// `tokwatt bench ab-error-rates`.
#[derive(Debug, clap::Args)]
pub struct ErrorRatesArgs {
    /// The policy both studies compare (arm A; in the A/A study arm B too).
    #[arg(long, default_value = "policies/static.toml")]
    policy: PathBuf,
    /// Arm B of the power study: the policy with this parameter changed (NAME=VALUE);
    /// the default makes B about 3 % more efficient on the steady scenario.
    #[arg(long, default_value = "power_cap_w=486")]
    b_param: String,
    /// Simulated GPU profile.
    #[arg(long, default_value = "h200")]
    sim: String,
    /// Demand scenario (default: host/scenarios/steady.toml, the same load throughout).
    #[arg(long, default_value = "host/scenarios/steady.toml")]
    scenario: PathBuf,
    /// Comparisons per study (one seed each).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    seeds: u64,
    /// Each comparison's epochs and budget, as `tokwatt ab` takes them.
    #[command(flatten)]
    epochs: EpochArgs,
    /// Run every comparison on one simulated node taking turns, as on a real one, instead
    /// of `tokwatt ab --sim`'s default replicated mode.
    #[arg(long)]
    interleaved: bool,
    /// Comparisons at once (default: the machine's cores).
    #[arg(long, value_parser = tokwatt::cli::thread_count)]
    threads: Option<usize>,
    /// Also write the figures as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn error_rates(args: &ErrorRatesArgs) -> Result<()> {
    use tokwatt_lab::ab::study::{long_run_ratio, run_study};
    let mut a = PolicySpec::load(&args.policy)?;
    if let Some(tick) = args.epochs.tick {
        a.override_tick(tick)?;
    }
    let (name, value) = args
        .b_param
        .split_once('=')
        .context("--b-param takes NAME=VALUE, e.g. power_cap_w=486")?;
    let mut b = a.clone();
    match b.params.iter_mut().find(|(key, _)| key == name) {
        Some(param) => param.1 = value.to_owned(),
        None => b.params.push((name.to_owned(), value.to_owned())),
    }
    b.params.sort();
    let tick = Duration::from_millis(u64::from(a.tick_ms));
    let schedule = args.epochs.schedule(tick)?;
    let threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let shape = StudyShape {
        epochs: &args.epochs,
        schedule,
        seeds: args.seeds,
        threads,
        interleaved: args.interleaved,
    };
    let sim = SimTarget {
        scenario: Some(args.scenario.clone()),
        ..SimTarget::new(args.sim.clone())
    };
    let study = |b: &PolicySpec| shape.study(&a, b, sim.clone());
    let same = study(&a);
    let different = study(&b);
    let started = std::time::Instant::now();
    let (tpj_a, tpj_b, truth) = long_run_ratio(&different, Duration::from_secs(4 * 3600), 1)?;
    let aa = run_study(&same)?;
    let ab = run_study(&different)?;
    println!(
        "SIMULATOR OUTPUT ({}, {}): {} comparisons per study, budget {} pairs, α {}, {}, {} threads, {:.0} s wall",
        args.sim,
        args.scenario.display(),
        args.seeds,
        args.epochs.budget(true),
        args.epochs.alpha,
        args.epochs.describe(),
        threads,
        started.elapsed().as_secs_f64()
    );
    println!(
        "truth: {} {:.4} tok/J, with {} {:.4} tok/J over 4 h each: B/A {:.4}",
        a.name, tpj_a, args.b_param, tpj_b, truth
    );
    for (label, r, rate) in [
        ("A/A (false positives)", &aa, aa.winner_rate()),
        ("A/B (power, B better)", &ab, ab.b_rate()),
    ] {
        let by_look: Vec<String> = r
            .winners_by_look
            .iter()
            .map(|(pairs, winners)| format!("{winners} at {pairs}"))
            .collect();
        println!(
            "{label:<24} {:>5.1} %  (a {}, b {}, none {}, refused {} of {}; winners {}), mean pairs {:.1}, median B/A {:.4}, simulated {:.1} h",
            rate * 100.0,
            r.decided_a,
            r.decided_b,
            r.no_difference,
            r.refused,
            r.comparisons,
            by_look.join(", "),
            r.mean_pairs,
            r.median_ratio,
            r.simulated_time_s / 3600.0
        );
    }
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "simulated": true,
            "truth_ratio_b_over_a": truth,
            "a_a": aa,
            "a_b": ab,
            "false_positive_rate": aa.winner_rate(),
            "power": ab.b_rate(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
