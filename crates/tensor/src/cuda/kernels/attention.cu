// Causal self-attention that never stores the T×T scores (FlashAttention-2's algorithm):
// forward keeps the output and each row's log-sum-exp; backward recomputes score tiles.
//
// Layout: qkv is [B, T, 3·D] (q, k, v; head h at columns h·HD..), out/dout [B, T, D],
// lse [B, H, T] (natural log of Σ_k exp(scale·q·k)), D_rows [B, H, T] = Σ_d dout·out.
//
// 16-bit inputs (bf16, f16) run on tensor cores with register-level fragments (mma.sync
// m16n8k16 with f32 accumulators, operands loaded from shared memory by ldmatrix): a block
// of 4 warps owns a 64-row tile, 16 rows a warp. Scores stay in registers: an accumulator
// fragment of S holds, per lane, the same (row, column) pairs that an A-operand fragment of
// P needs, so the online softmax runs on the accumulators and P feeds the next product
// without touching shared memory. The next key (or query) tile is copied in with cp.async
// while the current one is computed (two shared-memory buffers). Backward is two kernels so
// that no gradient is summed with atomics (two runs are bit-identical): one per key tile
// (dK, dV over the query tiles at or below the diagonal), one per query tile (dQ over the key
// tiles up to the diagonal). f32 inputs run exact SIMT kernels (a warp per row) for the CPU
// comparison and f32 training.
//
// Shared memory (Rust's ops::attention_smem computes the same): 16-bit tiles of 64 rows ×
// (HD + 8) values. The 16-byte padding puts the 8 rows an ldmatrix reads on distinct banks
// and keeps every row 16-byte aligned for cp.async. forward: Q + 2 K + 2 V tiles; dkdv: K, V
// + 2 Q + 2 dO tiles + 2 × 2 rows of 64 floats (lse, D); dq: Q, dO + 2 K + 2 V tiles.
//
// Fragment lane layouts (g = lane/4, c = 2·(lane%4)); PTX's, see prelude.cuh:
//   accumulator (16 × 8): [0], [1] = (row g, cols c, c+1); [2], [3] = (row g+8, cols c, c+1);
//   A (16 × 16): r0 = (g, c..c+1), r1 = (g+8, c..), r2 = (g, c+8..), r3 = (g+8, c+8..);
//   B (16 × 8, k × n): r0 = (k c..c+1, n g), r1 = (k c+8.., n g).

namespace attn {

constexpr int TILE = 64;     // query rows (and keys) per tile
constexpr int THREADS = 128; // 4 warps × 16 rows
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

__device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(f16 v) { return __half2float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }

template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<bf16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
template <> __device__ __forceinline__ unsigned pack2<f16>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// Queues rows r0..r0+TILE of one head (HD values from `src`, rows `stride` apart) into a
// shared tile with rows HD + 8 apart, 16 bytes per cp.async; rows at or past `rows` are
// zero-filled (padded keys and values contribute exact zeros, never garbage). HD, the row
// stride and the head offset are multiples of 8 values; buffers are 256-byte aligned.
template <typename T, int HD>
__device__ __forceinline__ void load_tile_async(T* dst, const T* src, long long stride, int r0,
                                                int rows) {
    constexpr int VECS = HD / 8, LD = HD + 8;
    for (int v = threadIdx.x; v < TILE * VECS; v += THREADS) {
        const int r = v / VECS, c = (v % VECS) * 8;
        const bool inside = r0 + r < rows;
        mt_cp_async_16(dst + r * LD + c, inside ? src + (long long)(r0 + r) * stride + c : src,
                       inside ? 16 : 0);
    }
}

// This lane's row address for an ldmatrix .x4 of the 16 × 16 block at (r0, c0) of a tile
// with rows `ld` apart, in the order of an A operand (rows r0.. are M, columns c0.. are K),
// or, with .trans, of the B operands of two n-tiles (rows r0.. are K, columns c0.. and
// c0 + 8.. the two n-tiles): registers 0, 1 feed n-tile 0 and 2, 3 n-tile 1.
template <typename T>
__device__ __forceinline__ const T* frag_rows(const T* tile, int ld, int r0, int c0, int lane) {
    return tile + (r0 + (lane & 15)) * ld + c0 + (lane >> 4) * 8;
}

// This lane's row address for an ldmatrix .x4 (no .trans) of the B operands of two n-tiles
// when the operand is stored transposed, n-major (rows n0..n0+15 are N, columns k0..k0+15
// are K; e.g. Kᵀ read from K's rows): registers 0, 1 feed n-tile 0 and 2, 3 n-tile 1.
template <typename T>
__device__ __forceinline__ const T* frag_cols(const T* tile, int ld, int n0, int k0, int lane) {
    return tile + (n0 + ((lane >> 4) << 3) + (lane & 7)) * ld + k0 + ((lane >> 3) & 1) * 8;
}

// acc[n] (16 × 8 accumulators, n over N/8 tiles) += A · B with A in registers (K/16 k-chunks
// of fragments) and B = Xᵀ for a shared tile X stored n-major (X's rows are B's columns):
// S = Q·Kᵀ, dPᵀ = V·dOᵀ, and the like.
template <typename T, int K, int N>
__device__ __forceinline__ void mma_a_xt(float (*acc)[4], const unsigned (*a)[4], const T* x,
                                         int ld, int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            unsigned b[4];
            mt_ldmatrix_x4(b, frag_cols(x, ld, np * 16, kk * 16, lane));
            mt_mma_16816<T>(acc[2 * np], a[kk], b);
            mt_mma_16816<T>(acc[2 * np + 1], a[kk], b + 2);
        }
    }
}

