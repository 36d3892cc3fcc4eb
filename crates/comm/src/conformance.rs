//! Backend conformance suite: every operation checked against a serial reference.
//!
//! Each rank generates every rank's input locally (a deterministic function of rank
//! and index), runs the operation through the group, and compares its result with
//! the reference computed serially from all inputs. Inputs are small integers, so
//! sums are exact in f32, bf16 and f16 whatever order a backend reduces in, and the
//! comparison can be bit-exact for every backend. The same suite runs on the threads
//! backend (`tests/threads.rs`) and on MPI (`examples/mpi_collectives.rs` under mpirun).

use crate::dtype::{reference_reduce, Element, RawBuf, ReduceOp};
use crate::error::CommError;
use crate::group::{Operation, ProcessGroup};
use crate::staged::{DeviceAlloc, DeviceMemory};
use anyhow::{bail, ensure, Context, Result};
use half::{bf16, f16};

/// Element counts exercised: empty, single, odd, around a cache line, more than one
/// kernel block (4096) and not a multiple of anything.
pub const SIZES: [usize; 6] = [0, 1, 7, 17, 1023, 4099];

/// Per-rank chunk lengths of the all-to-all checks: empty, single, odd, around a cache
/// line, and a few hundred. Large groups use shorter chunks, so that every (source,
/// destination, element) still gets its own value (see [`ROUTED_CODES`]).
pub const ALL_TO_ALL_CHUNKS: [usize; 5] = [0, 1, 7, 17, 300];

/// How many distinct test values the all-to-all checks have: an exchange needs one per
/// (source, destination, element), `size² × chunk` in all.
pub const ROUTED_CODES: usize = 128 * 30 * 2;

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

/// What rank `src` sends rank `dst` at `index` of its chunk, in an all-to-all of `chunk`
/// elements per rank on `n` ranks. The test values of the reductions repeat (any value
/// is fine there); an all-to-all only moves data, so each (src, dst, index) gets a value
/// of its own, and a chunk from the wrong rank, to the wrong rank or shifted is caught.
/// Values are exact in f32, bf16 and f16 — a significand 128..=255 (bf16 keeps 8 bits)
/// times 2^e for e in -21..=8 (f16's normal range, up to 65280), either sign — and never
/// zero, so a chunk left unwritten is caught too.
fn routed_value<T: Element>(n: usize, chunk: usize, src: usize, dst: usize, index: usize) -> T {
    let code = (src * n + dst) * chunk + index;
    assert!(code < ROUTED_CODES, "routed value {code} would repeat");
    let significand = (128 + code % 128) as f32;
    let exponent = (code / 128 % 30) as i32 - 21;
    let sign = if code / (128 * 30) == 0 { 1.0 } else { -1.0 };
    T::from_f32(sign * significand * 2f32.powi(exponent))
}

