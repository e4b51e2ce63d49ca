//! The spec's `[params]`, read and checked once in `init` (`policies/serve-slo.toml`
//! says why each default).

use std::fmt;
use tokwatt_policy_kit::LadderConfig;
use tokwatt_policy_sdk::Params;

/// Which knob slows the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KnobChoice {
    /// By the phase mix seen: a power cap where prompts take most of the busy time, a
    /// clock lock otherwise (where both are granted).
    Auto,
    Clock,
    Cap,
}

/// Why the spec's parameters cannot be used. Shown to the operator through `init`'s
/// error, so each says which key and how to fix it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ConfigError {
    /// A key the policy does not read, or a value that does not parse (the SDK's words).
    Params(String),
    /// `knob_choice` is none of the three.
    KnobChoice(String),
    /// A fraction outside (0, 1].
    Fraction { key: &'static str, value: f64 },
    /// `lock_below` above `cap_above`.
    Hysteresis { cap_above: f64, lock_below: f64 },
    /// A count or size that must be at least one.
    AtLeastOne(&'static str),
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Params(message) => f.write_str(message),
            ConfigError::KnobChoice(value) => write!(
                f,
                "parameter `knob_choice` = {value:?} must be \"auto\", \"clock\" or \"cap\""
            ),
            ConfigError::Fraction { key, value } => {
                write!(
                    f,
                    "parameter `{key}` = {value} must be a fraction in (0, 1]"
                )
            }
            ConfigError::Hysteresis {
                cap_above,
                lock_below,
            } => write!(
                f,
                "parameter `lock_below` = {lock_below} must not be above `cap_above` = \
                 {cap_above} (the gap between them keeps the knob from flipping)"
            ),
            ConfigError::AtLeastOne(key) => write!(f, "parameter `{key}` must be at least 1"),
        }
    }
}

impl From<String> for ConfigError {
    fn from(message: String) -> ConfigError {
        ConfigError::Params(message)
    }
}

/// The policy's own keys, beside the ladder search's.
pub(crate) const KEYS: [&str; 9] = [
    "knob_choice",
    "descent_guard",
    "cap_above",
    "lock_below",
    "cap_grid_w",
    "ttft_guard",
    "budget_window_ticks",
    "budget_floor",
    "batch_calm_windows",
];

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Config {
    pub ladder: LadderConfig,
    pub knob_choice: KnobChoice,
    /// Share of busy time on prompts above which a power cap is preferred…
    pub cap_above: f64,
    /// …and below which a clock lock is again.
    pub lock_below: f64,
    /// Watts between the caps searched.
    pub cap_grid_w: f64,
    /// Predicted p99 time to first token over this share of its bound raises the knob
    /// (and rules out a lower rung) before a tick breaks it.
    pub ttft_guard: f64,
    /// A settled clock goes down at once to the lowest clock whose predicted p99 time
    /// to first token stays under this share of its bound.
    pub descent_guard: f64,
    /// Settled ticks with prompts between two budget decisions.
    pub budget_window_ticks: u32,
    /// The smallest budget chosen (a chunk smaller than this costs more in step
    /// overhead than it saves in time per token).
    pub budget_floor: u32,
    /// Windows of ample room under the TPOT bound before a cut batch grows back.
    pub batch_calm_windows: u32,
}

impl Config {
    pub fn defaults() -> Config {
        Config {
            ladder: LadderConfig::defaults(),
            knob_choice: KnobChoice::Clock,
            cap_above: 0.6,
            lock_below: 0.4,
            cap_grid_w: 25.0,
            ttft_guard: 0.85,
            descent_guard: 0.6,
            budget_window_ticks: 4,
            budget_floor: 256,
            batch_calm_windows: 5,
        }
    }

    pub fn read(params: &Params<'_>) -> Result<Config, ConfigError> {
        let mut known: Vec<&str> = LadderConfig::KEYS.to_vec();
        known.extend(KEYS);
        params.check_known(&known)?;
        let d = Config::defaults();
        let knob_choice = match params.raw("knob_choice").map(str::trim) {
            None => d.knob_choice,
            Some("auto") => KnobChoice::Auto,
            Some("clock") => KnobChoice::Clock,
            Some("cap") => KnobChoice::Cap,
            Some(other) => return Err(ConfigError::KnobChoice(other.to_string())),
        };
        let config = Config {
            ladder: LadderConfig::read(params, d.ladder)?,
            knob_choice,
            cap_above: params.get("cap_above", d.cap_above)?,
            lock_below: params.get("lock_below", d.lock_below)?,
            cap_grid_w: params.get("cap_grid_w", d.cap_grid_w)?,
            ttft_guard: params.get("ttft_guard", d.ttft_guard)?,
            descent_guard: params.get("descent_guard", d.descent_guard)?,
            budget_window_ticks: params.get("budget_window_ticks", d.budget_window_ticks)?,
            budget_floor: params.get("budget_floor", d.budget_floor)?,
            batch_calm_windows: params.get("batch_calm_windows", d.batch_calm_windows)?,
        };
        for (key, value) in [
            ("cap_above", config.cap_above),
            ("lock_below", config.lock_below),
            ("ttft_guard", config.ttft_guard),
            ("descent_guard", config.descent_guard),
        ] {
            if !(value.is_finite() && value > 0.0 && value <= 1.0) {
                return Err(ConfigError::Fraction { key, value });
            }
        }
        if config.lock_below > config.cap_above {
            return Err(ConfigError::Hysteresis {
                cap_above: config.cap_above,
                lock_below: config.lock_below,
            });
        }
        if !(config.cap_grid_w.is_finite() && config.cap_grid_w >= 1.0) {
            return Err(ConfigError::AtLeastOne("cap_grid_w"));
        }
        for (key, value) in [
            ("budget_window_ticks", config.budget_window_ticks),
            ("budget_floor", config.budget_floor),
            ("batch_calm_windows", config.batch_calm_windows),
        ] {
            if value == 0 {
                return Err(ConfigError::AtLeastOne(key));
            }
        }
        Ok(config)
    }
}
