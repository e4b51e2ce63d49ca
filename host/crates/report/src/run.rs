//! The report of one run, built from the run's own files: `summary.json` for the
//! headline figures and `trace.csv` for the charts, read one row at a time so that a
//! week-long trace needs no more memory than a minute of it.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{Downsampler, LineChart, MAX_BUCKETS, Page, ReportError, Series, format_value};
use tokwatt_core::types::Objective;
use tokwatt_policy::spec::PolicySpec;

/// Ticks in the rolling tokens-per-joule window.
pub const ROLLING_TICKS: usize = 10;

/// The report of the run in `run_dir`, with the objective `summary.json` records; a
/// summary from before it recorded one takes it from the run's policy spec file as that
/// file is now (the page says so), or leaves it out where the file cannot be read.
pub fn run_report(run_dir: &Path) -> Result<String, ReportError> {
    let summary = read_summary(run_dir)?;
    let objective = match summary
        .get("objective")
        .and_then(|o| serde_json::from_value::<Objective>(o.clone()).ok())
    {
        Some(objective) => ObjectiveSource::Run(objective),
        None => objective_from_spec(&summary),
    };
    render(run_dir, &summary, &objective)
}

/// The report of the run in `run_dir`, whose objective is known (the one the run used).
pub fn run_report_with_objective(
    run_dir: &Path,
    objective: &Objective,
) -> Result<String, ReportError> {
    let summary = read_summary(run_dir)?;
    render(run_dir, &summary, &ObjectiveSource::Run(*objective))
}

enum ObjectiveSource {
    Run(Objective),
    SpecFile(PathBuf, Objective),
    Unknown(String),
}

impl ObjectiveSource {
    fn objective(&self) -> Option<&Objective> {
        match self {
            Self::Run(o) | Self::SpecFile(_, o) => Some(o),
            Self::Unknown(_) => None,
        }
    }
}

fn objective_from_spec(summary: &Value) -> ObjectiveSource {
    let Some(path) = summary.get("policy_spec").and_then(Value::as_str) else {
        return ObjectiveSource::Unknown("summary.json names no policy spec".to_owned());
    };
    match PolicySpec::load(Path::new(path)) {
        Ok(spec) => ObjectiveSource::SpecFile(PathBuf::from(path), spec.objective),
        Err(error) => ObjectiveSource::Unknown(error.to_string()),
    }
}

