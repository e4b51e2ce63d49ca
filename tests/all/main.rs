//! End-to-end tests: they drive the built `tokwatt` binary with the shipped policies and
//! the fixture plugins on the simulated GPU, and check what an operator would check.
//! One binary for all of them (wasmtime's `tests/all` layout), a module per area.

mod support;

mod ab;
mod accepts;
mod api;
mod bad_input;
mod book;
mod compare;
mod composition_root;
mod crate_deps;
mod deploy;
mod engines;
mod eval;
mod fence;
mod file_size;
mod fleet;
mod fleet_ab;
mod guard;
mod guest_lang;
mod hostile;
mod js_policy;
mod json;
mod llamacpp;
mod long_run;
mod metrics;
mod objective;
mod outputs;
mod plugin_check;
mod plugin_new;
mod policies_judged;
mod prometheus_server;
mod prompts;
mod python_policy;
mod readme;
mod replay;
mod report;
mod restore;
mod scale;
mod sdk_wit;
mod serve;
mod shell;
mod shipped_policies;
mod sim_driver;
mod swap;
mod tune;
mod workspace_build;
