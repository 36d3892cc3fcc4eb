#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
typedef __nv_bfloat16 bf16;
typedef __half f16;
#define DYNAMIC_SMEM(T, name) extern __shared__ __align__(128) unsigned char name##_dynamic_smem[]; T* name = reinterpret_cast<T*>(name##_dynamic_smem)
// Register-level tensor-core fragments (attention.cu): one PTX instruction each. The lane
// layouts are PTX's (ldmatrix, mma.sync m16n8k16 row.col with f32 accumulators, cp.async);
// the CPU emulator (tests/cuda_emu/cuda_emu.h) implements the same contracts.
__device__ __forceinline__ unsigned mt_smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void mt_ldmatrix_x4(unsigned* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(mt_smem_addr(row))
                 : "memory");
}
__device__ __forceinline__ void mt_ldmatrix_x4_trans(unsigned* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(mt_smem_addr(row))
                 : "memory");
}
template <class T> __device__ __forceinline__ void mt_mma_16816(float* d, const unsigned* a,
                                                                const unsigned* b);
template <> __device__ __forceinline__ void mt_mma_16816<bf16>(float* d, const unsigned* a,
                                                               const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void mt_mma_16816<f16>(float* d, const unsigned* a,
                                                              const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// 16 bytes global -> shared, asynchronously; bytes past src_bytes (0..16) are zero-filled.
__device__ __forceinline__ void mt_cp_async_16(void* smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(mt_smem_addr(smem)),
                 "l"(gmem), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void mt_cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N> __device__ __forceinline__ void mt_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// Hopper's warpgroup products (wgmma, sm_90a only; attention.cu's "wg" kernels): a warpgroup
// of 4 warps computes a 64 × N product, A (64 × 16) from registers in mma.sync's A layout
// (warp w holds rows 16w..16w+15) or from shared memory (mt_wgmma_ss, below), B (16 × N)
// read by the tensor cores straight from shared memory through a 64-bit descriptor, D in
// registers in mma.sync's accumulator layout (warp
// w's rows, n-tile j in d[j]). The product runs asynchronously: fence the registers before,
// commit, and wait before reading D or reusing the shared tile. B's shared layout is
// "interleaved" (no swizzle): core matrices of 8 rows × 16 bytes, 128 contiguous bytes
// each; the descriptor gives the start, LBO (bytes between core matrices along K) and SBO
// (bytes between core matrices along N). TRANS_B = 0: a core matrix row is 8 K values of one
// column n (B stored n-major, e.g. Kᵀ read from K's rows); 1: 8 N values of one k.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MT_HAS_WGMMA 1
#endif
__device__ __forceinline__ unsigned long long mt_wgmma_desc(const void* smem, unsigned lbo,
                                                            unsigned sbo) {
    return (unsigned long long)((mt_smem_addr(smem) & 0x3FFFF) >> 4) |
           ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
           ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32);
}
#ifdef MT_HAS_WGMMA
__device__ __forceinline__ void mt_wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void mt_wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> __device__ __forceinline__ void mt_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Shared memory written by ordinary stores or cp.async and read next by wgmma (the async
// proxy): each writer fences before the barrier that publishes it.
__device__ __forceinline__ void mt_fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Keeps the compiler from moving accesses of accumulators across a product in flight.
template <int N> __device__ __forceinline__ void mt_wgmma_hold(float (*d)[4]) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
        asm volatile("" : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])::"memory");
}
// One m64nNk16 product per N, for bf16 and f16: A from registers (mt_wgmma_n*), or from
// shared memory through its own descriptor (mt_wgmma_ss_n*: A's 64 rows stored K-major as core
// matrices, LBO along K and SBO along M, as B's when TRANS_B is 0); the pointer argument only
// picks the type. MT_WGMMA_D<N> is the asm's list of the N/2 accumulator registers and
// MT_WGMMA_OUT<N> the matching operands, each N's lists extending the smaller N's.
#define MT_WGMMA_OUT8(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define MT_WGMMA_OUT32 MT_WGMMA_OUT8(0), MT_WGMMA_OUT8(1), MT_WGMMA_OUT8(2), MT_WGMMA_OUT8(3)
#define MT_WGMMA_OUT64                                                                            \
    MT_WGMMA_OUT32, MT_WGMMA_OUT8(4), MT_WGMMA_OUT8(5), MT_WGMMA_OUT8(6), MT_WGMMA_OUT8(7)
#define MT_WGMMA_OUT128                                                                           \
    MT_WGMMA_OUT64, MT_WGMMA_OUT8(8), MT_WGMMA_OUT8(9), MT_WGMMA_OUT8(10), MT_WGMMA_OUT8(11),     \
        MT_WGMMA_OUT8(12), MT_WGMMA_OUT8(13), MT_WGMMA_OUT8(14), MT_WGMMA_OUT8(15)
#define MT_WGMMA_REGS32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define MT_WGMMA_REGS64                                                                           \
    MT_WGMMA_REGS32 ", %16, %17, %18, %19, %20, %21, %22, %23, "                                  \
                    "%24, %25, %26, %27, %28, %29, %30, %31"
