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
// + 2 Q + 2 dO tiles + 2 × 2 rows of 64 floats (lse, D); dq: Q, dO + 2 K + 2 V tiles. The
// Hopper kernels (WarpgroupMma, below) hold the same tiles as unpadded core matrices.
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

// The same rows as a tile of core matrices (the wgmma kernels' B operands): 8 rows × 8
// values, 128 contiguous bytes each, row group-major: value (r, c) at
// ((r / 8) · HD / 8 + c / 8) · 64 + (r % 8) · 8 + c % 8. Eight consecutive threads fill one
// core matrix (one 16-byte chunk of 8 rows: conflict-free stores, 32-byte global sectors).
template <typename T, int HD>
__device__ __forceinline__ void load_tile_cm_async(T* dst, const T* src, long long stride, int r0,
                                                   int rows) {
    constexpr int CHUNKS = HD / 8;
    for (int v = threadIdx.x; v < TILE * CHUNKS; v += THREADS) {
        const int cm = v / 8, r = (cm / CHUNKS) * 8 + v % 8, c = (cm % CHUNKS) * 8;
        const bool inside = r0 + r < rows;
        mt_cp_async_16(dst + v * 8, inside ? src + (long long)(r0 + r) * stride + c : src,
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

// The two ways the kernels below run their products, chosen per kernel (`Mma`). Each block
// has its own tile or two (the rows its warps own: Q in the forward and dQ, K and V in
// dK/dV, and dO in dQ), the A operands of the products with Xᵀ; the double-buffered tiles
// that stream past them are the B operands; P and dS are A operands in registers.
//   SyncMma: every GPU; tiles with padded rows, fragments by ldmatrix (the own tiles' read
//     once into registers, `Rows`), mma.sync per warp.
//   WarpgroupMma: sm_90a (H100, H200); every tile of core matrices (load_tile_cm_async) that
//     the tensor cores read themselves, the own tiles too (`Rows` is the tile: no registers
//     held for them), one wgmma per 16-wide k-step for the block's 4 warps (a warpgroup, 64
//     rows). Shared memory written by cp.async is fenced for the async proxy before the
//     barrier that publishes it.
struct SyncMma {
    static constexpr bool PIPELINED = false;
    // Every tile (own or streamed) in one layout: values a tile, and its load.
    template <int HD> static __device__ constexpr int tile_values() { return TILE * (HD + 8); }
    template <typename T, int HD>
    static __device__ __forceinline__ void load(T* dst, const T* src, long long stride, int r0,
                                                int rows) {
        load_tile_async<T, HD>(dst, src, stride, r0, rows);
    }
    static __device__ __forceinline__ void publish() {}
    // The warp's 16 rows of an own tile as A fragments (K = HD columns).
    template <typename T, int K> struct Rows {
        unsigned f[K / 16][4];
    };
    template <typename T, int K>
    static __device__ __forceinline__ void rows_of(Rows<T, K>& r, const T* tile, int lane) {
        load_rows<T, K>(r.f, tile, (threadIdx.x / 32) * 16, lane);
    }
    // Where the warps stage their output rows at the end: each its own 16 rows of the own
    // tile (only it read them).
    template <typename T> static __device__ __forceinline__ T* staging(T* own, T*) {
        return own;
    }
    // acc += A · Xᵀ, X an N × K tile (rows K + 8 apart).
    template <typename T, int K, int N>
    static __device__ __forceinline__ void a_xt(float (*acc)[4], const Rows<T, K>& a, const T* x,
                                                int lane) {
        mma_a_xt<T, K, N>(acc, a.f, x, K + 8, lane);
    }
    // acc += A · X, X a K × N tile.
    template <typename T, int K, int N>
    static __device__ __forceinline__ void a_x(float (*acc)[4], const unsigned (*a)[4],
                                               const T* x, int lane) {
        mma_a_x<T, K, N>(acc, a, x, N + 8, lane);
    }
    // Two independent products acc1 += A1·X1ᵀ and acc2 += A2·X2ᵀ with `between()` after
    // the first (it may read acc1, and must not touch the second's operands).
    template <typename T, int K, int N, typename Between>
    static __device__ __forceinline__ void a_xt_pair(float (*acc1)[4], const Rows<T, K>& a1,
                                                     const T* x1, float (*acc2)[4],
                                                     const Rows<T, K>& a2, const T* x2,
                                                     int lane, Between&& between) {
        a_xt<T, K, N>(acc1, a1, x1, lane);
        between();
        a_xt<T, K, N>(acc2, a2, x2, lane);
    }
    // acc += A · X with `between()` after it (it must not touch the product's operands).
    template <typename T, int K, int N, typename Between>
    static __device__ __forceinline__ void a_x_then(float (*acc)[4], const unsigned (*a)[4],
                                                    const T* x, int lane, Between&& between) {
        a_x<T, K, N>(acc, a, x, lane);
        between();
    }
};

struct WarpgroupMma {
    // The forward overlaps each tile's softmax with the products (forward_tiles_pipelined).
    static constexpr bool PIPELINED = true;
    template <int HD> static __device__ constexpr int tile_values() { return TILE * HD; }
    template <typename T, int HD>
    static __device__ __forceinline__ void load(T* dst, const T* src, long long stride, int r0,
                                                int rows) {
        load_tile_cm_async<T, HD>(dst, src, stride, r0, rows);
    }
    static __device__ __forceinline__ void publish() { mt_fence_proxy_async(); }
    // An own tile as the A operand of the whole warpgroup, read from shared memory.
    template <typename T, int K> struct Rows {
        const T* tile;
    };
    template <typename T, int K>
    static __device__ __forceinline__ void rows_of(Rows<T, K>& r, const T* tile, int) {
        r.tile = tile;
    }
    // The own tiles are unpadded and still read by the other warps' products: the output is
    // staged in the streamed buffers (free once every warp is past its last product), 64
    // rows of HD + 8 values, which fit in two of them.
    template <typename T> static __device__ __forceinline__ T* staging(T*, T* streamed) {
        __syncthreads();
        return streamed;
    }
    // Issues acc += A · Xᵀ (A the own tile's rows, from shared memory; X's rows are B's
    // columns, n-major) as one commit group; the caller fences the registers first and waits
    // before reading acc. A and X alike: core matrices 128 bytes apart along K and a row
    // group's K / 8 of them (K · 16 bytes) apart along M or N; k-step kk starts 2 core
    // matrices on.
    template <typename T, int K, int N>
    static __device__ __forceinline__ void issue_a_xt(float (*acc)[4], const Rows<T, K>& a,
                                                      const T* x) {
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk)
            mt_wgmma_ss<T, N, 0>(acc, mt_wgmma_desc(a.tile + kk * 128, 128, K * 16),
                                 mt_wgmma_desc(x + kk * 128, 128, K * 16));
        mt_wgmma_commit();
    }
    // Issues acc += A · X (A in registers; X's rows are K, B transposed): row groups N · 16
    // bytes apart along K, core matrices 128 bytes apart along N; k-step kk starts 2 row
    // groups on.
    template <typename T, int K, int N>
    static __device__ __forceinline__ void issue_a_x(float (*acc)[4], const unsigned (*a)[4],
                                                     const T* x) {
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk)
            mt_wgmma<T, N, 1>(acc, a[kk], mt_wgmma_desc(x + kk * N * 16, N * 16, 128));
        mt_wgmma_commit();
    }
    // One product (`issue` issues it), waited for.
    template <int N, typename Issue>
    static __device__ __forceinline__ void product(float (*acc)[4], Issue&& issue) {
        mt_wgmma_hold<N>(acc);
        mt_wgmma_fence();
        issue();
        mt_wgmma_wait<0>();
        mt_wgmma_hold<N>(acc);
    }
    template <typename T, int K, int N>
    static __device__ __forceinline__ void a_xt(float (*acc)[4], const Rows<T, K>& a, const T* x,
                                                int) {
        product<N>(acc, [&] { issue_a_xt<T, K, N>(acc, a, x); });
    }
    template <typename T, int K, int N>
    static __device__ __forceinline__ void a_x(float (*acc)[4], const unsigned (*a)[4],
                                               const T* x, int) {
        product<N>(acc, [&] { issue_a_x<T, K, N>(acc, a, x); });
    }
    // Both products issued at once; `between()` runs once the first is done, while the
    // tensor cores still compute the second.
    template <typename T, int K, int N, typename Between>
    static __device__ __forceinline__ void a_xt_pair(float (*acc1)[4], const Rows<T, K>& a1,
                                                     const T* x1, float (*acc2)[4],
                                                     const Rows<T, K>& a2, const T* x2, int,
                                                     Between&& between) {
        mt_wgmma_hold<N>(acc1);
        mt_wgmma_hold<N>(acc2);
        mt_wgmma_fence();
        issue_a_xt<T, K, N>(acc1, a1, x1);
        issue_a_xt<T, K, N>(acc2, a2, x2);
        mt_wgmma_wait<1>();
        mt_wgmma_hold<N>(acc1);
        between();
        mt_wgmma_wait<0>();
        mt_wgmma_hold<N>(acc2);
    }
    // `between()` runs while the tensor cores compute acc += A · X.
    template <typename T, int K, int N, typename Between>
    static __device__ __forceinline__ void a_x_then(float (*acc)[4], const unsigned (*a)[4],
                                                    const T* x, int, Between&& between) {
        mt_wgmma_hold<N>(acc);
        mt_wgmma_fence();
        issue_a_x<T, K, N>(acc, a, x);
        between();
        mt_wgmma_wait<0>();
        mt_wgmma_hold<N>(acc);
    }
};


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
// Block pairs. Every kernel below works on one (sample, head)'s pair of a block of query
// rows and a block of key rows, each operand at its row 0 with rows `*_stride` values
// apart. A causal pair starts at the same sequence position on both sides (query i sees
// keys 0..=i, or under a sliding window of w only i + 1 − w..=i, Mistral's); any other
// pair's keys all precede its queries (every key is seen). The whole causal product over a
// fused [B, T, 3·D] activation is the pair (T, T, causal) of each sample's head
// ([`fused_pair`]); ring attention meets another rank's key/value block as such pairs
// ([`ring_pair`], never windowed).
template <typename T> struct Pair {
    const T* q;
    const T* k;           // v is `v_at` values after k (D in both layouts)
    const T* dout;        // backward: the queries' output gradient rows
    const float* lse;     // backward: the queries' final log-sum-exps
    const float* Drows;   // backward: the queries' Σ dout·out
    long long q_stride, kv_stride, dout_stride;
    int v_at, q_rows, kv_rows;
    bool causal;
    int window; // keys a query sees at most, itself included (0: every earlier one)

    __device__ __forceinline__ const T* v() const { return k + v_at; }

    // The first key query `row` sees.
    __device__ __forceinline__ int first_key(int row) const {
        return window > 0 ? max(0, row - window + 1) : 0;
    }
    // The first key tile the query tile starting at q0 meets (its first row sees the least).
    __device__ __forceinline__ int first_key_tile(int q0) const { return first_key(q0) / TILE; }
    // Query tiles (from tile 0) up to the last one holding a query that sees a key of the
    // tile starting at k0: all of them, or under a window those up to its last key's reach.
    __device__ __forceinline__ int query_tiles(int k0) const {
        const int all = (q_rows + TILE - 1) / TILE;
        if (window <= 0) return all;
        const int end = min(q_rows, k0 + TILE - 1 + window);
        return min(all, (end + TILE - 1) / TILE);
    }
    // Whether the window hides some key of the tile at k0 from some query of the tile at q0
    // (the tiles' pairs that need the window's mask).
    __device__ __forceinline__ bool window_cuts(int q0, int k0) const {
        return window > 0 && k0 < q0 + TILE - window;
    }
    // Whether key `key` lies outside what query `row` sees (past the diagonal, before the
    // window, or past the block's keys).
    __device__ __forceinline__ bool unseen(int row, int key) const {
        return (causal && key > row) || key < first_key(row) || key >= kv_rows;
    }

    // Key tiles the query tile starting at q0 meets: under a causal mask those up to the
    // diagonal.
    __device__ __forceinline__ int key_tiles(int q0) const {
        const int all = (kv_rows + TILE - 1) / TILE;
        return causal ? min((min(q0 + TILE, q_rows) - 1) / TILE + 1, all) : all;
    }
    // Keys query `row` sees (the SIMT kernels).
    __device__ __forceinline__ int keys_of(int row) const {
        return causal ? min(row + 1, kv_rows) : kv_rows;
    }
    // Whether query `row` does not see key `key` (or is past the block's queries).
    __device__ __forceinline__ bool hidden(int row, int key) const {
        return unseen(row, key) || row >= q_rows;
    }
};

// Sample b, head h of the whole causal product over a fused [B, Tn, 3·D] activation, each
// query seeing at most `window` keys (0: all before it).
template <typename T, int HD>
__device__ __forceinline__ Pair<T> fused_pair(const T* qkv, const T* dout, const float* lse,
                                              const float* Drows, int b, int h, int Tn, int H,
                                              int window) {
    const int D = H * HD;
    const T* base = qkv + (long long)b * Tn * 3 * D + h * HD;
    const long long rows_at = ((long long)b * H + h) * Tn;
    Pair<T> p;
    p.q = base;
    p.k = base + D;
    p.v_at = D;
    p.dout = dout ? dout + (long long)b * Tn * D + h * HD : nullptr;
    p.lse = lse ? lse + rows_at : nullptr;
    p.Drows = Drows ? Drows + rows_at : nullptr;
    p.q_stride = p.kv_stride = 3LL * D;
    p.dout_stride = D;
    p.q_rows = p.kv_rows = Tn;
    p.causal = true;
    p.window = window;
    return p;
}

// Ring attention's pair: rows q_start.. of this rank's fused [B, rows, 3·D] activation
// against rows kv_start.. of a travelling key/value block [B, rows, 2·D] (k, then v); dout
// [B, rows, D], lse and D rows [B, H, rows] of this rank's queries.
template <typename T, int HD>
__device__ __forceinline__ Pair<T> ring_pair(const T* qkv, const T* kv, const T* dout,
                                             const float* lse, const float* Drows, int b, int h,
                                             int rows, int H, int q_start, int kv_start,
                                             int q_len, int kv_len, int causal) {
    const int D = H * HD;
    const long long q_row = (long long)b * rows + q_start, kv_row = (long long)b * rows + kv_start;
    const long long rows_at = ((long long)b * H + h) * rows + q_start;
    Pair<T> p;
    p.q = qkv + q_row * 3 * D + h * HD;
    p.k = kv + kv_row * 2 * D + h * HD;
    p.v_at = D;
    p.dout = dout ? dout + q_row * D + h * HD : nullptr;
    p.lse = lse ? lse + rows_at : nullptr;
    p.Drows = Drows ? Drows + rows_at : nullptr;
    p.q_stride = 3LL * D;
    p.kv_stride = 2LL * D;
    p.dout_stride = D;
    p.q_rows = q_len;
    p.kv_rows = kv_len;
    p.causal = causal != 0;
    p.window = 0;
    return p;
}

// The log-sum-exp merge of a kept state (output `o₁`, log-sum-exp `lse₁`; −∞ before any
// key) with a block's (`o₂`, `lse₂`): lse = log(e^lse₁ + e^lse₂), o = o₁·e^(lse₁−lse) +
// o₂·e^(lse₂−lse). Returns lse and the two weights; a state with no keys yet weighs 0 and
// its output is never read (it may be anything, even NaN).
struct Merge {
    float lse, w_kept, w_block;
    __device__ __forceinline__ static Merge of(float kept, float block) {
        Merge r;
        if (kept == -INFINITY) {
            r.lse = block;
            r.w_kept = 0.0f;
            r.w_block = 1.0f;
            return r;
        }
        const float mx = fmaxf(kept, block);
        r.lse = mx + logf(expf(kept - mx) + expf(block - mx));
        r.w_kept = expf(kept - r.lse);
        r.w_block = expf(block - r.lse);
        return r;
    }
    __device__ __forceinline__ float apply(float kept, float block) const {
        return w_kept == 0.0f ? block * w_block : kept * w_kept + block * w_block;
    }
};

// The online softmax of the lane's part of one 16 × 64 score tile (its rows row0, row0 + 8
// of the query tile at q0; key tile kt of key_tiles): the scores scaled to log2 units
// (exp2f is one instruction) and masked on the last tile (the only one holding keys past
// the diagonal or past the block: tiles are aligned, so earlier keys precede every row) and
// on the first ones a window cuts; then the running maxima m and the lane's part of the row
// sums l updated, `alpha` the factor for what was kept so far, and s left holding the
// probabilities.
template <typename T>
__device__ __forceinline__ void softmax_tile(const Pair<T>& p, float (*s)[4], int q0, int kt,
                                             int key_tiles, float scale2, float* m, float* l,
                                             float* alpha) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int c = 2 * (lane % 4);
    const int row0 = q0 + warp * 16 + lane / 4;
    const int k0 = kt * TILE;
    const bool edge = kt == key_tiles - 1 || p.window_cuts(q0, k0);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = k0 + 8 * j + c + (e & 1), row = row0 + (e >> 1) * 8;
            float v = s[j][e] * scale2;
            if (edge && p.unseen(row, key)) v = -INFINITY;
            s[j][e] = v;
            mx[e >> 1] = fmaxf(mx[e >> 1], v);
        }
    }
    float base_[2];
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
            const float pr = exp2f(s[j][e] - base_[e >> 1]);
            s[j][e] = pr;
            sum[e >> 1] += pr;
        }
    }
    // Each lane keeps its part of the row sums; the row's 4 lanes add them at the end.
    l[0] = l[0] * alpha[0] + sum[0];
    l[1] = l[1] * alpha[1] + sum[1];
}

