// bias.cu: deterministic column sums (bias gradients, and the second stage of layer norm's
// parameter gradients). See ABI.md.
//
// Two stages instead of atomics, so the result is bit-identical run to run:
// 1. Partial sums, one per column and block of rows_per_block rows, in fp32:
//    - colsum_partial_vec_*: the fast path, for cols a multiple of the vector width W (8
//      bf16/f16, 4 f32) and y 16-byte aligned (the Rust side checks both). Block (32, 8): a
//      lane owns W consecutive columns (one 16-byte load per row, so a warp reads 512
//      contiguous bytes of a row), and warp w of the block owns the w-th of 8 consecutive runs
//      of ceil(rows_per_block/8) rows. Each warp sums its run downwards, 8 rows loaded before
//      they are added in order (8 x 16 bytes in flight per thread); then warp 0 adds the 8
//      run sums in run order. Grid (ceil(cols / (32·W)), ceil(rows / rows_per_block)).
//    - colsum_partial_*: the fallback for any shape and alignment. Grid (ceil(cols/256),
//      ceil(rows/rows_per_block)), block 256, one thread per column of a block of rows,
//      summing its column downwards (16 rows loaded before they are added in order).
//    - act_bwd_colsum_*: colsum_partial_vec over the gradient of an activation, computed and
//      written in the same pass (a linear layer's activation backward and bias gradient).
// 2. colsum_finish: per column, the partials summed in double in block order (block 0 first),
//    then added to (or stored in) the output. A block takes 32 columns at a time: its threads
//    load up to 64 partials of the 32 columns into shared memory at once (8 loads in flight
//    per thread, coalesced), then warp 0 adds them, one lane per column, in block order.
//
// Cost of the bias gradient of a bf16 [16384 x 3072] tensor (GPT-2's fc1, rows_per_block 256):
// the partial pass reads 16384·3072·2 = 100,663,296 bytes and writes 64 x 3072 partials
// (786,432 bytes, 0.8%), the finish reads those back and writes 12 KiB: ~102.2 MB in all.
// Predicted: at the H100's copy rate (~2990 GB/s, read + write) 34.2 us, plus ~3 us for the
// finish (one round trip to memory and 64 dependent double additions): ~37 us, i.e. y read at
// 100.7 MB / 37 us = ~2700 GB/s, ~0.90 of the copy.
// Measured on an H100 (device time, CUDA graph of 20 calls): 38.8 us (partial 36.0, finish
// 2.6) = 2595 GB/s, 0.87 of the copy; the scalar kernel took 44.9 us (partial 41.8). Other
// rows_per_block: 64: 44.3 us, 128: 40.9, 512: 38.7 (768 columns: 11.4, 9.0, 8.2 at 256, 9.0);
// 4 or 16 rows per batch instead of 8: 39.0 / 40.5 us; 4 runs instead of 8: 39.3 us.
// `meshtrain bench gpu` (one call between two events, so the launch latency counts too):
// 0.045 ms, 0.75 of the copy (the scalar kernel and the old finish: 0.053 ms, 0.64).

#define MT_COLSUM_BATCH 16

template <class T>
__device__ __forceinline__ void colsum_partial_impl(const T* __restrict__ y,
                                                    float* __restrict__ partial, int rows,
                                                    int cols, int rows_per_block) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    const int r0 = blockIdx.y * rows_per_block;
    const int r1 = min(r0 + rows_per_block, rows);
    const T* col = y + (long long)r0 * cols + c;
    float s = 0.0f;
    int r = r0;
    for (; r + MT_COLSUM_BATCH <= r1; r += MT_COLSUM_BATCH) {
        float v[MT_COLSUM_BATCH];
#pragma unroll
        for (int k = 0; k < MT_COLSUM_BATCH; ++k) v[k] = to_f32(col[(long long)k * cols]);
#pragma unroll
        for (int k = 0; k < MT_COLSUM_BATCH; ++k) s += v[k];
        col += (long long)MT_COLSUM_BATCH * cols;
    }
    for (; r < r1; ++r) {
        s += to_f32(*col);
        col += cols;
    }
    partial[(long long)blockIdx.y * cols + c] = s;
}

