// The kernel half of the emulated CUDA device (see README.md beside this file): the tables of
// every kernel file's `extern "C"` kernels by name (each file compiled as host C++ against
// cuda_emu.h), device memory, and the products cuBLASLt would run, so that driver.cpp can
// answer cuModuleGetFunction, cuLaunchKernel, cuMemAlloc and cublasLtMatmul on the CPU.
#include "cuda_emu.h"
#include "emu_device.h"
#include "emu_registry.h"

#include <cstdio>
#include <cstring>

// Each kernel file is its own translation unit (build.sh writes kernels_<file>.cpp: the
// file and its table, EMU_KERNEL_TABLE below), as the emulator tests compile them: a
// `__shared__` variable of an inline function and one of a kernel may not share a section
// in one assembler file.
#include "kernel_tables.inc" // generated: EMU_DECLARE_TABLE(stem) for every kernel file

namespace {

struct Table {
    const emu_registry::Entry* entries;
    size_t count;
};

const std::vector<Table>& tables() {
    static const std::vector<Table> t = [] {
        std::vector<Table> v;
#undef EMU_DECLARE_TABLE
#define EMU_DECLARE_TABLE(stem)                                                              \
    {                                                                                        \
        size_t n = 0;                                                                        \
        const emu_registry::Entry* e = emu_kernels_##stem(&n);                              \
        v.push_back(Table{e, n});                                                            \
    }
#include "kernel_tables.inc"
#undef EMU_DECLARE_TABLE
        return v;
    }();
    return t;
}

void write_error(char* err, size_t len, const char* msg) {
    if (err && len) std::snprintf(err, len, "%s", msg);
}

} // namespace

extern "C" const void* emu_device_find_kernel(const char* name) {
    for (const Table& t : tables())
        for (size_t i = 0; i < t.count; ++i)
            if (std::strcmp(t.entries[i].name, name) == 0) return &t.entries[i];
    return nullptr;
}

extern "C" const char* emu_device_kernel_name(const void* kernel) {
    return static_cast<const emu_registry::Entry*>(kernel)->name;
}

extern "C" int emu_device_launch(const void* kernel, const unsigned grid[3],
                                 const unsigned block[3], size_t smem, void** params, char* err,
                                 size_t err_len) {
    const emu_registry::Entry* e = static_cast<const emu_registry::Entry*>(kernel);
    try {
        e->call(e->fn, dim3(grid[0], grid[1], grid[2]), dim3(block[0], block[1], block[2]), smem,
                params);
        return 0;
    } catch (const std::exception& ex) {
        write_error(err, err_len, ex.what());
        return 1;
    }
}

// ---------------------------------------------------------------------------------------
// Products: D = alpha * op(A) op(B) + beta * D in cuBLAS's column-major terms, then the
// epilogue, as cublasLtMatmul defines them (the subset meshtrain's blas.rs asks for).

namespace {

double load(const void* p, int type, size_t i, float scale) {
    switch (type) {
    case EMU_R_32F: return static_cast<const float*>(p)[i];
    case EMU_R_16BF: return (float)static_cast<const __nv_bfloat16*>(p)[i];
    case EMU_R_16F: return (float)static_cast<const __half*>(p)[i];
    case EMU_R_8F_E4M3:
        return emu_device_fp8_decode(static_cast<const unsigned char*>(p)[i], 4, 3) * scale;
    case EMU_R_8F_E5M2:
        return emu_device_fp8_decode(static_cast<const unsigned char*>(p)[i], 5, 2) * scale;
    }
    return 0.0;
}

void store(void* p, int type, size_t i, double v) {
    switch (type) {
    case EMU_R_32F: static_cast<float*>(p)[i] = (float)v; break;
    case EMU_R_16BF: static_cast<__nv_bfloat16*>(p)[i] = __nv_bfloat16((float)v); break;
    case EMU_R_16F: static_cast<__half*>(p)[i] = __half((float)v); break;
    }
}

/// TF32: f32 with its mantissa rounded to 10 bits (nearest, ties to even), as the tensor
/// cores read f32 operands under CUBLAS_COMPUTE_32F_FAST_TF32.
double tf32(double v) {
    float f = (float)v;
    unsigned u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return f;
    const unsigned lsb = (u >> 13) & 1u;
    u += 0xfffu + lsb;
    u &= ~0x1fffu;
    std::memcpy(&f, &u, 4);
    return f;
}

double gelu_tanh(double z) {
    const double c = 0.7978845608028654; // sqrt(2 / pi)
    return 0.5 * z * (1.0 + std::tanh(c * (z + 0.044715 * z * z * z)));
}

double gelu_tanh_grad(double z) {
    const double c = 0.7978845608028654;
    const double u = c * (z + 0.044715 * z * z * z);
    const double t = std::tanh(u);
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * z * z);
}

} // namespace

