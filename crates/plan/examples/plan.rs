//! Stand-alone `meshtrain plan` until the CLI binary wires it in:
//! `cargo run -p meshtrain-plan --release --example plan -- --model gpt-30b --cluster h100 --gpus 32 --global-batch 256 --explain`
use clap::Parser;

#[derive(Parser)]
#[command(
    name = "plan",
    about = "Recommend a parallel layout for a model and a cluster"
)]
struct Cli {
    #[command(flatten)]
    args: meshtrain_plan::cli::PlanArgs,
}

fn main() -> anyhow::Result<()> {
    meshtrain_plan::cli::run(&Cli::parse().args)
}
