//! Heat maps as inline SVG: one coloured cell per value, the value printed in it.

use std::fmt::Write as _;

use super::{escape, format_value};

/// A grid of values, coloured from the smallest (dark) to the largest (bright).
#[derive(Debug, Clone, PartialEq)]
pub struct HeatMap {
    pub title: String,
    pub rows: Vec<String>,
    pub columns: Vec<String>,
    /// `values[row][column]`; `None` (or a missing or non-finite value) is drawn as "n/a".
    pub values: Vec<Vec<Option<f64>>>,
    /// What the values are, with their unit (shown beside the colour scale).
    pub value_label: String,
}

/// Viridis, sampled: perceptually even and readable in grey.
const SCALE: [(u8, u8, u8); 5] = [
    (0x44, 0x01, 0x54),
    (0x3b, 0x52, 0x8b),
    (0x21, 0x91, 0x8c),
    (0x5e, 0xc9, 0x62),
    (0xfd, 0xe7, 0x25),
];
const NOT_AVAILABLE: &str = "#d9d9d9";
/// Width of one character of the 12 px labels, for layout: generous (0.6 em), so that a
/// label sized by it is never cut off.
const CHAR_WIDTH: f64 = 7.2;
/// The labels' and values' size, in px. The map is laid out to be shown at this size
/// (the page does not shrink it: it scrolls sideways instead), so no label is drawn
/// smaller than this.
pub const FONT_SIZE: f64 = 12.0;
const CELL_HEIGHT: f64 = 28.0;
const TITLE_HEIGHT: f64 = 28.0;
/// The narrowest and widest cell. Cells are as wide as their values, not as their column
/// labels (which are turned when longer): 13 scenarios of 25-character names used to make
/// a map 1 740 px wide, shrunk to about 8 px text on a laptop's page.
const MIN_CELL_WIDTH: f64 = 56.0;
const MAX_CELL_WIDTH: f64 = 120.0;
/// Cells widened for their column labels may make a grid this wide at most.
const MAX_GRID_WIDTH: f64 = 720.0;
/// Turned column labels rise at this angle: steep, so that they reach little past the
/// last column.
const TURN_DEGREES: f64 = 60.0;

impl HeatMap {
    fn value(&self, row: usize, column: usize) -> Option<f64> {
        self.values
            .get(row)
            .and_then(|r| r.get(column))
            .copied()
            .flatten()
            .filter(|v| v.is_finite())
    }

