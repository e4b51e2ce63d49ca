//! Scenario families: judging scenarios drawn at random over ranges (GPU, model shape,
//! context and output lengths, objective kind and tightness, demand shape and level), so a
//! policy is judged on work nobody tuned it on. A family draws two splits from disjoint
//! random streams: a *tuning* split to develop policies against, and a *held-out* split
//! that only judges them.
//!
//! Every draw is a scenario file's text (written out with `tokwatt eval --write-scenarios`,
//! loadable as any other) parsed by [`EvalScenario::parse`], so a drawn scenario obeys the
//! same rules as a hand-written one. Demand is drawn as a share of what the GPU can serve
//! within the drawn TPOT bound ([`super::oracle::capacity_rps`]); the oracle then checks
//! each phase, and a scenario with a phase nothing serves is judged as an overload
//! (served demand first, see [`super::objective_breach`]).

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use super::oracle;
use super::scenario::{EvalScenario, ScenarioError};
use tokwatt_core::model::{ModelShape, max_batch_that_fits};
use tokwatt_core::rng::Rng;
use tokwatt_sim::GpuProfile;

/// The families there are: `broad` (decode only, a fixed context) and `serving`
/// (requests with prompts: prefill, then decode, with TTFT objectives).
pub const FAMILIES: &[&str] = &["broad", "serving"];
/// The kinds of work the `serving` family draws, equally often.
pub const SERVING_KINDS: [&str; 5] = ["chat", "rag", "agent-loop", "code-completion", "reasoning"];
/// The objective kinds the `serving` family draws from, equally often.
pub const SERVING_OBJECTIVE_KINDS: [&str; 6] = [
    "ttft",
    "tpot+ttft",
    "ttft+queue-wait",
    "tpot",
    "tpot+floor",
    "queue-wait+floor",
];
/// The demand shapes a family draws from, equally often.
pub const DEMAND_SHAPES: [&str; 7] = [
    "steady",
    "phased",
    "bursty",
    "diurnal",
    "idle-spikes",
    "fast-shifts",
    "overload",
];
/// The objective kinds a family draws from, equally often: TPOT, queue wait and a
/// throughput floor, alone and in pairs (a floor only paired: see `draw`).
pub const OBJECTIVE_KINDS: [&str; 5] = [
    "tpot",
    "queue-wait",
    "tpot+queue-wait",
    "tpot+floor",
    "queue-wait+floor",
];
/// Simulated time of a drawn scenario, seconds.
pub const FAMILY_DURATION_S: f64 = 1200.0;
/// Draws of one slot before the family gives up on it (a shape that never fits, say).
const ATTEMPTS: u64 = 64;

#[derive(Debug, thiserror::Error)]
pub enum FamilyError {
    #[error("no scenario family `{name}`: the families are {}", FAMILIES.join(", "))]
    Unknown { name: String },
    #[error("--count {count}: draw 1 to 1000 scenarios")]
    Count { count: usize },
    #[error(
        "family `{family}`, scenario {index}: no valid draw in {ATTEMPTS} attempts (last: {last})"
    )]
    NoValidDraw {
        family: String,
        index: usize,
        last: String,
    },
}

/// Which of a family's two disjoint sets of draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Split {
    /// Develop and tune policies against these.
    Tuning,
    /// Judge only: drawn from another random stream, never seen while tuning.
    HeldOut,
}

impl Split {
    fn stream(self) -> u64 {
        match self {
            Split::Tuning => 0x7e57_0000_0007_e417,
            Split::HeldOut => 0x4e1d_0000_0004_e1d0,
        }
    }

    /// `tuning` or `held-out`, as the command's folders and tables name it.
    pub fn name(self) -> &'static str {
        match self {
            Split::Tuning => "tuning",
            Split::HeldOut => "held-out",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Split::Tuning => "t",
            Split::HeldOut => "h",
        }
    }
}

/// One drawn scenario and what it was drawn as.
#[derive(Debug, Clone)]
pub struct Drawn {
    pub scenario: EvalScenario,
    /// The scenario file's text.
    pub text: String,
    /// The demand shape drawn (`steady`, `phased`, `bursty`, `diurnal`, `idle-spikes`,
    /// `fast-shifts`, `overload`).
    pub demand: &'static str,
    /// The kind of work (`serving` family: `chat`, `rag`, ...; `broad`: `decode`).
    pub work: &'static str,
}

