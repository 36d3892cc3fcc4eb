// bias.cu: deterministic column sums (bias gradients, and the second stage of layer norm's
// parameter gradients). See ABI.md.
//
// Two stages instead of atomics, so the result is bit-identical run to run:
// 1. colsum_partial: grid (ceil(cols/256), ceil(rows/rows_per_block)), one thread per column
//    of a block of rows_per_block rows, summing its column downwards in fp32. A warp reads 32
//    consecutive columns of one row per step (coalesced); the rows are loaded 16 at a time
//    before they are added in order, so 16 loads are in flight per thread.
// 2. colsum_finish: one thread per column sums the per-block partials in double, block 0
//    first, and adds the result to (or stores it in) the output.

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

/// Any grid over the columns. The partials of one column are `cols` apart; a warp reads 32
/// consecutive columns per block index (coalesced), 4 block indices loaded ahead. (Loading
/// 16 or 32 ahead measured the same on an H200: ~15 us for 256 x 3072 partials.)
extern "C" __global__ void __launch_bounds__(256)
colsum_finish(const float* __restrict__ partial, float* __restrict__ out, int nblocks,
              int cols, int accumulate) {
    for (long long c = global_thread(); c < cols; c += grid_threads()) {
        const float* p = partial + c;
        double s = 0.0;
        int b = 0;
        for (; b + 4 <= nblocks; b += 4) {
            const float v0 = p[0], v1 = p[(long long)cols], v2 = p[2LL * cols],
                        v3 = p[3LL * cols];
            s += (double)v0;
            s += (double)v1;
            s += (double)v2;
            s += (double)v3;
            p += 4LL * cols;
        }
        for (; b < nblocks; ++b) {
            s += (double)*p;
            p += cols;
        }
        out[c] = accumulate ? out[c] + (float)s : (float)s;
    }
}
