//! `tokwatt plugin check FILE.wasm`: validate a component against the contract without
//! running it in an agent.

use std::path::PathBuf;

use anyhow::{Result, bail};

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The component (.wasm).
    file: PathBuf,
}

pub fn check(args: &CheckArgs) -> Result<()> {
    bail!(
        "`tokwatt plugin check` is not implemented yet ({})",
        args.file.display()
    )
}
