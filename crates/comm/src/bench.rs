//! `meshtrain bench collectives`: latency and bandwidth of the collectives.
//!
//! Bandwidths follow nccl-tests (`doc/PERFORMANCE.md` there): `algbw = bytes / time`,
//! and `busbw = algbw × factor` with factor `2(n-1)/n` for all-reduce, `(n-1)/n` for
//! reduce-scatter and all-gather (bytes = the full, gathered size) and for all-to-all
//! (bytes = one rank's buffer, of which the `(n-1)/n` bound for other ranks crosses
//! the bus), and 1 for broadcast, so that numbers are comparable across worker counts
//! and with the hardware's bandwidth. The single-thread memcpy bandwidth of each size
//! is measured in the same run as the physical limit of a shared-memory transport.
//!
//! Timing: a few warm-up calls, then as many calls as fit in `--seconds` (at least
//! `--min-iters`), with the iteration count agreed by all ranks; the time per call is
//! the maximum over ranks of each rank's mean — the same procedure as
//! `gloo_allreduce_bench.py`, so the numbers compare side by side.

use crate::dtype::ReduceOp;
use crate::group::{CommConfig, ProcessGroup};
use crate::threads::ThreadsWorld;
use crate::topology::{GroupHosts, HierarchicalGroup};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which communication backend to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchBackend {
    /// Shared-memory worker threads in this process.
    Threads,
    /// One process per rank under `mpirun` (needs the `mpi` feature).
    Mpi,
}

/// Which collective to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BenchOp {
    AllReduce,
    ReduceScatter,
    AllGather,
    AllToAll,
    Broadcast,
}

impl BenchOp {
    /// nccl-tests' bus-bandwidth factor for `n` ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            BenchOp::AllReduce => 2.0 * (n - 1.0) / n,
            BenchOp::ReduceScatter | BenchOp::AllGather | BenchOp::AllToAll => (n - 1.0) / n,
            BenchOp::Broadcast => 1.0,
        }
    }

    fn name(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "all_reduce",
            BenchOp::ReduceScatter => "reduce_scatter",
            BenchOp::AllGather => "all_gather",
            BenchOp::AllToAll => "all_to_all",
            BenchOp::Broadcast => "broadcast",
        }
    }
}

/// Arguments of `meshtrain bench collectives`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchCollectivesArgs {
    /// Backend to measure. `mpi` must run under `mpirun -np N`.
    #[arg(long, value_enum, default_value = "threads")]
    pub backend: BenchBackend,
    /// Worker counts for the threads backend (MPI uses the mpirun process count).
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    pub workers: Vec<usize>,
    /// Collectives to measure.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "all-reduce")]
    pub ops: Vec<BenchOp>,
    /// Message sizes in bytes; K/M/G suffixes are powers of 1024 (f32 elements).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "4K,16K,64K,256K,1M,4M,16M,64M"
    )]
    pub sizes: Vec<String>,
    /// Time budget per size in seconds.
    #[arg(long, default_value_t = 1.0)]
    pub seconds: f64,
    /// Minimum timed iterations per size.
    #[arg(long, default_value_t = 5)]
    pub min_iters: usize,
    /// Warm-up iterations per size.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Append one JSON object per measurement to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// With the MPI backend, also time raw `MPI_Allreduce` on the same buffers.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub raw_mpi: bool,
    /// Compare the flat all-reduce with the hierarchical one (reduce-scatter inside each
    /// host, all-reduce across hosts, all-gather inside the host) in interleaved rounds,
    /// instead of measuring `--ops`.
    #[arg(long)]
    pub hierarchical: bool,
    /// Hosts of this many consecutive ranks: simulated on the threads backend; under MPI it
    /// overrides the detected placement (0: threads one host, MPI the detected hosts).
    #[arg(long, default_value_t = 0)]
    pub ranks_per_host: usize,
    /// Interleaved rounds (flat, hierarchical, flat, …) of `--hierarchical`; the median
    /// time of each is reported.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
}

