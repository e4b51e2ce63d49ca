//! The output files are an API boundary: their layouts are pinned here. Changing a key
//! or a column means raising the file's format version (see `tokwatt_agent::recorder`).

use crate::support::*;

/// The recorder's one reader of `summary.json` reads back everything the run wrote: the
/// typed summary, written again, is the file's JSON key for key and value for value.
#[test]
fn the_summary_reads_back_exactly_what_the_run_wrote() {
    let dir = tempdir();
    let spec = repo_root().join("policies/slo-batch.toml");
    let out = dir.path().join("run");
    let r = run_sim(&spec, "20s", &out, &["--gpus", "2"]);
    let summary = tokwatt_agent::read_summary(&out).expect("the run's summary reads");
    assert_eq!(summary.meta.gpu_count, 2);
    assert!(summary.meta.simulated);
    assert_eq!(summary.totals.gpus.len(), 2);
    let again = serde_json::to_value(&summary).expect("serialises");
    assert_eq!(
        again, r.summary,
        "a key or value did not survive the round trip"
    );
}

#[test]
fn summary_keys_are_stable() {
    let dir = tempdir();
    let spec = repo_root().join("policies/static.toml");
    let r = run_sim(&spec, "5s", &dir.path().join("run"), &["--gpus", "2"]);
    let object = r.summary.as_object().expect("summary is an object");
    let mut keys: Vec<&str> = object.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "actuator",
            "actuator_errors",
            "clamped_decisions",
            "data_source",
            "demand",
            "duration_s",
            "energy_j",
            "fallback_ticks",
            "format_version",
            "gpu_count",
            "gpu_name",
            "gpu_profile",
            "gpus",
            "guard",
            "interrupted",
            "non_finite_values",
            "objective",
            "objective_in_force",
            "output_formats",
            "plugin",
            "plugin_traps",
            "policy",
            "policy_at_end",
            "policy_counters",
            "policy_spec",
            "request_latency",
            "requests",
            "seed",
            "settings_changes",
            "simulated",
            "slo_violation_ticks",
            "swaps",
            "telemetry_errors",
            "tick_ms",
            "ticks",
            "tokens",
            "tokens_per_joule",
            "wall_time_s",
            "workload",
        ],
        "summary.json's keys changed: update this list, and raise SUMMARY_FORMAT_VERSION where a key was renamed or removed"
    );
    assert_eq!(r.summary["format_version"], 1);
    assert_eq!(r.summary["output_formats"]["trace_csv"], 3);
    assert_eq!(r.summary["output_formats"]["observations_jsonl"], 1);
    assert_eq!(r.summary["output_formats"]["requests_jsonl"], 1);
    assert_eq!(r.summary["gpu_count"], 2);
    assert_eq!(r.summary["gpus"].as_array().map(Vec::len), Some(2));
}

#[test]
fn the_summary_has_no_key_twice() {
    // serde_json keeps the last of two equal keys, so read the raw text.
    let dir = tempdir();
    let spec = repo_root().join("policies/static.toml");
    let out = dir.path().join("run");
    run_sim(&spec, "3s", &out, &[]);
    let text = std::fs::read_to_string(out.join("summary.json")).expect("summary");
    let top_level_keys: Vec<&str> = text
        .lines()
        .filter(|line| line.starts_with("  \"") && !line.starts_with("   "))
        .filter_map(|line| line.trim().split('"').nth(1))
        .collect();
    let mut unique = top_level_keys.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(
        unique.len(),
        top_level_keys.len(),
        "a key appears twice: {top_level_keys:?}"
    );
}

