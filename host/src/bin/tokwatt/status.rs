//! `tokwatt status`: what a running agent (`tokwatt serve`) is doing, from its control API.
//! Also the connection flags every API command shares.

use std::path::PathBuf;

use anyhow::{Context, Result};

use tokwatt_plugin::sanitize_text;
use tokwatt_serve::api::{
    self, ApiClient, FleetStatus, GpuStatus, Holding, NodeStatus, NodeTotals,
};

/// Where the agent's control API is.
#[derive(Debug, Clone, clap::Args)]
pub struct ConnectionArgs {
    /// The agent's control socket (default: /run/tokwatt/tokwatt.sock as root, else
    /// $XDG_RUNTIME_DIR/tokwatt/tokwatt.sock).
    #[arg(long, value_name = "PATH", conflicts_with = "url")]
    socket: Option<PathBuf>,
    /// The agent's loopback HTTP listener, e.g. http://127.0.0.1:8321 (with --token-file).
    #[arg(long, value_name = "URL", requires = "token_file")]
    url: Option<String>,
    /// The file holding the agent's bearer token (for --url).
    #[arg(long, value_name = "FILE", requires = "url")]
    token_file: Option<PathBuf>,
}

impl ConnectionArgs {
    pub fn client(&self) -> Result<ApiClient> {
        let client = match (&self.url, &self.token_file, &self.socket) {
            (Some(url), Some(token_file), _) => ApiClient::http_with_token_file(url, token_file)?,
            (_, _, Some(socket)) => ApiClient::unix(socket)?,
            _ => ApiClient::unix(api::default_socket_path()?)?,
        };
        Ok(client)
    }
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    connection: ConnectionArgs,
    /// Print the agent's status as JSON (the API's own document; with --watch, one
    /// document a line).
    #[arg(long)]
    json: bool,
    /// Ask again every PERIOD (default 2s) until interrupted: on a terminal the screen is
    /// redrawn, elsewhere each status follows the last. An agent that stops answering is
    /// said so, and asked again.
    #[arg(long, value_name = "PERIOD", num_args = 0..=1, default_missing_value = "2s",
          value_parser = tokwatt::cli::parse_duration)]
    watch: Option<std::time::Duration>,
    /// With --watch: stop after this many statuses (for scripts); the exit status is the
    /// last one's.
    #[arg(long, requires = "watch", value_parser = clap::value_parser!(u64).range(1..))]
    count: Option<u64>,
}

pub fn status(args: &StatusArgs) -> Result<()> {
    let client = args.connection.client()?;
    let Some(period) = args.watch else {
        let status = client
            .status()
            .with_context(|| format!("asking {} for its status", client.describe_target()))?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&status)?);
        } else {
            print!("{}", render(&status));
        }
        return Ok(());
    };
    if period < std::time::Duration::from_millis(100) {
        anyhow::bail!(
            "--watch {period:?} would ask the agent more than 10 times a second: give 100ms or more (for example --watch 2s)"
        );
    }
    use std::io::IsTerminal;
    let redraw = !args.json && std::io::stdout().is_terminal();
    let mut shown = 0u64;
    loop {
        let asked = client
            .status()
            .with_context(|| format!("asking {} for its status", client.describe_target()));
        let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now());
        match (&asked, args.json) {
            (Ok(status), true) => println!("{}", serde_json::to_string(status)?),
            (Ok(status), false) => {
                if redraw {
                    // Home and clear: the screen shows the newest status only.
                    print!("\x1b[H\x1b[2J");
                } else if shown > 0 {
                    println!();
                }
                println!("{stamp} (every {})", humantime::format_duration(period));
                print!("{}", render(status));
            }
            (Err(error), _) => eprintln!("{stamp}: not answering: {error:#}"),
        }
        shown += 1;
        if args.count.is_some_and(|count| shown >= count) {
            return asked.map(|_| ());
        }
        std::thread::sleep(period);
    }
}

/// Text the agent sent, safe for a terminal.
fn shown(text: &str) -> String {
    sanitize_text(text, 256)
}

fn figure(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{v:.decimals$}"))
}

