// decode.cu: incremental decoding with a key/value cache (`meshtrain generate --device cuda`,
// the attention layer's cached pass on a device, crates/nn/src/device.rs): the new tokens'
// keys and values appended to a layer's cache, and the new tokens' causal attention over it.
// f32 only: decoding runs in f32. See ABI.md ("decode.cu").
//
// Layouts (the CPU cached pass's, meshtrain_tensor::attention::cached_attention_forward):
// - `qkv`: the new rows' `[Q | K | V]`, `[rows, 3·H·hd]`, head h of each part at columns
//   h·hd.. (GPT's fused projection as it is; Llama's after the rotary pass, which rotated q
//   and k and repeated each key/value head j into the K/V heads j·g .. j·g + g − 1, g = H/Hkv);
// - `keys`, `values`: the cache, `[positions, Hkv·hd]` each (position p's row at p·Hkv·hd);
//   rows 0..start hold the earlier positions, the new rows go to start..start+rows.
// Query head h reads key/value head h / g (grouped-query attention). Row i of the new rows is
// position start + i and sees the positions 0 ..= start + i, or under a sliding window of w
// (w > 0) only the last w of them.

// ---------------------------------------------------------------------------------------
// Append: key/value head j of row i is the K (V) head j·g of its [Q | K | V] row (the first
// of the group's copies, as the CPU decoder keeps it). Any grid over rows·Hkv·hd.

extern "C" __global__ void __launch_bounds__(256)
decode_append_kv_f32(const float* __restrict__ qkv, float* __restrict__ keys,
                     float* __restrict__ values, int rows, int start, int heads, int kv_heads,
                     int head_dim) {
    const int g = heads / kv_heads;
    const long long kvw = (long long)kv_heads * head_dim;
    const long long row_in = 3LL * heads * head_dim, part = (long long)heads * head_dim;
    const long long n = (long long)rows * kvw;
    for (long long u = global_thread(); u < n; u += grid_threads()) {
        const long long r = u / kvw;
        const int c = (int)(u - r * kvw);  // column of the cache row: head j, value d
        const int j = c / head_dim, d = c - j * head_dim;
        const float* src = qkv + r * row_in + (long long)j * g * head_dim + d;
        const long long dst = ((long long)start + r) * kvw + c;
        keys[dst] = src[part];
        values[dst] = src[2 * part];
    }
}

// ---------------------------------------------------------------------------------------
// Attention of the new rows over the cache (which already holds them: append first). One
// block per (query head h = blockIdx.x, new row i = blockIdx.y), blockDim.x a multiple of 32
// (128 used), positions `first` .. `len` − 1 (len = start + i + 1; first = 0, or len − w under
// a window w). Dynamic shared memory, floats: hd (the query) + start + rows (the scores, then
// the weights, at their positions) + max(blockDim.x, hd) (partial sums).
//
// 1. s_j = (Σ_d q_d·k_{j,d})·scale: warp w takes the positions j ≡ w (mod warps), its lanes
//    the values d ≡ lane (mod 32) (fp32, lane sums then the warp's butterfly);
// 2. m = max_j s_j; w_j = expf(s_j − m); l = Σ_j w_j (block sums, fixed order);
// 3. the head's values are cut into G = blockDim.x / hd groups of positions (1 when
//    hd ≥ blockDim.x): thread (group a, value d) sums w_j·v_{j,d} over j ≡ first + a (mod G)
//    in increasing j; out_d = (Σ_a partial_{a,d}, a increasing) / l.
// Every step's order is fixed by the shape and blockDim: the bits do not depend on timing.

extern "C" __global__ void __launch_bounds__(128)
decode_attn_f32(const float* __restrict__ qkv, const float* __restrict__ keys,
                const float* __restrict__ values, float* __restrict__ out, int rows, int start,
                int heads, int kv_heads, int head_dim, float scale, int window) {
    DYNAMIC_SMEM(float, smem);
    const int h = blockIdx.x, i = blockIdx.y;
    const int hd = head_dim, len = start + i + 1;
    const int first = window > 0 ? max(0, len - window) : 0;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    const long long kvw = (long long)kv_heads * hd;
    const int kv = h / (heads / kv_heads);
    const float* kbase = keys + (long long)kv * hd;
    const float* vbase = values + (long long)kv * hd;
    float* q = smem;
    float* w = q + hd;
    float* partial = w + start + rows;
    const int groups = (int)blockDim.x >= hd ? (int)blockDim.x / hd : 1;

    const float* qrow = qkv + (long long)i * 3 * heads * hd + (long long)h * hd;
    for (int d = tid; d < hd; d += blockDim.x) q[d] = qrow[d];
    __syncthreads();

    for (int j = first + warp; j < len; j += warps) {
        const float* k = kbase + (long long)j * kvw;
        float s = 0.0f;
        for (int d = lane; d < hd; d += 32) s += q[d] * k[d];
        s = warp_sum(s);
        if (lane == 0) w[j] = s * scale;
    }
    __syncthreads();

    float m = -INFINITY;
    for (int j = first + tid; j < len; j += blockDim.x) m = fmaxf(m, w[j]);
    m = block_max(m);
    float l = 0.0f;
    for (int j = first + tid; j < len; j += blockDim.x) {
        const float e = expf(w[j] - m);
        w[j] = e;
        l += e;
    }
    // block_sum's barriers also publish every thread's weights.
    l = block_sum(l);

    for (int e = tid; e < groups * hd; e += blockDim.x) {
        const int a = e / hd, d = e - a * hd;
        float acc = 0.0f;
        for (int j = first + a; j < len; j += groups) acc += w[j] * vbase[(long long)j * kvw + d];
        partial[e] = acc;
    }
    __syncthreads();

    float* o = out + ((long long)i * heads + h) * hd;
    for (int d = tid; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int a = 0; a < groups; ++a) acc += partial[a * hd + d];
        o[d] = acc / l;
    }
}
