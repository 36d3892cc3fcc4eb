//! SyncBatchNorm's reducer and layer against the single-worker computation.

use meshtrain_comm::{CommConfig, ThreadsWorld};
use meshtrain_nn::layers::BatchNorm2d;
use meshtrain_nn::{Layer, Mode, Params, ParamsMut, Saved, StatsReducer};
use meshtrain_parallel::data::GroupStatsReducer;
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::Tensor;
use std::sync::Arc;

#[test]
fn reducer_sums_exactly_in_rank_order_on_every_rank() {
    let out = ThreadsWorld::run(3, CommConfig::default(), |g| {
        let r = g.rank() as f64;
        let mut v = vec![1.0 + r, 1e-17 * (r + 1.0), -3.5 * r, f64::MAX / 4.0];
        GroupStatsReducer::new(g).sum(&mut v);
        Ok::<_, String>(v)
    })
    .unwrap();
    let expect = vec![6.0, 1e-17 + 2e-17 + 3e-17, -10.5, 3.0 * (f64::MAX / 4.0)];
    for v in out {
        assert_eq!(v, expect);
    }
}

/// Batch norm over [C, N·H·W] data split by sample across workers equals batch norm over the
/// whole batch: forward output and input gradient (scaled as DDP scales local losses).
#[test]
fn sync_batch_norm_equals_batch_norm_on_the_global_batch() {
    let (c, n, hw, world) = (3usize, 8usize, 5usize, 2usize);
    let mut rng = SplitMix64::new(4);
    let x: Vec<f32> = (0..c * n * hw).map(|_| rng.normal() * 2.0 + 1.0).collect();
    let dy: Vec<f32> = (0..c * n * hw).map(|_| rng.normal()).collect();
    let params = [1.5f32, 0.5, -1.0, 0.1, 0.2, 0.3];
    let bn = BatchNorm2d::new(c);
    let mut buffers = vec![0.0, 0.0, 0.0, 1.0, 1.0, 1.0];
    let mut saved = Saved::default();
    let y = bn.forward(
        Params::Host(&params[..]),
        ParamsMut::Host(&mut buffers[..]),
        Tensor::from_vec(x.clone(), &[c, n * hw]),
        Mode::TRAIN,
        &mut saved,
    );
    let mut g = [0.0f32; 6];
    let dx = bn
        .backward(
            Params::Host(&params[..]),
            ParamsMut::Host(&mut g[..]),
            saved,
            Tensor::from_vec(dy.clone(), &[c, n * hw]),
            true,
        )
        .unwrap();
    // Worker w holds samples w·n/world.. of every channel.
    let local = n / world * hw;
    let slice = move |v: &[f32], w: usize| -> Vec<f32> {
        (0..c)
            .flat_map(|ch| v[ch * n * hw + w * local..][..local].to_vec())
            .collect()
    };
    let (xs, dys) = (x.clone(), dy.clone());
    let parts = ThreadsWorld::run(world, CommConfig::default(), move |group| {
        let w = group.rank();
        let mut bn = BatchNorm2d::new(c);
        bn.set_stats_reducer(Some(Arc::new(GroupStatsReducer::new(group))));
        let mut b = vec![0.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let mut s = Saved::default();
        let y = bn.forward(
            Params::Host(&params[..]),
            ParamsMut::Host(&mut b[..]),
            Tensor::from_vec(slice(&xs, w), &[c, local]),
            Mode::TRAIN,
            &mut s,
        );
        let mut g = [0.0f32; 6];
        // Local losses are means over the local batch: their gradients are `world`× larger.
        let ldy: Vec<f32> = slice(&dys, w).iter().map(|v| v * world as f32).collect();
        let dx = bn
            .backward(
                Params::Host(&params[..]),
                ParamsMut::Host(&mut g[..]),
                s,
                Tensor::from_vec(ldy, &[c, local]),
                true,
            )
            .unwrap();
        Ok::<_, String>((y.data().to_vec(), dx.data().to_vec(), b))
    })
    .unwrap();
    for (w, (yl, dxl, b)) in parts.iter().enumerate() {
        let close = |a: &[f32], e: &[f32], k: f32| {
            a.iter()
                .zip(e)
                .all(|(p, q)| (p - k * q).abs() < 1e-5 * (1.0 + q.abs() * k))
        };
        assert!(close(yl, &slice(y.data(), w), 1.0), "forward of worker {w}");
        assert!(
            close(dxl, &slice(dx.data(), w), world as f32),
            "input gradient of worker {w}"
        );
        assert!(close(b, &buffers, 1.0), "running statistics of worker {w}");
    }
}
