//! The fleet's store on a real etcd cluster (three members on loopback): leadership,
//! fencing, leases and the keys bound to them, a member killed.

use std::time::{Duration, Instant};

use tokwatt_fleet::etcd::EtcdFleet;
use tokwatt_fleet::ledger::Why;
use tokwatt_fleet::{
    DomainBudget, Fence, FenceKind, FleetStore, Grant, GrantWrite, Hold, HoldWrite, Ledger,
    NodeBudget, NodeReport, ProofSource, ReleaseProof, Written,
};
use tokwatt_test_support::{EtcdCluster, eventually, free_port};

const TIMEOUT: Duration = Duration::from_secs(2);

fn budget(domain: &str) -> DomainBudget {
    DomainBudget {
        domain: domain.into(),
        budget_w: 10_000.0,
        uncontrolled_w: 500.0,
        nodes: ["a", "b"]
            .iter()
            .map(|n| NodeBudget {
                node: (*n).into(),
                reserve_w: 1000.0,
                max_w: 5600.0,
                priority: 0,
                // Two unfenced nodes' 11.2 kW would not fit: these run a fence.
                fenced: true,
                default_w: None,
            })
            .collect(),
    }
}

fn report(caps_in_force_w: f64) -> NodeReport {
    NodeReport {
        boot: 0,
        acked_generation: 0,
        caps_in_force_w,
        draw_w: caps_in_force_w * 0.9,
        tokens_per_s: 1000.0,
        wants_more: true,
        requested_w: 0.0,
        fence: None,
        default_w: 0.0,
    }
}

fn grant(generation: u64, watts: f64) -> Grant {
    Grant {
        generation,
        watts,
        ceiling_w: watts,
        under_freeze: None,
    }
}

#[test]
fn leadership_is_exclusive_and_a_deposed_leader_cannot_write() {
    let Some(cluster) = EtcdCluster::start(3) else {
        return;
    };
    let store = EtcdFleet::connect(&cluster.endpoints(), TIMEOUT).expect("connects");
    store.put_budget(&budget("rack-1")).expect("budget");
    let node = store
        .join("rack-1", "a", Duration::from_secs(30), &report(1000.0))
        .expect("joins");

    let first = store
        .campaign("rack-1", "coordinator-1", Duration::from_secs(30))
        .expect("campaign")
        .expect("the first candidate leads");
    assert!(
        store
            .campaign("rack-1", "coordinator-2", Duration::from_secs(30))
            .expect("campaign")
            .is_none(),
        "a second candidate does not lead while the first does"
    );
    let write = [GrantWrite {
        node: "a",
        lease: node.lease,
        grant: grant(1, 3000.0),
    }];
    assert_eq!(
        store
            .write_grants(&first, None, &write, &[])
            .expect("write"),
        Written::Done
    );
    assert_eq!(store.grant(&node).expect("read"), Some(grant(1, 3000.0)));

    // The first leader's lease goes (a crash, or a cut-off coordinator whose lease
    // lapsed): another takes over, and the old one's writes are refused.
    store.resign(&first).expect("resign");
    let second = store
        .campaign("rack-1", "coordinator-2", Duration::from_secs(30))
        .expect("campaign")
        .expect("the second candidate leads now");
    assert!(second.fence > first.fence);
    let stale = [GrantWrite {
        node: "a",
        lease: node.lease,
        grant: grant(2, 5600.0),
    }];
    assert!(
        store
            .write_grants(&first, None, &stale, &[])
            .expect("fenced")
            == Written::Deposed,
        "a deposed leader's grant is refused"
    );
    assert_eq!(store.grant(&node).expect("read"), Some(grant(1, 3000.0)));
    assert!(!store.renew_leadership(&first).expect("renew"));
    assert!(store.renew_leadership(&second).expect("renew"));
}

