// selftest.cu: kernels that exercise the CPU emulator itself (cuda_emu.h); the checks and the
// reference implementations are in selftest_main.cpp. Like a real kernel file it uses only
// the prelude of kernels/ABI.md (plus a few deliberate misuses, to check they are reported).

// ---------------------------------------------------------------------------------------
// Block reduction: a tree over static shared memory, blockDim a power of two.
extern "C" __global__ void st_reduce(const float* x, float* out, int n) {
    __shared__ float s[1024];
    const int t = threadIdx.x;
    const int i = blockIdx.x * blockDim.x + t;
    s[t] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int h = blockDim.x / 2; h > 0; h /= 2) {
        if (t < h) s[t] += s[t + h];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = s[0];
}

// A data race: reads a neighbour's slot without __syncthreads. Its result depends on the
// schedule (which is how the emulator exposes races).
extern "C" __global__ void st_race(int* out) {
    __shared__ int s[64];
    const int t = threadIdx.x;
    s[t] = t;
    out[blockIdx.x * blockDim.x + t] = s[(t + 1) % blockDim.x];
}

// ---------------------------------------------------------------------------------------
// Warp shuffles and votes. 12 float outputs, 2 doubles, 2 long longs and 4 vote words per
// thread.
#define ST_SHFL_OUT 12
extern "C" __global__ void st_shuffles(const float* x, float* o, double* od, long long* oll,
                                       unsigned* ov) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x % 32;
    const float v = x[t];
    float s = v;
    for (int k = 16; k > 0; k /= 2) s += __shfl_xor_sync(0xffffffffu, s, k);
    float* p = o + (long long)t * ST_SHFL_OUT;
    p[0] = s;
    p[1] = __shfl_down_sync(0xffffffffu, v, 3);
    p[2] = __shfl_up_sync(0xffffffffu, v, 5, 16);
    p[3] = __shfl_sync(0xffffffffu, v, lane * 7 + 3, 8);
    p[4] = __shfl_sync(0xffffffffu, v, -1, 16);
    p[5] = __shfl_xor_sync(0xffffffffu, v, 16, 16);
    p[6] = __shfl_down_sync(0xffffffffu, v, 2, 4);
    p[7] = __shfl_xor_sync(0xffffffffu, v, 5, 8);
    p[8] = __shfl_sync(0xffffffffu, v, 31 - lane);
    p[9] = __shfl_up_sync(0xffffffffu, v, 1);
    p[10] = __shfl_down_sync(0xffffffffu, v, 31);
    p[11] = __shfl_sync(0xffffffffu, v, 0, 1);
    const double d = (double)v * 1.0000000001 + lane * 1e-300;
    od[2 * t] = __shfl_xor_sync(0xffffffffu, d, 1);
    od[2 * t + 1] = __shfl_down_sync(0xffffffffu, d, 16);
    const long long ll = ((long long)lane << 40) | (long long)t;
    oll[2 * t] = __shfl_up_sync(0xffffffffu, ll, 2);
    oll[2 * t + 1] = __shfl_sync(0xffffffffu, ll, 17);
    ov[4 * t] = __ballot_sync(0xffffffffu, lane % 3 == 0);
    ov[4 * t + 1] = (unsigned)__any_sync(0xffffffffu, lane == 7);
    ov[4 * t + 2] = (unsigned)__all_sync(0xffffffffu, v > -1000.0f);
    ov[4 * t + 3] = (unsigned)__all_sync(0xffffffffu, lane < 31);
}

// Lanes 0-15 and 16-31 synchronise and shuffle separately, with their own masks.
extern "C" __global__ void st_half_warps(float* out) {
    __shared__ float s[32];
    const int lane = threadIdx.x;
    const unsigned half = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    s[lane] = (float)lane;
    __syncwarp(half);
    out[lane] = s[lane ^ 8];
    out[32 + lane] = __shfl_xor_sync(half, (float)(lane * lane), 1);
    out[64 + lane] = (float)__ballot_sync(half, lane & 1);
}

