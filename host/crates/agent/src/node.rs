//! Where a node is put together: the one composition root of every command that runs a
//! policy on GPUs (`run`, `serve`, `ab`, `replay`, `check`, `plugin check`, `tune`'s
//! reference, `bench agent-cpu`). [`Node::open`] builds, by one rule each:
//!
//! 1. the backends (simulator, NVML, tokwatt's CUDA work, a serving engine's metrics) and
//!    the knobs the policy is granted ([`crate::assembly`]);
//! 2. the settings guard and its state file, wherever a GPU setting may change or the
//!    operator names a file ([`Assembled::guard_settings`]): the restore invariant rests
//!    on this being decided here and nowhere else;
//! 3. the plugin host (one compiled-component cache for every command) and where plugins
//!    are looked for.
//!
//! Checks that must refuse before any GPU setting changes go between [`Node::assemble`]
//! and [`NodeDraft::open`]. [`Node::start_policy`] and [`Node::run`] then start policies against it. The binary and
//! the daemon parse their input into a [`NodeRequest`], call these, and print.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use tokwatt_core::types::{Knobs, Settings};
use tokwatt_plugin::PluginHost;
use tokwatt_policy::envelope::Envelope;
use tokwatt_policy::spec::PolicySpec;
use tokwatt_policy::supervisor::Supervisor;
use tokwatt_sim::{SimConfig, SimGpu};

use crate::assembly::{
    self, Assembled, AssemblyError, BackendRequest, Offered, Target, WorkloadSource,
};
use crate::control::{Backends, Progress};
use crate::restore::RestoreError;
use crate::swap::SwapPort;
use crate::{AgentError, NodeFacts, RunRequest, RunSummary};

/// Where plugins are found and where their compiled components are cached.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PluginPlaces {
    /// Folders searched after the spec's own (then `$TOKWATT_PLUGIN_DIR`, the
    /// executable's folder and the build's: [`crate::plugin_search_path`]).
    pub dirs: Vec<PathBuf>,
    /// The compiled-component cache; `None`: the user's default cache.
    pub cache_dir: Option<PathBuf>,
}

/// Which knobs any policy in the node's life may turn, for the rule that keeps the
/// original settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KeepFor {
    /// The knobs granted to the policy the node starts with (`run`, `check`).
    Granted,
    /// Those, and these knobs where the node offers them (`ab`: the other arm's).
    GrantedAnd(Knobs),
    /// Every knob (`serve`: a policy swapped in later may take any).
    Every,
}

impl KeepFor {
    /// The knobs the keep rule weighs: `granted` (the first policy's) and what else may
    /// turn in the node's life, where the backends offer it.
    pub fn knobs(self, granted: Knobs, offered: &Offered) -> Knobs {
        match self {
            KeepFor::Granted => granted,
            KeepFor::GrantedAnd(also) => granted.union(assembly::grant_knobs(also, offered).0),
            KeepFor::Every => Knobs::all(),
        }
    }
}

/// How the node keeps its GPUs' original settings ([`Assembled::guard_settings`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Keep {
    /// The state file the operator names; `None`: the default one, where a GPU setting
    /// may change.
    pub state_file: Option<PathBuf>,
    pub knobs: KeepFor,
    /// One of several groups of GPUs run side by side (`ab --crossover`).
    pub group: Option<usize>,
    /// The most a restore may put back, summed (a fleet node's reserve).
    pub power_ceiling_w: Option<f64>,
}

impl Default for Keep {
    fn default() -> Self {
        Keep {
            state_file: None,
            knobs: KeepFor::Granted,
            group: None,
            power_ceiling_w: None,
        }
    }
}

/// What a node is opened with.
#[derive(Debug, Clone)]
pub struct NodeRequest {
    pub backends: BackendRequest,
    /// Tokens from a serving engine's metrics beside one simulated GPU (`run --sim
    /// --workload external`): [`assembly::assemble_sim_with_engine`].
    pub engine_beside_sim: Option<WorkloadSource>,
    /// The policy the node starts with: its name (for messages) and the knobs its spec asks for.
    pub policy: String,
    pub knobs: Knobs,
    pub keep: Keep,
    pub plugins: PluginPlaces,
}

