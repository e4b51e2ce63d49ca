//! Conveniences for building [`Settings`].

use crate::Settings;

impl Settings {
    /// Leaves every knob as it is (every field `None`).
    pub const fn unchanged() -> Self {
        Settings {
            power_cap_w: None,
            sm_clock_max_mhz: None,
            batch_size: None,
            token_budget: None,
        }
    }

    /// The same settings with the power cap set to `watts`.
    #[must_use]
    pub const fn with_power_cap_w(mut self, watts: f64) -> Self {
        self.power_cap_w = Some(watts);
        self
    }

    /// The same settings with the SM clock lock's upper bound set to `mhz`.
    #[must_use]
    pub const fn with_sm_clock_max_mhz(mut self, mhz: u32) -> Self {
        self.sm_clock_max_mhz = Some(mhz);
        self
    }

    /// The same settings with the batch size set to `sequences`.
    #[must_use]
    pub const fn with_batch_size(mut self, sequences: u32) -> Self {
        self.batch_size = Some(sequences);
        self
    }

    /// The same settings with the token budget per step set to `tokens` (prompt chunks
    /// and decoding sequences together; the host applies it only where the spec grants
    /// `token-budget` and the workload has one: see [`crate::DeviceFacts`]'s
    /// `token_budget_max`, 0 where it has none).
    #[must_use]
    pub const fn with_token_budget(mut self, tokens: u32) -> Self {
        self.token_budget = Some(tokens);
        self
    }

    /// True when no knob is set.
    pub const fn is_unchanged(&self) -> bool {
        self.power_cap_w.is_none()
            && self.sm_clock_max_mhz.is_none()
            && self.batch_size.is_none()
            && self.token_budget.is_none()
    }
}

impl Default for Settings {
    /// [`Settings::unchanged`].
    fn default() -> Self {
        Settings::unchanged()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builders_set_only_their_knob() {
        assert!(Settings::unchanged().is_unchanged());
        assert_eq!(Settings::default(), Settings::unchanged());
        let settings = Settings::unchanged()
            .with_power_cap_w(450.0)
            .with_batch_size(64);
        assert_eq!(settings.power_cap_w, Some(450.0));
        assert_eq!(settings.sm_clock_max_mhz, None);
        assert_eq!(settings.batch_size, Some(64));
        assert!(!settings.is_unchanged());
        assert_eq!(
            Settings::unchanged()
                .with_sm_clock_max_mhz(1410)
                .sm_clock_max_mhz,
            Some(1410)
        );
        let budget = Settings::unchanged().with_token_budget(2048);
        assert_eq!(budget.token_budget, Some(2048));
        assert_eq!(budget.batch_size, None);
        assert!(!budget.is_unchanged());
    }
}
