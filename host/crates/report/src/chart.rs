//! Line charts as inline SVG: nice axis ticks, a legend, distinct colours, gaps where a
//! value is not a number, and long series reduced to a bounded number of points.

use std::fmt::Write as _;

use super::{escape, format_number};

/// One line of a chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    /// `(x, y)` in drawing order (increasing `x`); a non-finite `y` breaks the line.
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed: limits and reference lines.
    pub dashed: bool,
    /// One line of many of a kind (each trajectory of an A/B arm): drawn in the colour of
    /// the series at this index, thinner, with no legend entry of its own.
    pub same_as: Option<usize>,
}

impl Series {
    pub fn new(name: &str, points: Vec<(f64, f64)>) -> Self {
        Self {
            name: name.to_owned(),
            points,
            dashed: false,
            same_as: None,
        }
    }

    /// One of many lines of the kind of series `index`: its colour, no legend entry.
    pub fn like(index: usize, name: &str, points: Vec<(f64, f64)>) -> Self {
        Self {
            same_as: Some(index),
            ..Self::new(name, points)
        }
    }

    /// The palette index it is drawn in, given its own index.
    fn colour_index(&self, own: usize) -> usize {
        self.same_as.unwrap_or(own)
    }

    /// A dashed line.
    pub fn dashed(name: &str, points: Vec<(f64, f64)>) -> Self {
        Self {
            dashed: true,
            ..Self::new(name, points)
        }
    }
}

/// A chart of one or more series over a shared x axis.
#[derive(Debug, Clone, PartialEq)]
pub struct LineChart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

/// Distinct colours, told apart also by people with the common colour-vision
/// deficiencies (Okabe–Ito, with black last); the tenth series starts again.
const PALETTE: [&str; 8] = [
    "#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#7f6a00", "#000000",
];

const WIDTH: f64 = 640.0;
const MARGIN_LEFT: f64 = 64.0;
const MARGIN_RIGHT: f64 = 18.0;
const TITLE_HEIGHT: f64 = 26.0;
const LEGEND_ROW: f64 = 18.0;
const PLOT_HEIGHT: f64 = 200.0;
const MARGIN_BOTTOM: f64 = 44.0;
/// Approximate width of one character of the 12 px sans-serif text, for layout.
const CHAR_WIDTH: f64 = 6.6;
const TARGET_TICKS: usize = 5;

/// Points kept per series: two (its lowest and highest) per bucket of two pixels, so a
/// week of 1 s ticks draws no more than a minute of them.
pub const MAX_BUCKETS: usize = ((WIDTH - MARGIN_LEFT - MARGIN_RIGHT) / 2.0) as usize;

impl LineChart {
    pub fn new(title: &str, x_label: &str, y_label: &str) -> Self {
        Self {
            title: title.to_owned(),
            x_label: x_label.to_owned(),
            y_label: y_label.to_owned(),
            series: Vec::new(),
        }
    }

