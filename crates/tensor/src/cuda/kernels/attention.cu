// Causal self-attention that never stores the T×T scores (FlashAttention-2's algorithm):
// forward keeps the output and each row's log-sum-exp; backward recomputes score tiles.
//
// Layout: qkv is [B, T, 3·D] (q, k, v; head h at columns h·HD..), out/dout [B, T, D],
// lse [B, H, T] (natural log of Σ_k exp(scale·q·k)), D_rows [B, H, T] = Σ_d dout·out.
//
// 16-bit inputs (bf16, f16) run on tensor cores through WMMA: a block of 4 warps owns a
// 64-row tile (16 rows a warp); score tiles go through shared memory (f32), where the
// online softmax reads them by row, and probabilities go back to shared memory in 16 bits as
// the next product's input. Backward is two kernels so that no gradient is summed with
// atomics (two runs are bit-identical): one per key tile (dK, dV over the query tiles at or
// below the diagonal), one per query tile (dQ over the key tiles up to the diagonal). f32
// inputs run exact SIMT kernels (a warp per row) for the CPU comparison and f32 training.
//
// Shared-memory layout (bytes; Rust's ops::attention_smem computes the same): 16-bit tiles
// of 64 rows × (HD + 8) (the padding keeps rows off each other's banks and keeps every
// 16-row fragment 32-byte aligned), an f32 tile of 64 × (max(64, HD) + 4), 16-bit score
// tiles of 64 × 72, and 64-float rows.

namespace attn {

constexpr int TILE = 64;     // query rows (and keys) per tile
constexpr int THREADS = 128; // 4 warps × 16 rows
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

template <int HD> struct Dims {
    static constexpr int LDH = HD + 8;                         // 16-bit tile row
    static constexpr int LDS = (HD > TILE ? HD : TILE) + 4;    // f32 tile row
    static constexpr int LDP = TILE + 8;                       // 16-bit score row
    static constexpr int HALF_TILE = TILE * LDH;               // elements
    static constexpr int F32_TILE = TILE * LDS;                // elements
    static constexpr int SCORE_TILE = TILE * LDP;              // elements
};

__device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(f16 v) { return __half2float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ bf16 from_float<bf16>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ f16 from_float<f16>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }

// Loads rows r0..r0+TILE of one head (HD values from `src`, rows `stride` apart) into a
// shared tile with rows `ld` apart; rows at or past `rows` are zero (so padded keys and
// values contribute exact zeros, never garbage). 16-byte accesses: HD, the row stride and
// the head offset are multiples of 8 elements, buffers 256-byte aligned.
template <typename T, int HD>
__device__ __forceinline__ void load_tile(T* dst, int ld, const T* src, long long stride, int r0,
                                          int rows) {
    constexpr int VECS = HD / 8; // 16-byte vectors per row
    for (int v = threadIdx.x; v < TILE * VECS; v += THREADS) {
        const int r = v / VECS, c = (v % VECS) * 8;
        uint4 value = make_uint4(0, 0, 0, 0);
        if (r0 + r < rows) {
            value = *reinterpret_cast<const uint4*>(src + (long long)(r0 + r) * stride + c);
        }
        *reinterpret_cast<uint4*>(dst + r * ld + c) = value;
    }
}

// Writes rows r0.. of an f32 tile (rows `ld` apart) times `scale` to one head's columns of a
// 16-bit tensor, skipping rows at or past `rows`.
template <typename T, int HD>
__device__ __forceinline__ void store_tile(T* dst, long long stride, const float* src, int ld,
                                           int r0, int rows, float scale) {
    for (int v = threadIdx.x; v < TILE * HD / 2; v += THREADS) {
        const int r = v / (HD / 2), c = (v % (HD / 2)) * 2;
        if (r0 + r < rows) {
            T* out = dst + (long long)(r0 + r) * stride + c;
            out[0] = from_float<T>(src[r * ld + c] * scale);
            out[1] = from_float<T>(src[r * ld + c + 1] * scale);
        }
    }
}

using namespace nvcuda;

// acc[j] (16 rows × 16 columns j) += A (16 × K, row-major, lda) · B, for `NB` column tiles of
// B. B_T: B given as its transpose, row-major (`b + j·16·ldb` is row 16j of Bᵀ): the product
// with Kᵀ or Vᵀ reads K or V's rows directly. Otherwise B row-major (k rows, ldb apart).
template <typename T, int K, int NB, bool B_T>
__device__ __forceinline__ void mma_rows(wmma::fragment<wmma::accumulator, 16, 16, 16, float>* acc,
                                         const T* a, int lda, const T* b, int ldb) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::load_matrix_sync(fa, a + kk * 16, lda);
#pragma unroll
        for (int j = 0; j < NB; ++j) {
            if (B_T) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
                wmma::load_matrix_sync(fb, b + j * 16 * ldb + kk * 16, ldb);
                wmma::mma_sync(acc[j], fa, fb, acc[j]);
            } else {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
                wmma::load_matrix_sync(fb, b + kk * 16 * ldb + j * 16, ldb);
                wmma::mma_sync(acc[j], fa, fb, acc[j]);
            }
        }
    }
}

