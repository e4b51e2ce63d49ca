//! The decode model: time and power of one decode step of `n` sequences at an SM clock, and
//! the firmware's choice of clock under a power cap and a clock lock.
//!
//! For `n` sequences at SM clock `f`, with `x = f / f_max`, `v = max(v_min, 1 - slope·(1 - x))`,
//! `s = min(1, f / f_knee)` and `m = mem_clock / mem_clock_max`:
//!
//! ```text
//! t_ovh = layers · overhead_per_layer / s             launch gaps, small kernels
//! t_w   = weight_bytes / weights_bandwidth / (s·m)    streaming the weights
//! t_kv  = n · kv_bytes / kv_bandwidth / (s·m)         attention reads the KV cache
//! t_c   = n · flops_per_token / (tensor_rate · x)     arithmetic of the weight GEMMs
//! step  = t_ovh + t_kv + (t_w^p + t_c^p)^(1/p)        smooth roofline: GEMMs overlap their
//!                                                      arithmetic with the weight stream
//! P     = p0 + clock·x·v² + u_m·memory + u_c·core·x·v²
//! u_m   = bytes moved per second / peak bandwidth
//! u_c   = stream_activity · (step - t_ovh)/step + t_c/step
//! ```
//!
//! A step that also carries a chunk of prompt tokens (prefill, [`StepLoad`]) adds their
//! arithmetic `t_p` (weight GEMMs at the profile's `[prefill]` rate, causal attention at
//! its `attention_efficiency`) to the GEMMs' arithmetic, pays `[prefill]`'s launch
//! overhead instead of decode's, and counts `core_activity · t_p` in `u_c`:
//!
//! ```text
//! t_p  = (c · prefill_flops_per_token / prefill_rate + positions · attention / (prefill_rate · eff)) / x
//! step = t_ovh' + t_kv + (t_w^p + (t_c + t_p)^p)^(1/p)
//! u_c  = stream_activity · (step - t_ovh')/step + (t_c + core_activity · t_p)/step
//! ```
//!
//! A serving step ([`DecodeModel::point_load`]) takes the same form with the profile's
//! `[serving]` constants where it has them (the serving loop's own overhead, KV bandwidth,
//! tensor rate and attention efficiency, fitted to measured serving steps). There the
//! prompt tokens' GEMMs in a step of `M` tokens run at `M / (M + ramp)` of the rate
//! (`gemm_ramp_tokens`): a 2,048-token chunk fills the tensor cores' tiles less than four of
//! them together, so it takes longer per token and draws less at a clock (the H100 ran
//! 1,545 MHz under the cap beside one such chunk, 1,410 beside four); only the busy share
//! counts in `u_c`:
//!
//! ```text
//! t_p  = (c · prefill_flops_per_token / rate · (1 + ramp / M) + attention) / x
//! u_c  = stream_activity · (step - t_ovh)/step + (t_c + core_activity · t_p · busy)/step
//! busy = (GEMMs' t_p without the ramp · (M / 4096)^size + attention's t_p) / t_p
//! ```
//!
//! `size` (`gemm_power_exponent`) is there because at one clock a step's draw rises with its
//! size past where its speed per token stops rising: in one measured grid the H100 ran
//! 1,570 MHz under its cap beside one 2,048-token chunk and 1,410 beside four, the same
//! attention per token. Fitted beside the served runs, whose 8,192-token steps ran at
//! 1,515-1,550 MHz, it comes out small (0.03 on the h100): those runs bear out little of
//! that grid's fall.
//!
//! The whole-prompt
//! prefill ([`DecodeModel::prefill_steady_state`]) keeps `[decode]` and `[prefill]`'s.
//!
//! The constants live in the profile files (`host/profiles/*.toml`), fitted to measurements.

use super::profile::GpuProfile;

/// The step size at which `gemm_power_exponent` leaves the prompt GEMMs' core power as
/// their busy time gives it (`core_activity` is their activity at this size).
const GEMM_POWER_TOKENS: f64 = 4096.0;

