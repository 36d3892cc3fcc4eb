// attention.cu on the CPU emulator: the tensor-core kernels (mma.sync fragments) in bf16 and f16 and the
// exact f32 kernels, forward and backward, against a double-precision definition of causal
// attention, on ragged sequence lengths (a last partial 64-row tile) and every head size.
// Ring attention's kernels (one block pair at a time, merged into kept f32 state by the
// log-sum-exp rule, gradients added into f32 accumulators) run a whole ring of `cp` ranks
// over load-balanced chunks and must give the same attention as the whole causal product.
#include "cuda_emu.h"
#include "../../src/cuda/kernels/common.cuh"
#include "../../src/cuda/kernels/attention.cu"
#include "kernel_test_util.h"

#include <algorithm>

namespace {

struct Shape {
    int B, T, H, HD;
    int window = 0; // a sliding window: each query sees at most this many keys (0: all)
    int D() const { return H * HD; }
};

/// The shared memory the Rust side gives each tensor-core kernel (ops::attention_smem).
size_t smem(const char* part, int hd, bool wg = false) {
    // Tiles with padded rows; the wgmma kernels' are unpadded core matrices.
    const size_t tile = wg ? 64 * hd * 2 : 64 * (hd + 8) * 2;
    if (!strcmp(part, "fwd")) return 5 * tile;
    if (!strcmp(part, "dkdv")) return 6 * tile + 4 * 64 * 4;
    return 6 * tile;
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
                const int lo = s.window > 0 ? std::max(0, i - s.window + 1) : 0;
                double mx = -INFINITY;
                for (int j = lo; j <= i; ++j) {
                    double dot = 0.0;
                    for (int d = 0; d < s.HD; ++d) dot += q(i, d) * k(j, d);
                    p[j] = dot * scale;
                    mx = std::max(mx, p[j]);
                }
                double sum = 0.0;
                for (int j = lo; j <= i; ++j) sum += std::exp(p[j] - mx);
                const double lse = mx + std::log(sum);
                r.lse[((size_t)b * s.H + h) * s.T + i] = lse;
                for (int j = lo; j <= i; ++j) p[j] = std::exp(p[j] - lse);
                double Di = 0.0;
                for (int d = 0; d < s.HD; ++d) {
                    double o = 0.0;
                    for (int j = lo; j <= i; ++j) o += p[j] * v(j, d);
                    r.out[((size_t)b * s.T + i) * D + h * s.HD + d] = o;
                    Di += o * go(i, d);
                }
                for (int j = lo; j <= i; ++j) {
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
        static constexpr auto ring_fwd = attn_ring_fwd_##NAME##_hd##HD;                          \
        static constexpr auto ring_dkdv = attn_ring_dkdv_##NAME##_hd##HD;                        \
        static constexpr auto ring_dq = attn_ring_dq_##NAME##_hd##HD;                            \
        static constexpr bool wg = false;                                                        \
    };
// The Hopper kernels (wgmma products; the emulator runs them as PTX specifies wgmma).
#define WG_KERNELS(TYPE, NAME, HD)                                                               \
    template <> struct Kernels<TYPE##_wg<HD>> {                                                  \
        static constexpr auto fwd = attn_fwd_wg_##NAME##_hd##HD;                                 \
        static constexpr auto dkdv = attn_dkdv_wg_##NAME##_hd##HD;                               \
        static constexpr auto dq = attn_dq_wg_##NAME##_hd##HD;                                   \
        static constexpr bool wg = true;                                                         \
    };

template <int HD> struct bf16_hd {};
template <int HD> struct f16_hd {};
template <int HD> struct f32_hd {};
template <int HD> struct bf16_wg {};
template <int HD> struct f16_wg {};
WG_KERNELS(bf16, bf16, 64)
WG_KERNELS(bf16, bf16, 128)
WG_KERNELS(f16, f16, 64)
WG_KERNELS(f16, f16, 128)
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
#define PREP(TYPE, NAME)                                                                         \
    template <> struct Prep<TYPE> {                                                              \
        static constexpr auto k = attn_bwd_prep_##NAME;                                          \
        static constexpr auto kv = attn_ring_kv_##NAME;                                          \
        static constexpr auto join = attn_ring_join_##NAME;                                      \
    };
PREP(bf16, bf16)
PREP(f16, f16)
PREP(float, f32)

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
    auto sm = [&](const char* p) { return tensor_cores ? smem(p, s.HD, K::wg) : (size_t)0; };
    emu::launch(K::fwd, grid, dim3(128), sm("fwd"), qkv, out, lse, s.B, s.T, s.H, scale, s.window);
    const std::string what = kt::fmt("attention%s %s B=%d T=%d H=%d hd=%d window=%d", K::wg ? " (wgmma)" : "",
                                     kt::type_name<T>(), s.B, s.T, s.H, s.HD, s.window);
    tally.check(what + " forward", kt::rel_l2(kt::read(out, n_out), ref.out), kt::tol<T>());
    tally.check(what + " log-sum-exp", kt::rel_l2(kt::read(lse, n_rows), ref.lse), tensor_cores ? 1e-3 : 1e-5);
    emu::launch(Prep<T>::k, dim3(kt::grid_for((long long)n_rows * 32)), dim3(256), 0, out, dout, Dr,
                s.HD, s.B, s.T, s.H, scale);
    emu::launch(K::dkdv, grid, dim3(128), sm("dkdv"), qkv, dout, lse, Dr, dqkv, s.B, s.T, s.H, scale,
                s.window);
    emu::launch(K::dq, grid, dim3(128), sm("dq"), qkv, dout, lse, Dr, dqkv, s.B, s.T, s.H, scale, s.window);
    const auto got = kt::read(dqkv, n_qkv);
    const char* names[3] = {" dq", " dk", " dv"};
    for (int w = 0; w < 3; ++w)
        tally.check(what + names[w], kt::rel_l2(part(got, D, w), part(ref.dqkv, D, w)), kt::tol<T>());
}

