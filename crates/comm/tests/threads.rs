//! Threads backend: conformance against serial references, determinism, failure
//! handling (killed, stuck, erroring workers; desync) and the device mesh.

mod common;

use meshtrain_comm::{
    conformance, reference_reduce, CommConfig, CommError, DeviceMesh, MeshAxis, MeshError,
    ProcessGroup, RawBuf, ReduceOp, ThreadsWorld, WorkerFailure,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn config(timeout_s: f64) -> CommConfig {
    CommConfig::default()
        .with_timeout(Duration::from_secs_f64(timeout_s))
        .with_desync_check(true)
}

#[test]
fn conformance_suite_for_1_to_5_workers() {
    // 5 workers exceed the element count of the 1- and 7-element cases and leave
    // several chunks empty.
    for n in 1..=5 {
        let result = ThreadsWorld::run(n, config(20.0), |g| conformance::run_suite(g.as_ref()));
        if let Err(e) = result {
            panic!("{n} workers: {e}");
        }
    }
}

/// Pseudo-random floats of all magnitudes (2^-10 … 2^10), so that the summation order matters.
fn random_floats(rank: usize, len: usize) -> Vec<f32> {
    common::random_floats(rank, len, 20)
}

#[test]
fn all_reduce_is_bit_identical_run_to_run_and_in_rank_order() {
    let n = 4;
    let len = 100_003;
    let run = || {
        ThreadsWorld::run(n, config(20.0), move |g| {
            let mut buf = random_floats(g.rank(), len);
            g.all_reduce((&mut buf).into(), ReduceOp::Sum)?;
            Ok::<_, CommError>(buf)
        })
        .unwrap()
    };
    let first = run();
    let second = run();
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| random_floats(r, len)).collect();
    let reference = reference_reduce(&inputs, ReduceOp::Sum);
    // A different order gives different bits for some elements with these inputs, so
    // matching the rank-order reference bit for bit is a real check.
    let reversed: Vec<Vec<f32>> = inputs.iter().rev().cloned().collect();
    assert_ne!(
        reference_reduce(&reversed, ReduceOp::Sum)
            .iter()
            .map(|x| x.to_bits())
            .collect::<Vec<_>>(),
        reference.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    for rank in 0..n {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&first[rank]),
            bits(&reference),
            "rank {rank} vs reference"
        );
        assert_eq!(
            bits(&second[rank]),
            bits(&first[rank]),
            "rank {rank} run to run"
        );
    }
}