    pub fn to_svg(&self) -> String {
        let series: Vec<Vec<(f64, f64)>> = self
            .series
            .iter()
            .map(|s| downsample(&s.points, MAX_BUCKETS))
            .collect();
        let legend = legend_layout(&self.series);
        // A series drawn like another has no legend entry.
        let plot_top = TITLE_HEIGHT + legend.rows as f64 * LEGEND_ROW + 6.0;
        let height = plot_top + PLOT_HEIGHT + MARGIN_BOTTOM;
        let plot = Rect {
            left: MARGIN_LEFT,
            top: plot_top,
            width: WIDTH - MARGIN_LEFT - MARGIN_RIGHT,
            height: PLOT_HEIGHT,
        };

        let mut svg = String::new();
        let _ = write!(
            svg,
            r##"<svg xmlns="http://www.w3.org/2000/svg" class="chart line-chart" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" role="img" aria-label="{title}" font-family="sans-serif" font-size="12"><title>{title}</title><text x="{x}" y="17" font-size="14" font-weight="bold">{title}</text>"##,
            title = escape(&self.title),
            x = MARGIN_LEFT,
        );
        for (i, s) in self.series.iter().enumerate() {
            let Some(&(x, y)) = legend.positions.get(i).and_then(Option::as_ref) else {
                continue;
            };
            let _ = write!(
                svg,
                r##"<line x1="{x}" y1="{ly}" x2="{x2}" y2="{ly}" stroke="{colour}" stroke-width="2"{dash}/><text x="{tx}" y="{ty}">{name}</text>"##,
                ly = TITLE_HEIGHT + y + 9.0,
                x2 = x + 20.0,
                colour = colour(s.colour_index(i)),
                dash = dash_attr(s.dashed),
                tx = x + 25.0,
                ty = TITLE_HEIGHT + y + 13.0,
                name = escape(&s.name),
            );
        }

        let finite = || series.iter().flatten().filter(|(_, y)| y.is_finite());
        let x_range = range(finite().map(|p| p.0));
        let y_range = range(finite().map(|p| p.1));
        let _ = write!(
            svg,
            r##"<rect x="{}" y="{}" width="{}" height="{}" fill="#fff" stroke="#bbb"/>"##,
            plot.left, plot.top, plot.width, plot.height
        );
        let (Some(x_range), Some(y_range)) = (x_range, y_range) else {
            let _ = write!(
                svg,
                r##"<text x="{}" y="{}" text-anchor="middle" fill="#777">no data</text></svg>"##,
                plot.left + plot.width / 2.0,
                plot.top + plot.height / 2.0
            );
            return svg;
        };
        let x_axis = Axis::nice(x_range);
        let y_axis = Axis::nice(y_range);
        let to_px = |(x, y): (f64, f64)| {
            (
                plot.left + x_axis.fraction(x) * plot.width,
                plot.top + (1.0 - y_axis.fraction(y)) * plot.height,
            )
        };

        // Grid and tick labels.
        for (value, label) in y_axis.labelled_ticks() {
            let (_, py) = to_px((x_axis.lo, value));
            let _ = write!(
                svg,
                r##"<line x1="{l}" y1="{py:.1}" x2="{r}" y2="{py:.1}" stroke="#e6e6e6"/><text x="{tx}" y="{ty:.1}" text-anchor="end">{label}</text>"##,
                l = plot.left,
                r = plot.left + plot.width,
                tx = plot.left - 6.0,
                ty = py + 4.0,
            );
        }
        for (value, label) in x_axis.labelled_ticks() {
            let (px, _) = to_px((value, y_axis.lo));
            let _ = write!(
                svg,
                r##"<line x1="{px:.1}" y1="{t}" x2="{px:.1}" y2="{b}" stroke="#e6e6e6"/><text x="{px:.1}" y="{ty}" text-anchor="middle">{label}</text>"##,
                t = plot.top,
                b = plot.top + plot.height,
                ty = plot.top + plot.height + 16.0,
            );
        }
        let _ = write!(
            svg,
            r##"<text x="{x}" y="{y}" text-anchor="middle">{label}</text><text transform="translate(14 {ym}) rotate(-90)" text-anchor="middle">{ylabel}</text>"##,
            x = plot.left + plot.width / 2.0,
            y = plot.top + plot.height + 36.0,
            label = escape(&self.x_label),
            ym = plot.top + plot.height / 2.0,
            ylabel = escape(&self.y_label),
        );

        // The lines: a gap at every non-finite value; a point with no neighbour is a dot.
        for (i, (s, points)) in self.series.iter().zip(&series).enumerate() {
            let mut path = String::new();
            let mut dots = Vec::new();
            for segment in points.split(|(_, y)| !y.is_finite()) {
                match segment {
                    [] => {}
                    [only] => dots.push(to_px(*only)),
                    [first, rest @ ..] => {
                        let (x, y) = to_px(*first);
                        let _ = write!(path, "M{x:.1} {y:.1}");
                        for p in rest {
                            let (x, y) = to_px(*p);
                            let _ = write!(path, "L{x:.1} {y:.1}");
                        }
                    }
                }
            }
            let _ = write!(svg, "<g><title>{}</title>", escape(&s.name));
            if !path.is_empty() {
                let _ = write!(
                    svg,
                    r##"<path d="{path}" fill="none" stroke="{}" stroke-width="{}" stroke-linejoin="round"{}/>"##,
                    colour(s.colour_index(i)),
                    // Limits are drawn over the data, thicker, to stay visible in a dense
                    // line; one line of many, thinner.
                    if s.dashed {
                        2.2
                    } else if s.same_as.is_some() {
                        0.8
                    } else {
                        1.3
                    },
                    dash_attr(s.dashed)
                );
            }
            for (x, y) in dots {
                let _ = write!(
                    svg,
                    r##"<circle cx="{x:.1}" cy="{y:.1}" r="2.5" fill="{}"/>"##,
                    colour(s.colour_index(i))
                );
            }
            svg.push_str("</g>");
        }
        svg.push_str("</svg>");
        svg
    }
}

