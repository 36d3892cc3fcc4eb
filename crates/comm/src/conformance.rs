//! Backend conformance suite: every operation checked against a serial reference.
//!
//! Each rank generates every rank's input locally (a deterministic function of rank
//! and index), runs the operation through the group, and compares its result with
//! the reference computed serially from all inputs. Inputs are small integers, so
//! sums are exact in f32, bf16 and f16 whatever order a backend reduces in, and the
//! comparison can be bit-exact for every backend. The same suite runs on the threads
//! backend (`tests/threads.rs`) and on MPI (`examples/mpi_collectives.rs` under mpirun).

use crate::dtype::{reference_reduce, Element, RawBuf, ReduceOp};
use crate::group::ProcessGroup;
use anyhow::{bail, ensure, Context, Result};
use half::{bf16, f16};

/// Element counts exercised: empty, single, odd, around a cache line, more than one
/// kernel block (4096) and not a multiple of anything.
pub const SIZES: [usize; 6] = [0, 1, 7, 17, 1023, 4099];

/// Small integer in [-30, 30], deterministic in (rank, index, salt).
pub fn test_value(rank: usize, index: usize, salt: u64) -> f32 {
    let mut x = (rank as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((index as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(salt.wrapping_mul(0x94D0_49BB_1331_11EB));
    x ^= x >> 31;
    x = x.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    x ^= x >> 29;
    (x % 61) as f32 - 30.0
}

/// Input of `rank`: `len` test values.
pub fn test_input<T: Element>(rank: usize, len: usize, salt: u64) -> Vec<T> {
    (0..len)
        .map(|i| T::from_f32(test_value(rank, i, salt)))
        .collect()
}

fn expect_equal<T: Element>(what: &str, got: &[T], expected: &[T]) -> Result<()> {
    ensure!(
        got.len() == expected.len(),
        "{what}: length {} != expected {}",
        got.len(),
        expected.len()
    );
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        if g.to_f32().to_bits() != e.to_f32().to_bits() {
            bail!("{what}: element {i} is {g:?}, expected {e:?}");
        }
    }
    Ok(())
}

fn all_inputs<T: Element>(size: usize, len: usize, salt: u64) -> Vec<Vec<T>> {
    (0..size).map(|r| test_input::<T>(r, len, salt)).collect()
}

fn check_all_reduce<T: Element>(g: &dyn ProcessGroup, len: usize, op: ReduceOp) -> Result<()> {
    let inputs = all_inputs::<T>(g.size(), len, 1);
    let mut mine = inputs[g.rank()].clone();
    g.all_reduce((&mut mine).into(), op)?;
    expect_equal(
        &format!("all_reduce {op:?} {} len {len}", T::DTYPE),
        &mine,
        &reference_reduce(&inputs, op),
    )
}

fn check_reduce_scatter<T: Element>(
    g: &dyn ProcessGroup,
    chunk: usize,
    op: ReduceOp,
) -> Result<()> {
    let n = g.size();
    let inputs = all_inputs::<T>(n, chunk * n, 2);
    let mut out = vec![T::from_f32(0.0); chunk];
    g.reduce_scatter((&inputs[g.rank()]).into(), (&mut out).into(), op)?;
    let full = reference_reduce(&inputs, op);
    let r = g.rank();
    expect_equal(
        &format!("reduce_scatter {op:?} {} chunk {chunk}", T::DTYPE),
        &out,
        &full[r * chunk..(r + 1) * chunk],
    )
}

fn check_all_gather<T: Element>(g: &dyn ProcessGroup, chunk: usize) -> Result<()> {
    let inputs = all_inputs::<T>(g.size(), chunk, 3);
    let mut out = vec![T::from_f32(0.0); chunk * g.size()];
    g.all_gather((&inputs[g.rank()]).into(), (&mut out).into())?;
    expect_equal(
        &format!("all_gather {} chunk {chunk}", T::DTYPE),
        &out,
        &inputs.concat(),
    )
}

fn check_broadcast<T: Element>(g: &dyn ProcessGroup, len: usize) -> Result<()> {
    for root in 0..g.size() {
        let mut mine = test_input::<T>(g.rank(), len, 4);
        g.broadcast((&mut mine).into(), root)?;
        expect_equal(
            &format!("broadcast {} len {len} root {root}", T::DTYPE),
            &mine,
            &test_input::<T>(root, len, 4),
        )?;
    }
    Ok(())
}

/// Ring exchange plus two tags received out of order.
fn check_send_recv<T: Element>(g: &dyn ProcessGroup, len: usize) -> Result<()> {
    let (n, r) = (g.size(), g.rank());
    if n < 2 {
        return Ok(());
    }
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    let first = test_input::<T>(r, len, 5);
    let second = test_input::<T>(r, len, 6);
    g.send((&first).into(), next, 10)?;
    g.send((&second).into(), next, 11)?;
    let mut got_second = vec![T::from_f32(0.0); len];
    let mut got_first = vec![T::from_f32(0.0); len];
    g.recv((&mut got_second).into(), prev, 11)?;
    g.recv((&mut got_first).into(), prev, 10)?;
    let what = format!("send/recv {} len {len}", T::DTYPE);
    expect_equal(&what, &got_first, &test_input::<T>(prev, len, 5))?;
    expect_equal(&what, &got_second, &test_input::<T>(prev, len, 6))?;
    g.barrier()?;
    Ok(())
}

/// A receive buffer of the wrong length is an error, and the group stays usable.
fn check_recv_size_mismatch(g: &dyn ProcessGroup) -> Result<()> {
    if g.size() < 2 {
        return Ok(());
    }
    match g.rank() {
        0 => g.send((&vec![1.0f32; 5]).into(), 1, 99)?,
        1 => {
            let mut too_small = vec![0f32; 4];
            match g.recv((&mut too_small).into(), 0, 99) {
                Err(crate::CommError::InvalidBuffer { .. }) => {}
                other => {
                    bail!("recv into a 4-element buffer of a 5-element message gave {other:?}")
                }
            }
        }
        _ => {}
    }
    g.barrier()?;
    Ok(())
}

/// DDP's pattern: async all-reduces on disjoint buckets of one flat buffer, started
/// while other parts are still being written, must equal the synchronous result.
fn check_async_buckets(g: &dyn ProcessGroup) -> Result<()> {
    let len = 10_007;
    let inputs = all_inputs::<f32>(g.size(), len, 7);
    let expected = reference_reduce(&inputs, ReduceOp::Average);
    let mut flat = vec![0f32; len];
    let bounds = [0, 3, 4000, 4001, 9000, len];
    let mut works = Vec::new();
    // Fill buckets back to front like a backward pass; start each bucket's reduction
    // as soon as it is written, while earlier parts are written afterwards.
    for b in (0..bounds.len() - 1).rev() {
        let (lo, hi) = (bounds[b], bounds[b + 1]);
        flat[lo..hi].copy_from_slice(&inputs[g.rank()][lo..hi]);
        // SAFETY: `flat[lo..hi]` is not touched again until every Work is waited on
        // below, and the buckets are disjoint.
        let bucket = unsafe { RawBuf::from_raw_parts(flat.as_mut_ptr().add(lo), hi - lo) };
        works.push(unsafe { g.all_reduce_async(bucket, ReduceOp::Average)? });
    }
    for w in works {
        w.wait()?;
    }
    expect_equal("async bucketed all_reduce", &flat, &expected)?;

    // A synchronous op after async ones runs after them (same order on every rank).
    let mut owned = crate::OwnedBuf::F32(inputs[g.rank()].clone());
    let work = g.all_reduce_owned(owned, ReduceOp::Sum)?;
    let mut after = test_input::<f32>(g.rank(), 33, 8);
    g.all_reduce((&mut after).into(), ReduceOp::Max)?;
    owned = work.wait()?;
    let Some(owned) = f32::from_owned(owned) else {
        bail!("owned all_reduce returned another dtype")
    };
    expect_equal(
        "owned async all_reduce",
        &owned,
        &reference_reduce(&inputs, ReduceOp::Sum),
    )?;
    expect_equal(
        "sync all_reduce after async",
        &after,
        &reference_reduce(&all_inputs::<f32>(g.size(), 33, 8), ReduceOp::Max),
    )?;
    let barrier = g.barrier_async()?;
    barrier.wait()?;
    Ok(())
}

/// Every operation in its async form, all in flight at once, equals the reference.
fn check_async_ops(g: &dyn ProcessGroup) -> Result<()> {
    let (n, r) = (g.size(), g.rank());
    let scatter_in = test_input::<bf16>(r, 7 * n, 11);
    let mut scatter_out = vec![bf16::ZERO; 7];
    let gather_in = test_input::<f16>(r, 5, 12);
    let mut gather_out = vec![f16::ZERO; 5 * n];
    let mut bcast = test_input::<f32>(r, 9, 13);
    let send_buf = test_input::<f32>(r, 3, 14);
    let mut recv_buf = vec![0f32; 3];
    let mut scatter_in_copy = scatter_in.clone();
    let mut gather_in_copy = gather_in.clone();
    let mut send_copy = send_buf.clone();
    // SAFETY: every buffer outlives the Works, which are all waited on below, and no
    // buffer is touched while its operation is in flight.
    unsafe {
        let mut works = vec![
            g.reduce_scatter_async(
                RawBuf::from_slice(&mut scatter_in_copy),
                RawBuf::from_slice(&mut scatter_out),
                ReduceOp::Sum,
            )?,
            g.all_gather_async(
                RawBuf::from_slice(&mut gather_in_copy),
                RawBuf::from_slice(&mut gather_out),
            )?,
            g.broadcast_async(RawBuf::from_slice(&mut bcast), n - 1)?,
        ];
        if n > 1 {
            works.push(g.send_async(RawBuf::from_slice(&mut send_copy), (r + 1) % n, 3)?);
            works.push(g.recv_async(RawBuf::from_slice(&mut recv_buf), (r + n - 1) % n, 3)?);
        }
        for w in works {
            w.wait()?;
        }
    }
    let full = reference_reduce(&all_inputs::<bf16>(n, 7 * n, 11), ReduceOp::Sum);
    expect_equal(
        "async reduce_scatter",
        &scatter_out,
        &full[r * 7..(r + 1) * 7],
    )?;
    expect_equal(
        "async all_gather",
        &gather_out,
        &all_inputs::<f16>(n, 5, 12).concat(),
    )?;
    expect_equal("async broadcast", &bcast, &test_input::<f32>(n - 1, 9, 13))?;
    if n > 1 {
        expect_equal(
            "async send/recv",
            &recv_buf,
            &test_input::<f32>((r + n - 1) % n, 3, 14),
        )?;
    }
    Ok(())
}

/// Sub-groups of even and odd ranks reduce independently.
fn check_subgroups(g: &dyn ProcessGroup) -> Result<()> {
    let n = g.size();
    let parity = g.rank() % 2;
    let members: Vec<usize> = (0..n).filter(|r| r % 2 == parity).collect();
    let sub = g.new_subgroup(&members)?;
    ensure!(sub.size() == members.len(), "sub-group size");
    ensure!(
        members[sub.rank()] == g.rank(),
        "sub-group rank {} does not map to parent rank {}",
        sub.rank(),
        g.rank()
    );
    let len = 1023;
    let inputs: Vec<Vec<f32>> = members.iter().map(|&r| test_input(r, len, 9)).collect();
    let mut mine = inputs[sub.rank()].clone();
    sub.all_reduce((&mut mine).into(), ReduceOp::Sum)?;
    expect_equal(
        "sub-group all_reduce",
        &mine,
        &reference_reduce(&inputs, ReduceOp::Sum),
    )?;
    g.barrier()?;
    Ok(())
}

fn check_dtype<T: Element>(g: &dyn ProcessGroup) -> Result<()> {
    for len in SIZES {
        for op in [ReduceOp::Sum, ReduceOp::Average, ReduceOp::Max] {
            check_all_reduce::<T>(g, len, op)?;
        }
        check_all_gather::<T>(g, len)?;
        check_broadcast::<T>(g, len)?;
        check_send_recv::<T>(g, len)?;
    }
    for chunk in [0, 1, 7, 1023] {
        for op in [ReduceOp::Sum, ReduceOp::Average, ReduceOp::Max] {
            check_reduce_scatter::<T>(g, chunk, op)?;
        }
    }
    Ok(())
}

/// Runs the whole suite on `g`; every rank of `g` must call it.
pub fn run_suite(g: &dyn ProcessGroup) -> Result<()> {
    let rank = g.rank();
    let run = || -> Result<()> {
        check_dtype::<f32>(g)?;
        check_dtype::<bf16>(g)?;
        check_dtype::<f16>(g)?;
        check_recv_size_mismatch(g)?;
        check_async_buckets(g)?;
        check_async_ops(g)?;
        check_subgroups(g)?;
        g.barrier()?;
        Ok(())
    };
    run().with_context(|| format!("conformance suite on rank {rank} of {}", g.size()))
}
