// conv.cu: the convolutional nets' kernels (LeNet, ResNet-18) over CNHW activations
// (`[C, N, H, W]`: channel c owns one contiguous block of N·H·W values), the layout of
// meshtrain's convolutional layers on both devices. See ABI.md.
//
// - A convolution is `W[O, C·k·k] × cols[C·k·k, N·OH·OW]` (a cuBLASLt product on the Rust
//   side) around `im2col` (the columns, zero where a window reads padding) and `col2im` (its
//   adjoint, for the input gradient). With CNHW the product's `[O, N·OH·OW]` result is the
//   output as it is, and the gradient of the output is the product's operand as it is.
//   col2im gathers (each input element sums the column entries that read it, in (ky, kx)
//   order): no atomics, the same bits every run.
// - Per-channel statistics (batch norm's sums, a convolution's bias gradient) are reduced in a
//   fixed order: `channel_partials` sums a part of a channel per block in double (grid
//   channels × parts, the parts fixed by the shape alone on the Rust side), `channel_finish`
//   adds the parts in order. Double, because the CPU twin accumulates in double (a channel of
//   ResNet's stem holds 50k values, and the variance is E[x²] − E[x]²).
// - Batch norm's arithmetic is the CPU's (`norm.rs`): moments from the sums in double,
//   running statistics with the unbiased variance, `y = γ·x̂ + β` with `x̂ = (x − μ)·rstd`.
// - Pooling and the layout changes are element-wise gathers in the CPU's order of additions
//   (on the emulator bit-identical to the CPU's). NVRTC fuses multiplies into additions by
//   default, so on a GPU average pooling's gradient, batch norm's arithmetic and the running
//   update can differ from the CPU in the last bit (the checks' tolerances allow it).
//
// Every kernel takes T = float, bf16 or f16 for its activations (f32 arithmetic inside,
// rounded to T once); statistics and parameters are f32, sums double.

// ---------------------------------------------------------------------------------------
// im2col / col2im.

/// The geometry every convolution kernel takes: input `[C, N, H, W]`, square kernel k,
/// stride s, padding p, output `OH × OW`.
struct ConvDims {
    int C, N, H, W, k, s, p, OH, OW;
};

__device__ __forceinline__ ConvDims conv_dims(int C, int N, int H, int W, int k, int s, int p,
                                              int OH, int OW) {
    ConvDims d;
    d.C = C; d.N = N; d.H = H; d.W = W; d.k = k; d.s = s; d.p = p; d.OH = OH; d.OW = OW;
    return d;
}

// cols[(c·k + ky)·k + kx, (n·OH + oy)·OW + ox] = x[c, n, oy·s + ky − p, ox·s + kx − p], or 0
// where that is outside the image. Any grid; consecutive threads write consecutive columns.
template <class T>
__device__ __forceinline__ void im2col_impl(const T* __restrict__ x, T* __restrict__ cols,
                                            ConvDims d) {
    const long long np = (long long)d.N * d.OH * d.OW;
    const long long total = (long long)d.C * d.k * d.k * np;
    for (long long i = global_thread(); i < total; i += grid_threads()) {
        const long long row = i / np, j = i - row * np;
        const int kx = (int)(row % d.k), ky = (int)((row / d.k) % d.k), c = (int)(row / (d.k * d.k));
        const int ox = (int)(j % d.OW), oy = (int)((j / d.OW) % d.OH), n = (int)(j / ((long long)d.OW * d.OH));
        const int iy = oy * d.s + ky - d.p, ix = ox * d.s + kx - d.p;
        T v = from_f32<T>(0.0f);
        if (iy >= 0 && iy < d.H && ix >= 0 && ix < d.W)
            v = x[(((long long)c * d.N + n) * d.H + iy) * d.W + ix];
        cols[i] = v;
    }
}

