//! The objective in force, and where each of its bounds comes from.
//!
//! The operator owns the objective (`run`'s, `ab`'s and `tune`'s flags, `serve.toml`'s
//! `[objective]`, a judging scenario's); a policy spec may only narrow it. What a command
//! holds the policy to is therefore the operator's bounds, each replaced by the spec's
//! where the spec's is stricter, and the spec's alone where the operator set none.
//! [`ObjectiveInForce::merge`] puts that together and records, bound by bound, whose it
//! is and which of the operator's a spec narrowed, so that a command can say so at the
//! start instead of applying a spec's stricter bound silently.
//!
//! A spec's bound looser than the operator's never holds. `run` and `serve` refuse such a
//! spec outright ([`crate::rules::NodeRules::narrow`]); `ab` and `tune`, which judge
//! specs rather than deploy them, hold the arms to the operator's bound and say which of
//! the spec's was set aside ([`ObjectiveInForce::set_aside`]).

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokwatt_core::types::Objective;

/// Where the node's rules come from: the operator's side of the objective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RulesOrigin {
    /// The command's flags (`--tpot-p99-limit-ms` …: `run`, `ab`, `tune`).
    Flags,
    /// A `serve.toml`'s `[objective]`, `[guardrails]` and `[guard]`.
    ServeToml(PathBuf),
    /// A judging scenario's `[objective]`.
    Scenario(PathBuf),
    /// Rules set in code (tokwatt's defaults, a judge's), known by their words only.
    Described,
}

/// The node's rules' origin, and the words the error refusing a looser spec names it by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RulesSource {
    pub origin: RulesOrigin,
    pub words: String,
}

impl RulesSource {
    pub fn new(origin: RulesOrigin, words: impl Into<String>) -> Self {
        Self {
            origin,
            words: words.into(),
        }
    }

    /// The node's rules in `tokwatt serve`'s config file at `path`.
    pub fn serve_toml(path: &Path) -> Self {
        let words = format!(
            "the node's rules in {} ([objective], [guardrails], [guard])",
            path.display()
        );
        Self::new(RulesOrigin::ServeToml(path.to_path_buf()), words)
    }
}

impl From<&str> for RulesSource {
    fn from(words: &str) -> Self {
        Self::new(RulesOrigin::Described, words)
    }
}

impl From<String> for RulesSource {
    fn from(words: String) -> Self {
        Self::new(RulesOrigin::Described, words)
    }
}

impl fmt::Display for RulesSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.words)
    }
}

/// One bound of the objective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    TpotP99LimitMs,
    TtftP99LimitMs,
    QueueWaitP99LimitMs,
    MinTokensPerS,
}

impl Bound {
    /// Every bound, in the order they are printed.
    pub const ALL: [Bound; 4] = [
        Bound::TpotP99LimitMs,
        Bound::TtftP99LimitMs,
        Bound::QueueWaitP99LimitMs,
        Bound::MinTokensPerS,
    ];

