//! Matrix products on cuBLASLt: bf16/f16 inputs with f32 accumulation (and f32 or 16-bit
//! outputs), or f32 inputs in true f32 or, as an explicit option, TF32.
//!
//! cuBLAS is column-major and meshtrain's tensors are row-major; [`Gemm`] is the
//! column-major description, and [`super::ops`] turns each row-major product of a layer into
//! one (a row-major `X` is the column-major `Xᵀ` of the same memory). A plan (descriptors,
//! layouts and the heuristic's chosen algorithm) is made once per shape and reused.

use super::context::CudaDevice;
use super::error::CudaError;
use crate::fp8::Fp8Format;
use crate::DType;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use std::collections::HashMap;
use std::sync::Arc;

/// How f32 products are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum F32Math {
    /// True f32 (`CUBLAS_COMPUTE_32F`): the CPU's results to f32 rounding.
    #[default]
    Exact,
    /// TF32 tensor cores (10-bit mantissas in, f32 accumulation): ~7x faster, ~1e-3 relative
    /// error. Only when asked for (`train.tf32`).
    Tf32,
}

/// `D = α·op(A)·op(B) + β·C` in cuBLAS's column-major terms, `C = D` (β = 1 when
/// `accumulate`), then the [`Epilogue`]'s pass over it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub transa: bool,
    pub transb: bool,
    pub a: u64,
    pub lda: usize,
    pub b: u64,
    pub ldb: usize,
    /// The type of A and B.
    pub input: DType,
    pub d: u64,
    pub ldd: usize,
    pub output: DType,
    pub accumulate: bool,
    pub epilogue: Epilogue,
    pub alpha: f32,
    pub math: F32Math,
    /// FP8 operands instead of `input`-typed ones (Hopper and Ada tensor cores).
    pub fp8: Option<Fp8Operands>,
}

/// What a product does to its output besides the sum: cuBLASLt's epilogues, a pass over
/// the output fused into the product that writes it, so the output is not read again.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Epilogue {
    #[default]
    None,
    /// `bias` (`m` values of D's type) added to every column.
    Bias(u64),
    /// D = GELU(the product (+ `bias`)), the tanh approximation (cuBLASLt's GELU, PyTorch's
    /// `approximate="tanh"`), with the pre-activation written to `aux` (D's type, `ldd`)
    /// for backward: a linear layer's bias and GELU in the product
    /// (`CUBLASLT_EPILOGUE_GELU_AUX[_BIAS]`) instead of a pass that reads the product back.
    GeluAux { bias: Option<u64>, aux: u64 },
    /// D = the product × GELU′(`aux`) (the tanh approximation's derivative; `aux` the
    /// pre-activation, D's type and `ldd`): an input gradient taken through the previous
    /// layer's GELU in the product that computes it (`CUBLASLT_EPILOGUE_DGELU`), instead of
    /// a pass that reads it back with the pre-activation.
    DGelu { aux: u64 },
    /// `n` values of D's type at the address: each column's sum over `k` of op(B), written
    /// (not added). A weight gradient's product reads the output gradient as B anyway, so
    /// the bias gradient comes with it (`CUBLASLT_EPILOGUE_BGRADB`) instead of a pass of
    /// column sums over it.
    BiasGradB(u64),
}

/// [`Epilogue`] without its addresses: what a plan is made for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum EpilogueKind {
    None,
    Bias,
    GeluAux,
    GeluAuxBias,
    DGelu,
    BiasGradB,
}

impl Epilogue {
    fn kind(self) -> EpilogueKind {
        match self {
            Epilogue::None => EpilogueKind::None,
            Epilogue::Bias(_) => EpilogueKind::Bias,
            Epilogue::GeluAux { bias: None, .. } => EpilogueKind::GeluAux,
            Epilogue::GeluAux { bias: Some(_), .. } => EpilogueKind::GeluAuxBias,
            Epilogue::DGelu { .. } => EpilogueKind::DGelu,
            Epilogue::BiasGradB(_) => EpilogueKind::BiasGradB,
        }
    }

    /// The vector cuBLASLt reads or writes through its bias pointer.
    fn bias(self) -> Option<u64> {
        match self {
            Epilogue::Bias(b) | Epilogue::BiasGradB(b) => Some(b),
            Epilogue::GeluAux { bias, .. } => bias,
            Epilogue::None | Epilogue::DGelu { .. } => None,
        }
    }

    fn aux(self) -> Option<u64> {
        match self {
            Epilogue::GeluAux { aux, .. } | Epilogue::DGelu { aux } => Some(aux),
            _ => None,
        }
    }

    /// Whether it writes into D's columns before β·C is added, which accumulation would mix.
    fn transforms_output(self) -> bool {
        matches!(
            self,
            Epilogue::Bias(_) | Epilogue::GeluAux { .. } | Epilogue::DGelu { .. }
        )
    }

    /// How the profile names it (after the product's shape).
    fn label(self) -> &'static str {
        match self.kind() {
            EpilogueKind::None => "",
            EpilogueKind::Bias => " +bias",
            EpilogueKind::GeluAux => " +gelu",
            EpilogueKind::GeluAuxBias => " +bias+gelu",
            EpilogueKind::DGelu => " +dgelu",
            EpilogueKind::BiasGradB => " +bgrad",
        }
    }

    fn cublas(self) -> sys::cublasLtEpilogue_t {
        use sys::cublasLtEpilogue_t as E;
        match self.kind() {
            EpilogueKind::None => E::CUBLASLT_EPILOGUE_DEFAULT,
            EpilogueKind::Bias => E::CUBLASLT_EPILOGUE_BIAS,
            EpilogueKind::GeluAux => E::CUBLASLT_EPILOGUE_GELU_AUX,
            EpilogueKind::GeluAuxBias => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            EpilogueKind::DGelu => E::CUBLASLT_EPILOGUE_DGELU,
            EpilogueKind::BiasGradB => E::CUBLASLT_EPILOGUE_BGRADB,
        }
    }
}

