//! The ladder search on a synthetic GPU: 51 caps from 200 W to 700 W, noisy power.

use super::*;
use tokwatt_policy_sdk::{StateReader, StateWriter, testing};

/// A GPU whose cap ladder is rungs 0..=50 (200 W + 10 W a rung).
struct SyntheticGpu {
    /// Requests a second arriving; capacity beyond it leaves the GPU demand-limited.
    demand_tokens_per_s: f64,
    seed: u64,
    queue: f64,
}

impl SyntheticGpu {
    fn new(demand_tokens_per_s: f64) -> SyntheticGpu {
        SyntheticGpu {
            demand_tokens_per_s,
            seed: 0x5EED,
            queue: 0.0,
        }
    }

    /// Uniform noise in [-1, 1).
    fn noise(&mut self) -> f64 {
        self.seed = self
            .seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.seed >> 11) as f64 / (1_u64 << 53) as f64) * 2.0 - 1.0
    }

    /// Tokens a second the GPU can make at `rung`: saturating in the cap, so tokens per
    /// joule under full load peaks near rung 15 (350 W).
    fn capacity(rung: usize) -> f64 {
        let cap_w = 200.0 + 10.0 * rung as f64;
        17_500.0 * (1.0 - (-(cap_w - 120.0) / 200.0).exp())
    }

    fn tick(&mut self, tick: u64, rung: usize, settling: bool) -> Observation {
        let cap_w = 200.0 + 10.0 * rung as f64;
        let capacity = Self::capacity(rung);
        let arrivals = self.demand_tokens_per_s * (1.0 + 0.3 * self.noise());
        let backlog = self.queue * 256.0 + arrivals;
        let tokens = backlog.min(capacity);
        self.queue = ((backlog - tokens) / 256.0).min(2048.0);
        let busy = tokens / capacity;
        // Power: the cap while busy, 4 % noise a tick.
        let power_w = (120.0 + (cap_w - 120.0) * busy.max(0.9)) * (1.0 + 0.04 * self.noise());
        let mut observation = testing::observation(0, tick);
        observation.tokens = tokens as u64;
        observation.energy_j = power_w;
        observation.power_avg_w = power_w;
        observation.tokens_per_s = tokens;
        observation.tokens_per_joule = tokens / power_w;
        observation.queue_depth = self.queue as u32;
        // Time per token grows as the GPU slows: 30 ms at 700 W, under full load.
        observation.tpot_p99_ms = 30.0 * Self::capacity(50) / capacity * busy.max(0.3);
        observation.in_force.power_cap_w = cap_w;
        observation.settling = settling;
        observation
    }
}

fn objective(limit_ms: Option<f64>) -> Objective {
    Objective {
        tpot_p99_limit_ms: limit_ms,
        min_tokens_per_s: None,
        queue_wait_p99_limit_ms: None,
        ttft_p99_limit_ms: None,
    }
}

/// Runs the search for `ticks` ticks and returns the rungs in force, tick by tick.
fn run(
    search: &mut LadderSearch,
    gpu: &mut SyntheticGpu,
    ticks: u64,
    objective: &Objective,
) -> Vec<usize> {
    run_edited(search, gpu, ticks, objective, |_| {})
}

/// [`run`], with each observation passed through `edit` before the search sees it.
fn run_edited(
    search: &mut LadderSearch,
    gpu: &mut SyntheticGpu,
    ticks: u64,
    objective: &Objective,
    mut edit: impl FnMut(&mut Observation),
) -> Vec<usize> {
    let config = LadderConfig::defaults();
    let mut in_force = search.current;
    let mut settling = false;
    let mut history = Vec::new();
    for tick in 0..ticks {
        let mut observation = gpu.tick(tick, in_force, settling);
        edit(&mut observation);
        let asked = search.observe(&observation, in_force, objective, &config);
        settling = asked != in_force;
        in_force = asked;
        history.push(in_force);
    }
    history
}

fn new_search() -> LadderSearch {
    LadderSearch::new(0, 51, &LadderConfig::defaults()).unwrap_or_else(|error| panic!("{error}"))
}

/// The rung with the most tokens per joule under full load, by brute force.
fn best_saturated_rung() -> usize {
    (0..=50)
        .max_by(|&a, &b| {
            let efficiency =
                |rung: usize| SyntheticGpu::capacity(rung) / (200.0 + 10.0 * rung as f64);
            efficiency(a).total_cmp(&efficiency(b))
        })
        .unwrap_or_default()
}

