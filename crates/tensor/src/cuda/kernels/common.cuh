// common.cuh: device helpers shared by the kernel files (see ABI.md). Prepended after the
// prelude on the GPU (NVRTC) and after cuda_emu.h on the CPU, so it includes nothing itself.
//
// - scalar conversions `to_f32` / `from_f32<T>` for float, bf16 and f16;
// - 4- and 8-element vector loads/stores that convert to/from float registers (16-byte
//   accesses for 8 16-bit values or 4 floats; 8-byte accesses for 4 16-bit values);
// - warp reductions (xor butterfly: every lane ends with the same bits, since IEEE addition
//   and fmaxf are commutative, so the result does not depend on the lane that reads it);
// - block reductions in a fixed order (warp butterflies, then warp 0 combines the warp totals
//   in the same butterfly order): the result depends only on the values and blockDim.

// NVRTC's headers (the prelude's cuda_bf16.h/cuda_fp16.h/mma.h) do not define INFINITY, which
// ABI.md promises; the emulator's libm does.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// memcpy is an NVRTC built-in; g++ always knows __builtin_memcpy (whatever the emulator
// header includes).
#if defined(__CUDACC_RTC__)
#define MT_MEMCPY memcpy
#else
#define MT_MEMCPY __builtin_memcpy
#endif

// ---------------------------------------------------------------------------------------
// Scalar conversions.

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(f16 x) { return __half2float(x); }

template <class T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
/// Round to nearest even.
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) { return __float2bfloat16(x); }
/// Round to nearest even.
template <> __device__ __forceinline__ f16 from_f32<f16>(float x) { return __float2half(x); }

// ---------------------------------------------------------------------------------------
// Alignment and bit copies.

/// Whether `p` is a multiple of `bytes` (a power of two).
__device__ __forceinline__ bool is_aligned(const void* p, unsigned bytes) {
    return (reinterpret_cast<unsigned long long>(p) & (unsigned long long)(bytes - 1)) == 0;
}

/// Row `at` of an optional buffer: `p + at`, or null for a null `p` (an output a kernel
/// writes only when asked for it).
template <class P>
__device__ __forceinline__ P* row_or_null(P* p, long long at) {
    return p ? p + at : nullptr;
}

/// Floats before `p + h` is 16-byte aligned (p itself 4-byte aligned), at most n: the scalar
/// head of a float4 loop over a view that may start anywhere.
__device__ __forceinline__ long long align16_head(const float* p, long long n) {
    const unsigned mis = (unsigned)(reinterpret_cast<unsigned long long>(p) & 15u);
    const long long h = (long long)(((16u - mis) & 15u) / 4u);
    return h < n ? h : n;
}

/// The bits of `from` as a `To` of the same size. Through memcpy, the one type pun that is
/// defined in C++ (g++ -O2 would be entitled to break a pointer cast between unrelated
/// types); both compilers turn it into a register move.
template <class To, class From>
__device__ __forceinline__ To bit_copy(const From& from) {
    static_assert(sizeof(To) == sizeof(From), "bit_copy between types of different sizes");
    To to;
    MT_MEMCPY(&to, &from, sizeof(To));
    return to;
}

/// Two 16-bit values packed in a 32-bit word (low half first, as in memory) <-> floats.
template <class H> __device__ __forceinline__ float2 unpack2(unsigned w);
template <> __device__ __forceinline__ float2 unpack2<bf16>(unsigned w) {
    return __bfloat1622float2(bit_copy<__nv_bfloat162>(w));
}
template <> __device__ __forceinline__ float2 unpack2<f16>(unsigned w) {
    return __half22float2(bit_copy<__half2>(w));
}
template <class H> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<bf16>(float lo, float hi) {
    return bit_copy<unsigned>(__floats2bfloat162_rn(lo, hi));
}
template <> __device__ __forceinline__ unsigned pack2<f16>(float lo, float hi) {
    return bit_copy<unsigned>(__floats2half2_rn(lo, hi));
}