// ---------------------------------------------------------------------------------------
// A partial last warp: blockDim 48, so warp 1 has lanes 0-15 only.
extern "C" __global__ void st_partial(const float* x, float* o, unsigned* ov) {
    __shared__ float s[48];
    const int t = threadIdx.x;
    s[t] = x[t];
    __syncthreads();
    const float mine = s[47 - t];
    float sum = mine;
    for (int k = 8; k > 0; k /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, k);
    o[t * 3] = sum;
    o[t * 3 + 1] = __shfl_down_sync(0xffffffffu, mine, 8);
    ov[t] = __ballot_sync(0xffffffffu, 1);
    __syncwarp();
    o[t * 3 + 2] = (float)__syncthreads_count(t % 5 == 0);
}

// Half of each warp returns; the others use full-mask collectives (allowed: exited lanes do
// not take part), and read garbage from the exited lanes.
extern "C" __global__ void st_exited_lanes(float* out) {
    const int lane = threadIdx.x % 32;
    if (lane >= 16) return;
    float v = 1.0f;
    v += __shfl_xor_sync(0xffffffffu, v, 16); // reads an exited lane: garbage (NaN here)
    out[lane] = v;
    __syncwarp();
    float w = 1.0f;
    for (int k = 8; k > 0; k /= 2) w += __shfl_xor_sync(0xffffffffu, w, k);
    out[16 + lane] = w;
}

// ---------------------------------------------------------------------------------------
// Shared memory contents at block start, dynamic shared memory.
extern "C" __global__ void st_dynamic(unsigned* first_word, unsigned* align, float* o, int n) {
    DYNAMIC_SMEM(float, buf);
    const int t = threadIdx.x;
    if (t == 0) {
        first_word[blockIdx.x] = __float_as_uint(buf[n - 1]);
        align[blockIdx.x] = (unsigned)(reinterpret_cast<unsigned long long>(buf) % 16);
    }
    __syncthreads();
    for (int i = t; i < n; i += blockDim.x) buf[i] = (float)(i + 1000 * blockIdx.x);
    __syncthreads();
    for (int i = t; i < n; i += blockDim.x) o[(long long)blockIdx.x * n + i] = buf[n - 1 - i];
}

extern "C" __global__ void st_static_poison(unsigned* seen) {
    __shared__ unsigned flag;
    if (threadIdx.x == 0) {
        seen[blockIdx.x] = flag; // uninitialised: the emulator's garbage byte
        flag = 12345u;
    }
}

// ---------------------------------------------------------------------------------------
// Indices in 3-D grids and blocks, __syncthreads_and/or.
extern "C" __global__ void st_indices(int* out) {
    const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int nt = blockDim.x * blockDim.y * blockDim.z;
    const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    int* p = out + ((long long)b * nt + t) * 10;
    p[0] = threadIdx.x;
    p[1] = threadIdx.y;
    p[2] = threadIdx.z;
    p[3] = blockIdx.x;
    p[4] = blockIdx.y;
    p[5] = blockIdx.z;
    p[6] = warpSize;
    p[7] = __syncthreads_and(t < nt);
    p[8] = __syncthreads_and(t != 3);
    p[9] = __syncthreads_or(t == nt - 1) + 2 * __syncthreads_or(0);
}

