//! Invariant 8, the objective guard, and the node's rules: a policy that is valid and
//! wrong (on time, inside its guardrails, starving the service) is taken over by the
//! device defaults; a spec may only narrow the node's objective and guardrails; a
//! throughput floor is checked on a closed-loop workload. Driven on the simulated H200
//! (simulator output).

use crate::support::*;

/// `policies/static.toml`'s plugin holding 200 W, 345 MHz and batch 1 under a 25 ms p99
/// bound: valid settings that turn most of the built-in scenario's demand away.
fn starving_spec(dir: &std::path::Path) -> std::path::PathBuf {
    write_spec(
        dir,
        "starving",
        &built_plugin("policy_static"),
        "[params]\npower_cap_w = \"200\"\nsm_clock_max_mhz = \"345\"\nbatch_size = \"1\"\n\
         [objective]\ntpot_p99_limit_ms = 25.0\n",
    )
}

/// The first tick whose window broke the objective (trace.csv), and the first the guard
/// decided (observations.jsonl marks them `"guard": true`).
fn first_violation_and_guard_tick(out: &std::path::Path) -> (u64, u64) {
    let trace = read_trace(&out.join("trace.csv"));
    let violation = trace
        .iter()
        .find(|row| row.fields["slo_violation"] == "1")
        .map(|row| row.f64("tick") as u64)
        .expect("a tick broke the objective");
    let text = std::fs::read_to_string(out.join("observations.jsonl")).expect("observations");
    let guard = text
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).expect("json line"))
        .find(|line| line["guard"] == true)
        .and_then(|line| line["observation"]["tick"].as_u64())
        .expect("a tick decided by the guard");
    (violation, guard)
}

fn guard_count(summary: &serde_json::Value, key: &str) -> u64 {
    summary["guard"][key]
        .as_u64()
        .unwrap_or_else(|| panic!("summary.guard.{key} missing: {}", summary["guard"]))
}

#[test]
fn a_starving_policy_is_taken_over_and_the_objective_holds_but_for_the_guards_ticks() {
    let dir = tempdir();
    let spec = starving_spec(dir.path());

    let unguarded = run_sim(&spec, "10m", &dir.path().join("unguarded"), &["--no-guard"]);
    let broken = num(&unguarded.summary, "slo_violation_ticks") as u64;
    assert!(
        broken > 500,
        "without the guard the spec breaks the objective on most of 600 ticks: {broken}"
    );
    assert_eq!(guard_count(&unguarded.summary, "takeovers"), 0);
    assert_eq!(
        guard_count(&unguarded.summary, "policy_violation_ticks"),
        broken
    );

    let guarded = run_sim(&spec, "10m", &dir.path().join("guarded"), &[]);
    let s = &guarded.summary;
    let violations = num(s, "slo_violation_ticks") as u64;
    let takeovers = guard_count(s, "takeovers");
    let policy = guard_count(s, "policy_violation_ticks");
    let fallback = guard_count(s, "fallback_violation_ticks");
    let excused = guard_count(s, "excused_violation_ticks");
    assert!(
        takeovers >= 2,
        "the guard took over, and again after its back-off: {s}"
    );
    assert_eq!(
        violations,
        policy + fallback + excused,
        "every violating tick is charged to the policy, the guard's fallback or the demand"
    );
    // The default guard takes over at the fifth violation in 20 ticks: every take-over
    // costs the policy's five ticks, and the defaults' settling after the switch.
    assert!(
        policy <= 5 * takeovers,
        "{policy} policy violations for {takeovers} take-overs"
    );
    assert!(
        violations * 10 < broken,
        "the objective holds on all but the guard's ticks: {violations} violating ticks with the guard, {broken} without"
    );
    assert_eq!(
        guard_count(s, "unservable_takeovers"),
        0,
        "the defaults serve this demand"
    );

    // The first take-over is at the fifth tick the policy broke (its queue fills after
    // some 45 s, then every tick turns demand away), and the trace shows the guard's
    // ticks as fallback ticks at the device defaults.
    let (first_violation, first_guard_tick) =
        first_violation_and_guard_tick(&dir.path().join("guarded"));
    assert_eq!(
        first_guard_tick,
        first_violation + 4,
        "the guard decides the tick whose window showed the fifth violation"
    );
    let held = &guarded.trace[first_guard_tick as usize + 5];
    assert_eq!(held.f64("power_cap_requested_w"), 700.0, "the default cap");
    assert_eq!(held.f64("sm_clock_max_mhz"), 1980.0, "no clock lock");
    // The start's batch (512) breaks a 25 ms bound: the guard fits it under.
    let batch = held.f64("batch_size");
    assert!((100.0..512.0).contains(&batch), "batch {batch}");
    assert!(held.f64("tpot_p99_ms") <= 25.0, "{:?}", held.fields);
    assert_eq!(
        num(s, "fallback_ticks"),
        0.0,
        "the guard's ticks are not a failing policy's"
    );
}