// dx[c, n, iy, ix] = Σ dcols[(c·k + ky)·k + kx, (n·OH + oy)·OW + ox] over the taps (ky, kx)
// whose window position (oy, ox) reads (iy, ix), in (ky, kx) order, in f32. Any grid.
template <class T>
__device__ __forceinline__ void col2im_impl(const T* __restrict__ dcols, T* __restrict__ dx,
                                            ConvDims d) {
    const long long np = (long long)d.N * d.OH * d.OW;
    const long long total = (long long)d.C * d.N * d.H * d.W;
    for (long long i = global_thread(); i < total; i += grid_threads()) {
        const int ix = (int)(i % d.W), iy = (int)((i / d.W) % d.H);
        const long long cn = i / ((long long)d.W * d.H);
        const int n = (int)(cn % d.N), c = (int)(cn / d.N);
        float sum = 0.0f;
        for (int ky = 0; ky < d.k; ++ky) {
            const int ty = iy + d.p - ky;
            if (ty < 0 || ty % d.s != 0) continue;
            const int oy = ty / d.s;
            if (oy >= d.OH) continue;
            for (int kx = 0; kx < d.k; ++kx) {
                const int tx = ix + d.p - kx;
                if (tx < 0 || tx % d.s != 0) continue;
                const int ox = tx / d.s;
                if (ox >= d.OW) continue;
                const long long row = ((long long)c * d.k + ky) * d.k + kx;
                sum += to_f32(dcols[row * np + ((long long)n * d.OH + oy) * d.OW + ox]);
            }
        }
        dx[i] = from_f32<T>(sum);
    }
}

#define MT_CONV_ARGS int C, int N, int H, int W, int k, int s, int p, int OH, int OW
#define MT_CONV_DIMS conv_dims(C, N, H, W, k, s, p, OH, OW)

extern "C" __global__ void __launch_bounds__(256)
im2col_f32(const float* x, float* cols, MT_CONV_ARGS) { im2col_impl(x, cols, MT_CONV_DIMS); }
extern "C" __global__ void __launch_bounds__(256)
im2col_bf16(const bf16* x, bf16* cols, MT_CONV_ARGS) { im2col_impl(x, cols, MT_CONV_DIMS); }
extern "C" __global__ void __launch_bounds__(256)
im2col_f16(const f16* x, f16* cols, MT_CONV_ARGS) { im2col_impl(x, cols, MT_CONV_DIMS); }

extern "C" __global__ void __launch_bounds__(256)
col2im_f32(const float* dcols, float* dx, MT_CONV_ARGS) { col2im_impl(dcols, dx, MT_CONV_DIMS); }
extern "C" __global__ void __launch_bounds__(256)
col2im_bf16(const bf16* dcols, bf16* dx, MT_CONV_ARGS) { col2im_impl(dcols, dx, MT_CONV_DIMS); }
extern "C" __global__ void __launch_bounds__(256)
col2im_f16(const f16* dcols, f16* dx, MT_CONV_ARGS) { col2im_impl(dcols, dx, MT_CONV_DIMS); }

// ---------------------------------------------------------------------------------------
// y[c, ·] += b[c] over channel blocks of `plane` values (a convolution's bias, in T: the
// products' dtype, like the linear layers' bias). Any grid.

template <class T>
__device__ __forceinline__ void channel_bias_add_impl(T* __restrict__ y, const T* __restrict__ b,
                                                      long long plane, long long total) {
    for (long long i = global_thread(); i < total; i += grid_threads())
        y[i] = from_f32<T>(to_f32(y[i]) + to_f32(b[i / plane]));
}

extern "C" __global__ void __launch_bounds__(256)
channel_bias_add_f32(float* y, const float* b, long long plane, long long total) {
    channel_bias_add_impl(y, b, plane, total);
}
extern "C" __global__ void __launch_bounds__(256)
channel_bias_add_bf16(bf16* y, const bf16* b, long long plane, long long total) {
    channel_bias_add_impl(y, b, plane, total);
}
extern "C" __global__ void __launch_bounds__(256)
channel_bias_add_f16(f16* y, const f16* b, long long plane, long long total) {
    channel_bias_add_impl(y, b, plane, total);
}

