// Tests of decode.cu on the CPU emulator against double-precision definitions: the new rows'
// keys and values appended to a key/value cache (bit-exact copies of the right K/V heads),
// and the new rows' causal attention over the cache. Head sizes 8 (the tests' tiny models),
// 32, 64, 128 and 160 (more values than threads); grouped-query (2 and 3 query heads per
// key/value head) and not; caches of 1, 7 and 130 positions reached by one-row steps and by
// multi-row prefills, and a one-block grid for the append (grid-stride). Outputs and the cache
// past the new rows are NaN-poisoned: an unwritten output, or a read past a row's positions,
// fails.
#include "cuda_emu.h"
#include "common.cuh"
#include "decode.cu"
#include "kernel_test_util.h"

using namespace kt;

static Tally tally;

struct Case {
    int heads, kv_heads, hd;
    int start, rows;  // cache positions before, new rows: the last row sees start + rows
    int window = 0;   // a sliding window: each row sees at most this many positions (0: all)
};

/// The Rust side's shared memory for the attention launch (crates/tensor/src/cuda/decode.rs).
static size_t attn_smem(int hd, int positions, int threads) {
    return (size_t)(hd + positions + std::max(threads, hd)) * sizeof(float);
}

static void run(const Case& c, Rng& rng, bool one_block) {
    const int H = c.heads, Hkv = c.kv_heads, hd = c.hd, g = H / Hkv;
    const int total = c.start + c.rows;
    const int capacity = total + 3;  // the cache's room: rows past `total` stay poisoned
    const long long kvw = (long long)Hkv * hd, row = 3LL * H * hd;
    const std::string tag = fmt("decode H=%d Hkv=%d hd=%d start=%d rows=%d window=%d%s", H, Hkv,
                                hd, c.start, c.rows, c.window, one_block ? " one-block" : "");

    float* qkv = buffer<float>((size_t)c.rows * row);
    const auto qkvv = fill_random(qkv, (size_t)c.rows * row, rng, -1.0f, 1.0f);
    float* keys = buffer<float>((size_t)capacity * kvw);
    float* values = buffer<float>((size_t)capacity * kvw);
    fill_poison(keys, (size_t)capacity * kvw);
    fill_poison(values, (size_t)capacity * kvw);
    // The earlier positions' keys and values (a larger spread than q: peaked softmaxes too).
    auto kv_k = fill_random(keys, (size_t)c.start * kvw, rng, -2.0f, 2.0f);
    auto kv_v = fill_random(values, (size_t)c.start * kvw, rng, -1.0f, 1.0f);

    // Append.
    const long long n = (long long)c.rows * kvw;
    emu::launch(decode_append_kv_f32, dim3(one_block ? 1 : grid_for(n)), dim3(256), 0,
                (const float*)qkv, keys, values, c.rows, c.start, H, Hkv, hd);
    bool exact = true;
    kv_k.resize((size_t)total * kvw);
    kv_v.resize((size_t)total * kvw);
    for (int i = 0; i < c.rows; ++i)
        for (int j = 0; j < Hkv; ++j)
            for (int d = 0; d < hd; ++d) {
                const size_t at = ((size_t)(c.start + i) * Hkv + j) * hd + d;
                const double k = qkvv[(size_t)i * row + (size_t)(H + j * g) * hd + d];
                const double v = qkvv[(size_t)i * row + (size_t)(2 * H + j * g) * hd + d];
                kv_k[at] = k;
                kv_v[at] = v;
                exact &= (double)keys[at] == k && (double)values[at] == v;
            }
    // Nothing else written: the earlier positions kept, the room after the new rows untouched.
    for (size_t at = 0; at < (size_t)capacity * kvw; ++at) {
        if (at < (size_t)total * kvw) {
            exact &= (double)keys[at] == kv_k[at] && (double)values[at] == kv_v[at];
        } else {
            exact &= std::isnan(keys[at]) && std::isnan(values[at]);
        }
    }
    tally.check_true(tag + " append: the K/V heads copied bit-exactly, nothing else written",
                     exact);

    // Attention.
    if (one_block) return;
    float* out = buffer<float>((size_t)c.rows * H * hd);
    fill_poison(out, (size_t)c.rows * H * hd);
    const float scale = 1.0f / std::sqrt((float)hd);
    const int threads = 128;
    emu::launch(decode_attn_f32, dim3(H, c.rows), dim3(threads), attn_smem(hd, total, threads),
                (const float*)qkv, (const float*)keys, (const float*)values, out, c.rows,
                c.start, H, Hkv, hd, scale, c.window);
    std::vector<double> want((size_t)c.rows * H * hd);
    for (int i = 0; i < c.rows; ++i) {
        const int len = c.start + i + 1;
        const int first = c.window > 0 ? std::max(0, len - c.window) : 0;
        for (int h = 0; h < H; ++h) {
            const int j = h / g;
            std::vector<double> s(len);
            double m = -INFINITY;
            for (int p = first; p < len; ++p) {
                double dot = 0.0;
                for (int d = 0; d < hd; ++d)
                    dot += qkvv[(size_t)i * row + (size_t)h * hd + d] *
                           kv_k[((size_t)p * Hkv + j) * hd + d];
                s[p] = dot / std::sqrt((double)hd);
                m = std::max(m, s[p]);
            }
            double l = 0.0;
            for (int p = first; p < len; ++p) l += (s[p] = std::exp(s[p] - m));
            for (int d = 0; d < hd; ++d) {
                double acc = 0.0;
                for (int p = first; p < len; ++p) acc += s[p] * kv_v[((size_t)p * Hkv + j) * hd + d];
                want[((size_t)i * H + h) * hd + d] = acc / l;
            }
        }
    }
    tally.check(tag + " attention", rel_l2(read(out, want.size()), want), 1e-5);
}

int main() {
    Rng rng(2024);
    // (heads, kv_heads): no grouping, groups of 2, groups of 3, one key/value head.
    const int groupings[][2] = {{4, 4}, {4, 2}, {6, 2}, {2, 1}};
    // (start, rows): cache lengths 1, 7 and 130 by steps and by prefills.
    const int lengths[][2] = {{0, 1}, {6, 1}, {129, 1}, {0, 7}, {3, 4}, {123, 7}, {0, 130}};
    for (int hd : {32, 64, 128}) {
        for (const auto& gr : groupings) {
            for (const auto& len : lengths) {
                // The 130-row prefill once per head size: it is slow on the emulator.
                if (len[1] == 130 && gr[0] != 4) continue;
                run(Case{gr[0], gr[1], hd, len[0], len[1]}, rng, false);
            }
        }
    }
    // Tiny heads (fewer values than lanes) and heads wider than the block.
    for (int hd : {8, 160}) {
        for (const auto& len : lengths) {
            if (len[1] == 130) continue;
            run(Case{4, 2, hd, len[0], len[1]}, rng, false);
        }
    }
    // Mistral's sliding window: one position, fewer than the cache, more than it.
    for (int window : {1, 5, 200}) {
        run(Case{4, 2, 64, 129, 1, window}, rng, false);
        run(Case{4, 2, 32, 123, 7, window}, rng, false);
        run(Case{4, 4, 160, 3, 4, window}, rng, false);
    }
    // The append's grid-stride loop on one block.
    run(Case{6, 2, 64, 5, 9}, rng, true);
    run(Case{4, 4, 128, 0, 3}, rng, true);
    return tally.finish("decode_test");
}
