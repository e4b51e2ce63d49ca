//! `tokwatt plugin compile FILE.wasm`: compile a policy ahead of time into the agent's
//! compiled-component cache (same key, same trust rules), so a later start or hot swap
//! loads native code at once instead of compiling (seconds for a large component).

use std::path::PathBuf;

use anyhow::{Result, bail};

use tokwatt_plugin::inspect;
use tokwatt_plugin::{ComponentCache, HostConfig, PluginHost};

#[derive(Debug, clap::Args)]
pub struct CompileArgs {
    /// The component (.wasm) to compile.
    file: PathBuf,
    /// The cache to compile into; it must be the folder the agent uses (default: the
    /// agent's own, `$TOKWATT_CACHE_DIR` or the user's cache folder).
    #[arg(long = "cache-dir")]
    cache_dir: Option<PathBuf>,
    /// Print the result as JSON on standard output.
    #[arg(long)]
    json: bool,
}

pub fn compile(args: &CompileArgs) -> Result<()> {
    let Some(cache_dir) = args.cache_dir.clone().or_else(ComponentCache::default_dir) else {
        bail!(
            "no compiled-component cache folder is known for this user: pass --cache-dir DIR or set TOKWATT_CACHE_DIR, and run the agent with the same"
        );
    };
    let host = PluginHost::new(&HostConfig {
        cache_dir: Some(cache_dir),
    })?;
    let compiled = inspect::compile_ahead(&host, &args.file)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&compiled)?);
    } else if compiled.already_cached {
        println!(
            "already cached: {} ({}) is in {} (loaded in {:.3} s)",
            args.file.display(),
            compiled.guest_interface,
            compiled.cache_path.display(),
            compiled.seconds
        );
    } else {
        println!(
            "compiled {} ({}) in {:.3} s into {}",
            args.file.display(),
            compiled.guest_interface,
            compiled.seconds,
            compiled.cache_path.display()
        );
    }
    Ok(())
}