template <int NB>
__device__ __forceinline__ void zero(wmma::fragment<wmma::accumulator, 16, 16, 16, float>* acc) {
#pragma unroll
    for (int j = 0; j < NB; ++j) wmma::fill_fragment(acc[j], 0.0f);
}

template <int NB>
__device__ __forceinline__ void store_rows(float* dst, int ld,
                                           wmma::fragment<wmma::accumulator, 16, 16, 16, float>* acc) {
#pragma unroll
    for (int j = 0; j < NB; ++j) wmma::store_matrix_sync(dst + j * 16, acc[j], ld, wmma::mem_row_major);
}

// ---------------------------------------------------------------------------------------
// Forward: a block per (64-query tile, sample·head), latest tiles first (they have the most
// keys). Each lane owns half of one row of its warp's 16: the online-softmax statistics of
// that row, and the output columns half, half + 2, … (interleaved, so lanes of a warp touch
// different banks).
template <typename T, int HD>
__device__ void forward(const T* qkv, T* out, float* lse, int B, int Tn, int H, float scale) {
    using Dm = Dims<HD>;
    DYNAMIC_SMEM(unsigned char, smem);
    T* sQ = reinterpret_cast<T*>(smem);
    T* sK = sQ + Dm::HALF_TILE;
    T* sV = sK + Dm::HALF_TILE;
    float* sS = reinterpret_cast<float*>(sV + Dm::HALF_TILE);
    T* sP = reinterpret_cast<T*>(sS + Dm::F32_TILE);

    const int tile = gridDim.x - 1 - blockIdx.x;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const int q0 = tile * TILE;
    const int D = H * HD;
    const long long stride = 3LL * D;
    const T* base = qkv + (long long)b * Tn * stride + h * HD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = warp * 16 + lane / 2, half = lane % 2;
    const int qi = q0 + row;
    const float scale2 = scale * LOG2E; // scores in log2 units: exp2f is one instruction

    load_tile<T, HD>(sQ, Dm::LDH, base, stride, q0, Tn);
    float o[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) o[i] = 0.0f;
    float m = -INFINITY, l = 0.0f;

    const int last_key = min(q0 + TILE, Tn) - 1; // the block's last query sees keys ≤ it
    const int key_tiles = last_key / TILE + 1;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[(HD > TILE ? HD : TILE) / 16];
    for (int kt = 0; kt < key_tiles; ++kt) {
        const int k0 = kt * TILE;
        __syncthreads(); // everyone is done with the previous K and V
        load_tile<T, HD>(sK, Dm::LDH, base + D, stride, k0, Tn);
        load_tile<T, HD>(sV, Dm::LDH, base + 2 * D, stride, k0, Tn);
        __syncthreads();

        // S = Q·Kᵀ for this warp's 16 rows.
        zero<TILE / 16>(acc);
        mma_rows<T, HD, TILE / 16, true>(acc, sQ + warp * 16 * Dm::LDH, Dm::LDH, sK, Dm::LDH);
        store_rows<TILE / 16>(sS + warp * 16 * Dm::LDS, Dm::LDS, acc);
        __syncwarp();

        // Online softmax over this tile's keys of the row.
        float* srow = sS + row * Dm::LDS;
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < TILE / 2; ++j) {
            const int c = half + 2 * j, kj = k0 + c;
            const float s = (kj <= qi && kj < Tn) ? srow[c] * scale2 : -INFINITY;
            srow[c] = s;
            mx = fmaxf(mx, s);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float m_new = fmaxf(m, mx);
        const float m_base = (m_new == -INFINITY) ? 0.0f : m_new; // a fully masked row so far
        const float alpha = exp2f(m - m_base);
        float sum = 0.0f;
        T* prow = sP + row * Dm::LDP;
#pragma unroll
        for (int j = 0; j < TILE / 2; ++j) {
            const int c = half + 2 * j;
            const float p = exp2f(srow[c] - m_base);
            sum += p;
            prow[c] = from_float<T>(p);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * alpha + sum;
        m = m_new;
#pragma unroll
        for (int i = 0; i < HD / 2; ++i) o[i] *= alpha;
        __syncwarp();

        // O += P·V for the warp's rows, staged through its rows of sS.
        zero<HD / 16>(acc);
        mma_rows<T, TILE, HD / 16, false>(acc, sP + warp * 16 * Dm::LDP, Dm::LDP, sV, Dm::LDH);
        store_rows<HD / 16>(sS + warp * 16 * Dm::LDS, Dm::LDS, acc);
        __syncwarp();
#pragma unroll
        for (int i = 0; i < HD / 2; ++i) o[i] += srow[half + 2 * i];
    }

    // Normalise, stage the tile in sS and write it with whole rows per thread group.
    const float inv_l = 1.0f / l;
    __syncwarp();
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) sS[row * Dm::LDS + half + 2 * i] = o[i] * inv_l;
    if (half == 0 && qi < Tn) lse[((long long)b * H + h) * Tn + qi] = (m + log2f(l)) * LN2;
    __syncthreads();
    store_tile<T, HD>(out + (long long)b * Tn * D + h * HD, D, sS, Dm::LDS, q0, Tn, 1.0f);
}

