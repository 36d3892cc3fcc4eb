//! One CUDA device as meshtrain uses it: a context, one compute stream, the caching
//! allocator, the compiled kernel modules, cuBLASLt, and a pinned staging area for uploads.
//!
//! Every kernel and copy of a device runs on its one stream, in the order the host issues
//! them; the host runs ahead and waits only where it reads results (the loss and gradient
//! norm once per step, checkpoints). Handles are shared (`Arc<CudaDevice>`) and made once
//! per process and GPU ([`CudaDevice::get`]).

use super::alloc::{Block, CachingAllocator, MemoryStats, RawMemory};
use super::blas::Blas;
use super::compile::{self, KernelFile};
use super::error::CudaError;
use super::graph::{Op, Recorded, Recording};
use super::probe;
use cudarc::driver::result as cu;
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream};
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_void, CString};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock};

/// Memory straight from the driver (`cuMemAlloc`/`cuMemFree`).
pub struct DriverMemory {
    ctx: Arc<CudaContext>,
}

impl RawMemory for DriverMemory {
    fn alloc(&mut self, bytes: usize) -> Option<u64> {
        self.ctx.bind_to_thread().ok()?;
        // SAFETY: a plain allocation in the bound context.
        unsafe { cu::malloc_sync(bytes) }.ok()
    }

    fn free(&mut self, ptr: u64, _bytes: usize) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `alloc` and no tensor holds it any more. cuMemFree
            // waits for the device, so no queued kernel still uses it.
            let _ = unsafe { cu::free_sync(ptr) };
        }
    }

    fn info(&self) -> (usize, usize) {
        let _ = self.ctx.bind_to_thread();
        cu::mem_get_info().unwrap_or((0, 0))
    }
}

/// A compiled kernel function.
#[derive(Clone, Copy)]
struct Function {
    handle: sys::CUfunction,
    /// The dynamic shared memory this function has been allowed (above the 48 KiB default).
    smem_allowed: u32,
}

// SAFETY: CUfunction handles are plain driver handles, usable from any thread of the context.
unsafe impl Send for Function {}

struct Module {
    handle: sys::CUmodule,
    functions: HashMap<String, Function>,
}

// SAFETY: as for `Function`.
unsafe impl Send for Module {}

/// Kernel arguments, each at most 8 bytes (pointers, `long long`, `int`, `float`, `double`), kept in
/// place until the launch copies them.
#[derive(Default)]
pub struct Args {
    slots: Vec<u64>,
}

impl Args {
    pub fn new() -> Self {
        Args::default()
    }

    /// A device pointer.
    pub fn ptr(mut self, p: u64) -> Self {
        self.slots.push(p);
        self
    }

    pub fn i32(mut self, v: i32) -> Self {
        self.slots.push(v as u32 as u64);
        self
    }

    pub fn usize_as_i32(self, v: usize) -> Self {
        assert!(
            v <= i32::MAX as usize,
            "{v} does not fit a kernel's int argument"
        );
        self.i32(v as i32)
    }

    pub fn i64(mut self, v: i64) -> Self {
        self.slots.push(v as u64);
        self
    }

    pub fn f32(mut self, v: f32) -> Self {
        self.slots.push(v.to_bits() as u64);
        self
    }

    /// A `double` (batch norm's counts: the statistics are computed in double).
    pub fn f64(mut self, v: f64) -> Self {
        self.slots.push(v.to_bits());
        self
    }

    /// These arguments followed by `more`.
    pub fn append(mut self, more: Args) -> Self {
        self.slots.extend(more.slots);
        self
    }
}

/// A launch's grid, block and dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub smem: u32,
}

impl Launch {
    /// `blocks` blocks of `threads` threads along x.
    pub fn linear(blocks: usize, threads: u32) -> Self {
        Launch {
            grid: (blocks.clamp(1, u32::MAX as usize) as u32, 1, 1),
            block: (threads, 1, 1),
            smem: 0,
        }
    }

    /// A grid-stride launch over `n` elements: enough blocks of `threads` to cover them,
    /// at most `max_blocks` (the kernels loop over the rest).
    pub fn grid_stride(n: usize, threads: u32, max_blocks: usize) -> Self {
        Self::linear(n.div_ceil(threads as usize).clamp(1, max_blocks), threads)
    }
}

