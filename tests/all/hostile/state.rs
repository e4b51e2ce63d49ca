//! Hostile state at a hot swap: `snapshot` and `restore` are plugin calls like any other.

use std::time::Duration;

use tokwatt_agent::assembly::{self, BackendRequest, SimTarget, Target};
use tokwatt_agent::swap::PreparedPolicy;
use tokwatt_agent::{self as agent, NodeFacts};
use tokwatt_plugin::{HostConfig, PluginHost};
use tokwatt_policy::spec::PolicySpec;
use tokwatt_policy::supervisor::PolicyFailure;

use super::*;

fn prepare(mode: &str, extra: &str) -> Result<PreparedPolicy, tokwatt_agent::AgentError> {
    let dir = tempdir();
    let spec = write_spec(
        dir.path(),
        mode,
        &built_plugin("fixture_hostile"),
        &hostile_extra(mode, extra),
    );
    let spec = PolicySpec::load(&spec).expect("spec");
    let request = BackendRequest {
        target: Target::Sim(SimTarget::new("h200")),
        seed: 1,
        batch_only: false,
    };
    let assembled = assembly::assemble(&request, &spec.name, spec.knobs).expect("sim");
    let node = NodeFacts::of(&assembled.backends);
    let host = PluginHost::new(&HostConfig::default()).expect("host");
    let plugin = spec.resolve_plugin(&[]).expect("plugin");
    agent::prepare_policy(&host, &spec, &plugin, &node, 1, Duration::from_secs(1))
}

#[test]
fn a_huge_snapshot_is_bounded_by_the_memory_limit() {
    // 8 MiB of state fits in 64 MiB and is handed over; 96 MiB cannot be built.
    let slow_ok = "[sandbox]\ndeadline_ms = 500";
    let mut fits =
        prepare("huge-snapshot", &format!("snapshot_mib = 8\n{slow_ok}")).expect("starts");
    let state = fits.supervisor.snapshot().expect("snapshot");
    assert_eq!(state.bytes.len(), 8 << 20);
    let mut huge =
        prepare("huge-snapshot", &format!("snapshot_mib = 96\n{slow_ok}")).expect("starts");
    let failure = huge.supervisor.snapshot().expect_err("too big");
    assert!(
        matches!(failure, PolicyFailure::MemoryLimit { .. }),
        "{failure}"
    );
}

#[test]
fn a_panicking_snapshot_is_a_named_trap() {
    let mut old = prepare("panic-snapshot", "").expect("starts");
    let Err(PolicyFailure::Trap(text)) = old.supervisor.snapshot() else {
        panic!("a trap");
    };
    assert!(text.contains("snapshot refused to be taken"), "{text}");
    // Counted like a failed `decide`: the policy may come back by a rollback.
    let counters = old.supervisor.counters();
    assert_eq!(counters.traps, 1);
    assert_eq!(counters.failures_by_kind.get("trap"), Some(&1));
}

#[test]
fn a_trapping_restore_is_refused_with_its_cause() {
    let mut new = prepare("trap-restore", "").expect("starts");
    let state = tokwatt_policy::supervisor::PolicyState {
        schema_version: 1,
        bytes: vec![1, 2, 3],
    };
    let Err(PolicyFailure::Trap(text)) = new.supervisor.restore(&state) else {
        panic!("a trap");
    };
    assert!(text.contains("restore trapped on 3 bytes"), "{text}");
}

#[test]
fn a_hostile_restore_refusal_is_escaped() {
    let mut new = prepare("hostile-restore-error", "").expect("starts");
    let state = tokwatt_policy::supervisor::PolicyState::default();
    let Err(PolicyFailure::Refused(text)) = new.supervisor.restore(&state) else {
        panic!("refused");
    };
    assert_no_raw_text(&text);
    assert!(text.len() < 2048 && text.contains("bytes cut"), "{text}");
    // A refusal is the policy's answer, not a failure.
    assert_eq!(new.supervisor.counters().traps, 0);
}
