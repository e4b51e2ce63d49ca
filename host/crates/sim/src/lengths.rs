//! Request lengths: how many prompt tokens a request brings and how many it generates,
//! drawn per request from a distribution a scenario file names.
//!
//! In a scenario file each length is a number (every request the same) or a table:
//!
//! ```toml
//! prompt_tokens = 2048
//! prompt_tokens = { distribution = "uniform", min = 128, max = 4096 }
//! prompt_tokens = { distribution = "lognormal", median = 1024, sigma = 0.9, min = 16, max = 16384 }
//! prompt_tokens = { distribution = "table", tokens = [128, 2048, 8192], weights = [5, 3, 2] }
//! ```

use tokwatt_core::rng::Rng;

/// Longest prompt or output a request may have (a million positions, as `context_tokens`).
pub const MAX_TOKENS: u32 = 1_048_576;

/// A distribution of token counts, validated (every value it can draw lies in
/// 1..=[`MAX_TOKENS`]).
#[derive(Debug, Clone, PartialEq)]
pub enum LengthDist {
    Fixed(u32),
    /// Every integer in `min..=max` equally likely.
    Uniform {
        min: u32,
        max: u32,
    },
    /// `median · exp(sigma · N(0, 1))`, rounded, clamped to `min..=max`.
    LogNormal {
        median: f64,
        sigma: f64,
        min: u32,
        max: u32,
    },
    /// One of `tokens`, with probability proportional to its weight.
    Table {
        tokens: Vec<u32>,
        weights: Vec<f64>,
    },
}

impl LengthDist {
    /// Parse `value` (the scenario key `key`); the error names the key and the fix.
    pub fn parse(key: &str, value: &toml::Value) -> Result<LengthDist, String> {
        let dist = match value {
            toml::Value::Integer(n) => LengthDist::Fixed(tokens(key, *n)?),
            toml::Value::Table(table) => Self::parse_table(key, table)?,
            other => {
                return Err(format!(
                    "`{key}` must be a number of tokens or a table with a `distribution` \
                     (fixed, uniform, lognormal, table), not a {}",
                    other.type_str()
                ));
            }
        };
        dist.validate(key)?;
        Ok(dist)
    }

