//! Plain data shared by every boundary. Nothing here knows about wasmtime, NVML or CUDA.

use serde::{Deserialize, Serialize};

/// Which knobs a policy may turn (granted by the operator's policy spec).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Knobs {
    pub power_cap: bool,
    pub sm_clock: bool,
    pub batch_size: bool,
    /// The workload's token budget per step (chunked prefill): only a workload that
    /// serves prompts has one ([`crate::workload::Workload::token_budget_range`]).
    #[serde(default)]
    pub token_budget: bool,
}

impl Knobs {
    /// Every knob.
    pub const fn all() -> Self {
        Self {
            power_cap: true,
            sm_clock: true,
            batch_size: true,
            token_budget: true,
        }
    }

    /// Whether no knob is set.
    pub const fn none(self) -> bool {
        !(self.power_cap || self.sm_clock || self.batch_size || self.token_budget)
    }

    /// The knobs set in either.
    pub const fn union(self, other: Knobs) -> Knobs {
        Knobs {
            power_cap: self.power_cap || other.power_cap,
            sm_clock: self.sm_clock || other.sm_clock,
            batch_size: self.batch_size || other.batch_size,
            token_budget: self.token_budget || other.token_budget,
        }
    }
}

/// NVML clock-event reasons, reduced to what a policy can act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ClockEvents {
    pub gpu_idle: bool,
    pub sw_power_cap: bool,
    pub hw_slowdown: bool,
    pub sw_thermal: bool,
    pub hw_thermal: bool,
    pub clock_setting: bool,
}

impl ClockEvents {
    /// Every reason seen in either.
    pub fn union(self, other: ClockEvents) -> ClockEvents {
        ClockEvents {
            gpu_idle: self.gpu_idle || other.gpu_idle,
            sw_power_cap: self.sw_power_cap || other.sw_power_cap,
            hw_slowdown: self.hw_slowdown || other.hw_slowdown,
            sw_thermal: self.sw_thermal || other.sw_thermal,
            hw_thermal: self.hw_thermal || other.hw_thermal,
            clock_setting: self.clock_setting || other.clock_setting,
        }
    }
}

/// Constraints and identity of one GPU, as its backend reports them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub simulated: bool,
    pub power_cap_min_w: f64,
    pub power_cap_max_w: f64,
    pub power_cap_default_w: f64,
    /// Supported SM clocks, highest first.
    pub sm_clocks_mhz: Vec<u32>,
    /// Supported memory clocks, highest first.
    pub mem_clocks_mhz: Vec<u32>,
}

impl DeviceInfo {
    pub fn sm_clock_max_mhz(&self) -> u32 {
        self.sm_clocks_mhz.iter().copied().max().unwrap_or(0)
    }
    pub fn sm_clock_min_mhz(&self) -> u32 {
        self.sm_clocks_mhz.iter().copied().min().unwrap_or(0)
    }
}

/// What a policy asks for one GPU. `None` leaves the knob as it is.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Settings {
    pub power_cap_w: Option<f64>,
    pub sm_clock_max_mhz: Option<u32>,
    pub batch_size: Option<u32>,
    /// Tokens one engine step may process. Written only where set, so the files of a
    /// run that never turns it keep their layout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_budget: Option<u32>,
}

