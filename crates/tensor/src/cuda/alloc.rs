//! The caching device allocator: freed blocks are kept and handed out again, so a training
//! loop that allocates the same activation shapes every step calls `cuMemAlloc` only in its
//! first step (PyTorch's caching allocator does the same; `cuMemAlloc`/`cuMemFree` cost
//! tens of microseconds each and `cuMemFree` synchronises the device).
//!
//! All of meshtrain's device work runs on one stream per device, so a block freed by the host
//! while kernels that use it are still queued may be handed to the next allocation at once:
//! whatever the new owner queues runs after those kernels (stream order).
//!
//! A captured CUDA graph ([`super::graph`]) replays its kernels on the addresses they had when
//! it was captured, whenever it is launched: the blocks its work touches must never be handed
//! to other work. They form the graph's pool: blocks handed out or freed while capturing go
//! back to the pool, not to the shared cache, and each later run of the step (before a
//! replay) gets the same blocks again, in the same order, or learns that it cannot.
//!
//! The bookkeeping is plain host code over a [`RawMemory`], so it is unit-tested without a GPU.

use std::collections::{BTreeMap, HashSet};

/// Sizes below this are rounded up to a multiple of [`SMALL_GRAIN`]; larger ones to a
/// multiple of [`LARGE_GRAIN`] (few distinct classes, so freed blocks fit later requests).
pub const SMALL_LIMIT: usize = 1 << 20;
pub const SMALL_GRAIN: usize = 512;
pub const LARGE_GRAIN: usize = 2 << 20;

/// Every block starts at a multiple of this (16-byte vector accesses, cuBLASLt's preferred
/// 256-byte alignment).
pub const ALIGNMENT: usize = 256;

/// The size class a request of `bytes` is served from.
pub fn size_class(bytes: usize) -> usize {
    let bytes = bytes.max(1);
    if bytes < SMALL_LIMIT {
        bytes.div_ceil(SMALL_GRAIN) * SMALL_GRAIN
    } else {
        bytes.div_ceil(LARGE_GRAIN) * LARGE_GRAIN
    }
}

/// Where the allocator gets memory from: the driver on a GPU, a fake in tests.
pub trait RawMemory {
    /// A new block of exactly `bytes`, or `None` when the device has no room.
    fn alloc(&mut self, bytes: usize) -> Option<u64>;
    fn free(&mut self, ptr: u64, bytes: usize);
    /// (free, total) bytes of the device, for error messages.
    fn info(&self) -> (usize, usize);
}

/// A block handed out by the allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    pub ptr: u64,
    /// The block's size class (what it occupies), at least the bytes asked for.
    pub class: usize,
}

/// An allocation the device could not serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfMemory {
    pub what: String,
    pub bytes: usize,
    /// Bytes in use by live tensors when it failed.
    pub in_use: usize,
    /// The device's free and total bytes after the cache was emptied.
    pub free: usize,
    pub total: usize,
    /// A configured limit (`train.memory_limit_mb`) that refused it, if that was the cause.
    pub limit: Option<usize>,
}

impl std::fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        match self.limit {
            Some(limit) => write!(
                f,
                "out of device memory: {} needs {:.1} MiB, but {:.1} MiB are in use and the \
                 memory limit is {:.1} MiB",
                self.what,
                mib(self.bytes),
                mib(self.in_use),
                mib(limit)
            ),
            None => write!(
                f,
                "out of device memory: {} needs {:.1} MiB; {:.1} MiB are in use by this run, \
                 {:.1} MiB of the device's {:.1} MiB are free",
                self.what,
                mib(self.bytes),
                mib(self.in_use),
                mib(self.free),
                mib(self.total)
            ),
        }
    }
}

/// What the allocator has done: reported in the run summary and the step breakdown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryStats {
    /// Bytes held by live tensors and buffers (size classes, so a little above the sum of
    /// the tensors' own sizes).
    pub in_use: usize,
    /// The most `in_use` has been since the start or the last [`CachingAllocator::reset_peak`].
    pub peak_in_use: usize,
    /// Freed blocks kept for reuse.
    pub cached: usize,
    /// Calls to the driver's allocation function (flat in the steady state).
    pub device_allocs: u64,
    /// Requests served from the cache.
    pub reuses: u64,
}

