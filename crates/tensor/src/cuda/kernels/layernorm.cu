// layernorm.cu: layer norm over rows of the fp32 residual stream. See ABI.md; the formulas
// and their order are the CPU's (crates/tensor/src/norm.rs).
//
// Forward and input gradient: one warp per row (block 256 = 8 rows, grid ceil(rows/8); the
// kernels also loop with a grid stride over rows, so any grid works). When d is a multiple
// of 4, at most 4·32·LN_MAX_CHUNKS (1024), and the buffers are aligned, each lane keeps its
// float4 chunks (j = lane, lane+32, …) of the row in registers: the row is read from memory
// once, and every chunk load is issued before the first use, so a lane has up to 8 (16 in
// backward) 16-byte loads in flight. Otherwise a scalar path re-reads the row (from L1/L2)
// for each pass. Row sums: each lane adds its elements in order, then the warp butterfly.
//
// Parameter gradients: the column scheme of bias.cu (one thread per column of a
// rows_per_block block of rows, rows in increasing order), with colsum_finish as stage 2.
//
// Residual add fused into the forward (layernorm_fwd_add_*): the norm beginning a block's
// second branch reads the stream x and the first branch's output h, and writes their sum (the
// stream's new value) beside its output: one pass where the add and the norm took two, and
// one read of the sum fewer.
//
// Fused backward (layernorm_bwd_fused_*): the input gradient and the parameter gradients'
// stage 1 in one pass over x and dy, where the vector path applies (the host launches it then,
// and the two kernels above otherwise): common.cuh's norm_bwd_fused_impl, shared with the RMS
// norm. What it saves: the parameter kernel's second read of x (f32) and dy.

#define LN_MAX_CHUNKS 8

// ---------------------------------------------------------------------------------------
// Forward.

