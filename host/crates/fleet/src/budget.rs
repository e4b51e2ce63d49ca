//! A power domain's budget (a rack, a row): its watts, the draw outside tokwatt's
//! control, and each node's reserve, the watts a node holds on its own whenever it cannot
//! hear the coordinator.
//!
//! What a node may draw once it is silent (its agent hung, paused, killed, or the node
//! rebooted) depends on what puts its GPUs back at the reserve without the agent: a
//! power cap outlives the process that set it, and a reboot leaves the board defaults.
//! A node the operator declares `fenced` runs a fence covering stops and reboots, and is
//! counted at its reserve; any other at its GPUs' board defaults. Those silent draws and
//! the uncontrolled draw must fit in the budget, so that every node cut off at once, and
//! left so, still keeps the domain within it.

use serde::{Deserialize, Serialize};

/// One node of a domain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeBudget {
    /// The node's name, as its agent joins with it (`[fleet] node` in serve.toml).
    pub node: String,
    /// What the node holds when it hears no coordinator: its GPUs' caps sum to at most
    /// this, at start, at stop, and when its lease lapses.
    pub reserve_w: f64,
    /// The most the node can use: the sum of its GPUs' largest power caps.
    pub max_w: f64,
    /// Tier: watts go to a higher tier first (0 is the lowest).
    #[serde(default)]
    pub priority: u8,
    /// The operator states the node runs a fence that puts its GPUs at the reserve when
    /// its agent stops renewing (hung, paused, killed, failing at start) and when it
    /// reboots (a boot-time unit): the watchdog or `tokwatt fence`, and the boot unit.
    /// The budget then counts it at its reserve; the node proves it in its reports, and
    /// one that declares no such fence is charged as unfenced, and named.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fenced: bool,
    /// The sum of the node's GPUs' board-default power caps: what a reboot or a driver
    /// reload leaves in force. Absent: `max_w` (the most it could be). A node's own
    /// report of its defaults, read from the driver, takes the place of this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_w: Option<f64>,
}

impl NodeBudget {
    /// The node's GPUs' board defaults summed, as the budget states them.
    pub fn board_default_w(&self) -> f64 {
        self.default_w.unwrap_or(self.max_w)
    }

    /// The most the node may draw once silent, however long, as the budget states it:
    /// its reserve where it is fenced, else the higher of its reserve and its board
    /// defaults (a hung agent keeps its caps; a reboot leaves the defaults).
    pub fn silent_w(&self) -> f64 {
        if self.fenced {
            self.reserve_w
        } else {
            self.reserve_w.max(self.board_default_w())
        }
    }
}

/// A power domain's budget.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DomainBudget {
    pub domain: String,
    /// The watts the domain may draw, tokwatt's GPUs and everything else.
    pub budget_w: f64,
    /// Draw in the domain that tokwatt does not control (CPUs, fans, switches), at its
    /// highest: subtracted before any GPU watt is granted.
    #[serde(default)]
    pub uncontrolled_w: f64,
    pub nodes: Vec<NodeBudget>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BudgetError {
    #[error(
        "the domain name `{0}` cannot be a key: use letters, digits, `-`, `_` and `.` (e.g. rack-12)"
    )]
    BadDomain(String),
    #[error("`{what}` is {value} W: it must be a finite number of watts, at least 0")]
    BadWatts { what: String, value: f64 },
    #[error("node `{0}` is named twice: give each node once")]
    Duplicate(String),
    #[error(
        "node `{node}`'s reserve ({reserve_w} W) is above its maximum ({max_w} W): a reserve is at most what the node can use"
    )]
    ReserveAboveMax {
        node: String,
        reserve_w: f64,
        max_w: f64,
    },
    #[error(
        "node `{node}`'s board defaults ({default_w} W) are above its maximum ({max_w} W): default_w is at most what the node can use"
    )]
    DefaultAboveMax {
        node: String,
        default_w: f64,
        max_w: f64,
    },
    #[error(
        "the reserves ({reserves_w} W) and the uncontrolled draw ({uncontrolled_w} W) sum to more than the budget ({budget_w} W): every node cut off at once would exceed it; lower the reserves or raise the budget"
    )]
    ReservesExceedBudget {
        reserves_w: f64,
        uncontrolled_w: f64,
        budget_w: f64,
    },
    #[error(
        "the nodes' silent draws ({silent_w} W) and the uncontrolled draw ({uncontrolled_w} W) sum to more than the budget ({budget_w} W): every node cut off at once could exceed it, because a node without a fence keeps its caps while its agent is stopped and its GPUs' board defaults after a reboot; counted at their board defaults: {}. Declare the fences these nodes run (fenced = true, with the watchdog or `tokwatt fence` and the boot unit on each), give their real board defaults (default_w), lower the reserves, or raise the budget",
        .unfenced.iter().map(|(node, w)| format!("{node} ({w} W)")).collect::<Vec<_>>().join(", ")
    )]
    SilentDrawsExceedBudget {
        silent_w: f64,
        uncontrolled_w: f64,
        budget_w: f64,
        /// The nodes counted above their reserve, and what each is counted at.
        unfenced: Vec<(String, f64)>,
    },
}

