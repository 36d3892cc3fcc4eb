// Tests of optimizer.cu on the CPU emulator: AdamW and SGD against double-precision updates
// with parameter groups (segments), the clipping multiplier and the 16-bit copy, and the
// fixed-order gradient norm.
#include "cuda_emu.h"
#include "common.cuh"
#include "optimizer.cu"
#include "kernel_test_util.h"

using namespace kt;

static Tally tally;

struct Segments {
    long long* end;
    float* wd;
    float* lr_scale;
    int count;
    std::vector<long long> endv;
    std::vector<double> wdv, lrv;
    int of(long long i) const {
        int s = 0;
        while (endv[s] <= i) ++s;
        return s;
    }
};

/// Segments over n: some empty, some shorter than a float4 chunk, the last ending at n.
static Segments make_segments(long long n, Rng& rng) {
    std::vector<long long> ends;
    if (n > 10) {
        ends = {0, 3, 3, n / 3, n / 3 + 1, n / 2, n};
    } else {
        ends = {n / 2, n};
    }
    Segments s;
    s.count = (int)ends.size();
    s.end = buffer<long long>(ends.size());
    s.wd = buffer<float>(ends.size());
    s.lr_scale = buffer<float>(ends.size());
    for (size_t k = 0; k < ends.size(); ++k) {
        s.end[k] = ends[k];
        s.wd[k] = k % 2 ? 0.0f : rng.range(0.01f, 0.2f);
        s.lr_scale[k] = rng.range(0.5f, 2.0f);
        s.endv.push_back(ends[k]);
        s.wdv.push_back(s.wd[k]);
        s.lrv.push_back(s.lr_scale[k]);
    }
    return s;
}

static const long long SIZES[] = {1, 3, 5, 64, 1001};

template <class H>
static void test_adamw(void (*kernel)(float*, const float*, float*, float*, H*, long long, const long long*,
                                      const float*, const float*, int, const float*, float, float, float,
                                      const float*),
                       const char* name, bool has_half) {
    Rng rng(61);
    for (long long n : SIZES) {
        for (int off = 0; off < 2; ++off) {  // 1: views off 16-byte alignment, the scalar path
            for (int clip = 0; clip < 2; ++clip) {
                const Segments seg = make_segments(n, rng);
                float* p = buffer<float>(n + 1) + off;
                float* g = buffer<float>(n + 1) + off;
                float* m = buffer<float>(n + 1) + off;
                float* v = buffer<float>(n + 1) + off;
                H* half = has_half ? buffer<H>(n + 1) + off : nullptr;
                auto pv = fill_random(p, n, rng, -1.0f, 1.0f);
                const auto gv = fill_random(g, n, rng, -0.1f, 0.1f);
                auto mv = fill_random(m, n, rng, -0.01f, 0.01f);
                auto vv = fill_random(v, n, rng, 0.0f, 1e-3f);
                if (has_half) fill_poison(half, n);
                float* mul = nullptr;
                if (clip) {
                    mul = buffer<float>(1);
                    *mul = 0.625f;
                }
                const float lr = 3e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f;
                const int t = 7;
                const float c1 = 1.0f - std::pow(b1, (float)t), inv_sqrt_c2 = 1.0f / std::sqrt(1.0f - std::pow(b2, (float)t));
                const unsigned grid = clip ? 1 : grid_for(n);
                float* schedule = buffer<float>(3);
                schedule[0] = lr;
                schedule[1] = c1;
                schedule[2] = inv_sqrt_c2;
                emu::launch(kernel, dim3(grid), dim3(256), 0, p, (const float*)g, m, v, half, n,
                            (const long long*)seg.end, (const float*)seg.wd, (const float*)seg.lr_scale, seg.count,
                            (const float*)schedule, b1, b2, eps, (const float*)mul);
                for (long long i = 0; i < n; ++i) {
                    const int s = seg.of(i);
                    const double lrs = (double)lr * seg.lrv[s], gi = gv[i] * (clip ? 0.625 : 1.0);
                    pv[i] *= 1.0 - lrs * seg.wdv[s];
                    mv[i] = b1 * mv[i] + (1.0 - b1) * gi;
                    vv[i] = b2 * vv[i] + (1.0 - b2) * gi * gi;
                    pv[i] -= (lrs / c1) * mv[i] / (std::sqrt(vv[i]) * inv_sqrt_c2 + eps);
                }
                const std::string tag = fmt("%s n=%lld off=%d clip=%d", name, n, off, clip);
                tally.check(tag + " p", rel_l2(read(p, n), pv), 1e-5);
                tally.check(tag + " m", rel_l2(read(m, n), mv), 1e-5);
                tally.check(tag + " v", rel_l2(read(v, n), vv), 1e-5);
                if (has_half) {
                    // Exactly the updated f32 parameter, rounded.
                    std::vector<double> want(n);
                    for (long long i = 0; i < n; ++i) want[i] = to_f32(from_f32<H>(p[i]));
                    tally.check(tag + " p_half", rel_l2(read(half, n), want), 0.0);
                }
            }
        }
    }
}

