//! Scenarios: the workload a simulated GPU serves — model, request lengths, batch limits and
//! demand phases (Poisson arrivals), so a policy faces load that changes under it.
//!
//! Two layouts: requests with prompts (`prompt_tokens`, each request prefilled, then
//! decoded, its KV cache growing), or decode only (`context_tokens`: every sequence
//! decodes over a fixed context, no prompt to prefill).

use std::path::Path;

use serde::Deserialize;

use super::SimError;
use super::lengths::LengthDist;
use super::model::ModelShape;

/// Tokens one engine step may process when the file does not say: vLLM's
/// `max_num_batched_tokens` and SGLang's `chunked_prefill_size` for online serving on large
/// GPUs.
pub const DEFAULT_MAX_BATCHED_TOKENS: u32 = 8192;

/// The built-in scenario (also the example file `host/scenarios/phases.toml`).
const DEFAULT_SCENARIO: &str = include_str!("../../../scenarios/phases.toml");

/// A validated scenario.
#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    pub description: String,
    /// Preset name (or a model file's path, see [`ModelShape::load`]), or "custom" for a shape
    /// given in the file.
    pub model_name: String,
    pub model: ModelShape,
    /// Decode only: the KV-cache length every sequence attends over. With prompts: the
    /// mean context over a request's decode (mean prompt + half the mean output), for
    /// sizing the batch to the memory.
    pub context_tokens: u32,
    /// Decode only: the tokens each request generates. With prompts: the mean, rounded.
    pub output_tokens: u32,
    /// Prompt and output lengths drawn per request; `None` in the decode-only layout.
    pub requests: Option<RequestLengths>,
    /// Tokens one engine step may process: every decoding sequence's next token, then
    /// chunks of prompts (as vLLM's `max_num_batched_tokens`).
    pub max_batched_tokens: u32,
    /// Largest batch size the workload accepts.
    pub batch_size_max: u32,
    pub initial_batch_size: u32,
    /// Waiting requests beyond this are turned away.
    pub queue_max: u32,
    /// Demand phases, by start time (the first starts at 0).
    pub phases: Vec<Phase>,
}

/// The lengths of the requests of a scenario with prompts.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestLengths {
    pub prompt: LengthDist,
    pub output: LengthDist,
}

/// From `start_s` on, requests arrive at `arrival_rps` (Poisson).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Phase {
    pub start_s: f64,
    pub arrival_rps: f64,
    /// A power limit held by something outside tokwatt during this phase (another tool,
    /// a firmware or out-of-band limit): the GPU enforces the lower of it and the
    /// requested cap, as NVML's enforced limit does.
    #[serde(default)]
    pub outside_power_limit_w: Option<f64>,
}

/// The file format.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScenarioFile {
    #[serde(default)]
    description: String,
    model: Option<String>,
    model_shape: Option<ModelShape>,
    context_tokens: Option<u32>,
    prompt_tokens: Option<toml::Value>,
    output_tokens: toml::Value,
    max_batched_tokens: Option<u32>,
    #[serde(default = "default_batch_size_max")]
    batch_size_max: u32,
    initial_batch_size: Option<u32>,
    #[serde(default = "default_queue_max")]
    queue_max: u32,
    phases: Vec<Phase>,
}

fn default_batch_size_max() -> u32 {
    512
}

fn default_queue_max() -> u32 {
    2048
}

/// What a simulator scenario's error adds when the file is a judging scenario.
const JUDGING_LAYOUT_HINT: &str = "\nthis file is a judging scenario (`gpu`, `duration_s`, \
    `[objective]`, `[workload]`), which `tokwatt eval --scenarios FILE` reads; `run \
    --scenario` takes a simulator scenario: the keys of its `[workload]` table at the top \
    level, with the GPU as `--sim`, the objective as `--ttft-p99-limit-ms`, \
    `--tpot-p99-limit-ms`, `--queue-wait-p99-limit-ms`, `--min-tokens-per-s` and the length \
    as `--duration` (the book's reference/scenarios.md names both layouts)";

/// Whether `text` is a judging scenario (its workload in a `[workload]` table), the layout
/// `eval` reads, handed to a reader of simulator scenarios.
fn is_judging_layout(text: &str) -> bool {
    toml::from_str::<toml::Table>(text)
        .is_ok_and(|table| table.get("workload").is_some_and(toml::Value::is_table))
}

