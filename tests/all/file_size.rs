//! Files with one job: a product source file over [`LONG_FILE_LINES`] lines (its inline
//! test module not counted) says at its top why it stays one file (issue 43), so that a
//! long file is a decision, not a drift.

use std::path::{Path, PathBuf};

use crate::support::repo_root;

/// Beyond this, a product file states why it is one file.
const LONG_FILE_LINES: usize = 650;
/// Long files still to say why (issue 43, being worked through): each is removed from here
/// when its header says so; the list only shrinks.
const PENDING: &[&str] = &[];
/// The words its module documentation uses to say so.
const MARKER: &str = "One file because";

/// Product Rust sources under `dir`: not test modules (`tests.rs`, `tests/`), not build
/// output.
pub(crate) fn product_sources(dir: &Path, found: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !matches!(name.as_str(), "target" | "tests" | "node_modules" | ".git") {
                product_sources(&path, found);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" && !name.ends_with("_tests.rs") {
            found.push(path);
        }
    }
}

#[test]
fn a_long_product_file_says_why_it_is_one_file() {
    let root = repo_root();
    let mut sources = Vec::new();
    for folder in ["host", "policies", "plugins"] {
        product_sources(&root.join(folder), &mut sources);
    }
    assert!(
        sources.len() > 50,
        "the sources were not found under {}",
        root.display()
    );
    let mut unexplained = Vec::new();
    let mut stale: Vec<String> = Vec::new();
    for path in sources {
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        // The product part: an inline test module at the end is not counted.
        let lines = product_part(&text).lines().count();
        let header: String = text
            .lines()
            .take_while(|line| line.starts_with("//!") || line.trim().is_empty())
            .collect::<Vec<_>>()
            .join("\n");
        let shown = path
            .strip_prefix(&root)
            .unwrap_or(&path)
            .display()
            .to_string();
        let explained = lines <= LONG_FILE_LINES || header.contains(MARKER);
        let pending = PENDING.contains(&shown.as_str());
        if !explained && !pending {
            unexplained.push(format!("{shown} ({lines} lines)"));
        }
        if explained && pending {
            stale.push(shown);
        }
    }
    assert!(
        unexplained.is_empty(),
        "these files are over {LONG_FILE_LINES} lines and do not say at their top why they \
         stay one file: split them along their seams, or add a `//! {MARKER} …` line to \
         their module documentation:\n  {}",
        unexplained.join("\n  ")
    );
    assert!(
        stale.is_empty(),
        "these files say why now (or are short): remove them from PENDING in tests/all/file_size.rs:\n  {}",
        stale.join("\n  ")
    );
}

/// `text` up to its inline test module (`#[cfg(test)]`, any further attributes, then
/// `mod tests`), if it has one.
pub(crate) fn product_part(text: &str) -> &str {
    let mut offset = 0;
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    for (i, line) in lines.iter().enumerate() {
        if line.trim() == "#[cfg(test)]"
            && lines[i + 1..]
                .iter()
                .find(|next| !next.trim_start().starts_with("#["))
                .is_some_and(|next| next.trim_start().starts_with("mod tests"))
        {
            return &text[..offset];
        }
        offset += line.len();
    }
    text
}