#[test]
fn under_full_load_it_finds_the_peak_through_the_noise() {
    let mut search = new_search();
    let mut gpu = SyntheticGpu::new(1e9);
    let history = run(&mut search, &mut gpu, 150, &objective(None));
    let best = best_saturated_rung();
    let settled = search.incumbent.unwrap_or(usize::MAX);
    // Within 3 rungs (30 W) of the peak, where tokens per joule is within ~1 %.
    assert!(
        settled.abs_diff(best) <= 3,
        "settled {settled}, best {best}: {history:?}"
    );
    // Settled well inside the run: the bracket closes in about nine windows.
    assert!(
        history[100..]
            .iter()
            .all(|&rung| rung.abs_diff(settled) <= 1)
    );
}

#[test]
fn while_demand_is_light_it_goes_down_to_the_lowest_cap_that_keeps_up() {
    let mut search = new_search();
    let demand = 7_600.0;
    let edge = (0..=50)
        .find(|&rung| SyntheticGpu::capacity(rung) >= demand)
        .unwrap_or(50);
    let mut gpu = SyntheticGpu::new(demand);
    run(&mut search, &mut gpu, 200, &objective(None));
    let settled = search.incumbent.unwrap_or(usize::MAX);
    assert!(
        (edge..=edge + 3).contains(&settled),
        "settled {settled}, edge {edge}"
    );
}

#[test]
fn a_breach_moves_up_at_once_and_the_search_stays_above_it() {
    let mut search = new_search();
    let mut gpu = SyntheticGpu::new(1e9);
    // 40 ms: caps below ~330 W break it under full load.
    let limit = objective(Some(40.0));
    let history = run(&mut search, &mut gpu, 200, &limit);
    let highest_breaking = highest_rung_breaking(40.0);
    let ticks_below = history
        .iter()
        .filter(|&&rung| rung <= highest_breaking)
        .count();
    assert!(
        ticks_below <= 4,
        "{ticks_below} ticks at breaking caps: {history:?}"
    );
    let settled = search.incumbent.unwrap_or_default();
    assert!(settled > highest_breaking);
}

#[test]
fn a_fall_in_demand_is_noticed_and_searched_again() {
    let mut search = new_search();
    let mut gpu = SyntheticGpu::new(1e9);
    run(&mut search, &mut gpu, 150, &objective(None));
    let saturated = search.incumbent.unwrap_or_default();
    gpu.demand_tokens_per_s = 1_200.0;
    gpu.queue = 0.0;
    run(&mut search, &mut gpu, 150, &objective(None));
    let light = search.incumbent.unwrap_or(usize::MAX);
    assert!(
        light + 5 < saturated,
        "saturated {saturated}, light {light}"
    );
    assert!(
        light <= 3,
        "light load settles near the lowest cap, not {light}"
    );
}

#[test]
fn the_state_round_trips_and_a_changed_ladder_is_refused() {
    let mut search = new_search();
    let mut gpu = SyntheticGpu::new(1e9);
    run(&mut search, &mut gpu, 37, &objective(Some(45.0)));
    let config = LadderConfig::defaults();
    let state = search.write_state(StateWriter::new()).finish(1);
    let mut reader = StateReader::new(&state.bytes);
    let restored = new_search().read_state(&mut reader, &config);
    assert_eq!(reader.finish(), Ok(()));
    assert_eq!(restored, Ok(search.clone()));
    let mut reader = StateReader::new(&state.bytes);
    let shorter = LadderSearch::new(0, 40, &config).unwrap_or_else(|error| panic!("{error}"));
    let error = shorter
        .read_state(&mut reader, &config)
        .err()
        .unwrap_or_default();
    assert!(error.contains("searched 51 settings"), "{error}");
}

/// The highest rung whose p99 time per token breaks `limit_ms` under full load.
fn highest_rung_breaking(limit_ms: f64) -> usize {
    (0..=50)
        .rev()
        .find(|&rung| 30.0 * SyntheticGpu::capacity(50) / SyntheticGpu::capacity(rung) > limit_ms)
        .unwrap_or_default()
}

