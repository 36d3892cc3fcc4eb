// attention.cu on the CPU emulator: the tensor-core kernels (mma.sync fragments) in bf16 and f16 and the
// exact f32 kernels, forward and backward, against a double-precision definition of causal
// attention, on ragged sequence lengths (a last partial 64-row tile) and every head size.
#include "cuda_emu.h"
#include "../../src/cuda/kernels/common.cuh"
#include "../../src/cuda/kernels/attention.cu"
#include "kernel_test_util.h"

#include <algorithm>

namespace {

struct Shape {
    int B, T, H, HD;
    int D() const { return H * HD; }
};

/// The shared memory the Rust side gives each tensor-core kernel (ops::attention_smem).
size_t smem(const char* part, int hd) {
    const size_t half_tile = 64 * (hd + 8) * 2;
    if (!strcmp(part, "fwd")) return 5 * half_tile;
    if (!strcmp(part, "dkdv")) return 6 * half_tile + 4 * 64 * 4;
    return 6 * half_tile;
}

/// Causal attention in double: out, lse, and the gradients for dout.
struct Reference {
    std::vector<double> out, lse, dqkv;
};

Reference reference(const Shape& s, const std::vector<double>& qkv, const std::vector<double>& dout) {
    const int D = s.D(), W = 3 * D;
    const double scale = 1.0 / std::sqrt((double)s.HD);
    Reference r;
    r.out.assign((size_t)s.B * s.T * D, 0.0);
    r.lse.assign((size_t)s.B * s.H * s.T, 0.0);
    r.dqkv.assign(qkv.size(), 0.0);
    std::vector<double> p(s.T);
    for (int b = 0; b < s.B; ++b)
        for (int h = 0; h < s.H; ++h) {
            auto q = [&](int t, int d) { return qkv[((size_t)b * s.T + t) * W + h * s.HD + d]; };
            auto k = [&](int t, int d) { return qkv[((size_t)b * s.T + t) * W + D + h * s.HD + d]; };
            auto v = [&](int t, int d) { return qkv[((size_t)b * s.T + t) * W + 2 * D + h * s.HD + d]; };
            auto go = [&](int t, int d) { return dout[((size_t)b * s.T + t) * D + h * s.HD + d]; };
            auto dq = [&](int t, int d) -> double& { return r.dqkv[((size_t)b * s.T + t) * W + h * s.HD + d]; };
            auto dk = [&](int t, int d) -> double& { return r.dqkv[((size_t)b * s.T + t) * W + D + h * s.HD + d]; };
            auto dv = [&](int t, int d) -> double& { return r.dqkv[((size_t)b * s.T + t) * W + 2 * D + h * s.HD + d]; };
            for (int i = 0; i < s.T; ++i) {
                double mx = -INFINITY;
                for (int j = 0; j <= i; ++j) {
                    double dot = 0.0;
                    for (int d = 0; d < s.HD; ++d) dot += q(i, d) * k(j, d);
                    p[j] = dot * scale;
                    mx = std::max(mx, p[j]);
                }
                double sum = 0.0;
                for (int j = 0; j <= i; ++j) sum += std::exp(p[j] - mx);
                const double lse = mx + std::log(sum);
                r.lse[((size_t)b * s.H + h) * s.T + i] = lse;
                for (int j = 0; j <= i; ++j) p[j] = std::exp(p[j] - lse);
                double Di = 0.0;
                for (int d = 0; d < s.HD; ++d) {
                    double o = 0.0;
                    for (int j = 0; j <= i; ++j) o += p[j] * v(j, d);
                    r.out[((size_t)b * s.T + i) * D + h * s.HD + d] = o;
                    Di += o * go(i, d);
                }
                for (int j = 0; j <= i; ++j) {
                    double dp = 0.0;
                    for (int d = 0; d < s.HD; ++d) dp += go(i, d) * v(j, d);
                    const double ds = p[j] * (dp - Di);
                    for (int d = 0; d < s.HD; ++d) {
                        dv(j, d) += p[j] * go(i, d);
                        dq(i, d) += scale * ds * k(j, d);
                        dk(j, d) += scale * ds * q(i, d);
                    }
                }
            }
        }
    return r;
}

/// Picks the q, k or v columns of a [B·T, 3D] gradient.
std::vector<double> part(const std::vector<double>& v, int D, int which) {
    std::vector<double> out;
    for (size_t row = 0; row * 3 * D < v.size(); ++row)
        for (int d = 0; d < D; ++d) out.push_back(v[row * 3 * D + which * D + d]);
    return out;
}

template <class T> struct Kernels;
#define KERNELS(TYPE, NAME, HD)                                                            \
    template <> struct Kernels<TYPE##_hd<HD>> {                                                  \
        static constexpr auto fwd = attn_fwd_##NAME##_hd##HD;                                    \
        static constexpr auto dkdv = attn_dkdv_##NAME##_hd##HD;                                  \
        static constexpr auto dq = attn_dq_##NAME##_hd##HD;                                      \
    };

