//! The policy spec: the TOML file an operator deploys. It names the plugin, the knobs it
//! may turn, its parameters, the service objective, the guardrails and the sandbox limits.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::envelope::Guardrails;
use crate::limits::SandboxLimits;
use crate::supervisor::BreakerConfig;
use tokwatt_core::types::{Knobs, Objective};

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("cannot read policy spec {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("policy spec {path} is not valid: {message}")]
    Parse {
        path: PathBuf,
        /// The parser's message, with the line it stopped at quoted.
        message: String,
        /// Where it stopped (line and column, from 1), where it says.
        at: Option<(u32, u32)>,
        /// The parser's reason with nothing of the file's text in it: see
        /// [`SpecError::without_contents`]. (Boxed, as `build` below: an error stays small.)
        reason: Box<str>,
    },
    #[error(
        "policy spec {path}: unknown knob `{knob}`; the knobs are \"power-cap\", \"sm-clock\", \"batch-size\" and \"token-budget\""
    )]
    UnknownKnob { path: PathBuf, knob: String },
    #[error("policy spec {}{}: `{key}` {problem}", path.display(), line.map_or_else(String::new, |l| format!(":{l}")))]
    Invalid {
        path: PathBuf,
        /// The line the key is on, where the key is written in the file.
        line: Option<usize>,
        /// The key, with its table (`sandbox.fuel_per_call`).
        key: String,
        /// What is wrong and what would be right.
        problem: String,
    },
    #[error(
        "policy spec {spec}: plugin `{plugin}` not found (looked in {searched}). {build}, or pass its folder with --plugin-dir (serve: policy.plugin_dirs); tokwatt's own policies are built by building tokwatt (`cargo build`)"
    )]
    PluginNotFound {
        spec: PathBuf,
        plugin: String,
        searched: Box<str>,
        /// How to build it, in the language of the sources beside the spec.
        build: Box<str>,
    },
}

impl SpecError {
    /// The error without anything read from the file: for a reply to a remote caller
    /// (the control API), who may name any file the agent can read and must not learn its
    /// contents from the parser's quote of the line it stopped at. The full error goes to
    /// the agent's own log.
    pub fn without_contents(&self) -> String {
        match self {
            SpecError::Parse {
                path, at, reason, ..
            } => format!(
                "policy spec {}{} is not a valid policy spec: {reason} (the file's text is left out of this reply; \
                 run `tokwatt check {}` on the node to see the line, and see docs/book/src/reference/spec.md for the keys)",
                path.display(),
                at.map_or_else(String::new, |(line, column)| format!(":{line}:{column}")),
                path.display()
            ),
            SpecError::UnknownKnob { path, .. } => format!(
                "policy spec {}: `knobs` names an unknown knob; the knobs are \"power-cap\", \"sm-clock\", \"batch-size\" and \"token-budget\"",
                path.display()
            ),
            other => other.to_string(),
        }
    }
}

mod validate;

pub use validate::{MAX_TICK, MIN_TICK};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSpec {
    name: String,
    plugin: String,
    #[serde(default)]
    knobs: Vec<String>,
    #[serde(default = "default_tick_ms")]
    tick_ms: u64,
    #[serde(default)]
    params: BTreeMap<String, toml::Value>,
    #[serde(default)]
    objective: Objective,
    #[serde(default)]
    guardrails: Guardrails,
    #[serde(default)]
    sandbox: SandboxLimits,
    #[serde(default)]
    breaker: BreakerConfig,
}

fn default_tick_ms() -> u64 {
    1000
}

/// A parsed, validated policy spec.
#[derive(Debug, Clone)]
pub struct PolicySpec {
    /// Where the spec was read from.
    pub path: PathBuf,
    pub name: String,
    /// The plugin as written in the spec.
    pub plugin: String,
    pub knobs: Knobs,
    pub tick_ms: u32,
    /// Parameters passed to the policy's `init`, as strings, sorted by key.
    pub params: Vec<(String, String)>,
    pub objective: Objective,
    pub guardrails: Guardrails,
    pub sandbox: SandboxLimits,
    pub breaker: BreakerConfig,
}