/// The status for people.
fn render(status: &NodeStatus) -> String {
    let mut out = String::new();
    let mut line = |text: String| {
        out.push_str(&text);
        out.push('\n');
    };
    if status.simulated {
        line(format!(
            "SIMULATED: every figure below is simulator output ({})",
            shown(&status.data_source)
        ));
    }
    line(format!(
        "agent      tokwatt {}, {} ticks, up {:.0} s; actuator {}, workload {}",
        shown(&status.agent_version),
        status.ticks,
        status.uptime_s,
        shown(&status.actuator),
        shown(&status.workload)
    ));
    let policy = &status.policy;
    let mut policy_line = format!(
        "policy     {} (version {}), in charge for {} ticks",
        shown(&policy.name),
        shown(&policy.version),
        policy.ticks_in_charge
    );
    if policy.on_probation {
        policy_line.push_str(", ON PROBATION (a failure brings the previous policy back)");
    }
    line(policy_line);
    line(format!(
        "           swaps {}, rollbacks {} (by the operator {}), previous {}",
        policy.swaps,
        policy.rollbacks,
        policy.operator_rollbacks,
        policy.previous.as_deref().map_or("none".into(), shown)
    ));
    if let Some(fleet) = &status.fleet {
        for text in fleet_lines(fleet, NodeTotals::of(&status.gpus).power_cap_w) {
            line(text);
        }
    }
    line(if status.paused {
        "loop       PAUSED: the settings in force are held and the policy is not asked".into()
    } else if status.guard.in_charge {
        "loop       GUARD IN CHARGE: the policy broke the objective too often; the device defaults decide until its back-off ends".into()
    } else {
        "loop       running".into()
    });
    let guard = &status.guard;
    line(format!(
        "guard      {}; objective {}; take-overs {} ({} unservable), policy's violating ticks {}, objective rollbacks {}",
        if guard.enabled {
            "on"
        } else {
            "off (counting only)"
        },
        objective_words(&guard.objective),
        guard.takeovers,
        guard.unservable_takeovers,
        guard.policy_violation_ticks,
        guard.objective_rollbacks
    ));
    line(format!(
        "{:<4} {:<16} {:>7} {:>9} {:>6} {:>7} {:>8} {:>8} {:>11}",
        "GPU", "name", "cap W", "clock MHz", "batch", "tok/J", "power W", "tok/s", "TPOT p99 ms"
    ));
    for gpu in &status.gpus {
        line(gpu_row(gpu, &status.workload));
    }
    line(node_row(&NodeTotals::of(&status.gpus)));
    let failures = &status.failures;
    let counted = [
        ("fallback ticks", failures.fallback_ticks),
        ("plugin traps", failures.plugin_traps),
        ("ejections", failures.ejections),
        ("actuator errors", failures.actuator_errors),
        ("telemetry errors", failures.telemetry_errors),
        // Node-wide: ticks in which any GPU broke it (each GPU's are in its row's series,
        // tokwatt_gpu_slo_violation_ticks_total).
        (
            "node ticks breaking the objective",
            failures.slo_violation_ticks,
        ),
        ("TPOT unknown ticks", failures.tpot_unknown_ticks),
        ("swaps refused", failures.swaps_refused),
    ];
    let seen: Vec<String> = counted
        .iter()
        .filter(|(_, count)| *count > 0)
        .map(|(name, count)| format!("{name} {count}"))
        .collect();
    line(format!(
        "failures   {}",
        if seen.is_empty() {
            "none".into()
        } else {
            seen.join(", ")
        }
    ));
    if let Some(last) = &failures.last {
        line(format!("last       {}", shown(last)));
    }
    out
}

/// One GPU's line. A serving engine's batch size is its own: tokwatt neither knows nor
/// sets it, so it shows as n/a.
fn gpu_row(gpu: &GpuStatus, workload: &str) -> String {
    let batch = if workload == tokwatt_engines::prometheus::WORKLOAD_NAME {
        "n/a".to_owned()
    } else {
        gpu.in_force.batch_size.to_string()
    };
    format!(
        "{:<4} {:<16} {:>7.0} {:>9} {:>6} {:>7} {:>8} {:>8} {:>11}",
        gpu.gpu,
        shown(&gpu.name),
        gpu.in_force.power_cap_w,
        gpu.in_force.sm_clock_max_mhz,
        batch,
        figure(gpu.last_tokens_per_joule, 3),
        figure(gpu.last_power_w, 1),
        figure(gpu.last_tokens_per_s, 0),
        figure(gpu.last_tpot_p99_ms, 2),
    )
}

