//! Device buffers on the backends that move host memory.
//!
//! The threads and MPI backends read and write host memory; a GPU's buffer is an address the
//! host must never dereference. [`StagedGroup`] wraps any group so that it takes device
//! buffers too: each operation copies its inputs from the device into host staging memory
//! (pinned, on a GPU), runs the wrapped group's operation on the staged copies, and copies
//! its outputs back. That is how several ranks share the one GPU of a test machine (NCCL
//! refuses two ranks on one GPU), and how a user without NCCL still trains on several GPUs,
//! slowly: every collective crosses the host bus twice.
//!
//! The copies go through [`DeviceMemory`], so the staging logic is tested without a GPU on
//! [`HostBackedDevice`], a stand-in whose addresses the host cannot dereference: a backend
//! that touched a device address instead of its staged copy would crash the test.

use crate::dtype::{Device, RawBuf};
use crate::error::{CommError, OpContext};
use crate::group::{CommConfig, Completion, Operation, ProcessGroup, Work};
use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

/// Host memory an operation's device buffer is staged through, 8-byte aligned.
pub struct HostStage {
    ptr: *mut u8,
    len: usize,
    _owner: Box<dyn Any + Send>,
}

// SAFETY: the stage owns its memory (through `_owner`); only the operation it was made for
// uses it.
unsafe impl Send for HostStage {}

impl HostStage {
    /// Ordinary (pageable) host memory.
    pub fn heap(bytes: usize) -> HostStage {
        let mut words = vec![0u64; bytes.div_ceil(8)];
        let ptr = words.as_mut_ptr().cast();
        HostStage {
            ptr,
            len: bytes,
            _owner: Box::new(words),
        }
    }

    /// Memory kept alive by `owner`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, aligned to 8, for as long as
    /// `owner` lives, and used by nothing else meanwhile.
    pub unsafe fn from_owner(ptr: *mut u8, len: usize, owner: Box<dyn Any + Send>) -> HostStage {
        HostStage {
            ptr,
            len,
            _owner: owner,
        }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: valid for `len` bytes while `self` lives (constructors' contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The host view of this stage standing in for `device_buf`.
    fn view_for(&mut self, device_buf: RawBuf) -> RawBuf {
        debug_assert!(self.len >= device_buf.size_bytes());
        RawBuf {
            ptr: self.ptr,
            len: device_buf.len(),
            dtype: device_buf.dtype(),
            device: Device::Cpu,
        }
    }
}

/// An allocation in a device's memory, freed when dropped (through its owner).
pub struct DeviceAlloc {
    addr: u64,
    bytes: usize,
    device: Device,
    _owner: Box<dyn Any + Send + Sync>,
}

impl DeviceAlloc {
    /// `bytes` at `addr` in `device`'s memory, kept allocated by `owner`.
    pub fn new(addr: u64, bytes: usize, device: Device, owner: Box<dyn Any + Send + Sync>) -> Self {
        DeviceAlloc {
            addr,
            bytes,
            device,
            _owner: owner,
        }
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// A view of `len` elements of `dtype` from the start of the allocation.
    ///
    /// # Safety
    /// As for [`RawBuf::on_device`]; the view must fit the allocation (checked).
    pub unsafe fn view(&self, dtype: crate::DType, len: usize) -> RawBuf {
        assert!(
            len * dtype.size_bytes() <= self.bytes,
            "a view of {len} × {dtype} in an allocation of {} bytes",
            self.bytes
        );
        RawBuf::on_device(self.addr, len, dtype, self.device)
    }
}

/// One device's memory as a staging backend and the conformance suite see it.
pub trait DeviceMemory: Send + Sync {
    /// The device whose memory this is.
    fn device(&self) -> Device;
    /// Host memory of `bytes` to stage a buffer through (pinned, for a GPU).
    fn host_stage(&self, bytes: usize) -> Result<HostStage, String>;
    /// Copies the device bytes at `src` into `dst`, after the work queued on the device's
    /// compute stream so far (the kernels that produced them); returns once they are here.
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), String>;
    /// Copies `src` to the device at `dst`, before any work queued afterwards; returns once
    /// `src` may be reused.
    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), String>;
    /// `bytes` of device memory (for the conformance suite and tests).
    fn alloc(&self, bytes: usize) -> Result<DeviceAlloc, String>;
}

/// A device buffer of an operation and its host stage: `upload_bytes` go back to the device
/// once the host operation completes (0 for an input, whose stage only has to outlive it).
struct Staged {
    device_addr: u64,
    upload_bytes: usize,
    stage: HostStage,
}

/// Copies waiting for an asynchronous staged operation to finish.
struct Pending {
    work: Work,
    stages: Vec<Staged>,
    completion: Arc<Completion>,
    ctx: OpContext,
}

/// A process group that also takes buffers in one device's memory, staging them through
/// host memory for the wrapped (host) group. Host buffers pass straight through.
pub struct StagedGroup {
    inner: Arc<dyn ProcessGroup>,
    memory: Arc<dyn DeviceMemory>,
    /// Hands finished asynchronous operations to the thread that copies their outputs back;
    /// started with the first asynchronous device operation.
    finisher: Mutex<Option<mpsc::Sender<Pending>>>,
}

impl StagedGroup {
    /// `inner` taking buffers of `memory`'s device as well as host buffers.
    pub fn new(inner: Arc<dyn ProcessGroup>, memory: Arc<dyn DeviceMemory>) -> Arc<StagedGroup> {
        Arc::new(StagedGroup {
            inner,
            memory,
            finisher: Mutex::new(None),
        })
    }

