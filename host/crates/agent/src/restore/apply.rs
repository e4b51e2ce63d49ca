//! The restore itself: put every saved setting back, GPU by GPU (matched by UUID), then
//! settle the state file — delete it when everything is back, otherwise keep only what is
//! left to do, so that `tokwatt restore` can try again.

use super::RestoreError;
use super::owner::owned_by_other_live_process;
use super::report::{GpuRestore, Outcome, RestoreReport, RestoreStep, Setting, describe_lock};
use super::state_file::{SavedGpu, StateDocument, StateFile};
use tokwatt_core::actuator::{Actuator, ActuatorError};

/// Power limits closer than this are the same (NVML works in milliwatts).
const POWER_TOLERANCE_W: f64 = 0.5;

/// Put one GPU's saved settings back through `actuator` (GPU `gpu` there).
fn restore_gpu(actuator: &mut dyn Actuator, gpu: u32, saved: &SavedGpu) -> Vec<RestoreStep> {
    let original = saved.original;
    let outcome_of = |result: Result<(), ActuatorError>, undoing_a_lock: bool| match result {
        Ok(()) => Outcome::Restored,
        // A GPU that cannot lock clocks has no lock to release.
        Err(ActuatorError::NotSupported { reason, .. }) if undoing_a_lock => {
            Outcome::NothingToUndo(reason)
        }
        Err(error) => Outcome::Failed(error.to_string()),
    };

    let changed = saved.changed;
    let power = match actuator.read(gpu) {
        _ if !changed.power_cap => Outcome::NotChanged,
        Ok(now) if (now.power_cap_w - original.power_cap_w).abs() < POWER_TOLERANCE_W => {
            Outcome::AlreadyInPlace
        }
        _ => outcome_of(
            actuator
                .set_power_cap(gpu, original.power_cap_w)
                .map(|_enforced| ()),
            false,
        ),
    };
    // NVML cannot report clock locks, so a lock tokwatt changed is always put back (a
    // reset when there was none); one it never changed is left to whoever set it.
    let sm = if changed.sm_clock_lock {
        outcome_of(
            actuator.set_sm_clock_lock(gpu, original.sm_clock_lock_mhz),
            original.sm_clock_lock_mhz.is_none(),
        )
    } else {
        Outcome::NotChanged
    };
    let mem = if changed.mem_clock_lock {
        outcome_of(
            actuator.set_mem_clock_lock(gpu, original.mem_clock_lock_mhz),
            original.mem_clock_lock_mhz.is_none(),
        )
    } else {
        Outcome::NotChanged
    };
    vec![
        RestoreStep {
            setting: Setting::PowerCap,
            original: format!("{:.0} W", original.power_cap_w),
            outcome: power,
        },
        RestoreStep {
            setting: Setting::SmClockLock,
            original: describe_lock(original.sm_clock_lock_mhz),
            outcome: sm,
        },
        RestoreStep {
            setting: Setting::MemClockLock,
            original: describe_lock(original.mem_clock_lock_mhz),
            outcome: mem,
        },
    ]
}

/// Put back every saved setting, matching GPUs by UUID.
pub(super) fn apply(saved: &[SavedGpu], actuator: &mut dyn Actuator) -> RestoreReport {
    let devices = actuator.devices();
    let gpus = saved
        .iter()
        .map(|saved_gpu| {
            let position = devices.iter().position(|d| d.uuid == saved_gpu.uuid);
            let steps = match position {
                Some(position) => restore_gpu(actuator, position as u32, saved_gpu),
                None => Vec::new(),
            };
            let restore = GpuRestore {
                uuid: saved_gpu.uuid.clone(),
                saved_index: saved_gpu.index,
                found: position.is_some(),
                steps,
            };
            if restore.is_complete() {
                tracing::info!(uuid = %restore.uuid, "original GPU settings restored");
            } else {
                tracing::error!(uuid = %restore.uuid, "original GPU settings not fully restored: {restore:?}");
            }
            restore
        })
        .collect();
    RestoreReport {
        gpus,
        state_cleared: false,
    }
}

