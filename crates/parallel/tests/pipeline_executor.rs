//! The stage executor on real models: the gradient-ready hook, activation memory, clean
//! errors (before work, and from a failing peer), stage-local stores and the timeline.

use meshtrain_comm::{CommConfig, ProcessGroup, ThreadsWorld};
use meshtrain_nn::models::{gpt, GptConfig};
use meshtrain_nn::{Mode, Model};
use meshtrain_parallel::engine::{
    MicroBatches, NoHooks, Partition, PipelineError, Schedule, ScheduleKind, Stage, StepOptions,
};
use meshtrain_parallel::pipeline::bench::BenchModel;
use meshtrain_parallel::timeline::{chrome_trace, idle_fraction, Category, Span, Timeline};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const CFG: GptConfig = GptConfig {
    vocab: 32,
    dim: 16,
    layers: 4,
    heads: 2,
    seq: 8,
    tie_embeddings: false,
    attention: meshtrain_nn::transformer::AttentionKind::Standard,
    gelu: meshtrain_nn::models::gpt::Gelu::Erf,
};
const GPT: BenchModel = BenchModel::Gpt(CFG);

fn options(recompute: bool) -> StepOptions {
    StepOptions {
        recompute,
        ..StepOptions::new(GPT.loss())
    }
}

/// Runs one step of `kind` on `p` workers; `f` sees each worker's stage and its result.
fn one_step<T: Send + 'static>(
    kind: ScheduleKind,
    p: usize,
    m: usize,
    f: impl Fn(&Model, &mut Stage, &dyn ProcessGroup, &MicroBatches) -> Result<T, PipelineError>
        + Send
        + Sync
        + 'static,
) -> Vec<T> {
    let config = CommConfig::default().with_timeout(Duration::from_secs(20));
    ThreadsWorld::run(p, config, move |group| {
        let model = gpt::gpt(&CFG);
        let schedule = Schedule::new(kind, p, m)?;
        let partition = Partition::by_params(&model, schedule.num_chunks())?;
        let mut stage = Stage::new(&model, &partition, schedule, group.rank(), 1)?;
        let (x, y) = GPT.batch(2 * m, 1, 0);
        let micro = MicroBatches::split(&x, &y, m)?;
        f(&model, &mut stage, group.as_ref(), &micro)
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn grads_ready_fires_once_per_block_with_final_gradients() {
    for kind in [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved {
            chunks_per_worker: 2,
        },
    ] {
        let results = one_step(kind, 2, 4, |model, stage, group, micro| {
            let mut seen: Vec<(usize, usize, Vec<f32>)> = Vec::new();
            stage.run_step(
                model,
                group,
                micro.clone(),
                &options(false),
                None,
                &mut |ready: meshtrain_parallel::engine::GradsReady<'_>| {
                    let grads = ready.store.grads[ready.range.clone()].to_vec();
                    seen.push((ready.chunk, ready.block, grads));
                },
            )?;
            let mut count: HashMap<usize, usize> = HashMap::new();
            for (chunk, block, grads) in &seen {
                *count.entry(*block).or_default() += 1;
                let c = stage.chunks.iter().find(|c| c.index == *chunk).unwrap();
                assert!(c.blocks.contains(block));
                let base = model.blocks_param_range(c.blocks.clone()).start;
                let r = model.block_param_range(*block);
                let now = &c.store.grads[r.start - base..r.end - base];
                assert_eq!(
                    grads.as_slice(),
                    now,
                    "block {block} changed after its hook"
                );
                assert!(grads.is_empty() || grads.iter().any(|&g| g != 0.0));
            }
            let mine: Vec<usize> = stage.chunks.iter().flat_map(|c| c.blocks.clone()).collect();
            for b in &mine {
                assert_eq!(
                    count.get(b),
                    Some(&1),
                    "block {b} reported {:?} times",
                    count.get(b)
                );
            }
            assert_eq!(seen.len(), mine.len());
            Ok(())
        });
        assert_eq!(results.len(), 2, "{kind}");
    }
}

/// Activation bytes one micro-batch leaves on a stage, measured by a plain forward.
fn bytes_per_micro(model: &Model, stage: &Stage, micro: &MicroBatches, recompute: bool) -> usize {
    assert_eq!(stage.chunks.len(), 1);
    let c = &stage.chunks[0];
    let mut store = model.init(1);
    let mut x = micro.inputs[0].clone();
    if c.blocks.start > 0 {
        x = model
            .forward(&mut store, x, 0..c.blocks.start, Mode::TRAIN, &|_| false)
            .0;
    }
    let (_, acts) = model.forward(&mut store, x, c.blocks.clone(), Mode::TRAIN, &|_| recompute);
    acts.bytes()
}

#[test]
fn peak_activations_gpipe_holds_m_1f1b_holds_p_minus_rank() {
    let (p, m) = (3, 6);
    for (kind, recompute) in [
        (ScheduleKind::GPipe, false),
        (ScheduleKind::OneFOneB, false),
        (ScheduleKind::OneFOneB, true),
    ] {
        let peaks = one_step(kind, p, m, move |model, stage, group, micro| {
            let report = stage.run_step(
                model,
                group,
                micro.clone(),
                &options(recompute),
                None,
                &mut NoHooks,
            )?;
            let one = bytes_per_micro(model, stage, micro, recompute);
            Ok((report.peak_activation_bytes, one, stage.rank()))
        });
        for (peak, one, rank) in peaks {
            let in_flight = match kind {
                ScheduleKind::GPipe => m,
                _ => (p - rank).min(m),
            };
            assert!(one > 0);
            assert_eq!(
                peak,
                in_flight * one,
                "{kind} recompute={recompute} rank {rank}"
            );
        }
    }
}

#[test]
fn impossible_layouts_fail_before_any_work() {
    let model = gpt::gpt(&CFG); // 6 blocks
    let v2 = ScheduleKind::Interleaved {
        chunks_per_worker: 2,
    };
    let schedule = Schedule::new(v2, 4, 4).unwrap();
    let err = Partition::by_params(&model, schedule.num_chunks()).unwrap_err();
    assert!(
        matches!(
            err,
            PipelineError::TooFewBlocks {
                blocks: 6,
                chunks: 8
            }
        ),
        "{err}"
    );
    let three = Partition::by_params(&model, 3).unwrap();
    let err = Stage::new(&model, &three, schedule.clone(), 0, 1).unwrap_err();
    assert!(matches!(err, PipelineError::TooFewBlocks { .. }), "{err}");
    let two = Schedule::new(ScheduleKind::OneFOneB, 2, 4).unwrap();
    let err = Stage::new(&model, &three, two.clone(), 0, 1).unwrap_err();
    assert!(matches!(err, PipelineError::SizeMismatch { .. }), "{err}");
    let halves = Partition::by_params(&model, 2).unwrap();
    let err = Stage::new(&model, &halves, two, 2, 1).unwrap_err();
    assert!(
        matches!(
            err,
            PipelineError::RankOutOfRange {
                rank: 2,
                workers: 2
            }
        ),
        "{err}"
    );
    let (x, y) = GPT.batch(8, 1, 0);
    let err = MicroBatches::split(&x, &y, 3).unwrap_err();
    assert!(matches!(
        err,
        PipelineError::BatchNotDivisible {
            batch: 8,
            micro_batches: 3
        }
    ));
}

/// A stage whose step fails (no targets on the last stage) makes its peers fail with a
/// communication error within moments, instead of hanging until a timeout.
#[test]
fn a_failing_stage_becomes_an_error_on_every_worker() {
    let started = Instant::now();
    let config = CommConfig::default().with_timeout(Duration::from_secs(30));
    let err = ThreadsWorld::run(3, config, |group| {
        let model = gpt::gpt(&CFG);
        let schedule = Schedule::new(ScheduleKind::OneFOneB, 3, 2)?;
        let partition = Partition::by_params(&model, 3)?;
        let mut stage = Stage::new(&model, &partition, schedule, group.rank(), 1)?;
        let (x, y) = GPT.batch(8, 1, 0);
        let mut micro = MicroBatches::split(&x, &y, 2)?;
        if group.rank() == 2 {
            micro.targets.clear();
        }
        stage.run_step(
            &model,
            group.as_ref(),
            micro,
            &options(false),
            None,
            &mut NoHooks,
        )
    })
    .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(err.failures.len(), 3, "{err}");
    let text = err.to_string();
    assert!(text.contains("targets on the last stage"), "{text}");
    assert!(text.contains("stopped"), "{text}");
}

#[test]
fn a_group_of_the_wrong_size_is_an_error() {
    let err = ThreadsWorld::run(3, CommConfig::default(), |group| {
        let model = gpt::gpt(&CFG);
        let schedule = Schedule::new(ScheduleKind::GPipe, 2, 2)?;
        let partition = Partition::by_params(&model, 2)?;
        let mut stage = Stage::new(&model, &partition, schedule, group.rank().min(1), 1)?;
        let micro = MicroBatches::default();
        stage.run_step(
            &model,
            group.as_ref(),
            micro,
            &options(false),
            None,
            &mut NoHooks,
        )
    })
    .unwrap_err();
    assert!(
        err.to_string().contains("the pipeline group has 3 ranks"),
        "{err}"
    );
}

#[test]
fn stage_local_stores_are_slices_of_the_whole_model() {
    for model in [gpt::gpt(&CFG), BenchModel::Resnet { width: 4 }.build()] {
        let full = model.init(9);
        let n = model.num_blocks();
        for start in 0..n {
            for end in start + 1..=n {
                let local = model.init_blocks(9, start..end);
                assert_eq!(
                    local,
                    model.slice_store(&full, start..end),
                    "{start}..{end}"
                );
            }
        }
        let mut whole = full.clone();
        let (x, _) = GPT.batch(2, 3, 0);
        let x = match model.num_blocks() {
            6 => x,
            _ => BenchModel::Resnet { width: 4 }.batch(2, 3, 0).0,
        };
        let (expect, _) = model.forward_all(&mut whole, x.clone(), Mode::TRAIN);
        let mut h = x;
        for range in [0..2, 2..n] {
            let mut local = model.slice_store(&full, range.clone());
            h = model
                .forward_local(&mut local, h, range, Mode::TRAIN, &|_| false)
                .0;
        }
        assert_eq!(h.data(), expect.data());
    }
}

#[test]
fn timeline_spans_and_chrome_trace() {
    let spans: Vec<Vec<Span>> = one_step(
        ScheduleKind::OneFOneB,
        2,
        2,
        |model, stage, group, micro| {
            let mut timeline = Timeline::new(group.rank(), Instant::now());
            stage.run_step(
                model,
                group,
                micro.clone(),
                &options(false),
                Some(&mut timeline),
                &mut NoHooks,
            )?;
            Ok(timeline.into_spans())
        },
    );
    for (w, mine) in spans.iter().enumerate() {
        let labels: Vec<&str> = mine
            .iter()
            .filter(|s| s.category.is_compute())
            .map(|s| s.label.as_str())
            .collect();
        let expected = if w == 0 {
            ["F0", "F1", "B0", "B1"]
        } else {
            ["F0", "B0", "F1", "B1"]
        };
        assert_eq!(labels, expected, "worker {w}");
        assert!(mine.iter().all(|s| s.worker == w && s.end_s >= s.start_s));
        let recv = if w == 0 { "recv grad 0" } else { "recv act 0" };
        assert!(mine
            .iter()
            .any(|s| s.category == Category::RecvWait && s.label == recv));
        // Each asynchronous send's transfer, when it ran, on the communication row.
        let sent = if w == 0 { "xfer act " } else { "xfer grad " };
        let transfers: Vec<&Span> = mine
            .iter()
            .filter(|s| s.category == Category::Communication)
            .collect();
        assert_eq!(transfers.len(), 2, "worker {w}: {transfers:?}");
        for t in transfers {
            assert_eq!(t.category.lane(), 1);
            assert!(t.label.starts_with(sent), "{}", t.label);
            assert!(t.micro.is_some(), "{}", t.label);
        }
    }
    let all: Vec<Span> = spans.concat();
    let json: serde_json::Value = serde_json::from_str(&chrome_trace(&all).to_string()).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    let complete: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(complete.len(), all.len());
    for e in complete {
        for key in ["name", "ts", "dur", "pid", "tid", "args"] {
            assert!(!e[key].is_null(), "{key} missing in {e}");
        }
    }
    assert!(events
        .iter()
        .any(|e| e["ph"] == "M" && e["args"]["name"] == "worker 1"));
}

#[test]
fn idle_fraction_of_hand_made_spans() {
    let span = |worker, start_s, end_s, category| Span {
        worker,
        label: String::new(),
        category,
        start_s,
        end_s,
        micro: None,
    };
    // Worker 0 computes 0–2 and 3–4, worker 1 computes 1–4 but waits 0–1: 4 s of idle in 8.
    let spans = vec![
        span(0, 0.0, 2.0, Category::Forward),
        span(0, 2.0, 3.0, Category::RecvWait),
        span(0, 3.0, 4.0, Category::Backward),
        span(1, 0.0, 1.0, Category::RecvWait),
        span(1, 1.0, 2.0, Category::Forward),
        span(1, 2.0, 3.0, Category::Backward),
        span(1, 3.5, 4.0, Category::Optimizer),
    ];
    let idle = idle_fraction(&spans, 2, (0.0, 4.0));
    assert!((idle - (1.0 - 5.5 / 8.0)).abs() < 1e-12, "{idle}");
}

#[test]
fn evaluate_matches_the_whole_model_forward() {
    let v2 = ScheduleKind::Interleaved {
        chunks_per_worker: 2,
    };
    for (kind, p) in [(ScheduleKind::GPipe, 3), (v2, 2), (v2, 1)] {
        let results = one_step(kind, p, 2, |model, stage, group, micro| {
            let values =
                stage.evaluate(model, group, micro.clone(), &options(false), &mut NoHooks)?;
            Ok(values.map(|v| {
                let mean = v.iter().map(|l| l.mean as f64).sum::<f64>() / v.len() as f64;
                (
                    mean as f32,
                    v.iter().filter_map(|l| l.correct).sum::<usize>(),
                )
            }))
        });
        let model = gpt::gpt(&CFG);
        let mut store = model.init(1);
        let (x, y) = GPT.batch(4, 1, 0);
        let micro = MicroBatches::split(&x, &y, 2).unwrap();
        let (mut loss, mut correct) = (0.0f64, 0);
        for (x, y) in micro.inputs.iter().zip(&micro.targets) {
            let (logits, _) = model.forward_all(&mut store, x.clone(), Mode::EVAL);
            let (l, _, c) =
                meshtrain_tensor::loss::softmax_cross_entropy(logits.data(), CFG.vocab, y, 1.0);
            loss += l as f64;
            correct += c;
        }
        let expected = ((loss / 2.0) as f32, correct);
        let last = (p * kind.chunks_per_worker() - 1) % p;
        for (w, r) in results.into_iter().enumerate() {
            assert_eq!(
                r,
                (w == last).then_some(expected),
                "{kind} p={p} worker {w}"
            );
        }
    }
}

/// The global gradient norm over stages equals the single worker's, and clipping scales
/// every stage by the same factor.
#[test]
fn grad_norm_and_clipping_span_all_stages() {
    let results = one_step(
        ScheduleKind::OneFOneB,
        3,
        2,
        |model, stage, group, micro| {
            stage.run_step(
                model,
                group,
                micro.clone(),
                &options(false),
                None,
                &mut NoHooks,
            )?;
            let norm = stage.grad_norm(group)?;
            let before: Vec<f32> = stage
                .chunks
                .iter()
                .flat_map(|c| c.store.grads.clone())
                .collect();
            let clipped_from = stage.clip_grad_norm(group, norm / 2.0)?;
            let after: Vec<f32> = stage
                .chunks
                .iter()
                .flat_map(|c| c.store.grads.clone())
                .collect();
            let ratio = after
                .iter()
                .zip(&before)
                .find(|(_, b)| **b != 0.0)
                .map(|(a, b)| a / b);
            Ok((norm, clipped_from, ratio.unwrap()))
        },
    );
    let model = gpt::gpt(&CFG);
    let mut store = model.init(1);
    let (x, y) = GPT.batch(4, 1, 0);
    let micro = MicroBatches::split(&x, &y, 2).unwrap();
    for (x, y) in micro.inputs.iter().zip(&micro.targets) {
        let (logits, acts) = model.forward_all(&mut store, x.clone(), Mode::TRAIN);
        let (_, dl, _) =
            meshtrain_tensor::loss::softmax_cross_entropy(logits.data(), CFG.vocab, y, 0.5);
        let dy = meshtrain_tensor::Tensor::from_vec(dl, logits.shape());
        model.backward(&mut store, acts, dy, false, &mut |_, _| {});
    }
    let expected = meshtrain_nn::optim::grad_norm(&store.grads);
    for (norm, clipped_from, ratio) in results {
        assert!(
            (norm - expected).abs() <= 1e-5 * expected,
            "{norm} vs {expected}"
        );
        assert_eq!(norm, clipped_from);
        assert!((ratio - 0.5).abs() < 1e-4, "{ratio}");
    }
}

/// Workers agree on a time-balanced partition even though only rank 0 measures.
#[test]
fn measured_time_partition_is_the_same_on_every_worker() {
    let parts = ThreadsWorld::run(3, CommConfig::default(), |group| {
        let model = gpt::gpt(&CFG);
        let (x, y) = GPT.batch(2, 1, 0);
        Partition::by_measured_time(group.as_ref(), &model, (&x, &y), GPT.loss().as_ref(), 3)
    })
    .unwrap();
    assert_eq!(parts[0].len(), 3);
    assert!(parts.iter().all(|p| *p == parts[0]), "{parts:?}");
}

/// Rank 0 gathers exactly what the stages hold.
#[test]
fn gather_collects_the_whole_model_on_rank_0() {
    let v2 = ScheduleKind::Interleaved {
        chunks_per_worker: 2,
    };
    let results = one_step(v2, 2, 2, |model, stage, group, micro| {
        stage.run_step(
            model,
            group,
            micro.clone(),
            &options(false),
            None,
            &mut NoHooks,
        )?;
        let mut optimizers = stage.optimizers(meshtrain_nn::optim::OptimizerConfig::Sgd {
            momentum: 0.0,
            weight_decay: 0.0,
        });
        stage.optimizer_step(&mut optimizers, 0.1, None);
        let gathered = stage.gather(model, group)?;
        let held: Vec<_> = stage
            .chunks
            .iter()
            .map(|c| {
                (
                    c.blocks.clone(),
                    c.store.values.clone(),
                    c.store.buffers.clone(),
                )
            })
            .collect();
        Ok((held, gathered))
    });
    let model = gpt::gpt(&CFG);
    let mut expected = model.init(1);
    for (held, _) in &results {
        for (blocks, values, buffers) in held {
            expected.values[model.blocks_param_range(blocks.clone())].copy_from_slice(values);
            expected.buffers[model.blocks_buffer_range(blocks.clone())].copy_from_slice(buffers);
        }
    }
    assert_ne!(
        expected.values,
        model.init(1).values,
        "the step changed nothing"
    );
    assert_eq!(results[0].1.as_ref().unwrap().values, expected.values);
    assert_eq!(results[0].1.as_ref().unwrap().buffers, expected.buffers);
    assert!(results[1].1.is_none());
}