fn colour(index: usize) -> &'static str {
    PALETTE[index % PALETTE.len()]
}

fn dash_attr(dashed: bool) -> &'static str {
    if dashed {
        r#" stroke-dasharray="6 4""#
    } else {
        ""
    }
}

#[derive(Debug, Clone, Copy)]
struct Rect {
    left: f64,
    top: f64,
    width: f64,
    height: f64,
}

struct Legend {
    rows: usize,
    /// Each series' entry's offset from the legend's top left (`None`: no entry).
    positions: Vec<Option<(f64, f64)>>,
}

/// Legend entries flow left to right and wrap to the chart's width.
fn legend_layout(series: &[Series]) -> Legend {
    let mut positions = Vec::with_capacity(series.len());
    let (mut x, mut row) = (MARGIN_LEFT, 0usize);
    let mut entries = 0;
    for s in series {
        if s.same_as.is_some() {
            positions.push(None);
            continue;
        }
        entries += 1;
        let width = 25.0 + s.name.chars().count() as f64 * CHAR_WIDTH + 16.0;
        if x > MARGIN_LEFT && x + width > WIDTH - MARGIN_RIGHT {
            x = MARGIN_LEFT;
            row += 1;
        }
        positions.push(Some((x, row as f64 * LEGEND_ROW)));
        x += width;
    }
    Legend {
        rows: if entries == 0 { 0 } else { row + 1 },
        positions,
    }
}

/// The smallest and largest finite value, if any.
fn range(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values
        .filter(|v| v.is_finite())
        .fold(None, |acc, v| match acc {
            None => Some((v, v)),
            Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
        })
}

/// An axis from `lo` to `hi` in steps of a "nice" size (1, 2 or 5 times a power of ten):
/// the one axis of every chart tokwatt draws (line charts here, the A/B strip plots).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Axis {
    pub lo: f64,
    pub hi: f64,
    step: f64,
}

impl Axis {
    /// An axis just covering `(min, max)`; a flat range gets a tenth of its size (one
    /// unit around zero) on each side.
    pub fn nice((min, max): (f64, f64)) -> Self {
        Self::spanning(min, max, 0.0, 0.1)
    }

    /// An axis a twentieth wider than `(min, max)` on each side, so that no mark sits on
    /// the frame; a flat range gets a hundredth of its size (one unit around zero).
    pub fn padded((min, max): (f64, f64)) -> Self {
        Self::spanning(min, max, 0.05, 0.01)
    }

