// The interface between the two halves of the emulated CUDA device: kernels.cpp (the kernels
// and products, built against cuda_emu.h) and driver.cpp (the driver, NVRTC and cuBLASLt
// entry points, built against CUDA's own cuda.h and nvrtc.h). Plain C so the halves share no
// types beyond these.
#pragma once
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/// The kernel called `name` (an opaque handle), or NULL.
const void* emu_device_find_kernel(const char* name);
const char* emu_device_kernel_name(const void* kernel);
/// How many parameters `kernel` takes; their sizes in `*sizes`.
size_t emu_device_kernel_params(const void* kernel, const size_t** sizes);
/// Runs `kernel` on the CPU emulator; non-zero on a launch error, whose message goes to `err`.
int emu_device_launch(const void* kernel, const unsigned grid[3], const unsigned block[3],
                      size_t smem, void** params, char* err, size_t err_len);

/// cudaDataType values (library_types.h) the products take.
enum { EMU_R_32F = 0, EMU_R_16F = 2, EMU_R_16BF = 14, EMU_R_8F_E4M3 = 28, EMU_R_8F_E5M2 = 29 };
/// cublasLtEpilogue_t values the products run.
enum {
    EMU_EPILOGUE_DEFAULT = 1,
    EMU_EPILOGUE_BIAS = 4,
    EMU_EPILOGUE_GELU_AUX = 160,
    EMU_EPILOGUE_GELU_AUX_BIAS = 164,
    EMU_EPILOGUE_DGELU = 192,
    EMU_EPILOGUE_BGRADB = 512,
};

/// One cublasLtMatmul with C = D, its descriptors resolved.
typedef struct EmuGemm {
    size_t m, n, k;
    int transa, transb;
    const void* a;
    size_t lda;
    int a_type;
    const void* b;
    size_t ldb;
    int b_type;
    void* d;
    size_t ldd;
    int d_type;
    float alpha, beta;
    int compute_tf32;
    int epilogue;
    void* bias; /* D's type */
    void* aux;  /* D's type */
    size_t aux_ld;
    const float* a_scale; /* FP8 operands: their decode factors */
    const float* b_scale;
} EmuGemm;

/// Whether emu_device_gemm runs these operand, output and epilogue kinds: what the emulated
/// cuBLASLt's heuristic offers an algorithm for, and what the product itself accepts.
int emu_device_gemm_runs(int a_type, int b_type, int d_type, int epilogue);
int emu_device_gemm(const EmuGemm* g, char* err, size_t err_len);
/// Device memory: one of the emulator's guarded buffers (NULL when it cannot be mapped), and
/// its release (non-zero for a pointer that is not one).
void* emu_device_alloc(size_t bytes);
int emu_device_free(void* p);
/// f64 to bf16 / f16 bits, rounded to nearest even, and back (the emulator's conversions).
unsigned short emu_device_to_bf16(double v);
unsigned short emu_device_to_f16(double v);
float emu_device_from_bf16(unsigned short bits);
float emu_device_from_f16(unsigned short bits);
/// For the emulated NCCL (nccl.cpp), from driver.cpp: whether [p, p + bytes) lies inside one
/// device buffer; the current context's device; fn(arg) run in `stream`'s order (at once
/// unless EMU_DEVICE_STREAMS=async) outside the device's lock, since NCCL's work waits for
/// peers there, as its kernels do on a card.
int emu_device_in_memory(const void* p, size_t bytes);
int emu_device_current_ordinal(void);
void emu_device_enqueue(void* stream, void (*fn)(void*), void* arg);
double emu_device_fp8_decode(unsigned char code, int exponent_bits, int mantissa_bits);

#ifdef __cplusplus
}
#endif
