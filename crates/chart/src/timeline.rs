//! Gantt charts: what each pipeline worker does over time.

use crate::style::{self, draw_legend, format_tick, legend_width, Color, ColorMap};
use crate::style::{LABEL_PX, TICK_PX, TITLE_PX};
use crate::{axis_range, drawable, render_png, ChartError, Size};
use plotters::prelude::*;
// The trait behind .filled() / .stroke_width(); our own `Color` struct keeps the name.
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::Color as _;
use std::path::Path;

/// Something a row was busy with from `start_s` to `end_s` (seconds).
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    pub start_s: f64,
    pub end_s: f64,
    /// Colour and legend entry, e.g. "forward", "backward", "send", "idle".
    pub category: String,
    /// Written inside the span when it fits, e.g. the micro-batch number.
    pub label: Option<String>,
}

/// One lane of the chart, e.g. one pipeline stage.
#[derive(Clone, Debug, PartialEq)]
pub struct TimelineRow {
    pub label: String,
    pub spans: Vec<Span>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timeline {
    pub title: String,
    /// Top to bottom.
    pub rows: Vec<TimelineRow>,
    /// Fixed colours for some categories (e.g. idle in [`Color::IDLE_GREY`]); the others take
    /// the palette in order of appearance.
    pub category_colors: Vec<(String, Color)>,
    pub size: Size,
}

/// Seconds are rarely the readable unit for a pipeline step: pick s, ms or µs by the extent.
fn time_unit(extent_s: f64) -> (&'static str, f64) {
    if extent_s >= 1.0 {
        ("s", 1.0)
    } else if extent_s >= 1e-3 {
        ("ms", 1e3)
    } else {
        ("µs", 1e6)
    }
}

/// Fraction of a row's height left blank above and below its spans.
const ROW_PAD: f64 = 0.12;

/// Draw one lane per row, each span a box coloured by category, with a legend on the right.
pub fn timeline(path: &Path, chart: &Timeline) -> Result<(), ChartError> {
    let (t0, t1) = validate(chart)?;
    let (unit, scale) = time_unit(t1 - t0);
    let (x0, x1) = axis_range(t0 * scale, t1 * scale, 0.0);
    let mut colors = ColorMap::new(&chart.category_colors);
    let mut categories: Vec<(String, Color)> = Vec::new();
    for span in chart.rows.iter().flat_map(|r| &r.spans) {
        if !categories.iter().any(|(n, _)| *n == span.category) {
            categories.push((span.category.clone(), colors.color(&span.category)));
        }
    }
    let rows = chart.rows.len();

    render_png(path, chart.size, |root| {
        let body = if chart.title.is_empty() {
            root.clone()
        } else {
            root.titled(&chart.title, style::font(TITLE_PX))?
        };
        let names: Vec<&str> = categories.iter().map(|(n, _)| n.as_str()).collect();
        let legend_w = legend_width(root, &names)? + 12;
        let mut label_w = 0;
        for row in &chart.rows {
            label_w = label_w.max(
                root.estimate_text_size(&row.label, &style::font(LABEL_PX))?
                    .0,
            );
        }
        let mut ctx = ChartBuilder::on(&body)
            .margin(12)
            .margin_right(12 + legend_w)
            .x_label_area_size(52)
            .y_label_area_size(label_w + 16)
            .build_cartesian_2d(x0..x1, 0.0..rows as f64)?;
        ctx.configure_mesh()
            .disable_y_mesh()
            .y_labels(0)
            .max_light_lines(1)
            .light_line_style(RGBColor(240, 240, 240))
            .bold_line_style(RGBColor(215, 215, 215))
            .x_desc(format!("time ({unit})"))
            .axis_desc_style(style::font(LABEL_PX))
            .label_style(style::font(TICK_PX))
            .x_label_formatter(&|v| format_tick(*v))
            .draw()?;

        let label_style = style::font(TICK_PX);
        for (i, row) in chart.rows.iter().enumerate() {
            // Row 0 on top: lane i spans y in [rows-1-i, rows-i].
            let (lo, hi) = ((rows - 1 - i) as f64 + ROW_PAD, (rows - i) as f64 - ROW_PAD);
            let (plot_left, centre) = ctx.backend_coord(&(x0, (lo + hi) / 2.0));
            root.draw_text(
                &row.label,
                &style::font(LABEL_PX).pos(Pos::new(HPos::Right, VPos::Center)),
                (plot_left - 8, centre),
            )?;
            for span in &row.spans {
                let color = categories
                    .iter()
                    .find(|(n, _)| *n == span.category)
                    .map_or(Color(0, 0, 0), |(_, c)| *c);
                let corners = [(span.start_s * scale, lo), (span.end_s * scale, hi)];
                ctx.draw_series([
                    Rectangle::new(corners, color.rgb().filled()),
                    // A white outline keeps back-to-back spans of one category apart.
                    Rectangle::new(corners, WHITE.stroke_width(1)),
                ])?;
                if let Some(text) = &span.label {
                    let (left, top) = ctx.backend_coord(&corners[0]);
                    let (right, bottom) = ctx.backend_coord(&corners[1]);
                    let (tw, th) = root.estimate_text_size(text, &label_style)?;
                    let fits =
                        (tw as i32) + 6 <= right - left && (th as i32) + 4 <= (top - bottom).abs();
                    if fits {
                        root.draw_text(
                            text,
                            &label_style
                                .color(&color.text_on())
                                .pos(Pos::new(HPos::Center, VPos::Center)),
                            ((left + right) / 2, (top + bottom) / 2),
                        )?;
                    }
                }
            }
        }
        let (plot_right, plot_top) = ctx.backend_coord(&(x1, rows as f64));
        draw_legend(root, &categories, (plot_right + 16, plot_top))?;
        Ok(())
    })
}

/// Check every span; returns the time range to draw (starting at 0 unless spans start earlier).
fn validate(chart: &Timeline) -> Result<(f64, f64), ChartError> {
    if chart.rows.is_empty() {
        return Err(ChartError::Empty {
            what: "a timeline needs at least one row".into(),
        });
    }
    let (mut t0, mut t1) = (0.0f64, f64::NEG_INFINITY);
    for row in &chart.rows {
        for (i, span) in row.spans.iter().enumerate() {
            let item = || format!("row '{}' span {i} ({})", row.label, span.category);
            drawable(item, span.start_s)?;
            drawable(item, span.end_s)?;
            if span.end_s < span.start_s {
                return Err(ChartError::SpanEndsBeforeStart {
                    item: item(),
                    start_s: span.start_s,
                    end_s: span.end_s,
                });
            }
            t0 = t0.min(span.start_s);
            t1 = t1.max(span.end_s);
        }
    }
    if t1 == f64::NEG_INFINITY {
        return Err(ChartError::Empty {
            what: "no row of the timeline has a span".into(),
        });
    }
    Ok((t0, t1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(start_s: f64, end_s: f64) -> Span {
        Span {
            start_s,
            end_s,
            category: "forward".into(),
            label: None,
        }
    }

    fn one_row(spans: Vec<Span>) -> Timeline {
        Timeline {
            rows: vec![TimelineRow {
                label: "stage 0".into(),
                spans,
            }],
            ..Timeline::default()
        }
    }

    #[test]
    fn units_follow_the_extent() {
        assert_eq!(time_unit(2.0), ("s", 1.0));
        assert_eq!(time_unit(0.25), ("ms", 1e3));
        assert_eq!(time_unit(5e-4), ("µs", 1e6));
    }

    #[test]
    fn validation() {
        assert_eq!(
            validate(&one_row(vec![span(0.5, 1.0), span(1.0, 2.0)])).unwrap(),
            (0.0, 2.0)
        );
        assert_eq!(
            validate(&one_row(vec![span(-1.0, 1.0)])).unwrap(),
            (-1.0, 1.0)
        );

        let err = validate(&one_row(vec![span(0.0, 1.0), span(2.0, 1.5)])).unwrap_err();
        assert!(matches!(err, ChartError::SpanEndsBeforeStart { .. }));
        assert!(err.to_string().contains("row 'stage 0' span 1"), "{err}");

        let err = validate(&one_row(vec![span(0.0, f64::INFINITY)])).unwrap_err();
        assert!(matches!(err, ChartError::NonFinite { .. }));

        assert!(matches!(
            validate(&one_row(vec![])),
            Err(ChartError::Empty { .. })
        ));
        assert!(matches!(
            validate(&Timeline::default()),
            Err(ChartError::Empty { .. })
        ));
    }
}
