//! A profile's validation: every value checked, every problem named at once (the field,
//! the value and what is expected), and the physics checked against the profile's own
//! idle power and cap range.

use super::profile::GpuProfile;

/// How far the decode model's idle power may sit from `idle.power_w`: the larger of these.
const IDLE_TOLERANCE_FRACTION: f64 = 0.05;
const IDLE_TOLERANCE_W: f64 = 5.0;
/// The share of the default power limit the model must reach at full load.
const FULL_LOAD_REACH: f64 = 0.9;

/// The built-in profiles: (name, TOML text).
impl GpuProfile {
    /// Check every value; the error names the field, the value and what is expected.
    pub fn validate(&self) -> Result<(), String> {
        let mut checks = Checks::default();
        checks.require(
            !self.id.is_empty()
                && self
                    .id
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_'),
            || {
                format!(
                    "id '{}' must be non-empty lowercase letters, digits, '-' or '_'",
                    self.id
                )
            },
        );
        checks.require(!self.name.trim().is_empty(), || {
            "name must not be empty".into()
        });

        let cap = &self.power_cap;
        checks.positive("power_cap.min_w", cap.min_w);
        checks.positive("power_cap.default_w", cap.default_w);
        // Ten times any GPU's board power: past it the oracle's 25 W cap grid stops being a
        // grid (a 1e17 W cap minus 25 W is the same number).
        checks.in_range("power_cap.max_w", cap.max_w, 1.0, 10_000.0);
        checks.require(cap.min_w < cap.max_w, || {
            format!(
                "power_cap.min_w ({}) must be below power_cap.max_w ({})",
                cap.min_w, cap.max_w
            )
        });
        checks.require(
            cap.min_w <= cap.default_w && cap.default_w <= cap.max_w,
            || {
                format!(
                    "power_cap.default_w ({}) must lie between min_w ({}) and max_w ({})",
                    cap.default_w, cap.min_w, cap.max_w
                )
            },
        );

        self.validate_clocks(&mut checks);

        checks.positive("idle.power_w", self.idle.power_w);
        checks.require(self.idle.power_w < cap.min_w, || {
            format!(
                "idle.power_w ({}) must be below power_cap.min_w ({}): the GPU must fit under any cap when idle",
                self.idle.power_w, cap.min_w
            )
        });
        checks.positive("memory.peak_bandwidth_tbs", self.memory.peak_bandwidth_tbs);
        checks.in_range("memory.size_gb", self.memory.size_gb, 0.1, 100_000.0);

        let d = &self.decode;
        checks.positive("decode.overhead_per_layer_us", d.overhead_per_layer_us);
        checks.positive("decode.weights_bandwidth_tbs", d.weights_bandwidth_tbs);
        checks.positive("decode.kv_bandwidth_tbs", d.kv_bandwidth_tbs);
        checks.positive("decode.tensor_tflops", d.tensor_tflops);
        checks.in_range("decode.roofline_sharpness", d.roofline_sharpness, 1.0, 64.0);
        checks.positive("decode.knee_mhz", d.knee_mhz);
        checks.require(d.knee_mhz <= f64::from(self.sm_max_mhz()), || {
            format!(
                "decode.knee_mhz ({}) must not exceed the highest SM clock ({} MHz)",
                d.knee_mhz,
                self.sm_max_mhz()
            )
        });

        let pre = self.prefill();
        checks.positive("prefill.overhead_per_layer_us", pre.overhead_per_layer_us);
        checks.positive("prefill.tensor_tflops", pre.tensor_tflops);
        checks.in_range(
            "prefill.attention_efficiency",
            pre.attention_efficiency,
            0.01,
            1.0,
        );
        checks.in_range("prefill.core_activity", pre.core_activity, 0.0, 2.0);

        if let Some(serving) = &self.serving {
            checks.positive(
                "serving.overhead_per_layer_us",
                serving.overhead_per_layer_us,
            );
            checks.positive("serving.kv_bandwidth_tbs", serving.kv_bandwidth_tbs);
            checks.positive("serving.tensor_tflops", serving.tensor_tflops);
            checks.in_range(
                "serving.attention_efficiency",
                serving.attention_efficiency,
                0.01,
                1.0,
            );
            checks.in_range("serving.core_activity", serving.core_activity, 0.0, 2.0);
            checks.non_negative(
                "serving.row_attention_ns_per_position",
                serving.row_attention_ns_per_position,
            );
            checks.non_negative("serving.gemm_ramp_tokens", serving.gemm_ramp_tokens);
            checks.non_negative("serving.gemm_power_exponent", serving.gemm_power_exponent);
        }

        let p = &self.power;
        checks.non_negative("power.p0_w", p.p0_w);
        checks.non_negative("power.clock_w", p.clock_w);
        checks.non_negative("power.memory_w", p.memory_w);
        checks.positive("power.core_w", p.core_w);
        checks.in_range("power.stream_activity", p.stream_activity, 0.0, 1.0);
        checks.in_range("power.voltage_slope", p.voltage_slope, 0.0, 1.0);
        checks.in_range("power.v_min", p.v_min, 0.01, 1.0);
        self.validate_physics(&mut checks);

        let n = &self.nvml;
        checks.positive("nvml.energy_update_s", n.energy_update_s);
        checks.in_range("nvml.energy_update_s", n.energy_update_s, 0.001, 10.0);
        let bins = n.power_average_window_s / n.energy_update_s;
        // The simulator keeps one sample a bin: a window of 10 000 updates is already ten
        // times NVML's one second at its fastest update.
        checks.require(
            n.power_average_window_s.is_finite()
                && (1.0..=10_000.0).contains(&bins)
                && (bins - bins.round()).abs() < 1e-6,
            || {
                format!(
                    "nvml.power_average_window_s ({}) must be a whole multiple, 1 to 10000 times, of nvml.energy_update_s ({})",
                    n.power_average_window_s, n.energy_update_s
                )
            },
        );
        checks.non_negative("nvml.instantaneous_noise_w", n.instantaneous_noise_w);
        checks.in_range(
            "nvml.instantaneous_noise_fraction",
            n.instantaneous_noise_fraction,
            0.0,
            0.5,
        );
        checks.in_range("nvml.settle_s", n.settle_s, 0.0, 60.0);
        if let Some(throttle_s) = n.throttle_s {
            checks.in_range("nvml.throttle_s", throttle_s, 0.0, 60.0);
        }
        checks.in_range("nvml.gain_error_max", n.gain_error_max, 0.0, 0.5);
        for gain in n.fixed_gains() {
            checks.in_range("nvml.gain", *gain, 0.5, 1.5);
        }
        checks.in_range("nvml.step_time_jitter", n.step_time_jitter, 0.0, 1.0);

        let t = &self.thermal;
        checks.require(t.ambient_c.is_finite(), || {
            "thermal.ambient_c must be a number".into()
        });
        checks.non_negative("thermal.resistance_c_per_w", t.resistance_c_per_w);
        checks.positive("thermal.time_constant_s", t.time_constant_s);

        checks.finish()
    }