    /// The device whose buffers this group stages.
    pub fn device(&self) -> Device {
        self.memory.device()
    }

    fn ctx(&self, op: &Operation) -> OpContext {
        OpContext::of(op, 0, Arc::from(self.inner.name()))
    }

    /// The host operation standing in for `op`: every device buffer replaced by a stage,
    /// the inputs' bytes downloaded into theirs. Returns the stages (the outputs' bytes go back
    /// to the device once the host operation completes) and the context errors name.
    fn stage(&self, op: Operation) -> Result<(Operation, Vec<Staged>, OpContext), CommError> {
        let ctx = self.ctx(&op);
        op.validate(&ctx, self.rank(), self.size())?;
        let device = self.memory.device();
        if op.device() != device {
            return Err(CommError::InvalidBuffer {
                ctx,
                details: format!(
                    "the buffer is in {}'s memory, but this group stages {device}'s",
                    op.device()
                ),
            });
        }
        let failed = |what: &str, e: String| CommError::Backend {
            ctx: ctx.clone(),
            details: format!("staging through host memory: {what}: {e}"),
        };
        let mut stages = Vec::new();
        // Stage one buffer: `read` downloads its bytes, `written` uploads them afterwards.
        let mut stage = |buf: RawBuf, read: bool, written: bool| -> Result<RawBuf, CommError> {
            let bytes = buf.size_bytes();
            let mut stage = self
                .memory
                .host_stage(bytes)
                .map_err(|e| failed("allocating the stage", e))?;
            if read {
                self.memory
                    .download(buf.addr(), &mut stage.as_mut_slice()[..bytes])
                    .map_err(|e| failed("copying the input from the device", e))?;
            }
            let view = stage.view_for(buf);
            stages.push(Staged {
                device_addr: buf.addr(),
                upload_bytes: if written { bytes } else { 0 },
                stage,
            });
            Ok(view)
        };
        let rank = self.rank();
        let host_op = match op {
            Operation::AllReduce { buf, op } => Operation::AllReduce {
                buf: stage(buf, true, true)?,
                op,
            },
            Operation::Broadcast { buf, root } => Operation::Broadcast {
                buf: stage(buf, rank == root, rank != root)?,
                root,
            },
            Operation::ReduceScatter { input, output, op } => Operation::ReduceScatter {
                input: stage(input, true, false)?,
                output: stage(output, false, true)?,
                op,
            },
            Operation::AllGather { input, output } => Operation::AllGather {
                input: stage(input, true, false)?,
                output: stage(output, false, true)?,
            },
            Operation::AllToAll { input, output } => Operation::AllToAll {
                input: stage(input, true, false)?,
                output: stage(output, false, true)?,
            },
            Operation::Send { buf, dst, tag } => Operation::Send {
                buf: stage(buf, true, false)?,
                dst,
                tag,
            },
            Operation::Recv { buf, src, tag } => Operation::Recv {
                buf: stage(buf, false, true)?,
                src,
                tag,
            },
            Operation::Barrier => Operation::Barrier,
        };
        Ok((host_op, stages, ctx))
    }

