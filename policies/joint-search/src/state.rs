//! Hand-over of the search state at a hot swap: schema version 3 (1 lacked the shift
//! detector's demand, 2 the window's TTFT and backlog), little-endian.
//!
//! ```text
//! u32 number of GPUs, then per GPU:
//!   u32 arms, per arm: ArmRecord (5 x [u32 count, f64 mean, f64 m2]),
//!     u32 latency rule-out until, u32 queue rule-out until, bool held;
//!   u32 visits, u32 current arm,
//!   window: ArmRecord, [u32, f64, f64] p99, u32 queue_start, u32 queue_last,
//!     [u32, f64, f64] TTFT p99, f64 tokens made, f64 asked for, u32 in flight
//!     first, u32 last, u32 batch size,
//!   noise: f64 x2, shift: f64 ratio, u32 ticks_off, f64 demand,
//!   demand: [u32, f64, f64], u32 mismatch_ticks, bool raised
//! ```

use crate::bandit::Bandit;
use crate::config::Config;
use tokwatt_policy_kit::state;
use tokwatt_policy_sdk::State;

/// The version of the layout above.
pub(crate) const SCHEMA_VERSION: u32 = 3;

pub(crate) fn encode(gpus: &[Bandit]) -> State {
    state::encode_per_gpu(SCHEMA_VERSION, gpus, |writer, bandit| {
        bandit.write_state(writer)
    })
}

/// The searches in `state`, laid over `current`; nothing changes unless all of it reads.
pub(crate) fn decode(
    state: &State,
    current: &[Bandit],
    config: &Config,
) -> Result<Vec<Bandit>, String> {
    state::decode_per_gpu(state, SCHEMA_VERSION, current, |reader, bandit| {
        bandit.read_state(reader, config)
    })
}
