//! Lowering a node's power caps within its reserve, from any process.

use tokwatt_agent::control::fit_caps;
use tokwatt_core::actuator::Actuator;

use super::FenceError;

/// Caps closer than this are the same (NVML works in milliwatts; a fitted cap is rounded
/// down to the milliwatt).
const SAME_CAP_W: f64 = 0.01;

/// What applying the reserve found and did.
#[derive(Debug, Clone, PartialEq)]
pub struct ReserveApplied {
    /// The caps' sum before, watts.
    pub before_w: f64,
    /// The caps' sum after, read back, watts.
    pub after_w: f64,
    /// The GPUs lowered: index, cap before, cap after.
    pub lowered: Vec<(u32, f64, f64)>,
    /// Even every GPU at its lowest cap passes the reserve: each was held at its minimum.
    pub unmet: bool,
}

impl std::fmt::Display for ReserveApplied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.lowered.is_empty() {
            write!(
                f,
                "the caps sum to {:.0} W: nothing to lower",
                self.before_w
            )?;
        } else {
            write!(
                f,
                "the caps summed to {:.0} W, now {:.0} W:",
                self.before_w, self.after_w
            )?;
            for (gpu, before, after) in &self.lowered {
                write!(f, " GPU {gpu} {before:.0} → {after:.0} W;")?;
            }
        }
        if self.unmet {
            write!(
                f,
                " the reserve is below the GPUs' lowest caps: each held at its lowest"
            )?;
        }
        Ok(())
    }
}

/// Every GPU's power cap, as the driver holds it now.
pub fn read_caps(actuator: &mut dyn Actuator) -> Result<Vec<f64>, FenceError> {
    (0..actuator.devices().len() as u32)
        .map(|gpu| {
            actuator
                .read(gpu)
                .map(|settings| settings.power_cap_w)
                .map_err(|source| FenceError::Read { gpu, source })
        })
        .collect()
}