    pub fn to_svg(&self) -> String {
        let longest = |labels: &mut dyn Iterator<Item = String>| {
            labels.map(|l| l.chars().count()).max().unwrap_or(0) as f64 * CHAR_WIDTH
        };
        let row_label_width = longest(&mut self.rows.iter().cloned()) + 12.0;
        let column_label_width = longest(&mut self.columns.iter().cloned());
        let value_width = longest(
            &mut (0..self.rows.len())
                .flat_map(|r| (0..self.columns.len()).map(move |c| (r, c)))
                .map(|(r, c)| {
                    self.value(r, c)
                        .map_or_else(|| "n/a".to_owned(), format_value)
                }),
        );
        // Wide enough for its values; for its label too where the grid stays narrow
        // enough to be read at full size, the labels turned otherwise.
        let for_values = (value_width + 16.0).max(MIN_CELL_WIDTH);
        let for_labels = (column_label_width + 10.0).max(for_values);
        let cell_width = if for_labels <= MAX_CELL_WIDTH
            && for_labels * self.columns.len() as f64 <= MAX_GRID_WIDTH
        {
            for_labels
        } else {
            for_values
        };
        // Column labels wider than their cell are turned, so they never overlap.
        let turned = column_label_width + 10.0 > cell_width;
        let (sin, cos) = TURN_DEGREES.to_radians().sin_cos();
        let column_label_height = if turned {
            column_label_width * sin + 16.0
        } else {
            22.0
        };
        let grid_left = row_label_width;
        let grid_top = TITLE_HEIGHT + column_label_height;
        let grid_width = cell_width * self.columns.len() as f64;
        let grid_height = CELL_HEIGHT * self.rows.len() as f64;
        let scale_top = grid_top + grid_height + 14.0;
        // A turned label reaches past its cell to the right.
        let label_reach = if turned {
            column_label_width * cos - cell_width / 2.0
        } else {
            0.0
        };
        let width = (grid_left + grid_width + label_reach.max(0.0) + 10.0)
            .max(320.0)
            .max(self.title.chars().count() as f64 * 8.0 + 20.0);
        let height = scale_top + 40.0;

        let finite: Vec<f64> = (0..self.rows.len())
            .flat_map(|r| (0..self.columns.len()).map(move |c| (r, c)))
            .filter_map(|(r, c)| self.value(r, c))
            .collect();
        let low = finite.iter().copied().fold(f64::INFINITY, f64::min);
        let high = finite.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let position = |v: f64| {
            if high > low {
                (v - low) / (high - low)
            } else {
                0.5
            }
        };

        let mut svg = String::new();
        let _ = write!(
            svg,
            r##"<svg xmlns="http://www.w3.org/2000/svg" class="chart heat-map" viewBox="0 0 {width:.0} {height:.0}" width="{width:.0}" height="{height:.0}" role="img" aria-label="{title}" font-family="sans-serif" font-size="{FONT_SIZE}"><title>{title}</title><text x="4" y="18" font-size="14" font-weight="bold">{title}</text>"##,
            title = escape(&self.title),
        );
        for (c, label) in self.columns.iter().enumerate() {
            let x = grid_left + cell_width * (c as f64 + 0.5);
            let y = grid_top - 6.0;
            if turned {
                let _ = write!(
                    svg,
                    r##"<text transform="translate({x:.1} {y:.1}) rotate(-{TURN_DEGREES})">{}</text>"##,
                    escape(label)
                );
            } else {
                let _ = write!(
                    svg,
                    r##"<text x="{x:.1}" y="{y:.1}" text-anchor="middle">{}</text>"##,
                    escape(label)
                );
            }
        }
        for (r, label) in self.rows.iter().enumerate() {
            let y = grid_top + CELL_HEIGHT * r as f64;
            let _ = write!(
                svg,
                r##"<text x="{x:.1}" y="{ty:.1}" text-anchor="end">{}</text>"##,
                escape(label),
                x = grid_left - 6.0,
                ty = y + CELL_HEIGHT / 2.0 + 4.0,
            );
            for c in 0..self.columns.len() {
                let x = grid_left + cell_width * c as f64;
                let (fill, ink, text) = match self.value(r, c) {
                    Some(v) => {
                        let rgb = colour_at(position(v));
                        (hex(rgb), ink_for(rgb), format_value(v))
                    }
                    None => (NOT_AVAILABLE.to_owned(), "#555", "n/a".to_owned()),
                };
                let _ = write!(
                    svg,
                    r##"<rect x="{x:.1}" y="{y:.1}" width="{cell_width:.1}" height="{CELL_HEIGHT}" fill="{fill}" stroke="#fff"><title>{row} / {column}: {text}</title></rect><text x="{tx:.1}" y="{ty:.1}" text-anchor="middle" fill="{ink}">{text}</text>"##,
                    row = escape(label),
                    column = escape(&self.columns[c]),
                    tx = x + cell_width / 2.0,
                    ty = y + CELL_HEIGHT / 2.0 + 4.0,
                );
            }
        }

        // The colour scale: from the smallest value to the largest, in ten steps.
        let steps = 10;
        let bar_width = 16.0;
        for i in 0..steps {
            let _ = write!(
                svg,
                r##"<rect x="{x:.1}" y="{scale_top:.1}" width="{bar_width}" height="10" fill="{}"/>"##,
                hex(colour_at(i as f64 / (steps - 1) as f64)),
                x = grid_left + i as f64 * bar_width,
            );
        }
        let (from, to) = if finite.is_empty() {
            ("n/a".to_owned(), "n/a".to_owned())
        } else {
            (format_value(low), format_value(high))
        };
        let _ = write!(
            svg,
            r##"<text x="{left:.1}" y="{ty:.1}">{from}</text><text x="{right:.1}" y="{ty:.1}" text-anchor="end">{to}</text><text x="{label_x:.1}" y="{label_y:.1}">{label}</text></svg>"##,
            left = grid_left,
            right = grid_left + steps as f64 * bar_width,
            ty = scale_top + 24.0,
            label_x = grid_left + steps as f64 * bar_width + 10.0,
            label_y = scale_top + 9.0,
            label = escape(&self.value_label),
        );
        svg
    }
}