/// The caching allocator over a [`RawMemory`].
pub struct CachingAllocator<R: RawMemory> {
    raw: R,
    /// Freed blocks by size class.
    free: BTreeMap<usize, Vec<u64>>,
    stats: MemoryStats,
    /// Refuse to hold more than this many bytes in use (the run's memory limit).
    limit: Option<usize>,
    /// The blocks of the device's captured graph, while there is one.
    graph: Option<GraphPool>,
}

/// The blocks a captured graph's work touches ([`CachingAllocator::begin_graph_capture`]).
#[derive(Default)]
struct GraphPool {
    /// Every block of the graph: handed out while capturing, or freed while capturing
    /// (allocated before, the captured work may read it).
    owned: HashSet<u64>,
    /// The graph's blocks no tensor holds now, by size class.
    free: BTreeMap<usize, Vec<u64>>,
    /// The blocks handed out while capturing, in order: what a replayed step gets.
    handed: Vec<Block>,
    phase: GraphPhase,
}

#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum GraphPhase {
    /// Allocations are recorded (and served from the pool first).
    #[default]
    Capturing,
    /// Allocation `next` of a step that is to be replayed gets `handed[next]`.
    Replaying { next: usize },
    /// Neither: allocations come from the shared cache; the graph's blocks still return to
    /// its pool.
    Idle,
}

impl<R: RawMemory> CachingAllocator<R> {
    pub fn new(raw: R) -> Self {
        CachingAllocator {
            raw,
            free: BTreeMap::new(),
            stats: MemoryStats::default(),
            limit: None,
            graph: None,
        }
    }

    /// Refuse allocations that would take the bytes in use past `limit` (`None`: the
    /// device's memory is the limit).
    pub fn set_limit(&mut self, limit: Option<usize>) {
        self.limit = limit;
    }

    pub fn stats(&self) -> MemoryStats {
        self.stats
    }

    pub fn reset_peak(&mut self) {
        self.stats.peak_in_use = self.stats.in_use;
    }

    /// A block of at least `bytes`; `what` names the allocation in the error.
    pub fn allocate(&mut self, bytes: usize, what: &str) -> Result<Block, OutOfMemory> {
        let class = size_class(bytes);
        if let Some(limit) = self.limit {
            if self.stats.in_use + class > limit {
                let (free, total) = self.raw.info();
                return Err(OutOfMemory {
                    what: what.to_string(),
                    bytes,
                    in_use: self.stats.in_use,
                    free,
                    total,
                    limit: Some(limit),
                });
            }
        }
        let capturing = self
            .graph
            .as_ref()
            .is_some_and(|g| g.phase == GraphPhase::Capturing);
        // While capturing, the graph's own freed blocks first (its work is ordered on the
        // one stream, as every block reuse is).
        let from_graph = self
            .graph
            .as_mut()
            .filter(|_| capturing)
            .and_then(|g| g.free.get_mut(&class))
            .and_then(Vec::pop);
        let reused = from_graph.or_else(|| self.free.get_mut(&class).and_then(Vec::pop));
        let ptr = match reused {
            Some(ptr) => {
                self.stats.cached -= class;
                self.stats.reuses += 1;
                ptr
            }
            None => self.fresh(class, bytes, what)?,
        };
        if let Some(g) = self.graph.as_mut().filter(|_| capturing) {
            g.owned.insert(ptr);
            g.handed.push(Block { ptr, class });
        }
        self.stats.in_use += class;
        self.stats.peak_in_use = self.stats.peak_in_use.max(self.stats.in_use);
        Ok(Block { ptr, class })
    }

