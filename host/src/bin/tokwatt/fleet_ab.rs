//! `tokwatt fleet ab`: is policy B more efficient than A across a fleet of `tokwatt serve`
//! nodes? Nodes paired by load, each pair's nodes on opposite arms and swapped halfway,
//! driven through their control APIs and read from Prometheus (`tokwatt::fleet_ab`);
//! prints the verdict and writes `fleet-ab.json`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};

use tokwatt::ab::stats::DEFAULT_ALPHA;
use tokwatt::ab::{Arm, Decision};
use tokwatt::api::{ApiClient, SwapRequest};
use tokwatt::fleet_ab::{
    self, ApiAddress, BoxError, Fleet, FleetAbReport, FleetNode, LoadSource, NodeControl,
    NodePolicy, NodeState, Prepared, Prometheus, Settings, Swapped,
};
use tokwatt::plugin::sanitize_text;

/// How long a swap may take: its plugin is compiled and started off the node's loop (a
/// large component takes seconds), then it waits for a tick boundary.
const SWAP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a status may take: a node that does not answer in this is named, not waited on.
const STATUS_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, clap::Args)]
pub struct FleetAbArgs {
    /// The nodes file (TOML): a [[node]] per agent with its name, control API (`socket`,
    /// or `url` and `token_file`), Prometheus `instance` label (and/or `labels`), and
    /// optionally its `load`.
    #[arg(long, value_name = "FILE")]
    nodes: PathBuf,
    /// The Prometheus server that scrapes the nodes' /metrics, e.g. http://prometheus:9090.
    #[arg(long, value_name = "URL")]
    prometheus: String,
    /// Arm A's policy spec (the reference): its absolute path on the nodes' machines.
    #[arg(long = "a", value_name = "SPEC")]
    a: PathBuf,
    /// Arm B's policy spec (the challenger): its absolute path on the nodes' machines.
    #[arg(long = "b", value_name = "SPEC")]
    b: PathBuf,
    /// Each half's measured window.
    #[arg(long, value_parser = tokwatt::cli::parse_duration, default_value = "30m")]
    half: Duration,
    /// After each swap, before the half's window starts (not measured): the new policy's
    /// first moves and the old one's queue.
    #[arg(long, value_parser = tokwatt::cli::parse_duration_or_zero, default_value = "2m")]
    settle: Duration,
    /// The window before the start over which every node's series are checked and, unless
    /// the nodes file gives them, the loads are measured (tokens per control tick).
    #[arg(long, value_parser = tokwatt::cli::parse_duration, default_value = "10m")]
    baseline: Duration,
    /// Seeds the coin that decides, in each pair, which node runs A first.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The false-positive rate of the verdict.
    #[arg(long, default_value_t = DEFAULT_ALPHA)]
    alpha: f64,
    /// Where some node exports no demand counter (served demand unknown), judge the
    /// objective on violations alone instead of refusing a winner.
    #[arg(long)]
    accept_unknown_demand: bool,
    /// The longest stretch without a successful scrape of a node that a window may have
    /// (default: three of its scrape intervals).
    #[arg(long, value_parser = tokwatt::cli::parse_duration)]
    max_scrape_gap: Option<Duration>,
    /// Output folder for fleet-ab.json (default: out/fleet-ab-TIME).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replace an earlier experiment's fleet-ab.json in --out.
    #[arg(long)]
    overwrite: bool,
    /// Check the nodes, Prometheus and the settings, and print the plan; change nothing.
    #[arg(long)]
    plan_only: bool,
}

/// A node's control API, through the CLI's client: one for statuses, one for swaps, whose
/// timeouts differ.
struct Agent {
    status: ApiClient,
    actions: ApiClient,
}

impl NodeControl for Agent {
    fn status(&self) -> Result<NodeState, BoxError> {
        let status = self.status.status()?;
        Ok(NodeState {
            policy: NodePolicy {
                name: status.policy.name,
                version: status.policy.version,
                spec: status.policy.spec,
                plugin: status.policy.plugin,
            },
            paused: status.paused,
            simulated: status.simulated,
        })
    }

    fn swap(&self, spec: &Path, plugin: Option<&Path>, fresh: bool) -> Result<Swapped, BoxError> {
        let outcome = self.actions.swap(&SwapRequest {
            spec: spec.to_owned(),
            plugin: plugin.map(Path::to_owned),
            fresh,
        })?;
        Ok(Swapped {
            policy: outcome.policy,
            state_carried: outcome.state_carried,
        })
    }
}