// The lane's output rows times their factors (alpha[0] for row0, alpha[1] for row0 + 8).
template <int HD> __device__ __forceinline__ void rescale(float (*o)[4], const float* alpha) {
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
    }
}

// The rows' whole sums (their 4 lanes' parts), and the output divided by them.
template <int HD> __device__ __forceinline__ void normalise(float (*o)[4], float* l) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    const float inv[2] = {1.0f / l[0], 1.0f / l[1]};
    rescale<HD>(o, inv);
}

// ---------------------------------------------------------------------------------------
// Forward: a block per (64-query tile, sample·head), latest tiles first (they have the most
// keys). Each warp: S = Q·Kᵀ for its 16 rows in registers, the online softmax on the
// accumulators (each row's 16 values of a lane, then the 4 lanes of the row), O += P·V.
// (Two 16-row m-tiles a warp, so that each K/V fragment read from shared memory feeds two
// products, took 240 registers, 2 blocks a multiprocessor instead of 3, and ran the GPT-2
// step's forward 7% slower on an H100; a generic version with an m-tile loop and a
// diagonal skip ran 15% slower even at one m-tile.)
//
// `forward_tiles` leaves the warp's normalised output rows in `o` and each of the lane's two
// rows' maximum `m` (log2 units) and sum `l` (whole row); the kernels differ in where that
// goes. Shared memory: Q, then two K and two V tiles (Mma::staging says where the output is
// staged).
template <typename T, int HD, typename Mma = SyncMma>
__device__ __forceinline__ void forward_tiles(const Pair<T>& p, int q0, T* sQ, float scale,
                                              float (*o)[4], float* m, float* l) {
    constexpr int B_VALUES = Mma::template tile_values<HD>();
    T* sK = sQ + B_VALUES; // two buffers
    T* sV = sK + 2 * B_VALUES;
    const int lane = threadIdx.x % 32;
    const float scale2 = scale * LOG2E; // scores in log2 units
    const int key_tiles = p.key_tiles(q0), kt0 = p.first_key_tile(q0);

    Mma::template load<T, HD>(sQ, p.q, p.q_stride, q0, p.q_rows);
    Mma::template load<T, HD>(sK, p.k, p.kv_stride, kt0 * TILE, p.kv_rows);
    Mma::template load<T, HD>(sV, p.v(), p.kv_stride, kt0 * TILE, p.kv_rows);
    mt_cp_async_commit();

    typename Mma::template Rows<T, HD> qa;
    zero<HD>(o);
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
    for (int kt = kt0; kt < key_tiles; ++kt) {
        const int buf = (kt - kt0) & 1;
        if (kt + 1 < key_tiles) {
            const int nb = (buf ^ 1) * B_VALUES;
            Mma::template load<T, HD>(sK + nb, p.k, p.kv_stride, (kt + 1) * TILE, p.kv_rows);
            Mma::template load<T, HD>(sV + nb, p.v(), p.kv_stride, (kt + 1) * TILE, p.kv_rows);
            mt_cp_async_commit();
            mt_cp_async_wait<1>();
        } else {
            mt_cp_async_wait<0>();
        }
        Mma::publish();
        __syncthreads();
        if (kt == kt0) Mma::rows_of(qa, sQ, lane);
        const T* K = sK + buf * B_VALUES;
        const T* V = sV + buf * B_VALUES;

        float s[TILE / 8][4];
        zero<TILE>(s);
        Mma::template a_xt<T, HD, TILE>(s, qa, K, lane);

        float alpha[2];
        softmax_tile<T>(p, s, q0, kt, key_tiles, scale2, m, l, alpha);
        rescale<HD>(o, alpha);
        unsigned pa[TILE / 16][4];
        to_a<T, TILE>(pa, s);
        Mma::template a_x<T, TILE, HD>(o, pa, V, lane);
        __syncthreads(); // everyone is done with this buffer before it is refilled
    }
    normalise<HD>(o, l);
}

