//! `tokwatt ab` on the simulator with known truth: the false-positive rate of A/A
//! comparisons and the power against a true ~3 % difference, each over 200 seeds (whole
//! A/B runs through the agent's loop on the virtual clock), and the command end to end:
//! ab.json's keys, the crossover mode on two simulated GPUs, an arm that wins tokens per
//! joule by serving less, and bad input.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokwatt_agent::assembly::SimTarget;
use tokwatt_lab::ab::Schedule;
use tokwatt_lab::ab::stats::{DEFAULT_ALPHA, DEFAULT_BUDGET};
use tokwatt_lab::ab::study::{Study, long_run_ratio, run_study};
use tokwatt_policy::spec::PolicySpec;

use crate::support::*;

const SEEDS: u64 = 200;

fn steady() -> PathBuf {
    repo_root().join("host/scenarios/steady.toml")
}

fn static_spec(cap_w: u32) -> PolicySpec {
    let mut spec = PolicySpec::load(&repo_root().join("policies/static.toml")).expect("spec");
    for param in &mut spec.params {
        if param.0 == "power_cap_w" {
            param.1 = cap_w.to_string();
        }
    }
    spec
}

fn study(a: PolicySpec, b: PolicySpec, schedule: Schedule) -> Study {
    Study {
        a,
        b,
        sim: SimTarget {
            scenario: Some(steady()),
            ..SimTarget::new("h200")
        },
        judging: None,
        mode: tokwatt_lab::ab::Mode::Replicated,
        schedule,
        budget_pairs: DEFAULT_BUDGET,
        alpha: DEFAULT_ALPHA,
        seeds: 0..SEEDS,
        threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
        plugin_dirs: Vec::new(),
        cache_dir: Some(Path::new(env!("CARGO_TARGET_TMPDIR")).join("component-cache")),
        injected_ratio: None,
    }
}

/// The A/A rate does not depend on the epochs' length (noise is noise), so this study
/// uses short ones: it always runs to the budget.
#[test]
fn a_a_comparisons_over_200_seeds_name_a_winner_at_most_5_percent_of_the_time() {
    if !crate::support::run_slow("the A/A error-rate study (200 comparisons)") {
        return;
    }
    let schedule = Schedule {
        cooldown_ticks: 0,
        settle_ticks: 0,
        warmup_ticks: 3,
        measure_ticks: 20,
    };
    let result = run_study(&study(static_spec(500), static_spec(500), schedule)).expect("study");
    println!(
        "simulator A/A, {SEEDS} seeds, budget {DEFAULT_BUDGET} pairs of 20 s epochs: winner named {:.1} % (a {}, b {}), median B/A {:.4}",
        result.winner_rate() * 100.0,
        result.decided_a,
        result.decided_b,
        result.median_ratio
    );
    assert_eq!(result.comparisons, SEEDS as usize);
    assert!(
        result.winner_rate() <= 0.05,
        "A/A named a winner in {:.1} % of {SEEDS} comparisons",
        result.winner_rate() * 100.0
    );
    assert!((result.median_ratio - 1.0).abs() < 0.01, "{result:?}");
}

/// The power needs the default epochs (60 s measured); the warm-up is shortened and the
/// cool-down left out, which cost time but add no power.
#[test]
fn a_true_3_percent_difference_is_found_with_at_least_90_percent_power() {
    if !crate::support::run_slow("the A/B power study (200 comparisons)") {
        return;
    }
    let schedule = Schedule {
        cooldown_ticks: 0,
        settle_ticks: 0,
        warmup_ticks: 3,
        measure_ticks: 60,
    };
    let study = study(static_spec(500), static_spec(486), schedule);
    let (_, _, truth) = long_run_ratio(&study, Duration::from_secs(4 * 3600), 1).expect("truth");
    let result = run_study(&study).expect("study");
    println!(
        "simulator A/B, true B/A {truth:.4} (4 h runs), {SEEDS} seeds, budget {DEFAULT_BUDGET} pairs of 60 s epochs: B named {:.1} %, A {}, mean pairs {:.1}, median B/A {:.4}",
        result.b_rate() * 100.0,
        result.decided_a,
        result.mean_pairs,
        result.median_ratio
    );
    assert!(
        (1.02..=1.031).contains(&truth),
        "the known difference should be about 3 %, not {truth}"
    );
    assert_eq!(result.decided_a, 0, "{result:?}");
    assert!(result.b_rate() >= 0.9, "power {:.3}", result.b_rate());
    // Stopping early is what the looks are for.
    assert!(result.mean_pairs < DEFAULT_BUDGET as f64, "{result:?}");
}

