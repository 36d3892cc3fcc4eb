//! The key/value cache a causal model's layers read and extend when they generate text,
//! handed through [`crate::Layer::forward_cached`] as `transformers` hands `past_key_values`
//! through its models' forward.
//!
//! Why a cache: a causal model's hidden states at a position depend only on the tokens up to
//! it, so the keys and values every attention layer computed for earlier positions never
//! change while text grows. Keeping them makes a new token cost one row through every layer
//! plus its attention over the cache, `O(params + t·dim)`, where a forward over the window
//! costs `O(t · params + t²·dim)`.
//!
//! The cache holds, per attention layer in the order a forward meets them, the keys and
//! values of `len` positions of one sequence: `[positions, kv_heads · head_dim]` each (a
//! Llama's keys already rotated), so grouped-query attention's memory saving is the cache's.
//! It lives where the model runs: host vectors, or device buffers with room for the whole
//! context (allocated by the first pass on a GPU).

#[cfg(feature = "cuda")]
use meshtrain_tensor::cuda::CudaTensor;

/// One attention layer's cached keys and values.
pub enum LayerKv {
    /// `[len, kv_width]` each, growing as positions are added.
    Host { keys: Vec<f32>, values: Vec<f32> },
    /// `[capacity, kv_width]` f32 each; positions past the cache's `len` are stale.
    #[cfg(feature = "cuda")]
    Device {
        keys: CudaTensor,
        values: CudaTensor,
    },
}

/// The keys and values of every attention layer of a model for the first [`KvCache::len`]
/// positions of one sequence, and where a pass's new rows begin.
pub struct KvCache {
    /// The longest context the cache takes (the model's).
    capacity: usize,
    /// Positions whose keys and values every layer holds.
    len: usize,
    /// New rows of the pass under way (they sit at positions `len..len + rows`).
    rows: usize,
    /// Per attention layer: its store, and its values per position (keys or values).
    layers: Vec<(LayerKv, usize)>,
    /// The next attention layer's slot in the pass under way.
    cursor: usize,
}

impl KvCache {
    /// An empty cache for up to `capacity` positions.
    pub fn new(capacity: usize) -> Self {
        KvCache {
            capacity,
            len: 0,
            rows: 0,
            layers: Vec::new(),
            cursor: 0,
        }
    }

    /// Positions held: the next pass's rows begin at this position.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The longest context it takes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The position of the first row of the pass under way.
    pub fn start(&self) -> usize {
        self.len
    }

    /// The new rows of the pass under way.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Drops the positions from `len` on (a host cache frees them; a device cache keeps
    /// its room, its later positions written before they are read).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        for (layer, width) in &mut self.layers {
            match layer {
                LayerKv::Host { keys, values } => {
                    keys.truncate(self.len * *width);
                    values.truncate(self.len * *width);
                }
                #[cfg(feature = "cuda")]
                LayerKv::Device { .. } => {}
            }
        }
    }

    /// The f32 values held: every layer's keys and values of every position held.
    pub fn values_held(&self) -> usize {
        2 * self.len * self.layers.iter().map(|(_, w)| w).sum::<usize>()
    }

    /// Starts a pass of `rows` new rows at positions `len..`; fails (naming both) when they
    /// do not fit the capacity.
    pub fn begin(&mut self, rows: usize) -> Result<(), String> {
        if self.len + rows > self.capacity {
            return Err(format!(
                "{rows} new positions after {} cached: past the context of {}",
                self.len, self.capacity
            ));
        }
        // A pass that failed midway may have appended rows: the held positions are all.
        self.truncate(self.len);
        self.rows = rows;
        self.cursor = 0;
        Ok(())
    }

    /// Ends the pass: its rows are cached positions now. A model whose attention layers
    /// did not all take their slot (another model than the cache's) is a programming error.
    pub fn end(&mut self) {
        assert!(
            self.cursor == self.layers.len(),
            "a pass met {} attention layers, the cache holds {}",
            self.cursor,
            self.layers.len()
        );
        self.len += self.rows;
        self.rows = 0;
    }

    /// The next attention layer's slot in this pass (`width` values per position), made by
    /// `make(capacity)` on the first pass.
    pub fn next_layer(
        &mut self,
        width: usize,
        make: impl FnOnce(usize) -> LayerKv,
    ) -> &mut LayerKv {
        if self.cursor == self.layers.len() {
            assert!(
                self.len == 0,
                "a pass met a new attention layer after {} cached positions",
                self.len
            );
            self.layers.push((make(self.capacity), width));
        }
        let (layer, held) = &mut self.layers[self.cursor];
        assert_eq!(*held, width, "attention layer {}: cache width", self.cursor);
        self.cursor += 1;
        layer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(cache: &mut KvCache, width: usize) -> (&mut Vec<f32>, &mut Vec<f32>) {
        match cache.next_layer(width, |_| LayerKv::Host {
            keys: Vec::new(),
            values: Vec::new(),
        }) {
            LayerKv::Host { keys, values } => (keys, values),
            #[cfg(feature = "cuda")]
            LayerKv::Device { .. } => unreachable!("a host cache"),
        }
    }

    /// Passes add their rows as positions; a pass that stopped midway leaves nothing behind
    /// at the next one; the context's end is refused with both counts.
    #[test]
    fn positions_are_counted_by_whole_passes() {
        let mut cache = KvCache::new(4);
        cache.begin(2).unwrap();
        let (k, v) = host(&mut cache, 3);
        k.extend([1.0; 6]);
        v.extend([2.0; 6]);
        cache.end();
        assert_eq!((cache.len(), cache.values_held()), (2, 12));
        // A pass that fails after appending its row, then a new pass from the same place.
        cache.begin(1).unwrap();
        host(&mut cache, 3).0.extend([9.0; 3]);
        cache.begin(1).unwrap();
        let (k, _) = host(&mut cache, 3);
        assert_eq!(k.len(), 6, "the failed pass's row is gone");
        let e = KvCache::new(4).begin(5).unwrap_err();
        assert!(
            e.contains("5 new positions") && e.contains("context of 4"),
            "{e}"
        );
        cache.truncate(1);
        assert_eq!((cache.len(), cache.values_held()), (1, 6));
    }
}