// The forward's tiles with Hopper's asynchronous products (FlashAttention-3's overlap
// within a warpgroup): while the tensor cores compute O += P·V of one key tile, the warps
// run the softmax of the next tile's scores, issued just before it. K therefore runs a tile
// ahead of V: tile j's scores meet V of tile j − 1, and the loads in flight are V of the
// next tile and K of the one after (two buffers each, one load group per step). The same
// arithmetic as forward_tiles in the same order, so the results are the same bits.
template <typename T, int HD>
__device__ __forceinline__ void forward_tiles_pipelined(const Pair<T>& p, int q0, T* sQ,
                                                        float scale, float (*o)[4], float* m,
                                                        float* l) {
    using Mma = WarpgroupMma;
    constexpr int B_VALUES = Mma::tile_values<HD>();
    T* sK = sQ + B_VALUES;     // two buffers: key tile kt0 + j in buffer j % 2
    T* sV = sK + 2 * B_VALUES; // two buffers, likewise
    const int lane = threadIdx.x % 32;
    const float scale2 = scale * LOG2E;
    const int key_tiles = p.key_tiles(q0), kt0 = p.first_key_tile(q0), n = key_tiles - kt0;

    // Q with the first K; then the first V with the second K.
    Mma::load<T, HD>(sQ, p.q, p.q_stride, q0, p.q_rows);
    Mma::load<T, HD>(sK, p.k, p.kv_stride, kt0 * TILE, p.kv_rows);
    mt_cp_async_commit();
    Mma::load<T, HD>(sV, p.v(), p.kv_stride, kt0 * TILE, p.kv_rows);
    if (n > 1) Mma::load<T, HD>(sK + B_VALUES, p.k, p.kv_stride, (kt0 + 1) * TILE, p.kv_rows);
    mt_cp_async_commit();
    mt_cp_async_wait<1>();
    Mma::publish();
    __syncthreads();

    Mma::Rows<T, HD> qa;
    Mma::rows_of(qa, sQ, lane);
    unsigned pa[TILE / 16][4];
    zero<HD>(o);
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
    {
        float s[TILE / 8][4];
        zero<TILE>(s);
        Mma::a_xt<T, HD, TILE>(s, qa, sK, lane);
        float alpha[2]; // 0 or 1: nothing kept yet
        softmax_tile<T>(p, s, q0, kt0, key_tiles, scale2, m, l, alpha);
        to_a<T, TILE>(pa, s);
    }
    // A warp's wait covers its own part of the product: every warp is past its read of the
    // first K buffer before step 0 refills it.
    __syncthreads();
    // Step j: O += P·V of tile kt0 + j (P in `p_now`) beside the scores of tile kt0 + j + 1
    // (their P into `p_next`), issued together with no branch between them. The two P arrays
    // swap roles each step (the loop is unrolled twice): P written into the registers of
    // one still being read by an unfinished product makes ptxas serialise the products.
    auto step = [&](int j, unsigned (*p_now)[4], unsigned (*p_next)[4]) {
        Mma::load<T, HD>(sV + ((j + 1) & 1) * B_VALUES, p.v(), p.kv_stride,
                           (kt0 + j + 1) * TILE, p.kv_rows);
        if (j + 2 < n)
            Mma::load<T, HD>(sK + (j & 1) * B_VALUES, p.k, p.kv_stride, (kt0 + j + 2) * TILE,
                               p.kv_rows);
        mt_cp_async_commit();
        mt_cp_async_wait<1>();
        Mma::publish();
        __syncthreads();
        float s[TILE / 8][4];
        zero<TILE>(s);
        mt_wgmma_hold<TILE>(s);
        mt_wgmma_hold<HD>(o);
        mt_wgmma_fence();
        Mma::issue_a_xt<T, HD, TILE>(s, qa, sK + ((j + 1) & 1) * B_VALUES);
        Mma::issue_a_x<T, TILE, HD>(o, p_now, sV + (j & 1) * B_VALUES);
        mt_wgmma_wait<1>(); // the scores; P·V may still run
        mt_wgmma_hold<TILE>(s);
        float alpha[2];
        softmax_tile<T>(p, s, q0, kt0 + j + 1, key_tiles, scale2, m, l, alpha);
        to_a<T, TILE>(p_next, s);
        mt_wgmma_wait<0>();
        mt_wgmma_hold<HD>(o);
        rescale<HD>(o, alpha);
        __syncthreads(); // everyone is done with the buffers the next step refills
    };
    unsigned pb[TILE / 16][4];
    int j = 0;
    for (; j + 2 < n; j += 2) {
        step(j, pa, pb);
        step(j + 1, pb, pa);
    }
    // The last tile's P·V (in pa after an even number of steps, else in pb).
    auto last = [&](unsigned (*p_last)[4]) {
        mt_cp_async_wait<0>();
        Mma::publish();
        __syncthreads();
        Mma::a_x<T, TILE, HD>(o, p_last, sV + ((n - 1) & 1) * B_VALUES, lane);
    };
    if (j + 1 < n) {
        step(j, pa, pb);
        last(pb);
    } else {
        last(pa);
    }
    normalise<HD>(o, l);
}

