//! `tokwatt report A B C`: several run folders side by side (tokens per joule, tokens,
//! energy, time over the objective, served demand), and what each saved against the run
//! that held the default settings, where one is named or found. The comparison is made
//! from each folder's `summary.json` alone; the page (`--out`), the table and `--json`
//! are made from one [`Comparison`].

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use serde::Serialize;

use tokwatt_agent::{RunSummary, read_summary};

/// The comparison's own version (its keys in `--json`).
pub const COMPARISON_FORMAT_VERSION: u32 = 1;

/// The policy whose run is the baseline when none is named: the shipped `default` policy
/// holds the board's default settings and changes nothing.
pub const DEFAULT_POLICY: &str = "default";

/// A served share this much lower than the baseline's (0.5 points, the A/B's compliance
/// margin) makes a run's tokens per joule no saving at equal service.
const SERVED_MARGIN: f64 = 0.005;

/// Durations within this share of each other are the same length of run.
const DURATION_TOLERANCE: f64 = 0.01;

/// Several runs side by side.
#[derive(Debug, Serialize)]
pub struct Comparison {
    pub format_version: u32,
    /// The baseline run's folder (`null` where there is none).
    pub baseline: Option<PathBuf>,
    /// Why that run is the baseline, in words (`null` where there is none).
    pub baseline_because: Option<String>,
    /// The runs, in the order given.
    pub runs: Vec<ComparedRun>,
    /// What makes the runs less comparable (different GPUs, lengths, data sources).
    pub notes: Vec<String>,
}

/// One run's figures, from its `summary.json`.
#[derive(Debug, Serialize)]
pub struct ComparedRun {
    pub dir: PathBuf,
    pub policy: String,
    pub simulated: bool,
    pub gpu_name: String,
    pub gpu_count: u32,
    pub duration_s: f64,
    pub ticks: u64,
    pub tokens: u64,
    pub energy_j: f64,
    pub tokens_per_joule: f64,
    /// Ticks on which any GPU broke the objective, and their share of the ticks.
    pub slo_violation_ticks: u64,
    pub slo_violation_rate: f64,
    /// The share of the demand served, where the workload knows its demand (else `null`).
    pub served_fraction: Option<f64>,
    pub fallback_ticks: u64,
    pub interrupted: bool,
    /// Against the baseline (`null` for the baseline itself and where there is none).
    pub vs_baseline: Option<VsBaseline>,
}

/// A run against the baseline.
#[derive(Debug, Serialize)]
pub struct VsBaseline {
    /// Tokens per joule over the baseline's.
    pub tokens_per_joule_ratio: f64,
    /// The share of the energy per token saved: `1 − baseline's tokens per joule / this
    /// run's` (negative where the run spent more per token).
    pub energy_per_token_saving: f64,
    /// Joules saved on this run's tokens: what they cost at the baseline's tokens per
    /// joule, less what they cost.
    pub energy_saved_j: f64,
    /// Tokens over the baseline's.
    pub tokens_ratio: f64,
    /// Whether the saving came at equal service: the run served no less of the demand
    /// than the baseline (within 0.5 points) and broke the objective on no larger share of
    /// its ticks. Where false, `caveats` says why, and the saving is not one.
    pub at_equal_service: bool,
    pub caveats: Vec<String>,
}

/// Reads each folder's summary and compares them; `baseline` is a folder among `dirs`, or
/// `None` to take the one run of the [`DEFAULT_POLICY`], if exactly one ran it.
pub fn compare(dirs: &[PathBuf], baseline: Option<&Path>) -> Result<Comparison> {
    let summaries = dirs
        .iter()
        .map(|dir| read_summary(dir).map(|summary| (dir.clone(), summary)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(compare_summaries(&summaries, baseline)?)
}

/// Why a comparison cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    #[error(
        "--baseline {} is not one of the folders compared; give it among them too (`tokwatt report {} A B --baseline {}`)",
        given.display(), given.display(), given.display()
    )]
    BaselineNotCompared { given: PathBuf },
}