// acc[n] += A · X for a shared tile X stored k-major (rows are K, columns N): P·V, Pᵀ·dO,
// dS·K, dSᵀ·Q.
template <typename T, int K, int N>
__device__ __forceinline__ void mma_a_x(float (*acc)[4], const unsigned (*a)[4], const T* x,
                                        int ld, int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            unsigned b[4];
            mt_ldmatrix_x4_trans(b, frag_rows(x, ld, kk * 16, np * 16, lane));
            mt_mma_16816<T>(acc[2 * np], a[kk], b);
            mt_mma_16816<T>(acc[2 * np + 1], a[kk], b + 2);
        }
    }
}

// The A fragments of the warp's 16 rows (starting at row r0) of a shared tile, K = HD.
template <typename T, int HD>
__device__ __forceinline__ void load_rows(unsigned (*a)[4], const T* tile, int r0, int lane) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) mt_ldmatrix_x4(a[kk], frag_rows(tile, HD + 8, r0, kk * 16, lane));
}

// 16 × N accumulators as the A fragments of a 16 × N operand (N/16 k-chunks), rounded to T.
template <typename T, int N>
__device__ __forceinline__ void to_a(unsigned (*a)[4], const float (*acc)[4]) {
#pragma unroll
    for (int kc = 0; kc < N / 16; ++kc) {
        a[kc][0] = pack2<T>(acc[2 * kc][0], acc[2 * kc][1]);
        a[kc][1] = pack2<T>(acc[2 * kc][2], acc[2 * kc][3]);
        a[kc][2] = pack2<T>(acc[2 * kc + 1][0], acc[2 * kc + 1][1]);
        a[kc][3] = pack2<T>(acc[2 * kc + 1][2], acc[2 * kc + 1][3]);
    }
}