fn read_summary(run_dir: &Path) -> Result<Value, ReportError> {
    let path = run_dir.join("summary.json");
    let text = std::fs::read_to_string(&path).map_err(|source| ReportError::Read {
        path: path.clone(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| ReportError::Json { path, source })
}

/// The trace columns the charts use, in this order; each may be absent from a trace
/// (written by another version, or empty where the workload does not report it).
const COLUMNS: [&str; 14] = [
    "power_avg_w",
    "power_peak_w",
    "power_cap_w",
    "power_cap_requested_w",
    "sm_clock_max_mhz",
    "sm_clock_mhz",
    "batch_size",
    "tokens",
    "energy_j",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "requests_arrived",
    "requests_turned_away",
    "queue_wait_p99_ms",
];
const POWER_AVG: usize = 0;
const POWER_PEAK: usize = 1;
const CAP: usize = 2;
const CAP_REQUESTED: usize = 3;
const SM_LOCK: usize = 4;
const SM_CLOCK: usize = 5;
const BATCH: usize = 6;
const TOKENS: usize = 7;
const ENERGY: usize = 8;
const TPOT_P50: usize = 9;
const TPOT_P99: usize = 10;
const ARRIVED: usize = 11;
const TURNED_AWAY: usize = 12;
const QUEUE_WAIT: usize = 13;
/// The drawn lines: every column but tokens and energy, plus the rolling tokens per joule.
const LINES: usize = COLUMNS.len() + 1;
const ROLLING: usize = COLUMNS.len();

/// One GPU's lines, reduced as the rows stream by.
struct GpuLines {
    lines: Vec<Downsampler>,
    /// Whether a line got any value (demand columns are empty for most workloads).
    has_values: [bool; LINES],
    /// Whether the enforced cap ever differed from the requested one.
    cap_held_lower: bool,
    window: VecDeque<(f64, f64)>,
    rows: u64,
}

impl GpuLines {
    fn new(x_range: (f64, f64)) -> Self {
        Self {
            lines: (0..LINES)
                .map(|_| Downsampler::new(x_range, MAX_BUCKETS))
                .collect(),
            has_values: [false; LINES],
            cap_held_lower: false,
            window: VecDeque::with_capacity(ROLLING_TICKS + 1),
            rows: 0,
        }
    }

    fn push(&mut self, time_s: f64, values: &[Option<f64>; COLUMNS.len()]) {
        self.rows += 1;
        for (line, value) in values.iter().enumerate() {
            if line == TOKENS || line == ENERGY {
                continue;
            }
            self.has_values[line] |= value.is_some_and(f64::is_finite);
            self.lines[line].push(time_s, value.unwrap_or(f64::NAN));
        }
        if let (Some(cap), Some(requested)) = (values[CAP], values[CAP_REQUESTED]) {
            self.cap_held_lower |= (cap - requested).abs() > 0.05;
        }
        // Tokens per joule over the window is its tokens over its energy, not a mean of
        // per-tick ratios (an idle tick would weigh as much as a busy one).
        let rolling = match (values[TOKENS], values[ENERGY]) {
            (Some(tokens), Some(energy)) => {
                self.window.push_back((tokens, energy));
                if self.window.len() > ROLLING_TICKS {
                    self.window.pop_front();
                }
                let (tokens, energy) = self
                    .window
                    .iter()
                    .fold((0.0, 0.0), |(t, e), (wt, we)| (t + wt, e + we));
                if energy > 0.0 {
                    tokens / energy
                } else {
                    f64::NAN
                }
            }
            _ => f64::NAN,
        };
        self.has_values[ROLLING] |= rolling.is_finite();
        self.lines[ROLLING].push(time_s, rolling);
    }

    fn finish(self) -> FinishedLines {
        FinishedLines {
            lines: self.lines.into_iter().map(Downsampler::finish).collect(),
            has_values: self.has_values,
            cap_held_lower: self.cap_held_lower,
            rows: self.rows,
        }
    }
}

struct FinishedLines {
    lines: Vec<Vec<(f64, f64)>>,
    has_values: [bool; LINES],
    cap_held_lower: bool,
    rows: u64,
}

struct Trace {
    gpus: BTreeMap<u32, FinishedLines>,
    /// The policies in charge, in the order they took over (a hot swap changes it).
    policies: Vec<String>,
}

fn column_index(
    headers: &csv::StringRecord,
    path: &Path,
    column: &'static str,
) -> Result<usize, ReportError> {
    headers
        .iter()
        .position(|h| h == column)
        .ok_or_else(|| ReportError::MissingColumn {
            path: path.to_owned(),
            column,
        })
}

fn open_trace(path: &Path) -> Result<(csv::Reader<std::fs::File>, csv::StringRecord), ReportError> {
    let csv_error = |source| ReportError::Csv {
        path: path.to_owned(),
        source,
    };
    let mut reader = csv::Reader::from_path(path).map_err(csv_error)?;
    let headers = reader.headers().map_err(csv_error)?.clone();
    Ok((reader, headers))
}

fn parse_number(
    record: &csv::StringRecord,
    index: usize,
    path: &Path,
    column: &'static str,
) -> Result<Option<f64>, ReportError> {
    let text = record.get(index).unwrap_or("").trim();
    if text.is_empty() {
        return Ok(None);
    }
    text.parse().map(Some).map_err(|_| ReportError::BadValue {
        path: path.to_owned(),
        line: record.position().map_or(0, csv::Position::line),
        column,
        value: text.chars().take(40).collect(),
    })
}

/// The latest `time_s` in the trace, for a summary that does not give the duration.
fn last_time(path: &Path) -> Result<f64, ReportError> {
    let (mut reader, headers) = open_trace(path)?;
    let time = column_index(&headers, path, "time_s")?;
    let mut last = 0.0f64;
    for record in reader.records() {
        let record = record.map_err(|source| ReportError::Csv {
            path: path.to_owned(),
            source,
        })?;
        if let Some(t) = parse_number(&record, time, path, "time_s")? {
            last = last.max(t);
        }
    }
    Ok(last)
}

fn read_trace(path: &Path, x_range: (f64, f64)) -> Result<Trace, ReportError> {
    let (mut reader, headers) = open_trace(path)?;
    let time = column_index(&headers, path, "time_s")?;
    let gpu = column_index(&headers, path, "gpu")?;
    let policy = headers.iter().position(|h| h == "policy");
    let indices: Vec<Option<usize>> = COLUMNS
        .iter()
        .map(|c| headers.iter().position(|h| h == *c))
        .collect();
    let mut gpus: BTreeMap<u32, GpuLines> = BTreeMap::new();
    let mut policies: Vec<String> = Vec::new();
    let mut record = csv::StringRecord::new();
    loop {
        match reader.read_record(&mut record) {
            Ok(true) => {}
            Ok(false) => break,
            Err(source) => {
                return Err(ReportError::Csv {
                    path: path.to_owned(),
                    source,
                });
            }
        }
        let Some(time_s) = parse_number(&record, time, path, "time_s")? else {
            continue;
        };
        let gpu_text = record.get(gpu).unwrap_or("").trim();
        let gpu_id: u32 = gpu_text.parse().map_err(|_| ReportError::BadValue {
            path: path.to_owned(),
            line: record.position().map_or(0, csv::Position::line),
            column: "gpu",
            value: gpu_text.chars().take(40).collect(),
        })?;
        let mut values = [None; COLUMNS.len()];
        for (slot, (index, column)) in values.iter_mut().zip(indices.iter().zip(COLUMNS)) {
            if let Some(index) = index {
                *slot = parse_number(&record, *index, path, column)?;
            }
        }
        if let Some(name) = policy.and_then(|i| record.get(i))
            && !policies.iter().any(|p| p == name)
        {
            policies.push(name.to_owned());
        }
        gpus.entry(gpu_id)
            .or_insert_with(|| GpuLines::new(x_range))
            .push(time_s, &values);
    }
    Ok(Trace {
        gpus: gpus.into_iter().map(|(g, l)| (g, l.finish())).collect(),
        policies,
    })
}

/// The time axis' unit, chosen so that its labels stay short.
fn time_unit(duration_s: f64) -> (f64, &'static str) {
    if duration_s <= 600.0 {
        (1.0, "s")
    } else if duration_s <= 36_000.0 {
        (60.0, "min")
    } else {
        (3600.0, "h")
    }
}

fn text<'a>(summary: &'a Value, key: &str) -> Option<&'a str> {
    summary.get(key).and_then(Value::as_str)
}