// ---------------------------------------------------------------------------------------
// Per-channel sums in a fixed order.
//
// channel_partials_*: grid (channels, parts), block 256 (any multiple of 32 up to 1024). Block
// (c, q) covers values [q·span, min((q+1)·span, plane)) of channel c, span = ceil(plane /
// parts); thread t adds every blockDim.x-th of them from t, in double, then the block's
// fixed-order double sum. It writes partial[(c·parts + q)·2 + {0, 1}] =
//   (Σ a, Σ a·a)                 with `b` null (batch norm's forward moments),
//   (Σ a, Σ f32(a·b))            otherwise (the backward's Σdy and Σdy·x̂, the product rounded
//                                to f32 as the CPU rounds it).
// channel_finish: one thread per channel (any grid), the parts added in order (part 0 first).

template <class T>
__device__ __forceinline__ void channel_partials_impl(const T* __restrict__ a,
                                                      const T* __restrict__ b,
                                                      double* __restrict__ partial, int parts,
                                                      long long plane) {
    const int c = blockIdx.x, q = blockIdx.y;
    const long long span = (plane + parts - 1) / parts;
    const long long lo = min((long long)q * span, plane), hi = min(lo + span, plane);
    const T* ac = a + (long long)c * plane;
    const T* bc = b ? b + (long long)c * plane : nullptr;
    double s = 0.0, t = 0.0;
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float v = to_f32(ac[i]);
        s += (double)v;
        if (bc) t += (double)(v * to_f32(bc[i]));
        else t += (double)v * (double)v;
    }
    s = block_sum_d(s);
    t = block_sum_d(t);
    if (threadIdx.x == 0) {
        double* out = partial + ((long long)c * parts + q) * 2;
        out[0] = s;
        out[1] = t;
    }
}

extern "C" __global__ void __launch_bounds__(1024)
channel_partials_f32(const float* a, const float* b, double* partial, int parts, long long plane) {
    channel_partials_impl(a, b, partial, parts, plane);
}
extern "C" __global__ void __launch_bounds__(1024)
channel_partials_bf16(const bf16* a, const bf16* b, double* partial, int parts, long long plane) {
    channel_partials_impl(a, b, partial, parts, plane);
}
extern "C" __global__ void __launch_bounds__(1024)
channel_partials_f16(const f16* a, const f16* b, double* partial, int parts, long long plane) {
    channel_partials_impl(a, b, partial, parts, plane);
}

extern "C" __global__ void __launch_bounds__(256)
channel_finish(const double* __restrict__ partial, double* __restrict__ sums, int channels,
               int parts) {
    for (long long c = global_thread(); c < channels; c += grid_threads()) {
        double s = 0.0, t = 0.0;
        for (int q = 0; q < parts; ++q) {
            s += partial[(c * parts + q) * 2];
            t += partial[(c * parts + q) * 2 + 1];
        }
        sums[c * 2] = s;
        sums[c * 2 + 1] = t;
    }
}

// ---------------------------------------------------------------------------------------
// Batch norm.

// stats[0..C) = mean, stats[C..2C) = biased variance, from sums (Σx, Σx²) over `count` values
// (in double, as the CPU's `moments_from_sums`); with `running` (running_mean[C] then
// running_var[C], the layer's buffers) also the running estimates, the variance unbiased:
// r = (1 − momentum)·r + momentum·v, in f32. One thread per channel, any grid.
extern "C" __global__ void __launch_bounds__(256)
bn_moments(const double* __restrict__ sums, float* __restrict__ stats, float* running,
           int channels, double count, float momentum) {
    const float unbias = (float)count / (float)((count > 2.0 ? count : 2.0) - 1.0);
    for (long long c = global_thread(); c < channels; c += grid_threads()) {
        const double mean = sums[c * 2] / count;
        const double spread = sums[c * 2 + 1] / count - mean * mean;
        const double var = spread > 0.0 ? spread : 0.0;
        const float m = (float)mean, v = (float)var;
        stats[c] = m;
        stats[channels + c] = v;
        if (running) {
            float* rm = running + c;
            float* rv = running + channels + c;
            *rm = (1.0f - momentum) * *rm + momentum * m;
            *rv = (1.0f - momentum) * *rv + momentum * v * unbias;  // the CPU's order
        }
    }
}

