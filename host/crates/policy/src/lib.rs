//! The policy boundary as the control loop sees it, with no WebAssembly in sight:
//!
//! - [`supervisor`]: a [`supervisor::PolicyEngine`] (the plugin crate implements it) wrapped
//!   in a supervisor that turns every failure into a fallback decision and ejects a failing
//!   policy (the breaker).
//! - [`envelope`]: the operator's guardrails, clamping and rate-limiting every decision.
//! - [`guard`]: the objective guard, which takes the node from a policy that is valid and
//!   wrong.
//! - [`rules`]: the node's rules file (what a policy may be given on this node).
//! - [`in_force`]: the objective in force, bound by bound with where it came from.
//! - [`spec`]: the policy spec (plugin, params, objective, guardrails, sandbox limits).
//! - [`limits`]: the sandbox limits a spec sets and the plugin crate enforces.

pub mod envelope;
pub mod guard;
pub mod in_force;
pub mod limits;
pub mod rules;
pub mod spec;
pub mod supervisor;
