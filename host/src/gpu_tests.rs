//! How tests that need a GPU behave where there is none: they skip themselves, printing
//! why — except where `TOKWATT_REQUIRE_GPU=1` is set (`scripts/gpu-check.sh` sets it on
//! the GPU machine). There a skip is a failure, so a GPU test never passes silently on
//! the machine that is meant to run it.

use std::fmt::Display;

/// The variable that turns every GPU-test skip into a failure.
pub const REQUIRE_GPU_VAR: &str = "TOKWATT_REQUIRE_GPU";

/// Whether this test run must have a GPU (`TOKWATT_REQUIRE_GPU` set to anything but
/// empty or `0`).
pub fn gpu_required() -> bool {
    std::env::var_os(REQUIRE_GPU_VAR).is_some_and(|value| !value.is_empty() && value != "0")
}

/// Skip a GPU test for `reason`: prints it, or panics where a GPU is required.
///
/// # Panics
///
/// Where [`gpu_required`] is true.
#[track_caller]
pub fn skip(reason: impl Display) {
    skip_unless_required(gpu_required(), reason);
}

#[track_caller]
fn skip_unless_required(required: bool, reason: impl Display) {
    assert!(
        !required,
        "{REQUIRE_GPU_VAR} is set but this GPU test would skip: {reason}"
    );
    println!("skipping: {reason}");
}

/// Whether an NVML failure means "no NVIDIA driver here" (a reason to skip), as opposed
/// to a driver that is present and failing (a reason to fail).
pub fn no_driver(error: &crate::nvml::NvmlError) -> bool {
    matches!(
        error,
        crate::nvml::NvmlError::LibraryNotLoaded { .. } | crate::nvml::NvmlError::DriverNotLoaded
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_fails_where_a_gpu_is_required() {
        skip_unless_required(false, "no GPU here");
        let failed = std::panic::catch_unwind(|| skip_unless_required(true, "no GPU here"));
        assert!(
            failed.is_err(),
            "a required GPU test must not pass by skipping"
        );
    }

    #[test]
    fn no_driver_is_only_a_missing_driver() {
        use crate::nvml::NvmlError;
        assert!(no_driver(&NvmlError::LibraryNotLoaded {
            detail: String::new()
        }));
        assert!(no_driver(&NvmlError::DriverNotLoaded));
        assert!(!no_driver(&NvmlError::AccessDenied));
        assert!(!no_driver(&NvmlError::NoGpus));
    }
}
