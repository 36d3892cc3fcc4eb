//! Grouped, stacked bar charts: where the step time goes, per model and worker count.

use crate::style::{self, draw_legend, format_tick, legend_width, Color, ColorMap};
use crate::style::{LABEL_PX, TICK_PX, TITLE_PX};
use crate::{drawable, render_png, Canvas, ChartError, Size};
use plotters::prelude::*;
// The trait behind .filled() / .stroke_width(); our own `Color` struct keeps the name.
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::Color as _;
use std::path::Path;

/// One bar: a stack of (category, value) segments drawn bottom-up in order.
#[derive(Clone, Debug, PartialEq)]
pub struct Bar {
    pub label: String,
    /// Non-negative values; a category keeps one colour across the chart.
    pub segments: Vec<(String, f64)>,
}

impl Bar {
    /// A plain bar of one value (e.g. a speedup), for charts without stacking.
    pub fn single(label: impl Into<String>, category: impl Into<String>, value: f64) -> Self {
        Bar {
            label: label.into(),
            segments: vec![(category.into(), value)],
        }
    }

    fn total(&self) -> f64 {
        self.segments.iter().map(|(_, v)| v).sum()
    }
}

/// Bars that belong together (e.g. one model at several worker counts), labelled below them.
#[derive(Clone, Debug, PartialEq)]
pub struct BarGroup {
    pub label: String,
    pub bars: Vec<Bar>,
}

/// How the total on top of each bar is written: `{total:.decimals$}{suffix}`, e.g. "3.6×".
#[derive(Clone, Debug, PartialEq)]
pub struct ValueFormat {
    pub decimals: usize,
    pub suffix: String,
}

