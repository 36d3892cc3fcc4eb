// embedding.cu: token (+ position) embedding and its deterministic backward. See ABI.md.
//
// All three kernels work on float4 chunks of a row when d is a multiple of 4 and the
// buffers are 16-byte aligned (row starts are then aligned too), else element by element.
// The backward needs no atomics: the host groups the token rows by id (a stable counting
// sort), so one block owns each distinct id's gradient row; each position's gradient row is
// owned by the threads of its columns. Sums run in increasing row order.

// ---------------------------------------------------------------------------------------
// Forward: any grid over tokens·d (or tokens·d/4 chunks). A null `wpe` means no position
// table (Llama's token-only embedding: positions come from the rotary pass): y = wte[id];
// `pos_of` and `seq` are then not read. A negative id is a token outside this table (a
// vocabulary-parallel rank's share): its row of the table part is zero.

template <bool POSITIONS>
__device__ __forceinline__ void embedding_fwd_impl(const int* __restrict__ ids,
                                                   const float* __restrict__ wte,
                                                   const float* __restrict__ wpe,
                                                   const int* __restrict__ pos_of,
                                                   float* __restrict__ y, int tokens, int seq,
                                                   int d) {
    const long long t = global_thread(), stride = grid_threads();
    const long long n = (long long)tokens * d;
    if ((d & 3) == 0 && is_aligned(wte, 16) && is_aligned(wpe, 16) && is_aligned(y, 16)) {
        const int d4 = d >> 2;
        const float4* te = reinterpret_cast<const float4*>(wte);
        const float4* pe = reinterpret_cast<const float4*>(wpe);
        float4* y4 = reinterpret_cast<float4*>(y);
        for (long long i = t; i < n / 4; i += stride) {
            const int tok = (int)(i / d4), c4 = (int)(i - (long long)tok * d4);
            const int id = ids[tok];
            const float4 a = id < 0 ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                                    : te[(long long)id * d4 + c4];
            if constexpr (POSITIONS) {
                const float4 b = pe[(long long)pos_of[tok % seq] * d4 + c4];
                y4[i] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
            } else {
                y4[i] = a;
            }
        }
    } else {
        for (long long i = t; i < n; i += stride) {
            const int tok = (int)(i / d), c = (int)(i - (long long)tok * d);
            const int id = ids[tok];
            const float a = id < 0 ? 0.0f : wte[(long long)id * d + c];
            if constexpr (POSITIONS) {
                y[i] = a + wpe[(long long)pos_of[tok % seq] * d + c];
            } else {
                y[i] = a;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
embedding_fwd(const int* ids, const float* wte, const float* wpe, const int* pos_of, float* y,
              int tokens, int seq, int d) {
    if (wpe != nullptr) {
        embedding_fwd_impl<true>(ids, wte, wpe, pos_of, y, tokens, seq, d);
    } else {
        embedding_fwd_impl<false>(ids, wte, wpe, pos_of, y, tokens, seq, d);
    }
}

// ---------------------------------------------------------------------------------------
// Token gradient: block per distinct id (grid-stride over them), threads over the columns.
// dwte[id] += Σ_k dy[order[k]] for k = starts[u] .. starts[u+1]-1 in order (the sum first,
// then one add into the gradient). Rows are loaded 16 ahead of the adds: a very frequent id
// (",", "the": 3-7% of the tokens) makes one block sum ~1000 rows, and the loads it has in
// flight set the whole kernel's time. __launch_bounds__(256, 2) lets ptxas keep all 16 in
// registers (left alone it settles at 40 registers and serialises them). Measured with 16384
// tokens, d = 768, ids ~ U^4 (the top id 7% of the tokens): 101 us on an H100, 95 us on an
// H200, against 338 us (H100) with 8 rows ahead at 40 registers; Zipf(1) ids 109 us (H200).
// The price is occupancy when every id is rare: uniform ids take 105 us (H200) where 75 us
// is possible; real text is Zipfian.

#define EMB_BATCH 16

extern "C" __global__ void __launch_bounds__(256, 2)
embedding_bwd_tokens(const float* __restrict__ dy, const int* __restrict__ order,
                     const int* __restrict__ starts, const int* __restrict__ uniq,
                     float* __restrict__ dwte, const int* __restrict__ uniq_count, int d) {
    const bool vec = (d & 3) == 0 && is_aligned(dy, 16) && is_aligned(dwte, 16);
    // The count is read from device memory (the host writes it beside `starts`): the launch
    // is then the same for every batch of a shape, as a captured CUDA graph replays it, and
    // blocks past the count have nothing to do.
    const int count = *uniq_count;
    for (int u = blockIdx.x; u < count; u += gridDim.x) {
        const int k0 = starts[u], k1 = starts[u + 1];
        float* out = dwte + (long long)uniq[u] * d;
        if (vec) {
            const int d4 = d >> 2;
            for (int c4 = threadIdx.x; c4 < d4; c4 += blockDim.x) {
                float4* o = reinterpret_cast<float4*>(out) + c4;
                const float4 prev = *o;  // in flight with the first rows
                float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                int k = k0;
                for (; k + EMB_BATCH <= k1; k += EMB_BATCH) {
                    float4 v[EMB_BATCH];
#pragma unroll
                    for (int b = 0; b < EMB_BATCH; ++b)
                        v[b] = reinterpret_cast<const float4*>(dy + (long long)order[k + b] * d)
                                   [c4];
#pragma unroll
                    for (int b = 0; b < EMB_BATCH; ++b) {
                        s.x += v[b].x; s.y += v[b].y; s.z += v[b].z; s.w += v[b].w;
                    }
                }
                for (; k < k1; ++k) {
                    const float4 v =
                        reinterpret_cast<const float4*>(dy + (long long)order[k] * d)[c4];
                    s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
                }
                *o = make_float4(prev.x + s.x, prev.y + s.y, prev.z + s.z, prev.w + s.w);
            }
        } else {
            for (int c = threadIdx.x; c < d; c += blockDim.x) {
                float s = 0.0f;
                for (int k = k0; k < k1; ++k) s += dy[(long long)order[k] * d + c];
                out[c] += s;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Position gradient: any grid over seq·d (or seq·d/4 chunks); each element sums its column
// over the batch, b increasing, then adds into dwpe[pos_of[p]]. (pos_of must not map two
// positions to one row: that row would have two writers.) Batch rows are loaded 4 ahead: the
// grid already has seq·d/4 independent threads. (256, 6): left alone ptxas squeezes this
// kernel into 32 registers and spills a few bytes; 40 fit without.

#define EMB_POS_BATCH 4

extern "C" __global__ void __launch_bounds__(256, 6)
embedding_bwd_positions(const float* __restrict__ dy, const int* __restrict__ pos_of,
                        float* __restrict__ dwpe, int batch, int seq, int d) {
    const long long t = global_thread(), stride = grid_threads();
    const long long n = (long long)seq * d;
    const long long row_stride = (long long)seq * d;  // from batch b to b+1
    if ((d & 3) == 0 && is_aligned(dy, 16) && is_aligned(dwpe, 16)) {
        const int d4 = d >> 2;
        for (long long i = t; i < n / 4; i += stride) {
            const int p = (int)(i / d4), c4 = (int)(i - (long long)p * d4);
            const float* col = dy + 4 * i;
            float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            int b = 0;
            for (; b + EMB_POS_BATCH <= batch; b += EMB_POS_BATCH) {
                float4 v[EMB_POS_BATCH];
#pragma unroll
                for (int k = 0; k < EMB_POS_BATCH; ++k)
                    v[k] = *reinterpret_cast<const float4*>(col + (long long)(b + k) * row_stride);
#pragma unroll
                for (int k = 0; k < EMB_POS_BATCH; ++k) {
                    s.x += v[k].x; s.y += v[k].y; s.z += v[k].z; s.w += v[k].w;
                }
            }
            for (; b < batch; ++b) {
                const float4 v = *reinterpret_cast<const float4*>(col + (long long)b * row_stride);
                s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
            }
            float4* o = reinterpret_cast<float4*>(dwpe + (long long)pos_of[p] * d) + c4;
            const float4 prev = *o;
            *o = make_float4(prev.x + s.x, prev.y + s.y, prev.z + s.z, prev.w + s.w);
        }
    } else {
        for (long long i = t; i < n; i += stride) {
            const int p = (int)(i / d), c = (int)(i - (long long)p * d);
            float s = 0.0f;
            for (int b = 0; b < batch; ++b) s += dy[i + (long long)b * row_stride];
            dwpe[(long long)pos_of[p] * d + c] += s;
        }
    }
}
