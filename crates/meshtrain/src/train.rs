//! The single-worker training loop: batches, forward, loss, backward, clipping, optimizer,
//! schedule, evaluation, metrics, checkpoints and a step-time breakdown.
//!
//! Every step's data is a pure function of (seed, step) — image batches come from the seeded
//! permutation of their epoch, text windows from a sampler seeded by the step — so a resumed
//! run sees exactly the batches an uninterrupted run would, and ends bit-identical.

use crate::checkpoint::{self, TrainState};
use crate::config::{Config, ModelConfig};
use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use meshtrain_data::{
    unigram_entropy_nats, EpochShuffler, FashionMnist, ImageDataset, Normalization, ResolveOptions,
    SplitMix64, TextBatchSampler, TextCorpus,
};
use meshtrain_nn::models::{gpt, lenet, resnet};
use meshtrain_nn::optim::{clip_grad_norm, Optimizer};
use meshtrain_nn::schedule::{scale_lr_linearly, Schedule};
use meshtrain_nn::{Mode, Model, ParamStore};
use meshtrain_tensor::loss::softmax_cross_entropy;
use meshtrain_tensor::Tensor;
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

pub fn build_model(cfg: &ModelConfig) -> Model {
    match cfg {
        ModelConfig::Lenet { variant } => lenet::lenet(*variant),
        ModelConfig::Resnet18 { width } => resnet::resnet18(*width, 10),
        ModelConfig::Gpt(g) => gpt::gpt(g),
    }
}

/// The data a run trains on.
pub enum Task {
    Images { data: FashionMnist },
    Text { corpus: TextCorpus, seq: usize },
}

impl Task {
    pub fn load(cfg: &Config) -> Result<Task> {
        Ok(match &cfg.model {
            ModelConfig::Gpt(g) => Task::Text {
                corpus: TextCorpus::shakespeare().context("loading the Shakespeare corpus")?,
                seq: g.seq,
            },
            _ => {
                let opts = ResolveOptions::from_env(cfg.data.data_dir.clone());
                let mut data = FashionMnist::load(&opts, Normalization::FASHION_MNIST)
                    .context("loading Fashion-MNIST")?;
                if let Some(n) = cfg.data.train_limit {
                    truncate(&mut data.train, n);
                }
                if let Some(n) = cfg.data.test_limit {
                    truncate(&mut data.test, n);
                }
                Task::Images { data }
            }
        })
    }

    pub fn describe(&self) -> String {
        match self {
            Task::Images { data } => format!(
                "Fashion-MNIST from {} ({} train / {} test images)",
                data.source, data.train.n, data.test.n
            ),
            Task::Text { corpus, .. } => format!(
                "Shakespeare bytes ({} train / {} validation)",
                corpus.train.len(),
                corpus.val.len()
            ),
        }
    }
}

fn truncate(d: &mut ImageDataset, n: usize) {
    let n = n.min(d.n);
    d.images.truncate(n * d.sample_len());
    d.labels.truncate(n);
    d.n = n;
}

/// One training batch: model input, integer targets, and the number of samples.
pub struct Batch {
    pub x: Tensor,
    pub y: Vec<u32>,
    pub samples: usize,
}

/// Where a step's time went (seconds, summed over the run).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Breakdown {
    pub data_s: f64,
    pub forward_s: f64,
    pub backward_s: f64,
    pub optimizer_s: f64,
    pub eval_s: f64,
    pub checkpoint_s: f64,
    pub steps: u64,
}

impl Breakdown {
    pub fn report(&self) -> String {
        let n = self.steps.max(1) as f64;
        let compute = self.forward_s + self.backward_s + self.optimizer_s;
        let step = compute + self.data_s;
        format!(
            "per step: {:.1} ms = compute {:.1} ms (forward {:.1}, backward {:.1}, optimizer {:.1}) + data {:.1} ms; \
             communication 0 (single worker); eval {:.1} s, checkpoints {:.1} s in total",
            step / n * 1e3,
            compute / n * 1e3,
            self.forward_s / n * 1e3,
            self.backward_s / n * 1e3,
            self.optimizer_s / n * 1e3,
            self.data_s / n * 1e3,
            self.eval_s,
            self.checkpoint_s
        )
    }
}