// ---------------------------------------------------------------------------------------
// Atomics (order-independent uses only, as ABI.md asks).
extern "C" __global__ void st_atomics(int* ci, unsigned* cu, unsigned long long* cull, float* cf,
                                      double* cd, int* mx, unsigned* bits, int* cas_max,
                                      int* tickets) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(&ci[0], 1);
    atomicAdd(cu, 2u);
    atomicAdd(cull, 1ull << 33);
    atomicAdd(cf, 0.5f);
    atomicAdd(cd, 0.25);
    atomicMax(&mx[0], (t * 37) % 101);
    atomicMin(&mx[1], (t * 37) % 101 - 50);
    atomicOr(&bits[0], 1u << (t % 32));
    atomicAnd(&bits[1], ~(1u << (t % 29)));
    atomicOr(reinterpret_cast<int*>(&bits[2]), 1 << (t % 7));
    atomicExch(&ci[2], 7);
    atomicExch(cf + 1, 2.5f);
    int cur = *cas_max;
    for (;;) {
        const int want = max(cur, (t * 3) % 77);
        const int prev = atomicCAS(cas_max, cur, want);
        if (prev == cur) break;
        cur = prev;
    }
    unsigned long long old = atomicCAS(cull + 1, 0ull, (unsigned long long)t + 1);
    if (old == 0) atomicAdd(&ci[3], 1); // exactly one thread wins
    tickets[atomicAdd(&ci[1], 1)] = t;  // the returned old values are a permutation
}

// ---------------------------------------------------------------------------------------
// WMMA: D (32x32) = A (32x48) · B (48x32) + C from 16x16 tiles, a warp per output tile
// (4 warps). A and B in either layout (the fragment types), C loaded and D stored in either
// layout (arguments), optionally staged through dynamic shared memory.
template <class L> struct st_is_col {
    static constexpr bool value = false;
};
template <> struct st_is_col<nvcuda::wmma::col_major> {
    static constexpr bool value = true;
};

template <class T, class LA, class LB>
__device__ void st_gemm(const T* A, const T* B, const float* C, float* D, int lda, int ldb,
                        int ldc, int ldd, int c_col, int d_col, int via_smem, int a_elems,
                        int b_elems) {
    using namespace nvcuda;
    const bool a_col = st_is_col<LA>::value, b_col = st_is_col<LB>::value;
    const int warp = threadIdx.x / 32;
    const int tm = warp / 2, tn = warp % 2;
    const T* a = A;
    const T* b = B;
    if (via_smem) {
        DYNAMIC_SMEM(T, smem);
        T* sa = smem;
        T* sb = smem + (a_elems + 15) / 16 * 16; // keeps sb 32-byte aligned
        for (int i = threadIdx.x; i < a_elems; i += blockDim.x) sa[i] = A[i];
        for (int i = threadIdx.x; i < b_elems; i += blockDim.x) sb[i] = B[i];
        __syncthreads();
        a = sa;
        b = sb;
    }
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::load_matrix_sync(acc, C + (c_col ? tm * 16 + tn * 16 * ldc : tm * 16 * ldc + tn * 16),
                           ldc, c_col ? wmma::mem_col_major : wmma::mem_row_major);
    for (int kk = 0; kk < 3; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LA> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LB> fb;
        wmma::load_matrix_sync(fa, a + (a_col ? tm * 16 + kk * 16 * lda : tm * 16 * lda + kk * 16),
                               lda);
        wmma::load_matrix_sync(fb, b + (b_col ? kk * 16 + tn * 16 * ldb : kk * 16 * ldb + tn * 16),
                               ldb);
        wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(D + (d_col ? tm * 16 + tn * 16 * ldd : tm * 16 * ldd + tn * 16), acc,
                            ldd, d_col ? wmma::mem_col_major : wmma::mem_row_major);
}

#define ST_GEMM(NAME, T, LA, LB)                                                             \
    extern "C" __global__ void NAME(const T* A, const T* B, const float* C, float* D, int lda, \
                                    int ldb, int ldc, int ldd, int c_col, int d_col,         \
                                    int via_smem, int a_elems, int b_elems) {                \
        st_gemm<T, nvcuda::wmma::LA, nvcuda::wmma::LB>(A, B, C, D, lda, ldb, ldc, ldd, c_col, \
                                                       d_col, via_smem, a_elems, b_elems);   \
    }
ST_GEMM(st_gemm_bf16_rr, bf16, row_major, row_major)
ST_GEMM(st_gemm_bf16_rc, bf16, row_major, col_major)
ST_GEMM(st_gemm_bf16_cr, bf16, col_major, row_major)
ST_GEMM(st_gemm_bf16_cc, bf16, col_major, col_major)
ST_GEMM(st_gemm_f16_rc, f16, row_major, col_major)
ST_GEMM(st_gemm_f16_cr, f16, col_major, row_major)

// One 16x16x16 product stored to shared memory, then each lane reads half a row (elements
// that other lanes stored): correct only with the __syncwarp() between.
extern "C" __global__ void st_wmma_store_read(const bf16* A, const bf16* B, float* out,
                                              int sync, float scale) {
    using namespace nvcuda;
    __shared__ __align__(32) float tile[16 * 16];
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::load_matrix_sync(fa, A, 16);
    wmma::load_matrix_sync(fb, B, 16);
    wmma::fill_fragment(acc, 0.0f);
    wmma::mma_sync(acc, fa, fb, acc);
    for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= scale; // element-wise: allowed
    wmma::store_matrix_sync(tile, acc, 16, wmma::mem_row_major);
    if (sync) __syncwarp();
    const int lane = threadIdx.x, r = lane / 2, c0 = (lane % 2) * 8;
    for (int c = 0; c < 8; ++c) out[r * 16 + c0 + c] = tile[r * 16 + c0 + c];
}

// Misuses that the emulator must report.
extern "C" __global__ void st_wmma_misaligned(const bf16* A, float* out) {
    using namespace nvcuda;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, A + 8, 16); // 16 bytes off a 32-byte boundary
    out[threadIdx.x] = 0.0f;
}
extern "C" __global__ void st_wmma_lane_pointers(const bf16* A, float* out) {
    using namespace nvcuda;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, A + (threadIdx.x % 2) * 256, 16); // not uniform across lanes
    out[threadIdx.x] = 0.0f;
}
extern "C" __global__ void st_wmma_partial(const bf16* A, float* out) {
    using namespace nvcuda;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, A, 16); // launched with 16 threads
    out[threadIdx.x] = 0.0f;
}

