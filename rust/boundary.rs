//! Property tests of the boundary: every function the Python bindings call,
//! fed arbitrary input (huge, zero, non-finite, out of range, malformed),
//! returns Ok or a typed error and never panics. A panic fails the property.

use proptest::prelude::*;

use crate::checkpoint::linearize::{linearize, LinearNode};
use crate::checkpoint::rotor::{self, Chain, Stage};
use crate::sharding::enumerate::enumerate_specs;
use crate::sharding::layout::heuristic::heuristic_path;
use crate::sharding::layout::layout_context;
use crate::sharding::mesh::{Collective, DeviceMesh};
use crate::sharding::spec::ShardingSpec;
use crate::solve::blocks::{detect_blocks, BlockNode};
use crate::solve::strategy::einsum::{einsum_strategies, CostModel, EinsumSignature};
use crate::solve::strategy::reshape::reshape_strategies;

/// Sizes that reach the edges: 0, 1, small, and values near overflow.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 0usize..9,
        2 => Just(1usize << 31),
        1 => Just(1usize << 62),
        1 => Just(usize::MAX),
        1 => any::<usize>(),
    ]
}

fn float() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => 0.0f64..1e3,
        1 => Just(f64::NAN),
        1 => Just(f64::INFINITY),
        1 => Just(-1.0),
        1 => Just(1e300),
        1 => Just(f64::MIN_POSITIVE),
        1 => any::<f64>(),
    ]
}

/// Small valid meshes (so the searches stay quick) with arbitrary links.
fn mesh() -> impl Strategy<Value = DeviceMesh> {
    prop::collection::vec(1usize..5, 1..4).prop_filter_map("valid links", |shape| {
        DeviceMesh::uniform(shape, 1e-5, 1e9).ok()
    })
}