// ---------------------------------------------------------------------------------------
// Backward, part 1: a block per (64-key tile, sample·head). Each warp owns 16 keys and
// accumulates their dK and dV in registers over the query tiles from the diagonal down:
//   Sᵀ = K·Qᵀ, Pᵀ = exp(scale·Sᵀ − lse), dV += Pᵀ·dO, dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ − D),
//   dK += dSᵀ·Q (× scale at the end).
template <typename T, int HD>
__device__ void backward_dkdv(const T* qkv, const T* dout, const float* lse, const float* Drows,
                              T* dqkv, int B, int Tn, int H, float scale) {
    using Dm = Dims<HD>;
    DYNAMIC_SMEM(unsigned char, smem);
    T* sK = reinterpret_cast<T*>(smem);
    T* sV = sK + Dm::HALF_TILE;
    T* sQ = sV + Dm::HALF_TILE;
    T* sdO = sQ + Dm::HALF_TILE;
    float* sS = reinterpret_cast<float*>(sdO + Dm::HALF_TILE);
    T* sP = reinterpret_cast<T*>(sS + Dm::F32_TILE);
    T* sdS = sP + Dm::SCORE_TILE;
    float* sL = reinterpret_cast<float*>(sdS + Dm::SCORE_TILE);
    float* sD = sL + TILE;

    const int k0 = blockIdx.x * TILE;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const int D = H * HD;
    const long long stride = 3LL * D;
    const T* base = qkv + (long long)b * Tn * stride + h * HD;
    const T* dbase = dout + (long long)b * Tn * D + h * HD;
    const float* lse_bh = lse + ((long long)b * H + h) * Tn;
    const float* D_bh = Drows + ((long long)b * H + h) * Tn;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = warp * 16 + lane / 2, half = lane % 2;
    const int kj = k0 + row;

    load_tile<T, HD>(sK, Dm::LDH, base + D, stride, k0, Tn);
    load_tile<T, HD>(sV, Dm::LDH, base + 2 * D, stride, k0, Tn);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> dK[HD / 16], dV[HD / 16];
    zero<HD / 16>(dK);
    zero<HD / 16>(dV);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[TILE / 16];
    float p[TILE / 2];

    const int q_tiles = (Tn + TILE - 1) / TILE;
    for (int qt = k0 / TILE; qt < q_tiles; ++qt) {
        const int q0 = qt * TILE;
        __syncthreads(); // everyone is done with the previous Q, dO, lse and D
        load_tile<T, HD>(sQ, Dm::LDH, base, stride, q0, Tn);
        load_tile<T, HD>(sdO, Dm::LDH, dbase, D, q0, Tn);
        for (int r = threadIdx.x; r < TILE; r += THREADS) {
            const bool valid = q0 + r < Tn;
            sL[r] = valid ? lse_bh[q0 + r] : INFINITY; // P = 0 for padded queries
            sD[r] = valid ? D_bh[q0 + r] : 0.0f;
        }
        __syncthreads();

        // Sᵀ = K·Qᵀ → Pᵀ (registers and sP).
        zero<TILE / 16>(acc);
        mma_rows<T, HD, TILE / 16, true>(acc, sK + warp * 16 * Dm::LDH, Dm::LDH, sQ, Dm::LDH);
        store_rows<TILE / 16>(sS + warp * 16 * Dm::LDS, Dm::LDS, acc);
        __syncwarp();
        float* srow = sS + row * Dm::LDS;
        T* prow = sP + row * Dm::LDP;
#pragma unroll
        for (int j = 0; j < TILE / 2; ++j) {
            const int c = half + 2 * j, qi = q0 + c;
            const bool valid = qi >= kj && qi < Tn && kj < Tn;
            p[j] = valid ? exp2f((srow[c] * scale - sL[c]) * LOG2E) : 0.0f;
            prow[c] = from_float<T>(p[j]);
        }
        __syncwarp();

        // dV += Pᵀ·dO.
        mma_rows<T, TILE, HD / 16, false>(dV, sP + warp * 16 * Dm::LDP, Dm::LDP, sdO, Dm::LDH);

        // dPᵀ = V·dOᵀ → dSᵀ.
        zero<TILE / 16>(acc);
        mma_rows<T, HD, TILE / 16, true>(acc, sV + warp * 16 * Dm::LDH, Dm::LDH, sdO, Dm::LDH);
        store_rows<TILE / 16>(sS + warp * 16 * Dm::LDS, Dm::LDS, acc);
        __syncwarp();
        T* dsrow = sdS + row * Dm::LDP;
#pragma unroll
        for (int j = 0; j < TILE / 2; ++j) {
            const int c = half + 2 * j;
            dsrow[c] = from_float<T>(p[j] * (srow[c] - sD[c]));
        }
        __syncwarp();

        // dK += dSᵀ·Q.
        mma_rows<T, TILE, HD / 16, false>(dK, sdS + warp * 16 * Dm::LDP, Dm::LDP, sQ, Dm::LDH);
    }

    T* out = dqkv + (long long)b * Tn * stride + h * HD;
    __syncthreads();
    store_rows<HD / 16>(sS + warp * 16 * Dm::LDS, Dm::LDS, dK);
    __syncthreads();
    store_tile<T, HD>(out + D, stride, sS, Dm::LDS, k0, Tn, scale);
    __syncthreads();
    store_rows<HD / 16>(sS + warp * 16 * Dm::LDS, Dm::LDS, dV);
    __syncthreads();
    store_tile<T, HD>(out + 2 * D, stride, sS, Dm::LDS, k0, Tn, 1.0f);
}

