//! meshtrain-chart: PNG charts for training curves, scaling studies and pipeline timelines.
//!
//! Plain data in, a PNG file out: nothing here knows about meshtrain's types, so any crate (the
//! trainer, the benchmarks, the pipeline profiler) can draw a chart by filling a struct.
//!
//! - [`line_chart`] / [`line_panels`]: curves such as loss against step, one or more panels side
//!   by side, a legend placed in the emptiest corner, optional log-scale y axis.
//! - [`stacked_bars`]: grouped bars, each a stack of categories (e.g. per model, per worker
//!   count: compute / exposed communication / hidden communication / data loading), or plain
//!   bars with their value written on top (e.g. a speedup).
//! - [`timeline`]: a Gantt chart of spans per row (e.g. pipeline stages' forward, backward,
//!   send, recv and idle time) with labels inside spans that are wide enough.
//!
//! Rendering uses `plotters` onto an in-memory RGB bitmap and encodes it as PNG. Text is drawn
//! with the DejaVu Sans font embedded in this crate (see `fonts/LICENSE_DEJAVU`), so a chart
//! renders the same on a machine with no system fonts, no fontconfig and no network.
//!
//! Every input is validated before drawing: empty data, non-finite numbers, spans that end
//! before they start or non-positive values on a log axis return a [`ChartError`] naming the
//! offending series, bar or span; no input makes these functions panic.

mod bars;
mod line;
mod style;
mod timeline;

pub use bars::{stacked_bars, Bar, BarChart, BarGroup, ValueFormat};
pub use line::{line_chart, line_panels, LineChart, LinePanels, LineStyle, Series};
pub use style::{Color, PALETTE};
pub use timeline::{timeline, Span, Timeline, TimelineRow};

use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// Everything that can go wrong when drawing a chart.
#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    /// The chart has nothing to draw, e.g. no series, no bars, or a series without points.
    #[error("nothing to draw: {what}")]
    Empty { what: String },
    /// A coordinate or value is NaN or infinite.
    #[error("{item}: value {value} is not a finite number")]
    NonFinite { item: String, value: f64 },
    /// A value is finite but too large (or, on a log axis, too small) to lay out an axis for.
    #[error("{item}: value {value} is out of the drawable range ({allowed})")]
    OutOfRange {
        item: String,
        value: f64,
        allowed: &'static str,
    },
    /// A value that must be positive on a logarithmic axis is not.
    #[error("{item}: value {value} cannot be drawn on a logarithmic axis (must be > 0)")]
    NonPositiveOnLogAxis { item: String, value: f64 },
    /// Stacked bar segments add up, so they must be non-negative.
    #[error("{item}: stacked segment value {value} is negative")]
    NegativeSegment { item: String, value: f64 },
    /// A timeline span ends before it starts.
    #[error("{item}: span ends at {end_s} s, before it starts at {start_s} s")]
    SpanEndsBeforeStart {
        item: String,
        start_s: f64,
        end_s: f64,
    },
    /// An explicit axis range is empty or reversed.
    #[error("{item}: axis range {low}..{high} is empty or reversed")]
    InvalidRange { item: String, low: f64, high: f64 },
    /// The image size is outside what we draw sensibly.
    #[error(
        "image size {width}x{height} is outside {min}..={max} pixels per side",
        min = Size::MIN_SIDE,
        max = Size::MAX_SIDE
    )]
    InvalidSize { width: u32, height: u32 },
    /// The output path does not end in `.png`; we only write PNG.
    #[error("{path}: output file must have a .png extension")]
    NotPng { path: PathBuf },
    /// plotters failed while drawing (layout too small for the text, for example).
    #[error("drawing failed: {0}")]
    Render(String),
    /// The PNG could not be written.
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl<E: std::error::Error + Send + Sync> From<DrawingAreaErrorKind<E>> for ChartError {
    fn from(e: DrawingAreaErrorKind<E>) -> Self {
        ChartError::Render(e.to_string())
    }
}

/// Image size in pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size {
    pub width: u32,
    pub height: u32,
}

impl Size {
    /// Below this the axes, labels and legend no longer fit.
    pub const MIN_SIDE: u32 = 200;
    /// Above this the RGB buffer alone passes 300 MB: certainly a mistake.
    pub const MAX_SIDE: u32 = 10_000;

    pub const fn new(width: u32, height: u32) -> Self {
        Size { width, height }
    }

    fn validate(self) -> Result<(), ChartError> {
        let ok = |side: u32| (Self::MIN_SIDE..=Self::MAX_SIDE).contains(&side);
        if ok(self.width) && ok(self.height) {
            Ok(())
        } else {
            Err(ChartError::InvalidSize {
                width: self.width,
                height: self.height,
            })
        }
    }
}

impl Default for Size {
    /// 1000x600: readable when scaled down in a README, sharp at full width.
    fn default() -> Self {
        Size::new(1000, 600)
    }
}

/// The drawing area every chart module draws on.
type Canvas<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// Magnitudes beyond this are rejected: plotters' tick search loops forever or asserts when an
/// axis span overflows or loses all precision, and no training metric comes near it.
pub(crate) const MAX_MAGNITUDE: f64 = 1e100;

