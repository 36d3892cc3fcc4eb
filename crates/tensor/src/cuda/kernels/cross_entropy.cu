// cross_entropy.cu: fused softmax + cross-entropy over rows of logits, the gradient written
// over the logits, and the fixed-order sum of the per-row losses. See ABI.md; the formulas
// are the CPU's (crates/tensor/src/loss.rs).
//
// softmax_xent: block per row (grid-stride over rows), 512 threads. Two passes over the row
// instead of three: pass 1 keeps, per thread, a running max m, the first index attaining it,
// and s = Σ exp(x − m), rescaled by exp(m_old − m_new) whenever the max grows (an "online"
// softmax: the same Σ exp(x − max) up to rounding); the block then reduces the maxima, each
// thread rescales its s to the row max, and the block sums the s in a fixed order. Pass 2
// (if write_grad) writes (exp(x − m)·k) − [j = target]·grad_scale with k = grad_scale/s, the
// CPU's arrangement, walking the row backwards: its end, read last, is the part most likely
// still in L2 (on an H100, 16384 x 50304 bf16: 1567 -> 1395 us for loss + gradient).
// When v is a multiple of 8 and the logits are 16-byte aligned a thread reads 8 logits at a
// time (one 16-byte load of 16-bit values, two of f32), chunk j8 at thread j8 % 512, so a
// warp reads 512 (or 1024) contiguous bytes per step; else scalar.

struct ArgMax {
    float value;
    int index;
};

/// The larger value; on a tie the smaller index (the first occurrence, as the CPU's
/// strict `>` scan). NaN never wins (the CPU's `v > max` skips it too).
__device__ __forceinline__ ArgMax argmax_merge(ArgMax a, ArgMax b) {
    if (b.value > a.value || (b.value == a.value && b.index < a.index)) return b;
    return a;
}

/// Block-wide argmax in a fixed order (warp butterflies, then warp 0 over the warp results).
/// Every thread of the block must call it; every thread gets the result.
__device__ __forceinline__ ArgMax block_argmax(ArgMax v) {
    __shared__ float slot_value[32];
    __shared__ int slot_index[32];
    __shared__ ArgMax total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        ArgMax other;
        other.value = __shfl_xor_sync(0xffffffffu, v.value, o);
        other.index = __shfl_xor_sync(0xffffffffu, v.index, o);
        v = argmax_merge(v, other);
    }
    __syncthreads();
    if (lane == 0) {
        slot_value[warp] = v.value;
        slot_index[warp] = v.index;
    }
    __syncthreads();
    if (warp == 0) {
        ArgMax t;
        t.value = lane < warps ? slot_value[lane] : -INFINITY;
        t.index = lane < warps ? slot_index[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            ArgMax other;
            other.value = __shfl_xor_sync(0xffffffffu, t.value, o);
            other.index = __shfl_xor_sync(0xffffffffu, t.index, o);
            t = argmax_merge(t, other);
        }
        if (lane == 0) total = t;
    }
    __syncthreads();
    return total;
}

/// Folds the N values v at indices base, base+1, … into the running (best, s).
template <int N>
__device__ __forceinline__ void online_update(const float (&v)[N], int base, ArgMax& best,
                                              float& s) {
    // The chunk's own max and first index (NaN never wins a strict >), then one rescale
    // of s if the max grew.
    ArgMax c{-INFINITY, 0x7fffffff};
#pragma unroll
    for (int k = 0; k < N; ++k)
        if (v[k] > c.value) c = ArgMax{v[k], base + k};
    if (c.value > best.value) {
        // best.value may be −∞ (nothing seen yet): s is 0 then, and exp(−∞) = 0.
        s *= expf(best.value - c.value);
        best = c;
    }
#pragma unroll
    for (int k = 0; k < N; ++k) s += expf(v[k] - best.value);
}

