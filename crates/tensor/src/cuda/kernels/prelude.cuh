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
