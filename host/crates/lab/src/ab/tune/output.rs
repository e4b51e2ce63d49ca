//! A search's files: `tune.json`, `report.html` and the tuned spec.

use super::*;

/// The spec's text with `params` written into its `params` table by a TOML editor
/// (`toml_edit`: replaced where the key is there, added after the table's last key
/// otherwise, inline tables included; a table added at the end if the spec has none),
/// and first lines saying where they come from. The rest of the text, comments and
/// layout, is kept. `plugin`, when it is a path found beside the original spec, is made absolute
/// so that the copy in another folder finds it. The result is checked by loading it.
pub fn tuned_spec_text(
    original: &PolicySpec,
    original_text: &str,
    params: &[(String, String)],
    written_to: &Path,
    comment: &str,
) -> Result<String, TuneError> {
    let problem = |problem: String| TuneError::TunedSpec {
        path: written_to.to_owned(),
        problem,
    };
    // An editor of the TOML itself: the operator's comments, order and layout stay.
    let mut document: toml_edit::DocumentMut = original_text
        .parse()
        .map_err(|e| problem(format!("the original spec is not TOML: {e}")))?;
    // Make a plugin path found only beside the original spec absolute.
    let spec_dir = original.path.parent().unwrap_or(Path::new("."));
    let beside = spec_dir.join(&original.plugin);
    if Path::new(&original.plugin).is_relative()
        && beside.is_file()
        && written_to.parent() != Some(spec_dir)
        && let Ok(absolute) = beside.canonicalize()
        && document.contains_key("plugin")
    {
        document["plugin"] = toml_edit::value(absolute.display().to_string());
    }
    let table = document
        .entry("params")
        .or_insert_with(toml_edit::table)
        .as_table_like_mut()
        .ok_or_else(|| problem("its `params` is not a table".to_owned()))?;
    for (name, value) in params {
        match table.get_mut(name) {
            Some(item) => *item = toml_edit::value(value.as_str()),
            None => {
                table.insert(name, toml_edit::value(value.as_str()));
            }
        }
    }
    let edited = document.to_string();
    let mut text = String::new();
    for line in comment.lines() {
        text.push_str("# ");
        text.push_str(line);
        text.push('\n');
    }
    text.push_str(edited.trim_end());
    text.push('\n');
    let check = PolicySpec::parse(written_to, &text).map_err(|e| problem(e.to_string()))?;
    for (name, value) in params {
        if !check.params.iter().any(|(k, v)| k == name && v == value) {
            return Err(problem(format!(
                "the written spec does not hold {name} = {value:?}; set it by hand"
            )));
        }
    }
    Ok(text)
}

/// The files of a search: `tune.json`, `report.html` and `<policy>-tuned.toml` (the last
/// only when the winner kept the objective). Returns the tuned spec's path, if written.
pub fn write_outputs(
    dir: &Path,
    outcome: &TuneOutcome,
    reference: &PolicySpec,
    reference_text: &str,
) -> Result<Option<PathBuf>, TuneError> {
    let write_error = |path: &Path| {
        let path = path.to_owned();
        move |source| TuneError::Write { path, source }
    };
    std::fs::create_dir_all(dir).map_err(write_error(dir))?;
    let json_path = dir.join("tune.json");
    let json = serde_json::to_string_pretty(outcome).map_err(|e| TuneError::Write {
        path: json_path.clone(),
        source: std::io::Error::other(e),
    })?;
    std::fs::write(&json_path, json + "\n").map_err(write_error(&json_path))?;
    tokwatt_report::write_atomically(&dir.join("report.html"), &report_html(outcome))?;
    if !outcome.evidence.compliant {
        return Ok(None);
    }
    let safe = tokwatt_report::file_name_safe(&outcome.policy);
    let spec_path = dir.join(format!("{safe}-tuned.toml"));
    let comment = format!(
        "Tuned by `tokwatt tune` on the simulator ({}), seed {}: {} (tokens per joule {:.4}x the spec it came from, {} pairs). See tune.json beside this file.",
        outcome.data_source,
        outcome.seed,
        format_params(&outcome.winner),
        outcome.evidence.ratio_b_over_a,
        outcome.evidence.pairs
    );
    let text = tuned_spec_text(
        reference,
        reference_text,
        &outcome.winner,
        &spec_path,
        &comment,
    )?;
    std::fs::write(&spec_path, text).map_err(write_error(&spec_path))?;
    Ok(Some(spec_path))
}
