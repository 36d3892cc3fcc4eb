//! Kernel sources and their compilation by NVRTC, once per process and architecture, with an
//! on-disk cache of the machine code.
//!
//! Why NVRTC at run time and not `nvcc` at build time: building meshtrain then needs no CUDA
//! toolkit, and the code is compiled for exactly the GPU it runs on (`sm_90` on an H100).
//! Each kernel file is compiled as `prelude.cuh` + `common.cuh` + the file (see
//! `kernels/ABI.md`), so the same text compiles as host C++ against the CPU emulator the
//! tests use.

use super::error::CudaError;
use super::probe;
use cudarc::nvrtc::sys;
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

/// One compilation unit: a kernel file of `kernels/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelFile {
    pub name: &'static str,
    pub source: &'static str,
}

const PRELUDE: &str = include_str!("kernels/prelude.cuh");
const COMMON: &str = include_str!("kernels/common.cuh");

/// Every kernel file, in the order of `kernels/ABI.md`.
pub const KERNEL_FILES: &[KernelFile] = &[
    KernelFile {
        name: "elementwise.cu",
        source: include_str!("kernels/elementwise.cu"),
    },
    KernelFile {
        name: "bias.cu",
        source: include_str!("kernels/bias.cu"),
    },
    KernelFile {
        name: "layernorm.cu",
        source: include_str!("kernels/layernorm.cu"),
    },
    KernelFile {
        name: "embedding.cu",
        source: include_str!("kernels/embedding.cu"),
    },
    KernelFile {
        name: "cross_entropy.cu",
        source: include_str!("kernels/cross_entropy.cu"),
    },
    KernelFile {
        name: "optimizer.cu",
        source: include_str!("kernels/optimizer.cu"),
    },
    KernelFile {
        name: "attention.cu",
        source: include_str!("kernels/attention.cu"),
    },
    KernelFile {
        name: "llama.cu",
        source: include_str!("kernels/llama.cu"),
    },
    KernelFile {
        name: "decode.cu",
        source: include_str!("kernels/decode.cu"),
    },
    KernelFile {
        name: "conv.cu",
        source: include_str!("kernels/conv.cu"),
    },
    KernelFile {
        name: "fp8.cu",
        source: include_str!("kernels/fp8.cu"),
    },
];

/// The kernel file called `name`.
pub fn kernel_file(name: &str) -> Option<KernelFile> {
    KERNEL_FILES.iter().copied().find(|f| f.name == name)
}

/// The whole text NVRTC compiles for `file`.
pub fn full_source(file: KernelFile) -> String {
    format!(
        "{PRELUDE}\n// ---- common.cuh\n{COMMON}\n// ---- {}\n{}",
        file.name, file.source
    )
}

/// NVRTC's version, "13.0".
pub fn nvrtc_version() -> Result<String, CudaError> {
    probe::require_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters.
    let status = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    check(status, "nvrtcVersion")?;
    Ok(format!("{major}.{minor}"))
}

fn check(status: sys::nvrtcResult, what: &str) -> Result<(), CudaError> {
    if status == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::driver(format!("NVRTC {what}"), status))
    }
}

