//! Hot swap (invariant 5): a new policy is loaded, instantiated and initialised off the
//! loop ([`crate::prepare_policy`]), sent to the loop through a [`SwapSender`],
//! and takes over at the next tick boundary, so no tick is missed. Its state comes from
//! the old policy through `snapshot`/`restore` where the new one accepts it (a policy
//! refuses a snapshot whose schema it does not know, and then starts fresh). The old
//! policy is kept for a probation of a few ticks: if the new one fails in that time, the
//! old one comes back by itself.

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, Sender, TryRecvError};

use serde::{Deserialize, Serialize};

use tokwatt_core::types::{InForce, Objective, Settings};
use tokwatt_policy::envelope::Envelope;
use tokwatt_policy::supervisor::{PolicyState, Supervisor};

/// Ticks after a swap during which a failure of the new policy brings the old one back.
pub const DEFAULT_PROBATION_TICKS: u64 = 10;

/// A policy started off the loop, ready to take over.
#[derive(Debug)]
pub struct PreparedPolicy {
    pub supervisor: Supervisor,
    /// What its `init` returned: applied at the boundary as that tick's decision.
    pub first: Vec<Settings>,
    /// Its spec's envelope (guardrails and granted knobs).
    pub envelope: Envelope,
    pub objective: Objective,
    /// Ticks of probation (see the module docs).
    pub probation_ticks: u64,
    /// Told when it takes over and when its probation ends (whoever asked for the swap
    /// waits on it); `None` when nobody waits.
    pub notify: Option<Sender<SwapEvent>>,
    /// Where its state comes from when it takes over.
    pub state: StateOnSwap,
    /// The operator brings back an earlier policy (`tokwatt policy rollback`): counted
    /// as an operator rollback, not as a swap.
    pub operator_rollback: bool,
}

/// Where a swapped-in policy's state comes from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StateOnSwap {
    /// The outgoing policy's snapshot, where the new one accepts it (an operator's swap).
    #[default]
    FromOutgoing,
    /// None: it starts as `init` left it. `tokwatt ab` starts every trajectory this way,
    /// so no epoch learns from another.
    Fresh,
}

/// What became of a swapped-in policy, sent through [`PreparedPolicy::notify`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwapEvent {
    /// It took charge at `tick`, with the old policy's state or fresh.
    TookOver { tick: u64, state_carried: bool },
    /// It lasted its probation and stays.
    Kept { tick: u64 },
    /// It failed in probation at `tick`; the previous policy is back.
    RolledBack { tick: u64 },
    /// Another swap replaced it during its probation.
    Replaced { tick: u64 },
    /// The loop was paused when it arrived: it was dropped, and the policy in charge stays.
    RefusedWhilePaused { tick: u64 },
}

/// The sending half: whoever prepares policies (an API handler, a test) holds it.
#[derive(Debug, Clone)]
pub struct SwapSender(Sender<PreparedPolicy>);

impl SwapSender {
    /// Queue `policy` for the next tick boundary. Fails (giving it back) when the loop
    /// has ended.
    pub fn send(&self, policy: PreparedPolicy) -> Result<(), Box<PreparedPolicy>> {
        self.0.send(policy).map_err(|error| Box::new(error.0))
    }
}

/// The loop's half.
#[derive(Debug)]
pub struct SwapPort(Receiver<PreparedPolicy>);

/// A connected pair.
pub fn swap_channel() -> (SwapSender, SwapPort) {
    let (tx, rx) = std::sync::mpsc::channel();
    (SwapSender(tx), SwapPort(rx))
}

/// What swaps did, for the summary.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwapCounters {
    /// New policies that took over (an operator's rollback not included).
    pub swaps: u64,
    /// Earlier policies the operator brought back (`tokwatt policy rollback`); they take
    /// over as a swap does, probation included.
    pub operator_rollbacks: u64,
    /// Take-overs (swaps and operator rollbacks) whose policy took the old one's state.
    pub state_carried: u64,
    /// Take-overs whose policy started fresh (no state, or a schema it refused).
    pub started_fresh: u64,
    /// New policies that failed in probation and were replaced by the old one again.
    pub rollbacks: u64,
    /// Of the rollbacks, those for breaking the objective in probation on more ticks
    /// than the policy they replaced had broken it (a valid but harmful policy).
    pub objective_rollbacks: u64,
}

/// The longest probation whose objective comparison is kept (ticks of history).
const MAX_HISTORY_TICKS: usize = 10_000;

