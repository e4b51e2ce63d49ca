//! The oracle: for each demand phase of a scenario, the best power cap × SM clock × batch
//! size that honours the objective and serves the demand, found on the same simulator the
//! policies are judged on. For judging only: it sees the phase's arrival rate in advance.
//!
//! The search has two stages, so it stays exhaustive yet fast:
//!
//! 1. **Every** cap (25 W steps over the device range), supported SM clock and batch size
//!    of the grid is scored with the simulator's own decode model in steady state: the
//!    fewest active sequences whose throughput meets the demand (Little's law), the step
//!    time they take (the TPOT) and the power they draw. Settings that cannot serve the
//!    demand or break the TPOT bound are dropped; the rest are ranked by tokens per joule.
//! 2. The best-ranked distinct operating points are **simulated** for the phase at fixed
//!    settings (arrivals, queueing, step jitter, the firmware's clock control), judged on
//!    the simulator's true energy, and the best one that keeps the objective on ≥ 99 % of
//!    its ticks and turns nothing away wins.
//!
//! One file because it is one search over one model: the steady-state model stage 1 scores
//! with (`Requests`, the capacities and latency floors `family.rs` draws scenarios against)
//! and stage 2's fixed-settings runs (`FixedRun`) define the oracle together.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::scenario::EvalScenario;
use tokwatt_core::actuator::Actuator;
use tokwatt_core::clock::{Clock, VirtualClock};
use tokwatt_core::telemetry::Telemetry;
use tokwatt_core::workload::Workload;
use tokwatt_sim::model::{SteadyState, StepLoad};
use tokwatt_sim::{DecodeCost, DecodeModel, Phase, SimConfig, SimError, SimGpu};

/// Power cap grid step, watts (Zeus profiles limits in the same steps).
const CAP_STEP_W: f64 = 25.0;
/// Operating points simulated per round, and rounds before giving up on the ranking.
const VERIFY_PER_ROUND: usize = 6;
const VERIFY_ROUNDS: usize = 4;
/// A verification run: settle, then measure (or the phase's own length, if shorter).
const VERIFY_SETTLE_S: f64 = 20.0;
/// ... or two request lifetimes, if longer (up to this): the sequences in flight build up
/// over a lifetime, and a run measured before they have shows a load the setting never
/// carries (a reasoning model's 2,000-token outputs live a minute or more).
const VERIFY_SETTLE_MAX_S: f64 = 300.0;

/// The settling time of a verification run of a setting whose steps take `step_s`.
fn settle_s(requests: &Requests, step_s: f64) -> f64 {
    let lifetime_s = requests.output_mean * step_s;
    if lifetime_s.is_finite() {
        VERIFY_SETTLE_S
            .max(2.0 * lifetime_s)
            .min(VERIFY_SETTLE_MAX_S)
    } else {
        VERIFY_SETTLE_MAX_S
    }
}
const VERIFY_MEASURE_S: f64 = 90.0;
/// Settings run over the whole phase (with prompts), those that passed a verification run
/// first, then on up the steady-state ranking and last the most capable, skipping any no
/// more capable than one that failed, until one keeps the objective there: at most this
/// many.
const WHOLE_PHASE_CONFIRMATIONS: usize = 8;
/// Ticks of a verification run that may break the objective.
const VERIFY_VIOLATION_ALLOWANCE: f64 = 0.01;

/// Settings for one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct OracleSetting {
    pub power_cap_w: f64,
    /// The SM clock lock's upper bound (the highest supported clock: no lock).
    pub sm_clock_max_mhz: u32,
    pub batch_size: u32,
}

/// The oracle's choice for one demand phase.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseOracle {
    pub start_s: f64,
    pub end_s: f64,
    pub arrival_rps: f64,
    pub setting: OracleSetting,
    /// The decode model's steady-state estimate.
    pub predicted_tokens_per_joule: f64,
    pub predicted_tpot_ms: f64,
    /// Measured on a simulated run of the phase at these settings (true energy).
    pub simulated_tokens_per_joule: f64,
    pub simulated_violation_fraction: f64,
    /// False when no setting served the demand within the objective; the setting is then
    /// the one that came closest.
    pub feasible: bool,
    pub settings_scored: usize,
    pub settings_simulated: usize,
}

/// One candidate of stage 1.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    setting: OracleSetting,
    tokens_per_joule: f64,
    /// The steady state's power (with nothing to run, on an idle phase).
    power_w: f64,
    tpot_s: f64,
    /// The operating point (firmware clock, active sequences): candidates sharing it are
    /// the same point, and only the first is simulated.
    point: (u32, u32),
}

/// What a verification run measured.
#[derive(Debug, Clone, Copy)]
struct Verified {
    tokens_per_joule: f64,
    /// Mean power over the measured span: what tells settings apart where no token is
    /// asked for.
    power_w: f64,
    violation_fraction: f64,
    turned_away: u64,
}

