// llama.cu: the Llama layers' kernels: RMS norm, rotary positions with grouped-query heads,
// SwiGLU. See ABI.md; the formulas and their order are the CPU's (crates/tensor/src/norm.rs
// `rms_norm_*`, rotary.rs, activation.rs `swiglu_*`).
//
// RMS norm follows layernorm.cu: forward and input gradient one warp per row (block 256 = 8
// rows, grid ceil(rows/8), rows grid-strided so any grid works), each lane keeping its float4
// chunks (j = lane, lane+32, …) in registers when d is a multiple of 4, at most 1024, and the
// buffers are aligned; otherwise a scalar path re-reads the row. Row sums: each lane adds its
// elements in order, then the warp butterfly. The weight gradient: one thread per column of a
// rows_per_block block of rows (rows in increasing order), then colsum_finish (bias.cu) as
// stage 2, launched by the Rust side. The forward may take the residual add before it
// (rmsnorm_fwd_add_*: common.cuh's norm_row_in).
//
// Rotary and SwiGLU are element-wise passes over grid-stride units: W values of a row per
// unit (W = 16 bytes / sizeof(T): 4 floats or 8 16-bit values, one 16-byte access) when the
// unit's width divides the row's halves and the buffers are 16-byte aligned, else one value.
// All arithmetic is fp32; 16-bit inputs are widened, outputs rounded once.

#define RMS_MAX_CHUNKS 8

// ---------------------------------------------------------------------------------------
// RMS norm forward: rstd = 1/sqrtf(Σx²/d + eps), y = x·rstd·w.

// With `h` (rmsnorm_fwd_add_*), the row normalised is x + h, stored at `sum` (common.cuh's
// norm_row_in); without (h = sum = null), x's.
template <class T>
__device__ __forceinline__ void rmsnorm_fwd_impl(const float* __restrict__ x,
                                                 const T* __restrict__ h,
                                                 float* __restrict__ sum,
                                                 const float* __restrict__ w,
                                                 T* __restrict__ y, float* __restrict__ rstd_out,
                                                 int rows, int d, float eps) {
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const float d_f = (float)d;  // divided by (not multiplied by 1/d), as the CPU
    const bool vec = (d & 3) == 0 && d <= 128 * RMS_MAX_CHUNKS && is_aligned(x, 16) &&
                     is_aligned(w, 16) && is_aligned(y, 4 * sizeof(T)) &&
                     is_aligned(h, 4 * sizeof(T)) && is_aligned(sum, 16);
    for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < rows;
         row += gridDim.x * warps) {
        const long long at = (long long)row * d;
        T* yr = y + at;
        float rs;
        if (vec) {
            const int d4 = d >> 2;
            float4 v[RMS_MAX_CHUNKS];
            norm_row_in<T, RMS_MAX_CHUNKS>(x + at, row_or_null(h, at), row_or_null(sum, at), v,
                                           d4, lane);
            float q = 0.0f;
#pragma unroll
            for (int k = 0; k < RMS_MAX_CHUNKS; ++k) {
                if (lane + 32 * k < d4) {
                    q += v[k].x * v[k].x; q += v[k].y * v[k].y;
                    q += v[k].z * v[k].z; q += v[k].w * v[k].w;
                }
            }
            rs = 1.0f / sqrtf(warp_sum(q) / d_f + eps);
#pragma unroll
            for (int k = 0; k < RMS_MAX_CHUNKS; ++k) {
                const int j = lane + 32 * k;
                if (j < d4) {
                    const float4 g = reinterpret_cast<const float4*>(w)[j];
                    float o[4];
                    o[0] = v[k].x * rs * g.x;
                    o[1] = v[k].y * rs * g.y;
                    o[2] = v[k].z * rs * g.z;
                    o[3] = v[k].w * rs * g.w;
                    store4(yr + 4 * j, o);
                }
            }
        } else {
            const float* xr =
                norm_row_in_scalar(x + at, row_or_null(h, at), row_or_null(sum, at), d, lane);
            float q = 0.0f;
            for (int c = lane; c < d; c += 32) q += xr[c] * xr[c];
            rs = 1.0f / sqrtf(warp_sum(q) / d_f + eps);
            for (int c = lane; c < d; c += 32) yr[c] = from_f32<T>(xr[c] * rs * w[c]);
        }
        if (lane == 0 && rstd_out) rstd_out[row] = rs;
    }
}

