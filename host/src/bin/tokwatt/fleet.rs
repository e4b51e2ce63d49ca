//! `tokwatt fleet`: a power budget across nodes, on etcd. `budget` sets a domain's
//! budget from a file, `show` prints the ledger as the coordinator reads it, `release`
//! frees a silent node's stranded watts on the operator's word, `coordinate` runs one
//! coordinator replica (run two or more: the store elects the leader).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use tokwatt_fleet::etcd::{ClientFiles, EtcdFleet, EtcdTls, TlsError, TlsFile, TlsFiles};
use tokwatt_fleet::ledger::Why;
use tokwatt_fleet::show::{LedgerDocument, acknowledged, why_words};
use tokwatt_fleet::{
    Coordinator, CoordinatorConfig, DomainBudget, FleetStore, FrozenWrite, Hold, Ledger,
    MarginalAllocator, ProofSource, ReleaseProof, Round,
};

#[derive(Debug, clap::Subcommand)]
pub enum FleetCommand {
    /// Set a domain's budget from a TOML file (domain, budget_w, uncontrolled_w, and a
    /// [[nodes]] table per node: node, reserve_w, max_w, priority, fenced, default_w).
    /// Checked before it is written.
    Budget(BudgetArgs),
    /// The domain's ledger as the coordinator reads it: each node's lease, grant, reported
    /// caps, the watts charged to it and why, the watts stranded on silent nodes and when
    /// they free, the headroom, and who froze the domain's grants (an experiment).
    Show(ShowArgs),
    /// Free a silent node's stranded watts on your word: its GPUs' caps sum to at most its
    /// reserve (checked by hand, or the node is off) and stay so until its agent reports
    /// again. Refused while the node is live.
    Release(ReleaseArgs),
    /// Run a coordinator replica for a domain until SIGINT or SIGTERM (then it resigns, so
    /// another replica takes over at once).
    Coordinate(CoordinateArgs),
    /// Is policy B more efficient than A across serving nodes? Nodes paired by load, each
    /// pair's two on opposite arms and swapped halfway, counters read from Prometheus;
    /// a verdict over the pairs, fleet-ab.json, and every node put back.
    Ab(Box<crate::fleet_ab::FleetAbArgs>),
}

#[derive(Debug, clap::Args)]
pub struct EtcdArgs {
    /// An etcd client URL (http://HOST:PORT, or https://HOST:PORT with --etcd-ca); repeat
    /// for each member.
    #[arg(long = "etcd", required = true)]
    endpoints: Vec<String>,
    /// Each request's deadline.
    #[arg(long, default_value = "2s", value_parser = tokwatt::cli::parse_duration)]
    timeout: Duration,
    /// The CA that signed etcd's server certificate (PEM): needed for https:// endpoints.
    #[arg(long, value_name = "FILE")]
    etcd_ca: Option<PathBuf>,
    /// A client certificate (PEM) for an etcd started with --client-cert-auth.
    #[arg(long, value_name = "FILE", requires_all = ["etcd_ca", "etcd_key"])]
    etcd_cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    #[arg(long, value_name = "FILE", requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
}

impl EtcdArgs {
    fn connect(&self) -> Result<EtcdFleet> {
        connect_etcd(
            &self.endpoints,
            self.timeout,
            self.etcd_ca.as_ref(),
            self.etcd_cert.as_ref(),
            self.etcd_key.as_ref(),
        )
    }
}