fn write_static(dir: &Path, name: &str, cap_w: u32, extra_params: &str) -> PathBuf {
    let text = std::fs::read_to_string(repo_root().join("policies/static.toml")).expect("spec");
    let text = text
        .replace(
            "power_cap_w = \"500\"",
            &format!("power_cap_w = \"{cap_w}\"\n{extra_params}"),
        )
        .replace("name = \"static\"", &format!("name = \"{name}\""))
        .replace(
            "plugin = \"policy_static.wasm\"",
            &format!("plugin = \"{}\"", built_plugin("policy_static").display()),
        );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).expect("write spec");
    path
}

fn run_ab(
    a: &Path,
    b: &Path,
    out: &Path,
    extra: &[&str],
) -> (std::process::Output, serde_json::Value) {
    let output = tokwatt()
        .args(["ab", "--sim", "h200", "--quiet", "--overwrite"])
        .arg("--a")
        .arg(a)
        .arg("--b")
        .arg(b)
        .arg("--scenario")
        .arg(steady())
        .arg("--out")
        .arg(out)
        .args(extra)
        .output()
        .expect("tokwatt ab");
    let json = std::fs::read_to_string(out.join("ab.json"))
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or(serde_json::Value::Null);
    (output, json)
}

const SHORT: [&str; 6] = ["--budget", "8", "--epoch", "30s", "--warmup", "5s"];

#[test]
fn the_command_writes_every_key_of_ab_json_and_names_the_better_arm() {
    let dir = tempdir();
    let a = write_static(dir.path(), "cap500", 500, "");
    let b = write_static(dir.path(), "cap430", 430, "");
    let out = dir.path().join("ab");
    // One simulated node taking turns, as on a real one (the simulator's default is the
    // replicated mode, below).
    let mut args = SHORT.to_vec();
    args.push("--interleaved");
    let (output, json) = run_ab(&a, &b, &out, &args);
    assert!(output.status.success(), "{}", stderr(&output));
    for key in [
        "a",
        "b",
        "epochs",
        "ratio_b_over_a",
        "ci_low",
        "ci_high",
        "confidence",
        "decision",
        "served_fraction_a",
        "served_fraction_b",
        "violation_ticks_a",
        "violation_ticks_b",
        "looks",
        "pairs",
        "mode",
        "meta",
        "timeline",
        "estimand",
        "spread",
    ] {
        assert!(json.get(key).is_some(), "ab.json lacks {key}");
    }
    assert_eq!(json["decision"], "b", "{}", json["looks"]);
    assert_eq!(json["mode"], "interleaved");
    assert_eq!(json["a"]["policy"], "cap500");
    assert!(json["meta"]["simulated"].as_bool().unwrap_or(false));
    let ratio = json["ratio_b_over_a"].as_f64().expect("ratio");
    let (low, high) = (
        json["ci_low"].as_f64().unwrap(),
        json["ci_high"].as_f64().unwrap(),
    );
    assert!(
        1.0 < low && low <= ratio && ratio <= high,
        "{ratio} [{low}, {high}]"
    );
    // Every pair has one epoch of each arm, in either order, and both orders occur.
    let epochs = json["epochs"].as_array().expect("epochs");
    let pairs = json["pairs"].as_array().expect("pairs").len();
    assert_eq!(epochs.len(), 2 * pairs);
    let firsts: Vec<&str> = epochs
        .iter()
        .filter(|e| e["position"] == 0)
        .map(|e| e["arm"].as_str().unwrap_or(""))
        .collect();
    assert!(firsts.contains(&"a") && firsts.contains(&"b"), "{firsts:?}");
    // A measured window starts after its warm-up: no two epochs overlap.
    let mut last = None;
    for e in epochs {
        let (first, end) = (
            e["first_tick"].as_u64().unwrap(),
            e["last_tick"].as_u64().unwrap(),
        );
        assert_eq!(end - first + 1, 30, "{e}");
        if let Some(previous) = last {
            assert!(
                first > previous + 5,
                "warm-up and cool-down precede every epoch: {e}"
            );
        }
        last = Some(end);
    }
    let report = std::fs::read_to_string(out.join("report.html")).unwrap_or_default();
    assert!(report.contains("cap430"), "report.html names the arms");
}