    /// A block from the device; when it is full, the cache is given back first and the
    /// request tried again (freed blocks of other sizes are what usually fills it).
    fn fresh(&mut self, class: usize, bytes: usize, what: &str) -> Result<u64, OutOfMemory> {
        if let Some(ptr) = self.raw.alloc(class) {
            self.stats.device_allocs += 1;
            return Ok(ptr);
        }
        // Not while a graph is being captured: freeing device memory then is refused (a
        // captured graph may use any block later).
        if self.graph.is_none() {
            self.empty_cache();
        }
        if let Some(ptr) = self.raw.alloc(class) {
            self.stats.device_allocs += 1;
            return Ok(ptr);
        }
        let (free, total) = self.raw.info();
        Err(OutOfMemory {
            what: what.to_string(),
            bytes,
            in_use: self.stats.in_use,
            free,
            total,
            limit: None,
        })
    }

    /// Takes a block back into the cache (the graph's pool, for a block of the graph's).
    pub fn release(&mut self, block: Block) {
        self.stats.in_use -= block.class;
        self.stats.cached += block.class;
        if let Some(g) = &mut self.graph {
            if g.phase == GraphPhase::Capturing {
                g.owned.insert(block.ptr);
            }
            if g.owned.contains(&block.ptr) {
                g.free.entry(block.class).or_default().push(block.ptr);
                return;
            }
        }
        self.free.entry(block.class).or_default().push(block.ptr);
    }

    /// A graph is being captured from now on: its blocks are recorded and kept for it. One
    /// graph at a time (a second capture first drops the first's pool).
    pub fn begin_graph_capture(&mut self) {
        self.drop_graph_pool();
        self.graph = Some(GraphPool::default());
    }

    /// The capture ended (the graph exists): allocations come from the shared cache again
    /// until a replayed step begins.
    pub fn end_graph_capture(&mut self) {
        if let Some(g) = &mut self.graph {
            g.phase = GraphPhase::Idle;
        }
    }

    /// A step that is to be replayed runs its host code: its allocations get the captured
    /// blocks, in order ([`CachingAllocator::replay_allocation`]).
    pub fn begin_graph_replay(&mut self) {
        if let Some(g) = &mut self.graph {
            g.phase = GraphPhase::Replaying { next: 0 };
        }
    }

    /// The next allocation of a replayed step: the block the capture handed out at this
    /// point, if it is of `bytes`' class and free; else why not (the step differs from the
    /// captured one, and runs eagerly).
    pub fn replay_allocation(&mut self, bytes: usize) -> Result<Block, String> {
        let class = size_class(bytes);
        let Some(g) = &mut self.graph else {
            return Err("the graph's memory is gone".into());
        };
        let GraphPhase::Replaying { next } = g.phase else {
            return Err("no step is being replayed".into());
        };
        let Some(&expected) = g.handed.get(next) else {
            return Err(format!(
                "it allocates more than the {} blocks the captured step did",
                g.handed.len()
            ));
        };
        if expected.class != class {
            return Err(format!(
                "its allocation {next} is of {class} bytes, the captured step's of {}",
                expected.class
            ));
        }
        let free = g.free.get_mut(&class);
        let Some(at) = free
            .as_ref()
            .and_then(|f| f.iter().position(|&p| p == expected.ptr))
        else {
            return Err(format!(
                "the block of its allocation {next} is still held (a tensor of the last step \
                 outlived it)"
            ));
        };
        free.expect("found above").swap_remove(at);
        g.phase = GraphPhase::Replaying { next: next + 1 };
        self.stats.in_use += class;
        self.stats.cached -= class;
        self.stats.reuses += 1;
        self.stats.peak_in_use = self.stats.peak_in_use.max(self.stats.in_use);
        Ok(expected)
    }

    /// The replayed step's host code ended, or it fell back to running eagerly: allocations
    /// come from the shared cache again.
    pub fn end_graph_replay(&mut self) {
        self.end_graph_capture();
    }

    /// The graph is gone (its work done): its free blocks join the shared cache, and its
    /// held ones will when released.
    pub fn drop_graph_pool(&mut self) {
        if let Some(g) = self.graph.take() {
            for (class, ptrs) in g.free {
                self.free.entry(class).or_default().extend(ptrs);
            }
        }
    }

    /// Returns every cached block to the device.
    pub fn empty_cache(&mut self) {
        for (class, ptrs) in std::mem::take(&mut self.free) {
            for ptr in ptrs {
                self.raw.free(ptr, class);
            }
        }
        self.stats.cached = 0;
    }