/// The fleet's etcd at `endpoints`, over TLS where a CA is given (a client certificate and
/// its key too, where given); each flag named where its file is wrong.
pub fn connect_etcd(
    endpoints: &[String],
    timeout: Duration,
    etcd_ca: Option<&PathBuf>,
    etcd_cert: Option<&PathBuf>,
    etcd_key: Option<&PathBuf>,
) -> Result<EtcdFleet> {
    let tls = match etcd_ca {
        None => None,
        Some(ca) => {
            let files = TlsFiles {
                ca_file: ca.clone(),
                client: match (etcd_cert, etcd_key) {
                    (Some(cert), Some(key)) => Some(ClientFiles {
                        cert_file: cert.clone(),
                        key_file: key.clone(),
                    }),
                    // clap requires both or neither.
                    _ => None,
                },
            };
            let flag = |error: &TlsError| match error.file() {
                Some(TlsFile::Cert) => "--etcd-cert",
                Some(TlsFile::Key) => "--etcd-key",
                Some(TlsFile::Ca) | None => "--etcd-ca",
            };
            Some(EtcdTls::load(&files).map_err(|error| {
                let flag = flag(&error);
                anyhow::Error::new(error).context(format!("the TLS file of {flag}"))
            })?)
        }
    };
    EtcdFleet::connect_with(endpoints, tls.as_ref(), timeout)
        .context("the etcd endpoints (--etcd, --etcd-ca)")
}

#[derive(Debug, clap::Args)]
pub struct BudgetArgs {
    #[command(flatten)]
    etcd: EtcdArgs,
    /// The budget file.
    #[arg(long)]
    file: PathBuf,
    /// Only parse and check the file (the rules a budget must keep), without contacting
    /// etcd: for CI, or before a change is applied.
    #[arg(long, conflicts_with_all = ["endpoints", "etcd_ca", "etcd_cert", "etcd_key"])]
    check: bool,
}

