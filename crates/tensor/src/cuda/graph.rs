//! A training step as CUDA graphs: captured once, then replayed, so a step of a small model
//! costs a few launches instead of hundreds (issue 39, item 3).
//!
//! A captured graph replays the kernels with the arguments and addresses they had when it was
//! captured, and copies what pinned host memory holds when it runs. The step's host code
//! computes things per batch (token ids and their groups, the learning rate), so the graph
//! alone cannot say whether it still does what the next step would do. Hence three phases,
//! all on the device's one stream:
//!
//! 1. **Capture** ([`CudaDevice::begin_step_capture`], [`CudaDevice::end_step_capture`]):
//!    the step's host code runs once with the stream capturing. Every kernel, product,
//!    memset, copy and upload it queues is also written down (the tape); uploads are staged
//!    through pinned memory of the tape's own, which the graph's copies read. The caching
//!    allocator keeps the blocks the step touches for the graph ([`super::alloc`]).
//! 2. **Shadow run** ([`StepGraph::begin_step`]): before each replay the step's host code
//!    runs again, but the device only compares: each launch, product, memset and copy must
//!    equal the tape's next entry (kernel, grid, block, every argument), each allocation
//!    gets the block the capture got, and each upload writes its bytes into the pinned slot
//!    the graph's copy reads. Nothing is queued.
//! 3. **Replay**: what matched is launched as the captured graph.
//!
//! **Segments.** A step reads device memory (the loss sums, the gradient norm), waits for
//! the device and records timing events: none of that can be inside a graph. Such a point
//! ends a segment: while capturing, the capture so far becomes a graph, which is launched,
//! the read (wait, event) runs as usual, and a new capture begins; a shadow run launches the
//! segment's graph there (every piece of it matched) and does the read. A step is then a
//! few graph launches with its reads between them, as the eager step has them.
//!
//! **Falling back.** Anything that differs (a grid that depends on the batch, an argument,
//! an allocation of another size, a read where the captured step had none) or that a graph
//! cannot hold (autotuning a product of a new shape) makes the step fall back at that point:
//! what the current segment queued so far is issued as ordinary launches from the tape, the
//! call that differed runs as usual, and so does the rest of the step. The step is then
//! exactly the eager one, never a replay of the wrong graph, and the reason is returned.

use super::blas::{Blas, Gemm};
use super::context::{CudaDevice, Launch};
use super::error::CudaError;
use cudarc::driver::result as cu;
use cudarc::driver::sys;
use cudarc::driver::CudaGraph;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// One piece of a step's device work, as the capture saw it: a shadow run's piece matches
/// when it is equal (the same work on the same addresses; an upload's bytes are the run's
/// own, written into the slot the tape keeps for it).
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Op {
    Kernel {
        func: usize,
        launch: Launch,
        args: Vec<u64>,
    },
    Memset {
        ptr: u64,
        bytes: usize,
    },
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    /// `bytes` to `dst` from the tape's pinned inputs ([`Tape::slots`]).
    Upload {
        dst: u64,
        bytes: usize,
    },
    Product {
        gemm: Gemm,
        choice: usize,
    },
    /// A read, wait or timing event of the step's (`what`): a segment ends here.
    Between {
        what: &'static str,
    },
}

/// Pinned host memory the captured uploads read, in chunks that never move (the graph holds
/// their addresses).
#[derive(Default)]
struct Inputs {
    chunks: Vec<(*mut u8, usize, usize)>,
}

const INPUT_CHUNK_BYTES: usize = 1 << 20;

impl Inputs {
    /// Room for `bytes` (256-byte aligned), as (chunk, offset).
    fn reserve(&mut self, bytes: usize) -> Result<(usize, usize), CudaError> {
        let need = bytes.div_ceil(256) * 256;
        if let Some((i, (_, cap, used))) = self.chunks.iter_mut().enumerate().next_back() {
            if *used + need <= *cap {
                let at = *used;
                *used += need;
                return Ok((i, at));
            }
        }
        let cap = need.max(INPUT_CHUNK_BYTES);
        // SAFETY: a pinned allocation of the current context, freed once in `Drop`.
        let ptr = unsafe { cu::malloc_host(cap, 0) }
            .map_err(|e| CudaError::driver("allocating pinned memory for a graph's inputs", e))?;
        self.chunks.push((ptr as *mut u8, cap, need));
        Ok((self.chunks.len() - 1, 0))
    }