    fn finisher(&self) -> mpsc::Sender<Pending> {
        let mut finisher = self.finisher.lock().unwrap_or_else(|e| e.into_inner());
        finisher
            .get_or_insert_with(|| {
                let (tx, rx) = mpsc::channel::<Pending>();
                let memory = self.memory.clone();
                std::thread::Builder::new()
                    .name(format!("staged-{}", self.inner.name()))
                    .spawn(move || {
                        // In submission order, as the wrapped group completes them.
                        for pending in rx {
                            let result = pending.work.wait().and_then(|()| {
                                upload(memory.as_ref(), pending.stages, &pending.ctx)
                            });
                            pending.completion.complete(result);
                        }
                    })
                    .expect("starting the staging thread");
                tx
            })
            .clone()
    }
}

/// Copies the outputs' stages back to the device (and lets every stage go).
fn upload(
    memory: &dyn DeviceMemory,
    stages: Vec<Staged>,
    ctx: &OpContext,
) -> Result<(), CommError> {
    for mut staged in stages {
        if staged.upload_bytes > 0 {
            memory
                .upload(
                    staged.device_addr,
                    &staged.stage.as_mut_slice()[..staged.upload_bytes],
                )
                .map_err(|e| CommError::Backend {
                    ctx: ctx.clone(),
                    details: format!(
                        "staging through host memory: copying the output to the device: {e}"
                    ),
                })?;
        }
    }
    Ok(())
}

impl ProcessGroup for StagedGroup {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn name(&self) -> &str {
        self.inner.name()
    }

    fn global_ranks(&self) -> &[usize] {
        self.inner.global_ranks()
    }

    fn config(&self) -> &CommConfig {
        self.inner.config()
    }

    unsafe fn run_raw(&self, op: Operation) -> Result<(), CommError> {
        if op.device() == Device::Cpu {
            return self.inner.run_raw(op);
        }
        let (host_op, stages, ctx) = self.stage(op)?;
        // SAFETY: the stages live until `stages` is dropped, after the call.
        self.inner.run_raw(host_op)?;
        upload(self.memory.as_ref(), stages, &ctx)
    }

    unsafe fn start_raw(&self, op: Operation) -> Result<Work, CommError> {
        if op.device() == Device::Cpu {
            return self.inner.start_raw(op);
        }
        let completion = Arc::new(Completion::default());
        completion.begin();
        let (host_op, stages, ctx) = self.stage(op)?;
        // SAFETY: the stages move into `Pending` and live until its work has completed.
        let work = self.inner.start_raw(host_op)?;
        self.finisher()
            .send(Pending {
                work,
                stages,
                completion: completion.clone(),
                ctx: ctx.clone(),
            })
            .map_err(|_| CommError::Broken {
                ctx,
                cause: "the staging thread has stopped".into(),
            })?;
        Ok(Work::new(completion))
    }

    fn new_named_subgroup(
        &self,
        ranks: &[usize],
        name: &str,
    ) -> Result<Arc<dyn ProcessGroup>, CommError> {
        let inner = self.inner.new_named_subgroup(ranks, name)?;
        Ok(StagedGroup::new(inner, self.memory.clone()))
    }

    /// Staged sends are the host group's (buffered): whatever it needs.
    fn prepare_point_to_point(&self, pairs: &[(usize, usize)]) -> Result<(), CommError> {
        self.inner.prepare_point_to_point(pairs)
    }
}

/// A stand-in device's allocations by base address: (bytes, the memory).
type FakeAllocations = Arc<Mutex<BTreeMap<u64, (usize, Vec<u64>)>>>;

/// Addresses of [`HostBackedDevice`] allocations start here: a non-canonical x86-64 address
/// (and past any 48-bit address space elsewhere), so dereferencing one on the host faults.
const FAKE_DEVICE_BASE: u64 = 0xdead_0000_0000_0000;

/// A stand-in device for tests without a GPU: its memory is host memory, but the addresses
/// it hands out fault when the host dereferences them, so only its copies reach the bytes,
/// as with a GPU. It counts the bytes copied each way.
pub struct HostBackedDevice {
    device: Device,
    allocations: FakeAllocations,
    next: AtomicU64,
    downloaded: AtomicUsize,
    uploaded: AtomicUsize,
}

impl HostBackedDevice {
    /// A stand-in for `device` (its buffers are tagged with it).
    pub fn new(device: Device) -> Arc<HostBackedDevice> {
        Arc::new(HostBackedDevice {
            device,
            allocations: Arc::default(),
            next: AtomicU64::new(FAKE_DEVICE_BASE),
            downloaded: AtomicUsize::new(0),
            uploaded: AtomicUsize::new(0),
        })
    }

    /// Bytes copied to the host and to the device so far.
    pub fn copied(&self) -> (usize, usize) {
        (
            self.downloaded.load(Ordering::Relaxed),
            self.uploaded.load(Ordering::Relaxed),
        )
    }

