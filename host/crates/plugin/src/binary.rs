//! What a component's binary says about itself before it is compiled: the names of its
//! top-level imports. Compiling a 12-18 MiB JavaScript or Python component takes 15-20 s,
//! so a component that imports something the sandbox does not provide (a default
//! componentize-js build imports `wasi:http`) is refused from its import names at once.

use wasmparser::{Parser, Payload};

/// The component's own imports (not those of the modules and components nested in it),
/// as `package:namespace/interface@version`. `Err` with the parser's reason when the
/// bytes are not a well-formed component; compiling would fail on them too.
pub(crate) fn top_level_imports(bytes: &[u8]) -> Result<Vec<String>, String> {
    let mut names = Vec::new();
    // Nested modules and components are parsed inline, each between a `Version` and an
    // `End` payload; only depth 1 is the outer component.
    let mut depth = 0usize;
    for payload in Parser::new(0).parse_all(bytes) {
        match payload.map_err(|error| error.to_string())? {
            Payload::Version { .. } => depth += 1,
            Payload::End(_) => depth = depth.saturating_sub(1),
            Payload::ComponentImportSection(section) if depth == 1 => {
                for import in section {
                    let import = import.map_err(|error| error.to_string())?;
                    let mut name = import.name.name.to_owned();
                    if let Some(version) = import.name.version_suffix {
                        name.push_str(version);
                    }
                    names.push(name);
                }
            }
            _ => {}
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CONTRACT_VERSION;

    #[test]
    fn a_shipped_policy_imports_the_contract_host_and_wasi_only() {
        let plugin = tokwatt_plugin_artifacts::built_plugin("policy_static");
        let bytes = std::fs::read(&plugin).expect("the shipped static plugin");
        let names = top_level_imports(&bytes).expect("a component");
        assert!(
            names
                .iter()
                .any(|name| name == &format!("tokwatt:policy/host@{CONTRACT_VERSION}")),
            "{names:?}"
        );
        assert!(
            names
                .iter()
                .all(|name| name.starts_with("tokwatt:policy/") || name.starts_with("wasi:")),
            "{names:?}"
        );
    }

    #[test]
    fn bytes_that_are_not_a_component_are_an_error() {
        assert!(top_level_imports(b"not wasm at all").is_err());
    }
}
