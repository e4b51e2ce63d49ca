//! The objective guard (invariant 8): the host's defence of the service against a policy
//! that is valid and wrong. The sandbox and the breaker catch a policy that fails; a
//! policy that answers on time, inside the guardrails, and starves the service fails no
//! call. The guard watches the objective instead: when the policy's settings break it on
//! too many of the recent ticks, the guard takes the node over with settings known to
//! meet it (the device defaults), holds them for a back-off that doubles at each
//! take-over (as the breaker's does), then hands back. Every take-over is counted,
//! logged and exported.
//!
//! A tick's observation covers the window after the previous tick's decision, so a
//! violation is charged to whoever decided that previous tick. Ticks that the fallback
//! breaks as well tell the guard the demand is beyond what the GPU serves at any
//! setting: a take-over whose fallback breaks the objective on all its first ticks but
//! the switch's own hands back at once, one that breaks it on half its ticks or more is
//! *unservable* too; neither raises the back-off, and the policy's violations are not
//! held against it for a while (`takeover_ticks`, doubled at each unservable take-over
//! in a row), so a saturated node is probed now and then, not taken from its policy.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// The guard's settings: `[guard]` in serve.toml, flags of `run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GuardConfig {
    /// `false`: the policy's violations are counted, never acted on.
    pub enabled: bool,
    /// The recent ticks the guard looks at.
    pub window_ticks: u32,
    /// Ticks within the window whose objective the policy broke that make the guard take over.
    pub max_violation_ticks: u32,
    /// Ticks the first take-over lasts; doubled at each take-over.
    pub takeover_ticks: u64,
    /// Longest take-over.
    pub max_takeover_ticks: u64,
    /// Ticks of the policy meeting the objective after which earlier take-overs are
    /// forgiven (the next one lasts `takeover_ticks` again).
    pub forgive_after_ticks: u64,
    /// Ticks a swapped-in policy may break the objective in its probation beyond what the
    /// policy it replaced broke over as many ticks before the swap, before it is rolled
    /// back (one lets the settling tick after a switch pass).
    pub probation_allowance_ticks: u32,
}

impl Default for GuardConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            window_ticks: 20,
            max_violation_ticks: 5,
            takeover_ticks: 30,
            max_takeover_ticks: 960,
            forgive_after_ticks: 600,
            probation_allowance_ticks: 1,
        }
    }
}

/// A guard setting that makes no sense, named by its key in `[guard]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("[guard] {key} {problem}")]
pub struct GuardConfigError {
    pub key: &'static str,
    pub problem: String,
}

impl GuardConfig {
    /// Refuse settings that parse but make no sense.
    pub fn validate(&self) -> Result<(), GuardConfigError> {
        let error = |key, problem: String| Err(GuardConfigError { key, problem });
        if !(1..=10_000).contains(&self.window_ticks) {
            return error("window_ticks", "must be between 1 and 10000".into());
        }
        if self.max_violation_ticks == 0 || self.max_violation_ticks > self.window_ticks {
            return error(
                "max_violation_ticks",
                format!(
                    "= {} must be between 1 and window_ticks ({})",
                    self.max_violation_ticks, self.window_ticks
                ),
            );
        }
        if self.takeover_ticks == 0 {
            return error(
                "takeover_ticks",
                "must be at least 1 (0 would hand a starving policy the node straight back)".into(),
            );
        }
        if self.max_takeover_ticks < self.takeover_ticks {
            return error(
                "max_takeover_ticks",
                format!(
                    "({}) is below takeover_ticks ({})",
                    self.max_takeover_ticks, self.takeover_ticks
                ),
            );
        }
        if self.forgive_after_ticks == 0 {
            return error(
                "forgive_after_ticks",
                "must be at least 1 (0 would forgive a policy after every good tick, so its back-off never grows)".into(),
            );
        }
        if self.probation_allowance_ticks > self.window_ticks {
            return error(
                "probation_allowance_ticks",
                format!("must be at most window_ticks ({})", self.window_ticks),
            );
        }
        Ok(())
    }
}