/// `count` scenarios of `family`'s `split` from `seed`: the same arguments always draw the
/// same scenarios, and scenario `i` does not depend on `count`.
pub fn draw(
    family: &str,
    split: Split,
    count: usize,
    seed: u64,
) -> Result<Vec<Drawn>, FamilyError> {
    if !FAMILIES.contains(&family) {
        return Err(FamilyError::Unknown {
            name: family.to_owned(),
        });
    }
    if !(1..=1000).contains(&count) {
        return Err(FamilyError::Count { count });
    }
    (0..count)
        .map(|index| {
            let mut last = String::new();
            for attempt in 0..ATTEMPTS {
                let mut rng = Rng::stream(seed ^ split.stream(), (index as u64) << 8 | attempt);
                let name = format!("{family}-{}{seed}-{index:02}", split.tag());
                let drawn = if family == "serving" {
                    draw_serving(&name, &mut rng)
                } else {
                    draw_one(&name, &mut rng)
                };
                match drawn {
                    Ok(drawn) => return Ok(drawn),
                    Err(why) => last = why,
                }
            }
            Err(FamilyError::NoValidDraw {
                family: family.to_owned(),
                index,
                last,
            })
        })
        .collect()
}

/// A model shape of the family: a preset or a user-given shape, by size class.
struct Shape {
    label: &'static str,
    preset: Option<&'static str>,
    /// hidden, layers, heads, kv_heads, head_dim, mlp, vocab
    custom: Option<[u32; 7]>,
}

const SHAPES: [Shape; 4] = [
    Shape {
        label: "llama-3.2-1b",
        preset: Some("llama-3.2-1b"),
        custom: None,
    },
    Shape {
        label: "3B-class shape",
        preset: None,
        custom: Some([3072, 28, 24, 8, 128, 8192, 128_256]),
    },
    Shape {
        label: "llama-3-8b",
        preset: Some("llama-3-8b"),
        custom: None,
    },
    Shape {
        label: "14B-class shape",
        preset: None,
        custom: Some([5120, 48, 40, 8, 128, 13_824, 152_064]),
    },
];

fn pick<'a, T>(rng: &mut Rng, items: &'a [T]) -> &'a T {
    let index = ((rng.next_u64() as u128 * items.len() as u128) >> 64) as usize;
    &items[index.min(items.len() - 1)]
}

fn between(rng: &mut Rng, low: f64, high: f64) -> f64 {
    low + (high - low) * rng.uniform()
}

/// One draw of the `broad` family, or why it is not a valid scenario.
fn draw_one(name: &str, rng: &mut Rng) -> Result<Drawn, String> {
    let gpu = *pick(rng, &["h200", "h100", "a100"]);
    let shape = pick(rng, &SHAPES);
    let context = *pick(rng, &[512u32, 1024, 2048, 4096, 8192]);
    let output = *pick(rng, &[64u32, 128, 256, 512]);
    let profile = GpuProfile::load(gpu).map_err(|e| e.to_string())?;
    let model = model_of(shape)?;
    let fits =
        max_batch_that_fits(&model, context, profile.memory_bytes()).map_err(|e| e.to_string())?;
    if fits < 16 {
        return Err(format!(
            "{} at context {context} fits only {fits} sequences on {gpu}",
            shape.label
        ));
    }
    let batch_size_max = fits.min(512);
    draw_broad_rest(name, rng, gpu, shape, context, output, batch_size_max)
}

fn model_of(shape: &Shape) -> Result<ModelShape, String> {
    Ok(match (shape.preset, shape.custom) {
        (Some(preset), _) => ModelShape::preset(preset).map_err(|e| e.to_string())?,
        (None, Some([hidden, layers, heads, kv_heads, head_dim, mlp, vocab])) => ModelShape {
            name: "custom".into(),
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim,
            mlp,
            vocab,
            rope_theta: 500_000.0,
            norm_eps: 1e-5,
        },
        (None, None) => return Err("a shape with neither a preset nor a custom shape".into()),
    })
}

