// Tests of conv.cu on the CPU emulator, for T = float, bf16 and f16 (16-bit inputs are values
// T holds exactly, as fill_random makes them):
// - im2col (a copy: exact) and col2im (against a double scatter reference, against the
//   adjoint identity <im2col(x), g> = <x, col2im(g)>, and bit for bit against an f32 sum in
//   (ky, kx) order) on ResNet's and LeNet's geometries and odd ones, with the Rust side's
//   grid-stride launch and with a single block;
// - channel_bias_add; channel_partials + channel_finish (both modes, short and empty last
//   parts) against double sums, the finish exactly the in-order sum of the partials;
// - batch norm: bn_moments (the CPU's arithmetic), bn_apply, bn_param_grads, bn_input_grad;
// - max pooling (ties, NaN, padding, overlapping windows; its gradient bit for bit against
//   the CPU's scatter in output order) and average pooling (bit for bit in the documented
//   order); swap_axes; global average pooling.
#include "cuda_emu.h"
#include "common.cuh"
#include "conv.cu"
#include "kernel_test_util.h"

#include <algorithm>

using namespace kt;

static Tally tally;

typedef std::vector<double> Vec;

/// Values rounded to T (and back): what a kernel that computes `v` in f32 stores.
template <class T> static double round_t(float v) { return (double)to_f32(from_f32<T>(v)); }

/// "" if got and want hold the same values (NaN matching NaN), else the first difference.
static std::string first_diff(const Vec& got, const Vec& want) {
    if (got.size() != want.size()) return fmt("sizes %zu != %zu", got.size(), want.size());
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        // NaN matches NaN; otherwise equal values with equal signs (0.0 == -0.0 otherwise).
        const bool same = (std::isnan(got[i]) && std::isnan(want[i])) ||
                          (got[i] == want[i] && std::signbit(got[i]) == std::signbit(want[i]));
        if (!same) {
            if (!bad) first = i;
            ++bad;
        }
    }
    if (!bad) return "";
    return fmt("%zu of %zu differ, first at %zu: got %.9g want %.9g", bad, got.size(), first,
               got[first], want[first]);
}

/// A double buffer's values (kt::read goes through to_f32, which would round them).
static Vec read_d(const double* p, size_t n) { return Vec(p, p + n); }

static void check_exact(const std::string& what, const Vec& got, const Vec& want) {
    const std::string d = first_diff(got, want);
    tally.check_true(what + " (exact)" + (d.empty() ? "" : ": " + d), d.empty());
}

/// max_i |got − want| / scale_i (scale_i = 0: the absolute error); NaN anywhere: infinite.
static double max_err(const Vec& got, const Vec& want, const Vec& scale) {
    if (got.size() != want.size() || got.size() != scale.size()) return INFINITY;
    double worst = 0.0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isnan(got[i]) || std::isnan(want[i])) return INFINITY;
        const double e = std::fabs(got[i] - want[i]) / (scale[i] != 0.0 ? std::fabs(scale[i]) : 1.0);
        worst = std::max(worst, e);
    }
    return worst;
}

/// max_i |got − want| / |want| (|want| = 0: the absolute error).
static double max_rel(const Vec& got, const Vec& want) { return max_err(got, want, want); }

// ---------------------------------------------------------------------------------------
// im2col / col2im.

struct Geo {
    const char* name;
    int C, N, H, W, k, s, p;
    int OH() const { return (H + 2 * p - k) / s + 1; }
    int OW() const { return (W + 2 * p - k) / s + 1; }
};

static const Geo GEOS[] = {
    {"resnet 3x3/1 p1", 3, 2, 7, 7, 3, 1, 1},
    {"3x3/2 p1 9x7", 2, 2, 9, 7, 3, 2, 1},
    {"stem 7x7/2 p3", 3, 1, 12, 11, 7, 2, 3},
    {"1x1/2 p0", 4, 2, 7, 7, 1, 2, 0},
    {"lenet 5x5 p2", 1, 2, 12, 12, 5, 1, 2},
    {"lenet 5x5 p0", 3, 2, 10, 9, 5, 1, 0},
    {"5x5/3 p1 11x13", 2, 1, 11, 13, 5, 3, 1},
    {"4x4/3 p2 9x8", 2, 2, 9, 8, 4, 3, 2},
};

template <class T> using ConvKernel = void (*)(const T*, T*, int, int, int, int, int, int, int, int, int);

