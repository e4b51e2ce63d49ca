//! `tokwatt fleet ab`: is policy B more efficient than A across a fleet of `tokwatt serve`
//! nodes? Nodes paired by load, each pair's nodes on opposite arms and swapped halfway,
//! driven through their control APIs and read from Prometheus (`tokwatt_lab::fleet_ab`);
//! prints the verdict and writes `fleet-ab.json`. Nodes in a power domain have its grants
//! frozen in the fleet's etcd for the experiment (`--etcd`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

use tokwatt_fleet::etcd::EtcdFleet;
use tokwatt_fleet::{FleetStore, Freeze, FreezeOutcome, FreezeSession, FrozenWrite};
use tokwatt_lab::ab::Arm;
use tokwatt_lab::ab::stats::DEFAULT_ALPHA;
use tokwatt_lab::fleet_ab::{
    self, ApiAddress, BoxError, DomainReading, Fleet, FleetAbError, FleetAbReport, FleetNode,
    GrantSeen, LoadSource, NodeControl, NodePlace, NodePolicy, NodeState, PowerDomains, Prepared,
    Prometheus, Settings, Swapped,
};
use tokwatt_plugin::sanitize_text;
use tokwatt_serve::api::{ApiClient, SwapRequest};

mod etcd_domains;
use etcd_domains::EtcdDomains;

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
    /// The fleet's etcd client URL (http://HOST:PORT, or https://HOST:PORT with
    /// --etcd-ca); repeat for each member. Needed where a node is in a power domain: its
    /// grants are frozen for the experiment, since otherwise a greedier arm wins watts
    /// from the other arm's nodes through the coordinator.
    #[arg(long = "etcd", value_name = "URL")]
    etcd: Vec<String>,
    /// Each etcd request's deadline.
    #[arg(long, default_value = "2s", value_parser = tokwatt::cli::parse_duration)]
    etcd_timeout: Duration,
    /// The CA that signed etcd's server certificate (PEM): needed for https:// endpoints.
    #[arg(long, value_name = "FILE", requires = "etcd")]
    etcd_ca: Option<PathBuf>,
    /// A client certificate (PEM) for an etcd started with --client-cert-auth.
    #[arg(long, value_name = "FILE", requires_all = ["etcd_ca", "etcd_key"])]
    etcd_cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    #[arg(long, value_name = "FILE", requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
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
            fleet: status.fleet.map(|place| NodePlace {
                domain: place.domain,
                node: place.node,
            }),
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
    let domains = if args.etcd.is_empty() {
        None
    } else {
        let store = crate::fleet::connect_etcd(
            &args.etcd,
            args.etcd_timeout,
            args.etcd_ca.as_ref(),
            args.etcd_cert.as_ref(),
            args.etcd_key.as_ref(),
        )
        .with_context(|| unchanged.to_owned())?;
        Some(EtcdDomains::new(store))
    };
    let fleet = Fleet {
        nodes: &nodes,
        controls: &controls,
        counters: &prometheus,
        domains: domains.as_ref().map(|d| d as &dyn PowerDomains),
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
    if domains.is_some() && prepared.domains.is_empty() {
        println!("no node is in a power domain: nothing to freeze (--etcd is not needed)");
    }
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
    let outcome = fleet_ab::run(fleet, &settings, &prepared, &stop, &mut |what| {
        eprintln!("tokwatt fleet ab: {what}");
    });
    // Every freeze is ended by now; whatever is left (none) is ended here.
    drop(domains);
    let report = match outcome {
        Ok(report) => report,
        // The figures are kept for the record, but they are not a verdict.
        Err(FleetAbError::Biased {
            report,
            moved,
            put_back,
        }) => {
            let written = write_report(&report, &report_path);
            let error = FleetAbError::Biased {
                report,
                moved,
                put_back,
            };
            return match written {
                Ok(()) => Err(anyhow!(
                    "{error}; {} has the figures and every grant change",
                    report_path.display()
                )),
                Err(write_error) => Err(anyhow!("{error}; and {write_error:#}")),
            };
        }
        Err(error) => return Err(error.into()),
    };
    // The verdict is shown even where the file cannot be written.
    let written = write_report(&report, &report_path);
    print_verdict(&report, &report_path);
    written?;
    if !report.put_back.failed.is_empty() {
        bail!("the experiment finished, but {}", report.put_back);
    }
    Ok(())
}

fn write_report(report: &FleetAbReport, path: &Path) -> Result<()> {
    let json = serde_json::to_string_pretty(report).context("writing fleet-ab.json")?;
    tokwatt_report::write_atomically(path, &json)
        .with_context(|| format!("writing {}", path.display()))
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
    for domain in &prepared.domains {
        println!(
            "power domain {} ({} node(s): {}): its grants are frozen from before the first swap until every node is back (only cuts the budget forces are made)",
            shown(&domain.domain),
            domain.nodes.len(),
            shown(
                &domain
                    .nodes
                    .iter()
                    .map(|&i| nodes[i].name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        );
    }
    println!(
        "each half: {} settling, then {} measured",
        humantime::format_duration(settings.settle),
        humantime::format_duration(settings.half)
    );
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
        format!("{} ({})", v.decision_headline(), v.decision.code()),
    );
    row(
        "tokens/J B/A",
        format!(
            "{:.4}, {} intervals: bootstrap [{:.4}, {:.4}], t [{:.4}, {:.4}]",
            v.ratio_b_over_a,
            tokwatt_lab::ab::confidence_percent(v.confidence),
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
        row("refused because", why.clone());
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
    for domain in &report.domains {
        row(
            "frozen",
            format!(
                "power domain {} by {}; {} read(s) of its grants ({} failed); {}",
                shown(&domain.domain),
                shown(&domain.frozen_by),
                domain.reads,
                domain.read_errors,
                if domain.thawed {
                    "thawed"
                } else {
                    "NOT thawed: it lapses with its lease"
                }
            ),
        );
    }
    let watts =
        |g: Option<GrantSeen>| g.map_or_else(|| "none".to_owned(), |g| format!("{:.0}", g.watts));
    let granted: Vec<String> = report
        .nodes
        .iter()
        .filter(|node| node.fleet.is_some())
        .map(|node| {
            format!(
                "{} {} -> {}",
                shown(&node.name),
                watts(node.grant_start),
                watts(node.grant_end)
            )
        })
        .collect();
    if !granted.is_empty() {
        row("grants (W)", granted.join(", "));
        row(
            "grant changes",
            if report.grant_changes.is_empty() {
                "none while frozen".to_owned()
            } else {
                report
                    .grant_changes
                    .iter()
                    .map(|c| {
                        format!(
                            "{}{}",
                            shown(&c.to_string()),
                            if c.forced_cut {
                                " (a cut the budget forced)"
                            } else if c.in_window {
                                " (IN A MEASURED WINDOW)"
                            } else {
                                " (outside the measured windows)"
                            }
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; ")
            },
        );
    }
    row("put back", report.put_back.to_string());
    row("output", path.display().to_string());
}
