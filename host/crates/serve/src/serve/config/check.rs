//! From serve.toml as written to a `ServeConfig`: every value checked, and a problem
//! named with its key and line.

use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokwatt_engines::prometheus::{Engine, request_metrics};
use toml::Spanned;

use super::raw::{RawConfig, RawDuration, RawFence, RawFleet, RawGpus, RawWorkload};
use super::{
    EngineEndpoint, FenceConfig, FenceWatch, FleetConfig, NodeBackend, ServeConfig, ServeWorkload,
};

mod fleet;
use fleet::check_fleet;

/// A bad value: its key, where it is written, and what would be right.
pub(super) struct Problem {
    pub(super) key: &'static str,
    pub(super) span: Option<Range<usize>>,
    pub(super) text: String,
}

fn problem<T>(key: &'static str, value: &Spanned<T>, text: impl Into<String>) -> Problem {
    Problem {
        key,
        span: Some(value.span()),
        text: text.into(),
    }
}

fn missing(key: &'static str, text: impl Into<String>) -> Problem {
    Problem {
        key,
        span: None,
        text: text.into(),
    }
}

/// 1-based line of byte `offset`.
pub(super) fn line_at(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// A duration key's value: a string with its unit. `accepted` says which values the key
/// takes ("at least 1s"), for the refusal of one that is not a duration at all.
fn duration(
    key: &'static str,
    value: &Spanned<RawDuration>,
    accepted: &str,
) -> Result<Duration, Problem> {
    // The key as written in its table: `summary_every`, not `output.summary_every`.
    let name = key.rsplit('.').next().unwrap_or(key);
    match value.get_ref() {
        RawDuration::Text(text) => humantime::parse_duration(text.trim()).map_err(|e| {
            problem(
                key,
                value,
                format!(
                    "= \"{text}\" is not a duration ({e}): write it like \"1s\", \"500ms\" or \"5m\" (accepted: {accepted})"
                ),
            )
        }),
        RawDuration::Number(number) => Err(problem(
            key,
            value,
            format!(
                "= {number} is a number without a unit: write the duration as a string with its unit, e.g. {name} = \"{number}s\" for seconds (units: ms, s, m, h; accepted: {accepted})"
            ),
        )),
        RawDuration::Other(other) => Err(problem(
            key,
            value,
            format!(
                "is a {}, not a duration: write it as a string with its unit, e.g. {name} = \"5s\" (units: ms, s, m, h; accepted: {accepted})",
                other.type_str()
            ),
        )),
    }
}

fn in_range(
    key: &'static str,
    value: &Spanned<i64>,
    range: std::ops::RangeInclusive<i64>,
    what: &str,
) -> Result<i64, Problem> {
    let v = *value.get_ref();
    if range.contains(&v) {
        Ok(v)
    } else {
        Err(problem(
            key,
            value,
            format!(
                "= {v}: {what} must be between {} and {}",
                range.start(),
                range.end()
            ),
        ))
    }
}

fn socket_addr(key: &'static str, value: &Spanned<String>) -> Result<SocketAddr, Problem> {
    value.get_ref().trim().parse().map_err(|_| {
        problem(
            key,
            value,
            format!(
                "= \"{}\" is not an address with a port: write it like \"127.0.0.1:9400\" or \"[::1]:9400\"",
                value.get_ref()
            ),
        )
    })
}

pub(super) fn check(raw: RawConfig, base: &Path, _path: &Path) -> Result<ServeConfig, Problem> {
    let resolve = |p: &Path| {
        if p.is_absolute() {
            p.to_owned()
        } else {
            base.join(p)
        }
    };
    let node = raw.node;
    let backend_name = node
        .backend
        .as_ref()
        .map_or("nvml", |b| b.get_ref().as_str());
    let sim_only: [(&'static str, bool); 5] = [
        ("node.sim_profile", node.sim_profile.is_some()),
        ("node.sim_gpus", node.sim_gpus.is_some()),
        ("node.sim_scenario", node.sim_scenario.is_some()),
        ("node.sim_realtime", node.sim_realtime.is_some()),
        ("node.sim_driver", node.sim_driver.is_some()),
    ];
    let backend = match backend_name {
        "nvml" => {
            if let Some((key, _)) = sim_only.iter().find(|(_, set)| *set) {
                return Err(missing(
                    key,
                    "applies to backend = \"sim\" only; remove it, or set node.backend = \"sim\"",
                ));
            }
            let gpus = match &node.gpus {
                None => None,
                Some(spanned) => match spanned.get_ref() {
                    RawGpus::Word(word) if word == "all" => None,
                    RawGpus::Word(word) => {
                        return Err(problem(
                            "node.gpus",
                            spanned,
                            format!(
                                "= \"{word}\": write \"all\" or a list of NVML indices like [0, 1]"
                            ),
                        ));
                    }
                    RawGpus::List(list) => {
                        let mut indices = Vec::with_capacity(list.len());
                        for &index in list {
                            let index = u32::try_from(index).map_err(|_| {
                                problem(
                                    "node.gpus",
                                    spanned,
                                    format!("has {index}, which is not an NVML index (0, 1, …)"),
                                )
                            })?;
                            if indices.contains(&index) {
                                return Err(problem(
                                    "node.gpus",
                                    spanned,
                                    format!("lists GPU {index} twice"),
                                ));
                            }
                            indices.push(index);
                        }
                        if indices.is_empty() {
                            return Err(problem(
                                "node.gpus",
                                spanned,
                                "is empty: write \"all\" or the NVML indices to manage",
                            ));
                        }
                        Some(indices)
                    }
                },
            };
            NodeBackend::Nvml { gpus }
        }
        "sim" => {
            if node.gpus.is_some() {
                return Err(missing(
                    "node.gpus",
                    "applies to backend = \"nvml\"; the simulator's GPU count is node.sim_gpus",
                ));
            }
            if node.dry_run {
                return Err(missing(
                    "node.dry_run",
                    "applies to real GPUs (backend = \"nvml\"); the simulator changes nothing real",
                ));
            }
            let gpus = match &node.sim_gpus {
                Some(n) => in_range("node.sim_gpus", n, 1..=64, "the simulated GPU count")? as u32,
                None => 1,
            };
            NodeBackend::Sim {
                profile: node
                    .sim_profile
                    .as_ref()
                    .map_or_else(|| "h200".to_owned(), |p| p.get_ref().clone()),
                gpus,
                scenario: node.sim_scenario.as_deref().map(resolve),
                realtime: node.sim_realtime.as_ref().is_none_or(|r| *r.get_ref()),
                driver: match &node.sim_driver {
                    Some(path) if path.get_ref().as_os_str().is_empty() => {
                        return Err(problem(
                            "node.sim_driver",
                            path,
                            "is empty: name the simulated driver's file (created at the board defaults if it does not exist), or remove the key to keep the settings in the agent alone",
                        ));
                    }
                    Some(path) => Some(resolve(path.get_ref())),
                    None => None,
                },
            }
        }
        other => {
            let spanned = node
                .backend
                .as_ref()
                .expect("a name other than the default was written");
            return Err(problem(
                "node.backend",
                spanned,
                format!(
                    "= \"{other}\": the backends are \"nvml\" (real GPUs) and \"sim\" (the simulated GPU)"
                ),
            ));
        }
    };
    let tick = node
        .tick
        .as_ref()
        .map(|t| {
            let accepted = format!(
                "between {} and {}",
                humantime::format_duration(tokwatt_policy::spec::MIN_TICK),
                humantime::format_duration(tokwatt_policy::spec::MAX_TICK)
            );
            let tick = duration("node.tick", t, &accepted)?;
            if (tokwatt_policy::spec::MIN_TICK..=tokwatt_policy::spec::MAX_TICK).contains(&tick) {
                Ok(tick)
            } else {
                Err(problem("node.tick", t, format!("must be {accepted}")))
            }
        })
        .transpose()?;

    let reads_ttft = raw.objective.ttft_p99_limit_ms.is_some();
    let workload = check_workload(raw.workload, &backend, reads_ttft)?;
    let rules = check_rules(raw.objective, raw.guardrails, raw.guard)?;

    let policy = raw.policy;
    let probation_ticks = match &policy.probation_ticks {
        Some(n) => in_range("policy.probation_ticks", n, 1..=100_000, "the probation")? as u64,
        None => tokwatt_agent::swap::DEFAULT_PROBATION_TICKS,
    };
    let watch_period = match &policy.watch_period {
        Some(p) => {
            let period = duration("policy.watch_period", p, "at least 100ms")?;
            if period < Duration::from_millis(100) {
                return Err(problem(
                    "policy.watch_period",
                    p,
                    format!(
                        "= {} must be at least 100ms, e.g. watch_period = \"2s\"",
                        humantime::format_duration(period)
                    ),
                ));
            }
            period
        }
        None => Duration::from_secs(2),
    };

    let api = raw.api;
    let http = api
        .http
        .as_ref()
        .map(|h| {
            let addr = socket_addr("api.http", h)?;
            if !addr.ip().is_loopback() {
                return Err(problem(
                    "api.http",
                    h,
                    format!("= \"{addr}\" is not a loopback address: the HTTP API listens on 127.0.0.1 or [::1] only (use the Unix socket, or a proxy with its own authentication, for remote access)"),
                ));
            }
            Ok(addr)
        })
        .transpose()?;
    if http.is_some() && api.token_file.is_none() {
        return Err(missing(
            "api.token_file",
            "is required with api.http: name a file (mode 600) holding the bearer token",
        ));
    }
    if http.is_none() && api.token_file.is_some() {
        return Err(missing(
            "api.token_file",
            "is set without api.http: the Unix socket needs no token (its permissions are the access control)",
        ));
    }
    let metrics_listen = raw
        .metrics
        .listen
        .as_ref()
        .map(|l| socket_addr("metrics.listen", l))
        .transpose()?;

    let output = raw.output;
    let max_file_bytes = match &output.max_file_mib {
        Some(n) => {
            in_range(
                "output.max_file_mib",
                n,
                1..=1_000_000,
                "the size of one output file, MiB",
            )? as u64
                * 1024
                * 1024
        }
        None => 64 * 1024 * 1024,
    };
    let keep_files = match &output.keep_files {
        Some(n) => in_range("output.keep_files", n, 0..=1000, "the rotated files kept")? as u32,
        None => 4,
    };
    let summary_every = match &output.summary_every {
        Some(s) => {
            let every = duration("output.summary_every", s, "at least 1s")?;
            if every < Duration::from_secs(1) {
                return Err(problem(
                    "output.summary_every",
                    s,
                    format!(
                        "= {} must be at least 1s, e.g. summary_every = \"5m\" (the default)",
                        humantime::format_duration(every)
                    ),
                ));
            }
            every
        }
        None => Duration::from_secs(300),
    };

    Ok(ServeConfig {
        path: _path.to_owned(),
        policy_spec: resolve(&policy.spec),
        plugin_dirs: policy.plugin_dirs.iter().map(|d| resolve(d)).collect(),
        cache_dir: policy.cache_dir.as_deref().map(resolve),
        watch: policy.watch.as_deref().map(resolve),
        watch_period,
        probation_ticks,
        seed: policy.seed,
        backend,
        workload,
        tick,
        dry_run: node.dry_run,
        batch_only: node.batch_only,
        socket: api.socket.as_deref().map(resolve),
        http,
        token_file: api.token_file.as_deref().map(resolve),
        metrics_listen,
        out_dir: output
            .dir
            .as_deref()
            .map_or_else(ServeConfig::default_out_dir, resolve),
        max_file_bytes,
        keep_files,
        summary_every,
        state_file: raw.state.file.as_deref().map(resolve),
        fleet: raw
            .fleet
            .map(|fleet| check_fleet(fleet, &resolve))
            .transpose()?,
        rules,
    })
}

/// The node's rules, each value checked: a bound that is not a positive number, and a
/// guard setting that makes no sense, are refused by key. Unset, the cap raise per tick is
/// [`tokwatt_policy::rules::DEFAULT_MAX_POWER_CAP_RAISE_W`].
fn check_rules(
    objective: tokwatt_core::types::Objective,
    mut guardrails: tokwatt_policy::envelope::Guardrails,
    guard: tokwatt_policy::guard::GuardConfig,
) -> Result<tokwatt_policy::rules::NodeRules, Problem> {
    let positive = |key: &'static str, value: Option<f64>| match value {
        Some(v) if !(v.is_finite() && v > 0.0) => Err(missing(
            key,
            format!("= {v}: must be a positive number (or left out for no bound)"),
        )),
        _ => Ok(()),
    };
    positive("objective.tpot_p99_limit_ms", objective.tpot_p99_limit_ms)?;
    // A floor of 0 is no floor, as in policy specs.
    positive(
        "objective.min_tokens_per_s",
        objective.min_tokens_per_s.filter(|&floor| floor != 0.0),
    )?;
    positive(
        "objective.queue_wait_p99_limit_ms",
        objective.queue_wait_p99_limit_ms,
    )?;
    positive("objective.ttft_p99_limit_ms", objective.ttft_p99_limit_ms)?;
    positive("guardrails.power_cap_min_w", guardrails.power_cap_min_w)?;
    positive("guardrails.power_cap_max_w", guardrails.power_cap_max_w)?;
    positive(
        "guardrails.max_power_cap_step_w",
        guardrails.max_power_cap_step_w,
    )?;
    if let (Some(lo), Some(hi)) = (guardrails.power_cap_min_w, guardrails.power_cap_max_w)
        && lo > hi
    {
        return Err(missing(
            "guardrails.power_cap_min_w",
            format!("({lo}) is above guardrails.power_cap_max_w ({hi})"),
        ));
    }
    guard.validate().map_err(|e| Problem {
        key: "guard",
        span: None,
        text: format!("has {}: {}", e.key, e.problem),
    })?;
    positive(
        "guardrails.max_power_cap_raise_w",
        guardrails.max_power_cap_raise_w,
    )?;
    guardrails.max_power_cap_raise_w = guardrails
        .max_power_cap_raise_w
        .or(Some(tokwatt_policy::rules::DEFAULT_MAX_POWER_CAP_RAISE_W));
    Ok(tokwatt_policy::rules::NodeRules {
        objective,
        guardrails,
        guard,
    })
}

/// `reads_ttft`: the node's objective bounds TTFT, so the engines' presets' TTFT
/// histograms are read (else only where an entry names one).
fn check_workload(
    raw: RawWorkload,
    backend: &NodeBackend,
    reads_ttft: bool,
) -> Result<ServeWorkload, Problem> {
    let source = raw.source.as_ref().map(|s| s.get_ref().as_str());
    match (backend, source) {
        (NodeBackend::Sim { .. }, None | Some("sim")) => {
            if !raw.engine.is_empty() || raw.model.is_some() {
                return Err(missing(
                    "workload",
                    "describes a real GPU's tokens; the simulator has its own workload (remove [workload], or set node.backend = \"nvml\")",
                ));
            }
            Ok(ServeWorkload::Sim)
        }
        (NodeBackend::Sim { .. }, Some(_)) | (NodeBackend::Nvml { .. }, Some("sim")) => {
            let spanned = raw.source.as_ref().expect("a source was written");
            Err(problem(
                "workload.source",
                spanned,
                "does not match node.backend: the simulator's tokens are \"sim\"; real GPUs' are \"cuda\" or \"external\"",
            ))
        }
        (NodeBackend::Nvml { .. }, None) => Err(missing(
            "workload.source",
            "is missing: write \"external\" (each GPU's serving engine, [[workload.engine]]) or \"cuda\" (tokwatt's own decode)",
        )),
        (NodeBackend::Nvml { .. }, Some("cuda")) => {
            if !raw.engine.is_empty() {
                return Err(missing(
                    "workload.engine",
                    "applies to source = \"external\"",
                ));
            }
            Ok(ServeWorkload::Cuda {
                model: raw.model.unwrap_or_else(|| "llama-3-8b".to_owned()),
                context: match &raw.context {
                    Some(c) => {
                        in_range("workload.context", c, 1..=1_048_576, "the context")? as u32
                    }
                    None => 1024,
                },
                batch_size_max: match &raw.batch_size_max {
                    Some(b) => in_range(
                        "workload.batch_size_max",
                        b,
                        1..=65_536,
                        "the largest batch",
                    )? as u32,
                    None => 512,
                },
            })
        }
        (NodeBackend::Nvml { gpus }, Some("external")) => {
            if raw.engine.is_empty() {
                return Err(missing(
                    "workload.engine",
                    "is missing: add one [[workload.engine]] per GPU with gpu, url and engine",
                ));
            }
            let mut endpoints: Vec<EngineEndpoint> = Vec::with_capacity(raw.engine.len());
            for entry in raw.engine {
                let gpu = u32::try_from(*entry.gpu.get_ref()).map_err(|_| {
                    problem(
                        "workload.engine.gpu",
                        &entry.gpu,
                        "is not an NVML index (0, 1, …)",
                    )
                })?;
                if endpoints.iter().any(|e| e.gpu == gpu) {
                    return Err(problem(
                        "workload.engine.gpu",
                        &entry.gpu,
                        format!("= {gpu} has two engines: give each GPU one"),
                    ));
                }
                if let Some(list) = gpus
                    && !list.contains(&gpu)
                {
                    return Err(problem(
                        "workload.engine.gpu",
                        &entry.gpu,
                        format!("= {gpu} is not among node.gpus {list:?}"),
                    ));
                }
                let url = entry.url.get_ref().trim().to_owned();
                if !url.starts_with("http://") {
                    return Err(problem(
                        "workload.engine.url",
                        &entry.url,
                        format!(
                            "= \"{url}\": write the metrics endpoint as http://HOST:PORT/metrics"
                        ),
                    ));
                }
                let engine = match &entry.engine {
                    Some(name) => name
                        .get_ref()
                        .parse::<Engine>()
                        .map_err(|e| problem("workload.engine.engine", name, e.to_string()))?,
                    None => Engine::Vllm,
                };
                let tpot_histogram = match entry.tpot_histogram {
                    Some(name) if name.is_empty() => None,
                    Some(name) => Some(name),
                    None => engine.tpot_histogram().map(str::to_owned),
                };
                let request_metrics = if reads_ttft || entry.ttft_histogram.is_some() {
                    request_metrics(engine, entry.ttft_histogram, entry.prompt_counter)
                        .map_err(|why| problem("workload.engine.ttft_histogram", &entry.url, why))?
                } else {
                    None
                };
                endpoints.push(EngineEndpoint {
                    gpu,
                    url,
                    engine,
                    token_counter: entry
                        .token_counter
                        .unwrap_or_else(|| engine.token_counter().to_owned()),
                    tpot_histogram,
                    request_metrics,
                });
            }
            if let Some(list) = gpus
                && let Some(gpu) = list
                    .iter()
                    .find(|g| !endpoints.iter().any(|e| e.gpu == **g))
            {
                return Err(missing(
                    "workload.engine",
                    format!(
                        "has no entry for GPU {gpu}: each managed GPU needs its serving engine's metrics"
                    ),
                ));
            }
            Ok(ServeWorkload::External(endpoints))
        }
        (NodeBackend::Nvml { .. }, Some(other)) => {
            let spanned = raw.source.as_ref().expect("a source was written");
            Err(problem(
                "workload.source",
                spanned,
                format!("= \"{other}\": the sources are \"external\" and \"cuda\""),
            ))
        }
    }
}