template <class T> static void test_im2col_col2im(ConvKernel<T> im2col, ConvKernel<T> col2im) {
    Rng rng(11);
    for (const Geo& g : GEOS) {
        const int OH = g.OH(), OW = g.OW(), k = g.k;
        const long long np = (long long)g.N * OH * OW, rows = (long long)g.C * k * k;
        const long long ncols = rows * np, nx = (long long)g.C * g.N * g.H * g.W;
        const std::string tag = fmt("%s %s C=%d N=%d %dx%d -> %dx%d", type_name<T>(), g.name, g.C,
                                    g.N, g.H, g.W, OH, OW);
        // Where column entry (row, j) reads from, or -1 for padding.
        std::vector<long long> src(ncols);
        for (int c = 0; c < g.C; ++c)
            for (int ky = 0; ky < k; ++ky)
                for (int kx = 0; kx < k; ++kx)
                    for (int n = 0; n < g.N; ++n)
                        for (int oy = 0; oy < OH; ++oy)
                            for (int ox = 0; ox < OW; ++ox) {
                                const long long row = ((long long)c * k + ky) * k + kx;
                                const long long j = ((long long)n * OH + oy) * OW + ox;
                                const int iy = oy * g.s + ky - g.p, ix = ox * g.s + kx - g.p;
                                const bool in = iy >= 0 && iy < g.H && ix >= 0 && ix < g.W;
                                src[row * np + j] =
                                    in ? (((long long)c * g.N + n) * g.H + iy) * g.W + ix : -1;
                            }

        // im2col: a copy, zero over the padding.
        T* x = buffer<T>(nx);
        const Vec xv = fill_random(x, nx, rng, -1.0f, 1.0f);
        Vec want_cols(ncols);
        for (long long i = 0; i < ncols; ++i) want_cols[i] = src[i] < 0 ? 0.0 : xv[src[i]];
        T* cols = buffer<T>(ncols);
        for (int small = 0; small < 2; ++small) {
            fill_poison(cols, ncols);
            emu::launch(im2col, dim3(small ? 1 : grid_for(ncols)), dim3(256), 0, (const T*)x, cols,
                        g.C, g.N, g.H, g.W, k, g.s, g.p, OH, OW);
            check_exact(fmt("im2col %s grid=%s", tag.c_str(), small ? "1" : "rust"), read(cols, ncols),
                        want_cols);
        }

        // col2im: the adjoint.
        T* dcols = buffer<T>(ncols);
        const Vec gv = fill_random(dcols, ncols, rng, -1.0f, 1.0f);
        Vec want_dx(nx, 0.0);  // double scatter
        for (long long i = 0; i < ncols; ++i)
            if (src[i] >= 0) want_dx[src[i]] += gv[i];
        // f32 gather in (ky, kx) order from 0, rounded to T once: the kernel's bits.
        Vec exact_dx(nx);
        for (int c = 0; c < g.C; ++c)
            for (int n = 0; n < g.N; ++n)
                for (int iy = 0; iy < g.H; ++iy)
                    for (int ix = 0; ix < g.W; ++ix) {
                        float sum = 0.0f;
                        for (int ky = 0; ky < k; ++ky)
                            for (int kx = 0; kx < k; ++kx)
                                for (int oy = 0; oy < OH; ++oy)
                                    for (int ox = 0; ox < OW; ++ox)
                                        if (oy * g.s + ky - g.p == iy && ox * g.s + kx - g.p == ix) {
                                            const long long row = ((long long)c * k + ky) * k + kx;
                                            sum += (float)gv[row * np + ((long long)n * OH + oy) * OW + ox];
                                        }
                        exact_dx[(((long long)c * g.N + n) * g.H + iy) * g.W + ix] = round_t<T>(sum);
                    }
        T* dx = buffer<T>(nx);
        for (int small = 0; small < 2; ++small) {
            fill_poison(dx, nx);
            emu::launch(col2im, dim3(small ? 1 : grid_for(nx)), dim3(256), 0, (const T*)dcols, dx,
                        g.C, g.N, g.H, g.W, k, g.s, g.p, OH, OW);
            const Vec got = read(dx, nx);
            const std::string t = fmt("col2im %s grid=%s", tag.c_str(), small ? "1" : "rust");
            tally.check(t + " vs double scatter", rel_l2(got, want_dx), tol<T>());
            check_exact(t + " f32 (ky,kx) order", got, exact_dx);
            // <im2col(x), g> = <x, col2im(g)>, relative to the size of the terms.
            double lhs = 0.0, rhs = 0.0, scale = 0.0;
            for (long long i = 0; i < ncols; ++i) {
                lhs += want_cols[i] * gv[i];
                scale += std::fabs(want_cols[i] * gv[i]);
            }
            for (long long i = 0; i < nx; ++i) rhs += xv[i] * got[i];
            tally.check(t + " adjoint <im2col(x),g> = <x,col2im(g)>",
                        std::isnan(rhs) ? INFINITY : std::fabs(lhs - rhs) / scale, tol<T>());
        }
        emu::free(x);
        emu::free(cols);
        emu::free(dcols);
        emu::free(dx);
    }
}

// ---------------------------------------------------------------------------------------
// channel_bias_add.

template <class T> static void test_bias_add(void (*kernel)(T*, const T*, long long, long long)) {
    Rng rng(12);
    const long long shapes[][2] = {{3, 98}, {5, 1}, {4, 1000}};  // (channels, plane)
    for (const auto& sh : shapes) {
        const long long C = sh[0], plane = sh[1], total = C * plane;
        for (int small = 0; small < 2; ++small) {
            T* y = buffer<T>(total);
            T* b = buffer<T>(C);
            const Vec yv = fill_random(y, total, rng, -2.0f, 2.0f);
            const Vec bv = fill_random(b, C, rng, -1.0f, 1.0f);
            emu::launch(kernel, dim3(small ? 1 : grid_for(total)), dim3(256), 0, y, (const T*)b, plane,
                        total);
            Vec want(total);
            for (long long i = 0; i < total; ++i) want[i] = round_t<T>((float)yv[i] + (float)bv[i / plane]);
            check_exact(fmt("channel_bias_add %s C=%lld plane=%lld grid=%s", type_name<T>(), C, plane,
                            small ? "1" : "rust"),
                        read(y, total), want);
            emu::free(y);
            emu::free(b);
        }
    }
}

// ---------------------------------------------------------------------------------------
// channel_partials + channel_finish.

