//! The node's rules: the service objective, the guardrails and the objective guard the
//! operator sets for a node (`serve.toml`'s `[objective]`, `[guardrails]` and `[guard]`;
//! flags of `run`). The operator owns them: a policy spec may only narrow them (a
//! stricter objective, a tighter range, a smaller step), and a spec that tries to loosen
//! one is refused with the key, both values and the fix. [`NodeRules::narrow`] is the
//! one place where a spec meets the node's rules; what it returns is in force, and is
//! what the policy's `init` is told.

use serde::{Deserialize, Serialize};

use crate::envelope::Guardrails;
use crate::guard::GuardConfig;
use crate::spec::PolicySpec;
use tokwatt_core::types::Objective;

/// The node's largest power cap raise per tick and GPU when the operator sets none, W.
///
/// A cap is a promise about the node's draw: eight GPUs each raised 500 W in one tick
/// swing the rack up by 4 kW at once, which trips facility breakers sized for the steady
/// draw and shows on the grid as a load step. 200 W still reaches any cap of an H100/H200
/// range (200–700 W) in three ticks. Cuts are never slowed: a budget or an emergency
/// needs them at once, and a lower draw trips nothing.
pub const DEFAULT_MAX_POWER_CAP_RAISE_W: f64 = 200.0;

/// The operator's rules for a node.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeRules {
    pub objective: Objective,
    pub guardrails: Guardrails,
    pub guard: GuardConfig,
}

impl Default for NodeRules {
    fn default() -> Self {
        Self {
            objective: Objective::default(),
            guardrails: Guardrails {
                max_power_cap_raise_w: Some(DEFAULT_MAX_POWER_CAP_RAISE_W),
                ..Guardrails::default()
            },
            guard: GuardConfig::default(),
        }
    }
}

impl NodeRules {
    /// The rules a judge runs policies under (`eval`, `ab`, `tune`): the default
    /// guardrails, and the guard off, since a judge measures what the policy does, not
    /// what the host makes of it. The objective's violations are still counted.
    pub fn judging() -> Self {
        Self {
            guard: GuardConfig {
                enabled: false,
                ..GuardConfig::default()
            },
            ..Self::default()
        }
    }
}

/// A spec that tries to loosen one of the node's rules.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "policy spec {spec}: `{key}` = {asked} is looser than the node's {node} ({source_of_rule}); a policy may only narrow the node's rules: {fix}"
)]
pub struct Loosened {
    pub spec: String,
    pub key: String,
    pub asked: String,
    pub node: String,
    /// Where the node's value comes from (the serve config, a flag, the default).
    pub source_of_rule: String,
    pub fix: String,
}

/// Which way a bound narrows.
#[derive(Clone, Copy)]
enum Tighter {
    /// A smaller value is tighter (a limit, a maximum, a step).
    Lower,
    /// A larger value is tighter (a floor, a minimum).
    Higher,
}

fn narrow_f64(
    key: &str,
    node: Option<f64>,
    spec: Option<f64>,
    tighter: Tighter,
    loosened: &mut Vec<(String, String, String, String)>,
) -> Option<f64> {
    match (node, spec) {
        (Some(n), Some(s)) => {
            let looser = match tighter {
                Tighter::Lower => s > n,
                Tighter::Higher => s < n,
            };
            if looser {
                let fix = match tighter {
                    Tighter::Lower => format!("remove it, or set it to at most {n}"),
                    Tighter::Higher => format!("remove it, or set it to at least {n}"),
                };
                loosened.push((key.to_owned(), s.to_string(), n.to_string(), fix));
            }
            Some(s)
        }
        (n, s) => s.or(n),
    }
}

fn narrow_u32(
    key: &str,
    node: Option<u32>,
    spec: Option<u32>,
    tighter: Tighter,
    loosened: &mut Vec<(String, String, String, String)>,
) -> Option<u32> {
    narrow_f64(
        key,
        node.map(f64::from),
        spec.map(f64::from),
        tighter,
        loosened,
    )
    .map(|v| v as u32)
}

impl NodeRules {
    /// The node's own envelope: its guardrails over the node's devices and the knobs
    /// its backends offer. It bounds the host's own moves (the guard's fallback, a knob
    /// returning to the baseline), so a node whose guardrails miss its devices is refused
    /// at start with the reason.
    pub fn envelope(
        &self,
        devices: &[tokwatt_core::types::DeviceInfo],
        workload: &[crate::envelope::WorkloadLimits],
        knobs: tokwatt_core::types::Knobs,
    ) -> Result<crate::envelope::Envelope, crate::envelope::EnvelopeError> {
        crate::envelope::Envelope::for_workload(devices, workload, &self.guardrails, knobs)
    }