/// What the guard did, for `summary.json`, the status and the metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuardCounters {
    /// Times the guard took the node over from the policy.
    pub takeovers: u64,
    /// Take-overs whose fallback broke the objective as well (demand beyond the GPU).
    pub unservable_takeovers: u64,
    /// Ticks decided by the guard's fallback.
    pub takeover_ticks: u64,
    /// Ticks the policy's own settings broke the objective (charged to the policy).
    pub policy_violation_ticks: u64,
    /// Ticks the fallback's settings broke the objective.
    pub fallback_violation_ticks: u64,
    /// Violations of the policy's not held against it after an unservable take-over.
    pub excused_violation_ticks: u64,
}

/// Who decided the tick whose window an observation covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decider {
    /// The policy in charge (or its supervisor's fallback, which holds its settings).
    Policy,
    /// The guard's fallback: the device defaults.
    Guard,
    /// Nobody: the loop was paused by the operator, or a swap switched policies.
    Operator,
}

/// What happened at a tick, for the log and whoever waits on the loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuardEvent {
    /// The guard took over for `ticks` ticks.
    TookOver { ticks: u64 },
    /// The guard handed the node back; `unservable`: its fallback broke the objective too.
    HandedBack { unservable: bool },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Watching,
    InCharge {
        until_tick: u64,
        ticks: u64,
        violations: u64,
    },
}

/// The guard's state: see the module docs.
#[derive(Debug, Clone)]
pub struct ObjectiveGuard {
    config: GuardConfig,
    recent: VecDeque<bool>,
    state: State,
    /// Take-overs since the last forgiveness (the back-off's exponent).
    level: u32,
    /// Unservable take-overs in a row (the excuse's exponent).
    unservable_streak: u32,
    good_streak: u64,
    excused_until: u64,
    pub counters: GuardCounters,
}

impl ObjectiveGuard {
    pub fn new(config: GuardConfig) -> Self {
        Self {
            config,
            recent: VecDeque::with_capacity(config.window_ticks as usize),
            state: State::Watching,
            level: 0,
            unservable_streak: 0,
            good_streak: 0,
            excused_until: 0,
            counters: GuardCounters::default(),
        }
    }

    pub fn config(&self) -> &GuardConfig {
        &self.config
    }

    /// Whether the guard's fallback decides the current tick.
    pub fn in_charge(&self) -> bool {
        matches!(self.state, State::InCharge { .. })
    }

    /// The policy's violations within the current window.
    pub fn recent_violations(&self) -> u32 {
        self.recent.iter().filter(|&&v| v).count() as u32
    }

    /// A new policy took charge (an operator's swap, a rollback): the window is forgotten,
    /// since its predecessor's ticks are not its own, and a take-over in progress ends, so
    /// the new policy has its own chance.
    pub fn policy_swapped(&mut self) {
        self.recent.clear();
        self.good_streak = 0;
        self.state = State::Watching;
    }