/// Pinned host memory that uploads are staged through, so `cuMemcpyHtoDAsync` is truly
/// asynchronous (a copy from pageable memory waits for the stream) and the host keeps
/// running ahead of the device. A ring: a region is reused once the copy that read it is
/// done (its event).
struct Staging {
    base: *mut u8,
    capacity: usize,
    head: usize,
    pending: VecDeque<(usize, usize, sys::CUevent)>,
    spare_events: Vec<sys::CUevent>,
}

// SAFETY: the pinned buffer and events belong to the device and are used under its lock.
unsafe impl Send for Staging {}

const STAGING_BYTES: usize = 16 << 20;

/// One CUDA GPU.
pub struct CudaDevice {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pub(super) allocator: Mutex<CachingAllocator<DriverMemory>>,
    modules: Mutex<HashMap<&'static str, Module>>,
    pub(super) blas: Mutex<Option<Blas>>,
    /// A step being captured as a CUDA graph or compared with one ([`super::graph`]), and
    /// whether that is so (checked first, without the lock, by every launch).
    pub(super) recording: Mutex<Recording>,
    pub(super) recording_on: AtomicBool,
    /// The thread whose step is recorded (the only one that may use the device meanwhile).
    pub(super) recording_thread: Mutex<Option<std::thread::ThreadId>>,
    staging: Mutex<Option<Staging>>,
    name: String,
    capability: (i32, i32),
    multiprocessors: usize,
    /// How f32 products run (exact, or TF32 when the run asks for it).
    f32_math: Mutex<super::blas::F32Math>,
    /// While profiling: every kernel and product queued, between two timing events.
    profile: Mutex<Option<Vec<(String, Event, Event)>>>,
    /// Synchronise after every launch (`MESHTRAIN_CUDA_SYNC=1`): a failing kernel is then
    /// named by its own launch instead of at the next synchronisation.
    sync_each_launch: bool,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cuda:{} ({})", self.ordinal, self.name)
    }
}

fn registry() -> &'static Mutex<HashMap<usize, Arc<CudaDevice>>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
    DEVICES.get_or_init(Default::default)
}

impl CudaDevice {
    /// GPU `ordinal`, opened on first use (libraries checked, context and stream created).
    pub fn get(ordinal: usize) -> Result<Arc<CudaDevice>, CudaError> {
        let mut devices = registry().lock().expect("device registry");
        if let Some(d) = devices.get(&ordinal) {
            d.bind()?;
            return Ok(d.clone());
        }
        let device = Arc::new(Self::open(ordinal)?);
        devices.insert(ordinal, device.clone());
        Ok(device)
    }

    fn open(ordinal: usize) -> Result<CudaDevice, CudaError> {
        probe::require_gpu(ordinal)?;
        let ctx =
            CudaContext::new(ordinal).map_err(|e| CudaError::driver("creating a context", e))?;
        // Our tensors are raw device pointers ordered by one stream: cudarc's per-slice
        // event tracking would only add work.
        // SAFETY: no cudarc slices of this context exist yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| CudaError::driver("creating a stream", e))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let capability = ctx
            .compute_capability()
            .map_err(|e| CudaError::driver("reading the compute capability", e))?;
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .unwrap_or(1)
            .max(1) as usize;
        if capability.0 < 8 {
            return Err(CudaError::Unsupported(format!(
                "{name} has compute capability {}.{}; meshtrain's CUDA kernels need 8.0 or \
                 newer (A100, H100, RTX 30xx and later) for bf16 tensor cores",
                capability.0, capability.1
            )));
        }
        Ok(CudaDevice {
            ordinal,
            allocator: Mutex::new(CachingAllocator::new(DriverMemory { ctx: ctx.clone() })),
            ctx,
            stream,
            modules: Mutex::new(HashMap::new()),
            blas: Mutex::new(None),
            staging: Mutex::new(None),
            name,
            capability,
            multiprocessors,
            f32_math: Mutex::new(super::blas::F32Math::Exact),
            profile: Mutex::new(None),
            recording: Mutex::new(Recording::Off),
            recording_on: AtomicBool::new(false),
            recording_thread: Mutex::new(None),
            sync_each_launch: std::env::var("MESHTRAIN_CUDA_SYNC").is_ok_and(|v| v == "1"),
        })
    }