#[test]
fn with_no_p99_known_under_a_limit_it_never_moves_down() {
    // The serving engine reports tokens but never a p99 (NaN every tick): the latency
    // is unknown, so the search cannot tell a lower cap is safe and stays at the top.
    let mut search = new_search();
    let mut gpu = SyntheticGpu::new(1e9);
    let history = run_edited(&mut search, &mut gpu, 200, &objective(Some(40.0)), |o| {
        o.tpot_p99_ms = f64::NAN;
    });
    assert!(
        history.iter().all(|&rung| rung == 50),
        "moved down on unknown latency: {history:?}"
    );
    assert_eq!(search.window.tpot_p99_ms.count, 0);
    assert!(search.window.record.ticks() > 0, "the ticks still count");
    // Without a latency limit, the same ticks are searched as usual.
    let mut search = new_search();
    let mut gpu = SyntheticGpu::new(1e9);
    run_edited(&mut search, &mut gpu, 200, &objective(None), |o| {
        o.tpot_p99_ms = f64::NAN;
    });
    assert!(search.incumbent.is_some_and(|rung| rung < 40));
}

#[test]
fn ticks_with_an_unknown_p99_are_left_out_and_the_known_ones_still_bound_the_search() {
    let mut search = new_search();
    let mut gpu = SyntheticGpu::new(1e9);
    let mut tick = 0_u64;
    let history = run_edited(&mut search, &mut gpu, 300, &objective(Some(40.0)), |o| {
        tick += 1;
        if tick.is_multiple_of(2) {
            o.tpot_p99_ms = f64::NAN;
        }
    });
    let highest_breaking = highest_rung_breaking(40.0);
    let settled = search.incumbent.unwrap_or_default();
    assert!(
        settled > highest_breaking && settled < 50,
        "settled at {settled}, above {highest_breaking} expected: {history:?}"
    );
    assert!(search.window.tpot_p99_ms.mean.is_finite());
}

#[test]
fn a_window_with_no_p99_is_unknown_never_within() {
    let mut window = LadderWindow::default();
    assert_eq!(window.latency(40.0, 0.1), WindowLatency::Unknown);
    window.tpot_p99_ms.push(f64::NAN, 30);
    assert_eq!(window.latency(40.0, 0.1), WindowLatency::Unknown);
    window.tpot_p99_ms.push(30.0, 30);
    assert_eq!(window.latency(40.0, 0.1), WindowLatency::Within);
    window.tpot_p99_ms.push(50.0, 30);
    assert_eq!(window.latency(40.0, 0.1), WindowLatency::Near(40.0));
}

#[test]
fn a_throughput_breach_on_a_tick_with_an_unknown_p99_moves_as_one_without_a_limit() {
    // Settle under full load, then break the throughput floor on a tick whose p99 is
    // unknown: the move must not depend on a NaN overshoot.
    let mut search = new_search();
    let mut gpu = SyntheticGpu::new(1e9);
    run(&mut search, &mut gpu, 150, &objective(None));
    let mut settled = false;
    for _ in 0..100 {
        if search.incumbent == Some(search.current) && search.window.record.ticks() > 0 {
            settled = true;
            break;
        }
        run(&mut search, &mut gpu, 1, &objective(None));
    }
    assert!(settled, "the search never sat at its settled rung");
    let in_force = search.current;
    let mut observation = gpu.tick(1000, in_force, false);
    observation.tpot_p99_ms = f64::NAN;
    assert!(observation.queue_depth > 0, "requests wait under full load");
    let floor = |limit_ms| Objective {
        tpot_p99_limit_ms: limit_ms,
        min_tokens_per_s: Some(1e12),
        queue_wait_p99_limit_ms: None,
        ttft_p99_limit_ms: None,
    };
    let config = LadderConfig::defaults();
    let mut with_limit = search.clone();
    let mut without_limit = search;
    let asked = with_limit.observe(&observation, in_force, &floor(Some(40.0)), &config);
    let expected = without_limit.observe(&observation, in_force, &floor(None), &config);
    assert!(expected > in_force, "a breach moves up");
    assert_eq!(asked, expected);
    assert_eq!(with_limit, without_limit);
    assert_eq!(
        tpot_overshoot(&observation, &floor(Some(40.0))),
        1.0,
        "an unknown p99 is no overshoot"
    );
    observation.tpot_p99_ms = 44.0;
    assert!((tpot_overshoot(&observation, &floor(Some(40.0))) - 1.1).abs() < 1e-12);
}

