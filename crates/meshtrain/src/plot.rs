//! `meshtrain plot`: training curves from a run's `metrics.jsonl`.
//!
//! The trainer appends one JSON object per line: `"kind":"train"` every `log_every` steps,
//! `"kind":"eval"` after each evaluation and a final `"kind":"summary"`. We draw the train and
//! evaluation loss against the step, and beside it the test accuracy (image models) or, for
//! text models, the unigram baseline as a dashed line in the loss panel: the loss a model that
//! ignores context would reach, which a working language model must go below.

use meshtrain_chart::{line_panels, ChartError, LineChart, LinePanels, LineStyle, Series, Size};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("reading metrics file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("metrics file {path}, line {line}: {message}")]
    Parse {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("metrics file {path} has no train or eval records with a finite loss")]
    NoRecords { path: PathBuf },
    #[error("drawing {path}: {source}")]
    Chart {
        path: PathBuf,
        #[source]
        source: ChartError,
    },
}

/// One line of metrics.jsonl; fields we do not plot are ignored.
#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum Record {
    Train {
        step: u64,
        /// `null` when the loss was NaN (serde_json writes non-finite floats as null).
        loss: Option<f64>,
    },
    Eval {
        step: u64,
        loss: Option<f64>,
        accuracy: Option<f64>,
        unigram_baseline: Option<f64>,
    },
    Summary {
        test_accuracy: Option<f64>,
        eval_loss: Option<f64>,
    },
    /// Kinds added later: skipped, so old `meshtrain plot` binaries still read new runs.
    #[serde(other)]
    Other,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalPoint {
    pub loss: Option<f64>,
    pub accuracy: Option<f64>,
    pub unigram_baseline: Option<f64>,
}

/// What one run logged, by step. A resumed run appends to the same file and repeats steps
/// after the checkpoint: records from the abandoned continuation are dropped, so each step
/// keeps the value of the run that went on.
#[derive(Debug, Default, PartialEq)]
pub struct RunMetrics {
    pub train_loss: BTreeMap<u64, Option<f64>>,
    pub eval: BTreeMap<u64, EvalPoint>,
    pub final_test_accuracy: Option<f64>,
    pub final_eval_loss: Option<f64>,
}

impl RunMetrics {
    /// Parse a metrics.jsonl file; errors name the file and the line.
    pub fn read(path: &Path) -> Result<RunMetrics, PlotError> {
        let text = std::fs::read_to_string(path).map_err(|source| PlotError::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut m = RunMetrics::default();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let record: Record = serde_json::from_str(line).map_err(|e| PlotError::Parse {
                path: path.to_owned(),
                line: i + 1,
                message: e.to_string(),
            })?;
            match record {
                Record::Train { step, loss } => {
                    if m.train_loss
                        .keys()
                        .next_back()
                        .is_some_and(|&last| step <= last)
                    {
                        // Resumed: what was logged from here on belongs to the abandoned run.
                        m.train_loss.split_off(&step);
                        m.eval.split_off(&step);
                    }
                    m.train_loss.insert(step, loss);
                }
                Record::Eval {
                    step,
                    loss,
                    accuracy,
                    unigram_baseline,
                } => {
                    if m.eval.keys().next_back().is_some_and(|&last| step <= last) {
                        // The train record at this very step comes before its evaluation.
                        m.train_loss.split_off(&(step + 1));
                        m.eval.split_off(&step);
                    }
                    let point = EvalPoint {
                        loss,
                        accuracy,
                        unigram_baseline,
                    };
                    m.eval.insert(step, point);
                }
                Record::Summary {
                    test_accuracy,
                    eval_loss,
                } => {
                    m.final_test_accuracy = test_accuracy;
                    m.final_eval_loss = eval_loss;
                }
                Record::Other => {}
            }
        }
        Ok(m)
    }

