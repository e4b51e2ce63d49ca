//! Hand-over of both loops' state at a hot swap: schema version 1, little-endian.
//!
//! ```text
//! u32 number of GPUs, then per GPU:
//!   the kit's cap search (window scope `CapAndBatch`: with the window's batch size),
//!   batch control:
//!     bool has pending [u32 batch size]
//! ```
//!
//! The cap search's part is laid out in `tokwatt_policy_kit::state`.

use crate::GpuControl;
use crate::config::Config;
use tokwatt_policy_kit::state;
use tokwatt_policy_sdk::State;

/// The version of the layout above.
pub(crate) const SCHEMA_VERSION: u32 = 1;

pub(crate) fn encode(gpus: &[GpuControl]) -> State {
    state::encode_per_gpu(SCHEMA_VERSION, gpus, |writer, GpuControl { cap, batch }| {
        let writer = cap.write_state(writer).bool(batch.pending.is_some());
        match batch.pending {
            Some(size) => writer.u32(size),
            None => writer,
        }
    })
}

/// The controls in `state`, laid over `current` (this instance's GPUs, whose ranges and
/// configuration win: the new version's spec may have changed them). Nothing is changed
/// unless all of `state` reads back.
pub(crate) fn decode(
    state: &State,
    current: &[GpuControl],
    config: &Config,
) -> Result<Vec<GpuControl>, String> {
    state::decode_per_gpu(state, SCHEMA_VERSION, current, |reader, control| {
        let cap = control.cap.read_state(reader, &config.cap)?;
        let mut batch = control.batch;
        batch.pending = if reader.bool()? {
            Some(reader.u32()?.clamp(1, batch.max))
        } else {
            None
        };
        Ok(GpuControl { cap, batch })
    })
}
