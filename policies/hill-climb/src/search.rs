//! The search on one GPU: the kit's power cap search, with the objective first.

use std::ops::{Deref, DerefMut};
use tokwatt_policy_kit::measure::objective_breach;
use tokwatt_policy_kit::{CapConfig, CapSearch, WindowScope};
use tokwatt_policy_sdk::{DeviceFacts, Objective, Observation, Settings, info};

// The tests name the direction by this path.
#[cfg(test)]
pub(crate) use tokwatt_policy_kit::Direction;

/// The search state of one GPU: the cap search, and whether an objective-driven raise is
/// still taking effect. It reads as the cap search it extends.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GpuSearch {
    pub search: CapSearch,
    /// True from an objective-driven raise until the next settled tick, so the raise is
    /// judged on figures that show it rather than repeated while it takes effect.
    pub raised_for_slo: bool,
}

impl Deref for GpuSearch {
    type Target = CapSearch;

    fn deref(&self) -> &CapSearch {
        &self.search
    }
}

impl DerefMut for GpuSearch {
    fn deref_mut(&mut self) -> &mut CapSearch {
        &mut self.search
    }
}

impl GpuSearch {
    /// A search on `device`, starting at `config.start_w` or the device's default cap.
    /// Its windows hold only the cap still: this policy does not move the batch.
    pub fn new(device: &DeviceFacts, config: &CapConfig) -> Result<GpuSearch, String> {
        Ok(GpuSearch {
            search: CapSearch::new(device, config, WindowScope::Cap)?,
            raised_for_slo: false,
        })
    }

    /// Takes one tick's observation of this GPU and returns its settings.
    pub fn observe(
        &mut self,
        observation: &Observation,
        objective: &Objective,
        config: &CapConfig,
    ) -> Settings {
        let in_force_w = observation.in_force.power_cap_w;
        // The objective comes first: a violation raises the cap now, whatever the
        // window says. While an earlier raise is still settling, wait for it to show.
        let asked_w = if let Some(violation) = objective_breach(observation, objective) {
            if !(observation.settling && self.raised_for_slo) {
                let raised_w = self.search.raise_for_slo(observation, config);
                info!(
                    "gpu {}: {violation} at {in_force_w:.1} W; raising the cap to \
                     {raised_w:.1} W",
                    self.gpu
                );
                self.raised_for_slo = true;
            }
            self.search.request(in_force_w)
        } else {
            if !observation.settling {
                self.raised_for_slo = false;
            }
            self.search.observe(observation, config)
        };
        match asked_w {
            Some(cap_w) => Settings::unchanged().with_power_cap_w(cap_w),
            None => Settings::unchanged(),
        }
    }
}
