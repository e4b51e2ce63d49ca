//! What a restore did, GPU by GPU and setting by setting, and how that reads for an
//! operator (`tokwatt restore` prints it; errors and logs quote it).

use std::fmt;

use serde::Serialize;

/// A setting a run may change and a restore puts back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Setting {
    PowerCap,
    SmClockLock,
    MemClockLock,
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::PowerCap => "power cap",
            Self::SmClockLock => "SM clock lock",
            Self::MemClockLock => "memory clock lock",
        })
    }
}

/// How one setting's restore went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "outcome", content = "detail")]
pub enum Outcome {
    Restored,
    /// The setting already had its original value.
    AlreadyInPlace,
    /// tokwatt never changed the setting, so it is left as whoever set it left it.
    NotChanged,
    /// The GPU cannot have the setting, so there is nothing to undo.
    NothingToUndo(String),
    Failed(String),
}

/// One setting of one GPU, put back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RestoreStep {
    pub setting: Setting,
    /// The original value, in words ("700 W", "no lock").
    pub original: String,
    pub outcome: Outcome,
}

/// What was done for one saved GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuRestore {
    pub uuid: String,
    /// Position when the settings were saved.
    pub saved_index: u32,
    /// Whether the GPU was found among the actuator's devices.
    pub found: bool,
    pub steps: Vec<RestoreStep>,
}

impl GpuRestore {
    pub fn is_complete(&self) -> bool {
        self.found
            && self
                .steps
                .iter()
                .all(|step| !matches!(step.outcome, Outcome::Failed(_)))
    }
}

/// What a restore did, GPU by GPU.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct RestoreReport {
    pub gpus: Vec<GpuRestore>,
    /// Whether the state file was deleted (everything restored).
    pub state_cleared: bool,
}

impl RestoreReport {
    /// Whether every saved setting is back.
    pub fn is_complete(&self) -> bool {
        self.gpus.iter().all(GpuRestore::is_complete)
    }
}

impl fmt::Display for RestoreReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.gpus.is_empty() {
            return writeln!(f, "nothing to restore");
        }
        for gpu in &self.gpus {
            if !gpu.found {
                writeln!(
                    f,
                    "GPU {} (was {}): not found, its settings were not restored",
                    gpu.uuid, gpu.saved_index
                )?;
                continue;
            }
            writeln!(f, "GPU {} (was {}):", gpu.uuid, gpu.saved_index)?;
            for step in &gpu.steps {
                let outcome = match &step.outcome {
                    Outcome::Restored => "restored".to_owned(),
                    Outcome::AlreadyInPlace => "already in place".to_owned(),
                    Outcome::NotChanged => "not changed by tokwatt: left as it is".to_owned(),
                    Outcome::NothingToUndo(why) => format!("nothing to undo ({why})"),
                    Outcome::Failed(why) => format!("FAILED: {why}"),
                };
                writeln!(f, "  {} -> {}: {outcome}", step.setting, step.original)?;
            }
        }
        Ok(())
    }
}

/// A clock lock in words: "1200-1500 MHz" or "no lock".
pub(super) fn describe_lock(lock: Option<(u32, u32)>) -> String {
    match lock {
        Some((lo, hi)) => format!("{lo}-{hi} MHz"),
        None => "no lock".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(setting: Setting, original: &str, outcome: Outcome) -> RestoreStep {
        RestoreStep {
            setting,
            original: original.into(),
            outcome,
        }
    }

    #[test]
    fn an_empty_report_says_there_was_nothing_to_restore() {
        let report = RestoreReport::default();
        assert!(report.is_complete());
        assert_eq!(report.to_string(), "nothing to restore\n");
    }

    #[test]
    fn every_outcome_reads_as_a_line_of_its_gpu() {
        let report = RestoreReport {
            gpus: vec![
                GpuRestore {
                    uuid: "GPU-a".into(),
                    saved_index: 0,
                    found: true,
                    steps: vec![
                        step(Setting::PowerCap, "700 W", Outcome::Restored),
                        step(
                            Setting::SmClockLock,
                            &describe_lock(Some((1200, 1500))),
                            Outcome::AlreadyInPlace,
                        ),
                        step(
                            Setting::MemClockLock,
                            &describe_lock(None),
                            Outcome::NothingToUndo("not on this GPU".into()),
                        ),
                    ],
                },
                GpuRestore {
                    uuid: "GPU-b".into(),
                    saved_index: 1,
                    found: true,
                    steps: vec![step(
                        Setting::PowerCap,
                        "450 W",
                        Outcome::Failed("not permitted".into()),
                    )],
                },
                GpuRestore {
                    uuid: "GPU-gone".into(),
                    saved_index: 2,
                    found: false,
                    steps: Vec::new(),
                },
            ],
            state_cleared: false,
        };
        assert_eq!(
            report.to_string(),
            "GPU GPU-a (was 0):\n\
             \x20 power cap -> 700 W: restored\n\
             \x20 SM clock lock -> 1200-1500 MHz: already in place\n\
             \x20 memory clock lock -> no lock: nothing to undo (not on this GPU)\n\
             GPU GPU-b (was 1):\n\
             \x20 power cap -> 450 W: FAILED: not permitted\n\
             GPU GPU-gone (was 2): not found, its settings were not restored\n"
        );
        assert!(report.gpus[0].is_complete());
        assert!(!report.gpus[1].is_complete(), "a failed step");
        assert!(!report.gpus[2].is_complete(), "a GPU not found");
        assert!(!report.is_complete());
    }
}
