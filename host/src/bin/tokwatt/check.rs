//! `tokwatt check SPEC`: load a policy spec and its plugin and start it on a simulated
//! H200, without running.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::plugin_places::PluginPlaces;
use tokwatt_agent::assembly::{BackendRequest, SimTarget, Target};
use tokwatt_agent::node::{Node, NodeRequest};
use tokwatt_core::types::Settings;
use tokwatt_policy::spec::PolicySpec;

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The policy spec (TOML).
    spec: PathBuf,
    #[command(flatten)]
    plugins: PluginPlaces,
}

pub fn check(args: &CheckArgs) -> Result<()> {
    let mut spec = PolicySpec::load(&args.spec)?;
    let request = BackendRequest {
        target: Target::Sim(SimTarget::new("h200")),
        seed: 1,
        batch_only: false,
    };
    // A simulated node, put together as every command's is (nothing on it outlives the
    // check: no GPU setting can change, so no state file is kept).
    let node = Node::open(NodeRequest {
        plugins: args.plugins.for_node(),
        ..NodeRequest::new(request, &spec)
    })
    .context("putting a simulated H200 together to start the policy on")?;
    spec.knobs = node.assembled.knobs;
    let plugin = node.plugin_for(&spec)?;
    let tick = Duration::from_millis(u64::from(spec.tick_ms));
    let (_, first, _) = node.start_policy(&spec, 1, tick)?;
    let host = &node.host;
    // Started, so it loads: a second load takes the compiled form from the cache.
    let contract_line = host
        .load(&plugin, &spec.name, spec.sandbox)
        .map(|loaded| loaded.contract_line())
        .with_context(|| format!("loading {} again to read its contract", plugin.display()))?;
    println!(
        "ok: {} ({}) loads, implements tokwatt:policy@{contract_line} and starts; first settings: {}",
        spec.name,
        plugin.display(),
        Settings::per_gpu(&first),
    );
    Ok(())
}