    fn parse_table(key: &str, table: &toml::Table) -> Result<LengthDist, String> {
        let Some(kind) = table.get("distribution").and_then(toml::Value::as_str) else {
            return Err(format!(
                "`{key}` needs `distribution = \"fixed\" | \"uniform\" | \"lognormal\" | \"table\"`"
            ));
        };
        let (allowed, dist): (&[&str], _) = match kind {
            "fixed" => (
                &["tokens"],
                LengthDist::Fixed(tokens(key, integer(key, table, "tokens")?)?),
            ),
            "uniform" => (
                &["min", "max"],
                LengthDist::Uniform {
                    min: tokens(key, integer(key, table, "min")?)?,
                    max: tokens(key, integer(key, table, "max")?)?,
                },
            ),
            "lognormal" => (
                &["median", "sigma", "min", "max"],
                LengthDist::LogNormal {
                    median: number(key, table, "median")?,
                    sigma: number(key, table, "sigma")?,
                    min: match table.get("min") {
                        Some(_) => tokens(key, integer(key, table, "min")?)?,
                        None => 1,
                    },
                    max: tokens(key, integer(key, table, "max")?)?,
                },
            ),
            "table" => {
                let list = |field: &str| -> Result<Vec<toml::Value>, String> {
                    table
                        .get(field)
                        .and_then(toml::Value::as_array)
                        .cloned()
                        .ok_or_else(|| format!("`{key}.{field}` must be a list"))
                };
                let tokens = list("tokens")?
                    .iter()
                    .map(|v| match v.as_integer() {
                        Some(n) => tokens(key, n),
                        None => Err(format!("`{key}.tokens` must list whole numbers of tokens")),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let weights = list("weights")?
                    .iter()
                    .map(|v| {
                        v.as_float()
                            .or_else(|| v.as_integer().map(|n| n as f64))
                            .ok_or_else(|| format!("`{key}.weights` must list numbers"))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                (
                    &["tokens", "weights"],
                    LengthDist::Table { tokens, weights },
                )
            }
            other => {
                return Err(format!(
                    "`{key}.distribution` must be fixed, uniform, lognormal or table (got \"{other}\")"
                ));
            }
        };
        if let Some(unknown) = table
            .keys()
            .find(|k| *k != "distribution" && !allowed.contains(&k.as_str()))
        {
            return Err(format!(
                "`{key}.{unknown}` is not a field of a {kind} distribution (it takes {})",
                allowed.join(", ")
            ));
        }
        Ok(dist)
    }

    fn validate(&self, key: &str) -> Result<(), String> {
        match self {
            LengthDist::Fixed(_) => Ok(()),
            LengthDist::Uniform { min, max } if min > max => {
                Err(format!("`{key}`: min ({min}) must not exceed max ({max})"))
            }
            LengthDist::Uniform { .. } => Ok(()),
            LengthDist::LogNormal {
                median,
                sigma,
                min,
                max,
            } => {
                if min > max {
                    return Err(format!("`{key}`: min ({min}) must not exceed max ({max})"));
                }
                if !(median.is_finite() && *median >= 1.0 && *median <= f64::from(MAX_TOKENS)) {
                    return Err(format!(
                        "`{key}.median` must lie between 1 and {MAX_TOKENS} tokens (got {median})"
                    ));
                }
                if !(sigma.is_finite() && (0.0..=4.0).contains(sigma)) {
                    return Err(format!(
                        "`{key}.sigma` must lie between 0 and 4 (got {sigma}); 0.5-1.2 is typical of chat traces"
                    ));
                }
                Ok(())
            }
            LengthDist::Table { tokens, weights } => {
                if tokens.is_empty() || tokens.len() != weights.len() {
                    return Err(format!(
                        "`{key}`: give as many `weights` as `tokens`, at least one ({} tokens, {} weights)",
                        tokens.len(),
                        weights.len()
                    ));
                }
                if weights.iter().any(|w| !(w.is_finite() && *w >= 0.0))
                    || weights.iter().sum::<f64>() <= 0.0
                {
                    return Err(format!(
                        "`{key}.weights` must be non-negative numbers, not all zero"
                    ));
                }
                Ok(())
            }
        }
    }

    /// One draw.
    pub fn draw(&self, rng: &mut Rng) -> u32 {
        match self {
            LengthDist::Fixed(n) => *n,
            LengthDist::Uniform { min, max } => {
                let span = f64::from(max - min) + 1.0;
                min + ((rng.uniform() * span) as u32).min(max - min)
            }
            LengthDist::LogNormal {
                median,
                sigma,
                min,
                max,
            } => {
                let x = median * (sigma * rng.normal()).exp();
                (x.round().clamp(f64::from(*min), f64::from(*max))) as u32
            }
            LengthDist::Table { tokens, weights } => {
                let total: f64 = weights.iter().sum();
                let mut target = rng.uniform() * total;
                for (n, w) in tokens.iter().zip(weights) {
                    if target < *w {
                        return *n;
                    }
                    target -= w;
                }
                tokens.last().copied().unwrap_or(1)
            }
        }
    }

    /// The mean of a draw (the lognormal's clamping is taken into account numerically).
    pub fn mean(&self) -> f64 {
        match self {
            LengthDist::Fixed(n) => f64::from(*n),
            LengthDist::Uniform { min, max } => (f64::from(*min) + f64::from(*max)) / 2.0,
            LengthDist::LogNormal { .. } => {
                // The clamp makes the closed form wrong; a fixed-seed estimate is exact
                // enough for sizing and the same every time.
                let mut rng = Rng::stream(0x6c65_6e67_7468, 0);
                let draws = 20_000;
                (0..draws)
                    .map(|_| f64::from(self.draw(&mut rng)))
                    .sum::<f64>()
                    / draws as f64
            }
            LengthDist::Table { tokens, weights } => {
                let total: f64 = weights.iter().sum();
                tokens
                    .iter()
                    .zip(weights)
                    .map(|(n, w)| f64::from(*n) * w)
                    .sum::<f64>()
                    / total
            }
        }
    }

    /// `n` draws, sorted: a fixed-seed sample to read quantiles from, the same every
    /// time (as [`LengthDist::mean`]'s).
    pub fn sorted_sample(&self, n: usize) -> Vec<u32> {
        let mut rng = Rng::stream(0x6c65_6e67_7468, 1);
        let mut draws: Vec<u32> = (0..n.max(1)).map(|_| self.draw(&mut rng)).collect();
        draws.sort_unstable();
        draws
    }

    /// The longest draw possible.
    pub fn max(&self) -> u32 {
        match self {
            LengthDist::Fixed(n) => *n,
            LengthDist::Uniform { max, .. } | LengthDist::LogNormal { max, .. } => *max,
            LengthDist::Table { tokens, .. } => tokens.iter().copied().max().unwrap_or(1),
        }
    }
}

fn tokens(key: &str, n: i64) -> Result<u32, String> {
    u32::try_from(n)
        .ok()
        .filter(|n| (1..=MAX_TOKENS).contains(n))
        .ok_or_else(|| {
            format!("`{key}`: token counts must lie between 1 and {MAX_TOKENS} (got {n})")
        })
}

fn integer(key: &str, table: &toml::Table, field: &str) -> Result<i64, String> {
    table
        .get(field)
        .and_then(toml::Value::as_integer)
        .ok_or_else(|| format!("`{key}.{field}` must be a whole number of tokens"))
}

fn number(key: &str, table: &toml::Table, field: &str) -> Result<f64, String> {
    table
        .get(field)
        .and_then(|v| v.as_float().or_else(|| v.as_integer().map(|n| n as f64)))
        .ok_or_else(|| format!("`{key}.{field}` must be a number"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<LengthDist, String> {
        let table: toml::Table = toml::from_str(&format!("x = {text}")).unwrap();
        LengthDist::parse("prompt_tokens", &table["x"])
    }

    fn sample_mean(dist: &LengthDist, n: usize) -> f64 {
        let mut rng = Rng::stream(7, 1);
        (0..n).map(|_| f64::from(dist.draw(&mut rng))).sum::<f64>() / n as f64
    }

    #[test]
    fn each_distribution_draws_within_its_range_with_its_mean() {
        let fixed = parse("512").unwrap();
        assert_eq!((fixed.mean(), fixed.max()), (512.0, 512));
        let uniform = parse("{ distribution = \"uniform\", min = 100, max = 300 }").unwrap();
        assert!((sample_mean(&uniform, 50_000) - 200.0).abs() < 2.0);
        let lognormal = parse(
            "{ distribution = \"lognormal\", median = 1000, sigma = 0.8, min = 10, max = 8000 }",
        )
        .unwrap();
        // The unclamped mean is 1000·e^(0.32) = 1377; the clamp at 8000 takes a little off.
        let mean = lognormal.mean();
        assert!((1300.0..1377.0).contains(&mean), "{mean}");
        assert!((sample_mean(&lognormal, 50_000) / mean - 1.0).abs() < 0.02);
        let table =
            parse("{ distribution = \"table\", tokens = [100, 1000], weights = [3, 1] }").unwrap();
        assert_eq!(table.mean(), 325.0);
        assert!((sample_mean(&table, 50_000) - 325.0).abs() < 8.0);
        let mut rng = Rng::stream(1, 2);
        for dist in [&uniform, &lognormal, &table] {
            for _ in 0..10_000 {
                let n = dist.draw(&mut rng);
                assert!((1..=dist.max()).contains(&n));
            }
        }
    }

    #[test]
    fn bad_lengths_name_the_field_and_the_fix() {
        for (text, expected) in [
            ("0", "between 1 and 1048576 (got 0)"),
            ("\"long\"", "a number of tokens or a table"),
            ("{ min = 1 }", "needs `distribution"),
            (
                "{ distribution = \"zipf\" }",
                "fixed, uniform, lognormal or table",
            ),
            (
                "{ distribution = \"uniform\", min = 5, max = 2 }",
                "min (5) must not exceed max (2)",
            ),
            (
                "{ distribution = \"uniform\", min = 5, max = 9, mean = 7 }",
                "`prompt_tokens.mean` is not a field of a uniform distribution",
            ),
            (
                "{ distribution = \"lognormal\", median = 100, sigma = -1, max = 9 }",
                "sigma` must lie between 0 and 4",
            ),
            (
                "{ distribution = \"table\", tokens = [1, 2], weights = [1] }",
                "as many `weights` as `tokens`",
            ),
            (
                "{ distribution = \"table\", tokens = [1], weights = [0] }",
                "not all zero",
            ),
        ] {
            let err = parse(text).unwrap_err();
            assert!(err.contains(expected), "{text}: {err}");
        }
    }
}