template <class T>
static void test_channel_sums(void (*partials)(const T*, const T*, double*, int, long long)) {
    Rng rng(13);
    struct Case {
        int channels, parts;
        long long plane;
        unsigned block;
    };
    // Short last part (1000 = 334 + 334 + 332), an empty last part (5 over 4 parts of 2),
    // one part, several blocks' worth per part, a block of 64 (any multiple of 32 works).
    const Case cases[] = {{3, 3, 1000, 256}, {2, 4, 5, 256}, {4, 1, 300, 256},
                          {2, 3, 20000, 256}, {3, 5, 777, 64}, {1, 7, 7, 256}};
    for (const Case& cs : cases) {
        const long long n = (long long)cs.channels * cs.plane;
        T* a = buffer<T>(n);
        T* b = buffer<T>(n);
        // An offset mean (so Σa² ≠ Σ(a − mean)²) and signs in b.
        const Vec av = fill_random(a, n, rng, 0.5f, 3.0f);
        const Vec bv = fill_random(b, n, rng, -2.0f, 2.0f);
        const long long span = (cs.plane + cs.parts - 1) / cs.parts;
        for (int prod = 0; prod < 2; ++prod) {
            const std::string tag = fmt("channel_sums %s C=%d plane=%lld parts=%d block=%u %s",
                                        type_name<T>(), cs.channels, cs.plane, cs.parts, cs.block,
                                        prod ? "(a, a*b)" : "(a, a^2)");
            const size_t np = (size_t)cs.channels * cs.parts * 2;
            double* partial = buffer<double>(np);
            for (size_t i = 0; i < np; ++i) partial[i] = NAN;
            emu::launch(partials, dim3(cs.channels, cs.parts), dim3(cs.block), 0, (const T*)a,
                        prod ? (const T*)b : (const T*)nullptr, partial, cs.parts, cs.plane);
            // The sums and the sums of the terms' magnitudes (Σa·b may cancel).
            Vec want_partial(np), want_sums((size_t)cs.channels * 2, 0.0);
            Vec abs_partial(np), abs_sums((size_t)cs.channels * 2, 0.0);
            for (int c = 0; c < cs.channels; ++c)
                for (int q = 0; q < cs.parts; ++q) {
                    const long long lo = std::min((long long)q * span, cs.plane);
                    const long long hi = std::min(lo + span, cs.plane);
                    double s = 0.0, t = 0.0, sa = 0.0, ta = 0.0;
                    for (long long i = lo; i < hi; ++i) {
                        const long long e = (long long)c * cs.plane + i;
                        const double term = prod ? (double)((float)av[e] * (float)bv[e]) : av[e] * av[e];
                        s += av[e];
                        t += term;
                        sa += std::fabs(av[e]);
                        ta += std::fabs(term);
                    }
                    const size_t at = ((size_t)c * cs.parts + q) * 2;
                    want_partial[at] = s;
                    want_partial[at + 1] = t;
                    abs_partial[at] = sa;
                    abs_partial[at + 1] = ta;
                    want_sums[(size_t)c * 2] += s;
                    want_sums[(size_t)c * 2 + 1] += t;
                    abs_sums[(size_t)c * 2] += sa;
                    abs_sums[(size_t)c * 2 + 1] += ta;
                }
            const Vec got_partial = read_d(partial, np);
            tally.check(tag + " partials", rel_l2(got_partial, want_partial), 1e-12);
            // Each part on its own, relative to the magnitude of its terms.
            tally.check(tag + " partials (each)", max_err(got_partial, want_partial, abs_partial), 1e-12);

            for (int small = 0; small < 2; ++small) {
                double* sums = buffer<double>((size_t)cs.channels * 2);
                for (int i = 0; i < cs.channels * 2; ++i) sums[i] = NAN;
                emu::launch(channel_finish, dim3(small ? 1 : grid_for(cs.channels)), dim3(256), 0,
                            (const double*)partial, sums, cs.channels, cs.parts);
                const Vec got = read_d(sums, (size_t)cs.channels * 2);
                Vec in_order((size_t)cs.channels * 2);
                for (int c = 0; c < cs.channels; ++c) {
                    double s = 0.0, t = 0.0;
                    for (int q = 0; q < cs.parts; ++q) {
                        s += got_partial[((size_t)c * cs.parts + q) * 2];
                        t += got_partial[((size_t)c * cs.parts + q) * 2 + 1];
                    }
                    in_order[(size_t)c * 2] = s;
                    in_order[(size_t)c * 2 + 1] = t;
                }
                const std::string t = tag + fmt(" finish grid=%s", small ? "1" : "rust");
                tally.check(t + " vs double", rel_l2(got, want_sums), 1e-12);
                tally.check(t + " vs double (each)", max_err(got, want_sums, abs_sums), 1e-12);
                check_exact(t + " = partials summed in order", got, in_order);
                emu::free(sums);
            }
            emu::free(partial);
        }
        emu::free(a);
        emu::free(b);
    }
}

/// channel_finish over many channels with a single block (its grid-stride loop).
static void test_finish_many_channels() {
    Rng rng(14);
    const int C = 300, parts = 3;
    double* partial = buffer<double>((size_t)C * parts * 2);
    for (int i = 0; i < C * parts * 2; ++i) partial[i] = rng.range(-100.0f, 100.0f) + rng.uniform();
    Vec want((size_t)C * 2);
    for (int c = 0; c < C; ++c)
        for (int j = 0; j < 2; ++j) {
            double s = 0.0;
            for (int q = 0; q < parts; ++q) s += partial[((size_t)c * parts + q) * 2 + j];
            want[(size_t)c * 2 + j] = s;
        }
    for (int small = 0; small < 2; ++small) {
        double* sums = buffer<double>((size_t)C * 2);
        for (int i = 0; i < C * 2; ++i) sums[i] = NAN;
        emu::launch(channel_finish, dim3(small ? 1 : grid_for(C)), dim3(256), 0, (const double*)partial,
                    sums, C, parts);
        check_exact(fmt("channel_finish C=%d parts=%d grid=%s", C, parts, small ? "1" : "rust"),
                    read_d(sums, (size_t)C * 2), want);
        emu::free(sums);
    }
    emu::free(partial);
}

// ---------------------------------------------------------------------------------------
// Batch norm.