/// One measured row.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRecord {
    pub backend: String,
    pub op: BenchOp,
    pub workers: usize,
    pub bytes: usize,
    pub iters: usize,
    pub time_us: f64,
    #[serde(rename = "algbw_GBps")]
    pub algbw_gbps: f64,
    #[serde(rename = "busbw_GBps")]
    pub busbw_gbps: f64,
    /// Single-thread memcpy of the same number of bytes, measured in this run.
    #[serde(rename = "memcpy_GBps")]
    pub memcpy_gbps: f64,
}

impl BenchRecord {
    pub fn busbw_over_memcpy(&self) -> f64 {
        self.busbw_gbps / self.memcpy_gbps
    }
}

/// Parses `4K`, `64M`, `1G` or a plain byte count.
pub fn parse_size(text: &str) -> Result<usize> {
    let t = text
        .trim()
        .trim_end_matches(['B', 'b'])
        .trim_end_matches(['i']);
    let (digits, unit) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&t[..i], c.to_ascii_uppercase()),
        _ => (t, ' '),
    };
    let value: usize = digits
        .trim()
        .parse()
        .with_context(|| format!("invalid size '{text}' (expected e.g. 4K, 64M, 4096)"))?;
    let multiplier = match unit {
        ' ' => 1,
        'K' => 1 << 10,
        'M' => 1 << 20,
        'G' => 1 << 30,
        _ => bail!("invalid size unit in '{text}' (expected K, M or G)"),
    };
    Ok(value * multiplier)
}

/// Single-thread memcpy bandwidth (bytes copied per second, GB/s) for `bytes`:
/// median over samples of back-to-back copies between two pre-faulted buffers. Each
/// sample batches enough copies to last ~100 µs, so clock overhead does not count.
pub fn memcpy_gbps(bytes: usize, seconds: f64) -> f64 {
    let elems = (bytes / 4).max(1);
    let src = vec![1.0f32; elems];
    // Place the destination 2 KiB off the source modulo 4 KiB: with equal page offsets
    // (`malloc` often gives them) `rep movsb` hits 4K aliasing and copies several times
    // slower, which would understate the machine's bandwidth.
    let mut dst_block = vec![0.0f32; elems + 2048];
    let src_offset = (src.as_ptr() as usize / 4) % 1024;
    let dst_offset = (dst_block.as_ptr() as usize / 4) % 1024;
    let skip = (src_offset + 512 + 1024 - dst_offset) % 1024;
    let dst = &mut dst_block[skip..skip + elems];
    dst.copy_from_slice(&src);
    let copy_batch = |reps: usize, dst: &mut [f32]| {
        let t = Instant::now();
        for _ in 0..reps {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut *dst);
        }
        t.elapsed().as_secs_f64()
    };
    let mut reps = 1;
    while reps < 1 << 20 && copy_batch(reps, dst) < 1e-4 {
        reps *= 2;
    }
    let budget = Duration::from_secs_f64(seconds.max(0.01));
    let start = Instant::now();
    let mut samples = Vec::new();
    while samples.len() < 5 || (start.elapsed() < budget && samples.len() < 10_000) {
        samples.push(copy_batch(reps, dst) / reps as f64);
    }
    samples.sort_by(f64::total_cmp);
    (elems * 4) as f64 / samples[samples.len() / 2] / 1e9
}

/// Times `call` on every rank of `group` and returns (iterations, seconds per call as
/// the maximum over ranks). All ranks must call this with the same arguments.
pub fn time_collective(
    group: &dyn ProcessGroup,
    args: &BenchCollectivesArgs,
    call: &mut dyn FnMut() -> Result<()>,
) -> Result<(usize, f64)> {
    for _ in 0..args.warmup {
        call()?;
    }
    let probe = Instant::now();
    for _ in 0..3 {
        call()?;
    }
    let mut estimate = [probe.elapsed().as_secs_f32() / 3.0];
    group.all_reduce((&mut estimate[..]).into(), ReduceOp::Max)?;
    let iters = ((args.seconds / f64::from(estimate[0]).max(1e-7)) as usize)
        .clamp(args.min_iters.max(1), 100_000);
    group.barrier()?;
    let start = Instant::now();
    for _ in 0..iters {
        call()?;
    }
    let mut per_call = [start.elapsed().as_secs_f32() / iters as f32];
    group.all_reduce((&mut per_call[..]).into(), ReduceOp::Max)?;
    Ok((iters, f64::from(per_call[0])))
}

