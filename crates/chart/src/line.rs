//! Line charts: training curves, one or more panels side by side.

use crate::style::{self, format_tick, ColorMap, CAPTION_PX, LABEL_PX, TICK_PX, TITLE_PX};
use crate::{axis_range, drawable, render_png, Canvas, ChartError, Size, MAX_MAGNITUDE};
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use std::path::Path;

/// How a series is stroked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LineStyle {
    /// A solid line: dense curves such as the training loss every few steps.
    #[default]
    Solid,
    /// A solid line with a dot at each point: sparse curves such as one evaluation per epoch,
    /// where the reader should see where the measurements are.
    SolidWithMarkers,
    /// A dashed line: references such as a baseline the model must beat.
    Dashed,
}

/// One named curve.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub name: String,
    /// (x, y) in drawing order; all finite (and y > 0 on a log axis).
    pub points: Vec<(f64, f64)>,
    pub style: LineStyle,
}

impl Series {
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Series {
            name: name.into(),
            points,
            style: LineStyle::Solid,
        }
    }

    pub fn with_style(mut self, style: LineStyle) -> Self {
        self.style = style;
        self
    }
}

/// One panel: axes, curves and a legend.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LineChart {
    /// Caption above the panel (may be empty).
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// Logarithmic y axis (losses spanning decades); all y must then be > 0.
    pub log_y: bool,
    /// Fixed y range instead of the data's (e.g. accuracy in 0..1); data outside is clipped.
    pub y_range: Option<(f64, f64)>,
}

/// Several panels side by side under one title, e.g. loss on the left and accuracy on the
/// right. A series name keeps its colour across panels.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LinePanels {
    /// Title above all panels (may be empty).
    pub title: String,
    pub panels: Vec<LineChart>,
    pub size: Size,
}

/// Draw one panel into a PNG of the default [`Size`]; the chart's title heads the image.
pub fn line_chart(path: &Path, chart: &LineChart) -> Result<(), ChartError> {
    draw_panels(path, "", std::slice::from_ref(chart), Size::default())
}

/// Draw panels side by side (left to right in order) into a PNG.
pub fn line_panels(path: &Path, figure: &LinePanels) -> Result<(), ChartError> {
    draw_panels(path, &figure.title, &figure.panels, figure.size)
}

fn draw_panels(
    path: &Path,
    title: &str,
    panels: &[LineChart],
    size: Size,
) -> Result<(), ChartError> {
    if panels.is_empty() {
        return Err(ChartError::Empty {
            what: "a line chart needs at least one panel".into(),
        });
    }
    let bounds = panels
        .iter()
        .enumerate()
        .map(|(i, p)| PanelBounds::of(i, p))
        .collect::<Result<Vec<_>, _>>()?;
    render_png(path, size, |root| {
        let body = if title.is_empty() {
            root.clone()
        } else {
            root.titled(title, style::font(TITLE_PX))?
        };
        let mut colors = ColorMap::new(&[]);
        for ((area, panel), b) in body
            .split_evenly((1, panels.len()))
            .iter()
            .zip(panels)
            .zip(&bounds)
        {
            let x = b.x.0..b.x.1;
            if panel.log_y {
                draw_panel(area, panel, b, x, (b.y.0..b.y.1).log_scale(), &mut colors)?;
            } else {
                draw_panel(area, panel, b, x, b.y.0..b.y.1, &mut colors)?;
            }
        }
        Ok(())
    })
}

/// The validated axis ranges of one panel.
#[derive(Debug)]
struct PanelBounds {
    x: (f64, f64),
    y: (f64, f64),
}

