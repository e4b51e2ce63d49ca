//! Ranges, candidates and the tuned spec's text; the search itself is tested end to end
//! in `tests/all/tune.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap

use std::path::Path;

use super::*;

fn values(text: &str) -> Vec<String> {
    ParamRange::parse(text).unwrap().values
}

#[test]
fn ranges_are_inclusive_and_keep_the_written_form() {
    assert_eq!(values("power_cap_w=300..500:100"), ["300", "400", "500"]);
    assert_eq!(values("p=300..450:100"), ["300", "400"]);
    assert_eq!(values("x=0.5..1.0:0.25"), ["0.50", "0.75", "1.00"]);
    assert_eq!(values("mode = fast, slow"), ["fast", "slow"]);
    assert_eq!(values("one=7"), ["7"]);
    let range = ParamRange::parse("sm_clock_max_mhz=900..1300:50").unwrap();
    assert_eq!(range.name, "sm_clock_max_mhz");
    assert_eq!(range.values.len(), 9);
}

#[test]
fn a_fraction_longer_than_an_f64_holds_is_written_to_17_places() {
    let long = format!("x=1.{}..2:1", "0".repeat(70_000));
    let zeros = "0".repeat(17);
    assert_eq!(values(&long), [format!("1.{zeros}"), format!("2.{zeros}")]);
}

#[test]
fn bad_ranges_name_the_param_and_the_fix() {
    for (text, problem) in [
        ("power_cap_w", "no `=`"),
        ("power_cap_w=300..700", "no step"),
        ("power_cap_w=700..300:50", "below the low bound"),
        ("power_cap_w=300..700:0", "must be positive"),
        ("power_cap_w=300..700:-5", "must be positive"),
        ("power_cap_w=3OO..700:50", "`3OO` is not a number"),
        ("power_cap_w=300-700:50", "needs `..`"),
        ("power_cap_w=1,,2", "empty value"),
        ("power_cap_w=1,2,1", "`1` twice"),
        ("=1,2", "the name must be"),
        ("power_cap_w=0..1e9:1", "use a larger step"),
    ] {
        let error = ParamRange::parse(text).unwrap_err().to_string();
        assert!(error.contains(problem), "{text}: {error}");
        assert!(error.contains(text), "{text}: {error}");
        assert!(error.contains("NAME=LO..HI:STEP"), "{text}: {error}");
    }
}

#[test]
fn candidates_are_the_product_and_too_many_are_refused() {
    let ranges = [
        ParamRange::parse("a=1..3:1").unwrap(),
        ParamRange::parse("b=x,y").unwrap(),
    ];
    let all = candidates(&ranges).unwrap();
    assert_eq!(all.len(), 6);
    assert_eq!(all[0], [("a".into(), "1".into()), ("b".into(), "x".into())]);
    assert_eq!(all[5], [("a".into(), "3".into()), ("b".into(), "y".into())]);

    let big = [
        ParamRange::parse("a=1..100:1").unwrap(),
        ParamRange::parse("b=1..100:1").unwrap(),
    ];
    let error = candidates(&big).unwrap_err().to_string();
    assert!(error.contains("10000 candidates"), "{error}");
    assert!(error.contains("a 100 × b 100"), "{error}");
    assert!(matches!(candidates(&[]), Err(TuneError::NoParams)));
    let twice = [ranges[0].clone(), ranges[0].clone()];
    assert!(matches!(
        candidates(&twice),
        Err(TuneError::DuplicateParam { .. })
    ));
}

const SPEC: &str = r#"# a comment kept
name = "static"
plugin = "policy_static.wasm"
knobs = ["power-cap", "sm-clock"]

[params]
# the cap
power_cap_w = "500"
# sm_clock_max_mhz = "1605"

# no objective
[objective]
tpot_p99_limit_ms = 25.0
"#;

