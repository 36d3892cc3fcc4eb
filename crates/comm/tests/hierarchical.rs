//! The hierarchical all-reduce (reduce-scatter inside the host, all-reduce across hosts,
//! all-gather inside the host) on simulated hosts of the threads backend: it equals the
//! flat all-reduce up to the order of additions, in every use DDP makes of it, and a stuck
//! rank fails the others within the timeout, naming the operation and the missing rank.

mod common;

use meshtrain_comm::{
    bf16, reference_reduce, CommConfig, CommError, GroupHosts, HierarchicalGroup, ProcessGroup,
    RawBuf, ReduceOp, ThreadsWorld, WorkerFailure,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn hosts_of(ranks_per_host: usize, timeout_s: f64) -> CommConfig {
    CommConfig::default()
        .with_timeout(Duration::from_secs_f64(timeout_s))
        .with_desync_check(true)
        .with_ranks_per_host(ranks_per_host)
}

/// Values of many magnitudes (2^-6 … 2^6) and both signs, different on every rank.
fn values(rank: usize, len: usize) -> Vec<f32> {
    common::random_floats(rank, len, 12)
}

/// Sizes around the ranks per host (2, 3): divisible or not, shorter than a host, empty.
const SIZES: [usize; 8] = [0, 1, 2, 7, 17, 1023, 4099, 65_537];

/// The tolerance, stated: the flat and the hierarchical sums add the same values in another
/// order, so they differ by at most a few units of the last place of the sum of magnitudes
/// (f32: 1e-6 × Σ|x|); bf16 rounds the host's partial sum once more before it crosses
/// (2 × 2⁻⁸ × Σ|x|, two roundings of bf16's 8-bit mantissa).
fn tolerance(abs_sum: f32, dtype_bf16: bool) -> f32 {
    if dtype_bf16 {
        2.0 * 2f32.powi(-8) * abs_sum + 1e-30
    } else {
        1e-6 * abs_sum + 1e-30
    }
}

/// Runs the hierarchical all-reduce on a world of `hosts` × `per_host` simulated hosts and
/// compares every rank's result with the serial flat reduction.
fn equals_flat(hosts: usize, per_host: usize, op: ReduceOp, bf16_wire: bool) {
    let world = hosts * per_host;
    let results = ThreadsWorld::run(world, hosts_of(per_host, 20.0), move |g| {
        // Pieces of 1 KiB: the longer buffers go through the pipeline in many pieces (the
        // last one shorter), the shorter ones in one.
        let hier = HierarchicalGroup::new(g.clone())?.with_piece_bytes(1024);
        assert_eq!(hier.local().size(), per_host);
        assert_eq!(hier.across().size(), hosts);
        let mut out = Vec::new();
        for len in SIZES {
            let mine = values(g.rank(), len);
            let reduced: Vec<f32> = if bf16_wire {
                let mut buf: Vec<bf16> = mine.iter().map(|&v| bf16::from_f32(v)).collect();
                hier.all_reduce((&mut buf).into(), op)?;
                buf.iter().map(|v| v.to_f32()).collect()
            } else {
                let mut buf = mine;
                hier.all_reduce((&mut buf).into(), op)?;
                buf
            };
            out.push(reduced);
        }
        Ok::<_, CommError>(out)
    })
    .unwrap_or_else(|e| panic!("{hosts}×{per_host} {op:?}: {e}"));
    for (s, &len) in SIZES.iter().enumerate() {
        let inputs: Vec<Vec<f32>> = (0..world)
            .map(|r| {
                let v = values(r, len);
                // The flat reference sees what the ranks put in: bf16 inputs are rounded.
                if bf16_wire {
                    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
                } else {
                    v
                }
            })
            .collect();
        let expected = reference_reduce(&inputs, op);
        for (rank, result) in results.iter().enumerate() {
            assert_eq!(result[s].len(), len);
            for i in 0..len {
                let abs_sum: f32 = inputs.iter().map(|v| v[i].abs()).sum();
                let tol = tolerance(abs_sum, bf16_wire);
                assert!(
                    (result[s][i] - expected[i]).abs() <= tol,
                    "{hosts}×{per_host} {op:?} bf16={bf16_wire} len {len} rank {rank} [{i}]: \
                     {} vs flat {} (tolerance {tol})",
                    result[s][i],
                    expected[i]
                );
            }
        }
    }
}

#[test]
fn hierarchical_all_reduce_equals_flat_on_2x2_and_2x3_hosts() {
    for (hosts, per_host) in [(2, 2), (2, 3), (3, 2)] {
        for op in [ReduceOp::Sum, ReduceOp::Average, ReduceOp::Max] {
            for bf16_wire in [false, true] {
                equals_flat(hosts, per_host, op, bf16_wire);
            }
        }
    }
}

#[test]
fn asynchronous_buckets_of_one_buffer_equal_the_synchronous_result() {
    // DDP's use: disjoint bucket views of one flat buffer, all in flight at once.
    let results = ThreadsWorld::run(6, hosts_of(3, 20.0), |g| {
        let hier = HierarchicalGroup::new(g.clone())?;
        let mut grads = values(g.rank(), 10_001);
        let mut whole = grads.clone();
        let cuts = [0, 1, 5_000, 5_003, 10_001];
        let works: Vec<_> = cuts
            .windows(2)
            .map(|w| {
                // SAFETY: disjoint ranges of `grads`, untouched until the works are waited on.
                unsafe {
                    hier.all_reduce_async(
                        RawBuf::from_raw_parts(grads.as_mut_ptr().add(w[0]), w[1] - w[0]),
                        ReduceOp::Average,
                    )
                }
            })
            .collect::<Result<_, _>>()?;
        for work in works {
            work.wait()?;
        }
        hier.all_reduce((&mut whole).into(), ReduceOp::Average)?;
        Ok::<_, CommError>((grads, whole))
    })
    .unwrap();
    for (bucketed, whole) in &results {
        // Bucket boundaries move the chunk boundaries, not the addition order per element.
        assert_eq!(bucketed, whole);
    }
    assert!(results.windows(2).all(|w| w[0].0 == w[1].0));
}

#[test]
fn uneven_hosts_are_refused_before_any_collective() {
    // 5 ranks, 2 per host: hosts hold 2, 2, 1.
    let result = ThreadsWorld::run(5, hosts_of(2, 5.0), |g| {
        assert!(GroupHosts::of(g.as_ref()).hierarchy_helps());
        HierarchicalGroup::new(g.clone()).map(|_| ())
    });
    let err = result.unwrap_err();
    assert_eq!(err.failures.len(), 5);
    let message = err.to_string();
    assert!(
        message.contains("needs the same number of its ranks on every host, but its 3 hosts hold 2, 2, 1 of them"),
        "{message}"
    );
}

#[test]
fn a_stuck_rank_fails_the_others_within_the_timeout_naming_op_sequence_and_ranks() {
    let start = Instant::now();
    let timeout = Duration::from_secs(1);
    let result = ThreadsWorld::run(4, hosts_of(2, timeout.as_secs_f64()), |g| {
        let hier = Arc::new(HierarchicalGroup::new(g.clone())?);
        let mut buf = vec![1.0f32; 1000];
        hier.all_reduce((&mut buf).into(), ReduceOp::Sum)?;
        if g.rank() == 3 {
            std::thread::sleep(Duration::from_secs(20));
        }
        hier.all_reduce((&mut buf).into(), ReduceOp::Sum)
    });
    let elapsed = start.elapsed();
    let err = result.unwrap_err();
    // Timeout (1 s), a peer's failure reaching the ranks that wait on it, then the grace
    // before the stuck thread is abandoned (1 s).
    assert!(elapsed < Duration::from_secs(4), "took {elapsed:?}");
    let message_of = |rank: usize| -> String {
        match &err
            .failures
            .iter()
            .find(|(r, _)| *r == rank)
            .expect("rank failed")
            .1
        {
            WorkerFailure::Error(e) => e.to_string(),
            other => panic!("rank {rank}: {other:?}"),
        }
    };
    // Rank 2 shares rank 3's host: it waits in the second reduce-scatter of their host.
    assert_eq!(
        message_of(2),
        "reduce_scatter #2 on group 'world/host[2,3]' timed out after 1s: rank(s) [3] (global) \
         did not arrive"
    );
    // Rank 1 holds the shard rank 3 would send across: the cross-host all-reduce.
    assert_eq!(
        message_of(1),
        "all_reduce #2 on group 'world/across[1,3]' timed out after 1s: rank(s) [3] (global) \
         did not arrive"
    );
    // Rank 0 waits on rank 2 (across) or then rank 1 (its host's all-gather): it names the
    // operation, its sequence number and whom it waited for.
    let zero = message_of(0);
    assert!(
        zero.starts_with("all_reduce #2 on group 'world/across[0,2]'")
            && zero.contains("rank(s) [2]")
            || zero.starts_with("all_gather #2 on group 'world/host-gather[0,1]'")
                && zero.contains("rank(s) [1]"),
        "{zero}"
    );
    assert!(matches!(
        err.failures.iter().find(|(r, _)| *r == 3).unwrap().1,
        WorkerFailure::Abandoned
    ));
}