/// The model lines of a workload table: a preset's name, or a custom shape's table
/// (which goes last: TOML puts the keys after it inside it).
fn model_lines(shape: &Shape) -> (String, String) {
    let preset = shape
        .preset
        .map_or_else(String::new, |p| format!("model = \"{p}\"\n"));
    let custom = shape.custom.map_or_else(
        String::new,
        |[hidden, layers, heads, kv_heads, head_dim, mlp, vocab]| {
            format!(
                "\n[workload.model_shape]\nhidden = {hidden}\nlayers = {layers}\nheads = {heads}\nkv_heads = {kv_heads}\nhead_dim = {head_dim}\nmlp = {mlp}\nvocab = {vocab}\n"
            )
        },
    );
    (preset, custom)
}

#[allow(clippy::too_many_arguments)] // the draw so far, handed on
fn draw_broad_rest(
    name: &str,
    rng: &mut Rng,
    gpu: &'static str,
    shape: &Shape,
    context: u32,
    output: u32,
    batch_size_max: u32,
) -> Result<Drawn, String> {
    // The objective, its tightness drawn against this GPU and shape: the kinds
    // (TPOT, queue wait, throughput floor) alone and in pairs, equally likely. A floor is
    // checked only while requests wait, so alone it bounds nothing but the turning away
    // of demand: it comes paired.
    let kind = *pick(rng, &OBJECTIVE_KINDS);
    let mut workload = String::new();
    let _ = writeln!(workload, "[workload]");
    if let Some(preset) = shape.preset {
        let _ = writeln!(workload, "model = \"{preset}\"");
    }
    let _ = writeln!(
        workload,
        "context_tokens = {context}\noutput_tokens = {output}\nbatch_size_max = {batch_size_max}\nqueue_max = 2048"
    );
    if let Some([hidden, layers, heads, kv_heads, head_dim, mlp, vocab]) = shape.custom {
        let _ = writeln!(
            workload,
            "\n[workload.model_shape]\nhidden = {hidden}\nlayers = {layers}\nheads = {heads}\nkv_heads = {kv_heads}\nhead_dim = {head_dim}\nmlp = {mlp}\nvocab = {vocab}"
        );
    }
    // A probe of this GPU, shape and objective with one phase: the scale to draw demand on.
    let tpot_ms = if kind.starts_with("tpot") {
        let floor_ms = {
            let probe = parse(name, gpu, "", &workload, &[(0.0, 1.0)])?;
            oracle::single_sequence_tpot_ms(&probe)
        };
        Some(floor_ms * between(rng, 1.4, 3.5))
    } else {
        None
    };
    let queue_wait_ms = kind
        .contains("queue-wait")
        .then(|| between(rng, 500.0, 4000.0));
    let mut objective = String::from("[objective]\n");
    if let Some(ms) = tpot_ms {
        let _ = writeln!(objective, "tpot_p99_limit_ms = {ms:.1}");
    }
    if let Some(ms) = queue_wait_ms {
        let _ = writeln!(objective, "queue_wait_p99_limit_ms = {ms:.0}");
    }
    let probe = parse(name, gpu, &objective, &workload, &[(0.0, 1.0)])?;
    let capacity = oracle::capacity_rps(&probe);
    if !(capacity.is_finite() && capacity > 0.05) {
        return Err(format!(
            "{} at context {context} serves {capacity:.3} requests/s on {gpu} within the bound",
            shape.label
        ));
    }

    let (demand, phases) = draw_demand(rng, capacity);
    if kind.contains("floor") {
        // A throughput floor under the lightest phase's demand: met by serving it.
        let lightest = phases
            .iter()
            .map(|&(_, rps)| rps)
            .fold(f64::INFINITY, f64::min);
        let floor = 0.5 * lightest * f64::from(output);
        if floor >= 1.0 {
            let _ = writeln!(objective, "min_tokens_per_s = {floor:.0}");
        }
    }
    let mut sensor = String::new();
    let gain = *pick(rng, &[0.0, 0.02, 0.05]);
    let noise = *pick(rng, &[1.0, 1.0, 2.0]);
    if gain > 0.0 || noise > 1.0 {
        let _ = writeln!(
            sensor,
            "[sensor]\ngain_error_max = {gain}\nnoise_scale = {noise}"
        );
    }
    let description = format!(
        "{gpu}, {}, ctx {context}, {output} tokens out; {}; {demand} demand, {} phases, up to {:.1} of ~{capacity:.1} requests/s",
        shape.label,
        objective_words(tpot_ms, queue_wait_ms, &objective),
        phases.len(),
        phases.iter().map(|&(_, rps)| rps).fold(0.0, f64::max),
    );
    let text = file_text(&description, gpu, &objective, &sensor, &workload, &phases);
    let scenario = EvalScenario::parse(Path::new(&format!("{name}.toml")), &text)
        .map_err(|e| e.to_string())?;
    Ok(Drawn {
        scenario,
        text,
        demand,
        work: "decode",
    })
}

