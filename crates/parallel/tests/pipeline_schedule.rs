//! Schedules and partitions as data: no model runs here.

use meshtrain_parallel::engine::{Action, Partition, PipelineError, Schedule, ScheduleKind};
use std::collections::HashMap;

const KINDS: [ScheduleKind; 4] = [
    ScheduleKind::GPipe,
    ScheduleKind::OneFOneB,
    ScheduleKind::Interleaved {
        chunks_per_worker: 2,
    },
    ScheduleKind::Interleaved {
        chunks_per_worker: 3,
    },
];

/// Every valid (kind, p, m) with p ≤ 5, m ≤ 12.
fn all_schedules() -> Vec<Schedule> {
    let mut out = Vec::new();
    for kind in KINDS {
        for p in 1..=5 {
            for m in 1..=12 {
                let interleaved = matches!(kind, ScheduleKind::Interleaved { .. });
                match Schedule::new(kind, p, m) {
                    Ok(s) => out.push(s),
                    Err(PipelineError::MicroBatchesNotMultiple { .. })
                        if interleaved && m % p != 0 => {}
                    Err(e) => panic!("{kind} p={p} m={m}: {e}"),
                }
            }
        }
    }
    out
}

/// Counted directly from the action lists (independently of `Schedule::check`).
#[test]
fn every_micro_batch_is_forwarded_and_backwarded_once_per_chunk() {
    for s in all_schedules() {
        let mut counts: HashMap<(char, usize, usize), usize> = HashMap::new();
        for (w, program) in s.actions.iter().enumerate() {
            for a in program {
                assert_eq!(
                    a.chunk() % s.workers,
                    w,
                    "{:?}: chunk on wrong worker",
                    s.kind
                );
                match a {
                    Action::Forward { chunk, micro } => {
                        *counts.entry(('F', *chunk, *micro)).or_default() += 1
                    }
                    Action::Backward { chunk, micro } => {
                        *counts.entry(('B', *chunk, *micro)).or_default() += 1
                    }
                    _ => {}
                }
            }
        }
        let expected = 2 * s.num_chunks() * s.micro_batches;
        assert_eq!(
            counts.len(),
            expected,
            "{} p={} m={}",
            s.kind,
            s.workers,
            s.micro_batches
        );
        assert!(counts.values().all(|&n| n == 1));
        s.check().unwrap();
    }
}

/// Sends and receives pair up one to one between the right workers.
#[test]
fn sends_match_receives() {
    for s in all_schedules() {
        // (is_activation, receiving chunk, micro) -> (sender worker, receiver worker)
        let mut sent: HashMap<(bool, usize, usize), usize> = HashMap::new();
        let mut received: HashMap<(bool, usize, usize), usize> = HashMap::new();
        for (w, program) in s.actions.iter().enumerate() {
            for a in program {
                let (key, map) = match *a {
                    Action::SendActivation { chunk, micro } => {
                        ((true, chunk + 1, micro), &mut sent)
                    }
                    Action::SendGrad { chunk, micro } => ((false, chunk - 1, micro), &mut sent),
                    Action::RecvActivation { chunk, micro } => {
                        ((true, chunk, micro), &mut received)
                    }
                    Action::RecvGrad { chunk, micro } => ((false, chunk, micro), &mut received),
                    _ => continue,
                };
                assert!(map.insert(key, w).is_none(), "duplicate {a:?}");
            }
        }
        assert_eq!(sent.len(), received.len());
        for (key, sender) in &sent {
            let receiver = received[key];
            assert_eq!(receiver, key.1 % s.workers);
            assert_ne!(receiver, *sender);
        }
        // Every chunk boundary between different workers carries m activations and m grads.
        let boundaries = if s.workers > 1 { s.num_chunks() - 1 } else { 0 };
        assert_eq!(sent.len(), 2 * boundaries * s.micro_batches);
    }
}

/// With equal-cost stages (backward = 2 × forward) and free communication the simulated idle
/// fraction is exactly (p−1)/(v·m + p−1), and the step takes (v·m + p−1) chunk steps.
#[test]
fn simulated_bubble_matches_theory() {
    for s in all_schedules() {
        let v = s.chunks_per_worker() as f64;
        let sim = s
            .simulate(&|a| match a {
                Action::Forward { .. } => 1.0 / v,
                _ => 2.0 / v,
            })
            .unwrap();
        let (p, m) = (s.workers, s.micro_batches);
        let predicted = s.kind.predicted_idle_fraction(p, m);
        assert!(
            (sim.idle_fraction() - predicted).abs() < 1e-9,
            "{} p={p} m={m}: {} vs {predicted}",
            s.kind,
            sim.idle_fraction()
        );
        let steps = v * m as f64 + p as f64 - 1.0;
        assert!((sim.makespan - 3.0 / v * steps).abs() < 1e-9);
    }
}

