//! `tokwatt eval`: judge policies against the oracle on the simulator, over a set of
//! scenarios and seeds; writes `eval.json` and `report.html`.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};

use crate::plugin_places::PluginPlaces;
use tokwatt_lab::eval::family::{self, Split};
use tokwatt_lab::eval::{self, EvalRequest, EvalResults, EvalScenario};

#[derive(Debug, clap::Args)]
pub struct EvalArgs {
    /// Policy specs to judge (default: every shipped spec, `policies/*.toml`).
    #[arg(long, num_args = 1.., value_name = "SPEC")]
    policies: Vec<PathBuf>,
    /// Judging scenario files, or folders of them (default: the shipped set,
    /// `host/scenarios/eval`).
    #[arg(long, num_args = 1.., value_name = "DIR|FILE")]
    scenarios: Vec<PathBuf>,
    /// Judge on scenarios drawn from a family (`broad`: decode only; `serving`: requests
    /// with prompts and TTFT bounds) instead of files: its tuning and
    /// held-out splits (drawn from disjoint random streams), side by side.
    #[arg(long, conflicts_with = "scenarios", value_name = "NAME")]
    family: Option<String>,
    /// Scenarios drawn per split.
    #[arg(long, default_value_t = 40, requires = "family")]
    count: usize,
    /// The family's seed: the same seed draws the same scenarios.
    #[arg(
        long = "family-seed",
        alias = "seed",
        default_value_t = 1,
        requires = "family"
    )]
    family_seed: u64,
    /// Which split to judge.
    #[arg(long, value_enum, default_value = "both", requires = "family")]
    split: SplitArg,
    /// Also write every drawn scenario's file into DIR/tuning and DIR/held-out.
    #[arg(long, value_name = "DIR", requires = "family")]
    write_scenarios: Option<PathBuf>,
    /// Judge nothing: print each phase of these scenario files (or folders) with its
    /// demand, the capacity within the objective and the oracle's settings.
    #[arg(long, num_args = 1.., value_name = "SCENARIO", conflicts_with_all = ["policies", "family", "scenarios"])]
    plan: Vec<PathBuf>,
    /// With --plan: also check the oracle's invariant on each scenario: no fixed setting
    /// of a coarse grid (6 caps × 6 SM clocks × 4 batches × 3 token budgets), held through
    /// a phase from where the oracle's schedule left the run, beats the oracle's phase by
    /// more than 0.5 % while keeping the objective. Exits non-zero where it fails.
    #[arg(long)]
    check: bool,
    /// Print the result as JSON on standard output instead of the tables: eval.json in an
    /// envelope with the output folder and its files (with --family, `result` holds each
    /// split's eval.json under its name). With --plan: the plans as JSON.
    #[arg(long)]
    json: bool,
    /// Seeds per policy and scenario (1..=N).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=1000))]
    seeds: u64,
    /// Simulated time of every run (overrides each scenario's `duration_s`): 30m, 90s.
    #[arg(long, value_parser = tokwatt::cli::parse_duration)]
    duration: Option<Duration>,
    /// Runs in parallel (default: the cores there are).
    #[arg(long, value_parser = tokwatt::cli::thread_count)]
    threads: Option<usize>,
    /// Output folder for eval.json and report.html (default: out/eval-TIME).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replace an earlier evaluation's files in --out.
    #[arg(long)]
    overwrite: bool,
    #[command(flatten)]
    plugins: PluginPlaces,
    /// No progress bar or lines.
    #[arg(long, short)]
    quiet: bool,
    /// A line for every oracle and every run as it ends (by default a progress bar on a
    /// terminal, elsewhere a line at each tenth of the runs).
    #[arg(long, short, conflicts_with = "quiet")]
    verbose: bool,
    /// After the summary, also the table of every policy on every scenario (always in
    /// report.html and eval.json).
    #[arg(long)]
    details: bool,
}

