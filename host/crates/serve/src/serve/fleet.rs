//! `tokwatt serve` in a power domain (`[fleet]` in serve.toml): a thread of its own talks
//! to the coordination store (join, renew, report, read the grant), and the control loop
//! reads the node's allowance at every tick, without waiting on the network, and fits the
//! caps of all the node's GPUs within it (see `tokwatt_agent::control::PowerAllowance`).
//!
//! The node starts at its reserve (nothing heard yet), holds its grant while its lease is
//! surely live, drops to its reserve on its own clock when it is not, and stops and
//! restores at its reserve (the settings guard's ceiling).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokwatt_agent::control::{PowerAllowance, Progress, stall_threshold};
use tokwatt_fleet::etcd::EtcdFleet;

use crate::fence::ProofTarget;
use tokwatt_fleet::{Allowance, AllowanceSnapshot, FleetStore, LinkState, NodeLink};

use super::config::FleetConfig;
use super::control::ServeControl;
use super::fence::FenceDeclaration;
use crate::api::{FleetStatus, GrantStatus, Holding, LeaseStatus};
use crate::metrics::FleetReading;

/// What the loop reads every tick: the fleet thread's latest snapshot.
#[derive(Debug)]
pub(super) struct SharedAllowance {
    snapshot: Mutex<AllowanceSnapshot>,
}

impl SharedAllowance {
    fn new(reserve_w: f64) -> Self {
        Self {
            snapshot: Mutex::new(AllowanceSnapshot::reserve(reserve_w)),
        }
    }

    fn publish(&self, snapshot: AllowanceSnapshot) {
        *self.snapshot.lock().unwrap_or_else(PoisonError::into_inner) = snapshot;
    }

    pub(super) fn snapshot(&self) -> AllowanceSnapshot {
        *self.snapshot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What the node may hold at this instant.
    pub(super) fn now(&self) -> Allowance {
        self.snapshot().allowance(Instant::now())
    }
}

impl PowerAllowance for SharedAllowance {
    fn watts(&self) -> f64 {
        self.now().watts()
    }
}

/// The figures a node reports, as of the loop's last tick.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Figures {
    /// The GPUs' caps in force after the tick, read back from the device.
    pub caps_in_force_w: f64,
    pub draw_w: f64,
    pub tokens_per_s: f64,
    /// On some tick since the last report, the allowance lowered what the GPUs were
    /// asked to hold and a GPU was held by its power cap: the node would use more.
    /// (A policy may ask above its allowance on one tick in several: the report, sent
    /// once a period, must not depend on which tick it samples.)
    pub wants_more: bool,
    /// The most the policy asked for on a tick since the last report, caps summed,
    /// before the allowance.
    pub requested_w: f64,
    /// Ticks the loop has reported (0: none yet).
    pub ticks: u64,
    /// When the loop published them (`None`: not yet).
    pub published: Option<Instant>,
}

/// How often the fleet thread looks again for the loop's next tick while the figures it
/// holds are from before a stall.
const FRESH_FIGURES_POLL: Duration = Duration::from_millis(10);

/// What the fleet thread last learnt of the node's link, for the status.
#[derive(Debug, Clone, PartialEq)]
struct LinkView {
    /// The lease the node's record lives under (`None`: not joined).
    lease: Option<i64>,
    /// Why the last exchange did not go through (`None`: it did).
    apart_because: Option<String>,
    /// The last grant generation the node enforced and read back.
    acked_generation: u64,
}

impl LinkView {
    fn of(link: &NodeLink) -> Self {
        Self {
            lease: link.session().map(|session| session.lease),
            apart_because: match link.state() {
                LinkState::Live => None,
                LinkState::Apart(why) => Some(why.clone()),
            },
            acked_generation: link.acked_generation(),
        }
    }
}