impl NodeRequest {
    /// A node for `spec`'s policy on `backends`, keeping settings by the default rule.
    pub fn new(backends: BackendRequest, spec: &PolicySpec) -> Self {
        NodeRequest {
            backends,
            engine_beside_sim: None,
            policy: spec.name.clone(),
            knobs: spec.knobs,
            keep: Keep::default(),
            plugins: PluginPlaces::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Assembly(#[from] AssemblyError),
    #[error("saving the original GPU settings before the node starts: {0}")]
    Keep(#[from] RestoreError),
    #[error(transparent)]
    Plugin(#[from] tokwatt_plugin::PluginError),
}

/// A node put together: its backends, the state file that keeps its original settings,
/// and the plugin host its policies start in. Dropping it (or the backends taken from it)
/// puts back every setting changed.
pub struct Node {
    pub assembled: Assembled,
    /// The state file kept, where one is.
    pub state_file: Option<PathBuf>,
    /// The plugin host every policy of this node starts in (swapped-in ones too).
    pub host: Arc<PluginHost>,
    pub plugins: PluginPlaces,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("assembled", &self.assembled)
            .field("state_file", &self.state_file)
            .field("plugins", &self.plugins)
            .finish_non_exhaustive()
    }
}

/// A node whose backends are built and whose knobs are granted, with nothing kept or
/// changed yet: what must be refused before any GPU setting changes (a fleet reserve the
/// GPUs cannot hold, a folder that cannot be watched) is checked here, between
/// [`Node::assemble`] and [`NodeDraft::open`].
#[derive(Debug)]
pub struct NodeDraft {
    pub assembled: Assembled,
    keep: Keep,
    plugins: PluginPlaces,
}

impl NodeDraft {
    /// Keeps the original settings, then starts the plugin host: the state file is
    /// written before any setting can change, and a failure after it leaves nothing
    /// changed (the guard puts back what its arming restored).
    pub fn open(self) -> Result<Node, NodeError> {
        let NodeDraft {
            mut assembled,
            keep,
            plugins,
        } = self;
        let keep_knobs = keep.knobs.knobs(assembled.knobs, &assembled.offered);
        let state_file = assembled.guard_settings(
            keep.state_file,
            keep_knobs,
            keep.group,
            keep.power_ceiling_w,
        )?;
        let host = Arc::new(crate::plugin_host(plugins.cache_dir.clone())?);
        Ok(Node {
            assembled,
            state_file,
            host,
            plugins,
        })
    }
}

impl Node {
    /// [`Node::assemble`], then [`NodeDraft::open`].
    pub fn open(request: NodeRequest) -> Result<Node, NodeError> {
        Node::assemble(request)?.open()
    }

    /// Builds the node's backends and grants the policy its knobs; changes nothing.
    pub fn assemble(request: NodeRequest) -> Result<NodeDraft, NodeError> {
        let assembled = match (&request.backends.target, &request.engine_beside_sim) {
            (Target::Sim(sim), Some(engine)) => {
                assembly::assemble_sim_with_engine(sim, engine, &request.backends, request.knobs)?
            }
            _ => assembly::assemble(&request.backends, &request.policy, request.knobs)?,
        };
        Ok(NodeDraft {
            assembled,
            keep: request.keep,
            plugins: request.plugins,
        })
    }

    /// The plugin `spec` names, looked up where this node looks.
    pub fn plugin_for(&self, spec: &PolicySpec) -> Result<PathBuf, AgentError> {
        Ok(spec.resolve_plugin(&crate::plugin_search_path(&self.plugins.dirs))?)
    }

    /// A simulated node of an already loaded profile and scenario, for the lab's judging
    /// loops (`eval`, `plugin test`, `ab`'s trajectories on the simulator): in memory and
    /// on a virtual clock, nothing on it outlives the loop, so the keep rule has nothing
    /// to keep; the loop brings its own plugin host (one for many short runs).
    pub fn simulated(config: SimConfig) -> Result<(SimGpu, Backends), AssemblyError> {
        assembly::simulator_from(config, false)
    }

    /// What a policy is started against.
    pub fn facts(&self) -> NodeFacts {
        NodeFacts::of(&self.assembled.backends)
    }

    /// Starts `spec`'s policy on this node: its supervisor, first settings and envelope.
    pub fn start_policy(
        &self,
        spec: &PolicySpec,
        seed: u64,
        tick: Duration,
    ) -> Result<(Supervisor, Vec<Settings>, Envelope), AgentError> {
        let plugin = self.plugin_for(spec)?;
        crate::start_policy(&self.host, spec, &plugin, &self.facts(), seed, tick)
    }

    /// Runs `request`'s policy on this node ([`crate::run_with_swaps`]), in its plugin
    /// host. Hands back the backends: dropping them puts the settings back.
    pub fn run(
        self,
        request: &RunRequest,
        stop: Arc<AtomicBool>,
        swaps: Option<SwapPort>,
        progress: &mut dyn FnMut(Progress<'_>),
    ) -> Result<(RunSummary, Backends), AgentError> {
        let Node {
            assembled, host, ..
        } = self;
        crate::run_in(
            &host,
            request,
            assembled.backends,
            assembled.meta,
            stop,
            swaps,
            progress,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assembly::SimTarget;

    fn sim(gpus: u32, batch_only: bool) -> BackendRequest {
        BackendRequest {
            target: Target::Sim(SimTarget {
                gpus,
                ..SimTarget::new("h200")
            }),
            seed: 1,
            batch_only,
        }
    }

    fn request(backends: BackendRequest, knobs: Knobs) -> NodeRequest {
        NodeRequest {
            backends,
            engine_beside_sim: None,
            policy: "p".into(),
            knobs,
            keep: Keep::default(),
            plugins: PluginPlaces::default(),
        }
    }

    const CAP: Knobs = Knobs {
        power_cap: true,
        sm_clock: false,
        batch_size: false,
        token_budget: false,
    };
    const BATCH: Knobs = Knobs {
        power_cap: false,
        sm_clock: false,
        batch_size: true,
        token_budget: false,
    };

    #[test]
    fn a_simulated_node_keeps_no_state_file_unless_one_is_named() {
        let node = Node::open(request(sim(1, false), CAP)).expect("opens");
        assert_eq!(node.state_file, None, "nothing on it outlives the node");
        assert!(node.assembled.knobs.power_cap);

        let dir = tempfile::tempdir().expect("tempdir");
        let named = dir.path().join("state.json");
        let node = Node::open(NodeRequest {
            keep: Keep {
                state_file: Some(named.clone()),
                group: Some(2),
                ..Keep::default()
            },
            ..request(sim(1, false), CAP)
        })
        .expect("opens");
        let kept = dir.path().join("state.gpu2.json");
        assert_eq!(node.state_file, Some(kept.clone()));
        assert!(kept.exists(), "saved before anything could change");
    }

    #[test]
    fn the_keep_rule_weighs_what_may_turn_in_the_nodes_life_where_it_is_offered() {
        let draft = Node::assemble(request(sim(1, true), BATCH)).expect("assembles");
        let offered = &draft.assembled.offered;
        let granted = draft.assembled.knobs;
        assert_eq!(KeepFor::Granted.knobs(granted, offered), BATCH);
        // `ab`: the other arm asks for the cap, which a batch-only node does not offer.
        assert_eq!(KeepFor::GrantedAnd(CAP).knobs(granted, offered), BATCH);
        // `serve`: any policy swapped in later may take any knob.
        assert_eq!(KeepFor::Every.knobs(granted, offered), Knobs::all());
        let full = Node::assemble(request(sim(1, false), BATCH)).expect("assembles");
        assert_eq!(
            KeepFor::GrantedAnd(CAP).knobs(full.assembled.knobs, &full.assembled.offered),
            BATCH.union(CAP)
        );
    }

    #[test]
    fn a_refused_node_writes_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let named = dir.path().join("state.json");
        let error = Node::open(NodeRequest {
            engine_beside_sim: Some(WorkloadSource::External {
                url: "http://127.0.0.1:1/metrics".into(),
                token_counter: "tokens_total".into(),
                tpot_histogram: None,
                request_metrics: None,
            }),
            keep: Keep {
                state_file: Some(named.clone()),
                ..Keep::default()
            },
            ..request(sim(2, false), CAP)
        })
        .expect_err("one engine cannot feed two simulated GPUs");
        assert!(matches!(
            error,
            NodeError::Assembly(AssemblyError::EngineBesideManyGpus { gpus: 2 })
        ));
        assert!(!named.exists(), "refused before the state file");
    }
}