#[derive(Debug, clap::Args)]
pub struct ShowArgs {
    #[command(flatten)]
    etcd: EtcdArgs,
    #[arg(long)]
    domain: String,
    /// Print the ledger as JSON (stable keys, `format_version` 1: the book's fleet page,
    /// "Watching it") instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
pub struct ReleaseArgs {
    #[command(flatten)]
    etcd: EtcdArgs,
    /// The power domain, as its budget names it.
    #[arg(long)]
    domain: String,
    /// The node, as the budget names it.
    node: String,
    /// Why you release it, in words kept with the release (`fleet show` prints them):
    /// what you checked, e.g. "nvidia-smi: 8 x 125 W" or "powered off at the PDU".
    #[arg(long, value_name = "TEXT")]
    why: String,
    /// Who releases it (default: $USER on this host), kept with the release.
    #[arg(long, value_name = "WHO")]
    by: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct CoordinateArgs {
    #[command(flatten)]
    etcd: EtcdArgs,
    #[arg(long)]
    domain: String,
    /// This replica's name (default: the host name and process id).
    #[arg(long)]
    name: Option<String>,
    /// The leadership lease: how long a dead leader holds the domain before another
    /// replica takes over.
    #[arg(long, default_value = "10s", value_parser = tokwatt::cli::parse_duration)]
    ttl: Duration,
    /// How often the leader reads the domain and writes grants.
    #[arg(long, default_value = "1s", value_parser = tokwatt::cli::parse_duration)]
    period: Duration,
    /// Serve this replica's metrics (GET /metrics: leadership, rounds and, while it
    /// leads, the ledger and each node's grant) on ADDR, e.g. 0.0.0.0:9401.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
    /// Power a frozen host off through its BMC (a ClusterLabs fence agent such as
    /// fence_redfish or fence_ipmilan, as configured per node in this TOML file) once it
    /// has been silent long enough with watts stranded and no proof, and free its watts
    /// on the power state read back OFF. Checked before the replica starts. The book's
    /// "The off-node fence" page has the format.
    #[arg(long, value_name = "FILE")]
    off_node_fence: Option<PathBuf>,
}

pub fn fleet(command: &FleetCommand) -> Result<()> {
    match command {
        FleetCommand::Budget(args) => budget(args),
        FleetCommand::Show(args) => show(args),
        FleetCommand::Release(args) => release(args),
        FleetCommand::Coordinate(args) => coordinate(args),
        FleetCommand::Ab(args) => crate::fleet_ab::fleet_ab(args),
    }
}

fn budget(args: &BudgetArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("cannot read the budget file {}", args.file.display()))?;
    let budget: DomainBudget = toml::from_str(&text)
        .with_context(|| format!("{} is not a domain budget", args.file.display()))?;
    budget
        .check()
        .with_context(|| format!("the budget in {}", args.file.display()))?;
    let summary = format!(
        "domain {}: {} W, {} W uncontrolled, {} nodes ({} fenced), reserves {} W, silent draws {} W (every node cut off at once: {} W with the uncontrolled draw)",
        budget.domain,
        budget.budget_w,
        budget.uncontrolled_w,
        budget.nodes.len(),
        budget.nodes.iter().filter(|n| n.fenced).count(),
        budget.reserves_w(),
        budget.silent_w(),
        budget.silent_w() + budget.uncontrolled_w
    );
    if args.check {
        println!("{summary} (checked, not written)");
        return Ok(());
    }
    args.etcd.connect()?.put_budget(&budget)?;
    println!("{summary}");
    Ok(())
}

fn show(args: &ShowArgs) -> Result<()> {
    let store = args.etcd.connect()?;
    let Some(view) = store.read_domain(&args.domain)? else {
        bail!(
            "domain `{}` has no budget in etcd: set one with `tokwatt fleet budget --file FILE`",
            args.domain
        );
    };
    let ledger = Ledger::from_view(view);
    if args.json {
        let document = serde_json::to_string_pretty(&LedgerDocument::of(&ledger))
            .context("writing the ledger as JSON")?;
        println!("{document}");
        return Ok(());
    }
    let mut table = comfy_table::Table::new();
    table
        .load_preset(comfy_table::presets::NOTHING)
        .set_header([
            "node",
            "lease",
            "grant (W)",
            "acknowledged",
            "caps in force (W)",
            "draw (W)",
            "charged (W)",
            "why",
            "stranded (W)",
            "reserve (W)",
        ]);
    for entry in &ledger.entries {
        let report = entry.record.map(|r| r.report);
        table.add_row([
            entry.node().to_owned(),
            entry
                .record
                .map_or_else(|| "none".to_owned(), |r| format!("{:x}", r.lease)),
            entry.grant.map_or_else(
                || "-".to_owned(),
                |g| match g.under_freeze {
                    Some(FrozenWrite::BudgetCut) => {
                        format!("{:.0} (#{}, cut while frozen)", g.watts, g.generation)
                    }
                    Some(FrozenWrite::Reserve) => {
                        format!("{:.0} (#{}, reserve while frozen)", g.watts, g.generation)
                    }
                    None => format!("{:.0} (#{})", g.watts, g.generation),
                },
            ),
            match (entry.grant, acknowledged(entry)) {
                (_, Some(true)) => "yes".to_owned(),
                (Some(g), Some(false)) => format!("no (ceiling {:.0} W)", g.ceiling_w),
                _ => "-".to_owned(),
            },
            report.map_or_else(|| "-".to_owned(), |r| format!("{:.0}", r.caps_in_force_w)),
            report.map_or_else(|| "-".to_owned(), |r| format!("{:.0}", r.draw_w)),
            format!("{:.0}", entry.charged_w),
            why_words(entry),
            format!("{:.0}", entry.stranded_w),
            format!("{:.0}", entry.budget.reserve_w),
        ]);
    }
    println!("{table}");
    for (node, watts) in &ledger.unbudgeted {
        println!("node {node} is not in the budget and holds {watts:.0} W outside the plan");
    }
    for entry in ledger.entries.iter().filter(|e| e.fence_missing) {
        println!(
            "node {} is fenced in the budget but declares no fence, or no boot unit proved itself for its boot: charged as unfenced ({:.0} W, what a reboot may leave, not its {:.0} W reserve); run its fence and its boot unit with --etcd (tokwatt fence --once --etcd …), or set fenced = false",
            entry.node(),
            entry.floor_w,
            entry.budget.reserve_w
        );
    }
    if let Some(frozen) = &ledger.freeze {
        println!(
            "FROZEN by {} ({}), lease {:x}: every grant is held where it is; only the cuts the budget needs and a joining node's reserve are written, until it is thawed or its lease lapses",
            frozen.freeze.by, frozen.freeze.why, frozen.lease
        );
    }
    if ledger.stranded_w() > 0.0 {
        println!(
            "{:.0} W stranded on silent nodes: what their GPUs may still hold, given to no other node until each reports again, a record proves its caps lower (its fence, boot unit or agent, or an off-node fence), or it is released (`tokwatt fleet release NODE --why …`)",
            ledger.stranded_w()
        );
    }
    println!(
        "domain {}: {:.0} W charged of {:.0} W available ({:.0} W budget, {:.0} W uncontrolled); headroom {:.0} W; revision {}",
        ledger.budget.domain,
        ledger.charged_w(),
        ledger.budget.available_w(),
        ledger.budget.budget_w,
        ledger.budget.uncontrolled_w,
        ledger.headroom_w(),
        ledger.revision
    );
    Ok(())
}

/// Who runs this command: $USER (or $LOGNAME) on this host.
fn operator_name() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown user".to_owned());
    let host = Some(tokwatt_fleet::budget::host_name())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown host".to_owned());
    format!("{user}@{host}")
}