/// Lowers the caps of `actuator`'s GPUs so that they sum to at most `reserve_w`, each
/// toward its lowest cap in proportion to its room above it (the control loop's own
/// fitting, [`fit_caps`]). Never raises a cap, and leaves clock locks and batch sizes
/// alone: only the caps count against a budget. Every GPU is tried even where one fails,
/// so a failure lowers as much as it can; the first failure is returned.
pub fn apply_reserve(
    actuator: &mut dyn Actuator,
    reserve_w: f64,
) -> Result<ReserveApplied, FenceError> {
    if !(reserve_w.is_finite() && reserve_w > 0.0) {
        return Err(FenceError::BadReserve { reserve_w });
    }
    let devices = actuator.devices();
    let caps = read_caps(actuator)?;
    let min: Vec<f64> = devices.iter().map(|d| d.power_cap_min_w).collect();
    let fit = fit_caps(&caps, &min, reserve_w);
    let mut lowered = Vec::new();
    let mut first_failure = None;
    for (gpu, (&before, &after)) in caps.iter().zip(&fit.caps).enumerate() {
        let gpu = gpu as u32;
        if after >= before - SAME_CAP_W {
            continue;
        }
        match actuator.set_power_cap(gpu, after) {
            Ok(_enforced) => lowered.push((gpu, before, after)),
            Err(source) => {
                tracing::error!(gpu, watts = after, "lowering to the reserve: {source}");
                first_failure.get_or_insert(FenceError::Lower {
                    gpu,
                    watts: after,
                    source,
                });
            }
        }
    }
    if let Some(failure) = first_failure {
        return Err(failure);
    }
    let after_w = if lowered.is_empty() {
        caps.iter().sum()
    } else {
        read_caps(actuator)?.iter().sum()
    };
    Ok(ReserveApplied {
        before_w: caps.iter().sum(),
        after_w,
        lowered,
        unmet: fit.unmet,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use tokwatt_core::actuator::{ActuatorError, Capabilities, GpuSettings};
    use tokwatt_core::types::DeviceInfo;

    use super::*;

    /// Boards of 200-700 W whose caps a test sets and reads, counting the sets.
    #[derive(Debug)]
    pub(crate) struct Boards {
        pub(crate) caps: Vec<f64>,
        pub(crate) sets: usize,
        /// A board whose setter fails.
        pub(crate) broken: Option<u32>,
    }

    impl Boards {
        pub(crate) fn at(caps: &[f64]) -> Self {
            Self {
                caps: caps.to_vec(),
                sets: 0,
                broken: None,
            }
        }

        pub(crate) fn sum(&self) -> f64 {
            self.caps.iter().sum()
        }
    }

    impl Actuator for Boards {
        fn name(&self) -> &'static str {
            "boards"
        }
        fn devices(&self) -> Vec<DeviceInfo> {
            (0..self.caps.len() as u32)
                .map(|index| DeviceInfo {
                    index,
                    uuid: format!("GPU-{index}"),
                    name: "board".into(),
                    simulated: true,
                    power_cap_min_w: 200.0,
                    power_cap_max_w: 700.0,
                    power_cap_default_w: 700.0,
                    sm_clocks_mhz: vec![1980],
                    mem_clocks_mhz: vec![3201],
                })
                .collect()
        }
        fn capabilities(&self, _gpu: u32) -> Capabilities {
            Capabilities {
                power_cap: true,
                sm_clock: false,
                mem_clock: false,
            }
        }
        fn read(&mut self, gpu: u32) -> Result<GpuSettings, ActuatorError> {
            let cap = self.caps[gpu as usize];
            Ok(GpuSettings {
                power_cap_w: cap,
                power_cap_enforced_w: cap,
                sm_clock_lock_mhz: None,
                mem_clock_lock_mhz: None,
            })
        }
        fn set_power_cap(&mut self, gpu: u32, watts: f64) -> Result<f64, ActuatorError> {
            if self.broken == Some(gpu) {
                return Err(ActuatorError::Failed {
                    gpu,
                    what: "the power cap",
                    reason: "the test's broken board".into(),
                });
            }
            self.sets += 1;
            self.caps[gpu as usize] = watts;
            Ok(watts)
        }
        fn set_sm_clock_lock(
            &mut self,
            _gpu: u32,
            _range: Option<(u32, u32)>,
        ) -> Result<(), ActuatorError> {
            unreachable!("the fence never touches clocks")
        }
        fn set_mem_clock_lock(
            &mut self,
            _gpu: u32,
            _range: Option<(u32, u32)>,
        ) -> Result<(), ActuatorError> {
            unreachable!("the fence never touches clocks")
        }
    }

    #[test]
    fn caps_over_the_reserve_are_lowered_in_proportion_and_none_is_raised() {
        let mut boards = Boards::at(&[700.0, 700.0, 300.0, 200.0]);
        let applied = apply_reserve(&mut boards, 1200.0).expect("applied");
        assert!(
            boards.sum() <= 1200.0 && boards.sum() > 1199.9,
            "{boards:?}"
        );
        assert_eq!(applied.after_w, boards.sum());
        assert_eq!(applied.before_w, 1900.0);
        assert!(!applied.unmet);
        // The 700 W boards had 500 W of room each, the 300 W one 100 W, the 200 W none.
        assert!(boards.caps[0] < 700.0 && (boards.caps[0] - boards.caps[1]).abs() < 1e-9);
        assert!(boards.caps[2] < 300.0 && boards.caps[2] >= 200.0);
        assert_eq!(boards.caps[3], 200.0);
        assert_eq!(applied.lowered.len(), 3);
    }

    #[test]
    fn caps_within_the_reserve_are_left_alone() {
        let mut boards = Boards::at(&[300.0, 300.0]);
        let applied = apply_reserve(&mut boards, 1200.0).expect("applied");
        assert_eq!(boards.caps, [300.0, 300.0]);
        assert_eq!(boards.sets, 0, "nothing set: a fence never raises");
        assert!(applied.lowered.is_empty());
        assert!(
            applied.to_string().contains("nothing to lower"),
            "{applied}"
        );
    }

    #[test]
    fn a_reserve_below_the_lowest_caps_holds_every_gpu_at_its_lowest_and_says_so() {
        let mut boards = Boards::at(&[700.0, 700.0]);
        let applied = apply_reserve(&mut boards, 300.0).expect("applied");
        assert_eq!(boards.caps, [200.0, 200.0]);
        assert!(applied.unmet);
        assert!(applied.to_string().contains("lowest"), "{applied}");
    }

    #[test]
    fn a_board_that_refuses_is_named_and_the_others_are_still_lowered() {
        let mut boards = Boards::at(&[700.0, 700.0]);
        boards.broken = Some(0);
        let error = apply_reserve(&mut boards, 800.0).expect_err("one board refused");
        assert!(error.to_string().contains("GPU 0"), "{error}");
        assert_eq!(boards.caps[0], 700.0);
        assert_eq!(boards.caps[1], 400.0);
    }

    #[test]
    fn a_reserve_that_is_not_a_wattage_is_refused() {
        let mut boards = Boards::at(&[700.0]);
        for reserve in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                apply_reserve(&mut boards, reserve),
                Err(FenceError::BadReserve { .. })
            ));
        }
        assert_eq!(boards.sets, 0);
    }
}