/// For people: `power cap 450 W, SM clock ≤ 1500 MHz, batch 256, token budget 2048`,
/// naming only the knobs it changes (`unchanged` when none).
impl std::fmt::Display for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if let Some(cap) = self.power_cap_w {
            parts.push(format!("power cap {cap} W"));
        }
        if let Some(clock) = self.sm_clock_max_mhz {
            parts.push(format!("SM clock ≤ {clock} MHz"));
        }
        if let Some(batch) = self.batch_size {
            parts.push(format!("batch {batch}"));
        }
        if let Some(tokens) = self.token_budget {
            parts.push(format!("token budget {tokens}"));
        }
        if parts.is_empty() {
            f.write_str("unchanged")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

impl Settings {
    /// One GPU's settings after another, for people: `GPU 0: power cap 450 W; GPU 1: unchanged`.
    pub fn per_gpu(settings: &[Settings]) -> String {
        settings
            .iter()
            .enumerate()
            .map(|(gpu, s)| format!("GPU {gpu}: {s}"))
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// The settings actually in force on one GPU. The control loop's power cap and clock lock
/// are what it last read back from the device (at its start, after each change it makes,
/// after a stall; the enforced limit every tick), never what it asked for unread.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct InForce {
    /// The power limit the GPU enforces (what a policy sees as `power-cap-w`). Something
    /// outside tokwatt (another tool, a firmware limit) may hold it below the request.
    pub power_cap_w: f64,
    /// The power limit requested of the device (the driver's setting, whoever made it),
    /// as last read back. The envelope compares a new request with this one, never with
    /// the enforced limit, so a cap held lower from outside is not re-applied every tick.
    pub power_cap_requested_w: f64,
    /// Upper bound of the SM clock lock (the maximum supported clock when unlocked), as
    /// last read back.
    pub sm_clock_max_mhz: u32,
    pub batch_size: u32,
    /// Tokens one engine step may process; 0 where the workload has no token budget
    /// (it decodes only), and then not written.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub token_budget: u32,
}

fn is_zero(value: &u32) -> bool {
    *value == 0
}

/// What the telemetry backend saw on one GPU since the previous window was read.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct TelemetryWindow {
    /// Length of the window, seconds.
    pub interval_s: f64,
    /// Energy counter difference over the window (never integrated power samples).
    pub energy_j: f64,
    /// The energy counter at the end of the window, joules since the backend started.
    pub energy_counter_j: f64,
    /// NVML's 1 s averaged power reading at the end of the window.
    pub power_avg_reading_w: f64,
    /// Highest instantaneous power sample in the window.
    pub power_peak_w: f64,
    /// Median SM clock of the window's samples.
    pub sm_clock_mhz: u32,
    pub mem_clock_mhz: u32,
    pub temperature_c: f64,
    pub gpu_util_pct: f64,
    pub clock_events: ClockEvents,
    /// Power limit the GPU enforced at the end of the window.
    pub power_limit_enforced_w: f64,
    /// Power limit requested through NVML at the end of the window, where known.
    pub power_limit_requested_w: Option<f64>,
    /// Averaged memory power at the end of the window, where the GPU reports it.
    pub power_mem_avg_w: Option<f64>,
    /// Number of samples the window was built from.
    pub samples: u32,
}

/// What the workload did on one GPU since the previous window was read.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct WorkloadWindow {
    pub tokens: u64,
    /// Decode steps completed.
    pub steps: u64,
    /// Time per output token (one decode step), median and 99th percentile, ms.
    pub tpot_p50_ms: f64,
    pub tpot_p99_ms: f64,
    /// Sequences decoding together at the end of the window.
    pub active_sequences: u32,
    /// Requests waiting for a batch slot at the end of the window.
    pub queue_depth: u32,
    /// Batch size in force.
    pub batch_size: u32,
    /// What was asked of the workload, where the source knows it (the simulator's
    /// arrivals); `None` for a closed-loop source that generates its own work.
    pub demand: Option<DemandWindow>,
    /// Prompts, first tokens and energy per request, where the source serves requests
    /// with prompts and sees each one through; `None` where it does not (a decode-only
    /// loop).
    #[serde(default)]
    pub requests: Option<RequestsWindow>,
}

/// Upper bounds (joules) of the buckets of [`RequestEnergy`]; the last bucket is open.
pub const REQUEST_ENERGY_BUCKETS_J: [f64; 14] = [
    0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0,
];

