//! Checks of a plugin file against the contract before it runs: the component header, the
//! contract version it was built against, and the type of every guest function.

use std::path::Path;

use super::lines::Line;
use super::*;

pub(super) fn check_component_header(path: &Path, bytes: &[u8]) -> Result<(), PluginError> {
    const MAGIC: &[u8] = b"\0asm";
    let head = &bytes[..bytes.len().min(MAGIC.len())];
    if bytes.len() < 8 && MAGIC.starts_with(head) {
        return Err(PluginError::Truncated {
            path: path.to_owned(),
            len: bytes.len(),
        });
    }
    if bytes.len() < 8 || &bytes[..4] != MAGIC {
        return Err(PluginError::NotWasm {
            path: path.to_owned(),
        });
    }
    // Bytes 4..8: version 1 + layer 0 is a core module; the component layer is 1.
    if bytes[6..8] == [0, 0] {
        return Err(PluginError::CoreModule {
            path: path.to_owned(),
        });
    }
    Ok(())
}

/// The guest's functions as the contract writes them, for error messages.
pub(super) const GUEST_FUNCTIONS: [(&str, &str); 4] = [
    (
        "init",
        "func(args: init-args) -> result<list<settings>, string>",
    ),
    (
        "decide",
        "func(observations: list<observation>) -> list<settings>",
    ),
    ("snapshot", "func() -> state"),
    ("restore", "func(state: state) -> result<_, string>"),
];

/// Check each guest function's type against the contract, on a throwaway sandboxed
/// instance, so that a mismatch is refused at load naming the function and both types
/// (the generated bindings only say "type mismatch", on the first call). An instance
/// that cannot be created here is left for `instantiate` to report as a policy failure.
pub(super) fn check_guest_signatures(
    engine: &Engine,
    pre: &wasmtime::component::InstancePre<HostState>,
    name: &str,
    limits: &SandboxLimits,
    guest_export: &str,
    line: Line,
) -> Result<(), String> {
    let mut store = Store::new(engine, HostState::new(name, 0, limits));
    store.limiter(|state| &mut state.limiter);
    if store.set_fuel(limits.fuel_per_call).is_err() {
        return Ok(());
    }
    store.set_epoch_deadline(deadline_epochs(limits.deadline_ms));
    store.epoch_deadline_trap();
    let Ok(instance) = pre.instantiate(&mut store) else {
        return Ok(());
    };
    let guest = instance
        .get_export_index(&mut store, None, guest_export)
        .ok_or_else(|| format!("`{guest_export}` is not an instance"))?;
    for (function, contract) in GUEST_FUNCTIONS {
        let index = instance
            .get_export_index(&mut store, Some(&guest), function)
            .ok_or_else(|| {
                format!(
                    "`{guest_export}` lacks `{function}` (the contract: {function}: {contract})"
                )
            })?;
        let checked = line.check_function(&instance, &mut store, &index, function);
        checked.map_err(|e| {
            format!(
                "`{function}` of `{guest_export}`: {} (the contract: {function}: {contract})",
                error_text(&e)
            )
        })?;
    }
    Ok(())
}

/// Accept `tokwatt:policy/guest` of a served line (for 0.x versions the minor is the
/// compatibility line: 0.1.*, 0.2.*, 0.3.* and 0.4.*). Returns the guest interface's export name and
/// its line.
pub(super) fn check_contract_version(
    engine: &Engine,
    path: &Path,
    component: &Component,
) -> Result<(String, Line), PluginError> {
    let ty = component.component_type();
    let guest = ty
        .exports(engine)
        .map(|(name, _)| name.to_owned())
        .find(|name| name.starts_with(GUEST_INTERFACE));
    let Some(found) = guest else {
        return Err(PluginError::NotAPolicy {
            path: path.to_owned(),
        });
    };
    let found = sanitize_text(&found, PLUGIN_TEXT_MAX_BYTES);
    let version = found
        .split_once('@')
        .map(|(_, v)| v)
        .unwrap_or_default()
        .to_owned();
    let Some(line) = Line::of(&version) else {
        return Err(PluginError::WrongVersion {
            path: path.to_owned(),
            found,
            accepted: accepted_versions(),
        });
    };
    Ok((found, line))
}

pub(super) fn compatible_version(version: &str) -> bool {
    Line::of(version).is_some()
}

/// The versions this host accepts, newest first: `0.4.* or 0.3.* or 0.2.* or 0.1.*`.
pub(super) fn accepted_versions() -> String {
    let patterns: Vec<&str> = Line::SERVED
        .iter()
        .rev()
        .map(|line| line.pattern())
        .collect();
    patterns.join(" or ")
}