/// The operands of an FP8 product: their formats, and the device f32s holding the inverses
/// of their scales, which cuBLASLt multiplies the f32 sums by (its `A_SCALE` and `B_SCALE`
/// pointers; [`super::train_ops::Fp8Cast::inv_scale`]). cuBLASLt takes FP8 operands only
/// as "TN" (A transposed, B not), with `k` and the leading dimensions multiples of 16, and
/// not both in E5M2.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Operands {
    pub a: Fp8Format,
    pub b: Fp8Format,
    pub a_inv_scale: u64,
    pub b_inv_scale: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    m: usize,
    n: usize,
    k: usize,
    transa: bool,
    transb: bool,
    lda: usize,
    ldb: usize,
    ldd: usize,
    input: DType,
    output: DType,
    epilogue: EpilogueKind,
    /// β = 1: the same descriptors as β = 0, but the fastest algorithm can differ (it reads
    /// D too), so the two are tuned, and remembered, apart.
    accumulate: bool,
    math: F32Math,
    /// The FP8 operands' formats (A, B), for an FP8 product.
    fp8: Option<(Fp8Format, Fp8Format)>,
    /// Pointer alignments (bytes, up to 256: A, B, D, and the epilogue's vectors and
    /// matrix): algorithms are chosen for them.
    align: [u32; 4],
}

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    /// Algorithms the heuristic offered, best first.
    algos: Vec<sys::cublasLtMatmulHeuristicResult_t>,
}

// SAFETY: cuBLASLt descriptors are plain host objects, used under the device's blas lock.
unsafe impl Send for Plan {}

/// cuBLASLt on one device: its handle, a workspace and the plans made so far.
pub struct Blas {
    device: Arc<CudaDevice>,
    handle: sys::cublasLtHandle_t,
    workspace: super::context::DevBuf,
    plans: HashMap<PlanKey, Plan>,
    /// Descriptions cuBLASLt offered no algorithm for ([`Blas::try_gemm`]), asked once.
    refused: std::collections::HashSet<PlanKey>,
}

// SAFETY: the handle is used under the device's blas lock only.
unsafe impl Send for Blas {}

/// cuBLASLt's recommended workspace on Hopper.
const WORKSPACE_BYTES: usize = 32 << 20;
/// How many algorithms the heuristic is asked for (the first is used; the benchmark times
/// them all).
const ALGOS_ASKED: i32 = 8;

fn data_type(d: DType) -> sys::cudaDataType {
    match d {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
    }
}

fn fp8_data_type(f: Fp8Format) -> sys::cudaDataType {
    match f {
        Fp8Format::E4M3 => sys::cudaDataType::CUDA_R_8F_E4M3,
        Fp8Format::E5M2 => sys::cudaDataType::CUDA_R_8F_E5M2,
    }
}

/// The largest power of two up to 256 dividing `ptr`.
pub fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        return 256;
    }
    (1u64 << ptr.trailing_zeros().min(8)) as u32
}

impl Gemm {
    /// An `m × n × k` product of `input`-typed operands into the same type, no transposes,
    /// no accumulation, no bias, α = 1: what a layer's products start from (their operands
    /// and leading dimensions filled in by the caller).
    pub fn plain(m: usize, n: usize, k: usize, input: DType, math: F32Math) -> Gemm {
        Gemm {
            m,
            n,
            k,
            transa: false,
            transb: false,
            a: 0,
            lda: 0,
            b: 0,
            ldb: 0,
            input,
            d: 0,
            ldd: 0,
            output: input,
            accumulate: false,
            epilogue: Epilogue::None,
            alpha: 1.0,
            math,
            fp8: None,
        }
    }

    /// Checks the description before cuBLASLt sees it (a wrong leading dimension would
    /// read out of bounds).
    pub fn validate(&self) -> Result<(), CudaError> {
        let (a_rows, _) = if self.transa {
            (self.k, self.m)
        } else {
            (self.m, self.k)
        };
        let (b_rows, _) = if self.transb {
            (self.n, self.k)
        } else {
            (self.k, self.n)
        };
        let bad = |what: &str| {
            Err(CudaError::Unsupported(format!(
                "matrix product {}x{}x{}: {what}",
                self.m, self.n, self.k
            )))
        };
        if self.m == 0 || self.n == 0 || self.k == 0 {
            return bad("empty dimension");
        }
        if self.lda < a_rows.max(1) || self.ldb < b_rows.max(1) || self.ldd < self.m {
            return bad("a leading dimension is smaller than its matrix's rows");
        }
        if self.input == DType::F32 && self.output != DType::F32 {
            return bad("f32 inputs need an f32 output");
        }
        if self.epilogue.transforms_output() && self.accumulate {
            return bad("a bias or activation epilogue with accumulation");
        }
        if self.epilogue.aux().is_some() && !self.ldd.is_multiple_of(8) {
            return bad("an epilogue's auxiliary matrix with a leading dimension off 8 values");
        }
        if let Some(fp8) = self.fp8 {
            if !self.transa || self.transb {
                return bad("FP8 operands only as A transposed, B not (cuBLASLt's TN)");
            }
            if ![self.k, self.lda, self.ldb]
                .iter()
                .all(|d| d.is_multiple_of(16))
            {
                return bad(
                    "FP8 operands need the inner dimension and leading dimensions in \
                     multiples of 16",
                );
            }
            if fp8.a == Fp8Format::E5M2 && fp8.b == Fp8Format::E5M2 {
                return bad("FP8 operands both in E5M2");
            }
            if self.output == DType::F16 && self.epilogue != Epilogue::None {
                return bad("an FP8 product with a bias wants a bf16 or f32 output");
            }
            if !matches!(self.epilogue, Epilogue::None | Epilogue::Bias(_)) {
                return bad("FP8 operands with an epilogue other than a bias");
            }
        }
        Ok(())
    }