template <typename T, int HD, typename Mma = SyncMma>
__device__ void forward(const T* qkv, T* out, float* lse, int B, int Tn, int H, float scale,
                        int window) {
    constexpr int LD = HD + 8;
    DYNAMIC_SMEM(unsigned char, smem);
    T* sQ = reinterpret_cast<T*>(smem);
    const int q0 = (gridDim.x - 1 - blockIdx.x) * TILE;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const Pair<T> p = fused_pair<T, HD>(qkv, nullptr, nullptr, nullptr, b, h, Tn, H, window);
    float o[HD / 8][4], m[2], l[2];
    if constexpr (Mma::PIPELINED) forward_tiles_pipelined<T, HD>(p, q0, sQ, scale, o, m, l);
    else forward_tiles<T, HD, Mma>(p, q0, sQ, scale, o, m, l);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = q0 + warp * 16 + lane / 4;
    if (lane % 4 == 0) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if (row0 + 8 * i < Tn) lse[((long long)b * H + h) * Tn + row0 + 8 * i] = (m[i] + log2f(l[i])) * LN2;
        }
    }
    const int D = H * HD;
    T* stage = Mma::staging(sQ, sQ + Mma::template tile_values<HD>());
    store_rows<T, HD>(out + (long long)b * Tn * D + h * HD, D, o, 1.0f, stage + warp * 16 * LD,
                      q0 + warp * 16, Tn, lane);
}

// Merges the warp's 16 × HD normalised block output (rows r0.., the lane's two rows' m, l
// as `forward_tiles` leaves them) into a kept f32 state: `out` rows `stride` apart, `lse`
// one per row, rows at or past `rows` untouched. Each lane updates the values it holds;
// every lane of a row reads the row's kept log-sum-exp before one of them writes it.
template <int HD>
__device__ __forceinline__ void merge_rows(float* out, long long stride, float* lse,
                                           const float (*o)[4], const float* m, const float* l,
                                           int r0, int rows, int lane) {
    const int g = lane / 4, c = 2 * (lane % 4);
    Merge mg[2];
    bool live[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = r0 + g + 8 * i;
        live[i] = r < rows && l[i] > 0.0f;
        if (live[i]) mg[i] = Merge::of(lse[r], (m[i] + log2f(l[i])) * LN2);
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (!live[i]) continue;
        const int r = r0 + g + 8 * i;
        if (lane % 4 == 0) lse[r] = mg[i].lse;
        float* row = out + (long long)r * stride;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            float2* at = reinterpret_cast<float2*>(row + 8 * n + c);
            const float2 kept = *at;
            *at = make_float2(mg[i].apply(kept.x, o[n][2 * i]), mg[i].apply(kept.y, o[n][2 * i + 1]));
        }
    }
}

// Adds the warp's 16 × HD accumulators (times `scale`) into rows r0.. of an f32 tensor (rows
// `stride` apart), skipping rows at or past `rows`: each lane its own values.
template <int HD>
__device__ __forceinline__ void add_rows(float* dst, long long stride, const float (*acc)[4],
                                         float scale, int r0, int rows, int lane) {
    const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = r0 + g + 8 * i;
        if (r >= rows) continue;
        float* row = dst + (long long)r * stride;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            float2* at = reinterpret_cast<float2*>(row + 8 * n + c);
            const float2 was = *at;
            *at = make_float2(was.x + acc[n][2 * i] * scale, was.y + acc[n][2 * i + 1] * scale);
        }
    }
}

// Ring attention, forward of one pair: the block's output and log-sum-exp merged into the
// kept f32 state `out` [B, rows, D] and `lse` [B, H, rows] at the pair's query rows.
template <typename T, int HD>
__device__ void ring_forward(const T* qkv, const T* kv, float* out, float* lse, int B, int rows,
                             int H, int q_start, int kv_start, int q_len, int kv_len, int causal,
                             float scale) {
    DYNAMIC_SMEM(unsigned char, smem);
    T* sQ = reinterpret_cast<T*>(smem);
    const int q0 = (gridDim.x - 1 - blockIdx.x) * TILE;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const Pair<T> p = ring_pair<T, HD>(qkv, kv, nullptr, nullptr, nullptr, b, h, rows, H, q_start,
                                       kv_start, q_len, kv_len, causal);
    float o[HD / 8][4], m[2], l[2];
    forward_tiles<T, HD>(p, q0, sQ, scale, o, m, l);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int D = H * HD;
    merge_rows<HD>(out + ((long long)b * rows + q_start) * D + h * HD, D,
                   lse + ((long long)b * H + h) * rows + q_start, o, m, l, q0 + warp * 16, q_len,
                   lane);
}

