//! meshtrain-tensor: the small, fast f32 tensor core under meshtrain.
//!
//! Why our own core and not candle/burn: a distributed trainer needs control of memory and
//! timing (flat parameter buffers, gradient-ready hooks, backward from a received gradient),
//! and the measured CPU backward of those libraries is several times slower than PyTorch's.
//! This crate is scoped to the kernels meshtrain's models need, written as plain functions
//! over slices (in the spirit of llm.c), with matrix products behind one function
//! ([`matmul::gemm`]) backed by the `gemm` crate (or OpenBLAS behind the `openblas` feature).
//!
//! With the `cuda` feature (on by default) tensors may also live on a GPU ([`cuda`]), loaded
//! at run time: a [`Tensor`]'s kernels are chosen by its [`Device`].
//!
//! Layout conventions:
//! * tensors are contiguous and row-major; [`Tensor`] is an owned buffer plus a shape;
//! * convolutional activations use the **CNHW** layout (channel-major batch): a convolution
//!   then becomes one matrix product `W[O, C·kh·kw] × cols[C·kh·kw, N·H·W]` whose result *is*
//!   the next CNHW activation, with no transposes, and every channel's batch statistics are
//!   contiguous for batch norm.
//! * Intra-op parallelism comes from the caller's rayon pool (`pool.install(..)`): kernels ask
//!   [`par::threads`] how many threads they may use and take serial paths when it is one.

pub mod activation;
pub mod attention;
pub mod conv;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod dtype;
pub mod flash;
pub mod fp8;
pub mod loss;
pub mod lowp;
pub mod matmul;
pub mod norm;
pub mod par;
pub mod pool;
pub mod rng;
pub mod rotary;
pub mod small_gemm;
pub mod tensor;

pub use device::Device;
pub use dtype::DType;
pub use tensor::Tensor;