// x̂ = (x − mean[c])·rstd, y = γ[c]·x̂ + β[c] with rstd = 1/√(var[c] + eps); `stats` is mean[C]
// then var[C] (bn_moments' output in training, the running buffers in evaluation). `xhat`
// (kept for backward) may be null. Any grid.
template <class T>
__device__ __forceinline__ void bn_apply_impl(const T* __restrict__ x, const float* __restrict__ stats,
                                              const float* __restrict__ gamma,
                                              const float* __restrict__ beta, T* __restrict__ y,
                                              T* __restrict__ xhat, int channels, long long plane,
                                              float eps) {
    const long long total = (long long)channels * plane;
    for (long long i = global_thread(); i < total; i += grid_threads()) {
        const int c = (int)(i / plane);
        const float rstd = 1.0f / sqrtf(stats[channels + c] + eps);
        const float h = (to_f32(x[i]) - stats[c]) * rstd;
        if (xhat) xhat[i] = from_f32<T>(h);
        y[i] = from_f32<T>(gamma[c] * h + beta[c]);
    }
}

#define MT_BN_APPLY_ARGS(T) \
    const T* x, const float* stats, const float* gamma, const float* beta, T* y, T* xhat, \
        int channels, long long plane, float eps
extern "C" __global__ void __launch_bounds__(256) bn_apply_f32(MT_BN_APPLY_ARGS(float)) {
    bn_apply_impl(x, stats, gamma, beta, y, xhat, channels, plane, eps);
}
extern "C" __global__ void __launch_bounds__(256) bn_apply_bf16(MT_BN_APPLY_ARGS(bf16)) {
    bn_apply_impl(x, stats, gamma, beta, y, xhat, channels, plane, eps);
}
extern "C" __global__ void __launch_bounds__(256) bn_apply_f16(MT_BN_APPLY_ARGS(f16)) {
    bn_apply_impl(x, stats, gamma, beta, y, xhat, channels, plane, eps);
}

// dγ[c] += f32(Σdy·x̂), dβ[c] += f32(Σdy) from channel_finish's sums; `dgamma` may be null (a
// convolution's bias gradient is the dβ half). One thread per channel, any grid.
extern "C" __global__ void __launch_bounds__(256)
bn_param_grads(const double* __restrict__ sums, float* dgamma, float* __restrict__ dbeta,
               int channels) {
    for (long long c = global_thread(); c < channels; c += grid_threads()) {
        if (dgamma) dgamma[c] += (float)sums[c * 2 + 1];
        dbeta[c] += (float)sums[c * 2];
    }
}

// dx = γ·rstd·(dy − Σdy/M − x̂·Σ(dy·x̂)/M) per channel, the sums over `count` values (all
// data-parallel workers' under SyncBatchNorm), `var` the forward's biased variance. Any grid.
template <class T>
__device__ __forceinline__ void bn_input_grad_impl(const T* __restrict__ dy, const T* __restrict__ xhat,
                                                   const float* __restrict__ var,
                                                   const float* __restrict__ gamma,
                                                   const double* __restrict__ sums,
                                                   T* __restrict__ dx, int channels,
                                                   long long plane, double count, float eps) {
    const long long total = (long long)channels * plane;
    for (long long i = global_thread(); i < total; i += grid_threads()) {
        const int c = (int)(i / plane);
        const float rstd = 1.0f / sqrtf(var[c] + eps);
        const float scale = gamma[c] * rstd;
        const float mean_dy = (float)(sums[c * 2] / count);
        const float mean_dyh = (float)(sums[c * 2 + 1] / count);
        dx[i] = from_f32<T>(scale * (to_f32(dy[i]) - mean_dy - to_f32(xhat[i]) * mean_dyh));
    }
}

#define MT_BN_DX_ARGS(T) \
    const T* dy, const T* xhat, const float* var, const float* gamma, const double* sums, \
        T* dx, int channels, long long plane, double count, float eps