/// bn_moments: the CPU's `moments_from_sums` and running update (nn's BatchNorm2d).
static void test_bn_moments() {
    Rng rng(15);
    const double counts[] = {1.0, 2.0, 3.0, 98.0, 200704.0};
    for (double count : counts)
        for (int C : {7, 300})
            for (int with_running = 0; with_running < 2; ++with_running)
                for (float momentum : {0.1f, 0.9f}) {
                    if (!with_running && momentum != 0.1f) continue;
                    const std::string tag = fmt("bn_moments count=%.0f C=%d running=%d momentum=%g",
                                                count, C, with_running, momentum);
                    double* sums = buffer<double>((size_t)C * 2);
                    for (int c = 0; c < C; ++c) {
                        double s, q;
                        if (count == 1.0) {
                            const double v = rng.range(-3.0f, 3.0f);
                            s = v;
                            q = v * v;
                        } else if (c % 5 == 4) {
                            // Rounding made Σx²/n a little less than mean²: the variance is 0.
                            const double m = rng.range(-2.0f, 2.0f);
                            s = m * count;
                            q = m * m * count * (1.0 - 1e-9);
                        } else {
                            const double m = rng.range(-2.0f, 2.0f), v = rng.range(0.01f, 3.0f);
                            s = m * count;
                            q = (v + m * m) * count;
                        }
                        sums[(size_t)c * 2] = s;
                        sums[(size_t)c * 2 + 1] = q;
                    }
                    float* running = with_running ? buffer<float>((size_t)C * 2) : nullptr;
                    Vec run0;
                    if (with_running) {
                        fill_random(running, C, rng, -1.0f, 1.0f);
                        fill_random(running + C, C, rng, 0.1f, 2.0f);
                        run0 = read(running, (size_t)C * 2);
                    }
                    Vec want_stats((size_t)C * 2), want_run((size_t)C * 2);
                    const float unbias = (float)count / (float)(std::max(count, 2.0) - 1.0);
                    for (int c = 0; c < C; ++c) {
                        const double mean = sums[(size_t)c * 2] / count;
                        const float m = (float)mean;
                        const float v = (float)std::max(sums[(size_t)c * 2 + 1] / count - mean * mean, 0.0);
                        want_stats[c] = m;
                        want_stats[C + c] = v;
                        if (with_running) {
                            // nn/src/layers.rs: (1 − m)·r + m·mean, (1 − m)·r + m·var·unbias.
                            want_run[c] = (1.0f - momentum) * (float)run0[c] + momentum * m;
                            want_run[C + c] = (1.0f - momentum) * (float)run0[C + c] + momentum * v * unbias;
                        }
                    }
                    for (int small = 0; small < 2; ++small) {
                        // The running update is in place: start each launch from run0.
                        for (size_t i = 0; i < run0.size(); ++i) running[i] = (float)run0[i];
                        float* stats = buffer<float>((size_t)C * 2);
                        fill_poison(stats, (size_t)C * 2);
                        emu::launch(bn_moments, dim3(small ? 1 : grid_for(C)), dim3(256), 0,
                                    (const double*)sums, stats, running, C, count, momentum);
                        const std::string t = tag + fmt(" grid=%s", small ? "1" : "rust");
                        check_exact(t + " mean|var", read(stats, (size_t)C * 2), want_stats);
                        if (with_running) {
                            const Vec got = read(running, (size_t)C * 2);
                            check_exact(t + " running mean", Vec(got.begin(), got.begin() + C),
                                        Vec(want_run.begin(), want_run.begin() + C));
                            check_exact(t + " running var", Vec(got.begin() + C, got.end()),
                                        Vec(want_run.begin() + C, want_run.end()));
                        }
                        emu::free(stats);
                    }
                    emu::free(sums);
                    if (running) emu::free(running);
                }
}

template <class T>
static void test_bn_apply(void (*kernel)(const T*, const float*, const float*, const float*, T*, T*,
                                         int, long long, float)) {
    Rng rng(16);
    const float eps = 1e-5f;
    const long long shapes[][2] = {{3, 257}, {5, 64}, {2, 1}};
    for (const auto& sh : shapes) {
        const int C = (int)sh[0];
        const long long plane = sh[1], n = C * plane;
        T* x = buffer<T>(n);
        const Vec xv = fill_random(x, n, rng, -2.0f, 4.0f);
        float* stats = buffer<float>((size_t)C * 2);
        float* gamma = buffer<float>(C);
        float* beta = buffer<float>(C);
        const Vec mv = fill_random(stats, C, rng, 0.0f, 2.0f);
        const Vec vv = fill_random(stats + C, C, rng, 0.05f, 3.0f);
        const Vec gv = fill_random(gamma, C, rng, 0.5f, 1.5f);
        const Vec bv = fill_random(beta, C, rng, -0.5f, 0.5f);
        Vec want_y(n), want_h(n), exact_y(n), exact_h(n);
        for (long long i = 0; i < n; ++i) {
            const int c = (int)(i / plane);
            const double h = (xv[i] - mv[c]) / std::sqrt(vv[c] + (double)eps);
            want_h[i] = h;
            want_y[i] = gv[c] * h + bv[c];
            // The CPU's f32 arithmetic (norm.rs batch_norm_apply).
            const float rstd = 1.0f / std::sqrt((float)vv[c] + eps);
            const float hf = ((float)xv[i] - (float)mv[c]) * rstd;
            exact_h[i] = round_t<T>(hf);
            exact_y[i] = round_t<T>((float)gv[c] * hf + (float)bv[c]);
        }
        for (int keep = 0; keep < 2; ++keep)
            for (int small = 0; small < 2; ++small) {
                T* y = buffer<T>(n);
                T* xhat = keep ? buffer<T>(n) : nullptr;
                fill_poison(y, n);
                if (keep) fill_poison(xhat, n);
                emu::launch(kernel, dim3(small ? 1 : grid_for(n)), dim3(256), 0, (const T*)x,
                            (const float*)stats, (const float*)gamma, (const float*)beta, y, xhat, C,
                            plane, eps);
                const std::string t = fmt("bn_apply %s C=%d plane=%lld xhat=%d grid=%s", type_name<T>(),
                                          C, plane, keep, small ? "1" : "rust");
                tally.check(t + " y", rel_l2(read(y, n), want_y), tol<T>());
                check_exact(t + " y (CPU arithmetic)", read(y, n), exact_y);
                if (keep) {
                    tally.check(t + " xhat", rel_l2(read(xhat, n), want_h), tol<T>());
                    check_exact(t + " xhat (CPU arithmetic)", read(xhat, n), exact_h);
                }
                emu::free(y);
                if (xhat) emu::free(xhat);
            }
        emu::free(x);
        emu::free(stats);
        emu::free(gamma);
        emu::free(beta);
    }
}