/// The simulator reads the same model shapes as the CUDA workload (`host/models/models.toml`).
pub use tokwatt_core::model::ModelShape;

/// What one decode step costs for one model at one context length.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeCost {
    pub layers: u32,
    /// Weight bytes read per step, whatever the batch.
    pub weight_bytes: f64,
    /// KV-cache bytes read per sequence per step.
    pub kv_bytes_per_sequence: f64,
    /// FLOPs per generated token (weight GEMMs and attention).
    pub flops_per_token: f64,
    /// KV-cache bytes of one position (all layers, keys and values).
    pub kv_bytes_per_token: f64,
    /// Weight-GEMM FLOPs of one decoded token (the output head included).
    pub decode_linear_flops_per_token: f64,
    /// Weight-GEMM FLOPs of one prompt token (no output head: only a prompt's last token
    /// is turned into logits, and that one is the first decoded token's).
    pub prefill_flops_per_token: f64,
    /// Attention FLOPs of one token per position it attends to.
    pub attention_flops_per_position: f64,
}

impl DecodeCost {
    /// Every projection and the output head are read once a step (the norms' weights and the
    /// embedding table are too small to count); bf16.
    pub fn new(shape: &ModelShape, context_tokens: u32) -> Self {
        let params = shape.params_read_per_step() as f64;
        Self {
            layers: shape.layers,
            weight_bytes: params * tokwatt_core::model::BYTES_PER_PARAM as f64,
            kv_bytes_per_sequence: shape.kv_cache_bytes(1, context_tokens) as f64,
            flops_per_token: 2.0 * params + shape.attention_flops_per_token(context_tokens) as f64,
            kv_bytes_per_token: shape.kv_cache_bytes(1, 1) as f64,
            decode_linear_flops_per_token: 2.0 * params,
            prefill_flops_per_token: 2.0
                * (u64::from(shape.layers) * shape.layer_matrix_params()) as f64,
            attention_flops_per_position: shape.attention_flops_per_token(1) as f64,
        }
    }
}

/// What one engine step processes: core's (the serving scheduler composes it).
pub use tokwatt_core::workload::serving::StepLoad;

/// One decode step at one operating point.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepPoint {
    pub step_s: f64,
    pub power_w: f64,
}

/// What holds the SM clock below the highest supported clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockLimit {
    /// Nothing: the clock is at the top of its allowed range.
    None,
    /// The power cap (NVML `sw_power_cap`).
    PowerCap,
    /// A locked clock range (NVML `clock_setting`).
    ClockLock,
}

/// The clock the firmware picks, and why.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FirmwareClock {
    pub sm_mhz: u32,
    pub limit: ClockLimit,
}

/// Steady state of a saturated decode loop at fixed settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SteadyState {
    pub sm_mhz: u32,
    pub step_s: f64,
    pub power_w: f64,
    pub tokens_per_s: f64,
    pub limit: ClockLimit,
}

/// The parts of one step, before they are combined (see the module's formulas).
#[derive(Debug, Clone, Copy)]
struct Phases {
    overhead_s: f64,
    weights_s: f64,
    kv_s: f64,
    decode_arithmetic_s: f64,
    prefill_arithmetic_s: f64,
    /// The share of `prefill_arithmetic_s` that draws the core power of busy tensor cores
    /// (1 but where a small chunk fills their tiles less, the ramp's `M / (M + ramp)` of its
    /// GEMMs, and draws with the step's size, `(M / 4096)^size` of that).
    prefill_busy_share: f64,
    /// Bytes the step moves (weights and the KV cache read).
    bytes: f64,
}