extern "C" __global__ void __launch_bounds__(256) bn_input_grad_f32(MT_BN_DX_ARGS(float)) {
    bn_input_grad_impl(dy, xhat, var, gamma, sums, dx, channels, plane, count, eps);
}
extern "C" __global__ void __launch_bounds__(256) bn_input_grad_bf16(MT_BN_DX_ARGS(bf16)) {
    bn_input_grad_impl(dy, xhat, var, gamma, sums, dx, channels, plane, count, eps);
}
extern "C" __global__ void __launch_bounds__(256) bn_input_grad_f16(MT_BN_DX_ARGS(f16)) {
    bn_input_grad_impl(dy, xhat, var, gamma, sums, dx, channels, plane, count, eps);
}

// ---------------------------------------------------------------------------------------
// Pooling over `planes` planes of H × W (C·N of them in CNHW), windows k × k, stride s,
// padding p (average pooling: p = 0), output OH × OW per plane.

#define MT_POOL_ARGS long long planes, int H, int W, int OH, int OW, int k, int s, int p

// Max: y = the window's largest value inside the image (padding never wins); `arg` (the
// winner's index in its plane, for backward; may be null) takes the first largest in (ky, kx)
// order, a NaN winning over everything after it: the CPU's rule. One thread per output.
template <class T>
__device__ __forceinline__ void maxpool_fwd_impl(const T* __restrict__ x, T* __restrict__ y,
                                                 int* __restrict__ arg, MT_POOL_ARGS) {
    const long long total = planes * OH * OW;
    for (long long i = global_thread(); i < total; i += grid_threads()) {
        const int ox = (int)(i % OW), oy = (int)((i / OW) % OH);
        const long long plane = i / ((long long)OW * OH);
        const T* src = x + plane * H * W;
        float best = -INFINITY;
        int best_idx = 0;
        for (int ky = 0; ky < k; ++ky) {
            const int iy = oy * s + ky - p;
            if (iy < 0 || iy >= H) continue;
            for (int kx = 0; kx < k; ++kx) {
                const int ix = ox * s + kx - p;
                if (ix < 0 || ix >= W) continue;
                const float v = to_f32(src[iy * W + ix]);
                if (v > best || isnan(v)) {
                    best = v;
                    best_idx = iy * W + ix;
                }
            }
        }
        y[i] = from_f32<T>(best);
        if (arg) arg[i] = best_idx;
    }
}

// dx[plane, idx] = Σ dy over the outputs whose window covers idx and chose it, in output
// order (oy, then ox): the CPU's order of additions. One thread per input element.
template <class T>
__device__ __forceinline__ void maxpool_bwd_impl(const T* __restrict__ dy, const int* __restrict__ arg,
                                                 T* __restrict__ dx, MT_POOL_ARGS) {
    const long long total = planes * H * W;
    for (long long i = global_thread(); i < total; i += grid_threads()) {
        const int ix = (int)(i % W), iy = (int)((i / W) % H);
        const long long plane = i / ((long long)W * H);
        const int idx = iy * W + ix;
        // Outputs whose window covers (iy, ix): o·s − p ≤ i ≤ o·s − p + k − 1.
        const int oy0 = max(0, (iy + p - k + s) / s), oy1 = min(OH - 1, (iy + p) / s);
        const int ox0 = max(0, (ix + p - k + s) / s), ox1 = min(OW - 1, (ix + p) / s);
        float sum = 0.0f;
        for (int oy = oy0; oy <= oy1; ++oy)
            for (int ox = ox0; ox <= ox1; ++ox) {
                const long long o = (plane * OH + oy) * OW + ox;
                if (arg[o] == idx) sum += to_f32(dy[o]);
            }
        dx[i] = from_f32<T>(sum);
    }
}

// Average (no padding): each window's rows summed left to right, the row sums added top to
// bottom, times 1/k²: the CPU's order. One thread per output.
template <class T>
__device__ __forceinline__ void avgpool_fwd_impl(const T* __restrict__ x, T* __restrict__ y,
                                                 MT_POOL_ARGS) {
    const long long total = planes * OH * OW;
    const float inv = 1.0f / (float)(k * k);
    for (long long i = global_thread(); i < total; i += grid_threads()) {
        const int ox = (int)(i % OW), oy = (int)((i / OW) % OH);
        const T* src = x + (i / ((long long)OW * OH)) * H * W;
        float sum = 0.0f;
        for (int ky = 0; ky < k; ++ky) {
            const T* row = src + (oy * s + ky) * W + ox * s;
            float r = 0.0f;
            for (int kx = 0; kx < k; ++kx) r += to_f32(row[kx]);
            sum += r;
        }
        y[i] = from_f32<T>(sum * inv);
    }
}