#[test]
fn trace_header_and_observation_lines_carry_their_format() {
    let dir = tempdir();
    let spec = repo_root().join("policies/static.toml");
    let out = dir.path().join("run");
    run_sim(&spec, "3s", &out, &[]);
    let trace = std::fs::read_to_string(out.join("trace.csv")).expect("trace");
    let header = trace.lines().next().expect("header");
    assert_eq!(header, tokwatt_agent::recorder::trace_header().join(","));
    let observations = std::fs::read_to_string(out.join("observations.jsonl")).expect("jsonl");
    for line in observations.lines() {
        let record: serde_json::Value = serde_json::from_str(line).expect("JSON line");
        assert_eq!(record["format_version"], 1, "{line}");
    }
}

/// The settings a policy's `init` gave are on the first tick's line of each GPU, beside
/// what the envelope let through; no later line has them.
#[test]
fn the_first_ticks_lines_hold_what_init_asked_for() {
    let dir = tempdir();
    let out = dir.path().join("run");
    let spec = write_spec(
        dir.path(),
        "capped",
        &built_plugin("policy_static"),
        "[params]\npower_cap_w = \"450\"\n",
    );
    run_sim(&spec, "3s", &out, &["--gpus", "2"]);
    let observations = std::fs::read_to_string(out.join("observations.jsonl")).expect("jsonl");
    let lines: Vec<serde_json::Value> = observations
        .lines()
        .map(|line| serde_json::from_str(line).expect("JSON line"))
        .collect();
    assert_eq!(lines.len(), 6, "3 ticks of 2 GPUs");
    for (i, line) in lines.iter().enumerate() {
        if i < 2 {
            assert_eq!(line["init"]["requested"]["power_cap_w"], 450.0, "{line}");
            assert_eq!(line["init"]["applied"]["power_cap_w"], 450.0, "{line}");
            assert_eq!(line["init"]["clamped"], false, "{line}");
            assert_eq!(line["observation"]["gpu"], i, "{line}");
        } else {
            assert!(line.get("init").is_none(), "{line}");
        }
    }
}

/// A tick record for GPU `gpu` at `tick`, as the loop writes it.
fn tick_record(gpu: u32, tick: u64) -> tokwatt_agent::recorder::TickRecord {
    let observation = tokwatt_core::types::Observation::typical_h200(gpu, tick);
    tokwatt_agent::recorder::TickRecord {
        time_s: tick as f64 + 1.0,
        policy: "static".into(),
        observation,
        requested: tokwatt_core::types::Settings::default(),
        applied: tokwatt_core::types::Settings::default(),
        in_force_after: observation.in_force,
        fallback: false,
        clamped: false,
        guard: false,
        slo_violation: false,
        energy_counter_j: 690.0 * (tick as f64 + 1.0),
        power_mem_avg_w: None,
        init: None,
    }
}

/// The files of one kind in `dir`, the current one last: `name.<keep>.ext` … `name.1.ext`,
/// `name.ext`. Fails on a gap in the numbering or a number past `keep`.
fn rotation_chain(
    dir: &std::path::Path,
    stem: &str,
    ext: &str,
    keep: u32,
) -> Vec<std::path::PathBuf> {
    let mut numbers: Vec<u32> = std::fs::read_dir(dir)
        .expect("read dir")
        .filter_map(|entry| {
            let name = entry
                .expect("entry")
                .file_name()
                .into_string()
                .expect("utf-8");
            name.strip_prefix(&format!("{stem}."))?
                .strip_suffix(&format!(".{ext}"))?
                .parse()
                .ok()
        })
        .collect();
    numbers.sort_unstable();
    assert_eq!(
        numbers,
        (1..=keep).collect::<Vec<_>>(),
        "{stem}: rotated files 1..={keep} expected"
    );
    let mut chain: Vec<_> = numbers
        .iter()
        .rev()
        .map(|n| dir.join(format!("{stem}.{n}.{ext}")))
        .collect();
    chain.push(dir.join(format!("{stem}.{ext}")));
    chain
}