// ---------------------------------------------------------------------------------------
// Vector loads and stores. `p` must be aligned to the access: 4·sizeof(T) bytes for the
// 4-element forms (one float4, or one uint2 of 16-bit values), 16 bytes for the 8-element
// forms (two float4, or one uint4 of 16-bit values).

template <class T>
__device__ __forceinline__ void load4(const T* p, float (&v)[4]) {
    if constexpr (sizeof(T) == 4) {
        const float4 q = *reinterpret_cast<const float4*>(p);
        v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
    } else {
        const uint2 q = *reinterpret_cast<const uint2*>(p);
        const float2 a = unpack2<T>(q.x), b = unpack2<T>(q.y);
        v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
    }
}

template <class T>
__device__ __forceinline__ void store4(T* p, const float (&v)[4]) {
    if constexpr (sizeof(T) == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
        *reinterpret_cast<uint2*>(p) = make_uint2(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]));
    }
}

// Stores 4 floats at p (16-byte aligned), or with `accumulate` adds them to what p holds:
// p + v, the residual add's operand order, so the sum has the bits a separate add gives.
__device__ __forceinline__ void store4_or_add(float* p, float (&v)[4], int accumulate) {
    if (accumulate) {
        float a[4];
        load4(p, a);
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = a[e] + v[e];
    }
    store4(p, v);
}

template <class T>
__device__ __forceinline__ void load8(const T* p, float (&v)[8]) {
    if constexpr (sizeof(T) == 4) {
        const float4 a = reinterpret_cast<const float4*>(p)[0];
        const float4 b = reinterpret_cast<const float4*>(p)[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
        const uint4 q = *reinterpret_cast<const uint4*>(p);
        const float2 a = unpack2<T>(q.x), b = unpack2<T>(q.y);
        const float2 c = unpack2<T>(q.z), e = unpack2<T>(q.w);
        v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
        v[4] = c.x; v[5] = c.y; v[6] = e.x; v[7] = e.y;
    }
}

template <class T>
__device__ __forceinline__ void store8(T* p, const float (&v)[8]) {
    if constexpr (sizeof(T) == 4) {
        reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
        *reinterpret_cast<uint4*>(p) = make_uint4(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]),
                                                  pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7]));
    }
}

// ---------------------------------------------------------------------------------------
// W-wide loads and stores (W = 4 or 8, load4/load8 above: 16-byte aligned).

template <int W, class T>
__device__ __forceinline__ void load_w(const T* p, float (&v)[W]) {
    if constexpr (W == 4) {
        load4(p, v);
    } else {
        load8(p, v);
    }
}

template <int W, class T>
__device__ __forceinline__ void store_w(T* p, const float (&v)[W]) {
    if constexpr (W == 4) {
        store4(p, v);
    } else {
        store8(p, v);
    }
}


// ---------------------------------------------------------------------------------------
// Grid-stride indices (64-bit: flat buffers can exceed 2^31 elements).

__device__ __forceinline__ long long global_thread() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long long grid_threads() {
    return (long long)gridDim.x * blockDim.x;
}

// ---------------------------------------------------------------------------------------
// Warp reductions over all 32 lanes (every lane must call them; every lane gets the result).

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---------------------------------------------------------------------------------------
// Block reductions: every thread of the block must call them (they hold __syncthreads), with
// blockDim.x a multiple of 32 and at most 1024; every thread gets the result. Order: each
// warp's butterfly, then warp 0's butterfly over the warp totals (padded with the identity).
// They may be called several times in a row: the first barrier keeps a call from
// overwriting the slots that the previous call's readers still read.

struct SumOp {
    template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <class T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

template <class T, class Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T identity) {
    __shared__ T slots[32];
    __shared__ T total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_reduce(v, op);
    __syncthreads();
    if (lane == 0) slots[warp] = v;
    __syncthreads();
    if (warp == 0) {
        T t = lane < warps ? slots[lane] : identity;
        t = warp_reduce(t, op);
        if (lane == 0) total = t;
    }
    __syncthreads();
    return total;
}

