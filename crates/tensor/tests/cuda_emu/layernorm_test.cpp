// Tests of layernorm.cu on the CPU emulator against a double-precision layer norm.
#include "cuda_emu.h"
#include "common.cuh"
#include "bias.cu"  // colsum_finish, stage 2 of the parameter gradients
#include "layernorm.cu"
#include "kernel_test_util.h"

using namespace kt;

static Tally tally;

// (rows, d): vector path (d % 4 == 0, d ≤ 1024), scalar path (d % 4 != 0 or d > 1024),
// rows not a multiple of 8, a single row.
static const int SHAPES[][2] = {{1, 1}, {3, 5}, {9, 64}, {13, 96}, {8, 1024}, {17, 36},
                                {3, 1100}, {10, 30}, {5, 7}, {1, 768}, {11, 132}};

struct Stats {
    std::vector<double> mean, rstd;
};

static Stats ref_stats(const std::vector<double>& x, int rows, int d, double eps) {
    Stats s{std::vector<double>(rows), std::vector<double>(rows)};
    for (int r = 0; r < rows; ++r) {
        double m = 0.0, v = 0.0;
        for (int c = 0; c < d; ++c) m += x[(size_t)r * d + c];
        m /= d;
        for (int c = 0; c < d; ++c) v += (x[(size_t)r * d + c] - m) * (x[(size_t)r * d + c] - m);
        v /= d;
        s.mean[r] = m;
        s.rstd[r] = 1.0 / std::sqrt(v + eps);
    }
    return s;
}

template <class T>
static void test_forward(void (*fwd)(const float*, const float*, const float*, T*, float*, float*, int, int, float)) {
    Rng rng(31);
    const float eps = 1e-5f;
    for (const auto& sh : SHAPES) {
        const int rows = sh[0], d = sh[1];
        const size_t n = (size_t)rows * d;
        for (int with_stats = 0; with_stats < 2; ++with_stats) {
            float* x = buffer<float>(n);
            float* gamma = buffer<float>(d);
            float* beta = buffer<float>(d);
            T* y = buffer<T>(n);
            // An offset mean, so the two-pass variance matters.
            const auto xv = fill_random(x, n, rng, 2.0f, 6.0f);
            const auto gv = fill_random(gamma, d, rng, 0.5f, 1.5f);
            const auto bv = fill_random(beta, d, rng, -0.5f, 0.5f);
            fill_poison(y, n);
            float* mean = with_stats ? buffer<float>(rows) : nullptr;
            float* rstd = with_stats ? buffer<float>(rows) : nullptr;
            if (with_stats) {
                fill_poison(mean, rows);
                fill_poison(rstd, rows);
            }
            const unsigned grid = with_stats ? (rows + 7) / 8 : 1;  // 1 block: grid-stride rows
            emu::launch(fwd, dim3(grid), dim3(256), 0, (const float*)x, (const float*)gamma,
                        (const float*)beta, y, mean, rstd, rows, d, eps);
            const Stats s = ref_stats(xv, rows, d, eps);
            std::vector<double> want(n);
            for (int r = 0; r < rows; ++r)
                for (int c = 0; c < d; ++c)
                    want[(size_t)r * d + c] = (xv[(size_t)r * d + c] - s.mean[r]) * s.rstd[r] * gv[c] + bv[c];
            const std::string tag = fmt("layernorm_fwd_%s rows=%d d=%d stats=%d", type_name<T>(), rows, d, with_stats);
            tally.check(tag + " y", rel_l2(read(y, n), want), tol<T>());
            if (with_stats) {
                tally.check(tag + " mean", rel_l2(read(mean, rows), s.mean), 1e-6);
                tally.check(tag + " rstd", rel_l2(read(rstd, rows), s.rstd), 1e-5);
            }
        }
    }
}