/// Measures `op` at every size on `group`; returns rows (the same on every rank).
pub fn bench_group(
    group: &dyn ProcessGroup,
    backend: &str,
    op: BenchOp,
    sizes: &[usize],
    memcpy: &[f64],
    args: &BenchCollectivesArgs,
) -> Result<Vec<BenchRecord>> {
    let n = group.size();
    let mut rows = Vec::new();
    for (&bytes, &memcpy_gbps) in sizes.iter().zip(memcpy) {
        let elems = (bytes / 4).max(1);
        let (iters, seconds) = match op {
            BenchOp::AllReduce => {
                let mut buf = vec![1.0f32; elems];
                time_collective(group, args, &mut || {
                    Ok(group.all_reduce((&mut buf).into(), ReduceOp::Sum)?)
                })?
            }
            BenchOp::ReduceScatter => {
                let chunk = (elems / n).max(1);
                let input = vec![1.0f32; chunk * n];
                let mut output = vec![0.0f32; chunk];
                time_collective(group, args, &mut || {
                    Ok(group.reduce_scatter(
                        (&input).into(),
                        (&mut output).into(),
                        ReduceOp::Sum,
                    )?)
                })?
            }
            BenchOp::AllGather => {
                let chunk = (elems / n).max(1);
                let input = vec![1.0f32; chunk];
                let mut output = vec![0.0f32; chunk * n];
                time_collective(group, args, &mut || {
                    Ok(group.all_gather((&input).into(), (&mut output).into())?)
                })?
            }
            BenchOp::AllToAll => {
                let whole = (elems / n).max(1) * n;
                let input = vec![1.0f32; whole];
                let mut output = vec![0.0f32; whole];
                time_collective(group, args, &mut || {
                    Ok(group.all_to_all((&input).into(), (&mut output).into())?)
                })?
            }
            BenchOp::Broadcast => {
                let mut buf = vec![1.0f32; elems];
                time_collective(group, args, &mut || {
                    Ok(group.broadcast((&mut buf).into(), 0)?)
                })?
            }
        };
        rows.push(record(
            backend,
            op,
            n,
            elems * 4,
            iters,
            seconds,
            memcpy_gbps,
        ));
    }
    Ok(rows)
}

/// Flat against hierarchical all-reduce of f32 sums on `group` at every size, in `rounds`
/// interleaved rounds so that both see the same machine (a noisy neighbour or a warming
/// link hits both); each row has the median time of its rounds. Rows are the same on
/// every rank. Fails when the hosts hold different numbers of the group's ranks.
pub fn compare_hierarchical(
    group: &Arc<dyn ProcessGroup>,
    backend: &str,
    sizes: &[usize],
    memcpy: &[f64],
    args: &BenchCollectivesArgs,
) -> Result<Vec<(BenchRecord, BenchRecord)>> {
    let hierarchical = HierarchicalGroup::new(group.clone())?;
    let flat: &dyn ProcessGroup = group.as_ref();
    let median = |mut runs: Vec<(usize, f64)>| {
        runs.sort_by(|a, b| a.1.total_cmp(&b.1));
        runs[runs.len() / 2]
    };
    let mut rows = Vec::new();
    for (&bytes, &memcpy_gbps) in sizes.iter().zip(memcpy) {
        let elems = (bytes / 4).max(1);
        let mut buf = vec![1.0f32; elems];
        let (mut flat_runs, mut hier_runs) = (Vec::new(), Vec::new());
        for _ in 0..args.rounds.max(1) {
            for (target, runs) in [
                (flat, &mut flat_runs),
                (&hierarchical as &dyn ProcessGroup, &mut hier_runs),
            ] {
                runs.push(time_collective(flat, args, &mut || {
                    Ok(target.all_reduce((&mut buf).into(), ReduceOp::Sum)?)
                })?);
            }
        }
        let row = |name: &str, (iters, seconds): (usize, f64)| {
            let n = group.size();
            record(
                name,
                BenchOp::AllReduce,
                n,
                elems * 4,
                iters,
                seconds,
                memcpy_gbps,
            )
        };
        rows.push((
            row(backend, median(flat_runs)),
            row(&format!("{backend}-hier"), median(hier_runs)),
        ));
    }
    Ok(rows)
}