#[test]
fn a_lapsed_node_loses_its_record_and_its_grant_together() {
    let Some(cluster) = EtcdCluster::start(3) else {
        return;
    };
    let store = EtcdFleet::connect(&cluster.endpoints(), TIMEOUT).expect("connects");
    store.put_budget(&budget("rack-2")).expect("budget");
    let leader = store
        .campaign("rack-2", "c", Duration::from_secs(30))
        .expect("campaign")
        .expect("leads");
    let node = store
        .join("rack-2", "a", Duration::from_secs(2), &report(1000.0))
        .expect("joins");
    assert_eq!(
        store
            .write_grants(
                &leader,
                None,
                &[GrantWrite {
                    node: "a",
                    lease: node.lease,
                    grant: grant(1, 4000.0)
                }],
                &[]
            )
            .expect("write"),
        Written::Done
    );
    let view = store
        .read_domain("rack-2")
        .expect("read")
        .expect("a budget");
    let a = view.nodes.iter().find(|n| n.node == "a").expect("node a");
    assert_eq!(a.grant, Some(grant(1, 4000.0)));
    assert!(
        view.nodes
            .iter()
            .any(|n| n.node == "b" && n.record.is_none())
    );

    // The node stops renewing: within the TTL (and etcd's check interval) both go.
    assert!(
        eventually(Duration::from_secs(10), || {
            let view = store.read_domain("rack-2").expect("read").expect("budget");
            let a = view.nodes.iter().find(|n| n.node == "a").expect("node a");
            a.record.is_none() && a.grant.is_none()
        }),
        "the lapsed node's keys are gone"
    );
    assert_eq!(
        store.renew(&node).expect("renew"),
        None,
        "the lease is gone"
    );
    assert_eq!(store.grant(&node).expect("read"), None);
}

#[test]
fn a_grant_under_an_earlier_lease_is_not_the_rejoined_nodes() {
    let Some(cluster) = EtcdCluster::start(1) else {
        return;
    };
    let store = EtcdFleet::connect(&cluster.endpoints(), TIMEOUT).expect("connects");
    store.put_budget(&budget("rack-3")).expect("budget");
    let leader = store
        .campaign("rack-3", "c", Duration::from_secs(30))
        .expect("campaign")
        .expect("leads");
    let before = store
        .join("rack-3", "a", Duration::from_secs(30), &report(1000.0))
        .expect("joins");
    let write = [GrantWrite {
        node: "a",
        lease: before.lease,
        grant: grant(1, 5000.0),
    }];
    assert_eq!(
        store
            .write_grants(&leader, None, &write, &[])
            .expect("write"),
        Written::Done
    );
    // The agent restarts (kill -9) and joins again before its old lease has lapsed.
    let after = store
        .join("rack-3", "a", Duration::from_secs(30), &report(1000.0))
        .expect("rejoins");
    assert_eq!(store.grant(&after).expect("read"), None);
    let view = store.read_domain("rack-3").expect("read").expect("budget");
    let a = view.nodes.iter().find(|n| n.node == "a").expect("node a");
    assert_eq!(a.record.map(|r| r.lease), Some(after.lease));
    assert_eq!(
        a.grant, None,
        "the old lease's grant is not counted as the node's"
    );
}

#[test]
fn the_store_answers_through_a_killed_member() {
    let Some(mut cluster) = EtcdCluster::start(3) else {
        return;
    };
    let store = EtcdFleet::connect(&cluster.endpoints(), TIMEOUT).expect("connects");
    store.put_budget(&budget("rack-4")).expect("budget");
    let leader = store
        .campaign("rack-4", "c", Duration::from_secs(30))
        .expect("campaign")
        .expect("leads");
    for member in 0..3 {
        cluster.kill(member);
        // Two of three keep a quorum: every operation still succeeds (after an election
        // where the killed member led).
        assert!(
            eventually(Duration::from_secs(10), || store
                .renew_leadership(&leader)
                .unwrap_or(false)),
            "renewal with member {member} down"
        );
        let view = store.read_domain("rack-4").expect("read").expect("budget");
        assert_eq!(view.budget, budget("rack-4"));
        cluster.restart(member);
    }
}

#[test]
fn a_budget_that_breaks_a_rule_is_refused_before_it_is_written() {
    let Some(cluster) = EtcdCluster::start(1) else {
        return;
    };
    let store = EtcdFleet::connect(&cluster.endpoints(), TIMEOUT).expect("connects");
    let mut bad = budget("rack-5");
    bad.uncontrolled_w = 9000.0;
    let error = store
        .put_budget(&bad)
        .expect_err("reserves exceed")
        .to_string();
    assert!(error.contains("every node cut off at once"), "{error}");
    assert!(store.read_domain("rack-5").expect("read").is_none());
}