    fn spanning(min: f64, max: f64, pad: f64, flat_fraction: f64) -> Self {
        let span = max - min;
        let (min, max) = if span > f64::EPSILON * max.abs().max(1.0) {
            (min - span * pad, max + span * pad)
        } else {
            let half = if min == 0.0 {
                1.0
            } else {
                min.abs() * flat_fraction
            };
            (min - half, max + half)
        };
        // Divided before subtracting, so that even the widest finite range cannot overflow.
        let step = nice_step(max / TARGET_TICKS as f64 - min / TARGET_TICKS as f64);
        Self {
            lo: (min / step).floor() * step,
            hi: (max / step).ceil() * step,
            step,
        }
    }

    pub fn fraction(&self, value: f64) -> f64 {
        (value - self.lo) / (self.hi - self.lo)
    }

    /// Each tick and its label, the labels sharing one scale suffix (k, M, G).
    pub fn labelled_ticks(&self) -> Vec<(f64, String)> {
        let count = (self.hi / self.step - self.lo / self.step)
            .round()
            .clamp(0.0, 50.0) as usize;
        let largest = self.lo.abs().max(self.hi.abs());
        let (scale, suffix) = match largest {
            l if l >= 1e10 => (1e9, "G"),
            l if l >= 1e7 => (1e6, "M"),
            l if l >= 1e4 => (1e3, "k"),
            _ => (1.0, ""),
        };
        let decimals = (-(self.step / scale).log10().floor()).clamp(0.0, 9.0) as usize;
        (0..=count)
            .map(|i| {
                let value = self.lo + i as f64 * self.step;
                let label = format_number(value / scale, decimals);
                if label.trim_start_matches(['0', '.']).is_empty() {
                    (value, "0".to_owned())
                } else {
                    (value, format!("{label}{suffix}"))
                }
            })
            .collect()
    }
}

/// The nice step nearest above `raw`.
fn nice_step(raw: f64) -> f64 {
    let raw = if raw.is_finite() && raw > 0.0 {
        raw
    } else {
        1.0
    };
    let magnitude = 10f64.powf(raw.log10().floor());
    let fraction = raw / magnitude;
    let nice = match fraction {
        f if f <= 1.0 => 1.0,
        f if f <= 2.0 => 2.0,
        f if f <= 5.0 => 5.0,
        _ => 10.0,
    };
    nice * magnitude
}

/// Reduces a series to at most about `2 * buckets` points (plus gap markers) by keeping,
/// in each of `buckets` equal slices of the x range, the lowest and the highest point in
/// their order: the line drawn at a chart's resolution looks the same, peaks included.
/// A non-finite `y` in a slice is kept as one gap marker after that slice's points;
/// points with a non-finite `x` cannot be placed and are dropped.
pub fn downsample(points: &[(f64, f64)], buckets: usize) -> Vec<(f64, f64)> {
    let placed = || points.iter().copied().filter(|(x, _)| x.is_finite());
    if points.len() <= 2 * buckets.max(1) {
        return placed().collect();
    }
    let Some(x_range) = range(placed().map(|p| p.0)) else {
        return Vec::new();
    };
    let mut sampler = Downsampler::new(x_range, buckets);
    for (x, y) in placed() {
        sampler.push(x, y);
    }
    sampler.finish()
}

/// [`downsample`] one point at a time, for series too long to hold: the x range must be
/// known beforehand (a point outside it falls into the first or last slice).
#[derive(Debug, Clone)]
pub struct Downsampler {
    x_min: f64,
    x_span: f64,
    buckets: usize,
    current: Option<Bucket>,
    out: Vec<(f64, f64)>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    index: usize,
    low: Option<(usize, f64, f64)>,
    high: Option<(usize, f64, f64)>,
    gap: bool,
    seen: usize,
}

impl Downsampler {
    pub fn new((x_min, x_max): (f64, f64), buckets: usize) -> Self {
        Self {
            x_min,
            x_span: (x_max - x_min).max(0.0),
            buckets: buckets.max(1),
            current: None,
            out: Vec::new(),
        }
    }

