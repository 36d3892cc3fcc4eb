// Tests of bias.cu on the CPU emulator: the two-stage column sums against a double reference,
// and their exact (fixed) summation order, for the scalar partial kernel (any shape), the
// vector one (cols a multiple of 16 bytes' worth of values) and the finish; the activation
// backward fused with its column sums against act_bwd then colsum_partial_vec, bit for bit.
#include "cuda_emu.h"
#include "common.cuh"
#include "bias.cu"
#include "elementwise.cu"  // act_bwd, which act_bwd_colsum must equal
#include "kernel_test_util.h"

using namespace kt;

static Tally tally;

struct Shape {
    int rows, cols, rows_per_block;
};

typedef std::vector<double> Vec;

/// Σ y[r][c] for r in [lo, hi), in fp32, in row order (from 0).
static float run_sum(const Vec& yv, int cols, int c, int lo, int hi) {
    float acc = 0.0f;
    for (int r = lo; r < hi; ++r) acc += (float)yv[(size_t)r * cols + c];
    return acc;
}

/// colsum_partial_*: each block's rows summed downwards.
static Vec want_scalar_partial(const Vec& yv, const Shape& s, int nb) {
    Vec w((size_t)nb * s.cols);
    for (int b = 0; b < nb; ++b)
        for (int c = 0; c < s.cols; ++c)
            w[(size_t)b * s.cols + c] = run_sum(yv, s.cols, c, b * s.rows_per_block,
                                                std::min(s.rows, (b + 1) * s.rows_per_block));
    return w;
}

/// colsum_partial_vec_*: each block's rows in 8 consecutive runs of ceil(rpb/8) rows, each
/// summed downwards, then the run sums added in run order.
static Vec want_vec_partial(const Vec& yv, const Shape& s, int nb) {
    Vec w((size_t)nb * s.cols);
    const int per_run = (s.rows_per_block + MT_COLSUM_RUNS - 1) / MT_COLSUM_RUNS;
    for (int b = 0; b < nb; ++b) {
        const int r0 = b * s.rows_per_block, end = std::min(s.rows, r0 + s.rows_per_block);
        for (int c = 0; c < s.cols; ++c) {
            float acc = 0.0f;
            for (int j = 0; j < MT_COLSUM_RUNS; ++j) {
                const int lo = std::min(r0 + j * per_run, end), hi = std::min(lo + per_run, end);
                const float run = run_sum(yv, s.cols, c, lo, hi);
                acc = j == 0 ? run : acc + run;
            }
            w[(size_t)b * s.cols + c] = acc;
        }
    }
    return w;
}

/// colsum_finish over `partial` (nb x cols, holding `want_partial`): against the double sum
/// of y and, bit for bit, against the partials summed in double in block order.
static void test_finish(const std::string& tag, const float* partial, const Vec& want_partial,
                        const Vec& yv, const Shape& s, int nb, Rng& rng) {
    for (int acc = 0; acc < 2; ++acc) {
        float* out = buffer<float>(s.cols);
        Vec base(s.cols, 0.0);
        if (acc) base = fill_random(out, s.cols, rng, -3.0f, 3.0f);
        else fill_poison(out, s.cols);
        // acc=1: one block (column groups grid-strided); acc=0: the Rust side's grid, and a
        // block of 64 threads when there are several chunks of partials (any block works).
        const unsigned grid = acc ? 1 : (s.cols + MT_FINISH_COLS - 1) / MT_FINISH_COLS;
        const unsigned block = (!acc && nb > 16) ? 64 : 256;
        emu::launch(colsum_finish, dim3(grid), dim3(block), 0, partial, out, nb, s.cols, acc);
        Vec want(s.cols), exact(s.cols);
        for (int c = 0; c < s.cols; ++c) {
            double sum = 0.0, sum_partials = 0.0;
            for (int r = 0; r < s.rows; ++r) sum += yv[(size_t)r * s.cols + c];
            for (int b = 0; b < nb; ++b) sum_partials += want_partial[(size_t)b * s.cols + c];
            want[c] = base[c] + sum;
            exact[c] = acc ? (double)((float)base[c] + (float)sum_partials)
                           : (double)(float)sum_partials;
        }
        tally.check(tag + fmt(" finish acc=%d", acc), rel_l2(read(out, s.cols), want), 1e-5);
        tally.check(tag + fmt(" finish acc=%d (exact order)", acc), rel_l2(read(out, s.cols), exact),
                    0.0);
    }
}