// ---------------------------------------------------------------------------------------
// Backward, part 1: a block per (64-key tile, sample·head). Each warp owns 16 keys and
// accumulates their dK and dV in registers over the query tiles from the diagonal down
// (every query tile when the pair is not causal):
//   Sᵀ = K·Qᵀ, Pᵀ = exp(scale·Sᵀ − lse), dV += Pᵀ·dO, dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ − D),
//   dK += dSᵀ·Q (× scale when stored).
// Shared memory: K, V, two Q and two dO tiles, two rows each of lse and D.
template <typename T, int HD, typename Mma = SyncMma>
__device__ __forceinline__ void dkdv_tiles(const Pair<T>& p, int k0, T* sK, float scale,
                                           float (*dk)[4], float (*dv)[4]) {
    constexpr int B_VALUES = Mma::template tile_values<HD>();
    T* sV = sK + B_VALUES;
    T* sQ = sV + B_VALUES;      // two buffers
    T* sdO = sQ + 2 * B_VALUES; // two buffers
    float* sL = reinterpret_cast<float*>(sdO + 2 * B_VALUES); // two rows: lse · log2(e)
    float* sD = sL + 2 * TILE;                                   // two rows
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int c = 2 * (lane % 4);
    const int key0 = k0 + warp * 16 + lane / 4; // this lane's keys: key0 and key0 + 8
    const float scale2 = scale * LOG2E;

    // The query tile's rows of lse and D (plain loads: a row's start need not be 16-byte
    // aligned); padded queries get lse = ∞, so P = 0.
    auto load_rows_of = [&](int slot, int q0) {
        for (int r = threadIdx.x; r < TILE; r += THREADS) {
            const bool valid = q0 + r < p.q_rows;
            sL[slot * TILE + r] = valid ? p.lse[q0 + r] * LOG2E : INFINITY;
            sD[slot * TILE + r] = valid ? p.Drows[q0 + r] : 0.0f;
        }
    };
    const int qt0 = p.causal ? k0 / TILE : 0, q_tiles = p.query_tiles(k0);
    zero<HD>(dk);
    zero<HD>(dv);
    if (qt0 >= q_tiles) return; // no query sees these keys (a causal pair with fewer queries)
    Mma::template load<T, HD>(sK, p.k, p.kv_stride, k0, p.kv_rows);
    Mma::template load<T, HD>(sV, p.v(), p.kv_stride, k0, p.kv_rows);
    Mma::template load<T, HD>(sQ, p.q, p.q_stride, qt0 * TILE, p.q_rows);
    Mma::template load<T, HD>(sdO, p.dout, p.dout_stride, qt0 * TILE, p.q_rows);
    mt_cp_async_commit();
    load_rows_of(0, qt0 * TILE);

    for (int qt = qt0; qt < q_tiles; ++qt) {
        const int buf = (qt - qt0) & 1;
        if (qt + 1 < q_tiles) {
            const int nb = (buf ^ 1) * B_VALUES;
            Mma::template load<T, HD>(sQ + nb, p.q, p.q_stride, (qt + 1) * TILE, p.q_rows);
            Mma::template load<T, HD>(sdO + nb, p.dout, p.dout_stride, (qt + 1) * TILE,
                                        p.q_rows);
            mt_cp_async_commit();
            load_rows_of(buf ^ 1, (qt + 1) * TILE);
            mt_cp_async_wait<1>();
        } else {
            mt_cp_async_wait<0>();
        }
        Mma::publish();
        __syncthreads();
        const T* Q = sQ + buf * B_VALUES;
        const T* dO = sdO + buf * B_VALUES;
        const float* L = sL + buf * TILE;
        const float* Dq = sD + buf * TILE;
        const int q0 = qt * TILE;

        // Sᵀ = K·Qᵀ → Pᵀ, in registers.
        float st[TILE / 8][4];
        zero<TILE>(st);
        {
            typename Mma::template Rows<T, HD> ka;
            Mma::rows_of(ka, sK, lane);
            Mma::template a_xt<T, HD, TILE>(st, ka, Q, lane);
        }
        // The diagonal tile (a causal pair's first), the last one (padded queries) and
        // those a window cuts need the mask; padded keys are never stored.
        const bool edge =
            (p.causal && qt == qt0) || q0 + TILE > p.q_rows || p.window_cuts(q0, k0);
#pragma unroll
        for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int q = 8 * j + c + (e & 1), key = key0 + (e >> 1) * 8;
                float pr = exp2f(st[j][e] * scale2 - L[q]);
                if (edge && p.hidden(q0 + q, key)) pr = 0.0f;
                st[j][e] = pr;
            }
        }
        unsigned pa[TILE / 16][4];
        to_a<T, TILE>(pa, st);
        // dV += Pᵀ·dO, and dPᵀ = V·dOᵀ → dSᵀ = Pᵀ∘(dPᵀ − D): on Hopper at heads of 64 the
        // second product is issued while the tensor cores still compute the first (at 128
        // the registers of both would spill).
        float dpt[TILE / 8][4];
        auto dpt_product = [&] {
            zero<TILE>(dpt);
            typename Mma::template Rows<T, HD> va;
            Mma::rows_of(va, sV, lane);
            Mma::template a_xt<T, HD, TILE>(dpt, va, dO, lane);
        };
        if constexpr (HD <= 64) {
            Mma::template a_x_then<T, TILE, HD>(dv, pa, dO, lane, dpt_product);
        } else {
            Mma::template a_x<T, TILE, HD>(dv, pa, dO, lane);
            dpt_product();
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
        Mma::template a_x<T, TILE, HD>(dk, dsa, Q, lane);
        __syncthreads(); // everyone is done with this buffer before it is refilled
    }
}

template <typename T, int HD, typename Mma = SyncMma>
__device__ void backward_dkdv(const T* qkv, const T* dout, const float* lse, const float* Drows,
                              T* dqkv, int B, int Tn, int H, float scale, int window) {
    constexpr int LD = HD + 8, TILE_VALUES = Mma::template tile_values<HD>();
    DYNAMIC_SMEM(unsigned char, smem);
    T* sK = reinterpret_cast<T*>(smem);
    T* sV = sK + TILE_VALUES;
    const int k0 = blockIdx.x * TILE;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const Pair<T> p = fused_pair<T, HD>(qkv, dout, lse, Drows, b, h, Tn, H, window);
    float dk[HD / 8][4], dv[HD / 8][4];
    dkdv_tiles<T, HD, Mma>(p, k0, sK, scale, dk, dv);

    // Staged in the warp's own rows of sK and sV, or (wgmma) of the streamed Q buffers.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int D = H * HD;
    const long long stride = 3LL * D;
    T* out = dqkv + (long long)b * Tn * stride + h * HD;
    T* streamed = sV + TILE_VALUES;
    store_rows<T, HD>(out + D, stride, dk, scale, Mma::staging(sK, streamed) + warp * 16 * LD,
                      k0 + warp * 16, Tn, lane);
    store_rows<T, HD>(out + 2 * D, stride, dv, 1.0f, Mma::staging(sV, streamed) + warp * 16 * LD,
                      k0 + warp * 16, Tn, lane);
}

// Ring attention, dK and dV of one pair, added into the travelling block's f32 accumulator
// `dkv` [B, rows, 2·D] (dK, then dV) at the pair's key rows.
template <typename T, int HD>
__device__ void ring_dkdv(const T* qkv, const T* kv, const T* dout, const float* lse,
                          const float* Drows, float* dkv, int B, int rows, int H, int q_start,
                          int kv_start, int q_len, int kv_len, int causal, float scale) {
    DYNAMIC_SMEM(unsigned char, smem);
    T* sK = reinterpret_cast<T*>(smem);
    const int k0 = blockIdx.x * TILE;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const Pair<T> p = ring_pair<T, HD>(qkv, kv, dout, lse, Drows, b, h, rows, H, q_start, kv_start,
                                       q_len, kv_len, causal);
    float dk[HD / 8][4], dv[HD / 8][4];
    dkdv_tiles<T, HD>(p, k0, sK, scale, dk, dv);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int D = H * HD;
    float* at = dkv + ((long long)b * rows + kv_start) * 2 * D + h * HD;
    add_rows<HD>(at, 2LL * D, dk, scale, k0 + warp * 16, kv_len, lane);
    add_rows<HD>(at + D, 2LL * D, dv, 1.0f, k0 + warp * 16, kv_len, lane);
}