/// The decode model of one profile and one workload, with the per-step constants precomputed.
#[derive(Debug, Clone)]
pub struct DecodeModel {
    sm_max_mhz: f64,
    mem_max_mhz: f64,
    knee_mhz: f64,
    overhead_s: f64,
    weights_s: f64,
    kv_s_per_sequence: f64,
    compute_s_per_sequence: f64,
    weight_bytes: f64,
    kv_bytes_per_sequence: f64,
    peak_bytes_per_s: f64,
    sharpness: f64,
    power: super::profile::PowerConstants,
    /// Supported SM clocks, highest first.
    sm_grid: Vec<u32>,
    kv_bytes_per_token: f64,
    /// A step of a load as the measured whole-prompt and closed-loop tables run it.
    forward: LoadTerms,
    /// A step of a load as the serving loop runs it: the profile's `[serving]`, else
    /// `forward`.
    serving: LoadTerms,
}

/// The per-step and per-token terms of a step of a [`StepLoad`].
#[derive(Debug, Clone, Copy, PartialEq)]
struct LoadTerms {
    /// Launch gaps of a step without prompt tokens, and of one with.
    decode_overhead_s: f64,
    prefill_overhead_s: f64,
    kv_s_per_token: f64,
    /// Seconds per position of the longest decoding row's attention (0: none apart).
    row_s_per_position: f64,
    /// Seconds of decode arithmetic per decoded token (weights) and per position attended.
    decode_linear_s_per_token: f64,
    attention_s_per_position: f64,
    prefill_s_per_token: f64,
    prefill_attention_s_per_position: f64,
    /// SM activity per second of prompt arithmetic, relative to decode's.
    prefill_activity: f64,
    /// A step of `M` tokens runs its prompt tokens' GEMMs at `M / (M + this)` of the rate.
    gemm_ramp_tokens: f64,
    /// ... and their busy time draws `(M / 4096)^this` of the core power at a clock.
    gemm_power_exponent: f64,
}

impl DecodeModel {
    pub fn new(profile: &GpuProfile, cost: &DecodeCost) -> Self {
        let d = &profile.decode;
        let pre = profile.prefill();
        let layers = f64::from(cost.layers);
        let decode_overhead_s = layers * d.overhead_per_layer_us * 1e-6;
        let forward = LoadTerms {
            decode_overhead_s,
            prefill_overhead_s: (layers * pre.overhead_per_layer_us * 1e-6).max(decode_overhead_s),
            kv_s_per_token: cost.kv_bytes_per_token / (d.kv_bandwidth_tbs * 1e12),
            row_s_per_position: 0.0,
            decode_linear_s_per_token: cost.decode_linear_flops_per_token
                / (d.tensor_tflops * 1e12),
            attention_s_per_position: cost.attention_flops_per_position / (d.tensor_tflops * 1e12),
            prefill_s_per_token: cost.prefill_flops_per_token / (pre.tensor_tflops * 1e12),
            prefill_attention_s_per_position: cost.attention_flops_per_position
                / (pre.tensor_tflops * 1e12 * pre.attention_efficiency),
            prefill_activity: pre.core_activity,
            gemm_ramp_tokens: 0.0,
            gemm_power_exponent: 0.0,
        };
        // The serving loop launches every step alike and runs its decoding rows through the
        // prompt's GEMMs: one overhead, one tensor rate for every row.
        let serving = profile.serving.map_or(forward, |sv| {
            let overhead_s = layers * sv.overhead_per_layer_us * 1e-6;
            let tensor = sv.tensor_tflops * 1e12;
            LoadTerms {
                decode_overhead_s: overhead_s,
                prefill_overhead_s: overhead_s,
                kv_s_per_token: cost.kv_bytes_per_token / (sv.kv_bandwidth_tbs * 1e12),
                row_s_per_position: sv.row_attention_ns_per_position * 1e-9,
                decode_linear_s_per_token: cost.decode_linear_flops_per_token / tensor,
                attention_s_per_position: cost.attention_flops_per_position / tensor,
                prefill_s_per_token: cost.prefill_flops_per_token / tensor,
                prefill_attention_s_per_position: cost.attention_flops_per_position
                    / (tensor * sv.attention_efficiency),
                prefill_activity: sv.core_activity,
                gemm_ramp_tokens: sv.gemm_ramp_tokens,
                gemm_power_exponent: sv.gemm_power_exponent,
            }
        });
        Self {
            sm_max_mhz: f64::from(profile.sm_max_mhz()),
            mem_max_mhz: f64::from(profile.mem_max_mhz()),
            knee_mhz: d.knee_mhz,
            overhead_s: f64::from(cost.layers) * d.overhead_per_layer_us * 1e-6,
            weights_s: cost.weight_bytes / (d.weights_bandwidth_tbs * 1e12),
            kv_s_per_sequence: cost.kv_bytes_per_sequence / (d.kv_bandwidth_tbs * 1e12),
            compute_s_per_sequence: cost.flops_per_token / (d.tensor_tflops * 1e12),
            weight_bytes: cost.weight_bytes,
            kv_bytes_per_sequence: cost.kv_bytes_per_sequence,
            peak_bytes_per_s: profile.memory.peak_bandwidth_tbs * 1e12,
            sharpness: d.roofline_sharpness,
            power: profile.power,
            sm_grid: profile.sm_clocks_mhz(),
            kv_bytes_per_token: cost.kv_bytes_per_token,
            forward,
            serving,
        }
    }