/// The node's place in its domain at `now`: its allowance from the loop's snapshot, its
/// lease and acknowledgement from the link.
fn fleet_status(
    place: &FleetStatus,
    snapshot: &AllowanceSnapshot,
    link: &LinkView,
    now: Instant,
) -> FleetStatus {
    let allowance = snapshot.allowance(now);
    let grant = match allowance {
        Allowance::Granted(grant) => Some(GrantStatus {
            watts: grant.watts,
            generation: grant.generation,
            acknowledged: link.acked_generation >= grant.generation,
        }),
        Allowance::Reserve(_) => None,
    };
    FleetStatus {
        allowance_w: Some(allowance.watts()),
        holding: Some(if grant.is_some() {
            Holding::Grant
        } else {
            Holding::Reserve
        }),
        reserve_w: Some(snapshot.reserve_w()),
        grant,
        lease: link.lease.map(|id| LeaseStatus {
            id: format!("{id:x}"),
            holds_for_s: snapshot
                .holds_for(now)
                .map_or(0.0, |left| left.as_secs_f64()),
        }),
        apart_because: link.apart_because.clone(),
        ..place.clone()
    }
}

/// The node's side, shared by the loop (allowance, figures) and the fleet thread.
#[derive(Debug)]
pub(super) struct FleetNode {
    pub allowance: Arc<SharedAllowance>,
    figures: Mutex<Figures>,
    allowance_cuts_seen: Mutex<u64>,
    /// The domain and node names (the rest of the status is filled in each tick).
    place: FleetStatus,
    link: Mutex<LinkView>,
    /// The loop's tick: how old its figures may be before they are from before a stall.
    tick: Duration,
}

impl FleetNode {
    /// The node of `config`, whose loop ticks every `tick`.
    pub(super) fn new(config: &FleetConfig, tick: Duration) -> Arc<Self> {
        Self::placed(
            config.link.reserve_w,
            FleetStatus {
                domain: config.link.domain.clone(),
                node: config.link.node.clone(),
                ..FleetStatus::default()
            },
            tick,
        )
    }

    fn placed(reserve_w: f64, place: FleetStatus, tick: Duration) -> Arc<Self> {
        Arc::new(Self {
            allowance: Arc::new(SharedAllowance::new(reserve_w)),
            figures: Mutex::new(Figures::default()),
            allowance_cuts_seen: Mutex::new(0),
            place,
            link: Mutex::new(LinkView {
                lease: None,
                apart_because: Some("not joined yet".into()),
                acked_generation: 0,
            }),
            tick,
        })
    }

    /// The node's place in its domain at `now`, for the status (on the loop's thread:
    /// two short locks, no network).
    pub(super) fn status(&self, now: Instant) -> FleetStatus {
        let link = self
            .link
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        fleet_status(&self.place, &self.allowance.snapshot(), &link, now)
    }

    /// After each exchange with the store, on the fleet thread.
    fn observe_link(&self, link: &NodeLink) {
        *self.link.lock().unwrap_or_else(PoisonError::into_inner) = LinkView::of(link);
    }

    /// After each tick, on the loop's thread.
    pub(super) fn observe(&self, progress: &Progress<'_>) {
        let cuts = progress.totals.allowance_cut_ticks;
        let wants_more = {
            let mut seen = self
                .allowance_cuts_seen
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let cut_now = cuts > *seen;
            *seen = cuts;
            // A cut that binds nowhere buys nothing back: more watts help only where a
            // GPU is held by its power cap (or draws next to it).
            cut_now && progress.observations.iter().any(power_bound)
        };
        let requested_w = progress
            .requested
            .iter()
            .zip(progress.in_force)
            .map(|(asked, in_force)| asked.power_cap_w.unwrap_or(in_force.power_cap_requested_w))
            .sum();
        let mut figures = self.figures.lock().unwrap_or_else(PoisonError::into_inner);
        *figures = Figures {
            caps_in_force_w: progress.in_force.iter().map(|f| f.power_cap_w).sum(),
            draw_w: progress.observations.iter().map(|o| o.power_avg_w).sum(),
            tokens_per_s: progress.observations.iter().map(|o| o.tokens_per_s).sum(),
            wants_more: figures.wants_more || wants_more,
            requested_w: figures.requested_w.max(requested_w),
            ticks: progress.tick + 1,
            published: Some(Instant::now()),
        };
    }