/// The prompt and output lengths of a kind of work (scenario-file values), and their
/// medians for the description. Medians from published traces' shapes: ShareGPT-like
/// chat, 4k-token retrieval contexts, agent loops re-reading a ~7k transcript for short
/// tool calls, code completion with long file prefixes and ~24-token answers, and
/// reasoning models' long outputs.
fn serving_lengths(work: &str, rng: &mut Rng) -> (String, String, u32, u32) {
    let jitter = |rng: &mut Rng, median: f64| (median * between(rng, 0.75, 1.33)).round();
    let (prompt, prompt_sigma, prompt_range, output, output_sigma, output_range) = match work {
        "chat" => (600.0, 0.9, (16, 8192), 200.0, 0.8, (4, 2048)),
        "rag" => (4000.0, 0.3, (1024, 8192), 250.0, 0.5, (16, 1024)),
        "agent-loop" => (7000.0, 0.25, (2048, 12_000), 96.0, 0.5, (8, 512)),
        "code-completion" => (1500.0, 0.6, (128, 6000), 24.0, 0.6, (4, 128)),
        _ => (300.0, 0.7, (16, 2048), 2000.0, 0.6, (128, 8192)),
    };
    let prompt = jitter(rng, prompt);
    let output = jitter(rng, output);
    let dist = |median: f64, sigma: f64, (min, max): (u32, u32)| {
        format!(
            "{{ distribution = \"lognormal\", median = {median}, sigma = {sigma}, min = {min}, max = {max} }}"
        )
    };
    (
        dist(prompt, prompt_sigma, prompt_range),
        dist(output, output_sigma, output_range),
        prompt as u32,
        output as u32,
    )
}

