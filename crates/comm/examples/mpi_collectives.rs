//! MPI backend driver, run under `mpirun -np N` (see `scripts/mpi-tests.sh`).
//!
//! ```text
//! mpi_collectives test            conformance suite + desync + mesh checks (exit 0 = pass)
//! mpi_collectives stuck           last rank stops calling; the others must time out
//!                                 (2 s), print the error and abort the job (exit != 0)
//! mpi_collectives kill            last rank crashes mid-run; the job must end (exit != 0)
//! mpi_collectives bench [ARGS]    `meshtrain bench collectives --backend mpi` + raw MPI_Allreduce
//! ```

use clap::Parser;
use meshtrain_comm::bench::{run_bench, BenchBackend, BenchCollectivesArgs};
use meshtrain_comm::mpi_backend::MpiWorld;
use meshtrain_comm::{
    conformance, CommConfig, CommError, DeviceMesh, MeshAxis, ProcessGroup, ReduceOp,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct BenchCli {
    #[command(flatten)]
    args: BenchCollectivesArgs,
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let mode = argv.get(1).map(String::as_str).unwrap_or("test");
    if mode == "bench" {
        let mut cli = BenchCli::parse_from(
            std::iter::once("bench".to_string()).chain(argv[2..].iter().cloned()),
        );
        cli.args.backend = BenchBackend::Mpi;
        if let Err(e) = run_bench(cli.args) {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
        return;
    }
    let timeout = if mode == "test" { 60.0 } else { 2.0 };
    let config = CommConfig::default()
        .with_timeout(Duration::from_secs_f64(timeout))
        .with_desync_check(true);
    let world = match MpiWorld::init(config) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let outcome = match world.world_group() {
        Ok(group) => match mode {
            "test" => run_tests(group),
            "stuck" => stuck(group),
            "kill" => kill(group),
            other => Err(anyhow::anyhow!("unknown mode '{other}'")),
        },
        Err(e) => Err(e.into()),
    };
    if let Err(e) = outcome {
        eprintln!("error: {e:#}");
        world.abort(2);
    }
}

fn run_tests(world: Arc<dyn ProcessGroup>) -> anyhow::Result<()> {
    let start = Instant::now();
    conformance::run_suite(world.as_ref())?;
    desync_is_detected(world.as_ref())?;
    if world.size() == 4 {
        mesh_groups(&world)?;
    }
    world.barrier()?;
    if world.rank() == 0 {
        println!(
            "mpi conformance OK: {} ranks, {:.2} s",
            world.size(),
            start.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// Rank 0 all-reduces 7 elements, the others 8: every rank must get a Desync error.
fn desync_is_detected(world: &dyn ProcessGroup) -> anyhow::Result<()> {
    if world.size() < 2 {
        return Ok(());
    }
    let all: Vec<usize> = (0..world.size()).collect();
    let scratch = world.new_subgroup(&all)?;
    let mut buf = vec![1.0f32; if world.rank() == 0 { 7 } else { 8 }];
    match scratch.all_reduce((&mut buf).into(), ReduceOp::Sum) {
        Err(CommError::Desync { details, .. }) => {
            anyhow::ensure!(
                details.contains("f32×7") && details.contains("f32×8"),
                "{details}"
            );
            anyhow::ensure!(
                buf.iter().all(|&x| x == 1.0),
                "desynchronised data was touched"
            );
        }
        other => anyhow::bail!("mismatched all_reduce gave {other:?}, expected a desync error"),
    }
    Ok(())
}

fn mesh_groups(world: &Arc<dyn ProcessGroup>) -> anyhow::Result<()> {
    let mesh = DeviceMesh::new(Arc::clone(world), &[(MeshAxis::Dp, 2), (MeshAxis::Tp, 2)])?;
    let rank = world.rank() as f32;
    let mut tp = [rank];
    mesh.group(MeshAxis::Tp)
        .all_reduce((&mut tp[..]).into(), ReduceOp::Sum)?;
    let mut dp = [rank];
    mesh.group(MeshAxis::Dp)
        .all_reduce((&mut dp[..]).into(), ReduceOp::Sum)?;
    let expect_tp = [1.0, 1.0, 5.0, 5.0][world.rank()];
    let expect_dp = [2.0, 4.0, 2.0, 4.0][world.rank()];
    anyhow::ensure!(
        tp[0] == expect_tp && dp[0] == expect_dp,
        "mesh sums tp={} dp={}",
        tp[0],
        dp[0]
    );
    Ok(())
}

fn stuck(world: Arc<dyn ProcessGroup>) -> anyhow::Result<()> {
    world.barrier()?;
    if world.rank() == world.size() - 1 {
        std::thread::sleep(Duration::from_secs(60));
    }
    let mut buf = vec![1.0f32; 1000];
    world.all_reduce((&mut buf).into(), ReduceOp::Sum)?;
    Ok(())
}

fn kill(world: Arc<dyn ProcessGroup>) -> anyhow::Result<()> {
    let mut buf = vec![1.0f32; 1000];
    world.all_reduce((&mut buf).into(), ReduceOp::Sum)?;
    if world.rank() == world.size() - 1 {
        eprintln!("rank {} crashing on purpose", world.rank());
        std::process::abort();
    }
    world.all_reduce((&mut buf).into(), ReduceOp::Sum)?;
    Ok(())
}