/// Energy of the requests finished in one window, as a histogram: each step's energy
/// shared over the tokens it processed, summed over a request's prompt and output.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct RequestEnergy {
    pub count: u64,
    pub sum_j: f64,
    /// Requests at or under each bound of [`REQUEST_ENERGY_BUCKETS_J`] and above the one
    /// before; the last counts those above every bound.
    pub buckets: [u64; REQUEST_ENERGY_BUCKETS_J.len() + 1],
}

impl RequestEnergy {
    pub fn record(&mut self, joules: f64) {
        let joules = joules.max(0.0);
        self.count += 1;
        self.sum_j += joules;
        // The bounds ascend, so those under `joules` are the ones before its bucket: a
        // count without branches (the simulator records every finished request).
        let bucket = REQUEST_ENERGY_BUCKETS_J
            .iter()
            .filter(|&&bound| bound < joules)
            .count();
        self.buckets[bucket] += 1;
    }

    /// Add another window's requests.
    pub fn merge(&mut self, other: &RequestEnergy) {
        self.count += other.count;
        self.sum_j += other.sum_j;
        for (mine, theirs) in self.buckets.iter_mut().zip(other.buckets) {
            *mine += theirs;
        }
    }

    /// Mean joules per request; `None` with no request.
    pub fn mean_j(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum_j / self.count as f64)
    }
}

/// What a workload serving requests with prompts did in one window, besides decoding.
/// What the source cannot see is `None`, never a zero (a serving engine's metrics time
/// first tokens but know nothing of the energy each request drew).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct RequestsWindow {
    /// Prompt tokens processed (prefilled), recomputed ones included.
    pub prefill_tokens: u64,
    /// Requests that got their first token.
    pub first_tokens: u64,
    /// 99th percentile of the time from arrival to first token over those, ms; `None`
    /// when none got one.
    pub ttft_p99_ms: Option<f64>,
    /// Share of the busy time spent in steps that carried prompt tokens (0 to 1), where
    /// the source knows it.
    pub prefill_time_share: Option<f64>,
    /// Sequences pushed out of the KV cache for room, to be prefilled again, where the
    /// source counts them.
    pub preemptions: Option<u64>,
    /// Energy of the requests that finished, where the source attributes energy to
    /// requests (the simulator).
    pub energy: Option<RequestEnergy>,
}

/// The demand a workload faced in one window: what arrived, what it finished, what it
/// turned away, and how long admitted requests waited for a batch slot.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct DemandWindow {
    /// Requests that arrived (admitted to the queue or turned away).
    pub requests_arrived: u64,
    /// Requests that generated their last token.
    pub requests_completed: u64,
    /// Requests turned away because the queue was full: demand not served.
    pub requests_turned_away: u64,
    /// Tokens the arrivals asked for (turned-away ones included).
    pub tokens_demanded: u64,
    /// 99th percentile of the wait from arrival to a batch slot, over the requests that
    /// got a slot in the window, ms; `None` when none did.
    pub queue_wait_p99_ms: Option<f64>,
}

/// One GPU over one control interval, as handed to the policy.
///
/// JSON has no NaN: serde_json writes a non-finite number as `null` (an unknown TPOT is
/// NaN), so every float field reads `null` back as NaN, and a recorded observation
/// (`observations.jsonl`) round-trips.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    pub gpu: u32,
    pub tick: u64,
    #[serde(deserialize_with = "nan_if_null")]
    pub interval_s: f64,
    pub tokens: u64,
    #[serde(deserialize_with = "nan_if_null")]
    pub energy_j: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub tokens_per_joule: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub tokens_per_s: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub power_avg_w: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub power_peak_w: f64,
    pub sm_clock_mhz: u32,
    pub mem_clock_mhz: u32,
    #[serde(deserialize_with = "nan_if_null")]
    pub temperature_c: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub gpu_util_pct: f64,
    pub clock_events: ClockEvents,
    #[serde(deserialize_with = "nan_if_null")]
    pub tpot_p50_ms: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub tpot_p99_ms: f64,
    pub active_sequences: u32,
    pub queue_depth: u32,
    /// The demand in the window, where the workload knows it.
    pub demand: Option<DemandWindow>,
    /// Prompts, first tokens and energy per request in the window, where the workload
    /// sees requests through (`None`: a closed decode loop, an engine without TTFT).
    #[serde(default)]
    pub requests: Option<RequestsWindow>,
    pub in_force: InForce,
    pub last_clamped: bool,
    pub settling: bool,
}