    /// Runs `f` on the `len` bytes at `addr`, which must lie in one allocation.
    fn with_bytes<R>(
        &self,
        addr: u64,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, String> {
        let mut allocations = self.allocations.lock().unwrap_or_else(|e| e.into_inner());
        let (&base, (bytes, memory)) = allocations
            .range_mut(..=addr)
            .next_back()
            .ok_or_else(|| format!("{addr:#x} is not in an allocation of {}", self.device))?;
        let offset = (addr - base) as usize;
        if offset + len > *bytes {
            return Err(format!(
                "{len} bytes at {addr:#x} run past the allocation of {bytes} bytes at {base:#x}"
            ));
        }
        let all: &mut [u8] = bytemuck::cast_slice_mut(memory);
        Ok(f(&mut all[offset..offset + len]))
    }
}

impl DeviceMemory for HostBackedDevice {
    fn device(&self) -> Device {
        self.device
    }

    fn host_stage(&self, bytes: usize) -> Result<HostStage, String> {
        Ok(HostStage::heap(bytes))
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), String> {
        self.with_bytes(src, dst.len(), |bytes| dst.copy_from_slice(bytes))?;
        self.downloaded.fetch_add(dst.len(), Ordering::Relaxed);
        Ok(())
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), String> {
        self.with_bytes(dst, src.len(), |bytes| bytes.copy_from_slice(src))?;
        self.uploaded.fetch_add(src.len(), Ordering::Relaxed);
        Ok(())
    }

    fn alloc(&self, bytes: usize) -> Result<DeviceAlloc, String> {
        // 256-byte aligned as cudaMalloc's, with a gap so neighbours never touch.
        let addr = self
            .next
            .fetch_add((bytes as u64).div_ceil(256) * 256 + 256, Ordering::Relaxed);
        self.allocations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(addr, (bytes, vec![0u64; bytes.div_ceil(8)]));
        let owner = FakeAllocation {
            addr,
            allocations: self.allocations.clone(),
        };
        Ok(DeviceAlloc::new(addr, bytes, self.device, Box::new(owner)))
    }
}

/// Frees a [`HostBackedDevice`] allocation when its [`DeviceAlloc`] is dropped.
struct FakeAllocation {
    addr: u64,
    allocations: FakeAllocations,
}

impl Drop for FakeAllocation {
    fn drop(&mut self) {
        self.allocations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.addr);
    }
}

/// A CUDA GPU's memory: pinned host stages (kept in a small pool, since pinning is slow),
/// copies ordered on the device's compute stream.
#[cfg(feature = "cuda")]
pub struct CudaMemory {
    device: Arc<meshtrain_tensor::cuda::CudaDevice>,
    pool: Arc<Mutex<Vec<meshtrain_tensor::cuda::PinnedBuf>>>,
}

#[cfg(feature = "cuda")]
impl CudaMemory {
    pub fn new(device: Arc<meshtrain_tensor::cuda::CudaDevice>) -> Arc<CudaMemory> {
        Arc::new(CudaMemory {
            device,
            pool: Arc::default(),
        })
    }
}

/// A pinned stage that goes back to its pool when the operation is done with it.
#[cfg(feature = "cuda")]
struct PooledPinned {
    buf: Option<meshtrain_tensor::cuda::PinnedBuf>,
    pool: Arc<Mutex<Vec<meshtrain_tensor::cuda::PinnedBuf>>>,
}

#[cfg(feature = "cuda")]
impl Drop for PooledPinned {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
            // A handful in flight at once (DDP's buckets); more are freed.
            if pool.len() < 16 {
                pool.push(buf);
            }
        }
    }
}

#[cfg(feature = "cuda")]
impl DeviceMemory for CudaMemory {
    fn device(&self) -> Device {
        Device::Cuda(self.device.ordinal())
    }

    fn host_stage(&self, bytes: usize) -> Result<HostStage, String> {
        let reused = {
            let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
            let fit = pool
                .iter()
                .position(|b| b.len() >= bytes && b.len() <= bytes.max(4096) * 2);
            fit.map(|i| pool.swap_remove(i))
        };
        let mut buf = match reused {
            Some(buf) => buf,
            None => self.device.alloc_pinned(bytes).map_err(|e| e.to_string())?,
        };
        let ptr = buf.as_mut_ptr();
        let owner = PooledPinned {
            buf: Some(buf),
            pool: self.pool.clone(),
        };
        // SAFETY: page-aligned pinned memory of at least `bytes`, owned by `owner`.
        Ok(unsafe { HostStage::from_owner(ptr, bytes, Box::new(owner)) })
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), String> {
        self.device
            .download_into(dst, src)
            .map_err(|e| e.to_string())
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), String> {
        self.device.upload_now(dst, src).map_err(|e| e.to_string())
    }

    fn alloc(&self, bytes: usize) -> Result<DeviceAlloc, String> {
        let buf = self
            .device
            .alloc(bytes, "a collective's buffer")
            .map_err(|e| e.to_string())?;
        Ok(DeviceAlloc::new(
            buf.ptr(),
            bytes,
            self.device(),
            Box::new(buf),
        ))
    }
}