    /// The figures for a report ([`Self::take_figures`]), read back after any stall, and
    /// whether they were. Figures the loop published longer ago than it takes it to
    /// notice a stall of its own (its stall threshold and a tick) were read before one:
    /// the process was stopped and this thread woke with it, and something (a fence) may
    /// have changed the caps meanwhile. So it waits, as long again at most and checking
    /// `stop`, for the loop's next tick, which reads every GPU back before it publishes.
    /// A loop that does not tick by then (hung in a GPU call) is reported as last seen.
    fn take_figures_read_back(&self, stop: &AtomicBool) -> (Figures, bool) {
        let stale_after = stall_threshold(self.tick).saturating_add(self.tick);
        let waiting_since = Instant::now();
        loop {
            let published = self
                .figures
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .published;
            let read_back = published.is_none_or(|at| at.elapsed() <= stale_after);
            if read_back || stop.load(Ordering::Relaxed) || waiting_since.elapsed() >= stale_after {
                return (self.take_figures(), read_back);
            }
            std::thread::sleep(FRESH_FIGURES_POLL.min(self.tick));
        }
    }

    /// Figures as the loop would publish them, for the tests.
    #[cfg(test)]
    fn publish_for_test(&self, figures: Figures) {
        *self.figures.lock().unwrap_or_else(PoisonError::into_inner) = figures;
    }

    /// The figures for a report: the latest tick's, with what the node asked for since
    /// the last report (which starts afresh).
    fn take_figures(&self) -> Figures {
        let mut figures = self.figures.lock().unwrap_or_else(PoisonError::into_inner);
        let taken = *figures;
        figures.wants_more = false;
        figures.requested_w = 0.0;
        taken
    }
}

/// A GPU whose clock its power cap holds down, or that draws within 10 % of its cap.
fn power_bound(observation: &tokwatt_core::types::Observation) -> bool {
    observation.clock_events.sw_power_cap
        || observation.power_avg_w >= 0.9 * observation.in_force.power_cap_w
}

/// The reserve the node holds from its start: the configured one, or the budget's where
/// the budget gives this node less (read once, before the settings guard saves what a
/// restore puts back, so a crash restores within what the ledger charges a node without
/// a lease). Where etcd cannot be read now, the configured one; the link lowers its
/// own reserve on joining either way.
pub(super) fn reserve_at_start(config: &FleetConfig) -> f64 {
    let configured = config.link.reserve_w;
    let named = connect(config).and_then(|store| store.read_domain(&config.link.domain));
    match named {
        Ok(Some(view)) => match view.budget.node(&config.link.node) {
            Some(named) if named.reserve_w < configured => {
                tracing::warn!(
                    node = %config.link.node,
                    "fleet: the domain's budget gives this node a reserve of {} W, below fleet.reserve_w ({configured} W): holding, and restoring within, {} W; set fleet.reserve_w to the budget's",
                    named.reserve_w,
                    named.reserve_w
                );
                named.reserve_w
            }
            _ => configured,
        },
        Ok(None) => configured,
        Err(error) => {
            tracing::info!(
                "fleet: cannot read the domain's budget at start ({error}); holding fleet.reserve_w ({configured} W)"
            );
            configured
        }
    }
}

/// The node's client of the domain's etcd. The TLS files are read again each time: they
/// were checked when the config loaded, and may have been renewed since.
fn connect(config: &FleetConfig) -> Result<EtcdFleet, tokwatt_fleet::StoreError> {
    let tls = config
        .tls
        .as_ref()
        .map(tokwatt_fleet::etcd::EtcdTls::load)
        .transpose()?;
    EtcdFleet::connect_with(&config.endpoints, tls.as_ref(), config.timeout)
}

/// Where a starting agent writes its record of the reserve it applied (its own lease, not
/// its membership's: the record outlives the agent's silence). `None`, and a warning,
/// where the store cannot be reached: the node stays charged until it joins.
pub(super) fn agent_proof_target(config: &FleetConfig, boot: u64) -> Option<ProofTarget> {
    match connect(config) {
        Ok(store) => Some(ProofTarget {
            store: Box::new(store),
            domain: config.link.domain.clone(),
            node: config.link.node.clone(),
            by: format!("tokwatt serve (pid {}) at its start", std::process::id()),
            boot,
            ttl: tokwatt_fleet::DEFAULT_PROOF_TTL,
        }),
        Err(error) => {
            tracing::warn!("fleet: {error}; no record of the reserve applied at start");
            None
        }
    }
}

