//! Invariant 5: a swap never misses a tick. New policies are started off the loop, take
//! over at tick boundaries with the old one's state, and a new policy that fails in its
//! probation gives way to the old one by itself.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::time::Duration;

use tokwatt_agent::assembly::{self, BackendRequest, SimTarget, Target};
use tokwatt_agent::swap::swap_channel;
use tokwatt_agent::{self as agent, NodeFacts, RunRequest};
use tokwatt_plugin::{HostConfig, PluginHost};
use tokwatt_policy::spec::PolicySpec;

use crate::support::*;

const TICKS: u64 = 200;
/// A stateful policy is swapped in every this many ticks.
const SWAP_EVERY: u64 = 10;
/// At this tick a policy whose third `decide` traps is swapped in: it decides this tick
/// (its `init`), the next two, and fails on the third, within its probation.
const BROKEN_AT: u64 = 103;

#[test]
fn swaps_every_few_ticks_miss_no_tick_carry_state_and_roll_back_a_broken_policy() {
    let dir = tempdir();
    let stateful = write_spec(
        dir.path(),
        "stateful",
        &built_plugin("fixture_stateful"),
        "",
    );
    let broken = write_spec(
        dir.path(),
        "broken",
        &built_plugin("fixture_trap_decide"),
        "",
    );
    let stateful = PolicySpec::load(&stateful).expect("spec");
    let broken = PolicySpec::load(&broken).expect("spec");

    let request = BackendRequest {
        target: Target::Sim(SimTarget {
            gpus: 2,
            ..SimTarget::new("h200")
        }),
        seed: 7,
        batch_only: false,
    };
    let assembled = assembly::assemble(&request, &stateful.name, stateful.knobs).expect("sim");
    let node = NodeFacts::of(&assembled.backends);
    let tick = Duration::from_secs(1);
    let cache = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("component-cache");

    // The preparer: a thread of its own, as an API handler would be. It prepares the
    // next policy while the loop runs, sends it, then says so.
    let (sender, port) = swap_channel();
    let (sent_tx, sent_rx) = mpsc::channel::<u64>();
    let (want_tx, want_rx) = mpsc::channel::<u64>();
    let preparer = {
        let (stateful, broken, node, cache) = (stateful.clone(), broken.clone(), node, cache);
        std::thread::spawn(move || {
            let host = PluginHost::new(&HostConfig {
                cache_dir: Some(cache),
            })
            .expect("plugin host");
            while let Ok(at) = want_rx.recv() {
                let spec = if at == BROKEN_AT { &broken } else { &stateful };
                let plugin = spec.resolve_plugin(&[]).expect("plugin");
                let prepared = agent::prepare_policy(&host, spec, &plugin, &node, 7, tick)
                    .expect("the next policy starts off the loop");
                sender.send(prepared).expect("the loop is running");
                sent_tx.send(at).expect("test is waiting");
            }
        })
    };

    let out = dir.path().join("run");
    let run = RunRequest {
        spec: stateful.clone(),
        duration: tick * TICKS as u32,
        tick: Some(tick),
        out_dir: out.clone(),
        plugin_dirs: vec![],
        cache_dir: Some(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("component-cache")),
        seed: 7,
        overwrite: false,
        write_files: true,
        // Failures roll back here; the objective's rollbacks are tests/all/guard.rs's.
        rules: tokwatt_policy::rules::NodeRules::judging(),
        rules_source: "the judge's node rules".into(),
        node_knobs: tokwatt_core::types::Knobs::all(),
        output: tokwatt_agent::recorder::OutputBounds::default(),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (summary, _) = agent::run_with_swaps(
        &run,
        assembled.backends,
        assembled.meta,
        stop,
        Some(port),
        &mut |progress| {
            // After the tick before a swap, wait until the next policy has been sent, so
            // the swap lands at a known boundary (the virtual clock does not wait).
            let next = progress.tick + 1;
            if next % SWAP_EVERY == 0 || next == BROKEN_AT {
                want_tx.send(next).expect("preparer alive");
                assert_eq!(sent_rx.recv().expect("preparer sent"), next);
            }
        },
    )
    .expect("the run completes");
    drop(want_tx);
    preparer.join().expect("preparer");

    let totals = &summary.totals;
    assert_eq!(totals.ticks, TICKS, "no tick missed");
    let swaps_sent = (1..TICKS).filter(|t| t % SWAP_EVERY == 0).count() as u64 + 1;
    assert_eq!(totals.swaps.swaps, swaps_sent);
    assert_eq!(
        totals.swaps.rollbacks, 1,
        "the broken policy was rolled back"
    );
    // The counts are the run's, over every policy in charge: the broken one's trap
    // stays counted after its rollback, and the run names who finished it.
    assert_eq!(totals.plugin_traps, 1, "{:?}", totals.policy_counters);
    assert_eq!(totals.policy_counters.traps, 1);
    assert_eq!(totals.policy_at_end, "stateful");

    // Every tick has a row per GPU, and the policy in charge is named on it.
    let trace = read_trace(&out.join("trace.csv"));
    assert_eq!(trace.len() as u64, TICKS * 2);
    let policy_at = |tick: u64| {
        trace
            .iter()
            .find(|row| row.f64("tick") as u64 == tick)
            .map(|row| row.fields["policy"].clone())
            .expect("row")
    };
    assert_eq!(policy_at(BROKEN_AT), "broken");
    assert_eq!(policy_at(BROKEN_AT + 3), "broken", "its failing tick");
    assert_eq!(
        policy_at(BROKEN_AT + 4),
        "stateful",
        "the old policy is back"
    );

    // State carried over: the stateful fixture asks for 200 + n W at its n-th `decide`,
    // counting on across swaps. The caps it asked for on GPU 0 rise by one at every tick
    // a stateful policy decided, whichever instance it was.
    let jsonl = std::fs::read_to_string(out.join("observations.jsonl")).expect("jsonl");
    let mut asked = Vec::new();
    for line in jsonl.lines() {
        let record: serde_json::Value = serde_json::from_str(line).expect("json");
        if record["observation"]["gpu"] == 0
            && record["policy"] == "stateful"
            && let Some(cap) = record["requested"]["power_cap_w"].as_f64()
        {
            asked.push(cap);
        }
    }
    assert!(
        asked.windows(2).all(|pair| pair[1] == pair[0] + 1.0),
        "the count went on across swaps: {asked:?}"
    );
    // Every tick was a stateful `decide` but the swap ticks (decided by the new policy's
    // `init`) and the broken policy's two good and one failing `decide`.
    assert_eq!(asked.len() as u64, TICKS - swaps_sent - 3);
}

/// A policy that reaches a paused loop is dropped and its sender told; it does not take
/// over unseen at the next resume.
#[test]
fn a_swap_reaching_a_paused_loop_is_refused_not_kept() {
    use tokwatt_agent::swap::{InCharge, SwapEvent, Swapper};

    let dir = tempdir();
    let spec = write_spec(
        dir.path(),
        "stateful",
        &built_plugin("fixture_stateful"),
        "",
    );
    let spec = PolicySpec::load(&spec).expect("spec");
    let request = BackendRequest {
        target: Target::Sim(SimTarget::new("h200")),
        seed: 7,
        batch_only: false,
    };
    let assembled = assembly::assemble(&request, &spec.name, spec.knobs).expect("sim");
    let node = NodeFacts::of(&assembled.backends);
    let host = PluginHost::new(&HostConfig {
        cache_dir: Some(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("component-cache")),
    })
    .expect("plugin host");
    let plugin = spec.resolve_plugin(&[]).expect("plugin");
    let prepare = || {
        agent::prepare_policy(&host, &spec, &plugin, &node, 7, Duration::from_secs(1))
            .expect("prepared")
    };

    let (sender, port) = swap_channel();
    let mut swapper = Swapper::new(Some(port));
    let (notify, events) = mpsc::channel();
    let mut arriving = prepare();
    arriving.notify = Some(notify);
    sender.send(arriving).expect("sent");

    swapper.refuse_while_paused(5);
    assert!(matches!(
        events.try_recv(),
        Ok(SwapEvent::RefusedWhilePaused { tick: 5 })
    ));
    // Resumed: nothing is waiting to take over.
    let mut in_charge = prepare();
    let taken = swapper.take_over(
        6,
        InCharge {
            supervisor: &mut in_charge.supervisor,
            envelope: &mut in_charge.envelope,
            objective: &mut in_charge.objective,
        },
        &[],
    );
    assert!(taken.is_none(), "a refused swap took over after the pause");
    assert_eq!(swapper.counters.swaps, 0);
}
