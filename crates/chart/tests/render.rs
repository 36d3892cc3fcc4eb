//! Render every kind of chart into a temporary directory, decode the PNG and check what is in
//! it: size, that something was drawn, that each series' colour appears, and that bar heights
//! and span widths are proportional to their values.

use meshtrain_chart::*;
use std::path::{Path, PathBuf};

fn decode(path: &Path) -> image::RgbImage {
    image::open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .to_rgb8()
}

fn rgb(c: Color) -> image::Rgb<u8> {
    image::Rgb([c.0, c.1, c.2])
}

/// Pixels of exactly this colour in columns `x_range` (anti-aliased edges don't count).
fn count_in(img: &image::RgbImage, c: Color, x_range: std::ops::Range<u32>) -> usize {
    img.enumerate_pixels()
        .filter(|(x, _, p)| x_range.contains(x) && **p == rgb(c))
        .count()
}

fn count(img: &image::RgbImage, c: Color) -> usize {
    count_in(img, c, 0..img.width())
}

/// Pixels of colour `c` in each column (`by_column`) or each row: the length of a bar or span
/// crossing it, away from the legend swatches, which are much shorter.
fn line_counts(img: &image::RgbImage, c: Color, by_column: bool) -> Vec<usize> {
    let n = if by_column { img.width() } else { img.height() };
    let mut counts = vec![0; n as usize];
    for (x, y, p) in img.enumerate_pixels() {
        if *p == rgb(c) {
            counts[if by_column { x } else { y } as usize] += 1;
        }
    }
    counts
}

/// Length ratio of colour `b` to colour `a` along the column (or row) where `a` is longest.
fn length_ratio(img: &image::RgbImage, a: Color, b: Color, by_column: bool) -> f64 {
    let (la, lb) = (
        line_counts(img, a, by_column),
        line_counts(img, b, by_column),
    );
    let at = (0..la.len()).max_by_key(|&i| la[i]).unwrap();
    assert!(la[at] > 50, "colour {a:?} is barely drawn: {}", la[at]);
    lb[at] as f64 / la[at] as f64
}

fn non_white(img: &image::RgbImage) -> usize {
    img.pixels().filter(|p| p.0 != [255, 255, 255]).count()
}

/// Near-black pixels (text, axes) in the top `rows` rows.
fn dark_in_top(img: &image::RgbImage, rows: u32) -> usize {
    img.enumerate_pixels()
        .filter(|(_, y, p)| *y < rows && p.0.iter().all(|&v| v < 100))
        .count()
}

/// Text pixels (grey or darker, so anti-aliased small glyphs count) in a 60x25 box just above
/// the top of the longest column of colour `c`.
fn dark_above_tallest_bar(img: &image::RgbImage, c: Color) -> usize {
    let columns = line_counts(img, c, true);
    let tallest = *columns.iter().max().unwrap();
    let first = columns.iter().position(|&n| n == tallest).unwrap();
    let width = columns[first..]
        .iter()
        .take_while(|&&n| n == tallest)
        .count();
    let x = (first + width / 2) as u32;
    let top = (0..img.height())
        .find(|&y| *img.get_pixel(x, y) == rgb(c))
        .unwrap();
    img.enumerate_pixels()
        .filter(|(px, py, p)| {
            px.abs_diff(x) <= 30 && *py < top && top - py <= 25 && p.0.iter().all(|&v| v < 160)
        })
        .count()
}

fn out(dir: &tempfile::TempDir, name: &str) -> PathBuf {
    dir.path().join(name)
}

fn curve(name: &str, f: impl Fn(f64) -> f64, n: usize) -> Series {
    Series::new(
        name,
        (0..n).map(|i| (i as f64 * 10.0, f(i as f64))).collect(),
    )
}