fn release(args: &ReleaseArgs) -> Result<()> {
    let store = args.etcd.connect()?;
    let Some(view) = store.read_domain(&args.domain)? else {
        bail!(
            "domain `{}` has no budget in etcd: set one with `tokwatt fleet budget --file FILE`",
            args.domain
        );
    };
    let ledger = Ledger::from_view(view);
    let Some(entry) = ledger.entries.iter().find(|e| e.node() == args.node) else {
        bail!(
            "domain `{}`'s budget does not name node `{}`: `tokwatt fleet show --domain {}` lists its nodes",
            args.domain,
            args.node,
            args.domain
        );
    };
    let reserve_w = entry.budget.reserve_w;
    if entry.live() {
        bail!(
            "node `{}` is live: it reports the caps it reads back, and is charged {:.0} W by them and its grant; a release is for a silent node. Nothing written",
            args.node,
            entry.charged_w
        );
    }
    if entry.why == Why::Released {
        println!(
            "node `{}` is released already: charged its {reserve_w:.0} W reserve",
            args.node
        );
        return Ok(());
    }
    let floor_w = entry.floor_w;
    println!(
        "Releasing node `{}` of domain `{}`: charged {:.0} W now ({}), {:.0} W above its {reserve_w:.0} W reserve.",
        args.node,
        args.domain,
        entry.charged_w,
        why_words(entry),
        entry.stranded_w
    );
    println!(
        "This assumes its GPUs' power caps sum to at most {reserve_w:.0} W now and stay so until its agent reports again: you read them on the node (nvidia-smi -q -d POWER), or the node is off."
    );
    if floor_w > reserve_w {
        println!(
            "It has no fence covering reboots: a boot leaves its GPUs' board defaults ({floor_w:.0} W) in force until the agent starts. Keep it off until the domain has room for them (`tokwatt fleet show`: headroom of {:.0} W or more), or enable its boot unit first; its agent's return charges them again.",
            floor_w - reserve_w
        );
    }
    if args.why.trim().is_empty() {
        bail!(
            "--why is empty: say what you checked (e.g. --why \"nvidia-smi: 8 x 125 W\"), so the next operator can trust it"
        );
    }
    let (fence, default_w, boot) = entry.hold.map_or((None, 0.0, 0), |stored| {
        (stored.hold.fence, stored.hold.default_w, stored.hold.boot)
    });
    let hold = Hold {
        watts: reserve_w,
        fence,
        default_w,
        released: true,
        boot,
    };
    let record = ReleaseProof {
        source: ProofSource::Operator,
        by: args.by.clone().unwrap_or_else(operator_name),
        caps_w: Vec::new(),
        sum_w: reserve_w,
        at_unix_ms: tokwatt_serve::fence::unix_ms_now(),
        boot,
        detail: args.why.trim().to_owned(),
    };
    let revision = entry.hold.map_or(0, |stored| stored.mod_revision);
    if !store.release(&args.domain, &args.node, &hold, revision, &record)? {
        bail!(
            "node `{}` came back, or the leader rewrote its hold, since it was read: nothing written; look again with `tokwatt fleet show --domain {}`",
            args.node,
            args.domain
        );
    }
    println!(
        "Released by {}: node `{}` is charged its {reserve_w:.0} W reserve from the leader's next round, freeing {:.0} W, until its agent reports again.",
        record.by, args.node, entry.stranded_w
    );
    Ok(())
}

