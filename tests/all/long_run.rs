//! A long run on the virtual clock with a misbehaving plugin: 24 simulated hours (2 by
//! default; set TOKWATT_LONG_TESTS=1 for the full day), and afterwards no tick missing,
//! one trace row per tick and GPU, the trace's totals equal to the summary's, and the
//! process's memory bounded.
//!
//! The plugin is the `trap-decide` fixture: after each (re)start it answers two ticks and
//! traps on the third, so a third of the ticks fail, the host holds the settings with its
//! fallback and rebuilds the instance — some 29 000 fresh instances a day, which is what
//! would leak if anything per instance did.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::support::*;

const GPUS: u64 = 2;
/// Generous: a run holds about 30 MiB; a leak per tick or per instance would pass it
/// well before the end of a day.
const PEAK_RSS_LIMIT_KIB: u64 = 200 * 1024;

/// A line `Key:   1234 kB` of /proc/PID/status, in KiB.
fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix(key)?.strip_prefix(':'))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()
}

/// Sums over the trace, read row by row (a day of two GPUs is 172 800 rows).
struct TraceTotals {
    rows: u64,
    tokens: [u64; GPUS as usize],
    energy_j: [f64; GPUS as usize],
    /// The next tick expected per GPU: ticks must come 0, 1, 2, ... with none missing.
    next_tick: [u64; GPUS as usize],
    last_time_s: f64,
}

fn total_trace(path: &Path) -> TraceTotals {
    let file = std::fs::File::open(path).expect("trace.csv written");
    let mut lines = BufReader::new(file).lines();
    let header = lines.next().expect("a header").expect("text");
    let column = |name: &str| {
        header
            .split(',')
            .position(|c| c == name)
            .unwrap_or_else(|| panic!("trace has no {name} column: {header}"))
    };
    let (time, tick, gpu, tokens, energy) = (
        column("time_s"),
        column("tick"),
        column("gpu"),
        column("tokens"),
        column("energy_j"),
    );
    let mut totals = TraceTotals {
        rows: 0,
        tokens: [0; GPUS as usize],
        energy_j: [0.0; GPUS as usize],
        next_tick: [0; GPUS as usize],
        last_time_s: 0.0,
    };
    for line in lines {
        let line = line.expect("text");
        let fields: Vec<&str> = line.split(',').collect();
        let number = |i: usize| -> f64 {
            fields[i]
                .parse()
                .unwrap_or_else(|_| panic!("not a number in column {i}: {line}"))
        };
        let g = number(gpu) as usize;
        assert!(g < GPUS as usize, "{line}");
        assert_eq!(
            number(tick) as u64,
            totals.next_tick[g],
            "GPU {g}: a tick is missing or repeated"
        );
        totals.next_tick[g] += 1;
        totals.tokens[g] += number(tokens) as u64;
        totals.energy_j[g] += number(energy);
        totals.last_time_s = totals.last_time_s.max(number(time));
        totals.rows += 1;
    }
    totals
}