/// Σ over the block, fp32, fixed order.
__device__ __forceinline__ float block_sum(float v) { return block_reduce(v, SumOp(), 0.0f); }
/// Σ over the block, double, fixed order.
__device__ __forceinline__ double block_sum_d(double v) { return block_reduce(v, SumOp(), 0.0); }
/// Max over the block (NaN-ignoring, like fmaxf).
__device__ __forceinline__ float block_max(float v) { return block_reduce(v, MaxOp(), -INFINITY); }

// ---------------------------------------------------------------------------------------
// Norm forward's input row (layernorm.cu, llama.cu's RMS norm), with the residual add before
// it fused in: with `hr` (the branch's output, T) the row normalised is the stream's new
// value x + h, which is also stored at `sr` (the norm's backward and the block's next residual
// add read it there). One f32 addition per element, as the separate residual add's (and the
// CPU's `x += h`), so the sum and everything after it have that path's bits. Without `hr`,
// the row is x's. `sr` never aliases `xr` (the host gives the sum a buffer of its own).

/// The vector path: lane `lane` holds chunk k (float4 j = lane + 32k < d4) in v[k]; `hr`
/// 4·sizeof(T)-byte and `sr` 16-byte aligned.
template <class T, int CHUNKS>
__device__ __forceinline__ void norm_row_in(const float* __restrict__ xr, const T* __restrict__ hr,
                                            float* __restrict__ sr, float4 (&v)[CHUNKS], int d4,
                                            int lane) {
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const int j = lane + 32 * k;
        v[k] = j < d4 ? reinterpret_cast<const float4*>(xr)[j] : make_float4(0, 0, 0, 0);
    }
    if (hr == nullptr) return;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const int j = lane + 32 * k;
        if (j < d4) {
            float h[4];
            load4(hr + 4 * j, h);
            v[k].x += h[0]; v[k].y += h[1]; v[k].z += h[2]; v[k].w += h[3];
            reinterpret_cast<float4*>(sr)[j] = v[k];
        }
    }
}

/// The scalar path: writes the sum (this lane's columns c = lane, lane + 32, …) and returns
/// the row to normalise, which the caller reads at the same columns (its own writes).
template <class T>
__device__ __forceinline__ const float* norm_row_in_scalar(const float* __restrict__ xr,
                                                           const T* __restrict__ hr,
                                                           float* __restrict__ sr, int d,
                                                           int lane) {
    if (hr == nullptr) return xr;
    for (int c = lane; c < d; c += 32) sr[c] = xr[c] + to_f32(hr[c]);
    return sr;
}

// ---------------------------------------------------------------------------------------
// Norm backward (layernorm.cu, llama.cu's RMS norm). LAYER: the layer norm (h = (x − mean)·
// rstd, g = dy·γ, dx = rstd·(g − Σg/d − h·Σ(g·h)/d); parameter sums Σ dy·h for γ and Σ dy for
// β); otherwise the RMS norm (h = x·rstd, dx = rstd·(g − h·Σ(g·h)/d); Σ dy·h for the weight).

#define NORM_MAX_CHUNKS 8