template <class H>
static void test_sgd(void (*kernel)(float*, const float*, float*, H*, long long, const long long*, const float*,
                                    const float*, int, const float*, float, const float*),
                     const char* name, bool has_half) {
    Rng rng(62);
    for (long long n : SIZES) {
        for (int off = 0; off < 2; ++off) {
            for (int mode = 0; mode < 3; ++mode) {  // 0: momentum, 1: first step, 2: momentum 0 + clip
                const Segments seg = make_segments(n, rng);
                float* p = buffer<float>(n + 1) + off;
                float* g = buffer<float>(n + 1) + off;
                float* m = buffer<float>(n + 1) + off;
                H* half = has_half ? buffer<H>(n + 1) + off : nullptr;
                auto pv = fill_random(p, n, rng, -1.0f, 1.0f);
                const auto gv = fill_random(g, n, rng, -0.1f, 0.1f);
                auto mv = fill_random(m, n, rng, -0.1f, 0.1f);
                if (has_half) fill_poison(half, n);
                float* mul = nullptr;
                if (mode == 2) {
                    mul = buffer<float>(1);
                    *mul = 0.5f;
                }
                const float lr = 0.05f, momentum = mode == 2 ? 0.0f : 0.9f;
                const int first = mode == 1;
                float* schedule = buffer<float>(2);
                schedule[0] = lr;
                schedule[1] = (float)first;
                emu::launch(kernel, dim3(mode == 0 ? 1 : grid_for(n)), dim3(256), 0, p, (const float*)g, m, half, n,
                            (const long long*)seg.end, (const float*)seg.wd, (const float*)seg.lr_scale, seg.count,
                            (const float*)schedule, momentum, (const float*)mul);
                for (long long i = 0; i < n; ++i) {
                    const int s = seg.of(i);
                    const double gi = gv[i] * (mul ? 0.5 : 1.0) + seg.wdv[s] * pv[i];
                    mv[i] = (first || momentum == 0.0f) ? gi : momentum * mv[i] + gi;
                    pv[i] -= (double)lr * seg.lrv[s] * mv[i];
                }
                const std::string tag = fmt("%s n=%lld off=%d mode=%d", name, n, off, mode);
                tally.check(tag + " p", rel_l2(read(p, n), pv), 1e-5);
                tally.check(tag + " m", rel_l2(read(m, n), mv), 1e-5);
                if (has_half) {
                    std::vector<double> want(n);
                    for (long long i = 0; i < n; ++i) want[i] = to_f32(from_f32<H>(p[i]));
                    tally.check(tag + " p_half", rel_l2(read(half, n), want), 0.0);
                }
            }
        }
    }
}

