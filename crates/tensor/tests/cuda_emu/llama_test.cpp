// Tests of llama.cu on the CPU emulator against double-precision definitions: RMS norm
// (forward, input gradient, weight gradient through colsum_finish), rotary positions with
// grouped-query heads (forward, backward; groups of 1, 2 and 3 query heads per key/value
// head), SwiGLU (forward, backward), Qwen3's q/k heads out of grouped rows and back;
// vector and scalar paths, odd shapes, several rows, a
// one-block grid (grid-stride). Also embedding.cu's token-only forward (a null position
// table), which Llama's embedding uses.
#include "cuda_emu.h"
#include "common.cuh"
#include "bias.cu"  // colsum_finish, stage 2 of the weight gradient
#include "embedding.cu"
#include "llama.cu"
#include "kernel_test_util.h"

using namespace kt;

static Tally tally;

// ---------------------------------------------------------------------------------------
// RMS norm.

// (rows, d): vector path (d % 4 == 0, d ≤ 1024), scalar path (d % 4 != 0 or d > 1024),
// rows not a multiple of 8, a single row.
static const int NORM_SHAPES[][2] = {{1, 1}, {3, 5}, {9, 64}, {13, 96}, {8, 1024}, {17, 36},
                                     {3, 1100}, {10, 30}, {5, 7}, {1, 768}, {11, 132}};

static std::vector<double> ref_rstd(const std::vector<double>& x, int rows, int d, double eps) {
    std::vector<double> rs(rows);
    for (int r = 0; r < rows; ++r) {
        double q = 0.0;
        for (int c = 0; c < d; ++c) q += x[(size_t)r * d + c] * x[(size_t)r * d + c];
        rs[r] = 1.0 / std::sqrt(q / d + eps);
    }
    return rs;
}

template <class T>
static void test_rms_forward(void (*fwd)(const float*, const float*, T*, float*, int, int, float)) {
    Rng rng(41);
    const float eps = 1e-5f;
    for (const auto& sh : NORM_SHAPES) {
        const int rows = sh[0], d = sh[1];
        const size_t n = (size_t)rows * d;
        // off = 1: a view one float past an aligned start (the scalar path at any d).
        for (int off = 0; off < 2; ++off) {
            for (int with_stats = 0; with_stats < 2; ++with_stats) {
                float* x = buffer<float>(n + off) + off;
                float* w = buffer<float>(d);
                T* y = buffer<T>(n);
                // Not centred: the RMS is not the standard deviation.
                const auto xv = fill_random(x, n, rng, -1.0f, 3.0f);
                const auto wv = fill_random(w, d, rng, 0.5f, 1.5f);
                fill_poison(y, n);
                float* rstd = with_stats ? buffer<float>(rows) : nullptr;
                if (with_stats) fill_poison(rstd, rows);
                const unsigned grid = with_stats ? (rows + 7) / 8 : 1;  // 1 block: grid-stride
                emu::launch(fwd, dim3(grid), dim3(256), 0, (const float*)x, (const float*)w, y,
                            rstd, rows, d, eps);
                const auto rs = ref_rstd(xv, rows, d, eps);
                std::vector<double> want(n);
                for (int r = 0; r < rows; ++r)
                    for (int c = 0; c < d; ++c)
                        want[(size_t)r * d + c] = xv[(size_t)r * d + c] * rs[r] * wv[c];
                const std::string tag = fmt("rmsnorm_fwd_%s rows=%d d=%d off=%d stats=%d",
                                            type_name<T>(), rows, d, off, with_stats);
                tally.check(tag + " y", rel_l2(read(y, n), want), tol<T>());
                if (with_stats) tally.check(tag + " rstd", rel_l2(read(rstd, rows), rs), 1e-6);
            }
        }
    }
}