/// The load-balanced chunks of rank r of cp: chunks r and 2·cp − 1 − r of 2·cp.
std::vector<int> chunks_of(int r, int cp) { return {r, 2 * cp - 1 - r}; }

struct RingPair {
    int q_start, kv_start, len;
    bool causal;
};

/// The block pairs rank `me`'s queries meet in rank `src`'s block (as context.rs's
/// ring_pairs): a query chunk meets earlier key chunks whole and its own under the mask.
std::vector<RingPair> ring_pairs(int me, int src, int cp, int chunk) {
    std::vector<RingPair> pairs;
    const auto mine = chunks_of(me, cp), theirs = chunks_of(src, cp);
    for (int qi = 0; qi < 2; ++qi)
        for (int ki = 0; ki < 2; ++ki)
            if (theirs[ki] <= mine[qi]) pairs.push_back({qi * chunk, ki * chunk, chunk, theirs[ki] == mine[qi]});
    return pairs;
}

/// Rows of rank r's [B, rows, W] share of a global [B, T, W] tensor (its two chunks).
template <class V>
std::vector<V> rank_rows(const std::vector<V>& global, int r, int cp, int B, int T, int W) {
    const int chunk = T / (2 * cp);
    std::vector<V> out;
    for (int b = 0; b < B; ++b)
        for (int c : chunks_of(r, cp))
            for (int i = 0; i < chunk; ++i)
                for (int w = 0; w < W; ++w) out.push_back(global[((size_t)b * T + c * chunk + i) * W + w]);
    return out;
}

/// Rank r's rows of a global [B, H, T] row statistic.
std::vector<double> rank_stat(const std::vector<double>& global, int r, int cp, int B, int H, int T) {
    const int chunk = T / (2 * cp);
    std::vector<double> out;
    for (int bh = 0; bh < B * H; ++bh)
        for (int c : chunks_of(r, cp))
            for (int i = 0; i < chunk; ++i) out.push_back(global[(size_t)bh * T + c * chunk + i]);
    return out;
}

