//! Render one chart of each kind from made-up data, to look at the styling:
//! `cargo run --release -p meshtrain-chart --example gallery -- /tmp/gallery`

use meshtrain_chart::*;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "gallery".into()));
    std::fs::create_dir_all(&dir)?;

    let train: Vec<(f64, f64)> = (0..=200)
        .map(|s| {
            let step = s as f64 * 5.0;
            let noise = 0.08 * ((step * 0.37).sin() + (step * 1.3).cos());
            (step, 2.3 * (-step / 150.0).exp() + 0.3 + noise)
        })
        .collect();
    let eval: Vec<(f64, f64)> = (1..=5)
        .map(|e| {
            (
                e as f64 * 200.0,
                2.2 * (-(e as f64) * 200.0 / 160.0).exp() + 0.33,
            )
        })
        .collect();
    let accuracy: Vec<(f64, f64)> = (1..=5)
        .map(|e| (e as f64 * 200.0, 0.9 - 0.2 * (-(e as f64) / 1.5).exp()))
        .collect();
    line_panels(
        &dir.join("curves.png"),
        &LinePanels {
            title: "LeNet (ReLU) on Fashion-MNIST".into(),
            panels: vec![
                LineChart {
                    title: "loss".into(),
                    x_label: "step".into(),
                    y_label: "cross-entropy".into(),
                    series: vec![
                        Series::new("train loss", train),
                        Series::new("test loss", eval).with_style(LineStyle::SolidWithMarkers),
                    ],
                    ..LineChart::default()
                },
                LineChart {
                    title: "accuracy".into(),
                    x_label: "step".into(),
                    y_label: "test accuracy".into(),
                    series: vec![
                        Series::new("test accuracy", accuracy)
                            .with_style(LineStyle::SolidWithMarkers),
                        Series::new("chance", vec![(200.0, 0.1), (1000.0, 0.1)])
                            .with_style(LineStyle::Dashed),
                    ],
                    y_range: Some((0.0, 1.0)),
                    ..LineChart::default()
                },
            ],
            size: Size::new(1400, 560),
        },
    )?;

    let breakdown = |workers: u32, compute: f64| Bar {
        label: format!("{workers} workers"),
        segments: vec![
            ("compute".into(), compute / workers as f64),
            (
                "communication (exposed)".into(),
                2.0 * (workers as f64).log2(),
            ),
            (
                "communication (hidden)".into(),
                1.5 * (workers as f64).log2(),
            ),
            ("data loading".into(), 1.0),
        ],
    };
    stacked_bars(
        &dir.join("scaling.png"),
        &BarChart {
            title: "Step time by worker count".into(),
            y_label: "ms per step".into(),
            groups: vec![
                BarGroup {
                    label: "LeNet".into(),
                    bars: [1, 2, 4, 8].map(|w| breakdown(w, 40.0)).to_vec(),
                },
                BarGroup {
                    label: "GPT".into(),
                    bars: [1, 2, 4, 8].map(|w| breakdown(w, 120.0)).to_vec(),
                },
            ],
            value_labels: Some(ValueFormat {
                decimals: 1,
                suffix: " ms".into(),
            }),
            category_colors: vec![("communication (hidden)".into(), Color(174, 199, 232))],
            ..BarChart::default()
        },
    )?;
    stacked_bars(
        &dir.join("speedup.png"),
        &BarChart {
            title: "Speedup over one worker".into(),
            y_label: "speedup".into(),
            groups: vec![BarGroup {
                label: "GPT".into(),
                bars: [(2, 1.9), (4, 3.6), (8, 6.4)]
                    .map(|(w, s)| Bar::single(format!("{w} workers"), "speedup", s))
                    .to_vec(),
            }],
            value_labels: Some(ValueFormat {
                decimals: 1,
                suffix: "×".into(),
            }),
            ..BarChart::default()
        },
    )?;

    // GPipe-style schedule: 4 stages, 6 micro-batches, forward 1 unit, backward 2 units.
    let (stages, micro, f, b) = (4usize, 6usize, 0.004, 0.008);
    let rows = (0..stages)
        .map(|s| {
            let mut spans = Vec::new();
            for m in 0..micro {
                let start = (s + m) as f64 * f;
                spans.push(span(start, start + f, "forward", m));
            }
            let backward_start = (stages + micro - 1) as f64 * f;
            for m in 0..micro {
                let start = backward_start + ((stages - 1 - s) + m) as f64 * b;
                spans.push(span(start, start + b, "backward", m));
            }
            TimelineRow {
                label: format!("stage {s}"),
                spans,
            }
        })
        .collect();
    timeline(
        &dir.join("timeline.png"),
        &Timeline {
            title: "GPipe, 4 stages, 6 micro-batches".into(),
            rows,
            ..Timeline::default()
        },
    )?;
    println!("wrote 4 charts to {}", dir.display());
    Ok(())
}

fn span(start_s: f64, end_s: f64, category: &str, micro_batch: usize) -> Span {
    Span {
        start_s,
        end_s,
        category: category.into(),
        label: Some(micro_batch.to_string()),
    }
}
