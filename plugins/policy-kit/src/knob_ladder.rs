//! A [`LadderSearch`] over the values of one knob, per GPU: what `cap-search` (power caps
//! on a grid) and `clock-search` (the supported SM clocks) share.

use crate::ladder::LadderSearch;
use crate::ladder_config::LadderConfig;
use crate::state::{decode_per_gpu, encode_per_gpu};
use tokwatt_policy_sdk::{DeviceFacts, Objective, Observation, State};

/// The power caps of `device` from its lowest to its highest, `grid_w` apart, the highest
/// included (a rung short of the top where the last would be closer than half a step).
///
/// # Errors
/// Where the host reports a range in which no cap can be searched.
pub fn cap_ladder(device: &DeviceFacts, grid_w: f64) -> Result<Vec<f64>, String> {
    let (min_w, max_w) = (device.power_cap_min_w, device.power_cap_max_w);
    let searchable = min_w.is_finite() && max_w.is_finite() && 0.0 < min_w && min_w <= max_w;
    if !(searchable && grid_w.is_finite() && grid_w > 0.0) {
        return Err(format!(
            "gpu {}: the host reports a power cap range of {min_w}-{max_w} W, in which no cap \
             can be searched in steps of {grid_w} W; check the spec's power cap guardrails",
            device.index
        ));
    }
    let mut caps = Vec::new();
    let mut cap_w = min_w;
    while cap_w < max_w - grid_w / 2.0 {
        caps.push(cap_w);
        cap_w += grid_w;
    }
    caps.push(max_w);
    Ok(caps)
}

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

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::cap_ladder;
    use tokwatt_policy_sdk::testing;

    #[test]
    fn the_cap_ladder_runs_from_the_lowest_cap_to_the_highest_and_refuses_no_range() {
        let caps = cap_ladder(&testing::h200(0), 25.0).unwrap();
        assert_eq!(caps.len(), 21);
        assert_eq!((caps[0], caps[20]), (200.0, 700.0));
        // A last rung closer than half a step to the top is left out.
        let caps = cap_ladder(&testing::h200(0), 30.0).unwrap();
        assert_eq!(caps[caps.len() - 2..], [680.0, 700.0]);
        let mut no_range = testing::h200(3);
        no_range.power_cap_max_w = 0.0;
        let error = cap_ladder(&no_range, 25.0).unwrap_err();
        assert!(
            error.contains("gpu 3") && error.contains("guardrails"),
            "{error}"
        );
        assert!(cap_ladder(&testing::h200(0), 0.0).is_err());
    }
}
