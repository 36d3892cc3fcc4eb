//! ResNet-18 as in Dive into Deep Learning (8.6) for 1×28×28 input: a 7×7/2 stem with batch
//! norm and 3×3/2 max pooling, four stages of two residual blocks, global average pooling and
//! a linear classifier. Convolutions carry a bias, as in D2L. Widths are configurable so tests
//! can run a narrow copy of the same architecture.

use crate::layer::{Layer, Mode, ParamSpec, Params, ParamsMut, Saved, StatsReducer};
use crate::layers::{
    Act, BatchNorm2d, Children, Conv2d, Flatten, Linear, Pool2d, Seq, ToChannelMajor,
};
use crate::model::{Block, InputSpec, Model};
use meshtrain_tensor::activation::Activation;
use meshtrain_tensor::Tensor;
use std::sync::Arc;

/// D2L's residual block: `relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`, the shortcut
/// being a strided 1×1 convolution (`conv3`) when the shape changes.
pub struct Residual {
    /// conv1, bn1, relu, conv2, bn2 [, conv3]
    parts: Children,
    projection: bool,
}

impl Residual {
    pub fn new(inputs: usize, outputs: usize, stride: usize) -> Self {
        let projection = stride != 1 || inputs != outputs;
        let mut parts: Vec<(String, Box<dyn Layer>)> = vec![
            (
                "conv1".into(),
                Box::new(Conv2d::new(inputs, outputs, 3, stride, 1)),
            ),
            ("bn1".into(), Box::new(BatchNorm2d::new(outputs))),
            (String::new(), Box::new(Act(Activation::Relu))),
            (
                "conv2".into(),
                Box::new(Conv2d::new(outputs, outputs, 3, 1, 1)),
            ),
            ("bn2".into(), Box::new(BatchNorm2d::new(outputs))),
        ];
        if projection {
            parts.push((
                "conv3".into(),
                Box::new(Conv2d::new(inputs, outputs, 1, stride, 0)),
            ));
        }
        Residual {
            parts: Children::new(parts),
            projection,
        }
    }
}

impl Layer for Residual {
    fn params(&self) -> Vec<ParamSpec> {
        self.parts.param_specs()
    }
    fn buffers(&self) -> Vec<ParamSpec> {
        self.parts.buffer_specs()
    }

    fn forward(
        &self,
        p: Params<'_>,
        mut b: ParamsMut<'_>,
        x: Tensor,
        mode: Mode,
        s: &mut Saved,
    ) -> Tensor {
        let c = &self.parts;
        let y = (0..5).fold(x.clone(), |h, i| c.forward(i, p, &mut b, h, mode, s));
        let shortcut = if self.projection {
            c.forward(5, p, &mut b, x, mode, s)
        } else {
            x
        };
        #[cfg(feature = "cuda")]
        if y.device().is_cuda() {
            return crate::device::convnet::residual_join_forward(y, shortcut, mode, s);
        }
        let mut out = y;
        out.data_mut()
            .iter_mut()
            .zip(shortcut.data())
            .for_each(|(o, sc)| *o = (*o + sc).max(0.0));
        if mode.train {
            s.tensors.push(out.clone());
        }
        out
    }

    fn backward(
        &self,
        p: Params<'_>,
        mut g: ParamsMut<'_>,
        mut s: Saved,
        dy: Tensor,
        need_dx: bool,
    ) -> Option<Tensor> {
        let c = &self.parts;
        let out = s.tensors.pop().expect("residual: saved output");
        let d = join_gradient(&out, dy);
        let mut saved = s.children;
        let dshort = if self.projection {
            let st = saved.pop().expect("residual: conv3 state");
            c.backward(5, p, &mut g, st, d.clone(), need_dx)
        } else {
            Some(d.clone())
        };
        let mut grad = d;
        for i in (0..5).rev() {
            let st = saved.pop().expect("residual: saved state");
            grad = c.backward(i, p, &mut g, st, grad, need_dx || i > 0)?;
        }
        Some(match dshort {
            Some(ds) => add_gradients(grad, &ds),
            None => grad,
        })
    }

    fn set_stats_reducer(&mut self, reducer: Option<Arc<dyn StatsReducer>>) {
        self.parts.set_stats_reducer(reducer);
    }

    fn children(&self) -> Option<&Children> {
        Some(&self.parts)
    }

    fn children_mut(&mut self) -> Option<&mut Children> {
        Some(&mut self.parts)
    }
}

/// The gradient at the join's sum: `dy` where the output `relu(y + shortcut)` is positive.
fn join_gradient(out: &Tensor, dy: Tensor) -> Tensor {
    #[cfg(feature = "cuda")]
    if out.device().is_cuda() {
        return crate::device::convnet::residual_join_backward(out, dy);
    }
    let mut d = dy;
    d.data_mut().iter_mut().zip(out.data()).for_each(|(g, o)| {
        if *o <= 0.0 {
            *g = 0.0
        }
    });
    d
}

/// The block's input gradient: the branch's plus the shortcut's.
fn add_gradients(branch: Tensor, shortcut: &Tensor) -> Tensor {
    #[cfg(feature = "cuda")]
    if branch.device().is_cuda() {
        return crate::device::convnet::add(branch, shortcut);
    }
    let mut dx = branch;
    meshtrain_tensor::par::add_assign(dx.data_mut(), shortcut.data());
    dx
}

/// ResNet-18 with stage widths `(w, 2w, 4w, 8w)`; D2L uses w = 64.
pub fn resnet18(width: usize, classes: usize) -> Model {
    let w = [width, 2 * width, 4 * width, 8 * width];
    let mut blocks = vec![Block::new(
        "stem",
        Seq::new(vec![
            ("", Box::new(ToChannelMajor)),
            ("conv", Box::new(Conv2d::new(1, w[0], 7, 2, 3))),
            ("bn", Box::new(BatchNorm2d::new(w[0]))),
            ("", Box::new(Act(Activation::Relu))),
            ("", Box::new(Pool2d::max(3, 2, 1))),
        ]),
    )];
    for stage in 0..4 {
        let inputs = if stage == 0 { w[0] } else { w[stage - 1] };
        let stride = if stage == 0 { 1 } else { 2 };
        blocks.push(Block::new(
            &format!("stage{}.0", stage + 1),
            Residual::new(inputs, w[stage], stride),
        ));
        blocks.push(Block::new(
            &format!("stage{}.1", stage + 1),
            Residual::new(w[stage], w[stage], 1),
        ));
    }
    blocks.push(Block::new(
        "",
        Seq::new(vec![
            (
                "",
                Box::new(Flatten {
                    global_average: true,
                }),
            ),
            ("fc", Box::new(Linear::new(w[3], classes, true))),
        ]),
    ));
    Model::new(blocks).with_input(InputSpec::float(&[1, 28, 28]))
}
