//! Criterion benches of the rotor checkpointing solver (issue 6, acceptance
//! 4): L stages, M memory slots. Targets: <= 20 ms for L=100/M=500 and
//! <= 2 s for L=400/M=500 (the original MAP C solver: 2.3 s and 117 s).
//! The budget sits between the least feasible budget and the peak of saving
//! everything, so that the schedule has to recompute.

use std::hint::black_box;
use std::time::Duration;

use automap::checkpoint::rotor::{
    example_chain as bench_chain, min_budget_bytes, simulate, solve, solve_with_threads, Chain, Op,
};
use criterion::{criterion_group, criterion_main, Criterion};

/// A budget 40 % of the way from the least feasible one to saving everything.
pub fn bench_budget(chain: &Chain) -> u64 {
    let l = chain.len();
    let store_all: Vec<Op> = (0..l)
        .map(Op::ForwardSaveAll)
        .chain((0..l).rev().map(Op::Backward))
        .collect();
    let max = simulate(chain, &store_all).unwrap().peak_memory_bytes;
    let min = min_budget_bytes(chain);
    min + (max - min) * 2 / 5
}

fn bench_rotor(c: &mut Criterion) {
    let mut group = c.benchmark_group("rotor");
    group.sample_size(10);
    for (len, slots) in [(100, 500), (400, 500)] {
        let chain = bench_chain(len).expect("a chain of at least one stage");
        let budget = bench_budget(&chain);
        let sch = solve(&chain, budget, slots).unwrap();
        eprintln!(
            "L={len} M={slots}: budget {:.2} GiB, peak {:.2} GiB, {:.4} s ({:.1} % recompute)",
            budget as f64 / (1u64 << 30) as f64,
            sch.peak_memory_bytes as f64 / (1u64 << 30) as f64,
            sch.predicted_time_s,
            100.0 * sch.recompute_time_s() / sch.no_recompute_time_s
        );
        if len >= 400 {
            group.measurement_time(Duration::from_secs(20));
        }
        group.bench_function(format!("solve L={len} M={slots}"), |b| {
            b.iter(|| black_box(solve(&chain, budget, slots).unwrap()))
        });
        group.bench_function(
            format!("solve L={len} M={slots} by length 2 threads"),
            |b| b.iter(|| black_box(solve_with_threads(&chain, budget, slots, 2).unwrap())),
        );
    }
    group.finish();
}

criterion_group!(benches, bench_rotor);
criterion_main!(benches);
