//! The built-in models, each an ordered list of blocks that pipeline stages can cut.

pub mod gpt;
pub mod lenet;
pub mod llama;
pub mod resnet;

pub use gpt::GptConfig;
pub use lenet::LeNetVariant;
pub use llama::LlamaConfig;
