// elementwise.cu: conversions, the residual add, activations and the flat f32 updates of
// the training step (scale, tied sums, fp16 unscaling). See ABI.md.
//
// Every kernel is a grid-stride loop (any grid; the Rust side launches 256 threads and
// min(ceil(n/256), 132·32) blocks). The bulk runs on 16-byte accesses: chunks of 8 elements
// (one uint4 of 16-bit values, two float4 of f32) when every pointer is 16-byte aligned,
// else every element goes the scalar way; the n % 8 tail is scalar. The f32-only kernels
// (scale, unscale) work in float4 chunks after a scalar head that reaches 16-byte
// alignment, since the Rust side may hand them a view at any float offset.
//
// Arithmetic is fp32 with the precise functions (expf, erff, tanhf), in the CPU's
// arrangement (crates/tensor/src/activation.rs).

// ---------------------------------------------------------------------------------------
// Conversions.

template <class S, class D>
__device__ __forceinline__ void convert_impl(const S* __restrict__ x, D* __restrict__ y,
                                             long long n) {
    const long long t = global_thread(), stride = grid_threads();
    const long long chunks = (is_aligned(x, 16) && is_aligned(y, 16)) ? n / 8 : 0;
    for (long long i = t; i < chunks; i += stride) {
        float v[8];
        load8(x + 8 * i, v);
        store8(y + 8 * i, v);
    }
    for (long long i = chunks * 8 + t; i < n; i += stride) y[i] = from_f32<D>(to_f32(x[i]));
}

extern "C" __global__ void __launch_bounds__(256)
convert_f32_bf16(const float* x, bf16* y, long long n) { convert_impl(x, y, n); }
extern "C" __global__ void __launch_bounds__(256)
convert_f32_f16(const float* x, f16* y, long long n) { convert_impl(x, y, n); }
extern "C" __global__ void __launch_bounds__(256)
convert_bf16_f32(const bf16* x, float* y, long long n) { convert_impl(x, y, n); }
extern "C" __global__ void __launch_bounds__(256)
convert_f16_f32(const f16* x, float* y, long long n) { convert_impl(x, y, n); }

// ---------------------------------------------------------------------------------------
// Residual add: y = a + b, f32 stream plus a T branch. `y` may alias `a` (no __restrict__
// on them: each chunk is read whole before it is written).

template <class T>
__device__ __forceinline__ void add_impl(const float* a, const T* __restrict__ b, float* y,
                                         long long n) {
    const long long t = global_thread(), stride = grid_threads();
    const bool vec = is_aligned(a, 16) && is_aligned(b, 16) && is_aligned(y, 16);
    const long long chunks = vec ? n / 8 : 0;
    for (long long i = t; i < chunks; i += stride) {
        float va[8], vb[8];
        load8(a + 8 * i, va);
        load8(b + 8 * i, vb);
#pragma unroll
        for (int k = 0; k < 8; ++k) va[k] += vb[k];
        store8(y + 8 * i, va);
    }
    for (long long i = chunks * 8 + t; i < n; i += stride) y[i] = a[i] + to_f32(b[i]);
}

extern "C" __global__ void __launch_bounds__(256)
add_f32_f32(const float* a, const float* b, float* y, long long n) { add_impl(a, b, y, n); }
extern "C" __global__ void __launch_bounds__(256)
add_f32_bf16(const float* a, const bf16* b, float* y, long long n) { add_impl(a, b, y, n); }
extern "C" __global__ void __launch_bounds__(256)
add_f32_f16(const float* a, const f16* b, float* y, long long n) { add_impl(a, b, y, n); }

// ---------------------------------------------------------------------------------------
// Activations. `kind` is uniform, so it selects one of five monomorphised loops instead of
// branching per element.

// act_value and act_grad (common.cuh: bias.cu's fused activation backward uses them too).

template <class T, int K>
__device__ __forceinline__ void act_fwd_loop(const T* __restrict__ x, T* __restrict__ y,
                                             long long n) {
    const long long t = global_thread(), stride = grid_threads();
    const long long chunks = (is_aligned(x, 16) && is_aligned(y, 16)) ? n / 8 : 0;
    for (long long i = t; i < chunks; i += stride) {
        float v[8];
        load8(x + 8 * i, v);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = act_value<K>(v[k]);
        store8(y + 8 * i, v);
    }
    for (long long i = chunks * 8 + t; i < n; i += stride)
        y[i] = from_f32<T>(act_value<K>(to_f32(x[i])));
}

