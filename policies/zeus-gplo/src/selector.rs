//! Zeus's optimum selectors: which profiled power limit to keep.
//!
//! Zeus (`zeus/optimizer/power_limit.py`, ml-energy/zeus) offers `Energy`, `Time`,
//! `ZeusCost(eta_knob)` (its default, with `eta_knob = 0.5`) and
//! `MaxSlowdownConstraint(factor)`. Zeus measures the energy and time of a fixed number
//! of training steps, a fixed amount of work; a serving tick is a fixed time, not a
//! fixed amount of work, so here both are per token: joules per token (all GPUs) and
//! seconds per token (all GPUs together).

/// One profiled power limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Measurement {
    pub cap_w: f64,
    /// Joules per token, summed over the GPUs.
    pub energy_j: f64,
    /// Seconds per token, over the GPUs together.
    pub time_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Selector {
    /// The least energy.
    Energy,
    /// The least time.
    Time,
    /// The least `eta·energy + (1 − eta)·max power·time`, max power being the highest
    /// profiled limit times the number of GPUs.
    ZeusCost { eta: f64, gpus: usize },
    /// The lowest limit whose time is at most `factor` times the highest limit's.
    MaxSlowdown { factor: f64 },
}

impl Selector {
    /// The power limit to keep; `None` without measurements.
    pub fn select(&self, measurements: &[Measurement]) -> Option<f64> {
        let least = |key: &dyn Fn(&Measurement) -> f64| {
            measurements
                .iter()
                .min_by(|a, b| key(a).total_cmp(&key(b)))
                .map(|m| m.cap_w)
        };
        match *self {
            Selector::Energy => least(&|m| m.energy_j),
            Selector::Time => least(&|m| m.time_s),
            Selector::ZeusCost { eta, gpus } => {
                let max_power = measurements
                    .iter()
                    .map(|m| m.cap_w)
                    .fold(f64::NEG_INFINITY, f64::max)
                    * gpus as f64;
                least(&|m| eta * m.energy_j + (1.0 - eta) * max_power * m.time_s)
            }
            Selector::MaxSlowdown { factor } => {
                let fastest_cap = measurements
                    .iter()
                    .max_by(|a, b| a.cap_w.total_cmp(&b.cap_w))?;
                measurements
                    .iter()
                    .filter(|m| m.time_s <= factor * fastest_cap.time_s)
                    .map(|m| m.cap_w)
                    .min_by(f64::total_cmp)
            }
        }
    }

    pub fn name(&self) -> String {
        match self {
            Selector::Energy => "energy".into(),
            Selector::Time => "time".into(),
            Selector::ZeusCost { eta, .. } => format!("zeus-cost (eta {eta})"),
            Selector::MaxSlowdown { factor } => format!("max-slowdown (factor {factor})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> Vec<Measurement> {
        // Lower caps: less energy per token, more time per token.
        [
            (700.0, 0.040, 0.00006),
            (600.0, 0.034, 0.000062),
            (500.0, 0.031, 0.00007),
            (400.0, 0.033, 0.00009),
        ]
        .into_iter()
        .map(|(cap_w, energy_j, time_s)| Measurement {
            cap_w,
            energy_j,
            time_s,
        })
        .collect()
    }

    #[test]
    fn each_selector_picks_as_zeus_documents() {
        let profile = profile();
        assert_eq!(Selector::Energy.select(&profile), Some(500.0));
        assert_eq!(Selector::Time.select(&profile), Some(700.0));
        // eta 0.5: 0.5 E + 0.5 * 700 * T: 700 -> 0.041, 600 -> 0.0387, 500 -> 0.040, 400 -> 0.048.
        assert_eq!(
            Selector::ZeusCost { eta: 0.5, gpus: 1 }.select(&profile),
            Some(600.0)
        );
        // Ten GPUs weigh time by ten times the max power: the top limit wins.
        assert_eq!(
            Selector::ZeusCost { eta: 0.5, gpus: 10 }.select(&profile),
            Some(700.0)
        );
        // eta 0: time alone decides.
        assert_eq!(
            Selector::ZeusCost { eta: 0.0, gpus: 1 }.select(&profile),
            Some(700.0)
        );
        assert_eq!(
            Selector::MaxSlowdown { factor: 1.1 }.select(&profile),
            Some(600.0)
        );
        assert_eq!(
            Selector::MaxSlowdown { factor: 2.0 }.select(&profile),
            Some(400.0)
        );
        assert_eq!(Selector::Energy.select(&[]), None);
    }
}
