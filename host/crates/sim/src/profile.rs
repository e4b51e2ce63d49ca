//! GPU profiles: everything the simulator knows about one GPU model, as data.
//!
//! The built-in profiles are the TOML files in `host/profiles/`, embedded at build time; each
//! cites the measurements or datasheet figures its constants come from. A user profile is any
//! TOML file of the same shape.

use std::path::Path;

use serde::Deserialize;

use super::SimError;

const BUILT_IN: [(&str, &str); 3] = [
    ("a100", include_str!("../../../profiles/a100.toml")),
    ("h100", include_str!("../../../profiles/h100.toml")),
    ("h200", include_str!("../../../profiles/h200.toml")),
];

/// One GPU model: device constraints, the constants of the decode power and step-time model
/// (see [`super::model`]), NVML's reporting behaviour and a thermal model.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuProfile {
    /// Short identifier, used in simulated UUIDs (`SIM-<id>-<index>`).
    pub id: String,
    /// Marketing name, reported as the device name.
    pub name: String,
    pub calibration: Calibration,
    pub power_cap: PowerCapRange,
    pub clocks: Clocks,
    pub idle: Idle,
    pub memory: Memory,
    pub decode: DecodeConstants,
    /// Prompt processing; a profile without it gets [`PrefillConstants::scaled_from`] its
    /// decode constants (see [`GpuProfile::prefill`]).
    #[serde(default)]
    pub prefill: Option<PrefillConstants>,
    /// The serving loop's steps (decoding rows beside prompt chunks, no CUDA graph), fitted
    /// to `tokwatt bench serving-steps`; without it a serving step is costed from
    /// `[decode]` and `[prefill]`, the closed-loop and whole-prompt tables.
    #[serde(default)]
    pub serving: Option<ServingConstants>,
    pub power: PowerConstants,
    pub nvml: NvmlBehaviour,
    pub thermal: Thermal,
}

/// Where the constants come from, for labelling output.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// Whether the constants were fitted to measurements of this GPU model.
    pub measured: bool,
    /// What they were fitted to, e.g. "measured H200 data (driver 580.159.04, 2026-11-29)".
    pub source: String,
}

/// Power limit constraints, watts (NVML's power management limit constraints).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PowerCapRange {
    pub min_w: f64,
    pub default_w: f64,
    pub max_w: f64,
}

/// Supported clocks. SM clocks are either listed (`sm_mhz`) or given as a grid
/// (`sm_min_mhz`, `sm_max_mhz`, `sm_step_mhz`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Clocks {
    pub sm_mhz: Option<Vec<u32>>,
    pub sm_min_mhz: Option<u32>,
    pub sm_max_mhz: Option<u32>,
    pub sm_step_mhz: Option<u32>,
    /// Supported memory clocks.
    pub mem_mhz: Vec<u32>,
    /// SM clock when no work runs.
    pub idle_sm_mhz: u32,
}

/// The idle state (a CUDA context, no work).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Idle {
    pub power_w: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Memory {
    /// Datasheet peak memory bandwidth, TB/s (the denominator of memory utilisation).
    pub peak_bandwidth_tbs: f64,
    /// Device memory, GB (10^9 bytes), as on the datasheet: weights and KV cache must fit
    /// (see [`tokwatt_core::model::fit_batch`]).
    pub size_gb: f64,
}

/// Step-time constants of the decode model.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeConstants {
    /// Launch gaps and small kernels, per transformer layer, microseconds.
    pub overhead_per_layer_us: f64,
    /// Effective bandwidth when streaming the weights, TB/s.
    pub weights_bandwidth_tbs: f64,
    /// Effective bandwidth when reading the KV cache, TB/s.
    pub kv_bandwidth_tbs: f64,
    /// Effective tensor rate of the decode GEMMs at the highest SM clock, TFLOP/s.
    pub tensor_tflops: f64,
    /// Exponent `p` of the smooth roofline `(t_w^p + t_c^p)^(1/p)` (large: a hard max).
    pub roofline_sharpness: f64,
    /// SM clock below which memory-bound work slows with the clock, MHz.
    pub knee_mhz: f64,
}

