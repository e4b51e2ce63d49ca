//! `tokwatt replay RUN_DIR --policy SPEC`: a recorded run's observations fed to a policy,
//! its decisions printed beside the run's (`tokwatt_lab::replay`).

use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::plugin_places::PluginPlaces;
use tokwatt_lab::replay::{self, ReplayRequest, TickRange};
use tokwatt_policy::spec::PolicySpec;

#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// The run's output folder (summary.json and observations.jsonl).
    run_dir: PathBuf,
    /// The policy spec (TOML) to replay: the run's own, or another.
    #[arg(long)]
    policy: PathBuf,
    /// Show only ticks A to B, both included (A.. or ..B for open ends). The policy is
    /// still fed every tick before A, so its state is the run's.
    #[arg(long, value_parser = parse_ticks)]
    ticks: Option<TickRange>,
    /// Print the replay as JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Take the device facts `init` gets from this simulator profile (h200, h100, a100
    /// or a profile file); needed for a run on real GPUs, whose facts are not recorded.
    #[arg(long)]
    sim: Option<String>,
    #[command(flatten)]
    plugins: PluginPlaces,
}

fn parse_ticks(text: &str) -> Result<TickRange, String> {
    TickRange::parse(text).map_err(|error| error.to_string())
}

pub fn replay(args: &ReplayArgs) -> Result<()> {
    let spec = PolicySpec::load(&args.policy)?;
    let report = replay::replay(&ReplayRequest {
        run_dir: args.run_dir.clone(),
        spec,
        ticks: args.ticks.unwrap_or_default(),
        sim_profile: args.sim.clone(),
        plugin_dirs: args.plugins.plugin_dirs.clone(),
        cache_dir: args.plugins.cache_dir.clone(),
    })
    .with_context(|| format!("replaying {}", args.run_dir.display()))?;
    if args.json {
        let json = serde_json::to_string_pretty(&report).context("writing the replay as JSON")?;
        println!("{json}");
    } else {
        print!("{}", replay::render_text(&report));
    }
    Ok(())
}