/// A summary as the loop writes it, for a recording made tick by tick in a test.
fn recorded_summary(duration_s: f64) -> tokwatt_agent::RunSummary {
    tokwatt_agent::RunSummary {
        format_version: tokwatt_agent::SUMMARY_FORMAT_VERSION,
        output_formats: tokwatt_agent::OutputFormats::default(),
        policy: "static".into(),
        policy_spec: "policies/static.toml".into(),
        plugin: "static.wasm".into(),
        tick_ms: 1000,
        objective: Some(tokwatt_core::types::Objective::default()),
        objective_in_force: None,
        meta: tokwatt_agent::RunMeta {
            simulated: true,
            gpu_profile: "h200".into(),
            gpu_name: "NVIDIA H200".into(),
            data_source: "simulator".into(),
            gpu_count: 2,
            actuator: "sim".into(),
            workload: "sim".into(),
            seed: 1,
        },
        totals: tokwatt_agent::control::LoopTotals {
            duration_s,
            ..Default::default()
        },
    }
}

#[test]
fn rotated_outputs_stay_bounded_each_file_reads_on_its_own_and_no_tick_is_lost() {
    use tokwatt_agent::recorder::{Recorder, Rotation};
    let dir = tempdir();
    let out = dir.path().join("run");
    let rotation = Rotation {
        max_bytes: 16 * 1024,
        keep: 3,
    };
    let gpus = 2_u32;
    let ticks = 2_000_u64;
    let mut recorder = Recorder::create_rotating(&out, false, rotation).expect("recorder");
    for tick in 0..ticks {
        for gpu in 0..gpus {
            recorder.record(&tick_record(gpu, tick)).expect("record");
        }
    }
    recorder
        .finish(&recorded_summary(ticks as f64))
        .expect("finish");

    // The trace: every file within the bound, each with the header, and the ticks one
    // run without a gap from the oldest kept file to the current one.
    let header = tokwatt_agent::recorder::trace_header().join(",");
    let mut last: Option<(u64, u32)> = None;
    let trace_files = rotation_chain(&out, "trace", "csv", rotation.keep);
    for path in &trace_files {
        let text = std::fs::read_to_string(path).expect("trace file");
        assert!(
            text.len() as u64 <= rotation.max_bytes,
            "{} is {} bytes",
            path.display(),
            text.len()
        );
        let mut reader = csv::Reader::from_reader(text.as_bytes());
        assert_eq!(
            reader
                .headers()
                .expect("header")
                .iter()
                .collect::<Vec<_>>()
                .join(","),
            header,
            "{}",
            path.display()
        );
        let rows: Vec<csv::StringRecord> = reader.records().map(|r| r.expect("row")).collect();
        assert!(!rows.is_empty(), "{} has no rows", path.display());
        for row in rows {
            let tick: u64 = row[1].parse().expect("tick");
            let gpu: u32 = row[2].parse().expect("gpu");
            let time_s: f64 = row[0].parse().expect("time");
            assert_eq!(time_s, tick as f64 + 1.0, "{}", path.display());
            if let Some(previous) = last {
                let expected = if previous.1 + 1 == gpus {
                    (previous.0 + 1, 0)
                } else {
                    (previous.0, previous.1 + 1)
                };
                assert_eq!((tick, gpu), expected, "a gap in {}", path.display());
            }
            last = Some((tick, gpu));
        }
    }
    assert_eq!(
        last,
        Some((ticks - 1, gpus - 1)),
        "the last tick is in trace.csv"
    );

    // The observations: the same bound and the same unbroken run of ticks.
    let mut last: Option<(u64, u64)> = None;
    let observation_files = rotation_chain(&out, "observations", "jsonl", rotation.keep);
    for path in &observation_files {
        let text = std::fs::read_to_string(path).expect("observations file");
        assert!(
            text.len() as u64 <= rotation.max_bytes,
            "{}",
            path.display()
        );
        assert!(!text.is_empty(), "{} is empty", path.display());
        for line in text.lines() {
            let record: serde_json::Value = serde_json::from_str(line).expect("JSON line");
            assert_eq!(record["format_version"], 1);
            let tick = record["observation"]["tick"].as_u64().expect("tick");
            let gpu = record["observation"]["gpu"].as_u64().expect("gpu");
            if let Some((previous_tick, previous_gpu)) = last {
                let expected = if previous_gpu + 1 == u64::from(gpus) {
                    (previous_tick + 1, 0)
                } else {
                    (previous_tick, previous_gpu + 1)
                };
                assert_eq!((tick, gpu), expected, "a gap in {}", path.display());
            }
            last = Some((tick, gpu));
        }
    }
    assert_eq!(last, Some((ticks - 1, u64::from(gpus) - 1)));

    // Rotation dropped the oldest lines (the run wrote far more than the bound keeps),
    // and the report still renders from the current trace alone.
    let total: u64 = trace_files
        .iter()
        .chain(&observation_files)
        .map(|p| std::fs::metadata(p).expect("size").len())
        .sum();
    assert!(total <= 2 * u64::from(rotation.keep + 1) * rotation.max_bytes);
    let oldest = std::fs::read_to_string(&trace_files[0]).expect("oldest");
    let mut oldest = csv::Reader::from_reader(oldest.as_bytes());
    let first_kept = oldest.records().next().expect("a row").expect("row");
    assert!(
        first_kept[1].parse::<u64>().expect("tick") > 0,
        "nothing was rotated away"
    );
    let html = tokwatt_agent::run_report::run_report(&out).expect("report from the current trace");
    assert!(html.contains("GPU 1"));
}

