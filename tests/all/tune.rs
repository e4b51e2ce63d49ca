//! `tokwatt tune` on the simulator: the search finds the grid's best within 1 % for at
//! most a quarter of the grid's simulated time; its command refuses bad ranges, drops a
//! candidate the policy refuses, and writes tune.json and a spec that loads.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use tokwatt::ab::Schedule;
use tokwatt::ab::stats::Tolerances;
use tokwatt::ab::tune::{self, ParamRange, TuneRequest};
use tokwatt::agent::{self, RunRequest};
use tokwatt::assembly::{self, BackendRequest, SimTarget, Target};
use tokwatt::spec::PolicySpec;

use crate::support::{self, stderr, tokwatt};

/// Steady demand: every grid point and every A/B epoch sees the same load, so the grid's
/// score of a point is a property of the point, not of when it ran.
const STEADY: &str = r#"description = "steady 40 requests/s (llama-3-8b, ctx 1024)"
model = "llama-3-8b"
context_tokens = 1024
output_tokens = 256
batch_size_max = 512
initial_batch_size = 512
queue_max = 2048
[[phases]]
start_s = 0
arrival_rps = 40.0
"#;

/// Each grid point runs alone for this long: 30 simulated minutes, the judge's scenario
/// length.
const GRID_DURATION: Duration = Duration::from_secs(1800);
const SEED: u64 = 1;

/// A grid point: its params, its tokens per joule, whether it kept the objective.
type GridPoint = (Vec<(String, String)>, f64, bool);
const COOLDOWN: u64 = 2;
const WARMUP: u64 = 30;
const MEASURE: u64 = 15;

/// The shipped `static` spec with an objective (TPOT p99 ≤ 25 ms), so that the lowest
/// clocks and caps, which have the most tokens per joule, break it; the plugin path is
/// made absolute so the copy finds it.
fn static_spec(dir: &Path) -> (PathBuf, String) {
    let shipped = std::fs::read_to_string(support::repo_root().join("policies/static.toml"))
        .expect("policies/static.toml");
    let plugin = support::built_plugin("policy_static");
    let text = shipped
        .replace(
            "plugin = \"policy_static.wasm\"",
            &format!("plugin = \"{}\"", plugin.display()),
        )
        .replace("[objective]\n", "[objective]\ntpot_p99_limit_ms = 25.0\n");
    assert!(text.contains("tpot_p99_limit_ms = 25.0"), "{text}");
    let path = dir.join("static.toml");
    std::fs::write(&path, &text).expect("write spec");
    (path, text)
}

fn cache_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("component-cache")
}