/// The scale's colour at `t` in 0..=1.
fn colour_at(t: f64) -> (u8, u8, u8) {
    let t = if t.is_finite() {
        t.clamp(0.0, 1.0)
    } else {
        0.5
    };
    let scaled = t * (SCALE.len() - 1) as f64;
    let i = (scaled.floor() as usize).min(SCALE.len() - 2);
    let f = scaled - i as f64;
    let mix = |a: u8, b: u8| (f64::from(a) + (f64::from(b) - f64::from(a)) * f).round() as u8;
    let (a, b) = (SCALE[i], SCALE[i + 1]);
    (mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

fn hex((r, g, b): (u8, u8, u8)) -> String {
    format!("#{r:02x}{g:02x}{b:02x}")
}

/// Black text on light cells, white on dark.
fn ink_for((r, g, b): (u8, u8, u8)) -> &'static str {
    let luminance = 0.299 * f64::from(r) + 0.587 * f64::from(g) + 0.114 * f64::from(b);
    if luminance > 140.0 { "#000" } else { "#fff" }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(values: Vec<Vec<Option<f64>>>) -> HeatMap {
        HeatMap {
            title: "tok/J by policy and scenario".into(),
            rows: vec!["static".into(), "hill-climb".into()],
            columns: vec!["steady".into(), "bursty".into()],
            values,
            value_label: "tokens per joule".into(),
        }
    }

    #[test]
    fn every_cell_shows_its_value_or_n_a() {
        let svg = map(vec![
            vec![Some(20.5), None],
            vec![Some(f64::NAN), Some(22.25)],
        ])
        .to_svg();
        assert!(
            svg.contains(">20.5</text>") && svg.contains(">22.25</text>"),
            "{svg}"
        );
        assert_eq!(svg.matches(">n/a</text>").count(), 2, "None and NaN");
        assert_eq!(svg.matches(NOT_AVAILABLE).count(), 2);
        assert!(!svg.contains("NaN"));
        // The smallest value is the scale's first colour, the largest its last.
        assert!(svg.contains(&hex(SCALE[0])) && svg.contains(&hex(SCALE[4])));
    }

    #[test]
    fn equal_values_missing_rows_and_no_values_render() {
        let equal = map(vec![vec![Some(3.0), Some(3.0)], vec![Some(3.0)]]).to_svg();
        // Three cells, and both ends of the colour scale.
        assert_eq!(equal.matches(">3</text>").count(), 3 + 2, "{equal}");
        assert!(equal.contains(">n/a</text>"), "the missing cell");
        let empty = map(vec![]).to_svg();
        assert_eq!(
            empty.matches(">n/a</text>").count(),
            4 + 2,
            "cells and scale ends"
        );
        assert!(empty.ends_with("</svg>"));
    }

    #[test]
    fn labels_are_escaped() {
        let mut m = map(vec![vec![Some(1.0), Some(2.0)]]);
        m.rows[0] = "<script>alert(1)</script>".into();
        m.columns[1] = "a&b".into();
        m.title = "\"t\"".into();
        let svg = m.to_svg();
        assert!(!svg.contains("<script>"), "{svg}");
        assert!(svg.contains("&lt;script&gt;") && svg.contains("a&amp;b"));
        assert!(svg.contains("&quot;t&quot;"));
    }

    /// The width an SVG declares.
    fn declared_width(svg: &str) -> f64 {
        let rest = svg.split(" width=\"").nth(1).expect("a width");
        rest[..rest.find('"').expect("quote")]
            .parse()
            .expect("a number")
    }

    #[test]
    fn thirteen_long_scenario_names_fit_a_page_at_full_size() {
        // The judging set: 13 scenarios, the longest 25 characters, ten policies.
        let columns: Vec<String> = (0..13)
            .map(|i| format!("h200-custom-shape-lat-{i:03}"))
            .collect();
        let rows: Vec<String> = (0..10).map(|i| format!("cap-and-batch-{i}")).collect();
        let values = rows
            .iter()
            .map(|_| columns.iter().map(|_| Some(0.976)).collect())
            .collect();
        let map = HeatMap {
            title: "tokens per joule over the oracle's".into(),
            rows,
            columns,
            values,
            value_label: "ratio".into(),
        };
        let svg = map.to_svg();
        // Shown at full size (the page does not shrink a heat map), the labels are 12 px;
        // and the map fits a laptop's page (main is 1 292 px at most) without scrolling.
        assert!(svg.contains(&format!("font-size=\"{FONT_SIZE}\"")), "{svg}");
        const { assert!(FONT_SIZE >= 11.0) };
        assert!(!svg.contains("font-size=\"8") && !svg.contains("font-size=\"9"));
        let width = declared_width(&svg);
        assert!(width <= 1200.0, "{width} px wide");
        // The long column labels are turned, and every value still fits its cell.
        assert!(svg.contains("rotate(-60)"), "{svg}");
        assert_eq!(
            svg.matches(">0.976</text>").count(),
            130 + 2,
            "cells and scale ends"
        );
        // A few short columns keep their labels level.
        let mut small = map.clone();
        small.columns = vec!["steady".into(), "bursty".into()];
        small.values = vec![vec![Some(1.0), Some(2.0)]; small.rows.len()];
        assert!(!small.to_svg().contains("rotate("));
    }

    #[test]
    fn ink_contrasts_with_the_cell() {
        assert_eq!(ink_for(SCALE[0]), "#fff");
        assert_eq!(ink_for(SCALE[4]), "#000");
    }
}