/// The thread that talks to the store.
#[derive(Debug)]
pub(super) struct FleetThread {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl FleetThread {
    /// `fence`: what the node declares about its fence before each report; `default_w`:
    /// its GPUs' board-default caps, summed.
    pub(super) fn start(
        config: FleetConfig,
        node: Arc<FleetNode>,
        control: Arc<ServeControl>,
        fence: Option<FenceDeclaration>,
        default_w: f64,
        boot: u64,
    ) -> Result<Self, tokwatt_fleet::StoreError> {
        let declared = Declared {
            fence,
            default_w,
            boot,
        };
        let store = connect(&config)?;
        let stop = Arc::new(AtomicBool::new(false));
        let handle = std::thread::Builder::new()
            .name("tokwatt-fleet".into())
            .spawn({
                let stop = Arc::clone(&stop);
                move || run(&store, &config, &node, &control, &stop, declared)
            })
            .map_err(|e| {
                tokwatt_fleet::StoreError::Config(format!("cannot start the fleet thread: {e}"))
            })?;
        Ok(Self {
            stop,
            handle: Some(handle),
        })
    }

    /// Leaves the domain (after the loop has stopped, at the reserve) and ends the thread.
    pub(super) fn stop(mut self) {
        self.end();
    }

    fn end(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(handle) = self.handle.take()
            && handle.join().is_err()
        {
            tracing::error!("the fleet thread panicked");
        }
    }
}

impl Drop for FleetThread {
    fn drop(&mut self) {
        self.end();
    }
}

/// What the node declares of itself in its reports, beside its figures.
struct Declared {
    /// Its fence (`None`: none), as alive as its status shows.
    fence: Option<FenceDeclaration>,
    /// Its GPUs' board-default caps, summed.
    default_w: f64,
    /// The boot it runs in.
    boot: u64,
}

fn run(
    store: &dyn FleetStore,
    config: &FleetConfig,
    node: &FleetNode,
    control: &ServeControl,
    stop: &AtomicBool,
    declared: Declared,
) {
    let Declared {
        mut fence,
        default_w,
        boot,
    } = declared;
    let mut link = NodeLink::new(config.link.clone());
    link.declare_boot(boot);
    tracing::info!(
        domain = %config.link.domain,
        node = %config.link.node,
        reserve_w = config.link.reserve_w,
        "fleet: joining the power domain; holding the reserve until granted"
    );
    // The loop has not ticked for long: said once, until it ticks again.
    let mut said_stale = false;
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let (figures, read_back) = node.take_figures_read_back(stop);
        if !read_back && !said_stale && figures.ticks > 0 {
            tracing::warn!(
                "fleet: the control loop has not ticked for {:.1} s; reporting the caps it last read back",
                figures
                    .published
                    .map_or(0.0, |at| at.elapsed().as_secs_f64())
            );
        }
        said_stale = !read_back;
        if figures.ticks > 0 {
            link.declare(
                fence.as_mut().and_then(|f| f.now(Instant::now())),
                default_w,
            );
            let allowance = link.allowance(Instant::now());
            let report = link.report(
                &allowance,
                figures.caps_in_force_w,
                figures.draw_w,
                figures.tokens_per_s,
                figures.wants_more,
                figures.requested_w,
            );
            link.exchange(store, &report);
            node.allowance.publish(link.snapshot());
            node.observe_link(&link);
            let now = link.allowance(Instant::now());
            let counts = link.counts();
            control.observe_fleet(&FleetReading {
                allowance_w: now.watts(),
                caps_in_force_w: figures.caps_in_force_w,
                granted: matches!(now, Allowance::Granted(_)),
                lease_live: *link.state() == LinkState::Live,
                store_errors: counts.store_errors,
                lease_lapses: counts.lapses,
                joins: counts.joins,
            });
        }
        // Short sleeps: a stop is taken within 50 ms.
        while !stop.load(Ordering::Relaxed) && started.elapsed() < config.report_every {
            std::thread::sleep(Duration::from_millis(50).min(config.report_every));
        }
    }
    // The loop has stopped and put the node at its reserve: leave at once, so the
    // coordinator frees the grant now rather than when the lease lapses.
    node.allowance
        .publish(AllowanceSnapshot::reserve(link.reserve_w()));
    if let Err(error) = link.leave(store) {
        tracing::warn!("fleet: leaving the domain: {error}; the lease lapses on its own");
    }
    node.observe_link(&link);
}

