//! The policy's parameters, read from the spec's `[params]`.

use tokwatt_policy_sdk::Params;

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Config {
    /// Steer the p99 time per token to this fraction of the limit.
    pub headroom: f64,
    /// The first batch size (fitted to each device).
    pub start_batch_size: u32,
    /// The largest growth of the batch in one step, as a factor.
    pub max_batch_growth: f64,
    /// Settled, busy ticks per clock decision.
    pub window_ticks: u32,
    /// The largest fall of the SM clock in one step, as a fraction of the clock.
    pub clock_step_down: f64,
    /// The rise of the SM clock when the GPU does not keep up, as a fraction.
    pub clock_step_up: f64,
    /// Assumed growth of time per token with a lower clock: (old/new clock)^this.
    pub clock_elasticity: f64,
    /// Windows to stay above a clock that broke the objective or could not keep up.
    pub hold_windows: u32,
    /// A change of tokens/s by this factor (either way) is a workload shift.
    pub shift_factor: f64,
    /// The largest change of the token budget in one step, as a fraction of it.
    pub token_budget_step: f64,
}

impl Config {
    pub const KEYS: [&str; 10] = [
        "headroom",
        "start_batch_size",
        "max_batch_growth",
        "window_ticks",
        "clock_step_down",
        "clock_step_up",
        "clock_elasticity",
        "hold_windows",
        "shift_factor",
        "token_budget_step",
    ];

    pub fn from_params(params: &Params<'_>) -> Result<Config, String> {
        params.check_known(&Self::KEYS)?;
        let config = Config {
            headroom: params.get("headroom", 0.9)?,
            start_batch_size: params.get("start_batch_size", 64)?,
            max_batch_growth: params.get("max_batch_growth", 2.0)?,
            window_ticks: params.get("window_ticks", 3)?,
            clock_step_down: params.get("clock_step_down", 0.25)?,
            clock_step_up: params.get("clock_step_up", 0.05)?,
            clock_elasticity: params.get("clock_elasticity", 2.0)?,
            hold_windows: params.get("hold_windows", 10)?,
            shift_factor: params.get("shift_factor", 2.0)?,
            token_budget_step: params.get("token_budget_step", 0.25)?,
        };
        let fraction = |name: &str, value: f64, top_open: bool| {
            let inside = value > 0.0 && if top_open { value < 1.0 } else { value <= 1.0 };
            if inside {
                Ok(())
            } else {
                Err(format!(
                    "parameter `{name}` = {value} must lie in (0, 1{}",
                    if top_open { ")" } else { "]" }
                ))
            }
        };
        fraction("headroom", config.headroom, false)?;
        fraction("clock_step_down", config.clock_step_down, true)?;
        fraction("clock_step_up", config.clock_step_up, false)?;
        fraction("token_budget_step", config.token_budget_step, true)?;
        if config.start_batch_size == 0 {
            return Err("parameter `start_batch_size` must be at least 1".into());
        }
        if !(config.max_batch_growth > 1.0 && config.max_batch_growth.is_finite()) {
            return Err(format!(
                "parameter `max_batch_growth` = {} must be a finite factor above 1",
                config.max_batch_growth
            ));
        }
        if config.window_ticks == 0 {
            return Err("parameter `window_ticks` must be at least 1".into());
        }
        if !(config.clock_elasticity >= 1.0 && config.clock_elasticity.is_finite()) {
            return Err(format!(
                "parameter `clock_elasticity` = {} must be a finite number of at least 1 \
                 (time per token grows at least in proportion to a lower clock's period)",
                config.clock_elasticity
            ));
        }
        if !(config.shift_factor > 1.0 && config.shift_factor.is_finite()) {
            return Err(format!(
                "parameter `shift_factor` = {} must be a finite factor above 1",
                config.shift_factor
            ));
        }
        Ok(config)
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
    fn defaults_and_every_key() {
        let defaults = config(&[]).unwrap();
        assert_eq!(defaults.headroom, 0.9);
        assert_eq!(defaults.start_batch_size, 64);
        let given = config(&[
            ("headroom", "0.8"),
            ("start_batch_size", "32"),
            ("max_batch_growth", "1.5"),
            ("window_ticks", "4"),
            ("clock_step_down", "0.2"),
            ("clock_step_up", "0.3"),
            ("clock_elasticity", "1.5"),
            ("hold_windows", "7"),
            ("shift_factor", "3"),
            ("token_budget_step", "0.5"),
        ])
        .unwrap();
        assert_eq!(
            given,
            Config {
                headroom: 0.8,
                start_batch_size: 32,
                max_batch_growth: 1.5,
                window_ticks: 4,
                clock_step_down: 0.2,
                clock_step_up: 0.3,
                clock_elasticity: 1.5,
                hold_windows: 7,
                shift_factor: 3.0,
                token_budget_step: 0.5,
            }
        );
    }

    #[test]
    fn bad_values_are_refused_by_name() {
        for (key, value) in [
            ("headroom", "0"),
            ("headroom", "1.1"),
            ("start_batch_size", "0"),
            ("max_batch_growth", "1"),
            ("window_ticks", "0"),
            ("clock_step_down", "1"),
            ("clock_step_up", "0"),
            ("clock_elasticity", "0.5"),
            ("shift_factor", "1"),
            ("shift_factor", "inf"),
            ("token_budget_step", "0"),
            ("token_budget_step", "1"),
        ] {
            let error = config(&[(key, value)]).err().unwrap_or_default();
            assert!(error.contains(key), "{key}={value}: {error}");
        }
        let error = config(&[("batch", "1")]).err().unwrap_or_default();
        assert!(error.contains("unknown parameter `batch`"), "{error}");
    }
}