    /// The key in a spec's or serve.toml's `[objective]`.
    pub fn key(self) -> &'static str {
        match self {
            Bound::TpotP99LimitMs => "tpot_p99_limit_ms",
            Bound::TtftP99LimitMs => "ttft_p99_limit_ms",
            Bound::QueueWaitP99LimitMs => "queue_wait_p99_limit_ms",
            Bound::MinTokensPerS => "min_tokens_per_s",
        }
    }

    /// The flag of `run`, `ab` and `tune` that sets it.
    pub fn flag(self) -> &'static str {
        match self {
            Bound::TpotP99LimitMs => "--tpot-p99-limit-ms",
            Bound::TtftP99LimitMs => "--ttft-p99-limit-ms",
            Bound::QueueWaitP99LimitMs => "--queue-wait-p99-limit-ms",
            Bound::MinTokensPerS => "--min-tokens-per-s",
        }
    }

    /// What it bounds, in words.
    fn label(self) -> &'static str {
        match self {
            Bound::TpotP99LimitMs => "TPOT p99",
            Bound::TtftP99LimitMs => "TTFT p99",
            Bound::QueueWaitP99LimitMs => "queue wait p99",
            Bound::MinTokensPerS => "throughput",
        }
    }

    /// "TPOT p99 ≤ 30 ms", "throughput ≥ 100 tokens/s per GPU".
    fn words(self, value: f64) -> String {
        match self {
            Bound::MinTokensPerS => format!("throughput ≥ {value} tokens/s per GPU"),
            _ => format!("{} ≤ {value} ms", self.label()),
        }
    }

    /// A lower limit is stricter, a higher floor is stricter.
    fn stricter(self, a: f64, than: f64) -> bool {
        match self {
            Bound::MinTokensPerS => a > than,
            _ => a < than,
        }
    }

    fn of(self, objective: &Objective) -> Option<f64> {
        match self {
            Bound::TpotP99LimitMs => objective.tpot_p99_limit_ms,
            Bound::TtftP99LimitMs => objective.ttft_p99_limit_ms,
            Bound::QueueWaitP99LimitMs => objective.queue_wait_p99_limit_ms,
            Bound::MinTokensPerS => objective.min_tokens_per_s,
        }
    }

    fn set(self, objective: &mut Objective, value: Option<f64>) {
        let slot = match self {
            Bound::TpotP99LimitMs => &mut objective.tpot_p99_limit_ms,
            Bound::TtftP99LimitMs => &mut objective.ttft_p99_limit_ms,
            Bound::QueueWaitP99LimitMs => &mut objective.queue_wait_p99_limit_ms,
            Bound::MinTokensPerS => &mut objective.min_tokens_per_s,
        };
        *slot = value;
    }
}

/// Whose a bound is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// A flag of the command.
    Flag,
    /// The node's `serve.toml`.
    ServeToml,
    /// A judging scenario's `[objective]`.
    Scenario,
    /// The policy spec's `[objective]`.
    Spec,
    /// Rules set in code (tokwatt's defaults, a judge's).
    Rules,
}

/// A bound's value and where it was set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SetBy {
    pub value: f64,
    pub source: Source,
    /// The flag (`--tpot-p99-limit-ms`), or the file (serve.toml, scenario, spec), or the
    /// rules' words.
    pub from: String,
}

impl SetBy {
    /// "--tpot-p99-limit-ms", "spec policies/x.toml", "/etc/tokwatt/serve.toml".
    fn place(&self) -> String {
        match self.source {
            Source::Flag | Source::ServeToml | Source::Rules => self.from.clone(),
            Source::Spec => format!("spec {}", self.from),
            Source::Scenario => format!("scenario {}", self.from),
        }
    }

    /// The value where it was set: "--tpot-p99-limit-ms 70", "tpot_p99_limit_ms = 70 in
    /// /etc/tokwatt/serve.toml".
    fn value_words(&self, bound: Bound) -> String {
        match self.source {
            Source::Flag => format!("{} {}", self.from, self.value),
            Source::Rules => format!("{} ({})", self.value, self.from),
            _ => format!("{} = {} in {}", bound.key(), self.value, self.place()),
        }
    }
}

/// One bound in force.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BoundInForce {
    pub bound: Bound,
    #[serde(flatten)]
    pub set_by: SetBy,
    /// The operator's bound the spec's stricter one replaced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub narrowed: Option<SetBy>,
}

/// A spec's bound looser than the operator's: the operator's holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SetAside {
    pub bound: Bound,
    /// The spec's bound, not applied.
    pub spec: SetBy,
    /// The operator's, which holds.
    pub operator: SetBy,
}

/// The objective a command holds the policy to, bound by bound with where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ObjectiveInForce {
    /// The merged objective: what the policy's `init` is told and its ticks are judged by.
    pub objective: Objective,
    /// Each bound set, in [`Bound::ALL`]'s order; a bound absent here bounds nothing.
    pub bounds: Vec<BoundInForce>,
    /// The spec's bounds looser than the operator's, not applied (`ab`, `tune`; `run` and
    /// `serve` refuse such a spec instead).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub set_aside: Vec<SetAside>,
}

