//! Intra-op parallelism helpers.
//!
//! Every worker runs its step inside its own rayon pool (`pool.install`), sized by the caller so
//! that data-parallel workers never oversubscribe the cores. Kernels ask [`threads`] and take
//! a serial path when it is 1, which keeps single-thread workers free of rayon overhead.

use rayon::prelude::*;

/// Threads available to kernels in the current pool.
pub fn threads() -> usize {
    rayon::current_num_threads()
}

/// Build a pool of `n` threads (n ≥ 1) for one worker. Also tunes the allocator (see
/// [`tune_allocator`]), since every training process builds a pool before its first step.
pub fn pool(n: usize) -> rayon::ThreadPool {
    tune_allocator();
    rayon::ThreadPoolBuilder::new()
        .num_threads(n.max(1))
        .build()
        .expect("failed to start a rayon thread pool")
}

/// Below this many elements a kernel runs on one thread: splitting costs more than it saves.
pub const PARALLEL_MIN_LEN: usize = 16 * 1024;

fn worth_splitting(len: usize, chunk: usize) -> bool {
    threads() > 1 && len >= PARALLEL_MIN_LEN && len > chunk
}

/// How many consecutive `chunk`-sized pieces one parallel task takes: enough for about
/// `4 × threads` tasks of at least [`PARALLEL_MIN_LEN`] elements. Callers cut their data at
/// natural boundaries (a pooling plane of 196 values, a 256-wide layer-norm row); one rayon
/// task per such piece would cost more in scheduling than the piece's own work.
fn pieces_per_task(len: usize, chunk: usize) -> usize {
    (chunk_len(len, PARALLEL_MIN_LEN) / chunk).max(1)
}

/// Run `f(chunk_index, chunk)` over `chunk`-sized pieces of `data`, in parallel when the pool
/// has several threads and the work is large enough to pay for it.
pub fn for_each_chunk_mut<T, F>(data: &mut [T], chunk: usize, f: F)
where
    T: Send,
    F: Fn(usize, &mut [T]) + Sync + Send,
{
    let chunk = chunk.max(1);
    if worth_splitting(data.len(), chunk) {
        let group = pieces_per_task(data.len(), chunk);
        data.par_chunks_mut(chunk * group)
            .enumerate()
            .for_each(|(g, task)| {
                for (i, c) in task.chunks_mut(chunk).enumerate() {
                    f(g * group + i, c);
                }
            });
    } else {
        data.chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    }
}

/// [`for_each_chunk_mut`] over two buffers cut into the same number of pieces (an output and
/// its companion: max-pool values and winners, batch-norm output and normalised input).
pub fn for_each_chunk_pair_mut<A, B, F>(
    a: &mut [A],
    chunk_a: usize,
    b: &mut [B],
    chunk_b: usize,
    f: F,
) where
    A: Send,
    B: Send,
    F: Fn(usize, &mut [A], &mut [B]) + Sync + Send,
{
    let (chunk_a, chunk_b) = (chunk_a.max(1), chunk_b.max(1));
    if worth_splitting(a.len(), chunk_a) {
        let group = pieces_per_task(a.len(), chunk_a);
        a.par_chunks_mut(chunk_a * group)
            .zip(b.par_chunks_mut(chunk_b * group))
            .enumerate()
            .for_each(|(g, (x, y))| {
                for (i, (x, y)) in x.chunks_mut(chunk_a).zip(y.chunks_mut(chunk_b)).enumerate() {
                    f(g * group + i, x, y);
                }
            });
    } else {
        a.chunks_mut(chunk_a)
            .zip(b.chunks_mut(chunk_b))
            .enumerate()
            .for_each(|(i, (x, y))| f(i, x, y));
    }
}

/// `f(chunk_index, chunk)` over pieces of `data`, results collected in chunk order (so a
/// caller summing them gets the same order, and bits, on any pool size).
pub fn map_chunks_mut<T, R, F>(data: &mut [T], chunk: usize, f: F) -> Vec<R>
where
    T: Send,
    R: Send,
    F: Fn(usize, &mut [T]) -> R + Sync + Send,
{
    let chunk = chunk.max(1);
    if !worth_splitting(data.len(), chunk) {
        return data
            .chunks_mut(chunk)
            .enumerate()
            .map(|(i, c)| f(i, c))
            .collect();
    }
    let group = pieces_per_task(data.len(), chunk);
    let tasks = data.par_chunks_mut(chunk).with_min_len(group);
    tasks.enumerate().map(|(i, c)| f(i, c)).collect()
}

