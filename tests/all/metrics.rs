//! `/metrics`: a simulated run's every tick fed to `AgentMetrics`, its text checked
//! against the run's summary, against a swap's new series, and by `promtool check
//! metrics` (which skips with a reason where promtool is absent, unless
//! TOKWATT_REQUIRE_PROMTOOL=1).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokwatt_agent::assembly::{self, BackendRequest, SimTarget, Target};
use tokwatt_agent::swap::swap_channel;
use tokwatt_agent::{self as agent, NodeFacts, RunRequest, RunSummary};
use tokwatt_plugin::{HostConfig, PluginHost};
use tokwatt_policy::spec::PolicySpec;
use tokwatt_serve::metrics::AgentMetrics;

use crate::support::*;

const TICKS: u64 = 60;
const GPUS: u32 = 2;
/// The tick at which the second policy takes over.
const SWAP_AT: u64 = 25;

/// One sample of the text exposition.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// The samples of a classic text exposition (comments skipped), label values unescaped.
fn parse(text: &str) -> Vec<Sample> {
    let mut samples = Vec::new();
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let name_end = line.find(['{', ' ']).expect("a name");
        let name = line[..name_end].to_owned();
        let mut labels = BTreeMap::new();
        let mut rest = &line[name_end..];
        if let Some(body) = rest.strip_prefix('{') {
            let mut chars = body.char_indices();
            let mut key = String::new();
            loop {
                let (i, c) = chars.next().expect("labels end with }");
                match c {
                    '}' => {
                        rest = &body[i + 1..];
                        break;
                    }
                    ',' => {}
                    '=' => {
                        assert_eq!(chars.next().map(|(_, c)| c), Some('"'), "{line}");
                        let mut value = String::new();
                        loop {
                            match chars.next().expect("a closing quote").1 {
                                '"' => break,
                                '\\' => match chars.next().expect("an escape").1 {
                                    'n' => value.push('\n'),
                                    other => value.push(other),
                                },
                                other => value.push(other),
                            }
                        }
                        labels.insert(std::mem::take(&mut key), value);
                    }
                    other => key.push(other),
                }
            }
        }
        let value = rest
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("value of {line}"));
        samples.push(Sample {
            name,
            labels,
            value,
        });
    }
    samples
}

/// The sum of `name`'s samples whose labels include every pair of `with`.
fn sum(samples: &[Sample], name: &str, with: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            with.iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .sum()
}

fn has(samples: &[Sample], name: &str, with: &[(&str, &str)]) -> bool {
    samples.iter().any(|s| {
        s.name == name
            && with
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
    })
}

fn content_version(plugin: &Path) -> String {
    let digest = Sha256::digest(std::fs::read(plugin).expect("plugin"));
    digest.iter().take(6).map(|b| format!("{b:02x}")).collect()
}

struct Observed {
    summary: RunSummary,
    text: String,
    /// Content version by policy name.
    versions: BTreeMap<String, String>,
    /// GPU 0's tokens in the windows that ran on the first policy's settings: up to and
    /// including the swap tick's (the new policy's `init` decides that tick).
    tokens_before_swap: u64,
}

