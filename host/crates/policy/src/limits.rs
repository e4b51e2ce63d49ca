//! What the sandbox allows one policy, as the operator writes it in the spec's `[sandbox]`
//! table. The plugin crate enforces these; the spec checks them; neither needs the other.

/// Per-plugin sandbox limits, from the policy spec's `[sandbox]` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxLimits {
    /// WebAssembly instructions (roughly) one call may execute.
    pub fuel_per_call: u64,
    /// Wall-clock time one call may take.
    pub deadline_ms: u64,
    /// Linear memory the instance may hold, all its memories together.
    pub memory_mib: u64,
    /// Log messages per call; the rest are dropped and counted.
    pub log_messages_per_call: u32,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        Self {
            fuel_per_call: 100_000_000,
            deadline_ms: 100,
            memory_mib: 64,
            log_messages_per_call: 16,
        }
    }
}

/// The epoch deadline interrupts a call at this multiple of the spec's `deadline_ms`.
///
/// Fuel is the primary budget: it is deterministic, so a legal policy is never ejected
/// for the machine's load. The wall-clock deadline is the backstop for what fuel does
/// not count (time in host calls, a slow machine) and gets a margin, because wall time
/// per call varies with the machine's load: 40 identical calls of a fixed-work plugin
/// (`plugin::tests::wall_time_per_call_varies`, debug host, on this 2-core machine while
/// other builds ran) took min 473 ms, median 938, p90 1461, max 2292 ms, so a policy
/// using 87 % of its deadline in a quiet run misses it again and again under load. At
/// 2× a call is stopped only when it takes twice what its author was allowed; a call
/// that loops is still stopped by fuel first, deterministically. (Under heavier load
/// than the 2× margin covers, a deadline miss costs one tick, not the policy: it takes
/// `failures_to_eject` in a row to eject.)
pub const DEADLINE_MARGIN: u64 = 2;
