// Tests of elementwise.cu on the CPU emulator against double-precision references.
#include "cuda_emu.h"
#include "common.cuh"
#include "elementwise.cu"
#include "kernel_test_util.h"

using namespace kt;

static Tally tally;

// Sizes: tiny, around the 8-element chunk, a tail, several blocks.
static const long long SIZES[] = {1, 3, 7, 8, 9, 31, 64, 1000, 2053};
// Element offsets of views into a 256-byte aligned buffer: 0 takes the vector path, 1 and 3
// the scalar ones (or, for the f32-only kernels, a scalar head).
static const int OFFSETS[] = {0, 1, 3};

template <class S, class D>
static void test_convert(void (*kernel)(const S*, D*, long long), const char* name) {
    Rng rng(11);
    for (long long n : SIZES) {
        for (int off : OFFSETS) {
            S* x = buffer<S>(n + off) + off;
            D* y = buffer<D>(n + off) + off;
            const auto xv = fill_random(x, n, rng, -70000.0f, 70000.0f);
            fill_poison(y, n);
            emu::launch(kernel, dim3(grid_for(n)), dim3(256), 0, (const S*)x, y, n);
            // f16 overflows past 65504: the reference saturates to ±inf like the rounding does.
            std::vector<double> want(n);
            for (long long i = 0; i < n; ++i) want[i] = (double)to_f32(from_f32<D>((float)xv[i]));
            tally.check(fmt("%s n=%lld off=%d exact", name, n, off), rel_l2(read(y, n), want), 0.0);
            std::vector<double> ref(xv);
            if (sizeof(D) == 2 && std::string(type_name<D>()) == "f16")
                for (auto& r : ref) r = std::fabs(r) > 65504.0 ? std::copysign(INFINITY, r) : r;
            tally.check(fmt("%s n=%lld off=%d", name, n, off), rel_l2(read(y, n), ref), tol<D>());
        }
    }
}

template <class T>
static void test_add(void (*kernel)(const float*, const T*, float*, long long)) {
    Rng rng(12);
    for (long long n : SIZES) {
        for (int off : OFFSETS) {
            for (int in_place = 0; in_place < 2; ++in_place) {
                float* a = buffer<float>(n + off) + off;
                T* b = buffer<T>(n + off) + off;
                float* y = in_place ? a : buffer<float>(n + off) + off;
                const auto av = fill_random(a, n, rng, -2.0f, 2.0f);
                const auto bv = fill_random(b, n, rng, -2.0f, 2.0f);
                if (!in_place) fill_poison(y, n);
                emu::launch(kernel, dim3(grid_for(n)), dim3(256), 0, (const float*)a, (const T*)b, y, n);
                std::vector<double> want(n);
                for (long long i = 0; i < n; ++i) want[i] = av[i] + bv[i];
                tally.check(fmt("add_f32_%s n=%lld off=%d in_place=%d", type_name<T>(), n, off, in_place),
                            rel_l2(read(y, n), want), 1e-6);
            }
        }
    }
}

static double act_ref(int kind, double x) {
    switch (kind) {
        case 0: return x > 0 ? x : 0;
        case 1: return 1.0 / (1.0 + std::exp(-x));
        case 2: return std::tanh(x);
        default: return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    }
}

static double act_grad_ref(int kind, double s, double dy) {
    switch (kind) {
        case 0: return s > 0 ? dy : 0;
        case 1: return dy * s * (1 - s);
        case 2: return dy * (1 - s * s);
        default:
            return dy * (0.5 * (1.0 + std::erf(s / std::sqrt(2.0))) +
                         s * std::exp(-s * s / 2) / std::sqrt(2.0 * M_PI));
    }
}

