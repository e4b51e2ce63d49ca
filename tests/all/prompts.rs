//! Requests with prompts end to end: a simulated run of the shipped chat scenario under a
//! time-to-first-token bound, judged, written to the trace and the summary.

use crate::support::*;

#[test]
fn a_ttft_bound_is_judged_and_every_output_carries_the_requests() {
    let dir = tempdir();
    let chat = repo_root().join("host/scenarios/chat.toml");
    let chat = chat.to_str().expect("UTF-8 path");
    // The static policy at the board's defaults, the guard off: the run only measures.
    let spec = repo_root().join("policies/static.toml");
    let run = |name: &str, ttft_ms: &str| {
        run_sim(
            &spec,
            "2m",
            &dir.path().join(name),
            &[
                "--scenario",
                chat,
                "--ttft-p99-limit-ms",
                ttft_ms,
                "--no-guard",
            ],
        )
    };
    // The busy phase's TTFT p99 is a few hundred ms (prefill of ~900-token prompts
    // beside decode): a 10 ms bound is broken on nearly every tick, a minute's is not.
    let tight = run("tight", "10");
    let loose = run("loose", "60000");
    assert_eq!(tight.summary["objective"]["ttft_p99_limit_ms"], 10.0);
    let ticks = num(&tight.summary, "ticks");
    assert!(
        num(&tight.summary, "slo_violation_ticks") > 0.9 * ticks,
        "{}",
        tight.summary
    );
    assert_eq!(
        num(&loose.summary, "slo_violation_ticks"),
        0.0,
        "{}",
        loose.summary
    );

    // The summary adds the requests up; the trace has them tick by tick.
    let requests = &loose.summary["requests"];
    assert!(
        requests["prefill_tokens"].as_f64().unwrap_or(0.0) > 100_000.0,
        "{requests}"
    );
    let finished = requests["requests_finished"].as_f64().unwrap_or(0.0);
    assert!(finished > 1000.0, "{requests}");
    let per_request = requests["energy_per_request_j"].as_f64().unwrap_or(0.0);
    let energy = num(&loose.summary, "energy_j");
    assert!(
        per_request > 0.0 && per_request * finished < energy,
        "{requests}"
    );
    let ttfts: Vec<f64> = loose
        .trace
        .iter()
        .filter_map(|row| row.fields.get("ttft_p99_ms")?.parse().ok())
        .collect();
    assert!(ttfts.len() as f64 > 0.9 * loose.trace.len() as f64);
    assert!(ttfts.iter().all(|t| *t > 0.0 && *t < 60_000.0), "{ttfts:?}");
    assert!(
        loose
            .trace
            .iter()
            .any(|row| row.fields["energy_per_request_j"].parse::<f64>().is_ok())
    );
}