/// [`compare`] on summaries already read.
pub fn compare_summaries(
    runs: &[(PathBuf, RunSummary)],
    baseline: Option<&Path>,
) -> Result<Comparison, CompareError> {
    let (baseline_index, baseline_because) = match baseline {
        Some(given) => {
            let index = runs
                .iter()
                .position(|(dir, _)| same_folder(dir, given))
                .ok_or_else(|| CompareError::BaselineNotCompared {
                    given: given.to_owned(),
                })?;
            (Some(index), Some("named with --baseline".to_owned()))
        }
        None => {
            let defaults: Vec<usize> = runs
                .iter()
                .enumerate()
                .filter(|(_, (_, s))| s.policy == DEFAULT_POLICY)
                .map(|(i, _)| i)
                .collect();
            match defaults.as_slice() {
                [one] => (
                    Some(*one),
                    Some(format!(
                        "the one run of the `{DEFAULT_POLICY}` policy, which holds the board's default settings"
                    )),
                ),
                _ => (None, None),
            }
        }
    };
    let base = baseline_index.map(|i| &runs[i].1);
    let compared = runs
        .iter()
        .enumerate()
        .map(|(i, (dir, summary))| {
            let vs_baseline = match base {
                Some(base) if Some(i) != baseline_index => Some(against(summary, base)),
                _ => None,
            };
            compared_run(dir, summary, vs_baseline)
        })
        .collect();
    let mut notes = comparability_notes(runs);
    if baseline_index.is_none() && runs.len() > 1 {
        notes.push(format!(
            "no baseline: name the run with the default settings with --baseline DIR (a run \
             of the `{DEFAULT_POLICY}` policy is taken by itself where it is the only one)"
        ));
    }
    Ok(Comparison {
        format_version: COMPARISON_FORMAT_VERSION,
        baseline: baseline_index.map(|i| runs[i].0.clone()),
        baseline_because,
        runs: compared,
        notes,
    })
}

/// Whether two paths name one folder (as written, or once resolved).
fn same_folder(a: &Path, b: &Path) -> bool {
    a == b
        || match (a.canonicalize(), b.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        }
}

fn violation_rate(summary: &RunSummary) -> f64 {
    let t = &summary.totals;
    if t.ticks == 0 {
        0.0
    } else {
        t.slo_violation_ticks as f64 / t.ticks as f64
    }
}

fn served_fraction(summary: &RunSummary) -> Option<f64> {
    summary
        .totals
        .demand
        .as_ref()
        .map(|d| d.served_fraction)
        .filter(|f| f.is_finite())
}

fn compared_run(dir: &Path, s: &RunSummary, vs_baseline: Option<VsBaseline>) -> ComparedRun {
    let t = &s.totals;
    ComparedRun {
        dir: dir.to_owned(),
        policy: s.policy.clone(),
        simulated: s.meta.simulated,
        gpu_name: s.meta.gpu_name.clone(),
        gpu_count: s.meta.gpu_count,
        duration_s: t.duration_s,
        ticks: t.ticks,
        tokens: t.tokens,
        energy_j: t.energy_j,
        tokens_per_joule: t.tokens_per_joule,
        slo_violation_ticks: t.slo_violation_ticks,
        slo_violation_rate: violation_rate(s),
        served_fraction: served_fraction(s),
        fallback_ticks: t.fallback_ticks,
        interrupted: t.interrupted,
        vs_baseline,
    }
}

/// `run` against `base`.
fn against(run: &RunSummary, base: &RunSummary) -> VsBaseline {
    let (tpj, base_tpj) = (run.totals.tokens_per_joule, base.totals.tokens_per_joule);
    let mut caveats = Vec::new();
    if let (Some(served), Some(base_served)) = (served_fraction(run), served_fraction(base))
        && served < base_served - SERVED_MARGIN
    {
        caveats.push(format!(
            "it served {:.1} points less of the demand than the baseline ({:.1} % against \
             {:.1} %): its tokens per joule is no saving at equal service",
            (base_served - served) * 100.0,
            served * 100.0,
            base_served * 100.0
        ));
    }
    let (rate, base_rate) = (violation_rate(run), violation_rate(base));
    if rate > base_rate + SERVED_MARGIN {
        caveats.push(format!(
            "it broke the objective on {:.1} % of its ticks, the baseline on {:.1} %",
            rate * 100.0,
            base_rate * 100.0
        ));
    }
    VsBaseline {
        tokens_per_joule_ratio: tpj / base_tpj,
        energy_per_token_saving: 1.0 - base_tpj / tpj,
        energy_saved_j: run.totals.tokens as f64 / base_tpj - run.totals.energy_j,
        tokens_ratio: run.totals.tokens as f64 / base.totals.tokens as f64,
        at_equal_service: caveats.is_empty(),
        caveats,
    }
}