// Backward, part 2: a block per (64-query tile, sample·head), latest first. Each warp owns
// 16 queries and accumulates their dQ over the key tiles up to the diagonal:
//   S = Q·Kᵀ, P = exp(scale·S − lse), dP = dO·Vᵀ, dS = P∘(dP − D), dQ += dS·K (× scale).
template <typename T, int HD>
__device__ void backward_dq(const T* qkv, const T* dout, const float* lse, const float* Drows,
                            T* dqkv, int B, int Tn, int H, float scale) {
    using Dm = Dims<HD>;
    DYNAMIC_SMEM(unsigned char, smem);
    T* sQ = reinterpret_cast<T*>(smem);
    T* sdO = sQ + Dm::HALF_TILE;
    T* sK = sdO + Dm::HALF_TILE;
    T* sV = sK + Dm::HALF_TILE;
    float* sS = reinterpret_cast<float*>(sV + Dm::HALF_TILE);
    T* sdS = reinterpret_cast<T*>(sS + Dm::F32_TILE);
    float* sL = reinterpret_cast<float*>(sdS + Dm::SCORE_TILE);
    float* sD = sL + TILE;

    const int tile = gridDim.x - 1 - blockIdx.x;
    const int q0 = tile * TILE;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const int D = H * HD;
    const long long stride = 3LL * D;
    const T* base = qkv + (long long)b * Tn * stride + h * HD;
    const T* dbase = dout + (long long)b * Tn * D + h * HD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = warp * 16 + lane / 2, half = lane % 2;
    const int qi = q0 + row;

    load_tile<T, HD>(sQ, Dm::LDH, base, stride, q0, Tn);
    load_tile<T, HD>(sdO, Dm::LDH, dbase, D, q0, Tn);
    for (int r = threadIdx.x; r < TILE; r += THREADS) {
        const bool valid = q0 + r < Tn;
        sL[r] = valid ? lse[((long long)b * H + h) * Tn + q0 + r] : INFINITY;
        sD[r] = valid ? Drows[((long long)b * H + h) * Tn + q0 + r] : 0.0f;
    }
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> dQ[HD / 16];
    zero<HD / 16>(dQ);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[TILE / 16];
    float p[TILE / 2];

    const int last_key = min(q0 + TILE, Tn) - 1;
    const int key_tiles = last_key / TILE + 1;
    for (int kt = 0; kt < key_tiles; ++kt) {
        const int k0 = kt * TILE;
        __syncthreads();
        load_tile<T, HD>(sK, Dm::LDH, base + D, stride, k0, Tn);
        load_tile<T, HD>(sV, Dm::LDH, base + 2 * D, stride, k0, Tn);
        __syncthreads();
        const float lse_row = sL[row], d_row = sD[row];

        // S = Q·Kᵀ → P (registers).
        zero<TILE / 16>(acc);
        mma_rows<T, HD, TILE / 16, true>(acc, sQ + warp * 16 * Dm::LDH, Dm::LDH, sK, Dm::LDH);
        store_rows<TILE / 16>(sS + warp * 16 * Dm::LDS, Dm::LDS, acc);
        __syncwarp();
        float* srow = sS + row * Dm::LDS;
#pragma unroll
        for (int j = 0; j < TILE / 2; ++j) {
            const int c = half + 2 * j, kj = k0 + c;
            const bool valid = kj <= qi && kj < Tn && qi < Tn;
            p[j] = valid ? exp2f((srow[c] * scale - lse_row) * LOG2E) : 0.0f;
        }
        __syncwarp();

        // dP = dO·Vᵀ → dS.
        zero<TILE / 16>(acc);
        mma_rows<T, HD, TILE / 16, true>(acc, sdO + warp * 16 * Dm::LDH, Dm::LDH, sV, Dm::LDH);
        store_rows<TILE / 16>(sS + warp * 16 * Dm::LDS, Dm::LDS, acc);
        __syncwarp();
        T* dsrow = sdS + row * Dm::LDP;
#pragma unroll
        for (int j = 0; j < TILE / 2; ++j) {
            const int c = half + 2 * j;
            dsrow[c] = from_float<T>(p[j] * (srow[c] - d_row));
        }
        __syncwarp();

        // dQ += dS·K.
        mma_rows<T, TILE, HD / 16, false>(dQ, sdS + warp * 16 * Dm::LDP, Dm::LDP, sK, Dm::LDH);
    }

    __syncthreads();
    store_rows<HD / 16>(sS + warp * 16 * Dm::LDS, Dm::LDS, dQ);
    __syncthreads();
    store_tile<T, HD>(dqkv + (long long)b * Tn * stride + h * HD, stride, sS, Dm::LDS, q0, Tn,
                      scale);
}