/// One draw of the `serving` family: requests with prompts of one kind of work, an
/// engine's step budget, TTFT and TPOT bounds drawn above what the GPU can do, and
/// demand drawn on the capacity within them.
fn draw_serving(name: &str, rng: &mut Rng) -> Result<Drawn, String> {
    let gpu = *pick(rng, &["h200", "h100", "a100"]);
    let shape = pick(rng, &SHAPES);
    let work = *pick(rng, &SERVING_KINDS);
    let (prompt, output, prompt_median, output_median) = serving_lengths(work, rng);
    let kind = *pick(rng, &SERVING_OBJECTIVE_KINDS);
    // An operator who bounds TPOT keeps the step budget small, so that a long prompt's
    // chunk does not stall every decoding sequence (vLLM's advice for inter-token
    // latency); one who bounds only TTFT or waits gives prefill room.
    let budget = if kind.contains("tpot") {
        *pick(rng, &[512u32, 1024, 2048])
    } else {
        *pick(rng, &[2048u32, 4096, 8192])
    };
    let (preset, custom) = model_lines(shape);
    let workload = format!(
        "[workload]\n{preset}prompt_tokens = {prompt}\noutput_tokens = {output}\nmax_batched_tokens = {budget}\nbatch_size_max = 512\nqueue_max = 2048\n{custom}"
    );
    let probe = parse(name, gpu, "", &workload, &[(0.0, 1.0)])?;
    if probe.workload.batch_size_max < 16 {
        return Err(format!(
            "{} with {work} lengths fits only {} sequences on {gpu}",
            shape.label, probe.workload.batch_size_max
        ));
    }
    // Bounds are drawn above the latencies at half the unbounded capacity.
    let unbounded = oracle::capacity_rps(&probe);
    let (tpot_floor_ms, ttft_floor_ms) = oracle::latency_floors_ms(&probe, 0.5 * unbounded);
    let tpot_ms = kind
        .contains("tpot")
        .then(|| tpot_floor_ms * between(rng, 1.3, 3.0));
    let ttft_ms = kind
        .contains("ttft")
        .then(|| ttft_floor_ms.unwrap_or(0.0) * between(rng, 1.5, 4.0));
    let queue_wait_ms = kind
        .contains("queue-wait")
        .then(|| between(rng, 500.0, 4000.0));
    let mut objective = String::from("[objective]\n");
    if let Some(ms) = tpot_ms {
        let _ = writeln!(objective, "tpot_p99_limit_ms = {ms:.1}");
    }
    if let Some(ms) = ttft_ms {
        let _ = writeln!(objective, "ttft_p99_limit_ms = {ms:.0}");
    }
    if let Some(ms) = queue_wait_ms {
        let _ = writeln!(objective, "queue_wait_p99_limit_ms = {ms:.0}");
    }
    let probe = parse(name, gpu, &objective, &workload, &[(0.0, 1.0)])?;
    let capacity = oracle::capacity_rps(&probe);
    if !(capacity.is_finite() && capacity > 0.05) {
        return Err(format!(
            "{} with {work} lengths serves {capacity:.3} requests/s on {gpu} within the bounds",
            shape.label
        ));
    }
    let (demand, phases) = draw_demand(rng, capacity);
    if kind.contains("floor") {
        let lightest = phases
            .iter()
            .map(|&(_, rps)| rps)
            .fold(f64::INFINITY, f64::min);
        let floor = 0.5 * lightest * probe.workload.output_tokens as f64;
        if floor >= 1.0 {
            let _ = writeln!(objective, "min_tokens_per_s = {floor:.0}");
        }
    }
    let mut words = objective_words(tpot_ms, queue_wait_ms, &objective);
    if let Some(ms) = ttft_ms {
        words = format!(
            "TTFT p99 <= {ms:.0} ms{}{words}",
            if words.is_empty() { "" } else { ", " }
        );
    }
    let description = format!(
        "{gpu}, {}, {work}: prompts ~{prompt_median}, outputs ~{output_median} tokens, step budget {budget}; {words}; {demand} demand, {} phases, up to {:.2} of ~{capacity:.2} requests/s",
        shape.label,
        phases.len(),
        phases.iter().map(|&(_, rps)| rps).fold(0.0, f64::max),
    );
    let text = file_text(&description, gpu, &objective, "", &workload, &phases);
    let scenario = EvalScenario::parse(Path::new(&format!("{name}.toml")), &text)
        .map_err(|e| e.to_string())?;
    Ok(Drawn {
        scenario,
        text,
        demand,
        work,
    })
}

fn objective_words(tpot_ms: Option<f64>, queue_wait_ms: Option<f64>, objective: &str) -> String {
    let mut words = Vec::new();
    if let Some(ms) = tpot_ms {
        words.push(format!("TPOT p99 <= {ms:.1} ms"));
    }
    if let Some(ms) = queue_wait_ms {
        words.push(format!("queue wait p99 <= {ms:.0} ms"));
    }
    if objective.contains("min_tokens_per_s") {
        words.push("a throughput floor".to_owned());
    }
    words.join(", ")
}