#[test]
fn the_tuned_spec_keeps_the_text_and_holds_the_winner() {
    let path = Path::new("/nowhere/static.toml");
    let spec = PolicySpec::parse(path, SPEC).unwrap();
    let winner = [
        ("power_cap_w".to_owned(), "450".to_owned()),
        ("sm_clock_max_mhz".to_owned(), "1000".to_owned()),
    ];
    let out = Path::new("/elsewhere/static-tuned.toml");
    let text = tuned_spec_text(&spec, SPEC, &winner, out, "tuned\non the simulator").unwrap();
    assert!(
        text.starts_with("# tuned\n# on the simulator\n# a comment kept\n"),
        "{text}"
    );
    assert!(
        text.contains(
            "power_cap_w = \"450\"\nsm_clock_max_mhz = \"1000\"\n# sm_clock_max_mhz = \"1605\""
        ),
        "{text}"
    );
    assert!(!text.contains("\"500\""), "{text}");
    assert!(
        text.contains("# no objective\n[objective]\ntpot_p99_limit_ms = 25.0"),
        "{text}"
    );
    let tuned = PolicySpec::parse(out, &text).unwrap();
    assert_eq!(tuned.params, candidate_spec(&spec, &winner).params);
    assert_eq!(tuned.objective, spec.objective);

    // A spec without [params] gets one.
    let bare = "name = \"static\"\nplugin = \"p.wasm\"\n[objective]\n";
    let spec = PolicySpec::parse(path, bare).unwrap();
    let text = tuned_spec_text(&spec, bare, &winner, out, "tuned").unwrap();
    let tuned = PolicySpec::parse(out, &text).unwrap();
    assert_eq!(tuned.params.len(), 2);

    // An inline table is edited as a table (the TOML is edited, not its lines).
    let inline = "name = \"static\"\nplugin = \"p.wasm\"\nparams = { power_cap_w = \"500\" }\n";
    let spec = PolicySpec::parse(path, inline).unwrap();
    let text = tuned_spec_text(&spec, inline, &winner, out, "tuned").unwrap();
    let tuned = PolicySpec::parse(out, &text).unwrap();
    assert_eq!(
        tuned.params,
        candidate_spec(&spec, &winner).params,
        "{text}"
    );
    assert!(text.contains("params = {"), "still inline: {text}");

    // A `params` that is not a table is refused, not written wrong.
    let wrong = "name = \"static\"\nplugin = \"p.wasm\"\nparams = 3\n";
    if let Ok(spec) = PolicySpec::parse(path, wrong) {
        assert!(tuned_spec_text(&spec, wrong, &winner, out, "tuned").is_err());
    }
}

#[test]
fn candidate_specs_replace_and_add_params_in_key_order() {
    let spec = PolicySpec::parse(Path::new("/s.toml"), SPEC).unwrap();
    let candidate = candidate_spec(
        &spec,
        &[
            ("sm_clock_max_mhz".into(), "900".into()),
            ("power_cap_w".into(), "300".into()),
        ],
    );
    assert_eq!(
        candidate.params,
        [
            ("power_cap_w".to_owned(), "300".to_owned()),
            ("sm_clock_max_mhz".to_owned(), "900".to_owned())
        ]
    );
    assert_eq!(spec.params, [("power_cap_w".to_owned(), "500".to_owned())]);
}

fn ranked(name: &str, ratio: f64, compliance: Compliance) -> CandidateResult {
    CandidateResult {
        params: vec![("p".to_owned(), name.to_owned())],
        ratio,
        ci_low: ratio - 0.01,
        ci_high: ratio + 0.01,
        confidence: 0.95,
        decision: Decision::NoDifference,
        pairs: 4,
        served_fraction: 1.0,
        served_fraction_reference: 1.0,
        violation_rate: 0.0,
        violation_rate_reference: 0.0,
        compliant: compliance != Compliance::Breaks,
        compliance,
        not_compliant_because: None,
        rank: 0,
        kept: false,
        run_time_s: 1.0,
    }
}

fn names(params: &[Vec<(String, String)>]) -> Vec<&str> {
    params.iter().map(|p| p[0].1.as_str()).collect()
}

#[test]
fn the_objective_ranks_first_and_a_breaking_survivor_gives_its_place_to_the_reserve() {
    // Round 1: six candidates, two go on; the left-behind that keep the objective wait.
    let mut reserve = Vec::new();
    let mut round = vec![
        ranked("aggressive", 1.05, Compliance::Unresolved),
        ranked("breaks", 1.10, Compliance::Breaks),
        ranked("good", 1.02, Compliance::Keeps),
        ranked("fine", 1.01, Compliance::Keeps),
        ranked("slow", 0.98, Compliance::Keeps),
        ranked("edgy", 1.04, Compliance::Unresolved),
    ];
    rank(&mut round);
    let order: Vec<&str> = round.iter().map(|c| c.params[0].1.as_str()).collect();
    assert_eq!(
        order,
        ["good", "fine", "slow", "aggressive", "edgy", "breaks"],
        "keeps, then unresolved, then breaks; by ratio within each"
    );
    let (next, promoted) = select(&mut round, 2, &mut reserve);
    assert_eq!(names(&next), ["good", "fine"]);
    assert_eq!(promoted, 0);
    assert_eq!(
        names(&reserve),
        ["slow", "aggressive", "edgy"],
        "never the one that broke"
    );
    assert_eq!(round.iter().filter(|c| c.kept).count(), 2);
    assert_eq!(round[0].rank, 1);

    // Round 2: both survivors break over more pairs: the reserve's best take their places.
    let mut round = vec![
        ranked("good", 1.03, Compliance::Breaks),
        ranked("fine", 1.01, Compliance::Breaks),
    ];
    rank(&mut round);
    let (next, promoted) = select(&mut round, 1, &mut reserve);
    assert_eq!(names(&next), ["slow"]);
    assert_eq!(promoted, 1);
    assert!(round.iter().all(|c| !c.kept));
    assert_eq!(names(&reserve), ["aggressive", "edgy"]);

    // Nothing left that keeps the objective: nothing goes on.
    let mut empty = Vec::new();
    let mut round = vec![ranked("slow", 0.98, Compliance::Breaks)];
    let (next, promoted) = select(&mut round, 1, &mut empty);
    assert!(next.is_empty());
    assert_eq!(promoted, 0);
}

