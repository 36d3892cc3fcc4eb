// cuda_emu.h: a CPU emulator for meshtrain's CUDA kernels (C++17, g++ >= 12, Linux/POSIX).
//
// The kernel files in crates/tensor/src/cuda/kernels/ are CUDA C++ that NVRTC compiles on a
// GPU machine. This header lets g++ compile the *same* text as host code and run it, so the
// kernels' logic can be tested where there is no GPU (this machine, CI). It provides exactly
// the prelude that kernels/ABI.md ("The prelude (what a kernel may use)") promises, plus a
// small test API (emu::launch, emu::alloc, check helpers).
//
// How a launch runs (see emu::launch):
//   * Blocks run one after another on the calling OS thread. Within a block every CUDA thread
//     is a cooperative fiber with its own stack. Fibers run round-robin, each until it reaches
//     a synchronisation point (__syncthreads, __syncwarp, a shuffle or vote, a wmma
//     collective) or returns. Nothing is preemptive, so the run is fully deterministic, and
//     plain read-modify-write is atomic (atomics are plain code).
//   * A barrier completes when all its participants have arrived: the whole block for
//     __syncthreads; for a warp collective the lanes named in its mask that exist (the last
//     warp of a block may be partial) and have not exited. The fiber that completes a barrier
//     carries on without yielding; the others resume on the scheduler's next visit.
//   * If no fiber can run and some have not finished, the block is deadlocked: emu::launch
//     throws emu::Error describing where every thread waits (file:line of each barrier).
//   * Because blocks run one at a time, `__shared__` is plain static storage. It lives in its
//     own linker section ("emu_shared"), which is filled with a garbage byte (0xCD) at the
//     start of every block, as is the dynamic shared memory: reading shared memory a block did
//     not write shows up as garbage instead of a stale but plausible value.
//   * Fibers run in thread order by default. EMU_SCHEDULE=reverse runs blocks and threads in
//     reverse order, EMU_SCHEDULE=random:SEED in a seeded random order (both deterministic):
//     a kernel without data races gives bit-identical results under every schedule, so
//     running tests under two schedules exposes missing barriers (run_emu_tests.sh does).
//
// What is deliberately NOT emulated: timing, occupancy, register/shared-memory limits of a
// kernel (only the launch-wide limits are checked), __launch_bounds__ (a no-op: a launch with
// more threads than the bound is not rejected), memory ordering weaker than "each fiber's
// writes become visible at its next yield", cooperation between blocks of one launch (blocks
// are sequential, so spinning on another block's flag hangs), the exact rounding of tensor
// cores and of the fast-math intrinsics (__expf & co. map to the precise functions), and
// NVRTC's fused multiply-add contraction (GPU results may differ in the last bits: compare
// with tolerances, not bits, unless the kernel pins its arithmetic with fmaf/__f*_rn).
// The emulator is more lenient than NVRTC about host-only C++ (the standard library is
// visible here): a kernel that compiles here may still fail to compile with NVRTC
// (kernels/nvrtc_check.py checks that).
//
// What the emulator reports (emu::launch throws emu::Error naming the kernel, the launch site,
// the block, the thread and the source line of the offending call):
//   * deadlocks, including __syncthreads() after some threads returned, a warp collective
//     waiting for lanes that wait at __syncthreads(), and masks that never meet;
//   * threads of a block at different __syncthreads() calls (divergent barriers);
//   * warp collectives whose lanes disagree (different collectives, widths or value sizes; a
//     mask without the calling lane; wmma calls with different pointers/ldm per lane, from a
//     partial warp, with a pointer not 32-byte aligned or an ldm not a multiple of 16 bytes);
//   * launch limits: more than 1024 threads or 227 KiB of dynamic shared memory, zero or
//     oversized dimensions;
//   * Hopper wgmma misuse (see emu_wg): accumulator or A registers written while the product
//     is in flight, or written by ordinary code after the thread's last wgmma.fence and read
//     by a wgmma (and a wgmma with no wgmma.fence before it), shared bytes a wgmma reads that
//     the generic proxy (stores, cp.async) wrote without a later fence.proxy.async, warps of a
//     warpgroup issuing different wgmmas, and products (or cp.async copies) never waited for;
//   * writes past the end of the dynamic shared memory or of an emu::alloc buffer (into the
//     padding up to the next 128/256 bytes: checked after each block/launch; further: a
//     guard page faults and the SIGSEGV handler names the buffer, kernel, block and thread).
// And what it makes visible instead of reporting: garbage (NaN for floats) from shuffles that
// read lanes outside the mask, exited or missing lanes; 0xCD garbage in shared memory a block
// reads before writing; NaN in emu::alloc buffers a kernel should have written; NaN from a
// wgmma's accumulators read while the product is in flight; results that change with
// EMU_SCHEDULE when a barrier is missing.
//
// Using it (run_emu_tests.sh has the compile flags; a test program is one translation unit):
//     #include "cuda_emu.h"
//     #include "common.cuh"
//     #include "bias.cu"
//     int main() {
//         float* y = emu::upload(host_y);                  // "device" copy of a std::vector
//         float* partial = emu::alloc<float>(nb * cols);   // NaN-filled
//         emu::launch(colsum_partial_f32, dim3(gx, gy), 256, 0, y, partial, rows, cols, rpb);
//         emu::check_close("partial", partial, want.data(), nb * cols, 1e-6, 1e-6);
//         return emu::finish("bias_test");                 // non-zero if a check failed
//     }
//
// Environment variables (read at the first launch):
//   EMU_SCHEDULE       forward (default) | reverse | random[:SEED]
//   EMU_STACK_KIB      stack size of each CUDA thread's fiber, KiB (default 256)
//   EMU_EXITED_ARRIVE  1: threads that returned count as arrived at __syncthreads (what current
//                      hardware happens to do); default: such a barrier is a deadlock, since
//                      CUDA calls it undefined behaviour.
//   EMU_SMEM_POISON    the byte shared memory is filled with at each block start (default 0xCD)
#ifndef MESHTRAIN_CUDA_EMU_H
#define MESHTRAIN_CUDA_EMU_H

#if !defined(__cplusplus) || __cplusplus < 201703L
#error "cuda_emu.h needs C++17"
#endif

#include <cxxabi.h>
#include <dlfcn.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <math.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

/// Defined when kernel code is compiled by this emulator (never on the GPU).
#define MESHTRAIN_CUDA_EMU 1

// Kernels use `#pragma unroll`, which g++ does not know: compile with -Wno-unknown-pragmas
// (g++ 12 ignores `#pragma GCC diagnostic` for this warning, so the header cannot).

// =======================================================================================
// Qualifiers. All are no-ops on the host, except:
// - __shared__: static storage (blocks run one at a time) in the "emu_shared" section, so the
//   emulator can poison all of it at each block start (the linker defines
//   __start_emu_shared/__stop_emu_shared around it);
// - __align__(n): the GNU attribute, which (unlike alignas) is accepted in every position
//   CUDA code puts __align__.
// __restrict__ is a g++ keyword already.
// =======================================================================================
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static __attribute__((section("emu_shared")))

extern "C" {
// Bounds of the emu_shared section; weak so a program without __shared__ variables links.
extern char __start_emu_shared[] __attribute__((weak));
extern char __stop_emu_shared[] __attribute__((weak));
}

// =======================================================================================
// Vector types. Same sizes and alignments as CUDA's, so reinterpret_cast vector loads of
// kernels work. may_alias: kernels read bf16 buffers through uint4* and float buffers through
// float4*, which C++'s type-based aliasing rules would let g++ -O2 reorder (nvcc does not).
// =======================================================================================
#define EMU_VEC2(T, name, align)                                                             \
    struct __attribute__((aligned(align), may_alias)) name {                                 \
        T x, y;                                                                              \
    };                                                                                       \
    inline name make_##name(T x, T y) { return name{x, y}; }
#define EMU_VEC3(T, name)                                                                    \
    struct __attribute__((may_alias)) name {                                                 \
        T x, y, z;                                                                           \
    };                                                                                       \
    inline name make_##name(T x, T y, T z) { return name{x, y, z}; }
#define EMU_VEC4(T, name, align)                                                             \
    struct __attribute__((aligned(align), may_alias)) name {                                 \
        T x, y, z, w;                                                                        \
    };                                                                                       \
    inline name make_##name(T x, T y, T z, T w) { return name{x, y, z, w}; }

EMU_VEC2(float, float2, 8)
EMU_VEC3(float, float3)
EMU_VEC4(float, float4, 16)
EMU_VEC2(int, int2, 8)
EMU_VEC3(int, int3)
EMU_VEC4(int, int4, 16)
EMU_VEC2(unsigned int, uint2, 8)
EMU_VEC3(unsigned int, uint3)
EMU_VEC4(unsigned int, uint4, 16)
EMU_VEC2(double, double2, 16)
EMU_VEC2(long long, longlong2, 16)
EMU_VEC2(unsigned long long, ulonglong2, 16)
#undef EMU_VEC2
#undef EMU_VEC3
#undef EMU_VEC4

static_assert(sizeof(float4) == 16 && alignof(float4) == 16, "float4 layout");
static_assert(sizeof(uint2) == 8 && alignof(uint2) == 8, "uint2 layout");

/// Launch dimensions; unspecified components are 1, as in CUDA.
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
        : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

// =======================================================================================
// 16-bit floats. Plain 16-bit structs with the IEEE bit layouts (bf16: 1-8-7, f16: 1-5-10).
// Conversions from float/double round to nearest even (overflow to infinity, subnormals
// kept); a NaN becomes the canonical NaN 0x7FFF, as the GPU's cvt.rn does. Conversion to
// float is exact. There is no 16-bit arithmetic: the implicit conversion to float makes
// `a + b` a float expression (kernels convert to float anyway, see ABI.md).
// =======================================================================================
namespace emu {
namespace detail {

inline unsigned f32_bits(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float f32_from_bits(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

/// Rounds `d` to nearest even in a binary format with EB exponent bits and MB mantissa bits
/// (IEEE style: bias 2^(EB-1)-1, subnormals, all-ones exponent for inf/NaN). One rounding,
/// from the exact double (float -> double is exact, so this also serves float inputs).
template <int EB, int MB>
inline unsigned short round_to_small_float(double d) {
    std::uint64_t bits;
    std::memcpy(&bits, &d, 8);
    const unsigned sign = (unsigned)(bits >> 63) << 15;
    const std::uint64_t mag = bits & 0x7FFFFFFFFFFFFFFFull;
    const unsigned inf = ((1u << EB) - 1) << MB;
    if (mag > 0x7FF0000000000000ull) return 0x7FFF; // NaN: canonical
    if (mag == 0x7FF0000000000000ull) return (unsigned short)(sign | inf);
    const int dexp = (int)(mag >> 52);
    if (dexp == 0) return (unsigned short)sign; // double subnormal: far below any result
    const int bias = (1 << (EB - 1)) - 1;
    const int e = dexp - 1023;                                     // unbiased exponent
    const std::uint64_t mant = (mag & ((1ull << 52) - 1)) | (1ull << 52); // 53 bits
    // Bits to drop: 52 - MB for a normal result, more below the smallest normal exponent.
    const int below = (1 - bias) - e;
    const int shift = 52 - MB + (below > 0 ? below : 0);
    if (shift > 54) return (unsigned short)sign; // < half the smallest subnormal
    std::uint64_t q = mant >> shift;
    const std::uint64_t rem = mant & ((1ull << shift) - 1), halfway = 1ull << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1))) ++q;
    // Normal: the implicit bit of q lands in the exponent field (and a carry from rounding
    // moves to the next binade, or to infinity). Subnormal: q is the encoding (q == 2^MB is
    // the smallest normal, which is also right).
    std::uint64_t r = below > 0 ? q : ((std::uint64_t)(e + bias - 1) << MB) + q;
    if (r >= inf) r = inf;
    return (unsigned short)(sign | (unsigned)r);
}

inline unsigned short float_to_bf16_bits(float f) { return round_to_small_float<8, 7>(f); }
inline unsigned short float_to_f16_bits(float f) { return round_to_small_float<5, 10>(f); }
inline float bf16_bits_to_float(unsigned short h) { return f32_from_bits((unsigned)h << 16); }
inline float f16_bits_to_float(unsigned short h) {
    const unsigned sign = (unsigned)(h & 0x8000) << 16;
    const unsigned e = (h >> 10) & 0x1F, m = h & 0x3FF;
    if (e == 0x1F) return f32_from_bits(sign | 0x7F800000u | (m << 13)); // inf / NaN (payload)
    if (e != 0) return f32_from_bits(sign | ((e + 112) << 23) | (m << 13));
    const float v = (float)m * 5.9604644775390625e-08f; // m · 2^-24, exact
    return sign ? -v : v;
}

} // namespace detail
} // namespace emu

/// bfloat16 (CUDA's __nv_bfloat16): 1 sign, 8 exponent, 7 mantissa bits.
struct __attribute__((aligned(2), may_alias)) __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(emu::detail::float_to_bf16_bits(f)) {}
    __nv_bfloat16(double d) : __x(emu::detail::round_to_small_float<8, 7>(d)) {}
    __nv_bfloat16(int v) : __nv_bfloat16((double)v) {}
    __nv_bfloat16(unsigned int v) : __nv_bfloat16((double)v) {}
    __nv_bfloat16(long v) : __nv_bfloat16((double)v) {}
    __nv_bfloat16(unsigned long v) : __nv_bfloat16((double)v) {}
    __nv_bfloat16(long long v) : __nv_bfloat16((double)v) {}
    __nv_bfloat16(unsigned long long v) : __nv_bfloat16((double)v) {}
    operator float() const { return emu::detail::bf16_bits_to_float(__x); }
};

/// IEEE binary16 (CUDA's __half): 1 sign, 5 exponent, 10 mantissa bits.
struct __attribute__((aligned(2), may_alias)) __half {
    unsigned short __x;
    __half() = default;
    __half(float f) : __x(emu::detail::float_to_f16_bits(f)) {}
    __half(double d) : __x(emu::detail::round_to_small_float<5, 10>(d)) {}
    __half(int v) : __half((double)v) {}
    __half(unsigned int v) : __half((double)v) {}
    __half(long v) : __half((double)v) {}
    __half(unsigned long v) : __half((double)v) {}
    __half(long long v) : __half((double)v) {}
    __half(unsigned long long v) : __half((double)v) {}
    operator float() const { return emu::detail::f16_bits_to_float(__x); }
};

/// Two bf16 in one 32-bit word: x is the low half (first in memory).
struct __attribute__((aligned(4), may_alias)) __nv_bfloat162 {
    __nv_bfloat16 x, y;
    __nv_bfloat162() = default;
    __nv_bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) : x(a), y(b) {}
};
/// Two f16 in one 32-bit word: x is the low half (first in memory).
struct __attribute__((aligned(4), may_alias)) __half2 {
    __half x, y;
    __half2() = default;
    __half2(__half a, __half b) : x(a), y(b) {}
};

struct __nv_bfloat16_raw {
    unsigned short x;
};
struct __half_raw {
    unsigned short x;
};

typedef __nv_bfloat16 bf16;
typedef __half f16;

static_assert(sizeof(__nv_bfloat16) == 2 && sizeof(__half) == 2, "16-bit floats are 2 bytes");
static_assert(sizeof(__nv_bfloat162) == 4 && sizeof(__half2) == 4, "pairs are 4 bytes");
static_assert(std::is_trivially_copyable<bf16>::value && std::is_trivial<bf16>::value,
              "bf16 must be trivial (it is used in __shared__ arrays and memcpy)");
static_assert(std::is_trivial<f16>::value && std::is_trivial<__half2>::value, "trivial");