/// `dx` may alias `dy`: no __restrict__ on them; each chunk is read before it is written.
template <class T, int K>
__device__ __forceinline__ void act_bwd_loop(const T* __restrict__ saved, const T* dy, T* dx,
                                             long long n) {
    const long long t = global_thread(), stride = grid_threads();
    const bool vec = is_aligned(saved, 16) && is_aligned(dy, 16) && is_aligned(dx, 16);
    const long long chunks = vec ? n / 8 : 0;
    for (long long i = t; i < chunks; i += stride) {
        float s[8], g[8];
        load8(saved + 8 * i, s);
        load8(dy + 8 * i, g);
#pragma unroll
        for (int k = 0; k < 8; ++k) g[k] = act_grad<K>(s[k], g[k]);
        store8(dx + 8 * i, g);
    }
    for (long long i = chunks * 8 + t; i < n; i += stride)
        dx[i] = from_f32<T>(act_grad<K>(to_f32(saved[i]), to_f32(dy[i])));
}

template <class T>
__device__ __forceinline__ void act_fwd_impl(const T* x, T* y, long long n, int kind) {
    switch (kind) {
        case 0: act_fwd_loop<T, 0>(x, y, n); break;
        case 1: act_fwd_loop<T, 1>(x, y, n); break;
        case 2: act_fwd_loop<T, 2>(x, y, n); break;
        case 4: act_fwd_loop<T, 4>(x, y, n); break;
        default: act_fwd_loop<T, 3>(x, y, n); break;
    }
}

template <class T>
__device__ __forceinline__ void act_bwd_impl(const T* saved, const T* dy, T* dx, long long n,
                                             int kind) {
    switch (kind) {
        case 0: act_bwd_loop<T, 0>(saved, dy, dx, n); break;
        case 1: act_bwd_loop<T, 1>(saved, dy, dx, n); break;
        case 2: act_bwd_loop<T, 2>(saved, dy, dx, n); break;
        case 4: act_bwd_loop<T, 4>(saved, dy, dx, n); break;
        default: act_bwd_loop<T, 3>(saved, dy, dx, n); break;
    }
}

extern "C" __global__ void __launch_bounds__(256)
act_fwd_f32(const float* x, float* y, long long n, int kind) { act_fwd_impl(x, y, n, kind); }
extern "C" __global__ void __launch_bounds__(256)
act_fwd_bf16(const bf16* x, bf16* y, long long n, int kind) { act_fwd_impl(x, y, n, kind); }
extern "C" __global__ void __launch_bounds__(256)
act_fwd_f16(const f16* x, f16* y, long long n, int kind) { act_fwd_impl(x, y, n, kind); }

extern "C" __global__ void __launch_bounds__(256)
act_bwd_f32(const float* saved, const float* dy, float* dx, long long n, int kind) {
    act_bwd_impl(saved, dy, dx, n, kind);
}
extern "C" __global__ void __launch_bounds__(256)
act_bwd_bf16(const bf16* saved, const bf16* dy, bf16* dx, long long n, int kind) {
    act_bwd_impl(saved, dy, dx, n, kind);
}
extern "C" __global__ void __launch_bounds__(256)
act_bwd_f16(const f16* saved, const f16* dy, f16* dx, long long n, int kind) {
    act_bwd_impl(saved, dy, dx, n, kind);
}

// ---------------------------------------------------------------------------------------
// Flat f32 updates over buffers that may be views at any float offset: a scalar head of
// h < 4 elements (taken by the first h threads of the grid) brings the pointer to 16 bytes,
// then float4 chunks, then a scalar tail.

extern "C" __global__ void __launch_bounds__(256)
scale_f32(float* x, long long n, float s) {
    const long long t = global_thread(), stride = grid_threads();
    const long long h = align16_head(x, n);
    const long long chunks = (n - h) / 4;
    if (t < h) x[t] *= s;
    float4* x4 = reinterpret_cast<float4*>(x + h);
    for (long long i = t; i < chunks; i += stride) {
        float4 v = x4[i];
        v.x *= s; v.y *= s; v.z *= s; v.w *= s;
        x4[i] = v;
    }
    for (long long i = h + chunks * 4 + t; i < n; i += stride) x[i] *= s;
}

