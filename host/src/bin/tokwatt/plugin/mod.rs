//! `tokwatt plugin …`: tools for plugin authors (check a component against the contract,
//! compile it ahead of time into the agent's cache).

use anyhow::Result;

mod check;

#[derive(Debug, clap::Subcommand)]
pub enum PluginCommand {
    /// Check a component against the contract without deploying it: its world, version,
    /// imports and exports, then a few calls in the real sandbox.
    Check(check::CheckArgs),
}

pub fn plugin(command: PluginCommand) -> Result<()> {
    match command {
        PluginCommand::Check(args) => check::check(&args),
    }
}