#[test]
fn a_cut_off_node_drops_to_its_reserve_before_its_lease_can_lapse() {
    use tokwatt_fleet::{Allowance, NodeConfig, NodeLink};
    let Some(cluster) = EtcdCluster::start(1) else {
        return;
    };
    let store = EtcdFleet::connect(&cluster.endpoints(), TIMEOUT).expect("connects");
    store.put_budget(&budget("rack-6")).expect("budget");
    let leader = store
        .campaign("rack-6", "c", Duration::from_secs(30))
        .expect("campaign")
        .expect("leads");
    let mut link = NodeLink::new(NodeConfig {
        domain: "rack-6".into(),
        node: "a".into(),
        reserve_w: 1000.0,
        ttl: Duration::from_secs(3),
        margin: Duration::from_secs(1),
    });
    let in_force = report(1000.0);
    link.exchange(&store, &in_force);
    let session = link.session().cloned().expect("joined");
    assert_eq!(link.allowance(Instant::now()), Allowance::Reserve(1000.0));
    let write = [GrantWrite {
        node: "a",
        lease: session.lease,
        grant: grant(1, 4000.0),
    }];
    assert_eq!(
        store
            .write_grants(&leader, None, &write, &[])
            .expect("write"),
        Written::Done
    );
    link.exchange(&store, &in_force);
    assert_eq!(
        link.allowance(Instant::now()),
        Allowance::Granted(grant(1, 4000.0))
    );

    // The node is cut off from etcd: its own client reaches no member. It keeps the
    // grant until its deadline, then holds its reserve; the coordinator, still
    // connected, sees the node's record go only after that.
    let dead = format!("http://127.0.0.1:{}", free_port());
    let cut_off = EtcdFleet::connect(&[dead], Duration::from_millis(200)).expect("client");
    let start = Instant::now();
    let mut dropped = None;
    let mut lapsed = None;
    while start.elapsed() < Duration::from_secs(15) && lapsed.is_none() {
        link.exchange(&cut_off, &in_force);
        let now = Instant::now();
        if dropped.is_none() && link.allowance(now) == Allowance::Reserve(1000.0) {
            dropped = Some(now);
        }
        let view = store.read_domain("rack-6").expect("read").expect("budget");
        if view
            .nodes
            .iter()
            .any(|n| n.node == "a" && n.record.is_none())
        {
            lapsed = Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let (dropped, lapsed) = (
        dropped.expect("the node dropped"),
        lapsed.expect("the lease lapsed"),
    );
    assert!(
        dropped < lapsed,
        "the node held its grant until {:?}, after its lease lapsed at {:?}",
        dropped - start,
        lapsed - start
    );
    // Back in touch: the lease is gone, so it joins again, at its reserve, no grant.
    link.exchange(&store, &in_force);
    link.exchange(&store, &in_force);
    assert_eq!(link.allowance(Instant::now()), Allowance::Reserve(1000.0));
    assert_ne!(link.session().map(|s| s.lease), Some(session.lease));
}

#[test]
fn a_node_joins_only_where_the_budget_names_it_and_holds_the_lower_reserve() {
    use tokwatt_fleet::{Allowance, LinkState, NodeConfig, NodeLink};
    let Some(cluster) = EtcdCluster::start(1) else {
        return;
    };
    let store = EtcdFleet::connect(&cluster.endpoints(), TIMEOUT).expect("connects");
    let config = |node: &str, reserve_w: f64| NodeConfig {
        domain: "rack-7".into(),
        node: node.into(),
        reserve_w,
        ttl: Duration::from_secs(10),
        margin: Duration::from_secs(3),
    };
    // No budget yet: the node does not join, and holds its configured reserve.
    let mut stranger = NodeLink::new(config("z", 1500.0));
    stranger.exchange(&store, &report(1000.0));
    assert!(stranger.session().is_none());
    store.put_budget(&budget("rack-7")).expect("budget");
    stranger.exchange(&store, &report(1000.0));
    match stranger.state() {
        LinkState::Apart(why) => assert!(why.contains("does not name node `z`"), "{why}"),
        LinkState::Live => panic!("a node the budget does not name joined"),
    }
    // Named, with a configured reserve above the budget's 1000 W: it holds 1000 W.
    let mut named = NodeLink::new(config("a", 1500.0));
    assert_eq!(named.allowance(Instant::now()), Allowance::Reserve(1500.0));
    named.exchange(&store, &report(1000.0));
    assert!(named.session().is_some());
    assert_eq!(named.allowance(Instant::now()), Allowance::Reserve(1000.0));
}

#[test]
fn a_hold_outlives_the_nodes_lease_and_a_release_cannot_overwrite_a_newer_one() {
    let Some(cluster) = EtcdCluster::start(1) else {
        return;
    };
    let store = EtcdFleet::connect(&cluster.endpoints(), TIMEOUT).expect("connects");
    store.put_budget(&budget("rack-8")).expect("budget");
    let leader = store
        .campaign("rack-8", "c", Duration::from_secs(30))
        .expect("campaign")
        .expect("leads");
    let node = store
        .join("rack-8", "a", Duration::from_secs(2), &report(1000.0))
        .expect("joins");
    // The leader writes a's grant and its hold in one transaction.
    let held = Hold {
        boot: 0,
        watts: 4000.0,
        fence: None,
        default_w: 4800.0,
        released: false,
    };
    let grants = [GrantWrite {
        node: "a",
        lease: node.lease,
        grant: grant(1, 4000.0),
    }];
    let holds = [HoldWrite {
        node: "a",
        hold: held,
    }];
    assert_eq!(
        store
            .write_grants(&leader, None, &grants, &holds)
            .expect("write"),
        Written::Done
    );
    let hold_of = |node: &str| {
        let view = store.read_domain("rack-8").expect("read").expect("budget");
        view.nodes
            .into_iter()
            .find(|n| n.node == node)
            .and_then(|n| n.hold)
    };
    let first = hold_of("a").expect("a hold");
    assert_eq!(first.hold, held);

    // A deposed leader writes no hold either.
    store.resign(&leader).expect("resign");
    let higher = [HoldWrite {
        node: "a",
        hold: Hold {
            watts: 1000.0,
            ..held
        },
    }];
    assert_eq!(
        store
            .write_grants(&leader, None, &[], &higher)
            .expect("fenced"),
        Written::Deposed
    );
    let leader = store
        .campaign("rack-8", "c2", Duration::from_secs(30))
        .expect("campaign")
        .expect("leads");

    // The node stops renewing: its record and grant go with its lease, its hold stays,
    // and the ledger charges it what its GPUs may still hold (no fence: the higher of
    // its hold and its board defaults), not its reserve.
    assert!(
        eventually(Duration::from_secs(10), || {
            let view = store.read_domain("rack-8").expect("read").expect("budget");
            view.nodes
                .iter()
                .any(|n| n.node == "a" && n.record.is_none() && n.grant.is_none())
        }),
        "the lapsed node's lease went"
    );
    let view = store.read_domain("rack-8").expect("read").expect("budget");
    let ledger = Ledger::from_view(view);
    let a = &ledger.entries[0];
    assert_eq!(a.hold.map(|h| h.hold), Some(held));
    assert_eq!((a.charged_w, a.why), (4800.0, Why::SilentUnproven));
    assert_eq!(a.stranded_w, 3800.0);

    // An operator reads the hold; the leader rewrites it before the release lands: the
    // release is refused, and the leader's hold stands.
    let released = Hold {
        watts: 1000.0,
        released: true,
        ..held
    };
    let rewritten = Hold {
        watts: 4500.0,
        ..held
    };
    let operator = ReleaseProof {
        source: ProofSource::Operator,
        by: "alice@ops-1".into(),
        caps_w: Vec::new(),
        sum_w: 1000.0,
        at_unix_ms: 0,
        boot: 0,
        detail: "checked nvidia-smi: 8 x 125 W".into(),
    };
    assert_eq!(
        store
            .write_grants(
                &leader,
                None,
                &[],
                &[HoldWrite {
                    node: "a",
                    hold: rewritten
                }]
            )
            .expect("write"),
        Written::Done
    );
    assert!(
        !store
            .release("rack-8", "a", &released, first.mod_revision, &operator)
            .expect("release"),
        "a release over a hold it did not read"
    );
    let second = hold_of("a").expect("a hold");
    assert_eq!(second.hold, rewritten);
    // Read again, it lands.
    assert!(
        store
            .release("rack-8", "a", &released, second.mod_revision, &operator)
            .expect("release")
    );
    let view = store.read_domain("rack-8").expect("read").expect("budget");
    let ledger = Ledger::from_view(view);
    assert_eq!(
        (ledger.entries[0].charged_w, ledger.entries[0].why),
        (1000.0, Why::Released)
    );
    // Who released it, and why, is kept with the release (the refused one left none).
    let records: Vec<_> = ledger.entries[0]
        .proofs
        .iter()
        .filter(|p| p.proof.source == ProofSource::Operator)
        .collect();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0].proof, operator);
    assert!(
        tokwatt_fleet::show::why_words(&ledger.entries[0]).contains("alice@ops-1"),
        "{}",
        tokwatt_fleet::show::why_words(&ledger.entries[0])
    );

    // A live node cannot be released, whatever hold the operator read.
    let b = store
        .join("rack-8", "b", Duration::from_secs(30), &report(1000.0))
        .expect("joins");
    assert!(
        !store
            .release("rack-8", "b", &released, 0, &operator)
            .expect("release"),
        "a live node released"
    );
    assert_eq!(hold_of("b"), None);
    store.leave(&b).expect("leaves");

    // a comes back: its join ends the release, in the same transaction; the hold's
    // watts stay until the leader rewrites them.
    store
        .join("rack-8", "a", Duration::from_secs(30), &report(1000.0))
        .expect("rejoins");
    let back = hold_of("a").expect("a hold");
    assert!(!back.hold.released, "{back:?}");
    assert_eq!(back.hold.watts, 1000.0);
}

