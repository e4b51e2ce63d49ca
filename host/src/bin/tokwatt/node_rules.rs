//! The node's rules as flags (`run`): the operator's objective, cap step and guard, which
//! the policy spec may only narrow. `serve` reads the same from serve.toml; `ab` and `tune`
//! take the objective's flags alone ([`ObjectiveArgs`]).

use anyhow::Result;
use clap::Args;
use tokwatt_core::types::Objective;
use tokwatt_policy::guard::GuardConfig;
use tokwatt_policy::in_force::{ObjectiveInForce, RulesOrigin, RulesSource};
use tokwatt_policy::rules::NodeRules;
use tokwatt_policy::spec::PolicySpec;

/// The operator's objective as flags: `run`'s (inside [`NodeRulesArgs`]), `ab`'s and
/// `tune`'s. A policy spec's own `[objective]` may only narrow it.
#[derive(Debug, Clone, Args)]
pub struct ObjectiveArgs {
    /// The node's p99 time per output token bound, ms; the spec may only set a lower one.
    #[arg(long, value_name = "MS")]
    tpot_p99_limit_ms: Option<f64>,
    /// The node's throughput floor per GPU, tokens/s; the spec may only set a higher one.
    #[arg(long, value_name = "TOKENS")]
    min_tokens_per_s: Option<f64>,
    /// The node's p99 queue-wait bound, ms; the spec may only set a lower one.
    #[arg(long, value_name = "MS")]
    queue_wait_p99_limit_ms: Option<f64>,
    /// The node's p99 time-to-first-token bound, ms; the spec may only set a lower one
    /// (needs a workload that reports TTFT: the simulator does).
    #[arg(long, value_name = "MS")]
    ttft_p99_limit_ms: Option<f64>,
}

impl ObjectiveArgs {
    /// The flags' objective, checked (every bound a positive number).
    pub fn objective(&self) -> Result<Objective> {
        let positive = |flag: &str, value: Option<f64>| -> Result<()> {
            match value {
                Some(v) if !(v.is_finite() && v > 0.0) => {
                    anyhow::bail!("{flag} = {v}: must be a positive number")
                }
                _ => Ok(()),
            }
        };
        positive("--tpot-p99-limit-ms", self.tpot_p99_limit_ms)?;
        positive("--min-tokens-per-s", self.min_tokens_per_s)?;
        positive("--queue-wait-p99-limit-ms", self.queue_wait_p99_limit_ms)?;
        positive("--ttft-p99-limit-ms", self.ttft_p99_limit_ms)?;
        Ok(Objective {
            tpot_p99_limit_ms: self.tpot_p99_limit_ms,
            min_tokens_per_s: self.min_tokens_per_s,
            queue_wait_p99_limit_ms: self.queue_wait_p99_limit_ms,
            ttft_p99_limit_ms: self.ttft_p99_limit_ms,
        })
    }

    /// Where the flags' bounds come from, for the objective in force.
    pub fn source() -> RulesSource {
        RulesSource::new(
            RulesOrigin::Flags,
            "the operator's objective from the command line",
        )
    }

    /// Each spec's objective within the flags': what the spec narrows is in force, a looser
    /// bound of the spec's is set aside (`ab`, `tune`: both said in the lines printed).
    pub fn hold(&self, spec: &mut PolicySpec) -> Result<ObjectiveInForce> {
        let in_force = ObjectiveInForce::merge(
            &self.objective()?,
            &Self::source(),
            &spec.objective,
            &spec.path,
        );
        spec.objective = in_force.objective;
        Ok(in_force)
    }
}

#[derive(Debug, Clone, Args)]
pub struct NodeRulesArgs {
    #[command(flatten)]
    objective: ObjectiveArgs,
    /// The largest power cap raise per tick and GPU, W (cuts are never slowed; the spec may only set a smaller
    /// one).
    #[arg(long, value_name = "W", default_value_t = tokwatt_policy::rules::DEFAULT_MAX_POWER_CAP_RAISE_W)]
    max_power_cap_raise_w: f64,
    /// Count objective violations but never take over from the policy.
    #[arg(long)]
    no_guard: bool,
    /// The recent ticks the objective guard looks at.
    #[arg(long, value_name = "TICKS", default_value_t = GuardConfig::default().window_ticks)]
    guard_window_ticks: u32,
    /// Ticks within the window whose objective the policy broke that make the guard take over.
    #[arg(long, value_name = "TICKS", default_value_t = GuardConfig::default().max_violation_ticks)]
    guard_max_violation_ticks: u32,
    /// Ticks the guard's first take-over lasts (doubled at each take-over).
    #[arg(long, value_name = "TICKS", default_value_t = GuardConfig::default().takeover_ticks)]
    guard_takeover_ticks: u64,
}

impl NodeRulesArgs {
    /// The rules, checked, and where they come from (for the error that refuses a spec
    /// loosening them).
    pub fn rules(&self) -> Result<(NodeRules, RulesSource)> {
        let objective = self.objective.objective()?;
        if !(self.max_power_cap_raise_w.is_finite() && self.max_power_cap_raise_w > 0.0) {
            anyhow::bail!(
                "--max-power-cap-raise-w = {}: must be a positive number",
                self.max_power_cap_raise_w
            );
        }
        let defaults = NodeRules::default();
        let guard = GuardConfig {
            enabled: !self.no_guard,
            window_ticks: self.guard_window_ticks,
            max_violation_ticks: self.guard_max_violation_ticks,
            takeover_ticks: self.guard_takeover_ticks,
            max_takeover_ticks: defaults
                .guard
                .max_takeover_ticks
                .max(self.guard_takeover_ticks),
            ..defaults.guard
        };
        guard.validate().map_err(|e| {
            anyhow::anyhow!("{}: fix the --guard-{} flag", e, e.key.replace('_', "-"))
        })?;
        let rules = NodeRules {
            objective,
            guardrails: tokwatt_policy::envelope::Guardrails {
                max_power_cap_raise_w: Some(self.max_power_cap_raise_w),
                ..defaults.guardrails
            },
            guard,
        };
        let words = if objective == Objective::default() {
            format!(
                "the node's rules: no objective given, a cap raise of at most {} W a tick (--max-power-cap-raise-w)",
                self.max_power_cap_raise_w
            )
        } else {
            "the node's rules from the command line".to_owned()
        };
        let source = RulesSource::new(RulesOrigin::Flags, words);
        Ok((rules, source))
    }
}