// Conversions (ABI.md lists the ones kernels use; a few siblings are provided too).
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16(d); }
inline float __bfloat162float(__nv_bfloat16 h) { return (float)h; }
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __double2half(double d) { return __half(d); }
inline float __half2float(__half h) { return (float)h; }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
    return __nv_bfloat162(__nv_bfloat16(lo), __nv_bfloat16(hi));
}
inline __half2 __floats2half2_rn(float lo, float hi) { return __half2(__half(lo), __half(hi)); }
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
inline __half2 __float22half2_rn(float2 v) { return __floats2half2_rn(v.x, v.y); }
inline __nv_bfloat162 __float2bfloat162_rn(float f) { return __floats2bfloat162_rn(f, f); }
inline __half2 __float2half2_rn(float f) { return __floats2half2_rn(f, f); }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 lo, __nv_bfloat16 hi) {
    return __nv_bfloat162(lo, hi);
}
inline __half2 __halves2half2(__half lo, __half hi) { return __half2(lo, hi); }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return make_float2((float)v.x, (float)v.y); }
inline float2 __half22float2(__half2 v) { return make_float2((float)v.x, (float)v.y); }
inline float __low2float(__nv_bfloat162 v) { return (float)v.x; }
inline float __high2float(__nv_bfloat162 v) { return (float)v.y; }
inline float __low2float(__half2 v) { return (float)v.x; }
inline float __high2float(__half2 v) { return (float)v.y; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
    __nv_bfloat16 h;
    h.__x = u;
    return h;
}
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) {
    __half h;
    h.__x = u;
    return h;
}
inline int __float_as_int(float f) { return (int)emu::detail::f32_bits(f); }
inline float __int_as_float(int i) { return emu::detail::f32_from_bits((unsigned)i); }
inline unsigned int __float_as_uint(float f) { return emu::detail::f32_bits(f); }
inline float __uint_as_float(unsigned int u) { return emu::detail::f32_from_bits(u); }
inline long long __double_as_longlong(double d) {
    long long v;
    std::memcpy(&v, &d, 8);
    return v;
}
inline double __longlong_as_double(long long v) {
    double d;
    std::memcpy(&d, &v, 8);
    return d;
}
/// C++'s double -> float conversion rounds to nearest even (the default rounding mode).
inline float __double2float_rn(double d) { return (float)d; }
inline float __int2float_rn(int i) { return (float)i; }
inline float __ll2float_rn(long long i) { return (float)i; }
/// Round to nearest even, saturating, NaN -> 0 (cvt.rni.s32.f32).
inline int __float2int_rn(float f) {
    if (f != f) return 0;
    const float r = nearbyintf(f);
    if (r >= 2147483648.0f) return 2147483647;
    if (r < -2147483648.0f) return (-2147483647 - 1);
    return (int)r;
}
/// Round toward zero, saturating, NaN -> 0 (cvt.rzi.s32.f32).
inline int __float2int_rz(float f) {
    if (f != f) return 0;
    const float r = truncf(f);
    if (r >= 2147483648.0f) return 2147483647;
    if (r < -2147483648.0f) return (-2147483647 - 1);
    return (int)r;
}

