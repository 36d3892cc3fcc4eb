//! LeNet-5 as in Dive into Deep Learning (6.6): sigmoid + average pooling, or the modern
//! ReLU + max-pooling variant. Input `[N, 1, 28, 28]`, 10 classes.

use crate::layers::{Act, Conv2d, Flatten, Linear, Pool2d, Seq, ToChannelMajor};
use crate::model::{Block, InputSpec, Model};
use meshtrain_tensor::activation::Activation;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LeNetVariant {
    /// The original: sigmoid activations, average pooling.
    #[default]
    Sigmoid,
    /// ReLU activations, max pooling: trains faster and higher.
    Relu,
}

pub fn lenet(variant: LeNetVariant) -> Model {
    let act = || match variant {
        LeNetVariant::Sigmoid => Act(Activation::Sigmoid),
        LeNetVariant::Relu => Act(Activation::Relu),
    };
    let pool = || match variant {
        LeNetVariant::Sigmoid => Pool2d::avg(2, 2),
        LeNetVariant::Relu => Pool2d::max(2, 2, 0),
    };
    Model::new(vec![
        Block::new(
            "",
            Seq::new(vec![
                ("", Box::new(ToChannelMajor)),
                ("conv1", Box::new(Conv2d::new(1, 6, 5, 1, 2))),
                ("", Box::new(act())),
                ("", Box::new(pool())),
            ]),
        ),
        Block::new(
            "",
            Seq::new(vec![
                ("conv2", Box::new(Conv2d::new(6, 16, 5, 1, 0))),
                ("", Box::new(act())),
                ("", Box::new(pool())),
                (
                    "",
                    Box::new(Flatten {
                        global_average: false,
                    }),
                ),
            ]),
        ),
        Block::new(
            "",
            Seq::new(vec![
                ("fc1", Box::new(Linear::new(400, 120, true))),
                ("", Box::new(act())),
            ]),
        ),
        Block::new(
            "",
            Seq::new(vec![
                ("fc2", Box::new(Linear::new(120, 84, true))),
                ("", Box::new(act())),
            ]),
        ),
        Block::new("fc3", Linear::new(84, 10, true)),
    ])
    .with_input(InputSpec::float(&[1, 28, 28]))
}