template <class T>
static void test_act(void (*fwd)(const T*, T*, long long, int),
                     void (*bwd)(const T*, const T*, T*, long long, int)) {
    Rng rng(13);
    for (int kind = 0; kind < 4; ++kind) {
        for (long long n : SIZES) {
            for (int off : OFFSETS) {
                const unsigned grid = off == 3 ? 1 : grid_for(n);  // one block: grid-stride
                T* x = buffer<T>(n + off) + off;
                T* y = buffer<T>(n + off) + off;
                const auto xv = fill_random(x, n, rng, -5.0f, 5.0f);
                fill_poison(y, n);
                emu::launch(fwd, dim3(grid), dim3(256), 0, (const T*)x, y, n, kind);
                // GELU's 0.5x·(1 + erf) cancels for x ≪ 0: scale its error by |0.5x|.
                std::vector<double> want(n), scale(n);
                for (long long i = 0; i < n; ++i) {
                    want[i] = act_ref(kind, xv[i]);
                    scale[i] = kind == 3 ? std::max(std::fabs(want[i]), std::fabs(0.5 * xv[i]))
                                         : std::fabs(want[i]);
                }
                tally.check(fmt("act_fwd_%s kind=%d n=%lld off=%d", type_name<T>(), kind, n, off),
                            scaled_l2(read(y, n), want, scale), tol<T>());

                // Backward: saved = output for sigmoid/tanh, else the input; in place when
                // off == 1 (dx aliases dy).
                const T* saved = (kind == 1 || kind == 2) ? y : x;
                const auto sv = read(saved, n);
                T* dy = buffer<T>(n + off) + off;
                const auto dyv = fill_random(dy, n, rng, -1.0f, 1.0f);
                T* dx = off == 1 ? dy : buffer<T>(n + off) + off;
                if (off != 1) fill_poison(dx, n);
                emu::launch(bwd, dim3(grid), dim3(256), 0, saved, (const T*)dy, dx, n, kind);
                // 1 − s², 1 − s and 0.5·(1 + erf) cancel: scale the error by |dy|·|s|-ish terms.
                for (long long i = 0; i < n; ++i) {
                    want[i] = act_grad_ref(kind, sv[i], dyv[i]);
                    const double terms = kind == 1 ? std::fabs(dyv[i] * sv[i]) : std::fabs(dyv[i]);
                    scale[i] = kind == 0 ? std::fabs(want[i]) : std::max(std::fabs(want[i]), terms);
                }
                tally.check(fmt("act_bwd_%s kind=%d n=%lld off=%d", type_name<T>(), kind, n, off),
                            scaled_l2(read(dx, n), want, scale), tol<T>());
            }
        }
    }
}

static void test_flat_f32() {
    Rng rng(14);
    for (long long n : SIZES) {
        for (int off = 0; off < 4; ++off) {
            const unsigned grid = off == 2 ? 1 : grid_for(n);
            // scale
            float* x = buffer<float>(n + 4) + off;
            auto xv = fill_random(x, n, rng, -3.0f, 3.0f);
            x[n] = 123.0f;  // just past the view: must stay
            emu::launch(scale_f32, dim3(grid), dim3(256), 0, x, n, 0.375f);
            for (auto& v : xv) v *= 0.375;
            tally.check(fmt("scale_f32 n=%lld off=%d", n, off), rel_l2(read(x, n), xv), 1e-7);
            tally.check_true(fmt("scale_f32 n=%lld off=%d stays in view", n, off), x[n] == 123.0f);

            // tie_sum: b equally misaligned (vector path) or not (scalar path)
            for (int boff = 0; boff < 2; ++boff) {
                float* a = buffer<float>(n + 4) + off;
                float* b = buffer<float>(n + 4) + ((off + boff) & 3);
                const auto av = fill_random(a, n, rng, -3.0f, 3.0f);
                const auto bv = fill_random(b, n, rng, -3.0f, 3.0f);
                emu::launch(tie_sum_f32, dim3(grid), dim3(256), 0, a, b, n);
                std::vector<double> want(n);
                for (long long i = 0; i < n; ++i) want[i] = (double)((float)av[i] + (float)bv[i]);
                tally.check(fmt("tie_sum_f32 a n=%lld off=%d boff=%d", n, off, boff), rel_l2(read(a, n), want), 0.0);
                tally.check(fmt("tie_sum_f32 b n=%lld off=%d boff=%d", n, off, boff), rel_l2(read(b, n), want), 0.0);
            }

            // unscale_check: finite (flag stays 0), one inf or NaN (flag 1), flag already 1
            for (int bad = 0; bad < 3; ++bad) {
                float* g = buffer<float>(n + 4) + off;
                auto gv = fill_random(g, n, rng, -3.0f, 3.0f);
                const long long where = n / 2;
                if (bad == 1) g[where] = 1e38f;  // overflows to inf after × 10
                int* flag = buffer<int>(1);
                *flag = bad == 2 ? 1 : 0;
                emu::launch(unscale_check_f32, dim3(grid), dim3(256), 0, g, n, 10.0f, flag);
                for (long long i = 0; i < n; ++i) gv[i] = (double)((float)gv[i] * 10.0f);
                if (bad == 1) gv[where] = INFINITY;
                tally.check(fmt("unscale_check_f32 n=%lld off=%d bad=%d", n, off, bad), rel_l2(read(g, n), gv), 0.0);
                tally.check_true(fmt("unscale_check_f32 flag n=%lld off=%d bad=%d", n, off, bad),
                                 *flag == (bad == 0 ? 0 : 1));
            }
        }
    }
}

