//! The drawings of the A/B page: power and tokens per joule over time by arm, every
//! trajectory, each epoch as a strip, each look's intervals against ratio = 1, and the
//! row plot they share with `tokwatt tune`'s rounds ([`round_field_section`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::super::run::{AbOutcome, TickPoint};
use super::super::stats::{Arm, confidence_percent};
use super::{arm_epochs, arm_tokens_per_joule, decision_code, number};
use tokwatt_report::chart::Axis;
use tokwatt_report::{LineChart, Series, escape};

/// Colours of arm A, arm B and the cool-downs: the first three of the line charts' palette,
/// so an arm has the same colour in every chart of the page.
pub(super) const ARM_A_COLOUR: &str = "#0072b2";
pub(super) const ARM_B_COLOUR: &str = "#d55e00";
/// An entry that is not in the running (a dropped candidate).
pub(super) const FADED_COLOUR: &str = "#9a9a9a";

/// One round of `tokwatt tune` as an SVG section for [`Page::svg`]: one row per candidate
/// with its ratio of tokens per joule to the round's reference and that ratio's interval,
/// against the line ratio = 1. `field` holds `(label, ratio, ci_low, ci_high, kept)`;
/// candidates kept for the next round are drawn in colour and marked "kept", the others
/// grey. A non-finite ratio or bound is left out of the drawing and shown as "n/a".
pub fn round_field_section(title: &str, field: &[(String, f64, f64, f64, bool)]) -> String {
    let rows = field
        .iter()
        .map(|(label, ratio, low, high, kept)| Row {
            label: label.clone(),
            colour: if *kept { ARM_B_COLOUR } else { FADED_COLOUR },
            dots: Vec::new(),
            point: Some(*ratio),
            intervals: vec![Interval {
                low: *low,
                high: *high,
                thick: true,
            }],
            note: format!(
                "{} [{}, {}]{}",
                number(*ratio, 4),
                number(*low, 4),
                number(*high, 4),
                if *kept { " kept" } else { "" }
            ),
        })
        .collect();
    RowPlot {
        title: title.to_owned(),
        x_label: "tokens per joule, ratio to the round's reference".to_owned(),
        rows,
        reference: Some((1.0, "ratio = 1")),
    }
    .to_svg()
}

/// What is in charge of a tick: one of the arms, or nobody (a cool-down).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lane {
    ArmA,
    ArmB,
    Cooldown,
}

pub(super) const LANES: [Lane; 3] = [Lane::ArmA, Lane::ArmB, Lane::Cooldown];