    fn key(&self) -> PlanKey {
        PlanKey {
            m: self.m,
            n: self.n,
            k: self.k,
            transa: self.transa,
            transb: self.transb,
            lda: self.lda,
            ldb: self.ldb,
            ldd: self.ldd,
            input: self.input,
            output: self.output,
            epilogue: self.epilogue.kind(),
            accumulate: self.accumulate,
            math: self.math,
            fp8: self.fp8.map(|f| (f.a, f.b)),
            align: [
                alignment(self.a),
                alignment(self.b),
                alignment(self.d),
                [self.epilogue.bias(), self.epilogue.aux()]
                    .into_iter()
                    .flatten()
                    .map(alignment)
                    .min()
                    .unwrap_or(256),
            ],
        }
    }

    /// Floating-point operations of the product.
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

impl Blas {
    pub fn new(device: Arc<CudaDevice>) -> Result<Blas, CudaError> {
        super::probe::require_cublaslt()?;
        device.bind()?;
        let handle = lt::create_handle().map_err(|e| CudaError::blas("creating a handle", e))?;
        let workspace = device.alloc(WORKSPACE_BYTES, "the cuBLASLt workspace")?;
        Ok(Blas {
            device,
            handle,
            workspace,
            plans: HashMap::new(),
            refused: Default::default(),
        })
    }

    /// What the workspace occupies in the allocator's counts.
    pub fn workspace_held_bytes(&self) -> usize {
        self.workspace.held_bytes()
    }

    fn plan(&mut self, g: &Gemm) -> Result<&Plan, CudaError> {
        let key = g.key();
        if !self.plans.contains_key(&key) {
            // Planning times candidate algorithms on the stream: not inside a graph.
            if self.device.recording_active() {
                let device = self.device.clone();
                device.not_in_a_graph_holding("plans a product of a new shape", self)?;
            }
            let plan = self
                .make_plan(g, &key)?
                .map_err(|detail| refused(g, detail))?;
            self.tune_and_keep(g, key, plan)?
                .map_err(|detail| refused(g, detail))?;
        }
        Ok(&self.plans[&key])
    }

    /// Keeps `plan` for `key`, its fastest algorithm first; `Err` (why, nothing kept) when
    /// none of its algorithms launches.
    fn tune_and_keep(
        &mut self,
        g: &Gemm,
        key: PlanKey,
        mut plan: Plan,
    ) -> Result<Result<(), String>, CudaError> {
        if autotune_enabled() && plan.algos.len() > 1 {
            if let Err(why) = self.autotune(g, &key, &mut plan, true)? {
                return Ok(Err(why));
            }
        }
        self.plans.insert(key, plan);
        Ok(Ok(()))
    }

    /// Puts the fastest of the heuristic's algorithms first: cuBLASLt's first guess was
    /// measured up to 25% slower than its best on a GPT-2 shape (the lm head's weight
    /// gradient on an H100). The choice is remembered on disk per device and shape, so every
    /// later run uses the same algorithm and gives the same bits.
    ///
    /// With `cached` false the choice is made afresh on `g`'s own operands and not
    /// remembered ([`Blas::retune`]).
    ///
    /// Algorithms that fail to launch (cuBLASLt's heuristic can offer one that then refuses)
    /// are dropped; `Err` says why when none launches, and nothing is remembered.
    fn autotune(
        &self,
        g: &Gemm,
        key: &PlanKey,
        plan: &mut Plan,
        cached: bool,
    ) -> Result<Result<(), String>, CudaError> {
        let id = algo_id(self.device.name(), key);
        let remembered = if cached {
            remembered_algos()
                .lock()
                .expect("algorithm cache")
                .get(&id)
                .cloned()
        } else {
            None
        };
        if let Some(data) = remembered {
            if let Some(i) = plan.algos.iter().position(|a| a.algo.data == data) {
                plan.algos.swap(0, i);
                return Ok(Ok(()));
            }
        }
        let scratch = if g.accumulate {
            let bytes = g.ldd * g.n * g.output.size_bytes();
            Some(self.device.alloc_zeroed(bytes, "autotuning scratch")?)
        } else {
            None
        };
        let trial = trial_product(g, scratch.as_ref().map(|s| s.ptr()));
        // Rounds that visit every candidate in turn, each visit 3 runs queued back to back
        // between two events (the host's launch time is not counted); a candidate's time is
        // its fastest visit. Interleaving matters: the first products of a process run while
        // the GPU's clocks still climb, and timing one candidate after another (7 runs each)
        // chose the lm head's input gradient 14% off the best on an H100. Noise only ever
        // adds time, hence the minimum.
        const ROUNDS: usize = 5;
        const RUNS: usize = 3;
        let candidates: Vec<usize> = (0..plan.algos.len())
            .filter(|&i| {
                let run = || self.launch(&trial, plan, i);
                run().is_ok() && run().is_ok()
            })
            .collect();
        if candidates.is_empty() {
            return Ok(Err(format!(
                "none of the {} algorithms cuBLASLt's heuristic offered launches",
                plan.algos.len()
            )));
        }
        let mut fastest = vec![f32::INFINITY; plan.algos.len()];
        for _ in 0..ROUNDS {
            for &i in &candidates {
                let start = self.device.record_event()?;
                for _ in 0..RUNS {
                    self.launch(&trial, plan, i)?;
                }
                let ms = start.ms_until(&self.device.record_event()?)? / RUNS as f32;
                fastest[i] = fastest[i].min(ms);
            }
        }
        // The heuristic's first choice stays unless another is at least 1% faster: a tie
        // within the noise should not move a shape's algorithm (and its bits) between
        // machines' caches.
        let first = candidates[0];
        let mut best = (fastest[first], first);
        for &i in &candidates {
            if fastest[i] < best.0 * 0.99 {
                best = (fastest[i], i);
            }
        }
        // The fastest first, then the other algorithms that launch, in the heuristic's order.
        let mut kept = vec![plan.algos[best.1]];
        kept.extend(
            candidates
                .iter()
                .filter(|&&i| i != best.1)
                .map(|&i| plan.algos[i]),
        );
        plan.algos = kept;
        if cached {
            remember_algo(id, plan.algos[0].algo.data);
        }
        Ok(Ok(()))
    }

