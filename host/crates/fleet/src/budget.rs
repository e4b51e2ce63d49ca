//! A power domain's budget (a rack, a row): its watts, the draw outside tokwatt's
//! control, and each node's reserve, the watts a node holds on its own whenever it cannot
//! hear the coordinator. The reserves and the uncontrolled draw must fit in the budget,
//! so that every node cut off at once still keeps the domain within it.

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
        "the reserves ({reserves_w} W) and the uncontrolled draw ({uncontrolled_w} W) sum to more than the budget ({budget_w} W): every node cut off at once would exceed it; lower the reserves or raise the budget"
    )]
    ReservesExceedBudget {
        reserves_w: f64,
        uncontrolled_w: f64,
        budget_w: f64,
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
        }
        let reserves_w = self.reserves_w();
        if reserves_w + self.uncontrolled_w > self.budget_w {
            return Err(BudgetError::ReservesExceedBudget {
                reserves_w,
                uncontrolled_w: self.uncontrolled_w,
                budget_w: self.budget_w,
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
    }
}