impl Observation {
    /// A plausible observation of an H200 decoding at batch 128 near its power cap, for
    /// benchmarks (`tokwatt bench`) and tests.
    pub fn typical_h200(gpu: u32, tick: u64) -> Self {
        Self {
            gpu,
            tick,
            interval_s: 1.0,
            tokens: 11_876,
            energy_j: 690.0,
            tokens_per_joule: 17.2,
            tokens_per_s: 11_876.0,
            power_avg_w: 690.0,
            power_peak_w: 760.0,
            sm_clock_mhz: 1890,
            mem_clock_mhz: 3201,
            temperature_c: 55.0,
            gpu_util_pct: 100.0,
            clock_events: ClockEvents {
                sw_power_cap: true,
                ..ClockEvents::default()
            },
            tpot_p50_ms: 10.8,
            tpot_p99_ms: 11.2,
            active_sequences: 128,
            queue_depth: 40,
            demand: None,
            requests: None,
            in_force: InForce {
                power_cap_w: 700.0,
                power_cap_requested_w: 700.0,
                sm_clock_max_mhz: 1980,
                batch_size: 128,
                token_budget: 0,
            },
            last_clamped: false,
            settling: false,
        }
    }

    /// An interval of nothing on GPU `gpu` at `tick`: no tokens, no energy, an unknown
    /// latency (NaN), default settings, no demand known. For what needs an observation's
    /// shape rather than a measurement (the trace's column names).
    pub fn nothing(gpu: u32, tick: u64) -> Self {
        Self {
            gpu,
            tick,
            interval_s: 0.0,
            tokens: 0,
            energy_j: 0.0,
            tokens_per_joule: 0.0,
            tokens_per_s: 0.0,
            power_avg_w: 0.0,
            power_peak_w: 0.0,
            sm_clock_mhz: 0,
            mem_clock_mhz: 0,
            temperature_c: 0.0,
            gpu_util_pct: 0.0,
            clock_events: ClockEvents::default(),
            tpot_p50_ms: f64::NAN,
            tpot_p99_ms: f64::NAN,
            active_sequences: 0,
            queue_depth: 0,
            demand: None,
            requests: None,
            in_force: InForce::default(),
            last_clamped: false,
            settling: false,
        }
    }
}

/// Reads a number written by serde_json, where a NaN or infinity becomes `null`, back as
/// NaN (for `#[serde(deserialize_with)]` on `f64` fields that may be NaN).
pub fn nan_if_null<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(deserializer)?.unwrap_or(f64::NAN))
}

/// The operator's service objective.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Objective {
    /// Largest acceptable p99 time per output token, ms.
    pub tpot_p99_limit_ms: Option<f64>,
    /// Smallest acceptable throughput per GPU, tokens/s.
    pub min_tokens_per_s: Option<f64>,
    /// Largest acceptable p99 wait for a batch slot, ms (checked where the workload
    /// reports demand).
    #[serde(default)]
    pub queue_wait_p99_limit_ms: Option<f64>,
    /// Largest acceptable p99 time from a request's arrival to its first token, ms
    /// (needs a workload that reports it: a run whose workload cannot is refused).
    #[serde(default)]
    pub ttft_p99_limit_ms: Option<f64>,
}