impl PolicySpec {
    pub fn load(path: &Path) -> Result<Self, SpecError> {
        let text =
            tokwatt_core::files::read_text_bounded(path, tokwatt_core::files::MAX_SPEC_BYTES)
                .map_err(|source| SpecError::Read {
                    path: path.to_owned(),
                    source,
                })?;
        Self::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<Self, SpecError> {
        let raw: RawSpec = toml::from_str(text).map_err(|e| SpecError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
            at: e.span().map(|span| line_and_column(text, span.start)),
            reason: reason_without_contents(e.message()).into(),
        })?;
        let mut knobs = Knobs::default();
        for knob in &raw.knobs {
            match knob.as_str() {
                "power-cap" => knobs.power_cap = true,
                "sm-clock" => knobs.sm_clock = true,
                "batch-size" => knobs.batch_size = true,
                "token-budget" => knobs.token_budget = true,
                _ => {
                    return Err(SpecError::UnknownKnob {
                        path: path.to_owned(),
                        knob: knob.clone(),
                    });
                }
            }
        }
        validate::check(&raw).map_err(|problem| problem.locate(path, text))?;
        // Parameters reach the policy as strings; numbers and booleans are accepted
        // unquoted for convenience.
        let params = raw
            .params
            .into_iter()
            .map(|(k, v)| {
                let value = match v {
                    toml::Value::String(s) => s,
                    other => other.to_string(),
                };
                (k, value)
            })
            .collect();
        Ok(Self {
            path: path.to_owned(),
            name: raw.name,
            plugin: raw.plugin,
            knobs,
            tick_ms: raw.tick_ms as u32,
            params,
            objective: raw.objective,
            guardrails: raw.guardrails,
            sandbox: raw.sandbox,
            breaker: raw.breaker,
        })
    }

    /// Replace the spec's tick (`--tick`), validated as `tick_ms` in the file is.
    pub fn override_tick(&mut self, tick: std::time::Duration) -> Result<(), SpecError> {
        let tick_ms = validate::tick_ms(tick, self.sandbox.deadline_ms).map_err(|problem| {
            SpecError::Invalid {
                path: self.path.clone(),
                line: None,
                key: "--tick".into(),
                problem,
            }
        })?;
        self.tick_ms = tick_ms;
        Ok(())
    }