extern "C" __global__ void __launch_bounds__(256)
colsum_partial_f32(const float* y, float* partial, int rows, int cols, int rows_per_block) {
    colsum_partial_impl(y, partial, rows, cols, rows_per_block);
}
extern "C" __global__ void __launch_bounds__(256)
colsum_partial_bf16(const bf16* y, float* partial, int rows, int cols, int rows_per_block) {
    colsum_partial_impl(y, partial, rows, cols, rows_per_block);
}
extern "C" __global__ void __launch_bounds__(256)
colsum_partial_f16(const f16* y, float* partial, int rows, int cols, int rows_per_block) {
    colsum_partial_impl(y, partial, rows, cols, rows_per_block);
}

// ---------------------------------------------------------------------------------------
// The vector path.

/// Lanes (blockDim.x) and row runs (blockDim.y) of colsum_partial_vec_*.
#define MT_COLSUM_LANES 32
#define MT_COLSUM_RUNS 8
/// Rows loaded before they are added, per thread (each 16 bytes).
#define MT_COLSUM_VBATCH 8

/// 16 bytes of a row: 4 floats, or 8 bf16/f16 values, and their conversion to floats.
template <class T> struct ColVec {
    static constexpr int W = 8;
    typedef uint4 Raw;
    static __device__ __forceinline__ void add(const Raw& q, float (&s)[W]) {
        const float2 a = unpack2<T>(q.x), b = unpack2<T>(q.y);
        const float2 c = unpack2<T>(q.z), d = unpack2<T>(q.w);
        s[0] += a.x; s[1] += a.y; s[2] += b.x; s[3] += b.y;
        s[4] += c.x; s[5] += c.y; s[6] += d.x; s[7] += d.y;
    }
};
template <> struct ColVec<float> {
    static constexpr int W = 4;
    typedef float4 Raw;
    static __device__ __forceinline__ void add(const Raw& q, float (&s)[W]) {
        s[0] += q.x; s[1] += q.y; s[2] += q.z; s[3] += q.w;
    }
};

/// Where a thread of a vector column-sum block (block (32, 8)) works: lane `lane`'s W columns
/// from `c` (`active` when inside the matrix), and run `run`'s rows [lo, hi) of the block's
/// rows_per_block (8 consecutive runs of ceil(rows_per_block/8), the last ones shorter or
/// empty).
struct ColsumRun {
    int lane, run, c, lo, hi;
    bool active;
    __device__ __forceinline__ ColsumRun(int W, int rows, int cols, int rows_per_block) {
        lane = threadIdx.x;
        run = threadIdx.y;
        c = (blockIdx.x * MT_COLSUM_LANES + lane) * W;
        active = c < cols;
        const int r0 = blockIdx.y * rows_per_block;
        const int r_end = min(r0 + rows_per_block, rows);
        const int per_run = (rows_per_block + MT_COLSUM_RUNS - 1) / MT_COLSUM_RUNS;
        lo = min(r0 + run * per_run, r_end);
        hi = min(lo + per_run, r_end);
    }
};

/// The end of a vector column-sum block: each warp's run sums `s` (lane `lane`'s W columns)
/// added in run order by warp 0 into `out` (the block's partial row at the lane's first
/// column). Every thread of the block calls it (it holds a barrier).
template <int W>
__device__ __forceinline__ void add_runs_into_partial(float (&s)[W],
                                                      float (*runs)[W][MT_COLSUM_LANES],
                                                      int lane, int run, bool active,
                                                      float* __restrict__ out) {
    if (run > 0) {
#pragma unroll
        for (int k = 0; k < W; ++k) runs[run - 1][k][lane] = s[k];
    }
    __syncthreads();
    if (run == 0 && active) {
#pragma unroll
        for (int j = 0; j < MT_COLSUM_RUNS - 1; ++j) {
#pragma unroll
            for (int k = 0; k < W; ++k) s[k] += runs[j][k][lane];
        }
        float4* out4 = reinterpret_cast<float4*>(out);
#pragma unroll
        for (int k = 0; k < W / 4; ++k)
            out4[k] = make_float4(s[4 * k], s[4 * k + 1], s[4 * k + 2], s[4 * k + 3]);
    }
}

