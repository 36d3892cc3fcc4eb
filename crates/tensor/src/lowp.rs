//! Matrix products with low-precision (bf16 or f16) inputs and f32 accumulation: the
//! arithmetic of mixed-precision training.
//!
//! Why three kernels, chosen at run time:
//! * **AMX-BF16** (Sapphire Rapids and later Xeons): `tdpbf16ps` multiplies a 16×32 bf16 tile
//!   by a 32×16 one into 16×16 f32 accumulators, ~3.4 TFLOP/s per core in a register-only
//!   loop on our Xeon against ~200 for f32 FMA. This is where bf16 pays on Intel.
//! * **AVX-512 BF16** (`vdpbf16ps`, Zen 4, Cooper Lake): a pair of bf16 products summed into
//!   each f32 lane. On Zen 4 it runs at twice the f32 FMA rate; on our Xeon at half of it
//!   (measured, 110 vs 215 GFLOP/s), which is why AMX comes first where present.
//! * **Portable**: inputs rounded to bf16/f16 and back, then the f32 product. Same rounding of
//!   the inputs, f32 accumulation; correct on every x86-64 (and elsewhere), no faster.
//!
//! Both bf16 kernels share one packed layout, so the conversion to bf16 happens while packing,
//! which a product does anyway: a "bf16 copy of the weights" costs nothing extra.
//! * the left operand in blocks of 32 rows, each k-tile of 32 as two 16×32 bf16 tiles
//!   (row-major, 64 bytes a row);
//! * the right operand in VNNI order: per 16 columns and k-tile, 16 rows of
//!   `(b[2p][j], b[2p+1][j])` pairs, 64 bytes a row.
//!
//! Accumulation is always f32 and runs over k in order, the same for every row: a row's result
//! does not depend on how many rows the product has, so splitting a batch over workers changes
//! nothing in the forward pass.

use crate::matmul::{check_product, gemm_f32_with_threads, Mat, MatMut};
use crate::DType;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Which kernel computes bf16 products on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// Intel AMX tiles (`tdpbf16ps`).
    Amx,
    /// AVX-512 BF16 (`vdpbf16ps`).
    Avx512,
    /// Inputs rounded to bf16, f32 product.
    Portable,
}

impl Bf16Kernel {
    pub fn name(self) -> &'static str {
        match self {
            Bf16Kernel::Amx => "amx-bf16",
            Bf16Kernel::Avx512 => "avx512-bf16",
            Bf16Kernel::Portable => "portable",
        }
    }

    /// Every kernel this CPU can run, fastest first (detected once).
    pub fn available() -> &'static [Bf16Kernel] {
        static AVAILABLE: OnceLock<Vec<Bf16Kernel>> = OnceLock::new();
        AVAILABLE.get_or_init(|| {
            let mut out = Vec::new();
            if amx_usable() {
                out.push(Bf16Kernel::Amx);
            }
            if avx512_bf16_usable() {
                out.push(Bf16Kernel::Avx512);
            }
            out.push(Bf16Kernel::Portable);
            out
        })
    }
}

/// The bf16 kernel products use: the fastest available, or the one named by
/// `MESHTRAIN_BF16_KERNEL` (`amx-bf16`, `avx512-bf16`, `portable`) when this CPU has it, for
/// A/B measurements and for testing a slower path on a faster machine.
pub fn bf16_kernel() -> Bf16Kernel {
    static CHOSEN: OnceLock<Bf16Kernel> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let available = Bf16Kernel::available();
        let wanted = std::env::var("MESHTRAIN_BF16_KERNEL").ok();
        wanted
            .and_then(|w| available.iter().copied().find(|k| k.name() == w))
            .unwrap_or(available[0])
    })
}

fn avx512_bf16_usable() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// AMX needs the CPU bits (AMX-TILE, AMX-BF16) and the kernel's permission to use the large
/// tile state (Linux ≥ 5.16, `arch_prctl(ARCH_REQ_XCOMP_PERM)`); asked once per process.
fn amx_usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            let max_leaf = std::arch::x86_64::__cpuid(0).eax;
            if max_leaf < 7 || !avx512_bf16_usable() {
                return false;
            }
            let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
            let amx_bf16 = leaf7.edx & (1 << 22) != 0;
            let amx_tile = leaf7.edx & (1 << 24) != 0;
            amx_bf16 && amx_tile && amx::request_permission()
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        {
            false
        }
    })
}

/// `c = a · b` (or `c += a · b`) with `a` and `b` rounded to `dtype` and f32 accumulation.
/// `DType::F32` is the plain f32 product.
pub fn gemm_lowp(dtype: DType, c: MatMut, a: Mat, b: Mat, accumulate: bool, threads: usize) {
    match dtype {
        DType::F32 => gemm_f32_with_threads(c, a, b, accumulate, threads),
        DType::BF16 => gemm_bf16_with(bf16_kernel(), c, a, b, accumulate, threads),
        DType::F16 => gemm_rounded(DType::F16, c, a, b, accumulate, threads),
    }
}

/// A bf16 product on a chosen kernel (tests compare kernels on one machine).
pub fn gemm_bf16_with(
    kernel: Bf16Kernel,
    c: MatMut,
    a: Mat,
    b: Mat,
    accumulate: bool,
    threads: usize,
) {
    check_product(&c, &a, (b.rows(), b.cols()));
    if c.rows() == 0 || c.cols() == 0 || a.cols() == 0 || kernel == Bf16Kernel::Portable {
        return gemm_rounded(DType::BF16, c, a, b, accumulate, threads);
    }
    assert!(
        Bf16Kernel::available().contains(&kernel),
        "the {} kernel is not available on this CPU",
        kernel.name()
    );
    #[cfg(target_arch = "x86_64")]
    packed::gemm(kernel, c, a, packed::Right::F32(b), accumulate, threads);
}