template <int N> __device__ __forceinline__ void zero(float (*acc)[4]) {
#pragma unroll
    for (int n = 0; n < N / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

// Writes the warp's 16 × HD accumulators (times `scale`) to rows r0.. of one head's columns
// of a 16-bit tensor (rows `stride` apart), skipping rows at or past `rows`: staged in the
// warp's own 16 rows of the shared tile `stage` (which no other warp reads), then copied out
// 16 bytes per access.
template <typename T, int HD>
__device__ __forceinline__ void store_rows(T* dst, long long stride, const float (*acc)[4],
                                           float scale, T* stage, int r0, int rows, int lane) {
    constexpr int LD = HD + 8;
    const int g = lane / 4, c = 2 * (lane % 4);
    __syncwarp();
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
        *reinterpret_cast<unsigned*>(stage + g * LD + 8 * n + c) =
            pack2<T>(acc[n][0] * scale, acc[n][1] * scale);
        *reinterpret_cast<unsigned*>(stage + (g + 8) * LD + 8 * n + c) =
            pack2<T>(acc[n][2] * scale, acc[n][3] * scale);
    }
    __syncwarp();
    for (int v = lane; v < 16 * HD / 8; v += 32) {
        const int r = v / (HD / 8), col = (v % (HD / 8)) * 8;
        if (r0 + r < rows) {
            *reinterpret_cast<uint4*>(dst + (long long)(r0 + r) * stride + col) =
                *reinterpret_cast<const uint4*>(stage + r * LD + col);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Forward: a block per (64-query tile, sample·head), latest tiles first (they have the most
// keys). Each warp: S = Q·Kᵀ for its 16 rows in registers, the online softmax on the
// accumulators (each row's 16 values of a lane, then the 4 lanes of the row), O += P·V.
// (Two 16-row m-tiles a warp, so that each K/V fragment read from shared memory feeds two
// products, took 240 registers, 2 blocks a multiprocessor instead of 3, and ran the GPT-2
// step's forward 7% slower on an H100; a generic version with an m-tile loop and a
// diagonal skip ran 15% slower even at one m-tile.)
template <typename T, int HD>
__device__ void forward(const T* qkv, T* out, float* lse, int B, int Tn, int H, float scale) {
    constexpr int LD = HD + 8, TILE_VALUES = TILE * LD;
    DYNAMIC_SMEM(unsigned char, smem);
    T* sQ = reinterpret_cast<T*>(smem);
    T* sK = sQ + TILE_VALUES; // two buffers
    T* sV = sK + 2 * TILE_VALUES;

    const int tile = gridDim.x - 1 - blockIdx.x;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const int q0 = tile * TILE;
    const int D = H * HD;
    const long long stride = 3LL * D;
    const T* base = qkv + (long long)b * Tn * stride + h * HD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    const int row0 = q0 + warp * 16 + g; // this lane's rows: row0 and row0 + 8
    const float scale2 = scale * LOG2E;  // scores in log2 units: exp2f is one instruction
    const int key_tiles = (min(q0 + TILE, Tn) - 1) / TILE + 1;

    load_tile_async<T, HD>(sQ, base, stride, q0, Tn);
    load_tile_async<T, HD>(sK, base + D, stride, 0, Tn);
    load_tile_async<T, HD>(sV, base + 2 * D, stride, 0, Tn);
    mt_cp_async_commit();

    unsigned qa[HD / 16][4];
    float o[HD / 8][4];
    zero<HD>(o);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    for (int kt = 0; kt < key_tiles; ++kt) {
        const int buf = kt & 1;
        if (kt + 1 < key_tiles) {
            const int nb = (buf ^ 1) * TILE_VALUES;
            load_tile_async<T, HD>(sK + nb, base + D, stride, (kt + 1) * TILE, Tn);
            load_tile_async<T, HD>(sV + nb, base + 2 * D, stride, (kt + 1) * TILE, Tn);
            mt_cp_async_commit();
            mt_cp_async_wait<1>();
        } else {
            mt_cp_async_wait<0>();
        }
        __syncthreads();
        if (kt == 0) load_rows<T, HD>(qa, sQ, warp * 16, lane);
        const T* K = sK + buf * TILE_VALUES;
        const T* V = sV + buf * TILE_VALUES;

        float s[TILE / 8][4];
        zero<TILE>(s);
        mma_a_xt<T, HD, TILE>(s, qa, K, LD, lane);

        // Scale, and mask on the last tile (the only one holding keys past the diagonal or
        // past the sequence: tiles are aligned, so earlier keys precede every row).
        const bool edge = kt == key_tiles - 1;
        const int k0 = kt * TILE;
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + 8 * j + c + (e & 1), row = row0 + (e >> 1) * 8;
                float v = s[j][e] * scale2;
                if (edge && (key > row || key >= Tn)) v = -INFINITY;
                s[j][e] = v;
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
        }
        float base_[2], alpha[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            const float m_new = fmaxf(m[i], mx[i]);
            base_[i] = m_new == -INFINITY ? 0.0f : m_new; // a fully masked row so far
            alpha[i] = exp2f(m[i] - base_[i]);
            m[i] = m_new;
        }
        float sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2f(s[j][e] - base_[e >> 1]);
                s[j][e] = p;
                sum[e >> 1] += p;
            }
        }
        // Each lane keeps its part of the row sums; the row's 4 lanes add them at the end.
        l[0] = l[0] * alpha[0] + sum[0];
        l[1] = l[1] * alpha[1] + sum[1];
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }
        unsigned pa[TILE / 16][4];
        to_a<T, TILE>(pa, s);
        mma_a_x<T, TILE, HD>(o, pa, V, LD, lane);
        __syncthreads(); // everyone is done with this buffer before it is refilled
    }

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    const float inv[2] = {1.0f / l[0], 1.0f / l[1]};
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
        o[n][0] *= inv[0];
        o[n][1] *= inv[0];
        o[n][2] *= inv[1];
        o[n][3] *= inv[1];
    }
    if (lane % 4 == 0) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if (row0 + 8 * i < Tn) lse[((long long)b * H + h) * Tn + row0 + 8 * i] = (m[i] + log2f(l[i])) * LN2;
        }
    }
    // The warp's own rows of sQ (only it read them, at kt = 0) stage the output.
    store_rows<T, HD>(out + (long long)b * Tn * D + h * HD, D, o, 1.0f,
                      sQ + warp * 16 * LD, q0 + warp * 16, Tn, lane);
}