impl Lane {
    fn of(point: &TickPoint) -> Lane {
        match point.arm {
            Some(Arm::A) => Lane::ArmA,
            Some(Arm::B) => Lane::ArmB,
            None => Lane::Cooldown,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Sums of one lane's points at one tick (several in crossover: one per group).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct LaneSums {
    count: usize,
    power_w: f64,
    tokens_per_joule: f64,
}

/// The time axis' unit, chosen so that its labels stay short.
pub(super) fn time_unit(duration_s: f64) -> (f64, &'static str) {
    if duration_s <= 600.0 {
        (1.0, "s")
    } else if duration_s <= 36_000.0 {
        (60.0, "min")
    } else {
        (3600.0, "h")
    }
}

/// Power and tokens per joule over time: one line per arm and one for the cool-downs.
pub(super) fn timeline_charts(outcome: &AbOutcome) -> [LineChart; 2] {
    let mut ticks: BTreeMap<u64, (f64, usize, [LaneSums; 3])> = BTreeMap::new();
    for point in &outcome.timeline {
        let (time, count, lanes) = ticks.entry(point.tick).or_default();
        *time += point.time_s;
        *count += 1;
        let lane = &mut lanes[Lane::of(point).index()];
        lane.count += 1;
        lane.power_w += point.power_w;
        lane.tokens_per_joule += point.tokens_per_joule;
    }
    let duration = ticks
        .values()
        .map(|(time, count, _)| time / *count as f64)
        .fold(0.0, f64::max);
    let (scale, unit) = time_unit(duration);
    let line = |lane: Lane, value: fn(&LaneSums) -> f64| -> Vec<(f64, f64)> {
        ticks
            .values()
            .map(|(time, count, lanes)| {
                let sums = &lanes[lane.index()];
                let y = if sums.count > 0 {
                    value(sums) / sums.count as f64
                } else {
                    // Not in charge at this tick: a gap in its line.
                    f64::NAN
                };
                (time / *count as f64 / scale, y)
            })
            .collect()
    };
    let names = [
        format!("arm A: {}", outcome.a.policy),
        format!("arm B: {}", outcome.b.policy),
        "cool-down (device defaults)".to_owned(),
    ];
    let chart = |title: &str, y_label: &str, value: fn(&LaneSums) -> f64| LineChart {
        title: title.to_owned(),
        x_label: format!("time since the start ({unit})"),
        y_label: y_label.to_owned(),
        series: LANES
            .iter()
            .zip(&names)
            .map(|(lane, name)| Series::new(name, line(*lane, value)))
            .collect(),
    };
    [
        chart("power by arm", "W", |s| s.power_w),
        chart(
            "tokens per joule by arm, per tick",
            "tokens per joule",
            |s| s.tokens_per_joule,
        ),
    ]
}

/// Each trajectory's tokens per joule since its start (its tokens over its energy so
/// far), against the time since it took over, in its arm's colour: how far apart runs
/// of one policy end up, beside how far apart the arms are.
pub(super) fn trajectories_chart(outcome: &AbOutcome) -> LineChart {
    let tick_s = outcome.tick_ms as f64 / 1000.0;
    // (group, pair, arm) → (trajectory tick, cumulative tokens, cumulative energy).
    let mut lines: BTreeMap<(usize, usize, u8), Vec<(f64, f64)>> = BTreeMap::new();
    let mut sums: BTreeMap<(usize, usize, u8), (u64, f64)> = BTreeMap::new();
    for point in &outcome.timeline {
        let (Some(arm), Some(pair), Some(age)) = (point.arm, point.pair, point.trajectory_tick)
        else {
            continue;
        };
        // The take-over tick still observes the window before the trajectory.
        if age == 0 {
            continue;
        }
        let key = (point.group, pair, u8::from(arm == Arm::B));
        let (tokens, energy) = sums.entry(key).or_default();
        *tokens += point.tokens;
        *energy += point.energy_j;
        let y = if *energy > 0.0 {
            *tokens as f64 / *energy
        } else {
            f64::NAN
        };
        lines.entry(key).or_default().push((age as f64 * tick_s, y));
    }
    let names = [
        format!("arm A: {}", outcome.a.policy),
        format!("arm B: {}", outcome.b.policy),
    ];
    let of_arm = |arm: u8| -> Vec<Vec<(f64, f64)>> {
        lines
            .iter()
            .filter(|(key, _)| key.2 == arm)
            .map(|(_, points)| points.clone())
            .collect()
    };
    let (mut a, mut b) = (of_arm(0).into_iter(), of_arm(1).into_iter());
    // Series 0 and 1 carry the arms' legend entries; every other trajectory takes the
    // colour of its arm's.
    let mut series = vec![
        Series::new(&names[0], a.next().unwrap_or_default()),
        Series::new(&names[1], b.next().unwrap_or_default()),
    ];
    series.extend(a.map(|points| Series::like(0, &names[0], points)));
    series.extend(b.map(|points| Series::like(1, &names[1], points)));
    LineChart {
        title: "each trajectory's tokens per joule since its start".to_owned(),
        x_label: "time since the trajectory took over (s)".to_owned(),
        y_label: "tokens per joule so far".to_owned(),
        series,
    }
}

/// Each measured epoch's tokens per joule, one row of dots per arm.
pub(super) fn epoch_strip_svg(outcome: &AbOutcome) -> String {
    let row = |arm: Arm, colour: &'static str| {
        let overall = arm_tokens_per_joule(outcome, arm);
        let dots: Vec<f64> = arm_epochs(outcome, arm)
            .map(|e| e.tokens_per_joule)
            .collect();
        Row {
            label: format!("arm {}", arm.to_string().to_uppercase()),
            colour,
            note: format!("{} epochs, {}", dots.len(), number(overall, 4)),
            dots,
            point: Some(overall),
            intervals: Vec::new(),
        }
    };
    RowPlot {
        title: "tokens per joule of every measured epoch".to_owned(),
        x_label: "tokens per joule".to_owned(),
        rows: vec![row(Arm::A, ARM_A_COLOUR), row(Arm::B, ARM_B_COLOUR)],
        reference: None,
    }
    .to_svg()
}

/// Each pair's ratio B/A as a dot, with the verdict's ratio and interval and ratio = 1.
pub(super) fn pair_ratio_chart(outcome: &AbOutcome) -> LineChart {
    let tokens_per_joule = |tokens: u64, energy: f64| {
        if energy > 0.0 {
            tokens as f64 / energy
        } else {
            f64::NAN
        }
    };
    // A gap after every point: each pair is a dot of its own, not a line through them.
    let dots: Vec<(f64, f64)> = outcome
        .pairs
        .iter()
        .enumerate()
        .flat_map(|(i, pair)| {
            let ratio = tokens_per_joule(pair.b.tokens, pair.b.energy_j)
                / tokens_per_joule(pair.a.tokens, pair.a.energy_j);
            [(i as f64, ratio), (i as f64, f64::NAN)]
        })
        .collect();
    let last = outcome.pairs.len().saturating_sub(1).max(1) as f64;
    let level = |name: &str, y: f64| Series::dashed(name, vec![(0.0, y), (last, y)]);
    LineChart {
        title: "each pair's tokens per joule, B over A".to_owned(),
        x_label: "pair (from 0)".to_owned(),
        y_label: "ratio B/A".to_owned(),
        series: vec![
            Series::new("pair", dots),
            level("verdict", outcome.ratio_b_over_a),
            level("interval low", outcome.ci_low),
            level("interval high", outcome.ci_high),
            level("ratio = 1", 1.0),
        ],
    }
}

/// Every look's ratio with its bootstrap and t intervals.
pub(super) fn looks_svg(outcome: &AbOutcome) -> String {
    let rows = outcome
        .looks
        .iter()
        .map(|look| Row {
            label: format!("look {}: {} pairs", look.look, look.pairs),
            colour: if look.decision.is_final() {
                ARM_B_COLOUR
            } else {
                ARM_A_COLOUR
            },
            dots: Vec::new(),
            point: Some(look.ratio_b_over_a),
            intervals: vec![
                Interval {
                    low: look.ci_low,
                    high: look.ci_high,
                    thick: true,
                },
                Interval {
                    low: look.t_ci_low,
                    high: look.t_ci_high,
                    thick: false,
                },
            ],
            note: format!(
                "{} at {}: {}",
                number(look.ratio_b_over_a, 4),
                confidence_percent(look.confidence),
                decision_code(look.decision)
            ),
        })
        .collect();
    RowPlot {
        title: "ratio B/A and its interval at each look".to_owned(),
        x_label: "tokens per joule, B over A".to_owned(),
        rows,
        reference: Some((1.0, "ratio = 1")),
    }
    .to_svg()
}

/// A horizontal interval of a [`Row`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Interval {
    low: f64,
    high: f64,
    /// Thick: the main interval; thin, drawn just below: one for comparison.
    thick: bool,
}