    fn at(&self, (chunk, offset): (usize, usize)) -> *mut u8 {
        // SAFETY: slots are handed out inside their chunk.
        unsafe { self.chunks[chunk].0.add(offset) }
    }
}

impl Drop for Inputs {
    fn drop(&mut self) {
        for &(ptr, _, _) in &self.chunks {
            // SAFETY: allocated in `reserve`, freed once; the owner waited for the copies.
            unsafe {
                let _ = cu::free_host(ptr.cast());
            }
        }
    }
}

/// The captured step's work in order, with a name for each piece (for the reason a later
/// step fell back).
#[derive(Default)]
pub(super) struct Tape {
    ops: Vec<Op>,
    names: Vec<String>,
    inputs: Inputs,
    /// Where each upload's bytes sit in `inputs` (chunk, offset), by the upload's piece.
    slots: std::collections::HashMap<usize, (usize, usize)>,
    /// Each segment's graph (`None` for a segment with no work), in order.
    graphs: Vec<Option<CudaGraph>>,
}

// SAFETY: the pinned chunks are plain host memory owned by the tape; the graphs are driver
// handles used by one thread at a time (the device's recording lock, or `&mut StepGraph`).
unsafe impl Send for Tape {}

impl Tape {
    /// Queues `ops[range]` as ordinary launches (a step that fell back); products through
    /// `blas` when the caller holds it.
    fn issue(
        &self,
        device: &CudaDevice,
        range: std::ops::Range<usize>,
        blas: Option<&mut Blas>,
    ) -> Result<(), CudaError> {
        let stream = device.cu_stream();
        let mut blas = blas;
        let mut own_blas = None;
        for (at, op) in self
            .ops
            .iter()
            .enumerate()
            .take(range.end)
            .skip(range.start)
        {
            match op {
                Op::Between { .. } => {}
                Op::Kernel { func, launch, args } => {
                    // SAFETY: the launch the step made, with its arguments, on its stream.
                    unsafe {
                        device.launch_function(*func as sys::CUfunction, *launch, args.clone())
                    }
                    .map_err(|e| CudaError::driver("launching a step's kernel again", e))?
                }
                // SAFETY (the three below): the step's own ranges, in live allocations
                // (the graph's pool keeps them), on its stream; the pinned slot lives in
                // the tape, which outlives the copy (the owner waits before reuse).
                Op::Memset { ptr, bytes } => {
                    unsafe { cu::memset_d8_async(*ptr, 0, *bytes, stream) }
                        .map_err(|e| CudaError::driver("clearing a buffer", e))?
                }
                Op::Copy { dst, src, bytes } => {
                    unsafe { cu::memcpy_dtod_async(*dst, *src, *bytes, stream) }
                        .map_err(|e| CudaError::driver("a device-to-device copy", e))?
                }
                Op::Upload { dst, bytes } => unsafe {
                    let data = std::slice::from_raw_parts(self.inputs.at(self.slots[&at]), *bytes);
                    cu::memcpy_htod_async(*dst, data, stream)
                }
                .map_err(|e| CudaError::driver("copying to the device", e))?,
                Op::Product { gemm, choice } => {
                    let b: &mut Blas = match blas.as_deref_mut() {
                        Some(b) => b,
                        None => {
                            let guard =
                                own_blas.get_or_insert_with(|| device.blas.lock().expect("blas"));
                            guard.as_mut().expect("a product ran, so cuBLASLt exists")
                        }
                    };
                    b.issue(gemm, *choice)?;
                }
            }
        }
        Ok(())
    }
}

