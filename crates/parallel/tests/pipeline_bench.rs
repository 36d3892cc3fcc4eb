//! The measurements of `docs/pipeline.md` (ignored by default: they take minutes and their
//! timings need a quiet machine). Run all of them with
//! `cargo test --release -p meshtrain-parallel --test pipeline_bench -- --ignored --nocapture`
//! or some with `MESHTRAIN_BENCH_PARTS=bubble-synthetic,bubble-gpt,memory,equivalence`;
//! `MESHTRAIN_BENCH_QUICK=1` makes it a smoke test; `MESHTRAIN_TRACE_DIR=dir` also writes
//! Chrome traces of GPipe, 1F1B and interleaved (p = 4, m = 8) there.

use meshtrain_parallel::pipeline::measure::{run, write_example_traces, Part};

#[test]
#[ignore = "measurement, prints the docs/pipeline.md tables"]
fn pipeline_measurements() {
    let quick = std::env::var("MESHTRAIN_BENCH_QUICK").is_ok();
    let parts: Vec<Part> = match std::env::var("MESHTRAIN_BENCH_PARTS") {
        Err(_) => Part::ALL.to_vec(),
        Ok(list) => list
            .split(',')
            .map(|p| match p.trim() {
                "bubble-synthetic" => Part::BubbleSynthetic,
                "bubble-gpt" => Part::BubbleGpt,
                "memory" => Part::Memory,
                "equivalence" => Part::Equivalence,
                other => panic!("unknown part {other}"),
            })
            .collect(),
    };
    println!("{}", run(&parts, quick).unwrap());
    if let Ok(dir) = std::env::var("MESHTRAIN_TRACE_DIR") {
        for path in write_example_traces(std::path::Path::new(&dir)).unwrap() {
            println!("wrote {}", path.display());
        }
    }
}
