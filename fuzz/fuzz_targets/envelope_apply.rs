//! The safety envelope: from arbitrary guardrails, knobs and device facts, build an
//! `Envelope` (or get an error), then apply arbitrary requested `Settings` (NaN,
//! infinities, zero, huge) against a setting in force. Whatever is requested, what comes
//! out lies in the device's range and the guardrails, on a supported clock, and within
//! the per-tick step where the setting in force was already inside the range.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tokwatt_policy::envelope::{Envelope, Guardrails, WorkloadLimits};
use tokwatt_core::types::{DeviceInfo, InForce, Knobs, Settings};

#[derive(Debug, Arbitrary)]
struct Input {
    // The operator's guardrails: anything a spec can say.
    power_cap_min_w: Option<f64>,
    power_cap_max_w: Option<f64>,
    sm_clock_min_mhz: Option<u32>,
    sm_clock_max_mhz: Option<u32>,
    batch_size_min: Option<u32>,
    batch_size_max: Option<u32>,
    max_power_cap_step_w: Option<f64>,
    max_power_cap_raise_w: Option<f64>,
    max_sm_clock_step_mhz: Option<u32>,
    max_batch_size_step: Option<u32>,
    token_budget_min: Option<u32>,
    token_budget_max: Option<u32>,
    max_token_budget_step: Option<u32>,
    knobs: (bool, bool, bool, bool),
    // The device, as NVML or the simulator reports it: finite, ordered limits.
    device_cap_lo: u16,
    device_cap_span: u16,
    sm_clocks: Vec<u16>,
    workload_batch_max: u32,
    /// The workload's token budget range (`None`: it decodes only), ordered below.
    workload_token_budget: Option<(u32, u32)>,
    // What is in force: read from the device, so finite, but possibly outside the
    // guardrails (before the first change, or changed from outside).
    in_force_cap_w: u16,
    in_force_clock_mhz: u16,
    in_force_batch: u32,
    in_force_token_budget: u32,
    // What the plugin asks for: anything.
    requests: Vec<(Option<f64>, Option<u32>, Option<u32>, Option<u32>)>,
}