/// On a workload serving prompts, a step's time follows its prefill chunk: the guard
/// defends a time-per-token bound by shrinking the token budget (never back up to the
/// start's largest, which broke it) and leaves the batch, which was not the cause.
#[test]
fn on_prompts_the_guard_answers_a_broken_time_per_token_with_the_token_budget() {
    let dir = tempdir();
    let path = dir.path().join("chunky.toml");
    std::fs::write(
        &path,
        format!(
            "name = \"chunky\"\nplugin = \"{}\"\nknobs = [\"batch-size\", \"token-budget\"]\n\
             [params]\nbatch_size = \"64\"\ntoken_budget = \"8192\"\n\
             [objective]\ntpot_p99_limit_ms = 10.0\nttft_p99_limit_ms = 800.0\n",
            built_plugin("policy_static").display()
        ),
    )
    .expect("spec");
    let scenario = repo_root().join("host/scenarios/serving-budget.toml");
    let run = run_sim(
        &path,
        "40s",
        &dir.path().join("out"),
        &[
            "--batch-only",
            "--scenario",
            scenario.to_str().expect("utf-8"),
        ],
    );
    assert!(
        guard_count(&run.summary, "takeovers") >= 1,
        "{}",
        run.summary
    );
    let text = std::fs::read_to_string(dir.path().join("out/observations.jsonl")).expect("obs");
    let guard_ticks: Vec<u64> = text
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).expect("json line"))
        .filter(|line| line["guard"] == true)
        .filter_map(|line| line["observation"]["tick"].as_u64())
        .collect();
    assert!(!guard_ticks.is_empty());
    let budgets: Vec<f64> = guard_ticks
        .iter()
        .filter_map(|&tick| run.trace.get(tick as usize + 1))
        .map(|row| row.f64("token_budget"))
        .collect();
    assert!(
        budgets.iter().all(|&tokens| tokens < 8192.0),
        "the guard never puts back the budget that broke the bound: {budgets:?}"
    );
    assert!(
        budgets.windows(2).all(|pair| pair[1] <= pair[0]),
        "nor raises it, quiet ticks included: {budgets:?}"
    );
    assert!(
        budgets.iter().any(|&tokens| tokens < 2048.0),
        "it shrinks as the bound stays broken: {budgets:?}"
    );
    for &tick in &guard_ticks {
        if let Some(row) = run.trace.get(tick as usize + 1) {
            assert_eq!(
                row.f64("batch_size"),
                64.0,
                "the batch is left: {:?}",
                row.fields
            );
        }
    }
}