#[test]
fn naive_model_parallelism_idles_p_minus_1_over_p() {
    for p in 1..=6 {
        let s = Schedule::new(ScheduleKind::GPipe, p, 1).unwrap();
        let sim = s.simulate(&|_| 1.0).unwrap();
        let expected = (p as f64 - 1.0) / p as f64;
        assert!((sim.idle_fraction() - expected).abs() < 1e-12);
    }
}

#[test]
fn in_flight_micro_batches_gpipe_m_1f1b_at_most_p() {
    for p in 1..=5 {
        for m in 1..=12 {
            let g = Schedule::new(ScheduleKind::GPipe, p, m).unwrap();
            let g = g.simulate(&|_| 1.0).unwrap().peak_in_flight;
            assert!(g.iter().all(|&n| n == m), "gpipe p={p} m={m}: {g:?}");
            let f = Schedule::new(ScheduleKind::OneFOneB, p, m).unwrap();
            let f = f.simulate(&|_| 1.0).unwrap().peak_in_flight;
            assert_eq!(f[0], p.min(m), "1f1b p={p} m={m} stage 0");
            for (w, &n) in f.iter().enumerate() {
                assert_eq!(n, (p - w).min(m), "1f1b p={p} m={m} stage {w}");
            }
        }
    }
}

#[test]
fn check_rejects_broken_programs() {
    let good = Schedule::new(ScheduleKind::OneFOneB, 3, 4).unwrap();
    good.check().unwrap();
    let expect_invalid = |s: &Schedule, what: &str| match s.check() {
        Err(PipelineError::InvalidSchedule(msg)) => assert!(msg.contains(what), "{msg}"),
        other => panic!("expected an invalid schedule ({what}), got {other:?}"),
    };

    // Stage 1 waits for a gradient before it sends the activation that produces it.
    let mut deadlock = good.clone();
    let program = &mut deadlock.actions[1];
    let recv_grad = program
        .iter()
        .position(|a| matches!(a, Action::RecvGrad { .. }))
        .unwrap();
    let first_send = program
        .iter()
        .position(|a| matches!(a, Action::SendActivation { .. }))
        .unwrap();
    let moved = program.remove(recv_grad);
    program.insert(first_send, moved);
    // Move its backward along so the data-flow check still passes and the deadlock remains.
    let backward = program
        .iter()
        .position(|a| matches!(a, Action::Backward { .. }))
        .unwrap();
    let moved = program.remove(backward);
    program.insert(first_send + 1, moved);
    expect_invalid(&deadlock, "deadlock");

    let mut missing = good.clone();
    let b = missing.actions[2]
        .iter()
        .rposition(|a| matches!(a, Action::Backward { .. }))
        .unwrap();
    missing.actions[2].remove(b);
    assert!(missing.check().is_err());

    let mut twice = good.clone();
    let f = twice.actions[0][0];
    twice.actions[0].insert(0, f);
    expect_invalid(&twice, "forwarded 2");

    let mut unmatched = good.clone();
    unmatched.actions[0].retain(|a| !matches!(a, Action::SendActivation { micro: 3, .. }));
    expect_invalid(&unmatched, "never sent");

    let mut out_of_order = good.clone();
    let first_forward = out_of_order.actions[1]
        .iter()
        .position(|a| matches!(a, Action::Forward { .. }))
        .unwrap();
    out_of_order.actions[1].swap(first_forward - 1, first_forward);
    expect_invalid(&out_of_order, "no input");
}

#[test]
fn impossible_layouts_are_typed_errors() {
    assert!(matches!(
        Schedule::new(ScheduleKind::GPipe, 0, 4),
        Err(PipelineError::NoWorkers)
    ));
    assert!(matches!(
        Schedule::new(ScheduleKind::OneFOneB, 2, 0),
        Err(PipelineError::NoMicroBatches)
    ));
    let v0 = ScheduleKind::Interleaved {
        chunks_per_worker: 0,
    };
    assert!(matches!(
        Schedule::new(v0, 2, 4),
        Err(PipelineError::NoChunks)
    ));
    let v2 = ScheduleKind::Interleaved {
        chunks_per_worker: 2,
    };
    let err = Schedule::new(v2, 4, 6).unwrap_err();
    assert!(matches!(
        err,
        PipelineError::MicroBatchesNotMultiple {
            micro_batches: 6,
            workers: 4
        }
    ));
    assert!(err.to_string().contains("multiple"), "{err}");
    assert!("pipedream".parse::<ScheduleKind>().is_err());
    assert_eq!(
        "interleaved:3".parse::<ScheduleKind>().unwrap(),
        ScheduleKind::Interleaved {
            chunks_per_worker: 3
        }
    );
    assert_eq!(
        "1f1b".parse::<ScheduleKind>().unwrap(),
        ScheduleKind::OneFOneB
    );
}