impl Verified {
    fn feasible(&self) -> bool {
        self.turned_away == 0 && self.violation_fraction <= VERIFY_VIOLATION_ALLOWANCE
    }

    /// Nearer to keeping the objective than `other`, where neither does: fewer requests
    /// turned away, then fewer ticks over.
    fn closer_than(&self, other: &Verified) -> bool {
        (self.turned_away, self.violation_fraction) < (other.turned_away, other.violation_fraction)
    }

    /// More tokens per joule, or as many for less power.
    fn better_than(&self, other: &Verified) -> bool {
        self.tokens_per_joule > other.tokens_per_joule
            || (self.tokens_per_joule == other.tokens_per_joule && self.power_w < other.power_w)
    }
}

/// Batch sizes of the grid: every size up to 16, then steps of ~12 %, and the maximum.
pub fn batch_grid(max: u32) -> Vec<u32> {
    let mut sizes: Vec<u32> = (1..=16.min(max)).collect();
    let mut b = 16.0_f64;
    loop {
        b = (b * 1.125).ceil();
        let size = b as u32;
        if size >= max {
            break;
        }
        sizes.push(size);
    }
    sizes.push(max);
    sizes.dedup();
    sizes
}

/// The cap grid: the device range in 25 W steps from the maximum down, and the minimum.
pub fn cap_grid(min_w: f64, max_w: f64) -> Vec<f64> {
    let mut caps = Vec::new();
    let mut cap = max_w;
    while cap > min_w + 1e-9 {
        caps.push(cap);
        cap -= CAP_STEP_W;
    }
    caps.push(min_w);
    caps
}

/// The simulator's decode model for `scenario`'s GPU, model shape and context (with
/// prompts: the mean context over a request's decode).
fn decode_model(scenario: &EvalScenario) -> DecodeModel {
    DecodeModel::new(
        &scenario.profile,
        &DecodeCost::new(&scenario.workload.model, scenario.workload.context_tokens),
    )
}

/// What each request asks of the GPU, for the steady-state model: decode only, or a
/// prompt to prefill (in chunks beside the decoding sequences) and then an output.
#[derive(Debug, Clone)]
struct Requests {
    /// Mean prompt tokens (0: decode only).
    prompt_mean: f64,
    /// Prompt lengths drawn once, sorted: the quantiles the tail latencies need.
    prompt_sample: Vec<u32>,
    output_mean: f64,
    /// KV positions a decoding sequence attends to, on average.
    context_mean: f64,
    /// Tokens one step may process (decode tokens first, then prompt chunks).
    step_budget: f64,
}

impl Requests {
    fn of(scenario: &EvalScenario) -> Self {
        let workload = &scenario.workload;
        match &workload.requests {
            None => Requests {
                prompt_mean: 0.0,
                prompt_sample: Vec::new(),
                output_mean: f64::from(workload.output_tokens.max(1)),
                context_mean: f64::from(workload.context_tokens),
                step_budget: f64::INFINITY,
            },
            Some(lengths) => {
                let prompt_mean = lengths.prompt.mean();
                let output_mean = lengths.output.mean().max(1.0);
                Requests {
                    prompt_mean,
                    prompt_sample: lengths.prompt.sorted_sample(PROMPT_SAMPLE),
                    output_mean,
                    context_mean: prompt_mean + output_mean / 2.0,
                    step_budget: f64::from(workload.max_batched_tokens),
                }
            }
        }
    }

    fn has_prompts(&self) -> bool {
        self.prompt_mean > 0.0
    }

    /// The `q` quantile of the prompt length (0 without prompts).
    fn prompt_quantile(&self, q: f64) -> f64 {
        let n = self.prompt_sample.len();
        if n == 0 {
            return 0.0;
        }
        let index = ((q.clamp(0.0, 1.0) * n as f64) as usize).min(n - 1);
        f64::from(self.prompt_sample[index])
    }

    /// The prompt that sets a one-second window's p99 at `rate` requests/s: the
    /// objective is checked on every tick's window, and one step carrying a long
    /// prompt's chunk sets that window's TPOT p99 (and the prompt's own TTFT its TTFT
    /// p99). For at most 1 % of windows to hold one, it is the prompt longer than all but
    /// `0.01 / rate` of them.
    fn tail_prompt(&self, rate: f64) -> f64 {
        self.prompt_quantile((1.0 - 0.01 / rate.max(1e-3)).clamp(0.5, 0.999))
    }
}

/// Prompt lengths drawn to read quantiles from (the 99.9th is then 20 draws deep).
const PROMPT_SAMPLE: usize = 20_000;