/// The policy that was in charge before a swap, kept until the new one has proven itself.
#[derive(Debug)]
struct OnProbation {
    previous: Supervisor,
    previous_envelope: Envelope,
    previous_objective: Objective,
    /// The settings in force when it took over: the previous policy's, put back on a
    /// rollback so that it resumes from where it was, not from the failed policy's.
    previous_in_force: Vec<InForce>,
    until_tick: u64,
    notify: Option<Sender<SwapEvent>>,
    /// The tick it took over: that tick's window is the previous policy's.
    since_tick: u64,
    /// Ticks its settings broke the objective so far.
    violations: u64,
    /// The most it may break it: what the previous policy broke over as many ticks
    /// before the swap, plus the allowance. `None`: the objective is not judged.
    violations_allowed: Option<u64>,
}

fn tell(notify: &Option<Sender<SwapEvent>>, event: SwapEvent) {
    if let Some(notify) = notify {
        // Nobody waiting any more is fine: the swap stands either way.
        let _ = notify.send(event);
    }
}

/// Give `state` to the incoming policy; whether it took it.
fn restore_into(incoming: &mut Supervisor, state: &PolicyState, old: &str, new: &str) -> bool {
    match incoming.restore(state) {
        Ok(()) => true,
        Err(failure) => {
            tracing::info!(
                old,
                new,
                "the new policy did not take the state it was given ({failure}); it starts fresh"
            );
            false
        }
    }
}

/// The loop's side of swapping: receives prepared policies and keeps the one replaced.
#[derive(Debug)]
pub struct Swapper {
    port: Option<SwapPort>,
    probation: Option<OnProbation>,
    pub counters: SwapCounters,
    /// Whether each recent tick's window broke the objective under the policy in charge
    /// (newest last), for the probation's comparison.
    history: VecDeque<bool>,
    /// Extra violation ticks a new policy may have in probation; `None`: probation does
    /// not judge the objective.
    objective_allowance: Option<u64>,
}

/// Who is in charge: the parts of the loop a swap replaces.
#[derive(Debug)]
pub struct InCharge<'a> {
    pub supervisor: &'a mut Supervisor,
    pub envelope: &'a mut Envelope,
    pub objective: &'a mut Objective,
}

impl Swapper {
    pub fn new(port: Option<SwapPort>) -> Self {
        Self {
            port,
            probation: None,
            counters: SwapCounters::default(),
            history: VecDeque::new(),
            objective_allowance: None,
        }
    }

    /// Judge a swapped-in policy on the objective too: it is rolled back once it breaks
    /// the objective in probation on more than `allowance` ticks beyond what the policy
    /// it replaced broke over as many ticks before the swap.
    pub fn judge_objective(mut self, allowance: Option<u64>) -> Self {
        self.objective_allowance = allowance;
        self
    }

    /// At a tick boundary of a paused loop: drop every waiting policy, telling whoever
    /// sent it. A pause holds the policy in charge; a swap prepared while the pause came
    /// must not take over unseen at the next resume.
    pub fn refuse_while_paused(&mut self, tick: u64) {
        let Some(port) = self.port.as_ref() else {
            return;
        };
        loop {
            match port.0.try_recv() {
                Ok(refused) => {
                    tracing::info!(
                        policy = %refused.supervisor.policy_name(),
                        "a swap arrived while paused: dropped"
                    );
                    tell(&refused.notify, SwapEvent::RefusedWhilePaused { tick });
                }
                Err(TryRecvError::Empty) => return,
                Err(TryRecvError::Disconnected) => {
                    self.port = None;
                    return;
                }
            }
        }
    }

