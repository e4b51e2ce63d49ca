//! The cap search's parameters, read from the spec's `[params]`.

use tokwatt_policy_sdk::Params;

/// How the power cap search moves. The keys and defaults are the same in every policy
/// that uses the search:
///
/// | key | default | meaning |
/// |---|---|---|
/// | `window_ticks` | 5 | settled, busy ticks per measurement |
/// | `step_w` | 50 | first and largest step, W; also the objective raise |
/// | `min_step_w` | 10 | smallest step, W |
/// | `min_gain` | 0.005 | relative gain that counts as better |
/// | `slo_hold_windows` | 10 | windows to stay above a cap that broke the objective |
/// | `start_w` | the GPU's default cap | first cap, W |
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CapConfig {
    /// Settled, busy ticks per measurement window.
    pub window_ticks: u32,
    /// The largest (and first) step of the power cap.
    pub step_w: f64,
    /// The smallest step: halving stops here.
    pub min_step_w: f64,
    /// The relative gain in tokens per joule that counts as an improvement.
    pub min_gain: f64,
    /// Windows during which the search stays above a cap that broke the objective.
    pub slo_hold_windows: u32,
    /// Where to start; `None` starts from each GPU's default cap.
    pub start_w: Option<f64>,
}

impl CapConfig {
    /// The parameter names the search reads, for a policy's unknown-parameter check.
    pub const KEYS: [&str; 6] = [
        "window_ticks",
        "step_w",
        "min_step_w",
        "min_gain",
        "slo_hold_windows",
        "start_w",
    ];

    /// The search's parameters, for a policy that has no others: any key outside
    /// [`CapConfig::KEYS`] is refused.
    ///
    /// # Errors
    /// An unknown key, or a value that does not parse or makes no sense, by name.
    pub fn from_params(params: &Params<'_>) -> Result<CapConfig, String> {
        params.check_known(&Self::KEYS)?;
        Self::read(params)
    }

    /// The search's parameters, for a policy that reads further keys of its own: the
    /// caller checks for unknown keys.
    ///
    /// # Errors
    /// A value that does not parse or makes no sense, by name.
    pub fn read(params: &Params<'_>) -> Result<CapConfig, String> {
        let config = CapConfig {
            window_ticks: params.get("window_ticks", 5)?,
            step_w: params.get("step_w", 50.0)?,
            min_step_w: params.get("min_step_w", 10.0)?,
            min_gain: params.get("min_gain", 0.005)?,
            slo_hold_windows: params.get("slo_hold_windows", 10)?,
            start_w: params.get_optional("start_w")?,
        };
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), String> {
        if self.window_ticks == 0 {
            return Err("parameter `window_ticks` must be at least 1".into());
        }
        if !(self.min_step_w.is_finite() && self.min_step_w > 0.0) {
            return Err(format!(
                "parameter `min_step_w` = {} must be a positive number of watts",
                self.min_step_w
            ));
        }
        if !(self.step_w.is_finite() && self.step_w >= self.min_step_w) {
            return Err(format!(
                "parameter `step_w` = {} must be a number of watts at least `min_step_w` ({})",
                self.step_w, self.min_step_w
            ));
        }
        if !(self.min_gain.is_finite() && (0.0..1.0).contains(&self.min_gain)) {
            return Err(format!(
                "parameter `min_gain` = {} must be a fraction in [0, 1), e.g. 0.005 for 0.5 %",
                self.min_gain
            ));
        }
        if let Some(start_w) = self.start_w
            && !(start_w.is_finite() && start_w > 0.0)
        {
            return Err(format!(
                "parameter `start_w` = {start_w} must be a positive number of watts"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_policy_sdk::testing;

    fn config(pairs: &[(&str, &str)]) -> Result<CapConfig, String> {
        let pairs = testing::params(pairs);
        CapConfig::from_params(&Params::new(&pairs))
    }

    #[test]
    fn defaults_match_the_documentation() {
        assert_eq!(
            config(&[]),
            Ok(CapConfig {
                window_ticks: 5,
                step_w: 50.0,
                min_step_w: 10.0,
                min_gain: 0.005,
                slo_hold_windows: 10,
                start_w: None,
            })
        );
    }

    #[test]
    fn inconsistent_or_impossible_values_are_refused_by_name() {
        let cases: [(&[(&str, &str)], &str); 8] = [
            (&[("window_ticks", "0")], "window_ticks"),
            (&[("step_w", "5")], "step_w"),
            (&[("min_step_w", "0")], "min_step_w"),
            (&[("min_step_w", "NaN")], "min_step_w"),
            (&[("step_w", "inf")], "step_w"),
            (&[("min_gain", "-0.1")], "min_gain"),
            (&[("start_w", "-1")], "start_w"),
            (&[("windows", "3")], "unknown parameter `windows`"),
        ];
        for (pairs, named) in cases {
            let error = config(pairs).err().unwrap_or_default();
            assert!(error.contains(named), "{pairs:?}: {error:?}");
        }
    }

    #[test]
    fn read_leaves_other_keys_to_the_caller() {
        let pairs = testing::params(&[("batch_step", "8"), ("step_w", "40")]);
        let params = Params::new(&pairs);
        assert_eq!(
            CapConfig::read(&params).map(|config| config.step_w),
            Ok(40.0)
        );
        assert!(CapConfig::from_params(&params).is_err());
    }
}
