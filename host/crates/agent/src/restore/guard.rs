//! Saving before the first change and restoring at the end: [`OriginalSettings`] for a
//! loop that owns its actuator, and [`SettingsGuard`], an actuator that wraps another and
//! also restores when dropped — at the end of a run, and while a panic unwinds.

use std::fmt;

use super::RestoreError;
use super::apply::{apply, load_leftover, settle};
use super::report::RestoreReport;
use super::report::Setting;
use super::state_file::{Changed, SavedGpu, StateFile};
use tokwatt_core::actuator::{Actuator, ActuatorError, Capabilities, GpuSettings};
use tokwatt_core::types::DeviceInfo;

/// The original settings of a run: saved to the state file before the first change,
/// put back by [`OriginalSettings::restore`].
///
/// It does not hold the actuator, so a control loop that owns its actuator can call
/// [`OriginalSettings::save_before_change`] and then [`OriginalSettings::mark_changed`]
/// before each change (each saves once): a restore puts back only the settings marked. For
/// restore-on-drop, wrap the actuator in a [`SettingsGuard`] instead, which does both.
#[derive(Debug)]
pub struct OriginalSettings {
    state: StateFile,
    /// The originals, once saved.
    saved: Option<Vec<SavedGpu>>,
    /// A ceiling on the sum of the power caps put back (a fleet node's reserve).
    power_ceiling_w: Option<f64>,
}

impl OriginalSettings {
    /// Touches neither the GPUs nor the state file.
    pub fn new(state: StateFile) -> Self {
        Self {
            state,
            saved: None,
            power_ceiling_w: None,
        }
    }

    /// Whatever ends the run (a stop, a crash and `tokwatt restore`, the next start), the
    /// power caps put back sum to at most `watts`: the originals, lowered toward each
    /// GPU's minimum as the control loop fits them. A fleet node's reserve: a node never
    /// stops or restores at its board defaults, which would pass the domain's budget.
    pub fn with_power_ceiling(mut self, watts: f64) -> Self {
        self.power_ceiling_w = Some(watts);
        self
    }

    pub fn state_file(&self) -> &StateFile {
        &self.state
    }

