use std::collections::BTreeMap;
use std::time::Duration;

use super::*;
use crate::budget::{DomainBudget, NodeBudget};
use crate::store::{
    DomainView, FenceKind, Freeze, Grant, Hold, NodeRecord, NodeView, ReleaseProof, StoredFreeze,
    StoredHold, StoredProof,
};

fn proof(node: &str, source: ProofSource, sum_w: f64, revision: i64) -> StoredProof {
    StoredProof {
        node: node.into(),
        proof: ReleaseProof::of_caps(
            source,
            format!("{} on {node}", source.label()),
            vec![sum_w / 2.0, sum_w / 2.0],
            1_765_000_000_000,
            0,
        ),
        mod_revision: revision,
        lease: 0x51,
    }
}

fn node(name: &str, fenced: bool) -> NodeBudget {
    NodeBudget {
        node: name.into(),
        reserve_w: 1000.0,
        max_w: 5600.0,
        priority: 1,
        fenced,
        default_w: Some(5600.0),
    }
}

/// Domain `rack-1`: `a` live and granted (acknowledged), `b` silent for 6 s, its fence's
/// record written after its hold, `c` never heard; `a` and `b`'s boot units proved
/// themselves; `x` reports without a budget line; frozen by an experiment.
fn ledger() -> Ledger {
    let fence = Fence {
        kind: FenceKind::Heartbeat,
        deadline_s: 10.0,
        covers_reboot: true,
    };
    let report = NodeReport {
        boot: 0,
        acked_generation: 4,
        caps_in_force_w: 3000.0,
        draw_w: 2800.0,
        tokens_per_s: 9000.0,
        wants_more: true,
        requested_w: 4000.0,
        fence: Some(fence),
        default_w: 5600.0,
    };
    let view = DomainView {
        proofs: vec![
            proof("a", ProofSource::Boot, 1000.0, 5),
            proof("b", ProofSource::Boot, 1000.0, 6),
            proof("b", ProofSource::Fence, 900.0, 11),
        ],
        revision: 42,
        budget: DomainBudget {
            domain: "rack-1".into(),
            budget_w: 20000.0,
            uncontrolled_w: 2000.0,
            nodes: vec![node("a", true), node("b", true), node("c", false)],
        },
        nodes: vec![
            NodeView {
                node: "a".into(),
                record: Some(NodeRecord {
                    lease: 0x694d,
                    report,
                }),
                grant: Some(Grant {
                    generation: 4,
                    watts: 3000.0,
                    ceiling_w: 3000.0,
                    under_freeze: Some(FrozenWrite::BudgetCut),
                }),
                hold: None,
            },
            NodeView {
                node: "b".into(),
                record: None,
                grant: None,
                hold: Some(StoredHold {
                    hold: Hold {
                        boot: 0,
                        watts: 2500.0,
                        fence: Some(fence),
                        default_w: 5600.0,
                        released: false,
                    },
                    mod_revision: 9,
                }),
            },
            NodeView {
                node: "x".into(),
                record: Some(NodeRecord {
                    lease: 0x7,
                    report: NodeReport {
                        caps_in_force_w: 700.0,
                        ..report
                    },
                }),
                grant: None,
                hold: None,
            },
        ],
        freeze: Some(StoredFreeze {
            freeze: Freeze {
                by: "tokwatt fleet ab on h1".into(),
                why: "an A/B".into(),
            },
            lease: 0xabc,
            create_revision: 40,
        }),
    };
    let silent = BTreeMap::from([("b".to_owned(), Duration::from_secs(6))]);
    Ledger::with_silence(view, &silent)
}