#[test]
fn line_chart_draws_every_series_in_its_colour() {
    let dir = tempfile::tempdir().unwrap();
    let path = out(&dir, "loss.png");
    let chart = LineChart {
        title: "LeNet on Fashion-MNIST".into(),
        x_label: "step".into(),
        y_label: "loss".into(),
        series: vec![
            curve("train loss", |i| 2.3 * (-i / 20.0).exp() + 0.2, 100),
            curve("eval loss", |i| 2.0 * (-i / 25.0).exp() + 0.3, 10)
                .with_style(LineStyle::SolidWithMarkers),
            curve("baseline", |_| 1.5, 100).with_style(LineStyle::Dashed),
        ],
        ..LineChart::default()
    };
    line_chart(&path, &chart).unwrap();
    let img = decode(&path);
    assert_eq!(img.dimensions(), (1000, 600));
    assert!(
        non_white(&img) > 10_000,
        "too little drawn: {}",
        non_white(&img)
    );
    for (i, name) in ["train loss", "eval loss", "baseline"].iter().enumerate() {
        let n = count(&img, PALETTE[i]);
        assert!(n > 100, "series '{name}' colour appears in only {n} pixels");
    }
    assert_eq!(count(&img, PALETTE[3]), 0, "no fourth series was drawn");
    assert!(dark_in_top(&img, 40) > 50, "the title text is missing");
}

#[test]
fn panels_share_colours_by_series_name_and_support_log_axes() {
    let dir = tempfile::tempdir().unwrap();
    let path = out(&dir, "panels.png");
    let figure = LinePanels {
        title: String::new(),
        panels: vec![
            LineChart {
                title: "loss".into(),
                series: vec![
                    curve("train", |i| 3.0 * (-i / 10.0).exp() + 0.01, 80),
                    curve("eval", |i| 2.0 * (-i / 10.0).exp() + 0.05, 8),
                ],
                log_y: true,
                ..LineChart::default()
            },
            LineChart {
                title: "accuracy".into(),
                series: vec![curve("eval", |i| 1.0 - 0.5 * (-i / 3.0).exp(), 8)],
                y_range: Some((0.0, 1.0)),
                ..LineChart::default()
            },
        ],
        size: Size::new(1200, 500),
    };
    line_panels(&path, &figure).unwrap();
    let img = decode(&path);
    assert_eq!(img.dimensions(), (1200, 500));
    // "eval" is the second name seen, so PALETTE[1], in both halves; "train" only on the left.
    assert!(count_in(&img, PALETTE[1], 0..600) > 100);
    assert!(count_in(&img, PALETTE[1], 600..1200) > 100);
    assert!(count_in(&img, PALETTE[0], 0..600) > 100);
    assert_eq!(count_in(&img, PALETTE[0], 600..1200), 0);
    assert_eq!(dark_in_top(&img, 8), 0, "no figure title was asked for");
}

const A: Color = Color(200, 30, 30);
const B: Color = Color(30, 30, 200);

#[test]
fn stacked_bar_segments_are_proportional_to_their_values() {
    let dir = tempfile::tempdir().unwrap();
    let path = out(&dir, "bars.png");
    let chart = BarChart {
        title: "step time".into(),
        y_label: "ms".into(),
        groups: vec![BarGroup {
            label: "GPT".into(),
            bars: vec![Bar {
                label: "4 workers".into(),
                segments: vec![("compute".into(), 1.0), ("communication".into(), 3.0)],
            }],
        }],
        category_colors: vec![("compute".into(), A), ("communication".into(), B)],
        ..BarChart::default()
    };
    stacked_bars(&path, &chart).unwrap();
    let img = decode(&path);
    assert_eq!(img.dimensions(), (1000, 600));
    let ratio = length_ratio(&img, A, B, true);
    assert!(
        (ratio - 3.0).abs() < 0.05,
        "communication/compute height {ratio}, want 3"
    );
}

