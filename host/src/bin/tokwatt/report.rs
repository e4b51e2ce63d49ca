//! `tokwatt report RUN_DIR`: render a run's `report.html` again from its own files (after
//! an upgrade, or for a run whose report was not written). `tokwatt report A B C`: the
//! runs side by side, and each one's saving against the run with the default settings
//! (`compare`).

use std::path::PathBuf;

use anyhow::Result;

use tokwatt_report as report;

#[derive(Debug, clap::Args)]
#[command(
    after_help = "Several folders: a table of the runs side by side (tokens per joule, \
tokens, energy, ticks over the objective, served demand) and what each saved against the \
baseline, the run with the default settings: named with --baseline, or else the one run of \
the `default` policy among them. A run that served less of the demand or broke the objective \
more often than the baseline is marked (*): its saving is not one at equal service."
)]
pub struct ReportArgs {
    /// The run's output folder (holding summary.json and trace.csv); several to compare
    /// them.
    #[arg(value_name = "RUN_DIR", required = true)]
    run_dirs: Vec<PathBuf>,
    /// Where to write the report (default: report.html in RUN_DIR, replacing it). With
    /// several folders: where to write the comparison's page (default: none).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Comparing: the folder of the run with the default settings (one of RUN_DIR), which
    /// every other run's saving is against (default: the one run of the `default` policy).
    #[arg(long, value_name = "RUN_DIR")]
    baseline: Option<PathBuf>,
    /// Print the comparison as JSON on standard output instead of the table (with one
    /// folder too: its figures, no page written).
    #[arg(long)]
    json: bool,
}

pub fn report(args: &ReportArgs) -> Result<()> {
    crate::compare::check_dirs(&args.run_dirs)?;
    if let [run_dir] = args.run_dirs.as_slice()
        && !args.json
    {
        if args.baseline.is_some() {
            anyhow::bail!(
                "--baseline compares runs: give two or more folders (`tokwatt report A B --baseline A`)"
            );
        }
        let html = tokwatt_agent::run_report::run_report(run_dir)?;
        let path = args
            .out
            .clone()
            .unwrap_or_else(|| run_dir.join(report::RUN_REPORT_FILE));
        report::write_atomically(&path, &html)?;
        println!("wrote {}", path.display());
        return Ok(());
    }
    let comparison = crate::compare::compare(&args.run_dirs, args.baseline.as_deref())?;
    if let Some(path) = &args.out {
        report::write_atomically(path, &comparison.page())?;
        if !args.json {
            println!("wrote {}", path.display());
        }
    }
    if args.json {
        return crate::json_out::JsonResult::new("report", None, &comparison).print();
    }
    comparison.print();
    Ok(())
}
