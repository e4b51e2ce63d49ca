//! Between the host's types and the generated WIT types.
use super::wit;
use crate::policy::InitArgs;
use crate::types::{ClockEvents, Knobs, Observation, Settings};

fn knobs(k: Knobs) -> wit::Knobs {
    let mut out = wit::Knobs::empty();
    if k.power_cap {
        out |= wit::Knobs::POWER_CAP;
    }
    if k.sm_clock {
        out |= wit::Knobs::SM_CLOCK;
    }
    if k.batch_size {
        out |= wit::Knobs::BATCH_SIZE;
    }
    out
}

fn clock_events(e: ClockEvents) -> wit::ClockEvents {
    let mut out = wit::ClockEvents::empty();
    for (set, flag) in [
        (e.gpu_idle, wit::ClockEvents::GPU_IDLE),
        (e.sw_power_cap, wit::ClockEvents::SW_POWER_CAP),
        (e.hw_slowdown, wit::ClockEvents::HW_SLOWDOWN),
        (e.sw_thermal, wit::ClockEvents::SW_THERMAL),
        (e.hw_thermal, wit::ClockEvents::HW_THERMAL),
        (e.clock_setting, wit::ClockEvents::CLOCK_SETTING),
    ] {
        if set {
            out |= flag;
        }
    }
    out
}

pub(super) fn init_args(args: &InitArgs) -> wit::InitArgs {
    wit::InitArgs {
        devices: args
            .devices
            .iter()
            .map(|d| wit::DeviceFacts {
                index: d.index,
                uuid: d.uuid.clone(),
                name: d.name.clone(),
                simulated: d.simulated,
                power_cap_min_w: d.power_cap_min_w,
                power_cap_max_w: d.power_cap_max_w,
                power_cap_default_w: d.power_cap_default_w,
                sm_clocks_mhz: d.sm_clocks_mhz.clone(),
                batch_size_max: d.batch_size_max,
            })
            .collect(),
        knobs: knobs(args.knobs),
        objective: wit::Objective {
            tpot_p99_limit_ms: args.objective.tpot_p99_limit_ms,
            min_tokens_per_s: args.objective.min_tokens_per_s,
        },
        params: args.params.clone(),
        tick_ms: args.tick_ms,
        seed: args.seed,
    }
}

pub(super) fn observation(o: &Observation) -> wit::Observation {
    wit::Observation {
        gpu: o.gpu,
        tick: o.tick,
        interval_s: o.interval_s,
        tokens: o.tokens,
        energy_j: o.energy_j,
        tokens_per_joule: o.tokens_per_joule,
        tokens_per_s: o.tokens_per_s,
        power_avg_w: o.power_avg_w,
        power_peak_w: o.power_peak_w,
        sm_clock_mhz: o.sm_clock_mhz,
        mem_clock_mhz: o.mem_clock_mhz,
        temperature_c: o.temperature_c,
        gpu_util_pct: o.gpu_util_pct,
        clock_events: clock_events(o.clock_events),
        tpot_p50_ms: o.tpot_p50_ms,
        tpot_p99_ms: o.tpot_p99_ms,
        active_sequences: o.active_sequences,
        queue_depth: o.queue_depth,
        in_force: wit::InForce {
            power_cap_w: o.in_force.power_cap_w,
            sm_clock_max_mhz: o.in_force.sm_clock_max_mhz,
            batch_size: o.in_force.batch_size,
        },
        last_clamped: o.last_clamped,
        settling: o.settling,
    }
}

pub(super) fn settings_from_wit(s: &wit::Settings) -> Settings {
    Settings {
        power_cap_w: s.power_cap_w,
        sm_clock_max_mhz: s.sm_clock_max_mhz,
        batch_size: s.batch_size,
    }
}
