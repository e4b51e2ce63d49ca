//! `tokwatt run`'s progress lines and its summary's per-GPU rows, short however many GPUs
//! the node has. Up to [`LISTED_GPUS`] GPUs each one's settings are listed on the line;
//! beyond, a second line gives the node's sums and the extremes (the caps, clocks and
//! batches in force, and the GPUs with the lowest and highest tokens per joule), and every
//! GPU stays in `trace.csv` and `summary.json`. (Issue 43: 64 simulated GPUs made progress
//! lines of 1,247 characters.)

use tokwatt_agent::control::LoopTotals;
use tokwatt_core::types::{InForce, Observation};

/// GPUs whose settings a progress line lists one by one.
pub const LISTED_GPUS: usize = 3;
/// GPUs the summary gives a row each.
pub const LISTED_SUMMARY_GPUS: usize = 8;

/// The lines of one progress report: `done_percent` of the run at `time_s`, the run's
/// totals so far, this tick's observations (each with the settings in force over its
/// window). `engine_batch`: the batch size is the serving engine's, not tokwatt's.
pub fn progress_lines(
    done_percent: u64,
    time_s: f64,
    totals: &LoopTotals,
    observations: &[Observation],
    engine_batch: bool,
) -> Vec<String> {
    let energy = totals.energy_j;
    let mut first = format!(
        "[{done_percent:>3}%] t={time_s:>6.0}s tokens={:>10} energy={energy:>10.0}J tok/J={:>7.3} fallback={} traps={}",
        totals.tokens,
        if energy > 0.0 {
            totals.tokens as f64 / energy
        } else {
            0.0
        },
        totals.fallback_ticks,
        totals.plugin_traps,
    );
    if observations.len() <= LISTED_GPUS {
        let settings: Vec<String> = observations
            .iter()
            .map(|o| settings_words(&o.in_force, engine_batch))
            .collect();
        first.push_str(" settings=");
        first.push_str(&settings.join(" "));
        if engine_batch {
            first.push_str(" (batch: the engine's)");
        }
        return vec![first];
    }
    let in_force: Vec<InForce> = observations.iter().map(|o| o.in_force).collect();
    let draw: f64 = observations.iter().map(|o| o.power_avg_w).sum();
    let mut second = format!(
        "       {} GPUs: {}, draw {draw:.0} W",
        observations.len(),
        settings_spread(&in_force, engine_batch)
    );
    if let Some(extremes) = tokens_per_joule_extremes(totals) {
        second.push_str("; ");
        second.push_str(&extremes);
    }
    vec![first, second]
}

/// One GPU's settings: `700W/1980MHz/b64` (no batch where it is the engine's).
fn settings_words(in_force: &InForce, engine_batch: bool) -> String {
    let mut words = format!(
        "{:.0}W/{}MHz",
        in_force.power_cap_w, in_force.sm_clock_max_mhz
    );
    if !engine_batch {
        words.push_str(&format!("/b{}", in_force.batch_size));
    }
    words
}

/// `low-high unit`, or the one value where all are alike.
fn range(values: impl Iterator<Item = f64>, unit: &str) -> String {
    let (low, high) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !low.is_finite() {
        return "-".to_owned();
    }
    if (high - low).abs() < 0.5 {
        format!("{low:.0}{unit}")
    } else {
        format!("{low:.0}-{high:.0}{unit}")
    }
}

/// The node's settings in a few words: caps (and their sum), SM clock limits, batches.
fn settings_spread(in_force: &[InForce], engine_batch: bool) -> String {
    let caps_sum: f64 = in_force.iter().map(|f| f.power_cap_w).sum();
    let mut words = format!(
        "caps {} (sum {caps_sum:.0} W), SM {}",
        range(in_force.iter().map(|f| f.power_cap_w), " W"),
        range(
            in_force.iter().map(|f| f64::from(f.sm_clock_max_mhz)),
            " MHz"
        ),
    );
    if engine_batch {
        words.push_str(", batch the engine's");
    } else {
        words.push_str(&format!(
            ", batch {}",
            range(in_force.iter().map(|f| f64::from(f.batch_size)), "")
        ));
    }
    words
}

/// The GPUs with the lowest and highest tokens per joule so far (`None` before any GPU
/// has used energy).
fn tokens_per_joule_extremes(totals: &LoopTotals) -> Option<String> {
    let per_gpu: Vec<(u32, f64)> = totals
        .gpus
        .iter()
        .filter(|g| g.energy_j > 0.0)
        .map(|g| (g.gpu, g.tokens as f64 / g.energy_j))
        .collect();
    let worst = per_gpu.iter().copied().min_by(|a, b| a.1.total_cmp(&b.1))?;
    let best = per_gpu.iter().copied().max_by(|a, b| a.1.total_cmp(&b.1))?;
    Some(format!(
        "tok/J worst {:.3} (GPU {}), best {:.3} (GPU {})",
        worst.1, worst.0, best.1, best.0
    ))
}