static void test_bn_param_grads() {
    Rng rng(17);
    for (int C : {6, 300})
        for (int with_gamma = 0; with_gamma < 2; ++with_gamma)
            for (int small = 0; small < 2; ++small) {
                double* sums = buffer<double>((size_t)C * 2);
                for (int i = 0; i < 2 * C; ++i) sums[i] = (double)rng.range(-50.0f, 50.0f) + rng.uniform() * 1e-3;
                float* dgamma = buffer<float>(C);
                float* dbeta = buffer<float>(C);
                const Vec g0 = fill_random(dgamma, C, rng, -1.0f, 1.0f);
                const Vec b0 = fill_random(dbeta, C, rng, -1.0f, 1.0f);
                emu::launch(bn_param_grads, dim3(small ? 1 : grid_for(C)), dim3(256), 0, (const double*)sums,
                            with_gamma ? dgamma : (float*)nullptr, dbeta, C);
                Vec want_g(C), want_b(C);
                for (int c = 0; c < C; ++c) {
                    want_g[c] = with_gamma ? (double)((float)g0[c] + (float)sums[(size_t)c * 2 + 1]) : g0[c];
                    want_b[c] = (float)b0[c] + (float)sums[(size_t)c * 2];
                }
                const std::string t = fmt("bn_param_grads C=%d dgamma=%s grid=%s", C,
                                          with_gamma ? "yes" : "null", small ? "1" : "rust");
                check_exact(t + " dgamma", read(dgamma, C), want_g);
                check_exact(t + " dbeta", read(dbeta, C), want_b);
                emu::free(sums);
                emu::free(dgamma);
                emu::free(dbeta);
            }
}

template <class T>
static void test_bn_input_grad(void (*kernel)(const T*, const T*, const float*, const float*,
                                              const double*, T*, int, long long, double, float)) {
    Rng rng(18);
    const float eps = 1e-5f;
    struct Case {
        int C;
        long long plane;
        int workers;  // count = workers·plane (SyncBatchNorm: the other workers' sums are random)
    };
    const Case cases[] = {{3, 200, 1}, {4, 49, 4}, {2, 1, 1}, {5, 300, 2}};
    for (const Case& cs : cases) {
        const int C = cs.C;
        const long long plane = cs.plane, n = C * plane;
        const double count = (double)cs.workers * plane;
        T* dy = buffer<T>(n);
        T* xhat = buffer<T>(n);
        const Vec dyv = fill_random(dy, n, rng, -1.0f, 1.0f);
        const Vec hv = fill_random(xhat, n, rng, -2.0f, 2.0f);
        float* var = buffer<float>(C);
        float* gamma = buffer<float>(C);
        const Vec vv = fill_random(var, C, rng, 0.05f, 3.0f);
        const Vec gv = fill_random(gamma, C, rng, 0.5f, 1.5f);
        double* sums = buffer<double>((size_t)C * 2);
        for (int c = 0; c < C; ++c) {
            double s = 0.0, t = 0.0;
            for (long long i = c * plane; i < (c + 1) * plane; ++i) {
                s += dyv[i];
                t += (double)((float)dyv[i] * (float)hv[i]);
            }
            for (int w = 1; w < cs.workers; ++w) {
                s += rng.range(-0.5f, 0.5f) * plane;
                t += rng.range(-0.5f, 0.5f) * plane;
            }
            sums[(size_t)c * 2] = s;
            sums[(size_t)c * 2 + 1] = t;
        }
        Vec want(n), exact(n);
        for (long long i = 0; i < n; ++i) {
            const int c = (int)(i / plane);
            const double rstd = 1.0 / std::sqrt(vv[c] + (double)eps);
            want[i] = gv[c] * rstd *
                      (dyv[i] - sums[(size_t)c * 2] / count - hv[i] * sums[(size_t)c * 2 + 1] / count);
            // The CPU's f32 arithmetic (norm.rs batch_norm_input_grad).
            const float rs = 1.0f / std::sqrt((float)vv[c] + eps);
            const float kf = (float)gv[c] * rs;
            const float mean_dy = (float)(sums[(size_t)c * 2] / count);
            const float mean_dyh = (float)(sums[(size_t)c * 2 + 1] / count);
            exact[i] = round_t<T>(kf * ((float)dyv[i] - mean_dy - (float)hv[i] * mean_dyh));
        }
        for (int small = 0; small < 2; ++small) {
            T* dx = buffer<T>(n);
            fill_poison(dx, n);
            emu::launch(kernel, dim3(small ? 1 : grid_for(n)), dim3(256), 0, (const T*)dy, (const T*)xhat,
                        (const float*)var, (const float*)gamma, (const double*)sums, dx, C, plane, count,
                        eps);
            const std::string t = fmt("bn_input_grad %s C=%d plane=%lld count=%.0f grid=%s",
                                      type_name<T>(), C, plane, count, small ? "1" : "rust");
            tally.check(t + " vs double", rel_l2(read(dx, n), want), tol<T>());
            check_exact(t + " (CPU arithmetic)", read(dx, n), exact);
            emu::free(dx);
        }
        emu::free(dy);
        emu::free(xhat);
        emu::free(var);
        emu::free(gamma);
        emu::free(sums);
    }
}