/// What a finished run reports.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub steps: u64,
    pub final_train_loss: f32,
    /// Image models: test accuracy of the last evaluation.
    pub test_accuracy: Option<f64>,
    /// Last evaluation loss (test for images, validation for text).
    pub eval_loss: Option<f64>,
    /// Text: unigram entropy of the validation split, the loss of a model that ignores context.
    pub unigram_baseline: Option<f64>,
    pub samples_per_s: f64,
    pub peak_rss_mb: Option<f64>,
    pub breakdown: Breakdown,
    pub wall_s: f64,
}

pub struct Trainer {
    pub cfg: Config,
    pub model: Model,
    pub store: ParamStore,
    pub optimizer: Optimizer,
    pub schedule: Schedule,
    pub task: Task,
    pub step: u64,
    pub total_steps: u64,
    steps_per_epoch: u64,
    epoch_order: Option<(u64, Vec<usize>)>,
    pool: rayon::ThreadPool,
    pub breakdown: Breakdown,
    metrics: Option<std::fs::File>,
    pub show_progress: bool,
}

#[derive(Serialize)]
struct TrainRecord {
    kind: &'static str,
    step: u64,
    epoch: f64,
    loss: f32,
    lr: f32,
    grad_norm: f32,
    samples_per_s: f64,
    elapsed_s: f64,
}

#[derive(Serialize)]
struct EvalRecord {
    kind: &'static str,
    step: u64,
    epoch: f64,
    loss: f64,
    accuracy: Option<f64>,
    perplexity: Option<f64>,
    unigram_baseline: Option<f64>,
}

impl Trainer {
    pub fn new(cfg: Config, task: Task) -> Result<Trainer> {
        let model = build_model(&cfg.model);
        let store = model.init(cfg.train.seed);
        let optimizer = Optimizer::new(cfg.optimizer, model.num_params());
        let bs = cfg.train.batch_size as u64;
        let (steps_per_epoch, total_steps) = match &task {
            Task::Images { data } => {
                let spe = data.train.n as u64 / bs;
                anyhow::ensure!(
                    spe > 0,
                    "batch size {bs} is larger than the {} training images",
                    data.train.n
                );
                (spe, spe * cfg.train.epochs.unwrap_or(1))
            }
            Task::Text { .. } => (0, cfg.train.steps.unwrap_or(0)),
        };
        let s = &cfg.schedule;
        let base_lr = match s.reference_batch {
            Some(r) => scale_lr_linearly(s.lr, r, cfg.train.batch_size),
            None => s.lr,
        };
        let schedule = Schedule {
            base_lr,
            warmup_steps: s.warmup_steps,
            total_steps,
            min_lr_fraction: s.min_lr_fraction,
        };
        let threads = cfg
            .train
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        Ok(Trainer {
            pool: meshtrain_tensor::par::pool(threads),
            cfg,
            model,
            store,
            optimizer,
            schedule,
            task,
            step: 0,
            total_steps,
            steps_per_epoch,
            epoch_order: None,
            breakdown: Breakdown::default(),
            metrics: None,
            show_progress: false,
        })
    }

    /// Continue from a checkpoint written by [`Trainer::save_checkpoint`].
    pub fn resume(&mut self, path: &std::path::Path) -> Result<()> {
        self.step = checkpoint::load(path, &self.model, &mut self.store, &mut self.optimizer)?;
        Ok(())
    }

