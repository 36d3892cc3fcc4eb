//! DDP against a hand-computed average, and a backward that leaves blocks out.

use meshtrain_comm::{CommConfig, RawBuf, ThreadsWorld};
use meshtrain_nn::models::{gpt, GptConfig};
use meshtrain_nn::{Mode, Model, ParamStore};
use meshtrain_parallel::data::{Ddp, DdpConfig, GradCompression};
use meshtrain_tensor::loss::softmax_cross_entropy;
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::Tensor;

fn model() -> Model {
    gpt::gpt(&GptConfig {
        vocab: 16,
        dim: 16,
        layers: 3,
        heads: 2,
        seq: 8,
        tie_embeddings: false,
        attention: Default::default(),
        gelu: Default::default(),
    })
}

/// Rank `rank`'s local gradient: forward/backward over `blocks` on its own random tokens.
fn local_grads(
    m: &Model,
    store: &mut ParamStore,
    rank: usize,
    blocks: std::ops::Range<usize>,
    hook: &mut dyn FnMut(usize, &mut ParamStore),
) {
    let mut rng = SplitMix64::new(100 + rank as u64);
    let ids: Vec<f32> = (0..2 * 8).map(|_| rng.below(16) as f32).collect();
    let y: Vec<u32> = (0..2 * 8).map(|_| rng.below(16) as u32).collect();
    let mut x = Tensor::from_vec(ids, &[2, 8]);
    if blocks.start > 0 {
        x = m
            .forward(store, x, 0..blocks.start, Mode::EVAL, &|_| false)
            .0;
    }
    let (logits, acts) = m.forward(store, x, blocks, Mode::TRAIN, &|_| false);
    let (_, dy, _) = softmax_cross_entropy(logits.data(), 16, &y, 1.0);
    m.backward(
        store,
        acts,
        Tensor::from_vec(dy, logits.shape()),
        false,
        hook,
    );
}

fn run(compression: GradCompression, blocks_from: usize) -> (Vec<Vec<f32>>, Vec<f32>) {
    let m = model();
    let n = m.num_blocks();
    // The expected average, computed serially.
    let mut expect = vec![0.0f32; m.num_params()];
    for r in 0..3 {
        let mut s = m.init(1);
        local_grads(&m, &mut s, r, blocks_from..n, &mut |_, _| {});
        expect
            .iter_mut()
            .zip(&s.grads)
            .for_each(|(e, g)| *e += g / 3.0);
    }
    let got = ThreadsWorld::run(3, CommConfig::default(), move |group| {
        let m = model();
        let mut store = m.init(1);
        let cfg = DdpConfig {
            bucket_cap_mb: 0.02,
            first_bucket_mb: 0.005,
            compression,
            overlap: true,
            ..DdpConfig::default()
        };
        let mut ddp = Ddp::new(&m, group.clone(), cfg).map_err(|e| e.to_string())?;
        assert!(ddp.buckets().len() > 2, "test wants several buckets");
        ddp.prepare(true);
        let rank = group.rank();
        local_grads(&m, &mut store, rank, blocks_from..n, &mut |i, s| {
            // SAFETY: the store's gradients outlive the step and are only written by
            // backward's earlier blocks, outside the buckets in flight.
            ddp.block_ready(i, unsafe { RawBuf::from_slice(&mut s.grads) })
        });
        // SAFETY: as above; `finish` waits for every operation on them.
        let timing = ddp
            .finish(unsafe { RawBuf::from_slice(&mut store.grads) })
            .map_err(|e| e.to_string())?;
        assert!(timing.bytes > 0);
        Ok::<_, String>(store.grads)
    })
    .unwrap();
    (got, expect)
}

#[test]
fn ddp_leaves_the_average_gradient_on_every_rank() {
    let (got, expect) = run(GradCompression::None, 0);
    for g in &got {
        assert_eq!(g, &got[0], "ranks must agree bit for bit");
        let worst = g
            .iter()
            .zip(&expect)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst < 1e-6, "average off by {worst}");
    }
}

#[test]
fn bf16_on_the_wire_is_close_to_the_average() {
    let (got, expect) = run(GradCompression::Bf16, 0);
    let scale = expect.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let worst = got[0]
        .iter()
        .zip(&expect)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(
        worst > 0.0 && worst < 1e-2 * scale,
        "bf16 error {worst} (scale {scale})"
    );
}

#[test]
fn blocks_without_gradients_do_not_hang_and_stay_zero() {
    // Backward covers only the last blocks: the embedding's bucket never reports ready, and
    // `finish` still all-reduces it (zeros) in order on every rank.
    let (got, expect) = run(GradCompression::None, 2);
    let m = model();
    let frozen = m.block_param_range(0);
    assert!(got[0][frozen].iter().all(|&g| g == 0.0));
    let worst = got[0]
        .iter()
        .zip(&expect)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(worst < 1e-6);
}