/// Check an input number: finite and at most [`MAX_MAGNITUDE`], naming `item` in the error.
fn drawable(item: impl Fn() -> String, value: f64) -> Result<f64, ChartError> {
    if !value.is_finite() {
        Err(ChartError::NonFinite {
            item: item(),
            value,
        })
    } else if value.abs() > MAX_MAGNITUDE {
        Err(ChartError::OutOfRange {
            item: item(),
            value,
            allowed: "|value| <= 1e100",
        })
    } else {
        Ok(value)
    }
}

/// An axis range around data spanning `lo..=hi` (drawable values), widened by `fraction` of
/// the span on each side. A span too small to subdivide (one value, or differences lost in
/// rounding) gets a window around the value instead, so plotters always gets a proper range.
fn axis_range(lo: f64, hi: f64, fraction: f64) -> (f64, f64) {
    let span = hi - lo;
    let magnitude = lo.abs().max(hi.abs());
    if span < 1e-9 * magnitude || span < 1e-90 {
        let half = (magnitude * 0.1).max(0.5);
        (lo - half, hi + half)
    } else {
        (lo - span * fraction, hi + span * fraction)
    }
}

/// Render through `draw` onto a white canvas of `size` and write the result to `path` as PNG.
///
/// We draw into our own buffer and encode it ourselves rather than let plotters save the file:
/// plotters picks the format from the extension and reports I/O failures as an opaque drawing
/// error, whereas here a missing directory is a [`ChartError::Write`] naming the path.
fn render_png(
    path: &Path,
    size: Size,
    draw: impl FnOnce(&Canvas) -> Result<(), ChartError>,
) -> Result<(), ChartError> {
    size.validate()?;
    let is_png = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("png"));
    if !is_png {
        return Err(ChartError::NotPng {
            path: path.to_owned(),
        });
    }
    style::register_embedded_font()?;
    let (width, height) = (size.width, size.height);
    let mut pixels = vec![0u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (width, height)).into_drawing_area();
        root.fill(&WHITE)?;
        draw(&root)?;
        root.present()?;
    }
    let png = encode_png(&pixels, width, height)?;
    std::fs::write(path, png).map_err(|source| ChartError::Write {
        path: path.to_owned(),
        source,
    })
}

fn encode_png(rgb: &[u8], width: u32, height: u32) -> Result<Vec<u8>, ChartError> {
    use image::ImageEncoder;
    let mut out = Vec::new();
    image::codecs::png::PngEncoder::new(&mut out)
        .write_image(rgb, width, height, image::ColorType::Rgb8)
        .map_err(|e| ChartError::Render(format!("encoding PNG: {e}")))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_limits_are_enforced() {
        assert!(Size::default().validate().is_ok());
        assert!(Size::new(Size::MIN_SIDE, Size::MAX_SIDE).validate().is_ok());
        for bad in [
            Size::new(0, 600),
            Size::new(600, 199),
            Size::new(10_001, 600),
        ] {
            assert!(matches!(
                bad.validate(),
                Err(ChartError::InvalidSize { .. })
            ));
        }
    }

    #[test]
    fn axis_ranges_are_never_degenerate() {
        assert_eq!(axis_range(0.0, 10.0, 0.05), (-0.5, 10.5));
        for (lo, hi) in [
            (3.0, 3.0),
            (1.0, 1.0 + 1e-15),
            (0.0, 1e-300),
            (-1e100, -1e100),
        ] {
            let (a, b) = axis_range(lo, hi, 0.05);
            assert!(
                a < lo && b > hi && (b - a) > 1e-9 * b.abs().max(a.abs()),
                "{lo}..{hi}"
            );
        }
    }

    #[test]
    fn drawable_rejects_non_finite_and_huge_values() {
        let item = || "x".to_owned();
        assert_eq!(drawable(item, -2.5).unwrap(), -2.5);
        assert!(matches!(
            drawable(item, f64::NAN),
            Err(ChartError::NonFinite { .. })
        ));
        assert!(matches!(
            drawable(item, f64::NEG_INFINITY),
            Err(ChartError::NonFinite { .. })
        ));
        assert!(matches!(
            drawable(item, 1e101),
            Err(ChartError::OutOfRange { .. })
        ));
    }

    #[test]
    fn only_png_paths_are_accepted() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["chart.jpg", "chart", "chart.png.txt"] {
            let err = render_png(&dir.path().join(name), Size::default(), |_| Ok(())).unwrap_err();
            assert!(matches!(err, ChartError::NotPng { .. }), "{name}: {err}");
        }
        render_png(&dir.path().join("chart.PNG"), Size::default(), |_| Ok(())).unwrap();
    }

    #[test]
    fn unwritable_path_is_a_write_error_naming_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("no-such-dir").join("chart.png");
        let err = render_png(&path, Size::default(), |_| Ok(())).unwrap_err();
        assert!(matches!(err, ChartError::Write { .. }));
        assert!(err.to_string().contains("no-such-dir"), "{err}");
    }
}