// =======================================================================================
// Math. <math.h> provides expf, exp2f, logf, log2f, sqrtf, erff, tanhf, fmaxf, fminf, fabsf,
// fmaf, sqrt, isfinite, isnan, isinf and INFINITY in the global namespace. The fast
// intrinsics map to the precise functions (GPU results of __expf & co. differ slightly).
// =======================================================================================
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return powf(10.0f, x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float a, float b) { return powf(a, b); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
/// Clamp to [0, 1]; NaN gives 0.
inline float __saturatef(float x) { return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f; }

// CUDA's global min/max overloads (same-type, the signed/unsigned mixes it resolves to the
// unsigned type, and float/double mixes). Ambiguous calls are ambiguous in CUDA too.
#define EMU_MINMAX(R, A, B)                                                                  \
    inline R min(A a, B b) { return (R)a < (R)b ? (R)a : (R)b; }                             \
    inline R max(A a, B b) { return (R)a > (R)b ? (R)a : (R)b; }
EMU_MINMAX(int, int, int)
EMU_MINMAX(unsigned int, unsigned int, unsigned int)
EMU_MINMAX(unsigned int, int, unsigned int)
EMU_MINMAX(unsigned int, unsigned int, int)
EMU_MINMAX(long, long, long)
EMU_MINMAX(unsigned long, unsigned long, unsigned long)
EMU_MINMAX(unsigned long, long, unsigned long)
EMU_MINMAX(unsigned long, unsigned long, long)
EMU_MINMAX(long long, long long, long long)
EMU_MINMAX(unsigned long long, unsigned long long, unsigned long long)
EMU_MINMAX(unsigned long long, long long, unsigned long long)
EMU_MINMAX(unsigned long long, unsigned long long, long long)
#undef EMU_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(float a, double b) { return fmin((double)a, b); }
inline double max(float a, double b) { return fmax((double)a, b); }
inline double min(double a, float b) { return fmin(a, (double)b); }
inline double max(double a, float b) { return fmax(a, (double)b); }

// Bit manipulation.
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned int __brev(unsigned int x) {
    unsigned int r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}

// =======================================================================================
// The runtime: fibers, the scheduler, barriers.
// =======================================================================================
namespace emu {

/// What emu::launch (and the other API functions) throw on a kernel or launch error: a
/// deadlock, a misused collective, bad launch dimensions, a write past a buffer's end...
/// The message says which kernel, block and thread, and where in the source.
struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

/// The order in which blocks, and the threads of a block, are run (see the top of the file).
enum class Schedule { Forward, Reverse, Random };

/// Counters since the start of the program (for curiosity and performance tuning).
struct Stats {
    unsigned long long launches = 0, blocks = 0, threads = 0, switches = 0;
};

namespace detail {

inline std::string vfmt(const char* f, va_list ap) {
    va_list copy;
    va_copy(copy, ap);
    char buf[512];
    const int n = std::vsnprintf(buf, sizeof buf, f, copy);
    va_end(copy);
    if (n < 0) return f;
    if ((size_t)n < sizeof buf) return std::string(buf, (size_t)n);
    std::string s((size_t)n + 1, '\0');
    std::vsnprintf(&s[0], s.size(), f, ap);
    s.resize((size_t)n);
    return s;
}
inline std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
inline std::string fmt(const char* f, ...) {
    va_list ap;
    va_start(ap, f);
    std::string s = vfmt(f, ap);
    va_end(ap);
    return s;
}

/// A place in the source: captured with __builtin_FILE()/__builtin_LINE() as default
/// arguments, so every barrier knows the kernel line that called it.
struct Site {
    const char* file = nullptr;
    int line = 0;
};
inline const char* base_name(const char* p) {
    if (!p) return "?";
    const char* s = std::strrchr(p, '/');
    return s ? s + 1 : p;
}
inline std::string site_str(Site s) { return fmt("%s:%d", base_name(s.file), s.line); }
inline bool same_site(Site a, Site b) {
    return a.line == b.line &&
           (a.file == b.file || (a.file && b.file && std::strcmp(a.file, b.file) == 0));
}

#define EMU_SITE_PARAMS const char *emu_file = __builtin_FILE(), int emu_line = __builtin_LINE()
#define EMU_SITE ::emu::detail::Site{emu_file, emu_line}

template <class T> struct dependent_false : std::false_type {};
template <class T> struct identity {
    using type = T;
};

inline size_t page_size() {
    static const size_t p = (size_t)sysconf(_SC_PAGESIZE);
    return p;
}
inline size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// ---------------------------------------------------------------------------------------
// Context switching. On x86-64 a 20-instruction switch that saves the callee-saved
// registers (and the SSE/x87 control words) on the fiber's stack; elsewhere (or with
// EMU_USE_UCONTEXT, or with -fcf-protection, whose shadow stack a hand-made switch would
// upset) POSIX ucontext, which is portable but makes a system call per switch.
#if defined(__x86_64__) && !defined(__CET__) && !defined(EMU_USE_UCONTEXT)
#define EMU_FAST_SWITCH 1
#else
#define EMU_FAST_SWITCH 0
#endif

#if EMU_FAST_SWITCH
} // namespace detail
} // namespace emu
// A local symbol (no .globl), so each translation unit that includes this header has its own
// copy and nothing clashes at link time.
extern "C" __attribute__((visibility("hidden"))) void emu_detail_switch(void** save_sp,
                                                                         void* load_sp);
asm(R"(
    .pushsection .text
    .p2align 4
    .type emu_detail_switch, @function
emu_detail_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_detail_switch, .-emu_detail_switch
    .popsection
)");
namespace emu {
namespace detail {
struct Ctx {
    void* sp = nullptr;
};
/// Prepares `c` so that switching to it calls `entry()` on the stack [lo, lo + size).
inline void ctx_make(Ctx& c, char* lo, size_t size, void (*entry)()) {
    std::uintptr_t top = ((std::uintptr_t)(lo + size)) & ~(std::uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;              // entry's return address (it never returns); keeps the
                                  // stack 16-byte aligned at entry, as after a call
    *--sp = (void*)entry;         // popped by the switch's `ret`
    for (int i = 0; i < 6; ++i) *--sp = nullptr; // rbp rbx r12 r13 r14 r15
    --sp;
    const std::uint32_t csr[2] = {0x1F80u, 0x037Fu}; // default MXCSR, x87 control word
    std::memcpy(sp, csr, 8);
    c.sp = sp;
}
inline void ctx_switch(Ctx& from, Ctx& to) { emu_detail_switch(&from.sp, to.sp); }
#else
struct Ctx {
    ucontext_t uc;
};
inline void ctx_make(Ctx& c, char* lo, size_t size, void (*entry)()) {
    if (getcontext(&c.uc) != 0) {
        std::perror("emu: getcontext");
        std::abort();
    }
    c.uc.uc_stack.ss_sp = lo;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
inline void ctx_switch(Ctx& from, Ctx& to) {
    if (swapcontext(&from.uc, &to.uc) != 0) {
        std::perror("emu: swapcontext");
        std::abort();
    }
}
#endif

// ---------------------------------------------------------------------------------------
// Options.
struct Options {
    bool loaded = false;
    Schedule schedule = Schedule::Forward;
    std::uint64_t seed = 1;
    size_t stack_bytes = 256 * 1024;
    bool exited_arrive = false;
    unsigned char smem_poison = 0xCD;
};
inline Options& options() {
    static Options& o = *new Options;  // never destroyed: see run()
    if (!o.loaded) {
        o.loaded = true;
        if (const char* s = std::getenv("EMU_SCHEDULE")) {
            if (std::strcmp(s, "reverse") == 0) {
                o.schedule = Schedule::Reverse;
            } else if (std::strncmp(s, "random", 6) == 0) {
                o.schedule = Schedule::Random;
                if (s[6] == ':') o.seed = std::strtoull(s + 7, nullptr, 0);
            } else if (*s && std::strcmp(s, "forward") != 0) {
                std::fprintf(stderr, "emu: unknown EMU_SCHEDULE=%s (forward|reverse|random:N)\n",
                             s);
                std::exit(2);
            }
        }
        if (const char* s = std::getenv("EMU_STACK_KIB")) {
            const unsigned long k = std::strtoul(s, nullptr, 0);
            if (k >= 16) o.stack_bytes = (size_t)k * 1024;
        }
        if (const char* s = std::getenv("EMU_EXITED_ARRIVE")) o.exited_arrive = *s && *s != '0';
        if (const char* s = std::getenv("EMU_SMEM_POISON"))
            o.smem_poison = (unsigned char)std::strtoul(s, nullptr, 0);
    }
    return o;
}

inline Stats& stats_ref() {
    static Stats& s = *new Stats;  // never destroyed: see run()
    return s;
}

/// splitmix64: the deterministic generator of the random schedule.
struct SplitMix {
    std::uint64_t s;
    std::uint64_t next() {
        std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    std::uint64_t below(std::uint64_t n) { return next() % n; }
};
inline SplitMix& schedule_rng() {
    static SplitMix& r = *new SplitMix{1};  // never destroyed: see run()
    return r;
}

// ---------------------------------------------------------------------------------------
// Fibers and warps.

enum class FState : unsigned char { Ready, Running, AtBlockBarrier, AtWarpCollective, Exited };

/// The warp-level collectives. Lanes meet in a group keyed by the mask; all of a group must
/// be at the same kind of collective (with the same width and value size for shuffles, the
/// same pointer/ldm/layout for wmma), else the kernel is wrong and the launch fails.
enum class WOp : unsigned char {
    SyncWarp,
    ShflIdx,
    ShflUp,
    ShflDown,
    ShflXor,
    Ballot,
    Any,
    All,
    WmmaLoad,
    WmmaStore,
    WmmaMma
};
inline const char* wop_name(WOp op) {
    switch (op) {
    case WOp::SyncWarp: return "__syncwarp";
    case WOp::ShflIdx: return "__shfl_sync";
    case WOp::ShflUp: return "__shfl_up_sync";
    case WOp::ShflDown: return "__shfl_down_sync";
    case WOp::ShflXor: return "__shfl_xor_sync";
    case WOp::Ballot: return "__ballot_sync";
    case WOp::Any: return "__any_sync";
    case WOp::All: return "__all_sync";
    case WOp::WmmaLoad: return "wmma::load_matrix_sync";
    case WOp::WmmaStore: return "wmma::store_matrix_sync";
    case WOp::WmmaMma: return "wmma::mma_sync";
    }
    return "?";
}
inline bool is_shuffle(WOp op) {
    return op == WOp::ShflIdx || op == WOp::ShflUp || op == WOp::ShflDown || op == WOp::ShflXor;
}
inline bool is_wmma(WOp op) {
    return op == WOp::WmmaLoad || op == WOp::WmmaStore || op == WOp::WmmaMma;
}

struct WarpReq;
using CompleteFn = void (*)(WarpReq* const* lanes, unsigned group);

/// One lane's arrival at a warp collective. Lives on the lane's stack while it waits; the
/// lane that completes the group reads every member's request and writes their results.
struct WarpReq {
    WOp op = WOp::SyncWarp;
    unsigned mask = 0;
    Site site;
    // Shuffles and votes: the value (or predicate) as raw bits, what a lane reading a
    // non-participating lane gets (a NaN/0xCD pattern of the value's type), and the result.
    int width = 32;
    unsigned arg = 0; // srcLane, delta or laneMask
    unsigned size = 0;
    std::uint64_t bits = 0, poison = 0, result = 0;
    // wmma.
    const void* ptr = nullptr;
    unsigned ldm = 0;
    int layout = 0;
    const void* tag = nullptr; // the fragment type
    void* d = nullptr;
    const void* a = nullptr;
    const void* b = nullptr;
    const void* c = nullptr;
    CompleteFn complete = nullptr; // extra work at completion (mma)
};

struct Fiber {
    Ctx ctx;
    uint3 tid;
    unsigned linear = 0, warp = 0, lane = 0;
    FState st = FState::Exited;
    Site bar_site;        // the __syncthreads it waits at
    const char* bar_what = "";
    int bar_pred = 0, bar_result = 0, bar_total = 0;
    WarpReq* req = nullptr; // the warp collective it waits at
};

struct Warp {
    unsigned present = 0; // lanes that exist (the last warp of a block may be partial)
    unsigned exited = 0;  // lanes that returned from the kernel
};

/// The stacks of the fibers: one mapping, a PROT_NONE guard page below each stack so an
/// overflow faults (and the crash handler says so) instead of corrupting a neighbour.
struct StackPool {
    char* base = nullptr;
    size_t map_len = 0, stride = 0, usable = 0;
    unsigned count = 0;
    void ensure(unsigned n, size_t stack_bytes) {
        const size_t pg = page_size();
        const size_t use = round_up(stack_bytes, pg);
        if (base && n <= count && use == usable) return;
        if (base) munmap(base, map_len);
        usable = use;
        stride = use + pg;
        count = std::max(n, 32u);
        map_len = stride * count;
        void* p = mmap(nullptr, map_len, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            std::perror("emu: mmap of the fiber stacks");
            std::abort();
        }
        base = (char*)p;
        for (unsigned i = 0; i < count; ++i) mprotect(base + i * stride, pg, PROT_NONE);
    }
    char* lo(unsigned i) const { return base + (size_t)i * stride + page_size(); }
    bool in_guard(const void* a) const {
        if (!base || (const char*)a < base || (const char*)a >= base + map_len) return false;
        return (size_t)((const char*)a - base) % stride < page_size();
    }
};

/// Everything about the launch in progress.
struct Run {
    bool active = false;
    std::string kernel;
    Site site;
    dim3 grid_dim, block_dim;
    size_t smem = 0;
    void (*thunk)(void*) = nullptr;
    void* data = nullptr;

    uint3 block_idx{0, 0, 0};
    unsigned nthreads = 0, nwarps = 0;
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    std::vector<unsigned> order;
    unsigned bar_waiting = 0, exited = 0;
    bool failed = false;
    std::string error;
    Ctx sched;
    StackPool stacks;

    // Dynamic shared memory: [dsmem, dsmem + dsmem_padded) ends at a PROT_NONE page.
    char* dsmem_map = nullptr;
    size_t dsmem_map_len = 0;
    char* dsmem = nullptr;
    size_t dsmem_padded = 0;
    // Counts the blocks run (this one included): per-block state elsewhere (emu_proxy, emu_wg)
    // is keyed by it.
    unsigned long long block_serial = 0;
    // The numbers (Stats::launches) of the launches that failed, in order: the asynchronous
    // operations their abandoned threads left pending are not reported as never waited for
    // (emu_async).
    std::vector<unsigned long long> failed_launches;
};
inline Run& run() {
    // Never destroyed (nor the other state below): a stream thread of the emulated device
    // may still run a kernel while the process exits and static destructors run.
    static Run& r = *new Run;
    return r;
}
/// The fiber running now (nullptr outside kernels). A plain global: all fibers live on the
/// OS thread that called emu::launch, and only one launch runs at a time.
inline Fiber* g_cur = nullptr;

inline std::string block_str(uint3 b) { return fmt("(%u,%u,%u)", b.x, b.y, b.z); }
inline std::string dim_str(dim3 d) { return fmt("(%u,%u,%u)", d.x, d.y, d.z); }
inline std::string launch_context() {
    const Run& R = run();
    return fmt("kernel `%s` (launched at %s with grid %s, block %s, %zu bytes of dynamic shared "
               "memory), blockIdx %s",
               R.kernel.c_str(), site_str(R.site).c_str(), dim_str(R.grid_dim).c_str(),
               dim_str(R.block_dim).c_str(), R.smem, block_str(R.block_idx).c_str());
}

/// The current fiber; aborts with a message when kernel-only API is used outside a kernel.
inline Fiber* current(const char* what) {
    Fiber* f = g_cur;
    if (!f) {
        std::fprintf(stderr, "emu: %s used outside a kernel launched by emu::launch\n", what);
        std::abort();
    }
    return f;
}

/// Ends the launch with an error. Inside a fiber: records it and switches to the scheduler
/// for good (the scheduler throws; the fiber's stack is simply abandoned). Outside: throws.
[[noreturn]] inline void fail(const std::string& msg) {
    Run& R = run();
    if (Fiber* f = g_cur) {
        R.failed = true;
        R.error = fmt("threadIdx (%u,%u,%u) (warp %u, lane %u): ", f->tid.x, f->tid.y, f->tid.z,
                      f->warp, f->lane) +
                  msg;
        ctx_switch(f->ctx, R.sched);
        std::fprintf(stderr, "emu: a failed fiber was resumed\n");
        std::abort();
    }
    throw Error("emu: " + msg);
}

/// Blocks the current fiber (its state says why) until the scheduler resumes it.
inline void block_current(Fiber* f) {
    ctx_switch(f->ctx, run().sched);
}

// ---------------------------------------------------------------------------------------
// __syncthreads.

inline void complete_block_barrier() {
    Run& R = run();
    Fiber* first = nullptr;
    int count = 0, total = 0;
    for (unsigned i = 0; i < R.nthreads; ++i) {
        Fiber& f = R.fibers[i];
        if (f.st != FState::AtBlockBarrier) continue;
        if (!first) {
            first = &f;
        } else if (!same_site(f.bar_site, first->bar_site) ||
                   std::strcmp(f.bar_what, first->bar_what) != 0) {
            fail(fmt("threads of the block reached different barriers: threadIdx (%u,%u,%u) is at "
                     "%s() at %s, threadIdx (%u,%u,%u) at %s() at %s. CUDA requires every thread "
                     "of the block to reach the same __syncthreads() (it is undefined behaviour "
                     "in divergent code; hardware may hang or pair the wrong barriers)",
                     first->tid.x, first->tid.y, first->tid.z, first->bar_what,
                     site_str(first->bar_site).c_str(), f.tid.x, f.tid.y, f.tid.z, f.bar_what,
                     site_str(f.bar_site).c_str()));
        }
        count += f.bar_pred != 0;
        ++total;
    }
    for (unsigned i = 0; i < R.nthreads; ++i) {
        Fiber& f = R.fibers[i];
        if (f.st != FState::AtBlockBarrier) continue;
        f.bar_result = count;
        f.bar_total = total;
        f.st = FState::Ready;
    }
    R.bar_waiting = 0;
}

inline unsigned block_barrier_needed() {
    const Run& R = run();
    return R.nthreads - (options().exited_arrive ? R.exited : 0);
}

/// Returns the number of threads whose predicate was non-zero (and in *total the number of
/// threads that took part).
inline int block_barrier(const char* what, int pred, Site s, int* total = nullptr) {
    Run& R = run();
    Fiber* f = current(what);
    f->bar_site = s;
    f->bar_what = what;
    f->bar_pred = pred;
    f->st = FState::AtBlockBarrier;
    ++R.bar_waiting;
    if (R.bar_waiting == block_barrier_needed()) {
        complete_block_barrier();
        f->st = FState::Running;
    } else {
        block_current(f);
    }
    if (total) *total = f->bar_total;
    return f->bar_result;
}

// ---------------------------------------------------------------------------------------
// Warp collectives.

inline Fiber* warp_lanes(unsigned warp) { return &run().fibers[(size_t)warp * 32]; }

inline std::string lanes_str(unsigned m) {
    std::string s;
    for (int i = 0; i < 32;) {
        if (!((m >> i) & 1)) {
            ++i;
            continue;
        }
        int j = i;
        while (j + 1 < 32 && ((m >> (j + 1)) & 1)) ++j;
        if (!s.empty()) s += ",";
        s += i == j ? fmt("%d", i) : fmt("%d-%d", i, j);
        i = j + 1;
    }
    return s.empty() ? "none" : s;
}

/// The lane a shuffle reads from, following PTX's shfl.sync: `width` splits the warp into
/// segments; up/down/xor that would leave the lane's segment (for xor: go past its end)
/// read the lane's own value.
inline unsigned shuffle_source(WOp op, unsigned lane, unsigned arg, int width) {
    const unsigned seg = (unsigned)(32 - width) & 31u; // bits that select the segment
    const unsigned b = arg & 31u;
    const int l = (int)lane;
    int j = l;
    bool ok = true;
    switch (op) {
    case WOp::ShflUp: {
        const int lo = (int)(lane & seg);
        j = l - (int)b;
        ok = j >= lo;
        break;
    }
    case WOp::ShflDown: {
        const int hi = (int)((lane & seg) | (31u & ~seg));
        j = l + (int)b;
        ok = j <= hi;
        break;
    }
    case WOp::ShflXor: {
        const int hi = (int)((lane & seg) | (31u & ~seg));
        j = (int)(lane ^ b);
        ok = j <= hi;
        break;
    }
    default: // ShflIdx: srcLane modulo width, within the lane's segment
        j = (int)((lane & seg) | (b & ~seg & 31u));
        break;
    }
    return ok ? (unsigned)j : lane;
}

/// Completes the group of warp `w` keyed by `mask` if all its participants have arrived.
/// Returns whether it did (the group's lanes are then Ready, results written).
inline bool try_complete_group(unsigned w, unsigned mask) {
    Run& R = run();
    const Warp& W = R.warps[w];
    const unsigned group = mask & W.present & ~W.exited;
    Fiber* lanes = warp_lanes(w);
    for (unsigned m = group; m; m &= m - 1) {
        const Fiber& g = lanes[__builtin_ctz(m)];
        if (g.st != FState::AtWarpCollective || g.req->mask != mask) return false;
    }
    if (!group) return false;
    WarpReq* reqs[32] = {};
    for (unsigned m = group; m; m &= m - 1) reqs[__builtin_ctz(m)] = lanes[__builtin_ctz(m)].req;
    const unsigned l0 = (unsigned)__builtin_ctz(group);
    const WarpReq& r0 = *reqs[l0];

    // Everyone must be at the same kind of collective with the same parameters.
    for (unsigned m = group & (group - 1); m; m &= m - 1) {
        const unsigned l = (unsigned)__builtin_ctz(m);
        const WarpReq& r = *reqs[l];
        std::string why;
        if (r.op != r0.op) {
            why = "different collectives";
        } else if (is_shuffle(r.op) && r.width != r0.width) {
            why = fmt("different widths (%d and %d)", r0.width, r.width);
        } else if ((is_shuffle(r.op) || r.op == WOp::Ballot) && r.size != r0.size) {
            why = fmt("values of different sizes (%u and %u bytes)", r0.size, r.size);
        } else if (is_wmma(r.op) && r.tag != r0.tag) {
            why = "different fragment types";
        } else if ((r.op == WOp::WmmaLoad || r.op == WOp::WmmaStore) &&
                   (r.ptr != r0.ptr || r.ldm != r0.ldm || r.layout != r0.layout)) {
            why = fmt("different arguments (pointer %p, ldm %u, layout %d vs pointer %p, ldm %u, "
                      "layout %d); every lane must pass the same ones",
                      r0.ptr, r0.ldm, r0.layout, r.ptr, r.ldm, r.layout);
        }
        if (!why.empty()) {
            fail(fmt("lanes of warp %u met at a warp collective with mask 0x%08x with %s: lane %u "
                     "at %s() at %s, lane %u at %s() at %s",
                     w, mask, why.c_str(), l0, wop_name(r0.op), site_str(r0.site).c_str(), l,
                     wop_name(r.op), site_str(r.site).c_str()));
        }
    }

    if (is_shuffle(r0.op)) {
        for (unsigned m = group; m; m &= m - 1) {
            const unsigned l = (unsigned)__builtin_ctz(m);
            WarpReq& r = *reqs[l];
            const unsigned src = shuffle_source(r.op, l, r.arg, r.width);
            // Reading a lane outside the group (not in the mask, exited, or beyond the end of
            // a partial warp) is undefined in CUDA: give a recognisable garbage value.
            r.result = ((group >> src) & 1) ? reqs[src]->bits : r.poison;
        }
    } else if (r0.op == WOp::Ballot || r0.op == WOp::Any || r0.op == WOp::All) {
        unsigned ballot = 0;
        for (unsigned m = group; m; m &= m - 1) {
            const unsigned l = (unsigned)__builtin_ctz(m);
            if (reqs[l]->bits) ballot |= 1u << l;
        }
        const std::uint64_t v = r0.op == WOp::Ballot ? ballot
                                : r0.op == WOp::Any  ? (ballot != 0)
                                                     : (ballot == group);
        for (unsigned m = group; m; m &= m - 1) reqs[__builtin_ctz(m)]->result = v;
    } else if (is_wmma(r0.op)) {
        if (group != 0xFFFFFFFFu) {
            fail(fmt("%s() at %s needs all 32 lanes of the warp, but warp %u has only lanes %s "
                     "(%s)",
                     wop_name(r0.op), site_str(r0.site).c_str(), w, lanes_str(group).c_str(),
                     W.present != 0xFFFFFFFFu ? "a partial warp: blockDim is not a multiple of 32"
                                              : "the others returned from the kernel"));
        }
        if (r0.op != WOp::WmmaMma) {
            if ((std::uintptr_t)r0.ptr % 32 != 0) {
                fail(fmt("%s() at %s: the pointer %p is not 32-byte (256-bit) aligned, which "
                         "WMMA requires",
                         wop_name(r0.op), site_str(r0.site).c_str(), r0.ptr));
            }
            if (((size_t)r0.ldm * r0.size) % 16 != 0) {
                fail(fmt("%s() at %s: ldm %u is not a multiple of 16 bytes (%u elements), which "
                         "WMMA requires",
                         wop_name(r0.op), site_str(r0.site).c_str(), r0.ldm, 16 / r0.size));
            }
        }
        if (r0.complete) r0.complete(reqs, group);
    }
    for (unsigned m = group; m; m &= m - 1) lanes[__builtin_ctz(m)].st = FState::Ready;
    return true;
}

/// Arrives at a warp collective; returns once its group has completed (r.result is set).
inline void warp_collective(WarpReq& r) {
    Run& R = run();
    Fiber* f = current(wop_name(r.op));
    if (!((r.mask >> f->lane) & 1)) {
        fail(fmt("%s() at %s with mask 0x%08x, which does not include the calling lane %u (CUDA: "
                 "each calling lane must have its own bit set)",
                 wop_name(r.op), site_str(r.site).c_str(), r.mask, f->lane));
    }
    f->req = &r;
    f->st = FState::AtWarpCollective;
    if (try_complete_group(f->warp, r.mask)) {
        f->st = FState::Running;
    } else {
        block_current(f);
    }
    f->req = nullptr;
    (void)R;
}

/// After a lane exits: groups that waited for it may now be complete (exited lanes do not
/// take part); with EMU_EXITED_ARRIVE, so may the block barrier.
inline void on_thread_exit(Fiber* f) {
    Run& R = run();
    f->st = FState::Exited;
    ++R.exited;
    Warp& W = R.warps[f->warp];
    W.exited |= 1u << f->lane;
    Fiber* lanes = warp_lanes(f->warp);
    for (unsigned m = W.present & ~W.exited; m; m &= m - 1) {
        Fiber& g = lanes[__builtin_ctz(m)];
        if (g.st == FState::AtWarpCollective) try_complete_group(f->warp, g.req->mask);
    }
    if (R.bar_waiting > 0 && R.bar_waiting == block_barrier_needed()) complete_block_barrier();
}

/// Every fiber starts here.
[[noreturn]] inline void fiber_entry() {
    Run& R = run();
    try {
        R.thunk(R.data);
    } catch (const std::exception& e) {
        fail(fmt("the kernel threw a C++ exception: %s", e.what()));
    } catch (...) {
        fail("the kernel threw a C++ exception");
    }
    Fiber* f = g_cur;
    on_thread_exit(f);
    ctx_switch(f->ctx, R.sched);
    std::fprintf(stderr, "emu: an exited fiber was resumed\n");
    std::abort();
}

// ---------------------------------------------------------------------------------------
// Deadlock report.

inline std::string fiber_state_str(const Fiber& f) {
    switch (f.st) {
    case FState::Ready: return "ready";
    case FState::Running: return "running";
    case FState::Exited: return "returned from the kernel";
    case FState::AtBlockBarrier:
        return fmt("waiting at %s() at %s", f.bar_what, site_str(f.bar_site).c_str());
    case FState::AtWarpCollective:
        return fmt("waiting at %s(mask 0x%08x) at %s", wop_name(f.req->op), f.req->mask,
                   site_str(f.req->site).c_str());
    }
    return "?";
}

inline std::string deadlock_report() {
    Run& R = run();
    std::string s = "emu: deadlock in " + launch_context() +
                    ": no thread of the block can continue. Where the threads are:\n";
    unsigned at_block = 0, at_warp = 0;
    for (unsigned i = 0; i < R.nthreads;) {
        const std::string d = fiber_state_str(R.fibers[i]);
        unsigned j = i;
        while (j + 1 < R.nthreads && fiber_state_str(R.fibers[j + 1]) == d) ++j;
        const Fiber &a = R.fibers[i], &b = R.fibers[j];
        if (i == j) {
            s += fmt("  thread %u (threadIdx (%u,%u,%u)): %s\n", i, a.tid.x, a.tid.y, a.tid.z,
                     d.c_str());
        } else {
            s += fmt("  threads %u-%u (threadIdx (%u,%u,%u)-(%u,%u,%u)): %s\n", i, j, a.tid.x,
                     a.tid.y, a.tid.z, b.tid.x, b.tid.y, b.tid.z, d.c_str());
        }
        i = j + 1;
    }
    for (unsigned i = 0; i < R.nthreads; ++i) {
        at_block += R.fibers[i].st == FState::AtBlockBarrier;
        at_warp += R.fibers[i].st == FState::AtWarpCollective;
    }
    if (at_block && R.exited) {
        s += fmt("  hint: %u threads returned before reaching the __syncthreads() the others wait "
                 "at. In CUDA every thread of the block must reach it (undefined behaviour "
                 "otherwise); EMU_EXITED_ARRIVE=1 counts returned threads as arrived, as current "
                 "hardware happens to.\n",
                 R.exited);
    }
    if (at_block && at_warp) {
        s += "  hint: some threads wait at __syncthreads() while lanes of their warps wait at a "
             "warp collective for them (a collective or a barrier in divergent code).\n";
    }
    if (at_warp && !at_block) {
        s += "  hint: the lanes named in a warp collective's mask must all call a collective "
             "with the same mask (check the masks and the branches around the call).\n";
    }
    return s;
}

// ---------------------------------------------------------------------------------------
// emu::alloc bookkeeping (for the crash handler and the end-of-launch canary check).
struct AllocRec {
    char* ptr;
    size_t bytes, padded;
    char* map;
    size_t map_len;
    Site site;
    size_t elem_size;
};
inline std::vector<AllocRec>& allocs() {
    static auto& v = *new std::vector<AllocRec>;  // never destroyed: see run()
    return v;
}
constexpr unsigned char kCanary = 0xCD;

// ---------------------------------------------------------------------------------------
// The crash handler: names the kernel, block and thread of a SIGSEGV/SIGBUS, and what the
// address was (a guard page after an emu::alloc buffer, after the dynamic shared memory, or
// below a fiber's stack).
inline void crash_handler(int sig, siginfo_t* si, void*) {
    char buf[1536];
    int n = std::snprintf(buf, sizeof buf, "\nemu: %s at address %p",
                          sig == SIGSEGV ? "SIGSEGV" : "SIGBUS", si->si_addr);
    auto add = [&](int k) {
        if (k > 0) n = std::min<int>(n + k, (int)sizeof buf - 1);
    };
    const Run& R = run();
    if (R.active) {
        add(std::snprintf(buf + n, sizeof buf - n, " in kernel `%s` (launched at %s:%d), blockIdx "
                                                   "(%u,%u,%u)",
                          R.kernel.c_str(), base_name(R.site.file), R.site.line, R.block_idx.x,
                          R.block_idx.y, R.block_idx.z));
        if (const Fiber* f = g_cur)
            add(std::snprintf(buf + n, sizeof buf - n, ", threadIdx (%u,%u,%u)", f->tid.x,
                              f->tid.y, f->tid.z));
    }
    const char* a = (const char*)si->si_addr;
    const size_t pg = page_size();
    if (R.stacks.in_guard(a)) {
        add(std::snprintf(buf + n, sizeof buf - n,
                          ": stack overflow of the CUDA thread's fiber (%zu KiB; raise "
                          "EMU_STACK_KIB)",
                          R.stacks.usable / 1024));
    } else if (R.dsmem_map && a >= R.dsmem_map + R.dsmem_map_len - pg &&
               a < R.dsmem_map + R.dsmem_map_len) {
        add(std::snprintf(buf + n, sizeof buf - n,
                          ": %zu bytes past the end of the dynamic shared memory (the launch "
                          "asked for %zu bytes)",
                          (size_t)(a - R.dsmem), R.smem));
    } else {
        for (const AllocRec& r : allocs()) {
            if (a >= r.map && a < r.map + r.map_len) {
                if (a >= r.ptr)
                    add(std::snprintf(buf + n, sizeof buf - n,
                                      ": %zu bytes past the end of the emu::alloc buffer of %zu "
                                      "bytes at %p (allocated at %s:%d)",
                                      (size_t)(a - r.ptr - r.bytes), r.bytes, (void*)r.ptr,
                                      base_name(r.site.file), r.site.line));
                else
                    add(std::snprintf(buf + n, sizeof buf - n,
                                      ": %zu bytes before the start of the emu::alloc buffer of "
                                      "%zu bytes at %p (allocated at %s:%d)",
                                      (size_t)(r.ptr - a), r.bytes, (void*)r.ptr,
                                      base_name(r.site.file), r.site.line));
                break;
            }
        }
    }
    add(std::snprintf(buf + n, sizeof buf - n, "\n"));
    ssize_t ignored = write(2, buf, (size_t)n);
    (void)ignored;
    // SA_RESETHAND restored the default action: returning re-executes the faulting access,
    // which now kills the process with the signal.
}

inline void install_crash_handler() {
    static bool done = false;
    if (done) return;
    done = true;
    static char* alt = nullptr;
    const size_t alt_size = 64 * 1024;
    alt = (char*)std::malloc(alt_size);
    stack_t ss{};
    ss.ss_sp = alt;
    ss.ss_size = alt_size;
    sigaltstack(&ss, nullptr);
    for (int sig : {SIGSEGV, SIGBUS}) {
        struct sigaction old{};
        sigaction(sig, nullptr, &old);
        if (!(old.sa_flags & SA_SIGINFO) && old.sa_handler != SIG_DFL) continue; // not ours
        struct sigaction sa{};
        sa.sa_sigaction = crash_handler;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
        sigemptyset(&sa.sa_mask);
        sigaction(sig, &sa, nullptr);
    }
}

// ---------------------------------------------------------------------------------------
// Shared memory.

inline void* dynamic_smem() {
    current("DYNAMIC_SMEM");
    return run().dsmem;
}

/// Prepares the dynamic shared memory of a launch: `bytes` rounded up to 128 ending right at
/// a PROT_NONE page. (ABI.md promises 16-byte alignment; 128 is what GPUs give in practice,
/// and kernels derive 32-byte aligned wmma tile pointers from it.)
inline void prepare_dynamic_smem(size_t bytes) {
    Run& R = run();
    const size_t pg = page_size();
    const size_t padded = round_up(bytes, 128);
    const size_t need = round_up(padded, pg) + pg;
    if (!R.dsmem_map || R.dsmem_map_len < need) {
        if (R.dsmem_map) munmap(R.dsmem_map, R.dsmem_map_len);
        void* p = mmap(nullptr, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            std::perror("emu: mmap of the dynamic shared memory");
            std::abort();
        }
        R.dsmem_map = (char*)p;
        R.dsmem_map_len = need;
        mprotect(R.dsmem_map + need - pg, pg, PROT_NONE);
    }
    R.dsmem_padded = padded;
    R.dsmem = R.dsmem_map + R.dsmem_map_len - pg - padded;
}

/// Shared memory is uninitialised at the start of a block: fill it with garbage.
inline void poison_shared() {
    Run& R = run();
    const unsigned char p = options().smem_poison;
    char *lo = __start_emu_shared, *hi = __stop_emu_shared;
    if (lo && hi && hi > lo) std::memset(lo, p, (size_t)(hi - lo));
    if (R.dsmem_padded) std::memset(R.dsmem, p, R.dsmem_padded);
    // The bytes between the requested size and the 128-byte boundary hold the canary.
    if (R.dsmem_padded > R.smem) std::memset(R.dsmem + R.smem, kCanary, R.dsmem_padded - R.smem);
}

// ---------------------------------------------------------------------------------------
// Running a block, and a launch.

// The end-of-block check of the wgmma emulation (defined with it, below).
inline void wgmma_block_end();

inline void run_block() {
    Run& R = run();
    ++R.block_serial;
    const Options& o = options();
    const unsigned n = R.nthreads;
    const unsigned bx = R.block_dim.x, by = R.block_dim.y;
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = R.fibers[i];
        f.tid = uint3{i % bx, (i / bx) % by, i / (bx * by)};
        f.linear = i;
        f.warp = i / 32;
        f.lane = i % 32;
        f.st = FState::Ready;
        f.req = nullptr;
        f.bar_result = 0;
        ctx_make(f.ctx, R.stacks.lo(i), R.stacks.usable, &fiber_entry);
    }
    for (unsigned w = 0; w < R.nwarps; ++w) {
        const unsigned lanes = std::min(32u, n - w * 32);
        R.warps[w].present = lanes == 32 ? 0xFFFFFFFFu : ((1u << lanes) - 1);
        R.warps[w].exited = 0;
    }
    R.bar_waiting = 0;
    R.exited = 0;
    R.failed = false;
    poison_shared();

    for (unsigned i = 0; i < n; ++i) R.order[i] = o.schedule == Schedule::Reverse ? n - 1 - i : i;
    Stats& st = stats_ref();
    for (;;) {
        if (o.schedule == Schedule::Random) {
            for (unsigned i = n; i > 1; --i)
                std::swap(R.order[i - 1], R.order[schedule_rng().below(i)]);
        }
        bool ran = false;
        for (unsigned k = 0; k < n; ++k) {
            Fiber& f = R.fibers[R.order[k]];
            if (f.st != FState::Ready) continue;
            f.st = FState::Running;
            g_cur = &f;
            ctx_switch(R.sched, f.ctx);
            g_cur = nullptr;
            ++st.switches;
            if (R.failed) throw Error("emu: error in " + launch_context() + ", " + R.error);
            ran = true;
        }
        if (R.exited == n) break;
        if (!ran) throw Error(deadlock_report());
    }
    wgmma_block_end();
    for (size_t i = R.smem; i < R.dsmem_padded; ++i) {
        if ((unsigned char)R.dsmem[i] != kCanary) {
            throw Error(fmt("emu: %s wrote past the end of the dynamic shared memory: byte %zu of "
                            "a %zu-byte allocation was written",
                            launch_context().c_str(), i, R.smem));
        }
    }
}

inline std::string kernel_name(void* fn) {
    Dl_info info;
    if (dladdr(fn, &info) && info.dli_sname && info.dli_saddr == fn) {
        int status = 0;
        char* d = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
        std::string s = (status == 0 && d) ? d : info.dli_sname;
        std::free(d);
        return s;
    }
    return fmt("kernel@%p (link with -rdynamic for its name)", fn);
}

inline void check_alloc_canaries() {
    for (const AllocRec& r : allocs()) {
        for (size_t i = r.bytes; i < r.padded; ++i) {
            if ((unsigned char)r.ptr[i] != kCanary) {
                std::memset(r.ptr + r.bytes, kCanary, r.padded - r.bytes); // report once
                throw Error(fmt("emu: kernel `%s` (launched at %s) wrote past the end of the "
                                "emu::alloc buffer of %zu bytes allocated at %s (byte %zu of the "
                                "padding was changed)",
                                run().kernel.c_str(), site_str(run().site).c_str(), r.bytes,
                                site_str(r.site).c_str(), i - r.bytes));
            }
        }
    }
}

inline void launch_impl(std::string name, dim3 g, Site site, dim3 b, size_t smem,
                        void (*thunk)(void*), void* data) {
    Run& R = run();
    const std::string where = fmt("emu::launch of `%s` at %s", name.c_str(), site_str(site).c_str());
    if (R.active || g_cur) {
        throw Error(where + ": called from inside a kernel; dynamic parallelism is not "
                            "emulated");
    }
    // One launch at a time in the process (static shared memory is process-wide).
    static std::atomic<bool> busy{false};
    if (busy.exchange(true)) {
        throw Error(where + ": another OS thread is running a launch; launches must not overlap");
    }
    struct Release {
        ~Release() { busy.store(false); }
    } release;
    const unsigned long long threads = (unsigned long long)b.x * b.y * b.z;
    if (b.x == 0 || b.y == 0 || b.z == 0 || g.x == 0 || g.y == 0 || g.z == 0)
        throw Error(fmt("%s: grid %s / block %s has a zero dimension", where.c_str(),
                        dim_str(g).c_str(), dim_str(b).c_str()));
    if (threads > 1024 || b.x > 1024 || b.y > 1024 || b.z > 64)
        throw Error(fmt("%s: block %s (%llu threads) exceeds CUDA's limits (1024 threads; x, y "
                        "<= 1024, z <= 64)",
                        where.c_str(), dim_str(b).c_str(), threads));
    if (g.x > 2147483647u || g.y > 65535 || g.z > 65535)
        throw Error(fmt("%s: grid %s exceeds CUDA's limits (x < 2^31, y and z <= 65535)",
                        where.c_str(), dim_str(g).c_str()));
    if (smem > 227 * 1024)
        throw Error(fmt("%s: %zu bytes of dynamic shared memory; at most 227 KiB (232448 bytes) "
                        "exist per block",
                        where.c_str(), smem));

    const Options& o = options();
    install_crash_handler();
    R.kernel = std::move(name);
    R.site = site;
    R.grid_dim = g;
    R.block_dim = b;
    R.smem = smem;
    R.thunk = thunk;
    R.data = data;
    R.nthreads = (unsigned)threads;
    R.nwarps = (R.nthreads + 31) / 32;
    if (R.fibers.size() < R.nwarps * 32) R.fibers.resize(R.nwarps * 32);
    R.warps.resize(R.nwarps);
    R.order.resize(R.nthreads);
    R.stacks.ensure(R.nthreads, o.stack_bytes);
    prepare_dynamic_smem(smem);
    if (o.schedule == Schedule::Random && stats_ref().launches == 0) schedule_rng().s = o.seed;

    struct Reset {
        int exceptions = std::uncaught_exceptions();
        ~Reset() {
            if (std::uncaught_exceptions() > exceptions)
                run().failed_launches.push_back(stats_ref().launches);
            run().active = false;
            g_cur = nullptr;
        }
    } reset;
    R.active = true;
    const unsigned long long nblocks = (unsigned long long)g.x * g.y * g.z;
    std::vector<unsigned long long> perm;
    if (o.schedule == Schedule::Random) {
        perm.resize(nblocks);
        for (unsigned long long i = 0; i < nblocks; ++i) perm[i] = i;
        for (unsigned long long i = nblocks; i > 1; --i)
            std::swap(perm[i - 1], perm[schedule_rng().below(i)]);
    }
    Stats& st = stats_ref();
    ++st.launches;
    for (unsigned long long k = 0; k < nblocks; ++k) {
        const unsigned long long i = o.schedule == Schedule::Forward   ? k
                                     : o.schedule == Schedule::Reverse ? nblocks - 1 - k
                                                                       : perm[k];
        R.block_idx = uint3{(unsigned)(i % g.x), (unsigned)((i / g.x) % g.y),
                            (unsigned)(i / ((unsigned long long)g.x * g.y))};
        run_block();
        ++st.blocks;
        st.threads += R.nthreads;
    }
    check_alloc_canaries();
}

// Built-in variables (read-only, like CUDA's).
inline const uint3& thread_idx() { return current("threadIdx")->tid; }
inline const uint3& block_idx() {
    current("blockIdx");
    return run().block_idx;
}
inline const dim3& block_dim() {
    current("blockDim");
    return run().block_dim;
}
inline const dim3& grid_dim() {
    current("gridDim");
    return run().grid_dim;
}
/// Not a constant expression, as in CUDA.
inline int warp_size() { return 32; }

/// The garbage value of T (defined with the public emu::poison_value below).
template <class T> inline T poison_value();

template <class T>
struct shuffle_ok
    : std::integral_constant<bool, (std::is_arithmetic<T>::value && sizeof(T) <= 8) ||
                                       std::is_same<T, __nv_bfloat16>::value ||
                                       std::is_same<T, __half>::value ||
                                       std::is_same<T, __nv_bfloat162>::value ||
                                       std::is_same<T, __half2>::value> {};

template <class T>
inline T shuffle(WOp op, unsigned mask, T v, unsigned arg, int width, Site s) {
    if (width < 1 || width > 32 || (width & (width - 1)) != 0)
        fail(fmt("%s() at %s: width %d is not a power of two in [1, 32]", wop_name(op),
                 site_str(s).c_str(), width));
    WarpReq r;
    r.op = op;
    r.mask = mask;
    r.site = s;
    r.width = width;
    r.arg = arg;
    r.size = sizeof(T);
    std::memcpy(&r.bits, &v, sizeof(T));
    const T p = poison_value<T>();
    std::memcpy(&r.poison, &p, sizeof(T));
    warp_collective(r);
    T out;
    std::memcpy(&out, &r.result, sizeof(T));
    return out;
}

inline std::uint64_t vote(WOp op, unsigned mask, int pred, Site s) {
    WarpReq r;
    r.op = op;
    r.mask = mask;
    r.site = s;
    r.size = 4;
    r.bits = pred != 0;
    warp_collective(r);
    return r.result;
}

} // namespace detail

// ---------------------------------------------------------------------------------------
// Poison values: what emu::alloc fills buffers with, and what a shuffle from a lane that
// does not take part returns. Quiet NaNs with a 0xCD-ish payload for floating point; 0xCD
// bytes otherwise.
template <class T> inline T poison_value() {
    static_assert(std::is_trivially_copyable<T>::value, "poison_value needs a trivial type");
    if constexpr (std::is_same<T, float>::value) {
        return detail::f32_from_bits(0x7FCDCDCDu);
    } else if constexpr (std::is_same<T, double>::value) {
        return __longlong_as_double((long long)0x7FF9CDCDCDCDCDCDull);
    } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        return __ushort_as_bfloat16(0x7FCD);
    } else if constexpr (std::is_same<T, __half>::value) {
        return __ushort_as_half(0x7ECD);
    } else if constexpr (std::is_same<T, float2>::value) {
        const float n = poison_value<float>();
        return make_float2(n, n);
    } else if constexpr (std::is_same<T, float4>::value) {
        const float n = poison_value<float>();
        return make_float4(n, n, n, n);
    } else {
        T v;
        std::memset((void*)&v, 0xCD, sizeof(T));
        return v;
    }
}
namespace detail {
template <class T> inline T poison_value() { return ::emu::poison_value<T>(); }
} // namespace detail

} // namespace emu

// =======================================================================================
// Built-in variables and dynamic shared memory.
// =======================================================================================
#define threadIdx (::emu::detail::thread_idx())
#define blockIdx (::emu::detail::block_idx())
#define blockDim (::emu::detail::block_dim())
#define gridDim (::emu::detail::grid_dim())
#define warpSize (::emu::detail::warp_size())

/// `T* name` pointing at the block's dynamic shared memory (emu::launch's size, 128-byte
/// aligned, 0xCD garbage at the start of each block).
#define DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(::emu::detail::dynamic_smem())

// =======================================================================================
// Synchronisation.
// =======================================================================================
inline void __syncthreads(EMU_SITE_PARAMS) {
    ::emu::detail::block_barrier("__syncthreads", 0, EMU_SITE);
}
inline int __syncthreads_count(int pred, EMU_SITE_PARAMS) {
    return ::emu::detail::block_barrier("__syncthreads_count", pred, EMU_SITE);
}
inline int __syncthreads_and(int pred, EMU_SITE_PARAMS) {
    int total = 0;
    const int count = ::emu::detail::block_barrier("__syncthreads_and", pred, EMU_SITE, &total);
    return count == total;
}
inline int __syncthreads_or(int pred, EMU_SITE_PARAMS) {
    return ::emu::detail::block_barrier("__syncthreads_or", pred, EMU_SITE) != 0;
}
/// Memory fences: every write is visible at once to the other fibers.
inline void __threadfence() {}
inline void __threadfence_block() {}

inline void __syncwarp(unsigned mask = 0xFFFFFFFFu, EMU_SITE_PARAMS) {
    ::emu::detail::WarpReq r;
    r.op = ::emu::detail::WOp::SyncWarp;
    r.mask = mask;
    r.site = EMU_SITE;
    ::emu::detail::warp_collective(r);
}

template <class T, class = std::enable_if_t<::emu::detail::shuffle_ok<T>::value>>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = 32, EMU_SITE_PARAMS) {
    return ::emu::detail::shuffle(::emu::detail::WOp::ShflIdx, mask, var, (unsigned)srcLane,
                                  width, EMU_SITE);
}
template <class T, class = std::enable_if_t<::emu::detail::shuffle_ok<T>::value>>
inline T __shfl_up_sync(unsigned mask, T var, unsigned int delta, int width = 32,
                        EMU_SITE_PARAMS) {
    return ::emu::detail::shuffle(::emu::detail::WOp::ShflUp, mask, var, delta, width, EMU_SITE);
}
template <class T, class = std::enable_if_t<::emu::detail::shuffle_ok<T>::value>>
inline T __shfl_down_sync(unsigned mask, T var, unsigned int delta, int width = 32,
                          EMU_SITE_PARAMS) {
    return ::emu::detail::shuffle(::emu::detail::WOp::ShflDown, mask, var, delta, width,
                                  EMU_SITE);
}
template <class T, class = std::enable_if_t<::emu::detail::shuffle_ok<T>::value>>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = 32, EMU_SITE_PARAMS) {
    return ::emu::detail::shuffle(::emu::detail::WOp::ShflXor, mask, var, (unsigned)laneMask,
                                  width, EMU_SITE);
}
inline unsigned __ballot_sync(unsigned mask, int pred, EMU_SITE_PARAMS) {
    return (unsigned)::emu::detail::vote(::emu::detail::WOp::Ballot, mask, pred, EMU_SITE);
}
inline int __any_sync(unsigned mask, int pred, EMU_SITE_PARAMS) {
    return (int)::emu::detail::vote(::emu::detail::WOp::Any, mask, pred, EMU_SITE);
}
inline int __all_sync(unsigned mask, int pred, EMU_SITE_PARAMS) {
    return (int)::emu::detail::vote(::emu::detail::WOp::All, mask, pred, EMU_SITE);
}