/// Constants of prompt processing (prefill): large GEMMs over many tokens a step,
/// compute-bound where decode is bound by memory.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillConstants {
    /// Launch gaps and small kernels per layer of a step that carries a prompt chunk (engines
    /// replay CUDA graphs for decode-only steps, not for these), microseconds.
    pub overhead_per_layer_us: f64,
    /// Effective tensor rate of the prefill GEMMs at the highest SM clock, TFLOP/s.
    pub tensor_tflops: f64,
    /// Causal attention's rate relative to `tensor_tflops` (flash attention on long
    /// prompts runs below the GEMMs' rate).
    pub attention_efficiency: f64,
    /// SM activity per second of prefill arithmetic, relative to decode's arithmetic in
    /// `power.core_w` (large GEMMs keep the tensor cores fed with less switching per FLOP).
    pub core_activity: f64,
}

/// Constants of one serving step as the serving loop runs it (tokwatt's CUDA engine:
/// every step launched without a CUDA graph, decoding rows and prompt tokens through the
/// same GEMMs and the same attention kernel), fitted to measured steps. The weights' stream,
/// the roofline and the power constants stay the profile's.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServingConstants {
    /// Launch gaps, small kernels and the host's share of a step (its plan, uploads and the
    /// wait for it), per transformer layer, microseconds.
    pub overhead_per_layer_us: f64,
    /// Effective bandwidth of the decoding rows' KV-cache reads, TB/s.
    pub kv_bandwidth_tbs: f64,
    /// A decoding row's attention reads its cache with a few blocks (one per KV head), so
    /// the longest row's positions times this (all layers, nanoseconds per position) add
    /// to the rows' shared read at `kv_bandwidth_tbs`; 0 (the default): that read alone.
    #[serde(default)]
    pub row_attention_ns_per_position: f64,
    /// Effective tensor rate of the step's GEMMs (decoding rows and prompt tokens), TFLOP/s.
    pub tensor_tflops: f64,
    /// Prompt attention's rate relative to `tensor_tflops`.
    pub attention_efficiency: f64,
    /// SM activity per second of prompt arithmetic, relative to decode's arithmetic in
    /// `power.core_w` (as `[prefill]`'s).
    pub core_activity: f64,
    /// The prompt tokens' GEMMs in a step of `M` tokens (its prompt tokens and decoding
    /// rows, one GEMM) run at `M / (M + gemm_ramp_tokens)` of `tensor_tflops`: a small chunk
    /// fills the tensor cores' tiles less, takes longer per token and draws less per second
    /// than a large one. 0 (the default): every chunk at `tensor_tflops`.
    #[serde(default)]
    pub gemm_ramp_tokens: f64,
    /// At one clock, the prompt GEMMs of a step of `M` tokens draw `(M / 4096)^this` of the
    /// core power their busy time would (`core_activity` holds at 4,096 tokens): a GEMM over
    /// more rows keeps more of the tensor cores switching at once. Where a profile's steps
    /// under the cap run slower clocks the larger they are at the same attention per token,
    /// the busy time alone cannot give it. 0 (the default): no such term.
    #[serde(default)]
    pub gemm_power_exponent: f64,
}

impl PrefillConstants {
    /// The built-in H200's fitted prefill constants relative to its decode constants,
    /// applied to another profile's: a starting point where nothing was measured.
    pub fn scaled_from(decode: &DecodeConstants) -> Self {
        Self {
            overhead_per_layer_us: decode.overhead_per_layer_us * (80.0 / 42.54),
            tensor_tflops: decode.tensor_tflops * (780.0 / 850.3),
            attention_efficiency: 0.8,
            core_activity: 0.65,
        }
    }
}

/// Power constants of the decode model, watts at the highest SM clock.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PowerConstants {
    pub p0_w: f64,
    /// Clock tree and idle SMs: scales with `x·v²`.
    pub clock_w: f64,
    /// Memory traffic at the peak bandwidth.
    pub memory_w: f64,
    /// SM activity at full utilisation: scales with `x·v²`.
    pub core_w: f64,
    /// Activity of the SMs while they stream memory (relative to full tensor activity).
    pub stream_activity: f64,
    /// Slope of the relative voltage against the relative clock: `v = 1 - slope·(1 - x)`.
    pub voltage_slope: f64,
    /// Lowest relative voltage.
    pub v_min: f64,
}

