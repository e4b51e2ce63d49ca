//! `tokwatt plugin …`: tools for plugin authors (check a component against the contract,
//! compile it ahead of time into the agent's cache).

use anyhow::Result;

mod check;
mod compile;

#[derive(Debug, clap::Subcommand)]
pub enum PluginCommand {
    /// Check a component against the contract without deploying it: its world, version,
    /// imports and exports, then a few calls in the real sandbox.
    Check(check::CheckArgs),
    /// Compile a component ahead of time into the agent's compiled-component cache, so a
    /// later start or swap never waits for the compiler.
    Compile(compile::CompileArgs),
}

pub fn plugin(command: PluginCommand) -> Result<()> {
    match command {
        PluginCommand::Check(args) => check::check(&args),
        PluginCommand::Compile(args) => compile::compile(&args),
    }
}