    /// The plugin file: relative to the spec's folder first, then each folder of
    /// `search` (the plugin folder given on the command line, and the folder the build
    /// put the shipped plugins in).
    pub fn resolve_plugin(&self, search: &[PathBuf]) -> Result<PathBuf, SpecError> {
        let written = Path::new(&self.plugin);
        let spec_dir = self.path.parent().unwrap_or(Path::new("."));
        let mut candidates = vec![spec_dir.join(written)];
        if written.is_relative() {
            candidates.extend(search.iter().map(|dir| dir.join(written)));
        }
        if let Some(found) = candidates.iter().find(|c| c.is_file()) {
            return Ok(found.clone());
        }
        Err(SpecError::PluginNotFound {
            spec: self.path.clone(),
            plugin: self.plugin.clone(),
            searched: candidates
                .iter()
                .map(|c| c.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
                .into(),
            build: build_hint(spec_dir, &self.plugin).into(),
        })
    }
}

/// How to build a missing plugin, by the sources beside its spec: a Python policy (a
/// module, `app.py` in the scaffold) with componentize-py, a JavaScript one (a
/// `package.json`, or a script) with componentize-js, anything else as a Rust crate.
fn build_hint(spec_dir: &Path, plugin: &str) -> String {
    // A spec named without a folder (`policy.toml`) is in the current one.
    let spec_dir = if spec_dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        spec_dir
    };
    let files: Vec<String> = std::fs::read_dir(spec_dir)
        .map(|entries| {
            entries
                .filter_map(|entry| entry.ok())
                .filter(|entry| entry.file_type().is_ok_and(|t| t.is_file()))
                .filter_map(|entry| entry.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    let has = |name: &str| files.iter().any(|f| f == name);
    let with_ext = |ext: &str| files.iter().find(|f| f.ends_with(ext)).cloned();
    let dir = spec_dir.display();
    let pages = "docs/book/src/policies/python-js.md";
    if has("Cargo.toml") {
        // A crate beside its spec, whatever else is there.
    } else if has("app.py") || with_ext(".py").is_some() {
        let module = if has("app.py") { "app" } else { "MODULE" };
        return format!(
            "It is a Python policy (.py files beside the spec): build it with componentize-py \
             in the spec's folder ({dir}): `componentize-py -d {} -w policy componentize {module} -o {plugin}` \
             (once: `python3 -m pip install --user componentize-py==0.25.1`; see {pages})",
            contract_dir(spec_dir)
        );
    } else if has("package.json") {
        return format!(
            "It is a JavaScript policy (package.json beside the spec): build it with \
             componentize-js in the spec's folder ({dir}): `npm ci && npm run build` (its build script runs \
             `componentize-js ... --world-name policy --disable http fetch-event -o {plugin}`; \
             see {pages})"
        );
    } else if let Some(script) = with_ext(".js") {
        return format!(
            "It is a JavaScript policy (.js files beside the spec): build it with \
             componentize-js in the spec's folder ({dir}): `npx @bytecodealliance/componentize-js {script} --wit {} \
             --world-name policy --disable http fetch-event -o {plugin}` (see {pages})",
            contract_dir(spec_dir)
        );
    }
    "Build your policy crate with `cargo build --target wasm32-wasip2 --release` and point \
     `plugin` at the .wasm it writes (target/wasm32-wasip2/release/NAME.wasm); a Python or \
     JavaScript policy is built with componentize-py or componentize-js \
     (docs/book/src/policies/python-js.md)"
        .to_owned()
}

/// The contract's folder (`wit/`, holding `policy.wit`) as a path from `dir`: its own,
/// or its parents' up to three levels (a scaffold copies it in; the examples use the
/// repository's).
fn contract_dir(dir: &Path) -> String {
    let mut up = String::new();
    let Ok(mut at) = dir.canonicalize() else {
        return "PATH/TO/tokwatt/wit".to_owned();
    };
    for _ in 0..4 {
        if at.join("wit").join("policy.wit").is_file() {
            return format!("{up}wit");
        }
        match at.parent() {
            Some(parent) => at = parent.to_owned(),
            None => break,
        }
        up.push_str("../");
    }
    "PATH/TO/tokwatt/wit".to_owned()
}

/// The line and column (from 1) of byte `offset` of `text`.
fn line_and_column(text: &str, offset: usize) -> (u32, u32) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rfind('\n').map_or(before, |n| &before[n + 1..]);
    let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    (count(line), count(column.chars().count() + 1))
}

/// The TOML parser's reason without anything it quoted from the file. Its messages are
/// `WHAT, expected WHAT'S ALLOWED`: the grammar's or the spec's words after "expected",
/// and before it, where the file is quoted (`unknown field `k``, `invalid type: string
/// "v"`), the quote cut off. A missing field is named by the spec, not the file.
fn reason_without_contents(message: &str) -> String {
    let message = message.trim();
    if message.starts_with("missing field") {
        return message.to_owned();
    }
    let (head, expected) = match message.find(", expected") {
        Some(at) => message.split_at(at),
        None => (message, ""),
    };
    let head = head
        .find(['`', '"', '\''])
        .map_or(head, |quote| &head[..quote])
        .trim_end();
    format!("{head}{expected}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<PolicySpec, SpecError> {
        PolicySpec::parse(Path::new("/specs/p.toml"), text)
    }

    #[test]
    fn full_spec() {
        let spec = parse(
            r#"
            name = "hill-climb"
            plugin = "policy_hill_climb.wasm"
            knobs = ["power-cap", "batch-size"]
            tick_ms = 500
            [params]
            step_w = "50"
            window = 5
            [objective]
            tpot_p99_limit_ms = 60.0
            [guardrails]
            power_cap_min_w = 300.0
            max_power_cap_step_w = 100.0
            [sandbox]
            fuel_per_call = 1000
            "#,
        )
        .expect("valid");
        assert!(spec.knobs.power_cap && spec.knobs.batch_size && !spec.knobs.sm_clock);
        assert_eq!(spec.tick_ms, 500);
        assert_eq!(
            spec.params,
            vec![
                ("step_w".into(), "50".into()),
                ("window".into(), "5".into())
            ]
        );
        assert_eq!(spec.objective.tpot_p99_limit_ms, Some(60.0));
        assert_eq!(spec.guardrails.power_cap_min_w, Some(300.0));
        assert_eq!(spec.sandbox.fuel_per_call, 1000);
        assert_eq!(spec.sandbox.memory_mib, SandboxLimits::default().memory_mib);
    }

    #[test]
    fn the_token_budget_is_a_knob_with_guardrails_of_its_own() {
        let spec = parse(
            "name='x'\nplugin='x.wasm'\nknobs=['batch-size', 'token-budget']\n\
             [guardrails]\ntoken_budget_min = 256\ntoken_budget_max = 4096\n\
             max_token_budget_step = 1024",
        )
        .expect("valid");
        assert!(spec.knobs.token_budget && spec.knobs.batch_size && !spec.knobs.power_cap);
        assert_eq!(spec.guardrails.token_budget_min, Some(256));
        assert_eq!(spec.guardrails.token_budget_max, Some(4096));
        assert_eq!(spec.guardrails.max_token_budget_step, Some(1024));
        let listed = parse("name='x'\nplugin='x.wasm'\nknobs=['prefill']").expect_err("bad");
        assert!(listed.to_string().contains("\"token-budget\""), "{listed}");
    }

    #[test]
    fn errors_name_the_problem() {
        let unknown_knob =
            parse("name='x'\nplugin='x.wasm'\nknobs=['fan-speed']").expect_err("bad");
        assert!(
            unknown_knob.to_string().contains("fan-speed"),
            "{unknown_knob}"
        );
        let typo =
            parse("name='x'\nplugin='x.wasm'\n[guardrails]\npower_cap_max=5").expect_err("bad");
        assert!(typo.to_string().contains("power_cap_max"), "{typo}");
        let missing = parse("name='x'").expect_err("bad");
        assert!(missing.to_string().contains("plugin"), "{missing}");
        let tick = parse("name='x'\nplugin='x.wasm'\ntick_ms=0").expect_err("bad");
        assert!(tick.to_string().contains("tick_ms"), "{tick}");
    }

    #[test]
    fn a_reply_without_contents_keeps_the_reason_and_its_place_but_nothing_of_the_file() {
        let reply = |text: &str| parse(text).expect_err("bad").without_contents();
        let unknown = reply("name='x'\nplugin='x.wasm'\nsecret_key='hunter2'\n");
        assert!(
            unknown.contains("/specs/p.toml:3:1 is not a valid policy spec: unknown field, expected one of `name`, `plugin`"),
            "{unknown}"
        );
        let wrong_type =
            reply("name='x'\nplugin='x.wasm'\n[objective]\ntpot_p99_limit_ms='hunter2'\n");
        assert!(
            wrong_type
                .contains(":4:19 is not a valid policy spec: invalid type: string, expected f64"),
            "{wrong_type}"
        );
        let missing = reply("name='hunter2'\n");
        assert!(missing.contains("missing field `plugin`"), "{missing}");
        let not_toml = reply("root:$6$hunter2:19000:0:99999:7:::\n");
        assert!(
            not_toml.contains(":1:35 is not a valid policy spec: key with no value, expected `=`"),
            "{not_toml}"
        );
        for text in [unknown, wrong_type, missing, not_toml] {
            assert!(
                !text.contains("hunter2") && !text.contains("secret_key"),
                "{text}"
            );
            // The command it names is the one `tokwatt check` accepts, and the page has the keys.
            assert!(
                text.contains("run `tokwatt check /specs/p.toml` on the node"),
                "{text}"
            );
            assert!(text.contains("docs/book/src/reference/spec.md"), "{text}");
        }
    }

    #[test]
    fn plugin_not_found_lists_where_it_looked() {
        let spec = parse("name='x'\nplugin='nope.wasm'").expect("valid");
        let err = spec
            .resolve_plugin(&[PathBuf::from("/built")])
            .expect_err("missing");
        let text = err.to_string();
        assert!(
            text.contains("/specs/nope.wasm") && text.contains("/built/nope.wasm"),
            "{text}"
        );
        // An out-of-tree author is told how to build their own crate, not tokwatt's.
        assert!(
            text.contains("--target wasm32-wasip2") && !text.contains("cargo build -p tokwatt"),
            "{text}"
        );
    }
}