#[test]
fn a_checkpoint_writes_the_summary_and_the_recording_goes_on() {
    use tokwatt_agent::recorder::{Recorder, Rotation};
    let dir = tempdir();
    let out = dir.path().join("run");
    let rotation = Rotation {
        max_bytes: Rotation::MIN_BYTES,
        keep: 1,
    };
    let mut recorder = Recorder::create_rotating(&out, false, rotation).expect("recorder");
    for tick in 0..10 {
        recorder.record(&tick_record(0, tick)).expect("record");
    }
    recorder
        .checkpoint(&serde_json::json!({"ticks": 10}))
        .expect("checkpoint");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).expect("summary"))
            .expect("JSON");
    assert_eq!(summary["ticks"], 10);
    // What the summary counts is on disk: the trace reaches tick 9.
    let current = std::fs::read_to_string(out.join("trace.csv")).expect("trace");
    let last_row = current.lines().last().expect("a row");
    assert!(last_row.starts_with("10.0,9,"), "{last_row}");
    for tick in 10..20 {
        recorder
            .record(&tick_record(0, tick))
            .expect("record after a checkpoint");
    }
    recorder
        .finish(&serde_json::json!({"ticks": 20}))
        .expect("finish");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).expect("summary"))
            .expect("JSON");
    assert_eq!(summary["ticks"], 20);
    let leftovers: Vec<String> = std::fs::read_dir(&out)
        .expect("dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
}

#[test]
fn rotated_files_of_an_earlier_run_count_as_a_run_and_overwrite_clears_them() {
    use tokwatt_agent::recorder::{Recorder, Rotation};
    let dir = tempdir();
    let out = dir.path().join("run");
    std::fs::create_dir_all(&out).expect("dir");
    std::fs::write(out.join("trace.4.csv"), "old").expect("old rotated file");
    let rotation = Rotation {
        max_bytes: 1 << 20,
        keep: 2,
    };
    let error = Recorder::create_rotating(&out, false, rotation).expect_err("earlier run");
    let message = error.to_string();
    assert!(
        message.contains("trace.4.csv") && message.contains("--overwrite"),
        "{message}"
    );
    assert!(
        out.join("trace.4.csv").exists(),
        "a refusal changes nothing"
    );
    Recorder::create_rotating(&out, true, rotation).expect("overwrite asked for");
    assert!(!out.join("trace.4.csv").exists(), "runs must not mix");
    let error = Recorder::create_rotating(
        &dir.path().join("other"),
        false,
        Rotation {
            max_bytes: 10,
            keep: 2,
        },
    )
    .expect_err("too small");
    assert!(error.to_string().contains("max_bytes is 10"), "{error}");
    assert!(
        !dir.path().join("other").exists(),
        "bad bounds create nothing"
    );
}