template <class T>
static void test_backward(void (*dx_kernel)(const float*, const float*, const float*, const float*, const T*, float*, T*, int, int, int),
                          void (*params_kernel)(const float*, const float*, const float*, const T*, float*, int, int, int),
                          void (*fused_kernel)(const float*, const float*, const float*, const float*, const T*, float*, T*, float*, int, int, int)) {
    Rng rng(32);
    const double eps = 1e-5;
    for (const auto& sh : SHAPES) {
        const int rows = sh[0], d = sh[1];
        const size_t n = (size_t)rows * d;
        float* x = buffer<float>(n);
        float* gamma = buffer<float>(d);
        float* mean = buffer<float>(rows);
        float* rstd = buffer<float>(rows);
        T* dy = buffer<T>(n);
        float* dx = buffer<float>(n);
        const auto xv = fill_random(x, n, rng, -2.0f, 3.0f);
        const auto gv = fill_random(gamma, d, rng, 0.5f, 1.5f);
        const auto dyv = fill_random(dy, n, rng, -1.0f, 1.0f);
        // The statistics as the forward stores them (f32), and the reference uses the same.
        const Stats s0 = ref_stats(xv, rows, d, eps);
        std::vector<double> mv(rows), rv(rows);
        for (int r = 0; r < rows; ++r) {
            mean[r] = (float)s0.mean[r];
            rstd[r] = (float)s0.rstd[r];
            mv[r] = mean[r];
            rv[r] = rstd[r];
        }
        fill_poison(dx, n);
        emu::launch(dx_kernel, dim3((rows + 7) / 8), dim3(256), 0, (const float*)x, (const float*)gamma,
                    (const float*)mean, (const float*)rstd, (const T*)dy, dx, (T*)nullptr, rows, d, 0);
        std::vector<double> want(n), scale(n);
        std::vector<double> dgamma(d, 0.0), dbeta(d, 0.0);
        for (int r = 0; r < rows; ++r) {
            double mg = 0.0, mgh = 0.0;
            for (int c = 0; c < d; ++c) {
                const size_t i = (size_t)r * d + c;
                const double h = (xv[i] - mv[r]) * rv[r], g = dyv[i] * gv[c];
                mg += g;
                mgh += g * h;
                dgamma[c] += dyv[i] * h;
                dbeta[c] += dyv[i];
            }
            mg /= d;
            mgh /= d;
            for (int c = 0; c < d; ++c) {
                const size_t i = (size_t)r * d + c;
                const double h = (xv[i] - mv[r]) * rv[r], g = dyv[i] * gv[c];
                want[i] = rv[r] * (g - mg - h * mgh);
                // g − mg − h·mgh cancels exactly when d = 1 (dx = 0): scale by rstd·|g|.
                scale[i] = std::max(std::fabs(want[i]), rv[r] * std::fabs(g));
            }
        }
        const std::string tag = fmt("layernorm_bwd %s rows=%d d=%d", type_name<T>(), rows, d);
        tally.check(tag + " dx", scaled_l2(read(dx, n), want, scale), 1e-5);
        // accumulate = 1 adds the same values into what dx holds: exactly (the residual
        // add's bits), element for element; the rounded copy is of the sum.
        {
            float* acc = buffer<float>(n);
            T* low = buffer<T>(n);
            fill_poison(low, n);
            const auto base = fill_random(acc, n, rng, -1.0f, 1.0f);
            emu::launch(dx_kernel, dim3((rows + 7) / 8), dim3(256), 0, (const float*)x,
                        (const float*)gamma, (const float*)mean, (const float*)rstd, (const T*)dy,
                        acc, low, rows, d, 1);
            bool exact = true;
            for (size_t i = 0; i < n; ++i) exact &= acc[i] == (float)base[i] + dx[i];
            tally.check_true(tag + " dx accumulated bit-exactly", exact);
            tally.check_true(tag + " dx accumulated, rounded copy", rounded_copy(low, acc, n));
        }

        for (int rpb : {64, 4}) {
            const int nb = (rows + rpb - 1) / rpb;
            float* partial = buffer<float>((size_t)nb * 2 * d);
            fill_poison(partial, (size_t)nb * 2 * d);
            emu::launch(params_kernel, dim3((d + 255) / 256, nb), dim3(256), 0, (const float*)x,
                        (const float*)mean, (const float*)rstd, (const T*)dy, partial, rows, d, rpb);
            // The gradient accumulates: start from random values.
            float* grad = buffer<float>(2 * d);
            auto base = fill_random(grad, 2 * d, rng, -1.0f, 1.0f);
            emu::launch(colsum_finish, dim3((2 * d + 255) / 256), dim3(256), 0, (const float*)partial, grad, nb, 2 * d, 1);
            std::vector<double> wantg(2 * d);
            for (int c = 0; c < d; ++c) {
                wantg[c] = base[c] + dgamma[c];
                wantg[d + c] = base[d + c] + dbeta[c];
            }
            tally.check(tag + fmt(" dgamma|dbeta rpb=%d", rpb), rel_l2(read(grad, 2 * d), wantg), 1e-5);
        }

        // The fused kernel where the vector path applies: dx bit for bit the dx kernel's
        // (plain and accumulated), the parameter gradients as above, over grids of one
        // block (every warp loops over rows), two, and one warp per row.
        if (d % 4 != 0 || d > 1024) continue;
        for (unsigned blocks : {1u, 2u, (unsigned)(rows + 7) / 8}) {
            for (int accumulate = 0; accumulate < 2; ++accumulate) {
                float* fdx = buffer<float>(n);
                std::vector<double> base(n, 0.0);
                if (accumulate)
                    base = fill_random(fdx, n, rng, -1.0f, 1.0f);
                else
                    fill_poison(fdx, n);
                float* partial = buffer<float>((size_t)blocks * 2 * d);
                fill_poison(partial, (size_t)blocks * 2 * d);
                T* low = buffer<T>(n);
                fill_poison(low, n);
                emu::launch(fused_kernel, dim3(blocks), dim3(256), (size_t)64 * d, (const float*)x,
                            (const float*)gamma, (const float*)mean, (const float*)rstd,
                            (const T*)dy, fdx, low, partial, rows, d, accumulate);
                bool same = true;
                for (size_t i = 0; i < n; ++i)
                    same &= fdx[i] == (accumulate ? (float)base[i] + dx[i] : dx[i]);
                const std::string ftag = tag + fmt(" fused blocks=%u accumulate=%d", blocks, accumulate);
                tally.check_true(ftag + " dx as the dx kernel's", same);
                tally.check_true(ftag + " rounded copy", rounded_copy(low, fdx, n));
                float* grad = buffer<float>(2 * d);
                auto gbase = fill_random(grad, 2 * d, rng, -1.0f, 1.0f);
                emu::launch(colsum_finish, dim3((2 * d + 255) / 256), dim3(256), 0, (const float*)partial, grad, (int)blocks, 2 * d, 1);
                std::vector<double> wantg(2 * d);
                for (int c = 0; c < d; ++c) {
                    wantg[c] = gbase[c] + dgamma[c];
                    wantg[d + c] = gbase[d + c] + dbeta[c];
                }
                tally.check(ftag + " dgamma|dbeta", rel_l2(read(grad, 2 * d), wantg), 1e-5);
            }
        }
    }
}

