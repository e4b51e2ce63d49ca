//! `tokwatt tune` on the simulator: the search finds the grid's best within 1 % for at
//! most a quarter of the grid's simulated time for a static policy, and a third for an
//! adaptive one (its grid measured as tune measures, by trajectories); its command
//! refuses bad ranges, drops a candidate the policy refuses, and writes tune.json and a
//! spec that loads.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use tokwatt_agent::assembly::{self, BackendRequest, SimTarget, Target};
use tokwatt_agent::{self as agent, RunRequest};
use tokwatt_lab::ab::stats::{Compliance, Tolerances, objective_check};
use tokwatt_lab::ab::tune::{self, ParamRange, TuneRequest};
use tokwatt_lab::ab::{AbRequest, Arm, Schedule, SequentialPlan, SimWork, run_replicated};
use tokwatt_policy::spec::PolicySpec;

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

/// A grid point: its params, its score (tokens per joule, or its ratio to the reference:
/// see [`Grid`]), whether it kept the objective.
type GridPoint = (Vec<(String, String)>, f64, bool);
/// Seeds the trajectory grid: not tune's `SEED`, so the grid's draws are not tune's.
const GRID_SEED: u64 = 1_000_001;
const COOLDOWN: u64 = 2;
const WARMUP: u64 = 30;
const MEASURE: u64 = 15;

/// The shipped `static` spec with an objective (TPOT p99 ≤ 25 ms), so that the lowest
/// clocks and caps, which have the most tokens per joule, break it.
fn static_spec(dir: &Path) -> (PathBuf, String) {
    let (path, text) = shipped_spec(dir, "static", "policy_static");
    let text = text.replace("[objective]\n", "[objective]\ntpot_p99_limit_ms = 25.0\n");
    assert!(text.contains("tpot_p99_limit_ms = 25.0"), "{text}");
    std::fs::write(&path, &text).expect("write spec");
    (path, text)
}

/// A copy of the shipped `policies/{name}.toml` in `dir`, its plugin path made absolute so
/// the copy finds it.
fn shipped_spec(dir: &Path, name: &str, plugin: &str) -> (PathBuf, String) {
    let shipped =
        std::fs::read_to_string(support::repo_root().join(format!("policies/{name}.toml")))
            .expect("the shipped spec");
    let built = support::built_plugin(plugin);
    let text = shipped.replace(
        &format!("plugin = \"{plugin}.wasm\""),
        &format!("plugin = \"{}\"", built.display()),
    );
    assert!(text.contains(&built.display().to_string()), "{text}");
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, &text).expect("write spec");
    (path, text)
}

/// How tune searches: its A/Bs' epochs (which the trajectory grid measures too) and the
/// first round's pairs.
#[derive(Clone, Copy)]
struct Search {
    schedule: Schedule,
    first_round_pairs: usize,
}

/// Cold starts measured from tick 30 for `measure_ticks` ticks.
fn schedule(measure_ticks: u64) -> Schedule {
    Schedule {
        cooldown_ticks: COOLDOWN,
        settle_ticks: 0,
        warmup_ticks: WARMUP,
        measure_ticks,
    }
}

fn steady_sim(scenario: &Path) -> SimTarget {
    SimTarget {
        profile: "h200".into(),
        scenario: Some(scenario.to_owned()),
        gpus: 1,
        realtime: false,
        driver: None,
    }
}

/// An adaptive policy's grid point as tune's A/Bs see one: `pairs` cold-start trajectories
/// of the point against as many of the reference (a pair on the same work), all measured
/// (one look), judged by the A/B's objective rule. Its ratio to the reference, whether it
/// keeps the objective, and the A/B's simulated time.
fn trajectory_grid_point(
    reference: &PolicySpec,
    params: &[(String, String)],
    scenario: &Path,
    pairs: usize,
    schedule: Schedule,
) -> (f64, bool, f64) {
    const ALPHA: f64 = 0.05;
    let sim = steady_sim(scenario);
    let backend = BackendRequest {
        target: Target::Sim(sim.clone()),
        seed: GRID_SEED,
        batch_only: false,
    };
    // As tune does: the reference with the knobs the simulator grants.
    let assembled = assembly::assemble(&backend, &reference.name, reference.knobs).expect("sim");
    let mut reference = reference.clone();
    reference.knobs = assembled.knobs;
    let request = AbRequest {
        b: tune::candidate_spec(&reference, params),
        a: reference.clone(),
        schedule,
        plan: SequentialPlan::single_look(pairs, ALPHA, GRID_SEED).expect("plan"),
        seed: GRID_SEED,
        plugin_dirs: vec![],
        cache_dir: Some(cache_dir()),
        injected_ratio: None,
    };
    let tick = Duration::from_millis(u64::from(reference.tick_ms));
    let work = SimWork::of(&sim, None, &request.schedule, tick).expect("work");
    let outcome = run_replicated(
        &request,
        &|w| work.build(w),
        work.span_s,
        assembled.meta,
        Arc::new(AtomicBool::new(false)),
        &mut |_| {},
    )
    .expect("grid point runs");
    assert_eq!(outcome.pairs.len(), pairs, "every pair measured");
    println!(
        "grid point {}: B/A {:.4} [{:.4}, {:.4}], pairs' sd {:.4}",
        tune::format_params(params),
        outcome.ratio_b_over_a,
        outcome.ci_low,
        outcome.ci_high,
        outcome.spread.pairs
    );
    let check = objective_check(&outcome.pairs, Arm::B, &Tolerances::default(), ALPHA)
        .expect("measurements");
    (
        outcome.ratio_b_over_a,
        check.compliance != Compliance::Breaks,
        outcome.run_time_s,
    )
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
            driver: None,
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
        rules: tokwatt_policy::rules::NodeRules::judging(),
        rules_source: "the default node rules".into(),
        node_knobs: tokwatt_core::types::Knobs::all(),
        output: tokwatt_agent::recorder::OutputBounds::default(),
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
    let search = Search {
        schedule: schedule(MEASURE),
        first_round_pairs: 2,
    };
    let outcome = judged_tune(
        dir.path(),
        &spec_path,
        ranges,
        0.25,
        true,
        Grid::LongRuns,
        search,
    );
    assert_eq!(outcome.rounds.len(), 3, "27 → 9 → 3 → 1");
    assert_eq!(outcome.rounds[0].candidates.len(), 27);
    assert_eq!(outcome.rounds[1].candidates.len(), 9);
}

