//! The policy's parameters, read from the spec's `[params]`.

pub(crate) use tokwatt_policy_kit::CapConfig;
use tokwatt_policy_sdk::Params;

/// How the batch size follows the latency objective.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct BatchConfig {
    /// The batch grows only while p99 time per token is under this fraction of the limit.
    pub headroom: f64,
    /// The additive growth, in sequences.
    pub step: u32,
    /// Below this batch size, growth is multiplicative instead.
    pub multiplicative_below: u32,
    /// The multiplicative growth factor, above 1.
    pub grow_factor: f64,
    /// The factor a violation multiplies the batch by, in (0, 1).
    pub shrink_factor: f64,
    /// Where to start; `None` keeps each workload's batch size.
    pub start: Option<u32>,
}

/// Everything the spec's `[params]` sets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Config {
    pub cap: CapConfig,
    pub batch: BatchConfig,
}

impl Config {
    /// Reads and checks every parameter; a key that neither loop reads is refused.
    pub fn from_params(params: &Params<'_>) -> Result<Config, String> {
        params.check_known(&[CapConfig::KEYS.as_slice(), BatchConfig::KEYS.as_slice()].concat())?;
        Ok(Config {
            cap: CapConfig::read(params)?,
            batch: BatchConfig::read(params)?,
        })
    }
}

impl BatchConfig {
    /// The parameter names the batch control reads.
    const KEYS: [&str; 6] = [
        "batch_headroom",
        "batch_step",
        "batch_multiplicative_below",
        "batch_grow_factor",
        "batch_shrink_factor",
        "start_batch_size",
    ];

    fn read(params: &Params<'_>) -> Result<BatchConfig, String> {
        let config = BatchConfig {
            headroom: params.get("batch_headroom", 0.85)?,
            step: params.get("batch_step", 16)?,
            multiplicative_below: params.get("batch_multiplicative_below", 64)?,
            grow_factor: params.get("batch_grow_factor", 1.25)?,
            shrink_factor: params.get("batch_shrink_factor", 0.7)?,
            start: params.get_optional("start_batch_size")?,
        };
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), String> {
        if !(self.headroom.is_finite() && self.headroom > 0.0 && self.headroom <= 1.0) {
            return Err(format!(
                "parameter `batch_headroom` = {} must be a fraction of the latency limit in \
                 (0, 1], e.g. 0.85",
                self.headroom
            ));
        }
        if self.step == 0 {
            return Err("parameter `batch_step` must be at least 1 sequence".into());
        }
        if !(self.grow_factor.is_finite() && self.grow_factor > 1.0) {
            return Err(format!(
                "parameter `batch_grow_factor` = {} must be a number above 1, e.g. 1.25",
                self.grow_factor
            ));
        }
        if !(self.shrink_factor.is_finite() && self.shrink_factor > 0.0 && self.shrink_factor < 1.0)
        {
            return Err(format!(
                "parameter `batch_shrink_factor` = {} must be a fraction in (0, 1), e.g. 0.7",
                self.shrink_factor
            ));
        }
        if self.start == Some(0) {
            return Err("parameter `start_batch_size` must be at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_policy_sdk::testing;

    fn config(pairs: &[(&str, &str)]) -> Result<Config, String> {
        let pairs = testing::params(pairs);
        Config::from_params(&Params::new(&pairs))
    }

    #[test]
    fn defaults_match_the_documentation() {
        assert_eq!(
            config(&[]),
            Ok(Config {
                cap: CapConfig {
                    window_ticks: 5,
                    step_w: 50.0,
                    min_step_w: 10.0,
                    min_gain: 0.005,
                    slo_hold_windows: 10,
                    start_w: None,
                },
                batch: BatchConfig {
                    headroom: 0.85,
                    step: 16,
                    multiplicative_below: 64,
                    grow_factor: 1.25,
                    shrink_factor: 0.7,
                    start: None,
                },
            })
        );
    }

    #[test]
    fn every_key_is_read() {
        let given = config(&[
            ("window_ticks", "3"),
            ("step_w", "40"),
            ("min_step_w", "5"),
            ("min_gain", "0.01"),
            ("slo_hold_windows", "4"),
            ("start_w", "550"),
            ("batch_headroom", "0.9"),
            ("batch_step", "8"),
            ("batch_multiplicative_below", "32"),
            ("batch_grow_factor", "1.5"),
            ("batch_shrink_factor", "0.5"),
            ("start_batch_size", "96"),
        ]);
        assert_eq!(
            given,
            Ok(Config {
                cap: CapConfig {
                    window_ticks: 3,
                    step_w: 40.0,
                    min_step_w: 5.0,
                    min_gain: 0.01,
                    slo_hold_windows: 4,
                    start_w: Some(550.0),
                },
                batch: BatchConfig {
                    headroom: 0.9,
                    step: 8,
                    multiplicative_below: 32,
                    grow_factor: 1.5,
                    shrink_factor: 0.5,
                    start: Some(96),
                },
            })
        );
    }

    #[test]
    fn inconsistent_or_impossible_values_are_refused_by_name() {
        let cases: [(&[(&str, &str)], &str); 14] = [
            (&[("window_ticks", "0")], "window_ticks"),
            (&[("step_w", "5")], "step_w"),
            (&[("min_step_w", "NaN")], "min_step_w"),
            (&[("min_gain", "-0.1")], "min_gain"),
            (&[("start_w", "-1")], "start_w"),
            (&[("batch_headroom", "0")], "batch_headroom"),
            (&[("batch_headroom", "1.2")], "batch_headroom"),
            (&[("batch_step", "0")], "batch_step"),
            (&[("batch_step", "-4")], "batch_step"),
            (&[("batch_grow_factor", "1")], "batch_grow_factor"),
            (&[("batch_shrink_factor", "1")], "batch_shrink_factor"),
            (&[("batch_shrink_factor", "0")], "batch_shrink_factor"),
            (&[("start_batch_size", "0")], "start_batch_size"),
            (&[("batch_size", "64")], "unknown parameter `batch_size`"),
        ];
        for (pairs, named) in cases {
            let error = config(pairs).err().unwrap_or_default();
            assert!(error.contains(named), "{pairs:?}: {error:?}");
        }
    }
}