// =======================================================================================
// Atomics. Fibers never interleave inside these functions, so plain read-modify-write is
// atomic. CUDA semantics: each returns the old value.
// =======================================================================================
inline int atomicAdd(int* a, int v) {
    const int o = *a;
    *a = (int)((unsigned)o + (unsigned)v);
    return o;
}
inline unsigned int atomicAdd(unsigned int* a, unsigned int v) {
    const unsigned o = *a;
    *a = o + v;
    return o;
}
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
    const unsigned long long o = *a;
    *a = o + v;
    return o;
}
inline float atomicAdd(float* a, float v) {
    const float o = *a;
    *a = o + v;
    return o;
}
inline double atomicAdd(double* a, double v) {
    const double o = *a;
    *a = o + v;
    return o;
}
inline int atomicSub(int* a, int v) {
    const int o = *a;
    *a = (int)((unsigned)o - (unsigned)v);
    return o;
}
inline unsigned int atomicSub(unsigned int* a, unsigned int v) {
    const unsigned o = *a;
    *a = o - v;
    return o;
}
#define EMU_ATOMIC_MINMAX(T)                                                                 \
    inline T atomicMax(T* a, T v) {                                                          \
        const T o = *a;                                                                      \
        if (v > o) *a = v;                                                                   \
        return o;                                                                            \
    }                                                                                        \
    inline T atomicMin(T* a, T v) {                                                          \
        const T o = *a;                                                                      \
        if (v < o) *a = v;                                                                   \
        return o;                                                                            \
    }