/// layernorm_fwd_add_* against layernorm_fwd_* of the host's x + h, bit for bit.
template <class T>
static void test_forward_add(
    void (*plain)(const float*, const float*, const float*, T*, float*, float*, int, int, float),
    void (*fused)(const float*, const T*, float*, const float*, const float*, T*, float*, float*,
                  int, int, float)) {
    Rng rng(33);
    const float eps = 1e-5f;
    for (const auto& sh : SHAPES) {
        const int rows = sh[0], d = sh[1];
        float* gamma = buffer<float>(d);
        float* beta = buffer<float>(d);
        fill_random(gamma, d, rng, 0.5f, 1.5f);
        fill_random(beta, d, rng, -0.5f, 0.5f);
        check_norm_add<T>(
            tally, "layernorm", rng, rows, d, 2,
            [&](unsigned grid, const float* x, T* y, float* stats) {
                emu::launch(plain, dim3(grid), dim3(256), 0, x, (const float*)gamma,
                            (const float*)beta, y, stats, stats + rows, rows, d, eps);
            },
            [&](unsigned grid, const float* x, const T* h, float* sum, T* y, float* stats) {
                emu::launch(fused, dim3(grid), dim3(256), 0, x, h, sum, (const float*)gamma,
                            (const float*)beta, y, stats, stats + rows, rows, d, eps);
            });
    }
}

int main() {
    test_forward_add<float>(layernorm_fwd_f32, layernorm_fwd_add_f32);
    test_forward_add<bf16>(layernorm_fwd_bf16, layernorm_fwd_add_bf16);
    test_forward_add<f16>(layernorm_fwd_f16, layernorm_fwd_add_f16);
    test_forward<float>(layernorm_fwd_f32);
    test_forward<bf16>(layernorm_fwd_bf16);
    test_forward<f16>(layernorm_fwd_f16);
    test_backward<float>(layernorm_bwd_dx_f32, layernorm_bwd_params_f32, layernorm_bwd_fused_f32);
    test_backward<bf16>(layernorm_bwd_dx_bf16, layernorm_bwd_params_bf16, layernorm_bwd_fused_bf16);
    test_backward<f16>(layernorm_bwd_dx_f16, layernorm_bwd_params_f16, layernorm_bwd_fused_f16);
    return tally.finish("layernorm");
}
