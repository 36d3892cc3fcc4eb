//! Incremental decoding's device operations (`kernels/decode.cu`): the new tokens' keys and
//! values appended to a layer's key/value cache, and their causal attention over it. What
//! `meshtrain generate --device cuda` runs beside the layers' own operations ([`super::ops`]);
//! f32 only (decoding runs in f32).
//!
//! The layouts are the CPU decoder's: `qkv` holds the new rows' `[Q | K | V]`
//! (`[rows, 3·heads·head_dim]`, a Llama's after the rotary pass), the cache `[positions,
//! kv_heads·head_dim]` for keys and for values, so grouped-query attention's memory saving is
//! the cache's. Query head `h` reads key/value head `h / (heads / kv_heads)`.

use super::context::{Args, Launch};
use super::error::CudaError;
use super::CudaTensor;
use crate::DType;

/// Threads of an attention block (one block per query head and new row).
const ATTN_THREADS: usize = 128;
/// The most dynamic shared memory an attention block may ask for: what an A100 (163 KiB) and
/// an H100 (227 KiB) both give a block, less room for the kernel's own.
const MAX_SMEM: usize = 160 << 10;

/// The shape of one decoding pass: the CPU twin's ([`CachedShape`]): `rows` new tokens at
/// positions `start..start + rows`.
pub use crate::attention::CachedShape as DecodeShape;

fn check(s: &DecodeShape) -> Result<(), CudaError> {
    let DecodeShape {
        rows,
        heads,
        kv_heads,
        head_dim,
        ..
    } = *s;
    if rows == 0 || head_dim == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(CudaError::Unsupported(format!(
            "decoding {rows} rows of {heads} query heads over {kv_heads} key/value heads of \
             {head_dim} values: rows and heads must be positive, the query heads a \
             multiple of the key/value heads"
        )));
    }
    if rows > 65_535 || heads > 65_535 {
        return Err(CudaError::Unsupported(format!(
            "decoding {rows} rows of {heads} heads: at most 65535 of each per pass"
        )));
    }
    super::ops::window_arg(s.window, s.start + s.rows)?;
    Ok(())
}

/// Dynamic shared memory (bytes) of the attention over `positions` cached positions (the
/// query, the scores, the partial sums: `kernels/decode.cu`).
pub fn attention_smem(positions: usize, head_dim: usize) -> usize {
    (head_dim + positions + ATTN_THREADS.max(head_dim)) * 4
}

/// The longest context the attention kernel takes at `head_dim` (its scores live in shared
/// memory): a decoder checks its model's context against it before any work.
pub fn max_positions(head_dim: usize) -> usize {
    (MAX_SMEM / 4).saturating_sub(head_dim + ATTN_THREADS.max(head_dim))
}

fn check_f32(t: &CudaTensor, len: usize, what: &str) -> Result<(), CudaError> {
    if t.dtype() != DType::F32 || t.len() < len {
        return Err(CudaError::Unsupported(format!(
            "{what}: {len} f32 values needed, the tensor has {} {}",
            t.len(),
            t.dtype()
        )));
    }
    Ok(())
}

/// Writes the new rows' key/value heads (the K and V heads `j·(heads/kv_heads)` of each
/// `[Q | K | V]` row) into the cache at positions `start..start + rows`.
pub fn append_kv(
    qkv: &CudaTensor,
    keys: &CudaTensor,
    values: &CudaTensor,
    shape: DecodeShape,
) -> Result<(), CudaError> {
    check(&shape)?;
    check_f32(
        qkv,
        shape.rows * shape.qkv_width(),
        "decoding's [Q | K | V] rows",
    )?;
    let cached = (shape.start + shape.rows) * shape.kv_width();
    check_f32(keys, cached, "the key cache")?;
    check_f32(values, cached, "the value cache")?;
    let n = shape.rows * shape.kv_width();
    qkv.device().launch(
        "decode.cu",
        "decode_append_kv_f32",
        Launch::grid_stride(n, 256, 132 * 32),
        Args::new()
            .ptr(qkv.ptr())
            .ptr(keys.ptr())
            .ptr(values.ptr())
            .usize_as_i32(shape.rows)
            .usize_as_i32(shape.start)
            .usize_as_i32(shape.heads)
            .usize_as_i32(shape.kv_heads)
            .usize_as_i32(shape.head_dim),
    )
}