/// Rank `rank`'s all-to-all input (chunk j for rank j) and the output it must receive
/// (chunk i from rank i).
fn all_to_all_case<T: Element>(n: usize, chunk: usize, rank: usize) -> (Vec<T>, Vec<T>) {
    let mut input = Vec::with_capacity(n * chunk);
    let mut expected = Vec::with_capacity(n * chunk);
    for peer in 0..n {
        for i in 0..chunk {
            input.push(routed_value(n, chunk, rank, peer, i));
            expected.push(routed_value(n, chunk, peer, rank, i));
        }
    }
    (input, expected)
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

fn check_all_to_all<T: Element>(g: &dyn ProcessGroup, chunk: usize) -> Result<()> {
    let n = g.size();
    let chunk = chunk.min(ROUTED_CODES / (n * n));
    let (input, expected) = all_to_all_case::<T>(n, chunk, g.rank());
    let mut out = vec![T::from_f32(0.0); chunk * n];
    g.all_to_all((&input).into(), (&mut out).into())?;
    expect_equal(
        &format!("all_to_all {} chunk {chunk}", T::DTYPE),
        &out,
        &expected,
    )
}

/// `result` must be an all_to_all `InvalidBuffer` error whose details contain `needle`.
fn expect_invalid_all_to_all(
    what: &str,
    result: Result<(), CommError>,
    needle: &str,
) -> Result<()> {
    match result {
        Err(CommError::InvalidBuffer { ctx, details })
            if ctx.op == "all_to_all" && details.contains(needle) =>
        {
            Ok(())
        }
        other => bail!("all_to_all with {what} gave {other:?}, expected InvalidBuffer ({needle})"),
    }
}

/// Buffers that do not split into one equal chunk per rank, mismatched dtypes and
/// overlapping views are rejected on every rank before anything moves, and the group
/// stays usable.
fn check_all_to_all_rejects_invalid_buffers(g: &dyn ProcessGroup) -> Result<()> {
    let n = g.size();
    let input = vec![1.0f32; 2 * n];
    let mut longer = vec![0f32; 2 * n + 1];
    expect_invalid_all_to_all(
        "an output longer than the input",
        g.all_to_all((&input).into(), (&mut longer).into()),
        &format!("input has {} elements but output has {}", 2 * n, 2 * n + 1),
    )?;
    if n > 1 {
        let uneven = vec![1.0f32; 2 * n + 1];
        expect_invalid_all_to_all(
            "a length that is not a multiple of the group size",
            g.all_to_all((&uneven).into(), (&mut longer).into()),
            &format!("is not a multiple of the group size {n}"),
        )?;
    }
    let mut halves = vec![bf16::ZERO; 2 * n];
    expect_invalid_all_to_all(
        "an f32 input and a bf16 output",
        g.all_to_all((&input).into(), (&mut halves).into()),
        "input is f32 but output is bf16",
    )?;
    let mut shared = vec![0f32; 3 * n];
    // SAFETY: `shared` outlives the Work, waited on at once; validation rejects the
    // overlapping views before the operation could touch them.
    let overlapping = unsafe {
        let start = shared.as_mut_ptr();
        g.all_to_all_async(
            RawBuf::from_raw_parts(start, 2 * n),
            RawBuf::from_raw_parts(start.add(n), 2 * n),
        )?
        .wait()
    };
    expect_invalid_all_to_all("overlapping input and output", overlapping, "overlap")?;
    ensure!(
        longer.iter().chain(&shared).all(|&x| x == 0.0) && halves.iter().all(|&x| x == bf16::ZERO),
        "a rejected all_to_all wrote its output"
    );
    g.barrier()?;
    Ok(())
}

/// `result` must be a desync error of collective #1 whose details name every text in
/// `needles`; returns the name of the operation the error is about.
fn expect_desync(
    what: &str,
    result: Result<(), CommError>,
    needles: &[String],
) -> Result<&'static str> {
    match result {
        Err(CommError::Desync { ctx, details })
            if ctx.seq == 1
                && needles
                    .iter()
                    .all(|needle| details.contains(needle.as_str())) =>
        {
            Ok(ctx.op)
        }
        other => bail!("{what} gave {other:?}, expected a desync error of #1 naming {needles:?}"),
    }
}

/// Ranks that disagree on an all-to-all — another element count, or another collective
/// at the same sequence number — all get a desync error naming it, before any data
/// moves. Each case runs on a throw-away group of every rank, because a desync leaves
/// its group unusable.
fn check_all_to_all_desync(g: &dyn ProcessGroup) -> Result<()> {
    let (n, rank) = (g.size(), g.rank());
    if n < 2 || !g.config().check_desync {
        return Ok(());
    }
    let everyone: Vec<usize> = (0..n).collect();

    // Rank 0 sends 3 elements to every rank, the others 2.
    let scratch = g.new_subgroup(&everyone)?;
    let whole = if rank == 0 { 3 * n } else { 2 * n };
    let input = vec![1.0f32; whole];
    let mut output = vec![0f32; whole];
    let op = expect_desync(
        "all_to_all with rank 0 sending more elements",
        scratch.all_to_all((&input).into(), (&mut output).into()),
        &[
            format!("rank {}: all_to_all #1 f32×{}", g.global_ranks()[0], 3 * n),
            format!("rank {}: all_to_all #1 f32×{}", g.global_ranks()[1], 2 * n),
        ],
    )?;
    ensure!(
        op == "all_to_all",
        "the desync error is about {op}, not all_to_all"
    );
    ensure!(
        output.iter().all(|&x| x == 0.0),
        "desynchronised all_to_all wrote its output"
    );
    drop(scratch);

    // The last rank all-gathers where the others all-to-all.
    let scratch = g.new_subgroup(&everyone)?;
    let last = n - 1;
    let input = vec![1.0f32; 2 * n];
    let mut output = vec![0f32; 2 * n];
    let result = if rank == last {
        scratch.all_gather((&input[..2]).into(), (&mut output).into())
    } else {
        scratch.all_to_all((&input).into(), (&mut output).into())
    };
    let op = expect_desync(
        "all_gather on the last rank against all_to_all on the others",
        result,
        &[
            format!("rank {}: all_to_all #1 f32×{}", g.global_ranks()[0], 2 * n),
            format!("rank {}: all_gather #1 f32×2", g.global_ranks()[last]),
        ],
    )?;
    let own_op = if rank == last {
        "all_gather"
    } else {
        "all_to_all"
    };
    ensure!(
        op == own_op,
        "the desync error is about {op}, not this rank's {own_op}"
    );
    ensure!(
        output.iter().all(|&x| x == 0.0),
        "desynchronised all_to_all wrote its output"
    );
    Ok(())
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
    let (mut exchange_in, exchange_expected) = all_to_all_case::<f16>(n, 3, r);
    let mut exchange_out = vec![f16::ZERO; 3 * n];
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
            g.all_to_all_async(
                RawBuf::from_slice(&mut exchange_in),
                RawBuf::from_slice(&mut exchange_out),
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
    expect_equal("async all_to_all", &exchange_out, &exchange_expected)?;
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
    for chunk in ALL_TO_ALL_CHUNKS {
        check_all_to_all::<T>(g, chunk)?;
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
        check_all_to_all_rejects_invalid_buffers(g)?;
        check_all_to_all_desync(g)?;
        check_async_buckets(g)?;
        check_async_ops(g)?;
        check_subgroups(g)?;
        g.barrier()?;
        Ok(())
    };
    run().with_context(|| format!("conformance suite on rank {rank} of {}", g.size()))
}

/// Host values put into a device's memory and read back, for the device suite.
struct OnDevice<'a> {
    memory: &'a dyn DeviceMemory,
}

