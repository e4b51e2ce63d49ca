//! `tokwatt check SPEC`: load a policy spec and its plugin and start it on a simulated
//! H200, without running.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};

use tokwatt::agent;
use tokwatt::assembly::{self, BackendRequest, SimTarget, Target};
use tokwatt::plugin::{CONTRACT_VERSION, ComponentCache, HostConfig, PluginHost};
use tokwatt::spec::PolicySpec;

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The policy spec (TOML).
    spec: PathBuf,
    /// Extra folder to look for plugins in.
    #[arg(long = "plugin-dir")]
    plugin_dirs: Vec<PathBuf>,
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
    let plugin = spec.resolve_plugin(&agent::plugin_search_path(&args.plugin_dirs))?;
    let host = PluginHost::new(&HostConfig {
        cache_dir: ComponentCache::default_dir(),
    })?;
    let tick = Duration::from_millis(u64::from(spec.tick_ms));
    let (_, first, _) = agent::start_policy(
        &host,
        &spec,
        &plugin,
        &agent::NodeFacts::of(&assembled.backends),
        1,
        tick,
    )?;
    println!(
        "ok: {} ({}) loads, implements tokwatt:policy@{CONTRACT_VERSION} and starts; first settings: {first:?}",
        spec.name,
        plugin.display(),
    );
    Ok(())
}