EMU_ATOMIC_MINMAX(int)
EMU_ATOMIC_MINMAX(unsigned int)
EMU_ATOMIC_MINMAX(long long)
EMU_ATOMIC_MINMAX(unsigned long long)
#undef EMU_ATOMIC_MINMAX
#define EMU_ATOMIC_BITS(T)                                                                   \
    inline T atomicOr(T* a, T v) {                                                           \
        const T o = *a;                                                                      \
        *a = o | v;                                                                          \
        return o;                                                                            \
    }                                                                                        \
    inline T atomicAnd(T* a, T v) {                                                          \
        const T o = *a;                                                                      \
        *a = o & v;                                                                          \
        return o;                                                                            \
    }                                                                                        \
    inline T atomicXor(T* a, T v) {                                                          \
        const T o = *a;                                                                      \
        *a = o ^ v;                                                                          \
        return o;                                                                            \
    }
EMU_ATOMIC_BITS(int)
EMU_ATOMIC_BITS(unsigned int)
EMU_ATOMIC_BITS(unsigned long long)
#undef EMU_ATOMIC_BITS
#define EMU_ATOMIC_EXCH_CAS(T)                                                               \
    inline T atomicExch(T* a, T v) {                                                         \
        const T o = *a;                                                                      \
        *a = v;                                                                              \
        return o;                                                                            \
    }                                                                                        \
    inline T atomicCAS(T* a, T compare, T v) {                                               \
        const T o = *a;                                                                      \
        if (o == compare) *a = v;                                                            \
        return o;                                                                            \
    }
EMU_ATOMIC_EXCH_CAS(int)
EMU_ATOMIC_EXCH_CAS(unsigned int)
EMU_ATOMIC_EXCH_CAS(unsigned long long)
#undef EMU_ATOMIC_EXCH_CAS
inline float atomicExch(float* a, float v) {
    const float o = *a;
    *a = v;
    return o;
}
/// ((old >= limit) ? 0 : old + 1)
inline unsigned int atomicInc(unsigned int* a, unsigned int limit) {
    const unsigned o = *a;
    *a = o >= limit ? 0 : o + 1;
    return o;
}
/// ((old == 0) || (old > limit)) ? limit : old - 1
inline unsigned int atomicDec(unsigned int* a, unsigned int limit) {
    const unsigned o = *a;
    *a = (o == 0 || o > limit) ? limit : o - 1;
    return o;
}

// =======================================================================================
// WMMA (nvcuda::wmma), shape m16n16k16 only: matrix_a/matrix_b of bf16 or f16 (row_major or
// col_major), accumulator of float.
//
// The real fragment layout (which lane holds which elements) is unspecified, and kernels
// never index x[] positionally, so the emulator gives every lane its own copy of the whole
// 16x16 tile (x[r*16 + c], row-major, r/c being the logical row/column: a is M x K, b is
// K x N, the accumulator M x N). Element-wise loops over x[0..num_elements) (scaling an
// accumulator, say) therefore still work.
//
// load/store/mma are warp collectives, as in CUDA ("waits until all warp lanes have arrived"):
// all 32 lanes must call them, with the same pointer, ldm and layout (checked, as are the
// 256-bit pointer alignment and the 16-byte ldm multiple that WMMA requires). After that
// entry barrier:
// - load_matrix_sync: the tile is read once, before any lane goes on, into every lane's copy
//   (an entry and an exit barrier: it sees every write the warp made before the call, and a
//   lane cannot overwrite the source before the others have loaded it);
// - store_matrix_sync: each lane writes only the 8 elements it owns in the sm_80 accumulator
//   layout (rows lane/4 and lane/4 + 8, columns 2*(lane%4) + {0, 1, 8, 9}), when it resumes,
//   with no exit barrier. So, as CUDA requires, a lane must __syncwarp() before reading
//   elements other lanes stored (and other warps need a __syncthreads): a missing barrier
//   reads stale data here instead of passing by luck.
// - mma_sync: d = a*b + c with exact products of the 16-bit values, summed in double and
//   rounded to float once (an idealised tensor core: real ones round differently, so test
//   with tolerances). `d` may alias `c`.
// =======================================================================================
namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class T> struct emu_tile {
    using element_type = T;
    using storage_element_type = T;
    static constexpr int num_elements = 256;
    T x[256];
};

template <class Use, int M, int N, int K, class T, class Layout = void>
class fragment : public emu_tile<T> {
    static_assert(::emu::detail::dependent_false<Use>::value,
                  "cuda_emu.h implements only m16n16k16 fragments: matrix_a/matrix_b of "
                  "__nv_bfloat16/__half with row_major/col_major, accumulator of float");
};
template <class T, class Layout>
class fragment<matrix_a, 16, 16, 16, T, Layout> : public emu_tile<T> {
    static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                  "cuda_emu.h: matrix_a fragments hold __nv_bfloat16 or __half");
    static_assert(std::is_same<Layout, row_major>::value || std::is_same<Layout, col_major>::value,
                  "matrix_a fragments need row_major or col_major");
};
template <class T, class Layout>
class fragment<matrix_b, 16, 16, 16, T, Layout> : public emu_tile<T> {
    static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                  "cuda_emu.h: matrix_b fragments hold __nv_bfloat16 or __half");
    static_assert(std::is_same<Layout, row_major>::value || std::is_same<Layout, col_major>::value,
                  "matrix_b fragments need row_major or col_major");
};
template <class T> class fragment<accumulator, 16, 16, 16, T, void> : public emu_tile<T> {
    static_assert(std::is_same<T, float>::value,
                  "cuda_emu.h implements float accumulators only (ABI.md)");
};

/// Sets every element (per lane, not a collective).
template <class Use, int M, int N, int K, class T, class L>
inline void fill_fragment(fragment<Use, M, N, K, T, L>& f,
                          const typename ::emu::detail::identity<T>::type& v) {
    for (int i = 0; i < 256; ++i) f.x[i] = v;
}

namespace emu_impl {
template <class F> inline const void* type_tag() {
    static const char tag = 0;
    return &tag;
}

/// The entry barrier of load/store: all 32 lanes, same arguments. `complete` runs once the
/// last lane has arrived, before any lane goes on.
inline void arrive(::emu::detail::WOp op, const void* tag, void* frag, const void* ptr,
                   unsigned ldm, int layout, unsigned elem_size, ::emu::detail::CompleteFn complete,
                   ::emu::detail::Site s) {
    ::emu::detail::WarpReq r;
    r.op = op;
    r.mask = 0xFFFFFFFFu;
    r.site = s;
    r.tag = tag;
    r.d = frag;
    r.ptr = ptr;
    r.ldm = ldm;
    r.layout = layout;
    r.size = elem_size;
    r.complete = complete;
    ::emu::detail::warp_collective(r);
}

/// Completes a load: reads the 16x16 tile (element (r, c) at p[r*ldm + c] if row-major, else
/// p[r + c*ldm]) once, when every lane has arrived, into every lane's copy. (As if each lane
/// loaded right after the entry barrier and the warp met again before going on.)
template <class F>
inline void load_complete(::emu::detail::WarpReq* const* reqs, unsigned group) {
    using T = typename F::element_type;
    const ::emu::detail::WarpReq& r0 = *reqs[__builtin_ctz(group)];
    const T* p = static_cast<const T*>(r0.ptr);
    const size_t ldm = r0.ldm;
    T tile[256];
    for (size_t r = 0; r < 16; ++r)
        for (size_t c = 0; c < 16; ++c)
            tile[r * 16 + c] = r0.layout ? p[r + c * ldm] : p[r * ldm + c];
    for (unsigned m = group; m; m &= m - 1)
        std::memcpy(static_cast<F*>(reqs[__builtin_ctz(m)]->d)->x, tile, sizeof tile);
}

inline void mma_tile(float* d, const float* a, const float* b, const float* c, bool satf) {
    for (int i = 0; i < 16; ++i) {
        for (int j = 0; j < 16; ++j) {
            double s = 0.0;
            for (int k = 0; k < 16; ++k) s += (double)a[i * 16 + k] * (double)b[k * 16 + j];
            float v = (float)(s + (double)c[i * 16 + j]);
            if (satf) {
                if (v != v) v = 0.0f;
                v = v > 3.402823466e38f ? 3.402823466e38f : v < -3.402823466e38f ? -3.402823466e38f : v;
            }
            d[i * 16 + j] = v;
        }
    }
}

template <class FA, class FB, class FC>
inline void mma_complete(::emu::detail::WarpReq* const* reqs, unsigned group) {
    // Every lane normally holds the same operands: compute once, copy to the lanes with
    // identical inputs, compute separately for any lane whose copies differ.
    const unsigned l0 = (unsigned)__builtin_ctz(group);
    auto as_float = [](const auto& frag, float* out) {
        for (int i = 0; i < 256; ++i) out[i] = (float)frag.x[i];
    };
    auto compute = [&](const ::emu::detail::WarpReq& r, float* out) {
        float a[256], b[256];
        as_float(*(const FA*)r.a, a);
        as_float(*(const FB*)r.b, b);
        mma_tile(out, a, b, ((const FC*)r.c)->x, r.arg != 0);
    };
    float res0[256];
    const ::emu::detail::WarpReq& r0 = *reqs[l0];
    compute(r0, res0);
    for (unsigned m = group & (group - 1); m; m &= m - 1) {
        const ::emu::detail::WarpReq& r = *reqs[__builtin_ctz(m)];
        FC* d = (FC*)r.d;
        const bool same = std::memcmp(r.a, r0.a, sizeof(FA)) == 0 &&
                          std::memcmp(r.b, r0.b, sizeof(FB)) == 0 &&
                          std::memcmp(r.c, r0.c, sizeof(FC)) == 0 && r.arg == r0.arg;
        if (same) {
            std::memcpy(d->x, res0, sizeof res0);
        } else {
            float tmp[256];
            compute(r, tmp);
            std::memcpy(d->x, tmp, sizeof tmp);
        }
    }
    std::memcpy(((FC*)r0.d)->x, res0, sizeof res0); // last: it may alias lane l0's c
}
} // namespace emu_impl

/// a/b: the tile at `p`, leading dimension `ldm` elements, layout from the fragment type.
template <class Use, class T, class L,
          class = std::enable_if_t<std::is_same<Use, matrix_a>::value ||
                                   std::is_same<Use, matrix_b>::value>>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, L>& f, const T* p, unsigned ldm,
                             EMU_SITE_PARAMS) {
    using F = fragment<Use, 16, 16, 16, T, L>;
    emu_impl::arrive(::emu::detail::WOp::WmmaLoad, emu_impl::type_tag<F>(), &f, p, ldm,
                     std::is_same<L, col_major>::value ? 1 : 0, sizeof(T),
                     &emu_impl::load_complete<F>, EMU_SITE);
}

/// Accumulator: the layout is an argument.
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned ldm, layout_t layout, EMU_SITE_PARAMS) {
    using F = fragment<accumulator, 16, 16, 16, float>;
    emu_impl::arrive(::emu::detail::WOp::WmmaLoad, emu_impl::type_tag<F>(), &f, p, ldm,
                     layout == mem_col_major ? 1 : 0, sizeof(float), &emu_impl::load_complete<F>,
                     EMU_SITE);
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout, EMU_SITE_PARAMS) {
    const bool col = layout == mem_col_major;
    emu_impl::arrive(::emu::detail::WOp::WmmaStore,
                     emu_impl::type_tag<fragment<accumulator, 16, 16, 16, float>>(), nullptr, p,
                     ldm, col ? 1 : 0, sizeof(float), nullptr, EMU_SITE);
    // This lane's share of the tile (the sm_80 m16n16k16 accumulator layout).
    const unsigned lane = ::emu::detail::g_cur->lane;
    const unsigned r0 = lane >> 2, c0 = (lane & 3) * 2;
    for (unsigned r : {r0, r0 + 8}) {
        for (unsigned c : {c0, c0 + 1, c0 + 8, c0 + 9}) {
            const float v = f.x[r * 16 + c];
            if (col)
                p[r + (size_t)c * ldm] = v;
            else
                p[(size_t)r * ldm + c] = v;
        }
    }
}

/// d = a*b + c. a and b must hold the same 16-bit type.
template <class T, class LA, class LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                     const fragment<matrix_a, 16, 16, 16, T, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, T, LB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c, bool satf = false,
                     EMU_SITE_PARAMS) {
    using FA = fragment<matrix_a, 16, 16, 16, T, LA>;
    using FB = fragment<matrix_b, 16, 16, 16, T, LB>;
    using FC = fragment<accumulator, 16, 16, 16, float>;
    ::emu::detail::WarpReq r;
    r.op = ::emu::detail::WOp::WmmaMma;
    r.mask = 0xFFFFFFFFu;
    r.site = EMU_SITE;
    r.tag = emu_impl::type_tag<std::tuple<FA, FB>>();
    r.d = &d;
    r.a = &a;
    r.b = &b;
    r.c = &c;
    r.arg = satf ? 1u : 0u;
    r.complete = &emu_impl::mma_complete<FA, FB, FC>;
    ::emu::detail::warp_collective(r);
}

} // namespace wmma
} // namespace nvcuda