// dx = Σ dy/k² over the windows covering the element, in output order. One thread per input.
template <class T>
__device__ __forceinline__ void avgpool_bwd_impl(const T* __restrict__ dy, T* __restrict__ dx,
                                                 MT_POOL_ARGS) {
    const long long total = planes * H * W;
    const float inv = 1.0f / (float)(k * k);
    for (long long i = global_thread(); i < total; i += grid_threads()) {
        const int ix = (int)(i % W), iy = (int)((i / W) % H);
        const long long plane = i / ((long long)W * H);
        const int oy0 = max(0, (iy - k + s) / s), oy1 = min(OH - 1, iy / s);
        const int ox0 = max(0, (ix - k + s) / s), ox1 = min(OW - 1, ix / s);
        float sum = 0.0f;
        for (int oy = oy0; oy <= oy1; ++oy)
            for (int ox = ox0; ox <= ox1; ++ox)
                sum += to_f32(dy[(plane * OH + oy) * OW + ox]) * inv;
        dx[i] = from_f32<T>(sum);
    }
}

#define MT_POOL_PASS planes, H, W, OH, OW, k, s, p
extern "C" __global__ void __launch_bounds__(256)
maxpool_fwd_f32(const float* x, float* y, int* arg, MT_POOL_ARGS) { maxpool_fwd_impl(x, y, arg, MT_POOL_PASS); }
extern "C" __global__ void __launch_bounds__(256)
maxpool_fwd_bf16(const bf16* x, bf16* y, int* arg, MT_POOL_ARGS) { maxpool_fwd_impl(x, y, arg, MT_POOL_PASS); }
extern "C" __global__ void __launch_bounds__(256)
maxpool_fwd_f16(const f16* x, f16* y, int* arg, MT_POOL_ARGS) { maxpool_fwd_impl(x, y, arg, MT_POOL_PASS); }
extern "C" __global__ void __launch_bounds__(256)
maxpool_bwd_f32(const float* dy, const int* arg, float* dx, MT_POOL_ARGS) { maxpool_bwd_impl(dy, arg, dx, MT_POOL_PASS); }
extern "C" __global__ void __launch_bounds__(256)
maxpool_bwd_bf16(const bf16* dy, const int* arg, bf16* dx, MT_POOL_ARGS) { maxpool_bwd_impl(dy, arg, dx, MT_POOL_PASS); }
extern "C" __global__ void __launch_bounds__(256)
maxpool_bwd_f16(const f16* dy, const int* arg, f16* dx, MT_POOL_ARGS) { maxpool_bwd_impl(dy, arg, dx, MT_POOL_PASS); }
extern "C" __global__ void __launch_bounds__(256)
avgpool_fwd_f32(const float* x, float* y, MT_POOL_ARGS) { avgpool_fwd_impl(x, y, MT_POOL_PASS); }
extern "C" __global__ void __launch_bounds__(256)
avgpool_fwd_bf16(const bf16* x, bf16* y, MT_POOL_ARGS) { avgpool_fwd_impl(x, y, MT_POOL_PASS); }
extern "C" __global__ void __launch_bounds__(256)
avgpool_fwd_f16(const f16* x, f16* y, MT_POOL_ARGS) { avgpool_fwd_impl(x, y, MT_POOL_PASS); }
extern "C" __global__ void __launch_bounds__(256)
avgpool_bwd_f32(const float* dy, float* dx, MT_POOL_ARGS) { avgpool_bwd_impl(dy, dx, MT_POOL_PASS); }
extern "C" __global__ void __launch_bounds__(256)
avgpool_bwd_bf16(const bf16* dy, bf16* dx, MT_POOL_ARGS) { avgpool_bwd_impl(dy, dx, MT_POOL_PASS); }
extern "C" __global__ void __launch_bounds__(256)
avgpool_bwd_f16(const f16* dy, f16* dx, MT_POOL_ARGS) { avgpool_bwd_impl(dy, dx, MT_POOL_PASS); }

