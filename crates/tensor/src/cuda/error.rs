//! What can go wrong on a CUDA device, said so a user can act on it.

use super::alloc::OutOfMemory;

#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    /// A CUDA library the run needs is not installed or not on the loader's path.
    #[error("--device cuda needs {library} ({file}), which could not be loaded: {hint}")]
    MissingLibrary {
        library: &'static str,
        file: &'static str,
        hint: &'static str,
    },
    #[error("no CUDA GPU number {ordinal}: the driver sees {count} GPU(s){}", if *count > 0 { format!(" (use cuda:0 … cuda:{})", count - 1) } else { String::new() })]
    NoDevice { ordinal: usize, count: usize },
    #[error("CUDA driver: {what}: {detail}")]
    Driver { what: String, detail: String },
    #[error("cuBLASLt: {what}: {detail}")]
    Blas { what: String, detail: String },
    /// NVRTC refused a kernel file; the log says where.
    #[error("compiling the CUDA kernels of {file} for sm_{arch} failed (NVRTC {version}):\n{log}")]
    Compile {
        file: String,
        arch: String,
        version: String,
        log: String,
    },
    #[error("{oom}{}", suggestion(.oom))]
    OutOfMemory { oom: OutOfMemory },
    /// A shape, dtype or layout the device kernels do not handle.
    #[error("{0}")]
    Unsupported(String),
}

fn suggestion(oom: &OutOfMemory) -> String {
    match oom.limit {
        Some(_) => "; raise train.memory_limit_mb or lower the batch".into(),
        None => String::new(),
    }
}

impl CudaError {
    pub fn driver(what: impl Into<String>, e: impl std::fmt::Debug) -> Self {
        CudaError::Driver {
            what: what.into(),
            detail: format!("{e:?}"),
        }
    }

    pub fn blas(what: impl Into<String>, e: impl std::fmt::Debug) -> Self {
        CudaError::Blas {
            what: what.into(),
            detail: format!("{e:?}"),
        }
    }
}

/// Device work inside a layer's forward or backward cannot return an error through the
/// layer contract (it returns tensors); it raises this as a panic payload instead, and the
/// device step catches it at its boundary ([`catch`]) and returns it as an error. The panic
/// hook installed by [`quiet_device_panics`] keeps it from printing a backtrace.
#[derive(Debug, Clone)]
pub struct DevicePanic(pub CudaError);

/// Raises `e` for the step boundary to catch (see [`DevicePanic`]).
pub fn raise(e: CudaError) -> ! {
    quiet_device_panics();
    std::panic::panic_any(DevicePanic(e))
}

/// `r`'s value, or a raised error.
pub fn ok_or_raise<T>(r: Result<T, CudaError>) -> T {
    r.unwrap_or_else(|e| raise(e))
}

/// Runs `f`, turning a raised [`DevicePanic`] into an error (other panics continue).
pub fn catch<T>(f: impl FnOnce() -> T) -> Result<T, CudaError> {
    quiet_device_panics();
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(v) => Ok(v),
        Err(payload) => match payload.downcast::<DevicePanic>() {
            Ok(p) => Err(p.0),
            Err(other) => std::panic::resume_unwind(other),
        },
    }
}

/// Installs (once) a panic hook that stays silent for [`DevicePanic`] payloads and defers to
/// the previous hook for everything else.
pub fn quiet_device_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<DevicePanic>().is_none() {
                previous(info);
            }
        }));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raised_errors_come_back_as_values() {
        let r: Result<i32, CudaError> =
            catch(|| -> i32 { raise(CudaError::Unsupported("head dim 48".into())) });
        assert_eq!(r.unwrap_err().to_string(), "head dim 48");
        assert_eq!(catch(|| 7).unwrap(), 7);
    }

    #[test]
    fn other_panics_pass_through() {
        let r = std::panic::catch_unwind(|| catch(|| panic!("a bug")));
        assert!(r.is_err());
    }

    #[test]
    fn messages_name_the_cause() {
        let e = CudaError::NoDevice {
            ordinal: 2,
            count: 1,
        };
        assert_eq!(
            e.to_string(),
            "no CUDA GPU number 2: the driver sees 1 GPU(s) (use cuda:0 … cuda:0)"
        );
        let e = CudaError::NoDevice {
            ordinal: 0,
            count: 0,
        };
        assert_eq!(
            e.to_string(),
            "no CUDA GPU number 0: the driver sees 0 GPU(s)"
        );
    }
}
