//! `tokwatt policy swap|rollback|pause|resume|restore-defaults`: act on a running agent
//! through its control API. Each returns once the action took effect at a tick boundary.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use tokwatt_plugin::sanitize_text;
use tokwatt_policy::spec::{PolicySpec, SpecError};
use tokwatt_serve::api::{ActionOutcome, SwapRequest};

use crate::status::ConnectionArgs;

#[derive(Debug, clap::Subcommand)]
pub enum PolicyCommand {
    /// Swap in another policy; the running one is kept on probation and comes back if
    /// the new one fails.
    Swap {
        /// The policy spec (TOML); a relative path is taken from the current folder.
        spec: PathBuf,
        /// The component, overriding the spec's `plugin`.
        #[arg(long)]
        plugin: Option<PathBuf>,
        /// Start the new policy without the running one's state (by default it takes the
        /// state where its schema agrees).
        #[arg(long)]
        fresh: bool,
        #[command(flatten)]
        connection: ConnectionArgs,
    },
    /// Bring back the policy in charge before the last swap.
    Rollback {
        #[command(flatten)]
        connection: ConnectionArgs,
    },
    /// Hold the settings in force and stop asking the policy.
    Pause {
        #[command(flatten)]
        connection: ConnectionArgs,
    },
    /// Ask the policy again every tick.
    Resume {
        #[command(flatten)]
        connection: ConnectionArgs,
    },
    /// Put every GPU back to its device defaults, then pause.
    RestoreDefaults {
        #[command(flatten)]
        connection: ConnectionArgs,
    },
}

pub fn policy(command: &PolicyCommand) -> Result<()> {
    let outcome = match command {
        PolicyCommand::Swap {
            spec,
            plugin,
            fresh,
            connection,
        } => {
            let request = SwapRequest {
                spec: absolute(spec)?,
                plugin: plugin.as_deref().map(absolute).transpose()?,
                fresh: *fresh,
            };
            let client = connection.client()?;
            client.swap(&request).map_err(|refused| {
                let refused = anyhow::Error::new(refused)
                    .context(format!("swapping in {}", request.spec.display()));
                match read_here(&request.spec) {
                    Some(why) => anyhow::anyhow!("{refused:#}\n{why}"),
                    None => refused,
                }
            })?
        }
        PolicyCommand::Rollback { connection } => connection.client()?.rollback()?,
        PolicyCommand::Pause { connection } => connection.client()?.pause()?,
        PolicyCommand::Resume { connection } => connection.client()?.resume()?,
        PolicyCommand::RestoreDefaults { connection } => connection.client()?.restore_defaults()?,
    };
    println!("{}", describe(&outcome));
    Ok(())
}

/// Why the spec, read here, is not a valid spec, where it is not. The agent's reply
/// leaves out the file's text (anyone with the API may name any file the agent can read),
/// so the reason in full comes from the operator's own reading of it; a file this side
/// cannot read (an agent on another machine) adds nothing.
fn read_here(spec: &Path) -> Option<String> {
    match PolicySpec::load(spec) {
        // What the reply shortens; any other refusal it carries whole.
        Err(invalid @ (SpecError::Parse { .. } | SpecError::UnknownKnob { .. })) => {
            Some(format!("read on this machine, {invalid}"))
        }
        _ => None,
    }
}

/// The agent resolves paths on its own machine from its own folder, so a relative path is
/// made absolute here, against the operator's.
fn absolute(path: &Path) -> Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("making {} absolute", path.display()))
}

fn describe(outcome: &ActionOutcome) -> String {
    let mut text = format!(
        "{} (tick {}, policy {})",
        sanitize_text(&outcome.message, 1024),
        outcome.tick,
        sanitize_text(&outcome.policy, 256)
    );
    match outcome.state_carried {
        Some(true) => text.push_str("; the new policy took the old one's state"),
        Some(false) => text.push_str("; the new policy started fresh"),
        None => {}
    }
    text
}