// ---------------------------------------------------------------------------------------
// 16-bit conversions through the kernel paths: scalar and packed pairs (vector stores).
extern "C" __global__ void st_convert(const float* x, bf16* yb, f16* yh, bf16* pb, f16* ph,
                                      float* back, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n / 2;
         i += gridDim.x * blockDim.x) {
        const float lo = x[2 * i], hi = x[2 * i + 1];
        yb[2 * i] = __float2bfloat16(lo);
        yb[2 * i + 1] = __float2bfloat16(hi);
        yh[2 * i] = __float2half(lo);
        yh[2 * i + 1] = __float2half(hi);
        *reinterpret_cast<__nv_bfloat162*>(pb + 2 * i) = __floats2bfloat162_rn(lo, hi);
        *reinterpret_cast<__half2*>(ph + 2 * i) = __floats2half2_rn(lo, hi);
        const float2 fb = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(pb + 2 * i));
        const float2 fh = __half22float2(*reinterpret_cast<const __half2*>(ph + 2 * i));
        back[4 * i] = fb.x;
        back[4 * i + 1] = fb.y;
        back[4 * i + 2] = fh.x;
        back[4 * i + 3] = fh.y;
    }
}

// ---------------------------------------------------------------------------------------
// Deadlocks and misused barriers, which the emulator must report.
extern "C" __global__ void st_barrier_after_exit(float* out) {
    if (threadIdx.x < 16) {
        __syncthreads(); // threads 16-31 never get here: they return
    }
    out[threadIdx.x] = 1.0f;
}
extern "C" __global__ void st_two_barriers(float* out) {
    if (threadIdx.x < 16) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1.0f;
}
extern "C" __global__ void st_shuffle_vs_barrier(float* out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x == 0) v = __shfl_xor_sync(0xffffffffu, v, 1); // lane 1 is at __syncthreads
    __syncthreads();
    out[threadIdx.x] = v;
}
extern "C" __global__ void st_mask_without_self(float* out) {
    out[threadIdx.x] = __shfl_sync(0x1u, 1.0f, 0); // lanes 1-31 are not in their mask
}
extern "C" __global__ void st_mixed_collectives(float* out) {
    float v = 1.0f;
    if (threadIdx.x < 16)
        __syncwarp();
    else
        v = __shfl_xor_sync(0xffffffffu, v, 1);
    out[threadIdx.x] = v;
}