#[test]
fn the_report_names_a_refused_candidate_as_refused_and_shows_its_whole_label() {
    let long_params = vec![
        ("power_cap_w".to_owned(), "450".to_owned()),
        ("sm_clock_max_mhz".to_owned(), "1300".to_owned()),
    ];
    let mut refused = ranked("x", 1.4974, Compliance::Breaks);
    refused.params = long_params.clone();
    refused.decision = Decision::BRefused;
    refused.not_compliant_because = Some("candidate served less".to_owned());
    let schedule = Schedule {
        cooldown_ticks: 2,
        settle_ticks: 0,
        warmup_ticks: 30,
        measure_ticks: 15,
    };
    let outcome = TuneOutcome {
        format_version: TUNE_FORMAT_VERSION,
        policy: "static".to_owned(),
        spec: "policies/static.toml".to_owned(),
        reference_params: Vec::new(),
        ranges: Vec::new(),
        candidates: 1,
        eta: 3,
        first_round_pairs: 2,
        alpha: 0.02,
        tolerances: Tolerances::default(),
        schedule,
        tick_ms: 1000,
        seed: 1,
        rounds: vec![Round {
            round: 1,
            pairs_budget: 8,
            seed: 1,
            candidates: vec![refused],
            dropped: Vec::new(),
            kept: 0,
            promoted: 0,
            simulated_time_s: 10.0,
        }],
        winner: long_params.clone(),
        winner_spec_params: long_params,
        evidence: Evidence {
            ratio_b_over_a: 1.4974,
            ci_low: 1.4481,
            ci_high: 1.5434,
            confidence: 0.999_96,
            decision: Decision::BRefused,
            pairs: 8,
            served_fraction_reference: 0.9986,
            served_fraction_winner: 0.9819,
            violation_ticks_reference: 0,
            violation_ticks_winner: 1,
            violation_rate_reference: 0.0,
            violation_rate_winner: 0.0021,
            refused_because: Some("candidate served less".to_owned()),
            compliant: false,
        },
        dropped: Vec::new(),
        simulated_time_s: 10.0,
        simulated: true,
        data_source: "simulator".to_owned(),
        meta: RunMeta {
            simulated: true,
            gpu_profile: "h200".to_owned(),
            gpu_name: "NVIDIA H200".to_owned(),
            data_source: "simulator".to_owned(),
            gpu_count: 1,
            actuator: "sim".to_owned(),
            workload: "sim".to_owned(),
            seed: 1,
        },
        notes: Vec::new(),
    };
    let html = report_html(&outcome);
    // The winner's table and the round's: refused, never "no difference".
    assert_eq!(html.matches("candidate refused").count(), 2, "{html}");
    assert!(!html.contains("no difference"));
    // The confidence just under 100 % is not rounded up to it.
    assert!(
        html.contains("(99.996 %)") && !html.contains("(100"),
        "{html}"
    );
    // The forest plot's label column holds the whole label.
    let label = "power_cap_w=450, sm_clock_max_mhz=1300 (not compliant)";
    assert!(html.contains(&format!(">{label}</text>")), "{html}");
    let frame = html
        .split("class=\"chart row-plot\"")
        .nth(1)
        .expect("the plot");
    let frame = frame.split("<rect x=\"").nth(1).expect("its frame");
    let frame_left: f64 = frame[..frame.find('"').expect("quote")]
        .parse()
        .expect("number");
    assert!(frame_left - 8.0 >= label.len() as f64 * 7.2, "{frame_left}");
}