    /// At the start of `tick`, before anyone decides it: `violated` says whether the
    /// window just observed broke the objective, `decided_by` who set what was in force
    /// in it. Returns what the guard did.
    pub fn observe(
        &mut self,
        tick: u64,
        violated: bool,
        decided_by: Decider,
    ) -> Option<GuardEvent> {
        match (self.state, decided_by) {
            (
                State::InCharge {
                    until_tick,
                    ticks,
                    violations,
                },
                _,
            ) => {
                let ticks = ticks + 1;
                let violations = violations + u64::from(violated);
                self.counters.fallback_violation_ticks += u64::from(violated);
                // The first window after the switch shows the change itself; past it, a
                // fallback breaking the objective on every tick probed serves no better.
                let probe = u64::from(self.config.max_violation_ticks) + 1;
                let hopeless = ticks >= probe && violations + 1 >= ticks;
                if tick < until_tick && !hopeless {
                    self.state = State::InCharge {
                        until_tick,
                        ticks,
                        violations,
                    };
                    return None;
                }
                self.state = State::Watching;
                self.recent.clear();
                self.good_streak = 0;
                // The fallback broke it on half its ticks or more: the demand is beyond
                // what the GPU serves at the defaults, so this was no fault of the policy.
                let unservable = hopeless || violations * 2 >= ticks;
                if unservable {
                    self.counters.unservable_takeovers += 1;
                    self.level = self.level.saturating_sub(1);
                    let excuse = self
                        .config
                        .takeover_ticks
                        .saturating_mul(1u64 << self.unservable_streak.min(32))
                        .min(self.config.max_takeover_ticks);
                    self.unservable_streak = self.unservable_streak.saturating_add(1);
                    self.excused_until = tick + excuse;
                } else {
                    self.unservable_streak = 0;
                }
                tracing::info!(
                    tick,
                    unservable,
                    "the objective guard hands the node back to the policy"
                );
                Some(GuardEvent::HandedBack { unservable })
            }
            (State::Watching, Decider::Policy) if self.config.enabled => {
                if violated && tick < self.excused_until {
                    self.counters.excused_violation_ticks += 1;
                    self.push(false);
                    return None;
                }
                self.counters.policy_violation_ticks += u64::from(violated);
                self.push(violated);
                if violated {
                    self.good_streak = 0;
                } else {
                    self.good_streak += 1;
                    if self.good_streak >= self.config.forgive_after_ticks {
                        self.level = 0;
                    }
                }
                if self.recent_violations() < self.config.max_violation_ticks {
                    return None;
                }
                let ticks = self
                    .config
                    .takeover_ticks
                    .saturating_mul(1u64 << self.level.min(32))
                    .min(self.config.max_takeover_ticks);
                self.level = self.level.saturating_add(1);
                self.counters.takeovers += 1;
                self.state = State::InCharge {
                    until_tick: tick + ticks,
                    ticks: 0,
                    violations: 0,
                };
                self.recent.clear();
                tracing::warn!(
                    tick,
                    ticks,
                    window = self.config.window_ticks,
                    violations = self.config.max_violation_ticks,
                    "the policy's settings broke the objective too often: the objective guard takes over with the device defaults"
                );
                Some(GuardEvent::TookOver { ticks })
            }
            (State::Watching, Decider::Policy) => {
                // Disabled: counted, never acted on.
                self.counters.policy_violation_ticks += u64::from(violated);
                None
            }
            (State::Watching, _) => None,
        }
    }

    fn push(&mut self, violated: bool) {
        if self.recent.len() == self.config.window_ticks as usize {
            self.recent.pop_front();
        }
        self.recent.push_back(violated);
    }

