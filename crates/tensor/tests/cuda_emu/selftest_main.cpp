// Tests of the CPU emulator itself (cuda_emu.h): barriers and shared memory, warp shuffles
// and votes (widths, partial warps, exited lanes), atomics, WMMA tile semantics, 16-bit
// rounding, launch checks, the reports of deadlocks, misused collectives and overruns, and
// wgmma products with the emulator's checks of them.
// Each case compares with a reference written here from CUDA's documented semantics.
// Run by run_emu_tests.sh (which runs it under two schedules).
#include "cuda_emu.h"

#include "selftest.cu"

#include <sys/wait.h>

#include <map>

namespace {

/// The message of the emu::Error that `f` throws ("" if none).
template <class F> std::string error_of(F&& f) {
    try {
        f();
    } catch (const emu::Error& e) {
        return e.what();
    }
    return "";
}

bool contains(const std::string& s, const char* what) { return s.find(what) != std::string::npos; }

#define CHECK_ERROR(msg, ...)                                                                \
    do {                                                                                     \
        const std::string m_ = (msg);                                                        \
        for (const char* w_ : {__VA_ARGS__})                                                 \
            EMU_CHECKF(contains(m_, w_), "the error should mention \"%s\"; it is: %s", w_,   \
                       m_.empty() ? "(no error)" : m_.c_str());                              \
    } while (0)

/// Restores the schedule when it goes out of scope.
struct ScheduleScope {
    emu::Schedule s = emu::schedule();
    std::uint64_t seed = emu::detail::options().seed;
    ~ScheduleScope() { emu::set_schedule(s, seed); }
};

// ---------------------------------------------------------------------------------------

void test_reduce() {
    const int n = 3000;
    emu::Rng rng(1);
    std::vector<float> x(n);
    for (auto& v : x) v = (float)((int)rng.below(2001) - 1000); // integers: exact sums
    for (int threads : {32, 256, 1024}) {
        const int blocks = (n + threads - 1) / threads;
        float* dx = emu::upload(x);
        float* out = emu::alloc<float>(blocks);
        emu::launch(st_reduce, blocks, threads, 0, dx, out, n);
        for (int b = 0; b < blocks; ++b) {
            double want = 0;
            for (int i = b * threads; i < std::min(n, (b + 1) * threads); ++i) want += x[i];
            EMU_CHECKF(out[b] == (float)want, "threads %d block %d: got %g want %g", threads, b,
                       out[b], want);
        }
        emu::free(dx);
        emu::free(out);
    }
}

void test_schedules() {
    ScheduleScope keep;
    // A race-free kernel gives the same bits under every schedule.
    const int n = 5000;
    emu::Rng rng(2);
    std::vector<float> x(n);
    for (auto& v : x) v = rng.normal();
    float* dx = emu::upload(x);
    std::vector<std::vector<float>> results;
    for (auto s : {emu::Schedule::Forward, emu::Schedule::Reverse, emu::Schedule::Random}) {
        emu::set_schedule(s, 99);
        float* out = emu::alloc<float>(20);
        emu::launch(st_reduce, 20, 256, 0, dx, out, n);
        results.push_back(emu::download(out, 20));
        emu::free(out);
    }
    emu::check_equal("reverse vs forward", results[1].data(), results[0].data(), 20);
    emu::check_equal("random vs forward", results[2].data(), results[0].data(), 20);

    // A racy one does not: that is how running under two schedules exposes races.
    std::vector<std::vector<int>> racy;
    for (auto s : {emu::Schedule::Forward, emu::Schedule::Reverse}) {
        emu::set_schedule(s);
        int* out = emu::alloc<int>(64);
        emu::launch(st_race, 1, 64, 0, out);
        racy.push_back(emu::download(out, 64));
        emu::free(out);
    }
    EMU_CHECKF(racy[0] != racy[1], "the racy kernel gave the same result under both schedules");
    // Forward: thread t runs before t+1 wrote its slot, so it reads the garbage byte pattern.
    EMU_CHECKF(racy[0][0] == (int)0xCDCDCDCD && racy[0][63] == 0, "forward: %d %d", racy[0][0],
               racy[0][63]);
    EMU_CHECKF(racy[1][0] == 1 && racy[1][63] == (int)0xCDCDCDCD, "reverse: %d %d", racy[1][0],
               racy[1][63]);
}

// Reference shuffles, from the CUDA programming guide's description.
int ref_idx(int lane, int src, int w) { return lane / w * w + ((src % w) + w) % w; }
int ref_up(int lane, int d, int w) { return lane - d < lane / w * w ? lane : lane - d; }
int ref_down(int lane, int d, int w) { return lane + d >= lane / w * w + w ? lane : lane + d; }
int ref_xor(int lane, int m, int w) {
    const int s = lane ^ m;
    return s / w > lane / w ? lane : s; // later groups: own value; earlier groups: allowed
}

void test_shuffles() {
    const int threads = 64, blocks = 2, n = threads * blocks;
    emu::Rng rng(3);
    std::vector<float> x(n);
    for (auto& v : x) v = (float)((int)rng.below(200) - 100) * 0.25f; // exact sums
    float* dx = emu::upload(x);
    float* o = emu::alloc<float>(n * ST_SHFL_OUT);
    double* od = emu::alloc<double>(2 * n);
    long long* oll = emu::alloc<long long>(2 * n);
    unsigned* ov = emu::alloc<unsigned>(4 * n);
    emu::launch(st_shuffles, blocks, threads, 0, dx, o, od, oll, ov);
    for (int t = 0; t < n; ++t) {
        const int lane = t % 32, w0 = t - lane;
        auto X = [&](int l) { return x[w0 + l]; };
        float sum = 0;
        for (int l = 0; l < 32; ++l) sum += X(l);
        const float want[ST_SHFL_OUT] = {sum,
                                         X(ref_down(lane, 3, 32)),
                                         X(ref_up(lane, 5, 16)),
                                         X(ref_idx(lane, lane * 7 + 3, 8)),
                                         X(ref_idx(lane, -1, 16)),
                                         X(ref_xor(lane, 16, 16)),
                                         X(ref_down(lane, 2, 4)),
                                         X(ref_xor(lane, 5, 8)),
                                         X(31 - lane),
                                         X(ref_up(lane, 1, 32)),
                                         X(ref_down(lane, 31, 32)),
                                         X(lane)};
        for (int k = 0; k < ST_SHFL_OUT; ++k)
            EMU_CHECKF(o[t * ST_SHFL_OUT + k] == want[k], "thread %d output %d: got %g want %g",
                       t, k, o[t * ST_SHFL_OUT + k], want[k]);
        auto D = [&](int l) { return (double)X(l) * 1.0000000001 + l * 1e-300; };
        EMU_CHECKF(od[2 * t] == D(lane ^ 1) && od[2 * t + 1] == D(ref_down(lane, 16, 32)),
                   "double shuffles of thread %d", t);
        auto LL = [&](int l) { return ((long long)l << 40) | (long long)(w0 + l); };
        EMU_CHECKF(oll[2 * t] == LL(ref_up(lane, 2, 32)) && oll[2 * t + 1] == LL(17),
                   "long long shuffles of thread %d", t);
        unsigned ballot = 0;
        for (int l = 0; l < 32; l += 3) ballot |= 1u << l;
        EMU_CHECKF(ov[4 * t] == ballot && ov[4 * t + 1] == 1 && ov[4 * t + 2] == 1 &&
                       ov[4 * t + 3] == 0,
                   "votes of thread %d: %08x %u %u %u", t, ov[4 * t], ov[4 * t + 1],
                   ov[4 * t + 2], ov[4 * t + 3]);
    }

    float* h = emu::alloc<float>(96);
    emu::launch(st_half_warps, 1, 32, 0, h);
    for (int l = 0; l < 32; ++l) {
        EMU_CHECKF(h[l] == (float)(l ^ 8), "half-warp syncwarp lane %d: %g", l, h[l]);
        EMU_CHECKF(h[32 + l] == (float)((l ^ 1) * (l ^ 1)), "half-warp shuffle lane %d", l);
        const unsigned want = l < 16 ? 0x0000aaaau : 0xaaaa0000u;
        EMU_CHECKF(h[64 + l] == (float)want, "half-warp ballot lane %d: %g", l, h[64 + l]);
    }
    for (void* p : {(void*)dx, (void*)o, (void*)od, (void*)oll, (void*)ov, (void*)h}) emu::free(p);
}

void test_partial_warp() {
    std::vector<float> x(48);
    for (int i = 0; i < 48; ++i) x[i] = (float)(i * i % 17);
    float* dx = emu::upload(x);
    float* o = emu::alloc<float>(48 * 3);
    unsigned* ov = emu::alloc<unsigned>(48);
    emu::launch(st_partial, 1, 48, 0, dx, o, ov);
    for (int t = 0; t < 48; ++t) {
        const int lane = t % 32, w0 = t - lane;
        auto M = [&](int l) { return x[47 - (w0 + l)]; };
        float sum = 0;
        for (int l = lane / 16 * 16; l < lane / 16 * 16 + 16; ++l) sum += M(l);
        EMU_CHECKF(o[t * 3] == sum, "thread %d: 16-lane xor sum %g, want %g", t, o[t * 3], sum);
        const int src = ref_down(lane, 8, 32);
        if (w0 + src < 48) {
            EMU_CHECKF(o[t * 3 + 1] == M(src), "thread %d: shfl_down %g want %g", t,
                       o[t * 3 + 1], M(src));
        } else {
            // Lanes 8-15 of the 16-lane warp read lanes that do not exist: undefined in CUDA,
            // garbage (NaN) in the emulator.
            EMU_CHECKF(std::isnan(o[t * 3 + 1]), "thread %d: reading a missing lane gave %g", t,
                       o[t * 3 + 1]);
        }
        EMU_CHECKF(ov[t] == (t < 32 ? 0xffffffffu : 0x0000ffffu), "thread %d ballot %08x", t,
                   ov[t]);
        EMU_CHECKF(o[t * 3 + 2] == 10.0f, "thread %d: __syncthreads_count %g", t, o[t * 3 + 2]);
    }

    float* e = emu::alloc<float>(64 * 32);
    emu::launch(st_exited_lanes, 2, 64, 0, e);
    for (int l = 0; l < 16; ++l) {
        EMU_CHECKF(std::isnan(e[l]), "a shuffle from an exited lane gave %g", e[l]);
        EMU_CHECKF(e[16 + l] == 16.0f, "16-lane sum with exited lanes: %g", e[16 + l]);
    }
    for (void* p : {(void*)dx, (void*)o, (void*)ov, (void*)e}) emu::free(p);
}

void test_shared_memory() {
    const int n = 750, blocks = 3; // 3000 bytes: not a multiple of 16 or 128
    unsigned* first = emu::alloc<unsigned>(blocks);
    unsigned* align = emu::alloc<unsigned>(blocks);
    float* o = emu::alloc<float>(blocks * n);
    emu::launch(st_dynamic, blocks, 96, n * sizeof(float), first, align, o, n);
    for (int b = 0; b < blocks; ++b) {
        EMU_CHECKF(first[b] == 0xCDCDCDCDu, "block %d saw %08x in fresh shared memory", b,
                   first[b]);
        EMU_CHECKF(align[b] == 0, "dynamic shared memory misaligned by %u", align[b]);
        for (int i = 0; i < n; ++i)
            EMU_CHECKF(o[b * n + i] == (float)(n - 1 - i + 1000 * b), "block %d element %d", b, i);
    }
    unsigned* seen = emu::alloc<unsigned>(4);
    emu::launch(st_static_poison, 4, 32, 0, seen);
    for (int b = 0; b < 4; ++b)
        EMU_CHECKF(seen[b] == 0xCDCDCDCDu, "block %d saw %08x in a fresh __shared__ variable", b,
                   seen[b]);
    for (void* p : {(void*)first, (void*)align, (void*)o, (void*)seen}) emu::free(p);
}

void test_indices() {
    const dim3 grid(2, 3, 2), block(8, 4, 3);
    const int nb = 12, nt = 96;
    int* out = emu::alloc<int>(nb * nt * 10);
    emu::launch(st_indices, grid, block, 0, out);
    for (int b = 0; b < nb; ++b) {
        for (int t = 0; t < nt; ++t) {
            const int* p = out + (b * nt + t) * 10;
            const int want[10] = {t % 8, t / 8 % 4, t / 32, b % 2, b / 2 % 3, b / 6, 32, 1, 0, 1};
            for (int k = 0; k < 10; ++k)
                EMU_CHECKF(p[k] == want[k], "block %d thread %d value %d: %d want %d", b, t, k,
                           p[k], want[k]);
        }
    }
    emu::free(out);
}

void test_atomics() {
    const int blocks = 3, threads = 100, n = blocks * threads;
    int* ci = emu::alloc<int>(4);
    unsigned* cu = emu::alloc<unsigned>(1);
    unsigned long long* cull = emu::alloc<unsigned long long>(2);
    float* cf = emu::alloc<float>(2);
    double* cd = emu::alloc<double>(1);
    int* mx = emu::alloc<int>(2);
    unsigned* bits = emu::alloc<unsigned>(3);
    int* cas = emu::alloc<int>(1);
    int* tickets = emu::alloc<int>(n);
    ci[0] = ci[1] = ci[2] = ci[3] = 0;
    *cu = 5;
    cull[0] = 1;
    cull[1] = 0;
    cf[0] = 0.0f;
    cf[1] = 0.0f;
    *cd = 1.0;
    mx[0] = -1;
    mx[1] = 1000;
    bits[0] = 0;
    bits[1] = 0xffffffffu;
    bits[2] = 0;
    *cas = -5;
    emu::launch(st_atomics, blocks, threads, 0, ci, cu, cull, cf, cd, mx, bits, cas, tickets);
    EMU_CHECKF(ci[0] == n && ci[1] == n && ci[2] == 7 && ci[3] == 1, "int counters %d %d %d %d",
               ci[0], ci[1], ci[2], ci[3]);
    EMU_CHECKF(*cu == 5u + 2u * n, "unsigned %u", *cu);
    EMU_CHECKF(cull[0] == 1ull + (unsigned long long)n * (1ull << 33), "unsigned long long");
    EMU_CHECKF(cull[1] >= 1 && cull[1] <= (unsigned long long)n, "CAS winner %llu", cull[1]);
    EMU_CHECKF(cf[0] == 0.5f * n && cf[1] == 2.5f && *cd == 1.0 + 0.25 * n, "float %g %g double %g",
               cf[0], cf[1], *cd);
    int wmax = -1, wmin = 1000, wcas = -5;
    for (int t = 0; t < n; ++t) {
        wmax = std::max(wmax, (t * 37) % 101);
        wmin = std::min(wmin, (t * 37) % 101 - 50);
        wcas = std::max(wcas, (t * 3) % 77);
    }
    EMU_CHECKF(mx[0] == wmax && mx[1] == wmin && *cas == wcas, "max %d min %d cas-max %d", mx[0],
               mx[1], *cas);
    unsigned and_mask = 0xffffffffu;
    for (int t = 0; t < n; ++t) and_mask &= ~(1u << (t % 29));
    EMU_CHECKF(bits[0] == 0xffffffffu && bits[1] == and_mask && bits[2] == 0x7fu,
               "bits %08x %08x %08x", bits[0], bits[1], bits[2]);
    std::vector<int> seen(n, 0);
    for (int i = 0; i < n; ++i)
        if (tickets[i] >= 0 && tickets[i] < n) ++seen[tickets[i]];
    EMU_CHECK(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
    for (void* p : {(void*)ci, (void*)cu, (void*)cull, (void*)cf, (void*)cd, (void*)mx,
                    (void*)bits, (void*)cas, (void*)tickets})
        emu::free(p);
}

// ---------------------------------------------------------------------------------------
// WMMA.

template <class T>
using GemmKernel = void (*)(const T*, const T*, const float*, float*, int, int, int, int, int,
                            int, int, int, int);

template <class T>
void gemm_case(const char* name, GemmKernel<T> kernel, bool a_col, bool b_col, emu::Rng& rng) {
    const int M = 32, N = 32, K = 48;
    const int lda = a_col ? 40 : 56, ldb = b_col ? 56 : 40, ldc = 36, ldd = 44;
    const int a_elems = a_col ? K * lda : M * lda, b_elems = b_col ? N * ldb : K * ldb;
    std::vector<T> A(a_elems), B(b_elems);
    for (auto& v : A) v = T(rng.normal());
    for (auto& v : B) v = T(rng.normal());
    std::vector<float> C(32 * ldc);
    for (auto& v : C) v = rng.normal();
    auto a_at = [&](int i, int k) { return (double)(float)A[a_col ? i + k * lda : i * lda + k]; };
    auto b_at = [&](int k, int j) { return (double)(float)B[b_col ? k + j * ldb : k * ldb + j]; };
    T* dA = emu::upload(A);
    T* dB = emu::upload(B);
    float* dC = emu::upload(C);
    const size_t smem = ((a_elems + 15) / 16 * 16 + b_elems) * sizeof(T);
    std::vector<float> first;
    for (int c_col = 0; c_col < 2; ++c_col) {
        for (int d_col = 0; d_col < 2; ++d_col) {
            for (int via = 0; via < 2; ++via) {
                float* dD = emu::alloc<float>(32 * ldd);
                emu::launch(kernel, 1, 128, via ? smem : 0, dA, dB, dC, dD, lda, ldb, ldc, ldd,
                            c_col, d_col, via, a_elems, b_elems);
                std::vector<float> got, want;
                std::vector<double> tol;
                for (int i = 0; i < M; ++i) {
                    for (int j = 0; j < N; ++j) {
                        const double c = C[c_col ? i + j * ldc : i * ldc + j];
                        double s = c, mag = std::fabs(c);
                        for (int k = 0; k < K; ++k) {
                            s += a_at(i, k) * b_at(k, j);
                            mag += std::fabs(a_at(i, k) * b_at(k, j));
                        }
                        got.push_back(dD[d_col ? i + j * ldd : i * ldd + j]);
                        want.push_back((float)s);
                        tol.push_back(4e-6 * mag);
                    }
                }
                int bad = 0;
                for (size_t i = 0; i < got.size(); ++i) {
                    if (!(std::fabs((double)got[i] - want[i]) <= tol[i] + 1e-30)) {
                        if (bad++ < 5)
                            std::fprintf(stderr,
                                         "%s c_col %d d_col %d smem %d: D[%zu][%zu] = %.9g, "
                                         "want %.9g\n",
                                         name, c_col, d_col, via, i / N, i % N, got[i], want[i]);
                    }
                }
                EMU_CHECKF(bad == 0, "%s (c_col %d, d_col %d, via_smem %d): %d of %d wrong", name,
                           c_col, d_col, via, bad, M * N);
                // The padding of D (leading dimension 44 > 32) must stay unwritten.
                int written_pad = 0;
                for (int r = 0; r < 32; ++r)
                    for (int c = 32; c < ldd; ++c) written_pad += !std::isnan(dD[r * ldd + c]);
                EMU_CHECKF(written_pad == 0, "%s wrote %d padding elements of D", name,
                           written_pad);
                // Same result with and without the shared-memory staging (deterministic).
                if (via == 0) first = got;
                else
                    EMU_CHECK(std::memcmp(first.data(), got.data(), got.size() * 4) == 0);
                emu::free(dD);
            }
        }
    }
    emu::free(dA);
    emu::free(dB);
    emu::free(dC);
}

void test_wmma_gemm() {
    emu::Rng rng(4);
    gemm_case<bf16>("bf16 A row, B row", st_gemm_bf16_rr, false, false, rng);
    gemm_case<bf16>("bf16 A row, B col", st_gemm_bf16_rc, false, true, rng);
    gemm_case<bf16>("bf16 A col, B row", st_gemm_bf16_cr, true, false, rng);
    gemm_case<bf16>("bf16 A col, B col", st_gemm_bf16_cc, true, true, rng);
    gemm_case<f16>("f16 A row, B col", st_gemm_f16_rc, false, true, rng);
    gemm_case<f16>("f16 A col, B row", st_gemm_f16_cr, true, false, rng);
}

void test_wmma_sync_semantics() {
    emu::Rng rng(5);
    std::vector<bf16> A(256), B(256);
    for (auto& v : A) v = bf16(rng.normal());
    for (auto& v : B) v = bf16(rng.normal());
    std::vector<float> want(256);
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) {
            double s = 0;
            for (int k = 0; k < 16; ++k) s += (double)(float)A[i * 16 + k] * (float)B[k * 16 + j];
            want[i * 16 + j] = (float)(s * 3.0);
        }
    bf16* dA = emu::upload(A);
    bf16* dB = emu::upload(B);
    float* out = emu::alloc<float>(256);
    emu::launch(st_wmma_store_read, 1, 32, 0, dA, dB, out, 1, 3.0f);
    emu::check_close("store, __syncwarp, read", out, want.data(), 256, 1e-5, 1e-5);
    // Without the __syncwarp a lane reads elements that other lanes have not stored yet:
    // racy on the GPU, visibly wrong here.
    emu::launch(st_wmma_store_read, 1, 32, 0, dA, dB, out, 0, 3.0f);
    int wrong = 0;
    for (int i = 0; i < 256; ++i) wrong += !(std::fabs(out[i] - want[i]) <= 1e-5 * (1 + std::fabs(want[i])));
    EMU_CHECKF(wrong > 0, "a read after store_matrix_sync without __syncwarp went unnoticed");

    CHECK_ERROR(error_of([&] { emu::launch(st_wmma_misaligned, 1, 32, 0, dA, out); }),
                "st_wmma_misaligned", "not 32-byte", "selftest.cu:");
    CHECK_ERROR(error_of([&] { emu::launch(st_wmma_lane_pointers, 1, 32, 0, dA, out); }),
                "different arguments", "wmma::load_matrix_sync");
    CHECK_ERROR(error_of([&] { emu::launch(st_wmma_partial, 1, 16, 0, dA, out); }),
                "all 32 lanes", "partial warp");
    emu::free(dA);
    emu::free(dB);
    emu::free(out);
}

// ---------------------------------------------------------------------------------------
// 16-bit rounding, against an independent reference: the nearest value of a table of all
// encodings (decoded with ldexp), ties to the even encoding, infinity as the value 2^(emax+1).

double decode_ref(unsigned bits, bool bf) {
    const int mb = bf ? 7 : 10, bias = bf ? 127 : 15;
    const unsigned e = (bits >> mb) & (bf ? 0xFF : 0x1F), m = bits & ((1u << mb) - 1);
    const double mag = e == 0 ? std::ldexp((double)m, 1 - bias - mb)
                              : std::ldexp((double)((1u << mb) + m), (int)e - bias - mb);
    return (bits & 0x8000) ? -mag : mag;
}

struct Table {
    std::vector<double> value; // non-negative encodings 0 .. inf, increasing
    unsigned inf;
};
Table make_table(bool bf) {
    Table t;
    t.inf = bf ? 0x7F80 : 0x7C00;
    for (unsigned b = 0; b < t.inf; ++b) t.value.push_back(decode_ref(b, bf));
    t.value.push_back(bf ? std::ldexp(1.0, 128) : 65536.0);
    return t;
}

unsigned round_ref(float f, const Table& t) {
    if (std::isnan(f)) return 0x7FFF;
    const unsigned sign = std::signbit(f) ? 0x8000 : 0;
    const double a = std::fabs((double)f);
    if (std::isinf(a)) return sign | t.inf;
    const size_t hi = std::lower_bound(t.value.begin(), t.value.end(), a) - t.value.begin();
    if (hi == t.value.size()) return sign | t.inf; // beyond the infinity position
    if (t.value[hi] == a) return sign | (unsigned)hi;
    const size_t lo = hi - 1;
    const double mid = (t.value[lo] + t.value[hi]) / 2; // exact
    const size_t r = a < mid ? lo : a > mid ? hi : (lo % 2 == 0 ? lo : hi);
    return sign | (unsigned)r;
}

void test_rounding() {
    const Table tb = make_table(true), th = make_table(false);
    // Known patterns: {float bits, bf16 bits, f16 bits}.
    struct Case {
        unsigned f, bf, h;
        const char* what;
    };
    const Case cases[] = {
        {0x3F800000, 0x3F80, 0x3C00, "1"},
        {0x3F808000, 0x3F80, 0x3C04, "1 + 2^-8: bf16 tie, to even (down)"},
        {0x3F818000, 0x3F82, 0x3C0C, "1 + 3*2^-8: bf16 tie, to even (up)"},
        {0x3F808001, 0x3F81, 0x3C04, "just above a bf16 tie"},
        {0x3F807FFF, 0x3F80, 0x3C04, "just below a bf16 tie"},
        {0x3F801000, 0x3F80, 0x3C00, "1 + 2^-11: f16 tie, to even (down)"},
        {0x3F803000, 0x3F80, 0x3C02, "1 + 3*2^-11: f16 tie, to even (up)"},
        {0x7F7FFFFF, 0x7F80, 0x7C00, "FLT_MAX: overflows to inf"},
        {0x7F7F7FFF, 0x7F7F, 0x7C00, "largest float below the bf16 overflow tie"},
        {0xFF7FFFFF, 0xFF80, 0xFC00, "-FLT_MAX: -inf"},
        {0x477FE000, 0x4780, 0x7BFF, "65504 (f16 max)"},
        {0x477FEFFF, 0x4780, 0x7BFF, "below 65520: f16 max"},
        {0x477FF000, 0x4780, 0x7C00, "65520: f16 tie to inf"},
        {0x00000001, 0x0000, 0x0000, "smallest float subnormal"},
        {0x00010000, 0x0001, 0x0000, "bf16 smallest subnormal"},
        {0x00008000, 0x0000, 0x0000, "bf16 subnormal tie to even (0)"},
        {0x00018000, 0x0002, 0x0000, "bf16 subnormal tie to even (2)"},
        {0x00400000, 0x0040, 0x0000, "float subnormal 2^-127"},
        {0x33800000, 0x3380, 0x0001, "2^-24: f16 smallest subnormal"},
        {0x33000000, 0x3300, 0x0000, "2^-25: f16 tie to even (0)"},
        {0x33000001, 0x3300, 0x0001, "just above 2^-25"},
        {0x33C00000, 0x33C0, 0x0002, "1.5*2^-24: f16 tie to even (2)"},
        {0x34200000, 0x3420, 0x0002, "2.5*2^-24: f16 tie to even (2)"},
        {0x387FE000, 0x3880, 0x0400, "2^-14 - 2^-25: subnormal tie rounds up to the smallest normal"},
        {0x387FC000, 0x3880, 0x03FF, "2^-14 - 2^-24: the largest f16 subnormal"},
        {0x38800000, 0x3880, 0x0400, "2^-14: f16 smallest normal"},
        {0xC0000000, 0xC000, 0xC000, "-2"},
        {0x80000000, 0x8000, 0x8000, "-0"},
        {0x7F800000, 0x7F80, 0x7C00, "inf"},
        {0xFF800000, 0xFF80, 0xFC00, "-inf"},
        {0x7FC00000, 0x7FFF, 0x7FFF, "quiet NaN"},
        {0x7F800001, 0x7FFF, 0x7FFF, "signalling NaN with a tiny payload stays NaN"},
        {0xFFFFFFFF, 0x7FFF, 0x7FFF, "negative NaN"},
    };
    for (const Case& c : cases) {
        const float f = __uint_as_float(c.f);
        const unsigned bf = __bfloat16_as_ushort(__float2bfloat16(f));
        const unsigned h = __half_as_ushort(__float2half(f));
        EMU_CHECKF(bf == c.bf, "%s (%08x): bf16 %04x, want %04x", c.what, c.f, bf, c.bf);
        EMU_CHECKF(h == c.h, "%s (%08x): f16 %04x, want %04x", c.what, c.f, h, c.h);
        EMU_CHECKF(round_ref(f, tb) == c.bf && round_ref(f, th) == c.h,
                   "the test's reference disagrees on %s", c.what);
    }

    // Every 16-bit encoding converts to float exactly and back to itself.
    for (unsigned b = 0; b < 65536; ++b) {
        const float fb = __bfloat162float(__ushort_as_bfloat16((unsigned short)b));
        const float fh = __half2float(__ushort_as_half((unsigned short)b));
        const double rb = decode_ref(b, true), rh = decode_ref(b, false);
        const bool nan_b = (b & 0x7F80) == 0x7F80 && (b & 0x7F);
        const bool nan_h = (b & 0x7C00) == 0x7C00 && (b & 0x3FF);
        const bool inf_b = (b & 0x7FFF) == 0x7F80, inf_h = (b & 0x7FFF) == 0x7C00;
        if (nan_b) {
            EMU_CHECKF(std::isnan(fb), "bf16 %04x should be NaN", b);
        } else {
            EMU_CHECKF(inf_b ? std::isinf(fb) && std::signbit(fb) == !!(b & 0x8000)
                             : (double)fb == rb && std::signbit(fb) == !!(b & 0x8000),
                       "bf16 %04x -> %g", b, fb);
            EMU_CHECKF(__bfloat16_as_ushort(__float2bfloat16(fb)) == b, "bf16 %04x round trip", b);
        }
        if (nan_h) {
            EMU_CHECKF(std::isnan(fh), "f16 %04x should be NaN", b);
        } else {
            EMU_CHECKF(inf_h ? std::isinf(fh) && std::signbit(fh) == !!(b & 0x8000)
                             : (double)fh == rh && std::signbit(fh) == !!(b & 0x8000),
                       "f16 %04x -> %g", b, fh);
            EMU_CHECKF(__half_as_ushort(__float2half(fh)) == b, "f16 %04x round trip", b);
        }
    }

    // Random floats: any bit pattern, and floats within f16's range.
    emu::Rng rng(6);
    const int n = 100000;
    std::vector<float> x(n);
    for (int i = 0; i < n; ++i) {
        if (i % 2 == 0) {
            x[i] = __uint_as_float((unsigned)rng.next());
        } else {
            const unsigned e = 127 - 27 + (unsigned)rng.below(46); // 2^-27 .. 2^18
            x[i] = __uint_as_float(((unsigned)rng.below(2) << 31) | (e << 23) |
                                   ((unsigned)rng.next() & 0x7FFFFF));
        }
    }
    float* dx = emu::upload(x);
    bf16* yb = emu::alloc<bf16>(n);
    f16* yh = emu::alloc<f16>(n);
    bf16* pb = emu::alloc<bf16>(n);
    f16* ph = emu::alloc<f16>(n);
    float* back = emu::alloc<float>(2 * n);
    emu::launch(st_convert, 40, 128, 0, dx, yb, yh, pb, ph, back, n);
    int bad = 0;
    for (int i = 0; i < n && bad < 10; ++i) {
        const unsigned wb = round_ref(x[i], tb), wh = round_ref(x[i], th);
        const unsigned gb = __bfloat16_as_ushort(yb[i]), gh = __half_as_ushort(yh[i]);
        const unsigned gpb = __bfloat16_as_ushort(pb[i]), gph = __half_as_ushort(ph[i]);
        if (gb != wb || gh != wh || gpb != wb || gph != wh) {
            ++bad;
            std::fprintf(stderr, "float %08x: bf16 %04x/%04x want %04x, f16 %04x/%04x want %04x\n",
                         __float_as_uint(x[i]), gb, gpb, wb, gh, gph, wh);
        }
        const float fb = back[2 * (i & ~1) + (i & 1)], fh = back[2 * (i & ~1) + 2 + (i & 1)];
        const float eb = __bfloat162float(__ushort_as_bfloat16((unsigned short)wb));
        const float eh = __half2float(__ushort_as_half((unsigned short)wh));
        if (!((fb == eb || (std::isnan(fb) && std::isnan(eb))) &&
              (fh == eh || (std::isnan(fh) && std::isnan(eh))))) {
            ++bad;
            std::fprintf(stderr, "float %08x: pair unpacked to %g/%g, want %g/%g\n",
                         __float_as_uint(x[i]), fb, fh, eb, eh);
        }
    }
    EMU_CHECKF(bad == 0, "%d conversions differ from the reference", bad);
    for (void* p : {(void*)dx, (void*)yb, (void*)yh, (void*)pb, (void*)ph, (void*)back})
        emu::free(p);
}

// ---------------------------------------------------------------------------------------
// Reports.

void test_deadlocks() {
    float* out = emu::alloc<float>(64);
    const std::string dl =
        error_of([&] { emu::launch(st_barrier_after_exit, 1, 32, 0, out); });
    CHECK_ERROR(dl, "deadlock", "st_barrier_after_exit", "selftest_main.cpp:",
                "waiting at __syncthreads() at selftest.cu:", "threads 0-15",
                "threads 16-31 (threadIdx (16,0,0)-(31,0,0)): returned", "EMU_EXITED_ARRIVE");
    std::printf("    (what a deadlock report looks like:)\n    %s", dl.c_str());

    const bool keep = emu::detail::options().exited_arrive;
    emu::set_exited_threads_arrive(true); // the hardware's behaviour: now it completes
    const std::string none = error_of([&] { emu::launch(st_barrier_after_exit, 1, 32, 0, out); });
    EMU_CHECKF(none.empty(), "with EMU_EXITED_ARRIVE the launch should complete: %s", none.c_str());
    emu::set_exited_threads_arrive(keep);
    for (int i = 0; i < 32; ++i) EMU_CHECK(out[i] == 1.0f);

    CHECK_ERROR(error_of([&] { emu::launch(st_two_barriers, 1, 32, 0, out); }),
                "different barriers", "selftest.cu:");
    CHECK_ERROR(error_of([&] { emu::launch(st_shuffle_vs_barrier, 1, 32, 0, out); }), "deadlock",
                "__shfl_xor_sync(mask 0xffffffff)", "waiting at __syncthreads()",
                "warp collective");
    CHECK_ERROR(error_of([&] { emu::launch(st_mask_without_self, 1, 32, 0, out); }),
                "does not include the calling lane", "__shfl_sync");
    CHECK_ERROR(error_of([&] { emu::launch(st_mixed_collectives, 1, 32, 0, out); }),
                "different collectives", "__syncwarp", "__shfl_xor_sync");
    // The emulator is usable after an error.
    float* r = emu::alloc<float>(1);
    float* x = emu::upload(std::vector<float>(64, 1.0f));
    emu::launch(st_reduce, 1, 64, 0, x, r, 64);
    EMU_CHECK(*r == 64.0f);
    for (void* p : {(void*)out, (void*)r, (void*)x}) emu::free(p);
}

void test_launch_checks() {
    float* p = emu::alloc<float>(100);
    CHECK_ERROR(error_of([&] { emu::launch(st_write_at, 1, 1025, 0, p, 0LL); }), "st_write_at",
                "1024", "selftest_main.cpp:");
    CHECK_ERROR(error_of([&] { emu::launch(st_write_at, 1, dim3(1, 1, 65), 0, p, 0LL); }),
                "z <= 64");
    CHECK_ERROR(error_of([&] { emu::launch(st_write_at, 1, 32, 227 * 1024 + 1, p, 0LL); }),
                "227 KiB");
    CHECK_ERROR(error_of([&] { emu::launch(st_write_at, 0, 32, 0, p, 0LL); }), "zero dimension");
    // A write into the padding after a buffer, and past the dynamic shared memory.
    CHECK_ERROR(error_of([&] { emu::launch(st_write_at, 1, 32, 0, p, 100LL); }),
                "wrote past the end of the emu::alloc buffer of 400 bytes", "selftest_main.cpp:");
    emu::launch(st_write_at, 1, 32, 0, p, 99LL); // the last element is fine
    CHECK_ERROR(error_of([&] { emu::launch(st_dynamic_overrun, 1, 32, 100, 100); }),
                "past the end of the dynamic shared memory");
    emu::launch(st_dynamic_overrun, 1, 32, 101, 100);

    // Poisoned allocations.
    EMU_CHECK(std::isnan(emu::alloc<float>(3)[2]));
    EMU_CHECK(std::isnan((float)emu::alloc<bf16>(3)[1]) && std::isnan((float)emu::alloc<f16>(3)[0]));
    EMU_CHECK(emu::alloc<int>(1)[0] == (int)0xCDCDCDCD);
    EMU_CHECK((reinterpret_cast<std::uintptr_t>(emu::alloc<char>(3)) % 256) == 0);

    // An access beyond the padding faults; the crash handler names the buffer. In a child.
    int fds[2];
    if (pipe(fds) != 0) {
        EMU_CHECKF(false, "pipe failed");
        return;
    }
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        emu::launch(st_write_at, 1, 32, 0, p, 200LL); // 800 bytes into a 400-byte buffer
        _exit(0);
    }
    close(fds[1]);
    std::string text;
    char buf[512];
    for (ssize_t k; (k = read(fds[0], buf, sizeof buf)) > 0;) text.append(buf, (size_t)k);
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    EMU_CHECKF(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV,
               "the child should die of SIGSEGV (status %d)", status);
    CHECK_ERROR(text, "SIGSEGV", "st_write_at", "threadIdx (0,0,0)",
                "400 bytes past the end of the emu::alloc buffer of 400 bytes");
    emu::free(p);
}