// Writes x[i] = 1 from thread 0 (to test the guards around emu::alloc buffers).
extern "C" __global__ void st_write_at(float* x, long long i) {
    if (threadIdx.x == 0) x[i] = 1.0f;
}
extern "C" __global__ void st_dynamic_overrun(int n) {
    DYNAMIC_SMEM(unsigned char, buf);
    if (threadIdx.x == 0) buf[n] = 1; // one byte past the end
}

// ---------------------------------------------------------------------------------------
// wgmma (Hopper's warpgroup products): one warpgroup computes out (64 × 16, row-major) =
// A0·B0 + A1·B1, a chain of two k = 16 products into the same accumulators. a: two 64 × 16
// tiles, row-major; bt: two B tiles stored n-major (bt[tile][n][k]). In dynamic shared memory
// (5120 bytes) both are core matrices (8 rows of 16 bytes), LBO 128 bytes along K, SBO 256
// along M or N: A tiles at 0 and 2048, B tiles at 4096 and 4608. ST_WG_OK, ST_WG_CP and
// ST_WG_RS do it right (stores, cp.async for B, A from registers); each other mode breaks
// one rule the emulator checks (selftest_main.cpp's test_wgmma); ST_WG_D_REFENCED and
// ST_WG_SPLIT are right too (wgmma.fence after a write; a chain waited for in between).
enum {
    ST_WG_OK,
    ST_WG_CP,             // B by cp.async, fenced
    ST_WG_RS,             // A from registers
    ST_WG_UNFENCED,       // stores without fence.proxy.async
    ST_WG_FENCE_FIRST,    // the fence before the stores
    ST_WG_CP_UNFENCED,    // cp.async without the fence
    ST_WG_WRITE_D,        // writes an accumulator before the wait
    ST_WG_READ_D,         // reads an accumulator before the wait
    ST_WG_WRITE_A,        // rewrites an A register (register form) before the wait
    ST_WG_WARP_DESC,      // warp 1 gives another B descriptor
    ST_WG_EXTRA,          // warp 3 issues one more wgmma
    ST_WG_NO_WGFENCE,     // no wgmma.fence before the products
    ST_WG_D_AFTER_FENCE,  // writes an accumulator after the wgmma.fence
    ST_WG_D_REFENCED,     // the same write, then wgmma.fence again (right: d[0][1] starts at 1)
    ST_WG_A_AFTER_FENCE,  // rewrites an A register (register form) after the wgmma.fence
    ST_WG_SPLIT,          // waits between the two products, no fence between (right)
    ST_WG_SPLIT_WRITE,    // the same, with an accumulator written between them
};
extern "C" __global__ void st_wgmma(const __nv_bfloat16* a, const __nv_bfloat16* bt, float* out,
                                    int mode) {
    DYNAMIC_SMEM(__nv_bfloat16, sA);   // two A tiles, 1024 values each
    __nv_bfloat16* sB = sA + 2 * 1024; // two B tiles, 256 values each
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    if (mode == ST_WG_FENCE_FIRST) mt_fence_proxy_async();
    for (int i = t; i < 2 * 1024; i += 128) {
        const int m = (i / 16) % 64, k = i % 16;
        sA[(i / 1024) * 1024 + (k / 8) * 64 + (m / 8) * 128 + (m % 8) * 8 + k % 8] = a[i];
    }
    if (mode == ST_WG_CP || mode == ST_WG_CP_UNFENCED) {
        for (int i = t; i < 2 * 16 * 2; i += 128) { // 16 bytes: 8 k values of one n
            const int tile = i / 32, n = (i / 2) % 16, kc = i % 2;
            mt_cp_async_16(sB + tile * 256 + (n / 8) * 128 + (n % 8) * 8 + kc * 64,
                           bt + tile * 256 + n * 16 + kc * 8, 16);
        }
        mt_cp_async_commit();
        mt_cp_async_wait<0>();
    } else {
        for (int i = t; i < 2 * 256; i += 128) {
            const int n = (i / 16) % 16, k = i % 16;
            sB[(i / 256) * 256 + (n / 8) * 128 + (n % 8) * 8 + (k / 8) * 64 + k % 8] = bt[i];
        }
    }
    if (mode != ST_WG_UNFENCED && mode != ST_WG_FENCE_FIRST && mode != ST_WG_CP_UNFENCED)
        mt_fence_proxy_async();
    __syncthreads();

    const int g = lane / 4, c = 2 * (lane % 4), r0 = 16 * warp + g;
    const bool rs = mode == ST_WG_RS || mode == ST_WG_WRITE_A || mode == ST_WG_A_AFTER_FENCE;
    unsigned ra[2][4]; // register form: this lane's A fragments, mma.sync's A layout
    if (rs) {
        for (int kt = 0; kt < 2; ++kt) {
            auto pair = [&](int m, int k) {
                return *reinterpret_cast<const unsigned*>(a + kt * 1024 + m * 16 + k);
            };
            ra[kt][0] = pair(r0, c);
            ra[kt][1] = pair(r0 + 8, c);
            ra[kt][2] = pair(r0, c + 8);
            ra[kt][3] = pair(r0 + 8, c + 8);
        }
    }
    float d[2][4];
    for (int j = 0; j < 2; ++j)
        for (int e = 0; e < 4; ++e) d[j][e] = 0.0f;
    if (mode != ST_WG_NO_WGFENCE) mt_wgmma_fence();
    if (mode == ST_WG_D_AFTER_FENCE || mode == ST_WG_D_REFENCED) d[0][1] = 1.0f;
    if (mode == ST_WG_D_REFENCED) mt_wgmma_fence();
    if (mode == ST_WG_A_AFTER_FENCE) ra[1][2] ^= 1u;
    for (int kt = 0; kt < 2; ++kt) {
        const int off = mode == ST_WG_WARP_DESC && warp == 1 ? 8 : 0;
        const unsigned long long db = mt_wgmma_desc(sB + kt * 256 + off, 128, 256);
        if (rs) mt_wgmma<__nv_bfloat16, 16, 0>(d, ra[kt], db);
        else mt_wgmma_ss<__nv_bfloat16, 16, 0>(d, mt_wgmma_desc(sA + kt * 1024, 128, 256), db);
        if (kt == 0 && (mode == ST_WG_SPLIT || mode == ST_WG_SPLIT_WRITE)) {
            mt_wgmma_commit();
            mt_wgmma_wait<0>(); // no ordinary access, so the next product needs no fence
            if (mode == ST_WG_SPLIT_WRITE) d[1][0] += 1.0f;
        }
    }
    mt_wgmma_commit();
    if (mode == ST_WG_WRITE_D) d[1][2] = 0.0f;
    if (mode == ST_WG_WRITE_A) ra[1][3] ^= 1u;
    const float early = mode == ST_WG_READ_D ? d[0][0] : 0.0f;
    mt_wgmma_wait<0>();
    if (mode == ST_WG_EXTRA && warp == 3) {
        mt_wgmma_ss<__nv_bfloat16, 16, 0>(d, mt_wgmma_desc(sA, 128, 256),
                                          mt_wgmma_desc(sB, 128, 256));
        mt_wgmma_commit();
        mt_wgmma_wait<0>();
    }
    for (int j = 0; j < 2; ++j)
        for (int e = 0; e < 4; ++e)
            out[(r0 + 8 * (e >> 1)) * 16 + 8 * j + c + (e & 1)] = d[j][e] + early;
}