/// Runs the search under a host that holds every cap at or below `ceiling` (a fleet's
/// allowance, a limit from outside): the search asks, the host applies the lower.
fn run_held(
    search: &mut LadderSearch,
    gpu: &mut SyntheticGpu,
    ticks: u64,
    objective: &Objective,
    ceiling: usize,
) -> (Vec<usize>, Vec<usize>) {
    let config = LadderConfig::defaults();
    let mut in_force = search.current.min(ceiling);
    let mut settling = false;
    let (mut asked_history, mut history) = (Vec::new(), Vec::new());
    for tick in 0..ticks {
        let observation = gpu.tick(tick, in_force, settling);
        let asked = search.observe(&observation, in_force, objective, &config);
        let next = asked.min(ceiling);
        settling = next != in_force;
        in_force = next;
        asked_history.push(asked);
        history.push(in_force);
    }
    (asked_history, history)
}

#[test]
fn a_cap_the_host_holds_lower_bounds_the_search_which_goes_on_below_it() {
    // Light load: the lowest cap keeps up. The host holds caps at rung 10 (300 W); the
    // search must still find its way down rather than ask again and again for rungs
    // it is never given.
    let mut search = new_search();
    let mut gpu = SyntheticGpu::new(3_000.0);
    let (asked, history) = run_held(&mut search, &mut gpu, 200, &objective(None), 10);
    let settled = search.incumbent.unwrap_or(usize::MAX);
    assert!(settled <= 3, "settled {settled}: {history:?}");
    // After the first hold is noticed, it asks above the ceiling only rarely (when the
    // hold has expired, to see whether it was lifted).
    let above = asked[20..].iter().filter(|&&rung| rung > 10).count();
    assert!(
        above <= 10,
        "asked above the held cap {above} times: {asked:?}"
    );
}

#[test]
fn under_a_held_cap_a_breach_still_asks_above_it() {
    // Full load and a latency limit that rung 10 breaks: the search must keep asking for
    // more than the host gives (that ask is what a fleet grants watts on).
    let mut search = new_search();
    let mut gpu = SyntheticGpu::new(1e9);
    let limit_ms = 40.0;
    assert!(highest_rung_breaking(limit_ms) >= 10);
    let (asked, _) = run_held(&mut search, &mut gpu, 120, &objective(Some(limit_ms)), 10);
    let above = asked[20..].iter().filter(|&&rung| rung > 10).count();
    assert!(
        above >= 50,
        "asked above the held cap only {above} times: {asked:?}"
    );
}

#[test]
fn a_visit_that_fills_the_batch_while_making_too_few_tokens_falls_behind() {
    let window = |start: u32, last: u32, made: f64, asked: f64| LadderWindow {
        in_flight_start: start,
        in_flight_last: last,
        tokens_made: made,
        tokens_demanded: asked,
        batch_size: 512,
        ..LadderWindow::default()
    };
    // Too slow for the prompts: a third of the tokens asked for, the batch filling.
    let behind = window(150, 210, 700.0, 2300.0).falling_behind(16, 512);
    assert!(
        behind.as_deref().is_some_and(|why| why.contains("30 %")),
        "{behind:?}"
    );
    // A slower rung's longer-lived sequences below a quarter of the batch: Little's law,
    // not a backlog.
    assert_eq!(window(60, 90, 700.0, 2300.0).falling_behind(16, 512), None);
    // Keeping up while the batch fills (a burst being served) is not falling behind.
    assert_eq!(
        window(150, 210, 2200.0, 2300.0).falling_behind(16, 512),
        None
    );
    // No demand told: nothing to compare.
    assert_eq!(window(150, 210, 700.0, 0.0).falling_behind(16, 512), None);
}

#[test]
fn a_queue_wait_bound_holds_first_tokens_too_and_the_lower_bound_wins() {
    use crate::ladder::first_token_bound;
    let mut objective = objective(None);
    assert_eq!(first_token_bound(&objective), None);
    objective.queue_wait_p99_limit_ms = Some(1500.0);
    assert_eq!(first_token_bound(&objective), Some(1500.0));
    objective.ttft_p99_limit_ms = Some(800.0);
    assert_eq!(first_token_bound(&objective), Some(800.0));
}

#[test]
fn a_re_exploration_keeps_a_floor_until_its_hold_runs_out() {
    // After a rise always; after a fall with prompts (a rung that lagged them reads as
    // one). Without prompts a fall frees the rungs under the floor.
    for (shift, prompts, kept) in [
        (Shift::Rise, false, true),
        (Shift::Rise, true, true),
        (Shift::Fall, true, true),
        (Shift::Fall, false, false),
    ] {
        let mut search = new_search();
        search.serves_prompts = prompts;
        search.current = 30;
        search.floor = Some(Floor {
            rung: 20,
            windows_left: 3,
        });
        search.reexplore(shift, &LadderConfig::defaults());
        assert_eq!(search.floor.is_some(), kept, "{shift:?}, prompts {prompts}");
        assert!(
            !kept || (search.lo > 20 && search.current > 20),
            "{shift:?}: bracket {}-{}, at {}",
            search.lo,
            search.hi,
            search.current
        );
    }
}