/// The steady state of `decoding` sequences at fixed settings: decode only, or with the
/// prompt chunks that keep up with them (prompt over output tokens per decoded token).
fn serving_state(
    model: &DecodeModel,
    requests: &Requests,
    decoding: u32,
    cap_w: f64,
    clock_mhz: u32,
    mem_mhz: f64,
) -> SteadyState {
    if !requests.has_prompts() {
        return model.steady_state(decoding, cap_w, clock_mhz, mem_mhz);
    }
    let n = f64::from(decoding);
    let prefill = n * requests.prompt_mean / requests.output_mean;
    let load = StepLoad {
        decode: decoding,
        decode_positions: n * requests.context_mean,
        // The steady state's typical row, not its longest.
        decode_position_max: if decoding > 0 {
            requests.context_mean
        } else {
            0.0
        },
        prefill,
        // Causal: a prompt token attends to the half of its prompt before it, on average.
        prefill_positions: prefill * requests.prompt_mean / 2.0,
    };
    model.steady_state_load(&load, cap_w, clock_mhz, mem_mhz)
}

/// With prompts, the TPOT p99 and TTFT p99 the steady state implies when `prompt` (see
/// [`Requests::tail_prompt`]) arrives: its chunks ride beside the decoding sequences, one a step.
/// Decode only: the step.
#[allow(clippy::too_many_arguments)] // one operating point, spelled out
fn tail_latencies(
    model: &DecodeModel,
    requests: &Requests,
    decoding: u32,
    state: &SteadyState,
    prompt: f64,
    cap_w: f64,
    clock_mhz: u32,
    mem_mhz: f64,
) -> (f64, f64) {
    if !requests.has_prompts() || prompt <= 0.0 {
        return (state.step_s, 0.0);
    }
    let chunk_room = (requests.step_budget - f64::from(decoding)).max(1.0);
    let chunk = prompt.min(chunk_room);
    let load = StepLoad {
        decode: decoding,
        decode_positions: f64::from(decoding) * requests.context_mean,
        decode_position_max: if decoding > 0 {
            requests.context_mean
        } else {
            0.0
        },
        prefill: chunk,
        prefill_positions: chunk * prompt / 2.0,
    };
    let clock = model.firmware_clock_load(&load, cap_w, clock_mhz, mem_mhz);
    let chunk_step = model
        .point_load(&load, f64::from(clock.sm_mhz), mem_mhz)
        .step_s;
    let ttft = (prompt / chunk_room).ceil().max(1.0) * chunk_step;
    (chunk_step.max(state.step_s), ttft)
}

/// The most requests per second `scenario`'s GPU serves within its TPOT and TTFT bounds
/// (with 10 % headroom for the p99's jitter), by the decode model in steady state (with
/// prompts: their chunks beside the decoding sequences): no cap, no clock lock, any batch
/// up to the workload's largest. The scale a scenario family draws demand on; the
/// oracle's search, not this, says whether a drawn phase is feasible.
pub fn capacity_rps(scenario: &EvalScenario) -> f64 {
    capacity_at(scenario, scenario.profile.power_cap.max_w, None)
}

/// [`capacity_rps`] at cap `cap_w` and under an SM clock lock (none: the top clock).
pub fn capacity_at(scenario: &EvalScenario, cap_w: f64, clock_mhz: Option<u32>) -> f64 {
    let profile = &scenario.profile;
    let workload = &scenario.workload;
    let model = decode_model(scenario);
    let requests = Requests::of(scenario);
    let mem_mhz = f64::from(profile.mem_max_mhz());
    let clock = clock_mhz.unwrap_or_else(|| model.sm_grid().first().copied().unwrap_or(0));
    let limit = |ms: Option<f64>| ms.map_or(f64::INFINITY, |ms| 0.9 * ms * 1e-3);
    let tpot_limit_s = limit(scenario.objective.tpot_p99_limit_ms);
    let ttft_limit_s = limit(scenario.objective.ttft_p99_limit_ms);
    batch_grid(workload.batch_size_max)
        .into_iter()
        .filter_map(|batch| {
            let state = serving_state(&model, &requests, batch, cap_w, clock, mem_mhz);
            let rate = state.tokens_per_s / requests.output_mean;
            let prompt = requests.tail_prompt(rate);
            let (tpot, ttft) = tail_latencies(
                &model, &requests, batch, &state, prompt, cap_w, clock, mem_mhz,
            );
            (tpot <= tpot_limit_s && ttft <= ttft_limit_s).then_some(rate)
        })
        .fold(0.0, f64::max)
}

/// The step time of one sequence alone at the top clock and no cap: the fastest a token
/// can come, the floor a TPOT bound is drawn above.
pub fn single_sequence_tpot_ms(scenario: &EvalScenario) -> f64 {
    let profile = &scenario.profile;
    let model = decode_model(scenario);
    let top_clock = model.sm_grid().first().copied().unwrap_or(0);
    model
        .steady_state(
            1,
            profile.power_cap.max_w,
            top_clock,
            f64::from(profile.mem_max_mhz()),
        )
        .step_s
        * 1e3
}