// With `h` (layernorm_fwd_add_*), the row normalised is x + h, stored at `sum`
// (common.cuh's norm_row_in); without (h = sum = null), x's.
template <class T>
__device__ __forceinline__ void layernorm_fwd_impl(const float* __restrict__ x,
                                                   const T* __restrict__ h,
                                                   float* __restrict__ sum,
                                                   const float* __restrict__ gamma,
                                                   const float* __restrict__ beta,
                                                   T* __restrict__ y, float* __restrict__ mean_out,
                                                   float* __restrict__ rstd_out, int rows, int d,
                                                   float eps) {
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const float d_f = (float)d;  // divided by (not multiplied by 1/d), as the CPU
    const bool vec = (d & 3) == 0 && d <= 128 * LN_MAX_CHUNKS && is_aligned(x, 16) &&
                     is_aligned(gamma, 16) && is_aligned(beta, 16) &&
                     is_aligned(y, 4 * sizeof(T)) && is_aligned(h, 4 * sizeof(T)) &&
                     is_aligned(sum, 16);
    for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < rows;
         row += gridDim.x * warps) {
        const long long at = (long long)row * d;
        T* yr = y + at;
        float mean, rstd;
        if (vec) {
            const int d4 = d >> 2;
            float4 v[LN_MAX_CHUNKS];
            norm_row_in<T, LN_MAX_CHUNKS>(x + at, row_or_null(h, at), row_or_null(sum, at), v, d4,
                                          lane);
            float s = 0.0f;
#pragma unroll
            for (int k = 0; k < LN_MAX_CHUNKS; ++k) {
                if (lane + 32 * k < d4) {
                    s += v[k].x; s += v[k].y; s += v[k].z; s += v[k].w;
                }
            }
            mean = warp_sum(s) / d_f;
            float q = 0.0f;
#pragma unroll
            for (int k = 0; k < LN_MAX_CHUNKS; ++k) {
                if (lane + 32 * k < d4) {
                    const float a = v[k].x - mean, b = v[k].y - mean, c = v[k].z - mean,
                                e = v[k].w - mean;
                    q += a * a; q += b * b; q += c * c; q += e * e;
                }
            }
            const float var = warp_sum(q) / d_f;
            rstd = 1.0f / sqrtf(var + eps);
#pragma unroll
            for (int k = 0; k < LN_MAX_CHUNKS; ++k) {
                const int j = lane + 32 * k;
                if (j < d4) {
                    const float4 g = reinterpret_cast<const float4*>(gamma)[j];
                    const float4 b = reinterpret_cast<const float4*>(beta)[j];
                    float o[4];
                    o[0] = (v[k].x - mean) * rstd * g.x + b.x;
                    o[1] = (v[k].y - mean) * rstd * g.y + b.y;
                    o[2] = (v[k].z - mean) * rstd * g.z + b.z;
                    o[3] = (v[k].w - mean) * rstd * g.w + b.w;
                    store4(yr + 4 * j, o);
                }
            }
        } else {
            const float* xr =
                norm_row_in_scalar(x + at, row_or_null(h, at), row_or_null(sum, at), d, lane);
            float s = 0.0f;
            for (int c = lane; c < d; c += 32) s += xr[c];
            mean = warp_sum(s) / d_f;
            float q = 0.0f;
            for (int c = lane; c < d; c += 32) {
                const float a = xr[c] - mean;
                q += a * a;
            }
            const float var = warp_sum(q) / d_f;
            rstd = 1.0f / sqrtf(var + eps);
            for (int c = lane; c < d; c += 32)
                yr[c] = from_f32<T>((xr[c] - mean) * rstd * gamma[c] + beta[c]);
        }
        if (lane == 0) {
            if (mean_out) mean_out[row] = mean;
            if (rstd_out) rstd_out[row] = rstd;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
layernorm_fwd_f32(const float* x, const float* gamma, const float* beta, float* y, float* mean,
                  float* rstd, int rows, int d, float eps) {
    layernorm_fwd_impl<float>(x, nullptr, nullptr, gamma, beta, y, mean, rstd, rows, d, eps);
}
extern "C" __global__ void __launch_bounds__(256)
layernorm_fwd_bf16(const float* x, const float* gamma, const float* beta, bf16* y, float* mean,
                   float* rstd, int rows, int d, float eps) {
    layernorm_fwd_impl<bf16>(x, nullptr, nullptr, gamma, beta, y, mean, rstd, rows, d, eps);
}
extern "C" __global__ void __launch_bounds__(256)
layernorm_fwd_f16(const float* x, const float* gamma, const float* beta, f16* y, float* mean,
                  float* rstd, int rows, int d, float eps) {
    layernorm_fwd_impl<f16>(x, nullptr, nullptr, gamma, beta, y, mean, rstd, rows, d, eps);
}

// The residual add before the norm, fused: sum = x + h (f32; the stream's new value), then
// the norm of sum. h is the branch's output, in the norm's output dtype.
extern "C" __global__ void __launch_bounds__(256)
layernorm_fwd_add_f32(const float* x, const float* h, float* sum, const float* gamma,
                      const float* beta, float* y, float* mean, float* rstd, int rows, int d,
                      float eps) {
    layernorm_fwd_impl<float>(x, h, sum, gamma, beta, y, mean, rstd, rows, d, eps);
}
extern "C" __global__ void __launch_bounds__(256)
layernorm_fwd_add_bf16(const float* x, const bf16* h, float* sum, const float* gamma,
                       const float* beta, bf16* y, float* mean, float* rstd, int rows, int d,
                       float eps) {
    layernorm_fwd_impl<bf16>(x, h, sum, gamma, beta, y, mean, rstd, rows, d, eps);
}
extern "C" __global__ void __launch_bounds__(256)
layernorm_fwd_add_f16(const float* x, const f16* h, float* sum, const float* gamma,
                      const float* beta, f16* y, float* mean, float* rstd, int rows, int d,
                      float eps) {
    layernorm_fwd_impl<f16>(x, h, sum, gamma, beta, y, mean, rstd, rows, d, eps);
}

// ---------------------------------------------------------------------------------------
// Input gradient: h = (x − mean)·rstd, g = dy·γ, dx = rstd·(g − Σg/d − h·Σ(g·h)/d).

template <class T>
__device__ __forceinline__ void layernorm_bwd_dx_impl(const float* __restrict__ x,
                                                      const float* __restrict__ gamma,
                                                      const float* __restrict__ mean,
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
                     is_aligned(gamma, 16) && is_aligned(dx, 16) &&
                     is_aligned(dy, 4 * sizeof(T)) && is_aligned(dx_low, 4 * sizeof(T));
    for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < rows;
         row += gridDim.x * warps) {
        const float* xr = x + (long long)row * d;
        const T* dyr = dy + (long long)row * d;
        float* dxr = dx + (long long)row * d;
        T* lowr = row_or_null(dx_low, (long long)row * d);
        const float mu = mean[row], rs = rstd[row];
        if (vec) {
            norm_bwd_row<T, true>(xr, dyr, dxr, lowr, gamma, mu, rs, d, lane, accumulate,
                                  nullptr);
        } else {
            float sg = 0.0f, sgh = 0.0f;
            for (int c = lane; c < d; c += 32) {
                const float g = to_f32(dyr[c]) * gamma[c];
                sg += g;
                sgh += g * ((xr[c] - mu) * rs);
            }
            const float mg = warp_sum(sg) / d_f;
            const float mgh = warp_sum(sgh) / d_f;
            for (int c = lane; c < d; c += 32) {
                const float g = to_f32(dyr[c]) * gamma[c];
                const float h = (xr[c] - mu) * rs;
                const float v = rs * (g - mg - h * mgh);
                const float out = accumulate ? dxr[c] + v : v;
                dxr[c] = out;
                if (lowr) lowr[c] = from_f32<T>(out);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
layernorm_bwd_dx_f32(const float* x, const float* gamma, const float* mean, const float* rstd,
                     const float* dy, float* dx, float* dx_low, int rows, int d, int accumulate) {
    layernorm_bwd_dx_impl(x, gamma, mean, rstd, dy, dx, dx_low, rows, d, accumulate);
}
extern "C" __global__ void __launch_bounds__(256)
layernorm_bwd_dx_bf16(const float* x, const float* gamma, const float* mean, const float* rstd,
                      const bf16* dy, float* dx, bf16* dx_low, int rows, int d, int accumulate) {
    layernorm_bwd_dx_impl(x, gamma, mean, rstd, dy, dx, dx_low, rows, d, accumulate);
}
extern "C" __global__ void __launch_bounds__(256)
layernorm_bwd_dx_f16(const float* x, const float* gamma, const float* mean, const float* rstd,
                     const f16* dy, float* dx, f16* dx_low, int rows, int d, int accumulate) {
    layernorm_bwd_dx_impl(x, gamma, mean, rstd, dy, dx, dx_low, rows, d, accumulate);
}

// ---------------------------------------------------------------------------------------
// Parameter gradients, stage 1: per block of rows and per column c, Σ dy·h (dγ) and Σ dy
// (dβ) in fp32, rows in increasing order; 8 rows loaded ahead (x, dy and the row's
// statistics, the latter a broadcast load shared by the warp). __launch_bounds__(256, 2)
// lets ptxas keep them all in registers (left alone it settles at 32 registers; measured
// on an H100: 35.6 -> 33.9 us for 16384x768 bf16).

#define LN_PARAM_BATCH 8

template <class T>
__device__ __forceinline__ void layernorm_bwd_params_impl(const float* __restrict__ x,
                                                          const float* __restrict__ mean,
                                                          const float* __restrict__ rstd,
                                                          const T* __restrict__ dy,
                                                          float* __restrict__ partial, int rows,
                                                          int d, int rows_per_block) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= d) return;
    const int r0 = blockIdx.y * rows_per_block;
    const int r1 = min(r0 + rows_per_block, rows);
    float sgh = 0.0f, sg = 0.0f;
    int r = r0;
    for (; r + LN_PARAM_BATCH <= r1; r += LN_PARAM_BATCH) {
        float xv[LN_PARAM_BATCH], gv[LN_PARAM_BATCH], mv[LN_PARAM_BATCH], rv[LN_PARAM_BATCH];
#pragma unroll
        for (int k = 0; k < LN_PARAM_BATCH; ++k) {
            const long long i = (long long)(r + k) * d + c;
            xv[k] = x[i];
            gv[k] = to_f32(dy[i]);
            mv[k] = mean[r + k];
            rv[k] = rstd[r + k];
        }
#pragma unroll
        for (int k = 0; k < LN_PARAM_BATCH; ++k) {
            const float h = (xv[k] - mv[k]) * rv[k];
            sgh += gv[k] * h;
            sg += gv[k];
        }
    }
    for (; r < r1; ++r) {
        const long long i = (long long)r * d + c;
        const float g = to_f32(dy[i]);
        const float h = (x[i] - mean[r]) * rstd[r];
        sgh += g * h;
        sg += g;
    }
    partial[((long long)blockIdx.y * 2 + 0) * d + c] = sgh;
    partial[((long long)blockIdx.y * 2 + 1) * d + c] = sg;
}

extern "C" __global__ void __launch_bounds__(256, 2)
layernorm_bwd_params_f32(const float* x, const float* mean, const float* rstd, const float* dy,
                         float* partial, int rows, int d, int rows_per_block) {
    layernorm_bwd_params_impl(x, mean, rstd, dy, partial, rows, d, rows_per_block);
}
extern "C" __global__ void __launch_bounds__(256, 2)
layernorm_bwd_params_bf16(const float* x, const float* mean, const float* rstd, const bf16* dy,
                          float* partial, int rows, int d, int rows_per_block) {
    layernorm_bwd_params_impl(x, mean, rstd, dy, partial, rows, d, rows_per_block);
}
extern "C" __global__ void __launch_bounds__(256, 2)
layernorm_bwd_params_f16(const float* x, const float* mean, const float* rstd, const f16* dy,
                         float* partial, int rows, int d, int rows_per_block) {
    layernorm_bwd_params_impl(x, mean, rstd, dy, partial, rows, d, rows_per_block);
}

// ---------------------------------------------------------------------------------------
// Fused backward: common.cuh's norm_bwd_fused_impl with the layer norm's arithmetic.

extern "C" __global__ void __launch_bounds__(256)
layernorm_bwd_fused_f32(const float* x, const float* gamma, const float* mean, const float* rstd,
                        const float* dy, float* dx, float* dx_low, float* partial, int rows, int d,
                        int accumulate) {
    norm_bwd_fused_impl<float, true>(x, gamma, mean, rstd, dy, dx, dx_low, partial, rows, d,
                                     accumulate);
}
extern "C" __global__ void __launch_bounds__(256)
layernorm_bwd_fused_bf16(const float* x, const float* gamma, const float* mean, const float* rstd,
                         const bf16* dy, float* dx, bf16* dx_low, float* partial, int rows, int d,
                         int accumulate) {
    norm_bwd_fused_impl<bf16, true>(x, gamma, mean, rstd, dy, dx, dx_low, partial, rows, d,
                                     accumulate);
}
extern "C" __global__ void __launch_bounds__(256)
layernorm_bwd_fused_f16(const float* x, const float* gamma, const float* mean, const float* rstd,
                        const f16* dy, float* dx, f16* dx_low, float* partial, int rows, int d,
                        int accumulate) {
    norm_bwd_fused_impl<f16, true>(x, gamma, mean, rstd, dy, dx, dx_low, partial, rows, d,
                                     accumulate);
}