/// The unit of replication is a trajectory: every epoch is a fresh instance of its arm's
/// policy with a seed of its own and no state. The stateful fixture asks for 200 + n W at
/// its n-th `decide`, counting on through its snapshots: were an arm's state carried from
/// epoch to epoch (one instance's trajectory read as many samples), its requests would
/// climb epoch after epoch; fresh, every epoch ends where the first did.
#[test]
fn every_epoch_is_a_fresh_trajectory_with_its_own_seed_under_either_estimand() {
    let dir = tempdir();
    let spec = write_spec(
        dir.path(),
        "stateful",
        &built_plugin("fixture_stateful"),
        "",
    );
    let mut ends = Vec::new();
    for (estimand, extra) in [
        ("cold-start", &[][..]),
        ("settled", &["--estimand", "settled", "--settle", "4s"][..]),
    ] {
        let out = dir.path().join(estimand);
        let mut args = vec!["--budget", "4", "--epoch", "3s", "--warmup", "2s"];
        args.extend(extra);
        let (output, json) = run_ab(&spec, &spec, &out, &args);
        assert!(output.status.success(), "{}", stderr(&output));
        assert_eq!(json["mode"], "replicated", "the simulator's default");
        assert_eq!(json["estimand"]["kind"], estimand, "{}", json["estimand"]);
        let unit = json["estimand"]["unit_of_replication"]
            .as_str()
            .unwrap_or_default();
        assert!(unit.contains("trajectory"), "{unit}");
        let epochs = json["epochs"].as_array().expect("epochs");
        assert_eq!(epochs.len(), 8);
        let asked: Vec<f64> = epochs
            .iter()
            .map(|e| {
                e["settings"][0]["power_cap_requested_w"]
                    .as_f64()
                    .unwrap_or(f64::NAN)
            })
            .collect();
        assert!(
            asked.iter().all(|&cap| cap == asked[0]),
            "{estimand}: every trajectory starts afresh: {asked:?}"
        );
        let seeds: std::collections::BTreeSet<u64> =
            epochs.iter().filter_map(|e| e["seed"].as_u64()).collect();
        assert_eq!(
            seeds.len(),
            epochs.len(),
            "a seed per trajectory: {seeds:?}"
        );
        for key in ["within_a", "within_b", "pairs", "between_arms"] {
            assert!(
                json["spread"][key].is_number(),
                "spread.{key}: {}",
                json["spread"]
            );
        }
        ends.push(asked[0]);
    }
    // Settling is running unmeasured: 4 more decides before the window ends.
    assert_eq!(ends[1], ends[0] + 4.0, "{ends:?}");
}

