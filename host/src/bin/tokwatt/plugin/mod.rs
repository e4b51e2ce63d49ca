//! `tokwatt plugin …`: tools for plugin authors (check a component against the contract,
//! compile it ahead of time into the agent's cache).

use anyhow::Result;

mod check;
mod compile;
mod new;
mod test;

#[derive(Debug, clap::Subcommand)]
pub enum PluginCommand {
    /// Check a component against the contract without deploying it: its world, version,
    /// imports and exports, then a few calls in the real sandbox.
    Check(check::CheckArgs),
    /// Compile a component ahead of time into the agent's compiled-component cache, so a
    /// later start or swap never waits for the compiler.
    Compile(compile::CompileArgs),
    /// Scaffold a policy (Rust, Python or JavaScript) that builds and passes its own tests
    /// at once.
    New(new::NewArgs),
    /// Run a policy on the simulator: its tokens per joule beside the default policy's
    /// and the oracle's, with time over the objective and served demand.
    Test(test::TestArgs),
}

pub fn plugin(command: PluginCommand) -> Result<()> {
    match command {
        PluginCommand::Check(args) => check::check(&args),
        PluginCommand::Compile(args) => compile::compile(&args),
        PluginCommand::New(args) => new::new(&args),
        PluginCommand::Test(args) => test::test(&args),
    }
}