extern "C" __global__ void __launch_bounds__(256)
rmsnorm_fwd_f32(const float* x, const float* w, float* y, float* rstd, int rows, int d,
                float eps) {
    rmsnorm_fwd_impl<float>(x, nullptr, nullptr, w, y, rstd, rows, d, eps);
}
extern "C" __global__ void __launch_bounds__(256)
rmsnorm_fwd_bf16(const float* x, const float* w, bf16* y, float* rstd, int rows, int d,
                 float eps) {
    rmsnorm_fwd_impl<bf16>(x, nullptr, nullptr, w, y, rstd, rows, d, eps);
}
extern "C" __global__ void __launch_bounds__(256)
rmsnorm_fwd_f16(const float* x, const float* w, f16* y, float* rstd, int rows, int d,
                float eps) {
    rmsnorm_fwd_impl<f16>(x, nullptr, nullptr, w, y, rstd, rows, d, eps);
}

// The residual add before the norm, fused (as layernorm.cu's layernorm_fwd_add_*): sum = x + h
// (f32), then the norm of sum; h in the norm's output dtype.
extern "C" __global__ void __launch_bounds__(256)
rmsnorm_fwd_add_f32(const float* x, const float* h, float* sum, const float* w, float* y,
                    float* rstd, int rows, int d, float eps) {
    rmsnorm_fwd_impl<float>(x, h, sum, w, y, rstd, rows, d, eps);
}
extern "C" __global__ void __launch_bounds__(256)
rmsnorm_fwd_add_bf16(const float* x, const bf16* h, float* sum, const float* w, bf16* y,
                     float* rstd, int rows, int d, float eps) {
    rmsnorm_fwd_impl<bf16>(x, h, sum, w, y, rstd, rows, d, eps);
}
extern "C" __global__ void __launch_bounds__(256)
rmsnorm_fwd_add_f16(const float* x, const f16* h, float* sum, const float* w, f16* y,
                    float* rstd, int rows, int d, float eps) {
    rmsnorm_fwd_impl<f16>(x, h, sum, w, y, rstd, rows, d, eps);
}

// ---------------------------------------------------------------------------------------
// Input gradient: h = x·rstd, g = dy·w, dx = rstd·(g − h·Σ(g·h)/d).

