//! Write a tokwatt power-efficiency policy in Rust.
//!
//! A policy is a WebAssembly component that the tokwatt agent calls once per control tick
//! with one [`Observation`] per managed GPU; it answers with one [`Settings`] per GPU
//! (power cap, SM clock ceiling, batch size and, where the workload serves prompts, the
//! token budget per step, each optional). The agent clamps every
//! answer to the device's range and the operator's guardrails, so a policy can be wrong
//! but never dangerous, and a policy that traps, hangs or answers nonsense costs one tick.
//!
//! You implement one trait, [`Policy`], and export it with one macro,
//! [`export_policy!`]. This crate generates the bindings to the WIT contract
//! (`tokwatt:policy@0.4.0`, world `policy`) and re-exports its types under short names.
//!
//! # Example
//!
//! A complete policy that lowers the power cap of a GPU while it has nothing to do:
//!
//! ```
//! use tokwatt_policy_sdk::{InitArgs, Knobs, Observation, Params, Policy, Settings, debug};
//!
//! /// Caps an idle GPU at `idle_cap_w` and a busy one at `busy_cap_w`.
//! struct IdleCap {
//!     busy_cap_w: f64,
//!     idle_cap_w: f64,
//! }
//!
//! impl Policy for IdleCap {
//!     fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String> {
//!         if !args.knobs.contains(Knobs::POWER_CAP) {
//!             return Err("idle-cap turns the power cap: grant \"power-cap\" in the spec".into());
//!         }
//!         let params = Params::new(&args.params);
//!         params.check_known(&["busy_cap_w", "idle_cap_w"])?;
//!         let policy = IdleCap {
//!             busy_cap_w: params.get("busy_cap_w", 600.0)?,
//!             idle_cap_w: params.get("idle_cap_w", 250.0)?,
//!         };
//!         // Start busy; the host clamps the cap to each device's range.
//!         let busy = Settings::unchanged().with_power_cap_w(policy.busy_cap_w);
//!         Ok((policy, vec![busy; args.devices.len()]))
//!     }
//!
//!     fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
//!         observations
//!             .iter()
//!             .map(|observation| {
//!                 let idle = observation.tokens == 0 && observation.queue_depth == 0;
//!                 let cap_w = if idle { self.idle_cap_w } else { self.busy_cap_w };
//!                 if (observation.in_force.power_cap_w - cap_w).abs() < 1.0 {
//!                     return Settings::unchanged();
//!                 }
//!                 debug!("gpu {}: idle {idle}, cap {cap_w} W", observation.gpu);
//!                 Settings::unchanged().with_power_cap_w(cap_w)
//!             })
//!             .collect()
//!     }
//! }
//!
//! tokwatt_policy_sdk::export_policy!(IdleCap);
//! # fn main() {}
//! ```
//!
//! The policy keeps no state worth handing over at a hot swap, so it uses the default
//! [`Policy::snapshot`] and [`Policy::restore`]. The shipped `hill-climb` policy shows
//! a stateful one, using [`StateWriter`] and [`StateReader`].
//!
//! # Building
//!
//! A policy is a `cdylib` crate that depends on this one (and nothing else is needed):
//!
//! ```toml
//! [lib]
//! crate-type = ["cdylib"]
//!
//! [dependencies]
//! tokwatt-policy-sdk = { path = "…/plugins/sdk" }
//! ```
//!
//! `cargo build --target wasm32-wasip2 --release` then writes a component,
//! `target/wasm32-wasip2/release/<crate>.wasm`, that a policy spec names in its `plugin`
//! key. The target must be named: a plain `cargo build` builds the crate for the machine
//! you develop on, where [`export_policy!`] exports nothing (it builds and links, and
//! `cargo test` runs the policy's unit tests natively, but it is no plugin). Install the
//! target once with `rustup target add wasm32-wasip2`.
//!
//! Inside the tokwatt workspace, the host's build script builds every crate under
//! `policies/` and `plugins/fixtures/` with the size-optimised `plugin` profile; to build
//! one by hand, run `cargo build --target wasm32-wasip2 --profile plugin -p <crate>`.
//!
//! # Behaviour at the edges
//!
//! - `decide` before a successful `init` leaves every GPU unchanged (one
//!   [`Settings::unchanged`] per observation) and logs a warning; `snapshot` then returns
//!   [`State::empty`] and `restore` an error.
//! - A second `init` starts over: the previous instance is dropped first.
//! - A panic is a trap: the host counts the tick as failed and falls back to its safe
//!   settings. The panic message goes to the agent's log first, at error level. Return
//!   an `Err` from `init` or `restore` for errors you can explain.
//! - The SDK passes the policy's answers through unchanged; the host, not the SDK,
//!   checks their number and clamps their values.
//!
//! # Testing a policy natively
//!
//! The crate also builds for the machine you develop on, so a policy's unit tests run
//! with plain `cargo test`: call your [`Policy`] methods directly. Off WebAssembly,
//! [`log`] prints to standard error, [`random_u64`] comes from a fixed-seed generator
//! and [`tick_time_ms`] returns 0. The [`testing`] module builds plausible arguments.
//!
//! # More
//!
//! The plugin author's guide, `docs/book/src/policies/contract.md` in the tokwatt repository,
//! describes the contract field by field with units, the sandbox's limits and what
//! exceeding each costs, and the tools (`tokwatt plugin new`, `plugin check`,
//! `plugin test`, `replay`, `ab`) with a worked example. The contract itself is
//! `wit/policy.wit` in this crate, a copy of the repository's.