fuzz_target!(|input: Input| {
    let guardrails = Guardrails {
        power_cap_min_w: input.power_cap_min_w,
        power_cap_max_w: input.power_cap_max_w,
        sm_clock_min_mhz: input.sm_clock_min_mhz,
        sm_clock_max_mhz: input.sm_clock_max_mhz,
        batch_size_min: input.batch_size_min,
        batch_size_max: input.batch_size_max,
        max_power_cap_step_w: input.max_power_cap_step_w,
        max_power_cap_raise_w: input.max_power_cap_raise_w,
        max_sm_clock_step_mhz: input.max_sm_clock_step_mhz,
        max_batch_size_step: input.max_batch_size_step,
        token_budget_min: input.token_budget_min,
        token_budget_max: input.token_budget_max,
        max_token_budget_step: input.max_token_budget_step,
    };
    let knobs = Knobs {
        power_cap: input.knobs.0,
        sm_clock: input.knobs.1,
        batch_size: input.knobs.2,
        token_budget: input.knobs.3,
    };
    let workload_token_budget = input
        .workload_token_budget
        .map(|(a, b)| (a.min(b).max(1), a.max(b).max(1)));
    let dev_lo = f64::from(input.device_cap_lo.max(1));
    let dev_hi = dev_lo + f64::from(input.device_cap_span);
    let mut sm_clocks: Vec<u32> = input.sm_clocks.iter().map(|&c| u32::from(c)).collect();
    sm_clocks.sort_unstable_by(|a, b| b.cmp(a));
    sm_clocks.dedup();
    let device = DeviceInfo {
        index: 0,
        uuid: "GPU-fuzz".into(),
        name: "fuzz".into(),
        simulated: true,
        power_cap_min_w: dev_lo,
        power_cap_max_w: dev_hi,
        power_cap_default_w: dev_hi,
        sm_clocks_mhz: sm_clocks.clone(),
        mem_clocks_mhz: vec![1000],
    };
    let Ok(envelope) = Envelope::for_workload(
        std::slice::from_ref(&device),
        &[WorkloadLimits {
            batch_size_max: input.workload_batch_max,
            token_budget: workload_token_budget,
        }],
        &guardrails,
        knobs,
    ) else {
        return;
    };
    let Some(limits) = envelope.limits(0).cloned() else {
        panic!("an envelope for one GPU has its limits");
    };
    let (cap_lo, cap_hi) = limits.power_cap_w;
    assert!(cap_lo.is_finite() && cap_hi.is_finite() && cap_lo <= cap_hi);
    assert!(dev_lo <= cap_lo && cap_hi <= dev_hi, "{limits:?}");
    let (batch_lo, batch_hi) = limits.batch_size;
    assert!(1 <= batch_lo && batch_lo <= batch_hi && batch_hi <= input.workload_batch_max);
    match (limits.token_budget, workload_token_budget) {
        (Some((lo, hi)), Some((work_lo, work_hi))) => {
            assert!(work_lo <= lo && lo <= hi && hi <= work_hi, "{limits:?}");
        }
        (None, None) => {}
        (ours, theirs) => panic!("token budget {ours:?} for a workload's {theirs:?}"),
    }

    let mut in_force = InForce {
        power_cap_w: f64::from(input.in_force_cap_w),
        power_cap_requested_w: f64::from(input.in_force_cap_w),
        sm_clock_max_mhz: u32::from(input.in_force_clock_mhz),
        batch_size: input.in_force_batch,
        token_budget: input.in_force_token_budget,
    };
    // A plugin asks again and again; each answer is applied before the next.
    for (cap, clock, batch, tokens) in input.requests.into_iter().take(64) {
        let requested = Settings {
            power_cap_w: cap,
            sm_clock_max_mhz: clock,
            batch_size: batch,
            token_budget: tokens,
        };
        let applied = envelope.apply(0, &requested, &in_force);
        let out = applied.settings;
        if let Some(w) = out.power_cap_w {
            assert!(knobs.power_cap, "power cap changed without the knob");
            assert!(w.is_finite(), "{w}");
            assert!(
                (cap_lo..=cap_hi).contains(&w),
                "{w} outside {cap_lo}..{cap_hi}"
            );
            if let Some(g) = guardrails.power_cap_min_w {
                assert!(w >= g, "{w} below the guardrail {g}");
            }
            if let Some(g) = guardrails.power_cap_max_w {
                assert!(w <= g, "{w} above the guardrail {g}");
            }
            let before = in_force.power_cap_requested_w;
            if (cap_lo..=cap_hi).contains(&before) {
                let step = limits.max_power_cap_step_w;
                // `before ± step` is rounded to `before`'s precision.
                let rounding = (before.abs() + step) * 1e-12;
                assert!(
                    (w - before).abs() <= step + rounding,
                    "{before} -> {w} beyond the step {step}"
                );
            }
            in_force.power_cap_w = w;
            in_force.power_cap_requested_w = w;
        }
        if let Some(mhz) = out.sm_clock_max_mhz {
            assert!(knobs.sm_clock, "SM clock changed without the knob");
            assert!(sm_clocks.contains(&mhz), "{mhz} is not a supported clock");
            assert!(
                limits.sm_clocks_mhz.contains(&mhz),
                "{mhz} outside the guardrails"
            );
            if let Some(g) = guardrails.sm_clock_min_mhz {
                assert!(mhz >= g);
            }
            if let Some(g) = guardrails.sm_clock_max_mhz {
                assert!(mhz <= g);
            }
            in_force.sm_clock_max_mhz = mhz;
        }
        if let Some(b) = out.batch_size {
            assert!(knobs.batch_size, "batch size changed without the knob");
            assert!(
                (batch_lo..=batch_hi).contains(&b),
                "{b} outside {batch_lo}..{batch_hi}"
            );
            let before = in_force.batch_size;
            if (batch_lo..=batch_hi).contains(&before) {
                assert!(b.abs_diff(before) <= limits.max_batch_size_step);
            }
            in_force.batch_size = b;
        }
        if let Some(t) = out.token_budget {
            assert!(knobs.token_budget, "token budget changed without the knob");
            let Some((lo, hi)) = limits.token_budget else {
                panic!("token budget {t} on a workload without one");
            };
            assert!((lo..=hi).contains(&t), "{t} outside {lo}..{hi}");
            let before = in_force.token_budget;
            if (lo..=hi).contains(&before) {
                assert!(t.abs_diff(before) <= limits.max_token_budget_step);
            }
            in_force.token_budget = t;
        }
        let non_finite = cap.is_some_and(|w| !w.is_finite());
        if non_finite && knobs.power_cap {
            assert!(applied.non_finite && applied.clamped, "NaN went unreported");
        }
    }
});