/// A simulated run of `static` on two GPUs, `cap-search` swapped in at [`SWAP_AT`], every
/// tick fed to the metrics with the version of the policy in charge.
fn observed_run() -> Observed {
    let dir = tempdir();
    let first = PolicySpec::load(&repo_root().join("policies/static.toml")).expect("spec");
    let second = PolicySpec::load(&repo_root().join("policies/cap-search.toml")).expect("spec");
    let search = agent::plugin_search_path(&[]);
    let mut versions = BTreeMap::new();
    for spec in [&first, &second] {
        let plugin = spec.resolve_plugin(&search).expect("plugin built");
        versions.insert(spec.name.clone(), content_version(&plugin));
    }

    let request = BackendRequest {
        target: Target::Sim(SimTarget {
            gpus: GPUS,
            ..SimTarget::new("h200")
        }),
        seed: 11,
        batch_only: false,
    };
    let assembled = assembly::assemble(&request, &first.name, first.knobs).expect("sim");
    let devices = assembled.backends.telemetry.devices();
    let metrics = AgentMetrics::new(&devices, true, false);
    let tick = Duration::from_secs(1);
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("component-cache");

    // Prepared off the loop before the run; sent after the tick before SWAP_AT.
    let host = PluginHost::new(&HostConfig {
        cache_dir: Some(cache.clone()),
    })
    .expect("plugin host");
    let plugin = second.resolve_plugin(&search).expect("plugin");
    let node = NodeFacts::of(&assembled.backends);
    let mut prepared =
        Some(agent::prepare_policy(&host, &second, &plugin, &node, 11, tick).expect("prepared"));
    let (sender, port) = swap_channel();
    let mut tokens_before_swap = 0;

    let run = RunRequest {
        spec: first.clone(),
        duration: tick * TICKS as u32,
        tick: Some(tick),
        out_dir: dir.path().join("run"),
        plugin_dirs: vec![],
        cache_dir: Some(cache),
        seed: 11,
        overwrite: false,
        write_files: false,
        rules: tokwatt_policy::rules::NodeRules::default(),
        rules_source: "the default node rules".into(),
        node_knobs: tokwatt_core::types::Knobs::all(),
        output: tokwatt_agent::recorder::OutputBounds::default(),
    };
    let (summary, _) = agent::run_with_swaps(
        &run,
        assembled.backends,
        assembled.meta,
        Arc::new(AtomicBool::new(false)),
        Some(port),
        &mut |progress| {
            metrics.observe(&progress, &versions[progress.policy]);
            if progress.tick <= SWAP_AT {
                tokens_before_swap += progress.observations[0].tokens;
            }
            if progress.tick + 1 == SWAP_AT
                && let Some(next) = prepared.take()
            {
                sender.send(next).expect("the loop is running");
            }
        },
    )
    .expect("the run completes");
    Observed {
        summary,
        text: metrics.encode(),
        versions,
        tokens_before_swap,
    }
}

#[test]
fn counters_match_the_runs_summary_and_a_swap_starts_the_new_policys_series() {
    let Observed {
        summary,
        text,
        versions,
        tokens_before_swap,
    } = observed_run();
    let totals = &summary.totals;
    let samples = parse(&text);
    assert!(text.ends_with("# EOF\n"));
    assert_eq!(totals.ticks, TICKS);
    assert_eq!(totals.swaps.swaps, 1, "the swap happened");

    assert_eq!(sum(&samples, "tokwatt_ticks_total", &[]), TICKS as f64);
    for gpu in &totals.gpus {
        let label = gpu.gpu.to_string();
        let on_gpu = [("gpu", label.as_str())];
        assert_eq!(
            sum(&samples, "tokwatt_gpu_tokens_total", &on_gpu),
            gpu.tokens as f64,
            "GPU {label}'s tokens"
        );
        let energy = sum(&samples, "tokwatt_gpu_energy_joules_total", &on_gpu);
        assert!(
            (energy - gpu.energy_j).abs() <= 1e-9 * gpu.energy_j,
            "GPU {label}: {energy} J counted, {} J in the summary",
            gpu.energy_j
        );
        assert!(gpu.energy_j > 0.0 && gpu.tokens > 0, "the run did work");
        assert_eq!(
            sum(&samples, "tokwatt_gpu_slo_violation_ticks_total", &on_gpu),
            gpu.slo_violation_ticks as f64
        );
        // The settings in force are known every tick; the readings are the simulator's.
        for gauge in [
            "tokwatt_gpu_power_watts",
            "tokwatt_gpu_power_cap_enforced_watts",
            "tokwatt_gpu_sm_clock_hertz",
            "tokwatt_gpu_temperature_celsius",
            "tokwatt_gpu_tpot_p99_seconds",
        ] {
            assert!(has(&samples, gauge, &on_gpu), "{gauge} for GPU {label}");
        }
    }
    assert_eq!(
        sum(&samples, "tokwatt_policy_fallback_ticks_total", &[]),
        totals.fallback_ticks as f64
    );
    // Every tick but the swap's (decided by the new policy's `init`) called `decide`.
    assert_eq!(
        sum(
            &samples,
            "tokwatt_policy_decide_duration_seconds_count",
            &[]
        ),
        (TICKS - 1) as f64
    );
    assert_eq!(
        sum(&samples, "tokwatt_tick_lateness_seconds_count", &[]),
        TICKS as f64
    );
    assert!(has(
        &samples,
        "tokwatt_info",
        &[
            ("simulated", "true"),
            ("version", env!("CARGO_PKG_VERSION"))
        ]
    ));

    // The swap: a series per {policy, version}, the swap counted against the newcomer.
    let (old, new) = (
        [
            ("policy", "static"),
            ("version", versions["static"].as_str()),
        ],
        [
            ("policy", "cap-search"),
            ("version", versions["cap-search"].as_str()),
        ],
    );
    assert_eq!(sum(&samples, "tokwatt_policy_swaps_total", &new), 1.0);
    assert_eq!(sum(&samples, "tokwatt_policy_swaps_total", &old), 0.0);
    assert_eq!(sum(&samples, "tokwatt_policy_info", &new), 1.0);
    assert_eq!(sum(&samples, "tokwatt_policy_info", &old), 0.0);
    // Windows up to the swap tick ran on the old policy's settings, the rest on the new.
    let tokens_under = |policy: &[(&str, &str); 2]| {
        let with = [policy[0], policy[1], ("gpu", "0")];
        sum(&samples, "tokwatt_gpu_tokens_total", &with)
    };
    assert_eq!(tokens_under(&old), tokens_before_swap as f64);
    assert_eq!(
        tokens_under(&new),
        (totals.gpus[0].tokens - tokens_before_swap) as f64
    );
    assert!(tokens_under(&new) > 0.0, "{text}");
    let decided = |policy: &[(&str, &str); 2]| {
        sum(
            &samples,
            "tokwatt_policy_decide_duration_seconds_count",
            policy,
        )
    };
    assert_eq!(decided(&old), SWAP_AT as f64);
    assert_eq!(decided(&new), (TICKS - SWAP_AT - 1) as f64);
}