/// Where the shipped specs and judging scenarios are, from the checkout's root.
const SHIPPED_POLICIES: &str = "policies";
const SHIPPED_SCENARIOS: &str = "host/scenarios/eval";

/// `--policies` as given, or every shipped spec in `SHIPPED_POLICIES`, sorted.
fn policies_or_shipped(given: &[PathBuf]) -> Result<Vec<PathBuf>> {
    if !given.is_empty() {
        return Ok(given.to_vec());
    }
    let dir = std::path::Path::new(SHIPPED_POLICIES);
    let entries = std::fs::read_dir(dir).with_context(|| {
        format!(
            "no --policies given and ./{SHIPPED_POLICIES} cannot be read: run from the tokwatt \
             checkout to judge the shipped policies, or name specs with --policies"
        )
    })?;
    let mut specs: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "toml"))
        .collect();
    specs.sort();
    if specs.is_empty() {
        bail!(
            "no --policies given and ./{SHIPPED_POLICIES} holds no .toml spec: name specs with --policies"
        );
    }
    Ok(specs)
}

/// `--scenarios` as given, or the shipped set.
fn scenarios_or_shipped(given: &[PathBuf]) -> Result<Vec<PathBuf>> {
    if !given.is_empty() {
        return Ok(given.to_vec());
    }
    let dir = PathBuf::from(SHIPPED_SCENARIOS);
    if !dir.is_dir() {
        bail!(
            "no --scenarios given and ./{SHIPPED_SCENARIOS} is not here: run from the tokwatt \
             checkout to judge on the shipped scenarios, or name files or folders with --scenarios"
        );
    }
    Ok(vec![dir])
}

/// `--split`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SplitArg {
    Tuning,
    HeldOut,
    Both,
}

