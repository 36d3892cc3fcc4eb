// optimizer.cu: AdamW / SGD updates over the flat fp32 parameter buffers (refreshing the
// 16-bit compute copy in the same pass), and the fixed-order global gradient norm. See
// ABI.md; the formulas and their order are the CPU's (crates/nn/src/optim.rs update_serial,
// clip_grad_norm).
//
// Updates: grid-stride loops (any grid, 256 threads) over float4 chunks when p, g, m, v are
// 16-byte aligned and p_half 8-byte aligned (whole buffers are), else element by element;
// the n % 4 tail is scalar. Parameter groups: a thread's indices only grow, so it keeps its
// current segment (index, end, lr·scale, weight decay) in registers and binary-searches the
// segment table (from the current segment on) only when an index passes the segment's end.

/// The segment of the element indices this thread visits, in increasing order.
struct SegmentCursor {
    const long long* ends;
    const float* wd_of;
    const float* lr_scale_of;
    int count;
    float lr;        // the base learning rate
    float c1;        // AdamW's 1 − β1^t (1 for SGD)
    int s;           // current segment, −1 before the first lookup
    long long end;   // its exclusive end
    float wd, lr_s;  // its weight decay and learning rate (lr · lr_scale)
    float decay;     // 1 − lr_s·wd (AdamW's decoupled decay)
    float step;      // lr_s / c1 (AdamW's step size)

    __device__ __forceinline__ SegmentCursor(const long long* ends_, const float* wd_,
                                             const float* lr_scale_, int count_, float lr_,
                                             float c1_)
        : ends(ends_), wd_of(wd_), lr_scale_of(lr_scale_), count(count_), lr(lr_), c1(c1_),
          s(-1), end(0), wd(0.0f), lr_s(0.0f), decay(1.0f), step(0.0f) {}

    /// Moves to the first segment with end > i (i never smaller than at the last call).
    __device__ __forceinline__ void seek(long long i) {
        if (s >= 0 && i < end) return;
        int lo = s < 0 ? 0 : s, hi = count - 1;
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (ends[mid] > i) hi = mid; else lo = mid + 1;
        }
        s = lo;
        end = ends[lo];
        // The last segment's end is n; an index at or past it does not occur. Treat the end as
        // unbounded so a stale table cannot send seek() searching for every element.
        if (lo == count - 1) end = 0x7fffffffffffffffLL;
        wd = wd_of[lo];
        lr_s = lr * lr_scale_of[lo];
        decay = 1.0f - lr_s * wd;
        step = lr_s / c1;
    }
};

__device__ __forceinline__ float load_mul(const float* grad_mul) {
    return grad_mul ? *grad_mul : 1.0f;
}

// ---------------------------------------------------------------------------------------
// AdamW, PyTorch's arrangement (decoupled decay, bias corrections folded into c1 and
// inv_sqrt_c2 by the host). What changes every step (the learning rate and the corrections)
// is read from device memory, `schedule` = {lr, c1, inv_sqrt_c2}, not passed as arguments:
// a step captured as a CUDA graph replays the launch with its captured arguments, and the
// host writes each step's values there.

struct AdamParams {
    float lr, beta1, beta2, eps, c1, inv_sqrt_c2, mul;
};

/// decay = 1 − lr_s·wd and step = lr_s/c1 come from the segment (computed once per segment,
/// in f32 as the CPU computes them once per group).
__device__ __forceinline__ void adamw_one(float& p, float g, float& m, float& v, float decay,
                                          float step, const AdamParams& a) {
    const float gi = g * a.mul;
    p *= decay;
    m = a.beta1 * m + (1.0f - a.beta1) * gi;
    v = a.beta2 * v + (1.0f - a.beta2) * gi * gi;
    const float denom = sqrtf(v) * a.inv_sqrt_c2 + a.eps;
    p -= step * m / denom;
}