#[test]
fn promtool_finds_no_problem_in_the_text() {
    let Some(promtool) = promtool() else {
        return;
    };
    let Observed { text, .. } = observed_run();
    if let Err(said) = promtool_check(promtool, &text) {
        panic!("{said}");
    }
}

/// `promtool check metrics` on `text`: Err with what it said, and the text.
pub(crate) fn promtool_check(promtool: &str, text: &str) -> Result<(), String> {
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool starts");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("promtool reads");
    let output = child.wait_with_output().expect("promtool ends");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    // dcgm-exporter's `modelName` on the GPU series is kept as dcgm-exporter spells it,
    // so that its dashboards and joins work on tokwatt's series: promtool's snake_case
    // lint on it (exit 3, lint only) is the one thing let through, and only while it is
    // the one camelCase label name in the text.
    let camel = camel_case_label_names(text);
    let rest: Vec<&str> = said
        .lines()
        .filter(|line| {
            !(camel == ["modelName"]
                && line.starts_with("tokwatt_gpu_")
                && line.ends_with("label names should be written in 'snake_case' not 'camelCase'"))
        })
        .filter(|line| !line.trim().is_empty())
        .collect();
    let lint_only = output.status.success() || output.status.code() == Some(3);
    if lint_only && rest.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "promtool check metrics: {}\n{said}\n--- the text:\n{text}",
            output.status
        ))
    }
}

/// The label names of `text`'s samples with a lower-case letter followed by an upper-case
/// one (promtool's camelCase), sorted, each once.
fn camel_case_label_names(text: &str) -> Vec<String> {
    let mut names = std::collections::BTreeSet::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((_, labels)) = line.split_once('{') else {
            continue;
        };
        for pair in labels.split("\",") {
            let name = pair.trim_start_matches(',').split('=').next().unwrap_or("");
            let camel = name
                .as_bytes()
                .windows(2)
                .any(|w| w[0].is_ascii_lowercase() && w[1].is_ascii_uppercase());
            if camel {
                names.insert(name.to_owned());
            }
        }
    }
    names.into_iter().collect()
}

/// promtool's path, or `None` after saying why the check is skipped. Under
/// TOKWATT_REQUIRE_PROMTOOL=1 (set by .ci/run) a missing promtool fails instead.
pub(crate) fn promtool() -> Option<&'static str> {
    required_tool(
        "promtool",
        "TOKWATT_REQUIRE_PROMTOOL",
        "Debian: apt-get install prometheus",
    )
}
