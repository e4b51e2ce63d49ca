//! `tokwatt plugin check FILE.wasm`: a component checked against the contract without an
//! agent (its version, imports and exports, every problem named), then a short trial in
//! the real sandbox on simulated H200s: `init`, a few `decide`s on busy and idle
//! observations, a `snapshot`/`restore` round trip.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

use tokwatt_agent as agent;
use tokwatt_agent::assembly::{BackendRequest, SimTarget, Target};
use tokwatt_agent::node::{Keep, Node, NodeRequest, PluginPlaces};
use tokwatt_core::types::{Knobs, Objective};
use tokwatt_plugin::SandboxLimits;
use tokwatt_plugin::inspect::{self, CallOutcome, Inspection, TrialInputs};
use tokwatt_policy::envelope::{Envelope, Guardrails};
use tokwatt_policy::supervisor::InitArgs;

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The component (.wasm) to check.
    file: PathBuf,
    /// Simulated H200s that `init` is told about.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    gpus: u32,
    /// A parameter for `init`, as the spec's `[params]` would give it: KEY=VALUE (repeat
    /// the flag, or list several after it).
    #[arg(long = "params", alias = "param", num_args = 1.., value_parser = parse_param)]
    params: Vec<(String, String)>,
    /// `decide` calls in the trial, alternately busy and idle.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    decides: u32,
    /// The compiled-component cache to compile through (default: the agent's).
    #[arg(long = "cache-dir")]
    cache_dir: Option<PathBuf>,
    /// Print the result as JSON on standard output.
    #[arg(long)]
    json: bool,
}

fn parse_param(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.trim().is_empty() => {
            Ok((key.trim().to_owned(), value.to_owned()))
        }
        _ => Err(format!(
            "`{text}` is not KEY=VALUE: write each parameter as name=value, e.g. --params cap_w=450"
        )),
    }
}

/// The whole result, for `--json`.
#[derive(Debug, serde::Serialize)]
struct CheckReport<'a> {
    format_version: u32,
    fine: bool,
    inspection: &'a Inspection,
    /// Empty when the static checks found problems (nothing was run).
    calls: &'a [CallOutcome],
    verdict: String,
}