#[test]
fn the_guards_settings_are_flags_of_run() {
    let dir = tempdir();
    let spec = starving_spec(dir.path());
    let r = run_sim(
        &spec,
        "5m",
        &dir.path().join("run"),
        &[
            "--guard-window-ticks",
            "10",
            "--guard-max-violation-ticks",
            "2",
            "--guard-takeover-ticks",
            "100",
        ],
    );
    let (first_violation, first_guard_tick) =
        first_violation_and_guard_tick(&dir.path().join("run"));
    assert_eq!(
        first_guard_tick,
        first_violation + 1,
        "the second violation"
    );
    assert_eq!(
        guard_count(&r.summary, "policy_violation_ticks"),
        2 * guard_count(&r.summary, "takeovers")
    );

    let refused = sim_run(&spec, "1m", &dir.path().join("bad"))
        .args(["--guard-max-violation-ticks", "50"])
        .output()
        .expect("runs");
    assert!(!refused.status.success());
    let text = stderr(&refused);
    assert!(
        text.contains("max_violation_ticks") && text.contains("--guard-max-violation-ticks"),
        "{text}"
    );
}

#[test]
fn a_spec_may_only_narrow_the_nodes_objective_and_guardrails() {
    let dir = tempdir();
    // hill-climb asks for a 60 ms p99 bound; the node says 30 ms.
    let looser = sim_run(
        &repo_root().join("policies/hill-climb.toml"),
        "1m",
        &dir.path().join("looser"),
    )
    .args(["--tpot-p99-limit-ms", "30"])
    .output()
    .expect("runs");
    assert!(!looser.status.success(), "a looser spec is refused");
    let text = stderr(&looser);
    assert!(
        text.contains("objective.tpot_p99_limit_ms")
            && text.contains("at most 30")
            && text.contains("hill-climb.toml"),
        "{text}"
    );
    assert!(
        !dir.path().join("looser/summary.json").exists(),
        "nothing ran"
    );

    // The default node bounds the cap step: a spec asking for more is refused by name.
    let stepper = write_spec(
        dir.path(),
        "stepper",
        &built_plugin("policy_static"),
        "[guardrails]\nmax_power_cap_raise_w = 500.0\n",
    );
    let refused = sim_run(&stepper, "1m", &dir.path().join("stepper"))
        .output()
        .expect("runs");
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("guardrails.max_power_cap_raise_w"),
        "{}",
        stderr(&refused)
    );

    // A stricter node objective is what the run is judged by, and what `init` is told.
    let r = run_sim(
        &repo_root().join("policies/hill-climb.toml"),
        "1m",
        &dir.path().join("stricter"),
        &["--tpot-p99-limit-ms", "80", "--min-tokens-per-s", "100"],
    );
    assert_eq!(
        r.summary["objective"]["tpot_p99_limit_ms"], 60.0,
        "the spec's, tighter"
    );
    assert_eq!(
        r.summary["objective"]["min_tokens_per_s"], 100.0,
        "the node's, tighter than the spec's 0"
    );
}

