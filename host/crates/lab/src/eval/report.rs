//! The judge's HTML report: a policy × scenario heat map of the ratio to the oracle, the
//! table of entries, and per scenario the tokens per joule and settings over time of every
//! policy against the oracle (first seed).

use tokwatt_report::{HeatMap, LineChart, Page, Series};

use super::{EvalEntry, EvalResults, PolicyResult, TRAILING_WINDOW_S, fmt_option};

/// The policies best first: by the headline score (the median ratio to the oracle, a
/// failed scenario counting as 0), then fewer failed scenarios, then the ratio to the
/// causal reference; the name breaks a tie. The report and the terminal list them so,
/// whatever order the specs were given in.
pub fn ranked_policies(results: &EvalResults) -> Vec<&PolicyResult> {
    // A score that is no number (no scenario ran) ranks last.
    let score = |value: f64| {
        if value.is_nan() {
            f64::NEG_INFINITY
        } else {
            value
        }
    };
    let mut ranked: Vec<&PolicyResult> = results.policies.iter().collect();
    ranked.sort_by(|x, y| {
        score(y.ratio)
            .total_cmp(&score(x.ratio))
            .then(x.failed.cmp(&y.failed))
            .then(score(y.causal_ratio).total_cmp(&score(x.causal_ratio)))
            .then_with(|| x.policy.cmp(&y.policy))
    });
    ranked
}

/// The entries in the order of [`ranked_policies`], each policy's in scenario order.
pub fn ranked_entries(results: &EvalResults) -> Vec<&EvalEntry> {
    ranked_policies(results)
        .into_iter()
        .flat_map(|p| results.entries.iter().filter(|e| e.policy == p.policy))
        .collect()
}

/// `value` with `decimals` places, or `n/a (why)` where it is no number: a policy that
/// could not run a scenario has no figures there, and `NaN` says nothing of why.
pub fn figure(value: f64, decimals: usize, why: &str) -> String {
    if value.is_finite() {
        format!("{value:.decimals$}")
    } else {
        format!("n/a ({why})")
    }
}

/// A fraction as a percentage with two decimals, or `n/a (why)`.
pub fn percent_figure(fraction: f64, why: &str) -> String {
    if fraction.is_finite() {
        format!("{:.2} %", fraction * 100.0)
    } else {
        format!("n/a ({why})")
    }
}

impl EvalEntry {
    /// Why the entry's figures are not numbers, where they are not.
    pub fn missing_because(&self) -> &'static str {
        if self.seeds.is_empty() {
            "no seed ran"
        } else {
            "not measured"
        }
    }

    /// Ticks to a fraction of the oracle, `never` where no phase reached it, or `n/a
    /// (why)` where nothing ran.
    pub fn ticks_text(&self, ticks: Option<f64>) -> String {
        if self.seeds.is_empty() {
            format!("n/a ({})", self.missing_because())
        } else {
            fmt_option(ticks, 0)
        }
    }

    /// Median tokens per joule over seeds with its range, or `n/a (why)`.
    pub fn tokens_per_joule_text(&self) -> String {
        let spread = &self.tokens_per_joule;
        if spread.median.is_finite() {
            format!("{:.4} ({:.4}–{:.4})", spread.median, spread.min, spread.max)
        } else {
            format!("n/a ({})", self.missing_because())
        }
    }
}

/// Why a policy's medians over scenarios are not numbers, where they are not.
pub const NO_SCENARIO_RAN: &str = "no scenario ran";

/// The report of an evaluation as a self-contained HTML page.
/// A table's header and rows, built once for the terminal and for `report.html`.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalTable {
    pub header: Vec<&'static str>,
    pub rows: Vec<Vec<String>>,
}

/// The policies, best first, with their medians over the scenarios.
pub fn policy_table(results: &EvalResults) -> EvalTable {
    let rows = ranked_policies(results)
        .iter()
        .enumerate()
        .map(|(place, p)| {
            vec![
                (place + 1).to_string(),
                p.policy.clone(),
                figure(p.ratio, 3, NO_SCENARIO_RAN),
                figure(p.causal_ratio, 3, NO_SCENARIO_RAN),
                figure(p.over_default, 2, NO_SCENARIO_RAN),
                p.failed.to_string(),
                p.worst_text(),
                fmt_option(p.ticks_to_95, 0),
                fmt_option(p.ticks_to_98, 0),
                percent_figure(p.slo_violation_fraction, NO_SCENARIO_RAN),
                figure(p.served_fraction, 3, NO_SCENARIO_RAN),
                figure(p.oracle_served_fraction, 3, NO_SCENARIO_RAN),
                p.failed_scenarios.join("; "),
            ]
        })
        .collect();
    EvalTable {
        header: vec![
            "rank",
            "policy",
            "median ratio to oracle",
            "to causal reference",
            "× default settings",
            "failed",
            "worst scenario",
            "ticks to 0.95",
            "ticks to 0.98",
            "violating ticks",
            "served",
            "oracle served",
            "failed on",
        ],
        rows,
    }
}