#[test]
fn tune_finds_an_adaptive_policys_grid_best_within_one_percent_in_a_third_of_its_time() {
    // `slo-batch` learns its batch and walks its clock down from a cold start: a point's
    // tokens per joule is a distribution over runs, and tune's A/Bs compare trajectories.
    let dir = support::tempdir();
    let (spec_path, _) = shipped_spec(dir.path(), "slo-batch", "policy_slo_batch");
    let ranges = vec![
        ParamRange::parse("headroom=0.8,0.85,0.9,0.95").expect("range"),
        ParamRange::parse("clock_step_down=0.15,0.25,0.35").expect("range"),
    ];
    // Two cold-start runs of one point differ by 5-6.5 % over 90 ticks (the pairs' sd), so
    // the grid measures each point over 288 pairs (95 % interval about ±0.7 %: finer than
    // the 1 % it judges), and tune starts at 12 pairs a candidate: its last round (108
    // pairs) must tell 1 % apart. (At 4, rounds of 4, 12 and 36 pairs picked a point 1.4 %
    // below the best once the policy's margin followed its p99's scatter.)
    let search = Search {
        schedule: schedule(60),
        first_round_pairs: 12,
    };
    let outcome = judged_tune(
        dir.path(),
        &spec_path,
        ranges,
        1.0 / 3.0,
        false,
        Grid::Trajectories { pairs: 288 },
        search,
    );
    assert_eq!(outcome.rounds[0].candidates.len(), 12);
    assert!(outcome.rounds.len() >= 2, "it halved at least once");
}

/// How the test measures the grid it holds tune to.
enum Grid {
    /// Every point alone for `GRID_DURATION`, scored by tokens per joule: a static policy's
    /// point is a setting, and one long run measures it.
    LongRuns,
    /// Every point against the reference over `pairs` pairs of cold-start trajectories (the
    /// estimand tune's A/Bs estimate), scored by its ratio to the reference, at a seed tune
    /// does not use: an adaptive policy's point is a distribution of runs, and one run
    /// measures a draw of it.
    Trajectories { pairs: usize },
}

/// Runs the grid (`grid` says how, judged by the rule tune judges by) and tune over
/// `ranges` on the steady scenario, prints both, and holds tune's pick to within 1 % of
/// the grid's best compliant point for at most `time_share` of the grid's simulated
/// time. `objective_bites`: some point must beat the best by breaking the objective.
fn judged_tune(
    dir: &Path,
    spec_path: &Path,
    ranges: Vec<ParamRange>,
    time_share: f64,
    objective_bites: bool,
    grid: Grid,
    search: Search,
) -> tune::TuneOutcome {
    let scenario = dir.join("steady.toml");
    std::fs::write(&scenario, STEADY).expect("write scenario");
    let reference = PolicySpec::load(spec_path).expect("spec loads");
    let points = tune::candidates(&ranges).expect("grid");
    let (grid, grid_time_s): (Vec<GridPoint>, f64) = match grid {
        Grid::LongRuns => {
            let tolerances = Tolerances::default();
            let (_, reference_served, reference_violations) = grid_point(&reference, &scenario);
            let grid = points
                .into_iter()
                .map(|params| {
                    let (tpj, served, violations) =
                        grid_point(&tune::candidate_spec(&reference, &params), &scenario);
                    let compliant = reference_served - served <= tolerances.served_fraction
                        && violations - reference_violations <= tolerances.violation_rate;
                    (params, tpj, compliant)
                })
                .collect::<Vec<_>>();
            let time = grid.len() as f64 * GRID_DURATION.as_secs_f64();
            (grid, time)
        }
        Grid::Trajectories { pairs } => {
            let mut time = 0.0;
            let grid = points
                .into_iter()
                .map(|params| {
                    let (ratio, compliant, run_time_s) = trajectory_grid_point(
                        &reference,
                        &params,
                        &scenario,
                        pairs,
                        search.schedule,
                    );
                    // Half of each A/B is the point's own trajectories; the reference's are
                    // run once for the whole grid (added below).
                    time += run_time_s / 2.0;
                    (params, ratio, compliant)
                })
                .collect::<Vec<_>>();
            let per_point = time / grid.len().max(1) as f64;
            (grid, time + per_point)
        }
    };
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
        sim: steady_sim(&scenario),
        seed: SEED,
        eta: 3,
        first_round_pairs: search.first_round_pairs,
        alpha: 0.05,
        schedule: search.schedule,
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
            "grid {:<40} {tpj:.4}{}",
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
        "grid: {} points, {grid_time_s:.0} s simulated; best {} at {best_tpj:.4}",
        grid.len(),
        tune::format_params(best_params)
    );
    println!(
        "tune: {} rounds, {:.0} s simulated ({:.1} % of the grid's); picked {} at {pick_tpj:.4} on the grid ({:.2} % of the best); simulator output",
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