// Backward, part 2: a block per (64-query tile, sample·head), latest first. Each warp owns
// 16 queries and accumulates their dQ over the key tiles they meet:
//   S = Q·Kᵀ, P = exp(scale·S − lse), dP = dO·Vᵀ, dS = P∘(dP − D), dQ += dS·K (× scale when
//   stored).
// Shared memory: Q, dO, two K and two V tiles.
template <typename T, int HD, typename Mma = SyncMma>
__device__ __forceinline__ void dq_tiles(const Pair<T>& p, int q0, T* sQ, float scale,
                                         float (*dq)[4]) {
    constexpr int B_VALUES = Mma::template tile_values<HD>();
    T* sdO = sQ + B_VALUES;
    T* sK = sdO + B_VALUES; // two buffers
    T* sV = sK + 2 * B_VALUES;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int c = 2 * (lane % 4);
    const int row0 = q0 + warp * 16 + lane / 4; // this lane's queries: row0 and row0 + 8
    const float scale2 = scale * LOG2E;
    float lse2[2], d_row[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = row0 + 8 * i;
        lse2[i] = r < p.q_rows ? p.lse[r] * LOG2E : INFINITY; // padded queries: P = 0
        d_row[i] = r < p.q_rows ? p.Drows[r] : 0.0f;
    }
    const int key_tiles = p.key_tiles(q0), kt0 = p.first_key_tile(q0);

    Mma::template load<T, HD>(sQ, p.q, p.q_stride, q0, p.q_rows);
    Mma::template load<T, HD>(sdO, p.dout, p.dout_stride, q0, p.q_rows);
    Mma::template load<T, HD>(sK, p.k, p.kv_stride, kt0 * TILE, p.kv_rows);
    Mma::template load<T, HD>(sV, p.v(), p.kv_stride, kt0 * TILE, p.kv_rows);
    mt_cp_async_commit();

    typename Mma::template Rows<T, HD> qa, doa;
    zero<HD>(dq);
    for (int kt = kt0; kt < key_tiles; ++kt) {
        const int buf = (kt - kt0) & 1;
        if (kt + 1 < key_tiles) {
            const int nb = (buf ^ 1) * B_VALUES;
            Mma::template load<T, HD>(sK + nb, p.k, p.kv_stride, (kt + 1) * TILE, p.kv_rows);
            Mma::template load<T, HD>(sV + nb, p.v(), p.kv_stride, (kt + 1) * TILE, p.kv_rows);
            mt_cp_async_commit();
            mt_cp_async_wait<1>();
        } else {
            mt_cp_async_wait<0>();
        }
        Mma::publish();
        __syncthreads();
        if (kt == kt0) {
            Mma::rows_of(qa, sQ, lane);
            Mma::rows_of(doa, sdO, lane);
        }
        const T* K = sK + buf * B_VALUES;
        const T* V = sV + buf * B_VALUES;
        const int k0 = kt * TILE;

        // S = Q·Kᵀ → P, and dP = dO·Vᵀ (on Hopper both issued at once, P computed while the
        // tensor cores still compute dP) → dS = P∘(dP − D).
        float s[TILE / 8][4], dp[TILE / 8][4];
        zero<TILE>(s);
        zero<TILE>(dp);
        const bool edge = kt == key_tiles - 1 || p.window_cuts(q0, k0);
        Mma::template a_xt_pair<T, HD, TILE>(s, qa, K, dp, doa, V, lane, [&] {
#pragma unroll
            for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + 8 * j + c + (e & 1), row = row0 + (e >> 1) * 8;
                    float pr = exp2f(s[j][e] * scale2 - lse2[e >> 1]);
                    if (edge && p.unseen(row, key)) pr = 0.0f;
                    s[j][e] = pr;
                }
            }
        });
#pragma unroll
        for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[j][e] = s[j][e] * (dp[j][e] - d_row[e >> 1]);
        }
        unsigned dsa[TILE / 16][4];
        to_a<T, TILE>(dsa, dp);
        // dQ += dS·K.
        Mma::template a_x<T, TILE, HD>(dq, dsa, K, lane);
        __syncthreads(); // everyone is done with this buffer before it is refilled
    }
}

template <typename T, int HD, typename Mma = SyncMma>
__device__ void backward_dq(const T* qkv, const T* dout, const float* lse, const float* Drows,
                            T* dqkv, int B, int Tn, int H, float scale, int window) {
    constexpr int LD = HD + 8;
    DYNAMIC_SMEM(unsigned char, smem);
    T* sQ = reinterpret_cast<T*>(smem);
    const int q0 = (gridDim.x - 1 - blockIdx.x) * TILE;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const Pair<T> p = fused_pair<T, HD>(qkv, dout, lse, Drows, b, h, Tn, H, window);
    float dq[HD / 8][4];
    dq_tiles<T, HD, Mma>(p, q0, sQ, scale, dq);
    // Staged in the warp's own rows of sQ (only it read them, at kt = 0), or (wgmma) of the
    // streamed K buffers.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    T* stage = Mma::staging(sQ, sQ + 2 * Mma::template tile_values<HD>());
    store_rows<T, HD>(dqkv + (long long)b * Tn * 3 * H * HD + h * HD, 3LL * H * HD, dq, scale,
                      stage + warp * 16 * LD, q0 + warp * 16, Tn, lane);
}

// Ring attention, dQ of one pair, added into the f32 accumulator `dq` [B, rows, D] at the
// pair's query rows.
template <typename T, int HD>
__device__ void ring_dq(const T* qkv, const T* kv, const T* dout, const float* lse,
                        const float* Drows, float* dq, int B, int rows, int H, int q_start,
                        int kv_start, int q_len, int kv_len, int causal, float scale) {
    DYNAMIC_SMEM(unsigned char, smem);
    T* sQ = reinterpret_cast<T*>(smem);
    const int q0 = (gridDim.x - 1 - blockIdx.x) * TILE;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const Pair<T> p = ring_pair<T, HD>(qkv, kv, dout, lse, Drows, b, h, rows, H, q_start, kv_start,
                                       q_len, kv_len, causal);
    float acc[HD / 8][4];
    dq_tiles<T, HD>(p, q0, sQ, scale, acc);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int D = H * HD;
    add_rows<HD>(dq + ((long long)b * rows + q_start) * D + h * HD, D, acc, scale, q0 + warp * 16,
                 q_len, lane);
}

// ---------------------------------------------------------------------------------------
// D = Σ_d dout·out per (sample, head, query). HD / 8 threads a row (4, 8 or 16: a power of
// two that divides a warp), each summing its 8 products in order, then the row's threads by
// xor butterfly: a fixed order, the same bits on every GPU and run. Threads walk the [B, T,
// H·HD] tensors in memory order, 16 bytes each (8 16-bit values), so a warp reads contiguous
// bytes. (A warp per row with 2-byte loads ran at a third of the copy rate on an H100.)
template <typename T>
__device__ void backward_prep(const T* out, const T* dout, float* Drows, int HD, int B, int Tn,
                              int H) {
    const int per_row = HD / 8;
    const long long units = (long long)B * Tn * H * per_row;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const int lane = threadIdx.x % 32;
    // Warp-uniform bounds: every lane takes part in the butterfly (lanes past the end add 0).
    for (long long i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x - lane; i0 < units;
         i0 += stride) {
        const long long i = i0 + lane;
        float s = 0.0f;
        if (i < units) {
            float o[8], g[8];
            load8(out + i * 8, o);
            load8(dout + i * 8, g);
#pragma unroll
            for (int e = 0; e < 8; ++e) s += o[e] * g[e];
        }
        for (int off = per_row / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (i < units && (lane & (per_row - 1)) == 0) {
            const long long row = i / per_row; // (b, t, h) in memory order
            const int h = (int)(row % H);
            const long long bt = row / H;
            const int t = (int)(bt % Tn), b = (int)(bt / Tn);
            Drows[((long long)b * H + h) * Tn + t] = s;
        }
    }
}

// ---------------------------------------------------------------------------------------
// f32: exact SIMT kernels, a warp per row (4 rows a block), lanes over the head's values.
__device__ __forceinline__ float warp_total(float v) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Query row qi's online softmax over the keys it sees: the lane's values of its
// unnormalised output in `o`, the row's maximum `m` and sum `l` (natural units).
template <int HD>
__device__ __forceinline__ void forward_row_f32(const Pair<float>& p, int qi, float scale,
                                                float* o, float& m, float& l) {
    constexpr int PER = HD / 32;
    const int lane = threadIdx.x % 32;
    float q[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        q[i] = p.q[(long long)qi * p.q_stride + lane + 32 * i];
        o[i] = 0.0f;
    }
    m = -INFINITY;
    l = 0.0f;
    const int keys = p.keys_of(qi);
    for (int kj = p.first_key(qi); kj < keys; ++kj) {
        const float* k = p.k + (long long)kj * p.kv_stride;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; ++i) s += q[i] * k[lane + 32 * i];
        s = warp_total(s) * scale;
        const float m_new = fmaxf(m, s);
        const float alpha = expf(m - m_new), pr = expf(s - m_new);
        l = l * alpha + pr;
        m = m_new;
        const float* v = p.v() + (long long)kj * p.kv_stride;
#pragma unroll
        for (int i = 0; i < PER; ++i) o[i] = o[i] * alpha + pr * v[lane + 32 * i];
    }
}