    pub fn raw(&self) -> &R {
        &self.raw
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device of `capacity` bytes handing out increasing addresses.
    struct FakeMemory {
        capacity: usize,
        used: usize,
        next: u64,
        live: std::collections::HashMap<u64, usize>,
    }

    impl FakeMemory {
        fn new(capacity: usize) -> Self {
            FakeMemory {
                capacity,
                used: 0,
                next: 1 << 20,
                live: Default::default(),
            }
        }
    }

    impl RawMemory for FakeMemory {
        fn alloc(&mut self, bytes: usize) -> Option<u64> {
            if self.used + bytes > self.capacity {
                return None;
            }
            self.used += bytes;
            let ptr = self.next;
            self.next += bytes.div_ceil(ALIGNMENT) as u64 * ALIGNMENT as u64;
            self.live.insert(ptr, bytes);
            Some(ptr)
        }
        fn free(&mut self, ptr: u64, bytes: usize) {
            assert_eq!(
                self.live.remove(&ptr),
                Some(bytes),
                "freed what was not allocated"
            );
            self.used -= bytes;
        }
        fn info(&self) -> (usize, usize) {
            (self.capacity - self.used, self.capacity)
        }
    }

    #[test]
    fn size_classes_round_up_and_stay_aligned() {
        assert_eq!(size_class(0), 512);
        assert_eq!(size_class(1), 512);
        assert_eq!(size_class(512), 512);
        assert_eq!(size_class(513), 1024);
        assert_eq!(size_class((1 << 20) - 1), 1 << 20);
        assert_eq!(size_class(1 << 20), 2 << 20);
        assert_eq!(size_class((2 << 20) + 1), 4 << 20);
        for b in [1, 700, 5000, 3 << 20, 1_650_000_000] {
            let c = size_class(b);
            assert!(c >= b && c.is_multiple_of(ALIGNMENT), "{b} -> {c}");
        }
    }

    #[test]
    fn the_steady_state_reuses_blocks_without_device_allocations() {
        let mut a = CachingAllocator::new(FakeMemory::new(1 << 30));
        // One "step": a few activations of different sizes, then all freed.
        let step = |a: &mut CachingAllocator<FakeMemory>| {
            let blocks: Vec<Block> = [4096usize, 100_000, 3 << 20, 4096]
                .iter()
                .map(|&b| a.allocate(b, "activation").unwrap())
                .collect();
            for b in blocks {
                a.release(b);
            }
        };
        step(&mut a);
        let first = a.stats();
        assert_eq!(first.device_allocs, 4);
        assert_eq!(first.in_use, 0);
        for _ in 0..10 {
            step(&mut a);
        }
        let s = a.stats();
        assert_eq!(
            s.device_allocs, 4,
            "no device allocation after the first step"
        );
        assert_eq!(s.reuses, 40);
        assert_eq!(
            s.peak_in_use,
            2 * 4096 + size_class(100_000) + size_class(3 << 20)
        );
        assert_eq!(s.cached, s.peak_in_use);
    }

    #[test]
    fn peak_and_in_use_follow_live_blocks() {
        let mut a = CachingAllocator::new(FakeMemory::new(1 << 30));
        let x = a.allocate(1000, "x").unwrap();
        let y = a.allocate(3000, "y").unwrap();
        assert_eq!(a.stats().in_use, 1024 + 3072);
        a.release(x);
        assert_eq!(a.stats().in_use, 3072);
        assert_eq!(a.stats().peak_in_use, 4096);
        a.reset_peak();
        assert_eq!(a.stats().peak_in_use, 3072);
        a.release(y);
        assert_eq!((a.stats().in_use, a.stats().cached), (0, 4096));
        a.empty_cache();
        assert_eq!(a.stats().cached, 0);
        assert_eq!(a.raw().used, 0, "every block went back to the device");
    }

    #[test]
    fn a_full_device_gives_back_the_cache_then_names_the_allocation() {
        let mut a = CachingAllocator::new(FakeMemory::new(8 << 20));
        let x = a.allocate(3 << 20, "x").unwrap(); // a 4 MiB class
        a.release(x); // cached, still held from the device
                      // 6 MiB does not fit beside the cached 4 MiB: the cache is emptied and it fits.
        let y = a.allocate(5 << 20, "y").unwrap();
        assert_eq!(a.stats().cached, 0);
        let e = a.allocate(5 << 20, "blocks.3 fc1 output").unwrap_err();
        assert_eq!(e.limit, None);
        assert_eq!(e.in_use, 6 << 20);
        assert_eq!((e.free, e.total), (2 << 20, 8 << 20));
        let text = e.to_string();
        assert!(text.contains("blocks.3 fc1 output needs 5.0 MiB"), "{text}");
        assert!(text.contains("6.0 MiB are in use"), "{text}");
        assert!(
            text.contains("2.0 MiB of the device's 8.0 MiB are free"),
            "{text}"
        );
        a.release(y);
    }

    #[test]
    fn a_graphs_blocks_stay_its_own_and_a_replayed_step_gets_them_in_order() {
        let mut a = CachingAllocator::new(FakeMemory::new(1 << 30));
        let before = a.allocate(4096, "before the capture").unwrap();
        a.begin_graph_capture();
        let x = a.allocate(4096, "x").unwrap();
        let y = a.allocate(100_000, "y").unwrap();
        a.release(x);
        // Reused within the capture (stream order), and freed-while-capturing blocks (the
        // graph may read them) become the graph's.
        let z = a.allocate(4096, "z").unwrap();
        assert_eq!(z, x);
        a.release(before);
        a.release(z);
        a.release(y);
        a.end_graph_capture();
        // Eager work between replays never gets the graph's blocks.
        let eager = a.allocate(4096, "eager").unwrap();
        assert!(![x.ptr, y.ptr, before.ptr].contains(&eager.ptr));
        a.release(eager);
        // A replayed step gets the captured blocks in the captured order.
        a.begin_graph_replay();
        assert_eq!(a.replay_allocation(4096), Ok(x));
        assert_eq!(a.replay_allocation(100_000), Ok(y));
        let e = a.replay_allocation(4096).unwrap_err();
        assert!(e.contains("still held"), "{e}");
        a.release(x);
        assert_eq!(a.replay_allocation(4000), Ok(x));
        let e = a.replay_allocation(4096).unwrap_err();
        assert!(e.contains("more than the 3 blocks"), "{e}");
        a.end_graph_replay();
        a.release(x);
        a.release(y);
        // A step of another shape is told apart at its first allocation.
        a.begin_graph_replay();
        let e = a.replay_allocation(8192).unwrap_err();
        assert!(e.contains("8192 bytes, the captured step's of 4096"), "{e}");
        a.end_graph_replay();
        // The graph dropped: its blocks serve everyone again, and the counts add up.
        a.drop_graph_pool();
        assert_eq!(a.stats().in_use, 0);
        // x, before, the eager block and y.
        assert_eq!(a.stats().cached, 3 * 4096 + size_class(100_000));
        let mut again: Vec<Block> = (0..3).map(|_| a.allocate(4096, "after").unwrap()).collect();
        again.sort_by_key(|b| b.ptr);
        let mut expected = vec![x.ptr, before.ptr, eager.ptr];
        expected.sort();
        assert_eq!(again.iter().map(|b| b.ptr).collect::<Vec<_>>(), expected);
        assert_eq!(a.stats().device_allocs, 4, "all three from the cache");
        for b in again {
            a.release(b);
        }
        a.empty_cache();
        assert_eq!(a.raw().used, 0);
    }

    #[test]
    fn a_memory_limit_refuses_before_the_device_does() {
        let mut a = CachingAllocator::new(FakeMemory::new(1 << 30));
        a.set_limit(Some(4 << 20));
        let x = a.allocate(3 << 20, "x").unwrap();
        let e = a.allocate(1 << 20, "logits").unwrap_err();
        assert_eq!(e.limit, Some(4 << 20));
        assert!(e.to_string().contains("memory limit is 4.0 MiB"), "{e}");
        a.release(x);
        assert!(a.allocate(1 << 20, "logits").is_ok());
    }
}