/// The demand shape and its phases (start, requests/s), levels drawn as shares of
/// `capacity` requests/s.
fn draw_demand(rng: &mut Rng, capacity: f64) -> (&'static str, Vec<(f64, f64)>) {
    let shape = *pick(rng, &DEMAND_SHAPES);
    // The steady-state capacity is an upper bound: queueing lifts the p99 near it. Shares
    // are of 80 % of it, so that only the overload shape is meant to overload.
    let at = |share: f64| (share * 0.8 * capacity * 100.0).round().max(1.0) / 100.0;
    let mut phases = Vec::new();
    match shape {
        "steady" => phases.push((0.0, at(between(rng, 0.3, 0.8)))),
        "phased" => {
            let count = 3 + (rng.uniform() * 3.0) as usize;
            let length = FAMILY_DURATION_S / count as f64;
            for i in 0..count {
                phases.push((i as f64 * length, at(between(rng, 0.1, 0.85))));
            }
        }
        "bursty" => {
            let (mut t, high, low) = (0.0, between(rng, 0.7, 0.95), between(rng, 0.05, 0.25));
            while t < FAMILY_DURATION_S {
                phases.push((t, at(high)));
                t += between(rng, 20.0, 40.0).round();
                phases.push((t, at(low)));
                t += between(rng, 90.0, 180.0).round();
            }
        }
        "diurnal" => {
            let peak = between(rng, 0.6, 0.9);
            for i in 0..12 {
                let day = (1.0 - (std::f64::consts::TAU * i as f64 / 12.0).cos()) / 2.0;
                phases.push((i as f64 * 100.0, at(0.08 + (peak - 0.08) * day)));
            }
        }
        "idle-spikes" => {
            let base = between(rng, 0.01, 0.05);
            let mut t = 0.0;
            while t < FAMILY_DURATION_S {
                phases.push((t, at(base)));
                t += between(rng, 150.0, 330.0).round();
                phases.push((t, at(between(rng, 0.5, 0.8))));
                t += 20.0;
            }
        }
        "fast-shifts" => {
            for i in 0..10 {
                phases.push((i as f64 * 120.0, at(between(rng, 0.1, 0.85))));
            }
        }
        _ => {
            // Overload: a stretch beyond what the GPU serves, between ordinary ones.
            phases.push((0.0, at(between(rng, 0.3, 0.7))));
            phases.push((400.0, at(between(rng, 1.5, 2.0))));
            phases.push((800.0, at(between(rng, 0.3, 0.7))));
        }
    }
    phases.retain(|&(start, _)| start < FAMILY_DURATION_S);
    (shape, phases)
}

fn file_text(
    description: &str,
    gpu: &str,
    objective: &str,
    sensor: &str,
    workload: &str,
    phases: &[(f64, f64)],
) -> String {
    let mut text = format!(
        "# Drawn by a scenario family (tokwatt eval --family).\ndescription = \"{description}\"\ngpu = \"{gpu}\"\nduration_s = {FAMILY_DURATION_S}\n\n{objective}\n{sensor}\n{workload}"
    );
    for &(start_s, rps) in phases {
        let _ = write!(
            text,
            "\n[[workload.phases]]\nstart_s = {start_s}\narrival_rps = {rps}\n"
        );
    }
    text
}