#![deny(missing_docs)]

mod host;
mod params;
mod runtime;
mod settings;
mod state;
pub mod testing;

pub use host::{log, random_f64, random_u64, tick_time_ms};
pub use params::Params;
pub use state::{StateReader, StateWriter};

/// Bindings generated from `wit/policy.wit`. Use the re-exports at the crate root
/// instead; this module is public only so that [`export_policy!`] can reach it from the
/// policy's crate.
#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        world: "policy",
        path: "wit",
        // The export macro is invoked from the policy's crate, not this one.
        pub_export_macro: true,
        export_macro_name: "__export_policy_world",
        default_bindings_module: "::tokwatt_policy_sdk::bindings",
        additional_derives: [PartialEq],
    });
}

pub use bindings::tokwatt::policy::types::{
    ClockEvents, Demand, DeviceFacts, InForce, InitArgs, Knobs, LogLevel, Objective, Observation,
    Requests, Settings, State,
};

/// A power-efficiency policy. Implement it, then export the type with
/// [`export_policy!`].
///
/// The host creates one instance per loaded plugin with [`Policy::init`] and then calls
/// [`Policy::decide`] once per control tick. At a hot swap it takes
/// [`Policy::snapshot`] of the old version and hands it to [`Policy::restore`] of the
/// new one, after that one's `init`.
pub trait Policy: Sized + 'static {
    /// Creates the policy from the GPUs it manages, the knobs it may turn, the
    /// objective and the spec's parameters (see [`Params`]).
    ///
    /// Returns the instance and the first settings, one per device in `args.devices`
    /// order.
    ///
    /// # Errors
    /// A message that stops the policy from loading and is shown to the operator:
    /// say what is wrong and how to fix the spec.
    fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String>;

    /// Decides the settings for the next interval: exactly one per observation, in the
    /// same order. [`Settings::unchanged`] leaves a GPU as it is.
    fn decide(&mut self, observations: &[Observation]) -> Vec<Settings>;

    /// The state to hand to a new version of this policy at a hot swap.
    ///
    /// The default, for policies without state worth keeping, is [`State::empty`].
    fn snapshot(&self) -> State {
        State::empty()
    }

    /// Takes over state from [`Policy::snapshot`] of an earlier version. Check
    /// `state.schema_version` and reject versions you cannot read.
    ///
    /// The default accepts [`State::empty`] (what a stateless predecessor hands over)
    /// and refuses anything else, since there is nothing to restore it into.
    ///
    /// # Errors
    /// A message the host logs; the policy then continues from its `init` state.
    fn restore(&mut self, state: State) -> Result<(), String> {
        if state.is_empty() {
            return Ok(());
        }
        Err(format!(
            "this policy keeps no state, so it cannot take over {} bytes of schema version {}; \
             it continues from its init state",
            state.bytes.len(),
            state.schema_version
        ))
    }
}

