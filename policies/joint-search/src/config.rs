//! The joint search's parameters, read from the spec's `[params]`.

use tokwatt_policy_sdk::Params;

/// See `policies/joint-search.toml` for each key's unit, default and reason.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Config {
    /// SM clock levels of the arm grid, spread evenly over the supported clocks.
    pub clock_levels: u32,
    /// Batch levels: the largest batch, halved `batch_levels - 1` times.
    pub batch_levels: u32,
    /// Settled, busy ticks per visit to an arm.
    pub window_ticks: u32,
    /// Fraction of the p99 limit kept free.
    pub tpot_margin: f64,
    /// Requests a tick by which a queue must grow to count as growing.
    pub queue_growth: f64,
    /// Requests waiting that count as a queue.
    pub queue_min: u32,
    /// Visits an arm stays ruled out after it broke the objective or went out of bounds.
    pub hold_visits: u32,
    /// Per-tick relative noise assumed until measured, and its floor.
    pub noise_cv: f64,
    pub noise_floor_cv: f64,
    /// Relative spread of the prior of an arm not yet measured, around its neighbours.
    pub prior_spread: f64,
    /// Change of tokens per second at one arm that is a workload shift, and for how many
    /// ticks in a row.
    pub shift_factor: f64,
    pub shift_ticks: u32,
    /// Ticks remembered per arm.
    pub memory_ticks: u32,
}

impl Config {
    pub const KEYS: [&str; 13] = [
        "clock_levels",
        "batch_levels",
        "window_ticks",
        "tpot_margin",
        "queue_growth",
        "queue_min",
        "hold_visits",
        "noise_cv",
        "noise_floor_cv",
        "prior_spread",
        "shift_factor",
        "shift_ticks",
        "memory_ticks",
    ];

    /// # Errors
    /// An unknown key, or a value that does not parse or makes no sense, by name.
    pub fn from_params(params: &Params<'_>) -> Result<Config, String> {
        params.check_known(&Self::KEYS)?;
        let config = Config {
            clock_levels: params.get("clock_levels", 24)?,
            batch_levels: params.get("batch_levels", 4)?,
            window_ticks: params.get("window_ticks", 4)?,
            tpot_margin: params.get("tpot_margin", 0.10)?,
            queue_growth: params.get("queue_growth", 1.0)?,
            queue_min: params.get("queue_min", 16)?,
            hold_visits: params.get("hold_visits", 100)?,
            noise_cv: params.get("noise_cv", 0.03)?,
            noise_floor_cv: params.get("noise_floor_cv", 0.005)?,
            prior_spread: params.get("prior_spread", 0.1)?,
            shift_factor: params.get("shift_factor", 1.6)?,
            shift_ticks: params.get("shift_ticks", 5)?,
            memory_ticks: params.get("memory_ticks", 30)?,
        };
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), String> {
        let at_least = |name: &str, value: u32, least: u32| {
            if value >= least {
                Ok(())
            } else {
                Err(format!(
                    "parameter `{name}` = {value} must be at least {least}"
                ))
            }
        };
        at_least("clock_levels", self.clock_levels, 2)?;
        at_least("batch_levels", self.batch_levels, 1)?;
        at_least("window_ticks", self.window_ticks, 2)?;
        at_least("hold_visits", self.hold_visits, 1)?;
        at_least("shift_ticks", self.shift_ticks, 1)?;
        at_least("memory_ticks", self.memory_ticks, 2)?;
        if self.clock_levels > 256 || self.batch_levels > 16 {
            return Err(format!(
                "parameters `clock_levels` = {} and `batch_levels` = {} must stay within 256 \
                 and 16: every arm costs time to visit",
                self.clock_levels, self.batch_levels
            ));
        }
        if !(self.tpot_margin.is_finite() && (0.0..0.5).contains(&self.tpot_margin)) {
            return Err(format!(
                "parameter `tpot_margin` = {} must be a fraction in [0, 0.5)",
                self.tpot_margin
            ));
        }
        for (name, value) in [
            ("queue_growth", self.queue_growth),
            ("noise_cv", self.noise_cv),
            ("noise_floor_cv", self.noise_floor_cv),
            ("prior_spread", self.prior_spread),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(format!(
                    "parameter `{name}` = {value} must be a positive number"
                ));
            }
        }
        if !(self.shift_factor.is_finite() && self.shift_factor > 1.0) {
            return Err(format!(
                "parameter `shift_factor` = {} must be a factor above 1",
                self.shift_factor
            ));
        }
        Ok(())
    }
}