/// The summary's rows for the GPUs: one each up to [`LISTED_SUMMARY_GPUS`], else the
/// node's spread and its extremes (every GPU is in summary.json).
pub fn summary_gpu_rows(totals: &LoopTotals, engine_batch: bool) -> Vec<(String, String)> {
    let finals: Vec<InForce> = totals
        .gpus
        .iter()
        .filter_map(|g| g.final_settings)
        .collect();
    if totals.gpus.len() <= LISTED_SUMMARY_GPUS {
        return totals
            .gpus
            .iter()
            .filter_map(|g| {
                let f = g.final_settings?;
                let batch = if engine_batch {
                    "n/a (the serving engine's)".to_owned()
                } else {
                    f.batch_size.to_string()
                };
                Some((
                    format!("gpu {}", g.gpu),
                    format!(
                        "{:.4} tok/J, final cap {:.0} W, SM max {} MHz, batch {batch}",
                        g.tokens_per_joule, f.power_cap_w, f.sm_clock_max_mhz
                    ),
                ))
            })
            .collect();
    }
    let mut rows = Vec::new();
    if let Some(extremes) = tokens_per_joule_extremes(totals) {
        rows.push((format!("{} GPUs", totals.gpus.len()), extremes));
    }
    if !finals.is_empty() {
        rows.push((
            "final settings".to_owned(),
            settings_spread(&finals, engine_batch),
        ));
    }
    rows.push((
        "each GPU".to_owned(),
        "in summary.json (gpus) and trace.csv".to_owned(),
    ));
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokwatt_agent::control::GpuTotals;

    /// A node of `gpus` GPUs after a while: GPU i at a cap of 450 + 4·i W, batch 64, and
    /// tokens per joule rising with i.
    fn node(gpus: u32) -> (LoopTotals, Vec<Observation>) {
        let mut totals = LoopTotals {
            tokens: 123_456_789,
            energy_j: 45_678_901.0,
            ..LoopTotals::default()
        };
        let mut observations = Vec::new();
        for gpu in 0..gpus {
            let mut observation = Observation::typical_h200(gpu, 9);
            observation.in_force.power_cap_w = 450.0 + 4.0 * f64::from(gpu);
            observation.in_force.sm_clock_max_mhz = 1980;
            observation.in_force.batch_size = 64;
            observations.push(observation);
            totals.gpus.push(GpuTotals {
                gpu,
                tokens: 1_000_000 + 10_000 * u64::from(gpu),
                energy_j: 300_000.0,
                final_settings: Some(observation.in_force),
                ..GpuTotals::default()
            });
        }
        (totals, observations)
    }

    /// 64 GPUs: two lines, each under 160 characters, with the node's sums and the
    /// extremes; a few GPUs: one line listing each.
    #[test]
    fn progress_lines_stay_short_however_many_gpus() {
        let (totals, observations) = node(64);
        let lines = progress_lines(40, 720.0, &totals, &observations, false);
        assert_eq!(lines.len(), 2, "{lines:?}");
        for line in &lines {
            assert!(line.chars().count() < 160, "{} chars: {line}", line.len());
        }
        for expected in [
            "64 GPUs",
            "caps 450-702 W (sum 36864 W)",
            "SM 1980 MHz",
            "batch 64",
            "draw 44160 W",
            "tok/J worst 3.333 (GPU 0), best 5.433 (GPU 63)",
        ] {
            assert!(
                lines[1].contains(expected),
                "{expected:?} not in {}",
                lines[1]
            );
        }
        assert!(lines[0].starts_with("[ 40%] t=   720s tokens= 123456789"));

        let (totals, observations) = node(LISTED_GPUS as u32);
        let lines = progress_lines(10, 60.0, &totals, &observations, false);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].chars().count() < 160, "{}", lines[0]);
        assert!(
            lines[0].ends_with("settings=450W/1980MHz/b64 454W/1980MHz/b64 458W/1980MHz/b64"),
            "{}",
            lines[0]
        );
        // A serving engine's batch is not tokwatt's: said once, not per GPU.
        let lines = progress_lines(10, 60.0, &totals, &observations, true);
        assert!(
            lines[0].ends_with("458W/1980MHz (batch: the engine's)"),
            "{}",
            lines[0]
        );
        let (totals, observations) = node(8);
        let lines = progress_lines(10, 60.0, &totals, &observations, true);
        assert!(lines[1].contains("batch the engine's"), "{}", lines[1]);
    }

    #[test]
    fn the_summary_lists_a_few_gpus_and_summarises_many() {
        let (totals, _) = node(2);
        let rows = summary_gpu_rows(&totals, false);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1].0, "gpu 1");
        assert!(rows[1].1.contains("final cap 454 W"), "{rows:?}");

        let (totals, _) = node(64);
        let rows = summary_gpu_rows(&totals, false);
        assert_eq!(rows.len(), 3, "{rows:?}");
        assert_eq!(rows[0].0, "64 GPUs");
        assert!(rows[0].1.contains("worst 3.333 (GPU 0)"), "{rows:?}");
        assert!(rows[1].1.starts_with("caps 450-702 W"), "{rows:?}");
        for (key, value) in &rows {
            assert!(key.len() + value.len() < 140, "{key} {value}");
        }
    }
}