// =======================================================================================
// Register-level tensor-core fragments (common.cuh's mt_ldmatrix_x4, mt_mma_16816 and
// mt_cp_async_16; on the GPU they are one PTX instruction each: ldmatrix, mma.sync
// m16n8k16, cp.async). Their lane layouts ARE specified by PTX, and the kernels rely on
// them, so the emulator reproduces them exactly:
// - ldmatrix .x4: lane l gives the address of row l%8 of 8x8 matrix l/8 (16 bytes); lane t
//   receives in register i the elements (row t/4, columns 2(t%4), 2(t%4)+1) of matrix i, or
//   with .trans (rows 2(t%4) and 2(t%4)+1, column t/4); the first element in the low half.
// - mma m16n8k16 row.col, f32 accumulators: A (16x16) a0 = (g, c..c+1), a1 = (g+8, c..),
//   a2 = (g, c+8..), a3 = (g+8, c+8..); B (16x8, k x n) b0 = (k c..c+1, n g), b1 =
//   (k c+8.., n g); C/D (16x8) d0,d1 = (g, c..c+1), d2,d3 = (g+8, c..c+1), where g = lane/4
//   and c = 2(lane%4). Products exact, summed in double, rounded to float once (as WMMA).
// Both are warp collectives: every lane writes its operands into a per-warp staging area,
// the warp meets at a barrier, every lane computes its own results from all operands, and
// meets again before the staging area can be reused. cp.async reads its source at once
// (zero-filling what lies beyond src_bytes) and writes shared memory when its group's wait
// completes it (below), so a missing or wrong wait reads poison.
// =======================================================================================
namespace emu_frag {
inline unsigned linear_thread() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
// [warp][lane][slot]: 32 warps of a 1024-thread block.
inline unsigned long long (&staging())[32][32][8] {
    static unsigned long long area[32][32][8];
    return area;
}
inline float half_bits_to_float(unsigned short h, bool bf) {
    return bf ? ::emu::detail::bf16_bits_to_float(h) : ::emu::detail::f16_bits_to_float(h);
}
} // namespace emu_frag

inline void mt_ldmatrix_x4_impl(unsigned* r, const void* row, bool trans) {
    const unsigned t = emu_frag::linear_thread(), warp = t / 32, lane = t % 32;
    auto& st = emu_frag::staging()[warp];
    st[lane][0] = (unsigned long long)(uintptr_t)row;
    __syncwarp();
    for (int i = 0; i < 4; ++i) {
        unsigned short lo, hi;
        if (!trans) {
            const unsigned short* p =
                (const unsigned short*)(uintptr_t)st[8 * i + lane / 4][0] + 2 * (lane % 4);
            lo = p[0];
            hi = p[1];
        } else {
            lo = ((const unsigned short*)(uintptr_t)st[8 * i + 2 * (lane % 4)][0])[lane / 4];
            hi = ((const unsigned short*)(uintptr_t)st[8 * i + 2 * (lane % 4) + 1][0])[lane / 4];
        }
        r[i] = (unsigned)lo | ((unsigned)hi << 16);
    }
    __syncwarp();
}
inline void mt_ldmatrix_x4(unsigned* r, const void* row) { mt_ldmatrix_x4_impl(r, row, false); }
inline void mt_ldmatrix_x4_trans(unsigned* r, const void* row) {
    mt_ldmatrix_x4_impl(r, row, true);
}

template <class T> inline void mt_mma_16816(float* d, const unsigned* a, const unsigned* b) {
    static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                  "mma m16n8k16 takes bf16 or f16");
    constexpr bool bf = std::is_same<T, __nv_bfloat16>::value;
    const unsigned t = emu_frag::linear_thread(), warp = t / 32, lane = t % 32;
    auto& st = emu_frag::staging()[warp];
    for (int i = 0; i < 4; ++i) st[lane][i] = a[i];
    st[lane][4] = b[0];
    st[lane][5] = b[1];
    __syncwarp();
    float A[16][16], B[16][8];
    for (int s = 0; s < 32; ++s) {
        const int g = s / 4, c = 2 * (s % 4);
        auto put = [&](float* dst, unsigned long long v) {
            dst[0] = emu_frag::half_bits_to_float((unsigned short)(v & 0xFFFF), bf);
            dst[1] = emu_frag::half_bits_to_float((unsigned short)((v >> 16) & 0xFFFF), bf);
        };
        put(&A[g][c], st[s][0]);
        put(&A[g + 8][c], st[s][1]);
        put(&A[g][c + 8], st[s][2]);
        put(&A[g + 8][c + 8], st[s][3]);
        float b0[2], b1[2];
        put(b0, st[s][4]);
        put(b1, st[s][5]);
        B[c][g] = b0[0];
        B[c + 1][g] = b0[1];
        B[c + 8][g] = b1[0];
        B[c + 9][g] = b1[1];
    }
    __syncwarp();
    const int g = lane / 4, c = 2 * (lane % 4);
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {c, c + 1, c, c + 1};
    for (int i = 0; i < 4; ++i) {
        double acc = d[i];
        for (int k = 0; k < 16; ++k) acc += (double)A[rows[i]][k] * (double)B[k][cols[i]];
        d[i] = (float)acc;
    }
}

// cp.async: the source is read when the copy is issued, the destination written only when a
// cp.async.wait_group lets the copy's commit group complete (so reading the tile before the
// wait, or waiting for the wrong group, reads shared memory's poison).
namespace emu_async {
// One lane's asynchronous operations of one kind (cp.async copies, wgmma products) in commit
// groups, as PTX counts them: an operation belongs to the group committed next, and a wait
// for N completes every operation but those of the N newest committed groups. The state
// belongs to one block of one launch: an operation still pending from another was never
// waited for (its effect never happened), which fails the launch (unless that launch failed
// and abandoned its threads).
template <class Op> struct Groups {
    std::vector<std::pair<Op, unsigned>> pending; // each with its group
    unsigned commits = 0;
    uint3 block{0, 0, 0};
    unsigned long long launch = 0; // the launch's number (stats().launches while it runs)
};
template <class Op> inline Groups<Op>& lane(const char* what) {
    static Groups<Op> lanes[1024];
    Groups<Op>& L = lanes[emu_frag::linear_thread()];
    const uint3 blk = blockIdx;
    const unsigned long long launch = ::emu::detail::stats_ref().launches;
    const bool same = L.launch == launch && L.block.x == blk.x && L.block.y == blk.y &&
                      L.block.z == blk.z;
    if (!same) {
        const auto& failed = ::emu::detail::run().failed_launches;
        if (!L.pending.empty() && !std::binary_search(failed.begin(), failed.end(), L.launch))
            ::emu::detail::fail(::emu::detail::fmt(
                "%s of an earlier block or launch were never waited for", what));
        L.pending.clear();
        L.commits = 0;
        L.block = blk;
        L.launch = launch;
    }
    return L;
}
template <class Op> inline void issue(const Op& op, const char* what) {
    Groups<Op>& L = lane<Op>(what);
    L.pending.emplace_back(op, L.commits);
}
template <class Op> inline void commit(const char* what) { ++lane<Op>(what).commits; }
// Completes (`complete(op)`, in issue order) what a wait for `n` groups lets complete.
template <class Op, class Complete>
inline void wait(unsigned n, const char* what, Complete&& complete) {
    Groups<Op>& L = lane<Op>(what);
    std::vector<std::pair<Op, unsigned>> keep;
    for (const auto& [op, group] : L.pending) {
        if (group + n < L.commits) complete(op);
        else keep.emplace_back(op, group);
    }
    L.pending.swap(keep);
}
} // namespace emu_async

// =======================================================================================
// The async proxy's view of the dynamic shared memory (fence.proxy.async). PTX: wgmma reads
// its shared operands through the async proxy, while ordinary stores (st.shared) and the
// copies of cp.async write through the generic proxy; a generic-proxy write is guaranteed
// visible to a later async-proxy read only if the writing thread executes fence.proxy.async
// after it (and a barrier then hands the bytes over to the other threads). Without the fence
// real hardware mostly reads the new bytes and sometimes stale ones, so the emulator checks
// the rule instead: a per-block shadow of the dynamic shared memory says which bytes the
// generic proxy wrote since they were last fenced, and a wgmma whose descriptor reaches one
// fails the launch (checked when the wgmma is issued: the fence must come before it).
// - cp.async copies are attributed exactly: when a copy lands (at its thread's
//   cp.async.wait_group) its 16-byte chunk is marked with that thread, and only that
//   thread's fence clears the mark.
// - Plain stores cannot be intercepted (kernels store through ordinary pointers), so they are
//   found by value: `published` is a copy of the shared memory taken at every fence, and a
//   byte a wgmma reads that differs from its copy was stored after the block's last fence.
//   The approximation: one thread's fence publishes every earlier store of the block, not
//   only its own. A fence missing from every thread is always caught; a fence missing from
//   some threads (or placed before their stores) is caught when such a thread is the last to
//   store before the wgmma, which one of the two schedules (forward, reverse) arranges in
//   the usual "every thread stores, fences, then __syncthreads" shape. A store that rewrites
//   a byte's value is not seen (harmless). A copy per fence is affordable at test sizes
//   (attention_test: ~28k fences, ~1.7 GB copied in all).
// =======================================================================================
namespace emu_proxy {
struct Shadow {
    unsigned long long block = ~0ull;          // the Run::block_serial it describes
    std::vector<unsigned char> published;      // the dynamic shared memory at the last fence
    std::vector<unsigned short> owner;         // per 16-byte chunk: 1 + the linear index of
                                               // the thread whose landed cp.async is not
                                               // fenced yet, or 0
    std::vector<std::vector<unsigned>> marked; // per thread: the chunks it marked
};
inline Shadow& shadow() {
    static Shadow& s = *new Shadow;  // never destroyed: see run()
    const ::emu::detail::Run& R = ::emu::detail::run();
    if (s.block != R.block_serial) {
        // A block starts with its shared memory all poison (poison_shared): nothing written.
        s.block = R.block_serial;
        s.published.assign(R.smem, ::emu::detail::options().smem_poison);
        s.owner.assign((R.smem + 15) / 16, 0);
        s.marked.resize(1024);
        for (auto& m : s.marked) m.clear();
    }
    return s;
}
// A 16-byte cp.async copy of the calling thread landed at `dst`.
inline void landed(const unsigned char* dst) {
    const ::emu::detail::Run& R = ::emu::detail::run();
    const unsigned char* base = (const unsigned char*)R.dsmem;
    if (dst < base || dst >= base + R.smem) return; // static __shared__: wgmma cannot read it
    Shadow& s = shadow();
    const unsigned t = emu_frag::linear_thread();
    const size_t at = (size_t)(dst - base);
    for (size_t c = at / 16; c <= (at + 15) / 16 && c < s.owner.size(); ++c) {
        s.owner[c] = (unsigned short)(t + 1);
        s.marked[t].push_back((unsigned)c);
    }
}
// fence.proxy.async by the calling thread: publishes its landed copies, and (the
// approximation above) every store made so far.
inline void fence() {
    Shadow& s = shadow();
    const unsigned t = emu_frag::linear_thread();
    for (unsigned c : s.marked[t])
        if (s.owner[c] == t + 1) s.owner[c] = 0;
    s.marked[t].clear();
    const ::emu::detail::Run& R = ::emu::detail::run();
    if (R.smem) std::memcpy(s.published.data(), R.dsmem, R.smem);
}
// Fails unless the `bytes` bytes at shared offset `at`, which a wgmma is about to read as its
// operand `what`, were published by a fence after the generic proxy last wrote them.
inline void check_published(size_t at, size_t bytes, const char* what) {
    Shadow& s = shadow();
    const ::emu::detail::Run& R = ::emu::detail::run();
    const size_t end = std::min(at + bytes, R.smem); // beyond: the read itself fails later
    for (size_t c = at / 16; c * 16 < end; ++c) {
        if (s.owner[c])
            ::emu::detail::fail(::emu::detail::fmt(
                "wgmma reads %s at shared bytes %zu..%zu, which a cp.async of the thread of "
                "linear index %u wrote, and that thread executed no fence.proxy.async after its "
                "cp.async.wait_group completed the copy. PTX: cp.async writes through the "
                "generic proxy and wgmma reads through the async proxy; the writer must fence "
                "(mt_fence_proxy_async, Mma::publish) before the barrier that hands the bytes "
                "over",
                what, c * 16, c * 16 + 15, (unsigned)s.owner[c] - 1));
    }
    if (at < end && std::memcmp(s.published.data() + at, R.dsmem + at, end - at) != 0) {
        size_t i = at;
        while (s.published[i] == (unsigned char)R.dsmem[i]) ++i;
        ::emu::detail::fail(::emu::detail::fmt(
            "wgmma reads %s at shared byte %zu, which a store changed after the block's last "
            "fence.proxy.async. PTX: st.shared writes through the generic proxy and wgmma reads "
            "through the async proxy; the writer must fence (mt_fence_proxy_async) after its "
            "stores and before the barrier that hands them over",
            what, i));
    }
}
} // namespace emu_proxy

namespace emu_cp {
struct Copy {
    unsigned char* dst;
    unsigned char bytes[16];
};
constexpr const char* kWhat = "cp.async copies";
} // namespace emu_cp

inline void mt_cp_async_16(void* smem, const void* gmem, int src_bytes) {
    emu_cp::Copy c;
    c.dst = (unsigned char*)smem;
    const unsigned char* src = (const unsigned char*)gmem;
    for (int i = 0; i < 16; ++i) c.bytes[i] = i < src_bytes ? src[i] : 0;
    emu_async::issue(c, emu_cp::kWhat);
}
inline void mt_cp_async_commit() { emu_async::commit<emu_cp::Copy>(emu_cp::kWhat); }
template <int N> inline void mt_cp_async_wait() {
    emu_async::wait<emu_cp::Copy>(N, emu_cp::kWhat, [](const emu_cp::Copy& c) {
        std::memcpy(c.dst, c.bytes, 16);
        emu_proxy::landed(c.dst); // a generic-proxy write: unfenced until this thread fences
    });
}

