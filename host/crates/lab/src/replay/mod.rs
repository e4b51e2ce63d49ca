//! `tokwatt replay`: a recorded run's observations fed to a policy, tick by tick, with
//! its decisions beside the ones the run recorded, and what the guest logged and wrote
//! to its standard output and error.
//!
//! The policy is started as the run started its own: the run's seed and tick, the device
//! facts of the run's GPUs, the spec's knobs as the simulator grants them, and a
//! [`Supervisor`] (so a trap is decided by the fallback, the instance rebuilt and a
//! failing policy ejected, tick for tick as in the run). Each tick gets the recorded
//! observations and the recorded tick time, so a deterministic policy (every shipped one:
//! its random source and clocks are the run's) decides exactly what it decided in the
//! run, and the same replay prints the same bytes every time.
//!
//! A run does not record its devices' facts (power-cap range, supported clocks, largest
//! batch), which `init` needs: for a simulated run they are taken from the simulator
//! profile that `summary.json` names, with the built-in scenario; for a run on real GPUs
//! from a profile the caller names.

mod recorded;
mod render;

use recorded::{for_each_recorded_tick, read_summary};
pub use render::render_text;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use tokwatt_agent::assembly::{self, BackendRequest, SimTarget, Target};
use tokwatt_agent::node::{Node, NodeRequest, PluginPlaces};
use tokwatt_agent::{self as agent, NodeFacts, RunSummary};
use tokwatt_core::types::Settings;
use tokwatt_plugin::{GuestConsole, GuestOutput, PluginHost};
use tokwatt_policy::spec::PolicySpec;
use tokwatt_policy::supervisor::{DecisionSource, Supervisor};

/// Version of the replay's JSON output (`--json`).
pub const REPLAY_FORMAT_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(
        "{} is not a run's output folder: it has no summary.json; give the folder a run wrote (`tokwatt run --out DIR`, or `tokwatt serve`'s output folder)",
        dir.display()
    )]
    NotARun { dir: PathBuf },
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{} is damaged at line {line}: {reason}; replay a run whose files are complete",
        path.display()
    )]
    Damaged {
        path: PathBuf,
        line: u64,
        reason: String,
    },
    #[error(
        "{} is in {what} format version {found}, and this tokwatt reads version {supported}: replay it with the tokwatt version that recorded it, or record the run again with this one",
        path.display()
    )]
    ForeignVersion {
        path: PathBuf,
        what: &'static str,
        found: u64,
        supported: u32,
    },
    #[error(
        "the run was on real GPUs ({gpu_name}), and a run does not record the device facts (power-cap range, clocks, largest batch) that a policy's init needs: pass --sim PROFILE (h200, h100, a100 or a profile file) to take them from the simulator's profile of that GPU"
    )]
    NoDeviceFacts { gpu_name: String },
    #[error(
        "the run managed {recorded} GPUs, and the device facts taken from `{profile}` describe {facts}"
    )]
    DeviceCount {
        profile: String,
        recorded: u32,
        facts: usize,
    },
    #[error(
        "{} has {found} observations at tick {tick}, one per GPU of the run's {expected}: the file is damaged",
        path.display()
    )]
    TickIncomplete {
        path: PathBuf,
        tick: u64,
        found: usize,
        expected: usize,
    },
    #[error("the run recorded no tick in {range}{}", recorded.map_or_else(|| " (it recorded none at all)".to_owned(), |(a, b)| format!(" (it recorded ticks {a}..{b})")))]
    NoTicks {
        range: TickRange,
        recorded: Option<(u64, u64)>,
    },
    #[error("{0}")]
    BadRange(String),
    #[error("assembling the simulator for the run's device facts: {0}")]
    Assembly(#[from] assembly::AssemblyError),
    #[error(transparent)]
    Node(#[from] tokwatt_agent::node::NodeError),
    #[error(transparent)]
    Agent(#[from] agent::AgentError),
}

/// Ticks to show, both ends included; open ends reach the run's first or last tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct TickRange {
    pub first: Option<u64>,
    pub last: Option<u64>,
}

impl TickRange {
    /// `A..B` (both included), `A..` or `..B`.
    pub fn parse(text: &str) -> Result<Self, ReplayError> {
        let bad = |why: &str| {
            ReplayError::BadRange(format!(
                "--ticks `{text}` {why}: write A..B (ticks A to B, both included), A.. or ..B"
            ))
        };
        let (first, last) = text
            .trim()
            .split_once("..")
            .ok_or_else(|| bad("has no `..`"))?;
        let end = |part: &str| -> Result<Option<u64>, ReplayError> {
            let part = part.trim();
            if part.is_empty() {
                return Ok(None);
            }
            part.parse()
                .map(Some)
                .map_err(|_| bad(&format!("has `{part}`, which is not a tick number")))
        };
        let range = TickRange {
            first: end(first)?,
            last: end(last)?,
        };
        if let (Some(a), Some(b)) = (range.first, range.last)
            && a > b
        {
            return Err(bad("ends before it starts"));
        }
        Ok(range)
    }

    fn contains(&self, tick: u64) -> bool {
        self.first.is_none_or(|a| tick >= a) && self.last.is_none_or(|b| tick <= b)
    }

    fn past(&self, tick: u64) -> bool {
        self.last.is_some_and(|b| tick > b)
    }
}

impl std::fmt::Display for TickRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let end = |e: Option<u64>| e.map(|t| t.to_string()).unwrap_or_default();
        write!(f, "{}..{}", end(self.first), end(self.last))
    }
}

