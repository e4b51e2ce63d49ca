//! Where a node is put together (issue 43): the rules that decide a node's backends, the
//! keeping of its original settings and its plugin host are called from
//! `tokwatt_agent::node` alone, so that every command (`run`, `serve`, `ab`, `replay`,
//! `check`, `plugin check`, `tune`, `bench agent-cpu`) gets them by the same rule. A new
//! command that composes a node itself fails here, naming the file and the call.

use std::path::PathBuf;

use crate::file_size::{product_part, product_sources};
use crate::support::repo_root;

/// The composition root.
const ROOT: &str = "host/crates/agent/src/node.rs";

/// Calls that put part of a node together, and the product files besides the root that
/// may make them, with why.
const RULES: &[(&str, &[&str])] = &[
    // The restore invariant rests on one rule for when a state file is kept.
    (".guard_settings(", &[]),
    ("assembly::assemble(", &[]),
    ("assemble_sim_with_engine(", &[]),
    ("simulator_from(", &[]),
    (
        "plugin_host(",
        &[
            // `agent::run`, for library callers that bring bare backends (the lab's
            // judging loops on in-memory simulators).
            "host/crates/agent/src/lib.rs",
            // A comparison starts many instances of both arms in one host.
            "host/crates/lab/src/ab/run/driver.rs",
            // `plugin check` inspects a component file; no node runs it.
            "host/src/bin/tokwatt/plugin/check.rs",
            // `bench decide` times a policy's calls in a host, on no node.
            "host/src/bin/tokwatt/bench/agent.rs",
        ],
    ),
];

#[test]
fn a_node_is_put_together_in_the_composition_root_alone() {
    let root = repo_root();
    let mut sources: Vec<PathBuf> = Vec::new();
    product_sources(&root.join("host"), &mut sources);
    assert!(
        sources.iter().any(|p| p.ends_with("node.rs")),
        "the composition root {ROOT} was not found under {}",
        root.display()
    );
    let mut strays = Vec::new();
    for path in &sources {
        let shown = path
            .strip_prefix(&root)
            .unwrap_or(path)
            .to_string_lossy()
            .replace('\\', "/");
        let Ok(text) = std::fs::read_to_string(path) else {
            continue;
        };
        let product = product_part(&text);
        for (call, allowed) in RULES {
            if shown == ROOT || allowed.contains(&shown.as_str()) {
                continue;
            }
            for (n, line) in product.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                if code.contains(call) && !code.contains("fn ") {
                    strays.push(format!("{shown}:{}: {}", n + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        strays.is_empty(),
        "these put part of a node together outside {ROOT}; open the node there instead \
         (tokwatt_agent::node::Node::open, or Node::assemble for a node that only \
         describes its devices):\n{}",
        strays.join("\n")
    );
}