template <class T>
static void test_rms_backward(void (*dx_kernel)(const float*, const float*, const float*, const T*, float*, T*, int, int, int),
                              void (*params_kernel)(const float*, const float*, const T*, float*, int, int, int),
                              void (*fused_kernel)(const float*, const float*, const float*, const T*, float*, T*, float*, int, int, int)) {
    Rng rng(42);
    const double eps = 1e-5;
    for (const auto& sh : NORM_SHAPES) {
        const int rows = sh[0], d = sh[1];
        const size_t n = (size_t)rows * d;
        for (int off = 0; off < 2; ++off) {
            float* x = buffer<float>(n + off) + off;
            float* w = buffer<float>(d);
            float* rstd = buffer<float>(rows);
            T* dy = buffer<T>(n);
            float* dx = buffer<float>(n);
            const auto xv = fill_random(x, n, rng, -2.0f, 3.0f);
            const auto wv = fill_random(w, d, rng, 0.5f, 1.5f);
            const auto dyv = fill_random(dy, n, rng, -1.0f, 1.0f);
            // rstd as the forward stores it (f32); the reference uses the same values.
            const auto rs0 = ref_rstd(xv, rows, d, eps);
            std::vector<double> rv(rows);
            for (int r = 0; r < rows; ++r) rv[r] = rstd[r] = (float)rs0[r];
            fill_poison(dx, n);
            const unsigned grid = off ? 1 : (rows + 7) / 8;
            emu::launch(dx_kernel, dim3(grid), dim3(256), 0, (const float*)x, (const float*)w,
                        (const float*)rstd, (const T*)dy, dx, (T*)nullptr, rows, d, 0);
            std::vector<double> want(n), scale(n), dw(d, 0.0);
            for (int r = 0; r < rows; ++r) {
                double mgh = 0.0;
                for (int c = 0; c < d; ++c) {
                    const size_t i = (size_t)r * d + c;
                    const double h = xv[i] * rv[r], g = dyv[i] * wv[c];
                    mgh += g * h;
                    dw[c] += dyv[i] * h;
                }
                mgh /= d;
                for (int c = 0; c < d; ++c) {
                    const size_t i = (size_t)r * d + c;
                    const double h = xv[i] * rv[r], g = dyv[i] * wv[c];
                    want[i] = rv[r] * (g - h * mgh);
                    // g − h·mgh cancels exactly when d = 1 (dx ≈ 0 up to eps): scale by rstd·|g|.
                    scale[i] = std::max(std::fabs(want[i]), rv[r] * std::fabs(g));
                }
            }
            const std::string tag = fmt("rmsnorm_bwd %s rows=%d d=%d off=%d", type_name<T>(), rows, d, off);
            tally.check(tag + " dx", scaled_l2(read(dx, n), want, scale), 1e-5);
            {
                float* acc = buffer<float>(n);
                T* low = buffer<T>(n);
                fill_poison(low, n);
                const auto base = fill_random(acc, n, rng, -1.0f, 1.0f);
                emu::launch(dx_kernel, dim3(grid), dim3(256), 0, (const float*)x, (const float*)w,
                            (const float*)rstd, (const T*)dy, acc, low, rows, d, 1);
                bool exact = true;
                for (size_t i = 0; i < n; ++i) exact &= acc[i] == (float)base[i] + dx[i];
                tally.check_true(tag + " dx accumulated bit-exactly", exact);
                tally.check_true(tag + " dx accumulated, rounded copy", rounded_copy(low, acc, n));
            }

            for (int rpb : {64, 4}) {
                const int nb = (rows + rpb - 1) / rpb;
                float* partial = buffer<float>((size_t)nb * d);
                fill_poison(partial, (size_t)nb * d);
                emu::launch(params_kernel, dim3((d + 255) / 256, nb), dim3(256), 0, (const float*)x,
                            (const float*)rstd, (const T*)dy, partial, rows, d, rpb);
                // The gradient accumulates: start from random values.
                float* grad = buffer<float>(d);
                auto base = fill_random(grad, d, rng, -1.0f, 1.0f);
                emu::launch(colsum_finish, dim3((d + 255) / 256), dim3(256), 0, (const float*)partial,
                            grad, nb, d, 1);
                std::vector<double> wantg(d);
                for (int c = 0; c < d; ++c) wantg[c] = base[c] + dw[c];
                tally.check(tag + fmt(" dweight rpb=%d", rpb), rel_l2(read(grad, d), wantg), 1e-5);
            }

            // The fused kernel where its vector path applies (aligned, d % 4 == 0, d ≤ 1024):
            // dx bit for bit the dx kernel's (plain and accumulated), the weight gradient as
            // above, over grids of one block (every warp loops over rows), two, and a warp a row.
            if (off || d % 4 != 0 || d > 1024) continue;
            for (unsigned blocks : {1u, 2u, (unsigned)(rows + 7) / 8}) {
                for (int accumulate = 0; accumulate < 2; ++accumulate) {
                    float* fdx = buffer<float>(n);
                    std::vector<double> base(n, 0.0);
                    if (accumulate)
                        base = fill_random(fdx, n, rng, -1.0f, 1.0f);
                    else
                        fill_poison(fdx, n);
                    float* partial = buffer<float>((size_t)blocks * d);
                    fill_poison(partial, (size_t)blocks * d);
                    T* low = buffer<T>(n);
                    fill_poison(low, n);
                    emu::launch(fused_kernel, dim3(blocks), dim3(256), (size_t)32 * d, (const float*)x,
                                (const float*)w, (const float*)rstd, (const T*)dy, fdx, low, partial,
                                rows, d, accumulate);
                    bool same = true;
                    for (size_t i = 0; i < n; ++i)
                        same &= fdx[i] == (accumulate ? (float)base[i] + dx[i] : dx[i]);
                    const std::string ftag = tag + fmt(" fused blocks=%u accumulate=%d", blocks, accumulate);
                    tally.check_true(ftag + " dx as the dx kernel's", same);
                    tally.check_true(ftag + " rounded copy", rounded_copy(low, fdx, n));
                    float* grad = buffer<float>(d);
                    auto gbase = fill_random(grad, d, rng, -1.0f, 1.0f);
                    emu::launch(colsum_finish, dim3((d + 255) / 256), dim3(256), 0, (const float*)partial,
                                grad, (int)blocks, d, 1);
                    std::vector<double> wantg(d);
                    for (int c = 0; c < d; ++c) wantg[c] = gbase[c] + dw[c];
                    tally.check(ftag + " dweight", rel_l2(read(grad, d), wantg), 1e-5);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Rotary + grouped-query heads.

struct RotShape {
    int batch, seq, heads, kv_heads, hd;
};

// Groups of 1, 2 and 3 query heads per key/value head; head sizes with hd/2 a multiple of
// 8 (vector path for every dtype), of 4 only (vector for f32, scalar for 16-bit), and odd
// (scalar); one token; several rows.
static const RotShape ROT_SHAPES[] = {
    {1, 1, 1, 1, 2},  {2, 5, 6, 2, 8},  {1, 7, 4, 2, 6},   {3, 4, 3, 3, 16}, {2, 3, 6, 2, 64},
    {1, 9, 2, 1, 16}, {2, 3, 3, 1, 10}, {1, 6, 4, 4, 32},  {2, 2, 6, 3, 24},
};

/// The host's rotary_tables (rotary.rs): f32 inverse frequencies times f32 positions, the
/// angle's cosine and sine rounded to f32.
static void tables(const std::vector<int>& pos, int hd, double theta, float* c, float* s) {
    const int half = hd / 2;
    for (size_t t = 0; t < pos.size(); ++t)
        for (int i = 0; i < half; ++i) {
            const float inv = (float)(1.0 / std::pow(theta, (double)(2 * i) / hd));
            const double angle = (double)((float)pos[t] * inv);
            c[t * half + i] = (float)std::cos(angle);
            s[t * half + i] = (float)std::sin(angle);
        }
}

template <class T>
static void test_rotary(void (*fwd)(const T*, const float*, const float*, T*, int, int, int, int, int),
                        void (*bwd)(const T*, const float*, const float*, T*, int, int, int, int, int)) {
    Rng rng(43);
    for (const auto& sh : ROT_SHAPES) {
        const int rows = sh.batch * sh.seq, hd = sh.hd, half = hd / 2;
        const int H = sh.heads, K = sh.kv_heads, g = H / K;
        const int win = (H + 2 * K) * hd, wout = 3 * H * hd;
        const size_t nin = (size_t)rows * win, nout = (size_t)rows * wout;
        // Positions of a context-parallel shard: not 0, 1, 2, …
        std::vector<int> pos(sh.seq);
        for (int t = 0; t < sh.seq; ++t) pos[t] = 3 * t + 1;
        float* c = buffer<float>((size_t)sh.seq * half);
        float* s = buffer<float>((size_t)sh.seq * half);
        tables(pos, hd, 10000.0, c, s);
        // off = 1: views one element past an aligned start (the scalar path).
        for (int off = 0; off < 2; ++off) {
            for (int small_grid = 0; small_grid < 2; ++small_grid) {
                const std::string tag = fmt("rotary %s b=%d t=%d h=%d kv=%d hd=%d off=%d grid=%s",
                                            type_name<T>(), sh.batch, sh.seq, H, K, hd, off,
                                            small_grid ? "1" : "full");
                // Forward.
                T* x = buffer<T>(nin + off) + off;
                T* y = buffer<T>(nout + off) + off;
                const auto xv = fill_random(x, nin, rng, -1.0f, 1.0f);
                fill_poison(y, nout);
                const long long units = (long long)rows * 3 * H * half;
                emu::launch(fwd, dim3(small_grid ? 1 : grid_for(units)), dim3(256), 0, (const T*)x,
                            (const float*)c, (const float*)s, y, rows, sh.seq, H, K, hd);
                std::vector<double> want(nout), got = read(y, nout);
                double v_err = 0.0;
                for (int r = 0; r < rows; ++r) {
                    const int t = r % sh.seq;
                    for (int head = 0; head < H; ++head) {
                        const int j = head / g, m = head % g;
                        const int src[3] = {j * (g + 2) + m, j * (g + 2) + g, j * (g + 2) + g + 1};
                        for (int part = 0; part < 3; ++part) {
                            const double* in = &xv[(size_t)r * win + (size_t)src[part] * hd];
                            const size_t o = (size_t)r * wout + (size_t)(part * H + head) * hd;
                            for (int i = 0; i < half; ++i) {
                                if (part == 2) {
                                    want[o + i] = in[i];
                                    want[o + half + i] = in[half + i];
                                    v_err += std::fabs(got[o + i] - in[i]) + std::fabs(got[o + half + i] - in[half + i]);
                                    continue;
                                }
                                const double cc = c[t * half + i], ss = s[t * half + i];
                                want[o + i] = in[i] * cc - in[half + i] * ss;
                                want[o + half + i] = in[half + i] * cc + in[i] * ss;
                            }
                        }
                    }
                }
                tally.check(tag + " fwd", rel_l2(got, want), tol<T>());
                tally.check(tag + " fwd v copied exactly", v_err, 0.0);

                // Backward: the transpose.
                T* dy = buffer<T>(nout + off) + off;
                T* dx = buffer<T>(nin + off) + off;
                const auto dyv = fill_random(dy, nout, rng, -1.0f, 1.0f);
                fill_poison(dx, nin);
                const long long bunits = (long long)rows * (H + 2 * K) * half;
                emu::launch(bwd, dim3(small_grid ? 1 : grid_for(bunits)), dim3(256), 0, (const T*)dy,
                            (const float*)c, (const float*)s, dx, rows, sh.seq, H, K, hd);
                std::vector<double> wantb(nin, 0.0);
                for (int r = 0; r < rows; ++r) {
                    const int t = r % sh.seq;
                    for (int head = 0; head < H; ++head) {
                        const int j = head / g, m = head % g;
                        const int dst[3] = {j * (g + 2) + m, j * (g + 2) + g, j * (g + 2) + g + 1};
                        for (int part = 0; part < 3; ++part) {
                            const double* gy = &dyv[(size_t)r * wout + (size_t)(part * H + head) * hd];
                            double* o = &wantb[(size_t)r * win + (size_t)dst[part] * hd];
                            for (int i = 0; i < half; ++i) {
                                if (part == 2) {
                                    o[i] += gy[i];
                                    o[half + i] += gy[half + i];
                                    continue;
                                }
                                const double cc = c[t * half + i], ss = s[t * half + i];
                                o[i] += gy[i] * cc + gy[half + i] * ss;
                                o[half + i] += gy[half + i] * cc - gy[i] * ss;
                            }
                        }
                    }
                }
                tally.check(tag + " bwd", rel_l2(read(dx, nin), wantb), tol<T>());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// SwiGLU.

// (rows, half): multiples of 8 (vector path for every dtype), of 4 only (f32 vector path),
// odd, tiny.
static const int GLU_SHAPES[][2] = {{1, 1}, {3, 5}, {4, 8}, {7, 16}, {2, 12}, {5, 64}, {3, 100}, {9, 3}};

template <class T>
static void test_swiglu(void (*fwd)(const T*, T*, int, int), void (*bwd)(const T*, const T*, T*, int, int)) {
    Rng rng(44);
    for (const auto& sh : GLU_SHAPES) {
        const int rows = sh[0], half = sh[1];
        const size_t nx = (size_t)rows * 2 * half, ny = (size_t)rows * half;
        for (int off = 0; off < 2; ++off) {
            for (int small_grid = 0; small_grid < 2; ++small_grid) {
                const std::string tag = fmt("swiglu %s rows=%d half=%d off=%d grid=%s", type_name<T>(),
                                            rows, half, off, small_grid ? "1" : "full");
                T* x = buffer<T>(nx + off) + off;
                T* y = buffer<T>(ny + off) + off;
                T* dy = buffer<T>(ny + off) + off;
                T* dx = buffer<T>(nx + off) + off;
                // Gates wide enough to reach σ's tails.
                const auto xv = fill_random(x, nx, rng, -8.0f, 8.0f);
                const auto dyv = fill_random(dy, ny, rng, -1.0f, 1.0f);
                fill_poison(y, ny);
                fill_poison(dx, nx);
                const unsigned grid = small_grid ? 1 : grid_for((long long)ny);
                emu::launch(fwd, dim3(grid), dim3(256), 0, (const T*)x, y, rows, half);
                emu::launch(bwd, dim3(grid), dim3(256), 0, (const T*)x, (const T*)dy, dx, rows, half);
                std::vector<double> want(ny), wantb(nx);
                for (int r = 0; r < rows; ++r)
                    for (int i = 0; i < half; ++i) {
                        const double a = xv[(size_t)r * 2 * half + i], b = xv[(size_t)r * 2 * half + half + i];
                        const double sg = 1.0 / (1.0 + std::exp(-a)), gy = dyv[(size_t)r * half + i];
                        want[(size_t)r * half + i] = a * sg * b;
                        wantb[(size_t)r * 2 * half + i] = gy * b * sg * (1.0 + a * (1.0 - sg));
                        wantb[(size_t)r * 2 * half + half + i] = gy * a * sg;
                    }
                tally.check(tag + " fwd", rel_l2(read(y, ny), want), tol<T>());
                tally.check(tag + " bwd", rel_l2(read(dx, nx), wantb), tol<T>());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The token-only embedding (no position table).

static void test_embedding_without_positions() {
    Rng rng(45);
    const int dims[] = {8, 7, 1, 64};
    for (int d : dims) {
        for (int small_grid = 0; small_grid < 2; ++small_grid) {
            const int vocab = 11, tokens = 13;
            float* wte = buffer<float>((size_t)vocab * d);
            const auto tev = fill_random(wte, (size_t)vocab * d, rng, -1.0f, 1.0f);
            int* ids = buffer<int>(tokens);
            std::vector<int> idv(tokens);
            for (int i = 0; i < tokens; ++i) ids[i] = idv[i] = rng.below(vocab);
            float* y = buffer<float>((size_t)tokens * d);
            fill_poison(y, (size_t)tokens * d);
            // seq = 1 and pos_of null: neither is read without a table.
            emu::launch(embedding_fwd, dim3(small_grid ? 1 : grid_for((long long)tokens * d)), dim3(256), 0,
                        (const int*)ids, (const float*)wte, (const float*)nullptr, (const int*)nullptr, y,
                        tokens, 1, d);
            std::vector<double> want((size_t)tokens * d);
            for (int i = 0; i < tokens; ++i)
                for (int c = 0; c < d; ++c) want[(size_t)i * d + c] = tev[(size_t)idv[i] * d + c];
            tally.check(fmt("embedding_fwd no positions d=%d grid=%s", d, small_grid ? "1" : "full"),
                        rel_l2(read(y, (size_t)tokens * d), want), 0.0);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Qwen3's q/k heads moved out of grouped rows and back: the query heads of each group, then
// its key head, in row then head order; value heads untouched by the scatter.

static void test_qk_heads() {
    Rng rng(47);
    for (const auto& sh : ROT_SHAPES) {
        const int rows = sh.batch * sh.seq, hd = sh.hd;
        const int H = sh.heads, K = sh.kv_heads, g = H / K;
        const int width = (H + 2 * K) * hd;
        const size_t n = (size_t)rows * width, nq = (size_t)rows * H * hd, nk = (size_t)rows * K * hd;
        for (int small_grid = 0; small_grid < 2; ++small_grid) {
            const std::string tag = fmt("qk_heads b=%d t=%d h=%d kv=%d hd=%d grid=%s", sh.batch,
                                        sh.seq, H, K, hd, small_grid ? "1" : "full");
            float* x = buffer<float>(n);
            float* q = buffer<float>(nq);
            float* k = buffer<float>(nk);
            const auto xv = fill_random(x, n, rng, -1.0f, 1.0f);
            fill_poison(q, nq);
            fill_poison(k, nk);
            const unsigned grid = small_grid ? 1 : grid_for((long long)(nq + nk));
            emu::launch(qk_heads_f32, dim3(grid), dim3(256), 0, x, q, k, rows, H, K, hd, 0);
            std::vector<double> wq(nq), wk(nk);
            for (int r = 0; r < rows; ++r)
                for (int j = 0; j < K; ++j) {
                    const size_t base = (size_t)r * width + (size_t)j * (g + 2) * hd;
                    for (int m = 0; m < g; ++m)
                        for (int c = 0; c < hd; ++c)
                            wq[((size_t)r * H + j * g + m) * hd + c] = xv[base + (size_t)m * hd + c];
                    for (int c = 0; c < hd; ++c)
                        wk[((size_t)r * K + j) * hd + c] = xv[base + (size_t)g * hd + c];
                }
            tally.check(tag + " gather q", rel_l2(read(q, nq), wq), 0.0);
            tally.check(tag + " gather k", rel_l2(read(k, nk), wk), 0.0);
            // Scatter new heads back: q and k replaced, v as it was.
            const auto qv = fill_random(q, nq, rng, 2.0f, 3.0f);
            const auto kv = fill_random(k, nk, rng, 4.0f, 5.0f);
            emu::launch(qk_heads_f32, dim3(grid), dim3(256), 0, x, q, k, rows, H, K, hd, 1);
            std::vector<double> want = xv;
            for (int r = 0; r < rows; ++r)
                for (int j = 0; j < K; ++j) {
                    const size_t base = (size_t)r * width + (size_t)j * (g + 2) * hd;
                    for (int m = 0; m < g; ++m)
                        for (int c = 0; c < hd; ++c)
                            want[base + (size_t)m * hd + c] = qv[((size_t)r * H + j * g + m) * hd + c];
                    for (int c = 0; c < hd; ++c)
                        want[base + (size_t)g * hd + c] = kv[((size_t)r * K + j) * hd + c];
                }
            tally.check(tag + " scatter", rel_l2(read(x, n), want), 0.0);
        }
    }
}

/// rmsnorm_fwd_add_* against rmsnorm_fwd_* of the host's x + h, bit for bit.
template <class T>
static void test_rms_forward_add(
    void (*plain)(const float*, const float*, T*, float*, int, int, float),
    void (*fused)(const float*, const T*, float*, const float*, T*, float*, int, int, float)) {
    Rng rng(48);
    const float eps = 1e-5f;
    for (const auto& sh : NORM_SHAPES) {
        const int rows = sh[0], d = sh[1];
        float* w = buffer<float>(d);
        fill_random(w, d, rng, 0.5f, 1.5f);
        check_norm_add<T>(
            tally, "rmsnorm", rng, rows, d, 1,
            [&](unsigned grid, const float* x, T* y, float* stats) {
                emu::launch(plain, dim3(grid), dim3(256), 0, x, (const float*)w, y, stats, rows,
                            d, eps);
            },
            [&](unsigned grid, const float* x, const T* h, float* sum, T* y, float* stats) {
                emu::launch(fused, dim3(grid), dim3(256), 0, x, h, sum, (const float*)w, y,
                            stats, rows, d, eps);
            });
    }
}

int main() {
    test_rms_forward_add<float>(rmsnorm_fwd_f32, rmsnorm_fwd_add_f32);
    test_rms_forward_add<bf16>(rmsnorm_fwd_bf16, rmsnorm_fwd_add_bf16);
    test_rms_forward_add<f16>(rmsnorm_fwd_f16, rmsnorm_fwd_add_f16);
    test_rms_forward<float>(rmsnorm_fwd_f32);
    test_rms_forward<bf16>(rmsnorm_fwd_bf16);
    test_rms_forward<f16>(rmsnorm_fwd_f16);
    test_rms_backward<float>(rmsnorm_bwd_dx_f32, rmsnorm_bwd_params_f32, rmsnorm_bwd_fused_f32);
    test_rms_backward<bf16>(rmsnorm_bwd_dx_bf16, rmsnorm_bwd_params_bf16, rmsnorm_bwd_fused_bf16);
    test_rms_backward<f16>(rmsnorm_bwd_dx_f16, rmsnorm_bwd_params_f16, rmsnorm_bwd_fused_f16);
    test_rotary<float>(rotary_fwd_f32, rotary_bwd_f32);
    test_rotary<bf16>(rotary_fwd_bf16, rotary_bwd_bf16);
    test_rotary<f16>(rotary_fwd_f16, rotary_bwd_f16);
    test_swiglu<float>(swiglu_fwd_f32, swiglu_bwd_f32);
    test_swiglu<bf16>(swiglu_fwd_bf16, swiglu_bwd_bf16);
    test_swiglu<f16>(swiglu_fwd_f16, swiglu_bwd_f16);
    test_embedding_without_positions();
    test_qk_heads();
    return tally.finish("llama");
}