    /// The figure: a loss panel (train, eval and, for text, the unigram baseline) and, when the
    /// evaluations measured accuracy, an accuracy panel beside it.
    pub fn figure(&self, run_name: &str) -> Option<LinePanels> {
        let finite = |v: &Option<f64>| v.filter(|x| x.is_finite());
        let train: Vec<(f64, f64)> = self
            .train_loss
            .iter()
            .filter_map(|(&s, l)| Some((s as f64, finite(l)?)))
            .collect();
        let eval_loss: Vec<(f64, f64)> = self
            .eval
            .iter()
            .filter_map(|(&s, e)| Some((s as f64, finite(&e.loss)?)))
            .collect();
        let accuracy: Vec<(f64, f64)> = self
            .eval
            .iter()
            .filter_map(|(&s, e)| Some((s as f64, 100.0 * finite(&e.accuracy)?)))
            .collect();
        let baseline = self.eval.values().find_map(|e| finite(&e.unigram_baseline));
        let is_text = baseline.is_some();

        let mut series = Vec::new();
        if !train.is_empty() {
            series.push(Series::new("train loss", train));
        }
        let eval_name = if is_text {
            "validation loss"
        } else {
            "test loss"
        };
        if !eval_loss.is_empty() {
            series.push(Series::new(eval_name, eval_loss).with_style(LineStyle::SolidWithMarkers));
        }
        if series.is_empty() {
            return None;
        }
        if let Some(b) = baseline {
            // Across the steps drawn, so it spans the whole panel.
            let steps = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
            let (lo, hi) = steps.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
                (lo.min(x), hi.max(x))
            });
            series.push(
                Series::new("unigram baseline", vec![(lo, b), (hi, b)])
                    .with_style(LineStyle::Dashed),
            );
        }
        let loss_unit = if is_text {
            "loss (nats/token)"
        } else {
            "cross-entropy loss"
        };
        let mut panels = vec![LineChart {
            title: "loss".into(),
            x_label: "step".into(),
            y_label: loss_unit.into(),
            series,
            ..LineChart::default()
        }];
        if !accuracy.is_empty() {
            panels.push(LineChart {
                title: "test accuracy".into(),
                x_label: "step".into(),
                y_label: "accuracy (%)".into(),
                series: vec![
                    Series::new("test accuracy", accuracy).with_style(LineStyle::SolidWithMarkers)
                ],
                ..LineChart::default()
            });
        }
        let outcome = match (self.final_test_accuracy, self.final_eval_loss) {
            (Some(a), _) => format!(": final test accuracy {:.2}%", a * 100.0),
            (None, Some(l)) if is_text => format!(
                ": final validation loss {l:.3} nats/token (unigram {:.3})",
                baseline.unwrap_or(f64::NAN)
            ),
            _ => String::new(),
        };
        let size = if panels.len() == 1 {
            Size::new(1000, 600)
        } else {
            Size::new(1400, 560)
        };
        Some(LinePanels {
            title: format!("{run_name}{outcome}"),
            panels,
            size,
        })
    }
}

/// `meshtrain plot --metrics runs/lenet/metrics.jsonl --out curves.png`; several `--metrics`
/// overlay their runs in one figure (e.g. the same model in fp32, bf16 and fp16).
#[derive(clap::Args)]
pub struct PlotArgs {
    /// The run's metrics file, e.g. runs/lenet/metrics.jsonl (repeat it to overlay runs; each
    /// is named by its directory).
    #[arg(long, required = true)]
    pub metrics: Vec<PathBuf>,
    /// Where to write the PNG.
    #[arg(long, default_value = "curves.png")]
    pub out: PathBuf,
}

/// The `plot` subcommand.
pub fn run(args: &PlotArgs) -> anyhow::Result<()> {
    plot_runs(&args.metrics, &args.out)?;
    println!("wrote {}", args.out.display());
    Ok(())
}

/// The directory holding a metrics file names its run (`lenet` for `runs/lenet/metrics.jsonl`).
fn run_name(metrics_jsonl: &Path) -> String {
    metrics_jsonl
        .parent()
        .and_then(|d| d.file_name())
        .map_or_else(|| "run".to_owned(), |n| n.to_string_lossy().into_owned())
}

/// Read `metrics_jsonl` and draw its curves into `out_png`.
pub fn plot_metrics(metrics_jsonl: &Path, out_png: &Path) -> Result<(), PlotError> {
    plot_runs(&[metrics_jsonl.to_owned()], out_png)
}

