//! The trial of `tokwatt plugin check`: every guest function called in the real sandbox
//! on plausible inputs, each call's outcome and what the guest wrote kept.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::{PluginError, PluginHost, SandboxLimits, WasmPolicy};
use tokwatt_core::types::{ClockEvents, InForce, Observation};
use tokwatt_policy::supervisor::{InitArgs, PolicyEngine as _};
use tokwatt_policy::supervisor::{PolicyFailure, stderr_note};

/// One call of the trial and what became of it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CallOutcome {
    /// `init`, `decide`, `snapshot` or `restore` (with the trial step, e.g. `decide #2 (idle)`).
    pub call: String,
    pub function: String,
    pub ok: bool,
    /// What it returned, or why it failed.
    pub detail: String,
    /// For a failed call, the end of what it wrote to standard error (a Python
    /// traceback, a Rust panic report), one entry per line, each escaped. `detail` does not
    /// repeat it.
    pub stderr: Vec<String>,
}

/// Why a call of the trial failed, and what it wrote to standard error.
#[derive(Debug)]
pub(super) struct CallFailure {
    detail: String,
    stderr: Vec<String>,
}

impl From<String> for CallFailure {
    fn from(detail: String) -> Self {
        Self {
            detail,
            stderr: Vec::new(),
        }
    }
}

/// Run one guest call of `policy`; a failure comes with the end of what the call wrote
/// to standard error as lines, taken off the failure's one-line message (which the
/// agent's log keeps) so it is not shown twice.
pub(super) fn observed<T>(
    policy: &mut WasmPolicy,
    call: impl FnOnce(&mut WasmPolicy) -> Result<T, PolicyFailure>,
) -> Result<T, CallFailure> {
    let console = policy.console();
    let mark = console.stderr_written();
    call(policy).map_err(|failure| {
        let message = failure.to_string();
        let detail = console
            .stderr_tail_since(mark)
            .and_then(|tail| {
                message
                    .strip_suffix(&stderr_note(Some(&tail)))
                    .map(str::to_owned)
            })
            .unwrap_or(message);
        CallFailure {
            detail,
            stderr: console.stderr_tail_lines_since(mark),
        }
    })
}

/// What the trial feeds the plugin: `init`'s arguments and one list of observations per
/// `decide` (labelled, e.g. "busy" or "idle").
#[derive(Debug, Clone)]
pub struct TrialInputs {
    pub init: InitArgs,
    pub ticks: Vec<(String, Vec<Observation>)>,
    pub seed: u64,
}

/// The observations a trial feeds `decide`: each GPU busy (decoding at its default
/// settings), then idle, alternately, `count` ticks of one second.
pub fn sample_ticks(init: &InitArgs, count: usize) -> Vec<(String, Vec<Observation>)> {
    (0..count)
        .map(|tick| {
            let busy = tick % 2 == 0;
            let label = if busy { "busy" } else { "idle" };
            let observations = init
                .devices
                .iter()
                .map(|device| sample_observation(device, tick as u64, busy))
                .collect();
            (label.to_owned(), observations)
        })
        .collect()
}

/// A plausible one-second window of one GPU (H200-like figures scaled to its cap).
pub(super) fn sample_observation(
    device: &tokwatt_policy::supervisor::DeviceFacts,
    tick: u64,
    busy: bool,
) -> Observation {
    let sm_clock_max = device.sm_clocks_mhz.first().copied().unwrap_or(1980);
    let cap = device.power_cap_default_w;
    let batch = device.batch_size_max.min(128);
    let (tokens, power, util, tpot, active, queue) = if busy {
        (11_876_u64, cap * 0.95, 100.0, 10.8, batch, 40)
    } else {
        (0, cap * 0.11, 0.0, 0.0, 0, 0)
    };
    Observation {
        gpu: device.index,
        tick,
        interval_s: 1.0,
        tokens,
        energy_j: power,
        tokens_per_joule: if power > 0.0 {
            tokens as f64 / power
        } else {
            0.0
        },
        tokens_per_s: tokens as f64,
        power_avg_w: power,
        power_peak_w: power * 1.08,
        sm_clock_mhz: if busy { sm_clock_max } else { 345 },
        mem_clock_mhz: 3201,
        temperature_c: if busy { 55.0 } else { 32.0 },
        gpu_util_pct: util,
        clock_events: ClockEvents {
            gpu_idle: !busy,
            sw_power_cap: busy,
            ..ClockEvents::default()
        },
        tpot_p50_ms: tpot,
        tpot_p99_ms: tpot * 1.04,
        active_sequences: active,
        queue_depth: queue,
        demand: None,
        requests: None,
        in_force: InForce {
            power_cap_w: cap,
            power_cap_requested_w: cap,
            sm_clock_max_mhz: sm_clock_max,
            batch_size: batch,
            // The workload's budget, where it has one: the most the range allows.
            token_budget: device.token_budget_max,
        },
        last_clamped: false,
        settling: false,
    }
}