// ---------------------------------------------------------------------------------------
// Pooling.

struct Pool {
    long long planes;
    int H, W, k, s, p;
    int OH() const { return (H + 2 * p - k) / s + 1; }
    int OW() const { return (W + 2 * p - k) / s + 1; }
};

template <class T> using PoolFwd = void (*)(const T*, T*, int*, long long, int, int, int, int, int, int, int);
template <class T> using PoolBwd = void (*)(const T*, const int*, T*, long long, int, int, int, int, int, int, int);
template <class T> using AvgFwd = void (*)(const T*, T*, long long, int, int, int, int, int, int, int);

template <class T> static void test_maxpool(PoolFwd<T> fwd, PoolBwd<T> bwd) {
    Rng rng(19);
    // 2x2/2 (even and odd sizes: the last row/column unused), 3x3/2 padded by 1 (ResNet's
    // stem: overlapping windows, padding at the borders).
    const Pool pools[] = {{8, 8, 6, 2, 2, 0}, {8, 7, 9, 2, 2, 0}, {8, 9, 9, 3, 2, 1}, {8, 8, 7, 3, 2, 1},
                          {4, 3, 3, 3, 2, 1}};
    for (const Pool& pg : pools) {
        const int OH = pg.OH(), OW = pg.OW(), HW = pg.H * pg.W;
        const long long nx = pg.planes * HW, ny = pg.planes * OH * OW;
        const std::string tag = fmt("%s planes=%lld %dx%d k=%d s=%d p=%d", type_name<T>(), pg.planes,
                                    pg.H, pg.W, pg.k, pg.s, pg.p);
        // Plane kinds: continuous values; small integers (ties); negative integers (ties, and
        // padding must not win as a 0); peaks at odd (y, x), which overlapping 3x3/2 windows
        // share 2 to 4 at a time (an input chosen by several outputs: their order of addition
        // shows in the backward). A few NaNs, one of them in plane 0.
        T* x = buffer<T>(nx);
        Vec xv(nx);
        for (long long pl = 0; pl < pg.planes; ++pl)
            for (int e = 0; e < HW; ++e) {
                const long long i = pl * HW + e;
                float v;
                switch (pl % 4) {
                case 0: v = rng.range(-1.0f, 1.0f); break;
                case 1: v = (float)rng.below(3); break;
                case 2: v = -1.0f - (float)rng.below(3); break;
                default:
                    v = ((e / pg.W) % 2 == 1 && (e % pg.W) % 2 == 1) ? rng.range(1.0f, 2.0f)
                                                                     : rng.range(-1.0f, 0.0f);
                    break;
                }
                x[i] = from_f32<T>(v);
            }
        x[HW / 2 + 1] = nan_of<T>();
        for (int j = 0; j < 2; ++j) x[(1 + rng.below((int)pg.planes - 1)) * HW + rng.below(HW)] = nan_of<T>();
        xv = read(x, nx);
        // The CPU's loop (pool.rs max_pool_forward).
        Vec want_y(ny);
        std::vector<int> want_arg(ny);
        for (long long pl = 0; pl < pg.planes; ++pl)
            for (int oy = 0; oy < OH; ++oy)
                for (int ox = 0; ox < OW; ++ox) {
                    double best = -INFINITY;
                    int best_idx = 0;
                    for (int ky = 0; ky < pg.k; ++ky) {
                        const int iy = oy * pg.s + ky - pg.p;
                        if (iy < 0 || iy >= pg.H) continue;
                        for (int kx = 0; kx < pg.k; ++kx) {
                            const int ix = ox * pg.s + kx - pg.p;
                            if (ix < 0 || ix >= pg.W) continue;
                            const double v = xv[pl * HW + iy * pg.W + ix];
                            if (v > best || std::isnan(v)) {
                                best = v;
                                best_idx = iy * pg.W + ix;
                            }
                        }
                    }
                    const long long o = (pl * OH + oy) * OW + ox;
                    want_y[o] = best;
                    want_arg[o] = best_idx;
                }
        int* arg = buffer<int>(ny);
        for (int small = 0; small < 2; ++small)
            for (int with_arg = 0; with_arg < 2; ++with_arg) {
                T* y = buffer<T>(ny);
                fill_poison(y, ny);
                for (long long i = 0; i < ny; ++i) arg[i] = -7;
                emu::launch(fwd, dim3(small ? 1 : grid_for(ny)), dim3(256), 0, (const T*)x, y,
                            with_arg ? arg : (int*)nullptr, pg.planes, pg.H, pg.W, OH, OW, pg.k, pg.s,
                            pg.p);
                const std::string t = fmt("maxpool_fwd %s arg=%s grid=%s", tag.c_str(),
                                          with_arg ? "yes" : "null", small ? "1" : "rust");
                check_exact(t + " y", read(y, ny), want_y);
                bool ok = true;
                long long bad = -1;
                for (long long i = 0; i < ny; ++i)
                    if (arg[i] != (with_arg ? want_arg[i] : -7)) {
                        ok = false;
                        if (bad < 0) bad = i;
                    }
                tally.check_true(t + (with_arg ? " arg" : " arg untouched") +
                                     (ok ? "" : fmt(": first mismatch at %lld: %d", bad, arg[bad])),
                                 ok);
                emu::free(y);
            }
        // Backward from the forward's winners: dy[o] added into dx[arg[o]] in output order, f32.
        T* dy = buffer<T>(ny);
        const Vec dyv = fill_random(dy, ny, rng, -1.0f, 1.0f);
        std::vector<float> acc(nx, 0.0f);
        for (long long pl = 0; pl < pg.planes; ++pl)
            for (int o = 0; o < OH * OW; ++o) {
                const long long oi = pl * OH * OW + o;
                acc[pl * HW + want_arg[oi]] += (float)dyv[oi];
            }
        Vec want_dx(nx);
        for (long long i = 0; i < nx; ++i) want_dx[i] = round_t<T>(acc[i]);
        for (int small = 0; small < 2; ++small) {
            T* dx = buffer<T>(nx);
            fill_poison(dx, nx);
            emu::launch(bwd, dim3(small ? 1 : grid_for(nx)), dim3(256), 0, (const T*)dy, (const int*)arg,
                        dx, pg.planes, pg.H, pg.W, OH, OW, pg.k, pg.s, pg.p);
            check_exact(fmt("maxpool_bwd %s grid=%s", tag.c_str(), small ? "1" : "rust"), read(dx, nx),
                        want_dx);
            emu::free(dx);
        }
        emu::free(x);
        emu::free(arg);
        emu::free(dy);
    }
}

