// Tests of embedding.cu on the CPU emulator: forward against a gather, backward against a
// double scatter-add (with the host-side grouping the Rust side builds).
#include "cuda_emu.h"
#include "common.cuh"
#include "embedding.cu"
#include "kernel_test_util.h"

using namespace kt;

static Tally tally;

/// The Rust side's TokenGroups: a stable counting sort of the token rows by id.
struct Groups {
    std::vector<int> order, starts, uniq;
};

static Groups group(const std::vector<int>& ids, int vocab) {
    std::vector<int> count(vocab, 0);
    for (int id : ids) ++count[id];
    Groups g;
    std::vector<int> first(vocab, 0);
    int at = 0;
    for (int v = 0; v < vocab; ++v) {
        first[v] = at;
        if (count[v]) {
            g.uniq.push_back(v);
            g.starts.push_back(at);
        }
        at += count[v];
    }
    g.starts.push_back(at);
    g.order.resize(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) g.order[first[ids[i]]++] = (int)i;
    return g;
}

static void test(int vocab, int batch, int seq, int max_seq, int d, uint64_t seed) {
    Rng rng(seed);
    const int tokens = batch * seq;
    const std::string tag = fmt("embedding vocab=%d batch=%d seq=%d d=%d", vocab, batch, seq, d);
    float* wte = buffer<float>((size_t)vocab * d);
    float* wpe = buffer<float>((size_t)max_seq * d);
    const auto tev = fill_random(wte, (size_t)vocab * d, rng, -1.0f, 1.0f);
    const auto pev = fill_random(wpe, (size_t)max_seq * d, rng, -1.0f, 1.0f);
    int* ids = buffer<int>(tokens);
    int* pos_of = buffer<int>(seq);
    std::vector<int> idv(tokens), posv(seq);
    // Skewed ids (small ones repeat a lot) and a position map that is a permutation of a
    // subset of [0, max_seq).
    for (int i = 0; i < tokens; ++i) ids[i] = idv[i] = rng.below(2) ? rng.below(3) % vocab : rng.below(vocab);
    std::vector<int> perm(max_seq);
    for (int i = 0; i < max_seq; ++i) perm[i] = i;
    for (int i = max_seq - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
    for (int p = 0; p < seq; ++p) pos_of[p] = posv[p] = perm[p];

    // Forward.
    for (int small_grid = 0; small_grid < 2; ++small_grid) {
        float* y = buffer<float>((size_t)tokens * d);
        fill_poison(y, (size_t)tokens * d);
        emu::launch(embedding_fwd, dim3(small_grid ? 1 : grid_for((long long)tokens * d)), dim3(256), 0,
                    (const int*)ids, (const float*)wte, (const float*)wpe, (const int*)pos_of, y, tokens, seq, d);
        std::vector<double> want((size_t)tokens * d);
        for (int i = 0; i < tokens; ++i)
            for (int c = 0; c < d; ++c)
                want[(size_t)i * d + c] = (double)((float)tev[(size_t)idv[i] * d + c] + (float)pev[(size_t)posv[i % seq] * d + c]);
        tally.check(tag + fmt(" fwd grid=%s", small_grid ? "1" : "full"), rel_l2(read(y, (size_t)tokens * d), want), 0.0);
    }

    // Backward: the gradients accumulate into random values.
    float* dy = buffer<float>((size_t)tokens * d);
    const auto dyv = fill_random(dy, (size_t)tokens * d, rng, -1.0f, 1.0f);
    const Groups g = group(idv, vocab);
    const int uc = (int)g.uniq.size();
    int* order = buffer<int>(tokens);
    int* starts = buffer<int>(uc + 1);
    int* uniq = buffer<int>(uc);
    int* count = buffer<int>(1);
    *count = uc;
    std::copy(g.order.begin(), g.order.end(), order);
    std::copy(g.starts.begin(), g.starts.end(), starts);
    std::copy(g.uniq.begin(), g.uniq.end(), uniq);
    for (int small_grid = 0; small_grid < 2; ++small_grid) {
        float* dwte = buffer<float>((size_t)vocab * d);
        auto want = fill_random(dwte, (size_t)vocab * d, rng, -1.0f, 1.0f);
        // The full grid has more blocks than ids (the host launches one per token): the
        // surplus ones idle.
        const unsigned grid = small_grid ? 2 : (unsigned)uc + 3;
        emu::launch(embedding_bwd_tokens, dim3(grid), dim3(256), 0, (const float*)dy, (const int*)order,
                    (const int*)starts, (const int*)uniq, dwte, (const int*)count, d);
        for (int i = 0; i < tokens; ++i)
            for (int c = 0; c < d; ++c) want[(size_t)idv[i] * d + c] += dyv[(size_t)i * d + c];
        tally.check(tag + fmt(" bwd tokens grid=%u", grid), rel_l2(read(dwte, (size_t)vocab * d), want), 1e-6);

        float* dwpe = buffer<float>((size_t)max_seq * d);
        auto wantp = fill_random(dwpe, (size_t)max_seq * d, rng, -1.0f, 1.0f);
        emu::launch(embedding_bwd_positions, dim3(small_grid ? 1 : grid_for((long long)seq * d)), dim3(256), 0,
                    (const float*)dy, (const int*)pos_of, dwpe, batch, seq, d);
        for (int b = 0; b < batch; ++b)
            for (int p = 0; p < seq; ++p)
                for (int c = 0; c < d; ++c)
                    wantp[(size_t)posv[p] * d + c] += dyv[((size_t)b * seq + p) * d + c];
        tally.check(tag + fmt(" bwd positions grid=%s", small_grid ? "1" : "full"),
                    rel_l2(read(dwpe, (size_t)max_seq * d), wantp), 1e-6);
    }
}

/// A vocabulary-parallel rank's share: ids < 0 are tokens of other ranks' rows, whose table
/// part is zero (positions still added when the table is given).
static void test_foreign_ids(int d, bool positions, uint64_t seed) {
    Rng rng(seed);
    const int vocab = 5, tokens = 23, seq = 23;
    float* wte = buffer<float>((size_t)vocab * d);
    float* wpe = buffer<float>((size_t)seq * d);
    const auto tev = fill_random(wte, (size_t)vocab * d, rng, -1.0f, 1.0f);
    const auto pev = fill_random(wpe, (size_t)seq * d, rng, -1.0f, 1.0f);
    int* ids = buffer<int>(tokens);
    int* pos_of = buffer<int>(seq);
    for (int i = 0; i < tokens; ++i) {
        ids[i] = rng.below(3) == 0 ? -1 : (int)rng.below(vocab);
        pos_of[i] = i;
    }
    float* y = buffer<float>((size_t)tokens * d);
    fill_poison(y, (size_t)tokens * d);
    emu::launch(embedding_fwd, dim3(grid_for((long long)tokens * d)), dim3(256), 0, (const int*)ids,
                (const float*)wte, positions ? (const float*)wpe : (const float*)nullptr,
                (const int*)pos_of, y, tokens, seq, d);
    std::vector<double> want((size_t)tokens * d);
    for (int i = 0; i < tokens; ++i)
        for (int c = 0; c < d; ++c) {
            const float a = ids[i] < 0 ? 0.0f : (float)tev[(size_t)ids[i] * d + c];
            want[(size_t)i * d + c] = positions ? (double)(a + (float)pev[(size_t)i * d + c]) : a;
        }
    tally.check(fmt("embedding with foreign ids d=%d positions=%d", d, (int)positions),
                rel_l2(read(y, (size_t)tokens * d), want), 0.0);
}

int main() {
    test(11, 3, 4, 6, 8, 41);     // float4 path
    test(11, 3, 4, 4, 6, 42);     // scalar path (d % 4 != 0)
    test(7, 1, 1, 1, 1, 43);      // tiny
    test(50, 5, 9, 12, 260, 44);  // > 256 columns per row, batch > the 4-row unroll
    test(3, 9, 2, 5, 12, 45);     // few ids, many repeats
    test(2, 20, 3, 4, 8, 46);     // ids with 16+ rows: full batches and a partial one
    for (int d : {8, 6})
        for (bool positions : {false, true}) test_foreign_ids(d, positions, 40 + d);
    return tally.finish("embedding");
}