// ---------------------------------------------------------------------------------------
// Backward, part 1: a block per (64-key tile, sample·head). Each warp owns 16 keys and
// accumulates their dK and dV in registers over the query tiles from the diagonal down:
//   Sᵀ = K·Qᵀ, Pᵀ = exp(scale·Sᵀ − lse), dV += Pᵀ·dO, dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ − D),
//   dK += dSᵀ·Q (× scale at the end).
template <typename T, int HD>
__device__ void backward_dkdv(const T* qkv, const T* dout, const float* lse, const float* Drows,
                              T* dqkv, int B, int Tn, int H, float scale) {
    constexpr int LD = HD + 8, TILE_VALUES = TILE * LD;
    DYNAMIC_SMEM(unsigned char, smem);
    T* sK = reinterpret_cast<T*>(smem);
    T* sV = sK + TILE_VALUES;
    T* sQ = sV + TILE_VALUES;      // two buffers
    T* sdO = sQ + 2 * TILE_VALUES; // two buffers
    float* sL = reinterpret_cast<float*>(sdO + 2 * TILE_VALUES); // two rows: lse · log2(e)
    float* sD = sL + 2 * TILE;                                   // two rows

    const int k0 = blockIdx.x * TILE;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const int D = H * HD;
    const long long stride = 3LL * D;
    const T* base = qkv + (long long)b * Tn * stride + h * HD;
    const T* dbase = dout + (long long)b * Tn * D + h * HD;
    const float* lse_bh = lse + ((long long)b * H + h) * Tn;
    const float* D_bh = Drows + ((long long)b * H + h) * Tn;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    const int key0 = k0 + warp * 16 + g; // this lane's keys: key0 and key0 + 8
    const float scale2 = scale * LOG2E;

    // The query tile's rows of lse and D (plain loads: a row's start need not be 16-byte
    // aligned); padded queries get lse = ∞, so P = 0.
    auto load_rows_of = [&](int slot, int q0) {
        for (int r = threadIdx.x; r < TILE; r += THREADS) {
            const bool valid = q0 + r < Tn;
            sL[slot * TILE + r] = valid ? lse_bh[q0 + r] * LOG2E : INFINITY;
            sD[slot * TILE + r] = valid ? D_bh[q0 + r] : 0.0f;
        }
    };
    const int qt0 = k0 / TILE, q_tiles = (Tn + TILE - 1) / TILE;
    load_tile_async<T, HD>(sK, base + D, stride, k0, Tn);
    load_tile_async<T, HD>(sV, base + 2 * D, stride, k0, Tn);
    load_tile_async<T, HD>(sQ, base, stride, k0, Tn);
    load_tile_async<T, HD>(sdO, dbase, D, k0, Tn);
    mt_cp_async_commit();
    load_rows_of(0, k0);

    float dk[HD / 8][4], dv[HD / 8][4];
    zero<HD>(dk);
    zero<HD>(dv);
    for (int qt = qt0; qt < q_tiles; ++qt) {
        const int buf = (qt - qt0) & 1;
        if (qt + 1 < q_tiles) {
            const int nb = (buf ^ 1) * TILE_VALUES;
            load_tile_async<T, HD>(sQ + nb, base, stride, (qt + 1) * TILE, Tn);
            load_tile_async<T, HD>(sdO + nb, dbase, D, (qt + 1) * TILE, Tn);
            mt_cp_async_commit();
            load_rows_of(buf ^ 1, (qt + 1) * TILE);
            mt_cp_async_wait<1>();
        } else {
            mt_cp_async_wait<0>();
        }
        __syncthreads();
        const T* Q = sQ + buf * TILE_VALUES;
        const T* dO = sdO + buf * TILE_VALUES;
        const float* L = sL + buf * TILE;
        const float* Dq = sD + buf * TILE;
        const int q0 = qt * TILE;

        // Sᵀ = K·Qᵀ → Pᵀ, in registers.
        float st[TILE / 8][4];
        zero<TILE>(st);
        {
            unsigned ka[HD / 16][4];
            load_rows<T, HD>(ka, sK, warp * 16, lane);
            mma_a_xt<T, HD, TILE>(st, ka, Q, LD, lane);
        }
        // The diagonal tile (the first) and the last one (padded queries) need the mask.
        const bool edge = qt == qt0 || q0 + TILE > Tn;
#pragma unroll
        for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int q = 8 * j + c + (e & 1), key = key0 + (e >> 1) * 8;
                float p = exp2f(st[j][e] * scale2 - L[q]);
                if (edge && (q0 + q < key || q0 + q >= Tn || key >= Tn)) p = 0.0f;
                st[j][e] = p;
            }
        }
        unsigned pa[TILE / 16][4];
        to_a<T, TILE>(pa, st);
        // dV += Pᵀ·dO.
        mma_a_x<T, TILE, HD>(dv, pa, dO, LD, lane);

        // dPᵀ = V·dOᵀ → dSᵀ = Pᵀ∘(dPᵀ − D).
        float dpt[TILE / 8][4];
        zero<TILE>(dpt);
        {
            unsigned va[HD / 16][4];
            load_rows<T, HD>(va, sV, warp * 16, lane);
            mma_a_xt<T, HD, TILE>(dpt, va, dO, LD, lane);
        }