template <class T>
__device__ __forceinline__ void colsum_partial_vec_impl(const T* __restrict__ y,
                                                        float* __restrict__ partial, int rows,
                                                        int cols, int rows_per_block) {
    typedef ColVec<T> V;
    constexpr int W = V::W;
    typedef typename V::Raw Raw;
    __shared__ float runs[MT_COLSUM_RUNS - 1][W][MT_COLSUM_LANES];
    const ColsumRun place(W, rows, cols, rows_per_block);
    const int lane = place.lane, run = place.run, c = place.c, lo = place.lo, hi = place.hi;
    const bool active = place.active;
    float s[W];
#pragma unroll
    for (int k = 0; k < W; ++k) s[k] = 0.0f;
    if (active) {
        // Row r's 16 bytes are Raw number r·(cols/W) + c/W.
        const long long stride = cols / W;
        const Raw* p = reinterpret_cast<const Raw*>(y) + (long long)lo * stride + c / W;
        int r = lo;
        for (; r + MT_COLSUM_VBATCH <= hi; r += MT_COLSUM_VBATCH) {
            Raw q[MT_COLSUM_VBATCH];
#pragma unroll
            for (int k = 0; k < MT_COLSUM_VBATCH; ++k) q[k] = p[k * stride];
#pragma unroll
            for (int k = 0; k < MT_COLSUM_VBATCH; ++k) V::add(q[k], s);
            p += MT_COLSUM_VBATCH * stride;
        }
        for (; r < hi; ++r) {
            V::add(*p, s);
            p += stride;
        }
    }
    add_runs_into_partial<W>(s, runs, lane, run, active, partial + (long long)blockIdx.y * cols + c);
}

extern "C" __global__ void __launch_bounds__(256)
colsum_partial_vec_f32(const float* y, float* partial, int rows, int cols, int rows_per_block) {
    colsum_partial_vec_impl(y, partial, rows, cols, rows_per_block);
}
extern "C" __global__ void __launch_bounds__(256)
colsum_partial_vec_bf16(const bf16* y, float* partial, int rows, int cols, int rows_per_block) {
    colsum_partial_vec_impl(y, partial, rows, cols, rows_per_block);
}
extern "C" __global__ void __launch_bounds__(256)
colsum_partial_vec_f16(const f16* y, float* partial, int rows, int cols, int rows_per_block) {
    colsum_partial_vec_impl(y, partial, rows, cols, rows_per_block);
}

// ---------------------------------------------------------------------------------------
// A linear layer's activation backward and its bias gradient in one pass
// (act_bwd_colsum_{f32,bf16,f16}): dx = act'(saved)·dy as elementwise.cu's act_bwd writes
// it, and the column sums of that dx as colsum_partial_vec sums them (the same blocks, runs
// and order, of the values as rounded to T): the gradient and the partials are the two
// kernels' bit for bit, and the column-sum pass's read of dx is saved. The launch and the
// conditions of colsum_partial_vec (cols a multiple of W; saved, dy and dx 16-byte
// aligned). dx may alias dy: each thread reads its values before it writes them.

/// Rows loaded before they are used, per thread: two 16-byte loads a row (saved and dy).
#define MT_ACT_COLSUM_BATCH 4