// =======================================================================================
// Hopper's warpgroup products (prelude.cuh's mt_wgmma*, sm_90a's wgmma.mma_async with A in
// registers and B through a shared-memory descriptor). As PTX specifies them:
// - a warpgroup (4 consecutive warps of a block whose size is a multiple of 128) computes
//   a 64 × N product; warp w's A registers hold rows 16w.. in mma.sync's A layout and its
//   accumulators D the same rows in mma.sync's C/D layout (n-tile j in d[j]);
// - the descriptor: bits 0-13 the start (shared address >> 4), 16-29 LBO >> 4 (bytes
//   between core matrices along K), 32-45 SBO >> 4 (along N), 49-51 base offset and 62-63
//   swizzle (only 0, "interleaved", is emulated; anything else fails the launch); a core
//   matrix is 8 rows of 16 bytes, 128 contiguous bytes: B(k, n) lies at
//   start + (n/8)·SBO + (n%8)·16 + (k/8)·LBO + (k%8)·2 (TRANS_B 0: rows are n, 8 k values
//   each), or start + (k/8)·LBO + (k%8)·16 + (n/8)·SBO + (n%8)·2 (TRANS_B 1);
// - asynchronous: the product is computed, and D written, only when a wgmma.wait_group lets
//   its commit group complete. So a kernel that overwrites B's shared tile before waiting
//   gets different numbers here, and a product never committed and waited for fails that
//   thread's next wgmma call in another block or launch (emu_async, shared with cp.async).
//   Shared addresses are offsets into the launch's dynamic shared memory. Products exact,
//   summed in double, rounded to float once (as mma).
// Checked besides (each fails the launch naming the kernel, block and thread):
// - registers in flight (PTX: accessing a wgmma's accumulators or A registers before the
//   wgmma.wait_group that completes it is undefined): see InFlight below;
// - the async-proxy fence before a wgmma reads shared bytes the generic proxy wrote
//   (emu_proxy, above);
// - wgmma.fence between ordinary writes of a product's accumulator or A registers and the
//   wgmma that reads them, and before a thread's first wgmma (by value, against a copy of
//   the thread's stack taken at each fence: see Fenced below; reads are not seen);
// - .aligned: the lanes of a warp, and the 4 warps of a warpgroup, issue the same wgmma
//   (shape, types, descriptors), and each warp of a warpgroup as many of them in a block.
// Not checked: a fence that only some warps of the warpgroup execute (.aligned), and ordinary
// reads of the registers (only writes) on either side of a wgmma.fence.
// =======================================================================================
namespace emu_wg {
struct Pending {
    float (*d)[4];
    int n;
    bool trans, bf;
    unsigned long long desc;
    bool a_shared;           // A read through desc_a when the product completes
    unsigned long long desc_a;
    float a[2][16]; // this lane's two rows of A
    const unsigned* a_regs;  // A in registers: this lane's 4, and their values at issue
    unsigned a_bits[4];
};
constexpr const char* kWhat = "wgmma products";
inline const char* smem_base() { return ::emu::detail::run().dsmem; }

// Registers in flight. PTX: accessing (reading or writing) the accumulator registers or the
// A-fragment registers of a wgmma.mma_async before the wgmma.wait_group that completes it is
// undefined (the tensor cores read A and read-modify-write D at some point in between).
// - A (register form): its 4 registers are remembered at issue and must hold the same values
//   when the product completes, else the launch fails. (A read of them in between is not
//   seen.)
// - D: at issue the live accumulators are set aside here (the true sum goes on in `sum`)
//   and replaced by a signalling NaN; when a product completes they must still hold it, else
//   something wrote them and the launch fails; the sum goes back once the last product into
//   them completes. A read in between gets NaN, which reaches the kernel's output and fails
//   the test's comparison (a read cannot be seen otherwise); a read-modify-write (o *= a)
//   turns the signalling NaN into a quiet one, which counts as a write. Several products
//   into one D in flight at once (a k-loop's chain, in one commit group or several) are
//   legal and accumulate in issue order; D stays NaN until all of them completed.
constexpr unsigned kInFlightBits = 0x7FA5A5A5u; // a signalling NaN: arithmetic quiets it
struct InFlight {
    float (*d)[4];
    int n;        // N: the registers d[0..n/8)
    int products; // issued into them and not completed
    float sum[32][4];
};
inline std::vector<InFlight>& in_flight() {
    struct Lane {
        unsigned long long block = ~0ull;
        std::vector<InFlight> list;
    };
    static Lane* lanes = new Lane[1024];  // never destroyed: see run()
    Lane& L = lanes[emu_frag::linear_thread()];
    const unsigned long long blk = ::emu::detail::run().block_serial;
    if (L.block != blk) { // another block's: emu_async reports products never waited for
        L.block = blk;
        L.list.clear();
    }
    return L.list;
}
inline void check_d_untouched(const InFlight& f, const char* when) {
    for (int j = 0; j < f.n / 8; ++j)
        for (int e = 0; e < 4; ++e) {
            unsigned bits;
            std::memcpy(&bits, &f.d[j][e], 4);
            if (bits != kInFlightBits)
                ::emu::detail::fail(::emu::detail::fmt(
                    "the accumulators of a wgmma in flight were written before the "
                    "wgmma.wait_group that completes it (d[%d][%d] holds %g, not the emulator's "
                    "in-flight NaN, %s). PTX makes accessing a wgmma's accumulator registers "
                    "before that wait undefined: mt_wgmma_wait first",
                    j, e, (double)f.d[j][e], when));
        }
}
// A product into `d` (n/8 tiles) is issued: set its accumulators aside (see above).
inline void hold_d(float (*d)[4], int n) {
    std::vector<InFlight>& list = in_flight();
    InFlight* f = nullptr;
    for (InFlight& x : list) {
        if (x.d == d && x.n == n) {
            f = &x;
        } else if ((const float*)d < (const float*)(x.d + x.n / 8) &&
                   (const float*)x.d < (const float*)(d + n / 8)) {
            ::emu::detail::fail("wgmma: accumulators that overlap those of another product in "
                                "flight without being the same registers (the same d and N)");
        }
    }
    if (f) {
        check_d_untouched(*f, "as another wgmma into them is issued");
    } else {
        list.push_back(InFlight{d, n, 0, {}});
        f = &list.back();
        for (int j = 0; j < n / 8; ++j)
            for (int e = 0; e < 4; ++e) f->sum[j][e] = d[j][e];
    }
    ++f->products;
    float nan;
    std::memcpy(&nan, &kInFlightBits, 4);
    for (int j = 0; j < n / 8; ++j)
        for (int e = 0; e < 4; ++e) d[j][e] = nan;
}

// wgmma.fence. PTX: the warpgroup must execute wgmma.fence.sync.aligned before its first
// wgmma.mma_async, and between any access by other instructions to a wgmma's accumulator
// registers (or, A in registers, its A-fragment registers) and the wgmma.mma_async that uses
// them; only wgmmas that accumulate into the same registers one after another need none
// between them. Without it the tensor cores may read values from before the write (or the
// write may land after the product's): silently undefined on an H100. Checked by value, per
// thread, when a wgmma is issued:
// - each wgmma.fence copies the thread's live stack (the kernel's "registers": its frames
//   above the fence's) into `image`; when the last product into an accumulator array
//   completes (wait_group) the completed values go into the image too (a wgmma's own write
//   needs no fence before the next wgmma into them);
// - at issue, the registers the product reads (D unless a chain into it is in flight, whose
//   D holds the in-flight NaN and is checked by InFlight; A when from registers) must hold
//   what the image says, bit for bit; a register that differs, or lies in a frame made after
//   the fence (declared after it), was written by ordinary code since the fence: the launch
//   fails. A wgmma with no fence before it in the block fails too.
// The approximation: only writes are seen (an ordinary read of the registers between the
// last fence and the wgmma is undefined too, but not caught), and a write that stores the
// value the register already held (o *= 1) is not seen. The .aligned part (every warp of
// the warpgroup fences) is not checked. Registers outside the thread's fiber stack (none in
// real kernels; locals moved elsewhere by a sanitizer's fake stack) get only the "a fence
// before the first wgmma" check. The fence is a compiler barrier (a memory clobber, then a
// call the compiler does not inline) so that -O2 neither sinks stores to the registers
// past it nor hoists later ones before it. Cost: a copy of ~1.2 KB per lane and fence
// (attention_test: ~61k fences, ~74 MB per schedule), lost in the noise.
struct Fenced {
    unsigned long long block = ~0ull; // the Run::block_serial it describes
    bool fenced = false;               // a wgmma.fence executed in this block
    const unsigned char* lo = nullptr; // the image covers [lo, lo + image.size())
    std::vector<unsigned char> image;
};
inline Fenced& fenced_lane() {
    static Fenced* lanes = new Fenced[1024];  // never destroyed: see run()
    Fenced& L = lanes[emu_frag::linear_thread()];
    const unsigned long long blk = ::emu::detail::run().block_serial;
    if (L.block != blk) {
        L.block = blk;
        L.fenced = false;
        L.lo = nullptr;
        L.image.clear();
    }
    return L;
}
// The calling fiber's stack, [lo, hi).
inline void fiber_stack(const unsigned char*& lo, const unsigned char*& hi) {
    const ::emu::detail::Run& R = ::emu::detail::run();
    const ::emu::detail::Fiber* f = ::emu::detail::current("mt_wgmma_fence / mt_wgmma");
    lo = (const unsigned char*)R.stacks.lo(f->linear);
    hi = lo + R.stacks.usable;
}
// wgmma.fence by the calling thread: the image of its stack above this call.
__attribute__((noinline)) inline void fence_registers() {
    Fenced& L = fenced_lane();
    L.fenced = true;
    const unsigned char *lo, *hi;
    fiber_stack(lo, hi);
    const unsigned char* sp = (const unsigned char*)__builtin_frame_address(0);
    if (sp < lo || sp >= hi) { // not on the fiber's stack: nothing to compare with
        L.lo = nullptr;
        L.image.clear();
        return;
    }
    L.lo = sp;
    L.image.assign(sp, hi);
}
// The `bytes` bytes at `p` (accumulators) were just written by a completing product.
inline void fenced_update(const void* p, size_t bytes) {
    Fenced& L = fenced_lane();
    if (!L.lo) return;
    const unsigned char* b = (const unsigned char*)p;
    const unsigned char* s = std::max(b, L.lo);
    const unsigned char* e = std::min(b + bytes, L.lo + L.image.size());
    if (s < e) std::memcpy(L.image.data() + (s - L.lo), s, (size_t)(e - s));
}
// Fails unless the `words` 32-bit registers at `p` (the product's accumulators d, or its A
// fragment a) hold what they held at the thread's last wgmma.fence (or as the product that
// last wrote them completed).
inline void check_unchanged_since_fence(const Fenced& L, const void* p, int words, bool d) {
    const unsigned char *lo, *hi;
    fiber_stack(lo, hi);
    const unsigned char* b = (const unsigned char*)p;
    if (!L.lo || b < lo || b + 4 * (size_t)words > hi) return; // see the approximation above
    const unsigned char* img_end = L.lo + L.image.size();
    for (int w = 0; w < words; ++w) {
        const unsigned char* at = b + 4 * w;
        unsigned now, then = 0;
        std::memcpy(&now, at, 4);
        const bool live = at >= L.lo && at + 4 <= img_end;
        if (live) std::memcpy(&then, L.image.data() + (at - L.lo), 4);
        if (live && now == then) continue;
        float now_f;
        std::memcpy(&now_f, &now, 4);
        const std::string reg =
            d ? ::emu::detail::fmt("accumulator register d[%d][%d]", w / 4, w % 4)
              : ::emu::detail::fmt("A-fragment register a[%d]", w);
        const std::string was =
            live ? ::emu::detail::fmt("it held 0x%08x at the thread's last wgmma.fence, or as "
                                      "the last product into it completed",
                                      then)
                 : std::string("it lies in a stack frame made after the thread's last "
                               "wgmma.fence, so it was written after that fence");
        ::emu::detail::fail(::emu::detail::fmt(
            "wgmma.fence missing: a wgmma.mma_async reads %s, which ordinary code wrote after "
            "the thread's last wgmma.fence (it holds %g, 0x%08x; %s). PTX: the warpgroup must "
            "execute wgmma.fence.sync.aligned between any access to a wgmma's accumulator or "
            "A-fragment registers by other instructions and the wgmma.mma_async that uses "
            "them: mt_wgmma_fence after writing them, before issuing the product",
            reg.c_str(), (double)now_f, now, was.c_str()));
    }
}
// The wgmma.fence check of a product about to be issued (into d, N = n; A in registers at
// `a`, or nullptr).
inline void check_wgmma_fence(float (*d)[4], int n, const unsigned* a) {
    const Fenced& L = fenced_lane();
    if (!L.fenced)
        ::emu::detail::fail(
            "wgmma.fence missing: a wgmma.mma_async was issued by a thread that executed no "
            "wgmma.fence in this block. PTX: the warpgroup must execute "
            "wgmma.fence.sync.aligned before its first wgmma.mma_async, and between any access "
            "to a wgmma's accumulator or A-fragment registers by other instructions and the "
            "wgmma.mma_async that uses them (mt_wgmma_fence)");
    bool chained = false; // D in flight (hold_d checks it, and rejects a partial overlap)
    for (const InFlight& x : in_flight())
        if ((const float*)d < (const float*)(x.d + x.n / 8) &&
            (const float*)x.d < (const float*)(d + n / 8))
            chained = true;
    if (!chained) check_unchanged_since_fence(L, d, n / 2, true);
    if (a) check_unchanged_since_fence(L, a, 4, false);
}

// Element (k, mn) of an operand in shared memory through `desc`: K-major (trans false, a
// core matrix row is 8 K values of one m or n) or MN-major (trans true, 8 M/N values of one k).
inline float smem_value(unsigned long long desc, bool trans, bool bf, int k, int mn,
                        const char* what) {
    const ::emu::detail::Run& R = ::emu::detail::run();
    const size_t start = (desc & 0x3FFF) << 4, lbo = ((desc >> 16) & 0x3FFF) << 4,
                 sbo = ((desc >> 32) & 0x3FFF) << 4;
    const size_t at = trans ? start + (k / 8) * lbo + (k % 8) * 16 + (mn / 8) * sbo + (mn % 8) * 2
                            : start + (mn / 8) * sbo + (mn % 8) * 16 + (k / 8) * lbo + (k % 8) * 2;
    if (at + 2 > R.smem)
        ::emu::detail::fail(::emu::detail::fmt(
            "wgmma reads %s(k %d, %d) at shared byte %zu, past the %zu bytes of dynamic shared "
            "memory",
            what, k, mn, at, R.smem));
    unsigned short bits;
    std::memcpy(&bits, R.dsmem + at, 2);
    return emu_frag::half_bits_to_float(bits, bf);
}
// The async-proxy fence check of an operand's bytes: its 2 × `groups` core matrices (K 16
// deep; `groups` of 8 along M or N), 128 contiguous bytes each at start + kc·LBO + g·SBO
// in either layout.
inline void check_fenced(unsigned long long desc, int groups, const char* what) {
    const size_t start = (desc & 0x3FFF) << 4, lbo = ((desc >> 16) & 0x3FFF) << 4,
                 sbo = ((desc >> 32) & 0x3FFF) << 4;
    for (int kc = 0; kc < 2; ++kc)
        for (int g = 0; g < groups; ++g)
            emu_proxy::check_published(start + kc * lbo + g * sbo, 128, what);
}
inline float b_value(const Pending& p, int k, int n) {
    return smem_value(p.desc, p.trans, p.bf, k, n, "B");
}
// Completes a product (at the wait that lets its group complete).
inline void apply(Pending p) {
    const unsigned t = emu_frag::linear_thread(), lane = t % 32;
    const int c = 2 * (lane % 4);
    if (!p.a_shared) {
        for (int i = 0; i < 4; ++i)
            if (p.a_regs[i] != p.a_bits[i])
                ::emu::detail::fail(::emu::detail::fmt(
                    "register a[%d] of a wgmma's A fragment changed (0x%08x at issue, 0x%08x now) "
                    "before the wgmma.wait_group that completes it. PTX makes accessing the A "
                    "registers of a wgmma in flight undefined (the product may read either "
                    "value): write new A fragments into other registers, or wait first",
                    i, p.a_bits[i], p.a_regs[i]));
    }
    std::vector<InFlight>& list = in_flight();
    auto f = std::find_if(list.begin(), list.end(), [&](const InFlight& x) { return x.d == p.d; });
    if (f == list.end()) ::emu::detail::fail("wgmma emulation: a product's accumulators are lost");
    check_d_untouched(*f, "as the wait completes the product");
    if (p.a_shared) {
        // This lane's rows of the warpgroup's 64: its warp's 16 (warp w of the group holds
        // rows 16w..), rows g and g + 8 of them.
        const int m0 = 16 * (int)((t / 32) % 4) + (int)(lane / 4);
        for (int r = 0; r < 2; ++r)
            for (int k = 0; k < 16; ++k)
                p.a[r][k] = smem_value(p.desc_a, false, p.bf, k, m0 + 8 * r, "A");
    }
    for (int j = 0; j < p.n / 8; ++j) {
        for (int e = 0; e < 4; ++e) {
            const int col = 8 * j + c + (e & 1);
            double acc = f->sum[j][e];
            for (int k = 0; k < 16; ++k) acc += (double)p.a[e >> 1][k] * (double)b_value(p, k, col);
            f->sum[j][e] = (float)acc;
        }
    }
    if (--f->products == 0) {
        for (int j = 0; j < p.n / 8; ++j)
            for (int e = 0; e < 4; ++e) p.d[j][e] = f->sum[j][e];
        fenced_update(p.d, (size_t)p.n / 8 * sizeof *p.d); // a wgmma's write: no fence needed
        list.erase(f);
    }
}

// .aligned across the warpgroup: the n-th wgmma of each of its warps must be the same
// instruction (shape, types, descriptors). Its 4 warps do not meet at a wgmma, so each
// warp's n-th is compared with the n-th of the first warp to issue it, and at the end of
// the block each warp must have issued as many (block_end).
struct Issued {
    unsigned long long desc, desc_a;
    int n;
    bool trans, bf, a_shared;
    unsigned warp; // the first to issue it
    bool same(const Issued& o) const {
        return desc == o.desc && desc_a == o.desc_a && n == o.n && trans == o.trans &&
               bf == o.bf && a_shared == o.a_shared;
    }
};
struct GroupLog {
    std::vector<Issued> seq;
    unsigned count[4] = {0, 0, 0, 0}; // wgmmas issued by each warp
};
struct BlockLog {
    unsigned long long block = ~0ull;
    std::vector<GroupLog> groups;
};
inline BlockLog& block_log_state() {
    static BlockLog& b = *new BlockLog;  // never destroyed: see run()
    return b;
}
inline BlockLog& block_log() {
    BlockLog& b = block_log_state();
    const ::emu::detail::Run& R = ::emu::detail::run();
    if (b.block != R.block_serial) {
        b.block = R.block_serial;
        b.groups.assign((R.nthreads + 127) / 128, GroupLog{});
    }
    return b;
}
// The calling warp (its lane 0) issues `me`.
inline void check_warpgroup(Issued me) {
    const unsigned warp = emu_frag::linear_thread() / 32;
    GroupLog& g = block_log().groups[warp / 4];
    unsigned& k = g.count[warp % 4];
    me.warp = warp;
    if (k == g.seq.size()) {
        g.seq.push_back(me);
    } else if (!g.seq[k].same(me)) {
        const Issued& o = g.seq[k];
        auto form = [](const Issued& x) {
            return ::emu::detail::fmt("N %d, %s, B descriptor 0x%llx, A %s 0x%llx", x.n,
                                      x.trans ? "TRANS_B" : "no TRANS_B", x.desc,
                                      x.a_shared ? "descriptor" : "in registers, 0x0 =", x.desc_a);
        };
        ::emu::detail::fail(::emu::detail::fmt(
            "wgmma: the warps of a warpgroup issued different wgmmas: wgmma #%u of warp %u has "
            "%s; warp %u's has %s. PTX (.aligned): every thread of the warpgroup executes the "
            "same wgmma.mma_async, with the same descriptors",
            k, warp, form(me).c_str(), o.warp, form(o).c_str()));
    }
    ++k;
}
// After a block: every warp of each warpgroup issued as many wgmmas.
inline void block_end() {
    const ::emu::detail::Run& R = ::emu::detail::run();
    const BlockLog& b = block_log_state();
    if (b.block != R.block_serial) return; // no wgmma in this block
    for (size_t g = 0; g < b.groups.size(); ++g) {
        const unsigned* c = b.groups[g].count;
        if (c[0] != c[1] || c[0] != c[2] || c[0] != c[3])
            throw ::emu::Error(::emu::detail::fmt(
                "emu: error in %s: the warps of warpgroup %zu issued different numbers of wgmmas "
                "(%u, %u, %u, %u). PTX (.aligned): every thread of the warpgroup executes the same "
                "wgmma.mma_async instructions",
                ::emu::detail::launch_context().c_str(), g, c[0], c[1], c[2], c[3]));
    }
}

// Issues a product: A from this warp's registers `a`, or (a == nullptr) from shared memory
// through desc_a when it completes.
template <class T, int N, int TRANS_B>
inline void issue(float (*d)[4], const unsigned* a, unsigned long long desc_a,
                  unsigned long long desc) {
    static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                  "wgmma here takes bf16 or f16");
    static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma m64nNk16: N a multiple of 8 to 256");
    const unsigned t = emu_frag::linear_thread(), warp = t / 32, lane = t % 32;
    const dim3 bd = blockDim;
    if ((bd.x * bd.y * bd.z) % 128 != 0)
        ::emu::detail::fail("wgmma needs whole warpgroups: the block's threads are not a multiple of 128");
    for (unsigned long long dsc : {desc, a ? 0ull : desc_a})
        if ((dsc >> 62) != 0 || ((dsc >> 49) & 7) != 0)
            ::emu::detail::fail("wgmma descriptor with a swizzle or base offset (only the "
                                "interleaved layout is emulated)");
    check_wgmma_fence(d, N, a); // before hold_d sets D aside
    auto& st = emu_frag::staging()[warp];
    for (int i = 0; i < 4; ++i) st[lane][i] = a ? a[i] : 0;
    st[lane][4] = desc;
    st[lane][5] = desc_a;
    __syncwarp();
    emu_wg::Pending p;
    p.d = d;
    p.n = N;
    p.trans = TRANS_B != 0;
    p.bf = std::is_same<T, __nv_bfloat16>::value;
    p.desc = desc;
    p.a_shared = a == nullptr;
    p.desc_a = desc_a;
    p.a_regs = a;
    for (int i = 0; i < 4; ++i) p.a_bits[i] = a ? a[i] : 0;
    bool uniform = true;
    for (int s = 0; s < 32; ++s) uniform = uniform && st[s][4] == desc && st[s][5] == desc_a;
    const int g = lane / 4;
    for (int q = 0; q < 4; ++q) {
        const auto& src = st[4 * g + q];
        auto put = [&](int row, int col, unsigned long long v) {
            p.a[row][col] = emu_frag::half_bits_to_float((unsigned short)(v & 0xFFFF), p.bf);
            p.a[row][col + 1] = emu_frag::half_bits_to_float((unsigned short)((v >> 16) & 0xFFFF), p.bf);
        };
        put(0, 2 * q, src[0]);
        put(1, 2 * q, src[1]);
        put(0, 2 * q + 8, src[2]);
        put(1, 2 * q + 8, src[3]);
    }
    __syncwarp();
    if (!uniform) ::emu::detail::fail("wgmma: the lanes of a warp gave different descriptors");
    // Once per warp, now that all its lanes are here: the same wgmma as the rest of the
    // warpgroup's, reading shared bytes published to the async proxy.
    if (lane == 0) {
        check_warpgroup(Issued{desc, desc_a, N, p.trans, p.bf, p.a_shared, 0});
        check_fenced(desc, N / 8, "B");
        if (p.a_shared) check_fenced(desc_a, 8, "A");
    }
    hold_d(d, N);
    emu_async::issue(p, kWhat);
}
} // namespace emu_wg