/// The serve loop's chain after a stall: the control loop, this node's figures, the metrics.
#[cfg(test)]
#[path = "stall_tests.rs"]
mod stall_tests;

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use tokwatt_core::types::{ClockEvents, Observation};
    use tokwatt_fleet::{AllowanceSnapshot, Grant};

    use super::{FleetStatus, Holding, LinkView, fleet_status, power_bound};

    /// The status says which allowance the node holds, its grant and whether it enforced
    /// it, its lease and how long the grant holds without a renewal, and why it is apart.
    #[test]
    fn the_status_shows_the_allowance_the_grant_and_the_lease() {
        let place = FleetStatus {
            domain: "rack-s".into(),
            node: "n1".into(),
            ..FleetStatus::default()
        };
        let now = Instant::now();
        let grant = Grant {
            generation: 7,
            watts: 2800.0,
            ceiling_w: 2800.0,
            under_freeze: None,
        };
        let snapshot = AllowanceSnapshot::granted(grant, now + Duration::from_secs(2), 1000.0);
        let link = LinkView {
            lease: Some(0x694d),
            apart_because: None,
            acked_generation: 7,
        };
        let status = fleet_status(&place, &snapshot, &link, now);
        assert_eq!(
            (status.domain.as_str(), status.node.as_str()),
            ("rack-s", "n1")
        );
        assert_eq!(status.allowance_w, Some(2800.0));
        assert_eq!(status.holding, Some(Holding::Grant));
        assert_eq!(status.reserve_w, Some(1000.0));
        let held = status.grant.expect("a grant");
        assert!(held.acknowledged && held.generation == 7 && held.watts == 2800.0);
        let lease = status.lease.expect("a lease");
        assert_eq!(lease.id, "694d");
        assert!((lease.holds_for_s - 2.0).abs() < 1e-9, "{lease:?}");

        // Not yet enforced: not acknowledged.
        let behind = LinkView {
            acked_generation: 6,
            ..link.clone()
        };
        let status = fleet_status(&place, &snapshot, &behind, now);
        assert!(!status.grant.expect("a grant").acknowledged);

        // Past the deadline (etcd unreachable): the reserve, the lease held 0 s more.
        let cut_off = LinkView {
            apart_because: Some("cannot renew: no etcd member answered".into()),
            ..link
        };
        let later = now + Duration::from_secs(3);
        let status = fleet_status(&place, &snapshot, &cut_off, later);
        assert_eq!(status.allowance_w, Some(1000.0));
        assert_eq!(status.holding, Some(Holding::Reserve));
        assert!(status.grant.is_none());
        assert_eq!(status.lease.expect("still named").holds_for_s, 0.0);
        assert!(
            status
                .apart_because
                .as_deref()
                .is_some_and(|why| why.contains("cannot renew"))
        );

        // Never joined: no lease, the reserve.
        let apart = LinkView {
            lease: None,
            apart_because: Some("not joined yet".into()),
            acked_generation: 0,
        };
        let status = fleet_status(&place, &AllowanceSnapshot::reserve(1000.0), &apart, now);
        assert!(status.lease.is_none() && status.grant.is_none());
        assert_eq!(status.holding, Some(Holding::Reserve));
    }

    #[test]
    fn only_a_gpu_its_cap_holds_down_asks_for_more_watts() {
        let held = Observation::typical_h200(0, 1);
        assert!(power_bound(&held));
        // Light load under a 700 W cap: a higher cap would buy nothing.
        let light = Observation {
            power_avg_w: 320.0,
            clock_events: ClockEvents::default(),
            ..held
        };
        assert!(!power_bound(&light));
        // Drawing next to the cap counts even where the event was not reported.
        let close = Observation {
            power_avg_w: 650.0,
            ..light
        };
        assert!(power_bound(&close));
    }
}