/// `runs`: the block's shared run sums (declared once by the caller, not per activation).
template <class T, int K>
__device__ __forceinline__ void act_bwd_colsum_loop(const T* __restrict__ saved, const T* dy,
                                                    T* dx, float* __restrict__ partial,
                                                    int rows, int cols, int rows_per_block,
                                                    float (*runs)[ColVec<T>::W][MT_COLSUM_LANES]) {
    constexpr int W = ColVec<T>::W;
    const ColsumRun place(W, rows, cols, rows_per_block);
    const int lane = place.lane, run = place.run, c = place.c, lo = place.lo, hi = place.hi;
    const bool active = place.active;
    float s[W];
#pragma unroll
    for (int k = 0; k < W; ++k) s[k] = 0.0f;
    if (active) {
        long long at = (long long)lo * cols + c;
        int r = lo;
        for (; r < hi;) {
            const int n = min(MT_ACT_COLSUM_BATCH, hi - r);
            float sv[MT_ACT_COLSUM_BATCH][W], gv[MT_ACT_COLSUM_BATCH][W];
#pragma unroll
            for (int k = 0; k < MT_ACT_COLSUM_BATCH; ++k) {
                if (k < n) {
                    load_w<W>(saved + at + (long long)k * cols, sv[k]);
                    load_w<W>(dy + at + (long long)k * cols, gv[k]);
                }
            }
#pragma unroll
            for (int k = 0; k < MT_ACT_COLSUM_BATCH; ++k) {
                if (k < n) {
#pragma unroll
                    for (int e = 0; e < W; ++e) gv[k][e] = act_grad<K>(sv[k][e], gv[k][e]);
                    store_w<W>(dx + at + (long long)k * cols, gv[k]);
                    // The sum takes the values as stored (and as colsum_partial_vec reads them).
#pragma unroll
                    for (int e = 0; e < W; ++e) s[e] += to_f32(from_f32<T>(gv[k][e]));
                }
            }
            r += n;
            at += (long long)n * cols;
        }
    }
    add_runs_into_partial<W>(s, runs, lane, run, active, partial + (long long)blockIdx.y * cols + c);
}

template <class T>
__device__ __forceinline__ void act_bwd_colsum_impl(const T* saved, const T* dy, T* dx,
                                                    float* partial, int rows, int cols,
                                                    int rows_per_block, int kind) {
    __shared__ float runs[MT_COLSUM_RUNS - 1][ColVec<T>::W][MT_COLSUM_LANES];
    switch (kind) {
        case 0: act_bwd_colsum_loop<T, 0>(saved, dy, dx, partial, rows, cols, rows_per_block, runs); break;
        case 1: act_bwd_colsum_loop<T, 1>(saved, dy, dx, partial, rows, cols, rows_per_block, runs); break;
        case 2: act_bwd_colsum_loop<T, 2>(saved, dy, dx, partial, rows, cols, rows_per_block, runs); break;
        case 4: act_bwd_colsum_loop<T, 4>(saved, dy, dx, partial, rows, cols, rows_per_block, runs); break;
        default: act_bwd_colsum_loop<T, 3>(saved, dy, dx, partial, rows, cols, rows_per_block, runs); break;
    }
}

extern "C" __global__ void __launch_bounds__(256)
act_bwd_colsum_f32(const float* saved, const float* dy, float* dx, float* partial, int rows,
                   int cols, int rows_per_block, int kind) {
    act_bwd_colsum_impl(saved, dy, dx, partial, rows, cols, rows_per_block, kind);
}
extern "C" __global__ void __launch_bounds__(256)
act_bwd_colsum_bf16(const bf16* saved, const bf16* dy, bf16* dx, float* partial, int rows,
                    int cols, int rows_per_block, int kind) {
    act_bwd_colsum_impl(saved, dy, dx, partial, rows, cols, rows_per_block, kind);
}
extern "C" __global__ void __launch_bounds__(256)
act_bwd_colsum_f16(const f16* saved, const f16* dy, f16* dx, float* partial, int rows,
                   int cols, int rows_per_block, int kind) {
    act_bwd_colsum_impl(saved, dy, dx, partial, rows, cols, rows_per_block, kind);
}