/// A node that declares a fence covering stops and reboots, asking for its maximum.
fn fenced_report(acked_generation: u64, caps_in_force_w: f64) -> NodeReport {
    NodeReport {
        acked_generation,
        fence: Some(Fence {
            kind: FenceKind::Heartbeat,
            deadline_s: 5.0,
            covers_reboot: true,
        }),
        default_w: 5600.0,
        requested_w: 5600.0,
        ..report(caps_in_force_w)
    }
}

/// `node`'s boot unit's record: the reserve in force at its boot (of any boot: the
/// nodes here report none), which proves a reboot lands at the reserve.
fn boot_record(store: &EtcdFleet, domain: &str, node: &str) {
    store
        .prove(
            domain,
            node,
            &ReleaseProof::of_caps(
                ProofSource::Boot,
                format!("the boot unit of {node}"),
                vec![1000.0],
                0,
                0,
            ),
            Duration::from_secs(600),
        )
        .expect("a boot record");
}

#[test]
fn a_freeze_is_exclusive_holds_the_grants_still_cuts_and_lapses_with_its_lease() {
    use tokwatt_fleet::{
        Coordinator, CoordinatorConfig, Freeze, FreezeOutcome, FrozenWrite, MarginalAllocator,
    };
    let Some(cluster) = EtcdCluster::start(1) else {
        return;
    };
    let store = EtcdFleet::connect(&cluster.endpoints(), TIMEOUT).expect("connects");
    store.put_budget(&budget("rack-f")).expect("budget");
    boot_record(&store, "rack-f", "a");
    boot_record(&store, "rack-f", "b");
    let a = store
        .join(
            "rack-f",
            "a",
            Duration::from_secs(30),
            &fenced_report(0, 1000.0),
        )
        .expect("joins");
    let b = store
        .join(
            "rack-f",
            "b",
            Duration::from_secs(30),
            &fenced_report(0, 1000.0),
        )
        .expect("joins");
    let mut coordinator = Coordinator::new(
        CoordinatorConfig {
            domain: "rack-f".into(),
            name: "c".into(),
            ttl: Duration::from_secs(30),
        },
        Box::new(MarginalAllocator::default()),
    );
    // Each node acknowledges its grant and reports the caps it applied.
    let settle = |coordinator: &mut Coordinator| {
        for _ in 0..4 {
            coordinator.round(&store).expect("a round");
            for node in [&a, &b] {
                if let Some(g) = store.grant(node).expect("grant") {
                    store
                        .report(node, &fenced_report(g.generation, g.watts))
                        .expect("report");
                }
            }
        }
    };
    let grants = || {
        let view = store.read_domain("rack-f").expect("read").expect("budget");
        (
            view.nodes
                .iter()
                .map(|n| n.grant.expect("granted"))
                .collect::<Vec<_>>(),
            view.freeze,
        )
    };
    // Not frozen: both ask for their maximum and share the 9.5 kW.
    settle(&mut coordinator);
    let (before, freeze) = grants();
    assert_eq!(freeze, None);
    let total: f64 = before.iter().map(|g| g.watts).sum();
    assert!((total - 9500.0).abs() < 1.0, "{before:?}");

    // Frozen by an experiment: a second freeze is refused, naming who holds it.
    let by = Freeze {
        by: "tokwatt fleet ab on host-1 (pid 7)".into(),
        why: "an A/B of two policies".into(),
    };
    let FreezeOutcome::Frozen(session) = store
        .freeze("rack-f", &by, Duration::from_secs(3))
        .expect("freeze")
    else {
        panic!("the first freeze holds");
    };
    assert_eq!(
        store
            .freeze(
                "rack-f",
                &Freeze {
                    by: "another".into(),
                    why: "x".into()
                },
                Duration::from_secs(3)
            )
            .expect("freeze"),
        FreezeOutcome::HeldBy(by.clone())
    );
    let (_, freeze) = grants();
    let freeze = freeze.expect("the domain reads frozen");
    assert_eq!((freeze.freeze, freeze.lease), (by.clone(), session.lease));

    // The budget raised: unfrozen, both would be raised into it; frozen, nothing moves.
    let mut raised = budget("rack-f");
    raised.budget_w = 12_000.0;
    store.put_budget(&raised).expect("budget");
    assert!(store.renew_freeze(&session).expect("renew"));
    settle(&mut coordinator);
    assert_eq!(grants().0, before, "the grants are held while frozen");

    // The budget lowered below what is held: cut at once, every node alike, and marked.
    let mut lowered = budget("rack-f");
    lowered.budget_w = 8500.0;
    store.put_budget(&lowered).expect("budget");
    assert!(store.renew_freeze(&session).expect("renew"));
    settle(&mut coordinator);
    let (cut, _) = grants();
    let total: f64 = cut.iter().map(|g| g.watts).sum();
    assert!((total - 8000.0).abs() < 1.0, "{cut:?}");
    for (was, now) in before.iter().zip(&cut) {
        assert_eq!(now.under_freeze, Some(FrozenWrite::BudgetCut), "{now:?}");
        assert!(now.watts < was.watts);
    }

    // Not renewed, the freeze lapses by itself (an experiment that died), and grants
    // move again: the budget raised back, the nodes are raised into it.
    store.put_budget(&raised).expect("budget");
    assert!(
        eventually(Duration::from_secs(15), || grants().1.is_none()),
        "the freeze lapsed with its lease"
    );
    assert!(!store.renew_freeze(&session).expect("renew"));
    settle(&mut coordinator);
    let (after, _) = grants();
    assert!(
        after
            .iter()
            .zip(&cut)
            .all(|(now, was)| now.watts > was.watts),
        "{after:?}"
    );
    assert!(after.iter().all(|g| g.under_freeze.is_none()));

    // A freeze thawed goes at once, and another may freeze the domain.
    let FreezeOutcome::Frozen(session) = store
        .freeze("rack-f", &by, Duration::from_secs(30))
        .expect("freeze")
    else {
        panic!("frozen");
    };
    store.thaw(&session).expect("thaw");
    assert_eq!(grants().1, None);
    assert!(matches!(
        store
            .freeze("rack-f", &by, Duration::from_secs(30))
            .expect("freeze"),
        FreezeOutcome::Frozen(_)
    ));
}

