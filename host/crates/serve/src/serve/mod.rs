//! `tokwatt serve`: the node agent operators deploy. One control loop manages every GPU
//! of the node (or the chosen ones) until stopped: one telemetry sampler, one actuator and
//! one workload source per GPU, one policy deciding for all of them (it sees the whole
//! node, so it can share a node budget). Operators act on it through [`crate::api`]:
//! status, hot swap with automatic rollback, rollback, pause, resume, restore defaults.
//! The original settings of every GPU are saved in the state file before the first change
//! and restored however the agent ends.
//!
//! Threads: the loop runs on a thread of its own and never waits on the API; API handlers
//! prepare new policies (compile, instantiate, `init`) on their own threads and hand them
//! to the loop through the swap channel ([`tokwatt_agent::swap`]); commands go through the loop's
//! command channel; the status the API reads is written once per tick.

pub mod bench;
pub mod config;
mod control;
mod fence;
mod fleet;
mod live;
mod watch;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

pub use config::{ConfigError, EngineEndpoint, NodeBackend, ServeConfig, ServeWorkload};
pub use control::ServeControl;

use live::Live;
use tokwatt_agent::assembly::{
    Assembled, BackendRequest, GpuTarget, SimTarget, Target, Withheld, WorkloadSource,
};
use tokwatt_agent::control::{ControlLoop, LoopCommand, LoopConfig};
use tokwatt_agent::node::{Keep, KeepFor, Node, NodeRequest, PluginPlaces};
use tokwatt_agent::recorder::{Recorder, Rotation};
use tokwatt_agent::swap::swap_channel;
use tokwatt_agent::{NodeFacts, OutputFormats, RunMeta, RunSummary, SUMMARY_FORMAT_VERSION};
use tokwatt_policy::in_force::{ObjectiveInForce, RulesSource};
use tokwatt_policy::spec::PolicySpec;

/// Ticks over which the status's tick-lateness p99 is taken.
pub const LATENESS_WINDOW: usize = 1000;

