//! Every matrix product in meshtrain goes through [`gemm`]: one place to optimise, measure and
//! swap the backend. The default backend is the pure-Rust `gemm` crate (run-time dispatch to
//! AVX2/AVX-512, nothing to install); the `openblas` feature routes products to the system
//! OpenBLAS (`libopenblas-dev`), which is faster on large f32 products.

use crate::{lowp, par, DType};

/// Which library computes matrix products in this build (reported by benchmarks).
pub const BACKEND: &str = if cfg!(feature = "openblas") {
    "openblas"
} else {
    "gemm"
};

/// A read-only strided matrix view: element (i, j) lives at `i * rs + j * cs`.
/// Strides make transposes and sub-blocks (an attention head inside a fused QKV buffer) free.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

/// A mutable strided matrix view; see [`Mat`].
pub struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

fn check_bounds(len: usize, rows: usize, cols: usize, rs: usize, cs: usize) {
    if rows > 0 && cols > 0 {
        // Checked: wrapped-around strides must not pass for a view inside the buffer (the
        // kernels index through these views without further checks).
        let last = (rows - 1)
            .checked_mul(rs)
            .and_then(|r| (cols - 1).checked_mul(cs).and_then(|c| r.checked_add(c)));
        assert!(
            last.is_some_and(|last| last < len),
            "matrix view {rows}x{cols} (strides {rs},{cs}) exceeds buffer of {len}"
        );
    }
}