#[test]
fn plain_bars_get_value_labels_and_no_legend() {
    let dir = tempfile::tempdir().unwrap();
    let bars = |labels: Option<ValueFormat>| BarChart {
        title: "speedup".into(),
        groups: vec![
            BarGroup {
                label: "LeNet".into(),
                bars: vec![
                    Bar::single("2", "speedup", 1.0),
                    Bar::single("4", "speedup", 2.0),
                ],
            },
            BarGroup {
                label: "GPT".into(),
                bars: vec![Bar::single("2", "speedup", 1.9)],
            },
        ],
        value_labels: labels,
        category_colors: vec![("speedup".into(), A)],
        ..BarChart::default()
    };
    let (plain, labelled) = (out(&dir, "plain.png"), out(&dir, "labelled.png"));
    stacked_bars(&plain, &bars(None)).unwrap();
    let format = ValueFormat {
        decimals: 1,
        suffix: "×".into(),
    };
    stacked_bars(&labelled, &bars(Some(format))).unwrap();
    let (plain, labelled) = (decode(&plain), decode(&labelled));
    // The value is written just above each bar: dark text there only when labels are asked for.
    assert_eq!(dark_above_tallest_bar(&plain, A), 0);
    let n = dark_above_tallest_bar(&labelled, A);
    assert!(n > 20, "value label missing: {n} text pixels");
    // One category means no legend swatch, so the bar areas are exactly the bars, on a scale
    // with more headroom when labelled.
    let bar_pixels = count(&plain, A) as f64;
    assert!(bar_pixels > 1000.0);
    let labelled_pixels = count(&labelled, A) as f64;
    let headroom = 1.15 / 1.05;
    assert!(
        (bar_pixels / labelled_pixels / headroom - 1.0).abs() < 0.03,
        "bars shrink by the extra headroom: {bar_pixels} vs {labelled_pixels}"
    );
}

fn span(start_s: f64, end_s: f64, category: &str, label: Option<&str>) -> Span {
    Span {
        start_s,
        end_s,
        category: category.into(),
        label: label.map(str::to_owned),
    }
}

fn pipeline(spans: Vec<Span>) -> Timeline {
    Timeline {
        title: "1F1B, 2 stages".into(),
        rows: vec![
            TimelineRow {
                label: "stage 0".into(),
                spans,
            },
            TimelineRow {
                label: "stage 1 (idle)".into(),
                spans: vec![],
            },
        ],
        category_colors: vec![("forward".into(), A), ("backward".into(), B)],
        ..Timeline::default()
    }
}

#[test]
fn timeline_span_widths_follow_durations() {
    let dir = tempfile::tempdir().unwrap();
    let path = out(&dir, "timeline.png");
    timeline(
        &path,
        &pipeline(vec![
            span(0.0, 0.010, "forward", None),
            span(0.010, 0.030, "backward", None),
        ]),
    )
    .unwrap();
    let img = decode(&path);
    assert_eq!(img.dimensions(), (1000, 600));
    let ratio = length_ratio(&img, A, B, false);
    assert!(
        (ratio - 2.0).abs() < 0.05,
        "backward/forward width {ratio}, want 2"
    );
}

#[test]
fn timeline_writes_labels_only_where_they_fit() {
    let dir = tempfile::tempdir().unwrap();
    let render = |name: &str, spans: Vec<Span>| {
        let path = out(&dir, name);
        timeline(&path, &pipeline(spans)).unwrap();
        decode(&path)
    };
    // Wide spans: the micro-batch number is drawn inside, replacing some fill pixels.
    let wide = |label| {
        vec![
            span(0.0, 1.0, "forward", label),
            span(1.0, 2.0, "backward", None),
        ]
    };
    let with = render("wide-label.png", wide(Some("7")));
    let without = render("wide-none.png", wide(None));
    assert!(
        count(&with, A) < count(&without, A),
        "label missing inside a wide span"
    );
    // A span 1/2000 of the axis wide has no room: the label is skipped, the image unchanged.
    let narrow = |label| {
        vec![
            span(0.0, 0.001, "forward", label),
            span(0.001, 2.0, "backward", None),
        ]
    };
    let with = render("narrow-label.png", narrow(Some("12")));
    let without = render("narrow-none.png", narrow(None));
    assert_eq!(with, without, "a label was squeezed into a too-narrow span");
}

#[test]
fn bad_input_is_an_error_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = out(&dir, "bad.png");
    let nan = LineChart {
        series: vec![Series::new("loss", vec![(0.0, f64::NAN)])],
        ..LineChart::default()
    };
    let empty = LineChart {
        series: vec![Series::new("loss", vec![])],
        ..LineChart::default()
    };
    let backwards = pipeline(vec![span(2.0, 1.0, "forward", None)]);
    let no_groups = BarChart::default();
    let errors = [
        line_chart(&path, &nan).unwrap_err(),
        line_chart(&path, &empty).unwrap_err(),
        line_chart(&path, &LineChart::default()).unwrap_err(),
        timeline(&path, &backwards).unwrap_err(),
        stacked_bars(&path, &no_groups).unwrap_err(),
    ];
    assert!(matches!(errors[0], ChartError::NonFinite { .. }));
    assert!(matches!(errors[1], ChartError::Empty { .. }));
    assert!(matches!(errors[2], ChartError::Empty { .. }));
    assert!(matches!(errors[3], ChartError::SpanEndsBeforeStart { .. }));
    assert!(matches!(errors[4], ChartError::Empty { .. }));
    assert!(!path.exists());

    let tiny = LinePanels {
        title: String::new(),
        panels: vec![curve_chart()],
        size: Size::new(50, 50),
    };
    assert!(matches!(
        line_panels(&path, &tiny),
        Err(ChartError::InvalidSize { .. })
    ));
}