pub fn eval(args: &EvalArgs) -> Result<()> {
    if args.check {
        return check_oracles(args);
    }
    if !args.plan.is_empty() {
        return print_plans(args);
    }
    if let Some(name) = &args.family
        && !family::FAMILIES.contains(&name.as_str())
    {
        return Err(family::FamilyError::Unknown { name: name.clone() }.into());
    }
    let policies = policies_or_shipped(&args.policies)?;
    let out = args.out.clone().unwrap_or_else(|| {
        PathBuf::from("out").join(format!(
            "eval-{}",
            humantime::format_rfc3339_seconds(std::time::SystemTime::now())
                .to_string()
                .replace(':', "-")
        ))
    });
    let Some(family) = &args.family else {
        let scenarios = EvalScenario::load_all(&scenarios_or_shipped(&args.scenarios)?)?;
        let results = judge(args, policies, scenarios, &out)?;
        if args.json {
            return crate::json_out::JsonResult::new("eval", Some(&out), &results).print();
        }
        print_results(&results, args.details);
        return Ok(());
    };
    let splits: &[Split] = match args.split {
        SplitArg::Tuning => &[Split::Tuning],
        SplitArg::HeldOut => &[Split::HeldOut],
        SplitArg::Both => &[Split::Tuning, Split::HeldOut],
    };
    let mut judged = Vec::new();
    for &split in splits {
        let drawn = family::draw(family, split, args.count, args.family_seed)?;
        let folder = out.join(split.name());
        if let Some(dir) = &args.write_scenarios {
            let dir = dir.join(split.name());
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            for d in &drawn {
                let path = dir.join(format!("{}.toml", d.scenario.name));
                std::fs::write(&path, &d.text)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
        if !args.quiet {
            let shapes = drawn.iter().map(|d| d.demand).collect::<Vec<_>>();
            eprintln!(
                "{} split of family `{family}` (seed {}): {} scenarios ({})",
                split.name(),
                args.family_seed,
                drawn.len(),
                shapes.join(", ")
            );
        }
        let scenarios = drawn.into_iter().map(|d| d.scenario).collect();
        let results = judge(args, policies.clone(), scenarios, &folder)?;
        judged.push((split, results));
    }
    if args.json {
        let splits: std::collections::BTreeMap<&str, &EvalResults> = judged
            .iter()
            .map(|(split, results)| (split.name(), results))
            .collect();
        return crate::json_out::JsonResult::new("eval", Some(&out), &splits).print();
    }
    for (split, results) in &judged {
        println!("\n{} split", split.name());
        print_results(results, args.details);
    }
    if let [(_, tuning), (_, held_out)] = judged.as_slice() {
        print_splits(tuning, held_out);
    }
    Ok(())
}

/// The headline of both splits side by side, held-out first: the figure that says how a
/// policy does on work it was not tuned on.
fn print_splits(tuning: &EvalResults, held_out: &EvalResults) {
    let mut table = Table::new();
    table.load_preset(UTF8_FULL_CONDENSED).set_header([
        "policy",
        "held-out ratio",
        "to causal",
        "× default",
        "failed",
        "worst",
        "tuning ratio",
        "failed",
        "worst",
    ]);
    for h in eval::ranked_policies(held_out) {
        let t = tuning.policies.iter().find(|t| t.policy == h.policy);
        table.add_row([
            h.policy.clone(),
            eval::figure(h.ratio, 3, eval::NO_SCENARIO_RAN),
            eval::figure(h.causal_ratio, 3, eval::NO_SCENARIO_RAN),
            eval::figure(h.over_default, 2, eval::NO_SCENARIO_RAN),
            format!("{}/{}", h.failed, held_out.scenarios.len()),
            h.worst_text(),
            t.map_or_else(String::new, |t| {
                eval::figure(t.ratio, 3, eval::NO_SCENARIO_RAN)
            }),
            t.map_or_else(String::new, |t| {
                format!("{}/{}", t.failed, tuning.scenarios.len())
            }),
            t.map_or_else(String::new, eval::PolicyResult::worst_text),
        ]);
    }
    println!(
        "\nheld-out against tuning split (simulator output; median ratios to the oracle and to the causal reference with a failed scenario as 0)\n{table}"
    );
}

/// Judge `policies` on `scenarios`, write `eval.json` and `report.html` into `out`.
fn judge(
    args: &EvalArgs,
    policies: Vec<PathBuf>,
    scenarios: Vec<EvalScenario>,
    out: &std::path::Path,
) -> Result<EvalResults> {
    let json_path = out.join("eval.json");
    if json_path.exists() && !args.overwrite {
        bail!(
            "{} already holds an evaluation; choose another folder with --out, or pass --overwrite to replace it",
            out.display()
        );
    }
    let threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let request = EvalRequest {
        policies,
        scenarios,
        seeds: args.seeds,
        duration_s: args.duration.map(|d| d.as_secs_f64()),
        threads,
        plugin_dirs: args.plugins.plugin_dirs.clone(),
        cache_dir: args.plugins.cache_dir.clone(),
    };
    if !args.quiet {
        eprintln!(
            "judging {} policies on {} scenarios × {} seeds on {threads} threads (simulator output)",
            request.policies.len(),
            request.scenarios.len(),
            request.seeds
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    // Hundreds of runs: a bar, or a line a tenth; a line a run only with --verbose.
    let mut progress = crate::progress::EvalBar::new(args.quiet, args.verbose);
    let results = eval::evaluate(&request, stop, &mut |p| progress.update(&p));
    progress.finish();
    let results = results?;
    std::fs::create_dir_all(out)
        .with_context(|| format!("creating the output folder {}", out.display()))?;
    let json = serde_json::to_string_pretty(&results).context("serialising eval.json")?;
    tokwatt_report::write_atomically(&json_path, &(json + "\n"))
        .with_context(|| format!("writing {}", json_path.display()))?;
    let report_path = out.join("report.html");
    tokwatt_report::write_atomically(&report_path, &eval::eval_report(&results))
        .with_context(|| format!("writing {}", report_path.display()))?;
    let wrote = format!(
        "{:.1} s wall. Wrote {} and {}",
        results.wall_time_s,
        json_path.display(),
        report_path.display()
    );
    if args.json {
        eprintln!("{wrote}");
    } else {
        println!("{wrote}");
    }
    Ok(results)
}

/// The results: the summary first (each policy over the scenarios, best first) and the
/// failures; every policy on every scenario only with `details` (the tables of
/// report.html and eval.json hold it anyway).
fn print_results(results: &EvalResults, details: bool) {
    println!("\n{}", results.data_source);
    // The same table as report.html's (built once, in the library).
    let policies = eval::policy_table(results);
    let mut table = Table::new();
    table
        .load_preset(UTF8_FULL_CONDENSED)
        .set_header(policies.header.clone());
    for row in policies.rows {
        table.add_row(row);
    }
    println!("{table}");
    println!("{}", eval::failure_rule_words());
    for e in results.entries.iter().filter(|e| e.failed.is_some()) {
        println!(
            "FAILED: {} on {}: {}",
            e.policy,
            e.scenario,
            e.failed.as_deref().unwrap_or_default()
        );
    }
    if details {
        print_details(results);
    } else {
        println!("Each policy on each scenario: --details, or report.html beside eval.json.");
    }
}

/// `--details`: every policy on every scenario, the policies ranked (report.html's table).
fn print_details(results: &EvalResults) {
    let entries = eval::entry_table(results);
    let mut table = Table::new();
    table
        .load_preset(UTF8_FULL_CONDENSED)
        .set_header(entries.header.clone());
    for row in entries.rows {
        table.add_row(row);
    }
    println!("{table}");
}

/// `work` on each scenario `--plan` names, over its simulated length (`--duration`, else
/// its own) and the seeds `tokwatt eval` would judge on, so that the oracle is the one it
/// would search; an error names the scenario after `doing`.
fn over_planned<T, E>(
    args: &EvalArgs,
    doing: &str,
    work: impl Fn(&EvalScenario, f64, &[u64]) -> Result<T, E>,
) -> Result<Vec<T>>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let scenarios = EvalScenario::load_all(&args.plan)?;
    let seeds: Vec<u64> = (1..=args.seeds).collect();
    scenarios
        .iter()
        .map(|scenario| {
            let duration_s = args
                .duration
                .map_or(scenario.duration_s, |d| d.as_secs_f64());
            work(scenario, duration_s, &seeds)
                .with_context(|| format!("{doing} `{}`", scenario.name))
        })
        .collect()
}

/// `--plan --check`: the oracle's invariant on each scenario, phase by phase.
fn check_oracles(args: &EvalArgs) -> Result<()> {
    if args.plan.is_empty() {
        anyhow::bail!(
            "--check checks the oracle of scenario files: give them with --plan, e.g. \
             `tokwatt eval --check --plan my-scenario.toml`"
        );
    }
    let grid = eval::invariant::CheckGrid::coarse();
    let checks = over_planned(
        args,
        "checking the oracle's invariant on",
        |scenario, duration_s, seeds| eval::invariant::check(scenario, duration_s, seeds, &grid),
    )?;
    let failed: Vec<&str> = checks
        .iter()
        .filter(|c| !c.holds)
        .map(|c| c.scenario.as_str())
        .collect();
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&checks).context("serialising the checks")?
        );
    } else {
        for check in &checks {
            println!(
                "\n{}: {} ({})",
                check.scenario,
                if check.holds { "holds" } else { "FAILS" },
                check.data_source
            );
            let mut table = Table::new();
            table.load_preset(UTF8_FULL_CONDENSED).set_header([
                "phase",
                "oracle (cap, clock, batch, budget)",
                "oracle tok/J",
                "settings",
                "kept objective",
                "best of them / oracle",
                "beaten by",
            ]);
            for phase in &check.phases {
                let o = &phase.oracle;
                table.add_row([
                    format!("{:.0}–{:.0} s", phase.start_s, phase.end_s),
                    format!(
                        "{:.0} W, {} MHz, {}, {}",
                        o.power_cap_w, o.sm_clock_max_mhz, o.batch_size, o.token_budget
                    ),
                    format!("{:.4}", phase.oracle_tokens_per_joule),
                    phase.settings_checked.to_string(),
                    phase.kept_objective.to_string(),
                    phase
                        .best_ratio
                        .map_or_else(|| "—".to_owned(), |r| format!("{r:.4}")),
                    phase.beaten_by.first().map_or_else(
                        || "nothing".to_owned(),
                        |b| {
                            format!(
                                "{:.0} W, {} MHz, {}, {}: {:.4} (and {} more)",
                                b.setting.power_cap_w,
                                b.setting.sm_clock_max_mhz,
                                b.setting.batch_size,
                                b.setting.token_budget,
                                b.ratio,
                                phase.beaten_by.len() - 1
                            )
                        },
                    ),
                ]);
            }
            println!("{table}");
        }
        println!(
            "\nThe invariant: no fixed setting of the grid, held through a phase from where the \
             oracle's schedule left the run, beats the oracle's phase by more than {:.1} % \
             while keeping the objective as the oracle must (ticks over, requests turned \
             away, the queue left at the phase's end).",
            eval::invariant::INVARIANT_MARGIN * 100.0
        );
    }
    if !failed.is_empty() {
        anyhow::bail!(
            "the oracle's invariant fails on {}: a fixed setting beats its phase; report it \
             with this scenario file",
            failed.join(", ")
        );
    }
    Ok(())
}