fn number(summary: &Value, key: &str) -> Option<f64> {
    summary.get(key).and_then(Value::as_f64)
}

fn or_not_recorded(value: Option<String>) -> String {
    value.unwrap_or_else(|| "not recorded".to_owned())
}

fn render(
    run_dir: &Path,
    summary: &Value,
    objective: &ObjectiveSource,
) -> Result<String, ReportError> {
    let trace_path = run_dir.join("trace.csv");
    let duration_s = match number(summary, "duration_s").filter(|d| d.is_finite() && *d > 0.0) {
        Some(d) => d,
        None => last_time(&trace_path)?,
    };
    let trace = read_trace(&trace_path, (0.0, duration_s))?;
    let policy = text(summary, "policy").unwrap_or("unnamed policy");
    let mut page = Page::new(&format!("tokwatt run report: {policy}"));

    page.notice(&data_source_line(summary));
    page.heading("Summary");
    page.table(&["", "value"], &headline_rows(summary, &trace, duration_s));
    page.paragraph(&objective_line(objective));
    if let Some(gpus) = summary.get("gpus").and_then(Value::as_array) {
        page.table(
            &[
                "GPU",
                "tokens",
                "energy (J)",
                "tokens per joule",
                "SLO violation ticks",
                "final power cap (W)",
                "final SM clock limit (MHz)",
                "final batch size",
            ],
            &gpus.iter().map(gpu_row).collect::<Vec<_>>(),
        );
    }

    let tick_s = number(summary, "tick_ms").map(|ms| ms / 1000.0);
    let (scale, unit) = time_unit(duration_s);
    let x_label = format!("time since the start ({unit})");
    let objective = objective.objective();
    for (gpu, lines) in &trace.gpus {
        page.heading(&format!("GPU {gpu}"));
        page.paragraph(&format!(
            "{} ticks. Settings are those in force during each tick; tokens per joule is \
             the tokens over the energy of the last {ROLLING_TICKS} ticks{}.",
            lines.rows,
            tick_s.map_or(String::new(), |t| format!(
                " ({} s)",
                format_value(t * ROLLING_TICKS as f64)
            )),
        ));
        let gpu_tpj = gpu_tokens_per_joule(summary, *gpu);
        for chart in gpu_charts(*gpu, lines, objective, gpu_tpj, duration_s, tick_s) {
            let chart = LineChart {
                x_label: x_label.clone(),
                series: chart
                    .series
                    .into_iter()
                    .map(|s| Series {
                        points: s.points.iter().map(|(x, y)| (x / scale, *y)).collect(),
                        ..s
                    })
                    .collect(),
                ..chart
            };
            page.svg(chart.to_svg());
        }
    }
    if trace.gpus.is_empty() {
        page.paragraph("The trace has no rows: the run ended before its first tick.");
    }
    page.paragraph(&format!(
        "Made by tokwatt {} from summary.json and trace.csv in {}. Each line is drawn \
         from at most {} points: in each slice of the time axis, its lowest and highest value.",
        env!("CARGO_PKG_VERSION"),
        run_dir.display(),
        2 * MAX_BUCKETS
    ));
    Ok(page.finish())
}