/// A key-safe name: what etcd keys and Kubernetes object names both accept.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// This host's name (the default name of a node and of a coordinator replica), or an
/// empty string where it cannot be read.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}

impl DomainBudget {
    /// Every rule a budget must keep; the first one broken.
    pub fn check(&self) -> Result<(), BudgetError> {
        if !valid_name(&self.domain) {
            return Err(BudgetError::BadDomain(self.domain.clone()));
        }
        let watts = |what: String, value: f64| {
            if value.is_finite() && value >= 0.0 {
                Ok(())
            } else {
                Err(BudgetError::BadWatts { what, value })
            }
        };
        watts("budget_w".into(), self.budget_w)?;
        watts("uncontrolled_w".into(), self.uncontrolled_w)?;
        let mut seen = std::collections::BTreeSet::new();
        for node in &self.nodes {
            if !valid_name(&node.node) {
                return Err(BudgetError::BadDomain(node.node.clone()));
            }
            if !seen.insert(node.node.as_str()) {
                return Err(BudgetError::Duplicate(node.node.clone()));
            }
            watts(format!("{}.reserve_w", node.node), node.reserve_w)?;
            watts(format!("{}.max_w", node.node), node.max_w)?;
            if node.reserve_w > node.max_w {
                return Err(BudgetError::ReserveAboveMax {
                    node: node.node.clone(),
                    reserve_w: node.reserve_w,
                    max_w: node.max_w,
                });
            }
            if let Some(default_w) = node.default_w {
                watts(format!("{}.default_w", node.node), default_w)?;
                if default_w > node.max_w {
                    return Err(BudgetError::DefaultAboveMax {
                        node: node.node.clone(),
                        default_w,
                        max_w: node.max_w,
                    });
                }
            }
        }
        let reserves_w = self.reserves_w();
        if reserves_w + self.uncontrolled_w > self.budget_w {
            return Err(BudgetError::ReservesExceedBudget {
                reserves_w,
                uncontrolled_w: self.uncontrolled_w,
                budget_w: self.budget_w,
            });
        }
        let silent_w = self.silent_w();
        if silent_w + self.uncontrolled_w > self.budget_w {
            return Err(BudgetError::SilentDrawsExceedBudget {
                silent_w,
                uncontrolled_w: self.uncontrolled_w,
                budget_w: self.budget_w,
                unfenced: self
                    .nodes
                    .iter()
                    .filter(|n| n.silent_w() > n.reserve_w)
                    .map(|n| (n.node.clone(), n.silent_w()))
                    .collect(),
            });
        }
        Ok(())
    }

    /// The watts the GPUs may hold in all: the budget less the uncontrolled draw.
    pub fn available_w(&self) -> f64 {
        self.budget_w - self.uncontrolled_w
    }

    pub fn reserves_w(&self) -> f64 {
        self.nodes.iter().map(|n| n.reserve_w).sum()
    }

    /// Every node's silent draw ([`NodeBudget::silent_w`]), summed.
    pub fn silent_w(&self) -> f64 {
        self.nodes.iter().map(NodeBudget::silent_w).sum()
    }