template <int HD> struct bf16_hd {};
template <int HD> struct f16_hd {};
template <int HD> struct f32_hd {};
KERNELS(bf16, bf16, 32)
KERNELS(bf16, bf16, 64)
KERNELS(bf16, bf16, 128)
KERNELS(f16, f16, 32)
KERNELS(f16, f16, 64)
KERNELS(f16, f16, 128)
KERNELS(f32, f32, 32)
KERNELS(f32, f32, 64)
KERNELS(f32, f32, 128)

template <class T> struct Prep;
template <> struct Prep<bf16> { static constexpr auto k = attn_bwd_prep_bf16; };
template <> struct Prep<f16> { static constexpr auto k = attn_bwd_prep_f16; };
template <> struct Prep<float> { static constexpr auto k = attn_bwd_prep_f32; };

template <class T, class K>
void run(kt::Tally& tally, const Shape& s, uint64_t seed) {
    kt::Rng rng(seed);
    const int D = s.D();
    const size_t n_qkv = (size_t)s.B * s.T * 3 * D, n_out = (size_t)s.B * s.T * D;
    const size_t n_rows = (size_t)s.B * s.H * s.T;
    T* qkv = kt::buffer<T>(n_qkv);
    T* dout = kt::buffer<T>(n_out);
    T* out = kt::buffer<T>(n_out);
    T* dqkv = kt::buffer<T>(n_qkv);
    float* lse = kt::buffer<float>(n_rows);
    float* Dr = kt::buffer<float>(n_rows);
    const auto qkv_v = kt::fill_random(qkv, n_qkv, rng, -2.0f, 2.0f);
    const auto dout_v = kt::fill_random(dout, n_out, rng, -1.0f, 1.0f);
    kt::fill_poison(out, n_out);
    kt::fill_poison(dqkv, n_qkv);
    kt::fill_poison(lse, n_rows);
    const Reference ref = reference(s, qkv_v, dout_v);
    const float scale = 1.0f / std::sqrt((float)s.HD);
    const bool tensor_cores = sizeof(T) == 2;
    const dim3 grid(tensor_cores ? (s.T + 63) / 64 : (s.T + 3) / 4, s.B * s.H);
    auto sm = [&](const char* p) { return tensor_cores ? smem(p, s.HD) : (size_t)0; };
    emu::launch(K::fwd, grid, dim3(128), sm("fwd"), qkv, out, lse, s.B, s.T, s.H, scale);
    const std::string what = kt::fmt("attention %s B=%d T=%d H=%d hd=%d", kt::type_name<T>(), s.B, s.T, s.H, s.HD);
    tally.check(what + " forward", kt::rel_l2(kt::read(out, n_out), ref.out), kt::tol<T>());
    tally.check(what + " log-sum-exp", kt::rel_l2(kt::read(lse, n_rows), ref.lse), tensor_cores ? 1e-3 : 1e-5);
    emu::launch(Prep<T>::k, dim3(kt::grid_for((long long)n_rows * 32)), dim3(256), 0, out, dout, Dr,
                s.HD, s.B, s.T, s.H, scale);
    emu::launch(K::dkdv, grid, dim3(128), sm("dkdv"), qkv, dout, lse, Dr, dqkv, s.B, s.T, s.H, scale);
    emu::launch(K::dq, grid, dim3(128), sm("dq"), qkv, dout, lse, Dr, dqkv, s.B, s.T, s.H, scale);
    const auto got = kt::read(dqkv, n_qkv);
    const char* names[3] = {" dq", " dk", " dv"};
    for (int w = 0; w < 3; ++w)
        tally.check(what + names[w], kt::rel_l2(part(got, D, w), part(ref.dqkv, D, w)), kt::tol<T>());
}

} // namespace

int main() {
    kt::Tally tally;
    // Ragged lengths: a last tile of 2 rows (130), exactly one tile (64), a short one (70).
    run<bf16, Kernels<bf16_hd<64>>>(tally, {1, 130, 2, 64}, 1);
    // Several query tiles and a ragged last one.
    run<bf16, Kernels<bf16_hd<64>>>(tally, {1, 300, 1, 64}, 8);
    run<f16, Kernels<f16_hd<32>>>(tally, {1, 200, 1, 32}, 9);
    run<bf16, Kernels<bf16_hd<32>>>(tally, {2, 64, 1, 32}, 2);
    run<bf16, Kernels<bf16_hd<128>>>(tally, {1, 70, 1, 128}, 3);
    run<f16, Kernels<f16_hd<64>>>(tally, {1, 100, 2, 64}, 4);
    run<float, Kernels<f32_hd<64>>>(tally, {1, 37, 2, 64}, 5);
    run<float, Kernels<f32_hd<32>>>(tally, {2, 20, 1, 32}, 6);
    run<float, Kernels<f32_hd<128>>>(tally, {1, 9, 1, 128}, 7);
    return tally.finish("attention");
}
