// Tests of cross_entropy.cu on the CPU emulator against a double-precision softmax
// cross-entropy (losses, argmax with first-index ties, gradient over the logits) and of
// xent_sum's accumulation.
#include "cuda_emu.h"
#include "common.cuh"
#include "cross_entropy.cu"
#include "kernel_test_util.h"

using namespace kt;

static Tally tally;

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

int main() {
    test_xent<float>(softmax_xent_f32);
    test_xent<bf16>(softmax_xent_bf16);
    test_xent<f16>(softmax_xent_f16);
    test_xent_sum_many();
    return tally.finish("cross_entropy");
}