/// A scenario from its parts (a probe, or the draw itself).
fn parse(
    name: &str,
    gpu: &str,
    objective: &str,
    workload: &str,
    phases: &[(f64, f64)],
) -> Result<EvalScenario, String> {
    let text = file_text("probe", gpu, objective, "", workload, phases);
    EvalScenario::parse(Path::new(&format!("{name}.toml")), &text)
        .map_err(|e: ScenarioError| e.to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap

    use super::*;

    #[test]
    fn the_same_seed_draws_the_same_scenarios_and_a_longer_count_extends_them() {
        let five = draw("broad", Split::HeldOut, 5, 7).unwrap();
        let again = draw("broad", Split::HeldOut, 5, 7).unwrap();
        let three = draw("broad", Split::HeldOut, 3, 7).unwrap();
        let texts = |d: &[Drawn]| d.iter().map(|d| d.text.clone()).collect::<Vec<_>>();
        assert_eq!(texts(&five), texts(&again));
        assert_eq!(texts(&five)[..3], texts(&three)[..]);
        assert_eq!(five[4].scenario.name, "broad-h7-04");
    }

    #[test]
    fn the_splits_and_seeds_draw_different_scenarios() {
        let tuning = draw("broad", Split::Tuning, 8, 1).unwrap();
        let held_out = draw("broad", Split::HeldOut, 8, 1).unwrap();
        let other_seed = draw("broad", Split::HeldOut, 8, 2).unwrap();
        for (t, h) in tuning.iter().zip(&held_out) {
            assert_ne!(t.text, h.text);
        }
        for (a, b) in held_out.iter().zip(&other_seed) {
            assert_ne!(a.text, b.text);
        }
    }

    #[test]
    fn a_family_spans_what_it_promises() {
        let drawn = draw("broad", Split::Tuning, 120, 3).unwrap();
        let has = |f: &dyn Fn(&Drawn) -> bool| drawn.iter().any(f);
        for gpu in ["h200", "h100", "a100"] {
            assert!(has(&|d| d.scenario.profile.id == gpu), "no {gpu}");
        }
        for demand in DEMAND_SHAPES {
            assert!(has(&|d| d.demand == demand), "no {demand} demand");
        }
        assert!(has(&|d| d.scenario.workload.model_name == "llama-3.2-1b"));
        assert!(has(&|d| d.scenario.workload.model_name == "llama-3-8b"));
        assert!(
            has(&|d| d.scenario.workload.model.layers == 48),
            "no 14B class"
        );
        assert!(has(&|d| d.scenario.workload.context_tokens == 8192));
        assert!(has(&|d| d.scenario.objective.tpot_p99_limit_ms.is_none()
            && d.scenario.objective.queue_wait_p99_limit_ms.is_some()));
        assert!(has(&|d| d.scenario.objective.tpot_p99_limit_ms.is_some()
            && d.scenario.objective.queue_wait_p99_limit_ms.is_some()));
        assert!(has(&|d| d.scenario.objective.min_tokens_per_s.is_some()
            && d.scenario.objective.tpot_p99_limit_ms.is_some()));
        assert!(has(&|d| d.scenario.objective.min_tokens_per_s.is_some()
            && d.scenario.objective.queue_wait_p99_limit_ms.is_some()));
        assert!(has(&|d| d.scenario.objective.tpot_p99_limit_ms.is_some()
            && d.scenario.objective.queue_wait_p99_limit_ms.is_none()
            && d.scenario.objective.min_tokens_per_s.is_none()));
        for d in &drawn {
            let w = &d.scenario.workload;
            assert!(
                !w.phases.is_empty() && w.phases[0].start_s == 0.0,
                "{}",
                d.text
            );
            assert!(w.phases.iter().all(|p| p.arrival_rps > 0.0), "{}", d.text);
            assert_eq!(d.scenario.duration_s, FAMILY_DURATION_S);
            // The file's text is the scenario: it parses again to the same thing.
            let again =
                EvalScenario::parse(Path::new("again.toml"), &d.text).expect("the text parses");
            assert_eq!(again.workload.phases, w.phases);
        }
    }

    #[test]
    fn the_serving_family_draws_prompts_kinds_of_work_and_ttft_bounds() {
        let drawn = draw("serving", Split::Tuning, 60, 5).unwrap();
        let has = |f: &dyn Fn(&Drawn) -> bool| drawn.iter().any(f);
        for work in SERVING_KINDS {
            assert!(has(&|d| d.work == work), "no {work}");
        }
        assert!(has(&|d| d.scenario.objective.ttft_p99_limit_ms.is_some()
            && d.scenario.objective.tpot_p99_limit_ms.is_none()));
        assert!(has(&|d| d.scenario.objective.ttft_p99_limit_ms.is_some()
            && d.scenario.objective.tpot_p99_limit_ms.is_some()));
        assert!(has(&|d| d.scenario.objective.ttft_p99_limit_ms.is_none()));
        for d in &drawn {
            let w = &d.scenario.workload;
            let lengths = w.requests.as_ref().expect("every request has a prompt");
            if d.work == "agent-loop" {
                assert!(lengths.prompt.mean() > 4000.0, "{}", d.text);
            }
            if d.work == "reasoning" {
                assert!(lengths.output.mean() > lengths.prompt.mean(), "{}", d.text);
            }
            // Bounds are drawn where the GPU can keep them: demand fits under capacity
            // (but for the overload shape).
            let capacity = oracle::capacity_rps(&d.scenario);
            let peak = w.phases.iter().map(|p| p.arrival_rps).fold(0.0, f64::max);
            if d.demand != "overload" {
                assert!(peak <= capacity, "{peak} of {capacity}: {}", d.text);
            }
            let again =
                EvalScenario::parse(Path::new("again.toml"), &d.text).expect("the text parses");
            assert_eq!(again.workload.phases, w.phases);
            assert_eq!(again.objective, d.scenario.objective);
        }
    }

    #[test]
    fn an_unknown_family_or_count_names_the_fix() {
        let err = draw("narrow", Split::Tuning, 3, 1).unwrap_err().to_string();
        assert!(err.contains("broad"), "{err}");
        let err = draw("broad", Split::Tuning, 0, 1).unwrap_err().to_string();
        assert!(err.contains("1 to 1000"), "{err}");
    }
}
