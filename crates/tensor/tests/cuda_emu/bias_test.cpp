// Tests of bias.cu on the CPU emulator: the two-stage column sums against a double reference,
// and their exact (fixed) summation order.
#include "cuda_emu.h"
#include "common.cuh"
#include "bias.cu"
#include "kernel_test_util.h"

using namespace kt;

static Tally tally;

struct Shape {
    int rows, cols, rows_per_block;
};

template <class T>
static void test_colsum(void (*partial_kernel)(const T*, float*, int, int, int)) {
    const Shape shapes[] = {{1, 1, 64}, {5, 3, 64}, {70, 300, 64}, {130, 257, 64},
                            {64, 20, 64}, {33, 9, 7}, {9, 513, 2}, {45, 33, 2}, {64, 5, 2}};
    Rng rng(21);
    for (const Shape& s : shapes) {
        const int nb = (s.rows + s.rows_per_block - 1) / s.rows_per_block;
        T* y = buffer<T>((size_t)s.rows * s.cols);
        const auto yv = fill_random(y, (size_t)s.rows * s.cols, rng, -1.0f, 1.0f);
        float* partial = buffer<float>((size_t)nb * s.cols);
        fill_poison(partial, (size_t)nb * s.cols);
        emu::launch(partial_kernel, dim3((s.cols + 255) / 256, nb), dim3(256), 0, (const T*)y,
                    partial, s.rows, s.cols, s.rows_per_block);
        // Stage 1 is a plain fp32 sum down each column in row order: bit-exact.
        std::vector<double> want_partial((size_t)nb * s.cols);
        for (int b = 0; b < nb; ++b)
            for (int c = 0; c < s.cols; ++c) {
                float acc = 0.0f;
                for (int r = b * s.rows_per_block; r < std::min(s.rows, (b + 1) * s.rows_per_block); ++r)
                    acc += (float)yv[(size_t)r * s.cols + c];
                want_partial[(size_t)b * s.cols + c] = acc;
            }
        const std::string tag = fmt("colsum %s rows=%d cols=%d rpb=%d", type_name<T>(), s.rows, s.cols, s.rows_per_block);
        tally.check(tag + " partial (exact order)", rel_l2(read(partial, (size_t)nb * s.cols), want_partial), 0.0);

        for (int acc = 0; acc < 2; ++acc) {
            float* out = buffer<float>(s.cols);
            std::vector<double> base(s.cols, 0.0);
            if (acc) base = fill_random(out, s.cols, rng, -3.0f, 3.0f);
            else fill_poison(out, s.cols);
            const unsigned grid = acc ? 1 : (s.cols + 255) / 256;  // 1 block: grid-stride
            emu::launch(colsum_finish, dim3(grid), dim3(256), 0, (const float*)partial, out, nb, s.cols, acc);
            std::vector<double> want(s.cols), exact(s.cols);
            for (int c = 0; c < s.cols; ++c) {
                double sum = 0.0, sum_partials = 0.0;
                for (int r = 0; r < s.rows; ++r) sum += yv[(size_t)r * s.cols + c];
                for (int b = 0; b < nb; ++b) sum_partials += want_partial[(size_t)b * s.cols + c];
                want[c] = base[c] + sum;
                exact[c] = acc ? (double)((float)base[c] + (float)sum_partials) : (double)(float)sum_partials;
            }
            tally.check(tag + fmt(" finish acc=%d", acc), rel_l2(read(out, s.cols), want), 1e-5);
            tally.check(tag + fmt(" finish acc=%d (exact order)", acc), rel_l2(read(out, s.cols), exact), 0.0);
        }
    }
}

int main() {
    test_colsum<float>(colsum_partial_f32);
    test_colsum<bf16>(colsum_partial_bf16);
    test_colsum<f16>(colsum_partial_f16);
    return tally.finish("bias");
}