    /// At a tick boundary: switch in a waiting policy, if any. Returns its first
    /// settings, which decide this tick. `in_force`: each GPU's settings now, the outgoing
    /// policy's, to put back if the new one is rolled back.
    pub fn take_over(
        &mut self,
        tick: u64,
        in_charge: InCharge<'_>,
        in_force: &[InForce],
    ) -> Option<Vec<Settings>> {
        let port = self.port.as_ref()?;
        let mut next = match port.0.try_recv() {
            Ok(next) => next,
            Err(TryRecvError::Empty) => return None,
            Err(TryRecvError::Disconnected) => {
                self.port = None;
                return None;
            }
        };
        let old_name = in_charge.supervisor.policy_name().to_owned();
        let new_name = next.supervisor.policy_name().to_owned();
        let carried = match next.state {
            StateOnSwap::FromOutgoing => match in_charge.supervisor.snapshot() {
                Ok(state) => restore_into(&mut next.supervisor, &state, &old_name, &new_name),
                Err(failure) => {
                    tracing::info!(
                        old = %old_name,
                        new = %new_name,
                        "the old policy gave no state ({failure}); the new one starts fresh"
                    );
                    false
                }
            },
            StateOnSwap::Fresh => false,
        };
        if next.operator_rollback {
            self.counters.operator_rollbacks += 1;
        } else {
            self.counters.swaps += 1;
        }
        if carried {
            self.counters.state_carried += 1;
        } else {
            self.counters.started_fresh += 1;
        }
        std::mem::swap(in_charge.supervisor, &mut next.supervisor);
        std::mem::swap(in_charge.envelope, &mut next.envelope);
        std::mem::swap(in_charge.objective, &mut next.objective);
        tracing::info!(
            old = %old_name,
            new = %new_name,
            tick,
            carried,
            operator_rollback = next.operator_rollback,
            "policy swapped in"
        );
        tell(
            &next.notify,
            SwapEvent::TookOver {
                tick,
                state_carried: carried,
            },
        );
        // A swap during another's probation drops the older policy: the one in charge
        // just before this swap is the one to come back to.
        if let Some(replaced) = self.probation.take() {
            tell(&replaced.notify, SwapEvent::Replaced { tick });
        }
        let before: u64 = self
            .history
            .iter()
            .rev()
            .take(usize::try_from(next.probation_ticks).unwrap_or(usize::MAX))
            .map(|&v| u64::from(v))
            .sum();
        self.probation = Some(OnProbation {
            previous: next.supervisor,
            previous_envelope: next.envelope,
            previous_objective: next.objective,
            previous_in_force: in_force.to_vec(),
            until_tick: tick + next.probation_ticks,
            notify: next.notify.take(),
            since_tick: tick,
            violations: 0,
            violations_allowed: self.objective_allowance.map(|a| before + a),
        });
        Some(next.first)
    }

    /// After a tick's decision: a policy in probation that failed, or that broke the
    /// objective more than the one before it, is replaced by that one; one that lasted its
    /// probation is kept for good. `violated`: this tick's window broke the objective under
    /// the policy in charge (not under the guard's fallback or a pause). Returns, on a
    /// rollback, the settings that were in force when the failed policy took over (the
    /// restored policy's, for the loop to put back).
    pub fn judge(
        &mut self,
        tick: u64,
        failed: bool,
        violated: bool,
        in_charge: InCharge<'_>,
    ) -> Option<Vec<InForce>> {
        if self.history.len() == MAX_HISTORY_TICKS {
            self.history.pop_front();
        }
        self.history.push_back(violated);
        let mut probation = self.probation.take()?;
        // The swap tick's window shows the previous policy's settings.
        if tick > probation.since_tick {
            probation.violations += u64::from(violated);
        }
        let harmful = probation
            .violations_allowed
            .is_some_and(|allowed| probation.violations > allowed);
        if failed || harmful {
            let mut probation = probation;
            if harmful {
                tracing::warn!(
                    harmful = in_charge.supervisor.policy_name(),
                    back = probation.previous.policy_name(),
                    tick,
                    violation_ticks = probation.violations,
                    allowed = probation.violations_allowed,
                    "the new policy broke the objective in probation more often than the one it replaced; the previous policy is back"
                );
                self.counters.objective_rollbacks += 1;
            } else {
                tracing::warn!(
                    failed = in_charge.supervisor.policy_name(),
                    back = probation.previous.policy_name(),
                    tick,
                    "the new policy failed in probation; the previous policy is back"
                );
            }
            std::mem::swap(in_charge.supervisor, &mut probation.previous);
            std::mem::swap(in_charge.envelope, &mut probation.previous_envelope);
            std::mem::swap(in_charge.objective, &mut probation.previous_objective);
            self.counters.rollbacks += 1;
            tell(&probation.notify, SwapEvent::RolledBack { tick });
            // The rolled-back policy's ticks are not the restored one's record.
            self.history.clear();
            return Some(probation.previous_in_force);
        } else if tick < probation.until_tick {
            self.probation = Some(probation);
        } else {
            tell(&probation.notify, SwapEvent::Kept { tick });
        }
        None
    }

    /// Whether a swapped-in policy is still on probation.
    pub fn on_probation(&self) -> bool {
        self.probation.is_some()
    }
}