template <class T> static void test_avgpool(AvgFwd<T> fwd, AvgFwd<T> bwd) {
    Rng rng(20);
    // 2x2/2 (LeNet; odd sizes leave a row/column out), 3x3/1 and 3x3/2 (overlapping).
    const Pool pools[] = {{6, 8, 6, 2, 2, 0}, {3, 7, 5, 2, 2, 0}, {4, 6, 7, 3, 1, 0}, {2, 9, 8, 3, 2, 0},
                          {2, 4, 4, 4, 1, 0}};
    for (const Pool& pg : pools) {
        const int OH = pg.OH(), OW = pg.OW(), HW = pg.H * pg.W, k = pg.k, s = pg.s;
        const long long nx = pg.planes * HW, ny = pg.planes * OH * OW;
        const std::string tag = fmt("%s planes=%lld %dx%d k=%d s=%d", type_name<T>(), pg.planes, pg.H,
                                    pg.W, k, s);
        const float inv = 1.0f / (float)(k * k);
        T* x = buffer<T>(nx);
        const Vec xv = fill_random(x, nx, rng, -1.0f, 1.0f);
        Vec want_y(ny), mean_y(ny);
        for (long long pl = 0; pl < pg.planes; ++pl)
            for (int oy = 0; oy < OH; ++oy)
                for (int ox = 0; ox < OW; ++ox) {
                    float sum = 0.0f;
                    double d = 0.0;
                    for (int ky = 0; ky < k; ++ky) {
                        float r = 0.0f;
                        for (int kx = 0; kx < k; ++kx) {
                            const double v = xv[pl * HW + (oy * s + ky) * pg.W + ox * s + kx];
                            r += (float)v;
                            d += v;
                        }
                        sum += r;
                    }
                    want_y[(pl * OH + oy) * OW + ox] = round_t<T>(sum * inv);
                    mean_y[(pl * OH + oy) * OW + ox] = d / (k * k);
                }
        T* dy = buffer<T>(ny);
        const Vec dyv = fill_random(dy, ny, rng, -1.0f, 1.0f);
        Vec want_dx(nx), double_dx(nx, 0.0);
        for (long long pl = 0; pl < pg.planes; ++pl)
            for (int iy = 0; iy < pg.H; ++iy)
                for (int ix = 0; ix < pg.W; ++ix) {
                    float sum = 0.0f;
                    for (int oy = 0; oy < OH; ++oy)
                        for (int ox = 0; ox < OW; ++ox)
                            if (oy * s <= iy && iy < oy * s + k && ox * s <= ix && ix < ox * s + k) {
                                const double g = dyv[(pl * OH + oy) * OW + ox];
                                sum += (float)g * inv;
                                double_dx[pl * HW + iy * pg.W + ix] += g / (k * k);
                            }
                    want_dx[pl * HW + iy * pg.W + ix] = round_t<T>(sum);
                }
        for (int small = 0; small < 2; ++small) {
            T* y = buffer<T>(ny);
            fill_poison(y, ny);
            emu::launch(fwd, dim3(small ? 1 : grid_for(ny)), dim3(256), 0, (const T*)x, y, pg.planes, pg.H,
                        pg.W, OH, OW, k, s, 0);
            const std::string t = fmt("avgpool_fwd %s grid=%s", tag.c_str(), small ? "1" : "rust");
            check_exact(t + " rows then sum, times 1/k^2", read(y, ny), want_y);
            tally.check(t + " vs double mean", rel_l2(read(y, ny), mean_y), tol<T>());
            T* dx = buffer<T>(nx);
            fill_poison(dx, nx);
            emu::launch(bwd, dim3(small ? 1 : grid_for(nx)), dim3(256), 0, (const T*)dy, dx, pg.planes,
                        pg.H, pg.W, OH, OW, k, s, 0);
            const std::string tb = fmt("avgpool_bwd %s grid=%s", tag.c_str(), small ? "1" : "rust");
            check_exact(tb + " (oy,ox) order", read(dx, nx), want_dx);
            tally.check(tb + " vs double", rel_l2(read(dx, nx), double_dx), tol<T>());
            emu::free(y);
            emu::free(dx);
        }
        emu::free(x);
        emu::free(dy);
    }
}

// ---------------------------------------------------------------------------------------
// Layout changes and global average pooling.