/// Prints where `group`'s ranks are (the first line of a hierarchical comparison).
pub fn describe_hosts(group: &dyn ProcessGroup) -> String {
    let hosts = GroupHosts::of(group);
    let lists: Vec<String> = hosts
        .members
        .iter()
        .map(|m| {
            let globals: Vec<String> = m
                .iter()
                .map(|&r| group.global_ranks()[r].to_string())
                .collect();
            format!("[{}]", globals.join(","))
        })
        .collect();
    format!(
        "{} ranks on {} host(s): {}",
        group.size(),
        hosts.num_hosts(),
        lists.join(" ")
    )
}

/// Reports the rows of [`compare_hierarchical`] with the time ratio of each size.
pub fn report_comparison(
    rows: &[(BenchRecord, BenchRecord)],
    rounds: usize,
    json: Option<&PathBuf>,
) -> Result<()> {
    for (flat, hierarchical) in rows {
        report(flat, json)?;
        report(hierarchical, json)?;
        println!(
            "{:>60} hierarchical/flat time ratio {:.3} (median of {} interleaved rounds)",
            "",
            hierarchical.time_us / flat.time_us,
            rounds.max(1)
        );
    }
    Ok(())
}

pub(crate) fn record(
    backend: &str,
    op: BenchOp,
    workers: usize,
    bytes: usize,
    iters: usize,
    seconds: f64,
    memcpy_gbps: f64,
) -> BenchRecord {
    let algbw = bytes as f64 / seconds / 1e9;
    BenchRecord {
        backend: backend.to_string(),
        op,
        workers,
        bytes,
        iters,
        time_us: seconds * 1e6,
        algbw_gbps: algbw,
        busbw_gbps: algbw * op.bus_factor(workers),
        memcpy_gbps,
    }
}