/// What to replay.
#[derive(Debug, Clone)]
pub struct ReplayRequest {
    pub run_dir: PathBuf,
    pub spec: PolicySpec,
    pub ticks: TickRange,
    /// The simulator profile whose device facts `init` gets; `None`: the run's own (a
    /// simulated run only).
    pub sim_profile: Option<String>,
    pub plugin_dirs: Vec<PathBuf>,
    pub cache_dir: Option<PathBuf>,
}

/// The replay: `--json` prints it as it is. **API boundary** once scripts read it: its
/// keys are versioned by [`REPLAY_FORMAT_VERSION`].
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    pub format_version: u32,
    pub run_dir: String,
    /// The replayed policy (its spec's name) and plugin.
    pub policy: String,
    pub plugin: String,
    /// The policy the run started with.
    pub recorded_policy: String,
    pub seed: u64,
    pub tick_ms: u32,
    /// Where the device facts `init` got come from, in words.
    pub device_facts: String,
    pub ticks_shown: TickRange,
    /// Things that make the replay differ from the run for reasons other than the
    /// policy, in words.
    pub notes: Vec<String>,
    pub init: InitReplay,
    pub ticks: Vec<TickReplay>,
    pub totals: ReplayTotals,
}

#[derive(Debug, Clone, Serialize)]
pub struct InitReplay {
    /// `init`'s first settings, one per GPU.
    pub settings: Vec<Settings>,
    pub output: GuestOutput,
}