/// One row's input gradient by the vector path, for a warp (lane `lane`): each lane keeps its
/// float4 chunks (j = lane, lane+32, …) of x and dy in registers, every load issued before the
/// first use. With `sums` (this warp's [SUMS][d/4] float4 region of shared memory, SUMS = 2
/// or 1), it also adds the row's parameter-gradient terms, from dy as it is, a lane only into
/// its own chunks. Requires d % 4 == 0, d ≤ 128·NORM_MAX_CHUNKS, x, w and dx 16-byte and dy
/// 4·sizeof(T)-byte aligned. The dx kernels' vector path and the fused kernels below both run
/// it, so their input gradients are the same bits. With `lowr` (4·sizeof(T)-byte aligned) the
/// row's dx as stored (after `accumulate`'s add) is also written rounded to T: the copy the
/// next product reads, which would otherwise be a conversion pass of its own.
template <class T, bool LAYER>
__device__ __forceinline__ void norm_bwd_row(const float* __restrict__ xr, const T* __restrict__ dyr,
                                             float* __restrict__ dxr, T* __restrict__ lowr,
                                             const float* __restrict__ w, float mu, float rs,
                                             int d, int lane, int accumulate, float4* sums) {
    const int d4 = d >> 2;
    const float d_f = (float)d;
    float xv[NORM_MAX_CHUNKS][4], gv[NORM_MAX_CHUNKS][4];
#pragma unroll
    for (int k = 0; k < NORM_MAX_CHUNKS; ++k) {
        const int j = lane + 32 * k;
        if (j < d4) {
            const float4 a = reinterpret_cast<const float4*>(xr)[j];
            xv[k][0] = a.x; xv[k][1] = a.y; xv[k][2] = a.z; xv[k][3] = a.w;
            load4(dyr + 4 * j, gv[k]);
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) xv[k][e] = gv[k][e] = 0.0f;
        }
    }
    float sg = 0.0f, sgh = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_MAX_CHUNKS; ++k) {
        const int j = lane + 32 * k;
        if (j < d4) {
            float h[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) h[e] = LAYER ? (xv[k][e] - mu) * rs : xv[k][e] * rs;
            if (sums) {
                // The parameter sums take dy as it is, before the weight scales it.
                float4 dw = sums[j];
                dw.x += gv[k][0] * h[0]; dw.y += gv[k][1] * h[1];
                dw.z += gv[k][2] * h[2]; dw.w += gv[k][3] * h[3];
                sums[j] = dw;
                if constexpr (LAYER) {
                    float4 db = sums[d4 + j];
                    db.x += gv[k][0]; db.y += gv[k][1]; db.z += gv[k][2]; db.w += gv[k][3];
                    sums[d4 + j] = db;
                }
            }
            const float4 wa = reinterpret_cast<const float4*>(w)[j];
            gv[k][0] *= wa.x; gv[k][1] *= wa.y; gv[k][2] *= wa.z; gv[k][3] *= wa.w;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if constexpr (LAYER) {
                    sg += gv[k][e];
                    sgh += gv[k][e] * h[e];
                } else {
                    sgh += gv[k][e] * xv[k][e] * rs;
                }
            }
        }
    }
    const float mg = LAYER ? warp_sum(sg) / d_f : 0.0f;
    const float mgh = warp_sum(sgh) / d_f;
#pragma unroll
    for (int k = 0; k < NORM_MAX_CHUNKS; ++k) {
        const int j = lane + 32 * k;
        if (j < d4) {
            float o[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if constexpr (LAYER) {
                    const float h = (xv[k][e] - mu) * rs;
                    o[e] = rs * (gv[k][e] - mg - h * mgh);
                } else {
                    o[e] = rs * (gv[k][e] - xv[k][e] * rs * mgh);
                }
            }
            store4_or_add(dxr + 4 * j, o, accumulate);
            if (lowr) store4(lowr + 4 * j, o);  // the stored value (the sum), rounded to T
        }
    }
}