/// copy_runs_f32 against a plain loop: random plans of disjoint destination runs (some of
/// zeros), copies and adds, grids smaller than the plan in both directions so runs and
/// elements both take the strided paths; elements outside the runs stay as they were.
static void test_copy_runs() {
    Rng rng(13);
    for (int trial = 0; trial < 6; ++trial) {
        const int count = 1 + (int)(rng.next() % 9);
        std::vector<long long> table;
        long long at = 0, src_len = 1;
        for (int r = 0; r < count; ++r) {
            const long long len = (long long)(rng.next() % (trial < 3 ? 40 : 1500));
            const long long gap = (long long)(rng.next() % 3);
            const bool zeros = rng.next() % 4 == 0;
            const long long src = zeros ? -1 : (long long)(rng.next() % 3000);
            table.push_back(src);
            table.push_back(at + gap);
            table.push_back(len);
            if (!zeros) src_len = std::max(src_len, src + len);
            at += gap + len;
        }
        const long long dst_len = at + 1;
        float* src = buffer<float>(src_len);
        const auto sv = fill_random(src, src_len, rng, -3.0f, 3.0f);
        long long* runs = buffer<long long>(table.size());
        std::copy(table.begin(), table.end(), runs);
        for (int add = 0; add < 2; ++add) {
            float* dst = buffer<float>(dst_len);
            auto want = fill_random(dst, dst_len, rng, -3.0f, 3.0f);
            for (int r = 0; r < count; ++r) {
                const long long s = table[3 * r], d = table[3 * r + 1], len = table[3 * r + 2];
                for (long long i = 0; i < len; ++i) {
                    const double v = s < 0 ? 0.0 : sv[s + i];
                    if (!add) want[d + i] = v;
                    else if (s >= 0) want[d + i] = (double)((float)want[d + i] + (float)v);
                }
            }
            emu::launch(copy_runs_f32, dim3(2, 3), dim3(256), 0, (const float*)src, dst,
                        (const long long*)runs, count, add);
            tally.check(fmt("copy_runs_f32 trial=%d add=%d", trial, add),
                        rel_l2(read(dst, dst_len), want), 0.0);
        }
        // The 16-bit copy: the same plan over bits (zeros runs write 0).
        unsigned short* src16 = buffer<unsigned short>(src_len);
        unsigned short* dst16 = buffer<unsigned short>(dst_len);
        for (long long i = 0; i < src_len; ++i) src16[i] = (unsigned short)(rng.next() & 0xffff);
        for (long long i = 0; i < dst_len; ++i) dst16[i] = (unsigned short)(rng.next() & 0xffff);
        std::vector<unsigned short> want16(dst16, dst16 + dst_len);
        for (int r = 0; r < count; ++r) {
            const long long s = table[3 * r], d = table[3 * r + 1], len = table[3 * r + 2];
            for (long long i = 0; i < len; ++i) want16[d + i] = s < 0 ? 0 : src16[s + i];
        }
        emu::launch(copy_runs_u16, dim3(2, 3), dim3(256), 0, (const unsigned short*)src16, dst16,
                    (const long long*)runs, count);
        tally.check_true(fmt("copy_runs_u16 trial=%d", trial),
                         std::equal(want16.begin(), want16.end(), dst16));
    }
}

int main() {
    test_convert(convert_f32_bf16, "convert_f32_bf16");
    test_convert(convert_f32_f16, "convert_f32_f16");
    test_convert(convert_bf16_f32, "convert_bf16_f32");
    test_convert(convert_f16_f32, "convert_f16_f32");
    test_add<float>(add_f32_f32);
    test_add<bf16>(add_f32_bf16);
    test_add<f16>(add_f32_f16);
    test_act<float>(act_fwd_f32, act_bwd_f32);
    test_act<bf16>(act_fwd_bf16, act_bwd_bf16);
    test_act<f16>(act_fwd_f16, act_bwd_f16);
    test_flat_f32();
    test_copy_runs();
    return tally.finish("elementwise");
}
