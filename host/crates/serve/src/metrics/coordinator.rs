//! The fleet coordinator's metrics (`tokwatt fleet coordinate --metrics ADDR`): whether
//! this replica leads, its rounds, and, from the leader only, the domain's ledger after
//! each round (the budget, what is charged, the headroom) and each node's grant, charge
//! and lease, and the watts stranded on silent nodes (charged above their reserve until
//! they report again, their fence's deadline passes, or an operator releases them), by
//! reason. A follower does not read the ledger, so it exports no ledger series: an
//! absent series, never a zero that would read as "nothing charged". With
//! `--off-node-fence`, the off-node fence's actions by outcome (counted by this replica
//! while it led; kept when it stops leading, as counters are).

use std::sync::{Mutex, MutexGuard, PoisonError};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokwatt_fleet::offnode::OffNodeCounts;
use tokwatt_fleet::{Ledger, Round};

use super::registry::{GaugeF64, TotalCounter};

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DomainLabels {
    domain: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct NodeLabels {
    domain: String,
    node: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabels {
    domain: String,
    node: String,
    /// Why the node is charged what it is (live, silent-unproven, proven, released,
    /// never-heard).
    reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct FreezeLabels {
    domain: String,
    /// Who froze the domain (empty while it is not frozen).
    by: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OffNodeLabels {
    domain: String,
    /// started, powered-off, failed, cancelled.
    outcome: &'static str,
}

/// The off-node fence's outcomes, as labelled.
const OFF_NODE_OUTCOMES: [&str; 4] = ["started", "powered-off", "failed", "cancelled"];

#[derive(Debug, Default)]
struct Families {
    leading: Family<DomainLabels, GaugeF64>,
    rounds: Family<DomainLabels, TotalCounter<u64>>,
    round_errors: Family<DomainLabels, TotalCounter<u64>>,
    takeovers: Family<DomainLabels, TotalCounter<u64>>,
    grants_written: Family<DomainLabels, TotalCounter<u64>>,
    available_watts: Family<DomainLabels, GaugeF64>,
    charged_watts: Family<DomainLabels, GaugeF64>,
    headroom_watts: Family<DomainLabels, GaugeF64>,
    live_nodes: Family<DomainLabels, GaugeF64>,
    unbudgeted_nodes: Family<DomainLabels, GaugeF64>,
    node_grant_watts: Family<NodeLabels, GaugeF64>,
    node_charged_watts: Family<NodeLabels, GaugeF64>,
    node_lease_live: Family<NodeLabels, GaugeF64>,
    stranded_watts: Family<DomainLabels, GaugeF64>,
    node_stranded_watts: Family<ReasonLabels, GaugeF64>,
    node_fence_missing: Family<NodeLabels, GaugeF64>,
    frozen: Family<FreezeLabels, GaugeF64>,
    off_node_actions: Family<OffNodeLabels, TotalCounter<u64>>,
    /// The off-node fence's counts as last seen (the counters move by the difference).
    off_node_seen: OffNodeCounts,
}

/// Every family the coordinator exports: name, type, help (for the book and its test).
pub const COORDINATOR_METRICS: &[(&str, &str, &str)] = &[
    (
        "tokwatt_fleet_coordinator_leading",
        "gauge",
        "1 while this replica leads the domain, else 0",
    ),
    (
        "tokwatt_fleet_coordinator_rounds_total",
        "counter",
        "Rounds this replica ran (as leader or follower)",
    ),
    (
        "tokwatt_fleet_coordinator_round_errors_total",
        "counter",
        "Rounds that failed on the store (tried again next period)",
    ),
    (
        "tokwatt_fleet_coordinator_takeovers_total",
        "counter",
        "Times this replica took the leadership",
    ),
    (
        "tokwatt_fleet_coordinator_grants_written_total",
        "counter",
        "Grants this replica wrote while leading",
    ),
    (
        "tokwatt_fleet_available_watts",
        "gauge",
        "The domain's budget less its uncontrolled draw (leader only)",
    ),
    (
        "tokwatt_fleet_charged_watts",
        "gauge",
        "The most the domain's nodes may have in force after the round's grants (leader only)",
    ),
    (
        "tokwatt_fleet_headroom_watts",
        "gauge",
        "Available less charged: what may still be granted (leader only; negative while a lowered budget's cuts are unacknowledged)",
    ),
    (
        "tokwatt_fleet_live_nodes",
        "gauge",
        "Nodes with a live lease (leader only)",
    ),
    (
        "tokwatt_fleet_unbudgeted_nodes",
        "gauge",
        "Nodes that joined under a name the budget does not list (leader only)",
    ),
    (
        "tokwatt_fleet_node_grant_watts",
        "gauge",
        "Each budgeted node's grant after the round (leader only; absent for a node without one)",
    ),
    (
        "tokwatt_fleet_node_charged_watts",
        "gauge",
        "What the ledger charges each budgeted node (leader only)",
    ),
    (
        "tokwatt_fleet_node_lease_live",
        "gauge",
        "1 where the node's lease is live (leader only)",
    ),
    (
        "tokwatt_fleet_stranded_watts",
        "gauge",
        "Watts charged to silent nodes above their reserves: what their GPUs may still hold, given to no other node until each reports again, its fence's deadline passes, or an operator releases it (leader only)",
    ),
    (
        "tokwatt_fleet_node_stranded_watts",
        "gauge",
        "What each budgeted node is charged above its reserve while silent (0 while live), labelled with the reason it is charged what it is: live, silent-unproven, proven, released, never-heard (leader only)",
    ),
    (
        "tokwatt_fleet_node_fence_missing",
        "gauge",
        "1 where the budget calls the node fenced but it declares no fence covering stops and reboots: it is charged as unfenced, at its GPUs' board defaults once silent (leader only)",
    ),
    (
        "tokwatt_fleet_frozen",
        "gauge",
        "1 while the domain is frozen, labelled with who froze it (by): every grant is held where it is, only the cuts the budget needs and a joining node's reserve are written (an experiment such as tokwatt fleet ab holds it); 0, with by empty, while it is not (leader only)",
    ),
    (
        "tokwatt_fleet_off_node_actions_total",
        "counter",
        "Off-node fence actions this replica ran (--off-node-fence: a frozen host powered off through its BMC), by outcome: started; powered-off (read back off, its proof written); failed (nothing written, tried again after retry_after_s); cancelled (the node reported again, was proven or released, or this replica stopped leading)",
    ),
];

/// The coordinator's metrics, fed once a round.
#[derive(Debug)]
pub struct CoordinatorMetrics {
    domain: DomainLabels,
    inner: Mutex<(Registry, Families)>,
}

impl CoordinatorMetrics {
    pub fn new(domain: &str) -> Self {
        let families = Families::default();
        let mut registry = Registry::default();
        let help = |name: &str| {
            COORDINATOR_METRICS
                .iter()
                .find(|(listed, ..)| *listed == name)
                .map_or("", |(_, _, help)| *help)
        };
        let f = &families;
        for (name, family) in [
            ("tokwatt_fleet_coordinator_leading", &f.leading),
            ("tokwatt_fleet_available_watts", &f.available_watts),
            ("tokwatt_fleet_charged_watts", &f.charged_watts),
            ("tokwatt_fleet_headroom_watts", &f.headroom_watts),
            ("tokwatt_fleet_live_nodes", &f.live_nodes),
            ("tokwatt_fleet_unbudgeted_nodes", &f.unbudgeted_nodes),
            ("tokwatt_fleet_stranded_watts", &f.stranded_watts),
        ] {
            registry.register(name, help(name), family.clone());
        }
        for (name, family) in [
            ("tokwatt_fleet_coordinator_rounds_total", &f.rounds),
            (
                "tokwatt_fleet_coordinator_round_errors_total",
                &f.round_errors,
            ),
            ("tokwatt_fleet_coordinator_takeovers_total", &f.takeovers),
            (
                "tokwatt_fleet_coordinator_grants_written_total",
                &f.grants_written,
            ),
        ] {
            registry.register(name, help(name), family.clone());
        }
        for (name, family) in [
            ("tokwatt_fleet_node_grant_watts", &f.node_grant_watts),
            ("tokwatt_fleet_node_charged_watts", &f.node_charged_watts),
            ("tokwatt_fleet_node_lease_live", &f.node_lease_live),
            ("tokwatt_fleet_node_fence_missing", &f.node_fence_missing),
        ] {
            registry.register(name, help(name), family.clone());
        }
        registry.register(
            "tokwatt_fleet_frozen",
            help("tokwatt_fleet_frozen"),
            f.frozen.clone(),
        );
        registry.register(
            "tokwatt_fleet_node_stranded_watts",
            help("tokwatt_fleet_node_stranded_watts"),
            f.node_stranded_watts.clone(),
        );
        registry.register(
            "tokwatt_fleet_off_node_actions_total",
            help("tokwatt_fleet_off_node_actions_total"),
            f.off_node_actions.clone(),
        );
        let domain = DomainLabels {
            domain: domain.to_owned(),
        };
        families.leading.get_or_create(&domain).set(0.0);
        for family in [
            &families.rounds,
            &families.round_errors,
            &families.takeovers,
            &families.grants_written,
        ] {
            family.get_or_create(&domain).inc_by(0);
        }
        for outcome in OFF_NODE_OUTCOMES {
            families
                .off_node_actions
                .get_or_create(&OffNodeLabels {
                    domain: domain.domain.clone(),
                    outcome,
                })
                .inc_by(0);
        }
        Self {
            domain,
            inner: Mutex::new((registry, families)),
        }
    }

    /// After each round: what it was, or the store's error.
    pub fn observe<E>(&self, round: &Result<Round, E>) {
        let inner = self.lock();
        let families = &inner.1;
        let domain = &self.domain;
        families.rounds.get_or_create(domain).inc_by(1);
        match round {
            Ok(Round::Leader {
                took_over,
                grants_written,
                ledger,
                ..
            }) => {
                families.leading.get_or_create(domain).set(1.0);
                if *took_over {
                    families.takeovers.get_or_create(domain).inc_by(1);
                }
                families
                    .grants_written
                    .get_or_create(domain)
                    .inc_by(*grants_written as u64);
                self.observe_ledger(families, ledger);
            }
            Ok(Round::Follower) => {
                families.leading.get_or_create(domain).set(0.0);
                self.clear_ledger(families);
            }
            Err(_) => {
                // Whether it still leads is not known: its lease may have lapsed.
                families.round_errors.get_or_create(domain).inc_by(1);
            }
        }
    }

    /// After each round, where an off-node fence is configured: its counts since it
    /// started (the counters move by what changed).
    pub fn observe_off_node(&self, counts: &OffNodeCounts) {
        let mut inner = self.lock();
        let families = &mut inner.1;
        let seen = families.off_node_seen;
        for (outcome, now, before) in [
            ("started", counts.started, seen.started),
            ("powered-off", counts.powered_off, seen.powered_off),
            ("failed", counts.failed, seen.failed),
            ("cancelled", counts.cancelled, seen.cancelled),
        ] {
            families
                .off_node_actions
                .get_or_create(&OffNodeLabels {
                    domain: self.domain.domain.clone(),
                    outcome,
                })
                .inc_by(now.saturating_sub(before));
        }
        families.off_node_seen = *counts;
    }

    fn observe_ledger(&self, families: &Families, ledger: &Ledger) {
        let domain = &self.domain;
        families
            .available_watts
            .get_or_create(domain)
            .set(ledger.budget.available_w());
        families
            .charged_watts
            .get_or_create(domain)
            .set(ledger.charged_w());
        families
            .headroom_watts
            .get_or_create(domain)
            .set(ledger.headroom_w());
        families
            .live_nodes
            .get_or_create(domain)
            .set(ledger.entries.iter().filter(|e| e.live()).count() as f64);
        families
            .unbudgeted_nodes
            .get_or_create(domain)
            .set(ledger.unbudgeted.len() as f64);
        families
            .stranded_watts
            .get_or_create(domain)
            .set(ledger.stranded_w());
        // Who froze it may change between rounds: one series, the current one.
        families.frozen.clear();
        families
            .frozen
            .get_or_create(&FreezeLabels {
                domain: domain.domain.clone(),
                by: ledger
                    .freeze
                    .as_ref()
                    .map_or_else(String::new, |f| f.freeze.by.clone()),
            })
            .set(f64::from(u8::from(ledger.freeze.is_some())));
        // Nodes may leave the budget, and a node's reason change, between rounds: start
        // each round's node series afresh.
        Self::clear_nodes(families);
        for entry in &ledger.entries {
            let labels = NodeLabels {
                domain: domain.domain.clone(),
                node: entry.node().to_owned(),
            };
            if let Some(grant) = entry.grant {
                families
                    .node_grant_watts
                    .get_or_create(&labels)
                    .set(grant.watts);
            }
            families
                .node_charged_watts
                .get_or_create(&labels)
                .set(entry.charged_w);
            families
                .node_lease_live
                .get_or_create(&labels)
                .set(f64::from(u8::from(entry.live())));
            families
                .node_fence_missing
                .get_or_create(&labels)
                .set(f64::from(u8::from(entry.fence_missing)));
            families
                .node_stranded_watts
                .get_or_create(&ReasonLabels {
                    domain: labels.domain,
                    node: labels.node,
                    reason: entry.why.label().to_owned(),
                })
                .set(entry.stranded_w);
        }
    }

    fn clear_nodes(families: &Families) {
        families.node_grant_watts.clear();
        families.node_charged_watts.clear();
        families.node_lease_live.clear();
        families.node_fence_missing.clear();
        families.node_stranded_watts.clear();
    }

    fn clear_ledger(&self, families: &Families) {
        for family in [
            &families.available_watts,
            &families.charged_watts,
            &families.headroom_watts,
            &families.live_nodes,
            &families.unbudgeted_nodes,
            &families.stranded_watts,
        ] {
            family.clear();
        }
        families.frozen.clear();
        Self::clear_nodes(families);
    }

    pub fn encode(&self) -> String {
        let inner = self.lock();
        let mut text = String::new();
        if let Err(error) = prometheus_client::encoding::text::encode(&mut text, &inner.0) {
            tracing::error!("encoding the coordinator's metrics failed: {error}");
        }
        text
    }

    fn lock(&self) -> MutexGuard<'_, (Registry, Families)> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl crate::api::MetricsSource for CoordinatorMetrics {
    fn metrics(&self) -> String {
        self.encode()
    }
}

#[cfg(test)]
mod tests {
    use tokwatt_fleet::store::{
        DomainView, Fence, FenceKind, Grant, Hold, NodeRecord, NodeReport, NodeView, StoredHold,
    };
    use tokwatt_fleet::{DomainBudget, NodeBudget};

    use super::*;

    /// `a` live under a fence, its boot unit proven; `b` silent, no record of its caps
    /// yet; `c` silent without the fence and boot unit its budget says it runs.
    fn ledger() -> Ledger {
        let node = |name: &str| NodeBudget {
            node: name.into(),
            reserve_w: 1000.0,
            max_w: 2800.0,
            priority: 0,
            fenced: true,
            default_w: Some(1200.0),
        };
        let fence = Fence {
            kind: FenceKind::SystemdWatchdog,
            deadline_s: 5.0,
            covers_reboot: true,
        };
        let silent = |name: &str, watts: f64, fence: Option<Fence>| NodeView {
            node: name.into(),
            record: None,
            grant: None,
            hold: Some(StoredHold {
                hold: Hold {
                    boot: 0,
                    watts,
                    fence,
                    default_w: 0.0,
                    released: false,
                },
                mod_revision: 3,
            }),
        };
        let boot_record = |name: &str| tokwatt_fleet::StoredProof {
            node: name.into(),
            proof: tokwatt_fleet::ReleaseProof::of_caps(
                tokwatt_fleet::ProofSource::Boot,
                "the boot unit",
                vec![1000.0],
                0,
                0,
            ),
            mod_revision: 2,
            lease: 9,
        };
        Ledger::from_view(DomainView {
            proofs: vec![boot_record("a"), boot_record("b")],
            revision: 7,
            budget: DomainBudget {
                domain: "rack".into(),
                budget_w: 6000.0,
                uncontrolled_w: 0.0,
                nodes: vec![node("a"), node("b"), node("c")],
            },
            nodes: vec![
                NodeView {
                    node: "a".into(),
                    record: Some(NodeRecord {
                        lease: 1,
                        report: NodeReport {
                            boot: 0,
                            acked_generation: 2,
                            caps_in_force_w: 2500.0,
                            draw_w: 2400.0,
                            tokens_per_s: 9000.0,
                            wants_more: false,
                            requested_w: 2500.0,
                            fence: Some(fence),
                            default_w: 0.0,
                        },
                    }),
                    grant: Some(Grant {
                        generation: 2,
                        watts: 2500.0,
                        ceiling_w: 2500.0,
                        under_freeze: None,
                    }),
                    hold: None,
                },
                silent("b", 1500.0, Some(fence)),
                silent("c", 1000.0, None),
            ],
            freeze: None,
        })
    }

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    }

    #[test]
    fn the_leader_exports_its_ledger_and_a_follower_none() {
        let metrics = CoordinatorMetrics::new("rack");
        let round = |ledger: Ledger| -> Result<Round, ()> {
            Ok(Round::Leader {
                took_over: true,
                charged_w: ledger.charged_w(),
                available_w: ledger.budget.available_w(),
                grants_written: 1,
                holds_written: 1,
                live_nodes: 1,
                unbudgeted: Vec::new(),
                ledger: Box::new(ledger),
            })
        };
        metrics.observe(&round(ledger()));
        let text = metrics.encode();
        assert_eq!(
            value(&text, "tokwatt_fleet_coordinator_leading{domain=\"rack\"}"),
            Some(1.0)
        );
        // a holds its 2.5 kW grant; b may hold its 1.5 kW until a record proves less; c,
        // with no boot unit proven, may hold its 1.2 kW of board defaults.
        assert_eq!(
            value(&text, "tokwatt_fleet_charged_watts{domain=\"rack\"}"),
            Some(5200.0)
        );
        assert_eq!(
            value(&text, "tokwatt_fleet_headroom_watts{domain=\"rack\"}"),
            Some(800.0)
        );
        assert_eq!(
            value(&text, "tokwatt_fleet_stranded_watts{domain=\"rack\"}"),
            Some(700.0)
        );
        for (node, reason, watts) in [
            ("a", "live", 0.0),
            ("b", "silent-unproven", 500.0),
            ("c", "silent-unproven", 200.0),
        ] {
            let series = format!(
                "tokwatt_fleet_node_stranded_watts{{domain=\"rack\",node=\"{node}\",reason=\"{reason}\"}}"
            );
            assert_eq!(value(&text, &series), Some(watts), "{series}\n{text}");
        }
        for (node, missing) in [("a", 0.0), ("b", 0.0), ("c", 1.0)] {
            let series =
                format!("tokwatt_fleet_node_fence_missing{{domain=\"rack\",node=\"{node}\"}}");
            assert_eq!(value(&text, &series), Some(missing), "{series}\n{text}");
        }
        assert_eq!(
            value(
                &text,
                "tokwatt_fleet_node_grant_watts{domain=\"rack\",node=\"a\"}"
            ),
            Some(2500.0)
        );
        assert_eq!(
            value(
                &text,
                "tokwatt_fleet_node_grant_watts{domain=\"rack\",node=\"b\"}"
            ),
            None,
            "b has no grant: no series, not a zero"
        );
        assert_eq!(
            value(
                &text,
                "tokwatt_fleet_node_charged_watts{domain=\"rack\",node=\"b\"}"
            ),
            Some(1500.0)
        );
        assert_eq!(
            value(
                &text,
                "tokwatt_fleet_coordinator_takeovers_total{domain=\"rack\"}"
            ),
            Some(1.0)
        );
        assert_eq!(
            value(&text, "tokwatt_fleet_frozen{domain=\"rack\",by=\"\"}"),
            Some(0.0),
            "{text}"
        );
        // Frozen by an experiment: said, with who froze it.
        let mut frozen = ledger();
        frozen.freeze = Some(tokwatt_fleet::StoredFreeze {
            freeze: tokwatt_fleet::Freeze {
                by: "tokwatt fleet ab on host-1".into(),
                why: "an A/B".into(),
            },
            lease: 9,
            create_revision: 4,
        });
        metrics.observe(&round(frozen));
        let text = metrics.encode();
        assert_eq!(
            value(
                &text,
                "tokwatt_fleet_frozen{domain=\"rack\",by=\"tokwatt fleet ab on host-1\"}"
            ),
            Some(1.0),
            "{text}"
        );
        assert_eq!(text.matches("tokwatt_fleet_frozen{").count(), 1, "{text}");

        // Deposed: no ledger is read, none is exported.
        metrics.observe::<()>(&Ok(Round::Follower));
        let text = metrics.encode();
        assert_eq!(
            value(&text, "tokwatt_fleet_coordinator_leading{domain=\"rack\"}"),
            Some(0.0)
        );
        assert_eq!(
            value(&text, "tokwatt_fleet_charged_watts{domain=\"rack\"}"),
            None,
            "{text}"
        );
        for family in [
            "tokwatt_fleet_node_charged_watts{",
            "tokwatt_fleet_node_stranded_watts{",
            "tokwatt_fleet_stranded_watts{",
            "tokwatt_fleet_frozen{",
        ] {
            assert!(!text.contains(family), "{family}: {text}");
        }

        metrics.observe::<&str>(&Err("etcd unreachable"));
        let text = metrics.encode();
        assert_eq!(
            value(
                &text,
                "tokwatt_fleet_coordinator_round_errors_total{domain=\"rack\"}"
            ),
            Some(1.0)
        );
        assert_eq!(
            value(
                &text,
                "tokwatt_fleet_coordinator_rounds_total{domain=\"rack\"}"
            ),
            Some(4.0)
        );
    }

    #[test]
    fn the_off_node_fences_counts_move_its_counters_by_what_changed() {
        let metrics = CoordinatorMetrics::new("rack");
        let series = |outcome: &str| {
            format!("tokwatt_fleet_off_node_actions_total{{domain=\"rack\",outcome=\"{outcome}\"}}")
        };
        // Before any action: every outcome at 0, not absent.
        let text = metrics.encode();
        for outcome in OFF_NODE_OUTCOMES {
            assert_eq!(value(&text, &series(outcome)), Some(0.0), "{text}");
        }
        let mut counts = OffNodeCounts {
            started: 2,
            powered_off: 1,
            failed: 1,
            cancelled: 0,
        };
        metrics.observe_off_node(&counts);
        // The same counts again (a round where nothing ended): nothing counted twice.
        metrics.observe_off_node(&counts);
        counts.started = 3;
        counts.cancelled = 1;
        metrics.observe_off_node(&counts);
        let text = metrics.encode();
        for (outcome, expected) in [
            ("started", 3.0),
            ("powered-off", 1.0),
            ("failed", 1.0),
            ("cancelled", 1.0),
        ] {
            assert_eq!(value(&text, &series(outcome)), Some(expected), "{text}");
        }
    }

    #[test]
    fn every_family_listed_is_exported_with_its_type() {
        let metrics = CoordinatorMetrics::new("rack");
        let ledger = ledger();
        metrics.observe::<()>(&Ok(Round::Leader {
            took_over: false,
            charged_w: 0.0,
            available_w: 0.0,
            grants_written: 0,
            holds_written: 0,
            live_nodes: 0,
            unbudgeted: Vec::new(),
            ledger: Box::new(ledger),
        }));
        let text = metrics.encode();
        for (name, kind, _) in COORDINATOR_METRICS {
            assert!(
                text.contains(&format!("# TYPE {name} {kind}\n")),
                "{name} ({kind}) is not exported as such:\n{text}"
            );
        }
    }
}