    /// Count a tick the guard's fallback decided.
    pub fn count_takeover_tick(&mut self) {
        self.counters.takeover_ticks += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> GuardConfig {
        GuardConfig {
            window_ticks: 10,
            max_violation_ticks: 3,
            takeover_ticks: 5,
            max_takeover_ticks: 20,
            forgive_after_ticks: 50,
            ..GuardConfig::default()
        }
    }

    /// Drive the guard: each tick's violation is `violates(tick, in_charge)`.
    fn drive(
        guard: &mut ObjectiveGuard,
        ticks: std::ops::Range<u64>,
        violates: impl Fn(u64, bool) -> bool,
    ) -> Vec<GuardEvent> {
        let mut events = Vec::new();
        let mut decider = if guard.in_charge() {
            Decider::Guard
        } else {
            Decider::Policy
        };
        for tick in ticks {
            let violated = violates(tick, decider == Decider::Guard);
            events.extend(guard.observe(tick, violated, decider));
            decider = if guard.in_charge() {
                guard.count_takeover_tick();
                Decider::Guard
            } else {
                Decider::Policy
            };
        }
        events
    }

    #[test]
    fn a_starving_policy_is_taken_over_after_the_stated_violations_and_backs_off() {
        let mut guard = ObjectiveGuard::new(config());
        // The policy always breaks the objective; the defaults never do.
        let events = drive(&mut guard, 0..100, |_, guard_decided| !guard_decided);
        assert_eq!(events[0], GuardEvent::TookOver { ticks: 5 });
        assert_eq!(events[2], GuardEvent::TookOver { ticks: 10 });
        assert_eq!(events[4], GuardEvent::TookOver { ticks: 20 });
        assert_eq!(events[6], GuardEvent::TookOver { ticks: 20 }, "capped");
        // Three violations before each take-over, none while the guard holds the node.
        let c = &guard.counters;
        assert_eq!(c.fallback_violation_ticks, 0);
        assert_eq!(c.unservable_takeovers, 0);
        assert_eq!(c.policy_violation_ticks, 3 * c.takeovers);
        assert!(c.takeover_ticks > 80, "{c:?}");
    }

    #[test]
    fn violations_the_defaults_break_too_are_not_held_against_the_policy() {
        let mut guard = ObjectiveGuard::new(config());
        // Demand beyond the GPU: everyone breaks the objective.
        let events = drive(&mut guard, 0..40, |_, _| true);
        assert_eq!(events[0], GuardEvent::TookOver { ticks: 5 });
        assert_eq!(events[1], GuardEvent::HandedBack { unservable: true });
        // Excused for as long as the take-over lasted, then judged again at the same
        // back-off (not doubled).
        assert_eq!(events[2], GuardEvent::TookOver { ticks: 5 });
        assert!(guard.counters.excused_violation_ticks >= 5);
        assert!(
            events
                .iter()
                .all(|e| !matches!(e, GuardEvent::HandedBack { unservable: false })),
            "{events:?}"
        );
        let handed_back = events
            .iter()
            .filter(|e| matches!(e, GuardEvent::HandedBack { .. }))
            .count() as u64;
        assert_eq!(guard.counters.unservable_takeovers, handed_back);
    }

    #[test]
    fn a_policy_that_meets_the_objective_is_never_taken_over() {
        let mut guard = ObjectiveGuard::new(config());
        // Two violations in every ten ticks: under the limit of three.
        let events = drive(&mut guard, 0..1000, |tick, _| tick % 5 == 0);
        assert!(events.is_empty(), "{events:?}");
        assert_eq!(guard.counters.policy_violation_ticks, 200);
    }

    #[test]
    fn a_disabled_guard_counts_and_never_acts() {
        let mut guard = ObjectiveGuard::new(GuardConfig {
            enabled: false,
            ..config()
        });
        let events = drive(&mut guard, 0..50, |_, _| true);
        assert!(events.is_empty());
        assert_eq!(guard.counters.policy_violation_ticks, 50);
    }

    #[test]
    fn ticks_nobody_decided_are_not_the_policys() {
        let mut guard = ObjectiveGuard::new(config());
        for tick in 0..20 {
            assert_eq!(guard.observe(tick, true, Decider::Operator), None);
        }
        assert_eq!(guard.counters.policy_violation_ticks, 0);
    }

    #[test]
    fn forgiveness_restarts_the_back_off() {
        let mut guard = ObjectiveGuard::new(config());
        let events = drive(&mut guard, 0..20, |_, g| !g);
        assert!(events.contains(&GuardEvent::TookOver { ticks: 10 }));
        // A long good stretch, then trouble again: the first back-off length again.
        let events = drive(&mut guard, 20..200, |tick, g| tick >= 150 && !g);
        let first = events
            .iter()
            .find(|e| matches!(e, GuardEvent::TookOver { .. }))
            .copied();
        assert_eq!(first, Some(GuardEvent::TookOver { ticks: 5 }), "{events:?}");
    }

    #[test]
    fn nonsense_settings_are_refused_by_key() {
        let bad = |c: GuardConfig| c.validate().unwrap_err().key;
        let good = GuardConfig::default();
        assert!(good.validate().is_ok());
        assert_eq!(
            bad(GuardConfig {
                window_ticks: 0,
                ..good
            }),
            "window_ticks"
        );
        assert_eq!(
            bad(GuardConfig {
                max_violation_ticks: 21,
                ..good
            }),
            "max_violation_ticks"
        );
        assert_eq!(
            bad(GuardConfig {
                takeover_ticks: 0,
                ..good
            }),
            "takeover_ticks"
        );
        assert_eq!(
            bad(GuardConfig {
                max_takeover_ticks: 1,
                ..good
            }),
            "max_takeover_ticks"
        );
        assert_eq!(
            bad(GuardConfig {
                forgive_after_ticks: 0,
                ..good
            }),
            "forgive_after_ticks"
        );
    }
}