impl PowerConstants {
    /// `x·v²` at relative clock `x = f / f_max`: how clocked power scales.
    pub fn clock_factor(&self, x: f64) -> f64 {
        let v = (1.0 - self.voltage_slope * (1.0 - x)).max(self.v_min);
        x * v * v
    }
}

/// How NVML reports power and energy.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvmlBehaviour {
    /// Update period of the energy counter and the power readings, seconds.
    pub energy_update_s: f64,
    /// Length of the boxcar behind the averaged power reading, seconds.
    pub power_average_window_s: f64,
    /// Noise of the instantaneous reading: `noise_w + noise_fraction·(P - idle)` (standard deviation).
    pub instantaneous_noise_w: f64,
    pub instantaneous_noise_fraction: f64,
    /// Time for the SM clock to reach a new target (95 %), seconds.
    pub settle_s: f64,
    /// Time for the SM clock to fall to a lower target (95 %), seconds, where the firmware
    /// pulls it down faster than it raises it (its power control acts within a step that
    /// draws more than the cap); `None`: `settle_s` both ways.
    #[serde(default)]
    pub throttle_s: Option<f64>,
    /// Largest per-board gain error of the power sensor (fraction): a board without a fixed
    /// `gain` draws one, uniform in `1 ± gain_error_max`, from the seed and its index.
    pub gain_error_max: f64,
    /// Fixed sensor gains: one for every board, or a list by board index (boards past its end
    /// draw theirs). NVML reads `gain ×` the true power; the power limiter acts on that reading.
    #[serde(default)]
    pub gain: Option<SensorGain>,
    /// Lognormal sigma of the decode step time.
    pub step_time_jitter: f64,
}

/// Fixed power-sensor gains (`[nvml] gain = 1.0` or `gain = [1.0, 1.03]`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum SensorGain {
    Every(f64),
    PerBoard(Vec<f64>),
}

impl NvmlBehaviour {
    /// Board `index`'s fixed gain, if the profile gives one.
    pub fn fixed_gain(&self, index: u32) -> Option<f64> {
        match &self.gain {
            None => None,
            Some(SensorGain::Every(gain)) => Some(*gain),
            Some(SensorGain::PerBoard(gains)) => gains.get(index as usize).copied(),
        }
    }

    pub(crate) fn fixed_gains(&self) -> &[f64] {
        match &self.gain {
            None => &[],
            Some(SensorGain::Every(gain)) => std::slice::from_ref(gain),
            Some(SensorGain::PerBoard(gains)) => gains,
        }
    }
}

/// First-order thermal model: `T → ambient + resistance·P` with a time constant.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Thermal {
    pub ambient_c: f64,
    pub resistance_c_per_w: f64,
    pub time_constant_s: f64,
}