/// Write back what is still to restore: delete the file when everything is back, otherwise
/// keep only the GPUs that are not.
pub(super) fn settle(
    state: &StateFile,
    saved: &[SavedGpu],
    report: &mut RestoreReport,
) -> Result<(), RestoreError> {
    if report.is_complete() {
        state.clear()?;
        report.state_cleared = true;
    } else {
        let remaining: Vec<SavedGpu> = saved
            .iter()
            .zip(&report.gpus)
            .filter(|(_, restore)| !restore.is_complete())
            .map(|(saved_gpu, _)| saved_gpu.clone())
            .collect();
        state.save(&remaining)?;
    }
    Ok(())
}

/// Put back every setting saved in `state` through `actuator` (matching GPUs by UUID via
/// `actuator.devices()`). Deletes the file only when everything was restored; otherwise
/// it keeps the GPUs still to do, so `tokwatt restore` can try again.
pub fn restore_all(
    state: &StateFile,
    actuator: &mut dyn Actuator,
) -> Result<RestoreReport, RestoreError> {
    let Some(document) = load_leftover(state)? else {
        return Ok(RestoreReport::default());
    };
    let mut report = apply(&document.gpus, actuator);
    settle(state, &document.gpus, &mut report)?;
    Ok(report)
}

/// What a run that is not running any more left in `state`, or `None` when there is no
/// file. Refuses while the tokwatt that wrote the file still runs: its settings are its
/// own to restore.
pub(super) fn load_leftover(state: &StateFile) -> Result<Option<StateDocument>, RestoreError> {
    let Some(document) = state.load_document()? else {
        return Ok(None);
    };
    if owned_by_other_live_process(document.pid) {
        return Err(RestoreError::OwnerRunning {
            path: state.path().to_path_buf(),
            pid: document.pid,
        });
    }
    Ok(Some(document))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use std::fs;
    use std::io;
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::restore::SettingsGuard;
    use crate::restore::state_file::FORMAT_VERSION;
    use crate::restore::test_support::{FakeActuator, Hardware, saved, state_in, stock};
    use tokwatt_core::actuator::GpuSettings;

    #[test]
    fn a_crashed_run_is_restored_by_the_next_process() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(2);
        let mut crashed = SettingsGuard::new(
            state_in(&dir),
            Box::new(FakeActuator::new(&hardware, &["GPU-a", "GPU-b"])),
        );
        crashed.set_power_cap(1, 250.0).unwrap();
        crashed.set_sm_clock_lock(0, Some((1500, 1500))).unwrap();
        // kill -9: no destructor runs.
        std::mem::forget(crashed);
        assert_eq!(hardware.get(1).power_cap_w, 250.0);

        // A new process, whose NVML numbers the GPUs the other way round.
        let mut next = FakeActuator::new(&hardware, &["GPU-b", "GPU-a"]);
        next.hardware = Hardware(Arc::new(Mutex::new(vec![hardware.get(1), hardware.get(0)])));
        let swapped = next.hardware.clone();
        let report = restore_all(&state_in(&dir), &mut next).unwrap();
        assert!(report.is_complete() && report.state_cleared, "{report}");
        assert_eq!(swapped.get(0), stock());
        assert_eq!(swapped.get(1), stock());
        assert_eq!(state_in(&dir).load().unwrap(), None);
        let text = report.to_string();
        assert!(text.contains("GPU GPU-b (was 1):"), "{text}");
        assert!(text.contains("power cap -> 700 W: restored"), "{text}");
        assert!(
            text.contains("SM clock lock -> no lock: restored"),
            "{text}"
        );
    }

    #[test]
    fn restore_all_without_a_file_does_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(1);
        let mut actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        let report = restore_all(&state_in(&dir), &mut actuator).unwrap();
        assert!(report.gpus.is_empty() && report.is_complete());
        assert_eq!(report.to_string(), "nothing to restore\n");
        assert!(actuator.changes.lock().unwrap().is_empty());
    }

    #[test]
    fn a_power_cap_already_in_place_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_in(&dir);
        state.save(&[saved("GPU-a", 0, stock())]).unwrap();
        let hardware = Hardware::new(1);
        let mut actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        let report = restore_all(&state, &mut actuator).unwrap();
        assert!(report.is_complete() && report.state_cleared, "{report}");
        assert_eq!(report.gpus[0].steps[0].outcome, Outcome::AlreadyInPlace);
        let changes = actuator.changes.lock().unwrap().clone();
        assert!(
            changes.iter().all(|change| !change.contains("power")),
            "{changes:?}"
        );
    }

    #[test]
    fn an_incomplete_restore_keeps_what_is_left_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_in(&dir);
        let lowered = GpuSettings {
            power_cap_w: 300.0,
            ..stock()
        };
        let hardware = Hardware(Arc::new(Mutex::new(vec![lowered, lowered])));
        state
            .save(&[
                saved("GPU-a", 0, stock()),
                saved("GPU-b", 1, stock()),
                saved("GPU-gone", 2, stock()),
            ])
            .unwrap();

        let mut actuator = FakeActuator::new(&hardware, &["GPU-a", "GPU-b"]);
        actuator.deny_power = true;
        let report = restore_all(&state, &mut actuator).unwrap();
        assert!(!report.is_complete() && !report.state_cleared);
        let text = report.to_string();
        assert!(text.contains("FAILED"), "{text}");
        assert!(text.contains("GPU GPU-gone (was 2): not found"), "{text}");
        assert_eq!(state.load().unwrap().map(|g| g.len()), Some(3));

        // Privileges back: the GPUs present are restored, the missing one stays on file.
        actuator.deny_power = false;
        let report = restore_all(&state, &mut actuator).unwrap();
        assert!(!report.is_complete());
        assert_eq!(hardware.get(0), stock());
        assert_eq!(hardware.get(1), stock());
        assert_eq!(
            state.load().unwrap(),
            Some(vec![saved("GPU-gone", 2, stock())])
        );
    }

    #[test]
    fn a_file_it_cannot_read_changes_no_gpu_and_stays_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_in(&dir);
        let hardware = Hardware::new(1);
        for text in [
            "{\"format\": 1, \"gpus\": [",
            "{\"format\": 7}",
            "[1, 2, 3]",
        ] {
            fs::write(state.path(), text).unwrap();
            let mut actuator = FakeActuator::new(&hardware, &["GPU-a"]);
            let error = restore_all(&state, &mut actuator).unwrap_err();
            assert!(
                matches!(
                    error,
                    RestoreError::Corrupt { .. }
                        | RestoreError::UnsupportedFormat { .. }
                        | RestoreError::Foreign { .. }
                ),
                "{text}: {error}"
            );
            assert!(actuator.changes.lock().unwrap().is_empty(), "{text}");
            assert_eq!(fs::read_to_string(state.path()).unwrap(), text);
        }
    }

    const HELPER: &str = "restore::apply::tests::helper_live_until_stdin_closes";

    #[test]
    #[ignore = "helper process for a_live_owner_blocks_restore_until_it_exits"]
    fn helper_live_until_stdin_closes() {
        if std::env::var_os("TOKWATT_TEST_HELPER").is_some() {
            let _ = io::Read::read_to_end(&mut io::stdin(), &mut Vec::new());
        }
    }

    #[test]
    fn a_live_owner_blocks_restore_until_it_exits() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_in(&dir);
        // Another process of this same program stands in for a running tokwatt.
        let mut owner = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", HELPER, "--ignored"])
            .env("TOKWATT_TEST_HELPER", "1")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // The child's process name settles only once its exec has completed.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !owned_by_other_live_process(owner.id()) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let document = StateDocument {
            format: FORMAT_VERSION,
            pid: owner.id(),
            written_by: "test".into(),
            gpus: vec![saved("GPU-a", 0, stock())],
        };
        fs::write(state.path(), serde_json::to_vec(&document).unwrap()).unwrap();
        let hardware = Hardware(Arc::new(Mutex::new(vec![GpuSettings {
            power_cap_w: 300.0,
            ..stock()
        }])));

        let mut actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        let error = restore_all(&state, &mut actuator).unwrap_err();
        assert!(
            matches!(error, RestoreError::OwnerRunning { .. }),
            "{error}"
        );
        assert!(error.to_string().contains("Stop it first"), "{error}");
        let mut guard = SettingsGuard::new(state.clone(), Box::new(actuator));
        assert!(guard.set_power_cap(0, 400.0).is_err());
        assert_eq!(
            hardware.get(0).power_cap_w,
            300.0,
            "changed under a live owner"
        );

        drop(owner.stdin.take());
        owner.wait().unwrap();
        let mut actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        let report = restore_all(&state, &mut actuator).unwrap();
        assert!(report.is_complete() && report.state_cleared, "{report}");
        assert_eq!(hardware.get(0), stock());
        drop(guard);
    }
}
