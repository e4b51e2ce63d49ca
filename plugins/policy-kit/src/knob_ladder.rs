//! A [`LadderSearch`] over the values of one knob, per GPU: what `cap-search` (power caps
//! on a grid) and `clock-search` (the supported SM clocks) share.

use crate::ladder::LadderSearch;
use crate::ladder_config::LadderConfig;
use crate::state::{decode_per_gpu, encode_per_gpu};
use tokwatt_policy_sdk::{Objective, Observation, State};

/// The search of one GPU over `values`, ascending (least power first).
#[derive(Debug, Clone, PartialEq)]
pub struct KnobLadder {
    pub search: LadderSearch,
    pub values: Vec<f64>,
}

impl KnobLadder {
    /// # Errors
    /// When `values` is empty, not finite or not ascending.
    pub fn new(gpu: u32, values: Vec<f64>, config: &LadderConfig) -> Result<KnobLadder, String> {
        if values.iter().any(|value| !value.is_finite())
            || values.windows(2).any(|pair| pair[0] >= pair[1])
        {
            return Err(format!(
                "gpu {gpu}: the settings to search are not ascending finite numbers: {values:?}"
            ));
        }
        Ok(KnobLadder {
            search: LadderSearch::new(gpu, values.len(), config)?,
            values,
        })
    }

    /// The rung whose value is nearest `value`.
    pub fn rung_of(&self, value: f64) -> usize {
        let mut best = 0;
        for (rung, candidate) in self.values.iter().enumerate() {
            if (candidate - value).abs() < (self.values[best] - value).abs() {
                best = rung;
            }
        }
        best
    }

    /// The value the search asks for.
    pub fn target(&self) -> f64 {
        self.values[self.search.current.min(self.values.len() - 1)]
    }

    /// Takes one tick with `in_force` the knob's value in force; returns the value to ask
    /// for, unless it is the one in force (within `tolerance`).
    pub fn observe(
        &mut self,
        observation: &Observation,
        in_force: f64,
        tolerance: f64,
        objective: &Objective,
        config: &LadderConfig,
    ) -> Option<f64> {
        let rung = self.rung_of(in_force);
        self.search.observe(observation, rung, objective, config);
        let target = self.target();
        ((target - in_force).abs() > tolerance).then_some(target)
    }
}

/// The state of every GPU's ladder (see [`LadderSearch::write_state`]).
pub fn encode(schema_version: u32, ladders: &[KnobLadder]) -> State {
    encode_per_gpu(schema_version, ladders, |writer, ladder| {
        ladder.search.write_state(writer)
    })
}

/// The ladders in `state`, laid over `current`.
///
/// # Errors
/// As [`decode_per_gpu`] and [`LadderSearch::read_state`].
pub fn decode(
    state: &State,
    schema_version: u32,
    current: &[KnobLadder],
    config: &LadderConfig,
) -> Result<Vec<KnobLadder>, String> {
    decode_per_gpu(state, schema_version, current, |reader, ladder| {
        Ok(KnobLadder {
            search: ladder.search.read_state(reader, config)?,
            values: ladder.values,
        })
    })
}
