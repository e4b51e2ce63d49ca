//! Proofs of release: after whatever lowered a node's caps (the fence, the boot unit, a
//! starting agent) reads them back from the driver, it writes them to the fleet's store
//! ("node N: GPUs at these caps since t, sum W"), under a lease of its own and with its
//! own credentials. The coordinator frees a silent node's watts only on such a record
//! written after the node's last grant: a fence's deadline is a promise a frozen host
//! cannot keep, its record a reading.

use std::time::{Duration, SystemTime};

use tokwatt_core::actuator::Actuator;
use tokwatt_fleet::{FleetStore, ProofSource, ReleaseProof};

use super::{FenceError, read_caps};

/// Where a node's proofs go, and who writes them.
#[derive(Debug)]
pub struct ProofTarget {
    pub store: Box<dyn FleetStore>,
    pub domain: String,
    pub node: String,
    /// The writer, as `fleet show` names it (a command and host).
    pub by: String,
    /// The boot the node runs in ([`tokwatt_fleet::boot_of`]).
    pub boot: u64,
    /// The lease each record lives under.
    pub ttl: Duration,
}

/// A record written: its revision, and the caps' sum it holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProofWritten {
    pub revision: i64,
    pub sum_w: f64,
}

impl ProofTarget {
    /// Reads every GPU's cap back from `actuator`'s driver and writes them down as
    /// `source`'s record. A GPU that cannot be read writes nothing (a record is a
    /// reading, never a guess).
    pub fn write(
        &self,
        source: ProofSource,
        actuator: &mut dyn Actuator,
        detail: &str,
    ) -> Result<ProofWritten, FenceError> {
        let record = ReleaseProof {
            detail: detail.to_owned(),
            ..ReleaseProof::of_caps(
                source,
                self.by.clone(),
                read_caps(actuator)?,
                unix_ms_now(),
                self.boot,
            )
        };
        let sum_w = record.sum_w;
        let revision = self
            .store
            .prove(&self.domain, &self.node, &record, self.ttl)
            .map_err(|source| FenceError::Proof {
                node: self.node.clone(),
                source,
            })?;
        Ok(ProofWritten { revision, sum_w })
    }
}

/// Milliseconds since the Unix epoch by this host's clock (0 before it): shown beside a
/// record, never compared (the store's revisions order records).
pub fn unix_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
