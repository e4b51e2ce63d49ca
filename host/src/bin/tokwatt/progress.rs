//! Progress bars for the long commands (`tokwatt ab`, `tokwatt tune`, `tokwatt eval`), drawn
//! on stderr only when it is a terminal and the user did not ask for quiet: in a pipe, a
//! log file or CI nothing is written per update (`eval`: a line at each tenth of its
//! runs), and each command prints its own final lines.

use std::io::IsTerminal as _;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokwatt_lab::ab::{AbOutcome, AbProgress, AbSummary, Decision, confidence_percent};
use tokwatt_lab::eval::EvalProgress;

/// How often the bar redraws on its own, so that the elapsed time moves during an epoch
/// that takes minutes.
const STEADY_TICK: Duration = Duration::from_millis(250);

const AB_TEMPLATE: &str = "{elapsed_precise} [{bar:30}] {pos}/{len} pairs  {msg}";
const ROUND_TEMPLATE: &str = "{elapsed_precise} [{bar:30}] {pos}/{len} runs  {msg}";
const EVAL_TEMPLATE: &str = "{elapsed_precise} [{bar:30}] {pos}/{len} runs  {msg}";

/// A bar on stderr, or nothing when quiet or when stderr is not a terminal.
fn terminal_bar(quiet: bool, length: u64, template: &str) -> Option<ProgressBar> {
    if quiet || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::with_draw_target(Some(length), ProgressDrawTarget::stderr());
    // The templates are constants; a bad one falls back to the plain bar, never a panic.
    let style = ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    bar.set_style(style);
    bar.enable_steady_tick(STEADY_TICK);
    Some(bar)
}

/// `tokwatt ab`: pairs done of the budget and the latest look's ratio and interval.
#[derive(Debug)]
pub struct AbBar {
    bar: Option<ProgressBar>,
}

impl AbBar {
    pub fn new(quiet: bool, budget_pairs: usize) -> Self {
        let bar = terminal_bar(quiet, budget_pairs as u64, AB_TEMPLATE);
        if let Some(bar) = &bar {
            bar.set_message("first epoch");
        }
        Self { bar }
    }

    /// After every measured epoch (the runner's progress callback).
    pub fn update(&self, progress: &AbProgress) {
        if let Some(bar) = &self.bar {
            bar.set_length(progress.budget_pairs as u64);
            bar.set_position(progress.pairs_done as u64);
            bar.set_message(update_message(progress));
        }
    }

    /// The run is over: the bar stays, stopped at the pairs used, with the decision.
    pub fn finish(&self, outcome: &AbOutcome) {
        if let Some(bar) = &self.bar {
            bar.set_position(outcome.pairs.len() as u64);
            bar.finish_with_message(format!(
                "done: {}",
                outcome
                    .looks
                    .last()
                    .map_or_else(|| "no look".to_owned(), look_message)
            ));
        }
    }

    /// Whether anything is drawn.
    pub fn is_drawn(&self) -> bool {
        self.bar.is_some()
    }
}

/// The bar's message after an epoch: the latest look, or the epochs so far before the first.
fn update_message(progress: &AbProgress) -> String {
    match &progress.last_look {
        Some(look) => look_message(look),
        None => format!(
            "{} epochs, first look at {} pairs to come",
            progress.epochs_done,
            // The plan's first look is at 4 pairs, or at the budget when that is smaller.
            progress.budget_pairs.min(4)
        ),
    }
}

/// One look in a line: its ratio B/A, its interval and confidence, and its decision.
fn look_message(look: &AbSummary) -> String {
    let decision = match look.decision {
        Decision::A => "a wins",
        Decision::B => "b wins",
        Decision::ARefused => "a refused",
        Decision::BRefused => "b refused",
        Decision::NoDifference => "no difference",
        Decision::Continue => "continue",
    };
    format!(
        "look {} ({} pairs): B/A {:.4} [{:.4}, {:.4}] at {}: {decision}",
        look.look,
        look.pairs,
        look.ratio_b_over_a,
        look.ci_low,
        look.ci_high,
        confidence_percent(look.confidence)
    )
}

/// `tokwatt tune`: runs done of all the rounds' runs, with a message per run.
#[derive(Debug)]
pub struct RoundBar {
    bar: Option<ProgressBar>,
}

impl RoundBar {
    pub fn new(quiet: bool, total_runs: usize) -> Self {
        Self {
            bar: terminal_bar(quiet, total_runs as u64, ROUND_TEMPLATE),
        }
    }

