use super::*;
use crate::actuator::DryRun;
use crate::clock::VirtualClock;
use crate::envelope::Guardrails;
use crate::policy::doubles::NativePolicy;
use crate::policy::{BreakerConfig, InitArgs};
use crate::recorder::Recorder;
use crate::sim::{GpuProfile, Scenario, SimConfig, SimGpu};
use crate::types::Knobs;

/// 20 ticks on the simulator, through its own actuator or a dry run, with a policy
/// that always asks for 650 W. Returns the totals and every observation.
fn run_fixed_cap(dry_run: bool) -> (LoopTotals, Vec<Observation>) {
    run_fixed_cap_on(dry_run, Scenario::built_in().expect("scenario"))
}

fn run_fixed_cap_on(dry_run: bool, scenario: Scenario) -> (LoopTotals, Vec<Observation>) {
    let clock = VirtualClock::new();
    let sim = SimGpu::new(
        SimConfig {
            profile: GpuProfile::load("h200").expect("profile"),
            scenario,
            gpus: 1,
            seed: 1,
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
    let mut recorder = Recorder::create(dir.path(), false).expect("recorder");
    let control = ControlLoop::new(
        backends,
        supervisor,
        &first,
        envelope,
        LoopConfig {
            duration: Duration::from_secs(20),
            tick: Duration::from_secs(1),
            objective: Objective::default(),
        },
        Arc::new(AtomicBool::new(false)),
    );
    let mut seen = Vec::new();
    let (totals, _) = control
        .run(&mut recorder, &mut |p| {
            seen.extend_from_slice(p.observations)
        })
        .expect("runs");
    (totals, seen)
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
    use crate::types::DemandWindow;
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
