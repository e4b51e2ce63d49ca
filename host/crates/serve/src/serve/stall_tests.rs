//! Issue 52: an agent that knows time passed. The serve loop's chain, from the control
//! loop through what it reports: a node stopped for 20 s while a fence lowered its caps in
//! the driver shows, once the stall is counted, the driver's caps on `/metrics` and in the
//! fleet's report, never the ones it had set before it stopped.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use tokwatt_agent::control::{Backends, ControlLoop, LoopConfig};
use tokwatt_agent::recorder::Recorder;
use tokwatt_core::clock::{Clock, VirtualClock};
use tokwatt_core::types::{Knobs, Objective, Settings};
use tokwatt_policy::envelope::{Envelope, Guardrails};
use tokwatt_policy::supervisor::{BreakerConfig, InitArgs, Supervisor};
use tokwatt_sim::{GpuProfile, Scenario, SimConfig, SimDriver, SimGpu};
use tokwatt_test_support::NativePolicy;

use super::{Figures, FleetNode};
use crate::api::FleetStatus;
use crate::metrics::AgentMetrics;

/// Every sample of `family` in the exposition `text`, by its `gpu` label, in its order.
fn by_gpu(text: &str, family: &str) -> Vec<(String, f64)> {
    let mut samples: Vec<(String, f64)> = text
        .lines()
        .filter_map(|line| line.strip_prefix(family)?.strip_prefix('{'))
        .map(|rest| {
            let gpu = rest
                .split("gpu=\"")
                .nth(1)
                .and_then(|after| after.split('"').next())
                .expect("a gpu label")
                .to_owned();
            let value = rest
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .expect("a value");
            (gpu, value)
        })
        .collect();
    samples.sort_by(|a, b| a.0.cmp(&b.0));
    samples
}

/// The one sample of an unlabelled `family`.
fn unlabelled(text: &str, family: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(family)?.strip_prefix(' '))
        .and_then(|value| value.parse().ok())
}

/// Two simulated H200s on a driver file at `driver`, a policy asking 650 W of each
/// every second, on `clock`.
fn node(
    clock: &Arc<VirtualClock>,
    driver: &Path,
) -> (ControlLoop, Vec<tokwatt_core::types::DeviceInfo>) {
    let sim = SimGpu::with_driver(
        SimConfig {
            profile: GpuProfile::load("h200").expect("profile"),
            scenario: Scenario::built_in().expect("scenario"),
            gpus: 2,
            seed: 1,
            noise_seed: None,
        },
        clock.clone(),
        driver,
    )
    .expect("sim");
    let devices = sim.telemetry().devices();
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
    let policy = NativePolicy::new(|_, observations| {
        Ok(vec![
            Settings {
                power_cap_w: Some(650.0),
                ..Settings::default()
            };
            observations.len()
        ])
    });
    let (supervisor, first) =
        Supervisor::start(Box::new(policy), args, BreakerConfig::default()).expect("starts");
    let control = ControlLoop::new(
        Backends {
            telemetry: sim.telemetry(),
            actuator: sim.actuator(),
            workload: sim.workload(),
            clock: clock.clone(),
        },
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
    (control, devices)
}

#[test]
fn after_a_stall_metrics_and_the_fleets_report_show_the_caps_the_driver_holds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("driver.json");
    let clock = VirtualClock::new();
    let (mut control, devices) = node(&clock, &path);
    let driver = SimDriver::at(&path);
    let metrics = AgentMetrics::new(&devices, true, false).with_fleet();
    let fleet = FleetNode::placed(1000.0, FleetStatus::default(), Duration::from_secs(1));
    let mut recorder = Recorder::discard();
    let mut tick = |control: &mut ControlLoop| {
        let progress = control.tick(&mut recorder).expect("ticks").expect("a tick");
        metrics.observe(&progress, "aaaaaaaaaaaa");
        fleet.observe(&progress);
    };
    for _ in 0..3 {
        tick(&mut control);
    }
    let text = metrics.encode();
    assert_eq!(
        unlabelled(&text, "tokwatt_stalls_total"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        by_gpu(&text, "tokwatt_gpu_power_cap_requested_watts"),
        [("0".to_owned(), 650.0), ("1".to_owned(), 650.0)]
    );

    // Stopped for 20 s, the agent's caps lowered to 300 W each by a fence meanwhile.
    clock.sleep_until(clock.now() + Duration::from_secs(20));
    driver
        .update(|state| {
            for board in &mut state.boards {
                board.power_cap_w = 300.0;
            }
            Ok(())
        })
        .expect("the fence's write");
    tick(&mut control);

    let text = metrics.encode();
    assert_eq!(
        unlabelled(&text, "tokwatt_stalls_total"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        unlabelled(&text, "tokwatt_stall_seconds_total"),
        Some(19.0),
        "{text}"
    );
    // The window the stall ended is shown with the caps read back from the driver: both
    // the request and the enforced limit are the fence's, not the 650 W set before.
    for family in [
        "tokwatt_gpu_power_cap_requested_watts",
        "tokwatt_gpu_power_cap_enforced_watts",
    ] {
        assert_eq!(
            by_gpu(&text, family),
            [("0".to_owned(), 300.0), ("1".to_owned(), 300.0)],
            "{family}: {text}"
        );
    }
    // The fleet's report is of the caps after the tick, as read back: the driver's sum.
    let held: f64 = driver.read().expect("reads").power_cap_sum_w();
    let stop = AtomicBool::new(false);
    let (figures, read_back) = fleet.take_figures_read_back(&stop);
    assert!(read_back);
    assert_eq!(figures.caps_in_force_w, held);
}

#[test]
fn the_fleet_thread_waits_for_the_loops_next_tick_rather_than_report_figures_from_before_a_stall() {
    let tick = Duration::from_millis(100);
    let fleet = FleetNode::placed(1000.0, FleetStatus::default(), tick);
    let stop = AtomicBool::new(false);
    let before_the_stall = Figures {
        caps_in_force_w: 2215.0,
        ticks: 40,
        published: Instant::now().checked_sub(Duration::from_secs(20)),
        ..Figures::default()
    };
    fleet.publish_for_test(before_the_stall);
    // The loop ticks 50 ms after the thread woke, having read the caps back.
    let (figures, read_back) = std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            fleet.publish_for_test(Figures {
                caps_in_force_w: 1200.0,
                ticks: 41,
                published: Some(Instant::now()),
                ..Figures::default()
            });
        });
        fleet.take_figures_read_back(&stop)
    });
    assert!(read_back);
    assert_eq!((figures.caps_in_force_w, figures.ticks), (1200.0, 41));

    // A loop that does not tick (hung in a GPU call): reported as last seen, said so,
    // after waiting its stall threshold and a tick at most.
    fleet.publish_for_test(before_the_stall);
    let waited = Instant::now();
    let (figures, read_back) = fleet.take_figures_read_back(&stop);
    assert!(!read_back);
    assert_eq!(figures.caps_in_force_w, 2215.0);
    assert!(waited.elapsed() >= 3 * tick, "{:?}", waited.elapsed());
    assert!(
        waited.elapsed() < Duration::from_secs(2),
        "{:?}",
        waited.elapsed()
    );
}
