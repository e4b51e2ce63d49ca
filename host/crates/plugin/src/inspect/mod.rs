//! `tokwatt plugin check`: a component checked against the contract without an agent,
//! every problem reported (not the first), each naming the function or import it is
//! about and the fix; then, if nothing static is wrong, a short trial of every guest
//! function in the real sandbox.
//!
//! The static part reads the component's type (`Component::component_type`), which
//! runs nothing: its version, its imports against what the sandbox provides, and each
//! guest function's type against the contract. The authority on imports stays the
//! linker (`instantiate_pre`), which is asked once the names pass.

mod ahead;
mod trial;

pub use ahead::{CompileAheadError, CompiledAhead, compile_ahead};
pub use trial::{CallOutcome, TrialInputs, sample_ticks, trial};

use std::path::{Path, PathBuf};

use wasmtime::component::types::{ComponentFunc, ComponentItem, Type};

use crate::contract::{GUEST_FUNCTIONS, accepted_versions, compatible_version};
use crate::lines::Line;
use wasmtime::Engine;
use wasmtime::component::Component;

use crate::contract::check_component_header;
use crate::{
    CONTRACT_PACKAGE, CONTRACT_VERSION, GUEST_INTERFACE, PLUGIN_TEXT_MAX_BYTES, PluginError,
    PluginHost, binary, error_text, sanitize_text, unprovided_before_compiling,
};

/// The WASI 0.2 packages the sandbox links (`wasmtime_wasi::p2::add_to_linker_sync`): a
/// policy built with Rust's std imports some of them even when it never uses them.
/// Everything in them is locked down (no files, sockets, environment or arguments).
const WASI_PACKAGES_PROVIDED: [&str; 6] = [
    "wasi:cli/",
    "wasi:clocks/",
    "wasi:filesystem/",
    "wasi:io/",
    "wasi:random/",
    "wasi:sockets/",
];
const WASI_VERSION_LINE: &str = "0.2.";
/// The contract's interfaces a policy imports (`host`, and `types`, which `host` uses).
const CONTRACT_IMPORTS: [&str; 2] = ["tokwatt:policy/host", "tokwatt:policy/types"];

/// What kind of problem a [`Problem`] is, for machine output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProblemKind {
    /// Not readable, not WebAssembly, truncated, or a core module.
    NotAComponent,
    /// WebAssembly that does not validate or compile.
    Invalid,
    /// A component that does not export the guest interface.
    NotAPolicy,
    /// Built against a contract version this host does not serve.
    WrongVersion,
    /// An import the sandbox does not provide.
    ImportNotProvided,
    /// Imports whose names are provided but whose types the sandbox does not match.
    ImportMismatch,
    /// A guest function the contract requires is missing.
    ExportMissing,
    /// A guest function whose type is not the contract's.
    ExportWrongType,
}

/// One thing wrong with a component, in plain words.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Problem {
    pub kind: ProblemKind,
    /// The function, import or file it is about.
    pub subject: String,
    /// What is wrong and how to fix it.
    pub message: String,
}

/// One import of the component and whether the sandbox provides it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ImportEntry {
    pub name: String,
    pub provided: bool,
}

/// One guest function: what the contract expects, what the component has.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ExportEntry {
    pub function: String,
    pub expected: String,
    /// `None` when the component lacks it.
    pub found: Option<String>,
    pub matches: bool,
}

/// The static half of a check: nothing of the plugin ran.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Inspection {
    pub path: PathBuf,
    /// The guest interface the component exports (`tokwatt:policy/guest@0.4.0`).
    pub guest_interface: Option<String>,
    /// The contract version it was built against, and whether this host serves it.
    pub contract_version: Option<String>,
    pub contract_version_served: bool,
    pub imports: Vec<ImportEntry>,
    pub exports: Vec<ExportEntry>,
    /// Every problem found; empty when the component may be loaded.
    pub problems: Vec<Problem>,
}

impl Inspection {
    fn new(path: &Path) -> Self {
        Self {
            path: path.to_owned(),
            guest_interface: None,
            contract_version: None,
            contract_version_served: false,
            imports: Vec::new(),
            exports: Vec::new(),
            problems: Vec::new(),
        }
    }

    fn problem(&mut self, kind: ProblemKind, subject: impl Into<String>, message: String) {
        self.problems.push(Problem {
            kind,
            subject: subject.into(),
            message,
        });
    }

