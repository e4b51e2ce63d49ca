//! Coordinators and nodes on a real three-member etcd cluster: the leader killed, the
//! budget lowered. Nodes are threads with a NodeLink each and GPUs that follow their
//! allowance at once; a checker samples the caps in force every 20 ms.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokwatt_fleet::etcd::EtcdFleet;
use tokwatt_fleet::{
    Coordinator, CoordinatorConfig, DomainBudget, Fence, FenceKind, FleetStore, MarginalAllocator,
    NodeBudget, NodeConfig, NodeLink, Round,
};
use tokwatt_test_support::{EtcdCluster, eventually};

const NODES: usize = 4;

fn budget(budget_w: f64) -> DomainBudget {
    DomainBudget {
        domain: "row-1".into(),
        budget_w,
        uncontrolled_w: 0.0,
        nodes: (0..NODES)
            .map(|i| NodeBudget {
                node: format!("node-{i}"),
                reserve_w: 1000.0,
                max_w: 5600.0,
                priority: 0,
                // The nodes below declare a fence covering stops and reboots.
                fenced: true,
                default_w: None,
            })
            .collect(),
    }
}

fn connect(cluster: &EtcdCluster) -> Arc<EtcdFleet> {
    Arc::new(EtcdFleet::connect(&cluster.endpoints(), Duration::from_secs(1)).expect("connects"))
}

