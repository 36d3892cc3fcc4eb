// Tests of fp8.cu on the CPU emulator: every code against the nearest value of the format by
// exhaustive search (ties to the even code, saturating), written apart from the kernel's bit
// arithmetic; the amax against the inputs' largest magnitude; f32 and bf16 inputs, one block
// and many.
#include "cuda_emu.h"
#include "common.cuh"
#include "fp8.cu"
#include "kernel_test_util.h"

#include <algorithm>

using namespace kt;

static Tally tally;

/// The value of `code` in the format, from the format's definition.
static double decode(unsigned code, bool e4m3) {
    const int m_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    const double sign = (code & 0x80) ? -1.0 : 1.0;
    const unsigned mag = code & 0x7F;
    const int exponent = (int)(mag >> m_bits);
    const double mantissa = (double)(mag & ((1u << m_bits) - 1));
    if (e4m3 && mag == 0x7F) return NAN;
    if (!e4m3 && exponent == 31) return mantissa == 0 ? sign * INFINITY : NAN;
    if (exponent == 0) return sign * mantissa * std::ldexp(1.0, 1 - bias - m_bits);
    return sign * (1.0 + mantissa / (1 << m_bits)) * std::ldexp(1.0, exponent - bias);
}

/// The nearest finite code to x (clamped to the largest value), ties to the even code.
static unsigned nearest(float x, bool e4m3) {
    if (std::isnan(x)) return (std::signbit(x) ? 0x80u : 0u) | 0x7Fu;
    const double max = decode(e4m3 ? 0x7E : 0x7B, e4m3);
    const double v = std::min(std::max((double)x, -max), max);
    unsigned best = 0;
    double best_d = INFINITY;
    for (unsigned c = 0; c < 256; ++c) {
        const double d_value = decode(c, e4m3);
        if (!std::isfinite(d_value)) continue;
        if (d_value == 0.0 && ((c & 0x80) != 0) != std::signbit(v)) continue;
        const double d = std::fabs(d_value - v);
        if (d < best_d || (d == best_d && (c & 1) == 0 && (best & 1) == 1)) {
            best = c;
            best_d = d;
        }
    }
    return best;
}

template <class T>
static void launch_amax(const T* x, long long n, int* amax, bool small_grid) {
    if (std::is_same<T, float>::value)
        emu::launch(fp8_amax_f32, dim3(small_grid ? 1 : grid_for(n)), dim3(256), 0, (const float*)x, n, amax);
    else
        emu::launch(fp8_amax_bf16, dim3(small_grid ? 1 : grid_for(n)), dim3(256), 0, (const bf16*)x, n, amax);
}

template <class T>
static void launch_cast(const T* x, unsigned char* y, long long n, bool e4m3, const int* amax, float* inv_scale,
                        bool small_grid) {
    if (std::is_same<T, float>::value)
        emu::launch(fp8_cast_f32, dim3(small_grid ? 1 : grid_for(n)), dim3(256), 0, (const float*)x, y, n, (int)e4m3,
                    amax, inv_scale);
    else
        emu::launch(fp8_cast_bf16, dim3(small_grid ? 1 : grid_for(n)), dim3(256), 0, (const bf16*)x, y, n, (int)e4m3,
                    amax, inv_scale);
}

/// The cast at the scale an amax of `amax_value` gives (written where the amax pass would
/// have put it), against the nearest codes; the amax pass over the same inputs.
template <class T>
static void test(bool e4m3, float amax_value, bool small_grid, uint64_t seed) {
    Rng rng(seed);
    const float max = (float)decode(e4m3 ? 0x7E : 0x7B, e4m3);
    float scale = 1.0f;
    if (std::isfinite(amax_value) && amax_value > 0.0f && std::isfinite(max / amax_value)) scale = max / amax_value;
    // The ties between neighbouring values (divided by the scale, so the scaled input lands
    // on them), the points either side, random magnitudes over the range and beyond, and
    // the special values.
    std::vector<float> inputs;
    std::vector<double> values;
    for (unsigned c = 0; c < 256; ++c) {
        const double v = decode(c, e4m3);
        if (std::isfinite(v)) values.push_back(v);
    }
    std::sort(values.begin(), values.end());
    for (size_t i = 0; i + 1 < values.size(); ++i) {
        const float mid = (float)((values[i] + values[i + 1]) / 2.0);
        for (float m : {mid, std::nextafter(mid, INFINITY), std::nextafter(mid, -INFINITY)})
            inputs.push_back(m / scale);
    }
    for (int i = 0; i < 3000; ++i) {
        const double e = rng.uniform() * 44.0 - 24.0;
        inputs.push_back((float)((rng.below(2) ? -1.0 : 1.0) * std::ldexp(1.0 + rng.uniform(), (int)std::floor(e))));
    }
    for (float s : {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-45f, 3.0e38f, -1e6f}) inputs.push_back(s);
    const long long n = (long long)inputs.size();
    T* x = buffer<T>(n);
    for (long long i = 0; i < n; ++i) x[i] = from_f32<T>(inputs[i]);
    unsigned char* y = buffer<unsigned char>(n);
    std::fill(y, y + n, (unsigned char)0xA5);
    int* amax = buffer<int>(1);
    *amax = (int)__float_as_uint(amax_value);
    float* inv_scale = buffer<float>(1);
    *inv_scale = NAN;
    launch_cast(x, y, n, e4m3, amax, inv_scale, small_grid);
    int wrong = 0;
    for (long long i = 0; i < n; ++i) {
        const float v = to_f32(x[i]);  // the input as the kernel reads it (bf16-rounded)
        const unsigned want = nearest(v * scale, e4m3);
        if (y[i] != want) {
            if (++wrong <= 3)
                std::printf("  %s %s: x=%g scale=%g: code %#04x, want %#04x\n", e4m3 ? "e4m3" : "e5m2",
                            type_name<T>(), v, scale, y[i], want);
        }
    }
    const std::string tag = fmt("fp8 %s from %s amax=%g grid=%s", e4m3 ? "e4m3" : "e5m2", type_name<T>(), amax_value,
                                small_grid ? "1" : "full");
    tally.check_true(tag + fmt(": %d of %lld codes differ from the nearest value", wrong, n), wrong == 0);
    tally.check_true(tag + fmt(": inverse scale %g, want %g", *inv_scale, 1.0f / scale), *inv_scale == 1.0f / scale);
    // The amax pass: the inputs hold a NaN, which wins.
    *amax = 0;
    launch_amax(x, n, amax, small_grid);
    tally.check_true(tag + ": amax with a NaN among the inputs is NaN", std::isnan(__uint_as_float((unsigned)*amax)));
}