template <class T>
static void test_colsum(void (*scalar)(const T*, float*, int, int, int),
                        void (*vec)(const T*, float*, int, int, int)) {
    constexpr int W = ColVec<T>::W;
    // Any shape for the scalar kernel; the vector one where cols % W == 0 (marked below):
    // rows not a multiple of the batch (8) or of the runs, rows < rows_per_block, blocks whose
    // last run is short or empty, rows_per_block not a multiple of 8, one lane group (32·W
    // columns) and more with a partial last group, and enough partials for several chunks of
    // the finish (rows=300, rpb=2: 150 partials).
    const Shape shapes[] = {{1, 1, 64},      {5, 3, 64},     {70, 300, 64},   {130, 257, 64},
                            {64, 20, 64},    {33, 9, 7},     {9, 513, 2},     {45, 33, 2},
                            {64, 5, 2},      {1, 8, 256},    {5, 24, 64},     {70, 264, 64},
                            {130, 256, 100}, {33, 40, 7},    {300, 16, 2},    {300, 32 * W, 128},
                            {257, 72, 256},  {1000, 96, 256}, {67, 8 * W + 4, 9}};
    Rng rng(21);
    for (const Shape& s : shapes) {
        const int nb = (s.rows + s.rows_per_block - 1) / s.rows_per_block;
        const size_t n = (size_t)s.rows * s.cols;
        T* y = buffer<T>(n);
        const Vec yv = fill_random(y, n, rng, -1.0f, 1.0f);
        const std::string tag = fmt("colsum %s rows=%d cols=%d rpb=%d", type_name<T>(), s.rows,
                                    s.cols, s.rows_per_block);

        float* partial = buffer<float>((size_t)nb * s.cols);
        fill_poison(partial, (size_t)nb * s.cols);
        emu::launch(scalar, dim3((s.cols + 255) / 256, nb), dim3(256), 0, (const T*)y, partial,
                    s.rows, s.cols, s.rows_per_block);
        // Stage 1 is a plain fp32 sum down each column in row order: bit-exact.
        const Vec want_partial = want_scalar_partial(yv, s, nb);
        tally.check(tag + " partial (exact order)", rel_l2(read(partial, (size_t)nb * s.cols), want_partial),
                    0.0);
        test_finish(tag, partial, want_partial, yv, s, nb, rng);

        if (s.cols % W != 0) continue;
        // The vector kernel (the Rust side's launch: grid (ceil(cols/(32·W)), nb), block
        // (32, 8)), writing every partial and nothing else.
        float* vpartial = buffer<float>((size_t)nb * s.cols);
        fill_poison(vpartial, (size_t)nb * s.cols);
        const int groups = (s.cols / W + MT_COLSUM_LANES - 1) / MT_COLSUM_LANES;
        emu::launch(vec, dim3(groups, nb), dim3(MT_COLSUM_LANES, MT_COLSUM_RUNS), 0,
                    (const T*)y, vpartial, s.rows, s.cols, s.rows_per_block);
        const Vec want_vpartial = want_vec_partial(yv, s, nb);
        const Vec got = read(vpartial, (size_t)nb * s.cols);
        tally.check(tag + " vector partial (exact order)", rel_l2(got, want_vpartial), 0.0);
        tally.check(tag + " vector partial vs scalar", rel_l2(got, want_partial), 1e-5);
        test_finish(tag + " (vector partials)", vpartial, want_vpartial, yv, s, nb, rng);
    }
}

/// The vector kernel reads exactly its 16-byte rows: y placed at the very end of its
/// allocation (emu::alloc's guard page follows the padding) still passes.
template <class T> static void test_vector_bounds(void (*vec)(const T*, float*, int, int, int)) {
    constexpr int W = ColVec<T>::W;
    const Shape s{19, 2 * W, 8};
    const int nb = (s.rows + s.rows_per_block - 1) / s.rows_per_block;
    T* y = buffer<T>((size_t)s.rows * s.cols);
    Rng rng(5);
    const Vec yv = fill_random(y, (size_t)s.rows * s.cols, rng, -1.0f, 1.0f);
    float* partial = buffer<float>((size_t)nb * s.cols);
    fill_poison(partial, (size_t)nb * s.cols);
    emu::launch(vec, dim3(1, nb), dim3(MT_COLSUM_LANES, MT_COLSUM_RUNS), 0, (const T*)y, partial,
                s.rows, s.cols, s.rows_per_block);
    tally.check(fmt("colsum %s vector partial, small", type_name<T>()),
                rel_l2(read(partial, (size_t)nb * s.cols), want_vec_partial(yv, s, nb)), 0.0);
}

