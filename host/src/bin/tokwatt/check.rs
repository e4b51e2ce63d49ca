//! `tokwatt check SPEC`: load a policy spec and its plugin and start it on a simulated
//! H200, without running.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::plugin_places::PluginPlaces;
use tokwatt_agent as agent;
use tokwatt_agent::assembly::{self, BackendRequest, SimTarget, Target};
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
    let assembled = assembly::assemble(&request, &spec.name, spec.knobs)
        .context("assembling a simulated H200 to start the policy on")?;
    spec.knobs = assembled.knobs;
    let plugin = spec.resolve_plugin(&agent::plugin_search_path(&args.plugins.plugin_dirs))?;
    let host = tokwatt_agent::plugin_host(args.plugins.cache_dir.clone())?;
    let tick = Duration::from_millis(u64::from(spec.tick_ms));
    let (_, first, _) = agent::start_policy(
        &host,
        &spec,
        &plugin,
        &agent::NodeFacts::of(&assembled.backends),
        1,
        tick,
    )?;
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