    /// Makes this device's context current on the calling thread (every entry point calls
    /// it: worker threads use the device too).
    pub fn bind(&self) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::driver("binding the context", e))
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The architecture the kernels are compiled for: "80" for an A100, "90a" for an H100 or
    /// H200 (compute capability 9.0 with its architecture-specific instructions, `wgmma`
    /// among them; such code runs only on 9.0, which is the device it is compiled for).
    pub fn arch(&self) -> String {
        let suffix = if self.has_warpgroup_mma() { "a" } else { "" };
        format!("{}{}{suffix}", self.capability.0, self.capability.1)
    }

    /// Whether the kernels may use Hopper's warpgroup products (`wgmma`): compute capability
    /// exactly 9.0 (sm_90a code does not run on later architectures).
    pub fn has_warpgroup_mma(&self) -> bool {
        self.capability == (9, 0)
    }

    /// Whether the tensor cores take FP8 operands: Ada (compute capability 8.9) and later.
    pub fn has_fp8_tensor_cores(&self) -> bool {
        (self.capability.0, self.capability.1) >= (8, 9)
    }

    pub fn multiprocessors(&self) -> usize {
        self.multiprocessors
    }

    /// How this device runs f32 products ([`super::blas::F32Math`]).
    pub fn f32_math(&self) -> super::blas::F32Math {
        *self.f32_math.lock().expect("f32 math")
    }

    /// Allows TF32 for f32 products (`train.tf32`), or not.
    pub fn set_f32_math(&self, math: super::blas::F32Math) {
        *self.f32_math.lock().expect("f32 math") = math;
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    /// (free, total) device memory now.
    pub fn memory_info(&self) -> (usize, usize) {
        let _ = self.bind();
        cu::mem_get_info().unwrap_or((0, 0))
    }

    pub fn memory_stats(&self) -> MemoryStats {
        self.allocator.lock().expect("allocator").stats()
    }

    /// Bytes the device's own libraries hold for its whole life (cuBLASLt's workspace, once
    /// a product has run): counted by [`CudaDevice::memory_stats`], and named apart in a
    /// run's device-memory report, since no layout or batch changes them.
    pub fn library_bytes(&self) -> usize {
        self.blas
            .lock()
            .expect("blas")
            .as_ref()
            .map_or(0, |b| b.workspace_held_bytes())
    }

    pub fn reset_peak_memory(&self) {
        self.allocator.lock().expect("allocator").reset_peak();
    }

    /// Limits the bytes this process's tensors may hold on the device.
    pub fn set_memory_limit(&self, limit: Option<usize>) {
        self.allocator.lock().expect("allocator").set_limit(limit);
    }

    /// Returns cached blocks to the driver.
    pub fn empty_cache(&self) {
        self.allocator.lock().expect("allocator").empty_cache();
    }

    /// A buffer of at least `bytes` (contents undefined); `what` names it if the device is
    /// full.
    pub fn alloc(self: &Arc<Self>, bytes: usize, what: &str) -> Result<DevBuf, CudaError> {
        self.bind()?;
        if let Some(block) = self.record_allocation(bytes)? {
            return Ok(DevBuf {
                block,
                bytes,
                device: self.clone(),
            });
        }
        let block = self
            .allocator
            .lock()
            .expect("allocator")
            .allocate(bytes, what)
            .map_err(|oom| CudaError::OutOfMemory { oom })?;
        Ok(DevBuf {
            block,
            bytes,
            device: self.clone(),
        })
    }

    /// [`CudaDevice::alloc`] of a buffer filled with zero bytes.
    pub fn alloc_zeroed(self: &Arc<Self>, bytes: usize, what: &str) -> Result<DevBuf, CudaError> {
        let buf = self.alloc(bytes, what)?;
        self.memset_zero(buf.ptr(), bytes)?;
        Ok(buf)
    }

    pub fn memset_zero(&self, ptr: u64, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        let op = || Op::Memset { ptr, bytes };
        if self.recording_active()
            && self.record(op(), || format!("a memset of {bytes} bytes"), None)? == Recorded::Skip
        {
            return Ok(());
        }
        // SAFETY: `ptr..ptr+bytes` lies in a live allocation of this device.
        let queued = unsafe { cu::memset_d8_async(ptr, 0, bytes, self.cu_stream()) }
            .map_err(|e| CudaError::driver("clearing a buffer", e));
        self.refused_by_the_capture(queued, None)
    }

    /// Copies `bytes` from `src` to `dst` on the stream.
    pub fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        let op = || Op::Copy { dst, src, bytes };
        if self.recording_active()
            && self.record(op(), || format!("a copy of {bytes} bytes"), None)? == Recorded::Skip
        {
            return Ok(());
        }
        // SAFETY: both ranges lie in live allocations of this device.
        let queued = unsafe { cu::memcpy_dtod_async(dst, src, bytes, self.cu_stream()) }
            .map_err(|e| CudaError::driver("a device-to-device copy", e));
        self.refused_by_the_capture(queued, None)
    }

    /// Queues a copy of `data` into device memory at `dst`: through the pinned staging ring
    /// when it fits (asynchronous), else directly (the host waits).
    pub fn upload_to<T: bytemuck::Pod>(&self, dst: u64, data: &[T]) -> Result<(), CudaError> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if bytes.is_empty() {
            return Ok(());
        }
        self.bind()?;
        if self.record_upload(dst, bytes)? {
            return Ok(());
        }
        if bytes.len() <= STAGING_BYTES / 2 {
            let mut staging = self.staging.lock().expect("staging");
            if staging.is_none() {
                *staging = Some(Staging::new()?);
            }
            return staging
                .as_mut()
                .expect("made above")
                .upload(dst, bytes, self.cu_stream());
        }
        // SAFETY: `dst` holds at least `bytes.len()` bytes; the stream is synchronised first
        // so the copy is ordered after queued work that may still read `dst`.
        self.synchronize()?;
        unsafe { cu::memcpy_htod_sync(dst, bytes) }
            .map_err(|e| CudaError::driver("copying to the device", e))
    }

    /// A new buffer holding `data`.
    pub fn upload<T: bytemuck::Pod>(
        self: &Arc<Self>,
        data: &[T],
        what: &str,
    ) -> Result<DevBuf, CudaError> {
        let buf = self.alloc(std::mem::size_of_val(data), what)?;
        self.upload_to(buf.ptr(), data)?;
        Ok(buf)
    }

    /// Waits for queued work, then copies `out.len()` values from `src` (the host waits).
    pub fn download_into<T: bytemuck::Pod>(
        &self,
        out: &mut [T],
        src: u64,
    ) -> Result<(), CudaError> {
        if out.is_empty() {
            return Ok(());
        }
        self.bind()?;
        self.between_graphs("reads device memory", || {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
            // SAFETY: `src` holds at least `bytes.len()` bytes.
            unsafe { cu::memcpy_dtoh_async(bytes, src, self.cu_stream()) }
                .map_err(|e| CudaError::driver("copying from the device", e))?;
            self.synchronize()
        })
    }

    pub fn download<T: bytemuck::Pod + Default>(
        &self,
        src: u64,
        len: usize,
    ) -> Result<Vec<T>, CudaError> {
        let mut out = vec![T::default(); len];
        self.download_into(&mut out, src)?;
        Ok(out)
    }

    /// Page-locked host memory of `bytes` bytes (page-aligned), which copies to and from the
    /// device run at the bus's rate (about 9x pageable memory's on an H100 host): the staging
    /// area of collectives that move device buffers through host memory.
    pub fn alloc_pinned(self: &Arc<Self>, bytes: usize) -> Result<PinnedBuf, CudaError> {
        self.bind()?;
        // SAFETY: a pinned allocation of the current context, freed once by `PinnedBuf`.
        let ptr = unsafe { cu::malloc_host(bytes.max(1), 0) }.map_err(|e| {
            CudaError::driver(format!("allocating {bytes} bytes of pinned host memory"), e)
        })?;
        Ok(PinnedBuf {
            ptr: ptr as *mut u8,
            bytes,
            device: self.clone(),
        })
    }

    /// Copies `data` to `dst` after the work queued so far, and returns once it is on the
    /// device (so `data` may be reused at once); from pinned memory the copy is one DMA.
    pub fn upload_now(&self, dst: u64, data: &[u8]) -> Result<(), CudaError> {
        if data.is_empty() {
            return Ok(());
        }
        self.bind()?;
        self.between_graphs("waits for an upload", || {
            // SAFETY: `dst` holds at least `data.len()` bytes; the stream is synchronised
            // below, before `data` can be released.
            unsafe { cu::memcpy_htod_async(dst, data, self.cu_stream()) }
                .map_err(|e| CudaError::driver("copying to the device", e))?;
            self.synchronize()
        })
    }

    /// Waits until everything queued has run; a kernel that failed is reported here.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.bind()?;
        self.between_graphs("waits for the device", || {
            self.stream
                .synchronize()
                .map_err(|e| CudaError::driver("running the queued kernels", e))
        })
    }

    /// Compiles (or loads from the cache) `file` for this device, once per process.
    fn module<'a>(
        &self,
        modules: &'a mut HashMap<&'static str, Module>,
        file: KernelFile,
    ) -> Result<&'a mut Module, CudaError> {
        if !modules.contains_key(file.name) {
            let cubin = compile::compile_cached(file, &self.arch())?;
            self.bind()?;
            // SAFETY: `cubin` is a complete image for this device's architecture.
            let handle = unsafe { cu::module::load_data(cubin.as_ptr() as *const c_void) }
                .map_err(|e| CudaError::driver(format!("loading {}", file.name), e))?;
            modules.insert(
                file.name,
                Module {
                    handle,
                    functions: HashMap::new(),
                },
            );
        }
        Ok(modules.get_mut(file.name).expect("inserted above"))
    }

    /// Compiles and loads every kernel file now (so the first step does not pay for it and a
    /// compile error shows before training).
    pub fn load_all_kernels(&self) -> Result<(), CudaError> {
        let mut modules = self.modules.lock().expect("modules");
        for &file in compile::KERNEL_FILES {
            self.module(&mut modules, file)?;
        }
        Ok(())
    }

    /// Launches `kernel` of `file` on the stream.
    pub fn launch(
        &self,
        file: &'static str,
        kernel: &str,
        launch: Launch,
        args: Args,
    ) -> Result<(), CudaError> {
        let func = {
            let mut modules = self.modules.lock().expect("modules");
            let file_def = compile::kernel_file(file)
                .unwrap_or_else(|| panic!("no kernel file {file} (a programming error)"));
            let module = self.module(&mut modules, file_def)?;
            let entry = match module.functions.get(kernel) {
                Some(f) => *f,
                None => {
                    let name = CString::new(kernel).expect("kernel names hold no NUL");
                    // SAFETY: the module is loaded.
                    let handle =
                        unsafe { cu::module::get_function(module.handle, name) }.map_err(|e| {
                            CudaError::driver(format!("finding kernel {kernel} in {file}"), e)
                        })?;
                    let f = Function {
                        handle,
                        smem_allowed: 48 << 10,
                    };
                    module.functions.insert(kernel.to_string(), f);
                    f
                }
            };
            if launch.smem > entry.smem_allowed {
                // SAFETY: a valid function handle; the size is checked by the driver.
                unsafe {
                    cu::function::set_function_attribute(
                        entry.handle,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        launch.smem as i32,
                    )
                }
                .map_err(|e| {
                    CudaError::driver(
                        format!("allowing {kernel} {} bytes of shared memory", launch.smem),
                        e,
                    )
                })?;
                module
                    .functions
                    .get_mut(kernel)
                    .expect("inserted above")
                    .smem_allowed = launch.smem;
            }
            entry.handle
        };
        self.bind()?;
        if self.recording_active() {
            let op = Op::Kernel {
                func: func as usize,
                launch,
                args: args.slots.clone(),
            };
            let name = || format!("{kernel} ({file}) {launch:?}");
            if self.record(op, name, None)? == Recorded::Skip {
                return Ok(());
            }
        }
        let started = self.profiling().then(|| self.record_event()).transpose()?;
        // SAFETY: pointer arguments point into live allocations of this device (the callers'
        // DevBufs and parameter views outlive the queued work or are released back to the
        // cache, whose next owner's work is ordered after it on this stream).
        let queued = unsafe { self.launch_function(func, launch, args.slots) }
            .map_err(|e| CudaError::driver(format!("launching {kernel} ({file}) {launch:?}"), e));
        self.refused_by_the_capture(queued, None)?;
        if let Some(start) = started {
            self.profiled(kernel.to_string(), start)?;
        }
        if self.sync_each_launch {
            self.synchronize().map_err(|e| {
                CudaError::driver(format!("running {kernel} ({file}) {launch:?}"), e)
            })?;
        }
        Ok(())
    }

    /// Queues `func` with argument `slots` on the stream.
    ///
    /// # Safety
    /// `func` is a function of a loaded module of this device, `slots` its arguments in
    /// order, and every pointer among them stays valid until the queued work has run.
    pub(super) unsafe fn launch_function(
        &self,
        func: sys::CUfunction,
        launch: Launch,
        mut slots: Vec<u64>,
    ) -> Result<(), cudarc::driver::DriverError> {
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        // SAFETY: every parameter slot lives until the call returns (the driver copies them);
        // the rest is the caller's promise.
        unsafe {
            cu::launch_kernel(
                func,
                launch.grid,
                launch.block,
                launch.smem,
                self.cu_stream(),
                &mut params,
            )
        }
    }

    /// cuBLASLt, created on first use.
    pub fn with_blas<T>(
        self: &Arc<Self>,
        f: impl FnOnce(&mut Blas) -> Result<T, CudaError>,
    ) -> Result<T, CudaError> {
        let mut blas = self.blas.lock().expect("blas");
        if blas.is_none() {
            *blas = Some(Blas::new(self.clone())?);
        }
        f(blas.as_mut().expect("made above"))
    }

    /// Starts timing every kernel and product queued from now on ([`CudaDevice::profile_finish`]).
    pub fn profile_start(&self) {
        *self.profile.lock().expect("profile") = Some(Vec::new());
    }

    pub fn profiling(&self) -> bool {
        self.profile.lock().expect("profile").is_some()
    }

    /// Records that `name` ran from `start` to now (while profiling).
    pub fn profiled(&self, name: String, start: Event) -> Result<(), CudaError> {
        let end = self.record_event()?;
        if let Some(p) = self.profile.lock().expect("profile").as_mut() {
            p.push((name, start, end));
        }
        Ok(())
    }

    /// Stops profiling: milliseconds of device time and launches per kernel name, largest
    /// first (the host waits for the device).
    pub fn profile_finish(&self) -> Result<Vec<(String, f64, usize)>, CudaError> {
        let Some(records) = self.profile.lock().expect("profile").take() else {
            return Ok(Vec::new());
        };
        let mut by_name: HashMap<String, (f64, usize)> = HashMap::new();
        for (name, start, end) in records {
            let ms = start.ms_until(&end)? as f64;
            let e = by_name.entry(name).or_default();
            e.0 += ms;
            e.1 += 1;
        }
        let mut out: Vec<(String, f64, usize)> =
            by_name.into_iter().map(|(n, (ms, c))| (n, ms, c)).collect();
        out.sort_by(|a, b| b.1.total_cmp(&a.1));
        Ok(out)
    }

    /// A timing event recorded on the stream now.
    pub fn record_event(&self) -> Result<Event, CudaError> {
        self.bind()?;
        self.between_graphs("times its work", || {
            let e = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(|e| CudaError::driver("creating an event", e))?;
            // SAFETY: a fresh event and this device's stream.
            unsafe { cu::event::record(e, self.cu_stream()) }
                .map_err(|e| CudaError::driver("recording an event", e))?;
            Ok(Event(e))
        })
    }
}