/// What the device's stream is doing with a step's work.
#[derive(Default)]
pub(super) enum Recording {
    /// Running it (no graph involved).
    #[default]
    Off,
    /// Capturing it, and writing it down; the current segment's pieces begin at `start`.
    /// `paused` > 0 between segments (a read or wait under way, run as usual).
    Capturing {
        tape: Tape,
        start: usize,
        paused: u32,
    },
    /// Comparing it with the tape, piece `next` next, in segment `segment` (begun at piece
    /// `start`); nothing is queued but the matched segments' graphs.
    Shadow {
        tape: Tape,
        next: usize,
        start: usize,
        segment: usize,
        paused: u32,
    },
    /// It differed, or asked for what a graph cannot hold: what it had queued was issued,
    /// and the rest runs as usual.
    FellBack { tape: Tape, reason: String },
}

/// Ends the stream's capture: the segment's graph (`None` when it holds no work), launched.
fn end_segment(device: &CudaDevice) -> Result<Option<CudaGraph>, CudaError> {
    let graph = device
        .stream()
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .map_err(|e| CudaError::driver("ending a step's captured segment", e))?;
    if let Some(g) = &graph {
        g.launch()
            .map_err(|e| CudaError::driver("launching a step's captured segment", e))?;
    }
    Ok(graph)
}

fn begin_segment(device: &CudaDevice) -> Result<(), CudaError> {
    device
        .stream()
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .map_err(|e| CudaError::driver("beginning to capture a step", e))
}

/// What a piece of work does after [`CudaDevice::record`].
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Recorded {
    /// Queue it on the stream (eagerly, or into the capture).
    Issue,
    /// Nothing: a shadow run matched it, and the replay will run it.
    Skip,
}

impl CudaDevice {
    pub(super) fn recording_active(&self) -> bool {
        self.recording_on.load(Ordering::Acquire)
    }

    /// Whether the calling thread is not the one whose step is being captured or shadowed.
    /// The stream is the device's one: another thread's work would land in the graph (or be
    /// compared with it), so the step falls back instead.
    fn used_by_another_thread(&self) -> bool {
        let owner = *self.recording_thread.lock().expect("recording thread");
        owner.is_some_and(|t| t != std::thread::current().id())
    }

    /// The recording from now on belongs to the calling thread.
    fn start_recording(&self, state: Recording) {
        *self.recording_thread.lock().expect("recording thread") =
            Some(std::thread::current().id());
        *self.recording.lock().expect("recording") = state;
        self.recording_on.store(true, Ordering::Release);
    }

    /// Ends a capture's or shadow run's recording (the driver's capture is the caller's):
    /// what it had, with allocations from the shared cache again.
    fn stop_recording(&self) -> Recording {
        let state = std::mem::take(&mut *self.recording.lock().expect("recording"));
        self.recording_on.store(false, Ordering::Release);
        *self.recording_thread.lock().expect("recording thread") = None;
        self.allocator.lock().expect("allocator").end_graph_replay();
        state
    }

    /// Called by every piece of work before it is queued: written down while capturing,
    /// compared during a shadow run (a difference makes the step fall back, and the piece
    /// is then issued as usual). `name` says what it is, for the reason.
    pub(super) fn record(
        &self,
        op: Op,
        name: impl FnOnce() -> String,
        blas: Option<&mut Blas>,
    ) -> Result<Recorded, CudaError> {
        if !self.recording_active() {
            return Ok(Recorded::Issue);
        }
        if self.used_by_another_thread() {
            self.fall_back(ANOTHER_THREAD.into(), blas)?;
            return Ok(Recorded::Issue);
        }
        let mut recording = self.recording.lock().expect("recording");
        match &mut *recording {
            Recording::Capturing { tape, paused, .. } if *paused == 0 => {
                tape.ops.push(op);
                tape.names.push(name());
                Ok(Recorded::Issue)
            }
            Recording::Shadow {
                tape, next, paused, ..
            } if *paused == 0 => {
                if tape.ops.get(*next).is_some_and(|o| *o == op) {
                    *next += 1;
                    return Ok(Recorded::Skip);
                }
                let reason = differs(tape, *next, &name());
                drop(recording);
                self.fall_back(reason, blas)?;
                Ok(Recorded::Issue)
            }
            _ => Ok(Recorded::Issue),
        }
    }