    /// Supported SM clocks, highest first.
    pub fn sm_grid(&self) -> &[u32] {
        &self.sm_grid
    }

    /// `x·v²` at relative clock `x`: how clocked power scales.
    fn clock_power_factor(&self, x: f64) -> f64 {
        self.power.clock_factor(x)
    }

    /// Time and power of one step of `active` sequences at `sm_mhz` and `mem_mhz`. With no
    /// active sequence: the power of a clocked GPU with nothing to run, and no step.
    pub fn point(&self, active: u32, sm_mhz: f64, mem_mhz: f64) -> StepPoint {
        let x = (sm_mhz / self.sm_max_mhz).max(1e-3);
        let xv2 = self.clock_power_factor(x);
        let p = &self.power;
        if active == 0 {
            return StepPoint {
                step_s: f64::INFINITY,
                power_w: p.p0_w + p.clock_w * xv2,
            };
        }
        let n = f64::from(active);
        let (memory_speed, below_knee) = self.memory_speed(sm_mhz, mem_mhz);
        self.combine(
            Phases {
                overhead_s: self.overhead_s / below_knee,
                weights_s: self.weights_s / memory_speed,
                kv_s: n * self.kv_s_per_sequence / memory_speed,
                decode_arithmetic_s: n * self.compute_s_per_sequence / x,
                prefill_arithmetic_s: 0.0,
                prefill_busy_share: 1.0,
                bytes: self.weight_bytes + n * self.kv_bytes_per_sequence,
            },
            xv2,
            0.0,
        )
    }

    /// Time and power of one serving step of `load` (decode and prefill together) at
    /// `sm_mhz` and `mem_mhz`; an empty load is [`DecodeModel::point`]'s idle.
    pub fn point_load(&self, load: &StepLoad, sm_mhz: f64, mem_mhz: f64) -> StepPoint {
        self.point_terms(&self.serving, load, sm_mhz, mem_mhz)
    }