    pub fn push(&mut self, x: f64, y: f64) {
        if !x.is_finite() {
            return;
        }
        let index = if self.x_span > 0.0 {
            let slot = ((x - self.x_min) / self.x_span * self.buckets as f64).floor();
            slot.clamp(0.0, (self.buckets - 1) as f64) as usize
        } else {
            0
        };
        if self.current.is_some_and(|b| b.index != index) {
            self.flush();
        }
        let bucket = self.current.get_or_insert(Bucket {
            index,
            low: None,
            high: None,
            gap: false,
            seen: 0,
        });
        let order = bucket.seen;
        bucket.seen += 1;
        if !y.is_finite() {
            bucket.gap = true;
            return;
        }
        if bucket.low.is_none_or(|(_, _, low)| y < low) {
            bucket.low = Some((order, x, y));
        }
        if bucket.high.is_none_or(|(_, _, high)| y > high) {
            bucket.high = Some((order, x, y));
        }
    }

    fn flush(&mut self) {
        let Some(bucket) = self.current.take() else {
            return;
        };
        match (bucket.low, bucket.high) {
            (Some(low), Some(high)) if low.0 != high.0 => {
                let (first, second) = if low.0 < high.0 {
                    (low, high)
                } else {
                    (high, low)
                };
                self.out.push((first.1, first.2));
                self.out.push((second.1, second.2));
            }
            (Some(only), _) => self.out.push((only.1, only.2)),
            _ => {}
        }
        if bucket.gap {
            let x = self.out.last().map_or(self.x_min, |p| p.0);
            self.out.push((x, f64::NAN));
        }
    }