/// A settled search whose shift detector fires a fall on the next tick, and whose visit
/// so far made `made` of 2,000 tokens asked for while 40 more sequences came in.
fn about_to_read_a_fall(made: f64) -> (LadderSearch, SyntheticGpu) {
    let mut search = new_search();
    let mut gpu = SyntheticGpu::new(1_200.0);
    run(&mut search, &mut gpu, 200, &objective(None));
    let config = LadderConfig::defaults();
    search.shift = ShiftDetector {
        ratio: 0.01,
        ticks_off: -i32::try_from(config.shift_ticks).unwrap_or(i32::MAX),
        demand: 1_200.0,
    };
    search.window.tokens_made = made;
    search.window.tokens_demanded = 2_000.0;
    search.window.in_flight_start = 60;
    search.window.in_flight_last = 100;
    (search, gpu)
}

#[test]
fn a_rung_that_lags_its_demand_does_not_read_as_less_work() {
    let config = LadderConfig::defaults();
    let observe = |(mut search, mut gpu): (LadderSearch, SyntheticGpu)| {
        let at = search.current;
        let observation = gpu.tick(1_000, at, false);
        search.observe(&observation, at, &objective(None), &config);
        search
    };
    // Keeping up with its arrivals: the fall is real, and the search starts again.
    let kept_up = observe(about_to_read_a_fall(1_900.0));
    assert!(
        kept_up.rungs.iter().all(|r| r.ticks() == 0),
        "a real fall drops the records and searches again"
    );
    // A third of the tokens asked for while the batch fills: the rung, not the load.
    let lagged = observe(about_to_read_a_fall(700.0));
    assert!(
        lagged.rungs.iter().any(|r| r.ticks() > 0),
        "a lagging rung dropped the records"
    );
}

#[test]
fn a_predicted_breach_raises_and_floors_like_a_measured_one_once_per_settling() {
    let config = LadderConfig::defaults();
    let mut search = LadderSearch::new(0, 51, &config).unwrap_or_else(|e| panic!("{e}"));
    search.resettle(20);
    search.raise_for_predicted_breach(20, 1.2, "first tokens predicted late", &config);
    let raised = search.current;
    assert!(raised > 20, "{raised}");
    assert_eq!(search.floor.map(|floor| floor.rung), Some(20));
    // While that raise settles, a second prediction does not stack on it.
    search.raise_for_predicted_breach(raised, 1.2, "again", &config);
    assert_eq!(search.current, raised);
    // A prediction that is not a number still raises (as a clear breach), never panics.
    search.raised = false;
    search.raise_for_predicted_breach(raised, f64::NAN, "unknown", &config);
    assert!(search.current > raised);
    // At the top there is nowhere to go.
    let mut top = LadderSearch::new(0, 51, &config).unwrap_or_else(|e| panic!("{e}"));
    top.raise_for_predicted_breach(50, 1.5, "late", &config);
    assert_eq!((top.current, top.floor), (50, None));
}

#[test]
fn a_rung_ruled_out_by_a_prediction_becomes_a_floor_and_the_search_moves_above_it() {
    let config = LadderConfig::defaults();
    let mut search = LadderSearch::new(0, 51, &config).unwrap_or_else(|e| panic!("{e}"));
    search.resettle(30);
    // The search probes a rung below; a prediction rules it out before it is tried.
    search.current = 29;
    search.rule_out_current("first tokens predicted late at rung 29", &config);
    assert_eq!(search.floor.map(|floor| floor.rung), Some(29));
    assert_eq!(search.current, 30, "back to the settled rung");
}

#[test]
fn settling_at_a_predicted_rung_keeps_to_the_floor() {
    let config = LadderConfig::defaults();
    let mut search = LadderSearch::new(0, 51, &config).unwrap_or_else(|e| panic!("{e}"));
    search.resettle(40);
    assert_eq!(search.settle_at(25), 25);
    assert_eq!((search.current, search.incumbent), (25, Some(25)));
    search.floor = Some(Floor {
        rung: 20,
        windows_left: 3,
    });
    assert_eq!(search.settle_at(5), 21, "not below the floor");
    assert_eq!(search.settle_at(99), 50, "not past the top");
}