#[test]
fn a_round_planned_before_a_freeze_or_after_a_thaw_writes_nothing() {
    use tokwatt_fleet::{Freeze, FreezeOutcome};
    let Some(cluster) = EtcdCluster::start(1) else {
        return;
    };
    let store = EtcdFleet::connect(&cluster.endpoints(), TIMEOUT).expect("connects");
    store.put_budget(&budget("rack-g")).expect("budget");
    let leader = store
        .campaign("rack-g", "c", Duration::from_secs(30))
        .expect("campaign")
        .expect("leads");
    let node = store
        .join("rack-g", "a", Duration::from_secs(30), &report(1000.0))
        .expect("joins");
    let write = |generation: u64| {
        [GrantWrite {
            node: "a",
            lease: node.lease,
            grant: grant(generation, 1000.0 + generation as f64),
        }]
    };
    // A round reads the domain unfrozen; an experiment freezes it before the round writes.
    let read = store.read_domain("rack-g").expect("read").expect("budget");
    assert_eq!(read.freeze, None);
    let FreezeOutcome::Frozen(session) = store
        .freeze(
            "rack-g",
            &Freeze {
                by: "an experiment".into(),
                why: "a test".into(),
            },
            Duration::from_secs(30),
        )
        .expect("freeze")
    else {
        panic!("frozen");
    };
    assert_eq!(
        store
            .write_grants(&leader, read.freeze.as_ref(), &write(1), &[])
            .expect("write"),
        Written::FreezeChanged,
        "planned unfrozen, it must not land frozen"
    );
    assert_eq!(store.grant(&node).expect("grant"), None);
    // Planned under the freeze it read, it lands.
    let frozen = store.read_domain("rack-g").expect("read").expect("budget");
    assert!(frozen.freeze.is_some());
    assert_eq!(
        store
            .write_grants(&leader, frozen.freeze.as_ref(), &write(2), &[])
            .expect("write"),
        Written::Done
    );
    // Thawed: a round planned under the freeze writes nothing after it either.
    store.thaw(&session).expect("thaw");
    assert_eq!(
        store
            .write_grants(&leader, frozen.freeze.as_ref(), &write(3), &[])
            .expect("write"),
        Written::FreezeChanged
    );
    assert_eq!(store.grant(&node).expect("grant"), Some(grant(2, 1002.0)));
    // Deposed is still told apart.
    store.resign(&leader).expect("resign");
    assert_eq!(
        store
            .write_grants(&leader, None, &write(4), &[])
            .expect("write"),
        Written::Deposed
    );
}