impl GpuProfile {
    /// Names of the built-in profiles.
    pub fn built_in_names() -> impl Iterator<Item = &'static str> {
        BUILT_IN.iter().map(|(name, _)| *name)
    }

    /// A built-in profile by name (`a100`, `h100`, `h200`, any case), else the profile in the
    /// TOML file at `name_or_path`.
    pub fn load(name_or_path: &str) -> Result<GpuProfile, SimError> {
        let wanted = name_or_path.trim().to_ascii_lowercase();
        if let Some((name, text)) = BUILT_IN.iter().find(|(name, _)| *name == wanted) {
            return Self::from_toml_str(text, &format!("built-in profile '{name}'"));
        }
        let path = Path::new(name_or_path);
        if !path.is_file() {
            // Something that looks like a file name is a missing file, not an unknown name.
            let looks_like_a_path = name_or_path.contains(['/', '\\', '.']);
            return Err(if looks_like_a_path {
                SimError::ProfileNotFound(path.to_path_buf())
            } else {
                SimError::UnknownProfile(name_or_path.to_owned())
            });
        }
        let text = std::fs::read_to_string(path).map_err(|source| SimError::Read {
            what: "GPU profile",
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// Parse and validate a profile; `origin` names it in errors (a path or "built-in profile 'x'").
    pub fn from_toml_str(text: &str, origin: &str) -> Result<GpuProfile, SimError> {
        let profile: GpuProfile = toml::from_str(text).map_err(|e| SimError::Parse {
            what: "GPU profile",
            origin: origin.to_owned(),
            message: e.to_string(),
        })?;
        profile.validate().map_err(|problem| SimError::Invalid {
            what: "GPU profile",
            origin: origin.to_owned(),
            problem,
        })?;
        Ok(profile)
    }

    /// Supported SM clocks, highest first.
    pub fn sm_clocks_mhz(&self) -> Vec<u32> {
        let mut clocks = match (
            &self.clocks.sm_mhz,
            self.clocks.sm_min_mhz,
            self.clocks.sm_max_mhz,
            self.clocks.sm_step_mhz,
        ) {
            (Some(list), ..) => list.clone(),
            (None, Some(min), Some(max), Some(step)) if step > 0 && min <= max => (0..)
                .map(|i| max.saturating_sub(i * step))
                .take_while(|&f| f >= min && f > 0)
                .take(100_000)
                .collect(),
            _ => Vec::new(),
        };
        clocks.sort_unstable_by(|a, b| b.cmp(a));
        clocks.dedup();
        clocks
    }

    /// Supported memory clocks, highest first.
    pub fn mem_clocks_mhz(&self) -> Vec<u32> {
        let mut clocks = self.clocks.mem_mhz.clone();
        clocks.sort_unstable_by(|a, b| b.cmp(a));
        clocks.dedup();
        clocks
    }

    /// The decode model's power with nothing to run, at the idle SM clock: `p0 + clock·x·v²`
    /// (the model's `point` with no active sequence).
    pub fn model_idle_power_w(&self) -> f64 {
        let x = f64::from(self.clocks.idle_sm_mhz) / f64::from(self.sm_max_mhz().max(1));
        self.power.p0_w + self.power.clock_w * self.power.clock_factor(x)
    }

    /// The decode model's power flat out: the highest clock, memory at its peak bandwidth and the
    /// SMs fully busy (`u_m = u_c = 1`). No decode step draws more before the limiter acts.
    pub fn model_full_load_power_w(&self) -> f64 {
        let p = &self.power;
        p.p0_w + p.clock_w + p.memory_w + p.core_w
    }

    /// Device memory, bytes.
    pub fn memory_bytes(&self) -> u64 {
        (self.memory.size_gb * 1e9) as u64
    }

    /// Highest supported SM clock, MHz.
    pub fn sm_max_mhz(&self) -> u32 {
        self.sm_clocks_mhz().first().copied().unwrap_or(0)
    }

    /// Highest supported memory clock, MHz.
    pub fn mem_max_mhz(&self) -> u32 {
        self.mem_clocks_mhz().first().copied().unwrap_or(0)
    }

    /// The profile's prefill constants, or ones scaled from its decode constants.
    pub fn prefill(&self) -> PrefillConstants {
        self.prefill
            .unwrap_or_else(|| PrefillConstants::scaled_from(&self.decode))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    #[test]
    fn built_in_profiles_load_and_describe_their_devices() {
        for name in GpuProfile::built_in_names() {
            let profile = GpuProfile::load(name).unwrap();
            assert_eq!(profile.id, name);
            assert!(!profile.sm_clocks_mhz().is_empty());
        }
        let h200 = GpuProfile::load("H200").unwrap();
        let clocks = h200.sm_clocks_mhz();
        assert_eq!(clocks.len(), 110, "probe: 110 graphics clocks");
        assert_eq!((clocks[0], clocks[109]), (1980, 345));
        assert_eq!(h200.mem_clocks_mhz(), vec![3201, 2201]);
        assert!(h200.calibration.measured);
        assert!(!GpuProfile::load("h100").unwrap().calibration.measured);
        assert!(!GpuProfile::load("a100").unwrap().calibration.measured);
    }

    #[test]
    fn unknown_name_that_is_not_a_file_says_what_is_available() {
        let err = GpuProfile::load("b300").unwrap_err().to_string();
        assert_eq!(
            err,
            "unknown GPU profile 'b300': built-in profiles are a100, h100, h200; or pass the path of a profile TOML file"
        );
    }

    #[test]
    fn bad_toml_names_the_file_and_the_parser_message() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("broken.toml");
        std::fs::write(&path, "id = \"x\"\nname = [unclosed\n").unwrap();
        let err = GpuProfile::load(path.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("broken.toml"), "{err}");
        assert!(err.contains("line 2"), "{err}");
    }

    /// `text` with the line `key = ...` replaced by `replacement`.
    fn replace_line(text: &str, key: &str, replacement: &str) -> String {
        let prefix = format!("{key} = ");
        assert!(
            text.lines().any(|line| line.starts_with(&prefix)),
            "no line {key}"
        );
        text.lines()
            .map(|line| {
                if line.starts_with(&prefix) {
                    replacement
                } else {
                    line
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let text = BUILT_IN[2]
            .1
            .replace("[idle]\n", "[idle]\npower_watts = 3\n");
        let err = GpuProfile::from_toml_str(&text, "typo.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("typo.toml") && err.contains("power_watts"),
            "{err}"
        );
    }

    /// Values that would make the simulator or the oracle allocate without end.
    #[test]
    fn sizes_past_any_gpu_are_refused() {
        let text = replace_line(BUILT_IN[2].1, "max_w", "max_w = 1e17");
        let text = replace_line(
            &text,
            "power_average_window_s",
            "power_average_window_s = 1e17",
        );
        let err = GpuProfile::from_toml_str(&text, "huge.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("power_cap.max_w must lie between 1 and 10000 (got 100000000000000000)"),
            "{err}"
        );
        assert!(
            err.contains("must be a whole multiple, 1 to 10000 times, of nvml.energy_update_s"),
            "{err}"
        );
    }

    #[test]
    fn invalid_values_are_all_reported_with_the_field_and_value() {
        let text = replace_line(BUILT_IN[2].1, "min_w", "min_w = 800.0");
        let text = replace_line(&text, "tensor_tflops", "tensor_tflops = -1.0");
        let err = GpuProfile::from_toml_str(&text, "mine.toml")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("GPU profile mine.toml: "), "{err}");
        assert!(
            err.contains("power_cap.min_w (800) must be below power_cap.max_w (700)"),
            "{err}"
        );
        assert!(
            err.contains("decode.tensor_tflops must be a number above 0 (got -1)"),
            "{err}"
        );
    }

    #[test]
    fn clocks_must_be_a_list_or_a_grid_not_both() {
        let text = BUILT_IN[2]
            .1
            .replace("sm_step_mhz = 15", "sm_step_mhz = 15\nsm_mhz = [1980]");
        let err = GpuProfile::from_toml_str(&text, "both.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("give either sm_mhz"), "{err}");

        let text = BUILT_IN[2].1.replace(
            "sm_max_mhz = 1980\nsm_min_mhz = 345\nsm_step_mhz = 15",
            "sm_mhz = [1500, 1980, 390]",
        );
        let profile = GpuProfile::from_toml_str(&text, "list.toml").unwrap();
        assert_eq!(profile.sm_clocks_mhz(), vec![1980, 1500, 390]);
    }

    /// The h200 profile with `key = ...` replaced, validated: the error text.
    fn refusal(key: &str, replacement: &str) -> String {
        let text = replace_line(BUILT_IN[2].1, key, replacement);
        GpuProfile::from_toml_str(&text, "edited.toml")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn the_serving_and_clock_terms_added_to_profiles_are_range_checked() {
        let h100 = BUILT_IN[1].1;
        let edited = |key: &str, line: &str| {
            GpuProfile::from_toml_str(&replace_line(h100, key, line), "edited.toml")
                .unwrap_err()
                .to_string()
        };
        let message = edited(
            "row_attention_ns_per_position",
            "row_attention_ns_per_position = -1.0",
        );
        assert!(
            message.contains(
                "serving.row_attention_ns_per_position must be a number of 0 or more (got -1)"
            ),
            "{message}"
        );
        let message = edited("throttle_s", "throttle_s = 90.0");
        assert!(
            message.contains("nvml.throttle_s must lie between 0 and 60 (got 90)"),
            "{message}"
        );
    }

    #[test]
    fn decode_bandwidth_above_the_memory_peak_is_refused() {
        let err = refusal("weights_bandwidth_tbs", "weights_bandwidth_tbs = 5.2");
        assert!(
            err.contains(
                "decode.weights_bandwidth_tbs (5.2) must not exceed memory.peak_bandwidth_tbs (4.8)"
            ),
            "{err}"
        );
        let err = refusal("kv_bandwidth_tbs", "kv_bandwidth_tbs = 4.81");
        assert!(
            err.contains("decode.kv_bandwidth_tbs (4.81) must not exceed"),
            "{err}"
        );
        assert!(!err.contains("weights_bandwidth"), "{err}");
    }

    #[test]
    fn power_constants_contradicting_idle_power_are_refused() {
        // p0 + clock at the idle clock (1980 MHz) is 122 W; 150 W is not.
        let err = refusal("p0_w", "p0_w = 128.0");
        assert!(
            err.contains("power.p0_w (128) + power.clock_w (22)"),
            "{err}"
        );
        assert!(err.contains("contradicts idle.power_w (122 W)"), "{err}");
        // Within the tolerance (5 W or 5 %) it loads.
        GpuProfile::from_toml_str(
            &replace_line(BUILT_IN[2].1, "p0_w", "p0_w = 104.0"),
            "close.toml",
        )
        .unwrap();
        // A low idle clock lowers the model's idle power (x·v² = 0.083 at 390 MHz): 102 W.
        let err = refusal("idle_sm_mhz", "idle_sm_mhz = 390");
        assert!(
            err.contains("clocks.idle_sm_mhz = 390 MHz) = 101.8 W"),
            "{err}"
        );
        let err = refusal("power_w", "power_w = 90.0");
        assert!(err.contains("contradicts idle.power_w (90 W)"), "{err}");
    }

    #[test]
    fn a_model_that_cannot_reach_the_cap_range_is_refused() {
        let err = refusal("core_w", "core_w = 300.0");
        assert!(
            err.contains("power.core_w: at full load the model draws at most 592 W")
                && err.contains("power_cap.default_w (700 W)"),
            "{err}"
        );
    }

    #[test]
    fn memory_size_must_be_given_and_sane() {
        let err = refusal("size_gb", "size_gb = 0.0");
        assert!(err.contains("memory.size_gb must lie between"), "{err}");
        let text = BUILT_IN[2].1.replace("size_gb = 141.0", "");
        let err = GpuProfile::from_toml_str(&text, "nosize.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("size_gb"), "{err}");
    }

    #[test]
    fn fixed_gains_load_as_one_or_a_list_and_are_range_checked() {
        let with = |line: &str| {
            BUILT_IN[2].1.replace(
                "gain_error_max = 0.05",
                &format!("gain_error_max = 0.05\n{line}"),
            )
        };
        let every = GpuProfile::from_toml_str(&with("gain = 1.0"), "one.toml").unwrap();
        assert_eq!(every.nvml.fixed_gain(5), Some(1.0));
        let list = GpuProfile::from_toml_str(&with("gain = [1.0, 0.98]"), "list.toml").unwrap();
        assert_eq!(
            (list.nvml.fixed_gain(1), list.nvml.fixed_gain(2)),
            (Some(0.98), None)
        );
        let err = GpuProfile::from_toml_str(&with("gain = [1.0, 2.5]"), "bad.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("nvml.gain must lie between 0.5 and 1.5 (got 2.5)"),
            "{err}"
        );
        assert_eq!(GpuProfile::load("h200").unwrap().nvml.fixed_gain(0), None);
    }

    #[test]
    fn a_profile_file_on_disk_loads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mine.toml");
        std::fs::write(
            &path,
            BUILT_IN[2].1.replace("id = \"h200\"", "id = \"mine\""),
        )
        .unwrap();
        let profile = GpuProfile::load(path.to_str().unwrap()).unwrap();
        assert_eq!(profile.id, "mine");
    }
}