/// How long an agent runs when nobody stops it: practically forever (the loop counts
/// ticks in a u64 and schedules them in whole ticks from the start).
const UNTIL_STOPPED: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Spec(#[from] tokwatt_policy::spec::SpecError),
    #[error(transparent)]
    Assembly(#[from] tokwatt_agent::assembly::AssemblyError),
    #[error(transparent)]
    Node(#[from] tokwatt_agent::node::NodeError),
    #[error(transparent)]
    Nvml(#[from] tokwatt_nvml::NvmlError),
    #[error(transparent)]
    Agent(#[from] tokwatt_agent::AgentError),
    #[error(transparent)]
    Plugin(#[from] tokwatt_plugin::PluginError),
    #[error("saving the original GPU settings before the first change: {0}")]
    Restore(#[from] tokwatt_agent::restore::RestoreError),
    #[error(transparent)]
    Recorder(#[from] tokwatt_agent::recorder::RecorderError),
    #[error(
        "the watched folder {} (`policy.watch`) cannot be read: {source}; create it, or fix or remove the key",
        folder.display()
    )]
    Watch {
        folder: PathBuf,
        source: std::io::Error,
    },
    #[error("starting the control loop's thread: {0}")]
    Thread(std::io::Error),
    #[error("the control loop stopped: {0}")]
    Loop(String),
    #[error("stopped (SIGINT or SIGTERM) while starting, before any policy setting was applied")]
    StoppedStarting,
    #[error("fleet: {0}")]
    Fleet(String),
    #[error("fence: {0}")]
    Fence(String),
}

/// What a started agent is, for the operator's first lines.
#[derive(Debug, Clone)]
pub struct ServeInfo {
    pub meta: RunMeta,
    pub policy: String,
    pub policy_version: String,
    pub tick: Duration,
    pub withheld: Vec<Withheld>,
    pub out_dir: PathBuf,
    pub state_file: Option<PathBuf>,
    /// The objective the first policy is held to, bound by bound with where it came from.
    pub objective_in_force: ObjectiveInForce,
}

/// A running agent: the loop on its thread, and the [`ServeControl`] the API serves.
#[derive(Debug)]
pub struct Agent {
    control: Arc<ServeControl>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<RunSummary, ServeError>>>,
    watcher: Option<watch::Watcher>,
    /// The node's link to its power domain (`[fleet]`), stopped after the loop.
    fleet: Option<fleet::FleetThread>,
    /// systemd, where it runs the agent as a `Type=notify` service.
    systemd: Option<Arc<crate::fence::notify::SystemdNotifier>>,
    pub info: ServeInfo,
}

impl Agent {
    /// What the API serves.
    pub fn control(&self) -> Arc<ServeControl> {
        Arc::clone(&self.control)
    }

    /// Ask the loop to end at the next tick boundary.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Tells systemd the start is over (`READY=1`) where it runs the agent as a
    /// `Type=notify` service: call it once whatever the operator reaches (the API) is up.
    pub fn notify_ready(&self) {
        self.notify("READY=1");
    }

    /// Tells systemd the agent is stopping (`STOPPING=1`), so that it waits for the
    /// restore rather than counting the stop as a failure of the watchdog.
    pub fn notify_stopping(&self) {
        self.notify("STOPPING=1");
    }

    fn notify(&self, message: &str) {
        if let Some(systemd) = &self.systemd
            && let Err(error) = systemd.notify(message)
        {
            tracing::warn!("telling systemd {message}: {error}");
        }
    }

    /// Whether the loop has ended (stopped, its duration over, or failed).
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Wait for the loop to end; the settings are back to what they were by then.
    pub fn join(mut self) -> Result<RunSummary, ServeError> {
        drop(self.watcher.take());
        let thread = self
            .thread
            .take()
            .ok_or_else(|| ServeError::Loop("already joined".into()))?;
        let result = match thread.join() {
            Ok(result) => result,
            Err(panic) => Err(ServeError::Loop(panic_text(&panic))),
        };
        // The loop has put the node at its reserve: now leave the domain.
        if let Some(fleet) = self.fleet.take() {
            fleet.stop();
        }
        result
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
        drop(self.watcher.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        drop(self.fleet.take());
    }
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "it panicked".to_owned())
}

/// The backends `config` asks for.
fn backend_request(config: &ServeConfig, tick: Duration) -> Result<BackendRequest, ServeError> {
    let target = match &config.backend {
        NodeBackend::Sim {
            profile,
            gpus,
            scenario,
            realtime,
            driver,
        } => Target::Sim(SimTarget {
            profile: profile.clone(),
            scenario: scenario.clone(),
            gpus: *gpus,
            realtime: *realtime,
            driver: driver.clone(),
        }),
        NodeBackend::Nvml { gpus } => {
            let indices = match gpus {
                Some(indices) => indices.clone(),
                None => {
                    let system = tokwatt_nvml::NvmlSystem::open(None)?;
                    (0..system.devices().len() as u32)
                        .filter_map(|position| system.nvml_index(position))
                        .collect()
                }
            };
            let workload = match &config.workload {
                ServeWorkload::Cuda {
                    model,
                    context,
                    batch_size_max,
                } => WorkloadSource::Cuda {
                    model: model.clone(),
                    context: *context,
                    batch_size_max: *batch_size_max,
                },
                ServeWorkload::External(engines) => WorkloadSource::PerGpu(
                    indices
                        .iter()
                        .map(|index| {
                            let engine = engines.iter().find(|e| e.gpu == *index).ok_or_else(
                                || {
                                    ConfigError::Invalid {
                                        path: config.path.clone(),
                                        line: None,
                                        key: "workload.engine".into(),
                                        problem: format!(
                                            "has no entry for GPU {index}: each managed GPU needs its serving engine's metrics"
                                        ),
                                    }
                                },
                            )?;
                            Ok(WorkloadSource::External {
                                url: engine.url.clone(),
                                token_counter: engine.token_counter.clone(),
                                tpot_histogram: engine.tpot_histogram.clone(),
                                request_metrics: engine.request_metrics.clone(),
                            })
                        })
                        .collect::<Result<Vec<_>, ConfigError>>()?,
                ),
                ServeWorkload::Sim => {
                    return Err(ServeError::Loop(
                        "real GPUs need a workload source; the config check should have said so"
                            .into(),
                    ));
                }
            };
            Target::Gpu(GpuTarget {
                indices,
                dry_run: config.dry_run,
                workload,
                tick,
            })
        }
    };
    Ok(BackendRequest {
        target,
        seed: config.seed,
        batch_only: config.batch_only,
    })
}

/// The first 12 hex digits of the plugin's SHA-256: its content version, which changes
/// whenever the component does.
pub fn plugin_version(path: &Path) -> Result<String, ServeError> {
    use sha2::{Digest, Sha256};
    let bytes = tokwatt_plugin::read_component(path)?;
    let digest = Sha256::digest(&bytes);
    Ok(digest.iter().take(6).map(|b| format!("{b:02x}")).collect())
}

/// Start the agent: assemble every GPU, start the first policy, and run the loop on a
/// thread of its own until `stop` is raised (or `duration` is over, for tests and
/// benchmarks). Errors here (a bad spec, a GPU that cannot be opened, no privileges for
/// the policy's knobs) leave every setting as it was.
pub fn start(
    config: &ServeConfig,
    stop: Arc<AtomicBool>,
    duration: Option<Duration>,
) -> Result<Agent, ServeError> {
    // In a power domain the reserve comes first, before the policy spec, the plugin, the
    // GPUs' assembly or anything else that can fail: the caps in force now may be a
    // crashed run's, a lapsed grant's or a reboot's board defaults, all above what the
    // coordinator charges a node without a lease, and an agent that then failed to start
    // would leave them there. The node starts, stops and restores at its reserve: the
    // settings guard puts the caps back within it, never at the board defaults.
    let (fleet_config, boot) = match &config.fleet {
        Some(fleet) => {
            let boot = fence::node_boot(config);
            let mut gpus = fence::reserve_gpus(config)?;
            if let Some(gpus) = gpus.as_deref_mut() {
                fence::apply_reserve_at_start(gpus, fleet.link.reserve_w)?;
            }
            let mut fleet = fleet.clone();
            fleet.link.reserve_w = fleet::reserve_at_start(&fleet);
            if let Some(gpus) = gpus.as_deref_mut() {
                if fleet.link.reserve_w < config.fleet.as_ref().map_or(0.0, |f| f.link.reserve_w) {
                    // The budget gives this node less than its config.
                    fence::apply_reserve_at_start(gpus, fleet.link.reserve_w)?;
                }
                // The reserve the node holds now, read back and written down as the
                // restarted agent's record.
                if let Some(proof) = fleet::agent_proof_target(&fleet, boot) {
                    fence::prove_at_start(gpus, &proof);
                }
            }
            (Some(fleet), boot)
        }
        None => (None, 0),
    };
    let systemd = crate::fence::notify::SystemdNotifier::from_process_env()
        .map_err(|e| ServeError::Fence(e.to_string()))?;
    let rules_source = RulesSource::serve_toml(&config.path);
    // serve.toml's objective, narrowed by a stricter spec: said at start, in summary.json.
    let (mut spec, objective_in_force) = config
        .rules
        .narrow_in_force(&PolicySpec::load(&config.policy_spec)?, &rules_source)
        .map_err(tokwatt_agent::AgentError::from)?;
    if let Some(tick) = config.tick {
        spec.override_tick(tick)?;
    }
    let tick = Duration::from_millis(u64::from(spec.tick_ms));
    let request = backend_request(config, tick)?;
    // The node, put together by the one rule (tokwatt_agent::node): its original settings
    // kept over every hardware knob (a policy swapped in later may turn knobs the first
    // one leaves alone), a restore never putting back more than the fleet's reserve.
    let draft = Node::assemble(NodeRequest {
        keep: Keep {
            state_file: config.state_file.clone(),
            knobs: KeepFor::Every,
            group: None,
            power_ceiling_w: fleet_config.as_ref().map(|fleet| fleet.link.reserve_w),
        },
        plugins: PluginPlaces {
            dirs: config.plugin_dirs.clone(),
            cache_dir: config.cache_dir.clone(),
        },
        ..NodeRequest::new(request, &spec)
    })?;
    let assembled = &draft.assembled;
    spec.knobs = assembled.knobs;
    for w in &assembled.withheld {
        tracing::warn!(policy = %spec.name, "{w}");
    }

    // Refused before any GPU setting changes; what is there now is the watcher's
    // baseline (it starts after the loop).
    let watch_baseline = match &config.watch {
        Some(folder) => Some(watch::readable(folder)?),
        None => None,
    };

    let fleet_node = fleet_config
        .as_ref()
        .map(|f| fleet::FleetNode::new(f, tick));
    let fence::FenceParts {
        feed: mut fence_feed,
        declaration: fence_declaration,
        systemd,
    } = fence::prepare(fleet_config.as_ref(), systemd, tick)?;
    // What a reboot or a driver reload leaves in force, declared in the node's reports.
    let default_w: f64 = assembled
        .backends
        .telemetry
        .devices()
        .iter()
        .map(|d| d.power_cap_default_w)
        .sum();
    if let Some(fleet) = &fleet_config {
        let devices = assembled.backends.telemetry.devices();
        let floor: f64 = devices.iter().map(|d| d.power_cap_min_w).sum();
        if fleet.link.reserve_w < floor {
            return Err(ServeError::Fleet(format!(
                "the reserve ({} W, fleet.reserve_w) is below the sum of this node's {} GPUs' lowest power caps ({floor} W): the node could not hold it; raise the reserve in serve.toml and in the domain's budget",
                fleet.link.reserve_w,
                devices.len()
            )));
        }
        if config.dry_run {
            tracing::warn!(
                "fleet: a dry run changes no setting, so the grant is not enforced on the GPUs; the caps reported are the ones tokwatt would set"
            );
        }
    }
    // Nothing was changed up to here: the refusals above leave the GPUs as they were.
    let node = draft.open()?;
    let plugin_path = node.plugin_for(&spec)?;
    let version = plugin_version(&plugin_path)?;
    let (supervisor, first, envelope) = node.start_policy(&spec, config.seed, tick)?;
    let Node {
        assembled:
            Assembled {
                backends,
                meta,
                withheld,
                offered,
                not_permitted,
                ..
            },
        state_file,
        host,
        plugins,
    } = node;
    let plugin_dirs = plugins.dirs;
    let node = NodeFacts::of(&backends);
    let node_knobs = offered.knobs();
    let node_envelope = config
        .rules
        .envelope(&node.devices, &node.workload, node_knobs)
        .map_err(tokwatt_agent::AgentError::from)?;
    // A signal during start-up (a slow compile) ends it here, before `init`'s settings are
    // applied; dropping the backends puts back anything the leftover restore changed.
    if stop.load(Ordering::Relaxed) {
        return Err(ServeError::StoppedStarting);
    }
    tracing::info!(policy = %spec.name, version, plugin = %plugin_path.display(), "policy started");

    let out_dir = fresh_out_dir(&config.out_dir);
    // Weeks of ticks: each output file is bounded, the oldest rotated away.
    let mut recorder = Recorder::create_rotating(
        &out_dir,
        false,
        Rotation {
            max_bytes: config.max_file_bytes,
            keep: config.keep_files,
        },
    )?;

    let (swap_sender, swap_port) = swap_channel();
    let (command_sender, commands) = std::sync::mpsc::channel::<LoopCommand>();
    let live = Arc::new(Live::new(&meta, &node.devices));
    // The domain it shares a budget in (`tokwatt fleet ab` reads it to freeze the
    // grants) and, from the first tick on, what it may hold there.
    live.lock().status.fleet = fleet_node
        .as_ref()
        .map(|fleet| fleet.status(std::time::Instant::now()));
    let control = Arc::new(ServeControl::new(control::Parts {
        live: Arc::clone(&live),
        host,
        node,
        offered,
        not_permitted,
        plugin_dirs,
        seed: config.seed,
        tick,
        probation_ticks: config.probation_ticks,
        swaps: swap_sender,
        commands: command_sender,
        first: control::PolicyRecord {
            spec: spec.clone(),
            plugin: plugin_path.clone(),
            version: version.clone(),
        },
        rules: config.rules,
        rules_source,
        fleet: config.fleet.is_some(),
    }));

    let objective = spec.objective;
    let control_loop = ControlLoop::new(
        backends,
        supervisor,
        &first,
        envelope,
        LoopConfig {
            duration: duration.unwrap_or(UNTIL_STOPPED),
            tick,
            objective,
            node_knobs,
            node_guardrails: config.rules.guardrails,
            node_envelope: Some(node_envelope),
            guard: config.rules.guard,
            power_allowance: fleet_node.as_ref().map(|f| {
                Arc::clone(&f.allowance) as Arc<dyn tokwatt_agent::control::PowerAllowance>
            }),
        },
        Arc::clone(&stop),
    )
    .with_swaps(swap_port)
    .with_commands(commands);

    let info = ServeInfo {
        meta: meta.clone(),
        policy: spec.name.clone(),
        policy_version: version,
        tick,
        withheld,
        out_dir: out_dir.clone(),
        state_file,
        objective_in_force: objective_in_force.clone(),
    };
    let thread = std::thread::Builder::new()
        .name("tokwatt-control-loop".into())
        .spawn({
            let control = Arc::clone(&control);
            let fleet_node = fleet_node.clone();
            let summary_of = {
                let spec_name = spec.name.clone();
                let spec_path = spec.path.display().to_string();
                let plugin = plugin_path.display().to_string();
                move |totals: tokwatt_agent::control::LoopTotals| RunSummary {
                    format_version: SUMMARY_FORMAT_VERSION,
                    output_formats: OutputFormats::default(),
                    policy: spec_name.clone(),
                    policy_spec: spec_path.clone(),
                    plugin: plugin.clone(),
                    tick_ms: u32::try_from(tick.as_millis()).unwrap_or(u32::MAX),
                    objective: Some(objective),
                    objective_in_force: Some(objective_in_force.clone()),
                    meta: meta.clone(),
                    totals,
                }
            };
            let summary_every = config.summary_every;
            let summary_path = out_dir.join("summary.json");
            move || {
                // A weeks-long run keeps a current summary.json (rewritten atomically).
                let mut last_summary = std::time::Instant::now();
                let mut control_loop = control_loop;
                let result = loop {
                    match control_loop.tick(&mut recorder) {
                        Ok(Some(progress)) => {
                            // First: the fence is fed only after a tick that was on time.
                            fence_feed.after_tick(progress.lateness, std::time::Instant::now());
                            control.observe(&progress);
                            if let Some(fleet) = &fleet_node {
                                fleet.observe(&progress);
                                control.observe_allowance(fleet.allowance.now());
                                control
                                    .observe_fleet_status(fleet.status(std::time::Instant::now()));
                            }
                            if last_summary.elapsed() >= summary_every {
                                last_summary = std::time::Instant::now();
                                write_summary(&summary_path, &summary_of(progress.totals.clone()));
                            }
                        }
                        Ok(None) => break Ok(control_loop.finish()),
                        Err(error) => break Err(error),
                    }
                };
                let outcome = match result {
                    Ok((totals, backends)) => {
                        let summary = summary_of(totals);
                        // Dropping the backends puts every changed setting back.
                        drop(backends);
                        recorder
                            .finish(&summary)
                            .map(|()| summary)
                            .map_err(ServeError::from)
                    }
                    Err(error) => Err(ServeError::Loop(error.to_string())),
                };
                live.end();
                outcome
            }
        })
        .map_err(ServeError::Thread)?;
    let fleet = match (&fleet_config, fleet_node) {
        (Some(fleet_config), Some(node)) => {
            match fleet::FleetThread::start(
                fleet_config.clone(),
                node,
                Arc::clone(&control),
                fence_declaration,
                default_w,
                boot,
            ) {
                Ok(thread) => Some(thread),
                Err(error) => {
                    stop.store(true, Ordering::Relaxed);
                    if thread.join().is_err() {
                        tracing::error!("the control loop panicked while stopping");
                    }
                    return Err(ServeError::Fleet(error.to_string()));
                }
            }
        }
        _ => None,
    };
    let watcher = match (&config.watch, watch_baseline) {
        (Some(folder), Some(baseline)) => {
            match watch::Watcher::start(
                folder.clone(),
                baseline,
                config.watch_period,
                Arc::clone(&control),
            ) {
                Ok(watcher) => Some(watcher),
                Err(error) => {
                    // The loop runs and may have changed settings: it puts them back when
                    // it stops, and must stop before the error ends the process.
                    stop.store(true, Ordering::Relaxed);
                    if thread.join().is_err() {
                        tracing::error!("the control loop panicked while stopping");
                    }
                    return Err(error);
                }
            }
        }
        _ => None,
    };
    Ok(Agent {
        control,
        stop,
        thread: Some(thread),
        watcher,
        fleet,
        systemd,
        info,
    })
}

/// summary.json during the run. The trace is safe on disk either way, so a summary that
/// cannot be written costs a warning, not the agent.
fn write_summary(path: &Path, summary: &RunSummary) {
    let written = serde_json::to_string_pretty(summary)
        .map_err(|e| e.to_string())
        .and_then(|text| tokwatt_report::write_atomically(path, &text).map_err(|e| e.to_string()));
    if let Err(error) = written {
        tracing::warn!(path = %path.display(), "the summary was not rewritten: {error}");
    }
}

/// `base/serve-YYYY-MM-DDTHH-MM-SSZ`, with a counter if that exists already: every start
/// of the agent writes its own files.
fn fresh_out_dir(base: &Path) -> PathBuf {
    let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now())
        .to_string()
        .replace(':', "-");
    let first = base.join(format!("serve-{stamp}"));
    if !first.exists() {
        return first;
    }
    (2..1000)
        .map(|n| base.join(format!("serve-{stamp}-{n}")))
        .find(|dir| !dir.exists())
        .unwrap_or(first)
}