template <class H, bool HALF>
__device__ __forceinline__ void adamw_impl(float* __restrict__ p, const float* __restrict__ g,
                                           float* __restrict__ m, float* __restrict__ v,
                                           H* __restrict__ p_half, long long n,
                                           const long long* __restrict__ seg_end,
                                           const float* __restrict__ seg_wd,
                                           const float* __restrict__ seg_lr_scale, int nseg,
                                           const AdamParams& a) {
    const long long t = global_thread(), stride = grid_threads();
    SegmentCursor seg(seg_end, seg_wd, seg_lr_scale, nseg, a.lr, a.c1);
    const bool vec = is_aligned(p, 16) && is_aligned(g, 16) && is_aligned(m, 16) &&
                     is_aligned(v, 16) && (!HALF || is_aligned(p_half, 8));
    const long long chunks = vec ? n / 4 : 0;
    for (long long c = t; c < chunks; c += stride) {
        const long long i = 4 * c;
        float4 pv = reinterpret_cast<float4*>(p)[c];
        const float4 gv = reinterpret_cast<const float4*>(g)[c];
        float4 mv = reinterpret_cast<float4*>(m)[c];
        float4 vv = reinterpret_cast<float4*>(v)[c];
        float pp[4] = {pv.x, pv.y, pv.z, pv.w}, mm[4] = {mv.x, mv.y, mv.z, mv.w};
        float vq[4] = {vv.x, vv.y, vv.z, vv.w};
        const float gg[4] = {gv.x, gv.y, gv.z, gv.w};
        seg.seek(i);
        if (i + 3 < seg.end) {  // the usual case: one segment for the whole chunk
#pragma unroll
            for (int k = 0; k < 4; ++k)
                adamw_one(pp[k], gg[k], mm[k], vq[k], seg.decay, seg.step, a);
        } else {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                seg.seek(i + k);
                adamw_one(pp[k], gg[k], mm[k], vq[k], seg.decay, seg.step, a);
            }
        }
        reinterpret_cast<float4*>(p)[c] = make_float4(pp[0], pp[1], pp[2], pp[3]);
        reinterpret_cast<float4*>(m)[c] = make_float4(mm[0], mm[1], mm[2], mm[3]);
        reinterpret_cast<float4*>(v)[c] = make_float4(vq[0], vq[1], vq[2], vq[3]);
        if constexpr (HALF) store4(p_half + i, pp);
    }
    for (long long i = chunks * 4 + t; i < n; i += stride) {
        seg.seek(i);
        float pi = p[i], mi = m[i], vi = v[i];
        adamw_one(pi, g[i], mi, vi, seg.decay, seg.step, a);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if constexpr (HALF) p_half[i] = from_f32<H>(pi);
    }
}

#define MT_ADAMW_ARGS                                                                        \
    float *p, const float *g, float *m, float *v, HALF_T *p_half, long long n,               \
        const long long *seg_end, const float *seg_wd, const float *seg_lr_scale, int nseg,  \
        const float *schedule, float beta1, float beta2, float eps, const float *grad_mul
#define MT_ADAMW_CALL(H, HALF)                                                               \
    adamw_impl<H, HALF>(p, g, m, v, p_half, n, seg_end, seg_wd, seg_lr_scale, nseg,          \
                        AdamParams{schedule[0], beta1, beta2, eps, schedule[1], schedule[2], \
                                   load_mul(grad_mul)})

/// `_none`: no 16-bit copy; `p_half` is passed (null) and ignored.
#define HALF_T float
extern "C" __global__ void __launch_bounds__(256) adamw_none(MT_ADAMW_ARGS) {
    MT_ADAMW_CALL(float, false);
}
#undef HALF_T
#define HALF_T bf16
extern "C" __global__ void __launch_bounds__(256) adamw_bf16(MT_ADAMW_ARGS) {
    MT_ADAMW_CALL(bf16, true);
}
#undef HALF_T
#define HALF_T f16
extern "C" __global__ void __launch_bounds__(256) adamw_f16(MT_ADAMW_ARGS) {
    MT_ADAMW_CALL(f16, true);
}
#undef HALF_T

// ---------------------------------------------------------------------------------------
// SGD with momentum (coupled weight decay, PyTorch's arrangement); `schedule` = {lr,
// first_step (1 or 0)} in device memory, as AdamW's.

__device__ __forceinline__ void sgd_one(float& p, float g, float& m, float lr_s, float wd,
                                        float momentum, bool fresh, float mul) {
    const float gi = g * mul + wd * p;
    m = fresh ? gi : momentum * m + gi;
    p -= lr_s * m;
}

