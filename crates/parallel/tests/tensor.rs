//! Tensor-parallel pieces against their one-worker forms: the vocab-parallel cross-entropy
//! against `CrossEntropy` (loss, correct count, gradient) on a padded vocabulary, shard
//! specs (q/k/v groups, padding) against slicing by hand, and the plan check's errors for a
//! user's model.

use meshtrain_comm::{CommConfig, ThreadsWorld};
use meshtrain_nn::layers::Linear;
use meshtrain_nn::{Block, CrossEntropy, Loss, Model, ShardSpec, TensorPlan, TpStyle};
use meshtrain_parallel::tensor::{check, VocabParallelCrossEntropy};
use meshtrain_tensor::rng::SplitMix64;
use meshtrain_tensor::Tensor;

#[test]
fn vocab_parallel_cross_entropy_matches_the_whole_vocabulary() {
    // 5 classes over 2 ranks: padded to 6, rank 1 holds ids 3, 4 and one padding column.
    let (rows, vocab, tp) = (7usize, 5usize, 2usize);
    let columns = vocab.div_ceil(tp);
    let mut rng = SplitMix64::new(3);
    let logits: Vec<f32> = (0..rows * vocab).map(|_| 2.0 * rng.normal()).collect();
    let targets: Vec<u32> = (0..rows).map(|r| (r % vocab) as u32).collect();
    let (whole, dwhole) = CrossEntropy::new(vocab)
        .forward_backward(
            &Tensor::from_vec(logits.clone(), &[rows, vocab]),
            &targets,
            0.5,
        )
        .unwrap();
    let (lg, tg) = (logits.clone(), targets.clone());
    let parts = ThreadsWorld::run(tp, CommConfig::default(), move |group| {
        let rank = group.rank();
        // This rank's columns; the padding column holds a huge logit that must not count.
        let mut local = Vec::with_capacity(rows * columns);
        for r in 0..rows {
            for c in 0..columns {
                let id = rank * columns + c;
                local.push(if id < vocab { lg[r * vocab + id] } else { 1e4 });
            }
        }
        let loss = VocabParallelCrossEntropy {
            vocab,
            columns,
            group,
        };
        loss.forward_backward(&Tensor::from_vec(local, &[rows, columns]), &tg, 0.5)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for (rank, (value, grad)) in parts.iter().enumerate() {
        assert!(
            (value.mean - whole.mean).abs() < 1e-5,
            "rank {rank}: {value:?} vs {whole:?}"
        );
        assert_eq!(value.correct, whole.correct);
        for r in 0..rows {
            for c in 0..columns {
                let id = rank * columns + c;
                let got = grad.data()[r * columns + c];
                if id < vocab {
                    let want = dwhole.data()[r * vocab + id];
                    assert!(
                        (got - want).abs() < 1e-6,
                        "row {r} id {id}: {got} vs {want}"
                    );
                } else {
                    assert_eq!(got, 0.0, "padding gets no gradient");
                }
            }
        }
    }
}

#[test]
fn shards_cut_groups_separately_and_pad() {
    // A fused [q; k; v] weight of 3 × 4 rows of 2: rank 1 of 2 takes rows 2..4 of each.
    let whole: Vec<f32> = (0..24).map(|v| v as f32).collect();
    let s = ShardSpec::new(&[12, 2], 0, 3, 2, 1);
    assert_eq!(s.local_shape(), [6, 2]);
    let local = s.take(&whole);
    assert_eq!(
        local,
        [4., 5., 6., 7., 12., 13., 14., 15., 20., 21., 22., 23.]
    );
    let mut back = vec![0.0; 24];
    for rank in 0..2 {
        let spec = ShardSpec::new(&[12, 2], 0, 3, 2, rank);
        spec.put(&spec.take(&whole), &mut back);
    }
    assert_eq!(back, whole);
    // Columns (dim 1) of a [2, 4] weight; and 5 rows padded to 6 over 3 ranks.
    let row = ShardSpec::new(&[2, 4], 1, 1, 2, 1);
    assert_eq!(
        row.take(&(0..8).map(|v| v as f32).collect::<Vec<_>>()),
        [2., 3., 6., 7.]
    );
    let padded = ShardSpec::new(&[5, 1], 0, 1, 3, 2);
    assert_eq!(padded.local_shape(), [2, 1]);
    assert_eq!(
        padded.take(&[1., 2., 3., 4., 5.]),
        [5., 0.],
        "the padding row is zero"
    );
}

#[test]
fn a_plan_the_model_cannot_follow_is_an_error_naming_the_layer() {
    let model = || {
        Model::new(vec![
            Block::new("up", Linear::new(4, 6, true)),
            Block::new("down", Linear::new(6, 4, true)),
        ])
    };
    let plan = TensorPlan {
        rules: vec![
            ("up".into(), TpStyle::Column { groups: 1 }),
            ("down".into(), TpStyle::Row),
        ],
    };
    let e = check(&model(), 2, false, 1).unwrap_err().to_string();
    assert!(e.contains("no tensor-parallel plan"), "{e}");
    let planned = model().with_tensor_plan(plan);
    check(&planned, 2, false, 1).unwrap();
    let e = check(&planned, 4, false, 1).unwrap_err().to_string();
    assert!(
        e.contains("'up' output features per group is 6, not divisible by tp"),
        "{e}"
    );
    let e = check(&planned, 2, true, 1).unwrap_err().to_string();
    assert!(e.contains("tokens per sample"), "{e}");
}