impl OnDevice<'_> {
    fn put<T: Element>(&self, values: &[T]) -> Result<DeviceAlloc> {
        let alloc = self
            .memory
            .alloc(std::mem::size_of_val(values))
            .map_err(anyhow::Error::msg)?;
        self.memory
            .upload(alloc.addr(), bytemuck::cast_slice(values))
            .map_err(anyhow::Error::msg)?;
        Ok(alloc)
    }

    fn zeros<T: Element>(&self, len: usize) -> Result<DeviceAlloc> {
        self.put(&vec![T::from_f32(0.0); len])
    }

    fn get<T: Element>(&self, alloc: &DeviceAlloc, len: usize) -> Result<Vec<T>> {
        let mut out = vec![T::from_f32(0.0); len];
        self.memory
            .download(alloc.addr(), bytemuck::cast_slice_mut(&mut out))
            .map_err(anyhow::Error::msg)?;
        Ok(out)
    }
}

/// A view of the first `len` elements of `alloc`.
fn view<T: Element>(alloc: &DeviceAlloc, len: usize) -> RawBuf {
    // SAFETY: the suite keeps `alloc` alive and untouched until the operation completed.
    unsafe { alloc.view(T::DTYPE, len) }
}

/// The operations of the device suite.
#[derive(Clone, Copy, Debug)]
enum DeviceCase {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    AllGather,
    AllToAll,
    Broadcast,
    SendRecv,
}

/// Runs `op` synchronously or started and waited for.
fn run_op(g: &dyn ProcessGroup, op: Operation, asynchronous: bool) -> Result<(), CommError> {
    // SAFETY: the callers' buffers outlive the call, and the Work is waited on here.
    unsafe {
        if asynchronous {
            g.start_raw(op)?.wait()
        } else {
            g.run_raw(op)
        }
    }
}