// ---------------------------------------------------------------------------------------
// D = Σ_d dout·out per (sample, head, query): a warp per row.
template <typename T>
__device__ void backward_prep(const T* out, const T* dout, float* Drows, int HD, int B, int Tn,
                              int H) {
    const long long rows = (long long)B * H * Tn;
    const int lane = threadIdx.x % 32;
    const long long warps = (long long)gridDim.x * blockDim.x / 32;
    for (long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; w < rows;
         w += warps) {
        const int t = (int)(w % Tn);
        const long long bh = w / Tn;
        const int h = (int)(bh % H), b = (int)(bh / H);
        const long long at = ((long long)b * Tn + t) * H * HD + (long long)h * HD;
        float s = 0.0f;
        for (int d = lane; d < HD; d += 32) s += to_float(out[at + d]) * to_float(dout[at + d]);
        for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) Drows[w] = s;
    }
}

// ---------------------------------------------------------------------------------------
// f32: exact SIMT kernels, a warp per row (4 rows a block), lanes over the head's values.
__device__ __forceinline__ float warp_total(float v) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <int HD>
__device__ void forward_f32(const float* qkv, float* out, float* lse, int B, int Tn, int H,
                            float scale) {
    constexpr int PER = HD / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int qi = blockIdx.x * 4 + warp;
    if (qi >= Tn) return;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const int D = H * HD;
    const long long stride = 3LL * D;
    const float* base = qkv + (long long)b * Tn * stride + h * HD;
    float q[PER], o[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        q[i] = base[(long long)qi * stride + lane + 32 * i];
        o[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int kj = 0; kj <= qi; ++kj) {
        const float* k = base + (long long)kj * stride + D;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; ++i) s += q[i] * k[lane + 32 * i];
        s = warp_total(s) * scale;
        const float m_new = fmaxf(m, s);
        const float alpha = expf(m - m_new), p = expf(s - m_new);
        l = l * alpha + p;
        m = m_new;
        const float* v = k + D;
#pragma unroll
        for (int i = 0; i < PER; ++i) o[i] = o[i] * alpha + p * v[lane + 32 * i];
    }
    float* dst = out + ((long long)b * Tn + qi) * D + h * HD;
#pragma unroll
    for (int i = 0; i < PER; ++i) dst[lane + 32 * i] = o[i] / l;
    if (lane == 0) lse[((long long)b * H + h) * Tn + qi] = m + logf(l);
}