#[test]
fn async_all_reduce_progresses_without_polling() {
    ThreadsWorld::run(2, config(10.0), |g| {
        let mut buf = vec![g.rank() as f32 + 1.0; 1 << 16];
        // SAFETY: `buf` is not touched until the work completes.
        let work = unsafe { g.all_reduce_async(RawBuf::from_slice(&mut buf), ReduceOp::Sum)? };
        let start = Instant::now();
        // No call into the group: only the communication threads can finish it.
        while !work.is_done() {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "async op made no progress"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        work.wait()?;
        assert!(buf.iter().all(|&x| x == 3.0));
        Ok::<_, CommError>(())
    })
    .unwrap();
}

fn expect_one_world_failure<T: std::fmt::Debug, E: std::fmt::Display>(
    result: Result<Vec<T>, meshtrain_comm::WorldError<E>>,
) -> meshtrain_comm::WorldError<E> {
    match result {
        Ok(v) => panic!("expected failure, got {v:?}"),
        Err(e) => e,
    }
}

#[test]
fn panicking_worker_fails_the_others_quickly() {
    let start = Instant::now();
    let result = ThreadsWorld::run(3, config(30.0), |g| {
        let mut buf = vec![1.0f32; 1000];
        g.all_reduce((&mut buf).into(), ReduceOp::Sum)?;
        if g.rank() == 1 {
            panic!("worker 1 dies");
        }
        // Ranks 0 and 2 wait for rank 1 in the second collective.
        g.all_reduce((&mut buf).into(), ReduceOp::Sum)?;
        Ok::<_, CommError>(())
    });
    let elapsed = start.elapsed();
    let err = expect_one_world_failure(result);
    assert!(
        elapsed < Duration::from_secs(3),
        "took {elapsed:?} with a 30 s timeout"
    );
    assert_eq!(err.failures.len(), 3, "{err}");
    for (rank, failure) in &err.failures {
        match (rank, failure) {
            (1, WorkerFailure::Panic(msg)) => assert!(msg.contains("worker 1 dies")),
            (
                0 | 2,
                WorkerFailure::Error(CommError::PeerFailed {
                    ctx,
                    missing,
                    reason,
                }),
            ) => {
                assert_eq!((ctx.op, ctx.seq, &*ctx.group), ("all_reduce", 2, "world"));
                assert_eq!(missing, &vec![1]);
                assert!(reason.contains("worker 1 dies"), "{reason}");
            }
            other => panic!("unexpected failure {other:?}"),
        }
    }
    let message = err.to_string();
    assert!(
        message.contains("all_reduce #2 on group 'world'"),
        "{message}"
    );
}

/// Runs `n` workers; after barrier #1 the last one stops calling collectives (a hang
/// outside communication) while the others call collective #2 through `call`. They
/// must fail within the 1 s timeout naming `op`, #2, the group and the last rank: the
/// first to time out marks the group broken, so a peer waiting alongside it may get
/// `Broken` with that timeout as the cause.
fn stuck_last_rank_times_out(
    n: usize,
    op: &'static str,
    call: fn(&dyn ProcessGroup) -> Result<(), CommError>,
) {
    let start = Instant::now();
    let result = ThreadsWorld::run(n, config(1.0), move |g| {
        g.barrier()?;
        if g.rank() == g.size() - 1 {
            std::thread::sleep(Duration::from_secs(20));
        }
        call(g.as_ref())
    });
    let elapsed = start.elapsed();
    let err = expect_one_world_failure(result);
    // timeout (1 s) + grace for the stuck thread (1 s) + slack.
    assert!(elapsed < Duration::from_secs(4), "took {elapsed:?}");
    assert!(
        elapsed >= Duration::from_secs(1),
        "timed out early: {elapsed:?}"
    );
    let stuck = n - 1;
    let timeout_text = format!(
        "{op} #2 on group 'world' timed out after 1s: rank(s) [{stuck}] (global) did not arrive"
    );
    assert_eq!(err.failures.len(), n, "{err}");
    let mut timeouts = 0;
    for (rank, failure) in &err.failures {
        match failure {
            WorkerFailure::Error(CommError::Timeout { ctx, missing, .. }) if *rank != stuck => {
                assert_eq!((ctx.op, ctx.seq, &*ctx.group), (op, 2, "world"));
                assert_eq!(missing, &vec![stuck]);
                timeouts += 1;
            }
            WorkerFailure::Error(CommError::Broken { ctx, cause }) if *rank != stuck => {
                assert_eq!((ctx.op, ctx.seq, &*ctx.group), (op, 2, "world"));
                assert!(cause.contains(&timeout_text), "{cause}");
            }
            WorkerFailure::Abandoned if *rank == stuck => {}
            other => panic!("unexpected failure of rank {rank}: {other:?}"),
        }
    }
    assert!(timeouts >= 1, "no rank timed out: {err}");
    let message = err.to_string();
    assert!(message.contains(&timeout_text), "{message}");
}

#[test]
fn stuck_worker_times_out_with_the_missing_rank() {
    stuck_last_rank_times_out(2, "all_reduce", |g| {
        let mut buf = vec![1.0f32; 10];
        g.all_reduce((&mut buf).into(), ReduceOp::Max)
    });
}

#[test]
fn stuck_worker_times_out_an_all_to_all_with_the_missing_rank() {
    stuck_last_rank_times_out(3, "all_to_all", |g| {
        let input = vec![1.0f32; 4 * g.size()];
        let mut output = vec![0.0f32; 4 * g.size()];
        g.all_to_all((&input).into(), (&mut output).into())
    });
}

#[test]
fn worker_returning_early_is_reported_by_its_peers() {
    let result = ThreadsWorld::run(2, config(30.0), |g| {
        if g.rank() == 0 {
            return Err(anyhow::anyhow!("rank 0 gave up"));
        }
        let mut buf = vec![0f32; 3];
        g.recv((&mut buf).into(), 0, 7)?;
        Ok(())
    });
    let err = expect_one_world_failure(result);
    let text = err.to_string();
    // The root cause first and once; the peer's knock-on failure summarised after it.
    assert!(
        text.starts_with(
            "rank 0 failed: rank 0 gave up; then 1 other worker(s) stopped: rank 1 (recv"
        ),
        "{text}"
    );
    assert_eq!(text.matches("gave up").count(), 1, "{text}");
    assert!(
        text.contains("recv #1 from rank 0 on group 'world' cannot complete"),
        "{text}"
    );
    // The same fault on every worker (a config every worker checks) is said once.
    let result = ThreadsWorld::run(3, config(30.0), |_| {
        Err::<(), _>(anyhow::anyhow!("bad config"))
    });
    let text = expect_one_world_failure(result).to_string();
    assert_eq!(text, "every worker failed: bad config");
}

#[test]
fn recv_without_sender_times_out() {
    let start = Instant::now();
    let result = ThreadsWorld::run(2, config(0.5), |g| {
        if g.rank() == 1 {
            let mut buf = vec![0f32; 3];
            let err = g.recv((&mut buf).into(), 0, 1).unwrap_err();
            assert!(matches!(err, CommError::Timeout { ref missing, .. } if missing == &vec![0]));
            g.barrier()?;
        } else {
            // Stay alive (but silent) past rank 1's receive timeout.
            std::thread::sleep(Duration::from_millis(800));
            g.barrier()?;
        }
        Ok::<_, CommError>(())
    });
    result.unwrap();
    assert!(start.elapsed() < Duration::from_secs(3));
}

#[test]
fn messages_are_numbered_per_peer_and_a_lost_one_is_named_by_its_number() {
    // Rank 0 sends rank 1 two messages and rank 2 one between them, with a collective in the
    // middle; rank 1 waits for a third. Its error names message #3 from rank 0: the message
    // to rank 2 and the collective are numbered apart.
    let result = ThreadsWorld::run(3, config(0.5), |g| {
        let message = vec![g.rank() as f32; 2];
        let mut buf = vec![0f32; 2];
        let mut lost = None;
        match g.rank() {
            0 => {
                g.send((&message).into(), 1, 5)?;
                g.send((&message).into(), 2, 5)?;
                g.barrier()?;
                g.send((&message).into(), 1, 5)?;
            }
            1 => {
                g.recv((&mut buf).into(), 0, 5)?;
                g.barrier()?;
                g.recv((&mut buf).into(), 0, 5)?;
                lost = Some(g.recv((&mut buf).into(), 0, 5).unwrap_err().to_string());
            }
            _ => {
                g.recv((&mut buf).into(), 0, 5)?;
                g.barrier()?;
            }
        }
        if lost.is_none() {
            // Alive (but silent) past rank 1's receive timeout.
            std::thread::sleep(Duration::from_millis(800));
        }
        g.barrier()?;
        Ok::<_, CommError>(lost)
    })
    .unwrap();
    let lost = result[1].as_deref().expect("rank 1's third receive failed");
    assert!(
        lost.starts_with("recv #3 from rank 0 on group 'world' timed out after 500ms"),
        "{lost}"
    );
    assert!(
        lost.contains("rank(s) [0] (global) did not arrive"),
        "{lost}"
    );
}

#[test]
fn mismatched_collectives_are_detected_not_executed() {
    // Same op, different lengths: without the check rank 1 would read past rank 0's
    // buffer.
    let result = ThreadsWorld::run(2, config(5.0), |g| {
        let mut buf = vec![1.0f32; 7 + g.rank()];
        let err = g.all_reduce((&mut buf).into(), ReduceOp::Sum).unwrap_err();
        assert!(buf.iter().all(|&x| x == 1.0), "data was touched");
        Ok::<_, CommError>(err.to_string())
    })
    .unwrap();
    for message in &result {
        assert!(
            message.contains("all_reduce #1 on group 'world': collective mismatch"),
            "{message}"
        );
        assert!(
            message.contains("rank 0: all_reduce sum #1 f32×7"),
            "{message}"
        );
        assert!(
            message.contains("rank 1: all_reduce sum #1 f32×8"),
            "{message}"
        );
    }

    // Different ops at the same point; the group is unusable afterwards.
    let result = ThreadsWorld::run(2, config(5.0), |g| {
        let mut buf = vec![1.0f32; 4];
        let err = if g.rank() == 0 {
            g.all_reduce((&mut buf).into(), ReduceOp::Sum).unwrap_err()
        } else {
            g.broadcast((&mut buf).into(), 0).unwrap_err()
        };
        assert!(matches!(err, CommError::Desync { .. }), "{err}");
        let again = g.barrier().unwrap_err();
        assert!(matches!(again, CommError::Broken { .. }), "{again}");
        Ok::<_, CommError>(())
    });
    result.unwrap();
}

#[test]
fn invalid_buffers_and_ranks_are_errors() {
    ThreadsWorld::run(2, config(5.0), |g| {
        let input = vec![0f32; 5];
        let mut output = vec![0f32; 2];
        let err = g
            .reduce_scatter((&input).into(), (&mut output).into(), ReduceOp::Sum)
            .unwrap_err();
        assert!(matches!(err, CommError::InvalidBuffer { .. }), "{err}");
        let mut gathered = vec![0f32; 9];
        let err = g
            .all_gather((&input).into(), (&mut gathered).into())
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("output has 9 elements but must have group size 2 × input length 5 = 10"),
            "{err}"
        );
        let err = g.broadcast((&mut output).into(), 2).unwrap_err();
        assert!(matches!(err, CommError::InvalidRank { .. }), "{err}");
        let err = g.send((&input).into(), g.rank(), 0).unwrap_err();
        assert!(matches!(err, CommError::InvalidRank { .. }), "{err}");
        let err = g.new_subgroup(&[1 - g.rank()]).unwrap_err();
        assert!(err.to_string().contains("is not a member"), "{err}");
        // The group still works after local validation errors.
        g.barrier()?;
        Ok::<_, CommError>(())
    })
    .unwrap();
}