/// One operation on device buffers of `len` elements per rank (a chunk, for the operations
/// that have them), against the serial reference.
fn check_device_case<T: Element>(
    g: &dyn ProcessGroup,
    d: &OnDevice,
    case: DeviceCase,
    len: usize,
    asynchronous: bool,
) -> Result<()> {
    let (n, r) = (g.size(), g.rank());
    let what = format!(
        "{case:?} {} len {len} on {}{}",
        T::DTYPE,
        d.memory.device(),
        if asynchronous { " (async)" } else { "" }
    );
    let (got, expected) = match case {
        DeviceCase::AllReduce(op) => {
            let inputs = all_inputs::<T>(n, len, 1);
            let buf = d.put(&inputs[r])?;
            let buf_view = view::<T>(&buf, len);
            run_op(g, Operation::AllReduce { buf: buf_view, op }, asynchronous)?;
            (d.get::<T>(&buf, len)?, reference_reduce(&inputs, op))
        }
        DeviceCase::ReduceScatter(op) => {
            let inputs = all_inputs::<T>(n, len * n, 2);
            let (input, output) = (d.put(&inputs[r])?, d.zeros::<T>(len)?);
            let (input, output_view) = (view::<T>(&input, len * n), view::<T>(&output, len));
            let scatter = Operation::ReduceScatter {
                input,
                output: output_view,
                op,
            };
            run_op(g, scatter, asynchronous)?;
            let full = reference_reduce(&inputs, op);
            (
                d.get::<T>(&output, len)?,
                full[r * len..(r + 1) * len].to_vec(),
            )
        }
        DeviceCase::AllGather => {
            let inputs = all_inputs::<T>(n, len, 3);
            let (input, output) = (d.put(&inputs[r])?, d.zeros::<T>(len * n)?);
            let gather = Operation::AllGather {
                input: view::<T>(&input, len),
                output: view::<T>(&output, len * n),
            };
            run_op(g, gather, asynchronous)?;
            (d.get::<T>(&output, len * n)?, inputs.concat())
        }
        DeviceCase::AllToAll => {
            let chunk = len.min(ROUTED_CODES / (n * n));
            let (input, expected) = all_to_all_case::<T>(n, chunk, r);
            let (input, output) = (d.put(&input)?, d.zeros::<T>(chunk * n)?);
            let exchange = Operation::AllToAll {
                input: view::<T>(&input, chunk * n),
                output: view::<T>(&output, chunk * n),
            };
            run_op(g, exchange, asynchronous)?;
            (d.get::<T>(&output, chunk * n)?, expected)
        }
        DeviceCase::Broadcast => {
            let root = n - 1;
            let buf = d.put(&test_input::<T>(r, len, 4))?;
            let buf_view = view::<T>(&buf, len);
            run_op(
                g,
                Operation::Broadcast {
                    buf: buf_view,
                    root,
                },
                asynchronous,
            )?;
            (d.get::<T>(&buf, len)?, test_input::<T>(root, len, 4))
        }
        DeviceCase::SendRecv => {
            if n < 2 {
                return Ok(());
            }
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            let (sent, received) = (d.put(&test_input::<T>(r, len, 5))?, d.zeros::<T>(len)?);
            let send = Operation::Send {
                buf: view::<T>(&sent, len),
                dst: next,
                tag: 20,
            };
            let recv = Operation::Recv {
                buf: view::<T>(&received, len),
                src: prev,
                tag: 20,
            };
            // SAFETY: both buffers live until the Works are waited on.
            let works = unsafe { [g.start_raw(send)?, g.start_raw(recv)?] };
            for work in works {
                work.wait()?;
            }
            (d.get::<T>(&received, len)?, test_input::<T>(prev, len, 5))
        }
    };
    expect_equal(&what, &got, &expected)
}

const DEVICE_CASES: [DeviceCase; 9] = [
    DeviceCase::AllReduce(ReduceOp::Sum),
    DeviceCase::AllReduce(ReduceOp::Average),
    DeviceCase::AllReduce(ReduceOp::Max),
    DeviceCase::ReduceScatter(ReduceOp::Sum),
    DeviceCase::ReduceScatter(ReduceOp::Average),
    DeviceCase::AllGather,
    DeviceCase::AllToAll,
    DeviceCase::Broadcast,
    DeviceCase::SendRecv,
];

fn check_device_dtype<T: Element>(g: &dyn ProcessGroup, d: &OnDevice) -> Result<()> {
    for len in SIZES {
        for case in DEVICE_CASES {
            check_device_case::<T>(g, d, case, len, false)?;
        }
    }
    for case in DEVICE_CASES {
        check_device_case::<T>(g, d, case, 1023, true)?;
    }
    Ok(())
}

/// DDP's pattern on a device: asynchronous all-reduces of disjoint buckets of one flat
/// gradient buffer, all in flight at once, and a synchronous one after them.
fn check_device_buckets(g: &dyn ProcessGroup, d: &OnDevice) -> Result<()> {
    let len = 10_007;
    let inputs = all_inputs::<f32>(g.size(), len, 7);
    let flat = d.put(&inputs[g.rank()])?;
    let bounds = [0, 3, 4000, 4001, 9000, len];
    let mut works = Vec::new();
    for b in (0..bounds.len() - 1).rev() {
        let (lo, hi) = (bounds[b], bounds[b + 1]);
        // Disjoint buckets of `flat`, which lives until every Work is waited on.
        let bucket = view::<f32>(&flat, len).sub(lo, hi - lo);
        // SAFETY: as above.
        works.push(unsafe { g.all_reduce_async(bucket, ReduceOp::Average)? });
    }
    let after = d.put(&test_input::<f32>(g.rank(), 33, 8))?;
    run_op(
        g,
        Operation::AllReduce {
            buf: view::<f32>(&after, 33),
            op: ReduceOp::Max,
        },
        false,
    )?;
    for work in works {
        work.wait()?;
    }
    expect_equal(
        "async bucketed all_reduce on the device",
        &d.get::<f32>(&flat, len)?,
        &reference_reduce(&inputs, ReduceOp::Average),
    )?;
    expect_equal(
        "sync all_reduce after async ones on the device",
        &d.get::<f32>(&after, 33)?,
        &reference_reduce(&all_inputs::<f32>(g.size(), 33, 8), ReduceOp::Max),
    )
}