/// The TPOT p99 and TTFT p99 (ms) of one sequence decoding beside the prompt that sets a
/// window's p99 at `rate` requests/s, at the top clock and no cap: the floors a family
/// draws its bounds above. Decode only: the lone sequence's step, and no TTFT.
pub fn latency_floors_ms(scenario: &EvalScenario, rate: f64) -> (f64, Option<f64>) {
    let profile = &scenario.profile;
    let model = decode_model(scenario);
    let requests = Requests::of(scenario);
    let top_clock = model.sm_grid().first().copied().unwrap_or(0);
    let mem_mhz = f64::from(profile.mem_max_mhz());
    let cap = profile.power_cap.max_w;
    let state = serving_state(&model, &requests, 1, cap, top_clock, mem_mhz);
    let prompt = requests.tail_prompt(rate);
    let (tpot, ttft) = tail_latencies(
        &model, &requests, 1, &state, prompt, cap, top_clock, mem_mhz,
    );
    (tpot * 1e3, requests.has_prompts().then_some(ttft * 1e3))
}

/// The time to first token of a lone median prompt at the top clock and no cap: the
/// floor a TTFT bound is drawn above (none without prompts).
pub fn single_prompt_ttft_ms(scenario: &EvalScenario) -> Option<f64> {
    let requests = Requests::of(scenario);
    if !requests.has_prompts() {
        return None;
    }
    let profile = &scenario.profile;
    let model = decode_model(scenario);
    let top_clock = model.sm_grid().first().copied().unwrap_or(0);
    let prompt = requests.prompt_quantile(0.5);
    let chunk = prompt.min(requests.step_budget);
    let load = StepLoad {
        prefill: chunk,
        prefill_positions: chunk * prompt / 2.0,
        ..StepLoad::default()
    };
    let step = model
        .steady_state_load(
            &load,
            profile.power_cap.max_w,
            top_clock,
            f64::from(profile.mem_max_mhz()),
        )
        .step_s;
    Some((prompt / requests.step_budget).ceil().max(1.0) * step * 1e3)
}

/// Whether some phase is one no setting serves: the scenario is an overload, judged on
/// served demand first.
pub fn is_overload(phases: &[PhaseOracle]) -> bool {
    phases.iter().any(|phase| !phase.feasible)
}

/// The oracle's share of ticks over the objective, weighted by phase length (from its
/// verification runs); NaN without phases.
pub fn violation_fraction(phases: &[PhaseOracle]) -> f64 {
    let total: f64 = phases.iter().map(|p| p.end_s - p.start_s).sum();
    if total <= 0.0 {
        return f64::NAN;
    }
    phases
        .iter()
        .map(|p| p.simulated_violation_fraction * (p.end_s - p.start_s))
        .sum::<f64>()
        / total
}

/// The oracle of every phase of `scenario` over its first `duration_s` seconds.
pub fn search(
    scenario: &EvalScenario,
    duration_s: f64,
    seed: u64,
) -> Result<Vec<PhaseOracle>, SimError> {
    scenario
        .phase_spans(duration_s)
        .into_iter()
        .enumerate()
        .map(|(index, (start_s, end_s, rate))| {
            let outside = scenario
                .workload
                .phases
                .get(index)
                .and_then(|p| p.outside_power_limit_w);
            search_phase(scenario, start_s, end_s, rate, outside, seed)
        })
        .collect()
}