#[test]
fn crossover_on_two_simulated_gpus_runs_each_arm_on_each_gpu_in_every_block() {
    let dir = tempdir();
    let a = write_static(dir.path(), "cap500", 500, "");
    let b = write_static(dir.path(), "cap430", 430, "");
    let out = dir.path().join("cross");
    let mut args = SHORT.to_vec();
    args.extend(["--crossover", "--gpus", "2"]);
    let (output, json) = run_ab(&a, &b, &out, &args);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(json["mode"], "crossover");
    assert_eq!(json["decision"], "b", "{}", json["looks"]);
    let epochs = json["epochs"].as_array().expect("epochs");
    let blocks = json["pairs"].as_array().expect("pairs").len();
    assert_eq!(epochs.len(), 4 * blocks, "two GPUs, two periods per block");
    for block in 0..blocks {
        for period in 0..2u64 {
            let arms: Vec<&str> = epochs
                .iter()
                .filter(|e| e["pair"] == block && e["position"] == period)
                .map(|e| e["arm"].as_str().unwrap_or(""))
                .collect();
            assert_eq!(arms.len(), 2, "block {block}");
            assert_ne!(arms[0], arms[1], "A and B side by side in block {block}");
        }
    }
    let timeline_groups: std::collections::BTreeSet<u64> = json["timeline"]
        .as_array()
        .expect("timeline")
        .iter()
        .filter_map(|p| p["group"].as_u64())
        .collect();
    assert_eq!(timeline_groups.len(), 2);
    let groups: std::collections::BTreeSet<u64> =
        epochs.iter().filter_map(|e| e["group"].as_u64()).collect();
    assert_eq!(groups.into_iter().collect::<Vec<_>>(), vec![0, 1]);
    // The GPU-to-GPU difference it cancelled: two simulated H200s of one profile differ
    // only by their noise.
    let difference = &json["gpu_difference"];
    assert_eq!(difference["blocks"].as_u64(), Some(blocks as u64));
    let vs_group_0 = difference["groups"][1]["vs_group_0"]
        .as_f64()
        .expect("group 1 against group 0");
    assert!((vs_group_0 - 1.0).abs() < 0.02, "{difference}");
    assert_eq!(difference["unswapped"].as_array().map(Vec::len), Some(2));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("gpu difference"), "{stdout}");
    let report = std::fs::read_to_string(out.join("report.html")).expect("report.html");
    assert!(report.contains("The GPU-to-GPU difference the crossover cancelled"));
}

#[test]
fn an_arm_that_wins_tokens_per_joule_by_serving_less_does_not_win() {
    let dir = tempdir();
    let a = write_static(dir.path(), "cap500", 500, "");
    // 300 W cannot keep up with the demand: more tokens per joule, less served.
    let b = write_static(dir.path(), "cap300", 300, "");
    let out = dir.path().join("less");
    let (output, json) = run_ab(&a, &b, &out, &SHORT);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        json["ratio_b_over_a"].as_f64().unwrap() > 1.1,
        "{}",
        json["looks"]
    );
    // Refused, and said so: not "no difference" beside a ratio above 1.1.
    assert_eq!(json["decision"], "b-refused", "{}", json["looks"]);
    let why = json["refused_because"].as_str().unwrap_or("");
    assert!(why.contains("served"), "{why}");
    assert!(
        json["served_fraction_b"].as_f64().unwrap() < json["served_fraction_a"].as_f64().unwrap()
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains(
            "B refused: more tokens per joule, but it served less demand than A (b-refused)"
        ),
        "{stdout}"
    );
    assert!(!stdout.contains("100.00 %"), "{stdout}");
}

#[test]
fn bad_schedules_and_a_lone_gpu_crossover_are_refused_with_the_fix() {
    let dir = tempdir();
    let a = write_static(dir.path(), "cap500", 500, "");
    let cases: [(&[&str], &str); 6] = [
        (&["--warmup", "1s"], "at least 2 ticks"),
        (&["--epoch", "1s"], "too short for the energy counter"),
        (&["--epoch", "1500ms"], "whole number of ticks"),
        (&["--crossover"], "at least 2 GPUs"),
        (&["--settle", "1m"], "add --estimand settled"),
        (&["--crossover", "--interleaved"], "cannot be used with"),
    ];
    for (args, expected) in cases {
        let out = dir.path().join("bad");
        let (output, _) = run_ab(&a, &a, &out, args);
        assert!(!output.status.success(), "{args:?} was accepted");
        let text = stderr(&output);
        assert!(text.contains(expected), "{args:?}: {text}");
        assert!(!out.join("ab.json").exists());
    }
    let missing = dir.path().join("missing.toml");
    let (output, _) = run_ab(&a, &missing, &dir.path().join("m"), &SHORT);
    assert!(!output.status.success());
    assert!(stderr(&output).contains("arm b"), "{}", stderr(&output));
}

