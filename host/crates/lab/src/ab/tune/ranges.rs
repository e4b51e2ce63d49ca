//! The parameters' ranges and the candidates they make (their cartesian product).

use super::*;

/// The ranges' values a numeric range may hold before it is refused as a typo.
const MAX_VALUES_PER_RANGE: usize = 4096;

/// One parameter and the values it is tried at, as the policy will read them (strings).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamRange {
    pub name: String,
    pub values: Vec<String>,
}

impl ParamRange {
    /// `NAME=LO..HI:STEP` (inclusive, numeric) or `NAME=a,b,c`.
    pub fn parse(text: &str) -> Result<Self, TuneError> {
        let bad = |problem: &str| TuneError::BadParam {
            text: text.to_owned(),
            problem: problem.to_owned(),
        };
        let (name, range) = text
            .split_once('=')
            .ok_or_else(|| bad("there is no `=` between the name and the range"))?;
        let name = name.trim();
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(bad(
                "the name must be a parameter of the spec's [params]: letters, digits, `_` or `-`",
            ));
        }
        let range = range.trim();
        let values = if let Some((bounds, step)) = range.split_once(':') {
            let (low, high) = bounds
                .split_once("..")
                .ok_or_else(|| bad("a range with a step needs `..` between its bounds"))?;
            numeric_range(low.trim(), high.trim(), step.trim()).map_err(|p| bad(&p))?
        } else if range.contains("..") {
            return Err(bad("the range has no step (`:STEP`)"));
        } else {
            let values: Vec<String> = range.split(',').map(|v| v.trim().to_owned()).collect();
            if values.iter().any(String::is_empty) {
                return Err(bad("the list has an empty value"));
            }
            let mut seen = std::collections::HashSet::new();
            if let Some(twice) = values.iter().find(|v| !seen.insert(v.as_str())) {
                return Err(bad(&format!("the list has `{twice}` twice")));
            }
            values
        };
        Ok(Self {
            name: name.to_owned(),
            values,
        })
    }
}

/// The values `low, low+step, …` up to `high` inclusive, written as given: integers stay
/// integers (`300`, not `300.0`).
fn numeric_range(low: &str, high: &str, step: &str) -> Result<Vec<String>, String> {
    let number = |what: &str, text: &str| -> Result<f64, String> {
        match text.parse::<f64>() {
            Ok(v) if v.is_finite() => Ok(v),
            _ => Err(format!("the {what} `{text}` is not a number")),
        }
    };
    let (lo, hi, st) = (
        number("low bound", low)?,
        number("high bound", high)?,
        number("step", step)?,
    );
    if st <= 0.0 {
        return Err(format!("the step {step} must be positive"));
    }
    if hi < lo {
        return Err(format!(
            "the high bound {high} is below the low bound {low}"
        ));
    }
    let count = ((hi - lo) / st + 1e-9).floor() + 1.0;
    if count > MAX_VALUES_PER_RANGE as f64 {
        return Err(format!(
            "{count} values is more than {MAX_VALUES_PER_RANGE}; use a larger step"
        ));
    }
    let integers = [low, high, step].iter().all(|t| t.parse::<i64>().is_ok());
    let decimals = [low, high, step]
        .iter()
        .map(|t| t.split_once('.').map_or(0, |(_, f)| f.len()))
        .max()
        .unwrap_or(0)
        // An f64 holds no more than 17 significant digits (and a format precision past
        // 65 535 panics): longer fractions are written to that.
        .min(17);
    Ok((0..count as usize)
        .map(|i| {
            let value = lo + st * i as f64;
            if integers {
                format!("{}", value.round() as i64)
            } else {
                format!("{value:.decimals$}")
            }
        })
        .collect())
}

/// Every combination of the ranges' values, the first parameter varying slowest.
pub fn candidates(ranges: &[ParamRange]) -> Result<Vec<Vec<(String, String)>>, TuneError> {
    if ranges.is_empty() {
        return Err(TuneError::NoParams);
    }
    let mut names = std::collections::HashSet::new();
    for range in ranges {
        if !names.insert(range.name.as_str()) {
            return Err(TuneError::DuplicateParam {
                name: range.name.clone(),
            });
        }
    }
    let count = ranges
        .iter()
        .fold(1u128, |n, r| n.saturating_mul(r.values.len() as u128));
    if count > MAX_CANDIDATES as u128 {
        return Err(TuneError::TooManyCandidates {
            count,
            sizes: ranges
                .iter()
                .map(|r| format!("{} {}", r.name, r.values.len()))
                .collect::<Vec<_>>()
                .join(" × "),
        });
    }
    let mut all = vec![Vec::new()];
    for range in ranges {
        all = all
            .into_iter()
            .flat_map(|prefix: Vec<(String, String)>| {
                range.values.iter().map(move |value| {
                    let mut next = prefix.clone();
                    next.push((range.name.clone(), value.clone()));
                    next
                })
            })
            .collect();
    }
    Ok(all)
}

/// The reference spec with `params` set (added or replaced), sorted by key as the spec is.
pub fn candidate_spec(reference: &PolicySpec, params: &[(String, String)]) -> PolicySpec {
    let mut spec = reference.clone();
    for (name, value) in params {
        match spec.params.iter_mut().find(|(key, _)| key == name) {
            Some(slot) => slot.1 = value.clone(),
            None => spec.params.push((name.clone(), value.clone())),
        }
    }
    spec.params.sort();
    spec
}