/// What makes the runs less comparable: different GPUs or counts, simulated beside
/// measured, different lengths.
fn comparability_notes(runs: &[(PathBuf, RunSummary)]) -> Vec<String> {
    let mut notes = Vec::new();
    let Some((_, first)) = runs.first() else {
        return notes;
    };
    let differ =
        |what: &dyn Fn(&RunSummary) -> String| runs.iter().any(|(_, s)| what(s) != what(first));
    if differ(&|s| format!("{} × {}", s.meta.gpu_count, s.meta.gpu_name)) {
        notes.push(format!(
            "the runs are on different GPUs ({}): tokens per joule differs by GPU as much as by policy",
            distinct(runs, |s| format!("{} × {}", s.meta.gpu_count, s.meta.gpu_name))
        ));
    }
    if differ(&|s| s.meta.simulated.to_string()) {
        notes.push(
            "simulated and measured runs side by side: the simulator's figures are its model's, \
             not a GPU's"
                .to_owned(),
        );
    } else if first.meta.simulated {
        notes.push("simulator output: every figure is the simulator's".to_owned());
    }
    let shortest = runs
        .iter()
        .map(|(_, s)| s.totals.duration_s)
        .fold(f64::INFINITY, f64::min);
    let longest = runs
        .iter()
        .map(|(_, s)| s.totals.duration_s)
        .fold(0.0, f64::max);
    if longest > shortest * (1.0 + DURATION_TOLERANCE) {
        notes.push(format!(
            "the runs differ in length ({shortest:.0} s to {longest:.0} s): tokens and energy \
             are totals, compare tokens per joule, or runs of one length"
        ));
    }
    if runs.iter().any(|(_, s)| s.totals.interrupted) {
        notes.push("an interrupted run is shorter than asked (marked `interrupted`)".to_owned());
    }
    notes
}

fn distinct(runs: &[(PathBuf, RunSummary)], what: impl Fn(&RunSummary) -> String) -> String {
    let mut seen: Vec<String> = Vec::new();
    for (_, s) in runs {
        let value = what(s);
        if !seen.contains(&value) {
            seen.push(value);
        }
    }
    seen.join(", ")
}

/// A folder's name for a table: its last component.
fn label(dir: &Path) -> String {
    dir.file_name().map_or_else(
        || dir.display().to_string(),
        |name| name.to_string_lossy().into_owned(),
    )
}

fn percent(value: Option<f64>) -> String {
    value.map_or_else(|| "n/a".to_owned(), |v| format!("{:.1} %", v * 100.0))
}

impl Comparison {
    /// The table's header and rows, for the terminal and the page alike.
    pub fn rows(&self) -> (Vec<&'static str>, Vec<Vec<String>>) {
        let header = vec![
            "run",
            "policy",
            "tokens/J",
            "tokens",
            "energy",
            "over objective",
            "served",
            "vs baseline",
        ];
        let rows = self
            .runs
            .iter()
            .map(|run| {
                let is_baseline = self
                    .baseline
                    .as_deref()
                    .is_some_and(|b| b == run.dir.as_path());
                vec![
                    label(&run.dir),
                    run.policy.clone(),
                    format!("{:.4}", run.tokens_per_joule),
                    run.tokens.to_string(),
                    format!("{:.0} J", run.energy_j),
                    format!(
                        "{} ticks ({:.2} %)",
                        run.slo_violation_ticks,
                        run.slo_violation_rate * 100.0
                    ),
                    percent(run.served_fraction),
                    match (&run.vs_baseline, is_baseline) {
                        (_, true) => "baseline".to_owned(),
                        (None, false) => "-".to_owned(),
                        (Some(vs), false) => format!(
                            "{:.3}× tok/J, {:+.1} % J/token, {:+.0} J{}",
                            vs.tokens_per_joule_ratio,
                            -vs.energy_per_token_saving * 100.0,
                            -vs.energy_saved_j,
                            if vs.at_equal_service { "" } else { " (*)" }
                        ),
                    },
                ]
            })
            .collect();
        (header, rows)
    }

    /// The lines under the table: the baseline, each caveat, each note.
    pub fn footnotes(&self) -> Vec<String> {
        let mut lines = Vec::new();
        if let (Some(dir), Some(because)) = (&self.baseline, &self.baseline_because) {
            lines.push(format!(
                "baseline: {} ({because}); vs baseline: tokens per joule over the baseline's, \
                 the change in energy per token, and the change in energy against the \
                 baseline's energy per token on the run's own tokens",
                dir.display()
            ));
        }
        for run in &self.runs {
            if let Some(vs) = &run.vs_baseline {
                for caveat in &vs.caveats {
                    lines.push(format!("(*) {}: {caveat}", label(&run.dir)));
                }
            }
        }
        lines.extend(self.notes.iter().map(|n| format!("note: {n}")));
        lines
    }

    /// The table and its lines, for the terminal.
    pub fn print(&self) {
        let (header, rows) = self.rows();
        let mut table = Table::new();
        table.load_preset(UTF8_FULL_CONDENSED).set_header(header);
        for row in rows {
            table.add_row(row);
        }
        println!("{table}");
        for line in self.footnotes() {
            println!("{line}");
        }
    }