fn search_phase(
    scenario: &EvalScenario,
    start_s: f64,
    end_s: f64,
    rate: f64,
    outside_limit_w: Option<f64>,
    seed: u64,
) -> Result<PhaseOracle, SimError> {
    let candidates = score_all(scenario, rate, outside_limit_w);
    let settings_scored = candidates.len();
    let mut distinct = Vec::new();
    for candidate in candidates.iter().filter(|c| c.tpot_s.is_finite()) {
        if !distinct
            .iter()
            .any(|d: &Candidate| d.point == candidate.point)
        {
            distinct.push(*candidate);
        }
    }
    let measure_s = (end_s - start_s).min(VERIFY_MEASURE_S);
    let requests = Requests::of(scenario);
    let mut simulated = 0;
    let mut closest: Option<(Candidate, Verified)> = None;
    let mut best: Option<(Candidate, Verified)> = None;
    let mut passed: Vec<(Candidate, Verified)> = Vec::new();
    for round in distinct.chunks(VERIFY_PER_ROUND).take(VERIFY_ROUNDS) {
        for candidate in round {
            let verified = simulate(
                scenario,
                rate,
                outside_limit_w,
                candidate.setting,
                settle_s(&requests, candidate.tpot_s),
                measure_s,
                seed,
            )?;
            simulated += 1;
            if verified.feasible() {
                passed.push((*candidate, verified));
                if best.is_none_or(|(_, b)| verified.better_than(&b)) {
                    best = Some((*candidate, verified));
                }
            } else if closest.is_none_or(|(_, c)| verified.closer_than(&c)) {
                closest = Some((*candidate, verified));
            }
        }
        if best.is_some() {
            break;
        }
    }
    // Nothing the steady-state ranking offered kept the objective: its tails are too
    // hopeful here (a window's TTFT p99 swings with the prompts it holds). Before calling
    // the phase an overload, the most capable setting is run, and if it keeps the
    // objective, the lowest clock under it that does too: the oracle must not take a
    // schedule that breaks an objective some setting keeps.
    if best.is_none() {
        let climbed = climb_to_feasible(
            scenario,
            rate,
            outside_limit_w,
            &requests,
            closest.map(|(c, _)| c.setting.sm_clock_max_mhz),
            measure_s,
            seed,
        )?;
        simulated += climbed.simulated;
        if let Some(found) = climbed.found {
            passed.push(found);
            best = Some(found);
        } else if let Some(top) = climbed.top
            && closest.is_none_or(|(_, c)| top.1.closer_than(&c))
        {
            closest = Some(top);
        }
    }
    // With prompts, a setting can pass a short run and still fail the phase: the KV cache
    // of the sequences in flight grows as they decode, and a setting at the edge fills the
    // memory after minutes, then preempts and recomputes until the queue runs over. The
    // best that passed are run over the whole phase too, best first, and the first that
    // keeps the objective there wins.
    let phase_s = end_s - start_s;
    if requests.has_prompts() && phase_s > measure_s + 1.0 && best.is_some() {
        passed.sort_by(|(_, a), (_, b)| {
            b.tokens_per_joule
                .total_cmp(&a.tokens_per_joule)
                .then(a.power_w.total_cmp(&b.power_w))
        });
        best = None;
        let mut failed: Vec<OracleSetting> = Vec::new();
        // A setting no more capable than one that failed the phase fails it too.
        let outclassed = |setting: &OracleSetting, failed: &[OracleSetting]| {
            failed.iter().any(|f| {
                setting.sm_clock_max_mhz <= f.sm_clock_max_mhz
                    && setting.power_cap_w <= f.power_cap_w
                    && setting.batch_size <= f.batch_size
            })
        };
        let mut confirmations = 0;
        // The settings that passed the short run first; should they all fail the phase,
        // on up the steady-state ranking past them (more capable ones come later in it),
        // and last the most capable setting of all.
        let most = Candidate {
            setting: most_capable(scenario),
            tokens_per_joule: f64::NAN,
            power_w: f64::NAN,
            tpot_s: f64::NAN,
            point: (0, 0),
        };
        let order = passed
            .iter()
            .map(|(candidate, _)| *candidate)
            .chain(distinct.iter().copied())
            .chain(std::iter::once(most));
        let mut tried: Vec<OracleSetting> = Vec::new();
        for candidate in order {
            if confirmations == WHOLE_PHASE_CONFIRMATIONS {
                break;
            }
            // The last confirmation is kept for the most capable setting; past the ones
            // that passed the short run, the clock climbs by halves of what is left
            // above the highest that failed (a bisection, not a walk).
            let last_one = confirmations + 1 == WHOLE_PHASE_CONFIRMATIONS;
            let past_passed = !passed.iter().any(|(p, _)| p.setting == candidate.setting);
            let highest_failed = failed.iter().map(|f| f.sm_clock_max_mhz).max();
            let below_half = highest_failed.is_some_and(|h| {
                let top = most.setting.sm_clock_max_mhz;
                past_passed && candidate.setting.sm_clock_max_mhz < h + (top.saturating_sub(h)) / 2
            });
            if tried.contains(&candidate.setting)
                || outclassed(&candidate.setting, &failed)
                || below_half
                || (last_one && candidate.setting != most.setting)
            {
                continue;
            }
            tried.push(candidate.setting);
            let candidate = &candidate;
            confirmations += 1;
            let whole = simulate(
                scenario,
                rate,
                outside_limit_w,
                candidate.setting,
                settle_s(&requests, candidate.tpot_s),
                phase_s,
                seed,
            )?;
            simulated += 1;
            if whole.feasible() {
                best = Some((*candidate, whole));
                break;
            }
            failed.push(candidate.setting);
            if closest.is_none_or(|(_, c)| whole.closer_than(&c)) {
                closest = Some((*candidate, whole));
            }
        }
    }
    let feasible = best.is_some();
    let (candidate, verified) = match best.or(closest) {
        Some(found) => found,
        // Nothing serves the demand at any setting: the most capable one (no cap, no
        // lock, the largest batch) comes closest.
        None => {
            let setting = most_capable(scenario);
            let verified = simulate(
                scenario,
                rate,
                outside_limit_w,
                setting,
                VERIFY_SETTLE_S,
                measure_s,
                seed,
            )?;
            simulated += 1;
            (
                Candidate {
                    setting,
                    tokens_per_joule: f64::NAN,
                    power_w: f64::NAN,
                    tpot_s: f64::NAN,
                    point: (0, 0),
                },
                verified,
            )
        }
    };
    Ok(PhaseOracle {
        start_s,
        end_s,
        arrival_rps: rate,
        setting: candidate.setting,
        predicted_tokens_per_joule: candidate.tokens_per_joule,
        predicted_tpot_ms: candidate.tpot_s * 1e3,
        simulated_tokens_per_joule: verified.tokens_per_joule,
        simulated_violation_fraction: verified.violation_fraction,
        feasible,
        settings_scored,
        settings_simulated: simulated,
    })
}

