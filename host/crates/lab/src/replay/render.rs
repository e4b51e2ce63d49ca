//! `tokwatt replay`'s text: each decision beside the recorded one, and what the guest
//! logged and wrote.

use std::fmt::Write as _;

use tokwatt_core::types::Settings;
use tokwatt_plugin::GuestOutput;

use super::*;

/// The replay as text for a person: a line per GPU per tick, the replayed decision
/// beside the recorded one, what the guest wrote under it. Only the run's data and the
/// policy's answers go in (no times of this machine), so the same replay prints the same
/// bytes.
pub fn render_text(report: &ReplayReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "replay of {}: policy `{}` ({}), seed {}, tick {} ms; the run started with `{}`",
        report.run_dir,
        report.policy,
        report.plugin,
        report.seed,
        report.tick_ms,
        report.recorded_policy
    );
    let _ = writeln!(out, "device facts: {}", report.device_facts);
    for note in &report.notes {
        let _ = writeln!(out, "note: {note}");
    }
    let _ = writeln!(out, "init: {}", settings_list(&report.init.settings));
    render_output(&mut out, &report.init.output);
    for tick in &report.ticks {
        let mark = if tick.same { "same" } else { "DIFFERS" };
        let _ = writeln!(out, "tick {} (t={} s): {mark}", tick.tick, tick.time_s);
        for (gpu, decided) in tick.decided.iter().enumerate() {
            let recorded = tick
                .recorded
                .get(gpu)
                .map_or_else(|| "-".to_owned(), settings_text);
            let _ = writeln!(
                out,
                "  gpu{gpu}  replay {:<34} run {recorded}{}",
                settings_text(decided),
                if tick.recorded_fallback {
                    " (fallback)"
                } else {
                    ""
                }
            );
        }
        if let Some(failure) = &tick.failure {
            let _ = writeln!(out, "  {}: {failure}", tick.source);
        }
        if tick.recorded_policy != report.policy {
            let _ = writeln!(out, "  (the run's policy here: `{}`)", tick.recorded_policy);
        }
        render_output(&mut out, &tick.output);
    }
    let t = &report.totals;
    let _ = writeln!(
        out,
        "{} ticks shown ({} fed): {} same as the run, {} different, {} decided by the fallback",
        t.ticks_shown, t.ticks_fed, t.same, t.different, t.fallback
    );
    out
}

pub(super) fn render_output(out: &mut String, output: &GuestOutput) {
    for log in &output.logs {
        let _ = writeln!(out, "    log {}: {}", log.level, log.message);
    }
    if output.logs_lost > 0 {
        let _ = writeln!(out, "    log: {} more messages not kept", output.logs_lost);
    }
    for (name, lines, lost) in [
        ("stdout", &output.stdout, output.stdout_bytes_lost),
        ("stderr", &output.stderr, output.stderr_bytes_lost),
    ] {
        if lost > 0 {
            let _ = writeln!(out, "    {name}| … ({lost} bytes before not kept)");
        }
        for line in lines {
            let _ = writeln!(out, "    {name}| {line}");
        }
    }
}

pub(super) fn settings_list(settings: &[Settings]) -> String {
    settings
        .iter()
        .enumerate()
        .map(|(gpu, s)| format!("gpu{gpu} {}", settings_text(s)))
        .collect::<Vec<_>>()
        .join("; ")
}

/// `cap 350 W, clock 1500 MHz, batch 256`; `-` for a knob left unchanged.
pub(super) fn settings_text(settings: &Settings) -> String {
    let cap = settings
        .power_cap_w
        .map_or_else(|| "-".to_owned(), |w| format!("{w} W"));
    let clock = settings
        .sm_clock_max_mhz
        .map_or_else(|| "-".to_owned(), |mhz| format!("{mhz} MHz"));
    let batch = settings
        .batch_size
        .map_or_else(|| "-".to_owned(), |b| b.to_string());
    format!("cap {cap}, clock {clock}, batch {batch}")
}
