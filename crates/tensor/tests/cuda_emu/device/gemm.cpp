// The products of the emulated CUDA device: D = alpha * op(A) op(B) + beta * D in cuBLAS's
// column-major terms, then the epilogue, as cublasLtMatmul defines them (the subset meshtrain's
// blas.rs asks for). Sums in f64 (so a product is the exact one rounded once to its output
// type), vectorised and split over the CPU's cores: a training step's products would take
// minutes as plain loops. Its own translation unit: built with -O3 for this CPU, no emulator.
#include "emu_device.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

namespace {

float bf16_to_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

float f16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31;
    const int e = (h >> 10) & 0x1f;
    const uint32_t m = h & 0x3ff;
    float f;
    if (e == 0) {
        f = std::ldexp((float)m, -24);
        return sign ? -f : f;
    }
    if (e == 31) {
        const uint32_t u = sign | 0x7f800000u | (m << 13);
        std::memcpy(&f, &u, 4);
        return f;
    }
    const uint32_t u = sign | (uint32_t)(e - 15 + 127) << 23 | (m << 13);
    std::memcpy(&f, &u, 4);
    return f;
}

double load(const void* p, int type, size_t i, float scale) {
    switch (type) {
    case EMU_R_32F: return static_cast<const float*>(p)[i];
    case EMU_R_16BF: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case EMU_R_16F: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
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
    case EMU_R_16BF: static_cast<uint16_t*>(p)[i] = emu_device_to_bf16(v); break;
    case EMU_R_16F: static_cast<uint16_t*>(p)[i] = emu_device_to_f16(v); break;
    }
}

/// TF32: f32 with its mantissa rounded to 10 bits (nearest, ties to even), as the tensor
/// cores read f32 operands under CUBLAS_COMPUTE_32F_FAST_TF32.
double tf32(double v) {
    float f = (float)v;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return f;
    u += 0xfffu + ((u >> 13) & 1u);
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

/// Runs f(begin, end) over [0, n) in up to as many pieces as the CPU has cores.
template <class F> void split(size_t n, F f) {
    const size_t cores = std::max(1u, std::min(8u, std::thread::hardware_concurrency()));
    const size_t pieces = std::min(cores, std::max<size_t>(1, n / 16));
    if (pieces <= 1) {
        f(size_t(0), n);
        return;
    }
    std::vector<std::thread> threads;
    const size_t step = (n + pieces - 1) / pieces;
    for (size_t b = step; b < n; b += step) threads.emplace_back(f, b, std::min(n, b + step));
    f(size_t(0), std::min(n, step));
    for (auto& t : threads) t.join();
}

} // namespace

extern "C" double emu_device_fp8_decode(unsigned char code, int exponent_bits,
                                        int mantissa_bits) {
    const int bias = (1 << (exponent_bits - 1)) - 1;
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
    return (code >> 7) ? -v : v;
}

namespace {
bool operand_type(int t) {
    return t == EMU_R_32F || t == EMU_R_16F || t == EMU_R_16BF || t == EMU_R_8F_E4M3 ||
           t == EMU_R_8F_E5M2;
}
bool output_type(int t) { return t == EMU_R_32F || t == EMU_R_16F || t == EMU_R_16BF; }
} // namespace

extern "C" int emu_device_gemm_runs(int a_type, int b_type, int d_type, int epilogue) {
    switch (epilogue) {
    case EMU_EPILOGUE_DEFAULT:
    case EMU_EPILOGUE_BGRADB:
    case EMU_EPILOGUE_BIAS:
    case EMU_EPILOGUE_GELU_AUX:
    case EMU_EPILOGUE_GELU_AUX_BIAS:
    case EMU_EPILOGUE_DGELU: break;
    default: return 0;
    }
    return operand_type(a_type) && operand_type(b_type) && output_type(d_type);
}

extern "C" int emu_device_gemm(const EmuGemm* g, char* err, size_t err_len) {
    const size_t m = g->m, n = g->n, k = g->k;
    const bool fp8 = g->a_type == EMU_R_8F_E4M3 || g->a_type == EMU_R_8F_E5M2;
    const float a_scale = fp8 && g->a_scale ? *g->a_scale : 1.0f;
    const float b_scale = fp8 && g->b_scale ? *g->b_scale : 1.0f;
    const bool round_tf32 = g->compute_tf32 && g->a_type == EMU_R_32F;
    if (!emu_device_gemm_runs(g->a_type, g->b_type, g->d_type, g->epilogue)) {
        std::snprintf(err, err_len, "types %d, %d -> %d with epilogue %d are not emulated",
                      g->a_type, g->b_type, g->d_type, g->epilogue);
        return 1;
    }
    // op(A) as k rows of m (column l of op(A) contiguous) and op(B) as n columns of k, in
    // f64: D's column j is then a sum over l of op(B)[l, j] times a contiguous column of
    // op(A), which the compiler vectorises.
    std::vector<double> a_cols(k * m), b_cols(n * k);
    for (size_t l = 0; l < k; ++l)
        for (size_t i = 0; i < m; ++i) {
            const double v = load(g->a, g->a_type, g->transa ? l + i * g->lda : i + l * g->lda,
                                  a_scale);
            a_cols[l * m + i] = round_tf32 ? tf32(v) : v;
        }
    split(n, [&](size_t j0, size_t j1) {
        for (size_t j = j0; j < j1; ++j)
            for (size_t l = 0; l < k; ++l) {
                const double v = load(g->b, g->b_type,
                                      g->transb ? j + l * g->ldb : l + j * g->ldb, b_scale);
                b_cols[j * k + l] = round_tf32 ? tf32(v) : v;
            }
    });
    split(n, [&](size_t j0, size_t j1) {
        std::vector<double> column(m);
        for (size_t j = j0; j < j1; ++j) {
            std::fill(column.begin(), column.end(), 0.0);
            const double* b = &b_cols[j * k];
            for (size_t l = 0; l < k; ++l) {
                const double s = b[l];
                const double* a = &a_cols[l * m];
                double* c = column.data();
                for (size_t i = 0; i < m; ++i) c[i] += a[i] * s;
            }
            for (size_t i = 0; i < m; ++i) {
                const size_t at = i + j * g->ldd;
                double d = g->alpha * column[i];
                if (g->beta != 0.0f) d += g->beta * load(g->d, g->d_type, at, 1.0f);
                switch (g->epilogue) {
                case EMU_EPILOGUE_BIAS: d += load(g->bias, g->d_type, i, 1.0f); break;
                case EMU_EPILOGUE_GELU_AUX:
                case EMU_EPILOGUE_GELU_AUX_BIAS:
                    if (g->epilogue == EMU_EPILOGUE_GELU_AUX_BIAS)
                        d += load(g->bias, g->d_type, i, 1.0f);
                    store(g->aux, g->d_type, i + j * g->aux_ld, d);
                    d = gelu_tanh(d);
                    break;
                case EMU_EPILOGUE_DGELU:
                    d *= gelu_tanh_grad(load(g->aux, g->d_type, i + j * g->aux_ld, 1.0f));
                    break;
                default: break;
                }
                store(g->d, g->d_type, at, d);
            }
            if (g->epilogue == EMU_EPILOGUE_BGRADB) {
                double s = 0.0;
                for (size_t l = 0; l < k; ++l) s += b[l];
                store(g->bias, g->d_type, j, s);
            }
        }
    });
    return 0;
}