fn curve_chart() -> LineChart {
    LineChart {
        series: vec![curve("loss", |i| 1.0 / (1.0 + i), 10)],
        ..LineChart::default()
    }
}

#[test]
fn single_point_and_constant_series_still_render() {
    let dir = tempfile::tempdir().unwrap();
    let path = out(&dir, "flat.png");
    let chart = LineChart {
        series: vec![
            Series::new("one point", vec![(5.0, 2.0)]).with_style(LineStyle::SolidWithMarkers),
            Series::new("flat", vec![(5.0, 2.0), (5.0, 2.0)]),
        ],
        log_y: true,
        ..LineChart::default()
    };
    line_chart(&path, &chart).unwrap();
    let img = decode(&path);
    assert!(count(&img, PALETTE[0]) > 20, "the lone marker is drawn");
}

/// plotters' tick search hangs or asserts on axis spans that overflow or lose all precision:
/// values up to 1e100 in magnitude draw, larger ones are a clear error, and nothing hangs.
#[test]
fn extreme_values_draw_or_error_but_never_hang() {
    let dir = tempfile::tempdir().unwrap();
    let path = out(&dir, "extreme.png");
    let drawable = [
        vec![(0.0, -1e100), (1.0, 1e100)],
        vec![(-1e100, 1.0), (1e100, 2.0)],
        vec![(0.0, 1.0), (1e-300, 1.0 + 1e-15)],
        vec![(0.0, 1e-100), (1.0, 1e100)],
        vec![(0.0, 0.0), (5e-324, 5e-324)],
    ];
    for (i, points) in drawable.iter().enumerate() {
        let chart = LineChart {
            series: vec![Series::new("s", points.clone())],
            log_y: i == 3,
            ..LineChart::default()
        };
        line_chart(&path, &chart).unwrap_or_else(|e| panic!("case {i}: {e}"));
    }
    let too_large = LineChart {
        series: vec![Series::new("s", vec![(0.0, -1e308), (1.0, 1e308)])],
        ..LineChart::default()
    };
    assert!(matches!(
        line_chart(&path, &too_large),
        Err(ChartError::OutOfRange { .. })
    ));
    let too_small_for_log = LineChart {
        series: vec![Series::new("s", vec![(0.0, f64::MIN_POSITIVE), (1.0, 1.0)])],
        log_y: true,
        ..LineChart::default()
    };
    assert!(matches!(
        line_chart(&path, &too_small_for_log),
        Err(ChartError::OutOfRange { .. })
    ));

    let bars = |value: f64| BarChart {
        groups: vec![BarGroup {
            label: "g".into(),
            bars: vec![Bar {
                label: "b".into(),
                segments: vec![("a".into(), value), ("b".into(), value)],
            }],
        }],
        ..BarChart::default()
    };
    stacked_bars(&path, &bars(1e100)).unwrap();
    stacked_bars(&path, &bars(0.0)).unwrap();
    assert!(matches!(
        stacked_bars(&path, &bars(f64::MAX)),
        Err(ChartError::OutOfRange { .. })
    ));

    timeline(
        &path,
        &pipeline(vec![span(-1e100, 1e100, "forward", Some("x"))]),
    )
    .unwrap();
    timeline(&path, &pipeline(vec![span(1.0, 1.0, "forward", Some("x"))])).unwrap();
    // An extent lost in rounding against the start time.
    timeline(
        &path,
        &pipeline(vec![span(1e15, 1e15 + 0.1, "forward", None)]),
    )
    .unwrap();
    let huge = pipeline(vec![span(0.0, 1e300, "forward", None)]);
    assert!(matches!(
        timeline(&path, &huge),
        Err(ChartError::OutOfRange { .. })
    ));
}