/// A recorded timing event.
pub struct Event(sys::CUevent);

// SAFETY: event handles are usable from any thread of the context.
unsafe impl Send for Event {}

impl Event {
    /// Milliseconds of device time from `self` to `later` (waits for `later`).
    pub fn ms_until(&self, later: &Event) -> Result<f32, CudaError> {
        // SAFETY: both events were recorded.
        unsafe {
            cu::event::synchronize(later.0)
                .map_err(|e| CudaError::driver("waiting for an event", e))?;
            cu::event::elapsed(self.0, later.0)
        }
        .map_err(|e| CudaError::driver("reading an event's time", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by `record_event`, destroyed once.
        unsafe {
            let _ = cu::event::destroy(self.0);
        }
    }
}

impl Staging {
    fn new() -> Result<Staging, CudaError> {
        // SAFETY: a pinned allocation of the current context.
        let base = unsafe { cu::malloc_host(STAGING_BYTES, 0) }
            .map_err(|e| CudaError::driver("allocating pinned staging memory", e))?;
        Ok(Staging {
            base: base as *mut u8,
            capacity: STAGING_BYTES,
            head: 0,
            pending: VecDeque::new(),
            spare_events: Vec::new(),
        })
    }

    fn upload(&mut self, dst: u64, bytes: &[u8], stream: sys::CUstream) -> Result<(), CudaError> {
        let n = bytes.len().div_ceil(256) * 256;
        if self.head + n > self.capacity {
            self.head = 0;
        }
        let (start, end) = (self.head, self.head + n);
        // Wait for the newest pending copy that read this region; older ones are done too
        // (one stream).
        if let Some(newest) = self
            .pending
            .iter()
            .rposition(|&(s, e, _)| s < end && start < e)
        {
            let event = self.pending[newest].2;
            // SAFETY: a recorded event.
            unsafe { cu::event::synchronize(event) }
                .map_err(|e| CudaError::driver("waiting for a staged upload", e))?;
            for (_, _, e) in self.pending.drain(..=newest) {
                self.spare_events.push(e);
            }
        }
        // SAFETY: `start..start+len` lies in the pinned buffer and no pending copy reads it.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base.add(start), bytes.len());
            cu::memcpy_htod_async(
                dst,
                std::slice::from_raw_parts(self.base.add(start), bytes.len()),
                stream,
            )
        }
        .map_err(|e| CudaError::driver("copying to the device", e))?;
        let event = match self.spare_events.pop() {
            Some(e) => e,
            None => cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| CudaError::driver("creating an event", e))?,
        };
        // SAFETY: a live event and stream.
        unsafe { cu::event::record(event, stream) }
            .map_err(|e| CudaError::driver("recording an event", e))?;
        self.pending.push_back((start, end, event));
        self.head = end;
        Ok(())
    }
}