    /// The comparison as a self-contained HTML page.
    pub fn page(&self) -> String {
        let mut page = tokwatt_report::Page::new("tokwatt: runs compared");
        if self.runs.iter().any(|r| r.simulated) {
            page.notice("Simulator output: the simulated runs' figures are the simulator's.");
        }
        let (header, rows) = self.rows();
        page.table(&header, &rows);
        for line in self.footnotes() {
            page.paragraph(&line);
        }
        page.finish()
    }
}

/// Refuses what cannot be compared before anything is read.
pub fn check_dirs(dirs: &[PathBuf]) -> Result<()> {
    if dirs.is_empty() {
        bail!("give a run's output folder, or several to compare them");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(policy: &str, tokens: u64, energy_j: f64, served: Option<f64>) -> RunSummary {
        RunSummary {
            format_version: tokwatt_agent::SUMMARY_FORMAT_VERSION,
            output_formats: tokwatt_agent::OutputFormats::default(),
            policy: policy.to_owned(),
            policy_spec: String::new(),
            plugin: String::new(),
            tick_ms: 1000,
            objective: None,
            objective_in_force: None,
            meta: tokwatt_agent::assembly::RunMeta {
                simulated: true,
                gpu_profile: "h200".into(),
                gpu_name: "H200".into(),
                data_source: "simulator".into(),
                gpu_count: 1,
                actuator: "sim".into(),
                workload: "sim".into(),
                seed: 1,
            },
            totals: tokwatt_agent::control::LoopTotals {
                tokens,
                energy_j,
                tokens_per_joule: tokens as f64 / energy_j,
                ticks: 100,
                duration_s: 100.0,
                demand: served.map(|f| tokwatt_agent::control::DemandTotals {
                    served_fraction: f,
                    ..Default::default()
                }),
                ..Default::default()
            },
        }
    }

    #[test]
    fn the_saving_is_against_the_default_policys_run_found_by_itself() {
        let runs = vec![
            (
                PathBuf::from("a"),
                summary("slo-batch", 1000, 400.0, Some(1.0)),
            ),
            (
                PathBuf::from("d"),
                summary("default", 1000, 500.0, Some(1.0)),
            ),
        ];
        let c = compare_summaries(&runs, None).expect("compares");
        assert_eq!(c.baseline.as_deref(), Some(Path::new("d")));
        let vs = c.runs[0]
            .vs_baseline
            .as_ref()
            .expect("against the baseline");
        assert!((vs.tokens_per_joule_ratio - 1.25).abs() < 1e-12);
        assert!((vs.energy_per_token_saving - 0.2).abs() < 1e-12);
        assert!((vs.energy_saved_j - 100.0).abs() < 1e-9);
        assert!(vs.at_equal_service);
        assert!(c.runs[1].vs_baseline.is_none(), "the baseline itself");
        let (_, rows) = c.rows();
        assert_eq!(rows[1][7], "baseline");
        assert!(
            rows[0][7].starts_with("1.250× tok/J, -20.0 % J/token, -100 J"),
            "{rows:?}"
        );
    }

    #[test]
    fn a_run_that_served_less_saves_nothing_at_equal_service() {
        let runs = vec![
            (
                PathBuf::from("d"),
                summary("default", 1000, 500.0, Some(1.0)),
            ),
            (
                PathBuf::from("a"),
                summary("cap-low", 900, 300.0, Some(0.9)),
            ),
        ];
        let c = compare_summaries(&runs, Some(Path::new("d"))).expect("compares");
        let vs = c.runs[1]
            .vs_baseline
            .as_ref()
            .expect("against the baseline");
        assert!(!vs.at_equal_service);
        assert!(
            vs.caveats[0].contains("10.0 points less"),
            "{:?}",
            vs.caveats
        );
        assert!(c.footnotes().iter().any(|l| l.starts_with("(*) a:")));
    }

    #[test]
    fn without_a_default_run_there_is_no_baseline_and_a_note_says_how_to_name_one() {
        let runs = vec![
            (PathBuf::from("a"), summary("x", 1000, 400.0, None)),
            (PathBuf::from("b"), summary("y", 1000, 500.0, None)),
        ];
        let c = compare_summaries(&runs, None).expect("compares");
        assert!(c.baseline.is_none());
        assert!(c.runs.iter().all(|r| r.vs_baseline.is_none()));
        assert!(
            c.notes.iter().any(|n| n.contains("--baseline")),
            "{:?}",
            c.notes
        );
        let refused = compare_summaries(&runs, Some(Path::new("elsewhere")));
        assert!(matches!(
            refused,
            Err(CompareError::BaselineNotCompared { .. })
        ));
    }
}