/// The node's GPUs together, under their rows: caps and power summed, the node's tokens
/// per joule (its tokens per second over its power).
fn node_row(node: &NodeTotals) -> String {
    format!(
        "{:<4} {:<16} {:>7.0} {:>9} {:>6} {:>7} {:>8} {:>8} {:>11}",
        "node",
        format!("{} GPUs", node.gpus),
        node.power_cap_w,
        "",
        "",
        figure(node.last_tokens_per_joule, 3),
        figure(node.last_power_w, 1),
        figure(node.last_tokens_per_s, 0),
        "",
    )
}

/// A node in a power domain: which allowance it holds and why, its grant, its lease.
fn fleet_lines(fleet: &FleetStatus, caps_in_force_w: f64) -> Vec<String> {
    let place = format!(
        "fleet      node {} in power domain {}",
        shown(&fleet.node),
        shown(&fleet.domain)
    );
    let (Some(allowance_w), Some(holding)) = (fleet.allowance_w, fleet.holding) else {
        // An agent from before the allowance was in its status.
        return vec![format!(
            "{place} (its GPUs' caps fit the grant the domain's coordinator writes)"
        )];
    };
    let reserve = fleet
        .reserve_w
        .map_or_else(String::new, |w| format!(", reserve {w:.0} W"));
    let holds = match (holding, &fleet.grant) {
        (Holding::Grant, Some(grant)) => format!(
            "holding its grant: {allowance_w:.0} W (#{}, {}){reserve}",
            grant.generation,
            if grant.acknowledged {
                "acknowledged"
            } else {
                "not yet acknowledged: the caps read back are above it"
            }
        ),
        _ => format!("holding its reserve: {allowance_w:.0} W (no grant in force)"),
    };
    let mut lines = vec![
        format!("{place}: {holds}"),
        format!("           caps in force {caps_in_force_w:.0} W of {allowance_w:.0} W allowed"),
    ];
    let lease = match &fleet.lease {
        Some(lease) => format!(
            "           lease {}: the grant holds {:.1} s without a renewal",
            shown(&lease.id),
            lease.holds_for_s
        ),
        None => "           no lease (not joined)".to_owned(),
    };
    lines.push(match &fleet.apart_because {
        Some(why) => format!("{lease}; last exchange with etcd: {}", shown(why)),
        None => lease,
    });
    lines
}