/// One labelled row of a [`RowPlot`].
#[derive(Debug, Clone)]
pub(super) struct Row {
    label: String,
    colour: &'static str,
    /// Small dots (one per epoch), jittered up and down so that equal values stay visible.
    dots: Vec<f64>,
    /// The estimate, drawn as a bar across the row.
    point: Option<f64>,
    intervals: Vec<Interval>,
    /// Text at the row's right end.
    note: String,
}

/// Rows of dots, estimates and intervals on one shared horizontal axis: a strip plot, or
/// a forest plot with a reference line.
#[derive(Debug, Clone)]
pub(super) struct RowPlot {
    title: String,
    x_label: String,
    rows: Vec<Row>,
    reference: Option<(f64, &'static str)>,
}

pub(super) const PLOT_WIDTH: f64 = 640.0;
/// The plotting area keeps at least this width however long the labels: the page grows
/// instead (the report scrolls sideways before a chart gets too narrow to read).
pub(super) const MIN_PLOT_AREA: f64 = 360.0;
pub(super) const ROW_HEIGHT: f64 = 30.0;
pub(super) const TOP: f64 = 42.0;
pub(super) const BOTTOM: f64 = 44.0;
/// Width of one character of 12 px sans-serif text, for layout: generous (0.6 em; most
/// letters and digits are 0.5-0.56 em), so that a label sized by it is never cut off.
pub(super) const CHAR_WIDTH: f64 = 7.2;
/// How far beyond the marks (estimates, dots, the reference line and the narrowest
/// interval) an interval may widen the axis, in widths of that core. A wider one is
/// clipped at the frame and marked with an arrow: the early looks' t intervals at a tiny
/// α run from 0.06 to 39 when the verdict's lies within 1.44-1.54, and an axis covering
/// them draws every interval a pixel wide.
pub(super) const INTERVAL_REACH: f64 = 1.5;

/// The smallest and largest finite value, if any.
fn hull(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values
        .filter(|v| v.is_finite())
        .fold(None, |acc, v| match acc {
            None => Some((v, v)),
            Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
        })
}

impl RowPlot {
    /// The range the axis covers: the estimates, the dots, the reference line, the
    /// narrowest interval, and every interval end within [`INTERVAL_REACH`] of them;
    /// `None` where the rows hold no finite value at all.
    fn axis_range(&self) -> Option<(f64, f64)> {
        let intervals = || self.rows.iter().flat_map(|r| r.intervals.iter());
        let ends = || intervals().flat_map(|i| [i.low, i.high]);
        let marks = || {
            self.rows
                .iter()
                .flat_map(|r| r.dots.iter().copied().chain(r.point))
        };
        // The reference line widens the axis to include it, but is no data by itself.
        hull(marks().chain(ends()))?;
        let narrowest = intervals()
            .filter(|i| i.low.is_finite() && i.high.is_finite() && i.low <= i.high)
            .min_by(|x, y| (x.high - x.low).total_cmp(&(y.high - y.low)));
        let reference = self.reference.map(|(x, _)| x);
        let (lo, hi) = hull(
            marks()
                .chain(reference)
                .chain(narrowest.into_iter().flat_map(|i| [i.low, i.high])),
        )
        .or_else(|| hull(ends()))?;
        // A flat core (an A/A, every estimate at 1) still lets intervals of a percent in.
        let span = (hi - lo).max(lo.abs().max(hi.abs()) * 0.01);
        let (reach_lo, reach_hi) = (lo - INTERVAL_REACH * span, hi + INTERVAL_REACH * span);
        hull(
            [lo, hi]
                .into_iter()
                .chain(ends().filter(|v| (reach_lo..=reach_hi).contains(v))),
        )
    }