#define MT_WGMMA_REGS128                                                                          \
    MT_WGMMA_REGS64 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "              \
                    "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "                \
                    "%56, %57, %58, %59, %60, %61, %62, %63"
#define MT_WGMMA_D32 "{" MT_WGMMA_REGS32 "}, "
#define MT_WGMMA_D64 "{" MT_WGMMA_REGS64 "}, "
#define MT_WGMMA_D128 "{" MT_WGMMA_REGS128 "}, "
#define MT_WGMMA(N, TYPE, RS_TAIL, SS_TAIL)                                                       \
    template <int TRANS_B>                                                                        \
    __device__ __forceinline__ void mt_wgmma_n##N(const TYPE*, float (*d)[4], const unsigned* a,  \
                                                  unsigned long long desc) {                      \
        asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TYPE "." #TYPE " "        \
                     MT_WGMMA_D##N RS_TAIL                                                        \
                     : MT_WGMMA_OUT##N                                                            \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc),                     \
                       "n"(TRANS_B));                                                             \
    }                                                                                             \
    template <int TRANS_B>                                                                        \
    __device__ __forceinline__ void mt_wgmma_ss_n##N(const TYPE*, float (*d)[4],                  \
                                                     unsigned long long desc_a,                   \
                                                     unsigned long long desc_b) {                 \
        asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TYPE "." #TYPE " "        \
                     MT_WGMMA_D##N SS_TAIL                                                        \
                     : MT_WGMMA_OUT##N                                                            \
                     : "l"(desc_a), "l"(desc_b), "n"(TRANS_B));                                   \
    }
// The operand numbers after the N/2 accumulators: A's 4 registers (or its descriptor), B's
// descriptor, scale-d, scale-a, scale-b, (trans-a,) trans-b.
MT_WGMMA(32, bf16, "{%16, %17, %18, %19}, %20, 1, 1, 1, %21;", "%16, %17, 1, 1, 1, 0, %18;")
MT_WGMMA(32, f16, "{%16, %17, %18, %19}, %20, 1, 1, 1, %21;", "%16, %17, 1, 1, 1, 0, %18;")
MT_WGMMA(64, bf16, "{%32, %33, %34, %35}, %36, 1, 1, 1, %37;", "%32, %33, 1, 1, 1, 0, %34;")
MT_WGMMA(64, f16, "{%32, %33, %34, %35}, %36, 1, 1, 1, %37;", "%32, %33, 1, 1, 1, 0, %34;")
MT_WGMMA(128, bf16, "{%64, %65, %66, %67}, %68, 1, 1, 1, %69;", "%64, %65, 1, 1, 1, 0, %66;")
MT_WGMMA(128, f16, "{%64, %65, %66, %67}, %68, 1, 1, 1, %69;", "%64, %65, 1, 1, 1, 0, %66;")
template <class T, int N, int TRANS_B>
__device__ __forceinline__ void mt_wgmma(float (*d)[4], const unsigned* a,
                                         unsigned long long desc) {
    static_assert(N == 32 || N == 64 || N == 128, "wgmma products of N = 32, 64 or 128");
    if constexpr (N == 32) mt_wgmma_n32<TRANS_B>((const T*)nullptr, d, a, desc);
    else if constexpr (N == 64) mt_wgmma_n64<TRANS_B>((const T*)nullptr, d, a, desc);
    else mt_wgmma_n128<TRANS_B>((const T*)nullptr, d, a, desc);
}
template <class T, int N, int TRANS_B>
__device__ __forceinline__ void mt_wgmma_ss(float (*d)[4], unsigned long long desc_a,
                                            unsigned long long desc_b) {
    static_assert(N == 32 || N == 64 || N == 128, "wgmma products of N = 32, 64 or 128");
    if constexpr (N == 32) mt_wgmma_ss_n32<TRANS_B>((const T*)nullptr, d, desc_a, desc_b);
    else if constexpr (N == 64) mt_wgmma_ss_n64<TRANS_B>((const T*)nullptr, d, desc_a, desc_b);
    else mt_wgmma_ss_n128<TRANS_B>((const T*)nullptr, d, desc_a, desc_b);
}
#else
// Other architectures compile the wgmma kernels to a trap; the host never launches them there.
__device__ __forceinline__ void mt_wgmma_fence() {}
__device__ __forceinline__ void mt_wgmma_commit() {}
template <int N> __device__ __forceinline__ void mt_wgmma_wait() {}
__device__ __forceinline__ void mt_fence_proxy_async() {}
template <int N> __device__ __forceinline__ void mt_wgmma_hold(float (*)[4]) {}
template <class T, int N, int TRANS_B>
__device__ __forceinline__ void mt_wgmma(float (*)[4], const unsigned*, unsigned long long) {
    __trap();
}
template <class T, int N, int TRANS_B>
__device__ __forceinline__ void mt_wgmma_ss(float (*)[4], unsigned long long, unsigned long long) {
    __trap();
}
#endif
