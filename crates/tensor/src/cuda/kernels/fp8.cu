// fp8.cu: casts to FP8 (E4M3 or E5M2) for FP8 products, with per-tensor current scaling.
// See ABI.md, and crates/tensor/src/fp8.rs for the formats, the scaling and why.
//
// Two passes over a tensor, as current scaling needs (the scale comes from the tensor itself):
// 1. fp8_amax_{f32,bf16}(x, n, amax_bits): folds max |x[i]| into *amax_bits, the float's
//    bits as an int (non-negative floats order as their bits do; a NaN's bits exceed every
//    number's, so a NaN wins). The caller zeroes *amax_bits first. The maximum does not
//    depend on the order of the atomics: runs stay bit-identical.
// 2. fp8_cast_{f32,bf16}(x, y, n, e4m3, amax_bits, inv_scale): scale = max / amax (1 when
//    the amax is 0, infinite or NaN), as fp8::current_scale; y[i] = fp8(x[i] · scale),
//    rounded to nearest (ties to even) and saturating to ±448 (E4M3) or ±57,344 (E5M2), NaN
//    to 0x7F with x's sign: the codes of Fp8Format::encode on the CPU, bit for bit. Thread 0
//    of block 0 writes 1 / scale to *inv_scale, for the product's scale pointer. The scale
//    never goes through the host.
//
// 3. fp8_cast_transpose_{f32,bf16}(x, yt, rows, cols, e4m3, amax_bits, inv_scale): the cast of
//    the row-major [rows, cols] x written transposed, yt[c · rows + r]: cuBLASLt's FP8 products
//    take only "TN" operands, so backward's products read the weight, the input and the
//    output gradient transposed (Transformer Engine's cast-transpose). Block (32, 8), one
//    32 x 32 tile per block: codes staged in shared memory (a padded row per tile row),
//    rows read and columns written 32 bytes at a time. Grid (ceil(cols/32), ceil(rows/32)).
// 4. fp8_cast_both_{f32,bf16}(x, y, yt, rows, cols, e4m3, amax_bits, inv_scale): 2 and 3 from
//    one read of x, the launch of 3 (a backward's output gradient is wanted both ways: the
//    input gradient's operand and the weight gradient's).
//
// The rounding is integer arithmetic on the f32 bits, not the hardware's cvt.satfinite
// (sm_89+): one code path for every card and for the emulator; both passes are bound by
// memory (the cast reads 4 or 2 bytes and writes 1 an element).
//
// Grid-stride, block 256 (the amax's shared reduction assumes it): each block reduces its
// threads' maxima and makes one atomicMax.

// The FP8 code of x (sign in bit 7), as Fp8Format::encode.
__device__ __forceinline__ unsigned mt_fp8_encode(float x, int e4m3) {
    const unsigned bits = __float_as_uint(x);
    const unsigned sign = (bits >> 24) & 0x80u;
    if (isnan(x)) return sign | 0x7Fu;
    const unsigned magnitude = bits & 0x7FFFFFFFu;
    const int mantissa_bits = e4m3 ? 3 : 2;
    const int bias = e4m3 ? 7 : 15;
    const unsigned max_code = e4m3 ? 0x7Eu : 0x7Bu;
    // 2^(1 - bias): 2^-6 or 2^-14, exact.
    const float min_normal = __uint_as_float((unsigned)(127 + 1 - bias) << 23);
    unsigned code;
    if (__uint_as_float(magnitude) < min_normal) {
        // Units of the smallest subnormal (a power of two: exact), rounded to the nearest
        // integer with ties to even by adding and taking away 2^23 (no fast math here).
        const float unit = __uint_as_float((unsigned)(127 + 1 - bias - mantissa_bits) << 23);
        const float units = __uint_as_float(magnitude) / unit;
        const float magic = 8388608.0f;
        code = (unsigned)((units + magic) - magic);
    } else {
        // Drop the low mantissa bits, round to nearest even (a carry into the exponent is
        // the right result), rebias the exponent.
        const int shift = 23 - mantissa_bits;
        const unsigned long long rounded =
            ((unsigned long long)magnitude + ((1u << (shift - 1)) - 1u) + ((magnitude >> shift) & 1u)) >>
            shift;
        const unsigned long long rebias = (unsigned long long)(127 - bias) << mantissa_bits;
        const unsigned long long c = rounded - rebias;
        code = c > max_code ? max_code : (unsigned)c;
    }
    return sign | (code > max_code ? max_code : code);
}

// The largest finite value of the format.
__device__ __forceinline__ float mt_fp8_max(int e4m3) { return e4m3 ? 448.0f : 57344.0f; }

// The current scale of a tensor whose amax (its bits) is at amax_bits: max / amax, or 1 when
// the amax is 0, infinite or NaN (fp8::current_scale).
__device__ __forceinline__ float mt_fp8_scale(const int* __restrict__ amax_bits, int e4m3) {
    const float amax = __int_as_float(*amax_bits);
    if (isfinite(amax) && amax > 0.0f) {
        const float q = mt_fp8_max(e4m3) / amax;
        if (isfinite(q)) return q;
    }
    return 1.0f;
}

