//! `tokwatt gpus`: the node's GPUs, their constraints and settings, and whether tokwatt
//! may change them.

use anyhow::Result;

#[derive(Debug, clap::Args)]
pub struct GpusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn gpus(args: &GpusArgs) -> Result<()> {
    let reports = tokwatt_nvml::list_gpus()?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    } else {
        print!("{}", tokwatt_nvml::GpuTable(&reports));
    }
    Ok(())
}