/// Without NaN inputs, the amax is the largest magnitude exactly.
static void test_amax_finite(uint64_t seed) {
    Rng rng(seed);
    const long long n = 5000;
    float* x = buffer<float>(n);
    const auto xv = fill_random(x, n, rng, -3.0f, 2.0f);
    int* amax = buffer<int>(1);
    *amax = 0;
    emu::launch(fp8_amax_f32, dim3(3), dim3(256), 0, (const float*)x, n, amax);
    double want = 0.0;
    for (double v : xv) want = std::max(want, std::fabs(v));
    tally.check("fp8 amax of finite inputs", std::fabs(__uint_as_float((unsigned)*amax) - want), 0.0);
}

/// The transposed cast against the plain cast's codes, moved: odd shapes (tiles cut at both
/// edges), one tile, and a single row and column.
template <class T>
static void test_transpose(int rows, int cols, bool e4m3, uint64_t seed) {
    Rng rng(seed);
    const long long n = (long long)rows * cols;
    T* x = buffer<T>(n);
    for (long long i = 0; i < n; ++i) x[i] = from_f32<T>(rng.range(-3.0f, 3.0f) * (float)std::ldexp(1.0, rng.below(20) - 10));
    int* amax = buffer<int>(1);
    *amax = 0;
    launch_amax(x, n, amax, false);
    unsigned char* y = buffer<unsigned char>(n);
    unsigned char* yt = buffer<unsigned char>(n);
    std::fill(yt, yt + n, (unsigned char)0xA5);
    float* inv = buffer<float>(2);
    launch_cast(x, y, n, e4m3, amax, inv, false);
    const dim3 grid((cols + 31) / 32, (rows + 31) / 32);
    if (std::is_same<T, float>::value)
        emu::launch(fp8_cast_transpose_f32, grid, dim3(32, 8), 0, (const float*)x, yt, rows, cols, (int)e4m3,
                    (const int*)amax, inv + 1);
    else
        emu::launch(fp8_cast_transpose_bf16, grid, dim3(32, 8), 0, (const bf16*)x, yt, rows, cols, (int)e4m3,
                    (const int*)amax, inv + 1);
    int wrong = 0;
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) wrong += yt[(long long)c * rows + r] != y[(long long)r * cols + c];
    const std::string tag = fmt("fp8 cast-transpose %s %dx%d %s", e4m3 ? "e4m3" : "e5m2", rows, cols, type_name<T>());
    tally.check_true(tag + fmt(": %d of %lld codes differ from the cast's", wrong, n), wrong == 0);
    tally.check_true(tag + ": the inverse scale equals the cast's", inv[0] == inv[1]);
    // Both layouts from one read: the same codes as the two kernels.
    unsigned char* y2 = buffer<unsigned char>(n);
    unsigned char* yt2 = buffer<unsigned char>(n);
    std::fill(y2, y2 + n, (unsigned char)0x5A);
    std::fill(yt2, yt2 + n, (unsigned char)0xA5);
    inv[1] = 0.0f;
    if (std::is_same<T, float>::value)
        emu::launch(fp8_cast_both_f32, grid, dim3(32, 8), 0, (const float*)x, y2, yt2, rows, cols, (int)e4m3,
                    (const int*)amax, inv + 1);
    else
        emu::launch(fp8_cast_both_bf16, grid, dim3(32, 8), 0, (const bf16*)x, y2, yt2, rows, cols, (int)e4m3,
                    (const int*)amax, inv + 1);
    tally.check_true(tag + ": cast_both's plain codes are the cast's", std::memcmp(y2, y, n) == 0);
    tally.check_true(tag + ": cast_both's transposed codes are the cast-transpose's", std::memcmp(yt2, yt, n) == 0);
    tally.check_true(tag + ": cast_both's inverse scale equals the cast's", inv[0] == inv[1]);
}

int main() {
    for (bool e4m3 : {true, false})
        for (auto [rows, cols] : {std::pair{70, 45}, std::pair{32, 32}, std::pair{1, 33}, std::pair{100, 1}}) {
            test_transpose<float>(rows, cols, e4m3, 20 + rows);
            test_transpose<bf16>(rows, cols, e4m3, 30 + cols);
        }
    // Amaxes giving scales of 1, above 1, below 1, and the odd ones (scale 1).
    for (bool e4m3 : {true, false})
        for (float amax : {e4m3 ? 448.0f : 57344.0f, 0.37f, 9000.0f, 0.0f, NAN, INFINITY})
            for (bool small_grid : {true, false}) {
                test<float>(e4m3, amax, small_grid, 7 + (int)e4m3);
                test<bf16>(e4m3, amax, small_grid, 9 + (int)e4m3);
            }
    test_amax_finite(3);
    return tally.finish("fp8");
}