/// A whole ring of `cp` ranks over a [B, T, 3·D] sequence: every rank's forward (its own
/// block, then each earlier rank's, as the ring delivers them), then its backward with the
/// key/value gradient accumulators of each block (which travel on the GPU; here each rank
/// adds into the block owner's), against the whole causal product in double.
template <class T, class K>
void run_ring(kt::Tally& tally, const Shape& s, int cp, uint64_t seed) {
    kt::Rng rng(seed);
    const int D = s.D(), chunk = s.T / (2 * cp), rows = 2 * chunk;
    const size_t n_qkv = (size_t)s.B * s.T * 3 * D, n_out = (size_t)s.B * s.T * D;
    // The global sequence in T, and what each rank holds of it.
    T* global_qkv = kt::buffer<T>(n_qkv);
    T* global_dout = kt::buffer<T>(n_out);
    const auto qkv_v = kt::fill_random(global_qkv, n_qkv, rng, -2.0f, 2.0f);
    const auto dout_v = kt::fill_random(global_dout, n_out, rng, -1.0f, 1.0f);
    const Reference ref = reference(s, qkv_v, dout_v);
    const size_t local_qkv = (size_t)s.B * rows * 3 * D, local_out = (size_t)s.B * rows * D;
    const size_t local_rows = (size_t)s.B * s.H * rows;
    std::vector<T*> qkv(cp), kv(cp), dout(cp), out_t(cp), dqkv(cp);
    std::vector<float*> out(cp), lse(cp), Dr(cp), dq(cp), dkv(cp);
    const auto qkv_raw = kt::read(global_qkv, n_qkv);
    const auto dout_raw = kt::read(global_dout, n_out);
    for (int r = 0; r < cp; ++r) {
        qkv[r] = kt::buffer<T>(local_qkv);
        dout[r] = kt::buffer<T>(local_out);
        const auto q = rank_rows(qkv_raw, r, cp, s.B, s.T, 3 * D);
        const auto g = rank_rows(dout_raw, r, cp, s.B, s.T, D);
        for (size_t i = 0; i < q.size(); ++i) qkv[r][i] = from_f32<T>((float)q[i]);
        for (size_t i = 0; i < g.size(); ++i) dout[r][i] = from_f32<T>((float)g[i]);
        kv[r] = kt::buffer<T>(local_qkv / 3 * 2);
        kt::fill_poison(kv[r], local_qkv / 3 * 2);
        out[r] = kt::buffer<float>(local_out);
        lse[r] = kt::buffer<float>(local_rows);
        kt::fill_poison(out[r], local_out);
        kt::fill_poison(lse[r], local_rows);
        out_t[r] = kt::buffer<T>(local_out);
        Dr[r] = kt::buffer<float>(local_rows);
        dq[r] = kt::buffer<float>(local_out);
        dkv[r] = kt::buffer<float>(local_out * 2);
        dqkv[r] = kt::buffer<T>(local_qkv);
        kt::fill_poison(dqkv[r], local_qkv);
        const long long n_rows = (long long)s.B * rows;
        emu::launch(Prep<T>::kv, dim3(kt::grid_for(n_rows * 2 * D)), dim3(256), 0, qkv[r], kv[r], n_rows, D);
        emu::launch(attn_ring_start, dim3(kt::grid_for((long long)local_out)), dim3(256), 0, out[r],
                    (long long)local_out, lse[r], (long long)local_rows);
        emu::launch(attn_ring_start, dim3(kt::grid_for((long long)local_out)), dim3(256), 0, dq[r],
                    (long long)local_out, Dr[r], (long long)0);
        emu::launch(attn_ring_start, dim3(kt::grid_for((long long)local_out * 2)), dim3(256), 0,
                    dkv[r], (long long)local_out * 2, Dr[r], (long long)0);
    }
    const float scale = 1.0f / std::sqrt((float)s.HD);
    const bool tensor_cores = sizeof(T) == 2;
    auto grid = [&](int len) { return dim3(tensor_cores ? (len + 63) / 64 : (len + 3) / 4, s.B * s.H); };
    auto sm = [&](const char* p) { return tensor_cores ? smem(p, s.HD) : (size_t)0; };
    // Forward: rank me meets block src = me − step at ring step `step`.
    for (int me = 0; me < cp; ++me)
        for (int step = 0; step < cp; ++step) {
            const int src = (me + cp - step) % cp;
            for (const auto& p : ring_pairs(me, src, cp, chunk))
                emu::launch(K::ring_fwd, grid(p.len), dim3(128), sm("fwd"), qkv[me], kv[src], out[me],
                            lse[me], s.B, rows, s.H, p.q_start, p.kv_start, p.len, p.len, (int)p.causal,
                            scale);
        }
    const std::string what = kt::fmt("ring attention %s cp=%d B=%d T=%d H=%d hd=%d", kt::type_name<T>(), cp,
                                     s.B, s.T, s.H, s.HD);
    std::vector<double> got_out, want_out, got_lse, want_lse;
    for (int r = 0; r < cp; ++r) {
        const auto o = kt::read(out[r], local_out), l = kt::read(lse[r], local_rows);
        got_out.insert(got_out.end(), o.begin(), o.end());
        got_lse.insert(got_lse.end(), l.begin(), l.end());
        const auto wo = rank_rows(ref.out, r, cp, s.B, s.T, D);
        const auto wl = rank_stat(ref.lse, r, cp, s.B, s.H, s.T);
        want_out.insert(want_out.end(), wo.begin(), wo.end());
        want_lse.insert(want_lse.end(), wl.begin(), wl.end());
    }
    tally.check(what + " forward", kt::rel_l2(got_out, want_out), kt::tol<T>());
    tally.check(what + " log-sum-exp", kt::rel_l2(got_lse, want_lse), tensor_cores ? 1e-3 : 1e-5);
    // Backward: the output in T (as the layer keeps it), D, then every pair's gradients.
    for (int r = 0; r < cp; ++r) {
        for (size_t i = 0; i < local_out; ++i) out_t[r][i] = from_f32<T>(out[r][i]);
        emu::launch(Prep<T>::k, dim3(kt::grid_for((long long)local_rows * 32)), dim3(256), 0, out_t[r],
                    dout[r], Dr[r], s.HD, s.B, rows, s.H, scale);
    }
    for (int me = 0; me < cp; ++me)
        for (int step = 0; step < cp; ++step) {
            const int src = (me + cp - step) % cp;
            for (const auto& p : ring_pairs(me, src, cp, chunk)) {
                emu::launch(K::ring_dkdv, grid(p.len), dim3(128), sm("dkdv"), qkv[me], kv[src], dout[me],
                            lse[me], Dr[me], dkv[src], s.B, rows, s.H, p.q_start, p.kv_start, p.len, p.len,
                            (int)p.causal, scale);
                emu::launch(K::ring_dq, grid(p.len), dim3(128), sm("dq"), qkv[me], kv[src], dout[me],
                            lse[me], Dr[me], dq[me], s.B, rows, s.H, p.q_start, p.kv_start, p.len, p.len,
                            (int)p.causal, scale);
            }
        }
    std::vector<double> got, want;
    for (int r = 0; r < cp; ++r) {
        const long long n_rows = (long long)s.B * rows;
        emu::launch(Prep<T>::join, dim3(kt::grid_for(n_rows * 3 * D)), dim3(256), 0, dq[r], dkv[r], dqkv[r],
                    n_rows, D);
        const auto g = kt::read(dqkv[r], local_qkv);
        const auto w = rank_rows(ref.dqkv, r, cp, s.B, s.T, 3 * D);
        got.insert(got.end(), g.begin(), g.end());
        want.insert(want.end(), w.begin(), w.end());
    }
    const char* names[3] = {" dq", " dk", " dv"};
    for (int w = 0; w < 3; ++w)
        tally.check(what + names[w], kt::rel_l2(part(got, D, w), part(want, D, w)), kt::tol<T>());
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
    // Mistral's sliding window: shorter than a tile (whole key tiles skipped, the first ones
    // cut), one key, crossing a tile boundary, longer than the sequence.
    run<bf16, Kernels<bf16_hd<64>>>(tally, {1, 300, 1, 64, 37}, 16);
    run<f16, Kernels<f16_hd<32>>>(tally, {1, 200, 1, 32, 1}, 17);
    run<bf16, Kernels<bf16_hd<128>>>(tally, {1, 200, 1, 128, 100}, 18);
    run<bf16, Kernels<bf16_hd<32>>>(tally, {2, 64, 1, 32, 500}, 19);
    run<float, Kernels<f32_hd<64>>>(tally, {1, 37, 2, 64, 5}, 20);
    run<float, Kernels<f32_hd<32>>>(tally, {2, 20, 1, 32, 1}, 21);
    // The Hopper kernels on the same kinds of shapes: ragged tiles, several query tiles,
    // heads of 64 and 128, both types, windows.
    run<bf16, Kernels<bf16_wg<64>>>(tally, {1, 130, 2, 64}, 31);
    run<bf16, Kernels<bf16_wg<64>>>(tally, {1, 300, 1, 64}, 32);
    run<f16, Kernels<f16_wg<64>>>(tally, {2, 100, 1, 64}, 33);
    run<bf16, Kernels<bf16_wg<128>>>(tally, {1, 70, 1, 128}, 34);
    run<f16, Kernels<f16_wg<128>>>(tally, {1, 200, 1, 128}, 35);
    run<bf16, Kernels<bf16_wg<64>>>(tally, {1, 300, 1, 64, 37}, 36);
    run<bf16, Kernels<bf16_wg<128>>>(tally, {1, 200, 1, 128, 100}, 37);
    // Ring attention: chunks of a partial tile (40 rows), of exactly one (64) and of two
    // tiles with a ragged one (150), on 2 and 3 ranks.
    run_ring<bf16, Kernels<bf16_hd<64>>>(tally, {1, 160, 2, 64}, 2, 11);
    run_ring<f16, Kernels<f16_hd<32>>>(tally, {2, 256, 1, 32}, 2, 12);
    run_ring<bf16, Kernels<bf16_hd<128>>>(tally, {1, 900, 1, 128}, 3, 13);
    run_ring<float, Kernels<f32_hd<64>>>(tally, {1, 48, 2, 64}, 3, 14);
    run_ring<float, Kernels<f32_hd<32>>>(tally, {2, 20, 1, 32}, 2, 15);
    return tally.finish("attention");
}