#[test]
fn device_mesh_groups_reduce_along_their_axis() {
    let sums = ThreadsWorld::run(4, config(10.0), |g| {
        let mesh = DeviceMesh::new(Arc::clone(&g), &[(MeshAxis::Dp, 2), (MeshAxis::Tp, 2)])?;
        let mut tp = vec![g.rank() as f32];
        mesh.group(MeshAxis::Tp)
            .all_reduce((&mut tp).into(), ReduceOp::Sum)?;
        let mut dp = vec![g.rank() as f32];
        mesh.group(MeshAxis::Dp)
            .all_reduce((&mut dp).into(), ReduceOp::Sum)?;
        let mut pp = vec![g.rank() as f32];
        mesh.group(MeshAxis::Pp)
            .all_reduce((&mut pp).into(), ReduceOp::Sum)?;
        assert_eq!(mesh.group(MeshAxis::Pp).size(), 1);
        let names = (
            mesh.group(MeshAxis::Dp).name().to_string(),
            mesh.coordinate(MeshAxis::Dp),
            mesh.coordinate(MeshAxis::Tp),
        );
        Ok::<_, anyhow::Error>((tp[0], dp[0], pp[0], names))
    })
    .unwrap();
    // Ranks: (dp, tp) = 0:(0,0) 1:(0,1) 2:(1,0) 3:(1,1).
    assert_eq!(sums[0], (1.0, 2.0, 0.0, ("dp[0,2]".to_string(), 0, 0)));
    assert_eq!(sums[1], (1.0, 4.0, 1.0, ("dp[1,3]".to_string(), 0, 1)));
    assert_eq!(sums[2], (5.0, 2.0, 2.0, ("dp[0,2]".to_string(), 1, 0)));
    assert_eq!(sums[3], (5.0, 4.0, 3.0, ("dp[1,3]".to_string(), 1, 1)));
}