    /// `bytes` to `dst` while a step is captured or shadowed: through the tape's pinned
    /// inputs (the graph's copy reads them). `false` when no step is recorded (or it fell
    /// back here): the caller uploads as usual.
    pub(super) fn record_upload(&self, dst: u64, data: &[u8]) -> Result<bool, CudaError> {
        if !self.recording_active() {
            return Ok(false);
        }
        if self.used_by_another_thread() {
            self.fall_back(ANOTHER_THREAD.into(), None)?;
            return Ok(false);
        }
        let mut recording = self.recording.lock().expect("recording");
        let name = || format!("an upload of {} bytes", data.len());
        match &mut *recording {
            Recording::Capturing { tape, paused, .. } if *paused == 0 => {
                let slot = tape.inputs.reserve(data.len())?;
                let at = tape.inputs.at(slot);
                // SAFETY: the slot holds `data.len()` bytes of pinned memory; the captured
                // copy reads it whenever the graph runs (the tape keeps it).
                unsafe {
                    std::ptr::copy_nonoverlapping(data.as_ptr(), at, data.len());
                    cu::memcpy_htod_async(
                        dst,
                        std::slice::from_raw_parts(at, data.len()),
                        self.cu_stream(),
                    )
                }
                .map_err(|e| CudaError::driver("copying to the device", e))?;
                tape.slots.insert(tape.ops.len(), slot);
                tape.ops.push(Op::Upload {
                    dst,
                    bytes: data.len(),
                });
                tape.names.push(name());
                Ok(true)
            }
            Recording::Shadow {
                tape, next, paused, ..
            } if *paused == 0 => {
                let op = Op::Upload {
                    dst,
                    bytes: data.len(),
                };
                if tape.ops.get(*next) == Some(&op) {
                    // SAFETY: the captured slot of this upload; the last replay that read it
                    // is done (`begin_step` waited).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            data.as_ptr(),
                            tape.inputs.at(tape.slots[&*next]),
                            data.len(),
                        )
                    };
                    *next += 1;
                    return Ok(true);
                }
                let reason = differs(tape, *next, &name());
                drop(recording);
                self.fall_back(reason, None)?;
                Ok(false)
            }
            _ => Ok(false),
        }
    }

    /// A replayed step's next allocation, from the graph's pool (`None`: no step is being
    /// shadowed, or it fell back here and allocates as usual).
    pub(super) fn record_allocation(
        &self,
        bytes: usize,
    ) -> Result<Option<super::alloc::Block>, CudaError> {
        if !self.recording_active() {
            return Ok(None);
        }
        if self.used_by_another_thread() {
            self.fall_back(ANOTHER_THREAD.into(), None)?;
            return Ok(None);
        }
        let shadow = matches!(
            *self.recording.lock().expect("recording"),
            Recording::Shadow { .. }
        );
        if !shadow {
            return Ok(None);
        }
        let replayed = self
            .allocator
            .lock()
            .expect("allocator")
            .replay_allocation(bytes);
        match replayed {
            Ok(block) => Ok(Some(block)),
            Err(why) => {
                self.fall_back(
                    format!("the step differs from the captured one: {why}"),
                    None,
                )?;
                Ok(None)
            }
        }
    }

    /// Runs `work`, a read, wait or timing event of the step's (`what`), between two of its
    /// graphs: a capture ends its segment here (launching its graph) and begins the next
    /// after; a shadow run launches the matched segment's graph here. Nested calls (a read
    /// that waits) are part of the outer one.
    pub(super) fn between_graphs<T>(
        &self,
        what: &'static str,
        work: impl FnOnce() -> Result<T, CudaError>,
    ) -> Result<T, CudaError> {
        if !self.recording_active() {
            return work();
        }
        let resume = self.pause(what)?;
        let result = work();
        if resume {
            self.resume()?;
        }
        result
    }

    /// The step reaches a read: whether [`CudaDevice::resume`] is to follow.
    fn pause(&self, what: &'static str) -> Result<bool, CudaError> {
        if self.used_by_another_thread() {
            self.fall_back(ANOTHER_THREAD.into(), None)?;
            return Ok(false);
        }
        let mut recording = self.recording.lock().expect("recording");
        match &mut *recording {
            Recording::Capturing {
                tape,
                start,
                paused,
            } => {
                if *paused == 0 {
                    let graph = end_segment(self);
                    let graph = match graph {
                        Ok(g) => g,
                        Err(e) => {
                            // The driver made no graph of the segment: its pieces run as
                            // ordinary launches, and so does the rest of the step.
                            drop(recording);
                            self.fall_back(format!("{e}"), None)?;
                            return Ok(false);
                        }
                    };
                    tape.graphs.push(graph);
                    tape.ops.push(Op::Between { what });
                    tape.names.push(format!("a point where the step {what}"));
                    *start = tape.ops.len();
                }
                *paused += 1;
                Ok(true)
            }
            Recording::Shadow {
                tape,
                next,
                start,
                segment,
                paused,
            } => {
                if *paused == 0 {
                    let op = Op::Between { what };
                    if !tape.ops.get(*next).is_some_and(|o| *o == op) {
                        let reason = differs(tape, *next, &format!("a point where it {what}"));
                        drop(recording);
                        self.fall_back(reason, None)?;
                        return Ok(false);
                    }
                    if let Some(graph) = &tape.graphs[*segment] {
                        graph
                            .launch()
                            .map_err(|e| CudaError::driver("replaying a step's segment", e))?;
                    }
                    *segment += 1;
                    *next += 1;
                    *start = *next;
                }
                *paused += 1;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    fn resume(&self) -> Result<(), CudaError> {
        let mut recording = self.recording.lock().expect("recording");
        match &mut *recording {
            Recording::Capturing { paused, .. } => {
                *paused -= 1;
                if *paused == 0 {
                    begin_segment(self)?;
                }
            }
            Recording::Shadow { paused, .. } => *paused -= 1,
            _ => {}
        }
        Ok(())
    }

    /// Before work a graph cannot hold and a replay would not repeat (`what`: planning a
    /// product of a new shape, a timed product), from inside cuBLASLt's lock (`blas`, which
    /// then issues the products written down so far): a step being captured or shadowed
    /// falls back here.
    pub(super) fn not_in_a_graph_holding(
        &self,
        what: &str,
        blas: &mut Blas,
    ) -> Result<(), CudaError> {
        self.leave_graph(what, Some(blas))
    }

    fn leave_graph(&self, what: &str, blas: Option<&mut Blas>) -> Result<(), CudaError> {
        if !self.recording_active() {
            return Ok(());
        }
        if self.used_by_another_thread() {
            return self.fall_back(ANOTHER_THREAD.into(), blas);
        }
        let recording = matches!(
            *self.recording.lock().expect("recording"),
            Recording::Capturing { paused: 0, .. } | Recording::Shadow { paused: 0, .. }
        );
        if recording {
            self.fall_back(format!("the step {what}, which a graph cannot hold"), blas)?;
        }
        Ok(())
    }

    /// What queueing a piece of work returned, while a step may be captured. The pieces this
    /// code queues are known to be capturable, but a driver may refuse one for reasons of its
    /// own (a launch attribute, a library's internal call) and invalidate the capture: then
    /// the step falls back (the capture ended, its pieces so far, this one included, issued
    /// again as ordinary work) instead of failing the run. A failure outside a capture, or
    /// one that recurs when issued eagerly, is returned.
    pub(super) fn refused_by_the_capture(
        &self,
        queued: Result<(), CudaError>,
        blas: Option<&mut Blas>,
    ) -> Result<(), CudaError> {
        let Err(refused) = queued else {
            return Ok(());
        };
        let capturing = matches!(
            *self.recording.lock().expect("recording"),
            Recording::Capturing { paused: 0, .. }
        );
        if !capturing {
            return Err(refused);
        }
        self.fall_back(
            format!("the driver refused it in a capture: {refused}"),
            blas,
        )
    }

    /// The step runs eagerly from here: a capture is ended (its segment's graph dropped),
    /// the current segment's pieces so far are queued as ordinary launches, and `reason`
    /// kept.
    fn fall_back(&self, reason: String, blas: Option<&mut Blas>) -> Result<(), CudaError> {
        let state = std::mem::take(&mut *self.recording.lock().expect("recording"));
        let (tape, pending) = match state {
            Recording::Capturing {
                tape,
                start,
                paused,
            } => {
                if paused == 0 {
                    // Ends the driver's capture, so what follows runs; its graph is not kept.
                    drop(self.stream().end_capture(sys::CUgraphInstantiate_flags(0)));
                }
                let n = tape.ops.len();
                (tape, start..n)
            }
            Recording::Shadow {
                tape, next, start, ..
            } => (tape, start..next),
            other => {
                *self.recording.lock().expect("recording") = other;
                return Ok(());
            }
        };
        self.allocator.lock().expect("allocator").end_graph_replay();
        let issued = tape.issue(self, pending, blas);
        *self.recording.lock().expect("recording") = Recording::FellBack { tape, reason };
        issued
    }

    /// Starts capturing a step: every piece of work from here on is written down and
    /// captured, until [`CudaDevice::end_step_capture`]. The device must not be shared with
    /// other work meanwhile (the trainer captures a step of one worker).
    pub fn begin_step_capture(&self) -> Result<(), CudaError> {
        self.synchronize()?;
        let recording = self.recording.lock().expect("recording");
        if !matches!(*recording, Recording::Off) {
            return Err(CudaError::Unsupported(
                "a step is already being captured or replayed on this device".into(),
            ));
        }
        self.allocator
            .lock()
            .expect("allocator")
            .begin_graph_capture();
        begin_segment(self)?;
        drop(recording);
        self.start_recording(Recording::Capturing {
            tape: Tape::default(),
            start: 0,
            paused: 0,
        });
        Ok(())
    }

    /// Ends the capture begun by [`CudaDevice::begin_step_capture`]; its last segment's
    /// graph is launched (each earlier one was at its end), so the captured step has run.
    /// Where the step fell back, or the driver could not make a graph of it, the step has run
    /// (is queued) eagerly and the reason is returned.
    pub fn end_step_capture(self: &Arc<Self>) -> Result<StepCapture, CudaError> {
        let mut tape = match self.stop_recording() {
            Recording::Capturing {
                tape, paused: 0, ..
            } => tape,
            Recording::FellBack { reason, .. } => {
                self.allocator.lock().expect("allocator").drop_graph_pool();
                return Ok(StepCapture::FellBack(reason));
            }
            _ => {
                return Err(CudaError::Unsupported(
                    "end_step_capture without begin_step_capture, or inside a read".into(),
                ))
            }
        };
        match end_segment(self) {
            Ok(graph) => tape.graphs.push(graph),
            Err(e) => {
                // The last segment has not run: queue its pieces as ordinary launches.
                let start = tape
                    .ops
                    .iter()
                    .rposition(|o| matches!(o, Op::Between { .. }))
                    .map_or(0, |i| i + 1);
                tape.issue(self, start..tape.ops.len(), None)?;
                self.allocator.lock().expect("allocator").drop_graph_pool();
                return Ok(StepCapture::FellBack(format!(
                    "the driver made no graph of the step: {e}"
                )));
            }
        }
        Ok(StepCapture::Graph(StepGraph {
            device: self.clone(),
            tape: Some(tape),
            replays: 0,
        }))
    }
}

const ANOTHER_THREAD: &str = "another thread used the device during the step";

/// Why a shadow run's piece `name` is not the tape's piece `next`.
fn differs(tape: &Tape, next: usize, name: &str) -> String {
    match tape.names.get(next) {
        Some(expected) => {
            format!("{name} differs from the captured step's piece {next} ({expected})")
        }
        None => format!(
            "{name} comes after the {} pieces of the captured step",
            tape.ops.len()
        ),
    }
}

/// How a capture ended.
pub enum StepCapture {
    /// The step is a graph (and has run once, as it).
    Graph(StepGraph),
    /// The step ran eagerly; why it could not be captured.
    FellBack(String),
}

/// A captured step, replayed after each shadow run that matches it ([`self`]'s docs).
pub struct StepGraph {
    device: Arc<CudaDevice>,
    /// The tape and its graphs (with the device while a shadow run uses them).
    tape: Option<Tape>,
    replays: u64,
}

impl StepGraph {
    /// Before the step's host code: from here its work is compared with the captured step
    /// instead of queued. Waits for the last replay (whose inputs are rewritten now).
    pub fn begin_step(&mut self) -> Result<(), CudaError> {
        let tape = self
            .tape
            .take()
            .ok_or_else(|| CudaError::Unsupported("begin_step twice without end_step".into()))?;
        self.device.synchronize()?;
        self.device
            .allocator
            .lock()
            .expect("allocator")
            .begin_graph_replay();
        self.device.start_recording(Recording::Shadow {
            tape,
            next: 0,
            start: 0,
            segment: 0,
            paused: 0,
        });
        Ok(())
    }

    /// After the step's host code: launches the last segment's graph if the step matched
    /// the captured one whole (`None`), else returns why it ran eagerly instead.
    pub fn end_step(&mut self) -> Result<Option<String>, CudaError> {
        let device = self.device.clone();
        match device.stop_recording() {
            Recording::Shadow {
                tape,
                next,
                segment,
                paused: 0,
                ..
            } if next == tape.ops.len() => {
                let launched = match &tape.graphs[segment] {
                    Some(graph) => graph.launch(),
                    None => Ok(()),
                };
                self.tape = Some(tape);
                launched.map_err(|e| CudaError::driver("replaying the captured step", e))?;
                self.replays += 1;
                Ok(None)
            }
            Recording::Shadow {
                tape, next, start, ..
            } => {
                let issued = tape.issue(&device, start..next, None);
                let total = tape.ops.len();
                self.tape = Some(tape);
                issued?;
                Ok(Some(format!(
                    "the step ended after {next} of the captured step's {total} pieces"
                )))
            }
            Recording::FellBack { tape, reason } => {
                self.tape = Some(tape);
                Ok(Some(reason))
            }
            Recording::Off | Recording::Capturing { .. } => {
                Err(CudaError::Unsupported("end_step without begin_step".into()))
            }
        }
    }

    /// How many times the step was replayed (after its captured run).
    pub fn replays(&self) -> u64 {
        self.replays
    }

    /// How many pieces of work (kernels, products, copies, memsets, uploads) one replay
    /// runs, and in how many graphs (segments between the step's reads and waits).
    pub fn pieces(&self) -> (usize, usize) {
        self.tape.as_ref().map_or((0, 0), |t| {
            let between = t.ops.iter().filter(|o| matches!(o, Op::Between { .. }));
            (t.ops.len() - between.count(), t.graphs.len())
        })
    }
}

impl Drop for StepGraph {
    fn drop(&mut self) {
        let device = self.device.clone();
        // A step left between begin_step and end_step (an error) stops being shadowed.
        if self.tape.is_none() {
            if let Recording::Shadow { tape, .. } | Recording::FellBack { tape, .. } =
                device.stop_recording()
            {
                self.tape = Some(tape);
            }
        }
        // The graphs' work must be done before their blocks serve others and their pinned
        // inputs are freed.
        let _ = device.synchronize();
        device
            .allocator
            .lock()
            .expect("allocator")
            .drop_graph_pool();
        let _ = device.bind();
        self.tape = None;
    }
}
