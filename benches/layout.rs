//! Criterion benches of the layout manager: an uncached optimal search per
//! pair, a cached lookup, and a 50x50 resharding-cost matrix.
//! Targets (issue 2): <= 10 us per uncached pair, <= 100 ns per cached lookup.

use std::hint::black_box;

use automap::{
    enumerate_specs, layout_context, optimal_path, DeviceMesh, LayoutContext, LayoutProblem,
    ShardingSpec,
};
use criterion::{criterion_group, criterion_main, Criterion};

/// A fixed pseudo-random sample of pairs (xorshift, no extra dependency).
fn sample_pairs(specs: &[ShardingSpec], n: usize) -> Vec<(ShardingSpec, ShardingSpec)> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x as usize
    };
    (0..n)
        .map(|_| (specs[next() % specs.len()], specs[next() % specs.len()]))
        .collect()
}

fn cases() -> Vec<(&'static str, DeviceMesh, Vec<usize>)> {
    vec![
        (
            "2x2x2 [64,64,64]",
            DeviceMesh::new(
                vec![2, 2, 2],
                None,
                vec![1e-6, 5e-6, 2e-5],
                vec![2e11, 2e10, 1e10],
            )
            .unwrap(),
            vec![64, 64, 64],
        ),
        (
            "4x4 [1024,1024,64]",
            DeviceMesh::new(vec![4, 4], None, vec![2e-6, 1e-5], vec![1e11, 1.25e10]).unwrap(),
            vec![1024, 1024, 64],
        ),
    ]
}

fn bench_layout(c: &mut Criterion) {
    for (name, mesh, shape) in cases() {
        let problem = LayoutProblem::new(&mesh, &shape, 4).unwrap();
        let specs = enumerate_specs(&shape, mesh.shape()).unwrap();
        let pairs = sample_pairs(&specs, 256);
        let mut i = 0;
        c.bench_function(
            &format!("uncached pair {name} ({} specs)", specs.len()),
            |b| {
                b.iter(|| {
                    let (s, d) = pairs[i % pairs.len()];
                    i += 1;
                    black_box(optimal_path(&problem, s, d))
                })
            },
        );

        let ctx = layout_context(&mesh, &shape, 4).unwrap();
        for (s, d) in &pairs {
            ctx.path(s, d).unwrap();
        }
        let mut j = 0;
        c.bench_function(&format!("cached lookup {name}"), |b| {
            b.iter(|| {
                let (s, d) = &pairs[j % pairs.len()];
                j += 1;
                black_box(ctx.path(s, d).unwrap())
            })
        });

        let rows: Vec<ShardingSpec> = sample_pairs(&specs, 50).into_iter().map(|p| p.0).collect();
        let cols: Vec<ShardingSpec> = sample_pairs(&specs, 50).into_iter().map(|p| p.1).collect();
        c.bench_function(&format!("50x50 matrix uncached {name}"), |b| {
            b.iter(|| {
                let fresh = LayoutContext::new(problem.clone());
                black_box(fresh.cost_matrix(&rows, &cols).unwrap())
            })
        });
        c.bench_function(&format!("50x50 matrix cached {name}"), |b| {
            b.iter(|| black_box(ctx.cost_matrix(&rows, &cols).unwrap()))
        });
    }
}

criterion_group!(benches, bench_layout);
criterion_main!(benches);