    /// Save the settings of every GPU of `actuator` before the first change (later calls
    /// do nothing). Restores first what an earlier run left in the state file, and refuses
    /// while the tokwatt that wrote it still runs. On error, change nothing.
    pub fn save_before_change(&mut self, actuator: &mut dyn Actuator) -> Result<(), RestoreError> {
        if self.saved.is_some() {
            return Ok(());
        }
        if let Some(leftover) = load_leftover(&self.state)? {
            tracing::warn!(
                path = %self.state.path().display(),
                pid = leftover.pid,
                "an earlier run did not stop cleanly: restoring the GPU settings it saved"
            );
            let mut report = apply(&leftover.gpus, actuator);
            settle(&self.state, &leftover.gpus, &mut report)?;
            if !report.is_complete() {
                return Err(RestoreError::LeftoverNotRestored { report });
            }
        }
        let saved = actuator
            .devices()
            .iter()
            .enumerate()
            .map(|(position, device)| {
                let gpu = position as u32;
                actuator
                    .read(gpu)
                    .map(|original| SavedGpu {
                        uuid: device.uuid.clone(),
                        index: gpu,
                        original,
                        changed: Changed::default(),
                    })
                    .map_err(|source| RestoreError::ReadOriginal { gpu, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let saved = match self.power_ceiling_w {
            Some(ceiling) => within_ceiling(saved, &actuator.devices(), ceiling),
            None => saved,
        };
        self.state.save(&saved)?;
        tracing::info!(path = %self.state.path().display(), "original GPU settings saved");
        self.saved = Some(saved);
        Ok(())
    }

    /// Record, before the change, that `setting` of GPU `gpu` is about to change (in the
    /// state file the first time), so that a restore puts back only what tokwatt changed.
    pub fn mark_changed(&mut self, gpu: u32, setting: Setting) -> Result<(), RestoreError> {
        let Some(saved) = self.saved.as_mut() else {
            return Ok(());
        };
        let Some(position) = saved.iter().position(|saved_gpu| saved_gpu.index == gpu) else {
            return Ok(());
        };
        let before = saved[position].changed;
        if saved[position].changed.mark(setting)
            && let Err(error) = self.state.save(saved)
        {
            // Not on disk, so not changed: the caller changes nothing.
            saved[position].changed = before;
            return Err(error);
        }
        Ok(())
    }

    /// Whether originals are saved and not yet all restored.
    pub fn is_saved(&self) -> bool {
        self.saved.is_some()
    }

    /// Put the original settings back through `actuator` and delete the state file. Does
    /// nothing when nothing was saved or everything is already back; after a partial
    /// failure, a later call (or `tokwatt restore`) tries the rest again.
    pub fn restore(&mut self, actuator: &mut dyn Actuator) -> Result<RestoreReport, RestoreError> {
        let Some(saved) = self.saved.take() else {
            return Ok(RestoreReport::default());
        };
        let mut report = apply(&saved, actuator);
        let settled = settle(&self.state, &saved, &mut report);
        if !report.is_complete() {
            self.saved = Some(
                saved
                    .into_iter()
                    .zip(&report.gpus)
                    .filter(|(_, restore)| !restore.is_complete())
                    .map(|(saved_gpu, _)| saved_gpu)
                    .collect(),
            );
        }
        settled.map(|()| report)
    }
}

/// An actuator that saves the original settings before its first change and puts them
/// back when restored or dropped.
///
/// Wrap the run's actuator in it and change settings only through it: the first setter
/// call saves the originals (see [`OriginalSettings::save_before_change`]), then changes.
/// If saving fails, nothing is changed.
/// The saved settings with their power caps fitted within `ceiling_w` and marked changed,
/// so that every restore puts the fitted caps back whether or not the run changed them.
fn within_ceiling(
    mut saved: Vec<SavedGpu>,
    devices: &[tokwatt_core::types::DeviceInfo],
    ceiling_w: f64,
) -> Vec<SavedGpu> {
    let caps: Vec<f64> = saved.iter().map(|s| s.original.power_cap_w).collect();
    let min: Vec<f64> = saved
        .iter()
        .map(|s| {
            devices
                .get(s.index as usize)
                .map_or(s.original.power_cap_w, |d| d.power_cap_min_w)
        })
        .collect();
    let fit = crate::control::fit_caps(&caps, &min, ceiling_w);
    for (gpu, cap) in saved.iter_mut().zip(fit.caps) {
        gpu.original.power_cap_w = cap;
        gpu.original.power_cap_enforced_w = gpu.original.power_cap_enforced_w.min(cap);
        gpu.changed.power_cap = true;
    }
    saved
}

pub struct SettingsGuard {
    originals: OriginalSettings,
    actuator: Box<dyn Actuator>,
}

impl fmt::Debug for SettingsGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SettingsGuard")
            .field("originals", &self.originals)
            .field("actuator", &self.actuator.name())
            .finish()
    }
}

impl SettingsGuard {
    /// Wrap `actuator`. Touches neither the GPUs nor the state file.
    pub fn new(state: StateFile, actuator: Box<dyn Actuator>) -> Self {
        Self {
            originals: OriginalSettings::new(state),
            actuator,
        }
    }

    /// See [`OriginalSettings::with_power_ceiling`].
    pub fn with_power_ceiling(mut self, watts: f64) -> Self {
        self.originals.power_ceiling_w = Some(watts);
        self
    }

    /// Save the original settings now rather than at the first change.
    pub fn arm(&mut self) -> Result<(), RestoreError> {
        self.originals.save_before_change(self.actuator.as_mut())
    }

    /// Whether the originals have been saved (and not yet restored).
    pub fn is_armed(&self) -> bool {
        self.originals.is_saved()
    }

    /// Put the original settings back (idempotent; see [`OriginalSettings::restore`]).
    pub fn restore(&mut self) -> Result<RestoreReport, RestoreError> {
        self.originals.restore(self.actuator.as_mut())
    }

    /// The wrapped actuator.
    pub fn actuator(&self) -> &dyn Actuator {
        self.actuator.as_ref()
    }

    /// Save the originals if not yet saved, and record that `setting` is about to change.
    fn arm_for(
        &mut self,
        gpu: u32,
        setting: Setting,
        what: &'static str,
    ) -> Result<(), ActuatorError> {
        self.arm()
            .and_then(|()| self.originals.mark_changed(gpu, setting))
            .map_err(|error| ActuatorError::Failed {
                gpu,
                what,
                reason: format!(
                    "the original settings could not be saved, so nothing was changed: {error}"
                ),
            })
    }
}

impl Actuator for SettingsGuard {
    fn name(&self) -> &'static str {
        self.actuator.name()
    }
    fn applies_settings(&self) -> bool {
        self.actuator.applies_settings()
    }
    fn devices(&self) -> Vec<DeviceInfo> {
        self.actuator.devices()
    }
    fn capabilities(&self, gpu: u32) -> Capabilities {
        self.actuator.capabilities(gpu)
    }
    fn read(&mut self, gpu: u32) -> Result<GpuSettings, ActuatorError> {
        self.actuator.read(gpu)
    }
    fn set_power_cap(&mut self, gpu: u32, watts: f64) -> Result<f64, ActuatorError> {
        self.arm_for(gpu, Setting::PowerCap, "the power cap")?;
        self.actuator.set_power_cap(gpu, watts)
    }
    fn set_sm_clock_lock(
        &mut self,
        gpu: u32,
        range_mhz: Option<(u32, u32)>,
    ) -> Result<(), ActuatorError> {
        self.arm_for(gpu, Setting::SmClockLock, "the SM clock lock")?;
        self.actuator.set_sm_clock_lock(gpu, range_mhz)
    }
    fn set_mem_clock_lock(
        &mut self,
        gpu: u32,
        range_mhz: Option<(u32, u32)>,
    ) -> Result<(), ActuatorError> {
        self.arm_for(gpu, Setting::MemClockLock, "the memory clock lock")?;
        self.actuator.set_mem_clock_lock(gpu, range_mhz)
    }
}

impl Drop for SettingsGuard {
    fn drop(&mut self) {
        if !self.is_armed() {
            return;
        }
        match self.restore() {
            Ok(report) if report.is_complete() => {}
            Ok(report) => tracing::error!(
                path = %self.originals.state.path().display(),
                "GPU settings not fully restored; run `tokwatt restore`:\n{report}"
            ),
            Err(error) => tracing::error!("restoring GPU settings failed: {error}"),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use std::fs;
    use std::sync::Arc;

    use super::*;
    use crate::restore::test_support::{
        FakeActuator, Hardware, device, files_in, saved, state_in, stock,
    };
    use tokwatt_core::actuator::DryRun;

    #[test]
    fn a_fleet_nodes_guard_restores_its_caps_within_the_reserve_whatever_it_changed() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(2);
        let actuator = FakeActuator::new(&hardware, &["GPU-a", "GPU-b"]);
        // Two 700 W boards, a 1000 W reserve: each goes back to 500 W, not to 700 W.
        let mut guard =
            SettingsGuard::new(state_in(&dir), Box::new(actuator)).with_power_ceiling(1000.0);
        guard.arm().unwrap();
        let on_disk = state_in(&dir).load().unwrap().unwrap();
        let caps: Vec<f64> = on_disk.iter().map(|g| g.original.power_cap_w).collect();
        assert_eq!(
            caps,
            [500.0, 500.0],
            "what a crash's `tokwatt restore` puts back"
        );
        // Only a clock lock changes: the caps go to the reserve anyway.
        guard.set_sm_clock_lock(1, Some((1200, 1500))).unwrap();
        drop(guard);
        assert_eq!(
            hardware.get(0).power_cap_w + hardware.get(1).power_cap_w,
            1000.0
        );
        assert_eq!(hardware.get(1).sm_clock_lock_mhz, stock().sm_clock_lock_mhz);
    }

    #[test]
    fn guard_saves_before_the_first_change_and_restores_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(2);
        let actuator = FakeActuator::new(&hardware, &["GPU-a", "GPU-b"]);
        let mut guard = SettingsGuard::new(state_in(&dir), Box::new(actuator));
        // Reading is not a change: nothing saved yet.
        guard.read(0).unwrap();
        assert!(!guard.is_armed());
        assert_eq!(state_in(&dir).load().unwrap(), None);

        assert_eq!(guard.set_power_cap(0, 450.0).unwrap(), 450.0);
        guard.set_sm_clock_lock(1, Some((1200, 1500))).unwrap();
        guard.set_mem_clock_lock(1, Some((2201, 2201))).unwrap();
        assert!(guard.is_armed());
        // The file holds the settings from before the first change, and what changed.
        let on_disk = state_in(&dir).load().unwrap().unwrap();
        let locks = Changed {
            sm_clock_lock: true,
            mem_clock_lock: true,
            ..Changed::default()
        };
        assert_eq!(
            on_disk,
            vec![
                saved_changed("GPU-a", 0, stock(), POWER_CAP_ONLY),
                saved_changed("GPU-b", 1, stock(), locks)
            ]
        );
        assert_eq!(hardware.get(0).power_cap_w, 450.0);

        drop(guard);
        assert_eq!(hardware.get(0), stock());
        assert_eq!(hardware.get(1), stock());
        assert_eq!(state_in(&dir).load().unwrap(), None);
    }