/// The default settings over the whole run, as one phase: no cap below the maximum, no
/// clock lock, the workload's starting batch size. What a GPU runs when nobody tunes it.
pub fn default_settings(scenario: &EvalScenario, duration_s: f64) -> PhaseOracle {
    PhaseOracle {
        start_s: 0.0,
        end_s: duration_s,
        arrival_rps: f64::NAN,
        setting: OracleSetting {
            power_cap_w: scenario.profile.power_cap.max_w,
            sm_clock_max_mhz: scenario.profile.sm_max_mhz(),
            batch_size: scenario.workload.initial_batch_size,
        },
        predicted_tokens_per_joule: f64::NAN,
        predicted_tpot_ms: f64::NAN,
        simulated_tokens_per_joule: f64::NAN,
        simulated_violation_fraction: f64::NAN,
        feasible: true,
        settings_scored: 0,
        settings_simulated: 0,
    }
}

/// Verification runs a climb may make below the most capable setting: a bisection of a
/// hundred-odd clocks closes to a few rungs in this many.
const CLIMB_STEPS: usize = 5;

/// What [`climb_to_feasible`] found.
struct Climb {
    /// The lowest clock found (at the most capable cap and batch) that kept the objective.
    found: Option<(Candidate, Verified)>,
    /// The most capable setting's run, when even it broke the objective.
    top: Option<(Candidate, Verified)>,
    simulated: usize,
}

/// Runs the most capable setting; if it keeps the objective, bisects the clock between
/// `failed_mhz` (a clock that broke it, if one is known) and the top for the lowest that
/// keeps it too, at the most capable cap and batch.
fn climb_to_feasible(
    scenario: &EvalScenario,
    rate: f64,
    outside_limit_w: Option<f64>,
    requests: &Requests,
    failed_mhz: Option<u32>,
    measure_s: f64,
    seed: u64,
) -> Result<Climb, SimError> {
    let model = decode_model(scenario);
    let mem_mhz = f64::from(scenario.profile.mem_max_mhz());
    let most = most_capable(scenario);
    let enforced = outside_limit_w.map_or(most.power_cap_w, |o| most.power_cap_w.min(o));
    let at = |clock: u32| -> (Candidate, f64) {
        let setting = OracleSetting {
            sm_clock_max_mhz: clock,
            ..most
        };
        let state = serving_state(&model, requests, most.batch_size, enforced, clock, mem_mhz);
        let candidate = Candidate {
            setting,
            tokens_per_joule: f64::NAN,
            power_w: state.power_w,
            tpot_s: state.step_s,
            point: (clock, most.batch_size),
        };
        (candidate, settle_s(requests, state.step_s))
    };
    let mut simulated = 0;
    let (top_candidate, top_settle) = at(most.sm_clock_max_mhz);
    let top = simulate(
        scenario,
        rate,
        outside_limit_w,
        most,
        top_settle,
        measure_s,
        seed,
    )?;
    simulated += 1;
    if !top.feasible() {
        return Ok(Climb {
            found: None,
            top: Some((top_candidate, top)),
            simulated,
        });
    }
    let clocks: Vec<u32> = model
        .sm_grid()
        .iter()
        .copied()
        .filter(|&c| c <= most.sm_clock_max_mhz)
        .collect();
    // Indices into `clocks`: `lo` broke the objective (or is below the ladder), `hi` kept it.
    let mut hi = clocks.len().saturating_sub(1);
    let mut lo = failed_mhz.map_or(0, |f| clocks.partition_point(|&c| c <= f));
    let mut found = (top_candidate, top);
    for _ in 0..CLIMB_STEPS {
        if hi <= lo + 1 {
            break;
        }
        let mid = lo + (hi - lo) / 2;
        let (candidate, settle) = at(clocks[mid]);
        let verified = simulate(
            scenario,
            rate,
            outside_limit_w,
            candidate.setting,
            settle,
            measure_s,
            seed,
        )?;
        simulated += 1;
        if verified.feasible() {
            hi = mid;
            found = (candidate, verified);
        } else {
            lo = mid;
        }
    }
    Ok(Climb {
        found: Some(found),
        top: None,
        simulated,
    })
}