/// Page-locked host memory, freed when dropped.
pub struct PinnedBuf {
    ptr: *mut u8,
    bytes: usize,
    device: Arc<CudaDevice>,
}

// SAFETY: plain host memory owned by this value; the driver frees it from any thread.
unsafe impl Send for PinnedBuf {}
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: allocated by `alloc_pinned`, freed once; no copy still reads it (every
            // copy from or to it was waited for).
            unsafe {
                let _ = cu::free_host(self.ptr.cast());
            }
        }
    }
}

/// Device memory from the caching allocator, returned to it when dropped.
pub struct DevBuf {
    block: Block,
    bytes: usize,
    device: Arc<CudaDevice>,
}

impl DevBuf {
    pub fn ptr(&self) -> u64 {
        self.block.ptr
    }

    /// What the buffer occupies in the allocator's counts (its block's size class).
    pub fn held_bytes(&self) -> usize {
        self.block.class
    }

    /// The bytes asked for (the block may be larger).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }
}

impl std::fmt::Debug for DevBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DevBuf({:#x}, {} bytes on {:?})",
            self.block.ptr, self.bytes, self.device
        )
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if let Ok(mut a) = self.device.allocator.lock() {
            a.release(self.block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_sit_in_eight_byte_slots_the_driver_reads_from_the_start() {
        let a = Args::new()
            .ptr(0xdead_beef_0000)
            .i32(-2)
            .i64(1 << 40)
            .f32(1.5)
            .usize_as_i32(7)
            .append(Args::new().i32(3));
        assert_eq!(
            a.slots,
            vec![
                0xdead_beef_0000,
                0xffff_fffe, // an int: its four little-endian bytes first
                1 << 40,
                1.5f32.to_bits() as u64,
                7,
                3
            ]
        );
        // The driver reads sizeof(int) = 4 bytes from a slot: the value, sign included.
        assert_eq!(
            i32::from_le_bytes(a.slots[1].to_le_bytes()[..4].try_into().unwrap()),
            -2
        );
    }

    #[test]
    #[should_panic(expected = "does not fit a kernel's int argument")]
    fn sizes_past_an_int_are_refused() {
        let _ = Args::new().usize_as_i32(1 << 31);
    }

    #[test]
    fn grid_stride_launches_cover_small_inputs_and_cap_large_ones() {
        assert_eq!(Launch::grid_stride(0, 256, 100).grid, (1, 1, 1));
        assert_eq!(Launch::grid_stride(257, 256, 100).grid, (2, 1, 1));
        assert_eq!(Launch::grid_stride(1 << 30, 256, 100).grid, (100, 1, 1));
        assert_eq!(Launch::linear(0, 128).grid, (1, 1, 1));
        assert_eq!(Launch::linear(5, 128).block, (128, 1, 1));
    }
}