/// Complete lines in `path` (a line being written at a kill may be cut short).
fn complete_lines(path: &std::path::Path) -> usize {
    std::fs::read(path).map_or(0, |bytes| bytes.iter().filter(|&&b| b == b'\n').count())
}

/// Issue 28's crash promise: each tick's rows reach the files before the next tick (the
/// operating system's, not an fsync), so after `kill -9` the trace and observations hold
/// every tick but the one in flight. Watched on the simulator against the wall clock:
/// buffered, rows would appear some 25 ticks at a time; written through, tick by tick.
#[test]
fn a_kill_9_loses_at_most_the_tick_in_flight() {
    let dir = tempdir();
    let out = dir.path().join("out");
    let trace = out.join("trace.csv");
    let observations = out.join("observations.jsonl");
    let mut child = sim_run(&repo_root().join("policies/static.toml"), "120s", &out)
        .args(["--realtime", "--tick", "200ms"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("tokwatt starts");
    let started = std::time::Instant::now();
    while complete_lines(&trace) < 2 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "no tick written"
        );
        if let Ok(Some(status)) = child.try_wait() {
            panic!("tokwatt exited early: {status}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Three seconds: 15 ticks. Count how often the trace grew while watched.
    let mut seen = vec![complete_lines(&trace)];
    let watch = std::time::Instant::now();
    while watch.elapsed() < std::time::Duration::from_secs(3) {
        let now = complete_lines(&trace);
        if Some(&now) != seen.last() {
            seen.push(now);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    assert!(
        seen.len() >= 10,
        "the trace grew tick by tick while the run went on: {seen:?}"
    );
    // Every tick written is whole in both files: one trace row (after the header) and
    // one observation line each, the last of them complete.
    let rows = complete_lines(&trace) - 1;
    let lines = complete_lines(&observations);
    assert!(
        rows >= *seen.last().unwrap_or(&0) - 1,
        "nothing written was lost"
    );
    assert!(
        rows.abs_diff(lines) <= 1,
        "trace rows {rows} and observation lines {lines} agree but for the tick in flight"
    );
    let text = std::fs::read_to_string(&trace).expect("trace");
    let last_tick: usize = text
        .lines()
        .nth(rows)
        .and_then(|row| row.split(',').nth(1))
        .and_then(|tick| tick.parse().ok())
        .expect("the last complete row has a tick");
    assert_eq!(
        last_tick + 1,
        rows,
        "no tick is missing before the last one written"
    );
}

/// Runs `tokwatt ARGS` under `umask`, as a shell would start it.
fn tokwatt_under_umask(umask: &str, args: &[std::ffi::OsString]) -> std::process::Output {
    let mut command = std::process::Command::new("sh");
    command
        .arg("-c")
        .arg(format!("umask {umask} && exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_tokwatt"))
        .args(args);
    for (key, value) in tokwatt().get_envs() {
        match value {
            Some(value) => command.env(key, value),
            None => command.env_remove(key),
        };
    }
    command.output().expect("sh runs tokwatt")
}

#[cfg(unix)]
#[test]
fn every_output_file_has_a_plain_files_mode_under_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    let root = repo_root();
    let spec = root.join("policies/static.toml");
    for (umask, mode) in [("022", 0o644), ("077", 0o600)] {
        let dir = tempdir();
        let out = |name: &str| dir.path().join(name).into_os_string();
        let commands: Vec<Vec<std::ffi::OsString>> = vec![
            sim_run_args(&spec, "10s", dir.path().join("run").as_path()),
            [
                "ab", "--sim", "h200", "--quiet", "--budget", "4", "--epoch", "5s", "--warmup",
                "5s",
            ]
            .map(Into::into)
            .into_iter()
            .chain([
                "--a".into(),
                spec.clone().into(),
                "--b".into(),
                spec.clone().into(),
                "--scenario".into(),
                root.join("host/scenarios/steady.toml").into(),
                "--out".into(),
                out("ab"),
            ])
            .collect(),
            vec![
                "eval".into(),
                "--policies".into(),
                spec.clone().into(),
                "--scenarios".into(),
                root.join("host/scenarios/eval/h200-1b-latency.toml").into(),
                "--duration".into(),
                "60s".into(),
                "--out".into(),
                out("eval"),
            ],
        ];
        for args in &commands {
            let output = tokwatt_under_umask(umask, args);
            assert!(output.status.success(), "{args:?}: {}", stderr(&output));
        }
        for file in [
            "run/summary.json",
            "run/report.html",
            "run/trace.csv",
            "run/observations.jsonl",
            "ab/ab.json",
            "ab/report.html",
            "eval/eval.json",
            "eval/report.html",
        ] {
            let path = dir.path().join(file);
            let found = std::fs::metadata(&path)
                .unwrap_or_else(|e| panic!("{file}: {e}"))
                .permissions()
                .mode()
                & 0o777;
            assert_eq!(found, mode, "{file} under umask {umask}: {found:o}");
        }
    }
}

/// A long `tokwatt run` keeps its files within `--max-file-mib` and `--keep-files` and
/// `requests.jsonl` within `--max-request-lines`; the requests not written are counted in
/// the summary and named in the summary lines, and replay and the report read what is kept.
#[test]
fn a_long_run_keeps_its_output_bounded_and_says_what_it_left_out() {
    let dir = tempdir();
    let out = dir.path().join("run");
    let spec = repo_root().join("policies/slo-batch.toml");
    let output = sim_run(&spec, "40m", &out)
        .args([
            "--max-file-mib",
            "1",
            "--keep-files",
            "1",
            "--max-request-lines",
            "500",
        ])
        .output()
        .expect("tokwatt runs");
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).expect("summary.json"),
    )
    .expect("JSON");
    let latency = &summary["request_latency"];
    let requests = latency["requests"].as_u64().expect("requests");
    let not_written = latency["requests_not_written"].as_u64().expect("count");
    assert_eq!(requests - not_written, 500, "{latency}");
    assert!(not_written > 0);
    let lines = std::fs::read_to_string(out.join("requests.jsonl")).expect("requests.jsonl");
    assert_eq!(lines.lines().count(), 500);
    assert!(
        stdout.contains(&format!(
            "{not_written} more NOT written (--max-request-lines 500)"
        )),
        "{stdout}"
    );
    // 2 400 ticks of observations are over 3 MiB: one rotated file kept, the oldest gone.
    for name in ["observations.jsonl", "observations.1.jsonl", "trace.csv"] {
        let size = std::fs::metadata(out.join(name)).expect(name).len();
        assert!(size <= 1024 * 1024, "{name} is {size} bytes");
    }
    assert!(!out.join("observations.2.jsonl").exists());
    assert!(stdout.contains("were rotated away"), "{stdout}");
    let report = std::fs::read_to_string(out.join("report.html")).expect("report.html");
    assert!(report.contains("Simulator output"));
    let replay = tokwatt()
        .args(["replay", "--ticks", "2390..", "--policy"])
        .arg(&spec)
        .arg(&out)
        .output()
        .expect("replay runs");
    assert!(replay.status.success(), "{}", stderr(&replay));
    assert!(
        String::from_utf8_lossy(&replay.stdout).contains("rotated away"),
        "replay says where the kept files start"
    );
}