/// act_bwd_colsum_*: the gradient bit for bit act_bwd's (out of place, and in place over dy)
/// and the partials bit for bit colsum_partial_vec's over that gradient, for every activation,
/// on the vector shapes of test_colsum (runs short, empty, several lane groups).
template <class T>
static void test_act_colsum(void (*fused)(const T*, const T*, T*, float*, int, int, int, int),
                            void (*act_bwd)(const T*, const T*, T*, long long, int),
                            void (*vec)(const T*, float*, int, int, int)) {
    constexpr int W = ColVec<T>::W;
    const Shape shapes[] = {{1, 8, 256},  {5, 24, 64},  {70, 264, 64}, {130, 256, 100},
                            {33, 40, 7},  {300, 32 * W, 128}, {257, 72, 256}, {67, 8 * W + 4, 9}};
    Rng rng(23);
    for (const Shape& s : shapes) {
        if (s.cols % W != 0) continue;
        const int nb = (s.rows + s.rows_per_block - 1) / s.rows_per_block;
        const size_t n = (size_t)s.rows * s.cols;
        const int groups = (s.cols / W + MT_COLSUM_LANES - 1) / MT_COLSUM_LANES;
        for (int kind = 0; kind < 5; ++kind) {
            T* saved = buffer<T>(n);
            T* dy = buffer<T>(n);
            fill_random(saved, n, rng, -3.0f, 3.0f);
            fill_random(dy, n, rng, -1.0f, 1.0f);
            T* want = buffer<T>(n);
            emu::launch(act_bwd, dim3(7), dim3(256), 0, (const T*)saved, (const T*)dy, want,
                        (long long)n, kind);
            float* want_partial = buffer<float>((size_t)nb * s.cols);
            emu::launch(vec, dim3(groups, nb), dim3(MT_COLSUM_LANES, MT_COLSUM_RUNS), 0,
                        (const T*)want, want_partial, s.rows, s.cols, s.rows_per_block);
            for (int in_place = 0; in_place < 2; ++in_place) {
                T* dx = in_place ? dy : buffer<T>(n);
                if (!in_place) fill_poison(dx, n);
                float* partial = buffer<float>((size_t)nb * s.cols);
                fill_poison(partial, (size_t)nb * s.cols);
                emu::launch(fused, dim3(groups, nb), dim3(MT_COLSUM_LANES, MT_COLSUM_RUNS), 0,
                            (const T*)saved, (const T*)dy, dx, partial, s.rows, s.cols,
                            s.rows_per_block, kind);
                const std::string tag = fmt("act_bwd_colsum %s kind=%d rows=%d cols=%d rpb=%d in_place=%d",
                                            type_name<T>(), kind, s.rows, s.cols, s.rows_per_block, in_place);
                bool same = std::memcmp(dx, want, n * sizeof(T)) == 0;
                tally.check_true(tag + " gradient as act_bwd's", same);
                same = std::memcmp(partial, want_partial, (size_t)nb * s.cols * sizeof(float)) == 0;
                tally.check_true(tag + " partials as colsum_partial_vec's", same);
            }
        }
    }
}

/// bias_add: every row plus the bias, rounded to T once, on a ragged shape and a grid too
/// small to cover it (the grid-stride loop).
template <class T>
static void test_bias_add(void (*kernel)(T*, const T*, long long, int)) {
    kt::Rng rng(77);
    for (int grid : {1, 7}) {
        const long long rows = 37;
        const int cols = 29;
        T* y = kt::buffer<T>(rows * cols);
        T* b = kt::buffer<T>(cols);
        const auto yv = kt::fill_random(y, rows * cols, rng, -2.0f, 2.0f);
        const auto bv = kt::fill_random(b, cols, rng, -1.0f, 1.0f);
        emu::launch(kernel, dim3(grid), dim3(256), 0, y, (const T*)b, rows, cols);
        std::vector<double> want(rows * cols);
        for (long long i = 0; i < rows * cols; ++i)
            want[i] = to_f32(from_f32<T>((float)yv[i] + (float)bv[i % cols]));
        tally.check(kt::fmt("bias_add %s grid=%d", kt::type_name<T>(), grid),
                    kt::rel_l2(kt::read(y, rows * cols), want), 0.0);
    }
}

int main() {
    test_bias_add<float>(bias_add_f32);
    test_bias_add<bf16>(bias_add_bf16);
    test_bias_add<f16>(bias_add_f16);
    test_colsum<float>(colsum_partial_f32, colsum_partial_vec_f32);
    test_colsum<bf16>(colsum_partial_bf16, colsum_partial_vec_bf16);
    test_colsum<f16>(colsum_partial_f16, colsum_partial_vec_f16);
    test_vector_bounds<float>(colsum_partial_vec_f32);
    test_vector_bounds<bf16>(colsum_partial_vec_bf16);
    test_vector_bounds<f16>(colsum_partial_vec_f16);
    test_act_colsum<float>(act_bwd_colsum_f32, act_bwd_f32, colsum_partial_vec_f32);
    test_act_colsum<bf16>(act_bwd_colsum_bf16, act_bwd_bf16, colsum_partial_vec_bf16);
    test_act_colsum<f16>(act_bwd_colsum_f16, act_bwd_f16, colsum_partial_vec_f16);
    return tally.finish("bias");
}