template <class T>
__device__ __forceinline__ void softmax_xent_impl(T* __restrict__ logits,
                                                  const int* __restrict__ targets,
                                                  float* __restrict__ losses,
                                                  int* __restrict__ correct, int rows, int v,
                                                  float grad_scale, int write_grad) {
    const bool vec = (v & 7) == 0 && is_aligned(logits, 16);
    const int tid = threadIdx.x, threads = blockDim.x;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        T* row = logits + (long long)r * v;
        const int target = targets[r];
        // Read before any thread of the block overwrites the row in pass 2 (the block
        // reductions below are barriers between the two).
        const float x_target = to_f32(row[target]);
        ArgMax best{-INFINITY, 0x7fffffff};
        float s = 0.0f;
        if (vec) {
            const int v8 = v >> 3;
            int j8 = tid;
            // Two chunks per step: two independent 16-byte loads (four for f32) in flight.
            for (; j8 + threads < v8; j8 += 2 * threads) {
                float a[8], b[8];
                load8(row + 8 * j8, a);
                load8(row + 8 * (j8 + threads), b);
                online_update(a, 8 * j8, best, s);
                online_update(b, 8 * (j8 + threads), best, s);
            }
            if (j8 < v8) {
                float a[8];
                load8(row + 8 * j8, a);
                online_update(a, 8 * j8, best, s);
            }
        } else {
            for (int j = tid; j < v; j += threads) {
                const float a[1] = {to_f32(row[j])};
                online_update(a, j, best, s);
            }
        }
        const ArgMax top = block_argmax(best);
        const float m = top.value;
        // A row with no value above −∞: the CPU's scan reports index 0.
        const int arg = top.index == 0x7fffffff ? 0 : top.index;
        // To the row max; a thread that saw nothing has s = 0 (and best = −∞).
        s = best.value == -INFINITY ? 0.0f : s * expf(best.value - m);
        const float sum = block_sum(s);
        if (tid == 0) {
            losses[r] = (logf(sum) + m) - x_target;
            correct[r] = arg == target;
        }
        if (write_grad) {
            const float k = grad_scale / sum;
            if (vec) {
                // Backwards: the chunks pass 1 read last are the likeliest still in L2.
                const int v8 = v >> 3;
                const int last = tid < v8 ? tid + (v8 - 1 - tid) / threads * threads : -1;
                for (int j8 = last; j8 >= 0; j8 -= threads) {
                    float a[8];
                    load8(row + 8 * j8, a);
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        a[e] = expf(a[e] - m) * k;
                        if (8 * j8 + e == target) a[e] -= grad_scale;
                    }
                    store8(row + 8 * j8, a);
                }
            } else {
                const int last = tid < v ? tid + (v - 1 - tid) / threads * threads : -1;
                for (int j = last; j >= 0; j -= threads) {
                    float g = expf(to_f32(row[j]) - m) * k;
                    if (j == target) g -= grad_scale;
                    row[j] = from_f32<T>(g);
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(512)
softmax_xent_f32(float* logits, const int* targets, float* losses, int* correct, int rows,
                 int v, float grad_scale, int write_grad) {
    softmax_xent_impl(logits, targets, losses, correct, rows, v, grad_scale, write_grad);
}
extern "C" __global__ void __launch_bounds__(512)
softmax_xent_bf16(bf16* logits, const int* targets, float* losses, int* correct, int rows,
                  int v, float grad_scale, int write_grad) {
    softmax_xent_impl(logits, targets, losses, correct, rows, v, grad_scale, write_grad);
}
extern "C" __global__ void __launch_bounds__(512)
softmax_xent_f16(f16* logits, const int* targets, float* losses, int* correct, int rows,
                 int v, float grad_scale, int write_grad) {
    softmax_xent_impl(logits, targets, losses, correct, rows, v, grad_scale, write_grad);
}

/// One block of 256: out[0] += Σ losses (double), out[1] += Σ correct. Thread t takes rows
/// t, t+256, … in order, then the fixed-order block sum.
extern "C" __global__ void __launch_bounds__(256)
xent_sum(const float* __restrict__ losses, const int* __restrict__ correct, int rows,
         double* __restrict__ out) {
    double l = 0.0;
    long long c = 0;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        l += (double)losses[r];
        c += correct[r];
    }
    const double total_loss = block_sum_d(l);
    const double total_correct = block_sum_d((double)c);  // exact: counts < 2^53
    if (threadIdx.x == 0) {
        out[0] += total_loss;
        out[1] += total_correct;
    }
}

// ---------------------------------------------------------------------------------------
// Vocabulary-parallel cross-entropy (tensor parallelism's loss): each rank holds `cols`
// logits of a row (its share of the padded vocabulary), of which the first `real` are the
// real ids start..start+real (padding takes no part). Three kernels around two all-reduces
// of per-row numbers, never the logits (the CPU's arrangement, crates/parallel/src/tensor.rs):
//   vp_xent_max:    m[r] = max over the rank's real logits (then all-reduced with Max);
//   vp_xent_sums:   sums[r] = Σ exp(x − m[r]) over them, sums[rows + r] = the target's logit
//                   if the target is one of them, else 0 (then all-reduced with Sum);
//   vp_xent_finish: losses[r] = ln s + m − t, correct[r] = t ≥ m, and with write_grad the
//                   gradient over the logits, exp(x − m)·(grad_scale/s) − [j = target]·grad_scale
//                   (padding columns 0).
// Block per row (grid-stride over rows), 256 threads, fixed-order block reductions.

template <class T>
__device__ __forceinline__ void vp_xent_max_impl(const T* __restrict__ logits,
                                                 float* __restrict__ m, int rows, int cols,
                                                 int real) {
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = logits + (long long)r * cols;
        float v = -INFINITY;
        for (int j = threadIdx.x; j < real; j += blockDim.x) v = fmaxf(v, to_f32(row[j]));
        v = block_max(v);
        if (threadIdx.x == 0) m[r] = v;
    }
}

template <class T>
__device__ __forceinline__ void vp_xent_sums_impl(const T* __restrict__ logits,
                                                  const int* __restrict__ targets,
                                                  const float* __restrict__ m,
                                                  float* __restrict__ sums, int rows, int cols,
                                                  int real, int start) {
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = logits + (long long)r * cols;
        float s = 0.0f;
        for (int j = threadIdx.x; j < real; j += blockDim.x) s += expf(to_f32(row[j]) - m[r]);
        s = block_sum(s);
        if (threadIdx.x == 0) {
            const int local = targets[r] - start;
            sums[r] = s;
            sums[rows + r] = (local >= 0 && local < real) ? to_f32(row[local]) : 0.0f;
        }
    }
}

