//! `tokwatt plugin test FILE.wasm|SPEC`: a plugin on one judging scenario of the
//! simulator, beside the shipped `default` policy and the oracle, through the judge
//! (`tokwatt_lab::eval::evaluate`), so the figures are the ones `tokwatt eval` would give.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};

use crate::plugin_places::PluginPlaces;
use tokwatt_lab::eval::{self, EvalRequest, EvalResults, EvalScenario};

/// The judging scenario used when none is given: one H200, a latency objective, three
/// demand phases.
const DEFAULT_SCENARIO: &str = "scenarios/eval/h200-8b-latency.toml";
/// The baseline spec, relative to the checkout.
const DEFAULT_BASELINE: &str = "../policies/default.toml";

#[derive(Debug, clap::Args)]
pub struct TestArgs {
    /// The policy: its spec (TOML), or a bare component (.wasm), which is run under a
    /// minimal spec (every knob granted, 1 s tick, no parameters).
    policy: PathBuf,
    /// A judging scenario file (default: host/scenarios/eval/h200-8b-latency.toml).
    #[arg(long, value_name = "FILE")]
    scenario: Option<PathBuf>,
    /// Simulated time (default: the scenario's own): 10m, 90s.
    #[arg(long, value_parser = tokwatt::cli::parse_duration)]
    duration: Option<Duration>,
    /// Seeds 1..=N; the figures are medians over them, as in `tokwatt eval`.
    #[arg(long, default_value_t = 1)]
    seeds: u64,
    /// The spec to compare with (default: the shipped `default` policy).
    #[arg(long, value_name = "SPEC")]
    baseline: Option<PathBuf>,
    #[command(flatten)]
    plugins: PluginPlaces,
    /// Print the result as JSON on standard output instead of the table: the judge's
    /// document (eval.json's keys, the policy's entry first, then the baseline's) in an
    /// envelope. Nothing is written to disk. A policy that could not start or run still
    /// exits non-zero, after the document.
    #[arg(long)]
    json: bool,
}

pub fn test(args: &TestArgs) -> Result<()> {
    if args.seeds == 0 {
        bail!("--seeds must be at least 1");
    }
    let checkout = Path::new(env!("CARGO_MANIFEST_DIR"));
    let scenario_path = args
        .scenario
        .clone()
        .unwrap_or_else(|| checkout.join(DEFAULT_SCENARIO));
    let scenario = EvalScenario::load(&scenario_path).context(
        "loading the judging scenario (give one with --scenario; the shipped set is \
         host/scenarios/eval in a tokwatt checkout)",
    )?;
    let baseline = args
        .baseline
        .clone()
        .unwrap_or_else(|| checkout.join(DEFAULT_BASELINE));
    if !baseline.is_file() {
        bail!(
            "no baseline spec at {}: give one with --baseline (the shipped `default` policy \
             is policies/default.toml in a tokwatt checkout)",
            baseline.display()
        );
    }

    // A bare component gets a spec in a folder that lives until the run is over.
    let minimal_spec_dir;
    let spec = if args.policy.extension().is_some_and(|ext| ext == "wasm") {
        minimal_spec_dir = tempfile::Builder::new()
            .prefix("tokwatt-plugin-test-")
            .tempdir()
            .context("creating a folder for the minimal spec")?;
        let spec = minimal_spec(&args.policy, minimal_spec_dir.path())?;
        let note = if args.json {
            |text: &str| eprintln!("{text}")
        } else {
            |text: &str| println!("{text}")
        };
        note(&format!(
            "note: {} is a bare component, so it runs under a minimal spec: every knob \
             granted, tick 1 s, no parameters, the default sandbox limits. Write a spec to \
             set them.",
            args.policy.display()
        ));
        spec
    } else {
        args.policy.clone()
    };

    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let request = EvalRequest {
        policies: vec![spec, baseline],
        scenarios: vec![scenario],
        seeds: args.seeds,
        duration_s: args.duration.map(|d| d.as_secs_f64()),
        threads,
        plugin_dirs: args.plugins.plugin_dirs.clone(),
        cache_dir: args.plugins.cache_dir.clone(),
    };
    let results = eval::evaluate(&request, Arc::new(AtomicBool::new(false)), &mut |_| {})?;
    if args.json {
        crate::json_out::JsonResult::new("plugin test", None, &results).print()?;
    } else {
        print_results(&results)?;
    }
    if let Some(entry) = results.entries.first()
        && let Some(failure) = &entry.failure
    {
        if could_not_start(entry) {
            bail!("the policy could not start on the simulator: {failure}");
        }
        bail!("the policy failed on the simulator: {failure}");
    }
    Ok(())
}