// ---------------------------------------------------------------------------------------
// The finish.

/// Columns per group and partials per chunk of colsum_finish (the chunk: 8 per thread of a
/// 256-thread block).
#define MT_FINISH_COLS 32
#define MT_FINISH_CHUNK 64
#define MT_FINISH_LOADS 8

/// Any grid, any block of 32..256 threads (256 load a chunk of 64 partials in one go). The
/// order of the additions is that of one thread per column adding its partials in block
/// order, which this replaced (loading 4 partials ahead, 12 blocks for 3072 columns: 3.0 us
/// for 64 x 3072 partials on an H100, this 2.6 us).
extern "C" __global__ void __launch_bounds__(256)
colsum_finish(const float* __restrict__ partial, float* __restrict__ out, int nblocks,
              int cols, int accumulate) {
    __shared__ float tile[MT_FINISH_CHUNK][MT_FINISH_COLS];
    const int t = threadIdx.x;
    // Partials per chunk: 8 per thread, at most the tile's 64 rows.
    const int chunk = min(MT_FINISH_CHUNK, (int)(MT_FINISH_LOADS * blockDim.x / MT_FINISH_COLS));
    const int groups = (cols + MT_FINISH_COLS - 1) / MT_FINISH_COLS;
    for (int g = blockIdx.x; g < groups; g += gridDim.x) {
        const int c0 = g * MT_FINISH_COLS;
        double s = 0.0;  // lane t's column, in warp 0
        for (int b0 = 0; b0 < nblocks; b0 += chunk) {
            const int n = min(chunk, nblocks - b0) * MT_FINISH_COLS;  // tile entries used
            float v[MT_FINISH_LOADS];
#pragma unroll
            for (int k = 0; k < MT_FINISH_LOADS; ++k) {
                const int e = t + k * blockDim.x, c = c0 + (e % MT_FINISH_COLS);
                v[k] = (e < n && c < cols)
                           ? partial[(long long)(b0 + e / MT_FINISH_COLS) * cols + c]
                           : 0.0f;
            }
#pragma unroll
            for (int k = 0; k < MT_FINISH_LOADS; ++k) {
                const int e = t + k * blockDim.x;
                if (e < n) tile[e / MT_FINISH_COLS][e % MT_FINISH_COLS] = v[k];
            }
            __syncthreads();
            if (t < MT_FINISH_COLS) {
                const int rows_here = n / MT_FINISH_COLS;
                for (int b = 0; b < rows_here; ++b) s += (double)tile[b][t];
            }
            __syncthreads();
        }
        const int c = c0 + t;
        if (t < MT_FINISH_COLS && c < cols) out[c] = accumulate ? out[c] + (float)s : (float)s;
    }
}

// ---------------------------------------------------------------------------------------
// y[r, c] += b[c] for y [rows, cols] in T and the bias in T (the products' dtype): the bias
// of a row-parallel layer, added once its partial products are summed over the group.
// Grid-stride over rows·cols, block 256; the sum is f32, rounded to T once.

template <class T>
__device__ __forceinline__ void bias_add_impl(T* __restrict__ y, const T* __restrict__ b,
                                              long long rows, int cols) {
    const long long t = global_thread(), stride = grid_threads();
    for (long long i = t; i < rows * cols; i += stride) {
        y[i] = from_f32<T>(to_f32(y[i]) + to_f32(b[i % cols]));
    }
}

extern "C" __global__ void __launch_bounds__(256)
bias_add_f32(float* y, const float* b, long long rows, int cols) { bias_add_impl(y, b, rows, cols); }
extern "C" __global__ void __launch_bounds__(256)
bias_add_bf16(bf16* y, const bf16* b, long long rows, int cols) { bias_add_impl(y, b, rows, cols); }
extern "C" __global__ void __launch_bounds__(256)
bias_add_f16(f16* y, const f16* b, long long rows, int cols) { bias_add_impl(y, b, rows, cols); }