template <class H, bool HALF>
__device__ __forceinline__ void sgd_impl(float* __restrict__ p, const float* __restrict__ g,
                                         float* __restrict__ m, H* __restrict__ p_half,
                                         long long n, const long long* __restrict__ seg_end,
                                         const float* __restrict__ seg_wd,
                                         const float* __restrict__ seg_lr_scale, int nseg,
                                         float lr, float momentum, int first_step,
                                         const float* grad_mul) {
    const long long t = global_thread(), stride = grid_threads();
    const float mul = load_mul(grad_mul);
    const bool fresh = first_step || momentum == 0.0f;
    SegmentCursor seg(seg_end, seg_wd, seg_lr_scale, nseg, lr, 1.0f);
    const bool vec = is_aligned(p, 16) && is_aligned(g, 16) && is_aligned(m, 16) &&
                     (!HALF || is_aligned(p_half, 8));
    const long long chunks = vec ? n / 4 : 0;
    for (long long c = t; c < chunks; c += stride) {
        const long long i = 4 * c;
        const float4 pv = reinterpret_cast<float4*>(p)[c];
        const float4 gv = reinterpret_cast<const float4*>(g)[c];
        const float4 mv = reinterpret_cast<float4*>(m)[c];
        float pp[4] = {pv.x, pv.y, pv.z, pv.w}, mm[4] = {mv.x, mv.y, mv.z, mv.w};
        const float gg[4] = {gv.x, gv.y, gv.z, gv.w};
        seg.seek(i);
        if (i + 3 < seg.end) {
#pragma unroll
            for (int k = 0; k < 4; ++k)
                sgd_one(pp[k], gg[k], mm[k], seg.lr_s, seg.wd, momentum, fresh, mul);
        } else {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                seg.seek(i + k);
                sgd_one(pp[k], gg[k], mm[k], seg.lr_s, seg.wd, momentum, fresh, mul);
            }
        }
        reinterpret_cast<float4*>(p)[c] = make_float4(pp[0], pp[1], pp[2], pp[3]);
        reinterpret_cast<float4*>(m)[c] = make_float4(mm[0], mm[1], mm[2], mm[3]);
        if constexpr (HALF) store4(p_half + i, pp);
    }
    for (long long i = chunks * 4 + t; i < n; i += stride) {
        seg.seek(i);
        float pi = p[i], mi = m[i];
        sgd_one(pi, g[i], mi, seg.lr_s, seg.wd, momentum, fresh, mul);
        p[i] = pi;
        m[i] = mi;
        if constexpr (HALF) p_half[i] = from_f32<H>(pi);
    }
}

#define MT_SGD_ARGS                                                                          \
    float *p, const float *g, float *m, HALF_T *p_half, long long n, const long long *seg_end, \
        const float *seg_wd, const float *seg_lr_scale, int nseg, const float *schedule,     \
        float momentum, const float *grad_mul
#define MT_SGD_CALL(H, HALF)                                                                 \
    sgd_impl<H, HALF>(p, g, m, p_half, n, seg_end, seg_wd, seg_lr_scale, nseg, schedule[0],  \
                      momentum, schedule[1] != 0.0f, grad_mul)

#define HALF_T float
extern "C" __global__ void __launch_bounds__(256) sgd_none(MT_SGD_ARGS) {
    MT_SGD_CALL(float, false);
}
#undef HALF_T
#define HALF_T bf16
extern "C" __global__ void __launch_bounds__(256) sgd_bf16(MT_SGD_ARGS) {
    MT_SGD_CALL(bf16, true);
}
#undef HALF_T
#define HALF_T f16
extern "C" __global__ void __launch_bounds__(256) sgd_f16(MT_SGD_ARGS) {
    MT_SGD_CALL(f16, true);
}
#undef HALF_T

// ---------------------------------------------------------------------------------------
// Global gradient norm: Σ g² per block in double, then the blocks' sums in order.

/// Block 256, grid-stride. `g` may be a view at any float offset: a scalar head of < 4
/// elements (first threads of the grid) reaches 16-byte alignment, then float4 chunks, then
/// a scalar tail. Each thread adds its squares in its visiting order; the block sum is the
/// fixed-order block_sum_d. partial[blockIdx.x] is written by every block, even an idle one.
extern "C" __global__ void __launch_bounds__(256)
sumsq_partial(const float* __restrict__ g, long long n, double* __restrict__ partial) {
    const long long t = global_thread(), stride = grid_threads();
    const long long h = align16_head(g, n);
    const long long chunks = (n - h) / 4;
    double s = 0.0;
    if (t < h) s += (double)g[t] * (double)g[t];
    const float4* g4 = reinterpret_cast<const float4*>(g + h);
    for (long long i = t; i < chunks; i += stride) {
        const float4 v = g4[i];
        s += (double)v.x * (double)v.x;
        s += (double)v.y * (double)v.y;
        s += (double)v.z * (double)v.z;
        s += (double)v.w * (double)v.w;
    }
    for (long long i = h + chunks * 4 + t; i < n; i += stride) s += (double)g[i] * (double)g[i];
    s = block_sum_d(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

/// One block of 256: total = Σ partial (thread t takes t, t+256, … in order, then the
/// fixed-order block sum); out[0] = the norm, out[1] = the clipping factor (1 if none):
/// the CPU's clip_grad_norm (f64 sum, its sqrt rounded to f32, the factor in f32).
extern "C" __global__ void __launch_bounds__(256)
norm_finish(const double* __restrict__ partial, int nblocks, float max_norm,
            float* __restrict__ out, double* __restrict__ total_out) {
    double s = 0.0;
    for (int b = threadIdx.x; b < nblocks; b += blockDim.x) s += partial[b];
    const double total = block_sum_d(s);
    if (threadIdx.x == 0) {
        const float norm = (float)sqrt(total);
        out[0] = norm;
        // The sum of squares itself, for a norm summed over several workers in f64.
        if (total_out) *total_out = total;
        out[1] = (max_norm > 0.0f && norm > max_norm && norm > 0.0f) ? max_norm / (norm + 1e-6f)
                                                                     : 1.0f;
    }
}