/// Draw one or more runs' curves into `out_png`: one run as [`RunMetrics::figure`] draws it;
/// several overlaid, panel by panel, each series named by its run.
pub fn plot_runs(metrics: &[PathBuf], out_png: &Path) -> Result<(), PlotError> {
    let mut figures = Vec::new();
    let mut finals = Vec::new();
    for path in metrics {
        let name = run_name(path);
        let run = RunMetrics::read(path)?;
        let figure = run
            .figure(&name)
            .ok_or_else(|| PlotError::NoRecords { path: path.clone() })?;
        finals.push(match (run.final_test_accuracy, run.final_eval_loss) {
            (Some(a), _) => format!("{name} {:.2}%", 100.0 * a),
            (None, Some(l)) => format!("{name} {l:.3}"),
            _ => name.clone(),
        });
        figures.push((name, figure));
    }
    let figure = if figures.len() == 1 {
        figures.remove(0).1
    } else {
        let title = overlay_title(&finals);
        overlay(figures, title)
    };
    line_panels(out_png, &figure).map_err(|source| PlotError::Chart {
        path: out_png.to_owned(),
        source,
    })
}

/// The title of several runs in one figure, from each run's final figure ("lenet 88.00%",
/// "gpt 1.234"): what the figures are, named per run when classifiers and language models
/// are mixed.
fn overlay_title(finals: &[String]) -> String {
    let accuracies = finals.iter().filter(|f| f.ends_with('%')).count();
    if accuracies == finals.len() {
        format!("final test accuracy: {}", finals.join(", "))
    } else if accuracies == 0 {
        format!("final evaluation loss: {}", finals.join(", "))
    } else {
        // Classifiers beside language models: each figure says what it is.
        let named: Vec<String> = finals
            .iter()
            .map(|f| match f.rsplit_once(' ') {
                Some((name, v)) if v.ends_with('%') => format!("{name} test accuracy {v}"),
                Some((name, v)) => format!("{name} evaluation loss {v}"),
                None => f.clone(),
            })
            .collect();
        format!("final: {}", named.join(", "))
    }
}