/// One grid point run alone for `GRID_DURATION`: tokens per joule of the simulator's true
/// energy, served fraction and violation ticks per tick.
fn grid_point(spec: &PolicySpec, scenario: &Path) -> (f64, f64, f64) {
    let request = BackendRequest {
        target: Target::Sim(SimTarget {
            profile: "h200".into(),
            scenario: Some(scenario.to_owned()),
            gpus: 1,
            realtime: false,
        }),
        seed: SEED,
        batch_only: false,
    };
    let assembled = assembly::assemble(&request, &spec.name, spec.knobs).expect("sim");
    let sim = assembled.sim.clone().expect("a simulator");
    let run = RunRequest {
        spec: spec.clone(),
        duration: GRID_DURATION,
        tick: None,
        out_dir: PathBuf::from("unused"),
        plugin_dirs: vec![],
        cache_dir: Some(cache_dir()),
        seed: SEED,
        overwrite: false,
        write_files: false,
        rules: tokwatt::rules::NodeRules::judging(),
        rules_source: "the default node rules".into(),
        node_knobs: tokwatt::types::Knobs::all(),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (summary, _) = agent::run(&run, assembled.backends, assembled.meta, stop, &mut |_| {})
        .expect("grid point runs");
    let truth = sim.truth(0).expect("gpu 0");
    let totals = &summary.totals;
    let served = totals.demand.as_ref().expect("demand").served_fraction;
    (
        truth.tokens / truth.energy_j,
        served,
        totals.slo_violation_ticks as f64 / totals.ticks as f64,
    )
}

#[test]
fn tune_finds_the_grid_best_within_one_percent_in_a_quarter_of_its_time() {
    let dir = support::tempdir();
    let (spec_path, _) = static_spec(dir.path());
    let ranges = vec![
        ParamRange::parse("power_cap_w=350..450:50").expect("range"),
        ParamRange::parse("sm_clock_max_mhz=900..1300:50").expect("range"),
    ];
    let outcome = judged_tune(dir.path(), &spec_path, ranges, 0.25, true);
    assert_eq!(outcome.rounds.len(), 3, "27 → 9 → 3 → 1");
    assert_eq!(outcome.rounds[0].candidates.len(), 27);
    assert_eq!(outcome.rounds[1].candidates.len(), 9);
}

/// Runs the grid (every point alone for `GRID_DURATION`, judged as tune judges) and tune
/// over `ranges` on the steady scenario, prints both, and holds tune's pick to within 1 %
/// of the grid's best compliant point for at most `time_share` of the grid's simulated
/// time. `objective_bites`: some point must beat the best by breaking the objective.
fn judged_tune(
    dir: &Path,
    spec_path: &Path,
    ranges: Vec<ParamRange>,
    time_share: f64,
    objective_bites: bool,
) -> tune::TuneOutcome {
    let scenario = dir.join("steady.toml");
    std::fs::write(&scenario, STEADY).expect("write scenario");
    let reference = PolicySpec::load(spec_path).expect("spec loads");

    // The grid: every point alone, judged as tune judges (against the spec as given).
    let tolerances = Tolerances::default();
    let (_, reference_served, reference_violations) = grid_point(&reference, &scenario);
    let grid: Vec<GridPoint> = tune::candidates(&ranges)
        .expect("grid")
        .into_iter()
        .map(|params| {
            let (tpj, served, violations) =
                grid_point(&tune::candidate_spec(&reference, &params), &scenario);
            let compliant = reference_served - served <= tolerances.served_fraction
                && violations - reference_violations <= tolerances.violation_rate;
            (params, tpj, compliant)
        })
        .collect();
    let grid_time_s = grid.len() as f64 * GRID_DURATION.as_secs_f64();
    let (best_params, best_tpj, _) = grid
        .iter()
        .filter(|(_, _, compliant)| *compliant)
        .max_by(|x, y| x.1.total_cmp(&y.1))
        .expect("a compliant point");
    if objective_bites {
        assert!(
            grid.iter()
                .any(|(_, tpj, compliant)| !compliant && tpj > best_tpj),
            "the objective never bites on this grid"
        );
    }

    let request = TuneRequest {
        reference: reference.clone(),
        ranges,
        sim: SimTarget {
            profile: "h200".into(),
            scenario: Some(scenario.clone()),
            gpus: 1,
            realtime: false,
        },
        seed: SEED,
        eta: 3,
        first_round_pairs: 2,
        alpha: 0.05,
        schedule: Schedule {
            cooldown_ticks: COOLDOWN,
            settle_ticks: 0,
            warmup_ticks: WARMUP,
            measure_ticks: MEASURE,
        },
        plugin_dirs: vec![],
        cache_dir: Some(cache_dir()),
    };
    let outcome =
        tune::tune(&request, Arc::new(AtomicBool::new(false)), &mut |_| {}).expect("tune runs");
    let (_, pick_tpj, pick_compliant) = grid
        .iter()
        .find(|(params, _, _)| *params == outcome.winner)
        .expect("the winner is a grid point");
    for (params, tpj, compliant) in &grid {
        println!(
            "grid {:<40} {tpj:.4} tokens/J{}",
            tune::format_params(params),
            if *compliant {
                ""
            } else {
                " (breaks the objective)"
            }
        );
    }
    for round in &outcome.rounds {
        for c in &round.candidates {
            println!(
                "round {} #{} {:<40} B/A {:.4} [{:.4}, {:.4}] {} pairs served {:.4} violations {:.4}{}",
                round.round,
                c.rank,
                tune::format_params(&c.params),
                c.ratio,
                c.ci_low,
                c.ci_high,
                c.pairs,
                c.served_fraction,
                c.violation_rate,
                if c.compliant { "" } else { " (not compliant)" }
            );
        }
    }
    let ratio = outcome.simulated_time_s / grid_time_s;
    println!(
        "grid: {} points × {} s = {grid_time_s:.0} s simulated; best {} at {best_tpj:.4} tokens/J",
        grid.len(),
        GRID_DURATION.as_secs(),
        tune::format_params(best_params)
    );
    println!(
        "tune: {} rounds, {:.0} s simulated ({:.1} % of the grid's); picked {} at {pick_tpj:.4} tokens/J on the grid ({:.2} % of the best); simulator output",
        outcome.rounds.len(),
        outcome.simulated_time_s,
        ratio * 100.0,
        tune::format_params(&outcome.winner),
        pick_tpj / best_tpj * 100.0
    );
    assert!(
        *pick_compliant,
        "tune picked a point that breaks the objective"
    );
    assert!(
        *pick_tpj >= 0.99 * best_tpj,
        "tune's pick {pick_tpj} is not within 1 % of the grid's best {best_tpj}"
    );
    assert!(
        ratio <= time_share,
        "tune used {:.1} % of the grid's time",
        ratio * 100.0
    );
    assert!(outcome.evidence.compliant);
    assert!(outcome.simulated);
    outcome
}

fn run_tune(args: &[&str]) -> std::process::Output {
    tokwatt()
        .args(["tune", "--sim", "h200", "--quiet"])
        .args(args)
        .output()
        .expect("tokwatt runs")
}

#[test]
fn bad_ranges_are_refused_with_the_param_and_the_fix() {
    let dir = support::tempdir();
    let (spec, _) = static_spec(dir.path());
    let spec = spec.to_str().expect("utf-8");
    for (param, says) in [
        ("power_cap_w=300..700", "no step"),
        ("power_cap_w=700..300:50", "below the low bound"),
        ("power_cap_w", "no `=`"),
    ] {
        let out = dir.path().join("never");
        let output = run_tune(
            &["--policy", spec, "--param", param, "--out"]
                .into_iter()
                .chain([out.to_str().expect("utf-8")])
                .collect::<Vec<_>>(),
        );
        assert!(!output.status.success());
        let err = stderr(&output);
        assert!(err.contains(param) && err.contains(says), "{err}");
        assert!(err.contains("NAME=LO..HI:STEP"), "{err}");
        assert!(!out.exists(), "nothing is written for bad input");
    }
    let output = run_tune(&[
        "--policy",
        spec,
        "--param",
        "power_cap_w=1..100:1",
        "--param",
        "sm_clock_max_mhz=1..100:1",
    ]);
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("10000 candidates"),
        "{}",
        stderr(&output)
    );
    // Real GPUs: said, not attempted.
    let output = tokwatt()
        .args([
            "tune",
            "--gpu",
            "0",
            "--policy",
            spec,
            "--param",
            "power_cap_w=300,400",
        ])
        .output()
        .expect("tokwatt runs");
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("tokwatt ab"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn the_command_drops_a_refused_candidate_and_writes_a_spec_that_loads() {
    let dir = support::tempdir();
    let (spec, _) = static_spec(dir.path());
    let out = dir.path().join("tune");
    let output = tokwatt()
        .args([
            "tune",
            "--sim",
            "h200",
            "--quiet",
            "--epoch",
            "15s",
            "--warmup",
            "30s",
            "--cooldown",
            "2s",
        ])
        .arg("--policy")
        .arg(&spec)
        .args([
            "--param",
            "power_cap_w=450,lots",
            "--param",
            "sm_clock_max_mhz=1100,1300",
        ])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("tokwatt runs");
    let err = stderr(&output);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{err}\n{stdout}");
    assert!(
        err.contains("power_cap_w=lots") && err.contains("dropped"),
        "{err}"
    );
    assert!(stdout.contains("round 1: 2 candidates"), "{stdout}");
    assert!(stdout.contains("simulator output"), "{stdout}");

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tune.json")).expect("tune.json"))
            .expect("json");
    for key in [
        "format_version",
        "policy",
        "rounds",
        "winner",
        "evidence",
        "dropped",
        "simulated_time_s",
        "simulated",
        "data_source",
        "candidates",
    ] {
        assert!(json.get(key).is_some(), "{key} missing");
    }
    for key in [
        "ratio_b_over_a",
        "ci_low",
        "ci_high",
        "decision",
        "served_fraction_winner",
        "violation_ticks_winner",
    ] {
        assert!(
            json["evidence"].get(key).is_some(),
            "evidence.{key} missing"
        );
    }
    assert_eq!(json["simulated"], true);
    assert_eq!(json["dropped"].as_array().expect("array").len(), 2);
    let round = &json["rounds"][0]["candidates"][0];
    for key in [
        "params",
        "ratio",
        "ci_low",
        "ci_high",
        "kept",
        "compliant",
        "run_time_s",
    ] {
        assert!(
            round.get(key).is_some(),
            "rounds[].candidates[].{key} missing"
        );
    }
    let simulated = json["simulated_time_s"].as_f64().expect("number");
    let summed: f64 = json["rounds"]
        .as_array()
        .expect("rounds")
        .iter()
        .flat_map(|r| r["candidates"].as_array().expect("candidates").clone())
        .map(|c| c["run_time_s"].as_f64().expect("number"))
        .sum();
    assert!(
        simulated > 0.0 && (simulated - summed).abs() < 1e-6,
        "{simulated} vs {summed}"
    );

    let tuned = PolicySpec::load(&out.join("static-tuned.toml")).expect("the tuned spec loads");
    let winner: Vec<(String, String)> =
        serde_json::from_value(json["winner"].clone()).expect("winner");
    assert_eq!(winner.len(), 2);
    for (name, value) in &winner {
        assert!(
            tuned.params.contains(&(name.clone(), value.clone())),
            "{name}={value}"
        );
    }
    assert_eq!(tuned.params.len(), 2, "{:?}", tuned.params);
    assert_eq!(tuned.objective.tpot_p99_limit_ms, Some(25.0));
    let report = std::fs::read_to_string(out.join("report.html")).expect("report.html");
    assert!(report.contains("Round 1") && report.contains("Simulator output"));
}