    fn point_terms(
        &self,
        terms: &LoadTerms,
        load: &StepLoad,
        sm_mhz: f64,
        mem_mhz: f64,
    ) -> StepPoint {
        if load.prefill <= 0.0 && load.decode == 0 {
            return self.point(0, sm_mhz, mem_mhz);
        }
        let x = (sm_mhz / self.sm_max_mhz).max(1e-3);
        let xv2 = self.clock_power_factor(x);
        let (memory_speed, below_knee) = self.memory_speed(sm_mhz, mem_mhz);
        let n = f64::from(load.decode);
        let overhead_s = if load.prefill > 0.0 {
            terms.prefill_overhead_s
        } else {
            terms.decode_overhead_s
        };
        // The prompt tokens' GEMMs, slowed where the step's tokens fill the tiles less.
        let gemm_s = load.prefill * terms.prefill_s_per_token;
        let attention_s = load.prefill_positions * terms.prefill_attention_s_per_position;
        let (ramp, size_share) = if load.prefill > 0.0 {
            let tokens = load.prefill + n;
            (
                1.0 + terms.gemm_ramp_tokens / tokens,
                (tokens / GEMM_POWER_TOKENS).powf(terms.gemm_power_exponent),
            )
        } else {
            (1.0, 1.0)
        };
        self.combine(
            Phases {
                overhead_s: overhead_s / below_knee,
                weights_s: self.weights_s / memory_speed,
                // The rows' reads together at the KV bandwidth, and the longest row's own
                // attention on top (its few blocks finish last).
                kv_s: (load.decode_positions * terms.kv_s_per_token
                    + load.decode_position_max * terms.row_s_per_position)
                    / memory_speed,
                decode_arithmetic_s: (n * terms.decode_linear_s_per_token
                    + load.decode_positions * terms.attention_s_per_position)
                    / x,
                prefill_arithmetic_s: (gemm_s * ramp + attention_s) / x,
                prefill_busy_share: if gemm_s * ramp + attention_s > 0.0 {
                    (gemm_s * size_share + attention_s) / (gemm_s * ramp + attention_s)
                } else {
                    1.0
                },
                bytes: self.weight_bytes + load.decode_positions * self.kv_bytes_per_token,
            },
            xv2,
            terms.prefill_activity,
        )
    }

    /// The fraction of the memory bandwidth in reach at `sm_mhz` and `mem_mhz`, and how far
    /// below the knee the clock is (1: at or above it). Below the knee the SMs cannot issue
    /// loads fast enough; a lower memory clock lowers the bandwidth in proportion.
    fn memory_speed(&self, sm_mhz: f64, mem_mhz: f64) -> (f64, f64) {
        let below_knee = (sm_mhz / self.knee_mhz).clamp(1e-3, 1.0);
        (
            below_knee * (mem_mhz / self.mem_max_mhz).clamp(1e-3, 1.0),
            below_knee,
        )
    }

    /// One step from its parts: the smooth roofline over the GEMMs, and the power of what
    /// the step keeps busy.
    fn combine(&self, parts: Phases, xv2: f64, prefill_activity: f64) -> StepPoint {
        let p = &self.power;
        let arithmetic = parts.decode_arithmetic_s + parts.prefill_arithmetic_s;
        let gemm = (parts.weights_s.powf(self.sharpness) + arithmetic.powf(self.sharpness))
            .powf(1.0 / self.sharpness);
        let step_s = parts.overhead_s + parts.kv_s + gemm;
        let memory_util = parts.bytes / (step_s * self.peak_bytes_per_s);
        let core_util = p.stream_activity * (step_s - parts.overhead_s) / step_s
            + (parts.decode_arithmetic_s
                + prefill_activity * parts.prefill_busy_share * parts.prefill_arithmetic_s)
                / step_s;
        StepPoint {
            step_s,
            power_w: p.p0_w
                + p.clock_w * xv2
                + memory_util * p.memory_w
                + core_util * p.core_w * xv2,
        }
    }

    /// KV-cache bytes of one position.
    pub fn kv_bytes_per_token(&self) -> f64 {
        self.kv_bytes_per_token
    }

    /// The clock the firmware runs `active` sequences at: the highest supported clock not above
    /// `lock_max_mhz` whose power fits under `cap_w` (the lowest clock if none fits; the power
    /// limiter may go below a locked minimum, as on real GPUs).
    pub fn firmware_clock(
        &self,
        active: u32,
        cap_w: f64,
        lock_max_mhz: u32,
        mem_mhz: f64,
    ) -> FirmwareClock {
        self.firmware_clock_for(cap_w, lock_max_mhz, |f| {
            self.point(active, f64::from(f), mem_mhz).power_w
        })
    }

    /// [`DecodeModel::firmware_clock`] for a step of `load`.
    pub fn firmware_clock_load(
        &self,
        load: &StepLoad,
        cap_w: f64,
        lock_max_mhz: u32,
        mem_mhz: f64,
    ) -> FirmwareClock {
        self.firmware_clock_terms(&self.serving, load, cap_w, lock_max_mhz, mem_mhz)
    }

