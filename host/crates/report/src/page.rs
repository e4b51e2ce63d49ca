//! A self-contained HTML5 page: inline CSS, inline SVG, nothing fetched, every piece of
//! text escaped.

use std::fmt::Write as _;

use super::escape;

/// An HTML report, built top to bottom.
#[derive(Debug, Clone)]
pub struct Page {
    title: String,
    blocks: Vec<Block>,
}

#[derive(Debug, Clone)]
enum Block {
    Heading(String),
    Paragraph(String),
    Notice(String),
    Table {
        header: Vec<String>,
        rows: Vec<Vec<String>>,
    },
    Svg(String),
}

/// A heat map is never shrunk to the page (its labels would fall below a readable size):
/// a wider one scrolls sideways instead.
const STYLE: &str = "\
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;color:#222;background:#fafafa}\
main{max-width:1340px;margin:0 auto;padding:16px 24px 48px}\
h1{font-size:1.5em;margin:0.6em 0}\
h2{font-size:1.2em;margin:1.6em 0 0.5em;padding-top:0.4em;border-top:1px solid #ddd}\
p{max-width:60em;line-height:1.45}\
.notice{background:#fff4d6;border-left:4px solid #e69f00;padding:8px 12px}\
table{border-collapse:collapse;margin:0.5em 0;background:#fff}\
th,td{border:1px solid #ddd;padding:4px 10px;text-align:left;vertical-align:top}\
th{background:#f0f0f0}\
td.number{text-align:right;font-variant-numeric:tabular-nums}\
.charts{display:flex;flex-wrap:wrap;gap:12px;overflow-x:auto}\
.charts svg{background:#fff;border:1px solid #e2e2e2;max-width:100%;height:auto}\
.charts svg.heat-map{max-width:none;flex:none}";

impl Page {
    pub fn new(title: &str) -> Page {
        Page {
            title: title.to_owned(),
            blocks: Vec::new(),
        }
    }

    pub fn heading(&mut self, text: &str) {
        self.blocks.push(Block::Heading(text.to_owned()));
    }

    pub fn paragraph(&mut self, text: &str) {
        self.blocks.push(Block::Paragraph(text.to_owned()));
    }

    /// A paragraph that stands out: what a reader must not miss (simulator output).
    pub fn notice(&mut self, text: &str) {
        self.blocks.push(Block::Notice(text.to_owned()));
    }

    /// A table; columns of numbers are right-aligned.
    pub fn table(&mut self, header: &[&str], rows: &[Vec<String>]) {
        self.blocks.push(Block::Table {
            header: header.iter().map(|h| (*h).to_owned()).collect(),
            rows: rows.to_vec(),
        });
    }

    /// A chart from this module ([`super::LineChart::to_svg`], [`super::HeatMap::to_svg`]).
    /// Charts in a row flow side by side. Anything that is not an `<svg>` element is shown
    /// as text, never as markup.
    pub fn svg(&mut self, svg: String) {
        let trimmed = svg.trim();
        if trimmed.starts_with("<svg") && trimmed.ends_with("</svg>") {
            self.blocks.push(Block::Svg(svg));
        } else {
            self.blocks.push(Block::Paragraph(svg));
        }
    }