    /// Chooses `g`'s algorithm again, timed on `g`'s own operands, for this process only
    /// (the remembered choice stays). The fastest algorithm depends on the values: a
    /// product timed on a step's logit gradients (mostly near zero) and on random normal
    /// values can prefer different ones, 10% apart on the lm head's input gradient on an
    /// H100. The benchmark that compares the choice with cuBLASLt's best on random
    /// operands tunes on those.
    pub fn retune(&mut self, g: &Gemm) -> Result<(), CudaError> {
        let key = g.key();
        let mut plan = self
            .make_plan(g, &key)?
            .map_err(|detail| refused(g, detail))?;
        if plan.algos.len() > 1 {
            self.autotune(g, &key, &mut plan, false)?
                .map_err(|detail| refused(g, detail))?;
        }
        self.plans.insert(key, plan);
        Ok(())
    }

    /// The descriptors of `g` and the heuristic's algorithms for it; `Err` (the heuristic's
    /// status, or that it offered none) when it refuses the description.
    fn make_plan(&self, g: &Gemm, key: &PlanKey) -> Result<Result<Plan, String>, CudaError> {
        let what = || {
            format!(
                "a {}x{}x{} product ({} in, {} out)",
                g.m, g.n, g.k, g.input, g.output
            )
        };
        let compute = match (g.input, g.math) {
            (DType::F32, F32Math::Tf32) => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            _ => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        let err = |e| CudaError::blas(what(), e);
        let desc = lt::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F).map_err(err)?;
        let set_desc = |attr: sys::cublasLtMatmulDescAttributes_t, value: &[u8]| {
            // SAFETY: `desc` is live; the value has the attribute's size.
            unsafe {
                lt::set_matmul_desc_attribute(desc, attr, value.as_ptr() as *const _, value.len())
            }
            .map_err(err)
        };
        use sys::cublasLtMatmulDescAttributes_t as A;
        set_desc(
            A::CUBLASLT_MATMUL_DESC_TRANSA,
            &(g.transa as i32).to_ne_bytes(),
        )?;
        set_desc(
            A::CUBLASLT_MATMUL_DESC_TRANSB,
            &(g.transb as i32).to_ne_bytes(),
        )?;
        if g.epilogue != Epilogue::None {
            let epilogue = g.epilogue.cublas() as u32;
            set_desc(A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue.to_ne_bytes())?;
        }
        if g.epilogue.aux().is_some() {
            // The pre-activation as D is laid out (its type is D's, cuBLASLt's default).
            set_desc(
                A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                &(g.ldd as i64).to_ne_bytes(),
            )?;
        }
        // The heuristic reads the epilogue's pointers for their alignment (each launch sets
        // its own again).
        for (attr, ptr) in [
            (A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.epilogue.bias()),
            (
                A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                g.epilogue.aux(),
            ),
        ] {
            if let Some(ptr) = ptr {
                set_desc(attr, &ptr.to_ne_bytes())?;
            }
        }
        let (a_rows, a_cols) = if g.transa { (g.k, g.m) } else { (g.m, g.k) };
        let (b_rows, b_cols) = if g.transb { (g.n, g.k) } else { (g.k, g.n) };
        let layout = |t: DType, rows: usize, cols: usize, ld: usize| {
            lt::create_matrix_layout(data_type(t), rows as u64, cols as u64, ld as i64).map_err(err)
        };
        let layout_of = |t: sys::cudaDataType, rows: usize, cols: usize, ld: usize| {
            lt::create_matrix_layout(t, rows as u64, cols as u64, ld as i64).map_err(err)
        };
        let (a_type, b_type) = match g.fp8 {
            Some(f) => (fp8_data_type(f.a), fp8_data_type(f.b)),
            None => (data_type(g.input), data_type(g.input)),
        };
        let layouts = [
            layout_of(a_type, a_rows, a_cols, g.lda)?,
            layout_of(b_type, b_rows, b_cols, g.ldb)?,
            layout(g.output, g.m, g.n, g.ldd)?,
        ];
        let pref = lt::create_matmul_pref().map_err(err)?;
        let set_pref = |attr: sys::cublasLtMatmulPreferenceAttributes_t, value: &[u8]| {
            // SAFETY: `pref` is live; the value has the attribute's size.
            unsafe {
                lt::set_matmul_pref_attribute(pref, attr, value.as_ptr() as *const _, value.len())
            }
            .map_err(err)
        };
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        set_pref(
            P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &(WORKSPACE_BYTES as u64).to_ne_bytes(),
        )?;
        for (attr, align) in [
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align[0]),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align[1]),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align[2]),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align[2]),
        ] {
            set_pref(attr, &align.to_ne_bytes())?;
        }
        let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> =
            vec![unsafe { std::mem::zeroed() }; ALGOS_ASKED as usize];
        let mut count = 0i32;
        // SAFETY: every descriptor is live; `results` has room for ALGOS_ASKED entries.
        let status = unsafe {
            sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                desc,
                layouts[0],
                layouts[1],
                layouts[2],
                layouts[2],
                pref,
                ALGOS_ASKED,
                results.as_mut_ptr(),
                &mut count,
            )
        };
        // SAFETY: created above.
        unsafe {
            let _ = lt::destroy_matmul_pref(pref);
        }
        results.truncate(count.max(0) as usize);
        results.retain(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS);
        let plan = Plan {
            desc,
            layouts,
            algos: results,
        };
        // A refusal drops the plan's descriptors with it.
        if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Ok(Err(format!("the heuristic answered {status:?}")));
        }
        if plan.algos.is_empty() {
            return Ok(Err(
                "cuBLASLt has no algorithm for this shape, type and alignment".into(),
            ));
        }
        Ok(Ok(plan))
    }

    /// Queues `g` if cuBLASLt has an algorithm for it, and says whether it did. A fused
    /// epilogue ([`Epilogue`]) is not offered for every shape, type and alignment: its
    /// caller then runs the product without it and the pass apart. A description with no
    /// algorithm is remembered, so cuBLASLt is asked about it once per process.
    pub fn try_gemm(&mut self, g: &Gemm) -> Result<bool, CudaError> {
        g.validate()?;
        let key = g.key();
        if self.refused.contains(&key) {
            return Ok(false);
        }
        if !self.plans.contains_key(&key) {
            self.device.bind()?;
            let kept = match self.make_plan(g, &key)? {
                Ok(plan) => self.tune_and_keep(g, key, plan)?,
                Err(why) => Err(why),
            };
            if kept.is_err() {
                self.refused.insert(key);
                return Ok(false);
            }
        }
        match self.gemm(g) {
            // Refused at launch (not every refusal shows in the heuristic's answer): nothing
            // was queued, so the caller's fallback runs in its place.
            Err(CudaError::Blas { detail, .. }) if launch_refused(&detail) => {
                self.plans.remove(&key);
                self.refused.insert(key);
                Ok(false)
            }
            other => other.map(|()| true),
        }
    }

    /// Queues the product with the heuristic's best algorithm.
    pub fn gemm(&mut self, g: &Gemm) -> Result<(), CudaError> {
        self.gemm_with(g, 0)
    }

    /// How many algorithms the heuristic offers for `g`.
    pub fn algorithms(&mut self, g: &Gemm) -> Result<usize, CudaError> {
        g.validate()?;
        Ok(self.plan(g)?.algos.len())
    }

    /// Queues the product with the heuristic's algorithm number `choice` (after autotuning:
    /// 0 is the fastest).
    pub fn gemm_with(&mut self, g: &Gemm, choice: usize) -> Result<(), CudaError> {
        g.validate()?;
        self.device.bind()?;
        let device = self.device.clone();
        if device.recording_active() && device.profiling() {
            device.not_in_a_graph_holding("times its work", self)?;
        }
        let started = device
            .profiling()
            .then(|| device.record_event())
            .transpose()?;
        self.plan(g)?;
        if device.recording_active() {
            let op = super::graph::Op::Product { gemm: *g, choice };
            let name = || format!("a {}x{}x{} product", g.m, g.n, g.k);
            if device.record(op, name, Some(self))? == super::graph::Recorded::Skip {
                return Ok(());
            }
        }
        let plan = &self.plans[&g.key()];
        let queued = self.launch(g, plan, choice);
        device.refused_by_the_capture(queued, Some(self))?;
        if let Some(start) = started {
            let name = format!(
                "gemm {}x{}x{} {}{} {}->{}{}",
                g.m,
                g.n,
                g.k,
                if g.transa { 'T' } else { 'N' },
                if g.transb { 'T' } else { 'N' },
                g.input,
                g.output,
                g.epilogue.label()
            );
            device.profiled(name, start)?;
        }
        Ok(())
    }

    /// Queues `g` with algorithm `choice` of its plan, unrecorded (a step that fell back
    /// from its graph issues its products again, [`super::graph`]).
    pub(super) fn issue(&mut self, g: &Gemm, choice: usize) -> Result<(), CudaError> {
        self.plan(g)?;
        let plan = &self.plans[&g.key()];
        self.launch(g, plan, choice)
    }

    /// Queues `g` with `plan`'s algorithm `choice` on the stream.
    fn launch(&self, g: &Gemm, plan: &Plan, choice: usize) -> Result<(), CudaError> {
        let stream = self.device.cu_stream() as sys::cudaStream_t;
        let algo = plan.algos.get(choice).unwrap_or(&plan.algos[0]);
        let what = || format!("a {}x{}x{} product", g.m, g.n, g.k);
        use sys::cublasLtMatmulDescAttributes_t as A;
        for (attr, ptr) in [
            (A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.epilogue.bias()),
            (
                A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                g.epilogue.aux(),
            ),
        ] {
            let Some(ptr) = ptr else { continue };
            // SAFETY: the descriptor is live; the pointer is a device address.
            unsafe {
                lt::set_matmul_desc_attribute(
                    plan.desc,
                    attr,
                    &ptr as *const u64 as *const _,
                    std::mem::size_of::<u64>(),
                )
            }
            .map_err(|e| CudaError::blas(what(), e))?;
        }
        if let Some(fp8) = g.fp8 {
            for (attr, ptr) in [
                (A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, fp8.a_inv_scale),
                (A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, fp8.b_inv_scale),
            ] {
                // SAFETY: the descriptor is live; the pointer is a device address of an f32.
                unsafe {
                    lt::set_matmul_desc_attribute(
                        plan.desc,
                        attr,
                        &ptr as *const u64 as *const _,
                        std::mem::size_of::<u64>(),
                    )
                }
                .map_err(|e| CudaError::blas(what(), e))?;
            }
        }
        let beta: f32 = if g.accumulate { 1.0 } else { 0.0 };
        // SAFETY: the pointers are device addresses of buffers at least as large as the
        // layouts say (checked by the callers in ops.rs), the workspace is ours, and alpha
        // and beta are host f32 scalars (the default pointer mode).
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                &g.alpha as *const f32 as *const _,
                &beta as *const f32 as *const _,
                g.a as *const _,
                plan.layouts[0],
                g.b as *const _,
                plan.layouts[1],
                g.d as *const _,
                plan.layouts[2],
                g.d as *mut _,
                plan.layouts[2],
                &algo.algo,
                self.workspace.ptr() as *mut _,
                WORKSPACE_BYTES,
                stream,
            )
        }
        .map_err(|e| CudaError::blas(what(), e))
    }
}

