//! `GpuProfile::from_toml_str` on arbitrary text: an error or a valid profile, never a
//! panic; and a profile that validates yields sane clock lists.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokwatt_sim::GpuProfile;

fuzz_target!(|text: &str| {
    if let Ok(profile) = GpuProfile::from_toml_str(text, "fuzz") {
        let sm = profile.sm_clocks_mhz();
        assert!(!sm.is_empty(), "a valid profile has SM clocks");
        assert!(sm.windows(2).all(|w| w[0] > w[1]), "highest first: {sm:?}");
        assert_eq!(profile.sm_max_mhz(), sm[0]);
        let _ = profile.mem_clocks_mhz();
        let _ = profile.mem_max_mhz();
    }
});