template <int HD>
__device__ void forward_f32(const float* qkv, float* out, float* lse, int B, int Tn, int H,
                            float scale, int window) {
    constexpr int PER = HD / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int qi = blockIdx.x * 4 + warp;
    if (qi >= Tn) return;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const Pair<float> p =
        fused_pair<float, HD>(qkv, nullptr, nullptr, nullptr, b, h, Tn, H, window);
    float o[PER], m, l;
    forward_row_f32<HD>(p, qi, scale, o, m, l);
    const int D = H * HD;
    float* dst = out + ((long long)b * Tn + qi) * D + h * HD;
#pragma unroll
    for (int i = 0; i < PER; ++i) dst[lane + 32 * i] = o[i] / l;
    if (lane == 0) lse[((long long)b * H + h) * Tn + qi] = m + logf(l);
}

template <int HD>
__device__ void ring_forward_f32(const float* qkv, const float* kv, float* out, float* lse, int B,
                                 int rows, int H, int q_start, int kv_start, int q_len,
                                 int kv_len, int causal, float scale) {
    constexpr int PER = HD / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int qi = blockIdx.x * 4 + warp;
    if (qi >= q_len) return;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const Pair<float> p = ring_pair<float, HD>(qkv, kv, nullptr, nullptr, nullptr, b, h, rows, H,
                                               q_start, kv_start, q_len, kv_len, causal);
    float o[PER], m, l;
    forward_row_f32<HD>(p, qi, scale, o, m, l);
    if (l == 0.0f) return; // no key in this pair (never for a ring's pairs)
    const int D = H * HD;
    float* kept_lse = lse + ((long long)b * H + h) * rows + q_start + qi;
    const Merge mg = Merge::of(*kept_lse, m + logf(l));
    __syncwarp(); // every lane has read the kept log-sum-exp
    if (lane == 0) *kept_lse = mg.lse;
    float* dst = out + ((long long)b * rows + q_start + qi) * D + h * HD;
#pragma unroll
    for (int i = 0; i < PER; ++i) dst[lane + 32 * i] = mg.apply(dst[lane + 32 * i], o[i] / l);
}

// Key kj's dK (unscaled) and dV over the queries that see it.
template <int HD>
__device__ __forceinline__ void dkdv_row_f32(const Pair<float>& p, int kj, float scale, float* dk,
                                             float* dv) {
    constexpr int PER = HD / 32;
    const int lane = threadIdx.x % 32;
    float k[PER], v[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        k[i] = p.k[(long long)kj * p.kv_stride + lane + 32 * i];
        v[i] = p.v()[(long long)kj * p.kv_stride + lane + 32 * i];
        dk[i] = dv[i] = 0.0f;
    }
    const int last = p.window > 0 ? min(p.q_rows, kj + p.window) : p.q_rows;
    for (int qi = p.causal ? kj : 0; qi < last; ++qi) {
        const float* q = p.q + (long long)qi * p.q_stride;
        const float* g = p.dout + (long long)qi * p.dout_stride;
        float s = 0.0f, dp = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            s += q[lane + 32 * i] * k[i];
            dp += g[lane + 32 * i] * v[i];
        }
        s = warp_total(s);
        dp = warp_total(dp);
        const float pr = expf(s * scale - p.lse[qi]);
        const float ds = pr * (dp - p.Drows[qi]);
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            dv[i] += pr * g[lane + 32 * i];
            dk[i] += ds * q[lane + 32 * i];
        }
    }
}

template <int HD>
__device__ void dkdv_f32(const float* qkv, const float* dout, const float* lse, const float* Drows,
                         float* dqkv, int B, int Tn, int H, float scale, int window) {
    constexpr int PER = HD / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kj = blockIdx.x * 4 + warp;
    if (kj >= Tn) return;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const Pair<float> p = fused_pair<float, HD>(qkv, dout, lse, Drows, b, h, Tn, H, window);
    float dk[PER], dv[PER];
    dkdv_row_f32<HD>(p, kj, scale, dk, dv);
    const int D = H * HD;
    float* dst = dqkv + ((long long)b * Tn + kj) * 3 * D + h * HD;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        dst[D + lane + 32 * i] = dk[i] * scale;
        dst[2 * D + lane + 32 * i] = dv[i];
    }
}

template <int HD>
__device__ void ring_dkdv_f32(const float* qkv, const float* kv, const float* dout,
                              const float* lse, const float* Drows, float* dkv, int B, int rows,
                              int H, int q_start, int kv_start, int q_len, int kv_len, int causal,
                              float scale) {
    constexpr int PER = HD / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kj = blockIdx.x * 4 + warp;
    if (kj >= kv_len) return;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const Pair<float> p = ring_pair<float, HD>(qkv, kv, dout, lse, Drows, b, h, rows, H, q_start,
                                               kv_start, q_len, kv_len, causal);
    float dk[PER], dv[PER];
    dkdv_row_f32<HD>(p, kj, scale, dk, dv);
    const int D = H * HD;
    float* dst = dkv + ((long long)b * rows + kv_start + kj) * 2 * D + h * HD;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        dst[lane + 32 * i] += dk[i] * scale;
        dst[D + lane + 32 * i] += dv[i];
    }
}

// Query qi's dQ (unscaled) over the keys it sees.
template <int HD>
__device__ __forceinline__ void dq_row_f32(const Pair<float>& p, int qi, float scale, float* dq) {
    constexpr int PER = HD / 32;
    const int lane = threadIdx.x % 32;
    const float l = p.lse[qi];
    const float dd = p.Drows[qi];
    float q[PER], go[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        q[i] = p.q[(long long)qi * p.q_stride + lane + 32 * i];
        go[i] = p.dout[(long long)qi * p.dout_stride + lane + 32 * i];
        dq[i] = 0.0f;
    }
    const int keys = p.keys_of(qi);
    for (int kj = p.first_key(qi); kj < keys; ++kj) {
        const float* k = p.k + (long long)kj * p.kv_stride;
        const float* v = p.v() + (long long)kj * p.kv_stride;
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
}

template <int HD>
__device__ void dq_f32(const float* qkv, const float* dout, const float* lse, const float* Drows,
                       float* dqkv, int B, int Tn, int H, float scale, int window) {
    constexpr int PER = HD / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int qi = blockIdx.x * 4 + warp;
    if (qi >= Tn) return;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const Pair<float> p = fused_pair<float, HD>(qkv, dout, lse, Drows, b, h, Tn, H, window);
    float dq[PER];
    dq_row_f32<HD>(p, qi, scale, dq);
    float* dst = dqkv + ((long long)b * Tn + qi) * 3 * H * HD + h * HD;
#pragma unroll
    for (int i = 0; i < PER; ++i) dst[lane + 32 * i] = dq[i] * scale;
}

template <int HD>
__device__ void ring_dq_f32(const float* qkv, const float* kv, const float* dout, const float* lse,
                            const float* Drows, float* dq, int B, int rows, int H, int q_start,
                            int kv_start, int q_len, int kv_len, int causal, float scale) {
    constexpr int PER = HD / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int qi = blockIdx.x * 4 + warp;
    if (qi >= q_len) return;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const Pair<float> p = ring_pair<float, HD>(qkv, kv, dout, lse, Drows, b, h, rows, H, q_start,
                                               kv_start, q_len, kv_len, causal);
    float acc[PER];
    dq_row_f32<HD>(p, qi, scale, acc);
    float* dst = dq + ((long long)b * rows + q_start + qi) * H * HD + h * HD;
#pragma unroll
    for (int i = 0; i < PER; ++i) dst[lane + 32 * i] += acc[i] * scale;
}

// ---------------------------------------------------------------------------------------
// Ring attention's moves (grid-stride loops over rows × values).

// kv [N, 2·D] = the keys and values of qkv [N, 3·D]: the block that travels.
template <typename T>
__device__ void ring_keys_values(const T* qkv, T* kv, long long n, int D) {
    const long long t = global_thread(), stride = grid_threads();
    for (long long i = t; i < n * 2 * D; i += stride) {
        const long long row = i / (2 * D);
        kv[i] = qkv[row * 3 * D + D + i % (2 * D)];
    }
}

// dqkv [N, 3·D] in T = (dq [N, D], dkv [N, 2·D]) of f32 accumulators.
template <typename T>
__device__ void ring_join(const float* dq, const float* dkv, T* dqkv, long long n, int D) {
    const long long t = global_thread(), stride = grid_threads();
    for (long long i = t; i < n * 3 * D; i += stride) {
        const long long row = i / (3 * D);
        const int col = (int)(i % (3 * D));
        const float v = col < D ? dq[row * D + col] : dkv[row * 2 * D + col - D];
        dqkv[i] = from_f32<T>(v);
    }
}

// The state before any key: lse = −∞ (the output is not read until the first merge writes
// it, but starts at zero so that nothing undefined is ever read back).
__device__ void ring_start(float* out, long long n_out, float* lse, long long n_lse) {
    const long long t = global_thread(), stride = grid_threads();
    for (long long i = t; i < n_out; i += stride) out[i] = 0.0f;
    for (long long i = t; i < n_lse; i += stride) lse[i] = -INFINITY;
}

} // namespace attn