/// A contiguous row-major matrix of bf16 values, as bits: an activation kept for backward
/// ([`crate::dtype::HalfTensor`]), read by a product without widening it to f32 first.
#[derive(Clone, Copy)]
pub struct Bf16Rows<'a> {
    bits: &'a [u16],
    rows: usize,
    cols: usize,
}

impl<'a> Bf16Rows<'a> {
    pub fn new(bits: &'a [u16], rows: usize, cols: usize) -> Self {
        assert_eq!(
            bits.len(),
            rows * cols,
            "Bf16Rows: {rows}x{cols} over {} values",
            bits.len()
        );
        Bf16Rows { bits, rows, cols }
    }

    fn widened(self) -> Vec<f32> {
        let mut wide = vec![0.0f32; self.bits.len()];
        crate::dtype::widen(self.bits, &mut wide, DType::BF16);
        wide
    }
}

/// `c = a · b` (or `c += a · b`) in bf16 with `b` already bf16: the same result as
/// [`gemm_lowp`] on `b` widened to f32, without the widening pass (a weight gradient
/// `dzᵀ·x` against the input its layer kept in bf16).
pub fn gemm_bf16_rows(c: MatMut, a: Mat, b: Bf16Rows, accumulate: bool, threads: usize) {
    let kernel = bf16_kernel();
    check_product(&c, &a, (b.rows, b.cols));
    let degenerate = c.rows() == 0 || c.cols() == 0 || a.cols() == 0;
    if degenerate || kernel == Bf16Kernel::Portable {
        let wide = b.widened();
        let b = Mat::new(&wide, b.rows, b.cols);
        return gemm_bf16_with(kernel, c, a, b, accumulate, threads);
    }
    #[cfg(target_arch = "x86_64")]
    packed::gemm(kernel, c, a, packed::Right::Bf16(b), accumulate, threads);
}

/// The portable path: copies of `a` and `b` rounded through `dtype`, then the f32 product.
fn gemm_rounded(dtype: DType, c: MatMut, a: Mat, b: Mat, accumulate: bool, threads: usize) {
    let parallel = threads > 1;
    let (ra, rb) = (
        RoundedCopy::of(a, dtype, parallel),
        RoundedCopy::of(b, dtype, parallel),
    );
    gemm_f32_with_threads(c, ra.view(), rb.view(), accumulate, threads);
    crate::par::recycle(ra.data);
    crate::par::recycle(rb.data);
}

/// A rounded copy of a matrix view that keeps its orientation: a transposed view (unit row
/// stride, such as `Wᵀ`) is copied as the transpose it is, so the copy reads memory in order.
struct RoundedCopy {
    data: Vec<f32>,
    rows: usize,
    cols: usize,
    transposed: bool,
}

impl RoundedCopy {
    fn of(m: Mat, dtype: DType, parallel: bool) -> Self {
        let transposed = m.row_stride() == 1 && m.col_stride() != 1;
        let m = if transposed { m.t() } else { m };
        let (rows, cols, rs, cs) = (m.rows(), m.cols(), m.row_stride(), m.col_stride());
        // Every element is written below; the thread's buffer pool spares the page faults of
        // a fresh allocation this size on every product.
        let mut data = crate::par::take_buffer(rows * cols);
        let copy_row = |(i, row): (usize, &mut [f32])| {
            // SAFETY: row i of the bounds-checked view.
            let start = unsafe { m.as_ptr().add(i * rs) };
            if cs == 1 {
                row.copy_from_slice(unsafe { std::slice::from_raw_parts(start, cols) });
            } else {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = unsafe { *start.add(j * cs) };
                }
            }
            crate::dtype::round_through(row, dtype);
        };
        if parallel {
            data.par_chunks_mut(cols.max(1))
                .enumerate()
                .for_each(copy_row);
        } else {
            data.chunks_mut(cols.max(1)).enumerate().for_each(copy_row);
        }
        RoundedCopy {
            data,
            rows,
            cols,
            transposed,
        }
    }

    fn view(&self) -> Mat<'_> {
        let m = Mat::new(&self.data, self.rows, self.cols);
        if self.transposed {
            m.t()
        } else {
            m
        }
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod amx {
    /// Tile configuration: palette 1, tiles 0–7 all 16 rows × 64 bytes.
    #[repr(C, align(64))]
    pub struct TileConfig([u8; 64]);

    pub const CONFIG: TileConfig = {
        let mut bytes = [0u8; 64];
        bytes[0] = 1;
        let mut t = 0;
        while t < 8 {
            bytes[16 + 2 * t] = 64;
            bytes[48 + t] = 16;
            t += 1;
        }
        TileConfig(bytes)
    };

    /// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: 0 when granted.
    pub fn request_permission() -> bool {
        const SYS_ARCH_PRCTL: i64 = 158;
        const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
        const XFEATURE_XTILEDATA: i64 = 18;
        let ret: i64;
        // SAFETY: a plain system call; it only changes which state the kernel lets this
        // process use, and fails cleanly (negative errno) on kernels without AMX support.
        unsafe {
            std::arch::asm!(
                "syscall",
                inlateout("rax") SYS_ARCH_PRCTL => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM,
                in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack)
            );
        }
        ret == 0
    }
}

#[cfg(target_arch = "x86_64")]
mod packed {
    use super::{Bf16Kernel, Bf16Rows};
    use crate::matmul::{Mat, MatMut};
    use rayon::prelude::*;
    use std::arch::x86_64::*;
    use std::cell::Cell;