impl ObjectiveInForce {
    /// The operator's objective (from `rules`) narrowed by the spec's at `spec_path`: each
    /// bound is the stricter of the two, the one that is set where only one is. A spec's
    /// throughput floor of 0 is no floor (specs write it so).
    pub fn merge(
        operator: &Objective,
        rules: &RulesSource,
        spec: &Objective,
        spec_path: &Path,
    ) -> Self {
        let operator_set_by = |bound: Bound, value: f64| {
            let (source, from) = match &rules.origin {
                RulesOrigin::Flags => (Source::Flag, bound.flag().to_owned()),
                RulesOrigin::ServeToml(path) => (Source::ServeToml, path.display().to_string()),
                RulesOrigin::Scenario(path) => (Source::Scenario, path.display().to_string()),
                RulesOrigin::Described => (Source::Rules, rules.words.clone()),
            };
            SetBy {
                value,
                source,
                from,
            }
        };
        let spec_set_by = |value: f64| SetBy {
            value,
            source: Source::Spec,
            from: spec_path.display().to_string(),
        };
        let mut merged = Self {
            objective: Objective::default(),
            bounds: Vec::new(),
            set_aside: Vec::new(),
        };
        for bound in Bound::ALL {
            let spec_value = bound
                .of(spec)
                .filter(|&v| !(bound == Bound::MinTokensPerS && v <= 0.0));
            let in_force = match (bound.of(operator), spec_value) {
                (None, None) => None,
                (Some(o), None) => Some(BoundInForce {
                    bound,
                    set_by: operator_set_by(bound, o),
                    narrowed: None,
                }),
                (None, Some(s)) => Some(BoundInForce {
                    bound,
                    set_by: spec_set_by(s),
                    narrowed: None,
                }),
                (Some(o), Some(s)) if bound.stricter(s, o) => Some(BoundInForce {
                    bound,
                    set_by: spec_set_by(s),
                    narrowed: Some(operator_set_by(bound, o)),
                }),
                // As strict: the operator's, which the spec repeats.
                (Some(o), Some(s)) if s == o => Some(BoundInForce {
                    bound,
                    set_by: operator_set_by(bound, o),
                    narrowed: None,
                }),
                (Some(o), Some(s)) => {
                    merged.set_aside.push(SetAside {
                        bound,
                        spec: spec_set_by(s),
                        operator: operator_set_by(bound, o),
                    });
                    Some(BoundInForce {
                        bound,
                        set_by: operator_set_by(bound, o),
                        narrowed: None,
                    })
                }
            };
            bound.set(
                &mut merged.objective,
                in_force.as_ref().map(|b| b.set_by.value),
            );
            merged.bounds.extend(in_force);
        }
        merged
    }

    /// The bounds the spec narrowed.
    pub fn narrowings(&self) -> impl Iterator<Item = &BoundInForce> {
        self.bounds.iter().filter(|b| b.narrowed.is_some())
    }

    /// What a command prints at its start: a heading line and one line a bound, e.g.
    ///
    /// ```text
    /// objective in force:
    ///   TPOT p99 ≤ 30 ms (spec policies/x.toml, stricter than --tpot-p99-limit-ms 70)
    ///   TTFT p99 ≤ 800 ms (spec policies/x.toml)
    ///   no bound on queue wait p99 or throughput
    /// ```
    pub fn lines(&self) -> Vec<String> {
        let mut lines = Vec::new();
        if self.bounds.is_empty() {
            lines.push(
                "objective in force: none (no objective flag or serve.toml [objective], none in \
                 the spec): only demand turned away counts as a violation"
                    .to_owned(),
            );
        } else {
            lines.push("objective in force:".to_owned());
        }
        for b in &self.bounds {
            let whose = match &b.narrowed {
                Some(operator) => format!(
                    "{}, stricter than {}",
                    b.set_by.place(),
                    operator.value_words(b.bound)
                ),
                None => b.set_by.place(),
            };
            lines.push(format!("  {} ({whose})", b.bound.words(b.set_by.value)));
        }
        for s in &self.set_aside {
            lines.push(format!(
                "  {}: the spec's {} is looser than {}, which holds (a policy may only narrow the operator's objective)",
                s.bound.label(),
                s.spec.value_words(s.bound),
                s.operator.value_words(s.bound)
            ));
        }
        let unbounded: Vec<&str> = Bound::ALL
            .into_iter()
            .filter(|bound| !self.bounds.iter().any(|b| b.bound == *bound))
            .map(Bound::label)
            .collect();
        if !self.bounds.is_empty() && !unbounded.is_empty() {
            lines.push(format!("  no bound on {}", or_list(&unbounded)));
        }
        lines
    }
}