pub fn check(args: &CheckArgs) -> Result<()> {
    let host = tokwatt_agent::plugin_host(args.cache_dir.clone())?;
    let inspection = inspect::inspect(&host, &args.file);
    let calls = if inspection.passed() {
        let inputs = trial_inputs(args)?;
        inspect::trial(&host, &args.file, SandboxLimits::default(), &inputs)
            .context("loading the plugin for its trial")?
    } else {
        Vec::new()
    };
    let verdict = verdict(&inspection, &calls);
    let fine = verdict.is_ok();
    let verdict_line = match &verdict {
        Ok(line) | Err(line) => line.clone(),
    };
    if args.json {
        let report = CheckReport {
            format_version: 1,
            fine,
            inspection: &inspection,
            calls: &calls,
            verdict: verdict_line.clone(),
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_text(&inspection, &calls);
        println!("verdict: {verdict_line}");
    }
    if fine {
        Ok(())
    } else {
        bail!(
            "{} did not pass `tokwatt plugin check`",
            args.file.display()
        )
    }
}

/// Simulated H200s as the agent would describe them (every knob of the built-in
/// scenario granted: it decodes only, so there is no token budget; the device's own
/// limits), the flags' parameters, a 1 s tick.
fn trial_inputs(args: &CheckArgs) -> Result<TrialInputs> {
    let all_knobs = Knobs {
        power_cap: true,
        sm_clock: true,
        batch_size: true,
        token_budget: false,
    };
    let request = BackendRequest {
        target: Target::Sim(SimTarget {
            gpus: args.gpus,
            ..SimTarget::new("h200")
        }),
        seed: 1,
        batch_only: false,
    };
    // Simulated nodes are described as every command's are; none is opened (nothing runs).
    let assembled = Node::assemble(NodeRequest {
        policy: "plugin-check".into(),
        knobs: all_knobs,
        backends: request,
        engine_beside_sim: None,
        keep: Keep::default(),
        plugins: PluginPlaces::default(),
    })
    .context("assembling simulated H200s to describe to the plugin")?
    .assembled;
    let node = agent::NodeFacts::of(&assembled.backends);
    let envelope = Envelope::for_workload(
        &node.devices,
        &node.workload,
        &Guardrails::default(),
        assembled.knobs,
    )?;
    let init = InitArgs {
        devices: envelope.facts(&node.devices),
        knobs: assembled.knobs,
        objective: Objective::default(),
        params: args.params.clone(),
        tick_ms: 1000,
        seed: 1,
    };
    let ticks = inspect::sample_ticks(&init, args.decides as usize);
    Ok(TrialInputs {
        init,
        ticks,
        seed: 1,
    })
}

/// `Ok(line)` when the plugin is fine, `Err(line)` naming what is not.
fn verdict(inspection: &Inspection, calls: &[CallOutcome]) -> Result<String, String> {
    let file = inspection.path.display();
    if !inspection.passed() {
        let count = inspection.problems.len();
        let plural = if count == 1 { "" } else { "s" };
        return Err(format!(
            "NOT FINE: {file} has {count} problem{plural} against the contract (nothing was run)"
        ));
    }
    let failed: Vec<&CallOutcome> = calls.iter().filter(|call| !call.ok).collect();
    let decides = calls
        .iter()
        .filter(|call| call.function == "decide")
        .count();
    let decides_ok = calls
        .iter()
        .filter(|call| call.function == "decide" && call.ok)
        .count();
    if failed.is_empty() && decides > 0 {
        return Ok(format!(
            "fine: {file} implements the contract and answered all {} calls of the trial",
            calls.len()
        ));
    }
    let mut functions: Vec<&str> = failed.iter().map(|call| call.function.as_str()).collect();
    functions.dedup();
    let named = if functions.is_empty() {
        "the trial stopped before `decide`".to_owned()
    } else {
        format!(
            "{} failed",
            functions
                .iter()
                .map(|f| format!("`{f}`"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    Err(format!(
        "NOT FINE: {file} loads, but {named} ({} of {} calls failed; {decides_ok} of {decides} `decide` calls answered)",
        failed.len(),
        calls.len()
    ))
}

fn print_text(inspection: &Inspection, calls: &[CallOutcome]) {
    println!("checking {}", inspection.path.display());
    if let Some(guest) = &inspection.guest_interface {
        let served = if inspection.contract_version_served {
            "served by this tokwatt"
        } else {
            "NOT served by this tokwatt"
        };
        println!(
            "  contract: exports {guest} (world tokwatt:policy/policy@{}), {served}",
            inspection.contract_version.as_deref().unwrap_or("?")
        );
    }
    if !inspection.imports.is_empty() {
        // The WASI interfaces std pulls in are many and rarely the problem: counted, unless
        // one is not provided.
        let (wasi, named): (Vec<_>, Vec<_>) = inspection
            .imports
            .iter()
            .partition(|import| import.provided && import.name.starts_with("wasi:"));
        println!("  imports:");
        for import in named {
            let mark = if import.provided {
                "ok     "
            } else {
                "MISSING"
            };
            println!("    {mark} {}", import.name);
        }
        if !wasi.is_empty() {
            println!(
                "    ok      {} WASI 0.2 interface(s) the sandbox provides, locked down",
                wasi.len()
            );
        }
    }
    if !inspection.exports.is_empty() {
        println!("  exports:");
        for export in &inspection.exports {
            match (&export.found, export.matches) {
                (Some(_), true) => println!("    ok      {}", export.function),
                (None, _) => println!(
                    "    MISSING {}: expected {}",
                    export.function, export.expected
                ),
                (Some(found), false) => println!(
                    "    WRONG   {}: expected {}, found {found}",
                    export.function, export.expected
                ),
            }
        }
    }
    if !inspection.problems.is_empty() {
        println!("  problems:");
        for (number, problem) in inspection.problems.iter().enumerate() {
            println!(
                "    {}. {}: {}",
                number + 1,
                problem.subject,
                problem.message
            );
        }
    }
    if !calls.is_empty() {
        println!("  trial in the sandbox:");
        for call in calls {
            let mark = if call.ok { "ok    " } else { "FAILED" };
            println!("    {mark} {}: {}", call.call, call.detail);
            // What the call wrote to standard error (a traceback), as the guest wrote it,
            // line by line under the call; each line escaped.
            for line in &call.stderr {
                println!("           stderr| {line}");
            }
        }
    }
}