    #[test]
    fn original_settings_work_beside_an_actuator_the_loop_owns() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(1);
        let mut actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        let mut originals = OriginalSettings::new(state_in(&dir));
        assert!(!originals.is_saved());

        originals.save_before_change(&mut actuator).unwrap();
        originals.mark_changed(0, Setting::PowerCap).unwrap();
        actuator.set_power_cap(0, 300.0).unwrap();
        // Before the next change: already saved, so the lowered cap is not taken as original.
        originals.save_before_change(&mut actuator).unwrap();
        originals.mark_changed(0, Setting::SmClockLock).unwrap();
        actuator.set_sm_clock_lock(0, Some((1500, 1500))).unwrap();
        let both = Changed {
            sm_clock_lock: true,
            ..POWER_CAP_ONLY
        };
        assert_eq!(
            originals.state_file().load().unwrap(),
            Some(vec![saved_changed("GPU-a", 0, stock(), both)])
        );

        let report = originals.restore(&mut actuator).unwrap();
        assert!(report.is_complete() && report.state_cleared, "{report}");
        assert_eq!(hardware.get(0), stock());
        assert!(!originals.is_saved());
    }

    #[test]
    fn explicit_restore_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(1);
        let actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        let changes = Arc::clone(&actuator.changes);
        let mut guard = SettingsGuard::new(state_in(&dir), Box::new(actuator));
        guard.set_power_cap(0, 300.0).unwrap();
        guard.set_power_cap(0, 350.0).unwrap();