fn refused(g: &Gemm, detail: String) -> CudaError {
    CudaError::Blas {
        what: format!(
            "a {}x{}x{} product ({} in, {} out)",
            g.m, g.n, g.k, g.input, g.output
        ),
        detail,
    }
}

/// Whether a launch's error (its status, as [`CudaError::blas`] words it) is a refusal of
/// the description, after which nothing was queued: not supported, an invalid value, or an
/// architecture the algorithm is not for.
fn launch_refused(detail: &str) -> bool {
    [
        "CUBLAS_STATUS_NOT_SUPPORTED",
        "CUBLAS_STATUS_INVALID_VALUE",
        "CUBLAS_STATUS_ARCH_MISMATCH",
    ]
    .iter()
    .any(|status| detail.contains(status))
}

/// The product autotuning times: `g` itself, β included (an accumulating product's best
/// algorithm is not β = 0's: the lm head's weight gradient ran 8% slower with the β = 0
/// choice on an H100), but an accumulating one into `scratch`, a zeroed output of the same
/// size, so nothing is added into the real output. A plain product writes its real output,
/// which the real call overwrites anyway.
fn trial_product(g: &Gemm, scratch: Option<u64>) -> Gemm {
    assert_eq!(
        g.accumulate,
        scratch.is_some(),
        "an accumulating product, and only one, is timed on scratch output"
    );
    Gemm {
        d: scratch.unwrap_or(g.d),
        ..*g
    }
}