impl Objective {
    /// Whether an observation breaks the objective. Idle intervals (no tokens) meet the
    /// latency bound; a window that turned demand away always breaks it, so a policy
    /// cannot buy tokens per joule by serving less than arrives.
    pub fn violated_by(&self, obs: &Observation) -> bool {
        self.violated_by_waiting(obs, crate::workload::WorkWaiting::Reported)
    }

    /// [`Objective::violated_by`] for a workload that says how it knows work is waiting:
    /// a closed loop always has work waiting, so its throughput floor is checked on every
    /// window (a queue depth of 0 would otherwise read as idle).
    pub fn violated_by_waiting(
        &self,
        obs: &Observation,
        waiting: crate::workload::WorkWaiting,
    ) -> bool {
        let queue_depth = match waiting {
            crate::workload::WorkWaiting::Always => obs.queue_depth.max(1),
            _ => obs.queue_depth,
        };
        self.violated_by_window(
            &WorkloadWindow {
                tokens: obs.tokens,
                tpot_p99_ms: obs.tpot_p99_ms,
                queue_depth,
                demand: obs.demand,
                requests: obs.requests,
                ..WorkloadWindow::default()
            },
            obs.interval_s,
        )
    }

    /// Whether tokens flowed under a TPOT bound but the window's TPOT is unknown (NaN:
    /// an external engine's histogram had no observation in it). The bound could not be
    /// checked: the loop counts such ticks apart, never as a met objective.
    pub fn tpot_unknown(&self, obs: &Observation) -> bool {
        self.tpot_p99_limit_ms.is_some() && obs.tokens > 0 && obs.tpot_p99_ms.is_nan()
    }