impl ValueFormat {
    fn format(&self, v: f64) -> String {
        format!("{v:.*}{}", self.decimals, self.suffix)
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct BarChart {
    pub title: String,
    pub y_label: String,
    pub groups: Vec<BarGroup>,
    /// Write each bar's total above it (speedups, step times); `None` for no labels.
    pub value_labels: Option<ValueFormat>,
    /// Fixed colours for some categories; the others take the palette in order of appearance.
    pub category_colors: Vec<(String, Color)>,
    pub size: Size,
}

/// Horizontal layout in bar units: each bar takes one unit (80% of it filled), groups are
/// separated by a gap and the plot has a small margin at both ends, so bars line up whatever
/// the number per group.
const BAR_FILL: f64 = 0.8;
const GROUP_GAP: f64 = 0.7;
const EDGE: f64 = 0.15;

/// Draw grouped bars, stacked when a bar has several segments, with a legend of categories
/// (when there is more than one) to the right of the plot.
pub fn stacked_bars(path: &Path, chart: &BarChart) -> Result<(), ChartError> {
    let max_total = validate(chart)?;
    // Headroom so the tallest bar's value label stays inside the plot.
    let headroom = if chart.value_labels.is_some() {
        1.15
    } else {
        1.05
    };
    // All-zero (or vanishing) bars still get an axis plotters can subdivide.
    let y_max = if max_total > 1e-90 {
        max_total * headroom
    } else {
        1.0
    };
    let mut colors = ColorMap::new(&chart.category_colors);
    let mut categories: Vec<(String, Color)> = Vec::new();
    for (name, _) in chart
        .groups
        .iter()
        .flat_map(|g| &g.bars)
        .flat_map(|b| &b.segments)
    {
        if !categories.iter().any(|(n, _)| n == name) {
            categories.push((name.clone(), colors.color(name)));
        }
    }
    let slots = layout(chart);
    let x_end = slots.last().map_or(1.0, |s| s.x + 1.0 + EDGE);

    render_png(path, chart.size, |root| {
        let body = if chart.title.is_empty() {
            root.clone()
        } else {
            root.titled(&chart.title, style::font(TITLE_PX))?
        };
        let show_legend = categories.len() > 1;
        let names: Vec<&str> = categories.iter().map(|(n, _)| n.as_str()).collect();
        let legend_w = if show_legend {
            legend_width(root, &names)? + 12
        } else {
            0
        };
        let mut chart_ctx = ChartBuilder::on(&body)
            .margin(12)
            .margin_right(12 + legend_w)
            .x_label_area_size(62)
            .y_label_area_size(72)
            .build_cartesian_2d(0.0..x_end, 0.0..y_max)?;
        chart_ctx
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .max_light_lines(1)
            .light_line_style(RGBColor(238, 238, 238))
            .bold_line_style(RGBColor(210, 210, 210))
            .y_desc(chart.y_label.as_str())
            .axis_desc_style(style::font(LABEL_PX))
            .label_style(style::font(TICK_PX))
            .y_label_formatter(&|v| format_tick(*v))
            .draw()?;

        for slot in &slots {
            let mut base = 0.0;
            for (name, value) in &slot.bar.segments {
                let color = categories
                    .iter()
                    .find(|(n, _)| n == name)
                    .map_or(Color(0, 0, 0), |(_, c)| *c);
                let rect = [
                    (slot.x + (1.0 - BAR_FILL) / 2.0, base),
                    (slot.x + (1.0 + BAR_FILL) / 2.0, base + value),
                ];
                chart_ctx
                    .draw_series(std::iter::once(Rectangle::new(rect, color.rgb().filled())))?;
                base += value;
            }
            label_bar(root, &chart_ctx, slot, chart.value_labels.as_ref())?;
        }
        for (g, group) in chart.groups.iter().enumerate() {
            let in_group: Vec<&Slot> = slots.iter().filter(|s| s.group == g).collect();
            if let (Some(first), Some(last)) = (in_group.first(), in_group.last()) {
                let (left, bottom) = chart_ctx.backend_coord(&(first.x, 0.0));
                let (right, _) = chart_ctx.backend_coord(&(last.x + 1.0, 0.0));
                root.draw_text(
                    &group.label,
                    &style::font(LABEL_PX).pos(Pos::new(HPos::Center, VPos::Top)),
                    ((left + right) / 2, bottom + 30),
                )?;
            }
        }
        if show_legend {
            let (plot_right, plot_top) = chart_ctx.backend_coord(&(x_end, y_max));
            draw_legend(root, &categories, (plot_right + 16, plot_top))?;
        }
        Ok(())
    })
}

/// Check every value; returns the tallest bar's total.
fn validate(chart: &BarChart) -> Result<f64, ChartError> {
    if chart.groups.is_empty() {
        return Err(ChartError::Empty {
            what: "a bar chart needs at least one group".into(),
        });
    }
    let mut max_total: f64 = 0.0;
    for g in &chart.groups {
        if g.bars.is_empty() {
            return Err(ChartError::Empty {
                what: format!("bar group '{}' has no bars", g.label),
            });
        }
        for b in &g.bars {
            if b.segments.is_empty() {
                return Err(ChartError::Empty {
                    what: format!("bar '{}' in group '{}' has no segments", b.label, g.label),
                });
            }
            for (category, value) in &b.segments {
                let item = || format!("group '{}' bar '{}' segment '{category}'", g.label, b.label);
                drawable(item, *value)?;
                if *value < 0.0 {
                    return Err(ChartError::NegativeSegment {
                        item: item(),
                        value: *value,
                    });
                }
            }
            max_total = max_total.max(b.total());
        }
    }
    Ok(max_total)
}

/// Where one bar goes: its left edge in bar units.
struct Slot<'a> {
    x: f64,
    group: usize,
    bar: &'a Bar,
}

fn layout(chart: &BarChart) -> Vec<Slot<'_>> {
    let mut slots = Vec::new();
    let mut x = EDGE;
    for (group, g) in chart.groups.iter().enumerate() {
        for bar in &g.bars {
            slots.push(Slot { x, group, bar });
            x += 1.0;
        }
        x += GROUP_GAP;
    }
    slots
}

