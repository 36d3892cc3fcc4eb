// Tests of cross_entropy.cu on the CPU emulator against a double-precision softmax
// cross-entropy (losses, argmax with first-index ties, gradient over the logits) and of
// xent_sum's accumulation.
#include "cuda_emu.h"
#include "common.cuh"
#include "cross_entropy.cu"
#include "kernel_test_util.h"

using namespace kt;

static Tally tally;

template <class T> struct VpKernels;
#define VP_KERNELS(TYPE, NAME)                                                                 \
    template <> struct VpKernels<TYPE> {                                                       \
        static constexpr auto max = vp_xent_max_##NAME;                                        \
        static constexpr auto sums = vp_xent_sums_##NAME;                                      \
        static constexpr auto finish = vp_xent_finish_##NAME;                                  \
    };
VP_KERNELS(float, f32)
VP_KERNELS(bf16, bf16)
VP_KERNELS(f16, f16)

template <class T>
static void test_xent(void (*kernel)(T*, const int*, float*, int*, int, int, float, int)) {
    // (rows, v): scalar path (v % 8 != 0), vector path, v > 8·512 (several chunks per thread,
    // and the two-chunk step), one class.
    const int shapes[][2] = {{1, 1}, {3, 7}, {5, 8}, {4, 40}, {3, 1000}, {2, 8200}, {6, 4099}, {9, 16}};
    Rng rng(51);
    for (const auto& sh : shapes) {
        const int rows = sh[0], v = sh[1];
        const size_t n = (size_t)rows * v;
        for (int write_grad = 0; write_grad < 2; ++write_grad) {
            T* logits = buffer<T>(n);
            auto xv = fill_random(logits, n, rng, -8.0f, 8.0f);
            int* targets = buffer<int>(rows);
            std::vector<int> tv(rows);
            for (int r = 0; r < rows; ++r) {
                // Row 1: a tie for the max (the first index must win); even rows: the target
                // is the max, so correct = 1 is exercised.
                if (r == 1 && v > 2) {
                    const size_t a = (size_t)r * v + v / 3, b = (size_t)r * v + v - 1;
                    logits[a] = logits[b] = from_f32<T>(9.0f);
                    xv[a] = xv[b] = 9.0;
                }
                int best = 0;
                for (int j = 1; j < v; ++j)
                    if (xv[(size_t)r * v + j] > xv[(size_t)r * v + best]) best = j;
                tv[r] = targets[r] = (r % 2 == 0 || r == 1) ? best : rng.below(v);
                if (r == 3 && v > 2) {  // the other tied index is not the first: wrong
                    tv[r] = targets[r] = v - 1;
                    const size_t a = (size_t)r * v + 0, b = (size_t)r * v + v - 1;
                    logits[a] = logits[b] = from_f32<T>(9.5f);
                    xv[a] = xv[b] = 9.5;
                }
            }
            float* losses = buffer<float>(rows);
            int* correct = buffer<int>(rows);
            fill_poison(losses, rows);
            for (int r = 0; r < rows; ++r) correct[r] = -7;
            const float grad_scale = 0.37f / rows;
            const unsigned grid = write_grad ? (unsigned)rows : 2;  // 2 blocks: grid-stride rows
            emu::launch(kernel, dim3(grid), dim3(512), 0, logits, (const int*)targets, losses, correct,
                        rows, v, grad_scale, write_grad);
            std::vector<double> want_loss(rows), want_grad(n);
            bool correct_ok = true;
            for (int r = 0; r < rows; ++r) {
                const double* x = &xv[(size_t)r * v];
                int arg = 0;
                for (int j = 1; j < v; ++j)
                    if (x[j] > x[arg]) arg = j;
                double s = 0.0;
                for (int j = 0; j < v; ++j) s += std::exp(x[j] - x[arg]);
                want_loss[r] = std::log(s) + x[arg] - x[tv[r]];
                for (int j = 0; j < v; ++j)
                    want_grad[(size_t)r * v + j] = (std::exp(x[j] - x[arg]) / s - (j == tv[r])) * grad_scale;
                correct_ok &= correct[r] == (arg == tv[r] ? 1 : 0);
            }
            const std::string tag = fmt("softmax_xent_%s rows=%d v=%d grad=%d", type_name<T>(), rows, v, write_grad);
            tally.check(tag + " loss", rel_l2(read(losses, rows), want_loss), 1e-5);
            tally.check_true(tag + " correct", correct_ok);
            if (write_grad) {
                tally.check(tag + " dlogits", rel_l2(read(logits, n), want_grad), tol<T>());
            } else {
                tally.check(tag + " logits untouched", rel_l2(read(logits, n), xv), 0.0);
            }

            // xent_sum adds into the two doubles.
            double* out = buffer<double>(2);
            out[0] = 1.25;
            out[1] = 3.0;
            emu::launch(xent_sum, dim3(1), dim3(256), 0, (const float*)losses, (const int*)correct, rows, out);
            double sl = 1.25, sc = 3.0;
            for (int r = 0; r < rows; ++r) {
                sl += (double)losses[r];
                sc += correct[r];
            }
            tally.check(tag + " xent_sum loss", std::fabs(out[0] - sl) / std::fabs(sl), 1e-14);
            tally.check_true(tag + " xent_sum correct", out[1] == sc);
        }
    }
}

