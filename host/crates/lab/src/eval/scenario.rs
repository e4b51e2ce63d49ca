//! Judging scenarios: one file names the simulated GPU, the operator's objective, the
//! boards' sensor behaviour and the workload (a simulator scenario table), so a policy is
//! judged on exactly the work and the objective the file states.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use tokwatt_core::types::Objective;
use tokwatt_sim::{GpuProfile, Scenario};

/// Simulated time a judged run lasts when neither the file nor the command says.
pub const DEFAULT_DURATION_S: f64 = 1800.0;

#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("cannot read judging scenario {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("judging scenario {}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
    #[error(
        "no judging scenario in {}: give .toml files (the shipped set is host/scenarios/eval)",
        .0.display()
    )]
    Empty(PathBuf),
}

/// A validated judging scenario.
#[derive(Debug, Clone)]
pub struct EvalScenario {
    /// The file's stem, e.g. `h200-8b-latency`.
    pub name: String,
    pub path: PathBuf,
    pub description: String,
    /// The simulated GPU, with the file's sensor overrides applied.
    pub profile: GpuProfile,
    pub workload: Scenario,
    /// The operator's objective: it replaces each judged policy's own.
    pub objective: Objective,
    pub gpus: u32,
    pub duration_s: f64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScenarioFile {
    #[serde(default)]
    description: String,
    /// A built-in profile (`h200`, `h100`, `a100`) or a profile file, relative to this file.
    gpu: String,
    #[serde(default = "one")]
    gpus: u32,
    duration_s: Option<f64>,
    #[serde(default)]
    objective: Objective,
    #[serde(default)]
    sensor: SensorOverrides,
    /// A simulator scenario (the keys of `host/scenarios/phases.toml`).
    workload: toml::Table,
}

fn one() -> u32 {
    1
}

/// Noisy boards: the sensor's behaviour, overriding the profile's.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SensorOverrides {
    /// Largest per-board gain error of the power sensor (fraction, e.g. 0.05 for ±5 %).
    gain_error_max: Option<f64>,
    /// Multiplies the profile's instantaneous power noise (both terms).
    noise_scale: Option<f64>,
}

impl EvalScenario {
    pub fn load(path: &Path) -> Result<EvalScenario, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<EvalScenario, ScenarioError> {
        let invalid = |message: String| ScenarioError::Invalid {
            path: path.to_owned(),
            message,
        };
        let file: ScenarioFile = toml::from_str(text).map_err(|e| invalid(e.to_string()))?;
        let base = path.parent().unwrap_or(Path::new("."));
        let gpu = if GpuProfile::built_in_names().any(|n| n.eq_ignore_ascii_case(&file.gpu)) {
            file.gpu.clone()
        } else {
            base.join(&file.gpu).display().to_string()
        };
        let mut profile = GpuProfile::load(&gpu).map_err(|e| invalid(format!("`gpu`: {e}")))?;
        if let Some(gain) = file.sensor.gain_error_max {
            if !(0.0..0.5).contains(&gain) {
                return Err(invalid(format!(
                    "`sensor.gain_error_max` must lie in [0, 0.5) (got {gain}); 0.05 is the published ±5 %"
                )));
            }
            profile.nvml.gain_error_max = gain;
        }
        if let Some(scale) = file.sensor.noise_scale {
            if !(scale.is_finite() && (0.0..=100.0).contains(&scale)) {
                return Err(invalid(format!(
                    "`sensor.noise_scale` must lie in [0, 100] (got {scale})"
                )));
            }
            profile.nvml.instantaneous_noise_w *= scale;
            profile.nvml.instantaneous_noise_fraction *= scale;
        }
        // The workload table is a simulator scenario: parse it with the simulator's own
        // rules and errors, relative paths (a model file) resolved beside this file.
        let workload_text =
            toml::to_string(&file.workload).map_err(|e| invalid(format!("`workload`: {e}")))?;
        let mut workload =
            Scenario::from_toml_str(&workload_text, &format!("{} [workload]", path.display()))
                .map_err(|e| invalid(e.to_string()))?;
        // The memory rule the simulator applies, applied here too, so the oracle searches
        // the batch sizes the GPU can hold.
        let fits = tokwatt_core::model::max_batch_that_fits(
            &workload.model,
            workload.context_tokens,
            profile.memory_bytes(),
        )
        .map_err(|e| invalid(format!("`workload`: {e}")))?;
        workload.batch_size_max = workload.batch_size_max.min(fits);
        workload.initial_batch_size = workload.initial_batch_size.min(fits);
        let duration_s = file.duration_s.unwrap_or(DEFAULT_DURATION_S);
        if !duration_in_range(duration_s) {
            return Err(invalid(format!(
                "`duration_s` must lie between 10 s and a week (got {duration_s})"
            )));
        }
        if !(1..=64).contains(&file.gpus) {
            return Err(invalid(format!(
                "`gpus` must lie between 1 and 64 (got {})",
                file.gpus
            )));
        }
        for (key, value) in [
            ("tpot_p99_limit_ms", file.objective.tpot_p99_limit_ms),
            ("min_tokens_per_s", file.objective.min_tokens_per_s),
            (
                "queue_wait_p99_limit_ms",
                file.objective.queue_wait_p99_limit_ms,
            ),
            ("ttft_p99_limit_ms", file.objective.ttft_p99_limit_ms),
        ] {
            if let Some(v) = value
                && !(v.is_finite() && v >= 0.0)
            {
                return Err(invalid(format!(
                    "`objective.{key}` must be a non-negative number (got {v})"
                )));
            }
        }
        if file.objective.ttft_p99_limit_ms.is_some() && workload.requests.is_none() {
            return Err(invalid(
                "`objective.ttft_p99_limit_ms` needs requests with prompts: give the workload \
                 `prompt_tokens` (and `output_tokens` as a distribution or a number) instead of \
                 `context_tokens`, or drop the TTFT bound"
                    .into(),
            ));
        }
        Ok(EvalScenario {
            name: path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
            path: path.to_owned(),
            description: file.description,
            profile,
            workload,
            objective: file.objective,
            gpus: file.gpus,
            duration_s,
        })
    }