namespace emu {
namespace detail {
inline void wgmma_block_end() { ::emu_wg::block_end(); }
} // namespace detail
} // namespace emu

inline unsigned long long mt_wgmma_desc(const void* smem, unsigned lbo, unsigned sbo) {
    const ::emu::detail::Run& R = ::emu::detail::run();
    const char* p = (const char*)smem;
    if (p < R.dsmem || p >= R.dsmem + R.smem)
        ::emu::detail::fail("mt_wgmma_desc of an address outside the dynamic shared memory");
    const unsigned long long addr = (unsigned long long)(p - R.dsmem);
    if (addr % 16 || lbo % 16 || sbo % 16)
        ::emu::detail::fail("a wgmma descriptor's start, LBO and SBO must be multiples of 16 bytes");
    return ((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
           ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32);
}
inline void mt_wgmma_fence() {
    asm volatile("" ::: "memory"); // stores to the registers happen on their side of the fence
    emu_wg::fence_registers();
}
inline void mt_fence_proxy_async() { emu_proxy::fence(); }
template <int N> inline void mt_wgmma_hold(float (*)[4]) {}
inline void mt_wgmma_commit() { emu_async::commit<emu_wg::Pending>(emu_wg::kWhat); }
template <int N> inline void mt_wgmma_wait() {
    emu_async::wait<emu_wg::Pending>(N, emu_wg::kWhat,
                                     [](const emu_wg::Pending& p) { emu_wg::apply(p); });
}
template <class T, int N, int TRANS_B>
inline void mt_wgmma(float (*d)[4], const unsigned* a, unsigned long long desc) {
    emu_wg::issue<T, N, TRANS_B>(d, a, 0, desc);
}
template <class T, int N, int TRANS_B>
inline void mt_wgmma_ss(float (*d)[4], unsigned long long desc_a, unsigned long long desc) {
    emu_wg::issue<T, N, TRANS_B>(d, nullptr, desc_a, desc);
}

// =======================================================================================
// The test API.
// =======================================================================================
namespace emu {

/// The grid argument of emu::launch: a dim3 or a number, plus (captured implicitly) the
/// file:line of the launch, which error messages quote.
struct GridArg {
    dim3 dims;
    detail::Site site;
    GridArg(dim3 d, EMU_SITE_PARAMS) : dims(d), site{emu_file, emu_line} {}
    GridArg(unsigned long long x, unsigned long long y = 1, unsigned long long z = 1,
            EMU_SITE_PARAMS)
        : dims((unsigned)x, (unsigned)y, (unsigned)z), site{emu_file, emu_line} {
        if (x > 0xFFFFFFFFull || y > 0xFFFFFFFFull || z > 0xFFFFFFFFull)
            throw Error(detail::fmt("emu::launch at %s: grid dimension does not fit 32 bits",
                                    detail::site_str(site).c_str()));
    }
};

/// Runs `kernel(args...)` for every thread of every block of `grid` x `block`, like
/// `kernel<<<grid, block, dynamic_smem_bytes>>>(args...)` followed by a device
/// synchronisation. Arguments are converted to the kernel's parameter types as in a call.
/// Throws emu::Error on a launch error, a deadlock, a misused collective, or a write past the
/// end of dynamic shared memory or of an emu::alloc buffer.
template <class... P, class... A>
inline void launch(void (*kernel)(P...), GridArg grid, dim3 block, size_t dynamic_smem_bytes,
                   A&&... args) {
    static_assert(sizeof...(P) == sizeof...(A),
                  "emu::launch: the number of arguments differs from the kernel's parameters");
    struct Data {
        void (*k)(P...);
        std::tuple<std::decay_t<P>...> params;
    };
    Data d{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)};
    void (*thunk)(void*) = [](void* p) {
        Data* dd = static_cast<Data*>(p);
        std::apply(dd->k, dd->params);
    };
    detail::launch_impl(detail::kernel_name(reinterpret_cast<void*>(kernel)), grid.dims,
                        grid.site, block, dynamic_smem_bytes, thunk, &d);
}

/// The order of blocks and threads of the next launches (overrides EMU_SCHEDULE).
inline void set_schedule(Schedule s, std::uint64_t seed = 1) {
    detail::Options& o = detail::options();
    o.schedule = s;
    o.seed = seed;
    detail::schedule_rng().s = seed;
}
inline Schedule schedule() { return detail::options().schedule; }
inline const char* schedule_name() {
    switch (schedule()) {
    case Schedule::Forward: return "forward";
    case Schedule::Reverse: return "reverse";
    case Schedule::Random: return "random";
    }
    return "?";
}
/// Whether threads that returned count as arrived at __syncthreads (EMU_EXITED_ARRIVE).
inline void set_exited_threads_arrive(bool on) { detail::options().exited_arrive = on; }
inline const Stats& stats() { return detail::stats_ref(); }

/// "Device" memory: n elements, 256-byte aligned (as the Rust side allocates), filled with
/// poison_value<T>() (NaN for floating point) so outputs a kernel forgets to write show up.
/// The buffer ends at a 256-byte boundary followed by a PROT_NONE page: an access further
/// past the end faults (the crash handler names the buffer), and a write into the padding is
/// reported by the launch. Freed by emu::free or at exit.
template <class T> inline T* alloc(size_t n, EMU_SITE_PARAMS) {
    static_assert(std::is_trivially_copyable<T>::value, "emu::alloc needs a trivial type");
    detail::install_crash_handler();
    const size_t pg = detail::page_size();
    const size_t bytes = n * sizeof(T);
    const size_t padded = detail::round_up(bytes ? bytes : 1, 256);
    const size_t body = detail::round_up(padded, pg);
    const size_t len = body + 2 * pg;
    void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        throw Error(detail::fmt("emu::alloc of %zu bytes at %s failed", bytes,
                                detail::site_str(detail::Site{emu_file, emu_line}).c_str()));
    char* map = (char*)m;
    mprotect(map, pg, PROT_NONE);
    mprotect(map + pg + body, pg, PROT_NONE);
    char* p = map + pg + body - padded;
    const T poison = poison_value<T>();
    for (size_t i = 0; i < n; ++i) std::memcpy(p + i * sizeof(T), &poison, sizeof(T));
    std::memset(p + bytes, detail::kCanary, padded - bytes);
    detail::allocs().push_back(
        detail::AllocRec{p, bytes, padded, map, len, detail::Site{emu_file, emu_line}, sizeof(T)});
    return (T*)p;
}

/// Frees a buffer of emu::alloc (nullptr is fine).
inline void free(const void* p) {
    if (!p) return;
    auto& v = detail::allocs();
    for (size_t i = 0; i < v.size(); ++i) {
        if (v[i].ptr == (const char*)p) {
            munmap(v[i].map, v[i].map_len);
            v.erase(v.begin() + (long)i);
            return;
        }
    }
    throw Error(detail::fmt("emu::free(%p): not a buffer of emu::alloc", p));
}

/// A device copy of `host`.
template <class T> inline T* upload(const std::vector<T>& host, EMU_SITE_PARAMS) {
    T* p = alloc<T>(host.size(), emu_file, emu_line);
    if (!host.empty()) std::memcpy((void*)p, host.data(), host.size() * sizeof(T));
    return p;
}
/// A host copy of n elements at p.
template <class T> inline std::vector<T> download(const T* p, size_t n) {
    std::vector<T> v(n);
    if (n) std::memcpy((void*)v.data(), p, n * sizeof(T));
    return v;
}

// ---------------------------------------------------------------------------------------
// Test helpers: deterministic random numbers, checks that print the first mismatches and
// count failures, and a summary for main's exit status.

/// Deterministic random numbers (splitmix64).
struct Rng {
    std::uint64_t state;
    explicit Rng(std::uint64_t seed = 1) : state(seed) {}
    std::uint64_t next() {
        detail::SplitMix s{state};
        const std::uint64_t v = s.next();
        state = s.s;
        return v;
    }
    /// Uniform in [0, 1).
    double uniform() { return (double)(next() >> 11) * (1.0 / 9007199254740992.0); }
    float uniform(float lo, float hi) { return lo + (hi - lo) * (float)uniform(); }
    /// Standard normal (Box-Muller).
    float normal() {
        const double u = 1.0 - uniform(), v = uniform();
        return (float)(std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v));
    }
    /// Uniform in [0, n).
    std::uint64_t below(std::uint64_t n) { return next() % n; }
};

inline int& check_failures() {
    static int n = 0;
    return n;
}
inline void report_failure(const char* file, int line, const std::string& msg) {
    std::fprintf(stderr, "%s:%d: FAILED: %s\n", detail::base_name(file), line, msg.c_str());
    ++check_failures();
}
/// EMU_CHECK(cond) / EMU_CHECKF(cond, printf-format, ...): count and print a failure.
#define EMU_CHECK(cond)                                                                      \
    do {                                                                                     \
        if (!(cond)) ::emu::report_failure(__FILE__, __LINE__, #cond);                       \
    } while (0)
#define EMU_CHECKF(cond, ...)                                                                \
    do {                                                                                     \
        if (!(cond))                                                                         \
            ::emu::report_failure(__FILE__, __LINE__,                                        \
                                  std::string(#cond) + ": " + ::emu::detail::fmt(__VA_ARGS__)); \
    } while (0)

namespace detail {
template <class T> inline double as_double(T v) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value)
        return (double)(float)v;
    else
        return (double)v;
}
} // namespace detail

/// Checks |got - want| <= atol + rtol*|want| element-wise (NaN must match NaN, infinities
/// must be equal). Prints the first `max_report` mismatches, the count and the largest error.
template <class G, class W>
inline bool check_close(const char* what, const G* got, const W* want, size_t n, double atol,
                        double rtol, size_t max_report = 8, EMU_SITE_PARAMS) {
    size_t bad = 0;
    double worst = 0.0;
    size_t worst_i = 0;
    for (size_t i = 0; i < n; ++i) {
        const double g = detail::as_double(got[i]), w = detail::as_double(want[i]);
        bool ok;
        if (std::isnan(w) || std::isnan(g)) {
            ok = std::isnan(w) && std::isnan(g);
        } else if (std::isinf(w) || std::isinf(g)) {
            ok = g == w;
        } else {
            const double err = std::fabs(g - w);
            ok = err <= atol + rtol * std::fabs(w);
            if (err > worst) {
                worst = err;
                worst_i = i;
            }
        }
        if (!ok) {
            if (bad < max_report)
                std::fprintf(stderr, "%s:%d: %s[%zu]: got %.9g, want %.9g (atol %g, rtol %g)\n",
                             detail::base_name(emu_file), emu_line, what, i, g, w, atol, rtol);
            ++bad;
        }
    }
    if (bad) {
        report_failure(emu_file, emu_line,
                       detail::fmt("%s: %zu of %zu values differ; largest |error| %.3g at [%zu]",
                                   what, bad, n, worst, worst_i));
    }
    return bad == 0;
}
template <class G, class W>
inline bool check_close(const char* what, const std::vector<G>& got, const std::vector<W>& want,
                        double atol, double rtol, size_t max_report = 8, EMU_SITE_PARAMS) {
    if (got.size() != want.size()) {
        report_failure(emu_file, emu_line,
                       detail::fmt("%s: sizes differ (%zu vs %zu)", what, got.size(), want.size()));
        return false;
    }
    return check_close(what, got.data(), want.data(), got.size(), atol, rtol, max_report,
                       emu_file, emu_line);
}
/// Bitwise equality (for deterministic kernels and integer outputs).
template <class T>
inline bool check_equal(const char* what, const T* got, const T* want, size_t n,
                        size_t max_report = 8, EMU_SITE_PARAMS) {
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
        if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
            if (bad < max_report) {
                if constexpr (std::is_arithmetic<T>::value || std::is_same<T, __half>::value ||
                              std::is_same<T, __nv_bfloat16>::value)
                    std::fprintf(stderr, "%s:%d: %s[%zu]: got %.9g, want %.9g\n",
                                 detail::base_name(emu_file), emu_line, what, i,
                                 detail::as_double(got[i]), detail::as_double(want[i]));
                else
                    std::fprintf(stderr, "%s:%d: %s[%zu] differs\n", detail::base_name(emu_file),
                                 emu_line, what, i);
            }
            ++bad;
        }
    }
    if (bad)
        report_failure(emu_file, emu_line,
                       detail::fmt("%s: %zu of %zu values differ", what, bad, n));
    return bad == 0;
}

/// Runs one named test case: an emu::Error (or any exception) counts as a failure and the
/// program goes on with the next case. Prints "ok"/"FAILED" per case.
template <class F> inline bool run_test(const char* name, F&& body) {
    const int before = check_failures();
    try {
        body();
    } catch (const std::exception& e) {
        report_failure(name, 0, detail::fmt("exception: %s", e.what()));
    }
    const bool ok = check_failures() == before;
    std::printf("  %-50s %s\n", name, ok ? "ok" : "FAILED");
    std::fflush(stdout);
    return ok;
}

/// The exit status for main: prints a summary line.
inline int finish(const char* program = "test") {
    const int n = check_failures();
    if (n)
        std::printf("%s: %d check(s) FAILED (schedule %s)\n", program, n, schedule_name());
    else
        std::printf("%s: all checks passed (schedule %s, %llu launches, %llu blocks)\n", program,
                    schedule_name(), stats().launches, stats().blocks);
    return n ? 1 : 0;
}

} // namespace emu

#endif // MESHTRAIN_CUDA_EMU_H
