//! The oracle: for each demand phase of a scenario, the best power cap × SM clock × batch
//! size × token budget that honours the objective and serves the demand, found on the same
//! simulator the policies are judged on. For judging only: it sees the phase's arrival
//! rate in advance.
//!
//! The search itself is [`super::search`]: every setting it weighs is simulated over the
//! whole phase, from the queue the phase before left. This file holds the steady-state
//! model it starts from (`Requests`, `serving_state`), which also gives the capacities and
//! latency floors `family.rs` draws scenarios against, and what a schedule is.
//!
//! One file because the steady-state model and its uses (the capacity, the floors, the
//! ranking the search is seeded with) are one model.

use serde::Serialize;

use super::scenario::EvalScenario;
use tokwatt_sim::model::{SteadyState, StepLoad};
use tokwatt_sim::{DecodeCost, DecodeModel, SimError};

/// Power cap grid step, watts (Zeus profiles limits in the same steps).
pub(super) const CAP_STEP_W: f64 = 25.0;

pub use super::fixed::OracleSetting;

/// The oracle's choice for one demand phase.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseOracle {
    pub start_s: f64,
    pub end_s: f64,
    /// The scenario's demand phase this is (or is part of).
    pub scenario_phase: usize,
    /// The first part of a phase that inherited a backlog, up to where the most capable
    /// setting has worked it off; the rest of the phase follows with a setting of its own.
    pub drains_backlog: bool,
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

/// One setting scored by the steady-state model.
#[derive(Debug, Clone, Copy)]
pub(super) struct Candidate {
    pub(super) setting: OracleSetting,
    tokens_per_joule: f64,
    /// The steady state's power (with nothing to run, on an idle phase).
    power_w: f64,
    pub(super) tpot_s: f64,
    /// The operating point (firmware clock, active sequences): candidates sharing it are
    /// the same point, and only the first is simulated.
    pub(super) point: (u32, u32),
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

/// The oracle of every phase of `scenario` over its first `duration_s` seconds (see
/// [`super::search`]).
pub fn search(
    scenario: &EvalScenario,
    duration_s: f64,
    seeds: &[u64],
) -> Result<Vec<PhaseOracle>, SimError> {
    super::search::search(scenario, duration_s, seeds)
}

/// The default settings over the whole run, as one phase: no cap below the maximum, no
/// clock lock, the workload's starting batch size. What a GPU runs when nobody tunes it.
pub fn default_settings(scenario: &EvalScenario, duration_s: f64) -> PhaseOracle {
    PhaseOracle {
        start_s: 0.0,
        end_s: duration_s,
        scenario_phase: 0,
        drains_backlog: false,
        arrival_rps: f64::NAN,
        setting: OracleSetting {
            power_cap_w: scenario.profile.power_cap.max_w,
            sm_clock_max_mhz: scenario.profile.sm_max_mhz(),
            batch_size: scenario.workload.initial_batch_size,
            token_budget: scenario.workload.max_batched_tokens,
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

/// The steady-state model at one demand: what a setting's operating point is estimated
/// to give.
struct Estimator<'a> {
    model: &'a DecodeModel,
    requests: &'a Requests,
    demand_tokens_per_s: f64,
    /// The prompt that sets a window's tails ([`Requests::tail_prompt`]).
    prompt: f64,
    mem_mhz: f64,
    budget: u32,
}

impl Estimator<'_> {
    /// The fewest active sequences that keep up with the demand at `cap_w` (enforced:
    /// `enforced_w`), `clock_mhz` and `batch`, and the TTFT p99 they imply; none where
    /// even `batch` sequences cannot keep up.
    fn estimate(
        &self,
        cap_w: f64,
        enforced_w: f64,
        clock_mhz: u32,
        batch: u32,
    ) -> Option<(Candidate, f64)> {
        let state = |n: u32| {
            serving_state(
                self.model,
                self.requests,
                n,
                enforced_w,
                clock_mhz,
                self.mem_mhz,
            )
        };
        if state(batch).tokens_per_s < self.demand_tokens_per_s {
            return None;
        }
        // Throughput grows with the sequences active: the fewest that keep up.
        let (mut lo, mut hi) = (1, batch);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if state(mid).tokens_per_s >= self.demand_tokens_per_s {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let at = state(lo);
        let (tpot_s, ttft_s) = tail_latencies(
            self.model,
            self.requests,
            lo,
            &at,
            self.prompt,
            enforced_w,
            clock_mhz,
            self.mem_mhz,
        );
        let served = self.demand_tokens_per_s.min(at.tokens_per_s);
        // Prompt tokens cost energy too: the step's power covers both phases.
        Some((
            Candidate {
                setting: OracleSetting {
                    power_cap_w: cap_w,
                    sm_clock_max_mhz: clock_mhz,
                    batch_size: batch,
                    token_budget: self.budget,
                },
                tokens_per_joule: served / at.power_w,
                power_w: at.power_w,
                tpot_s,
                point: (at.sm_mhz, lo),
            },
            ttft_s,
        ))
    }
}

/// The steady-state model's tokens per joule and TPOT p99 (s) for `setting` at `rate`
/// (NaN where it cannot keep up): what the plan shows beside the simulated figures.
pub(super) fn steady_estimate(
    scenario: &EvalScenario,
    rate: f64,
    outside_limit_w: Option<f64>,
    setting: OracleSetting,
) -> (f64, f64) {
    let model = decode_model(scenario);
    let requests = Requests::of(scenario);
    let at = Estimator {
        model: &model,
        requests: &requests,
        demand_tokens_per_s: rate * requests.output_mean,
        prompt: requests.tail_prompt(rate),
        mem_mhz: f64::from(scenario.profile.mem_max_mhz()),
        budget: setting.token_budget,
    };
    let enforced = outside_limit_w.map_or(setting.power_cap_w, |o| setting.power_cap_w.min(o));
    at.estimate(
        setting.power_cap_w,
        enforced,
        setting.sm_clock_max_mhz,
        setting.batch_size,
    )
    .map_or((f64::NAN, f64::NAN), |(c, _)| {
        (c.tokens_per_joule, c.tpot_s)
    })
}

/// Every setting of the grid in steady state, feasible ones ranked best first.
/// An idle phase (no demand) ranks the settings by the power of a GPU with nothing to
/// run: tokens per joule cannot tell them apart, the energy bill can.
pub(super) fn score_all(
    scenario: &EvalScenario,
    rate: f64,
    outside_limit_w: Option<f64>,
) -> Vec<Candidate> {
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
                    token_budget: workload.max_batched_tokens,
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
    let at = Estimator {
        model: &model,
        requests: &requests,
        demand_tokens_per_s,
        prompt,
        mem_mhz,
        budget: workload.max_batched_tokens,
    };
    for &cap in &caps {
        let enforced = outside_limit_w.map_or(cap, |outside| cap.min(outside));
        for &clock in &clocks {
            for &batch in &batches {
                let Some((candidate, ttft_s)) = at.estimate(cap, enforced, clock, batch) else {
                    continue; // cannot keep up: the queue would grow until requests are turned away
                };
                if candidate.tpot_s > tpot_limit_s || ttft_s > ttft_limit_s {
                    continue;
                }
                candidates.push(candidate);
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