fn data_source_line(summary: &Value) -> String {
    let source = text(summary, "data_source").unwrap_or("no data source recorded");
    match summary.get("simulated").and_then(Value::as_bool) {
        Some(true) => format!(
            "Simulator output: every figure in this report comes from the simulator, not \
             from a GPU measurement. Data source: {source}."
        ),
        Some(false) => format!("Measured on real GPUs. Data source: {source}."),
        None => format!(
            "summary.json does not say whether this run was simulated. Data source: {source}."
        ),
    }
}

fn headline_rows(summary: &Value, trace: &Trace, duration_s: f64) -> Vec<Vec<String>> {
    let row = |key: &str, value: String| vec![key.to_owned(), value];
    let count = |key: &str| number(summary, key).map(|v| format!("{v:.0}"));
    let ticks = number(summary, "ticks");
    let mut rows = vec![
        row(
            "policy",
            or_not_recorded(text(summary, "policy").map(str::to_owned)),
        ),
        row(
            "policy spec",
            or_not_recorded(text(summary, "policy_spec").map(str::to_owned)),
        ),
    ];
    if trace.policies.len() > 1 {
        rows.push(row(
            "policies in charge (hot swaps)",
            trace.policies.join(", "),
        ));
    }
    let simulated = if summary.get("simulated").and_then(Value::as_bool) == Some(true) {
        " (simulated)"
    } else {
        ""
    };
    let gpus = match (number(summary, "gpu_count"), text(summary, "gpu_name")) {
        (Some(n), Some(name)) => Some(format!("{n:.0} × {name}{simulated}")),
        (None, Some(name)) => Some(format!("{name}{simulated}")),
        (Some(n), None) => Some(format!("{n:.0}")),
        (None, None) => None,
    };
    rows.extend([
        row("GPUs", or_not_recorded(gpus)),
        row(
            "tokens per joule",
            or_not_recorded(number(summary, "tokens_per_joule").map(|v| format!("{v:.4}"))),
        ),
        row("tokens", or_not_recorded(count("tokens"))),
        row(
            "energy",
            or_not_recorded(
                number(summary, "energy_j")
                    .map(|j| format!("{j:.0} J ({} kWh)", format_value(j / 3.6e6))),
            ),
        ),
        row(
            "duration",
            format!(
                "{} s{}",
                format_value(duration_s),
                ticks.map_or(String::new(), |t| format!(" in {t:.0} ticks"))
            ),
        ),
        row(
            "SLO violation ticks",
            or_not_recorded(count("slo_violation_ticks")),
        ),
    ]);
    if let Some(demand) = summary.get("demand").filter(|d| d.is_object()) {
        rows.push(row(
            "served fraction",
            or_not_recorded(
                number(demand, "served_fraction").map(|f| format!("{}%", format_value(f * 100.0))),
            ),
        ));
        rows.push(row(
            "requests arrived / turned away",
            format!(
                "{} / {}",
                or_not_recorded(number(demand, "requests_arrived").map(|v| format!("{v:.0}"))),
                or_not_recorded(number(demand, "requests_turned_away").map(|v| format!("{v:.0}")))
            ),
        ));
    }
    rows.push(row(
        "fallback ticks",
        format!(
            "{} (plugin traps {})",
            or_not_recorded(count("fallback_ticks")),
            or_not_recorded(count("plugin_traps"))
        ),
    ));
    if summary.get("interrupted").and_then(Value::as_bool) == Some(true) {
        rows.push(row(
            "interrupted",
            "yes: the run was stopped early".to_owned(),
        ));
    }
    rows
}