    /// Rows (and columns) of one output block: 2 × 2 AMX tiles of 16×16.
    const BLOCK: usize = 32;
    /// Depth of one k-tile (32 bf16 = 64 bytes a tile row).
    const KT: usize = 32;
    /// bf16 elements in one 16×32 tile.
    const TILE: usize = 16 * KT;
    /// k-tiles per chunk of the depth: 8 × 2 tiles of the left operand (16 KiB) plus one
    /// column block's 16 KiB fit L1 together.
    const KC_TILES: usize = 8;

    /// Sixteen f32 values `ptr[i * stride]` for lanes in `mask` (zeros elsewhere).
    ///
    /// # Safety
    /// Every masked-in address must be readable; AVX-512F available.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(ptr: *const f32, stride: usize, mask: __mmask16) -> __m512 {
        if stride == 1 {
            _mm512_maskz_loadu_ps(mask, ptr)
        } else if stride.saturating_mul(15) <= i32::MAX as usize / 4 {
            let idx = _mm512_mullo_epi32(
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                _mm512_set1_epi32(stride as i32),
            );
            _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), mask, idx, ptr)
        } else {
            let mut lanes = [0.0f32; 16];
            for (i, lane) in lanes.iter_mut().enumerate() {
                if mask & (1 << i) != 0 {
                    *lane = *ptr.add(i * stride);
                }
            }
            _mm512_loadu_ps(lanes.as_ptr())
        }
    }

    fn lane_mask(valid: usize) -> __mmask16 {
        if valid >= 16 {
            0xffff
        } else {
            ((1u32 << valid) - 1) as __mmask16
        }
    }

    /// Packs rows `m0..m0+32` of `a` (zeros past its end) into `dst`: per k-tile, two 16×32
    /// bf16 tiles.
    ///
    /// # Safety
    /// AVX-512F/BW/BF16 available; `dst` holds `k_tiles * 2 * TILE` elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn pack_a_block(a: Mat, m0: usize, dst: &mut [u16]) {
        let (m, k) = (a.rows(), a.cols());
        let (rs, cs) = (a.row_stride(), a.col_stride());
        let k_tiles = k.div_ceil(KT);
        // k-tiles outermost: a transposed operand (a weight gradient's dzᵀ) is gathered
        // across rows, and the 32 rows of one k-tile then share their cache lines.
        for kb in 0..k_tiles {
            for r in 0..BLOCK {
                let row = m0 + r;
                let out = dst
                    .as_mut_ptr()
                    .add((kb * 2 + r / 16) * TILE + (r % 16) * KT);
                if row >= m {
                    _mm512_storeu_si512(out as *mut _, _mm512_setzero_si512());
                    continue;
                }
                let k0 = kb * KT;
                let base = a.as_ptr().add(row * rs + k0 * cs);
                let lo = load16(base, cs, lane_mask(k - k0));
                let hi = if k0 + 16 < k {
                    load16(base.add(16 * cs), cs, lane_mask(k - k0 - 16))
                } else {
                    _mm512_setzero_ps()
                };
                // cvtne2ps: the second argument fills the low half.
                let bf: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_storeu_si512(out as *mut _, bf);
            }
        }
    }

    /// Transposes an N×N matrix held as N rows of N lanes, in registers: 16-bit lanes for
    /// N = 32 (bf16 values), 32-bit lanes for N = 16 (bf16 pairs). Each stage swaps one bit of
    /// the row index with the same bit of the column index (two `vpermt2w`/`vpermt2d` per
    /// pair of rows); log₂ N stages swap them all.
    ///
    /// # Safety
    /// AVX-512F/BW available; N is 16 or 32.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn transpose_lanes<const N: usize>(v: &mut [__m512i; N]) {
        let index = |f: &dyn Fn(usize) -> usize| -> __m512i {
            if N == 32 {
                let lanes: [i16; 32] = std::array::from_fn(|j| f(j) as i16);
                _mm512_loadu_si512(lanes.as_ptr() as *const _)
            } else {
                let lanes: [i32; 16] = std::array::from_fn(|j| f(j) as i32);
                _mm512_loadu_si512(lanes.as_ptr() as *const _)
            }
        };
        let mut bit = N / 2;
        while bit > 0 {
            let keep = index(&|j| if j & bit == 0 { j } else { N + j - bit });
            let swap = index(&|j| if j & bit == 0 { j + bit } else { N + j });
            for i in (0..N).filter(|i| i & bit == 0) {
                let (low, high) = (v[i], v[i + bit]);
                (v[i], v[i + bit]) = if N == 32 {
                    (
                        _mm512_permutex2var_epi16(low, keep, high),
                        _mm512_permutex2var_epi16(low, swap, high),
                    )
                } else {
                    (
                        _mm512_permutex2var_epi32(low, keep, high),
                        _mm512_permutex2var_epi32(low, swap, high),
                    )
                };
            }
            bit /= 2;
        }
    }

    /// Thirty-two consecutive f32 values from `ptr` (`valid` of them, zeros after) as 32 bf16.
    ///
    /// # Safety
    /// AVX-512F/BF16; the first `valid` values readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn load32_bf16(ptr: *const f32, valid: usize) -> __m512i {
        let lo = _mm512_maskz_loadu_ps(lane_mask(valid), ptr);
        let hi = if valid > 16 {
            _mm512_maskz_loadu_ps(lane_mask(valid - 16), ptr.add(16))
        } else {
            _mm512_setzero_ps()
        };
        std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo))
    }

    /// [`pack_a_block`] for a transposed left operand (unit row stride: a weight gradient's
    /// `dzᵀ`): each k reads 32 consecutive rows, and a 32×32 transpose in registers turns
    /// them into tile rows ([`transpose_lanes`]), where gathering across rows cost ~25% of a bf16 GPT step.
    ///
    /// # Safety
    /// As [`pack_a_block`]; `a.row_stride() == 1`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn pack_a_block_transposed(a: Mat, m0: usize, dst: &mut [u16]) {
        let (m, k, cs) = (a.rows(), a.cols(), a.col_stride());
        let rows = m.saturating_sub(m0).min(BLOCK);
        for kb in 0..k.div_ceil(KT) {
            let mut v = [_mm512_setzero_si512(); 32];
            for (kk, column) in v.iter_mut().enumerate() {
                let at = kb * KT + kk;
                if at < k && rows > 0 {
                    *column = load32_bf16(a.as_ptr().add(m0 + at * cs), rows);
                }
            }
            transpose_lanes(&mut v);
            for (r, row) in v.iter().enumerate() {
                let out = dst
                    .as_mut_ptr()
                    .add((kb * 2 + r / 16) * TILE + (r % 16) * KT);
                _mm512_storeu_si512(out as *mut _, *row);
            }
        }
    }

    /// One VNNI tile (column tile `t`, k-tile `kb`) of a transposed right operand (unit row
    /// stride: `Wᵀ` in a forward product): column j of the tile is 32 consecutive k of one
    /// row of `W`, so 16 contiguous loads and a 16×16 transpose of bf16 pairs build it.
    ///
    /// # Safety
    /// AVX-512F/BW/BF16; `b.row_stride() == 1`; `out` writable for one tile.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn pack_b_tile_transposed(b: Mat, t: usize, kb: usize, out: *mut u16) {
        let (k, n, cs) = (b.rows(), b.cols(), b.col_stride());
        let k0 = kb * KT;
        let mut v = [_mm512_setzero_si512(); 16];
        for (j, column) in v.iter_mut().enumerate() {
            let col = t * 16 + j;
            if col < n && k0 < k {
                *column = load32_bf16(b.as_ptr().add(col * cs + k0), k - k0);
            }
        }
        transpose_lanes(&mut v);
        for (p, row) in v.iter().enumerate() {
            _mm512_storeu_si512(out.add(p * KT) as *mut _, *row);
        }
    }

    /// Packs one 64-byte row of a VNNI tile: k-pair `p` of k-tile `kb`, columns `n0..n0+16`
    /// of `b` (zeros past its ends), as `(b[k][j], b[k+1][j])` pairs.
    ///
    /// # Safety
    /// AVX-512F/BW/BF16 available; `out` writable for 32 elements.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn pack_b_pair(b: Mat, kb: usize, p: usize, n0: usize, out: *mut u16) {
        let (k, n) = (b.rows(), b.cols());
        let (rs, cs) = (b.row_stride(), b.col_stride());
        let mask = lane_mask(n.saturating_sub(n0));
        let k_even = kb * KT + 2 * p;
        let row = |kk: usize| {
            if kk < k && mask != 0 {
                load16(b.as_ptr().add(kk * rs + n0 * cs), cs, mask)
            } else {
                _mm512_setzero_ps()
            }
        };
        let (even, odd) = (row(k_even), row(k_even + 1));
        let bf: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(odd, even));
        _mm512_storeu_si512(out as *mut _, _mm512_permutexvar_epi16(interleave(), bf));
    }

    /// The right operand of a packed product: an f32 view, or bf16 rows kept as they are.
    #[derive(Clone, Copy)]
    pub enum Right<'a> {
        F32(Mat<'a>),
        Bf16(Bf16Rows<'a>),
    }

    impl Right<'_> {
        fn cols(&self) -> usize {
            match self {
                Right::F32(m) => m.cols(),
                Right::Bf16(b) => b.cols,
            }
        }
    }

    /// [`pack_b_pair`] from bf16 rows: the bits need no conversion, only the interleave.
    ///
    /// # Safety
    /// AVX-512F/BW/VL available; `out` writable for 32 elements.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn pack_b_pair_bf16(b: Bf16Rows, kb: usize, p: usize, n0: usize, out: *mut u16) {
        let mask = lane_mask(b.cols.saturating_sub(n0));
        let k_even = kb * KT + 2 * p;
        let row = |kk: usize| {
            if kk < b.rows && mask != 0 {
                _mm256_maskz_loadu_epi16(mask, b.bits.as_ptr().add(kk * b.cols + n0) as *const i16)
            } else {
                _mm256_setzero_si256()
            }
        };
        let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(row(k_even)), row(k_even + 1));
        _mm512_storeu_si512(out as *mut _, _mm512_permutexvar_epi16(interleave(), both));
    }

    /// The VNNI interleave of two 16-value rows held low half / high half: output pair j is
    /// (row 2p column j, row 2p+1 column j).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn interleave() -> __m512i {
        _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
            4, 19, 3, 18, 2, 17, 1, 16, 0,
        )
    }

    /// Packs all of `b` into `dst`: column tile `t`, k-tile `kb` at `(t * k_tiles + kb)`
    /// tiles. The walk follows memory: a row-major `b` (an activation, `W`) is read row by
    /// row across all column tiles, a transposed one (`Wᵀ`) column tile by column tile, so
    /// each cache line is used whole while it is in L1.
    fn pack_b(right: Right, dst: &mut [u16], k_tiles: usize, col_tiles: usize, parallel: bool) {
        let out = OutPtr16(dst.as_mut_ptr());
        // bf16 rows are row-major by construction.
        let (row_major, transposed) = match right {
            Right::F32(b) => (
                b.col_stride() == 1,
                b.col_stride() != 1 && b.row_stride() == 1,
            ),
            Right::Bf16(_) => (true, false),
        };
        let (tasks, inner) = if row_major {
            (k_tiles, col_tiles)
        } else {
            (col_tiles, k_tiles)
        };
        let task = |outer: usize| {
            for i in 0..inner {
                let (t, kb) = if row_major { (i, outer) } else { (outer, i) };
                let tile = out.ptr().wrapping_add((t * k_tiles + kb) * TILE);
                // SAFETY (all three): the caller checked the CPU (AVX-512 BF16, which comes
                // with BW and VL here); tile (t, kb) lies inside `dst`; tasks write disjoint
                // tiles or rows.
                match right {
                    Right::F32(b) if transposed => unsafe {
                        pack_b_tile_transposed(b, t, kb, tile)
                    },
                    Right::F32(b) => (0..16)
                        .for_each(|p| unsafe { pack_b_pair(b, kb, p, t * 16, tile.add(p * KT)) }),
                    Right::Bf16(rows) => (0..16).for_each(|p| unsafe {
                        pack_b_pair_bf16(rows, kb, p, t * 16, tile.add(p * KT))
                    }),
                }
            }
        };
        if parallel {
            (0..tasks).into_par_iter().for_each(task);
        } else {
            (0..tasks).for_each(task);
        }
    }

    /// The packed buffer that packing tasks on several threads write disjoint rows of.
    #[derive(Clone, Copy)]
    struct OutPtr16(*mut u16);
    // SAFETY: every task writes a disjoint set of rows.
    unsafe impl Send for OutPtr16 {}
    unsafe impl Sync for OutPtr16 {}

    impl OutPtr16 {
        /// The pointer (a method, so closures capture the `Sync` wrapper, not the field).
        fn ptr(self) -> *mut u16 {
            self.0
        }
    }

    /// The 32×32 block `a_block · b_cols` into `out` (row stride 32), over `k_tiles`; with
    /// `resume`, added to what `out` holds (the previous k-chunk's sums: the order of the
    /// additions is the same as in one pass).
    ///
    /// # Safety
    /// AMX permission granted and configured on this thread (`ldtilecfg`); the slices hold
    /// `k_tiles` tiles as packed above.
    unsafe fn block_amx(
        a: &[u16],
        (b0, b1): (&[u16], &[u16]),
        k_tiles: usize,
        out: &mut [f32],
        resume: bool,
    ) {
        let stride = 64usize;
        let o = out.as_mut_ptr();
        if resume {
            std::arch::asm!(
                "tileloadd tmm0, [{c00} + {s}*1]",
                "tileloadd tmm1, [{c01} + {s}*1]",
                "tileloadd tmm2, [{c10} + {s}*1]",
                "tileloadd tmm3, [{c11} + {s}*1]",
                c00 = in(reg) o,
                c01 = in(reg) o.add(16),
                c10 = in(reg) o.add(16 * BLOCK),
                c11 = in(reg) o.add(16 * BLOCK + 16),
                s = in(reg) BLOCK * 4,
                options(nostack, readonly)
            );
        } else {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack)
            );
        }
        for kb in 0..k_tiles {
            let a0 = a.as_ptr().add(kb * 2 * TILE);
            let a1 = a0.add(TILE);
            let p0 = b0.as_ptr().add(kb * TILE);
            let p1 = b1.as_ptr().add(kb * TILE);
            std::arch::asm!(
                "tileloadd tmm4, [{a0} + {s}*1]",
                "tileloadd tmm5, [{a1} + {s}*1]",
                "tileloadd tmm6, [{p0} + {s}*1]",
                "tileloadd tmm7, [{p1} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a0,
                a1 = in(reg) a1,
                p0 = in(reg) p0,
                p1 = in(reg) p1,
                s = in(reg) stride,
                options(nostack, readonly)
            );
        }
        std::arch::asm!(
            "tilestored [{c00} + {s}*1], tmm0",
            "tilestored [{c01} + {s}*1], tmm1",
            "tilestored [{c10} + {s}*1], tmm2",
            "tilestored [{c11} + {s}*1], tmm3",
            c00 = in(reg) o,
            c01 = in(reg) o.add(16),
            c10 = in(reg) o.add(16 * BLOCK),
            c11 = in(reg) o.add(16 * BLOCK + 16),
            s = in(reg) BLOCK * 4,
            options(nostack)
        );
    }

    /// The same block with `vdpbf16ps`: 8 rows × 32 columns of accumulators at a time.
    ///
    /// # Safety
    /// AVX-512F/BF16 available; slices packed as above.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn block_avx512(
        a: &[u16],
        (b0, b1): (&[u16], &[u16]),
        k_tiles: usize,
        out: &mut [f32],
        resume: bool,
    ) {
        const ROWS: usize = 8;
        for g in 0..BLOCK / ROWS {
            let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
            if resume {
                for (r, acc_row) in acc.iter_mut().enumerate() {
                    let o = out.as_ptr().add((g * ROWS + r) * BLOCK);
                    *acc_row = [_mm512_loadu_ps(o), _mm512_loadu_ps(o.add(16))];
                }
            }
            for kb in 0..k_tiles {
                let tile_a = a.as_ptr().add((kb * 2 + g * ROWS / 16) * TILE);
                let row0 = (g * ROWS) % 16;
                for p in 0..16 {
                    let w0: __m512bh = std::mem::transmute(_mm512_loadu_si512(
                        b0.as_ptr().add(kb * TILE + p * KT) as *const _,
                    ));
                    let w1: __m512bh = std::mem::transmute(_mm512_loadu_si512(
                        b1.as_ptr().add(kb * TILE + p * KT) as *const _,
                    ));
                    for (r, acc_row) in acc.iter_mut().enumerate() {
                        let pair =
                            (tile_a.add((row0 + r) * KT + 2 * p) as *const i32).read_unaligned();
                        let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                        acc_row[0] = _mm512_dpbf16_ps(acc_row[0], x, w0);
                        acc_row[1] = _mm512_dpbf16_ps(acc_row[1], x, w1);
                    }
                }
            }
            for (r, acc_row) in acc.iter().enumerate() {
                let o = out.as_mut_ptr().add((g * ROWS + r) * BLOCK);
                _mm512_storeu_ps(o, acc_row[0]);
                _mm512_storeu_ps(o.add(16), acc_row[1]);
            }
        }
    }

    /// Copies (or adds) the valid part of a 32×32 block into `c` at (m0, n0); rows with unit
    /// column stride (every output of our layers) go sixteen lanes at a time.
    ///
    /// # Safety
    /// `c` points at a view of `rows × cols` with strides `rs`, `cs`; AVX-512F available.
    #[target_feature(enable = "avx512f")]
    unsafe fn write_block(
        c: *mut f32,
        (rows, cols, rs, cs): (usize, usize, usize, usize),
        (m0, n0): (usize, usize),
        block: &[f32],
        accumulate: bool,
    ) {
        let valid_cols = BLOCK.min(cols - n0);
        for r in 0..BLOCK.min(rows - m0) {
            let src = block.as_ptr().add(r * BLOCK);
            let dst = c.add((m0 + r) * rs + n0 * cs);
            if cs == 1 {
                for half in 0..2 {
                    let mask = lane_mask(valid_cols.saturating_sub(16 * half));
                    if mask == 0 {
                        break;
                    }
                    let (s, d) = (src.add(16 * half), dst.add(16 * half));
                    let mut v = _mm512_loadu_ps(s);
                    if accumulate {
                        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, d));
                    }
                    _mm512_mask_storeu_ps(d, mask, v);
                }
                continue;
            }
            for j in 0..valid_cols {
                let d = dst.add(j * cs);
                let v = *src.add(j);
                *d = if accumulate { *d + v } else { v };
            }
        }
    }

    /// Raw output pointer that tasks on several threads write disjoint blocks through.
    #[derive(Clone, Copy)]
    struct OutPtr(*mut f32);
    // SAFETY: every task writes a disjoint set of output blocks.
    unsafe impl Send for OutPtr {}
    unsafe impl Sync for OutPtr {}

    pub fn gemm(kernel: Bf16Kernel, c: MatMut, a: Mat, b: Right, accumulate: bool, threads: usize) {
        let (m, n, k) = (c.rows(), c.cols(), a.cols());
        debug_assert_eq!(n, b.cols());
        let shape = (m, n, c.row_stride(), c.col_stride());
        let k_tiles = k.div_ceil(KT);
        let col_tiles = n.div_ceil(BLOCK) * 2;
        let mut packed_b = Scratch::take(&PACKED_B, col_tiles * k_tiles * TILE);
        let row_blocks = m.div_ceil(BLOCK);
        let col_blocks = col_tiles / 2;
        let parallel = threads > 1 && m * n * k >= crate::matmul::PARALLEL_MIN_MACS;
        pack_b(b, &mut packed_b, k_tiles, col_tiles, parallel);
        // Tasks: a row block × a range of column blocks, enough of them for every thread.
        let col_splits = if parallel {
            (2 * threads).div_ceil(row_blocks).min(col_blocks).max(1)
        } else {
            1
        };
        let per_split = col_blocks.div_ceil(col_splits);
        let out = OutPtr(c.into_mut_ptr());
        let task = |t: usize| {
            let (rb, split) = (t / col_splits, t % col_splits);
            let cb_range = split * per_split..((split + 1) * per_split).min(col_blocks);
            if cb_range.is_empty() {
                return;
            }
            let mut packed_a = Scratch::take(&PACKED_A, k_tiles * 2 * TILE);
            // SAFETY: CPU checked by the caller; buffer sizes as documented.
            unsafe {
                if a.row_stride() == 1 && a.col_stride() != 1 {
                    pack_a_block_transposed(a, rb * BLOCK, &mut packed_a)
                } else {
                    pack_a_block(a, rb * BLOCK, &mut packed_a)
                }
            };
            #[cfg(target_os = "linux")]
            if kernel == Bf16Kernel::Amx {
                // SAFETY: permission granted (Bf16Kernel::available); the config is static.
                unsafe {
                    std::arch::asm!("ldtilecfg [{}]", in(reg) &super::amx::CONFIG, options(nostack));
                }
            }
            // k in chunks of KC_TILES tiles: a chunk of the packed rows (16 KiB) stays in L1
            // while it meets every column block, whose running sums wait in `sums`.
            let blocks = cb_range.len();
            let mut sums = Scratch::take(&SUMS, blocks * BLOCK * BLOCK);
            for k0 in (0..k_tiles).step_by(KC_TILES) {
                let depth = KC_TILES.min(k_tiles - k0);
                let a_chunk = &packed_a[k0 * 2 * TILE..];
                for (i, cb) in cb_range.clone().enumerate() {
                    let tiles = |t: usize| &packed_b[(t * k_tiles + k0) * TILE..];
                    let b = (tiles(2 * cb), tiles(2 * cb + 1));
                    let block = &mut sums[i * BLOCK * BLOCK..(i + 1) * BLOCK * BLOCK];
                    // SAFETY: as above; AMX configured on this thread when chosen.
                    unsafe {
                        match kernel {
                            Bf16Kernel::Amx => block_amx(a_chunk, b, depth, block, k0 > 0),
                            _ => block_avx512(a_chunk, b, depth, block, k0 > 0),
                        }
                    }
                }
            }
            for (i, cb) in cb_range.enumerate() {
                let block = &sums[i * BLOCK * BLOCK..(i + 1) * BLOCK * BLOCK];
                let o = out;
                // SAFETY: this task's output blocks, inside the view.
                unsafe { write_block(o.0, shape, (rb * BLOCK, cb * BLOCK), block, accumulate) };
            }
            sums.put_back(&SUMS);
            #[cfg(target_os = "linux")]
            if kernel == Bf16Kernel::Amx {
                // SAFETY: releases this thread's tile state; nothing on it is live.
                unsafe { std::arch::asm!("tilerelease", options(nostack)) };
            }
            packed_a.put_back(&PACKED_A);
        };
        let tasks = row_blocks * col_splits;
        if parallel {
            (0..tasks).into_par_iter().for_each(task);
        } else {
            (0..tasks).for_each(task);
        }
        packed_b.put_back(&PACKED_B);
    }

    thread_local! {
        static PACKED_A: Cell<Vec<u16>> = const { Cell::new(Vec::new()) };
        static PACKED_B: Cell<Vec<u16>> = const { Cell::new(Vec::new()) };
        static SUMS: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    }

    /// A buffer kept per thread between products (attention runs thousands of small ones a
    /// step; allocating, and faulting in, each buffer again cost more than packing). Taken
    /// out of its slot while in use, so a product nested on the same thread (rayon runs
    /// stolen work inside a wait) finds the slot empty and allocates its own.
    struct Scratch<T: 'static>(Vec<T>);

    impl<T: Copy + Default + 'static> Scratch<T> {
        fn take(slot: &'static std::thread::LocalKey<Cell<Vec<T>>>, len: usize) -> Scratch<T> {
            let mut v = slot.with(Cell::take);
            // Every element is written before it is read.
            v.resize(len, T::default());
            Scratch(v)
        }

        /// Keeps the buffer for the next product on this thread, unless it is one of the rare
        /// huge ones (a vocabulary head's weights), which would stay allocated on every thread.
        fn put_back(self, slot: &'static std::thread::LocalKey<Cell<Vec<T>>>) {
            const KEEP_AT_MOST_BYTES: usize = 16 << 20;
            if self.0.len() * std::mem::size_of::<T>() <= KEEP_AT_MOST_BYTES {
                slot.with(|s| s.set(self.0));
            }
        }
    }

    impl<T> std::ops::Deref for Scratch<T> {
        type Target = [T];
        fn deref(&self) -> &[T] {
            &self.0
        }
    }

    impl<T> std::ops::DerefMut for Scratch<T> {
        fn deref_mut(&mut self) -> &mut [T] {
            &mut self.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::rng::SplitMix64::new(seed);
        (0..n).map(|_| 2.0 * rng.next_f32() - 1.0).collect()
    }

    /// f64 product of the stored values, and of their magnitudes (the scale of rounding).
    fn reference(m: usize, n: usize, k: usize, a: Mat, b: Mat) -> (Vec<f64>, Vec<f64>) {
        let at = |mat: Mat, i: usize, j: usize| unsafe {
            *mat.as_ptr()
                .add(i * mat.row_stride() + j * mat.col_stride()) as f64
        };
        let mut exact = vec![0.0; m * n];
        let mut magnitude = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    let prod = at(a, i, p) * at(b, p, j);
                    exact[i * n + j] += prod;
                    magnitude[i * n + j] += prod.abs();
                }
            }
        }
        (exact, magnitude)
    }

    /// Every kernel on odd shapes, transposed operands and accumulation, within the bound
    /// that bf16 inputs with f32 accumulation allow: each input carries a relative error of
    /// at most 2⁻⁹, so a product 2⁻⁸; the f32 sum adds at most k·2⁻²⁴ of the magnitudes.
    #[test]
    fn bf16_products_stay_within_rounding_bounds_of_an_f64_reference() {
        for &kernel in Bf16Kernel::available() {
            for &(m, n, k) in &[
                (1, 1, 1),
                (3, 5, 7),
                (33, 17, 65),
                (64, 48, 300),
                (70, 130, 40),
            ] {
                let a = pseudo_random(m * k, 1);
                let b_t = pseudo_random(n * k, 2);
                // a row-major; b given as the transpose of an n×k matrix (strided like Wᵀ).
                let (av, bv) = (Mat::new(&a, m, k), Mat::new(&b_t, n, k).t());
                check_transposed_operands(kernel, (m, n, k), &a, &b_t);
                let (exact, magnitude) = reference(m, n, k, av, bv);
                let bound = |i: usize| magnitude[i] * (2f64.powi(-8) + k as f64 * 2f64.powi(-24));
                let mut c = vec![0.5f32; m * n];
                gemm_bf16_with(kernel, MatMut::new(&mut c, m, n), av, bv, false, 2);
                for (i, v) in c.iter().enumerate() {
                    let err = (*v as f64 - exact[i]).abs();
                    assert!(
                        err <= bound(i),
                        "{kernel:?} {m}x{n}x{k} [{i}]: {v} vs {}",
                        exact[i]
                    );
                }
                gemm_bf16_with(kernel, MatMut::new(&mut c, m, n), av, bv, true, 1);
                for (i, v) in c.iter().enumerate() {
                    let err = (*v as f64 - 2.0 * exact[i]).abs();
                    assert!(
                        err <= 2.0 * bound(i),
                        "{kernel:?} accumulate {m}x{n}x{k} [{i}]"
                    );
                }
            }
        }
    }

    /// The other orientations: `a` transposed (a weight gradient's `dzᵀ`), `b` row-major;
    /// the same products as `a · b_tᵀ` bit for bit, since only the packing differs.
    fn check_transposed_operands(
        kernel: Bf16Kernel,
        (m, n, k): (usize, usize, usize),
        a: &[f32],
        b_t: &[f32],
    ) {
        let a_t: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
        let b: Vec<f32> = (0..k * n).map(|i| b_t[(i % n) * k + i / n]).collect();
        let mut want = vec![0.0f32; m * n];
        gemm_bf16_with(
            kernel,
            MatMut::new(&mut want, m, n),
            Mat::new(a, m, k),
            Mat::new(b_t, n, k).t(),
            false,
            1,
        );
        for (av, bv) in [
            (Mat::new(&a_t, k, m).t(), Mat::new(&b, k, n)),
            (Mat::new(&a_t, k, m).t(), Mat::new(b_t, n, k).t()),
            (Mat::new(a, m, k), Mat::new(&b, k, n)),
        ] {
            let mut got = vec![0.0f32; m * n];
            gemm_bf16_with(kernel, MatMut::new(&mut got, m, n), av, bv, false, 2);
            assert_eq!(
                got, want,
                "{kernel:?} {m}x{n}x{k}: orientation changes the result"
            );
        }
    }

    /// 2¹⁷ products of about 1: a bf16 accumulator stops growing at 256 (256 + 1 is not
    /// representable), an f32 one counts every term (to f32 rounding of the running sum:
    /// above 2¹⁷ its spacing is 2⁻⁶, so 10⁻⁴ relative is generous and bf16's 99% is not).
    #[test]
    fn long_dot_products_accumulate_in_f32() {
        let k = 1 << 17;
        let a = vec![1.0f32; k];
        let b: Vec<f32> = (0..k)
            .map(|i| if i % 2 == 0 { 1.0 } else { 1.0078125 })
            .collect();
        let want: f64 = b.iter().map(|&x| x as f64).sum();
        for &kernel in Bf16Kernel::available() {
            let mut c = [0.0f32];
            gemm_bf16_with(
                kernel,
                MatMut::new(&mut c, 1, 1),
                Mat::new(&a, 1, k),
                Mat::new(&b, k, 1),
                false,
                1,
            );
            assert!(
                ((c[0] as f64) - want).abs() <= want * 1e-4,
                "{kernel:?}: {} vs {want}",
                c[0]
            );
        }
    }

    /// A row's result does not depend on the other rows: 37 rows, then 5 of them alone.
    #[test]
    fn each_row_is_computed_the_same_whatever_the_batch() {
        let (m, n, k) = (37, 40, 90);
        let a = pseudo_random(m * k, 3);
        let b = pseudo_random(k * n, 4);
        for &kernel in Bf16Kernel::available() {
            let mut all = vec![0.0f32; m * n];
            let (av, bv) = (Mat::new(&a, m, k), Mat::new(&b, k, n));
            gemm_bf16_with(kernel, MatMut::new(&mut all, m, n), av, bv, false, 2);
            let mut some = vec![0.0f32; 5 * n];
            gemm_bf16_with(
                kernel,
                MatMut::new(&mut some, 5, n),
                av.rows_range(30, 35),
                bv,
                false,
                1,
            );
            assert_eq!(&all[30 * n..35 * n], &some[..], "{kernel:?}");
        }
    }

    /// A right operand kept in bf16 gives what the same values in f32 give, bit for bit.
    #[test]
    fn bf16_rows_read_directly_equal_their_widened_values() {
        for &(m, n, k) in &[(1, 1, 1), (33, 17, 65), (70, 130, 300)] {
            let a = pseudo_random(m * k, 5);
            let mut b = pseudo_random(k * n, 6);
            crate::dtype::round_through(&mut b, DType::BF16);
            let bits: Vec<u16> = b
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            let a_t: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
            let mut want = vec![0.25f32; m * n];
            let mut got = want.clone();
            let av = Mat::new(&a_t, k, m).t();
            gemm_lowp(
                DType::BF16,
                MatMut::new(&mut want, m, n),
                av,
                Mat::new(&b, k, n),
                true,
                2,
            );
            gemm_bf16_rows(
                MatMut::new(&mut got, m, n),
                av,
                Bf16Rows::new(&bits, k, n),
                true,
                2,
            );
            assert_eq!(got, want, "{m}x{n}x{k}");
        }
    }

    #[test]
    fn f16_products_round_inputs_to_half() {
        let a = [1.0f32 + 1.0 / 4096.0, 3.0];
        let b = [1.0f32, 1.0];
        let mut c = [0.0f32];
        gemm_lowp(
            DType::F16,
            MatMut::new(&mut c, 1, 1),
            Mat::new(&a, 1, 2),
            Mat::new(&b, 2, 1),
            false,
            1,
        );
        // 1 + 2⁻¹² is not an f16 (10 fraction bits): it rounds to 1.
        assert_eq!(c[0], 4.0);
        gemm_lowp(
            DType::F32,
            MatMut::new(&mut c, 1, 1),
            Mat::new(&a, 1, 2),
            Mat::new(&b, 2, 1),
            false,
            1,
        );
        assert_eq!(c[0], 4.0 + 1.0 / 4096.0);
        // Overflow past f16's 65504 is inf, which the loss scaler detects.
        let big = [70000.0f32];
        gemm_lowp(
            DType::F16,
            MatMut::new(&mut c, 1, 1),
            Mat::new(&big, 1, 1),
            Mat::new(&b[..1], 1, 1),
            false,
            1,
        );
        assert!(c[0].is_infinite());
    }
}