    /// Whether the static checks found nothing wrong.
    pub fn passed(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Check a component against the contract without running any of it. Compiling goes
/// through the host's cache, so a later load of the same file is quick.
pub fn inspect(host: &PluginHost, path: &Path) -> Inspection {
    let mut report = Inspection::new(path);
    let file = path.display().to_string();
    let bytes = match super::read_component(path) {
        Ok(bytes) => bytes,
        Err(error) => {
            report.problem(ProblemKind::NotAComponent, file, error.to_string());
            return report;
        }
    };
    if let Err(error) = check_component_header(path, &bytes) {
        report.problem(ProblemKind::NotAComponent, file, error.to_string());
        return report;
    }
    // The import names are in the binary: a component importing what the sandbox lacks
    // (a default componentize-js build imports wasi:http) is refused before the compiler
    // spends 15-20 s on it, and its exports are not checked: fix the imports first. A
    // contract import of another version goes on to the export checks, which name the
    // version the component implements.
    let imports_read = binary::top_level_imports(&bytes).ok();
    if let Some(names) = &imports_read {
        check_imports(&mut report, names.iter().map(String::as_str));
        if !unprovided_before_compiling(names).is_empty() {
            return report;
        }
    }
    let component = match compile(host, &bytes) {
        Ok(component) => component,
        Err(reason) => {
            let error = PluginError::Invalid {
                path: path.to_owned(),
                reason: sanitize_text(&reason, PLUGIN_TEXT_MAX_BYTES),
            };
            report.problem(ProblemKind::Invalid, file, error.to_string());
            return report;
        }
    };
    let engine = &host.engine;
    let component_type = component.component_type();
    if imports_read.is_none() {
        let names: Vec<String> = component_type
            .imports(engine)
            .map(|(name, _)| name.to_owned())
            .collect();
        check_imports(&mut report, names.iter().map(String::as_str));
    }
    if report.problems.is_empty()
        && let Err(e) = host.linker.instantiate_pre(&component)
    {
        report.problem(
            ProblemKind::ImportMismatch,
            "imports",
            format!(
                "the sandbox provides every interface this component imports by name, but not with the types it expects ({}); rebuild it with a wasm32-wasip2 toolchain whose WASI is 0.2 and against this tokwatt's wit/policy.wit",
                error_text(&e)
            ),
        );
    }
    check_exports(&mut report, engine, &component_type);
    report
}

/// Compile as `PluginHost::load` does: through the cache when the host has one.
fn compile(host: &PluginHost, bytes: &[u8]) -> Result<Component, String> {
    match &host.cache {
        Some(cache) => cache.load_or_compile(&host.engine, bytes),
        None => Component::new(&host.engine, bytes).map_err(|e| format!("{e:#}")),
    }
}

fn text(name: &str) -> String {
    sanitize_text(name, PLUGIN_TEXT_MAX_BYTES)
}

/// The version after `@` in an interface name (`a:b/c@0.1.0` → `0.1.0`).
fn version_of(name: &str) -> Option<&str> {
    name.split_once('@').map(|(_, version)| version)
}

fn check_imports<'a>(report: &mut Inspection, names: impl IntoIterator<Item = &'a str>) {
    for name in names {
        let shown = text(name);
        let verdict = import_verdict(name);
        report.imports.push(ImportEntry {
            name: shown.clone(),
            provided: verdict.is_ok(),
        });
        if let Err(message) = verdict {
            report.problem(ProblemKind::ImportNotProvided, shown, message);
        }
    }
}

/// `Ok` when the sandbox provides an import of this name, else why not and the fix.
pub(crate) fn import_verdict(name: &str) -> Result<(), String> {
    let shown = text(name);
    let version = version_of(name).unwrap_or_default();
    if let Some(interface) = CONTRACT_IMPORTS
        .iter()
        .find(|interface| name.split('@').next() == Some(**interface))
    {
        if compatible_version(version) {
            return Ok(());
        }
        return Err(format!(
            "imports `{shown}`, but this tokwatt serves {interface}@{} ({CONTRACT_PACKAGE}@{CONTRACT_VERSION}): rebuild the plugin against the contract in this tokwatt's wit/ folder",
            accepted_versions()
        ));
    }
    if let Some(package) = WASI_PACKAGES_PROVIDED
        .iter()
        .find(|package| name.starts_with(**package))
    {
        if version.starts_with(WASI_VERSION_LINE) {
            return Ok(());
        }
        return Err(format!(
            "imports `{shown}`: the sandbox provides {package}* of WASI {WASI_VERSION_LINE}x only; build for wasm32-wasip2 (WASI 0.2)"
        ));
    }
    if name.starts_with(CONTRACT_PACKAGE) {
        return Err(format!(
            "imports `{shown}`, which the contract does not have: a policy imports only {}@{} from {CONTRACT_PACKAGE}",
            CONTRACT_IMPORTS[0],
            accepted_versions()
        ));
    }
    let fix = if name.starts_with("wasi:http/") {
        "build without it: a policy has no network (for JavaScript, `componentize-js --disable http fetch-event` or `jco componentize --disable http`; for Rust, drop the dependency that pulls in an HTTP client)"
    } else if name.starts_with("wasi:") {
        "build without it: a policy gets only wasi:cli, wasi:clocks, wasi:filesystem, wasi:io, wasi:random and wasi:sockets 0.2 (all locked down), and the contract's tokwatt:policy/host"
    } else {
        "a policy may import only tokwatt:policy/host and the WASI 0.2 interfaces Rust's std pulls in; remove the dependency that needs it"
    };
    Err(format!(
        "imports `{shown}`, which the sandbox does not provide: {fix}"
    ))
}

fn check_exports(
    report: &mut Inspection,
    engine: &Engine,
    component_type: &wasmtime::component::types::Component,
) {
    let guest = component_type
        .exports(engine)
        .find(|(name, _)| name.starts_with(GUEST_INTERFACE))
        .map(|(name, item)| (name.to_owned(), item.ty));
    let Some((guest_name, guest_item)) = guest else {
        let exported: Vec<String> = component_type
            .exports(engine)
            .map(|(name, _)| format!("`{}`", text(name)))
            .collect();
        let exported = if exported.is_empty() {
            "nothing".to_owned()
        } else {
            exported.join(", ")
        };
        report.problem(
            ProblemKind::NotAPolicy,
            GUEST_INTERFACE,
            format!(
                "does not export `{GUEST_INTERFACE}` (it exports {exported}): a policy implements the world `policy` of {CONTRACT_PACKAGE}@{CONTRACT_VERSION} (wit/policy.wit), exporting `guest`"
            ),
        );
        return;
    };
    let shown = text(&guest_name);
    let version = version_of(&guest_name).map(text).unwrap_or_default();
    report.guest_interface = Some(shown.clone());
    report.contract_version = Some(version.clone());
    report.contract_version_served = compatible_version(&version);
    // A version not served is reported above; its functions are checked against the
    // newest line, the one to rebuild against.
    let line = Line::of(&version).unwrap_or(Line::NEWEST);
    if !report.contract_version_served {
        let version = if version.is_empty() {
            "no version".to_owned()
        } else {
            format!("version {version}")
        };
        report.problem(
            ProblemKind::WrongVersion,
            shown.clone(),
            format!(
                "implements `{shown}` ({version} of the contract), but this tokwatt serves {CONTRACT_PACKAGE}@{} (built with {CONTRACT_VERSION}): rebuild the plugin against the contract in this tokwatt's wit/ folder",
                accepted_versions()
            ),
        );
    }
    let ComponentItem::ComponentInstance(instance) = guest_item else {
        report.problem(
            ProblemKind::NotAPolicy,
            shown.clone(),
            format!(
                "exports `{shown}` as something other than an interface: rebuild it from the world `policy` of wit/policy.wit"
            ),
        );
        return;
    };
    let cx = component_type.instance_type();
    for (function, expected) in GUEST_FUNCTIONS {
        let found = instance.get_export(engine, function).map(|item| item.ty);
        let (found_text, mismatch) = match &found {
            None => (None, None),
            Some(ComponentItem::ComponentFunc(func)) => (
                Some(render_func(func)),
                typecheck(line, function, func, &cx).err(),
            ),
            Some(_) => (
                Some("something other than a function".to_owned()),
                Some("not a function".to_owned()),
            ),
        };
        let matches = found.is_some() && mismatch.is_none();
        report.exports.push(ExportEntry {
            function: function.to_owned(),
            expected: format!("func{}", expected.trim_start_matches("func")),
            found: found_text.clone(),
            matches,
        });
        match (found_text, mismatch) {
            (None, _) => report.problem(
                ProblemKind::ExportMissing,
                function,
                format!(
                    "`{function}` is missing from `{shown}`: the contract requires {function}: {expected}"
                ),
            ),
            (Some(found), Some(why)) => report.problem(
                ProblemKind::ExportWrongType,
                function,
                format!(
                    "`{function}` of `{shown}` has the wrong type: expected {function}: {expected}, found {function}: {found} ({why}); rebuild the plugin against this tokwatt's wit/policy.wit"
                ),
            ),
            (Some(_), None) => {}
        }
    }
}

/// The contract's type of each guest function, checked without an instance (the same
/// check `get_typed_func` makes on a live instance at load).
fn typecheck(
    line: Line,
    function: &str,
    func: &ComponentFunc,
    cx: &wasmtime::component::__internal::InstanceType<'_>,
) -> Result<(), String> {
    let checked = line.typecheck(function, func, cx);
    checked.map_err(|e| error_text(&e))
}

/// A function type in WIT's words, nested types spelled out (the names of records are
/// not part of a component's type, only their fields).
fn render_func(func: &ComponentFunc) -> String {
    let params: Vec<String> = func
        .params()
        .map(|(name, ty)| format!("{}: {}", text(name), render_type(&ty, 0)))
        .collect();
    let results: Vec<String> = func.results().map(|ty| render_type(&ty, 0)).collect();
    let arrow = match results.as_slice() {
        [] => String::new(),
        [one] => format!(" -> {one}"),
        many => format!(" -> ({})", many.join(", ")),
    };
    text(&format!("func({}){arrow}", params.join(", ")))
}

/// Deep enough to show a record's fields and their types, shallow enough to stay a line.
const RENDER_DEPTH: usize = 3;

fn render_type(ty: &Type, depth: usize) -> String {
    if depth > RENDER_DEPTH {
        return "…".to_owned();
    }
    let inner = |ty: &Type| render_type(ty, depth + 1);
    match ty {
        Type::List(list) => format!("list<{}>", inner(&list.ty())),
        Type::Option(option) => format!("option<{}>", inner(&option.ty())),
        Type::Result(result) => {
            let side = |ty: Option<Type>| ty.map_or_else(|| "_".to_owned(), |ty| inner(&ty));
            format!("result<{}, {}>", side(result.ok()), side(result.err()))
        }
        Type::Tuple(tuple) => {
            let types: Vec<String> = tuple.types().map(|ty| inner(&ty)).collect();
            format!("tuple<{}>", types.join(", "))
        }
        Type::Record(record) => {
            let fields: Vec<String> = record
                .fields()
                .map(|field| format!("{}: {}", field.name, inner(&field.ty)))
                .collect();
            format!("record {{ {} }}", fields.join(", "))
        }
        Type::Flags(flags) => format!(
            "flags {{ {} }}",
            flags.names().collect::<Vec<_>>().join(", ")
        ),
        Type::Enum(e) => format!("enum {{ {} }}", e.names().collect::<Vec<_>>().join(", ")),
        Type::Variant(variant) => {
            let cases: Vec<String> = variant
                .cases()
                .map(|case| match case.ty {
                    Some(ty) => format!("{}({})", case.name, inner(&ty)),
                    None => case.name.to_owned(),
                })
                .collect();
            format!("variant {{ {} }}", cases.join(", "))
        }
        Type::Bool => "bool".to_owned(),
        Type::S8 => "s8".to_owned(),
        Type::U8 => "u8".to_owned(),
        Type::S16 => "s16".to_owned(),
        Type::U16 => "u16".to_owned(),
        Type::S32 => "s32".to_owned(),
        Type::U32 => "u32".to_owned(),
        Type::S64 => "s64".to_owned(),
        Type::U64 => "u64".to_owned(),
        Type::Float32 => "f32".to_owned(),
        Type::Float64 => "f64".to_owned(),
        Type::Char => "char".to_owned(),
        Type::String => "string".to_owned(),
        Type::Own(_) => "own<resource>".to_owned(),
        Type::Borrow(_) => "borrow<resource>".to_owned(),
        // Types a policy's contract never uses (maps, futures, streams …).
        _ => "(a type the contract does not use)".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{HostConfig, SandboxLimits};

    use tokwatt_plugin_artifacts::built_plugin as built;

    fn host_with_cache(dir: &Path) -> PluginHost {
        PluginHost::new(&HostConfig {
            cache_dir: Some(dir.to_owned()),
        })
        .expect("host")
    }

    fn cache_hits(host: &PluginHost) -> u64 {
        host.cache.as_ref().expect("a cache").hits()
    }

    #[test]
    fn a_component_compiled_ahead_is_loaded_from_the_cache() {
        let plugin = built("policy_static");
        let cache = tempfile::tempdir().expect("tempdir");
        let compiled = compile_ahead(&host_with_cache(cache.path()), &plugin).expect("compiles");
        assert!(!compiled.already_cached);
        assert!(compiled.cache_path.is_file());
        assert!(compiled.guest_interface.starts_with(GUEST_INTERFACE));
        let again = compile_ahead(&host_with_cache(cache.path()), &plugin).expect("cached");
        assert!(again.already_cached);
        assert_eq!(again.cache_path, compiled.cache_path);

        // An agent's host with that cache loads the compiled form, compiling nothing.
        let agent = host_with_cache(cache.path());
        agent
            .load(&plugin, "static", SandboxLimits::default())
            .expect("loads");
        assert_eq!(cache_hits(&agent), 1);
        // Without the compile ahead, the first load compiles.
        let empty = tempfile::tempdir().expect("tempdir");
        let cold = host_with_cache(empty.path());
        cold.load(&plugin, "static", SandboxLimits::default())
            .expect("loads");
        assert_eq!(cache_hits(&cold), 0);
    }

    #[test]
    fn compile_ahead_needs_a_cache_and_a_policy() {
        let host = PluginHost::new(&HostConfig { cache_dir: None }).expect("host");
        assert!(matches!(
            compile_ahead(&host, &built("policy_static")),
            Err(CompileAheadError::NoCache)
        ));
        let cache = tempfile::tempdir().expect("tempdir");
        let wrong = compile_ahead(
            &host_with_cache(cache.path()),
            &built("fixture_wrong_version"),
        )
        .expect_err("another contract version");
        assert!(
            matches!(
                wrong,
                CompileAheadError::Plugin(PluginError::WrongVersion { .. })
            ),
            "{wrong}"
        );
    }

    #[test]
    fn a_trial_reports_every_call_and_keeps_going_after_a_trap() {
        let host = PluginHost::new(&HostConfig::default()).expect("host");
        let init = tokwatt_policy::supervisor::InitArgs::typical_h200(2);
        let inputs = TrialInputs {
            ticks: sample_ticks(&init, 4),
            init,
            seed: 1,
        };
        let inspection = inspect(&host, &built("fixture_trap_decide"));
        assert!(inspection.passed(), "{:?}", inspection.problems);
        let calls = trial(
            &host,
            &built("fixture_trap_decide"),
            SandboxLimits::default(),
            &inputs,
        )
        .expect("loads");
        let verdicts: Vec<(&str, bool)> = calls
            .iter()
            .map(|call| (call.function.as_str(), call.ok))
            .collect();
        // The fixture panics on its third decide; the fourth runs on a rebuilt instance.
        assert_eq!(
            verdicts,
            [
                ("init", true),
                ("decide", true),
                ("decide", true),
                ("decide", false),
                ("decide", true),
                ("snapshot", true),
                ("restore", true),
                ("decide", true),
            ]
        );
        assert!(calls[3].detail.contains("trapped"), "{}", calls[3].detail);
    }

    #[test]
    fn the_sandbox_provides_the_contract_and_wasi_0_2_only() {
        assert!(import_verdict("tokwatt:policy/host@0.1.0").is_ok());
        assert!(import_verdict("tokwatt:policy/types@0.1.3").is_ok());
        assert!(import_verdict("tokwatt:policy/host@0.2.0").is_ok());
        assert!(import_verdict("tokwatt:policy/host@0.3.0").is_ok());
        assert!(import_verdict("tokwatt:policy/host@0.4.0").is_ok());
        assert!(import_verdict("wasi:io/streams@0.2.6").is_ok());
        assert!(import_verdict("wasi:cli/environment@0.2.0").is_ok());
        let other_contract = import_verdict("tokwatt:policy/host@0.5.0").expect_err("0.5");
        assert!(
            other_contract.contains("0.4.* or 0.3.* or 0.2.* or 0.1.*"),
            "{other_contract}"
        );
        let http = import_verdict("wasi:http/outgoing-handler@0.2.0").expect_err("http");
        assert!(
            http.contains("does not provide") && http.contains("build without it"),
            "{http}"
        );
        let preview3 = import_verdict("wasi:io/streams@0.3.0").expect_err("0.3");
        assert!(preview3.contains("wasm32-wasip2"), "{preview3}");
        assert!(import_verdict("acme:telemetry/push").is_err());
    }
}