template <int HD>
__device__ void dkdv_f32(const float* qkv, const float* dout, const float* lse, const float* Drows,
                         float* dqkv, int B, int Tn, int H, float scale) {
    constexpr int PER = HD / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kj = blockIdx.x * 4 + warp;
    if (kj >= Tn) return;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const int D = H * HD;
    const long long stride = 3LL * D;
    const float* base = qkv + (long long)b * Tn * stride + h * HD;
    const float* dbase = dout + (long long)b * Tn * D + h * HD;
    const float* lse_bh = lse + ((long long)b * H + h) * Tn;
    const float* D_bh = Drows + ((long long)b * H + h) * Tn;
    float k[PER], v[PER], dk[PER], dv[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        k[i] = base[(long long)kj * stride + D + lane + 32 * i];
        v[i] = base[(long long)kj * stride + 2 * D + lane + 32 * i];
        dk[i] = dv[i] = 0.0f;
    }
    for (int qi = kj; qi < Tn; ++qi) {
        const float* q = base + (long long)qi * stride;
        const float* g = dbase + (long long)qi * D;
        float s = 0.0f, dp = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            s += q[lane + 32 * i] * k[i];
            dp += g[lane + 32 * i] * v[i];
        }
        s = warp_total(s);
        dp = warp_total(dp);
        const float p = expf(s * scale - lse_bh[qi]);
        const float ds = p * (dp - D_bh[qi]);
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            dv[i] += p * g[lane + 32 * i];
            dk[i] += ds * q[lane + 32 * i];
        }
    }
    float* dst = dqkv + ((long long)b * Tn + kj) * stride + h * HD;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        dst[D + lane + 32 * i] = dk[i] * scale;
        dst[2 * D + lane + 32 * i] = dv[i];
    }
}

