//! Where a command finds policy plugins and keeps their compiled form: the same two flags
//! on every command that loads a policy (flattened into each one's flags).

use std::path::PathBuf;

#[derive(Debug, Clone, Default, clap::Args)]
pub struct PluginPlaces {
    /// Extra folder to look for plugins in (repeatable), after the spec's own folder and
    /// before $TOKWATT_PLUGIN_DIR, the executable's folder and the build's.
    #[arg(long = "plugin-dir", value_name = "DIR")]
    pub plugin_dirs: Vec<PathBuf>,
    /// Folder for compiled plugins (default: $TOKWATT_CACHE_DIR, else the user's cache
    /// folder's tokwatt/components).
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
}

impl PluginPlaces {
    /// The places as the node takes them (tokwatt_agent::node).
    pub fn for_node(&self) -> tokwatt_agent::node::PluginPlaces {
        tokwatt_agent::node::PluginPlaces {
            dirs: self.plugin_dirs.clone(),
            cache_dir: self.cache_dir.clone(),
        }
    }
}
