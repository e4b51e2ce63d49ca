//! The SM clock table a device reports (`sm-clocks-mhz`, highest first).

use tokwatt_policy_sdk::DeviceFacts;

/// The highest clock the device supports (the one that releases a lock), if it reports any.
pub fn highest_clock(device: &DeviceFacts) -> Option<u32> {
    device.sm_clocks_mhz.iter().copied().max()
}

/// The highest supported clock at or below `mhz`; the lowest supported one when every
/// clock is above `mhz`. `None` when the device reports no clocks.
pub fn supported_clock_at_or_below(device: &DeviceFacts, mhz: u32) -> Option<u32> {
    let clocks = &device.sm_clocks_mhz;
    clocks
        .iter()
        .copied()
        .filter(|&clock| clock <= mhz)
        .max()
        .or_else(|| clocks.iter().copied().min())
}

/// The device's clocks sorted highest first without repeats, whatever order it gave them in.
pub fn clock_ladder(device: &DeviceFacts) -> Vec<u32> {
    let mut clocks = device.sm_clocks_mhz.clone();
    clocks.sort_unstable_by(|a, b| b.cmp(a));
    clocks.dedup();
    clocks
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_policy_sdk::testing;

    #[test]
    fn a_clock_is_fitted_down_to_a_supported_one_or_up_to_the_lowest() {
        let device = testing::h200(0);
        assert_eq!(highest_clock(&device), Some(1980));
        assert_eq!(supported_clock_at_or_below(&device, 1410), Some(1410));
        assert_eq!(supported_clock_at_or_below(&device, 1415), Some(1410));
        assert_eq!(supported_clock_at_or_below(&device, 5000), Some(1980));
        assert_eq!(supported_clock_at_or_below(&device, 100), Some(345));
        let mut none = device;
        none.sm_clocks_mhz.clear();
        assert_eq!(supported_clock_at_or_below(&none, 1410), None);
        assert_eq!(highest_clock(&none), None);
    }

    #[test]
    fn the_ladder_is_highest_first_without_repeats() {
        let mut device = testing::h200(0);
        device.sm_clocks_mhz = vec![1000, 1500, 1000, 1200];
        assert_eq!(clock_ladder(&device), vec![1500, 1200, 1000]);
    }
}