/// The norm backward in one pass (layernorm_bwd_fused_*, rmsnorm_bwd_fused_*): norm_bwd_row
/// over the warp's rows with its region of dynamic shared memory ([warps][SUMS][d] floats:
/// 64·d or 32·d bytes at 8 warps) for the parameter sums, a lane touching only its own words,
/// so no atomics; then the block sums its warps' regions in warp order into its partial row
/// ([gridDim.x][SUMS][d]: the layout of the norms' params kernels) for colsum_finish to sum
/// the blocks. Every sum's order is fixed by the grid, which the host derives from the shape
/// alone. norm_bwd_row's requirements, and partial 16-byte aligned (the host checks, and
/// launches the two kernels otherwise).
template <class T, bool LAYER>
__device__ __forceinline__ void norm_bwd_fused_impl(const float* __restrict__ x,
                                                    const float* __restrict__ w,
                                                    const float* __restrict__ mean,
                                                    const float* __restrict__ rstd,
                                                    const T* __restrict__ dy,
                                                    float* __restrict__ dx,
                                                    T* __restrict__ dx_low,
                                                    float* __restrict__ partial, int rows, int d,
                                                    int accumulate) {
    constexpr int SUMS = LAYER ? 2 : 1;
    DYNAMIC_SMEM(float4, norm_sums);  // [warps][SUMS][d / 4]
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int d4 = d >> 2;
    float4* mine = norm_sums + (long long)warp * SUMS * d4;
    for (int j = lane; j < SUMS * d4; j += 32) mine[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // Lane l zeroes words other lanes add to: the warp's lanes are not in lockstep.
    __syncwarp();
    for (int row = blockIdx.x * warps + warp; row < rows; row += gridDim.x * warps) {
        const float mu = LAYER ? mean[row] : 0.0f;
        const long long at = (long long)row * d;
        norm_bwd_row<T, LAYER>(x + at, dy + at, dx + at, row_or_null(dx_low, at), w, mu, rstd[row],
                               d, lane, accumulate, mine);
    }
    __syncthreads();
    float4* out = reinterpret_cast<float4*>(partial + (long long)blockIdx.x * SUMS * d);
    for (int c = threadIdx.x; c < SUMS * d4; c += blockDim.x) {
        float4 s = norm_sums[c];
        for (int v = 1; v < warps; ++v) {
            const float4 t = norm_sums[(long long)v * SUMS * d4 + c];
            s.x += t.x; s.y += t.y; s.z += t.z; s.w += t.w;
        }
        out[c] = s;
    }
}

// ---------------------------------------------------------------------------------------
// Activations (elementwise.cu's act_fwd/act_bwd, bias.cu's act_bwd_colsum): K is the ActKind
// code (0 ReLU, 1 sigmoid, 2 tanh, 3 exact GELU, 4 GELU's tanh approximation).

#define MT_INV_SQRT2 0.70710678118654752f
#define MT_INV_SQRT_2PI 0.39894228040143268f
#define MT_SQRT_2_OVER_PI 0.79788456080286536f
#define MT_GELU_CUBIC 0.044715f

template <int K>
__device__ __forceinline__ float act_value(float x) {
    if constexpr (K == 0) {
        return fmaxf(x, 0.0f);  // like the CPU's x.max(0): NaN gives 0
    } else if constexpr (K == 1) {
        return 1.0f / (1.0f + expf(-x));
    } else if constexpr (K == 2) {
        return tanhf(x);
    } else if constexpr (K == 4) {
        // GELU's tanh approximation (GPT-2's "gelu_new").
        const float t = tanhf(MT_SQRT_2_OVER_PI * fmaf(MT_GELU_CUBIC * x, x * x, x));
        const float hx = 0.5f * x;
        return fmaf(hx, t, hx);
    } else {
        const float hx = 0.5f * x;  // 0.5·x·(1 + erf(x/√2)) as the CPU: hx·erf + hx
        return fmaf(hx, erff(x * MT_INV_SQRT2), hx);
    }
}

/// dx from the saved tensor (input for ReLU and GELU, output for sigmoid and tanh) and dy.
template <int K>
__device__ __forceinline__ float act_grad(float s, float dy) {
    if constexpr (K == 0) {
        return s > 0.0f ? dy : 0.0f;
    } else if constexpr (K == 1) {
        return dy * s * (1.0f - s);
    } else if constexpr (K == 2) {
        return dy * (1.0f - s * s);
    } else if constexpr (K == 4) {
        const float t = tanhf(MT_SQRT_2_OVER_PI * fmaf(MT_GELU_CUBIC * s, s * s, s));
        const float inner = MT_SQRT_2_OVER_PI * fmaf(3.0f * MT_GELU_CUBIC, s * s, 1.0f);
        return dy * (fmaf(0.5f, t, 0.5f) + 0.5f * s * (1.0f - t * t) * inner);
    } else {
        // Φ(x) + x·φ(x) with φ(x) = exp(−x²/2)/√(2π) = exp(−u²)/√(2π), u = x/√2.
        const float u = s * MT_INV_SQRT2;
        const float gauss = expf(-u * u);
        return dy * fmaf(s * MT_INV_SQRT_2PI, gauss, fmaf(0.5f, erff(u), 0.5f));
    }
}