    /// Relations between sections that keep the model's steps physically possible.
    fn validate_physics(&self, checks: &mut Checks) {
        let peak = self.memory.peak_bandwidth_tbs;
        for (field, value) in [
            (
                "decode.weights_bandwidth_tbs",
                self.decode.weights_bandwidth_tbs,
            ),
            ("decode.kv_bandwidth_tbs", self.decode.kv_bandwidth_tbs),
        ] {
            checks.require(!value.is_finite() || value <= peak, || {
                format!(
                    "{field} ({value}) must not exceed memory.peak_bandwidth_tbs ({peak}): no step \
                     streams memory faster than the device's peak"
                )
            });
        }
        // The simulator draws idle.power_w with nothing to run and the model's formula the
        // moment work starts: the two must agree, or power jumps at the first request.
        let model_idle = self.model_idle_power_w();
        let idle = self.idle.power_w;
        let tolerance = (IDLE_TOLERANCE_FRACTION * idle).max(IDLE_TOLERANCE_W);
        checks.require((model_idle - idle).abs() <= tolerance, || {
            format!(
                "power.p0_w ({}) + power.clock_w ({}) x {:.3} (x·v² at clocks.idle_sm_mhz = {} MHz) = \
                 {model_idle:.1} W contradicts idle.power_w ({idle} W): they must agree within \
                 {tolerance:.1} W",
                self.power.p0_w,
                self.power.clock_w,
                self.power.clock_factor(
                    f64::from(self.clocks.idle_sm_mhz) / f64::from(self.sm_max_mhz().max(1))
                ),
                self.clocks.idle_sm_mhz
            )
        });
        // A device at full load reaches its default limit (its TDP); a model that cannot leaves
        // every cap in the range without effect.
        let full = self.model_full_load_power_w();
        let default_w = self.power_cap.default_w;
        checks.require(full >= FULL_LOAD_REACH * default_w, || {
            format!(
                "power.core_w: at full load the model draws at most {full:.0} W (p0_w + clock_w + \
                 memory_w + core_w), far below power_cap.default_w ({default_w} W); a device at \
                 full load reaches its default limit"
            )
        });
    }

