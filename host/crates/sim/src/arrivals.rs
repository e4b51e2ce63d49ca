//! A scenario's requests one by one, for a workload that serves them in real time (tokwatt's
//! CUDA serving loop): Poisson arrivals at each phase's rate, prompt and output lengths from
//! the scenario's distributions, each from a stream of its own so that the same seed gives the
//! same requests whatever serves them.

use super::scenario::Scenario;
use tokwatt_core::rng::Rng;
use tokwatt_core::workload::serving::{Request, RequestSource};

/// Streams of the arrival process (distinct from the simulated GPU's).
const GAP_STREAM: u64 = 0x6172_7269_7661_6c73; // "arrivals"
const LENGTH_STREAM: u64 = 0x6c65_6e67_7468_7321; // "lengths!"

/// The requests of a scenario with prompts.
#[derive(Debug, Clone)]
pub struct ScenarioArrivals {
    scenario: Scenario,
    gaps: Rng,
    lengths: Rng,
    /// The next arrival, drawn ahead.
    next: Option<Request>,
    /// Where the arrival process stands: the next arrival is drawn from here.
    clock_s: f64,
}

impl ScenarioArrivals {
    /// The arrivals of `scenario` from `seed`; a decode-only scenario (no `prompt_tokens`)
    /// has no requests to serve and is refused.
    pub fn new(scenario: &Scenario, seed: u64) -> Result<ScenarioArrivals, String> {
        if scenario.requests.is_none() {
            return Err(format!(
                "scenario `{}` is decode only (no `prompt_tokens`): a serving loop needs requests with prompts; give it `prompt_tokens` and `output_tokens` distributions",
                scenario.description
            ));
        }
        Ok(ScenarioArrivals {
            scenario: scenario.clone(),
            gaps: Rng::stream(seed, GAP_STREAM),
            lengths: Rng::stream(seed, LENGTH_STREAM),
            next: None,
            clock_s: 0.0,
        })
    }

    /// The first arrival after `clock_s`: an exponential gap at the phase's rate; a gap that
    /// crosses into the next phase is drawn again from its start (the process is memoryless).
    fn draw(&mut self) -> Option<Request> {
        let mut t = self.clock_s;
        loop {
            let rate = self.scenario.arrival_rps_at(t);
            let phase_end = self
                .scenario
                .phases
                .iter()
                .map(|p| p.start_s)
                .find(|&start| start > t);
            if rate <= 0.0 || !rate.is_finite() {
                t = phase_end?;
                continue;
            }
            let gap = -(1.0 - self.gaps.uniform()).ln() / rate;
            match phase_end {
                Some(end) if t + gap >= end => t = end,
                _ => {
                    t += gap;
                    break;
                }
            }
        }
        self.clock_s = t;
        let lengths = self.scenario.requests.as_ref()?;
        Some(Request {
            arrival_s: t,
            prompt: lengths.prompt.draw(&mut self.lengths),
            output: lengths.output.draw(&mut self.lengths),
        })
    }
}

impl RequestSource for ScenarioArrivals {
    fn arrivals(&mut self, from_s: f64, to_s: f64) -> Vec<Request> {
        let mut due = Vec::new();
        loop {
            if self.next.is_none() {
                self.next = self.draw();
            }
            match self.next {
                Some(request) if request.arrival_s < to_s => {
                    if request.arrival_s >= from_s {
                        due.push(request);
                    }
                    self.next = None;
                }
                _ => return due,
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn scenario(phases: &str) -> Scenario {
        Scenario::from_toml_str(
            &format!(
                "model = \"llama-3-8b\"\nprompt_tokens = {{ distribution = \"uniform\", min = 100, max = 300 }}\noutput_tokens = 50\n{phases}"
            ),
            "test",
        )
        .unwrap()
    }

    #[test]
    fn arrivals_follow_each_phase_rate_and_draw_the_lengths() {
        let s = scenario(
            "[[phases]]\nstart_s = 0\narrival_rps = 20\n[[phases]]\nstart_s = 100\narrival_rps = 0\n[[phases]]\nstart_s = 150\narrival_rps = 5\n",
        );
        let mut a = ScenarioArrivals::new(&s, 7).unwrap();
        let mut all = Vec::new();
        // Asked in uneven slices, as a real-time loop asks.
        let mut t = 0.0;
        while t < 350.0 {
            let next = t + 0.37;
            all.extend(a.arrivals(t, next));
            t = next;
        }
        let count = |from: f64, to: f64| {
            all.iter()
                .filter(|r| r.arrival_s >= from && r.arrival_s < to)
                .count() as f64
        };
        // Poisson counts: 2000 ± 45 and 1000 ± 32 (3 sd bounds), none in the quiet phase.
        assert!((count(0.0, 100.0) - 2000.0).abs() < 135.0);
        assert_eq!(count(100.0, 150.0), 0.0);
        assert!((count(150.0, 350.0) - 1000.0).abs() < 95.0);
        assert!(all.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s));
        assert!(
            all.iter()
                .all(|r| (100..=300).contains(&r.prompt) && r.output == 50)
        );
        // The same seed gives the same requests, however the time is sliced.
        let mut again = ScenarioArrivals::new(&s, 7).unwrap();
        assert_eq!(again.arrivals(0.0, 350.0), all);
    }

    #[test]
    fn a_decode_only_scenario_is_refused_with_the_fix() {
        let s = Scenario::from_toml_str(
            "model = \"llama-3-8b\"\ncontext_tokens = 1024\noutput_tokens = 50\n[[phases]]\nstart_s = 0\narrival_rps = 1\n",
            "test",
        )
        .unwrap();
        let error = ScenarioArrivals::new(&s, 1).unwrap_err();
        assert!(error.contains("prompt_tokens"), "{error}");
    }
}