fn most_capable(scenario: &EvalScenario) -> OracleSetting {
    OracleSetting {
        power_cap_w: scenario.profile.power_cap.max_w,
        sm_clock_max_mhz: scenario.profile.sm_max_mhz(),
        batch_size: scenario.workload.batch_size_max,
    }
}

/// Stage 1: every setting of the grid in steady state, feasible ones ranked best first.
/// An idle phase (no demand) ranks the settings by the power of a GPU with nothing to
/// run: tokens per joule cannot tell them apart, the energy bill can.
fn score_all(scenario: &EvalScenario, rate: f64, outside_limit_w: Option<f64>) -> Vec<Candidate> {
    let profile = &scenario.profile;
    let workload = &scenario.workload;
    let model = decode_model(scenario);
    let requests = Requests::of(scenario);
    let mem_mhz = f64::from(profile.mem_max_mhz());
    let demand_tokens_per_s = rate * requests.output_mean;
    let limit = |ms: Option<f64>| ms.map_or(f64::INFINITY, |ms| ms * 1e-3);
    let tpot_limit_s = limit(scenario.objective.tpot_p99_limit_ms);
    let ttft_limit_s = limit(scenario.objective.ttft_p99_limit_ms);
    let caps = cap_grid(profile.power_cap.min_w, profile.power_cap.max_w);
    let batches = batch_grid(workload.batch_size_max);
    let clocks = model.sm_grid().to_vec();
    let prompt = requests.tail_prompt(rate);
    let mut candidates = Vec::new();
    if demand_tokens_per_s <= 0.0 {
        for &clock in &clocks {
            let idle = model.point(0, f64::from(clock), mem_mhz);
            candidates.push(Candidate {
                setting: OracleSetting {
                    power_cap_w: profile.power_cap.max_w,
                    sm_clock_max_mhz: clock,
                    batch_size: workload.batch_size_max,
                },
                tokens_per_joule: 0.0,
                power_w: idle.power_w,
                tpot_s: 0.0,
                point: (clock, 0),
            });
        }
        candidates.sort_by(|a, b| a.power_w.total_cmp(&b.power_w));
        return candidates;
    }
    for &cap in &caps {
        let enforced = outside_limit_w.map_or(cap, |outside| cap.min(outside));
        for &clock in &clocks {
            for &batch in &batches {
                let setting = OracleSetting {
                    power_cap_w: cap,
                    sm_clock_max_mhz: clock,
                    batch_size: batch,
                };
                let state = |n: u32| serving_state(&model, &requests, n, enforced, clock, mem_mhz);
                if state(batch).tokens_per_s < demand_tokens_per_s {
                    continue; // cannot keep up: the queue would grow until requests are turned away
                }
                // The fewest active sequences that keep up (throughput grows with them).
                let (mut lo, mut hi) = (1, batch);
                while lo < hi {
                    let mid = lo + (hi - lo) / 2;
                    if state(mid).tokens_per_s >= demand_tokens_per_s {
                        hi = mid;
                    } else {
                        lo = mid + 1;
                    }
                }
                let at = state(lo);
                let (tpot_s, ttft_s) =
                    tail_latencies(&model, &requests, lo, &at, prompt, enforced, clock, mem_mhz);
                if tpot_s > tpot_limit_s || ttft_s > ttft_limit_s {
                    continue;
                }
                let served = demand_tokens_per_s.min(at.tokens_per_s);
                // Prompt tokens cost energy too: the step's power covers both phases.
                candidates.push(Candidate {
                    setting,
                    tokens_per_joule: served / at.power_w,
                    power_w: at.power_w,
                    tpot_s,
                    point: (at.sm_mhz, lo),
                });
            }
        }
    }
    // Best first; among equals, the highest cap, clock and batch (the least constraining).
    candidates.sort_by(|a, b| {
        b.tokens_per_joule
            .total_cmp(&a.tokens_per_joule)
            .then(b.setting.power_cap_w.total_cmp(&a.setting.power_cap_w))
            .then(b.setting.sm_clock_max_mhz.cmp(&a.setting.sm_clock_max_mhz))
            .then(b.setting.batch_size.cmp(&a.setting.batch_size))
    });
    candidates
}

/// A single-phase copy of the scenario's workload at `rate`.
fn phase_workload(
    scenario: &EvalScenario,
    rate: f64,
    outside_limit_w: Option<f64>,
) -> tokwatt_sim::Scenario {
    let mut workload = scenario.workload.clone();
    workload.phases = vec![Phase {
        start_s: 0.0,
        arrival_rps: rate,
        outside_power_limit_w: outside_limit_w,
    }];
    workload
}