/// Folders holding `cuda_bf16.h` (and its `cccl` companion, which CUDA 13 needs for
/// `nv/target`): `CUDA_INCLUDE_DIRS` (colon-separated), `$CUDA_HOME/include`,
/// `/usr/local/cuda/include`, and the include folder beside any `libnvrtc` on
/// `LD_LIBRARY_PATH` (the layout of pip's `nvidia-cuda-*` wheels).
pub fn include_dirs() -> Result<Vec<PathBuf>, CudaError> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(dirs) = std::env::var("CUDA_INCLUDE_DIRS") {
        candidates.extend(dirs.split(':').filter(|d| !d.is_empty()).map(PathBuf::from));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(home) = std::env::var(var) {
            candidates.push(Path::new(&home).join("include"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    if let Ok(paths) = std::env::var("LD_LIBRARY_PATH") {
        for dir in paths.split(':').filter(|d| !d.is_empty()) {
            let dir = Path::new(dir);
            if let Some(parent) = dir.parent() {
                candidates.push(parent.join("include"));
            }
        }
    }
    let Some(base) = candidates
        .iter()
        .find(|d| d.join("cuda_bf16.h").is_file())
        .cloned()
    else {
        return Err(CudaError::MissingLibrary {
            library: "the CUDA headers NVRTC compiles against",
            file: "cuda_bf16.h",
            hint: "install the CUDA toolkit's headers (/usr/local/cuda/include) or pip's \
                   nvidia-cuda-runtime and nvidia-cuda-cccl wheels, and point \
                   CUDA_INCLUDE_DIRS at the folder that holds cuda_bf16.h (and its cccl/ \
                   subfolder)",
        });
    };
    let mut dirs = vec![base.clone()];
    let cccl = base.join("cccl");
    if cccl.is_dir() {
        dirs.push(cccl);
    }
    // CUDA_INCLUDE_DIRS may name the cccl folder itself, or a separate one.
    for extra in candidates {
        if extra != base && extra.join("nv").join("target").is_file() && !dirs.contains(&extra) {
            dirs.push(extra);
        }
    }
    Ok(dirs)
}

/// The NVRTC options for `arch` ("90" for sm_90).
pub fn options(arch: &str, includes: &[PathBuf]) -> Vec<String> {
    let mut options = vec![
        format!("--gpu-architecture=sm_{arch}"),
        "-std=c++17".to_string(),
    ];
    options.extend(
        includes
            .iter()
            .map(|d| format!("--include-path={}", d.display())),
    );
    options
}

/// Machine code (CUBIN) for `file` on `arch`, from the disk cache when this source, these
/// options and this NVRTC compiled it before.
pub fn compile_cached(file: KernelFile, arch: &str) -> Result<Vec<u8>, CudaError> {
    let version = nvrtc_version()?;
    let includes = include_dirs()?;
    let source = full_source(file);
    let opts = options(arch, &includes);
    let key = cache_key(&source, &opts, &version);
    let cached = cache_dir().map(|d| d.join(format!("{}-sm{arch}-{key:016x}.cubin", file.name)));
    if let Some(path) = &cached {
        if let Ok(bytes) = std::fs::read(path) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
    }
    let cubin = compile_source(file.name, &source, arch, &opts, &version)?;
    if let Some(path) = cached {
        // A cache that cannot be written only costs the next process a compilation.
        let _ = write_atomically(&path, &cubin);
    }
    Ok(cubin)
}

/// Compiles `source` (named `name` in messages) to a CUBIN for `arch`.
pub fn compile_source(
    name: &str,
    source: &str,
    arch: &str,
    options: &[String],
    version: &str,
) -> Result<Vec<u8>, CudaError> {
    probe::require_nvrtc()?;
    let c_source = CString::new(source).expect("kernel sources hold no NUL");
    let c_name = CString::new(name).expect("kernel file names hold no NUL");
    let c_options: Vec<CString> = options
        .iter()
        .map(|o| CString::new(o.as_str()).expect("options hold no NUL"))
        .collect();
    let option_ptrs: Vec<*const std::ffi::c_char> = c_options.iter().map(|o| o.as_ptr()).collect();
    let mut program: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings; no headers passed by name.
    let status = unsafe {
        sys::nvrtcCreateProgram(
            &mut program,
            c_source.as_ptr(),
            c_name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    check(status, "create program")?;
    let result = (|| {
        // SAFETY: `program` is live; the option pointers outlive the call.
        let status = unsafe {
            sys::nvrtcCompileProgram(program, option_ptrs.len() as i32, option_ptrs.as_ptr())
        };
        let log = program_log(program);
        if status != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(CudaError::Compile {
                file: name.to_string(),
                arch: arch.to_string(),
                version: version.to_string(),
                log: if log.trim().is_empty() {
                    format!("{status:?}")
                } else {
                    log
                },
            });
        }
        let mut size = 0usize;
        // SAFETY: `program` compiled for a real architecture, so it has a CUBIN.
        check(
            unsafe { sys::nvrtcGetCUBINSize(program, &mut size) },
            "CUBIN size",
        )?;
        let mut cubin = vec![0u8; size];
        check(
            unsafe { sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr() as *mut _) },
            "CUBIN",
        )?;
        Ok(cubin)
    })();
    // SAFETY: created above, destroyed once.
    unsafe { sys::nvrtcDestroyProgram(&mut program) };
    result
}

fn program_log(program: sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: `program` is live.
    if unsafe { sys::nvrtcGetProgramLogSize(program, &mut size) } != sys::nvrtcResult::NVRTC_SUCCESS
        || size <= 1
    {
        return String::new();
    }
    let mut log = vec![0u8; size];
    // SAFETY: the buffer holds `size` bytes, NUL included.
    unsafe { sys::nvrtcGetProgramLog(program, log.as_mut_ptr() as *mut _) };
    CStr::from_bytes_until_nul(&log)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// FNV-1a over everything that decides the machine code.
fn cache_key(source: &str, options: &[String], version: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    };
    eat(source.as_bytes());
    for o in options {
        eat(o.as_bytes());
    }
    eat(version.as_bytes());
    h
}

/// `MESHTRAIN_KERNEL_CACHE`, else `$XDG_CACHE_HOME/meshtrain/kernels`, else
/// `~/.cache/meshtrain/kernels`; `MESHTRAIN_KERNEL_CACHE=off` disables it.
pub fn cache_dir() -> Option<PathBuf> {
    let dir = match std::env::var("MESHTRAIN_KERNEL_CACHE") {
        Ok(v) if v == "off" || v.is_empty() => return None,
        Ok(v) => PathBuf::from(v),
        Err(_) => {
            let base = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))?;
            base.join("meshtrain").join("kernels")
        }
    };
    std::fs::create_dir_all(&dir).ok()?;
    Some(dir)
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Every kernel each file must export (`kernels/ABI.md`): what the Rust side launches.
pub fn expected_kernels(file: &str) -> Vec<String> {
    let types = ["f32", "bf16", "f16"];
    let each =
        |base: &str| -> Vec<String> { types.iter().map(|t| format!("{base}_{t}")).collect() };
    match file {
        "elementwise.cu" => {
            let mut v: Vec<String> = [
                "convert_f32_bf16",
                "convert_f32_f16",
                "convert_bf16_f32",
                "convert_f16_f32",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            v.extend(each("add_f32"));
            v.extend(each("act_fwd"));
            v.extend(each("act_bwd"));
            v.extend(
                [
                    "scale_f32",
                    "tie_sum_f32",
                    "unscale_check_f32",
                    "copy_runs_f32",
                    "copy_runs_u16",
                ]
                .map(String::from),
            );
            v
        }
        "bias.cu" => {
            let mut v = each("colsum_partial");
            v.extend(each("colsum_partial_vec"));
            v.extend(each("act_bwd_colsum"));
            v.extend(each("bias_add"));
            v.push("colsum_finish".into());
            v
        }
        "layernorm.cu" => [
            each("layernorm_fwd"),
            each("layernorm_fwd_add"),
            each("layernorm_bwd_dx"),
            each("layernorm_bwd_params"),
            each("layernorm_bwd_fused"),
        ]
        .concat(),
        "embedding.cu" => [
            "embedding_fwd",
            "embedding_bwd_tokens",
            "embedding_bwd_positions",
        ]
        .map(String::from)
        .to_vec(),
        "cross_entropy.cu" => {
            let mut v = each("softmax_xent");
            v.push("xent_sum".into());
            for part in ["max", "sums", "finish"] {
                v.extend(each(&format!("vp_xent_{part}")));
            }
            v
        }
        "optimizer.cu" => [
            "adamw_none",
            "adamw_bf16",
            "adamw_f16",
            "sgd_none",
            "sgd_bf16",
            "sgd_f16",
            "sumsq_partial",
            "norm_finish",
        ]
        .map(String::from)
        .to_vec(),
        "attention.cu" => {
            let mut v = Vec::new();
            for part in ["fwd", "dkdv", "dq", "ring_fwd", "ring_dkdv", "ring_dq"] {
                for t in types {
                    for hd in [32, 64, 128] {
                        v.push(format!("attn_{part}_{t}_hd{hd}"));
                    }
                }
            }
            // Hopper's warpgroup kernels (a trap below sm_90a), 16-bit heads of 64 and 128.
            for part in ["fwd", "dkdv", "dq"] {
                for t in ["bf16", "f16"] {
                    for hd in [64, 128] {
                        v.push(format!("attn_{part}_wg_{t}_hd{hd}"));
                    }
                }
            }
            v.extend(each("attn_bwd_prep"));
            v.extend(each("attn_ring_kv"));
            v.extend(each("attn_ring_join"));
            v.push("attn_ring_start".into());
            v
        }
        "llama.cu" => [
            each("rmsnorm_fwd"),
            each("rmsnorm_fwd_add"),
            each("rmsnorm_bwd_dx"),
            each("rmsnorm_bwd_params"),
            each("rmsnorm_bwd_fused"),
            each("rotary_fwd"),
            each("rotary_bwd"),
            each("swiglu_fwd"),
            each("swiglu_bwd"),
            vec!["qk_heads_f32".into()],
        ]
        .concat(),
        "fp8.cu" => [
            each("fp8_amax"),
            each("fp8_cast"),
            each("fp8_cast_transpose"),
            each("fp8_cast_both"),
        ]
        .concat()
        .into_iter()
        .filter(|name| !name.ends_with("_f16"))
        .collect(),
        "decode.cu" => ["decode_append_kv_f32", "decode_attn_f32"]
            .map(String::from)
            .to_vec(),
        "conv.cu" => {
            let mut v: Vec<String> = [
                "im2col",
                "col2im",
                "channel_bias_add",
                "channel_partials",
                "bn_apply",
                "bn_input_grad",
                "maxpool_fwd",
                "maxpool_bwd",
                "avgpool_fwd",
                "avgpool_bwd",
                "swap_axes",
                "global_avg_fwd",
                "global_avg_bwd",
            ]
            .iter()
            .flat_map(|base| each(base))
            .collect();
            v.extend(["channel_finish", "bn_moments", "bn_param_grads"].map(String::from));
            v
        }
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel file compiles with NVRTC for the A100's and the H100's architectures (plain
    /// sm_90, and sm_90a with its warpgroup products, which is what an H100 gets) and exports
    /// the kernels the Rust side launches. Runs wherever NVRTC and the CUDA headers
    /// are found (CI installs them from pip: no GPU needed); skipped with the reason
    /// otherwise, and required with `MESHTRAIN_REQUIRE_NVRTC=1`.
    #[test]
    fn every_kernel_compiles_for_sm80_and_sm90() {
        let ready = probe::require_nvrtc().and_then(|_| include_dirs().map(|_| ()));
        if let Err(e) = ready {
            assert!(
                std::env::var("MESHTRAIN_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "MESHTRAIN_REQUIRE_NVRTC=1 but: {e}"
            );
            eprintln!("skipped: {e}");
            return;
        }
        let version = nvrtc_version().unwrap();
        let includes = include_dirs().unwrap();
        let builds: Vec<_> = ["80", "90", "90a"]
            .into_iter()
            .flat_map(|arch| KERNEL_FILES.iter().map(move |&file| (arch, file)))
            .collect();
        // NVRTC compiles separate programs concurrently: on every core, since this is most of
        // the tests' time in CI (minutes on one core).
        use rayon::prelude::*;
        builds.par_iter().for_each(|&(arch, file)| {
            let cubin = compile_source(
                file.name,
                &full_source(file),
                arch,
                &options(arch, &includes),
                &version,
            )
            .unwrap_or_else(|e| panic!("{e}"));
            for name in expected_kernels(file.name) {
                let mut symbol = name.clone().into_bytes();
                symbol.push(0);
                assert!(
                    cubin.windows(symbol.len()).any(|w| w == symbol.as_slice()),
                    "{} for sm_{arch} does not export {name}",
                    file.name
                );
            }
            eprintln!("{} sm_{arch}: {} bytes", file.name, cubin.len());
        });
    }

    #[test]
    fn a_broken_kernel_is_named_with_nvrtcs_log() {
        if probe::require_nvrtc().is_err() || include_dirs().is_err() {
            eprintln!("skipped: no NVRTC");
            return;
        }
        let e = compile_source(
            "broken.cu",
            "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
            "90",
            &options("90", &include_dirs().unwrap()),
            &nvrtc_version().unwrap(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("broken.cu") && e.contains("sm_90"), "{e}");
        assert!(
            e.contains("undefined_name"),
            "NVRTC's log is in the message: {e}"
        );
    }

    #[test]
    fn the_cache_key_changes_with_source_options_and_version() {
        let o = vec!["--gpu-architecture=sm_90".to_string()];
        let k = cache_key("a", &o, "13.0");
        assert_eq!(k, cache_key("a", &o, "13.0"));
        assert_ne!(k, cache_key("b", &o, "13.0"));
        assert_ne!(
            k,
            cache_key("a", &["--gpu-architecture=sm_80".into()], "13.0")
        );
        assert_ne!(k, cache_key("a", &o, "13.1"));
        // Concatenation does not collide ("ab"+"c" vs "a"+"bc").
        assert_ne!(
            cache_key("ab", &["c".into()], "v"),
            cache_key("a", &["bc".into()], "v")
        );
    }

    #[test]
    fn every_kernel_file_is_listed_once() {
        let mut names: Vec<&str> = KERNEL_FILES.iter().map(|f| f.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), KERNEL_FILES.len());
        assert!(kernel_file("attention.cu").is_some());
        assert!(kernel_file("llama.cu").is_some());
        assert!(kernel_file("decode.cu").is_some());
        // Every listed file says which kernels it must export.
        for f in KERNEL_FILES {
            assert!(!expected_kernels(f.name).is_empty(), "{}", f.name);
        }
        assert!(full_source(KERNEL_FILES[0]).contains("typedef __nv_bfloat16 bf16"));
    }
}