impl Scenario {
    /// The built-in scenario (`host/scenarios/phases.toml`, embedded): saturating, then light,
    /// then medium load on llama-3-8b.
    pub fn built_in() -> Result<Scenario, SimError> {
        Self::from_toml_str(
            DEFAULT_SCENARIO,
            "built-in scenario (scenarios/phases.toml)",
        )
    }

    /// Load a scenario TOML file.
    pub fn load(path: impl AsRef<Path>) -> Result<Scenario, SimError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| SimError::Read {
            what: "scenario",
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// Parse and validate; `origin` names the scenario in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Scenario, SimError> {
        let file: ScenarioFile = toml::from_str(text).map_err(|e| SimError::Parse {
            what: "scenario",
            origin: origin.to_owned(),
            message: if is_judging_layout(text) {
                format!("{e}{JUDGING_LAYOUT_HINT}")
            } else {
                e.to_string()
            },
        })?;
        let invalid = |problem: String| SimError::Invalid {
            what: "scenario",
            origin: origin.to_owned(),
            problem,
        };
        let (model_name, model) = match (file.model, file.model_shape) {
            (Some(name), None) => {
                let shape = ModelShape::load(&name)?;
                (name, shape)
            }
            (None, Some(mut shape)) => {
                shape.name = "custom".to_owned();
                shape.validate().map_err(|e| invalid(e.to_string()))?;
                ("custom".to_owned(), shape)
            }
            _ => {
                return Err(invalid(
                    "give either model = \"<preset>\" or a [model_shape] table, not both or neither"
                        .to_owned(),
                ));
            }
        };
        let (context_tokens, output_tokens, requests) =
            Self::lengths(file.context_tokens, file.prompt_tokens, &file.output_tokens)
                .map_err(invalid)?;
        let scenario = Scenario {
            description: file.description,
            model_name,
            model,
            context_tokens,
            output_tokens,
            requests,
            max_batched_tokens: file
                .max_batched_tokens
                .unwrap_or(DEFAULT_MAX_BATCHED_TOKENS),
            batch_size_max: file.batch_size_max,
            initial_batch_size: file.initial_batch_size.unwrap_or(file.batch_size_max),
            queue_max: file.queue_max,
            phases: file.phases,
        };
        scenario.validate().map_err(invalid)?;
        Ok(scenario)
    }

    /// The layout's lengths: (context, output, drawn lengths) of a decode-only file
    /// (`context_tokens`, a fixed `output_tokens`) or of one with prompts.
    fn lengths(
        context: Option<u32>,
        prompt: Option<toml::Value>,
        output: &toml::Value,
    ) -> Result<(u32, u32, Option<RequestLengths>), String> {
        match (context, prompt) {
            (Some(_), Some(_)) => Err(
                "give `prompt_tokens` (requests with prompts: prefilled, then decoded) or \
                 `context_tokens` (decode only, over a fixed context), not both"
                    .to_owned(),
            ),
            (None, None) => Err(
                "give `prompt_tokens` (requests with prompts: prefilled, then decoded) or \
                 `context_tokens` (decode only, over a fixed context)"
                    .to_owned(),
            ),
            (Some(context), None) => match output.as_integer() {
                Some(n) => Ok((context, u32::try_from(n).unwrap_or(0), None)),
                None => Err(
                    "a decode-only scenario (`context_tokens`) generates a fixed `output_tokens`: \
                     give a number, or give `prompt_tokens` to draw lengths per request"
                        .to_owned(),
                ),
            },
            (None, Some(prompt)) => {
                let prompt = LengthDist::parse("prompt_tokens", &prompt)?;
                let output = LengthDist::parse("output_tokens", output)?;
                let mean_output = output.mean();
                let context = (prompt.mean() + mean_output / 2.0).round();
                Ok((
                    context.clamp(1.0, f64::from(u32::MAX)) as u32,
                    mean_output.round().max(1.0) as u32,
                    Some(RequestLengths { prompt, output }),
                ))
            }
        }
    }

    /// The longest context one sequence can reach (its whole prompt and output).
    pub fn longest_context_tokens(&self) -> u32 {
        match &self.requests {
            Some(lengths) => lengths.prompt.max().saturating_add(lengths.output.max()),
            None => self.context_tokens,
        }
    }