/// Causal attention of the new rows' queries over the cache (which must already hold the new
/// rows: [`append_kv`] first): row `i` meets positions `0..=start + i`, or the last
/// `shape.window` of them. Returns `[rows, heads·head_dim]` f32, softmax scale `1/√head_dim`.
pub fn attention(
    qkv: &CudaTensor,
    keys: &CudaTensor,
    values: &CudaTensor,
    shape: DecodeShape,
) -> Result<CudaTensor, CudaError> {
    check(&shape)?;
    let positions = shape.start + shape.rows;
    if positions > max_positions(shape.head_dim) {
        return Err(CudaError::Unsupported(format!(
            "decoding attention over {positions} positions at head size {}: the kernel keeps \
             a row's scores in shared memory, which holds at most {}",
            shape.head_dim,
            max_positions(shape.head_dim)
        )));
    }
    check_f32(
        qkv,
        shape.rows * shape.qkv_width(),
        "decoding's [Q | K | V] rows",
    )?;
    check_f32(keys, positions * shape.kv_width(), "the key cache")?;
    check_f32(values, positions * shape.kv_width(), "the value cache")?;
    let dev = qkv.device();
    let out = CudaTensor::alloc(
        dev,
        shape.rows * shape.heads * shape.head_dim,
        DType::F32,
        "decoding attention's output",
    )?;
    dev.launch(
        "decode.cu",
        "decode_attn_f32",
        Launch {
            grid: (shape.heads as u32, shape.rows as u32, 1),
            block: (ATTN_THREADS as u32, 1, 1),
            smem: attention_smem(positions, shape.head_dim) as u32,
        },
        Args::new()
            .ptr(qkv.ptr())
            .ptr(keys.ptr())
            .ptr(values.ptr())
            .ptr(out.ptr())
            .usize_as_i32(shape.rows)
            .usize_as_i32(shape.start)
            .usize_as_i32(shape.heads)
            .usize_as_i32(shape.kv_heads)
            .usize_as_i32(shape.head_dim)
            .f32(1.0 / (shape.head_dim as f32).sqrt())
            .i32(super::ops::window_arg(shape.window, positions)?),
    )?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::probe::gpu_available;
    use crate::cuda::CudaDevice;
    use crate::rng::SplitMix64;

    #[test]
    fn shared_memory_and_the_longest_context() {
        // q, 130 scores, 128 partial sums.
        assert_eq!(attention_smem(130, 64), (64 + 130 + 128) * 4);
        // Wide heads: as many partial sums as values.
        assert_eq!(attention_smem(1, 256), (256 + 1 + 256) * 4);
        for hd in [8, 32, 64, 128, 256] {
            let most = max_positions(hd);
            assert!(attention_smem(most, hd) <= MAX_SMEM, "{hd}");
            assert!(attention_smem(most + 1, hd) > MAX_SMEM, "{hd}");
            assert!(most > 32_000, "{hd}: {most}");
        }
        let s = DecodeShape {
            rows: 1,
            start: 0,
            heads: 6,
            kv_heads: 4,
            head_dim: 64,
            window: None,
        };
        assert!(check(&s).is_err(), "6 query heads over 4 key/value heads");
        assert!(check(&DecodeShape { kv_heads: 2, ..s }).is_ok());
        let windowed = |window| DecodeShape {
            kv_heads: 2,
            window,
            ..s
        };
        assert!(check(&windowed(Some(8))).is_ok());
        assert!(check(&windowed(Some(0))).is_err());
        assert!(check(&DecodeShape { rows: 0, ..s }).is_err());
    }

    /// The kernels against a double-precision reference on a GPU: skipped without one,
    /// required with `MESHTRAIN_REQUIRE_GPU=1`.
    #[test]
    fn append_and_attention_match_a_double_reference_on_a_gpu() {
        if !gpu_available() {
            assert!(
                std::env::var("MESHTRAIN_REQUIRE_GPU").as_deref() != Ok("1"),
                "MESHTRAIN_REQUIRE_GPU=1 but no usable CUDA GPU"
            );
            eprintln!("skipped: no CUDA GPU (the driver or a device is missing)");
            return;
        }
        let dev = CudaDevice::get(0).unwrap();
        let mut rng = SplitMix64::new(5);
        let mut random = |n: usize, spread: f64| -> Vec<f32> {
            (0..n)
                .map(|_| ((rng.next_f64() * 2.0 - 1.0) * spread) as f32)
                .collect()
        };
        for (heads, kv_heads, head_dim) in [(4, 4, 32), (8, 2, 64), (6, 2, 128), (4, 2, 8)] {
            for (start, rows, window) in [
                (0, 1, None),
                (6, 1, None),
                (129, 1, None),
                (0, 7, None),
                (123, 7, None),
                (129, 1, Some(5)),
                (123, 7, Some(3)),
            ] {
                let s = DecodeShape {
                    rows,
                    start,
                    heads,
                    kv_heads,
                    head_dim,
                    window,
                };
                let (kvw, total) = (s.kv_width(), start + rows);
                let qkv_h = random(rows * s.qkv_width(), 1.0);
                let mut k_h = random(total * kvw, 2.0);
                let mut v_h = random(total * kvw, 1.0);
                let qkv = CudaTensor::from_host(&dev, &qkv_h, DType::F32).unwrap();
                let keys = CudaTensor::from_host(&dev, &k_h, DType::F32).unwrap();
                let values = CudaTensor::from_host(&dev, &v_h, DType::F32).unwrap();
                append_kv(&qkv, &keys, &values, s).unwrap();
                let out = attention(&qkv, &keys, &values, s)
                    .unwrap()
                    .to_host_f32()
                    .unwrap();
                let g = heads / kv_heads;
                for i in 0..rows {
                    for j in 0..kv_heads {
                        let at = (start + i) * kvw + j * head_dim;
                        let row = &qkv_h[i * s.qkv_width()..];
                        k_h[at..at + head_dim]
                            .copy_from_slice(&row[(heads + j * g) * head_dim..][..head_dim]);
                        v_h[at..at + head_dim]
                            .copy_from_slice(&row[(2 * heads + j * g) * head_dim..][..head_dim]);
                    }
                }
                assert_eq!(keys.to_host_f32().unwrap(), k_h, "{s:?}: keys");
                assert_eq!(values.to_host_f32().unwrap(), v_h, "{s:?}: values");
                let (mut num, mut den) = (0.0f64, 0.0f64);
                for i in 0..rows {
                    for h in 0..heads {
                        let q = &qkv_h[i * s.qkv_width() + h * head_dim..][..head_dim];
                        let kv = (h / g) * head_dim;
                        let len = start + i + 1;
                        let first = window.map_or(0, |w: usize| len.saturating_sub(w));
                        let scores: Vec<f64> = (first..len)
                            .map(|p| {
                                let k = &k_h[p * kvw + kv..][..head_dim];
                                q.iter()
                                    .zip(k)
                                    .map(|(&a, &b)| a as f64 * b as f64)
                                    .sum::<f64>()
                                    / (head_dim as f64).sqrt()
                            })
                            .collect();
                        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                        let l: f64 = w.iter().sum();
                        for d in 0..head_dim {
                            let want = (first..len)
                                .map(|p| w[p - first] * v_h[p * kvw + kv + d] as f64)
                                .sum::<f64>()
                                / l;
                            let got = out[(i * heads + h) * head_dim + d] as f64;
                            num += (got - want).powi(2);
                            den += want * want;
                        }
                    }
                }
                let e = (num / den).sqrt();
                assert!(e < 1e-5, "{s:?}: relative L2 {e:e}");
            }
        }
    }
}
