//! Stand-alone `meshtrain bench collectives` (same arguments), e.g.
//! `cargo run --release -p meshtrain-comm --example bench_collectives -- --workers 2,4`.

use clap::Parser;
use meshtrain_comm::bench::{run_bench, BenchCollectivesArgs};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: BenchCollectivesArgs,
}

fn main() -> anyhow::Result<()> {
    run_bench(Cli::parse().args)
}