/// The objective in force, in words.
fn objective_words(objective: &tokwatt_core::types::Objective) -> String {
    let mut parts = Vec::new();
    if let Some(ms) = objective.tpot_p99_limit_ms {
        parts.push(format!("TPOT p99 <= {ms} ms"));
    }
    if let Some(floor) = objective.min_tokens_per_s.filter(|&f| f > 0.0) {
        parts.push(format!(">= {floor} tok/s per GPU"));
    }
    if let Some(ms) = objective.queue_wait_p99_limit_ms {
        parts.push(format!("queue wait p99 <= {ms} ms"));
    }
    if let Some(ms) = objective.ttft_p99_limit_ms {
        parts.push(format!("TTFT p99 <= {ms} ms"));
    }
    if parts.is_empty() {
        "none set (turned-away demand still breaks it)".into()
    } else {
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_serving_engines_batch_shows_as_not_known() {
        let gpu = GpuStatus::default();
        let engine = gpu_row(&gpu, tokwatt_engines::prometheus::WORKLOAD_NAME);
        let own = gpu_row(&gpu, "cuda-decode");
        assert!(engine.contains("n/a"), "{engine}");
        assert!(!own.contains("n/a"), "{own}");
    }

    #[test]
    fn the_human_status_shows_what_an_operator_checks() {
        let mut status = NodeStatus {
            simulated: true,
            data_source: "simulator (h200 profile)".into(),
            paused: true,
            ..NodeStatus::default()
        };
        status.policy.name = "slo-batch".into();
        status.policy.version = "0123456789ab".into();
        status.policy.on_probation = true;
        status.gpus.push(GpuStatus {
            gpu: 0,
            name: "H200".into(),
            last_tokens_per_joule: Some(3.25),
            last_tpot_p99_ms: None,
            ..GpuStatus::default()
        });
        status.failures.plugin_traps = 2;
        status.failures.last = Some("trap\x1b[2J".into());
        let text = render(&status);
        for expected in [
            "SIMULATED",
            "slo-batch (version 0123456789ab)",
            "ON PROBATION",
            "PAUSED",
            "3.250",
            "plugin traps 2",
            "trap\\u{1b}[2J",
        ] {
            assert!(
                text.contains(expected),
                "{expected:?} missing from:\n{text}"
            );
        }
        status.simulated = false;
        assert!(!render(&status).contains("SIMULATED"));
    }

    /// Under the GPUs' rows, the node's: caps and power summed, and its tokens per joule
    /// (tokens per second over power), issue 43 item 9.
    #[test]
    fn the_human_status_has_a_node_total() {
        let mut status = NodeStatus::default();
        for (gpu, (power, rate)) in [(400.0, 1200.0), (600.0, 2800.0)].into_iter().enumerate() {
            let mut row = GpuStatus {
                gpu: gpu as u32,
                name: "H200".into(),
                last_power_w: Some(power),
                last_tokens_per_s: Some(rate),
                ..GpuStatus::default()
            };
            row.in_force.power_cap_w = 700.0;
            status.gpus.push(row);
        }
        let text = render(&status);
        let node = text
            .lines()
            .find(|l| l.starts_with("node"))
            .unwrap_or_else(|| panic!("no node row in:\n{text}"));
        for expected in ["2 GPUs", "1400", "4.000", "1000.0", "4000"] {
            assert!(
                node.contains(expected),
                "{expected:?} missing from {node:?}"
            );
        }
        // Before the first tick the figures are unknown, not 0.
        status.gpus[1].last_power_w = None;
        let node = render(&status)
            .lines()
            .find(|l| l.starts_with("node"))
            .map(str::to_owned)
            .unwrap_or_default();
        assert!(!node.contains("4.000"), "{node}");
    }

    /// A node in a power domain shows what it may hold, its grant and whether it enforced
    /// it, its lease, and why it is cut off (issue 43 item 8).
    #[test]
    fn the_human_status_shows_the_allowance_grant_and_lease() {
        let mut status = NodeStatus::default();
        let mut row = GpuStatus::default();
        row.in_force.power_cap_w = 700.0;
        status.gpus = vec![row.clone(), row.clone(), row.clone(), row];
        status.fleet = Some(FleetStatus {
            domain: "rack-s".into(),
            node: "n1".into(),
            allowance_w: Some(2800.0),
            holding: Some(Holding::Grant),
            reserve_w: Some(1000.0),
            grant: Some(api::GrantStatus {
                watts: 2800.0,
                generation: 7,
                acknowledged: true,
            }),
            lease: Some(api::LeaseStatus {
                id: "694d".into(),
                holds_for_s: 1.84,
            }),
            apart_because: None,
        });
        let text = render(&status);
        for expected in [
            "node n1 in power domain rack-s: holding its grant: 2800 W (#7, acknowledged), reserve 1000 W",
            "caps in force 2800 W of 2800 W allowed",
            "lease 694d: the grant holds 1.8 s without a renewal",
        ] {
            assert!(
                text.contains(expected),
                "{expected:?} missing from:\n{text}"
            );
        }
        let fleet = status.fleet.as_mut().expect("fleet");
        fleet.allowance_w = Some(1000.0);
        fleet.holding = Some(Holding::Reserve);
        fleet.grant = None;
        fleet.lease = None;
        fleet.apart_because = Some("cannot renew: no etcd member answered".into());
        let text = render(&status);
        for expected in [
            "holding its reserve: 1000 W (no grant in force)",
            "no lease (not joined); last exchange with etcd: cannot renew",
        ] {
            assert!(
                text.contains(expected),
                "{expected:?} missing from:\n{text}"
            );
        }
        // An older agent's status names the domain only.
        let fleet = status.fleet.as_mut().expect("fleet");
        fleet.allowance_w = None;
        assert!(render(&status).contains("node n1 in power domain rack-s (its GPUs' caps"));
    }
}