fn client(node: &FleetNode) -> Result<Agent> {
    let connect = |timeout: Duration| {
        match &node.api {
            ApiAddress::Socket(path) => ApiClient::unix(path),
            ApiAddress::Http { url, token_file } => {
                ApiClient::http_with_token_file(url, token_file)
            }
        }
        .map(|client| client.with_timeout(timeout))
        .map_err(|e| {
            anyhow!(
                "node `{}`'s control API: {e}; nothing was changed on any node",
                node.name
            )
        })
    };
    Ok(Agent {
        status: connect(STATUS_TIMEOUT)?,
        actions: connect(SWAP_TIMEOUT)?,
    })
}

pub fn fleet_ab(args: &FleetAbArgs) -> Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop))
            .context("installing signal handlers")?;
    }
    let unchanged = "nothing was changed on any node";
    // The cause first, then what it means for the nodes.
    let nodes = fleet_ab::load_nodes(&args.nodes).map_err(|e| anyhow!("{e}; {unchanged}"))?;
    let agents = nodes.iter().map(client).collect::<Result<Vec<_>>>()?;
    let controls: Vec<&dyn NodeControl> = agents.iter().map(|a| a as &dyn NodeControl).collect();
    let prometheus = Prometheus::new(&args.prometheus).map_err(|e| anyhow!("{e}; {unchanged}"))?;
    let fleet = Fleet {
        nodes: &nodes,
        controls: &controls,
        counters: &prometheus,
    };
    let settings = Settings {
        a: args.a.clone(),
        b: args.b.clone(),
        half: args.half,
        settle: args.settle,
        baseline: args.baseline,
        seed: args.seed,
        alpha: args.alpha,
        accept_unknown_demand: args.accept_unknown_demand,
        max_scrape_gap: args.max_scrape_gap,
        source: args.prometheus.clone(),
    };
    let out_dir = match &args.out {
        Some(dir) => dir.clone(),
        None => crate::run::fresh_out_dir(Path::new("out"), "fleet-ab"),
    };
    let report_path = out_dir.join("fleet-ab.json");
    if !args.plan_only && report_path.exists() && !args.overwrite {
        bail!(
            "{} holds an earlier experiment; choose another --out, or pass --overwrite ({unchanged})",
            report_path.display()
        );
    }

    let prepared = fleet_ab::prepare(fleet, &settings)?;
    print_plan(&nodes, &prepared, &settings);
    if args.plan_only {
        println!("plan only: {unchanged}");
        return Ok(());
    }
    std::fs::create_dir_all(&out_dir).with_context(|| {
        format!(
            "creating the output folder {} ({unchanged})",
            out_dir.display()
        )
    })?;
    let report = fleet_ab::run(fleet, &settings, &prepared, &stop, &mut |what| {
        eprintln!("tokwatt fleet ab: {what}");
    })?;
    // The verdict is shown even where the file cannot be written.
    let written = serde_json::to_string_pretty(&report)
        .context("writing fleet-ab.json")
        .and_then(|json| {
            tokwatt::report::write_atomically(&report_path, &json)
                .with_context(|| format!("writing {}", report_path.display()))
        });
    print_verdict(&report, &report_path);
    written?;
    if !report.put_back.failed.is_empty() {
        bail!("the experiment finished, but {}", report.put_back);
    }
    Ok(())
}

/// Text an agent or a file gave, safe for a terminal.
fn shown(text: &str) -> String {
    sanitize_text(text, 256)
}