    /// [`Self::narrow`] with the rules' `source`, and the objective then in force bound by
    /// bound with where each came from: what `run` and `serve` print and record.
    pub fn narrow_in_force(
        &self,
        spec: &PolicySpec,
        source: &crate::in_force::RulesSource,
    ) -> Result<(PolicySpec, crate::in_force::ObjectiveInForce), Box<Loosened>> {
        let narrowed = self.narrow(spec, &source.words)?;
        let in_force = crate::in_force::ObjectiveInForce::merge(
            &self.objective,
            source,
            &spec.objective,
            &spec.path,
        );
        Ok((narrowed, in_force))
    }

    /// The spec's objective and guardrails within the node's: every bound the spec leaves
    /// out is the node's, every bound it sets must be as tight or tighter. `source_of_rule`
    /// names where the node's rules come from, for the error.
    pub fn narrow(
        &self,
        spec: &PolicySpec,
        source_of_rule: &str,
    ) -> Result<PolicySpec, Box<Loosened>> {
        let mut loosened = Vec::new();
        let (n, s) = (&self.objective, &spec.objective);
        let objective = Objective {
            tpot_p99_limit_ms: narrow_f64(
                "objective.tpot_p99_limit_ms",
                n.tpot_p99_limit_ms,
                s.tpot_p99_limit_ms,
                Tighter::Lower,
                &mut loosened,
            ),
            // A floor of 0 is no floor (specs write it so): the node's, if any, holds.
            min_tokens_per_s: narrow_f64(
                "objective.min_tokens_per_s",
                n.min_tokens_per_s,
                s.min_tokens_per_s.filter(|&floor| floor > 0.0),
                Tighter::Higher,
                &mut loosened,
            ),
            queue_wait_p99_limit_ms: narrow_f64(
                "objective.queue_wait_p99_limit_ms",
                n.queue_wait_p99_limit_ms,
                s.queue_wait_p99_limit_ms,
                Tighter::Lower,
                &mut loosened,
            ),
            ttft_p99_limit_ms: narrow_f64(
                "objective.ttft_p99_limit_ms",
                n.ttft_p99_limit_ms,
                s.ttft_p99_limit_ms,
                Tighter::Lower,
                &mut loosened,
            ),
        };
        let (n, s) = (&self.guardrails, &spec.guardrails);
        let guardrails = Guardrails {
            power_cap_min_w: narrow_f64(
                "guardrails.power_cap_min_w",
                n.power_cap_min_w,
                s.power_cap_min_w,
                Tighter::Higher,
                &mut loosened,
            ),
            power_cap_max_w: narrow_f64(
                "guardrails.power_cap_max_w",
                n.power_cap_max_w,
                s.power_cap_max_w,
                Tighter::Lower,
                &mut loosened,
            ),
            sm_clock_min_mhz: narrow_u32(
                "guardrails.sm_clock_min_mhz",
                n.sm_clock_min_mhz,
                s.sm_clock_min_mhz,
                Tighter::Higher,
                &mut loosened,
            ),
            sm_clock_max_mhz: narrow_u32(
                "guardrails.sm_clock_max_mhz",
                n.sm_clock_max_mhz,
                s.sm_clock_max_mhz,
                Tighter::Lower,
                &mut loosened,
            ),
            batch_size_min: narrow_u32(
                "guardrails.batch_size_min",
                n.batch_size_min,
                s.batch_size_min,
                Tighter::Higher,
                &mut loosened,
            ),
            batch_size_max: narrow_u32(
                "guardrails.batch_size_max",
                n.batch_size_max,
                s.batch_size_max,
                Tighter::Lower,
                &mut loosened,
            ),
            max_power_cap_step_w: narrow_f64(
                "guardrails.max_power_cap_step_w",
                n.max_power_cap_step_w,
                s.max_power_cap_step_w,
                Tighter::Lower,
                &mut loosened,
            ),
            max_power_cap_raise_w: narrow_f64(
                "guardrails.max_power_cap_raise_w",
                n.max_power_cap_raise_w,
                s.max_power_cap_raise_w,
                Tighter::Lower,
                &mut loosened,
            ),
            max_sm_clock_step_mhz: narrow_u32(
                "guardrails.max_sm_clock_step_mhz",
                n.max_sm_clock_step_mhz,
                s.max_sm_clock_step_mhz,
                Tighter::Lower,
                &mut loosened,
            ),
            max_batch_size_step: narrow_u32(
                "guardrails.max_batch_size_step",
                n.max_batch_size_step,
                s.max_batch_size_step,
                Tighter::Lower,
                &mut loosened,
            ),
            token_budget_min: narrow_u32(
                "guardrails.token_budget_min",
                n.token_budget_min,
                s.token_budget_min,
                Tighter::Higher,
                &mut loosened,
            ),
            token_budget_max: narrow_u32(
                "guardrails.token_budget_max",
                n.token_budget_max,
                s.token_budget_max,
                Tighter::Lower,
                &mut loosened,
            ),
            max_token_budget_step: narrow_u32(
                "guardrails.max_token_budget_step",
                n.max_token_budget_step,
                s.max_token_budget_step,
                Tighter::Lower,
                &mut loosened,
            ),
        };
        if let Some((key, asked, node, fix)) = loosened.into_iter().next() {
            return Err(Box::new(Loosened {
                spec: spec.path.display().to_string(),
                key,
                asked,
                node,
                source_of_rule: source_of_rule.to_owned(),
                fix,
            }));
        }
        let mut narrowed = spec.clone();
        narrowed.objective = objective;
        narrowed.guardrails = guardrails;
        Ok(narrowed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn spec(objective_and_guardrails: &str) -> PolicySpec {
        let text = format!(
            "name = \"p\"\nplugin = \"p.wasm\"\nknobs = [\"power-cap\"]\n{objective_and_guardrails}"
        );
        PolicySpec::parse(Path::new("/specs/p.toml"), &text).expect("spec parses")
    }

    fn node() -> NodeRules {
        NodeRules {
            objective: Objective {
                tpot_p99_limit_ms: Some(50.0),
                min_tokens_per_s: Some(1000.0),
                queue_wait_p99_limit_ms: None,
                ttft_p99_limit_ms: None,
            },
            guardrails: Guardrails {
                power_cap_min_w: Some(300.0),
                power_cap_max_w: Some(600.0),
                max_power_cap_step_w: Some(100.0),
                max_power_cap_raise_w: Some(200.0),
                token_budget_min: Some(256),
                token_budget_max: Some(8192),
                max_token_budget_step: Some(2048),
                ..Guardrails::default()
            },
            guard: GuardConfig::default(),
        }
    }

    #[test]
    fn a_spec_without_an_objective_gets_the_nodes() {
        let narrowed = node().narrow(&spec(""), "serve.toml").expect("narrows");
        assert_eq!(narrowed.objective, node().objective);
        assert_eq!(narrowed.guardrails, node().guardrails);
    }

    #[test]
    fn a_stricter_spec_keeps_its_own_bounds_and_gains_the_nodes_others() {
        let narrowed = node()
            .narrow(
                &spec(
                    "[objective]\ntpot_p99_limit_ms = 25.0\n[guardrails]\npower_cap_max_w = 500.0\nmax_power_cap_step_w = 50.0\n",
                ),
                "serve.toml",
            )
            .expect("narrows");
        assert_eq!(narrowed.objective.tpot_p99_limit_ms, Some(25.0));
        assert_eq!(narrowed.objective.min_tokens_per_s, Some(1000.0));
        assert_eq!(narrowed.guardrails.power_cap_min_w, Some(300.0));
        assert_eq!(narrowed.guardrails.power_cap_max_w, Some(500.0));
        assert_eq!(narrowed.guardrails.max_power_cap_step_w, Some(50.0));
        // The token budget's range is narrowed as the others: a spec may tighten it.
        let budget = node()
            .narrow(
                &spec("[guardrails]\ntoken_budget_min = 512\ntoken_budget_max = 4096\n"),
                "serve.toml",
            )
            .expect("narrows");
        assert_eq!(budget.guardrails.token_budget_min, Some(512));
        assert_eq!(budget.guardrails.token_budget_max, Some(4096));
        assert_eq!(budget.guardrails.max_token_budget_step, Some(2048));
    }

    #[test]
    fn the_objective_in_force_is_what_narrow_puts_in_force() {
        use crate::in_force::{ObjectiveInForce, RulesOrigin, RulesSource};
        let source = RulesSource::new(RulesOrigin::ServeToml("serve.toml".into()), "serve.toml");
        for text in [
            "",
            "[objective]\ntpot_p99_limit_ms = 25.0\n",
            "[objective]\nttft_p99_limit_ms = 800.0\nmin_tokens_per_s = 0.0\n",
            "[objective]\nmin_tokens_per_s = 2000.0\nqueue_wait_p99_limit_ms = 100.0\n",
        ] {
            let given = spec(text);
            let narrowed = node().narrow(&given, &source.words).expect("narrows");
            let in_force =
                ObjectiveInForce::merge(&node().objective, &source, &given.objective, &given.path);
            assert_eq!(in_force.objective, narrowed.objective, "{text}");
            assert!(in_force.set_aside.is_empty());
        }
    }

    #[test]
    fn every_loosening_is_refused_by_key_with_the_fix() {
        let cases = [
            (
                "[objective]\ntpot_p99_limit_ms = 80.0\n",
                "objective.tpot_p99_limit_ms",
                "at most 50",
            ),
            (
                "[objective]\nmin_tokens_per_s = 10.0\n",
                "objective.min_tokens_per_s",
                "at least 1000",
            ),
            (
                "[guardrails]\npower_cap_min_w = 200.0\n",
                "guardrails.power_cap_min_w",
                "at least 300",
            ),
            (
                "[guardrails]\npower_cap_max_w = 700.0\n",
                "guardrails.power_cap_max_w",
                "at most 600",
            ),
            (
                "[guardrails]\nmax_power_cap_step_w = 400.0\n",
                "guardrails.max_power_cap_step_w",
                "at most 100",
            ),
            (
                "[guardrails]\nmax_power_cap_raise_w = 400.0\n",
                "guardrails.max_power_cap_raise_w",
                "at most 200",
            ),
            (
                "[guardrails]\ntoken_budget_min = 128\n",
                "guardrails.token_budget_min",
                "at least 256",
            ),
            (
                "[guardrails]\ntoken_budget_max = 16384\n",
                "guardrails.token_budget_max",
                "at most 8192",
            ),
            (
                "[guardrails]\nmax_token_budget_step = 4096\n",
                "guardrails.max_token_budget_step",
                "at most 2048",
            ),
        ];
        for (text, key, fix) in cases {
            let error = node().narrow(&spec(text), "serve.toml").unwrap_err();
            assert_eq!(error.key, key);
            let message = error.to_string();
            assert!(message.contains(fix), "{message}");
            assert!(message.contains("/specs/p.toml"), "{message}");
            assert!(message.contains("serve.toml"), "{message}");
        }
    }

    #[test]
    fn the_default_node_bounds_every_cap_raise() {
        let narrowed = NodeRules::default()
            .narrow(&spec(""), "the default")
            .expect("narrows");
        assert_eq!(
            narrowed.guardrails.max_power_cap_raise_w,
            Some(DEFAULT_MAX_POWER_CAP_RAISE_W)
        );
        // A spec's symmetric step is its own; its raises stay within the node's.
        let stepped = NodeRules::default()
            .narrow(
                &spec("[guardrails]\nmax_power_cap_step_w = 500.0\n"),
                "the default",
            )
            .expect("a step is the spec's to set");
        assert_eq!(stepped.guardrails.max_power_cap_step_w, Some(500.0));
        assert_eq!(stepped.guardrails.max_power_cap_raise_w, Some(200.0));
        assert!(
            NodeRules::default()
                .narrow(
                    &spec("[guardrails]\nmax_power_cap_raise_w = 500.0\n"),
                    "the default"
                )
                .is_err()
        );
    }

    #[test]
    fn every_shipped_spec_fits_the_default_node() {
        let policies = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../policies");
        let mut checked = 0;
        for entry in std::fs::read_dir(&policies).expect("policies folder") {
            let path = entry.expect("entry").path();
            if path.extension().is_some_and(|e| e == "toml") {
                let spec = PolicySpec::load(&path).expect("shipped spec loads");
                NodeRules::default()
                    .narrow(&spec, "the default")
                    .unwrap_or_else(|e| panic!("{e}"));
                checked += 1;
            }
        }
        assert!(checked >= 10, "only {checked} specs found");
    }
}
