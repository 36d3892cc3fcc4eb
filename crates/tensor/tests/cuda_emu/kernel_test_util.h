// Helpers shared by the kernel tests (*_test.cpp): random inputs, poisoned outputs, host
// views of 16-bit values, relative L2 errors and a pass/fail tally. Include after cuda_emu.h
// and common.cuh (it uses to_f32 / from_f32 from there). Tolerances (relative L2 against a
// double-precision reference): 1e-5 for fp32 outputs, 1e-2 for bf16/f16 ones.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdarg>
#include <cstring>
#include <string>
#include <vector>

namespace kt {

/// splitmix64: a fixed seed gives the same inputs on every machine.
struct Rng {
    uint64_t s;
    explicit Rng(uint64_t seed) : s(seed) {}
    uint64_t next() {
        uint64_t z = (s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    /// Uniform in [0, 1).
    double uniform() { return (double)(next() >> 11) * (1.0 / 9007199254740992.0); }
    /// Uniform in [lo, hi).
    float range(float lo, float hi) { return (float)(lo + (hi - lo) * uniform()); }
    int below(int n) { return (int)(next() % (uint64_t)n); }
};

template <class T> const char* type_name();
template <> inline const char* type_name<float>() { return "f32"; }
template <> inline const char* type_name<bf16>() { return "bf16"; }
template <> inline const char* type_name<f16>() { return "f16"; }

/// The relative L2 tolerance of a kernel output stored as T.
template <class T> double tol() { return sizeof(T) == 4 ? 1e-5 : 1e-2; }

/// A NaN of T, to poison outputs before a launch (an unwritten element then fails).
template <class T> T nan_of() { return from_f32<T>(NAN); }

/// Device-visible buffer of n T's from the emulator, with host access.
template <class T> T* buffer(size_t n) { return emu::alloc<T>(n == 0 ? 1 : n); }

template <class T> void fill_poison(T* p, size_t n) {
    for (size_t i = 0; i < n; ++i) p[i] = nan_of<T>();
}

/// Fills p with uniform values in [lo, hi), rounded to T; returns them as doubles (the
/// values the kernel sees).
template <class T> std::vector<double> fill_random(T* p, size_t n, Rng& rng, float lo, float hi) {
    std::vector<double> out(n);
    for (size_t i = 0; i < n; ++i) {
        p[i] = from_f32<T>(rng.range(lo, hi));
        out[i] = (double)to_f32(p[i]);
    }
    return out;
}

template <class T> std::vector<double> read(const T* p, size_t n) {
    std::vector<double> out(n);
    for (size_t i = 0; i < n; ++i) out[i] = (double)to_f32(p[i]);
    return out;
}

/// ‖got − want‖ / ‖want‖ (or the absolute norm if want is 0); infinite if got holds a NaN
/// or an infinity where want does not, or the sizes differ.
inline double rel_l2(const std::vector<double>& got, const std::vector<double>& want) {
    if (got.size() != want.size()) return INFINITY;
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isnan(got[i]) || (std::isinf(got[i]) && got[i] != want[i])) return INFINITY;
        if (std::isinf(want[i])) continue;  // equal infinities
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += want[i] * want[i];
    }
    return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

/// ‖got − want‖ / ‖scale‖: the error relative to the size of the terms a formula adds
/// (where it cancels, as 1 − y² near |y| = 1, fp32's error is relative to those, not to the
/// small result). NaN or an unexpected infinity in got is infinite.
inline double scaled_l2(const std::vector<double>& got, const std::vector<double>& want,
                        const std::vector<double>& scale) {
    if (got.size() != want.size() || got.size() != scale.size()) return INFINITY;
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isnan(got[i]) || (std::isinf(got[i]) && got[i] != want[i])) return INFINITY;
        if (std::isinf(want[i])) continue;
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += scale[i] * scale[i];
    }
    return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

/// Counts checks; failures go through the emulator's report_failure (so emu::finish sees
/// them), named by what was checked.
struct Tally {
    int checks = 0, failures = 0;
    /// Passes when err ≤ limit (NaN never passes).
    void check(const std::string& what, double err, double limit) {
        ++checks;
        if (!(err <= limit)) {
            ++failures;
            char buf[64];
            std::snprintf(buf, sizeof buf, ": error %.3e > %.1e", err, limit);
            ::emu::report_failure("check", checks, what + buf);
        }
    }
    void check_true(const std::string& what, bool ok) {
        ++checks;
        if (!ok) {
            ++failures;
            ::emu::report_failure("check", checks, what);
        }
    }
    /// Prints the count and returns emu::finish's exit status.
    int finish(const char* name) {
        std::printf("%s: %d checks, %d failures\n", name, checks, failures);
        return ::emu::finish(name);
    }
};

inline std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
inline std::string fmt(const char* f, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, f);
    std::vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

/// Bit equality of two buffers of T (NaN never equal).
template <class T> bool same_bits(const T* a, const T* b, size_t n) {
    for (size_t i = 0; i < n; ++i)
        if (!(to_f32(a[i]) == to_f32(b[i]))) return false;
    return true;
}

/// Whether `low` holds `v` rounded to T, value for value (a kernel's rounded copy of its f32
/// output; NaN never matches).
template <class T> bool rounded_copy(const T* low, const float* v, size_t n) {
    for (size_t i = 0; i < n; ++i)
        if (!(to_f32(low[i]) == to_f32(from_f32<T>(v[i])))) return false;
    return true;
}

/// A norm forward with the residual add fused (`*_fwd_add_*`: sum = x + h, then the norm of
/// sum) against the plain forward of the sum the host computes with the same one f32 addition:
/// the sum, the output and the `nstats` statistics arrays (rows floats each) bit for bit.
/// `plain(grid, x, y, stats)` and `fused(grid, x, h, sum, y, stats)` launch the two kernels on
/// `rows` × `d`. h is given aligned (the vector path where d allows) and one element off (the
/// scalar path; the plain kernel's input is then one float off too, for its scalar path: the
/// two paths sum a row in different orders), and `fused` runs on one block too (grid-stride
/// rows).
template <class T, class Plain, class Fused>
void check_norm_add(Tally& tally, const char* name, Rng& rng, int rows, int d, int nstats,
                    Plain plain, Fused fused) {
    const size_t n = (size_t)rows * d;
    for (int off = 0; off < 2; ++off) {
        float* x = buffer<float>(n);
        T* h = buffer<T>(n + off) + off;
        fill_random(x, n, rng, -2.0f, 4.0f);
        fill_random(h, n, rng, -1.0f, 1.0f);
        // The plain kernel takes the path the fused one does: one float off with h.
        float* want_sum = buffer<float>(n + off) + off;
        for (size_t i = 0; i < n; ++i) want_sum[i] = x[i] + to_f32(h[i]);
        T* want_y = buffer<T>(n);
        float* want_stats = buffer<float>((size_t)rows * nstats);
        fill_poison(want_y, n);
        plain((int)((rows + 7) / 8), (const float*)want_sum, want_y, want_stats);
        for (int one_block = 0; one_block < 2; ++one_block) {
            float* sum = buffer<float>(n);
            T* y = buffer<T>(n);
            float* stats = buffer<float>((size_t)rows * nstats);
            fill_poison(sum, n);
            fill_poison(y, n);
            fill_poison(stats, (size_t)rows * nstats);
            fused(one_block ? 1 : (rows + 7) / 8, (const float*)x, (const T*)h, sum, y, stats);
            const std::string tag = fmt("%s_fwd_add_%s rows=%d d=%d h_off=%d blocks=%s", name,
                                        type_name<T>(), rows, d, off, one_block ? "1" : "rows/8");
            tally.check_true(tag + ": the sum is x + h", same_bits(sum, want_sum, n));
            tally.check_true(tag + ": the output is the plain norm's", same_bits(y, want_y, n));
            tally.check_true(tag + ": the statistics are the plain norm's",
                             same_bits(stats, want_stats, (size_t)rows * nstats));
        }
    }
}

/// The Rust side's grid-stride launch: ceil(n/256) blocks, at least 1, at most max_blocks.
inline unsigned grid_for(long long n, long long max_blocks = 132 * 32) {
    long long b = (n + 255) / 256;
    if (b < 1) b = 1;
    if (b > max_blocks) b = max_blocks;
    return (unsigned)b;
}

}  // namespace kt