    fn to_svg(&self) -> String {
        // Each column as wide as its longest text, so that no label is cut off.
        let text_width = |texts: &mut dyn Iterator<Item = &String>| {
            texts
                .map(|t| t.chars().count() as f64 * CHAR_WIDTH)
                .fold(40.0, f64::max)
        };
        let left = text_width(&mut self.rows.iter().map(|r| &r.label)) + 16.0;
        let right = text_width(&mut self.rows.iter().map(|r| &r.note)) + 16.0;
        let plot_left = left;
        let plot_width = (PLOT_WIDTH - left - right).max(MIN_PLOT_AREA);
        let width = plot_left + plot_width + right;
        let plot_height = ROW_HEIGHT * self.rows.len().max(1) as f64;
        let height = TOP + plot_height + BOTTOM;
        let title = escape(&self.title);
        let mut svg = String::new();
        let _ = write!(
            svg,
            r##"<svg xmlns="http://www.w3.org/2000/svg" class="chart row-plot" viewBox="0 0 {width:.0} {height:.0}" width="{width:.0}" height="{height:.0}" role="img" aria-label="{title}" font-family="sans-serif" font-size="12"><title>{title}</title><text x="{plot_left:.0}" y="17" font-size="14" font-weight="bold">{title}</text><rect x="{plot_left:.1}" y="{TOP}" width="{plot_width:.1}" height="{plot_height:.1}" fill="#fff" stroke="#bbb"/>"##,
        );
        let Some((min, max)) = self.axis_range() else {
            let _ = write!(
                svg,
                r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#777">no data</text></svg>"##,
                plot_left + plot_width / 2.0,
                TOP + plot_height / 2.0
            );
            return svg;
        };
        let axis = Axis::padded((min, max));
        let to_x = |v: f64| plot_left + axis.fraction(v) * plot_width;

        for (x, label) in axis.labelled_ticks() {
            let px = to_x(x);
            let _ = write!(
                svg,
                r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{bottom:.1}" stroke="#eee"/><text x="{px:.1}" y="{ty:.1}" text-anchor="middle">{label}</text>"##,
                bottom = TOP + plot_height,
                ty = TOP + plot_height + 16.0,
            );
        }
        let _ = write!(
            svg,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            plot_left + plot_width / 2.0,
            TOP + plot_height + 36.0,
            escape(&self.x_label)
        );
        if let Some((x, label)) = self.reference {
            let px = to_x(x);
            let _ = write!(
                svg,
                r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{bottom:.1}" stroke="#000" stroke-width="1.2" stroke-dasharray="6 4"><title>{label}</title></line><text x="{px:.1}" y="{ty:.1}" text-anchor="middle" fill="#555">{label}</text>"##,
                bottom = TOP + plot_height,
                ty = TOP - 4.0,
                label = escape(label),
            );
        }

        for (index, row) in self.rows.iter().enumerate() {
            let mid = TOP + (index as f64 + 0.5) * ROW_HEIGHT;
            let colour = row.colour;
            let _ = write!(
                svg,
                r##"<g><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                plot_left - 8.0,
                mid + 4.0,
                escape(&row.label)
            );
            for interval in &row.intervals {
                // An unbounded end (infinite) is drawn to the frame like a clipped one;
                // an end that is no number at all is not drawn.
                if interval.low.is_nan() || interval.high.is_nan() {
                    continue;
                }
                let (y, stroke) = if interval.thick {
                    (mid, 4.0)
                } else {
                    (mid + 7.0, 1.5)
                };
                let low = interval.low.clamp(axis.lo, axis.hi);
                let high = interval.high.clamp(axis.lo, axis.hi);
                let _ = write!(
                    svg,
                    r##"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{colour}" stroke-width="{stroke}" stroke-opacity="0.6"><title>{} to {}</title></line>"##,
                    to_x(low),
                    to_x(high),
                    number(interval.low, 4),
                    number(interval.high, 4)
                );
                // An arrow at the frame where the interval runs on beyond the axis.
                for (clipped, edge, outward, end) in [
                    (interval.low < axis.lo, axis.lo, -1.0, interval.low),
                    (interval.high > axis.hi, axis.hi, 1.0, interval.high),
                ] {
                    if !clipped {
                        continue;
                    }
                    let tip = to_x(edge);
                    let back = tip - outward * 7.0;
                    let _ = write!(
                        svg,
                        r##"<polygon class="clipped" points="{tip:.1},{y:.1} {back:.1},{:.1} {back:.1},{:.1}" fill="{colour}"><title>continues beyond the axis to {}</title></polygon>"##,
                        y - 4.5,
                        y + 4.5,
                        if end.is_finite() {
                            number(end, 4)
                        } else {
                            "infinity (unbounded)".to_owned()
                        }
                    );
                }
            }
            for (i, dot) in row.dots.iter().enumerate() {
                if !dot.is_finite() {
                    continue;
                }
                // Deterministic jitter, five lanes: equal values do not hide each other.
                let jitter = ((i * 3) % 5) as f64 * 3.0 - 6.0;
                let _ = write!(
                    svg,
                    r##"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{colour}" fill-opacity="0.7"><title>{}</title></circle>"##,
                    to_x(*dot),
                    mid + jitter,
                    number(*dot, 4)
                );
            }
            if let Some(point) = row.point.filter(|p| p.is_finite()) {
                let px = to_x(point);
                let _ = write!(
                    svg,
                    r##"<line x1="{px:.1}" y1="{:.1}" x2="{px:.1}" y2="{:.1}" stroke="{colour}" stroke-width="3"><title>{}</title></line>"##,
                    mid - 10.0,
                    mid + 10.0,
                    number(point, 4)
                );
            }
            let _ = write!(
                svg,
                r##"<text x="{:.1}" y="{:.1}">{}</text></g>"##,
                plot_left + plot_width + 8.0,
                mid + 4.0,
                escape(&row.note)
            );
        }
        svg.push_str("</svg>");
        svg
    }
}