    /// One more run done; `message` says which (e.g. "round 2: cap_w = 450").
    pub fn inc(&self, message: &str) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
            bar.set_message(message.to_owned());
        }
    }

    /// The search is over; the command prints the result itself.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }

    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.bar {
            Some(bar) => bar.suspend(f),
            None => f(),
        }
    }
}

/// `tokwatt eval`: hundreds of runs, and no line for each unless asked (`verbose`). On a
/// terminal a bar of the runs done, with the failures so far; elsewhere a line at each
/// tenth of the runs; quiet, nothing.
#[derive(Debug)]
pub struct EvalBar {
    bar: Option<ProgressBar>,
    quiet: bool,
    verbose: bool,
    failed: usize,
    next_tenth: usize,
}

impl EvalBar {
    pub fn new(quiet: bool, verbose: bool) -> Self {
        let bar = terminal_bar(quiet, 0, EVAL_TEMPLATE);
        if let Some(bar) = &bar {
            bar.set_message("the oracle first");
        }
        Self {
            bar,
            quiet,
            verbose,
            failed: 0,
            next_tenth: 1,
        }
    }

    /// After each oracle and each run (the judge's progress callback).
    pub fn update(&mut self, progress: &EvalProgress) {
        if let EvalProgress::Run {
            outcome: Err(_), ..
        } = progress
        {
            self.failed += 1;
        }
        let line = (!self.quiet && self.verbose).then(|| run_line(progress));
        match &self.bar {
            Some(bar) => {
                if let Some(line) = line {
                    bar.println(line);
                }
                match progress {
                    EvalProgress::Oracle { scenario, done, of } => {
                        bar.set_message(format!("oracle {done}/{of}: {scenario}"));
                    }
                    EvalProgress::Run { done, of, .. } => {
                        bar.set_length(*of as u64);
                        bar.set_position(*done as u64);
                        bar.set_message(failed_words(self.failed));
                    }
                }
            }
            None => {
                if let Some(line) = line {
                    eprintln!("{line}");
                } else if !self.quiet
                    && let EvalProgress::Run { done, of, .. } = progress
                    && let Some(line) = tenth_line(*done, *of, self.failed, &mut self.next_tenth)
                {
                    eprintln!("{line}");
                }
            }
        }
    }