    /// Every `.toml` file of the given files and folders (a folder's files sorted by name).
    pub fn load_all(paths: &[PathBuf]) -> Result<Vec<EvalScenario>, ScenarioError> {
        let mut files = Vec::new();
        for path in paths {
            if path.is_dir() {
                let read = std::fs::read_dir(path).map_err(|source| ScenarioError::Read {
                    path: path.clone(),
                    source,
                })?;
                let mut found: Vec<PathBuf> = read
                    .filter_map(Result::ok)
                    .map(|entry| entry.path())
                    .filter(|p| p.extension().is_some_and(|e| e == "toml"))
                    .collect();
                if found.is_empty() {
                    return Err(ScenarioError::Empty(path.clone()));
                }
                found.sort();
                files.extend(found);
            } else {
                files.push(path.clone());
            }
        }
        files.iter().map(|p| Self::load(p)).collect()
    }

    /// The simulated time of each demand phase within the run: `(start_s, end_s, rate)`.
    pub fn phase_spans(&self, duration_s: f64) -> Vec<(f64, f64, f64)> {
        let phases = &self.workload.phases;
        phases
            .iter()
            .enumerate()
            .filter(|(_, p)| p.start_s < duration_s)
            .map(|(i, p)| {
                let end = phases
                    .get(i + 1)
                    .map_or(duration_s, |next| next.start_s.min(duration_s));
                (p.start_s, end, p.arrival_rps)
            })
            .collect()
    }
}

/// A judging run's simulated time: 10 s to a week, whether a scenario gives it or
/// `tokwatt eval --duration` does (each tick keeps a point of the report's series).
pub fn duration_in_range(duration_s: f64) -> bool {
    duration_s.is_finite() && (10.0..=7.0 * 86_400.0).contains(&duration_s)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
        gpu = "h100"
        [objective]
        tpot_p99_limit_ms = 30.0
        [sensor]
        gain_error_max = 0.05
        noise_scale = 2.0
        [workload]
        model = "llama-3.2-1b"
        context_tokens = 2048
        output_tokens = 128
        batch_size_max = 256
        [[workload.phases]]
        start_s = 0
        arrival_rps = 10.0
        [[workload.phases]]
        start_s = 600
        arrival_rps = 40.0
    "#;

    #[test]
    fn a_scenario_names_gpu_objective_sensor_and_workload() {
        let s = EvalScenario::parse(Path::new("dir/small.toml"), MINIMAL).unwrap();
        assert_eq!(s.name, "small");
        assert_eq!(s.profile.id, "h100");
        assert_eq!(s.profile.nvml.gain_error_max, 0.05);
        assert_eq!(s.objective.tpot_p99_limit_ms, Some(30.0));
        assert_eq!(s.workload.context_tokens, 2048);
        assert_eq!(s.duration_s, DEFAULT_DURATION_S);
        assert_eq!(
            s.phase_spans(900.0),
            vec![(0.0, 600.0, 10.0), (600.0, 900.0, 40.0)]
        );
        // A phase after the end is not part of a shorter run.
        assert_eq!(s.phase_spans(300.0), vec![(0.0, 300.0, 10.0)]);
    }

    #[test]
    fn bad_values_name_the_key() {
        let bad = MINIMAL.replace("gain_error_max = 0.05", "gain_error_max = 0.9");
        let error = EvalScenario::parse(Path::new("x.toml"), &bad).unwrap_err();
        assert!(
            error.to_string().contains("sensor.gain_error_max"),
            "{error}"
        );
        let bad = MINIMAL.replace("context_tokens = 2048", "context_tokens = 0");
        let error = EvalScenario::parse(Path::new("x.toml"), &bad).unwrap_err();
        assert!(error.to_string().contains("context_tokens"), "{error}");
        let bad = MINIMAL.replace("gpu = \"h100\"", "gpu = \"nope\"");
        let error = EvalScenario::parse(Path::new("x.toml"), &bad).unwrap_err();
        assert!(error.to_string().contains("`gpu`"), "{error}");
        let bad = format!("{MINIMAL}\nsurprise = 1");
        assert!(EvalScenario::parse(Path::new("x.toml"), &bad).is_err());
    }
}