#[test]
fn device_mesh_rejects_a_layout_that_does_not_fit_the_world() {
    let messages = ThreadsWorld::run(4, config(5.0), |g| {
        let err = DeviceMesh::new(g, &[(MeshAxis::Dp, 2), (MeshAxis::Pp, 3)]).unwrap_err();
        assert!(matches!(err, MeshError::SizeMismatch { .. }));
        Ok::<_, CommError>(err.to_string())
    })
    .unwrap();
    assert_eq!(messages[0], "dp=2 × pp=3 = 6 but the world has 4 workers");
}

#[test]
fn zero_workers_is_an_error() {
    let err = ThreadsWorld::run(0, config(1.0), |_g| Ok::<_, CommError>(())).unwrap_err();
    assert_eq!(
        err.to_string(),
        "a threads world needs at least one worker, got 0"
    );
}

/// The position board a companion engine (NCCL) asks on every look: a member that stopped
/// before issuing a collective is missing from it at once, but one that issued it and then
/// failed is not (its threads share this process, and its communicator completes what it
/// issued before it goes): counting it failed collectives that were about to complete.
#[test]
fn the_board_counts_a_failed_member_missing_only_from_collectives_it_never_issued() {
    let result = ThreadsWorld::run(3, config(30.0), |g| {
        let board = g
            .position_board("companion")
            .expect("the threads world keeps a board");
        match g.rank() {
            1 => return Err("failed before issuing anything".to_string()),
            2 => {
                board.issued("all_reduce", 1);
                return Err("failed after issuing all_reduce #1".to_string());
            }
            _ => {}
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while board.stopped(None).is_none_or(|m| m.ranks.len() < 2) {
            assert!(
                Instant::now() < deadline,
                "ranks 1 and 2 never showed as stopped"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let first = board.stopped(Some(1)).expect("rank 1 never issued #1");
        assert_eq!(first.ranks, [1], "{}", first.note);
        assert!(
            first.note.contains("before its first collective"),
            "{}",
            first.note
        );
        let second = board.stopped(Some(2)).expect("neither issued #2");
        assert_eq!(second.ranks, [1, 2], "{}", second.note);
        assert!(
            second.note.contains("rank 2 last issued all_reduce #1"),
            "{}",
            second.note
        );
        Ok(())
    });
    let failures = result.expect_err("ranks 1 and 2 failed").failures;
    assert_eq!(failures.len(), 2, "{failures:?}");
    assert!(failures.iter().all(|(rank, _)| *rank != 0), "{failures:?}");
}