    /// The runs are over; the command prints the results itself.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

fn failed_words(failed: usize) -> String {
    match failed {
        0 => String::new(),
        1 => "1 failed".to_owned(),
        n => format!("{n} failed"),
    }
}

/// A line at each tenth of the runs (where no bar is drawn): `[ 30%] 129/429 runs`.
fn tenth_line(done: usize, of: usize, failed: usize, next_tenth: &mut usize) -> Option<String> {
    if of == 0 || done * 10 < *next_tenth * of {
        return None;
    }
    *next_tenth = done * 10 / of + 1;
    let mut line = format!("[{:>3}%] {done}/{of} runs", done * 100 / of);
    if failed > 0 {
        line.push_str(&format!(", {}", failed_words(failed)));
    }
    Some(line)
}

/// One oracle's or one run's line (`--verbose`).
pub fn run_line(progress: &EvalProgress) -> String {
    match progress {
        EvalProgress::Oracle { scenario, done, of } => {
            format!("[oracle {done:>3}/{of}] {scenario}")
        }
        EvalProgress::Run {
            policy,
            scenario,
            seed,
            outcome,
            done,
            of,
        } => match outcome {
            Ok(tokens_per_joule) => format!(
                "[run {done:>4}/{of}] {policy} on {scenario}, seed {seed}: {tokens_per_joule:.4} tok/J"
            ),
            Err(reason) => {
                format!(
                    "[run {done:>4}/{of}] {policy} on {scenario}, seed {seed}: FAILED: {reason}"
                )
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(done: usize, of: usize, failed: bool) -> EvalProgress {
        EvalProgress::Run {
            policy: "static".into(),
            scenario: "h200-8b-latency".into(),
            seed: 1,
            outcome: if failed {
                Err("could not start".into())
            } else {
                Ok(3.25)
            },
            done,
            of,
        }
    }

    /// 429 runs make ten lines, not 429 (issue 43 item 9); each run's own line is
    /// `--verbose`'s.
    #[test]
    fn eval_progress_is_a_line_a_tenth_not_a_line_a_run() {
        let mut next = 1;
        let lines: Vec<String> = (1..=429)
            .filter_map(|done| tenth_line(done, 429, usize::from(done > 200), &mut next))
            .collect();
        assert_eq!(lines.len(), 10, "{lines:?}");
        assert_eq!(lines[0], "[ 10%] 43/429 runs");
        assert_eq!(lines[9], "[100%] 429/429 runs, 1 failed");
        assert_eq!(
            run_line(&run(7, 429, false)),
            "[run    7/429] static on h200-8b-latency, seed 1: 3.2500 tok/J"
        );
        assert!(run_line(&run(8, 429, true)).ends_with("FAILED: could not start"));

        // A live bar counts the runs and the failures.
        let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::hidden());
        let mut eval = EvalBar {
            bar: Some(bar.clone()),
            quiet: false,
            verbose: false,
            failed: 0,
            next_tenth: 1,
        };
        eval.update(&run(1, 429, false));
        eval.update(&run(2, 429, true));
        assert_eq!((bar.position(), bar.length()), (2, Some(429)));
        assert_eq!(bar.message(), "1 failed");
        eval.finish();
        assert!(bar.is_finished());
        // Quiet: nothing drawn, every call accepted.
        let mut quiet = EvalBar::new(true, false);
        assert!(quiet.bar.is_none());
        quiet.update(&run(429, 429, false));
        quiet.finish();
    }

    fn look(decision: Decision) -> AbSummary {
        AbSummary {
            pairs: 8,
            ratio_b_over_a: 1.0312,
            ci_low: 1.0101,
            ci_high: 1.05,
            t_ci_low: 1.009,
            t_ci_high: 1.051,
            confidence: 0.99453,
            decision,
            look: 2,
            served_fraction_a: 1.0,
            served_fraction_b: 1.0,
            violation_rate_a: 0.0,
            violation_rate_b: 0.0,
            refused_because: None,
            objective: None,
        }
    }

    #[test]
    fn the_message_shows_the_latest_look_or_the_epochs_before_it() {
        let mut progress = AbProgress {
            pairs_done: 1,
            budget_pairs: 16,
            epochs_done: 3,
            last_look: None,
        };
        assert_eq!(
            update_message(&progress),
            "3 epochs, first look at 4 pairs to come"
        );
        progress.last_look = Some(look(Decision::B));
        assert_eq!(
            update_message(&progress),
            "look 2 (8 pairs): B/A 1.0312 [1.0101, 1.0500] at 99.45 %: b wins"
        );
        // A refused arm is said, and a level just under 100 % is not rounded up to it.
        let mut refused = look(Decision::BRefused);
        refused.confidence = 0.99996;
        assert_eq!(
            look_message(&refused),
            "look 2 (8 pairs): B/A 1.0312 [1.0101, 1.0500] at 99.996 %: b refused"
        );
        assert!(look_message(&look(Decision::Continue)).ends_with(": continue"));
    }

    #[test]
    fn the_templates_are_valid() {
        for template in [AB_TEMPLATE, ROUND_TEMPLATE, EVAL_TEMPLATE] {
            assert!(ProgressStyle::with_template(template).is_ok(), "{template}");
        }
    }

    /// Drawn into a hidden target: every call works on a live bar too.
    #[test]
    fn a_live_bar_follows_the_run() {
        let bar = ProgressBar::with_draw_target(Some(16), ProgressDrawTarget::hidden());
        let ab = AbBar {
            bar: Some(bar.clone()),
        };
        ab.update(&AbProgress {
            pairs_done: 4,
            budget_pairs: 16,
            epochs_done: 8,
            last_look: Some(look(Decision::Continue)),
        });
        assert_eq!(bar.position(), 4);
        assert!(
            bar.message().starts_with("look 2 (8 pairs)"),
            "{}",
            bar.message()
        );
        let rounds = RoundBar {
            bar: Some(bar.clone()),
        };
        rounds.inc("round 1: cap_w = 450");
        assert_eq!(bar.position(), 5);
        assert_eq!(bar.message(), "round 1: cap_w = 450");
        rounds.finish();
        assert!(bar.is_finished());
    }

    #[test]
    fn quiet_bars_draw_nothing_and_accept_every_call() {
        let bar = AbBar::new(true, 16);
        assert!(!bar.is_drawn());
        bar.update(&AbProgress {
            pairs_done: 4,
            budget_pairs: 16,
            epochs_done: 8,
            last_look: Some(look(Decision::Continue)),
        });
        let rounds = RoundBar::new(true, 9);
        assert!(rounds.bar.is_none());
        rounds.inc("round 1: cap_w = 450");
        rounds.finish();
    }
}