impl PanelBounds {
    fn of(index: usize, panel: &LineChart) -> Result<Self, ChartError> {
        let panel_name = if panel.title.is_empty() {
            format!("panel {index}")
        } else {
            format!("panel '{}'", panel.title)
        };
        if panel.series.is_empty() {
            return Err(ChartError::Empty {
                what: format!("{panel_name} has no series"),
            });
        }
        let (mut x_lo, mut x_hi) = (f64::INFINITY, f64::NEG_INFINITY);
        let (mut y_lo, mut y_hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for s in &panel.series {
            if s.points.is_empty() {
                return Err(ChartError::Empty {
                    what: format!("{panel_name}: series '{}' has no points", s.name),
                });
            }
            for (i, &(x, y)) in s.points.iter().enumerate() {
                let item = || format!("{panel_name}: series '{}' point {i}", s.name);
                drawable(item, x)?;
                drawable(item, y)?;
                if panel.log_y {
                    log_drawable(item, y)?;
                }
                (x_lo, x_hi) = (x_lo.min(x), x_hi.max(x));
                (y_lo, y_hi) = (y_lo.min(y), y_hi.max(y));
            }
        }
        let y = match panel.y_range {
            Some((lo, hi)) => {
                let item = || format!("{panel_name}: y_range");
                drawable(item, lo)?;
                drawable(item, hi)?;
                if panel.log_y {
                    log_drawable(item, lo)?;
                }
                let too_narrow = axis_range(lo, hi, 0.0) != (lo, hi);
                if lo >= hi || too_narrow {
                    return Err(ChartError::InvalidRange {
                        item: item(),
                        low: lo,
                        high: hi,
                    });
                }
                (lo, hi)
            }
            None if panel.log_y => padded_log(y_lo, y_hi),
            None => axis_range(y_lo, y_hi, 0.05),
        };
        Ok(PanelBounds {
            x: axis_range(x_lo, x_hi, 0.02),
            y,
        })
    }
}

/// Values on a log axis must be positive and, like all values, within [`MAX_MAGNITUDE`] decades.
fn log_drawable(item: impl Fn() -> String, value: f64) -> Result<(), ChartError> {
    if value <= 0.0 {
        Err(ChartError::NonPositiveOnLogAxis {
            item: item(),
            value,
        })
    } else if value < 1.0 / MAX_MAGNITUDE {
        Err(ChartError::OutOfRange {
            item: item(),
            value,
            allowed: ">= 1e-100 on a log axis",
        })
    } else {
        Ok(())
    }
}

/// [`axis_range`] with 5% padding in log space; a single value gets a factor-of-two window.
fn padded_log(lo: f64, hi: f64) -> (f64, f64) {
    if hi / lo < 1.0 + 1e-9 {
        (lo / 2.0, hi * 2.0)
    } else {
        let (l, h) = axis_range(lo.ln(), hi.ln(), 0.05);
        (l.exp(), h.exp())
    }
}

fn draw_panel<Y>(
    area: &Canvas,
    panel: &LineChart,
    bounds: &PanelBounds,
    x: std::ops::Range<f64>,
    y: Y,
    colors: &mut ColorMap,
) -> Result<(), ChartError>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let mut builder = ChartBuilder::on(area);
    builder
        .margin(12)
        .x_label_area_size(52)
        .y_label_area_size(72);
    if !panel.title.is_empty() {
        builder.caption(&panel.title, style::font(CAPTION_PX));
    }
    let mut chart = builder.build_cartesian_2d(x, y)?;
    chart
        .configure_mesh()
        .max_light_lines(1)
        .light_line_style(RGBColor(238, 238, 238))
        .bold_line_style(RGBColor(210, 210, 210))
        .x_desc(panel.x_label.as_str())
        .y_desc(panel.y_label.as_str())
        .axis_desc_style(style::font(LABEL_PX))
        .label_style(style::font(TICK_PX))
        .x_label_formatter(&|v| format_tick(*v))
        .y_label_formatter(&|v| format_tick(*v))
        .draw()?;

    for s in &panel.series {
        let color = colors.color(&s.name).rgb();
        let line = color.stroke_width(2);
        let points = s.points.iter().copied();
        let anno = match s.style {
            LineStyle::Solid => chart.draw_series(LineSeries::new(points, line))?,
            LineStyle::Dashed => chart.draw_series(DashedLineSeries::new(points, 10, 6, line))?,
            LineStyle::SolidWithMarkers => {
                chart.draw_series(LineSeries::new(points.clone(), line))?;
                chart.draw_series(points.map(|p| Circle::new(p, 4, color.filled())))?
            }
        };
        let style = s.style;
        anno.label(s.name.as_str()).legend(move |(x, y)| {
            // Offsets relative to the legend anchor: a line (broken for dashed), a dot for markers.
            let stroke = color.stroke_width(2);
            let (left_end, right_start) = if style == LineStyle::Dashed {
                (8, 13)
            } else {
                (11, 11)
            };
            let dot = if style == LineStyle::SolidWithMarkers {
                color.filled()
            } else {
                TRANSPARENT.filled()
            };
            EmptyElement::at((x, y))
                + PathElement::new(vec![(0, 0), (left_end, 0)], stroke)
                + PathElement::new(vec![(right_start, 0), (21, 0)], stroke)
                + Circle::new((10, 0), 4, dot)
        });
    }

    chart
        .configure_series_labels()
        .position(legend_corner(panel, bounds))
        .label_font(style::font(LABEL_PX))
        .background_style(WHITE.mix(0.9))
        .border_style(RGBColor(160, 160, 160))
        .draw()?;
    Ok(())
}