static void test_norm() {
    Rng rng(63);
    // Two ranges of one buffer at unaligned offsets into consecutive partial slots, as
    // train_ops.rs grad_norm does; then norm_finish with and without clipping.
    const long long total = 3000;
    float* grads = buffer<float>(total);
    const auto gv = fill_random(grads, total, rng, -0.5f, 0.5f);
    const int blocks = 3;
    const long long ranges[][2] = {{1, 1030}, {1035, 2999}, {2999, 3000}};
    double* partial = buffer<double>(3 * blocks);
    for (int i = 0; i < 3 * blocks; ++i) partial[i] = NAN;
    double want = 0.0;
    for (int k = 0; k < 3; ++k) {
        const long long a = ranges[k][0], b = ranges[k][1];
        emu::launch(sumsq_partial, dim3(blocks), dim3(256), 0, (const float*)(grads + a), b - a, partial + k * blocks);
        double range_sum = 0.0, got = 0.0;
        for (long long i = a; i < b; ++i) range_sum += gv[i] * gv[i];
        for (int j = 0; j < blocks; ++j) got += partial[k * blocks + j];
        tally.check(fmt("sumsq_partial range %lld..%lld", a, b), std::fabs(got - range_sum) / range_sum, 1e-13);
        want += range_sum;
    }
    const double norm = std::sqrt(want);
    for (int mode = 0; mode < 3; ++mode) {
        const float max_norm = mode == 0 ? 0.0f : mode == 1 ? (float)(norm * 2) : (float)(norm / 3);
        float* out = buffer<float>(2);
        out[0] = out[1] = NAN;
        double* total_out = buffer<double>(1);
        *total_out = NAN;
        emu::launch(norm_finish, dim3(1), dim3(256), 0, (const double*)partial, 3 * blocks, max_norm, out,
                    total_out);
        tally.check(fmt("norm_finish mode=%d sum of squares", mode), std::fabs(*total_out - want) / want, 1e-13);
        const double factor = mode == 2 ? max_norm / ((float)norm + 1e-6f) : 1.0;
        tally.check(fmt("norm_finish mode=%d norm", mode), std::fabs(out[0] - norm) / norm, 1e-7);
        tally.check(fmt("norm_finish mode=%d factor", mode), std::fabs(out[1] - factor) / factor, 1e-6);
    }
    // Many partials (more than threads), and an all-zero gradient: norm 0, factor 1.
    const int many = 1000;
    double* p2 = buffer<double>(many);
    double w2 = 0.0;
    for (int i = 0; i < many; ++i) w2 += (p2[i] = rng.uniform());
    float* out = buffer<float>(2);
    emu::launch(norm_finish, dim3(1), dim3(256), 0, (const double*)p2, many, 1.0f, out, (double*)nullptr);
    tally.check("norm_finish 1000 partials norm", std::fabs(out[0] - std::sqrt(w2)) / std::sqrt(w2), 1e-7);
    tally.check("norm_finish 1000 partials factor", std::fabs(out[1] - 1.0f / ((float)std::sqrt(w2) + 1e-6f)), 1e-7);
    float* zeros = buffer<float>(10);
    for (int i = 0; i < 10; ++i) zeros[i] = 0.0f;
    emu::launch(sumsq_partial, dim3(2), dim3(256), 0, (const float*)zeros, 10LL, p2);
    emu::launch(norm_finish, dim3(1), dim3(256), 0, (const double*)p2, 2, 1.0f, out, (double*)nullptr);
    tally.check_true("norm of zeros", out[0] == 0.0f && out[1] == 1.0f);
}

int main() {
    test_adamw<float>(adamw_none, "adamw_none", false);
    test_adamw<bf16>(adamw_bf16, "adamw_bf16", true);
    test_adamw<f16>(adamw_f16, "adamw_f16", true);
    test_sgd<float>(sgd_none, "sgd_none", false);
    test_sgd<bf16>(sgd_bf16, "sgd_bf16", true);
    test_sgd<f16>(sgd_f16, "sgd_f16", true);
    test_norm();
    return tally.finish("optimizer");
}