/// Sub-groups of even and odd ranks reduce device buffers independently.
fn check_device_subgroups(g: &dyn ProcessGroup, d: &OnDevice) -> Result<()> {
    let parity = g.rank() % 2;
    let members: Vec<usize> = (0..g.size()).filter(|r| r % 2 == parity).collect();
    let sub = g.new_subgroup(&members)?;
    check_device_case::<f32>(
        sub.as_ref(),
        d,
        DeviceCase::AllReduce(ReduceOp::Sum),
        1023,
        false,
    )?;
    check_device_case::<bf16>(sub.as_ref(), d, DeviceCase::AllGather, 17, true)?;
    g.barrier()?;
    Ok(())
}

/// Ranks that disagree on a collective of device buffers (rank 0 all-reduces one element
/// more) all get a desync error naming both calls, before any data moves: unchecked, NCCL
/// would read past the shorter buffer or wait forever. On a throw-away group of every rank,
/// because a desync leaves its group unusable.
fn check_device_desync(g: &dyn ProcessGroup, d: &OnDevice) -> Result<()> {
    let (n, rank) = (g.size(), g.rank());
    if n < 2 || !g.config().check_desync {
        return Ok(());
    }
    let everyone: Vec<usize> = (0..n).collect();
    let scratch = g.new_subgroup(&everyone)?;
    let len = if rank == 0 { 9 } else { 8 };
    let values: Vec<f32> = (0..len).map(|i| i as f32).collect();
    let buf = d.put(&values)?;
    let all_reduce = Operation::AllReduce {
        buf: view::<f32>(&buf, len),
        op: ReduceOp::Sum,
    };
    let op = expect_desync(
        "a device all_reduce of 9 elements on rank 0 and 8 on the others",
        run_op(scratch.as_ref(), all_reduce, false),
        // The backends word it differently (threads and MPI: a line per rank, NCCL: "rank 0
        // called … but rank 1 called …"); each names both ranks and both calls.
        &[
            format!("rank {}", g.global_ranks()[0]),
            "all_reduce sum #1 f32×9".into(),
            format!("rank {}", g.global_ranks()[1]),
            "all_reduce sum #1 f32×8".into(),
        ],
    )?;
    ensure!(
        op == "all_reduce",
        "the desync error is about {op}, not all_reduce"
    );
    ensure!(
        d.get::<f32>(&buf, len)? == values,
        "the desynchronised all_reduce wrote its device buffer"
    );
    drop(scratch);
    run_op(g, Operation::Barrier, false)?;
    Ok(())
}

/// One buffer on the host and one on the device in the same operation is refused before
/// any data moves, naming both places.
fn check_mixed_places_refused(g: &dyn ProcessGroup, d: &OnDevice) -> Result<()> {
    let n = g.size();
    let output = d.zeros::<f32>(n)?;
    let mut input = vec![1f32; 1];
    // SAFETY: both live past the (refused) call.
    let gather = unsafe {
        Operation::AllGather {
            input: RawBuf::from_slice(&mut input),
            output: view::<f32>(&output, n),
        }
    };
    match run_op(g, gather, false) {
        Err(CommError::InvalidBuffer { details, .. }) if details.contains("one device") => Ok(()),
        other => bail!("a host input with a device output: expected InvalidBuffer, got {other:?}"),
    }
}

/// Runs the suite on device buffers in `memory`: every operation, every dtype, synchronous
/// and asynchronous, DDP's bucket pattern, sub-groups and the desync check. For groups that take device
/// buffers ([`StagedGroup`](crate::StagedGroup), NCCL); every rank of `g` must call it.
pub fn run_device_suite(g: &dyn ProcessGroup, memory: &dyn DeviceMemory) -> Result<()> {
    let rank = g.rank();
    let d = OnDevice { memory };
    let run = || -> Result<()> {
        check_device_dtype::<f32>(g, &d)?;
        check_device_dtype::<bf16>(g, &d)?;
        check_device_dtype::<f16>(g, &d)?;
        check_device_buckets(g, &d)?;
        check_device_subgroups(g, &d)?;
        check_device_desync(g, &d)?;
        check_mixed_places_refused(g, &d)?;
        run_op(g, Operation::Barrier, true)?;
        Ok(())
    };
    run().with_context(|| {
        format!(
            "device conformance suite on rank {rank} of {} ({})",
            g.size(),
            memory.device()
        )
    })
}