    /// The complete HTML5 document.
    pub fn finish(self) -> String {
        let mut html = String::new();
        let title = escape(&self.title);
        let _ = write!(
            html,
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
             <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
             <title>{title}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<main>\n<h1>{title}</h1>\n"
        );
        let mut in_charts = false;
        for block in &self.blocks {
            let is_svg = matches!(block, Block::Svg(_));
            if is_svg && !in_charts {
                html.push_str("<div class=\"charts\">\n");
            } else if !is_svg && in_charts {
                html.push_str("</div>\n");
            }
            in_charts = is_svg;
            match block {
                Block::Heading(text) => {
                    let _ = writeln!(html, "<h2>{}</h2>", escape(text));
                }
                Block::Paragraph(text) => {
                    let _ = writeln!(html, "<p>{}</p>", escape(text));
                }
                Block::Notice(text) => {
                    let _ = writeln!(html, "<p class=\"notice\">{}</p>", escape(text));
                }
                Block::Table { header, rows } => {
                    html.push_str("<table>\n<thead><tr>");
                    for h in header {
                        let _ = write!(html, "<th>{}</th>", escape(h));
                    }
                    html.push_str("</tr></thead>\n<tbody>\n");
                    // A column of numbers is right-aligned; a mixed one is not.
                    let numeric: Vec<bool> = (0..rows.iter().map(Vec::len).max().unwrap_or(0))
                        .map(|c| {
                            rows.iter()
                                .filter_map(|r| r.get(c))
                                .all(|cell| looks_numeric(cell))
                        })
                        .collect();
                    for row in rows {
                        html.push_str("<tr>");
                        for (cell, numeric) in row.iter().zip(&numeric) {
                            let class = if *numeric { " class=\"number\"" } else { "" };
                            let _ = write!(html, "<td{class}>{}</td>", escape(cell));
                        }
                        html.push_str("</tr>\n");
                    }
                    html.push_str("</tbody>\n</table>\n");
                }
                Block::Svg(svg) => {
                    html.push_str(svg);
                    html.push('\n');
                }
            }
        }
        if in_charts {
            html.push_str("</div>\n");
        }
        html.push_str("</main>\n</body>\n</html>\n");
        html
    }
}

/// A number, perhaps with a unit after it ("20.86", "622371 J", "0 ticks").
fn looks_numeric(cell: &str) -> bool {
    let first = cell.split_whitespace().next().unwrap_or("");
    !first.is_empty() && first.trim_end_matches('%').parse::<f64>().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LineChart, Series};

    #[test]
    fn a_page_is_a_complete_document_with_everything_escaped() {
        let mut page = Page::new("report <script>alert(1)</script>");
        page.heading("GPU <0>");
        page.paragraph("a & b");
        page.table(
            &["key", "<value>"],
            &[vec!["policy".into(), "<script>x</script>".into()]],
        );
        page.svg(LineChart::new("<chart>", "x", "y").to_svg());
        page.svg("<img src=x onerror=alert(1)>".into());
        let html = page.finish();
        assert!(html.starts_with("<!DOCTYPE html>"));
        assert!(html.trim_end().ends_with("</html>"));
        assert!(
            !html.contains("<script>") && !html.contains("<img"),
            "{html}"
        );
        assert!(html.contains("<title>report &lt;script&gt;alert(1)&lt;/script&gt;</title>"));
        assert!(html.contains("<h2>GPU &lt;0&gt;</h2>") && html.contains("<p>a &amp; b</p>"));
        assert!(html.contains("<th>&lt;value&gt;</th>"));
        assert!(html.contains("&lt;chart&gt;"));
        // Self-contained: nothing is loaded from elsewhere.
        for outside in ["src=\"", "href=", "<link", "@import", "url("] {
            assert!(!html.contains(outside), "{outside}");
        }
    }

    #[test]
    fn consecutive_charts_share_one_row_of_charts() {
        let mut page = Page::new("t");
        let chart = LineChart {
            series: vec![Series::new("s", vec![(0.0, 1.0), (1.0, 2.0)])],
            ..LineChart::new("c", "x", "y")
        };
        page.heading("one");
        page.svg(chart.to_svg());
        page.svg(chart.to_svg());
        page.heading("two");
        page.svg(chart.to_svg());
        let html = page.finish();
        assert_eq!(html.matches("<div class=\"charts\">").count(), 2);
        assert_eq!(html.matches("</div>").count(), 2);
        assert_eq!(html.matches("<svg").count(), 3);
    }

    #[test]
    fn columns_of_numbers_are_right_aligned() {
        let mut page = Page::new("t");
        page.table(
            &["what", "value", "count"],
            &[
                vec!["a".into(), "1 J".into(), "3".into()],
                vec!["b".into(), "policy".into(), "4".into()],
            ],
        );
        let html = page.finish();
        assert!(html.contains("<td>1 J</td>") && html.contains("<td class=\"number\">3</td>"));
        assert!(html.contains("<td class=\"number\">4</td>") && html.contains("<td>a</td>"));
    }

    #[test]
    fn numbers_are_recognised() {
        assert!(looks_numeric("20.86") && looks_numeric("622371 J") && looks_numeric("99.5%"));
        assert!(!looks_numeric("hill-climb") && !looks_numeric(""));
    }
}