/// Runs' figures merged under `title`: panel i holds every run's panel-i series, named
/// `run: series`; a reference line the runs share (the unigram baseline) is drawn once.
fn overlay(figures: Vec<(String, LinePanels)>, title: String) -> LinePanels {
    let panel_count = figures
        .iter()
        .map(|(_, f)| f.panels.len())
        .max()
        .unwrap_or(0);
    let mut panels: Vec<LineChart> = Vec::new();
    for i in 0..panel_count {
        let mut merged: Option<LineChart> = None;
        for (name, figure) in &figures {
            let Some(panel) = figure.panels.get(i) else {
                continue;
            };
            let target = merged.get_or_insert_with(|| LineChart {
                series: Vec::new(),
                ..panel.clone()
            });
            for series in &panel.series {
                let shared = series.name == "unigram baseline";
                if shared && target.series.iter().any(|s| s.name == series.name) {
                    continue;
                }
                let mut s = series.clone();
                if !shared {
                    s.name = format!("{name}: {}", series.name);
                }
                target.series.push(s);
            }
        }
        panels.extend(merged);
    }
    let size = figures[0].1.size;
    LinePanels {
        title,
        panels,
        size,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::presets::Task;

    fn write(dir: &Path, lines: &[&str]) -> PathBuf {
        let path = dir.join("metrics.jsonl");
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        path
    }

    fn train(step: u64, loss: f64) -> String {
        format!(
            r#"{{"kind":"train","step":{step},"epoch":0.5,"loss":{loss},"lr":0.1,"grad_norm":1.0,"samples_per_s":100.0,"elapsed_s":1.0}}"#
        )
    }

    fn eval_image(step: u64, loss: f64, accuracy: f64) -> String {
        format!(
            r#"{{"kind":"eval","step":{step},"epoch":1.0,"loss":{loss},"accuracy":{accuracy},"perplexity":null,"unigram_baseline":null}}"#
        )
    }

    fn points(s: &Series) -> Vec<(f64, f64)> {
        s.points.clone()
    }

    #[test]
    fn image_run_gets_loss_and_accuracy_panels() {
        let dir = tempfile::tempdir().unwrap();
        let summary = r#"{"kind":"summary","steps":20,"final_train_loss":0.5,"test_accuracy":0.8,"eval_loss":0.6,"unigram_baseline":null,"samples_per_s":1.0,"peak_rss_mb":null,"breakdown":{},"wall_s":1.0}"#;
        let lines = [
            train(10, 1.5),
            eval_image(10, 1.2, 0.7),
            train(20, 0.5),
            eval_image(20, 0.6, 0.8),
            summary.to_owned(),
        ];
        let path = write(
            dir.path(),
            &lines.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        let fig = RunMetrics::read(&path).unwrap().figure("lenet").unwrap();
        assert_eq!(fig.title, "lenet: final test accuracy 80.00%");
        assert_eq!(fig.panels.len(), 2);
        let loss = &fig.panels[0];
        assert_eq!(loss.series.len(), 2);
        assert_eq!(points(&loss.series[0]), [(10.0, 1.5), (20.0, 0.5)]);
        assert_eq!(loss.series[1].name, "test loss");
        assert_eq!(points(&loss.series[1]), [(10.0, 1.2), (20.0, 0.6)]);
        assert_eq!(
            points(&fig.panels[1].series[0]),
            [(10.0, 70.0), (20.0, 80.0)]
        );
    }

    /// Several runs overlay panel by panel, each series named by its run's directory.
    #[test]
    fn an_overlay_title_says_what_each_figure_is() {
        let f = |v: &[&str]| overlay_title(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(
            f(&["a 80.00%", "b 90.00%"]),
            "final test accuracy: a 80.00%, b 90.00%"
        );
        assert_eq!(f(&["gpt 1.234"]), "final evaluation loss: gpt 1.234");
        assert_eq!(
            f(&["lenet 88.00%", "gpt 1.234"]),
            "final: lenet test accuracy 88.00%, gpt evaluation loss 1.234"
        );
    }

    #[test]
    fn runs_overlay_in_one_figure() {
        let root = tempfile::tempdir().unwrap();
        let mut figures = Vec::new();
        for (name, loss) in [("gpt-fp32", 1.0), ("gpt-bf16", 1.1)] {
            let dir = root.path().join(name);
            std::fs::create_dir(&dir).unwrap();
            let lines = [train(10, loss), eval_image(10, loss, 0.5)];
            let path = write(&dir, &lines.iter().map(String::as_str).collect::<Vec<_>>());
            figures.push((
                run_name(&path),
                RunMetrics::read(&path).unwrap().figure(name).unwrap(),
            ));
        }
        let fig = overlay(figures, "two runs".into());
        assert_eq!(fig.title, "two runs");
        assert_eq!(fig.panels.len(), 2);
        let names: Vec<&str> = fig.panels[0]
            .series
            .iter()
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(
            names,
            [
                "gpt-fp32: train loss",
                "gpt-fp32: test loss",
                "gpt-bf16: train loss",
                "gpt-bf16: test loss"
            ]
        );
        assert_eq!(points(&fig.panels[0].series[2]), [(10.0, 1.1)]);
        assert_eq!(fig.panels[1].series.len(), 2);
        let out = root.path().join("overlay.png");
        let paths: Vec<PathBuf> = ["gpt-fp32", "gpt-bf16"]
            .iter()
            .map(|n| root.path().join(n).join("metrics.jsonl"))
            .collect();
        plot_runs(&paths, &out).unwrap();
        assert!(std::fs::metadata(&out).unwrap().len() > 1000);
    }

    #[test]
    fn resumed_run_keeps_the_continuation_that_went_on() {
        let dir = tempfile::tempdir().unwrap();
        // First run: steps 10..30 (eval at 20), crashed; resumed from the step-20 checkpoint.
        let lines = [
            train(10, 3.0),
            train(20, 2.0),
            eval_image(20, 2.1, 0.5),
            train(30, 9.0), // abandoned
            train(30, 1.0),
            train(40, 0.5),
            eval_image(40, 0.7, 0.9),
        ];
        let path = write(
            dir.path(),
            &lines.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        let m = RunMetrics::read(&path).unwrap();
        let kept: Vec<_> = m.train_loss.iter().map(|(&s, l)| (s, l.unwrap())).collect();
        assert_eq!(kept, [(10, 3.0), (20, 2.0), (30, 1.0), (40, 0.5)]);
        assert_eq!(m.eval.keys().copied().collect::<Vec<_>>(), [20, 40]);

        // Resumed from step 10 after the first run reached an eval at 20: both are replaced.
        let lines = [
            train(10, 3.0),
            train(20, 8.0),
            eval_image(20, 8.1, 0.1),
            train(20, 2.0),
            eval_image(20, 2.1, 0.5),
        ];
        let path = write(
            dir.path(),
            &lines.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        let m = RunMetrics::read(&path).unwrap();
        assert_eq!(m.train_loss[&20], Some(2.0));
        assert_eq!(m.eval[&20].loss, Some(2.1));
    }

    #[test]
    fn nan_losses_are_skipped_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let nan = r#"{"kind":"train","step":30,"epoch":1.0,"loss":null,"lr":0.1,"grad_norm":null,"samples_per_s":1.0,"elapsed_s":1.0}"#;
        let path = write(dir.path(), &[&train(10, 2.0), &train(20, 1.0), nan]);
        let fig = RunMetrics::read(&path).unwrap().figure("x").unwrap();
        assert_eq!(fig.panels.len(), 1);
        assert_eq!(points(&fig.panels[0].series[0]), [(10.0, 2.0), (20.0, 1.0)]);
    }

    #[test]
    fn bad_files_name_the_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.jsonl");
        let err = plot_metrics(&missing, &dir.path().join("out.png")).unwrap_err();
        assert!(matches!(err, PlotError::Read { .. }));
        assert!(err.to_string().contains("nope.jsonl"), "{err}");

        let path = write(
            dir.path(),
            &[&train(10, 2.0), "{\"kind\":\"train\",\"step\":"],
        );
        let err = plot_metrics(&path, &dir.path().join("out.png")).unwrap_err();
        assert!(matches!(err, PlotError::Parse { line: 2, .. }), "{err}");
        assert!(err.to_string().contains("metrics.jsonl"), "{err}");

        let path = write(dir.path(), &[r#"{"kind":"train","step":"ten","loss":1.0}"#]);
        assert!(matches!(
            plot_metrics(&path, &dir.path().join("out.png")),
            Err(PlotError::Parse { line: 1, .. })
        ));

        let path = write(dir.path(), &[r#"{"kind":"summary","test_accuracy":0.5}"#]);
        assert!(matches!(
            plot_metrics(&path, &dir.path().join("out.png")),
            Err(PlotError::NoRecords { .. })
        ));

        let path = write(dir.path(), &[&train(10, 2.0)]);
        let err = plot_metrics(&path, &dir.path().join("no-dir").join("out.png")).unwrap_err();
        assert!(matches!(err, PlotError::Chart { .. }));
        assert!(err.to_string().contains("out.png"), "{err}");
    }

    /// PNG width and height from the IHDR chunk, which always follows the 8-byte signature.
    fn png_size(bytes: &[u8]) -> (u32, u32) {
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&bytes[12..16], b"IHDR");
        let be = |b: &[u8]| u32::from_be_bytes(b.try_into().unwrap());
        (be(&bytes[16..20]), be(&bytes[20..24]))
    }

    /// The schema we parse is the one the trainer writes: train a tiny GPT for a few steps and
    /// plot what it logged.
    #[test]
    fn plots_what_the_trainer_writes() {
        let dir = tempfile::tempdir().unwrap();
        let config = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/gpt.toml"),
        )
        .unwrap();
        let overrides: Vec<String> = [
            "model.dim=32",
            "model.layers=1",
            "model.seq=16",
            "train.batch_size=4",
            "train.steps=6",
            "train.eval_every=3",
            "train.eval_batches=2",
            "train.log_every=2",
            "train.threads=1",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("train.out_dir=\"{}\"", dir.path().display())])
        .collect();
        let cfg = Config::from_toml_with_overrides(&config, &overrides).unwrap();
        let task = Task::load(&cfg).unwrap();
        cfg.job(&task)
            .unwrap()
            .run(&meshtrain_train::RunOptions::default())
            .unwrap();

        let metrics = dir.path().join("metrics.jsonl");
        let m = RunMetrics::read(&metrics).unwrap();
        assert_eq!(m.train_loss.keys().copied().collect::<Vec<_>>(), [2, 4, 6]);
        assert_eq!(m.eval.keys().copied().collect::<Vec<_>>(), [3, 6]);
        let fig = m.figure("gpt").unwrap();
        let names: Vec<&str> = fig.panels[0]
            .series
            .iter()
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(names, ["train loss", "validation loss", "unigram baseline"]);
        assert_eq!(fig.panels.len(), 1, "text runs have no accuracy panel");

        let out = dir.path().join("curves.png");
        plot_metrics(&metrics, &out).unwrap();
        assert_eq!(png_size(&std::fs::read(&out).unwrap()), (1000, 600));
    }
}
