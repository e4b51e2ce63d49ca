//! What a GPU accepts: one rule for every backend. The NVML actuator checks a request
//! with it before calling the driver, and the simulator refuses what it refuses, so code
//! tested on the simulator is not refused on a GPU for a setting the simulator let pass.
//!
//! The rule is NVML's, as documented for `nvmlDeviceSetPowerManagementLimit` (milliwatts
//! within the constraints `nvmlDeviceGetPowerManagementLimitConstraints` reports) and
//! `nvmlDeviceSetGpuLockedClocks` / `nvmlDeviceSetMemoryLockedClocks` (a range within the
//! supported clocks), made strict where the driver's behaviour is not documented: a lock
//! range must hold at least one supported clock.

/// Why a GPU refuses a setting.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Refused {
    #[error("{0} W is not a power")]
    NotAPower(f64),
    #[error("{watts} W is outside this GPU's power-limit range {min_w:.0}-{max_w:.0} W")]
    CapOutOfRange { watts: f64, min_w: f64, max_w: f64 },
    #[error("the lock range {lo}-{hi} MHz is reversed (its minimum is above its maximum)")]
    Reversed { lo: u32, hi: u32 },
    #[error("the lock range {lo}-{hi} MHz is outside the supported {lowest}-{highest} MHz")]
    OutsideSupported {
        lo: u32,
        hi: u32,
        lowest: u32,
        highest: u32,
    },
    #[error(
        "no supported clock lies within {lo}-{hi} MHz: widen the range to hold one of the supported clocks ({lowest}-{highest} MHz)"
    )]
    NoSupportedClockWithin {
        lo: u32,
        hi: u32,
        lowest: u32,
        highest: u32,
    },
}

/// One setting request, as an actuator receives it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Request {
    PowerCap(f64),
    SmClockLock(u32, u32),
    MemClockLock(u32, u32),
}

/// Whether a GPU with `device`'s facts accepts `request`, by the shared rule.
pub fn check(device: &crate::types::DeviceInfo, request: Request) -> Result<(), Refused> {
    match request {
        Request::PowerCap(watts) => {
            power_cap_milliwatts(device.power_cap_min_w, device.power_cap_max_w, watts).map(|_| ())
        }
        Request::SmClockLock(lo, hi) => clock_lock(&device.sm_clocks_mhz, lo, hi).map(|_| ()),
        Request::MemClockLock(lo, hi) => clock_lock(&device.mem_clocks_mhz, lo, hi).map(|_| ()),
    }
}

/// A power cap in NVML's milliwatts, if `watts` lies within `min_w..=max_w`.
pub fn power_cap_milliwatts(min_w: f64, max_w: f64, watts: f64) -> Result<u32, Refused> {
    if !watts.is_finite() {
        return Err(Refused::NotAPower(watts));
    }
    if !(min_w..=max_w).contains(&watts) {
        return Err(Refused::CapOutOfRange {
            watts,
            min_w,
            max_w,
        });
    }
    // In range, so finite, non-negative and far below u32::MAX milliwatts.
    Ok((watts * 1000.0).round() as u32)
}

/// A clock lock range checked against the supported clocks (highest first, as NVML lists
/// them): the lowest and highest supported clocks it holds, which is where the clock can
/// be. With no supported clocks known, only the order is checked and the range stands.
pub fn clock_lock(supported: &[u32], lo: u32, hi: u32) -> Result<(u32, u32), Refused> {
    if lo > hi {
        return Err(Refused::Reversed { lo, hi });
    }
    let (Some(&highest), Some(&lowest)) = (supported.first(), supported.last()) else {
        return Ok((lo, hi));
    };
    if lo < lowest || hi > highest {
        return Err(Refused::OutsideSupported {
            lo,
            hi,
            lowest,
            highest,
        });
    }
    let mut inside = supported.iter().copied().filter(|f| (lo..=hi).contains(f));
    let top = inside.next().ok_or(Refused::NoSupportedClockWithin {
        lo,
        hi,
        lowest,
        highest,
    })?;
    let bottom = inside.next_back().unwrap_or(top);
    Ok((bottom, top))
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200_SM: [u32; 5] = [1980, 1500, 1200, 800, 345];

    #[test]
    fn caps_are_accepted_within_the_range_in_milliwatts() {
        assert_eq!(power_cap_milliwatts(200.0, 700.0, 450.25), Ok(450_250));
        assert_eq!(power_cap_milliwatts(200.0, 700.0, 700.0), Ok(700_000));
        assert!(matches!(
            power_cap_milliwatts(200.0, 700.0, 800.0),
            Err(Refused::CapOutOfRange { .. })
        ));
        assert!(matches!(
            power_cap_milliwatts(200.0, 700.0, f64::NAN),
            Err(Refused::NotAPower(_))
        ));
    }

    #[test]
    fn a_lock_must_lie_within_the_supported_clocks_and_hold_one() {
        assert_eq!(clock_lock(&H200_SM, 345, 1980), Ok((345, 1980)));
        assert_eq!(clock_lock(&H200_SM, 1100, 1600), Ok((1200, 1500)));
        assert_eq!(clock_lock(&H200_SM, 1500, 1500), Ok((1500, 1500)));
        assert!(matches!(
            clock_lock(&H200_SM, 1500, 1200),
            Err(Refused::Reversed { .. })
        ));
        // Overlapping the supported span is not enough: NVML refuses what leaves it.
        let high = clock_lock(&H200_SM, 1500, 2100).unwrap_err();
        assert!(high.to_string().contains("345-1980 MHz"), "{high}");
        assert!(matches!(
            clock_lock(&H200_SM, 100, 400),
            Err(Refused::OutsideSupported { .. })
        ));
        assert!(matches!(
            clock_lock(&H200_SM, 1250, 1400),
            Err(Refused::NoSupportedClockWithin { .. })
        ));
        // Unknown supported clocks: only the order is checked.
        assert_eq!(clock_lock(&[], 100, 200), Ok((100, 200)));
    }
}
