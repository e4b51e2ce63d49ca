//! Prometheus' text exposition format, read: sample lines, the token counter summed over
//! its series, the histograms merged over theirs, and a missing metric named with the
//! names that are there.

use super::*;

/// One sample line of the text exposition format.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Sample {
    pub(super) name: String,
    pub(super) labels: Vec<(String, String)>,
    pub(super) value: f64,
}

/// Parse one sample line: `name{label="value",...} value [timestamp] [# exemplar]`.
/// Label values may hold commas, braces and the escapes `\"`, `\\` and `\n`. `None`
/// for comments, blank lines and lines that are not samples.
pub(super) fn parse_sample(line: &str) -> Option<Sample> {
    let line = line.trim_start();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        let mut chars = after_brace.char_indices().peekable();
        let mut key = String::new();
        let consumed = loop {
            let (i, c) = chars.next()?;
            match c {
                '}' => break i + 1,
                ',' | ' ' | '\t' => {}
                '=' => {
                    // The value: a quoted string with escapes.
                    while chars.peek().is_some_and(|(_, c)| c.is_whitespace()) {
                        chars.next();
                    }
                    if chars.next()?.1 != '"' {
                        return None;
                    }
                    let mut value = String::new();
                    loop {
                        match chars.next()?.1 {
                            '"' => break,
                            '\\' => match chars.next()?.1 {
                                'n' => value.push('\n'),
                                other => value.push(other),
                            },
                            other => value.push(other),
                        }
                    }
                    labels.push((std::mem::take(&mut key).trim().to_owned(), value));
                }
                other => key.push(other),
            }
        };
        rest = &after_brace[consumed..];
    }
    // The value; a timestamp and an exemplar (`# {...} value`) may follow: ignored.
    let value = parse_float(rest.split_whitespace().next()?)?;
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// A sample value as the format writes it, `+Inf`, `-Inf` and `NaN` included.
pub(super) fn parse_float(text: &str) -> Option<f64> {
    match text {
        "+Inf" | "Inf" | "+inf" | "inf" => Some(f64::INFINITY),
        "-Inf" | "-inf" => Some(f64::NEG_INFINITY),
        "NaN" | "nan" => Some(f64::NAN),
        other => other.parse().ok(),
    }
}

/// Parse the Prometheus text exposition format into what the window needs: the counter
/// summed over all its series, the histogram merged bucket by bound over all its series
/// (several engines, several models). A named metric that is absent is an error naming
/// it and the similar names the exposition does have.
pub(super) fn parse_exposition(
    text: &str,
    counter: &str,
    histogram: Option<&str>,
) -> Result<Scrape, WorkloadError> {
    parse_counter_and_histogram(
        text,
        counter,
        histogram,
        "--token-counter",
        "--tpot-histogram",
    )
}

/// [`parse_exposition`], and the requests' metrics where they are named.
pub(super) fn parse_scrape(
    text: &str,
    counter: &str,
    histogram: Option<&str>,
    requests: Option<&RequestMetrics>,
) -> Result<Scrape, WorkloadError> {
    let mut scrape = parse_exposition(text, counter, histogram)?;
    if let Some(metrics) = requests {
        let read = parse_counter_and_histogram(
            text,
            &metrics.prompt_counter,
            Some(&metrics.ttft_histogram),
            "--prompt-counter",
            "--ttft-histogram",
        )?;
        scrape.requests = Some(RequestScrape {
            prompt_tokens: read.tokens,
            ttft_buckets: read.tpot_buckets,
        });
    }
    Ok(scrape)
}

/// One counter summed over its series and one histogram merged over its series; a
/// named metric that is absent is an error naming the flag that names it.
pub(super) fn parse_counter_and_histogram(
    text: &str,
    counter: &str,
    histogram: Option<&str>,
    counter_flag: &str,
    histogram_flag: &str,
) -> Result<Scrape, WorkloadError> {
    let mut tokens = None;
    let mut buckets: HashMap<u64, (f64, f64)> = HashMap::new();
    let bucket_name = histogram.map(|h| format!("{h}_bucket"));
    let mut names_seen = BTreeSet::new();
    // A family declared by `# TYPE` but without series yet (a labelled metric before its
    // first observation, as prometheus_client writes it) is present, at zero.
    let mut declared = BTreeSet::new();
    for line in text.lines() {
        if let Some(declaration) = line.trim_start().strip_prefix("# TYPE ")
            && let Some(name) = declaration.split_whitespace().next()
        {
            declared.insert(name.to_owned());
        }
    }
    if declared.contains(counter) {
        tokens = Some(0.0);
    }
    for sample in text.lines().filter_map(parse_sample) {
        if sample.name == counter {
            *tokens.get_or_insert(0.0) += sample.value;
        } else if bucket_name.as_deref() == Some(sample.name.as_str()) {
            let Some(le) = sample
                .labels
                .iter()
                .find(|(k, _)| k == "le")
                .and_then(|(_, le)| parse_float(le))
            else {
                continue;
            };
            let entry = buckets.entry(le.to_bits()).or_insert((le, 0.0));
            entry.1 += sample.value;
        }
        names_seen.insert(sample.name);
    }
    let tokens = tokens.ok_or_else(|| missing(counter, counter_flag, &names_seen))?;
    // A counter is a non-negative, exactly representable count: anything else is a
    // broken or lying endpoint, refused as a failed scrape rather than summed.
    if !(tokens.is_finite() && (0.0..=MAX_PLAUSIBLE_TOKENS).contains(&tokens)) {
        return Err(WorkloadError::Failed(format!(
            "the `{counter}` counter reads {tokens}, which is not a token count (expected a whole number from 0 to 2^53)"
        )));
    }
    if let Some(histogram) = histogram
        && buckets.is_empty()
        && !declared.contains(histogram)
    {
        return Err(missing(histogram, histogram_flag, &names_seen));
    }
    let mut tpot_buckets: Vec<(f64, f64)> = buckets.into_values().collect();
    tpot_buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(Scrape {
        tokens,
        tpot_buckets,
        requests: None,
    })
}

/// The error for a named metric the exposition lacks, with the names it has that share
/// at least two words with it (`vllm:inter_token_latency_seconds` for the deprecated
/// `vllm:time_per_output_token_seconds`).
pub(super) fn missing(wanted: &str, flag: &str, names_seen: &BTreeSet<String>) -> WorkloadError {
    let words = |name: &str| -> BTreeSet<String> {
        name.split([':', '_'])
            .filter(|w| w.len() >= 4)
            .map(str::to_owned)
            .collect()
    };
    let wanted_words = words(wanted);
    let similar: Vec<&str> = names_seen
        .iter()
        .filter(|name| words(name).intersection(&wanted_words).count() >= 2)
        .map(String::as_str)
        .take(12)
        .collect();
    let similar = if similar.is_empty() {
        "none".to_owned()
    } else {
        similar.join(", ")
    };
    WorkloadError::Failed(format!(
        "the metrics have no `{wanted}` (similar names there: {similar}): pick the engine with --engine or name the metric with {flag}"
    ))
}

/// The largest count an `f64` holds exactly (2^53).
pub(super) const MAX_PLAUSIBLE_TOKENS: f64 = 9_007_199_254_740_992.0;