/// `--plan`: each scenario's phases, capacity and oracle, judged nothing.
fn print_plans(args: &EvalArgs) -> Result<()> {
    let plans = over_planned(args, "planning scenario", eval::plan::plan)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&plans).context("serialising the plans")?
        );
        return Ok(());
    }
    for plan in &plans {
        println!("\n{}: {}", plan.scenario, plan.description);
        let lengths = match plan.prompt_tokens_mean {
            Some(prompt) => format!(
                "requests with prompts: mean {prompt:.0} prompt and {:.0} output tokens",
                plan.output_tokens_mean
            ),
            None => format!(
                "decode only: {:.0} output tokens at context {}",
                plan.output_tokens_mean, plan.context_tokens
            ),
        };
        println!(
            "{}; {lengths}; batch up to {} ({})",
            plan.gpu, plan.batch_size_max, plan.data_source
        );
        let mut table = Table::new();
        table.load_preset(UTF8_FULL_CONDENSED).set_header([
            "phase",
            "requests/s",
            "capacity",
            "load",
            "oracle cap",
            "SM clock max",
            "batch",
            "token budget",
            "tok/J",
            "violating",
            "feasible",
        ]);
        for phase in &plan.phases {
            let o = &phase.oracle;
            table.add_row([
                format!("{:.0}–{:.0} s", phase.start_s, phase.end_s),
                format!("{:.2}", phase.arrival_rps),
                format!("{:.2}", phase.capacity_rps),
                format!("{:.0} %", phase.load * 100.0),
                format!("{:.0} W", o.setting.power_cap_w),
                format!("{} MHz", o.setting.sm_clock_max_mhz),
                o.setting.batch_size.to_string(),
                o.setting.token_budget.to_string(),
                format!("{:.4}", o.simulated_tokens_per_joule),
                format!("{:.2} %", o.simulated_violation_fraction * 100.0),
                if o.drains_backlog {
                    "no: drains the backlog".to_owned()
                } else if o.feasible {
                    "yes".to_owned()
                } else {
                    "no: closest".to_owned()
                },
            ]);
        }
        println!("{table}");
    }
    println!(
        "\ncapacity: the most requests/s served within the TPOT and TTFT bounds (10 % headroom) \
         by the steady-state model at the largest cap, no clock lock, any batch; load above \
         100 % queues until requests are turned away. The oracle's settings are the best \
         that keep the objective on 99 % of the ticks of a simulated run of the whole phase, \
         from the queue the phase before left, turning nobody away and leaving no more \
         waiting than the most capable setting (simulator output)."
    );
    Ok(())
}