/// Spec strings over a small alphabet: valid and invalid ones.
fn spec_text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            Just("R"),
            Just("S"),
            Just("0"),
            Just("1"),
            Just("2"),
            Just("9"),
            Just("x")
        ],
        0..8,
    )
    .prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn meshes_never_panic(shape in prop::collection::vec(size(), 0..10),
                          ranks in prop::option::of(prop::collection::vec(any::<i64>(), 0..20)),
                          alpha in prop::collection::vec(float(), 0..10),
                          bw in prop::collection::vec(float(), 0..10),
                          coord in prop::collection::vec(size(), 0..5),
                          axes in prop::collection::vec(0usize..10, 0..4),
                          bytes in float(), rank in any::<i64>()) {
        if let Ok(m) = DeviceMesh::new(shape, ranks, alpha, bw) {
            let _ = m.rank_at(&coord);
            let _ = m.coordinate(rank);
            let _ = m.axis_groups(&axes);
            for kind in [Collective::AllReduce, Collective::AllGather, Collective::AllToAll] {
                let _ = m.collective_cost_s(kind, bytes, &axes);
                let _ = m.collective_plan(kind, bytes, &axes);
            }
        }
    }

    #[test]
    fn specs_never_panic(text in spec_text(), dims in prop::collection::vec(
                             prop::collection::vec(0usize..12, 0..3), 0..40),
                         shape in prop::collection::vec(size(), 0..6),
                         m in mesh(), rank in any::<i64>()) {
        for spec in [ShardingSpec::parse(&text), ShardingSpec::from_dims(&dims)]
            .into_iter()
            .flatten()
        {
            let _ = spec.validate(&shape, &m);
            let _ = spec.checked_shard_count(m.shape());
            let _ = spec.local_shape(&shape, &m);
            let _ = spec.local_slices(&shape, &m, rank);
        }
        let _ = ShardingSpec::replicated(dims.len());
    }

    #[test]
    fn layouts_never_panic(m in mesh(), shape in prop::collection::vec(size(), 0..5),
                           dtype in size(), a in spec_text(), b in spec_text()) {
        let (Ok(src), Ok(dst)) = (ShardingSpec::parse(&a), ShardingSpec::parse(&b)) else {
            return Ok(());
        };
        if let Ok(ctx) = layout_context(&m, &shape, dtype) {
            let _ = ctx.path(&src, &dst);
            let _ = ctx.cost_matrix(&[src, dst], &[dst, src]);
            if ctx.problem().validate(&src).is_ok() && ctx.problem().validate(&dst).is_ok() {
                prop_assert!(heuristic_path(ctx.problem(), src, dst).is_ok());
            }
        }
    }

    #[test]
    fn enumeration_and_views_never_panic(shape in prop::collection::vec(size(), 0..5),
                                         out in prop::collection::vec(size(), 0..5),
                                         m in mesh()) {
        let _ = enumerate_specs(&shape, m.shape());
        let _ = reshape_strategies(&shape, &out, m.shape());
    }

    #[test]
    fn strategies_never_panic(letters in prop::collection::vec(size(), 0..5),
                              unshardable in prop::collection::vec(any::<bool>(), 0..5),
                              inputs in prop::collection::vec(
                                  prop::collection::vec(0usize..6, 0..4), 0..3),
                              outputs in prop::collection::vec(
                                  prop::collection::vec(0usize..6, 0..4), 0..3),
                              bytes in prop::collection::vec(float(), 0..6),
                              flags in prop::collection::vec(any::<bool>(), 0..6),
                              flops in float(), flops_per_s in float(),
                              memory_bandwidth in float(), op_overhead_s in float(),
                              is_view in any::<bool>(), m in mesh()) {
        let n_in = inputs.len();
        let take = |v: &[f64], n: usize| v.iter().copied().cycle().take(n).collect::<Vec<_>>();
        let sig = EinsumSignature {
            unshardable: if unshardable.len() == letters.len() {
                unshardable
            } else {
                vec![false; letters.len()]
            },
            letter_sizes: letters,
            input_bytes: if bytes.is_empty() { vec![] } else { take(&bytes, n_in) },
            output_bytes: if bytes.is_empty() { vec![] } else { take(&bytes, outputs.len()) },
            input_needs_grad: flags.iter().copied().cycle().take(n_in).collect(),
            input_additive: flags.iter().rev().copied().cycle().take(n_in).collect(),
            inputs,
            outputs,
            flops,
            is_view,
        };
        let cost = CostModel {
            mesh_shape: m.shape().to_vec(),
            alpha_s: m.alpha_s().to_vec(),
            bandwidth_bytes_per_s: m.bandwidth_bytes_per_s().to_vec(),
            flops_per_s,
            memory_bandwidth_bytes_per_s: memory_bandwidth,
            op_overhead_s,
            reduce_scatter_as_all_reduce: flops_per_s > 1e12,
        };
        let _ = einsum_strategies(&sig, &cost);
    }

    #[test]
    fn graphs_never_panic(parents in prop::collection::vec(
                              prop::collection::vec(0usize..12, 0..3), 0..10),
                          paths in prop::collection::vec(
                              prop_oneof![Just("h.0"), Just("h.1"), Just("h.1.fc"), Just(""),
                                          Just("h.99999999999999999999999"), Just("0.x")], 1..4)) {
        let nodes: Vec<LinearNode> = parents
            .iter()
            .map(|p| LinearNode { parents: p.clone(), ..LinearNode::default() })
            .collect();
        let _ = linearize(&nodes);
        let blocks: Vec<BlockNode> = parents
            .iter()
            .enumerate()
            .map(|(i, p)| BlockNode {
                key: format!("k{}", i % 2),
                shape_key: "s".into(),
                module_path: paths[i % paths.len()].into(),
                inputs: p.clone(),
            })
            .collect();
        let _ = detect_blocks(&blocks);
    }

    #[test]
    fn rotor_never_panics(times in prop::collection::vec(float(), 1..16),
                          sizes in prop::collection::vec(
                              prop_oneof![0u64..100, Just(u64::MAX), Just(1u64 << 62)], 1..16),
                          len in 1usize..5, budget in prop_oneof![0u64..400, Just(u64::MAX)],
                          slots in prop_oneof![0usize..300, Just(usize::MAX)]) {
        let t = |k: usize| times[k % times.len()];
        let b = |k: usize| sizes[k % sizes.len()];
        let stages = (0..len)
            .map(|k| Stage {
                fwd_compute_s: t(4 * k),
                fwd_comm_s: t(4 * k + 1),
                bwd_compute_s: t(4 * k + 2),
                bwd_comm_s: t(4 * k + 3),
                fwd_tmp_bytes: b(5 * k),
                out_bytes: b(5 * k + 1),
                saved_bytes: b(5 * k + 1).saturating_add(b(5 * k + 2)),
                bwd_tmp_bytes: b(5 * k + 3),
                out_grad_bytes: b(5 * k + 4),
                ..Stage::default()
            })
            .collect();
        if let Ok(chain) = Chain::new(stages, b(7), b(8)) {
            let _ = rotor::solve(&chain, budget, slots.min(1 << 21));
        }
    }
}

#[test]
fn the_reported_panics_are_typed_errors() {
    use crate::AutomapError;
    // A shard count on a mesh without the spec's axis.
    let one_axis = DeviceMesh::uniform(vec![2], 1e-5, 1e9).unwrap();
    let s3 = ShardingSpec::parse("S3").unwrap();
    assert!(matches!(
        s3.checked_shard_count(one_axis.shape()),
        Err(AutomapError::InvalidSpec(_))
    ));
    // Enumeration of a 32-dim tensor.
    assert!(matches!(
        enumerate_specs(&[2; 32], &[2]),
        Err(AutomapError::InvalidArgument(_))
    ));
    // Stage times above f32::MAX.
    let stage = |t: f64| Stage {
        fwd_compute_s: t,
        bwd_compute_s: 1.0,
        out_bytes: 10,
        saved_bytes: 20,
        out_grad_bytes: 10,
        ..Stage::default()
    };
    let e = Chain::new(vec![stage(1e39), stage(1e39), stage(1e39)], 10, 0).unwrap_err();
    assert!(e.to_string().contains("stage times add up"), "{e}");
    // A block node reading a node that does not exist.
    let node = BlockNode {
        key: "a".into(),
        shape_key: "a".into(),
        module_path: "h.0".into(),
        inputs: vec![5],
    };
    assert!(matches!(
        detect_blocks(&[node]),
        Err(AutomapError::InvalidArgument(_))
    ));
    // Byte counts past 2^64: [2^62, 2] float32.
    let e = layout_context(&one_axis, &[1 << 62, 2], 4).err().unwrap();
    assert!(matches!(e, AutomapError::LimitExceeded(_)), "{e}");
}
