use super::*;
use crate::recorder::Recorder;
use tokwatt_core::actuator::DryRun;
use tokwatt_core::clock::VirtualClock;
use tokwatt_core::types::Knobs;
use tokwatt_policy::envelope::Guardrails;
use tokwatt_policy::supervisor::{BreakerConfig, InitArgs};
use tokwatt_sim::{GpuProfile, Scenario, SimConfig, SimGpu};
use tokwatt_test_support::NativePolicy;

/// 20 ticks on the simulator, through its own actuator or a dry run, with a policy
/// that always asks for 650 W. Returns the totals and every observation.
fn run_fixed_cap(dry_run: bool) -> (LoopTotals, Vec<Observation>) {
    run_fixed_cap_on(dry_run, Scenario::built_in().expect("scenario"))
}

fn run_fixed_cap_on(dry_run: bool, scenario: Scenario) -> (LoopTotals, Vec<Observation>) {
    let (control, mut recorder, _dir) =
        fixed_cap_loop(dry_run, scenario, Arc::new(AtomicBool::new(false)));
    let mut seen = Vec::new();
    let (totals, _) = control
        .run(&mut recorder, &mut |p| {
            seen.extend_from_slice(p.observations)
        })
        .expect("runs");
    (totals, seen)
}

/// A 20-tick loop on the simulator with a policy that always asks for 650 W, its
/// recorder, and the folder the recorder writes to.
fn fixed_cap_loop(
    dry_run: bool,
    scenario: Scenario,
    stop: Arc<AtomicBool>,
) -> (ControlLoop, Recorder, tempfile::TempDir) {
    let clock = VirtualClock::new();
    let sim = SimGpu::new(
        SimConfig {
            profile: GpuProfile::load("h200").expect("profile"),
            scenario,
            gpus: 1,
            seed: 1,
            noise_seed: None,
        },
        clock.clone(),
    )
    .expect("sim");
    let devices = sim.telemetry().devices();
    let mut real = sim.actuator();
    let actuator: Box<dyn Actuator> = if dry_run {
        let current = vec![real.read(0).expect("read")];
        Box::new(DryRun::new(devices.clone(), current))
    } else {
        real
    };
    let backends = Backends {
        telemetry: sim.telemetry(),
        actuator,
        workload: sim.workload(),
        clock,
    };
    let knobs = Knobs {
        power_cap: true,
        ..Knobs::default()
    };
    let envelope =
        Envelope::new(&devices, &[512], &Guardrails::default(), knobs).expect("envelope");
    let args = InitArgs {
        devices: envelope.facts(&devices),
        knobs,
        objective: Objective::default(),
        params: vec![],
        tick_ms: 1000,
        seed: 1,
    };
    let fixed_cap = NativePolicy::new(|_, observations| {
        Ok(vec![
            Settings {
                power_cap_w: Some(650.0),
                ..Settings::default()
            };
            observations.len()
        ])
    });
    let (supervisor, first) =
        Supervisor::start(Box::new(fixed_cap), args, BreakerConfig::default()).expect("starts");
    let dir = tempfile::tempdir().expect("tempdir");
    let recorder = Recorder::create(dir.path(), false).expect("recorder");
    let control = ControlLoop::new(
        backends,
        supervisor,
        &first,
        envelope,
        LoopConfig::new(
            Duration::from_secs(20),
            Duration::from_secs(1),
            Objective::default(),
        ),
        stop,
    );
    (control, recorder, dir)
}

#[test]
fn the_loop_steps_one_tick_per_call_until_its_duration_or_a_stop() {
    // To the end of its duration: 20 ticks, then nothing more however often it is asked.
    let stop = Arc::new(AtomicBool::new(false));
    let (mut control, mut recorder, _dir) =
        fixed_cap_loop(false, Scenario::built_in().expect("scenario"), stop);
    for expected in 0..20 {
        let progress = control.tick(&mut recorder).expect("ticks").expect("a tick");
        assert_eq!((progress.tick, progress.ticks), (expected, 20));
        assert_eq!(progress.time, Duration::from_secs(expected + 1));
        assert_eq!(progress.observations.len(), 1);
        assert_eq!(progress.requested.len(), 1);
        assert_eq!(progress.totals.ticks, expected + 1);
    }
    assert!(control.tick(&mut recorder).expect("over").is_none());
    assert!(control.tick(&mut recorder).expect("still over").is_none());
    let (totals, _) = control.finish();
    assert_eq!(totals.ticks, 20);
    assert!(!totals.interrupted);

    // A stop raised between ticks ends the run at the next call, marked interrupted.
    let stop = Arc::new(AtomicBool::new(false));
    let (mut control, mut recorder, _dir) =
        fixed_cap_loop(false, Scenario::built_in().expect("scenario"), stop.clone());
    for _ in 0..5 {
        control.tick(&mut recorder).expect("ticks").expect("a tick");
    }
    stop.store(true, Ordering::Relaxed);
    assert!(control.tick(&mut recorder).expect("stopped").is_none());
    let (totals, _) = control.finish();
    assert_eq!(totals.ticks, 5);
    assert!(totals.interrupted);
}