/// A knob one arm sets and the other leaves alone: the other arm's epochs run at the
/// device default, never at the first arm's setting.
#[test]
fn every_epoch_starts_from_the_device_defaults() {
    let dir = tempdir();
    let a = write_static(dir.path(), "clock1200", 500, "sm_clock_max_mhz = \"1200\"");
    let b = write_static(dir.path(), "cap500", 500, "");
    let out = dir.path().join("defaults");
    let (output, json) = run_ab(&a, &b, &out, &SHORT);
    assert!(output.status.success(), "{}", stderr(&output));
    let epochs = json["epochs"].as_array().expect("epochs");
    let clocks = |arm: &str| -> Vec<u64> {
        epochs
            .iter()
            .filter(|e| e["arm"] == arm)
            .map(|e| {
                e["settings"][0]["sm_clock_max_mhz"]
                    .as_u64()
                    .expect("clock")
            })
            .collect()
    };
    let (clocks_a, clocks_b) = (clocks("a"), clocks("b"));
    assert!(clocks_a.iter().all(|&c| c <= 1200), "{clocks_a:?}");
    assert!(clocks_b.iter().all(|&c| c > 1900), "{clocks_b:?}");
}

/// Interrupted (SIGINT) in the middle of a crossover run, the blocks already measured are
/// kept and the outcome says it was interrupted, as in the interleaved mode; it is not an
/// error because the other GPU group's loop ended first.
#[test]
fn an_interrupted_crossover_run_keeps_the_blocks_it_measured() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let sim = SimTarget {
        scenario: Some(steady()),
        ..SimTarget::new("h200")
    };
    let (sims, groups): (Vec<_>, Vec<_>) = (0..2)
        .map(|group| {
            tokwatt_agent::assembly::simulator(&sim, 11 + group).expect("a simulated H200")
        })
        .unzip();
    let request = tokwatt_lab::ab::AbRequest {
        // A/A, so that the first look (4 blocks) does not decide and end the run.
        a: static_spec(500),
        b: static_spec(500),
        schedule: Schedule {
            cooldown_ticks: 0,
            settle_ticks: 0,
            warmup_ticks: 3,
            measure_ticks: 10,
        },
        plan: tokwatt_lab::ab::SequentialPlan::new(DEFAULT_BUDGET, DEFAULT_ALPHA, 11)
            .expect("plan"),
        seed: 11,
        plugin_dirs: Vec::new(),
        cache_dir: Some(Path::new(env!("CARGO_TARGET_TMPDIR")).join("component-cache")),
        injected_ratio: None,
    };
    let meta = tokwatt_agent::assembly::RunMeta {
        simulated: true,
        gpu_profile: "h200".into(),
        gpu_name: "h200".into(),
        data_source: "simulator output (interrupted crossover test)".into(),
        gpu_count: 2,
        actuator: "sim".into(),
        workload: "sim".into(),
        seed: 11,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let signal = Arc::clone(&stop);
    // The "signal" arrives after the first look (4 blocks): both groups are mid-run.
    let outcome =
        tokwatt_lab::ab::run_crossover(&request, groups, meta, stop, &mut move |progress| {
            if progress.pairs_done >= 5 {
                signal.store(true, Ordering::Relaxed);
            }
        })
        .expect("an interrupted crossover keeps its blocks, it is not an error");
    drop(sims);
    assert!(outcome.interrupted);
    assert!(
        (5..DEFAULT_BUDGET).contains(&outcome.pairs.len()),
        "{} blocks",
        outcome.pairs.len()
    );
    assert_eq!(outcome.looks.len(), 1, "the first look stands");
}
