//! Parameter groups (per-group weight decay and learning-rate scale over the flat buffer) and
//! tied parameters (one parameter held by several blocks).

use meshtrain_nn::models::{gpt, lenet, GptConfig, LeNetVariant};
use meshtrain_nn::optim::{
    segments_within, GroupHyper, Optimizer, OptimizerConfig, ParamGroup, ParamGroups, Segment,
    Selector,
};
use meshtrain_nn::{layers::Linear, Block, Model, ModelError};

const ADAMW: OptimizerConfig = OptimizerConfig::Adamw {
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.1,
};

#[test]
fn groups_resolve_to_merged_segments_and_vectors_skip_decay() {
    let model = lenet::lenet(LeNetVariant::Relu);
    let segments = ParamGroups::no_decay_on_vectors().resolve(&model, &ADAMW);
    // Every parameter is covered once, in order.
    assert_eq!(segments.first().unwrap().range.start, 0);
    assert_eq!(segments.last().unwrap().range.end, model.num_params());
    assert!(segments
        .windows(2)
        .all(|w| w[0].range.end == w[1].range.start));
    for e in model.params() {
        let s = segments
            .iter()
            .find(|s| s.range.contains(&e.range.start))
            .unwrap();
        assert!(
            s.range.end >= e.range.end,
            "{} split across segments",
            e.name
        );
        let expected = if e.shape.len() < 2 { 0.0 } else { 0.1 };
        assert_eq!(s.hyper.weight_decay, expected, "{}", e.name);
    }
    // No groups: one segment, the optimizer's own decay.
    let one = ParamGroups::default().resolve(&model, &ADAMW);
    assert_eq!(one.len(), 1);
    assert_eq!(one[0].hyper.weight_decay, 0.1);
}

#[test]
fn patterns_select_by_name_and_dimension() {
    let model = lenet::lenet(LeNetVariant::Relu);
    let groups = ParamGroups {
        groups: vec![
            ParamGroup {
                select: Selector::Patterns(vec!["fc3.*".into()]),
                weight_decay: None,
                lr_scale: 0.5,
            },
            ParamGroup {
                select: Selector::Patterns(vec!["*.bias".into()]),
                weight_decay: Some(0.0),
                lr_scale: 1.0,
            },
        ],
    };
    groups.validate().unwrap();
    let summary = groups.summary(&model);
    let fc3 = 84 * 10 + 10;
    let other_biases = 6 + 16 + 120 + 84;
    assert_eq!(summary[0].1, fc3, "the first matching group wins");
    assert_eq!(summary[1].1, other_biases);
    assert_eq!(summary[2].1, model.num_params() - fc3 - other_biases);
    let bad = ParamGroups {
        groups: vec![ParamGroup {
            select: Selector::Patterns(vec!["ndim=2".into()]),
            weight_decay: None,
            lr_scale: 1.0,
        }],
    };
    assert!(bad.validate().unwrap_err().contains("ndim<N or ndim>=N"));
}

/// A segmented optimizer does, segment by segment, exactly what an optimizer over each
/// segment alone with that segment's settings does — bit for bit.
#[test]
fn segmented_updates_equal_separate_optimizers() {
    let n = 37;
    let params: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let grads: Vec<f32> = (0..n).map(|i| (i as f32 * 0.91).cos()).collect();
    let hypers = [
        GroupHyper {
            weight_decay: 0.1,
            lr_scale: 1.0,
        },
        GroupHyper {
            weight_decay: 0.0,
            lr_scale: 0.25,
        },
    ];
    let segments = vec![
        Segment {
            range: 0..20,
            hyper: hypers[0],
        },
        Segment {
            range: 20..n,
            hyper: hypers[1],
        },
    ];
    for config in [
        ADAMW,
        OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.1,
        },
    ] {
        let mut together = params.clone();
        let mut opt = Optimizer::with_segments(config, n, segments.clone());
        let mut apart = params.clone();
        let mut parts: Vec<(Optimizer, std::ops::Range<usize>, f32)> = segments
            .iter()
            .map(|s| {
                let cfg = match config {
                    OptimizerConfig::Adamw {
                        beta1, beta2, eps, ..
                    } => OptimizerConfig::Adamw {
                        beta1,
                        beta2,
                        eps,
                        weight_decay: s.hyper.weight_decay,
                    },
                    OptimizerConfig::Sgd { momentum, .. } => OptimizerConfig::Sgd {
                        momentum,
                        weight_decay: s.hyper.weight_decay,
                    },
                };
                (
                    Optimizer::new(cfg, s.range.len()),
                    s.range.clone(),
                    s.hyper.lr_scale,
                )
            })
            .collect();
        for _ in 0..3 {
            opt.step(&mut together, &grads, 0.01);
            for (o, r, scale) in &mut parts {
                o.step(&mut apart[r.clone()], &grads[r.clone()], 0.01 * *scale);
            }
        }
        assert_eq!(together, apart, "{config:?}");
        // The decayed segment moved differently from an undecayed one would have.
        assert_ne!(together[..20], params[..20]);
    }
    // A chunk's optimizer takes the segments inside its range, rebased.
    let within = segments_within(&segments, 10..30);
    assert_eq!(
        within.iter().map(|s| s.range.clone()).collect::<Vec<_>>(),
        [0..10, 10..20]
    );
}

#[test]
fn ties_share_initial_values_and_are_checked() {
    let cfg = GptConfig {
        vocab: 256,
        dim: 16,
        layers: 1,
        heads: 2,
        seq: 8,
        tie_embeddings: true,
        attention: Default::default(),
        gelu: Default::default(),
    };
    let model = gpt::gpt(&cfg);
    let (tok, head) = (
        model.param_index("tok.weight").unwrap(),
        model.param_index("head.weight").unwrap(),
    );
    assert_eq!(model.tied_primary(head), Some(tok));
    let store = model.init(3);
    let range = |i: usize| model.params()[i].range.clone();
    assert_eq!(store.values[range(tok)], store.values[range(head)]);
    // A pipeline stage holding only the head draws the same values.
    let last = model.num_blocks() - 1;
    let stage = model.init_blocks(3, last..model.num_blocks());
    let base = model.blocks_param_range(last..model.num_blocks()).start;
    let local = range(head).start - base..range(head).end - base;
    assert_eq!(stage.values[local], store.values[range(tok)]);
    // A tied copy takes its primary's parameter group.
    let groups = ParamGroups {
        groups: vec![ParamGroup {
            select: Selector::Patterns(vec!["head.*".into()]),
            weight_decay: Some(0.0),
            lr_scale: 1.0,
        }],
    };
    let segments = groups.resolve(&model, &ADAMW);
    let hyper_at = |i: usize| {
        segments
            .iter()
            .find(|s| s.range.contains(&i))
            .unwrap()
            .hyper
            .weight_decay
    };
    assert_eq!(
        hyper_at(range(head).start),
        0.1,
        "the copy follows tok.weight"
    );

    let two = || {
        Model::new(vec![
            Block::new("a", Linear::new(4, 4, false)),
            Block::new("b", Linear::new(4, 3, false)),
        ])
    };
    assert!(matches!(
        two().tie("b.weight", "a.weight"),
        Err(ModelError::TieShape { .. })
    ));
    assert!(matches!(
        two().tie("c.weight", "a.weight"),
        Err(ModelError::UnknownParam(_))
    ));
    assert!(matches!(
        two().tie("a.weight", "a.weight"),
        Err(ModelError::SelfTie(_))
    ));
}