/// Run the plugin in the real sandbox: `init`, each tick's `decide`, then `snapshot`
/// and `restore` of that snapshot into a fresh instance (which then decides once more).
/// A failed call is recorded and the instance rebuilt, as the supervisor would, so one
/// bad call does not hide the others. Call only after [`inspect`] passed: a load error
/// here is returned as is.
pub fn trial(
    host: &PluginHost,
    path: &Path,
    limits: SandboxLimits,
    inputs: &TrialInputs,
) -> Result<Vec<CallOutcome>, PluginError> {
    let loaded = Arc::new(host.load(path, "plugin-check", limits)?);
    let mut outcomes = Vec::new();
    let mut record = |call: String, function: &str, result: Result<String, CallFailure>| {
        let ok = result.is_ok();
        let (detail, stderr) = match result {
            Ok(detail) => (detail, Vec::new()),
            Err(failure) => (failure.detail, failure.stderr),
        };
        outcomes.push(CallOutcome {
            call,
            function: function.to_owned(),
            ok,
            detail,
            stderr,
        });
        ok
    };
    let gpus = inputs.init.devices.len();
    let mut policy = match loaded.instantiate(inputs.seed) {
        Ok(policy) => policy,
        Err(failure) => {
            record(
                "instantiate".into(),
                "instantiate",
                Err(failure.to_string().into()),
            );
            return Ok(outcomes);
        }
    };
    let init = |policy: &mut WasmPolicy| {
        observed(policy, |policy| policy.init(&inputs.init))
            .and_then(|settings| settings_verdict(&settings, gpus).map_err(CallFailure::from))
    };
    let init_ok = record("init".into(), "init", init(&mut policy));
    if !init_ok {
        // Every later call would run on a policy that refused to start.
        return Ok(outcomes);
    }
    let decide = |policy: &mut WasmPolicy, tick: usize, observations: &[Observation]| {
        let tick_time = Duration::from_millis(u64::from(inputs.init.tick_ms) * (tick as u64 + 1));
        observed(policy, |policy| policy.decide(tick_time, observations)).and_then(|settings| {
            settings_verdict(&settings, observations.len()).map_err(CallFailure::from)
        })
    };
    for (tick, (label, observations)) in inputs.ticks.iter().enumerate() {
        let ok = record(
            format!("decide #{} ({label})", tick + 1),
            "decide",
            decide(&mut policy, tick, observations),
        );
        // A failed call leaves the instance unusable; start a fresh one as the
        // supervisor does, so the next call is tried on its own.
        if !ok && (policy.rebuild().is_err() || init(&mut policy).is_err()) {
            return Ok(outcomes);
        }
    }
    let (described, state) = match observed(&mut policy, |policy| policy.snapshot()) {
        Ok(state) => (
            Ok(format!(
                "state schema {} with {} bytes",
                state.schema_version,
                state.bytes.len()
            )),
            Some(state),
        ),
        Err(failure) => (Err(failure), None),
    };
    record("snapshot".into(), "snapshot", described);
    let Some(state) = state else {
        return Ok(outcomes);
    };
    let mut fresh = match loaded.instantiate(inputs.seed.wrapping_add(1)) {
        Ok(fresh) => fresh,
        Err(failure) => {
            record("restore".into(), "restore", Err(failure.to_string().into()));
            return Ok(outcomes);
        }
    };
    let restored = init(&mut fresh).and_then(|_| {
        observed(&mut fresh, |fresh| fresh.restore(&state))
            .map(|()| "took its own snapshot back".to_owned())
    });
    if record("restore".into(), "restore", restored)
        && let Some((label, observations)) = inputs.ticks.first()
    {
        record(
            format!("decide after restore ({label})"),
            "decide",
            decide(&mut fresh, inputs.ticks.len(), observations),
        );
    }
    Ok(outcomes)
}

/// A list of settings is usable when it has one entry per GPU.
pub(super) fn settings_verdict(
    settings: &[tokwatt_core::types::Settings],
    gpus: usize,
) -> Result<String, String> {
    if settings.len() != gpus {
        return Err(format!(
            "returned {} settings for {gpus} GPU(s): the contract wants exactly one per GPU, in device order",
            settings.len()
        ));
    }
    let shown: Vec<String> = settings.iter().map(ToString::to_string).collect();
    Ok(shown.join("; "))
}