fn objective_line(source: &ObjectiveSource) -> String {
    let describe = |o: &Objective| {
        let mut parts = Vec::new();
        if let Some(limit) = o.tpot_p99_limit_ms {
            parts.push(format!("TPOT p99 at most {} ms", format_value(limit)));
        }
        if let Some(min) = o.min_tokens_per_s {
            parts.push(format!(
                "at least {} tokens/s per GPU while requests queue",
                format_value(min)
            ));
        }
        if let Some(limit) = o.queue_wait_p99_limit_ms {
            parts.push(format!("queue wait p99 at most {} ms", format_value(limit)));
        }
        if parts.is_empty() {
            "none (no tick counts as a violation, except one that turns requests away)".to_owned()
        } else {
            parts.join("; ")
        }
    };
    match source {
        ObjectiveSource::Run(o) => format!("Objective: {}.", describe(o)),
        ObjectiveSource::SpecFile(path, o) => format!(
            "Objective: {} (read from the spec file {} as it is now; summary.json does not \
             record the objective).",
            describe(o),
            path.display()
        ),
        ObjectiveSource::Unknown(why) => {
            format!("Objective: not known, so no limits are drawn ({why}).")
        }
    }
}

fn gpu_row(gpu: &Value) -> Vec<String> {
    let final_setting = |key: &str| {
        gpu.get("final_settings")
            .and_then(|f| f.get(key))
            .and_then(Value::as_f64)
            .map_or_else(|| "n/a".to_owned(), |v| format!("{v:.0}"))
    };
    let value = |key: &str, decimals: usize| {
        number(gpu, key).map_or_else(|| "n/a".to_owned(), |v| format!("{v:.decimals$}"))
    };
    vec![
        value("gpu", 0),
        value("tokens", 0),
        value("energy_j", 0),
        value("tokens_per_joule", 4),
        value("slo_violation_ticks", 0),
        final_setting("power_cap_w"),
        final_setting("sm_clock_max_mhz"),
        final_setting("batch_size"),
    ]
}

fn gpu_tokens_per_joule(summary: &Value, gpu: u32) -> Option<f64> {
    summary
        .get("gpus")?
        .as_array()?
        .iter()
        .find(|g| g.get("gpu").and_then(Value::as_u64) == Some(u64::from(gpu)))
        .and_then(|g| number(g, "tokens_per_joule"))
}