// wgmma: a chain of two products right (shared or register A, B by stores or cp.async, a
// write fenced again, a wait between the products), and each rule of PTX the emulator checks
// broken once (st_wgmma's modes).
void test_wgmma() {
    emu::Rng rng(9);
    std::vector<bf16> a(2 * 1024), bt(2 * 256);
    for (auto& v : a) v = bf16((float)((int)rng.below(9) - 4)); // small integers: exact sums
    for (auto& v : bt) v = bf16((float)((int)rng.below(9) - 4));
    std::vector<float> want(64 * 16, 0.0f);
    for (int tile = 0; tile < 2; ++tile)
        for (int m = 0; m < 64; ++m)
            for (int n = 0; n < 16; ++n)
                for (int k = 0; k < 16; ++k)
                    want[m * 16 + n] +=
                        (float)a[tile * 1024 + m * 16 + k] * (float)bt[tile * 256 + n * 16 + k];
    bf16* da = emu::upload(a);
    bf16* dbt = emu::upload(bt);
    float* out = emu::alloc<float>(64 * 16);
    const size_t smem = 5120;
    for (int mode : {ST_WG_OK, ST_WG_CP, ST_WG_RS, ST_WG_D_REFENCED, ST_WG_SPLIT}) {
        emu::launch(st_wgmma, 1, 128, smem, da, dbt, out, mode);
        int bad = 0;
        for (int i = 0; i < 64 * 16; ++i) {
            // ST_WG_D_REFENCED: d[0][1] (rows 16w + g, odd columns below 8) started at 1.
            const bool one = mode == ST_WG_D_REFENCED && (i / 16) % 16 < 8 && i % 16 < 8 && i % 2;
            bad += out[i] != want[i] + (one ? 1.0f : 0.0f);
        }
        EMU_CHECKF(bad == 0, "mode %d: %d of 1024 products wrong (out[0] %g, want %g)", mode, bad,
                   out[0], want[0]);
    }
    auto err = [&](int mode) {
        return error_of([&] { emu::launch(st_wgmma, 1, 128, smem, da, dbt, out, mode); });
    };
    CHECK_ERROR(err(ST_WG_UNFENCED), "st_wgmma", "wgmma reads",
                "which a store changed after the block's last fence.proxy.async");
    CHECK_ERROR(err(ST_WG_FENCE_FIRST),
                "which a store changed after the block's last fence.proxy.async");
    CHECK_ERROR(err(ST_WG_CP_UNFENCED), "wgmma reads B", "which a cp.async of the thread",
                "executed no fence.proxy.async");
    CHECK_ERROR(err(ST_WG_WRITE_D), "the accumulators of a wgmma in flight were written",
                "d[1][2] holds 0");
    CHECK_ERROR(err(ST_WG_WRITE_A), "register a[3] of a wgmma's A fragment changed");
    CHECK_ERROR(err(ST_WG_WARP_DESC), "the warps of a warpgroup issued different wgmmas",
                "wgmma #0 of warp 1");
    CHECK_ERROR(err(ST_WG_EXTRA), "the warps of warpgroup 0 issued different numbers of wgmmas",
                "(2, 2, 2, 3)");
    // wgmma.fence: registers a product reads, written by ordinary code after the fence.
    CHECK_ERROR(err(ST_WG_NO_WGFENCE), "st_wgmma", "threadIdx (", "wgmma.fence missing",
                "executed no wgmma.fence in this block");
    CHECK_ERROR(err(ST_WG_D_AFTER_FENCE), "st_wgmma", "threadIdx (", "wgmma.fence missing",
                "reads accumulator register d[0][1]", "it holds 1, 0x3f800000",
                "it held 0x00000000 at the thread's last wgmma.fence",
                "wgmma.fence.sync.aligned between any access");
    CHECK_ERROR(err(ST_WG_A_AFTER_FENCE), "wgmma.fence missing", "reads A-fragment register a[2]",
                "after the thread's last wgmma.fence");
    CHECK_ERROR(err(ST_WG_SPLIT_WRITE), "wgmma.fence missing", "reads accumulator register d[1][0]",
                "or as the last product into it completed");
    // A read of the accumulators in flight cannot be seen; it reads NaN instead.
    emu::launch(st_wgmma, 1, 128, smem, da, dbt, out, (int)ST_WG_READ_D);
    EMU_CHECKF(std::isnan(out[0]) && std::isnan(out[1023]), "reading D in flight: got %g", out[0]);
    for (void* p : {(void*)da, (void*)dbt, (void*)out}) emu::free(p);
}

} // namespace

int main() {
    std::printf("cuda_emu selftest (schedule %s)\n", emu::schedule_name());
    emu::run_test("block reduction, static shared memory", test_reduce);
    emu::run_test("schedules: same bits, races exposed", test_schedules);
    emu::run_test("warp shuffles and votes", test_shuffles);
    emu::run_test("partial warp, exited lanes", test_partial_warp);
    emu::run_test("shared memory poison, dynamic shared memory", test_shared_memory);
    emu::run_test("3-D indices, __syncthreads_and/or", test_indices);
    emu::run_test("atomics", test_atomics);
    emu::run_test("wmma 32x48 * 48x32, all layouts", test_wmma_gemm);
    emu::run_test("wmma store/__syncwarp semantics, misuse", test_wmma_sync_semantics);
    emu::run_test("bf16/f16 round to nearest even", test_rounding);
    emu::run_test("deadlock and barrier misuse reports", test_deadlocks);
    emu::run_test("launch checks, overruns, poison", test_launch_checks);
    emu::run_test("wgmma: chains, registers in flight, wgmma.fence, async-proxy fence, warpgroups",
                  test_wgmma);
    return emu::finish("selftest");
}