template <class T>
__device__ __forceinline__ void vp_xent_finish_impl(T* __restrict__ logits,
                                                    const int* __restrict__ targets,
                                                    const float* __restrict__ m,
                                                    const float* __restrict__ sums,
                                                    float* __restrict__ losses,
                                                    int* __restrict__ correct, int rows, int cols,
                                                    int real, int start, float grad_scale,
                                                    int write_grad) {
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float s = sums[r], t = sums[rows + r], mx = m[r];
        if (threadIdx.x == 0) {
            losses[r] = logf(s) + mx - t;
            correct[r] = t >= mx ? 1 : 0;
        }
        if (!write_grad) continue;
        T* row = logits + (long long)r * cols;
        const int local = targets[r] - start;
        const float k = grad_scale / s;
        for (int j = threadIdx.x; j < cols; j += blockDim.x) {
            float g = 0.0f;
            if (j < real) {
                g = expf(to_f32(row[j]) - mx) * k;
                if (j == local) g -= grad_scale;
            }
            row[j] = from_f32<T>(g);
        }
    }
}

#define VP_XENT(T, NAME)                                                                       \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        vp_xent_max_##NAME(const T* logits, float* m, int rows, int cols, int real) {          \
        vp_xent_max_impl(logits, m, rows, cols, real);                                         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        vp_xent_sums_##NAME(const T* logits, const int* targets, const float* m, float* sums,  \
                            int rows, int cols, int real, int start) {                         \
        vp_xent_sums_impl(logits, targets, m, sums, rows, cols, real, start);                  \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) vp_xent_finish_##NAME(                   \
        T* logits, const int* targets, const float* m, const float* sums, float* losses,       \
        int* correct, int rows, int cols, int real, int start, float grad_scale,               \
        int write_grad) {                                                                      \
        vp_xent_finish_impl(logits, targets, m, sums, losses, correct, rows, cols, real, start, \
                            grad_scale, write_grad);                                           \
    }
VP_XENT(float, f32)
VP_XENT(bf16, bf16)
VP_XENT(f16, f16)