fn human_bytes(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes.is_multiple_of(1 << 10) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

/// Prints the table header.
pub fn print_header() {
    println!(
        "{:<12} {:<15} {:>3} {:>9} {:>7} {:>12} {:>8} {:>8} {:>9} {:>8}",
        "backend", "op", "n", "size", "iters", "time", "algbw", "busbw", "memcpy", "bus/mcpy"
    );
}

/// Prints one row and appends it to the JSON-lines file if one was given.
pub fn report(row: &BenchRecord, json: Option<&PathBuf>) -> Result<()> {
    let time = if row.time_us < 1000.0 {
        format!("{:.2} us", row.time_us)
    } else {
        format!("{:.3} ms", row.time_us / 1000.0)
    };
    println!(
        "{:<12} {:<15} {:>3} {:>9} {:>7} {:>12} {:>8.2} {:>8.2} {:>9.2} {:>8.2}",
        row.backend,
        row.op.name(),
        row.workers,
        human_bytes(row.bytes),
        row.iters,
        time,
        row.algbw_gbps,
        row.busbw_gbps,
        row.memcpy_gbps,
        row.busbw_over_memcpy()
    );
    if let Some(path) = json {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        writeln!(file, "{}", serde_json::to_string(row)?)?;
    }
    Ok(())
}

/// Parses the size list and measures the memcpy bandwidth of each size.
pub fn sizes_and_memcpy(args: &BenchCollectivesArgs) -> Result<(Vec<usize>, Vec<f64>)> {
    let sizes = args
        .sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<Vec<_>>>()?;
    if sizes.is_empty() {
        bail!("no sizes given");
    }
    let memcpy = sizes
        .iter()
        .map(|&b| memcpy_gbps(b, (args.seconds / 4.0).min(0.5)))
        .collect();
    Ok((sizes, memcpy))
}

/// Entry point of `meshtrain bench collectives`.
pub fn run_bench(args: BenchCollectivesArgs) -> Result<()> {
    match args.backend {
        BenchBackend::Threads => run_threads(&args),
        BenchBackend::Mpi => run_mpi(&args),
    }
}

fn run_threads(args: &BenchCollectivesArgs) -> Result<()> {
    if args.workers.is_empty() || args.workers.contains(&0) {
        bail!(
            "--workers needs positive worker counts, got {:?}",
            args.workers
        );
    }
    let (sizes, memcpy) = sizes_and_memcpy(args)?;
    println!(
        "single-thread memcpy: {}",
        sizes
            .iter()
            .zip(&memcpy)
            .map(|(&s, m)| format!("{} {m:.2} GB/s", human_bytes(s)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    print_header();
    let config = CommConfig::default()
        .with_desync_check(false)
        .with_ranks_per_host(args.ranks_per_host);
    for &n in &args.workers {
        if args.hierarchical {
            let (sizes, memcpy, worker_args) = (sizes.clone(), memcpy.clone(), args.clone());
            let rows = ThreadsWorld::run(n, config.clone(), move |g| {
                let hosts = describe_hosts(g.as_ref());
                compare_hierarchical(&g, "threads", &sizes, &memcpy, &worker_args)
                    .map(|rows| (hosts, rows))
            })
            .map_err(|e| anyhow::anyhow!("benchmark failed: {e}"))?;
            println!("{}", rows[0].0);
            report_comparison(&rows[0].1, args.rounds, args.json.as_ref())?;
            continue;
        }
        for &op in &args.ops {
            let (sizes, memcpy, worker_args) = (sizes.clone(), memcpy.clone(), args.clone());
            let rows = ThreadsWorld::run(n, config.clone(), move |g| {
                bench_group(g.as_ref(), "threads", op, &sizes, &memcpy, &worker_args)
            })
            .map_err(|e| anyhow::anyhow!("benchmark failed: {e}"))?;
            for row in &rows[0] {
                report(row, args.json.as_ref())?;
            }
        }
    }
    Ok(())
}

#[cfg(feature = "mpi")]
fn run_mpi(args: &BenchCollectivesArgs) -> Result<()> {
    crate::mpi_backend::run_bench_mpi(args)
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_args: &BenchCollectivesArgs) -> Result<()> {
    bail!("this binary was built without MPI support; rebuild with `--features mpi` and run under mpirun")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("1000").unwrap(), 1000);
        assert!(parse_size("4X").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn bus_bandwidth_factors_match_nccl_tests() {
        let row = record("t", BenchOp::AllReduce, 4, 8_000_000, 1, 0.001, 10.0);
        assert!((row.algbw_gbps - 8.0).abs() < 1e-9);
        assert!((row.busbw_gbps - 12.0).abs() < 1e-9);
        assert_eq!(BenchOp::AllGather.bus_factor(4), 0.75);
        assert_eq!(BenchOp::AllToAll.bus_factor(4), 0.75);
        assert_eq!(BenchOp::Broadcast.bus_factor(4), 1.0);
        assert_eq!(BenchOp::AllReduce.bus_factor(2), 1.0);
    }

    #[test]
    fn tiny_threads_bench_runs() {
        let args = BenchCollectivesArgs {
            backend: BenchBackend::Threads,
            workers: vec![2],
            ops: vec![
                BenchOp::AllReduce,
                BenchOp::AllGather,
                BenchOp::ReduceScatter,
                BenchOp::AllToAll,
                BenchOp::Broadcast,
            ],
            sizes: vec!["4K".into(), "64K".into()],
            seconds: 0.01,
            min_iters: 2,
            warmup: 1,
            json: None,
            raw_mpi: false,
            hierarchical: false,
            ranks_per_host: 0,
            rounds: 1,
        };
        run_bench(args.clone()).unwrap();
        // Flat against hierarchical on 2 simulated hosts of 2 workers.
        run_bench(BenchCollectivesArgs {
            workers: vec![4],
            hierarchical: true,
            ranks_per_host: 2,
            rounds: 2,
            sizes: vec!["4K".into(), "1000".into()],
            ..args
        })
        .unwrap();
    }
}