/// a = b = a + b. The float4 path needs a and b equally misaligned (the same head serves
/// both); otherwise everything is scalar.
extern "C" __global__ void __launch_bounds__(256)
tie_sum_f32(float* a, float* b, long long n) {
    const long long t = global_thread(), stride = grid_threads();
    const bool same = ((reinterpret_cast<unsigned long long>(a) ^
                        reinterpret_cast<unsigned long long>(b)) & 15u) == 0;
    const long long h = same ? align16_head(a, n) : n;
    const long long chunks = (n - h) / 4;
    if (t < h) {
        for (long long i = t; i < h; i += stride) {
            const float s = a[i] + b[i];
            a[i] = s;
            b[i] = s;
        }
    }
    float4* a4 = reinterpret_cast<float4*>(a + h);
    float4* b4 = reinterpret_cast<float4*>(b + h);
    for (long long i = t; i < chunks; i += stride) {
        const float4 x = a4[i], y = b4[i];
        const float4 s = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
        a4[i] = s;
        b4[i] = s;
    }
    for (long long i = h + chunks * 4 + t; i < n; i += stride) {
        const float s = a[i] + b[i];
        a[i] = s;
        b[i] = s;
    }
}

/// g *= factor; any non-finite result stores 1 into *found_inf (a plain store of the same
/// value by whichever threads see one: no order dependence; never cleared here).
extern "C" __global__ void __launch_bounds__(256)
unscale_check_f32(float* g, long long n, float factor, int* found_inf) {
    const long long t = global_thread(), stride = grid_threads();
    const long long h = align16_head(g, n);
    const long long chunks = (n - h) / 4;
    bool bad = false;
    if (t < h) {
        const float v = g[t] * factor;
        g[t] = v;
        bad |= !isfinite(v);
    }
    float4* g4 = reinterpret_cast<float4*>(g + h);
    for (long long i = t; i < chunks; i += stride) {
        float4 v = g4[i];
        v.x *= factor; v.y *= factor; v.z *= factor; v.w *= factor;
        g4[i] = v;
        bad |= !(isfinite(v.x) && isfinite(v.y) && isfinite(v.z) && isfinite(v.w));
    }
    for (long long i = h + chunks * 4 + t; i < n; i += stride) {
        const float v = g[i] * factor;
        g[i] = v;
        bad |= !isfinite(v);
    }
    if (bad) *found_inf = 1;
}

/// Copy plans (crates/parallel/src/engine/flat.rs, ZeRO's packing of pieces into slots and
/// back): run r of `runs` is three i64 (src, dst, len) and moves len floats from src + s to
/// dst + d, zeros when s < 0; with `add`, adds them instead (zeros runs change nothing).
/// Runs never overlap in dst and never read dst, so blocks need no coordination: runs go
/// over grid y, a run's elements over grid x.
/// copy_runs_u16: the same plans over 16-bit values (bf16 or f16 bits: activations moved by
/// Ulysses' all-to-all reshuffles), copies only (`add` must be 0; zeros runs write 0 bits).
extern "C" __global__ void __launch_bounds__(256)
copy_runs_u16(const unsigned short* __restrict__ src, unsigned short* __restrict__ dst,
              const long long* __restrict__ runs, int count) {
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (int r = blockIdx.y; r < count; r += gridDim.y) {
        const long long s = runs[3 * r], d = runs[3 * r + 1], len = runs[3 * r + 2];
        for (long long i = first; i < len; i += stride) dst[d + i] = s < 0 ? 0 : src[s + i];
    }
}

extern "C" __global__ void __launch_bounds__(256)
copy_runs_f32(const float* __restrict__ src, float* __restrict__ dst,
              const long long* __restrict__ runs, int count, int add) {
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (int r = blockIdx.y; r < count; r += gridDim.y) {
        const long long s = runs[3 * r], d = runs[3 * r + 1], len = runs[3 * r + 2];
        for (long long i = first; i < len; i += stride) {
            if (s < 0) {
                if (!add) dst[d + i] = 0.0f;
            } else if (add) {
                dst[d + i] += src[s + i];
            } else {
                dst[d + i] = src[s + i];
            }
        }
    }
}
