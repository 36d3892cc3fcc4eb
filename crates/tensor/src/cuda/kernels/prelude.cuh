#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
typedef __nv_bfloat16 bf16;
typedef __half f16;
#define DYNAMIC_SMEM(T, name) extern __shared__ __align__(128) unsigned char name##_dynamic_smem[]; T* name = reinterpret_cast<T*>(name##_dynamic_smem)