/// "a", "a or b", "a, b or c".
fn or_list(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => (*one).to_owned(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn objective(
        tpot: Option<f64>,
        ttft: Option<f64>,
        queue: Option<f64>,
        floor: Option<f64>,
    ) -> Objective {
        Objective {
            tpot_p99_limit_ms: tpot,
            ttft_p99_limit_ms: ttft,
            queue_wait_p99_limit_ms: queue,
            min_tokens_per_s: floor,
        }
    }

    fn flags() -> RulesSource {
        RulesSource::new(RulesOrigin::Flags, "the node's rules from the command line")
    }

    const SPEC: &str = "policies/x.toml";

    #[test]
    fn a_stricter_spec_narrows_and_says_whose_bound_it_replaced() {
        let merged = ObjectiveInForce::merge(
            &objective(Some(70.0), None, None, None),
            &flags(),
            &objective(Some(30.0), Some(800.0), None, None),
            Path::new(SPEC),
        );
        assert_eq!(
            merged.objective,
            objective(Some(30.0), Some(800.0), None, None)
        );
        let tpot = &merged.bounds[0];
        assert_eq!(
            (tpot.bound, tpot.set_by.source),
            (Bound::TpotP99LimitMs, Source::Spec)
        );
        let narrowed = tpot.narrowed.as_ref().expect("the flag's bound narrowed");
        assert_eq!((narrowed.source, narrowed.value), (Source::Flag, 70.0));
        assert_eq!(narrowed.from, "--tpot-p99-limit-ms");
        assert_eq!(merged.narrowings().count(), 1);
        assert!(merged.set_aside.is_empty());
        assert_eq!(
            merged.lines(),
            [
                "objective in force:",
                "  TPOT p99 ≤ 30 ms (spec policies/x.toml, stricter than --tpot-p99-limit-ms 70)",
                "  TTFT p99 ≤ 800 ms (spec policies/x.toml)",
                "  no bound on queue wait p99 or throughput",
            ]
        );
    }

    #[test]
    fn each_operator_source_is_named() {
        let operator = objective(Some(50.0), None, None, Some(100.0));
        let spec = objective(Some(40.0), None, None, None);
        let cases = [
            (
                RulesSource::new(RulesOrigin::Flags, "flags"),
                Source::Flag,
                "  TPOT p99 ≤ 40 ms (spec policies/x.toml, stricter than --tpot-p99-limit-ms 50)",
                "  throughput ≥ 100 tokens/s per GPU (--min-tokens-per-s)",
            ),
            (
                RulesSource::new(
                    RulesOrigin::ServeToml("/etc/tokwatt/serve.toml".into()),
                    "serve",
                ),
                Source::ServeToml,
                "  TPOT p99 ≤ 40 ms (spec policies/x.toml, stricter than tpot_p99_limit_ms = 50 in /etc/tokwatt/serve.toml)",
                "  throughput ≥ 100 tokens/s per GPU (/etc/tokwatt/serve.toml)",
            ),
            (
                RulesSource::new(
                    RulesOrigin::Scenario("scenarios/chat.toml".into()),
                    "scenario",
                ),
                Source::Scenario,
                "  TPOT p99 ≤ 40 ms (spec policies/x.toml, stricter than tpot_p99_limit_ms = 50 in scenario scenarios/chat.toml)",
                "  throughput ≥ 100 tokens/s per GPU (scenario scenarios/chat.toml)",
            ),
            (
                RulesSource::from("the judge's rules"),
                Source::Rules,
                "  TPOT p99 ≤ 40 ms (spec policies/x.toml, stricter than 50 (the judge's rules))",
                "  throughput ≥ 100 tokens/s per GPU (the judge's rules)",
            ),
        ];
        for (rules, source, tpot, floor) in cases {
            let merged = ObjectiveInForce::merge(&operator, &rules, &spec, Path::new(SPEC));
            assert_eq!(merged.bounds[1].set_by.source, source);
            let lines = merged.lines();
            assert_eq!(lines[1], tpot);
            assert_eq!(lines[2], floor);
        }
    }

    #[test]
    fn a_looser_spec_bound_is_set_aside_and_said() {
        let merged = ObjectiveInForce::merge(
            &objective(Some(50.0), None, None, Some(1000.0)),
            &flags(),
            &objective(Some(80.0), None, None, Some(10.0)),
            Path::new(SPEC),
        );
        assert_eq!(
            merged.objective,
            objective(Some(50.0), None, None, Some(1000.0))
        );
        assert!(
            merged
                .bounds
                .iter()
                .all(|b| b.set_by.source == Source::Flag)
        );
        assert_eq!(merged.narrowings().count(), 0);
        assert_eq!(merged.set_aside.len(), 2);
        assert_eq!(merged.set_aside[0].spec.value, 80.0);
        assert_eq!(merged.set_aside[0].operator.value, 50.0);
        let lines = merged.lines();
        assert!(
            lines.contains(
                &"  TPOT p99: the spec's tpot_p99_limit_ms = 80 in spec policies/x.toml is looser than --tpot-p99-limit-ms 50, which holds (a policy may only narrow the operator's objective)"
                    .to_owned()
            ),
            "{lines:#?}"
        );
    }

    #[test]
    fn missing_bounds_come_from_whichever_side_sets_them() {
        // Only the operator's; only the spec's; neither.
        let merged = ObjectiveInForce::merge(
            &objective(None, Some(2000.0), None, None),
            &flags(),
            &objective(None, None, Some(500.0), Some(0.0)),
            Path::new(SPEC),
        );
        assert_eq!(
            merged.objective,
            objective(None, Some(2000.0), Some(500.0), None)
        );
        assert_eq!(merged.bounds.len(), 2);
        assert_eq!(merged.bounds[0].set_by.source, Source::Flag);
        assert_eq!(merged.bounds[1].set_by.source, Source::Spec);
        let none = ObjectiveInForce::merge(
            &Objective::default(),
            &flags(),
            &Objective::default(),
            Path::new(SPEC),
        );
        assert_eq!(none.objective, Objective::default());
        assert!(none.bounds.is_empty());
        assert_eq!(none.lines().len(), 1);
        assert!(none.lines()[0].starts_with("objective in force: none"));
    }

    #[test]
    fn an_equal_spec_bound_leaves_the_operators() {
        let merged = ObjectiveInForce::merge(
            &objective(Some(50.0), None, None, None),
            &flags(),
            &objective(Some(50.0), None, None, None),
            Path::new(SPEC),
        );
        assert_eq!(merged.bounds[0].set_by.source, Source::Flag);
        assert!(merged.bounds[0].narrowed.is_none());
        assert!(merged.set_aside.is_empty());
    }

    #[test]
    fn it_serializes_with_sources() {
        let merged = ObjectiveInForce::merge(
            &objective(Some(70.0), None, None, None),
            &flags(),
            &objective(Some(30.0), None, None, None),
            Path::new(SPEC),
        );
        let json = serde_json::to_value(&merged).expect("serializes");
        assert_eq!(json["bounds"][0]["bound"], "tpot_p99_limit_ms");
        assert_eq!(json["bounds"][0]["source"], "spec");
        assert_eq!(json["bounds"][0]["narrowed"]["source"], "flag");
        assert_eq!(json["bounds"][0]["narrowed"]["from"], "--tpot-p99-limit-ms");
        assert!(json.get("set_aside").is_none());
        let back: ObjectiveInForce = serde_json::from_value(json).expect("reads back");
        assert_eq!(back, merged);
    }
}