/// A coordinator replica on a thread: rounds every 200 ms until `stop` (no resignation:
/// a stop is a crash), recording when it took over.
fn coordinator(
    store: Arc<EtcdFleet>,
    name: &str,
    stop: Arc<AtomicBool>,
    took_over: Arc<Mutex<Vec<(String, Instant)>>>,
) -> std::thread::JoinHandle<()> {
    let name = name.to_owned();
    std::thread::spawn(move || {
        let mut coordinator = Coordinator::new(
            CoordinatorConfig {
                domain: "row-1".into(),
                name: name.clone(),
                ttl: Duration::from_secs(3),
            },
            Box::new(MarginalAllocator::default()),
        );
        while !stop.load(Ordering::Relaxed) {
            if let Ok(Round::Leader {
                took_over: true, ..
            }) = coordinator.round(store.as_ref())
            {
                took_over
                    .lock()
                    .expect("lock")
                    .push((name.clone(), Instant::now()));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    })
}

#[test]
fn the_caps_in_force_stay_within_the_budget_through_a_leader_killed_and_a_budget_lowered() {
    let Some(cluster) = EtcdCluster::start(3) else {
        return;
    };
    let store = connect(&cluster);
    store.put_budget(&budget(12_000.0)).expect("budget");
    // Each node's boot unit wrote its record: a reboot lands at the reserve.
    for i in 0..NODES {
        store
            .prove(
                "row-1",
                &format!("node-{i}"),
                &tokwatt_fleet::ReleaseProof::of_caps(
                    tokwatt_fleet::ProofSource::Boot,
                    format!("the boot unit of node-{i}"),
                    vec![1000.0],
                    0,
                    0,
                ),
                Duration::from_secs(600),
            )
            .expect("a boot record");
    }
    let done = Arc::new(AtomicBool::new(false));
    let in_force: Arc<Vec<Mutex<f64>>> = Arc::new((0..NODES).map(|_| Mutex::new(1000.0)).collect());

    // The nodes: each productive in its own measure, all wanting more watts.
    let nodes: Vec<_> = (0..NODES)
        .map(|i| {
            let store = connect(&cluster);
            let done = done.clone();
            let in_force = in_force.clone();
            std::thread::spawn(move || {
                let mut link = NodeLink::new(NodeConfig {
                    domain: "row-1".into(),
                    node: format!("node-{i}"),
                    reserve_w: 1000.0,
                    // A loaded two-core CI machine can starve a thread for a second:
                    // the margin covers that, as a node's covers a control tick.
                    ttl: Duration::from_secs(10),
                    margin: Duration::from_secs(3),
                });
                // These GPUs follow the allowance at once, the reserve included: as
                // fenced as a node can be.
                link.declare(
                    Some(Fence {
                        kind: FenceKind::Heartbeat,
                        deadline_s: 1.0,
                        covers_reboot: true,
                    }),
                    5600.0,
                );
                let mut last_exchange = Instant::now() - Duration::from_secs(1);
                while !done.load(Ordering::Relaxed) {
                    let allowance = link.allowance(Instant::now());
                    let watts = allowance.watts();
                    *in_force[i].lock().expect("lock") = watts;
                    if last_exchange.elapsed() >= Duration::from_millis(300) {
                        let tokens_per_s =
                            (10_000.0 + 2000.0 * i as f64) * (watts / 3000.0).powf(0.6);
                        let report =
                            link.report(&allowance, watts, watts * 0.95, tokens_per_s, true, 0.0);
                        link.exchange(store.as_ref(), &report);
                        last_exchange = Instant::now();
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        })
        .collect();

    // The checker: the caps in force, summed, every 20 ms.
    let peak = Arc::new(Mutex::new(Vec::<(Instant, f64)>::new()));
    let checker = {
        let done = done.clone();
        let in_force = in_force.clone();
        let peak = peak.clone();
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                let total: f64 = in_force.iter().map(|w| *w.lock().expect("lock")).sum();
                peak.lock().expect("lock").push((Instant::now(), total));
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };

    let took_over = Arc::new(Mutex::new(Vec::new()));
    let stop_first = Arc::new(AtomicBool::new(false));
    let first = coordinator(
        connect(&cluster),
        "c1",
        stop_first.clone(),
        took_over.clone(),
    );
    std::thread::sleep(Duration::from_millis(500));
    let stop_second = Arc::new(AtomicBool::new(false));
    let second = coordinator(
        connect(&cluster),
        "c2",
        stop_second.clone(),
        took_over.clone(),
    );

    let total = || {
        in_force
            .iter()
            .map(|w| *w.lock().expect("lock"))
            .sum::<f64>()
    };
    // Watts flow to the nodes (liveness, within a generous bound for a loaded machine).
    assert!(
        eventually(Duration::from_secs(30), || total() > 11_000.0),
        "the budget is not spent: {} W in force",
        total()
    );

    // The leader dies without resigning; the other replica takes over once its lease lapses.
    let killed = Instant::now();
    stop_first.store(true, Ordering::Relaxed);
    first.join().expect("first");
    let c2_took_over = || {
        took_over
            .lock()
            .expect("lock")
            .iter()
            .find(|(name, _)| name == "c2")
            .map(|(_, at)| *at)
    };
    assert!(
        eventually(Duration::from_secs(30), || c2_took_over().is_some()),
        "the second replica never took over"
    );
    let reaction = c2_took_over().map(|at| at - killed).expect("c2 took over");

    // The operator lowers the budget: the cuts land, and the sum stays under it.
    store.put_budget(&budget(8000.0)).expect("lower");
    let lowered = Instant::now();
    assert!(
        eventually(Duration::from_secs(30), || total() <= 8000.0 + 1e-6),
        "never within the lowered budget: {} W",
        total()
    );
    std::thread::sleep(Duration::from_secs(3));
    done.store(true, Ordering::Relaxed);
    stop_second.store(true, Ordering::Relaxed);
    second.join().expect("second");
    checker.join().expect("checker");
    for node in nodes {
        node.join().expect("node");
    }

    let samples = peak.lock().expect("lock").clone();
    let worst = samples.iter().map(|(_, w)| *w).fold(0.0, f64::max);
    assert!(
        worst <= 12_000.0 + 1e-6,
        "{worst} W in force, over the 12 kW budget"
    );
    // Settled for good: after the last sample over the lowered budget. (The sum also
    // dips while watts move between nodes: cuts land before the raises they pay for.)
    let settled = samples
        .iter()
        .rev()
        .find(|(at, total)| *at > lowered && *total > 8000.0 + 1e-6)
        .map_or(Duration::ZERO, |(at, _)| *at - lowered);
    let after: Vec<f64> = samples
        .iter()
        .filter(|(at, _)| *at > lowered + settled)
        .map(|(_, w)| *w)
        .collect();
    assert!(
        !after.is_empty() && after.iter().all(|w| *w <= 8000.0 + 1e-6),
        "the caps never settled within the lowered budget"
    );
    println!(
        "takeover after {reaction:?}; within the lowered budget after {settled:?}; peak {worst} W of 12000"
    );
}
