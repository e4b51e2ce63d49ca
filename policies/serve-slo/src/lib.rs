//! The `serve-slo` policy: serving with prompts, under whatever of TTFT, TPOT, queue wait
//! and a throughput floor the objective sets, with the knobs it is granted (a clock lock
//! or a power cap, the token budget per step, the batch size).
//!
//! Per GPU, each tick:
//!
//! 1. **The knob that slows the GPU, from the phase mix.** Under a power cap the firmware
//!    clocks each step by its own power: compute-bound prompt chunks run low, memory-bound
//!    decode steps high, which no single clock lock does; on decode-only work a lock is
//!    the finer knob. The share of busy time spent on prompts, smoothed
//!    ([`PhaseMix`](tokwatt_policy_kit::PhaseMix)), picks the cap above `cap_above` and
//!    the lock again below `lock_below` (where both are granted and `knob_choice` is
//!    `auto`); a switch releases the other knob and searches the new one from its top.
//!    The default is `clock`: on the simulator `auto` measured lower (the cap's ladder
//!    has no predicted descent; see `policies/serve-slo.toml`).
//! 2. **The search.** The kit's noise-aware ladder search (as `clock-search` and
//!    `cap-search`) walks the knob down to the least power that keeps the objective,
//!    raises it at once on a breach, and searches again when the workload shifts. A
//!    clock settled for 6 ticks with no queue *descends* at once (at most 25 %) to the
//!    lowest clock predicted to keep every bound with room (`descent_guard`), instead of
//!    a probe one rung at a time; a breach soon after rules that clock out of descents
//!    for 300 ticks. Sequences preempted from the KV cache raise the knob (a slower
//!    rung holds more in flight).
//! 3. **The time to first token, predicted.** The kit's step model
//!    ([`StepModel`](tokwatt_policy_kit::StepModel)) learns a decode step's time and a
//!    prompt token's at the setting in force (the prompt tokens prefilled and the share
//!    of busy time they took), and predicts the p99 time to first token of the prompts
//!    waiting now (the requests admitted without a first token yet, in the queue and in
//!    the batch waiting for chunks, at the mean prompt) at the prefill rate the budget
//!    leaves, times the tail it learnt. Past `ttft_guard` of the bound the knob goes up
//!    before a first token is late; a lower rung predicted past it (a prompt token's time
//!    scaled by the clock) is ruled out before it is tried. A per-tick p99 that spikes
//!    with one long prompt is not what it steers by.
//! 4. **The token budget**, where granted: every `budget_window_ticks` ticks with prompts,
//!    the largest budget (of those from the largest the workload takes down to
//!    `budget_floor`, √2 apart) whose step with a full chunk is predicted within the TPOT
//!    bound, and not so small that prompts would take over 80 % of the busy time; at
//!    most a halving or a doubling a decision. Without a TPOT bound the largest (a
//!    smaller chunk only costs first tokens and prefill efficiency). A tick that breaks
//!    the TPOT bound halves it at once, where first tokens stay on time.
//! 5. **The batch**, where granted: cut to 80 % of the sequences decoding only on a TPOT
//!    breach that the budget cannot answer (it is at its floor or not granted, or a decode
//!    step alone is too slow) and only where the batch binds: smaller chunks before fewer
//!    sequences. Preemptions cut it to 90 % of the sequences in flight (at most once in
//!    5 ticks). Never below an eighth of the workload's own batch; it grows back after
//!    `batch_calm_windows` windows of ample room. With requests waiting at the top clock
//!    and cap (demand beyond the GPU) neither the budget nor the batch is cut, and the
//!    budget goes to the largest: it serves the most.
//!
//! Under `--batch-only` (neither the clock nor the cap granted) steps 1-3 do nothing and
//! the budget and the batch run alone.
//!
//! The state is not handed over at a hot swap: a new instance searches again from the
//! settings in force (the host's default refusal of a non-empty state never fires: this
//! policy's snapshot is empty).

mod config;
mod gpu;

use config::Config;
use gpu::Gpu;
use tokwatt_policy_kit::{check_objective, decide_per_gpu};
use tokwatt_policy_sdk::{InitArgs, Objective, Observation, Params, Policy, Settings, info};

#[derive(Debug, Clone)]
struct ServeSlo {
    config: Config,
    objective: Objective,
    gpus: Vec<Gpu>,
}

impl Policy for ServeSlo {
    fn init(args: InitArgs) -> Result<(Self, Vec<Settings>), String> {
        let params = Params::new(&args.params);
        let config = Config::read(&params).map_err(|error| error.to_string())?;
        check_objective(&args.objective)?;
        if let Some(limit_ms) = args.objective.ttft_p99_limit_ms
            && !(limit_ms.is_finite() && limit_ms > 0.0)
        {
            return Err(format!(
                "objective `ttft_p99_limit_ms` = {limit_ms} must be a positive number of ms"
            ));
        }
        let gpus = args
            .devices
            .iter()
            .map(|device| Gpu::new(device, args.knobs, &config))
            .collect::<Result<Vec<_>, _>>()?;
        let first = gpus.iter().map(Gpu::first).collect();
        info!(
            "serve-slo on {} GPUs: {:?}, TTFT guard {} of the bound",
            gpus.len(),
            gpus.first().map(|gpu| gpu.mode),
            config.ttft_guard
        );
        Ok((
            ServeSlo {
                config,
                objective: args.objective,
                gpus,
            },
            first,
        ))
    }

    fn decide(&mut self, observations: &[Observation]) -> Vec<Settings> {
        let (config, objective) = (&self.config, &self.objective);
        decide_per_gpu(&mut self.gpus, observations, |gpu, observation| {
            gpu.decide(observation, objective, config)
        })
    }
}

tokwatt_policy_sdk::export_policy!(ServeSlo);

#[cfg(test)]
mod tests;
