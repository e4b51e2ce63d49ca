//! The power domains frozen in the fleet's etcd for an experiment: each freeze kept alive by
//! a thread of its own, and every one still held thawed when the experiment ends.

use super::*;

/// A freeze's lease: renewed every quarter of it while the experiment runs, it lapses
/// within this once the experiment dies (a crash, a kill), so a domain is never left
/// frozen by an experiment that is gone.
const FREEZE_TTL: Duration = Duration::from_secs(10);

/// The power domains in the fleet's etcd: each freeze kept alive by a thread of its own
/// until it is thawed (or this is dropped, as on a panic: every freeze still held is
/// ended then).
pub(super) struct EtcdDomains {
    store: Arc<EtcdFleet>,
    /// Who holds the freezes, as `fleet show` and the coordinator's metrics say it.
    by: String,
    held: Mutex<BTreeMap<String, HeldFreeze>>,
}

struct HeldFreeze {
    session: FreezeSession,
    stop: Arc<AtomicBool>,
    keeper: std::thread::JoinHandle<()>,
}

impl EtcdDomains {
    pub(super) fn new(store: EtcdFleet) -> Self {
        let host = tokwatt_fleet::budget::host_name();
        Self {
            store: Arc::new(store),
            by: format!(
                "tokwatt fleet ab on {} (pid {})",
                if host.is_empty() { "a host" } else { &host },
                std::process::id()
            ),
            held: Mutex::new(BTreeMap::new()),
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, HeldFreeze>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stops the freeze's keeper and ends the freeze.
    fn end(&self, held: HeldFreeze) -> Result<(), BoxError> {
        held.stop.store(true, Ordering::Relaxed);
        // A keeper that panicked renews nothing: the freeze is ended below either way.
        let _ = held.keeper.join();
        Ok(self.store.thaw(&held.session)?)
    }
}

/// Renews `session` every quarter of its TTL until `stop`; a renewal that fails is tried
/// again (the experiment's reads see a freeze that lapsed, and stop it).
fn keep_frozen(store: &EtcdFleet, session: &FreezeSession, stop: &AtomicBool) {
    let every = session.ttl / 4;
    loop {
        let since = Instant::now();
        while since.elapsed() < every {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        match store.renew_freeze(session) {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(domain = %session.domain, "fleet ab: the freeze lapsed before it was renewed");
                return;
            }
            Err(error) => {
                tracing::warn!(domain = %session.domain, "fleet ab: renewing the freeze failed (tried again): {error}");
            }
        }
    }
}

impl PowerDomains for EtcdDomains {
    fn freeze(&self, domain: &str, why: &str) -> Result<String, BoxError> {
        let freeze = Freeze {
            by: self.by.clone(),
            why: why.to_owned(),
        };
        match self.store.freeze(domain, &freeze, FREEZE_TTL)? {
            FreezeOutcome::Frozen(session) => {
                let stop = Arc::new(AtomicBool::new(false));
                let keeper = {
                    let (store, session, stop) =
                        (Arc::clone(&self.store), session.clone(), Arc::clone(&stop));
                    std::thread::Builder::new()
                        .name(format!("freeze-{domain}"))
                        .spawn(move || keep_frozen(&store, &session, &stop))?
                };
                let before = self.held().insert(
                    domain.to_owned(),
                    HeldFreeze {
                        session,
                        stop,
                        keeper,
                    },
                );
                if let Some(before) = before {
                    self.end(before)?;
                }
                Ok(self.by.clone())
            }
            FreezeOutcome::HeldBy(other) => Err(format!(
                "it is frozen already, by {} ({}): another experiment holds its grants; wait until it ends",
                other.by, other.why
            )
            .into()),
        }
    }

    fn read(&self, domain: &str) -> Result<DomainReading, BoxError> {
        let view = self.store.read_domain(domain)?.ok_or_else(|| {
            format!("etcd has no budget for it: is `{domain}` the domain the nodes' [fleet] names?")
        })?;
        let ours = self.held().get(domain).map(|held| held.session.lease);
        let (frozen_by_us, frozen_by_other) = match &view.freeze {
            Some(stored) if Some(stored.lease) == ours => (true, None),
            Some(stored) => (
                false,
                Some(format!("{} ({})", stored.freeze.by, stored.freeze.why)),
            ),
            None => (false, None),
        };
        Ok(DomainReading {
            grants: view
                .nodes
                .iter()
                .map(|node| {
                    let grant = node.grant.map(|g| GrantSeen {
                        generation: g.generation,
                        watts: g.watts,
                        forced_cut: g.under_freeze == Some(FrozenWrite::BudgetCut),
                    });
                    (node.node.clone(), grant)
                })
                .collect(),
            frozen_by_us,
            frozen_by_other,
        })
    }

    fn thaw(&self, domain: &str) -> Result<(), BoxError> {
        let held = self.held().remove(domain);
        match held {
            Some(held) => self.end(held),
            None => Ok(()),
        }
    }
}

impl Drop for EtcdDomains {
    fn drop(&mut self) {
        let held = std::mem::take(&mut *self.held());
        for (domain, held) in held {
            if let Err(error) = self.end(held) {
                eprintln!(
                    "tokwatt fleet ab: power domain {domain} could not be thawed ({error}); its freeze lapses within {FREEZE_TTL:?}"
                );
            }
        }
    }
}