    /// The same work from `offset_s` on: the phase in force then starts at 0, later ones
    /// move earlier by `offset_s`. A simulation of it is the original's from that moment,
    /// with an empty queue.
    pub fn starting_at(&self, offset_s: f64) -> Scenario {
        let offset_s = offset_s.max(0.0);
        let in_force = self
            .phases
            .iter()
            .rposition(|p| p.start_s <= offset_s)
            .unwrap_or(0);
        let phases = self.phases[in_force..]
            .iter()
            .map(|p| Phase {
                start_s: (p.start_s - offset_s).max(0.0),
                ..*p
            })
            .collect();
        Scenario {
            phases,
            ..self.clone()
        }
    }

    /// When the last phase starts: from then on the work no longer changes.
    pub fn last_change_s(&self) -> f64 {
        self.phases.last().map_or(0.0, |p| p.start_s)
    }

    /// Check every value; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        self.model.validate().map_err(|e| e.to_string())?;
        if !(1..=1_048_576).contains(&self.context_tokens) {
            return Err(format!(
                "context_tokens must lie between 1 and 1048576 (got {})",
                self.context_tokens
            ));
        }
        if self.output_tokens == 0 {
            return Err("output_tokens must be at least 1".to_owned());
        }
        if !(1..=1_048_576).contains(&self.max_batched_tokens) {
            return Err(format!(
                "max_batched_tokens must lie between 1 and 1048576 (got {})",
                self.max_batched_tokens
            ));
        }
        if !(1..=65_536).contains(&self.batch_size_max) {
            return Err(format!(
                "batch_size_max must lie between 1 and 65536 (got {})",
                self.batch_size_max
            ));
        }
        if !(1..=self.batch_size_max).contains(&self.initial_batch_size) {
            return Err(format!(
                "initial_batch_size must lie between 1 and batch_size_max ({}) (got {})",
                self.batch_size_max, self.initial_batch_size
            ));
        }
        if self.queue_max > 1_000_000 {
            return Err(format!(
                "queue_max must be at most 1000000 (got {})",
                self.queue_max
            ));
        }
        let Some(first) = self.phases.first() else {
            return Err("give at least one [[phases]] entry (start_s, arrival_rps)".to_owned());
        };
        if first.start_s != 0.0 {
            return Err(format!(
                "the first phase must start at start_s = 0 (got {})",
                first.start_s
            ));
        }
        for (i, phase) in self.phases.iter().enumerate() {
            if !(phase.arrival_rps.is_finite() && (0.0..=1e6).contains(&phase.arrival_rps)) {
                return Err(format!(
                    "phases[{i}].arrival_rps must lie between 0 and 1000000 (got {})",
                    phase.arrival_rps
                ));
            }
            if !phase.start_s.is_finite() {
                return Err(format!("phases[{i}].start_s must be a number"));
            }
            if let Some(watts) = phase.outside_power_limit_w
                && !(watts.is_finite() && watts > 0.0)
            {
                return Err(format!(
                    "phases[{i}].outside_power_limit_w must be a positive number of watts (got {watts})"
                ));
            }
        }
        if let Some(i) = self
            .phases
            .windows(2)
            .position(|pair| pair[1].start_s <= pair[0].start_s)
        {
            return Err(format!(
                "phases must start in increasing order: phases[{}] starts at {} s, not after phases[{i}] at {} s",
                i + 1,
                self.phases[i + 1].start_s,
                self.phases[i].start_s
            ));
        }
        Ok(())
    }

    /// Arrival rate in force at time `t_s`.
    pub fn arrival_rps_at(&self, t_s: f64) -> f64 {
        self.phase_at(t_s).map_or(0.0, |phase| phase.arrival_rps)
    }

    /// The outside power limit in force at time `t_s`, if any.
    pub fn outside_power_limit_at(&self, t_s: f64) -> Option<f64> {
        self.phase_at(t_s)
            .and_then(|phase| phase.outside_power_limit_w)
    }

    fn phase_at(&self, t_s: f64) -> Option<&Phase> {
        self.phases
            .iter()
            .take_while(|phase| phase.start_s <= t_s)
            .last()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    #[test]
    fn a_scenario_started_later_keeps_the_phase_in_force_and_moves_the_rest() {
        let built_in = Scenario::built_in().unwrap();
        let rates = |s: &Scenario| -> Vec<(f64, f64)> {
            s.phases
                .iter()
                .map(|p| (p.start_s, p.arrival_rps))
                .collect()
        };
        assert_eq!(
            rates(&built_in.starting_at(900.0)),
            [(0.0, 5.0), (300.0, 30.0)]
        );
        assert_eq!(rates(&built_in.starting_at(0.0)), rates(&built_in));
        assert_eq!(rates(&built_in.starting_at(5000.0)), [(0.0, 30.0)]);
        assert_eq!(built_in.last_change_s(), 1200.0);
        built_in.starting_at(900.0).validate().unwrap();
    }

    #[test]
    fn the_built_in_scenario_is_the_example_file_and_has_three_phases() {
        let scenario = Scenario::built_in().unwrap();
        let example = Scenario::from_toml_str(DEFAULT_SCENARIO, "phases.toml").unwrap();
        assert_eq!(scenario, example);
        assert_eq!(scenario.model_name, "llama-3-8b");
        assert_eq!(scenario.phases.len(), 3);
        assert_eq!(scenario.arrival_rps_at(0.0), 45.0);
        assert_eq!(scenario.arrival_rps_at(599.9), 45.0);
        assert_eq!(scenario.arrival_rps_at(600.0), 5.0);
        assert_eq!(scenario.arrival_rps_at(5000.0), 30.0);
    }

    #[test]
    fn defaults_apply_and_a_custom_shape_is_accepted() {
        let text = r#"
            context_tokens = 2048
            output_tokens = 64
            [model_shape]
            hidden = 1024
            layers = 4
            heads = 8
            kv_heads = 2
            head_dim = 128
            mlp = 4096
            vocab = 32000
            [[phases]]
            start_s = 0
            arrival_rps = 1
        "#;
        let scenario = Scenario::from_toml_str(text, "custom.toml").unwrap();
        assert_eq!(scenario.model_name, "custom");
        assert_eq!(
            (scenario.batch_size_max, scenario.initial_batch_size),
            (512, 512)
        );
        assert_eq!(scenario.queue_max, 2048);
    }

    fn error_for(text: &str) -> String {
        Scenario::from_toml_str(text, "bad.toml")
            .unwrap_err()
            .to_string()
    }

    const VALID_HEAD: &str = "model = \"llama-3-8b\"\ncontext_tokens = 1024\noutput_tokens = 16\n";

    #[test]
    fn bad_scenarios_give_clear_errors() {
        let err = error_for("model = \"llama-3-8b\"\ncontext_tokens = [\n");
        assert!(
            err.starts_with("scenario file bad.toml is not valid:"),
            "{err}"
        );

        let err = error_for(&format!(
            "{VALID_HEAD}[[phases]]\nstart_s = 5\narrival_rps = 1\n"
        ));
        assert_eq!(
            err,
            "scenario bad.toml: the first phase must start at start_s = 0 (got 5)"
        );

        let err = error_for(&format!(
            "{VALID_HEAD}[[phases]]\nstart_s = 0\narrival_rps = 1\n[[phases]]\nstart_s = 0\narrival_rps = 2\n"
        ));
        assert!(
            err.contains("phases must start in increasing order"),
            "{err}"
        );

        let err = error_for(&format!(
            "{VALID_HEAD}[[phases]]\nstart_s = 0\narrival_rps = -1\n"
        ));
        assert!(
            err.contains("phases[0].arrival_rps must lie between 0 and 1000000 (got -1)"),
            "{err}"
        );

        let err = error_for(&format!(
            "{VALID_HEAD}batch_size_max = 64\ninitial_batch_size = 65\n[[phases]]\nstart_s = 0\narrival_rps = 1\n"
        ));
        assert!(
            err.contains("initial_batch_size must lie between 1 and batch_size_max (64) (got 65)"),
            "{err}"
        );

        let err = error_for(&format!("{VALID_HEAD}phases = []\n"));
        assert!(err.contains("at least one [[phases]]"), "{err}");

        let err =
            error_for("model = \"llama-9\"\ncontext_tokens = 1\noutput_tokens = 1\nphases = []\n");
        assert!(err.contains("unknown model 'llama-9'"), "{err}");

        let err = error_for(&format!("{VALID_HEAD}arrival_rate = 3\nphases = []\n"));
        assert!(err.contains("arrival_rate"), "{err}");
    }

    #[test]
    fn a_missing_file_is_named_in_the_error() {
        let err = Scenario::load("/nonexistent/scenario.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cannot read scenario file /nonexistent/scenario.toml"),
            "{err}"
        );
    }
}