fn print_plan(nodes: &[FleetNode], prepared: &Prepared, settings: &Settings) {
    let simulated: Vec<&str> = nodes
        .iter()
        .zip(&prepared.originals)
        .filter(|(_, state)| state.simulated)
        .map(|(node, _)| node.name.as_str())
        .collect();
    if !simulated.is_empty() {
        println!(
            "SIMULATED: {} of {} nodes are simulated ({}); their figures are simulator output, never a GPU's",
            simulated.len(),
            nodes.len(),
            shown(&simulated.join(", "))
        );
    }
    let load = match prepared.load_source {
        LoadSource::Given => "as the nodes file gives it".to_owned(),
        LoadSource::TokensPerTick => format!(
            "tokens per control tick over the {} before the start",
            humantime::format_duration(settings.baseline)
        ),
    };
    println!("pairs by load ({load}); the coin (seed {}):", settings.seed);
    let describe = |i: usize, first: Arm| {
        format!(
            "{} (load {:.1}, {} then {})",
            shown(&nodes[i].name),
            prepared.loads[i],
            first,
            if first == Arm::A { Arm::B } else { Arm::A }
        )
    };
    for (k, pair) in prepared.assignment.pairs.iter().enumerate() {
        println!(
            "  pair {}: {}, {}",
            k + 1,
            describe(pair.a_first, Arm::A),
            describe(pair.b_first, Arm::B)
        );
    }
    if let Some(out) = prepared.assignment.left_out {
        println!(
            "  left out (odd one, stays on {}): {}",
            shown(&prepared.originals[out].policy.name),
            shown(&nodes[out].name)
        );
    }
    if !prepared.demand_unknown_on.is_empty() {
        println!(
            "served demand unknown on {} (no tokwatt_gpu_tokens_demanded_total){}",
            shown(&prepared.demand_unknown_on.join(", ")),
            if settings.accept_unknown_demand {
                ": the objective is judged on violations alone (--accept-unknown-demand)"
            } else {
                ": a winner will be refused (--accept-unknown-demand judges on violations alone)"
            }
        );
    }
    println!(
        "each half: {} settling, then {} measured",
        humantime::format_duration(settings.settle),
        humantime::format_duration(settings.half)
    );
}

fn decision_words(decision: Decision) -> &'static str {
    match decision {
        Decision::A => "A is more efficient",
        Decision::B => "B is more efficient",
        Decision::NoDifference => "no difference shown",
        Decision::Continue => "not decided",
    }
}

fn print_verdict(report: &FleetAbReport, path: &Path) {
    let v = &report.verdict;
    let row = |key: &str, value: String| println!("{key:<20} {value}");
    println!();
    row("a", report.a.display().to_string());
    row("b", report.b.display().to_string());
    if !report.simulated_nodes.is_empty() {
        row(
            "SIMULATED",
            format!(
                "{} node(s): figures are simulator output",
                report.simulated_nodes.len()
            ),
        );
    }
    row(
        "decision",
        format!(
            "{} ({})",
            decision_words(v.decision),
            serde_json::to_value(v.decision)
                .ok()
                .and_then(|d| d.as_str().map(str::to_owned))
                .unwrap_or_default()
        ),
    );
    row(
        "tokens/J B/A",
        format!(
            "{:.4}, {:.2} % intervals: bootstrap [{:.4}, {:.4}], t [{:.4}, {:.4}]",
            v.ratio_b_over_a,
            v.confidence * 100.0,
            v.ci_low,
            v.ci_high,
            v.t_ci_low,
            v.t_ci_high
        ),
    );
    row(
        "pairs",
        format!(
            "{} (the unit: a pair of load-matched nodes, each half a fresh instance){}",
            v.pairs,
            report
                .left_out
                .as_deref()
                .map(|n| format!("; left out: {}", shown(n)))
                .unwrap_or_default()
        ),
    );
    row(
        "estimand",
        format!(
            "the fleet's tokens per joule, B over A, per pair of load-matched nodes (each arm's two halves summed: one on each node, one in each half); settled: {} after each swap unmeasured, {} measured a half",
            humantime::format_duration(Duration::from_secs_f64(report.settle_s)),
            humantime::format_duration(Duration::from_secs_f64(report.half_s))
        ),
    );
    let fraction = |f: Option<f64>| f.map_or_else(|| "unknown".to_owned(), |f| format!("{f:.4}"));
    row(
        "served a / b",
        format!(
            "{} / {}{}",
            fraction(v.served_fraction_a),
            fraction(v.served_fraction_b),
            if report.demand_unknown_on.is_empty() {
                String::new()
            } else {
                format!(
                    " (no demand counter on {})",
                    shown(&report.demand_unknown_on.join(", "))
                )
            }
        ),
    );
    row(
        "violations a / b",
        format!(
            "{:.2} % / {:.2} % of GPU-ticks",
            v.violation_rate_a * 100.0,
            v.violation_rate_b * 100.0
        ),
    );
    if let Some(why) = &v.refused_because {
        row("no winner because", why.clone());
    }
    for pair in &report.pairs {
        row(
            "pair",
            format!(
                "{} + {}: B/A {:.4} ({:.4} / {:.4} tokens/J)",
                shown(&pair.a_first),
                shown(&pair.b_first),
                pair.sums.ratio_b_over_a,
                pair.sums.b.tokens_per_joule,
                pair.sums.a.tokens_per_joule
            ),
        );
    }
    row("put back", report.put_back.to_string());
    row("output", path.display().to_string());
}