    fn validate_clocks(&self, checks: &mut Checks) {
        let c = &self.clocks;
        let grid_fields = [c.sm_min_mhz, c.sm_max_mhz, c.sm_step_mhz];
        match (&c.sm_mhz, grid_fields) {
            (Some(list), [None, None, None]) => {
                checks.require(!list.is_empty() && list.iter().all(|&f| f > 0), || {
                    "clocks.sm_mhz must list at least one clock, all above 0 MHz".into()
                });
            }
            (None, [Some(min), Some(max), Some(step)]) => {
                checks.require(min > 0 && min < max, || {
                    format!("clocks.sm_min_mhz ({min}) must be above 0 and below clocks.sm_max_mhz ({max})")
                });
                checks.require(step > 0, || "clocks.sm_step_mhz must be above 0".into());
                checks.require(step == 0 || (max.saturating_sub(min)) / step <= 10_000, || {
                    format!("clocks: {min}-{max} MHz in steps of {step} MHz gives too many clocks (10000 at most)")
                });
            }
            _ => checks.require(false, || {
                "clocks: give either sm_mhz = [..] or all of sm_min_mhz, sm_max_mhz and sm_step_mhz".into()
            }),
        }
        checks.require(
            !c.mem_mhz.is_empty() && c.mem_mhz.iter().all(|&f| f > 0),
            || "clocks.mem_mhz must list at least one memory clock, all above 0 MHz".into(),
        );
        let grid = self.sm_clocks_mhz();
        if let (Some(&highest), Some(&lowest)) = (grid.first(), grid.last()) {
            checks.require((lowest..=highest).contains(&c.idle_sm_mhz), || {
                format!(
                    "clocks.idle_sm_mhz ({}) must lie within the SM clock range {lowest}-{highest} MHz",
                    c.idle_sm_mhz
                )
            });
        }
    }
}

/// Collects validation problems so a profile with several mistakes reports them all at once.
#[derive(Debug, Default)]
struct Checks {
    problems: Vec<String>,
}

impl Checks {
    fn require(&mut self, ok: bool, problem: impl FnOnce() -> String) {
        if !ok {
            self.problems.push(problem());
        }
    }
    fn positive(&mut self, field: &str, value: f64) {
        self.require(value.is_finite() && value > 0.0, || {
            format!("{field} must be a number above 0 (got {value})")
        });
    }
    fn non_negative(&mut self, field: &str, value: f64) {
        self.require(value.is_finite() && value >= 0.0, || {
            format!("{field} must be a number of 0 or more (got {value})")
        });
    }
    fn in_range(&mut self, field: &str, value: f64, lo: f64, hi: f64) {
        self.require(value.is_finite() && (lo..=hi).contains(&value), || {
            format!("{field} must lie between {lo} and {hi} (got {value})")
        });
    }
    fn finish(self) -> Result<(), String> {
        if self.problems.is_empty() {
            Ok(())
        } else {
            Err(self.problems.join("; "))
        }
    }
}