/// Writes a spec for a bare component into `dir` and returns its path.
fn minimal_spec(wasm: &Path, dir: &Path) -> Result<PathBuf> {
    if !wasm.is_file() {
        bail!(
            "no component at {}: build it first (`cargo build --release --target wasm32-wasip2`)",
            wasm.display()
        );
    }
    let wasm = wasm
        .canonicalize()
        .with_context(|| format!("resolving {}", wasm.display()))?;
    let name = wasm
        .file_stem()
        .map_or_else(|| "plugin".to_owned(), |s| s.to_string_lossy().into_owned());
    let plugin = wasm.to_str().with_context(|| {
        format!(
            "the path {} is not UTF-8, which a spec cannot hold; move the component",
            wasm.display()
        )
    })?;
    let text = format!(
        "name = {}\nplugin = {}\nknobs = [\"power-cap\", \"sm-clock\", \"batch-size\"]\ntick_ms = 1000\n",
        toml::Value::String(name),
        toml::Value::String(plugin.to_owned()),
    );
    let path = dir.join("minimal.toml");
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

fn print_results(results: &EvalResults) -> Result<()> {
    let [policy, baseline] = results.entries.as_slice() else {
        bail!(
            "the judge returned {} entries for a policy and its baseline",
            results.entries.len()
        );
    };
    let Some(scenario) = results.scenarios.first() else {
        bail!("the judge returned no scenario");
    };
    println!(
        "{} on {} ({}; {:.0} s simulated, seeds {}), labelled simulator output:",
        policy.policy,
        scenario.name,
        scenario.description,
        scenario.duration_s,
        results
            .seeds
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("{}", results.data_source);
    let mut table = Table::new();
    table.load_preset(UTF8_FULL_CONDENSED).set_header([
        "run",
        "tokens/J",
        "vs oracle",
        "over objective",
        "served",
    ]);
    for (label, entry) in [
        (format!("policy {}", policy.policy), policy),
        (format!("baseline {}", baseline.policy), baseline),
    ] {
        if could_not_start(entry) {
            table.add_row([
                label,
                "could not start".into(),
                "-".into(),
                "-".into(),
                "-".into(),
            ]);
            continue;
        }
        table.add_row([
            label,
            format!("{:.4}", entry.tokens_per_joule.median),
            entry.ratio_text(),
            format!("{:.2}%", entry.slo_violation_fraction * 100.0),
            format!("{:.1}%", entry.served_fraction * 100.0),
        ]);
    }
    // The oracle's figures are over the seeds a policy ran: the baseline's where the
    // policy ran none.
    let oracle = [policy, baseline]
        .into_iter()
        .find(|entry| !could_not_start(entry));
    let figure = |value: Option<f64>, text: &dyn Fn(f64) -> String| {
        value
            .filter(|v| v.is_finite())
            .map_or_else(|| "-".to_owned(), text)
    };
    table.add_row([
        "oracle".to_owned(),
        figure(oracle.map(|o| o.oracle_tokens_per_joule), &|v| {
            format!("{v:.4}")
        }),
        "1.000".to_owned(),
        figure(
            Some(eval::oracle::violation_fraction(&scenario.oracle)),
            &|v| format!("{:.2}%", v * 100.0),
        ),
        figure(oracle.map(|o| o.oracle_served_fraction), &|v| {
            format!("{:.1}%", v * 100.0)
        }),
    ]);
    println!("{table}");
    println!(
        "vs oracle: tokens per joule over the oracle's, times the share of the oracle's \
         served demand served. The oracle knows each phase's demand in advance; its time \
         over the objective is from its per-phase verification runs."
    );
    for entry in [policy, baseline] {
        if let Some(failure) = &entry.failure {
            if could_not_start(entry) {
                println!("{} could not start: {failure}", entry.policy);
            } else {
                println!("{} could not run on every seed: {failure}", entry.policy);
            }
        } else if let Some(why) = &entry.failed {
            println!("{} FAILED the scenario: {why}", entry.policy);
        }
    }
    Ok(())
}

/// Whether no seed of the policy ran: its start was refused (a plugin's `init`, a spec
/// the node cannot serve), so it has no figures, not even the oracle's beside it.
fn could_not_start(entry: &eval::EvalEntry) -> bool {
    entry.failure.is_some() && entry.seeds.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_lab::eval::PhaseOracle;

    fn phase(start_s: f64, end_s: f64, violation: f64) -> PhaseOracle {
        PhaseOracle {
            start_s,
            end_s,
            scenario_phase: 0,
            drains_backlog: false,
            arrival_rps: 1.0,
            setting: eval::OracleSetting {
                power_cap_w: 700.0,
                sm_clock_max_mhz: 1980,
                batch_size: 64,
                token_budget: 8192,
            },
            predicted_tokens_per_joule: 1.0,
            predicted_tpot_ms: 10.0,
            simulated_tokens_per_joule: 1.0,
            simulated_violation_fraction: violation,
            feasible: true,
            settings_scored: 1,
            settings_simulated: 1,
        }
    }

    #[test]
    fn the_oracle_violations_are_weighted_by_phase_length() {
        let phases = [phase(0.0, 300.0, 0.0), phase(300.0, 400.0, 0.04)];
        assert!((eval::oracle::violation_fraction(&phases) - 0.01).abs() < 1e-12);
        assert!(eval::oracle::violation_fraction(&[]).is_nan());
    }

    #[test]
    fn a_missing_component_is_refused_with_the_fix() {
        let dir = tempfile::tempdir().expect("temp dir");
        let error = minimal_spec(&dir.path().join("absent.wasm"), dir.path())
            .expect_err("no file")
            .to_string();
        assert!(error.contains("build it first"), "{error}");
    }

    #[test]
    fn the_minimal_spec_loads() {
        let dir = tempfile::tempdir().expect("temp dir");
        let wasm = dir.path().join("my_policy.wasm");
        std::fs::write(&wasm, b"\0asm").expect("write");
        let path = minimal_spec(&wasm, dir.path()).expect("spec written");
        let spec = tokwatt_policy::spec::PolicySpec::load(&path).expect("the spec loads");
        assert_eq!(spec.name, "my_policy");
        assert_eq!(spec.tick_ms, 1000);
        assert!(spec.knobs.power_cap && spec.knobs.sm_clock && spec.knobs.batch_size);
    }
}