static void test_xent_sum_many() {
    // More rows than threads, so each thread sums several.
    Rng rng(52);
    const int rows = 1000;
    float* losses = buffer<float>(rows);
    int* correct = buffer<int>(rows);
    double want_l = 0.0, want_c = 0.0;
    for (int r = 0; r < rows; ++r) {
        losses[r] = rng.range(0.0f, 11.0f);
        correct[r] = rng.below(2);
        want_l += losses[r];
        want_c += correct[r];
    }
    double* out = buffer<double>(2);
    out[0] = out[1] = 0.0;
    emu::launch(xent_sum, dim3(1), dim3(256), 0, (const float*)losses, (const int*)correct, rows, out);
    tally.check("xent_sum rows=1000 loss", std::fabs(out[0] - want_l) / want_l, 1e-14);
    tally.check_true("xent_sum rows=1000 correct", out[1] == want_c);
}

/// The vocabulary-parallel kernels on `tp` simulated ranks (each its share of a padded
/// vocabulary; the all-reduces done here on the host) against the whole-vocabulary softmax
/// cross-entropy in double: losses, correct, the gradient of every real column, zero padding.
template <class T>
static void test_vocab_parallel(int rows, int vocab, int tp, uint64_t seed) {
    Rng rng(seed);
    const int padded = (vocab + tp - 1) / tp * tp, cols = padded / tp;
    const float grad_scale = 0.25f;
    std::vector<double> whole((size_t)rows * vocab);
    std::vector<T*> logits(tp);
    std::vector<int> tv(rows);
    int* targets = buffer<int>(rows);
    for (int r = 0; r < rows; ++r) targets[r] = tv[r] = (int)rng.below(vocab);
    for (int k = 0; k < tp; ++k) {
        logits[k] = buffer<T>((size_t)rows * cols);
        const auto v = fill_random(logits[k], (size_t)rows * cols, rng, -6.0f, 6.0f);
        for (int r = 0; r < rows; ++r)
            for (int j = 0; j < cols; ++j)
                if (k * cols + j < vocab) whole[(size_t)r * vocab + k * cols + j] = v[(size_t)r * cols + j];
    }
    auto real_of = [&](int k) { return std::max(0, std::min(cols, vocab - k * cols)); };
    std::vector<float*> m(tp), sums(tp), losses(tp);
    std::vector<int*> correct(tp);
    for (int k = 0; k < tp; ++k) {
        m[k] = buffer<float>(rows);
        sums[k] = buffer<float>(2 * rows);
        losses[k] = buffer<float>(rows);
        correct[k] = buffer<int>(rows);
    }
    const dim3 grid(std::min(rows, 3)), block(256);
    const char* name = type_name<T>();
    for (int k = 0; k < tp; ++k) emu::launch(VpKernels<T>::max, grid, block, 0, (const T*)logits[k], m[k], rows, cols, real_of(k));
    for (int r = 0; r < rows; ++r) {  // all-reduce (Max)
        float mx = -INFINITY;
        for (int k = 0; k < tp; ++k) mx = std::max(mx, m[k][r]);
        for (int k = 0; k < tp; ++k) m[k][r] = mx;
    }
    for (int k = 0; k < tp; ++k)
        emu::launch(VpKernels<T>::sums, grid, block, 0, (const T*)logits[k], (const int*)targets, (const float*)m[k],
                    sums[k], rows, cols, real_of(k), k * cols);
    for (int i = 0; i < 2 * rows; ++i) {  // all-reduce (Sum)
        float total = 0.0f;
        for (int k = 0; k < tp; ++k) total += sums[k][i];
        for (int k = 0; k < tp; ++k) sums[k][i] = total;
    }
    for (int k = 0; k < tp; ++k)
        emu::launch(VpKernels<T>::finish, grid, block, 0, logits[k], (const int*)targets, (const float*)m[k],
                    (const float*)sums[k], losses[k], correct[k], rows, cols, real_of(k), k * cols, grad_scale, 1);
    std::vector<double> want_loss(rows), got_grad, want_grad;
    bool correct_ok = true, padding_zero = true;
    for (int r = 0; r < rows; ++r) {
        double mx = -INFINITY;
        for (int j = 0; j < vocab; ++j) mx = std::max(mx, whole[(size_t)r * vocab + j]);
        double s = 0.0;
        for (int j = 0; j < vocab; ++j) s += std::exp(whole[(size_t)r * vocab + j] - mx);
        const double t = whole[(size_t)r * vocab + tv[r]];
        want_loss[r] = std::log(s) + mx - t;
        for (int k = 0; k < tp; ++k) correct_ok &= correct[k][r] == (t >= mx ? 1 : 0);
        for (int k = 0; k < tp; ++k)
            for (int j = 0; j < cols; ++j) {
                const double g = to_f32(logits[k][(size_t)r * cols + j]);
                const int id = k * cols + j;
                if (id >= vocab) {
                    padding_zero &= g == 0.0;
                    continue;
                }
                got_grad.push_back(g);
                want_grad.push_back(grad_scale * (std::exp(whole[(size_t)r * vocab + id] - mx) / s - (id == tv[r])));
            }
    }
    const std::string tag = fmt("vocab-parallel xent %s rows=%d vocab=%d tp=%d", name, rows, vocab, tp);
    for (int k = 0; k < tp; ++k) tally.check(tag + fmt(" loss (rank %d)", k), rel_l2(read(losses[k], rows), want_loss), 1e-5);
    tally.check_true(tag + " correct", correct_ok);
    tally.check_true(tag + " padding gradient 0", padding_zero);
    tally.check(tag + " gradient", rel_l2(got_grad, want_grad), tol<T>());
}

int main() {
    test_xent<float>(softmax_xent_f32);
    test_xent<bf16>(softmax_xent_bf16);
    test_xent<f16>(softmax_xent_f16);
    test_xent_sum_many();
    // A vocabulary padded to a multiple of tp (the last rank holds padding), rows over a grid
    // smaller than them, a vocabulary wider than a block.
    test_vocab_parallel<float>(5, 37, 2, 61);
    test_vocab_parallel<float>(4, 700, 4, 62);
    test_vocab_parallel<bf16>(3, 50, 3, 63);
    test_vocab_parallel<f16>(2, 600, 2, 64);
    return tally.finish("cross_entropy");
}