fn coordinate(args: &CoordinateArgs) -> Result<()> {
    // A file with a mistake is refused before anything starts, rather than found out
    // when a host freezes.
    let off_node = args
        .off_node_fence
        .as_deref()
        .map(tokwatt_fleet::offnode::OffNodeConfig::load)
        .transpose()
        .context("the off-node fence (--off-node-fence)")?;
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop))
            .context("installing signal handlers")?;
    }
    let store = args.etcd.connect()?;
    let name = match &args.name {
        Some(name) => name.clone(),
        None => {
            let host = tokwatt_fleet::budget::host_name();
            let host = if host.is_empty() {
                "coordinator".into()
            } else {
                host
            };
            format!("{host}-{}", std::process::id())
        }
    };
    if args.ttl < Duration::from_secs(2) || args.period * 2 > args.ttl {
        bail!(
            "--period ({:?}) must fit twice in --ttl ({:?}), and --ttl be at least 2s: the leader renews its lease every period",
            args.period,
            args.ttl
        );
    }
    let metrics =
        Arc::new(tokwatt_serve::metrics::coordinator::CoordinatorMetrics::new(&args.domain));
    let _metrics_server = match args.metrics {
        Some(addr) => {
            let server = tokwatt_serve::api::ApiServer::start_metrics_only(addr, metrics.clone())
                .context("the metrics address (--metrics)")?;
            if let Some(addr) = server.metrics_addr() {
                eprintln!("coordinator {name}: metrics on http://{addr}/metrics");
            }
            Some(server)
        }
        None => None,
    };
    let mut coordinator = Coordinator::new(
        CoordinatorConfig {
            domain: args.domain.clone(),
            name: name.clone(),
            ttl: args.ttl,
        },
        Box::new(MarginalAllocator::default()),
    );
    if let Some(config) = off_node {
        let nodes: Vec<&str> = config.nodes.keys().map(String::as_str).collect();
        eprintln!(
            "coordinator {name}: off-node fence for {} (while leading)",
            nodes.join(", ")
        );
        coordinator = coordinator.with_off_node(tokwatt_fleet::offnode::OffNodeFence::new(config));
    }
    eprintln!("coordinator {name} for domain {}: campaigning", args.domain);
    let mut was_leader = false;
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let round = coordinator.round(&store);
        metrics.observe(&round);
        if let Some(fence) = coordinator.off_node() {
            metrics.observe_off_node(&fence.counts());
        }
        match round {
            Ok(Round::Leader {
                took_over,
                charged_w,
                available_w,
                grants_written,
                holds_written,
                live_nodes,
                ref ledger,
                ..
            }) => {
                if took_over {
                    eprintln!("coordinator {name}: leading domain {}", args.domain);
                }
                was_leader = true;
                tracing::info!(
                    charged_w,
                    available_w,
                    grants_written,
                    holds_written,
                    live_nodes,
                    stranded_w = ledger.stranded_w(),
                    "fleet: round"
                );
            }
            Ok(Round::Follower) => {
                if was_leader {
                    eprintln!("coordinator {name}: no longer leading; campaigning");
                    was_leader = false;
                }
            }
            // The store answers again later: a round is only tried again.
            Err(error) => tracing::warn!("fleet: round failed: {error}"),
        }
        while !stop.load(Ordering::Relaxed) && started.elapsed() < args.period {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    coordinator
        .resign(&store)
        .context("resigning the leadership (it lapses with its lease anyway)")?;
    eprintln!("coordinator {name}: stopped");
    Ok(())
}