template <int HD>
__device__ void dq_f32(const float* qkv, const float* dout, const float* lse, const float* Drows,
                       float* dqkv, int B, int Tn, int H, float scale) {
    constexpr int PER = HD / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int qi = blockIdx.x * 4 + warp;
    if (qi >= Tn) return;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const int D = H * HD;
    const long long stride = 3LL * D;
    const float* base = qkv + (long long)b * Tn * stride + h * HD;
    const float* g = dout + ((long long)b * Tn + qi) * D + h * HD;
    const float l = lse[((long long)b * H + h) * Tn + qi];
    const float dd = Drows[((long long)b * H + h) * Tn + qi];
    float q[PER], go[PER], dq[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        q[i] = base[(long long)qi * stride + lane + 32 * i];
        go[i] = g[lane + 32 * i];
        dq[i] = 0.0f;
    }
    for (int kj = 0; kj <= qi; ++kj) {
        const float* k = base + (long long)kj * stride + D;
        const float* v = k + D;
        float s = 0.0f, dp = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            s += q[i] * k[lane + 32 * i];
            dp += go[i] * v[lane + 32 * i];
        }
        s = warp_total(s);
        dp = warp_total(dp);
        const float ds = expf(s * scale - l) * (dp - dd);
#pragma unroll
        for (int i = 0; i < PER; ++i) dq[i] += ds * k[lane + 32 * i];
    }
    float* dst = dqkv + ((long long)b * Tn + qi) * stride + h * HD;
#pragma unroll
    for (int i = 0; i < PER; ++i) dst[lane + 32 * i] = dq[i] * scale;
}

} // namespace attn

// The exported kernels: attn_{fwd,dkdv,dq}_{bf16,f16,f32}_hd{32,64,128}, attn_bwd_prep_{t}.
#define ATTN_HALF(T, NAME, HD)                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        attn_fwd_##NAME##_hd##HD(const T* qkv, T* out, float* lse, int B, int Tn, int H,       \
                                 float scale) {                                                \
        attn::forward<T, HD>(qkv, out, lse, B, Tn, H, scale);                                  \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_dkdv_##NAME##_hd##HD(               \
        const T* qkv, const T* dout, const float* lse, const float* Drows, T* dqkv, int B,     \
        int Tn, int H, float scale) {                                                          \
        attn::backward_dkdv<T, HD>(qkv, dout, lse, Drows, dqkv, B, Tn, H, scale);              \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_dq_##NAME##_hd##HD(                 \
        const T* qkv, const T* dout, const float* lse, const float* Drows, T* dqkv, int B,     \
        int Tn, int H, float scale) {                                                          \
        attn::backward_dq<T, HD>(qkv, dout, lse, Drows, dqkv, B, Tn, H, scale);                \
    }

#define ATTN_F32(HD)                                                                           \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        attn_fwd_f32_hd##HD(const float* qkv, float* out, float* lse, int B, int Tn, int H,    \
                            float scale) {                                                     \
        attn::forward_f32<HD>(qkv, out, lse, B, Tn, H, scale);                                 \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_dkdv_f32_hd##HD(                    \
        const float* qkv, const float* dout, const float* lse, const float* Drows,             \
        float* dqkv, int B, int Tn, int H, float scale) {                                      \
        attn::dkdv_f32<HD>(qkv, dout, lse, Drows, dqkv, B, Tn, H, scale);                      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_dq_f32_hd##HD(                      \
        const float* qkv, const float* dout, const float* lse, const float* Drows,             \
        float* dqkv, int B, int Tn, int H, float scale) {                                      \
        attn::dq_f32<HD>(qkv, dout, lse, Drows, dqkv, B, Tn, H, scale);                        \
    }

ATTN_HALF(bf16, bf16, 32)
ATTN_HALF(bf16, bf16, 64)
ATTN_HALF(bf16, bf16, 128)
ATTN_HALF(f16, f16, 32)
ATTN_HALF(f16, f16, 64)
ATTN_HALF(f16, f16, 128)
ATTN_F32(32)
ATTN_F32(64)
ATTN_F32(128)

#define ATTN_PREP(T, NAME)                                                                     \
    extern "C" __global__ void attn_bwd_prep_##NAME(const T* out, const T* dout, float* Drows, \
                                                    int HD, int B, int Tn, int H, float scale) { \
        attn::backward_prep<T>(out, dout, Drows, HD, B, Tn, H);                                \
    }
ATTN_PREP(bf16, bf16)
ATTN_PREP(f16, f16)
ATTN_PREP(float, f32)
