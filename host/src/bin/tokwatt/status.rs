//! `tokwatt status`: what a running agent (`tokwatt serve`) is doing, from its control API.
//! Also the connection flags every API command shares.

use std::path::PathBuf;

use anyhow::{Context, Result};

use tokwatt::api::{self, ApiClient, GpuStatus, NodeStatus};
use tokwatt::plugin::sanitize_text;

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
    /// Print the agent's status as JSON (the API's own document).
    #[arg(long)]
    json: bool,
}

pub fn status(args: &StatusArgs) -> Result<()> {
    let client = args.connection.client()?;
    let status = client
        .status()
        .with_context(|| format!("asking {} for its status", client.describe_target()))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", render(&status));
    }
    Ok(())
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
        line(format!(
            "fleet      node {} in power domain {} (its GPUs' caps fit the grant the domain's coordinator writes)",
            shown(&fleet.node),
            shown(&fleet.domain)
        ));
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
    let batch = if workload == tokwatt::prometheus::WORKLOAD_NAME {
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

/// The objective in force, in words.
fn objective_words(objective: &tokwatt::types::Objective) -> String {
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
        let engine = gpu_row(&gpu, tokwatt::prometheus::WORKLOAD_NAME);
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
}