    pub fn node(&self, name: &str) -> Option<&NodeBudget> {
        self.nodes.iter().find(|n| n.node == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn rack(nodes: usize, reserve_w: f64, max_w: f64, budget_w: f64) -> DomainBudget {
        DomainBudget {
            domain: "rack-1".into(),
            budget_w,
            uncontrolled_w: 0.0,
            nodes: (0..nodes)
                .map(|i| NodeBudget {
                    node: format!("node-{i}"),
                    reserve_w,
                    max_w,
                    priority: 0,
                    fenced: true,
                    default_w: None,
                })
                .collect(),
        }
    }

    #[test]
    fn reserves_must_fit_with_the_uncontrolled_draw() {
        let mut budget = rack(4, 1000.0, 5600.0, 10_000.0);
        budget.check().expect("4 kW of reserves in 10 kW");
        budget.uncontrolled_w = 6500.0;
        let error = budget.check().expect_err("10.5 kW").to_string();
        assert!(error.contains("every node cut off at once"), "{error}");
    }

    #[test]
    fn each_rule_is_named() {
        let mut budget = rack(2, 1000.0, 5600.0, 10_000.0);
        budget.nodes[1].node = "node-0".into();
        assert_eq!(budget.check(), Err(BudgetError::Duplicate("node-0".into())));
        let mut budget = rack(2, 1000.0, 500.0, 10_000.0);
        assert!(matches!(
            budget.check(),
            Err(BudgetError::ReserveAboveMax { .. })
        ));
        budget = rack(2, f64::NAN, 500.0, 10_000.0);
        assert!(matches!(budget.check(), Err(BudgetError::BadWatts { .. })));
        budget = rack(1, 1.0, 2.0, 10.0);
        budget.domain = "rack/1".into();
        assert!(matches!(budget.check(), Err(BudgetError::BadDomain(_))));
        budget = rack(1, 1.0, 2.0, 10.0);
        budget.nodes[0].default_w = Some(3.0);
        assert!(matches!(
            budget.check(),
            Err(BudgetError::DefaultAboveMax { .. })
        ));
        budget.nodes[0].default_w = Some(f64::INFINITY);
        assert!(matches!(budget.check(), Err(BudgetError::BadWatts { .. })));
    }

    #[test]
    fn an_unfenced_node_is_counted_at_its_board_defaults() {
        // Four fenced nodes: 4 kW of reserves in 10 kW.
        let mut budget = rack(4, 1000.0, 5600.0, 10_000.0);
        assert_eq!(budget.silent_w(), 4000.0);
        // One without a fence: its GPUs may keep 5.6 kW (no defaults given: its maximum).
        budget.nodes[2].fenced = false;
        assert_eq!(budget.silent_w(), 3000.0 + 5600.0);
        budget.check().expect("8.6 kW in 10 kW");
        // Two: 13.2 kW, refused, naming both and the ways out.
        budget.nodes[3].fenced = false;
        let error = budget.check().expect_err("13.2 kW in 10 kW");
        assert_eq!(
            error,
            BudgetError::SilentDrawsExceedBudget {
                silent_w: 13_200.0,
                uncontrolled_w: 0.0,
                budget_w: 10_000.0,
                unfenced: vec![("node-2".into(), 5600.0), ("node-3".into(), 5600.0)],
            }
        );
        let text = error.to_string();
        for said in [
            "node-2 (5600 W), node-3 (5600 W)",
            "every node cut off at once",
            "fenced = true",
            "default_w",
            "raise the budget",
        ] {
            assert!(text.contains(said), "`{said}` not in: {text}");
        }
        // Their real board defaults (8 × 400 W) fit.
        budget.nodes[2].default_w = Some(3200.0);
        budget.nodes[3].default_w = Some(3200.0);
        assert_eq!(budget.silent_w(), 2000.0 + 6400.0);
        budget.check().expect("8.4 kW in 10 kW");
        // A board default under the reserve counts at the reserve: the node holds it.
        budget.nodes[3].default_w = Some(500.0);
        assert_eq!(budget.nodes[3].silent_w(), 1000.0);
    }

    #[test]
    fn a_budget_without_the_new_fields_reads_as_unfenced_at_its_maximum() {
        let budget: DomainBudget = serde_json::from_str(
            r#"{"domain":"r","budget_w":9000,"nodes":[{"node":"a","reserve_w":1000,"max_w":5600}]}"#,
        )
        .expect("an old budget");
        assert!(!budget.nodes[0].fenced);
        assert_eq!(budget.nodes[0].silent_w(), 5600.0);
        // And written back, an unfenced node without defaults has no new fields: an agent
        // from before them still reads it.
        let text = serde_json::to_string(&budget).expect("encodes");
        assert!(
            !text.contains("fenced") && !text.contains("default_w"),
            "{text}"
        );
    }
}