impl<'a> Mat<'a> {
    /// A contiguous row-major `rows × cols` matrix.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::strided(data, rows, cols, cols, 1)
    }

    pub fn strided(data: &'a [f32], rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        check_bounds(data.len(), rows, cols, rs, cs);
        Mat {
            data,
            rows,
            cols,
            rs,
            cs,
        }
    }

    /// The transpose, as a view (no copy).
    pub fn t(self) -> Self {
        Mat {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }

    /// Rows `r0..r1` of the view (no copy).
    pub fn rows_range(self, r0: usize, r1: usize) -> Self {
        assert!(
            r0 <= r1 && r1 <= self.rows,
            "rows {r0}..{r1} of {}",
            self.rows
        );
        Mat {
            data: &self.data[(r0 * self.rs).min(self.data.len())..],
            rows: r1 - r0,
            ..self
        }
    }

    /// Columns `c0..c1` of the view (no copy).
    pub fn cols_range(self, c0: usize, c1: usize) -> Self {
        assert!(
            c0 <= c1 && c1 <= self.cols,
            "columns {c0}..{c1} of {}",
            self.cols
        );
        Mat {
            data: &self.data[(c0 * self.cs).min(self.data.len())..],
            cols: c1 - c0,
            ..self
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn row_stride(&self) -> usize {
        self.rs
    }

    pub fn col_stride(&self) -> usize {
        self.cs
    }

    /// Pointer to element (0, 0), for kernels that index with the strides themselves.
    pub fn as_ptr(&self) -> *const f32 {
        self.data.as_ptr()
    }

    /// The elements of a view without gaps (row-major `rs == cols, cs == 1`, or column-major
    /// `rs == 1, cs == rows`) in storage order, with the view's strides; `None` for others.
    pub fn dense_storage(&self) -> Option<(&'a [f32], usize, usize)> {
        let len = self.rows * self.cols;
        let dense =
            (self.rs == self.cols && self.cs == 1) || (self.rs == 1 && self.cs == self.rows);
        (dense && self.data.len() >= len).then(|| (&self.data[..len], self.rs, self.cs))
    }

    /// Element (`r`, `c`).
    pub fn at(&self, r: usize, c: usize) -> f32 {
        assert!(
            r < self.rows && c < self.cols,
            "({r}, {c}) outside a {}x{} matrix",
            self.rows,
            self.cols
        );
        self.data[r * self.rs + c * self.cs]
    }
}

impl<'a> MatMut<'a> {
    pub fn new(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        Self::strided(data, rows, cols, cols, 1)
    }

    pub fn strided(data: &'a mut [f32], rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        check_bounds(data.len(), rows, cols, rs, cs);
        MatMut {
            data,
            rows,
            cols,
            rs,
            cs,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn row_stride(&self) -> usize {
        self.rs
    }

    pub fn col_stride(&self) -> usize {
        self.cs
    }

    /// Pointer to element (0, 0), for kernels that index with the strides themselves; the
    /// view is consumed so the borrow ends with the pointer's use.
    pub fn into_mut_ptr(self) -> *mut f32 {
        self.data.as_mut_ptr()
    }
}

/// Below this many multiply-adds a product runs on one thread: splitting costs more than it saves.
pub(crate) const PARALLEL_MIN_MACS: usize = 1 << 18;

/// `c = a · b`, or `c += a · b` when `accumulate`; threads from the current pool.
pub fn gemm(c: MatMut, a: Mat, b: Mat, accumulate: bool) {
    gemm_f32_with_threads(c, a, b, accumulate, par::threads())
}

/// [`gemm`] with the inputs rounded to `dtype` (bf16 or f16) and f32 accumulation: the
/// products of mixed-precision training ([`crate::lowp`]). `DType::F32` is [`gemm`].
pub fn gemm_in(dtype: DType, c: MatMut, a: Mat, b: Mat, accumulate: bool) {
    lowp::gemm_lowp(dtype, c, a, b, accumulate, par::threads())
}

/// [`gemm`] on one thread: for callers that already parallelise over many small products
/// (attention heads, batch chunks).
pub fn gemm_serial(c: MatMut, a: Mat, b: Mat, accumulate: bool) {
    gemm_f32_with_threads(c, a, b, accumulate, 1)
}

/// One product of [`gemm_pair`]: (output, a, b, accumulate).
pub type Product<'a, 'b> = (MatMut<'a>, Mat<'b>, Mat<'b>, bool);

/// Two independent products at once, each on half of the pool's threads.
///
/// A layer's backward has two products of equal size, the weight gradient `dyᵀ·x` and the
/// input gradient `dy·W`. The weight-gradient product is long and thin (its inner dimension
/// is the whole batch), a shape the `gemm` crate splits poorly over threads; running the two
/// side by side, each on its own thread, keeps every thread busy with no synchronisation
/// inside either product. Results are bit-identical to running them one after the other.
pub fn gemm_pair(first: Product, second: Product) {
    gemm_pair_in(DType::F32, first, second)
}

/// [`gemm_pair`] with inputs rounded to `dtype` (see [`gemm_in`]).
pub fn gemm_pair_in(dtype: DType, first: Product, second: Product) {
    let macs = |p: &Product| p.0.rows * p.0.cols * p.1.cols;
    let sizes = [macs(&first), macs(&second)];
    run_pair(
        sizes,
        move |threads| {
            let (c, a, b, acc) = first;
            lowp::gemm_lowp(dtype, c, a, b, acc, threads)
        },
        move |threads| {
            let (c, a, b, acc) = second;
            lowp::gemm_lowp(dtype, c, a, b, acc, threads)
        },
    );
}

/// Runs two independent products (`macs` multiply-adds each; each closure gets its thread
/// count) side by side on half of the pool's threads each, or one after the other on all of
/// them when either is too small to split (see [`gemm_pair`]). For pairs whose operands are
/// not both f32 views (a weight gradient against a kept bf16 activation).
pub fn run_pair(
    macs: [usize; 2],
    first: impl FnOnce(usize) + Send,
    second: impl FnOnce(usize) + Send,
) {
    let threads = par::threads();
    if threads < 2 || macs[0].min(macs[1]) < PARALLEL_MIN_MACS {
        first(threads);
        second(threads);
        return;
    }
    let half = threads / 2;
    rayon::join(move || first(half), move || second(threads - half));
}

/// Panics unless `c (rows × cols) = a · b` fits, `b` being `b_rows × b_cols`.
pub(crate) fn check_product(c: &MatMut, a: &Mat, (b_rows, b_cols): (usize, usize)) {
    assert_eq!(a.cols, b_rows, "gemm: inner dimensions differ");
    assert_eq!(c.rows, a.rows, "gemm: output rows differ");
    assert_eq!(c.cols, b_cols, "gemm: output columns differ");
}

/// The f32 product on at most `threads` threads.
pub(crate) fn gemm_f32_with_threads(c: MatMut, a: Mat, b: Mat, accumulate: bool, threads: usize) {
    check_product(&c, &a, (b.rows, b.cols));
    let (m, n, k) = (c.rows, c.cols, a.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    c.data[i * c.rs + j * c.cs] = 0.0;
                }
            }
        }
        return;
    }
    let threads = if m * n * k < PARALLEL_MIN_MACS {
        1
    } else {
        threads
    };
    backend::gemm(c, a, b, accumulate, threads);
}

#[cfg(not(feature = "openblas"))]
mod backend {
    use super::{Mat, MatMut};

    pub fn gemm(c: MatMut, a: Mat, b: Mat, accumulate: bool, threads: usize) {
        let parallelism = if threads > 1 {
            gemm::Parallelism::Rayon(threads)
        } else {
            gemm::Parallelism::None
        };
        // SAFETY: the views were bounds-checked at construction against their slices, the
        // output is borrowed mutably (no aliasing with a or b), and the dimensions match.
        unsafe {
            gemm::gemm(
                c.rows,
                c.cols,
                a.cols,
                c.data.as_mut_ptr(),
                c.cs as isize,
                c.rs as isize,
                accumulate,
                a.data.as_ptr(),
                a.cs as isize,
                a.rs as isize,
                b.data.as_ptr(),
                b.cs as isize,
                b.rs as isize,
                1.0f32,
                1.0f32,
                false,
                false,
                false,
                parallelism,
            );
        }
    }
}

#[cfg(feature = "openblas")]
mod backend {
    use super::{Mat, MatMut};

    #[allow(non_camel_case_types)]
    type blasint = i32;
    const ROW_MAJOR: i32 = 101;
    const NO_TRANS: i32 = 111;
    const TRANS: i32 = 112;

    #[link(name = "openblas")]
    extern "C" {
        fn cblas_sgemm(
            order: i32,
            transa: i32,
            transb: i32,
            m: blasint,
            n: blasint,
            k: blasint,
            alpha: f32,
            a: *const f32,
            lda: blasint,
            b: *const f32,
            ldb: blasint,
            beta: f32,
            c: *mut f32,
            ldc: blasint,
        );
        fn openblas_set_num_threads(n: i32);
    }

    /// (transpose flag, leading dimension) of a view for row-major BLAS, or None if neither
    /// stride is unit (BLAS cannot express it; we then copy).
    fn layout(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<(i32, usize)> {
        if cs == 1 && rs >= cols.max(1) {
            Some((NO_TRANS, rs))
        } else if rs == 1 && cs >= rows.max(1) {
            Some((TRANS, cs))
        } else {
            None
        }
    }

    fn packed(m: Mat) -> Vec<f32> {
        let mut out = Vec::with_capacity(m.rows * m.cols);
        for i in 0..m.rows {
            for j in 0..m.cols {
                out.push(m.data[i * m.rs + j * m.cs]);
            }
        }
        out
    }

    pub fn gemm(c: MatMut, a: Mat, b: Mat, accumulate: bool, threads: usize) {
        let (m, n, k) = (c.rows, c.cols, a.cols);
        let a_packed;
        let (ta, lda, a_ptr) = match layout(a.rows, a.cols, a.rs, a.cs) {
            Some((t, ld)) => (t, ld, a.data.as_ptr()),
            None => {
                a_packed = packed(a);
                (NO_TRANS, k, a_packed.as_ptr())
            }
        };
        let b_packed;
        let (tb, ldb, b_ptr) = match layout(b.rows, b.cols, b.rs, b.cs) {
            Some((t, ld)) => (t, ld, b.data.as_ptr()),
            None => {
                b_packed = packed(b);
                (NO_TRANS, n, b_packed.as_ptr())
            }
        };
        assert!(
            c.cs == 1 && c.rs >= n,
            "openblas backend needs a row-major output"
        );
        let beta = if accumulate { 1.0 } else { 0.0 };
        // SAFETY: views are bounds-checked; pointers and leading dimensions describe them.
        // Changing OpenBLAS's thread count is not free (it takes a lock and may touch its
        // pool): only do it when the wanted count differs from the last one set.
        static LAST_THREADS: std::sync::atomic::AtomicUsize =
            std::sync::atomic::AtomicUsize::new(0);
        if LAST_THREADS.swap(threads, std::sync::atomic::Ordering::Relaxed) != threads {
            // SAFETY: plain configuration call into OpenBLAS.
            unsafe { openblas_set_num_threads(threads as i32) };
        }
        unsafe {
            cblas_sgemm(
                ROW_MAJOR,
                ta,
                tb,
                m as blasint,
                n as blasint,
                k as blasint,
                1.0,
                a_ptr,
                lda as blasint,
                b_ptr,
                ldb as blasint,
                beta,
                c.data.as_mut_ptr(),
                c.rs as blasint,
            );
        }
    }
}

/// Naive triple loop, the reference the tests hold [`gemm`] to.
pub fn gemm_reference(m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    for i in 0..m {
        for p in 0..k {
            let av = a[i * k + p];
            for j in 0..n {
                c[i * n + j] += av * b[p * n + j];
            }
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo_random(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2000) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn gemm_matches_reference_for_odd_shapes_and_transposes() {
        for &(m, n, k) in &[(1, 1, 1), (3, 5, 7), (17, 33, 65), (64, 48, 300)] {
            let a = pseudo_random(m * k, 1);
            let b = pseudo_random(k * n, 2);
            let want = gemm_reference(m, n, k, &a, &b);
            let mut c = vec![0.0; m * n];
            gemm(
                MatMut::new(&mut c, m, n),
                Mat::new(&a, m, k),
                Mat::new(&b, k, n),
                false,
            );
            for (x, y) in c.iter().zip(&want) {
                assert!((x - y).abs() < 1e-4 * (k as f32), "{x} vs {y}");
            }
            // a^T stored as k×m, used transposed; accumulate doubles the result.
            let at: Vec<f32> = (0..k * m).map(|idx| a[(idx % m) * k + idx / m]).collect();
            gemm(
                MatMut::new(&mut c, m, n),
                Mat::new(&at, k, m).t(),
                Mat::new(&b, k, n),
                true,
            );
            for (x, y) in c.iter().zip(&want) {
                assert!(
                    (x - 2.0 * y).abs() < 2e-4 * (k as f32),
                    "{x} vs {}",
                    2.0 * y
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "exceeds buffer")]
    fn views_whose_strides_wrap_around_are_rejected() {
        let a = vec![0.0; 5];
        let _ = Mat::strided(&a, 2, 2, 1 << 63, 1 << 63);
    }

    #[test]
    #[should_panic(expected = "exceeds buffer")]
    fn out_of_bounds_views_are_rejected() {
        let a = vec![0.0; 5];
        let _ = Mat::new(&a, 2, 3);
    }
}