        let report = guard.restore().unwrap();
        assert!(report.is_complete() && report.state_cleared, "{report}");
        assert_eq!(hardware.get(0), stock());
        let after_first = changes.lock().unwrap().len();
        let again = guard.restore().unwrap();
        assert!(again.gpus.is_empty());
        drop(guard);
        assert_eq!(changes.lock().unwrap().len(), after_first, "restored twice");
    }

    const POWER_CAP_ONLY: Changed = Changed {
        power_cap: true,
        sm_clock_lock: false,
        mem_clock_lock: false,
    };

    fn saved_changed(uuid: &str, index: u32, original: GpuSettings, changed: Changed) -> SavedGpu {
        SavedGpu {
            changed,
            ..saved(uuid, index, original)
        }
    }

    /// A clock lock someone else set survives a run that changed only the power cap, a
    /// crash of that run, and the restore after it.
    #[test]
    fn a_lock_tokwatt_never_changed_is_left_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(1);
        let mut operator = FakeActuator::new(&hardware, &["GPU-a"]);
        operator.set_sm_clock_lock(0, Some((1200, 1500))).unwrap();
        let theirs = hardware.get(0);

        let mut guard = SettingsGuard::new(
            state_in(&dir),
            Box::new(FakeActuator::new(&hardware, &["GPU-a"])),
        );
        guard.set_power_cap(0, 400.0).unwrap();
        drop(guard);
        assert_eq!(hardware.get(0), theirs);

        let mut crashed = SettingsGuard::new(
            state_in(&dir),
            Box::new(FakeActuator::new(&hardware, &["GPU-a"])),
        );
        crashed.set_power_cap(0, 350.0).unwrap();
        std::mem::forget(crashed);
        let mut next = FakeActuator::new(&hardware, &["GPU-a"]);
        let report = crate::restore::restore_all(&state_in(&dir), &mut next).unwrap();
        assert!(report.is_complete(), "{report}");
        assert_eq!(hardware.get(0), theirs);
    }

    #[test]
    fn guard_that_changed_nothing_writes_and_restores_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(1);
        let actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        let changes = Arc::clone(&actuator.changes);
        drop(SettingsGuard::new(state_in(&dir), Box::new(actuator)));
        assert!(changes.lock().unwrap().is_empty());
        assert_eq!(files_in(dir.path()), Vec::<String>::new());
    }

    #[test]
    fn the_next_run_restores_leftovers_before_saving_its_own_originals() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(1);
        let mut crashed = SettingsGuard::new(
            state_in(&dir),
            Box::new(FakeActuator::new(&hardware, &["GPU-a"])),
        );
        crashed.set_power_cap(0, 250.0).unwrap();
        std::mem::forget(crashed);

        let mut next = SettingsGuard::new(
            state_in(&dir),
            Box::new(FakeActuator::new(&hardware, &["GPU-a"])),
        );
        next.set_power_cap(0, 300.0).unwrap();
        // The saved original is the true one, not the crashed run's 250 W.
        assert_eq!(
            state_in(&dir).load().unwrap(),
            Some(vec![saved_changed("GPU-a", 0, stock(), POWER_CAP_ONLY)])
        );
        drop(next);
        assert_eq!(hardware.get(0), stock());
    }

    #[test]
    fn releasing_a_lock_the_gpu_cannot_have_is_nothing_to_undo() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(1);
        let mut actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        actuator.no_mem_locks = true;
        let mut guard = SettingsGuard::new(state_in(&dir), Box::new(actuator));
        guard.set_power_cap(0, 400.0).unwrap();
        assert!(guard.set_mem_clock_lock(0, Some((2201, 2201))).is_err());
        let report = guard.restore().unwrap();
        assert!(report.is_complete(), "{report}");
        let text = report.to_string();
        assert!(
            text.contains("memory clock lock -> no lock: nothing to undo"),
            "{text}"
        );
        assert!(
            text.contains("SM clock lock -> no lock: not changed by tokwatt"),
            "{text}"
        );
        assert_eq!(hardware.get(0), stock());
    }

    #[test]
    fn a_guard_that_cannot_save_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let blocked = dir.path().join("state.json");
        fs::create_dir(&blocked).unwrap();
        fs::write(blocked.join("keep"), "x").unwrap();
        let hardware = Hardware::new(1);
        let actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        let changes = Arc::clone(&actuator.changes);
        let mut guard = SettingsGuard::new(StateFile::new(&blocked), Box::new(actuator));
        let error = guard.set_power_cap(0, 300.0).unwrap_err();
        assert!(error.to_string().contains("nothing was changed"), "{error}");
        assert!(changes.lock().unwrap().is_empty());
        assert_eq!(hardware.get(0), stock());
    }

    #[test]
    fn guard_over_dry_run_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let original = GpuSettings {
            power_cap_w: 650.0,
            power_cap_enforced_w: 650.0,
            sm_clock_lock_mhz: Some((1400, 1980)),
            mem_clock_lock_mhz: None,
        };
        let dry = DryRun::new(vec![device(0, "GPU-a")], vec![original]);
        let mut guard = SettingsGuard::new(state_in(&dir), Box::new(dry));
        guard.set_power_cap(0, 400.0).unwrap();
        guard.set_sm_clock_lock(0, Some((1200, 1200))).unwrap();
        assert_eq!(guard.read(0).unwrap().power_cap_w, 400.0);
        let report = guard.restore().unwrap();
        assert!(report.is_complete(), "{report}");
        assert_eq!(guard.read(0).unwrap(), original);
    }

    #[test]
    fn a_panic_restores_the_settings_while_it_unwinds() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = Hardware::new(1);
        let actuator = FakeActuator::new(&hardware, &["GPU-a"]);
        let state = state_in(&dir);
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut guard = SettingsGuard::new(state.clone(), Box::new(actuator));
            guard.set_power_cap(0, 300.0).unwrap();
            guard.set_sm_clock_lock(0, Some((1500, 1500))).unwrap();
            assert_eq!(hardware.get(0).power_cap_w, 300.0);
            panic!("the control loop failed");
        }));
        assert!(run.is_err());
        assert_eq!(hardware.get(0), stock());
        assert_eq!(state.load().unwrap(), None);
    }
}