template <class T> static void test_swap_axes(void (*kernel)(const T*, T*, int, int, long long)) {
    Rng rng(21);
    const long long shapes[][3] = {{3, 4, 5}, {2, 5, 49}, {7, 3, 1}, {1, 6, 10}, {64, 2, 3}};
    for (const auto& sh : shapes) {
        const int A = (int)sh[0], B = (int)sh[1];
        const long long P = sh[2], n = A * B * P;
        T* x = buffer<T>(n);
        const Vec xv = fill_random(x, n, rng, -1.0f, 1.0f);
        Vec want(n);
        for (int a = 0; a < A; ++a)
            for (int b = 0; b < B; ++b)
                for (long long e = 0; e < P; ++e) want[((long long)b * A + a) * P + e] = xv[((long long)a * B + b) * P + e];
        for (int small = 0; small < 2; ++small) {
            T* y = buffer<T>(n);
            fill_poison(y, n);
            emu::launch(kernel, dim3(small ? 1 : grid_for(n)), dim3(256), 0, (const T*)x, y, A, B, P);
            check_exact(fmt("swap_axes %s [%d,%d,%lld] grid=%s", type_name<T>(), A, B, P, small ? "1" : "rust"),
                        read(y, n), want);
            emu::free(y);
        }
        emu::free(x);
    }
}

template <class T>
static void test_global_avg(void (*fwd)(const T*, T*, int, int, int), void (*bwd)(const T*, T*, int, int, int)) {
    Rng rng(22);
    const int shapes[][3] = {{3, 2, 49}, {5, 4, 1}, {2, 3, 300}, {300, 1, 4}};  // (C, N, HW)
    for (const auto& sh : shapes) {
        const int C = sh[0], N = sh[1], HW = sh[2];
        const long long nx = (long long)C * N * HW, ny = (long long)C * N;
        const float inv = 1.0f / (float)HW;
        T* x = buffer<T>(nx);
        const Vec xv = fill_random(x, nx, rng, -1.0f, 1.0f);
        T* dy = buffer<T>(ny);
        const Vec dyv = fill_random(dy, ny, rng, -1.0f, 1.0f);
        Vec want_y(ny), mean_y(ny), want_dx(nx);
        for (int n = 0; n < N; ++n)
            for (int c = 0; c < C; ++c) {
                float sum = 0.0f;
                double d = 0.0;
                for (int e = 0; e < HW; ++e) {
                    sum += (float)xv[((long long)c * N + n) * HW + e];
                    d += xv[((long long)c * N + n) * HW + e];
                }
                want_y[(long long)n * C + c] = round_t<T>(sum * inv);
                mean_y[(long long)n * C + c] = d / HW;
                for (int e = 0; e < HW; ++e)
                    want_dx[((long long)c * N + n) * HW + e] = round_t<T>((float)dyv[(long long)n * C + c] * inv);
            }
        const std::string tag = fmt("%s C=%d N=%d HW=%d", type_name<T>(), C, N, HW);
        for (int small = 0; small < 2; ++small) {
            T* y = buffer<T>(ny);
            fill_poison(y, ny);
            emu::launch(fwd, dim3(small ? 1 : grid_for(ny)), dim3(256), 0, (const T*)x, y, C, N, HW);
            const std::string t = fmt("global_avg_fwd %s grid=%s", tag.c_str(), small ? "1" : "rust");
            check_exact(t + " in-order sum", read(y, ny), want_y);
            tally.check(t + " vs double mean", rel_l2(read(y, ny), mean_y), tol<T>());
            T* dx = buffer<T>(nx);
            fill_poison(dx, nx);
            emu::launch(bwd, dim3(small ? 1 : grid_for(nx)), dim3(256), 0, (const T*)dy, dx, C, N, HW);
            check_exact(fmt("global_avg_bwd %s grid=%s", tag.c_str(), small ? "1" : "rust"), read(dx, nx),
                        want_dx);
            emu::free(y);
            emu::free(dx);
        }
        emu::free(x);
        emu::free(dy);
    }
}

int main() {
    test_im2col_col2im<float>(im2col_f32, col2im_f32);
    test_im2col_col2im<bf16>(im2col_bf16, col2im_bf16);
    test_im2col_col2im<f16>(im2col_f16, col2im_f16);
    test_bias_add<float>(channel_bias_add_f32);
    test_bias_add<bf16>(channel_bias_add_bf16);
    test_bias_add<f16>(channel_bias_add_f16);
    test_channel_sums<float>(channel_partials_f32);
    test_channel_sums<bf16>(channel_partials_bf16);
    test_channel_sums<f16>(channel_partials_f16);
    test_finish_many_channels();
    test_bn_moments();
    test_bn_apply<float>(bn_apply_f32);
    test_bn_apply<bf16>(bn_apply_bf16);
    test_bn_apply<f16>(bn_apply_f16);
    test_bn_param_grads();
    test_bn_input_grad<float>(bn_input_grad_f32);
    test_bn_input_grad<bf16>(bn_input_grad_bf16);
    test_bn_input_grad<f16>(bn_input_grad_f16);
    test_maxpool<float>(maxpool_fwd_f32, maxpool_bwd_f32);
    test_maxpool<bf16>(maxpool_fwd_bf16, maxpool_bwd_bf16);
    test_maxpool<f16>(maxpool_fwd_f16, maxpool_bwd_f16);
    test_avgpool<float>(avgpool_fwd_f32, avgpool_bwd_f32);
    test_avgpool<bf16>(avgpool_fwd_bf16, avgpool_bwd_bf16);
    test_avgpool<f16>(avgpool_fwd_f16, avgpool_bwd_f16);
    test_swap_axes<float>(swap_axes_f32);
    test_swap_axes<bf16>(swap_axes_bf16);
    test_swap_axes<f16>(swap_axes_f16);
    test_global_avg<float>(global_avg_fwd_f32, global_avg_bwd_f32);
    test_global_avg<bf16>(global_avg_fwd_bf16, global_avg_bwd_bf16);
    test_global_avg<f16>(global_avg_fwd_f16, global_avg_bwd_f16);
    return tally.finish("conv");
}