/// The bar's label under the axis and, if asked, its total above it.
fn label_bar<Y: plotters::coord::ranged1d::Ranged<ValueType = f64>>(
    root: &Canvas,
    chart: &ChartContext<BitMapBackend, Cartesian2d<plotters::coord::types::RangedCoordf64, Y>>,
    slot: &Slot,
    value_labels: Option<&ValueFormat>,
) -> Result<(), ChartError> {
    let centre = slot.x + 0.5;
    let (x, bottom) = chart.backend_coord(&(centre, 0.0));
    root.draw_text(
        &slot.bar.label,
        &style::font(TICK_PX).pos(Pos::new(HPos::Center, VPos::Top)),
        (x, bottom + 8),
    )?;
    if let Some(format) = value_labels {
        let total = slot.bar.total();
        let (_, top) = chart.backend_coord(&(centre, total));
        root.draw_text(
            &format.format(total),
            &style::font(TICK_PX).pos(Pos::new(HPos::Center, VPos::Bottom)),
            (x, top - 4),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(groups: Vec<BarGroup>) -> BarChart {
        BarChart {
            groups,
            ..BarChart::default()
        }
    }

    #[test]
    fn layout_puts_gaps_between_groups_only() {
        let bars = |n: usize| {
            (0..n)
                .map(|i| Bar::single(i.to_string(), "t", 1.0))
                .collect()
        };
        let c = chart(vec![
            BarGroup {
                label: "a".into(),
                bars: bars(3),
            },
            BarGroup {
                label: "b".into(),
                bars: bars(2),
            },
        ]);
        let xs: Vec<f64> = layout(&c).iter().map(|s| s.x).collect();
        let (e, g) = (EDGE, GROUP_GAP);
        let want = [e, e + 1.0, e + 2.0, e + 3.0 + g, e + 4.0 + g];
        assert_eq!(xs.len(), want.len());
        for (x, w) in xs.iter().zip(want) {
            assert!((x - w).abs() < 1e-12, "{xs:?} vs {want:?}");
        }
    }

    #[test]
    fn validation_names_the_bad_segment() {
        let bad = Bar {
            label: "4 workers".into(),
            segments: vec![("compute".into(), 1.0), ("comm".into(), -0.5)],
        };
        let err = validate(&chart(vec![BarGroup {
            label: "gpt".into(),
            bars: vec![bad],
        }]))
        .unwrap_err();
        assert!(matches!(err, ChartError::NegativeSegment { .. }));
        let msg = err.to_string();
        assert!(
            msg.contains("gpt") && msg.contains("4 workers") && msg.contains("comm"),
            "{msg}"
        );

        let nan = Bar::single("1", "speedup", f64::NAN);
        let err = validate(&chart(vec![BarGroup {
            label: "g".into(),
            bars: vec![nan],
        }]))
        .unwrap_err();
        assert!(matches!(err, ChartError::NonFinite { .. }));

        assert!(matches!(
            validate(&chart(vec![])),
            Err(ChartError::Empty { .. })
        ));
        let empty_group = BarGroup {
            label: "g".into(),
            bars: vec![],
        };
        assert!(matches!(
            validate(&chart(vec![empty_group])),
            Err(ChartError::Empty { .. })
        ));
    }

    #[test]
    fn tallest_total_sets_the_scale() {
        let c = chart(vec![BarGroup {
            label: "g".into(),
            bars: vec![
                Bar {
                    label: "1".into(),
                    segments: vec![("a".into(), 1.0), ("b".into(), 2.0)],
                },
                Bar::single("2", "a", 2.5),
            ],
        }]);
        assert_eq!(validate(&c).unwrap(), 3.0);
        assert_eq!(
            ValueFormat {
                decimals: 1,
                suffix: "×".into()
            }
            .format(3.04),
            "3.0×"
        );
    }
}