/// A round of many nodes: every grant and its hold, more operations than etcd takes in
/// one transaction (128 by default), land in transactions of at most that many, each
/// node's pair in one (the 125-node scale run's coordinator failed every round before).
#[test]
fn a_round_of_more_writes_than_one_transaction_takes_lands_whole() {
    let Some(cluster) = EtcdCluster::start(1) else {
        return;
    };
    let store = EtcdFleet::connect(&cluster.endpoints(), TIMEOUT).expect("connects");
    let names: Vec<String> = (0..150).map(|i| format!("n{i:03}")).collect();
    let domain = DomainBudget {
        domain: "row-9".into(),
        budget_w: 1_000_000.0,
        uncontrolled_w: 0.0,
        nodes: names
            .iter()
            .map(|n| NodeBudget {
                node: n.clone(),
                reserve_w: 1000.0,
                max_w: 5600.0,
                priority: 0,
                fenced: true,
                default_w: None,
            })
            .collect(),
    };
    store.put_budget(&domain).expect("budget");
    let sessions: Vec<_> = names
        .iter()
        .map(|n| {
            store
                .join("row-9", n, Duration::from_secs(60), &report(1000.0))
                .expect("joins")
        })
        .collect();
    let leader = store
        .campaign("row-9", "c", Duration::from_secs(30))
        .expect("campaign")
        .expect("leads");
    let grants: Vec<GrantWrite<'_>> = names
        .iter()
        .zip(&sessions)
        .map(|(n, s)| GrantWrite {
            node: n,
            lease: s.lease,
            grant: grant(1, 3000.0),
        })
        .collect();
    let held = Hold {
        boot: 0,
        watts: 3000.0,
        fence: None,
        default_w: 5600.0,
        released: false,
    };
    let holds: Vec<HoldWrite<'_>> = names
        .iter()
        .map(|n| HoldWrite {
            node: n,
            hold: held,
        })
        .collect();
    assert!(grants.len() + holds.len() > tokwatt_fleet::etcd::MAX_TXN_OPS);
    assert_eq!(
        store
            .write_grants(&leader, None, &grants, &holds)
            .expect("written"),
        Written::Done
    );
    let view = store.read_domain("row-9").expect("read").expect("budget");
    let budgeted: Vec<_> = view
        .nodes
        .iter()
        .filter(|n| names.contains(&n.node))
        .collect();
    assert_eq!(budgeted.len(), 150);
    for node in budgeted {
        assert_eq!(node.grant.map(|g| g.watts), Some(3000.0), "{}", node.node);
        assert_eq!(node.hold.map(|h| h.hold), Some(held), "{}", node.node);
    }
}