/// One tick: what the replayed policy decided, what the run recorded.
#[derive(Debug, Clone, Serialize)]
pub struct TickReplay {
    pub tick: u64,
    pub time_s: f64,
    /// One per GPU; all "leave unchanged" when the fallback decided.
    pub decided: Vec<Settings>,
    /// `policy`, `fallback` or `ejected`.
    pub source: &'static str,
    /// Why the fallback decided (a failure names the end of the guest's stderr).
    pub failure: Option<String>,
    /// What the run's policy (or its fallback) asked for.
    pub recorded: Vec<Settings>,
    pub recorded_policy: String,
    pub recorded_fallback: bool,
    /// The decisions equal the recorded ones on every GPU.
    pub same: bool,
    /// What the guest logged and wrote during this tick.
    pub output: GuestOutput,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ReplayTotals {
    /// Ticks fed to the policy (those before the range too: a policy's state needs them).
    pub ticks_fed: u64,
    pub ticks_shown: u64,
    pub same: u64,
    pub different: u64,
    pub fallback: u64,
}

/// Replay `request.run_dir` with `request.spec`'s policy.
pub fn replay(request: &ReplayRequest) -> Result<ReplayReport, ReplayError> {
    let dir = &request.run_dir;
    let summary = read_summary(dir)?;
    // A simulated node, put together as every command's is: its devices describe the
    // run's to the policy; nothing on it can change a GPU.
    let (opened, device_facts) = open_node(request, &summary)?;
    let node = opened.facts();
    let knobs = opened.assembled.knobs;
    if node.devices.len() != summary.meta.gpu_count as usize {
        return Err(ReplayError::DeviceCount {
            profile: request
                .sim_profile
                .clone()
                .unwrap_or(summary.meta.gpu_profile.clone()),
            recorded: summary.meta.gpu_count,
            facts: node.devices.len(),
        });
    }
    let mut spec = request.spec.clone();
    spec.knobs = knobs;
    let plugin_path = opened.plugin_for(&spec)?;
    let host = &opened.host;
    let (mut supervisor, first, console) = start(host, &spec, &plugin_path, &node, &summary)?;

    let mut notes = Vec::new();
    if spec.name != summary.policy {
        notes.push(format!(
            "the run's policy was `{}`; this replay runs `{}`, so different decisions are expected",
            summary.policy, spec.name
        ));
    }
    if spec.tick_ms != summary.tick_ms {
        notes.push(format!(
            "the spec's tick is {} ms; the policy gets the run's, {} ms",
            spec.tick_ms, summary.tick_ms
        ));
    }
    let mut report = ReplayReport {
        format_version: REPLAY_FORMAT_VERSION,
        run_dir: dir.display().to_string(),
        policy: spec.name.clone(),
        plugin: plugin_path.display().to_string(),
        recorded_policy: summary.policy.clone(),
        seed: summary.meta.seed,
        tick_ms: summary.tick_ms,
        device_facts,
        ticks_shown: request.ticks,
        notes,
        init: InitReplay {
            settings: first,
            output: console.take(),
        },
        ticks: Vec::new(),
        totals: ReplayTotals::default(),
    };

    let mut recorded_span: Option<(u64, u64)> = None;
    for_each_recorded_tick(dir, node.devices.len(), &mut |recorded| {
        let span = recorded_span.get_or_insert((recorded.tick, recorded.tick));
        span.1 = recorded.tick;
        if request.ticks.past(recorded.tick) {
            return Ok(false);
        }
        let tick_time = tick_time(recorded.time_s);
        let decision = supervisor.decide(recorded.tick, tick_time, &recorded.observations);
        report.totals.ticks_fed += 1;
        let output = console.take();
        if !request.ticks.contains(recorded.tick) {
            return Ok(true);
        }
        let (source, failure) = match &decision.source {
            DecisionSource::Policy => ("policy", None),
            DecisionSource::Fallback(failure) => ("fallback", Some(failure.to_string())),
            DecisionSource::Ejected { until_tick } => (
                "ejected",
                Some(format!(
                    "the policy is ejected until tick {until_tick}; the fallback holds the settings"
                )),
            ),
        };
        let same = decision.settings.len() == recorded.requested.len()
            && decision
                .settings
                .iter()
                .zip(&recorded.requested)
                .all(|(decided, recorded)| as_recorded(decided) == *recorded);
        report.totals.ticks_shown += 1;
        report.totals.same += u64::from(same);
        report.totals.different += u64::from(!same);
        report.totals.fallback += u64::from(source != "policy");
        report.ticks.push(TickReplay {
            tick: recorded.tick,
            time_s: recorded.time_s,
            decided: decision.settings,
            source,
            failure,
            recorded: recorded.requested,
            recorded_policy: recorded.policy,
            recorded_fallback: recorded.fallback,
            same,
            output,
        });
        Ok(true)
    })?;
    if report.ticks.is_empty() {
        return Err(ReplayError::NoTicks {
            range: request.ticks,
            recorded: recorded_span,
        });
    }
    if let Some((first, _)) = recorded_span
        && first > 0
    {
        report.notes.push(format!(
            "the run's files start at tick {first} (older ticks were rotated away): the policy did not see the ticks before, so its decisions may differ from the run's"
        ));
    }
    Ok(report)
}

/// The recorded tick time: the run's clock at the tick, in whole nanoseconds.
fn tick_time(time_s: f64) -> Duration {
    if time_s.is_finite() && time_s >= 0.0 {
        Duration::from_nanos((time_s * 1e9).round() as u64)
    } else {
        Duration::ZERO
    }
}

/// A decision as the recorder writes it: JSON has no NaN or infinity, so a non-finite
/// power cap (which the envelope drops) was recorded as "leave unchanged".
fn as_recorded(settings: &Settings) -> Settings {
    Settings {
        power_cap_w: settings.power_cap_w.filter(|w| w.is_finite()),
        ..*settings
    }
}

/// The policy started as `agent::start_policy` starts it, keeping its console (what the
/// guest writes, and a transcript of its log messages) for the report.
fn start(
    host: &PluginHost,
    spec: &PolicySpec,
    plugin_path: &Path,
    node: &NodeFacts,
    summary: &RunSummary,
) -> Result<(Supervisor, Vec<Settings>, GuestConsole), ReplayError> {
    let tick = Duration::from_millis(u64::from(summary.tick_ms));
    let (supervisor, first, _, console) =
        agent::start_policy_watched(host, spec, plugin_path, node, summary.meta.seed, tick)?;
    Ok((supervisor, first, console))
}

/// A simulated node standing for the run's (its devices, the knobs the simulator grants
/// the spec, the plugin host), and where its devices came from in words.
fn open_node(request: &ReplayRequest, summary: &RunSummary) -> Result<(Node, String), ReplayError> {
    let (profile, words) = match (&request.sim_profile, summary.meta.simulated) {
        (Some(profile), _) => (
            profile.clone(),
            format!("the simulator profile `{profile}` (--sim)"),
        ),
        (None, true) => (
            summary.meta.gpu_profile.clone(),
            format!(
                "the simulator profile `{}` named in summary.json, with the built-in scenario (a run does not record its device facts)",
                summary.meta.gpu_profile
            ),
        ),
        (None, false) => {
            return Err(ReplayError::NoDeviceFacts {
                gpu_name: summary.meta.gpu_name.clone(),
            });
        }
    };
    let backend_request = BackendRequest {
        target: Target::Sim(SimTarget {
            gpus: summary.meta.gpu_count,
            ..SimTarget::new(profile)
        }),
        seed: summary.meta.seed,
        batch_only: false,
    };
    let node = Node::open(NodeRequest {
        plugins: PluginPlaces {
            dirs: request.plugin_dirs.clone(),
            cache_dir: request.cache_dir.clone(),
        },
        ..NodeRequest::new(backend_request, &request.spec)
    })?;
    Ok((node, words))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_core::types::Observation;

    #[test]
    fn tick_ranges_parse_with_open_ends_and_refuse_nonsense() {
        assert_eq!(
            TickRange::parse("3..7").expect("parses"),
            TickRange {
                first: Some(3),
                last: Some(7)
            }
        );
        let open = TickRange::parse("5..").expect("parses");
        assert!(open.contains(5) && open.contains(1 << 40) && !open.contains(4));
        let to = TickRange::parse("..2").expect("parses");
        assert!(to.contains(0) && to.contains(2) && !to.contains(3) && to.past(3));
        for bad in ["7..3", "3", "a..b", "1..2x"] {
            let error = TickRange::parse(bad).expect_err(bad).to_string();
            assert!(error.contains("write A..B"), "{error}");
        }
    }

    #[test]
    fn a_nan_decision_compares_as_recorded() {
        use tokwatt_agent::recorder::{ObservationReader, Recorder, TickRecord};
        let dir = tempfile::tempdir().expect("tempdir");
        let decided = Settings {
            power_cap_w: Some(f64::NAN),
            sm_clock_max_mhz: None,
            batch_size: Some(8),
            token_budget: None,
        };
        let observation = Observation::typical_h200(0, 1);
        let mut recorder = Recorder::create(dir.path(), false).expect("recorder");
        recorder
            .record(&TickRecord {
                requested: decided,
                ..TickRecord::unchanged(2.0, "p", observation)
            })
            .expect("record");
        recorder.finish(&"summary").expect("finish");
        let read = ObservationReader::open(dir.path())
            .expect("open")
            .next()
            .expect("a line")
            .expect("reads");
        // The same decision made again in a replay matches what was recorded of it.
        assert_eq!(as_recorded(&decided), read.record.requested);
    }
}