/// Exports a [`Policy`] implementation as the component's `guest` interface.
///
/// Invoke it once, at the top level of the policy's crate:
///
/// ```
/// # use tokwatt_policy_sdk::{InitArgs, Observation, Policy, Settings};
/// # struct MyPolicy;
/// # impl Policy for MyPolicy {
/// #     fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String> {
/// #         Ok((MyPolicy, vec![Settings::unchanged(); args.devices.len()]))
/// #     }
/// #     fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
/// #         vec![Settings::unchanged(); observations.len()]
/// #     }
/// # }
/// tokwatt_policy_sdk::export_policy!(MyPolicy);
/// # fn main() {}
/// ```
///
/// The instance lives in a thread-local slot of the component (WebAssembly components
/// run single-threaded); see the crate documentation for how calls out of order behave.
///
/// The exports are emitted only when the policy's crate is compiled for WebAssembly
/// (`target_arch = "wasm32"`): their symbol names (`tokwatt:policy/guest@0.4.0#decide`)
/// are for the component model, and a native linker refuses them. Built natively — a
/// plain `cargo build`, or `cargo test` for the policy's unit tests — the macro only
/// checks that the type implements [`Policy`], so the crate still builds and links.
#[macro_export]
macro_rules! export_policy {
    ($policy:ty) => {
        // Natively there is no component to export into. Naming the methods keeps the
        // policy type, and what its methods use, from counting as dead code.
        #[cfg(not(target_arch = "wasm32"))]
        const _: () = {
            let _ = <$policy as $crate::Policy>::init;
            let _ = <$policy as $crate::Policy>::decide;
            let _ = <$policy as $crate::Policy>::snapshot;
            let _ = <$policy as $crate::Policy>::restore;
        };

        #[cfg(target_arch = "wasm32")]
        const _: () = {
            ::std::thread_local! {
                static TOKWATT_POLICY_SLOT: $crate::__private::Slot<$policy> =
                    const { $crate::__private::Slot::new() };
            }

            struct TokwattPolicyExport;

            impl $crate::__private::Guest for TokwattPolicyExport {
                fn init(
                    args: $crate::InitArgs,
                ) -> ::core::result::Result<
                    $crate::__private::Vec<$crate::Settings>,
                    $crate::__private::String,
                > {
                    TOKWATT_POLICY_SLOT.with(|slot| slot.init(args))
                }

                fn decide(
                    observations: $crate::__private::Vec<$crate::Observation>,
                ) -> $crate::__private::Vec<$crate::Settings> {
                    TOKWATT_POLICY_SLOT.with(|slot| slot.decide(&observations))
                }

                fn snapshot() -> $crate::State {
                    TOKWATT_POLICY_SLOT.with(|slot| slot.snapshot())
                }

                fn restore(
                    state: $crate::State,
                ) -> ::core::result::Result<(), $crate::__private::String> {
                    TOKWATT_POLICY_SLOT.with(|slot| slot.restore(state))
                }
            }

            $crate::bindings::__export_policy_world!(
                TokwattPolicyExport with_types_in $crate::bindings
            );
        };
    };
}

/// Not public API: what [`export_policy!`] expands to.
#[doc(hidden)]
pub mod __private {
    pub use crate::bindings::exports::tokwatt::policy::guest::Guest;
    pub use crate::runtime::Slot;
    pub use std::string::String;
    pub use std::vec::Vec;
}