    fn firmware_clock_terms(
        &self,
        terms: &LoadTerms,
        load: &StepLoad,
        cap_w: f64,
        lock_max_mhz: u32,
        mem_mhz: f64,
    ) -> FirmwareClock {
        self.firmware_clock_for(cap_w, lock_max_mhz, |f| {
            self.point_terms(terms, load, f64::from(f), mem_mhz).power_w
        })
    }

    /// The highest allowed clock whose power (`power_at`) fits under `cap_w`.
    fn firmware_clock_for(
        &self,
        cap_w: f64,
        lock_max_mhz: u32,
        power_at: impl Fn(u32) -> f64,
    ) -> FirmwareClock {
        let grid = &self.sm_grid;
        let Some(&lowest) = grid.last() else {
            return FirmwareClock {
                sm_mhz: 0,
                limit: ClockLimit::None,
            };
        };
        let fits = |f: u32| power_at(f) <= cap_w;
        // The grid is highest first and power falls with the clock, so "too hot" is a prefix.
        let first_allowed = grid
            .partition_point(|&f| f > lock_max_mhz)
            .min(grid.len() - 1);
        let allowed = &grid[first_allowed..];
        let too_hot = allowed.partition_point(|&f| !fits(f));
        match allowed.get(too_hot) {
            None => FirmwareClock {
                sm_mhz: lowest,
                limit: ClockLimit::PowerCap,
            },
            Some(&f) if too_hot > 0 => FirmwareClock {
                sm_mhz: f,
                limit: ClockLimit::PowerCap,
            },
            Some(&f) => {
                // The lock binds when the next clock above it would also have fitted.
                let lock_binds = first_allowed > 0 && fits(grid[first_allowed - 1]);
                FirmwareClock {
                    sm_mhz: f,
                    limit: if lock_binds {
                        ClockLimit::ClockLock
                    } else {
                        ClockLimit::None
                    },
                }
            }
        }
    }

    /// The steady state of one forward over `sequences` prompts of `prompt` tokens each,
    /// repeated back to back (what the measured prefill table runs): tokens/s counts
    /// prompt tokens.
    pub fn prefill_steady_state(
        &self,
        prompt: u32,
        sequences: u32,
        cap_w: f64,
        lock_max_mhz: u32,
        mem_mhz: f64,
    ) -> SteadyState {
        let tokens = f64::from(prompt) * f64::from(sequences);
        let load = StepLoad {
            prefill: tokens,
            // Causal: the i-th token of a prompt attends to the i before it.
            prefill_positions: tokens * f64::from(prompt) / 2.0,
            ..StepLoad::default()
        };
        // The measured prefill table is a whole-prompt forward, not a serving step.
        let clock = self.firmware_clock_terms(&self.forward, &load, cap_w, lock_max_mhz, mem_mhz);
        let point = self.point_terms(&self.forward, &load, f64::from(clock.sm_mhz), mem_mhz);
        SteadyState {
            sm_mhz: clock.sm_mhz,
            step_s: point.step_s,
            power_w: point.power_w,
            tokens_per_s: tokens / point.step_s,
            limit: clock.limit,
        }
    }

    /// The steady state of steps of `load` back to back (an engine serving a mix of
    /// decode and prompt chunks): tokens/s counts decoded tokens.
    pub fn steady_state_load(
        &self,
        load: &StepLoad,
        cap_w: f64,
        lock_max_mhz: u32,
        mem_mhz: f64,
    ) -> SteadyState {
        let clock = self.firmware_clock_load(load, cap_w, lock_max_mhz, mem_mhz);
        let point = self.point_load(load, f64::from(clock.sm_mhz), mem_mhz);
        SteadyState {
            sm_mhz: clock.sm_mhz,
            step_s: point.step_s,
            power_w: point.power_w,
            tokens_per_s: f64::from(load.decode) / point.step_s,
            limit: clock.limit,
        }
    }