/// Read-only [`map_chunks_mut`].
pub fn map_chunks<T, R, F>(data: &[T], chunk: usize, f: F) -> Vec<R>
where
    T: Sync,
    R: Send,
    F: Fn(usize, &[T]) -> R + Sync + Send,
{
    let chunk = chunk.max(1);
    if !worth_splitting(data.len(), chunk) {
        return data
            .chunks(chunk)
            .enumerate()
            .map(|(i, c)| f(i, c))
            .collect();
    }
    let group = pieces_per_task(data.len(), chunk);
    let tasks = data.par_chunks(chunk).with_min_len(group);
    tasks.enumerate().map(|(i, c)| f(i, c)).collect()
}

/// Chunk length that splits `len` elements into about `4 × threads` pieces of at least `min`.
pub fn chunk_len(len: usize, min: usize) -> usize {
    let pieces = 4 * threads();
    len.div_ceil(pieces).max(min)
}

/// Element-wise map in place, parallel for large buffers.
pub fn map_inplace<F>(data: &mut [f32], f: F)
where
    F: Fn(f32) -> f32 + Sync + Send,
{
    let chunk = chunk_len(data.len(), PARALLEL_MIN_LEN);
    for_each_chunk_mut(data, chunk, |_, c| c.iter_mut().for_each(|v| *v = f(*v)));
}

/// `dst += src`, parallel for large buffers.
pub fn add_assign(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len());
    let chunk = chunk_len(dst.len(), PARALLEL_MIN_LEN);
    for_each_chunk_mut(dst, chunk, |i, c| {
        let s = &src[i * chunk..i * chunk + c.len()];
        c.iter_mut().zip(s).for_each(|(d, s)| *d += s);
    });
}

/// Keep freed activation buffers inside the process.
///
/// glibc serves large allocations with fresh `mmap`s and unmaps them on free, so every step's
/// activations page-fault and get zeroed by the kernel again (measured: ~20% of a LeNet step).
/// Raising the mmap and trim thresholds makes freed buffers reusable. Idempotent.
pub fn tune_allocator() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            extern "C" {
                fn mallopt(param: i32, value: i32) -> i32;
            }
            const M_TRIM_THRESHOLD: i32 = -1;
            const M_MMAP_THRESHOLD: i32 = -3;
            // SAFETY: mallopt only changes allocator tuning parameters.
            unsafe {
                mallopt(M_MMAP_THRESHOLD, 1 << 30);
                mallopt(M_TRIM_THRESHOLD, i32::MAX);
            }
        }
    });
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<Vec<f32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Buffers kept per thread at most; more are simply freed. A GPT step has a few dozen
/// activation-sized buffers alive at once: all of them should find their way back.
const MAX_RECYCLED: usize = 64;

/// A recycled buffer serves a request only if it is at most this many times larger, so that a
/// small tensor does not pin a large buffer that the next large request then misses.
const MAX_OVERSIZE: usize = 4;

/// A buffer of `len` elements with unspecified contents (left over from earlier use), taken
/// from this thread's recycled buffers when one of a fitting size is there: for data that the
/// caller overwrites completely (im2col columns, product outputs, element-wise results).
/// Saves both the allocation and the zero-fill that `vec![0.0; len]` pays on every call; give
/// it back with [`recycle`] (or `Tensor::recycle`) once it is dead.
pub fn take_buffer(len: usize) -> Vec<f32> {
    let recycled = SCRATCH.with(|s| {
        let mut pool = s.borrow_mut();
        // The smallest buffer that fits without being far too large.
        let fit = (0..pool.len())
            .filter(|&i| {
                let cap = pool[i].capacity();
                cap >= len && cap <= len.max(1024).saturating_mul(MAX_OVERSIZE)
            })
            .min_by_key(|&i| pool[i].capacity());
        fit.map(|i| pool.swap_remove(i))
    });
    match recycled {
        Some(mut buf) => {
            // Within capacity: only a growing tail (if any) is written.
            buf.resize(len, 0.0);
            buf
        }
        None => vec![0.0; len],
    }
}

/// [`take_buffer`] with every element set to `value` (a recycled buffer cleared, instead of
/// `vec![value; len]`'s fresh allocation and its page faults).
pub fn filled_buffer(len: usize, value: f32) -> Vec<f32> {
    let mut buf = take_buffer(len);
    buf.fill(value);
    buf
}

/// Return a buffer for reuse by [`take_buffer`] / [`with_scratch`] on this thread.
pub fn recycle(buf: Vec<f32>) {
    SCRATCH.with(|s| {
        let mut pool = s.borrow_mut();
        if pool.len() < MAX_RECYCLED {
            pool.push(buf);
        }
    });
}

/// Run `f` with a temporary buffer of `len` elements whose contents are unspecified (see
/// [`take_buffer`]); the buffer goes back to the pool afterwards.
pub fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut buf = take_buffer(len);
    let r = f(&mut buf);
    recycle(buf);
    r
}