/// `tokwatt fleet show --json`'s keys, as scripts read them: a key renamed or removed is
/// a new `SHOW_FORMAT_VERSION` (issue 43 item 8).
#[test]
fn the_documents_keys_are_stable() {
    let json = serde_json::to_value(LedgerDocument::of(&ledger())).expect("serialises");
    let keys = |value: &serde_json::Value| -> Vec<String> {
        let mut keys: Vec<String> = value
            .as_object()
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default();
        keys.sort();
        keys
    };
    assert_eq!(
        keys(&json),
        [
            "available_w",
            "budget_w",
            "charged_w",
            "domain",
            "format_version",
            "frozen",
            "headroom_w",
            "nodes",
            "revision",
            "stranded_w",
            "unbudgeted",
            "uncontrolled_w",
        ]
    );
    assert_eq!(json["format_version"], SHOW_FORMAT_VERSION);
    assert_eq!(keys(&json["frozen"]), ["by", "lease", "why"]);
    assert_eq!(
        keys(&json["nodes"][0]),
        [
            "boot_proven",
            "charged_w",
            "fence_missing",
            "fenced",
            "floor_w",
            "grant",
            "lease",
            "live",
            "max_w",
            "node",
            "priority",
            "proof",
            "proofs",
            "released_by",
            "report",
            "reserve_w",
            "silent_for_s",
            "stranded_w",
            "why",
            "why_words",
        ]
    );
    assert_eq!(
        keys(&json["nodes"][0]["grant"]),
        [
            "acknowledged",
            "ceiling_w",
            "generation",
            "under_freeze",
            "watts"
        ]
    );
    assert_eq!(
        keys(&json["nodes"][0]["report"]),
        [
            "acked_generation",
            "boot",
            "caps_in_force_w",
            "default_w",
            "draw_w",
            "fence",
            "requested_w",
            "tokens_per_s",
            "wants_more",
        ]
    );
    assert_eq!(
        keys(&json["nodes"][0]["report"]["fence"]),
        ["covers_reboot", "deadline_s", "kind"]
    );
    assert_eq!(
        keys(&json["nodes"][1]["proof"]),
        [
            "at_unix_ms",
            "by",
            "caps_w",
            "detail",
            "lease",
            "revision",
            "source",
            "sum_w",
        ]
    );
    assert_eq!(keys(&json["unbudgeted"][0]), ["node", "watts"]);
}

/// The document says what the table says: each node's charge and why, its grant and
/// whether it enforced it, its lease, the domain's sums.
#[test]
fn the_document_holds_the_ledgers_figures() {
    let ledger = ledger();
    let doc = LedgerDocument::of(&ledger);
    let json = serde_json::to_value(&doc).expect("serialises");
    assert_eq!(json["domain"], "rack-1");
    assert_eq!(json["revision"], 42);
    assert_eq!(json["available_w"], 18000.0);
    assert_eq!(json["charged_w"], ledger.charged_w());
    assert_eq!(json["headroom_w"], ledger.headroom_w());
    assert_eq!(json["frozen"]["lease"], "abc");

    let a = &json["nodes"][0];
    assert_eq!(
        (&a["node"], &a["live"], &a["lease"], &a["why"]),
        (
            &serde_json::json!("a"),
            &serde_json::json!(true),
            &serde_json::json!("694d"),
            &serde_json::json!("live")
        )
    );
    assert_eq!(a["grant"]["acknowledged"], true);
    assert_eq!(a["grant"]["under_freeze"], "budget-cut");
    assert_eq!(a["report"]["fence"]["kind"], "heartbeat");
    assert_eq!(a["silent_for_s"], serde_json::Value::Null);

    let b = &json["nodes"][1];
    assert_eq!(b["why"], "proven");
    assert_eq!(b["lease"], serde_json::Value::Null);
    assert_eq!(b["report"], serde_json::Value::Null);
    assert_eq!(b["proof"]["source"], "fence");
    assert_eq!(b["proof"]["revision"], 11);
    assert_eq!(b["proof"]["sum_w"], 900.0);
    assert_eq!(b["proofs"].as_array().map(Vec::len), Some(2));
    assert_eq!(b["boot_proven"], true);
    assert_eq!(b["silent_for_s"], 6.0);
    // Proven at 900 W, but charged its 1 kW reserve: what its boot unit puts in force.
    assert_eq!(b["charged_w"], 1000.0);
    assert_eq!(b["stranded_w"], 0.0);
    assert_eq!(b["why_words"], "silent, proven by its fence record");

    let c = &json["nodes"][2];
    assert_eq!(c["why"], "never-heard");
    assert_eq!(c["grant"], serde_json::Value::Null);

    assert_eq!(json["unbudgeted"][0]["node"], "x");
    assert_eq!(json["unbudgeted"][0]["watts"], 700.0);
}
