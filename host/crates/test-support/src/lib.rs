//! How tokwatt's tests behave where something they need is missing: they skip, printing
//! why, unless the run requires it. One rule for every `TOKWATT_REQUIRE_…` variable (set to
//! anything but empty or `0`: `.ci/run` sets them all, `scripts/gpu-check.sh` sets
//! `TOKWATT_REQUIRE_GPU` on the GPU machine); there a skip is a failure, so a test never
//! passes silently on the machine meant to run it.
//!
//! A dev-dependency only: no product crate links it. It also holds [`NativePolicy`], a
//! policy whose `decide` is a closure, for the control loop's tests, [`EtcdCluster`],
//! a real etcd cluster on loopback for the fleet's (over TLS too), and [`TestPki`], the
//! certificates for that, made with openssl, and [`RedfishEmulator`], a BMC on loopback
//! (sushy-tools) for the fleet's off-node fence and the ClusterLabs fence agents.

use std::fmt::Display;

pub mod etcd;
mod native_policy;
mod pki;
pub mod redfish;
pub use etcd::{EtcdCluster, REQUIRE_ETCD_VAR, ServerTls};
pub use native_policy::NativePolicy;
pub use pki::TestPki;
pub use redfish::{FakeSystem, REQUIRE_FENCE_AGENTS_VAR, RedfishEmulator, fence_agent};

// `crate::supervisor` in `native_policy.rs`, which the policy crate also compiles as its own.
use tokwatt_policy::supervisor;

/// The variable that turns every GPU-test skip into a failure.
pub const REQUIRE_GPU_VAR: &str = "TOKWATT_REQUIRE_GPU";

/// The variable that runs the slowest end-to-end tests (each a minute or more on two
/// cores: building every plugin crate natively, building a scaffolded policy, the A/B
/// error-rate studies); `.ci/run` sets it.
pub const SLOW_TESTS: &str = "TOKWATT_SLOW_TESTS";

/// A free loopback port (free when asked: whoever binds it does so a moment later).
///
/// # Panics
///
/// Where no loopback port can be bound.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// Whether `done` holds within `patience`, asking every 10 ms.
pub fn eventually(patience: std::time::Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < patience {
        if done() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    done()
}

/// Waits until `done` holds, at most `patience`.
///
/// # Panics
///
/// When `patience` passes first, naming `what` was waited for.
#[track_caller]
pub fn wait_for(what: &str, patience: std::time::Duration, done: impl FnMut() -> bool) {
    assert!(eventually(patience, done), "timed out waiting for {what}");
}

/// Whether the run requires what `var` stands for (`var` set to anything but empty or
/// `0`): a missing tool or GPU then fails its test instead of skipping it. The one
/// reading of every such variable.
pub fn required(var: &str) -> bool {
    means_required(std::env::var_os(var).as_deref())
}

fn means_required(value: Option<&std::ffi::OsStr>) -> bool {
    value.is_some_and(|value| !value.is_empty() && value != "0")
}

/// Skips a test for `reason` (printed), or fails it where [`required`]`(var)`.
///
/// # Panics
///
/// Where [`required`]`(var)`.
#[track_caller]
pub fn skip_unless_required(var: &str, reason: impl Display) {
    assert!(
        !required(var),
        "{var} is set but this test would skip: {reason}"
    );
    println!("skipped: {reason}");
}

/// Whether this test run must have a GPU ([`REQUIRE_GPU_VAR`] by [`required`]'s rule).
pub fn gpu_required() -> bool {
    required(REQUIRE_GPU_VAR)
}

/// Skips a GPU test for `reason`: prints it, or fails where a GPU is required.
///
/// # Panics
///
/// Where [`gpu_required`].
#[track_caller]
pub fn skip_gpu(reason: impl Display) {
    skip_unless_required(REQUIRE_GPU_VAR, reason);
}

/// Whether a slow test runs: where [`SLOW_TESTS`] is set (by [`required`]'s rule); else
/// prints why `what` is skipped.
pub fn run_slow(what: &str) -> bool {
    if required(SLOW_TESTS) {
        return true;
    }
    println!("skipped: {what} is a slow test (set {SLOW_TESTS}=1 to run it; CI does)");
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_fails_where_the_thing_is_required() {
        // A variable no one sets: the skip passes.
        skip_unless_required("TOKWATT_REQUIRE_NOTHING_AT_ALL", "nothing here");
        // PATH is set on every machine, so it reads as required: the skip must fail.
        let failed = std::panic::catch_unwind(|| skip_unless_required("PATH", "no GPU here"));
        assert!(failed.is_err(), "a required test must not pass by skipping");
    }

    #[test]
    fn empty_and_zero_mean_not_required() {
        // The values, not the environment (tests run in parallel threads).
        let value = |text: &'static str| means_required(Some(std::ffi::OsStr::new(text)));
        assert!(!means_required(None));
        assert!(!value(""));
        assert!(!value("0"));
        assert!(value("1"));
        assert!(value("yes"));
    }
}