#pragma unroll
        for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int q = 8 * j + c + (e & 1);
                dpt[j][e] = st[j][e] * (dpt[j][e] - Dq[q]);
            }
        }
        unsigned dsa[TILE / 16][4];
        to_a<T, TILE>(dsa, dpt);
        // dK += dSᵀ·Q.
        mma_a_x<T, TILE, HD>(dk, dsa, Q, LD, lane);
        __syncthreads(); // everyone is done with this buffer before it is refilled
    }

    // The warp's own rows of sK and sV (only it read them) stage dK and dV.
    T* out = dqkv + (long long)b * Tn * stride + h * HD;
    store_rows<T, HD>(out + D, stride, dk, scale, sK + warp * 16 * LD, k0 + warp * 16, Tn, lane);
    store_rows<T, HD>(out + 2 * D, stride, dv, 1.0f, sV + warp * 16 * LD, k0 + warp * 16, Tn,
                      lane);
}

// Backward, part 2: a block per (64-query tile, sample·head), latest first. Each warp owns
// 16 queries and accumulates their dQ over the key tiles up to the diagonal:
//   S = Q·Kᵀ, P = exp(scale·S − lse), dP = dO·Vᵀ, dS = P∘(dP − D), dQ += dS·K (× scale).
template <typename T, int HD>
__device__ void backward_dq(const T* qkv, const T* dout, const float* lse, const float* Drows,
                            T* dqkv, int B, int Tn, int H, float scale) {
    constexpr int LD = HD + 8, TILE_VALUES = TILE * LD;
    DYNAMIC_SMEM(unsigned char, smem);
    T* sQ = reinterpret_cast<T*>(smem);
    T* sdO = sQ + TILE_VALUES;
    T* sK = sdO + TILE_VALUES; // two buffers
    T* sV = sK + 2 * TILE_VALUES;

    const int tile = gridDim.x - 1 - blockIdx.x;
    const int q0 = tile * TILE;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const int D = H * HD;
    const long long stride = 3LL * D;
    const T* base = qkv + (long long)b * Tn * stride + h * HD;
    const T* dbase = dout + (long long)b * Tn * D + h * HD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    const int row0 = q0 + warp * 16 + g; // this lane's queries: row0 and row0 + 8
    const float scale2 = scale * LOG2E;
    float lse2[2], d_row[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = row0 + 8 * i;
        const long long at = ((long long)b * H + h) * Tn + r;
        lse2[i] = r < Tn ? lse[at] * LOG2E : INFINITY; // padded queries: P = 0
        d_row[i] = r < Tn ? Drows[at] : 0.0f;
    }
    const int key_tiles = (min(q0 + TILE, Tn) - 1) / TILE + 1;

    load_tile_async<T, HD>(sQ, base, stride, q0, Tn);
    load_tile_async<T, HD>(sdO, dbase, D, q0, Tn);
    load_tile_async<T, HD>(sK, base + D, stride, 0, Tn);
    load_tile_async<T, HD>(sV, base + 2 * D, stride, 0, Tn);
    mt_cp_async_commit();

    unsigned qa[HD / 16][4], doa[HD / 16][4];
    float dq[HD / 8][4];
    zero<HD>(dq);
    for (int kt = 0; kt < key_tiles; ++kt) {
        const int buf = kt & 1;
        if (kt + 1 < key_tiles) {
            const int nb = (buf ^ 1) * TILE_VALUES;
            load_tile_async<T, HD>(sK + nb, base + D, stride, (kt + 1) * TILE, Tn);
            load_tile_async<T, HD>(sV + nb, base + 2 * D, stride, (kt + 1) * TILE, Tn);
            mt_cp_async_commit();
            mt_cp_async_wait<1>();
        } else {
            mt_cp_async_wait<0>();
        }
        __syncthreads();
        if (kt == 0) {
            load_rows<T, HD>(qa, sQ, warp * 16, lane);
            load_rows<T, HD>(doa, sdO, warp * 16, lane);
        }
        const T* K = sK + buf * TILE_VALUES;
        const T* V = sV + buf * TILE_VALUES;
        const int k0 = kt * TILE;

        // S = Q·Kᵀ → P.
        float s[TILE / 8][4];
        zero<TILE>(s);
        mma_a_xt<T, HD, TILE>(s, qa, K, LD, lane);
        const bool edge = kt == key_tiles - 1;
#pragma unroll
        for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + 8 * j + c + (e & 1), row = row0 + (e >> 1) * 8;
                float p = exp2f(s[j][e] * scale2 - lse2[e >> 1]);
                if (edge && (key > row || key >= Tn)) p = 0.0f;
                s[j][e] = p;
            }
        }
        // dP = dO·Vᵀ → dS = P∘(dP − D).
        float dp[TILE / 8][4];
        zero<TILE>(dp);
        mma_a_xt<T, HD, TILE>(dp, doa, V, LD, lane);
#pragma unroll
        for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[j][e] = s[j][e] * (dp[j][e] - d_row[e >> 1]);
        }
        unsigned dsa[TILE / 16][4];
        to_a<T, TILE>(dsa, dp);
        // dQ += dS·K.
        mma_a_x<T, TILE, HD>(dq, dsa, K, LD, lane);
        __syncthreads(); // everyone is done with this buffer before it is refilled
    }

    // The warp's own rows of sQ (only it read them, at kt = 0) stage dQ.
    store_rows<T, HD>(dqkv + (long long)b * Tn * stride + h * HD, stride, dq, scale,
                      sQ + warp * 16 * LD, q0 + warp * 16, Tn, lane);
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