/// Stage 2: one GPU at fixed settings for one phase, on the simulator's truth.
fn simulate(
    scenario: &EvalScenario,
    rate: f64,
    outside_limit_w: Option<f64>,
    setting: OracleSetting,
    settle_s: f64,
    measure_s: f64,
    seed: u64,
) -> Result<Verified, SimError> {
    let clock = VirtualClock::new();
    let sim = SimGpu::new(
        SimConfig {
            profile: scenario.profile.clone(),
            scenario: phase_workload(scenario, rate, outside_limit_w),
            gpus: 1,
            seed,
            noise_seed: None,
        },
        clock.clone(),
    )?;
    let mut run = FixedRun::new(&sim, clock, &scenario.objective);
    run.apply(setting);
    run.advance_ticks(settle_s.round().max(1.0) as u64);
    let before = sim.truth(0);
    let ticks = measure_s.round().max(1.0) as u64;
    let violations = run.advance_ticks(ticks);
    let after = sim.truth(0);
    let (tokens, energy, turned_away) = match (before, after) {
        (Some(b), Some(a)) => (
            a.tokens - b.tokens,
            a.energy_j - b.energy_j,
            a.requests_turned_away - b.requests_turned_away,
        ),
        _ => (0.0, 0.0, 0),
    };
    Ok(Verified {
        tokens_per_joule: if energy > 0.0 { tokens / energy } else { 0.0 },
        power_w: energy / ticks as f64,
        violation_fraction: violations as f64 / ticks as f64,
        turned_away,
    })
}

/// Drives simulated GPUs at fixed settings in one-second ticks, checking the objective on
/// every tick's window as the control loop does.
pub(super) struct FixedRun<'a> {
    sim: &'a SimGpu,
    clock: Arc<VirtualClock>,
    telemetry: Box<dyn Telemetry>,
    actuator: Box<dyn Actuator>,
    workload: Box<dyn Workload>,
    objective: tokwatt_core::types::Objective,
    gpus: u32,
    tick: u64,
    tokens_served: u64,
    tokens_demanded: u64,
}

impl<'a> FixedRun<'a> {
    pub(super) fn new(
        sim: &'a SimGpu,
        clock: Arc<VirtualClock>,
        objective: &tokwatt_core::types::Objective,
    ) -> Self {
        Self {
            sim,
            clock,
            telemetry: sim.telemetry(),
            actuator: sim.actuator(),
            workload: sim.workload(),
            objective: *objective,
            gpus: u32::try_from(sim.telemetry().devices().len()).unwrap_or(0),
            tick: 0,
            tokens_served: 0,
            tokens_demanded: 0,
        }
    }

    /// The same settings on every GPU. A setting the device refuses is left as it was:
    /// the grids only hold supported values.
    pub(super) fn apply(&mut self, setting: OracleSetting) {
        let supported = self.sim.profile().sm_clocks_mhz();
        let lowest = supported.last().copied().unwrap_or(0);
        let highest = supported.first().copied().unwrap_or(0);
        let lock =
            (setting.sm_clock_max_mhz < highest).then_some((lowest, setting.sm_clock_max_mhz));
        for gpu in 0..self.gpus {
            let _ = self.actuator.set_power_cap(gpu, setting.power_cap_w);
            let _ = self.actuator.set_sm_clock_lock(gpu, lock);
            let _ = self.workload.set_batch_size(gpu, setting.batch_size);
        }
    }

    /// Run `ticks` one-second ticks; returns how many broke the objective on any GPU.
    pub(super) fn advance_ticks(&mut self, ticks: u64) -> u64 {
        let mut violations = 0;
        for _ in 0..ticks {
            self.tick += 1;
            self.clock.sleep_until(Duration::from_secs(self.tick));
            let mut broken = false;
            for gpu in 0..self.gpus {
                // Reading the windows also resets them for the next tick.
                let _ = self.telemetry.read_window(gpu);
                if let Ok(window) = self.workload.read_window(gpu) {
                    broken |= self.objective.violated_by_window(&window, 1.0);
                    self.tokens_served += window.tokens;
                    self.tokens_demanded += window.demand.map_or(0, |d| d.tokens_demanded);
                }
            }
            violations += u64::from(broken);
        }
        violations
    }

    pub(super) fn tick(&self) -> u64 {
        self.tick
    }

    /// Tokens served over tokens demanded so far (at most 1; 1 when nothing was asked).
    pub(super) fn served_fraction(&self) -> f64 {
        if self.tokens_demanded == 0 {
            1.0
        } else {
            (self.tokens_served as f64 / self.tokens_demanded as f64).min(1.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_cover_the_ranges() {
        let batches = batch_grid(512);
        assert_eq!(&batches[..3], &[1, 2, 3]);
        assert_eq!(batches.last(), Some(&512));
        assert!(batches.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(batch_grid(4), vec![1, 2, 3, 4]);
        let caps = cap_grid(200.0, 700.0);
        assert_eq!(caps.first(), Some(&700.0));
        assert_eq!(caps.last(), Some(&200.0));
        assert_eq!(caps.len(), 21);
        assert_eq!(cap_grid(150.0, 400.0).len(), 11);
    }
}
