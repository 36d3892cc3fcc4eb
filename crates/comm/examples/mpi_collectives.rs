//! MPI backend driver, run under `mpirun -np N` (see `scripts/mpi-tests.sh`).
//!
//! ```text
//! mpi_collectives test            conformance suite + desync + mesh checks (exit 0 = pass)
//! mpi_collectives FAULT [RANK [OP]]
//!                                 after barrier #1, RANK (default: the last) misbehaves
//!                                 while the others call OP #2 (all_reduce, the default,
//!                                 or all_to_all); every run must end non-zero with an
//!                                 error naming the op, group and RANK:
//!   stuck    stops calling (sleeps); the others time out (4 s)
//!   panic    panics
//!   kill     kills itself with SIGKILL
//!   exit     shuts MPI down cleanly without calling OP #2
//!   desync   calls broadcast #2 instead (caught by the fingerprint check)
//! mpi_collectives bench [ARGS]    `meshtrain bench collectives --backend mpi` + raw MPI_Allreduce
//! ```
//!
//! In the fault modes every other rank prints `waiting in OP #2 since T ms` (Unix
//! time) first, so the test script can measure how long the failure took to end the
//! job.

use clap::Parser;
use meshtrain_comm::bench::{run_bench, BenchBackend, BenchCollectivesArgs};
use meshtrain_comm::mpi_backend::MpiWorld;
use meshtrain_comm::{
    conformance, CommConfig, CommError, DeviceMesh, MeshAxis, ProcessGroup, ReduceOp,
};
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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
    let timeout = if mode == "test" { 60.0 } else { 4.0 };
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
        Ok(group) if mode == "test" => run_tests(group),
        Ok(group) => match Fault::parse(mode) {
            Some(fault) => {
                let size = group.size();
                let collective = match argv.get(3) {
                    None => Some(Collective::AllReduce),
                    Some(name) => Collective::parse(name),
                };
                match (argv.get(2).map(|r| r.parse::<usize>()), collective) {
                    (_, None) => Err(anyhow::anyhow!("OP must be all_reduce or all_to_all")),
                    (None, Some(op)) => misbehave(group, fault, size - 1, op),
                    (Some(Ok(rank)), Some(op)) if rank < size => misbehave(group, fault, rank, op),
                    (Some(_), Some(_)) => Err(anyhow::anyhow!("RANK must be below {size}")),
                }
            }
            None => Err(anyhow::anyhow!("unknown mode '{mode}'")),
        },
        Err(e) => Err(e.into()),
    };
    if let Err(e) = outcome {
        world.abort_with_error(format_args!("{e:#}"), 2);
    }
}

fn run_tests(world: Arc<dyn ProcessGroup>) -> anyhow::Result<()> {
    let start = Instant::now();
    conformance::run_suite(world.as_ref())?;
    desync_is_detected(world.as_ref())?;
    a_send_arrives_while_its_sender_stays_outside_mpi(world.as_ref())?;
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

/// Rank 1 sends rank 0 a message far above MPI's eager limit and then works outside MPI
/// for `AWAY`, as a tensor-parallel rank does when it sends its checkpoint shards and goes
/// on to NCCL kernels: the message must still arrive at once (the backend's send thread
/// moves it), not when the sender next calls MPI.
fn a_send_arrives_while_its_sender_stays_outside_mpi(
    world: &dyn ProcessGroup,
) -> anyhow::Result<()> {
    const AWAY: Duration = Duration::from_secs(1);
    const ELEMENTS: usize = 8 << 20;
    if world.size() < 2 {
        return Ok(());
    }
    world.barrier()?;
    match world.rank() {
        0 => {
            let start = Instant::now();
            let mut message = vec![0.0f32; ELEMENTS];
            world.recv((&mut message).into(), 1, 7)?;
            let waited = start.elapsed();
            anyhow::ensure!(
                message.iter().enumerate().all(|(i, &v)| v == i as f32),
                "the large message arrived corrupted"
            );
            anyhow::ensure!(
                waited < AWAY / 2,
                "a 32 MB message took {:.2} s to arrive while its sender stayed outside MPI \
                 for {:.0} s: sends move only inside MPI calls",
                waited.as_secs_f64(),
                AWAY.as_secs_f64()
            );
        }
        1 => {
            let message: Vec<f32> = (0..ELEMENTS).map(|i| i as f32).collect();
            world.send((&message).into(), 0, 7)?;
            std::thread::sleep(AWAY);
        }
        _ => {}
    }
    world.barrier()?;
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

/// How the misbehaving rank of a fault mode fails its peers.
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    Stuck,
    Panic,
    Kill,
    Exit,
    Desync,
}

impl Fault {
    fn parse(mode: &str) -> Option<Fault> {
        Some(match mode {
            "stuck" => Fault::Stuck,
            "panic" => Fault::Panic,
            "kill" => Fault::Kill,
            "exit" => Fault::Exit,
            "desync" => Fault::Desync,
            _ => return None,
        })
    }
}

/// The collective the healthy ranks of a fault mode wait in: the failure detection
/// (watchdog, failure monitor, fingerprints) must name whichever collective it is.
#[derive(Clone, Copy)]
enum Collective {
    /// In place on 1000 f32 elements.
    AllReduce,
    /// 250 f32 elements for every rank.
    AllToAll,
}

impl Collective {
    fn parse(name: &str) -> Option<Collective> {
        Some(match name {
            "all_reduce" => Collective::AllReduce,
            "all_to_all" => Collective::AllToAll,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllToAll => "all_to_all",
        }
    }

    fn call(self, world: &dyn ProcessGroup) -> Result<(), CommError> {
        match self {
            Collective::AllReduce => {
                let mut buf = vec![1.0f32; 1000];
                world.all_reduce((&mut buf).into(), ReduceOp::Sum)
            }
            Collective::AllToAll => {
                let input = vec![1.0f32; 250 * world.size()];
                let mut output = vec![0.0f32; input.len()];
                world.all_to_all((&input).into(), (&mut output).into())
            }
        }
    }
}

/// Barrier #1, then rank `culprit` misbehaves while the others call `collective` (#2).
fn misbehave(
    world: Arc<dyn ProcessGroup>,
    fault: Fault,
    culprit: usize,
    collective: Collective,
) -> anyhow::Result<()> {
    world.barrier()?;
    let rank = world.rank();
    let op = collective.name();
    if rank != culprit {
        let since = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis();
        // One write: `mpirun` merges the ranks' output line by line only if lines
        // are written whole.
        std::io::stderr()
            .write_all(format!("rank {rank}: waiting in {op} #2 since {since} ms\n").as_bytes())?;
        collective.call(world.as_ref())?;
        anyhow::bail!("{op} #2 completed although rank {culprit} did not call it");
    }
    match fault {
        Fault::Stuck => std::thread::sleep(Duration::from_secs(60)),
        Fault::Panic => panic!("rank {rank} panics on purpose"),
        Fault::Kill => {
            let pid = std::process::id().to_string();
            std::process::Command::new("kill")
                .args(["-9", &pid])
                .status()?;
            std::thread::sleep(Duration::from_secs(60));
        }
        // Returning drops the group and the world: a clean MPI shutdown.
        Fault::Exit => return Ok(()),
        Fault::Desync => world.broadcast((&mut vec![1.0f32; 1000]).into(), 0)?,
    }
    anyhow::bail!("rank {rank} was not stopped by its fault")
}