/// A proof of release on a real etcd: written under a lease of its writer's own (not the
/// node's), it frees a silent node's watts only when written after the node's hold (the
/// leader's last grant), and once its lease lapses the node is charged again.
#[test]
fn a_silent_node_is_freed_only_by_a_proof_written_after_its_last_grant() {
    let Some(cluster) = EtcdCluster::start(1) else {
        return;
    };
    let store = EtcdFleet::connect(&cluster.endpoints(), TIMEOUT).expect("connects");
    store.put_budget(&budget("rack-p")).expect("budget");
    let leader = store
        .campaign("rack-p", "c", Duration::from_secs(30))
        .expect("campaign")
        .expect("leads");
    let fence_record = |sum_w: f64| ReleaseProof {
        source: ProofSource::Fence,
        by: "tokwatt fence on a".into(),
        caps_w: vec![sum_w / 2.0, sum_w / 2.0],
        sum_w,
        at_unix_ms: 0,
        boot: 0,
        detail: String::new(),
    };
    // A record from before the grant: it proves nothing of what the node did after.
    let early = store
        .prove(
            "rack-p",
            "a",
            &fence_record(1000.0),
            Duration::from_secs(60),
        )
        .expect("proves");
    let node = store
        .join(
            "rack-p",
            "a",
            Duration::from_secs(2),
            &fenced_report(0, 1000.0),
        )
        .expect("joins");
    assert_eq!(
        store
            .write_grants(
                &leader,
                None,
                &[GrantWrite {
                    node: "a",
                    lease: node.lease,
                    grant: grant(1, 4000.0),
                }],
                &[HoldWrite {
                    node: "a",
                    hold: Hold {
                        watts: 4000.0,
                        fence: None,
                        default_w: 0.0,
                        released: false,
                        boot: 0,
                    },
                }],
            )
            .expect("write"),
        Written::Done
    );
    let ledger = || Ledger::from_view(store.read_domain("rack-p").expect("read").expect("budget"));
    assert!(
        eventually(Duration::from_secs(10), || !ledger().entries[0].live()),
        "the node's lease lapsed"
    );
    let silent = ledger();
    let a = &silent.entries[0];
    assert!(a.hold.is_some_and(|h| h.mod_revision > early));
    assert_eq!((a.charged_w, a.why), (5600.0, Why::SilentUnproven));

    // Its fence reads the caps back under the reserve and writes them down, under a
    // short lease of its own. No boot unit proved itself, so a reboot may still leave
    // the defaults (the budget's maximum, 5.6 kW): that much stays charged.
    let proven_at = store
        .prove("rack-p", "a", &fence_record(900.0), Duration::from_secs(2))
        .expect("proves");
    let proven = ledger();
    let a = &proven.entries[0];
    assert_eq!(a.why, Why::Proven(ProofSource::Fence));
    assert_eq!(a.proof.as_ref().map(|p| p.mod_revision), Some(proven_at));
    assert_ne!(a.proof.as_ref().map(|p| p.lease), Some(node.lease));
    assert_eq!(a.charged_w, 5600.0, "a reboot may still leave the defaults");
    // Its lease lapses (a fence gone for good, a stale reading): no proof any more.
    assert!(
        eventually(Duration::from_secs(10), || ledger().entries[0].why
            == Why::SilentUnproven),
        "the proof lapsed with its writer's lease"
    );

    // Its boot unit's record (of any boot: the node reported none) proves a reboot lands
    // at the reserve: now the node is charged the fence's reading, at least its reserve.
    store
        .prove(
            "rack-p",
            "a",
            &ReleaseProof {
                source: ProofSource::Boot,
                by: "tokwatt fence --once on a".into(),
                ..fence_record(1000.0)
            },
            Duration::from_secs(60),
        )
        .expect("proves");
    let both = ledger();
    assert_eq!(both.entries[0].charged_w, 1000.0);
    assert!(both.entries[0].boot_proven);
    // The boot record is the newest proof now; it proves the same reserve.
    assert_eq!(both.entries[0].why, Why::Proven(ProofSource::Boot));
    assert_eq!(both.entries[0].stranded_w, 0.0);

    // A boot unit keeps one record per boot: the next boot's does not replace this one,
    // which still proves the boot the node reports until its agent joins again.
    for boot in [5, 6] {
        store
            .prove(
                "rack-p",
                "a",
                &ReleaseProof {
                    source: ProofSource::Boot,
                    boot,
                    ..fence_record(1000.0)
                },
                Duration::from_secs(60),
            )
            .expect("proves");
    }
    let boots: Vec<u64> = ledger().entries[0]
        .proofs
        .iter()
        .filter(|p| p.proof.source == ProofSource::Boot)
        .map(|p| p.proof.boot)
        .collect();
    assert_eq!(boots.len(), 3, "{boots:?}");
    assert!(boots.contains(&5) && boots.contains(&6), "{boots:?}");
}