    /// [`Objective::violated_by`] for a workload window of `interval_s` seconds (the judge
    /// checks the oracle's windows with it, with no policy in the loop).
    pub fn violated_by_window(&self, w: &WorkloadWindow, interval_s: f64) -> bool {
        let tpot = self
            .tpot_p99_limit_ms
            .is_some_and(|limit| w.tokens > 0 && w.tpot_p99_ms > limit);
        let tokens_per_s = if interval_s > 0.0 {
            w.tokens as f64 / interval_s
        } else {
            0.0
        };
        let throughput = self
            .min_tokens_per_s
            .is_some_and(|min| w.queue_depth > 0 && tokens_per_s < min);
        let turned_away = w.demand.is_some_and(|d| d.requests_turned_away > 0);
        let queue_wait = match (self.queue_wait_p99_limit_ms, w.demand) {
            (Some(limit), Some(demand)) => demand.queue_wait_p99_ms.is_some_and(|w| w > limit),
            _ => false,
        };
        let ttft = match (self.ttft_p99_limit_ms, w.requests) {
            (Some(limit), Some(requests)) => requests.ttft_p99_ms.is_some_and(|t| t > limit),
            _ => false,
        };
        tpot || throughput || turned_away || queue_wait || ttft
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throughput_floor_is_checked_on_every_window_of_a_closed_loop() {
        use crate::workload::WorkWaiting;
        let objective = Objective {
            min_tokens_per_s: Some(20_000.0),
            ..Objective::default()
        };
        // Batch 1 on the CUDA decode: 231 tokens/s, and no queue to report.
        let obs = Observation {
            tokens: 231,
            interval_s: 1.0,
            queue_depth: 0,
            ..Observation::typical_h200(0, 0)
        };
        assert!(objective.violated_by_waiting(&obs, WorkWaiting::Always));
        assert!(
            !objective.violated_by_waiting(&obs, WorkWaiting::Reported),
            "an idle queue"
        );
        assert!(!objective.violated_by_waiting(
            &Observation {
                tokens: 25_000,
                ..obs
            },
            WorkWaiting::Always
        ));
    }

    #[test]
    fn a_ttft_bound_is_broken_by_a_window_whose_first_tokens_came_late() {
        let objective = Objective {
            ttft_p99_limit_ms: Some(500.0),
            ..Objective::default()
        };
        let window = |ttft_p99_ms: Option<f64>| WorkloadWindow {
            tokens: 1000,
            requests: Some(RequestsWindow {
                first_tokens: u64::from(ttft_p99_ms.is_some()),
                ttft_p99_ms,
                ..RequestsWindow::default()
            }),
            ..WorkloadWindow::default()
        };
        assert!(objective.violated_by_window(&window(Some(730.0)), 1.0));
        assert!(!objective.violated_by_window(&window(Some(420.0)), 1.0));
        // No first token in the window: nothing to judge (a run whose workload never
        // reports TTFT is refused before it starts).
        assert!(!objective.violated_by_window(&window(None), 1.0));
        // Through an observation, as the loop and the guard judge it.
        let late = Observation {
            requests: window(Some(730.0)).requests,
            ..Observation::typical_h200(0, 0)
        };
        assert!(objective.violated_by(&late));
        assert!(!Objective::default().violated_by(&late));
    }

    #[test]
    fn settings_read_as_words_naming_only_what_changes() {
        let all = Settings {
            power_cap_w: Some(450.0),
            sm_clock_max_mhz: Some(1500),
            batch_size: Some(256),
            token_budget: None,
        };
        assert_eq!(
            all.to_string(),
            "power cap 450 W, SM clock ≤ 1500 MHz, batch 256"
        );
        let budget = Settings {
            token_budget: Some(2048),
            ..all
        };
        assert_eq!(
            budget.to_string(),
            "power cap 450 W, SM clock ≤ 1500 MHz, batch 256, token budget 2048"
        );
        let batch_only = Settings {
            batch_size: Some(8),
            ..Settings::default()
        };
        assert_eq!(
            Settings::per_gpu(&[all, Settings::default(), batch_only]),
            "GPU 0: power cap 450 W, SM clock ≤ 1500 MHz, batch 256; GPU 1: unchanged; GPU 2: batch 8"
        );
    }

    fn busy_observation(demand: Option<DemandWindow>) -> Observation {
        Observation {
            tokens: 100,
            tpot_p99_ms: 10.0,
            demand,
            ..Observation::typical_h200(0, 0)
        }
    }

    #[test]
    fn a_tick_that_turns_demand_away_breaks_the_objective() {
        let objective = Objective::default();
        let served = DemandWindow {
            requests_arrived: 5,
            ..DemandWindow::default()
        };
        assert!(!objective.violated_by(&busy_observation(Some(served))));
        let turned_away = DemandWindow {
            requests_turned_away: 1,
            ..served
        };
        assert!(objective.violated_by(&busy_observation(Some(turned_away))));
        // Without demand figures there is nothing to judge it by.
        assert!(!objective.violated_by(&busy_observation(None)));
    }

    #[test]
    fn an_unknown_tpot_under_a_tpot_bound_is_neither_met_nor_violated() {
        let bounded = Objective {
            tpot_p99_limit_ms: Some(20.0),
            ..Objective::default()
        };
        let unknown = Observation {
            tpot_p99_ms: f64::NAN,
            ..busy_observation(None)
        };
        assert!(bounded.tpot_unknown(&unknown));
        assert!(!bounded.violated_by(&unknown));
        assert!(!bounded.tpot_unknown(&busy_observation(None)));
        let idle = Observation {
            tokens: 0,
            ..unknown
        };
        assert!(!bounded.tpot_unknown(&idle));
        assert!(!Objective::default().tpot_unknown(&unknown));
    }

    #[test]
    fn the_queue_wait_bound_is_checked_where_demand_is_known() {
        let objective = Objective {
            queue_wait_p99_limit_ms: Some(500.0),
            ..Objective::default()
        };
        let wait = |ms| DemandWindow {
            queue_wait_p99_ms: Some(ms),
            ..DemandWindow::default()
        };
        assert!(!objective.violated_by(&busy_observation(Some(wait(400.0)))));
        assert!(objective.violated_by(&busy_observation(Some(wait(600.0)))));
    }
}
