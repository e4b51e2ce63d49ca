//! Reports: self-contained HTML pages with inline SVG charts, readable offline, nothing
//! fetched from anywhere.
//!
//! The building blocks ([`LineChart`], [`HeatMap`], [`Page`]) are for every command that
//! reports (`tokwatt run`, `tokwatt eval`, `tokwatt ab`); a run's own report, which reads
//! the recorder's files, is the agent's (`tokwatt_agent::run_report`).

pub mod chart;
mod heatmap;
mod page;

use std::io::Write as _;
use std::path::{Path, PathBuf};

pub use chart::{Downsampler, LineChart, MAX_BUCKETS, Series, downsample};
pub use heatmap::HeatMap;
pub use page::Page;

/// The report's file name in a run's folder.
pub const RUN_REPORT_FILE: &str = "report.html";

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A temporary file in `dir` for an output written atomically (renamed over its name
/// when complete), created as a plain file is: readable by others as the umask allows
/// (0644 under the usual 022), as the run's trace is, not the temporary file's 0600. A
/// run's outputs are read by others (a dashboard, a colleague, a CI job as another user).
pub fn output_tempfile(dir: &Path) -> std::io::Result<tempfile::NamedTempFile> {
    let mut builder = tempfile::Builder::new();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        // The mode asked of open(2), which takes the umask off, as for File::create.
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    builder.tempfile_in(dir)
}

/// Write `html` to `path` atomically: a reader never sees half a report, and a failed
/// write leaves an earlier report as it was. The file's mode is a plain file's
/// ([`output_tempfile`]).
/// `name` made safe for a file name: every character but ASCII letters, digits, `-` and `_`
/// becomes `_` (a policy's name in an output folder's or a tuned spec's name).
pub fn file_name_safe(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

pub fn write_atomically(path: &Path, html: &str) -> Result<(), ReportError> {
    let write_error = |source| ReportError::Write {
        path: path.to_owned(),
        source,
    };
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let mut file = output_tempfile(dir).map_err(write_error)?;
    file.write_all(html.as_bytes()).map_err(write_error)?;
    file.persist(path).map_err(|e| write_error(e.error))?;
    Ok(())
}

/// Escapes text for HTML and SVG, in element content and in quoted attributes.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            // Control characters have no place in a page (and some are invalid in XML).
            c if c.is_control() && c != '\n' && c != '\t' => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// `value` with `decimals` places, never "-0".
fn format_number(value: f64, decimals: usize) -> String {
    let text = format!("{value:.decimals$}");
    if text.starts_with('-') && text[1..].chars().all(|c| c == '0' || c == '.') {
        text[1..].to_owned()
    } else {
        text
    }
}

/// A value for a reader: whole numbers from 1000 up, else four significant digits,
/// without trailing zeros.
pub fn format_value(value: f64) -> String {
    if !value.is_finite() {
        return "n/a".to_owned();
    }
    if value.abs() >= 1000.0 {
        return format_number(value, 0);
    }
    let magnitude = if value == 0.0 {
        0
    } else {
        value.abs().log10().floor() as i32
    };
    let decimals = (3 - magnitude).clamp(0, 12) as usize;
    let text = format_number(value, decimals);
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_covers_markup_and_quotes() {
        assert_eq!(
            escape("<script>alert('x' & \"y\")</script>\u{1b}[31m"),
            "&lt;script&gt;alert(&#39;x&#39; &amp; &quot;y&quot;)&lt;/script&gt;\u{fffd}[31m"
        );
    }

    #[test]
    fn values_read_well() {
        assert_eq!(format_value(20.856919), "20.86");
        assert_eq!(format_value(622370.67), "622371");
        assert_eq!(format_value(0.001234567), "0.001235");
        assert_eq!(format_value(3.0), "3");
        assert_eq!(format_value(0.0), "0");
        assert_eq!(format_value(-0.00001), "-0.00001");
        assert_eq!(format_value(f64::NAN), "n/a");
        assert_eq!(format_number(-0.0001, 2), "0.00");
    }

    #[test]
    fn a_report_is_written_atomically() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(RUN_REPORT_FILE);
        write_atomically(&path, "first").expect("write");
        write_atomically(&path, "second").expect("rewrite");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "second");
        assert_eq!(std::fs::read_dir(dir.path()).expect("list").count(), 1);
    }
}
