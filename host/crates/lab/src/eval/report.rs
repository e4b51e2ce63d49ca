//! The judge's HTML report: a policy × scenario heat map of the ratio to the oracle, the
//! table of entries, and per scenario the tokens per joule and settings over time of every
//! policy against the oracle (first seed).

use tokwatt_report::{HeatMap, LineChart, Page, Series};

use super::{EvalResults, TRAILING_WINDOW_S, fmt_option};

/// The report of an evaluation as a self-contained HTML page.
pub fn eval_report(results: &EvalResults) -> String {
    let mut page = Page::new("tokwatt eval");
    page.notice(&format!(
        "Every figure here is {}. Seeds: {:?}.",
        results.data_source, results.seeds
    ));
    page.heading("Policies, median over scenarios");
    let rows: Vec<Vec<String>> = results
        .policies
        .iter()
        .map(|p| {
            vec![
                p.policy.clone(),
                format!("{:.3}", p.ratio),
                format!("{:.3}", p.causal_ratio),
                format!("{:.2}", p.over_default),
                p.failed.to_string(),
                p.worst_text(),
                fmt_option(p.ticks_to_95, 0),
                fmt_option(p.ticks_to_98, 0),
                format!("{:.2} %", p.slo_violation_fraction * 100.0),
                format!("{:.3}", p.served_fraction),
                p.failed_scenarios.join("; "),
            ]
        })
        .collect();
    page.paragraph(&super::failure_rule_words());
    page.table(
        &[
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
            "failed on",
        ],
        &rows,
    );
    let policies: Vec<String> = results.policies.iter().map(|p| p.policy.clone()).collect();
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
            title: "tokens per joule over the oracle's (median over seeds; blank: failed)".into(),
            rows: policies,
            columns: scenarios,
            values,
            value_label: "ratio".into(),
        }
        .to_svg(),
    );
    page.heading("Every policy on every scenario");
    let rows: Vec<Vec<String>> = results
        .entries
        .iter()
        .map(|e| {
            vec![
                e.policy.clone(),
                e.scenario.clone(),
                format!(
                    "{:.4} ({:.4}–{:.4})",
                    e.tokens_per_joule.median, e.tokens_per_joule.min, e.tokens_per_joule.max
                ),
                format!("{:.4}", e.oracle_tokens_per_joule),
                e.ratio_text(),
                format!("{:.4}", e.causal_tokens_per_joule),
                e.causal_ratio_text(),
                fmt_option(e.over_default, 2),
                fmt_option(e.ticks_to_95, 0),
                fmt_option(e.ticks_to_98, 0),
                format!("{:.2} %", e.slo_violation_fraction * 100.0),
                format!("{:.3}", e.served_fraction),
                format!("{:.0}", e.setting_changes),
                e.failed.clone().unwrap_or_default(),
            ]
        })
        .collect();
    page.table(
        &[
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
        &rows,
    );
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
                    if p.feasible {
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