template <class T>
__device__ __forceinline__ void fp8_amax_impl(const T* __restrict__ x, long long n, int* __restrict__ amax_bits) {
    int local = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int a = (int)(__float_as_uint(to_f32(x[i])) & 0x7FFFFFFFu);
        local = a > local ? a : local;
    }
    __shared__ int maxima[256];
    maxima[threadIdx.x] = local;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if ((int)threadIdx.x < half) {
            const int other = maxima[threadIdx.x + half];
            if (other > maxima[threadIdx.x]) maxima[threadIdx.x] = other;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicMax(amax_bits, maxima[0]);
}

template <class T>
__device__ __forceinline__ void fp8_cast_impl(const T* __restrict__ x, unsigned char* __restrict__ y, long long n,
                                              int e4m3, const int* __restrict__ amax_bits,
                                              float* __restrict__ inv_scale) {
    const float s = mt_fp8_scale(amax_bits, e4m3);
    if (blockIdx.x == 0 && threadIdx.x == 0) *inv_scale = 1.0f / s;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = (unsigned char)mt_fp8_encode(to_f32(x[i]) * s, e4m3);
}

extern "C" __global__ void __launch_bounds__(256)
    fp8_amax_f32(const float* __restrict__ x, long long n, int* __restrict__ amax_bits) {
    fp8_amax_impl(x, n, amax_bits);
}

extern "C" __global__ void __launch_bounds__(256)
    fp8_amax_bf16(const bf16* __restrict__ x, long long n, int* __restrict__ amax_bits) {
    fp8_amax_impl(x, n, amax_bits);
}

extern "C" __global__ void __launch_bounds__(256)
    fp8_cast_f32(const float* __restrict__ x, unsigned char* __restrict__ y, long long n, int e4m3,
                 const int* __restrict__ amax_bits, float* __restrict__ inv_scale) {
    fp8_cast_impl(x, y, n, e4m3, amax_bits, inv_scale);
}

extern "C" __global__ void __launch_bounds__(256)
    fp8_cast_bf16(const bf16* __restrict__ x, unsigned char* __restrict__ y, long long n, int e4m3,
                  const int* __restrict__ amax_bits, float* __restrict__ inv_scale) {
    fp8_cast_impl(x, y, n, e4m3, amax_bits, inv_scale);
}

/// `y` (may be null): the codes as they are too, row-major, written from the same read.
template <class T>
__device__ __forceinline__ void fp8_cast_transpose_impl(const T* __restrict__ x, unsigned char* __restrict__ y,
                                                        unsigned char* __restrict__ yt,
                                                        int rows, int cols, int e4m3,
                                                        const int* __restrict__ amax_bits,
                                                        float* __restrict__ inv_scale) {
    const float s = mt_fp8_scale(amax_bits, e4m3);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) *inv_scale = 1.0f / s;
    __shared__ unsigned char tile[32][33];
    const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
        const int r = r0 + i, c = c0 + threadIdx.x;
        if (r < rows && c < cols) {
            const long long at = (long long)r * cols + c;
            const unsigned char code = (unsigned char)mt_fp8_encode(to_f32(x[at]) * s, e4m3);
            tile[i][threadIdx.x] = code;
            if (y) y[at] = code;
        }
    }
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
        const int c = c0 + i, r = r0 + threadIdx.x;
        if (r < rows && c < cols) yt[(long long)c * rows + r] = tile[threadIdx.x][i];
    }
}

extern "C" __global__ void __launch_bounds__(256)
    fp8_cast_transpose_f32(const float* __restrict__ x, unsigned char* __restrict__ yt, int rows, int cols,
                           int e4m3, const int* __restrict__ amax_bits, float* __restrict__ inv_scale) {
    fp8_cast_transpose_impl(x, (unsigned char*)nullptr, yt, rows, cols, e4m3, amax_bits, inv_scale);
}

extern "C" __global__ void __launch_bounds__(256)
    fp8_cast_transpose_bf16(const bf16* __restrict__ x, unsigned char* __restrict__ yt, int rows, int cols,
                            int e4m3, const int* __restrict__ amax_bits, float* __restrict__ inv_scale) {
    fp8_cast_transpose_impl(x, (unsigned char*)nullptr, yt, rows, cols, e4m3, amax_bits, inv_scale);
}

// fp8_cast_both: see 4. above.
extern "C" __global__ void __launch_bounds__(256)
    fp8_cast_both_f32(const float* __restrict__ x, unsigned char* __restrict__ y, unsigned char* __restrict__ yt,
                      int rows, int cols, int e4m3, const int* __restrict__ amax_bits,
                      float* __restrict__ inv_scale) {
    fp8_cast_transpose_impl(x, y, yt, rows, cols, e4m3, amax_bits, inv_scale);
}

extern "C" __global__ void __launch_bounds__(256)
    fp8_cast_both_bf16(const bf16* __restrict__ x, unsigned char* __restrict__ y, unsigned char* __restrict__ yt,
                       int rows, int cols, int e4m3, const int* __restrict__ amax_bits,
                       float* __restrict__ inv_scale) {
    fp8_cast_transpose_impl(x, y, yt, rows, cols, e4m3, amax_bits, inv_scale);
}