/// The line an algorithm choice is remembered under: the device's name and the plan key's
/// debug text, which names every field. A field added to [`PlanKey`] (as `accumulate` was)
/// changes every id, so lines written before, tuned for another key, are never matched
/// again: the shape is re-tuned once and its new line appended.
fn algo_id(device: &str, key: &PlanKey) -> String {
    format!("{device} {key:?}")
}

/// Whether products are autotuned (`MESHTRAIN_GEMM_AUTOTUNE=0` keeps cuBLASLt's first
/// guess).
fn autotune_enabled() -> bool {
    std::env::var("MESHTRAIN_GEMM_AUTOTUNE").map_or(true, |v| v != "0")
}

/// The algorithms chosen so far, per device and shape: loaded from, and written to,
/// `gemm-algorithms.txt` in the kernel cache folder.
fn remembered_algos() -> &'static std::sync::Mutex<HashMap<String, [u64; 8]>> {
    static CACHE: std::sync::OnceLock<std::sync::Mutex<HashMap<String, [u64; 8]>>> =
        std::sync::OnceLock::new();
    CACHE.get_or_init(|| {
        let mut map = HashMap::new();
        if let Some(path) = algos_file() {
            for line in std::fs::read_to_string(path).unwrap_or_default().lines() {
                if let Some((id, data)) = line.rsplit_once('\t') {
                    let words: Vec<u64> = data
                        .split(',')
                        .filter_map(|w| u64::from_str_radix(w, 16).ok())
                        .collect();
                    if let Ok(words) = <[u64; 8]>::try_from(words) {
                        map.insert(id.to_string(), words);
                    }
                }
            }
        }
        std::sync::Mutex::new(map)
    })
}

fn algos_file() -> Option<std::path::PathBuf> {
    super::compile::cache_dir().map(|d| d.join("gemm-algorithms.txt"))
}