/// Smallest possible largest chunk, by trying every cut (small cases only).
fn brute_force_best(costs: &[f64], parts: usize) -> f64 {
    fn go(costs: &[f64], parts: usize) -> f64 {
        if parts == 1 {
            return costs.iter().sum();
        }
        (1..=costs.len() - (parts - 1))
            .map(|k| {
                costs[..k]
                    .iter()
                    .sum::<f64>()
                    .max(go(&costs[k..], parts - 1))
            })
            .fold(f64::INFINITY, f64::min)
    }
    go(costs, parts)
}

#[test]
fn balanced_partition_is_optimal_and_contiguous() {
    let mut rng = meshtrain_tensor::rng::SplitMix64::new(5);
    for n in 1..=9 {
        for parts in 1..=n {
            let costs: Vec<f64> = (0..n).map(|_| (rng.below(20) + 1) as f64).collect();
            let p = Partition::balanced(&costs, parts).unwrap();
            assert_eq!(p.len(), parts);
            let mut next = 0;
            for r in p.chunks() {
                assert_eq!(r.start, next);
                assert!(r.end > r.start);
                next = r.end;
            }
            assert_eq!(next, n);
            let worst = p.chunk_costs(&costs).into_iter().fold(0.0, f64::max);
            assert_eq!(
                worst,
                brute_force_best(&costs, parts),
                "{costs:?} into {parts}"
            );
        }
    }
}

#[test]
fn partition_errors() {
    let err = Partition::balanced(&[1.0, 2.0, 3.0], 4).unwrap_err();
    assert!(
        matches!(
            err,
            PipelineError::TooFewBlocks {
                blocks: 3,
                chunks: 4
            }
        ),
        "{err}"
    );
    assert!(Partition::balanced(&[1.0], 0).is_err());
    assert_eq!(
        Partition::explicit(8, &[3, 6]).unwrap().chunks(),
        &[0..3, 3..6, 6..8]
    );
    for bad in [&[0usize][..], &[8], &[5, 3], &[3, 3]] {
        let err = Partition::explicit(8, bad).unwrap_err();
        assert!(
            matches!(err, PipelineError::InvalidBoundaries { .. }),
            "{bad:?}: {err}"
        );
    }
}

/// NCCL carries no tags: each pair's messages must be received in the order they are sent.
/// Every schedule the trainer builds keeps that order, or the GPU refuses it.
#[test]
fn every_schedule_receives_each_pairs_messages_in_the_order_they_are_sent() {
    let out_of_order: Vec<String> = all_schedules()
        .iter()
        .filter_map(|s| {
            let (kind, p, m) = (s.kind, s.workers, s.micro_batches);
            let e = s.check_in_order_between_pairs().err()?;
            Some(format!("{kind:?} p={p} m={m}: {e}"))
        })
        .collect();
    assert!(out_of_order.is_empty(), "{out_of_order:#?}");
}

#[test]
fn a_pair_whose_messages_cross_is_named() {
    let mut s = Schedule::new(ScheduleKind::GPipe, 2, 2).unwrap();
    // Worker 1 takes micro-batch 1's activation before micro-batch 0's.
    let program = &mut s.actions[1];
    let at = |program: &Vec<Action>, micro| {
        program
            .iter()
            .position(|a| *a == Action::RecvActivation { chunk: 1, micro })
            .unwrap()
    };
    let (a, b) = (at(program, 0), at(program, 1));
    program.swap(a, b);
    let e = s.check_in_order_between_pairs().unwrap_err();
    assert!(
        e.contains("worker 1 receives") && e.contains("from worker 0"),
        "{e}"
    );
}

/// The pairs a GPU pipeline makes channels for are the neighbours that messages go between:
/// both ways between adjacent stages, and around from the last stage to the first only when
/// chunks are interleaved (chunk p − 1 hands over to chunk p on worker 0). None for one stage.
#[test]
fn the_point_to_point_pairs_are_the_neighbours_messages_go_between() {
    for s in all_schedules() {
        let (p, kind) = (s.workers, s.kind);
        let mut expected: Vec<(usize, usize)> = (0..p.saturating_sub(1))
            .flat_map(|w| [(w, w + 1), (w + 1, w)])
            .collect();
        if s.chunks_per_worker() > 1 && p > 1 {
            expected.extend([(p - 1, 0), (0, p - 1)]);
        }
        expected.sort_unstable();
        expected.dedup();
        assert_eq!(s.point_to_point_pairs(), expected, "{kind} p={p}");
    }
}