/// Every policy on every scenario, the policies ranked.
pub fn entry_table(results: &EvalResults) -> EvalTable {
    let rows = ranked_entries(results)
        .into_iter()
        .map(|e| {
            let why = e.missing_because();
            vec![
                e.policy.clone(),
                e.scenario.clone(),
                e.tokens_per_joule_text(),
                figure(e.oracle_tokens_per_joule, 4, why),
                e.ratio_text(),
                figure(e.causal_tokens_per_joule, 4, why),
                e.causal_ratio_text(),
                e.over_default
                    .map_or_else(|| format!("n/a ({why})"), |v| format!("{v:.2}")),
                e.ticks_text(e.ticks_to_95),
                e.ticks_text(e.ticks_to_98),
                percent_figure(e.slo_violation_fraction, why),
                figure(e.served_fraction, 3, why),
                figure(e.setting_changes, 0, why),
                e.failed.clone().unwrap_or_default(),
            ]
        })
        .collect();
    EvalTable {
        header: vec![
            "policy",
            "scenario",
            "tok/J (range)",
            "oracle tok/J",
            "ratio",
            "causal tok/J",
            "ratio to causal",
            "× default",
            "ticks to 0.95",
            "ticks to 0.98",
            "violating ticks",
            "served",
            "setting changes",
            "failure",
        ],
        rows,
    }
}

pub fn eval_report(results: &EvalResults) -> String {
    let mut page = Page::new("tokwatt eval");
    page.notice(&format!(
        "Every figure here is {}. Seeds: {:?}.",
        results.data_source, results.seeds
    ));
    page.heading("Policies, best first: median over scenarios");
    let ranked = ranked_policies(results);
    page.paragraph(&super::failure_rule_words());
    let table = policy_table(results);
    page.table(&table.header, &table.rows);
    let policies: Vec<String> = ranked.iter().map(|p| p.policy.clone()).collect();
    let scenarios: Vec<String> = results.scenarios.iter().map(|s| s.name.clone()).collect();
    let values = policies
        .iter()
        .map(|policy| {
            scenarios
                .iter()
                .map(|scenario| {
                    results
                        .entries
                        .iter()
                        .find(|e| &e.policy == policy && &e.scenario == scenario)
                        .and_then(|e| e.ratio)
                })
                .collect()
        })
        .collect();
    page.svg(
        HeatMap {
            title: "tokens per joule over the oracle's, best policy first (median over seeds; n/a: failed)"
                .into(),
            rows: policies,
            columns: scenarios,
            values,
            value_label: "ratio".into(),
        }
        .to_svg(),
    );
    page.heading("Every policy on every scenario");
    let table = entry_table(results);
    page.table(&table.header, &table.rows);
    for scenario in &results.scenarios {
        page.heading(&format!("{}: {}", scenario.name, scenario.description));
        let oracle_rows: Vec<Vec<String>> = scenario
            .oracle
            .iter()
            .map(|p| {
                vec![
                    format!("{:.0}–{:.0} s", p.start_s, p.end_s),
                    format!("{:.1}", p.arrival_rps),
                    format!("{:.0} W", p.setting.power_cap_w),
                    format!("{} MHz", p.setting.sm_clock_max_mhz),
                    p.setting.batch_size.to_string(),
                    format!("{:.4}", p.simulated_tokens_per_joule),
                    if p.drains_backlog {
                        "no: drains the backlog".into()
                    } else if p.feasible {
                        "yes".into()
                    } else {
                        "no: closest".into()
                    },
                ]
            })
            .collect();
        page.paragraph(&format!(
            "{} on {} simulated {} GPU(s). The oracle's settings per demand phase:",
            scenario.duration_s, scenario.gpus, scenario.gpu
        ));
        page.table(
            &[
                "phase",
                "requests/s",
                "power cap",
                "SM clock max",
                "batch",
                "tok/J",
                "feasible",
            ],
            &oracle_rows,
        );
        let of_scenario: Vec<_> = results
            .first_seed_series
            .iter()
            .filter(|s| s.scenario == scenario.name)
            .collect();
        let mut efficiency = LineChart::new(
            &format!("tokens per joule, trailing {TRAILING_WINDOW_S:.0} s (first seed)"),
            "time (s)",
            "tokens per joule",
        );
        let mut caps = LineChart::new("power cap in force (GPU 0)", "time (s)", "W");
        let mut clocks = LineChart::new("SM clock lock, upper bound (GPU 0)", "time (s)", "MHz");
        let mut batches = LineChart::new("batch size (GPU 0)", "time (s)", "sequences");
        for series in of_scenario {
            let make = |points: Vec<(f64, f64)>| {
                if series.who == "oracle" || series.who == "causal reference" {
                    Series::dashed(&series.who, points)
                } else {
                    Series::new(&series.who, points)
                }
            };
            let s = &series.series;
            efficiency.series.push(make(
                s.trailing_tokens_per_joule(TRAILING_WINDOW_S)
                    .into_iter()
                    .filter(|(_, v)| v.is_finite())
                    .collect(),
            ));
            let setting = |pick: &dyn Fn(&(f64, u32, u32)) -> f64| -> Vec<(f64, f64)> {
                s.time_s
                    .iter()
                    .zip(&s.settings)
                    .map(|(&t, v)| (t, pick(v)))
                    .collect()
            };
            caps.series.push(make(setting(&|v| v.0)));
            clocks.series.push(make(setting(&|v| f64::from(v.1))));
            batches.series.push(make(setting(&|v| f64::from(v.2))));
        }
        for chart in [efficiency, caps, clocks, batches] {
            page.svg(chart.to_svg());
        }
    }
    page.finish()
}