fn remember_algo(id: String, data: [u64; 8]) {
    let line = format!(
        "{id}\t{}\n",
        data.iter()
            .map(|w| format!("{w:x}"))
            .collect::<Vec<_>>()
            .join(",")
    );
    remembered_algos()
        .lock()
        .expect("algorithm cache")
        .insert(id, data);
    if let Some(path) = algos_file() {
        use std::io::Write;
        // Appending one whole line is atomic enough for a cache; a torn file only costs a
        // re-tune.
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by make_plan, destroyed once (host objects: no device needed).
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
        }
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        let _ = self.device.bind();
        self.plans.clear();
        // SAFETY: created in `new`.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

/// cuBLAS's column-major `D = α·op(A)·op(B) (+ D)` and its epilogue, on host f32 memory:
/// what a [`Gemm`] description means, evaluated without a GPU (its pointers are host
/// addresses here), for testing the descriptions a layer builds.
#[cfg(test)]
pub(super) fn run_on_host(g: &Gemm) {
    g.validate().expect("a valid description");
    assert_eq!((g.input, g.output), (DType::F32, DType::F32));
    let at = |p: u64, i: usize| unsafe { *(p as *const f32).add(i) };
    // SAFETY (the writes below): the test's buffers hold every addressed element.
    let write = |p: u64, i: usize, v: f32| unsafe { *(p as *mut f32).add(i) = v };
    let op_b = |l: usize, j: usize| {
        if g.transb {
            at(g.b, j + l * g.ldb)
        } else {
            at(g.b, l + j * g.ldb)
        }
    };
    for j in 0..g.n {
        for i in 0..g.m {
            let mut sum = 0.0f64;
            for l in 0..g.k {
                let a = if g.transa {
                    at(g.a, l + i * g.lda)
                } else {
                    at(g.a, i + l * g.lda)
                };
                sum += a as f64 * op_b(l, j) as f64;
            }
            let at_d = i + j * g.ldd;
            let d = g.alpha * sum as f32 + if g.accumulate { at(g.d, at_d) } else { 0.0 };
            let d = match g.epilogue {
                Epilogue::None | Epilogue::BiasGradB(_) => d,
                Epilogue::Bias(bias) => d + at(bias, i),
                Epilogue::GeluAux { bias, aux } => {
                    let z = d + bias.map_or(0.0, |b| at(b, i));
                    write(aux, at_d, z);
                    crate::activation::gelu_tanh(z)
                }
                Epilogue::DGelu { aux } => d * crate::activation::gelu_tanh_grad(at(aux, at_d)),
            };
            write(g.d, at_d, d);
        }
    }
    if let Epilogue::BiasGradB(bias_grad) = g.epilogue {
        for j in 0..g.n {
            write(bias_grad, j, (0..g.k).map(|l| op_b(l, j)).sum());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemm() -> Gemm {
        Gemm {
            m: 64,
            n: 32,
            k: 16,
            transa: true,
            transb: false,
            a: 0x1000,
            lda: 16,
            b: 0x2000,
            ldb: 16,
            input: DType::BF16,
            d: 0x3000,
            ldd: 64,
            output: DType::BF16,
            accumulate: false,
            epilogue: Epilogue::None,
            alpha: 1.0,
            math: F32Math::Exact,
            fp8: None,
        }
    }

    /// FP8 products: only TN, multiples of 16, not E5M2 twice; the formats are in the plan's
    /// key (an E4M3 × E4M3 plan is not an E5M2 × E4M3 one).
    #[test]
    fn fp8_descriptions_are_checked_and_keyed() {
        let fp8 = |a, b| Fp8Operands {
            a,
            b,
            a_inv_scale: 0x4000,
            b_inv_scale: 0x4004,
        };
        let ok = Gemm {
            fp8: Some(fp8(Fp8Format::E4M3, Fp8Format::E4M3)),
            ..gemm()
        };
        assert!(ok.validate().is_ok());
        let fails = |g: Gemm, what: &str| {
            let e = g.validate().unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        };
        fails(
            Gemm {
                transa: false,
                lda: 64,
                ..ok
            },
            "TN",
        );
        fails(
            Gemm {
                transb: true,
                ldb: 32,
                ..ok
            },
            "TN",
        );
        fails(
            Gemm {
                k: 24,
                lda: 24,
                ldb: 24,
                ..ok
            },
            "multiples of 16",
        );
        fails(
            Gemm {
                fp8: Some(fp8(Fp8Format::E5M2, Fp8Format::E5M2)),
                ..ok
            },
            "both in E5M2",
        );
        let gradient = Gemm {
            fp8: Some(fp8(Fp8Format::E5M2, Fp8Format::E4M3)),
            ..ok
        };
        assert!(gradient.validate().is_ok());
        assert_ne!(ok.key(), gradient.key());
        assert_ne!(ok.key(), gemm().key());
    }

    /// The statuses after which a launch queued nothing, as `CudaError::blas` words them,
    /// are refusals (`try_gemm` falls back); any other failure stays an error.
    #[test]
    fn a_refused_launch_is_told_from_a_failed_one() {
        use cudarc::cublaslt::result::CublasError;
        let worded = |status| CudaError::blas("a product", CublasError(status)).to_string();
        use sys::cublasStatus_t as S;
        for status in [
            S::CUBLAS_STATUS_NOT_SUPPORTED,
            S::CUBLAS_STATUS_INVALID_VALUE,
            S::CUBLAS_STATUS_ARCH_MISMATCH,
        ] {
            assert!(launch_refused(&worded(status)), "{status:?}");
        }
        for status in [
            S::CUBLAS_STATUS_EXECUTION_FAILED,
            S::CUBLAS_STATUS_ALLOC_FAILED,
        ] {
            assert!(!launch_refused(&worded(status)), "{status:?}");
        }
    }

    #[test]
    fn descriptions_are_checked_before_cublas_sees_them() {
        assert!(gemm().validate().is_ok());
        let e = Gemm { lda: 8, ..gemm() }.validate().unwrap_err();
        assert!(e.to_string().contains("leading dimension"), "{e}");
        let e = Gemm { ldd: 10, ..gemm() }.validate().unwrap_err();
        assert!(e.to_string().contains("leading dimension"), "{e}");
        let e = Gemm {
            input: DType::F32,
            ..gemm()
        }
        .validate()
        .unwrap_err();
        assert!(
            e.to_string().contains("f32 inputs need an f32 output"),
            "{e}"
        );
        for epilogue in [
            Epilogue::Bias(0x4000),
            Epilogue::GeluAux {
                bias: None,
                aux: 0x5000,
            },
        ] {
            let e = Gemm {
                epilogue,
                accumulate: true,
                ..gemm()
            }
            .validate()
            .unwrap_err();
            assert!(e.to_string().contains("epilogue with accumulation"), "{e}");
        }
        // Each epilogue is its own plan (and autotuned choice), and so is the alignment of
        // its vectors.
        let keys: std::collections::HashSet<PlanKey> = [
            Epilogue::None,
            Epilogue::Bias(0x4000),
            Epilogue::Bias(0x4008),
            Epilogue::GeluAux {
                bias: None,
                aux: 0x5000,
            },
            Epilogue::GeluAux {
                bias: Some(0x4000),
                aux: 0x5000,
            },
            Epilogue::DGelu { aux: 0x5000 },
            Epilogue::BiasGradB(0x4000),
        ]
        .into_iter()
        .map(|epilogue| Gemm { epilogue, ..gemm() }.key())
        .collect();
        assert_eq!(keys.len(), 7);
        let e = Gemm {
            epilogue: Epilogue::DGelu { aux: 0x5000 },
            m: 60,
            ldd: 60,
            ..gemm()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("off 8 values"), "{e}");
        // A bias gradient is written beside D, not into it: a weight gradient accumulates.
        Gemm {
            epilogue: Epilogue::BiasGradB(0x4000),
            accumulate: true,
            output: DType::F32,
            ..gemm()
        }
        .validate()
        .unwrap();
        assert!(Gemm { k: 0, ..gemm() }.validate().is_err());
    }

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x1002), 2);
        assert_eq!(alignment(0x1010), 16);
        assert_eq!(alignment(0x1080), 128);
        // Plans differ by alignment (an algorithm for 16-byte pointers may not take 2).
        let a = gemm().key();
        let b = Gemm {
            a: 0x1002,
            ..gemm()
        }
        .key();
        assert_ne!(a, b);
    }

    /// β = 1 and β = 0 are tuned and remembered apart: the same shape's lines differ.
    #[test]
    fn accumulating_products_have_their_own_plan_and_remembered_algorithm() {
        let plain = gemm().key();
        let acc = Gemm {
            accumulate: true,
            output: DType::F32,
            ..gemm()
        }
        .key();
        let plain_f32 = Gemm {
            output: DType::F32,
            ..gemm()
        }
        .key();
        assert_ne!(acc, plain_f32);
        assert_ne!(plain, plain_f32);
        let (a, b) = (
            algo_id("NVIDIA H100 80GB HBM3", &acc),
            algo_id("NVIDIA H100 80GB HBM3", &plain_f32),
        );
        assert_ne!(a, b);
        assert!(a.starts_with("NVIDIA H100 80GB HBM3 PlanKey {"), "{a}");
        assert!(
            a.contains("accumulate: true") && b.contains("accumulate: false"),
            "{a} / {b}"
        );
        // One line per id in the file: the id holds no tab or newline.
        assert!(!a.contains(['\t', '\n']));
    }

    /// The autotuner times the real product, β included; an accumulating one on scratch.
    #[test]
    fn autotuning_times_the_real_beta_on_scratch_output() {
        let acc = Gemm {
            accumulate: true,
            output: DType::F32,
            ..gemm()
        };
        let t = trial_product(&acc, Some(0x9000));
        assert!(t.accumulate, "timed with beta = 1");
        assert_eq!(t.d, 0x9000);
        assert_eq!(
            (t.m, t.n, t.k, t.a, t.b, t.lda, t.ldb, t.ldd, t.output),
            (acc.m, acc.n, acc.k, acc.a, acc.b, acc.lda, acc.ldb, acc.ldd, acc.output)
        );
        // Only the output pointer differs (the trial runs the real product's plan; the
        // scratch, like every allocation, is 256-byte aligned, which any algorithm takes).
        assert_eq!(
            Gemm { d: 0x3000, ..t }.key(),
            acc.key(),
            "the trial has the real product's plan"
        );
        let plain = trial_product(&gemm(), None);
        assert!(!plain.accumulate);
        assert_eq!(plain.d, gemm().d);
    }

    #[test]
    #[should_panic(expected = "scratch output")]
    fn an_accumulating_trial_needs_scratch() {
        trial_product(
            &Gemm {
                accumulate: true,
                ..gemm()
            },
            None,
        );
    }
}