extern "C" double emu_device_fp8_decode(unsigned char code, int exponent_bits,
                                        int mantissa_bits) {
    const int bias = (1 << (exponent_bits - 1)) - 1;
    const int sign = code >> 7;
    const int e = (code >> mantissa_bits) & ((1 << exponent_bits) - 1);
    const int m = code & ((1 << mantissa_bits) - 1);
    const int e_max = (1 << exponent_bits) - 1;
    double v;
    if (exponent_bits == 4 && e == e_max && m == (1 << mantissa_bits) - 1) {
        v = NAN; // E4M3 has no infinities: S.1111.111 is its only NaN
    } else if (exponent_bits == 5 && e == e_max) {
        v = m ? NAN : INFINITY;
    } else if (e == 0) {
        v = std::ldexp((double)m, 1 - bias - mantissa_bits);
    } else {
        v = std::ldexp(1.0 + (double)m / (1 << mantissa_bits), e - bias);
    }
    return sign ? -v : v;
}

extern "C" int emu_device_gemm(const EmuGemm* g, char* err, size_t err_len) {
    const bool fp8 = g->a_type == EMU_R_8F_E4M3 || g->a_type == EMU_R_8F_E5M2;
    const float a_scale = fp8 && g->a_scale ? *g->a_scale : 1.0f;
    const float b_scale = fp8 && g->b_scale ? *g->b_scale : 1.0f;
    const bool round_tf32 = g->compute_tf32 && g->a_type == EMU_R_32F;
    auto a_at = [&](size_t i, size_t l) {
        const size_t at = g->transa ? l + i * g->lda : i + l * g->lda;
        const double v = load(g->a, g->a_type, at, a_scale);
        return round_tf32 ? tf32(v) : v;
    };
    auto b_at = [&](size_t l, size_t j) {
        const size_t at = g->transb ? j + l * g->ldb : l + j * g->ldb;
        const double v = load(g->b, g->b_type, at, b_scale);
        return round_tf32 ? tf32(v) : v;
    };
    std::vector<double> column(g->k);
    for (size_t j = 0; j < g->n; ++j) {
        for (size_t l = 0; l < g->k; ++l) column[l] = b_at(l, j);
        for (size_t i = 0; i < g->m; ++i) {
            double sum = 0.0;
            for (size_t l = 0; l < g->k; ++l) sum += a_at(i, l) * column[l];
            const size_t at = i + j * g->ldd;
            double d = g->alpha * sum;
            if (g->beta != 0.0f) d += g->beta * load(g->d, g->d_type, at, 1.0f);
            switch (g->epilogue) {
            case EMU_EPILOGUE_DEFAULT:
            case EMU_EPILOGUE_BGRADB: break;
            case EMU_EPILOGUE_BIAS: d += load(g->bias, g->d_type, i, 1.0f); break;
            case EMU_EPILOGUE_GELU_AUX:
            case EMU_EPILOGUE_GELU_AUX_BIAS: {
                if (g->epilogue == EMU_EPILOGUE_GELU_AUX_BIAS)
                    d += load(g->bias, g->d_type, i, 1.0f);
                store(g->aux, g->d_type, i + j * g->aux_ld, d);
                d = gelu_tanh(d);
                break;
            }
            case EMU_EPILOGUE_DGELU:
                d *= gelu_tanh_grad(load(g->aux, g->d_type, i + j * g->aux_ld, 1.0f));
                break;
            default:
                write_error(err, err_len, "an epilogue the emulated cuBLASLt does not run");
                return 1;
            }
            store(g->d, g->d_type, at, d);
        }
        if (g->epilogue == EMU_EPILOGUE_BGRADB) {
            double s = 0.0;
            for (size_t l = 0; l < g->k; ++l) s += column[l];
            store(g->bias, g->d_type, j, s);
        }
    }
    return 0;
}

// ---------------------------------------------------------------------------------------
// Device memory: the emulator's guarded buffers (a write past the end is reported by the
// launch that makes it, an access further out faults and the crash handler names the buffer).

extern "C" void* emu_device_alloc(size_t bytes) {
    try {
        return emu::alloc<unsigned char>(bytes);
    } catch (const std::exception&) {
        return nullptr;
    }
}

extern "C" int emu_device_free(void* p) {
    try {
        emu::free(p);
        return 0;
    } catch (const std::exception&) {
        return 1;
    }
}