    pub fn finish(mut self) -> Vec<(f64, f64)> {
        self.flush();
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(series: Vec<Series>) -> String {
        LineChart {
            title: "t".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            series,
        }
        .to_svg()
    }

    #[test]
    fn an_empty_chart_says_no_data() {
        for series in [
            vec![],
            vec![Series::new("empty", vec![])],
            vec![Series::new("nan", vec![(0.0, f64::NAN), (1.0, f64::NAN)])],
        ] {
            let svg = chart(series);
            assert!(svg.contains("no data"), "{svg}");
            assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
        }
    }

    #[test]
    fn one_point_is_drawn_as_a_dot_with_finite_ticks() {
        let svg = chart(vec![Series::new("one", vec![(5.0, 3.0)])]);
        assert!(svg.contains("<circle"), "{svg}");
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        assert!(!svg.contains("no data"));
    }

    #[test]
    fn equal_min_and_max_get_a_range_around_the_value() {
        let axis = Axis::nice((700.0, 700.0));
        assert!(axis.lo < 700.0 && axis.hi > 700.0, "{axis:?}");
        let axis = Axis::nice((0.0, 0.0));
        assert!(axis.lo < 0.0 && axis.hi > 0.0, "{axis:?}");
        let svg = chart(vec![Series::new("flat", vec![(0.0, 700.0), (10.0, 700.0)])]);
        assert!(svg.contains("<path") && !svg.contains("NaN"), "{svg}");
    }

    #[test]
    fn nan_breaks_the_line() {
        let svg = chart(vec![Series::new(
            "gappy",
            vec![
                (0.0, 1.0),
                (1.0, 2.0),
                (2.0, f64::NAN),
                (3.0, 2.0),
                (4.0, 3.0),
            ],
        )]);
        let path = svg.split("<path d=\"").nth(1).expect("a path");
        let d = &path[..path.find('"').expect("closing quote")];
        assert_eq!(d.matches('M').count(), 2, "{d}");
        assert!(!svg.contains("NaN"));
    }

    #[test]
    fn text_is_escaped() {
        let svg = LineChart {
            title: "<script>alert(1)</script>".into(),
            x_label: "a & b".into(),
            y_label: "\"quoted\"".into(),
            series: vec![Series::new("<b>", vec![(0.0, 1.0), (1.0, 2.0)])],
        }
        .to_svg();
        assert!(!svg.contains("<script>") && !svg.contains("<b>"), "{svg}");
        assert!(svg.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
        assert!(svg.contains("a &amp; b") && svg.contains("&quot;quoted&quot;"));
    }

    #[test]
    fn ticks_are_nice_and_cover_the_data() {
        let axis = Axis::nice((3.2, 97.0));
        assert_eq!((axis.lo, axis.hi, axis.step), (0.0, 100.0, 20.0));
        let labels: Vec<String> = axis.labelled_ticks().into_iter().map(|t| t.1).collect();
        assert_eq!(labels, ["0", "20", "40", "60", "80", "100"]);
        let labels: Vec<String> = Axis::nice((0.0, 604_800.0))
            .labelled_ticks()
            .into_iter()
            .map(|t| t.1)
            .collect();
        assert_eq!(
            labels.last().map(String::as_str),
            Some("800k"),
            "{labels:?}"
        );
        let small = Axis::nice((0.11, 0.14));
        assert!(
            small
                .labelled_ticks()
                .iter()
                .all(|t| t.1.starts_with("0.1"))
        );
    }

    #[test]
    fn series_get_distinct_colours_and_a_legend_entry() {
        let series: Vec<Series> = (0..PALETTE.len())
            .map(|i| Series::new(&format!("series {i}"), vec![(0.0, i as f64), (1.0, 1.0)]))
            .collect();
        let svg = chart(series);
        for (i, c) in PALETTE.iter().enumerate() {
            assert!(svg.contains(&format!("stroke=\"{c}\"")), "{c}");
            assert!(svg.contains(&format!(">series {i}</text>")));
        }
    }

    #[test]
    fn downsampling_keeps_the_min_and_max_and_bounds_the_points() {
        // A week of 1 s ticks with one spike and one dip.
        let n = 7 * 24 * 3600;
        let mut points: Vec<(f64, f64)> = (0..n)
            .map(|i| (i as f64, 300.0 + (i as f64 * 0.01).sin() * 50.0))
            .collect();
        points[123_457].1 = 900.0;
        points[400_001].1 = -5.0;
        let reduced = downsample(&points, 100);
        assert!(reduced.len() <= 200, "{}", reduced.len());
        assert!(reduced.contains(&(123_457.0, 900.0)));
        assert!(reduced.contains(&(400_001.0, -5.0)));
        assert!(reduced.windows(2).all(|w| w[0].0 <= w[1].0), "x order kept");
        // Every bucket keeps its own extremes too.
        let bucket = n / 100;
        for b in 0..100 {
            let slice = &points[b * bucket..(b + 1) * bucket];
            let top = slice.iter().map(|p| p.1).fold(f64::MIN, f64::max);
            assert!(reduced.iter().any(|p| p.1 == top), "bucket {b}");
        }
    }

    #[test]
    fn downsampling_keeps_gaps_and_short_series() {
        let short = vec![(0.0, 1.0), (1.0, f64::NAN), (f64::NAN, 2.0)];
        assert_eq!(downsample(&short, 10).len(), 2);
        let mut long: Vec<(f64, f64)> = (0..1000).map(|i| (i as f64, 1.0)).collect();
        long[500].1 = f64::NAN;
        let reduced = downsample(&long, 10);
        assert_eq!(reduced.iter().filter(|p| p.1.is_nan()).count(), 1);
        assert!(reduced.len() <= 21);
    }

    #[test]
    fn long_series_draw_a_bounded_number_of_points() {
        let points: Vec<(f64, f64)> = (0..100_000).map(|i| (i as f64, (i % 7) as f64)).collect();
        let svg = chart(vec![Series::new("long", points)]);
        let segments = svg.matches('L').count();
        assert!(segments <= 2 * MAX_BUCKETS, "{segments}");
    }
}