/// The panels of one GPU, x in seconds.
fn gpu_charts(
    gpu: u32,
    lines: &FinishedLines,
    objective: Option<&Objective>,
    gpu_tokens_per_joule: Option<f64>,
    duration_s: f64,
    tick_s: Option<f64>,
) -> Vec<LineChart> {
    let line = |name: &str, index: usize| Series::new(name, lines.lines[index].clone());
    let level = |name: &str, y: f64| Series::dashed(name, vec![(0.0, y), (duration_s, y)]);
    let chart = |title: &str, y_label: &str, series: Vec<Series>| LineChart {
        title: format!("GPU {gpu}: {title}"),
        x_label: String::new(),
        y_label: y_label.to_owned(),
        series,
    };

    let mut power = vec![
        line("average", POWER_AVG),
        line("peak", POWER_PEAK),
        Series::dashed("power cap (enforced)", lines.lines[CAP].clone()),
    ];
    if lines.cap_held_lower {
        power.push(Series::dashed(
            "power cap (requested)",
            lines.lines[CAP_REQUESTED].clone(),
        ));
    }
    let mut efficiency = vec![line(&format!("last {ROLLING_TICKS} ticks"), ROLLING)];
    if let Some(tpj) = gpu_tokens_per_joule.filter(|v| v.is_finite()) {
        efficiency.push(level("whole run", tpj));
    }
    let mut tpot = vec![line("p50", TPOT_P50), line("p99", TPOT_P99)];
    if let Some(limit) = objective.and_then(|o| o.tpot_p99_limit_ms) {
        tpot.push(level("p99 limit (objective)", limit));
    }
    let window = tick_s.map_or_else(
        || "per tick".to_owned(),
        |t| format!("per tick ({} s)", format_value(t)),
    );
    let mut charts = vec![
        chart("power and the power cap in force", "W", power),
        chart(
            &format!("tokens per joule, rolling over {ROLLING_TICKS} ticks"),
            "tokens per joule",
            efficiency,
        ),
        chart(
            "SM clock: limit in force (lock) and actual",
            "MHz",
            vec![
                Series::dashed("limit (lock)", lines.lines[SM_LOCK].clone()),
                line("actual", SM_CLOCK),
            ],
        ),
        chart(
            "batch size in force",
            "sequences",
            vec![line("batch size", BATCH)],
        ),
        chart("time per output token", "ms", tpot),
    ];
    if lines.has_values[ARRIVED] || lines.has_values[TURNED_AWAY] {
        charts.push(chart(
            &format!("requests {window}"),
            "requests",
            vec![line("arrived", ARRIVED), line("turned away", TURNED_AWAY)],
        ));
    }
    if lines.has_values[QUEUE_WAIT] {
        let mut wait = vec![line("p99", QUEUE_WAIT)];
        if let Some(limit) = objective.and_then(|o| o.queue_wait_p99_limit_ms) {
            wait.push(level("p99 limit (objective)", limit));
        }
        charts.push(chart("queue wait for a batch slot", "ms", wait));
    }
    charts
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = "time_s,tick,gpu,policy,power_cap_w,power_cap_requested_w,\
                          sm_clock_max_mhz,batch_size,power_avg_w,power_peak_w,energy_j,\
                          tokens,tpot_p50_ms,tpot_p99_ms";

    fn run_folder(summary: &str, trace: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("summary.json"), summary).expect("summary");
        std::fs::write(dir.path().join("trace.csv"), trace).expect("trace");
        dir
    }

    fn trace(rows: u32) -> String {
        let mut text = format!("{HEADER}\n");
        for tick in 0..rows {
            // 4 tokens per joule until tick 20, then 2; the cap held below the request.
            let tokens = if tick < 20 { 2000 } else { 1000 };
            text.push_str(&format!(
                "{}.0,{tick},0,p,400.0,450.0,1980,64,480.5,600.0,500.0,{tokens},10.0,20.0\n",
                tick + 1
            ));
        }
        text
    }

    #[test]
    fn a_measured_run_without_demand_columns_gets_the_panels_it_has_data_for() {
        let summary = r#"{"policy":"p","simulated":false,"data_source":"NVML on GPU-abc",
            "duration_s":40.0,"tick_ms":1000,"tokens_per_joule":3.0,"tokens":60000,
            "energy_j":20000.0,"ticks":40,"slo_violation_ticks":2,"fallback_ticks":0,
            "plugin_traps":0,"gpus":[{"gpu":0,"tokens_per_joule":3.0}]}"#;
        let dir = run_folder(summary, &trace(40));
        let objective = Objective {
            tpot_p99_limit_ms: Some(25.0),
            ..Objective::default()
        };
        let html = run_report_with_objective(dir.path(), &objective).expect("report");
        assert!(html.contains("Measured on real GPUs. Data source: NVML on GPU-abc."));
        assert!(!html.contains("Simulator output"));
        assert_eq!(html.matches("<svg").count(), 5, "no demand panels");
        assert!(html.contains(">p99 limit (objective)</text>"));
        // The enforced cap differs from the requested one, so both are drawn.
        assert!(html.contains(">power cap (requested)</text>"));
        assert!(html.contains("<td>SLO violation ticks</td><td>2</td>"));
        assert!(
            !html.contains("served fraction"),
            "no demand in the summary"
        );
    }

    #[test]
    fn the_rolling_efficiency_is_tokens_over_energy_of_the_window() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("trace.csv");
        std::fs::write(&path, trace(40)).expect("trace");
        let trace = read_trace(&path, (0.0, 40.0)).expect("read");
        let rolling = &trace.gpus[&0].lines[ROLLING];
        let at = |t: f64| {
            rolling
                .iter()
                .find(|p| p.0 == t)
                .map(|p| p.1)
                .expect("point kept")
        };
        assert_eq!(at(1.0), 4.0);
        // Tick 25 (time 25 s): 5 ticks at 4 tok/J and 5 at 2 tok/J.
        assert!((at(25.0) - 3.0).abs() < 1e-12, "{}", at(25.0));
        assert_eq!(at(40.0), 2.0);
        assert_eq!(trace.policies, ["p"]);
    }

    #[test]
    fn a_bad_value_is_named_with_its_line_and_column() {
        let mut text = trace(3);
        text.push_str("4.0,3,0,p,400.0,450.0,1980,64,oops,600.0,500.0,10,10.0,20.0\n");
        let dir = run_folder(r#"{"duration_s":4.0}"#, &text);
        let error = run_report(dir.path()).expect_err("bad value");
        let message = error.to_string();
        assert!(
            message.contains("line 5") && message.contains("power_avg_w"),
            "{message}"
        );
        assert!(message.contains("oops"), "{message}");
    }

    #[test]
    fn missing_files_and_columns_are_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let error = run_report(dir.path()).expect_err("no summary");
        assert!(error.to_string().contains("summary.json"), "{error}");
        let dir = run_folder("{}", "tick,gpu\n0,0\n");
        let error = run_report(dir.path()).expect_err("no time column");
        assert!(error.to_string().contains("`time_s`"), "{error}");
        let dir = run_folder("not json", "");
        assert!(matches!(
            run_report(dir.path()),
            Err(ReportError::Json { .. })
        ));
    }

    #[test]
    fn without_a_duration_the_trace_gives_the_time_axis() {
        let dir = run_folder(r#"{"policy":"p"}"#, &trace(5));
        let html = run_report(dir.path()).expect("report");
        assert!(html.contains("does not say whether this run was simulated"));
        assert!(html.contains("Objective: not known"), "no spec named");
        assert_eq!(html.matches("<svg").count(), 5);
        assert!(html.contains("time since the start (s)"));
    }

    #[test]
    fn an_empty_trace_makes_a_report_that_says_so() {
        let dir = run_folder(r#"{"policy":"p","duration_s":0.0}"#, &format!("{HEADER}\n"));
        let html = run_report(dir.path()).expect("report");
        assert!(html.contains("The trace has no rows"));
        assert!(!html.contains("<svg"));
    }
}
