//! `tokwatt report RUN_DIR`: render a run's `report.html` again from its own files (after
//! an upgrade, or for a run whose report was not written).

use std::path::PathBuf;

use anyhow::Result;

use tokwatt::report;

#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// The run's output folder (holding summary.json and trace.csv).
    run_dir: PathBuf,
    /// Where to write the report (default: report.html in RUN_DIR, replacing it).
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn report(args: &ReportArgs) -> Result<()> {
    let html = report::run_report(&args.run_dir)?;
    let path = args
        .out
        .clone()
        .unwrap_or_else(|| args.run_dir.join(report::RUN_REPORT_FILE));
    report::write_atomically(&path, &html)?;
    println!("wrote {}", path.display());
    Ok(())
}