#[test]
fn a_setting_is_applied_once_not_every_tick() {
    for dry_run in [false, true] {
        let (totals, seen) = run_fixed_cap(dry_run);
        assert_eq!(totals.settings_changes, 1, "dry run {dry_run}");
        assert_eq!(totals.ticks, 20);
        // From the tick after the change on, the policy sees its cap in force.
        assert!(
            seen[1..].iter().all(|o| o.in_force.power_cap_w == 650.0),
            "dry run {dry_run}: {:?}",
            seen.iter()
                .map(|o| o.in_force.power_cap_w)
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn a_cap_held_lower_from_outside_is_not_reapplied_every_tick() {
    // Something outside tokwatt holds the limit at 400 W; the policy asks for 650 W
    // every tick. The request is applied once; the policy sees the enforced 400 W.
    let mut scenario = Scenario::built_in().expect("scenario");
    for phase in &mut scenario.phases {
        phase.outside_power_limit_w = Some(400.0);
    }
    let (totals, seen) = run_fixed_cap_on(false, scenario);
    assert_eq!(totals.settings_changes, 1);
    // Tick 1's window follows the change, so it alone settles.
    assert!(
        seen[2..].iter().all(|o| !o.settling
            && o.in_force.power_cap_w == 400.0
            && o.in_force.power_cap_requested_w == 650.0),
        "{:?}",
        seen.iter()
            .map(|o| (o.settling, o.in_force.power_cap_w))
            .collect::<Vec<_>>()
    );
}

#[test]
fn demand_totals_sum_ticks_and_gpus() {
    use tokwatt_core::types::DemandWindow;
    let window = |arrived, turned_away, wait| DemandWindow {
        requests_arrived: arrived,
        requests_completed: arrived - turned_away,
        requests_turned_away: turned_away,
        tokens_demanded: arrived * 10,
        queue_wait_p99_ms: wait,
    };
    let mut gpu0 = DemandTotals::default();
    gpu0.add(&window(4, 0, Some(5.0)), 40);
    gpu0.add(&window(6, 2, None), 40);
    assert_eq!(gpu0.requests_arrived, 10);
    assert_eq!(gpu0.tokens_served, 80);
    assert_eq!(gpu0.ticks_turning_away, 1);
    assert_eq!(gpu0.served_fraction, 0.8);
    assert_eq!(gpu0.worst_tick_queue_wait_p99_ms, Some(5.0));
    let mut gpu1 = DemandTotals::default();
    gpu1.add(&window(10, 1, Some(9.0)), 100);
    gpu1.add(&window(10, 1, None), 100);
    let mut node = gpu0;
    node.merge(&gpu1);
    assert_eq!(node.requests_arrived, 30);
    assert_eq!(node.served_fraction, 280.0 / 300.0);
    // The most of any one GPU, not the sum: ticks are shared by every GPU.
    assert_eq!(node.ticks_turning_away, 2);
    assert_eq!(node.worst_tick_queue_wait_p99_ms, Some(9.0));
}

/// Invariant 9: a policy that does not own the power cap takes over from one that held
/// it at 650 W; the cap goes back to the node's baseline (the board default it found) at
/// the switch, and the record of that tick shows the move.
#[test]
fn a_knob_the_new_policy_does_not_own_returns_to_the_baseline() {
    let clock = VirtualClock::new();
    let sim = SimGpu::new(
        SimConfig {
            profile: GpuProfile::load("h200").expect("profile"),
            scenario: Scenario::built_in().expect("scenario"),
            gpus: 1,
            seed: 1,
            noise_seed: None,
        },
        clock.clone(),
    )
    .expect("sim");
    let devices = sim.telemetry().devices();
    let backends = Backends {
        telemetry: sim.telemetry(),
        actuator: sim.actuator(),
        workload: sim.workload(),
        clock,
    };
    let start = |knobs: Knobs, settings: Settings| {
        let envelope =
            Envelope::new(&devices, &[512], &Guardrails::default(), knobs).expect("envelope");
        let args = InitArgs {
            devices: envelope.facts(&devices),
            knobs,
            objective: Objective::default(),
            params: vec![],
            tick_ms: 1000,
            seed: 1,
        };
        let policy =
            NativePolicy::new(move |_, observations| Ok(vec![settings; observations.len()]));
        let (supervisor, first) =
            Supervisor::start(Box::new(policy), args, BreakerConfig::default()).expect("starts");
        (supervisor, first, envelope)
    };
    let (supervisor, first, envelope) = start(
        Knobs {
            power_cap: true,
            ..Knobs::default()
        },
        Settings {
            power_cap_w: Some(650.0),
            ..Settings::default()
        },
    );
    let (batch_supervisor, batch_first, batch_envelope) = start(
        Knobs {
            batch_size: true,
            ..Knobs::default()
        },
        Settings {
            batch_size: Some(256),
            ..Settings::default()
        },
    );
    let (sender, port) = crate::swap::swap_channel();
    let mut next = Some(crate::swap::PreparedPolicy {
        supervisor: batch_supervisor,
        first: batch_first,
        envelope: batch_envelope,
        objective: Objective::default(),
        probation_ticks: 3,
        notify: None,
        state: crate::swap::StateOnSwap::Fresh,
        operator_rollback: false,
    });
    let control = ControlLoop::new(
        backends,
        supervisor,
        &first,
        envelope,
        LoopConfig::new(
            Duration::from_secs(12),
            Duration::from_secs(1),
            Objective::default(),
        ),
        Arc::new(AtomicBool::new(false)),
    )
    .with_swaps(port);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut recorder = Recorder::create(dir.path(), false).expect("recorder");
    let mut caps = Vec::new();
    let (totals, _) = control
        .run(&mut recorder, &mut |p| {
            caps.push(p.observations[0].in_force.power_cap_requested_w);
            if p.tick == 4
                && let Some(prepared) = next.take()
            {
                sender.send(prepared).expect("the loop runs");
            }
        })
        .expect("runs");
    assert_eq!(totals.swaps.swaps, 1);
    // The window of tick t shows what tick t-1 set: 650 W from tick 1, the swap at tick 5
    // puts 700 W back (a raise of 50 W, within the node's 200 W), seen from tick 6 on.
    assert_eq!(caps[1..6], [650.0; 5], "{caps:?}");
    assert!(caps[6..].iter().all(|&cap| cap == 700.0), "{caps:?}");
    let observations =
        std::fs::read_to_string(dir.path().join("observations.jsonl")).expect("observations");
    let swap_tick: serde_json::Value = observations
        .lines()
        .nth(5)
        .map(|line| serde_json::from_str(line).expect("json"))
        .expect("tick 5");
    assert_eq!(swap_tick["applied"]["power_cap_w"], 700.0, "{swap_tick}");
    assert_eq!(swap_tick["policy"], "native", "{swap_tick}");
}

/// An allowance the test moves between ticks.
#[derive(Debug)]
struct MovingAllowance(std::sync::Mutex<f64>);

impl PowerAllowance for MovingAllowance {
    fn watts(&self) -> f64 {
        *self.0.lock().expect("lock")
    }
}

/// An actuator that checks, at every cap it sets, that no raise takes the node's sum of
/// caps past the allowance in force.
struct SumCheckingActuator {
    inner: Box<dyn Actuator>,
    caps: Vec<f64>,
    allowance: Arc<MovingAllowance>,
    raises_past_it: Arc<std::sync::Mutex<Vec<(f64, f64)>>>,
}

impl Actuator for SumCheckingActuator {
    fn name(&self) -> &'static str {
        "sum-checking"
    }
    fn devices(&self) -> Vec<tokwatt_core::types::DeviceInfo> {
        self.inner.devices()
    }
    fn capabilities(&self, gpu: u32) -> tokwatt_core::actuator::Capabilities {
        self.inner.capabilities(gpu)
    }
    fn read(
        &mut self,
        gpu: u32,
    ) -> Result<tokwatt_core::actuator::GpuSettings, tokwatt_core::actuator::ActuatorError> {
        self.inner.read(gpu)
    }
    fn set_power_cap(
        &mut self,
        gpu: u32,
        watts: f64,
    ) -> Result<f64, tokwatt_core::actuator::ActuatorError> {
        let enforced = self.inner.set_power_cap(gpu, watts)?;
        let before: f64 = self.caps.iter().sum();
        self.caps[gpu as usize] = watts;
        let after: f64 = self.caps.iter().sum();
        let allowed = self.allowance.watts();
        if after > before && after > allowed + 1e-9 {
            self.raises_past_it
                .lock()
                .expect("lock")
                .push((after, allowed));
        }
        Ok(enforced)
    }
    fn set_sm_clock_lock(
        &mut self,
        gpu: u32,
        range: Option<(u32, u32)>,
    ) -> Result<(), tokwatt_core::actuator::ActuatorError> {
        self.inner.set_sm_clock_lock(gpu, range)
    }
    fn set_mem_clock_lock(
        &mut self,
        gpu: u32,
        range: Option<(u32, u32)>,
    ) -> Result<(), tokwatt_core::actuator::ActuatorError> {
        self.inner.set_mem_clock_lock(gpu, range)
    }
}

#[test]
fn the_nodes_caps_stay_within_its_allowance_from_the_first_settings_on() {
    const GPUS: usize = 4;
    let clock = VirtualClock::new();
    let sim = SimGpu::new(
        SimConfig {
            profile: GpuProfile::load("h200").expect("profile"),
            scenario: Scenario::built_in().expect("scenario"),
            gpus: GPUS as u32,
            seed: 1,
            noise_seed: None,
        },
        clock.clone(),
    )
    .expect("sim");
    let devices = sim.telemetry().devices();
    let mut real = sim.actuator();
    let caps: Vec<f64> = (0..GPUS as u32)
        .map(|g| real.read(g).expect("read").power_cap_w)
        .collect();
    let allowance = Arc::new(MovingAllowance(std::sync::Mutex::new(2000.0)));
    let raises_past_it = Arc::new(std::sync::Mutex::new(Vec::new()));
    let backends = Backends {
        telemetry: sim.telemetry(),
        actuator: Box::new(SumCheckingActuator {
            inner: real,
            caps,
            allowance: allowance.clone(),
            raises_past_it: raises_past_it.clone(),
        }),
        workload: sim.workload(),
        clock,
    };
    let knobs = Knobs {
        power_cap: true,
        ..Knobs::default()
    };
    let envelope =
        Envelope::new(&devices, &[512; GPUS], &Guardrails::default(), knobs).expect("envelope");
    let args = InitArgs {
        devices: envelope.facts(&devices),
        knobs,
        objective: Objective::default(),
        params: vec![],
        tick_ms: 1000,
        seed: 1,
    };
    // A policy that wants every GPU at its most, some ticks, and lower on others.
    let greedy = NativePolicy::new(|tick, observations| {
        Ok(observations
            .iter()
            .enumerate()
            .map(|(g, _)| Settings {
                power_cap_w: Some(if (tick + g as u64).is_multiple_of(3) {
                    400.0
                } else {
                    700.0
                }),
                ..Settings::default()
            })
            .collect())
    });
    let (supervisor, first) =
        Supervisor::start(Box::new(greedy), args, BreakerConfig::default()).expect("starts");
    let mut config = LoopConfig::new(
        Duration::from_secs(40),
        Duration::from_secs(1),
        Objective::default(),
    );
    config.power_allowance = Some(allowance.clone());
    let control = ControlLoop::new(
        backends,
        supervisor,
        &first,
        envelope,
        config,
        Arc::new(AtomicBool::new(false)),
    );
    let started: f64 = control
        .in_force
        .iter()
        .map(|f| f.power_cap_requested_w)
        .sum();
    assert!(started <= 2000.0 + 1e-9, "the first settings: {started} W");
    let mut recorder = Recorder::discard();
    let mut control = control;
    let steps = [2000.0, 1200.0, 2600.0, 900.0, 2200.0];
    for tick in 0..40 {
        *allowance.0.lock().expect("lock") = steps[tick / 8];
        control.tick(&mut recorder).expect("tick").expect("a tick");
        let after: f64 = control
            .in_force
            .iter()
            .map(|f| f.power_cap_requested_w)
            .sum();
        assert!(
            after <= steps[tick / 8] + 1e-9,
            "tick {tick}: {after} W over {} W",
            steps[tick / 8]
        );
    }
    let (totals, _) = control.finish();
    assert!(totals.allowance_cut_ticks > 0);
    assert_eq!(totals.allowance_unmet_ticks, 0);
    let raises = raises_past_it.lock().expect("lock");
    assert!(raises.is_empty(), "raises past the allowance: {raises:?}");
}

/// A policy that fails in its probation is rolled back, and the settings the restored
/// policy had in force come back with it: a policy that holds what is in force (as an
/// adaptive one steps from it) resumes from its own batch, not the failed one's.
#[test]
fn a_rollback_puts_back_the_settings_the_restored_policy_had_in_force() {
    let clock = VirtualClock::new();
    let sim = SimGpu::new(
        SimConfig {
            profile: GpuProfile::load("h200").expect("profile"),
            scenario: Scenario::built_in().expect("scenario"),
            gpus: 1,
            seed: 1,
            noise_seed: None,
        },
        clock.clone(),
    )
    .expect("sim");
    let devices = sim.telemetry().devices();
    let backends = Backends {
        telemetry: sim.telemetry(),
        actuator: sim.actuator(),
        workload: sim.workload(),
        clock,
    };
    let batch_only = Knobs {
        batch_size: true,
        ..Knobs::default()
    };
    let start = |policy: NativePolicy| {
        let envelope =
            Envelope::new(&devices, &[512], &Guardrails::default(), batch_only).expect("envelope");
        let args = InitArgs {
            devices: envelope.facts(&devices),
            knobs: batch_only,
            objective: Objective::default(),
            params: vec![],
            tick_ms: 1000,
            seed: 1,
        };
        let (supervisor, first) =
            Supervisor::start(Box::new(policy), args, BreakerConfig::default()).expect("starts");
        (supervisor, first, envelope)
    };
    let hold = |batch: u32| {
        move |call: u64, observations: &[Observation]| {
            Ok(vec![
                Settings {
                    batch_size: (call == 0).then_some(batch),
                    ..Settings::default()
                };
                observations.len()
            ])
        }
    };
    // Holds 256 from its first decision on.
    let (supervisor, first, envelope) = start(NativePolicy::new(hold(256)));
    // Asks for batch 1, then fails.
    let (failing, failing_first, failing_envelope) =
        start(NativePolicy::new(|call, observations: &[Observation]| {
            if call == 0 {
                Ok(vec![
                    Settings {
                        batch_size: Some(1),
                        ..Settings::default()
                    };
                    observations.len()
                ])
            } else {
                Err(tokwatt_policy::supervisor::PolicyFailure::Trap(
                    "on purpose".into(),
                ))
            }
        }));
    let (sender, port) = crate::swap::swap_channel();
    let mut next = Some(crate::swap::PreparedPolicy {
        supervisor: failing,
        first: failing_first,
        envelope: failing_envelope,
        objective: Objective::default(),
        probation_ticks: 5,
        notify: None,
        state: crate::swap::StateOnSwap::Fresh,
        operator_rollback: false,
    });
    let control = ControlLoop::new(
        backends,
        supervisor,
        &first,
        envelope,
        LoopConfig::new(
            Duration::from_secs(12),
            Duration::from_secs(1),
            Objective::default(),
        ),
        Arc::new(AtomicBool::new(false)),
    )
    .with_swaps(port);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut recorder = Recorder::create(dir.path(), false).expect("recorder");
    let mut batches = Vec::new();
    let (totals, _) = control
        .run(&mut recorder, &mut |p| {
            batches.push(p.in_force[0].batch_size);
            if p.tick == 4
                && let Some(prepared) = next.take()
            {
                sender.send(prepared).expect("the loop runs");
            }
        })
        .expect("runs");
    assert_eq!(totals.swaps.swaps, 1);
    assert_eq!(totals.swaps.rollbacks, 1, "{:?}", totals.swaps);
    assert!(
        batches.contains(&1),
        "the failing policy's batch: {batches:?}"
    );
    assert_eq!(
        batches.last(),
        Some(&256),
        "the restored policy's batch is back: {batches:?}"
    );
}

/// The token budget through the loop: a policy granted it moves the workload's budget,
/// within its guardrails; once a policy that does not own it takes over, the host puts
/// the budget back where the run started (invariant 9), as it does every other knob.
#[test]
fn a_granted_token_budget_reaches_the_workload_and_goes_back_when_no_policy_owns_it() {
    let clock = VirtualClock::new();
    let scenario = Scenario::from_toml_str(
        "model = \"llama-3-8b\"\nprompt_tokens = 2048\noutput_tokens = 128\n\
         max_batched_tokens = 4096\n[[phases]]\nstart_s = 0\narrival_rps = 4\n",
        "prompts",
    )
    .expect("scenario");
    let sim = SimGpu::new(
        SimConfig {
            profile: GpuProfile::load("h200").expect("profile"),
            scenario,
            gpus: 1,
            seed: 1,
            noise_seed: None,
        },
        clock.clone(),
    )
    .expect("sim");
    let devices = sim.telemetry().devices();
    let backends = Backends {
        telemetry: sim.telemetry(),
        actuator: sim.actuator(),
        workload: sim.workload(),
        clock,
    };
    let workload = tokwatt_policy::envelope::WorkloadLimits::of(backends.workload.as_ref(), &[0]);
    assert_eq!(workload[0].token_budget, Some((1, 4096)));
    let start = |knobs: Knobs, ask: Option<u32>| {
        let guardrails = Guardrails {
            token_budget_min: Some(512),
            ..Guardrails::default()
        };
        let envelope =
            Envelope::for_workload(&devices, &workload, &guardrails, knobs).expect("envelope");
        let args = InitArgs {
            devices: envelope.facts(&devices),
            knobs,
            objective: Objective::default(),
            params: vec![],
            tick_ms: 1000,
            seed: 1,
        };
        assert_eq!(
            (
                args.devices[0].token_budget_min,
                args.devices[0].token_budget_max
            ),
            (512, 4096)
        );
        let policy = NativePolicy::new(move |_, observations: &[Observation]| {
            Ok(vec![
                Settings {
                    token_budget: ask,
                    ..Settings::default()
                };
                observations.len()
            ])
        });
        let (supervisor, first) =
            Supervisor::start(Box::new(policy), args, BreakerConfig::default()).expect("starts");
        (supervisor, first, envelope)
    };
    let budget_only = Knobs {
        token_budget: true,
        ..Knobs::default()
    };
    // Asks for 100 tokens a step: the guardrails' 512 is what it gets.
    let (supervisor, first, envelope) = start(budget_only, Some(100));
    let batch_only = Knobs {
        batch_size: true,
        ..Knobs::default()
    };
    let (other, other_first, other_envelope) = start(batch_only, None);
    let (sender, port) = crate::swap::swap_channel();
    let mut next = Some(crate::swap::PreparedPolicy {
        supervisor: other,
        first: other_first,
        envelope: other_envelope,
        objective: Objective::default(),
        probation_ticks: 2,
        notify: None,
        state: crate::swap::StateOnSwap::Fresh,
        operator_rollback: false,
    });
    let control = ControlLoop::new(
        backends,
        supervisor,
        &first,
        envelope,
        LoopConfig::new(
            Duration::from_secs(10),
            Duration::from_secs(1),
            Objective::default(),
        ),
        Arc::new(AtomicBool::new(false)),
    )
    .with_swaps(port);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut recorder = Recorder::create(dir.path(), false).expect("recorder");
    let mut budgets = Vec::new();
    let mut seen = Vec::new();
    let (totals, _) = control
        .run(&mut recorder, &mut |p| {
            budgets.push(p.in_force[0].token_budget);
            seen.push(p.observations[0].in_force.token_budget);
            if p.tick == 3
                && let Some(prepared) = next.take()
            {
                sender.send(prepared).expect("the loop runs");
            }
        })
        .expect("runs");
    assert_eq!(totals.swaps.swaps, 1);
    assert_eq!(budgets[0], 512, "the first tick: {budgets:?}");
    assert_eq!(seen[1], 512, "the policy sees it in force: {seen:?}");
    assert!(totals.clamped_decisions > 0, "100 was clamped to 512");
    assert_eq!(
        budgets.last(),
        Some(&4096),
        "back to the start's budget: {budgets:?}"
    );
    // The trace has it beside the batch size.
    let trace = std::fs::read_to_string(dir.path().join("trace.csv")).expect("trace");
    let header: Vec<&str> = trace.lines().next().expect("header").split(',').collect();
    let column = header
        .iter()
        .position(|c| *c == "token_budget")
        .expect("a token_budget column");
    assert_eq!(header[column - 1], "batch_size");
    let recorded: Vec<&str> = trace
        .lines()
        .skip(1)
        .map(|line| line.split(',').nth(column).expect("a value"))
        .collect();
    assert_eq!(recorded[1], "512", "{recorded:?}");
    assert_eq!(recorded.last(), Some(&"4096"), "{recorded:?}");
}

/// Two simulated H200s whose settings live in a driver file, as a real driver holds them
/// (a fence changes them from outside the loop), on a virtual clock the test moves, run by
/// a policy that asks 650 W of each GPU every tick; `on_decide` runs in the policy's
/// `decide` with its call number, the clock and the driver (a stall inside a tick).
struct DriverNode {
    control: ControlLoop,
    recorder: Recorder,
    clock: Arc<VirtualClock>,
    driver: tokwatt_sim::SimDriver,
    _dir: tempfile::TempDir,
}

fn driver_node(
    on_decide: impl Fn(u64, &VirtualClock, &tokwatt_sim::SimDriver) + Send + 'static,
) -> DriverNode {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("driver.json");
    let clock = VirtualClock::new();
    let sim = SimGpu::with_driver(
        SimConfig {
            profile: GpuProfile::load("h200").expect("profile"),
            scenario: Scenario::built_in().expect("scenario"),
            gpus: 2,
            seed: 1,
            noise_seed: None,
        },
        clock.clone(),
        &path,
    )
    .expect("sim");
    let devices = sim.telemetry().devices();
    let backends = Backends {
        telemetry: sim.telemetry(),
        actuator: sim.actuator(),
        workload: sim.workload(),
        clock: clock.clone(),
    };
    let knobs = Knobs {
        power_cap: true,
        ..Knobs::default()
    };
    let envelope =
        Envelope::new(&devices, &[512, 512], &Guardrails::default(), knobs).expect("envelope");
    let args = InitArgs {
        devices: envelope.facts(&devices),
        knobs,
        objective: Objective::default(),
        params: vec![],
        tick_ms: 1000,
        seed: 1,
    };
    let driver = tokwatt_sim::SimDriver::at(&path);
    let policy = NativePolicy::new({
        let clock = clock.clone();
        let driver = driver.clone();
        move |call, observations| {
            on_decide(call, &clock, &driver);
            Ok(vec![
                Settings {
                    power_cap_w: Some(650.0),
                    ..Settings::default()
                };
                observations.len()
            ])
        }
    });
    let (supervisor, first) =
        Supervisor::start(Box::new(policy), args, BreakerConfig::default()).expect("starts");
    let control = ControlLoop::new(
        backends,
        supervisor,
        &first,
        envelope,
        LoopConfig::new(
            Duration::from_secs(60),
            Duration::from_secs(1),
            Objective::default(),
        ),
        Arc::new(AtomicBool::new(false)),
    );
    DriverNode {
        control,
        recorder: Recorder::discard(),
        clock,
        driver,
        _dir: dir,
    }
}

/// What a fence does to a stopped agent's node: every cap lowered in the driver (and, to
/// show that clock locks are read back too, the SM clock locked at `sm_clock_mhz`).
fn fence_lowers(driver: &tokwatt_sim::SimDriver, watts: f64, sm_clock_mhz: Option<u32>) {
    let lowest = *GpuProfile::load("h200")
        .expect("profile")
        .sm_clocks_mhz()
        .last()
        .expect("clocks");
    driver
        .update(|state| {
            for board in &mut state.boards {
                board.power_cap_w = watts;
                board.sm_clock_lock_mhz = sm_clock_mhz.map(|mhz| (lowest, mhz));
            }
            Ok(())
        })
        .expect("the driver file takes the change");
}

/// Each GPU's settings as the driver holds them: the requested cap and the SM clock
/// lock's upper bound (`None`: unlocked).
fn driver_holds(driver: &tokwatt_sim::SimDriver) -> Vec<(f64, Option<u32>)> {
    driver
        .read()
        .expect("the driver file reads")
        .boards
        .iter()
        .map(|b| (b.power_cap_w, b.sm_clock_lock_mhz.map(|(_, hi)| hi)))
        .collect()
}

/// `in_force` as the driver would hold it: the requested cap, and the lock's upper bound
/// (`None` where it is the device's highest clock, which is no lock).
fn as_held(in_force: &[InForce], device_max_mhz: u32) -> Vec<(f64, Option<u32>)> {
    in_force
        .iter()
        .map(|f| {
            (
                f.power_cap_requested_w,
                (f.sm_clock_max_mhz < device_max_mhz).then_some(f.sm_clock_max_mhz),
            )
        })
        .collect()
}

fn h200_top_clock() -> u32 {
    GpuProfile::load("h200")
        .expect("profile")
        .sm_clocks_mhz()
        .first()
        .copied()
        .expect("clocks")
}

#[test]
fn after_a_stall_the_loop_reads_back_what_a_fence_changed_before_it_shows_or_acts_on_it() {
    let mut node = driver_node(|_, _, _| {});
    let top = h200_top_clock();
    for _ in 0..3 {
        node.control
            .tick(&mut node.recorder)
            .expect("ticks")
            .expect("a tick");
    }
    assert_eq!(driver_holds(&node.driver), [(650.0, None), (650.0, None)]);

    // The agent is stopped for 20 s (its tick comes 19 s late); meanwhile a fence lowers
    // every cap to 300 W, and something locks the SM clock at a supported clock.
    let clocks = GpuProfile::load("h200").expect("profile").sm_clocks_mhz();
    let locked = clocks[clocks.len() / 2];
    node.clock
        .sleep_until(node.clock.now() + Duration::from_secs(20));
    fence_lowers(&node.driver, 300.0, Some(locked));
    assert_eq!(driver_holds(&node.driver)[0], (300.0, Some(locked)));

    let progress = node
        .control
        .tick(&mut node.recorder)
        .expect("ticks")
        .expect("a tick");
    assert_eq!(progress.totals.stalls, 1);
    assert!(
        (progress.totals.stalled_s - 19.0).abs() < 1e-6,
        "{}",
        progress.totals.stalled_s
    );
    assert_eq!(progress.lateness, Duration::from_secs(19));
    // What the status and /metrics show of this tick (the observations' settings in
    // force): the driver's, read back before anything used them, never the 650 W the
    // loop had set before the stall.
    for observation in progress.observations {
        let in_force = observation.in_force;
        assert_eq!(
            (
                in_force.power_cap_requested_w,
                in_force.power_cap_w,
                in_force.sm_clock_max_mhz
            ),
            (300.0, 300.0, locked),
            "GPU {}",
            observation.gpu
        );
    }
    // What the loop did next was worked out from them: the policy's 650 W applied again
    // (the loop believing 650 W in force would have changed nothing), the clock no policy
    // owns sent back toward the start's, and what it reports in force after the tick (the
    // fleet's report) is what the driver holds.
    assert_eq!(progress.totals.settings_changes, 2 + 2 * 2);
    assert_eq!(as_held(progress.in_force, top), driver_holds(&node.driver));
    assert!(progress.in_force.iter().all(|f| f.power_cap_w == 650.0));

    // The ticks the stall missed are not run back to back: the next is due a period after
    // the late one, on time, and no second stall is counted.
    let late_at = progress.time;
    let next = node
        .control
        .tick(&mut node.recorder)
        .expect("ticks")
        .expect("a tick");
    assert_eq!(next.lateness, Duration::ZERO);
    assert_eq!(next.time, late_at + Duration::from_secs(1));
    assert_eq!(next.totals.stalls, 1);
    assert_eq!(as_held(next.in_force, top), driver_holds(&node.driver));
    let (totals, _) = node.control.finish();
    assert_eq!(totals.stalls, 1);
}

#[test]
fn a_stall_between_a_ticks_reads_and_its_changes_is_read_back_before_anything_is_applied() {
    // The policy's fourth call stands for the process stopped while it decided: 20 s pass
    // and a fence lowers every cap to 300 W before the tick applies anything.
    let mut node = driver_node(|call, clock, driver| {
        if call == 3 {
            clock.sleep_until(clock.now() + Duration::from_secs(20));
            fence_lowers(driver, 300.0, None);
        }
    });
    let top = h200_top_clock();
    for tick in 0..3 {
        let progress = node
            .control
            .tick(&mut node.recorder)
            .expect("ticks")
            .expect("a tick");
        assert_eq!(progress.totals.stalls, 0, "tick {tick}");
    }
    let progress = node
        .control
        .tick(&mut node.recorder)
        .expect("ticks")
        .expect("a tick");
    // The tick started on time and was stopped in its middle: one stall, of 20 s.
    assert_eq!(progress.lateness, Duration::ZERO);
    assert_eq!(progress.totals.stalls, 1);
    assert!((progress.totals.stalled_s - 20.0).abs() < 1e-6);
    // What the tick shows in force (status, metrics) is what it read back after the
    // stall, not the 650 W it had read before it.
    for observation in progress.observations {
        assert_eq!(
            (
                observation.in_force.power_cap_requested_w,
                observation.in_force.power_cap_w
            ),
            (300.0, 300.0),
            "GPU {}",
            observation.gpu
        );
    }
    // Its settings were worked out again from the driver's 300 W: the 650 W asked is
    // applied (the loop believing 650 W in force would have changed nothing, and reported
    // 650 W in force over 300 W held), and what it reports in force is the driver's.
    assert_eq!(progress.totals.settings_changes, 2 + 2);
    assert_eq!(as_held(progress.in_force, top), driver_holds(&node.driver));
    assert!(progress.in_force.iter().all(|f| f.power_cap_w == 650.0));

    // The schedule moved on with it: the next tick is on time, and no second stall.
    let next = node
        .control
        .tick(&mut node.recorder)
        .expect("ticks")
        .expect("a tick");
    assert_eq!(next.lateness, Duration::ZERO);
    assert_eq!(next.totals.stalls, 1);
}