    pub fn save_checkpoint(&mut self, path: &std::path::Path) -> Result<()> {
        let t = Instant::now();
        let config_toml = toml::to_string(&self.cfg).unwrap_or_default();
        checkpoint::save(
            path,
            &TrainState {
                model: &self.model,
                store: &self.store,
                optimizer: &self.optimizer,
                step: self.step,
                config_toml: &config_toml,
            },
        )?;
        self.breakdown.checkpoint_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    fn out_dir(&self) -> PathBuf {
        self.cfg.train.out_dir.clone()
    }

    pub fn checkpoint_path(&self) -> PathBuf {
        self.out_dir().join("checkpoint.safetensors")
    }

    fn epoch_of(&self, step: u64) -> f64 {
        if self.steps_per_epoch == 0 {
            0.0
        } else {
            step as f64 / self.steps_per_epoch as f64
        }
    }

    /// The batch of global step `step` (a pure function of the seed and the step).
    pub fn batch(&mut self, step: u64) -> Result<Batch> {
        let bs = self.cfg.train.batch_size;
        let seed = self.cfg.train.seed;
        match &self.task {
            Task::Images { data } => {
                let epoch = step / self.steps_per_epoch;
                let in_epoch = (step % self.steps_per_epoch) as usize;
                if self.epoch_order.as_ref().map(|(e, _)| *e) != Some(epoch) {
                    let order = EpochShuffler::new(data.train.n, seed).permutation(epoch);
                    self.epoch_order = Some((epoch, order));
                }
                let order = &self.epoch_order.as_ref().expect("epoch order").1;
                let idx = &order[in_epoch * bs..(in_epoch + 1) * bs];
                let d = &data.train;
                let mut x = vec![0.0f32; bs * d.sample_len()];
                let mut y = vec![0u32; bs];
                d.batch(idx, &mut x, &mut y)?;
                Ok(Batch {
                    x: Tensor::from_vec(x, &[bs, d.channels, d.height, d.width]),
                    y,
                    samples: bs,
                })
            }
            Task::Text { corpus, seq } => {
                let stream = SplitMix64::derive(seed, step).next_u64();
                text_batch(&corpus.train, bs, *seq, stream)
            }
        }
    }

    /// One optimisation step on `batch`; returns (loss, gradient norm before clipping).
    pub fn train_step(&mut self, batch: &Batch) -> (f32, f32) {
        let classes = self.num_classes();
        let lr = self.schedule.lr(self.step);
        let clip = self.cfg.train.grad_clip;
        let recompute = self.cfg.train.recompute;
        let (model, store, opt, bd) = (
            &self.model,
            &mut self.store,
            &mut self.optimizer,
            &mut self.breakdown,
        );
        let result = self.pool.install(|| {
            let t0 = Instant::now();
            let blocks = 0..model.num_blocks();
            let (logits, acts) =
                model.forward(store, batch.x.clone(), blocks, Mode::TRAIN, &|_| recompute);
            let (loss, dlogits, _) = softmax_cross_entropy(logits.data(), classes, &batch.y, 1.0);
            let t1 = Instant::now();
            model.backward(
                store,
                acts,
                Tensor::from_vec(dlogits, logits.shape()),
                false,
                &mut |_, _| {},
            );
            let t2 = Instant::now();
            let norm = match clip {
                Some(c) => clip_grad_norm(&mut store.grads, c),
                None => meshtrain_nn::optim::grad_norm(&store.grads),
            };
            opt.step(&mut store.values, &store.grads, lr);
            store.zero_grads();
            let t3 = Instant::now();
            bd.forward_s += (t1 - t0).as_secs_f64();
            bd.backward_s += (t2 - t1).as_secs_f64();
            bd.optimizer_s += (t3 - t2).as_secs_f64();
            (loss, norm)
        });
        self.breakdown.steps += 1;
        self.step += 1;
        result
    }

    fn num_classes(&self) -> usize {
        match &self.cfg.model {
            ModelConfig::Gpt(g) => g.vocab,
            _ => 10,
        }
    }

    /// Evaluate: image models on the whole test set (loss, accuracy); GPT on fixed validation
    /// windows (loss, perplexity).
    pub fn evaluate(&mut self) -> Result<(f64, Option<f64>)> {
        let t = Instant::now();
        let classes = self.num_classes();
        let (model, store) = (&self.model, &mut self.store);
        let result = match &self.task {
            Task::Images { data } => {
                let d = &data.test;
                let chunk = 500;
                let (mut loss_sum, mut correct) = (0.0f64, 0usize);
                let mut start = 0;
                while start < d.n {
                    let n = chunk.min(d.n - start);
                    let idx: Vec<usize> = (start..start + n).collect();
                    let mut x = vec![0.0f32; n * d.sample_len()];
                    let mut y = vec![0u32; n];
                    d.batch(&idx, &mut x, &mut y)?;
                    let x = Tensor::from_vec(x, &[n, d.channels, d.height, d.width]);
                    let (l, c) = self.pool.install(|| {
                        let (logits, _) = model.forward_all(store, x, Mode::EVAL);
                        let (l, _, c) = softmax_cross_entropy(logits.data(), classes, &y, 1.0);
                        (l, c)
                    });
                    loss_sum += l as f64 * n as f64;
                    correct += c;
                    start += n;
                }
                (loss_sum / d.n as f64, Some(correct as f64 / d.n as f64))
            }
            Task::Text { corpus, seq } => {
                let bs = self.cfg.train.batch_size;
                let mut loss_sum = 0.0f64;
                let batches = self.cfg.train.eval_batches.max(1);
                for i in 0..batches {
                    let b = text_batch(&corpus.val, bs, *seq, 0xE7A1 + i as u64)?;
                    let l = self.pool.install(|| {
                        let (logits, _) = model.forward_all(store, b.x, Mode::EVAL);
                        softmax_cross_entropy(logits.data(), classes, &b.y, 1.0).0
                    });
                    loss_sum += l as f64;
                }
                (loss_sum / batches as f64, None)
            }
        };
        self.breakdown.eval_s += t.elapsed().as_secs_f64();
        Ok(result)
    }

    fn write_metric<T: Serialize>(&mut self, record: &T) -> Result<()> {
        if let Some(f) = self.metrics.as_mut() {
            serde_json::to_writer(&mut *f, record)?;
            f.write_all(b"\n")?;
        }
        Ok(())
    }

    fn eval_and_log(
        &mut self,
        pb: &ProgressBar,
        last: &mut (Option<f64>, Option<f64>),
    ) -> Result<()> {
        let (loss, acc) = self.evaluate()?;
        let baseline = match &self.task {
            Task::Text { corpus, .. } => Some(unigram_entropy_nats(&corpus.val)),
            _ => None,
        };
        let record = EvalRecord {
            kind: "eval",
            step: self.step,
            epoch: self.epoch_of(self.step),
            loss,
            accuracy: acc,
            perplexity: baseline.map(|_| loss.exp()),
            unigram_baseline: baseline,
        };
        let line = match (acc, baseline) {
            (Some(a), _) => format!("eval step {}: test loss {loss:.4}, test accuracy {:.2}%", self.step, a * 100.0),
            (_, Some(b)) => format!(
                "eval step {}: val loss {loss:.4} nats/char (perplexity {:.2}); unigram baseline {b:.4}",
                self.step,
                loss.exp()
            ),
            _ => format!("eval step {}: loss {loss:.4}", self.step),
        };
        if self.show_progress {
            pb.println(line);
        } else {
            println!("{line}");
        }
        self.write_metric(&record)?;
        *last = (Some(loss), acc);
        Ok(())
    }

    /// Run to the end of the schedule (or `train.max_steps`), evaluating, logging and
    /// checkpointing as configured.
    pub fn run(&mut self) -> Result<Summary> {
        let out = self.out_dir();
        std::fs::create_dir_all(&out)
            .with_context(|| format!("creating output dir {}", out.display()))?;
        let metrics_path = out.join("metrics.jsonl");
        self.metrics = Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&metrics_path)
                .with_context(|| format!("opening {}", metrics_path.display()))?,
        );
        let stop = self
            .cfg
            .train
            .max_steps
            .map_or(self.total_steps, |m| m.min(self.total_steps));
        let pb = if self.show_progress {
            ProgressBar::new(stop)
        } else {
            ProgressBar::hidden()
        };
        pb.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} steps [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .expect("progress template"),
        );
        pb.set_position(self.step);
        let started = Instant::now();
        let first_step = self.step;
        let (mut window_t, mut window_samples) = (Instant::now(), 0usize);
        let mut last_eval = (None, None);
        let mut last_loss = f32::NAN;
        let mut samples_total = 0usize;
        let compute_start = self.breakdown.clone();
        while self.step < stop {
            let t = Instant::now();
            let batch = self.batch(self.step)?;
            self.breakdown.data_s += t.elapsed().as_secs_f64();
            let lr = self.schedule.lr(self.step);
            let (loss, norm) = self.train_step(&batch);
            anyhow::ensure!(
                loss.is_finite(),
                "training diverged at step {}: loss is {loss}",
                self.step
            );
            last_loss = loss;
            window_samples += batch.samples;
            samples_total += batch.samples;
            pb.inc(1);
            if self.step.is_multiple_of(self.cfg.train.log_every) || self.step == stop {
                let sps = window_samples as f64 / window_t.elapsed().as_secs_f64();
                pb.set_message(format!("loss {loss:.4} | {sps:.0} samples/s"));
                if !self.show_progress {
                    println!(
                        "step {:>6} epoch {:>5.2} loss {loss:.4} lr {lr:.2e} {sps:.0} samples/s",
                        self.step,
                        self.epoch_of(self.step)
                    );
                }
                let rec = TrainRecord {
                    kind: "train",
                    step: self.step,
                    epoch: self.epoch_of(self.step),
                    loss,
                    lr,
                    grad_norm: norm,
                    samples_per_s: sps,
                    elapsed_s: started.elapsed().as_secs_f64(),
                };
                self.write_metric(&rec)?;
                (window_t, window_samples) = (Instant::now(), 0);
            }
            let epoch_end =
                self.steps_per_epoch > 0 && self.step.is_multiple_of(self.steps_per_epoch);
            let eval_due = match self.cfg.train.eval_every {
                Some(e) if e > 0 => self.step.is_multiple_of(e),
                _ => epoch_end,
            };
            if eval_due || self.step == self.total_steps {
                self.eval_and_log(&pb, &mut last_eval)?;
            }
            if let Some(every) = self.cfg.checkpoint.every_steps.filter(|&e| e > 0) {
                if self.step.is_multiple_of(every) {
                    let p = self.checkpoint_path();
                    self.save_checkpoint(&p)?;
                }
            }
        }
        pb.finish_and_clear();
        if self.step > first_step {
            let p = self.checkpoint_path();
            self.save_checkpoint(&p)?;
        }
        let bd = &self.breakdown;
        let compute = (bd.forward_s - compute_start.forward_s)
            + (bd.backward_s - compute_start.backward_s)
            + (bd.optimizer_s - compute_start.optimizer_s)
            + (bd.data_s - compute_start.data_s);
        let summary = Summary {
            steps: self.step,
            final_train_loss: last_loss,
            test_accuracy: last_eval.1,
            eval_loss: last_eval.0,
            unigram_baseline: match &self.task {
                Task::Text { corpus, .. } => Some(unigram_entropy_nats(&corpus.val)),
                _ => None,
            },
            samples_per_s: samples_total as f64 / compute.max(1e-9),
            peak_rss_mb: peak_rss_mb(),
            breakdown: self.breakdown.clone(),
            wall_s: started.elapsed().as_secs_f64(),
        };
        #[derive(Serialize)]
        struct Tagged<'a> {
            kind: &'static str,
            #[serde(flatten)]
            summary: &'a Summary,
        }
        self.write_metric(&Tagged {
            kind: "summary",
            summary: &summary,
        })?;
        Ok(summary)
    }
}

/// A batch of `bs` random windows of `seq + 1` bytes from `data`, seeded by `seed`.
fn text_batch(data: &[u8], bs: usize, seq: usize, seed: u64) -> Result<Batch> {
    let mut sampler = TextBatchSampler::new(bs, seq, seed)?;
    let mut inputs = vec![0u32; bs * seq];
    let mut targets = vec![0u32; bs * seq];
    sampler.sample(data, &mut inputs, &mut targets)?;
    Ok(Batch {
        x: Tensor::from_vec(inputs.iter().map(|&v| v as f32).collect(), &[bs, seq]),
        y: targets,
        samples: bs,
    })
}

/// Peak resident memory of this process (Linux `VmHWM`), in MiB.
pub fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}
