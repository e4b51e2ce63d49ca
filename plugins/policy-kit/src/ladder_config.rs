//! The ladder search's parameters, read from the spec's `[params]`.

use tokwatt_policy_sdk::Params;

/// How the ladder search measures, compares and moves. Every policy built on the search
/// reads the same keys.
///
/// | key | meaning |
/// |---|---|
/// | `min_window_ticks` | settled, busy ticks before a probe may be judged |
/// | `max_window_ticks` | ticks after which a difference still within the noise is a tie |
/// | `z` | standard errors a difference must exceed to count |
/// | `noise_cv` | first guess of the per-tick relative noise, before any is measured |
/// | `noise_floor_cv` | the learnt noise is kept above this |
/// | `tpot_margin` | fraction of the p99 limit kept free: a window above it is out of bounds |
/// | `queue_growth` | requests per tick by which a queue must grow to count as growing |
/// | `queue_min` | requests waiting (at the end, or on average) that count as a queue |
/// | `floor_hold_windows` | windows to stay above a rung that broke the objective |
/// | `recheck_windows` | windows at the best rung between probes of its neighbours |
/// | `shift_factor` | change of tokens per second, at one rung, that is a workload shift |
/// | `shift_ticks` | ticks in a row the change must last |
/// | `memory_ticks` | samples remembered per rung; older ones fade |
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LadderConfig {
    pub min_window_ticks: u32,
    pub max_window_ticks: u32,
    pub z: f64,
    pub noise_cv: f64,
    pub noise_floor_cv: f64,
    pub tpot_margin: f64,
    pub queue_growth: f64,
    pub queue_min: u32,
    pub floor_hold_windows: u32,
    pub recheck_windows: u32,
    pub shift_factor: f64,
    pub shift_ticks: u32,
    pub memory_ticks: u32,
}

impl LadderConfig {
    /// The parameter names the search reads, for a policy's unknown-parameter check.
    pub const KEYS: [&str; 13] = [
        "min_window_ticks",
        "max_window_ticks",
        "z",
        "noise_cv",
        "noise_floor_cv",
        "tpot_margin",
        "queue_growth",
        "queue_min",
        "floor_hold_windows",
        "recheck_windows",
        "shift_factor",
        "shift_ticks",
        "memory_ticks",
    ];

    /// The defaults (see `policies/cap-search.toml` for why each).
    pub fn defaults() -> LadderConfig {
        LadderConfig {
            min_window_ticks: 3,
            max_window_ticks: 10,
            z: 2.0,
            noise_cv: 0.03,
            noise_floor_cv: 0.005,
            tpot_margin: 0.08,
            queue_growth: 1.0,
            queue_min: 16,
            floor_hold_windows: 20,
            recheck_windows: 10,
            shift_factor: 1.6,
            shift_ticks: 5,
            memory_ticks: 30,
        }
    }

    /// The search's parameters over `defaults`; the caller checks for unknown keys.
    ///
    /// # Errors
    /// A value that does not parse or makes no sense, by name.
    pub fn read(params: &Params<'_>, defaults: LadderConfig) -> Result<LadderConfig, String> {
        let d = defaults;
        let config = LadderConfig {
            min_window_ticks: params.get("min_window_ticks", d.min_window_ticks)?,
            max_window_ticks: params.get("max_window_ticks", d.max_window_ticks)?,
            z: params.get("z", d.z)?,
            noise_cv: params.get("noise_cv", d.noise_cv)?,
            noise_floor_cv: params.get("noise_floor_cv", d.noise_floor_cv)?,
            tpot_margin: params.get("tpot_margin", d.tpot_margin)?,
            queue_growth: params.get("queue_growth", d.queue_growth)?,
            queue_min: params.get("queue_min", d.queue_min)?,
            floor_hold_windows: params.get("floor_hold_windows", d.floor_hold_windows)?,
            recheck_windows: params.get("recheck_windows", d.recheck_windows)?,
            shift_factor: params.get("shift_factor", d.shift_factor)?,
            shift_ticks: params.get("shift_ticks", d.shift_ticks)?,
            memory_ticks: params.get("memory_ticks", d.memory_ticks)?,
        };
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), String> {
        let positive = |name: &str, value: f64| {
            if value.is_finite() && value > 0.0 {
                Ok(())
            } else {
                Err(format!(
                    "parameter `{name}` = {value} must be a positive number"
                ))
            }
        };
        if self.min_window_ticks == 0 {
            return Err("parameter `min_window_ticks` must be at least 1".into());
        }
        if self.max_window_ticks < self.min_window_ticks {
            return Err(format!(
                "parameter `max_window_ticks` = {} must be at least `min_window_ticks` ({})",
                self.max_window_ticks, self.min_window_ticks
            ));
        }
        positive("z", self.z)?;
        positive("noise_cv", self.noise_cv)?;
        positive("noise_floor_cv", self.noise_floor_cv)?;
        if !(self.tpot_margin.is_finite() && (0.0..0.5).contains(&self.tpot_margin)) {
            return Err(format!(
                "parameter `tpot_margin` = {} must be a fraction in [0, 0.5), e.g. 0.08",
                self.tpot_margin
            ));
        }
        positive("queue_growth", self.queue_growth)?;
        if !(self.shift_factor.is_finite() && self.shift_factor > 1.0) {
            return Err(format!(
                "parameter `shift_factor` = {} must be a factor above 1, e.g. 1.6",
                self.shift_factor
            ));
        }
        for (name, value) in [
            ("floor_hold_windows", self.floor_hold_windows),
            ("recheck_windows", self.recheck_windows),
            ("shift_ticks", self.shift_ticks),
        ] {
            if value == 0 {
                return Err(format!("parameter `{name}` must be at least 1"));
            }
        }
        if self.memory_ticks < 2 {
            return Err("parameter `memory_ticks` must be at least 2".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_policy_sdk::testing;

    fn config(pairs: &[(&str, &str)]) -> Result<LadderConfig, String> {
        let pairs = testing::params(pairs);
        LadderConfig::read(&Params::new(&pairs), LadderConfig::defaults())
    }

    #[test]
    fn absent_keys_take_the_defaults_and_present_ones_win() {
        assert_eq!(config(&[]), Ok(LadderConfig::defaults()));
        assert_eq!(config(&[("z", "3")]).map(|config| config.z), Ok(3.0));
    }

    #[test]
    fn impossible_values_are_refused_by_name() {
        let cases: [(&[(&str, &str)], &str); 7] = [
            (&[("min_window_ticks", "0")], "min_window_ticks"),
            (&[("max_window_ticks", "2")], "max_window_ticks"),
            (&[("z", "-1")], "`z`"),
            (&[("noise_cv", "NaN")], "noise_cv"),
            (&[("tpot_margin", "0.7")], "tpot_margin"),
            (&[("shift_factor", "1")], "shift_factor"),
            (&[("memory_ticks", "1")], "memory_ticks"),
        ];
        for (pairs, named) in cases {
            let error = config(pairs).err().unwrap_or_default();
            assert!(error.contains(named), "{pairs:?}: {error:?}");
        }
    }
}