// The exported kernels: attn_{fwd,dkdv,dq}_{bf16,f16,f32}_hd{32,64,128}, attn_bwd_prep_{t};
// ring attention's attn_ring_{fwd,dkdv,dq}_{t}_hd{n} (one block pair, merged or added into
// f32 state), attn_ring_kv_{t}, attn_ring_join_{t} and attn_ring_start.
#define ATTN_RING_ARGS                                                                         \
    int B, int rows, int H, int q_start, int kv_start, int q_len, int kv_len, int causal,      \
        float scale
#define ATTN_RING_PASS B, rows, H, q_start, kv_start, q_len, kv_len, causal, scale

#define ATTN_HALF(T, NAME, HD)                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        attn_fwd_##NAME##_hd##HD(const T* qkv, T* out, float* lse, int B, int Tn, int H,       \
                                 float scale, int window) {                                    \
        attn::forward<T, HD>(qkv, out, lse, B, Tn, H, scale, window);                          \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_dkdv_##NAME##_hd##HD(               \
        const T* qkv, const T* dout, const float* lse, const float* Drows, T* dqkv, int B,     \
        int Tn, int H, float scale, int window) {                                              \
        attn::backward_dkdv<T, HD>(qkv, dout, lse, Drows, dqkv, B, Tn, H, scale, window);      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_dq_##NAME##_hd##HD(                 \
        const T* qkv, const T* dout, const float* lse, const float* Drows, T* dqkv, int B,     \
        int Tn, int H, float scale, int window) {                                              \
        attn::backward_dq<T, HD>(qkv, dout, lse, Drows, dqkv, B, Tn, H, scale, window);        \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_ring_fwd_##NAME##_hd##HD(           \
        const T* qkv, const T* kv, float* out, float* lse, ATTN_RING_ARGS) {                   \
        attn::ring_forward<T, HD>(qkv, kv, out, lse, ATTN_RING_PASS);                          \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_ring_dkdv_##NAME##_hd##HD(          \
        const T* qkv, const T* kv, const T* dout, const float* lse, const float* Drows,        \
        float* dkv, ATTN_RING_ARGS) {                                                          \
        attn::ring_dkdv<T, HD>(qkv, kv, dout, lse, Drows, dkv, ATTN_RING_PASS);                \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_ring_dq_##NAME##_hd##HD(            \
        const T* qkv, const T* kv, const T* dout, const float* lse, const float* Drows,        \
        float* dq, ATTN_RING_ARGS) {                                                           \
        attn::ring_dq<T, HD>(qkv, kv, dout, lse, Drows, dq, ATTN_RING_PASS);                   \
    }

#define ATTN_F32(HD)                                                                           \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        attn_fwd_f32_hd##HD(const float* qkv, float* out, float* lse, int B, int Tn, int H,    \
                            float scale, int window) {                                         \
        attn::forward_f32<HD>(qkv, out, lse, B, Tn, H, scale, window);                         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_dkdv_f32_hd##HD(                    \
        const float* qkv, const float* dout, const float* lse, const float* Drows,             \
        float* dqkv, int B, int Tn, int H, float scale, int window) {                          \
        attn::dkdv_f32<HD>(qkv, dout, lse, Drows, dqkv, B, Tn, H, scale, window);              \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_dq_f32_hd##HD(                      \
        const float* qkv, const float* dout, const float* lse, const float* Drows,             \
        float* dqkv, int B, int Tn, int H, float scale, int window) {                          \
        attn::dq_f32<HD>(qkv, dout, lse, Drows, dqkv, B, Tn, H, scale, window);                \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_ring_fwd_f32_hd##HD(                \
        const float* qkv, const float* kv, float* out, float* lse, ATTN_RING_ARGS) {           \
        attn::ring_forward_f32<HD>(qkv, kv, out, lse, ATTN_RING_PASS);                         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_ring_dkdv_f32_hd##HD(               \
        const float* qkv, const float* kv, const float* dout, const float* lse,                \
        const float* Drows, float* dkv, ATTN_RING_ARGS) {                                      \
        attn::ring_dkdv_f32<HD>(qkv, kv, dout, lse, Drows, dkv, ATTN_RING_PASS);               \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_ring_dq_f32_hd##HD(                 \
        const float* qkv, const float* kv, const float* dout, const float* lse,                \
        const float* Drows, float* dq, ATTN_RING_ARGS) {                                       \
        attn::ring_dq_f32<HD>(qkv, kv, dout, lse, Drows, dq, ATTN_RING_PASS);                  \
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

// The same three kernels with Hopper's warpgroup products (sm_90a; a trap elsewhere, and the
// host launches them only on compute capability 9.0): attn_{fwd,dkdv,dq}_wg_{bf16,f16}_hd{64,128}.
#define ATTN_WG(T, NAME, HD)                                                                   \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        attn_fwd_wg_##NAME##_hd##HD(const T* qkv, T* out, float* lse, int B, int Tn, int H,    \
                                    float scale, int window) {                                 \
        attn::forward<T, HD, attn::WarpgroupMma>(qkv, out, lse, B, Tn, H, scale, window);      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_dkdv_wg_##NAME##_hd##HD(            \
        const T* qkv, const T* dout, const float* lse, const float* Drows, T* dqkv, int B,     \
        int Tn, int H, float scale, int window) {                                              \
        attn::backward_dkdv<T, HD, attn::WarpgroupMma>(qkv, dout, lse, Drows, dqkv, B, Tn, H,  \
                                                       scale, window);                         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_dq_wg_##NAME##_hd##HD(              \
        const T* qkv, const T* dout, const float* lse, const float* Drows, T* dqkv, int B,     \
        int Tn, int H, float scale, int window) {                                              \
        attn::backward_dq<T, HD, attn::WarpgroupMma>(qkv, dout, lse, Drows, dqkv, B, Tn, H,    \
                                                     scale, window);                           \
    }
ATTN_WG(bf16, bf16, 64)
ATTN_WG(bf16, bf16, 128)
ATTN_WG(f16, f16, 64)
ATTN_WG(f16, f16, 128)

#define ATTN_PREP(T, NAME)                                                                     \
    extern "C" __global__ void attn_bwd_prep_##NAME(const T* out, const T* dout, float* Drows, \
                                                    int HD, int B, int Tn, int H, float scale) { \
        attn::backward_prep<T>(out, dout, Drows, HD, B, Tn, H);                                \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        attn_ring_kv_##NAME(const T* qkv, T* kv, long long n, int D) {                         \
        attn::ring_keys_values<T>(qkv, kv, n, D);                                              \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        attn_ring_join_##NAME(const float* dq, const float* dkv, T* dqkv, long long n, int D) { \
        attn::ring_join<T>(dq, dkv, dqkv, n, D);                                               \
    }
ATTN_PREP(bf16, bf16)
ATTN_PREP(f16, f16)
ATTN_PREP(float, f32)

extern "C" __global__ void __launch_bounds__(256)
attn_ring_start(float* out, long long n_out, float* lse, long long n_lse) {
    attn::ring_start(out, n_out, lse, n_lse);
}