/// The plot corner that the curves cross least, so the legend hides as little data as possible.
fn legend_corner(panel: &LineChart, bounds: &PanelBounds) -> SeriesLabelPosition {
    let to_axis = |v: f64| if panel.log_y { v.ln() } else { v };
    let (y0, y1) = (to_axis(bounds.y.0), to_axis(bounds.y.1));
    let (x0, x1) = bounds.x;
    let unit = |(x, y): (f64, f64)| ((x - x0) / (x1 - x0), (to_axis(y) - y0) / (y1 - y0));
    // The legend box, in fractions of the plot: wide enough for typical names, one row each.
    let (box_w, box_h) = (0.42, (0.08 + 0.07 * panel.series.len() as f64).min(0.7));
    let corners = [
        (SeriesLabelPosition::UpperRight, (1.0 - box_w, 1.0 - box_h)),
        (SeriesLabelPosition::UpperLeft, (0.0, 1.0 - box_h)),
        (SeriesLabelPosition::LowerRight, (1.0 - box_w, 0.0)),
        (SeriesLabelPosition::LowerLeft, (0.0, 0.0)),
    ];
    let mut hits = [0usize; 4];
    for s in &panel.series {
        // Sample along each segment too: two far-apart points still draw a line between them.
        let first = [s.points[0]];
        let pairs = first.iter().chain(&s.points).zip(&s.points);
        for (&a, &b) in pairs {
            let (a, b) = (unit(a), unit(b));
            for k in 0..=16 {
                let t = k as f64 / 16.0;
                let (u, v) = (a.0 + (b.0 - a.0) * t, a.1 + (b.1 - a.1) * t);
                for (hit, (_, (cu, cv))) in hits.iter_mut().zip(&corners) {
                    if (*cu..=cu + box_w).contains(&u) && (*cv..=cv + box_h).contains(&v) {
                        *hit += 1;
                    }
                }
            }
        }
    }
    let best = (0..4).min_by_key(|&i| (hits[i], i)).unwrap_or(0);
    corners[best].0.clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panel(series: Vec<Series>) -> LineChart {
        LineChart {
            series,
            ..LineChart::default()
        }
    }

    #[test]
    fn log_padding_handles_single_values_and_spans() {
        let (lo, hi) = padded_log(0.1, 10.0);
        assert!(lo < 0.1 && hi > 10.0 && lo > 0.0);
        assert!(
            (lo * hi - 1.0).abs() < 1e-9,
            "log padding is symmetric in log space"
        );
        assert_eq!(padded_log(2.0, 2.0), (1.0, 4.0));
    }

    #[test]
    fn legend_avoids_the_curves() {
        let falling = Series::new(
            "loss",
            (0..50).map(|i| (i as f64, 50.0 - i as f64)).collect(),
        );
        let p = panel(vec![falling]);
        let b = PanelBounds::of(0, &p).unwrap();
        // A falling diagonal crosses the upper-left and lower-right corners.
        assert!(matches!(
            legend_corner(&p, &b),
            SeriesLabelPosition::UpperRight
        ));
        let rising = Series::new("acc", (0..50).map(|i| (i as f64, i as f64)).collect());
        let p = panel(vec![rising]);
        let b = PanelBounds::of(0, &p).unwrap();
        assert!(matches!(
            legend_corner(&p, &b),
            SeriesLabelPosition::UpperLeft
        ));
    }

    #[test]
    fn bounds_reject_bad_input_with_names() {
        let err = PanelBounds::of(0, &panel(vec![])).unwrap_err();
        assert!(err.to_string().contains("panel 0 has no series"), "{err}");

        let err = PanelBounds::of(1, &panel(vec![Series::new("eval", vec![])])).unwrap_err();
        assert!(err.to_string().contains("'eval' has no points"), "{err}");

        let nan = Series::new("train", vec![(0.0, 1.0), (1.0, f64::NAN)]);
        let err = PanelBounds::of(0, &panel(vec![nan])).unwrap_err();
        assert!(matches!(err, ChartError::NonFinite { .. }));
        assert!(err.to_string().contains("'train' point 1"), "{err}");

        let zero = Series::new("loss", vec![(0.0, 1.0), (1.0, 0.0)]);
        let log = LineChart {
            log_y: true,
            ..panel(vec![zero])
        };
        assert!(matches!(
            PanelBounds::of(0, &log),
            Err(ChartError::NonPositiveOnLogAxis { .. })
        ));

        let fine = Series::new("acc", vec![(0.0, 0.5)]);
        let reversed = LineChart {
            y_range: Some((1.0, 0.0)),
            ..panel(vec![fine])
        };
        assert!(matches!(
            PanelBounds::of(0, &reversed),
            Err(ChartError::InvalidRange { .. })
        ));
    }
}
