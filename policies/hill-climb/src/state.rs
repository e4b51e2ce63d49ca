//! Hand-over of the search state at a hot swap: schema version 1, little-endian.
//!
//! ```text
//! u32 number of GPUs, then per GPU:
//!   the kit's cap search (window scope `Cap`: no batch size), then
//!   bool raised_for_slo
//! ```
//!
//! The cap search's part is laid out in `tokwatt_policy_kit::state`.

use crate::search::GpuSearch;
use tokwatt_policy_kit::{CapConfig, state};
use tokwatt_policy_sdk::State;

/// The version of the layout above.
pub(crate) const SCHEMA_VERSION: u32 = 1;

pub(crate) fn encode(searches: &[GpuSearch]) -> State {
    state::encode_per_gpu(SCHEMA_VERSION, searches, |writer, search| {
        search
            .search
            .write_state(writer)
            .bool(search.raised_for_slo)
    })
}

/// The searches in `state`, laid over `current` (this instance's GPUs, whose ranges and
/// configuration win: the new version's spec may have changed them). Nothing is changed
/// unless all of `state` reads back.
pub(crate) fn decode(
    state: &State,
    current: &[GpuSearch],
    config: &CapConfig,
) -> Result<Vec<GpuSearch>, String> {
    state::decode_per_gpu(state, SCHEMA_VERSION, current, |reader, search| {
        Ok(GpuSearch {
            search: search.search.read_state(reader, config)?,
            raised_for_slo: reader.bool()?,
        })
    })
}