#[test]
fn a_simulated_day_with_a_trapping_plugin_misses_no_tick_and_stays_bounded() {
    let hours: u64 = if std::env::var_os("TOKWATT_LONG_TESTS").is_some_and(|v| v == "1") {
        24
    } else {
        println!(
            "long_run: shortened to 2 simulated hours (the full 24 h takes minutes in the debug profile); set TOKWATT_LONG_TESTS=1 for the full day"
        );
        2
    };
    let ticks = hours * 3600;
    let dir = tempdir();
    let spec = write_spec(
        dir.path(),
        "trap-decide",
        &built_plugin("fixture_trap_decide"),
        // Retried soon after an ejection, so instances keep being rebuilt all day.
        "tick_ms = 1000\n[breaker]\nmax_backoff_ticks = 60",
    );
    let out = dir.path().join("out");
    let log = std::fs::File::create(dir.path().join("stderr.log")).expect("log file");
    let started = Instant::now();
    let mut child = sim_run(&spec, &format!("{hours}h"), &out)
        .args(["--gpus", &GPUS.to_string()])
        .stdout(Stdio::null())
        // A trapping plugin logs every trap: to a file, so no pipe fills and stalls it.
        .stderr(log)
        .spawn()
        .expect("tokwatt starts");
    let pid = child.id();

    // The peak resident set (VmHWM) only grows, so the last reading before the exit is
    // the run's peak, less the last few milliseconds. The resident set now (VmRSS) in the
    // first and last quarters of the run shows whether it creeps.
    let mut peak_kib = 0;
    let mut rss_samples = Vec::new();
    let status = loop {
        if let Some(status) = child.try_wait().expect("status") {
            break status;
        }
        if let Some(hwm) = status_kib(pid, "VmHWM") {
            peak_kib = peak_kib.max(hwm);
        }
        if let Some(rss) = status_kib(pid, "VmRSS") {
            rss_samples.push(rss);
        }
        assert!(
            started.elapsed() < Duration::from_secs(60 * 30),
            "the run takes too long"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let wall = started.elapsed();
    let log = std::fs::read_to_string(dir.path().join("stderr.log")).unwrap_or_default();
    assert!(status.success(), "tokwatt run failed: {status}\n{}", {
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    });
    assert!(!log.contains("panicked at host"), "the host panicked");

    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).expect("summary.json written"),
    )
    .expect("summary.json is JSON");
    let quarter = (rss_samples.len() / 4).max(1);
    let early = rss_samples.iter().take(quarter).max().copied().unwrap_or(0);
    let late = rss_samples
        .iter()
        .rev()
        .take(quarter)
        .max()
        .copied()
        .unwrap_or(0);
    println!(
        "long_run: {hours} simulated h on {GPUS} GPUs in {:.1} s wall; peak RSS {:.1} MiB; RSS early {:.1} MiB, late {:.1} MiB ({} samples); {} traps, {} rebuilds",
        wall.as_secs_f64(),
        peak_kib as f64 / 1024.0,
        early as f64 / 1024.0,
        late as f64 / 1024.0,
        rss_samples.len(),
        summary["policy_counters"]["traps"],
        summary["policy_counters"]["rebuilds"],
    );

    // No tick missed.
    assert_eq!(num(&summary, "ticks") as u64, ticks, "{summary}");
    assert_eq!(num(&summary, "duration_s"), ticks as f64);
    assert_eq!(summary["interrupted"], false);
    // The plugin misbehaved, and the host carried on.
    assert!(
        num(&summary, "fallback_ticks") as u64 >= ticks / 4,
        "{summary}"
    );
    assert!(summary["policy_counters"]["rebuilds"].as_u64() > Some(ticks / 4));

    // One trace row per tick and GPU, ticks in order with none missing.
    let trace = total_trace(&out.join("trace.csv"));
    assert_eq!(trace.rows, ticks * GPUS);
    assert_eq!(trace.next_tick, [ticks; GPUS as usize]);
    assert_eq!(trace.last_time_s, ticks as f64);

    // The trace's totals are the summary's, per GPU and overall (the trace rounds
    // energy to 1e-4 J a row).
    let gpus = summary["gpus"].as_array().expect("per-GPU summaries");
    assert_eq!(gpus.len() as u64, GPUS);
    let rounding_j = 0.5e-4 * ticks as f64 + 1e-9 * num(&summary, "energy_j");
    for (g, per_gpu) in gpus.iter().enumerate() {
        assert_eq!(
            trace.tokens[g],
            num(per_gpu, "tokens") as u64,
            "GPU {g} tokens"
        );
        let energy = num(per_gpu, "energy_j");
        assert!(
            (trace.energy_j[g] - energy).abs() <= rounding_j,
            "GPU {g}: trace energy {} J, summary {energy} J",
            trace.energy_j[g]
        );
    }
    assert_eq!(
        trace.tokens.iter().sum::<u64>(),
        num(&summary, "tokens") as u64
    );
    let energy = num(&summary, "energy_j");
    assert!(
        (trace.energy_j.iter().sum::<f64>() - energy).abs() <= GPUS as f64 * rounding_j,
        "trace energy {} J, summary {energy} J",
        trace.energy_j.iter().sum::<f64>()
    );

    // Memory bounded, and not creeping.
    assert!(peak_kib > 0, "no reading of the process's memory");
    assert!(
        peak_kib < PEAK_RSS_LIMIT_KIB,
        "peak RSS {peak_kib} KiB over {PEAK_RSS_LIMIT_KIB} KiB"
    );
    assert!(
        late <= early + 64 * 1024,
        "RSS grew from {early} KiB to {late} KiB over the run"
    );
}