template <class T>
__device__ __forceinline__ void rmsnorm_bwd_dx_impl(const float* __restrict__ x,
                                                    const float* __restrict__ w,
                                                    const float* __restrict__ rstd,
                                                    const T* __restrict__ dy,
                                                    float* __restrict__ dx,
                                                    T* __restrict__ dx_low, int rows, int d,
                                                    int accumulate) {
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const float d_f = (float)d;
    // norm_bwd_row's conditions (common.cuh).
    const bool vec = (d & 3) == 0 && d <= 128 * NORM_MAX_CHUNKS && is_aligned(x, 16) &&
                     is_aligned(w, 16) && is_aligned(dx, 16) && is_aligned(dy, 4 * sizeof(T)) &&
                     is_aligned(dx_low, 4 * sizeof(T));
    for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < rows;
         row += gridDim.x * warps) {
        const float* xr = x + (long long)row * d;
        const T* dyr = dy + (long long)row * d;
        float* dxr = dx + (long long)row * d;
        T* lowr = row_or_null(dx_low, (long long)row * d);
        const float rs = rstd[row];
        if (vec) {
            norm_bwd_row<T, false>(xr, dyr, dxr, lowr, w, 0.0f, rs, d, lane, accumulate,
                                   nullptr);
        } else {
            float sgh = 0.0f;
            for (int c = lane; c < d; c += 32) {
                const float g = to_f32(dyr[c]) * w[c];
                sgh += g * xr[c] * rs;
            }
            const float mgh = warp_sum(sgh) / d_f;
            for (int c = lane; c < d; c += 32) {
                const float g = to_f32(dyr[c]) * w[c];
                const float v = rs * (g - xr[c] * rs * mgh);
                const float out = accumulate ? dxr[c] + v : v;
                dxr[c] = out;
                if (lowr) lowr[c] = from_f32<T>(out);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
rmsnorm_bwd_dx_f32(const float* x, const float* w, const float* rstd, const float* dy,
                   float* dx, float* dx_low, int rows, int d, int accumulate) {
    rmsnorm_bwd_dx_impl(x, w, rstd, dy, dx, dx_low, rows, d, accumulate);
}
extern "C" __global__ void __launch_bounds__(256)
rmsnorm_bwd_dx_bf16(const float* x, const float* w, const float* rstd, const bf16* dy,
                    float* dx, bf16* dx_low, int rows, int d, int accumulate) {
    rmsnorm_bwd_dx_impl(x, w, rstd, dy, dx, dx_low, rows, d, accumulate);
}
extern "C" __global__ void __launch_bounds__(256)
rmsnorm_bwd_dx_f16(const float* x, const float* w, const float* rstd, const f16* dy,
                   float* dx, f16* dx_low, int rows, int d, int accumulate) {
    rmsnorm_bwd_dx_impl(x, w, rstd, dy, dx, dx_low, rows, d, accumulate);
}

// ---------------------------------------------------------------------------------------
// Fused backward: the input gradient and the weight gradient's stage 1 in one pass over x and
// dy (common.cuh's norm_bwd_fused_impl, as layernorm_bwd_fused_*; `partial` [gridDim.x][d],
// 32·d bytes of dynamic shared memory), where the vector path applies.

extern "C" __global__ void __launch_bounds__(256)
rmsnorm_bwd_fused_f32(const float* x, const float* w, const float* rstd, const float* dy,
                      float* dx, float* dx_low, float* partial, int rows, int d, int accumulate) {
    norm_bwd_fused_impl<float, false>(x, w, nullptr, rstd, dy, dx, dx_low, partial, rows, d,
                                      accumulate);
}
extern "C" __global__ void __launch_bounds__(256)
rmsnorm_bwd_fused_bf16(const float* x, const float* w, const float* rstd, const bf16* dy,
                       float* dx, bf16* dx_low, float* partial, int rows, int d, int accumulate) {
    norm_bwd_fused_impl<bf16, false>(x, w, nullptr, rstd, dy, dx, dx_low, partial, rows, d,
                                      accumulate);
}
extern "C" __global__ void __launch_bounds__(256)
rmsnorm_bwd_fused_f16(const float* x, const float* w, const float* rstd, const f16* dy,
                      float* dx, f16* dx_low, float* partial, int rows, int d, int accumulate) {
    norm_bwd_fused_impl<f16, false>(x, w, nullptr, rstd, dy, dx, dx_low, partial, rows, d,
                                      accumulate);
}

// ---------------------------------------------------------------------------------------
// Weight gradient, stage 1: per block of rows and per column c, Σ dy·x·rstd in fp32, rows in
// increasing order, 8 rows loaded ahead (as layernorm_bwd_params).

#define RMS_PARAM_BATCH 8

template <class T>
__device__ __forceinline__ void rmsnorm_bwd_params_impl(const float* __restrict__ x,
                                                        const float* __restrict__ rstd,
                                                        const T* __restrict__ dy,
                                                        float* __restrict__ partial, int rows,
                                                        int d, int rows_per_block) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= d) return;
    const int r0 = blockIdx.y * rows_per_block;
    const int r1 = min(r0 + rows_per_block, rows);
    float s = 0.0f;
    int r = r0;
    for (; r + RMS_PARAM_BATCH <= r1; r += RMS_PARAM_BATCH) {
        float xv[RMS_PARAM_BATCH], gv[RMS_PARAM_BATCH], rv[RMS_PARAM_BATCH];
#pragma unroll
        for (int k = 0; k < RMS_PARAM_BATCH; ++k) {
            const long long i = (long long)(r + k) * d + c;
            xv[k] = x[i];
            gv[k] = to_f32(dy[i]);
            rv[k] = rstd[r + k];
        }
#pragma unroll
        for (int k = 0; k < RMS_PARAM_BATCH; ++k) s += gv[k] * xv[k] * rv[k];
    }
    for (; r < r1; ++r) {
        const long long i = (long long)r * d + c;
        s += to_f32(dy[i]) * x[i] * rstd[r];
    }
    partial[(long long)blockIdx.y * d + c] = s;
}

extern "C" __global__ void __launch_bounds__(256, 2)
rmsnorm_bwd_params_f32(const float* x, const float* rstd, const float* dy, float* partial,
                       int rows, int d, int rows_per_block) {
    rmsnorm_bwd_params_impl(x, rstd, dy, partial, rows, d, rows_per_block);
}
extern "C" __global__ void __launch_bounds__(256, 2)
rmsnorm_bwd_params_bf16(const float* x, const float* rstd, const bf16* dy, float* partial,
                        int rows, int d, int rows_per_block) {
    rmsnorm_bwd_params_impl(x, rstd, dy, partial, rows, d, rows_per_block);
}
extern "C" __global__ void __launch_bounds__(256, 2)
rmsnorm_bwd_params_f16(const float* x, const float* rstd, const f16* dy, float* partial,
                       int rows, int d, int rows_per_block) {
    rmsnorm_bwd_params_impl(x, rstd, dy, partial, rows, d, rows_per_block);
}

// ---------------------------------------------------------------------------------------
// Rotary positions + grouped-query heads (crates/tensor/src/rotary.rs). Input rows
// [(H + 2·Hkv)·hd] in the grouped layout (group j: its g = H/Hkv query heads, key head j,
// value head j), output rows [3·H·hd] = [Q | K | V]. Row r is token t = r % seq; cos/sin are
// [seq, hd/2] f32 tables (the host's rotary_tables). Rotate half: element i pairs with
// i + hd/2. A unit is W pairs (i .. i+W−1 with their partners i+hd/2 ..) of one head of one
// row; consecutive units run along a head, so a warp reads and writes two contiguous runs.

/// The W-pair rotation of `a` (first halves) and `b` (second halves) by angle tables c, s:
/// forward o0 = a·c − b·s, o1 = b·c + a·s; backward (Rᵀ) o0 = a·c + b·s, o1 = b·c − a·s.
template <int W, bool BACK>
__device__ __forceinline__ void rotate_w(float (&a)[W], float (&b)[W], const float (&c)[W],
                                         const float (&s)[W]) {
#pragma unroll
    for (int e = 0; e < W; ++e) {
        const float o0 = BACK ? a[e] * c[e] + b[e] * s[e] : a[e] * c[e] - b[e] * s[e];
        const float o1 = BACK ? b[e] * c[e] - a[e] * s[e] : b[e] * c[e] + a[e] * s[e];
        a[e] = o0;
        b[e] = o1;
    }
}

template <int W, class T>
__device__ __forceinline__ void load_pairs(const T* p, int half, float (&a)[W], float (&b)[W]) {
    if constexpr (W == 1) {
        a[0] = to_f32(p[0]);
        b[0] = to_f32(p[half]);
    } else {
        load_w<W>(p, a);
        load_w<W>(p + half, b);
    }
}

template <int W, class T>
__device__ __forceinline__ void store_pairs(T* p, int half, const float (&a)[W],
                                            const float (&b)[W]) {
    if constexpr (W == 1) {
        p[0] = from_f32<T>(a[0]);
        p[half] = from_f32<T>(b[0]);
    } else {
        store_w<W>(p, a);
        store_w<W>(p + half, b);
    }
}

template <int W>
__device__ __forceinline__ void load_angles(const float* cos_t, const float* sin_t, long long at,
                                            float (&c)[W], float (&s)[W]) {
    if constexpr (W == 1) {
        c[0] = cos_t[at];
        s[0] = sin_t[at];
    } else {
        load_w<W>(cos_t + at, c);
        load_w<W>(sin_t + at, s);
    }
}

template <int W, class T>
__device__ __forceinline__ void rotary_fwd_loop(const T* __restrict__ x,
                                                const float* __restrict__ cos_t,
                                                const float* __restrict__ sin_t,
                                                T* __restrict__ y, int rows, int seq, int heads,
                                                int kv_heads, int hd) {
    const int half = hd >> 1, g = heads / kv_heads;
    const long long win = (long long)(heads + 2 * kv_heads) * hd, wout = 3LL * heads * hd;
    const int per_head = half / W;
    const long long per_row = 3LL * heads * per_head;
    const long long n = (long long)rows * per_row;
    for (long long u = global_thread(); u < n; u += grid_threads()) {
        const long long r = u / per_row;
        const int rem = (int)(u - r * per_row);
        const int slot = rem / per_head;  // output head: part·H + head
        const int i = (rem - slot * per_head) * W;
        const int part = slot / heads, head = slot - part * heads;
        const int j = head / g;
        // Query head m of group j, else the group's key (g) or value (g + 1) head.
        const int src = j * (g + 2) + (part == 0 ? head - j * g : g + part - 1);
        float a[W], b[W];
        load_pairs<W>(x + r * win + (long long)src * hd + i, half, a, b);
        if (part < 2) {
            float c[W], s[W];
            load_angles<W>(cos_t, sin_t, (r % seq) * half + i, c, s);
            rotate_w<W, false>(a, b, c, s);
        }
        store_pairs<W>(y + r * wout + (long long)slot * hd + i, half, a, b);
    }
}

/// dx from dy: query heads rotated back; key (value) head j's gradient is the sum of the
/// K (V) gradients of its group's query heads, m = 0, 1, … in order (the CPU's order), the
/// key sum then rotated back.
template <int W, class T>
__device__ __forceinline__ void rotary_bwd_loop(const T* __restrict__ dy,
                                                const float* __restrict__ cos_t,
                                                const float* __restrict__ sin_t,
                                                T* __restrict__ dx, int rows, int seq, int heads,
                                                int kv_heads, int hd) {
    const int half = hd >> 1, g = heads / kv_heads;
    const long long win = (long long)(heads + 2 * kv_heads) * hd, wout = 3LL * heads * hd;
    const int per_head = half / W;
    const long long per_row = (long long)(heads + 2 * kv_heads) * per_head;
    const long long n = (long long)rows * per_row;
    for (long long u = global_thread(); u < n; u += grid_threads()) {
        const long long r = u / per_row;
        const int rem = (int)(u - r * per_row);
        const int slot = rem / per_head;  // input head in the grouped layout
        const int i = (rem - slot * per_head) * W;
        const int j = slot / (g + 2), m = slot - j * (g + 2);
        const T* dyr = dy + r * wout + i;
        float a[W], b[W];
        bool rotate = true;
        if (m < g) {
            load_pairs<W>(dyr + (long long)(j * g + m) * hd, half, a, b);
        } else {
            // Part 1 (K) or 2 (V): the group's g copies, summed in order.
            const T* first = dyr + ((long long)(m - g + 1) * heads + (long long)j * g) * hd;
            load_pairs<W>(first, half, a, b);
            for (int k = 1; k < g; ++k) {
                float a2[W], b2[W];
                load_pairs<W>(first + (long long)k * hd, half, a2, b2);
#pragma unroll
                for (int e = 0; e < W; ++e) {
                    a[e] += a2[e];
                    b[e] += b2[e];
                }
            }
            rotate = m == g;
        }
        if (rotate) {
            float c[W], s[W];
            load_angles<W>(cos_t, sin_t, (r % seq) * half + i, c, s);
            rotate_w<W, true>(a, b, c, s);
        }
        store_pairs<W>(dx + r * win + (long long)slot * hd + i, half, a, b);
    }
}

/// The W-wide loop when hd/2 is a multiple of W and every buffer is 16-byte aligned (row and
/// head starts then are too), else one pair per unit.
template <class T>
__device__ __forceinline__ bool rotary_vec(const T* a, const T* b, const float* c,
                                           const float* s, int hd) {
    constexpr int W = 16 / sizeof(T);
    return ((hd >> 1) % W) == 0 && is_aligned(a, 16) && is_aligned(b, 16) &&
           is_aligned(c, 16) && is_aligned(s, 16);
}

template <class T>
__device__ __forceinline__ void rotary_fwd_impl(const T* x, const float* cos_t,
                                                const float* sin_t, T* y, int rows, int seq,
                                                int heads, int kv_heads, int hd) {
    if (rotary_vec(x, y, cos_t, sin_t, hd)) {
        rotary_fwd_loop<16 / sizeof(T)>(x, cos_t, sin_t, y, rows, seq, heads, kv_heads, hd);
    } else {
        rotary_fwd_loop<1>(x, cos_t, sin_t, y, rows, seq, heads, kv_heads, hd);
    }
}

template <class T>
__device__ __forceinline__ void rotary_bwd_impl(const T* dy, const float* cos_t,
                                                const float* sin_t, T* dx, int rows, int seq,
                                                int heads, int kv_heads, int hd) {
    if (rotary_vec(dy, dx, cos_t, sin_t, hd)) {
        rotary_bwd_loop<16 / sizeof(T)>(dy, cos_t, sin_t, dx, rows, seq, heads, kv_heads, hd);
    } else {
        rotary_bwd_loop<1>(dy, cos_t, sin_t, dx, rows, seq, heads, kv_heads, hd);
    }
}

extern "C" __global__ void __launch_bounds__(256)
rotary_fwd_f32(const float* x, const float* cos_t, const float* sin_t, float* y, int rows,
               int seq, int heads, int kv_heads, int hd) {
    rotary_fwd_impl(x, cos_t, sin_t, y, rows, seq, heads, kv_heads, hd);
}
extern "C" __global__ void __launch_bounds__(256)
rotary_fwd_bf16(const bf16* x, const float* cos_t, const float* sin_t, bf16* y, int rows,
                int seq, int heads, int kv_heads, int hd) {
    rotary_fwd_impl(x, cos_t, sin_t, y, rows, seq, heads, kv_heads, hd);
}
extern "C" __global__ void __launch_bounds__(256)
rotary_fwd_f16(const f16* x, const float* cos_t, const float* sin_t, f16* y, int rows,
               int seq, int heads, int kv_heads, int hd) {
    rotary_fwd_impl(x, cos_t, sin_t, y, rows, seq, heads, kv_heads, hd);
}

extern "C" __global__ void __launch_bounds__(256)
rotary_bwd_f32(const float* dy, const float* cos_t, const float* sin_t, float* dx, int rows,
               int seq, int heads, int kv_heads, int hd) {
    rotary_bwd_impl(dy, cos_t, sin_t, dx, rows, seq, heads, kv_heads, hd);
}
extern "C" __global__ void __launch_bounds__(256)
rotary_bwd_bf16(const bf16* dy, const float* cos_t, const float* sin_t, bf16* dx, int rows,
                int seq, int heads, int kv_heads, int hd) {
    rotary_bwd_impl(dy, cos_t, sin_t, dx, rows, seq, heads, kv_heads, hd);
}
extern "C" __global__ void __launch_bounds__(256)
rotary_bwd_f16(const f16* dy, const float* cos_t, const float* sin_t, f16* dx, int rows,
               int seq, int heads, int kv_heads, int hd) {
    rotary_bwd_impl(dy, cos_t, sin_t, dx, rows, seq, heads, kv_heads, hd);
}

// ---------------------------------------------------------------------------------------
// SwiGLU: rows [a | b] of 2·half values → y = silu(a)·b = a·σ(a)·b (half values);
// backward da = dy·b·σ(a)·(1 + a·(1 − σ(a))), db = dy·a·σ(a), σ(a) = 1/(1 + expf(−a)).

template <int W, class T>
__device__ __forceinline__ void swiglu_fwd_loop(const T* __restrict__ x, T* __restrict__ y,
                                                int rows, int half) {
    const int per_row = half / W;
    const long long n = (long long)rows * per_row;
    for (long long u = global_thread(); u < n; u += grid_threads()) {
        const long long r = u / per_row;
        const int i = (int)(u - r * per_row) * W;
        float a[W], b[W];
        load_pairs<W>(x + r * 2 * half + i, half, a, b);
#pragma unroll
        for (int e = 0; e < W; ++e) {
            const float s = 1.0f / (1.0f + expf(-a[e]));
            a[e] = a[e] * s * b[e];
        }
        T* yr = y + r * half + i;
        if constexpr (W == 1) {
            yr[0] = from_f32<T>(a[0]);
        } else {
            store_w<W>(yr, a);
        }
    }
}

template <int W, class T>
__device__ __forceinline__ void swiglu_bwd_loop(const T* __restrict__ x,
                                                const T* __restrict__ dy, T* __restrict__ dx,
                                                int rows, int half) {
    const int per_row = half / W;
    const long long n = (long long)rows * per_row;
    for (long long u = global_thread(); u < n; u += grid_threads()) {
        const long long r = u / per_row;
        const int i = (int)(u - r * per_row) * W;
        float a[W], b[W], g[W];
        load_pairs<W>(x + r * 2 * half + i, half, a, b);
        const T* gr = dy + r * half + i;
        if constexpr (W == 1) {
            g[0] = to_f32(gr[0]);
        } else {
            load_w<W>(gr, g);
        }
#pragma unroll
        for (int e = 0; e < W; ++e) {
            const float s = 1.0f / (1.0f + expf(-a[e]));
            const float da = g[e] * b[e] * s * (1.0f + a[e] * (1.0f - s));
            const float db = g[e] * a[e] * s;
            a[e] = da;
            b[e] = db;
        }
        store_pairs<W>(dx + r * 2 * half + i, half, a, b);
    }
}

template <class T>
__device__ __forceinline__ void swiglu_fwd_impl(const T* x, T* y, int rows, int half) {
    constexpr int W = 16 / sizeof(T);
    if (half % W == 0 && is_aligned(x, 16) && is_aligned(y, 16)) {
        swiglu_fwd_loop<W>(x, y, rows, half);
    } else {
        swiglu_fwd_loop<1>(x, y, rows, half);
    }
}

template <class T>
__device__ __forceinline__ void swiglu_bwd_impl(const T* x, const T* dy, T* dx, int rows,
                                                int half) {
    constexpr int W = 16 / sizeof(T);
    if (half % W == 0 && is_aligned(x, 16) && is_aligned(dy, 16) && is_aligned(dx, 16)) {
        swiglu_bwd_loop<W>(x, dy, dx, rows, half);
    } else {
        swiglu_bwd_loop<1>(x, dy, dx, rows, half);
    }
}

extern "C" __global__ void __launch_bounds__(256)
swiglu_fwd_f32(const float* x, float* y, int rows, int half) {
    swiglu_fwd_impl(x, y, rows, half);
}
extern "C" __global__ void __launch_bounds__(256)
swiglu_fwd_bf16(const bf16* x, bf16* y, int rows, int half) {
    swiglu_fwd_impl(x, y, rows, half);
}
extern "C" __global__ void __launch_bounds__(256)
swiglu_fwd_f16(const f16* x, f16* y, int rows, int half) {
    swiglu_fwd_impl(x, y, rows, half);
}

extern "C" __global__ void __launch_bounds__(256)
swiglu_bwd_f32(const float* x, const float* dy, float* dx, int rows, int half) {
    swiglu_bwd_impl(x, dy, dx, rows, half);
}
extern "C" __global__ void __launch_bounds__(256)
swiglu_bwd_bf16(const bf16* x, const bf16* dy, bf16* dx, int rows, int half) {
    swiglu_bwd_impl(x, dy, dx, rows, half);
}
extern "C" __global__ void __launch_bounds__(256)
swiglu_bwd_f16(const f16* x, const f16* dy, f16* dx, int rows, int half) {
    swiglu_bwd_impl(x, dy, dx, rows, half);
}

// ---------------------------------------------------------------------------------------
// Qwen3's per-head q/k norms run the RMS norm kernels above on the query and key heads of
// grouped q/k/v rows (`rotary.rs`: per key/value group j, its g = heads/kv_heads query heads,
// then key head j, then value head j, hd values each), moved to and from contiguous
// [rows·heads, hd] and [rows·kv_heads, hd] buffers (crates/tensor/src/rotary.rs gather_qk /
// scatter_qk). One thread per moved value, grid-stride; value heads are not touched.
// scatter = 0: grouped → q, k; scatter = 1: q, k → grouped.

extern "C" __global__ void __launch_bounds__(256)
qk_heads_f32(float* __restrict__ grouped, float* __restrict__ q, float* __restrict__ k,
             int rows, int heads, int kv_heads, int hd, int scatter) {
    const int g = heads / kv_heads;
    const long long width = (long long)(heads + 2 * kv_heads) * hd;
    const long long nq = (long long)rows * heads * hd;
    const long long n = nq + (long long)rows * kv_heads * hd;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long at;
        float* packed;
        if (i < nq) {
            const long long r = i / ((long long)heads * hd);
            const int rem = (int)(i - r * heads * hd);
            const int h = rem / hd, c = rem - h * hd;
            at = r * width + (long long)(h / g) * (g + 2) * hd + (h % g) * hd + c;
            packed = q + i;
        } else {
            const long long j = i - nq;
            const long long r = j / ((long long)kv_heads * hd);
            const int rem = (int)(j - r * kv_heads * hd);
            const int h = rem / hd, c = rem - h * hd;
            at = r * width + (long long)h * (g + 2) * hd + (long long)g * hd + c;
            packed = k + j;
        }
        if (scatter) {
            grouped[at] = *packed;
        } else {
            *packed = grouped[at];
        }
    }
}
