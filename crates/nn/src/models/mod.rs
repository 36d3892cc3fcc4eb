//! The built-in models, each an ordered list of blocks that pipeline stages can cut.

pub mod gpt;
pub mod lenet;
pub mod llama;
pub mod resnet;

pub use gpt::GptConfig;
pub use lenet::LeNetVariant;
pub use llama::LlamaConfig;

use crate::layer::{Init, Layer, TensorPlan};
use crate::layers::{Linear, Seq};
use crate::model::{Block, InputSpec, Model};
use crate::transformer::{GptEmbedding, TransformerBlock};

/// A decoder-only language model from its parts (GPT's and Llama's shared frame): the
/// embedding, the blocks (named `blocks.{i}`), the final norm (named `norm_name`) and a linear
/// head without bias (`head.weight`, drawn from `init`; tied to `tok.weight` when `tie`),
/// token ids `[B, seq]` in, split by `plan` under tensor parallelism.
pub(crate) fn decoder(
    embedding: GptEmbedding,
    blocks: Vec<TransformerBlock>,
    (norm_name, norm): (&str, Box<dyn Layer>),
    init: Init,
    plan: TensorPlan,
    tie: bool,
) -> Model {
    let (vocab, dim, seq) = (embedding.vocab, embedding.dim, embedding.max_seq);
    let mut all = vec![Block::new("", embedding)];
    for (i, block) in blocks.into_iter().enumerate() {
        all.push(Block::new(&format!("blocks.{i}"), block));
    }
    all.push(Block::new(
        "",
        Seq::new(vec![
            (norm_name, norm),
            (
                "head",
                Box::new(Linear::new(dim, vocab, false).with_init(init)),
            ),
        ]),
    ));
    let model = Model::new(all)
        .with_input(InputSpec::tokens(seq, vocab))
        .with_tensor_plan(plan);
    if tie {
        return model
            .tie("head.weight", "tok.weight")
            .expect("the head and the token embedding are both [vocab, dim]");
    }
    model
}