    /// The steady state of `active` sequences decoding back to back.
    pub fn steady_state(
        &self,
        active: u32,
        cap_w: f64,
        lock_max_mhz: u32,
        mem_mhz: f64,
    ) -> SteadyState {
        let clock = self.firmware_clock(active, cap_w, lock_max_mhz, mem_mhz);
        let point = self.point(active, f64::from(clock.sm_mhz), mem_mhz);
        SteadyState {
            sm_mhz: clock.sm_mhz,
            step_s: point.step_s,
            power_w: point.power_w,
            tokens_per_s: f64::from(active) / point.step_s,
            limit: clock.limit,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    #[test]
    fn the_step_cost_comes_from_the_shared_model_shape() {
        // calibration README: Llama-3-8B reads 7.5 B parameters per step (15.0 GB of bf16).
        let llama8 = ModelShape::preset("llama-3-8b").unwrap();
        let cost = DecodeCost::new(&llama8, 1024);
        assert!((cost.weight_bytes / 1e9 - 15.0).abs() < 0.05);
        assert_eq!(
            cost.weight_bytes,
            llama8.params_read_per_step() as f64 * 2.0
        );
        // 2 (K, V) × 32 layers × 8 heads × 128 dims × 2 bytes × 1024 tokens = 134 MB.
        assert_eq!(cost.kv_bytes_per_sequence, 134_217_728.0);
        assert_eq!(cost.layers, 32);
        // Two FLOPs a weight, and attention's scores and values over 1024 positions.
        let attention = 4.0 * 32.0 * 4096.0 * 1024.0;
        assert_eq!(
            cost.flops_per_token,
            2.0 * llama8.params_read_per_step() as f64 + attention
        );
    }

    #[test]
    fn head_dim_sets_the_kv_bytes_not_hidden_over_heads() {
        let mut shape = ModelShape::preset("llama-3.2-1b").unwrap();
        let narrow = DecodeCost::new(&shape, 1024);
        shape.head_dim *= 2;
        let wide = DecodeCost::new(&shape, 1024);
        assert_eq!(
            wide.kv_bytes_per_sequence,
            2.0 * narrow.kv_bytes_per_sequence
        );
        assert!(wide.weight_bytes > narrow.weight_bytes);
    }

    fn h200_8b(context: u32) -> DecodeModel {
        let profile = GpuProfile::load("h200").unwrap();
        DecodeModel::new(
            &profile,
            &DecodeCost::new(&ModelShape::preset("llama-3-8b").unwrap(), context),
        )
    }

    #[test]
    fn power_rises_with_clock_so_the_firmware_search_is_valid() {
        for name in GpuProfile::built_in_names() {
            let profile = GpuProfile::load(name).unwrap();
            for preset in ["llama-3-8b", "llama-3.2-1b"] {
                let shape = ModelShape::preset(preset).unwrap();
                for context in [256, 1024, 4096] {
                    let model = DecodeModel::new(&profile, &DecodeCost::new(&shape, context));
                    for active in [1, 8, 64, 512] {
                        let powers: Vec<f64> = model
                            .sm_grid()
                            .iter()
                            .map(|&f| {
                                model
                                    .point(active, f64::from(f), f64::from(profile.mem_max_mhz()))
                                    .power_w
                            })
                            .collect();
                        assert!(
                            powers.windows(2).all(|w| w[0] >= w[1]),
                            "{name} {preset} ctx {context} n {active}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn firmware_lowers_the_clock_until_the_power_fits_the_cap() {
        let model = h200_8b(1024);
        for cap in [200.0, 300.0, 450.0, 600.0, 700.0] {
            let state = model.steady_state(256, cap, 1980, 3201.0);
            let next_up = model
                .point(256, f64::from(state.sm_mhz + 15), 3201.0)
                .power_w;
            if state.sm_mhz > 345 {
                assert!(state.power_w <= cap, "cap {cap}: {state:?}");
            }
            if state.sm_mhz < 1980 {
                assert_eq!(state.limit, ClockLimit::PowerCap);
                assert!(next_up > cap, "cap {cap}: one step up would have fitted");
            }
        }
        // At the lowest cap the clock falls to a fraction of its range.
        assert!(model.steady_state(512, 200.0, 1980, 3201.0).sm_mhz < 600);
    }

    #[test]
    fn a_lock_below_the_firmware_clock_binds_and_says_so() {
        let model = h200_8b(1024);
        let light = model.steady_state(16, 700.0, 1500, 3201.0);
        assert_eq!((light.sm_mhz, light.limit), (1500, ClockLimit::ClockLock));
        // A lock off the grid is rounded down to a supported clock.
        assert_eq!(model.steady_state(16, 700.0, 1507, 3201.0).sm_mhz, 1500);
        // Heavy load under a low cap: the cap, not the lock, holds the clock.
        let heavy = model.steady_state(512, 400.0, 1800, 3201.0);
        assert_eq!(heavy.limit, ClockLimit::PowerCap);
        assert!(heavy.sm_mhz < 1800);
        // A lock at the top never binds.
        assert_eq!(
            model.steady_state(16, 700.0, 1980, 3201.0).limit,
            ClockLimit::None
        );
    }

    /// A user profile for a smaller card, and the built-ins: no step beats the weights over the
    /// peak bandwidth, and the firmware keeps the power between idle and the cap.
    #[test]
    fn every_profile_gives_physically_possible_steps() {
        let fixture = GpuProfile::from_toml_str(
            include_str!("../../../profiles/fixtures/l40s-class.toml"),
            "l40s-class.toml",
        )
        .unwrap();
        let mut profiles: Vec<GpuProfile> = GpuProfile::built_in_names()
            .map(|name| GpuProfile::load(name).unwrap())
            .collect();
        profiles.push(fixture);
        for profile in &profiles {
            let peak = profile.memory.peak_bandwidth_tbs * 1e12;
            let mem_mhz = f64::from(profile.mem_max_mhz());
            let caps = &profile.power_cap;
            let lowest = profile.sm_clocks_mhz().last().copied().unwrap();
            for preset in ["llama-3.2-1b", "llama-3-8b"] {
                let shape = ModelShape::preset(preset).unwrap();
                for context in [1024, 4096] {
                    let fits = tokwatt_core::model::max_batch_that_fits(
                        &shape,
                        context,
                        profile.memory_bytes(),
                    )
                    .unwrap();
                    let cost = DecodeCost::new(&shape, context);
                    let model = DecodeModel::new(profile, &cost);
                    for batch in [1, 8, 64, 256, 512].map(|b: u32| b.min(fits)) {
                        let bytes =
                            cost.weight_bytes + f64::from(batch) * cost.kv_bytes_per_sequence;
                        for cap in [caps.min_w, caps.default_w, caps.max_w] {
                            let s = model.steady_state(batch, cap, u32::MAX, mem_mhz);
                            let at = format!(
                                "{} {preset} ctx {context} b{batch} cap {cap}: {s:?}",
                                profile.id
                            );
                            assert!(
                                s.step_s >= bytes / peak,
                                "{at}: faster than the peak bandwidth"
                            );
                            assert!(s.power_w >= 0.95 * profile.idle.power_w, "{at}: below idle");
                            assert!(
                                s.power_w <= cap || s.sm_mhz == lowest,
                                "{at}: above the cap"
                            );
                            assert!(s.power_w <= caps.max_w, "{at}: above the largest cap");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn context_length_and_memory_clock_slow_the_step() {
        let short = h200_8b(1024).point(64, 1980.0, 3201.0);
        let long = h200_8b(4096).point(64, 1980.0, 3201.0);
        assert!(long.step_s > short.step_s * 1.5);
        let slow_memory = h200_8b(1024).point(64, 1980.0, 2201.0);
        assert!(slow_memory.step_s > short.step_s * 1.3);
    }
}