mod serving {
    use std::path::Path;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};

    use tokwatt_serve::api::{Control, ControlError, SwapRequest};
    use tokwatt_serve::serve::{self, ServeConfig};

    use crate::support::*;

    fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        let start = Instant::now();
        while !done() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "timed out waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A simulated one-GPU node at a 20 ms tick whose objective is a 60 ms p99 bound and
    /// `objective` (more keys of `[objective]`), with `probation` ticks of probation.
    fn node(dir: &Path, spec: &Path, probation: u64, objective: &str) -> ServeConfig {
        let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("component-cache");
        let text = format!(
            "[policy]\nspec = \"{}\"\ncache_dir = \"{}\"\nprobation_ticks = {probation}\n\n\
             [objective]\ntpot_p99_limit_ms = 60.0\n{objective}\n\
             [node]\nbackend = \"sim\"\nsim_gpus = 1\ntick = \"20ms\"\n\n\
             [output]\ndir = \"{}\"\n",
            spec.display(),
            cache.display(),
            dir.join("out").display()
        );
        let path = dir.join("serve.toml");
        std::fs::write(&path, text).expect("write config");
        ServeConfig::load(&path).expect("the test's config is valid")
    }

    fn static_spec(
        dir: &Path,
        name: &str,
        knobs: &str,
        params: &str,
        extra: &str,
    ) -> std::path::PathBuf {
        let path = dir.join(format!("{name}.toml"));
        std::fs::write(
            &path,
            format!(
                "name = \"{name}\"\nplugin = \"{}\"\nknobs = [{knobs}]\n[params]\n{params}\n{extra}\n[sandbox]\ndeadline_ms = 5\n",
                built_plugin("policy_static").display()
            ),
        )
        .expect("write spec");
        path
    }

    #[test]
    fn serve_defends_the_nodes_objective_and_leaves_nothing_behind_at_a_swap() {
        let dir = tempdir();
        let capped = static_spec(
            dir.path(),
            "capped",
            "\"power-cap\"",
            "power_cap_w = \"500\"",
            "",
        );
        let batch_only = static_spec(
            dir.path(),
            "batch-only",
            "\"batch-size\"",
            "batch_size = \"256\"",
            "",
        );
        // Clock 345 MHz at batch 512: over 60 ms a token once some 200 sequences decode.
        let slow = static_spec(
            dir.path(),
            "slow",
            "\"sm-clock\", \"batch-size\"",
            "sm_clock_max_mhz = \"345\"\nbatch_size = \"512\"",
            "",
        );
        let looser = static_spec(
            dir.path(),
            "looser",
            "\"batch-size\"",
            "batch_size = \"256\"",
            "[objective]\ntpot_p99_limit_ms = 80.0\n",
        );
        // Probation 400 ticks (8 s simulated): in 20 ms windows a slow clock breaks the
        // bound only once some 200 sequences decode.
        let agent = serve::start(
            &node(dir.path(), &capped, 400, ""),
            Arc::new(AtomicBool::new(false)),
            None,
        )
        .expect("the agent starts");
        let control = agent.control();
        let swap = |spec: &Path| {
            control.swap(&SwapRequest {
                spec: spec.to_owned(),
                plugin: None,
                fresh: false,
            })
        };
        wait_for("the cap of 500 W", || {
            control.status().gpus[0].in_force.power_cap_requested_w == 500.0
        });
        assert_eq!(
            control.status().guard.objective.tpot_p99_limit_ms,
            Some(60.0)
        );

        // A batch-only policy takes over: the cap it does not own goes back to 700 W.
        swap(&batch_only).expect("swaps in");
        wait_for("the cap back at the node's baseline", || {
            let status = control.status();
            status.gpus[0].in_force.power_cap_requested_w == 700.0
                && status.gpus[0].in_force.batch_size == 256
        });

        // A spec loosening the node's objective is refused, naming the key.
        let refused = swap(&looser).expect_err("looser than the node");
        assert!(
            matches!(&refused, ControlError::BadRequest(m) if m.contains("objective.tpot_p99_limit_ms") && m.contains("at most 60")),
            "{refused:?}"
        );

        // A valid policy that breaks the objective in its probation is rolled back, and
        // the settings the restored policy had in force come back with it: the clock it
        // does not own too, which it would never move back itself.
        let before = control.status().gpus[0].in_force;
        swap(&slow).expect("its init is fine");
        wait_for("the slow policy's clock", || {
            control.status().gpus[0].in_force.sm_clock_max_mhz == 345
        });
        wait_for("the objective's rollback", || {
            control.status().guard.objective_rollbacks == 1
        });
        let status = control.status();
        assert_eq!(status.policy.name, "batch-only", "{:?}", status.policy);
        assert_eq!(status.policy.rollbacks, 1);
        // (The status shows the settings a tick's window ran under: the next tick's.)
        wait_for("the restored policy's settings back in force", || {
            control.status().gpus[0].in_force == before
        });

        agent.stop();
        let summary = agent.join().expect("the agent ends cleanly");
        assert_eq!(summary.totals.swaps.objective_rollbacks, 1);
        assert_eq!(summary.totals.guard.takeovers, 0);
    }

    /// The starving spec swapped into `serve` under a throughput floor: it breaks the
    /// floor on every tick requests wait, and the guard takes the node over at the fifth;
    /// the policy stays in charge.
    #[test]
    fn serve_takes_over_from_a_starving_policy_that_passed_its_probation() {
        let dir = tempdir();
        let batch_only = static_spec(
            dir.path(),
            "batch-only",
            "\"batch-size\"",
            "batch_size = \"256\"",
            "",
        );
        let starving = static_spec(
            dir.path(),
            "starving",
            "\"power-cap\", \"sm-clock\", \"batch-size\"",
            "power_cap_w = \"200\"\nsm_clock_max_mhz = \"345\"\nbatch_size = \"1\"",
            "[objective]\ntpot_p99_limit_ms = 25.0\n",
        );
        let agent = serve::start(
            // A throughput floor batch 1 cannot hold once requests wait; an allowance
            // the size of the guard's window leaves the starving policy to the guard.
            &node(
                dir.path(),
                &batch_only,
                5,
                "min_tokens_per_s = 500.0\n[guard]\nprobation_allowance_ticks = 20",
            ),
            Arc::new(AtomicBool::new(false)),
            None,
        )
        .expect("the agent starts");
        let control = agent.control();
        let took_over = control
            .swap(&SwapRequest {
                spec: starving.clone(),
                plugin: None,
                fresh: false,
            })
            .expect("swaps in");
        wait_for("the guard's take-over", || {
            control.status().guard.takeovers >= 1
        });
        let status = control.status();
        assert_eq!(
            status.policy.name, "starving",
            "the guard holds, the policy stays"
        );
        assert_eq!(status.guard.objective_rollbacks, 0, "{:?}", status.guard);
        assert!(
            status.guard.policy_violation_ticks >= 5,
            "{:?}",
            status.guard
        );
        let metrics = control.metrics();
        assert!(
            metrics.lines().any(|l| l
                .starts_with("tokwatt_guard_takeovers_total{policy=\"starving\"")
                && !l.ends_with(" 0")),
            "{metrics}"
        );
        assert!(metrics.contains("tokwatt_guard_in_charge"), "{metrics}");
        agent.stop();
        let summary = agent.join().expect("the agent ends cleanly");
        assert!(summary.totals.guard.takeovers >= 1);
        assert!(
            summary.totals.ticks > took_over.tick,
            "{} ticks, swapped at {}",
            summary.totals.ticks,
            took_over.tick
        );
    }

    #[test]
    fn a_swap_reply_never_quotes_the_file_it_was_given() {
        let dir = tempdir();
        let capped = static_spec(
            dir.path(),
            "capped",
            "\"power-cap\"",
            "power_cap_w = \"500\"",
            "",
        );
        let secret = dir.path().join("shadow");
        std::fs::write(&secret, "root:$6$not-a-spec-secret:19000:0:99999:7:::\n").expect("write");
        let agent = serve::start(
            &node(dir.path(), &capped, 10, ""),
            Arc::new(AtomicBool::new(false)),
            None,
        )
        .expect("the agent starts");
        let control = agent.control();
        let refused = control
            .swap(&SwapRequest {
                spec: secret.clone(),
                plugin: None,
                fresh: false,
            })
            .expect_err("not a spec");
        let ControlError::BadRequest(message) = &refused else {
            panic!("{refused:?}");
        };
        assert!(
            !message.contains("not-a-spec-secret") && !message.contains("root:"),
            "{message}"
        );
        assert!(
            message.contains(&format!("run `tokwatt check {}`", secret.display())),
            "{message}"
        );
        // A folder as the plugin is named as what it is.
        let folder = control
            .swap(&SwapRequest {
                spec: capped.clone(),
                plugin: Some(dir.path().to_owned()),
                fresh: false,
            })
            .expect_err("a folder is no plugin");
        assert!(
            matches!(&folder, ControlError::BadRequest(m) if m.contains("not a regular file")),
            "{folder:?}"
        );
        agent.stop();
        agent.join().expect("ends");
    }
}
