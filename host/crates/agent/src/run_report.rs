//! The report of one run, built from the run's own files through their one reader each:
//! [`read_summary`] for the headline figures and [`TraceReader`] for the charts, a row at
//! a time, so that a week-long trace needs no more memory than a minute of it.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};

use crate::control::GpuTotals;
use crate::recorder::{TraceError, TraceReader, TraceRow, trace_files};
use crate::{RunSummary, SummaryError, read_summary};
use tokwatt_core::types::Objective;
use tokwatt_policy::spec::PolicySpec;
use tokwatt_report::{
    Downsampler, LineChart, MAX_BUCKETS, Page, ReportError, Series, format_value,
};

/// Ticks in the rolling tokens-per-joule window.
pub const ROLLING_TICKS: usize = 10;

/// Why a run's report could not be made.
#[derive(Debug, thiserror::Error)]
pub enum RunReportError {
    #[error(transparent)]
    Summary(#[from] SummaryError),
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error(transparent)]
    Write(#[from] ReportError),
}

/// The report of the run in `run_dir`, with the objective `summary.json` records; a
/// summary from before it recorded one takes it from the run's policy spec file as that
/// file is now (the page says so), or leaves it out where the file cannot be read.
pub fn run_report(run_dir: &Path) -> Result<String, RunReportError> {
    let summary = read_summary(run_dir)?;
    let objective = match summary.objective {
        Some(objective) => ObjectiveSource::Run(objective),
        None => objective_from_spec(&summary),
    };
    render(run_dir, &summary, &objective)
}

/// The report of the run in `run_dir`, whose objective is known (the one the run used).
pub fn run_report_with_objective(
    run_dir: &Path,
    objective: &Objective,
) -> Result<String, RunReportError> {
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

fn objective_from_spec(summary: &RunSummary) -> ObjectiveSource {
    if summary.policy_spec.is_empty() {
        return ObjectiveSource::Unknown("summary.json names no policy spec".to_owned());
    }
    let path = Path::new(&summary.policy_spec);
    match PolicySpec::load(path) {
        Ok(spec) => ObjectiveSource::SpecFile(path.to_owned(), spec.objective),
        Err(error) => ObjectiveSource::Unknown(error.to_string()),
    }
}

/// The trace columns the charts use, in this order (the demand columns are empty where
/// the workload does not report demand, the requests columns where it does not see
/// requests through).
const COLUMNS: [&str; 16] = [
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
    "ttft_p99_ms",
    "energy_per_request_j",
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
const TTFT: usize = 14;
const ENERGY_PER_REQUEST: usize = 15;
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
    /// The time of the oldest row kept (later than the first tick where a bounded run
    /// rotated its oldest rows away).
    first_time: Option<f64>,
}

/// A row's values in [`COLUMNS`]' order.
fn chart_values(row: &TraceRow) -> [Option<f64>; COLUMNS.len()] {
    let whole = |v: u64| Some(v as f64);
    [
        Some(row.power_avg_w),
        Some(row.power_peak_w),
        Some(row.power_cap_w),
        Some(row.power_cap_requested_w),
        Some(f64::from(row.sm_clock_max_mhz)),
        Some(f64::from(row.sm_clock_mhz)),
        Some(f64::from(row.batch_size)),
        whole(row.tokens),
        Some(row.energy_j),
        Some(row.tpot_p50_ms),
        Some(row.tpot_p99_ms),
        row.requests_arrived.and_then(whole),
        row.requests_turned_away.and_then(whole),
        row.queue_wait_p99_ms,
        row.ttft_p99_ms,
        row.energy_per_request_j,
    ]
}

/// Every row of the run's trace files, oldest first (a rotating run's older files, then
/// `trace.csv`).
fn trace_rows(files: &[PathBuf]) -> impl Iterator<Item = Result<TraceRow, TraceError>> + '_ {
    files.iter().flat_map(|path| match TraceReader::open(path) {
        Ok(reader) => Box::new(reader) as Box<dyn Iterator<Item = _>>,
        Err(error) => Box::new(std::iter::once(Err(error))),
    })
}

/// The latest `time_s` in the trace, for a summary that does not give the duration.
fn last_time(files: &[PathBuf]) -> Result<f64, TraceError> {
    let mut last = 0.0f64;
    for row in trace_rows(files) {
        last = last.max(row?.time_s);
    }
    Ok(last)
}

fn read_trace(files: &[PathBuf], x_range: (f64, f64)) -> Result<Trace, TraceError> {
    let mut gpus: BTreeMap<u32, GpuLines> = BTreeMap::new();
    let mut policies: Vec<String> = Vec::new();
    let mut first_time: Option<f64> = None;
    for row in trace_rows(files) {
        let row = row?;
        first_time.get_or_insert(row.time_s);
        if !policies.contains(&row.policy) {
            policies.push(row.policy.clone());
        }
        gpus.entry(row.gpu)
            .or_insert_with(|| GpuLines::new(x_range))
            .push(row.time_s, &chart_values(&row));
    }
    Ok(Trace {
        gpus: gpus.into_iter().map(|(g, l)| (g, l.finish())).collect(),
        policies,
        first_time,
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

fn render(
    run_dir: &Path,
    summary: &RunSummary,
    objective: &ObjectiveSource,
) -> Result<String, RunReportError> {
    let trace_files = trace_files(run_dir)?;
    let totals = &summary.totals;
    // A run stopped before its first tick records no duration; the trace gives the axis.
    let duration_s = if totals.duration_s.is_finite() && totals.duration_s > 0.0 {
        totals.duration_s
    } else {
        last_time(&trace_files)?
    };
    let trace = read_trace(&trace_files, (0.0, duration_s))?;
    let mut page = Page::new(&format!("tokwatt run report: {}", summary.policy));

    page.notice(&data_source_line(summary));
    page.heading("Summary");
    page.table(&["", "value"], &headline_rows(summary, &trace, duration_s));
    page.paragraph(&objective_line(objective));
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
        &totals.gpus.iter().map(gpu_row).collect::<Vec<_>>(),
    );

    let tick_s = f64::from(summary.tick_ms) / 1000.0;
    if let Some(first) = trace.first_time.filter(|&t| t > 1.5 * tick_s) {
        page.paragraph(&format!(
            "The trace's oldest rows were rotated away (a long run keeps its newest output \
             files; `tokwatt run --max-file-mib`, `--keep-files`): the charts start at {} s. \
             The figures above are the whole run's.",
            format_value(first)
        ));
    }
    let (scale, unit) = time_unit(duration_s);
    let x_label = format!("time since the start ({unit})");
    let objective = objective.objective();
    for (gpu, lines) in &trace.gpus {
        page.heading(&format!("GPU {gpu}"));
        page.paragraph(&format!(
            "{} ticks. Settings are those in force during each tick; tokens per joule is \
             the tokens over the energy of the last {ROLLING_TICKS} ticks ({} s).",
            lines.rows,
            format_value(tick_s * ROLLING_TICKS as f64)
        ));
        let gpu_tpj = totals
            .gpus
            .iter()
            .find(|g| g.gpu == *gpu)
            .map(|g| g.tokens_per_joule);
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

fn data_source_line(summary: &RunSummary) -> String {
    let source = &summary.meta.data_source;
    if summary.meta.simulated {
        format!(
            "Simulator output: every figure in this report comes from the simulator, not \
             from a GPU measurement. Data source: {source}."
        )
    } else {
        format!("Measured on real GPUs. Data source: {source}.")
    }
}

fn headline_rows(summary: &RunSummary, trace: &Trace, duration_s: f64) -> Vec<Vec<String>> {
    let row = |key: &str, value: String| vec![key.to_owned(), value];
    let totals = &summary.totals;
    let mut rows = vec![
        row("policy", summary.policy.clone()),
        row("policy spec", summary.policy_spec.clone()),
    ];
    if trace.policies.len() > 1 {
        rows.push(row(
            "policies in charge (hot swaps)",
            trace.policies.join(", "),
        ));
    }
    let simulated = if summary.meta.simulated {
        " (simulated)"
    } else {
        ""
    };
    rows.extend([
        row(
            "GPUs",
            format!(
                "{} × {}{simulated}",
                summary.meta.gpu_count, summary.meta.gpu_name
            ),
        ),
        row("tokens per joule", format_fixed(totals.tokens_per_joule, 4)),
        row("tokens", totals.tokens.to_string()),
        row(
            "energy",
            format!(
                "{} J ({} kWh)",
                format_fixed(totals.energy_j, 0),
                format_value(totals.energy_j / 3.6e6)
            ),
        ),
        row(
            "duration",
            format!("{} s in {} ticks", format_value(duration_s), totals.ticks),
        ),
        row(
            "SLO violation ticks",
            totals.slo_violation_ticks.to_string(),
        ),
    ]);
    if let Some(demand) = &totals.demand {
        rows.push(row(
            "served fraction",
            format!("{}%", format_value(demand.served_fraction * 100.0)),
        ));
        rows.push(row(
            "requests arrived / turned away",
            format!(
                "{} / {}",
                demand.requests_arrived, demand.requests_turned_away
            ),
        ));
    }
    rows.push(row(
        "fallback ticks",
        format!(
            "{} (plugin traps {})",
            totals.fallback_ticks, totals.plugin_traps
        ),
    ));
    if totals.interrupted {
        rows.push(row(
            "interrupted",
            "yes: the run was stopped early".to_owned(),
        ));
    }
    rows
}

/// `value` with `decimals` places, or "n/a" where it is not a number (no tokens, no energy).
fn format_fixed(value: f64, decimals: usize) -> String {
    if value.is_finite() {
        format!("{value:.decimals$}")
    } else {
        "n/a".to_owned()
    }
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
        if let Some(limit) = o.ttft_p99_limit_ms {
            parts.push(format!(
                "time to first token p99 at most {} ms",
                format_value(limit)
            ));
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

fn gpu_row(gpu: &GpuTotals) -> Vec<String> {
    let final_setting =
        |value: Option<f64>| value.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.0}"));
    let settings = gpu.final_settings.as_ref();
    vec![
        gpu.gpu.to_string(),
        gpu.tokens.to_string(),
        format_fixed(gpu.energy_j, 0),
        format_fixed(gpu.tokens_per_joule, 4),
        gpu.slo_violation_ticks.to_string(),
        final_setting(settings.map(|s| s.power_cap_w)),
        final_setting(settings.map(|s| f64::from(s.sm_clock_max_mhz))),
        final_setting(settings.map(|s| f64::from(s.batch_size))),
    ]
}

/// The panels of one GPU, x in seconds.
fn gpu_charts(
    gpu: u32,
    lines: &FinishedLines,
    objective: Option<&Objective>,
    gpu_tokens_per_joule: Option<f64>,
    duration_s: f64,
    tick_s: f64,
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
    let window = format!("per tick ({} s)", format_value(tick_s));
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
    if lines.has_values[TTFT] {
        let mut ttft = vec![line("p99", TTFT)];
        if let Some(limit) = objective.and_then(|o| o.ttft_p99_limit_ms) {
            ttft.push(level("p99 limit (objective)", limit));
        }
        charts.push(chart("time to first token", "ms", ttft));
    }
    if lines.has_values[ENERGY_PER_REQUEST] {
        charts.push(chart(
            &format!("energy per finished request, mean {window}"),
            "J",
            vec![line("mean", ENERGY_PER_REQUEST)],
        ));
    }
    charts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assembly::RunMeta;
    use crate::control::LoopTotals;
    use crate::recorder::{Recorder, TRACE_FILE, TickRecord};
    use crate::{OutputFormats, SUMMARY_FORMAT_VERSION};
    use tokwatt_core::types::Observation;

    fn summary(simulated: bool, duration_s: f64) -> RunSummary {
        RunSummary {
            format_version: SUMMARY_FORMAT_VERSION,
            output_formats: OutputFormats::default(),
            policy: "p".into(),
            policy_spec: String::new(),
            plugin: "p.wasm".into(),
            tick_ms: 1000,
            objective: Some(Objective::default()),
            objective_in_force: None,
            meta: RunMeta {
                simulated,
                gpu_profile: "h200".into(),
                gpu_name: "NVIDIA H200".into(),
                data_source: if simulated {
                    "simulator".into()
                } else {
                    "NVML on GPU-abc".into()
                },
                gpu_count: 1,
                actuator: "dry-run".into(),
                workload: "sim".into(),
                seed: 1,
            },
            totals: LoopTotals {
                duration_s,
                ticks: 40,
                slo_violation_ticks: 2,
                tokens_per_joule: 3.0,
                gpus: vec![GpuTotals {
                    tokens_per_joule: 3.0,
                    ..GpuTotals::default()
                }],
                ..LoopTotals::default()
            },
        }
    }

    /// A run folder written by the recorder: `ticks` ticks of GPU 0, 4 tokens per joule
    /// until tick 20 and 2 after, the enforced cap held below the requested one.
    fn run_folder(summary: &RunSummary, ticks: u64) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut recorder = Recorder::create(dir.path(), true).expect("recorder");
        for tick in 0..ticks {
            let mut observation = Observation::typical_h200(0, tick);
            observation.energy_j = 500.0;
            observation.tokens = if tick < 20 { 2000 } else { 1000 };
            observation.in_force.power_cap_w = 400.0;
            observation.in_force.power_cap_requested_w = 450.0;
            recorder
                .record(&TickRecord::unchanged((tick + 1) as f64, "p", observation))
                .expect("record");
        }
        recorder.finish(summary).expect("finish");
        dir
    }

    #[test]
    fn a_measured_run_without_demand_gets_the_panels_it_has_data_for() {
        let dir = run_folder(&summary(false, 40.0), 40);
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
        assert!(!html.contains("served fraction"), "no demand in the run");
    }

    #[test]
    fn a_rotated_trace_is_read_across_its_files_and_the_page_says_where_it_starts() {
        let summary = summary(true, 400.0);
        let dir = tempfile::tempdir().expect("tempdir");
        let rotation = crate::recorder::Rotation {
            max_bytes: crate::recorder::Rotation::MIN_BYTES,
            keep: 3,
        };
        let mut recorder = Recorder::create_rotating(dir.path(), true, rotation).expect("recorder");
        for tick in 0..400 {
            let observation = Observation::typical_h200(0, tick);
            recorder
                .record(&TickRecord::unchanged((tick + 1) as f64, "p", observation))
                .expect("record");
        }
        recorder.finish(&summary).expect("finish");
        let files = trace_files(dir.path()).expect("files");
        assert_eq!(files.len(), 4, "three rotated files and the current one");
        let trace = read_trace(&files, (0.0, 400.0)).expect("read");
        let first = trace.first_time.expect("rows");
        assert!(first > 2.0, "the oldest rows were rotated away: {first}");
        let rows: u64 = trace.gpus[&0].rows;
        assert_eq!(
            rows,
            400 - (first as u64) + 1,
            "every kept row, across the files"
        );
        let html = run_report(dir.path()).expect("report");
        assert!(
            html.contains("oldest rows were rotated away"),
            "the page says so"
        );
        // A run that kept everything says nothing of the kind.
        let whole = run_folder(&summary, 40);
        let html = run_report(whole.path()).expect("report");
        assert!(!html.contains("rotated away"));
    }

    #[test]
    fn a_simulated_run_says_so_first() {
        let dir = run_folder(&summary(true, 40.0), 3);
        let html = run_report(dir.path()).expect("report");
        assert!(
            html.contains("Simulator output: every figure in this report comes from the simulator")
        );
        assert!(html.contains("1 × NVIDIA H200 (simulated)"));
    }

    #[test]
    fn the_rolling_efficiency_is_tokens_over_energy_of_the_window() {
        let dir = run_folder(&summary(true, 40.0), 40);
        let trace = read_trace(&[dir.path().join(TRACE_FILE)], (0.0, 40.0)).expect("read");
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
    fn a_bad_trace_value_is_named_with_its_line_and_column() {
        let dir = run_folder(&summary(true, 4.0), 3);
        let path = dir.path().join(TRACE_FILE);
        let text = std::fs::read_to_string(&path).expect("trace");
        let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
        let column = lines[0]
            .split(',')
            .position(|c| c == "power_avg_w")
            .expect("column");
        let mut fields: Vec<&str> = lines[3].split(',').collect();
        fields[column] = "oops";
        lines[3] = fields.join(",");
        std::fs::write(&path, lines.join("\n") + "\n").expect("rewrite");
        let message = run_report(dir.path()).expect_err("bad value").to_string();
        assert!(
            message.contains("line 4") && message.contains("`power_avg_w` is `oops`"),
            "{message}"
        );
    }

    #[test]
    fn missing_files_and_columns_are_named() {
        let empty = tempfile::tempdir().expect("tempdir");
        let error = run_report(empty.path()).expect_err("no summary");
        assert!(error.to_string().contains("has no summary.json"), "{error}");
        let dir = run_folder(&summary(true, 4.0), 1);
        std::fs::write(dir.path().join(TRACE_FILE), "tick,gpu\n0,0\n").expect("trace");
        let error = run_report(dir.path()).expect_err("no time column");
        assert!(error.to_string().contains("`time_s`"), "{error}");
        std::fs::write(dir.path().join("summary.json"), "not json").expect("summary");
        assert!(matches!(
            run_report(dir.path()),
            Err(RunReportError::Summary(SummaryError::Damaged { .. }))
        ));
    }

    #[test]
    fn a_trace_without_the_optional_columns_reads_them_as_absent() {
        let dir = run_folder(&summary(true, 4.0), 2);
        let path = dir.path().join(TRACE_FILE);
        let text = std::fs::read_to_string(&path).expect("trace");
        let header: Vec<&str> = text.lines().next().expect("header").split(',').collect();
        let keep: Vec<usize> = (0..header.len())
            .filter(|&i| {
                !["power_mem_w", "requests_arrived", "queue_wait_p99_ms"].contains(&header[i])
            })
            .collect();
        let cut: Vec<String> = text
            .lines()
            .map(|line| {
                let fields: Vec<&str> = line.split(',').collect();
                keep.iter()
                    .map(|&i| fields[i])
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .collect();
        std::fs::write(&path, cut.join("\n") + "\n").expect("rewrite");
        let rows: Vec<TraceRow> = TraceReader::open(&path)
            .expect("open")
            .collect::<Result<_, _>>()
            .expect("rows");
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].requests_arrived, None);
        assert_eq!(rows[0].power_mem_w, None);
    }

    #[test]
    fn without_a_duration_the_trace_gives_the_time_axis() {
        let dir = run_folder(&summary(true, f64::NAN), 5);
        let html = run_report(dir.path()).expect("report");
        assert_eq!(html.matches("<svg").count(), 5);
        assert!(html.contains("5 s in 40 ticks"), "duration from the trace");
    }

    #[test]
    fn a_summary_without_an_objective_takes_the_spec_files_or_says_it_is_unknown() {
        let mut old = summary(true, 4.0);
        old.objective = None;
        let dir = run_folder(&old, 2);
        let html = run_report(dir.path()).expect("report");
        assert!(html.contains("Objective: not known"), "no spec named");
        let spec = dir.path().join("p.toml");
        std::fs::write(
            &spec,
            "name = \"p\"\nplugin = \"p.wasm\"\n[objective]\ntpot_p99_limit_ms = 30.0\n",
        )
        .expect("spec");
        old.policy_spec = spec.display().to_string();
        let dir = run_folder(&old, 2);
        let html = run_report(dir.path()).expect("report");
        assert!(
            html.contains("TPOT p99 at most 30 ms"),
            "objective from the spec"
        );
        assert!(html.contains("as it is now"));
    }

    #[test]
    fn an_empty_trace_makes_a_report_that_says_so() {
        let dir = run_folder(&summary(true, 0.0), 0);
        let html = run_report(dir.path()).expect("report");
        assert!(html.contains("The trace has no rows"));
        assert!(!html.contains("<svg"));
    }
}
