//! Are the CUDA libraries there? Asked before any work, so `--device cuda` on a machine
//! without a driver, a GPU or NVRTC says which library is missing and what to install,
//! instead of failing deep inside the first kernel launch.
//!
//! cudarc loads each library on first use and panics when it is missing; these checks
//! load them in advance (inside `catch_unwind`: cudarc's loaders may panic too).

use super::error::CudaError;

/// Whether the library behind one of cudarc's `is_culib_present` checks loads (the driver's,
/// NVRTC's, cuBLAS's, NCCL's): never panics.
pub fn present(check: unsafe fn() -> bool) -> bool {
    // SAFETY: the checks only try to dlopen the library by its candidate names.
    std::panic::catch_unwind(|| unsafe { check() }).unwrap_or(false)
}

/// The NVIDIA driver's `libcuda.so.1`.
pub fn require_driver() -> Result<(), CudaError> {
    if present(cudarc::driver::sys::is_culib_present) {
        return Ok(());
    }
    Err(CudaError::MissingLibrary {
        library: "the NVIDIA driver",
        file: "libcuda.so.1",
        hint: "install the NVIDIA driver for your GPU (nvidia-smi must list it) or make its \
               folder visible on LD_LIBRARY_PATH; without a GPU, train with --device cpu",
    })
}

/// NVRTC, the run-time compiler of the kernels.
pub fn require_nvrtc() -> Result<(), CudaError> {
    if present(cudarc::nvrtc::sys::is_culib_present) {
        return Ok(());
    }
    Err(CudaError::MissingLibrary {
        library: "NVRTC, the CUDA run-time compiler",
        file: "libnvrtc.so.13",
        hint: "install the CUDA 13 toolkit's NVRTC (package cuda-nvrtc-13-0, or `pip install \
               nvidia-cuda-nvrtc`) and put the folder holding libnvrtc.so.13 on \
               LD_LIBRARY_PATH",
    })
}

/// cuBLASLt, the matrix products.
pub fn require_cublaslt() -> Result<(), CudaError> {
    if present(cudarc::cublaslt::sys::is_culib_present) {
        return Ok(());
    }
    Err(CudaError::MissingLibrary {
        library: "cuBLASLt, CUDA's matrix-product library",
        file: "libcublasLt.so.13",
        hint: "install CUDA 13's cuBLAS (package libcublas-13-0, or `pip install \
               nvidia-cublas`) and put the folder holding libcublasLt.so.13 on \
               LD_LIBRARY_PATH",
    })
}

/// Everything a training run on a GPU needs, checked in the order a user fixes them.
pub fn require_all() -> Result<(), CudaError> {
    require_driver()?;
    require_nvrtc()?;
    require_cublaslt()?;
    super::compile::include_dirs().map(|_| ())
}

/// How many GPUs the driver sees (the driver's library required; no context is created, so
/// asking holds no GPU memory).
pub fn device_count() -> Result<usize, CudaError> {
    require_driver()?;
    std::panic::catch_unwind(|| {
        cudarc::driver::result::init()
            .and_then(|_| cudarc::driver::result::device::get_count())
            .map(|n| n.max(0) as usize)
    })
    .map_err(|_| CudaError::driver("initialising", "the driver library panicked"))?
    .map_err(|e| CudaError::driver("initialising the driver", e))
}

/// Everything GPU `ordinal` needs before it is opened, in the order a user fixes them: the
/// libraries ([`require_all`]), then the GPU itself. Creates no context: a launcher asks this
/// for the GPUs its workers will open, and holds none of their memory.
pub fn require_gpu(ordinal: usize) -> Result<(), CudaError> {
    require_all()?;
    let count = device_count()?;
    if ordinal >= count {
        return Err(CudaError::NoDevice { ordinal, count });
    }
    Ok(())
}

/// Whether this process can use a GPU at all (driver present and at least one device):
/// tests skip GPU checks when it cannot.
pub fn gpu_available() -> bool {
    device_count().is_ok_and(|n| n > 0)
}