// ---------------------------------------------------------------------------------------
// Layout changes.

// y[b, a, ·] = x[a, b, ·] for x `[A, B, P]`: NCHW ↔ CNHW (P = H·W), and CNHW → `[N, C·H·W]`
// (PyTorch's flatten order). One thread per element, any grid.
template <class T>
__device__ __forceinline__ void swap_axes_impl(const T* __restrict__ x, T* __restrict__ y, int A,
                                               int B, long long P) {
    const long long total = (long long)A * B * P;
    for (long long i = global_thread(); i < total; i += grid_threads()) {
        const long long e = i % P, ba = i / P;
        const int a = (int)(ba % A), b = (int)(ba / A);
        y[i] = x[((long long)a * B + b) * P + e];
    }
}

extern "C" __global__ void __launch_bounds__(256)
swap_axes_f32(const float* x, float* y, int A, int B, long long P) { swap_axes_impl(x, y, A, B, P); }
extern "C" __global__ void __launch_bounds__(256)
swap_axes_bf16(const bf16* x, bf16* y, int A, int B, long long P) { swap_axes_impl(x, y, A, B, P); }
extern "C" __global__ void __launch_bounds__(256)
swap_axes_f16(const f16* x, f16* y, int A, int B, long long P) { swap_axes_impl(x, y, A, B, P); }

// Global average pooling: y[n, c] = (Σ x[c, n, ·], left to right) / HW, the plane summed in
// order as the CPU sums it. One thread per (n, c), any grid.
template <class T>
__device__ __forceinline__ void global_avg_fwd_impl(const T* __restrict__ x, T* __restrict__ y,
                                                    int C, int N, int HW) {
    const float inv = 1.0f / (float)HW;
    for (long long i = global_thread(); i < (long long)C * N; i += grid_threads()) {
        const int c = (int)(i % C), n = (int)(i / C);
        const T* plane = x + ((long long)c * N + n) * HW;
        float sum = 0.0f;
        for (int e = 0; e < HW; ++e) sum += to_f32(plane[e]);
        y[i] = from_f32<T>(sum * inv);
    }
}

// dx[c, n, ·] = dy[n, c] / HW. Any grid.
template <class T>
__device__ __forceinline__ void global_avg_bwd_impl(const T* __restrict__ dy, T* __restrict__ dx,
                                                    int C, int N, int HW) {
    const float inv = 1.0f / (float)HW;
    const long long total = (long long)C * N * HW;
    for (long long i = global_thread(); i < total; i += grid_threads()) {
        const long long cn = i / HW;
        const int n = (int)(cn % N), c = (int)(cn / N);
        dx[i] = from_f32<T>(to_f32(dy[(long long)n * C + c]) * inv);
    }
}

extern "C" __global__ void __launch_bounds__(256)
global_avg_fwd_f32(const float* x, float* y, int C, int N, int HW) { global_avg_fwd_impl(x, y, C, N, HW); }
extern "C" __global__ void __launch_bounds__(256)
global_avg_fwd_bf16(const bf16* x, bf16* y, int C, int N, int HW) { global_avg_fwd_impl(x, y, C, N, HW); }
extern "C" __global__ void __launch_bounds__(256)
global_avg_fwd_f16(const f16* x, f16* y, int C, int N, int HW) { global_avg_fwd_impl(x, y, C, N, HW); }
extern "C" __global__ void __launch_bounds__(256)
global_avg_bwd_f32(const float* dy, float* dx, int C, int N, int HW) { global_avg_bwd_impl(dy, dx, C, N, HW); }
extern "C" __global__ void __launch_bounds__(256)
global_avg_bwd_bf16(const bf16* dy, bf16* dx, int C, int N, int HW) { global_avg_bwd_impl(dy, dx, C, N, HW); }
extern "C" __global__ void __launch_bounds__(256)
global_avg_bwd_f16(const f16* dy, f16* dx, int C, int N, int HW) { global_avg_bwd_impl(dy, dx, C, N, HW); }
